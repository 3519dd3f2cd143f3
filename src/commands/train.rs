//! `imgrun train`: one data-parallel job on the cluster.
//!
//! The client connects to the running cluster (or starts an embedded one for the job),
//! sizes the world from the free GPUs (else CPU trainers), spawns one trainer actor per
//! rank in a worker process of its own on its node, wires the ranks into a ring, and then
//! drives them: the same number of steps to every rank per call, evaluation, checkpoints,
//! metrics, progress. Every trainer failure or node loss ends the job with the rank, node
//! and cause; Ctrl-C stops every trainer.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use actors::train::{
    CheckpointState, ConnectReply, ConnectRequest, DataSpec, DeviceSpec, DigestReply, EvalReply,
    JobSpec, ListenReply, ModelKind, ModelSpec, OptimSpec, PolicySpec, ResumeFrom, SaveRequest,
    ScheduleSpec, SgdConfig, ShardSet, SourceSpec, TRAINER_KIND, TrainReply, TrainRequest,
    TrainerInit, checkpoint, scaled_lr, secret_hex,
};
use anyhow::{Context, bail};
use pipelines::{HookSources, Manifest, ShardList};
use runtime::{ActorRef, ClusterClient, NodeId, Resources, SpawnOptions, Strategy};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::config::{Config, Loaded};

#[derive(Debug, clap::Args)]
pub struct TrainArgs {
    /// Address of the cluster's head [default: the cluster this machine runs or joined;
    /// without one, an embedded cluster for the length of the job].
    #[arg(long)]
    address: Option<String>,
    /// Start an embedded cluster even when one is running.
    #[arg(long, conflicts_with = "address")]
    embedded: bool,
    /// GPU trainers (0: every free GPU).
    #[arg(long)]
    gpus: Option<u32>,
    /// CPU trainers when the cluster has no GPUs (0: one per node).
    #[arg(long)]
    workers: Option<u32>,
    #[arg(long)]
    epochs: Option<u64>,
    /// Run name (its folder is runs_dir/NAME).
    #[arg(long)]
    name: Option<String>,
    /// Continue from a checkpoint: its folder, a run folder, or `latest` (the newest run's
    /// latest checkpoint).
    #[arg(long, value_name = "PATH")]
    resume: Option<PathBuf>,
    /// Sets a configuration key for this run (`--set train.lr=0.2`); repeatable.
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
    /// Do not draw metrics.png at the end.
    #[arg(long)]
    no_plot: bool,
}

/// What a finished job reports.
#[derive(Debug, Clone)]
pub struct JobSummary {
    pub run_dir: PathBuf,
    pub top1: Option<f64>,
    pub top5: Option<f64>,
    pub first_loss: Option<f32>,
    pub last_loss: Option<f32>,
    pub images_per_s: f64,
}

pub fn run(loaded: &Loaded, args: TrainArgs) -> anyhow::Result<ExitCode> {
    let mut loaded = crate::config::load_with(loaded.file.as_deref(), None, &args.set)?;
    let train = &mut loaded.config.train;
    if let Some(gpus) = args.gpus {
        train.gpus = gpus;
    }
    if let Some(workers) = args.workers {
        train.workers = workers;
    }
    if let Some(epochs) = args.epochs {
        train.epochs = epochs;
    }
    if let Some(name) = &args.name {
        train.name = name.clone();
    }
    let options = JobOptions {
        address: args.address,
        embedded: args.embedded,
        resume: args.resume,
        plot: !args.no_plot,
    };
    match train_job(&loaded.config, &options) {
        Ok(_) => Ok(ExitCode::SUCCESS),
        Err(error) if error.is::<Cancelled>() => {
            eprintln!("cancelled: every trainer was stopped");
            Ok(ExitCode::from(130))
        }
        Err(error) => Err(error),
    }
}

/// How to run a job, beside its configuration.
#[derive(Debug, Clone, Default)]
pub struct JobOptions {
    pub address: Option<String>,
    pub embedded: bool,
    pub resume: Option<PathBuf>,
    pub plot: bool,
}

#[derive(Debug, thiserror::Error)]
#[error("cancelled")]
struct Cancelled;

/// Runs a job to its end.
pub fn train_job(config: &Config, options: &JobOptions) -> anyhow::Result<JobSummary> {
    let job = job_spec(config)?;
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    tokio.block_on(async {
        let cluster = Cluster::connect(config, options).await?;
        let driver = Driver::start(config, options, job, &cluster);
        let outcome = tokio::select! {
            outcome = driver => outcome,
            _ = tokio::signal::ctrl_c() => Err(Cancelled.into()),
        };
        cluster.stop_trainers().await;
        cluster.shutdown().await;
        outcome
    })
}

