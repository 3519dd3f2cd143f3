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
//! status, until it is stopped (`imgrun cancel` removes a finished job); a detached one
//! hands it to the cluster's archive of ended jobs and ends (`archive.rs`). Its methods
//! and their types are `methods.rs`'.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use runtime::{Actor, ActorContext, ActorRegistry, ClusterAccess, ClusterClient, MethodError};
use serde::{Deserialize, Serialize};
use tracing::warn;

use super::joblog::Journal;
use super::methods::{
    Answers, COORDINATOR_KIND, FollowReply, FollowRequest, JobStatus, MAX_TIMELINE, MAX_WARNINGS,
    TimelineEntry, Warning, answer, stop_name,
};
use super::ranks::{RankOutputReply, RankOutputRequest, RankView};
use super::stop::{STOP_GRACE, run_to_end_or_stop};
use super::{
    JobError, JobEvent, JobOutput, JobRequest, JobState, JobSummary, Level, Moment, StopControl,
    StopRequest, Trainers,
};

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
    /// Owned by no connection (`imgrun train --detach`): once the job has ended, its
    /// coordinator hands its final status to the cluster's archive and ends.
    #[serde(default)]
    pub detached: bool,
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
            let job = JobThread {
                access,
                request: init.request,
                control: control.clone(),
                aborted,
                archived_as: init.detached.then(|| ctx.id()),
            };
            std::thread::Builder::new()
                .name("imgrun-job".to_string())
                .spawn(move || run_job(&shared, job))
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
            .ok_or_else(|| {
                if self.shared.lock().status.state.is_final() {
                    MethodError::new("the job has ended: its ranks are gone")
                } else {
                    MethodError::new("the job has not started yet")
                }
            })?;
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
}

impl Answers for Coordinator {
    fn status(&self) -> JobStatus {
        full_status(&self.shared, &self.control)
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

    /// A rank's newest output lines, asked of its node from the job's runtime.
    fn rank_output(&self, request: &RankOutputRequest) -> Result<RankOutputReply, MethodError> {
        let control = self.control.clone();
        let request = request.clone();
        let what = format!("rank {}'s node", request.rank);
        self.on_job_runtime(Duration::from_secs(15), &what, async move {
            control.rank_output(&request).await
        })?
        .map_err(|error| MethodError::new(error.to_string()))
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

/// The job's status with where its step loop stands: its newest checkpoint and every
/// rank's totals.
fn full_status(shared: &Shared, control: &StopControl) -> JobStatus {
    let mut status = shared.lock().status.clone();
    status.checkpoint = control.progress().checkpoint.clone();
    status.rank_totals = control.rank_totals();
    status
}

impl Actor for Coordinator {
    fn call(&mut self, method: &str, payload: &[u8]) -> Result<Vec<u8>, MethodError> {
        answer(self, method, payload)
    }

    /// A graceful stop of a running job stops it as a cancel does, and waits for it. An
    /// ended job's thread has nothing left to save, and may be the one that asked (to
    /// end a coordinator that handed its job to the archive): it is not waited for.
    fn stopping(&mut self) {
        if self.cancel("cancel").state.is_final() {
            return;
        }
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

impl Drop for Coordinator {
    /// Killed, or dropped after a graceful stop: a job still running ends now.
    fn drop(&mut self) {
        self.abort.send_replace(true);
    }
}

/// What the job's thread is given.
struct JobThread {
    access: ClusterAccess,
    request: JobRequest,
    control: StopControl,
    /// Turns true when the coordinator is dropped (killed, or stopped).
    aborted: tokio::sync::watch::Receiver<bool>,
    /// The coordinator's own id, when it hands its ended job to the archive.
    archived_as: Option<runtime::ActorId>,
}

/// The job's thread: connects to the cluster, runs the job to its end (or to a stop,
/// given [`STOP_GRACE`] to save a checkpoint), kills its trainers and records how it
/// ended; a detached job's coordinator then hands its status to the archive and ends.
fn run_job(shared: &Arc<Shared>, job: JobThread) {
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
        let JobThread {
            access,
            request,
            control,
            aborted,
            archived_as,
        } = job;
        let state = runtime::StateDir::at(&access.state_dir);
        let client = match ClusterClient::connect(&state, Some(&access.head)).await {
            Ok(client) => client,
            Err(error) => {
                let outcome = format!("connecting to the cluster at {}: {error}", access.head);
                shared.finish(JobState::Failed, Some(outcome), None);
                return;
            }
        };
        run_to_end(shared, &client, request, &control, aborted.clone()).await;
        if let Some(own) = archived_as {
            super::archive::hand_over(&client, own, full_status(shared, &control), aborted).await;
        }
    });
    // The job's runtime (and what it holds open) goes with the thread.
    shared
        .runtime
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take();
}

/// Runs the job to its end, or to a stop, and records how it ended.
async fn run_to_end(
    shared: &Arc<Shared>,
    client: &ClusterClient,
    request: JobRequest,
    control: &StopControl,
    mut aborted: tokio::sync::watch::Receiver<bool>,
) {
    let trainers = Trainers::default();
    let job = super::run(client, request, shared.as_ref(), control, &trainers);
    let killed = async move {
        let _ = aborted.wait_for(|aborted| *aborted).await;
        JobError::Refused(
            "the job's coordinator was killed (its owner went away, or it was stopped at \
             once): every trainer was stopped"
                .to_string(),
        )
    };
    let outcome = run_to_end_or_stop(job, control, killed, STOP_GRACE).await;
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
