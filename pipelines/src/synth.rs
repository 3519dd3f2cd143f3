//! The synthetic demo dataset: shapes on noisy, textured backgrounds, drawn straight
//! into shards, so the demo and the tests need no download.
//!
//! Each class is a shape (circle, square, triangle, ...). With more classes than
//! shapes, a class is a shape in a colour family (`red-circle`, `cyan-circle`). Shapes
//! have a random position, size, rotation, aspect ratio and colour; the background has
//! a random colour, gradient and blotchy texture, with lines, specks and sometimes a
//! smaller decoy shape as distractors (some lines drawn over the shape) and pixel
//! noise. A small CNN has to train for several epochs to tell the classes apart: with
//! the defaults (10 x 500 images of 64 pixels), a 4-block CNN (32-256 channels, Adam
//! 1e-3, batch 64, no augmentation) passed 90% training accuracy in epoch 9, with 84%
//! on held-out images at epoch 12.

use std::path::Path;

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::folder::encode_jpeg;
use crate::produce::{CreateError, CreateReport, bad_option};
use crate::produce::{ShardPlan, available_cores, key_width, write_samples};
use crate::sample::Sample;

/// JPEG quality of the generated images.
const QUALITY: u8 = 90;

/// How [`generate_synthetic`] builds and writes the dataset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SynthOptions {
    pub classes: u32,
    pub per_class: u32,
    /// Width and height of the images, in pixels.
    pub size: u32,
    pub seed: u64,
    /// Shards are named `<prefix>-000000.tar`, ...
    pub prefix: String,
    /// Most samples per shard.
    pub max_count: u64,
    /// A new shard starts once the current one holds this many payload bytes.
    pub max_size: u64,
    /// Worker threads drawing and encoding images.
    pub threads: usize,
    /// How an `s3://bucket/prefix/` output is reached.
    pub s3: crate::stream::S3Options,
}

impl Default for SynthOptions {
    fn default() -> Self {
        Self {
            classes: 10,
            per_class: 500,
            size: 64,
            seed: 0,
            prefix: "synth".into(),
            max_count: 1000,
            max_size: 1_000_000_000,
            threads: available_cores(),
            s3: crate::stream::S3Options::default(),
        }
    }
}

