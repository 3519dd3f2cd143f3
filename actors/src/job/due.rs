//! What is due at each point of the step loop, decided without I/O: the steps of the next
//! call, then what follows a call and an epoch's end. The step loop (`steps.rs`) asks
//! [`Cadence`] and carries out what it says.
//!
//! Rules:
//! - A stop asked between calls ends the loop before the next call, with a checkpoint at
//!   the last completed step ([`last_checkpoint`]) unless the newest checkpoint is there
//!   or no step ran.
//! - A call runs at most `chunk` steps, and never past the next multiple of a nonzero
//!   `eval_every_steps` or `checkpoint_every_steps`, where one of them is due
//!   ([`steps_until`]).
//! - The next call's chunk is about a second of steps at the last call's pace, 1 to 1000
//!   ([`next_chunk`]): progress stays live, and a stop or a failure is noticed between
//!   calls.
//! - After a call that did not end the epoch: an evaluation at a multiple of
//!   `eval_every_steps` (when the job has val shards), then a checkpoint `step-N` at a
//!   multiple of `checkpoint_every_steps`. A call that ends the epoch leaves both to the
//!   epoch's end.
//! - At an epoch's end: an evaluation after the last epoch and after every
//!   `eval_every_epochs`-th (when the job has val shards); a checkpoint `epoch-E` (`E` the
//!   next epoch) after the last epoch and after every `checkpoint_every_epochs`-th; and an
//!   elastic job smaller than the world it started with looks for room for the ranks it
//!   lacks, except after the last epoch.
//!
//! A checkpoint at an epoch's start is named `epoch-E`, elsewhere `step-N` (`N` the global
//! step).

use super::JobSettings;

/// The job's cadence: its epochs, and how often it evaluates, checkpoints and grows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Cadence {
    pub(super) epochs: u64,
    pub(super) eval_every_steps: u64,
    pub(super) eval_every_epochs: u64,
    pub(super) checkpoint_every_steps: u64,
    pub(super) checkpoint_every_epochs: u64,
    /// Whether the job has val shards to evaluate on.
    pub(super) has_val: bool,
    /// The most ranks an elastic job grows back to; none: it does not grow.
    pub(super) max_world_size: Option<usize>,
}

/// What the loop does before its next call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BeforeCall {
    /// Stop, asked by this signal (or `cancel`).
    Stop(&'static str),
    /// Call every rank for this many steps.
    Train { max_steps: u64 },
}

/// Where a call left the loop: the place every rank reached, whether the epoch ended,
/// and how long the call took for how many steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Called {
    pub(super) epoch: u64,
    pub(super) global_step: u64,
    pub(super) step_in_epoch: u64,
    pub(super) epoch_done: bool,
    pub(super) seconds: f64,
    pub(super) steps: usize,
}

/// What follows a call, in this order: an evaluation, a checkpoint; then the next call's
/// chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct AfterCall {
    pub(super) evaluate: bool,
    pub(super) checkpoint: Option<Checkpoint>,
    pub(super) chunk: u64,
}

/// What an epoch's end brings, in this order: an evaluation, the epoch's record, a
/// checkpoint, a look for room to grow (for this many more ranks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct EpochEnd {
    pub(super) last: bool,
    pub(super) evaluate: bool,
    pub(super) checkpoint: Option<Checkpoint>,
    pub(super) look_for_room: Option<usize>,
}

/// A checkpoint to write: its name, and the place it holds (where the job continues).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Checkpoint {
    pub(super) name: String,
    pub(super) epoch: u64,
    pub(super) global_step: u64,
    pub(super) step_in_epoch: u64,
}

impl Checkpoint {
    /// At `step_in_epoch` of `epoch`: `epoch-E` at its start, else `step-N`.
    pub(super) fn at(epoch: u64, global_step: u64, step_in_epoch: u64) -> Checkpoint {
        if step_in_epoch == 0 {
            Checkpoint::epoch_start(epoch, global_step)
        } else {
            Checkpoint::step(epoch, global_step, step_in_epoch)
        }
    }

    /// `epoch-E`: the start of `epoch`, at `global_step`.
    pub(super) fn epoch_start(epoch: u64, global_step: u64) -> Checkpoint {
        Checkpoint {
            name: format!("epoch-{epoch:04}"),
            epoch,
            global_step,
            step_in_epoch: 0,
        }
    }

    /// `step-N`: `global_step`, step `step_in_epoch` of `epoch`.
    pub(super) fn step(epoch: u64, global_step: u64, step_in_epoch: u64) -> Checkpoint {
        Checkpoint {
            name: format!("step-{global_step:08}"),
            epoch,
            global_step,
            step_in_epoch,
        }
    }

    /// `(epoch, global_step, step_in_epoch)`.
    pub(super) fn place(&self) -> (u64, u64, u64) {
        (self.epoch, self.global_step, self.step_in_epoch)
    }
}

