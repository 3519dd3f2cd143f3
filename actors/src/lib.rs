//! imgrun's actors: the pieces that join the data path (`pipelines`) to the control
//! plane (`runtime`) and run libtorch.
//!
//! `train` is the trainer actor (a rank: a model replica, its loader workers and its
//! collectives); `load` the loader actor (a rank's loader workers on another node);
//! `job` drives a job's trainers from a request to trained replicas;
//! `probe_libtorch` is the check behind `imgrun doctor`.
//!
//! Modules, bottom up: a module uses only those on the lines before its own.
//! 1. `data` (the job's data settings), `torch`: leaves.
//! 2. `load` (told a `DataSpec`).
//! 3. `train` (its trainer feeds on loader actors through `load`).
//! 4. `job`.

pub mod data;
pub mod job;
pub mod load;
mod torch;
pub mod train;

pub use torch::{LibtorchReport, probe_libtorch};
