//! A job's events on this terminal: lines to stdout (warnings to stderr) and a progress
//! bar per epoch, the lines printed above the bar.

use std::sync::Mutex;

use actors::job::{JobEvent, JobOutput, Level};
use indicatif::ProgressBar;

use crate::commands::progress_bar;

/// Renders a job's events as they come.
#[derive(Default)]
pub(crate) struct Terminal {
    bar: Mutex<Option<ProgressBar>>,
}

impl Terminal {
    /// Clears the progress bar, if one is shown.
    pub(crate) fn finish(&self) {
        if let Some(bar) = self.bar.lock().unwrap_or_else(|e| e.into_inner()).take() {
            bar.finish_and_clear();
        }
    }
}

impl JobOutput for Terminal {
    fn event(&self, event: JobEvent) {
        let mut bar = self.bar.lock().unwrap_or_else(|e| e.into_inner());
        match event {
            JobEvent::Line { level, text } => {
                let say = || match level {
                    Level::Info => println!("{text}"),
                    Level::Warning => eprintln!("{text}"),
                };
                match bar.as_ref() {
                    Some(bar) => bar.suspend(say),
                    None => say(),
                }
            }
            JobEvent::EpochStarted {
                epoch,
                steps,
                position,
            } => {
                if let Some(old) = bar.take() {
                    old.finish_and_clear();
                }
                let new = progress_bar(steps, &format!("epoch {epoch}"));
                new.set_position(position);
                *bar = Some(new);
            }
            JobEvent::Stepped {
                epoch,
                position,
                loss,
                images_per_s,
                ..
            } => {
                if let Some(bar) = bar.as_ref() {
                    bar.set_position(position);
                    bar.set_message(format!(
                        "epoch {epoch} loss {loss:.3} {images_per_s:.0} img/s"
                    ));
                }
            }
            JobEvent::EpochEnded { .. } | JobEvent::Preloaded => {
                if let Some(old) = bar.take() {
                    old.finish_and_clear();
                }
            }
            JobEvent::Preloading { done, total, bytes } => {
                let bar = bar.get_or_insert_with(|| progress_bar(total, "preload"));
                bar.set_length(total);
                bar.set_position(done);
                bar.set_message(format!("preload {:.0} MB", bytes as f64 / 1e6));
            }
            // Its lines say the same for people.
            JobEvent::Moment { .. } => {}
        }
    }
}
