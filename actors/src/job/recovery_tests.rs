//! Tests of the job's recovery: transcripts of what the driver told it and the line each
//! answer reads as.

use super::*;

/// An elastic job that survives up to 2 losses and goes on down to 2 ranks.
const ELASTIC: Option<Elastic> = Some(Elastic {
    min_world: 2,
    max_failures: 2,
});

/// Runs `steps` on the recovery of a job of `world_size` ranks and checks the line of
/// each answer: the action, then the stage, the world size and the losses so far.
fn run(name: &str, elastic: Option<Elastic>, world_size: u32, steps: &[(Event, &str)]) {
    let mut recovery = Recovery::new(elastic, world_size);
    for (i, (event, want)) in steps.iter().enumerate() {
        let action = recovery.on(*event);
        let got = format!(
            "{}; {:?}, world size {}, failures {}",
            match action {
                Ok(action) => show(action),
                Err(stray) => format!("stray: {:?} while {:?}", stray.event, stray.stage),
            },
            recovery.stage,
            recovery.world_size,
            recovery.failures
        );
        assert_eq!(got, *want, "{name}: step {i} {event:?}");
    }
}

fn show(action: Action) -> String {
    match action {
        Action::Train => "train".to_string(),
        Action::FindLosses => "find losses".to_string(),
        Action::Regroup => "regroup".to_string(),
        Action::Grow => "grow".to_string(),
        Action::Wire => "wire".to_string(),
        Action::Finish => "finish".to_string(),
        Action::Explain => "explain".to_string(),
        Action::GiveUp(GiveUp::PastMaxFailures {
            failures,
            max_failures,
        }) => format!("give up: {failures} losses, max {max_failures}"),
        Action::GiveUp(GiveUp::BelowMinWorld { left, min_world }) => {
            format!("give up: {left} left, min {min_world}")
        }
        Action::GiveUp(GiveUp::ChangeFailed) => "give up: the change failed".to_string(),
    }
}

#[test]
fn a_job_that_is_not_elastic_finishes_or_explains_its_failure() {
    run(
        "done",
        None,
        3,
        &[(Event::LoopDone, "finish; Ended, world size 3, failures 0")],
    );
    run(
        "failed",
        None,
        3,
        &[(
            Event::LoopFailed,
            "explain; Ended, world size 3, failures 0",
        )],
    );
}

#[test]
fn an_elastic_job_shrinks_after_a_loss_and_trains_on() {
    run(
        "one loss",
        ELASTIC,
        4,
        &[
            (
                Event::LoopFailed,
                "find losses; FindingLosses, world size 4, failures 0",
            ),
            (
                Event::Lost {
                    lost: 1,
                    survivors: 3,
                },
                "regroup; Regrouping, world size 4, failures 1",
            ),
            (
                Event::Changed { world_size: 3 },
                "wire; Wiring { grown: false }, world size 3, failures 1",
            ),
            (Event::Wired, "train; Training, world size 3, failures 1"),
            (Event::LoopDone, "finish; Ended, world size 3, failures 1"),
        ],
    );
}

#[test]
fn a_failure_that_lost_no_rank_is_explained() {
    run(
        "no loss",
        ELASTIC,
        3,
        &[
            (
                Event::LoopFailed,
                "find losses; FindingLosses, world size 3, failures 0",
            ),
            (Event::NoLoss, "explain; Ended, world size 3, failures 0"),
        ],
    );
}

