//! GPUs of this machine: found through NVML loaded at run time (or `nvidia-smi`), filtered
//! by `CUDA_VISIBLE_DEVICES` as CUDA filters them, and overridden by `--num-gpus`.
//!
//! Discovery never fails: a machine without NVIDIA drivers simply has no GPUs, and the
//! reason is logged at debug level. The rules (`CUDA_VISIBLE_DEVICES`, `nvidia-smi`
//! output, claimed GPUs) are pure functions; only `discover_gpus` touches the machine.
//! `sampler.rs` measures what the GPUs NVML found are doing (utilisation, memory in use),
//! for the heartbeats and the head's status.

mod sampler;

use std::fmt;
use std::io::Read;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;
use tracing::{debug, info};

pub(crate) use sampler::{GpuSample, GpuSampler, GpuUse};

/// One GPU this node offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// The physical index (NVML's, PCI bus order), whatever `CUDA_VISIBLE_DEVICES` says:
    /// a worker selects this GPU with `CUDA_VISIBLE_DEVICES=<uuid>` or, under
    /// `CUDA_DEVICE_ORDER=PCI_BUS_ID`, with `CUDA_VISIBLE_DEVICES=<index>`. For a claimed
    /// GPU, its position among this node's GPUs.
    pub index: u32,
    /// The model, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// Total memory; `None` when the driver does not say (`[N/A]`) or the GPU is claimed.
    pub memory_bytes: Option<u64>,
    /// `GPU-xxxxxxxx-...` for a real GPU, `claimed-<i>` for a claimed one.
    pub uuid: String,
    pub source: GpuSource,
}

impl GpuInfo {
    /// Whether this GPU exists on the machine (rather than being claimed by `--num-gpus`).
    pub fn discovered(&self) -> bool {
        self.source != GpuSource::Claimed
    }
}

/// Where a GPU's description comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuSource {
    /// The NVIDIA management library, loaded at run time.
    Nvml,
    /// `nvidia-smi --query-gpu`, when NVML could not be loaded.
    NvidiaSmi,
    /// Not discovered: claimed by `--num-gpus` beyond what the machine has (tests, or
    /// devices the driver does not report).
    Claimed,
}

impl fmt::Display for GpuSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GpuSource::Nvml => "nvml",
            GpuSource::NvidiaSmi => "nvidia-smi",
            GpuSource::Claimed => "claimed",
        })
    }
}

/// Which `CUDA_VISIBLE_DEVICES` discovery honours.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum VisibleDevices {
    /// The value in this process's environment (the default).
    #[default]
    Inherit,
    /// As if the variable were unset: every GPU.
    Unset,
    /// As if the variable had this value.
    Set(String),
}

impl VisibleDevices {
    fn value(&self) -> Option<String> {
        match self {
            VisibleDevices::Inherit => std::env::var_os("CUDA_VISIBLE_DEVICES")
                .map(|value| value.to_string_lossy().into_owned()),
            VisibleDevices::Unset => None,
            VisibleDevices::Set(value) => Some(value.clone()),
        }
    }
}

/// The most GPUs `--num-gpus` may claim; a larger number is taken as this one.
pub const MAX_CLAIMED_GPUS: usize = 1024;

/// How the UUID of a claimed GPU starts (`claimed-<i>`); a real GPU's starts with `GPU-`.
const CLAIMED_UUID_PREFIX: &str = "claimed-";

/// Whether `uuid` is a claimed GPU's ([`GpuSource::Claimed`]): the one thing that tells
/// one apart in a node's description on the wire, where its index is only its position.
pub(crate) fn is_claimed_uuid(uuid: &str) -> bool {
    uuid.starts_with(CLAIMED_UUID_PREFIX)
}

/// The GPUs this node offers: those NVML (or else `nvidia-smi`) reports, kept and ordered
/// by `visible` as CUDA would, then overridden by `num_gpus` (`--num-gpus`: `None`
/// discovers; `Some(n)` offers exactly `n`, see [`select_gpus`]).
pub(crate) fn discover_gpus(visible: &VisibleDevices, num_gpus: Option<usize>) -> Vec<GpuInfo> {
    let physical = if num_gpus == Some(0) {
        Vec::new()
    } else {
        physical_gpus()
    };
    select_gpus(physical, visible.value().as_deref(), num_gpus)
}

