//! Benchmarks imgrun's ring allreduce against torch.distributed's gloo side by side,
//! every rank its own process on loopback, as real trainers are:
//!
//! ```text
//! eval "$(bash tools/libtorch.sh)"   # optional: puts torch's python on PATH for gloo
//! env -u LIBTORCH -u LIBTORCH_USE_PYTORCH \
//!     cargo run --locked --release -p runtime --example allreduce_procs -- [--worlds 2,4]
//!     [--max-bytes 268435456] [--target-bytes 268435456] [--chunk-bytes 1048576]
//!     [--inline-bytes 131072] [--block-bytes 524288] [--local-sockets 1] [--python PATH]
//! ```
//!
//! The ranks link over Unix domain sockets, as ranks on one host do by default;
//! `--local-sockets 0` links them over TCP loopback instead (gloo always uses TCP).
//!
//! For each world size the driver starts the ranks of this binary (`rank ...`), then the
//! ranks of `benches/python/allreduce_gloo.py` with `$VIRTUAL_ENV/bin/python` (else
//! `python3`; the gloo column is skipped with a note if torch does not import). Both
//! sides run the same float32 sizes (4 KiB to 256 MiB, powers of 4), the same iteration
//! counts (enough to move `--target-bytes` per size, 5 to 1000, after a fifth as many
//! warm-up ops, at most 50) and print the same JSON lines; the time per op is the
//! slowest rank's median, and busbw = 2 (n - 1) / n * bytes / time, as in nccl-tests.
//!
//! The ceiling printed first is this machine's memcpy bandwidth on one thread (buffers of
//! the largest size, at least 64 MiB): over a local socket every byte a rank sends is copied twice by the
//! kernel (into the socket, out of it) and reduced once, so the busbw columns are also
//! shown as a share of it.

#[path = "../benches/common/memcpy.rs"]
mod memcpy;

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener as StdListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use runtime::{CollectiveOptions, RingGroup, RingSecret};
use serde_json::{Value, json};

const SECRET_ENV: &str = "IMGRUN_BENCH_SECRET";

use memcpy::memcpy_bandwidth;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("rank") {
        return rank_main(&Flags::parse(&args[1..])?);
    }
    driver(&Flags::parse(&args)?)
}

/// `--name value` flags of both the driver and the ranks.
#[derive(Debug, Default)]
struct Flags {
    worlds: Vec<usize>,
    max_bytes: usize,
    target_bytes: usize,
    python: Option<PathBuf>,
    chunk_bytes: usize,
    inline_bytes: usize,
    block_bytes: usize,
    local_sockets: bool,
    rank: usize,
    ports: Vec<u16>,
}

impl Flags {
    fn parse(args: &[String]) -> Result<Self> {
        let mut flags = Flags {
            worlds: vec![2, 4],
            max_bytes: 256 << 20,
            target_bytes: 256 << 20,
            chunk_bytes: runtime::DEFAULT_CHUNK_BYTES,
            inline_bytes: runtime::DEFAULT_INLINE_BYTES,
            block_bytes: runtime::DEFAULT_BLOCK_BYTES,
            local_sockets: true,
            ..Flags::default()
        };
        let mut args = args.iter();
        while let Some(name) = args.next() {
            let value = args
                .next()
                .with_context(|| format!("flag {name} needs a value"))?;
            let list = |v: &str| -> Result<Vec<usize>> {
                v.split(',')
                    .map(|x| x.parse().with_context(|| format!("{name}: {x:?}")))
                    .collect()
            };
            match name.as_str() {
                "--worlds" | "--world" => flags.worlds = list(value)?,
                "--max-bytes" => flags.max_bytes = value.parse().context("--max-bytes")?,
                "--target-bytes" => flags.target_bytes = value.parse().context("--target-bytes")?,
                "--python" => flags.python = Some(value.into()),
                "--chunk-bytes" => flags.chunk_bytes = value.parse().context("--chunk-bytes")?,
                "--inline-bytes" => flags.inline_bytes = value.parse().context("--inline-bytes")?,
                "--block-bytes" => flags.block_bytes = value.parse().context("--block-bytes")?,
                "--local-sockets" => {
                    flags.local_sockets = match value.as_str() {
                        "1" | "true" => true,
                        "0" | "false" => false,
                        other => bail!("--local-sockets: {other:?} is not 1 or 0"),
                    }
                }
                "--rank" => flags.rank = value.parse().context("--rank")?,
                "--ports" => {
                    flags.ports = list(value)?
                        .into_iter()
                        .map(u16::try_from)
                        .collect::<Result<_, _>>()?
                }
                other => bail!("unknown flag {other}"),
            }
        }
        Ok(flags)
    }