/// Generates `classes * per_class` RGB images of `size` x `size` pixels (JPEG,
/// quality 90) into shards `out/<prefix>-%06d.tar`, with `manifest.json` and
/// `classes.txt` (class names such as `circle`, or `red-circle` beyond twelve
/// classes, the number of distinct shapes).
///
/// Samples are keyed `sample-000000`, ... and carry `jpg` and `cls`. The classes are
/// shuffled together (ChaCha8 from `seed`), and sample `i` is drawn from its own
/// ChaCha8 stream `i` of `seed`, so the output is byte-for-byte the same for the same
/// options whatever the number of threads. `progress` is called with the number of
/// samples newly written.
pub fn generate_synthetic(
    out: &Path,
    options: &SynthOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<CreateReport, CreateError> {
    if options.classes == 0 || options.per_class == 0 {
        return Err(bad_option(
            "classes",
            "needs at least one class and one image per class",
        ));
    }
    if !(8..=4096).contains(&options.size) {
        return Err(bad_option("size", "images must be 8 to 4096 pixels wide"));
    }
    let count = usize::try_from(u64::from(options.classes) * u64::from(options.per_class))
        .map_err(|_| bad_option("classes", "too many images for this machine"))?;
    let looks = class_looks(options.classes);
    let mut labels: Vec<u32> = (0..options.classes)
        .flat_map(|class| std::iter::repeat_n(class, options.per_class as usize))
        .collect();
    let mut order_rng = ChaCha8Rng::seed_from_u64(options.seed);
    order_rng.set_stream(u64::MAX);
    labels.shuffle(&mut order_rng);

    let width = key_width(count);
    let make = |index: usize| -> Result<Sample, CreateError> {
        let class = labels[index];
        let mut rng = ChaCha8Rng::seed_from_u64(options.seed);
        rng.set_stream(index as u64);
        let pixels = render(&looks[class as usize], options.size, &mut rng);
        let key = format!("sample-{index:0width$}");
        let jpeg = encode_jpeg(&pixels, options.size, options.size, QUALITY, &key)?;
        Ok(Sample::new(key).with("jpg", jpeg).with_class(class))
    };
    let plan = ShardPlan {
        out,
        prefix: &options.prefix,
        max_count: options.max_count,
        max_size: options.max_size,
        threads: options.threads,
        s3: &options.s3,
    };
    let names = looks.iter().map(|look| look.name.clone()).collect();
    write_samples(&plan, names, count, &make, progress)
}

/// Number of distinct shapes; beyond it, classes also differ by colour family.
pub(crate) fn shape_count() -> u32 {
    SHAPES.len() as u32
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    Circle,
    Square,
    Triangle,
    Cross,
    Ring,
    Stripes,
    Star,
    Crescent,
    Frame,
    Checker,
    Semicircle,
    Bowtie,
}

/// In class order: the default ten classes are the first ten shapes.
const SHAPES: [Shape; 12] = [
    Shape::Circle,
    Shape::Square,
    Shape::Triangle,
    Shape::Cross,
    Shape::Ring,
    Shape::Stripes,
    Shape::Star,
    Shape::Crescent,
    Shape::Frame,
    Shape::Checker,
    Shape::Semicircle,
    Shape::Bowtie,
];

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::Circle => "circle",
            Shape::Square => "square",
            Shape::Triangle => "triangle",
            Shape::Cross => "cross",
            Shape::Ring => "ring",
            Shape::Stripes => "stripes",
            Shape::Star => "star",
            Shape::Crescent => "crescent",
            Shape::Frame => "frame",
            Shape::Checker => "checker",
            Shape::Semicircle => "semicircle",
            Shape::Bowtie => "bowtie",
        }
    }

    /// Whether the point `(u, v)` of the shape's own frame, where the shape fits in
    /// `[-1, 1]²`, is inside it.
    fn contains(self, u: f32, v: f32) -> bool {
        let r2 = u * u + v * v;
        let (au, av) = (u.abs(), v.abs());
        match self {
            Shape::Circle => r2 <= 0.81,
            Shape::Square => au.max(av) <= 0.78,
            Shape::Triangle => {
                let s = 3f32.sqrt();
                v >= -0.5 && s * u + v <= 1.0 && -s * u + v <= 1.0
            }
            Shape::Cross => (au <= 0.28 && av <= 0.95) || (av <= 0.28 && au <= 0.95),
            Shape::Ring => (0.3025..=0.9025).contains(&r2),
            Shape::Stripes => au.max(av) <= 0.85 && ((v + 0.85) / 0.34) as i32 % 2 == 0,
            Shape::Star => star_contains(u, v),
            Shape::Crescent => r2 <= 0.81 && (u - 0.4) * (u - 0.4) + v * v >= 0.5184,
            Shape::Frame => (0.5..=0.85).contains(&au.max(av)),
            Shape::Checker => {
                au.max(av) <= 0.9 && (((u + 0.9) / 0.6) as i32 + ((v + 0.9) / 0.6) as i32) % 2 == 0
            }
            Shape::Semicircle => v >= -0.3 && u * u + (v + 0.3) * (v + 0.3) <= 1.0,
            Shape::Bowtie => au <= 0.9 && av <= 0.1 + 0.85 * au,
        }
    }
}

/// A five-pointed star, outer radius 1, inner radius 0.42.
fn star_contains(u: f32, v: f32) -> bool {
    const SECTOR: f32 = std::f32::consts::TAU / 5.0;
    let radius = (u * u + v * v).sqrt();
    if radius > 1.0 {
        return false;
    }
    // Fold the angle into the half-sector between a tip (angle 0) and a notch.
    let mut angle = (v.atan2(u) - std::f32::consts::FRAC_PI_2).rem_euclid(SECTOR);
    if angle > SECTOR / 2.0 {
        angle = SECTOR - angle;
    }
    let (px, py) = (radius * angle.cos(), radius * angle.sin());
    let (ix, iy) = (0.42 * (SECTOR / 2.0).cos(), 0.42 * (SECTOR / 2.0).sin());
    // Inside when on the same side of the tip-notch edge as the centre.
    (ix - 1.0) * py - iy * (px - 1.0) >= 0.0
}

/// What a class looks like: a shape, and a hue range when colour matters.
#[derive(Debug, Clone, PartialEq)]
struct ClassLook {
    name: String,
    shape: Shape,
    /// (first hue, width) in degrees; `None` means any hue.
    hues: Option<(f32, f32)>,
}

const HUE_NAMES: [&str; 12] = [
    "red",
    "orange",
    "yellow",
    "chartreuse",
    "green",
    "spring",
    "cyan",
    "azure",
    "blue",
    "violet",
    "magenta",
    "rose",
];

