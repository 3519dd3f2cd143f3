//! The job's coordinator: an actor that runs a job ([`super::run`]) inside the cluster,
//! so that the job outlives the command that submitted it (`imgrun train --detach`).
//!
//! `imgrun train` on a running cluster spawns the coordinator on the head's node, inside
//! the head's daemon (it runs no native code), owned by the command's connection; with
//! `--detach`, owned by no connection. It connects to the cluster with
//! [`ActorContext::cluster`], runs the job on a thread of its own, and keeps every
//! [`JobEvent`] and the job's [`JobStatus`] for whoever follows it (`imgrun train` itself,
//! `imgrun logs`), lists it (`imgrun jobs`) or cancels it (Ctrl-C, `imgrun cancel`). The
//! trainers it spawns are owned by its connection; a coordinator that is killed (its
//! owner gone) kills them at once. A finished job's coordinator stays, with its final
//! status, until it is stopped (`imgrun cancel` removes a finished job).

use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use runtime::{Actor, ActorContext, ActorRegistry, ClusterAccess, ClusterClient, MethodError};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tracing::warn;

use super::joblog::{self, Journal, LogReply, LogRequest, LogSearchReply, LogSearchRequest};
use super::rank_totals::RankTotals;
use super::ranks::{RankOutputReply, RankOutputRequest, RankView};
use super::stop::{STOP_GRACE, run_to_end_or_stop};
use super::{
    JobError, JobEvent, JobOutput, JobRequest, JobState, JobSummary, Level, Moment, Saved,
    StopControl, StopRequest, Trainers,
};

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

/// The longest a [`FollowRequest`] waits for something new.
const MAX_FOLLOW_WAIT: Duration = Duration::from_secs(5);

/// Registers the coordinator's kind.
pub fn register(registry: &mut ActorRegistry) {
    registry.register(COORDINATOR_KIND, |ctx, args| {
        Ok(Box::new(Coordinator::new(ctx, args)?) as Box<dyn Actor>)
    });
}

/// What the coordinator is built with: the job's name (its run folder's) and request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CoordinatorInit {
    pub name: String,
    pub request: JobRequest,
}

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
fn stop_name(by: &str) -> &'static str {
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

/// Each method's request type, name and reply type, fixed once.
macro_rules! coordinator_methods {
    ($($request:ty => $name:literal, $reply:ty;)*) => {
        $(impl CoordinatorMethod for $request {
            const NAME: &'static str = $name;
            type Reply = $reply;
        })*
        /// Every method's name, for the error that names them.
        const METHODS: &[&str] = &[$($name),*];
    };
}

coordinator_methods! {
    FollowRequest => "follow", FollowReply;
    CancelRequest => "cancel", JobStatus;
    StatusRequest => "status", JobStatus;
    RanksRequest => "ranks", Vec<RankView>;
    RankOutputRequest => "rank_output", RankOutputReply;
    MetricsRequest => "metrics", MetricsReply;
    LogRequest => "log", LogReply;
    LogSearchRequest => "log_search", LogSearchReply;
}

/// What the job's thread and the actor's methods share.
struct Shared {
    log: Mutex<Log>,
    /// The run folder's `job.log`: every line the job says, and how it ended.
    journal: Mutex<Journal>,
    changed: Condvar,
    /// The job thread's async runtime, once it runs.
    runtime: Mutex<Option<tokio::runtime::Handle>>,
}

struct Log {
    events: Vec<JobEvent>,
    status: JobStatus,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn journal(&self) -> std::sync::MutexGuard<'_, Journal> {
        self.journal.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn finish(&self, state: JobState, outcome: Option<String>, summary: Option<JobSummary>) {
        let mut log = self.lock();
        if log.status.state.is_final() {
            return;
        }
        let now = std::time::SystemTime::now();
        self.journal().ended(now, state, outcome.as_deref());
        let entry = TimelineEntry {
            at_unix_ms: super::unix_ms(now),
            moment: Moment::Ended {
                state,
                outcome: outcome.clone(),
            },
        };
        keep_newest(&mut log.status.timeline, MAX_TIMELINE, entry);
        log.status.state = state;
        log.status.outcome = outcome;
        if let Some(summary) = &summary {
            log.status.run_dir = Some(summary.run_dir.clone());
        }
        log.status.summary = summary;
        drop(log);
        self.changed.notify_all();
    }
}

