//! Tests of the train and eval transforms.

use image::RgbImage;
use image::imageops::FilterType::Triangle;
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::transform::decode::tests::{encode, jpeg_420, mean_abs_diff, photos_as_jpeg, picture};
use crate::transform::decode_rgb;
use crate::transform::{IMAGENET_MEAN, IMAGENET_STD, ImageFormat};

fn png(image: &RgbImage) -> Vec<u8> {
    encode(image, image::ImageFormat::Png)
}

fn jpeg(image: &RgbImage) -> Vec<u8> {
    encode(image, image::ImageFormat::Jpeg)
}

fn train_u8(transform: &TrainTransform, bytes: &[u8], seed: u64) -> Vec<u8> {
    let mut out = vec![0u8; transform.output.slot_len(transform.size)];
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    transform
        .apply_u8(bytes, &mut rng, &mut out)
        .expect("valid image");
    out
}

#[test]
fn outputs_have_the_slot_size_and_layout() {
    let bytes = jpeg(&picture(120, 90));
    let norm = OutputFormat::IMAGENET_F32;
    for size in [1, 16, 33, 224] {
        let u8_transform = TrainTransform::new(size);
        let pixels = train_u8(&u8_transform, &bytes, 7);
        assert_eq!(pixels.len(), (size * size * 3) as usize);
        // The f32 slot holds the same pixels, normalised and laid out as CHW.
        let f32_transform = TrainTransform {
            output: norm,
            ..u8_transform
        };
        let mut floats = vec![0f32; norm.slot_len(size)];
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        f32_transform
            .apply_f32(&bytes, &mut rng, &mut floats)
            .expect("valid image");
        let plane = (size * size) as usize;
        for (i, px) in pixels.chunks_exact(3).enumerate() {
            for c in 0..3 {
                let want = (f32::from(px[c]) / 255.0 - IMAGENET_MEAN[c]) / IMAGENET_STD[c];
                assert!((floats[c * plane + i] - want).abs() < 1e-5, "size {size}");
            }
        }
    }
}

#[test]
fn slot_and_parameter_errors() {
    let bytes = png(&picture(40, 30));
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let t = TrainTransform::new(8);
    let mut short = vec![0u8; 10];
    assert_eq!(
        t.apply_u8(&bytes, &mut rng, &mut short),
        Err(TransformError::OutputSlot {
            expected: 192,
            actual: 10
        })
    );
    let mut floats = vec![0f32; 192];
    let mismatch = t.apply_f32(&bytes, &mut rng, &mut floats);
    assert!(matches!(
        mismatch,
        Err(TransformError::InvalidParameters { .. })
    ));
    let bad = [
        TrainTransform { size: 0, ..t },
        TrainTransform {
            scale: (0.5, 0.1),
            ..t
        },
        TrainTransform {
            ratio: (f32::NAN, 1.0),
            ..t
        },
    ];
    for bad in bad {
        let mut out = vec![0u8; 192];
        let result = bad.apply_u8(&bytes, &mut rng, &mut out);
        assert!(
            matches!(result, Err(TransformError::InvalidParameters { .. })),
            "{bad:?}"
        );
    }
    let eval = EvalTransform {
        resize_ratio: 1.5,
        ..EvalTransform::new(8)
    };
    let result = eval.apply_u8(&bytes, &mut [0u8; 192]);
    assert!(matches!(
        result,
        Err(TransformError::InvalidParameters { .. })
    ));
    let garbage = TrainTransform::new(8).apply_u8(b"\xFF\xD8\xFFjunk", &mut rng, &mut [0u8; 192]);
    assert!(matches!(
        garbage,
        Err(TransformError::Undecodable {
            format: ImageFormat::Jpeg,
            ..
        })
    ));
}

