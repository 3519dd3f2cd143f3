//! Checkpoints: a folder per save under the run's `checkpoints/`, holding the model
//! (`model.ot`: parameters and buffers by name), the optimiser's momentum
//! (`optimizer.ot`) and `state.json` (epoch, step, schedule position and every rank's
//! loader cursor). A save is written into a hidden partial folder and renamed into place,
//! then the `latest` pointer is replaced the same way, so a crash at any moment leaves the
//! previous checkpoint whole.
//!
//! A run keeps its newest `keep` checkpoints (`train.keep_checkpoints`; 0: every one):
//! once a save is complete and `latest` names it, [`prune`] removes the oldest others by
//! global step. It never removes the one `latest` names, nor a partial folder (a save in
//! progress), so a full disk is freed only of what no resume can need.
//!
//! A decentralized job's replicas differ: `model.ot` and `optimizer.ot` hold their mean
//! (what export and an allreduce job read), and `replicas.ot` every rank's own
//! parameters, buffers and momentum, named `rank<r>.<name>`, so the job resumes exactly.

use std::path::{Path, PathBuf};

use pipelines::RankCursor;
use serde::{Deserialize, Serialize};
use tch::Tensor;

use super::file_error::FileError;
use super::file_error::{bad, io, torch};
use super::scaler::ScalerState;

pub const MODEL_FILE: &str = "model.ot";
pub const OPTIMIZER_FILE: &str = "optimizer.ot";
pub const STATE_FILE: &str = "state.json";
/// Every rank's own tensors, in the checkpoints of decentralized jobs.
pub const REPLICAS_FILE: &str = "replicas.ot";
/// The file in `checkpoints/` naming the newest complete checkpoint.
pub const LATEST_FILE: &str = "latest";

/// Where a job stands, enough to continue it exactly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointState {
    /// The epoch to continue (the next one when `cursors` is empty).
    pub epoch: u64,
    /// Optimiser steps taken since the job began (the schedule's position).
    pub global_step: u64,
    /// Steps already taken in `epoch`.
    pub step_in_epoch: u64,
    pub world: u32,
    /// Ranks on each node (empty in checkpoints from before it was kept).
    #[serde(default)]
    pub node_ranks: Vec<u32>,
    /// Each rank's loader position in `epoch`; empty at an epoch boundary.
    pub cursors: Vec<RankCursor>,
    /// The model's kind and classes, checked on resume.
    pub model: String,
    pub classes: i64,
    /// The dynamic loss scale, when the job scales its loss.
    #[serde(default)]
    pub loss_scale: Option<ScalerState>,
    /// What `epoch`'s steps before the checkpoint add up to (zero at an epoch boundary),
    /// so that a resumed epoch's summary covers the whole epoch.
    #[serde(default)]
    pub epoch_sums: EpochSums,
    /// Validation top-1 of the evaluation at this checkpoint's step, when there was one
    /// (what `train.keep_best` ranks checkpoints by).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_top1: Option<f64>,
}

/// Running sums over the steps of one epoch: what its summary (mean train loss and
/// accuracy) is made of.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct EpochSums {
    /// Steps counted.
    pub steps: u64,
    /// Sum of the steps' global mean losses, and of their accuracies.
    pub loss_sum: f64,
    pub accuracy_sum: f64,
    /// Samples over all ranks.
    pub samples: u64,
}

impl EpochSums {
    /// Counts one step.
    pub fn add(&mut self, loss: f32, accuracy: f32, samples: u64) {
        self.steps += 1;
        self.loss_sum += f64::from(loss);
        self.accuracy_sum += f64::from(accuracy);
        self.samples += samples;
    }

    /// The mean step loss and accuracy (0 without steps).
    pub fn means(&self) -> (f64, f64) {
        let n = self.steps.max(1) as f64;
        (self.loss_sum / n, self.accuracy_sum / n)
    }
}

/// Why a checkpoint could not be written or read: the file, and what went wrong.
pub type CheckpointError = FileError;

