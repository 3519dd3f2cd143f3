//! The job from spawning its trainers to the check of the replicas: the ring's wiring,
//! resume, the run folder, metrics, and watching the trainers for failures.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use actors::train::{
    AllreduceChoice, ConnectRecord, ConnectReply, ConnectRequest, DeviceSpec, DigestReply,
    DigestRequest, JobRecord, JobSpec, ListenReply, ListenRequest, MetricsRecord, ResumeFrom,
    TRAINER_KIND, TrainerInit, TrainerMethod, checkpoint, scaled_lr, secret_hex,
};
use anyhow::{Context, bail};
use runtime::{
    ActorCallError, ActorLabel, ActorRef, ClusterClient, FailureOrigin, NodeId, Resources,
    SpawnOptions, Strategy,
};
use serde::Serialize;

use super::spec::check_plan;
use super::steps::{RunningJob, Saved, StopControl, train_loop};
use super::world::{Cluster, RankPlace, plan_world};
use super::{JobOptions, JobSummary};
use crate::commands::plot;
use crate::config::Config;

/// A rank's handle and where it is.
#[derive(Clone)]
pub(super) struct Rank {
    pub(super) rank: u32,
    pub(super) place: RankPlace,
    pub(super) actor: ActorRef,
}

impl Rank {
    pub(super) fn name(&self) -> String {
        format!("rank {} (node {})", self.rank, self.place.node)
    }
}

/// Calls method `M` on every rank at once, each with its `request`, and returns the
/// replies in rank order; the first failure ends the call, naming the rank and node.
pub(super) async fn call_all<M: TrainerMethod>(
    ranks: &[Rank],
    request: impl Fn(&Rank) -> M,
    timeout: Duration,
) -> anyhow::Result<Vec<M::Reply>> {
    let mut tasks = tokio::task::JoinSet::new();
    for rank in ranks {
        let rank = rank.clone();
        let payload = to_json(&request(&rank));
        tasks.spawn(async move {
            let outcome = call_payload::<M>(&rank, payload, timeout).await;
            (rank.rank, outcome)
        });
    }
    let mut replies: BTreeMap<u32, M::Reply> = BTreeMap::new();
    while let Some(joined) = tasks.join_next().await {
        let (rank, outcome) = joined.context("a call task failed")?;
        replies.insert(rank, outcome?);
    }
    Ok(replies.into_values().collect())
}

/// Calls method `M` on one rank.
pub(super) async fn call_one<M: TrainerMethod>(
    rank: &Rank,
    request: &M,
    timeout: Duration,
) -> anyhow::Result<M::Reply> {
    call_payload::<M>(rank, to_json(request), timeout).await
}

async fn call_payload<M: TrainerMethod>(
    rank: &Rank,
    payload: Vec<u8>,
    timeout: Duration,
) -> anyhow::Result<M::Reply> {
    let method = M::NAME;
    let bytes = rank
        .actor
        .call(method, payload, timeout)
        .await
        .map_err(|error| RankCallError {
            rank: rank.name(),
            method,
            error,
        })?;
    serde_json::from_slice::<M::Reply>(&bytes)
        .with_context(|| format!("{}: {method}: bad reply", rank.name()))
}

/// A call to a rank that failed: the runtime's error, kept typed so that the job can ask
/// where a failure started ([`follows_another_failure`]).
#[derive(Debug, thiserror::Error)]
#[error("{rank}: {method}: {error}")]
pub(super) struct RankCallError {
    rank: String,
    method: &'static str,
    error: ActorCallError,
}

/// Whether `error` is a rank's failure that follows from another rank's (its ring peer
/// went away or stopped answering), as the trainer marked it: the root cause is elsewhere.
/// The failure may have come back from a call or, first, in the head's events.
fn follows_another_failure(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        let origin = match cause.downcast_ref::<RankCallError>() {
            Some(call) => call.error.failure_origin(),
            None => cause
                .downcast_ref::<RankFailure>()
                .map(|failure| failure.origin),
        };
        origin == Some(FailureOrigin::Elsewhere)
    })
}