#[test]
fn flip_mirrors_rows() {
    let bytes = png(&picture(64, 48));
    let header = read_header(&bytes, &DecodeLimits::default()).expect("valid png");
    let crop = CropBox {
        top: 5,
        left: 9,
        height: 30,
        width: 40,
    };
    let size = 24;
    let render_u8 = |flip| {
        let mut out = vec![0u8; size * size * 3];
        let slot = Slot::U8(&mut out, OutputFormat::Uint8Nhwc);
        render(&bytes, &header, crop, flip, size as u32, slot).expect("valid png");
        out
    };
    let (plain, flipped) = (render_u8(false), render_u8(true));
    assert_ne!(plain, flipped);
    for (a, b) in plain
        .chunks_exact(size * 3)
        .zip(flipped.chunks_exact(size * 3))
    {
        let mirrored: Vec<u8> = b.chunks_exact(3).rev().flatten().copied().collect();
        assert_eq!(a, mirrored.as_slice());
    }
    // With flip enabled, about half the draws mirror.
    let t = TrainTransform {
        scale: (1.0, 1.0),
        ratio: (4.0 / 3.0, 4.0 / 3.0),
        ..TrainTransform::new(16)
    };
    let unflipped = train_u8(&TrainTransform { flip: false, ..t }, &bytes, 0);
    let mirrored_count = (0..200)
        .filter(|&seed| train_u8(&t, &bytes, seed) != unflipped)
        .count();
    assert!(
        (70..130).contains(&mirrored_count),
        "{mirrored_count} of 200 mirrored"
    );
}

/// Table: image size; every crop is inside the image and, unless it is the fallback,
/// follows the scale and ratio ranges.
#[test]
fn crops_stay_in_bounds_and_follow_scale_and_ratio() {
    let scale = (0.08, 1.0);
    let ratio = (3.0 / 4.0, 4.0 / 3.0);
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    for (width, height) in [
        (500, 375),
        (375, 500),
        (224, 224),
        (1, 1),
        (3, 200),
        (4000, 90),
    ] {
        let mut fallbacks = 0;
        for _ in 0..2000 {
            let c = random_resized_crop(width, height, scale, ratio, &mut rng);
            assert!(c.width >= 1 && c.height >= 1, "{width}x{height}: {c:?}");
            assert!(
                c.left + c.width <= width && c.top + c.height <= height,
                "{c:?}"
            );
            let fraction = f64::from(c.width * c.height) / f64::from(width * height);
            let aspect = f64::from(c.width) / f64::from(c.height);
            // Rounding to whole pixels moves a crop by at most half a pixel per side.
            let slack_w = 0.5 / f64::from(c.width);
            let slack_h = 0.5 / f64::from(c.height);
            let in_scale = fraction >= 0.08 * (1.0 - slack_w - slack_h) - 1e-9 && fraction <= 1.0;
            let in_ratio = aspect >= 0.75 * (1.0 - slack_w - slack_h) - 1e-9
                && aspect <= 4.0 / 3.0 * (1.0 + slack_w + slack_h) + 1e-9;
            if !(in_scale && in_ratio) {
                fallbacks += 1;
            }
        }
        let normal_shape = width * 3 >= height * 3 / 4 * 3 && width <= height * 2 && width > 10;
        if normal_shape {
            assert!(
                fallbacks <= 20,
                "{width}x{height}: {fallbacks} out of range"
            );
        }
    }
    let empty = random_resized_crop(0, 5, scale, ratio, &mut rng);
    assert_eq!((empty.width, empty.height), (0, 5));
    // A strip far outside the ratio range always takes the centered fallback.
    let crop = random_resized_crop(1000, 10, scale, ratio, &mut rng);
    assert_eq!(
        crop,
        CropBox {
            top: 0,
            left: 493,
            height: 10,
            width: 13
        }
    );
}

#[test]
fn same_seed_same_bytes() {
    let bytes = jpeg(&picture(300, 200));
    let t = TrainTransform::new(64);
    assert_eq!(train_u8(&t, &bytes, 5), train_u8(&t, &bytes, 5));
    assert_ne!(train_u8(&t, &bytes, 5), train_u8(&t, &bytes, 6));
}

