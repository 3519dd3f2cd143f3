//! Tests of decoding: errors on hostile bytes, PNG exactness, reduced-scale JPEG.

use super::*;
use crate::transform::resample::resize_box;

/// A smooth RGB test picture: gradients plus a low-frequency pattern.
pub(crate) fn picture(width: u32, height: u32) -> RgbImage {
    RgbImage::from_fn(width, height, |x, y| {
        let fx = x as f32 / width as f32;
        let fy = y as f32 / height as f32;
        let wave = ((fx * 9.0).sin() * (fy * 7.0).cos() * 60.0) as i32;
        image::Rgb([
            (fx * 200.0) as u8 + 20,
            (fy * 200.0) as u8 + 20,
            (128 + wave).clamp(0, 255) as u8,
        ])
    })
}

pub(crate) fn encode(image: &RgbImage, format: image::ImageFormat) -> Vec<u8> {
    let mut out = Cursor::new(Vec::new());
    image
        .write_to(&mut out, format)
        .expect("encoding a test image");
    out.into_inner()
}

/// JPEG at quality 90 with 4:2:0 chroma, as most photos are stored (`image`'s encoder
/// writes 4:4:4 only), baseline or progressive.
pub(crate) fn jpeg_420(image: &RgbImage, progressive: bool) -> Vec<u8> {
    let side = |n: u32| u16::try_from(n).expect("test image fits a JPEG");
    let mut jpeg = Vec::new();
    let mut encoder = jpeg_encoder::Encoder::new(&mut jpeg, 90);
    encoder.set_sampling_factor(jpeg_encoder::SamplingFactor::R_4_2_0);
    encoder.set_progressive(progressive);
    encoder
        .encode(
            image.as_raw(),
            side(image.width()),
            side(image.height()),
            jpeg_encoder::ColorType::Rgb,
        )
        .expect("encoding a test image");
    jpeg
}

/// The repository's photos (`assets/photos/`), each as a 4:2:0 JPEG, with its name.
pub(crate) fn photos_as_jpeg() -> Vec<(String, Vec<u8>)> {
    let dir = photos_dir();
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.extension().is_some_and(|e| {
                ["jpg", "jpeg", "png"]
                    .iter()
                    .any(|x| e.eq_ignore_ascii_case(x))
            })
        })
        .collect();
    paths.sort();
    assert!(
        !paths.is_empty(),
        "no photos under {} (the checkout's assets/photos/)",
        dir.display()
    );
    paths
        .iter()
        .map(|path| {
            let bytes = std::fs::read(path).expect("reading a listed photo");
            let image = image::load_from_memory(&bytes).expect("photo decodes");
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
            (
                name.unwrap_or_default(),
                jpeg_420(&image.into_rgb8(), false),
            )
        })
        .collect()
}

/// Rewrites the SOF0 frame size of an encoded JPEG.
fn patch_jpeg_size(mut jpeg: Vec<u8>, width: u16, height: u16) -> Vec<u8> {
    let sof = jpeg
        .windows(2)
        .position(|w| w == [0xFF, 0xC0])
        .expect("baseline JPEG has SOF0");
    jpeg[sof + 5..sof + 7].copy_from_slice(&height.to_be_bytes());
    jpeg[sof + 7..sof + 9].copy_from_slice(&width.to_be_bytes());
    jpeg
}

fn patch_png_size(mut png: Vec<u8>, width: u32, height: u32) -> Vec<u8> {
    png[16..20].copy_from_slice(&width.to_be_bytes());
    png[20..24].copy_from_slice(&height.to_be_bytes());
    png
}

fn kind(result: Result<RgbImage, TransformError>) -> String {
    match result {
        Ok(image) => format!("ok {}x{}", image.width(), image.height()),
        Err(e) => format!("{e:?}")
            .split([' ', '{', '('])
            .next()
            .unwrap_or("")
            .into(),
    }
}

