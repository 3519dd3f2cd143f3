//! Epoch planning: which samples every (rank, loader worker) reads in an epoch, how many
//! batches each rank runs, and what the batch policy did to make them agree.
//!
//! Pure and deterministic: a plan is a function of the settings ([`PlanConfig`]), the
//! hook scripts and the epoch number. No clock, no I/O (except reading hook scripts when
//! they are loaded), no worker-local counters; every random choice comes from a
//! [`SplitMix64`] seeded by [`derive_seed`]`(seed, epoch, rank, worker)`, so the same
//! plan comes out on every machine.
//!
//! - **Modes.** [`PlanMode::Resampled`] (default): each worker draws shards with
//!   replacement until it has its share of `epoch_size` samples (`epoch_size / world`
//!   per rank), so all ranks run the same batches. [`PlanMode::Split`]: WebDataset's
//!   `urls[rank::world]` then `[worker::workers]`; with fewer shards than parts, parts
//!   share a shard by sample stride. Ranks may then differ, and the [`BatchPolicy`]
//!   decides: `join` pads with empty batches, `drop` truncates, `repeat` reads the data
//!   `dsrepeat` times and truncates; `none` leaves the plan inconsistent and
//!   [`Plan::check`] says which ranks have how many batches.
//! - **Batches.** Each worker batches its own stream (a partial last batch dropped or
//!   kept); a rank's batches are the sum over its workers. When a policy truncates a
//!   rank, it takes batches from its workers in turn, as a data loader does, and each
//!   worker's items are cut to exactly the samples it serves.
//! - **Chopped epochs.** In split mode, `epoch_size` makes each worker's data an
//!   endless stream of passes (pass `p` split and shuffled with the seed of `p`); epoch
//!   `e` reads its share from position `e * share`. Every pass must hold the same number
//!   of samples. `nominal_size` is only reported, for schedules and progress.
//! - **Hooks.** Four Rhai functions run per (rank, worker, pass), in this order:
//!   `reseed(ctx)`, `node_selection(shards, ctx)`, `shard_selection(shards, ctx)`,
//!   `shard_shuffle(shards, ctx)`. The defaults are the files in `scripts/` (embedded),
//!   and `scripts/README.md` documents `ctx`, the shard maps and the sandbox.
//!
//! Files, bottom up: a file uses only files on the lines before its own.
//! 1. `rng`, `shards`: leaves.
//! 2. `script_api` (what hook scripts see).
//! 3. `hooks`.
//! 4. `config` (the planner's inputs).
//! 5. `policy` (the plan, and the batch policy).
//! 6. `planner`, `render`.

mod config;
mod hooks;
mod planner;
mod policy;
mod render;
mod rng;
mod script_api;
mod shards;

use std::fmt;

pub use config::{BatchPolicy, ClusterShape, PlanConfig, PlanError, PlanMode};
pub use hooks::{HookError, HookName, HookSources, Hooks};
pub use planner::Planner;
pub(crate) use policy::round_robin;
pub use policy::{Consistency, LoaderWorkerPlan, Plan, RankPlan};
pub use render::render_plan;
pub use rng::{SplitMix64, derive_seed, mix64};
pub use script_api::HookLimits;
pub use shards::{PlanShard, WorkItem};

/// A training process's index in the world (`0..world_size`), numbered node by node.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct Rank(pub u32);

/// A loader worker's index within its rank.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct LoaderWorkerId(pub u32);

impl fmt::Display for Rank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Display for LoaderWorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}
