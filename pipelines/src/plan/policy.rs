//! The plan itself, and the batch policy that makes every rank run the same number of
//! steps: counting each worker's batches, then joining, dropping or repeating.

use std::collections::BTreeSet;

use super::config::{BatchPolicy, ClusterShape, PlanConfig, PlanError, PlanMode};
use super::hooks::HookName;
use super::shards::WorkItem;
use super::{LoaderWorkerId, Rank};

/// One epoch's plan for the whole cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub epoch: u64,
    pub seed: u64,
    pub mode: PlanMode,
    pub policy: BatchPolicy,
    pub cluster: ClusterShape,
    pub batch_size: u64,
    pub drop_partial: bool,
    /// Shards in the input list.
    pub shards: usize,
    /// Samples in the input list, when every count is known.
    pub dataset_samples: Option<u64>,
    /// Shards whose count was assumed (`default_samples_per_shard`).
    pub assumed_counts: usize,
    /// Samples served per epoch when fixed (resampled mode, chopped epochs).
    pub epoch_size: Option<u64>,
    /// The epoch length reported to schedules and progress, in samples.
    pub nominal_size: Option<u64>,
    /// Where each hook came from, in call order.
    pub hooks: Vec<(HookName, String)>,
    pub ranks: Vec<RankPlan>,
    pub consistency: Consistency,
}

/// One rank's epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankPlan {
    pub rank: Rank,
    /// The node it runs on.
    pub node: u32,
    pub workers: Vec<LoaderWorkerPlan>,
    /// Samples it trains on (after the policy), when known.
    pub samples: Option<u64>,
    /// Batches with data (after the policy), when known.
    pub batches: Option<u64>,
    /// `join`: empty batches it takes part with after its data runs out.
    pub empty_batches: u64,
    /// `drop` and `repeat`: batches cut to match the other ranks.
    pub dropped_batches: u64,
    /// `repeat`: batches served beyond one pass over its data.
    pub repeated_batches: u64,
}

/// One loader worker's epoch: read `items` in order, batch them, stop at the end.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LoaderWorkerPlan {
    pub worker: LoaderWorkerId,
    /// Seed for the worker's own randomness (sample shuffling, augmentation), derived
    /// from (seed, epoch, rank, worker).
    pub seed: u64,
    /// Where this epoch starts in the worker's endless stream (`epoch * samples per
    /// epoch`; 0 for unchopped split epochs).
    pub stream_offset: u64,
    pub items: Vec<WorkItem>,
    /// Samples its items yield, when known.
    pub samples: Option<u64>,
    /// Batches it produces (the last one partial when partial batches are kept).
    pub batches: Option<u64>,
    /// Batches cut by the policy.
    pub dropped_batches: u64,
}

/// Whether every rank runs the same number of steps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Consistency {
    /// Every rank runs `steps` steps (batches, plus empty ones under `join`).
    Consistent { steps: u64 },
    /// Ranks run these different numbers of batches: training would hang.
    Inconsistent { batches: Vec<u64> },
    /// Some counts are unknown, so batches cannot be counted ahead.
    Unknown { shards_without_counts: usize },
}

impl Plan {
    /// Ok when every rank is known to run the same number of steps (or, with unknown
    /// counts, when the `join` policy evens them out at run time).
    pub fn check(&self) -> Result<(), PlanError> {
        match &self.consistency {
            Consistency::Consistent { .. } => Ok(()),
            Consistency::Inconsistent { batches } => Err(PlanError::InconsistentBatches {
                batches: batches.clone(),
            }),
            Consistency::Unknown { .. } if self.policy == BatchPolicy::Join => Ok(()),
            Consistency::Unknown {
                shards_without_counts,
            } => Err(PlanError::Unchecked {
                missing: *shards_without_counts,
            }),
        }
    }

    /// Steps every rank runs, when consistent.
    pub fn steps(&self) -> Option<u64> {
        match self.consistency {
            Consistency::Consistent { steps } => Some(steps),
            _ => None,
        }
    }

    /// `nominal_size` in batches per rank, for schedules and progress.
    pub fn nominal_batches(&self) -> Option<u64> {
        let per_rank = self.nominal_size? / u64::from(self.cluster.world_size());
        Some(if self.drop_partial {
            per_rank / self.batch_size
        } else {
            per_rank.div_ceil(self.batch_size)
        })
    }
}