/// The configuration turned into what every trainer gets.
fn job_spec(config: &Config) -> anyhow::Result<JobSpec> {
    let data = &config.data;
    let model = &config.model;
    let train = &config.train;
    anyhow::ensure!(
        !data.train.is_empty(),
        "data.train is empty: name the training shards (e.g. --set data.train='\"/data/train-{{000000..000146}}.tar\"')"
    );
    let kind: ModelKind = model
        .name
        .parse()
        .map_err(|e| anyhow::anyhow!("model.name: {e}"))?;
    let train_set = shard_set(&data.train, &data.base).context("data.train")?;
    let val_set = if data.val.is_empty() {
        ShardSet::default()
    } else {
        shard_set(&data.val, &data.base).context("data.val")?
    };
    let classes = match data.classes {
        0 => manifest_beside(&train_set.urls)
            .map(|m| m.classes.len() as i64)
            .filter(|&c| c > 0)
            .context(
                "data.classes is 0 and the training shards have no manifest.json naming the \
                 classes: set data.classes",
            )?,
        n => n,
    };
    let hooks_dir = (!data.hooks.is_empty()).then(|| PathBuf::from(&data.hooks));
    let hooks = HookSources::read(hooks_dir.as_deref()).context("data.hooks")?;
    let policy = match data.policy.as_str() {
        "none" => PolicySpec::None,
        "join" => PolicySpec::Join,
        "drop" => PolicySpec::Drop {
            nbatches: (data.nbatches > 0).then_some(data.nbatches),
        },
        "repeat" => PolicySpec::Repeat {
            dsrepeat: data.dsrepeat.max(1),
            nbatches: (data.nbatches > 0).then_some(data.nbatches),
        },
        other => bail!("data.policy `{other}`: expected join, drop, repeat or none"),
    };
    let split = match data.mode.as_str() {
        "resampled" => false,
        "split" => true,
        other => bail!("data.mode `{other}`: expected resampled or split"),
    };
    let mut sizes = vec![(0, data.image_size)];
    sizes.extend(data.size_schedule.iter().copied().filter(|(e, _)| *e > 0));
    sizes.sort_unstable();
    let schedule = match train.schedule.as_str() {
        "cosine" => ScheduleSpec::Cosine {
            final_fraction: train.final_lr_fraction,
        },
        "step" => ScheduleSpec::Step {
            milestones: train.milestones.clone(),
            gamma: train.gamma,
        },
        "constant" => ScheduleSpec::Constant,
        other => bail!("train.schedule `{other}`: expected cosine, step or constant"),
    };
    let amp = match train.precision.as_str() {
        "fp32" => false,
        "amp" => true,
        other => bail!("train.precision `{other}`: expected fp32 or amp"),
    };
    anyhow::ensure!(train.batch_size > 0, "train.batch_size must be at least 1");
    anyhow::ensure!(train.epochs > 0, "train.epochs must be at least 1");
    let (lo, hi) = data.crop_scale;
    anyhow::ensure!(
        0.0 < lo && lo <= hi && hi <= 1.0,
        "data.crop_scale [{lo}, {hi}] must satisfy 0 < min <= max <= 1"
    );
    let shards = &config.shards;
    Ok(JobSpec {
        data: DataSpec {
            train: train_set,
            val: val_set,
            hooks,
            split,
            policy,
            epoch_size: (data.epoch_size > 0).then_some(data.epoch_size),
            nominal_size: (data.nominal_size > 0).then_some(data.nominal_size),
            seed: data.seed,
            workers: data.workers.max(1),
            shuffle_buffer: data.shuffle_buffer,
            queue_batches: data.queue_batches.max(1),
            image_fields: data.image_fields.clone(),
            label_field: data.label_field.clone(),
            errors: shards.error_policy.clone(),
            sizes,
            eval_size: data.eval_size,
            crop_scale: data.crop_scale,
            resize_ratio: data.resize_ratio,
            flip: data.flip,
            sources: SourceSpec {
                read_buffer: shards.read_buffer,
                http_timeout_secs: shards.http_timeout_secs,
                http_attempts: shards.http_attempts,
                http_retry_delay_ms: shards.http_retry_delay_ms,
                cache_dir: (!shards.cache_dir.is_empty()).then(|| shards.cache_dir.clone()),
                cache_max_bytes: crate::units::parse_size(&shards.cache_max_size).unwrap_or(0),
            },
        },
        model: ModelSpec {
            kind,
            classes,
            width: model.width,
            seed: model.seed,
        },
        optim: OptimSpec {
            epochs: train.epochs,
            batch_size: train.batch_size,
            // Scaled once the world size is known.
            lr: train.lr,
            sgd: SgdConfig {
                momentum: train.momentum,
                nesterov: train.nesterov,
                weight_decay: train.weight_decay,
            },
            label_smoothing: train.label_smoothing,
            warmup_epochs: train.warmup_epochs,
            warmup_start_fraction: train.warmup_start_fraction,
            schedule,
            bucket_bytes: (train.bucket_mb.max(0.001) * 1e6) as usize,
            amp,
        },
    })
}

