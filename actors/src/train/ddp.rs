//! Data-parallel synchronisation of replicas: gradients flattened into buckets and
//! averaged across ranks, weighted by the samples each rank processed; and broadcasts of
//! parameters and buffers from rank 0.
//!
//! Two transports. imgrun's ring allreduce (`runtime::RingGroup`) over TCP runs on a
//! communication thread of its own with a single-threaded tokio runtime, so bucket `k` is
//! on the wire while the trainer flattens bucket `k + 1`; CUDA tensors are staged through
//! host memory a bucket at a time. Between CUDA trainers, NCCL (once [`GradSync::use_nccl`]
//! hands it a communicator) reduces buckets flattened on the device, on the default
//! stream, and takes over broadcasts; the ring stays for small host-side sums and for the
//! ranks to agree on things.
//!
//! Buckets hold parameters in a fixed order (the model's sorted names), so every rank
//! cuts the same buckets, and every rank receives the same reduced bytes: the replicas
//! stay bit-identical. With [`GradSync::overlap_backward`] (CPU parameters on the ring),
//! buckets are cut in the order backward produces gradients instead, one the ranks agree
//! on, and leave for the ring during backward (`overlap.rs`).

use std::future::Future;
use std::ops::Range;
use std::time::{Duration, Instant};

use runtime::{CollectiveError, RingGroup};
use tch::{Device, Kind, Tensor};

use super::bucket::{
    Op, append_grad, append_values, cut_buckets, flatten_grads, flatten_values, scatter_values,
    write_grad, write_grad_tensor, write_values,
};
use super::comm::{CommThread, SyncError};
use super::nccl::Communicator;
use super::overlap::{Overlap, Sent};
use super::transfer::to_device_async;

/// Averages gradients and broadcasts state across the ranks of one ring.
#[derive(Debug)]
pub struct GradSync {
    /// The gradient-ready hooks, when averaging overlaps backward. Declared before
    /// `comm`: dropping it first lets go of its handle on the communication thread.
    overlap: Option<Overlap>,
    comm: Comm,
    /// Parameter index ranges, one per bucket.
    buckets: Vec<Range<usize>>,
    numels: Vec<usize>,
    bucket_elems: usize,
    /// Buffers handed back by the communication thread, reused.
    spare: Vec<Vec<f32>>,
    /// Averages and broadcasts on the device, when every rank has one (NCCL).
    device: Option<Box<dyn DeviceCollective>>,
    rank: usize,
    world: usize,
}

/// What one [`GradSync::average`] did.
#[derive(Debug, Clone, Copy, Default)]
pub struct SyncStats {
    /// Samples over all ranks (the total weight).
    pub samples: f32,
    /// Time from the first bucket sent to the last one back.
    pub wait: Duration,
    pub buckets: usize,
    /// Whether every averaged gradient value is finite (the same answer on every rank).
    pub finite: bool,
}

impl GradSync {
    /// Starts the communication thread, which forms its ring with `connect` (run on the
    /// thread's own runtime, where the ring's sockets then live), and cuts `parameters`
    /// into buckets of about `bucket_bytes`.
    pub fn start<F, Fut>(
        connect: F,
        parameters: &[Tensor],
        bucket_bytes: usize,
    ) -> Result<Self, SyncError>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<RingGroup, CollectiveError>>,
    {
        let comm = Comm::start(connect)?;
        let numels: Vec<usize> = parameters.iter().map(Tensor::numel).collect();
        let buckets = cut_buckets(&numels, bucket_bytes / 4);
        Ok(Self {
            rank: comm.rank,
            world: comm.world,
            comm,
            buckets,
            numels,
            bucket_elems: bucket_bytes / 4,
            spare: Vec::new(),
            device: None,
            overlap: None,
        })
    }