/// The pure part of [`discover_gpus`]: applies a `CUDA_VISIBLE_DEVICES` value (`None`:
/// unset) to the physical GPUs, then `num_gpus`: `Some(n)` keeps the first `n` and, when
/// fewer remain, adds claimed GPUs (up to [`MAX_CLAIMED_GPUS`]) to make `n`.
pub(crate) fn select_gpus(
    physical: Vec<GpuInfo>,
    visible: Option<&str>,
    num_gpus: Option<usize>,
) -> Vec<GpuInfo> {
    let mut gpus = match visible {
        None => physical,
        Some(value) => apply_visible_devices(value, physical),
    };
    if let Some(wanted) = num_gpus {
        let wanted = wanted.min(MAX_CLAIMED_GPUS);
        gpus.truncate(wanted);
        for position in gpus.len()..wanted {
            gpus.push(GpuInfo {
                // `wanted` is at most MAX_CLAIMED_GPUS, so this never saturates.
                index: u32::try_from(position).unwrap_or(u32::MAX),
                name: "claimed GPU".to_string(),
                memory_bytes: None,
                uuid: format!("{CLAIMED_UUID_PREFIX}{position}"),
                source: GpuSource::Claimed,
            });
        }
    }
    gpus
}

/// Why physical discovery found nothing through one route; logged, never returned.
#[derive(Debug, thiserror::Error)]
enum ProbeError {
    #[error("nvml: {0}")]
    Nvml(#[from] NvmlError),
    #[error("cannot run nvidia-smi: {0}")]
    Spawn(std::io::Error),
    #[error("nvidia-smi did not answer within {0:?}")]
    Timeout(Duration),
    #[error("nvidia-smi exited with {status}: {message}")]
    Failed { status: ExitStatus, message: String },
}

/// How long `nvidia-smi` may take (it can hang on a wedged driver).
const NVIDIA_SMI_TIMEOUT: Duration = Duration::from_secs(15);

/// Every GPU on the machine, in physical order; empty when neither route works.
fn physical_gpus() -> Vec<GpuInfo> {
    let nvml_error = match nvml_gpus() {
        Ok(gpus) => return gpus,
        Err(error) => error,
    };
    debug!(error = %nvml_error, "NVML unavailable, asking nvidia-smi");
    let mut command = Command::new("nvidia-smi");
    command.args([
        "--query-gpu=index,name,memory.total,uuid",
        "--format=csv,noheader,nounits",
    ]);
    match run_with_timeout(command, NVIDIA_SMI_TIMEOUT) {
        Ok(stdout) => {
            let (gpus, skipped) = parse_nvidia_smi(&stdout);
            if skipped > 0 {
                info!(
                    skipped,
                    "ignored nvidia-smi lines that do not describe a GPU"
                );
            }
            gpus
        }
        Err(error) => {
            debug!(%error, "nvidia-smi unavailable, no GPUs");
            Vec::new()
        }
    }
}

/// GPUs through NVML. A GPU whose handle or UUID cannot be read is left out (it cannot be
/// addressed); an unreadable name or memory size is reported as unknown.
fn nvml_gpus() -> Result<Vec<GpuInfo>, ProbeError> {
    let nvml = Nvml::init()?;
    let count = nvml.device_count()?;
    let mut gpus = Vec::new();
    for index in 0..count {
        let device = match nvml.device_by_index(index) {
            Ok(device) => device,
            Err(error) => {
                info!(index, %error, "NVML cannot open this GPU, leaving it out");
                continue;
            }
        };
        let uuid = match device.uuid() {
            Ok(uuid) => uuid,
            Err(error) => {
                info!(index, %error, "NVML cannot read this GPU's UUID, leaving it out");
                continue;
            }
        };
        let name = device.name().unwrap_or_else(|error| {
            debug!(index, %error, "NVML cannot read this GPU's name");
            "unknown GPU".to_string()
        });
        let memory_bytes = match device.memory_info() {
            Ok(memory) => Some(memory.total),
            Err(error) => {
                debug!(index, %error, "NVML cannot read this GPU's memory");
                None
            }
        };
        gpus.push(GpuInfo {
            index,
            name,
            memory_bytes,
            uuid,
            source: GpuSource::Nvml,
        });
    }
    Ok(gpus)
}

/// Runs `command` and returns its standard output, killing it after `timeout`.
fn run_with_timeout(mut command: Command, timeout: Duration) -> Result<String, ProbeError> {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(ProbeError::Spawn)?;
    let (Some(stdout), Some(stderr)) = (child.stdout.take(), child.stderr.take()) else {
        // Both were set to `Stdio::piped()` above.
        return Err(ProbeError::Spawn(std::io::Error::other("no pipes")));
    };
    let stdout = read_in_thread(stdout);
    let stderr = read_in_thread(stderr);
    // The readers finish when the child closes its ends, normally by exiting.
    let Ok(output) = stdout.recv_timeout(timeout) else {
        // Killing an exited child is harmless; waiting reaps it either way.
        let _ = child.kill();
        let _ = child.wait();
        return Err(ProbeError::Timeout(timeout));
    };
    let status = child.wait().map_err(ProbeError::Spawn)?;
    if status.success() {
        return Ok(output);
    }
    let errors = stderr.recv_timeout(timeout).unwrap_or_default();
    let message = [errors.as_str(), output.as_str()]
        .iter()
        .flat_map(|text| text.lines())
        .map(str::trim)
        .find(|line| !line.is_empty())
        .unwrap_or("no message")
        .to_string();
    Err(ProbeError::Failed { status, message })
}

/// Reads a pipe to its end on a thread of its own (lossily, as text).
fn read_in_thread(mut pipe: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (sender, receiver) = mpsc::channel();
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        let _ = sender.send(String::from_utf8_lossy(&bytes).into_owned());
    });
    receiver
}

