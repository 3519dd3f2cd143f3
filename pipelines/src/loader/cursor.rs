//! Where a rank's epoch stands: small enough to write into every checkpoint, and enough
//! to continue the epoch exactly.
//!
//! A worker's stream is a pure function of its plan (items, seed), so the cursor only
//! counts: how many batches each worker delivered and how many samples of its shuffled
//! stream those batches used up (bad samples included). A resumed worker reads its
//! items again, runs the shuffle buffer with the same seed, passes over that many
//! samples without decoding them, and goes on from there; the rank asks its workers in
//! the same turn as before. The plan's fingerprint makes resuming against a different
//! plan an error instead of silently wrong data.

use serde::{Deserialize, Serialize};

use super::LoaderError;
use crate::plan::{Plan, RankPlan, mix64};

/// One rank's position in one epoch.
///
/// With cross-worker mixing, batches are handed out in blocks that are mixed together;
/// `turn` and `workers` are then the positions at the start of the current block, and
/// `in_block` the batches of it already handed out (a resume decodes the block again
/// and passes over those).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankCursor {
    pub epoch: u64,
    pub rank: u32,
    /// A hash of the rank's plan (items and seeds of every worker).
    pub plan: u64,
    /// Batches handed out, empty ones included.
    pub steps: u64,
    /// Batches mixed together per block (1: no mixing).
    pub mix_batches: u64,
    /// Batches of the current block handed out.
    pub in_block: u64,
    /// The worker asked for the next batch (at the start of the block).
    pub turn: u32,
    /// Each worker's position (at the start of the block).
    pub workers: Vec<LoaderWorkerCursor>,
}

/// One loader worker's position.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderWorkerCursor {
    /// Batches of this worker handed out.
    pub batches: u64,
    /// Samples in those batches.
    pub samples: u64,
    /// Samples of the worker's shuffled stream those batches used up (bad ones too).
    pub consumed: u64,
}

impl RankCursor {
    pub(crate) fn start(plan: &Plan, rank: &RankPlan, mix_batches: u64) -> Self {
        Self {
            mix_batches,
            epoch: plan.epoch,
            rank: rank.rank.0,
            plan: fingerprint(plan, rank),
            steps: 0,
            in_block: 0,
            turn: 0,
            workers: vec![LoaderWorkerCursor::default(); rank.workers.len()],
        }
    }

    /// Checks that this cursor was taken from this plan and rank.
    pub(crate) fn check(
        &self,
        whole: &Plan,
        plan: &RankPlan,
        mix_batches: u64,
    ) -> Result<(), LoaderError> {
        let epoch = whole.epoch;
        let problem = if self.epoch != epoch {
            format!("the cursor is from epoch {}, not {epoch}", self.epoch)
        } else if self.rank != plan.rank.0 {
            format!(
                "the cursor is rank {}'s, not rank {}'s",
                self.rank, plan.rank
            )
        } else if self.workers.len() != plan.workers.len() {
            format!(
                "the cursor has {} loader workers, the plan {}",
                self.workers.len(),
                plan.workers.len()
            )
        } else if self.plan != fingerprint(whole, plan) {
            "the cursor was taken from a different plan (other shards, seed, cluster \
             shape or batch settings)"
                .to_string()
        } else if self.mix_batches != mix_batches {
            format!(
                "the cursor mixed batches in blocks of {}, the loader is set to {mix_batches}",
                self.mix_batches
            )
        } else if self.in_block > self.steps || self.in_block >= mix_batches.max(1) {
            format!(
                "the cursor's block ({}) is longer than its steps",
                self.in_block
            )
        } else if self.turn as usize >= plan.workers.len().max(1) {
            format!("the cursor's turn {} names no worker", self.turn)
        } else {
            return Ok(());
        };
        Err(LoaderError::Cursor { problem })
    }
}

/// A stable hash of everything a rank's stream depends on in its plan.
fn fingerprint(whole: &Plan, plan: &RankPlan) -> u64 {
    let mut h = mix64(u64::from(plan.rank.0));
    let mut add = |x: u64| h = mix64(h ^ x);
    add(whole.batch_size);
    add(u64::from(whole.drop_partial));
    for worker in &plan.workers {
        add(u64::from(worker.worker.0));
        add(worker.seed);
        add(worker.stream_offset);
        add(worker.batches.unwrap_or(u64::MAX));
        for item in &worker.items {
            for chunk in item.url.as_bytes().chunks(8) {
                let mut word = [0u8; 8];
                word[..chunk.len()].copy_from_slice(chunk);
                add(u64::from_le_bytes(word));
            }
            add(item.url.len() as u64);
            add(item.start);
            add(item.stride);
            add(item.take.unwrap_or(u64::MAX));
        }
    }
    add(plan.empty_batches);
    h
}
