//! `bench dashboard`'s jobs: actors of the coordinators' kind
//! (`actors::job::COORDINATOR_KIND`, labelled with the job's name) hosted by the real head
//! in this process, answering the coordinator's real requests with its real types.
//!
//! - The running job: `ranks` ranks whose step advances every `step` from its start, by
//!   the clock. It answers `status` and `ranks` from the clock, and `metrics` and `log`
//!   from `metrics.jsonl` and `job.log` in its run folder (a temporary folder), which
//!   [`Feed::tick`] appends to at each step as a job does. Each `status` answer is kept
//!   ([`Feed::answered`]): it is the moment a snapshot of the dashboard saw that step.
//! - Finished jobs: each a final status kept by the cluster's real job archive
//!   (`actors::job::ARCHIVE_KIND`), as an ended detached job's coordinator hands it over.

use std::io::{Read as _, Seek as _, Write as _};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use actors::job::{
    ArchiveMethod, COORDINATOR_KIND, CoordinatorMethod, JobState, JobStatus, JobSummary,
    KeepRequest, LOG_FILE, LogRequest, MetricsReply, MetricsRequest, RankTotals, RankView,
    RanksRequest, StatusRequest,
};
use actors::train::phase::{Phase, RankPhase};
use anyhow::Context as _;
use runtime::{
    Actor, ActorLabel, ActorRef, ActorRegistry, ClusterClient, MethodError, SpawnOptions,
};

/// The running job's name.
pub(super) const RUNNING_JOB: &str = "bench-running";

/// Steps in one epoch of the running job.
const EPOCH_STEPS: u64 = 1000;

/// Ranks per node, for the nodes the running job's ranks say they run on.
const RANKS_PER_NODE: u32 = 8;

/// The ranks a finished job's status carries totals of.
const FINISHED_RANKS: u32 = 8;

/// The most of `metrics.jsonl` one `metrics` answer holds, as the coordinator's.
const MAX_METRICS_PIECE: u64 = 4 << 20;

/// The running job: its clock, its run folder, and when each `status` was answered.
#[derive(Debug)]
pub(super) struct Feed {
    started: Instant,
    step: Duration,
    ranks: u32,
    run_dir: PathBuf,
    answered: Mutex<Vec<(Instant, u64)>>,
}

impl Feed {
    /// A job of `ranks` ranks stepping every `step` from now, its files in `run_dir`.
    pub(super) fn new(ranks: u32, step: Duration, run_dir: PathBuf) -> Self {
        Feed {
            started: Instant::now(),
            step,
            ranks,
            run_dir,
            answered: Mutex::new(Vec::new()),
        }
    }

    /// Steps done at `at`.
    pub(super) fn steps_at(&self, at: Instant) -> u64 {
        let elapsed = at.saturating_duration_since(self.started);
        (elapsed.as_nanos() / self.step.as_nanos().max(1)) as u64
    }

    /// When step `step` ended (the job's count of steps done became `step`).
    pub(super) fn step_ended(&self, step: u64) -> Instant {
        let nanos = self.step.as_nanos().saturating_mul(u128::from(step));
        self.started + Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }

