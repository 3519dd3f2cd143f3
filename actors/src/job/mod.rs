//! The training job: from a [`JobRequest`] and a cluster to trained replicas.
//!
//! [`run`] sizes the world from the cluster's free GPUs (else CPU trainers), spawns one
//! trainer actor per rank in a worker process of its own on its node, wires the ranks
//! into a ring, and drives them: the same number of steps to every rank per call,
//! evaluations, checkpoints, `metrics.jsonl`, progress. Every trainer failure or node loss
//! ends the job with the rank, node and cause; the loss of the head ends it saying so.
//! A stop asked through [`StopControl`] lets the step in flight end, saves a checkpoint
//! at the last completed step and ends the job with [`JobError::Interrupted`].
//!
//! The job says what happens through a [`JobOutput`] as typed [`JobEvent`]s; whoever
//! runs it renders them (`imgrun train` on its terminal) or keeps them for followers
//! (the coordinator actor of `coordinator.rs`, which runs a detached job inside the
//! cluster). The job prints nothing.
//!
//! The files' layers, bottom up (a file names only files of the layers below it; CI's
//! `tools/check-circles.py` fails on a circle among them):
//! 1. leaves: `error.rs` (why a job ended, and its `Progress`), `output.rs` (its events),
//!    `rules.rs` (the rules between its choices), `rank_totals.rs` (what the step loop
//!    counts per rank), and the pure decisions: `due.rs` (what
//!    is due at each step) and `recovery.rs` (what follows each end of the step loop),
//!    `tensorboard.rs` (records as TensorBoard event files), `joblog.rs` (the job's
//!    `job.log` and the reads of it), `attempts.rs` (which trainers have held each
//!    rank);
//! 2. `world.rs` (where its ranks run), `metrics.rs` (`metrics.jsonl`, and its records as
//!    TensorBoard events);
//! 3. `calls.rs` (a rank's handle, the typed calls to ranks);
//! 4. what acts on ranks: `watch.rs` (the head's events for them), `ranks.rs` (the hang
//!    doctor), `spawn.rs` (starting trainers, preload, the ring), `loader_actors.rs` (remote
//!    loader actors);
//! 5. `stop.rs` (how a caller stops the job, and the stop protocol every caller runs it
//!    under);
//! 6. `steps.rs` (the step loop, carrying out `due.rs`);
//! 7. `elastic.rs` (the calls of a loss's recovery and of growth);
//! 8. `driver.rs` ([`run`], carrying out `recovery.rs`);
//! 9. `coordinator.rs` (the actor that runs a detached job);
//! 10. `snapshot.rs` (the cluster and its jobs at one moment, asked of the head and the
//!     coordinators: what every view of a running cluster reads).

mod archive;
mod attempts;
mod calls;
mod coordinator;
mod driver;
mod due;
mod elastic;
mod error;
mod joblog;
mod loader_actors;
mod methods;
mod metrics;
mod output;
mod rank_totals;
mod ranks;
mod recovery;
mod rules;
mod snapshot;
mod spawn;
mod steps;
mod stop;
pub mod tensorboard;
mod watch;
mod world;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::train::JobSpec;
pub use archive::{
    ARCHIVE_KIND, Archive, ArchiveMethod, AskRequest, ForgetRequest, HasRequest, JobHandle,
    KeepRequest, LINGER, ListReply, ListRequest, MAX_ARCHIVED, archive_ids,
    register as register_archive, start_archive,
};
pub use coordinator::{CoordinatorInit, job_end};
pub use driver::{compute_line, elastic_line, newest_run, run, sync_lines};
pub use error::{HeadLost, Interrupted, JobError, Progress, RankCallError, RankFailure, Saved};
pub use joblog::{
    Journal, LOG_FILE, LogFrom, LogMatch, LogReply, LogRequest, LogSearchReply, LogSearchRequest,
    MAX_LOG_PIECE, SEARCH_WINDOW, read as read_log, read_in as read_log_in, search as search_log,
};
pub use methods::{
    COORDINATOR_KIND, CancelRequest, CoordinatorCallError, CoordinatorMethod, FollowReply,
    FollowRequest, JobStatus, MAX_TIMELINE, MAX_WARNINGS, MetricsReply, MetricsRequest,
    RanksRequest, StatusRequest, TimelineEntry, Warning,
};
pub use output::{JobEvent, JobOutput, JobState, Level, Moment};
pub use rank_totals::{RankTally, RankTotals};
pub use ranks::{RankOutputError, RankOutputReply, RankOutputRequest, RankView};
pub use rules::{JobChoices, RuleError, check_choices};
pub use snapshot::{
    COORDINATOR_CALL_TIMEOUT, ClusterSnapshot, JobLookupError, JobSnapshot, Jobs, SnapshotCache,
    call_coordinator, coordinator, coordinators, job_names, snapshot, snapshot_keeping,
};
pub use stop::{STOP_GRACE, StopControl, StopRequest, run_to_end_or_stop};
pub use watch::head_lost;
pub use world::{RankPlace, Trainers, check_plan, plan_world, trainable_steps};

