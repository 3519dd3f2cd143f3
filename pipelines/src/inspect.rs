//! Looking into shards: a one-line summary per shard (`imgrun shards ls`) and a full
//! check that every sample decodes as training would decode it (`imgrun shards verify`).

use std::ops::ControlFlow;

use crate::error::{ErrorPolicy, ShardError, escaped};
use crate::reader::{ReadStats, SampleReader};
use crate::sample::{Sample, decode_int_field};
use crate::transform::{DecodeLimits, decode_rgb};

/// What `shards ls` prints for one shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardSummary {
    pub url: String,
    pub samples: u64,
    pub payload_bytes: u64,
    pub first_key: Option<String>,
    pub last_key: Option<String>,
    /// Field names seen, sorted.
    pub extensions: Vec<String>,
}

/// Reads a shard through and summarises it.
pub fn summarize_shard(reader: &SampleReader, url: &str) -> Result<ShardSummary, ShardError> {
    let mut summary = ShardSummary {
        url: url.to_string(),
        samples: 0,
        payload_bytes: 0,
        first_key: None,
        last_key: None,
        extensions: Vec::new(),
    };
    let mut stats = ReadStats::default();
    // The visitor never breaks, so the flow is always `Continue`.
    let _flow = reader.read_shard(url, &mut stats, &mut |sample| {
        summary.samples += 1;
        summary.payload_bytes += sample.payload_bytes();
        if summary.first_key.is_none() {
            summary.first_key = Some(sample.key.clone());
        }
        for (extension, _) in &sample.fields {
            if !summary.extensions.contains(extension) {
                summary.extensions.push(extension.clone());
            }
        }
        summary.last_key = Some(sample.key);
        ControlFlow::Continue(())
    })?;
    summary.extensions.sort();
    Ok(summary)
}

/// One problem found by [`verify_shard`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub url: String,
    /// The sample's key, when the problem is in one sample.
    pub key: Option<String>,
    pub message: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.key {
            Some(key) => {
                let key = escaped(key.as_bytes());
                write!(f, "{}: sample `{key}`: {}", self.url, self.message)
            }
            None => write!(f, "{}", self.message),
        }
    }
}

/// What [`verify_shard`] checks in each sample besides the tar structure.
#[derive(Debug, Clone, Default)]
pub struct VerifyChecks {
    /// Field every sample must have (`cls`).
    pub label: Option<String>,
    /// Number of classes: the label must be in `0..classes`, as the trainer requires.
    pub classes: Option<u64>,
    /// Limits images are decoded under: the defaults are the ones training uses.
    pub limits: DecodeLimits,
}

/// What [`verify_shard`] found.
#[derive(Debug, Default)]
pub struct VerifyReport {
    pub samples: u64,
    pub images: u64,
    pub problems: Vec<Problem>,
}

/// Image field names, by the last dot-component as the Python decoder picks handlers.
const IMAGE_EXTENSIONS: &[&str] = &["jpg", "jpeg", "png", "ppm", "pgm", "pbm", "pnm"];
const INT_EXTENSIONS: &[&str] = &["cls", "cls2", "index", "inx", "id"];

/// Reads every sample of a shard, decodes its images (with the decoder and limits of
/// training) and integer labels, and reports every problem (tar damage with its byte
/// offset, undecodable or oversized images, labels missing or out of range) without
/// stopping.
pub fn verify_shard(reader: &SampleReader, url: &str, checks: &VerifyChecks) -> VerifyReport {
    let reader = reader.clone().with_policy(ErrorPolicy::Skip);
    let mut report = VerifyReport::default();
    let mut stats = ReadStats::default();
    let result = reader.read_shard(url, &mut stats, &mut |sample| {
        report.samples += 1;
        check_sample(&sample, checks, &mut report);
        ControlFlow::Continue(())
    });
    if let Err(error) = result {
        report.problems.push(shard_problem(url, &error));
    }
    for error in &stats.problems {
        report.problems.push(shard_problem(url, error));
    }
    report
}

fn shard_problem(url: &str, error: &ShardError) -> Problem {
    Problem {
        url: url.to_string(),
        key: None,
        message: error.to_string(),
    }
}

