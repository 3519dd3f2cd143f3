//! The loader benchmark's data: ImageNet-like JPEG shards cut from real photos, made
//! once (in parallel) and reused while their specification is unchanged.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Instant;

use image::RgbImage;
use image::imageops::{self, FilterType};
use pipelines::{Sample, ShardWriter};
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

use crate::SEED;

/// Bump when the generated data changes, so that old shards are not reused.
pub const DATA_VERSION: &str = "loader-v1";
const JPEG_QUALITY: u8 = 90;

/// The benchmark shards and a line that describes them.
#[derive(Debug)]
pub struct Shards {
    pub paths: Vec<PathBuf>,
    pub description: String,
}

/// The shards, made on first use. The `.complete` file marks a finished set: its first
/// line is the set's specification (reused only when it matches), then the description,
/// then the shard file names.
pub fn ensure_shards(
    dir: &Path,
    photos: &Path,
    samples: u64,
    shards: u64,
) -> Result<Shards, String> {
    let spec = format!("{DATA_VERSION}: {samples} samples in {shards} shards");
    let marker = dir.join(".complete");
    if let Ok(text) = std::fs::read_to_string(&marker) {
        let mut lines = text.lines();
        if lines.next() == Some(spec.as_str()) {
            let description = lines.next().unwrap_or_default().to_string();
            let paths: Vec<PathBuf> = lines.map(|name| dir.join(name)).collect();
            if !paths.is_empty() && paths.iter().all(|p| p.is_file()) {
                return Ok(Shards { paths, description });
            }
        }
    }
    eprintln!(
        "loader bench: making {samples} samples from {} in {} (once)",
        photos.display(),
        dir.display()
    );
    let started = Instant::now();
    let sources = load_photos(photos)?;
    let io_error = |e: io::Error| e.to_string();
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(io_error)?;
    }
    std::fs::create_dir_all(dir).map_err(io_error)?;
    let pattern = dir.join("loader-%06d.tar");
    let mut writer = ShardWriter::new(
        pattern.to_string_lossy(),
        samples.div_ceil(shards),
        u64::MAX,
    )
    .map_err(io_error)?;
    let mut stats = DataStats::default();
    let indices: Vec<u64> = (0..samples).collect();
    // Made in parallel a block at a time, written in order.
    for block in indices.chunks(256) {
        let made: Vec<(Sample, Made)> = block
            .par_iter()
            .map(|&index| make_sample(index, &sources))
            .collect::<Result<_, _>>()?;
        for (sample, made) in made {
            writer.write(&sample).map_err(io_error)?;
            stats.add(made);
        }
    }
    let written = writer.finish().map_err(io_error)?;
    let description = stats.describe(sources.len());
    let mut text = format!("{spec}\n{description}\n");
    for shard in &written {
        let name = shard.path.file_name().ok_or("shard without a file name")?;
        text.push_str(&format!("{}\n", name.to_string_lossy()));
    }
    std::fs::write(&marker, text).map_err(io_error)?;
    eprintln!(
        "loader bench: made {} shards in {:.1} s",
        written.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(Shards {
        paths: written.into_iter().map(|shard| shard.path).collect(),
        description,
    })
}

/// A source photo, decoded.
#[derive(Debug)]
struct Photo {
    pixels: RgbImage,
    /// Stored without colour (expanded to grey RGB in `pixels`).
    grey: bool,
}

/// Every JPEG and PNG in `dir`, decoded, in name order.
fn load_photos(dir: &Path) -> Result<Vec<Photo>, String> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| {
            path.extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| ["jpg", "jpeg", "png"].contains(&e.to_ascii_lowercase().as_str()))
        })
        .collect();
    paths.sort();
    if paths.is_empty() {
        return Err(format!("no JPEG or PNG photos in {}", dir.display()));
    }
    paths
        .par_iter()
        .map(|path| {
            image::open(path)
                .map(|image| Photo {
                    grey: !image.color().has_color(),
                    pixels: image.into_rgb8(),
                })
                .map_err(|e| format!("{}: {e}", path.display()))
        })
        .collect()
}

/// What one generated sample looks like, for the description of the set.
#[derive(Debug, Clone, Copy)]
struct Made {
    jpeg_bytes: usize,
    width: u32,
    height: u32,
}

#[derive(Debug, Default)]
struct DataStats {
    samples: u64,
    jpeg_bytes: u64,
    width: u64,
    height: u64,
    portrait: u64,
}

impl DataStats {
    fn add(&mut self, made: Made) {
        self.samples += 1;
        self.jpeg_bytes += made.jpeg_bytes as u64;
        self.width += u64::from(made.width);
        self.height += u64::from(made.height);
        self.portrait += u64::from(made.height > made.width);
    }