/// Registers the kinds a job's cluster hosts: its coordinator and the archive of ended
/// jobs.
pub fn register(registry: &mut runtime::ActorRegistry) {
    coordinator::register(registry);
    archive::register(registry);
}

/// Everything a job needs besides its cluster: what every trainer is told, and how the
/// job itself is run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobRequest {
    pub spec: JobSpec,
    pub settings: JobSettings,
    /// Continue from this checkpoint: its folder, a run folder, `latest` (the newest
    /// run's latest checkpoint under the runs folder), or the URL of a checkpoint or a
    /// run in a checkpoint store (`s3://bucket/runs/RUN`).
    pub resume: Option<PathBuf>,
}

impl JobRequest {
    /// The choices the job's rules relate ([`check_choices`]).
    pub fn choices(&self) -> JobChoices {
        JobChoices {
            elastic: self.settings.elastic.is_some(),
            sync: self.spec.optim.sync,
            allreduce: self.spec.optim.allreduce,
            loaders: self.spec.data.loaders,
            preload: self.spec.data.sources.preload_dir.is_some(),
        }
    }

    /// Whether the job keeps every rule of [`check_choices`]; [`run`] refuses one that
    /// does not, however it was built.
    pub fn validate(&self) -> Result<(), JobError> {
        check_choices(&self.choices()).map_err(|error| JobError::Refused(error.to_string()))
    }
}

/// How the job is run: its world, its run folder and the cadence of its evaluations and
/// checkpoints (the `[train]` keys of the same names).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobSettings {
    /// GPU trainers (0: every free GPU).
    pub gpus: u32,
    /// CPU trainers when the cluster has no free GPU (0: one per node).
    pub cpu_trainers: u32,
    /// libtorch threads per trainer (0: the node's CPUs shared by its trainers).
    pub threads: u32,
    /// The learning rate at `reference_batch`; scaled linearly to the global batch.
    pub lr: f64,
    pub reference_batch: u64,
    /// The most a call of one step may take on a rank.
    pub step_timeout_secs: u64,
    pub eval_every_epochs: u64,
    pub eval_every_steps: u64,
    pub checkpoint_every_epochs: u64,
    pub checkpoint_every_steps: u64,
    /// The newest checkpoints a run keeps (0: every one); older ones go once a new one is
    /// complete.
    #[serde(default)]
    pub keep_checkpoints: u32,
    /// Also keep the checkpoint of the best validation top-1.
    #[serde(default)]
    pub keep_best: bool,
    /// Where rank 0 copies each checkpoint, under `RUN/checkpoints/`
    /// (`train.checkpoint_store`, `s3://bucket/prefix`); none: the run folder alone.
    #[serde(default)]
    pub checkpoint_store: Option<String>,
    /// How far behind the quickest rank a rank may be in one step before it is named
    /// (0: never).
    pub straggler_secs: f64,
    /// Write the samples of every rank's every step to `metrics.jsonl`
    /// (`train.sample_log`), to audit that an epoch served each sample once.
    #[serde(default)]
    pub sample_log: bool,
    /// Write each rank's own figures of every step into `metrics.jsonl` and as
    /// TensorBoard runs of their own, `tb/rank-N/` (`train.tensorboard_ranks`).
    #[serde(default)]
    pub tensorboard_ranks: bool,
    /// Where run folders are made.
    pub runs_dir: PathBuf,
    /// The run's name (its folder is `runs_dir/name`); empty: `run-<unix time>`.
    pub name: String,
    /// The cluster's failure-detection window: how long the head may take to name a
    /// failed rank after a healthy one has seen it go.
    pub dead_after_ms: u64,
    /// Go on without lost ranks (`train.elastic`); none: a lost rank fails the job.
    #[serde(default)]
    pub elastic: Option<Elastic>,
}

impl JobSettings {
    /// The run's name: `name` when given, else `run-<unix time>`. Every way of starting a
    /// job names its run here (the driver, and `imgrun train --detach`, which names it
    /// before its coordinator starts).
    pub fn run_name(&self) -> String {
        if self.name.is_empty() {
            timestamped_name("run")
        } else {
            self.name.clone()
        }
    }
}

/// Milliseconds from the Unix epoch to `at` (0 before it).
pub(crate) fn unix_ms(at: std::time::SystemTime) -> u64 {
    at.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as u64)
}

/// `<prefix>-<unix time>`: the name of a run that was given none (`run-…`, `demo-…`).
pub fn timestamped_name(prefix: &str) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!("{prefix}-{now}")
}

/// How far an elastic job shrinks (`train.elastic`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Elastic {
    /// The fewest ranks it goes on with (`train.min_world`).
    pub min_world: u32,
    /// The losses it survives (`train.max_failures`); the next one fails it.
    pub max_failures: u32,
}

/// What a finished job reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobSummary {
    pub run_dir: PathBuf,
    pub top1: Option<f64>,
    pub top5: Option<f64>,
    pub first_loss: Option<f32>,
    pub last_loss: Option<f32>,
    pub images_per_s: f64,
}
