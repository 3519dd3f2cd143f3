//! One module per `imgrun` command.

pub mod bench;
pub mod cluster;
mod coordinator;
pub mod demo;
pub mod doctor;
pub mod export;
pub mod jobs;
pub mod plan;
pub mod plot;
pub mod serve;
pub mod shards;
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
