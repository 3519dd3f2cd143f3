//! The train and eval transforms: crop geometry as torchvision computes it, then one
//! resampling pass written straight into the caller's slot.

use std::cell::RefCell;

use fast_image_resize::Resizer;
use rand::Rng;

use super::decode::{DecodeBuffers, Frame, area_scale_denominator, decode_area, read_header};
use super::resample::{Pixels, SourceBox, resample_into};
use super::{DecodeLimits, ImageHeader, OutputFormat, PixelBox, TransformError};

/// A crop in pixels of the image as its header declares it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CropBox {
    pub top: u32,
    pub left: u32,
    pub height: u32,
    pub width: u32,
}

/// Training augmentation: torchvision's `RandomResizedCrop(size, scale, ratio)` with
/// bilinear antialiased resizing, then `RandomHorizontalFlip(0.5)` when `flip` is set.
///
/// The struct is `Copy`: change `size` per call or per epoch for progressive resizing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainTransform {
    pub size: u32,
    /// Range of the crop's area as a fraction of the image's.
    pub scale: (f32, f32),
    /// Range of the crop's width / height, sampled log-uniformly.
    pub ratio: (f32, f32),
    pub flip: bool,
    pub output: OutputFormat,
    pub limits: DecodeLimits,
}

/// Evaluation preprocessing: resize the shorter side to `floor(size / resize_ratio)`,
/// then take the center `size x size` (torchvision's `Resize` + `CenterCrop`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalTransform {
    pub size: u32,
    /// Crop size over resized shorter side; 0.875 gives the usual 224 of 256.
    pub resize_ratio: f32,
    pub output: OutputFormat,
    pub limits: DecodeLimits,
}

impl OutputFormat {
    /// Values one sample's slot holds at `size`: `size * size * 3` of `u8` or `f32`.
    pub fn slot_len(&self, size: u32) -> usize {
        size as usize * size as usize * 3
    }
}

impl TrainTransform {
    /// torchvision's defaults: scale 0.08-1, ratio 3/4-4/3, flip, `u8` NHWC output.
    pub fn new(size: u32) -> Self {
        Self {
            size,
            scale: (0.08, 1.0),
            ratio: (3.0 / 4.0, 4.0 / 3.0),
            flip: true,
            output: OutputFormat::Uint8Nhwc,
            limits: DecodeLimits::default(),
        }
    }

    /// Decodes and augments one image into a `u8` slot; `output` must be `Uint8Nhwc`.
    pub fn apply_u8(
        &self,
        bytes: &[u8],
        rng: &mut impl Rng,
        out: &mut [u8],
    ) -> Result<(), TransformError> {
        let (header, crop, flip) = self.plan(bytes, rng)?;
        render(
            bytes,
            &header,
            crop,
            flip,
            self.size,
            Slot::U8(out, self.output),
        )
    }

    /// Decodes and augments one image into an `f32` slot; `output` must be `Float32Chw`.
    pub fn apply_f32(
        &self,
        bytes: &[u8],
        rng: &mut impl Rng,
        out: &mut [f32],
    ) -> Result<(), TransformError> {
        let (header, crop, flip) = self.plan(bytes, rng)?;
        render(
            bytes,
            &header,
            crop,
            flip,
            self.size,
            Slot::F32(out, self.output),
        )
    }

    /// Reads the header and draws the crop and the flip: all randomness happens here,
    /// from the declared size, so decoding at any scale gives the same geometry.
    fn plan(
        &self,
        bytes: &[u8],
        rng: &mut impl Rng,
    ) -> Result<(ImageHeader, CropBox, bool), TransformError> {
        let valid_range =
            |(lo, hi): (f32, f32)| lo.is_finite() && hi.is_finite() && 0.0 < lo && lo <= hi;
        if !valid_range(self.scale) || !valid_range(self.ratio) {
            return Err(TransformError::InvalidParameters {
                reason: "scale and ratio must be positive, finite ranges (lo <= hi)",
            });
        }
        let header = read_header(bytes, &self.limits)?;
        let crop = random_resized_crop(header.width, header.height, self.scale, self.ratio, rng);
        let flip = self.flip && rng.random_bool(0.5);
        Ok((header, crop, flip))
    }
}

impl EvalTransform {
    /// Resize ratio 0.875, `u8` NHWC output.
    pub fn new(size: u32) -> Self {
        Self {
            size,
            resize_ratio: 0.875,
            output: OutputFormat::Uint8Nhwc,
            limits: DecodeLimits::default(),
        }
    }

