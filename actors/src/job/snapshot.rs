//! One typed snapshot of the cluster and its jobs: the state every view of a running
//! cluster reads (`imgrun status --json`, `imgrun jobs --json`, the head's dashboard and
//! its `/metrics`), so that they never disagree.
//!
//! [`snapshot`] asks the head for its [`ClusterStatus`] once, then every job's coordinator
//! (an actor of [`COORDINATOR_KIND`]) for its [`JobStatus`] and, while it runs, its ranks,
//! all coordinators at once. A coordinator that does not answer is a job with a
//! `problem`, not a failed snapshot: one stuck job never hides the others.

use std::collections::{HashMap, HashSet};
use std::sync::PoisonError;
use std::time::{Duration, SystemTime};

use runtime::{ActorCallError, ActorId, ActorRef, ClusterClient, ClusterStatus, DaemonError};
use serde::Serialize;

use super::coordinator::{
    COORDINATOR_KIND, CoordinatorMethod, JobStatus, RanksRequest, StatusRequest,
};
use super::ranks::RankView;

/// How long one call to a coordinator may take.
pub const COORDINATOR_CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a snapshot waits for one coordinator's answers before it reports the job as
/// not answering.
const SNAPSHOT_CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// The cluster and its jobs at one moment.
#[derive(Debug, Clone, Serialize)]
pub struct ClusterSnapshot {
    /// When it was taken, in milliseconds since the Unix epoch.
    pub taken_at_unix_ms: u64,
    /// The head's status: nodes, reservations, totals and actors (JSON fields beside
    /// `jobs`, as `imgrun status --json` has always printed them).
    #[serde(flatten)]
    pub cluster: ClusterStatus,
    /// Every job the cluster holds, running or finished, by name.
    pub jobs: Vec<JobSnapshot>,
}

/// One job: its coordinator's status and, while it runs, its ranks.
#[derive(Debug, Clone, Serialize)]
pub struct JobSnapshot {
    /// The job's name (its run folder's).
    pub name: String,
    /// None when its coordinator did not answer (see `problem`).
    pub job: Option<JobStatus>,
    /// Empty once the job has ended.
    pub ranks: Vec<RankView>,
    /// Why `job` or `ranks` are missing.
    pub problem: Option<String>,
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

/// Calls method `M` of a job's coordinator, waiting at most `timeout`.
pub async fn call_coordinator<M: CoordinatorMethod>(
    actor: &ActorRef,
    request: &M,
    timeout: Duration,
) -> Result<M::Reply, CoordinatorCallError> {
    let method = M::NAME;
    let payload = serde_json::to_vec(request)
        .map_err(|source| CoordinatorCallError::Encode { method, source })?;
    let bytes = actor
        .call(method, payload, timeout)
        .await
        .map_err(|source| CoordinatorCallError::Call { method, source })?;
    serde_json::from_slice(&bytes).map_err(|source| CoordinatorCallError::Decode { method, source })
}

/// The coordinators of the jobs in `status`, by job name, reachable now.
pub async fn coordinators(
    client: &ClusterClient,
    status: &ClusterStatus,
) -> Vec<(String, ActorRef)> {
    let mut found = Vec::new();
    for actor in &status.actors {
        if actor.kind != COORDINATOR_KIND {
            continue;
        }
        let name = actor
            .label
            .as_ref()
            .map_or_else(|| format!("actor {}", actor.id), |label| label.job.clone());
        // An actor that ended between the status and here is no longer a job.
        if let Ok(handle) = client.actor(actor.id).await {
            found.push((name, handle));
        }
    }
    found.sort_by(|a, b| a.0.cmp(&b.0));
    found
}

/// The coordinator of the job `name`, found by name in the head's table; `None` when the
/// cluster holds no such job.
pub async fn coordinator(
    client: &ClusterClient,
    name: &str,
) -> Result<Option<ActorRef>, DaemonError> {
    let status = client.status().await?;
    let found = status.actors.iter().find(|actor| {
        actor.kind == COORDINATOR_KIND && actor.label.as_ref().is_some_and(|l| l.job == name)
    });
    match found {
        // An actor that ended between the status and here is no longer a job.
        Some(actor) => Ok(client.actor(actor.id).await.ok()),
        None => Ok(None),
    }
}

/// Finished jobs as earlier snapshots found them: a finished job's status never changes,
/// so [`snapshot_keeping`] asks its coordinator once, and a head that holds thousands of
/// finished jobs costs a snapshot only its running ones.
#[derive(Debug, Default)]
pub struct FinishedJobs {
    by_actor: std::sync::Mutex<HashMap<ActorId, JobSnapshot>>,
}

impl FinishedJobs {
    /// Those of `present`'s jobs it holds; it forgets every other (a job the head no
    /// longer holds).
    fn kept(&self, present: &HashSet<ActorId>) -> HashMap<ActorId, JobSnapshot> {
        let mut held = self.by_actor.lock().unwrap_or_else(PoisonError::into_inner);
        held.retain(|id, _| present.contains(id));
        held.clone()
    }

