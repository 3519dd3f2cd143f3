//! One typed snapshot of the cluster and its jobs: the state every view of a running
//! cluster reads (`imgrun status --json`, `imgrun jobs --json`, the head's dashboard and
//! its `/metrics`), so that they never disagree.
//!
//! [`snapshot`] asks the head for its [`ClusterStatus`] once, then every job's coordinator
//! (an actor of [`COORDINATOR_KIND`]) for its [`JobStatus`] and, while it runs, its ranks,
//! all coordinators at once, and the cluster's archive for the jobs that ended (see
//! [`super::archive`]). A coordinator that does not answer is a job with a `problem`, not
//! a failed snapshot: one stuck job never hides the others.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, SystemTime};

use runtime::{ActorId, ActorRef, ClusterClient, ClusterStatus, DaemonError};
use serde::Serialize;

use super::archive::{HasRequest, JobHandle, ListRequest, archive_ids, archives, call_archive};
use super::methods::{
    COORDINATOR_KIND, CoordinatorCallError, CoordinatorMethod, JobStatus, RanksRequest,
    StatusRequest,
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
    pub jobs: Jobs,
}

/// A snapshot's jobs: those whose coordinators run (running, or ended and not yet handed
/// to the archive), and the archive's, one shared block that a snapshot of thousands of
/// ended jobs neither copies nor looks into. Read, listed and encoded as one list by name.
#[derive(Debug, Clone, Default)]
pub struct Jobs {
    /// By name.
    coordinated: Vec<Arc<JobSnapshot>>,
    /// By name, none named as a coordinated one.
    archived: Arc<Vec<Arc<JobSnapshot>>>,
    /// Which ended jobs these are, as one number: it changes when one ends, is handed to
    /// the archive or is removed, and only then (an ended job's status never changes).
    ended: u64,
}

impl Jobs {
    /// `coordinated` and `archived` jobs (each sorted here by name; an archived one named
    /// as a coordinated one is left out), and the number of the ended ones.
    pub fn new(
        mut coordinated: Vec<Arc<JobSnapshot>>,
        archived: Arc<Vec<Arc<JobSnapshot>>>,
        ended: u64,
    ) -> Self {
        coordinated.sort_by(|a, b| a.name.cmp(&b.name));
        let sorted = archived.is_sorted_by(|a, b| a.name <= b.name);
        let clash = coordinated
            .iter()
            .any(|job| find_by_name(&archived, &job.name).is_some());
        let archived = if sorted && !clash {
            archived
        } else {
            let mut kept: Vec<Arc<JobSnapshot>> = archived
                .iter()
                .filter(|job| find_by_name(&coordinated, &job.name).is_none())
                .cloned()
                .collect();
            kept.sort_by(|a, b| a.name.cmp(&b.name));
            Arc::new(kept)
        };
        Jobs {
            coordinated,
            archived,
            ended,
        }
    }

    /// Every job, by name.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<JobSnapshot>> + '_ {
        let mut coordinated = self.coordinated.iter().peekable();
        let mut archived = self.archived.iter().peekable();
        std::iter::from_fn(move || match (coordinated.peek(), archived.peek()) {
            (Some(c), Some(a)) if a.name < c.name => archived.next(),
            (Some(_), _) => coordinated.next(),
            (None, _) => archived.next(),
        })
    }

    /// The jobs whose coordinators run, by name: every running one.
    pub fn coordinated(&self) -> &[Arc<JobSnapshot>] {
        &self.coordinated
    }

    /// The archive's jobs, by name: all ended.
    pub fn archived(&self) -> &[Arc<JobSnapshot>] {
        &self.archived
    }

    /// Which ended jobs these are, as one number (see the field).
    pub fn ended(&self) -> u64 {
        self.ended
    }

    /// The job `name`.
    pub fn find(&self, name: &str) -> Option<&Arc<JobSnapshot>> {
        self.coordinated
            .iter()
            .find(|job| job.name == name)
            .or_else(|| find_by_name(&self.archived, name))
    }

    pub fn len(&self) -> usize {
        self.coordinated.len() + self.archived.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl From<Vec<Arc<JobSnapshot>>> for Jobs {
    /// Jobs all of which have coordinators.
    fn from(coordinated: Vec<Arc<JobSnapshot>>) -> Self {
        Jobs::new(coordinated, Arc::default(), 0)
    }
}

impl Serialize for Jobs {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.iter())
    }
}

/// The job `name` of `jobs`, which are sorted by name.
fn find_by_name<'a>(jobs: &'a [Arc<JobSnapshot>], name: &str) -> Option<&'a Arc<JobSnapshot>> {
    jobs.binary_search_by(|job| job.name.as_str().cmp(name))
        .ok()
        .map(|at| &jobs[at])
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

