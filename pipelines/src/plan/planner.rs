//! The planner: each worker's stream for an epoch (the hooks, then the split, the draws
//! with replacement, or the chopped window), handed to the batch policy.

use std::collections::HashMap;

use super::config::{PlanConfig, PlanError, PlanMode, validate};
use super::hooks::Hooks;
use super::policy::{self, Plan, RawLoaderWorker};
use super::rng::{SplitMix64, derive_seed};
use super::script_api::HookContext;
use super::shards::{Slice, WorkItem};
use super::{LoaderWorkerId, Rank};

/// Forms plans: one per epoch, from the settings and the hooks.
#[derive(Debug)]
pub struct Planner {
    config: PlanConfig,
    hooks: Hooks,
    /// The shard list as hooks receive it.
    input: Vec<Slice>,
    /// Sample count by URL, for hooks that return plain URLs.
    known: HashMap<String, Option<u64>>,
    assumed_counts: usize,
}

impl Planner {
    pub fn new(mut config: PlanConfig, hooks: Hooks) -> Result<Self, PlanError> {
        validate(&config)?;
        let mut assumed_counts = 0;
        if let Some(default) = config.default_samples_per_shard {
            for shard in config.shards.iter_mut().filter(|s| s.samples.is_none()) {
                shard.samples = Some(default);
                assumed_counts += 1;
            }
        }
        let mut known = HashMap::new();
        for shard in &config.shards {
            known.entry(shard.url.clone()).or_insert(shard.samples);
        }
        Ok(Self {
            input: config.shards.iter().map(Slice::whole).collect(),
            config,
            hooks,
            known,
            assumed_counts,
        })
    }

    pub fn config(&self) -> &PlanConfig {
        &self.config
    }

    pub fn hooks(&self) -> &Hooks {
        &self.hooks
    }

    /// The plan of one epoch: every (rank, worker)'s work and what the policy did.
    pub fn plan(&self, epoch: u64) -> Result<Plan, PlanError> {
        let cluster = &self.config.cluster;
        let mut ranks = Vec::with_capacity(cluster.world_size() as usize);
        for rank in 0..cluster.world_size() {
            let mut workers = Vec::with_capacity(cluster.workers_per_rank as usize);
            for worker in 0..cluster.workers_per_rank {
                workers.push(self.worker_stream(epoch, Rank(rank), LoaderWorkerId(worker))?);
            }
            ranks.push(workers);
        }
        let dataset_samples = self.dataset_samples();
        let context = policy::PlanContext {
            config: &self.config,
            epoch,
            epoch_size: self.epoch_size(),
            nominal_size: self
                .config
                .nominal_size
                .or(self.epoch_size())
                .or(dataset_samples),
            dataset_samples,
            assumed_counts: self.assumed_counts,
            hooks: self
                .hooks
                .files()
                .map(|(h, f)| (h, f.to_string()))
                .collect(),
        };
        Ok(policy::apply(context, ranks))
    }

    fn dataset_samples(&self) -> Option<u64> {
        self.config.shards.iter().map(|s| s.samples).sum()
    }

    /// Samples per epoch when fixed: resampled mode, or chopped split mode.
    fn epoch_size(&self) -> Option<u64> {
        match self.config.mode {
            PlanMode::Resampled => self.config.epoch_size.or(self.dataset_samples()),
            PlanMode::Split => self.config.epoch_size,
        }
    }

    /// This worker's share of a fixed epoch size: the rank's share is
    /// `epoch_size / world_size`, spread over its workers with the first ones taking
    /// one more where it does not divide.
    fn worker_quota(&self, epoch_size: u64, worker: LoaderWorkerId) -> u64 {
        let cluster = &self.config.cluster;
        let per_rank = epoch_size / u64::from(cluster.world_size());
        let workers = u64::from(cluster.workers_per_rank);
        per_rank / workers + u64::from(u64::from(worker.0) < per_rank % workers)
    }

    fn context(&self, epoch: u64, pass: u64, rank: Rank, worker: LoaderWorkerId) -> HookContext {
        let cluster = &self.config.cluster;
        HookContext {
            rank: rank.0,
            world_size: cluster.world_size(),
            node_rank: cluster.node_of(rank),
            num_nodes: cluster.nodes(),
            local_rank: cluster.local_rank(rank),
            ranks_per_node: cluster.ranks_beside(rank),
            worker: worker.0,
            workers: cluster.workers_per_rank,
            epoch,
            pass,
            seed: self.config.seed,
            mode: self.config.mode.name(),
            shuffle: self.config.shuffle_shards,
            rng_seed: derive_seed(self.config.seed, pass, rank.0, worker.0),
        }
    }

    fn run_hooks(
        &self,
        epoch: u64,
        pass: u64,
        rank: Rank,
        worker: LoaderWorkerId,
    ) -> Result<(Vec<Slice>, SplitMix64), PlanError> {
        let ctx = self.context(epoch, pass, rank, worker);
        Ok(self.hooks.run(&ctx, &self.input, &self.known)?)
    }