/// GPUs from the output of `nvidia-smi
/// --query-gpu=index,name,memory.total,uuid --format=csv,noheader[,nounits]`, with the
/// number of non-blank lines that describe no GPU (headers, driver errors, garbage).
fn parse_nvidia_smi(output: &str) -> (Vec<GpuInfo>, usize) {
    let mut gpus = Vec::new();
    let mut skipped = 0;
    for line in output.lines().map(str::trim).filter(|l| !l.is_empty()) {
        match parse_nvidia_smi_line(line) {
            Some(gpu) => gpus.push(gpu),
            None => skipped += 1,
        }
    }
    (gpus, skipped)
}

/// One `index, name, memory, uuid` line. The name may hold commas, so the index is split
/// off the front and the memory and UUID off the back.
fn parse_nvidia_smi_line(line: &str) -> Option<GpuInfo> {
    let (index, rest) = line.split_once(',')?;
    let (rest, uuid) = rest.rsplit_once(',')?;
    let (name, memory) = rest.rsplit_once(',')?;
    let index: u32 = index.trim().parse().ok()?;
    let name = name.trim();
    let uuid = uuid.trim();
    if name.is_empty() || uuid.is_empty() || uuid.contains(char::is_whitespace) {
        return None;
    }
    Some(GpuInfo {
        index,
        name: name.to_string(),
        memory_bytes: parse_mib(memory)?,
        uuid: uuid.to_string(),
        source: GpuSource::NvidiaSmi,
    })
}

/// A memory size in MiB, with or without the unit: `Some(None)` for `[N/A]` and the like,
/// `None` for anything else that is not a number of bytes.
fn parse_mib(text: &str) -> Option<Option<u64>> {
    let text = text.trim();
    if text.starts_with('[') && text.ends_with(']') {
        return Some(None);
    }
    let number = text.strip_suffix("MiB").unwrap_or(text).trim();
    let mib: u64 = number.parse().ok()?;
    Some(Some(mib.checked_mul(1024 * 1024)?))
}

/// One entry of `CUDA_VISIBLE_DEVICES`.
#[derive(Debug, Clone, PartialEq, Eq)]
enum VisibleEntry {
    Index(u32),
    /// A whole UUID or a prefix of one, `GPU-` included.
    Uuid(String),
}

