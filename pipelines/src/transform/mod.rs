//! From image bytes to training inputs: decoding, random-resized-crop, flip and resize.
//!
//! `decode.rs` turns JPEG or PNG bytes into RGB8, checking the declared size against
//! [`DecodeLimits`] from the header before any pixel buffer exists, decoding JPEG at a
//! reduced DCT scale when the caller needs far fewer pixels, and for the transforms
//! decoding only the crop's region: `libjpeg.rs` (libjpeg-turbo, where the build found
//! it) skips the rows above and the columns beside it, zune-jpeg otherwise stops a
//! sequential JPEG after the rows the crop reaches. `resample.rs` resamples a
//! floating-point source box with PIL's antialiased `BILINEAR` filter (SIMD, through
//! `fast_image_resize`) straight into the caller's buffer. `augment.rs` holds the train
//! and eval transforms, which sample their crop from the header's dimensions, so the
//! same RNG state gives the same crop whatever the decoder does; each thread keeps its
//! decode and resample buffers from image to image.
//!
//! Hostile bytes never panic: every failure is a [`TransformError`].

mod augment;
mod decode;
#[cfg(imgrun_libjpeg)]
mod libjpeg;
mod resample;

pub use augment::{CropBox, EvalTransform, TrainTransform, random_resized_crop};
pub use decode::{decode_rgb, read_header};

/// The mean of ImageNet's training images per channel, on the 0-1 scale.
pub const IMAGENET_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
/// The standard deviation of ImageNet's training images per channel, on the 0-1 scale.
pub const IMAGENET_STD: [f32; 3] = [0.229, 0.224, 0.225];

/// What a transform writes into its output slot.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OutputFormat {
    /// `size * size * 3` bytes, rows top to bottom, pixels as R, G, B (HWC of one NHWC
    /// batch). Normalisation is left to the trainer.
    Uint8Nhwc,
    /// `3 * size * size` floats, one plane per channel (CHW), each value
    /// `(v / 255 - mean[c]) / std[c]`, as torchvision's `ToTensor` then `Normalize`.
    Float32Chw { mean: [f32; 3], std: [f32; 3] },
}

impl OutputFormat {
    /// Normalised float CHW with ImageNet's mean and standard deviation.
    pub const IMAGENET_F32: Self = Self::Float32Chw {
        mean: IMAGENET_MEAN,
        std: IMAGENET_STD,
    };
}

/// Bounds on the images a decoder accepts, checked from the header before allocating.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Largest accepted `width * height` as declared by the header.
    pub max_pixels: u64,
}

impl DecodeLimits {
    /// 100 megapixels: far above any photo in an image-classification dataset.
    pub const DEFAULT_MAX_PIXELS: u64 = 100_000_000;
}

impl Default for DecodeLimits {
    fn default() -> Self {
        Self {
            max_pixels: Self::DEFAULT_MAX_PIXELS,
        }
    }
}

/// What the header of an image declares, checked against [`DecodeLimits`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageHeader {
    pub format: ImageFormat,
    pub width: u32,
    pub height: u32,
}

/// A box of the declared image in whole pixels, `[left, right) x [top, bottom)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PixelBox {
    pub left: u32,
    pub top: u32,
    pub right: u32,
    pub bottom: u32,
}

/// Image formats the transforms decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageFormat {
    Jpeg,
    Png,
}

impl std::fmt::Display for ImageFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Jpeg => "jpeg",
            Self::Png => "png",
        })
    }
}

/// Why an image could not be decoded or transformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransformError {
    #[error("empty image field")]
    Empty,
    #[error("unsupported image format (first bytes {magic:02x?})")]
    UnsupportedFormat { magic: Vec<u8> },
    #[error("undecodable {format} image: {reason}")]
    Undecodable { format: ImageFormat, reason: String },
    #[error("{format} image of {width}x{height} exceeds the limit of {max_pixels} pixels")]
    TooLarge {
        format: ImageFormat,
        width: u32,
        height: u32,
        max_pixels: u64,
    },
    #[error("{format} image has a zero dimension ({width}x{height})")]
    ZeroSized {
        format: ImageFormat,
        width: u32,
        height: u32,
    },
    #[error("invalid transform parameters: {reason}")]
    InvalidParameters { reason: &'static str },
    #[error("output slot holds {actual} values, the transform writes {expected}")]
    OutputSlot { expected: usize, actual: usize },
}
