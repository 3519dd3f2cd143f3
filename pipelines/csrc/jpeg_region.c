/*
 * One region of a JPEG decoded to RGB8 with libjpeg-turbo: the rows above the region
 * are entropy-decoded and skipped (no IDCT, upsampling or colour conversion), only the
 * iMCU columns that hold the region are reconstructed, and decoding stops after the
 * region's last row. Optionally at 1/2, 1/4 or 1/8 scale (the reduced IDCTs).
 *
 * Called from pipelines/src/transform/libjpeg.rs. libjpeg reports fatal errors through
 * `error_exit`, which must not return: it jumps back here, so no unwinding ever crosses
 * the Rust boundary. A premature end of the data, a warning to libjpeg, is an error here.
 */
#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>
#include <jerror.h>

#if !defined(LIBJPEG_TURBO_VERSION_NUMBER) || LIBJPEG_TURBO_VERSION_NUMBER < 1005000
#error "libjpeg-turbo 1.5 or later is needed (jpeg_crop_scanline, jpeg_skip_scanlines)"
#endif

enum {
    IMGRUN_JPEG_OK = 0,
    IMGRUN_JPEG_UNSUPPORTED = 1,
    IMGRUN_JPEG_ERROR = 2,
    IMGRUN_JPEG_SMALL_BUFFER = 3,
};

/* Mirrored by `Region` in libjpeg.rs. */
struct imgrun_jpeg_region {
    /* The whole image at the decoded scale. */
    uint32_t full_width, full_height;
    /* The first column and row written, at the decoded scale. */
    uint32_t left, top;
    /* What was written: `rows` rows of `columns` RGB8 pixels, packed. */
    uint32_t columns, rows;
    /* Bytes `out` must hold (set when the call returns IMGRUN_JPEG_SMALL_BUFFER). */
    size_t needed;
};

struct imgrun_jpeg_error {
    struct jpeg_error_mgr mgr;
    jmp_buf jump;
    char *message;
    size_t message_len;
};

static void imgrun_jpeg_fail(j_common_ptr cinfo) {
    struct imgrun_jpeg_error *err = (struct imgrun_jpeg_error *)cinfo->err;
    char text[JMSG_LENGTH_MAX];
    err->mgr.format_message(cinfo, text);
    snprintf(err->message, err->message_len, "%s", text);
    longjmp(err->jump, 1);
}

/* Warnings are ignored (as PIL does), except data that ends early. */
static void imgrun_jpeg_message(j_common_ptr cinfo, int level) {
    if (level < 0 && cinfo->err->msg_code == JWRN_JPEG_EOF) {
        imgrun_jpeg_fail(cinfo);
    }
}

static uint32_t imgrun_div_ceil(uint32_t a, uint32_t b) { return a / b + (a % b != 0); }

/*
 * Decodes the declared-pixel box [left, right) x [top, bottom) (clamped to the image) at
 * 1/denominator scale into `out`. The columns written start at or left of the box and
 * end at or right of it (whole iMCUs); the rows written are exactly the box's, scaled.
 */
int imgrun_jpeg_decode_region(const unsigned char *data, unsigned long len,
                              unsigned denominator, uint32_t left, uint32_t top,
                              uint32_t right, uint32_t bottom, unsigned char *out,
                              size_t out_len, struct imgrun_jpeg_region *region,
                              char *message, size_t message_len) {
    struct jpeg_decompress_struct cinfo;
    struct imgrun_jpeg_error err;
    /* volatile: read after a longjmp. */
    volatile int status = IMGRUN_JPEG_ERROR;
    memset(&cinfo, 0, sizeof cinfo);
    cinfo.err = jpeg_std_error(&err.mgr);
    err.mgr.error_exit = imgrun_jpeg_fail;
    err.mgr.emit_message = imgrun_jpeg_message;
    err.message = message;
    err.message_len = message_len;
    if (message_len > 0) {
        message[0] = '\0';
    }
    if (setjmp(err.jump)) {
        int code = err.mgr.msg_code;
        jpeg_destroy_decompress(&cinfo);
        /* Sample precisions and frame types this 8-bit build lacks: another decoder may
         * have them. */
        if (code == JERR_BAD_PRECISION || code == JERR_SOF_UNSUPPORTED) {
            return IMGRUN_JPEG_UNSUPPORTED;
        }
        return IMGRUN_JPEG_ERROR;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, data, len);
    jpeg_read_header(&cinfo, TRUE);
    if (cinfo.jpeg_color_space != JCS_YCbCr && cinfo.jpeg_color_space != JCS_GRAYSCALE &&
        cinfo.jpeg_color_space != JCS_RGB) {
        /* CMYK and YCCK: libjpeg-turbo 2 has no conversion to RGB. */
        jpeg_destroy_decompress(&cinfo);
        return IMGRUN_JPEG_UNSUPPORTED;
    }
    cinfo.out_color_space = JCS_RGB;
    cinfo.dct_method = JDCT_ISLOW;
    cinfo.scale_num = 1;
    cinfo.scale_denom = denominator;
    jpeg_start_decompress(&cinfo);

    uint32_t width = cinfo.output_width, height = cinfo.output_height;
    uint32_t d = denominator == 0 ? 1 : denominator;
    uint32_t x0 = left / d, y0 = top / d;
    uint32_t x1 = imgrun_div_ceil(right, d), y1 = imgrun_div_ceil(bottom, d);
    if (x1 > width) x1 = width;
    if (y1 > height) y1 = height;
    if (x0 >= x1 || y0 >= y1) {
        snprintf(message, message_len, "empty region");
        jpeg_destroy_decompress(&cinfo);
        return IMGRUN_JPEG_ERROR;
    }
    JDIMENSION xoffset = x0, columns = x1 - x0;
    if (columns < width) {
        jpeg_crop_scanline(&cinfo, &xoffset, &columns);
    }
    uint32_t rows = y1 - y0;
    size_t stride = (size_t)columns * 3;
    region->full_width = width;
    region->full_height = height;
    region->left = xoffset;
    region->top = y0;
    region->columns = columns;
    region->rows = rows;
    region->needed = stride * rows;
    if (out_len < region->needed) {
        jpeg_destroy_decompress(&cinfo);
        return IMGRUN_JPEG_SMALL_BUFFER;
    }
    if (y0 > 0 && jpeg_skip_scanlines(&cinfo, y0) != y0) {
        snprintf(message, message_len, "could not skip to row %u", (unsigned)y0);
        jpeg_destroy_decompress(&cinfo);
        return IMGRUN_JPEG_ERROR;
    }
    while (cinfo.output_scanline < y1) {
        JSAMPROW row = out + (size_t)(cinfo.output_scanline - y0) * stride;
        if (jpeg_read_scanlines(&cinfo, &row, 1) != 1) {
            snprintf(message, message_len, "no scanline %u", (unsigned)cinfo.output_scanline);
            jpeg_destroy_decompress(&cinfo);
            return IMGRUN_JPEG_ERROR;
        }
    }
    status = IMGRUN_JPEG_OK;
    /* The rest of the image is not needed: abort rather than finish. */
    jpeg_destroy_decompress(&cinfo);
    return status;
}