/// A gradient PNG (R = 2x, G = 2y, B = 100) through the eval transform: the expected
/// pixels follow from the center crop's offset and the resize factor.
#[test]
fn eval_center_crop_of_a_gradient() {
    let gradient =
        |w, h| RgbImage::from_fn(w, h, |x, y| image::Rgb([(2 * x) as u8, (2 * y) as u8, 100]));
    // (image size, size, resize ratio, f(x, y) -> expected R, G)
    type Expect = fn(usize, usize) -> (u8, u8);
    let cases: [((u32, u32), u32, f32, Expect); 2] = [
        // No resize: crop left = round((64 - 40) / 2) = 12.
        ((64, 40), 40, 1.0, |x, y| (2 * (x + 12) as u8, 2 * y as u8)),
        // Shorter side 80 -> 40: halved, crop left 16, top 4; a linear ramp averages
        // to its value at the sampling center.
        ((128, 80), 32, 0.8, |x, y| {
            ((65 + 4 * x) as u8, (17 + 4 * y) as u8)
        }),
    ];
    for ((w, h), size, resize_ratio, expect) in cases {
        let t = EvalTransform {
            resize_ratio,
            ..EvalTransform::new(size)
        };
        let mut out = vec![0u8; t.output.slot_len(size)];
        t.apply_u8(&png(&gradient(w, h)), &mut out)
            .expect("valid png");
        let size = size as usize;
        for (i, px) in out.chunks_exact(3).enumerate() {
            let (x, y) = (i % size, i / size);
            let (r, g) = expect(x, y);
            assert_eq!(px, [r, g, 100], "{w}x{h} at ({x}, {y})");
        }
    }
}

#[test]
fn normalisation_math() {
    let bytes = png(&RgbImage::from_pixel(10, 10, image::Rgb([255, 0, 51])));
    let t = EvalTransform {
        output: OutputFormat::Float32Chw {
            mean: [0.5, 0.5, 0.1],
            std: [0.25, 0.5, 2.0],
        },
        ..EvalTransform::new(4)
    };
    let mut out = vec![0f32; 48];
    t.apply_f32(&bytes, &mut out).expect("valid png");
    for (c, want) in [2.0, -1.0, 0.05].into_iter().enumerate() {
        for v in &out[c * 16..(c + 1) * 16] {
            assert!((v - want).abs() < 1e-6, "channel {c}: {v} != {want}");
        }
    }
}

/// The train transform's reduced-scale decoding looks like full-size decoding.
#[test]
fn scaled_decode_train_matches_full_decode() {
    let bytes = jpeg(&picture(1600, 1200));
    let header = read_header(&bytes, &DecodeLimits::default()).expect("valid jpeg");
    let size = 128;
    let run = |denominator| {
        let mut out = vec![0u8; size * size * 3];
        let crop = CropBox {
            top: 100,
            left: 200,
            height: 900,
            width: 1100,
        };
        let slot = Slot::U8(&mut out, OutputFormat::Uint8Nhwc);
        render_at(
            &bytes,
            &header,
            crop.into(),
            false,
            size as u32,
            slot,
            denominator,
        )
        .expect("valid jpeg");
        out
    };
    let full = run(Some(1));
    for d in [None, Some(2), Some(4)] {
        let diff = mean_abs_diff(&full, &run(d));
        assert!(diff < 2.5, "denominator {d:?}: mean abs diff {diff}");
    }
}

/// The crops a seed gives are drawn from the header's size before anything is decoded,
/// and the transform draws nothing else but the flip: no change to decoding may move
/// them. (torchvision's algorithm as `random_resized_crop` implements it, ChaCha8 seeded
/// with 2024, on a 500x375 image.)
#[test]
fn crop_boxes_for_a_seed_are_fixed() {
    let t = TrainTransform::new(224);
    let mut rng = ChaCha8Rng::seed_from_u64(2024);
    let crops: Vec<_> = (0..4)
        .map(|_| random_resized_crop(500, 375, t.scale, t.ratio, &mut rng))
        .collect();
    let crop = |top, left, height, width| CropBox {
        top,
        left,
        height,
        width,
    };
    let want = [
        crop(129, 178, 182, 240),
        crop(6, 69, 363, 278),
        crop(23, 144, 284, 348),
        crop(36, 50, 327, 384),
    ];
    assert_eq!(crops, want);
    let bytes = jpeg_420(&picture(500, 375), false);
    for seed in 0..4 {
        let mut applied = ChaCha8Rng::seed_from_u64(seed);
        let mut out = vec![0u8; t.output.slot_len(t.size)];
        t.apply_u8(&bytes, &mut applied, &mut out)
            .expect("valid jpeg");
        let mut drawn = ChaCha8Rng::seed_from_u64(seed);
        random_resized_crop(500, 375, t.scale, t.ratio, &mut drawn);
        drawn.random_bool(0.5);
        assert_eq!(applied.next_u64(), drawn.next_u64(), "seed {seed}");
    }
}

