//! Weights in the formats other tools load: a model's state dict under torchvision's
//! names, as safetensors (`safetensors.rs`) or as the zip archive `torch.save` writes
//! (`pt.rs`, with the pickle it holds in `pickle.rs`); and the reverse, starting a model
//! from such a file (`model.init`).
//!
//! The names are the ones `tch`'s `VarStore` gives our models (`layer1.0.bn1.weight`,
//! `fc.bias`), which for the ResNets are torchvision's own; a state dict adds the
//! `num_batches_tracked` counter PyTorch keeps beside each BatchNorm's running statistics.

mod pickle;
mod pt;
mod safetensors;

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use tch::{Kind, Tensor};

use super::checkpoint;
use super::file_error::FileError;
use super::file_error::{bad, io};
use super::model::{Model, ModelKind};

/// The suffix of a BatchNorm's running mean; its layer also has `running_var` and, in a
/// PyTorch state dict, `num_batches_tracked`.
const RUNNING_MEAN: &str = "running_mean";
const BATCHES_TRACKED: &str = "num_batches_tracked";
/// The classifier's tensors, the ones `model.init` replaces when the class count differs.
const CLASSIFIER: [&str; 2] = ["fc.weight", "fc.bias"];

/// A file format for weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightsFormat {
    /// safetensors with `{"format": "pt"}` metadata.
    Safetensors,
    /// The archive `torch.save` writes (`torch.load(path, weights_only=True)` reads it).
    Pt,
}

impl WeightsFormat {
    pub const ALL: [WeightsFormat; 2] = [WeightsFormat::Safetensors, WeightsFormat::Pt];

    pub fn name(self) -> &'static str {
        match self {
            WeightsFormat::Safetensors => "safetensors",
            WeightsFormat::Pt => "pt",
        }
    }

    /// The format a file name implies: `.safetensors`, or `.pt`/`.pth`.
    pub fn of_path(path: &Path) -> Option<WeightsFormat> {
        match path.extension()?.to_str()? {
            "safetensors" => Some(WeightsFormat::Safetensors),
            "pt" | "pth" => Some(WeightsFormat::Pt),
            _ => None,
        }
    }
}

impl fmt::Display for WeightsFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for WeightsFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        WeightsFormat::ALL
            .into_iter()
            .find(|format| format.name() == s)
            .ok_or_else(|| {
                let valid: Vec<&str> = WeightsFormat::ALL.iter().map(|f| f.name()).collect();
                format!("unknown format {s:?}; expected one of {}", valid.join(", "))
            })
    }
}

/// Why a weights file could not be written or read: the file, and what went wrong.
pub type WeightsError = FileError;

/// A model's tensors (parameters and buffers, as a checkpoint holds them) as a PyTorch
/// state dict: names with `.` separators (a `|` from tch's files becomes `.`), every
/// tensor on the CPU in standard contiguous layout, and each BatchNorm's
/// `num_batches_tracked` (an int64 scalar, as PyTorch keeps it) set to `batches`, the
/// training steps the statistics have seen. Sorted by name.
pub fn state_dict(tensors: &[(String, Tensor)], batches: i64) -> Vec<(String, Tensor)> {
    let mut dict: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(name, tensor)| {
            let tensor = tensor.detach().to_device(tch::Device::Cpu).contiguous();
            (name.replace('|', "."), tensor)
        })
        .collect();
    let counters: Vec<(String, Tensor)> = dict
        .iter()
        .filter_map(|(name, _)| name.strip_suffix(RUNNING_MEAN))
        .map(|layer| {
            (
                format!("{layer}{BATCHES_TRACKED}"),
                Tensor::scalar_tensor(batches as f64, (Kind::Int64, tch::Device::Cpu)),
            )
        })
        .collect();
    dict.extend(counters);
    dict.sort_by(|a, b| a.0.cmp(&b.0));
    dict
}

/// Writes `tensors` to `path` in `format`: into a partial file beside it, renamed into
/// place once whole, so a failed write leaves nothing at `path`.
pub fn write(
    path: &Path,
    format: WeightsFormat,
    tensors: &[(String, Tensor)],
) -> Result<(), WeightsError> {
    let bytes = match format {
        WeightsFormat::Safetensors => safetensors::serialize(tensors).map_err(|e| bad(path, e))?,
        WeightsFormat::Pt => pt::serialize(tensors).map_err(|e| bad(path, e))?,
    };
    let name = path
        .file_name()
        .ok_or_else(|| bad(path, "names no file"))?
        .to_string_lossy();
    let partial = path.with_file_name(format!(".{name}.partial-{}", std::process::id()));
    let written = write_file(&partial, &bytes)
        .and_then(|()| std::fs::rename(&partial, path).map_err(io(path)));
    if written.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    written.map_err(|error| match error {
        // Name the file the user asked for, not the partial one.
        WeightsError::Io { error, .. } => io(path)(error),
        other => other,
    })
}