    fn worker_stream(
        &self,
        epoch: u64,
        rank: Rank,
        worker: LoaderWorkerId,
    ) -> Result<RawLoaderWorker, PlanError> {
        let seed = derive_seed(self.config.seed, epoch, rank.0, worker.0);
        // Resampled draws of shards whose counts are not all known read whole shards,
        // and the worker stops at its quota: it serves `quota` samples, not the sum of
        // counts that may be wrong or missing.
        let mut served = None;
        let (items, stream_offset) = match (self.config.mode, self.epoch_size()) {
            (PlanMode::Resampled, Some(size)) => {
                let quota = self.worker_quota(size, worker);
                let (slices, rng) = self.run_hooks(epoch, epoch, rank, worker)?;
                let exact = self.assumed_counts == 0 && slices.iter().all(|s| s.len().is_some());
                if !exact {
                    served = Some(quota);
                }
                let items = draw(slices, rng, quota, (rank, worker), !exact)?;
                (items, epoch.saturating_mul(quota))
            }
            (PlanMode::Resampled, None) => {
                return Err(PlanError::NeedsEpochSize {
                    missing: self.missing_counts(),
                });
            }
            (PlanMode::Split, None) => {
                let (slices, _) = self.run_hooks(epoch, epoch, rank, worker)?;
                (slices.into_iter().map(|s| s.into_item(None)).collect(), 0)
            }
            (PlanMode::Split, Some(size)) => {
                let quota = self.worker_quota(size, worker);
                let offset = epoch.saturating_mul(quota);
                (self.chopped(epoch, rank, worker, offset, quota)?, offset)
            }
        };
        let samples = served.or_else(|| items.iter().map(|i| i.samples).sum());
        Ok(RawLoaderWorker {
            worker,
            seed,
            stream_offset,
            items,
            samples,
            drawn_whole: served.is_some(),
        })
    }

    fn missing_counts(&self) -> usize {
        self.config
            .shards
            .iter()
            .filter(|s| s.samples.is_none())
            .count()
    }

    /// `quota` samples of the worker's endless stream (pass 0, pass 1, ... of its split,
    /// each pass shuffled by its own seed) from position `offset`.
    fn chopped(
        &self,
        epoch: u64,
        rank: Rank,
        worker: LoaderWorkerId,
        offset: u64,
        quota: u64,
    ) -> Result<Vec<WorkItem>, PlanError> {
        let pass_len = |slices: &[Slice]| -> Result<u64, PlanError> {
            slices
                .iter()
                .map(Slice::len)
                .sum::<Option<u64>>()
                .ok_or(PlanError::NeedsCounts {
                    what: "split mode with an epoch size",
                    missing: slices.iter().filter(|s| s.len().is_none()).count(),
                })
        };
        let (first, _) = self.run_hooks(epoch, 0, rank, worker)?;
        let expected = pass_len(&first)?;
        if expected == 0 {
            return Err(PlanError::EmptyStream { rank, worker });
        }
        let mut pass = offset / expected;
        let mut skip = offset % expected;
        let mut need = quota;
        let mut items = Vec::new();
        while need > 0 {
            let slices = if pass == 0 {
                first.clone()
            } else {
                self.run_hooks(epoch, pass, rank, worker)?.0
            };
            let found = pass_len(&slices)?;
            if found != expected {
                return Err(PlanError::PassLength {
                    rank,
                    worker,
                    pass,
                    expected,
                    found,
                });
            }
            for slice in slices {
                let len = slice.len().unwrap_or(0);
                if skip >= len {
                    skip -= len;
                    continue;
                }
                let take = (len - skip).min(need);
                items.push(slice.skipping(skip).into_item(Some(take)));
                skip = 0;
                need -= take;
                if need == 0 {
                    break;
                }
            }
            pass += 1;
        }
        Ok(items)
    }
}

/// Resampled mode: draw shards with replacement until `quota` samples. With `whole`
/// (some counts unknown or assumed, `data.samples_per_shard`), each draw is a whole
/// shard, counted as its count or as 1 when unknown (the least a shard that is not
/// empty holds), and the worker stops at its quota as it reads: a shard holding more
/// than its assumed count is read on, one holding fewer leaves the next draws to make
/// up. Otherwise the last draw is cut to the quota.
fn draw(
    slices: Vec<Slice>,
    mut rng: SplitMix64,
    quota: u64,
    (rank, worker): (Rank, LoaderWorkerId),
    whole: bool,
) -> Result<Vec<WorkItem>, PlanError> {
    let lens: Vec<u64> = slices.iter().map(|s| s.len().unwrap_or(1)).collect();
    if quota > 0 && lens.iter().all(|&n| n == 0) {
        return Err(PlanError::EmptyStream { rank, worker });
    }
    let mut items = Vec::new();
    let mut need = quota;
    while need > 0 {
        let index = rng.below(slices.len() as u64) as usize;
        let len = lens[index];
        if len == 0 {
            continue;
        }
        let take = len.min(need);
        let slice = slices[index].clone();
        items.push(slice.into_item(if whole { None } else { Some(take) }));
        need -= take;
    }
    Ok(items)
}