/// Class `c` is shape `c % shapes` in colour family `c / shapes`; families split the
/// hue circle evenly, family 0 centred on red, and are named after their centre hue.
fn class_looks(classes: u32) -> Vec<ClassLook> {
    let shapes = shape_count();
    let families = classes.div_ceil(shapes);
    let width = 360.0 / families as f32;
    let mut names: Vec<String> = (0..families)
        .map(|f| {
            HUE_NAMES[((f as f32 * width / 30.0).round() as usize) % HUE_NAMES.len()].to_string()
        })
        .collect();
    let mut unique = names.clone();
    unique.sort();
    unique.dedup();
    if unique.len() < names.len() {
        names = (0..families)
            .map(|f| format!("hue{:03}", (f as f32 * width).round() as u32))
            .collect();
    }
    (0..classes)
        .map(|class| {
            let shape = SHAPES[(class % shapes) as usize];
            let family = class / shapes;
            if families == 1 {
                return ClassLook {
                    name: shape.name().to_string(),
                    shape,
                    hues: None,
                };
            }
            // Keep 15% of the family's width free at each side, so families stay apart.
            let start = family as f32 * width - width / 2.0 + 0.15 * width;
            ClassLook {
                name: format!("{}-{}", names[family as usize], shape.name()),
                shape,
                hues: Some((start, 0.7 * width)),
            }
        })
        .collect()
}

type Rgb = [f32; 3];

/// Size of the class shape (half its extent), as a fraction of the image side.
const SHAPE_RADIUS: std::ops::Range<f32> = 0.16..0.34;
/// Size of decoy shapes, as a fraction of the class shape's size: always smaller, so
/// the class is the largest shape in the image.
const DECOY_RADIUS: std::ops::Range<f32> = 0.2..0.4;
/// Least difference in brightness (HSV value) between shape and background.
const MIN_CONTRAST: f32 = 0.25;

/// Draws one image; returns `size * size` RGB pixels.
fn render(look: &ClassLook, size: u32, rng: &mut ChaCha8Rng) -> Vec<u8> {
    let side = size as usize;
    let s = size as f32;

    let fg_value: f32 = rng.random_range(0.3..1.0);
    let bg_value = if fg_value + MIN_CONTRAST < 0.95 && rng.random_bool(0.5) {
        rng.random_range(fg_value + MIN_CONTRAST..1.0)
    } else {
        rng.random_range(0.0..fg_value - MIN_CONTRAST)
    };
    let (fg_hue, fg_saturation) = match look.hues {
        Some((start, width)) => (
            start + rng.random_range(0.0..width),
            rng.random_range(0.55..1.0),
        ),
        None => (rng.random_range(0.0..360.0), rng.random_range(0.2..1.0)),
    };
    let foreground = hsv(fg_hue, fg_saturation, fg_value);
    let background = hsv(
        rng.random_range(0.0..360.0),
        rng.random_range(0.0..0.6),
        bg_value,
    );
    let mut pixels = textured_background(background, side, rng);

    // Behind the shape: decoys (smaller shapes of any kind) and most distractors.
    let distractors: Vec<Distractor> = (0..rng.random_range(1..=4))
        .map(|_| Distractor::random(rng, s))
        .collect();
    let radius = s * rng.random_range(SHAPE_RADIUS);
    let pose = Pose::random(rng, s, radius);
    for _ in 0..rng.random_range(0..=1) {
        let shape = SHAPES[rng.random_range(0..SHAPES.len())];
        let colour = hsv(rng.random_range(0.0..360.0), rng.random(), rng.random());
        let decoy_radius = radius * rng.random_range(DECOY_RADIUS);
        let decoy = Pose::random(rng, s, decoy_radius);
        draw_shape(shape, colour, &decoy, &mut pixels, side);
    }
    for distractor in distractors.iter().filter(|d| !d.on_top) {
        distractor.draw(&mut pixels, side);
    }
    draw_shape(look.shape, foreground, &pose, &mut pixels, side);
    for distractor in distractors.iter().filter(|d| d.on_top) {
        distractor.draw(&mut pixels, side);
    }

    let noise: f32 = rng.random_range(0.02..0.08);
    let mut out = Vec::with_capacity(side * side * 3);
    for p in &pixels {
        for value in p {
            let v = value + rng.random_range(-noise..noise);
            out.push((v.clamp(0.0, 1.0) * 255.0 + 0.5) as u8);
        }
    }
    out
}

