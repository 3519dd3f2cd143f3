//! Data channel benchmark: how fast `runtime::channel` moves image batches over loopback,
//! against the memory bandwidth of one core, which bounds any copy through the kernel.
//!
//!     cargo bench -p runtime --bench channel [-- --quick]
//!
//! Each row runs 1, 2 or 4 streams at once, each a sender thread sending the same
//! uint8 batch (a 16-byte label part and the pixels, as two parts of one frame) to a
//! receiver thread that takes every frame into one reused buffer. Rows: batches of 256
//! images at 224 px (38.5 MB a frame) and at 64 px (3.1 MB). Throughput is counted at
//! the receivers over the timed window, after a warm-up. Figures are printed, never
//! asserted; the machine's cores and load are printed with them, since a sender and a
//! receiver each take a core.

#[allow(dead_code)] // Shared with the cluster bench, which uses the rest of it.
#[path = "cluster/measure.rs"]
mod measure;

#[path = "common/memcpy.rs"]
mod memcpy;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use measure::{load_average, machine_line, utc_now};
use runtime::channel::{ChannelSecret, DataListener, DataStream};

/// Images per batch.
const BATCH: usize = 256;
/// Image sides of the rows, in pixels (3 channels, uint8).
const SIDES: [usize; 2] = [224, 64];
/// Concurrent streams of the rows.
const STREAMS: [usize; 3] = [1, 2, 4];

use memcpy::memcpy_bandwidth;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // `cargo bench` passes `--bench`; anything else but `--quick` is a mistake.
    let quick = args.iter().any(|arg| arg == "--quick");
    if let Some(other) = args
        .iter()
        .find(|arg| !matches!(arg.as_str(), "--quick" | "--bench"))
    {
        eprintln!("channel bench: unknown argument {other:?}");
        eprintln!("usage: cargo bench -p runtime --bench channel [-- --quick]");
        return ExitCode::FAILURE;
    }
    match run(quick) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("channel bench: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(quick: bool) -> Result<()> {
    let (warm_up, window) = if quick {
        (Duration::from_millis(100), Duration::from_millis(400))
    } else {
        (Duration::from_millis(500), Duration::from_secs(3))
    };
    println!(
        "data channel benchmark{}: loopback (127.0.0.1), release build, {:?} per row",
        if quick { " (--quick)" } else { "" },
        window
    );
    println!("machine: {}", machine_line());
    println!("date: {}", utc_now());
    let ceiling = memcpy_bandwidth(frame_len(224), window);
    println!(
        "ceiling: memcpy on one thread, {} MB buffers: {:.2} GB/s",
        mb(frame_len(224)),
        ceiling / 1e9
    );
    println!();
    println!(
        "{:<26} {:>7} {:>10} {:>9} {:>15} {:>12}",
        "frame", "streams", "frames/s", "GB/s", "GB/s per stream", "of memcpy"
    );
    for side in SIDES {
        for streams in STREAMS {
            let len = frame_len(side);
            let rate = stream_row(len, streams, warm_up, window)
                .with_context(|| format!("{side} px, {streams} streams"))?;
            let bytes_per_s = rate * len as f64;
            println!(
                "{:<26} {:>7} {:>10.1} {:>9.2} {:>15.2} {:>11.0}%",
                format!("{BATCH} x {side} px ({} MB)", mb(len)),
                streams,
                rate,
                bytes_per_s / 1e9,
                bytes_per_s / 1e9 / streams as f64,
                100.0 * bytes_per_s / ceiling
            );
        }
    }
    println!("(load average after: {})", load_average());
    Ok(())
}

/// Bytes of one uint8 batch of `side` px images.
fn frame_len(side: usize) -> usize {
    BATCH * side * side * 3
}

fn mb(bytes: usize) -> String {
    format!("{:.1}", bytes as f64 / 1e6)
}

/// Frames per second received in total over `streams` concurrent streams.
fn stream_row(len: usize, streams: usize, warm_up: Duration, window: Duration) -> Result<f64> {
    let secret = ChannelSecret::random();
    let listener = DataListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)), secret.clone())?;
    let addr = listener.local_addr();
    let stop = Arc::new(AtomicBool::new(false));
    let received = Arc::new(AtomicU64::new(0));

    let senders: Vec<_> = (0..streams)
        .map(|index| {
            let (secret, stop) = (secret.clone(), stop.clone());
            thread::spawn(move || -> Result<()> {
                let mut stream = DataStream::connect(addr, &secret, Duration::from_secs(10))?;
                let label = [index as u8; 16];
                let pixels = vec![index as u8 ^ 0x5a; len - label.len()];
                while !stop.load(Ordering::Relaxed) {
                    stream.send(&[&label, &pixels])?;
                }
                Ok(())
            })
        })
        .collect();
    let receivers: Vec<_> = (0..streams)
        .map(|_| {
            let mut stream = listener.accept()?;
            let received = received.clone();
            Ok(thread::spawn(move || -> Result<()> {
                let mut buf = Vec::new();
                while stream.recv(&mut buf, len)? {
                    if buf.len() != len {
                        bail!("a frame of {} bytes instead of {len}", buf.len());
                    }
                    received.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            }))
        })
        .collect::<Result<_>>()?;

    thread::sleep(warm_up);
    let (start, first) = (Instant::now(), received.load(Ordering::Relaxed));
    thread::sleep(window);
    let (end, last) = (Instant::now(), received.load(Ordering::Relaxed));
    stop.store(true, Ordering::Relaxed);
    for sender in senders {
        sender
            .join()
            .map_err(|_| anyhow::anyhow!("a sender panicked"))??;
    }
    for receiver in receivers {
        receiver
            .join()
            .map_err(|_| anyhow::anyhow!("a receiver panicked"))??;
    }
    Ok((last - first) as f64 / (end - start).as_secs_f64())
}
