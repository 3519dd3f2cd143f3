//! The trainer's side of a decentralized job (`train.sync = "decentralized"`): its
//! mixing groups, its steps (the local step with the neighbours' mixing behind it, see
//! [`crate::train::decentral`]), the replicas' mean for evaluations and the job's end,
//! and checkpoints that keep every rank's replica.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Instant;

use runtime::{CollectiveError, CollectiveOptions, MethodError};
use tch::{Kind, Tensor};

use super::{Trainer, fatal, parse_secret};
use crate::train::checkpoint;
use crate::train::comm::ring_failure;
use crate::train::decentral::{self, MixSync};
use crate::train::phase::{self, Phase};
use crate::train::protocol::{AverageReply, ConnectRequest, SaveRequest, StepRecord, StepTiming};
use crate::train::scaler::StepVerdict;

impl Trainer {
    /// Connects the mixing groups of this rank's schedule to the peers' ports.
    pub(super) fn connect_mixer(&mut self, request: &ConnectRequest) -> Result<(), MethodError> {
        let rank = self.init.rank;
        let world = self.init.world as usize;
        if request.mix_peers.len() != world {
            return Err(MethodError::fatal(format!(
                "rank {rank}: {} mixing addresses for {world} ranks",
                request.mix_peers.len()
            )));
        }
        let topology = self.init.job.optim.topology;
        let nodes = self.rank_nodes();
        let peers = request.mix_peers.clone();
        let listeners = std::mem::take(&mut self.mix_listeners);
        let secret = parse_secret(&request.secret)?;
        let ring_id = request.ring_id.clone();
        let options = CollectiveOptions {
            op_timeout: std::time::Duration::from_secs(request.op_timeout_secs.max(1)),
            ..CollectiveOptions::default()
        };
        let connect = move || async move {
            let listeners = listeners
                .into_iter()
                .map(|listener| {
                    listener
                        .set_nonblocking(true)
                        .and_then(|()| tokio::net::TcpListener::from_std(listener))
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| runtime::MixError::Connect {
                    rank,
                    group: Vec::new(),
                    source: CollectiveError::InvalidArgument {
                        rank: rank as usize,
                        what: format!("a mixing group's listening socket: {e}"),
                    },
                })?;
            let address = |group: &[u32], peer: u32| {
                let index = runtime::Mixer::groups_of(topology, &nodes, peer)
                    .iter()
                    .position(|g| g == group)?;
                let at = peers.get(peer as usize)?;
                Some(SocketAddr::new(at.ip, *at.ports.get(index)?))
            };
            runtime::Mixer::connect(
                rank, topology, &nodes, listeners, address, &secret, &ring_id, options,
            )
            .await
        };
        let mix = MixSync::start(connect).map_err(|e| {
            MethodError::fatal(format!("rank {rank} joining its mixing groups: {e}"))
        })?;
        self.mix = Some(mix);
        Ok(())
    }

    /// One step of a decentralized job: this rank's state goes to its group of the step
    /// for mixing while the rank computes its gradients and steps on them; then the
    /// mixed state replaces the one sent, keeping the local update (see
    /// [`decentral`]). Only the step's loss, accuracy, samples and whether every
    /// rank's gradients are finite are summed over all ranks.
    pub(super) fn step_decentralized(
        &mut self,
        batch: &pipelines::Batch,
    ) -> Result<StepRecord, MethodError> {
        let rank = self.init.rank;
        let state = self.state_tensors();
        let values = host_values(rank, &state)?;
        let mix = self
            .mix
            .as_mut()
            .ok_or_else(|| MethodError::new("train before connect"))?;
        mix.begin(self.global_step, values)
            .map_err(|e| ring_failure(rank, "mixing parameters", &e))?;
        let computing = Instant::now();
        let n = batch.len();
        let [loss, accuracy] = self.forward_backward(batch)?;
        let unscale = 1.0 / self.scaler.scale();
        let mut finite = true;
        if n > 0 {
            let _no_grad = tch::no_grad_guard();
            // Whether every gradient is finite, worked out on the device and read once
            // (before: one read per parameter).
            let mut all_finite = Tensor::ones([], (Kind::Bool, self.device));
            for parameter in &self.params {
                let mut grad = parameter.grad();
                if !grad.defined() {
                    continue;
                }
                if unscale != 1.0 {
                    let _ = grad
                        .f_mul_scalar_(unscale)
                        .map_err(|e| fatal("unscaling")(e.to_string()))?;
                }
                all_finite = all_finite.logical_and(&grad.isfinite().all());
            }
            finite = all_finite
                .f_int64_value(&[])
                .map_err(|e| fatal("checking the gradients")(e.to_string()))?
                != 0;
        }
        let compute_s = computing.elapsed().as_secs_f64();
        phase::enter(Phase::Averaging);
        let waiting = Instant::now();
        let weight = n as f32;
        let mut sums = [loss * weight, accuracy * weight, weight, f32::from(!finite)];
        self.sync
            .as_mut()
            .ok_or_else(|| MethodError::new("train before connect"))?
            .sum(&mut sums)
            .map_err(|e| ring_failure(rank, "summing the step's figures", &e))?;
        let samples = sums[2];
        let lr = self.schedule.lr_at(self.lr_step());
        let loss_scale = self.scaler.scale();
        // Every rank sums the same flags, so all take the same verdict.
        let verdict = self.scaler.update(sums[3] == 0.0);
        match verdict {
            StepVerdict::Diverged => {
                return Err(MethodError::fatal(format!(
                    "step {}: {} rank(s) computed gradients that are not finite (the loss \
                     diverged; try a lower train.lr or a longer warm-up)",
                    self.global_step + 1,
                    sums[3]
                )));
            }
            StepVerdict::Skip => {}
            StepVerdict::Apply if n > 0 => self.sgd.step(lr),
            StepVerdict::Apply => {}
        }
        if let Some(mix) = self.mix.as_mut() {
            mix.finish(&state)
                .map_err(|e| ring_failure(rank, "mixing parameters", &e))?;
        }
        self.global_step += 1;
        let mean = |sum: f32| if samples > 0.0 { sum / samples } else { 0.0 };
        Ok(StepRecord {
            step: self.global_step,
            loss: mean(sums[0]),
            accuracy: mean(sums[1]),
            lr,
            samples: samples as u64,
            loss_scale: self.scaler.enabled().then_some(loss_scale),
            skipped: verdict == StepVerdict::Skip,
            timing: StepTiming {
                compute_s,
                allreduce_s: waiting.elapsed().as_secs_f64(),
                ..StepTiming::default()
            },
            sample_ids: Vec::new(),
        })
    }

    /// Replaces this rank's state (parameters and buffers) with the mean over all ranks;
    /// returns the state it had and its distance from the mean.
    pub(super) fn take_mean_state(&mut self) -> Result<(Vec<f32>, f64), MethodError> {
        let rank = self.init.rank;
        let state = self.state_tensors();
        let own = host_values(rank, &state)?;
        let mut mean = own.clone();
        self.sync
            .as_mut()
            .ok_or_else(|| MethodError::new("averaging before connect"))?
            .mean_values(&mut mean)
            .map_err(|e| ring_failure(rank, "averaging the replicas", &e))?;
        let distance = decentral::distance(&own, &mean);
        decentral::write_state(&state, &mean)
            .map_err(|e| MethodError::fatal(format!("rank {rank}: writing the mean: {e}")))?;
        Ok((own, distance))
    }

    /// Ends a decentralized job: every replica becomes the replicas' mean.
    pub(super) fn average(&mut self) -> Result<AverageReply, MethodError> {
        if !self.decentralized() {
            return Ok(AverageReply { distance: 0.0 });
        }
        let (_, distance) = self.take_mean_state()?;
        Ok(AverageReply { distance })
    }

    /// A decentralized job's save, on every rank: the replicas' mean of the model and the
    /// momentum, and every rank's own, go to rank 0 over the ring (one broadcast per
    /// rank), which writes them all into one checkpoint (see [`checkpoint`]).
    pub(super) fn save_replicas(&mut self, request: SaveRequest) -> Result<PathBuf, MethodError> {
        let (rank, world) = (self.init.rank, self.init.world);
        let mut named = self.model.parameters();
        named.extend(self.model.buffers());
        let model_tensors = named.len();
        named.extend(self.sgd.state_or_zeros());
        let tensors: Vec<Tensor> = named.iter().map(|(_, t)| t.shallow_clone()).collect();
        let own = host_values(rank, &tensors)?;
        let sync = self
            .sync
            .as_mut()
            .ok_or_else(|| MethodError::new("save before connect"))?;
        let mut mean = own.clone();
        sync.mean_values(&mut mean)
            .map_err(|e| ring_failure(rank, "averaging the replicas", &e))?;
        let mut replicas = Vec::new();
        for root in 0..world {
            let mut values = if root == rank {
                own.clone()
            } else {
                vec![0.0; own.len()]
            };
            sync.broadcast_values(&mut values, root as usize)
                .map_err(|e| ring_failure(rank, "gathering the replicas", &e))?;
            if rank == 0 {
                replicas.extend(named_values(&named, &values, |name| {
                    checkpoint::replica_name(root, name)
                })?);
            }
        }
        if rank != 0 {
            return Ok(request.root.join(&request.name));
        }
        let mut mean = named_values(&named, &mean, str::to_string)?;
        let momentum = mean.split_off(model_tensors);
        self.write_checkpoint(request, &mean, &momentum, &replicas)
    }
}

/// The values of `tensors` as host floats, in order.
fn host_values(rank: u32, tensors: &[Tensor]) -> Result<Vec<f32>, MethodError> {
    let mut values = Vec::new();
    decentral::read_state(tensors, &mut values)
        .map_err(|e| MethodError::fatal(format!("rank {rank}: reading its state: {e}")))?;
    Ok(values)
}

/// `values` cut into host tensors shaped, kinded and named like `like`'s (each name
/// through `name`).
fn named_values(
    like: &[(String, Tensor)],
    values: &[f32],
    name: impl Fn(&str) -> String,
) -> Result<Vec<(String, Tensor)>, MethodError> {
    let mut offset = 0;
    let mut out = Vec::with_capacity(like.len());
    for (n, tensor) in like {
        let count = tensor.numel();
        let part = values.get(offset..offset + count).ok_or_else(|| {
            MethodError::new(format!("{} values are too few for `{n}`", values.len()))
        })?;
        let value = Tensor::f_from_slice(part)
            .and_then(|t| t.f_view(tensor.size().as_slice()))
            .and_then(|t| t.f_to_kind(tensor.kind()))
            .map_err(|e| MethodError::new(format!("`{n}`: {e}")))?;
        out.push((name(n), value));
        offset += count;
    }
    Ok(out)
}
