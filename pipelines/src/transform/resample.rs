//! Separable antialiased bilinear resampling of a source box, row by row into a sink.
//!
//! The filter is PIL's `BILINEAR` (a triangle widened by the scale factor when
//! downscaling, so every source pixel contributes), and the source box may have
//! fractional edges, as in PIL's `resize(size, box=...)`. Resampling a box is the same as
//! resizing the whole image and cropping, without the pixels that would be thrown away.
//! Intermediate values stay in `f32`; output is rounded to `u8` once.

use image::RgbImage;

/// A rectangle of the source image in pixel units; edges may be fractional.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct SourceBox {
    pub x: f64,
    pub y: f64,
    pub width: f64,
    pub height: f64,
}

/// Resamples `area` of `source` to `out_width x out_height` and hands each finished RGB8
/// row (`out_width * 3` bytes) to `sink` with its row index, top to bottom.
pub(crate) fn resample_rows(
    source: &RgbImage,
    area: SourceBox,
    out_width: u32,
    out_height: u32,
    mut sink: impl FnMut(usize, &[u8]),
) {
    let out_width = out_width as usize;
    let columns = Taps::new(source.width() as usize, area.x, area.width, out_width);
    let rows = Taps::new(
        source.height() as usize,
        area.y,
        area.height,
        out_height as usize,
    );
    let (first_row, end_row) = rows.span();
    let (first_column, end_column) = columns.span();

    // Horizontal pass over the source rows the vertical pass will read.
    let stride = out_width * 3;
    let src_stride = source.width() as usize * 3;
    let pixels = source.as_raw();
    let mut horizontal = vec![0f32; (end_row - first_row) * stride];
    let mut line = vec![[0f32; 3]; end_column - first_column];
    for (y, dst) in (first_row..end_row).zip(horizontal.chunks_exact_mut(stride)) {
        let src = &pixels[y * src_stride + first_column * 3..y * src_stride + end_column * 3];
        for (l, s) in line.iter_mut().zip(src.chunks_exact(3)) {
            *l = [f32::from(s[0]), f32::from(s[1]), f32::from(s[2])];
        }
        for (x, px) in dst.chunks_exact_mut(3).enumerate() {
            let (start, weights) = columns.of(x);
            let taps = &line[start - first_column..start - first_column + weights.len()];
            let mut acc = [0f32; 3];
            for (&w, p) in weights.iter().zip(taps) {
                acc[0] += w * p[0];
                acc[1] += w * p[1];
                acc[2] += w * p[2];
            }
            px.copy_from_slice(&acc);
        }
    }

    // Vertical pass, one output row at a time.
    let mut acc = vec![0f32; stride];
    let mut row = vec![0u8; stride];
    for y in 0..out_height as usize {
        let (start, weights) = rows.of(y);
        acc.fill(0.0);
        for (k, &w) in weights.iter().enumerate() {
            let offset = (start - first_row + k) * stride;
            for (a, &h) in acc.iter_mut().zip(&horizontal[offset..offset + stride]) {
                *a += w * h;
            }
        }
        for (r, &a) in row.iter_mut().zip(&acc) {
            // Saturating cast after rounding: the weights sum to one, so only rounding
            // error can leave the 0-255 range.
            *r = (a + 0.5) as u8;
        }
        sink(y, &row);
    }
}

/// For every output index along one axis, the first source index and the normalised
/// filter weights of the source indices that follow it.
#[derive(Debug)]
struct Taps {
    starts: Vec<usize>,
    counts: Vec<usize>,
    weights: Vec<f32>,
    max_taps: usize,
}