#[test]
fn losses_past_the_limits_give_up() {
    run(
        "past max_failures over two losses",
        ELASTIC,
        5,
        &[
            (
                Event::LoopFailed,
                "find losses; FindingLosses, world size 5, failures 0",
            ),
            (
                Event::Lost {
                    lost: 2,
                    survivors: 3,
                },
                "regroup; Regrouping, world size 5, failures 2",
            ),
            (
                Event::Changed { world_size: 3 },
                "wire; Wiring { grown: false }, world size 3, failures 2",
            ),
            (Event::Wired, "train; Training, world size 3, failures 2"),
            (
                Event::LoopFailed,
                "find losses; FindingLosses, world size 3, failures 2",
            ),
            (
                Event::Lost {
                    lost: 1,
                    survivors: 2,
                },
                "give up: 3 losses, max 2; Ended, world size 3, failures 3",
            ),
        ],
    );
    run(
        "below min_world",
        ELASTIC,
        3,
        &[
            (
                Event::LoopFailed,
                "find losses; FindingLosses, world size 3, failures 0",
            ),
            (
                Event::Lost {
                    lost: 2,
                    survivors: 1,
                },
                "give up: 1 left, min 2; Ended, world size 3, failures 2",
            ),
        ],
    );
}

#[test]
fn a_loss_while_the_smaller_ring_forms_is_found_like_any_other() {
    run(
        "a second loss while wiring",
        ELASTIC,
        4,
        &[
            (
                Event::LoopFailed,
                "find losses; FindingLosses, world size 4, failures 0",
            ),
            (
                Event::Lost {
                    lost: 1,
                    survivors: 3,
                },
                "regroup; Regrouping, world size 4, failures 1",
            ),
            (
                Event::Changed { world_size: 3 },
                "wire; Wiring { grown: false }, world size 3, failures 1",
            ),
            (
                Event::WireFailed,
                "find losses; FindingLosses, world size 3, failures 1",
            ),
            (
                Event::Lost {
                    lost: 1,
                    survivors: 2,
                },
                "regroup; Regrouping, world size 3, failures 2",
            ),
            (
                Event::Changed { world_size: 2 },
                "wire; Wiring { grown: false }, world size 2, failures 2",
            ),
            (Event::Wired, "train; Training, world size 2, failures 2"),
        ],
    );
}

#[test]
fn a_failed_regroup_gives_up_with_a_checkpoint() {
    run(
        "regroup failed",
        ELASTIC,
        3,
        &[
            (
                Event::LoopFailed,
                "find losses; FindingLosses, world size 3, failures 0",
            ),
            (
                Event::Lost {
                    lost: 1,
                    survivors: 2,
                },
                "regroup; Regrouping, world size 3, failures 1",
            ),
            (
                Event::ChangeFailed,
                "give up: the change failed; Ended, world size 3, failures 1",
            ),
        ],
    );
}

#[test]
fn an_elastic_job_grows_into_room_and_gives_up_when_growing_fails() {
    run(
        "grows back",
        ELASTIC,
        2,
        &[
            (Event::RoomFound, "grow; Growing, world size 2, failures 0"),
            (
                Event::Changed { world_size: 3 },
                "wire; Wiring { grown: true }, world size 3, failures 0",
            ),
            (Event::Wired, "train; Training, world size 3, failures 0"),
            (Event::LoopDone, "finish; Ended, world size 3, failures 0"),
        ],
    );
    run(
        "growth failed",
        ELASTIC,
        2,
        &[
            (Event::RoomFound, "grow; Growing, world size 2, failures 0"),
            (
                Event::ChangeFailed,
                "give up: the change failed; Ended, world size 2, failures 0",
            ),
        ],
    );
    run(
        "the grown ring failed",
        ELASTIC,
        2,
        &[
            (Event::RoomFound, "grow; Growing, world size 2, failures 0"),
            (
                Event::Changed { world_size: 4 },
                "wire; Wiring { grown: true }, world size 4, failures 0",
            ),
            (
                Event::WireFailed,
                "give up: the change failed; Ended, world size 4, failures 0",
            ),
        ],
    );
}

#[test]
fn an_event_out_of_turn_ends_the_job() {
    run(
        "wired while training",
        ELASTIC,
        3,
        &[(
            Event::Wired,
            "stray: Wired while Training; Ended, world size 3, failures 0",
        )],
    );
    run(
        "anything after the end",
        None,
        3,
        &[
            (
                Event::LoopFailed,
                "explain; Ended, world size 3, failures 0",
            ),
            (
                Event::LoopDone,
                "stray: LoopDone while Ended; Ended, world size 3, failures 0",
            ),
        ],
    );
}
