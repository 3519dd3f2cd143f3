//! Loss scaling for mixed precision, by PyTorch's `GradScaler` rule: the loss is
//! multiplied by the scale before backward and the averaged gradients by its inverse;
//! a step whose averaged gradients are not finite is skipped and the scale halved; after
//! `growth_interval` finite steps in a row the scale doubles.
//!
//! Every rank feeds [`LossScaler::update`] the same answer (the averaged gradients are the
//! same bits everywhere), so the ranks' scales never drift apart.

use serde::{Deserialize, Serialize};
use tch::Kind;

/// PyTorch's `GradScaler` default: the finite steps in a row that double the scale.
pub const DEFAULT_GROWTH_INTERVAL: u32 = 2000;

/// Whether a job scales its loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum LossScaling {
    /// Dynamic scaling under float16 autocast (`precision = "amp"` on CUDA), none
    /// otherwise (bfloat16 has f32's exponent range).
    #[default]
    Auto,
    Dynamic,
    Off,
}

impl std::str::FromStr for LossScaling {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "dynamic" => Ok(Self::Dynamic),
            "off" => Ok(Self::Off),
            other => Err(format!("`{other}`: expected auto, dynamic or off")),
        }
    }
}

/// The part of a scaler a checkpoint keeps.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ScalerState {
    pub scale: f64,
    pub finite_steps: u32,
}

/// What to do with a step's averaged gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepVerdict {
    Apply,
    /// Overflow under dynamic scaling: skip the step; the scale was halved.
    Skip,
    /// Not finite without loss scaling: the loss diverged.
    Diverged,
}

#[derive(Debug, Clone, PartialEq)]
pub struct LossScaler {
    /// `None` when scaling is off.
    state: Option<ScalerState>,
    growth_interval: u32,
}

impl LossScaler {
    pub fn off() -> Self {
        Self {
            state: None,
            growth_interval: DEFAULT_GROWTH_INTERVAL,
        }
    }

    /// Dynamic scaling from `init` (a power of two keeps fp32 results bit-exact).
    pub fn dynamic(init: f64, growth_interval: u32) -> Self {
        Self {
            state: Some(ScalerState {
                scale: init,
                finite_steps: 0,
            }),
            growth_interval: growth_interval.max(1),
        }
    }

    /// The scaler a job asks for when autocast computes in `autocast` (`None`: no
    /// autocast; see `Precision::autocast_kind`).
    pub fn for_job(scaling: LossScaling, init: f64, autocast: Option<Kind>) -> Self {
        match scaling {
            LossScaling::Dynamic => Self::dynamic(init, DEFAULT_GROWTH_INTERVAL),
            LossScaling::Auto if autocast == Some(Kind::Half) => {
                Self::dynamic(init, DEFAULT_GROWTH_INTERVAL)
            }
            LossScaling::Auto | LossScaling::Off => Self::off(),
        }
    }

    /// The factor the loss is multiplied by before backward (1 when off).
    pub fn scale(&self) -> f64 {
        self.state.map_or(1.0, |s| s.scale)
    }

    pub fn enabled(&self) -> bool {
        self.state.is_some()
    }

    /// Takes in whether the step's averaged, unscaled gradients are all finite.
    pub fn update(&mut self, finite: bool) -> StepVerdict {
        let Some(state) = &mut self.state else {
            return if finite {
                StepVerdict::Apply
            } else {
                StepVerdict::Diverged
            };
        };
        if !finite {
            state.scale /= 2.0;
            state.finite_steps = 0;
            return StepVerdict::Skip;
        }
        state.finite_steps += 1;
        if state.finite_steps >= self.growth_interval {
            state.scale *= 2.0;
            state.finite_steps = 0;
        }
        StepVerdict::Apply
    }

    pub fn state(&self) -> Option<ScalerState> {
        self.state
    }

    /// Continues from a checkpoint's state (ignored when scaling is off).
    pub fn restore(&mut self, saved: ScalerState) {
        if let Some(state) = &mut self.state {
            *state = saved;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `finite` answers through a scaler and returns the verdicts and the scale
    /// after each.
    fn run(mut scaler: LossScaler, answers: &[bool]) -> Vec<(StepVerdict, f64)> {
        answers
            .iter()
            .map(|&finite| (scaler.update(finite), scaler.scale()))
            .collect()
    }

    #[test]
    fn dynamic_scale_halves_on_overflow_and_doubles_after_the_interval() {
        use StepVerdict::{Apply, Skip};
        let got = run(
            LossScaler::dynamic(8.0, 3),
            &[true, true, false, true, true, true, true, false],
        );
        let want = [
            (Apply, 8.0),
            (Apply, 8.0),
            (Skip, 4.0),
            (Apply, 4.0),
            (Apply, 4.0),
            (Apply, 8.0),
            (Apply, 8.0),
            (Skip, 4.0),
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn without_scaling_a_non_finite_step_is_divergence() {
        use StepVerdict::{Apply, Diverged};
        let got = run(LossScaler::off(), &[true, false]);
        assert_eq!(got, [(Apply, 1.0), (Diverged, 1.0)]);
    }

    #[test]
    fn the_job_setting_picks_the_scaler() {
        let (half, bf16) = (Some(Kind::Half), Some(Kind::BFloat16));
        // (setting, autocast dtype, enabled)
        let cases = [
            (LossScaling::Auto, half, true),
            (LossScaling::Auto, bf16, false),
            (LossScaling::Auto, None, false),
            (LossScaling::Dynamic, None, true),
            (LossScaling::Dynamic, bf16, true),
            (LossScaling::Off, half, false),
            (LossScaling::Off, bf16, false),
        ];
        for (setting, autocast, enabled) in cases {
            let scaler = LossScaler::for_job(setting, 1024.0, autocast);
            assert_eq!(
                scaler.enabled(),
                enabled,
                "{setting:?} autocast {autocast:?}"
            );
            assert_eq!(scaler.scale(), if enabled { 1024.0 } else { 1.0 });
        }
        assert_eq!("dynamic".parse(), Ok(LossScaling::Dynamic));
        let error = "static".parse::<LossScaling>().expect_err("not a setting");
        assert!(error.contains("static"), "{error}");
    }

    #[test]
    fn restore_continues_from_a_saved_state() {
        let mut scaler = LossScaler::dynamic(65536.0, 2);
        scaler.restore(ScalerState {
            scale: 512.0,
            finite_steps: 1,
        });
        assert_eq!(scaler.update(true), StepVerdict::Apply);
        assert_eq!(scaler.scale(), 1024.0);
        let mut off = LossScaler::off();
        off.restore(ScalerState {
            scale: 512.0,
            finite_steps: 1,
        });
        assert_eq!(off.state(), None);
    }
}