fn to_json<T: Serialize>(value: &T) -> Vec<u8> {
    // Invariant: these request types hold only strings, numbers and paths, which always
    // encode.
    serde_json::to_vec(value).unwrap_or_default()
}

/// The job, from spawning trainers to the final checkpoint.
pub(super) struct Driver;

impl Driver {
    pub(super) async fn start(
        config: &Config,
        options: &JobOptions,
        mut job: JobSpec,
        cluster: &Cluster,
        stop: &StopControl,
    ) -> anyhow::Result<JobSummary> {
        let train = &config.train;
        let status = cluster
            .client
            .status()
            .await
            .context("asking for the cluster's status")?;
        let (places, node_ranks) = plan_world(&status, train)?;
        if job.optim.allreduce == AllreduceChoice::Nccl && places.iter().any(|p| !p.gpu) {
            bail!(
                "train.allreduce = \"nccl\" needs CUDA trainers, and this job's trainers run \
                 on CPUs (the cluster has no free GPU): use \"auto\" or \"ring\""
            );
        }
        let world = places.len() as u32;
        let global_batch = train.batch_size * u64::from(world);
        job.optim.lr = scaled_lr(train.lr, global_batch, train.reference_batch.max(1));
        check_plan(&job, &node_ranks)?;
        let resume = match &options.resume {
            Some(path) => Some(resume_from(path, &config.train.runs_dir)?),
            None => None,
        };
        if let Some(r) = &resume
            && r.state.epoch >= job.optim.epochs
        {
            bail!(
                "{} continues at epoch {} and train.epochs is {}: that run is complete. To \
                 train on, raise train.epochs (`--epochs {}` or more)",
                r.dir.display(),
                r.state.epoch,
                job.optim.epochs,
                r.state.epoch + 1
            );
        }
        let run_dir = match &resume {
            // A resumed run continues in its own folder: <run>/checkpoints/<name>.
            Some(r) => r
                .dir
                .parent()
                .and_then(Path::parent)
                .map(Path::to_path_buf)
                .context("checkpoint folder has no run folder")?,
            None => new_run_dir(train)?,
        };
        std::fs::create_dir_all(&run_dir)
            .with_context(|| format!("creating {}", run_dir.display()))?;
        {
            let mut progress = stop.progress();
            progress.run_dir = Some(run_dir.clone());
            progress.checkpoint = resume.as_ref().map(|r| Saved {
                dir: r.dir.clone(),
                epoch: r.state.epoch,
                global_step: r.state.global_step,
                step_in_epoch: r.state.step_in_epoch,
            });
        }
        print_plan(&job, &places, &node_ranks, global_batch, &run_dir);
        let metrics_path = run_dir.join("metrics.jsonl");
        if let Some(resume) = &resume {
            let dropped = super::metrics::rewind(&metrics_path, &resume.state)?;
            if dropped > 0 {
                println!(
                    "metrics: {dropped} record(s) past the checkpoint dropped from {}",
                    metrics_path.display()
                );
            }
        }
        let mut metrics = Metrics::open(&metrics_path)?;
        metrics.write(&MetricsRecord::Job(JobRecord {
            time: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            world: Some(world),
            nodes: Some(node_ranks.len() as u32),
            node_ranks: node_ranks.clone(),
            model: Some(job.model.kind.name().to_string()),
            classes: Some(job.model.classes),
            global_batch: Some(global_batch),
            lr: Some(job.optim.lr),
            epochs: Some(job.optim.epochs),
            resumed_from: resume.as_ref().map(|r| r.dir.display().to_string()),
            // `imgrun plot` drops what an earlier run wrote past this point.
            resumed_at_step: resume.as_ref().map(|r| r.state.global_step),
            resumed_epoch: resume.as_ref().map(|r| r.state.epoch),
        }))?;

        let job_name = run_dir.file_name().map_or_else(
            || run_dir.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        let ranks = spawn_trainers(cluster, &job, &job_name, &places, &node_ranks).await?;
        let long = Duration::from_secs(train.step_timeout_secs.max(10));
        let listens: Vec<ListenReply> = call_all(&ranks, |_| ListenRequest {}, long).await?;
        let steps_per_epoch = listens[0].steps_per_epoch;
        if let Some(bad) = listens
            .iter()
            .position(|l| l.steps_per_epoch != steps_per_epoch)
        {
            bail!(
                "ranks disagree on the epoch's length: rank 0 plans {steps_per_epoch} steps, \
                 rank {bad} {}",
                listens[bad].steps_per_epoch
            );
        }
        println!(
            "trainers: {} up ({} parameters on {}); {} steps per epoch, {} in all",
            world,
            listens[0].parameters,
            listens[0].device,
            steps_per_epoch,
            listens[0].total_steps
        );
        let secret = runtime::RingSecret::random();
        let job_id = format!("{}", run_dir.display());
        let connects: Vec<ConnectReply> = call_all(
            &ranks,
            |rank| {
                let next = &ranks[(rank.rank as usize + 1) % ranks.len()];
                let port = listens[next.rank as usize].port;
                let next_addr = format!("{}:{port}", next.place.ip)
                    .parse()
                    .unwrap_or_else(|_| std::net::SocketAddr::from(([127, 0, 0, 1], port)));
                ConnectRequest {
                    next: next_addr,
                    secret: secret_hex(&secret),
                    job: job_id.clone(),
                    op_timeout_secs: train.step_timeout_secs,
                    resume: resume.clone(),
                    nccl_id: listens[0].nccl_id.clone(),
                }
            },
            long,
        )
        .await?;
        println!(
            "ring: {world} ranks connected, {} gradient buckets; gradients averaged with {}",
            connects[0].buckets, connects[0].allreduce
        );
        metrics.write(&MetricsRecord::Connect(ConnectRecord {
            buckets: connects[0].buckets,
            allreduce: connects[0].allreduce.clone(),
        }))?;

        let running = RunningJob {
            config,
            job: &job,
            ranks: &ranks,
            run_dir: &run_dir,
            steps_per_epoch,
            node_ranks: &node_ranks,
            stop,
        };
        let mut watcher = FailureWatcher::start(cluster.client.clone(), &ranks);
        let loop_result = tokio::select! {
            result = train_loop(&running, &mut metrics, resume.as_ref()) => result,
            failure = watcher.failure() => Err(anyhow::Error::new(failure)),
        };
        let lost_head = match &loop_result {
            Err(error)
                if !error.is::<super::Interrupted>()
                    && !format!("{error:#}").starts_with(LOST_HEAD) =>
            {
                head_lost(&cluster.client).await
            }
            _ => None,
        };
        let loop_result = match (loop_result, lost_head) {
            // Without the head the job cannot go on, whatever the ranks saw first.
            (Err(error), Some(lost)) => {
                Err(anyhow::anyhow!("{lost}\n  (the trainers saw: {error:#})"))
            }
            // The first error is often a healthy rank seeing its ring peer go away; the
            // head's events name the rank that failed first, once it has noticed (a lost
            // node takes `dead_after_ms`).
            (Err(error), None) if follows_another_failure(&error) => {
                let wait = Duration::from_millis(config.cluster.dead_after_ms + 2000);
                match watcher.root_cause(wait).await {
                    Some(cause) => Err(anyhow::anyhow!("{cause}\n  (then: {error:#})")),
                    None => Err(error),
                }
            }
            (other, _) => other,
        };
        watcher.stop();
        let mut summary = loop_result.map_err(|error| {
            if format!("{error:#}").starts_with(LOST_HEAD) {
                anyhow::anyhow!("{error:#}\n{}", lost_head_consequences(&stop.progress()))
            } else {
                error
            }
        })?;

        let digests: Vec<DigestReply> = call_all(&ranks, |_| DigestRequest {}, long).await?;
        if digests.iter().any(|d| d.sha256 != digests[0].sha256) {
            bail!(
                "the replicas differ after training: {}",
                digests
                    .iter()
                    .enumerate()
                    .map(|(r, d)| format!("rank {r} {}", &d.sha256[..12]))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        println!(
            "replicas: identical on all {world} ranks (sha256 {})",
            &digests[0].sha256[..16]
        );
        if options.plot {
            let out = run_dir.join("metrics.png");
            match plot::render(&run_dir, &out) {
                Ok(()) => println!("plot: {}", out.display()),
                Err(error) => eprintln!("warning: drawing the metrics failed: {error:#}"),
            }
        }
        summary.run_dir = run_dir;
        Ok(summary)
    }
}

/// Spawns one trainer per place, each labelled with the job's name and its rank (what
/// `imgrun status` shows), for a world of `node_ranks[i]` ranks on node `i`.
pub(super) async fn spawn_trainers(
    cluster: &Cluster,
    job: &JobSpec,
    job_name: &str,
    places: &[RankPlace],
    node_ranks: &[u32],
) -> anyhow::Result<Vec<Rank>> {
    let world = places.len() as u32;
    let group = format!("train-{}", std::process::id());
    let mut tasks = tokio::task::JoinSet::new();
    for (r, place) in places.iter().enumerate() {
        let init = TrainerInit {
            rank: r as u32,
            world,
            node_ranks: node_ranks.to_vec(),
            threads: place.threads,
            device: if place.gpu {
                DeviceSpec::Cuda
            } else {
                DeviceSpec::Cpu
            },
            job: job.clone(),
        };
        let resources = if place.gpu {
            Resources::new().with_gpus(1)
        } else {
            Resources::new().with_cpu_millis(place.cpu_millis)
        };
        let options = SpawnOptions::new(TRAINER_KIND)
            .args(to_json(&init))
            .resources(resources)
            .strategy(Strategy::Node(place.node))
            .process_group(format!("{group}-rank{r}"))
            .label(ActorLabel::new(job_name, r as u32));
        let client = cluster.client.clone();
        let place = place.clone();
        tasks.spawn(async move {
            let spawned = client.spawn(options).await;
            (r, place, spawned)
        });
    }
    let mut ranks = Vec::new();
    let mut failure = None;
    while let Some(joined) = tasks.join_next().await {
        let (r, place, spawned) = joined.context("a spawn task failed")?;
        match spawned {
            Ok(actor) => {
                cluster
                    .trainers
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(actor.clone());
                ranks.push(Rank {
                    rank: r as u32,
                    place,
                    actor,
                });
            }
            Err(error) => {
                failure.get_or_insert_with(|| {
                    format!(
                        "rank {r} (node {}): starting its trainer: {error}",
                        place.node
                    )
                });
            }
        }
    }
    if let Some(failure) = failure {
        bail!(failure);
    }
    ranks.sort_by_key(|r| r.rank);
    Ok(ranks)
}

pub(super) fn resume_from(path: &Path, runs_dir: &str) -> anyhow::Result<ResumeFrom> {
    let path = if path == Path::new("latest") {
        newest_run(Path::new(runs_dir))?
    } else {
        path.to_path_buf()
    };
    let dir = checkpoint::resolve(&path)?;
    let state = checkpoint::read_state(&dir)?;
    let dir = std::fs::canonicalize(&dir).with_context(|| format!("{}", dir.display()))?;
    println!(
        "resuming: {} (epoch {}, step {} of the epoch, global step {})",
        dir.display(),
        state.epoch,
        state.step_in_epoch,
        state.global_step
    );
    Ok(ResumeFrom { dir, state })
}

/// The most recently modified run folder with a checkpoint.
pub(super) fn newest_run(runs: &Path) -> anyhow::Result<PathBuf> {
    let entries = std::fs::read_dir(runs)
        .with_context(|| format!("--resume latest: reading {}", runs.display()))?;
    entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.join("checkpoints")
                .join(checkpoint::LATEST_FILE)
                .is_file()
        })
        .max_by_key(|p| {
            std::fs::metadata(p.join("checkpoints").join(checkpoint::LATEST_FILE))
                .and_then(|m| m.modified())
                .ok()
        })
        .with_context(|| {
            format!(
                "--resume latest: no run in {} has a checkpoint",
                runs.display()
            )
        })
}

pub(super) fn new_run_dir(train: &crate::config::TrainConfig) -> anyhow::Result<PathBuf> {
    let name = if train.name.is_empty() {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        format!("run-{now}")
    } else {
        train.name.clone()
    };
    let dir = Path::new(&train.runs_dir).join(name);
    anyhow::ensure!(
        !dir.join("checkpoints")
            .join(checkpoint::LATEST_FILE)
            .exists(),
        "{} already holds a run: choose another --name, or continue it with --resume {}",
        dir.display(),
        dir.display()
    );
    Ok(dir)
}

pub(super) fn print_plan(
    job: &JobSpec,
    places: &[RankPlace],
    node_ranks: &[u32],
    global_batch: u64,
    run_dir: &Path,
) {
    let world = places.len();
    let device = if places.first().is_some_and(|p| p.gpu) {
        "GPU"
    } else {
        "CPU"
    };
    let mut nodes: Vec<NodeId> = places.iter().map(|p| p.node).collect();
    nodes.dedup();
    let names: Vec<String> = nodes.iter().map(|n| format!("node {n}")).collect();
    let shape =
        pipelines::ClusterShape::with_node_ranks(node_ranks.to_vec(), job.data.loader_workers);
    println!("plan:");
    println!(
        "  world       {world} {device} trainer(s) on {}: {} ({})",
        names.join(", "),
        shape.layout(),
        if shape.nodes() > 1 {
            "ranks numbered node by node"
        } else {
            "one node"
        }
    );
    println!(
        "  threads     {} libtorch thread(s) per trainer, {} loader worker(s) each",
        places.first().map_or(0, |p| p.threads),
        job.data.loader_workers
    );
    println!(
        "  model       {} ({} classes)",
        job.model.kind.name(),
        job.model.classes
    );
    println!(
        "  data        {} train shard(s){}, {} val shard(s), {} mode",
        job.data.train.urls.len(),
        job.data
            .train
            .total()
            .map(|t| format!(" ({t} samples)"))
            .unwrap_or_default(),
        job.data.val.urls.len(),
        job.data.mode.name()
    );
    println!(
        "  batch       {} per rank, {global_batch} global; lr {:.4} after linear scaling",
        job.optim.batch_size, job.optim.lr
    );
    println!("  epochs      {}", job.optim.epochs);
    println!("  run         {}", run_dir.display());
}

/// The metrics file: one JSON object per line, flushed as it goes.
pub(super) struct Metrics {
    pub(super) file: File,
    pub(super) path: PathBuf,
}

impl Metrics {
    pub(super) fn open(path: &Path) -> anyhow::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        Ok(Self {
            file,
            path: path.to_path_buf(),
        })
    }

