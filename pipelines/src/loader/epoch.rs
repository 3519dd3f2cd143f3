//! A rank's epoch: its workers started, their batches taken in turn, the end padded to
//! the planned number of steps, the cursor and the counts kept.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::mpsc::Receiver;

use super::batch::{Batch, Held};
use super::cursor::{LoaderWorkerCursor, RankCursor};
use super::stats::{EpochStats, ReadingNow};
use super::worker::{EpochTally, LoaderWorkerMsg, LoaderWorkerRun};
use super::{LoaderError, Transform};
use crate::plan::{Plan, Rank, SplitMix64, derive_seed, mix64};

/// Mixed into the plan's seed for the cross-worker shuffle.
const MIX_STREAM: u64 = 0x4d49_5842_4154_4348;

/// One rank's batches for one epoch, in order. Dropping it stops the workers.
///
/// When the plan knows every rank's step count, exactly that many batches come out,
/// the last ones empty if this rank's data ran short (the `join` policy, or samples
/// skipped as bad); otherwise batches come until the workers' data ends.
///
/// With [`LoaderConfig::mix_batches`] above 1, batches are taken from the workers in
/// blocks of that many and their samples shuffled across the block (WebDataset's
/// unbatch, shuffle, rebatch), each batch keeping its size, so the plan's counts hold.
#[derive(Debug)]
pub struct EpochBatches {
    rank: Rank,
    transform: Transform,
    workers: Vec<LoaderWorker>,
    planned_steps: Option<u64>,
    nominal_steps: Option<u64>,
    /// The current block's positions; `steps` and `in_block` are kept up to date.
    cursor: RankCursor,
    /// The workers' positions and turn as of the last batch taken from them.
    positions: Vec<LoaderWorkerCursor>,
    turn: u32,
    /// The current block's batches not yet handed out.
    block: VecDeque<Batch>,
    /// Batches of the first block already handed out before a resume.
    skip: u64,
    mix_seed: u64,
    tally: EpochTally,
    finished: bool,
}

#[derive(Debug)]
struct LoaderWorker {
    batches: Receiver<LoaderWorkerMsg>,
    done: bool,
}

/// Where a rank's loader workers run: each one's [`LoaderWorkerRun`] is started somewhere, and
/// its messages arrive on the receiver returned. [`Loader::epoch`](super::Loader::epoch)
/// runs them all in this process; a trainer fed by loader actors sends some elsewhere.
pub trait LoaderWorkerPlacement {
    /// Starts `run`; its counts go to `tally` (a remote worker's as it reports them).
    fn start(
        &mut self,
        run: LoaderWorkerRun,
        tally: &EpochTally,
    ) -> Result<Receiver<LoaderWorkerMsg>, LoaderError>;
}

impl EpochBatches {
    pub(crate) fn start(
        placement: &mut dyn LoaderWorkerPlacement,
        plan: &Plan,
        rank: Rank,
        transform: Transform,
        mix_batches: usize,
        resume: Option<&RankCursor>,
    ) -> Result<Self, LoaderError> {
        let Some(rank_plan) = plan.ranks.get(rank.0 as usize) else {
            return Err(LoaderError::NoSuchRank {
                rank,
                world: plan.cluster.world_size(),
            });
        };
        plan.check()?;
        let batch_size = usize::try_from(plan.batch_size)
            .ok()
            .filter(|&b| b > 0)
            .ok_or_else(|| LoaderError::Config {
                field: "batch_size",
                problem: format!("{} is not a usable batch size", plan.batch_size),
            })?;
        let mix = mix_batches.max(1) as u64;
        let mut cursor = match resume {
            Some(cursor) => {
                cursor.check(plan, rank_plan, mix)?;
                cursor.clone()
            }
            None => RankCursor::start(plan, rank_plan, mix),
        };
        // A resume starts the interrupted block again and passes over what it served.
        let skip = cursor.in_block;
        cursor.steps -= cursor.in_block;
        cursor.in_block = 0;
        let tally = EpochTally::default();
        let mut workers = Vec::with_capacity(rank_plan.workers.len());
        for (w, worker_plan) in rank_plan.workers.iter().enumerate() {
            let run = LoaderWorkerRun {
                epoch: plan.epoch,
                rank,
                plan: worker_plan.clone(),
                batch_size,
                drop_partial: plan.drop_partial,
                transform,
                resume: cursor.workers[w],
            };
            workers.push(LoaderWorker {
                batches: placement.start(run, &tally)?,
                done: false,
            });
        }
        Ok(Self {
            rank,
            transform,
            workers,
            planned_steps: plan.steps(),
            nominal_steps: plan.nominal_batches(),
            positions: cursor.workers.clone(),
            turn: cursor.turn,
            cursor,
            block: VecDeque::new(),
            skip,
            mix_seed: derive_seed(plan.seed ^ MIX_STREAM, plan.epoch, rank.0, u32::MAX),
            tally,
            finished: false,
        })
    }

    /// Batches (empty ones included) this rank hands out this epoch, when the plan knows.
    pub fn planned_steps(&self) -> Option<u64> {
        self.planned_steps
    }

    /// The epoch's nominal length in batches (for schedules and progress bars).
    pub fn nominal_steps(&self) -> Option<u64> {
        self.nominal_steps
    }

