//! What this machine offers: logical CPUs and memory.

/// Resources of the local machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostResources {
    pub cpus: usize,
    pub memory_bytes: Option<u64>,
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
        Some("kB") | None => Some(value * 1024),
        Some(_) => None,
    }
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
        ];
        for (text, want) in cases {
            assert_eq!(parse_mem_total(text), want, "{text:?}");
        }
    }

    #[test]
    fn host_has_at_least_one_cpu() {
        assert!(discover_host().cpus >= 1);
    }
}
