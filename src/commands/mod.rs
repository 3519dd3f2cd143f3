//! One module per `imgrun` command.
//!
//! Modules, bottom up: a module uses only those on the lines before its own.
//! 1. `coordinator`, `doctor`, `export`, `k8s`, `serve`, `shards`, `tables` (the jobs
//!    and ranks tables), `terminal` (a job's events on this terminal): leaves.
//! 2. `cluster` (above `tables`).
//! 3. `jobs` (above `cluster`, `coordinator`, `tables`, `terminal`).
//! 4. `plot/` (above `jobs`).
//! 5. `train/` (above `jobs`, `plot/`, `terminal`), `report` (above `coordinator`,
//!    `jobs`, `plot/`), `bench/` (above `plot/`).
//! 6. `demo`, `plan` (above `train/`).

pub mod bench;
pub mod cluster;
mod coordinator;
pub mod demo;
pub mod doctor;
pub mod export;
pub mod jobs;
pub mod k8s;
pub mod plan;
pub mod plot;
pub mod report;
pub mod serve;
pub mod shards;
mod tables;
mod terminal;
pub mod train;

use indicatif::{ProgressBar, ProgressStyle};

/// A progress bar on standard error (drawn only when it is a terminal).
pub fn progress_bar(total: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(total);
    let style =
        ProgressStyle::with_template("{msg:>10} [{bar:40}] {pos}/{len} ({per_sec}, eta {eta})")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
    bar.set_style(style);
    bar.set_message(what.to_string());
    bar
}