fn shard_set(spec: &str, base: &str) -> anyhow::Result<ShardSet> {
    let spec = if spec.contains("%s") && !base.is_empty() {
        spec.replace("%s", base)
    } else {
        spec.to_string()
    };
    let urls = ShardList::from_spec(&spec)
        .with_context(|| format!("shard spec `{spec}`"))?
        .urls;
    anyhow::ensure!(!urls.is_empty(), "shard spec `{spec}` names no shards");
    let missing: Vec<&String> = urls
        .iter()
        .filter(|u| !u.contains("://") && !u.starts_with("pipe:") && u.as_str() != "-")
        .filter(|u| !Path::new(u.trim_start_matches("file:")).is_file())
        .collect();
    if let Some(first) = missing.first() {
        bail!(
            "no such shard: {first} ({} of the {} shards of `{spec}` are missing)",
            missing.len(),
            urls.len()
        );
    }
    let samples = match manifest_beside(&urls) {
        Some(manifest) => pipelines::PlanShard::with_manifest(&urls, &manifest)
            .into_iter()
            .map(|s| s.samples)
            .collect(),
        None => vec![None; urls.len()],
    };
    Ok(ShardSet { urls, samples })
}

/// The manifest.json beside the first shard, when the shards are local files.
fn manifest_beside(urls: &[String]) -> Option<Manifest> {
    let first = urls.first()?;
    if first.contains("://") || first.starts_with("pipe:") {
        return None;
    }
    let dir = Path::new(first.trim_start_matches("file:")).parent()?;
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    Manifest::read_from(dir).ok()
}

/// The cluster a job runs on: the running one, or one embedded in this process.
struct Cluster {
    client: ClusterClient,
    embedded: Option<(runtime::Head, tempfile::TempDir)>,
    trainers: std::sync::Mutex<Vec<ActorRef>>,
}

impl Cluster {
    async fn connect(config: &Config, options: &JobOptions) -> anyhow::Result<Self> {
        let state = super::cluster::state_dir(&config.cluster)?;
        if !options.embedded {
            match ClusterClient::connect(&state, options.address.as_deref()).await {
                Ok(client) => {
                    println!("cluster: head at {}", client.head());
                    return Ok(Self {
                        client,
                        embedded: None,
                        trainers: Default::default(),
                    });
                }
                Err(runtime::DaemonError::NoHead { .. }) if options.address.is_none() => {}
                Err(error) => {
                    return Err(error).context(
                        "connecting to the cluster (`imgrun stop` clears the records of a \
                         cluster that is gone; --embedded runs on a cluster of its own)",
                    );
                }
            }
        }
        let dir = tempfile::Builder::new()
            .prefix("imgrun-embedded-")
            .tempdir()
            .context("making the embedded cluster's state folder")?;
        let state = runtime::StateDir::at(dir.path());
        let head = runtime::Head::start(runtime::HeadConfig {
            bind: "127.0.0.1:0".parse().context("loopback address")?,
            advertise: None,
            state: state.clone(),
            resources: runtime::discover(&runtime::DiscoverOptions::default()),
            membership: super::cluster::membership(&config.cluster),
            transport: runtime::TransportOptions::default(),
            actors: super::cluster::actor_hosting(),
        })
        .await
        .context("starting the embedded cluster")?;
        let client = ClusterClient::connect(&state, Some(&head.join_address()))
            .await
            .context("connecting to the embedded cluster")?;
        println!(
            "cluster: embedded, on this machine only (no running cluster was found; \
             `imgrun start --head` starts one)"
        );
        Ok(Self {
            client,
            embedded: Some((head, dir)),
            trainers: Default::default(),
        })
    }

    async fn stop_trainers(&self) {
        let trainers =
            std::mem::take(&mut *self.trainers.lock().unwrap_or_else(|e| e.into_inner()));
        let mut tasks = tokio::task::JoinSet::new();
        for trainer in trainers {
            tasks.spawn(async move {
                // A trainer stuck in a collective would not get to a graceful stop.
                let _ = trainer.kill().await;
            });
        }
        while tasks.join_next().await.is_some() {}
    }

    async fn shutdown(self) {
        if let Some((head, _dir)) = self.embedded {
            head.stop().await;
        }
    }
}

/// Where one rank runs.
#[derive(Debug, Clone)]
struct RankPlace {
    node: NodeId,
    /// The node's IP, where its trainers' ring ports are reached.
    ip: String,
    gpu: bool,
    threads: u32,
    /// The node's CPUs this rank reserves, in thousandths: its share of the node.
    cpu_millis: u64,
}

