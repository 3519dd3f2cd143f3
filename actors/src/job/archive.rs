//! The cluster's archive of ended jobs: one actor ([`ARCHIVE_KIND`]) in the head's daemon
//! that keeps each ended detached job's final [`JobStatus`], so that an ended job costs
//! the head a record rather than a live coordinator (an actor with its thread, its
//! runtime and its open files).
//!
//! A detached job's coordinator, once its job has ended, waits [`LINGER`] (a follower
//! reads the end from it), hands its status to the archive ([`hand_over`]) and stops.
//! The archive answers the coordinator's methods for the jobs it holds (status, log,
//! metrics, ...; see [`Archived`]), so that every caller reaches a job through one
//! [`JobHandle`], whichever holds it. `imgrun start --head` starts the archive
//! ([`start_archive`]); a cluster without one keeps ended coordinators, as before.

use std::collections::BTreeMap;
use std::time::Duration;

use runtime::{
    Actor, ActorCallError, ActorId, ActorRef, ActorRegistry, ClusterClient, ClusterStatus,
    MethodError, SpawnOptions, Strategy,
};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use super::joblog::{self, LogFrom, LogRequest};
use super::methods::{
    Answers, CoordinatorCallError, CoordinatorMethod, FollowReply, FollowRequest, JobStatus,
    answer, decode_request, encode, typed_methods,
};
use super::ranks::{RankOutputReply, RankOutputRequest, RankView};
use super::{JobEvent, Level};

/// The archive's actor kind.
pub const ARCHIVE_KIND: &str = "job-archive";

/// The most ended jobs the archive keeps; past it, the oldest kept is forgotten.
pub const MAX_ARCHIVED: usize = 50_000;

/// How long an ended detached job's coordinator stays before it hands the job over.
pub const LINGER: Duration = Duration::from_secs(10);

/// How long one call to the archive may take.
const ARCHIVE_CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The most bytes of statuses one [`ListRequest`] answers (a frame holds 16 MiB; small
/// replies keep both ends' peak memory low).
const MAX_LIST_BYTES: usize = 1 << 20;

/// The lines of its `job.log` an archived job's first follow answers.
const FOLLOW_LINES: u64 = 200;

/// Registers the archive's kind.
pub fn register(registry: &mut ActorRegistry) {
    registry.register(ARCHIVE_KIND, |_ctx, _args| {
        Ok(Box::new(Archive::default()) as Box<dyn Actor>)
    });
}

/// Keeps an ended job (replacing one of the same name); true when it is new.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KeepRequest {
    pub status: JobStatus,
}

/// The kept jobs, by name, after `after` (none: from the first), unless the archive is
/// still at generation `known`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ListRequest {
    pub known: Option<u64>,
    pub after: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ListReply {
    /// Changes whenever a job is kept or forgotten.
    pub generation: u64,
    /// None when the archive is still at the generation asked; otherwise the next jobs
    /// by name, as many as fit in one reply.
    pub jobs: Option<Vec<JobStatus>>,
    /// More jobs follow the last of `jobs`.
    pub more: bool,
}

/// Whether the archive holds the job `name`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HasRequest {
    pub name: String,
}

/// Forgets the job `name`; true when it held it (`imgrun cancel` of an ended job).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ForgetRequest {
    pub name: String,
}

/// A coordinator method (`method`, with its encoded `request`) for the kept job `name`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AskRequest {
    pub name: String,
    pub method: String,
    pub request: serde_json::Value,
}

/// An archive method: the request is `Self`, the reply `Self::Reply`.
pub trait ArchiveMethod: Serialize + DeserializeOwned {
    const NAME: &'static str;
    type Reply: Serialize + DeserializeOwned;
}

typed_methods! {
    ArchiveMethod:
    KeepRequest => "keep", bool;
    ListRequest => "list", ListReply;
    HasRequest => "has", bool;
    ForgetRequest => "forget", bool;
    AskRequest => "ask", serde_json::Value;
}

/// The kept jobs: the archive's state and every decision on it.
#[derive(Debug, Default)]
pub struct Archive {
    jobs: BTreeMap<String, Kept>,
    generation: u64,
    /// Counts kept jobs, to know the oldest.
    kept: u64,
}

#[derive(Debug)]
struct Kept {
    status: JobStatus,
    order: u64,
}