    fn describe(&self, photos: usize) -> String {
        let n = self.samples.max(1) as f64;
        format!(
            "JPEG quality {JPEG_QUALITY}, 4:2:0, cropped from {photos} photos; mean {:.0}x{:.0} px, \
             {:.0}% portrait, {:.1} KB a sample (ImageNet: about 110 KB)",
            self.width as f64 / n,
            self.height as f64 / n,
            100.0 * self.portrait as f64 / n,
            self.jpeg_bytes as f64 / n / 1e3,
        )
    }
}

/// Sample `index`: a random crop of a random photo at an ImageNet-like size, as JPEG,
/// with a random class. A function of the index alone, so any thread may make it.
fn make_sample(index: u64, photos: &[Photo]) -> Result<(Sample, Made), String> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(SEED ^ index);
    let photo = &photos[rng.random_range(0..photos.len())];
    let grey = photo.grey;
    let photo = &photo.pixels;
    let (width, height) = imagenet_like_size(&mut rng);
    // The largest crop of the photo with the target's aspect ratio, scaled by 0.6-1.
    let aspect = f64::from(width) / f64::from(height);
    let (photo_w, photo_h) = (f64::from(photo.width()), f64::from(photo.height()));
    let (max_w, max_h) = if photo_w / photo_h > aspect {
        (photo_h * aspect, photo_h)
    } else {
        (photo_w, photo_w / aspect)
    };
    let scale = rng.random_range(0.6..=1.0);
    let crop_w = ((max_w * scale) as u32).clamp(1, photo.width());
    let crop_h = ((max_h * scale) as u32).clamp(1, photo.height());
    let left = rng.random_range(0..=photo.width() - crop_w);
    let top = rng.random_range(0..=photo.height() - crop_h);
    let crop = imageops::crop_imm(photo, left, top, crop_w, crop_h).to_image();
    let mut resized = imageops::resize(&crop, width, height, FilterType::Triangle);
    if grey {
        tint(&mut resized, &mut rng);
    }
    let jpeg = encode_jpeg(&resized)?;
    let class = rng.random_range(0..1000u32);
    let made = Made {
        jpeg_bytes: jpeg.len(),
        width,
        height,
    };
    let key = format!("n{:08}_{index:06}", 1_440_764 + class);
    Ok((Sample::new(key).with("jpg", jpeg).with_class(class), made))
}

/// A colour cast for a grey photo (ImageNet's photos are almost all in colour): each
/// channel scaled by its own gain.
fn tint(image: &mut RgbImage, rng: &mut impl Rng) {
    let gains: [f32; 3] = std::array::from_fn(|_| rng.random_range(0.6..=1.0));
    for pixel in image.pixels_mut() {
        for (value, gain) in pixel.0.iter_mut().zip(gains) {
            *value = (f32::from(*value) * gain).round() as u8;
        }
    }
}

/// Most ImageNet training photos are 500 pixels on the longer side, landscape, 4:3 or
/// 3:2; some are portrait, square or smaller.
fn imagenet_like_size(rng: &mut impl Rng) -> (u32, u32) {
    const ASPECTS: [f64; 8] = [
        4.0 / 3.0,
        4.0 / 3.0,
        4.0 / 3.0,
        4.0 / 3.0,
        1.5,
        1.5,
        1.25,
        1.0,
    ];
    let long: u32 = if rng.random_bool(0.8) {
        500
    } else {
        rng.random_range(300..500)
    };
    let aspect = ASPECTS[rng.random_range(0..ASPECTS.len())];
    let short = (f64::from(long) / aspect).round() as u32;
    if rng.random_bool(0.2) {
        (short, long)
    } else {
        (long, short)
    }
}

/// JPEG at quality 90 with 4:2:0 chroma, as most photos are stored (`image`'s own encoder
/// writes 4:4:4 only, which decodes slower than what a loader meets in practice).
fn encode_jpeg(image: &RgbImage) -> Result<Vec<u8>, String> {
    let side = |n: u32| u16::try_from(n).map_err(|_| format!("image side {n} too large for JPEG"));
    let mut jpeg = Vec::new();
    let mut encoder = jpeg_encoder::Encoder::new(&mut jpeg, JPEG_QUALITY);
    encoder.set_sampling_factor(jpeg_encoder::SamplingFactor::R_4_2_0);
    encoder
        .encode(
            image.as_raw(),
            side(image.width())?,
            side(image.height())?,
            jpeg_encoder::ColorType::Rgb,
        )
        .map_err(|e| format!("jpeg encoding: {e}"))?;
    Ok(jpeg)
}
