//! `imgrun status` as text: a table of nodes, the use of each GPU NVML measured (only when
//! some GPU has a measurement), the reservations by owner, the live actors with their job
//! and rank, and the totals.

use std::collections::BTreeMap;
use std::fmt;

use super::{ClusterStatus, GpuStatus};

const HEADER: [&str; 10] = [
    "NODE",
    "ADDRESS",
    "HOST",
    "STATE",
    "UPTIME",
    "HEARTBEAT",
    "CPUS",
    "MEMORY",
    "GPUS",
    "IN USE",
];

impl fmt::Display for ClusterStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ended = self.nodes.len() - self.totals.nodes;
        write!(
            f,
            "cluster: {} live node{}",
            self.totals.nodes,
            plural(self.totals.nodes)
        )?;
        if ended > 0 {
            write!(f, ", {ended} dead or left")?;
        }
        writeln!(f)?;
        writeln!(f)?;
        let rows: Vec<[String; 10]> = self
            .nodes
            .iter()
            .map(|node| {
                [
                    node.id.to_string(),
                    node.address.clone(),
                    node.hostname.clone(),
                    node.state.to_string(),
                    duration(node.uptime_ms),
                    format!("{} ago", duration(node.last_heartbeat_ms_ago)),
                    node.cpus.to_string(),
                    node.memory_bytes.map_or_else(|| "?".to_owned(), bytes),
                    gpus(&node.gpus),
                    amounts(&node.used),
                ]
            })
            .collect();
        table(f, &HEADER.map(str::to_owned), &rows)?;
        let measured: Vec<[String; 5]> = self
            .nodes
            .iter()
            .flat_map(|node| {
                node.gpus.iter().filter_map(move |gpu| {
                    let (busy, memory) = gpu.use_words()?;
                    Some([
                        node.id.to_string(),
                        gpu.index.to_string(),
                        gpu.name.clone(),
                        busy,
                        memory,
                    ])
                })
            })
            .collect();
        if !measured.is_empty() {
            writeln!(f, "\ngpus:")?;
            let header = ["NODE", "GPU", "MODEL", "UTIL", "MEMORY"];
            table(f, &header.map(str::to_owned), &measured)?;
        }
        if !self.reservations.is_empty() {
            writeln!(f, "\nreservations:")?;
            for reservation in &self.reservations {
                writeln!(
                    f,
                    "  node {}  {}  {}",
                    reservation.node,
                    reservation.owner,
                    amounts(&reservation.resources)
                )?;
            }
        }
        if !self.actors.is_empty() {
            writeln!(f, "\nactors:")?;
            let rows: Vec<[String; 6]> = self
                .actors
                .iter()
                .map(|actor| {
                    let (job, rank) = actor.label.as_ref().map_or_else(
                        || ("-".to_owned(), "-".to_owned()),
                        |label| (label.job.clone(), label.rank.to_string()),
                    );
                    [
                        actor.id.to_string(),
                        actor.kind.clone(),
                        actor
                            .node
                            .map_or_else(|| "-".to_owned(), |node| node.to_string()),
                        actor.state.clone(),
                        job,
                        rank,
                    ]
                })
                .collect();
            let header = ["ACTOR", "KIND", "NODE", "STATE", "JOB", "RANK"];
            table(f, &header.map(str::to_owned), &rows)?;
        }
        let totals = &self.totals;
        write!(
            f,
            "\ntotals: {} cpus, {} memory, {} gpus; ",
            totals.cpus,
            bytes(totals.memory_bytes),
            totals.gpus
        )?;
        if totals.reservations == 0 {
            writeln!(f, "nothing in use")
        } else {
            writeln!(
                f,
                "in use: {} ({} reservation{})",
                amounts(&totals.used),
                totals.reservations,
                plural(totals.reservations)
            )
        }
    }
}

/// Columns padded to their widest cell, two spaces apart; the last one not padded.
fn table<const N: usize>(
    f: &mut fmt::Formatter<'_>,
    header: &[String; N],
    rows: &[[String; N]],
) -> fmt::Result {
    let mut widths = header.each_ref().map(|cell| cell.chars().count());
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    for row in std::iter::once(header).chain(rows) {
        let mut line = String::new();
        for (i, (cell, width)) in row.iter().zip(widths).enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                line.push_str(&format!("{cell:<width$}  "));
            }
        }
        writeln!(f, "{}", line.trim_end())?;
    }
    Ok(())
}

