//! The trainer's methods as types. Each request type names its method and fixes its
//! reply type, so the job's client and the trainer cannot disagree on either: a method
//! name is written once, here, and a reply is read as the type the method returns.

use std::path::PathBuf;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::trainer::{
    ConnectReply, ConnectRequest, DigestReply, EvalReply, ListenReply, RegroupReply,
    RegroupRequest, RollbackReply, RollbackRequest, SaveRequest, TrainReply, TrainRequest,
};

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
pub struct LoadersRequest {
    pub loaders: Vec<Option<std::net::SocketAddr>>,
    pub secret: String,
}

/// Workers the rank's loader actors run.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct LoadersReply {
    pub remote_workers: u32,
}

impl TrainerMethod for LoadersRequest {
    const NAME: &'static str = "loaders";
    type Reply = LoadersReply;
}

/// Opens the trainer's ring port (and, between CUDA trainers, an NCCL id).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct ListenRequest {}

/// Evaluates the current model on this rank's share of the validation set.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct EvaluateRequest {}

/// The SHA-256 of the replica's parameters and buffers.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct DigestRequest {}

impl TrainerMethod for ListenRequest {
    const NAME: &'static str = "listen";
    type Reply = ListenReply;
}

impl TrainerMethod for ConnectRequest {
    const NAME: &'static str = "connect";
    type Reply = ConnectReply;
}

impl TrainerMethod for TrainRequest {
    const NAME: &'static str = "train";
    type Reply = TrainReply;
}

impl TrainerMethod for EvaluateRequest {
    const NAME: &'static str = "evaluate";
    type Reply = EvalReply;
}

/// The reply is the checkpoint's folder.
impl TrainerMethod for SaveRequest {
    const NAME: &'static str = "save";
    type Reply = PathBuf;
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

impl TrainerMethod for RollbackRequest {
    const NAME: &'static str = "rollback";
    type Reply = RollbackReply;
}

impl TrainerMethod for RegroupRequest {
    const NAME: &'static str = "regroup";
    type Reply = RegroupReply;
}

/// Every method's name, for an error about one that does not exist.
pub const METHODS: [&str; 12] = [
    super::phase::PhaseRequest::NAME,
    PreloadRequest::NAME,
    LoadersRequest::NAME,
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
