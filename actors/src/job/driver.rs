//! The job from its cluster to the check of its replicas: the world and the run folder
//! made (or resumed), the trainers spawned, preloaded and wired into a ring, then the
//! step loop, and after each of its ends what the job's [`Recovery`] decides (finish,
//! explain a failure, shrink after a loss, grow into room), carried out here with the
//! calls of `elastic.rs`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use runtime::{ClusterClient, FailureOrigin, NodeId};

use super::calls::{RankHandle, agreed, call_all};
use super::elastic::{self, Losses, Regrouped, World};
use super::error::Saved;
use super::loader_actors;
use super::metrics::{Metrics, rewind};
use super::recovery::{Action, Event, GiveUp, Recovery};
use super::spawn::{Ring, preload, spawn_trainers};
use super::steps::{Grow, LoopEnd, Position, RunningJob, train_loop};
use super::stop::StopControl;
use super::watch::{FailureWatcher, head_lost};
use super::world::{RankPlace, Trainers, check_plan, plan_world};
use super::{
    Elastic, HeadLost, JobError, JobEvent, JobOutput, JobRequest, JobSettings, JobSummary, Moment,
};
use crate::train::{
    AllreduceChoice, AverageReply, AverageRequest, ConnectRecord, DigestReply, DigestRequest,
    JobRecord, JobSpec, ListenReply, ListenRequest, Loaders, MetricsRecord, Precision,
    RegroupRecord, ResumeFrom, SyncChoice, checkpoint, checkpoint_store, scaled_lr, secret_hex,
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
        mut settings,
        resume,
    } = request;
    let planned = plan(client, &mut job, &settings).await?;
    let resume = match &resume {
        Some(path) => Some(resume_from(path, &mut settings, &job, output).await?),
        None => None,
    };
    if let Some(store) = settings.checkpoint_store.clone() {
        let options = job.data.sources.s3.clone();
        off_runtime(move || checkpoint_store::check(&store, &options))
            .await?
            .map_err(|error| JobError::Refused(format!("train.checkpoint_store: {error}")))?;
    }
    let run_dir = open_run_dir(resume.as_ref(), &settings, stop)?;
    output.run_folder(&run_dir);
    for line in plan_lines(&job, &planned, settings.elastic, &run_dir) {
        output.info(line);
    }
    let metrics = open_metrics(&run_dir, &job, &planned, resume.as_ref(), output)?;
    let job_name = run_dir.file_name().map_or_else(
        || run_dir.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let driver = Driver {
        client,
        trainers,
        settings: &settings,
        stop,
        output,
        ring: Ring {
            secret: secret_hex(&runtime::RingSecret::random()),
            id: format!("{}", run_dir.display()),
            op_timeout_secs: settings.step_timeout_secs,
        },
        job_name,
        run_dir,
        long: Duration::from_secs(settings.step_timeout_secs.max(10)),
        max_world_size: planned.places.len(),
    };
    let mut turn = driver.start(job, planned, resume, metrics).await?;
    let result = driver.drive(&mut turn).await.map_err(|error| {
        if error.is_head_gone() {
            JobError::HeadLost(Box::new(HeadLost {
                message: error.to_string(),
                progress: stop.progress().clone(),
            }))
        } else {
            error
        }
    });
    result?;
    check_replicas(&turn.job, &turn.world.ranks, output, driver.long).await?;
    let mut summary = turn.summary;
    summary.run_dir = driver.run_dir;
    Ok(summary)
}

/// The world a job gets: where its ranks run, how many on each node, its global batch.
struct Planned {
    places: Vec<RankPlace>,
    node_ranks: Vec<u32>,
    global_batch: u64,
}

