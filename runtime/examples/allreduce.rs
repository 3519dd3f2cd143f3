//! Prints the bus bandwidth of the TCP ring allreduce on loopback, every rank a task of
//! this process: `cargo run --release -p runtime --example allreduce [WORLD...]`.
//!
//! busbw = 2 (n - 1) / n * bytes / time, as nccl-tests and gloo benchmarks report it.
//! The multi-process benchmark against torch.distributed's gloo is `allreduce_procs`.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use runtime::{CollectiveOptions, RingGroup, RingSecret};
use tokio::net::TcpListener;

const SIZES: [usize; 8] = [
    4 << 10,
    16 << 10,
    64 << 10,
    256 << 10,
    1 << 20,
    4 << 20,
    16 << 20,
    64 << 20,
];
/// Bytes each size moves per rank at least, so small sizes run many iterations.
const TARGET_BYTES: usize = 512 << 20;

#[tokio::main]
async fn main() -> Result<()> {
    let worlds: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().context("world sizes are integers"))
        .collect::<Result<_>>()?;
    let worlds = if worlds.is_empty() {
        vec![2, 4]
    } else {
        worlds
    };
    println!(
        "{:>6} {:>10} {:>6} {:>12} {:>12}",
        "ranks", "bytes", "iters", "time/op", "busbw"
    );
    for world in worlds {
        let mut groups = connect(world).await?;
        for bytes in SIZES {
            let iters = (TARGET_BYTES / bytes).clamp(3, 1000);
            let elapsed;
            (elapsed, groups) = time_allreduce(groups, bytes / 4, iters).await?;
            let per_op = elapsed / iters as u32;
            let busbw =
                2.0 * (world - 1) as f64 / world as f64 * bytes as f64 / per_op.as_secs_f64() / 1e9;
            println!(
                "{world:>6} {bytes:>10} {iters:>6} {:>10.1}us {busbw:>8.3} GB/s",
                per_op.as_secs_f64() * 1e6
            );
        }
    }
    Ok(())
}

/// Runs one warm-up and `iters` timed allreduces of `len` floats on every rank; the time
/// is the slowest rank's. The groups come back for the next size.
async fn time_allreduce(
    groups: Vec<RingGroup>,
    len: usize,
    iters: usize,
) -> Result<(Duration, Vec<RingGroup>)> {
    let tasks: Vec<_> = groups
        .into_iter()
        .map(|mut group| {
            tokio::spawn(async move {
                let mut buffer = vec![1.0f32; len];
                group.allreduce_sum(&mut buffer).await?;
                group.barrier().await?;
                let start = Instant::now();
                for _ in 0..iters {
                    group.allreduce_sum(&mut buffer).await?;
                }
                group.barrier().await?;
                anyhow::Ok((start.elapsed(), group))
            })
        })
        .collect();
    let mut slowest = Duration::ZERO;
    let mut back = Vec::new();
    for task in tasks {
        let (elapsed, group) = task.await??;
        slowest = slowest.max(elapsed);
        back.push(group);
    }
    Ok((slowest, back))
}

async fn connect(world: usize) -> Result<Vec<RingGroup>> {
    let secret = RingSecret::random();
    let mut listeners = Vec::new();
    for _ in 0..world {
        listeners.push(TcpListener::bind("127.0.0.1:0").await?);
    }
    let addrs: Vec<SocketAddr> = listeners
        .iter()
        .map(|l| l.local_addr())
        .collect::<std::io::Result<_>>()?;
    let tasks: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(rank, listener)| {
            let next = addrs[(rank + 1) % world];
            let secret = secret.clone();
            tokio::spawn(async move {
                let options = CollectiveOptions::default();
                RingGroup::connect(rank, world, listener, next, &secret, "bench", options).await
            })
        })
        .collect();
    let mut groups = Vec::new();
    for task in tasks {
        groups.push(task.await??);
    }
    Ok(groups)
}