    /// Where the epoch stands: save it with a checkpoint and pass it to
    /// [`Loader::epoch`](super::Loader::epoch) to continue from here.
    pub fn cursor(&self) -> &RankCursor {
        &self.cursor
    }

    /// Counts so far.
    pub fn stats(&self) -> EpochStats {
        self.tally.stats()
    }

    /// The shards the rank's workers read now, readable from another thread while this
    /// one waits for a batch.
    pub fn reading(&self) -> Arc<ReadingNow> {
        self.tally.reading()
    }

    fn next_batch(&mut self) -> Option<Result<Batch, LoaderError>> {
        if self.finished {
            return None;
        }
        if self.planned_steps.is_some_and(|s| self.cursor.steps >= s) {
            return self.finish();
        }
        if self.block.is_empty() {
            if let Err(error) = self.fill_block() {
                self.finished = true;
                return Some(Err(error));
            }
            let skip = (self.skip as usize).min(self.block.len());
            self.block.drain(..skip);
            self.cursor.steps += skip as u64;
            self.cursor.in_block += skip as u64;
            self.skip = 0;
        }
        if let Some(mut batch) = self.block.pop_front() {
            batch.step = self.cursor.steps;
            self.cursor.steps += 1;
            self.cursor.in_block += 1;
            if self.block.is_empty() {
                // The next block starts from here.
                self.cursor.in_block = 0;
                self.cursor.workers.clone_from(&self.positions);
                self.cursor.turn = self.turn;
            }
            if let Ok(mut stats) = self.tally.stats.lock() {
                stats.samples += batch.len() as u64;
                stats.batches += 1;
            }
            return Some(Ok(batch));
        }
        // Every worker is done: pad to the planned steps.
        if self.planned_steps.is_some_and(|s| self.cursor.steps < s) {
            let empty = Batch::empty(
                self.cursor.epoch,
                self.cursor.steps,
                self.transform.size(),
                self.transform.output(),
            );
            self.cursor.steps += 1;
            if let Ok(mut stats) = self.tally.stats.lock() {
                stats.empty_batches += 1;
            }
            return Some(Ok(empty));
        }
        self.finish()
    }

    /// Takes the next block of batches from the workers, in turn, and mixes it.
    fn fill_block(&mut self) -> Result<(), LoaderError> {
        let want = self.cursor.mix_batches.max(1) as usize;
        while self.block.len() < want {
            match self.take_from_workers()? {
                Some(batch) => self.block.push_back(batch),
                None => break,
            }
        }
        if self.block.len() > 1 {
            let seed = mix64(self.mix_seed ^ self.cursor.steps);
            mix_block(self.block.make_contiguous(), &mut SplitMix64::new(seed));
        }
        Ok(())
    }

    /// The next batch in the workers' turn; `None` when every worker is done.
    fn take_from_workers(&mut self) -> Result<Option<Batch>, LoaderError> {
        let n = self.workers.len();
        for _ in 0..n {
            let w = self.turn as usize;
            self.turn = ((w + 1) % n) as u32;
            if self.workers[w].done {
                continue;
            }
            match self.workers[w].batches.recv() {
                Ok(LoaderWorkerMsg::Batch(batch, position)) => {
                    self.positions[w] = position;
                    return Ok(Some(batch));
                }
                Ok(LoaderWorkerMsg::Done) => self.workers[w].done = true,
                Ok(LoaderWorkerMsg::Failed(error)) => return Err(error),
                Err(_) => {
                    return Err(LoaderError::WorkerLost {
                        rank: self.rank,
                        worker: w as u32,
                    });
                }
            }
        }
        Ok(None)
    }

    fn finish(&mut self) -> Option<Result<Batch, LoaderError>> {
        self.finished = true;
        // Hang up: workers still reading (data beyond the plan) stop at their next send.
        self.workers.clear();
        self.block.clear();
        None
    }
}

/// Shuffles the samples of `batches` across all of them; each batch keeps its size.
fn mix_block(batches: &mut [Batch], rng: &mut SplitMix64) {
    // Slot g of the block is (batch, index); slot g takes the sample of slot `from[g]`.
    let slots: Vec<(usize, usize)> = batches
        .iter()
        .enumerate()
        .flat_map(|(b, batch)| (0..batch.len()).map(move |i| (b, i)))
        .collect();
    let mut from: Vec<usize> = (0..slots.len()).collect();
    rng.shuffle(&mut from);
    let mut placed = vec![false; slots.len()];
    let (mut first, mut moving) = (Held::default(), Held::default());
    // Follow each cycle of the permutation, holding its first sample aside.
    for start in 0..slots.len() {
        if placed[start] || from[start] == start {
            continue;
        }
        let (b, i) = slots[start];
        batches[b].lift(i, &mut first);
        let mut at = start;
        while from[at] != start {
            let (b, i) = slots[from[at]];
            batches[b].lift(i, &mut moving);
            let (b, i) = slots[at];
            batches[b].put(i, &moving);
            placed[at] = true;
            at = from[at];
        }
        let (b, i) = slots[at];
        batches[b].put(i, &first);
        placed[at] = true;
    }
}

impl Iterator for EpochBatches {
    type Item = Result<Batch, LoaderError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_batch()
    }
}