    /// 4 KiB, 16 KiB, ... up to `max_bytes`.
    fn sizes(&self) -> Vec<usize> {
        std::iter::successors(Some(4usize << 10), |b| Some(b * 4))
            .take_while(|&b| b <= self.max_bytes)
            .collect()
    }
}

/// Timed and warm-up iterations for messages of `bytes` (the Python side agrees).
fn iterations(bytes: usize, target_bytes: usize) -> (usize, usize) {
    let iters = (target_bytes / bytes).clamp(5, 1000);
    (iters, (iters / 5).clamp(1, 50))
}

// --- driver ----------------------------------------------------------------------------

fn driver(flags: &Flags) -> Result<()> {
    let python = python(flags);
    let torch = Command::new(&python)
        .args(["-c", "import torch; print(torch.__version__)"])
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    match &torch {
        Some(version) => println!(
            "# gloo: torch {version} from {} (torch.set_num_threads(1) in every rank)",
            python.display()
        ),
        None => println!(
            "# gloo: SKIPPED, torch does not import with {} (run `eval \"$(bash tools/libtorch.sh)\"` or pass --python)",
            python.display()
        ),
    }
    println!(
        "# imgrun: ring over {}, chunk {} KiB, blocks of {} KiB, inline up to {} KiB x (n - 1), one current-thread tokio runtime per rank",
        if flags.local_sockets {
            "Unix sockets (TCP loopback where they fail)"
        } else {
            "TCP loopback"
        },
        flags.chunk_bytes >> 10,
        flags.block_bytes >> 10,
        flags.inline_bytes >> 10
    );
    // At least 64 MiB, so the copy runs from memory, not from cache.
    let memcpy_len = flags.max_bytes.max(64 << 20);
    let ceiling = memcpy_bandwidth(memcpy_len, Duration::from_secs(1));
    println!(
        "# ceiling: memcpy on one thread, {} buffers: {:.2} GB/s",
        human(memcpy_len as f64),
        ceiling / 1e9
    );
    println!(
        "# {} cores; load before: {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load()
    );
    for &world in &flags.worlds {
        let started = Instant::now();
        let ours = run_imgrun(flags, world).with_context(|| format!("imgrun, {world} ranks"))?;
        let ours_s = started.elapsed().as_secs_f64();
        let started = Instant::now();
        let theirs = match torch {
            Some(_) => Some(
                run_gloo(flags, world, &python).with_context(|| format!("gloo, {world} ranks"))?,
            ),
            None => None,
        };
        let theirs_s = started.elapsed().as_secs_f64();
        print_table(world, &ours, theirs.as_deref(), ceiling);
        println!(
            "# {world} ranks: imgrun {ours_s:.1} s, gloo {theirs_s:.1} s; load after: {}",
            load()
        );
    }
    Ok(())
}