/// Sizes the job's world on the cluster as it is now, scales `job`'s learning rate to
/// its global batch, and plans its first epoch, refusing what cannot run.
async fn plan(
    client: &ClusterClient,
    job: &mut JobSpec,
    settings: &JobSettings,
) -> Result<Planned, JobError> {
    let status = client
        .status()
        .await
        .map_err(JobError::cluster("asking for the cluster's status"))?;
    let (places, node_ranks) = plan_world(&status, settings)?;
    if job.optim.allreduce == AllreduceChoice::Nccl && places.iter().any(|p| !p.gpu) {
        return Err(JobError::Refused(
            "train.allreduce = \"nccl\" needs CUDA trainers, and this job's trainers run on \
             CPUs (the cluster has no free GPU): use \"auto\" or \"ring\""
                .to_string(),
        ));
    }
    let global_batch = job.optim.batch_size * places.len() as u64;
    job.optim.lr = scaled_lr(settings.lr, global_batch, settings.reference_batch.max(1));
    check_plan(job, &node_ranks)?;
    Ok(Planned {
        places,
        node_ranks,
        global_batch,
    })
}

/// The run folder, made: a resumed run continues in its own (`<run>/checkpoints/<name>`),
/// a new one gets one of its own. `stop`'s progress names it and the checkpoint resumed.
fn open_run_dir(
    resume: Option<&ResumeFrom>,
    settings: &JobSettings,
    stop: &StopControl,
) -> Result<PathBuf, JobError> {
    let run_dir = match resume {
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
        None => new_run_dir(settings)?,
    };
    std::fs::create_dir_all(&run_dir)
        .map_err(JobError::io(format!("creating {}", run_dir.display())))?;
    let mut progress = stop.progress();
    progress.run_dir = Some(run_dir.clone());
    progress.checkpoint = resume.map(|r| Saved {
        dir: r.dir.clone(),
        epoch: r.state.epoch,
        global_step: r.state.global_step,
        step_in_epoch: r.state.step_in_epoch,
        seconds: None,
        store_run: None,
    });
    Ok(run_dir)
}

/// The run's `metrics.jsonl`, rewound to the checkpoint a resumed run continues from, with
/// the job's record added.
fn open_metrics(
    run_dir: &Path,
    job: &JobSpec,
    planned: &Planned,
    resume: Option<&ResumeFrom>,
    output: &dyn JobOutput,
) -> Result<Metrics, JobError> {
    let metrics_path = run_dir.join("metrics.jsonl");
    if let Some(resume) = resume {
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
        world: Some(planned.places.len() as u32),
        nodes: Some(planned.node_ranks.len() as u32),
        node_ranks: planned.node_ranks.clone(),
        model: Some(job.model.kind.name().to_string()),
        classes: Some(job.model.classes),
        global_batch: Some(planned.global_batch),
        lr: Some(job.optim.lr),
        epochs: Some(job.optim.epochs),
        resumed_from: resume.map(|r| r.dir.display().to_string()),
        // `imgrun plot` drops what an earlier run wrote past this point.
        resumed_at_step: resume.map(|r| r.state.global_step),
        resumed_epoch: resume.map(|r| r.state.epoch),
    }))?;
    Ok(metrics)
}

/// The end of a job that trained: a decentralized job's replicas become their mean,
/// then every rank's digest must be the same.
async fn check_replicas(
    job: &JobSpec,
    ranks: &[RankHandle],
    output: &dyn JobOutput,
    long: Duration,
) -> Result<(), JobError> {
    let world_size = ranks.len();
    if job.optim.sync == SyncChoice::Decentralized {
        let averaged: Vec<AverageReply> = call_all(ranks, |_| AverageRequest {}, long).await?;
        let spread = averaged.iter().map(|a| a.distance).fold(0.0, f64::max);
        output.info(format!(
            "replicas: each replaced by the mean of all {world_size} (the farthest was {spread:.4} \
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
        "replicas: identical on all {world_size} ranks (sha256 {})",
        &digests[0].sha256[..16]
    ));
    Ok(())
}

/// A job whose run folder is made: what starts its world and carries out what its
/// [`Recovery`] decides.
struct Driver<'a> {
    client: &'a ClusterClient,
    trainers: &'a Trainers,
    settings: &'a JobSettings,
    stop: &'a StopControl,
    output: &'a dyn JobOutput,
    ring: Ring,
    job_name: String,
    run_dir: PathBuf,
    long: Duration,
    /// An elastic job grows back up to the world it started with.
    max_world_size: usize,
}