/// Keeps and orders `physical` as CUDA does for a `CUDA_VISIBLE_DEVICES` value (the rules
/// PyTorch reproduces in `torch.cuda._parse_visible_devices`): entries up to the first that
/// does not name exactly one GPU; no GPU at all when one is named twice.
fn apply_visible_devices(value: &str, physical: Vec<GpuInfo>) -> Vec<GpuInfo> {
    if value.trim_start().starts_with("MIG-") {
        info!(
            value,
            "MIG instances in CUDA_VISIBLE_DEVICES are not supported, no GPUs (use --num-gpus)"
        );
        return Vec::new();
    }
    let mut chosen: Vec<usize> = Vec::new();
    for entry in parse_visible_devices(value) {
        let mut matches = physical
            .iter()
            .enumerate()
            .filter(|(_, gpu)| match &entry {
                VisibleEntry::Index(index) => gpu.index == *index,
                VisibleEntry::Uuid(prefix) => gpu.uuid.starts_with(prefix.as_str()),
            })
            .map(|(position, _)| position);
        let (Some(position), None) = (matches.next(), matches.next()) else {
            debug!(
                value,
                ?entry,
                "CUDA_VISIBLE_DEVICES entry names no one GPU, stopping"
            );
            break;
        };
        if chosen.contains(&position) {
            debug!(value, "CUDA_VISIBLE_DEVICES names a GPU twice, no GPUs");
            return Vec::new();
        }
        chosen.push(position);
    }
    let mut physical: Vec<Option<GpuInfo>> = physical.into_iter().map(Some).collect();
    chosen
        .into_iter()
        .filter_map(|position| physical[position].take())
        .collect()
}

/// The entries of a `CUDA_VISIBLE_DEVICES` value, up to the first invalid one. The first
/// entry decides the kind: UUIDs (`GPU-...`) or indices, read as C's `strtoul` reads
/// them (`1gpu2` is 1; a sign, a missing number or an overflow is invalid). A repeated
/// entry means no GPUs, so it gives an empty list.
fn parse_visible_devices(value: &str) -> Vec<VisibleEntry> {
    let by_uuid = value.trim_start().starts_with("GPU-");
    let mut entries = Vec::new();
    for token in value.split(',').map(str::trim) {
        let entry = if by_uuid {
            match token.strip_prefix("GPU-") {
                Some(rest) if !rest.is_empty() => VisibleEntry::Uuid(token.to_string()),
                _ => break,
            }
        } else {
            match leading_index(token) {
                Some(index) => VisibleEntry::Index(index),
                None => break,
            }
        };
        if entries.contains(&entry) {
            return Vec::new();
        }
        entries.push(entry);
    }
    entries
}

