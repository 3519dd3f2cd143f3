//! The step loop: calls of the same number of steps to every rank, evaluations and
//! checkpoints when due, metrics and progress, and the checkpoint at the last step when
//! the job is asked to stop. What is due when is decided in `due.rs` ([`Cadence`]); the
//! loop carries it out, its counters in an [`EpochTally`] per epoch.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

use pipelines::RankCursor;
use runtime::ClusterClient;

use super::calls::{RankHandle, call_all, call_one};
use super::due::{BeforeCall, Cadence, Called, Checkpoint, last_checkpoint};
use super::error::Saved;
use super::metrics::Metrics;
use super::ranks::{hold_ups, rank_views};
use super::stop::StopControl;
use super::world::{RankPlace, room_to_grow};
use super::{Interrupted, JobError, JobEvent, JobOutput, JobSettings, JobSummary, Moment};
use crate::train::{
    CheckpointState, EpochReceived, EpochRecord, EpochSums, EvalRecord, EvalReply, EvaluateRequest,
    JobSpec, Late, LateCause, LateRecord, MetricsRecord, RankStep, ResumeFrom, SamplesRecord,
    SaveRequest, StepMetrics, StepRecord, StepTiming, StopRecord, SyncChoice, TrainReply,
    TrainRequest, checkpoint_store, late_rank,
};

/// Where the step loop stands between calls: the last step every rank completed, with
/// every rank's loader cursor and the epoch's running sums there. The loop starts from
/// one (a fresh job's start, a checkpoint's, or where an elastic job lost a rank) and
/// keeps one up to date, so that a job that loses a rank knows where to go on from.
#[derive(Debug, Clone, Default)]
pub(super) struct Position {
    pub(super) epoch: u64,
    pub(super) global_step: u64,
    pub(super) step_in_epoch: u64,
    /// Every rank's cursor (none at an epoch's start).
    pub(super) cursors: Vec<RankCursor>,
    pub(super) sums: EpochSums,
}

impl Position {
    pub(super) fn resumed(resume: Option<&ResumeFrom>) -> Position {
        let Some(r) = resume else {
            return Position::default();
        };
        let mid = r.state.step_in_epoch > 0;
        Position {
            epoch: r.state.epoch,
            global_step: r.state.global_step,
            step_in_epoch: r.state.step_in_epoch,
            cursors: if mid {
                r.state.cursors.clone()
            } else {
                Vec::new()
            },
            sums: if mid {
                r.state.epoch_sums
            } else {
                EpochSums::default()
            },
        }
    }
}

/// How the step loop ended without an error.
pub(super) enum LoopEnd {
    /// The job's last epoch is done.
    Done,
    /// An elastic job found room for more trainers at an epoch's end: these places.
    Grow(Vec<RankPlace>),
}

/// An elastic job that may grow at its epochs' ends: the cluster to look for room in, and
/// the most ranks it may have.
#[derive(Clone, Copy)]
pub(super) struct Grow<'a> {
    pub(super) client: &'a ClusterClient,
    pub(super) max_world_size: usize,
}

/// A job whose trainers are up and connected: what the step loop and its checkpoints
/// need.
#[derive(Clone, Copy)]
pub(super) struct RunningJob<'a> {
    pub(super) settings: &'a JobSettings,
    pub(super) job: &'a JobSpec,
    pub(super) ranks: &'a [RankHandle],
    pub(super) run_dir: &'a Path,
    pub(super) steps_per_epoch: u64,
    pub(super) node_ranks: &'a [u32],
    pub(super) stop: &'a StopControl,
    pub(super) output: &'a dyn JobOutput,
    /// The epoch an elastic job regrouped in, and its steps in the smaller world: its
    /// cursors are the regrouped plan's, which a resume does not make, so it
    /// checkpoints again at its end.
    pub(super) regrouped: Option<(u64, u64)>,
    /// Whether (and up to how many ranks) the job grows at its epochs' ends.
    pub(super) grow: Option<Grow<'a>>,
}