impl Archive {
    pub fn keep(&mut self, request: KeepRequest) -> bool {
        self.generation += 1;
        self.kept += 1;
        let kept = Kept {
            status: request.status,
            order: self.kept,
        };
        let new = self.jobs.insert(kept.status.name.clone(), kept).is_none();
        if self.jobs.len() > MAX_ARCHIVED
            && let Some(oldest) = self
                .jobs
                .iter()
                .min_by_key(|(_, kept)| kept.order)
                .map(|(name, _)| name.clone())
        {
            self.jobs.remove(&oldest);
        }
        new
    }

    pub fn list(&self, request: &ListRequest) -> ListReply {
        let (generation, jobs, more) = self.listed(request);
        ListReply {
            generation,
            jobs: jobs.map(|jobs| jobs.into_iter().cloned().collect()),
            more,
        }
    }

    /// What [`Archive::list`] answers, the jobs by reference: the generation, the jobs
    /// (none when unchanged), and whether more follow.
    fn listed(&self, request: &ListRequest) -> (u64, Option<Vec<&JobStatus>>, bool) {
        if request.known == Some(self.generation) {
            return (self.generation, None, false);
        }
        let from = match &request.after {
            Some(after) => std::ops::Bound::Excluded(after.clone()),
            None => std::ops::Bound::Unbounded,
        };
        let (mut jobs, mut bytes, mut more) = (Vec::new(), 0, false);
        for (_, kept) in self.jobs.range((from, std::ops::Bound::Unbounded)) {
            let size = encoded_len(&kept.status);
            if !jobs.is_empty() && bytes + size > MAX_LIST_BYTES {
                more = true;
                break;
            }
            bytes += size;
            jobs.push(&kept.status);
        }
        (self.generation, Some(jobs), more)
    }

    /// [`Archive::list`]'s reply, encoded without copying a status.
    fn list_encoded(&self, request: &ListRequest) -> Result<Vec<u8>, serde_json::Error> {
        #[derive(Serialize)]
        struct Listed<'a> {
            generation: u64,
            jobs: Option<Vec<&'a JobStatus>>,
            more: bool,
        }
        let (generation, jobs, more) = self.listed(request);
        serde_json::to_vec(&Listed {
            generation,
            jobs,
            more,
        })
    }

    pub fn has(&self, name: &str) -> bool {
        self.jobs.contains_key(name)
    }

    pub fn forget(&mut self, name: &str) -> bool {
        let held = self.jobs.remove(name).is_some();
        if held {
            self.generation += 1;
        }
        held
    }

    /// Answers a coordinator method for a kept job.
    pub fn ask(&self, request: &AskRequest) -> Result<serde_json::Value, MethodError> {
        let kept = self.jobs.get(&request.name).ok_or_else(|| {
            MethodError::new(format!("the archive holds no job named `{}`", request.name))
        })?;
        let payload = serde_json::to_vec(&request.request)
            .map_err(|error| MethodError::new(error.to_string()))?;
        let reply = answer(&Archived(&kept.status), &request.method, &payload)?;
        serde_json::from_slice(&reply).map_err(|error| MethodError::new(error.to_string()))
    }
}

impl Actor for Archive {
    fn call(&mut self, method: &str, payload: &[u8]) -> Result<Vec<u8>, MethodError> {
        fn decode<M: ArchiveMethod>(payload: &[u8]) -> Result<M, MethodError> {
            decode_request(M::NAME, payload)
        }
        match method {
            KeepRequest::NAME => encode(&self.keep(decode::<KeepRequest>(payload)?)),
            ListRequest::NAME => self
                .list_encoded(&decode::<ListRequest>(payload)?)
                .map_err(|error| MethodError::new(error.to_string())),
            HasRequest::NAME => encode(&self.has(&decode::<HasRequest>(payload)?.name)),
            ForgetRequest::NAME => encode(&self.forget(&decode::<ForgetRequest>(payload)?.name)),
            AskRequest::NAME => encode(&self.ask(&decode::<AskRequest>(payload)?)?),
            other => Err(MethodError::new(format!(
                "the job archive has no method '{other}' (it has {})",
                METHODS.join(", ")
            ))),
        }
    }
}

/// The length of `status` in JSON, counted rather than kept.
fn encoded_len(status: &JobStatus) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0 += bytes.len();
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    serde_json::to_writer(&mut count, status).map_or(0, |()| count.0)
}

/// An ended job as the archive answers for it: its final status; its metrics and log
/// from its run folder; no ranks.
struct Archived<'a>(&'a JobStatus);

