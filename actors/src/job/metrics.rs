//! A resumed run's `metrics.jsonl`: before the run appends to it, the records an earlier
//! run wrote past the checkpoint it resumes from are dropped (that history did not happen
//! in the run that continues), so every step is in the file once. The file is rewritten
//! into a partial file beside it and renamed over it: a crash leaves either the old file
//! or the new one.

use std::io::Write as _;
use std::path::Path;

use std::fs::File;
use std::path::PathBuf;

use serde_json::Value;

use super::JobError;
use super::tensorboard::{EventFiles, TB_DIR};
use crate::train::{CheckpointState, MetricsRecord};

/// Rewinds the metrics file at `path` to the checkpoint `state`; returns how many
/// records (and unreadable lines) were dropped. A missing file has nothing to rewind.
pub(crate) fn rewind(path: &Path, state: &CheckpointState) -> Result<usize, JobError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(error) => return Err(JobError::io(format!("reading {}", path.display()))(error)),
    };
    let (kept, dropped) = keep_until(&text, state.global_step, state.epoch);
    if dropped == 0 {
        return Ok(0);
    }
    let partial = path.with_extension(format!("jsonl.partial-{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut file = std::fs::File::create(&partial)?;
        file.write_all(kept.as_bytes())?;
        file.sync_all()?;
        std::fs::rename(&partial, path)?;
        if let Some(dir) = path.parent() {
            std::fs::File::open(dir)?.sync_all()?;
        }
        Ok(())
    };
    if let Err(error) = write() {
        let _ = std::fs::remove_file(&partial);
        return Err(JobError::io(format!("rewriting {}", path.display()))(error));
    }
    Ok(dropped)
}

/// The lines of `text` that a run resumed at `global_step`, continuing `epoch`, keeps:
/// step, eval and stop records up to that step, epoch summaries of the epochs before
/// `epoch`, and every other record (jobs, connections); lines that are not JSON objects
/// (a line cut short by a crash) go. Returns the kept text and how many lines went.
pub(crate) fn keep_until(text: &str, global_step: u64, epoch: u64) -> (String, usize) {
    let mut kept = String::with_capacity(text.len());
    let mut dropped = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let keep = match serde_json::from_str::<Value>(line) {
            Ok(Value::Object(record)) => {
                let number = |key: &str| record.get(key).and_then(Value::as_u64);
                match record.get("kind").and_then(Value::as_str) {
                    Some("step" | "eval" | "stop" | "late" | "samples" | "regroup") => {
                        number("step").is_none_or(|step| step <= global_step)
                    }
                    Some("epoch") => number("epoch").is_none_or(|e| e < epoch),
                    _ => true,
                }
            }
            _ => false,
        };
        if keep {
            kept.push_str(line);
            kept.push('\n');
        } else {
            dropped += 1;
        }
    }
    (kept, dropped)
}

/// The metrics file: one JSON object per line, flushed as it goes; and the same records
/// as TensorBoard scalars in event files of the run's `tb/` folder (the job's, and each
/// rank's in `tb/rank-N/` when the step records carry the ranks' figures).
pub(crate) struct Metrics {
    pub(crate) file: File,
    pub(crate) path: PathBuf,
    tensorboard: EventFiles,
}

