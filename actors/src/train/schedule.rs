//! Learning-rate schedules: a linear warm-up followed by cosine, step or no decay, and
//! the linear scaling rule for large batches.

use std::f64::consts::PI;

/// What the learning rate does after the warm-up.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ScheduleKind {
    /// Cosine from base_lr (after warm-up) down to base_lr * final_fraction at total_steps.
    Cosine {
        final_fraction: f64,
    },
    /// base_lr multiplied by gamma at each milestone step passed.
    Step {
        milestones: Vec<u64>,
        gamma: f64,
    },
    Constant,
}

/// The learning rate as a function of the optimiser step.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LrSchedule {
    pub base_lr: f64,
    pub warmup_steps: u64,
    pub warmup_start_fraction: f64,
    pub total_steps: u64,
    pub kind: ScheduleKind,
}

impl LrSchedule {
    /// The learning rate of step `step` (0-based): linear warm-up from base_lr*warmup_start_fraction to base_lr over warmup_steps, then the decay; past total_steps stays at the final value.
    ///
    /// The warm-up reaches base_lr at step `warmup_steps`, where the decay starts. A step
    /// milestone counts from the step it names (`step >= milestone`); milestones inside
    /// the warm-up take effect once it ends.
    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            let progress = step as f64 / self.warmup_steps as f64;
            let start = self.warmup_start_fraction;
            return self.base_lr * (start + (1.0 - start) * progress);
        }
        let step = step.min(self.total_steps.max(self.warmup_steps));
        match &self.kind {
            ScheduleKind::Constant => self.base_lr,
            ScheduleKind::Step { milestones, gamma } => {
                let passed = milestones
                    .iter()
                    .filter(|&&milestone| step >= milestone)
                    .count();
                self.base_lr * gamma.powi(i32::try_from(passed).unwrap_or(i32::MAX))
            }
            ScheduleKind::Cosine { final_fraction } => {
                let decay_steps = self.total_steps.saturating_sub(self.warmup_steps);
                let progress = if decay_steps == 0 {
                    1.0
                } else {
                    (step - self.warmup_steps) as f64 / decay_steps as f64
                };
                let cosine = 0.5 * (1.0 + (PI * progress).cos());
                self.base_lr * (final_fraction + (1.0 - final_fraction) * cosine)
            }
        }
    }

    /// Checks the values a config file could get wrong; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.base_lr.is_finite() && self.base_lr > 0.0) {
            return Err(format!(
                "base_lr must be a positive number, got {}",
                self.base_lr
            ));
        }
        if !(0.0..=1.0).contains(&self.warmup_start_fraction) {
            return Err(format!(
                "warmup_start_fraction must lie in [0, 1], got {}",
                self.warmup_start_fraction
            ));
        }
        if self.warmup_steps > self.total_steps {
            return Err(format!(
                "warmup_steps ({}) must not exceed total_steps ({})",
                self.warmup_steps, self.total_steps
            ));
        }
        match &self.kind {
            ScheduleKind::Cosine { final_fraction } if !(0.0..=1.0).contains(final_fraction) => {
                Err(format!(
                    "final_fraction must lie in [0, 1], got {final_fraction}"
                ))
            }
            ScheduleKind::Step { gamma, .. } if !(gamma.is_finite() && *gamma > 0.0) => {
                Err(format!("gamma must be a positive number, got {gamma}"))
            }
            ScheduleKind::Step { milestones, .. } if !milestones.is_sorted() => Err(format!(
                "milestones must be in increasing order, got {milestones:?}"
            )),
            _ => Ok(()),
        }
    }
}

