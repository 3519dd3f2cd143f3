//! Reading a large job log as the dashboard does: writes a log of `IMGRUN_LOG_MB`
//! megabytes (default 1024) of stamped lines in a temporary folder, then times the last
//! 1,000 lines, a 4 MiB piece from the middle, and a search of the newest 64 MiB, each
//! five times, and prints the figures. A program that prints, not a timed test.
//!
//! `cargo bench -p actors --bench joblog` (with libtorch's environment, as `actors`
//! links it; `make bench` runs it).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::time::Instant;

use actors::job::{LogFrom, LogRequest, LogSearchRequest, MAX_LOG_PIECE, read_log, search_log};

fn main() -> anyhow::Result<()> {
    let megabytes: u64 = std::env::var("IMGRUN_LOG_MB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1024);
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("job.log");
    let started = Instant::now();
    let mut out = BufWriter::with_capacity(1 << 20, File::create(&path)?);
    let mut written = 0u64;
    let mut line = 0u64;
    while written < megabytes << 20 {
        let text = format!(
            "2026-11-28T19:05:11.{:03}Z epoch {} step {line}: loss 2.3026, 812 images/s, \
             data wait 0.004 s{}\n",
            line % 1000,
            line / 5000,
            if line % 100_000 == 7 {
                " warning: slow rank 3"
            } else {
                ""
            }
        );
        out.write_all(text.as_bytes())?;
        written += text.len() as u64;
        line += 1;
    }
    out.flush()?;
    drop(out);
    println!(
        "log: {:.0} MiB, {line} lines, written in {:.1} s",
        written as f64 / f64::from(1 << 20),
        started.elapsed().as_secs_f64()
    );
    let length = std::fs::metadata(&path)?.len();
    let time = |what: &str, run: &mut dyn FnMut() -> anyhow::Result<usize>| -> anyhow::Result<()> {
        let mut ms = Vec::new();
        let mut size = 0;
        for _ in 0..5 {
            let started = Instant::now();
            size = run()?;
            ms.push(started.elapsed().as_secs_f64() * 1000.0);
        }
        ms.sort_by(f64::total_cmp);
        println!(
            "{what}: median {:.2} ms, slowest {:.2} ms ({size} bytes or matches)",
            ms[2], ms[4]
        );
        Ok(())
    };
    time("last 1,000 lines", &mut || {
        let mut file = File::open(&path)?;
        let request = LogRequest {
            from: LogFrom::Tail { lines: 1000 },
            max_bytes: MAX_LOG_PIECE,
        };
        Ok(read_log(&mut file, length, &request)?.bytes.len())
    })?;
    time("4 MiB from the middle", &mut || {
        let mut file = File::open(&path)?;
        let request = LogRequest {
            from: LogFrom::Offset { offset: length / 2 },
            max_bytes: MAX_LOG_PIECE,
        };
        Ok(read_log(&mut file, length, &request)?.bytes.len())
    })?;
    time("search of the newest 64 MiB", &mut || {
        let mut file = File::open(&path)?;
        let request = LogSearchRequest {
            text: "warning".into(),
            max_matches: 1000,
        };
        Ok(search_log(&mut file, length, &request)?.matches.len())
    })?;
    Ok(())
}