    /// From now on, [`GradSync::average`] overlaps backward: hooks on `parameters`
    /// (those `average` gets, in the same order) send each bucket to the ring as soon
    /// as backward has produced its gradients. Steps need [`GradSync::before_backward`]
    /// then. Does nothing for parameters off the CPU or with a device collective (NCCL
    /// averages after backward). Every rank must make the same call at the same point;
    /// the first step where rank 0 has data is not overlapped: it records the order in
    /// which gradients come, which all ranks then take from rank 0.
    pub fn overlap_backward(&mut self, parameters: &[Tensor]) -> Result<(), SyncError> {
        self.overlap = None;
        if self.device.is_some() || parameters.iter().any(|p| p.device() != Device::Cpu) {
            return Ok(());
        }
        self.overlap = Some(Overlap::install(
            parameters,
            &self.numels,
            self.bucket_elems,
        )?);
        Ok(())
    }

    /// Whether steps overlap backward (the buckets agreed).
    pub fn overlapping(&self) -> bool {
        self.overlap.as_ref().is_some_and(Overlap::agreed)
    }

    /// Before a step's backward, with this rank's weight (`samples`, as `average`
    /// gets it): arms the hooks of [`GradSync::overlap_backward`]; otherwise nothing.
    pub fn before_backward(&mut self, samples: f32) -> Result<(), SyncError> {
        if let Some(overlap) = &self.overlap {
            overlap.arm(self.comm.thread.sender()?, samples, &mut self.spare);
        }
        Ok(())
    }

    /// After a step whose backward failed (before `average`): disarms the hooks. A
    /// bucket already sent stays in flight; the ranks' ring is no use after that.
    pub fn abandon_step(&mut self) {
        if let Some(overlap) = &self.overlap {
            overlap.finish_abandoned();
        }
    }

