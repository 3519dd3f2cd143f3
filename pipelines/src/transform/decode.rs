//! JPEG and PNG bytes to RGB8: header checks before allocation, reduced-scale JPEG.
//!
//! Full-size JPEG goes through `image` (zune-jpeg, the fastest pure-Rust decoder);
//! reduced-size JPEG through `jpeg-decoder`, whose IDCT can output 1/2, 1/4 or 1/8 of
//! the image directly (zune-jpeg cannot; see `scale_denominator` for which are used).
//! PNG goes through `image` (the `png` crate).

use std::io::Cursor;

use image::{DynamicImage, RgbImage};

use super::{DecodeLimits, ImageFormat, TransformError};

/// What the header of an image declares, checked against [`DecodeLimits`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageHeader {
    pub format: ImageFormat,
    pub width: u32,
    pub height: u32,
}

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
        ImageFormat::Jpeg => {
            let decoder =
                image::codecs::jpeg::JpegDecoder::new(Cursor::new(bytes)).map_err(undecodable)?;
            DynamicImage::from_decoder(decoder).map_err(undecodable)?
        }
    };
    Ok(image.into_rgb8())
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
