//! What this machine's GPUs are doing: their utilisation and memory in use, measured
//! through NVML on a thread of its own every [`SAMPLE_EVERY`], so that a heartbeat takes
//! the newest measurement without waiting for the driver.
//!
//! - Only GPUs discovered through NVML are measured. A GPU claimed with `--num-gpus`, or
//!   one `nvidia-smi` reported (NVML did not load), has no measurement, nor has any GPU
//!   of a machine without NVML.
//! - NVML is initialised once, by the thread, and kept. If that fails the thread says so
//!   once at debug level and ends: the daemon then sends no samples, and never tries
//!   again.
//! - A read that fails makes that field of that GPU unknown (`None`), never an error; a
//!   GPU whose reads start or stop failing is logged at debug level, not every sample.
//! - The thread ends once every [`GpuSampler`] handle is gone (within [`SAMPLE_EVERY`]).

use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;
use tracing::debug;

use super::{GpuInfo, GpuSource};

/// How often the GPUs are measured. NVML's own utilisation period is 1/6 s to 1 s, by
/// model; heartbeats go every 500 ms by default and carry the newest measurement.
pub(crate) const SAMPLE_EVERY: Duration = Duration::from_secs(1);

/// What one GPU is doing; `None` where NVML did not answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct GpuUse {
    /// The share of NVML's last sample period in which a kernel ran on the GPU, 0 to 100.
    pub(crate) utilization_percent: Option<u32>,
    /// Memory in use (allocated by processes and the driver).
    pub(crate) memory_used_bytes: Option<u64>,
}

/// One GPU's use, named by its physical index ([`GpuInfo::index`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GpuSample {
    pub(crate) index: u32,
    pub(crate) usage: GpuUse,
}

/// The newest measurement of this machine's GPUs; clones share it.
#[derive(Debug, Clone, Default)]
pub(crate) struct GpuSampler {
    latest: Arc<Mutex<Vec<GpuSample>>>,
}

impl GpuSampler {
    /// Starts measuring those of `gpus` that NVML found, on a thread of its own. With none,
    /// no thread starts and [`GpuSampler::latest`] stays empty.
    pub(crate) fn start(gpus: &[GpuInfo]) -> GpuSampler {
        let sampler = GpuSampler::default();
        let indices = sampled_indices(gpus);
        if indices.is_empty() {
            return sampler;
        }
        let latest = Arc::downgrade(&sampler.latest);
        let started = std::thread::Builder::new()
            .name("imgrun-gpu-use".to_owned())
            .spawn(move || run(&indices, &latest));
        if let Err(error) = started {
            debug!(%error, "cannot start the GPU sampling thread; GPU use unknown");
        }
        sampler
    }

