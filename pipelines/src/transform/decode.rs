//! JPEG and PNG bytes to RGB8: header checks before allocation, reduced-scale JPEG,
//! and for the transforms only the region a crop needs.
//!
//! Full-size JPEG goes straight to zune-jpeg (the fastest pure-Rust decoder; through
//! `image` it would copy the input, parse the headers twice and zero the output);
//! reduced-size JPEG through `jpeg-decoder`, whose IDCT can output 1/2, 1/4 or 1/8 of
//! the image directly (zune-jpeg cannot; see `scale_denominator` for which are used).
//! PNG goes through `image` (the `png` crate). Entropy decoding is most of a JPEG's
//! time and is sequential, so rows above a crop must be entropy-decoded. The transforms
//! call [`decode_area`]: with libjpeg-turbo (`libjpeg.rs`) those rows and the columns
//! beside the crop are never reconstructed (no IDCT, upsampling or colour conversion);
//! without it, zune-jpeg stops below the crop ([`decode_top`]).

use std::io::Cursor;

use image::{DynamicImage, RgbImage};

use super::{DecodeLimits, ImageFormat, ImageHeader, PixelBox, TransformError};

/// Reads the format and declared size of an image without decoding pixels, and checks
/// them: no zero dimension, no more than `limits.max_pixels` pixels.
pub fn read_header(bytes: &[u8], limits: &DecodeLimits) -> Result<ImageHeader, TransformError> {
    let format = sniff(bytes)?;
    let (width, height) = match format {
        ImageFormat::Png => png_dimensions(bytes)?,
        ImageFormat::Jpeg => {
            let mut decoder = jpeg_decoder::Decoder::new(bytes);
            decoder.read_info().map_err(|e| jpeg_error(&e))?;
            let info = decoder.info().ok_or_else(|| TransformError::Undecodable {
                format,
                reason: "no frame header".into(),
            })?;
            (u32::from(info.width), u32::from(info.height))
        }
    };
    if width == 0 || height == 0 {
        return Err(TransformError::ZeroSized {
            format,
            width,
            height,
        });
    }
    if u64::from(width) * u64::from(height) > limits.max_pixels {
        return Err(TransformError::TooLarge {
            format,
            width,
            height,
            max_pixels: limits.max_pixels,
        });
    }
    Ok(ImageHeader {
        format,
        width,
        height,
    })
}

/// Decodes JPEG or PNG bytes into RGB8 (grey is expanded, alpha dropped).
///
/// With `min_side_hint`, a JPEG may be decoded at 1/4 or 1/8 of its size: the smallest
/// scale whose shorter side is still at least the hint. Without it, or for PNG,
/// the image comes back at full size.
pub fn decode_rgb(
    bytes: &[u8],
    min_side_hint: Option<u32>,
    limits: &DecodeLimits,
) -> Result<RgbImage, TransformError> {
    let header = read_header(bytes, limits)?;
    let denominator = match min_side_hint {
        Some(min_side) => scale_denominator(&header, min_side),
        None => 1,
    };
    decode_checked(bytes, &header, denominator)
}

/// The largest JPEG reduction (8 or 4) that keeps the shorter side at least `min_side`,
/// else 1 (full size). Always 1 for formats without scaled decoding.
///
/// No 1/2: measured on 500x375 and 2400x1800 photos, `jpeg-decoder` at 1/2 is slower
/// than zune-jpeg at full size, by more than the smaller resample saves; at 1/4 and 1/8
/// it costs about what zune-jpeg's full decode does and the resample gets far cheaper.
pub(crate) fn scale_denominator(header: &ImageHeader, min_side: u32) -> u32 {
    if header.format != ImageFormat::Jpeg {
        return 1;
    }
    let short = header.width.min(header.height);
    [8, 4]
        .into_iter()
        .find(|&d| short.div_ceil(d) >= min_side.max(1))
        .unwrap_or(1)
}