#[test]
fn bad_input_comes_back_as_errors() {
    let jpeg = encode(&picture(64, 48), image::ImageFormat::Jpeg);
    let png = encode(&picture(64, 48), image::ImageFormat::Png);
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty", vec![], "Empty"),
        (
            "garbage",
            b"definitely not an image".to_vec(),
            "UnsupportedFormat",
        ),
        ("jpeg magic only", vec![0xFF, 0xD8, 0xFF], "Undecodable"),
        ("jpeg cut in header", jpeg[..40].to_vec(), "Undecodable"),
        ("png signature only", png[..8].to_vec(), "Undecodable"),
        (
            "png cut in data",
            png[..png.len() / 2].to_vec(),
            "Undecodable",
        ),
        (
            "huge jpeg",
            patch_jpeg_size(jpeg.clone(), 60_000, 60_000),
            "TooLarge",
        ),
        (
            "huge png",
            patch_png_size(png.clone(), 1 << 20, 1 << 20),
            "TooLarge",
        ),
        (
            "zero-width png",
            patch_png_size(png.clone(), 0, 48),
            "ZeroSized",
        ),
        ("valid jpeg", jpeg.clone(), "ok 64x48"),
        ("valid png", png.clone(), "ok 64x48"),
    ];
    for (name, bytes, want) in cases {
        let got = kind(decode_rgb(&bytes, None, &DecodeLimits::default()));
        assert_eq!(got, want, "{name}");
        let scaled = kind(decode_rgb(&bytes, Some(8), &DecodeLimits::default()));
        assert!(
            !scaled.starts_with("ok") || want.starts_with("ok"),
            "{name}: {scaled}"
        );
    }
}

#[test]
fn limit_is_configurable() {
    let png = encode(&picture(64, 48), image::ImageFormat::Png);
    let limits = DecodeLimits { max_pixels: 1000 };
    assert_eq!(
        decode_rgb(&png, None, &limits),
        Err(TransformError::TooLarge {
            format: ImageFormat::Png,
            width: 64,
            height: 48,
            max_pixels: 1000
        })
    );
}

#[test]
fn jpeg_cut_in_scan_never_panics() {
    let jpeg = encode(&picture(200, 120), image::ImageFormat::Jpeg);
    for cut in (100..jpeg.len()).step_by(97) {
        for hint in [None, Some(30)] {
            if let Ok(image) = decode_rgb(&jpeg[..cut], hint, &DecodeLimits::default()) {
                assert!(image.width() <= 200 && image.height() <= 120, "cut {cut}");
            }
        }
        // Decoding only the top rows goes through a changed copy of the header.
        let Ok(header) = read_header(&jpeg[..cut], &DecodeLimits::default()) else {
            continue;
        };
        let mut buffers = DecodeBuffers::default();
        for (denominator, rows) in [(1, 10), (1, 200), (4, 10)] {
            if let Ok(frame) = decode_top(&jpeg[..cut], &header, denominator, rows, &mut buffers) {
                assert!(frame.width <= 200 && frame.height <= 120, "cut {cut}");
            }
        }
    }
}

#[test]
fn png_decodes_exactly_and_drops_alpha() {
    let rgb = picture(31, 17);
    let rgba = DynamicImage::ImageRgb8(rgb.clone()).into_rgba8();
    let grey = DynamicImage::ImageRgb8(rgb.clone()).into_luma8();
    let limits = DecodeLimits::default();
    let decoded = |bytes: Vec<u8>| decode_rgb(&bytes, Some(4), &limits).expect("valid png");
    assert_eq!(decoded(encode(&rgb, image::ImageFormat::Png)), rgb);
    assert_eq!(decoded(encode_dynamic(rgba.into())), rgb);
    let grey_rgb = decoded(encode_dynamic(grey.clone().into()));
    assert_eq!(grey_rgb.get_pixel(5, 5).0, [grey.get_pixel(5, 5).0[0]; 3]);
}

/// `source` as a greyscale JPEG.
fn grey_jpeg(source: &RgbImage) -> Vec<u8> {
    let mut grey = Cursor::new(Vec::new());
    DynamicImage::ImageRgb8(source.clone())
        .into_luma8()
        .write_to(&mut grey, image::ImageFormat::Jpeg)
        .expect("encoding a test image");
    grey.into_inner()
}