/// A background colour with a linear gradient and blotches interpolated from a coarse
/// grid of random colours.
fn textured_background(colour: Rgb, side: usize, rng: &mut ChaCha8Rng) -> Vec<Rgb> {
    const GRID: usize = 5;
    let s = side as f32;
    let gradient_angle: f32 = rng.random_range(0.0..std::f32::consts::TAU);
    let gradient: f32 = rng.random_range(0.0..0.3);
    let (gx, gy) = (
        gradient * gradient_angle.cos() / s,
        gradient * gradient_angle.sin() / s,
    );
    let texture: f32 = rng.random_range(0.04..0.15);
    let mut grid = [[0f32; 3]; GRID * GRID];
    for cell in &mut grid {
        for c in cell.iter_mut() {
            *c = rng.random_range(-1.0..1.0) * texture;
        }
    }
    let mut pixels: Vec<Rgb> = Vec::with_capacity(side * side);
    let cell = (GRID - 1) as f32 / s;
    for y in 0..side {
        for x in 0..side {
            let (fx, fy) = (x as f32 * cell, y as f32 * cell);
            let (ix, iy) = ((fx as usize).min(GRID - 2), (fy as usize).min(GRID - 2));
            let (tx, ty) = (fx - ix as f32, fy - iy as f32);
            let shade = (x as f32 - s / 2.0) * gx + (y as f32 - s / 2.0) * gy;
            let mut p = colour;
            for (c, value) in p.iter_mut().enumerate() {
                let at = |cx: usize, cy: usize| grid[(iy + cy) * GRID + ix + cx][c];
                let top = at(0, 0) * (1.0 - tx) + at(1, 0) * tx;
                let bottom = at(0, 1) * (1.0 - tx) + at(1, 1) * tx;
                *value += shade + top * (1.0 - ty) + bottom * ty;
            }
            pixels.push(p);
        }
    }
    pixels
}

/// Where and how a shape is drawn: centre, size, rotation, aspect ratio, shading.
#[derive(Debug, Clone, Copy)]
struct Pose {
    centre: (f32, f32),
    radius: f32,
    /// Half extents along the shape's own axes (`radius` stretched by the aspect ratio).
    scale: (f32, f32),
    /// Cosine and sine of the rotation.
    rotation: (f32, f32),
    shading: f32,
    opacity: f32,
}

impl Pose {
    /// A random pose of the given radius, at least 70% of it inside the image.
    fn random(rng: &mut ChaCha8Rng, s: f32, radius: f32) -> Self {
        let margin = (radius * 0.7).min(s / 2.0 - 0.5);
        let centre = (
            rng.random_range(margin..s - margin),
            rng.random_range(margin..s - margin),
        );
        let angle: f32 = rng.random_range(0.0..std::f32::consts::TAU);
        let aspect = rng.random_range(-0.25f32..0.25).exp().sqrt();
        Self {
            centre,
            radius,
            scale: (radius * aspect, radius / aspect),
            rotation: (angle.cos(), angle.sin()),
            shading: rng.random_range(-0.2..0.2),
            opacity: rng.random_range(0.75..1.0),
        }
    }
}