/// Writes a checkpoint named `name` into `root` (the run's `checkpoints/` folder) and
/// makes it the latest. Returns its folder. Pruning the older ones is the caller's
/// ([`prune`]), once this has returned.
///
/// A save that fails (a full disk, a folder that cannot be written) leaves the previous
/// checkpoints and `latest` as they were and removes what it had written. Tensors are
/// serialised in memory and written by Rust, so that a write error comes back as an
/// error naming the file, never as an abort inside libtorch. `replicas` (every rank's
/// own tensors, see [`replica_name`]) is written only when there are any.
pub fn write(
    root: &Path,
    name: &str,
    model: &[(String, Tensor)],
    optimizer: &[(String, Tensor)],
    replicas: &[(String, Tensor)],
    state: &CheckpointState,
) -> Result<PathBuf, CheckpointError> {
    std::fs::create_dir_all(root).map_err(io(root))?;
    let partial = root.join(format!(".{name}.partial-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&partial);
    std::fs::create_dir(&partial).map_err(io(&partial))?;
    let written = write_files(&partial, model, optimizer, state).and_then(|()| {
        if replicas.is_empty() {
            return Ok(());
        }
        let path = partial.join(REPLICAS_FILE);
        write_file(&path, &serialize(replicas, &path)?)
    });
    if let Err(error) = written {
        let _ = std::fs::remove_dir_all(&partial);
        return Err(error);
    }
    let done = root.join(name);
    if done.exists() {
        std::fs::remove_dir_all(&done).map_err(io(&done))?;
    }
    std::fs::rename(&partial, &done).map_err(io(&done))?;
    let latest = root.join(LATEST_FILE);
    let latest_partial = root.join(format!(".{LATEST_FILE}.partial-{}", std::process::id()));
    if let Err(error) = std::fs::write(&latest_partial, format!("{name}\n")) {
        let _ = std::fs::remove_file(&latest_partial);
        return Err(io(&latest_partial)(error));
    }
    std::fs::rename(&latest_partial, &latest).map_err(io(&latest))?;
    sync(root)?;
    Ok(done)
}

/// Which checkpoints a run keeps (`train.keep_checkpoints`, `train.keep_best`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// The newest checkpoints kept, the one `latest` names counted among them (0: every
    /// one).
    pub keep: usize,
    /// Also keep the one with the best validation top-1 (the newest of equals).
    pub keep_best: bool,
}

/// A checkpoint of a run, as pruning sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct SavedCheckpoint {
    pub name: String,
    pub global_step: u64,
    pub val_top1: Option<f64>,
}

/// Removes the checkpoints of `root` that `retention` does not keep, by [`to_prune`]'s
/// rule; returns the names removed. A folder whose state cannot be read is no checkpoint
/// and stays; a removal that fails is an error naming the folder.
pub fn prune(root: &Path, retention: Retention) -> Result<Vec<String>, CheckpointError> {
    if retention.keep == 0 {
        return Ok(Vec::new());
    }
    let latest_path = root.join(LATEST_FILE);
    let latest = std::fs::read_to_string(&latest_path).map_err(io(&latest_path))?;
    let mut saved = Vec::new();
    for entry in std::fs::read_dir(root).map_err(io(root))? {
        let entry = entry.map_err(io(root))?;
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        if name.starts_with('.') || !entry.path().is_dir() {
            continue;
        }
        if let Ok(state) = read_state(&entry.path()) {
            saved.push(SavedCheckpoint {
                name,
                global_step: state.global_step,
                val_top1: state.val_top1,
            });
        }
    }
    let doomed = to_prune(&saved, latest.trim(), retention);
    for name in &doomed {
        let dir = root.join(name);
        std::fs::remove_dir_all(&dir).map_err(io(&dir))?;
    }
    Ok(doomed)
}

