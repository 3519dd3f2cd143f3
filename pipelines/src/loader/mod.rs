//! The loader: one epoch of one rank's [`Plan`] turned into batches of decoded,
//! augmented images in preallocated buffers.
//!
//! Each loader worker of the rank is two threads. The *reader* streams the worker's work
//! items (shards or strided shard slices) in plan order into a bounded channel, so the
//! next shard is opened and read while the current one is still being decoded. The
//! *decoder* takes samples through a shuffle buffer, decodes and augments each one
//! straight into a slot of the batch it is filling, and sends whole batches to a bounded
//! per-worker queue. [`EpochBatches`] takes one batch from each worker in turn (as a
//! data loader does, and as the planner counted), pads the end with empty batches when
//! the plan says so, and keeps the [`RankCursor`] that resumes the epoch exactly.
//!
//! Determinism: every random choice (the shuffle buffer, each sample's crop and flip)
//! comes from the worker's planned seed, and a sample's augmentation from its position
//! in the worker's shuffled stream, so the same plan gives the same batches in the same
//! order however fast the threads run, and a resumed epoch continues with exactly the
//! batches an uninterrupted one would have produced.
//!
//! Bad samples (undecodable image, missing or bad label) and bad shards follow the
//! [`ErrorPolicy`]: skipped and counted in the [`EpochStats`] (the default), or the end
//! of the epoch with an error naming the shard and the sample.
//!
//! Files, bottom up: a file uses only files on the lines before its own.
//! 1. `batch`, `cursor`, `shuffle`, `stats`: leaves.
//! 2. `regroup` (the rest of an epoch for fewer ranks), `worker` (a loader worker's two
//!    threads).
//! 3. `epoch` ([`EpochBatches`]), `wire` (a worker's messages as frames).

mod batch;
mod cursor;
mod epoch;
mod regroup;
mod shuffle;
mod stats;
mod wire;
mod worker;

use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};

pub use batch::{Batch, Images, SampleId};
pub use cursor::{LoaderWorkerCursor, RankCursor};
pub use epoch::{EpochBatches, LoaderWorkerPlacement};
pub use regroup::{Regrouped, regroup};
pub use stats::{EpochStats, ReadingNow, ShardReading};
pub use wire::{FrameDecoder, FrameError, encode_frame};
pub use worker::{EpochTally, LoaderWorkerMsg, LoaderWorkerRun};

use crate::error::{ErrorPolicy, ShardError};
use crate::plan::{Plan, PlanError, Rank};
use crate::reader::SampleReader;
use crate::source::Sources;
use crate::transform::{EvalTransform, OutputFormat, TrainTransform, TransformError};

/// The image transform of an epoch. Pass a different one per epoch for progressive
/// resizing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Transform {
    Train(TrainTransform),
    Eval(EvalTransform),
}

impl Transform {
    /// Output side in pixels.
    pub fn size(&self) -> u32 {
        match self {
            Self::Train(t) => t.size,
            Self::Eval(t) => t.size,
        }
    }

    pub fn output(&self) -> OutputFormat {
        match self {
            Self::Train(t) => t.output,
            Self::Eval(t) => t.output,
        }
    }

    /// Values in one sample's slot.
    pub fn slot_len(&self) -> usize {
        self.output().slot_len(self.size())
    }

    /// Decodes and transforms one image into slot `index` of `images`.
    fn apply(
        &self,
        bytes: &[u8],
        rng: &mut crate::plan::SplitMix64,
        images: &mut Images,
        index: usize,
    ) -> Result<(), TransformError> {
        let len = self.slot_len();
        let range = index * len..(index + 1) * len;
        match (self, images) {
            (Self::Train(t), Images::U8(buf)) => t.apply_u8(bytes, rng, &mut buf[range]),
            (Self::Train(t), Images::F32(buf)) => t.apply_f32(bytes, rng, &mut buf[range]),
            (Self::Eval(t), Images::U8(buf)) => t.apply_u8(bytes, &mut buf[range]),
            (Self::Eval(t), Images::F32(buf)) => t.apply_f32(bytes, &mut buf[range]),
        }
    }
}

/// How a rank's loader workers turn samples into batches. The batch size and whether
/// partial batches are kept come from the [`Plan`], so loader and plan always agree.
#[derive(Debug, Clone)]
pub struct LoaderConfig {
    /// Fields holding the image, tried in order (the first present is used).
    pub image_fields: Vec<String>,
    /// The integer field holding the label.
    pub label_field: String,
    /// Samples each worker's shuffle buffer holds (0 or 1: no shuffling).
    pub shuffle_buffer: usize,
    /// Samples the shuffle buffer holds before it gives out the first one.
    pub shuffle_initial: usize,
    /// Ready batches each worker may queue ahead of the trainer (back-pressure).
    pub queue_batches: usize,
    /// Samples the reader may read ahead of the decoder (the shard prefetch).
    pub prefetch_samples: usize,
    /// What to do with bad samples and shards.
    pub errors: ErrorPolicy,
    /// Cross-worker shuffle: batches are taken in blocks of this many and their samples
    /// shuffled across the block, each batch keeping its size (0 or 1: off).
    pub mix_batches: usize,
}