fn python(flags: &Flags) -> PathBuf {
    if let Some(python) = &flags.python {
        return python.clone();
    }
    std::env::var_os("VIRTUAL_ENV")
        .map(|venv| Path::new(&venv).join("bin/python"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| "python3".into())
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// Starts `world` rank processes of this binary and returns rank 0's JSON lines.
fn run_imgrun(flags: &Flags, world: usize) -> Result<Vec<Value>> {
    let ports = free_ports(world)?;
    let ports = ports
        .iter()
        .map(u16::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let secret: String = RingSecret::random()
        .as_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let exe = std::env::current_exe().context("locating this binary")?;
    let children = (0..world)
        .map(|rank| {
            Command::new(&exe)
                .args(["rank", "--rank", &rank.to_string()])
                .args(["--world", &world.to_string(), "--ports", &ports])
                .args(["--max-bytes", &flags.max_bytes.to_string()])
                .args(["--target-bytes", &flags.target_bytes.to_string()])
                .args(["--chunk-bytes", &flags.chunk_bytes.to_string()])
                .args(["--inline-bytes", &flags.inline_bytes.to_string()])
                .args(["--block-bytes", &flags.block_bytes.to_string()])
                .args([
                    "--local-sockets",
                    &u8::from(flags.local_sockets).to_string(),
                ])
                .env(SECRET_ENV, &secret)
                .stdout(if rank == 0 {
                    Stdio::piped()
                } else {
                    Stdio::null()
                })
                .spawn()
                .with_context(|| format!("starting rank {rank}"))
        })
        .collect::<Result<Vec<_>>>()?;
    collect(children)
}

/// Runs the Python gloo benchmark, which starts its own rank processes.
fn run_gloo(flags: &Flags, world: usize, python: &Path) -> Result<Vec<Value>> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/python/allreduce_gloo.py");
    let child = Command::new(python)
        .arg(&script)
        .args(["--world", &world.to_string()])
        .args(["--max-bytes", &flags.max_bytes.to_string()])
        .args(["--target-bytes", &flags.target_bytes.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", script.display()))?;
    collect(vec![child])
}

/// Reads the first child's stdout as JSON lines and waits for every child to succeed.
fn collect(mut children: Vec<Child>) -> Result<Vec<Value>> {
    let stdout = children[0].stdout.take().context("child stdout")?;
    let mut lines = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        let value: Value =
            serde_json::from_str(&line).with_context(|| format!("not a JSON line: {line:?}"))?;
        lines.push(value);
    }
    for (i, mut child) in children.into_iter().enumerate() {
        let status = child.wait()?;
        ensure!(status.success(), "process {i} failed: {status}");
    }
    Ok(lines)
}

/// Ports free on loopback a moment ago (the ranks bind them right away).
fn free_ports(n: usize) -> Result<Vec<u16>> {
    let listeners = (0..n)
        .map(|_| StdListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()?;
    listeners
        .iter()
        .map(|l| Ok(l.local_addr()?.port()))
        .collect()
}

fn print_table(world: usize, ours: &[Value], theirs: Option<&[Value]>, ceiling: f64) {
    let field = |v: &Value, k: &str| v.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
    let find = |lines: Option<&[Value]>, bytes: f64| {
        lines.and_then(|ls| ls.iter().find(|v| field(v, "bytes") == bytes).cloned())
    };
    println!();
    println!("## {world} processes, float32 allreduce, loopback");
    println!(
        "{:>10} {:>6} {:>12} {:>12} {:>11} {:>11} {:>8} {:>9} {:>9}",
        "bytes",
        "iters",
        "imgrun us",
        "gloo us",
        "imgrun GB/s",
        "gloo GB/s",
        "ratio",
        "imgrun %",
        "gloo %"
    );
    for ours in ours {
        let bytes = field(ours, "bytes");
        let gloo = find(theirs, bytes);
        let (gloo_us, gloo_bw) = gloo.as_ref().map_or((f64::NAN, f64::NAN), |g| {
            (field(g, "median_us"), field(g, "busbw_gbps"))
        });
        let busbw = field(ours, "busbw_gbps");
        println!(
            "{:>10} {:>6} {:>12.1} {:>12.1} {:>11.3} {:>11.3} {:>8.2} {:>8.1}% {:>8.1}%",
            human(bytes),
            field(ours, "iters"),
            field(ours, "median_us"),
            gloo_us,
            busbw,
            gloo_bw,
            busbw / gloo_bw,
            100.0 * busbw / (ceiling / 1e9),
            100.0 * gloo_bw / (ceiling / 1e9)
        );
    }
    println!(
        "(GB/s: bus bandwidth of the slowest rank's median; ratio: imgrun / gloo; %: of memcpy)"
    );
    if let Some(small) = ours.first() {
        let bytes = field(small, "bytes");
        let gloo = find(theirs, bytes);
        let gloo = gloo.as_ref().map_or("skipped".to_string(), |g| {
            format!(
                "median {:.1} us, p99 {:.1} us",
                field(g, "median_us"),
                field(g, "p99_us")
            )
        });
        println!(
            "latency at {}: imgrun median {:.1} us, p99 {:.1} us; gloo {gloo}",
            human(bytes),
            field(small, "median_us"),
            field(small, "p99_us"),
        );
    }
}

fn human(bytes: f64) -> String {
    let bytes = bytes as u64;
    match bytes {
        b if b >= 1 << 20 => format!("{}M", b >> 20),
        b if b >= 1 << 10 => format!("{}K", b >> 10),
        b => b.to_string(),
    }
}

// --- rank ------------------------------------------------------------------------------

fn rank_main(flags: &Flags) -> Result<()> {
    // One thread per rank: the ring runs as one task, and on small machines extra
    // worker threads only compete with the other ranks.
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(rank_body(flags))
}

async fn rank_body(flags: &Flags) -> Result<()> {
    let (rank, world) = (flags.rank, flags.ports.len());
    ensure!(
        flags.worlds.len() == 1 && flags.worlds[0] == world,
        "--world must match --ports"
    );
    let hex = std::env::var(SECRET_ENV).with_context(|| format!("{SECRET_ENV} is not set"))?;
    let mut secret = [0u8; 32];
    ensure!(hex.len() == 64, "{SECRET_ENV} is not 64 hex digits");
    for (i, byte) in secret.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).context(SECRET_ENV)?;
    }
    let addr = |r: usize| SocketAddr::from(([127, 0, 0, 1], flags.ports[r]));
    let listener = tokio::net::TcpListener::bind(addr(rank))
        .await
        .with_context(|| format!("rank {rank} binding {}", addr(rank)))?;
    let mut group = RingGroup::connect(
        rank,
        world,
        listener,
        addr((rank + 1) % world),
        &RingSecret::from_bytes(secret),
        "allreduce-bench",
        CollectiveOptions {
            chunk_bytes: flags.chunk_bytes,
            inline_bytes: flags.inline_bytes,
            block_bytes: flags.block_bytes,
            local_sockets: flags.local_sockets,
            ..CollectiveOptions::default()
        },
    )
    .await?;
    if let (0, Some(link)) = (rank, group.link()) {
        eprintln!(
            "# rank 0: to rank {} over {:?}, from rank {} over {:?}",
            link.next(),
            link.next_transport(),
            link.prev(),
            link.prev_transport()
        );
    }

    let sizes = flags.sizes();
    let mut buffer = vec![0.0f32; sizes.last().copied().unwrap_or(0) / 4];
    for bytes in sizes {
        let data = &mut buffer[..bytes / 4];
        let (iters, warmup) = iterations(bytes, flags.target_bytes);
        group.barrier().await?;
        for _ in 0..warmup {
            group.allreduce_sum(data).await?;
        }
        group.barrier().await?;
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters {
            let start = Instant::now();
            group.allreduce_sum(data).await?;
            times.push(start.elapsed().as_secs_f64());
        }
        // Check the sum once, then zero the buffer so values never grow.
        data.fill(rank as f32 + 1.0);
        group.allreduce_sum(data).await?;
        let want = (world * (world + 1) / 2) as f32;
        ensure!(
            data.first() == Some(&want) && data.last() == Some(&want),
            "rank {rank}: wrong sum at {bytes} bytes"
        );
        data.fill(0.0);

        let (median, p99, mean) = stats(&mut times);
        // Gather every rank's figures (each in its own slots of a sum) and keep the worst.
        let mut all = vec![0.0f32; 3 * world];
        all[3 * rank..3 * rank + 3].copy_from_slice(&[median as f32, p99 as f32, mean as f32]);
        group.allreduce_sum(&mut all).await?;
        if rank == 0 {
            let worst = |k: usize| {
                (0..world)
                    .map(|r| f64::from(all[3 * r + k]))
                    .fold(0.0, f64::max)
            };
            println!(
                "{}",
                result_line("imgrun", world, bytes, iters, worst(0), worst(1), worst(2))
            );
        }
    }
    group.barrier().await?;
    Ok(())
}

/// Median (upper), 99th percentile and mean of `times`, in seconds.
fn stats(times: &mut [f64]) -> (f64, f64, f64) {
    times.sort_by(f64::total_cmp);
    let n = times.len();
    let p99 = times[(n * 99).div_ceil(100).clamp(1, n) - 1];
    (times[n / 2], p99, times.iter().sum::<f64>() / n as f64)
}

fn result_line(
    implementation: &str,
    world: usize,
    bytes: usize,
    iters: usize,
    median: f64,
    p99: f64,
    mean: f64,
) -> Value {
    let algbw = bytes as f64 / median / 1e9;
    json!({
        "impl": implementation,
        "world": world,
        "bytes": bytes,
        "iters": iters,
        "median_us": median * 1e6,
        "p99_us": p99 * 1e6,
        "mean_us": mean * 1e6,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * 2.0 * (world - 1) as f64 / world as f64,
    })
}