    /// When each `status` was answered, and with how many steps done.
    pub(super) fn answered(&self) -> Vec<(Instant, u64)> {
        self.answered
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Appends a step record to `metrics.jsonl` and a line to `job.log` at every step,
    /// until the task is dropped, as a running job's coordinator does.
    pub(super) async fn tick(self: Arc<Self>) {
        let mut written = self.steps_at(Instant::now());
        loop {
            tokio::time::sleep_until(self.step_ended(written + 1).into()).await;
            let done = self.steps_at(Instant::now());
            for step in written + 1..=done {
                if let Err(error) = self.append_step(step) {
                    tracing::warn!(%error, "the synthetic job's files");
                }
            }
            written = done;
        }
    }

    fn append_step(&self, step: u64) -> std::io::Result<()> {
        append(&self.run_dir.join("metrics.jsonl"), &step_record(step))?;
        append(&self.run_dir.join(LOG_FILE), &log_line(step))
    }

    fn status(&self) -> JobStatus {
        let now = Instant::now();
        let steps = self.steps_at(now);
        self.answered
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((now, steps));
        running_status(self, steps)
    }

    fn rank_views(&self) -> Vec<RankView> {
        let steps = self.steps_at(Instant::now());
        (0..self.ranks)
            .map(|rank| RankView {
                rank,
                node: u64::from(rank / RANKS_PER_NODE),
                phase: Some(RankPhase {
                    rank,
                    phase: Phase::Computing,
                    seconds: 0.05,
                    epoch: Some(steps / EPOCH_STEPS),
                    step: steps + 1,
                    bucket: None,
                    reading: Vec::new(),
                    data_wait_s: 0.4,
                }),
                problem: None,
                heartbeat_ms_ago: Some(100),
            })
            .collect()
    }

    /// A piece of `metrics.jsonl`, as the coordinator's `metrics` answers it.
    fn metrics(&self, request: &MetricsRequest) -> Result<MetricsReply, MethodError> {
        let path = self.run_dir.join("metrics.jsonl");
        let mut file = std::fs::File::open(&path)?;
        let length = file.metadata()?.len();
        file.seek(std::io::SeekFrom::Start(request.offset.min(length)))?;
        let mut bytes = Vec::new();
        file.take(request.max_bytes.clamp(1, MAX_METRICS_PIECE))
            .read_to_end(&mut bytes)?;
        Ok(MetricsReply { bytes, length })
    }
}

/// The head's registry: the coordinators' kind, built as the synthetic running job, and
/// the real job archive.
pub(super) fn registry(feed: Arc<Feed>) -> ActorRegistry {
    let mut registry = ActorRegistry::new();
    registry.register(COORDINATOR_KIND, move |_, _| {
        let job: Box<dyn Actor> = Box::new(RunningJob {
            feed: Arc::clone(&feed),
        });
        Ok(job)
    });
    actors::job::register_archive(&mut registry);
    registry
}

struct RunningJob {
    feed: Arc<Feed>,
}

impl Actor for RunningJob {
    fn call(&mut self, method: &str, payload: &[u8]) -> Result<Vec<u8>, MethodError> {
        let reply = match method {
            StatusRequest::NAME => serde_json::to_vec(&self.feed.status()),
            RanksRequest::NAME => serde_json::to_vec(&self.feed.rank_views()),
            MetricsRequest::NAME => {
                serde_json::to_vec(&self.feed.metrics(&serde_json::from_slice(payload)?)?)
            }
            LogRequest::NAME => {
                let request: LogRequest = serde_json::from_slice(payload)?;
                serde_json::to_vec(&actors::job::read_log_in(&self.feed.run_dir, &request)?)
            }
            other => return Err(unanswered(other)),
        };
        Ok(reply?)
    }
}

fn unanswered(method: &str) -> MethodError {
    MethodError::new(format!(
        "the benchmark's synthetic job does not answer '{method}'"
    ))
}

/// The running job's status after `steps` steps.
fn running_status(feed: &Feed, steps: u64) -> JobStatus {
    let now_ms = actors_unix_ms(SystemTime::now());
    let rank_totals = (0..feed.ranks)
        .map(|rank| RankTotals {
            rank,
            steps,
            data_wait_s: steps as f64 * 0.01,
            allreduce_s: steps as f64 * 0.02,
            last_step_unix_ms: now_ms,
            step_p50_s: feed.step.as_secs_f64(),
            step_p95_s: feed.step.as_secs_f64() * 1.1,
            ..RankTotals::default()
        })
        .collect();
    JobStatus {
        epoch: Some(steps / EPOCH_STEPS),
        position: steps % EPOCH_STEPS,
        steps: EPOCH_STEPS,
        loss: Some(loss_at(steps) as f32),
        images_per_s: Some(f64::from(feed.ranks) * 256.0 / feed.step.as_secs_f64()),
        lr: Some(0.1),
        step_s: Some(feed.step.as_secs_f64()),
        data_wait_s: Some(0.01),
        allreduce_s: Some(0.02),
        rank_totals,
        ..JobStatus::new(RUNNING_JOB, JobState::Running, Some(feed.run_dir.clone()))
    }
}

/// Finished job number `index`'s final status.
fn finished_status(index: u64) -> JobStatus {
    let name = finished_name(index);
    let run_dir = PathBuf::from("/runs").join(&name);
    let rank_totals = (0..FINISHED_RANKS)
        .map(|rank| RankTotals {
            rank,
            steps: 5000,
            step_p50_s: 0.3,
            step_p95_s: 0.35,
            ..RankTotals::default()
        })
        .collect();
    JobStatus {
        epoch: Some(5),
        position: EPOCH_STEPS,
        steps: EPOCH_STEPS,
        loss: Some(0.9),
        images_per_s: Some(6000.0),
        rank_totals,
        outcome: Some(format!(
            "done: validation top-1 76.10%; 6000 images/s; run folder {}",
            run_dir.display()
        )),
        summary: Some(JobSummary {
            run_dir: run_dir.clone(),
            top1: Some(0.761),
            top5: Some(0.93),
            first_loss: Some(6.9),
            last_loss: Some(0.9),
            images_per_s: 6000.0,
        }),
        ..JobStatus::new(&name, JobState::Succeeded, Some(run_dir))
    }
}

/// Finished job number `index`'s name.
pub(super) fn finished_name(index: u64) -> String {
    format!("bench-finished-{index:05}")
}

/// Spawns the running job's coordinator in the head's daemon.
pub(super) async fn spawn_running(client: &ClusterClient) -> anyhow::Result<ActorRef> {
    let options = SpawnOptions::new(COORDINATOR_KIND).label(ActorLabel::new(RUNNING_JOB, 0));
    client
        .spawn(options)
        .await
        .context("spawning the synthetic running job")
}

/// How far the keeping of finished jobs went.
#[derive(Debug)]
pub(super) struct Spawned {
    pub count: u64,
    pub took: Duration,
    /// Why it stopped short of the count asked for.
    pub stopped: Option<String>,
}

/// Hands finished jobs number `indices` to the archive, `at_once` at a time; stops at
/// the first failure or once `limit` has passed, saying which.
pub(super) async fn keep_finished(
    archive: &ActorRef,
    indices: std::ops::Range<u64>,
    at_once: usize,
    limit: Duration,
) -> Spawned {
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let (mut next, mut done, mut stopped) = (indices.start, 0_u64, None);
    let count = indices.end.saturating_sub(indices.start);
    while done < count && stopped.is_none() {
        while next < indices.end && tasks.len() < at_once && started.elapsed() < limit {
            tasks.spawn(keep_one(archive.clone(), next));
            next += 1;
        }
        match tasks.join_next().await {
            Some(Ok(Ok(()))) => done += 1,
            Some(Ok(Err(error))) => stopped = Some(format!("{error:#}")),
            Some(Err(error)) => stopped = Some(error.to_string()),
            None => stopped = Some(format!("not done within {limit:?}")),
        }
    }
    // Those in flight when it stopped still count once they are kept.
    while let Some(joined) = tasks.join_next().await {
        done += u64::from(matches!(joined, Ok(Ok(()))));
    }
    Spawned {
        count: done,
        took: started.elapsed(),
        stopped,
    }
}

async fn keep_one(archive: ActorRef, index: u64) -> anyhow::Result<()> {
    let request = KeepRequest {
        status: finished_status(index),
    };
    archive
        .call(
            KeepRequest::NAME,
            serde_json::to_vec(&request)?,
            Duration::from_secs(30),
        )
        .await
        .with_context(|| format!("keeping finished job {index}"))?;
    Ok(())
}

/// Starts the cluster's job archive on the head's node, and its handle.
pub(super) async fn start_archive(
    client: &ClusterClient,
    head: runtime::NodeId,
) -> anyhow::Result<ActorRef> {
    actors::job::start_archive(client, head)
        .await
        .context("starting the job archive")?;
    let status = client.status().await.context("asking the head")?;
    let id = actors::job::archive_ids(&status)
        .into_iter()
        .next()
        .context("the job archive is not among the head's actors")?;
    Ok(client.actor(id).await?)
}

/// Writes a `job.log` of about `bytes` bytes into `run_dir`, lines as a job's log has
/// them (a UTC time, then the text), and a `metrics.jsonl` of `steps` steps.
pub(super) fn write_run(run_dir: &Path, bytes: u64, steps: u64) -> anyhow::Result<()> {
    let path = run_dir.join(LOG_FILE);
    let file = std::fs::File::create(&path).with_context(|| format!("{}", path.display()))?;
    let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
    let (mut written, mut line) = (0_u64, 0_u64);
    while written < bytes {
        let text = log_line(line);
        out.write_all(text.as_bytes())?;
        written += text.len() as u64;
        line += 1;
    }
    out.flush()
        .with_context(|| format!("writing {}", path.display()))?;
    let metrics: String = (1..=steps).map(step_record).collect();
    std::fs::write(run_dir.join("metrics.jsonl"), metrics).context("writing metrics.jsonl")
}

/// Line `n` of the synthetic log.
fn log_line(n: u64) -> String {
    format!(
        "2025-06-01T12:{:02}:{:02}.{:03}Z epoch {} step {n}: loss {:.4}, 16384 images/s, data \
         wait 0.010 s, allreduce 0.020 s\n",
        (n / 60_000) % 60,
        (n / 1000) % 60,
        n % 1000,
        n / EPOCH_STEPS,
        loss_at(n)
    )
}

/// Step `step`'s record of `metrics.jsonl`.
fn step_record(step: u64) -> String {
    let record = serde_json::json!({
        "kind": "step", "epoch": step / EPOCH_STEPS, "step": step, "loss": loss_at(step),
        "accuracy": 0.5, "lr": 0.1, "samples": 16384, "images_per_s": 16384.0,
        "data_wait_s": 0.01, "compute_s": 0.15, "allreduce_s": 0.02, "step_s": 0.2,
        "elapsed_s": step as f64 * 0.2,
    });
    format!("{record}\n")
}

/// A loss that falls as a job's does.
fn loss_at(step: u64) -> f64 {
    0.9 + 6.0 / (1.0 + step as f64 / 500.0)
}

fn append(path: &Path, text: &str) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new().append(true).open(path)?;
    file.write_all(text.as_bytes())
}