    /// The newest samples, one per measured GPU; empty before the first measurement and
    /// without NVML. Never waits for NVML: the thread only swaps a finished measurement in.
    pub(crate) fn latest(&self) -> Vec<GpuSample> {
        self.latest
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// A sampler that always answers `samples` (tests of what reads it).
    #[cfg(test)]
    pub(crate) fn fixed(samples: Vec<GpuSample>) -> GpuSampler {
        GpuSampler {
            latest: Arc::new(Mutex::new(samples)),
        }
    }
}

/// The physical indices of the GPUs NVML can measure: those it discovered.
fn sampled_indices(gpus: &[GpuInfo]) -> Vec<u32> {
    gpus.iter()
        .filter(|gpu| gpu.source == GpuSource::Nvml)
        .map(|gpu| gpu.index)
        .collect()
}

/// The thread: NVML once, then a measurement every [`SAMPLE_EVERY`] until `latest` is
/// gone.
fn run(indices: &[u32], latest: &Weak<Mutex<Vec<GpuSample>>>) {
    let nvml = match Nvml::init() {
        Ok(nvml) => nvml,
        Err(error) => {
            debug!(%error, "NVML unavailable for sampling; GPU use unknown");
            return;
        }
    };
    let mut failing = vec![false; indices.len()];
    loop {
        let mut samples = Vec::with_capacity(indices.len());
        for (&index, failing) in indices.iter().zip(&mut failing) {
            let (usage, error) = read_use(&nvml, index);
            match (error, *failing) {
                (Some(error), false) => {
                    debug!(index, %error, "NVML cannot read this GPU's use");
                    *failing = true;
                }
                (None, true) => {
                    debug!(index, "NVML reads this GPU's use again");
                    *failing = false;
                }
                _ => {}
            }
            samples.push(GpuSample { index, usage });
        }
        let Some(latest) = latest.upgrade() else {
            return;
        };
        *latest.lock().unwrap_or_else(PoisonError::into_inner) = samples;
        drop(latest);
        std::thread::sleep(SAMPLE_EVERY);
    }
}

/// The GPU at physical `index`'s use (`device.utilization_rates().gpu`,
/// `device.memory_info().used`), with the first error that made a field unknown.
fn read_use(nvml: &Nvml, index: u32) -> (GpuUse, Option<NvmlError>) {
    let device = match nvml.device_by_index(index) {
        Ok(device) => device,
        Err(error) => return (GpuUse::default(), Some(error)),
    };
    let utilization = device.utilization_rates();
    let memory = device.memory_info();
    let usage = GpuUse {
        utilization_percent: utilization.as_ref().ok().map(|rates| percent(rates.gpu)),
        memory_used_bytes: memory.as_ref().ok().map(|memory| memory.used),
    };
    (usage, utilization.err().or(memory.err()))
}

/// NVML's percentage, which it keeps within 0 to 100; kept there whatever a driver says.
fn percent(value: u32) -> u32 {
    value.min(100)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: u32, source: GpuSource) -> GpuInfo {
        GpuInfo {
            index,
            name: "NVIDIA H100 80GB HBM3".to_owned(),
            memory_bytes: Some(80 << 30),
            uuid: format!("GPU-{index}"),
            source,
        }
    }

    #[test]
    fn only_gpus_nvml_found_are_measured() {
        use GpuSource::{Claimed, NvidiaSmi, Nvml};
        // (the node's GPUs as (index, source), the indices measured)
        type Case = (Vec<(u32, GpuSource)>, Vec<u32>);
        let cases: Vec<Case> = vec![
            (vec![], vec![]),
            (vec![(0, Nvml), (1, Nvml)], vec![0, 1]),
            (vec![(3, Nvml), (1, Claimed), (2, Claimed)], vec![3]),
            (vec![(0, NvidiaSmi), (1, NvidiaSmi)], vec![]),
            (vec![(2, Nvml), (0, Nvml)], vec![2, 0]),
        ];
        for (gpus, want) in cases {
            let gpus: Vec<GpuInfo> = gpus
                .into_iter()
                .map(|(index, source)| gpu(index, source))
                .collect();
            assert_eq!(sampled_indices(&gpus), want, "{gpus:?}");
        }
        assert_eq!((percent(37), percent(100), percent(101)), (37, 100, 100));
    }

    #[test]
    fn without_nvml_gpus_no_thread_starts_and_nothing_is_sampled() {
        let gpus = [gpu(0, GpuSource::Claimed), gpu(1, GpuSource::NvidiaSmi)];
        let sampler = GpuSampler::start(&gpus);
        assert!(sampler.latest().is_empty());
        // No thread holds the measurement: this handle is its only owner.
        assert_eq!(Arc::weak_count(&sampler.latest), 0);
        let sample = GpuSample {
            index: 0,
            usage: GpuUse {
                utilization_percent: Some(37),
                memory_used_bytes: None,
            },
        };
        let fixed = GpuSampler::fixed(vec![sample]);
        assert_eq!(fixed.clone().latest(), vec![sample]);
    }
}