    /// Keeps `job` when it has ended and its coordinator answered in full.
    fn keep(&self, id: ActorId, job: &JobSnapshot) {
        let ended = job.job.as_ref().is_some_and(|s| s.state.is_final());
        if ended && job.problem.is_none() {
            let mut held = self.by_actor.lock().unwrap_or_else(PoisonError::into_inner);
            held.insert(id, job.clone());
        }
    }
}

/// The cluster and every job in it, now.
pub async fn snapshot(client: &ClusterClient) -> Result<ClusterSnapshot, DaemonError> {
    snapshot_keeping(client, &FinishedJobs::default()).await
}

/// The cluster and every job in it, now, asking only the coordinators of jobs that
/// `finished` does not hold (and keeping there those that have ended since).
pub async fn snapshot_keeping(
    client: &ClusterClient,
    finished: &FinishedJobs,
) -> Result<ClusterSnapshot, DaemonError> {
    let cluster = client.status().await?;
    let taken_at_unix_ms = super::unix_ms(SystemTime::now());
    let mut listed: Vec<(String, ActorId)> = cluster
        .actors
        .iter()
        .filter(|actor| actor.kind == COORDINATOR_KIND)
        .map(|actor| {
            let name = actor
                .label
                .as_ref()
                .map_or_else(|| format!("actor {}", actor.id), |label| label.job.clone());
            (name, actor.id)
        })
        .collect();
    listed.sort();
    let present: HashSet<ActorId> = listed.iter().map(|(_, id)| *id).collect();
    let mut kept = finished.kept(&present);
    let mut jobs: Vec<Option<JobSnapshot>> = Vec::with_capacity(listed.len());
    let mut tasks = tokio::task::JoinSet::new();
    for (index, (name, id)) in listed.into_iter().enumerate() {
        if let Some(job) = kept.remove(&id) {
            jobs.push(Some(job));
            continue;
        }
        jobs.push(None);
        let client = client.clone();
        tasks.spawn(async move {
            // An actor that ended between the status and here is no longer a job.
            let actor = client.actor(id).await.ok()?;
            Some((index, id, job_snapshot(name, &actor).await))
        });
    }
    for (index, id, job) in tasks.join_all().await.into_iter().flatten() {
        finished.keep(id, &job);
        jobs[index] = Some(job);
    }
    Ok(ClusterSnapshot {
        taken_at_unix_ms,
        cluster,
        jobs: jobs.into_iter().flatten().collect(),
    })
}

/// One job's status and, while it runs, its ranks.
async fn job_snapshot(name: String, actor: &ActorRef) -> JobSnapshot {
    let status = match call_coordinator(actor, &StatusRequest {}, SNAPSHOT_CALL_TIMEOUT).await {
        Ok(status) => status,
        Err(error) => {
            return JobSnapshot {
                name,
                job: None,
                ranks: Vec::new(),
                problem: Some(error.to_string()),
            };
        }
    };
    let (ranks, problem) = if status.state.is_final() {
        (Vec::new(), None)
    } else {
        match call_coordinator(actor, &RanksRequest {}, SNAPSHOT_CALL_TIMEOUT).await {
            Ok(ranks) => (ranks, None),
            Err(error) => (Vec::new(), Some(error.to_string())),
        }
    };
    JobSnapshot {
        name,
        job: Some(status),
        ranks,
        problem,
    }
}
