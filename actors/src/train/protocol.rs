//! The trainer's methods as types. Each request type names its method and fixes its
//! reply type, so the job's client and the trainer cannot disagree on either: a method
//! name is written once, here, and a reply is read as the type the method returns.
//!
//! Every request and reply of the trainer and of its monitor (`phase.rs`) is here, with
//! what a step and an epoch report, so that the files which send or answer them all sit
//! above this one.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use pipelines::RankCursor;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::checkpoint::CheckpointState;

/// A trainer method: the request is `Self`, the reply `Self::Reply`.
pub trait TrainerMethod: Serialize + DeserializeOwned {
    /// The method's name on the wire.
    const NAME: &'static str;
    type Reply: Serialize + DeserializeOwned + Send + 'static;
}

/// Copies the node's shards to local disk for at most `seconds` (`data.preload`); the
/// job asks again until every rank is done.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct PreloadRequest {
    pub seconds: f64,
}

/// Where a rank's preload stands: shards in place of those it copies, those that were
/// there already, and bytes copied.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct PreloadReply {
    pub done: u64,
    pub total: u64,
    pub present: u64,
    pub bytes: u64,
}

impl TrainerMethod for PreloadRequest {
    const NAME: &'static str = "preload";
    type Reply = PreloadReply;
}

/// Feeds the rank's loader workers from loader actors (`data.loaders = "remote"`): each
/// worker's loader actor (`None`: the worker runs in the trainer's process) and the job's
/// data channel secret, in hex. From the next epoch started on.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct LoaderActorsRequest {
    /// The data channel address of each loader worker's loader actor, by worker.
    pub loader_actors: Vec<Option<std::net::SocketAddr>>,
    pub secret: String,
}

/// Loader workers the rank's loader actors run.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct LoaderActorsReply {
    pub remote_workers: u32,
}

impl TrainerMethod for LoaderActorsRequest {
    const NAME: &'static str = "loader_actors";
    type Reply = LoaderActorsReply;
}

/// Opens the trainer's ring port (and, between CUDA trainers, an NCCL id).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct ListenRequest {}

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

impl TrainerMethod for ListenRequest {
    const NAME: &'static str = "listen";
    type Reply = ListenReply;
}

/// `connect`'s request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ConnectRequest {
    pub next: SocketAddr,
    /// The job's ring secret, hex.
    pub secret: String,
    /// The ring's id, the same on every rank (the run folder's path): a peer of another
    /// ring is refused.
    pub ring_id: String,
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
    /// The checkpoint's place in a store, when it was resumed from one: a trainer that
    /// does not see `dir` (another machine) copies it from there.
    #[serde(default)]
    pub store: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ConnectReply {
    pub buckets: usize,
    /// How gradients are averaged: `nccl 2.28.9`, or `ring` with why NCCL is not used.
    pub allreduce: String,
}

impl TrainerMethod for ConnectRequest {
    const NAME: &'static str = "connect";
    type Reply = ConnectReply;
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainRequest {
    pub epoch: u64,
    pub max_steps: u64,
    /// Reply with each step's sample ids (`train.sample_log`).
    #[serde(default)]
    pub sample_ids: bool,
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
    /// What this rank's loader served and skipped so far this epoch (its `problems`
    /// are in `problems`).
    #[serde(default)]
    pub loader: pipelines::EpochStats,
    /// The shards this rank's process opened so far (for training and validation), by
    /// kind of source.
    #[serde(default)]
    pub sources: pipelines::SourceCounts,
    /// When the epoch is done: what this rank received in it (since the resume, for a
    /// resumed epoch).
    #[serde(default)]
    pub received: Option<EpochReceived>,
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

/// The images one rank actually trained on in an epoch: their sides in pixels, and the
/// shards they came from (a brace spec).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochReceived {
    pub image_sizes: Vec<u32>,
    pub shards: String,
}

impl TrainerMethod for TrainRequest {
    const NAME: &'static str = "train";
    type Reply = TrainReply;
}

/// Evaluates the current model on this rank's share of the validation set.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct EvaluateRequest {}

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

impl TrainerMethod for EvaluateRequest {
    const NAME: &'static str = "evaluate";
    type Reply = EvalReply;
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SaveRequest {
    /// The run's `checkpoints/` folder.
    pub root: PathBuf,
    pub name: String,
    pub state: CheckpointState,
    /// Once it is saved, keep the newest `keep` checkpoints of `root` (0: every one)...
    #[serde(default)]
    pub keep: u32,
    /// ... and the one of the best validation top-1.
    #[serde(default)]
    pub keep_best: bool,
    /// Then copy it to this run's place in the checkpoint store
    /// (`STORE/RUN/checkpoints`, see [`checkpoint_store`](super::checkpoint_store)) and
    /// keep the same there.
    #[serde(default)]
    pub store: Option<String>,
}

/// The reply is the checkpoint's folder.
impl TrainerMethod for SaveRequest {
    const NAME: &'static str = "save";
    type Reply = PathBuf;
}

/// The SHA-256 of the replica's parameters and buffers.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct DigestRequest {}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DigestReply {
    /// SHA-256 of every parameter and buffer, in order.
    pub sha256: String,
}

impl TrainerMethod for DigestRequest {
    const NAME: &'static str = "digest";
    type Reply = DigestReply;
}

/// Ends a decentralized job: every rank's replica becomes the replicas' mean (an
/// allreduce job's replicas are equal already, and stay as they are).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct AverageRequest {}

/// How far the rank's replica was from the mean (Euclidean, over parameters and buffers).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct AverageReply {
    pub distance: f64,
}