    /// From now on, gradients are averaged and tensors broadcast on the device through
    /// `collective` (NCCL). Every rank must switch at the same point (the ranks agree
    /// over the ring first).
    pub fn use_device_collective(&mut self, collective: Box<dyn DeviceCollective>) {
        self.device = Some(collective);
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    pub fn buckets(&self) -> usize {
        self.buckets.len()
    }

    /// Replaces each parameter's gradient with the mean over all ranks, weighted by
    /// `samples` (this rank's batch size; 0 for a rank out of data, whose gradients are
    /// ignored), then multiplied by `unscale` (the inverse of a mixed-precision loss
    /// scale; 1 without). `extra` values (a loss, an accuracy) ride along in the last
    /// bucket and come back as weighted means too. A parameter without a gradient counts
    /// as zeros and gets one.
    pub fn average(
        &mut self,
        parameters: &[Tensor],
        samples: f32,
        extra: &mut [f32],
        unscale: f32,
    ) -> Result<SyncStats, SyncError> {
        if let Some(device) = &self.device {
            return average_on_device(
                device.as_ref(),
                &self.buckets,
                parameters,
                samples,
                extra,
                unscale,
            );
        }
        if let Some(overlap) = self.overlap.take() {
            let result = self.average_overlapped(&overlap, parameters, samples, extra, unscale);
            self.overlap = Some(overlap);
            return result;
        }
        self.average_after(parameters, samples, extra, unscale)
    }

    /// `average` with the hooks of `overlap_backward`: the buckets backward filled are
    /// on the ring already; the rest leave now. Before the ranks agree on buckets, the
    /// step averages after backward and then takes rank 0's order of gradients.
    fn average_overlapped(
        &mut self,
        overlap: &Overlap,
        parameters: &[Tensor],
        samples: f32,
        extra: &mut [f32],
        unscale: f32,
    ) -> Result<SyncStats, SyncError> {
        let started = Instant::now();
        let finished = match overlap.finish(extra) {
            // The thread ended (on an abort): its last answer says why.
            Err(SyncError::ThreadGone) => Err(self.comm.why_gone()),
            other => other,
        };
        let Some(sent) = finished? else {
            let stats = self.average_after(parameters, samples, extra, unscale)?;
            let mut order = overlap.proposal(self.rank);
            self.broadcast_values(&mut order, 0)?;
            overlap.agree(&order)?;
            return Ok(stats);
        };
        let Sent { buckets } = sent;
        let count = buckets.len();
        let (mut total, mut finite) = (0.0, true);
        for (b, members) in buckets.iter().enumerate() {
            let at = (b, count);
            let (buffer, t, f) =
                self.receive_bucket(at, members.iter().copied(), parameters, extra, unscale)?;
            (total, finite) = (t, finite && f);
            overlap.reuse(b, buffer);
        }
        Ok(SyncStats {
            samples: total,
            wait: started.elapsed(),
            buckets: count,
            finite,
        })
    }

    /// `average` after backward: buckets of the model's order, flattened now.
    fn average_after(
        &mut self,
        parameters: &[Tensor],
        samples: f32,
        extra: &mut [f32],
        unscale: f32,
    ) -> Result<SyncStats, SyncError> {
        let started = Instant::now();
        let count = self.buckets.len();
        let on_device = parameters
            .first()
            .is_some_and(|p| p.device() != Device::Cpu);
        for (b, range) in self.buckets.iter().enumerate() {
            let mut buffer = self.spare.pop().unwrap_or_default();
            buffer.clear();
            if on_device {
                // One copy to the host per bucket, not one per parameter.
                append_values(&mut buffer, &flatten_grads(parameters, range.clone())?)?;
            } else {
                for p in range.clone() {
                    append_grad(&mut buffer, &parameters[p], self.numels[p])?;
                }
            }
            if b + 1 == count {
                buffer.extend_from_slice(extra);
            }
            self.comm.send(Op::Mean {
                buffer,
                weight: samples,
            })?;
        }
        let mut total = 0.0;
        let mut finite = true;
        for (b, range) in self.buckets.clone().into_iter().enumerate() {
            let (buffer, t, f) =
                self.receive_bucket((b, count), range, parameters, extra, unscale)?;
            (total, finite) = (t, finite && f);
            self.spare.push(buffer);
        }
        Ok(SyncStats {
            samples: total,
            wait: started.elapsed(),
            buckets: count,
            finite,
        })
    }

    /// Receives the average of bucket `b` of `count` (`at`), which holds the parameters
    /// `members` (and, the last one, the `extra` values after them), and writes it,
    /// unscaled, into their gradients. Returns the buffer (for reuse), the ranks' total
    /// weight, and whether every averaged gradient is finite.
    fn receive_bucket(
        &mut self,
        (b, count): (usize, usize),
        members: impl IntoIterator<Item = usize>,
        parameters: &[Tensor],
        extra: &mut [f32],
        unscale: f32,
    ) -> Result<(Vec<f32>, f32, bool), SyncError> {
        super::phase::averaging(b, count);
        let Done { mut buffer, total } = self.comm.receive()?;
        let last = b + 1 == count;
        let grads = buffer.len() - if last { extra.len() } else { 0 };
        if unscale != 1.0 {
            buffer[..grads].iter_mut().for_each(|x| *x *= unscale);
        }
        let finite = buffer[..grads].iter().all(|x| x.is_finite());
        let mut offset = 0;
        for p in members {
            let n = self.numels[p];
            write_grad(&parameters[p], &buffer[offset..offset + n])?;
            offset += n;
        }
        if last {
            extra.copy_from_slice(&buffer[offset..]);
        }
        Ok((buffer, total, finite))
    }

    /// Copies rank `root`'s values of `tensors` into every rank's (parameters at the
    /// start, BatchNorm statistics after each step).
    pub fn broadcast(&mut self, tensors: &[Tensor], root: usize) -> Result<(), SyncError> {
        if tensors.is_empty() {
            return Ok(());
        }
        if let Some(device) = &self.device {
            let flat = flatten_values(tensors)?;
            device.broadcast(&flat, root)?;
            return scatter_values(&flat, tensors);
        }
        let mut buffer = self.spare.pop().unwrap_or_default();
        buffer.clear();
        for t in tensors {
            append_values(&mut buffer, t)?;
        }
        self.comm.send(Op::Broadcast { buffer, root })?;
        let Done { buffer, .. } = self.comm.receive()?;
        let mut offset = 0;
        for t in tensors {
            let n = t.numel();
            write_values(t, &buffer[offset..offset + n])?;
            offset += n;
        }
        self.spare.push(buffer);
        Ok(())
    }

    /// Replaces `values` with their mean over all ranks, through the ring on the host
    /// (every rank gets the same bits).
    pub fn mean_values(&mut self, values: &mut Vec<f32>) -> Result<(), SyncError> {
        self.comm.send(Op::Mean {
            buffer: std::mem::take(values),
            weight: 1.0,
        })?;
        *values = self.comm.receive()?.buffer;
        Ok(())
    }

    /// Replaces `values` with rank `root`'s, through the ring on the host.
    pub fn broadcast_values(
        &mut self,
        values: &mut Vec<f32>,
        root: usize,
    ) -> Result<(), SyncError> {
        self.comm.send(Op::Broadcast {
            buffer: std::mem::take(values),
            root,
        })?;
        *values = self.comm.receive()?.buffer;
        Ok(())
    }

    /// Sums `values` over all ranks, in place.
    pub fn sum(&mut self, values: &mut [f32]) -> Result<(), SyncError> {
        self.comm.send(Op::Sum {
            buffer: values.to_vec(),
        })?;
        let Done { buffer, .. } = self.comm.receive()?;
        values.copy_from_slice(&buffer);
        Ok(())
    }
}

/// In-place collectives on flat float tensors where they live (NCCL's on CUDA), with the
/// ring's guarantee: every rank gets the same bits.
pub trait DeviceCollective: Send + std::fmt::Debug {
    fn all_reduce_sum(&self, tensor: &Tensor) -> Result<(), SyncError>;
    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<(), SyncError>;
}

impl DeviceCollective for Communicator {
    fn all_reduce_sum(&self, tensor: &Tensor) -> Result<(), SyncError> {
        Ok(Communicator::all_reduce_sum(self, tensor)?)
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<(), SyncError> {
        Ok(Communicator::broadcast(self, tensor, root)?)
    }
}

/// [`GradSync::average`] on the device (NCCL): each bucket is flattened on the device, multiplied
/// by this rank's weight (zeroed at weight 0, so a rank without data cannot spread a NaN)
/// and summed in place; the last bucket carries the extra values and the weight. Every
/// bucket is then divided by the total weight and copied into the gradients, all on the
/// device; one read at the end brings the extra values' means, the total and whether the
/// gradients are finite to the host (the step's one synchronisation here).
fn average_on_device(
    collective: &dyn DeviceCollective,
    buckets: &[Range<usize>],
    parameters: &[Tensor],
    samples: f32,
    extra: &mut [f32],
    unscale: f32,
) -> Result<SyncStats, SyncError> {
    let started = Instant::now();
    let Some(device) = parameters.first().map(Tensor::device) else {
        return Ok(SyncStats {
            finite: true,
            ..SyncStats::default()
        });
    };
    let count = buckets.len();
    let mut flats = Vec::with_capacity(count);
    for (b, range) in buckets.iter().enumerate() {
        let mut flat = flatten_grads(parameters, range.clone())?;
        if b + 1 == count {
            let mut tail = extra.to_vec();
            tail.push(1.0);
            let tail = to_device_async(&Tensor::f_from_slice(&tail)?, device)?;
            flat = Tensor::f_cat(&[flat, tail], 0)?;
        }
        if samples > 0.0 {
            let _ = flat.f_mul_scalar_(f64::from(samples))?;
        } else {
            let _ = flat.f_zero_()?;
        }
        collective.all_reduce_sum(&flat)?;
        flats.push(flat);
    }
    // One read back to the host, at the end: the means of the extra values, the total
    // weight and whether every averaged gradient is finite, all worked out on the device
    // (before: one read of the sums and another of the finite flag). Each division is the
    // f32 one the host made before, so the values are the same bits.
    // `cut_buckets` always makes at least one bucket.
    let last = flats.last().expect("at least one bucket");
    let length = last.numel();
    let tail_length = extra.len() + 1;
    let tail = last.f_narrow(0, (length - tail_length) as i64, tail_length as i64)?;
    let total = tail.f_narrow(0, extra.len() as i64, 1)?;
    let positive = total.f_gt(0.0)?;
    let means = tail
        .f_narrow(0, 0, extra.len() as i64)?
        .f_div(&total)?
        .f_where_scalarother(&positive, 0.0)?;
    let factor = Tensor::f_full([1], f64::from(unscale), (Kind::Float, device))?
        .f_div(&total)?
        .f_where_scalarother(&positive, 0.0)?;
    let mut finite = Tensor::f_ones([1], (Kind::Bool, device))?;
    for (b, (range, flat)) in buckets.iter().zip(&flats).enumerate() {
        let grads = flat.numel() - if b + 1 == count { tail_length } else { 0 };
        let mut values = flat.f_narrow(0, 0, grads as i64)?;
        let _ = values.f_mul_(&factor)?;
        finite = finite.f_logical_and(&values.f_isfinite()?.f_all()?)?;
        let mut offset = 0;
        for p in range.clone() {
            let n = parameters[p].numel();
            let part = values.f_narrow(0, offset as i64, n as i64)?;
            write_grad_tensor(&parameters[p], &part)?;
            offset += n;
        }
    }
    let read = Tensor::f_cat(&[means, total, finite.f_to_kind(Kind::Float)?], 0)?;
    let read: Vec<f32> = Vec::<f32>::try_from(read.f_to_device(Device::Cpu)?)?;
    extra.copy_from_slice(&read[..extra.len()]);
    let (total, finite) = (read[extra.len()], read[extra.len() + 1] != 0.0);
    Ok(SyncStats {
        samples: total,
        wait: started.elapsed(),
        buckets: count,
        finite,
    })
}

struct Done {
    buffer: Vec<f32>,
    total: f32,
}

/// The communication thread: owns the ring and runs ops in the order sent.
struct Comm {
    thread: CommThread<Op, Result<Done, CollectiveError>>,
    rank: usize,
    world: usize,
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Comm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish_non_exhaustive()
    }
}

impl Comm {
    fn start<F, Fut>(connect: F) -> Result<Self, SyncError>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<RingGroup, CollectiveError>>,
    {
        let (thread, (rank, world)) = CommThread::start(
            "ddp-comm",
            super::comm::abort_signal(),
            connect,
            |group: &RingGroup| (group.rank(), group.world()),
            async |group: &mut RingGroup, op| run(group, op).await,
            |group: &RingGroup| {
                Err(CollectiveError::Aborted {
                    rank: group.rank(),
                    what: "the ring's operation",
                })
            },
        )?;
        Ok(Self {
            thread,
            rank,
            world,
        })
    }

    fn send(&self, op: Op) -> Result<(), SyncError> {
        self.thread.send(op).map_err(|_| self.why_gone())
    }

    /// Why the thread stopped taking ops: the error it answered last (an abort, which
    /// says a peer failed), else that it is gone.
    fn why_gone(&self) -> SyncError {
        loop {
            match self.thread.receive() {
                Ok(Ok(_)) => {}
                Ok(Err(error)) => return error.into(),
                Err(error) => return error,
            }
        }
    }

    fn receive(&self) -> Result<Done, SyncError> {
        Ok(self.thread.receive()??)
    }
}

async fn run(group: &mut RingGroup, op: Op) -> Result<Done, CollectiveError> {
    match op {
        Op::Mean { mut buffer, weight } => {
            let total = group.allreduce_mean_weighted(&mut buffer, weight).await?;
            Ok(Done { buffer, total })
        }
        Op::Broadcast { mut buffer, root } => {
            group.broadcast(&mut buffer, root).await?;
            Ok(Done { buffer, total: 0.0 })
        }
        Op::Sum { mut buffer } => {
            group.allreduce_sum(&mut buffer).await?;
            Ok(Done { buffer, total: 0.0 })
        }
    }
}
