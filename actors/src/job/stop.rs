//! How whoever runs a job asks it to stop (a signal's name, or `cancel`), and what the
//! job tells it back: where it stands, and its ranks for the hang doctor. And the stop
//! protocol, the same for every way a job is run (`imgrun train` on a terminal, the
//! coordinator actor inside the cluster): a stop asked through the job's [`StopControl`]
//! lets the step in flight end and a checkpoint be saved at the last step, within
//! [`STOP_GRACE`]. Past the grace, or when whoever runs the job ends it at once (a
//! second signal, the coordinator killed), the job ends without that checkpoint, saying
//! why ([`run_to_end_or_stop`]).
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::JobSummary;
use super::attempts::{RankAttempts, Trainer};
use super::calls::RankHandle;
use super::error::{Interrupted, JobError, Progress};
use super::rank_totals::{RankTally, RankTotals};
use super::ranks::{
    RankOutputError, RankOutputReply, RankOutputRequest, RankView, rank_output, rank_views,
};

/// How whoever runs the job tells the step loop to stop (a signal's name, or `cancel`),
/// and what the loop tells it back.
#[derive(Clone)]
pub struct StopControl {
    requested: tokio::sync::watch::Receiver<Option<&'static str>>,
    progress: Arc<Mutex<Progress>>,
    /// The job's ranks, once spawned, the cluster they run on, and each rank's attempts,
    /// for the hang doctor and the ranks' logs.
    ranks: Arc<Mutex<RanksNow>>,
    /// What the step loop counts per rank.
    tally: Arc<Mutex<RankTally>>,
}

impl std::fmt::Debug for StopControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StopControl")
            .field("requested", &*self.requested.borrow())
            .field("progress", &*self.progress())
            .finish_non_exhaustive()
    }
}

/// The job's ranks as the step loop last set them, and every rank's attempts so far.
#[derive(Clone, Default)]
struct RanksNow {
    handles: Vec<RankHandle>,
    client: Option<runtime::ClusterClient>,
    attempts: RankAttempts,
}

