//! The ordered parallel write pipeline behind every dataset producer (`shards create`
//! from a folder, `shards synth`): samples are made in parallel chunks and written in
//! order, so the output is byte-for-byte the same for the same input, options and seed,
//! whatever the number of threads. With `CreateError`, the error of every dataset
//! producer, and `CreateReport`, what one wrote: the folder's bottom layer, below
//! `folder.rs` and `synth.rs`.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use rayon::prelude::*;

use crate::brace::summarize_names;
use crate::manifest::{MANIFEST_FILE, Manifest};
use crate::s3::put_object;
use crate::sample::Sample;
use crate::stream::S3Options;
use crate::writer::{ShardWriter, WrittenShard};

/// What [`create_from_folder`] or [`generate_synthetic`](crate::generate_synthetic)
/// wrote. The manifest (and `classes.txt`) are already in the output folder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreateReport {
    pub shards: Vec<WrittenShard>,
    pub manifest: Manifest,
    /// Brace spec of the written shard paths (`out/shards-{000000..000012}.tar`).
    pub spec: String,
}

/// Why shards could not be created.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    #[error("cannot list {}: {source}", path.display())]
    Scan { path: PathBuf, source: io::Error },
    #[error("no class folders in {}", path.display())]
    NoClasses { path: PathBuf },
    #[error("no images (.jpg, .jpeg, .png) in class folder {}", path.display())]
    EmptyClass { path: PathBuf },
    #[error("no images to write from {}", path.display())]
    NoImages { path: PathBuf },
    #[error("cannot read image {}: {source}", path.display())]
    ReadImage { path: PathBuf, source: io::Error },
    #[error("cannot decode image {}: {reason}", path.display())]
    DecodeImage { path: PathBuf, reason: String },
    #[error("cannot encode sample `{key}` as JPEG: {source}")]
    EncodeImage {
        key: String,
        source: image::ImageError,
    },
    #[error("cannot create output folder {}: {source}", path.display())]
    CreateOutput { path: PathBuf, source: io::Error },
    #[error("cannot write shard {}: {source}", path.display())]
    WriteShard { path: PathBuf, source: io::Error },
    #[error("cannot write the manifest in {}: {source}", path.display())]
    WriteManifest { path: PathBuf, source: io::Error },
    #[error("cannot start {threads} worker threads: {source}")]
    Threads {
        threads: usize,
        source: rayon::ThreadPoolBuildError,
    },
    #[error("bad option {option}: {reason}")]
    BadOption {
        option: &'static str,
        reason: String,
    },
}

pub(crate) fn bad_option(option: &'static str, reason: &str) -> CreateError {
    CreateError::BadOption {
        option,
        reason: reason.to_string(),
    }
}

/// Samples prepared in parallel before they are handed, in order, to the writer.
const CHUNK: usize = 256;

/// Where and how [`write_samples`] writes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ShardPlan<'a> {
    pub(crate) out: &'a Path,
    pub(crate) prefix: &'a str,
    pub(crate) max_count: u64,
    pub(crate) max_size: u64,
    pub(crate) threads: usize,
    /// How an `s3://bucket/prefix/` output is reached.
    pub(crate) s3: &'a S3Options,
}

impl ShardPlan<'_> {
    /// The output as an object store's prefix (ending with `/`), when it is one.
    fn bucket_prefix(&self) -> Option<String> {
        let out = self.out.to_str().filter(|o| crate::s3::is_object_url(o))?;
        Some(format!("{}/", out.trim_end_matches('/')))
    }
}