impl Metrics {
    /// Appends to the metrics file at `path`; the event files go to `tb/` beside it.
    pub(crate) fn open(path: &Path) -> Result<Self, JobError> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(JobError::io(format!("opening {}", path.display())))?;
        let dir = path.parent().unwrap_or(Path::new(".")).join(TB_DIR);
        Ok(Self {
            file,
            path: path.to_path_buf(),
            tensorboard: EventFiles::new(&dir, "imgrun"),
        })
    }

    pub(crate) fn write(&mut self, record: &MetricsRecord) -> Result<(), JobError> {
        let line = serde_json::to_string(record).map_err(|error| {
            JobError::Refused(format!("encoding a {} record: {error}", record.kind()))
        })?;
        writeln!(self.file, "{line}")
            .map_err(JobError::io(format!("writing {}", self.path.display())))?;
        self.tensorboard.write(record).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run that checkpointed at step 3 (epoch 1, mid-epoch), went on to step 5 and was
    /// cut while writing; then the same file resumed once already.
    const RUN: &str = r#"{"kind":"job","world":2}
{"kind":"connect","buckets":1}
{"kind":"step","epoch":0,"step":1,"loss":2.0}
{"kind":"step","epoch":0,"step":2,"loss":1.9}
{"kind":"eval","epoch":0,"step":2,"top1":0.3}
{"kind":"epoch","epoch":0,"step":2,"train_loss":1.95}
{"kind":"step","epoch":1,"step":3,"loss":1.8}
{"kind":"step","epoch":1,"step":4,"loss":1.7}
{"kind":"eval","epoch":1,"step":4,"top1":0.4}
{"kind":"stop","signal":"SIGINT","epoch":1,"step":4}
{"kind":"epoch","epoch":1,"step":4,"train_loss":1.75}
{"kind":"step","epoch":2,"step":5,"loss":1.6}
{"kind":"step","epoch":2,"st"#;

    #[test]
    fn a_resume_keeps_what_happened_up_to_its_checkpoint() {
        let cases: [(u64, u64, &[&str], usize); 3] = [
            // Mid-epoch checkpoint at step 3 of epoch 1.
            (
                3,
                1,
                &[
                    "job", "connect", "step 1", "step 2", "eval 2", "epoch 0", "step 3",
                ],
                6,
            ),
            // Epoch checkpoint after epoch 1 (continue with epoch 2).
            (
                4,
                2,
                &[
                    "job", "connect", "step 1", "step 2", "eval 2", "epoch 0", "step 3", "step 4",
                    "eval 4", "stop 4", "epoch 1",
                ],
                2,
            ),
            // Past everything: only the cut line goes.
            (9, 3, &[], 1),
        ];
        for (step, epoch, want, want_dropped) in cases {
            let (kept, dropped) = keep_until(RUN, step, epoch);
            let described: Vec<String> = kept
                .lines()
                .map(|l| {
                    let v: Value = serde_json::from_str(l).expect("kept lines are JSON");
                    let kind = v["kind"].as_str().unwrap_or("?").to_string();
                    match kind.as_str() {
                        "epoch" => format!("epoch {}", v["epoch"]),
                        "job" | "connect" => kind,
                        _ => format!("{kind} {}", v["step"]),
                    }
                })
                .collect();
            if !want.is_empty() {
                assert_eq!(described, want, "resumed at step {step}");
            }
            assert_eq!(dropped, want_dropped, "resumed at step {step}");
            assert_eq!(kept.lines().count() + dropped, RUN.lines().count());
            // Rewinding twice changes nothing more.
            assert_eq!(keep_until(&kept, step, epoch), (kept.clone(), 0));
        }
    }

    #[test]
    fn the_file_is_rewritten_in_place_and_left_alone_when_nothing_goes() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("metrics.jsonl");
        let state = |global_step, epoch| CheckpointState {
            epoch,
            global_step,
            step_in_epoch: 1,
            world: 2,
            node_ranks: vec![1, 1],
            cursors: Vec::new(),
            model: "small_cnn".into(),
            classes: 4,
            loss_scale: None,
            epoch_sums: Default::default(),
            val_top1: None,
        };
        assert_eq!(rewind(&path, &state(3, 1)).expect("no file"), 0);
        std::fs::write(&path, RUN).expect("write");
        assert_eq!(rewind(&path, &state(3, 1)).expect("rewind"), 6);
        let text = std::fs::read_to_string(&path).expect("read");
        assert_eq!(text, keep_until(RUN, 3, 1).0);
        let modified = std::fs::metadata(&path).and_then(|m| m.modified()).ok();
        assert_eq!(rewind(&path, &state(3, 1)).expect("again"), 0);
        assert_eq!(
            std::fs::metadata(&path).and_then(|m| m.modified()).ok(),
            modified
        );
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .expect("list")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["metrics.jsonl"], "nothing partial left behind");
    }
}