/// A worker's stream before the policy.
#[derive(Debug)]
pub(crate) struct RawLoaderWorker {
    pub worker: LoaderWorkerId,
    pub seed: u64,
    pub stream_offset: u64,
    pub items: Vec<WorkItem>,
    pub samples: Option<u64>,
    /// The items are whole shards drawn until at least `samples`, read until the worker
    /// has served its batches: never cut by count.
    pub drawn_whole: bool,
}

/// The parts of a plan that do not depend on the workers' streams.
#[derive(Debug)]
pub(crate) struct PlanContext<'a> {
    pub config: &'a PlanConfig,
    pub epoch: u64,
    pub epoch_size: Option<u64>,
    pub nominal_size: Option<u64>,
    pub dataset_samples: Option<u64>,
    pub assumed_counts: usize,
    pub hooks: Vec<(HookName, String)>,
}

/// Counts batches and applies the policy.
pub(crate) fn apply(ctx: PlanContext<'_>, ranks: Vec<Vec<RawLoaderWorker>>) -> Plan {
    let config = ctx.config;
    let batches = |samples: u64| {
        if config.drop_partial {
            samples / config.batch_size
        } else {
            samples.div_ceil(config.batch_size)
        }
    };
    let mut ranks = ranks;
    let mut one_pass: Vec<Vec<Option<u64>>> = Vec::with_capacity(ranks.len());
    for workers in &mut ranks {
        one_pass.push(workers.iter().map(|w| w.samples.map(batches)).collect());
        if let BatchPolicy::Repeat { dsrepeat, .. } = config.policy {
            for worker in workers.iter_mut() {
                worker.items = std::iter::repeat_n(worker.items.clone(), dsrepeat as usize)
                    .flatten()
                    .collect();
                worker.samples = worker.samples.map(|s| s.saturating_mul(dsrepeat));
            }
        }
    }
    let worker_batches: Option<Vec<Vec<u64>>> = ranks
        .iter()
        .map(|workers| workers.iter().map(|w| w.samples.map(batches)).collect())
        .collect();

    let (rank_plans, consistency) = match worker_batches {
        None => {
            let unknown: BTreeSet<&str> = ranks
                .iter()
                .flatten()
                .flat_map(|w| &w.items)
                .filter(|i| i.samples.is_none())
                .map(|i| i.url.as_str())
                .collect();
            let consistency = Consistency::Unknown {
                shards_without_counts: unknown.len(),
            };
            let plans = ranks
                .into_iter()
                .enumerate()
                .map(|(r, workers)| rank_plan(config, r, workers, None, 0, &[]))
                .collect();
            (plans, consistency)
        }
        Some(worker_batches) => {
            let totals: Vec<u64> = worker_batches.iter().map(|w| w.iter().sum()).collect();
            let min = totals.iter().copied().min().unwrap_or(0);
            let max = totals.iter().copied().max().unwrap_or(0);
            // The batches every rank serves, and the steps (with empty batches) they run.
            let (target, steps) = match config.policy {
                BatchPolicy::None => (max, max),
                BatchPolicy::Join => (max, max),
                BatchPolicy::Drop { nbatches } | BatchPolicy::Repeat { nbatches, .. } => {
                    let target = nbatches.unwrap_or(min);
                    (target, target)
                }
            };
            let mut plans = Vec::with_capacity(ranks.len());
            let mut served = Vec::with_capacity(ranks.len());
            for (r, workers) in ranks.into_iter().enumerate() {
                let quotas = round_robin(&worker_batches[r], target.min(totals[r]));
                let empty = if config.policy == BatchPolicy::Join {
                    steps - totals[r]
                } else {
                    0
                };
                let plan = rank_plan(config, r, workers, Some(&quotas), empty, &one_pass[r]);
                served.push(plan.batches.unwrap_or(0) + plan.empty_batches);
                plans.push(plan);
            }
            let consistency = if served.iter().all(|&s| s == steps) {
                Consistency::Consistent { steps }
            } else {
                Consistency::Inconsistent { batches: served }
            };
            (plans, consistency)
        }
    };

    Plan {
        epoch: ctx.epoch,
        seed: config.seed,
        mode: config.mode,
        policy: config.policy,
        cluster: config.cluster.clone(),
        batch_size: config.batch_size,
        drop_partial: config.drop_partial,
        shards: config.shards.len(),
        dataset_samples: ctx.dataset_samples,
        assumed_counts: ctx.assumed_counts,
        epoch_size: ctx.epoch_size,
        nominal_size: ctx.nominal_size,
        hooks: ctx.hooks,
        ranks: rank_plans,
        consistency,
    }
}

