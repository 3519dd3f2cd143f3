//! The arithmetic a job trains in (`train.precision`): fp32 everywhere, or CUDA autocast
//! in float16 (`amp`, with loss scaling) or bfloat16 (`bf16`, whose exponent range needs
//! none). CPU trainers always compute in fp32. tch switches autocast on and off but
//! always in float16; the dtype is set through the crate's C++ shim
//! (`csrc/autocast.cpp`), per thread, right before each autocast forward.

// FFI into the crate's C++ shim; every block says why it is sound.
#![allow(unsafe_code)]

use std::ffi::c_int;

use serde::{Deserialize, Serialize};
use tch::{Device, Kind};

unsafe extern "C" {
    fn imgrun_set_cuda_autocast_dtype(code: c_int) -> c_int;
    fn imgrun_cuda_autocast_dtype() -> c_int;
}

/// `train.precision`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// f32 everywhere.
    #[default]
    Fp32,
    /// Autocast in float16 on CUDA, with loss scaling (`loss_scaling = "auto"`).
    Amp,
    /// Autocast in bfloat16 on CUDA, no loss scaling under `"auto"`.
    Bf16,
}

/// Why the autocast dtype could not be set or read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AutocastError {
    #[error("autocast cannot compute in {0:?}; only Half and BFloat16")]
    Unsupported(Kind),
    #[error("libtorch refused to {0} the CUDA autocast dtype")]
    Refused(&'static str),
}

impl Precision {
    /// Every precision, in the order the error of `from_str` lists them.
    pub const ALL: [Precision; 3] = [Precision::Fp32, Precision::Amp, Precision::Bf16];

    /// The name in configurations and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Fp32 => "fp32",
            Self::Amp => "amp",
            Self::Bf16 => "bf16",
        }
    }

    /// The dtype autocast computes in on `device`, or `None` for no autocast (fp32, and
    /// every CPU trainer).
    pub fn autocast_kind(self, device: Device) -> Option<Kind> {
        match (self, device) {
            (_, Device::Cpu) | (Self::Fp32, _) => None,
            (Self::Amp, _) => Some(Kind::Half),
            (Self::Bf16, _) => Some(Kind::BFloat16),
        }
    }

    /// Runs `forward` under this precision's autocast on `device` (none on the CPU or in
    /// fp32), with the thread's CUDA autocast dtype set first.
    pub fn autocast<T>(
        self,
        device: Device,
        forward: impl FnOnce() -> T,
    ) -> Result<T, AutocastError> {
        let Some(kind) = self.autocast_kind(device) else {
            return Ok(forward());
        };
        set_cuda_autocast_dtype(kind)?;
        Ok(tch::autocast(true, forward))
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Precision {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|precision| precision.name() == s)
            .ok_or_else(|| format!("`{s}`: expected fp32, amp or bf16"))
    }
}

/// Sets the calling thread's CUDA autocast dtype (`Half` or `BFloat16`). Needs no GPU.
pub fn set_cuda_autocast_dtype(kind: Kind) -> Result<(), AutocastError> {
    let code = match kind {
        Kind::Half => 0,
        Kind::BFloat16 => 1,
        other => return Err(AutocastError::Unsupported(other)),
    };
    // SAFETY: the shim takes any int, touches only ATen's thread-local autocast state and
    // catches every C++ exception.
    match unsafe { imgrun_set_cuda_autocast_dtype(code) } {
        0 => Ok(()),
        _ => Err(AutocastError::Refused("set")),
    }
}

/// The calling thread's CUDA autocast dtype: `Half`, `BFloat16`, or `None` for another.
pub fn cuda_autocast_dtype() -> Result<Option<Kind>, AutocastError> {
    // SAFETY: the shim only reads ATen's thread-local autocast state and catches every
    // C++ exception.
    match unsafe { imgrun_cuda_autocast_dtype() } {
        0 => Ok(Some(Kind::Half)),
        1 => Ok(Some(Kind::BFloat16)),
        2 => Ok(None),
        _ => Err(AutocastError::Refused("read")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::scaler::{LossScaler, LossScaling};

    #[test]
    fn names_parse_and_a_bad_one_lists_all_three() {
        for precision in Precision::ALL {
            assert_eq!(precision.name().parse(), Ok(precision));
            let json = serde_json::to_string(&precision).expect("a unit variant serializes");
            assert_eq!(json, format!("\"{precision}\""));
        }
        let error = "fp16".parse::<Precision>().expect_err("not a precision");
        for want in ["fp16", "fp32", "amp", "bf16"] {
            assert!(error.contains(want), "{want}: {error}");
        }
    }

    /// What each precision computes in on each device, and whether `loss_scaling =
    /// "auto"` scales the loss then.
    #[test]
    fn precision_and_device_pick_the_autocast_dtype_and_the_scaler() {
        let cuda = Device::Cuda(0);
        // (precision, device, autocast dtype, auto loss scaling)
        let cases = [
            (Precision::Fp32, Device::Cpu, None, false),
            (Precision::Amp, Device::Cpu, None, false),
            (Precision::Bf16, Device::Cpu, None, false),
            (Precision::Fp32, cuda, None, false),
            (Precision::Amp, cuda, Some(Kind::Half), true),
            (Precision::Bf16, cuda, Some(Kind::BFloat16), false),
        ];
        for (precision, device, kind, scaled) in cases {
            let got = precision.autocast_kind(device);
            assert_eq!(got, kind, "{precision} on {device:?}");
            let scaler = LossScaler::for_job(LossScaling::Auto, 1024.0, got);
            assert_eq!(scaler.enabled(), scaled, "{precision} on {device:?}");
        }
    }

    #[test]
    fn the_cuda_autocast_dtype_round_trips_on_this_thread() {
        // ATen's autocast state is per thread: a thread of its own leaves the test
        // runner's others as they were.
        let seen = std::thread::spawn(|| {
            let before = cuda_autocast_dtype();
            let mut seen = vec![before];
            for kind in [Kind::BFloat16, Kind::Half, Kind::BFloat16] {
                set_cuda_autocast_dtype(kind).expect("set");
                seen.push(cuda_autocast_dtype());
            }
            seen
        })
        .join()
        .expect("the thread ends");
        let half = Ok(Some(Kind::Half));
        let bf16 = Ok(Some(Kind::BFloat16));
        // ATen's default is float16.
        assert_eq!(seen, [half.clone(), bf16.clone(), half, bf16]);
        assert_eq!(
            set_cuda_autocast_dtype(Kind::Float),
            Err(AutocastError::Unsupported(Kind::Float))
        );
    }

    #[test]
    fn cpu_and_fp32_forwards_run_without_autocast() {
        for (precision, device) in [
            (Precision::Bf16, Device::Cpu),
            (Precision::Amp, Device::Cpu),
            (Precision::Fp32, Device::Cuda(0)),
        ] {
            let ran = precision.autocast(device, || 7);
            assert_eq!(ran, Ok(7), "{precision} on {device:?}");
        }
    }
}