/// Which of the checkpoints `saved` go so that the newest `retention.keep` remain (the
/// oldest go first, by global step, then by name), never `latest`, which counts as one of
/// the kept, nor (with `keep_best`) the one of the best validation top-1 (the newest of
/// equals), which does not count. Sorted by name.
pub fn to_prune(saved: &[SavedCheckpoint], latest: &str, retention: Retention) -> Vec<String> {
    let keep = retention.keep;
    if keep == 0 || saved.len() <= keep {
        return Vec::new();
    }
    let mut newest_first: Vec<&SavedCheckpoint> = saved.iter().collect();
    newest_first.sort_by(|a, b| {
        b.global_step
            .cmp(&a.global_step)
            .then_with(|| b.name.cmp(&a.name))
    });
    let best = retention
        .keep_best
        .then(|| {
            newest_first
                .iter()
                .filter_map(|c| Some((c.val_top1.filter(|t| t.is_finite())?, c.name.as_str())))
                // Newest first, so among equals the first (newest) wins.
                .reduce(|best, next| if next.0 > best.0 { next } else { best })
                .map(|(_, name)| name)
        })
        .flatten();
    let mut kept = 0;
    let mut doomed = Vec::new();
    // `latest` is kept whatever its place, and counts as one of the kept.
    if saved.iter().any(|c| c.name == latest) {
        kept += 1;
    }
    for checkpoint in newest_first {
        let name = checkpoint.name.as_str();
        if name == latest || Some(name) == best {
            continue;
        }
        if kept < keep {
            kept += 1;
        } else {
            doomed.push(name.to_string());
        }
    }
    doomed.sort();
    doomed
}

/// The checkpoint's files, written and synced into `dir`.
fn write_files(
    dir: &Path,
    model: &[(String, Tensor)],
    optimizer: &[(String, Tensor)],
    state: &CheckpointState,
) -> Result<(), CheckpointError> {
    let model_path = dir.join(MODEL_FILE);
    write_file(&model_path, &serialize(model, &model_path)?)?;
    let optimizer_path = dir.join(OPTIMIZER_FILE);
    write_file(&optimizer_path, &serialize(optimizer, &optimizer_path)?)?;
    let state_path = dir.join(STATE_FILE);
    let text = serde_json::to_string_pretty(state).map_err(|e| bad(&state_path, e))?;
    write_file(&state_path, text.as_bytes())
}

/// Named tensors in libtorch's file format, in memory, each in standard contiguous
/// (logical NCHW) layout: a channels-last weight of a CUDA trainer is copied into it, so
/// a checkpoint's bytes do not depend on `train.channels_last`.
fn serialize(tensors: &[(String, Tensor)], path: &Path) -> Result<Vec<u8>, CheckpointError> {
    let tensors = tensors
        .iter()
        .map(|(name, tensor)| Ok((name.clone(), tensor.f_contiguous()?)))
        .collect::<Result<Vec<_>, tch::TchError>>()
        .map_err(|e| torch(path, e))?;
    let buffer = SharedBuffer::default();
    Tensor::save_multi_to_stream(&tensors, buffer.clone()).map_err(|e| torch(path, e))?;
    Ok(buffer.take())
}

/// A `Write` whose bytes the caller keeps: libtorch takes ownership of the stream it
/// writes to.
#[derive(Clone, Default)]
struct SharedBuffer(std::rc::Rc<std::cell::RefCell<Vec<u8>>>);

impl SharedBuffer {
    fn take(&self) -> Vec<u8> {
        std::mem::take(&mut self.0.borrow_mut())
    }
}

impl std::io::Write for SharedBuffer {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.borrow_mut().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `bytes` into a new file at `path`, synced to disk.
fn write_file(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    use std::io::Write;
    let mut file = std::fs::File::create(path).map_err(io(path))?;
    file.write_all(bytes).map_err(io(path))?;
    file.sync_all().map_err(io(path))
}

fn sync(path: &Path) -> Result<(), CheckpointError> {
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io(path))
}