/// The reduction for [`decode_area`]: as [`scale_denominator`], and with libjpeg-turbo
/// also 1/2, whose 4x4 IDCT pays where `jpeg-decoder`'s does not: the f32 train
/// transform on the shared 1411x1411 photo (re-encoded at quality 90, 4:2:0) took 2.60
/// to 2.62 ms an image against 2.80 to 2.81 with 1/2 left out; on the 1000x872 one few
/// crops are large enough for it.
pub(crate) fn area_scale_denominator(header: &ImageHeader, min_side: u32) -> u32 {
    let denominator = scale_denominator(header, min_side);
    let short = header.width.min(header.height);
    // With room to spare: a 1/2 IDCT is sharper than the bilinear filter, so the
    // resample after it must still shrink by 1.5 or more to match a full-size decode
    // (the augment tests' mean absolute error on the shared photos).
    let halved = short.div_ceil(2) >= min_side.max(1).saturating_mul(3) / 2;
    if cfg!(imgrun_libjpeg) && denominator == 1 && header.format == ImageFormat::Jpeg && halved {
        2
    } else {
        denominator
    }
}

/// Buffers a thread keeps from image to image, so that the transforms' decoding
/// neither allocates nor zeroes memory once they are large enough.
#[derive(Debug, Default)]
pub(crate) struct DecodeBuffers {
    /// RGB8 pixels of the last image, `Frame::width * Frame::height * 3` at the start.
    pub pixels: Vec<u8>,
    /// A copy of the input whose frame header was changed.
    input: Vec<u8>,
}

/// What [`decode_top`] or [`decode_area`] left in [`DecodeBuffers::pixels`]: `height`
/// rows of `width` RGB8 pixels, a window of the whole image at the decoded scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Frame {
    pub width: u32,
    pub height: u32,
    /// The size the whole image has at the decoded scale: more than `width` and `height`
    /// when only part of it was decoded.
    pub full_width: u32,
    pub full_height: u32,
    /// Where the window's first pixel lies in the whole image at the decoded scale.
    pub left: u32,
    pub top: u32,
}

/// Decodes at least `area` (declared pixels) of an image whose header has been checked
/// into `buffers.pixels`, reduced by `denominator` (1, 2, 4 or 8; JPEG only), as little
/// else as the decoder allows.
///
/// JPEG goes through libjpeg-turbo where the build found it (see `libjpeg.rs`): only
/// the iMCU columns and rows of `area` are reconstructed. Otherwise, and for CMYK JPEG
/// and PNG, this is [`decode_top`] down to `area.bottom`.
pub(crate) fn decode_area(
    bytes: &[u8],
    header: &ImageHeader,
    denominator: u32,
    area: PixelBox,
    buffers: &mut DecodeBuffers,
) -> Result<Frame, TransformError> {
    #[cfg(imgrun_libjpeg)]
    if header.format == ImageFormat::Jpeg {
        let region =
            super::libjpeg::decode_region(bytes, header, denominator, area, &mut buffers.pixels)?;
        if let Some(region) = region {
            return Ok(Frame {
                width: region.columns,
                height: region.rows,
                full_width: region.full_width,
                full_height: region.full_height,
                left: region.left,
                top: region.top,
            });
        }
    }
    decode_top(bytes, header, denominator, area.bottom, buffers)
}

/// Decodes an image whose header has been checked into `buffers.pixels`, reduced by
/// `denominator` (1, 2, 4 or 8; JPEG only), keeping at least the top `rows` rows of the
/// declared image.
///
/// A sequential JPEG (baseline or extended Huffman, as nearly every photo) stores its
/// MCU rows top to bottom, so decoding stops after the MCU row that holds `rows` plus a
/// margin: the frame header's height is lowered in a copy of the bytes and the decoder
/// never reads what lies below. The margin keeps the rows above it identical to a full
/// decode (chroma upsampling reads the next MCU row). Other images decode whole.
pub(crate) fn decode_top(
    bytes: &[u8],
    header: &ImageHeader,
    denominator: u32,
    rows: u32,
    buffers: &mut DecodeBuffers,
) -> Result<Frame, TransformError> {
    // One row of the tallest MCU (16 pixels) of the decoded scale: the rows above it are
    // then upsampled as in the whole image.
    let margin = 16 * denominator.max(1);
    let kept = rows.saturating_add(margin);
    let height_at = match header.format {
        ImageFormat::Jpeg if kept < header.height => sequential_height_offset(bytes),
        _ => None,
    };
    let (bytes, cut_header) = match height_at {
        Some(at) => {
            let input = &mut buffers.input;
            input.clear();
            input.extend_from_slice(bytes);
            // `kept < header.height <= u16::MAX` for a JPEG.
            let kept16 = u16::try_from(kept).unwrap_or(u16::MAX);
            input[at..at + 2].copy_from_slice(&kept16.to_be_bytes());
            let cut = ImageHeader {
                height: kept,
                ..*header
            };
            (input.as_slice(), cut)
        }
        None => (bytes, *header),
    };
    let (width, height) = if header.format == ImageFormat::Jpeg && denominator == 1 {
        decode_jpeg_into(bytes, &cut_header, &mut buffers.pixels)?
    } else {
        let image = decode_checked(bytes, &cut_header, denominator)?;
        let size = image.dimensions();
        buffers.pixels = image.into_raw();
        size
    };
    // A scaled decode may have fallen back to full size.
    let actual = if width == header.width {
        1
    } else {
        denominator
    };
    Ok(Frame {
        width,
        height,
        full_width: width,
        full_height: header.height.div_ceil(actual),
        left: 0,
        top: 0,
    })
}

