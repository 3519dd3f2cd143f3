//! The step loop: calls of the same number of steps to every rank, evaluations and
//! checkpoints when due, metrics and progress, and the checkpoint at the last step when
//! the job is asked to stop.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pipelines::RankCursor;

use super::calls::{Rank, call_all, call_one};
use super::error::{Progress, Saved};
use super::metrics::Metrics;
use super::ranks::{RankView, hold_ups, rank_views};
use super::world::{RankPlace, room_to_grow};
use super::{Interrupted, JobError, JobEvent, JobOutput, JobSettings, JobSummary};
use crate::train::{
    CheckpointState, EpochReceived, EpochRecord, EpochSums, EvalRecord, EvalReply, EvaluateRequest,
    JobSpec, LateCause, LateRecord, MetricsRecord, ResumeFrom, SamplesRecord, SaveRequest,
    StepMetrics, StepRecord, StepTiming, StopRecord, SyncChoice, TrainReply, TrainRequest,
    late_rank,
};

/// How whoever runs the job tells the step loop to stop (a signal's name, or `cancel`),
/// and what the loop tells it back.
#[derive(Clone)]
pub struct StopControl {
    requested: tokio::sync::watch::Receiver<Option<&'static str>>,
    progress: Arc<Mutex<Progress>>,
    /// The job's ranks, once spawned, and the cluster they run on, for the hang doctor.
    ranks: Arc<Mutex<(Vec<Rank>, Option<runtime::ClusterClient>)>>,
}

impl std::fmt::Debug for StopControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StopControl")
            .field("requested", &*self.requested.borrow())
            .field("progress", &*self.progress())
            .finish_non_exhaustive()
    }
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
        };
        (StopRequest(tx), control)
    }

    /// Where the job stands now.
    pub fn progress(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn set_ranks(&self, ranks: &[Rank], client: &runtime::ClusterClient) {
        *self.ranks.lock().unwrap_or_else(|e| e.into_inner()) =
            (ranks.to_vec(), Some(client.clone()));
    }

    /// Every rank's phase now, from its monitor, with its node's last heartbeat (none
    /// before the ranks are up).
    pub async fn rank_views(&self) -> Vec<RankView> {
        let (ranks, client) = self.ranks.lock().unwrap_or_else(|e| e.into_inner()).clone();
        rank_views(&ranks, client.as_ref()).await
    }

    fn requested(&self) -> Option<&'static str> {
        *self.requested.borrow()
    }

    /// The stop requests, to wait for one.
    pub(crate) fn watch(&self) -> tokio::sync::watch::Receiver<Option<&'static str>> {
        self.requested.clone()
    }
}

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
    pub(super) client: &'a runtime::ClusterClient,
    pub(super) max_world: usize,
}

/// A job whose trainers are up and connected: what the step loop and its checkpoints
/// need.
#[derive(Clone, Copy)]
pub(super) struct RunningJob<'a> {
    pub(super) settings: &'a JobSettings,
    pub(super) job: &'a JobSpec,
    pub(super) ranks: &'a [Rank],
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
    /// Has rank 0 write checkpoint `name`: the job at `global_step`, to continue at step
    /// `step_in_epoch` of `epoch` with the ranks' loader `cursors` and the epoch's running
    /// `sums` so far.
    pub(super) async fn save(
        &self,
        name: &str,
        (epoch, global_step, step_in_epoch): (u64, u64, u64),
        cursors: Vec<RankCursor>,
        sums: EpochSums,
    ) -> Result<(), JobError> {
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
        };
        let root = std::fs::canonicalize(self.run_dir)
            .unwrap_or_else(|_| self.run_dir.to_path_buf())
            .join("checkpoints");
        let request = SaveRequest {
            root,
            name: name.to_string(),
            state,
        };
        let timeout = Duration::from_secs(self.settings.step_timeout_secs.max(10));
        let Some(rank0) = self.ranks.first() else {
            return Err(JobError::Refused(format!(
                "checkpoint {name}: no rank is left to write it"
            )));
        };
        let saved = if self.job.optim.sync == SyncChoice::Decentralized {
            // Every rank sends its replica to rank 0, which writes them all.
            call_all(self.ranks, |_| request.clone(), timeout)
                .await
                .map(|mut paths| paths.swap_remove(0))
        } else {
            call_one(rank0, &request, timeout).await
        };
        let path = saved.map_err(|error| {
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
        self.stop.progress().checkpoint = Some(Saved {
            dir: path,
            epoch,
            global_step,
            step_in_epoch,
        });
        Ok(())
    }

    /// The job was asked to stop by `signal` between steps: saves a checkpoint at the
    /// last completed step unless the newest one is there already, and says where the
    /// job stands.
    async fn interrupted(
        &self,
        signal: &'static str,
        at: (u64, u64, u64),
        cursors: &[RankCursor],
        sums: EpochSums,
        metrics: &mut Metrics,
    ) -> JobError {
        let (epoch, global_step, step_in_epoch) = at;
        let newest = self.stop.progress().checkpoint.clone();
        let saved_already = newest
            .as_ref()
            .is_some_and(|c| c.global_step == global_step);
        if !saved_already && global_step > 0 {
            let (name, cursors, sums) = if step_in_epoch == 0 {
                (
                    format!("epoch-{epoch:04}"),
                    Vec::new(),
                    EpochSums::default(),
                )
            } else {
                (format!("step-{global_step:08}"), cursors.to_vec(), sums)
            };
            if let Err(error) = self.save(&name, at, cursors, sums).await {
                return JobError::Interrupted(Box::new(Interrupted::late(
                    signal,
                    self.stop.progress().clone(),
                    format!("the checkpoint at global step {global_step} failed: {error}"),
                )));
            }
        }
        let progress = self.stop.progress().clone();
        let _ = metrics.write(&MetricsRecord::Stop(StopRecord {
            signal: signal.to_string(),
            epoch,
            step: global_step,
            checkpoint: progress
                .checkpoint
                .as_ref()
                .map(|c| c.dir.display().to_string()),
        }));
        JobError::Interrupted(Box::new(Interrupted::in_time(signal, progress)))
    }
}