impl RunningJob<'_> {
    /// Has rank 0 write `checkpoint`: the job at its global step, to continue at its step
    /// of its epoch with the ranks' loader `cursors` and the epoch's running `sums` so far,
    /// and the validation top-1 of an evaluation at that step.
    pub(super) async fn save(
        &self,
        checkpoint: &Checkpoint,
        cursors: Vec<RankCursor>,
        sums: EpochSums,
        val_top1: Option<f64>,
    ) -> Result<(), JobError> {
        let name = checkpoint.name.as_str();
        let (epoch, global_step, step_in_epoch) = checkpoint.place();
        if step_in_epoch > 0 && self.regrouped.is_some_and(|(e, _)| e == epoch) {
            tracing::info!(
                name,
                "no checkpoint in the middle of the epoch the job regrouped in"
            );
            return Ok(());
        }
        let state = CheckpointState {
            epoch,
            global_step,
            step_in_epoch,
            world: self.node_ranks.iter().sum(),
            node_ranks: self.node_ranks.to_vec(),
            cursors,
            model: self.job.model.kind.name().to_string(),
            classes: self.job.model.classes,
            // Rank 0 fills in its scaler.
            loss_scale: None,
            epoch_sums: sums,
            val_top1,
        };
        let root = std::fs::canonicalize(self.run_dir)
            .unwrap_or_else(|_| self.run_dir.to_path_buf())
            .join("checkpoints");
        let store = self.settings.checkpoint_store.as_deref();
        let run = self
            .run_dir
            .file_name()
            .map(|name| name.to_string_lossy().into_owned())
            .unwrap_or_default();
        let request = SaveRequest {
            root,
            name: name.to_string(),
            state,
            keep: self.settings.keep_checkpoints,
            keep_best: self.settings.keep_best,
            store: store.map(|store| checkpoint_store::run_prefix(store, &run)),
        };
        let timeout = Duration::from_secs(self.settings.step_timeout_secs.max(10));
        let Some(rank0) = self.ranks.first() else {
            return Err(JobError::Refused(format!(
                "checkpoint {name}: no rank is left to write it"
            )));
        };
        let started = std::time::Instant::now();
        let saved = if self.job.optim.sync == SyncChoice::Decentralized {
            // Every rank sends its replica to rank 0, which writes them all.
            call_all(self.ranks, |_| request.clone(), timeout)
                .await
                .map(|mut paths| paths.swap_remove(0))
        } else {
            call_one(rank0, &request, timeout).await
        };
        let path = saved.map_err(|error| {
            self.output.event(JobEvent::Moment {
                moment: Moment::CheckpointFailed {
                    global_step,
                    cause: error.to_string(),
                },
            });
            let newest = match (&self.stop.progress().checkpoint, self.run_dir) {
                (Some(saved), run) => format!(
                    "; the newest checkpoint, {}, is intact and `latest` points at it: \
                         free space or fix the cause, then continue with --resume {}",
                    saved.dir.display(),
                    run.display()
                ),
                (None, _) => "; no earlier checkpoint was written".to_string(),
            };
            error.during(format!(
                "{}: saving checkpoint {name}{newest}",
                rank0.name()
            ))
        })?;
        tracing::info!(path = %path.display(), "checkpoint saved");
        let seconds = started.elapsed().as_secs_f64();
        self.output.event(JobEvent::Moment {
            moment: Moment::Checkpoint {
                epoch,
                global_step,
                seconds,
            },
        });
        self.stop.progress().checkpoint = Some(Saved {
            dir: path,
            epoch,
            global_step,
            step_in_epoch,
            seconds: Some(seconds),
            store_run: store.map(|store| checkpoint_store::run_url(store, &run)),
        });
        Ok(())
    }

    /// The job was asked to stop by `signal` between steps, at `at`: saves a checkpoint at
    /// the last completed step unless the newest one is there already, and says where
    /// the job stands.
    async fn interrupted(
        &self,
        signal: &'static str,
        at: &Position,
        metrics: &mut Metrics,
    ) -> JobError {
        let place = (at.epoch, at.global_step, at.step_in_epoch);
        let newest = self.newest_checkpoint_step();
        if let Some(checkpoint) = last_checkpoint(place, newest) {
            let (cursors, sums) = if at.step_in_epoch == 0 {
                (Vec::new(), EpochSums::default())
            } else {
                (at.cursors.clone(), at.sums)
            };
            if let Err(error) = self.save(&checkpoint, cursors, sums, None).await {
                return JobError::Interrupted(Box::new(Interrupted::late(
                    signal,
                    self.stop.progress().clone(),
                    format!(
                        "the checkpoint at global step {} failed: {error}",
                        at.global_step
                    ),
                )));
            }
        }
        let progress = self.stop.progress().clone();
        let _ = metrics.write(&MetricsRecord::Stop(StopRecord {
            signal: signal.to_string(),
            epoch: at.epoch,
            step: at.global_step,
            checkpoint: progress
                .checkpoint
                .as_ref()
                .map(|c| c.dir.display().to_string()),
        }));
        JobError::Interrupted(Box::new(Interrupted::in_time(signal, progress)))
    }
}