    pub(super) fn write(&mut self, record: &MetricsRecord) -> anyhow::Result<()> {
        let line = serde_json::to_string(record)
            .with_context(|| format!("encoding a {} record", record.kind()))?;
        writeln!(self.file, "{line}").with_context(|| format!("writing {}", self.path.display()))
    }
}

/// How a lost head's error begins.
const LOST_HEAD: &str = "lost the head node at";
/// How long the head may take to answer a status request before a job that failed calls
/// it lost.
const HEAD_PROBE: Duration = Duration::from_secs(5);

/// Why the head is lost, if it is: its connection ended, or it did not answer a status
/// request within [`HEAD_PROBE`]. The connection is then closed, so that what the client
/// still asks of the head (killing trainers) fails at once rather than waiting.
async fn head_lost(client: &ClusterClient) -> Option<String> {
    let why = if client.connection().is_closed() {
        "the connection to it ended".to_owned()
    } else {
        match tokio::time::timeout(HEAD_PROBE, client.status()).await {
            Ok(Err(
                error @ (runtime::DaemonError::Unreachable { .. }
                | runtime::DaemonError::Request { .. }),
            )) => error.to_string(),
            // It answered, if not with a status.
            Ok(_) => return None,
            Err(_) => format!(
                "it did not answer a status request within {} s",
                HEAD_PROBE.as_secs()
            ),
        }
    };
    client.connection().close();
    Some(format!("{LOST_HEAD} {}: {why}", client.head()))
}

