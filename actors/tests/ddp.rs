//! Data-parallel steps equal single-process steps: two replicas, each with part of a
//! batch, averaging their gradients with `GradSync` over an in-memory ring, end up with
//! the parameters one process gets from the whole batch, for even and uneven splits and
//! for a rank with no data at all (the `join` policy).
//!
//! BatchNorm runs in eval mode here: in train mode each replica normalises with its own
//! part's statistics, so no data-parallel scheme without synchronised BatchNorm (PyTorch's
//! DDP included) equals the single-process step there.

use actors::train::{GradSync, Model, ModelKind, Sgd, SgdConfig, cross_entropy_smoothed};
use runtime::{CollectiveOptions, RingGroup};
use tch::{Device, Kind, Tensor};

const CLASSES: i64 = 10;
const LR: f64 = 0.1;

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

/// Two steps on the whole batch in one process.
fn single(images: &Tensor, labels: &Tensor) -> Vec<Tensor> {
    let model = model();
    let mut sgd = sgd(&model);
    for _ in 0..2 {
        sgd.zero_grad();
        let loss = cross_entropy_smoothed(&model.forward_t(images, false), labels, 0.1);
        loss.backward();
        sgd.step(LR);
    }
    model.parameters().into_iter().map(|(_, t)| t).collect()
}

/// Two steps on two replicas, rank 0 taking the first `split` samples.
fn data_parallel(images: &Tensor, labels: &Tensor, split: i64) -> [Vec<Tensor>; 2] {
    let n = images.size()[0];
    let parts = [(0, split), (split, n - split)];
    let groups = RingGroup::in_memory(2, CollectiveOptions::default());
    // Built here, one after the other: libtorch's random generator is one per process.
    let models = [model(), model()];
    let results: Vec<Vec<Tensor>> = std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .zip(parts)
            .zip(models)
            .map(|((group, (start, len)), model)| {
                let images = images.narrow(0, start, len);
                let labels = labels.narrow(0, start, len);
                scope.spawn(move || {
                    let mut sgd = sgd(&model);
                    let params: Vec<Tensor> =
                        model.parameters().into_iter().map(|(_, t)| t).collect();
                    // Small buckets, so the step crosses several of them.
                    let mut sync = GradSync::start(move || async move { Ok(group) }, &params, 4096)
                        .expect("sync");
                    assert!(sync.buckets() > 1);
                    for _ in 0..2 {
                        sgd.zero_grad();
                        let mut extra = [0.0f32];
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

#[test]
fn data_parallel_steps_equal_the_single_process_step() {
    tch::set_num_threads(1);
    tch::manual_seed(1);
    let images = Tensor::randn([8, 3, 16, 16], (Kind::Float, Device::Cpu));
    let labels = Tensor::randint(CLASSES, [8], (Kind::Int64, Device::Cpu));
    let want = single(&images, &labels);
    let start: Vec<Tensor> = model().parameters().into_iter().map(|(_, t)| t).collect();
    for split in [4, 6, 8] {
        let [rank0, rank1] = data_parallel(&images, &labels, split);
        for (i, ((a, b), w)) in rank0.iter().zip(&rank1).zip(&want).enumerate() {
            assert!(
                a.equal(b),
                "split {split}: parameter {i} differs between the replicas"
            );
            let diff = (a - w).abs().max().double_value(&[]);
            let moved = (w - &start[i]).abs().max().double_value(&[]);
            assert!(
                diff <= 1e-5 * (1.0 + w.abs().max().double_value(&[])),
                "split {split}: parameter {i} is {diff} away from the single-process step"
            );
            assert!(moved > 0.0 || i > 0, "the step did not move parameter {i}");
        }
    }
}

#[test]
fn a_non_finite_gradient_on_one_rank_is_seen_by_every_rank() {
    let groups = RingGroup::in_memory(2, CollectiveOptions::default());
    let finite: Vec<bool> = std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, group)| {
                scope.spawn(move || {
                    let weight =
                        Tensor::ones([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
                    let scale = if rank == 1 { f64::NAN } else { 1.0 };
                    (&weight * scale).sum(Kind::Float).backward();
                    let params = [weight];
                    let mut sync =
                        GradSync::start(move || async move { Ok(group) }, &params, 1 << 20)
                            .expect("sync");
                    let stats = sync.average(&params, 2.0, &mut [], 0.5).expect("average");
                    stats.finite
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank"))
            .collect()
    });
    assert_eq!(finite, [false, false]);
}
