//! What `bench dashboard` reads of its own process (CPU time, one thread's CPU time,
//! resident memory, all from Linux's `/proc`) and the quantiles it prints.

use std::time::{Duration, Instant};

/// This process's CPU seconds so far (every thread, user and system).
pub(super) fn process_cpu_s() -> Option<f64> {
    pipelines::process_cpu_seconds()
}

/// The calling thread's CPU seconds so far: the first field of
/// `/proc/thread-self/schedstat`, in nanoseconds.
pub(super) fn thread_cpu_s() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let nanos: u64 = text.split_whitespace().next()?.parse().ok()?;
    Some(nanos as f64 * 1e-9)
}

/// This process's resident memory in bytes (`VmRSS` of `/proc/self/status`).
pub(super) fn rss_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = text.lines().find(|line| line.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The process's CPU time and memory at one moment.
#[derive(Debug, Clone, Copy)]
pub(super) struct Reading {
    at: Instant,
    cpu_s: Option<f64>,
    rss: Option<u64>,
}

impl Reading {
    pub(super) fn now() -> Self {
        Reading {
            at: Instant::now(),
            cpu_s: process_cpu_s(),
            rss: rss_bytes(),
        }
    }

    /// Resident memory then, in bytes.
    pub(super) fn rss(&self) -> Option<u64> {
        self.rss
    }
}

/// What the process spent between two readings, less the CPU time of the benchmark's own
/// clients (`clients_cpu_s`, measured on their thread).
#[derive(Debug, Clone, Copy)]
pub(super) struct Span {
    /// The process's CPU seconds per wall second, the clients' left out.
    pub cores: Option<f64>,
    /// The clients' own CPU seconds per wall second (left out of `cores`).
    pub client_cores: f64,
    /// Resident memory at the start and the end.
    pub rss_start: Option<u64>,
    pub rss_end: Option<u64>,
}

impl Span {
    pub(super) fn between(start: Reading, end: Reading, clients_cpu_s: f64) -> Self {
        let wall_s = end.at.duration_since(start.at).as_secs_f64().max(1e-9);
        let cores = start
            .cpu_s
            .zip(end.cpu_s)
            .map(|(a, b)| (b - a - clients_cpu_s).max(0.0) / wall_s);
        Span {
            cores,
            client_cores: clients_cpu_s / wall_s,
            rss_start: start.rss,
            rss_end: end.rss,
        }
    }

    /// The growth of resident memory over the span, in bytes (negative when it shrank).
    pub(super) fn rss_growth(&self) -> Option<i64> {
        self.rss_start
            .zip(self.rss_end)
            .map(|(a, b)| b as i64 - a as i64)
    }
}

/// The median, 95th percentile and largest of some durations.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Quantiles {
    pub count: usize,
    pub p50: Duration,
    pub p95: Duration,
    pub max: Duration,
}

impl Quantiles {
    /// `None` for no samples. The nearest-rank quantiles: p95 of 20 samples is the 19th.
    pub(super) fn of(samples: &[Duration]) -> Option<Self> {
        let mut sorted = samples.to_vec();
        sorted.sort();
        let rank = |q: f64| {
            let index = (q * sorted.len() as f64).ceil() as usize;
            sorted[index.clamp(1, sorted.len()) - 1]
        };
        let max = *sorted.last()?;
        Some(Quantiles {
            count: sorted.len(),
            p50: rank(0.50),
            p95: rank(0.95),
            max,
        })
    }
}

/// Milliseconds, for printing.
pub(super) fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_the_nearest_rank() {
        let ms = |n: u64| Duration::from_millis(n);
        for (samples, expected) in [
            (vec![], None),
            (vec![7], Some((7, 7, 7))),
            ((1..=20).collect::<Vec<u64>>(), Some((10, 19, 20))),
            (vec![5, 1, 3, 2, 4], Some((3, 5, 5))),
        ] {
            let samples: Vec<Duration> = samples.into_iter().map(ms).collect();
            let got = Quantiles::of(&samples).map(|q| (q.p50, q.p95, q.max));
            let want = expected.map(|(a, b, c)| (ms(a), ms(b), ms(c)));
            assert_eq!(got, want, "{samples:?}");
        }
    }

    #[test]
    fn this_process_can_be_read() {
        assert!(rss_bytes().is_some_and(|rss| rss > 0));
        assert!(thread_cpu_s().is_some());
        assert!(process_cpu_s().is_some());
    }
}