/// Where the job stands between its recovery's actions, and what the next one works
/// on.
struct Turn {
    /// The job as its ranks hold it (a regroup or a growth changes its learning rate).
    job: JobSpec,
    world: World,
    metrics: Metrics,
    /// Where the next step loop starts, and where the last one got to.
    start: Position,
    at: Position,
    summary: JobSummary,
    /// The epoch the job regrouped in, and its steps in the smaller world.
    regrouped: Option<(u64, u64)>,
    /// The head's events for `world`'s ranks.
    watcher: Option<FailureWatcher>,
    /// The failure being recovered from or explained.
    error: Option<JobError>,
    losses: Option<Losses>,
    /// The room the step loop found.
    places: Vec<RankPlace>,
    /// A new world, before its ring is wired.
    next: Option<NextWorld>,
    /// When the failure or the room was seen, and how long finding the losses took.
    seen: Instant,
    found_s: f64,
    /// The learning rate before the world changed.
    old_lr: f64,
}

/// A world the job changes into, before its ring is wired.
enum NextWorld {
    Shrunk(Regrouped),
    Grown {
        world: World,
        listens: Vec<ListenReply>,
        record: RegroupRecord,
    },
}

impl Driver<'_> {
    /// Spawns the job's first world on `planned`'s places, has its nodes preload, starts
    /// remote loaders and wires its ring.
    async fn start(
        &self,
        job: JobSpec,
        planned: Planned,
        resume: Option<ResumeFrom>,
        mut metrics: Metrics,
    ) -> Result<Turn, JobError> {
        let (output, long) = (self.output, self.long);
        let Planned {
            places, node_ranks, ..
        } = planned;
        let world_size = places.len();
        let first = (&node_ranks[..], 0);
        let ranks = spawn_trainers(
            self.client,
            self.trainers,
            &job,
            &self.job_name,
            &places,
            first,
        )
        .await?;
        self.stop.set_ranks(&ranks, self.client);
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
            world_size,
            listens[0].parameters,
            listens[0].device,
            steps_per_epoch,
            listens[0].total_steps
        ));
        if job.data.loaders == Loaders::Remote {
            let name = &self.job_name;
            loader_actors::start(self.client, self.trainers, &job, name, &ranks, output, long)
                .await?;
        }
        let wired = self
            .ring
            .wire(&job, &ranks, &listens, resume.clone(), false, long);
        let connects = wired.await?;
        output.event(JobEvent::Moment {
            moment: Moment::Started {
                world: world_size as u32,
            },
        });
        output.info(match job.optim.sync {
            SyncChoice::Allreduce => format!(
                "ring: {world_size} ranks connected, {} gradient buckets; gradients averaged \
                 with {}",
                connects[0].buckets, connects[0].allreduce
            ),
            SyncChoice::Decentralized => format!(
                "ring and mixing groups: {world_size} ranks connected; gradient average: {}",
                connects[0].allreduce
            ),
        });
        metrics.write(&MetricsRecord::Connect(ConnectRecord {
            buckets: connects[0].buckets,
            allreduce: connects[0].allreduce.clone(),
        }))?;
        let start = Position::resumed(resume.as_ref());
        Ok(Turn {
            job,
            world: World {
                ranks,
                node_ranks,
                steps_per_epoch,
            },
            metrics,
            at: start.clone(),
            start,
            summary: JobSummary {
                run_dir: self.run_dir.clone(),
                top1: None,
                top5: None,
                first_loss: None,
                last_loss: None,
                images_per_s: 0.0,
            },
            regrouped: None,
            watcher: None,
            error: None,
            losses: None,
            places: Vec::new(),
            next: None,
            seen: Instant::now(),
            found_s: 0.0,
            old_lr: 0.0,
        })
    }

    /// Runs the step loop, and what the job's [`Recovery`] says after each of its ends,
    /// until the job is done or fails.
    async fn drive(&self, turn: &mut Turn) -> Result<(), JobError> {
        let mut recovery = Recovery::new(self.settings.elastic, turn.world.ranks.len() as u32);
        self.output.info(format!(
            "\n{:>5} {:>10} {:>8} {:>8} {:>9} {:>8} {:>10}",
            "epoch", "train loss", "val top1", "val top5", "time", "img/s", "data wait"
        ));
        let mut action = Action::Train;
        loop {
            let event = match action {
                Action::Train => self.train(turn).await,
                Action::FindLosses => self.find_losses(turn).await,
                Action::Regroup => self.regroup(turn).await,
                Action::Grow => self.grow(turn).await,
                Action::Wire => self.wire(turn).await?,
                Action::Finish => return Ok(()),
                Action::Explain => return Err(self.explain(turn).await),
                Action::GiveUp(why) => return Err(self.give_up(turn, why).await),
            };
            action = recovery
                .on(event)
                .map_err(|stray| JobError::Refused(stray.to_string()))?;
        }
    }

    /// The step loop over the job's world, from `turn.start`, under a new watcher.
    async fn train(&self, turn: &mut Turn) -> Event {
        if let Some(old) = turn.watcher.take() {
            old.stop();
        }
        self.stop.set_ranks(&turn.world.ranks, self.client);
        let mut watcher = FailureWatcher::start(self.client.clone(), &turn.world.ranks);
        let running = self.running(&turn.job, &turn.world, &turn.world.ranks, turn.regrouped);
        let (metrics, summary) = (&mut turn.metrics, &mut turn.summary);
        let result = tokio::select! {
            result = train_loop(&running, metrics, &turn.start, &mut turn.at, summary) => result,
            failure = watcher.failure() => Err(JobError::RankFailed(failure)),
        };
        match result {
            Ok(LoopEnd::Done) => {
                watcher.stop();
                Event::LoopDone
            }
            Ok(LoopEnd::Grow(places)) => {
                watcher.stop();
                turn.seen = Instant::now();
                turn.places = places;
                Event::RoomFound
            }
            Err(error) => {
                turn.watcher = Some(watcher);
                turn.error = Some(error);
                Event::LoopFailed
            }
        }
    }

    /// After a failure: the ranks it lost, and the survivors rolled back to `turn.at`.
    async fn find_losses(&self, turn: &mut Turn) -> Event {
        turn.seen = Instant::now();
        let error = take_error(turn);
        let mut watcher = self.watcher(turn);
        let (world, at) = (&turn.world, &turn.at);
        let found =
            elastic::find_losses(self.client, world, at, error, &mut watcher, self.settings).await;
        match found {
            Err(error) => {
                turn.watcher = Some(watcher);
                turn.error = Some(error);
                Event::NoLoss
            }
            Ok(losses) => {
                watcher.stop();
                turn.found_s = turn.seen.elapsed().as_secs_f64();
                self.output.event(JobEvent::Moment {
                    moment: Moment::Lost {
                        ranks: losses.lost_ranks(),
                        cause: losses
                            .lost
                            .iter()
                            .map(|(rank, why)| format!("rank {rank}: {why}"))
                            .collect::<Vec<_>>()
                            .join("; "),
                    },
                });
                let event = Event::Lost {
                    lost: losses.lost.len() as u32,
                    survivors: losses.survivors.len() as u32,
                };
                turn.losses = Some(losses);
                event
            }
        }
    }

    /// The survivors of `turn.losses` as a smaller world, before its ring is wired.
    async fn regroup(&self, turn: &mut Turn) -> Event {
        turn.old_lr = turn.job.optim.lr;
        let regrouped = match &turn.losses {
            Some(losses) => elastic::regroup(&turn.job, self.settings, losses, &turn.at).await,
            None => Err(JobError::Refused(
                "the job's recovery has no losses to regroup after".to_string(),
            )),
        };
        match regrouped {
            Ok(regrouped) => {
                let world = regrouped.world.ranks.len() as u32;
                turn.next = Some(NextWorld::Shrunk(regrouped));
                Event::Changed { world_size: world }
            }
            Err(error) => {
                turn.error = Some(error);
                Event::ChangeFailed
            }
        }
    }

    /// The job's world grown onto `turn.places`, before its ring is wired.
    async fn grow(&self, turn: &mut Turn) -> Event {
        turn.old_lr = turn.job.optim.lr;
        let context = (self.client, self.trainers, self.job_name.as_str());
        let places = std::mem::take(&mut turn.places);
        let (job, world, at) = (&mut turn.job, &turn.world, &turn.at);
        match elastic::grow(context, job, self.settings, world, &places, at).await {
            Ok((world, listens, record)) => {
                let n = world.ranks.len() as u32;
                turn.next = Some(NextWorld::Grown {
                    world,
                    listens,
                    record,
                });
                Event::Changed { world_size: n }
            }
            Err(error) => {
                turn.error = Some(error);
                Event::ChangeFailed
            }
        }
    }

    /// Wires the ring of the new world; once it formed, the job goes on in it.
    async fn wire(&self, turn: &mut Turn) -> Result<Event, JobError> {
        let (world, listens, mut record) = match turn.next.take() {
            Some(NextWorld::Shrunk(regrouped)) => return self.wire_shrunk(turn, regrouped).await,
            Some(NextWorld::Grown {
                world,
                listens,
                record,
            }) => (world, listens, record),
            None => {
                return Err(JobError::Refused(
                    "the job's recovery has no new world to wire".to_string(),
                ));
            }
        };
        let wired = self
            .ring
            .wire(&turn.job, &world.ranks, &listens, None, true, self.long);
        if let Err(error) = wired.await {
            turn.error = Some(error);
            return Ok(Event::WireFailed);
        }
        record.recovery_s = turn.seen.elapsed().as_secs_f64();
        let line = elastic::regroup_line(&record, turn.world.ranks.len(), turn.old_lr);
        self.output.warn(line);
        self.output
            .event(regroup_moment(&record, turn.world.ranks.len()));
        turn.metrics.write(&MetricsRecord::Regroup(record))?;
        turn.world = world;
        turn.start = turn.at.clone();
        turn.regrouped = None;
        Ok(Event::Wired)
    }

    /// Wires the ring of the survivors' world: the job goes on in it at the position its
    /// ranks hold, even when the ring did not form (whom it lost is then found as after
    /// any failure).
    async fn wire_shrunk(&self, turn: &mut Turn, regrouped: Regrouped) -> Result<Event, JobError> {
        let mut regrouped = regrouped;
        let record = &mut regrouped.record;
        turn.job.optim.lr = record.lr;
        let new_ranks = &regrouped.world.ranks;
        let listens = &regrouped.listens;
        let wired = self
            .ring
            .wire(&turn.job, new_ranks, listens, None, true, self.long);
        let wired = wired.await;
        record.found_s = turn.found_s;
        record.recovery_s = turn.seen.elapsed().as_secs_f64();
        let old_world_size = turn.world.ranks.len();
        if wired.is_ok() {
            self.output.event(regroup_moment(record, old_world_size));
        }
        self.output.warn(match &wired {
            Ok(_) => elastic::regroup_line(record, old_world_size, turn.old_lr),
            Err(error) => format!(
                "elastic: lost rank(s) {:?} ({}); the {} others lost another while they \
                 formed their ring again: {error}",
                record.lost, record.cause, record.world
            ),
        });
        turn.metrics
            .write(&MetricsRecord::Regroup(record.clone()))?;
        let Regrouped {
            world,
            epoch_steps,
            at,
            ..
        } = regrouped;
        if !at.cursors.is_empty() {
            turn.regrouped = Some((at.epoch, epoch_steps));
        }
        turn.world = world;
        turn.at = at;
        turn.start = turn.at.clone();
        turn.losses = None;
        Ok(match wired {
            Ok(_) => Event::Wired,
            Err(error) => {
                turn.error = Some(error);
                Event::WireFailed
            }
        })
    }

    /// The job's error for the failure in `turn`, explained ([`explain_failure`]).
    async fn explain(&self, turn: &mut Turn) -> JobError {
        let error = take_error(turn);
        let mut watcher = self.watcher(turn);
        explain_failure(self.client, error, &mut watcher, self.settings).await
    }

    /// The job's error when it gives up for `why`, with a checkpoint at `turn.at`, where
    /// the ranks that hold the model stand (the survivors, after a loss).
    async fn give_up(&self, turn: &mut Turn, why: GiveUp) -> JobError {
        let beyond = turn.losses.as_ref().and_then(|losses| losses.beyond(why));
        let error = beyond.unwrap_or_else(|| take_error(turn));
        let ranks = match &turn.losses {
            Some(losses) => &losses.survivors,
            None => &turn.world.ranks,
        };
        let running = self.running(&turn.job, &turn.world, ranks, turn.regrouped);
        running.checkpoint_after_loss(error, &turn.at).await
    }

    /// The watcher of the job's world now: the one that saw its failure, or, for a world
    /// that has none yet, a new one (with the world's ranks shown to the hang doctor).
    fn watcher(&self, turn: &mut Turn) -> FailureWatcher {
        turn.watcher.take().unwrap_or_else(|| {
            self.stop.set_ranks(&turn.world.ranks, self.client);
            FailureWatcher::start(self.client.clone(), &turn.world.ranks)
        })
    }

    /// The running job of `world` (as `ranks` hold it) for the step loop and its
    /// checkpoints.
    fn running<'b>(
        &'b self,
        job: &'b JobSpec,
        world: &'b World,
        ranks: &'b [RankHandle],
        regrouped: Option<(u64, u64)>,
    ) -> RunningJob<'b> {
        RunningJob {
            settings: self.settings,
            job,
            ranks,
            run_dir: &self.run_dir,
            steps_per_epoch: world.steps_per_epoch,
            node_ranks: &world.node_ranks,
            stop: self.stop,
            output: self.output,
            regrouped,
            grow: self.settings.elastic.map(|_| Grow {
                client: self.client,
                max_world_size: self.max_world_size,
            }),
        }
    }
}