/// `2x NVIDIA H100 80GB HBM3 (80 GiB)`, models in order of first appearance; `-` for none.
fn gpus(gpus: &[GpuStatus]) -> String {
    let mut models: Vec<(String, usize)> = Vec::new();
    for gpu in gpus {
        let model = match gpu.memory_bytes {
            Some(memory) => format!("{} ({})", gpu.name, bytes(memory)),
            None => gpu.name.clone(),
        };
        match models.iter_mut().find(|(name, _)| *name == model) {
            Some((_, count)) => *count += 1,
            None => models.push((model, 1)),
        }
    }
    if models.is_empty() {
        return "-".to_owned();
    }
    let parts: Vec<String> = models
        .into_iter()
        .map(|(model, count)| format!("{count}x {model}"))
        .collect();
    parts.join(", ")
}

impl GpuStatus {
    /// Its utilisation and memory in use in words (`37%`, `12.1/80.0 GiB`; `-` for what
    /// NVML did not say), as `imgrun status` and the dashboard show them; `None` when it
    /// has no measurement at all.
    pub fn use_words(&self) -> Option<(String, String)> {
        if self.utilization_percent.is_none() && self.memory_used_bytes.is_none() {
            return None;
        }
        let busy = self
            .utilization_percent
            .map_or_else(|| "-".to_owned(), |percent| format!("{percent}%"));
        let memory = self.memory_used_bytes.map_or_else(
            || "-".to_owned(),
            |used| memory_use(used, self.memory_bytes),
        );
        Some((busy, memory))
    }
}

/// Memory in use out of the total, both in the unit of the larger and to a tenth:
/// `12.1/80.0 GiB`, `0.5/80.0 GiB`; `12.1 GiB` when the total is unknown.
fn memory_use(used: u64, total: Option<u64>) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let largest = total.map_or(used, |total| total.max(used));
    let mut unit = 0;
    while unit + 1 < UNITS.len() && largest >> (10 * (unit + 1)) > 0 {
        unit += 1;
    }
    let scaled = |amount: u64| {
        if unit == 0 {
            amount.to_string()
        } else {
            format!("{:.1}", amount as f64 / (1u64 << (10 * unit)) as f64)
        }
    };
    match total {
        Some(total) => format!("{}/{} {}", scaled(used), scaled(total), UNITS[unit]),
        None => format!("{} {}", scaled(used), UNITS[unit]),
    }
}

/// `1 gpu, 2 tpu, 1.5 cpu, 4 GiB memory` (scarcest first), or `-`.
fn amounts(amounts: &BTreeMap<String, u64>) -> String {
    let rank = |name: &str| match name {
        "gpu" => 0,
        "cpu" => 2,
        "memory" => 3,
        _ => 1,
    };
    let mut items: Vec<(&String, &u64)> = amounts.iter().filter(|(_, a)| **a > 0).collect();
    items.sort_by_key(|(name, _)| (rank(name), name.as_str()));
    if items.is_empty() {
        return "-".to_owned();
    }
    let parts: Vec<String> = items
        .into_iter()
        .map(|(name, amount)| match name.as_str() {
            "cpu" => format!("{} cpu", millis(*amount)),
            "memory" => format!("{} memory", bytes(*amount)),
            _ => format!("{amount} {name}"),
        })
        .collect();
    parts.join(", ")
}

/// Thousandths as a decimal: `1.5`, `2`, `0.25`.
fn millis(amount: u64) -> String {
    let (whole, fraction) = (amount / 1000, amount % 1000);
    if fraction == 0 {
        whole.to_string()
    } else {
        let digits = format!("{fraction:03}");
        format!("{whole}.{}", digits.trim_end_matches('0'))
    }
}

/// `64 GiB`, `1.5 TiB`, `512 MiB`, `300 B`.
fn bytes(amount: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if amount < 1024 {
        return format!("{amount} B");
    }
    let mut value = amount as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    let text = format!("{value:.1}");
    format!("{} {}", text.trim_end_matches(".0"), UNITS[unit])
}

/// `850ms`, `3.1s`, `5m12s`, `3h05m`, `2d04h`.
fn duration(ms: u64) -> String {
    let seconds = ms / 1000;
    match seconds {
        0 => format!("{ms}ms"),
        1..60 => format!("{:.1}s", ms as f64 / 1000.0),
        60..3600 => format!("{}m{:02}s", seconds / 60, seconds % 60),
        3600..86_400 => format!("{}h{:02}m", seconds / 3600, seconds / 60 % 60),
        _ => format!("{}d{:02}h", seconds / 86_400, seconds / 3600 % 24),
    }
}

