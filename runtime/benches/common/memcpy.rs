//! This machine's one-thread memory copy bandwidth, the ceiling the benchmarks compare
//! the ring and the data channel against (shared by `benches/channel.rs` and
//! `examples/allreduce_procs.rs`).

use std::hint::black_box;
use std::time::{Duration, Instant};

/// Bytes per second that one thread copies between two buffers of `len` bytes.
pub fn memcpy_bandwidth(len: usize, window: Duration) -> f64 {
    let source = vec![7u8; len];
    let mut target = vec![0u8; len];
    // Once to fault the pages in.
    target.copy_from_slice(&source);
    let started = Instant::now();
    let mut copies = 0u64;
    while started.elapsed() < window {
        target.copy_from_slice(black_box(&source));
        black_box(&mut target);
        copies += 1;
    }
    copies as f64 * len as f64 / started.elapsed().as_secs_f64()
}
