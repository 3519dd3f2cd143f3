//! A job's coordinator methods, as the coordinator and the archive of ended jobs both
//! answer them: the job's [`JobStatus`], each method's request and reply types
//! ([`CoordinatorMethod`]), and [`answer`], which decodes a call and dispatches it to an
//! [`Answers`]. A leaf of `job/`: `coordinator.rs` (a running job) and `archive.rs` (an
//! ended one) answer through it, and `snapshot.rs` asks through it.

use std::path::PathBuf;

use runtime::{ActorCallError, MethodError};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::joblog::{self, LogReply, LogRequest, LogSearchReply, LogSearchRequest};
use super::rank_totals::RankTotals;
use super::ranks::{RankOutputReply, RankOutputRequest, RankView};
use super::{JobEvent, JobState, JobSummary, Moment, Saved};

/// The most warnings a [`JobStatus`] carries.
pub const MAX_WARNINGS: usize = 20;

/// The most turns of its life a [`JobStatus`] carries.
pub const MAX_TIMELINE: usize = 100;

/// A turn in the job's life, and when.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimelineEntry {
    pub at_unix_ms: u64,
    #[serde(flatten)]
    pub moment: Moment,
}

/// A warning the job gave, and when.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Warning {
    pub at_unix_ms: u64,
    pub text: String,
}

/// The coordinator's actor kind.
pub const COORDINATOR_KIND: &str = "job";

/// A job as `imgrun jobs` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobStatus {
    pub name: String,
    pub state: JobState,
    /// On the coordinator's machine (the head's).
    pub run_dir: Option<PathBuf>,
    pub epoch: Option<u64>,
    /// Steps done in the epoch, of `steps`.
    pub position: u64,
    pub steps: u64,
    pub loss: Option<f32>,
    pub images_per_s: Option<f64>,
    /// The newest step's learning rate, wall time (its slowest rank's), and the ranks'
    /// mean data wait and allreduce, in seconds.
    #[serde(default)]
    pub lr: Option<f64>,
    #[serde(default)]
    pub step_s: Option<f64>,
    #[serde(default)]
    pub data_wait_s: Option<f64>,
    #[serde(default)]
    pub allreduce_s: Option<f64>,
    /// Every rank's running totals, step time quantiles and straggler flag.
    #[serde(default)]
    pub rank_totals: Vec<RankTotals>,
    /// The job's newest warnings (a lost or late rank, a regroup, a failed save, ...),
    /// at most [`MAX_WARNINGS`], oldest first; all of them are in its `job.log`.
    #[serde(default)]
    pub warnings: Vec<Warning>,
    /// The job's newest turns (ranks lost, regroups, checkpoints, its end), at most
    /// [`MAX_TIMELINE`], oldest first.
    #[serde(default)]
    pub timeline: Vec<TimelineEntry>,
    /// The newest checkpoint.
    pub checkpoint: Option<Saved>,
    /// How it ended: why it failed or how it stopped (where its checkpoint is).
    pub outcome: Option<String>,
    /// For a job that was stopped: who asked (`SIGINT`, `SIGTERM`, `cancel`), and why it
    /// could not stop at a checkpoint of its last step, when it could not.
    pub stopped_by: Option<String>,
    pub late: Option<String>,
    /// What a job that succeeded reports.
    pub summary: Option<JobSummary>,
}

impl JobStatus {
    /// A job that has said nothing yet but its name, its state and its run folder.
    pub fn new(name: &str, state: JobState, run_dir: Option<PathBuf>) -> Self {
        JobStatus {
            name: name.to_owned(),
            state,
            run_dir,
            epoch: None,
            position: 0,
            steps: 0,
            loss: None,
            images_per_s: None,
            lr: None,
            step_s: None,
            data_wait_s: None,
            allreduce_s: None,
            rank_totals: Vec::new(),
            warnings: Vec::new(),
            timeline: Vec::new(),
            checkpoint: None,
            outcome: None,
            stopped_by: None,
            late: None,
            summary: None,
        }
    }
}

