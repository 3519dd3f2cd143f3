//! Converting an image folder (`SRC/<class>/<image>`, as torchvision's `ImageFolder`
//! reads it) into shuffled WebDataset shards, written by the ordered parallel pipeline
//! of `produce.rs`.

use std::fs;
use std::io::Cursor;
use std::path::{Path, PathBuf};

use image::codecs::jpeg::JpegEncoder;
use image::imageops::FilterType;
use image::{ExtendedColorType, ImageFormat, ImageReader};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use crate::produce::{
    CreateError, CreateReport, ShardPlan, available_cores, bad_option, key_width, write_samples,
};
use crate::sample::Sample;

/// File extensions (compared lower-cased) that [`ImageFolder::scan`] takes as images:
/// the formats this crate's `image` build decodes.
const IMAGE_EXTENSIONS: &[&str] = &["jpg", "jpeg", "png"];

/// The images of a classification folder, `root/<class>/.../<image>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageFolder {
    pub root: PathBuf,
    /// Class folder names, sorted; an image's class is an index into this list.
    pub classes: Vec<String>,
    /// Every image with its class, sorted by class, then path.
    pub images: Vec<(PathBuf, u32)>,
}

impl ImageFolder {
    /// Lists `root` as torchvision's `ImageFolder` does: each sub-folder is a class
    /// (sorted by name), and every file below it named `*.jpg`, `*.jpeg` or `*.png`
    /// (any case) is an image of that class. Hidden entries
    /// (names starting with `.`) and other files are ignored. Symlinked class folders
    /// and images are followed; symlinked folders inside a class are not (no cycles).
    /// A folder without classes, or a class without images, is an error.
    pub fn scan(root: &Path) -> Result<Self, CreateError> {
        let mut classes: Vec<(String, PathBuf)> = Vec::new();
        for entry in list_dir(root)? {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                continue;
            }
            let is_dir = fs::metadata(&path)
                .map_err(|source| CreateError::Scan {
                    path: path.clone(),
                    source,
                })?
                .is_dir();
            if is_dir {
                classes.push((name, path));
            }
        }
        if classes.is_empty() {
            return Err(CreateError::NoClasses {
                path: root.to_path_buf(),
            });
        }
        classes.sort();

        let mut images = Vec::new();
        for (class, (_, dir)) in classes.iter().enumerate() {
            let mut found = Vec::new();
            collect_images(dir, &mut found)?;
            if found.is_empty() {
                return Err(CreateError::EmptyClass { path: dir.clone() });
            }
            found.sort();
            let class = u32::try_from(class).map_err(|_| CreateError::BadOption {
                option: "source folder",
                reason: format!("more than {} classes", u32::MAX),
            })?;
            images.extend(found.into_iter().map(|path| (path, class)));
        }
        Ok(Self {
            root: root.to_path_buf(),
            classes: classes.into_iter().map(|(name, _)| name).collect(),
            images,
        })
    }
}

/// How [`create_from_folder`] writes shards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreateOptions {
    /// Shards are named `<prefix>-000000.tar`, `<prefix>-000001.tar`, ...
    pub prefix: String,
    /// Most samples per shard.
    pub max_count: u64,
    /// A new shard starts once the current one holds this many payload bytes.
    pub max_size: u64,
    /// Seeds the one shuffle of all images.
    pub seed: u64,
    /// Downscale so the shorter side is this many pixels, re-encoding as JPEG.
    pub resize: Option<u32>,
    /// Worker threads reading (and resizing) images.
    pub threads: usize,
    /// JPEG quality (1-100) of resized images.
    pub quality: u8,
    /// How an `s3://bucket/prefix/` output is reached.
    pub s3: crate::stream::S3Options,
}

impl Default for CreateOptions {
    fn default() -> Self {
        Self {
            prefix: "shards".into(),
            max_count: 100_000,
            max_size: 1_000_000_000,
            seed: 0,
            resize: None,
            threads: available_cores(),
            quality: 90,
            s3: crate::stream::S3Options::default(),
        }
    }
}