impl Answers for Archived<'_> {
    fn status(&self) -> JobStatus {
        self.0.clone()
    }

    /// Its end: the last lines of its `job.log` for a first follow (its events went
    /// with its coordinator), then nothing new.
    fn follow(&self, request: &FollowRequest) -> FollowReply {
        let events = if request.after == 0 {
            self.log_tail()
        } else {
            Vec::new()
        };
        FollowReply {
            events,
            next: request.after.max(1),
            status: self.0.clone(),
        }
    }

    fn ranks(&self) -> Result<Vec<RankView>, MethodError> {
        Ok(Vec::new())
    }

    fn rank_output(&self, request: &RankOutputRequest) -> Result<RankOutputReply, MethodError> {
        Err(MethodError::new(format!(
            "job {} has ended, and rank {}'s process with it: its own lines are gone \
             (the job's log keeps what the job said)",
            self.0.name, request.rank
        )))
    }

    fn cancel(&self, _by: &str) -> JobStatus {
        self.0.clone()
    }
}

impl Archived<'_> {
    /// The last [`FOLLOW_LINES`] lines of the job's log, as lines it said; none when it
    /// has no log.
    fn log_tail(&self) -> Vec<JobEvent> {
        let Some(run_dir) = &self.0.run_dir else {
            return Vec::new();
        };
        let request = LogRequest {
            from: LogFrom::Tail {
                lines: FOLLOW_LINES,
            },
            max_bytes: joblog::MAX_LOG_PIECE,
        };
        let Ok(reply) = joblog::read_in(run_dir, &request) else {
            return Vec::new();
        };
        String::from_utf8_lossy(&reply.bytes)
            .lines()
            .map(|line| JobEvent::Line {
                level: Level::Info,
                text: line.to_owned(),
            })
            .collect()
    }
}

/// Where a job is answered: its coordinator, or the archive once the job has ended and
/// its coordinator handed it over.
#[derive(Clone)]
pub enum JobHandle {
    Coordinator(ActorRef),
    Archived { archive: ActorRef, name: String },
}

impl std::fmt::Debug for JobHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JobHandle::Coordinator(actor) => write!(f, "coordinator {}", actor.id()),
            JobHandle::Archived { name, .. } => write!(f, "archived job {name}"),
        }
    }
}

impl From<ActorRef> for JobHandle {
    fn from(actor: ActorRef) -> Self {
        JobHandle::Coordinator(actor)
    }
}

impl JobHandle {
    /// Calls method `M` of the job, waiting at most `timeout`.
    pub async fn call<M: CoordinatorMethod>(
        &self,
        request: &M,
        timeout: Duration,
    ) -> Result<M::Reply, CoordinatorCallError> {
        let method = M::NAME;
        let encode = |source| CoordinatorCallError::Encode { method, source };
        let (actor, call_method, payload) = match self {
            JobHandle::Coordinator(actor) => {
                (actor, method, serde_json::to_vec(request).map_err(encode)?)
            }
            JobHandle::Archived { archive, name } => {
                let ask = AskRequest {
                    name: name.clone(),
                    method: method.to_owned(),
                    request: serde_json::to_value(request).map_err(encode)?,
                };
                let payload = serde_json::to_vec(&ask).map_err(encode)?;
                (archive, AskRequest::NAME, payload)
            }
        };
        let bytes = actor
            .call(call_method, payload, timeout)
            .await
            .map_err(|source| CoordinatorCallError::Call { method, source })?;
        serde_json::from_slice(&bytes)
            .map_err(|source| CoordinatorCallError::Decode { method, source })
    }

    /// Removes an ended job from the cluster (its coordinator stops, or the archive
    /// forgets it).
    pub async fn remove(&self) -> Result<(), CoordinatorCallError> {
        match self {
            JobHandle::Coordinator(actor) => {
                actor
                    .stop()
                    .await
                    .map_err(|source| CoordinatorCallError::Call {
                        method: "stop",
                        source,
                    })
            }
            JobHandle::Archived { archive, name } => {
                call_archive(archive, &ForgetRequest { name: name.clone() })
                    .await
                    .map(|_| ())
            }
        }
    }
}

/// Calls method `M` of an archive.
pub(super) async fn call_archive<M: ArchiveMethod>(
    archive: &ActorRef,
    request: &M,
) -> Result<M::Reply, CoordinatorCallError> {
    let method = M::NAME;
    let payload = serde_json::to_vec(request)
        .map_err(|source| CoordinatorCallError::Encode { method, source })?;
    let bytes = archive
        .call(method, payload, ARCHIVE_CALL_TIMEOUT)
        .await
        .map_err(|source| CoordinatorCallError::Call { method, source })?;
    serde_json::from_slice(&bytes).map_err(|source| CoordinatorCallError::Decode { method, source })
}