/// The failure `turn` recovers from or explains.
fn take_error(turn: &mut Turn) -> JobError {
    turn.error.take().unwrap_or_else(|| {
        JobError::Refused("the job's recovery has no failure to report".to_string())
    })
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

/// The checkpoint `path` names (`latest`: the newest run's in the runs folder; a store's
/// URL: see [`from_store`]), refused when its run is complete for `job`.
async fn resume_from(
    path: &Path,
    settings: &mut JobSettings,
    job: &JobSpec,
    output: &dyn JobOutput,
) -> Result<ResumeFrom, JobError> {
    let mut store = None;
    let path = if path == Path::new("latest") {
        newest_run(&settings.runs_dir)?
    } else if let Some(url) = path.to_str().filter(|p| checkpoint_store::is_store_url(p)) {
        let found = from_store(url, &settings.runs_dir, job, output).await?;
        // The resumed run goes on saving to the store it came from, unless told another.
        settings
            .checkpoint_store
            .get_or_insert_with(|| found.store.clone());
        store = Some(found.url.clone());
        settings.runs_dir.join(&found.run).join("checkpoints")
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
    if state.epoch >= job.optim.epochs {
        return Err(JobError::Refused(format!(
            "{} continues at epoch {} and train.epochs is {}: that run is complete. To \
             train on, raise train.epochs (`--epochs {}` or more)",
            dir.display(),
            state.epoch,
            job.optim.epochs,
            state.epoch + 1
        )));
    }
    Ok(ResumeFrom { dir, state, store })
}

/// The checkpoint that the store's `url` names (a checkpoint, or a run's latest), copied
/// into its run's folder under `runs_dir`, where the job continues.
async fn from_store(
    url: &str,
    runs_dir: &Path,
    job: &JobSpec,
    output: &dyn JobOutput,
) -> Result<checkpoint_store::StoredCheckpoint, JobError> {
    let options = job.data.sources.s3.clone();
    let (url, runs_dir) = (url.to_string(), runs_dir.to_path_buf());
    let started = std::time::Instant::now();
    let copied = off_runtime(move || {
        let found = checkpoint_store::locate(&url, &options)?;
        let dir = runs_dir
            .join(&found.run)
            .join("checkpoints")
            .join(&found.name);
        checkpoint_store::download(&found.url, &dir, &options)?;
        Ok::<_, checkpoint::CheckpointError>(found)
    })
    .await?;
    let found = copied
        .map_err(|error| JobError::Refused(format!("--resume: copying the checkpoint: {error}")))?;
    output.info(format!(
        "checkpoint {} copied from the store in {:.1} s",
        found.url,
        started.elapsed().as_secs_f64()
    ));
    Ok(found)
}

/// `work`'s result, run on a thread of its own: a checkpoint store's client waits on its
/// own runtime, which must not hold up this one's threads.
async fn off_runtime<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, JobError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|error| JobError::Refused(format!("the checkpoint store's work ended: {error}")))
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
    let name = train.run_name();
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
    planned: &Planned,
    elastic: Option<Elastic>,
    run_dir: &Path,
) -> Vec<String> {
    let Planned {
        places,
        node_ranks,
        global_batch,
    } = planned;
    let world_size = places.len();
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
            "  world       {world_size} {device} trainer(s) on {}: {} ({})",
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
        compute_line(
            job.optim.precision,
            job.optim.channels_last,
            places.first().map(|p| p.gpu),
        ),
    ];
    lines.extend(sync_lines(job.optim.sync, job.optim.topology, node_ranks));
    lines.push(elastic_line(elastic));
    lines.push(format!("  run         {}", run_dir.display()));
    lines
}