/// Reads the named tensors of a safetensors file or a `torch.save` archive (told apart by
/// their first bytes), on the CPU.
pub fn read(path: &Path) -> Result<Vec<(String, Tensor)>, WeightsError> {
    let bytes = std::fs::read(path).map_err(io(path))?;
    if bytes.starts_with(b"PK\x03\x04") {
        pt::deserialize(&bytes).map_err(|e| bad(path, e))
    } else {
        safetensors::deserialize(&bytes).map_err(|e| bad(path, e))
    }
}

/// What [`export`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exported {
    pub tensors: usize,
    pub model: String,
    pub classes: i64,
}

/// Writes the model of the checkpoint in `dir` to `out` as a state dict in `format`, its
/// BatchNorm counters at the checkpoint's global step.
pub fn export(dir: &Path, format: WeightsFormat, out: &Path) -> Result<Exported, WeightsError> {
    let state = checkpoint::read_state(dir).map_err(|e| bad(dir, e))?;
    let tensors = checkpoint::read_model(dir).map_err(|e| bad(dir, e))?;
    let batches = i64::try_from(state.global_step).unwrap_or(i64::MAX);
    let dict = state_dict(&tensors, batches);
    write(out, format, &dict)?;
    Ok(Exported {
        tensors: dict.len(),
        model: state.model,
        classes: state.classes,
    })
}

/// Runs the model of the checkpoint in `dir`, built as the trainers build it, in eval
/// mode on the float32 NCHW tensor `images` of the safetensors file `images`, and writes
/// its `logits` to the safetensors file `out`: what the export is checked against.
pub fn write_logits(dir: &Path, images: &Path, out: &Path) -> Result<(), WeightsError> {
    let state = checkpoint::read_state(dir).map_err(|e| bad(dir, e))?;
    let tensors = checkpoint::read_model(dir).map_err(|e| bad(dir, e))?;
    let kind: ModelKind = state.model.parse().map_err(|e| bad(dir, e))?;
    // The small CNN's width is its first convolution's output channels.
    let width = tensors
        .iter()
        .find(|(name, _)| name.replace('|', ".") == "block1.conv.weight")
        .map_or(1, |(_, t)| t.size()[0]);
    let model =
        Model::new(kind, state.classes, width, tch::Device::Cpu).map_err(|e| bad(dir, e))?;
    let mut targets = model.parameters();
    targets.extend(model.buffers());
    let tensors: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(n, t)| (n.replace('|', "."), t.shallow_clone()))
        .collect();
    checkpoint::restore(dir, &tensors, &targets).map_err(|e| bad(dir, e))?;
    let batch = read(images)?
        .into_iter()
        .find(|(name, _)| name == "images")
        .ok_or_else(|| bad(images, "has no tensor `images`"))?
        .1;
    // The models' layers panic on other shapes; refuse those here.
    let size = batch.size();
    if size.len() != 4 || size[1] != 3 || size[2] < 32 || size[3] < 32 {
        return Err(bad(
            images,
            format!("`images` is {size:?}; expected [N, 3, H, W] with H and W of 32 or more"),
        ));
    }
    let logits = tch::no_grad(|| model.forward_t(&batch.to_kind(Kind::Float), false));
    write(
        out,
        WeightsFormat::Safetensors,
        &[("logits".to_string(), logits)],
    )
}

/// What starting from a file of weights did besides copying them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitOutcome {
    /// The file's classifier shape and the model's, when they differ: the model keeps
    /// its freshly initialised classifier.
    pub replaced_classifier: Option<(Vec<i64>, Vec<i64>)>,
    /// Tensors copied.
    pub copied: usize,
}

impl InitOutcome {
    /// One line saying what happened, for the job's output.
    pub fn describe(&self, path: &Path) -> String {
        let mut text = format!(
            "model.init: {} tensors from {}",
            self.copied,
            path.display()
        );
        if let Some((file, model)) = &self.replaced_classifier {
            text.push_str(&format!(
                "; the classifier was replaced (the file's fc.weight is {file:?}, this \
                 job's {model:?}): it starts freshly initialised"
            ));
        }
        text
    }
}