impl TrainerMethod for AverageRequest {
    const NAME: &'static str = "average";
    type Reply = AverageReply;
}

/// Drops the step in flight: the trainer goes back to its state when the job's last
/// completed call ended, at `global_step`, and forgets its ring and its epoch's loader.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RollbackRequest {
    pub global_step: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RollbackReply {
    /// Steps undone (0 when the rank had run none past `global_step`).
    pub undone: u64,
}

impl TrainerMethod for RollbackRequest {
    const NAME: &'static str = "rollback";
    type Reply = RollbackReply;
}

/// Makes the trainer rank `rank` of a smaller world (after a rollback): the survivors
/// are the old ranks `survivors`, in order; `cursors` are every old rank's cursors in
/// epoch `epoch` as of the rollback (empty at an epoch's start); `lr` is the learning
/// rate after the linear scaling rule for the new global batch.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RegroupRequest {
    pub rank: u32,
    pub node_ranks: Vec<u32>,
    pub survivors: Vec<u32>,
    pub epoch: u64,
    pub cursors: Vec<RankCursor>,
    pub lr: f64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RegroupReply {
    /// Steps of epoch `epoch` (those run plus those left) in the new world.
    pub steps_in_epoch: u64,
    /// Steps of a whole epoch in the new world.
    pub steps_per_epoch: u64,
    /// Where this rank stands in the rest of epoch `epoch`, as dealt to the new world
    /// (none at an epoch's start): the job's position, should the new world lose a rank
    /// before its first step.
    #[serde(default)]
    pub cursor: Option<RankCursor>,
}

impl TrainerMethod for RegroupRequest {
    const NAME: &'static str = "regroup";
    type Reply = RegroupReply;
}

/// Asks a rank's monitor (or its trainer, between calls) where the trainer is.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PhaseRequest {}

impl TrainerMethod for PhaseRequest {
    const NAME: &'static str = "phase";
    type Reply = RankPhase;
}

/// A rank's phase as its monitor reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankPhase {
    pub rank: u32,
    pub phase: Phase,
    /// How long it has been in that phase.
    pub seconds: f64,
    pub epoch: Option<u64>,
    /// The global step it works on (its steps done + 1 while it trains).
    pub step: u64,
    /// While averaging: the gradient bucket it waits for (1-based) and how many there
    /// are.
    #[serde(default)]
    pub bucket: Option<(usize, usize)>,
    /// The shards its loader workers read now, with the bytes received from each.
    #[serde(default)]
    pub reading: Vec<ShardRead>,
    /// Seconds it has waited for its loader's batches in this epoch, now included.
    #[serde(default)]
    pub data_wait_s: f64,
}

impl RankPhase {
    /// The phase, with the bucket while averaging (`averaging (bucket 3 of 5)`).
    pub fn describe(&self) -> String {
        match self.bucket {
            Some((bucket, of)) if self.phase == Phase::Averaging => {
                format!("{} (bucket {bucket} of {of})", self.phase.name())
            }
            _ => self.phase.name().to_string(),
        }
    }
}

/// What a trainer is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Built, not yet connected to its ring.
    Starting,
    /// Copying its node's shards to local disk (`data.preload`).
    Preloading,
    /// Between the job's calls.
    Idle,
    /// Waiting for its loader's next batch.
    WaitingForData,
    /// Forward and backward.
    Computing,
    /// Averaging gradients (or broadcasting buffers) with the other ranks.
    Averaging,
    Evaluating,
    Checkpointing,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Starting => "starting",
            Phase::Preloading => "preloading",
            Phase::Idle => "idle",
            Phase::WaitingForData => "waiting for data",
            Phase::Computing => "computing",
            Phase::Averaging => "averaging",
            Phase::Evaluating => "evaluating",
            Phase::Checkpointing => "checkpointing",
        }
    }
}

/// A shard a loader worker reads now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardRead {
    pub worker: u32,
    pub url: String,
    pub bytes: u64,
}

/// Aborts the collective the rank's trainer waits in, if any (an elastic job that lost
/// a peer): its communication threads end the op in flight with an error and drop their
/// connections, so the trainer's call returns.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct AbortRequest {}

impl TrainerMethod for AbortRequest {
    const NAME: &'static str = "abort";
    type Reply = ();
}

/// Every method's name, for an error about one that does not exist.
pub const METHODS: [&str; 12] = [
    PhaseRequest::NAME,
    PreloadRequest::NAME,
    LoaderActorsRequest::NAME,
    ListenRequest::NAME,
    ConnectRequest::NAME,
    TrainRequest::NAME,
    EvaluateRequest::NAME,
    SaveRequest::NAME,
    DigestRequest::NAME,
    AverageRequest::NAME,
    RollbackRequest::NAME,
    RegroupRequest::NAME,
];