/// Why a job could not be looked up.
#[derive(Debug, thiserror::Error)]
pub enum JobLookupError {
    #[error("asking the head: {0}")]
    Head(#[from] DaemonError),
    #[error("asking the job archive: {0}")]
    Archive(#[from] CoordinatorCallError),
}

/// Calls method `M` of a job (its coordinator, or the archive for an ended one), waiting
/// at most `timeout`.
pub async fn call_coordinator<M: CoordinatorMethod>(
    job: &JobHandle,
    request: &M,
    timeout: Duration,
) -> Result<M::Reply, CoordinatorCallError> {
    job.call(request, timeout).await
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

/// The job `name`: its coordinator, found by name in the head's table, or the archive
/// that holds it once it has ended; `None` when the cluster holds no such job.
pub async fn coordinator(
    client: &ClusterClient,
    name: &str,
) -> Result<Option<JobHandle>, JobLookupError> {
    let status = client.status().await?;
    let found = status.actors.iter().find(|actor| {
        actor.kind == COORDINATOR_KIND && actor.label.as_ref().is_some_and(|l| l.job == name)
    });
    // An actor that ended between the status and here is no longer a job.
    if let Some(actor) = found
        && let Ok(handle) = client.actor(actor.id).await
    {
        return Ok(Some(JobHandle::Coordinator(handle)));
    }
    for (_, archive) in archives(client, &status).await {
        let request = HasRequest {
            name: name.to_owned(),
        };
        if call_archive(&archive, &request).await? {
            return Ok(Some(JobHandle::Archived {
                archive,
                name: name.to_owned(),
            }));
        }
    }
    Ok(None)
}

/// The names of every job the cluster holds, running or ended, by name.
pub async fn job_names(client: &ClusterClient) -> Result<Vec<String>, JobLookupError> {
    let status = client.status().await?;
    let mut names: Vec<String> = coordinators(client, &status)
        .await
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    for (_, archive) in archives(client, &status).await {
        let (_, jobs) = archived(&archive, None).await?;
        names.extend(jobs.unwrap_or_default().into_iter().map(|job| job.name));
    }
    names.sort();
    names.dedup();
    Ok(names)
}

/// Every job `archive` holds, by name, a reply at a time, and its generation; no jobs
/// when it is still at generation `known`.
async fn archived(
    archive: &runtime::ActorRef,
    known: Option<u64>,
) -> Result<(u64, Option<Vec<JobStatus>>), CoordinatorCallError> {
    let first = call_archive(archive, &ListRequest { known, after: None }).await?;
    let (generation, Some(mut jobs)) = (first.generation, first.jobs) else {
        return Ok((first.generation, None));
    };
    let mut more = first.more;
    while more {
        let request = ListRequest {
            known: None,
            after: jobs.last().map(|job| job.name.clone()),
        };
        let reply = call_archive(archive, &request).await?;
        jobs.extend(reply.jobs.unwrap_or_default());
        more = reply.more;
    }
    Ok((generation, Some(jobs)))
}

/// What snapshots keep between them: finished jobs as earlier snapshots found them (a
/// finished job's status never changes, so [`snapshot_keeping`] asks its coordinator
/// once, and the archive's list again only when it has changed), and the handles of the
/// actors they ask (each found once, not at every snapshot). A head that holds thousands
/// of finished jobs costs a snapshot only its running ones.
#[derive(Default)]
pub struct SnapshotCache {
    by_actor: std::sync::Mutex<HashMap<ActorId, Arc<JobSnapshot>>>,
    archived: std::sync::Mutex<HashMap<ActorId, ArchivedJobs>>,
    handles: std::sync::Mutex<HashMap<ActorId, ActorRef>>,
}

impl std::fmt::Debug for SnapshotCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotCache").finish_non_exhaustive()
    }
}

/// An archive's jobs at one generation of it.
#[derive(Debug, Clone)]
struct ArchivedJobs {
    generation: u64,
    jobs: Arc<Vec<Arc<JobSnapshot>>>,
}

impl SnapshotCache {
    /// Those of `present`'s jobs it holds; it forgets every other (a job the head no
    /// longer holds).
    fn kept(&self, present: &HashSet<ActorId>) -> HashMap<ActorId, Arc<JobSnapshot>> {
        let mut held = self.by_actor.lock().unwrap_or_else(PoisonError::into_inner);
        held.retain(|id, _| present.contains(id));
        held.clone()
    }