impl JobOutput for Shared {
    fn event(&self, event: JobEvent) {
        let mut log = self.lock();
        let status = &mut log.status;
        match &event {
            JobEvent::EpochStarted {
                epoch,
                steps,
                position,
            } => {
                status.epoch = Some(*epoch);
                status.steps = *steps;
                status.position = *position;
            }
            JobEvent::Stepped {
                position,
                loss,
                images_per_s,
                lr,
                step_s,
                data_wait_s,
                allreduce_s,
                ..
            } => {
                status.position = *position;
                status.loss = Some(*loss);
                status.images_per_s = Some(*images_per_s);
                status.lr = Some(*lr);
                status.step_s = Some(*step_s);
                status.data_wait_s = Some(*data_wait_s);
                status.allreduce_s = Some(*allreduce_s);
            }
            JobEvent::Line { level, text } => {
                let now = std::time::SystemTime::now();
                self.journal().line(now, text);
                if *level == Level::Warning {
                    let warning = Warning {
                        at_unix_ms: super::unix_ms(now),
                        text: text.clone(),
                    };
                    keep_newest(&mut status.warnings, MAX_WARNINGS, warning);
                }
            }
            JobEvent::Moment { moment } => {
                let entry = TimelineEntry {
                    at_unix_ms: super::unix_ms(std::time::SystemTime::now()),
                    moment: moment.clone(),
                };
                keep_newest(&mut status.timeline, MAX_TIMELINE, entry);
            }
            JobEvent::EpochEnded { .. } | JobEvent::Preloading { .. } | JobEvent::Preloaded => {}
        }
        log.events.push(event);
        drop(log);
        self.changed.notify_all();
    }

    fn run_folder(&self, dir: &std::path::Path) {
        if let Err(error) = self.journal().open(dir) {
            warn!(%error, dir = %dir.display(), "opening the job's log; it is not kept");
        }
        self.lock().status.run_dir = Some(dir.to_path_buf());
    }
}