/// The archives in `status` (one, unless two were started), oldest first, with their
/// handles; one that ended between the status and here is left out.
pub(super) async fn archives(
    client: &ClusterClient,
    status: &ClusterStatus,
) -> Vec<(ActorId, ActorRef)> {
    let ids = archive_ids(status);
    let mut found = Vec::with_capacity(ids.len());
    for id in ids {
        if let Ok(handle) = client.actor(id).await {
            found.push((id, handle));
        }
    }
    found
}

/// The archives `status` lists, oldest first.
pub fn archive_ids(status: &ClusterStatus) -> Vec<ActorId> {
    let mut ids: Vec<ActorId> = status
        .actors
        .iter()
        .filter(|actor| actor.kind == ARCHIVE_KIND)
        .map(|actor| actor.id)
        .collect();
    ids.sort();
    ids
}

/// Starts the cluster's archive on the node `head` (the head's), owned by no connection,
/// unless the cluster has one.
pub async fn start_archive(
    client: &ClusterClient,
    head: runtime::NodeId,
) -> Result<(), ActorCallError> {
    if let Ok(status) = client.status().await
        && !archive_ids(&status).is_empty()
    {
        return Ok(());
    }
    let options = SpawnOptions::new(ARCHIVE_KIND)
        .strategy(Strategy::Node(head))
        .detached();
    client.spawn(options).await.map(|_| ())
}