impl RunningJob<'_> {
    /// The global step of the newest checkpoint, if any.
    fn newest_checkpoint_step(&self) -> Option<u64> {
        self.stop
            .progress()
            .checkpoint
            .as_ref()
            .map(|c| c.global_step)
    }

    /// An elastic job that cannot go on after a loss (`error` says why): a checkpoint at
    /// `at`, the step its surviving ranks rolled back to (unless the newest one is
    /// there), and the job's error saying where to continue from.
    pub(super) async fn checkpoint_after_loss(&self, error: JobError, at: &Position) -> JobError {
        let place = (at.epoch, at.global_step, at.step_in_epoch);
        let newest = self.newest_checkpoint_step();
        let saved = match last_checkpoint(place, newest) {
            Some(checkpoint) => {
                self.save(&checkpoint, at.cursors.clone(), at.sums, None)
                    .await
            }
            None => Ok(()),
        };
        let world_size: u32 = self.node_ranks.iter().sum();
        let checkpoint = match (saved, &self.stop.progress().checkpoint) {
            (Err(failed), _) => format!(
                "; the checkpoint at step {} failed: {failed}",
                at.global_step
            ),
            (Ok(()), Some(newest)) => format!(
                "; checkpoint {} (step {}): continue with --resume {} once the cluster has \
                 room for the job's {world_size} ranks",
                newest.dir.display(),
                newest.global_step,
                self.run_dir.display()
            ),
            (Ok(()), None) => "; no checkpoint was written".to_string(),
        };
        JobError::Refused(format!("{error}{checkpoint}"))
    }

    /// Evaluates on the val shards (split across ranks) and records the result:
    /// `(top1, top5)`, or none without val samples.
    pub(super) async fn evaluate(
        &self,
        epoch: u64,
        global_step: u64,
        metrics: &mut Metrics,
        elapsed_s: f64,
    ) -> Result<Option<(f64, f64)>, JobError> {
        let timeout = Duration::from_secs(self.settings.step_timeout_secs.max(10) * 6);
        let evals: Vec<EvalReply> = call_all(self.ranks, |_| EvaluateRequest {}, timeout).await?;
        let samples: u64 = evals.iter().map(|e| e.samples).sum();
        if samples == 0 {
            return Ok(None);
        }
        let n = samples as f64;
        let loss = evals.iter().map(|e| e.loss_sum).sum::<f64>() / n;
        let top1 = evals.iter().map(|e| e.top1).sum::<u64>() as f64 / n;
        let top5 = evals.iter().map(|e| e.top5).sum::<u64>() as f64 / n;
        let replica_spread = evals
            .iter()
            .filter_map(|e| e.replica_distance)
            .reduce(f64::max);
        metrics.write(&MetricsRecord::Eval(EvalRecord {
            replica_spread,
            epoch,
            step: global_step,
            loss,
            top1,
            top5,
            samples,
            elapsed_s,
        }))?;
        Ok(Some((top1, top5)))
    }
}

/// One step's figures for metrics.jsonl, from every rank's record of it: a step lasts
/// as long as its slowest rank; the data wait, the compute and the allreduce are the
/// ranks' means.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct StepFigures {
    pub(super) step_s: f64,
    pub(super) data_wait_s: f64,
    pub(super) compute_s: f64,
    pub(super) allreduce_s: f64,
    pub(super) images_per_s: f64,
}

