//! Small tensors between the host and a CUDA device with as few host synchronisations as
//! a step allows: values read together in one transfer, and uploads from pinned memory
//! that do not wait for the device (a copy from pageable memory makes the host wait for
//! all the work queued before it).

use tch::{Device, Kind, TchError, Tensor};

/// `scalars` (0-dimensional tensors of one device, any kind) brought to the host in one
/// transfer, as f64 (exact for f32 values and for counts below 2^53).
pub fn to_host(scalars: &[Tensor]) -> Result<Vec<f64>, TchError> {
    let _no_grad = tch::no_grad_guard();
    let parts = scalars
        .iter()
        .map(|t| t.f_detach()?.f_to_kind(Kind::Double)?.f_reshape([1]))
        .collect::<Result<Vec<_>, _>>()?;
    Vec::<f64>::try_from(Tensor::f_cat(&parts, 0)?.f_to_device(Device::Cpu)?)
}

/// `host` (a CPU tensor) on `device`: on CUDA copied from pinned memory without making
/// the host wait (libtorch keeps the pinned block until the copy is done); on the CPU as
/// it is.
pub fn to_device_async(host: &Tensor, device: Device) -> Result<Tensor, TchError> {
    if device == Device::Cpu {
        return Ok(host.shallow_clone());
    }
    host.f_pin_memory(device)?
        .f_to_device_(device, host.f_kind()?, true, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalars_reach_the_host_in_one_read_with_their_exact_values() {
        let loss = Tensor::from_slice(&[0.1f32]).reshape([]);
        let count = Tensor::from_slice(&[12345_i64]).reshape([]);
        let read = to_host(&[loss.shallow_clone(), count]).expect("to_host");
        assert_eq!(read.len(), 2);
        assert_eq!(read[0] as f32, loss.double_value(&[]) as f32);
        assert_eq!(read[0], f64::from(0.1f32));
        assert_eq!(read[1], 12345.0);
        assert_eq!(to_host(&[]).map(|v| v.len()).ok(), None, "cat of nothing");
    }

    #[test]
    fn an_upload_to_the_cpu_is_the_tensor_itself() {
        let host = Tensor::from_slice(&[1.5f32, -2.0]);
        let uploaded = to_device_async(&host, Device::Cpu).expect("upload");
        assert_eq!(uploaded.data_ptr(), host.data_ptr());
    }
}
