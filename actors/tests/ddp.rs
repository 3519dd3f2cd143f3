//! Data-parallel steps equal single-process steps: two replicas, each with part of a
//! batch, averaging their gradients with `GradSync` over an in-memory ring, end up with
//! the parameters one process gets from the whole batch, for even and uneven splits and
//! for a rank with no data at all (the `join` policy).
//!
//! The same cases run through the on-device path that NCCL drives on CUDA (buckets
//! flattened where the gradients live, weighted, summed in place, divided after), with a
//! stand-in collective that sums CPU tensors between the two rank threads.
//!
//! And through the overlapped path (`GradSync::overlap_backward`): gradient hooks send
//! buckets, cut in the order backward produces gradients, during backward; its replicas
//! end bit-identical to the ring's after backward (two ranks: a sum of two is the same
//! whichever rank adds).
//!
//! BatchNorm runs in eval mode here: in train mode each replica normalises with its own
//! part's statistics, so no data-parallel scheme without synchronised BatchNorm (PyTorch's
//! DDP included) equals the single-process step there.

use std::sync::{Arc, Barrier, Mutex};

use actors::train::{
    DeviceCollective, GradSync, Model, ModelKind, Sgd, SgdConfig, SyncError,
    cross_entropy_smoothed, is_channels_last, to_channels_last,
};
use runtime::{CollectiveOptions, RingGroup};
use tch::{Device, Kind, Tensor};

const CLASSES: i64 = 10;
const LR: f64 = 0.1;

/// Held by every test of this file: each seeds libtorch's one random generator and builds
/// its models from it, so two at once would draw each other's numbers.
fn seeded_alone() -> std::sync::MutexGuard<'static, ()> {
    static SEEDING: Mutex<()> = Mutex::new(());
    // A test that panicked while holding the lock leaves no state behind to protect.
    SEEDING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn model() -> Model {
    tch::manual_seed(7);
    Model::new(ModelKind::SmallCnn, CLASSES, 8, Device::Cpu).expect("model")
}

fn sgd(model: &Model) -> Sgd {
    Sgd::new(
        model.parameters(),
        SgdConfig {
            momentum: 0.9,
            nesterov: true,
            weight_decay: 5e-4,
        },
    )
}

/// Steps of each run: the overlapped path records the order of gradients on the first
/// and overlaps the others.
const STEPS: usize = 3;

/// The steps on the whole batch in one process.
fn single(images: &Tensor, labels: &Tensor) -> Vec<Tensor> {
    let model = model();
    let mut sgd = sgd(&model);
    for _ in 0..STEPS {
        sgd.zero_grad();
        let loss = cross_entropy_smoothed(&model.forward_t(images, false), labels, 0.1);
        loss.backward();
        sgd.step(LR);
    }
    model.parameters().into_iter().map(|(_, t)| t).collect()
}

/// How the replicas average.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Path {
    Ring,
    Device,
    Overlap,
}

/// What NCCL does between GPUs, for CPU tensors between threads: every rank puts its
/// tensor in a slot, and all add the slots up in rank order, so all get the same bits.
#[derive(Debug)]
struct ThreadCollective {
    rank: usize,
    shared: Arc<(Barrier, Mutex<Vec<Option<Tensor>>>)>,
}

