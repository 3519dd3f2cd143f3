//! One loader worker: a reader thread that streams the worker's items ahead, and the
//! decoder thread that shuffles, decodes, augments and batches.

use std::ops::ControlFlow;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread;

use super::batch::{Batch, BufferPool, SampleId};
use super::cursor::LoaderWorkerCursor;
use super::shuffle::ShuffleBuffer;
use super::stats::{EpochStats, ReadingNow};
use super::{LoaderConfig, LoaderError, Transform};
use crate::error::{ErrorPolicy, ShardError};
use crate::plan::{LoaderWorkerPlan, Rank, SplitMix64, WorkItem, mix64};
use crate::reader::{ReadStats, SampleReader};
use crate::sample::Sample;

/// Mixed into the worker's seed for its shuffle buffer, so shuffling and augmentation
/// draw from unrelated streams.
const SHUFFLE_STREAM: u64 = 0x5348_5546_464c_4531;

/// What a loader worker sends its rank.
#[derive(Debug)]
pub enum LoaderWorkerMsg {
    /// A batch, and the worker's cursor once the batch is handed out.
    Batch(Batch, LoaderWorkerCursor),
    /// The worker's data (or its planned batches) is finished.
    Done,
    Failed(LoaderError),
}

/// One loader worker's share of an epoch: what it reads (its part of the plan), how it
/// batches and transforms, and where it starts. A rank's epoch makes one per worker; a
/// loader elsewhere (a loader actor) gets one over the network and runs it the same way.
#[derive(Debug, Clone)]
pub struct LoaderWorkerRun {
    pub epoch: u64,
    pub rank: Rank,
    pub plan: LoaderWorkerPlan,
    pub batch_size: usize,
    pub drop_partial: bool,
    pub transform: Transform,
    /// Where the worker starts: at the beginning, or after what its rank already took.
    pub resume: LoaderWorkerCursor,
}

/// The counters one epoch's workers share with whoever reads them: what was skipped, and
/// the shard each worker reads now.
#[derive(Debug, Clone, Default)]
pub struct EpochTally {
    pub(crate) stats: Arc<Mutex<EpochStats>>,
    pub(crate) reading: Arc<ReadingNow>,
}

impl EpochTally {
    /// The counts so far.
    pub fn stats(&self) -> EpochStats {
        self.stats
            .lock()
            .map(|s| s.clone())
            .unwrap_or_else(|e| e.into_inner().clone())
    }

    /// Adds counts gathered elsewhere (a remote worker's, since its last report).
    pub fn add(&self, more: &EpochStats) {
        let mut stats = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        stats.merge(more);
    }

    /// Notes a problem that skipped nothing (a loader that moved, a count that was off).
    pub fn note(&self, problem: String) {
        self.stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .note(problem);
    }

    pub fn reading(&self) -> Arc<ReadingNow> {
        self.reading.clone()
    }
}

/// Everything one worker needs for one epoch.
struct LoaderWorkerJob {
    epoch: u64,
    rank: Rank,
    plan: LoaderWorkerPlan,
    batch_size: usize,
    drop_partial: bool,
    transform: Transform,
    config: Arc<LoaderConfig>,
    reader: SampleReader,
    resume: LoaderWorkerCursor,
    stats: Arc<Mutex<EpochStats>>,
    reading: Arc<ReadingNow>,
    out: SyncSender<LoaderWorkerMsg>,
}

/// Starts the threads of `run`, counting into `tally` and sending to `out`. They stop by
/// themselves at the end of the worker's epoch, or as soon as `out`'s receiver is gone.
pub(crate) fn spawn(
    run: LoaderWorkerRun,
    config: Arc<LoaderConfig>,
    reader: SampleReader,
    tally: &EpochTally,
    out: SyncSender<LoaderWorkerMsg>,
) -> Result<(), LoaderError> {
    let job = LoaderWorkerJob {
        epoch: run.epoch,
        rank: run.rank,
        plan: run.plan,
        batch_size: run.batch_size,
        drop_partial: run.drop_partial,
        transform: run.transform,
        config,
        reader,
        resume: run.resume,
        stats: tally.stats.clone(),
        reading: tally.reading.clone(),
        out,
    };
    let name = format!("imgrun-load-r{}w{}", job.rank, job.plan.worker);
    thread::Builder::new()
        .name(name)
        .spawn(move || job.run())
        .map(drop)
        .map_err(|source| LoaderError::Thread { source })
}