/// What the trainers compute in and how their tensors are laid out (`train.precision`,
/// `train.channels_last`), as the plans print it; `gpu`: whether the trainers have GPUs
/// (`None`: not known, as for `imgrun plan`).
pub fn compute_line(precision: Precision, channels_last: bool, gpu: Option<bool>) -> String {
    let autocast = match precision {
        Precision::Fp32 => None,
        Precision::Amp => Some("float16 autocast with loss scaling"),
        Precision::Bf16 => Some("bfloat16 autocast"),
    };
    let arithmetic = match (autocast, gpu) {
        (None, _) => "fp32".to_string(),
        (Some(autocast), Some(true)) => format!("{precision} ({autocast})"),
        (Some(_), Some(false)) => format!("fp32 ({precision} applies to CUDA trainers only)"),
        (Some(autocast), None) => {
            format!("{precision} ({autocast}) on CUDA trainers, fp32 on CPU ones")
        }
    };
    let layout = match (channels_last, gpu) {
        (false, _) => "NCHW images and weights",
        (true, Some(true)) => "channels-last images and convolution weights",
        (true, Some(false)) => "channels-last images, NCHW weights",
        (true, None) => "channels-last images (and weights on CUDA)",
    };
    format!("  compute     {arithmetic}; {layout}")
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

/// The timeline's note of a regroup from `old_world_size` ranks.
fn regroup_moment(record: &RegroupRecord, old_world_size: usize) -> JobEvent {
    JobEvent::Moment {
        moment: Moment::Regrouped {
            from_world: old_world_size as u32,
            world: record.world,
            epoch: record.epoch,
            step: record.step,
            recovery_s: record.recovery_s,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_compute_line_says_what_each_device_computes_in() {
        // (precision, channels_last, gpu, expected line after `compute`)
        let cases = [
            (
                Precision::Fp32,
                true,
                Some(false),
                "fp32; channels-last images, NCHW weights",
            ),
            (
                Precision::Bf16,
                true,
                Some(false),
                "fp32 (bf16 applies to CUDA trainers only); channels-last images, NCHW weights",
            ),
            (
                Precision::Bf16,
                true,
                Some(true),
                "bf16 (bfloat16 autocast); channels-last images and convolution weights",
            ),
            (
                Precision::Amp,
                false,
                Some(true),
                "amp (float16 autocast with loss scaling); NCHW images and weights",
            ),
            (
                Precision::Bf16,
                true,
                None,
                "bf16 (bfloat16 autocast) on CUDA trainers, fp32 on CPU ones; channels-last \
                 images (and weights on CUDA)",
            ),
        ];
        for (precision, channels_last, gpu, want) in cases {
            let line = compute_line(precision, channels_last, gpu);
            assert_eq!(line, format!("  compute     {want}"), "{precision} {gpu:?}");
        }
    }
}
