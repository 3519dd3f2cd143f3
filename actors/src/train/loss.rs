//! The training loss (cross-entropy with label smoothing) and top-k accuracy counts.

use tch::{Kind, Reduction, Tensor};

/// PyTorch's `ignore_index` default; imgrun's targets are never negative, so nothing is ignored.
const NO_IGNORED_CLASS: i64 = -100;

/// Mean cross-entropy with label smoothing `smoothing` (PyTorch's `label_smoothing` semantics), as a scalar tensor with grad.
pub fn cross_entropy_smoothed(logits: &Tensor, targets: &Tensor, smoothing: f64) -> Tensor {
    logits.cross_entropy_loss::<Tensor>(targets, None, Reduction::Mean, NO_IGNORED_CLASS, smoothing)
}

/// How many rows have their target among the k highest logits (k clamped to the number of classes).
///
/// A `k` below 1 counts nothing. Ties at the k-th place are broken as `topk` breaks them.
pub fn topk_correct(logits: &Tensor, targets: &Tensor, k: i64) -> i64 {
    topk_correct_tensor(logits, targets, k).int64_value(&[])
}

/// [`topk_correct`] as a 0-dimensional Int64 tensor on the logits' device, so that a
/// caller can bring it to the host together with other values, in one transfer.
pub fn topk_correct_tensor(logits: &Tensor, targets: &Tensor, k: i64) -> Tensor {
    let classes = logits.size().last().copied().unwrap_or(0);
    let k = k.min(classes);
    if k < 1 {
        return Tensor::zeros([], (Kind::Int64, logits.device()));
    }
    let _no_grad = tch::no_grad_guard();
    let (_, top) = logits.topk(k, -1, true, false);
    top.eq_tensor(&targets.unsqueeze(-1))
        .any_dim(-1, false)
        .sum(Kind::Int64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    #[test]
    fn without_smoothing_it_is_plain_cross_entropy() {
        let logits = crate::train::model::with_tch_rng(|| {
            tch::manual_seed(11);
            Tensor::randn([6, 5], (Kind::Double, Device::Cpu))
        })
        .set_requires_grad(true);
        let targets = Tensor::from_slice(&[0_i64, 4, 2, 2, 1, 3]);
        let loss = cross_entropy_smoothed(&logits, &targets, 0.0);
        let by_hand = -logits
            .log_softmax(1, Kind::Double)
            .gather(1, &targets.unsqueeze(1), false)
            .mean(Kind::Double);
        assert!(loss.size().is_empty() && loss.requires_grad());
        assert!((loss.double_value(&[]) - by_hand.double_value(&[])).abs() < 1e-12);
        loss.backward();
        assert!(logits.grad().defined());
    }

    #[test]
    fn smoothing_matches_a_hand_computed_value() {
        // Row 1: probabilities [1/4, 1/4, 1/2], target 2, so -log p = [2 ln 2, 2 ln 2, ln 2]
        // and the loss is 0.7 * ln 2 + (0.3 / 3) * 5 ln 2 = 1.2 ln 2.
        // Row 2: uniform, so every class costs ln 3 whatever the smoothing.
        let logits = Tensor::from_slice(&[0.0, 0.0, 2_f64.ln(), 0.0, 0.0, 0.0]).reshape([2, 3]);
        let targets = Tensor::from_slice(&[2_i64, 0]);
        let expected = (1.2 * 2_f64.ln() + 3_f64.ln()) / 2.0;
        let loss = cross_entropy_smoothed(&logits, &targets, 0.3).double_value(&[]);
        assert!((loss - expected).abs() < 1e-12, "{loss} != {expected}");
    }

    #[test]
    fn topk_counts_targets_among_the_highest_logits() {
        let logits = Tensor::from_slice(&[
            0.9_f32, 0.05, 0.03, 0.02, // ranks: class 0, 1, 2, 3
            0.1, 0.6, 0.2, 0.1, // class 1, 2, then 0 and 3
            0.2, 0.3, 0.1, 0.4, // class 3, 1, 0, 2
        ])
        .reshape([3, 4]);
        // Targets of rank 1, 2 and 4.
        let targets = Tensor::from_slice(&[0_i64, 2, 2]);
        for (k, expected) in [(0, 0), (1, 1), (2, 2), (3, 2), (4, 3), (5, 3), (100, 3)] {
            assert_eq!(topk_correct(&logits, &targets, k), expected, "k = {k}");
        }
        let empty = Tensor::zeros([0, 4], (Kind::Float, Device::Cpu));
        assert_eq!(
            topk_correct(&empty, &Tensor::zeros([0], (Kind::Int64, Device::Cpu)), 5),
            0
        );
    }
}
