//! Data-parallel training with libtorch: models, the optimiser, learning-rate schedules,
//! losses and accuracy; the gradient sync between replicas; checkpoints; and the trainer
//! actor that runs one rank of a job.
//!
//! Layers, bottom up: a file uses only files on the lines before its own
//! (`tools/check-circles.py` fails on a circle among them).
//! 1. `file_error`, `loss`, `model`, `nccl`, `optim`, `precision`, `scaler`, `schedule`,
//!    `transfer`: leaves.
//! 2. `checkpoint`; `comm` (a communication thread, [`SyncError`]); `spec` (the job as
//!    every trainer gets it).
//! 3. `bucket` (the bucket helpers); `checkpoint_store` (checkpoints copied to and
//!    from an object store); `protocol` (every request and reply of the trainer
//!    and its monitor); `weights`.
//! 4. `decentral` (neighbour averaging); `overlap` (averaging behind backward); `phase`
//!    (the board and the monitor); `straggler`.
//! 5. `ddp` ([`GradSync`]); `records` (`metrics.jsonl`).
//! 6. `negotiate` (the move onto NCCL).
//! 7. `trainer`: the actor, above them all.

mod bucket;
pub mod checkpoint;
pub mod checkpoint_store;
mod comm;
mod ddp;
mod decentral;
mod file_error;
mod loss;
mod model;
pub(crate) mod nccl;
mod negotiate;
mod optim;
mod overlap;
pub mod phase;
mod precision;
mod protocol;
mod records;
mod scaler;
mod schedule;
mod spec;
mod straggler;
mod trainer;
mod transfer;
pub mod weights;

pub use checkpoint::{CheckpointState, EpochSums};
pub use comm::SyncError;
pub use ddp::{DeviceCollective, GradSync, SyncStats};
pub use file_error::FileError;
pub use loss::{cross_entropy_smoothed, topk_correct, topk_correct_tensor};
pub use model::{Model, ModelKind, channels_last_weights, is_channels_last, to_channels_last};
pub use optim::{Sgd, SgdConfig};
pub use precision::{AutocastError, Precision, cuda_autocast_dtype, set_cuda_autocast_dtype};
pub use protocol::{
    AverageReply, AverageRequest, ConnectReply, ConnectRequest, DigestReply, DigestRequest,
    EpochReceived, EvalReply, EvaluateRequest, ListenReply, ListenRequest, LoaderActorsReply,
    LoaderActorsRequest, MixPeer, PreloadReply, PreloadRequest, RegroupReply, RegroupRequest,
    ResumeFrom, RollbackReply, RollbackRequest, SaveRequest, StepRecord, StepTiming, TrainReply,
    TrainRequest, TrainerMethod,
};
pub use records::{
    ConnectRecord, EpochRecord, EvalRecord, JobRecord, LateRecord, MetricsRecord, RankStep,
    RegroupRecord, SamplesRecord, StepMetrics, StopRecord,
};
pub use scaler::{LossScaler, LossScaling, ScalerState, StepVerdict};
pub use schedule::{LrSchedule, ScheduleKind, scaled_lr};
pub use spec::{
    AllreduceChoice, DataSpec, DeviceSpec, JobSpec, Loaders, ModelSpec, OptimSpec, ScheduleSpec,
    ShardSet, SourceSpec, SyncChoice, TrainPlanner, TrainerInit,
};
pub use straggler::{Late, LateCause, late_rank};
pub use trainer::{TRAINER_KIND, register, secret_hex};
pub use transfer::{to_device_async, to_host};
