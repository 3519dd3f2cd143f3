//! What an epoch's loader workers read now ([`ReadingNow`]) and what the epoch served
//! and skipped ([`EpochStats`]): the counts the workers keep and the epoch reports. A
//! leaf of `loader/`, below `worker.rs` and `epoch.rs`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::reader::ReadStats;

/// How many problems [`EpochStats`] keeps word for word; the rest are only counted.
const KEPT_PROBLEMS: usize = 32;

/// The shard each loader worker of an epoch reads now, and the bytes received from it so
/// far: what a rank that waits for data waits for.
#[derive(Debug, Default)]
pub struct ReadingNow(Mutex<std::collections::BTreeMap<u32, (String, Arc<AtomicU64>)>>);

/// One worker's shard in [`ReadingNow`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardReading {
    pub worker: u32,
    pub url: String,
    pub bytes: u64,
}

impl ReadingNow {
    /// What every worker reads now, by worker.
    pub fn snapshot(&self) -> Vec<ShardReading> {
        let reading = self.0.lock().unwrap_or_else(|e| e.into_inner());
        reading
            .iter()
            .map(|(&worker, (url, bytes))| ShardReading {
                worker,
                url: url.clone(),
                bytes: bytes.load(Ordering::Relaxed),
            })
            .collect()
    }

    /// `worker` starts reading `url`; returns the counter of its bytes.
    pub(crate) fn start(&self, worker: u32, url: &str) -> Arc<AtomicU64> {
        let counter = Arc::new(AtomicU64::new(0));
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(worker, (url.to_string(), counter.clone()));
        counter
    }

    /// `worker` reads nothing now.
    pub(crate) fn stop(&self, worker: u32) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&worker);
    }
}

/// What an epoch served and skipped, so far.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EpochStats {
    /// Samples handed out in batches.
    pub samples: u64,
    /// Batches with samples handed out.
    pub batches: u64,
    /// Empty batches handed out (the `join` policy, or data short of the plan).
    pub empty_batches: u64,
    /// Samples skipped as bad: undecodable image, missing or bad label.
    pub bad_samples: u64,
    /// Samples the shard reader skipped (duplicate fields, oversized members).
    pub skipped_in_shards: u64,
    /// Shards (or the rest of shards) the reader could not read and skipped.
    pub skipped_shards: u64,
    /// The first problems, in the order met.
    pub problems: Vec<String>,
}

impl EpochStats {
    pub(crate) fn note(&mut self, problem: String) {
        if self.problems.len() < KEPT_PROBLEMS {
            self.problems.push(problem);
        }
    }

    pub(crate) fn add_read(&mut self, read: ReadStats) {
        self.skipped_in_shards += read.skipped_samples;
        self.skipped_shards += read.skipped_shards;
        for problem in read.problems {
            self.note(problem.to_string());
        }
    }

    /// Adds `more` (counts gathered elsewhere) to these.
    pub fn merge(&mut self, more: &EpochStats) {
        self.samples += more.samples;
        self.batches += more.batches;
        self.empty_batches += more.empty_batches;
        self.bad_samples += more.bad_samples;
        self.skipped_in_shards += more.skipped_in_shards;
        self.skipped_shards += more.skipped_shards;
        for problem in &more.problems {
            self.note(problem.clone());
        }
    }

    /// What these counts gained since `earlier` (taken from the same tally): the
    /// difference of every count and the problems kept after it.
    pub fn since(&self, earlier: &EpochStats) -> EpochStats {
        EpochStats {
            samples: self.samples.saturating_sub(earlier.samples),
            batches: self.batches.saturating_sub(earlier.batches),
            empty_batches: self.empty_batches.saturating_sub(earlier.empty_batches),
            bad_samples: self.bad_samples.saturating_sub(earlier.bad_samples),
            skipped_in_shards: self
                .skipped_in_shards
                .saturating_sub(earlier.skipped_in_shards),
            skipped_shards: self.skipped_shards.saturating_sub(earlier.skipped_shards),
            problems: self
                .problems
                .get(earlier.problems.len()..)
                .unwrap_or_default()
                .to_vec(),
        }
    }

    /// Everything skipped, of every kind.
    pub fn skipped(&self) -> u64 {
        self.bad_samples + self.skipped_in_shards + self.skipped_shards
    }
}
