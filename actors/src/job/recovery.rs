//! What the job does when its step loop ends, decided without I/O: finish, explain a
//! failure, or (an elastic job, `train.elastic`) shrink after a loss and grow when room
//! appears. The driver (`driver.rs`) tells a [`Recovery`] what happened, as [`Event`]s,
//! and carries out the [`Action`] it returns; `elastic.rs` does the calls.
//!
//! Rules:
//! - The step loop finished the last epoch: the job finishes.
//! - The step loop failed: a job that is not elastic ends with the failure, explained
//!   (the head's loss, or the rank whose failure came first). An elastic one finds its
//!   losses first; a failure that lost no rank (a refusal, a timeout, the head gone, a
//!   stop) ends it the same way.
//! - Losses are counted over the job's life. Past `train.max_failures`, or with fewer
//!   survivors than `train.min_world`, the job gives up, with a checkpoint where the
//!   survivors stand; otherwise the survivors regroup as a smaller world and wire their
//!   ring.
//! - The step loop found room at an epoch's end: the world grows onto it and wires its
//!   ring.
//! - A regroup or a growth that fails, or a grown world whose ring does not form, gives
//!   up with a checkpoint where the ranks that hold the model stand. A regrouped world
//!   whose ring does not form lost another rank while it formed: its losses are found as
//!   after any failure.
//! - A ring that formed: the step loop runs on, from where the ranks stand.
//! - An event the stage does not expect (a driver that did something else than it was
//!   told) ends the job: [`Recovery::on`] answers with a [`Stray`].

use super::Elastic;

/// What the driver tells the recovery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Event {
    /// The step loop finished the job's last epoch.
    LoopDone,
    /// The step loop ended at an epoch's end, having found room for more ranks.
    RoomFound,
    /// The step loop failed.
    LoopFailed,
    /// The failure lost no rank the job can go on without.
    NoLoss,
    /// `lost` ranks are lost, and `survivors` rolled back.
    Lost { lost: u32, survivors: u32 },
    /// The regroup or the growth asked for is done: the world has `world_size` ranks.
    Changed { world_size: u32 },
    /// The regroup or the growth asked for failed.
    ChangeFailed,
    /// The new world's ring formed.
    Wired,
    /// The new world's ring did not form.
    WireFailed,
}

/// What the driver does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Action {
    /// Run the step loop on (the first time, or from where a new world stands).
    Train,
    /// Find the ranks the failure lost, and roll the others back.
    FindLosses,
    /// Regroup the survivors as a smaller world.
    Regroup,
    /// Grow onto the room the step loop found.
    Grow,
    /// Wire the new world's ring.
    Wire,
    /// The job is done: check its replicas.
    Finish,
    /// End with the failure, explained.
    Explain,
    /// End with a checkpoint where the ranks that hold the model stand, for this reason.
    GiveUp(GiveUp),
}

/// An event the recovery did not expect in its stage: the job ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the job's recovery was told of {event:?} while {stage:?}, out of turn")]
pub(super) struct Stray {
    pub(super) event: Event,
    pub(super) stage: Stage,
}

/// Why an elastic job gives up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum GiveUp {
    /// `failures` losses, past `train.max_failures`.
    PastMaxFailures { failures: u32, max_failures: u32 },
    /// `left` ranks, fewer than `train.min_world`.
    BelowMinWorld { left: u32, min_world: u32 },
    /// The regroup, the growth or the grown world's ring failed (the failure says how).
    ChangeFailed,
}

/// What the job is doing, as far as its recovery goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stage {
    Training,
    FindingLosses,
    Regrouping,
    Growing,
    /// Wiring the ring of a world that shrank (`false`) or grew (`true`).
    Wiring {
        grown: bool,
    },
    Ended,
}

/// The recovery of one job: its elastic settings, the losses so far, the size of its
/// world and what it is doing.
#[derive(Debug, Clone)]
pub(super) struct Recovery {
    elastic: Option<Elastic>,
    failures: u32,
    world_size: u32,
    stage: Stage,
}

impl Recovery {
    /// A job of `world_size` ranks, elastic or not, about to run its step loop.
    pub(super) fn new(elastic: Option<Elastic>, world_size: u32) -> Recovery {
        Recovery {
            elastic,
            failures: 0,
            world_size,
            stage: Stage::Training,
        }
    }

    /// What to do after `event`, or the [`Stray`] it is in this stage (the recovery has
    /// ended then).
    pub(super) fn on(&mut self, event: Event) -> Result<Action, Stray> {
        let stage = self.stage;
        match self.next(event) {
            Some((next, action)) => {
                self.stage = next;
                Ok(action)
            }
            None => {
                self.stage = Stage::Ended;
                Err(Stray { event, stage })
            }
        }
    }

    fn next(&mut self, event: Event) -> Option<(Stage, Action)> {
        use Action as A;
        use Event as E;
        use Stage as S;
        Some(match (self.stage, event) {
            (S::Training, E::LoopDone) => (S::Ended, A::Finish),
            (S::Training, E::RoomFound) => (S::Growing, A::Grow),
            (S::Training, E::LoopFailed) if self.elastic.is_some() => {
                (S::FindingLosses, A::FindLosses)
            }
            (S::Training, E::LoopFailed) | (S::FindingLosses, E::NoLoss) => (S::Ended, A::Explain),
            (S::FindingLosses, E::Lost { lost, survivors }) => self.lost(lost, survivors)?,
            (S::Regrouping, E::Changed { world_size }) => {
                self.world_size = world_size;
                (S::Wiring { grown: false }, A::Wire)
            }
            (S::Growing, E::Changed { world_size }) => {
                self.world_size = world_size;
                (S::Wiring { grown: true }, A::Wire)
            }
            (S::Regrouping | S::Growing, E::ChangeFailed)
            | (S::Wiring { grown: true }, E::WireFailed) => {
                (S::Ended, A::GiveUp(GiveUp::ChangeFailed))
            }
            (S::Wiring { .. }, E::Wired) => (S::Training, A::Train),
            (S::Wiring { grown: false }, E::WireFailed) => (S::FindingLosses, A::FindLosses),
            _ => return None,
        })
    }

    /// `lost` more ranks lost, `survivors` left: regroup, or give up past the job's limits
    /// (none: a job that is not elastic has no losses to go on from).
    fn lost(&mut self, lost: u32, survivors: u32) -> Option<(Stage, Action)> {
        let elastic = self.elastic?;
        self.failures += lost;
        let give_up = if self.failures > elastic.max_failures {
            GiveUp::PastMaxFailures {
                failures: self.failures,
                max_failures: elastic.max_failures,
            }
        } else if survivors < elastic.min_world {
            GiveUp::BelowMinWorld {
                left: survivors,
                min_world: elastic.min_world,
            }
        } else {
            return Some((Stage::Regrouping, Action::Regroup));
        };
        Some((Stage::Ended, Action::GiveUp(give_up)))
    }
}

#[cfg(test)]
#[path = "recovery_tests.rs"]
mod tests;