type ReadResult = Result<Sample, ShardError>;

impl LoaderWorkerJob {
    fn run(self) {
        let out = self.out.clone();
        if let Err(error) = self.batch_all() {
            let _ = out.send(LoaderWorkerMsg::Failed(error));
        }
    }

    fn batch_all(self) -> Result<(), LoaderError> {
        let worker = self.plan.worker;
        let quota = self.plan.batches;
        let mut cursor = self.resume;
        if quota.is_some_and(|q| cursor.batches >= q) {
            let _ = self.out.send(LoaderWorkerMsg::Done);
            return Ok(());
        }
        let samples = self.start_reader()?;
        let mut pull = || samples.recv().ok();
        let mut shuffle = ShuffleBuffer::new(
            self.config.shuffle_buffer,
            self.config.shuffle_initial,
            SplitMix64::new(mix64(self.plan.seed ^ SHUFFLE_STREAM)),
        );
        let values = self.transform.slot_len() * self.batch_size;
        let pool = BufferPool::new(
            self.transform.output(),
            values,
            self.config.queue_batches + 2,
        );
        let augment_base = mix64(self.plan.seed);
        let size = self.transform.size();
        let mut ordinal: u64 = 0;
        let mut batch: Option<Batch> = None;
        while quota.is_none_or(|q| cursor.batches < q) {
            let sample = match shuffle.next(&mut pull) {
                None => break,
                Some(Err(error)) => return Err(error.into()),
                Some(Ok(sample)) => sample,
            };
            let this = ordinal;
            ordinal += 1;
            if this < self.resume.consumed {
                // Used up before the resume: only the stream's order matters here.
                continue;
            }
            let filling = batch.get_or_insert_with(|| {
                Batch::new(self.epoch, worker, size, pool.take(), pool.clone())
            });
            let mut rng = SplitMix64::new(mix64(augment_base.wrapping_add(this)));
            match self.load(&sample, &mut rng, filling) {
                Ok(label) => {
                    filling.labels.push(label);
                    filling.ids.push(SampleId {
                        url: sample.url.clone(),
                        key: sample.key,
                    });
                }
                Err(problem) => self.bad_sample(&sample, problem)?,
            }
            if filling.len() == self.batch_size
                && let Some(full) = batch.take()
            {
                cursor.batches += 1;
                cursor.samples += full.len() as u64;
                cursor.consumed = this + 1;
                if self.out.send(LoaderWorkerMsg::Batch(full, cursor)).is_err() {
                    return Ok(());
                }
            }
        }
        let keep_partial = !self.drop_partial && quota.is_none_or(|q| cursor.batches < q);
        if let Some(partial) = batch.take()
            && keep_partial
            && !partial.is_empty()
        {
            cursor.batches += 1;
            cursor.samples += partial.len() as u64;
            cursor.consumed = ordinal;
            if self
                .out
                .send(LoaderWorkerMsg::Batch(partial, cursor))
                .is_err()
            {
                return Ok(());
            }
        }
        let _ = self.out.send(LoaderWorkerMsg::Done);
        Ok(())
    }

    /// Decodes one sample into the next slot of `batch` and returns its label.
    fn load(
        &self,
        sample: &Sample,
        rng: &mut SplitMix64,
        batch: &mut Batch,
    ) -> Result<i64, String> {
        let fields: Vec<&str> = self
            .config
            .image_fields
            .iter()
            .map(String::as_str)
            .collect();
        let Some((field, bytes)) = sample.first_of(&fields) else {
            return Err(format!("no image field (looked for {})", fields.join(", ")));
        };
        let label_field = &self.config.label_field;
        let label = match sample.int_field(label_field) {
            None => return Err(format!("no `{label_field}` field")),
            Some(Err(problem)) => return Err(format!("bad `{label_field}` field: {problem}")),
            Some(Ok(label)) => label,
        };
        let slot = batch.len();
        self.transform
            .apply(bytes, rng, batch.images_mut(), slot)
            .map_err(|problem| format!("`{field}`: {problem}"))?;
        Ok(label)
    }

