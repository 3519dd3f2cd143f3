//! The job from spawning its trainers to the check of the replicas: the world, the run
//! folder, resume, the ring's wiring, and watching the trainers for failures while the
//! step loop runs.

use std::path::{Path, PathBuf};
use std::time::Duration;

use runtime::{ClusterClient, FailureOrigin, NodeId};

use super::calls::{agreed, call_all};
use super::elastic::{self, Regrouped, World};
use super::error::Saved;
use super::loaders;
use super::metrics::{Metrics, rewind};
use super::spawn::{Ring, preload, spawn_trainers};
use super::steps::{Grow, LoopEnd, Position, RunningJob, train_loop};
use super::stop::StopControl;
use super::watch::{FailureWatcher, head_lost};
use super::world::{RankPlace, Trainers, check_plan, plan_world};
use super::{Elastic, HeadLost, JobError, JobOutput, JobRequest, JobSettings, JobSummary};
use crate::train::{
    AllreduceChoice, AverageReply, AverageRequest, ConnectRecord, DigestReply, DigestRequest,
    JobRecord, JobSpec, ListenReply, ListenRequest, Loaders, MetricsRecord, ResumeFrom, SyncChoice,
    checkpoint, scaled_lr, secret_hex,
};

/// Runs the job of `request` on the cluster `client` reaches, telling `output` what
/// happens, until it ends, fails, or `stop` asks it to stop (then it saves a checkpoint
/// at its last completed step and fails with [`JobError::Interrupted`]). Every trainer
/// it spawns is in `trainers`, for the caller to stop whatever happened.
pub async fn run(
    client: &ClusterClient,
    request: JobRequest,
    output: &dyn JobOutput,
    stop: &StopControl,
    trainers: &Trainers,
) -> Result<JobSummary, JobError> {
    request.validate()?;
    let JobRequest {
        spec: mut job,
        settings,
        resume,
    } = request;
    let status = client
        .status()
        .await
        .map_err(JobError::cluster("asking for the cluster's status"))?;
    let (places, node_ranks) = plan_world(&status, &settings)?;
    if job.optim.allreduce == AllreduceChoice::Nccl && places.iter().any(|p| !p.gpu) {
        return Err(JobError::Refused(
            "train.allreduce = \"nccl\" needs CUDA trainers, and this job's trainers run on \
             CPUs (the cluster has no free GPU): use \"auto\" or \"ring\""
                .to_string(),
        ));
    }
    let world = places.len() as u32;
    let global_batch = job.optim.batch_size * u64::from(world);
    job.optim.lr = scaled_lr(settings.lr, global_batch, settings.reference_batch.max(1));
    check_plan(&job, &node_ranks)?;
    let resume = match &resume {
        Some(path) => Some(resume_from(path, &settings.runs_dir, output)?),
        None => None,
    };
    if let Some(r) = &resume
        && r.state.epoch >= job.optim.epochs
    {
        return Err(JobError::Refused(format!(
            "{} continues at epoch {} and train.epochs is {}: that run is complete. To \
             train on, raise train.epochs (`--epochs {}` or more)",
            r.dir.display(),
            r.state.epoch,
            job.optim.epochs,
            r.state.epoch + 1
        )));
    }
    let run_dir = match &resume {
        // A resumed run continues in its own folder: <run>/checkpoints/<name>.
        Some(r) => r
            .dir
            .parent()
            .and_then(Path::parent)
            .map(Path::to_path_buf)
            .ok_or_else(|| {
                JobError::Refused(format!(
                    "{}: checkpoint folder has no run folder",
                    r.dir.display()
                ))
            })?,
        None => new_run_dir(&settings)?,
    };
    std::fs::create_dir_all(&run_dir)
        .map_err(JobError::io(format!("creating {}", run_dir.display())))?;
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
    for line in plan_lines(
        &job,
        &places,
        &node_ranks,
        global_batch,
        settings.elastic,
        &run_dir,
    ) {
        output.info(line);
    }
    let metrics_path = run_dir.join("metrics.jsonl");
    if let Some(resume) = &resume {
        let dropped = rewind(&metrics_path, &resume.state)?;
        if dropped > 0 {
            output.info(format!(
                "metrics: {dropped} record(s) past the checkpoint dropped from {}",
                metrics_path.display()
            ));
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
    let ranks =
        spawn_trainers(client, trainers, &job, &job_name, &places, (&node_ranks, 0)).await?;
    stop.set_ranks(&ranks, client);
    let long = Duration::from_secs(settings.step_timeout_secs.max(10));
    if let Some(dir) = &job.data.sources.preload_dir {
        preload(&ranks, dir, output, long).await?;
    }
    let listens: Vec<ListenReply> = call_all(&ranks, |_| ListenRequest {}, long).await?;
    let steps_per_epoch = agreed(
        listens.iter().map(|l| l.steps_per_epoch),
        |first, bad, v| {
            format!(
                "ranks disagree on the epoch's length: rank 0 plans {first} steps, rank {bad} {v}"
            )
        },
    )?;
    output.info(format!(
        "trainers: {} up ({} parameters on {}); {} steps per epoch, {} in all",
        world, listens[0].parameters, listens[0].device, steps_per_epoch, listens[0].total_steps
    ));
    if job.data.loaders == Loaders::Remote {
        loaders::start(client, trainers, &job, &job_name, &ranks, output, long).await?;
    }
    let secret = runtime::RingSecret::random();
    let ring = Ring {
        secret: secret_hex(&secret),
        job_id: format!("{}", run_dir.display()),
        op_timeout_secs: settings.step_timeout_secs,
    };
    let connects = ring
        .wire(&job, &ranks, &listens, resume.clone(), false, long)
        .await?;
    output.info(match job.optim.sync {
        SyncChoice::Allreduce => format!(
            "ring: {world} ranks connected, {} gradient buckets; gradients averaged with {}",
            connects[0].buckets, connects[0].allreduce
        ),
        SyncChoice::Decentralized => format!(
            "ring and mixing groups: {world} ranks connected; gradient average: {}",
            connects[0].allreduce
        ),
    });
    metrics.write(&MetricsRecord::Connect(ConnectRecord {
        buckets: connects[0].buckets,
        allreduce: connects[0].allreduce.clone(),
    }))?;

    let mut world = World {
        ranks,
        node_ranks,
        steps_per_epoch,
    };
    let mut start = Position::resumed(resume.as_ref());
    let mut at = start.clone();
    let mut summary = JobSummary {
        run_dir: run_dir.clone(),
        top1: None,
        top5: None,
        first_loss: None,
        last_loss: None,
        images_per_s: 0.0,
    };
    let mut regrouped = None;
    let mut failures = 0u32;
    // An elastic job grows back up to the world it started with.
    let max_world = world.ranks.len();
    output.info(format!(
        "\n{:>5} {:>10} {:>8} {:>8} {:>9} {:>8} {:>10}",
        "epoch", "train loss", "val top1", "val top5", "time", "img/s", "data wait"
    ));
    // A loss found while the ring formed again, for the next turn to recover from.
    let mut pending: Option<JobError> = None;
    let loop_result = loop {
        stop.set_ranks(&world.ranks, client);
        let mut watcher = FailureWatcher::start(client.clone(), &world.ranks);
        // As the ranks hold it in this loop (a regroup or a growth changes `job` after).
        let job_now = job.clone();
        let running = RunningJob {
            settings: &settings,
            job: &job_now,
            ranks: &world.ranks,
            run_dir: &run_dir,
            steps_per_epoch: world.steps_per_epoch,
            node_ranks: &world.node_ranks,
            stop,
            output,
            regrouped,
            grow: settings.elastic.map(|_| Grow { client, max_world }),
        };
        let result = match pending.take() {
            Some(error) => Err(error),
            None => tokio::select! {
                result = train_loop(&running, &mut metrics, &start, &mut at, &mut summary) => result,
                failure = watcher.failure() => Err(JobError::RankFailed(failure)),
            },
        };
        let error = match (result, settings.elastic) {
            (Ok(LoopEnd::Done), _) => {
                watcher.stop();
                break Ok(());
            }
            (Ok(LoopEnd::Grow(places)), _) => {
                watcher.stop();
                let seen = std::time::Instant::now();
                let old_lr = job.optim.lr;
                let context = (client, trainers, job_name.as_str());
                let grown =
                    match elastic::grow(context, &mut job, &settings, &world, &places, &at).await {
                        Ok(grown) => grown,
                        // The old ranks hold the model at `at`, an epoch's end.
                        Err(error) => break Err(running.checkpoint_after_loss(error, &at).await),
                    };
                let (new_world, listens, mut record) = grown;
                let wired = ring.wire(&job, &new_world.ranks, &listens, None, true, long);
                if let Err(error) = wired.await {
                    break Err(running.checkpoint_after_loss(error, &at).await);
                }
                record.recovery_s = seen.elapsed().as_secs_f64();
                output.warn(elastic::regroup_line(&record, world.ranks.len(), old_lr));
                metrics.write(&MetricsRecord::Regroup(record))?;
                world = new_world;
                start = at.clone();
                regrouped = None;
                continue;
            }
            (Err(error), Some(elastic)) => {
                let seen = std::time::Instant::now();
                let found =
                    elastic::find_losses(client, &world, &at, error, &mut watcher, &settings).await;
                match found {
                    Err(error) => error,
                    Ok(losses) => {
                        watcher.stop();
                        let found_s = seen.elapsed().as_secs_f64();
                        failures += losses.lost.len() as u32;
                        let old_lr = job.optim.lr;
                        let regrouping =
                            elastic::regroup(&job, &settings, elastic, &losses, &at, failures)
                                .await;
                        let mut regrouped_world = match regrouping {
                            Ok(regrouped) => regrouped,
                            Err(error) => {
                                // The survivors hold the model at `at`, in the old world.
                                let survivors = RunningJob {
                                    ranks: &losses.survivors,
                                    ..running
                                };
                                break Err(survivors.checkpoint_after_loss(error, &at).await);
                            }
                        };
                        let record = &mut regrouped_world.record;
                        job.optim.lr = record.lr;
                        let new_ranks = &regrouped_world.world.ranks;
                        let listens = &regrouped_world.listens;
                        let wired = ring.wire(&job, new_ranks, listens, None, true, long).await;
                        record.found_s = found_s;
                        record.recovery_s = seen.elapsed().as_secs_f64();
                        match &wired {
                            Ok(_) => output.warn(elastic::regroup_line(
                                record,
                                world.ranks.len(),
                                old_lr,
                            )),
                            Err(error) => output.warn(format!(
                                "elastic: lost rank(s) {:?} ({}); the {} others lost another \
                                 while they formed their ring again: {error}",
                                record.lost, record.cause, record.world
                            )),
                        }
                        metrics.write(&MetricsRecord::Regroup(record.clone()))?;
                        let Regrouped {
                            world: new_world,
                            epoch_steps,
                            at: new_at,
                            ..
                        } = regrouped_world;
                        if !new_at.cursors.is_empty() {
                            regrouped = Some((new_at.epoch, epoch_steps));
                        }
                        world = new_world;
                        at = new_at;
                        start = at.clone();
                        // The new world's ranks hold the model at `at`: whom it lost is
                        // found as after any failure.
                        pending = wired.err();
                        continue;
                    }
                }
            }
            (Err(error), None) => error,
        };
        break Err(explain_failure(client, error, &mut watcher, &settings).await);
    };
    let mut summary = loop_result.map(|()| summary).map_err(|error| {
        if error.is_head_gone() {
            JobError::HeadLost(Box::new(HeadLost {
                message: error.to_string(),
                progress: stop.progress().clone(),
            }))
        } else {
            error
        }
    })?;

    let ranks = &world.ranks;
    let world = ranks.len();
    if job.optim.sync == SyncChoice::Decentralized {
        let averaged: Vec<AverageReply> = call_all(ranks, |_| AverageRequest {}, long).await?;
        let spread = averaged.iter().map(|a| a.distance).fold(0.0, f64::max);
        output.info(format!(
            "replicas: each replaced by the mean of all {world} (the farthest was {spread:.4} \
             from it), the model the last evaluation and checkpoint hold"
        ));
    }
    let digests: Vec<DigestReply> = call_all(ranks, |_| DigestRequest {}, long).await?;
    if digests.iter().any(|d| d.sha256 != digests[0].sha256) {
        return Err(JobError::Refused(format!(
            "the replicas differ after training: {}",
            digests
                .iter()
                .enumerate()
                .map(|(r, d)| format!("rank {r} {}", &d.sha256[..12]))
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    output.info(format!(
        "replicas: identical on all {world} ranks (sha256 {})",
        &digests[0].sha256[..16]
    ));
    summary.run_dir = run_dir;
    Ok(summary)
}

/// The error a failed step loop ends the job with: the head's loss when the head is
/// gone, else the rank that failed first (the head's events name it once it noticed;
/// the first error is often a healthy rank seeing its ring peer go away).
async fn explain_failure(
    client: &ClusterClient,
    error: JobError,
    watcher: &mut FailureWatcher,
    settings: &JobSettings,
) -> JobError {
    let lost_head = if error.interrupted().is_none() && !error.is_head_gone() {
        head_lost(client).await
    } else {
        None
    };
    let explained = match lost_head {
        // Without the head the job cannot go on, whatever the ranks saw first.
        Some(lost) => JobError::HeadGone(format!("{lost}\n  (the trainers saw: {error})")),
        // A lost node takes `dead_after_ms` to be named.
        None if error.failure_origin() == Some(FailureOrigin::Elsewhere) => {
            let wait = Duration::from_millis(settings.dead_after_ms + 2000);
            match watcher.root_cause(wait).await {
                Some(cause) => JobError::Refused(format!("{cause}\n  (then: {error})")),
                None => error,
            }
        }
        None => error,
    };
    watcher.stop();
    explained
}

fn resume_from(
    path: &Path,
    runs_dir: &Path,
    output: &dyn JobOutput,
) -> Result<ResumeFrom, JobError> {
    let path = if path == Path::new("latest") {
        newest_run(runs_dir)?
    } else {
        path.to_path_buf()
    };
    let dir = checkpoint::resolve(&path)?;
    let state = checkpoint::read_state(&dir)?;
    let dir = std::fs::canonicalize(&dir).map_err(JobError::io(dir.display().to_string()))?;
    output.info(format!(
        "resuming: {} (epoch {}, step {} of the epoch, global step {})",
        dir.display(),
        state.epoch,
        state.step_in_epoch,
        state.global_step
    ));
    Ok(ResumeFrom { dir, state })
}

/// The most recently modified run folder with a checkpoint.
pub fn newest_run(runs: &Path) -> Result<PathBuf, JobError> {
    let entries = std::fs::read_dir(runs).map_err(JobError::io(format!(
        "--resume latest: reading {}",
        runs.display()
    )))?;
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
        .ok_or_else(|| {
            JobError::Refused(format!(
                "--resume latest: no run in {} has a checkpoint",
                runs.display()
            ))
        })
}

fn new_run_dir(train: &JobSettings) -> Result<PathBuf, JobError> {
    let name = if train.name.is_empty() {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        format!("run-{now}")
    } else {
        train.name.clone()
    };
    let dir = train.runs_dir.join(name);
    if dir
        .join("checkpoints")
        .join(checkpoint::LATEST_FILE)
        .exists()
    {
        return Err(JobError::Refused(format!(
            "{} already holds a run: choose another --name, or continue it with --resume {}",
            dir.display(),
            dir.display()
        )));
    }
    Ok(dir)
}

/// The job's plan, as `imgrun train` prints it before anything starts.
fn plan_lines(
    job: &JobSpec,
    places: &[RankPlace],
    node_ranks: &[u32],
    global_batch: u64,
    elastic: Option<Elastic>,
    run_dir: &Path,
) -> Vec<String> {
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
    let mut lines = vec![
        "plan:".to_string(),
        format!(
            "  world       {world} {device} trainer(s) on {}: {} ({})",
            names.join(", "),
            shape.layout(),
            if shape.nodes() > 1 {
                "ranks numbered node by node"
            } else {
                "one node"
            }
        ),
        format!(
            "  threads     {} libtorch thread(s) per trainer, {} loader worker(s) each{}",
            places.first().map_or(0, |p| p.threads),
            job.data.loader_workers,
            match job.data.loaders {
                Loaders::Local => "",
                Loaders::Remote => " in loader actors",
            }
        ),
        format!(
            "  model       {} ({} classes)",
            job.model.kind.name(),
            job.model.classes
        ),
        format!(
            "  data        {} train shard(s){}, {} val shard(s), {} mode",
            job.data.train.urls.len(),
            job.data
                .train
                .total()
                .map(|t| format!(" ({t} samples)"))
                .unwrap_or_default(),
            job.data.val.urls.len(),
            job.data.mode.name()
        ),
        format!(
            "  batch       {} per rank, {global_batch} global; lr {:.4} after linear scaling",
            job.optim.batch_size, job.optim.lr
        ),
        format!("  epochs      {}", job.optim.epochs),
    ];
    lines.extend(sync_lines(job.optim.sync, job.optim.topology, node_ranks));
    lines.push(elastic_line(elastic));
    lines.push(format!("  run         {}", run_dir.display()));
    lines
}

/// What a job does when it loses trainers (`train.elastic`), as the plans print it.
pub fn elastic_line(elastic: Option<Elastic>) -> String {
    match elastic {
        None => "  elastic     off: a lost trainer fails the job (continue it with --resume)"
            .to_string(),
        Some(elastic) => format!(
            "  elastic     on: the others go on without a lost trainer, down to {} rank(s), \
             for up to {} loss(es)",
            elastic.min_world, elastic.max_failures
        ),
    }
}

/// How the replicas are kept together, as the plans print it: for a decentralized job,
/// its topology's groups over one period of steps (at most 8 lines).
pub fn sync_lines(
    sync: SyncChoice,
    topology: runtime::Topology,
    node_ranks: &[u32],
) -> Vec<String> {
    if sync == SyncChoice::Allreduce {
        return vec!["  sync        allreduce of gradients every step".to_string()];
    }
    let nodes = runtime::node_of_each_rank(node_ranks);
    let steps = topology.describe(&nodes);
    let mut lines = vec![format!(
        "  sync        decentralized, {topology} topology; the groups repeat every {} step(s):",
        steps.len()
    )];
    const SHOWN: usize = 8;
    for step in steps.iter().take(SHOWN) {
        lines.push(format!("                {step}"));
    }
    if steps.len() > SHOWN {
        lines.push(format!("                ... {} more", steps.len() - SHOWN));
    }
    lines
}