fn plural(count: usize) -> &'static str {
    if count == 1 { "" } else { "s" }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{measured, sample};
    use super::*;

    #[test]
    fn the_table_reads_well() {
        let text = sample().to_string();
        let expected = "\
cluster: 2 live nodes, 1 dead or left

NODE  ADDRESS        HOST    STATE    UPTIME  HEARTBEAT  CPUS  MEMORY  GPUS                               IN USE
1     10.0.0.1:7070  gpu-01  alive    1h02m   120ms ago  16    64 GiB  -                                  -
2     10.0.0.2:7070  gpu-02  suspect  1h02m   120ms ago  16    64 GiB  2x NVIDIA H100 80GB HBM3 (80 GiB)  1 gpu, 2 cpu
3     10.0.0.3:7070  gpu-03  dead     1h02m   120ms ago  16    64 GiB  1x NVIDIA H100 80GB HBM3 (80 GiB)  -

reservations:
  node 2  actor:3  1 gpu, 2 cpu

actors:
ACTOR  KIND     NODE  STATE    JOB    RANK
3      trainer  2     running  run-1  0
4      trainer  2     running  -      -

totals: 32 cpus, 128 GiB memory, 2 gpus; in use: 1 gpu, 2 cpu (1 reservation)
";
        assert_eq!(text, expected);
        let empty = ClusterStatus::new(1, Vec::new(), Vec::new()).to_string();
        assert!(empty.starts_with("cluster: 0 live nodes\n"), "{empty}");
        assert!(empty.ends_with("0 gpus; nothing in use\n"), "{empty}");
    }

    #[test]
    fn measured_gpus_get_a_table_of_their_use() {
        let text = measured().to_string();
        let expected = "\
NODE  ADDRESS        HOST    STATE    UPTIME  HEARTBEAT  CPUS  MEMORY  GPUS                               IN USE
1     10.0.0.1:7070  gpu-01  alive    1h02m   120ms ago  16    64 GiB  -                                  -
2     10.0.0.2:7070  gpu-02  suspect  1h02m   120ms ago  16    64 GiB  2x NVIDIA H100 80GB HBM3 (80 GiB)  1 gpu, 2 cpu
3     10.0.0.3:7070  gpu-03  dead     1h02m   120ms ago  16    64 GiB  1x NVIDIA H100 80GB HBM3 (80 GiB)  -

gpus:
NODE  GPU  MODEL                  UTIL  MEMORY
2     0    NVIDIA H100 80GB HBM3  37%   12.1/80.0 GiB
2     1    NVIDIA H100 80GB HBM3  -     0.5/80.0 GiB

reservations:
";
        assert!(text.contains(expected), "{text}");
        // Without a measurement the text is as it was: no `gpus:` section.
        assert!(!sample().to_string().contains("gpus:"));
    }

    #[test]
    fn quantities_read_well() {
        let cases = [
            (bytes(300), "300 B"),
            (bytes(64 << 30), "64 GiB"),
            (bytes(1536 << 30), "1.5 TiB"),
            (millis(1500), "1.5"),
            (millis(250), "0.25"),
            (millis(3000), "3"),
            (duration(850), "850ms"),
            (duration(3_140), "3.1s"),
            (duration(312_000), "5m12s"),
            (duration(11_100_000), "3h05m"),
            (duration(187_200_000), "2d04h"),
        ];
        for (got, want) in cases {
            assert_eq!(got, want);
        }
        let memory_cases = [
            (memory_use(12_992_000_000, Some(80 << 30)), "12.1/80.0 GiB"),
            (memory_use(512 << 20, Some(80 << 30)), "0.5/80.0 GiB"),
            (memory_use(0, Some(16 << 30)), "0.0/16.0 GiB"),
            (memory_use(12_992_000_000, None), "12.1 GiB"),
            (memory_use(300, Some(1000)), "300/1000 B"),
            (memory_use(2 << 40, Some(1 << 40)), "2.0/1.0 TiB"),
            (memory_use(u64::MAX, None), "16384.0 PiB"),
        ];
        for (got, want) in memory_cases {
            assert_eq!(got, want);
        }
        let used = [("memory".to_owned(), 4 << 30), ("tpu".to_owned(), 2)].into();
        assert_eq!(amounts(&used), "2 tpu, 4 GiB memory");
        assert_eq!(amounts(&BTreeMap::new()), "-");
    }
}