fn encode_dynamic(image: DynamicImage) -> Vec<u8> {
    let mut out = Cursor::new(Vec::new());
    image
        .write_to(&mut out, image::ImageFormat::Png)
        .expect("encoding a test image");
    out.into_inner()
}

#[test]
fn denominator_keeps_the_shorter_side() {
    let header = |width, height| ImageHeader {
        format: ImageFormat::Jpeg,
        width,
        height,
    };
    let cases = [
        ((500, 375), 224, 1),
        ((500, 375), 180, 1),
        ((500, 375), 94, 4),
        ((500, 375), 47, 8),
        ((500, 375), 1, 8),
        ((4000, 3000), 256, 8),
        ((4000, 3000), 400, 4),
    ];
    for ((w, h), min_side, want) in cases {
        assert_eq!(
            scale_denominator(&header(w, h), min_side),
            want,
            "{w}x{h} {min_side}"
        );
    }
    let png = ImageHeader {
        format: ImageFormat::Png,
        ..header(4000, 3000)
    };
    assert_eq!(scale_denominator(&png, 10), 1);
}

/// Scaled JPEG decoding then resizing looks like full decoding then resizing.
#[test]
fn scaled_decode_matches_full_decode() {
    let source = picture(803, 601);
    let jpeg = encode(&source, image::ImageFormat::Jpeg);
    let limits = DecodeLimits::default();
    let full = decode_rgb(&jpeg, None, &limits).expect("valid jpeg");
    let header = read_header(&jpeg, &limits).expect("valid jpeg");
    let target = 90;
    let full_small = resize_box(&full, (0.0, 0.0, 803.0, 601.0), target, target);
    for (denominator, want_width) in [(2, 402), (4, 201), (8, 101)] {
        let scaled = decode_checked(&jpeg, &header, denominator).expect("valid jpeg");
        assert_eq!(scaled.width(), want_width, "1/{denominator}");
        assert_eq!(scaled.height(), 601_u32.div_ceil(denominator));
        let bounds = (0.0, 0.0, scaled.width() as f64, scaled.height() as f64);
        let small = resize_box(&scaled, bounds, target, target);
        let diff = mean_abs_diff(&full_small, &small);
        assert!(diff < 2.5, "1/{denominator}: mean abs diff {diff}");
    }
}

pub(crate) fn mean_abs_diff(a: &[u8], b: &[u8]) -> f64 {
    assert_eq!(a.len(), b.len());
    let sum: u64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| u64::from(x.abs_diff(y)))
        .sum();
    sum as f64 / a.len() as f64
}

/// The photos shipped in the repository, with their provenance (`assets/photos/`).
fn photos_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/photos")
}

/// Decodes one real photo at reduced scale, from the repository's photos.
#[test]
fn real_photo_decodes_at_scale() {
    let dir = photos_dir();
    let mut photos: Vec<_> = std::fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("jpg") || e.eq_ignore_ascii_case("jpeg"))
        })
        .collect();
    photos.sort();
    let path = photos
        .first()
        .unwrap_or_else(|| panic!("no JPEG under {} (assets/photos/)", dir.display()));
    let bytes = std::fs::read(path).expect("reading a listed photo");
    let limits = DecodeLimits::default();
    let header = read_header(&bytes, &limits).expect("photo header");
    let full = decode_rgb(&bytes, None, &limits).expect("photo decodes");
    assert_eq!((full.width(), full.height()), (header.width, header.height));
    let short = header.width.min(header.height);
    let scaled = decode_rgb(&bytes, Some(short / 8), &limits).expect("photo decodes scaled");
    assert_eq!(
        scaled.width(),
        header.width.div_ceil(8),
        "{}",
        path.display()
    );
    let target = (short / 8).min(64);
    let a = resize_box(
        &full,
        (0.0, 0.0, f64::from(header.width), f64::from(header.height)),
        target,
        target,
    );
    let b = resize_box(
        &scaled,
        (
            0.0,
            0.0,
            f64::from(scaled.width()),
            f64::from(scaled.height()),
        ),
        target,
        target,
    );
    let diff = mean_abs_diff(&a, &b);
    assert!(diff < 6.0, "{}: mean abs diff {diff}", path.display());
}