/// Decodes an image whose header has been checked, reduced by `denominator` (1, 2, 4 or
/// 8; JPEG only). The result is `ceil(width / d) x ceil(height / d)`.
pub(crate) fn decode_checked(
    bytes: &[u8],
    header: &ImageHeader,
    denominator: u32,
) -> Result<RgbImage, TransformError> {
    let format = header.format;
    let undecodable = |e: image::ImageError| TransformError::Undecodable {
        format,
        reason: e.to_string(),
    };
    let image = match format {
        ImageFormat::Png => {
            let decoder =
                image::codecs::png::PngDecoder::new(Cursor::new(bytes)).map_err(undecodable)?;
            DynamicImage::from_decoder(decoder).map_err(undecodable)?
        }
        ImageFormat::Jpeg if denominator > 1 => {
            if let Some(image) = decode_jpeg_scaled(bytes, header, denominator)? {
                return Ok(image);
            }
            return decode_checked(bytes, header, 1);
        }
        ImageFormat::Jpeg => return decode_jpeg(bytes, header),
    };
    Ok(image.into_rgb8())
}

/// Full-size decoding with zune-jpeg, straight to RGB (grey and CMYK are converted).
fn decode_jpeg(bytes: &[u8], header: &ImageHeader) -> Result<RgbImage, TransformError> {
    let mut pixels = Vec::new();
    let (width, height) = decode_jpeg_into(bytes, header, &mut pixels)?;
    RgbImage::from_raw(width, height, pixels).ok_or_else(|| TransformError::Undecodable {
        format: ImageFormat::Jpeg,
        reason: "decoded buffer does not match the frame size".into(),
    })
}

/// Decodes a JPEG at full size into the start of `pixels` as RGB8, growing it when too
/// small (it never shrinks, so a reused buffer is zeroed only when it grows).
fn decode_jpeg_into(
    bytes: &[u8],
    header: &ImageHeader,
    pixels: &mut Vec<u8>,
) -> Result<(u32, u32), TransformError> {
    use zune_core::bytestream::ZCursor;
    use zune_core::colorspace::ColorSpace;
    use zune_core::options::DecoderOptions;
    let undecodable = |reason: String| TransformError::Undecodable {
        format: ImageFormat::Jpeg,
        reason,
    };
    let options = DecoderOptions::default()
        .set_strict_mode(false)
        .set_max_width(header.width as usize)
        .set_max_height(header.height as usize)
        .jpeg_set_out_colorspace(ColorSpace::RGB);
    let mut decoder = zune_jpeg::JpegDecoder::new_with_options(ZCursor::new(bytes), options);
    decoder
        .decode_headers()
        .map_err(|e| undecodable(e.to_string()))?;
    let size = decoder.dimensions().zip(decoder.output_buffer_size());
    let Some(((width, height), len)) = size else {
        return Err(undecodable("no frame header".into()));
    };
    if decoder.output_colorspace() != Some(ColorSpace::RGB) || len != width * height * 3 {
        return Err(undecodable("no RGB conversion for its colour space".into()));
    }
    if pixels.len() < len {
        pixels.resize(len, 0);
    }
    decoder
        .decode_into(&mut pixels[..len])
        .map_err(|e| undecodable(e.to_string()))?;
    // Both are at most `u16::MAX` in a JPEG frame header.
    let side = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
    Ok((side(width), side(height)))
}