pub(super) fn step_figures(samples: u64, ranks: &[&StepRecord]) -> StepFigures {
    let n = ranks.len().max(1) as f64;
    let step_s = ranks
        .iter()
        .map(|r| r.timing.seconds)
        .fold(0.0, f64::max)
        .max(1e-9);
    StepFigures {
        step_s,
        data_wait_s: ranks.iter().map(|r| r.timing.data_wait_s).sum::<f64>() / n,
        compute_s: ranks.iter().map(|r| r.timing.compute_s).sum::<f64>() / n,
        allreduce_s: ranks.iter().map(|r| r.timing.allreduce_s).sum::<f64>() / n,
        images_per_s: samples as f64 / step_s,
    }
}

/// Each rank's own figures of one step for its step record (`train.tensorboard_ranks`),
/// from its timing, by rank number.
fn rank_steps(by_rank: &[(u32, StepTiming)]) -> Vec<RankStep> {
    by_rank
        .iter()
        .map(|&(rank, timing)| RankStep {
            rank,
            step_s: timing.seconds,
            data_wait_s: timing.data_wait_s,
            compute_s: timing.compute_s,
            allreduce_s: timing.allreduce_s,
        })
        .collect()
}

/// What the step loop counts over one epoch.
struct EpochTally {
    epoch: u64,
    started: Instant,
    sums: EpochSums,
    cursors: Vec<RankCursor>,
    images: u64,
    busy_s: f64,
    wait_s: f64,
    /// What each rank trained on, told by the call that ended the epoch.
    received: Vec<EpochReceived>,
    /// The loaders' problems (bad samples skipped, shards whose counts are wrong), each
    /// told once.
    told: HashSet<String>,
    /// Ranks that held the others up this epoch: steps late and the most behind.
    late: BTreeMap<usize, (u64, f64, LateCause)>,
    /// Bad samples and shards each rank has skipped so far this epoch.
    skipped: Vec<u64>,
}

impl EpochTally {
    /// Epoch `epoch` of a loop that started at `start`: a resumed epoch's summary counts
    /// the steps before its checkpoint too.
    fn new(epoch: u64, start: &Position) -> EpochTally {
        let resumed = epoch == start.epoch && start.step_in_epoch > 0;
        EpochTally {
            epoch,
            started: Instant::now(),
            sums: if resumed {
                start.sums
            } else {
                EpochSums::default()
            },
            cursors: if resumed {
                start.cursors.clone()
            } else {
                Vec::new()
            },
            images: 0,
            busy_s: 0.0,
            wait_s: 0.0,
            received: Vec::new(),
            told: HashSet::new(),
            late: BTreeMap::new(),
            skipped: Vec::new(),
        }
    }

    /// Counts rank `found.rank` late once more; whether this is its first time this epoch.
    fn note_late(&mut self, found: &Late) -> bool {
        let seen = self.late.entry(found.rank).or_insert((0, 0.0, found.cause));
        let first = seen.0 == 0;
        seen.0 += 1;
        if found.behind_s > seen.1 {
            *seen = (seen.0, found.behind_s, found.cause);
        }
        first
    }

    /// Takes in a call's `replies` (after their steps are recorded), which took `seconds`:
    /// the loaders' problems not told before, for the caller to tell.
    fn absorb(&mut self, replies: &[TrainReply], seconds: f64) -> Vec<String> {
        let samples: u64 = replies.iter().map(|r| r.samples).sum();
        let data_wait = replies
            .iter()
            .map(|r| r.data_wait_s / r.seconds.max(1e-9))
            .sum::<f64>()
            / replies.len() as f64;
        self.skipped = replies.iter().map(|r| r.skipped).collect();
        let mut new = Vec::new();
        for (rank, reply) in replies.iter().enumerate() {
            for problem in &reply.problems {
                if self.told.insert(problem.clone()) {
                    new.push(format!("rank {rank}: {problem}"));
                }
            }
        }
        if replies[0].epoch_done {
            self.received = replies
                .iter()
                .map(|r| r.received.clone().unwrap_or_default())
                .collect();
        }
        self.images += samples;
        self.busy_s += seconds;
        self.wait_s += data_wait * seconds;
        self.cursors = replies.iter().filter_map(|r| r.cursor.clone()).collect();
        new
    }
}