/// Decodes the top `rows` of `bytes` at `1 / denominator` with a reused buffer and checks
/// them against the whole image decoded at that scale: the same frame, the same pixels.
/// Returns whether decoding stopped early.
fn check_top_rows(name: &str, bytes: &[u8], denominator: u32, rows: u32) -> bool {
    thread_local! {
        static BUFFERS: std::cell::RefCell<DecodeBuffers> = Default::default();
    }
    let header = read_header(bytes, &DecodeLimits::default()).expect("valid jpeg");
    let whole = decode_checked(bytes, &header, denominator).expect("valid jpeg");
    BUFFERS.with_borrow_mut(|buffers| {
        let frame = decode_top(bytes, &header, denominator, rows, buffers).expect("valid jpeg");
        let case = format!("{name} at 1/{denominator}, top {rows} rows");
        assert_eq!(frame.width, whole.width(), "{case}");
        assert_eq!(frame.full_height, whole.height(), "{case}");
        let needed = rows.div_ceil(denominator).min(whole.height());
        assert!(
            needed <= frame.height && frame.height <= whole.height(),
            "{case}"
        );
        let len = (frame.width * needed * 3) as usize;
        let same = buffers.pixels[..len] == whole.as_raw()[..len];
        assert!(same, "{case}: rows differ from the whole image's");
        frame.height < whole.height()
    })
}

/// Table: sequential JPEGs of every chroma layout stop decoding below the rows asked
/// for, at full and reduced scale; progressive ones decode whole. The rows kept equal
/// the whole image's exactly.
#[test]
fn top_rows_match_full_decode() {
    let source = picture(203, 397);
    let cases = [
        ("4:2:0", jpeg_420(&source, false), true),
        ("4:4:4", encode(&source, image::ImageFormat::Jpeg), true),
        ("grey", grey_jpeg(&source), true),
        ("progressive", jpeg_420(&source, true), false),
    ];
    for (name, bytes, sequential) in &cases {
        for (denominator, rows, stops) in [
            (1, 0, true),
            (1, 1, true),
            (1, 100, true),
            (1, 380, true),
            (1, 381, false),
            (1, 397, false),
            (1, u32::MAX, false),
            (4, 50, true),
            (4, 340, false),
        ] {
            let stopped = check_top_rows(name, bytes, denominator, rows);
            assert_eq!(
                stopped,
                stops && *sequential,
                "{name} 1/{denominator} {rows}"
            );
        }
    }
}

/// The same on every shared photo, for the rows a crop might need.
#[test]
fn real_photos_top_rows_match_full_decode() {
    for (name, bytes) in photos_as_jpeg() {
        let header = read_header(&bytes, &DecodeLimits::default()).expect("valid jpeg");
        for rows in [7, header.height / 2 + 5] {
            check_top_rows(&name, &bytes, 1, rows);
        }
    }
}