/// Copies the weights of the state dict at `path` (safetensors or `torch.save`, under
/// torchvision's names) into `model`: every parameter and buffer must be there with the
/// model's shape, except the classifier, which keeps its fresh values when its shape
/// differs (another class count). A name the model lacks is an error too, but for the
/// `num_batches_tracked` counters, which the model does not keep.
pub fn load_init(model: &Model, path: &Path) -> Result<InitOutcome, WeightsError> {
    let saved = read(path)?;
    let mut targets = model.parameters();
    targets.extend(model.buffers());
    let layers: Vec<&str> = targets
        .iter()
        .filter_map(|(name, _)| name.strip_suffix(RUNNING_MEAN))
        .collect();
    if let Some((name, _)) = saved.iter().find(|(name, _)| {
        let counter = name
            .strip_suffix(BATCHES_TRACKED)
            .is_some_and(|layer| layers.contains(&layer));
        !counter && !targets.iter().any(|(target, _)| target == name)
    }) {
        return Err(bad(
            path,
            format!(
                "has `{name}`, which {} has not: a state dict of another model?",
                model.kind()
            ),
        ));
    }
    let mut outcome = InitOutcome {
        replaced_classifier: None,
        copied: 0,
    };
    for (name, target) in &targets {
        let Some((_, value)) = saved.iter().find(|(n, _)| n == name) else {
            return Err(bad(
                path,
                format!("has no `{name}`, which {} needs", model.kind()),
            ));
        };
        if value.size() != target.size() {
            if CLASSIFIER.contains(&name.as_str()) {
                if name == CLASSIFIER[0] {
                    outcome.replaced_classifier = Some((value.size(), target.size()));
                }
                continue;
            }
            return Err(bad(
                path,
                format!(
                    "`{name}` has shape {:?}, {}'s is {:?}",
                    value.size(),
                    model.kind(),
                    target.size()
                ),
            ));
        }
        if !is_float(value.kind()) {
            return Err(bad(
                path,
                format!(
                    "`{name}` holds {:?} values, not floating point",
                    value.kind()
                ),
            ));
        }
        let value = value.to_device(target.device()).to_kind(target.kind());
        tch::no_grad(|| target.shallow_clone().f_copy_(&value))
            .map_err(|e| bad(path, format!("copying `{name}`: {e}")))?;
        outcome.copied += 1;
    }
    Ok(outcome)
}

/// [`load_init`] into a fresh CPU model of `kind`, `classes` and `width` (the small
/// CNN's): whether the file at `path` fits the job, before any trainer starts.
pub fn check_init(
    kind: ModelKind,
    classes: i64,
    width: i64,
    path: &Path,
) -> Result<InitOutcome, WeightsError> {
    let model = Model::new(kind, classes, width, tch::Device::Cpu)
        .map_err(|e| bad(path, format!("building {kind} to check it: {e}")))?;
    load_init(&model, path)
}

fn is_float(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16
    )
}

/// `bytes` into a new file at `path`, synced to disk.
fn write_file(path: &Path, bytes: &[u8]) -> Result<(), WeightsError> {
    use std::io::Write;
    let mut file = std::fs::File::create(path).map_err(io(path))?;
    file.write_all(bytes).map_err(io(path))?;
    file.sync_all().map_err(io(path))
}

/// The element kinds both formats store, with their names in each and their width.
/// (kind, safetensors dtype, torch storage class, bytes per element)
const KINDS: [(Kind, &str, &str, usize); 9] = [
    (Kind::Float, "F32", "FloatStorage", 4),
    (Kind::Double, "F64", "DoubleStorage", 8),
    (Kind::Half, "F16", "HalfStorage", 2),
    (Kind::BFloat16, "BF16", "BFloat16Storage", 2),
    (Kind::Int64, "I64", "LongStorage", 8),
    (Kind::Int, "I32", "IntStorage", 4),
    (Kind::Int16, "I16", "ShortStorage", 2),
    (Kind::Int8, "I8", "CharStorage", 1),
    (Kind::Uint8, "U8", "ByteStorage", 1),
];

/// A CPU tensor's elements as little-endian bytes (the machine's order: both formats are
/// written on little-endian machines only).
fn tensor_bytes(tensor: &Tensor) -> Result<Vec<u8>, String> {
    let (_, _, _, width) = kind_entry(tensor.kind())?;
    let tensor = tensor.to_device(tch::Device::Cpu).contiguous();
    let numel = tensor.numel();
    let mut bytes = vec![0u8; numel * width];
    tensor
        .f_copy_data_u8(&mut bytes, numel)
        .map_err(|e| e.to_string())?;
    Ok(bytes)
}

/// A tensor of `kind` and `shape` from little-endian bytes; their count must fit.
fn tensor_from_bytes(bytes: &[u8], shape: &[i64], kind: Kind) -> Result<Tensor, String> {
    let (_, _, _, width) = kind_entry(kind)?;
    let numel = shape
        .iter()
        .try_fold(1i64, |n, &d| (d >= 0).then(|| n.checked_mul(d)).flatten())
        .ok_or_else(|| format!("bad shape {shape:?}"))?;
    if bytes.len() as u64 != numel as u64 * width as u64 {
        return Err(format!(
            "{} bytes for shape {shape:?} of {kind:?}, which takes {}",
            bytes.len(),
            numel as u64 * width as u64
        ));
    }
    Tensor::f_from_data_size(bytes, shape, kind).map_err(|e| e.to_string())
}

fn kind_entry(kind: Kind) -> Result<(Kind, &'static str, &'static str, usize), String> {
    KINDS
        .into_iter()
        .find(|entry| entry.0 == kind)
        .ok_or_else(|| format!("{kind:?} tensors are not supported"))
}

#[cfg(test)]
mod tests;