/// When the step loop started, and the images and busy seconds of the epochs it ran.
struct Clock {
    started: Instant,
    images: u64,
    train_s: f64,
}

impl Clock {
    fn images_per_s(&self) -> f64 {
        self.images as f64 / self.train_s.max(1e-9)
    }
}

/// Runs the job's steps from `start` to its end; `at` follows the last step every rank
/// completed, and `summary` gathers what the job reports. What is due when comes from
/// [`Cadence`]; this carries it out.
pub(super) async fn train_loop(
    run: &RunningJob<'_>,
    metrics: &mut Metrics,
    start: &Position,
    at: &mut Position,
    summary: &mut JobSummary,
) -> Result<LoopEnd, JobError> {
    let job = run.job;
    let cadence = Cadence::new(
        run.settings,
        job.optim.epochs,
        !job.data.val.is_empty(),
        run.grow.map(|g| g.max_world_size),
    );
    let mut clock = Clock {
        started: Instant::now(),
        images: 0,
        train_s: 0.0,
    };
    summary.run_dir = run.run_dir.to_path_buf();
    *at = start.clone();
    for epoch in start.epoch..job.optim.epochs {
        let steps = match run.regrouped {
            Some((regrouped, steps)) if regrouped == epoch => steps,
            _ => run.steps_per_epoch,
        };
        run.output.event(JobEvent::EpochStarted {
            epoch,
            steps,
            position: at.step_in_epoch,
        });
        let mut tally = EpochTally::new(epoch, start);
        run.epoch(&cadence, &mut tally, at, &clock, metrics, summary)
            .await?;
        let grow = run
            .end_epoch(&cadence, &tally, at, &mut clock, metrics, summary)
            .await?;
        if let Some(places) = grow {
            summary.images_per_s = clock.images_per_s();
            return Ok(LoopEnd::Grow(places));
        }
    }
    summary.images_per_s = clock.images_per_s();
    Ok(LoopEnd::Done)
}