    /// Keeps `job` when it has ended and its coordinator answered in full.
    fn keep(&self, id: ActorId, job: &Arc<JobSnapshot>) {
        let ended = job.job.as_ref().is_some_and(|s| s.state.is_final());
        if ended && job.problem.is_none() {
            let mut held = self.by_actor.lock().unwrap_or_else(PoisonError::into_inner);
            held.insert(id, Arc::clone(job));
        }
    }

    /// The jobs of the archive `id` now: those kept when it has not changed since.
    async fn archived(
        &self,
        id: ActorId,
        archive: &runtime::ActorRef,
    ) -> Result<(u64, Arc<Vec<Arc<JobSnapshot>>>), CoordinatorCallError> {
        let known = self.archived_lock().get(&id).cloned();
        let (generation, Some(statuses)) =
            archived(archive, known.as_ref().map(|kept| kept.generation)).await?
        else {
            return Ok(match known {
                Some(known) => (known.generation, known.jobs),
                None => (0, Arc::default()),
            });
        };
        let jobs: Arc<Vec<Arc<JobSnapshot>>> = Arc::new(
            statuses
                .into_iter()
                .map(|status| {
                    Arc::new(JobSnapshot {
                        name: status.name.clone(),
                        job: Some(status),
                        ranks: Vec::new(),
                        problem: None,
                    })
                })
                .collect(),
        );
        let kept = ArchivedJobs {
            generation,
            jobs: Arc::clone(&jobs),
        };
        self.archived_lock().insert(id, kept);
        Ok((generation, jobs))
    }

    /// The handle of the actor `id`, found once; `None` when it is not running.
    async fn handle(&self, client: &ClusterClient, id: ActorId) -> Option<ActorRef> {
        if let Some(handle) = self.handles_lock().get(&id) {
            return Some(handle.clone());
        }
        let handle = client.actor(id).await.ok()?;
        self.handles_lock().insert(id, handle.clone());
        Some(handle)
    }

    /// Forgets the handles of actors the head no longer lists.
    fn forget_handles(&self, cluster: &ClusterStatus) {
        let listed: HashSet<ActorId> = cluster.actors.iter().map(|actor| actor.id).collect();
        self.handles_lock().retain(|id, _| listed.contains(id));
    }

