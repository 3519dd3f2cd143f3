//! Why a job ended without finishing, and where it stood then. Every message names the
//! rank, node, file or key it is about and says its cause once (no variant also reports
//! a `source`), so a caller prints it whole with `{}`.
//!
//! A leaf of the job's folder: the failures other files carry up ([`RankCallError`],
//! [`RankFailure`]) and the job's [`Progress`] are defined here, so that every file can
//! name them without importing the code that makes them.

use std::path::{Path, PathBuf};

use runtime::{ActorCallError, FailureOrigin};
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The job cannot start or go on as it was asked to; the text says why and what to do.
    #[error("{0}")]
    Refused(String),
    /// A file of the run folder could not be written or read.
    #[error("{what}: {error}")]
    Io { what: String, error: std::io::Error },
    /// The cluster did not answer a request of the job.
    #[error("{what}: {error}")]
    Cluster {
        what: String,
        error: runtime::DaemonError,
    },
    /// A checkpoint could not be read.
    #[error(transparent)]
    Checkpoint(#[from] crate::train::checkpoint::CheckpointError),
    /// A call to a rank failed.
    #[error("{0}")]
    Call(Box<RankCallError>),
    /// The head's events say a rank failed or its node was lost.
    #[error("{0}")]
    RankFailed(RankFailure),
    /// The job was asked to stop and did, at a checkpoint of its last step or saying why
    /// not.
    #[error("{0}")]
    Interrupted(Box<Interrupted>),
    /// The head went away: the job cannot go on.
    #[error("{0}")]
    HeadLost(Box<HeadLost>),
    /// The head went away, found after a failure of the step loop (the text says how, and
    /// what the trainers saw); the job makes it a [`JobError::HeadLost`] with its progress.
    #[error("{0}")]
    HeadGone(String),
    /// What the job was doing when `cause` happened.
    #[error("{what}: {cause}")]
    While { what: String, cause: Box<JobError> },
}

impl JobError {
    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> JobError {
        let what = what.into();
        move |error| JobError::Io { what, error }
    }

    pub(crate) fn cluster(
        what: impl Into<String>,
    ) -> impl FnOnce(runtime::DaemonError) -> JobError {
        let what = what.into();
        move |error| JobError::Cluster { what, error }
    }

    /// This error, said to have happened while doing `what`.
    pub(crate) fn during(self, what: impl Into<String>) -> JobError {
        JobError::While {
            what: what.into(),
            cause: Box::new(self),
        }
    }

    /// The stop this error is, under any context.
    pub fn interrupted(&self) -> Option<&Interrupted> {
        match self {
            JobError::Interrupted(interrupted) => Some(interrupted),
            JobError::While { cause, .. } => cause.interrupted(),
            _ => None,
        }
    }

    /// The loss of the head this error is, under any context.
    pub fn head_lost(&self) -> Option<&HeadLost> {
        match self {
            JobError::HeadLost(lost) => Some(lost),
            JobError::While { cause, .. } => cause.head_lost(),
            _ => None,
        }
    }

    /// Whether this error is the loss of the head, found by the watcher or after a failed
    /// step, before the job's progress is attached to it.
    pub(crate) fn is_head_gone(&self) -> bool {
        match self {
            JobError::RankFailed(failure) => failure.is_head(),
            JobError::HeadGone(_) => true,
            _ => false,
        }
    }

    /// Where the failure behind this error started, when a rank failed: a rank whose
    /// ring peer went away or stopped answering fails [`FailureOrigin::Elsewhere`].
    pub(crate) fn failure_origin(&self) -> Option<FailureOrigin> {
        match self {
            JobError::Call(call) => call.error.failure_origin(),
            JobError::RankFailed(failure) => Some(failure.origin),
            JobError::While { cause, .. } => cause.failure_origin(),
            _ => None,
        }
    }
}

/// Context for results whose error is a [`JobError`].
pub(crate) trait During<T> {
    fn during(self, what: impl FnOnce() -> String) -> Result<T, JobError>;
}

impl<T> During<T> for Result<T, JobError> {
    fn during(self, what: impl FnOnce() -> String) -> Result<T, JobError> {
        self.map_err(|error| error.during(what()))
    }
}

/// A job stopped on request (a signal's name, or `cancel`), and where it stands: its run
/// folder and newest checkpoint, and why no checkpoint at its last step was written when
/// none was.
#[derive(Debug, Clone)]
pub struct Interrupted {
    pub by: &'static str,
    pub progress: Progress,
    /// Why the job could not stop at a checkpoint of its last step.
    pub late: Option<String>,
}

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.summary())
    }
}

impl Interrupted {
    pub fn in_time(by: &'static str, progress: Progress) -> Self {
        Interrupted {
            by,
            progress,
            late: None,
        }
    }