impl RunningJob<'_> {
    /// The calls of `tally`'s epoch until it ends, each followed by what is due; a stop
    /// asked between calls ends it with the job's error.
    async fn epoch(
        &self,
        cadence: &Cadence,
        tally: &mut EpochTally,
        at: &mut Position,
        clock: &Clock,
        metrics: &mut Metrics,
        summary: &mut JobSummary,
    ) -> Result<(), JobError> {
        let epoch = tally.epoch;
        let mut chunk = 1u64;
        loop {
            let max_steps = match cadence.before_call(self.stop.requested(), at.global_step, chunk)
            {
                BeforeCall::Stop(signal) => {
                    self.output.event(JobEvent::EpochEnded { epoch });
                    return Err(self.interrupted(signal, at, metrics).await);
                }
                BeforeCall::Train { max_steps } => max_steps,
            };
            let called = self.call(tally, max_steps, clock, metrics, summary).await?;
            *at = Position {
                epoch,
                global_step: called.global_step,
                step_in_epoch: called.step_in_epoch,
                cursors: tally.cursors.clone(),
                sums: tally.sums,
            };
            let after = cadence.after_call(&called);
            chunk = after.chunk;
            let mut top1 = None;
            if after.evaluate {
                let elapsed_s = clock.started.elapsed().as_secs_f64();
                let global_step = called.global_step;
                if let Some(top) = self
                    .evaluate(epoch, global_step, metrics, elapsed_s)
                    .await?
                {
                    self.output.info(format!(
                        "      step {global_step}: val top-1 {:.2}%, top-5 {:.2}%",
                        top.0 * 100.0,
                        top.1 * 100.0
                    ));
                    top1 = Some(top.0);
                }
            }
            if let Some(checkpoint) = &after.checkpoint {
                self.save(checkpoint, tally.cursors.clone(), tally.sums, top1)
                    .await?;
            }
            if called.epoch_done {
                return Ok(());
            }
        }
    }

    /// The end of `tally`'s epoch, `at` the last step of it: `at` moves to the next
    /// epoch's start, then what [`Cadence::epoch_end`] says is due; the places to grow
    /// onto when the job found room for more ranks.
    async fn end_epoch(
        &self,
        cadence: &Cadence,
        tally: &EpochTally,
        at: &mut Position,
        clock: &mut Clock,
        metrics: &mut Metrics,
        summary: &mut JobSummary,
    ) -> Result<Option<Vec<RankPlace>>, JobError> {
        let epoch = tally.epoch;
        self.output.event(JobEvent::EpochEnded { epoch });
        let global_step = at.global_step;
        *at = Position {
            epoch: epoch + 1,
            global_step,
            ..Position::default()
        };
        let epoch_s = tally.started.elapsed().as_secs_f64();
        clock.images += tally.images;
        clock.train_s += tally.busy_s;
        let end = cadence.epoch_end(epoch, global_step, self.ranks.len());
        let elapsed_s = clock.started.elapsed().as_secs_f64();
        let top = if end.evaluate {
            self.evaluate(epoch, global_step, metrics, elapsed_s)
                .await?
        } else {
            None
        };
        if let Some((top1, top5)) = top {
            summary.top1 = Some(top1);
            summary.top5 = Some(top5);
        }
        self.epoch_record(tally, (global_step, epoch_s), top, clock, metrics)?;
        if let Some(checkpoint) = &end.checkpoint {
            let top1 = top.map(|(top1, _)| top1);
            self.save(checkpoint, Vec::new(), EpochSums::default(), top1)
                .await?;
        }
        if let (Some(want), Some(grow)) = (end.look_for_room, self.grow) {
            let places = self.room_to_grow(grow.client, want).await;
            if !places.is_empty() {
                return Ok(Some(places));
            }
        }
        Ok(None)
    }

    /// One call of up to `max_steps` steps to every rank, its steps recorded in `metrics`
    /// and `summary` and taken into `tally`; where it left the ranks.
    async fn call(
        &self,
        tally: &mut EpochTally,
        max_steps: u64,
        clock: &Clock,
        metrics: &mut Metrics,
        summary: &mut JobSummary,
    ) -> Result<Called, JobError> {
        let epoch = tally.epoch;
        let request = TrainRequest {
            epoch,
            max_steps,
            sample_ids: self.settings.sample_log,
        };
        let called = Instant::now();
        let called_at_s = clock.started.elapsed().as_secs_f64();
        let replies = self.train(request).await?;
        let seconds = called.elapsed().as_secs_f64();
        in_step(&replies, epoch)?;
        let first = &replies[0];
        let last_figures = self.record_steps(&replies, called_at_s, tally, metrics, summary)?;
        for line in tally.absorb(&replies, seconds) {
            self.output.warn(line);
        }
        if let (Some(last), Some(figures)) = (first.steps.last(), last_figures) {
            self.output.event(JobEvent::Stepped {
                epoch,
                position: first.step_in_epoch,
                loss: last.loss,
                images_per_s: figures.images_per_s,
                lr: last.lr,
                step_s: figures.step_s,
                data_wait_s: figures.data_wait_s,
                allreduce_s: figures.allreduce_s,
            });
        }
        Ok(Called {
            epoch,
            global_step: first.global_step,
            step_in_epoch: first.step_in_epoch,
            epoch_done: first.epoch_done,
            seconds,
            steps: first.steps.len(),
        })
    }

    /// Has every rank run `request`; while the call is out longer than a straggler may be
    /// late, the ranks' monitors say who the others wait for.
    async fn train(&self, request: TrainRequest) -> Result<Vec<TrainReply>, JobError> {
        let train = self.settings;
        let long = Duration::from_secs(train.step_timeout_secs.max(10));
        let call = call_all(
            self.ranks,
            |_| request.clone(),
            long + Duration::from_secs(60),
        );
        let mut call = std::pin::pin!(call);
        let watching = train.straggler_secs > 0.0;
        let tick = Duration::from_secs_f64(train.straggler_secs.max(1.0));
        let mut named = HashSet::new();
        loop {
            tokio::select! {
                replies = &mut call => return replies,
                () = tokio::time::sleep(tick), if watching => {
                    let views = rank_views(self.ranks, None).await;
                    for line in hold_ups(&views, train.straggler_secs, &mut named) {
                        self.output.warn(line);
                    }
                }
            }
        }
    }

    /// Writes each step of a call's `replies` to `metrics` (with the rank that held it
    /// up, if one did, and the samples when the job logs them) and adds it to the epoch's
    /// sums and the summary's losses; the figures of the last step.
    fn record_steps(
        &self,
        replies: &[TrainReply],
        called_at_s: f64,
        tally: &mut EpochTally,
        metrics: &mut Metrics,
        summary: &mut JobSummary,
    ) -> Result<Option<StepFigures>, JobError> {
        let (epoch, train) = (tally.epoch, self.settings);
        // Each step's own figures: when it ended, from the ranks' step timings.
        let mut step_end_s = called_at_s;
        let mut last_figures = None;
        for (rank, reply) in self.ranks.iter().zip(replies) {
            let mut tally = self.stop.tally();
            tally.loaded(rank.rank, &reply.loader, reply.epoch_done);
            tally.sourced(rank.rank, &reply.sources);
        }
        for (i, step) in replies[0].steps.iter().enumerate() {
            let ranks_records: Vec<&StepRecord> =
                replies.iter().filter_map(|r| r.steps.get(i)).collect();
            let figures = step_figures(step.samples, &ranks_records);
            step_end_s += figures.step_s;
            let timings: Vec<StepTiming> = ranks_records.iter().map(|r| r.timing).collect();
            let late = late_rank(&timings, train.straggler_secs);
            let by_rank: Vec<(u32, StepTiming)> = self
                .ranks
                .iter()
                .map(|r| r.rank)
                .zip(timings.iter().copied())
                .collect();
            self.stop.tally().step(
                &by_rank,
                late.map(|l| self.ranks[l.rank].rank),
                super::unix_ms(std::time::SystemTime::now()),
            );
            if let Some(found) = late {
                let who = &self.ranks[found.rank];
                if tally.note_late(&found) {
                    self.output.warn(format!(
                        "{} is {:.1} s behind the others at step {}: {}",
                        who.name(),
                        found.behind_s,
                        step.step,
                        found.cause.explain()
                    ));
                }
                metrics.write(&MetricsRecord::Late(LateRecord {
                    epoch,
                    step: step.step,
                    rank: who.rank,
                    node: who.place.node.0,
                    behind_s: found.behind_s,
                    cause: found.cause,
                }))?;
            }
            metrics.write(&MetricsRecord::Step(StepMetrics {
                epoch,
                step: step.step,
                loss: step.loss.into(),
                accuracy: step.accuracy.into(),
                lr: step.lr,
                samples: step.samples,
                images_per_s: figures.images_per_s,
                data_wait_s: figures.data_wait_s,
                compute_s: figures.compute_s,
                allreduce_s: figures.allreduce_s,
                step_s: figures.step_s,
                elapsed_s: step_end_s,
                loss_scale: step.loss_scale,
                skipped: step.loss_scale.map(|_| step.skipped),
                ranks: if train.tensorboard_ranks {
                    rank_steps(&by_rank)
                } else {
                    Vec::new()
                },
            }))?;
            if train.sample_log {
                for (rank, record) in ranks_records.iter().enumerate() {
                    metrics.write(&MetricsRecord::Samples(SamplesRecord {
                        epoch,
                        step: step.step,
                        rank: rank as u32,
                        samples: record.sample_ids.clone(),
                    }))?;
                }
            }
            tally.sums.add(step.loss, step.accuracy, step.samples);
            summary.first_loss.get_or_insert(step.loss);
            summary.last_loss = Some(step.loss);
            last_figures = Some(figures);
        }
        Ok(last_figures)
    }

    /// The record and line of `tally`'s epoch, ended at `global_step` `epoch_s` after it
    /// started, with its evaluation's `top` accuracies: the ranks that held the others up
    /// and the samples skipped are told first.
    fn epoch_record(
        &self,
        tally: &EpochTally,
        (global_step, epoch_s): (u64, f64),
        top: Option<(f64, f64)>,
        clock: &Clock,
        metrics: &mut Metrics,
    ) -> Result<(), JobError> {
        let epoch = tally.epoch;
        let (train_loss, train_accuracy) = tally.sums.means();
        for (rank, (steps, most, cause)) in &tally.late {
            self.output.warn(format!(
                "epoch {epoch}: {} held the others up on {steps} step(s), by up to \
                 {most:.1} s ({})",
                self.ranks[*rank].name(),
                match cause {
                    LateCause::WaitingForData => "waiting for data",
                    LateCause::Computing => "computing",
                }
            ));
        }
        let skipped: u64 = tally.skipped.iter().sum();
        if skipped > 0 {
            self.output.warn(format!(
                "epoch {epoch}: {skipped} bad sample(s) or shard(s) skipped \
                 (shards.error_policy = \"skip\")"
            ));
        }
        let images_per_s = tally.images as f64 / tally.busy_s.max(1e-9);
        let data_wait_fraction = tally.wait_s / tally.busy_s.max(1e-9);
        metrics.write(&MetricsRecord::Epoch(EpochRecord {
            epoch,
            step: global_step,
            train_loss,
            train_accuracy,
            steps: tally.sums.steps,
            samples: tally.sums.samples,
            images_per_s,
            data_wait_fraction,
            seconds: epoch_s,
            elapsed_s: clock.started.elapsed().as_secs_f64(),
            // What each rank actually trained on (this run's part of a resumed epoch).
            image_sizes: tally
                .received
                .iter()
                .map(|r| r.image_sizes.clone())
                .collect(),
            train_shards: tally.received.iter().map(|r| r.shards.clone()).collect(),
            // Bad samples and shards skipped over all ranks (shards.error_policy = "skip").
            skipped,
        }))?;
        let pct = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{:.2}%", v * 100.0));
        self.output.info(format!(
            "{epoch:>5} {train_loss:>10.4} {:>8} {:>8} {:>8.1}s {images_per_s:>8.0} {:>9.1}%",
            pct(top.map(|t| t.0)),
            pct(top.map(|t| t.1)),
            epoch_s,
            data_wait_fraction * 100.0
        ));
        Ok(())
    }

    /// Places for up to `want` more trainers where the job has none; none when the
    /// cluster cannot be asked.
    async fn room_to_grow(&self, client: &ClusterClient, want: usize) -> Vec<RankPlace> {
        let taken: Vec<RankPlace> = self.ranks.iter().map(|r| r.place.clone()).collect();
        match client.status().await {
            Ok(status) => room_to_grow(&status, &taken, self.settings, want),
            Err(_) => Vec::new(),
        }
    }
}