/// Decodes `area` of `bytes` at `1 / denominator` with a reused buffer and checks the
/// window against the whole image decoded the same way: it covers the area, and inside
/// the area its pixels are the whole image's, but for a cut side's outermost column. Returns the window's share of the image.
fn check_area(name: &str, bytes: &[u8], denominator: u32, area: PixelBox) -> f64 {
    thread_local! {
        static BUFFERS: std::cell::RefCell<DecodeBuffers> = Default::default();
    }
    let header = read_header(bytes, &DecodeLimits::default()).expect("valid jpeg");
    let everything = PixelBox {
        left: 0,
        top: 0,
        right: header.width,
        bottom: header.height,
    };
    let mut whole_buffers = DecodeBuffers::default();
    let whole = decode_area(bytes, &header, denominator, everything, &mut whole_buffers)
        .expect("valid jpeg");
    let case = format!("{name} at 1/{denominator}, {area:?}");
    assert_eq!((whole.left, whole.top), (0, 0), "{case}");
    assert_eq!(
        (whole.width, whole.height),
        (whole.full_width, whole.full_height),
        "{case}"
    );
    BUFFERS.with_borrow_mut(|buffers| {
        let frame = decode_area(bytes, &header, denominator, area, buffers).expect("valid jpeg");
        assert_eq!(
            (frame.full_width, frame.full_height),
            (whole.width, whole.height),
            "{case}"
        );
        let d = denominator;
        let (x0, y0) = (area.left / d, area.top / d);
        let x1 = area.right.div_ceil(d).min(whole.width);
        let y1 = area.bottom.div_ceil(d).min(whole.height);
        assert!(frame.left <= x0 && frame.top <= y0, "{case}: {frame:?}");
        assert!(
            frame.left + frame.width >= x1 && frame.top + frame.height >= y1,
            "{case}: {frame:?}"
        );
        let at = |pixels: &[u8], width: u32, x: u32, y: u32| {
            let i = (y as usize * width as usize + x as usize) * 3;
            [pixels[i], pixels[i + 1], pixels[i + 2]]
        };
        // Chroma upsampling treats a window's cut side as the image's edge: its outermost
        // column may differ (the transforms ask for 16 pixels more on each side).
        let inner_left = if frame.left > 0 { frame.left + 1 } else { 0 };
        let cut_right = frame.left + frame.width < whole.width;
        let inner_right = frame.left + frame.width - u32::from(cut_right);
        for y in y0..y1 {
            for x in x0.max(inner_left)..x1.min(inner_right) {
                let got = at(&buffers.pixels, frame.width, x - frame.left, y - frame.top);
                let want = at(&whole_buffers.pixels, whole.width, x, y);
                assert_eq!(got, want, "{case}: pixel ({x}, {y})");
            }
        }
        f64::from(frame.width * frame.height) / f64::from(whole.width * whole.height)
    })
}

/// Table: every chroma layout, sequential and progressive, at full and reduced scale;
/// corners, the middle, strips and single pixels decode as in the whole image. With
/// libjpeg-turbo, a small area in the middle costs a small window.
#[test]
fn areas_match_the_whole_image() {
    let source = picture(203, 397);
    let cases = [
        ("4:2:0", jpeg_420(&source, false)),
        ("4:4:4", encode(&source, image::ImageFormat::Jpeg)),
        ("grey", grey_jpeg(&source)),
        ("progressive", jpeg_420(&source, true)),
        ("png", encode(&source, image::ImageFormat::Png)),
    ];
    let area = |left, top, right, bottom| PixelBox {
        left,
        top,
        right,
        bottom,
    };
    for (name, bytes) in &cases {
        for denominator in [1, 2, 4] {
            if *name == "png" && denominator > 1 {
                continue;
            }
            for window in [
                area(0, 0, 203, 397),
                area(0, 0, 40, 30),
                area(150, 350, 203, 397),
                area(60, 100, 140, 300),
                area(0, 200, 203, 201),
                area(101, 0, 102, 397),
                area(77, 77, 78, 78),
            ] {
                check_area(name, bytes, denominator, window);
            }
        }
        let share = check_area(name, bytes, 1, area(64, 160, 128, 240));
        if cfg!(imgrun_libjpeg) && *name != "png" {
            assert!(
                share < 0.25,
                "{name}: a 64x80 area decoded {share} of the image"
            );
        }
    }
}

/// On every shared photo, a crop-sized area through the crop decoder looks like the
/// same pixels of zune-jpeg's whole-image decode (two decoders: not bit for bit).
#[test]
fn real_photo_areas_match_a_full_decode() {
    for (name, bytes) in photos_as_jpeg() {
        let header = read_header(&bytes, &DecodeLimits::default()).expect("valid jpeg");
        let (w, h) = (header.width, header.height);
        let area = PixelBox {
            left: w / 5,
            top: h / 3,
            right: w * 4 / 5,
            bottom: h * 5 / 6,
        };
        check_area(&name, &bytes, 1, area);
        let whole = decode_rgb(&bytes, None, &DecodeLimits::default()).expect("valid jpeg");
        let mut buffers = DecodeBuffers::default();
        let frame = decode_area(&bytes, &header, 1, area, &mut buffers).expect("valid jpeg");
        let row_len = (area.right - area.left) as usize * 3;
        let (mut got, mut want) = (Vec::new(), Vec::new());
        for y in area.top..area.bottom {
            let start = ((y - frame.top) * frame.width + area.left - frame.left) as usize * 3;
            got.extend_from_slice(&buffers.pixels[start..start + row_len]);
            let start = (y * w + area.left) as usize * 3;
            want.extend_from_slice(&whole.as_raw()[start..start + row_len]);
        }
        let diff = mean_abs_diff(&got, &want);
        assert!(diff < 1.0, "{name}: mean abs diff {diff}");
    }
}

