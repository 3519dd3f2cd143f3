//! What a loader actor is told and asked: its arguments, its one method, and the request
//! a trainer sends first on each data channel.

use std::net::SocketAddr;

use pipelines::{LoaderWorkerCursor, LoaderWorkerPlan};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::data::DataSpec;

/// The actor kind of loaders.
pub const LOADER_KIND: &str = "loader";

/// A loader method: the request is `Self`, the reply `Self::Reply`.
pub trait LoaderMethod: Serialize + DeserializeOwned {
    /// The method's name on the wire.
    const NAME: &'static str;
    type Reply: Serialize + DeserializeOwned + Send + 'static;
}

/// A loader actor's arguments.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LoaderInit {
    /// The job's data settings (sources, loader, transforms).
    pub data: DataSpec,
    /// The job's data channel secret, in hex: only the job's trainers get batches.
    pub secret: String,
    /// Loader workers this actor runs at once (what it reserved CPUs for).
    pub workers: u32,
}

/// Where the actor's data channel listens.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct AddressRequest {}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LoaderAddress {
    pub addr: SocketAddr,
}

impl LoaderMethod for AddressRequest {
    const NAME: &'static str = "address";
    type Reply = LoaderAddress;
}

/// The first frame a trainer sends on a data channel: run this worker of this rank's
/// epoch from `resume`, and send me its messages.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LoadRequest {
    pub epoch: u64,
    pub rank: u32,
    /// The image side the trainer expects (the loader derives the transform from the
    /// job and the epoch, and refuses when it disagrees).
    pub size: u32,
    pub batch_size: usize,
    pub drop_partial: bool,
    pub plan: LoaderWorkerPlan,
    pub resume: LoaderWorkerCursor,
}