    pub fn late(by: &'static str, progress: Progress, why: String) -> Self {
        Interrupted {
            by,
            progress,
            late: Some(why),
        }
    }

    /// The run folder to continue with `--resume`, when there is a checkpoint.
    pub fn resumable(&self) -> Option<&PathBuf> {
        self.progress.checkpoint.as_ref()?;
        self.progress.run_dir.as_ref()
    }

    /// One paragraph: what happened, and the checkpoint to continue from.
    pub fn summary(&self) -> String {
        let mut text = format!("interrupted by {}: every trainer was stopped", self.by);
        if let Some(why) = &self.late {
            text.push_str(&format!("; no checkpoint at the last step ({why})"));
        }
        match (&self.progress.checkpoint, &self.progress.run_dir) {
            (Some(saved), Some(run)) => text.push_str(&format!(
                "\n{} checkpoint: {} (epoch {}, step {} of the epoch, global step {}{}); \
                 continue with {}",
                if self.late.is_some() { "last" } else { "saved" },
                saved.dir.display(),
                saved.epoch,
                saved.step_in_epoch,
                saved.global_step,
                // What a scheduler's grace period after SIGTERM must leave time for.
                saved
                    .seconds
                    .map(|s| format!("; written in {s:.1} s"))
                    .unwrap_or_default(),
                saved.resume_hint(run)
            )),
            _ => {
                text.push_str("\nno checkpoint was written: nothing to resume; start the job again")
            }
        }
        text
    }
}

/// The head went away during the job: why, and where the job stands.
#[derive(Debug, Clone)]
pub struct HeadLost {
    /// Begins with "lost the head node at <address>".
    pub message: String,
    pub progress: Progress,
}

impl std::fmt::Display for HeadLost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}\nthe job cannot continue without the head, which places and supervises its \
             trainers; they end: those on the head's machine with its daemon (or, if the \
             head lives on, when it sees the job gone), those on other nodes when their \
             node has been cut off from the head for the dead window \
             (cluster.dead_after_ms)",
            self.message
        )?;
        match (&self.progress.checkpoint, &self.progress.run_dir) {
            (Some(saved), Some(run)) => write!(
                f,
                "\nlast checkpoint: {} (epoch {}, step {} of the epoch, global step {}); once \
                 the head is back (`imgrun start --head`, and the nodes joined), continue \
                 with {}",
                saved.dir.display(),
                saved.epoch,
                saved.step_in_epoch,
                saved.global_step,
                saved.resume_hint(run)
            ),
            _ => f.write_str(
                "\nno checkpoint was written: nothing to resume; start the job again once the \
                 head is back",
            ),
        }
    }
}

/// A checkpoint this job wrote or resumed from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Saved {
    pub dir: PathBuf,
    pub epoch: u64,
    pub global_step: u64,
    pub step_in_epoch: u64,
    /// How long writing it took, from the request to rank 0's answer (none for the
    /// checkpoint a job resumed from).
    #[serde(default)]
    pub seconds: Option<f64>,
    /// Its run in the checkpoint store, when it was copied there: what `--resume` takes
    /// on any machine (`s3://bucket/prefix/RUN`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store_run: Option<String>,
}

impl Saved {
    /// `--resume RUN`, and the store's run where it is there too.
    fn resume_hint(&self, run: &Path) -> String {
        match &self.store_run {
            Some(url) => format!(
                "--resume {} (or, on any machine, --resume {url})",
                run.display()
            ),
            None => format!("--resume {}", run.display()),
        }
    }
}

/// Where a job stands, shared with the code that handles signals: what it needs to say
/// after an interrupt, even when the step loop did not get to answer.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Progress {
    pub run_dir: Option<PathBuf>,
    /// The newest checkpoint.
    pub checkpoint: Option<Saved>,
}

/// A call to a rank that failed: the runtime's error, kept typed so that the job can ask
/// where a failure started ([`JobError::failure_origin`]).
#[derive(Debug, thiserror::Error)]
#[error("{rank}: {method}: {error}")]
pub struct RankCallError {
    pub rank: String,
    pub method: &'static str,
    pub error: ActorCallError,
}

/// A failure the head's events tell of (`watch.rs`): what to tell the user, and where it
/// started.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct RankFailure {
    /// For people only: no decision reads it.
    pub message: String,
    pub origin: FailureOrigin,
    /// The rank it is about (none: the head, whose connection ended).
    pub rank: Option<u32>,
}

impl RankFailure {
    /// Whether the rank is gone with its process or node, not by its own error.
    pub fn is_loss(&self) -> bool {
        self.origin.is_loss()
    }

    /// Whether this is the loss of the head rather than of a rank.
    pub fn is_head(&self) -> bool {
        self.rank.is_none()
    }
}
