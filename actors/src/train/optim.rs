//! Stochastic gradient descent with momentum, written out by hand so that its momentum
//! buffers can be checkpointed; it follows `torch.optim.SGD` with dampening 0.

use std::fmt;

use tch::Tensor;

/// The hyper-parameters of [`Sgd`] other than the learning rate, which each step takes.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SgdConfig {
    pub momentum: f64,
    pub nesterov: bool,
    pub weight_decay: f64,
}

/// SGD over a fixed list of named parameters, updated in place.
pub struct Sgd {
    config: SgdConfig,
    slots: Vec<Slot>,
}

/// One parameter and what the optimiser keeps for it.
struct Slot {
    name: String,
    parameter: Tensor,
    /// Whether weight decay applies (parameters with 2 or more dimensions).
    decayed: bool,
    /// Created by the first step that sees a gradient, as in PyTorch.
    momentum: Option<Tensor>,
}

/// The prefix of the names `Sgd::state` gives its momentum buffers.
pub(super) const MOMENTUM_PREFIX: &str = "momentum.";

impl Sgd {
    /// Weight decay applies only to parameters with 2 or more dimensions (not to biases and norm weights).
    pub fn new(parameters: Vec<(String, Tensor)>, config: SgdConfig) -> Self {
        let slots = parameters
            .into_iter()
            .map(|(name, parameter)| Slot {
                name,
                decayed: parameter.dim() >= 2,
                parameter,
                momentum: None,
            })
            .collect();
        Sgd { config, slots }
    }

    pub fn config(&self) -> SgdConfig {
        self.config
    }

    /// One update with learning rate `lr` from each parameter's `.grad()` (a parameter without a defined grad is skipped). No autograd recording.
    pub fn step(&mut self, lr: f64) {
        let SgdConfig {
            momentum,
            nesterov,
            weight_decay,
        } = self.config;
        let _no_grad = tch::no_grad_guard();
        for slot in &mut self.slots {
            let grad = slot.parameter.grad();
            if !grad.defined() {
                continue;
            }
            let mut direction = if slot.decayed && weight_decay != 0.0 {
                &grad + &slot.parameter * weight_decay
            } else {
                grad
            };
            if momentum != 0.0 {
                let buffer = match &mut slot.momentum {
                    Some(buffer) => {
                        *buffer *= momentum;
                        *buffer += &direction;
                        buffer
                    }
                    // A copy: `direction` may be the gradient itself, which is zeroed later.
                    None => slot.momentum.insert(direction.copy()),
                };
                direction = if nesterov {
                    &direction + &*buffer * momentum
                } else {
                    buffer.shallow_clone()
                };
            }
            slot.parameter -= direction * lr;
        }
    }

    /// Zeroes every parameter's gradient where one is defined.
    ///
    /// Unlike PyTorch's default (`set_to_none`), the gradient stays defined, so a
    /// parameter left out of a later backward pass still gets decay and momentum updates.
    pub fn zero_grad(&mut self) {
        for slot in &mut self.slots {
            slot.parameter.zero_grad();
        }
    }