/// Builds samples `0..count` with `make` on `plan.threads` threads, a chunk at a time,
/// while a writer thread writes the previous chunk in order; then writes the manifest.
pub(crate) fn write_samples(
    plan: &ShardPlan<'_>,
    classes: Vec<String>,
    count: usize,
    make: &(dyn Fn(usize) -> Result<Sample, CreateError> + Sync),
    progress: &(dyn Fn(u64) + Sync),
) -> Result<CreateReport, CreateError> {
    let pattern = validate_plan(plan)?;
    if plan.bucket_prefix().is_none() {
        fs::create_dir_all(plan.out).map_err(|source| CreateError::CreateOutput {
            path: plan.out.to_path_buf(),
            source,
        })?;
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(plan.threads)
        .thread_name(|i| format!("imgrun-shards-{i}"))
        .build()
        .map_err(|source| CreateError::Threads {
            threads: plan.threads,
            source,
        })?;

    let (sender, receiver) = mpsc::sync_channel::<Batch>(1);
    let shards = std::thread::scope(|scope| {
        let writer = scope.spawn(|| write_batches(plan, &pattern, receiver, progress));
        let produced = produce_batches(&pool, count, make, &sender);
        if produced.is_ok() {
            // A closed channel means the writer failed; its error is returned below.
            let _ = sender.send(Batch::Done);
        }
        drop(sender);
        let written = match writer.join() {
            Ok(written) => written,
            Err(panic) => std::panic::resume_unwind(panic),
        };
        produced?;
        // Invariant: `Done` was sent, so the writer either finished or failed.
        Ok::<_, CreateError>(written?.expect("the writer saw `Done`"))
    })?;

    let manifest = Manifest::new(classes, &shards);
    write_manifest(plan, &manifest).map_err(|source| CreateError::WriteManifest {
        path: plan.out.to_path_buf(),
        source,
    })?;
    let names: Vec<String> = shards
        .iter()
        .map(|s| s.path.to_string_lossy().into_owned())
        .collect();
    tracing::debug!(
        shards = shards.len(),
        samples = manifest.total_samples(),
        "shards created"
    );
    Ok(CreateReport {
        spec: summarize_names(&names),
        shards,
        manifest,
    })
}

/// Writes `manifest.json` and `classes.txt` beside the shards: in the output folder, or
/// as objects under the output prefix, each whole or not at all, after every shard.
fn write_manifest(plan: &ShardPlan<'_>, manifest: &Manifest) -> io::Result<()> {
    let Some(prefix) = plan.bucket_prefix() else {
        return manifest.write_to(plan.out);
    };
    let json = serde_json::to_vec_pretty(manifest).map_err(io::Error::other)?;
    put_object(&format!("{prefix}{MANIFEST_FILE}"), json, plan.s3)?;
    put_object(
        &format!("{prefix}classes.txt"),
        manifest.classes_text().into_bytes(),
        plan.s3,
    )
}

/// Worker threads to use by default: the cores this process may run on.
pub(crate) fn available_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Width of zero-padded sample numbers: six digits, more when needed.
pub(crate) fn key_width(count: usize) -> usize {
    count.saturating_sub(1).to_string().len().max(6)
}

enum Batch {
    Samples(Vec<Sample>),
    /// Every sample was sent: finish the last shard. A channel closed without it means
    /// the producer failed, and the open shard is abandoned, not finished.
    Done,
}

fn produce_batches(
    pool: &rayon::ThreadPool,
    count: usize,
    make: &(dyn Fn(usize) -> Result<Sample, CreateError> + Sync),
    sender: &mpsc::SyncSender<Batch>,
) -> Result<(), CreateError> {
    for start in (0..count).step_by(CHUNK) {
        let end = (start + CHUNK).min(count);
        let results: Vec<Result<Sample, CreateError>> =
            pool.install(|| (start..end).into_par_iter().map(make).collect());
        // The first failure in sample order, so the error does not depend on timing.
        let samples = results.into_iter().collect::<Result<Vec<_>, _>>()?;
        if sender.send(Batch::Samples(samples)).is_err() {
            break;
        }
    }
    Ok(())
}

/// Returns the shards written, or `None` when the producer gave up.
fn write_batches(
    plan: &ShardPlan<'_>,
    pattern: &str,
    receiver: mpsc::Receiver<Batch>,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Option<Vec<WrittenShard>>, CreateError> {
    let mut writer = ShardWriter::new(pattern, plan.max_count, plan.max_size)
        .map_err(|source| CreateError::WriteShard {
            path: PathBuf::from(pattern),
            source,
        })?
        .with_s3(plan.s3.clone());
    let shard_error = |path: Option<&Path>, source: io::Error| CreateError::WriteShard {
        path: path.map_or_else(|| PathBuf::from(pattern), Path::to_path_buf),
        source,
    };
    while let Ok(batch) = receiver.recv() {
        let samples = match batch {
            Batch::Samples(samples) => samples,
            Batch::Done => {
                let last = writer.current_path().map(Path::to_path_buf);
                let shards = writer
                    .finish()
                    .map_err(|e| shard_error(last.as_deref(), e))?;
                return Ok(Some(shards));
            }
        };
        for sample in &samples {
            writer
                .write(sample)
                .map_err(|e| shard_error(writer.current_path(), e))?;
        }
        progress(samples.len() as u64);
    }
    Ok(None)
}

/// Checks the plan and returns the shard name pattern (`out/prefix-%06d.tar`).
fn validate_plan(plan: &ShardPlan<'_>) -> Result<String, CreateError> {
    let prefix = plan.prefix;
    if prefix.is_empty() || prefix.contains(['/', '\\']) || prefix.starts_with('.') {
        return Err(bad_option(
            "prefix",
            "must be a non-empty file name that does not start with `.`",
        ));
    }
    if plan.max_count == 0 {
        return Err(bad_option("max count", "must be at least 1"));
    }
    if plan.max_size == 0 {
        return Err(bad_option("max size", "must be at least 1 byte"));
    }
    if plan.threads == 0 {
        return Err(bad_option("threads", "must be at least 1"));
    }
    let base = plan.out.join(prefix);
    let base = base
        .to_str()
        .ok_or_else(|| bad_option("output folder", "path is not valid UTF-8"))?;
    Ok(format!("{}-%06d.tar", base.replace('%', "%%")))
}
