//! The planner's inputs: the cluster's shape, the mode, the batch policy and the other
//! settings, their validation, and the errors a plan can end in.

use super::hooks::HookError;
use super::shards::PlanShard;
use super::{LoaderWorkerId, Rank};

/// How ranks and loader workers are laid out: the ranks on each node, numbered node by
/// node, and the loader workers of each rank. Nodes may hold different numbers of ranks
/// (a node with 8 GPUs beside one with 4).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ClusterShape {
    /// Ranks on each node, in node order.
    node_ranks: Vec<u32>,
    /// Loader workers of each rank.
    pub workers_per_rank: u32,
}

impl ClusterShape {
    /// `nodes` nodes of `ranks_per_node` ranks each.
    pub fn new(nodes: u32, ranks_per_node: u32, workers_per_rank: u32) -> Self {
        Self::with_node_ranks(vec![ranks_per_node; nodes as usize], workers_per_rank)
    }

    /// Nodes holding `node_ranks[i]` ranks each.
    pub fn with_node_ranks(node_ranks: Vec<u32>, workers_per_rank: u32) -> Self {
        Self {
            node_ranks,
            workers_per_rank,
        }
    }

    pub fn nodes(&self) -> u32 {
        self.node_ranks.len() as u32
    }

    /// Ranks on each node, in node order.
    pub fn node_ranks(&self) -> &[u32] {
        &self.node_ranks
    }

    /// Ranks in all.
    pub fn world_size(&self) -> u32 {
        self.node_ranks
            .iter()
            .fold(0u32, |sum, &n| sum.saturating_add(n))
    }

    /// The node a rank runs on (ranks are numbered node by node); past the last rank,
    /// the last node.
    pub fn node_of(&self, rank: Rank) -> u32 {
        self.locate(rank).0
    }

    /// The rank's index among the ranks of its node.
    pub fn local_rank(&self, rank: Rank) -> u32 {
        self.locate(rank).1
    }

    /// Ranks on the node `rank` runs on.
    pub fn ranks_beside(&self, rank: Rank) -> u32 {
        let node = self.node_of(rank) as usize;
        self.node_ranks.get(node).copied().unwrap_or(0)
    }

    fn locate(&self, rank: Rank) -> (u32, u32) {
        let mut first = 0u32;
        for (node, &count) in self.node_ranks.iter().enumerate() {
            if rank.0 < first.saturating_add(count) {
                return (node as u32, rank.0 - first);
            }
            first = first.saturating_add(count);
        }
        (self.nodes().saturating_sub(1), 0)
    }

    /// `2 node(s) x 4 rank(s)`, or `3 node(s) with 2+1+1 ranks`.
    pub fn layout(&self) -> String {
        match self.node_ranks.split_first() {
            Some((first, rest)) if rest.iter().all(|n| n == first) => {
                format!("{} node(s) x {first} rank(s)", self.nodes())
            }
            _ => {
                let counts: Vec<String> = self.node_ranks.iter().map(u32::to_string).collect();
                format!("{} node(s) with {} ranks", self.nodes(), counts.join("+"))
            }
        }
    }
}

/// Where each worker's shards come from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlanMode {
    /// Each worker draws shards at random with replacement; an epoch is `epoch_size`
    /// samples (default: the dataset's size), the same number on every rank.
    #[default]
    Resampled,
    /// Exact epochs: shards are split across ranks and then across each rank's workers,
    /// so every sample is read once per epoch (or per pass, when epochs are chopped).
    Split,
}

impl PlanMode {
    pub fn name(self) -> &'static str {
        match self {
            PlanMode::Resampled => "resampled",
            PlanMode::Split => "split",
        }
    }
}

impl std::str::FromStr for PlanMode {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "resampled" => Ok(PlanMode::Resampled),
            "split" => Ok(PlanMode::Split),
            other => Err(format!(
                "unknown mode `{other}` (expected resampled or split)"
            )),
        }
    }
}