/// The world: one rank per free GPU (or `gpus` of them), else CPU trainers. Ranks are
/// numbered node by node.
fn plan_world(
    status: &runtime::ClusterStatus,
    train: &crate::config::TrainConfig,
) -> anyhow::Result<(Vec<RankPlace>, u32, u32)> {
    let live: Vec<&runtime::NodeStatus> = status.live_nodes().collect();
    anyhow::ensure!(!live.is_empty(), "the cluster has no live node");
    let free_gpus: Vec<u32> = live
        .iter()
        .map(|n| {
            (n.gpus.len() as u64).saturating_sub(n.used.get(Resources::GPU).copied().unwrap_or(0))
                as u32
        })
        .collect();
    let total_gpus: u32 = free_gpus.iter().sum();
    let mut per_node: Vec<u32> = if total_gpus > 0 {
        let want = if train.gpus == 0 {
            total_gpus
        } else {
            train.gpus.min(total_gpus)
        };
        take_spread(&free_gpus, want)
    } else {
        anyhow::ensure!(
            train.gpus == 0,
            "train.gpus = {} but the cluster has no free GPU",
            train.gpus
        );
        let want = if train.workers == 0 {
            live.len() as u32
        } else {
            train.workers
        };
        take_spread(&vec![u32::MAX; live.len()], want)
    };
    // The planner numbers ranks node by node with the same count on each node; a world
    // that is not even is planned as one rank per "node".
    let used_nodes: Vec<usize> = (0..live.len()).filter(|&i| per_node[i] > 0).collect();
    let counts: Vec<u32> = used_nodes.iter().map(|&i| per_node[i]).collect();
    let even = counts.windows(2).all(|w| w[0] == w[1]);
    let mut ranks = Vec::new();
    for &i in &used_nodes {
        let node = live[i];
        let here = per_node[i];
        let cpus = node.cpus.max(1);
        let free_cpu_millis = (u64::from(cpus) * 1000)
            .saturating_sub(node.used.get(Resources::CPU).copied().unwrap_or(0))
            .max(u64::from(here));
        let threads = match train.threads {
            0 => (cpus / here).max(1),
            t => t,
        };
        let ip = node
            .address
            .rsplit_once(':')
            .map_or(node.address.as_str(), |(ip, _)| ip)
            .trim_matches(['[', ']'])
            .to_string();
        for _ in 0..here {
            ranks.push(RankPlace {
                node: node.id,
                ip: ip.clone(),
                gpu: total_gpus > 0,
                threads,
                cpu_millis: free_cpu_millis / u64::from(here),
            });
        }
    }
    per_node.retain(|&c| c > 0);
    let (nodes, per) = if even {
        (per_node.len() as u32, counts.first().copied().unwrap_or(1))
    } else {
        (ranks.len() as u32, 1)
    };
    Ok((ranks, nodes, per))
}

/// `want` slots taken round-robin over nodes with `free` slots each.
fn take_spread(free: &[u32], want: u32) -> Vec<u32> {
    let mut taken = vec![0u32; free.len()];
    let mut left = want;
    while left > 0 {
        let mut progressed = false;
        for (slot, &cap) in taken.iter_mut().zip(free) {
            if left > 0 && *slot < cap {
                *slot += 1;
                left -= 1;
                progressed = true;
            }
        }
        if !progressed {
            break;
        }
    }
    taken
}

/// A rank's handle and where it is.
#[derive(Clone)]
struct Rank {
    rank: u32,
    place: RankPlace,
    actor: ActorRef,
}

impl Rank {
    fn name(&self) -> String {
        format!("rank {} (node {})", self.rank, self.place.node)
    }
}

/// Calls `method` on every rank at once and returns the replies in rank order; the
/// first failure ends the call, naming the rank and node.
async fn call_all<Rep: DeserializeOwned + Send + 'static>(
    ranks: &[Rank],
    method: &'static str,
    payload: impl Fn(&Rank) -> Vec<u8>,
    timeout: Duration,
) -> anyhow::Result<Vec<Rep>> {
    let mut tasks = tokio::task::JoinSet::new();
    for rank in ranks {
        let rank = rank.clone();
        let payload = payload(&rank);
        tasks.spawn(async move {
            let result = rank.actor.call(method, payload, timeout).await;
            let outcome = result
                .map_err(|e| anyhow::anyhow!("{}: {method}: {e}", rank.name()))
                .and_then(|bytes| {
                    serde_json::from_slice::<Rep>(&bytes)
                        .with_context(|| format!("{}: {method}: bad reply", rank.name()))
                });
            (rank.rank, outcome)
        });
    }
    let mut replies: BTreeMap<u32, Rep> = BTreeMap::new();
    while let Some(joined) = tasks.join_next().await {
        let (rank, outcome) = joined.context("a call task failed")?;
        replies.insert(rank, outcome?);
    }
    Ok(replies.into_values().collect())
}

fn to_json<T: Serialize>(value: &T) -> Vec<u8> {
    // Invariant: these request types hold only strings, numbers and paths, which always
    // encode.
    serde_json::to_vec(value).unwrap_or_default()
}

/// The job, from spawning trainers to the final checkpoint.
struct Driver;

