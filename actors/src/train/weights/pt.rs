//! The archive `torch.save` writes and `torch.load(path, weights_only=True)` reads: a zip
//! of stored (uncompressed) records under one folder: `data.pkl` (the state dict's
//! pickle), `data/<key>` (each storage's bytes, aligned to 64 bytes as PyTorch aligns
//! them), `byteorder` and `version`.

use std::io::{Cursor, Read, Write};

use tch::Tensor;

use super::pickle::{self, TensorRef, Value};
use super::{KINDS, kind_entry, tensor_bytes, tensor_from_bytes};

/// The folder every record is in (PyTorch takes it from the first record, whatever it is).
const FOLDER: &str = "archive";
/// The format version PyTorch 2 writes.
const VERSION: &str = "3\n";
/// Where each record's bytes start, as PyTorch writes them (so `torch.load(mmap=True)`
/// can map them).
const ALIGNMENT: u16 = 64;

/// The archive's bytes for `tensors` (a state dict: one storage per tensor).
pub(super) fn serialize(tensors: &[(String, Tensor)]) -> Result<Vec<u8>, String> {
    let mut entries = Vec::with_capacity(tensors.len());
    let mut storages = Vec::with_capacity(tensors.len());
    for (index, (name, tensor)) in tensors.iter().enumerate() {
        let (_, _, storage_type, _) =
            kind_entry(tensor.kind()).map_err(|e| format!("`{name}`: {e}"))?;
        let size = tensor.size();
        let reference = TensorRef {
            storage_type: storage_type.to_string(),
            key: index.to_string(),
            offset: 0,
            stride: contiguous_strides(&size),
            size,
        };
        entries.push((name.clone(), reference, tensor.numel()));
        storages.push(tensor_bytes(tensor).map_err(|e| format!("`{name}`: {e}"))?);
    }
    let zip_error = |e: zip::result::ZipError| format!("writing the archive: {e}");
    let io_error = |e: std::io::Error| format!("writing the archive: {e}");
    let mut zip = zip::ZipWriter::new(Cursor::new(Vec::new()));
    let options =
        zip::write::FileOptions::default().compression_method(zip::CompressionMethod::Stored);
    let record = |zip: &mut zip::ZipWriter<_>, name: &str, bytes: &[u8]| {
        zip.start_file_aligned(format!("{FOLDER}/{name}"), options, ALIGNMENT)
            .map_err(zip_error)?;
        zip.write_all(bytes).map_err(io_error)
    };
    record(&mut zip, "data.pkl", &pickle::state_dict(&entries))?;
    record(&mut zip, "byteorder", b"little")?;
    for (index, bytes) in storages.iter().enumerate() {
        record(&mut zip, &format!("data/{index}"), bytes)?;
    }
    record(&mut zip, "version", VERSION.as_bytes())?;
    Ok(zip.finish().map_err(zip_error)?.into_inner())
}

/// The named tensors of a `torch.save` archive of a state dict, sorted by name.
pub(super) fn deserialize(bytes: &[u8]) -> Result<Vec<(String, Tensor)>, String> {
    let mut zip = zip::ZipArchive::new(Cursor::new(bytes))
        .map_err(|e| format!("not a torch.save archive: {e}"))?;
    let pickle_name = zip
        .file_names()
        .find(|name| name.ends_with("/data.pkl") && name.matches('/').count() == 1)
        .ok_or("a zip without the data.pkl of a torch.save archive")?
        .to_string();
    let folder = pickle_name.trim_end_matches("data.pkl").to_string();
    if let Ok(order) = read_record(&mut zip, &format!("{folder}byteorder"), 16)
        && order != b"little"
    {
        return Err(format!(
            "saved with byte order {:?}; only little-endian archives are read",
            String::from_utf8_lossy(&order)
        ));
    }
    let pickle = read_record(&mut zip, &pickle_name, bytes.len())?;
    let Value::Dict(items) = pickle::load(&pickle).map_err(|e| format!("{pickle_name}: {e}"))?
    else {
        return Err(format!("{pickle_name} holds no dict of tensors"));
    };
    let mut tensors = Vec::with_capacity(items.len());
    for (key, value) in items {
        let (Value::Str(name), Value::Tensor(reference)) = (key, value) else {
            return Err(format!(
                "{pickle_name}: an entry that is not a name and a tensor"
            ));
        };
        let storage = read_record(
            &mut zip,
            &format!("{folder}data/{}", reference.key),
            bytes.len(),
        )?;
        let tensor = view(&storage, &reference).map_err(|e| format!("`{name}`: {e}"))?;
        tensors.push((name, tensor));
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(tensors)
}

/// The tensor `reference` describes over the bytes of its storage, as a contiguous copy;
/// refused where the view reaches past the storage.
pub(super) fn view(storage: &[u8], reference: &TensorRef) -> Result<Tensor, String> {
    let (kind, _, _, width) = KINDS
        .into_iter()
        .find(|entry| entry.2 == reference.storage_type)
        .ok_or_else(|| format!("{} is not supported", reference.storage_type))?;
    if !storage.len().is_multiple_of(width) {
        return Err(format!(
            "a {} of {} bytes",
            reference.storage_type,
            storage.len()
        ));
    }
    let numel = (storage.len() / width) as i64;
    let (size, stride, offset) = (&reference.size, &reference.stride, reference.offset);
    if size.len() != stride.len() || size.iter().chain(stride).any(|&d| d < 0) || offset < 0 {
        return Err(format!(
            "bad view: size {size:?}, stride {stride:?}, offset {offset}"
        ));
    }
    let empty = size.contains(&0);
    let last = size
        .iter()
        .zip(stride)
        .try_fold(offset, |at, (&n, &s)| {
            (n - 1)
                .max(0)
                .checked_mul(s)
                .and_then(|d| at.checked_add(d))
        })
        .ok_or("a view whose extent overflows")?;
    if !empty && last >= numel {
        return Err(format!(
            "size {size:?}, stride {stride:?} and offset {offset} reach element {last} of a \
             storage of {numel}"
        ));
    }
    let flat = tensor_from_bytes(storage, &[numel], kind)?;
    flat.f_as_strided(size.as_slice(), stride.as_slice(), offset)
        .and_then(|t| t.f_contiguous())
        .map_err(|e| e.to_string())
}

/// A record's bytes, refused past `limit` (the archive's own size: a damaged size field
/// cannot ask for more memory than that).
fn read_record(
    zip: &mut zip::ZipArchive<Cursor<&[u8]>>,
    name: &str,
    limit: usize,
) -> Result<Vec<u8>, String> {
    let file = zip
        .by_name(name)
        .map_err(|e| format!("record {name}: {e}"))?;
    if file.size() > limit as u64 {
        return Err(format!("record {name} declares {} bytes", file.size()));
    }
    let mut bytes = Vec::with_capacity(file.size() as usize);
    file.take(limit as u64)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("record {name}: {e}"))?;
    Ok(bytes)
}

/// The strides of a standard contiguous tensor of `size`.
fn contiguous_strides(size: &[i64]) -> Vec<i64> {
    let mut strides = vec![1i64; size.len()];
    for i in (0..size.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * size[i + 1].max(1);
    }
    strides
}