/// The linear scaling rule (Goyal et al.): base_lr * global_batch / reference_batch.
pub fn scaled_lr(base_lr: f64, global_batch: u64, reference_batch: u64) -> f64 {
    base_lr * global_batch as f64 / reference_batch as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(warmup_steps: u64, total_steps: u64, kind: ScheduleKind) -> LrSchedule {
        LrSchedule {
            base_lr: 0.4,
            warmup_steps,
            warmup_start_fraction: 0.1,
            total_steps,
            kind,
        }
    }

    /// Checks `lr_at` at each (step, expected learning rate).
    fn check(schedule: &LrSchedule, cases: &[(u64, f64)]) {
        for &(step, expected) in cases {
            let lr = schedule.lr_at(step);
            assert!(
                (lr - expected).abs() < 1e-12,
                "{schedule:?} step {step}: {lr} != {expected}"
            );
        }
    }

    #[test]
    fn warm_up_rises_linearly_to_base_lr() {
        for kind in [
            ScheduleKind::Constant,
            ScheduleKind::Cosine {
                final_fraction: 0.0,
            },
            ScheduleKind::Step {
                milestones: vec![50],
                gamma: 0.1,
            },
        ] {
            check(
                &schedule(10, 100, kind),
                &[(0, 0.04), (5, 0.22), (9, 0.364), (10, 0.4)],
            );
        }
    }

    #[test]
    fn cosine_passes_the_midpoint_and_ends_at_the_final_fraction() {
        let cosine = schedule(
            10,
            110,
            ScheduleKind::Cosine {
                final_fraction: 0.1,
            },
        );
        // Midpoint: base * (0.1 + 0.9 * 0.5); a quarter in: cos(pi/4) terms.
        let quarter = 0.4 * (0.1 + 0.9 * 0.5 * (1.0 + (PI / 4.0).cos()));
        check(
            &cosine,
            &[
                (10, 0.4),
                (35, quarter),
                (60, 0.22),
                (110, 0.04),
                (111, 0.04),
                (10_000, 0.04),
            ],
        );
        let no_warmup = schedule(
            0,
            4,
            ScheduleKind::Cosine {
                final_fraction: 0.0,
            },
        );
        check(&no_warmup, &[(0, 0.4), (2, 0.2), (4, 0.0), (5, 0.0)]);
        let all_warmup = schedule(
            4,
            4,
            ScheduleKind::Cosine {
                final_fraction: 0.5,
            },
        );
        check(&all_warmup, &[(3, 0.31), (4, 0.2), (9, 0.2)]);
    }

    #[test]
    fn step_multiplies_by_gamma_at_each_milestone() {
        let step = schedule(
            5,
            100,
            ScheduleKind::Step {
                milestones: vec![30, 60, 200],
                gamma: 0.1,
            },
        );
        check(
            &step,
            &[
                (5, 0.4),
                (29, 0.4),
                (30, 0.04),
                (59, 0.04),
                (60, 0.004),
                (100, 0.004),
                (250, 0.004),
            ],
        );
        check(
            &schedule(0, 10, ScheduleKind::Constant),
            &[(0, 0.4), (10, 0.4), (11, 0.4)],
        );
    }

    #[test]
    fn scaled_lr_follows_the_linear_rule() {
        for (base, global, reference, expected) in [
            (0.1, 256, 256, 0.1),
            (0.1, 1024, 256, 0.4),
            (0.1, 64, 256, 0.025),
            (0.2, 3000, 1000, 0.6),
        ] {
            let lr = scaled_lr(base, global, reference);
            assert!(
                (lr - expected).abs() < 1e-12,
                "{base} * {global} / {reference} = {lr}"
            );
        }
    }

    #[test]
    fn validate_names_the_bad_field() {
        let good = schedule(
            10,
            100,
            ScheduleKind::Cosine {
                final_fraction: 0.0,
            },
        );
        assert_eq!(good.validate(), Ok(()));
        let cases = [
            (
                LrSchedule {
                    base_lr: -1.0,
                    ..good.clone()
                },
                "base_lr",
            ),
            (
                LrSchedule {
                    warmup_start_fraction: 1.5,
                    ..good.clone()
                },
                "warmup_start_fraction",
            ),
            (
                LrSchedule {
                    warmup_steps: 101,
                    ..good.clone()
                },
                "warmup_steps",
            ),
            (
                LrSchedule {
                    kind: ScheduleKind::Cosine {
                        final_fraction: 2.0,
                    },
                    ..good.clone()
                },
                "final_fraction",
            ),
            (
                LrSchedule {
                    kind: ScheduleKind::Step {
                        milestones: vec![1],
                        gamma: 0.0,
                    },
                    ..good.clone()
                },
                "gamma",
            ),
            (
                LrSchedule {
                    kind: ScheduleKind::Step {
                        milestones: vec![5, 1],
                        gamma: 0.1,
                    },
                    ..good.clone()
                },
                "milestones",
            ),
        ];
        for (schedule, field) in cases {
            let err = schedule.validate().expect_err(field);
            assert!(err.contains(field), "{field}: {err}");
        }
    }

    #[test]
    fn kinds_serialize_with_a_kind_tag() {
        let step = schedule(
            0,
            10,
            ScheduleKind::Step {
                milestones: vec![3],
                gamma: 0.5,
            },
        );
        let json = serde_json::to_value(&step).expect("serializes");
        assert_eq!(
            json["kind"],
            serde_json::json!({"kind": "step", "milestones": [3], "gamma": 0.5})
        );
        let back: LrSchedule = serde_json::from_value(json).expect("deserializes");
        assert_eq!(back, step);
    }
}