/// A checkpoint folder from what the user typed: a folder holding `state.json`, a run's
/// `checkpoints/` folder or a run folder (their latest), or `latest` under `runs_root`'s
/// newest run.
pub fn resolve(path: &Path) -> Result<PathBuf, CheckpointError> {
    if path.join(STATE_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    for root in [path.to_path_buf(), path.join("checkpoints")] {
        let latest = root.join(LATEST_FILE);
        if latest.is_file() {
            let name = std::fs::read_to_string(&latest).map_err(io(&latest))?;
            let dir = root.join(name.trim());
            if dir.join(STATE_FILE).is_file() {
                return Ok(dir);
            }
            return Err(bad(
                &latest,
                format!("names `{}`, which holds no {STATE_FILE}", name.trim()),
            ));
        }
    }
    Err(bad(
        path,
        format!("not a checkpoint (no {STATE_FILE}) and no checkpoints/{LATEST_FILE} pointer"),
    ))
}

/// Reads a checkpoint's state.
pub fn read_state(dir: &Path) -> Result<CheckpointState, CheckpointError> {
    let path = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&path).map_err(io(&path))?;
    serde_json::from_str(&text).map_err(|e| bad(&path, e))
}

/// Reads a checkpoint's tensors: the model's and the optimiser's.
#[allow(clippy::type_complexity)] // Two name/tensor lists, spelled out once here.
pub fn read_tensors(
    dir: &Path,
) -> Result<(Vec<(String, Tensor)>, Vec<(String, Tensor)>), CheckpointError> {
    let model_path = dir.join(MODEL_FILE);
    let model = Tensor::load_multi(&model_path).map_err(|e| torch(&model_path, e))?;
    let optimizer_path = dir.join(OPTIMIZER_FILE);
    let optimizer = Tensor::load_multi(&optimizer_path).map_err(|e| torch(&optimizer_path, e))?;
    Ok((model, optimizer))
}

/// The name of rank `rank`'s copy of tensor `name` in [`REPLICAS_FILE`].
pub fn replica_name(rank: u32, name: &str) -> String {
    format!("rank{rank}.{name}")
}

/// Rank `rank`'s own tensors from a decentralized job's checkpoint, by their names in
/// the model and the optimiser (momentum ones start with `momentum.`); `None` when the
/// checkpoint keeps no replicas (an allreduce job's).
pub fn read_replica(
    dir: &Path,
    rank: u32,
) -> Result<Option<Vec<(String, Tensor)>>, CheckpointError> {
    let path = dir.join(REPLICAS_FILE);
    if !path.exists() {
        return Ok(None);
    }
    let all = Tensor::load_multi(&path).map_err(|e| torch(&path, e))?;
    let prefix = replica_name(rank, "");
    let mine: Vec<(String, Tensor)> = all
        .into_iter()
        .filter_map(|(name, tensor)| Some((name.strip_prefix(&prefix)?.to_string(), tensor)))
        .collect();
    if mine.is_empty() {
        return Err(bad(&path, format!("has no tensors of rank {rank}")));
    }
    Ok(Some(mine))
}

/// Reads a checkpoint's model tensors (parameters and buffers) alone.
pub fn read_model(dir: &Path) -> Result<Vec<(String, Tensor)>, CheckpointError> {
    let path = dir.join(MODEL_FILE);
    Tensor::load_multi(&path).map_err(|e| torch(&path, e))
}

