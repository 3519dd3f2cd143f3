//! Reading a run's `metrics.jsonl` into what the plot draws: leniently where a run's
//! history makes it messy (kinds from newer versions are skipped, a resumed run drops
//! what the earlier run wrote past its checkpoint and its repeated steps are resolved by
//! the later line, a last line cut short by a kill is skipped) and strictly everywhere
//! else: any other bad line is an error that names the file and line.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use actors::train::MetricsRecord;
use anyhow::{anyhow, bail};
use serde_json::Value;

/// What a metrics file says, with repeated steps resolved (the later line wins).
#[derive(Debug, Default, PartialEq)]
pub(super) struct Metrics {
    /// The last job record.
    pub(super) job: Option<Job>,
    /// Keyed by the global optimiser step.
    pub(super) steps: BTreeMap<u64, StepPoint>,
    /// Keyed by the step the eval ran at.
    pub(super) evals: BTreeMap<u64, EvalPoint>,
    /// The epochs that have an epoch record.
    pub(super) epochs: BTreeSet<u64>,
    /// The 1-based number of a truncated last line that was skipped.
    pub(super) skipped_last_line: Option<usize>,
}

#[derive(Debug, Default, Clone, PartialEq)]
pub(super) struct Job {
    pub(super) model: Option<String>,
    pub(super) world: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct StepPoint {
    pub(super) epoch: u64,
    pub(super) loss: f64,
    pub(super) lr: f64,
    pub(super) images_per_s: f64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct EvalPoint {
    pub(super) epoch: u64,
    pub(super) loss: f64,
    pub(super) top1: f64,
    pub(super) top5: f64,
}

/// Parses the lines of a metrics file; `path` is only used in messages.
pub(super) fn parse_metrics(path: &Path, bytes: &[u8]) -> anyhow::Result<Metrics> {
    let lines: Vec<&[u8]> = bytes
        .split(|&b| b == b'\n')
        .map(|line| line.strip_suffix(b"\r").unwrap_or(line))
        .collect();
    let last = lines.iter().rposition(|line| !line.trim_ascii().is_empty());
    let Some(last) = last else {
        bail!("{}: the file is empty", path.display());
    };
    let mut metrics = Metrics::default();
    for (index, line) in lines.iter().enumerate().take(last + 1) {
        if line.trim_ascii().is_empty() {
            continue;
        }
        let at = || format!("{}:{}", path.display(), index + 1);
        let value: Value = match serde_json::from_slice(line) {
            Ok(value) => value,
            // A run killed mid-write leaves half a line at the end: JSON that just stops.
            Err(error) if error.is_eof() && index == last => {
                metrics.skipped_last_line = Some(index + 1);
                continue;
            }
            Err(error) => bail!("{}: invalid JSON ({error})", at()),
        };
        metrics
            .add_record(value)
            .map_err(|problem| anyhow!("{}: {problem}", at()))?;
    }
    if metrics.steps.is_empty() {
        bail!("{}: no step records", path.display());
    }
    Ok(metrics)
}

impl Metrics {
    /// Adds one record (a line's JSON); the error is a message without the place.
    fn add_record(&mut self, value: Value) -> Result<(), String> {
        let kind = match &value {
            Value::Object(record) => match record.get("kind") {
                Some(Value::String(kind)) => kind.clone(),
                Some(_) => return Err(r#""kind" is not a string"#.to_string()),
                None => return Err(r#"record has no "kind""#.to_string()),
            },
            _ => return Err("record is not a JSON object".to_string()),
        };
        let record: MetricsRecord =
            serde_json::from_value(value).map_err(|e| format!("{kind} record: {e}"))?;
        match record {
            MetricsRecord::Job(job) => {
                // A resumed job continues after the checkpoint's step: what an earlier
                // run wrote past it is history that did not happen in this run.
                if let Some(at) = job.resumed_at_step {
                    let epoch = job
                        .resumed_epoch
                        .ok_or("job record has \"resumed_at_step\" but no \"resumed_epoch\"")?;
                    self.steps.split_off(&(at + 1));
                    self.evals.split_off(&(at + 1));
                    self.epochs.split_off(&epoch);
                }
                self.job = Some(Job {
                    model: job.model,
                    world: job.world.map(u64::from),
                });
            }
            MetricsRecord::Step(step) => {
                let point = StepPoint {
                    epoch: step.epoch,
                    loss: step.loss,
                    lr: step.lr,
                    images_per_s: step.images_per_s,
                };
                self.steps.insert(step.step, point);
            }
            MetricsRecord::Eval(eval) => {
                let point = EvalPoint {
                    epoch: eval.epoch,
                    loss: eval.loss,
                    top1: eval.top1,
                    top5: eval.top5,
                };
                self.evals.insert(eval.step, point);
            }
            MetricsRecord::Epoch(epoch) => {
                self.epochs.insert(epoch.epoch);
            }
            // Kinds the plot does not draw, and kinds from newer versions.
            MetricsRecord::Connect(_)
            | MetricsRecord::Stop(_)
            | MetricsRecord::Late(_)
            | MetricsRecord::Samples(_)
            | MetricsRecord::Regroup(_)
            | MetricsRecord::Unknown => {}
        }
        Ok(())
    }

    /// Top-1 and top-5 accuracy in percent per epoch: the eval with the highest step in
    /// each epoch.
    pub(super) fn accuracy_per_epoch(&self) -> Vec<(u64, f64, f64)> {
        let mut per_epoch = BTreeMap::new();
        for eval in self.evals.values() {
            per_epoch.insert(eval.epoch, (eval.top1 * 100.0, eval.top5 * 100.0));
        }
        per_epoch
            .into_iter()
            .map(|(epoch, (top1, top5))| (epoch, top1, top5))
            .collect()
    }

    pub(super) fn summary(&self) -> String {
        let epochs: BTreeSet<u64> = self.steps.values().map(|point| point.epoch).collect();
        let mut summary = format!("{} steps, {} epochs", self.steps.len(), epochs.len());
        if let Some((step, point)) = self.steps.last_key_value() {
            summary += &format!(", last loss {:.4} (step {step})", point.loss);
        }
        let best = self
            .accuracy_per_epoch()
            .into_iter()
            .filter(|(_, top1, _)| top1.is_finite())
            .max_by(|a, b| a.1.total_cmp(&b.1));
        match best {
            Some((epoch, top1, _)) => {
                summary += &format!(", best top-1 {top1:.2}% (epoch {epoch})")
            }
            None => summary += ", no eval records",
        }
        summary
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::step;
    use super::*;

    const FILE: &str = "run/metrics.jsonl";

    fn parse(text: &str) -> anyhow::Result<Metrics> {
        parse_metrics(Path::new(FILE), text.as_bytes())
    }

    #[test]
    fn parses_a_good_file() {
        let text = [
            r#"{"kind":"job","time":1,"world":2,"model":"small_cnn","global_batch":128,"new":{"x":1}}"#.to_string(),
            step(1, 0, 2.0),
            step(2, 0, 1.9),
            step(3, 0, 1.8),
            step(4, 1, 1.7),
            r#"{"kind":"eval","epoch":1,"step":4,"loss":1.2,"top1":0.4,"top5":0.8,"samples":10,"elapsed_s":1}"#.to_string(),
            r#"{"kind":"epoch","epoch":1,"step":4,"train_loss":1.3,"images_per_s":1,"data_wait_fraction":0,"seconds":1,"elapsed_s":1}"#.to_string(),
            r#"{"kind":"checkpoint","step":3,"path":"ckpt-3"}"#.to_string(),
            // Resumed from step 1: steps 2 and 3 are written again, and what the first
            // run wrote past step 1 (step 4, its eval and epoch 1) is gone.
            r#"{"kind":"job","time":2,"world":4,"model":"small_cnn","resumed_at_step":1,"resumed_epoch":0}"#.to_string(),
            step(2, 0, 1.5),
            step(3, 1, 1.4),
            String::new(),
            r#"{"kind":"eval","epoch":1,"step":3,"loss":1.2,"top1":0.5,"top5":0.9,"samples":10,"elapsed_s":1,"extra":true}"#.to_string(),
            r#"{"kind":"epoch","epoch":1,"step":3,"train_loss":1.3,"images_per_s":1,"data_wait_fraction":0,"seconds":1,"elapsed_s":1}"#.to_string(),
        ]
        .join("\n");
        let metrics = parse(&text).expect("a good file parses");
        let losses: Vec<(u64, f64)> = metrics.steps.iter().map(|(&s, p)| (s, p.loss)).collect();
        assert_eq!(losses, [(1, 2.0), (2, 1.5), (3, 1.4)]);
        assert_eq!(
            metrics.job,
            Some(Job {
                model: Some("small_cnn".into()),
                world: Some(4)
            })
        );
        assert_eq!(metrics.accuracy_per_epoch(), [(1, 50.0, 90.0)]);
        assert_eq!(metrics.epochs, BTreeSet::from([1]));
        assert_eq!(metrics.skipped_last_line, None);
        assert_eq!(
            metrics.summary(),
            "3 steps, 2 epochs, last loss 1.4000 (step 3), best top-1 50.00% (epoch 1)"
        );
    }

    #[test]
    fn a_null_loss_reads_as_nan() {
        let text = r#"{"kind":"step","epoch":0,"step":1,"loss":null,"lr":0.1,"images_per_s":1}"#;
        let metrics = parse(text).expect("null is a NaN loss");
        assert!(metrics.steps[&1].loss.is_nan());
    }

    #[test]
    fn bad_files_name_the_line() {
        let good = step(1, 0, 1.0);
        let cases: &[(&str, String, &str)] = &[
            (
                "empty",
                String::new(),
                "run/metrics.jsonl: the file is empty",
            ),
            (
                "blank lines",
                "\n \n".into(),
                "run/metrics.jsonl: the file is empty",
            ),
            (
                "no steps",
                r#"{"kind":"job","world":1}"#.into(),
                "run/metrics.jsonl: no step records",
            ),
            (
                "not JSON",
                format!("{good}\nnot json\n{good}"),
                "run/metrics.jsonl:2: invalid JSON",
            ),
            (
                "a resume point that is not a step",
                format!("{good}\n{{\"kind\":\"job\",\"resumed_at_step\":-1,\"resumed_epoch\":0}}"),
                "run/metrics.jsonl:2: job record: invalid value: integer `-1`, expected u64",
            ),
            (
                "a resume without its epoch",
                format!("{good}\n{{\"kind\":\"job\",\"resumed_at_step\":1}}"),
                r#"run/metrics.jsonl:2: job record has "resumed_at_step" but no "resumed_epoch""#,
            ),
            (
                "truncated line in the middle",
                format!("{good}\n{{\"kind\":\"st\n{good}"),
                "run/metrics.jsonl:2: invalid JSON",
            ),
            (
                "bad syntax on the last line",
                format!("{good}\n{{\"kind\":\"step\"]"),
                "run/metrics.jsonl:2: invalid JSON",
            ),
            (
                "not an object",
                format!("{good}\n[1,2]"),
                "run/metrics.jsonl:2: record is not a JSON object",
            ),
            (
                "no kind",
                format!("{good}\n{{\"step\":1}}"),
                r#"run/metrics.jsonl:2: record has no "kind""#,
            ),
            (
                "step without loss",
                format!(
                    "{good}\n\n{}",
                    r#"{"kind":"step","epoch":0,"step":2,"lr":0.1,"images_per_s":1}"#
                ),
                "run/metrics.jsonl:3: step record: missing field `loss`",
            ),
            (
                "loss as a string",
                r#"{"kind":"step","epoch":0,"step":2,"loss":"1","lr":0.1,"images_per_s":1}"#.into(),
                r#"run/metrics.jsonl:1: step record: invalid type: string "1", expected f64"#,
            ),
            (
                "negative step",
                r#"{"kind":"step","epoch":0,"step":-2,"loss":1,"lr":0.1,"images_per_s":1}"#.into(),
                "run/metrics.jsonl:1: step record: invalid value: integer `-2`, expected u64",
            ),
            (
                "eval without top1",
                format!(
                    "{good}\n{}",
                    r#"{"kind":"eval","epoch":0,"step":1,"loss":1,"top5":0.9}"#
                ),
                "run/metrics.jsonl:2: eval record: missing field `top1`",
            ),
            (
                "epoch without epoch",
                format!("{good}\n{}", r#"{"kind":"epoch","step":1,"train_loss":1}"#),
                "run/metrics.jsonl:2: epoch record: missing field `epoch`",
            ),
        ];
        for (name, text, expected) in cases {
            let error = parse(text).expect_err(name);
            let message = format!("{error:#}");
            assert!(
                message.starts_with(expected),
                "{name}: got {message:?}, want {expected:?}"
            );
        }
    }

    #[test]
    fn skips_a_truncated_last_line() {
        let cut = step(3, 0, 1.0);
        for (name, tail) in [
            ("mid-key", &cut[..20]),
            (
                "mid-number",
                &cut[..cut.find("1.0").map_or(cut.len(), |at| at + 2)],
            ),
            ("before the brace", &cut[..cut.len() - 1]),
        ] {
            let text = format!("{}\n{}\n{tail}", step(1, 0, 2.0), step(2, 0, 1.5));
            let metrics = parse(&text).unwrap_or_else(|e| panic!("{name}: {e:#}"));
            assert_eq!(metrics.skipped_last_line, Some(3), "{name}");
            assert_eq!(metrics.steps.len(), 2, "{name}");
        }
    }
}

/// Metrics files that look like training, for the tests of parsing and drawing.
#[cfg(test)]
pub(super) mod fixtures {
    pub fn step(step: u64, epoch: u64, loss: f64) -> String {
        format!(
            r#"{{"kind":"step","epoch":{epoch},"step":{step},"loss":{loss},"lr":0.1,"images_per_s":400.0,"data_wait_s":0.01,"allreduce_s":0.02,"step_s":0.3,"elapsed_s":1.0}}"#
        )
    }

    /// A run of `steps` steps over `epochs` epochs that looks like training.
    pub fn sample(steps: u64, epochs: u64) -> String {
        let per_epoch = steps / epochs;
        let mut lines = vec![
            r#"{"kind":"job","time":1700000000,"world":2,"model":"small_cnn","global_batch":128,"seed":7}"#.to_string(),
        ];
        for s in 1..=steps {
            let epoch = (s - 1) / per_epoch;
            let t = s as f64;
            let loss = 2.3 * (-t / 80.0).exp() + 0.3 + 0.15 * (t * 1.7).sin();
            let lr = if s < 30 {
                0.1 * t / 30.0
            } else {
                0.1 * (1.0 + (std::f64::consts::PI * t / steps as f64).cos()) / 2.0
            };
            let ips = 900.0 + 60.0 * (t * 0.9).sin() - if s < 5 { 500.0 } else { 0.0 };
            lines.push(format!(
                r#"{{"kind":"step","epoch":{epoch},"step":{s},"loss":{loss},"lr":{lr},"images_per_s":{ips},"data_wait_s":0.01,"allreduce_s":0.02,"step_s":0.14,"elapsed_s":{}}}"#,
                t * 0.14
            ));
            if s % per_epoch == 0 {
                let e = epoch as f64;
                let top1 = 0.35 + 0.4 * (1.0 - (-e / 3.0).exp());
                let top5 = 0.7 + 0.27 * (1.0 - (-e / 2.5).exp());
                lines.push(format!(
                    r#"{{"kind":"eval","epoch":{epoch},"step":{s},"loss":{},"top1":{top1},"top5":{top5},"samples":1000,"elapsed_s":1.0}}"#,
                    loss + 0.1
                ));
                lines.push(format!(
                    r#"{{"kind":"epoch","epoch":{epoch},"step":{s},"train_loss":{loss},"images_per_s":880.0,"data_wait_fraction":0.02,"seconds":4.2,"elapsed_s":1.0}}"#
                ));
            }
        }
        lines.join("\n") + "\n"
    }
}
