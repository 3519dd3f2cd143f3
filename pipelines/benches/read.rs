//! Read benchmark: raw sample iteration over ImageNet-like shards, single thread, files hot
//! in the page cache; imgrun's `SampleReader` against `cat` and Python `webdataset`.
//!
//!     cargo bench -p pipelines --bench read
//!
//! The shards (3,000 samples of a JPEG-sized payload, about 110 KB on average, plus a
//! `cls`, 1,000 samples a shard) are generated once under `$IMGRUN_CACHE/bench-data`, or
//! `target/bench-data` when `IMGRUN_CACHE` is not set. Python comes from
//! `tools/pytools.sh`; without it that row says why it was skipped. The goals are
//! >= 10x Python's samples/s and >= 0.9x `cat`'s MB/s. Timings are printed, never asserted.
//!
//! A run takes some 40 ms, so on a busy machine its wall time says more about the load
//! than about the reader. imgrun and `cat` are also set side by side by the CPU time of
//! all their runs (user and system, in 10 ms ticks: imgrun's own, `cat`'s as a waited-for
//! child), which time spent waiting for a core does not inflate.
//!
//! Below the table, variants of the imgrun reader show where the time goes: the public
//! `ShardSamples` on the file as any `Read` (member data read into zeroed memory, which
//! `SampleReader` skips for a local file), or through a 1 MiB buffer as it was before the
//! reader read member data in place, and a lean tar walk that is not imgrun.
//!
//! Options (after `--`): `--runs N` (default 10) and `--only-imgrun`, for profiling:
//!
//!     perf record -g target/release/deps/read-<hash> --only-imgrun --runs 20

mod common;

use std::io::Read;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{data_dir, machine_line, ratio_line, repo_root, warm};
use pipelines::{
    ReadStats, Sample, SampleReader, ShardSamples, ShardWriter, SourceOptions, Sources,
};
use rand::{Rng, RngCore, SeedableRng};

const SAMPLES: u64 = 3_000;
const PER_SHARD: u64 = 1_000;
/// Payload sizes are uniform in this range: 110 KB on average, like ImageNet's JPEGs.
const JPEG_BYTES: std::ops::RangeInclusive<usize> = 40_000..=180_000;
/// Timed runs of each reader; the best is reported (and the CPU time of all of them).
const DEFAULT_RUNS: usize = 10;
/// Bump when the generated data changes, so that old shards are not reused.
const DATA_VERSION: &str = "read-v1";

const GOAL_VS_PYTHON: f64 = 10.0;
const GOAL_VS_CAT: f64 = 0.9;

/// Samples and payload bytes seen by one run, and its time.
type Timed = Result<(Counts, Duration), String>;