    /// The momentum buffers, named "momentum.<parameter name>" (only those that exist yet).
    ///
    /// The tensors are copies: later steps do not change them.
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let _no_grad = tch::no_grad_guard();
        self.slots
            .iter()
            .filter_map(|slot| {
                let buffer = slot.momentum.as_ref()?;
                Some((format!("{MOMENTUM_PREFIX}{}", slot.name), buffer.copy()))
            })
            .collect()
    }

    /// Every parameter's momentum buffer, named as in [`Sgd::state`]: zeros for those
    /// that have none yet (the next step treats both alike), so that every rank's list
    /// has the same tensors. Copies.
    pub fn state_or_zeros(&self) -> Vec<(String, Tensor)> {
        let _no_grad = tch::no_grad_guard();
        self.slots
            .iter()
            .map(|slot| {
                let buffer = match &slot.momentum {
                    Some(buffer) => buffer.copy(),
                    None => slot.parameter.zeros_like(),
                };
                (format!("{MOMENTUM_PREFIX}{}", slot.name), buffer)
            })
            .collect()
    }

    /// Restores buffers from `state()`'s output; an unknown name or a shape mismatch is an error naming it.
    ///
    /// The state replaces the optimiser's whole state: a parameter without a buffer in
    /// `state` starts its momentum afresh, as after `new`. On error nothing changes. The
    /// tensors are copied onto each parameter's device and kind.
    pub fn load_state(&mut self, state: &[(String, Tensor)]) -> Result<(), String> {
        let mut restored: Vec<Option<&Tensor>> = vec![None; self.slots.len()];
        for (name, tensor) in state {
            let index = name
                .strip_prefix(MOMENTUM_PREFIX)
                .and_then(|parameter| self.slots.iter().position(|slot| slot.name == parameter))
                .ok_or_else(|| format!("unknown optimizer state {name:?}"))?;
            let expected = self.slots[index].parameter.size();
            if tensor.size() != expected {
                return Err(format!(
                    "optimizer state {name:?} has shape {:?}, its parameter {expected:?}",
                    tensor.size()
                ));
            }
            restored[index] = Some(tensor);
        }
        let _no_grad = tch::no_grad_guard();
        for (slot, tensor) in self.slots.iter_mut().zip(restored) {
            slot.momentum = tensor.map(|tensor| {
                tensor
                    .to_device(slot.parameter.device())
                    .to_kind(slot.parameter.kind())
                    .detach()
                    .copy()
            });
        }
        Ok(())
    }
}

