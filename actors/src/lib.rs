//! imgrun's actors: the pieces that join the data path (`pipelines`) to the control
//! plane (`runtime`) and run libtorch.
//!
//! `train` is the trainer actor (a rank: a model replica, its loader workers and its
//! collectives); `load` the loader actor (a rank's loader workers on another node);
//! `job` drives a job's trainers from a request to trained replicas;
//! `probe_libtorch` is the check behind `imgrun doctor`.

pub mod job;
pub mod load;
mod torch;
pub mod train;

pub use torch::{LibtorchReport, probe_libtorch};