impl RunningJob<'_> {
    /// An elastic job that cannot go on after a loss (`error` says why): a checkpoint at
    /// `at`, the step its surviving ranks rolled back to (unless the newest one is
    /// there), and the job's error saying where to continue from.
    pub(super) async fn checkpoint_after_loss(&self, error: JobError, at: &Position) -> JobError {
        let newest = self.stop.progress().checkpoint.clone();
        let saved =
            if at.global_step == 0 || newest.is_some_and(|c| c.global_step == at.global_step) {
                Ok(())
            } else {
                let name = if at.step_in_epoch == 0 {
                    format!("epoch-{:04}", at.epoch)
                } else {
                    format!("step-{:08}", at.global_step)
                };
                let place = (at.epoch, at.global_step, at.step_in_epoch);
                self.save(&name, place, at.cursors.clone(), at.sums).await
            };
        let world: u32 = self.node_ranks.iter().sum();
        let checkpoint = match (saved, &self.stop.progress().checkpoint) {
            (Err(failed), _) => format!(
                "; the checkpoint at step {} failed: {failed}",
                at.global_step
            ),
            (Ok(()), Some(newest)) => format!(
                "; checkpoint {} (step {}): continue with --resume {} once the cluster has \
                 room for the job's {world} ranks",
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

/// The steps a call may run from `global_step`: at most `chunk`, and never past the next
/// multiple of any nonzero `every` (a checkpoint or an evaluation is due there).
pub(super) fn steps_until(global_step: u64, chunk: u64, every: &[u64]) -> u64 {
    every
        .iter()
        .filter(|&&e| e > 0)
        .map(|e| e - global_step % e)
        .fold(chunk, u64::min)
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

/// Runs the job's steps from `start` to its end; `at` follows the last step every rank
/// completed, and `summary` gathers what the job reports.
pub(super) async fn train_loop(
    run: &RunningJob<'_>,
    metrics: &mut Metrics,
    start: &Position,
    at: &mut Position,
    summary: &mut JobSummary,
) -> Result<LoopEnd, JobError> {
    let RunningJob {
        settings: train,
        job,
        ranks,
        run_dir,
        steps_per_epoch,
        output,
        ..
    } = *run;
    let long = Duration::from_secs(train.step_timeout_secs.max(10));
    let started = Instant::now();
    let (first_epoch, mut step_in_epoch) = (start.epoch, start.step_in_epoch);
    summary.run_dir = run_dir.to_path_buf();
    let mut global_step = start.global_step;
    *at = start.clone();
    let (mut total_images, mut total_train_s) = (0u64, 0.0f64);
    for epoch in first_epoch..job.optim.epochs {
        let steps = match run.regrouped {
            Some((regrouped, steps)) if regrouped == epoch => steps,
            _ => steps_per_epoch,
        };
        output.event(JobEvent::EpochStarted {
            epoch,
            steps,
            position: step_in_epoch,
        });
        let epoch_started = Instant::now();
        // A resumed epoch's summary counts the steps before its checkpoint too.
        let resumed = epoch == start.epoch && start.step_in_epoch > 0;
        let mut sums = if resumed {
            start.sums
        } else {
            EpochSums::default()
        };
        let (mut images, mut busy_s, mut wait_s) = (0u64, 0.0f64, 0.0f64);
        let mut cursors: Vec<RankCursor> = if resumed {
            start.cursors.clone()
        } else {
            Vec::new()
        };
        let mut chunk = 1u64;
        let mut done = false;
        let mut received: Vec<EpochReceived> = Vec::new();
        // The loaders' problems (bad samples skipped, shards whose counts are wrong),
        // each told once.
        let mut told: std::collections::HashSet<String> = std::collections::HashSet::new();
        // Ranks that held the others up this epoch: steps late and the most behind.
        let mut late: BTreeMap<usize, (u64, f64, LateCause)> = BTreeMap::new();
        // Bad samples and shards each rank has skipped so far this epoch.
        let mut skipped: Vec<u64> = Vec::new();
        while !done {
            if let Some(signal) = run.stop.requested() {
                output.event(JobEvent::EpochEnded { epoch });
                let at = (epoch, global_step, step_in_epoch);
                return Err(run.interrupted(signal, at, &cursors, sums, metrics).await);
            }
            let max_steps = steps_until(
                global_step,
                chunk,
                &[train.checkpoint_every_steps, train.eval_every_steps],
            );
            let request = TrainRequest {
                epoch,
                max_steps,
                sample_ids: train.sample_log,
            };
            let called = Instant::now();
            let called_at_s = started.elapsed().as_secs_f64();
            let replies: Vec<TrainReply> = {
                let call = call_all(ranks, |_| request.clone(), long + Duration::from_secs(60));
                let mut call = std::pin::pin!(call);
                // While the call is out longer than a straggler may be late, the ranks'
                // monitors say who the others wait for.
                let watching = train.straggler_secs > 0.0;
                let tick = Duration::from_secs_f64(train.straggler_secs.max(1.0));
                let mut named = std::collections::HashSet::new();
                loop {
                    tokio::select! {
                        replies = &mut call => break replies?,
                        () = tokio::time::sleep(tick), if watching => {
                            let views = rank_views(ranks, None).await;
                            for line in hold_ups(&views, train.straggler_secs, &mut named) {
                                output.warn(line);
                            }
                        }
                    }
                }
            };
            let elapsed = called.elapsed().as_secs_f64();
            let first = &replies[0];
            if let Some(bad) = replies.iter().position(|r| {
                r.step_in_epoch != first.step_in_epoch || r.epoch_done != first.epoch_done
            }) {
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
            let samples: u64 = replies.iter().map(|r| r.samples).sum();
            let data_wait = replies
                .iter()
                .map(|r| r.data_wait_s / r.seconds.max(1e-9))
                .sum::<f64>()
                / replies.len() as f64;
            // Each step's own figures: when it ended, from the ranks' step timings.
            let mut step_end_s = called_at_s;
            let mut last_figures = None;
            for (i, step) in first.steps.iter().enumerate() {
                let ranks_records: Vec<&StepRecord> =
                    replies.iter().filter_map(|r| r.steps.get(i)).collect();
                let figures = step_figures(step.samples, &ranks_records);
                step_end_s += figures.step_s;
                let timings: Vec<StepTiming> = ranks_records.iter().map(|r| r.timing).collect();
                if let Some(found) = late_rank(&timings, train.straggler_secs) {
                    let who = &ranks[found.rank];
                    let seen = late.entry(found.rank).or_insert((0, 0.0, found.cause));
                    if seen.0 == 0 {
                        output.warn(format!(
                            "{} is {:.1} s behind the others at step {}: {}",
                            who.name(),
                            found.behind_s,
                            step.step,
                            found.cause.explain()
                        ));
                    }
                    seen.0 += 1;
                    if found.behind_s > seen.1 {
                        *seen = (seen.0, found.behind_s, found.cause);
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
                sums.add(step.loss, step.accuracy, step.samples);
                summary.first_loss.get_or_insert(step.loss);
                summary.last_loss = Some(step.loss);
                last_figures = Some(figures);
            }
            skipped = replies.iter().map(|r| r.skipped).collect();
            for (rank, reply) in replies.iter().enumerate() {
                for problem in &reply.problems {
                    if told.insert(problem.clone()) {
                        output.warn(format!("rank {rank}: {problem}"));
                    }
                }
            }
            if first.epoch_done {
                received = replies
                    .iter()
                    .map(|r| r.received.clone().unwrap_or_default())
                    .collect();
            }
            images += samples;
            busy_s += elapsed;
            wait_s += data_wait * elapsed;
            global_step = first.global_step;
            step_in_epoch = first.step_in_epoch;
            done = first.epoch_done;
            cursors = replies.iter().filter_map(|r| r.cursor.clone()).collect();
            *at = Position {
                epoch,
                global_step,
                step_in_epoch,
                cursors: cursors.clone(),
                sums,
            };
            if let (Some(last), Some(figures)) = (first.steps.last(), last_figures) {
                output.event(JobEvent::Stepped {
                    epoch,
                    position: step_in_epoch,
                    loss: last.loss,
                    images_per_s: figures.images_per_s,
                });
            }
            // Calls of about a second: progress stays live, and Ctrl-C or a failure is
            // noticed between calls.
            let per_step = elapsed / first.steps.len().max(1) as f64;
            chunk = ((1.0 / per_step.max(1e-4)) as u64).clamp(1, 1000);
            let due = |every: u64| !done && every > 0 && global_step.is_multiple_of(every);
            if due(train.eval_every_steps) && !job.data.val.is_empty() {
                let elapsed_s = started.elapsed().as_secs_f64();
                if let Some(top) = run.evaluate(epoch, global_step, metrics, elapsed_s).await? {
                    output.info(format!(
                        "      step {global_step}: val top-1 {:.2}%, top-5 {:.2}%",
                        top.0 * 100.0,
                        top.1 * 100.0
                    ));
                }
            }
            if due(train.checkpoint_every_steps) {
                let name = format!("step-{global_step:08}");
                let at = (epoch, global_step, step_in_epoch);
                run.save(&name, at, cursors.clone(), sums).await?;
            }
        }
        output.event(JobEvent::EpochEnded { epoch });
        *at = Position {
            epoch: epoch + 1,
            global_step,
            ..Position::default()
        };
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
        let (train_loss, train_accuracy) = sums.means();
        for (rank, (steps, most, cause)) in &late {
            output.warn(format!(
                "epoch {epoch}: {} held the others up on {steps} step(s), by up to \
                 {most:.1} s ({})",
                ranks[*rank].name(),
                match cause {
                    LateCause::WaitingForData => "waiting for data",
                    LateCause::Computing => "computing",
                }
            ));
        }
        let skipped: u64 = skipped.iter().sum();
        if skipped > 0 {
            output.warn(format!(
                "epoch {epoch}: {skipped} bad sample(s) or shard(s) skipped \
                 (shards.error_policy = \"skip\")"
            ));
        }
        let images_per_s = images as f64 / busy_s.max(1e-9);
        let data_wait_fraction = wait_s / busy_s.max(1e-9);
        metrics.write(&MetricsRecord::Epoch(EpochRecord {
            epoch,
            step: global_step,
            train_loss,
            train_accuracy,
            steps: sums.steps,
            samples: sums.samples,
            images_per_s,
            data_wait_fraction,
            seconds: epoch_s,
            elapsed_s: started.elapsed().as_secs_f64(),
            // What each rank actually trained on (this run's part of a resumed epoch).
            image_sizes: received.iter().map(|r| r.image_sizes.clone()).collect(),
            train_shards: received.iter().map(|r| r.shards.clone()).collect(),
            // Bad samples and shards skipped over all ranks (shards.error_policy = "skip").
            skipped,
        }))?;
        let pct = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{:.2}%", v * 100.0));
        output.info(format!(
            "{epoch:>5} {train_loss:>10.4} {:>8} {:>8} {:>8.1}s {images_per_s:>8.0} {:>9.1}%",
            pct(top.0),
            pct(top.1),
            epoch_s,
            data_wait_fraction * 100.0
        ));
        let save_due = last_epoch
            || (train.checkpoint_every_epochs > 0
                && (epoch + 1) % train.checkpoint_every_epochs == 0);
        if save_due {
            let name = format!("epoch-{:04}", epoch + 1);
            let at = (epoch + 1, global_step, 0);
            run.save(&name, at, Vec::new(), EpochSums::default())
                .await?;
        }
        if let Some(grow) = run.grow
            && !last_epoch
            && ranks.len() < grow.max_world
        {
            let want = grow.max_world - ranks.len();
            let taken: Vec<RankPlace> = ranks.iter().map(|r| r.place.clone()).collect();
            // None when the cluster cannot be asked.
            let places = match grow.client.status().await {
                Ok(status) => room_to_grow(&status, &taken, train, want),
                Err(_) => Vec::new(),
            };
            if !places.is_empty() {
                summary.images_per_s = total_images as f64 / total_train_s.max(1e-9);
                return Ok(LoopEnd::Grow(places));
            }
        }
    }
    summary.images_per_s = total_images as f64 / total_train_s.max(1e-9);
    Ok(LoopEnd::Done)
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

    #[test]
    pub(super) fn calls_stop_at_every_due_step() {
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
