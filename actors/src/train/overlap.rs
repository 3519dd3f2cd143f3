//! Averaging behind backward: each CPU parameter gets a gradient-ready hook
//! (`csrc/grad_hooks.cpp`, libtorch's post-accumulate-grad hook) that copies the
//! gradient into its bucket the moment backward has written it, and hands a full bucket
//! to the communication thread while backward goes on with the layers below.
//!
//! Buckets follow the order in which gradients become ready (about the reverse of the
//! forward order), so the first buckets fill early. Every rank must cut the same buckets
//! and send them in the same order: the order is recorded once, on a step where rank 0
//! has data, and rank 0's is broadcast to all ([`Overlap::agree`]). Buckets leave in
//! bucket order only (a bucket that fills early waits for the ones before it), and the
//! last one leaves after backward with the step's extra values, so the sequence of
//! collectives is the same on every rank whatever backward does.
#![allow(unsafe_code)] // FFI to csrc/grad_hooks.cpp: hooks set and cleared, two callbacks.

use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard, mpsc};

use tch::{Kind, Tensor};
use torch_sys::C_tensor;

use super::bucket::Op;
use super::comm::SyncError;

type GradReady = unsafe extern "C" fn(context: *mut c_void, index: usize, grad: *mut C_tensor);
type Release = unsafe extern "C" fn(context: *mut c_void);

unsafe extern "C" {
    fn imgrun_set_grad_ready_hook(
        parameter: *const C_tensor,
        ready: GradReady,
        release: Release,
        context: *mut c_void,
        index: usize,
    ) -> i32;
    fn imgrun_clear_grad_ready_hook(parameter: *const C_tensor, context: *const c_void);
}

/// The hooks of one set of parameters, and the step they feed.
pub(super) struct Overlap {
    shared: Arc<Mutex<Step>>,
    /// The hooked parameters, to take the hooks off again.
    hooked: Vec<Tensor>,
    numels: Vec<usize>,
    /// Elements per bucket, about.
    bucket_elems: usize,
}

impl std::fmt::Debug for Overlap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Overlap")
            .field("parameters", &self.numels.len())
            .finish_non_exhaustive()
    }
}

/// What [`Overlap::finish`] hands back: the step's buckets, sent, to receive in order.
pub(super) struct Sent {
    pub(super) buckets: Vec<Vec<usize>>,
}

impl Overlap {
    /// Hooks every parameter of `parameters` (CPU leaves that require grad). The hooks
    /// do nothing until [`Overlap::arm`].
    pub(super) fn install(
        parameters: &[Tensor],
        numels: &[usize],
        bucket_elems: usize,
    ) -> Result<Self, SyncError> {
        let shared = Arc::new(Mutex::new(Step::new(parameters.len())));
        let mut overlap = Self {
            shared,
            hooked: Vec::with_capacity(parameters.len()),
            numels: numels.to_vec(),
            bucket_elems,
        };
        for (index, parameter) in parameters.iter().enumerate() {
            let context = Arc::into_raw(Arc::clone(&overlap.shared)) as *mut c_void;
            // SAFETY: `parameter` is a live tensor handle for the call; the shim takes
            // `context` (one strong count of `shared`) and gives it back through
            // `release` exactly once, whatever happens.
            let status = unsafe {
                imgrun_set_grad_ready_hook(parameter.as_ptr(), ready, release, context, index)
            };
            if status != 0 {
                // `overlap`'s drop takes off the hooks set so far.
                return Err(SyncError::Overlap(format!(
                    "parameter {index} takes no gradient hook (not a leaf that requires grad)"
                )));
            }
            overlap.hooked.push(parameter.shallow_clone());
        }
        Ok(overlap)
    }

    /// Whether the ranks have agreed on the buckets (until then steps are not overlapped).
    pub(super) fn agreed(&self) -> bool {
        self.step().plan.is_some()
    }