impl fmt::Debug for Sgd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sgd")
            .field("config", &self.config)
            .field("parameters", &self.slots.len())
            .field(
                "momentum_buffers",
                &self
                    .slots
                    .iter()
                    .filter(|slot| slot.momentum.is_some())
                    .count(),
            )
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// A 2-D weight and a 1-D bias whose loss has the constant gradients
    /// [[0.5, 1.0]] and [2.0] (plus weight decay on the weight).
    struct Toy {
        weight: Tensor,
        bias: Tensor,
    }

    impl Toy {
        fn new() -> Self {
            Toy {
                weight: Tensor::from_slice(&[1.0_f64, -2.0])
                    .reshape([1, 2])
                    .set_requires_grad(true),
                bias: Tensor::from_slice(&[0.5_f64]).set_requires_grad(true),
            }
        }

        fn parameters(&self) -> Vec<(String, Tensor)> {
            vec![
                ("fc.bias".to_string(), self.bias.shallow_clone()),
                ("fc.weight".to_string(), self.weight.shallow_clone()),
            ]
        }

        fn train(&self, sgd: &mut Sgd, steps: usize) {
            let weight_grad = Tensor::from_slice(&[0.5_f64, 1.0]).reshape([1, 2]);
            for _ in 0..steps {
                sgd.zero_grad();
                let loss = (&self.weight * &weight_grad).sum(Kind::Double)
                    + (&self.bias * 2.0).sum(Kind::Double);
                loss.backward();
                sgd.step(0.1);
            }
        }

        fn values(&self) -> [f64; 3] {
            [
                self.weight.double_value(&[0, 0]),
                self.weight.double_value(&[0, 1]),
                self.bias.double_value(&[0]),
            ]
        }
    }

    fn assert_close(actual: [f64; 3], expected: [f64; 3], case: &str) {
        for (a, e) in actual.iter().zip(expected) {
            assert!(
                (a - e).abs() < 1e-12,
                "{case}: got {actual:?}, expected {expected:?}"
            );
        }
    }

    #[test]
    fn three_steps_match_torch_optim_sgd() {
        // Expected values from torch 2.11 `torch.optim.SGD(lr=0.1, ...)` with the same
        // start, gradients and weight decay on the weight only. By hand, the first case's
        // first step: d = [0.5, 1.0] + 0.1 * [1, -2] = [0.6, 0.8], so the weight moves to
        // [0.94, -2.08]; the bias (no decay) to 0.5 - 0.1 * 2 = 0.3.
        let cases = [
            ("momentum", 0.9, false, 0.1, [0.666274, -2.444968, -0.622]),
            (
                "nesterov",
                0.9,
                true,
                0.1,
                [0.525363646, -2.632848472, -1.1098],
            ),
            ("plain", 0.0, false, 0.1, [0.821794, -2.237608, -0.1]),
            (
                "nesterov without decay",
                0.5,
                true,
                0.0,
                [0.74375, -2.5125, -0.525],
            ),
        ];
        for (case, momentum, nesterov, weight_decay, expected) in cases {
            let toy = Toy::new();
            let mut sgd = Sgd::new(
                toy.parameters(),
                SgdConfig {
                    momentum,
                    nesterov,
                    weight_decay,
                },
            );
            toy.train(&mut sgd, 3);
            assert_close(toy.values(), expected, case);
            assert!(
                toy.weight.requires_grad() && toy.weight.is_leaf(),
                "{case}: still a leaf"
            );
            let buffers = if momentum == 0.0 { 0 } else { 2 };
            assert_eq!(sgd.state().len(), buffers, "{case}");
        }
    }

    #[test]
    fn a_parameter_without_a_gradient_is_left_alone() {
        let toy = Toy::new();
        let unused = Tensor::ones([3, 3], (Kind::Double, Device::Cpu)).set_requires_grad(true);
        let mut parameters = toy.parameters();
        parameters.push(("unused".to_string(), unused.shallow_clone()));
        let config = SgdConfig {
            momentum: 0.9,
            nesterov: false,
            weight_decay: 0.1,
        };
        let mut sgd = Sgd::new(parameters, config);
        toy.train(&mut sgd, 2);
        assert!(unused.equal(&Tensor::ones([3, 3], (Kind::Double, Device::Cpu))));
        let names: Vec<String> = sgd.state().into_iter().map(|(name, _)| name).collect();
        assert_eq!(names, ["momentum.fc.bias", "momentum.fc.weight"]);
    }

    #[test]
    fn restored_state_continues_identically() {
        let config = SgdConfig {
            momentum: 0.9,
            nesterov: true,
            weight_decay: 0.1,
        };
        let original = Toy::new();
        let mut sgd = Sgd::new(original.parameters(), config);
        original.train(&mut sgd, 2);
        let state = sgd.state();

        // Two copies of the weights after 2 steps; only one gets the momentum back.
        let resume = |state: &[(String, Tensor)]| {
            let toy = Toy::new();
            let _no_grad = tch::no_grad_guard();
            toy.weight.shallow_clone().copy_(&original.weight);
            toy.bias.shallow_clone().copy_(&original.bias);
            let mut sgd = Sgd::new(toy.parameters(), config);
            sgd.load_state(state).expect("state() output loads");
            (toy, sgd)
        };
        let (resumed, mut resumed_sgd) = resume(&state);
        let (restarted, mut restarted_sgd) = resume(&[]);

        original.train(&mut sgd, 2);
        resumed.train(&mut resumed_sgd, 2);
        restarted.train(&mut restarted_sgd, 2);
        assert_eq!(original.values(), resumed.values());
        assert_ne!(original.values(), restarted.values());
    }

    #[test]
    fn bad_state_is_an_error_naming_it_and_changes_nothing() {
        let config = SgdConfig {
            momentum: 0.9,
            nesterov: false,
            weight_decay: 0.0,
        };
        let toy = Toy::new();
        let mut sgd = Sgd::new(toy.parameters(), config);
        toy.train(&mut sgd, 1);
        let before = sgd.state();
        let good = || before[0].1.copy();
        let cases = [
            ("momentum.fc.other", good(), "momentum.fc.other"),
            ("fc.bias", good(), "fc.bias"),
            (
                "momentum.fc.weight",
                Tensor::zeros([2, 1], (Kind::Double, Device::Cpu)),
                "[2, 1]",
            ),
        ];
        for (name, tensor, mentioned) in cases {
            let err = sgd
                .load_state(&[(name.to_string(), tensor)])
                .expect_err(name);
            assert!(err.contains(mentioned), "{name}: {err}");
            let after = sgd.state();
            assert!(
                before
                    .iter()
                    .zip(&after)
                    .all(|(a, b)| a.0 == b.0 && a.1.equal(&b.1)),
                "{name}"
            );
            assert_eq!(after.len(), before.len(), "{name}");
        }
    }
}