    /// Decodes, resizes and center-crops one image into a `u8` slot.
    pub fn apply_u8(&self, bytes: &[u8], out: &mut [u8]) -> Result<(), TransformError> {
        let (header, crop) = self.plan(bytes)?;
        render(
            bytes,
            &header,
            crop,
            false,
            self.size,
            Slot::U8(out, self.output),
        )
    }

    /// Decodes, resizes and center-crops one image into an `f32` slot.
    pub fn apply_f32(&self, bytes: &[u8], out: &mut [f32]) -> Result<(), TransformError> {
        let (header, crop) = self.plan(bytes)?;
        render(
            bytes,
            &header,
            crop,
            false,
            self.size,
            Slot::F32(out, self.output),
        )
    }

    /// The center crop as a box of the original image, which `render` resamples to
    /// `size`: the same pixels as resizing the whole image and cropping.
    fn plan(&self, bytes: &[u8]) -> Result<(ImageHeader, CropF64), TransformError> {
        let ratio = f64::from(self.resize_ratio);
        if !(ratio > 0.0 && ratio <= 1.0) {
            return Err(TransformError::InvalidParameters {
                reason: "resize_ratio must be in (0, 1]",
            });
        }
        let header = read_header(bytes, &self.limits)?;
        let (w, h) = (u64::from(header.width), u64::from(header.height));
        // In f32, as the ratio is given: 32 / 0.8 must be 40 as in Python, not 39.99...
        let short_target = (self.size as f32 / self.resize_ratio).floor() as u64;
        // torchvision: the longer side becomes int(short_target * long / short).
        let (resized_w, resized_h) = if w <= h {
            (short_target, (short_target.saturating_mul(h) / w).max(1))
        } else {
            ((short_target.saturating_mul(w) / h).max(1), short_target)
        };
        let size = f64::from(self.size);
        let top = ((resized_h as f64 - size) / 2.0).round_ties_even();
        let left = ((resized_w as f64 - size) / 2.0).round_ties_even();
        let (sx, sy) = (w as f64 / resized_w as f64, h as f64 / resized_h as f64);
        let crop = CropF64 {
            area: SourceBox {
                x: left * sx,
                y: top * sy,
                width: size * sx,
                height: size * sy,
            },
            min_decoded_short_side: u32::try_from(short_target).unwrap_or(u32::MAX),
        };
        Ok((header, crop))
    }
}

/// torchvision's `RandomResizedCrop.get_params` for an image of `width x height`: up to
/// ten draws of area fraction (uniform in `scale`) and aspect ratio (log-uniform in
/// `ratio`), then the largest center crop within `ratio`. An empty image gives an empty
/// crop.
pub fn random_resized_crop(
    width: u32,
    height: u32,
    scale: (f32, f32),
    ratio: (f32, f32),
    rng: &mut impl Rng,
) -> CropBox {
    if width == 0 || height == 0 {
        return CropBox {
            top: 0,
            left: 0,
            height,
            width,
        };
    }
    let area = f64::from(width) * f64::from(height);
    let (log_lo, log_hi) = (f64::from(ratio.0).ln(), f64::from(ratio.1).ln());
    let uniform = |rng: &mut _, lo: f64, hi: f64| lo + (hi - lo) * Rng::random::<f64>(rng);
    for _ in 0..10 {
        let target_area = area * uniform(rng, f64::from(scale.0), f64::from(scale.1));
        let aspect = uniform(rng, log_lo, log_hi).exp();
        let w = (target_area * aspect).sqrt().round_ties_even();
        let h = (target_area / aspect).sqrt().round_ties_even();
        if 0.0 < w && w <= f64::from(width) && 0.0 < h && h <= f64::from(height) {
            let (w, h) = (w as u32, h as u32);
            let top = rng.random_range(0..=height - h);
            let left = rng.random_range(0..=width - w);
            return CropBox {
                top,
                left,
                height: h,
                width: w,
            };
        }
    }
    let in_ratio = f64::from(width) / f64::from(height);
    let (lo, hi) = (f64::from(ratio.0), f64::from(ratio.1));
    let (w, h) = if in_ratio < lo {
        (
            width,
            ((f64::from(width) / lo).round_ties_even() as u32).clamp(1, height),
        )
    } else if in_ratio > hi {
        (
            ((f64::from(height) * hi).round_ties_even() as u32).clamp(1, width),
            height,
        )
    } else {
        (width, height)
    };
    CropBox {
        top: (height - h) / 2,
        left: (width - w) / 2,
        height: h,
        width: w,
    }
}

