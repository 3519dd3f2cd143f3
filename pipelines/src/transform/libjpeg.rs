//! A region of a JPEG through libjpeg-turbo (`csrc/jpeg_region.c`): rows above the
//! region are entropy-decoded but never reconstructed, only the iMCU columns that hold
//! it are, and decoding stops after its last row. On the loader benchmark's crops this
//! costs about two thirds of a full decode.
//!
//! Built only where `build.rs` found libjpeg-turbo (cfg `imgrun_libjpeg`); elsewhere the
//! transforms use zune-jpeg alone. libjpeg's fatal errors jump back inside the C file,
//! so nothing unwinds across the boundary, and a premature end of data is an error.

use std::ffi::{c_char, c_int, c_uint, c_ulong};

use super::{ImageFormat, ImageHeader, PixelBox, TransformError};

/// What [`decode_region`] wrote; mirrors `struct imgrun_jpeg_region`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Region {
    /// The whole image at the decoded scale.
    pub full_width: u32,
    pub full_height: u32,
    /// Where the first pixel written lies in the whole image, at the decoded scale.
    pub left: u32,
    pub top: u32,
    /// `rows` rows of `columns` RGB8 pixels, packed, at the start of the buffer.
    pub columns: u32,
    pub rows: u32,
    needed: usize,
}

const OK: c_int = 0;
const UNSUPPORTED: c_int = 1;
const SMALL_BUFFER: c_int = 3;

#[allow(unsafe_code)] // The C decoder of `csrc/jpeg_region.c`; its one caller is below.
unsafe extern "C" {
    fn imgrun_jpeg_decode_region(
        data: *const u8,
        len: c_ulong,
        denominator: c_uint,
        left: u32,
        top: u32,
        right: u32,
        bottom: u32,
        out: *mut u8,
        out_len: usize,
        region: *mut Region,
        message: *mut c_char,
        message_len: usize,
    ) -> c_int;
}

/// Decodes `area` of a JPEG whose header has been checked, at 1/`denominator` scale (1,
/// 2, 4 or 8), into the start of `pixels` (grown when too small, never shrunk). The
/// columns written may reach past `area` to whole iMCUs; the rows are `area`'s, scaled
/// outward. `Ok(None)` for what this libjpeg does not decode to RGB: CMYK and YCCK,
/// sample precisions other than 8 bits, lossless and other unsupported frame types.
pub(crate) fn decode_region(
    bytes: &[u8],
    header: &ImageHeader,
    denominator: u32,
    area: PixelBox,
    pixels: &mut Vec<u8>,
) -> Result<Option<Region>, TransformError> {
    debug_assert_eq!(header.format, ImageFormat::Jpeg);
    let undecodable = |reason: String| TransformError::Undecodable {
        format: ImageFormat::Jpeg,
        reason,
    };
    let len = c_ulong::try_from(bytes.len()).map_err(|_| undecodable("too long".into()))?;
    if pixels.is_empty() {
        // A first guess that fits most crops; a larger region grows it below.
        pixels.resize(area_bytes(area), 0);
    }
    // At most two calls: the first says how large the buffer must be.
    for _ in 0..2 {
        let mut region = Region::default();
        let mut message = [0 as c_char; 200];
        #[allow(unsafe_code)] // FFI: the C function reads `len` bytes and writes at most
        // `out_len` bytes to `out`, one `Region` and `message_len` bytes of message.
        let status = unsafe {
            imgrun_jpeg_decode_region(
                bytes.as_ptr(),
                len,
                denominator,
                area.left,
                area.top,
                area.right,
                area.bottom,
                pixels.as_mut_ptr(),
                pixels.len(),
                &mut region,
                message.as_mut_ptr(),
                message.len(),
            )
        };
        match status {
            OK => return Ok(Some(region)),
            UNSUPPORTED => return Ok(None),
            SMALL_BUFFER => pixels.resize(region.needed, 0),
            _ => {
                let text: Vec<u8> = message
                    .iter()
                    .take_while(|&&c| c != 0)
                    .map(|&c| c as u8)
                    .collect();
                return Err(undecodable(String::from_utf8_lossy(&text).into_owned()));
            }
        }
    }
    Err(undecodable("region larger than its own size".into()))
}

fn area_bytes(area: PixelBox) -> usize {
    let side = |a: u32, b: u32| b.saturating_sub(a) as usize + 64;
    side(area.left, area.right) * side(area.top, area.bottom) * 3
}