impl Cadence {
    /// The cadence of a job of `epochs` epochs run with `settings`.
    pub(super) fn new(
        settings: &JobSettings,
        epochs: u64,
        has_val: bool,
        max_world_size: Option<usize>,
    ) -> Cadence {
        Cadence {
            epochs,
            eval_every_steps: settings.eval_every_steps,
            eval_every_epochs: settings.eval_every_epochs,
            checkpoint_every_steps: settings.checkpoint_every_steps,
            checkpoint_every_epochs: settings.checkpoint_every_epochs,
            has_val,
            max_world_size,
        }
    }

    /// Before a call at `global_step`: stop when `stop` asks to, else train up to `chunk`
    /// steps, no further than the next step an evaluation or checkpoint is due at.
    pub(super) fn before_call(
        &self,
        stop: Option<&'static str>,
        global_step: u64,
        chunk: u64,
    ) -> BeforeCall {
        match stop {
            Some(signal) => BeforeCall::Stop(signal),
            None => BeforeCall::Train {
                max_steps: steps_until(
                    global_step,
                    chunk,
                    &[self.checkpoint_every_steps, self.eval_every_steps],
                ),
            },
        }
    }

    /// What follows the call `called`.
    pub(super) fn after_call(&self, called: &Called) -> AfterCall {
        let due = |every: u64| {
            !called.epoch_done && every > 0 && called.global_step.is_multiple_of(every)
        };
        AfterCall {
            evaluate: due(self.eval_every_steps) && self.has_val,
            checkpoint: due(self.checkpoint_every_steps)
                .then(|| Checkpoint::step(called.epoch, called.global_step, called.step_in_epoch)),
            chunk: next_chunk(called.seconds, called.steps),
        }
    }

    /// What the end of `epoch` brings, at `global_step`, for a world of `world_size` ranks.
    pub(super) fn epoch_end(&self, epoch: u64, global_step: u64, world_size: usize) -> EpochEnd {
        let last = epoch + 1 == self.epochs;
        let every = |n: u64| n > 0 && (epoch + 1).is_multiple_of(n);
        EpochEnd {
            last,
            evaluate: self.has_val && (last || every(self.eval_every_epochs)),
            checkpoint: (last || every(self.checkpoint_every_epochs))
                .then(|| Checkpoint::epoch_start(epoch + 1, global_step)),
            look_for_room: match self.max_world_size {
                Some(max) if !last && world_size < max => Some(max - world_size),
                _ => None,
            },
        }
    }
}

/// The checkpoint a job that ends early (a stop, a loss it cannot recover from) writes at
/// the last step every rank completed, unless no step ran or the newest checkpoint, at
/// `newest` (its global step), is there already.
pub(super) fn last_checkpoint(
    (epoch, global_step, step_in_epoch): (u64, u64, u64),
    newest: Option<u64>,
) -> Option<Checkpoint> {
    if global_step == 0 || newest == Some(global_step) {
        return None;
    }
    Some(Checkpoint::at(epoch, global_step, step_in_epoch))
}

/// The steps a call may run from `global_step`: at most `chunk`, and never past the next
/// multiple of any nonzero `every` (a checkpoint or an evaluation is due there).
pub(super) fn steps_until(global_step: u64, chunk: u64, every: &[u64]) -> u64 {
    every
        .iter()
        .filter(|&&e| e > 0)
        .map(|e| e - global_step % e)
        .fold(chunk, u64::min)
}