/// What to do when ranks would run different numbers of batches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum BatchPolicy {
    /// Nothing: such a plan is inconsistent and [`Plan::check`] fails.
    #[default]
    None,
    /// Ranks that run out take part with empty batches until the longest is done.
    Join,
    /// Every rank stops after `nbatches` (default: the smallest rank's count).
    Drop { nbatches: Option<u64> },
    /// Each worker reads its data `dsrepeat` times, then every rank stops after
    /// `nbatches` (default: the smallest rank's count).
    Repeat {
        dsrepeat: u64,
        nbatches: Option<u64>,
    },
}

impl BatchPolicy {
    /// The policy named `name` (`none`, `join`, `drop`, `repeat`) with its counts, as the
    /// command line and the configuration give them: a batch count alone means `drop`,
    /// `dsrepeat` means `repeat`.
    pub fn parse(name: &str, nbatches: Option<u64>, dsrepeat: Option<u64>) -> Result<Self, String> {
        Ok(match (name, dsrepeat, nbatches) {
            (_, Some(dsrepeat), nbatches) => BatchPolicy::Repeat { dsrepeat, nbatches },
            ("none" | "drop", None, Some(nbatches)) => BatchPolicy::Drop {
                nbatches: Some(nbatches),
            },
            ("none", None, None) => BatchPolicy::None,
            ("join", None, None) => BatchPolicy::Join,
            ("drop", None, None) => BatchPolicy::Drop { nbatches: None },
            ("repeat", None, _) => return Err("the repeat policy needs a dsrepeat count".into()),
            ("join", None, Some(_)) => {
                return Err("the join policy cannot take a batch count".into());
            }
            (other, ..) => {
                return Err(format!(
                    "unknown policy `{other}` (expected none, join, drop or repeat)"
                ));
            }
        })
    }
}

/// Everything a plan depends on except the epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanConfig {
    pub shards: Vec<PlanShard>,
    pub cluster: ClusterShape,
    pub seed: u64,
    pub batch_size: u64,
    /// Drop each worker's last, partial batch (WebDataset's `partial=False`).
    pub drop_partial: bool,
    pub mode: PlanMode,
    pub policy: BatchPolicy,
    /// Let the default `shard_shuffle` hook shuffle each worker's shards.
    pub shuffle_shards: bool,
    /// Samples served per epoch, over all ranks. Resampled mode: the epoch's length
    /// (default: the dataset's size). Split mode: chops epochs out of an endless stream
    /// of passes, each epoch starting where the previous one stopped.
    pub epoch_size: Option<u64>,
    /// The epoch length reported to schedules and progress (default: `epoch_size`, or
    /// the dataset's size).
    pub nominal_size: Option<u64>,
    /// Count assumed for shards whose count is unknown.
    pub default_samples_per_shard: Option<u64>,
}

impl PlanConfig {
    /// Defaults: seed 0, partial batches dropped, resampled mode, no policy, shard
    /// shuffling on.
    pub fn new(shards: Vec<PlanShard>, cluster: ClusterShape, batch_size: u64) -> Self {
        Self {
            shards,
            cluster,
            seed: 0,
            batch_size,
            drop_partial: true,
            mode: PlanMode::Resampled,
            policy: BatchPolicy::None,
            shuffle_shards: true,
            epoch_size: None,
            nominal_size: None,
            default_samples_per_shard: None,
        }
    }
}