    /// Arms the hooks for one backward: with agreed buckets, each full bucket goes to
    /// `ops` weighted by `weight` (this rank's samples); before that, the hooks record
    /// the order in which gradients come.
    pub(super) fn arm(&self, ops: mpsc::Sender<Op>, weight: f32, spare: &mut Vec<Vec<f32>>) {
        let mut step = self.step();
        step.armed = true;
        step.error = None;
        step.stopped = false;
        step.weight = weight;
        step.fired.iter_mut().for_each(|f| *f = false);
        step.seen.clear();
        step.next = 0;
        let Some((sizes, counts)) = step.plan.as_ref().map(|plan| {
            let counts: Vec<usize> = plan.buckets.iter().map(Vec::len).collect();
            (plan.sizes.clone(), counts)
        }) else {
            return;
        };
        for (b, (size, count)) in sizes.into_iter().zip(counts).enumerate() {
            let mut buffer = std::mem::take(&mut step.buffers[b]);
            if buffer.capacity() == 0 {
                buffer = spare.pop().unwrap_or_default();
            }
            // Every element is written before the bucket leaves (by a hook or, for a
            // parameter without a gradient, by `finish`): only new room is zeroed.
            buffer.truncate(size);
            buffer.resize(size, 0.0);
            step.buffers[b] = buffer;
            step.left[b] = count;
        }
        step.ops = Some(ops);
    }

    /// Disarms the hooks after backward. With agreed buckets: fills in the parameters
    /// without a gradient with zeros, appends `extra` to the last bucket and sends every
    /// bucket not sent yet, in order.
    pub(super) fn finish(&self, extra: &[f32]) -> Result<Option<Sent>, SyncError> {
        let mut step = self.step();
        let armed = std::mem::replace(&mut step.armed, false);
        let ops = step.ops.take();
        if std::mem::take(&mut step.stopped) {
            return Err(SyncError::ThreadGone);
        }
        if let Some(error) = step.error.take() {
            return Err(SyncError::Overlap(error));
        }
        let Some(plan) = step.plan.take() else {
            return Ok(None);
        };
        if !armed {
            step.plan = Some(plan);
            return Err(SyncError::Overlap(
                "a step averaged without arming the hooks before backward".into(),
            ));
        }
        let result = finish_buckets(&mut step, &plan, &self.numels, ops, extra);
        let buckets = plan.buckets.clone();
        step.plan = Some(plan);
        result.map(|()| Some(Sent { buckets }))
    }

    /// Disarms the hooks after a backward that failed; nothing is sent.
    pub(super) fn finish_abandoned(&self) {
        let mut step = self.step();
        step.armed = false;
        step.ops = None;
        step.error = None;
        step.stopped = false;
    }

    /// Takes back a bucket's buffer once its average is written out.
    pub(super) fn reuse(&self, bucket: usize, buffer: Vec<f32>) {
        let mut step = self.step();
        if let Some(slot) = step.buffers.get_mut(bucket) {
            *slot = buffer;
        }
    }

    /// What the ranks agree on: rank 0's order of the last recorded backward as floats
    /// (every parameter once: those that got no gradient follow in index order), or -1s
    /// when rank 0 recorded none. Every rank sends a vector of the same length.
    pub(super) fn proposal(&self, rank: usize) -> Vec<f32> {
        let step = self.step();
        let count = self.numels.len();
        if rank != 0 || step.seen.is_empty() {
            return vec![-1.0; count];
        }
        let mut order = step.seen.clone();
        order.extend((0..count).filter(|i| !step.fired[*i]));
        order.into_iter().map(|i| i as f32).collect()
    }

    /// Adopts the order rank 0 proposed (every rank gets the same one), unless it had
    /// none; then later steps are overlapped.
    pub(super) fn agree(&self, order: &[f32]) -> Result<(), SyncError> {
        if order.first().is_none_or(|&first| first < 0.0) {
            return Ok(());
        }
        let count = self.numels.len();
        let mut seen = vec![false; count];
        let mut indices = Vec::with_capacity(count);
        for &value in order {
            let index = value as usize;
            if value < 0.0 || value.fract() != 0.0 || index >= count || seen[index] {
                return Err(SyncError::Overlap(format!(
                    "rank 0's gradient order is not a permutation of the {count} parameters"
                )));
            }
            seen[index] = true;
            indices.push(index);
        }
        if indices.len() != count {
            return Err(SyncError::Overlap(format!(
                "rank 0's gradient order has {} of the {count} parameters",
                indices.len()
            )));
        }
        let plan = Plan::cut(&indices, &self.numels, self.bucket_elems);
        let mut step = self.step();
        step.left = vec![0; plan.buckets.len()];
        step.buffers = vec![Vec::new(); plan.buckets.len()];
        step.plan = Some(plan);
        Ok(())
    }