/// The steps of the next call: about a second's worth at the pace of a call that ran
/// `steps` steps in `seconds`, 1 to 1000.
pub(super) fn next_chunk(seconds: f64, steps: usize) -> u64 {
    let per_step = seconds / steps.max(1) as f64;
    ((1.0 / per_step.max(1e-4)) as u64).clamp(1, 1000)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cadence() -> Cadence {
        Cadence {
            epochs: 3,
            eval_every_steps: 0,
            eval_every_epochs: 0,
            checkpoint_every_steps: 0,
            checkpoint_every_epochs: 0,
            has_val: true,
            max_world_size: None,
        }
    }

    #[test]
    fn calls_stop_at_every_due_step() {
        let cases: [(u64, u64, &[u64], u64); 5] = [
            (0, 100, &[0, 0], 100),
            (0, 100, &[7, 0], 7),
            (7, 100, &[7, 5], 3),
            (9, 2, &[7, 5], 1),
            (14, 100, &[7, 10], 6),
        ];
        for (step, chunk, every, want) in cases {
            assert_eq!(
                steps_until(step, chunk, every),
                want,
                "{step} {chunk} {every:?}"
            );
        }
    }

    #[test]
    fn a_stop_comes_before_the_next_call_and_a_call_ends_where_something_is_due() {
        let every = Cadence {
            eval_every_steps: 5,
            checkpoint_every_steps: 7,
            ..cadence()
        };
        // (cadence, stop asked, global step, chunk, what comes next)
        let cases = [
            (cadence(), None, 0, 1, BeforeCall::Train { max_steps: 1 }),
            (
                cadence(),
                None,
                12,
                400,
                BeforeCall::Train { max_steps: 400 },
            ),
            (every, None, 0, 400, BeforeCall::Train { max_steps: 5 }),
            (every, None, 5, 400, BeforeCall::Train { max_steps: 2 }),
            (every, None, 7, 2, BeforeCall::Train { max_steps: 2 }),
            (every, Some("SIGINT"), 3, 400, BeforeCall::Stop("SIGINT")),
            (cadence(), Some("cancel"), 0, 1, BeforeCall::Stop("cancel")),
        ];
        for (i, (cadence, stop, step, chunk, want)) in cases.into_iter().enumerate() {
            assert_eq!(cadence.before_call(stop, step, chunk), want, "case {i}");
        }
    }

    #[test]
    fn after_a_call_evaluations_and_checkpoints_are_due_at_their_multiples_within_an_epoch() {
        let every = Cadence {
            eval_every_steps: 5,
            checkpoint_every_steps: 10,
            ..cadence()
        };
        let no_val = Cadence {
            has_val: false,
            ..every
        };
        let called = |global_step, step_in_epoch, epoch_done| Called {
            epoch: 1,
            global_step,
            step_in_epoch,
            epoch_done,
            seconds: 1.0,
            steps: 100,
        };
        let step = |n, s| Some(Checkpoint::step(1, n, s));
        // (cadence, the call, evaluate, checkpoint)
        let cases = [
            (cadence(), called(5, 5, false), false, None),
            (every, called(4, 4, false), false, None),
            (every, called(5, 5, false), true, None),
            (every, called(10, 3, false), true, step(10, 3)),
            (no_val, called(10, 3, false), false, step(10, 3)),
            // The call that ends an epoch leaves both to the epoch's end.
            (every, called(20, 8, true), false, None),
        ];
        for (i, (cadence, called, evaluate, checkpoint)) in cases.into_iter().enumerate() {
            let after = cadence.after_call(&called);
            assert_eq!(after.evaluate, evaluate, "case {i}");
            assert_eq!(after.checkpoint, checkpoint, "case {i}");
        }
    }

    #[test]
    fn the_next_chunk_is_about_a_second_of_steps() {
        // (seconds of the call, its steps, the next chunk)
        let cases = [
            (1.0, 10, 10),
            (0.5, 1, 2),
            (3.0, 1, 1),
            (0.0, 1, 1000),
            (1e-6, 5, 1000),
            (2.0, 0, 1),
            (0.25, 64, 256),
        ];
        for (seconds, steps, want) in cases {
            assert_eq!(
                next_chunk(seconds, steps),
                want,
                "{seconds} s, {steps} steps"
            );
        }
    }

    #[test]
    fn an_epochs_end_evaluates_checkpoints_and_looks_for_room_as_its_cadence_says() {
        let every_2 = Cadence {
            eval_every_epochs: 2,
            checkpoint_every_epochs: 2,
            ..cadence()
        };
        let elastic = Cadence {
            max_world_size: Some(3),
            ..cadence()
        };
        let no_val = Cadence {
            has_val: false,
            ..cadence()
        };
        let epoch = |e, step| Some(Checkpoint::epoch_start(e, step));
        // (cadence, epoch, global step, world size, evaluate, checkpoint, look for room)
        let cases = [
            (cadence(), 0, 10, 2, false, None, None),
            (cadence(), 2, 30, 2, true, epoch(3, 30), None),
            (no_val, 2, 30, 2, false, epoch(3, 30), None),
            (every_2, 0, 10, 2, false, None, None),
            (every_2, 1, 20, 2, true, epoch(2, 20), None),
            (elastic, 0, 10, 2, false, None, Some(1)),
            (elastic, 1, 20, 1, false, None, Some(2)),
            (elastic, 1, 20, 3, false, None, None),
            // No growth after the last epoch.
            (elastic, 2, 30, 1, true, epoch(3, 30), None),
        ];
        for (i, (cadence, e, step, world_size, evaluate, checkpoint, room)) in
            cases.into_iter().enumerate()
        {
            let end = cadence.epoch_end(e, step, world_size);
            assert_eq!(end.last, e == 2, "case {i}");
            assert_eq!(end.evaluate, evaluate, "case {i}");
            assert_eq!(end.checkpoint, checkpoint, "case {i}");
            assert_eq!(end.look_for_room, room, "case {i}");
        }
    }

    #[test]
    fn a_job_that_ends_early_checkpoints_its_last_step_once() {
        // (epoch, global step, step in epoch), the newest checkpoint's step, the name due
        let cases = [
            ((0, 0, 0), None, None),
            ((0, 7, 7), None, Some("step-00000007")),
            ((1, 10, 0), None, Some("epoch-0001")),
            ((1, 10, 0), Some(10), None),
            ((1, 12, 2), Some(10), Some("step-00000012")),
        ];
        for (at, newest, want) in cases {
            let due = last_checkpoint(at, newest);
            assert_eq!(
                due.as_ref().map(|c| c.name.as_str()),
                want,
                "{at:?} {newest:?}"
            );
            if let Some(due) = due {
                assert_eq!(due.place(), at);
            }
        }
    }
}