/// A coordinator method: the request is `Self`, the reply `Self::Reply`.
pub trait CoordinatorMethod: Serialize + DeserializeOwned {
    const NAME: &'static str;
    type Reply: Serialize + DeserializeOwned + Send + 'static;
}

/// The job's events from number `after` on (0: all), waiting up to `wait_ms` (at most
/// 5 s) for one when there is none yet and the job runs.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FollowRequest {
    pub after: u64,
    pub wait_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FollowReply {
    pub events: Vec<JobEvent>,
    /// What to ask `after` next.
    pub next: u64,
    pub status: JobStatus,
}

/// Asks the job to stop after its step in flight, with a checkpoint. `by` names who asks:
/// `SIGINT` or `SIGTERM` (a following command's signal) or, by default, `cancel`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CancelRequest {
    #[serde(default)]
    pub by: String,
}

/// The names a stop may be asked by.
pub(super) fn stop_name(by: &str) -> &'static str {
    match by {
        "SIGINT" => "SIGINT",
        "SIGTERM" => "SIGTERM",
        _ => "cancel",
    }
}

/// The job's status now.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct StatusRequest {}

/// Every rank's phase now (the hang doctor's view).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RanksRequest {}

/// A piece of the run's `metrics.jsonl` on the coordinator's machine: up to `max_bytes`
/// (at most 4 MiB) from byte `offset`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct MetricsRequest {
    pub offset: u64,
    pub max_bytes: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MetricsReply {
    pub bytes: Vec<u8>,
    /// The file's length now.
    pub length: u64,
}

/// The most one [`MetricsRequest`] returns.
const MAX_METRICS_PIECE: u64 = 4 << 20;

/// Each method's request type, name and reply type, fixed once, as implementations of
/// `$method` (a trait with `NAME` and `Reply`), and every name in `METHODS`, for the
/// error that names them. The coordinator's and the archive's methods are both declared
/// with it.
macro_rules! typed_methods {
    ($method:ident: $($request:ty => $name:literal, $reply:ty;)*) => {
        $(impl $method for $request {
            const NAME: &'static str = $name;
            type Reply = $reply;
        })*
        /// Every method's name, for the error that names them.
        const METHODS: &[&str] = &[$($name),*];
    };
}
pub(super) use typed_methods;

typed_methods! {
    CoordinatorMethod:
    FollowRequest => "follow", FollowReply;
    CancelRequest => "cancel", JobStatus;
    StatusRequest => "status", JobStatus;
    RanksRequest => "ranks", Vec<RankView>;
    RankOutputRequest => "rank_output", RankOutputReply;
    MetricsRequest => "metrics", MetricsReply;
    LogRequest => "log", LogReply;
    LogSearchRequest => "log_search", LogSearchReply;
}

/// What a job answers, running or ended: the coordinator's methods. Its metrics and log
/// are read from its run folder.
pub(super) trait Answers {
    fn status(&self) -> JobStatus;
    fn follow(&self, request: &FollowRequest) -> FollowReply;
    fn ranks(&self) -> Result<Vec<RankView>, MethodError>;
    fn rank_output(&self, request: &RankOutputRequest) -> Result<RankOutputReply, MethodError>;
    fn cancel(&self, by: &str) -> JobStatus;

    /// The run folder, or why there is none yet.
    fn run_dir(&self) -> Result<PathBuf, MethodError> {
        self.status()
            .run_dir
            .ok_or_else(|| MethodError::new("the job has no run folder yet"))
    }

    fn metrics(&self, request: &MetricsRequest) -> Result<MetricsReply, MethodError> {
        read_metrics(&self.run_dir()?, request)
    }

    fn log(&self, request: &LogRequest) -> Result<LogReply, MethodError> {
        let run_dir = self.run_dir()?;
        joblog::read_in(&run_dir, request).map_err(|error| log_error(&run_dir, &error))
    }