/// Milliseconds from the Unix epoch to `at`.
fn actors_unix_ms(at: SystemTime) -> u64 {
    at.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_gives_steps_and_their_ends() {
        let feed = Feed::new(4, Duration::from_millis(200), PathBuf::new());
        for step in [0, 1, 7, 1000] {
            let ended = feed.step_ended(step);
            assert_eq!(feed.steps_at(ended), step);
            assert_eq!(feed.steps_at(ended + Duration::from_millis(199)), step);
        }
        assert_eq!(feed.rank_views().len(), 4);
    }

    #[test]
    fn the_synthetic_files_read_as_a_jobs_do() {
        let dir = tempfile::tempdir().expect("temp dir");
        write_run(dir.path(), 100_000, 50).expect("written");
        let request = LogRequest {
            from: actors::job::LogFrom::Tail { lines: 10 },
            max_bytes: 1 << 20,
        };
        let reply = actors::job::read_log_in(dir.path(), &request).expect("read");
        assert_eq!(reply.bytes.iter().filter(|&&b| b == b'\n').count(), 10);
        let metrics = std::fs::read(dir.path().join("metrics.jsonl")).expect("metrics");
        for line in metrics.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
            let record: actors::train::MetricsRecord =
                serde_json::from_slice(line).expect("a metrics record");
            assert_eq!(record.kind(), "step");
        }
    }
}