/// Draws a shape in a pose, antialiased by 3x3 supersampling.
fn draw_shape(shape: Shape, colour: Rgb, pose: &Pose, pixels: &mut [Rgb], side: usize) {
    const SUB: [f32; 3] = [1.0 / 6.0, 0.5, 5.0 / 6.0];
    let (cx, cy) = pose.centre;
    let (sx, sy) = pose.scale;
    let (cos, sin) = pose.rotation;
    let reach = sx.max(sy) * std::f32::consts::SQRT_2;
    let span = |c: f32| {
        ((c - reach).floor().max(0.0) as usize)..((c + reach).ceil().max(0.0) as usize).min(side)
    };
    for y in span(cy) {
        for x in span(cx) {
            let mut inside = 0;
            for oy in SUB {
                for ox in SUB {
                    let (dx, dy) = (x as f32 + ox - cx, y as f32 + oy - cy);
                    let u = (cos * dx + sin * dy) / sx;
                    let v = (-sin * dx + cos * dy) / sy;
                    inside += usize::from(shape.contains(u, v));
                }
            }
            if inside == 0 {
                continue;
            }
            let (dx, dy) = (x as f32 + 0.5 - cx, y as f32 + 0.5 - cy);
            let light = 1.0 + pose.shading * (cos * dx + sin * dy) / pose.radius;
            let alpha = pose.opacity * inside as f32 / 9.0;
            let pixel = &mut pixels[y * side + x];
            for (value, c) in pixel.iter_mut().zip(colour) {
                *value += alpha * (c * light - *value);
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Distractor {
    /// A segment from `a` to `b`; a speck when they are equal.
    a: (f32, f32),
    b: (f32, f32),
    /// Half the thickness of a line, or the radius of a speck.
    half_width: f32,
    colour: Rgb,
    alpha: f32,
    on_top: bool,
}

impl Distractor {
    fn random(rng: &mut ChaCha8Rng, s: f32) -> Self {
        let a = (rng.random_range(0.0..s), rng.random_range(0.0..s));
        let (b, half_width) = if rng.random_bool(0.5) {
            let length = rng.random_range(0.15..0.6) * s;
            let angle: f32 = rng.random_range(0.0..std::f32::consts::TAU);
            (
                (a.0 + length * angle.cos(), a.1 + length * angle.sin()),
                rng.random_range(0.4..0.9),
            )
        } else {
            (a, rng.random_range(0.8..(s * 0.05).max(1.0)))
        };
        Self {
            a,
            b,
            half_width,
            colour: hsv(rng.random_range(0.0..360.0), rng.random(), rng.random()),
            alpha: rng.random_range(0.4..0.9),
            on_top: rng.random_bool(0.3),
        }
    }

    fn draw(&self, pixels: &mut [Rgb], side: usize) {
        let reach = self.half_width + 1.0;
        let span = |p: f32, q: f32| {
            let lo = (p.min(q) - reach).floor().max(0.0) as usize;
            let hi = ((p.max(q) + reach).ceil().max(0.0) as usize).min(side);
            lo..hi
        };
        let (dx, dy) = (self.b.0 - self.a.0, self.b.1 - self.a.1);
        let length2 = dx * dx + dy * dy;
        for y in span(self.a.1, self.b.1) {
            for x in span(self.a.0, self.b.0) {
                let (px, py) = (x as f32 + 0.5 - self.a.0, y as f32 + 0.5 - self.a.1);
                let t = if length2 > 0.0 {
                    ((px * dx + py * dy) / length2).clamp(0.0, 1.0)
                } else {
                    0.0
                };
                let distance = ((px - t * dx).powi(2) + (py - t * dy).powi(2)).sqrt();
                let coverage = (self.half_width + 0.5 - distance).clamp(0.0, 1.0);
                if coverage > 0.0 {
                    let pixel = &mut pixels[y * side + x];
                    for (value, c) in pixel.iter_mut().zip(self.colour) {
                        *value += self.alpha * coverage * (c - *value);
                    }
                }
            }
        }
    }
}

/// HSV (hue in degrees, saturation and value in 0..1) to RGB in 0..1.
fn hsv(hue: f32, saturation: f32, value: f32) -> Rgb {
    let h = hue.rem_euclid(360.0) / 60.0;
    let chroma = value * saturation;
    let x = chroma * (1.0 - (h % 2.0 - 1.0).abs());
    let (r, g, b) = match h as u32 {
        0 => (chroma, x, 0.0),
        1 => (x, chroma, 0.0),
        2 => (0.0, chroma, x),
        3 => (0.0, x, chroma),
        4 => (x, 0.0, chroma),
        _ => (chroma, 0.0, x),
    };
    let m = value - chroma;
    [r + m, g + m, b + m]
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::fs;

    use super::*;
    use crate::manifest::Manifest;
    use crate::reader::SampleReader;
    use crate::source::Sources;

    fn small(seed: u64, threads: usize) -> SynthOptions {
        SynthOptions {
            classes: 4,
            per_class: 6,
            size: 32,
            seed,
            max_count: 10,
            threads,
            ..SynthOptions::default()
        }
    }

    fn generate(out: &Path, options: &SynthOptions) -> (CreateReport, Vec<Vec<u8>>) {
        let report = generate_synthetic(out, options, &|_| {}).expect("generate");
        let bytes = report
            .shards
            .iter()
            .map(|s| fs::read(&s.path).expect("read shard"))
            .collect();
        (report, bytes)
    }

    #[test]
    fn writes_every_class_at_the_asked_size() {
        let dir = tempfile::tempdir().expect("temp dir");
        let options = small(7, 2);
        let (report, _) = generate(dir.path(), &options);
        assert_eq!(report.shards.len(), 3);
        assert_eq!(
            Manifest::read_from(dir.path()).expect("manifest"),
            report.manifest
        );
        assert_eq!(
            fs::read_to_string(dir.path().join("classes.txt")).expect("classes.txt"),
            "circle\nsquare\ntriangle\ncross\n"
        );
        let urls: Vec<String> = report
            .shards
            .iter()
            .map(|s| s.path.display().to_string())
            .collect();
        let (samples, _) = SampleReader::new(Sources::default())
            .collect(&urls)
            .expect("read back");
        assert_eq!(samples.len(), 24);
        let mut per_class: BTreeMap<i64, u32> = BTreeMap::new();
        for (i, sample) in samples.iter().enumerate() {
            assert_eq!(sample.key, format!("sample-{i:06}"));
            let class = sample.int_field("cls").expect("cls").expect("integer");
            *per_class.entry(class).or_default() += 1;
            let image = image::load_from_memory(sample.field("jpg").expect("jpg")).expect("decode");
            assert_eq!((image.width(), image.height()), (32, 32), "{}", sample.key);
        }
        assert_eq!(per_class, (0..4).map(|c| (c, 6)).collect());
        let first_shard: std::collections::BTreeSet<_> =
            samples[..10].iter().map(|s| s.int_field("cls")).collect();
        assert!(first_shard.len() > 1, "classes are not shuffled together");
    }

    #[test]
    fn same_seed_same_bytes_whatever_the_threads() {
        let dir = tempfile::tempdir().expect("temp dir");
        let run =
            |name: &str, seed, threads| generate(&dir.path().join(name), &small(seed, threads)).1;
        let reference = run("a", 3, 1);
        assert_eq!(run("b", 3, 2), reference);
        assert_eq!(run("c", 3, 5), reference);
        assert_ne!(run("d", 4, 2), reference);
    }

    #[test]
    fn class_names_add_colour_families_past_the_shapes() {
        let names = |classes| {
            class_looks(classes)
                .into_iter()
                .map(|l| l.name)
                .collect::<Vec<_>>()
        };
        let cases: &[(u32, &[&str])] = &[
            (2, &["circle", "square"]),
            (13, &["red-circle", "red-square"]),
            (36, &["red-circle", "green-circle", "blue-circle"]),
        ];
        for (classes, want) in cases {
            let got = names(*classes);
            assert_eq!(got.len(), *classes as usize);
            let mut unique = got.clone();
            unique.sort();
            unique.dedup();
            assert_eq!(unique.len(), got.len(), "{got:?}");
            for name in *want {
                assert!(
                    got.contains(&name.to_string()),
                    "{classes} classes: no {name} in {got:?}"
                );
            }
        }
        let many = names(200);
        assert!(many[0].starts_with("hue000-"), "{many:?}");
    }

    #[test]
    fn shapes_differ_from_each_other() {
        // Rasterise each shape at a fixed pose; no two may cover the same pixels.
        let grid = |shape: Shape| -> Vec<bool> {
            (0..40 * 40)
                .map(|i| {
                    shape.contains(
                        (i % 40) as f32 / 20.0 - 0.975,
                        (i / 40) as f32 / 20.0 - 0.975,
                    )
                })
                .collect()
        };
        for (i, a) in SHAPES.iter().enumerate() {
            let cells = grid(*a);
            let area = cells.iter().filter(|c| **c).count();
            assert!((300..1300).contains(&area), "{a:?} covers {area} of 1600");
            for b in &SHAPES[i + 1..] {
                let differing = cells
                    .iter()
                    .zip(grid(*b))
                    .filter(|(x, y)| **x != *y)
                    .count();
                assert!(
                    differing > 100,
                    "{a:?} and {b:?} differ in {differing} cells"
                );
            }
        }
    }

    #[test]
    fn bad_options_are_errors() {
        let dir = tempfile::tempdir().expect("temp dir");
        let cases = [
            (
                "classes",
                SynthOptions {
                    classes: 0,
                    ..small(0, 1)
                },
            ),
            (
                "classes",
                SynthOptions {
                    per_class: 0,
                    ..small(0, 1)
                },
            ),
            (
                "size",
                SynthOptions {
                    size: 4,
                    ..small(0, 1)
                },
            ),
            (
                "prefix",
                SynthOptions {
                    prefix: String::new(),
                    ..small(0, 1)
                },
            ),
        ];
        for (option, options) in cases {
            let err = generate_synthetic(dir.path(), &options, &|_| {})
                .expect_err(option)
                .to_string();
            assert!(err.contains(option), "{option}: {err}");
        }
    }
}
