//! An elastic job's side of the trainer (`train.elastic`): the state at the start of
//! every `train` call, kept so that a step in flight when a rank is lost can be dropped
//! by every survivor alike (`rollback`), and the move to a smaller world (`regroup`):
//! a new rank number, the rest of the epoch dealt over the survivors
//! (`pipelines::regroup`), and the learning rate of the smaller global batch.
//!
//! The job's coordinator holds every rank's loader cursor as of the end of the last
//! call all ranks answered; survivors roll back to the state they had then, whether
//! their own call failed, ended, or never ran a step, so all of them continue from the
//! same model, optimiser and step, and no batch counts twice.

use pipelines::{ClusterShape, Plan, Rank, RankCursor};
use runtime::{FailureOrigin, MethodError};
use tch::Tensor;

use super::super::comm::ring_failure;
use super::super::ddp::GradSync;
use super::super::protocol::{RegroupReply, RegroupRequest, RollbackReply, RollbackRequest};
use super::super::scaler::ScalerState;
use super::{Trainer, fatal, schedule};

/// The trainer's state at the start of a `train` call.
pub(super) struct Snapshot {
    global_step: u64,
    /// Parameters, then buffers (copies).
    tensors: Vec<Tensor>,
    momentum: Vec<(String, Tensor)>,
    scaler: Option<ScalerState>,
}

impl Trainer {
    pub(super) fn elastic(&self) -> bool {
        self.init.job.optim.elastic
    }

    /// Keeps the state a rollback returns to (an elastic job, at every call's start).
    pub(super) fn take_snapshot(&mut self) {
        if !self.elastic() {
            return;
        }
        let _no_grad = tch::no_grad_guard();
        self.snapshot = Some(Snapshot {
            global_step: self.global_step,
            tensors: self
                .params
                .iter()
                .chain(&self.buffers)
                .map(Tensor::copy)
                .collect(),
            momentum: self.sgd.state(),
            scaler: self.scaler.state(),
        });
    }

    /// An elastic job's trainer survives a lost peer: the error is for the job, which
    /// rolls every survivor back; the ring is dropped (so its other peers see it end at
    /// once) and the epoch's loader with it.
    pub(super) fn survive(&mut self, error: MethodError) -> MethodError {
        if !self.elastic() || error.origin() != FailureOrigin::Elsewhere {
            return error;
        }
        self.sync = None;
        self.running = None;
        MethodError::new(error.message()).caused_elsewhere()
    }

    pub(super) fn rollback(
        &mut self,
        request: RollbackRequest,
    ) -> Result<RollbackReply, MethodError> {
        self.sync = None;
        self.running = None;
        self.listener = None;
        let rank = self.init.rank;
        // The state from the start of the call that began at that step, even when the
        // step count did not move: a step that failed after the optimiser stepped (in
        // the buffers' broadcast) changed the parameters all the same.
        let Some(snapshot) = self
            .snapshot
            .take()
            .filter(|s| s.global_step == request.global_step)
        else {
            if self.global_step == request.global_step {
                // No call began there: nothing ran past it.
                return Ok(RollbackReply { undone: 0 });
            }
            return Err(MethodError::fatal(format!(
                "rank {rank}: cannot roll back to step {}: it is at step {} and kept no \
                 state from then",
                request.global_step, self.global_step
            )));
        };
        let targets: Vec<&Tensor> = self.params.iter().chain(&self.buffers).collect();
        let _no_grad = tch::no_grad_guard();
        for (target, saved) in targets.into_iter().zip(&snapshot.tensors) {
            target
                .shallow_clone()
                .f_copy_(saved)
                .map_err(|e| fatal("rolling back")(e.to_string()))?;
        }
        self.sgd
            .load_state(&snapshot.momentum)
            .map_err(fatal("rolling back the optimiser"))?;
        if let Some(saved) = snapshot.scaler {
            self.scaler.restore(saved);
        }
        let undone = self.global_step - snapshot.global_step;
        self.global_step = snapshot.global_step;
        Ok(RollbackReply { undone })
    }