fn check_sample(sample: &Sample, checks: &VerifyChecks, report: &mut VerifyReport) {
    let problem = |message: String| Problem {
        url: sample.url.to_string(),
        key: Some(sample.key.clone()),
        message,
    };
    for (name, bytes) in &sample.fields {
        let handler = name.rsplit('.').next().unwrap_or(name);
        if IMAGE_EXTENSIONS.contains(&handler) {
            report.images += 1;
            if let Err(e) = decode_rgb(bytes, None, &checks.limits) {
                report.problems.push(problem(format!(
                    "field `{}` is not a decodable image: {e}",
                    escaped(name.as_bytes())
                )));
            }
        } else if INT_EXTENSIONS.contains(&handler)
            && let Err(e) = decode_int_field(bytes)
        {
            report.problems.push(problem(format!(
                "field `{}`: {}",
                escaped(name.as_bytes()),
                escaped(e.as_bytes())
            )));
        }
    }
    if let Some(label) = checks.label.as_deref() {
        match (sample.int_field(label), checks.classes) {
            (None, _) => report
                .problems
                .push(problem(format!("has no `{label}` field"))),
            // An integer field's own decoding problem was reported above.
            (Some(Err(e)), _) if !INT_EXTENSIONS.contains(&label) => {
                report.problems.push(problem(format!(
                    "field `{label}`: {}",
                    escaped(e.as_bytes())
                )));
            }
            (Some(Ok(value)), Some(classes))
                if !u64::try_from(value).is_ok_and(|v| v < classes) =>
            {
                report.problems.push(problem(format!(
                    "label {value} is outside the {classes} classes (0 to {})",
                    classes.saturating_sub(1)
                )));
            }
            _ => {}
        }
    }
}

/// Formats a byte count for people (`1.23 GB`).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "kB", "MB", "GB", "TB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1000.0 && unit + 1 < UNITS.len() {
        value /= 1000.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::Sample;
    use crate::source::Sources;
    use crate::writer::TarWriter;

    /// A valid PNG of `width` x `height` grey pixels.
    fn png(width: u32, height: u32) -> Vec<u8> {
        let mut bytes = Vec::new();
        let image = image::GrayImage::new(width, height);
        image
            .write_to(
                &mut std::io::Cursor::new(&mut bytes),
                image::ImageFormat::Png,
            )
            .expect("encode png");
        bytes
    }

    #[test]
    fn verify_checks_labels_and_pixels_as_training_does() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("v.tar");
        let samples = [
            Sample::new("fine").with("png", png(8, 8)).with_class(2),
            Sample::new("big").with("png", png(40, 30)).with_class(0),
            Sample::new("over").with("png", png(8, 8)).with_class(3),
            Sample::new("negative")
                .with("png", png(8, 8))
                .with("cls", b"-1".to_vec()),
            Sample::new("nolabel").with("png", png(8, 8)),
            Sample::new("bad\x1b[2Jkey")
                .with("png", b"\x89PNG junk".to_vec())
                .with_class(1),
        ];
        let mut writer = TarWriter::new(std::fs::File::create(&path).expect("create"));
        for sample in &samples {
            writer.write(sample).expect("write");
        }
        writer.finish().expect("finish");
        let url = path.display().to_string();
        let reader = SampleReader::new(Sources::default());
        let checks = VerifyChecks {
            label: Some("cls".into()),
            classes: Some(3),
            limits: DecodeLimits { max_pixels: 1000 },
        };
        let report = verify_shard(&reader, &url, &checks);
        let found: Vec<String> = report.problems.iter().map(|p| p.to_string()).collect();
        let want = [
            "sample `big`: field `png` is not a decodable image: png image of 40x30 exceeds the limit of 1000 pixels",
            "sample `over`: label 3 is outside the 3 classes (0 to 2)",
            "sample `negative`: label -1 is outside the 3 classes (0 to 2)",
            "sample `nolabel`: has no `cls` field",
            "sample `bad\\u{1b}[2Jkey`: field `png` is not a decodable image",
        ];
        assert_eq!(found.len(), want.len(), "{found:#?}");
        for (found, want) in found.iter().zip(want) {
            assert!(found.contains(want), "`{found}` lacks `{want}`");
            assert!(found.starts_with(&url), "`{found}` names the shard");
        }
        assert_eq!((report.samples, report.images), (6, 6));
        // Without a class count, only presence is checked; the limits are training's.
        let defaults = VerifyChecks {
            label: Some("cls".into()),
            ..VerifyChecks::default()
        };
        assert_eq!(defaults.limits, DecodeLimits::default());
        let report = verify_shard(&reader, &url, &defaults);
        assert_eq!(report.problems.len(), 2, "{:?}", report.problems);
    }
}