/// On every shared photo and a few seeds, the train transform (decoding only the rows
/// the crop needs, SIMD resampling) matches an independent reference: the whole image
/// decoded, the same crop cut out and resized by `image`'s triangle filter, then flipped.
#[test]
fn train_matches_a_full_decode_reference_on_photos() {
    let t = TrainTransform::new(224);
    for (name, bytes) in photos_as_jpeg() {
        let full = decode_rgb(&bytes, None, &t.limits).expect("photo decodes");
        for seed in 0..4 {
            let out = train_u8(&t, &bytes, seed);
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let (w, h) = full.dimensions();
            let c = random_resized_crop(w, h, t.scale, t.ratio, &mut rng);
            let flip = rng.random_bool(0.5);
            let cut = image::imageops::crop_imm(&full, c.left, c.top, c.width, c.height);
            let mut want = image::imageops::resize(&cut.to_image(), 224, 224, Triangle);
            if flip {
                image::imageops::flip_horizontal_in_place(&mut want);
            }
            let diff = mean_abs_diff(&out, want.as_raw());
            assert!(diff < 1.0, "{name} seed {seed} {c:?}: mean abs diff {diff}");
        }
    }
}

/// The same for the eval transform: the whole image resized so that its shorter side is
/// 256, then the center 224 x 224.
#[test]
fn eval_matches_a_full_decode_reference_on_photos() {
    let t = EvalTransform::new(224);
    for (name, bytes) in photos_as_jpeg() {
        let full = decode_rgb(&bytes, None, &t.limits).expect("photo decodes");
        let mut out = vec![0u8; t.output.slot_len(224)];
        t.apply_u8(&bytes, &mut out).expect("photo decodes");
        let (w, h) = full.dimensions();
        let (rw, rh) = if w <= h {
            (256, 256 * h / w)
        } else {
            (256 * w / h, 256)
        };
        let resized = image::imageops::resize(&full, rw, rh, Triangle);
        // torchvision's CenterCrop: `int(round((side - 224) / 2))`, ties to even.
        let offset = |side: u32| (f64::from(side - 224) / 2.0).round_ties_even() as u32;
        let (left, top) = (offset(rw), offset(rh));
        let want = image::imageops::crop_imm(&resized, left, top, 224, 224).to_image();
        let diff = mean_abs_diff(&out, want.as_raw());
        assert!(diff < 1.0, "{name}: mean abs diff {diff}");
    }
}

/// The float slot holds exactly the byte slot's pixels, normalised and split into
/// planes, flipped or not, at sizes that are and are not a multiple of the SIMD width.
#[test]
fn float_planes_are_the_normalised_bytes() {
    let bytes = jpeg_420(&picture(120, 90), false);
    let header = read_header(&bytes, &DecodeLimits::default()).expect("valid jpeg");
    let crop = CropBox {
        top: 7,
        left: 11,
        height: 70,
        width: 90,
    };
    let (mean, std) = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]);
    let format = OutputFormat::Float32Chw { mean, std };
    for size in [24, 37, 224] {
        for flip in [false, true] {
            let plane = size * size;
            let mut bytes_out = vec![0u8; plane * 3];
            let slot = Slot::U8(&mut bytes_out, OutputFormat::Uint8Nhwc);
            render(&bytes, &header, crop, flip, size as u32, slot).expect("valid jpeg");
            let mut floats = vec![0f32; plane * 3];
            let slot = Slot::F32(&mut floats, format);
            render(&bytes, &header, crop, flip, size as u32, slot).expect("valid jpeg");
            for (i, pixel) in bytes_out.chunks_exact(3).enumerate() {
                for c in 0..3 {
                    let want = (f32::from(pixel[c]) / 255.0 - mean[c]) / std[c];
                    let got = floats[c * plane + i];
                    assert!((got - want).abs() < 1e-5, "{size} {flip} pixel {i}: {got}");
                }
            }
        }
    }
}