impl Default for LoaderConfig {
    fn default() -> Self {
        Self {
            image_fields: ["jpg", "jpeg", "png"].map(String::from).to_vec(),
            label_field: "cls".into(),
            shuffle_buffer: 1000,
            shuffle_initial: 100,
            queue_batches: 2,
            prefetch_samples: 256,
            errors: ErrorPolicy::Skip,
            mix_batches: 1,
        }
    }
}

/// Why an epoch could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoaderError {
    #[error(transparent)]
    Shard(#[from] ShardError),
    #[error("{url}: sample `{}`: {problem}", crate::error::escaped(key.as_bytes()))]
    Sample {
        url: String,
        key: String,
        problem: String,
    },
    #[error("the plan has no rank {rank} (world size {world})")]
    NoSuchRank { rank: Rank, world: u32 },
    #[error("invalid loader setting `{field}`: {problem}")]
    Config {
        field: &'static str,
        problem: String,
    },
    #[error("cannot resume: {problem}")]
    Cursor { problem: String },
    #[error("cannot deal the rest of the epoch to the surviving ranks: {problem}")]
    Regroup { problem: String },
    #[error("rank {rank} loader worker {worker}: {message}")]
    Remote {
        rank: Rank,
        worker: u32,
        message: String,
    },
    #[error("rank {rank} loader worker {worker} stopped without finishing its epoch")]
    WorkerLost { rank: Rank, worker: u32 },
    #[error("cannot start a loader thread: {source}")]
    Thread {
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Plan(#[from] PlanError),
}

/// Loads epochs of plans: holds the settings and the shard reader shared by all epochs.
#[derive(Debug, Clone)]
pub struct Loader {
    config: Arc<LoaderConfig>,
    reader: SampleReader,
}

impl Loader {
    pub fn new(config: LoaderConfig, sources: Sources) -> Result<Self, LoaderError> {
        if config.image_fields.is_empty() {
            return Err(LoaderError::Config {
                field: "image_fields",
                problem: "name at least one field".into(),
            });
        }
        if config.queue_batches == 0 {
            return Err(LoaderError::Config {
                field: "queue_batches",
                problem: "must be at least 1".into(),
            });
        }
        let reader = SampleReader::new(sources).with_policy(config.errors);
        Ok(Self {
            config: Arc::new(config),
            reader,
        })
    }

    pub fn config(&self) -> &LoaderConfig {
        &self.config
    }

    /// The shards it opened so far (over all its epochs), by kind of source.
    pub fn source_counts(&self) -> crate::SourceCounts {
        self.reader.source_counts()
    }

    /// Starts `rank`'s epoch of `plan`: spawns its workers and returns the batches, in
    /// order. With `resume`, continues an epoch from the cursor a previous run reported
    /// (taken from the same plan), without repeating or skipping a sample.
    pub fn epoch(
        &self,
        plan: &Plan,
        rank: Rank,
        transform: Transform,
        resume: Option<&RankCursor>,
    ) -> Result<EpochBatches, LoaderError> {
        self.epoch_placed(plan, rank, transform, resume, &mut self.clone())
    }

    /// [`Loader::epoch`], with each worker started by `placement` (which may run some of
    /// them elsewhere and pass their batches here).
    pub fn epoch_placed(
        &self,
        plan: &Plan,
        rank: Rank,
        transform: Transform,
        resume: Option<&RankCursor>,
        placement: &mut dyn LoaderWorkerPlacement,
    ) -> Result<EpochBatches, LoaderError> {
        EpochBatches::start(
            placement,
            plan,
            rank,
            transform,
            self.config.mix_batches,
            resume,
        )
    }

    /// Starts one worker in this process: its threads count into `tally` and send to
    /// `out`, and stop at the end of the worker's epoch or when `out`'s receiver is gone.
    pub fn start_worker(
        &self,
        run: LoaderWorkerRun,
        tally: &EpochTally,
        out: SyncSender<LoaderWorkerMsg>,
    ) -> Result<(), LoaderError> {
        worker::spawn(run, self.config.clone(), self.reader.clone(), tally, out)
    }
}

/// Every worker in this process.
impl LoaderWorkerPlacement for Loader {
    fn start(
        &mut self,
        run: LoaderWorkerRun,
        tally: &EpochTally,
    ) -> Result<Receiver<LoaderWorkerMsg>, LoaderError> {
        let (out, batches) = sync_channel(self.config.queue_batches);
        self.start_worker(run, tally, out)?;
        Ok(batches)
    }
}