/// Scaled decoding with `jpeg-decoder`; `None` for what it does not support or leaves
/// unconverted (CMYK, 16-bit grey), which the full-size path then handles.
fn decode_jpeg_scaled(
    bytes: &[u8],
    header: &ImageHeader,
    denominator: u32,
) -> Result<Option<RgbImage>, TransformError> {
    let mut decoder = jpeg_decoder::Decoder::new(bytes);
    // The header check bounds the pixels; this bounds what the decoder may allocate.
    let pixels = u64::from(header.width) * u64::from(header.height);
    decoder.set_max_decoding_buffer_size(usize::try_from(pixels * 4).unwrap_or(usize::MAX));
    // `scale` picks the smallest IDCT size reaching the request in one axis; asking for
    // exactly ceil(len / d) selects 1/d.
    let want = |len: u32| u16::try_from(len.div_ceil(denominator)).unwrap_or(u16::MAX);
    let scaled = decoder
        .scale(want(header.width), want(header.height))
        .and_then(|size| decoder.decode().map(|data| (size, data)));
    let ((width, height), data) = match scaled {
        Ok(decoded) => decoded,
        // Features zune-jpeg may still handle (e.g. some progressive or 12-bit files).
        Err(jpeg_decoder::Error::Unsupported(_)) => return Ok(None),
        Err(e) => return Err(jpeg_error(&e)),
    };
    let format = decoder.info().map(|i| i.pixel_format);
    let rgb = match format {
        Some(jpeg_decoder::PixelFormat::RGB24) => data,
        Some(jpeg_decoder::PixelFormat::L8) => data.iter().flat_map(|&v| [v, v, v]).collect(),
        _ => return Ok(None),
    };
    RgbImage::from_raw(u32::from(width), u32::from(height), rgb)
        .map(Some)
        .ok_or_else(|| TransformError::Undecodable {
            format: ImageFormat::Jpeg,
            reason: "decoded buffer does not match the frame size".into(),
        })
}

/// Where the frame header of a sequential Huffman JPEG (SOF0 or SOF1) holds the image
/// height, as a byte offset; `None` for any other frame type (progressive, lossless,
/// arithmetic) or markers that do not parse before the frame header.
fn sequential_height_offset(bytes: &[u8]) -> Option<usize> {
    let mut at = 2; // Past SOI.
    loop {
        if *bytes.get(at)? != 0xFF {
            return None;
        }
        // Any number of 0xFF fill bytes may precede a marker code.
        let mut code_at = at + 1;
        while *bytes.get(code_at)? == 0xFF {
            code_at += 1;
        }
        let code = *bytes.get(code_at)?;
        let length = usize::from(u16::from_be_bytes([
            *bytes.get(code_at + 1)?,
            *bytes.get(code_at + 2)?,
        ]));
        match code {
            // Segment length (2), sample precision (1), then the height.
            0xC0 | 0xC1 => return Some(code_at + 4).filter(|&h| h + 2 <= bytes.len()),
            // Other frame types, or a scan before any frame: decode whole.
            0xC2 | 0xC3 | 0xC5..=0xC7 | 0xC9..=0xCB | 0xCD..=0xCF | 0xDA => return None,
            _ if length < 2 => return None,
            _ => at = code_at + 1 + length,
        }
    }
}

fn sniff(bytes: &[u8]) -> Result<ImageFormat, TransformError> {
    const PNG_SIGNATURE: [u8; 8] = [0x89, b'P', b'N', b'G', 0x0D, 0x0A, 0x1A, 0x0A];
    if bytes.is_empty() {
        Err(TransformError::Empty)
    } else if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
        Ok(ImageFormat::Jpeg)
    } else if bytes.starts_with(&PNG_SIGNATURE) {
        Ok(ImageFormat::Png)
    } else {
        Err(TransformError::UnsupportedFormat {
            magic: bytes.iter().take(8).copied().collect(),
        })
    }
}

/// Width and height from a PNG's IHDR chunk, which must come first.
fn png_dimensions(bytes: &[u8]) -> Result<(u32, u32), TransformError> {
    let be32 = |at: usize| {
        bytes
            .get(at..at + 4)
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map(u32::from_be_bytes)
    };
    let ihdr = bytes.get(12..16) == Some(b"IHDR".as_slice());
    match (ihdr, be32(16), be32(20)) {
        (true, Some(width), Some(height)) => Ok((width, height)),
        _ => Err(TransformError::Undecodable {
            format: ImageFormat::Png,
            reason: "missing or truncated IHDR chunk".into(),
        }),
    }
}

fn jpeg_error(error: &jpeg_decoder::Error) -> TransformError {
    TransformError::Undecodable {
        format: ImageFormat::Jpeg,
        reason: error.to_string(),
    }
}

#[cfg(test)]
#[path = "decode_tests.rs"]
pub(crate) mod tests;