/// Writes the images of `folder` as shards `out/<prefix>-%06d.tar`, plus
/// `manifest.json` and `classes.txt`, creating `out` if needed.
///
/// All images are shuffled once (ChaCha8 seeded with `options.seed`) and written in
/// that order. Sample `i` of `n` has the key `<i>-<stem>`: `i` zero-padded to at least
/// six digits, `stem` the file name without its extension, with every character other
/// than ASCII letters, digits, `-` and `_` replaced by `_` (so no dots). Fields: the
/// image under its own lower-cased extension, bytes untouched (`jpeg` stays `jpeg`; a
/// file whose content is not what its extension says gets `jpg` or `png` after its
/// content), and `cls`. With `resize: Some(n)`, images whose shorter side exceeds `n`
/// are decoded, converted to RGB, scaled (bilinear, antialiased) so the shorter side is
/// `n`, and re-encoded as JPEG at `quality` under `jpg`; smaller ones are kept as they
/// are. `progress` is called with the number of samples newly written.
pub fn create_from_folder(
    folder: &ImageFolder,
    out: &Path,
    options: &CreateOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<CreateReport, CreateError> {
    if options.resize == Some(0) {
        return Err(bad_option(
            "resize",
            "the shorter side must be at least 1 pixel",
        ));
    }
    if !(1..=100).contains(&options.quality) {
        return Err(bad_option("quality", "must be between 1 and 100"));
    }
    if folder.images.is_empty() {
        return Err(CreateError::NoImages {
            path: folder.root.clone(),
        });
    }
    let mut order: Vec<&(PathBuf, u32)> = folder.images.iter().collect();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(options.seed));
    let width = key_width(order.len());
    let plan = ShardPlan {
        out,
        prefix: &options.prefix,
        max_count: options.max_count,
        max_size: options.max_size,
        threads: options.threads,
        s3: &options.s3,
    };
    let make = |index: usize| -> Result<Sample, CreateError> {
        let (path, class) = order[index];
        let key = format!("{index:0width$}-{}", sanitize_stem(path));
        let (field, bytes) = prepare_image(path, &key, options)?;
        Ok(Sample::new(key).with(field, bytes).with_class(*class))
    };
    write_samples(&plan, folder.classes.clone(), order.len(), &make, progress)
}

/// Encodes RGB pixels as a baseline JPEG.
pub(crate) fn encode_jpeg(
    rgb: &[u8],
    width: u32,
    height: u32,
    quality: u8,
    key: &str,
) -> Result<Vec<u8>, CreateError> {
    let mut bytes = Vec::new();
    JpegEncoder::new_with_quality(&mut bytes, quality)
        .encode(rgb, width, height, ExtendedColorType::Rgb8)
        .map_err(|source| CreateError::EncodeImage {
            key: key.to_string(),
            source,
        })?;
    Ok(bytes)
}

fn list_dir(dir: &Path) -> Result<Vec<fs::DirEntry>, CreateError> {
    let scan_error = |source| CreateError::Scan {
        path: dir.to_path_buf(),
        source,
    };
    fs::read_dir(dir)
        .map_err(scan_error)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(scan_error)
}

/// Adds the images below `dir` to `found`, recursing into real (not symlinked) folders.
fn collect_images(dir: &Path, found: &mut Vec<PathBuf>) -> Result<(), CreateError> {
    for entry in list_dir(dir)? {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') {
            continue;
        }
        let file_type = entry.file_type().map_err(|source| CreateError::Scan {
            path: path.clone(),
            source,
        })?;
        if file_type.is_dir() {
            collect_images(&path, found)?;
        } else if has_image_extension(&path) && fs::metadata(&path).is_ok_and(|m| m.is_file()) {
            found.push(path);
        }
    }
    Ok(())
}

fn has_image_extension(path: &Path) -> bool {
    lower_extension(path).is_some_and(|e| IMAGE_EXTENSIONS.contains(&e.as_str()))
}

