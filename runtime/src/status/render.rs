//! `imgrun status` as text: a table of nodes, the reservations by owner, the live actors
//! with their job and rank, and the totals.

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
    use super::super::tests::sample;
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
        let used = [("memory".to_owned(), 4 << 30), ("tpu".to_owned(), 2)].into();
        assert_eq!(amounts(&used), "2 tpu, 4 GiB memory");
        assert_eq!(amounts(&BTreeMap::new()), "-");
    }
}
