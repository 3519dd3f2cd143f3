//! safetensors files through the `safetensors` crate, with the `{"format": "pt"}`
//! metadata that transformers and timm look for, and every tensor in standard
//! contiguous layout (a channels-last tensor is copied into it).

use std::borrow::Cow;
use std::collections::HashMap;

use safetensors::tensor::{Dtype, SafeTensors, View};
use tch::Tensor;

use super::{KINDS, kind_entry, tensor_bytes, tensor_from_bytes};

/// One tensor's bytes as the crate serialises them.
struct Bytes {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl View for &Bytes {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }

    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// The file's bytes for `tensors`.
pub(super) fn serialize(tensors: &[(String, Tensor)]) -> Result<Vec<u8>, String> {
    let mut views = Vec::with_capacity(tensors.len());
    for (name, tensor) in tensors {
        let (_, dtype, _, _) = kind_entry(tensor.kind()).map_err(|e| format!("`{name}`: {e}"))?;
        views.push((
            name.clone(),
            Bytes {
                dtype: dtype_of(dtype)?,
                shape: tensor.size().iter().map(|&d| d as usize).collect(),
                data: tensor_bytes(tensor).map_err(|e| format!("`{name}`: {e}"))?,
            },
        ));
    }
    let metadata = Some(HashMap::from([("format".to_string(), "pt".to_string())]));
    safetensors::tensor::serialize(views.iter().map(|(n, b)| (n.as_str(), b)), &metadata)
        .map_err(|e| format!("serialising: {e:?}"))
}

/// The named tensors of a safetensors file, sorted by name.
pub(super) fn deserialize(bytes: &[u8]) -> Result<Vec<(String, Tensor)>, String> {
    let file = SafeTensors::deserialize(bytes)
        .map_err(|e| format!("not a safetensors file or a torch.save archive ({e:?})"))?;
    let mut tensors = Vec::new();
    for (name, view) in file.tensors() {
        let dtype = format!("{:?}", view.dtype());
        let (kind, _, _, _) = KINDS
            .into_iter()
            .find(|entry| entry.1 == dtype)
            .ok_or_else(|| format!("`{name}`: {dtype} tensors are not supported"))?;
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        let tensor =
            tensor_from_bytes(view.data(), &shape, kind).map_err(|e| format!("`{name}`: {e}"))?;
        tensors.push((name, tensor));
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(tensors)
}

/// The crate's dtype named as in the file format (`F32`, ...).
fn dtype_of(name: &str) -> Result<Dtype, String> {
    Ok(match name {
        "F32" => Dtype::F32,
        "F64" => Dtype::F64,
        "F16" => Dtype::F16,
        "BF16" => Dtype::BF16,
        "I64" => Dtype::I64,
        "I32" => Dtype::I32,
        "I16" => Dtype::I16,
        "I8" => Dtype::I8,
        "U8" => Dtype::U8,
        other => return Err(format!("no safetensors dtype {other}")),
    })
}