/// One rank's plan; `quotas` are the batches each worker serves (None: unknown counts).
fn rank_plan(
    config: &PlanConfig,
    rank: usize,
    workers: Vec<RawLoaderWorker>,
    quotas: Option<&[u64]>,
    empty_batches: u64,
    one_pass: &[Option<u64>],
) -> RankPlan {
    let rank = Rank(rank as u32);
    let batch = config.batch_size;
    let mut plans = Vec::with_capacity(workers.len());
    let (mut dropped, mut repeated) = (0, 0);
    for (w, raw) in workers.into_iter().enumerate() {
        let Some(quotas) = quotas else {
            plans.push(LoaderWorkerPlan {
                worker: raw.worker,
                seed: raw.seed,
                stream_offset: raw.stream_offset,
                items: raw.items,
                samples: raw.samples,
                batches: None,
                dropped_batches: 0,
            });
            continue;
        };
        let samples = raw.samples.unwrap_or(0);
        let full = if config.drop_partial {
            samples / batch
        } else {
            samples.div_ceil(batch)
        };
        let quota = quotas[w];
        // All of its batches: every sample, less a dropped partial batch. Fewer: whole
        // batches only (the partial one is always last).
        let served = if quota == full {
            if config.drop_partial {
                full * batch
            } else {
                samples
            }
        } else {
            quota * batch
        };
        dropped += full - quota;
        if let Some(Some(first)) = one_pass.get(w) {
            repeated += quota.saturating_sub(*first);
        }
        plans.push(LoaderWorkerPlan {
            worker: raw.worker,
            seed: raw.seed,
            stream_offset: raw.stream_offset,
            items: if raw.drawn_whole {
                raw.items
            } else {
                truncate(raw.items, served)
            },
            samples: Some(served),
            batches: Some(quota),
            dropped_batches: full - quota,
        });
    }
    RankPlan {
        rank,
        node: config.cluster.node_of(rank),
        samples: plans.iter().map(|w| w.samples).sum(),
        batches: plans.iter().map(|w| w.batches).sum(),
        workers: plans,
        empty_batches,
        dropped_batches: dropped,
        repeated_batches: repeated,
    }
}

/// The first `samples` samples of a list of items with known counts.
fn truncate(items: Vec<WorkItem>, samples: u64) -> Vec<WorkItem> {
    let mut left = samples;
    let mut out = Vec::with_capacity(items.len());
    for mut item in items {
        let n = item.samples.unwrap_or(0);
        if left == 0 {
            break;
        }
        if n == 0 {
            continue;
        }
        if n > left {
            item.take = Some(left);
            item.samples = Some(left);
        }
        left -= item.samples.unwrap_or(0);
        out.push(item);
    }
    out
}

/// How many of `total` batches each worker serves when a rank takes one batch from each
/// worker in turn (skipping workers that have run out), as a data loader does.
pub(crate) fn round_robin(batches: &[u64], total: u64) -> Vec<u64> {
    let served = |rounds: u64| batches.iter().map(|&b| b.min(rounds)).sum::<u64>();
    // The most full rounds that fit in `total`.
    let (mut lo, mut hi) = (0, batches.iter().copied().max().unwrap_or(0));
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if served(mid) <= total {
            lo = mid
        } else {
            hi = mid - 1
        }
    }
    let mut left = total - served(lo);
    batches
        .iter()
        .map(|&b| {
            let mut n = b.min(lo);
            if left > 0 && b > lo {
                n += 1;
                left -= 1;
            }
            n
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_takes_one_batch_per_worker_in_turn() {
        let cases: &[(&[u64], u64, &[u64])] = &[
            (&[18, 8, 9], 26, &[9, 8, 9]),
            (&[18, 8, 9], 35, &[18, 8, 9]),
            (&[18, 8, 9], 0, &[0, 0, 0]),
            (&[5, 5, 5], 7, &[3, 2, 2]),
            (&[0, 4], 3, &[0, 3]),
            (&[], 0, &[]),
        ];
        for (batches, total, want) in cases {
            assert_eq!(round_robin(batches, *total), *want, "{batches:?} {total}");
        }
    }

    #[test]
    fn truncate_cuts_the_last_item() {
        let item = |n| WorkItem {
            url: "a".into(),
            start: 0,
            stride: 1,
            take: None,
            samples: Some(n),
        };
        let got = truncate(vec![item(5), item(0), item(5), item(5)], 7);
        let kept: Vec<_> = got.iter().map(|i| (i.samples, i.take)).collect();
        assert_eq!(kept, [(Some(5), None), (Some(2), Some(2))]);
    }
}