/// A crop in original-image pixels and the shorter side the decoded image needs.
#[derive(Debug, Clone, Copy)]
struct CropF64 {
    area: SourceBox,
    min_decoded_short_side: u32,
}

impl From<CropBox> for CropF64 {
    fn from(crop: CropBox) -> Self {
        Self {
            area: SourceBox {
                x: f64::from(crop.left),
                y: f64::from(crop.top),
                width: f64::from(crop.width),
                height: f64::from(crop.height),
            },
            min_decoded_short_side: 0,
        }
    }
}

thread_local! {
    /// Each thread's buffers, reused from image to image: transforms run on the
    /// loader's decode threads, one image at a time each.
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

#[derive(Default)]
struct Scratch {
    decode: DecodeBuffers,
    resizer: Resizer,
    /// The resampled RGB8 image before it becomes floats.
    resized: Vec<u8>,
}

/// Where a transform writes, with the format the transform was configured for.
enum Slot<'a> {
    U8(&'a mut [u8], OutputFormat),
    F32(&'a mut [f32], OutputFormat),
}

/// Decodes at the smallest JPEG scale that keeps the crop at least `size` pixels on its
/// shorter side, resamples the crop to `size x size` and writes it into the slot.
fn render(
    bytes: &[u8],
    header: &ImageHeader,
    crop: impl Into<CropF64>,
    flip: bool,
    size: u32,
    slot: Slot<'_>,
) -> Result<(), TransformError> {
    let crop = crop.into();
    render_at(bytes, header, crop, flip, size, slot, None)
}

fn render_at(
    bytes: &[u8],
    header: &ImageHeader,
    crop: CropF64,
    flip: bool,
    size: u32,
    slot: Slot<'_>,
    forced_denominator: Option<u32>,
) -> Result<(), TransformError> {
    if size == 0 {
        return Err(TransformError::InvalidParameters {
            reason: "target size must be positive",
        });
    }
    let expected = size as usize * size as usize * 3;
    let (actual, format_matches) = match &slot {
        Slot::U8(out, format) => (out.len(), *format == OutputFormat::Uint8Nhwc),
        Slot::F32(out, format) => (out.len(), matches!(format, OutputFormat::Float32Chw { .. })),
    };
    if !format_matches {
        return Err(TransformError::InvalidParameters {
            reason: "slot type does not match the configured output format",
        });
    }
    if actual != expected {
        return Err(TransformError::OutputSlot { expected, actual });
    }
    let denominator = forced_denominator.unwrap_or_else(|| {
        // The decoded image must keep the crop at least `size` on its shorter side (and,
        // for eval, the resized shorter side).
        let crop_short = crop.area.width.min(crop.area.height);
        let factor = (crop_short / f64::from(size)).max(1.0);
        let image_short = f64::from(header.width.min(header.height));
        let needed = (image_short / factor).ceil() as u32;
        area_scale_denominator(header, needed.max(crop.min_decoded_short_side))
    });
    let needed = needed_pixels(&crop.area, header, denominator, size);
    SCRATCH.with_borrow_mut(|scratch| {
        let frame = decode_area(bytes, header, denominator, needed, &mut scratch.decode)?;
        let source = Pixels {
            pixels: &scratch.decode.pixels,
            width: frame.width,
            height: frame.height,
        };
        let area = scaled_box(&crop.area, header, &frame);
        let resizer = &mut scratch.resizer;
        let mut resample = |out: &mut [u8]| {
            resample_into(resizer, source, area, (size, size), out).map_err(|_| {
                TransformError::Undecodable {
                    format: header.format,
                    reason: "decoded buffer does not match the frame size".into(),
                }
            })
        };
        let side = size as usize;
        let stride = side * 3;
        match slot {
            Slot::U8(out, _) => {
                resample(out)?;
                if flip {
                    out.chunks_exact_mut(stride).for_each(mirror);
                }
            }
            Slot::F32(out, OutputFormat::Float32Chw { mean, std }) => {
                let pixels = &mut scratch.resized;
                pixels.resize(stride * side, 0);
                resample(pixels)?;
                write_chw(pixels, side, flip, (mean, std), out);
            }
            Slot::F32(_, OutputFormat::Uint8Nhwc) => {} // Rejected above.
        }
        Ok(())
    })
}

/// Writes `size x size` RGB8 pixels into `out` as normalised float planes (CHW), each
/// row mirrored when `flip` is set.
///
/// Compiled twice: for the baseline target and, where the CPU has it, with AVX2, which
/// lets the compiler vectorise the split of RGB triples into planes, with the same
/// values (no multiply and add is fused). 224 x 224 in a loop over one buffer took about
/// 15 us against 54; in the loader benchmark, whose slots are fresh memory, its share of
/// the f32 loader's profile halved.
fn write_chw(
    pixels: &[u8],
    size: usize,
    flip: bool,
    normalise: ([f32; 3], [f32; 3]),
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        #[allow(unsafe_code)] // The CPU has AVX2: checked on the line above.
        unsafe {
            write_chw_avx2(pixels, size, flip, normalise, out);
        }
        return;
    }
    write_chw_any(pixels, size, flip, normalise, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn write_chw_avx2(
    pixels: &[u8],
    size: usize,
    flip: bool,
    normalise: ([f32; 3], [f32; 3]),
    out: &mut [f32],
) {
    write_chw_any(pixels, size, flip, normalise, out);
}

#[inline(always)]
fn write_chw_any(
    pixels: &[u8],
    size: usize,
    flip: bool,
    (mean, std): ([f32; 3], [f32; 3]),
    out: &mut [f32],
) {
    // `(v / 255 - mean) / std` as one multiply and add per value.
    let gain: [f32; 3] = std::array::from_fn(|c| 1.0 / (255.0 * std[c]));
    let bias: [f32; 3] = std::array::from_fn(|c| -mean[c] / std[c]);
    let plane = size * size;
    let (red, rest) = out.split_at_mut(plane);
    let (green, blue) = rest.split_at_mut(plane);
    let rows = pixels.chunks_exact(size * 3);
    let planes = red
        .chunks_exact_mut(size)
        .zip(green.chunks_exact_mut(size))
        .zip(blue.chunks_exact_mut(size));
    for (row, ((r, g), b)) in rows.zip(planes) {
        let mut put = |x: usize, p: &[u8]| {
            r[x] = f32::from(p[0]) * gain[0] + bias[0];
            g[x] = f32::from(p[1]) * gain[1] + bias[1];
            b[x] = f32::from(p[2]) * gain[2] + bias[2];
        };
        if flip {
            row.chunks_exact(3)
                .rev()
                .enumerate()
                .for_each(|(x, p)| put(x, p));
        } else {
            row.chunks_exact(3).enumerate().for_each(|(x, p)| put(x, p));
        }
    }
}

/// Reverses the order of the RGB pixels of one row in place.
fn mirror(row: &mut [u8]) {
    let pixels = row.len() / 3;
    for x in 0..pixels / 2 {
        let (a, b) = (x * 3, (pixels - 1 - x) * 3);
        for c in 0..3 {
            row.swap(a + c, b + c);
        }
    }
}

/// The declared pixels the resampler may read for `area`: the box plus the filter's
/// reach on every side, which is one output pixel (at least one source pixel) and
/// rounding, plus one MCU (16 pixels at the decoded scale), so that the pixels read are
/// upsampled as in a whole-image decode. Clamped to the image.
fn needed_pixels(area: &SourceBox, header: &ImageHeader, denominator: u32, size: u32) -> PixelBox {
    let margin = f64::from(16 * denominator.max(1));
    let reach_x = (area.width / f64::from(size)).max(1.0) + 2.0 + margin;
    let reach_y = (area.height / f64::from(size)).max(1.0) + 2.0 + margin;
    let clamp = |v: f64, limit: u32| v.clamp(0.0, f64::from(limit)) as u32;
    PixelBox {
        left: clamp((area.x - reach_x).floor(), header.width),
        top: clamp((area.y - reach_y).floor(), header.height),
        right: clamp((area.x + area.width + reach_x).ceil(), header.width),
        bottom: clamp((area.y + area.height + reach_y).ceil(), header.height),
    }
}

/// Maps a box of the declared image onto the decoded window (smaller after scaled
/// decoding, shifted when only part of the image was decoded).
fn scaled_box(area: &SourceBox, header: &ImageHeader, frame: &Frame) -> SourceBox {
    let sx = f64::from(frame.full_width) / f64::from(header.width);
    let sy = f64::from(frame.full_height) / f64::from(header.height);
    SourceBox {
        x: area.x * sx - f64::from(frame.left),
        y: area.y * sy - f64::from(frame.top),
        width: area.width * sx,
        height: area.height * sy,
    }
}

#[cfg(test)]
#[path = "augment_tests.rs"]
mod tests;