/// A plan that cannot be formed, or that fails its check.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("invalid plan setting `{field}`: {problem}")]
    Config {
        field: &'static str,
        problem: String,
    },
    #[error(
        "{what} needs per-shard sample counts, and {missing} shard(s) have none: index the shards with `imgrun shards index SPEC -o manifest.json` and use that manifest (data.manifest, plan --manifest), or declare a count per shard (data.samples_per_shard, plan --samples-per-shard)"
    )]
    NeedsCounts { what: &'static str, missing: usize },
    #[error(
        "resampled mode draws an epoch of `data.epoch_size` samples, and without it the size is the dataset's, which is unknown: {missing} shard(s) have no sample count. Set data.epoch_size (plan --epoch-size), or index the shards with `imgrun shards index SPEC -o manifest.json` and use that manifest (data.manifest, plan --manifest)"
    )]
    NeedsEpochSize { missing: usize },
    #[error("rank {rank} worker {worker} has no samples to read (its hooks left it no data)")]
    EmptyStream { rank: Rank, worker: LoaderWorkerId },
    #[error(
        "rank {rank} worker {worker}: pass {pass} holds {found} samples but pass 0 held {expected}; chopped epochs need passes of equal size"
    )]
    PassLength {
        rank: Rank,
        worker: LoaderWorkerId,
        pass: u64,
        expected: u64,
        found: u64,
    },
    #[error(transparent)]
    Hook(#[from] HookError),
    #[error("ranks run different numbers of batches ({}); choose a policy: join, drop or repeat", list_batches(.batches))]
    InconsistentBatches { batches: Vec<u64> },
    #[error(
        "cannot check batch consistency: {missing} shard(s) have no sample count: index the shards with `imgrun shards index SPEC -o manifest.json` and use that manifest (data.manifest, plan --manifest), or declare a count per shard (data.samples_per_shard, plan --samples-per-shard)"
    )]
    Unchecked { missing: usize },
}

pub(crate) fn validate(config: &PlanConfig) -> Result<(), PlanError> {
    let bad = |field, problem: &str| {
        Err(PlanError::Config {
            field,
            problem: problem.to_string(),
        })
    };
    let cluster = &config.cluster;
    if cluster.node_ranks.is_empty()
        || cluster.node_ranks.contains(&0)
        || cluster.workers_per_rank == 0
    {
        return bad(
            "cluster",
            "nodes, ranks on each node and workers per rank must be at least 1",
        );
    }
    if cluster
        .node_ranks
        .iter()
        .try_fold(0u32, |sum, &n| sum.checked_add(n))
        .is_none()
    {
        return bad("cluster", "too many ranks");
    }
    if config.batch_size == 0 {
        return bad("batch_size", "must be at least 1");
    }
    if config.shards.is_empty() {
        return bad("shards", "the shard list is empty");
    }
    if config
        .epoch_size
        .is_some_and(|size| size < u64::from(cluster.world_size()))
    {
        return bad("epoch_size", "must give every rank at least one sample");
    }
    match config.policy {
        BatchPolicy::Repeat { dsrepeat: 0, .. } => bad("dsrepeat", "must be at least 1"),
        BatchPolicy::Repeat { .. }
            if config.mode == PlanMode::Resampled || config.epoch_size.is_some() =>
        {
            bad(
                "policy",
                "repeat applies to split mode without an epoch size (other streams already repeat)",
            )
        }
        _ => Ok(()),
    }
}

/// `rank 0: 35, rank 1: 26, ...` for messages.
pub(crate) fn list_batches(batches: &[u64]) -> String {
    batches
        .iter()
        .enumerate()
        .map(|(rank, n)| format!("rank {rank}: {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uneven_nodes_number_their_ranks_node_by_node() {
        let shape = ClusterShape::with_node_ranks(vec![2, 1, 3], 1);
        assert_eq!(shape.world_size(), 6);
        let placed: Vec<(u32, u32, u32)> = (0..6)
            .map(|r| {
                let rank = Rank(r);
                (
                    shape.node_of(rank),
                    shape.local_rank(rank),
                    shape.ranks_beside(rank),
                )
            })
            .collect();
        assert_eq!(
            placed,
            [
                (0, 0, 2),
                (0, 1, 2),
                (1, 0, 1),
                (2, 0, 3),
                (2, 1, 3),
                (2, 2, 3)
            ]
        );
        assert_eq!(shape.layout(), "3 node(s) with 2+1+3 ranks");
        assert_eq!(ClusterShape::new(2, 4, 1).layout(), "2 node(s) x 4 rank(s)");
        assert_eq!(ClusterShape::new(2, 4, 1).node_of(Rank(5)), 1);
    }
}