    fn log_search(&self, request: &LogSearchRequest) -> Result<LogSearchReply, MethodError> {
        let run_dir = self.run_dir()?;
        joblog::search_in(&run_dir, request).map_err(|error| log_error(&run_dir, &error))
    }
}

/// Answers `method` with `payload` from `job`.
pub(super) fn answer(
    job: &impl Answers,
    method: &str,
    payload: &[u8],
) -> Result<Vec<u8>, MethodError> {
    fn decode<M: CoordinatorMethod>(payload: &[u8]) -> Result<M, MethodError> {
        decode_request(M::NAME, payload)
    }
    match method {
        FollowRequest::NAME => encode(&job.follow(&decode::<FollowRequest>(payload)?)),
        CancelRequest::NAME => encode(&job.cancel(&decode::<CancelRequest>(payload)?.by)),
        StatusRequest::NAME => encode(&job.status()),
        RanksRequest::NAME => encode(&job.ranks()?),
        RankOutputRequest::NAME => {
            encode(&job.rank_output(&decode::<RankOutputRequest>(payload)?)?)
        }
        MetricsRequest::NAME => encode(&job.metrics(&decode::<MetricsRequest>(payload)?)?),
        LogRequest::NAME => encode(&job.log(&decode::<LogRequest>(payload)?)?),
        LogSearchRequest::NAME => encode(&job.log_search(&decode::<LogSearchRequest>(payload)?)?),
        other => Err(MethodError::new(format!(
            "a job's coordinator has no method '{other}' (it has {})",
            METHODS.join(", ")
        ))),
    }
}

/// The request of method `name`, from its JSON.
pub(super) fn decode_request<M: DeserializeOwned>(
    name: &str,
    payload: &[u8],
) -> Result<M, MethodError> {
    serde_json::from_slice(payload)
        .map_err(|error| MethodError::new(format!("{name}: bad request: {error}")))
}

/// A method's reply, as JSON.
pub(super) fn encode<T: Serialize>(reply: &T) -> Result<Vec<u8>, MethodError> {
    serde_json::to_vec(reply).map_err(|error| MethodError::new(error.to_string()))
}

/// Up to `request.max_bytes` of `run_dir`'s `metrics.jsonl` from `request.offset`.
fn read_metrics(
    run_dir: &std::path::Path,
    request: &MetricsRequest,
) -> Result<MetricsReply, MethodError> {
    use std::io::{Read, Seek};
    let path = run_dir.join("metrics.jsonl");
    let mut file = std::fs::File::open(&path)
        .map_err(|error| MethodError::new(format!("{}: {error}", path.display())))?;
    let length = file
        .metadata()
        .map_err(|error| MethodError::new(format!("{}: {error}", path.display())))?
        .len();
    let want = request.max_bytes.clamp(1, MAX_METRICS_PIECE);
    let mut bytes = Vec::new();
    file.seek(std::io::SeekFrom::Start(request.offset.min(length)))
        .and_then(|_| file.take(want).read_to_end(&mut bytes))
        .map_err(|error| MethodError::new(format!("{}: {error}", path.display())))?;
    Ok(MetricsReply { bytes, length })
}

/// A failed read of `run_dir`'s log, naming it.
fn log_error(run_dir: &std::path::Path, error: &std::io::Error) -> MethodError {
    let path = run_dir.join(joblog::LOG_FILE);
    if error.kind() == std::io::ErrorKind::NotFound {
        return MethodError::new(format!("{}: the job has no log yet", path.display()));
    }
    MethodError::new(format!("{}: {error}", path.display()))
}

/// Why a coordinator call failed.
#[derive(Debug, thiserror::Error)]
pub enum CoordinatorCallError {
    #[error("encoding the {method} request: {source}")]
    Encode {
        method: &'static str,
        source: serde_json::Error,
    },
    #[error("asking the job's coordinator ({method}): {source}")]
    Call {
        method: &'static str,
        source: ActorCallError,
    },
    #[error("the job's coordinator answered {method} badly: {source}")]
    Decode {
        method: &'static str,
        source: serde_json::Error,
    },
}
