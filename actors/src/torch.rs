//! Probing the libtorch this process loaded: version, CUDA, and a tensor op that runs.

use std::path::PathBuf;

/// What `imgrun doctor` reports about libtorch.
#[derive(Debug, Clone)]
pub struct LibtorchReport {
    /// Version of the loaded libtorch (e.g. `2.11.0+cu128`), if it could be found.
    pub version: Option<String>,
    /// Folder the libtorch libraries were loaded from.
    pub library_dir: Option<PathBuf>,
    pub cuda_available: bool,
    pub cuda_devices: usize,
    pub cudnn_available: bool,
    /// Threads libtorch uses for intra-op parallelism.
    pub threads: i32,
    /// The NCCL CUDA trainers would average gradients through: its version and the
    /// library it came from, or why it does not load (it needs no GPU to load).
    pub nccl: Result<String, String>,
    /// Result of a small matrix product computed by libtorch, checked against the
    /// expected value.
    pub smoke_test: Result<(), String>,
}

/// Runs the probe. Cheap: one 2x2 matrix product on the CPU (and one on the first GPU
/// when there is one).
pub fn probe_libtorch() -> LibtorchReport {
    let library_dir = loaded_library_dir();
    let version = library_dir.as_deref().and_then(read_version);
    let cuda_available = tch::Cuda::is_available();
    let cuda_devices = if cuda_available {
        usize::try_from(tch::Cuda::device_count()).unwrap_or(0)
    } else {
        0
    };
    let mut smoke_test = matmul_check(tch::Device::Cpu);
    if smoke_test.is_ok() && cuda_available {
        smoke_test = matmul_check(tch::Device::Cuda(0));
    }
    LibtorchReport {
        version,
        library_dir,
        cuda_available,
        cuda_devices,
        cudnn_available: tch::Cuda::cudnn_is_available(),
        threads: tch::get_num_threads(),
        nccl: crate::train::nccl::library()
            .map(|lib| format!("{} ({})", lib.version(), lib.library_name()))
            .map_err(|e| e.to_string()),
        smoke_test,
    }
}

fn matmul_check(device: tch::Device) -> Result<(), String> {
    let a = tch::Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0])
        .view([2, 2])
        .to_device(device);
    let product = a.f_matmul(&a).map_err(|e| format!("{device:?}: {e}"))?;
    let values: Vec<f32> = Vec::<f32>::try_from(product.to_device(tch::Device::Cpu).view([-1]))
        .map_err(|e| format!("{device:?}: {e}"))?;
    if values == [7.0, 10.0, 15.0, 22.0] {
        Ok(())
    } else {
        Err(format!("{device:?}: [[1,2],[3,4]]^2 gave {values:?}"))
    }
}

/// The folder of the `libtorch_cpu` this process mapped, from `/proc/self/maps`.
fn loaded_library_dir() -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| path.ends_with("/libtorch_cpu.so"))
        .and_then(|path| PathBuf::from(path).parent().map(PathBuf::from))
}

/// The version from `torch/version.py` beside a wheel's `lib/` folder, or from
/// `build-version` in a plain libtorch folder.
fn read_version(lib: &std::path::Path) -> Option<String> {
    let root = lib.parent()?;
    if let Ok(text) = std::fs::read_to_string(root.join("version.py")) {
        let line = text.lines().find(|l| l.starts_with("__version__"))?;
        return line.split(['\'', '"']).nth(1).map(str::to_string);
    }
    std::fs::read_to_string(root.join("build-version"))
        .ok()
        .map(|v| v.trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libtorch_runs_a_tensor_op() {
        let report = probe_libtorch();
        assert_eq!(report.smoke_test, Ok(()));
        assert!(report.library_dir.is_some(), "libtorch_cpu.so not mapped");
        assert!(
            report
                .version
                .as_deref()
                .is_some_and(|v| v.starts_with("2.11.0")),
            "{report:?}"
        );
    }
}