impl Driver {
    async fn start(
        config: &Config,
        options: &JobOptions,
        mut job: JobSpec,
        cluster: &Cluster,
    ) -> anyhow::Result<JobSummary> {
        let train = &config.train;
        let status = cluster
            .client
            .status()
            .await
            .context("asking for the cluster's status")?;
        let (places, nodes, ranks_per_node) = plan_world(&status, train)?;
        let world = places.len() as u32;
        let global_batch = train.batch_size * u64::from(world);
        job.optim.lr = scaled_lr(train.lr, global_batch, train.reference_batch.max(1));
        check_plan(&job, nodes, ranks_per_node)?;
        let resume = match &options.resume {
            Some(path) => Some(resume_from(path, &config.train.runs_dir)?),
            None => None,
        };
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
        print_plan(&job, &places, nodes, ranks_per_node, global_batch, &run_dir);
        let mut metrics = Metrics::open(&run_dir.join("metrics.jsonl"))?;
        metrics.write(&serde_json::json!({
            "kind": "job",
            "time": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
            "world": world,
            "nodes": nodes,
            "ranks_per_node": ranks_per_node,
            "model": job.model.kind.name(),
            "classes": job.model.classes,
            "global_batch": global_batch,
            "lr": job.optim.lr,
            "epochs": job.optim.epochs,
            "resumed_from": resume.as_ref().map(|r| r.dir.display().to_string()),
        }))?;

        let ranks = spawn_trainers(cluster, &job, &places, nodes, ranks_per_node).await?;
        let long = Duration::from_secs(train.step_timeout_secs.max(10));
        let listens: Vec<ListenReply> =
            call_all(&ranks, "listen", |_| b"{}".to_vec(), long).await?;
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
            "connect",
            |rank| {
                let next = &ranks[(rank.rank as usize + 1) % ranks.len()];
                let port = listens[next.rank as usize].port;
                let next_addr = format!("{}:{port}", next.place.ip)
                    .parse()
                    .unwrap_or_else(|_| std::net::SocketAddr::from(([127, 0, 0, 1], port)));
                to_json(&ConnectRequest {
                    next: next_addr,
                    secret: secret_hex(&secret),
                    job: job_id.clone(),
                    op_timeout_secs: train.step_timeout_secs,
                    resume: resume.clone(),
                })
            },
            long,
        )
        .await?;
        println!(
            "ring: {world} ranks connected, {} gradient buckets",
            connects[0].buckets
        );

        let running = RunningJob {
            config,
            job: &job,
            ranks: &ranks,
            run_dir: &run_dir,
            steps_per_epoch,
            nodes,
            ranks_per_node,
        };
        let mut watcher = FailureWatcher::start(cluster.client.clone(), &ranks);
        let loop_result = tokio::select! {
            result = train_loop(&running, &mut metrics, resume.as_ref()) => result,
            failure = watcher.failure() => Err(anyhow::anyhow!(failure)),
        };
        let loop_result = match loop_result {
            // The first error is often a healthy rank seeing its ring peer go away; the
            // head's events name the rank that failed first, once it has noticed (a lost
            // node takes `dead_after_ms`).
            Err(error) if format!("{error:#}").contains(actors::train::PEER_FAILURE) => {
                let wait = Duration::from_millis(config.cluster.dead_after_ms + 2000);
                match watcher.root_cause(wait).await {
                    Some(cause) => Err(anyhow::anyhow!("{cause}\n  (then: {error:#})")),
                    None => Err(error),
                }
            }
            other => other,
        };
        watcher.stop();
        let mut summary = loop_result?;

        let digests: Vec<DigestReply> =
            call_all(&ranks, "digest", |_| b"{}".to_vec(), long).await?;
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
            match super::plot::render(&run_dir, &out) {
                Ok(()) => println!("plot: {}", out.display()),
                Err(error) => eprintln!("warning: drawing the metrics failed: {error:#}"),
            }
        }
        summary.run_dir = run_dir;
        Ok(summary)
    }
}

/// Plans the first epoch here, so a bad hook or missing counts fail before any trainer
/// starts (each trainer plans every epoch again for itself).
fn check_plan(job: &JobSpec, nodes: u32, ranks_per_node: u32) -> anyhow::Result<()> {
    let shape = pipelines::ClusterShape::new(nodes, ranks_per_node, job.data.workers);
    let hooks = pipelines::Hooks::compile(&job.data.hooks, pipelines::HookLimits::default())?;
    let plan = pipelines::Planner::new(job.data.train_plan(shape, job.optim.batch_size), hooks)
        .and_then(|planner| planner.plan(0))
        .context("planning the first epoch")?;
    plan.check().context("planning the first epoch")?;
    anyhow::ensure!(
        plan.steps().is_some(),
        "the ranks' batch counts are unknown: give the shards a manifest.json with sample \
         counts, or choose the drop policy with data.nbatches"
    );
    Ok(())
}

