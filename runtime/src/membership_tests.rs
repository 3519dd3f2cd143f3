//! Tests of membership: transcripts of calls with made-up times and what each returned.

use super::*;

/// One call in a transcript. Nodes and sessions are plain numbers to keep tables short.
#[derive(Debug, Clone, Copy)]
enum Step {
    /// `join(at, key)`; the info is `key@at`.
    Join(u64, &'static str),
    /// `heartbeat(at, node, session)`.
    Beat(u64, u64, u64),
    /// `leave(at, node, session)`.
    Leave(u64, u64, u64),
    /// `tick(at)`.
    Tick(u64),
    /// `next_deadline()`.
    Deadline,
    /// `nodes()`, one line each.
    Nodes,
}

/// Runs `steps` on a membership with the default window (500 ms beats, dead after
/// 3000 ms, suspect after 1500 ms) and checks what each step returned.
fn run(name: &str, steps: &[(Step, &[&str])]) {
    let mut membership = Membership::new(MembershipConfig::default());
    for (i, (step, want)) in steps.iter().enumerate() {
        let got = apply(&mut membership, *step);
        assert_eq!(got, *want, "{name}: step {i} {step:?}");
    }
}

fn apply(membership: &mut Membership<String>, step: Step) -> Vec<String> {
    match step {
        Step::Join(at, key) => {
            let joined = membership.join(at, key, format!("{key}@{at}"));
            let mut out = vec![format!("joined n{} s{}", joined.node, joined.session)];
            out.extend(joined.ended.iter().map(show));
            out
        }
        Step::Beat(at, node, session) => {
            match membership.heartbeat(at, NodeId(node), SessionId(session)) {
                Ok(event) => event.iter().map(show).collect(),
                Err(error) => vec![show_error(&error)],
            }
        }
        Step::Leave(at, node, session) => {
            match membership.leave(at, NodeId(node), SessionId(session)) {
                Ok(event) => vec![show(&event)],
                Err(error) => vec![show_error(&error)],
            }
        }
        Step::Tick(at) => membership.tick(at).iter().map(show).collect(),
        Step::Deadline => vec![match membership.next_deadline() {
            Some(at) => format!("deadline {at}"),
            None => "deadline none".to_string(),
        }],
        Step::Nodes => membership
            .nodes()
            .map(|m| {
                format!(
                    "n{} s{} {} joined {} beat {} info {}",
                    m.id(),
                    m.session(),
                    m.state(),
                    m.joined_at_ms(),
                    m.last_heartbeat_ms(),
                    m.info()
                )
            })
            .collect(),
    }
}

fn show(event: &MembershipEvent) -> String {
    match event {
        MembershipEvent::NodeSuspect {
            node,
            session,
            silent_for_ms,
            ..
        } => format!("suspect n{node} s{session} after {silent_for_ms}"),
        MembershipEvent::NodeRecovered {
            node,
            session,
            silent_for_ms,
        } => format!("recovered n{node} s{session} after {silent_for_ms}"),
        MembershipEvent::NodeDead {
            node,
            session,
            last_heartbeat_ms,
            silent_for_ms,
        } => format!("dead n{node} s{session} beat {last_heartbeat_ms} after {silent_for_ms}"),
        MembershipEvent::NodeReplaced {
            node,
            old_session,
            new_session,
        } => format!("replaced n{node} s{old_session} by s{new_session}"),
        MembershipEvent::NodeLeft { node, session } => format!("left n{node} s{session}"),
    }
}

fn show_error(error: &MembershipError) -> String {
    match error {
        MembershipError::UnknownNode { .. } => "err unknown".to_string(),
        MembershipError::StaleSession { current, .. } => format!("err stale, current s{current}"),
        MembershipError::SessionEnded { state, .. } => format!("err {state}"),
        MembershipError::Expired { silent_for_ms, .. } => format!("err expired {silent_for_ms}"),
        MembershipError::BadConfig { .. } => "err config".to_string(),
    }
}

use Step::{Beat, Deadline, Join, Leave, Nodes, Tick};

#[test]
fn heartbeats_keep_a_node_alive() {
    let mut steps: Vec<(Step, &[&str])> = vec![(Join(0, "a"), &["joined n1 s1"])];
    for at in (500..=10_000).step_by(500) {
        steps.push((Beat(at, 1, 1), &[]));
        steps.push((Tick(at + 499), &[]));
    }
    steps.push((Nodes, &["n1 s1 alive joined 0 beat 10000 info a@0"]));
    run("steady beats", &steps);
    // The slowest beats that still keep a node alive: one every 2999 ms.
    run(
        "slow beats",
        &[
            (Join(0, "a"), &["joined n1 s1"]),
            (Beat(2999, 1, 1), &[]),
            (Tick(2999), &[]),
            (Beat(5998, 1, 1), &[]),
            (Tick(5998), &[]),
            (Nodes, &["n1 s1 alive joined 0 beat 5998 info a@0"]),
        ],
    );
}

#[test]
fn silence_makes_a_node_suspect_then_dead_exactly_at_the_deadline() {
    run(
        "silent from the join",
        &[
            (Join(0, "a"), &["joined n1 s1"]),
            (Tick(1499), &[]),
            (Tick(1500), &["suspect n1 s1 after 1500"]),
            (Tick(1500), &[]),
            (Tick(2999), &[]),
            (Tick(3000), &["dead n1 s1 beat 0 after 3000"]),
            (Tick(3000), &[]),
            (Tick(90_000), &[]),
            (Nodes, &["n1 s1 dead joined 0 beat 0 info a@0"]),
        ],
    );
    run(
        "window counted from the last beat; a suspect node recovers",
        &[
            (Join(0, "a"), &["joined n1 s1"]),
            (Beat(1000, 1, 1), &[]),
            (Tick(2499), &[]),
            (Tick(2500), &["suspect n1 s1 after 1500"]),
            (Beat(2600, 1, 1), &["recovered n1 s1 after 1600"]),
            (Tick(4099), &[]),
            (Tick(4100), &["suspect n1 s1 after 1500"]),
            (Tick(5599), &[]),
            (Tick(5600), &["dead n1 s1 beat 2600 after 3000"]),
        ],
    );
    run(
        "a late tick goes straight to dead",
        &[
            (Join(0, "a"), &["joined n1 s1"]),
            (Tick(7000), &["dead n1 s1 beat 0 after 7000"]),
            (Tick(7000), &[]),
        ],
    );
    run(
        "several nodes die in id order",
        &[
            (Join(0, "b"), &["joined n1 s1"]),
            (Join(100, "a"), &["joined n2 s2"]),
            (Beat(200, 2, 2), &[]),
            (
                Tick(3199),
                &["dead n1 s1 beat 0 after 3199", "suspect n2 s2 after 2999"],
            ),
            (Tick(3200), &["dead n2 s2 beat 200 after 3000"]),
            (Join(3250, "c"), &["joined n3 s3"]),
            (Join(3200, "d"), &["joined n4 s4"]),
            (
                Tick(8250),
                &[
                    "dead n3 s3 beat 3250 after 5000",
                    "dead n4 s4 beat 3200 after 5050",
                ],
            ),
        ],
    );
}

#[test]
fn messages_past_the_deadline_are_refused_even_before_a_tick() {
    run(
        "heartbeat at the deadline",
        &[
            (Join(0, "a"), &["joined n1 s1"]),
            (Beat(3000, 1, 1), &["err expired 3000"]),
            (Nodes, &["n1 s1 alive joined 0 beat 0 info a@0"]),
            (Tick(3000), &["dead n1 s1 beat 0 after 3000"]),
            (Beat(3001, 1, 1), &["err dead"]),
        ],
    );
    run(
        "heartbeat just before the deadline",
        &[
            (Join(0, "a"), &["joined n1 s1"]),
            (Beat(2999, 1, 1), &[]),
            (Tick(3000), &[]),
        ],
    );
    run(
        "leave past the deadline",
        &[
            (Join(0, "a"), &["joined n1 s1"]),
            (Leave(3500, 1, 1), &["err expired 3500"]),
            (Tick(3500), &["dead n1 s1 beat 0 after 3500"]),
        ],
    );
}

#[test]
fn a_rejoining_node_gets_a_new_session_and_the_old_one_is_refused() {
    run(
        "rejoin while alive",
        &[
            (Join(0, "a"), &["joined n1 s1"]),
            (Join(1000, "a"), &["joined n1 s2", "replaced n1 s1 by s2"]),
            (Beat(1100, 1, 1), &["err stale, current s2"]),
            (Leave(1100, 1, 1), &["err stale, current s2"]),
            (Beat(1200, 1, 2), &[]),
            (Tick(4199), &["suspect n1 s2 after 2999"]),
            (Nodes, &["n1 s2 suspect joined 1000 beat 1200 info a@1000"]),
        ],
    );
    run(
        "rejoin after a silence no tick noticed",
        &[
            (Join(0, "a"), &["joined n1 s1"]),
            (
                Join(5000, "a"),
                &["joined n1 s2", "dead n1 s1 beat 0 after 5000"],
            ),
            (Tick(5000), &[]),
            (Beat(5100, 1, 2), &[]),
        ],
    );
    run(
        "rejoin after death or leave ends nothing more",
        &[
            (Join(0, "a"), &["joined n1 s1"]),
            (Tick(3000), &["dead n1 s1 beat 0 after 3000"]),
            (Beat(3100, 1, 1), &["err dead"]),
            (Join(3200, "a"), &["joined n1 s2"]),
            (Leave(3300, 1, 2), &["left n1 s2"]),
            (Join(3400, "a"), &["joined n1 s3"]),
            (Join(3500, "b"), &["joined n2 s4"]),
            (
                Nodes,
                &[
                    "n1 s3 alive joined 3400 beat 3400 info a@3400",
                    "n2 s4 alive joined 3500 beat 3500 info b@3500",
                ],
            ),
            (Beat(3600, 1, 9), &["err stale, current s3"]),
        ],
    );
}

#[test]
fn leave_ends_a_session_gracefully() {
    run(
        "leave",
        &[
            (Join(0, "a"), &["joined n1 s1"]),
            (Join(10, "b"), &["joined n2 s2"]),
            (Leave(100, 1, 1), &["left n1 s1"]),
            (Beat(200, 1, 1), &["err left"]),
            (Leave(200, 1, 1), &["err left"]),
            (Tick(10_000), &["dead n2 s2 beat 10 after 9990"]),
            (
                Nodes,
                &[
                    "n1 s1 left joined 0 beat 0 info a@0",
                    "n2 s2 dead joined 10 beat 10 info b@10",
                ],
            ),
        ],
    );
    run(
        "unknown nodes",
        &[
            (Beat(0, 7, 1), &["err unknown"]),
            (Leave(0, 7, 1), &["err unknown"]),
            (Join(0, "a"), &["joined n1 s1"]),
            (Beat(0, 2, 1), &["err unknown"]),
        ],
    );
}

#[test]
fn next_deadline_is_the_next_time_tick_has_work() {
    run(
        "deadlines",
        &[
            (Deadline, &["deadline none"]),
            (Join(0, "a"), &["joined n1 s1"]),
            (Deadline, &["deadline 1500"]),
            (Join(400, "b"), &["joined n2 s2"]),
            (Deadline, &["deadline 1500"]),
            (Beat(1000, 1, 1), &[]),
            (Deadline, &["deadline 1900"]),
            (Tick(1900), &["suspect n2 s2 after 1500"]),
            (Deadline, &["deadline 2500"]),
            (Tick(2500), &["suspect n1 s1 after 1500"]),
            (Deadline, &["deadline 3400"]),
            (Tick(3400), &["dead n2 s2 beat 400 after 3000"]),
            (Deadline, &["deadline 4000"]),
            (Leave(3500, 1, 1), &["left n1 s1"]),
            (Deadline, &["deadline none"]),
        ],
    );
    run(
        "a deadline that passed without a tick is still reported",
        &[
            (Join(0, "a"), &["joined n1 s1"]),
            (Join(2000, "b"), &["joined n2 s2"]),
            (Deadline, &["deadline 1500"]),
            (Tick(2000), &["suspect n1 s1 after 2000"]),
            (Deadline, &["deadline 3000"]),
        ],
    );
    run(
        "the clock going backwards declares nothing early",
        &[
            (Join(1000, "a"), &["joined n1 s1"]),
            (Beat(500, 1, 1), &[]),
            (Tick(200), &[]),
            (Deadline, &["deadline 2500"]),
            (Tick(3999), &["suspect n1 s1 after 2999"]),
            (Tick(4000), &["dead n1 s1 beat 1000 after 3000"]),
        ],
    );
}

/// A daemon that sleeps exactly until `next_deadline` (or the next heartbeat, whichever
/// comes first) declares every death at its deadline, and only nodes that did fall silent
/// for the whole window.
#[test]
fn a_driver_ticking_at_next_deadline_declares_deaths_on_time() {
    let config = MembershipConfig::default();
    for seed in 0..20 {
        let mut rng = SplitMix(seed);
        let mut membership = Membership::new(config);
        // Per node: (node, session, time of its next heartbeat).
        let mut nodes = Vec::new();
        for key in ["a", "b", "c", "d"] {
            let joined = membership.join(0, key, ());
            nodes.push((joined.node, joined.session, rng.gap()));
        }
        let mut now = 0;
        let mut deaths = 0;
        while now < 60_000 {
            let next_beat = nodes.iter().map(|n| n.2).min();
            now = match (membership.next_deadline(), next_beat) {
                (Some(deadline), Some(beat)) => deadline.min(beat),
                (deadline, beat) => deadline.or(beat).unwrap_or(u64::MAX),
            };
            // Deadlines first: a heartbeat at the deadline is too late.
            for event in membership.tick(now) {
                if let MembershipEvent::NodeDead {
                    node,
                    silent_for_ms,
                    ..
                } = event
                {
                    assert_eq!(silent_for_ms, config.dead_after_ms, "seed {seed}");
                    let beat = nodes.iter().find(|n| n.0 == node).map(|n| n.2);
                    let last = membership.get(node).map(|m| m.last_heartbeat_ms());
                    assert!(
                        beat >= last.map(|l| l + config.dead_after_ms),
                        "seed {seed}"
                    );
                    deaths += 1;
                    nodes.retain(|n| n.0 != node);
                }
            }
            for (node, session, beat) in nodes.iter_mut().filter(|n| n.2 == now) {
                assert_eq!(membership.heartbeat(now, *node, *session).err(), None);
                *beat = now + rng.gap();
            }
        }
        assert!(deaths > 0, "seed {seed}: gaps up to 3999 ms kill someone");
    }
}

#[test]
fn sessions_can_start_above_a_previous_life() {
    let mut membership =
        Membership::with_first_session(MembershipConfig::default(), SessionId(500));
    let a = membership.join(0, "a", ());
    let b = membership.join(0, "b", ());
    let a2 = membership.join(0, "a", ());
    let got: Vec<(u64, u64)> = [&a, &b, &a2]
        .iter()
        .map(|j| (j.node.0, j.session.0))
        .collect();
    assert_eq!(got, [(1, 500), (2, 501), (1, 502)]);
    assert_eq!(
        membership.find("a").map(Member::session),
        Some(SessionId(502))
    );
    assert_eq!(membership.find("z").map(Member::id), None);
    let alive: Vec<NodeId> = membership.alive().map(Member::id).collect();
    assert_eq!(alive, [NodeId(1), NodeId(2)]);
}

#[test]
fn events_say_which_session_they_end() {
    let (n, s, s2) = (NodeId(3), SessionId(4), SessionId(5));
    let cases = [
        (
            MembershipEvent::NodeSuspect {
                node: n,
                session: s,
                last_heartbeat_ms: 0,
                silent_for_ms: 1,
            },
            None,
        ),
        (
            MembershipEvent::NodeRecovered {
                node: n,
                session: s,
                silent_for_ms: 1,
            },
            None,
        ),
        (
            MembershipEvent::NodeDead {
                node: n,
                session: s,
                last_heartbeat_ms: 0,
                silent_for_ms: 1,
            },
            Some(s),
        ),
        (
            MembershipEvent::NodeReplaced {
                node: n,
                old_session: s,
                new_session: s2,
            },
            Some(s),
        ),
        (
            MembershipEvent::NodeLeft {
                node: n,
                session: s,
            },
            Some(s),
        ),
    ];
    for (event, ended) in cases {
        assert_eq!(event.node(), n, "{event:?}");
        assert_eq!(event.ended_session(), ended, "{event:?}");
    }
}

#[test]
fn config_is_validated() {
    let cases = [
        (500, 3000, true),
        (500, 1000, true),
        (500, 999, false),
        (0, 3000, false),
        (1, 2, true),
        (2000, 3000, false),
    ];
    for (heartbeat_interval_ms, dead_after_ms, ok) in cases {
        let config = MembershipConfig {
            heartbeat_interval_ms,
            dead_after_ms,
        };
        assert_eq!(config.validate().is_ok(), ok, "{config:?}");
    }
    assert_eq!(MembershipConfig::default().suspect_after_ms(), 1500);
}

#[test]
fn errors_read_well() {
    let (node, session) = (NodeId(3), SessionId(7));
    let cases = [
        (MembershipError::UnknownNode { node }, "unknown node 3"),
        (
            MembershipError::StaleSession {
                node,
                session,
                current: SessionId(9),
            },
            "node 3: session 7 is not the current one (9)",
        ),
        (
            MembershipError::SessionEnded {
                node,
                session,
                state: NodeState::Dead,
            },
            "node 3: session 7 is over (dead)",
        ),
        (
            MembershipError::Expired {
                node,
                session,
                silent_for_ms: 3100,
                dead_after_ms: 3000,
            },
            "node 3: session 7 was silent for 3100 ms, the limit is 3000 ms",
        ),
    ];
    for (error, want) in cases {
        assert_eq!(error.to_string(), want);
    }
}

/// SplitMix64, for heartbeat gaps that are random but the same on every run.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A heartbeat gap of 1..=3999 ms: mostly on time, sometimes too late.
    fn gap(&mut self) -> u64 {
        if self.next().is_multiple_of(8) {
            3000 + self.next() % 1000
        } else {
            1 + self.next() % 2999
        }
    }
}