    fn step(&self) -> MutexGuard<'_, Step> {
        // A hook never panics while holding the lock, so it cannot be poisoned; if it
        // were, the state is still consistent (each field is written whole).
        self.shared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Drop for Overlap {
    fn drop(&mut self) {
        let context = Arc::as_ptr(&self.shared) as *const c_void;
        for parameter in &self.hooked {
            // SAFETY: a live tensor handle; the shim removes the hook only if it is
            // this `Overlap`'s (`context`), releasing its count of `shared`.
            unsafe { imgrun_clear_grad_ready_hook(parameter.as_ptr(), context) };
        }
    }
}

/// The agreed buckets: parameter indices in the order their gradients come.
#[derive(Debug, Clone)]
struct Plan {
    buckets: Vec<Vec<usize>>,
    /// Per parameter: its bucket and offset there.
    slots: Vec<(usize, usize)>,
    /// Gradient elements per bucket.
    sizes: Vec<usize>,
}

impl Plan {
    fn cut(order: &[usize], numels: &[usize], limit: usize) -> Self {
        let sizes_in_order: Vec<usize> = order.iter().map(|&i| numels[i]).collect();
        let ranges = super::bucket::cut_buckets(&sizes_in_order, limit);
        let mut slots = vec![(0, 0); numels.len()];
        let mut buckets = Vec::with_capacity(ranges.len());
        let mut sizes = Vec::with_capacity(ranges.len());
        for (b, range) in ranges.into_iter().enumerate() {
            let mut offset = 0;
            let members: Vec<usize> = order[range].to_vec();
            for &p in &members {
                slots[p] = (b, offset);
                offset += numels[p];
            }
            buckets.push(members);
            sizes.push(offset);
        }
        Plan {
            buckets,
            slots,
            sizes,
        }
    }
}

/// One backward's state, shared with the hooks.
struct Step {
    armed: bool,
    plan: Option<Plan>,
    /// Recording (no plan yet): parameter indices in the order their gradients came.
    seen: Vec<usize>,
    fired: Vec<bool>,
    /// Per bucket: parameters whose gradient has not come yet.
    left: Vec<usize>,
    buffers: Vec<Vec<f32>>,
    /// The next bucket to send.
    next: usize,
    ops: Option<mpsc::Sender<Op>>,
    weight: f32,
    /// The first thing that went wrong in a hook, reported by `finish`.
    error: Option<String>,
    /// The communication thread stopped taking ops (it ended on an abort).
    stopped: bool,
}

impl Step {
    fn new(parameters: usize) -> Self {
        Step {
            armed: false,
            plan: None,
            seen: Vec::new(),
            fired: vec![false; parameters],
            left: Vec::new(),
            buffers: Vec::new(),
            next: 0,
            ops: None,
            weight: 0.0,
            error: None,
            stopped: false,
        }
    }

    /// A gradient came for parameter `index`.
    fn gradient(&mut self, index: usize, grad: Option<Tensor>) {
        if !self.armed || self.error.is_some() || self.stopped || index >= self.fired.len() {
            return;
        }
        if std::mem::replace(&mut self.fired[index], true) {
            self.error = Some(format!(
                "parameter {index} got its gradient twice in one backward (a parameter used \
                 twice in the model); set train.overlap = false"
            ));
            return;
        }
        let Some(plan) = self.plan.take() else {
            self.seen.push(index);
            return;
        };
        let (bucket, offset) = plan.slots[index];
        let outcome = match grad {
            Some(grad) => copy_into(&grad, &mut self.buffers[bucket], offset),
            None => Err("no gradient after accumulation".into()),
        };
        match outcome {
            Ok(()) => {
                self.left[bucket] -= 1;
                // The last bucket leaves in `finish`, with the extra values.
                let last = plan.buckets.len() - 1;
                while self.next < last && self.left[self.next] == 0 {
                    let b = self.next;
                    self.next += 1;
                    if !self.send(b) {
                        break;
                    }
                }
            }
            Err(e) => self.error = Some(format!("parameter {index}'s gradient: {e}")),
        }
        self.plan = Some(plan);
    }