async fn spawn_trainers(
    cluster: &Cluster,
    job: &JobSpec,
    places: &[RankPlace],
    nodes: u32,
    ranks_per_node: u32,
) -> anyhow::Result<Vec<Rank>> {
    let world = places.len() as u32;
    let group = format!("train-{}", std::process::id());
    let mut tasks = tokio::task::JoinSet::new();
    for (r, place) in places.iter().enumerate() {
        let init = TrainerInit {
            rank: r as u32,
            world,
            nodes,
            ranks_per_node,
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
            .process_group(format!("{group}-rank{r}"));
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

fn resume_from(path: &Path, runs_dir: &str) -> anyhow::Result<ResumeFrom> {
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
fn newest_run(runs: &Path) -> anyhow::Result<PathBuf> {
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

fn new_run_dir(train: &crate::config::TrainConfig) -> anyhow::Result<PathBuf> {
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

fn print_plan(
    job: &JobSpec,
    places: &[RankPlace],
    nodes: u32,
    ranks_per_node: u32,
    global_batch: u64,
    run_dir: &Path,
) {
    let world = places.len();
    let device = if places.first().is_some_and(|p| p.gpu) {
        "GPU"
    } else {
        "CPU"
    };
    let mut per_node: BTreeMap<String, usize> = BTreeMap::new();
    for p in places {
        *per_node.entry(format!("node {}", p.node)).or_default() += 1;
    }
    let layout = per_node
        .iter()
        .map(|(n, c)| format!("{n}: {c}"))
        .collect::<Vec<_>>()
        .join(", ");
    println!("plan:");
    println!(
        "  world       {world} {device} trainer(s) ({layout}); planned as {nodes} node(s) x {ranks_per_node}"
    );
    println!(
        "  threads     {} libtorch thread(s) per trainer, {} loader worker(s) each",
        places.first().map_or(0, |p| p.threads),
        job.data.workers
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
        if job.data.split { "split" } else { "resampled" }
    );
    println!(
        "  batch       {} per rank, {global_batch} global; lr {:.4} after linear scaling",
        job.optim.batch_size, job.optim.lr
    );
    println!("  epochs      {}", job.optim.epochs);
    println!("  run         {}", run_dir.display());
}

/// The metrics file: one JSON object per line, flushed as it goes.
struct Metrics {
    file: File,
    path: PathBuf,
}

impl Metrics {
    fn open(path: &Path) -> anyhow::Result<Self> {
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

    fn write(&mut self, value: &serde_json::Value) -> anyhow::Result<()> {
        writeln!(self.file, "{value}").with_context(|| format!("writing {}", self.path.display()))
    }
}

/// Watches the head's events for the job's trainers: any failure or stop we did not ask
/// for ends the job, naming the rank, node and cause.
struct FailureWatcher {
    failures: tokio::sync::mpsc::Receiver<String>,
    task: tokio::task::JoinHandle<()>,
}

impl FailureWatcher {
    fn start(client: ClusterClient, ranks: &[Rank]) -> Self {
        let by_id: BTreeMap<u64, (u32, NodeId)> = ranks
            .iter()
            .map(|r| (r.actor.id().0, (r.rank, r.place.node)))
            .collect();
        let (tx, failures) = tokio::sync::mpsc::channel(4);
        let task = tokio::spawn(async move {
            let mut after = 0;
            loop {
                let Ok(page) = client.events(after, Duration::from_secs(30)).await else {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                };
                for event in page.events {
                    after = after.max(event.seq);
                    if let Some((rank, node)) = by_id.get(&event.actor.0) {
                        let node = event.node.unwrap_or(*node);
                        let _ = tx
                            .send(format!(
                                "rank {rank} (node {node}) {}: {}",
                                event.kind, event.reason
                            ))
                            .await;
                    }
                }
            }
        });
        Self { failures, task }
    }

    /// Within `wait`, the failure of a rank that did not fail because a ring peer went
    /// away (a trainer that crashed, or one on a lost node), if the head reports one.
    async fn root_cause(&mut self, wait: Duration) -> Option<String> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let failure = tokio::time::timeout_at(deadline, self.failures.recv())
                .await
                .ok()??;
            if !failure.contains(actors::train::PEER_FAILURE) {
                return Some(failure);
            }
        }
    }

    async fn failure(&mut self) -> String {
        match self.failures.recv().await {
            Some(failure) => failure,
            None => std::future::pending().await,
        }
    }

    fn stop(&self) {
        self.task.abort();
    }
}

/// A job whose trainers are up and connected: what the step loop and its checkpoints
/// need.
struct RunningJob<'a> {
    config: &'a Config,
    job: &'a JobSpec,
    ranks: &'a [Rank],
    run_dir: &'a Path,
    steps_per_epoch: u64,
    nodes: u32,
    ranks_per_node: u32,
}

impl RunningJob<'_> {
    /// Has rank 0 write checkpoint `name`: the job at `global_step`, to continue at step
    /// `step_in_epoch` of `epoch` with the ranks' loader `cursors`.
    async fn save(
        &self,
        name: &str,
        epoch: u64,
        global_step: u64,
        step_in_epoch: u64,
        cursors: Vec<pipelines::RankCursor>,
    ) -> anyhow::Result<()> {
        let state = CheckpointState {
            epoch,
            global_step,
            step_in_epoch,
            world: self.ranks.len() as u32,
            nodes: self.nodes,
            ranks_per_node: self.ranks_per_node,
            cursors,
            model: self.job.model.kind.name().to_string(),
            classes: self.job.model.classes,
        };
        let root = std::fs::canonicalize(self.run_dir)
            .unwrap_or_else(|_| self.run_dir.to_path_buf())
            .join("checkpoints");
        let request = SaveRequest {
            root,
            name: name.to_string(),
            state,
        };
        let timeout = Duration::from_secs(self.config.train.step_timeout_secs.max(10));
        let rank0 = &self.ranks[0];
        let reply = rank0
            .actor
            .call("save", to_json(&request), timeout)
            .await
            .with_context(|| format!("{}: saving checkpoint {name}", rank0.name()))?;
        let path: PathBuf = serde_json::from_slice(&reply).context("save: bad reply")?;
        tracing::info!(path = %path.display(), "checkpoint saved");
        Ok(())
    }
}

impl RunningJob<'_> {
    /// Evaluates on the val shards (split across ranks) and records the result:
    /// `(top1, top5)`, or none without val samples.
    async fn evaluate(
        &self,
        epoch: u64,
        global_step: u64,
        metrics: &mut Metrics,
        elapsed_s: f64,
    ) -> anyhow::Result<Option<(f64, f64)>> {
        let timeout = Duration::from_secs(self.config.train.step_timeout_secs.max(10) * 6);
        let evals: Vec<EvalReply> =
            call_all(self.ranks, "evaluate", |_| b"{}".to_vec(), timeout).await?;
        let samples: u64 = evals.iter().map(|e| e.samples).sum();
        if samples == 0 {
            return Ok(None);
        }
        let n = samples as f64;
        let loss = evals.iter().map(|e| e.loss_sum).sum::<f64>() / n;
        let top1 = evals.iter().map(|e| e.top1).sum::<u64>() as f64 / n;
        let top5 = evals.iter().map(|e| e.top5).sum::<u64>() as f64 / n;
        metrics.write(&serde_json::json!({
            "kind": "eval", "epoch": epoch, "step": global_step, "loss": loss,
            "top1": top1, "top5": top5, "samples": samples, "elapsed_s": elapsed_s,
        }))?;
        Ok(Some((top1, top5)))
    }
}

/// The steps a call may run from `global_step`: at most `chunk`, and never past the next
/// multiple of any nonzero `every` (a checkpoint or an evaluation is due there).
fn steps_until(global_step: u64, chunk: u64, every: &[u64]) -> u64 {
    every
        .iter()
        .filter(|&&e| e > 0)
        .map(|e| e - global_step % e)
        .fold(chunk, u64::min)
}

async fn train_loop(
    run: &RunningJob<'_>,
    metrics: &mut Metrics,
    resume: Option<&ResumeFrom>,
) -> anyhow::Result<JobSummary> {
    let RunningJob {
        config,
        job,
        ranks,
        run_dir,
        steps_per_epoch,
        ..
    } = *run;
    let train = &config.train;
    let long = Duration::from_secs(train.step_timeout_secs.max(10));
    let started = Instant::now();
    let (first_epoch, mut step_in_epoch) = match resume {
        Some(r) => (r.state.epoch, r.state.step_in_epoch),
        None => (0, 0),
    };
    let mut summary = JobSummary {
        run_dir: run_dir.to_path_buf(),
        top1: None,
        top5: None,
        first_loss: None,
        last_loss: None,
        images_per_s: 0.0,
    };
    let mut global_step = resume.map_or(0, |r| r.state.global_step);
    let (mut total_images, mut total_train_s) = (0u64, 0.0f64);
    println!(
        "\n{:>5} {:>10} {:>8} {:>8} {:>9} {:>8} {:>10}",
        "epoch", "train loss", "val top1", "val top5", "time", "img/s", "data wait"
    );
    for epoch in first_epoch..job.optim.epochs {
        let bar = super::progress_bar(steps_per_epoch, &format!("epoch {epoch}"));
        bar.set_position(step_in_epoch);
        let epoch_started = Instant::now();
        let (mut loss_sum, mut loss_steps) = (0.0f64, 0u64);
        let (mut images, mut busy_s, mut wait_s) = (0u64, 0.0f64, 0.0f64);
        let mut chunk = 1u64;
        let mut done = false;
        while !done {
            let max_steps = steps_until(
                global_step,
                chunk,
                &[train.checkpoint_every_steps, train.eval_every_steps],
            );
            let request = TrainRequest { epoch, max_steps };
            let called = Instant::now();
            let replies: Vec<TrainReply> = call_all(
                ranks,
                "train",
                |_| to_json(&request),
                long + Duration::from_secs(60),
            )
            .await?;
            let elapsed = called.elapsed().as_secs_f64();
            let first = &replies[0];
            if let Some(bad) = replies.iter().position(|r| {
                r.step_in_epoch != first.step_in_epoch || r.epoch_done != first.epoch_done
            }) {
                bail!(
                    "ranks out of step: rank 0 at step {} of epoch {epoch}, rank {bad} at {}",
                    first.step_in_epoch,
                    replies[bad].step_in_epoch
                );
            }
            let samples: u64 = replies.iter().map(|r| r.samples).sum();
            let seconds = replies
                .iter()
                .map(|r| r.seconds)
                .fold(0.0, f64::max)
                .max(1e-9);
            let data_wait = replies
                .iter()
                .map(|r| r.data_wait_s / r.seconds.max(1e-9))
                .sum::<f64>()
                / replies.len() as f64;
            let allreduce =
                replies.iter().map(|r| r.allreduce_s).sum::<f64>() / replies.len() as f64;
            let steps = first.steps.len().max(1) as f64;
            for step in &first.steps {
                metrics.write(&serde_json::json!({
                    "kind": "step",
                    "epoch": epoch,
                    "step": step.step,
                    "loss": step.loss,
                    "accuracy": step.accuracy,
                    "lr": step.lr,
                    "samples": step.samples,
                    "images_per_s": samples as f64 / seconds,
                    "data_wait_s": data_wait * seconds / steps,
                    "allreduce_s": allreduce / steps,
                    "step_s": seconds / steps,
                    "elapsed_s": started.elapsed().as_secs_f64(),
                }))?;
                loss_sum += f64::from(step.loss);
                loss_steps += 1;
                summary.first_loss.get_or_insert(step.loss);
                summary.last_loss = Some(step.loss);
            }
            for reply in &replies {
                if reply.skipped > 0 && !reply.problems.is_empty() {
                    tracing::warn!(skipped = reply.skipped, first = %reply.problems[0], "bad samples skipped");
                }
            }
            images += samples;
            busy_s += elapsed;
            wait_s += data_wait * elapsed;
            global_step = first.global_step;
            step_in_epoch = first.step_in_epoch;
            done = first.epoch_done;
            bar.set_position(step_in_epoch);
            if let Some(last) = first.steps.last() {
                bar.set_message(format!(
                    "epoch {epoch} loss {:.3} {:.0} img/s",
                    last.loss,
                    samples as f64 / seconds
                ));
            }
            // Calls of about a second: progress stays live, and Ctrl-C or a failure is
            // noticed between calls.
            let per_step = elapsed / first.steps.len().max(1) as f64;
            chunk = ((1.0 / per_step.max(1e-4)) as u64).clamp(1, 1000);
            let due = |every: u64| !done && every > 0 && global_step % every == 0;
            if due(train.eval_every_steps) && !job.data.val.is_empty() {
                let elapsed_s = started.elapsed().as_secs_f64();
                if let Some(top) = run.evaluate(epoch, global_step, metrics, elapsed_s).await? {
                    bar.suspend(|| {
                        println!(
                            "      step {global_step}: val top-1 {:.2}%, top-5 {:.2}%",
                            top.0 * 100.0,
                            top.1 * 100.0
                        );
                    });
                }
            }
            if due(train.checkpoint_every_steps) {
                let cursors = replies.iter().filter_map(|r| r.cursor.clone()).collect();
                let name = format!("step-{global_step:08}");
                run.save(&name, epoch, global_step, step_in_epoch, cursors)
                    .await?;
            }
        }
        bar.finish_and_clear();
        let epoch_s = epoch_started.elapsed().as_secs_f64();
        total_images += images;
        total_train_s += busy_s;
        step_in_epoch = 0;
        let last_epoch = epoch + 1 == job.optim.epochs;
        let eval_due = !job.data.val.is_empty()
            && (last_epoch
                || (train.eval_every_epochs > 0 && (epoch + 1) % train.eval_every_epochs == 0));
        let mut top = (None, None);
        if eval_due {
            let elapsed_s = started.elapsed().as_secs_f64();
            if let Some((top1, top5)) = run.evaluate(epoch, global_step, metrics, elapsed_s).await?
            {
                top = (Some(top1), Some(top5));
                summary.top1 = Some(top1);
                summary.top5 = Some(top5);
            }
        }
        let train_loss = loss_sum / loss_steps.max(1) as f64;
        let images_per_s = images as f64 / busy_s.max(1e-9);
        let data_wait_fraction = wait_s / busy_s.max(1e-9);
        metrics.write(&serde_json::json!({
            "kind": "epoch", "epoch": epoch, "step": global_step, "train_loss": train_loss,
            "images_per_s": images_per_s, "data_wait_fraction": data_wait_fraction,
            "seconds": epoch_s, "elapsed_s": started.elapsed().as_secs_f64(),
        }))?;
        let pct = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{:.2}%", v * 100.0));
        println!(
            "{epoch:>5} {train_loss:>10.4} {:>8} {:>8} {:>8.1}s {images_per_s:>8.0} {:>9.1}%",
            pct(top.0),
            pct(top.1),
            epoch_s,
            data_wait_fraction * 100.0
        );
        let save_due = last_epoch
            || (train.checkpoint_every_epochs > 0
                && (epoch + 1) % train.checkpoint_every_epochs == 0);
        if save_due {
            let name = format!("epoch-{:04}", epoch + 1);
            run.save(&name, epoch + 1, global_step, 0, Vec::new())
                .await?;
        }
    }
    summary.images_per_s = total_images as f64 / total_train_s.max(1e-9);
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_spread_round_robin() {
        let cases: [(&[u32], u32, &[u32]); 5] = [
            (&[2, 2], 4, &[2, 2]),
            (&[2, 2], 3, &[2, 1]),
            (&[1, 4], 4, &[1, 3]),
            (&[8], 2, &[2]),
            (&[1, 1], 5, &[1, 1]),
        ];
        for (free, want, expect) in cases {
            assert_eq!(take_spread(free, want), expect, "{free:?} want {want}");
        }
    }

    #[test]
    fn calls_stop_at_every_due_step() {
        let cases: [(u64, u64, &[u64], u64); 5] = [
            (0, 100, &[0, 0], 100),
            (0, 100, &[7, 0], 7),
            (7, 100, &[7, 5], 3),
            (9, 2, &[7, 5], 1),
            (14, 100, &[7, 10], 6),
        ];
        for (step, chunk, every, want) in cases {
            assert_eq!(
                steps_until(step, chunk, every),
                want,
                "{step} {chunk} {every:?}"
            );
        }
    }
}