/// Hands the ended job `status` of the coordinator `own` to the archive after
/// [`LINGER`], then stops the coordinator; nothing when the coordinator is stopped or
/// killed first (the job was removed), or the cluster has no archive.
pub(super) async fn hand_over(
    client: &ClusterClient,
    own: ActorId,
    status: JobStatus,
    mut aborted: tokio::sync::watch::Receiver<bool>,
) {
    tokio::select! {
        () = tokio::time::sleep(LINGER) => {}
        _ = aborted.wait_for(|aborted| *aborted) => return,
    }
    let name = status.name.clone();
    let cluster = match client.status().await {
        Ok(cluster) => cluster,
        Err(error) => {
            warn!(job = %name, %error, "the ended job stays with its coordinator");
            return;
        }
    };
    let Some((_, archive)) = archives(client, &cluster).await.into_iter().next() else {
        return;
    };
    if let Err(error) = call_archive(&archive, &KeepRequest { status }).await {
        warn!(job = %name, %error, "the ended job stays with its coordinator");
        return;
    }
    info!(job = %name, "the ended job is kept by the archive; its coordinator ends");
    match client.actor(own).await {
        Ok(coordinator) => {
            if let Err(error) = coordinator.stop().await {
                warn!(job = %name, %error, "stopping the ended job's coordinator");
            }
        }
        Err(error) => warn!(job = %name, %error, "finding the ended job's coordinator"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::{JobState, LogReply, MetricsReply, MetricsRequest, StatusRequest};

    fn ended(name: &str) -> JobStatus {
        JobStatus::new(name, JobState::Succeeded, None)
    }

    fn keep(archive: &mut Archive, name: &str) -> bool {
        archive.keep(KeepRequest {
            status: ended(name),
        })
    }

    fn names(reply: &ListReply) -> Vec<&str> {
        let jobs = reply.jobs.as_deref().unwrap_or_default();
        jobs.iter().map(|job| job.name.as_str()).collect()
    }

    #[test]
    fn kept_jobs_are_listed_by_name_and_unchanged_lists_are_not_sent() {
        let mut archive = Archive::default();
        assert!(keep(&mut archive, "b"));
        assert!(keep(&mut archive, "a"));
        assert!(!keep(&mut archive, "b"), "the same name replaces");
        let all = archive.list(&ListRequest::default());
        assert_eq!(names(&all), ["a", "b"]);
        assert!(!all.more);
        let same = archive.list(&ListRequest {
            known: Some(all.generation),
            after: None,
        });
        assert!(same.jobs.is_none());
        let after = archive.list(&ListRequest {
            known: None,
            after: Some("a".to_owned()),
        });
        assert_eq!(names(&after), ["b"]);
        assert!(archive.has("a") && !archive.has("c"));
        assert!(archive.forget("a"));
        assert!(!archive.forget("a"));
        let changed = archive.list(&ListRequest {
            known: Some(all.generation),
            after: None,
        });
        assert_eq!(names(&changed), ["b"]);
        assert_ne!(changed.generation, all.generation);
    }

    #[test]
    fn a_list_holds_at_most_a_frames_share_and_says_more_follow() {
        let mut archive = Archive::default();
        let mut big = ended("big-0");
        big.outcome = Some("x".repeat(MAX_LIST_BYTES / 3));
        for i in 0..4 {
            big.name = format!("big-{i}");
            archive.keep(KeepRequest {
                status: big.clone(),
            });
        }
        let first = archive.list(&ListRequest::default());
        assert_eq!(names(&first), ["big-0", "big-1"]);
        assert!(first.more);
        let rest = archive.list(&ListRequest {
            known: None,
            after: Some("big-1".to_owned()),
        });
        assert_eq!(names(&rest), ["big-2", "big-3"]);
        assert!(!rest.more);
    }

    #[test]
    fn the_encoded_list_is_the_list() {
        let mut archive = Archive::default();
        keep(&mut archive, "a");
        keep(&mut archive, "b");
        let request = ListRequest::default();
        let encoded = archive.list_encoded(&request).expect("encodes");
        let decoded: ListReply = serde_json::from_slice(&encoded).expect("a list");
        assert_eq!(
            serde_json::to_value(&decoded).expect("json"),
            serde_json::to_value(archive.list(&request)).expect("json")
        );
        assert_eq!(
            encoded_len(&ended("a")),
            serde_json::to_vec(&ended("a")).expect("encodes").len()
        );
    }

    #[test]
    fn past_its_bound_the_archive_forgets_the_oldest_kept() {
        let mut archive = Archive::default();
        for i in 0..=MAX_ARCHIVED {
            keep(&mut archive, &format!("job-{}", MAX_ARCHIVED - i));
        }
        assert_eq!(archive.jobs.len(), MAX_ARCHIVED);
        assert!(
            !archive.has(&format!("job-{MAX_ARCHIVED}")),
            "the first kept"
        );
        assert!(archive.has("job-0"));
    }

    #[test]
    fn an_archived_job_answers_as_its_coordinator_did() {
        let run_dir = tempfile::tempdir().expect("a folder");
        std::fs::write(run_dir.path().join("metrics.jsonl"), "{\"step\":1}\n").expect("writes");
        std::fs::write(
            run_dir.path().join(joblog::LOG_FILE),
            "2026-11-29T05:00:00Z trainers: 2 up\n2026-11-29T05:01:00Z done\n",
        )
        .expect("writes");
        let mut status = ended("run");
        status.run_dir = Some(run_dir.path().to_path_buf());
        let mut archive = Archive::default();
        archive.keep(KeepRequest { status });
        let ask = |method: &str, request: serde_json::Value| {
            archive.ask(&AskRequest {
                name: "run".to_owned(),
                method: method.to_owned(),
                request,
            })
        };
        let status: JobStatus =
            serde_json::from_value(ask("status", serde_json::json!({})).expect("status"))
                .expect("a status");
        assert_eq!(status.state, JobState::Succeeded);
        let follow: FollowReply = serde_json::from_value(
            ask("follow", serde_json::json!({"after": 0, "wait_ms": 0})).expect("follow"),
        )
        .expect("a reply");
        let said: Vec<String> = follow
            .events
            .iter()
            .filter_map(|event| match event {
                JobEvent::Line { text, .. } => Some(text.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(said.len(), 2, "{said:?}");
        assert!(said[1].ends_with("done"));
        let again: FollowReply = serde_json::from_value(
            ask(
                "follow",
                serde_json::json!({"after": follow.next, "wait_ms": 0}),
            )
            .expect("follow"),
        )
        .expect("a reply");
        assert!(again.events.is_empty());
        let metrics: MetricsReply = serde_json::from_value(
            ask(
                MetricsRequest::NAME,
                serde_json::json!({"offset": 0, "max_bytes": 100}),
            )
            .expect("metrics"),
        )
        .expect("a reply");
        assert_eq!(metrics.bytes, b"{\"step\":1}\n");
        let log: LogReply = serde_json::from_value(
            ask(
                "log",
                serde_json::json!({"from": {"tail": {"lines": 1}}, "max_bytes": 1000}),
            )
            .expect("log"),
        )
        .expect("a reply");
        assert!(String::from_utf8_lossy(&log.bytes).ends_with("done\n"));
        let ranks: Vec<RankView> =
            serde_json::from_value(ask("ranks", serde_json::json!({})).expect("ranks"))
                .expect("a reply");
        assert!(ranks.is_empty());
        assert!(ask("rank_output", serde_json::json!({"rank": 0, "lines": 10})).is_err());
        let missing = archive.ask(&AskRequest {
            name: "other".to_owned(),
            method: StatusRequest::NAME.to_owned(),
            request: serde_json::json!({}),
        });
        assert!(missing.is_err());
    }
}