/// One way of reading the benchmark shards once.
type Reader<'a> = dyn Fn() -> Timed + 'a;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Counts {
    samples: u64,
    payload: u64,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let runs = args
        .iter()
        .position(|a| a == "--runs")
        .and_then(|i| args.get(i + 1))
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or(DEFAULT_RUNS)
        .max(1);
    let only_imgrun = args.iter().any(|a| a == "--only-imgrun");

    let root = repo_root();
    let dir = data_dir(&root, DATA_VERSION);
    let shards = ensure_shards(&dir).unwrap_or_else(|error| {
        fail(&format!(
            "cannot generate shards in {}: {error}",
            dir.display()
        ))
    });
    let urls: Vec<String> = shards
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let file_bytes: u64 = shards
        .iter()
        .map(|p| std::fs::metadata(p).map_or(0, |m| m.len()))
        .sum();
    for path in &shards {
        warm(path);
    }
    let rate = |time: Duration| Rates::of(file_bytes, time);

    // imgrun and cat take turns, so that a burst of load elsewhere hits both alike.
    let mut imgrun_best: Option<(Counts, Duration)> = None;
    let mut cat_best: Option<Duration> = None;
    let mut cat_error = None;
    let mut cpu = CpuTicks::default();
    for _ in 0..runs {
        let before = cpu_ticks();
        let (counts, time) = read_with_imgrun(&urls, SourceOptions::default())
            .unwrap_or_else(|error| fail(&format!("imgrun failed: {error}")));
        cpu.add(before, cpu_ticks());
        if imgrun_best.is_none_or(|(_, best)| time < best) {
            imgrun_best = Some((counts, time));
        }
        if only_imgrun {
            continue;
        }
        let before = cpu_ticks();
        match read_with_cat(&shards) {
            Ok((_, time)) => cat_best = Some(cat_best.map_or(time, |best| best.min(time))),
            Err(error) => cat_error = Some(error),
        }
        cpu.add(before, cpu_ticks());
    }
    // Invariant: `runs` is at least 1, so the loop ran imgrun at least once.
    let (counts, imgrun_time) = imgrun_best.expect("one imgrun run");
    let imgrun = rate(imgrun_time);
    if only_imgrun {
        println!(
            "imgrun SampleReader: best of {runs}: {:.0} MB/s",
            imgrun.mb_per_s
        );
        return;
    }
    let cat = cat_best.map(rate);
    let python = read_with_python(&root, &urls, runs);

    println!(
        "read benchmark: {} shards, {} samples, {:.1} MB of tar ({:.1} KB payload a sample); \
         hot page cache, one thread, best of {runs}",
        shards.len(),
        counts.samples,
        file_bytes as f64 / 1e6,
        counts.payload as f64 / counts.samples.max(1) as f64 / 1e3,
    );
    println!("data: {}", dir.display());
    println!("machine: {}", machine_line());
    println!();
    println!(
        "{:<36} {:>10} {:>8} {:>8} {:>8}",
        "reader", "samples/s", "MB/s", "seconds", "vs cat"
    );
    let row = |name: &str, samples: Option<u64>, time: Duration| {
        let r = rate(time);
        let per_s = samples.map_or("-".to_string(), |n| format!("{:.0}", n as f64 / r.seconds));
        let vs_cat = cat.map_or("-".to_string(), |c| {
            format!("{:.2}x", c.seconds / r.seconds)
        });
        println!(
            "{name:<36} {per_s:>10} {:>8.0} {:>8.3} {vs_cat:>8}",
            r.mb_per_s, r.seconds
        );
    };
    row(
        "imgrun SampleReader (raw)",
        Some(counts.samples),
        imgrun_time,
    );
    match (cat_best, &cat_error) {
        (Some(time), _) => row("cat FILES > /dev/null", None, time),
        (None, Some(reason)) => println!("cat: skipped ({reason})"),
        (None, None) => println!("cat: skipped (no runs)"),
    }
    let python = match python {
        Ok(run) => {
            let name = format!("python webdataset {} (raw)", run.version);
            row(&name, Some(run.counts.samples), run.best);
            if run.counts != counts {
                println!("  note: python saw {:?}, imgrun {counts:?}", run.counts);
            }
            Some(rate(run.best))
        }
        Err(reason) => {
            println!("python: skipped ({reason})");
            None
        }
    };

    println!();
    println!("{:<36} {:>10} {:>8}", "ratio", "measured", "goal");
    // Same data in every row, so a ratio of times is a ratio of samples/s and of MB/s.
    let vs_python = python.map(|p| p.seconds / imgrun.seconds);
    ratio_line("imgrun / python samples/s", vs_python, Some(GOAL_VS_PYTHON));
    let vs_cat = cat.map(|c| c.seconds / imgrun.seconds);
    ratio_line("imgrun / cat MB/s", vs_cat, Some(GOAL_VS_CAT));
    let by_cpu = (cpu.own > 0 && cpu.children > 0 && cat_error.is_none())
        .then(|| cpu.children as f64 / cpu.own as f64);
    ratio_line("imgrun / cat MB/s, by CPU time", by_cpu, Some(GOAL_VS_CAT));
    println!(
        "  (CPU time of all {runs} runs: imgrun {:.2} s, cat {:.2} s)",
        cpu.own as f64 / TICKS_PER_SECOND,
        cpu.children as f64 / TICKS_PER_SECOND
    );

    println!();
    println!("variants of the imgrun reader (where the time goes):");
    let variants: [(&str, Box<Reader>); 3] = [
        (
            "  ShardSamples, bare File, zeroed",
            Box::new(|| read_shard_samples(&shards, None)),
        ),
        (
            "  ShardSamples, 1 MiB BufReader",
            Box::new(|| read_shard_samples(&shards, Some(1 << 20))),
        ),
        (
            "  sketch: lean tar walk (not imgrun)",
            Box::new(|| read_sketch(&shards)),
        ),
    ];
    for (name, run) in variants {
        match best_of(runs, run) {
            Ok((seen, time)) => {
                row(name, Some(counts.samples), time);
                if seen != counts {
                    println!("    note: saw {seen:?}, imgrun {counts:?}");
                }
            }
            Err(error) => println!("{name}: failed: {error}"),
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Rates {
    mb_per_s: f64,
    seconds: f64,
}

impl Rates {
    fn of(bytes: u64, time: Duration) -> Self {
        let seconds = time.as_secs_f64().max(1e-9);
        Self {
            mb_per_s: bytes as f64 / 1e6 / seconds,
            seconds,
        }
    }
}

/// Clock ticks a second in `/proc/self/stat` (`USER_HZ`, 100 on Linux).
const TICKS_PER_SECOND: f64 = 100.0;

/// CPU time summed over runs, in clock ticks: this process's own (imgrun's runs) and its
/// waited-for children's (`cat`'s runs; the two take turns, so each delta is one side's).
#[derive(Debug, Default)]
struct CpuTicks {
    own: u64,
    children: u64,
}

impl CpuTicks {
    fn add(&mut self, before: Option<(u64, u64)>, after: Option<(u64, u64)>) {
        if let (Some(before), Some(after)) = (before, after) {
            self.own += after.0.saturating_sub(before.0);
            self.children += after.1.saturating_sub(before.1);
        }
    }
}

/// This process's CPU time and its waited-for children's (user + system), in clock ticks,
/// from `/proc/self/stat`; `None` where it cannot be read.
fn cpu_ticks() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces) start at the state, field 3;
    // utime, stime, cutime and cstime are fields 14 to 17.
    let rest = &text[text.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    Some((field(14)? + field(15)?, field(16)? + field(17)?))
}

fn fail(message: &str) -> ! {
    common::fail("read", message)
}

/// The shards, generated on first use; a `.complete` file marks a finished set.
fn ensure_shards(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let shard_count = SAMPLES.div_ceil(PER_SHARD);
    let paths: Vec<PathBuf> = (0..shard_count)
        .map(|i| dir.join(format!("bench-{i:06}.tar")))
        .collect();
    if dir.join(".complete").exists() {
        return Ok(paths);
    }
    eprintln!(
        "read bench: generating {SAMPLES} samples in {} (once)",
        dir.display()
    );
    if dir.exists() {
        std::fs::remove_dir_all(dir)?;
    }
    std::fs::create_dir_all(dir)?;
    let pattern = dir.join("bench-%06d.tar");
    let mut writer = ShardWriter::new(pattern.to_string_lossy(), PER_SHARD, u64::MAX)?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(20_240_101);
    for i in 0..SAMPLES {
        let mut jpeg = vec![0u8; rng.random_range(JPEG_BYTES)];
        rng.fill_bytes(&mut jpeg);
        // Start and end like a JPEG; the bytes between are noise, as good as any for
        // raw iteration.
        jpeg[..4].copy_from_slice(&[0xff, 0xd8, 0xff, 0xe0]);
        let end = jpeg.len() - 2;
        jpeg[end..].copy_from_slice(&[0xff, 0xd9]);
        let class = rng.random_range(0..1000u32);
        let key = format!("n{:08}_{i:06}", 1_440_764 + class);
        writer.write(&Sample::new(key).with("jpg", jpeg).with_class(class))?;
    }
    let written = writer.finish()?;
    if written.len() as u64 != shard_count {
        return Err(std::io::Error::other(format!(
            "wrote {} shards",
            written.len()
        )));
    }
    std::fs::write(
        dir.join(".complete"),
        format!("{SAMPLES} samples, {PER_SHARD} a shard\n"),
    )?;
    Ok(paths)
}

/// The fastest of `runs` timed calls, or the first failure.
fn best_of(runs: usize, mut run: impl FnMut() -> Timed) -> Timed {
    let mut best = run()?;
    for _ in 1..runs {
        let next = run()?;
        if next.1 < best.1 {
            best = next;
        }
    }
    Ok(best)
}

fn read_with_imgrun(urls: &[String], options: SourceOptions) -> Timed {
    let reader = SampleReader::new(Sources::new(options));
    let start = Instant::now();
    let stats = reader
        .read_all(urls, &mut |sample| {
            std::hint::black_box(&sample);
            ControlFlow::Continue(())
        })
        .map_err(|e| e.to_string())?;
    let counts = Counts {
        samples: stats.samples,
        payload: stats.payload_bytes,
    };
    Ok((counts, start.elapsed()))
}

/// The tar parsed straight from the file, without `Sources` and its compression check,
/// as a plain `Read` (member data read into zeroed memory); with `buffer`, through a
/// `BufReader` of that size, which every byte then passes (one more copy: what the
/// reader paid for its 1 MiB read buffer before).
fn read_shard_samples(paths: &[PathBuf], buffer: Option<usize>) -> Timed {
    let start = Instant::now();
    let mut stats = ReadStats::default();
    for path in paths {
        let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let stream: Box<dyn Read> = match buffer {
            Some(bytes) => Box::new(std::io::BufReader::with_capacity(bytes, file)),
            None => Box::new(file),
        };
        // The visitor never stops early, so the flow is always `Continue`.
        let _flow = ShardSamples::new(&path.to_string_lossy(), stream)
            .for_each(&mut stats, &mut |sample| {
                std::hint::black_box(&sample);
                ControlFlow::Continue(())
            })
            .map_err(|e| e.to_string())?;
    }
    let counts = Counts {
        samples: stats.samples,
        payload: stats.payload_bytes,
    };
    Ok((counts, start.elapsed()))
}

/// Not imgrun: a bare-bones tar walk (plain headers only, no checksums, no limits, no
/// error offsets: enough for these shards) through a 64 KiB `BufReader`, member data
/// read with `read_to_end` into the sample's buffer. The floor that `reader.rs` is
/// measured against, on the same data.
fn read_sketch(paths: &[PathBuf]) -> Timed {
    let start = Instant::now();
    let mut counts = Counts {
        samples: 0,
        payload: 0,
    };
    for path in paths {
        let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut stream = std::io::BufReader::with_capacity(64 << 10, file);
        let mut header = [0u8; 512];
        let mut padding_bytes = [0u8; 512];
        let mut key = Vec::new();
        loop {
            stream.read_exact(&mut header).map_err(|e| e.to_string())?;
            if header.iter().all(|&b| b == 0) {
                break;
            }
            let name = &header[..header[..100].iter().position(|&b| b == 0).unwrap_or(100)];
            let size_field = std::str::from_utf8(&header[124..136]).map_err(|e| e.to_string())?;
            let size = u64::from_str_radix(size_field.trim_matches(|c| c == '\0' || c == ' '), 8)
                .map_err(|e| format!("size `{size_field}`: {e}"))?;
            let mut data = Vec::with_capacity(usize::try_from(size).map_err(|e| e.to_string())?);
            (&mut stream)
                .take(size)
                .read_to_end(&mut data)
                .map_err(|e| e.to_string())?;
            let padding = (size.div_ceil(512) * 512 - size) as usize;
            stream
                .read_exact(&mut padding_bytes[..padding])
                .map_err(|e| e.to_string())?;
            let this_key = &name[..name.iter().position(|&b| b == b'.').unwrap_or(name.len())];
            if this_key != key.as_slice() {
                counts.samples += 1;
                key = this_key.to_vec();
            }
            counts.payload += data.len() as u64;
            std::hint::black_box(&data);
        }
    }
    Ok((counts, start.elapsed()))
}

fn read_with_cat(paths: &[PathBuf]) -> Timed {
    let start = Instant::now();
    let status = Command::new("cat")
        .args(paths)
        .stdout(Stdio::null())
        .status()
        .map_err(|e| format!("cannot run cat: {e}"))?;
    let time = start.elapsed();
    if !status.success() {
        return Err(format!("cat exited with {status}"));
    }
    Ok((
        Counts {
            samples: 0,
            payload: 0,
        },
        time,
    ))
}

struct PythonRun {
    version: String,
    best: Duration,
    counts: Counts,
}

/// Python `webdataset` iterating the same shards (`wds_iterate.py` times itself, so
/// interpreter start-up is not counted).
fn read_with_python(root: &Path, urls: &[String], runs: usize) -> Result<PythonRun, String> {
    let python = common::tool_python(root, "tools/pytools.sh")?;
    let mut args = vec![runs.to_string()];
    args.extend_from_slice(urls);
    let report = common::python_json(
        &python,
        &root.join("pipelines/tests/python/wds_iterate.py"),
        &args,
    )?;
    let best = report["runs"]
        .as_array()
        .and_then(|runs| {
            runs.iter()
                .filter_map(serde_json::Value::as_f64)
                .reduce(f64::min)
        })
        .ok_or("wds_iterate.py printed no timings")?;
    Ok(PythonRun {
        version: report["version"].as_str().unwrap_or("?").to_string(),
        best: Duration::from_secs_f64(best),
        counts: Counts {
            samples: report["samples"].as_u64().unwrap_or(0),
            payload: report["payload_bytes"].as_u64().unwrap_or(0),
        },
    })
}
