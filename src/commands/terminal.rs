//! A job's events on this terminal: lines to stdout (warnings to stderr) and a progress
//! bar per epoch, the lines printed above the bar; for a job run here, its lines also go
//! to the run folder's `job.log`, as a cluster's coordinator keeps it.

use std::sync::Mutex;
use std::time::SystemTime;

use actors::job::{JobError, JobEvent, JobOutput, JobSummary, Journal, Level, job_end};
use indicatif::ProgressBar;

use crate::commands::progress_bar;

/// Renders a job's events as they come.
#[derive(Default)]
pub(crate) struct Terminal {
    bar: Mutex<Option<ProgressBar>>,
    /// The job's log, for a job run in this process.
    journal: Option<Mutex<Journal>>,
}

impl Terminal {
    /// A terminal that also keeps the job's `job.log` in its run folder.
    pub(crate) fn keeping_log() -> Self {
        Terminal {
            bar: Mutex::default(),
            journal: Some(Mutex::new(Journal::new())),
        }
    }

    /// Writes how the job ended to its log, when it keeps one.
    pub(crate) fn ended(&self, outcome: &Result<JobSummary, JobError>) {
        if let Some(journal) = &self.journal {
            let (state, line) = job_end(outcome);
            let mut journal = journal.lock().unwrap_or_else(|e| e.into_inner());
            journal.ended(SystemTime::now(), state, Some(&line));
        }
    }

    /// Clears the progress bar, if one is shown.
    pub(crate) fn finish(&self) {
        if let Some(bar) = self.bar.lock().unwrap_or_else(|e| e.into_inner()).take() {
            bar.finish_and_clear();
        }
    }
}

impl JobOutput for Terminal {
    fn run_folder(&self, dir: &std::path::Path) {
        if let Some(journal) = &self.journal {
            let mut journal = journal.lock().unwrap_or_else(|e| e.into_inner());
            if let Err(error) = journal.open(dir) {
                tracing::warn!(%error, dir = %dir.display(), "opening the job's log; it is not kept");
            }
        }
    }

    fn event(&self, event: JobEvent) {
        let mut bar = self.bar.lock().unwrap_or_else(|e| e.into_inner());
        match event {
            JobEvent::Line { level, text } => {
                if let Some(journal) = &self.journal {
                    let mut journal = journal.lock().unwrap_or_else(|e| e.into_inner());
                    journal.line(SystemTime::now(), &text);
                }
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