/// What a lost head means for the job, and how to continue it.
fn lost_head_consequences(progress: &super::steps::Progress) -> String {
    let mut text = String::from(
        "the job cannot continue without the head, which places and supervises its \
         trainers; they end: those on the head's machine with its daemon (or, if the head \
         lives on, when it sees this client gone), those on other nodes when their node \
         has been cut off from the head for the dead window (cluster.dead_after_ms)",
    );
    match (&progress.checkpoint, &progress.run_dir) {
        (Some(saved), Some(run)) => {
            let args: Vec<String> = std::env::args().collect();
            text.push_str(&format!(
                "\nlast checkpoint: {} (epoch {}, step {} of the epoch, global step {}); once \
                 the head is back (`imgrun start --head`, and the nodes joined), continue \
                 with:\n  {}",
                saved.dir.display(),
                saved.epoch,
                saved.step_in_epoch,
                saved.global_step,
                super::resume_command(&args, run)
            ));
        }
        _ => text.push_str(
            "\nno checkpoint was written: nothing to resume; start the job again once the \
             head is back",
        ),
    }
    text
}

/// Watches the head's events for the job's trainers: any failure or stop we did not ask
/// for ends the job, naming the rank, node and cause; so does the end of the connection
/// to the head.
pub(super) struct FailureWatcher {
    pub(super) failures: tokio::sync::mpsc::Receiver<RankFailure>,
    pub(super) task: tokio::task::JoinHandle<()>,
}