    fn bad_sample(&self, sample: &Sample, problem: String) -> Result<(), LoaderError> {
        match self.config.errors {
            ErrorPolicy::Fail => Err(LoaderError::Sample {
                url: sample.url.to_string(),
                key: sample.key.clone(),
                problem,
            }),
            ErrorPolicy::Skip => {
                let key = crate::error::escaped(sample.key.as_bytes());
                let message = format!("{}: sample `{key}`: {problem}", sample.url);
                tracing::warn!(rank = %self.rank, worker = %self.plan.worker, "skipping bad sample: {message}");
                if let Ok(mut stats) = self.stats.lock() {
                    stats.bad_samples += 1;
                    stats.note(message);
                }
                Ok(())
            }
        }
    }

    /// Starts the reader thread; its samples arrive in plan order on the receiver, which
    /// closes at the end of the worker's items.
    fn start_reader(&self) -> Result<Receiver<ReadResult>, LoaderError> {
        let (tx, rx) = sync_channel(self.config.prefetch_samples.max(1));
        let items = self.plan.items.clone();
        let reader = self.reader.clone();
        let stats = self.stats.clone();
        let reading = self.reading.clone();
        let worker = self.plan.worker.0;
        let name = format!("imgrun-read-r{}w{}", self.rank, self.plan.worker);
        thread::Builder::new()
            .name(name)
            .spawn(move || {
                read_items(&items, &reader, &tx, &stats, &reading, worker);
                reading.stop(worker);
            })
            .map_err(|source| LoaderError::Thread { source })?;
        Ok(rx)
    }
}

/// Streams `items` in order, each one's samples `start, start + stride, ...` (at most
/// `take`), until the items end or the decoder hangs up.
fn read_items(
    items: &[WorkItem],
    reader: &SampleReader,
    tx: &SyncSender<ReadResult>,
    stats: &Mutex<EpochStats>,
    reading: &ReadingNow,
    worker: u32,
) {
    let mut read = ReadStats::default();
    for item in items {
        if item.take == Some(0) {
            continue;
        }
        let received = reading.start(worker, &item.url);
        let stride = item.stride.max(1);
        let (mut position, mut taken) = (0u64, 0u64);
        let mut hung_up = false;
        let result =
            reader.read_shard_counted(&item.url, Some(received), &mut read, &mut |sample| {
                let at = position;
                position += 1;
                if at < item.start || (at - item.start) % stride != 0 {
                    return ControlFlow::Continue(());
                }
                if tx.send(Ok(sample)).is_err() {
                    hung_up = true;
                    return ControlFlow::Break(());
                }
                taken += 1;
                if item.take.is_some_and(|take| taken >= take) {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            });
        if let Some(expected) = item.samples.filter(|_| item.is_whole_shard())
            && (taken > expected || (!hung_up && result.is_ok() && taken < expected))
        {
            count_mismatch(&item.url, expected, taken, hung_up, stats);
        }
        if hung_up {
            break;
        }
        if let Err(error) = result {
            let _ = tx.send(Err(error));
            break;
        }
    }
    if let Ok(mut stats) = stats.lock() {
        stats.add_read(read);
    }
}

/// A shard read whole that does not hold the samples its count (the manifest's, or
/// `data.samples_per_shard`) says: the plan's batches were counted from a wrong number.
fn count_mismatch(url: &str, expected: u64, taken: u64, cut: bool, stats: &Mutex<EpochStats>) {
    let holds = if cut {
        format!("at least {taken}")
    } else {
        taken.to_string()
    };
    let message = format!(
        "{url}: the shard holds {holds} samples and its count says {expected} (a stale \
         manifest or a wrong data.samples_per_shard; `imgrun shards index` counts them)"
    );
    tracing::warn!("{message}");
    if let Ok(mut stats) = stats.lock() {
        stats.note(message);
    }
}