    fn send(&mut self, bucket: usize) -> bool {
        let buffer = std::mem::take(&mut self.buffers[bucket]);
        let sent = self.ops.as_ref().is_some_and(|ops| {
            ops.send(Op::Mean {
                buffer,
                weight: self.weight,
            })
            .is_ok()
        });
        self.stopped |= !sent;
        sent
    }
}

fn finish_buckets(
    step: &mut Step,
    plan: &Plan,
    numels: &[usize],
    ops: Option<mpsc::Sender<Op>>,
    extra: &[f32],
) -> Result<(), SyncError> {
    step.ops = ops;
    let last = plan.buckets.len() - 1;
    for b in step.next..=last {
        for &p in &plan.buckets[b] {
            if !step.fired[p] {
                let (_, offset) = plan.slots[p];
                step.buffers[b][offset..offset + numels[p]].fill(0.0);
            }
        }
        if b == last {
            step.buffers[b].extend_from_slice(extra);
        }
        if !step.send(b) {
            step.ops = None;
            return Err(SyncError::ThreadGone);
        }
    }
    step.next = last + 1;
    step.ops = None;
    Ok(())
}

/// Copies `grad` (a CPU tensor of the slot's size) into `buffer[offset..]`.
fn copy_into(grad: &Tensor, buffer: &mut [f32], offset: usize) -> Result<(), String> {
    let n = grad.numel();
    let slot = buffer
        .get_mut(offset..offset + n)
        .ok_or_else(|| format!("{n} values do not fit its bucket slot"))?;
    let flat = grad
        .f_to_kind(Kind::Float)
        .and_then(|g| g.f_contiguous())
        .map_err(|e| e.to_string())?;
    flat.f_copy_data(slot, n).map_err(|e| e.to_string())
}

/// The hook's callback: a parameter's gradient is ready.
unsafe extern "C" fn ready(context: *mut c_void, index: usize, grad: *mut C_tensor) {
    // SAFETY: the shim passes the context it was given, which holds a strong count of
    // the `Mutex<Step>` until `release`; `grad` is a new handle the shim allocated for
    // us (or null), which `Tensor` frees on drop.
    let shared = unsafe { &*(context as *const Mutex<Step>) };
    let grad = (!grad.is_null()).then(|| unsafe { Tensor::from_ptr(grad) });
    // Nothing may unwind into libtorch.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut step = shared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        step.gradient(index, grad);
    }));
}

/// The hook's destructor: gives back its count of the shared state.
unsafe extern "C" fn release(context: *mut c_void) {
    // SAFETY: `context` came from `Arc::into_raw` in `install`, once per hook.
    drop(unsafe { Arc::from_raw(context as *const Mutex<Step>) });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_follow_the_order_and_cover_every_parameter_once() {
        // (order, element counts, limit, buckets).
        type Case = (
            &'static [usize],
            &'static [usize],
            usize,
            &'static [&'static [usize]],
        );
        let cases: [Case; 3] = [
            (&[2, 1, 0], &[4, 4, 4], 8, &[&[2, 1], &[0]]),
            (&[0], &[5], 1, &[&[0]]),
            (&[3, 2, 1, 0], &[1, 20, 1, 1], 8, &[&[3, 2], &[1], &[0]]),
        ];
        for (order, numels, limit, want) in cases {
            let plan = Plan::cut(order, numels, limit);
            let got: Vec<&[usize]> = plan.buckets.iter().map(Vec::as_slice).collect();
            assert_eq!(got, want, "{order:?} {numels:?} limit {limit}");
            for (b, members) in plan.buckets.iter().enumerate() {
                let mut offset = 0;
                for &p in members {
                    assert_eq!(plan.slots[p], (b, offset));
                    offset += numels[p];
                }
                assert_eq!(plan.sizes[b], offset);
            }
        }
    }
}
