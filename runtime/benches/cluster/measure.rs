//! What the sections share: latency percentiles, the CPU time of a process, the machine
//! line and the date for the header, and the throughput rows.

use std::future::Future;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};

/// The Linux kernel reports process times in these ticks per second (`USER_HZ`, fixed at
/// 100 on every architecture the kernel exports to user space in /proc).
const USER_HZ: f64 = 100.0;

/// Latencies of one run, sorted.
#[derive(Debug, Clone)]
pub struct Latencies {
    sorted: Vec<Duration>,
}

impl Latencies {
    pub fn new(mut samples: Vec<Duration>) -> Self {
        samples.sort_unstable();
        Latencies { sorted: samples }
    }

    pub fn len(&self) -> usize {
        self.sorted.len()
    }

    /// The nearest-rank percentile `p` (0 to 100); zero when there are no samples.
    pub fn percentile(&self, p: f64) -> Duration {
        if self.sorted.is_empty() {
            return Duration::ZERO;
        }
        let rank = ((p / 100.0) * self.sorted.len() as f64).ceil() as usize;
        self.sorted[rank.clamp(1, self.sorted.len()) - 1]
    }

    pub fn min(&self) -> Duration {
        self.sorted.first().copied().unwrap_or_default()
    }

    pub fn max(&self) -> Duration {
        self.sorted.last().copied().unwrap_or_default()
    }

    pub fn median(&self) -> Duration {
        self.percentile(50.0)
    }
}

/// Messages of one timed run and how long it took.
#[derive(Debug, Clone)]
pub struct Run {
    pub messages: u64,
    pub elapsed: Duration,
    /// Per message, when they were timed (calls, requests); none for tells.
    pub latencies: Option<Latencies>,
    /// CPU time the processes involved spent meanwhile, when it could be read.
    pub cpu: Option<Duration>,
}

impl Run {
    pub fn per_second(&self) -> f64 {
        self.messages as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Calls from `callers` tasks for `run_time`, each waiting for its answer before the
/// next, every call timed. `call(caller, n)` makes the `n`th call of task `caller`.
pub async fn timed_calls<F, Fut>(callers: usize, run_time: Duration, call: F) -> Result<Run>
where
    F: Fn(usize, u64) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<()>> + Send,
{
    let start = Instant::now();
    let deadline = start + run_time;
    let mut running = tokio::task::JoinSet::new();
    for caller in 0..callers {
        let call = call.clone();
        running.spawn(async move {
            let mut latencies = Vec::with_capacity(1 << 16);
            let mut n = 0;
            while Instant::now() < deadline {
                n += 1;
                let sent = Instant::now();
                call(caller, n).await?;
                latencies.push(sent.elapsed());
            }
            Ok::<_, anyhow::Error>(latencies)
        });
    }
    let mut latencies = Vec::new();
    while let Some(done) = running.join_next().await {
        latencies.extend(done.context("a caller task panicked")??);
    }
    Ok(Run {
        messages: latencies.len() as u64,
        elapsed: start.elapsed(),
        latencies: Some(Latencies::new(latencies)),
        cpu: None,
    })
}

/// The CPU time of a few processes since it started.
#[derive(Debug)]
pub struct CpuMeter {
    pids: Vec<u32>,
    start: Option<Duration>,
}

impl CpuMeter {
    pub fn start(pids: &[u32]) -> Self {
        CpuMeter {
            pids: pids.to_vec(),
            start: total_cpu_time(pids),
        }
    }

    /// CPU time since [`CpuMeter::start`], if every process could be read both times.
    pub fn elapsed(&self) -> Option<Duration> {
        Some(total_cpu_time(&self.pids)?.saturating_sub(self.start?))
    }
}

fn total_cpu_time(pids: &[u32]) -> Option<Duration> {
    pids.iter().map(|pid| cpu_time(*pid)).sum()
}

/// The header of a throughput table.
pub fn run_header(first: &str) {
    println!(
        "{first:<15} {:<22} {:>9} {:>11} {:>8} {:>8} {:>8} {:>6} {:>10}",
        "pattern", "messages", "per second", "p50 µs", "p99 µs", "max µs", "CPU", "CPU µs/msg"
    );
}

/// One row of a throughput table.
pub fn run_row(first: &str, pattern: &str, run: &Run) {
    let (p50, p99, max) = match &run.latencies {
        Some(latencies) => (
            format!("{:.1}", micros(latencies.percentile(50.0))),
            format!("{:.1}", micros(latencies.percentile(99.0))),
            format!("{:.0}", micros(latencies.max())),
        ),
        None => ("-".into(), "-".into(), "-".into()),
    };
    let (cpu, per_message) = match run.cpu {
        Some(cpu) => (
            format!(
                "{:.0}%",
                cpu.as_secs_f64() / run.elapsed.as_secs_f64() * 100.0
            ),
            format!("{:.1}", micros(cpu) / run.messages.max(1) as f64),
        ),
        None => ("-".into(), "-".into()),
    };
    println!(
        "{first:<15} {pattern:<22} {:>9} {:>11.0} {p50:>8} {p99:>8} {max:>8} {cpu:>6} {per_message:>10}",
        run.messages,
        run.per_second()
    );
}

pub fn micros(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e6
}

pub fn millis(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}

/// User plus system CPU time of process `pid` so far (threads that ended included).
pub fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces; fields count after it.
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state is field 3 of the whole line, utime 14 and stime 15.
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some(Duration::from_secs_f64((utime + stime) / USER_HZ))
}

/// `N cores (model), load average A B C`: timings mean little without it.
pub fn machine_line() -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|line| line.starts_with("model name"))
                .and_then(|line| line.split_once(':'))
                .map(|(_, model)| model.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown cpu".into());
    format!("{cores} cores ({model}), load average {}", load_average())
}

/// The 1, 5 and 15 minute load averages, as `/proc/loadavg` gives them.
pub fn load_average() -> String {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load: Vec<&str> = load.split_whitespace().take(3).collect();
    if load.is_empty() {
        "unknown".into()
    } else {
        load.join(" ")
    }
}

/// The time now, `YYYY-MM-DD HH:MM:SS UTC`.
pub fn utc_now() -> String {
    let seconds = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs());
    let (days, of_day) = (seconds / 86_400, seconds % 86_400);
    let (year, month, day) = civil_from_days(days as i64);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        of_day / 3600,
        of_day % 3600 / 60,
        of_day % 60
    )
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (H. Hinnant's
/// `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Datagrams the kernel dropped, machine-wide, for want of room in a socket's receive
/// buffer (`Udp: RcvbufErrors` in /proc/net/snmp). On loopback, a drop costs QUIC a
/// retransmission after its loss timer.
pub fn udp_receive_drops() -> Option<u64> {
    let snmp = std::fs::read_to_string("/proc/net/snmp").ok()?;
    let mut udp = snmp.lines().filter(|line| line.starts_with("Udp:"));
    let (names, values) = (udp.next()?, udp.next()?);
    let column = names
        .split_whitespace()
        .position(|name| name == "RcvbufErrors")?;
    values.split_whitespace().nth(column)?.parse().ok()
}