fn lower_extension(path: &Path) -> Option<String> {
    path.extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase())
}

/// The file stem with everything but ASCII letters, digits, `-` and `_` replaced by
/// `_`, at most 64 characters.
fn sanitize_stem(path: &Path) -> String {
    let stem = path.file_stem().unwrap_or_default().to_string_lossy();
    stem.chars()
        .take(64)
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Reads one image and returns its field name and bytes, resized if asked.
fn prepare_image(
    path: &Path,
    key: &str,
    options: &CreateOptions,
) -> Result<(String, Vec<u8>), CreateError> {
    let bytes = fs::read(path).map_err(|source| CreateError::ReadImage {
        path: path.to_path_buf(),
        source,
    })?;
    let decode_error = |reason: String| CreateError::DecodeImage {
        path: path.to_path_buf(),
        reason,
    };
    let format = image::guess_format(&bytes).map_err(|e| decode_error(e.to_string()))?;
    let content_ext = match format {
        ImageFormat::Jpeg => "jpg",
        ImageFormat::Png => "png",
        other => return Err(decode_error(format!("{other:?} images are not supported"))),
    };
    // Reading the header checks the file is an image and gives its size.
    let (width, height) = ImageReader::with_format(Cursor::new(&bytes), format)
        .into_dimensions()
        .map_err(|e| decode_error(e.to_string()))?;
    let field = match (lower_extension(path).as_deref(), content_ext) {
        (Some(ext @ ("jpg" | "jpeg")), "jpg") => ext.to_string(),
        _ => content_ext.to_string(),
    };
    let Some(target) = options.resize.filter(|&n| width.min(height) > n) else {
        return Ok((field, bytes));
    };
    let (new_width, new_height) = scaled_size(width, height, target);
    let image = ImageReader::with_format(Cursor::new(&bytes), format)
        .decode()
        .map_err(|e| decode_error(e.to_string()))?;
    let resized = image::imageops::resize(
        &image.to_rgb8(),
        new_width,
        new_height,
        FilterType::Triangle,
    );
    let jpeg = encode_jpeg(
        resized.as_raw(),
        new_width,
        new_height,
        options.quality,
        key,
    )?;
    Ok(("jpg".to_string(), jpeg))
}

/// The size with the shorter side `target` and the same aspect ratio (rounded).
fn scaled_size(width: u32, height: u32, target: u32) -> (u32, u32) {
    let scale = |long: u32, short: u32| {
        ((u64::from(long) * u64::from(target) + u64::from(short) / 2) / u64::from(short)).max(1)
            as u32
    };
    if width <= height {
        (target, scale(height, width))
    } else {
        (scale(width, height), target)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use image::{Rgb, RgbImage};

    use super::*;
    use crate::manifest::Manifest;
    use crate::reader::SampleReader;
    use crate::source::Sources;

    fn gradient(width: u32, height: u32, seed: u8) -> RgbImage {
        RgbImage::from_fn(width, height, |x, y| {
            Rgb([(x * 7) as u8 ^ seed, (y * 5) as u8, seed.wrapping_mul(31)])
        })
    }

    fn encoded(image: &RgbImage, format: ImageFormat) -> Vec<u8> {
        let mut bytes = Cursor::new(Vec::new());
        image
            .write_to(&mut bytes, format)
            .expect("encode test image");
        bytes.into_inner()
    }

    /// A folder of `per_class` images in each of `classes`, alternating PNG and JPEG
    /// (some with upper-case extensions); returns (relative path, bytes, class).
    fn make_folder(root: &Path, classes: &[&str], per_class: usize) -> Vec<(String, Vec<u8>, u32)> {
        let mut files = Vec::new();
        for (class, name) in classes.iter().enumerate() {
            fs::create_dir_all(root.join(name)).expect("class dir");
            for i in 0..per_class {
                let image = gradient(
                    40 + i as u32 * 3,
                    30 + class as u32 * 11,
                    (i * 13 + class) as u8,
                );
                let (file, bytes) = match i % 3 {
                    0 => (format!("img.{i}.png"), encoded(&image, ImageFormat::Png)),
                    1 => (format!("img{i}.JPEG"), encoded(&image, ImageFormat::Jpeg)),
                    _ => (format!("img {i}.jpg"), encoded(&image, ImageFormat::Jpeg)),
                };
                let relative = format!("{name}/{file}");
                fs::write(root.join(&relative), &bytes).expect("write image");
                files.push((relative, bytes, class as u32));
            }
        }
        files
    }

    fn urls(report: &CreateReport) -> Vec<String> {
        report
            .shards
            .iter()
            .map(|s| s.path.display().to_string())
            .collect()
    }

    fn read_back(report: &CreateReport) -> Vec<Sample> {
        let (samples, _) = SampleReader::new(Sources::default())
            .collect(&urls(report))
            .expect("read shards back");
        samples
    }

    fn shard_bytes(report: &CreateReport) -> Vec<Vec<u8>> {
        report
            .shards
            .iter()
            .map(|s| fs::read(&s.path).expect("read shard"))
            .collect()
    }

    fn create(folder: &ImageFolder, out: &Path, options: &CreateOptions) -> CreateReport {
        create_from_folder(folder, out, options, &|_| {}).expect("create shards")
    }

    #[test]
    fn scan_sorts_classes_and_skips_what_is_not_an_image() {
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path();
        for (path, bytes) in [
            ("zebra/b.PNG", &b"x"[..]),
            ("zebra/a.jpg", b"x"),
            ("zebra/nested/c.jpeg", b"x"),
            ("zebra/notes.txt", b"x"),
            ("zebra/.hidden.jpg", b"x"),
            ("ant/1.png", b"x"),
            (".git/x.png", b"x"),
            ("README.md", b"x"),
        ] {
            fs::create_dir_all(root.join(path).parent().expect("parent")).expect("mkdir");
            fs::write(root.join(path), bytes).expect("write");
        }
        let folder = ImageFolder::scan(root).expect("scan");
        assert_eq!(folder.classes, ["ant", "zebra"]);
        let images: Vec<(String, u32)> = folder
            .images
            .iter()
            .map(|(p, c)| {
                (
                    p.strip_prefix(root)
                        .expect("under root")
                        .display()
                        .to_string(),
                    *c,
                )
            })
            .collect();
        let want = [
            ("ant/1.png", 0),
            ("zebra/a.jpg", 1),
            ("zebra/b.PNG", 1),
            ("zebra/nested/c.jpeg", 1),
        ];
        let want: Vec<(String, u32)> = want.iter().map(|(p, c)| (p.to_string(), *c)).collect();
        assert_eq!(images, want);
    }

    #[test]
    fn scan_errors_name_the_folder() {
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path();
        fs::create_dir_all(root.join("empty")).expect("mkdir");
        fs::create_dir_all(root.join("one-class/cats")).expect("mkdir");
        fs::write(root.join("one-class/cats/notes.txt"), b"x").expect("write");
        let cases = [
            ("missing", "cannot list"),
            ("empty", "no class folders"),
            ("one-class", "no images"),
        ];
        for (name, want) in cases {
            let err = ImageFolder::scan(&root.join(name))
                .expect_err(name)
                .to_string();
            assert!(err.contains(want) && err.contains(name), "{name}: {err}");
        }
    }

    #[test]
    fn create_round_trips_every_image_once() {
        let dir = tempfile::tempdir().expect("temp dir");
        let src = dir.path().join("src");
        let files = make_folder(&src, &["cat", "dog", "emu"], 7);
        let folder = ImageFolder::scan(&src).expect("scan");
        let out = dir.path().join("out/nested");
        let options = CreateOptions {
            max_count: 4,
            threads: 2,
            ..CreateOptions::default()
        };
        let total = std::sync::atomic::AtomicU64::new(0);
        let report = create_from_folder(&folder, &out, &options, &|n| {
            total.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        })
        .expect("create");
        assert_eq!(total.into_inner(), 21);
        assert_eq!(report.shards.len(), 6);
        assert_eq!(
            report.spec,
            format!("{}/shards-{{000000..000005}}.tar", out.display())
        );
        assert_eq!(
            Manifest::read_from(&out).expect("manifest"),
            report.manifest
        );
        assert_eq!(report.manifest.total_samples(), 21);
        assert_eq!(report.manifest.classes, ["cat", "dog", "emu"]);
        let mut per_class: BTreeMap<String, u64> = BTreeMap::new();
        for shard in &report.manifest.shards {
            for (class, n) in &shard.class_counts {
                *per_class.entry(class.clone()).or_default() += n;
            }
        }
        assert_eq!(
            per_class,
            [("0".into(), 7), ("1".into(), 7), ("2".into(), 7)].into()
        );

        let samples = read_back(&report);
        assert_eq!(samples.len(), files.len());
        for (relative, bytes, class) in &files {
            let matches: Vec<&Sample> = samples
                .iter()
                .filter(|s| {
                    s.first_of(&["jpg", "jpeg", "png"])
                        .is_some_and(|(_, b)| b == bytes)
                })
                .collect();
            assert_eq!(matches.len(), 1, "{relative}");
            let sample = matches[0];
            assert_eq!(
                sample.int_field("cls"),
                Some(Ok(i64::from(*class))),
                "{relative}"
            );
            let want_ext = lower_extension(Path::new(relative)).expect("extension");
            assert!(
                sample.field(&want_ext).is_some(),
                "{relative}: {:?}",
                sample.key
            );
            assert!(
                !sample.key.contains('.') && !sample.key.contains('/'),
                "{}",
                sample.key
            );
        }
        // Shuffled: the first shard does not hold one class only.
        let first_classes: std::collections::BTreeSet<_> =
            samples[..4].iter().map(|s| s.int_field("cls")).collect();
        assert!(first_classes.len() > 1, "{first_classes:?}");
    }

    #[test]
    fn output_depends_on_seed_not_threads() {
        let dir = tempfile::tempdir().expect("temp dir");
        let src = dir.path().join("src");
        make_folder(&src, &["a", "b"], 9);
        let folder = ImageFolder::scan(&src).expect("scan");
        let run = |name: &str, seed: u64, threads: usize, resize: Option<u32>| {
            let options = CreateOptions {
                max_count: 5,
                seed,
                threads,
                resize,
                ..CreateOptions::default()
            };
            shard_bytes(&create(&folder, &dir.path().join(name), &options))
        };
        let reference = run("one", 1, 1, None);
        assert_eq!(run("two", 1, 2, None), reference);
        assert_eq!(run("three", 1, 3, None), reference);
        assert_ne!(run("other-seed", 2, 2, None), reference);
        assert_eq!(
            run("resize-1", 1, 1, Some(20)),
            run("resize-4", 1, 4, Some(20))
        );
    }

    #[test]
    fn resize_shrinks_the_shorter_side_only() {
        let dir = tempfile::tempdir().expect("temp dir");
        let src = dir.path().join("src");
        let files = make_folder(&src, &["a", "b"], 4);
        let folder = ImageFolder::scan(&src).expect("scan");
        let target = 35;
        let options = CreateOptions {
            resize: Some(target),
            quality: 80,
            ..CreateOptions::default()
        };
        let report = create(&folder, &dir.path().join("out"), &options);
        let samples = read_back(&report);
        assert_eq!(samples.len(), files.len());
        let mut kept = 0;
        for sample in &samples {
            let (ext, bytes) = sample
                .first_of(&["jpg", "jpeg", "png"])
                .expect("image field");
            let image = image::load_from_memory(bytes).expect("decode");
            let short = image.width().min(image.height());
            if files.iter().any(|(_, original, _)| original == bytes) {
                assert!(short <= target, "{}: kept a {short}px image", sample.key);
                kept += 1;
            } else {
                assert_eq!((ext, short), ("jpg", target), "{}", sample.key);
            }
        }
        // Class `a` images are 30 pixels high, so kept; class `b` ones are resized.
        assert_eq!(kept, 4);
    }

    #[test]
    fn bad_images_and_options_are_errors() {
        let dir = tempfile::tempdir().expect("temp dir");
        let src = dir.path().join("src");
        make_folder(&src, &["a"], 2);
        fs::write(src.join("a/broken.jpg"), b"not an image at all").expect("write");
        let folder = ImageFolder::scan(&src).expect("scan");
        let err = create_from_folder(
            &folder,
            &dir.path().join("out"),
            &CreateOptions::default(),
            &|_| {},
        )
        .expect_err("broken image")
        .to_string();
        assert!(err.contains("broken.jpg"), "{err}");
        assert!(
            !dir.path()
                .join("out")
                .join(crate::manifest::MANIFEST_FILE)
                .exists()
        );

        let cases: [(&str, CreateOptions); 5] = [
            (
                "prefix",
                CreateOptions {
                    prefix: "a/b".into(),
                    ..CreateOptions::default()
                },
            ),
            (
                "max count",
                CreateOptions {
                    max_count: 0,
                    ..CreateOptions::default()
                },
            ),
            (
                "threads",
                CreateOptions {
                    threads: 0,
                    ..CreateOptions::default()
                },
            ),
            (
                "resize",
                CreateOptions {
                    resize: Some(0),
                    ..CreateOptions::default()
                },
            ),
            (
                "quality",
                CreateOptions {
                    quality: 101,
                    ..CreateOptions::default()
                },
            ),
        ];
        for (option, options) in cases {
            let err = create_from_folder(&folder, &dir.path().join("bad"), &options, &|_| {})
                .expect_err(option)
                .to_string();
            assert!(err.contains(option), "{option}: {err}");
        }
    }

    #[test]
    fn scaled_sizes_keep_the_aspect_ratio() {
        let cases = [
            ((640, 427, 160), (240, 160)),
            ((300, 451, 100), (100, 150)),
            ((7, 1, 1), (7, 1)),
        ];
        for ((w, h, n), want) in cases {
            assert_eq!(scaled_size(w, h, n), want, "{w}x{h} -> {n}");
        }
    }

    /// Real photographs, shipped in the repository (`assets/photos/`).
    #[test]
    fn photos_convert_with_resize() {
        let photos = Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/photos");
        assert!(
            photos.is_dir(),
            "no photos at {} (the checkout's assets/photos/, see its PROVENANCE.md)",
            photos.display()
        );
        let dir = tempfile::tempdir().expect("temp dir");
        let src = dir.path().join("src");
        let picks = [
            (
                "color",
                ["astronaut.png", "china.jpg", "coffee.png", "flower.jpg"],
            ),
            (
                "texture",
                ["brick.png", "grass.png", "gravel.png", "camera.png"],
            ),
        ];
        for (class, names) in picks {
            fs::create_dir_all(src.join(class)).expect("class dir");
            for name in names {
                fs::copy(photos.join(name), src.join(class).join(name)).expect("copy photo");
            }
        }
        let folder = ImageFolder::scan(&src).expect("scan");
        let options = CreateOptions {
            resize: Some(160),
            max_count: 3,
            ..CreateOptions::default()
        };
        let report = create(&folder, &dir.path().join("out"), &options);
        assert_eq!(report.shards.len(), 3);
        let samples = read_back(&report);
        assert_eq!(samples.len(), 8);
        for sample in &samples {
            let bytes = sample.field("jpg").expect("resized photos are JPEG");
            let image = image::load_from_memory(bytes).expect("decode");
            assert_eq!(image.width().min(image.height()), 160, "{}", sample.key);
        }
    }
}