/// Whether every rank's reply to a call in `epoch` stands at the same step, having run
/// as many steps, or the job's error saying which does not.
fn in_step(replies: &[TrainReply], epoch: u64) -> Result<(), JobError> {
    let first = &replies[0];
    if let Some(bad) = replies
        .iter()
        .position(|r| r.step_in_epoch != first.step_in_epoch || r.epoch_done != first.epoch_done)
    {
        return Err(JobError::Refused(format!(
            "ranks out of step: rank 0 at step {} of epoch {epoch}, rank {bad} at {}",
            first.step_in_epoch, replies[bad].step_in_epoch
        )));
    }
    if let Some(bad) = replies
        .iter()
        .position(|r| r.steps.len() != first.steps.len())
    {
        return Err(JobError::Refused(format!(
            "ranks out of step: rank 0 ran {} steps in a call, rank {bad} {}",
            first.steps.len(),
            replies[bad].steps.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_lasts_as_long_as_its_slowest_rank() {
        let record = |seconds, data_wait_s, allreduce_s| StepRecord {
            step: 7,
            loss: 1.0,
            accuracy: 0.5,
            lr: 0.1,
            samples: 64,
            loss_scale: None,
            skipped: false,
            timing: StepTiming {
                seconds,
                data_wait_s,
                compute_s: 0.0,
                allreduce_s,
            },
            sample_ids: Vec::new(),
        };
        let (a, b) = (record(0.5, 0.1, 0.2), record(0.25, 0.3, 0.0));
        let figures = step_figures(64, &[&a, &b]);
        assert_eq!(
            figures,
            StepFigures {
                step_s: 0.5,
                data_wait_s: 0.2,
                compute_s: 0.0,
                allreduce_s: 0.1,
                images_per_s: 128.0,
            }
        );
        // No time measured (a clock too coarse) never divides by zero.
        let still = record(0.0, 0.0, 0.0);
        assert!(step_figures(64, &[&still]).images_per_s.is_finite());
    }
}