impl Taps {
    fn new(in_len: usize, box_start: f64, box_len: f64, out_len: usize) -> Self {
        let scale = box_len / out_len.max(1) as f64;
        let filter_scale = scale.max(1.0);
        let support = filter_scale; // The triangle's support is 1 at unit scale.
        let max_taps = support.ceil() as usize * 2 + 1;
        let mut taps = Self {
            starts: Vec::with_capacity(out_len),
            counts: Vec::with_capacity(out_len),
            weights: vec![0.0; out_len * max_taps],
            max_taps,
        };
        let last = in_len.saturating_sub(1) as f64;
        for i in 0..out_len {
            let center = box_start + (i as f64 + 0.5) * scale;
            let lo = (center - support + 0.5).floor().clamp(0.0, last) as usize;
            // `lo < in_len`, so `lo + 1 <= in_len`: every output reads at least one pixel.
            let hi = ((center + support + 0.5).floor().clamp(0.0, in_len as f64) as usize)
                .max(lo + 1)
                .min(lo + max_taps);
            let weights = &mut taps.weights[i * max_taps..i * max_taps + (hi - lo)];
            let mut total = 0.0;
            for (k, w) in weights.iter_mut().enumerate() {
                let t = ((lo + k) as f64 - center + 0.5) / filter_scale;
                let v = (1.0 - t.abs()).max(0.0);
                *w = v as f32;
                total += v;
            }
            if total > 0.0 {
                weights
                    .iter_mut()
                    .for_each(|w| *w = (f64::from(*w) / total) as f32);
            } else {
                // A box outside the image: repeat the nearest edge pixel.
                weights.fill(0.0);
                weights[0] = 1.0;
            }
            taps.starts.push(lo);
            taps.counts.push(hi - lo);
        }
        taps
    }

    fn of(&self, i: usize) -> (usize, &[f32]) {
        let at = i * self.max_taps;
        (self.starts[i], &self.weights[at..at + self.counts[i]])
    }

    /// The source indices any output reads, as `start..end`.
    fn span(&self) -> (usize, usize) {
        let start = self.starts.iter().copied().min().unwrap_or(0);
        let end = (0..self.starts.len())
            .map(|i| self.starts[i] + self.counts[i])
            .max()
            .unwrap_or(0);
        (start, end.max(start))
    }
}

/// Resamples a box `(x, y, width, height)` into a new buffer (tests and benchmarks).
#[cfg(test)]
pub(crate) fn resize_box(
    source: &RgbImage,
    (x, y, width, height): (f64, f64, f64, f64),
    out_width: u32,
    out_height: u32,
) -> Vec<u8> {
    let mut out = vec![0u8; out_width as usize * out_height as usize * 3];
    let stride = out_width as usize * 3;
    let area = SourceBox {
        x,
        y,
        width,
        height,
    };
    resample_rows(source, area, out_width, out_height, |row, pixels| {
        out[row * stride..(row + 1) * stride].copy_from_slice(pixels);
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transform::decode::tests::picture;

    #[test]
    fn whole_image_at_same_size_is_identity() {
        let source = picture(37, 23);
        let out = resize_box(&source, (0.0, 0.0, 37.0, 23.0), 37, 23);
        assert_eq!(out, source.as_raw().as_slice());
    }

    #[test]
    fn integer_box_at_unit_scale_is_a_crop() {
        let source = picture(50, 40);
        let out = resize_box(&source, (7.0, 11.0, 20.0, 15.0), 20, 15);
        let crop = image::imageops::crop_imm(&source, 7, 11, 20, 15).to_image();
        assert_eq!(out, crop.as_raw().as_slice());
    }

    /// Table: (image size, box, output size, expected value of a constant image).
    #[test]
    fn constant_images_stay_constant() {
        let cases = [
            ((64, 48), (0.0, 0.0, 64.0, 48.0), (7, 5)),
            ((64, 48), (3.3, 1.7, 40.2, 30.9), (224, 224)),
            ((500, 375), (10.0, 20.0, 480.0, 300.0), (17, 31)),
            ((3, 2), (0.0, 0.0, 3.0, 2.0), (90, 60)),
        ];
        for ((w, h), area, (ow, oh)) in cases {
            let source = RgbImage::from_pixel(w, h, image::Rgb([3, 128, 252]));
            let out = resize_box(&source, area, ow, oh);
            assert_eq!(out.len(), (ow * oh * 3) as usize);
            assert!(
                out.chunks_exact(3).all(|p| p == [3, 128, 252]),
                "{w}x{h} {area:?} -> {ow}x{oh}"
            );
        }
    }

    /// Downscaling by two averages a fine checkerboard to grey (antialiasing works).
    #[test]
    fn downscaling_averages_fine_detail() {
        let source = RgbImage::from_fn(64, 64, |x, y| {
            let v = if (x + y) % 2 == 0 { 0 } else { 200 };
            image::Rgb([v, v, v])
        });
        let out = resize_box(&source, (0.0, 0.0, 64.0, 64.0), 16, 16);
        let interior = (2..14).flat_map(|y| (2..14).map(move |x| (y * 16 + x) * 3));
        for i in interior {
            assert!(out[i].abs_diff(100) <= 2, "pixel {i}: {}", out[i]);
        }
    }
}
