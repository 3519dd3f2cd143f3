//! What this machine offers: logical CPUs, memory, GPUs and its name.

use tracing::info;

use crate::gpu::{self, GpuInfo, VisibleDevices};

/// Resources of the local machine, without GPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostResources {
    pub cpus: usize,
    pub memory_bytes: Option<u64>,
}

/// Everything a node offers to the cluster, as discovered and overridden by
/// [`DiscoverOptions`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeResources {
    /// Logical CPUs (discovered or `--num-cpus`).
    pub cpus: usize,
    pub memory_bytes: Option<u64>,
    /// In the order CUDA would number them for this process; see [`GpuInfo::index`].
    pub gpus: Vec<GpuInfo>,
    /// `None` when the kernel does not say.
    pub hostname: Option<String>,
}

/// Overrides for [`discover`]; the default discovers everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiscoverOptions {
    /// `--num-cpus`: offer this many CPUs whatever the machine has.
    pub num_cpus: Option<usize>,
    /// `--num-gpus`: `Some(0)` offers none; `Some(n)` the first `n` visible GPUs, made up
    /// to `n` with claimed ones (at most [`crate::MAX_CLAIMED_GPUS`] in all).
    pub num_gpus: Option<usize>,
    /// Which `CUDA_VISIBLE_DEVICES` to honour (the process's by default).
    pub visible_devices: VisibleDevices,
}

/// Discovers what this node offers. Never fails: what cannot be found is unknown or
/// absent, and the reason is logged.
pub fn discover(options: &DiscoverOptions) -> NodeResources {
    let host = discover_host();
    let gpus = gpu::discover_gpus(&options.visible_devices, options.num_gpus);
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .and_then(|text| parse_hostname(&text));
    let resources = NodeResources {
        cpus: options.num_cpus.unwrap_or(host.cpus),
        memory_bytes: host.memory_bytes,
        gpus,
        hostname,
    };
    info!(
        cpus = resources.cpus,
        memory_bytes = resources.memory_bytes,
        gpus = resources.gpus.len(),
        claimed_gpus = resources.gpus.iter().filter(|g| !g.discovered()).count(),
        hostname = resources.hostname.as_deref(),
        "node resources discovered"
    );
    resources
}

/// Discovers the local machine's CPUs (honouring affinity and cgroup limits, as
/// `std::thread::available_parallelism` does) and total memory (from `/proc/meminfo`).
pub fn discover_host() -> HostResources {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let memory_bytes = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| parse_mem_total(&text));
    HostResources { cpus, memory_bytes }
}

/// Total memory in bytes from the text of `/proc/meminfo`.
fn parse_mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut parts = line.split_whitespace().skip(1);
    let value: u64 = parts.next()?.parse().ok()?;
    match parts.next() {
        Some("kB") | None => value.checked_mul(1024),
        Some(_) => None,
    }
}

/// The host name from the text of `/proc/sys/kernel/hostname`.
fn parse_hostname(text: &str) -> Option<String> {
    let name = text.trim();
    (!name.is_empty() && !name.contains(char::is_whitespace)).then(|| name.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_is_parsed() {
        let cases = [
            (
                "MemTotal:       24576000 kB\nMemFree: 1 kB\n",
                Some(24_576_000 * 1024),
            ),
            ("MemFree: 1 kB\n", None),
            ("MemTotal: lots kB\n", None),
            ("MemTotal: 18446744073709551615 kB\n", None),
        ];
        for (text, want) in cases {
            assert_eq!(parse_mem_total(text), want, "{text:?}");
        }
    }

    #[test]
    fn hostname_is_parsed() {
        let cases = [
            ("worker-3\n", Some("worker-3")),
            ("  gpu01.example.org \n", Some("gpu01.example.org")),
            ("\n", None),
            ("two words\n", None),
        ];
        for (text, want) in cases {
            assert_eq!(parse_hostname(text).as_deref(), want, "{text:?}");
        }
    }

    #[test]
    fn host_has_at_least_one_cpu() {
        assert!(discover_host().cpus >= 1);
    }

    #[test]
    fn options_override_discovery() {
        let options = DiscoverOptions {
            num_cpus: Some(3),
            num_gpus: Some(2),
            // Hides this machine's GPUs, if any, so both GPUs are claimed.
            visible_devices: VisibleDevices::Set("-1".to_string()),
        };
        let node = discover(&options);
        assert_eq!(node.cpus, 3);
        assert_eq!(node.memory_bytes, discover_host().memory_bytes);
        let uuids: Vec<&str> = node.gpus.iter().map(|g| g.uuid.as_str()).collect();
        assert_eq!(uuids, ["claimed-0", "claimed-1"]);
        assert_eq!(
            discover(&DiscoverOptions::default()).cpus,
            discover_host().cpus
        );
    }
}