impl ThreadCollective {
    fn group(world: usize) -> Vec<ThreadCollective> {
        let shared = Arc::new((
            Barrier::new(world),
            Mutex::new((0..world).map(|_| None).collect()),
        ));
        (0..world)
            .map(|rank| ThreadCollective {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }

    /// Publishes `tensor` (or nothing), then returns every rank's.
    fn exchange(&self, tensor: Option<&Tensor>) -> Vec<Option<Tensor>> {
        let (barrier, slots) = &*self.shared;
        slots.lock().expect("slots")[self.rank] = tensor.map(Tensor::copy);
        barrier.wait();
        let all: Vec<Option<Tensor>> = slots
            .lock()
            .expect("slots")
            .iter()
            .map(|t| t.as_ref().map(Tensor::copy))
            .collect();
        // Nobody overwrites a slot before everyone has read it.
        barrier.wait();
        all
    }
}

impl DeviceCollective for ThreadCollective {
    fn all_reduce_sum(&self, tensor: &Tensor) -> Result<(), SyncError> {
        let all = self.exchange(Some(tensor));
        let mut sum = all[0].as_ref().expect("rank 0's part").copy();
        for part in all[1..].iter().flatten() {
            sum += part;
        }
        tensor.shallow_clone().copy_(&sum);
        Ok(())
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<(), SyncError> {
        let all = self.exchange((self.rank == root).then_some(tensor));
        tensor
            .shallow_clone()
            .copy_(all[root].as_ref().expect("the root's tensor"));
        Ok(())
    }
}

/// A rank's `GradSync` over `group`, on `path`.
fn grad_sync(
    group: RingGroup,
    device: ThreadCollective,
    path: Path,
    params: &[Tensor],
    bucket_bytes: usize,
) -> GradSync {
    let mut sync =
        GradSync::start(move || async move { Ok(group) }, params, bucket_bytes).expect("sync");
    match path {
        Path::Ring => {}
        Path::Device => sync.use_device_collective(Box::new(device)),
        Path::Overlap => sync.overlap_backward(params).expect("gradient hooks"),
    }
    sync
}

/// Two steps on two replicas, rank 0 taking the first `split` samples; with
/// `channels_last`, channels-last images and weights (what a CUDA trainer runs).
fn data_parallel(
    images: &Tensor,
    labels: &Tensor,
    split: i64,
    path: Path,
    channels_last: bool,
) -> [Vec<Tensor>; 2] {
    let n = images.size()[0];
    let parts = [(0, split), (split, n - split)];
    let groups = RingGroup::in_memory(2, CollectiveOptions::default());
    let devices = ThreadCollective::group(2);
    // Built here, one after the other: libtorch's random generator is one per process.
    let models = [model(), model()];
    let images = if channels_last {
        for model in &models {
            model
                .use_channels_last_weights()
                .expect("channels-last weights");
        }
        to_channels_last(images).expect("channels-last images")
    } else {
        images.shallow_clone()
    };
    let results: Vec<Vec<Tensor>> = std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .zip(devices)
            .zip(parts)
            .zip(models)
            .map(|(((group, device), (start, len)), model)| {
                let images = images.narrow(0, start, len);
                let labels = labels.narrow(0, start, len);
                scope.spawn(move || {
                    let mut sgd = sgd(&model);
                    let params: Vec<Tensor> =
                        model.parameters().into_iter().map(|(_, t)| t).collect();
                    // Small buckets, so the step crosses several of them.
                    let mut sync = grad_sync(group, device, path, &params, 4096);
                    assert!(sync.buckets() > 1);
                    // The replicas start from rank 0's weights, as in a job.
                    sync.broadcast(&params, 0).expect("broadcast");
                    for _ in 0..STEPS {
                        sgd.zero_grad();
                        let mut extra = [0.0f32];
                        sync.before_backward(len as f32).expect("arm");
                        if len > 0 {
                            let logits = model.forward_t(&images, false);
                            let loss = cross_entropy_smoothed(&logits, &labels, 0.1);
                            loss.backward();
                            extra[0] = loss.double_value(&[]) as f32;
                        }
                        let stats = sync
                            .average(&params, len as f32, &mut extra, 1.0)
                            .expect("average");
                        assert_eq!(stats.samples, n as f32);
                        assert!(stats.finite);
                        sgd.step(LR);
                    }
                    assert_eq!(sync.overlapping(), path == Path::Overlap);
                    params.iter().map(|p| p.copy()).collect::<Vec<Tensor>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    });
    let [a, b]: [Vec<Tensor>; 2] = results.try_into().expect("two ranks");
    [a, b]
}

/// The batch the data-parallel tests split (seed 1, one libtorch thread), and the
/// parameters one single-process step on it ends with.
fn seeded_batch() -> (Tensor, Tensor, Vec<Tensor>) {
    tch::set_num_threads(1);
    tch::manual_seed(1);
    let images = Tensor::randn([8, 3, 16, 16], (Kind::Float, Device::Cpu));
    let labels = Tensor::randint(CLASSES, [8], (Kind::Int64, Device::Cpu));
    let want = single(&images, &labels);
    (images, labels, want)
}

#[test]
fn data_parallel_steps_equal_the_single_process_step() {
    let _alone = seeded_alone();
    let (images, labels, want) = seeded_batch();
    let start: Vec<Tensor> = model().parameters().into_iter().map(|(_, t)| t).collect();
    for (split, path) in [4, 6, 8].into_iter().flat_map(|split| {
        [
            (split, Path::Ring),
            (split, Path::Device),
            (split, Path::Overlap),
        ]
    }) {
        let [rank0, rank1] = data_parallel(&images, &labels, split, path, false);
        if path == Path::Overlap {
            let [ring, _] = data_parallel(&images, &labels, split, Path::Ring, false);
            for (i, (a, b)) in rank0.iter().zip(&ring).enumerate() {
                assert!(
                    a.equal(b),
                    "split {split}: parameter {i} differs between the overlapped and the ring's steps"
                );
            }
        }
        for (i, ((a, b), w)) in rank0.iter().zip(&rank1).zip(&want).enumerate() {
            assert!(
                a.equal(b),
                "split {split} on {path:?}: parameter {i} differs between the replicas"
            );
            let diff = (a - w).abs().max().double_value(&[]);
            let moved = (w - &start[i]).abs().max().double_value(&[]);
            assert!(
                diff <= 1e-5 * (1.0 + w.abs().max().double_value(&[])),
                "split {split} on {path:?}: parameter {i} is {diff} away from the single-process step"
            );
            assert!(moved > 0.0 || i > 0, "the step did not move parameter {i}");
        }
    }
}

/// A CUDA trainer's channels-last weights (strided gradients, momentum and parameters)
/// through every path: the replicas stay identical, stay channels-last, and end where
/// the single NCHW process does, to the rounding of the other kernels.
#[test]
fn channels_last_weights_average_like_nchw_ones() {
    let _alone = seeded_alone();
    let (images, labels, want) = seeded_batch();
    for path in [Path::Ring, Path::Device, Path::Overlap] {
        let [rank0, rank1] = data_parallel(&images, &labels, 5, path, true);
        for (i, ((a, b), w)) in rank0.iter().zip(&rank1).zip(&want).enumerate() {
            assert!(
                a.equal(b),
                "{path:?}: parameter {i} differs between the replicas"
            );
            assert_eq!(a.dim() == 4, is_channels_last(a), "{path:?}: parameter {i}");
            let diff = (a - w).abs().max().double_value(&[]);
            assert!(
                diff <= 1e-4 * (1.0 + w.abs().max().double_value(&[])),
                "{path:?}: parameter {i} is {diff} away from the NCHW single-process step"
            );
        }
    }
}

/// A NaN gradient on a rank with samples makes the average non-finite on every rank; on
/// a rank without samples (weight 0) it is ignored. Both paths, with a loss scale to undo.
#[test]
fn a_non_finite_gradient_counts_only_on_a_rank_with_samples() {
    let _alone = seeded_alone();
    // (path, rank 1's samples, finite on both ranks)
    let cases = [
        (Path::Ring, 2.0, false),
        (Path::Device, 2.0, false),
        (Path::Overlap, 2.0, false),
        (Path::Ring, 0.0, true),
        (Path::Device, 0.0, true),
        (Path::Overlap, 0.0, true),
    ];
    for (path, samples1, want) in cases {
        let groups = RingGroup::in_memory(2, CollectiveOptions::default());
        let devices = ThreadCollective::group(2);
        let results: Vec<(bool, f32, Vec<f32>, [f32; 1])> = std::thread::scope(|scope| {
            let handles: Vec<_> = groups
                .into_iter()
                .zip(devices)
                .enumerate()
                .map(|(rank, (group, device))| {
                    scope.spawn(move || {
                        let weight =
                            Tensor::ones([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
                        let params = [weight.shallow_clone()];
                        let mut sync = grad_sync(group, device, path, &params, 1 << 20);
                        let samples = if rank == 0 { 2.0 } else { samples1 };
                        if path == Path::Overlap {
                            // A finite step first: the ranks agree on the buckets there.
                            sync.before_backward(2.0).expect("arm");
                            weight.sum(Kind::Float).backward();
                            sync.average(&params, 2.0, &mut [0.0], 1.0).expect("first");
                            assert!(sync.overlapping());
                            let _ = params[0].grad().zero_();
                        }
                        sync.before_backward(samples).expect("arm");
                        // Rank 0's gradient is 4 (a loss scale of 2 on 2), rank 1's NaN.
                        let factor = if rank == 1 { f64::NAN } else { 4.0 };
                        (&weight * factor).sum(Kind::Float).backward();
                        let mut extra = [if rank == 0 { 3.0 } else { 5.0 }];
                        let stats = sync
                            .average(&params, samples, &mut extra, 0.5)
                            .expect("average");
                        let grad = Vec::<f32>::try_from(params[0].grad()).expect("grad");
                        (stats.finite, stats.samples, grad, extra)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("rank"))
                .collect()
        });
        for (rank, (finite, total, grad, extra)) in results.into_iter().enumerate() {
            let what = format!("{path:?}, rank 1 with {samples1} samples, rank {rank}");
            assert_eq!(finite, want, "{what}");
            assert_eq!(total, 2.0 + samples1, "{what}");
            if want {
                assert_eq!(grad, [2.0; 3], "{what}: the average, unscaled");
                assert_eq!(extra, [3.0], "{what}: rank 0's value alone");
            }
        }
    }
}
