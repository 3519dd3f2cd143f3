//! What a trainer is told when it is spawned: the job's data, model and optimisation
//! settings, and its place in the world. The client builds it from the configuration;
//! it crosses the network as JSON in the actor's constructor arguments.

use serde::{Deserialize, Serialize};

use super::model::ModelKind;
use super::optim::SgdConfig;
use super::precision::Precision;
use super::scaler::LossScaling;
pub use crate::data::{DataSpec, Loaders, ShardSet, SourceSpec, TrainPlanner};

/// Everything a trainer needs, the same for every rank but `rank`, `threads` and `device`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainerInit {
    pub rank: u32,
    pub world: u32,
    /// Ranks on each node, in node order (ranks are numbered node by node): the
    /// placement the planner plans for.
    pub node_ranks: Vec<u32>,
    /// libtorch's intra-op threads for this trainer.
    pub threads: u32,
    /// `cpu`, or `cuda` for the actor's first reserved GPU.
    pub device: DeviceSpec,
    pub job: JobSpec,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceSpec {
    Cpu,
    Cuda,
}

/// The job: data, model, optimisation. Identical on every rank.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobSpec {
    pub data: DataSpec,
    pub model: ModelSpec,
    pub optim: OptimSpec,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelSpec {
    pub kind: ModelKind,
    pub classes: i64,
    /// Channels of the small CNN's first block.
    pub width: i64,
    /// Seed of the initial weights (rank 0's are broadcast anyway).
    pub seed: u64,
    /// A state dict rank 0 starts from instead (`model.init`, an absolute path), unless
    /// the job resumes.
    #[serde(default)]
    pub init: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OptimSpec {
    pub epochs: u64,
    /// Samples per rank per step.
    pub batch_size: u64,
    /// The learning rate after the linear scaling rule.
    pub lr: f64,
    pub sgd: SgdConfig,
    pub label_smoothing: f64,
    pub warmup_epochs: f64,
    pub warmup_start_fraction: f64,
    pub schedule: ScheduleSpec,
    /// Gradient bucket size in bytes.
    pub bucket_bytes: usize,
    /// Average buckets during backward, as soon as their gradients are ready
    /// (`train.overlap`; CPU trainers on the ring; NCCL averages after backward).
    #[serde(default)]
    pub overlap: bool,
    /// What CUDA trainers compute in (`train.precision`); CPU trainers stay in fp32.
    #[serde(default)]
    pub precision: Precision,
    /// Images enter the model channels-last (NHWC in memory), and on CUDA trainers the
    /// 4-D convolution weights are channels-last too; false: NCHW inputs and weights
    /// (`train.channels_last`).
    #[serde(default = "default_channels_last")]
    pub channels_last: bool,
    pub loss_scaling: LossScaling,
    /// The dynamic loss scale's first value.
    pub loss_scale_init: f64,
    /// How gradients are averaged.
    pub allreduce: AllreduceChoice,
    /// How the replicas are kept together: gradient averaging, or neighbour averaging of
    /// parameters (`train.sync`).
    #[serde(default)]
    pub sync: SyncChoice,
    /// Who averages with whom each step under `sync = "decentralized"` (`train.topology`).
    #[serde(default = "default_topology")]
    pub topology: runtime::Topology,
    /// Survive a lost rank (`train.elastic`): snapshots at every call, and a lost peer
    /// is an error the job recovers from, not the trainer's end.
    #[serde(default)]
    pub elastic: bool,
}

fn default_channels_last() -> bool {
    true
}

fn default_topology() -> runtime::Topology {
    runtime::Topology::OnePeerExponential
}

/// How the replicas are kept together (`train.sync`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum SyncChoice {
    /// Every step, gradients are averaged over all ranks (`train.allreduce` says how);
    /// the replicas stay bit-identical.
    #[default]
    Allreduce,
    /// Every step, each rank takes its own optimiser step and averages its parameters and
    /// BatchNorm buffers with the step's group of `train.topology`, overlapped with the
    /// step's forward and backward; the replicas differ, their mean is the model.
    Decentralized,
}

impl SyncChoice {
    pub fn name(self) -> &'static str {
        match self {
            Self::Allreduce => "allreduce",
            Self::Decentralized => "decentralized",
        }
    }
}

impl std::str::FromStr for SyncChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "allreduce" => Ok(Self::Allreduce),
            "decentralized" => Ok(Self::Decentralized),
            other => Err(format!("`{other}`: expected allreduce or decentralized")),
        }
    }
}

/// Which collective averages the gradients (`train.allreduce`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AllreduceChoice {
    /// NCCL between CUDA trainers when it loads and starts on every rank, otherwise
    /// imgrun's ring.
    #[default]
    Auto,
    /// NCCL or fail.
    Nccl,
    /// imgrun's ring, through host memory on CUDA trainers too.
    Ring,
}

impl std::str::FromStr for AllreduceChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "nccl" => Ok(Self::Nccl),
            "ring" => Ok(Self::Ring),
            other => Err(format!("`{other}`: expected auto, nccl or ring")),
        }
    }
}

/// The decay after warm-up, in epochs (converted to steps once the epoch length is known).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum ScheduleSpec {
    Cosine { final_fraction: f64 },
    Step { milestones: Vec<u64>, gamma: f64 },
    Constant,
}