/// A failure the watcher saw: what to tell the user, and where it started.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub(super) struct RankFailure {
    pub(super) message: String,
    pub(super) origin: FailureOrigin,
}

impl FailureWatcher {
    pub(super) fn start(client: ClusterClient, ranks: &[Rank]) -> Self {
        let by_id: BTreeMap<u64, (u32, NodeId)> = ranks
            .iter()
            .map(|r| (r.actor.id().0, (r.rank, r.place.node)))
            .collect();
        let (tx, failures) = tokio::sync::mpsc::channel(4);
        let task = tokio::spawn(async move {
            let mut after = 0;
            loop {
                let page = match client.events(after, Duration::from_secs(30)).await {
                    Ok(page) => page,
                    Err(error) if client.connection().is_closed() => {
                        let message = format!("{LOST_HEAD} {}: {error}", client.head());
                        let origin = FailureOrigin::Here;
                        let _ = tx.send(RankFailure { message, origin }).await;
                        return;
                    }
                    Err(_) => {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                };
                for event in page.events {
                    after = after.max(event.seq);
                    if let Some((rank, node)) = by_id.get(&event.actor.0) {
                        let node = event.node.unwrap_or(*node);
                        let message =
                            format!("rank {rank} (node {node}) {}: {}", event.kind, event.reason);
                        let origin = event.origin;
                        let _ = tx.send(RankFailure { message, origin }).await;
                    }
                }
            }
        });
        Self { failures, task }
    }

    /// Within `wait`, the failure of a rank that did not fail because a ring peer went
    /// away (a trainer that crashed, or one on a lost node), if the head reports one.
    pub(super) async fn root_cause(&mut self, wait: Duration) -> Option<String> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let failure = tokio::time::timeout_at(deadline, self.failures.recv())
                .await
                .ok()??;
            if failure.origin == FailureOrigin::Here {
                return Some(failure.message);
            }
        }
    }

    pub(super) async fn failure(&mut self) -> RankFailure {
        match self.failures.recv().await {
            Some(failure) => failure,
            None => std::future::pending().await,
        }
    }

    pub(super) fn stop(&self) {
        self.task.abort();
    }
}
