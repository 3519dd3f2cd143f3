//! imgrun's actors: the pieces that join the data path (`pipelines`) to the control
//! plane (`runtime`) and run libtorch.
//!
//! Today it holds the libtorch probe behind `imgrun doctor`; the loader and trainer
//! actors grow here next.

mod torch;
pub mod train;

pub use torch::{LibtorchReport, probe_libtorch};