/// Hostile bytes through the crop decoder: a JPEG cut anywhere in its scan is an error
/// (libjpeg) or a smaller image (zune-jpeg), never a panic, and with libjpeg-turbo an
/// area that reaches past the cut is always an error that says the data ended early.
/// Bytes changed in the scan decode to something or fail, never panic.
#[test]
fn cut_or_changed_jpeg_through_areas() {
    let jpeg = jpeg_420(&picture(200, 120), false);
    let header = read_header(&jpeg, &DecodeLimits::default()).expect("valid jpeg");
    let everything = PixelBox {
        left: 0,
        top: 0,
        right: 200,
        bottom: 120,
    };
    let mut buffers = DecodeBuffers::default();
    for cut in (100..jpeg.len()).step_by(97) {
        for denominator in [1, 2, 8] {
            let result = decode_area(&jpeg[..cut], &header, denominator, everything, &mut buffers);
            if cfg!(imgrun_libjpeg) {
                match result {
                    Err(TransformError::Undecodable { reason, .. }) => {
                        assert!(reason.contains("end of JPEG"), "cut {cut}: {reason}");
                    }
                    other => panic!("cut {cut} at 1/{denominator}: {other:?}"),
                }
            } else if let Ok(frame) = result {
                assert!(frame.width <= 200 && frame.height <= 120, "cut {cut}");
            }
        }
    }
    let mut changed = jpeg.clone();
    let scan = jpeg.len() / 3;
    for (i, at) in (scan..jpeg.len() - 2).step_by(53).enumerate() {
        changed[at] = changed[at].wrapping_add(1 + i as u8);
        if let Ok(frame) = decode_area(&changed, &header, 1, everything, &mut buffers) {
            assert!(
                frame.width <= 200 && frame.height <= 120,
                "changed byte {at}"
            );
        }
    }
}

/// A frame of 12-bit samples, which neither the header reader nor an 8-bit libjpeg
/// takes, is an error that names the precision.
#[test]
fn twelve_bit_frame_is_an_error() {
    let mut bytes = jpeg_420(&picture(64, 48), false);
    let sof = bytes
        .windows(2)
        .position(|w| w == [0xFF, 0xC0])
        .expect("baseline JPEG has SOF0");
    bytes[sof + 1] = 0xC1;
    bytes[sof + 4] = 12;
    match read_header(&bytes, &DecodeLimits::default()) {
        Err(TransformError::Undecodable { reason, .. }) => {
            assert!(reason.contains("12"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}

/// CMYK JPEG, which libjpeg does not turn into RGB, still decodes (through zune-jpeg).
#[test]
fn cmyk_jpeg_decodes_an_area() {
    let source = picture(64, 48);
    let cmyk: Vec<u8> = source
        .pixels()
        .flat_map(|p| [255 - p[0], 255 - p[1], 255 - p[2], 0])
        .collect();
    let mut bytes = Vec::new();
    jpeg_encoder::Encoder::new(&mut bytes, 95)
        .encode(&cmyk, 64, 48, jpeg_encoder::ColorType::Cmyk)
        .expect("encoding a test image");
    let header = read_header(&bytes, &DecodeLimits::default()).expect("valid jpeg");
    let area = PixelBox {
        left: 10,
        top: 10,
        right: 30,
        bottom: 20,
    };
    let mut buffers = DecodeBuffers::default();
    let frame = decode_area(&bytes, &header, 1, area, &mut buffers).expect("cmyk decodes");
    assert_eq!((frame.full_width, frame.full_height), (64, 48));
    assert!(frame.left <= 10 && frame.top <= 10);
}
