//! `imgrun bench`: benchmark programs that print figures (never timed tests).
//!
//! - `loader.rs`: `bench loader SPEC`, the training loader on the user's own shards.
//! - `dashboard.rs`: `bench dashboard`, the head's dashboard against the goals of its
//!   issue, on a real head and dashboard in this process, fed by `synthetic.rs`'s jobs and
//!   read over loopback HTTP by `browser.rs`'s pages; `usage.rs` reads this process's CPU
//!   time and memory and makes the quantiles.
//!
//! Layers, bottom up: `usage.rs`, `synthetic.rs` and `loader.rs` are leaves; `browser.rs`
//! uses `usage.rs`; `dashboard.rs` uses `usage.rs`, `synthetic.rs` and `browser.rs` (and,
//! outside this folder, `crate::dashboard` and `plot/`'s chart drawing).

mod browser;
mod dashboard;
mod loader;
mod synthetic;
mod usage;

use std::process::ExitCode;

use crate::config::Loaded;

pub use dashboard::DashboardArgs;
pub use loader::LoaderArgs;

#[derive(Debug, clap::Subcommand)]
pub enum BenchCommand {
    /// Runs the training loader on your shards: images/s, MB/s, where a worker's time
    /// goes (read, decode, transform), and the cores a target rate needs. Settings come
    /// from `[data]` (image size, crop, fields) and `train.batch_size`, as a job uses them.
    Loader(LoaderArgs),
    /// Measures the head's dashboard in this process: a real head and dashboard, a
    /// synthetic running job of `--ranks` ranks, `--finished-jobs` finished jobs and a
    /// `--log-bytes` job log, read by `--pages` pages over loopback HTTP; prints each
    /// figure against its goal.
    Dashboard(DashboardArgs),
}

pub fn run(loaded: &Loaded, command: BenchCommand) -> anyhow::Result<ExitCode> {
    match command {
        BenchCommand::Loader(args) => loader::run(loaded, args),
        BenchCommand::Dashboard(args) => dashboard::run(&args),
    }
}
