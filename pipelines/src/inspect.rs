//! Looking into shards: a one-line summary per shard (`imgrun shards ls`) and a full
//! check that every sample decodes (`imgrun shards verify`).

use std::ops::ControlFlow;

use crate::error::{ErrorPolicy, ShardError};
use crate::reader::{ReadStats, SampleReader};
use crate::sample::{Sample, decode_int_field};

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
            Some(key) => write!(f, "{}: sample `{key}`: {}", self.url, self.message),
            None => write!(f, "{}", self.message),
        }
    }
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

/// Reads every sample of a shard, decodes its images and integer labels, and reports
/// every problem (tar damage with its byte offset, undecodable fields) without stopping.
/// `label` names the field that must be present in every sample (`cls`), if any.
pub fn verify_shard(reader: &SampleReader, url: &str, label: Option<&str>) -> VerifyReport {
    let reader = reader.clone().with_policy(ErrorPolicy::Skip);
    let mut report = VerifyReport::default();
    let mut stats = ReadStats::default();
    let result = reader.read_shard(url, &mut stats, &mut |sample| {
        report.samples += 1;
        check_sample(&sample, label, &mut report);
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

fn check_sample(sample: &Sample, label: Option<&str>, report: &mut VerifyReport) {
    let problem = |message: String| Problem {
        url: sample.url.to_string(),
        key: Some(sample.key.clone()),
        message,
    };
    for (name, bytes) in &sample.fields {
        let handler = name.rsplit('.').next().unwrap_or(name);
        if IMAGE_EXTENSIONS.contains(&handler) {
            report.images += 1;
            if let Err(e) = image::load_from_memory(bytes) {
                report.problems.push(problem(format!(
                    "field `{name}` is not a decodable image: {e}"
                )));
            }
        } else if INT_EXTENSIONS.contains(&handler) {
            if let Err(e) = decode_int_field(bytes) {
                report
                    .problems
                    .push(problem(format!("field `{name}`: {e}")));
            }
        }
    }
    if let Some(label) = label {
        if sample.field(label).is_none() {
            report
                .problems
                .push(problem(format!("has no `{label}` field")));
        }
    }
}
