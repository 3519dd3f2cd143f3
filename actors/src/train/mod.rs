//! Data-parallel training with libtorch: models, the optimiser, learning-rate schedules,
//! losses and accuracy; the gradient sync between replicas; checkpoints; and the trainer
//! actor that runs one rank of a job.

mod bucket;
pub mod checkpoint;
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
mod protocol;
mod records;
mod scaler;
mod schedule;
mod spec;
mod straggler;
mod trainer;
pub mod weights;

pub use checkpoint::{CheckpointState, EpochSums};
pub use comm::SyncError;
pub use ddp::{DeviceCollective, GradSync, SyncStats};
pub use file_error::FileError;
pub use loss::{cross_entropy_smoothed, topk_correct};
pub use model::{Model, ModelKind};
pub use optim::{Sgd, SgdConfig};
pub use protocol::{
    AverageReply, AverageRequest, ConnectReply, ConnectRequest, DigestReply, DigestRequest,
    EpochReceived, EvalReply, EvaluateRequest, ListenReply, ListenRequest, LoadersReply,
    LoadersRequest, MixPeer, PreloadReply, PreloadRequest, RegroupReply, RegroupRequest,
    ResumeFrom, RollbackReply, RollbackRequest, SaveRequest, StepRecord, StepTiming, TrainReply,
    TrainRequest, TrainerMethod,
};
pub use records::{
    ConnectRecord, EpochRecord, EvalRecord, JobRecord, LateRecord, MetricsRecord, RegroupRecord,
    SamplesRecord, StepMetrics, StopRecord,
};
pub use scaler::{LossScaler, LossScaling, ScalerState, StepVerdict};
pub use schedule::{LrSchedule, ScheduleKind, scaled_lr};
pub use spec::{
    AllreduceChoice, DataSpec, DeviceSpec, JobSpec, Loaders, ModelSpec, OptimSpec, ScheduleSpec,
    ShardSet, SourceSpec, SyncChoice, TrainPlanner, TrainerInit,
};
pub use straggler::{Late, LateCause, late_rank};
pub use trainer::{TRAINER_KIND, register, secret_hex};
