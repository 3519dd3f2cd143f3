//! Where a loader worker's time goes on real shards, one stage at a time on one thread:
//! reading samples out of the tar stream, decoding an image at full size, and the train
//! transform (decode at the scale the crop needs, crop, resample, flip). `imgrun bench
//! loader` prints it beside the whole loader's rate.

use std::ops::ControlFlow;
use std::time::Instant;

use crate::error::ShardError;
use crate::plan::SplitMix64;
use crate::reader::{ReadStats, SampleReader};
use crate::transform::{TrainTransform, decode_rgb};

/// One thread's time per stage over the same images.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StageProfile {
    /// Images read (samples with an image field).
    pub images: u64,
    /// Their image bytes.
    pub image_bytes: u64,
    /// Reading the shards into samples.
    pub read_s: f64,
    /// Decoding every image at full size.
    pub decode_s: f64,
    /// The train transform of every image.
    pub transform_s: f64,
    /// Images that did not decode or transform (counted, not timed).
    pub bad_images: u64,
}

impl StageProfile {
    /// Milliseconds per image of a stage that took `seconds`.
    pub fn ms_per_image(&self, seconds: f64) -> f64 {
        seconds * 1e3 / self.images.max(1) as f64
    }
}

/// Reads the samples of `urls` in order until `max_images` images or `max_seconds` of
/// reading, keeping the first of `image_fields` of each; then decodes each at full size,
/// then applies `transform` to each (into a `u8` slot), timing every stage.
pub fn profile_stages(
    reader: &SampleReader,
    urls: &[String],
    image_fields: &[String],
    transform: &TrainTransform,
    max_images: u64,
    max_seconds: f64,
) -> Result<StageProfile, ShardError> {
    let fields: Vec<&str> = image_fields.iter().map(String::as_str).collect();
    let mut images: Vec<Vec<u8>> = Vec::new();
    let mut stats = ReadStats::default();
    let started = Instant::now();
    let full = |images: &Vec<Vec<u8>>| {
        images.len() as u64 >= max_images || started.elapsed().as_secs_f64() >= max_seconds
    };
    for url in urls {
        // A break only comes when the limit is reached, which is checked below.
        let _flow = reader.read_shard(url, &mut stats, &mut |sample| {
            if let Some((_, bytes)) = sample.first_of(&fields) {
                images.push(bytes.to_vec());
            }
            if full(&images) {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })?;
        if full(&images) {
            break;
        }
    }
    let read_s = started.elapsed().as_secs_f64();
    let mut bad = 0u64;
    let started = Instant::now();
    for bytes in &images {
        match decode_rgb(bytes, None, &transform.limits) {
            Ok(image) => {
                std::hint::black_box(image);
            }
            Err(_) => bad += 1,
        }
    }
    let decode_s = started.elapsed().as_secs_f64();
    let mut slot = vec![0u8; transform.output.slot_len(transform.size)];
    let mut rng = SplitMix64::new(0x5052_4f46_494c_4531);
    let started = Instant::now();
    for bytes in &images {
        if transform.apply_u8(bytes, &mut rng, &mut slot).is_ok() {
            std::hint::black_box(&mut slot);
        }
    }
    let transform_s = started.elapsed().as_secs_f64();
    Ok(StageProfile {
        images: images.len() as u64,
        image_bytes: images.iter().map(|b| b.len() as u64).sum(),
        read_s,
        decode_s,
        transform_s,
        bad_images: bad,
    })
}

/// CPU time of this process (all threads) in seconds, to the nanosecond
/// (`CLOCK_PROCESS_CPUTIME_ID`: a run of a few milliseconds still reads as more than
/// nothing, where `/proc`'s ticks of 1/100 s read 0); none where the clock cannot be read.
#[allow(unsafe_code)] // clock_gettime(2): std has no clock of the process's CPU time
pub fn process_cpu_seconds() -> Option<f64> {
    let mut time = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `time` is a valid, writable timespec for the call to fill in.
    let status = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut time) };
    (status == 0).then_some(time.tv_sec as f64 + time.tv_nsec as f64 * 1e-9)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::Sources;
    use crate::synth::{SynthOptions, generate_synthetic};

    #[test]
    fn every_stage_sees_the_same_images() {
        let dir = tempfile::tempdir().expect("temp dir");
        let options = SynthOptions {
            classes: 2,
            per_class: 10,
            size: 32,
            max_count: 8,
            threads: 1,
            ..SynthOptions::default()
        };
        let report = generate_synthetic(dir.path(), &options, &|_| {}).expect("synth");
        let urls: Vec<String> = report
            .shards
            .iter()
            .map(|s| s.path.display().to_string())
            .collect();
        let reader = SampleReader::new(Sources::default());
        let fields = ["jpg".to_string(), "png".to_string()];
        let transform = TrainTransform::new(16);
        let all = profile_stages(&reader, &urls, &fields, &transform, 1000, 60.0).expect("all");
        assert_eq!((all.images, all.bad_images), (20, 0));
        assert!(all.image_bytes > 0 && all.decode_s > 0.0 && all.transform_s > 0.0);
        let some = profile_stages(&reader, &urls, &fields, &transform, 11, 60.0).expect("some");
        assert_eq!(some.images, 11, "stops at the image limit, mid-shard");
        assert!(process_cpu_seconds().is_some_and(|s| s > 0.0));
    }
}