/// Copies saved values into `targets` by name; a missing name or a shape mismatch is an
/// error naming it.
pub fn restore(
    path: &Path,
    saved: &[(String, Tensor)],
    targets: &[(String, Tensor)],
) -> Result<(), CheckpointError> {
    for (name, target) in targets {
        let Some((_, value)) = saved.iter().find(|(n, _)| n == name) else {
            return Err(bad(path, format!("has no tensor `{name}`")));
        };
        if value.size() != target.size() {
            return Err(bad(
                path,
                format!(
                    "`{name}` has shape {:?}, the model's is {:?}",
                    value.size(),
                    target.size()
                ),
            ));
        }
        let value = value.to_device(target.device()).to_kind(target.kind());
        tch::no_grad(|| target.shallow_clone().f_copy_(&value)).map_err(|e| torch(path, e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> CheckpointState {
        CheckpointState {
            epoch: 2,
            global_step: 40,
            step_in_epoch: 0,
            world: 2,
            node_ranks: vec![2],
            cursors: Vec::new(),
            model: "small_cnn".into(),
            classes: 10,
            loss_scale: Some(ScalerState {
                scale: 1024.0,
                finite_steps: 7,
            }),
            epoch_sums: EpochSums {
                steps: 3,
                loss_sum: 0.1 + 0.2 + 1.0 / 3.0,
                accuracy_sum: 1.25,
                samples: 96,
            },
            val_top1: Some(0.75),
        }
    }

    #[test]
    fn write_then_resolve_and_read_back() {
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path().join("checkpoints");
        let weight = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
        let model = vec![("w".to_string(), weight.shallow_clone())];
        let optimizer = vec![("momentum.w".to_string(), weight.shallow_clone() * 0.5)];
        write(&root, "epoch-0001", &model, &optimizer, &[], &state()).expect("write");
        let newer = CheckpointState {
            epoch: 3,
            ..state()
        };
        let path = write(&root, "epoch-0002", &model, &optimizer, &[], &newer).expect("write");
        for given in [dir.path().to_path_buf(), root.clone(), path.clone()] {
            assert_eq!(resolve(&given).expect("resolve"), path, "{given:?}");
        }
        // Every field comes back to the bit, the epoch's running sums included.
        assert_eq!(read_state(&path).expect("state"), newer);
        let (saved, momentum) = read_tensors(&path).expect("tensors");
        let target = vec![("w".to_string(), Tensor::zeros([3], tch::kind::FLOAT_CPU))];
        restore(&path, &saved, &target).expect("restore");
        assert_eq!(
            Vec::<f32>::try_from(&target[0].1).expect("values"),
            [1.0, 2.0, 3.0]
        );
        assert_eq!(momentum[0].0, "momentum.w");
        // Nothing partial is left behind.
        let names: Vec<String> = std::fs::read_dir(&root)
            .expect("list")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.contains("partial")), "{names:?}");
    }

    /// A CUDA trainer's channels-last weights are written in NCHW order: the same file
    /// bytes as the NCHW weights, read back equal, and restored into either layout.
    #[test]
    fn channels_last_weights_write_the_nchw_bytes() {
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path().join("checkpoints");
        let nchw = Tensor::arange(2 * 3 * 4 * 5, tch::kind::FLOAT_CPU).reshape([2, 3, 4, 5]);
        let channels_last = crate::train::model::to_channels_last(&nchw).expect("permute");
        assert!(!channels_last.is_contiguous() && channels_last.equal(&nchw));
        let mut files = Vec::new();
        for (name, weight) in [("nchw", &nchw), ("channels-last", &channels_last)] {
            let model = vec![("conv.weight".to_string(), weight.shallow_clone())];
            let optimizer = vec![("momentum.conv.weight".to_string(), weight * 0.5)];
            let path = write(&root, name, &model, &optimizer, &[], &state()).expect("write");
            files.push(std::fs::read(path.join(MODEL_FILE)).expect("model file"));
            let (saved, momentum) = read_tensors(&path).expect("tensors");
            assert!(
                saved[0].1.equal(&nchw) && saved[0].1.is_contiguous(),
                "{name}"
            );
            assert!(momentum[0].1.equal(&(&nchw * 0.5)), "{name}");
            let target =
                crate::train::model::to_channels_last(&nchw.zeros_like()).expect("permute");
            let targets = vec![("conv.weight".to_string(), target.shallow_clone())];
            restore(&path, &saved, &targets).expect("restore");
            assert!(target.equal(&nchw) && !target.is_contiguous(), "{name}");
        }
        assert_eq!(files[0], files[1], "model.ot bytes");
    }

    #[test]
    fn epoch_sums_add_steps_and_old_states_have_none() {
        let mut sums = EpochSums::default();
        assert_eq!(sums.means(), (0.0, 0.0));
        sums.add(1.5, 0.25, 32);
        sums.add(0.5, 0.75, 16);
        assert_eq!((sums.steps, sums.samples), (2, 48));
        assert_eq!(sums.means(), (1.0, 0.5));
        let mut text = serde_json::to_value(state()).expect("json");
        text.as_object_mut().expect("object").remove("epoch_sums");
        let old: CheckpointState = serde_json::from_value(text).expect("an older state");
        assert_eq!(old.epoch_sums, EpochSums::default());
    }

    #[test]
    fn a_full_disk_is_an_error_naming_the_file() {
        let full = Path::new("/dev/full");
        let err = write_file(full, &[0u8; 4096]).expect_err("/dev/full takes nothing");
        let text = err.to_string();
        assert!(text.contains("/dev/full"), "{text}");
        assert!(
            matches!(&err, CheckpointError::Io { error, .. } if error.raw_os_error() == Some(28)),
            "ENOSPC expected: {text}"
        );
    }

    #[test]
    fn each_rank_reads_back_its_own_replica() {
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path().join("checkpoints");
        let tensor = |v: f32| Tensor::from_slice(&[v, v + 1.0]);
        let model = vec![("w".to_string(), tensor(1.5))];
        let mut replicas = Vec::new();
        for rank in 0..3u32 {
            let v = rank as f32;
            replicas.push((replica_name(rank, "w"), tensor(v)));
            replicas.push((replica_name(rank, "momentum.w"), tensor(10.0 + v)));
        }
        let path = write(&root, "epoch-0001", &model, &[], &replicas, &state()).expect("write");
        for rank in 0..3u32 {
            let mine = read_replica(&path, rank).expect("read").expect("replicas");
            let names: Vec<&str> = mine.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(names, ["w", "momentum.w"], "rank {rank}");
            let w: Vec<f32> = Vec::try_from(&mine[0].1).expect("values");
            assert_eq!(w, [rank as f32, rank as f32 + 1.0], "rank {rank}");
        }
        let err = read_replica(&path, 3).expect_err("no rank 3");
        assert!(err.to_string().contains("rank 3"), "{err}");
        // A checkpoint without replicas (an allreduce job's) has none to read.
        let plain = write(&root, "epoch-0002", &model, &[], &[], &state()).expect("write");
        assert!(read_replica(&plain, 0).expect("read").is_none());
        assert!(!plain.join(REPLICAS_FILE).exists());
    }

    #[test]
    fn bad_checkpoints_name_the_problem() {
        let dir = tempfile::tempdir().expect("temp dir");
        let err = resolve(dir.path()).expect_err("empty folder");
        assert!(err.to_string().contains("not a checkpoint"), "{err}");
        let root = dir.path().join("checkpoints");
        std::fs::create_dir_all(&root).expect("mkdir");
        std::fs::write(root.join(LATEST_FILE), "gone\n").expect("write");
        let err = resolve(dir.path()).expect_err("dangling pointer");
        assert!(err.to_string().contains("gone"), "{err}");
        let target = vec![("w".to_string(), Tensor::zeros([2], tch::kind::FLOAT_CPU))];
        let saved = vec![("w".to_string(), Tensor::zeros([3], tch::kind::FLOAT_CPU))];
        let err = restore(dir.path(), &saved, &target).expect_err("shape");
        assert!(err.to_string().contains("shape"), "{err}");
        let err = restore(dir.path(), &[], &target).expect_err("missing");
        assert!(err.to_string().contains("`w`"), "{err}");
        // A damaged tensor file: one line naming it, without libtorch's C++ stack trace.
        let damaged = dir.path().join(MODEL_FILE);
        std::fs::write(&damaged, b"PK\x03\x04 not a whole archive").expect("write");
        let err = read_tensors(dir.path()).expect_err("damaged");
        let text = err.to_string();
        assert!(text.contains(MODEL_FILE), "{text}");
        assert!(!text.contains("frame #") && !text.contains('\n'), "{text}");
        // An unreadable state.json names its cause once.
        std::fs::write(dir.path().join(STATE_FILE), [0xffu8, 0xfe]).expect("write");
        let err = anyhow::Error::from(read_state(dir.path()).expect_err("not UTF-8"));
        let text = format!("{err:#}");
        assert_eq!(text.matches("valid UTF-8").count(), 1, "{text}");
    }

    #[test]
    fn pruning_keeps_the_newest_and_always_latest() {
        let saved = |list: &[(&str, u64, Option<f64>)]| -> Vec<SavedCheckpoint> {
            list.iter()
                .map(|&(name, global_step, val_top1)| SavedCheckpoint {
                    name: name.to_string(),
                    global_step,
                    val_top1,
                })
                .collect()
        };
        let three = saved(&[
            ("epoch-0001", 10, Some(0.5)),
            ("step-00000015", 15, None),
            ("epoch-0002", 20, Some(0.4)),
        ]);
        // The best so far is the oldest but one; two share it, the newer one is kept.
        let four = saved(&[
            ("epoch-0001", 10, Some(0.6)),
            ("epoch-0002", 20, Some(0.6)),
            ("epoch-0003", 30, Some(f64::NAN)),
            ("epoch-0004", 40, Some(0.3)),
        ]);
        let (newest, best) = (false, true);
        /// (saved, latest, keep, keep_best, removed)
        type Case<'a> = (&'a [SavedCheckpoint], &'a str, usize, bool, &'a [&'a str]);
        let cases: [Case; 12] = [
            (&three, "epoch-0002", 0, newest, &[]),
            (&three, "epoch-0002", 3, newest, &[]),
            (&three, "epoch-0002", 2, newest, &["epoch-0001"]),
            (
                &three,
                "epoch-0002",
                1,
                newest,
                &["epoch-0001", "step-00000015"],
            ),
            // A resume from an older checkpoint makes it latest: it stays, and counts.
            (
                &three,
                "epoch-0001",
                1,
                newest,
                &["epoch-0002", "step-00000015"],
            ),
            (&three, "epoch-0001", 2, newest, &["step-00000015"]),
            // The best by top-1 stays beside the newest, and does not count.
            (&three, "epoch-0002", 1, best, &["step-00000015"]),
            (&three, "epoch-0002", 2, best, &[]),
            (&three, "epoch-0002", 0, best, &[]),
            // Among equals the newer; a NaN top-1 is never the best.
            (&four, "epoch-0004", 1, best, &["epoch-0001", "epoch-0003"]),
            (&four, "epoch-0004", 2, best, &["epoch-0001"]),
            // The best is also latest: nothing more is kept for it.
            (
                &four,
                "epoch-0002",
                1,
                best,
                &["epoch-0001", "epoch-0003", "epoch-0004"],
            ),
        ];
        for (saved, latest, keep, keep_best, removed) in cases {
            let retention = Retention { keep, keep_best };
            assert_eq!(
                to_prune(saved, latest, retention),
                removed,
                "latest {latest}, {retention:?}"
            );
        }
    }

    #[test]
    fn prune_removes_old_checkpoints_but_no_partial_or_foreign_folder() {
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path().join("checkpoints");
        let model = vec![("w".to_string(), Tensor::zeros([2], tch::kind::FLOAT_CPU))];
        for (name, step) in [("epoch-0001", 10), ("epoch-0002", 20), ("epoch-0003", 30)] {
            let state = CheckpointState {
                global_step: step,
                ..state()
            };
            write(&root, name, &model, &[], &[], &state).expect("write");
        }
        std::fs::create_dir(root.join(".epoch-0004.partial-1")).expect("partial");
        std::fs::create_dir(root.join("notes")).expect("foreign");
        let keep = |keep| Retention {
            keep,
            keep_best: false,
        };
        assert_eq!(
            prune(&root, keep(0)).expect("keep all"),
            Vec::<String>::new()
        );
        assert_eq!(prune(&root, keep(2)).expect("prune"), ["epoch-0001"]);
        let mut left: Vec<String> = std::fs::read_dir(&root)
            .expect("read")
            .map(|e| e.expect("entry").file_name().into_string().expect("name"))
            .collect();
        left.sort();
        assert_eq!(
            left,
            [
                ".epoch-0004.partial-1",
                "epoch-0002",
                "epoch-0003",
                "latest",
                "notes"
            ]
        );
        assert_eq!(
            resolve(dir.path()).expect("latest"),
            root.join("epoch-0003")
        );
    }
}