struct Coordinator {
    shared: Arc<Shared>,
    stop: StopRequest,
    /// Where the job stands (its newest checkpoint), as the job's step loop keeps it.
    control: StopControl,
    /// Told when the coordinator is dropped without a graceful stop (killed): the job
    /// ends at once and its trainers are killed.
    abort: tokio::sync::watch::Sender<bool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Coordinator {
    fn new(ctx: &ActorContext, args: &[u8]) -> Result<Self, MethodError> {
        let init: CoordinatorInit = serde_json::from_slice(args)
            .map_err(|error| MethodError::new(format!("bad coordinator arguments: {error}")))?;
        let access = ctx.cluster().cloned().ok_or_else(|| {
            MethodError::new(
                "a job's coordinator runs in a cluster's daemon, and this one has none",
            )
        })?;
        let shared = Arc::new(Shared {
            log: Mutex::new(Log {
                events: Vec::new(),
                status: JobStatus::new(
                    &init.name,
                    JobState::Running,
                    Some(init.request.settings.runs_dir.join(&init.name)),
                ),
            }),
            journal: Mutex::new(Journal::new()),
            changed: Condvar::new(),
            runtime: Mutex::new(None),
        });
        let (stop, control) = StopControl::new();
        let (abort, aborted) = tokio::sync::watch::channel(false);
        let thread = {
            let shared = shared.clone();
            let control = control.clone();
            std::thread::Builder::new()
                .name("imgrun-job".to_string())
                .spawn(move || run_job(&shared, access, init.request, control, aborted))
                .map_err(|error| MethodError::new(format!("starting the job's thread: {error}")))?
        };
        Ok(Coordinator {
            shared,
            stop,
            control,
            abort,
            thread: Some(thread),
        })
    }

    fn status(&self) -> JobStatus {
        let mut status = self.shared.lock().status.clone();
        status.checkpoint = self.control.progress().checkpoint.clone();
        status.rank_totals = self.control.rank_totals();
        status
    }

    fn follow(&self, request: &FollowRequest) -> FollowReply {
        let wait = Duration::from_millis(request.wait_ms).min(MAX_FOLLOW_WAIT);
        let mut log = self.shared.lock();
        let after = usize::try_from(request.after).unwrap_or(usize::MAX);
        if log.events.len() <= after && !log.status.state.is_final() && !wait.is_zero() {
            log = self
                .shared
                .changed
                .wait_timeout_while(log, wait, |log| {
                    log.events.len() <= after && !log.status.state.is_final()
                })
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        let events = log.events.get(after..).unwrap_or_default().to_vec();
        let next = log.events.len() as u64;
        drop(log);
        FollowReply {
            events,
            next,
            status: self.status(),
        }
    }

    /// Every rank's phase, asked on the job's runtime.
    fn ranks(&self) -> Result<Vec<RankView>, MethodError> {
        let control = self.control.clone();
        self.on_job_runtime(Duration::from_secs(10), "the ranks", async move {
            control.rank_views().await
        })
    }

    /// Runs `work` on the job thread's async runtime (where its ranks' handles live) and
    /// waits at most `limit` for it; `what` names it in the error.
    fn on_job_runtime<T: Send + 'static>(
        &self,
        limit: Duration,
        what: &str,
        work: impl std::future::Future<Output = T> + Send + 'static,
    ) -> Result<T, MethodError> {
        let runtime = self
            .shared
            .runtime
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(|| MethodError::new("the job has not started yet"))?;
        let (tx, rx) = std::sync::mpsc::channel();
        runtime.spawn(async move {
            let _ = tx.send(work.await);
        });
        rx.recv_timeout(limit).map_err(|_| {
            MethodError::new(format!(
                "{what} did not answer within {} s",
                limit.as_secs()
            ))
        })
    }

    /// A rank's newest output lines, asked of its node from the job's runtime.
    fn rank_output(&self, request: &RankOutputRequest) -> Result<RankOutputReply, MethodError> {
        let control = self.control.clone();
        let (rank, lines) = (request.rank, request.lines);
        let what = format!("rank {rank}'s node");
        self.on_job_runtime(Duration::from_secs(15), &what, async move {
            control.rank_output(rank, lines).await
        })?
        .map_err(|error| MethodError::new(error.to_string()))
    }

    fn metrics(&self, request: &MetricsRequest) -> Result<MetricsReply, MethodError> {
        use std::io::{Read, Seek};
        let run_dir = self
            .status()
            .run_dir
            .ok_or_else(|| MethodError::new("the job has no run folder yet"))?;
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

    /// The run folder, or why there is none yet.
    fn run_dir(&self) -> Result<PathBuf, MethodError> {
        self.status()
            .run_dir
            .ok_or_else(|| MethodError::new("the job has no run folder yet"))
    }

    fn log(&self, request: &LogRequest) -> Result<LogReply, MethodError> {
        let run_dir = self.run_dir()?;
        joblog::read_in(&run_dir, request).map_err(|error| log_error(&run_dir, &error))
    }

    fn log_search(&self, request: &LogSearchRequest) -> Result<LogSearchReply, MethodError> {
        let run_dir = self.run_dir()?;
        joblog::search_in(&run_dir, request).map_err(|error| log_error(&run_dir, &error))
    }

    fn cancel(&self, by: &str) -> JobStatus {
        let mut log = self.shared.lock();
        if log.status.state == JobState::Running {
            log.status.state = JobState::Stopping;
            self.stop.stop(stop_name(by));
        }
        drop(log);
        self.status()
    }
}

impl Actor for Coordinator {
    fn call(&mut self, method: &str, payload: &[u8]) -> Result<Vec<u8>, MethodError> {
        fn decode<M: CoordinatorMethod>(payload: &[u8]) -> Result<M, MethodError> {
            serde_json::from_slice(payload)
                .map_err(|error| MethodError::new(format!("{}: bad request: {error}", M::NAME)))
        }
        fn encode<T: Serialize>(reply: &T) -> Result<Vec<u8>, MethodError> {
            serde_json::to_vec(reply).map_err(|error| MethodError::new(error.to_string()))
        }
        match method {
            FollowRequest::NAME => encode(&self.follow(&decode::<FollowRequest>(payload)?)),
            CancelRequest::NAME => encode(&self.cancel(&decode::<CancelRequest>(payload)?.by)),
            StatusRequest::NAME => encode(&self.status()),
            RanksRequest::NAME => encode(&self.ranks()?),
            RankOutputRequest::NAME => {
                encode(&self.rank_output(&decode::<RankOutputRequest>(payload)?)?)
            }
            MetricsRequest::NAME => encode(&self.metrics(&decode::<MetricsRequest>(payload)?)?),
            LogRequest::NAME => encode(&self.log(&decode::<LogRequest>(payload)?)?),
            LogSearchRequest::NAME => {
                encode(&self.log_search(&decode::<LogSearchRequest>(payload)?)?)
            }
            other => Err(MethodError::new(format!(
                "a job's coordinator has no method '{other}' (it has {})",
                METHODS.join(", ")
            ))),
        }
    }

    /// A graceful stop of a running job stops it as a cancel does, and waits for it.
    fn stopping(&mut self) {
        self.cancel("cancel");
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            warn!("the job's thread panicked");
        }
    }
}

/// How a job that ended with `outcome` ended: its state and what its log says of it.
pub fn job_end(outcome: &Result<JobSummary, JobError>) -> (JobState, String) {
    match outcome {
        Ok(summary) => (
            JobState::Succeeded,
            format!(
                "done: validation top-1 {}; {:.0} images/s; run folder {}",
                summary
                    .top1
                    .map_or("-".to_string(), |t| format!("{:.2}%", t * 100.0)),
                summary.images_per_s,
                summary.run_dir.display()
            ),
        ),
        Err(error) => match error.interrupted() {
            Some(interrupted) => (JobState::Cancelled, interrupted.summary()),
            None => (JobState::Failed, error.to_string()),
        },
    }
}

/// Adds `item` to the newest of `list`, dropping the oldest past `max`.
fn keep_newest<T>(list: &mut Vec<T>, max: usize, item: T) {
    if list.len() >= max {
        list.drain(..=list.len() - max);
    }
    list.push(item);
}

/// A failed read of `run_dir`'s log, naming it.
fn log_error(run_dir: &std::path::Path, error: &std::io::Error) -> MethodError {
    let path = run_dir.join(joblog::LOG_FILE);
    if error.kind() == std::io::ErrorKind::NotFound {
        return MethodError::new(format!("{}: the job has no log yet", path.display()));
    }
    MethodError::new(format!("{}: {error}", path.display()))
}

impl Drop for Coordinator {
    /// Killed, or dropped after a graceful stop: a job still running ends now.
    fn drop(&mut self) {
        self.abort.send_replace(true);
    }
}

/// The job's thread: connects to the cluster, runs the job to its end (or to a stop,
/// given [`STOP_GRACE`] to save a checkpoint), kills its trainers and records how it
/// ended.
fn run_job(
    shared: &Arc<Shared>,
    access: ClusterAccess,
    request: JobRequest,
    stop: StopControl,
    mut aborted: tokio::sync::watch::Receiver<bool>,
) {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            let outcome = format!("starting the job's async runtime: {error}");
            shared.finish(JobState::Failed, Some(outcome), None);
            return;
        }
    };
    *shared
        .runtime
        .lock()
        .unwrap_or_else(PoisonError::into_inner) = Some(runtime.handle().clone());
    runtime.block_on(async {
        let state = runtime::StateDir::at(&access.state_dir);
        let client = match ClusterClient::connect(&state, Some(&access.head)).await {
            Ok(client) => client,
            Err(error) => {
                let outcome = format!("connecting to the cluster at {}: {error}", access.head);
                shared.finish(JobState::Failed, Some(outcome), None);
                return;
            }
        };
        let trainers = Trainers::default();
        let job = super::run(&client, request, shared.as_ref(), &stop, &trainers);
        let killed = async move {
            let _ = aborted.wait_for(|aborted| *aborted).await;
            JobError::Refused(
                "the job's coordinator was killed (its owner went away, or it was stopped at \
                 once): every trainer was stopped"
                    .to_string(),
            )
        };
        let outcome = run_to_end_or_stop(job, &stop, killed, STOP_GRACE).await;
        trainers.kill_all().await;
        let (state, line) = job_end(&outcome);
        match outcome {
            Ok(summary) => shared.finish(state, Some(line), Some(summary)),
            Err(error) => {
                if let Some(interrupted) = error.interrupted() {
                    let mut log = shared.lock();
                    log.status.stopped_by = Some(interrupted.by.to_string());
                    log.status.late = interrupted.late.clone();
                }
                shared.finish(state, Some(line), None);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_keeps_the_newest_warnings() {
        let mut warnings = Vec::new();
        for i in 0..(MAX_WARNINGS as u64 + 5) {
            let warning = Warning {
                at_unix_ms: i,
                text: format!("warning: {i}"),
            };
            keep_newest(&mut warnings, MAX_WARNINGS, warning);
        }
        let kept: Vec<u64> = warnings.iter().map(|w| w.at_unix_ms).collect();
        assert_eq!(kept, (5..MAX_WARNINGS as u64 + 5).collect::<Vec<_>>());
        assert_eq!(warnings[0].text, "warning: 5");
    }

    #[test]
    fn a_timeline_entry_reads_as_flat_json() {
        let entry = TimelineEntry {
            at_unix_ms: 7,
            moment: Moment::Lost {
                ranks: vec![1, 3],
                cause: "node 2 left".to_string(),
            },
        };
        let json = serde_json::to_value(&entry).expect("encodes");
        assert_eq!(
            json,
            serde_json::json!({"at_unix_ms": 7, "kind": "lost", "ranks": [1, 3], "cause": "node 2 left"})
        );
        let back: TimelineEntry = serde_json::from_value(json).expect("decodes");
        assert_eq!(back, entry);
        let ended = TimelineEntry {
            at_unix_ms: 8,
            moment: Moment::Ended {
                state: JobState::Failed,
                outcome: Some("rank 0 lost".to_string()),
            },
        };
        let text = serde_json::to_string(&ended).expect("encodes");
        assert!(
            text.contains(r#""kind":"ended","state":"failed""#),
            "{text}"
        );
    }
}