/// The sending half of a [`StopControl`]: asks the job to stop.
#[derive(Debug)]
pub struct StopRequest(tokio::sync::watch::Sender<Option<&'static str>>);

impl StopRequest {
    /// Asks the job to stop after the step in flight; `by` names who asked (`SIGINT`,
    /// `SIGTERM`, `cancel`).
    pub fn stop(&self, by: &'static str) {
        let _ = self.0.send(Some(by));
    }
}

impl StopControl {
    pub fn new() -> (StopRequest, StopControl) {
        let (tx, requested) = tokio::sync::watch::channel(None);
        let control = StopControl {
            requested,
            progress: Arc::new(Mutex::new(Progress::default())),
            ranks: Arc::default(),
            tally: Arc::default(),
        };
        (StopRequest(tx), control)
    }

    /// Where the job stands now.
    pub fn progress(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The per-rank tally the step loop keeps.
    pub(crate) fn tally(&self) -> std::sync::MutexGuard<'_, RankTally> {
        self.tally.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every rank's totals so far.
    pub fn rank_totals(&self) -> Vec<RankTotals> {
        self.tally().totals()
    }

    /// The job's world is `ranks` now (its first, or one after a regroup or a growth, or
    /// the same again): each rank whose trainer changed has a new attempt.
    pub(crate) fn set_ranks(&self, ranks: &[RankHandle], client: &runtime::ClusterClient) {
        let world: Vec<(u32, Trainer)> = ranks
            .iter()
            .map(|handle| {
                let trainer = Trainer {
                    actor: handle.actor.id(),
                    node: handle.place.node,
                };
                (handle.rank, trainer)
            })
            .collect();
        let mut now = self.ranks_now();
        now.attempts = now.attempts.with_world(&world);
        now.handles = ranks.to_vec();
        now.client = Some(client.clone());
    }

    fn ranks_now(&self) -> std::sync::MutexGuard<'_, RanksNow> {
        self.ranks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every rank's phase now, from its monitor, with its node's last heartbeat (none
    /// before the ranks are up).
    pub async fn rank_views(&self) -> Vec<RankView> {
        let (ranks, client) = {
            let now = self.ranks_now();
            (now.handles.clone(), now.client.clone())
        };
        rank_views(&ranks, client.as_ref()).await
    }

    /// The newest lines of the process of the rank's attempt that `request` names (the
    /// current one by default), from its node.
    pub async fn rank_output(
        &self,
        request: &RankOutputRequest,
    ) -> Result<RankOutputReply, RankOutputError> {
        let now = self.ranks_now().clone();
        rank_output(&now.handles, &now.attempts, now.client.as_ref(), request).await
    }

    pub(super) fn requested(&self) -> Option<&'static str> {
        *self.requested.borrow()
    }

    /// The stop requests, to wait for one.
    pub(crate) fn watch(&self) -> tokio::sync::watch::Receiver<Option<&'static str>> {
        self.requested.clone()
    }
}

/// How long a stopping job may take to end its step in flight and save a checkpoint.
pub const STOP_GRACE: Duration = Duration::from_secs(20);

/// Runs `job` to its end under the stop protocol, given `grace` ([`STOP_GRACE`] but in
/// tests) once a stop is asked. `at_once` resolves when whoever runs the job ends it
/// without waiting, with the error the job then ends with; it is polled from the start,
/// so it may also be what asks the stop (a first signal) before it ends the job (a
/// second).
pub async fn run_to_end_or_stop(
    job: impl Future<Output = Result<JobSummary, JobError>>,
    stop: &StopControl,
    at_once: impl Future<Output = JobError>,
    grace: Duration,
) -> Result<JobSummary, JobError> {
    let mut job = std::pin::pin!(job);
    let mut at_once = std::pin::pin!(at_once);
    let by = tokio::select! {
        outcome = &mut job => return outcome,
        error = &mut at_once => return Err(error),
        by = stop_asked(stop) => by,
    };
    let late = |why: String| {
        JobError::Interrupted(Box::new(Interrupted::late(
            by,
            stop.progress().clone(),
            why,
        )))
    };
    tokio::select! {
        outcome = &mut job => match outcome {
            Err(error) if error.interrupted().is_none() => {
                Err(late(format!("the job failed while stopping: {error}")))
            }
            other => other,
        },
        error = &mut at_once => Err(error),
        () = tokio::time::sleep(grace) => {
            Err(late(format!("no step ended within {} s", grace.as_secs())))
        }
    }
}

/// Resolves when a stop is asked, with who asked.
async fn stop_asked(stop: &StopControl) -> &'static str {
    let mut requested = stop.watch();
    loop {
        if let Some(by) = *requested.borrow_and_update() {
            return by;
        }
        if requested.changed().await.is_err() {
            return std::future::pending().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::job::Progress;

    const GRACE: Duration = Duration::from_millis(200);

    fn summary() -> JobSummary {
        JobSummary {
            run_dir: PathBuf::from("runs/r"),
            top1: None,
            top5: None,
            first_loss: None,
            last_loss: None,
            images_per_s: 1.0,
        }
    }

    /// What the job ends with, in a few words.
    fn ending(outcome: &Result<JobSummary, JobError>) -> String {
        match outcome {
            Ok(_) => "done".to_string(),
            Err(JobError::Interrupted(i)) => match &i.late {
                None => format!("interrupted by {} at a checkpoint", i.by),
                Some(why) => format!("interrupted by {}, late: {why}", i.by),
            },
            Err(error) => format!("failed: {error}"),
        }
    }

    /// How the job behaves once a stop is asked.
    #[derive(Clone, Copy)]
    enum Job {
        /// Ends by itself after this long, stop or not.
        EndsAfter(u64),
        /// Ends at a checkpoint soon after a stop is asked, never without one.
        StopsAtACheckpoint,
        /// Fails soon after a stop is asked.
        FailsWhileStopping,
        /// Never ends.
        Hangs,
    }

    async fn job(kind: Job, stop: StopControl) -> Result<JobSummary, JobError> {
        match kind {
            Job::EndsAfter(ms) => {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Ok(summary())
            }
            Job::StopsAtACheckpoint | Job::FailsWhileStopping => {
                let by = stop_asked(&stop).await;
                tokio::time::sleep(Duration::from_millis(20)).await;
                if matches!(kind, Job::FailsWhileStopping) {
                    return Err(JobError::Refused("rank 1 lost".to_string()));
                }
                Err(JobError::Interrupted(Box::new(Interrupted::in_time(
                    by,
                    Progress::default(),
                ))))
            }
            Job::Hangs => std::future::pending().await,
        }
    }

    /// When the stop is asked and when whoever runs the job ends it at once (ms from the
    /// start; none: never).
    async fn run(kind: Job, stop_at: Option<u64>, at_once_at: Option<u64>) -> String {
        let (request, stop) = StopControl::new();
        let asker = async move {
            if let Some(ms) = stop_at {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                request.stop("SIGINT");
            }
            std::future::pending::<()>().await;
        };
        let at_once = async move {
            match at_once_at {
                Some(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
                None => std::future::pending().await,
            }
            JobError::Refused("stopped at once".to_string())
        };
        let protocol = run_to_end_or_stop(job(kind, stop.clone()), &stop, at_once, GRACE);
        tokio::select! {
            outcome = protocol => ending(&outcome),
            () = asker => unreachable!("the asker never ends"),
        }
    }

    #[tokio::test]
    async fn a_stop_ends_the_job_as_the_table_says() {
        let table = [
            (Job::EndsAfter(10), None, None, "done"),
            (Job::EndsAfter(10), None, Some(100), "done"),
            (Job::Hangs, None, Some(10), "failed: stopped at once"),
            (
                Job::StopsAtACheckpoint,
                Some(10),
                None,
                "interrupted by SIGINT at a checkpoint",
            ),
            (
                Job::FailsWhileStopping,
                Some(10),
                None,
                "interrupted by SIGINT, late: the job failed while stopping: rank 1 lost",
            ),
            (
                Job::Hangs,
                Some(10),
                None,
                "interrupted by SIGINT, late: no step ended within 0 s",
            ),
            (Job::Hangs, Some(10), Some(50), "failed: stopped at once"),
            // A job that ends by itself within the grace ends as it would have.
            (Job::EndsAfter(60), Some(10), None, "done"),
        ];
        for (kind, stop_at, at_once_at, expected) in table {
            assert_eq!(run(kind, stop_at, at_once_at).await, expected);
        }
    }
}
