//! The trainer's requests and replies (the methods' types are named in
//! [`crate::train::protocol`]), and what a step and an epoch report.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use pipelines::RankCursor;
use serde::{Deserialize, Serialize};

use crate::train::checkpoint::CheckpointState;

/// `listen`'s reply.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ListenReply {
    pub port: u16,
    /// Batches per epoch (the same on every rank) and the schedule's length.
    pub steps_per_epoch: u64,
    pub total_steps: u64,
    pub parameters: usize,
    pub device: String,
    /// Rank 0's NCCL unique id (hex) for CUDA trainers that may use NCCL.
    #[serde(default)]
    pub nccl_id: Option<String>,
    /// A decentralized job's mixing ports: one per group of the rank's schedule
    /// (`runtime::Mixer::groups_of`), in that order.
    #[serde(default)]
    pub mix_ports: Vec<u16>,
}

/// Where a rank of a decentralized job listens for its mixing groups.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MixPeer {
    pub ip: IpAddr,
    /// [`ListenReply::mix_ports`] of the rank.
    pub ports: Vec<u16>,
}

/// `connect`'s request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ConnectRequest {
    pub next: SocketAddr,
    /// The job's ring secret, hex.
    pub secret: String,
    pub job: String,
    pub op_timeout_secs: u64,
    pub resume: Option<ResumeFrom>,
    /// Rank 0's NCCL unique id, passed on to every rank.
    #[serde(default)]
    pub nccl_id: Option<String>,
    /// Every rank's mixing ports, by rank (decentralized jobs).
    #[serde(default)]
    pub mix_peers: Vec<MixPeer>,
    /// The survivors of a loss re-form the ring: the model is the one they hold (no
    /// `model.init`).
    #[serde(default)]
    pub regrouped: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ResumeFrom {
    pub dir: PathBuf,
    pub state: CheckpointState,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ConnectReply {
    pub buckets: usize,
    /// How gradients are averaged: `nccl 2.28.9`, or `ring` with why NCCL is not used.
    pub allreduce: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainRequest {
    pub epoch: u64,
    pub max_steps: u64,
    /// Reply with each step's sample ids (`train.sample_log`).
    #[serde(default)]
    pub sample_ids: bool,
}

/// One optimiser step, as every rank saw it (loss and accuracy are global means).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StepRecord {
    /// Global step number after this step (1-based).
    pub step: u64,
    pub loss: f32,
    pub accuracy: f32,
    pub lr: f64,
    /// Samples in this step over all ranks.
    pub samples: u64,
    /// The loss scale this step ran with, under loss scaling.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// Whether the step was skipped (its scaled gradients overflowed).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
    /// How long the step took on the rank that replies (the one figure here that differs
    /// between ranks).
    pub timing: StepTiming,
    /// The replying rank's samples in this step, as `URL#key`, when the job asked.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sample_ids: Vec<String>,
}

/// One rank's wall time for one step, and how it went.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StepTiming {
    /// From asking the loader for the batch to the end of the optimiser step.
    pub seconds: f64,
    /// Waiting for the batch.
    pub data_wait_s: f64,
    /// Forward and backward.
    pub compute_s: f64,
    /// Waiting for the gradient average (in a decentralized job: for the step's sums
    /// and the rest of the neighbours' mixing, which began before the forward pass).
    pub allreduce_s: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainReply {
    pub epoch: u64,
    pub step_in_epoch: u64,
    pub steps_in_epoch: u64,
    pub epoch_done: bool,
    pub global_step: u64,
    pub steps: Vec<StepRecord>,
    /// This rank's wall time in the call, and how it went: waiting for batches, forward
    /// and backward, waiting for the gradient average (the sums of its steps' timings).
    pub seconds: f64,
    pub data_wait_s: f64,
    pub compute_s: f64,
    pub allreduce_s: f64,
    /// Samples this rank trained on.
    pub samples: u64,
    /// Where this rank's epoch stands (absent once the epoch is done).
    pub cursor: Option<RankCursor>,
    /// Bad samples and shards skipped so far this epoch, with what was wrong.
    pub skipped: u64,
    pub problems: Vec<String>,
    /// When the epoch is done: what this rank received in it (since the resume, for a
    /// resumed epoch).
    #[serde(default)]
    pub received: Option<EpochReceived>,
}

/// The images one rank actually trained on in an epoch: their sides in pixels, and the
/// shards they came from (a brace spec).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochReceived {
    pub image_sizes: Vec<u32>,
    pub shards: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EvalReply {
    pub samples: u64,
    pub loss_sum: f64,
    pub top1: u64,
    pub top5: u64,
    pub seconds: f64,
    /// A decentralized job's: how far this rank's replica is from the replicas' mean
    /// (the Euclidean distance over parameters and buffers), which is what was evaluated.
    #[serde(default)]
    pub replica_distance: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SaveRequest {
    /// The run's `checkpoints/` folder.
    pub root: PathBuf,
    pub name: String,
    pub state: CheckpointState,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DigestReply {
    /// SHA-256 of every parameter and buffer, in order.
    pub sha256: String,
}
