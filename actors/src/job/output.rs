//! What a job tells whoever follows it: lines for people and the progress of its epochs,
//! as typed events that a terminal, a log or a remote follower renders.

use serde::{Deserialize, Serialize};

/// How a line matters: information belongs with the job's output (stdout), a warning
/// with its diagnostics (stderr).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Level {
    Info,
    Warning,
}

/// Where a job is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Running,
    /// Asked to stop; ending its step in flight and saving a checkpoint.
    Stopping,
    Succeeded,
    Failed,
    Cancelled,
}

impl JobState {
    pub fn name(self) -> &'static str {
        match self {
            JobState::Running => "running",
            JobState::Stopping => "stopping",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }

    pub fn is_final(self) -> bool {
        matches!(
            self,
            JobState::Succeeded | JobState::Failed | JobState::Cancelled
        )
    }
}

/// One thing a job says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum JobEvent {
    /// A line for people (a warning's text begins with `warning:`).
    Line { level: Level, text: String },
    /// An epoch's steps begin (or resume at `position`).
    EpochStarted {
        epoch: u64,
        steps: u64,
        position: u64,
    },
    /// Steps of the epoch ended: where it stands, the last step's loss and the rate.
    Stepped {
        epoch: u64,
        position: u64,
        loss: f32,
        images_per_s: f64,
        /// The last step's learning rate, wall time (its slowest rank's), and the ranks'
        /// mean data wait and allreduce, in seconds.
        lr: f64,
        step_s: f64,
        data_wait_s: f64,
        allreduce_s: f64,
    },
    /// The epoch's steps are over (its summary line follows as a `Line`).
    EpochEnded { epoch: u64 },
    /// Shards copied to node-local disk so far (`data.preload`), of `total` on all
    /// nodes, and bytes copied.
    Preloading { done: u64, total: u64, bytes: u64 },
    /// The preload is over (its summary follows as a `Line`).
    Preloaded,
    /// A turn in the job's life (its line, if it has one, is a `Line` of its own).
    Moment { moment: Moment },
}

/// A turn in a job's life, typed: what the job page's timeline and `imgrun status
/// --json` list, where the job's lines say the same for people.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Moment {
    /// The ranks' ring formed for the first time (or again, on a resume).
    Started { world: u32 },
    /// Ranks were found lost, by their old numbers, with why.
    Lost { ranks: Vec<u32>, cause: String },
    /// The job goes on with `world` ranks, of `from_world`, from global step `step`: fewer
    /// after a loss, more after new ranks joined.
    Regrouped {
        from_world: u32,
        world: u32,
        epoch: u64,
        step: u64,
        recovery_s: f64,
    },
    /// A checkpoint was saved, in `seconds`.
    Checkpoint {
        epoch: u64,
        global_step: u64,
        seconds: f64,
    },
    /// A checkpoint could not be saved.
    CheckpointFailed { global_step: u64, cause: String },
    /// The job ended: succeeded, failed or cancelled, and how.
    Ended {
        state: JobState,
        outcome: Option<String>,
    },
}

/// Where a job's events go. Called from the job's tasks; an implementation must not
/// block for long.
pub trait JobOutput: Send + Sync {
    fn event(&self, event: JobEvent);

    /// The job's run folder is `dir` (made, or found again by a resume): called once,
    /// before the job says its plan. An output that keeps a log there opens it now.
    fn run_folder(&self, _dir: &std::path::Path) {}

    /// Says `text` as information.
    fn info(&self, text: String) {
        self.event(JobEvent::Line {
            level: Level::Info,
            text,
        });
    }

    /// Says `text` as a warning; it is prefixed with `warning: `.
    fn warn(&self, text: String) {
        self.event(JobEvent::Line {
            level: Level::Warning,
            text: format!("warning: {text}"),
        });
    }
}
