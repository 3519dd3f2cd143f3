//! The bucket helpers that the gradient average (`ddp.rs`), averaging behind backward
//! (`overlap.rs`) and a decentralized job's mixing (`decentral.rs`) share: how parameters
//! are cut into buckets, the work a bucket is for the ring's communication thread
//! ([`Op`]), and the copies between tensors (values or gradients) and flat float
//! buffers.

use std::ops::Range;

use tch::{Device, Kind, Tensor};

use super::comm::SyncError;

/// Work for the gradient ring's communication thread (`ddp.rs`'s; the hooks of
/// `overlap.rs` hand it full buckets too).
pub(super) enum Op {
    Mean { buffer: Vec<f32>, weight: f32 },
    Broadcast { buffer: Vec<f32>, root: usize },
    Sum { buffer: Vec<f32> },
}

/// Consecutive index ranges whose sizes add up to about `limit` elements (at least one
/// parameter per bucket, at least one bucket).
pub(super) fn cut_buckets(numels: &[usize], limit: usize) -> Vec<Range<usize>> {
    let mut buckets = Vec::new();
    let (mut start, mut size) = (0, 0);
    for (i, &n) in numels.iter().enumerate() {
        if size > 0 && size + n > limit.max(1) {
            buckets.push(start..i);
            (start, size) = (i, 0);
        }
        size += n;
    }
    buckets.push(start..numels.len());
    buckets
}

/// The gradients of `parameters[range]` as one flat float tensor on their device (zeros
/// for a parameter without a gradient).
pub(super) fn flatten_grads(
    parameters: &[Tensor],
    range: Range<usize>,
) -> Result<Tensor, SyncError> {
    let mut parts = Vec::with_capacity(range.len());
    for parameter in &parameters[range] {
        let grad = parameter.grad();
        parts.push(if grad.defined() {
            grad.f_flatten(0, -1)?.f_to_kind(Kind::Float)?
        } else {
            Tensor::f_zeros(
                [parameter.numel() as i64],
                (Kind::Float, parameter.device()),
            )?
        });
    }
    Ok(Tensor::f_cat(&parts, 0)?)
}

/// `tensors` as one flat float tensor on their device.
pub(super) fn flatten_values(tensors: &[Tensor]) -> Result<Tensor, SyncError> {
    let parts = tensors
        .iter()
        .map(|t| t.f_detach()?.f_flatten(0, -1)?.f_to_kind(Kind::Float))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Tensor::f_cat(&parts, 0)?)
}

/// Copies consecutive slices of `flat` back into `tensors`, in their own kinds.
pub(super) fn scatter_values(flat: &Tensor, tensors: &[Tensor]) -> Result<(), SyncError> {
    let mut offset = 0i64;
    for tensor in tensors {
        let n = tensor.numel() as i64;
        let part = flat
            .f_narrow(0, offset, n)?
            .f_view(tensor.size().as_slice())?
            .f_to_kind(tensor.kind())?;
        tch::no_grad(|| tensor.shallow_clone().f_copy_(&part))?;
        offset += n;
    }
    Ok(())
}

pub(super) fn append_grad(
    buffer: &mut Vec<f32>,
    parameter: &Tensor,
    numel: usize,
) -> Result<(), SyncError> {
    let grad = parameter.grad();
    if grad.defined() {
        append_values(buffer, &grad)
    } else {
        buffer.resize(buffer.len() + numel, 0.0);
        Ok(())
    }
}

pub(super) fn append_values(buffer: &mut Vec<f32>, tensor: &Tensor) -> Result<(), SyncError> {
    let flat = tensor
        .f_to_device(Device::Cpu)?
        .f_to_kind(Kind::Float)?
        .f_contiguous()?;
    let start = buffer.len();
    let n = flat.numel();
    buffer.resize(start + n, 0.0);
    flat.f_copy_data(&mut buffer[start..], n)?;
    Ok(())
}

pub(super) fn write_grad(parameter: &Tensor, values: &[f32]) -> Result<(), SyncError> {
    let source = Tensor::f_from_slice(values)?.f_to_device(parameter.device())?;
    write_grad_tensor(parameter, &source)
}

/// Sets `parameter`'s gradient to the flat `values` (on its device).
pub(super) fn write_grad_tensor(parameter: &Tensor, values: &Tensor) -> Result<(), SyncError> {
    let mut grad = parameter.grad();
    let source = values.f_view(parameter.size().as_slice())?;
    if grad.defined() {
        grad.f_copy_(&source)?;
    } else {
        // A rank that ran no backward yet (out of data on its first step): give the
        // parameter its gradient through autograd, which then owns it as usual.
        let zero = (parameter * 0.0).f_sum(Kind::Float)?;
        zero.f_backward()?;
        parameter.grad().f_copy_(&source)?;
    }
    Ok(())
}

pub(super) fn write_values(tensor: &Tensor, values: &[f32]) -> Result<(), SyncError> {
    let source = Tensor::f_from_slice(values)?
        .f_view(tensor.size().as_slice())?
        .f_to_device(tensor.device())?
        .f_to_kind(tensor.kind())?;
    tch::no_grad(|| tensor.shallow_clone().f_copy_(&source))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_every_parameter_in_order() {
        // (element counts, limit, buckets as (start, end)).
        type Case = (&'static [usize], usize, &'static [(usize, usize)]);
        let cases: [Case; 5] = [
            (&[], 10, &[(0, 0)]),
            (&[5], 1, &[(0, 1)]),
            (&[4, 4, 4], 8, &[(0, 2), (2, 3)]),
            (&[20, 1, 1], 8, &[(0, 1), (1, 3)]),
            (&[1, 1, 1, 1], 100, &[(0, 4)]),
        ];
        for (numels, limit, want) in cases {
            let got: Vec<(usize, usize)> = cut_buckets(numels, limit)
                .into_iter()
                .map(|r| (r.start, r.end))
                .collect();
            assert_eq!(got, want, "{numels:?} limit {limit}");
        }
    }
}