/// The unsigned number a token starts with (an optional `+`, then digits).
fn leading_index(token: &str) -> Option<u32> {
    let digits = token.strip_prefix('+').unwrap_or(token);
    let end = digits
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(digits.len());
    digits[..end].parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: u32, uuid: &str) -> GpuInfo {
        GpuInfo {
            index,
            name: "NVIDIA H100 80GB HBM3".to_string(),
            memory_bytes: Some(81_559 * 1024 * 1024),
            uuid: uuid.to_string(),
            source: GpuSource::Nvml,
        }
    }

    /// Four GPUs; the UUIDs of 1 and 2 share the prefix `GPU-12`.
    fn machine() -> Vec<GpuInfo> {
        vec![
            gpu(0, "GPU-0aaa1111-2222-3333-4444-555566667777"),
            gpu(1, "GPU-12bb1111-2222-3333-4444-555566667777"),
            gpu(2, "GPU-12cc1111-2222-3333-4444-555566667777"),
            gpu(3, "GPU-3ddd1111-2222-3333-4444-555566667777"),
        ]
    }

    #[test]
    fn visible_devices_are_parsed_as_cuda_does() {
        use VisibleEntry::{Index, Uuid};
        let uuid = |s: &str| Uuid(s.to_string());
        let cases: Vec<(&str, Vec<VisibleEntry>)> = vec![
            ("0", vec![Index(0)]),
            ("2,0", vec![Index(2), Index(0)]),
            (" 1 , 3 ", vec![Index(1), Index(3)]),
            ("+1", vec![Index(1)]),
            ("1gpu2,2ampere", vec![Index(1), Index(2)]),
            ("", vec![]),
            ("-1", vec![]),
            ("none", vec![]),
            ("NoDevFiles", vec![]),
            ("0,-1,1", vec![Index(0)]),
            ("0,,1", vec![Index(0)]),
            ("0,1,", vec![Index(0), Index(1)]),
            ("0,1,0", vec![]),
            ("99999999999", vec![]),
            ("0,GPU-12bb", vec![Index(0)]),
            ("GPU-12bb", vec![uuid("GPU-12bb")]),
            ("GPU-3d,GPU-0a", vec![uuid("GPU-3d"), uuid("GPU-0a")]),
            ("GPU-3d,1", vec![uuid("GPU-3d")]),
            ("GPU-3d,GPU-", vec![uuid("GPU-3d")]),
            ("GPU-3d,GPU-3d", vec![]),
            ("gpu-3d", vec![]),
        ];
        for (value, want) in cases {
            assert_eq!(parse_visible_devices(value), want, "{value:?}");
        }
    }

    #[test]
    fn visible_devices_select_gpus() {
        let cases: Vec<(&str, Vec<u32>)> = vec![
            ("0", vec![0]),
            ("3,1", vec![3, 1]),
            ("1,5,2", vec![1]),
            ("5", vec![]),
            ("", vec![]),
            ("-1", vec![]),
            ("GPU-3ddd1111-2222-3333-4444-555566667777", vec![3]),
            ("GPU-3d,GPU-0", vec![3, 0]),
            ("GPU-12bb,GPU-12cc", vec![1, 2]),
            ("GPU-0,GPU-12,GPU-3", vec![0]),
            ("GPU-12", vec![]),
            ("GPU-ffff", vec![]),
            ("GPU-3d,GPU-3ddd", vec![]),
            ("MIG-GPU-0aaa1111/1/0", vec![]),
        ];
        for (value, want) in cases {
            let got: Vec<u32> = apply_visible_devices(value, machine())
                .iter()
                .map(|g| g.index)
                .collect();
            assert_eq!(got, want, "{value:?}");
        }
    }

    #[test]
    fn num_gpus_overrides_discovery() {
        // (CUDA_VISIBLE_DEVICES, --num-gpus, wanted (index, source) pairs)
        use GpuSource::{Claimed, Nvml};
        type Case = (Option<&'static str>, Option<usize>, Vec<(u32, GpuSource)>);
        let cases: Vec<Case> = vec![
            (None, None, vec![(0, Nvml), (1, Nvml), (2, Nvml), (3, Nvml)]),
            (None, Some(0), vec![]),
            (None, Some(2), vec![(0, Nvml), (1, Nvml)]),
            (Some("3,2"), Some(1), vec![(3, Nvml)]),
            (
                Some("3"),
                Some(3),
                vec![(3, Nvml), (1, Claimed), (2, Claimed)],
            ),
            (Some(""), Some(2), vec![(0, Claimed), (1, Claimed)]),
        ];
        for (visible, num_gpus, want) in cases {
            let got: Vec<(u32, GpuSource)> = select_gpus(machine(), visible, num_gpus)
                .iter()
                .map(|g| (g.index, g.source))
                .collect();
            assert_eq!(got, want, "{visible:?} {num_gpus:?}");
        }
    }

    #[test]
    fn claimed_gpus_are_marked() {
        let gpus = select_gpus(Vec::new(), None, Some(2));
        assert_eq!(gpus.len(), 2);
        assert!(gpus.iter().all(|g| !g.discovered()));
        assert_eq!(gpus[1].uuid, "claimed-1");
        assert!(gpus.iter().all(|g| is_claimed_uuid(&g.uuid)));
        assert!(!machine().iter().any(|g| is_claimed_uuid(&g.uuid)));
        assert_eq!(gpus[1].memory_bytes, None);
        assert_eq!(
            select_gpus(Vec::new(), None, Some(usize::MAX)).len(),
            MAX_CLAIMED_GPUS
        );
    }

    #[test]
    fn nvidia_smi_output_is_parsed() {
        const MIB: u64 = 1024 * 1024;
        // NVML reports 85_520_809_984 bytes for this GPU, so MiB are 2^20 bytes.
        const H100_UUID: &str = "GPU-34a0491e-4652-9607-a7b5-75b97c8e21ff";
        // (output, wanted (index, name, memory, uuid), skipped lines)
        type Want = Vec<(u32, &'static str, Option<u64>, &'static str)>;
        let cases: Vec<(&str, Want, usize)> = vec![
            // Captured on an H100 machine, with `nounits` and without.
            (
                "0, NVIDIA H100 80GB HBM3, 81559, GPU-34a0491e-4652-9607-a7b5-75b97c8e21ff\n",
                vec![(0, "NVIDIA H100 80GB HBM3", Some(85_520_809_984), H100_UUID)],
                0,
            ),
            (
                "0, NVIDIA H100 80GB HBM3, 81559 MiB, GPU-34a0491e-4652-9607-a7b5-75b97c8e21ff\n",
                vec![(0, "NVIDIA H100 80GB HBM3", Some(85_520_809_984), H100_UUID)],
                0,
            ),
            (
                "0, Tesla T4, 15360, GPU-a\n1, Tesla T4, 15360, GPU-b\n",
                vec![
                    (0, "Tesla T4", Some(15_360 * MIB), "GPU-a"),
                    (1, "Tesla T4", Some(15_360 * MIB), "GPU-b"),
                ],
                0,
            ),
            // Units left in, extra whitespace, CRLF, blank lines.
            (
                "\n  3 ,  NVIDIA A100-SXM4-40GB ,  40960 MiB , GPU-x  \r\n\n",
                vec![(3, "NVIDIA A100-SXM4-40GB", Some(40_960 * MIB), "GPU-x")],
                0,
            ),
            (
                "0, NVIDIA GH200 480GB, [N/A], GPU-gh\n",
                vec![(0, "NVIDIA GH200 480GB", None, "GPU-gh")],
                0,
            ),
            (
                "1, Odd, Name, With Commas, 1024, GPU-c\n",
                vec![(1, "Odd, Name, With Commas", Some(1024 * MIB), "GPU-c")],
                0,
            ),
            (
                "index, name, memory.total [MiB], uuid\n0, T4, 15360, GPU-a\n",
                vec![(0, "T4", Some(15_360 * MIB), "GPU-a")],
                1,
            ),
            (
                "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA \
                 driver. Make sure that the latest NVIDIA driver is installed and running.\n",
                vec![],
                1,
            ),
            ("No devices were found\n", vec![], 1),
            ("", vec![], 0),
            (
                "0, T4, lots, GPU-a\n-1, T4, 1, GPU-a\n0, , 1, GPU-a\n0, T4, 1, \n\
                 0, T4, 1, GPU a\n0,T4\n\u{0}\u{fffd},,,\n0, T4, 99999999999999999, GPU-a\n",
                vec![],
                8,
            ),
        ];
        for (output, want, want_skipped) in cases {
            let (gpus, skipped) = parse_nvidia_smi(output);
            let got: Vec<(u32, &str, Option<u64>, &str)> = gpus
                .iter()
                .map(|g| (g.index, g.name.as_str(), g.memory_bytes, g.uuid.as_str()))
                .collect();
            assert_eq!(got, want, "{output:?}");
            assert_eq!(skipped, want_skipped, "{output:?}");
            assert!(gpus.iter().all(|g| g.source == GpuSource::NvidiaSmi));
        }
    }

    #[test]
    fn commands_run_with_a_time_limit() {
        let shell = |script: &str| {
            let mut command = Command::new("sh");
            command.args(["-c", script]);
            command
        };
        let long = Duration::from_secs(30);
        assert_eq!(
            run_with_timeout(shell("printf '0, T4, 1, GPU-a\\n'"), long).ok(),
            Some("0, T4, 1, GPU-a\n".to_string())
        );
        match run_with_timeout(shell("echo broken >&2; exit 9"), long) {
            Err(ProbeError::Failed { status, message }) => {
                assert_eq!(status.code(), Some(9));
                assert_eq!(message, "broken");
            }
            other => panic!("want a failure, got {other:?}"),
        }
        assert!(matches!(
            run_with_timeout(Command::new("/nonexistent/nvidia-smi"), long),
            Err(ProbeError::Spawn(_))
        ));
        assert!(matches!(
            run_with_timeout(shell("exec sleep 30"), Duration::from_millis(50)),
            Err(ProbeError::Timeout(_))
        ));
    }

    #[test]
    fn discovery_never_fails() {
        // Whatever this machine has: an empty CUDA_VISIBLE_DEVICES hides every GPU.
        let gpus = discover_gpus(&VisibleDevices::Set(String::new()), Some(2));
        assert_eq!(gpus.len(), 2);
        assert!(gpus.iter().all(|g| g.source == GpuSource::Claimed));
        assert!(discover_gpus(&VisibleDevices::Inherit, Some(0)).is_empty());
        let all = discover_gpus(&VisibleDevices::Unset, None);
        assert!(all.iter().all(GpuInfo::discovered));
    }
}