    fn handles_lock(&self) -> std::sync::MutexGuard<'_, HashMap<ActorId, ActorRef>> {
        self.handles.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn archived_lock(&self) -> std::sync::MutexGuard<'_, HashMap<ActorId, ArchivedJobs>> {
        self.archived.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The cluster and every job in it, now.
pub async fn snapshot(client: &ClusterClient) -> Result<ClusterSnapshot, DaemonError> {
    snapshot_keeping(client, &SnapshotCache::default()).await
}

/// The cluster and every job in it, now, asking only the coordinators of jobs that
/// `cache` does not hold (and keeping there those that have ended since), and the
/// archive only for what it holds that `cache` has not seen.
pub async fn snapshot_keeping(
    client: &ClusterClient,
    cache: &SnapshotCache,
) -> Result<ClusterSnapshot, DaemonError> {
    let cluster = client.status().await?;
    let taken_at_unix_ms = super::unix_ms(SystemTime::now());
    cache.forget_handles(&cluster);
    let (jobs, mut ended) = running_jobs(client, &cluster, cache).await;
    let mut archived: Vec<Arc<Vec<Arc<JobSnapshot>>>> = Vec::new();
    let mut problems = Vec::new();
    let mut held = HashSet::new();
    for id in archive_ids(&cluster) {
        // An archive that ended between the status and here holds no jobs.
        let Some(archive) = cache.handle(client, id).await else {
            continue;
        };
        held.insert(id);
        match cache.archived(id, &archive).await {
            Ok((generation, kept)) => {
                ended.push((id, generation));
                archived.push(kept);
            }
            Err(error) => problems.push(Arc::new(JobSnapshot {
                name: format!("(ended jobs of archive {id})"),
                job: None,
                ranks: Vec::new(),
                problem: Some(error.to_string()),
            })),
        }
    }
    cache.archived_lock().retain(|id, _| held.contains(id));
    // One archive, as a cluster has: its block, shared; more are put together.
    let archived = match archived.len() {
        0 => Arc::default(),
        1 => archived.remove(0),
        _ => Arc::new(
            archived
                .iter()
                .flat_map(|kept| kept.iter().cloned())
                .collect(),
        ),
    };
    let coordinated = jobs.into_iter().chain(problems).collect();
    Ok(ClusterSnapshot {
        taken_at_unix_ms,
        cluster,
        jobs: Jobs::new(coordinated, archived, fingerprint(&ended)),
    })
}

/// The jobs of the coordinators in `cluster`, by name: those `cache` holds as it
/// holds them, every other asked now, all at once; and the ended ones' coordinators, each
/// with generation 0.
async fn running_jobs(
    client: &ClusterClient,
    cluster: &ClusterStatus,
    cache: &SnapshotCache,
) -> (Vec<Arc<JobSnapshot>>, Vec<(ActorId, u64)>) {
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
    let ids: Vec<ActorId> = listed.iter().map(|(_, id)| *id).collect();
    let present: HashSet<ActorId> = ids.iter().copied().collect();
    let mut kept = cache.kept(&present);
    let mut jobs: Vec<Option<Arc<JobSnapshot>>> = Vec::with_capacity(listed.len());
    let mut tasks = tokio::task::JoinSet::new();
    for (index, (name, id)) in listed.into_iter().enumerate() {
        if let Some(job) = kept.remove(&id) {
            jobs.push(Some(job));
            continue;
        }
        jobs.push(None);
        // An actor that ended between the status and here is no longer a job.
        let Some(actor) = cache.handle(client, id).await else {
            continue;
        };
        tasks.spawn(async move { Some((index, id, Arc::new(job_snapshot(name, &actor).await))) });
    }
    for (index, id, job) in tasks.join_all().await.into_iter().flatten() {
        cache.keep(id, &job);
        jobs[index] = Some(job);
    }
    let mut ended = Vec::new();
    let jobs = (jobs.into_iter().zip(ids))
        .filter_map(|(job, id)| {
            let job = job?;
            if job
                .job
                .as_ref()
                .is_some_and(|status| status.state.is_final())
            {
                ended.push((id, 0));
            }
            Some(job)
        })
        .collect();
    (jobs, ended)
}

/// One number for the ended jobs that `ended` names: each an actor (an ended job's
/// coordinator, or an archive) and its generation.
fn fingerprint(ended: &[(ActorId, u64)]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hash = std::collections::hash_map::DefaultHasher::new();
    for (id, generation) in ended {
        (id.0, generation).hash(&mut hash);
    }
    hash.finish()
}

/// One job's status and, while it runs, its ranks.
async fn job_snapshot(name: String, actor: &ActorRef) -> JobSnapshot {
    let actor = JobHandle::Coordinator(actor.clone());
    let status = match call_coordinator(&actor, &StatusRequest {}, SNAPSHOT_CALL_TIMEOUT).await {
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
        match call_coordinator(&actor, &RanksRequest {}, SNAPSHOT_CALL_TIMEOUT).await {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::JobState;

    fn job(name: &str, state: JobState) -> Arc<JobSnapshot> {
        Arc::new(JobSnapshot {
            name: name.to_owned(),
            job: Some(JobStatus::new(name, state, None)),
            ranks: Vec::new(),
            problem: None,
        })
    }

    fn names<'a>(jobs: impl Iterator<Item = &'a Arc<JobSnapshot>>) -> Vec<&'a str> {
        jobs.map(|job| job.name.as_str()).collect()
    }

    #[test]
    fn jobs_read_as_one_list_by_name_and_a_handed_over_job_once() {
        let coordinated = vec![job("m", JobState::Running), job("c", JobState::Succeeded)];
        let archived = Arc::new(vec![
            job("a", JobState::Succeeded),
            job("c", JobState::Succeeded),
            job("z", JobState::Failed),
        ]);
        let jobs = Jobs::new(coordinated, archived, 7);
        assert_eq!(names(jobs.iter()), ["a", "c", "m", "z"]);
        assert_eq!(names(jobs.coordinated().iter()), ["c", "m"]);
        assert_eq!(names(jobs.archived().iter()), ["a", "z"]);
        assert_eq!(jobs.len(), 4);
        assert_eq!(jobs.ended(), 7);
        assert_eq!(
            jobs.find("c")
                .and_then(|job| job.job.as_ref())
                .map(|s| s.state),
            Some(JobState::Succeeded)
        );
        assert!(jobs.find("z").is_some() && jobs.find("b").is_none());
        let json = serde_json::to_value(&jobs).expect("encodes");
        let listed: Vec<&str> = json
            .as_array()
            .expect("a list")
            .iter()
            .filter_map(|job| job["name"].as_str())
            .collect();
        assert_eq!(listed, ["a", "c", "m", "z"]);
        assert!(Jobs::default().is_empty());
    }

    #[test]
    fn an_archive_block_is_shared_as_it_is_when_nothing_clashes() {
        let archived = Arc::new(vec![
            job("a", JobState::Succeeded),
            job("b", JobState::Failed),
        ]);
        let jobs = Jobs::new(vec![job("m", JobState::Running)], Arc::clone(&archived), 0);
        assert!(std::ptr::eq(jobs.archived(), archived.as_slice()));
    }
}
