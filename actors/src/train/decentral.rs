//! Decentralized data parallelism (`train.sync = "decentralized"`): every rank steps on
//! its own gradients, and its parameters and BatchNorm buffers are averaged with the
//! step's group of the job's [`runtime::Topology`] instead of the gradients with every
//! rank.
//!
//! A step of rank r, from its state x (parameters and buffers):
//! 1. the mixing thread starts averaging a copy of x with the step's group, while
//! 2. the trainer runs forward and backward on x and takes its own optimiser step,
//!    giving x' (the forward also moves the BatchNorm statistics);
//! 3. once the group's mean m of x is back, the new state is x' + (m - x).
//!
//! That is decentralized SGD with the communication behind the step's compute: the
//! update is the gradient at x, applied to the mixed state. Every group replaces its
//! members' x with their mean, so the mean of the state over all ranks moves by the mean
//! of the local updates only, exactly as the topology's doubly stochastic mixing says.
//! Momentum stays local to each rank.
//!
//! The mixing thread ([`CommThread`]) owns a [`Mixer`], as the gradient ring's thread owns
//! the ring, so the two never wait for each other.

use std::future::Future;

use runtime::{MixError, Mixer};
use tch::{Device, Tensor};

use super::bucket::{append_values, flatten_values, scatter_values};
use super::comm::{CommThread, SyncError};

/// One rank's side of the neighbour averaging: a thread that mixes one state at a time.
#[derive(Debug)]
pub struct MixSync {
    thread: CommThread<(u64, Vec<f32>), Result<Vec<f32>, MixError>>,
    /// The state sent for mixing, kept to take the local update's difference.
    sent: Option<Vec<f32>>,
}

impl MixSync {
    /// Starts the mixing thread, which connects its groups with `connect` on its own
    /// runtime (where their sockets then live).
    pub fn start<F, Fut>(connect: F) -> Result<Self, SyncError>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<Mixer, MixError>>,
    {
        let (thread, ()) = CommThread::start(
            "mix-comm",
            super::comm::abort_signal(),
            connect,
            |_: &Mixer| (),
            async |mixer: &mut Mixer, (step, mut buffer): (u64, Vec<f32>)| {
                mixer.mix(step, &mut buffer).await.map(|_| buffer)
            },
            |_: &Mixer| Err(MixError::Aborted),
        )?;
        Ok(Self { thread, sent: None })
    }

    /// Starts averaging `state` (this rank's before step `step`) with the step's group;
    /// [`MixSync::finish`] applies the result.
    pub fn begin(&mut self, step: u64, state: Vec<f32>) -> Result<(), SyncError> {
        self.thread.send((step, state.clone()))?;
        self.sent = Some(state);
        Ok(())
    }

    /// Waits for the group's mean of the state [`MixSync::begin`] sent, and moves
    /// `tensors` (which held that state, and have since taken the local step) by the
    /// mean's difference from it.
    pub fn finish(&mut self, tensors: &[Tensor]) -> Result<(), SyncError> {
        let mixed = self.thread.receive()??;
        let sent = self.sent.take().ok_or(SyncError::ThreadGone)?;
        let mut now = Vec::with_capacity(sent.len());
        read_state(tensors, &mut now)?;
        add_difference(&mut now, &mixed, &sent);
        write_state(tensors, &now)
    }
}

/// `now += mixed - sent`, element by element: the local update carried over to the
/// mixed state.
pub fn add_difference(now: &mut [f32], mixed: &[f32], sent: &[f32]) {
    for ((x, m), s) in now.iter_mut().zip(mixed).zip(sent) {
        *x += m - s;
    }
}

/// Appends the values of `tensors` to `into`, as floats on the host (one copy from the
/// device for CUDA tensors).
pub fn read_state(tensors: &[Tensor], into: &mut Vec<f32>) -> Result<(), SyncError> {
    if tensors.is_empty() {
        return Ok(());
    }
    if tensors[0].device() == Device::Cpu {
        for tensor in tensors {
            append_values(into, tensor)?;
        }
        Ok(())
    } else {
        append_values(into, &flatten_values(tensors)?)
    }
}

/// Sets `tensors` to consecutive slices of `values`, each in its own kind and device.
pub fn write_state(tensors: &[Tensor], values: &[f32]) -> Result<(), SyncError> {
    let Some(device) = tensors.first().map(Tensor::device) else {
        return Ok(());
    };
    let wanted: usize = tensors.iter().map(Tensor::numel).sum();
    if values.len() != wanted {
        return Err(SyncError::Tensor(tch::TchError::Shape(format!(
            "{} values for tensors of {wanted}",
            values.len()
        ))));
    }
    let flat = Tensor::f_from_slice(values)?.f_to_device(device)?;
    scatter_values(&flat, tensors)
}