    pub(super) fn regroup(&mut self, request: RegroupRequest) -> Result<RegroupReply, MethodError> {
        let old_rank = self.init.rank;
        let fail = |what: String| MethodError::fatal(format!("rank {old_rank}: {what}"));
        let workers = self.init.job.data.loader_workers.max(1);
        let shape = ClusterShape::with_node_ranks(request.node_ranks.clone(), workers);
        let survivors: Vec<Rank> = request.survivors.iter().map(|&r| Rank(r)).collect();
        let mut reply = RegroupReply::default();
        let mut continued: Option<(u64, Plan, RankCursor)> = None;
        if !request.cursors.is_empty() {
            let plan = self.epoch_plan(request.epoch)?;
            let regrouped = pipelines::regroup(&plan, &request.cursors, &survivors, shape.clone())
                .map_err(|e| fail(format!("epoch {}: {e}", request.epoch)))?;
            let mine = request.rank as usize;
            let cursor = regrouped
                .cursors
                .get(mine)
                .cloned()
                .ok_or_else(|| fail(format!("no rank {} among the survivors", request.rank)))?;
            reply.steps_in_epoch = regrouped.plan.steps().unwrap_or(0);
            continued = Some((request.epoch, regrouped.plan, cursor));
        }
        let planner = self
            .init
            .job
            .data
            .train_planner(shape.clone(), self.init.job.optim.batch_size)
            .map_err(|e| fail(format!("training plan for {}: {e}", shape.layout())))?;
        let steps_per_epoch = planner
            .plan(0)
            .map_err(|e| fail(format!("planning for {}: {e}", shape.layout())))?
            .steps()
            .ok_or_else(|| fail("the new world's batch counts are unknown".to_string()))?;
        // The schedule keeps its shape in epochs: the same point of training, counted in
        // the smaller world's (more numerous) steps, at the new global batch's rate.
        let position =
            self.lr_step() as f64 * steps_per_epoch as f64 / self.steps_per_epoch.max(1) as f64;
        self.init.job.optim.lr = request.lr;
        self.schedule = schedule(&self.init, steps_per_epoch);
        self.lr_offset = position.round() as i64 - self.global_step as i64;
        self.init.rank = request.rank;
        self.init.world = request.node_ranks.iter().sum();
        self.init.node_ranks = request.node_ranks;
        self.shape = shape;
        self.planner = planner;
        self.steps_per_epoch = steps_per_epoch;
        if reply.steps_in_epoch == 0 {
            reply.steps_in_epoch = steps_per_epoch;
        }
        reply.steps_per_epoch = steps_per_epoch;
        self.resume_cursor = continued.as_ref().map(|(_, _, c)| c.clone());
        reply.cursor = self.resume_cursor.clone();
        self.continued = continued.map(|(epoch, plan, _)| (epoch, plan));
        super::phase::start(request.rank);
        Ok(reply)
    }

    /// The plan of `epoch` this rank runs: the regrouped one after a loss in it.
    pub(super) fn epoch_plan(&self, epoch: u64) -> Result<Plan, MethodError> {
        if let Some((at, plan)) = &self.continued
            && *at == epoch
        {
            return Ok(plan.clone());
        }
        self.planner
            .plan(epoch)
            .map_err(|e| MethodError::fatal(format!("planning epoch {epoch}: {e}")))
    }

    /// Gives every rank of a re-formed ring rank 0's optimiser state, step and schedule
    /// position (a trainer that joined a growing job has none of its own).
    pub(super) fn share_state(&mut self, sync: &mut GradSync) -> Result<(), MethodError> {
        let rank = self.init.rank;
        let failed = |what: &str, e: &dyn std::fmt::Display| {
            MethodError::fatal(format!("rank {rank}: sharing the {what}: {e}"))
        };
        let momentum = self.sgd.state_or_zeros();
        let tensors: Vec<Tensor> = momentum.iter().map(|(_, t)| t.shallow_clone()).collect();
        sync.broadcast(&tensors, 0)
            .map_err(|e| ring_failure(rank, "sharing the optimiser state", &e))?;
        self.sgd
            .load_state(&momentum)
            .map_err(|e| failed("optimiser state", &e))?;
        let scaler = self.scaler.state();
        // Whole numbers travel as 16-bit pieces, each exact in an f32.
        let words = [
            self.global_step,
            self.lr_offset as u64,
            scaler.map_or(0, |s| u64::from(s.finite_steps)),
            scaler.map_or(0, |s| s.scale.to_bits()),
        ];
        let mut values: Vec<f32> = words
            .iter()
            .flat_map(|w| (0..4).map(move |i| ((w >> (16 * i)) & 0xffff) as f32))
            .collect();
        sync.broadcast_values(&mut values, 0)
            .map_err(|e| ring_failure(rank, "sharing the step and schedule", &e))?;
        let word = |k: usize| {
            (0..4).fold(0u64, |acc, i| {
                acc | ((values[4 * k + i] as u64) << (16 * i))
            })
        };
        self.global_step = word(0);
        self.lr_offset = word(1) as i64;
        if let Some(mut state) = scaler {
            state.finite_steps = u32::try_from(word(2)).unwrap_or(u32::MAX);
            state.scale = f64::from_bits(word(3));
            self.scaler.restore(state);
        }
        Ok(())
    }

    /// The step the learning-rate schedule is at.
    pub(super) fn lr_step(&self) -> u64 {
        (self.global_step as i64 + self.lr_offset).max(0) as u64
    }
}