/// The Euclidean distance between two states.
pub fn distance(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| f64::from(x - y).powi(2))
        .sum::<f64>()
        .sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;
    use runtime::{CollectiveOptions, Topology};
    use tch::Kind;

    #[test]
    fn states_round_trip_through_host_values_in_their_kinds() {
        let weight = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).view([2, 2]);
        let count = Tensor::from_slice(&[7i64]);
        let tensors = [weight.shallow_clone(), count.shallow_clone()];
        let mut values = Vec::new();
        read_state(&tensors, &mut values).expect("read");
        assert_eq!(values, [1.0, 2.0, 3.0, 4.0, 7.0]);
        write_state(&tensors, &[0.5, 1.5, 2.5, 3.5, 9.0]).expect("write");
        assert_eq!(
            Vec::<f32>::try_from(weight.flatten(0, -1)).expect("values"),
            [0.5, 1.5, 2.5, 3.5]
        );
        assert_eq!(count.kind(), Kind::Int64);
        assert_eq!(count.int64_value(&[0]), 9);
        let err = write_state(&tensors, &[1.0]).expect_err("too few values");
        assert!(
            err.to_string().contains("1 values for tensors of 5"),
            "{err}"
        );
    }

    /// Four ranks, each with its own state and local update, mixing over every topology
    /// for a few steps through real mixing threads: the mean over the ranks moves by the
    /// mean local update alone, and a group's members end equal when they took no update.
    #[test]
    fn mixing_after_local_steps_keeps_the_mean_of_the_updates() {
        let world = 4usize;
        let nodes = [0u32, 0, 1, 1];
        for topology in Topology::ALL {
            let mixers = Mixer::in_memory(topology, &nodes, CollectiveOptions::default());
            let mut syncs: Vec<MixSync> = mixers
                .into_iter()
                .map(|mixer| MixSync::start(move || async move { Ok(mixer) }).expect("start"))
                .collect();
            let states: Vec<Tensor> = (0..world)
                .map(|r| Tensor::from_slice(&[r as f32, 10.0 * r as f32, -(r as f32)]))
                .collect();
            let mean = |states: &[Tensor]| -> Vec<f32> {
                let mut sum = vec![0.0f32; 3];
                for state in states {
                    let values: Vec<f32> = Vec::try_from(state).expect("values");
                    sum.iter_mut().zip(values).for_each(|(s, v)| *s += v);
                }
                sum.into_iter().map(|s| s / world as f32).collect()
            };
            for step in 0..5u64 {
                let before = mean(&states);
                for (sync, state) in syncs.iter_mut().zip(&states) {
                    let mut values = Vec::new();
                    read_state(std::slice::from_ref(state), &mut values).expect("read");
                    sync.begin(step, values).expect("begin");
                }
                // The local steps: rank r moves by r * 0.25 on every value.
                for (r, state) in states.iter().enumerate() {
                    let mut moved = state.shallow_clone();
                    let _ = moved.f_add_scalar_(r as f64 * 0.25).expect("step");
                }
                // Finished in reverse rank order: the threads mix on their own.
                for (sync, state) in syncs.iter_mut().zip(&states).rev() {
                    sync.finish(std::slice::from_ref(state)).expect("finish");
                }
                let after = mean(&states);
                let moved = (0..world).map(|r| r as f32 * 0.25).sum::<f32>() / world as f32;
                for (b, a) in before.iter().zip(&after) {
                    assert!(
                        (b + moved - a).abs() < 1e-4,
                        "{topology} step {step}: mean {before:?} -> {after:?}"
                    );
                }
            }
            // A complete step without updates leaves every rank at the mean.
            if topology == Topology::Complete {
                for (sync, state) in syncs.iter_mut().zip(&states) {
                    let mut values = Vec::new();
                    read_state(std::slice::from_ref(state), &mut values).expect("read");
                    sync.begin(5, values).expect("begin");
                }
                for (sync, state) in syncs.iter_mut().zip(&states) {
                    sync.finish(std::slice::from_ref(state)).expect("finish");
                }
                let first: Vec<f32> = Vec::try_from(&states[0]).expect("values");
                for state in &states[1..] {
                    assert_eq!(Vec::<f32>::try_from(state).expect("values"), first);
                }
            }
        }
    }

    #[test]
    fn distance_is_euclidean() {
        assert_eq!(distance(&[0.0, 3.0], &[4.0, 0.0]), 5.0);
        assert_eq!(distance(&[], &[]), 0.0);
    }
}
