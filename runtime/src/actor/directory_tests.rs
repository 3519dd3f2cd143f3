//! Tests of the actor directory: transcripts of calls at made-up times against a real
//! resource table. After each call the transcript also shows the events it produced.

use super::*;
use crate::placement::NodeCapacity;

/// One call in a transcript. Times are the first field; actors and nodes are numbers.
#[derive(Debug, Clone, Copy)]
enum Step {
    /// Adds a node offering `"gpu=2 cpu=8"` to the table.
    Node(u64, &'static str),
    /// `spawn(at, owner, resources, strategy)` with `restarts` and `backoff_ms`.
    Spawn(u64, &'static str, &'static str, Strategy, u32, u64),
    Started(u64, u64, u64),
    StartFailed(u64, u64, u64, &'static str),
    /// `spawn_failed(at, actor, reason)`.
    SpawnFailed(u64, u64, &'static str),
    Failed(u64, u64, u64, &'static str),
    Stopped(u64, u64, u64),
    /// `node_lost(at, node, why)`.
    Lost(u64, u64, &'static str),
    /// `stop(at, owner, actor, kill)`.
    Stop(u64, &'static str, u64, bool),
    OwnerGone(u64, &'static str),
    Tick(u64),
    Deadline,
    Locate(u64),
    /// `events_after(owner, seq)`.
    Events(&'static str, u64),
    /// What the table has in use.
    Used,
}

use Step::{
    Deadline, Events, Failed, Locate, Lost, Node, OwnerGone, Spawn, SpawnFailed, StartFailed,
    Started, Stop, Stopped, Tick, Used,
};
use Strategy::{Pack, Spread};

/// Runs `steps` on an empty directory and table and checks what each returned, followed
/// by the events it produced.
fn run(name: &str, steps: &[(Step, &[&str])]) {
    run_with(name, DirectoryConfig::default(), steps);
}

fn run_with(name: &str, config: DirectoryConfig, steps: &[(Step, &[&str])]) {
    let table = ResourceTable::new();
    let mut directory = ActorDirectory::new(config);
    for (i, (step, want)) in steps.iter().enumerate() {
        let seen = directory.last_seq();
        let mut got = apply(&mut directory, &table, *step);
        got.extend(
            directory
                .events()
                .filter(|event| event.seq > seen)
                .map(show_event),
        );
        assert_eq!(got, *want, "{name}: step {i} {step:?}");
    }
}

fn apply(directory: &mut ActorDirectory, table: &ResourceTable, step: Step) -> Vec<String> {
    let done = |result: Result<(), DirectoryError>| match result {
        Ok(()) => vec![],
        Err(error) => vec![format!("err {error}")],
    };
    let actions = |actions: Vec<ActorAction>| actions.iter().map(show_action).collect();
    match step {
        Node(node, capacity) => {
            let capacity = NodeCapacity::new(res(capacity));
            match table.add_node(NodeId(node), capacity) {
                Ok(()) => vec![],
                Err(error) => vec![format!("err {error}")],
            }
        }
        Spawn(at, owner, resources, strategy, max_restarts, backoff_ms) => {
            let request = SpawnRequest {
                label: None,
                kind: "worker".to_string(),
                args: b"args".to_vec(),
                resources: res(resources),
                strategy,
                process_group: String::new(),
                restart: RestartPolicy {
                    max_restarts,
                    backoff_ms,
                },
            };
            match directory.spawn(at, owner, request, table) {
                Ok((actor, action)) => vec![format!("a{actor}: {}", show_action(&action))],
                Err(error) => vec![format!("err {error}")],
            }
        }
        Started(at, actor, node) => actions(
            directory
                .started(at, ActorId(actor), NodeId(node))
                .into_iter()
                .collect(),
        ),
        StartFailed(at, actor, node, reason) => {
            done(directory.start_failed(at, ActorId(actor), NodeId(node), reason, table))
        }
        SpawnFailed(at, actor, reason) => {
            directory.spawn_failed(at, ActorId(actor), reason, table);
            vec![]
        }
        Failed(at, actor, node, reason) => done(directory.failed(
            at,
            ActorId(actor),
            NodeId(node),
            reason,
            FailureOrigin::Here,
            table,
        )),
        Stopped(at, actor, node) => {
            done(directory.stopped(at, ActorId(actor), NodeId(node), table))
        }
        Lost(at, node, why) => {
            // As the head does: the table first, then the directory.
            let lost = table.remove_node(NodeId(node));
            directory.node_lost(at, NodeId(node), why, lost.iter().map(|r| r.id), table);
            vec![]
        }
        Stop(at, owner, actor, kill) => match directory.stop(at, owner, ActorId(actor), kill) {
            Ok(action) => actions(action.into_iter().collect()),
            Err(error) => vec![format!("err {error}")],
        },
        OwnerGone(at, owner) => actions(directory.owner_gone(at, owner)),
        Tick(at) => actions(directory.tick(at, table)),
        Deadline => match directory.next_deadline() {
            Some(at) => vec![format!("deadline {at}")],
            None => vec!["deadline none".to_string()],
        },
        Locate(actor) => vec![match directory.locate(ActorId(actor)) {
            None => "unknown".to_string(),
            Some(location) => show_location(location),
        }],
        Events(owner, after) => {
            let page = directory.events_after(owner, after);
            let mut lines: Vec<String> = page.events.iter().map(show_event).collect();
            if page.missed {
                lines.push("missed".to_string());
            }
            lines
        }
        Used => {
            let totals = table.totals();
            vec![format!(
                "used {} by {} reservations",
                totals.used(),
                totals.reservations
            )]
        }
    }
}

fn show_action(action: &ActorAction) -> String {
    match action {
        ActorAction::Start {
            actor,
            node,
            reservation,
            gpus,
            ..
        } => {
            let gpus: Vec<String> = gpus.iter().map(u32::to_string).collect();
            format!("start a{actor} n{node} r{reservation} [{}]", gpus.join(","))
        }
        ActorAction::Stop { actor, node, kill } => {
            let how = if *kill { "kill" } else { "stop" };
            format!("{how} a{actor} n{node}")
        }
    }
}

fn show_event(event: &ActorEvent) -> String {
    let node = event
        .node
        .map_or("-".to_string(), |node| format!("n{node}"));
    let origin = match event.origin {
        FailureOrigin::Here => "",
        FailureOrigin::Elsewhere => " [elsewhere]",
        FailureOrigin::WorkerExit => " [worker exit]",
        FailureOrigin::NodeLost => " [node lost]",
    };
    format!(
        "#{} {} a{} {} {node}{origin}: {}",
        event.seq, event.owner, event.actor, event.kind, event.reason
    )
}

fn show_location(location: ActorLocation) -> String {
    let node = location
        .node
        .map_or("-".to_string(), |node| format!("n{node}"));
    match location.state {
        ActorState::Restarting { attempt, at_ms } => {
            format!("restarting {node} attempt {attempt} at {at_ms}")
        }
        ActorState::Stopping { kill: true } => format!("stopping {node} kill"),
        state => format!("{state} {node}"),
    }
}

/// `"gpu=2 cpu=4"`: whole CPUs.
fn res(text: &str) -> Resources {
    let mut resources = Resources::new();
    for item in text.split_whitespace() {
        let (name, amount) = item.split_once('=').expect("name=amount");
        let amount: u64 = amount.parse().expect("amount");
        match name {
            Resources::CPU => resources.set(name, amount * 1000),
            _ => resources.set(name, amount),
        }
    }
    resources
}

#[test]
fn spawn_places_by_strategy_and_reserves() {
    run(
        "pack fills the fullest node, spread the emptiest",
        &[
            (Node(1, "gpu=4 cpu=8"), &[]),
            (Node(2, "gpu=2 cpu=8"), &[]),
            (
                Spawn(0, "alice", "gpu=1", Pack, 0, 0),
                &["a1: start a1 n2 r1 [0]"],
            ),
            (
                Spawn(0, "alice", "gpu=1", Pack, 0, 0),
                &["a2: start a2 n2 r2 [1]"],
            ),
            (
                Spawn(0, "alice", "gpu=1", Pack, 0, 0),
                &["a3: start a3 n1 r3 [0]"],
            ),
            (
                Spawn(0, "bob", "cpu=2", Spread, 0, 0),
                &["a4: start a4 n1 r4 []"],
            ),
            (
                Spawn(0, "bob", "cpu=2", Spread, 0, 0),
                &["a5: start a5 n2 r5 []"],
            ),
            (
                Spawn(0, "bob", "gpu=1", Strategy::Node(NodeId(1)), 0, 0),
                &["a6: start a6 n1 r6 [1]"],
            ),
            (Used, &["used 4 gpu, 4 cpu by 6 reservations"]),
            (Locate(1), &["starting n2"]),
            (Started(10, 1, 2), &[]),
            (Locate(1), &["running n2"]),
            (Locate(7), &["unknown"]),
            (Deadline, &["deadline none"]),
        ],
    );
}

#[test]
fn a_refused_spawn_reserves_nothing_and_uses_no_id() {
    run(
        "refusals carry the table's words",
        &[
            (Node(1, "gpu=2 cpu=8"), &[]),
            (Node(3, "gpu=2 cpu=8"), &[]),
            (
                Spawn(0, "alice", "gpu=4", Pack, 3, 100),
                &["err unsatisfiable: needs 4 gpu on one node; the largest node has 2 (node 1)"],
            ),
            (
                Spawn(0, "alice", "gpu=2", Pack, 0, 0),
                &["a1: start a1 n1 r1 [0,1]"],
            ),
            (
                Spawn(0, "alice", "gpu=2", Pack, 0, 0),
                &["a2: start a2 n3 r2 [0,1]"],
            ),
            (
                Spawn(0, "alice", "gpu=1", Spread, 0, 0),
                &["err busy: needs 1 gpu on one node; 4 of 4 gpu in use"],
            ),
            (
                Spawn(0, "alice", "cpu=1", Strategy::Node(NodeId(9)), 0, 0),
                &["err unknown node 9"],
            ),
            (Used, &["used 4 gpu by 2 reservations"]),
            (
                Spawn(0, "alice", "cpu=1", Pack, 0, 0),
                &["a3: start a3 n1 r3 []"],
            ),
        ],
    );
}

#[test]
fn a_lost_node_restarts_its_actors_elsewhere_after_a_doubling_backoff() {
    run(
        "restart on another node exactly at the deadline, three times",
        &[
            (Node(1, "gpu=2"), &[]),
            (Node(2, "gpu=2"), &[]),
            (
                Spawn(0, "alice", "gpu=2", Pack, 3, 100),
                &["a1: start a1 n1 r1 [0,1]"],
            ),
            (Started(5, 1, 1), &[]),
            (
                Lost(1000, 1, "dead"),
                &[
                    "#1 alice a1 restarting n1 [node lost]: node 1 lost: dead; restart 1 of 3 in 100 ms",
                ],
            ),
            (Locate(1), &["restarting - attempt 1 at 1100"]),
            (Used, &["used nothing by 0 reservations"]),
            (Deadline, &["deadline 1100"]),
            (Tick(1099), &[]),
            (Tick(1100), &["start a1 n2 r2 [0,1]"]),
            (Tick(1100), &[]),
            (Locate(1), &["starting n2"]),
            (Deadline, &["deadline none"]),
            (
                Started(1150, 1, 2),
                &["#2 alice a1 restarted n2: restart 1 of 3 on node 2"],
            ),
            (Node(1, "gpu=2"), &[]),
            (
                Failed(2000, 1, 2, "worker exited: signal 9"),
                &["#3 alice a1 restarting n2: worker exited: signal 9; restart 2 of 3 in 200 ms"],
            ),
            (Deadline, &["deadline 2200"]),
            (Tick(2199), &[]),
            (Tick(2200), &["start a1 n1 r3 [0,1]"]),
            (
                StartFailed(2300, 1, 1, "no such kind"),
                &["#4 alice a1 restarting n1: no such kind; restart 3 of 3 in 400 ms"],
            ),
            (Tick(2700), &["start a1 n1 r4 [0,1]"]),
            (
                Started(2710, 1, 1),
                &["#5 alice a1 restarted n1: restart 3 of 3 on node 1"],
            ),
            (Used, &["used 2 gpu by 1 reservations"]),
            (
                Failed(3000, 1, 1, "boom"),
                &["#6 alice a1 failed n1: boom; no restarts left (3 used)"],
            ),
            (Locate(1), &["failed -"]),
            (Used, &["used nothing by 0 reservations"]),
            (Deadline, &["deadline none"]),
            (Tick(100_000), &[]),
        ],
    );
}

#[test]
fn actors_without_restarts_fail_with_the_reason() {
    run(
        "node lost, worker exit, failed start",
        &[
            (Node(1, "gpu=2 cpu=8"), &[]),
            (Node(2, "cpu=8"), &[]),
            (
                Spawn(0, "alice", "gpu=1", Pack, 0, 0),
                &["a1: start a1 n1 r1 [0]"],
            ),
            (
                Spawn(0, "bob", "gpu=1", Pack, 0, 0),
                &["a2: start a2 n1 r2 [1]"],
            ),
            (
                Spawn(0, "bob", "cpu=1", Strategy::Node(NodeId(2)), 0, 0),
                &["a3: start a3 n2 r3 []"],
            ),
            (
                Spawn(0, "bob", "cpu=1", Strategy::Node(NodeId(2)), 0, 0),
                &["a4: start a4 n2 r4 []"],
            ),
            (Started(1, 1, 1), &[]),
            (Started(1, 2, 1), &[]),
            (Started(1, 3, 2), &[]),
            (
                Lost(500, 1, "silent for 3000 ms"),
                &[
                    "#1 alice a1 failed n1 [node lost]: node 1 lost: silent for 3000 ms",
                    "#2 bob a2 failed n1 [node lost]: node 1 lost: silent for 3000 ms",
                ],
            ),
            (
                Failed(600, 3, 2, "exit code 1; last stderr: oops"),
                &["#3 bob a3 failed n2: exit code 1; last stderr: oops"],
            ),
            (
                StartFailed(700, 4, 2, "no such kind"),
                &["#4 bob a4 failed n2: no such kind"],
            ),
            (Used, &["used nothing by 0 reservations"]),
            (Locate(2), &["failed -"]),
            (Deadline, &["deadline none"]),
        ],
    );
}

#[test]
fn a_first_start_that_fails_ends_the_actor_whatever_its_policy() {
    run(
        "spawn failed",
        &[
            (Node(1, "gpu=2 cpu=8"), &[]),
            (
                Spawn(0, "alice", "gpu=1", Pack, 3, 100),
                &["a1: start a1 n1 r1 [0]"],
            ),
            (
                SpawnFailed(10, 1, "node 1: unknown actor kind 'x'"),
                &["#1 alice a1 failed n1: node 1: unknown actor kind 'x'"],
            ),
            (Used, &["used nothing by 0 reservations"]),
            (Locate(1), &["failed -"]),
            (Deadline, &["deadline none"]),
            // Lost while starting: restarting, then the spawner's error ends it.
            (
                Spawn(20, "alice", "gpu=1", Pack, 3, 100),
                &["a2: start a2 n1 r2 [0]"],
            ),
            (
                Lost(30, 1, "left"),
                &[
                    "#2 alice a2 restarting n1 [node lost]: node 1 lost: left; restart 1 of 3 in 100 ms",
                ],
            ),
            (
                SpawnFailed(40, 2, "node 1 lost"),
                &["#3 alice a2 failed -: node 1 lost"],
            ),
            (Deadline, &["deadline none"]),
            (SpawnFailed(50, 2, "again"), &[]),
        ],
    );
}

#[test]
fn a_restart_that_cannot_be_placed_uses_up_a_restart() {
    run(
        "no room, then room, then no room until the end",
        &[
            (Node(1, "gpu=1"), &[]),
            (
                Spawn(0, "alice", "gpu=1", Pack, 3, 1000),
                &["a1: start a1 n1 r1 [0]"],
            ),
            (Started(0, 1, 1), &[]),
            (
                Lost(10, 1, "left"),
                &[
                    "#1 alice a1 restarting n1 [node lost]: node 1 lost: left; restart 1 of 3 in 1000 ms",
                ],
            ),
            (
                Tick(1010),
                &[
                    "#2 alice a1 restarting -: restart 1 of 3 could not be placed: unsatisfiable: needs 1 gpu on one node; the cluster has no nodes; restart 2 of 3 in 2000 ms",
                ],
            ),
            (Node(2, "gpu=1"), &[]),
            (Tick(3010), &["start a1 n2 r2 [0]"]),
            (
                Started(3020, 1, 2),
                &["#3 alice a1 restarted n2: restart 2 of 3 on node 2"],
            ),
            (
                Lost(4000, 2, "dead"),
                &[
                    "#4 alice a1 restarting n2 [node lost]: node 2 lost: dead; restart 3 of 3 in 4000 ms",
                ],
            ),
            (
                Tick(8000),
                &[
                    "#5 alice a1 failed -: restart 3 of 3 could not be placed: unsatisfiable: needs 1 gpu on one node; the cluster has no nodes; no restarts left (3 used)",
                ],
            ),
            (Deadline, &["deadline none"]),
        ],
    );
    run(
        "a busy cluster, and a restart pinned to a lost node",
        &[
            (Node(1, "gpu=1"), &[]),
            (Node(2, "gpu=1"), &[]),
            (
                Spawn(0, "alice", "gpu=1", Pack, 1, 0),
                &["a1: start a1 n1 r1 [0]"],
            ),
            (
                Spawn(0, "bob", "gpu=1", Pack, 0, 0),
                &["a2: start a2 n2 r2 [0]"],
            ),
            (
                Spawn(0, "bob", "cpu=1", Strategy::Node(NodeId(3)), 1, 50),
                &["err unknown node 3"],
            ),
            (Node(3, "cpu=1"), &[]),
            (
                Spawn(0, "bob", "cpu=1", Strategy::Node(NodeId(3)), 1, 50),
                &["a3: start a3 n3 r3 []"],
            ),
            (
                Failed(100, 1, 1, "oom"),
                &["#1 alice a1 restarting n1: oom; restart 1 of 1 in 0 ms"],
            ),
            (Deadline, &["deadline 100"]),
            (
                Spawn(100, "bob", "gpu=1", Pack, 0, 0),
                &["a4: start a4 n1 r4 [0]"],
            ),
            (
                Tick(100),
                &[
                    "#2 alice a1 failed -: restart 1 of 1 could not be placed: busy: needs 1 gpu on one node; 2 of 2 gpu in use; no restarts left (1 used)",
                ],
            ),
            (
                Lost(200, 3, "replaced"),
                &[
                    "#3 bob a3 restarting n3 [node lost]: node 3 lost: replaced; restart 1 of 1 in 50 ms",
                ],
            ),
            (
                Tick(250),
                &[
                    "#4 bob a3 failed -: restart 1 of 1 could not be placed: unknown node 3; no restarts left (1 used)",
                ],
            ),
        ],
    );
}

#[test]
fn backoff_doubles_up_to_the_cap() {
    let cases: [(u64, u32, u64); 9] = [
        (100, 1, 100),
        (100, 2, 200),
        (100, 3, 400),
        (100, 9, 25_600),
        (100, 10, 30_000),
        (100, 200, 30_000),
        (0, 5, 0),
        (u64::MAX, 1, 30_000),
        (100, 0, 100),
    ];
    for (backoff_ms, attempt, want) in cases {
        let policy = RestartPolicy {
            max_restarts: 1,
            backoff_ms,
        };
        assert_eq!(
            policy.backoff(attempt, 30_000),
            want,
            "{policy:?} {attempt}"
        );
    }
    // In a directory, with a small cap.
    let config = DirectoryConfig {
        max_backoff_ms: 300,
        ..DirectoryConfig::default()
    };
    run_with(
        "capped at 300",
        config,
        &[
            (Node(1, "cpu=1"), &[]),
            (
                Spawn(0, "alice", "cpu=1", Pack, 4, 100),
                &["a1: start a1 n1 r1 []"],
            ),
            (
                Failed(0, 1, 1, "x"),
                &["#1 alice a1 restarting n1: x; restart 1 of 4 in 100 ms"],
            ),
            (Tick(100), &["start a1 n1 r2 []"]),
            (
                Failed(100, 1, 1, "x"),
                &["#2 alice a1 restarting n1: x; restart 2 of 4 in 200 ms"],
            ),
            (Tick(300), &["start a1 n1 r3 []"]),
            (
                Failed(300, 1, 1, "x"),
                &["#3 alice a1 restarting n1: x; restart 3 of 4 in 300 ms"],
            ),
            (Tick(600), &["start a1 n1 r4 []"]),
            (
                Failed(600, 1, 1, "x"),
                &["#4 alice a1 restarting n1: x; restart 4 of 4 in 300 ms"],
            ),
            (Deadline, &["deadline 900"]),
        ],
    );
}

#[test]
fn restarts_due_together_are_placed_in_deadline_then_id_order() {
    run(
        "one GPU left for two restarts",
        &[
            (Node(1, "gpu=2"), &[]),
            (Node(2, "gpu=1"), &[]),
            (
                Spawn(0, "alice", "gpu=1", Pack, 1, 500),
                &["a1: start a1 n2 r1 [0]"],
            ),
            (
                Spawn(0, "alice", "gpu=1", Pack, 1, 100),
                &["a2: start a2 n1 r2 [0]"],
            ),
            (
                Spawn(0, "alice", "gpu=1", Pack, 1, 100),
                &["a3: start a3 n1 r3 [1]"],
            ),
            (
                Lost(0, 1, "dead"),
                &[
                    "#1 alice a2 restarting n1 [node lost]: node 1 lost: dead; restart 1 of 1 in 100 ms",
                    "#2 alice a3 restarting n1 [node lost]: node 1 lost: dead; restart 1 of 1 in 100 ms",
                ],
            ),
            (
                Failed(0, 1, 2, "x"),
                &["#3 alice a1 restarting n2: x; restart 1 of 1 in 500 ms"],
            ),
            (
                Tick(1000),
                &[
                    "start a2 n2 r4 [0]",
                    "#4 alice a3 failed -: restart 1 of 1 could not be placed: busy: needs 1 gpu on one node; 1 of 1 gpu in use; no restarts left (1 used)",
                    "#5 alice a1 failed -: restart 1 of 1 could not be placed: busy: needs 1 gpu on one node; 1 of 1 gpu in use; no restarts left (1 used)",
                ],
            ),
        ],
    );
}

#[test]
fn stop_and_kill_by_the_owner() {
    run(
        "graceful stop, confirmed",
        &[
            (Node(1, "gpu=2"), &[]),
            (
                Spawn(0, "alice", "gpu=1", Pack, 3, 100),
                &["a1: start a1 n1 r1 [0]"],
            ),
            (Started(10, 1, 1), &[]),
            (
                Stop(100, "bob", 1, true),
                &["err actor 1 belongs to another owner"],
            ),
            (Stop(100, "alice", 9, true), &["err unknown actor 9"]),
            (Stop(100, "alice", 1, false), &["stop a1 n1"]),
            (Locate(1), &["stopping n1"]),
            (Used, &["used 1 gpu by 1 reservations"]),
            (Deadline, &["deadline 30100"]),
            (Stop(200, "alice", 1, false), &[]),
            (
                Stopped(300, 1, 1),
                &["#1 alice a1 stopped n1: stopped by its owner"],
            ),
            (Used, &["used nothing by 0 reservations"]),
            (Locate(1), &["stopped -"]),
            (Stop(400, "alice", 1, true), &[]),
            (Stopped(400, 1, 1), &[]),
            (Failed(400, 1, 1, "late"), &[]),
            (Deadline, &["deadline none"]),
        ],
    );
    run(
        "kill, and a kill upgrading a stop",
        &[
            (Node(1, "gpu=2"), &[]),
            (
                Spawn(0, "alice", "gpu=1", Pack, 0, 0),
                &["a1: start a1 n1 r1 [0]"],
            ),
            (
                Spawn(0, "alice", "gpu=1", Pack, 0, 0),
                &["a2: start a2 n1 r2 [1]"],
            ),
            (Started(10, 1, 1), &[]),
            (Started(10, 2, 1), &[]),
            (Stop(100, "alice", 1, true), &["kill a1 n1"]),
            (Locate(1), &["stopping n1 kill"]),
            (Deadline, &["deadline none"]),
            (Stop(100, "alice", 2, false), &["stop a2 n1"]),
            (Stop(200, "alice", 2, true), &["kill a2 n1"]),
            (Stop(300, "alice", 2, true), &[]),
            (Deadline, &["deadline none"]),
            (
                Stopped(400, 2, 1),
                &["#1 alice a2 stopped n1: killed by its owner"],
            ),
            (
                Failed(500, 1, 1, "killed by signal 9"),
                &["#2 alice a1 stopped n1: killed by its owner; killed by signal 9"],
            ),
            (Used, &["used nothing by 0 reservations"]),
        ],
    );
    run(
        "a graceful stop past its grace becomes a kill",
        &[
            (Node(1, "cpu=1"), &[]),
            (
                Spawn(0, "alice", "cpu=1", Pack, 0, 0),
                &["a1: start a1 n1 r1 []"],
            ),
            (Started(0, 1, 1), &[]),
            (Stop(1000, "alice", 1, false), &["stop a1 n1"]),
            (Deadline, &["deadline 31000"]),
            (Tick(30_999), &[]),
            (Tick(31_000), &["kill a1 n1"]),
            (Tick(31_000), &[]),
            (Deadline, &["deadline none"]),
            (Locate(1), &["stopping n1 kill"]),
            (
                Lost(40_000, 1, "dead"),
                &["#1 alice a1 stopped n1: stopped by its owner; node 1 lost: dead"],
            ),
            (Used, &["used nothing by 0 reservations"]),
        ],
    );
    run(
        "a stop while waiting to restart ends it at once",
        &[
            (Node(1, "cpu=1"), &[]),
            (
                Spawn(0, "alice", "cpu=1", Pack, 2, 100),
                &["a1: start a1 n1 r1 []"],
            ),
            (
                Failed(0, 1, 1, "x"),
                &["#1 alice a1 restarting n1: x; restart 1 of 2 in 100 ms"],
            ),
            (
                Stop(50, "alice", 1, false),
                &["#2 alice a1 stopped -: stopped by its owner while waiting to restart"],
            ),
            (Deadline, &["deadline none"]),
            (Tick(100), &[]),
            (Used, &["used nothing by 0 reservations"]),
        ],
    );
}

#[test]
fn a_stop_waits_for_the_start_and_late_reports_are_handled() {
    run(
        "stopped while starting: the stop goes once the node answers",
        &[
            (Node(1, "cpu=2"), &[]),
            (Node(2, "cpu=2"), &[]),
            (
                Spawn(0, "alice", "cpu=1", Pack, 0, 0),
                &["a1: start a1 n1 r1 []"],
            ),
            (Stop(10, "alice", 1, false), &[]),
            (Locate(1), &["stopping n1"]),
            (Deadline, &["deadline none"]),
            (Started(20, 1, 1), &["stop a1 n1"]),
            (Deadline, &["deadline 30020"]),
            (Started(25, 1, 1), &[]),
            (
                Stopped(30, 1, 1),
                &["#1 alice a1 stopped n1: stopped by its owner"],
            ),
            (Started(40, 1, 1), &["kill a1 n1"]),
            (
                Spawn(50, "alice", "cpu=1", Pack, 0, 0),
                &["a2: start a2 n1 r2 []"],
            ),
            (Stop(60, "alice", 2, true), &[]),
            (
                StartFailed(70, 2, 1, "no such kind"),
                &["#2 alice a2 stopped n1: killed by its owner; no such kind"],
            ),
            (Used, &["used nothing by 0 reservations"]),
        ],
    );
    run(
        "reports from a node the actor left are stale",
        &[
            (Node(1, "cpu=1"), &[]),
            (Node(2, "cpu=1"), &[]),
            (
                Spawn(0, "alice", "cpu=1", Pack, 1, 0),
                &["a1: start a1 n1 r1 []"],
            ),
            (
                StartFailed(10, 1, 1, "timed out"),
                &["#1 alice a1 restarting n1: timed out; restart 1 of 1 in 0 ms"],
            ),
            (Tick(10), &["start a1 n1 r2 []"]),
            (Started(20, 1, 2), &["kill a1 n2"]),
            (Failed(20, 1, 2, "stale"), &[]),
            (Stopped(20, 1, 2), &[]),
            (
                Started(30, 1, 1),
                &["#2 alice a1 restarted n1: restart 1 of 1 on node 1"],
            ),
            (Started(30, 1, 1), &[]),
            (Lost(40, 2, "dead"), &[]),
            (Locate(1), &["running n1"]),
            (Started(50, 7, 1), &["kill a7 n1"]),
            (Failed(50, 7, 1, "?"), &["err unknown actor 7"]),
            (StartFailed(50, 7, 1, "?"), &["err unknown actor 7"]),
            (Stopped(50, 7, 1), &["err unknown actor 7"]),
            (Used, &["used 1 cpu by 1 reservations"]),
        ],
    );
    run(
        "an actor that ends on its own",
        &[
            (Node(1, "cpu=1"), &[]),
            (
                Spawn(0, "alice", "cpu=1", Pack, 5, 0),
                &["a1: start a1 n1 r1 []"],
            ),
            (Started(0, 1, 1), &[]),
            (
                Stopped(10, 1, 1),
                &["#1 alice a1 stopped n1: ended on node 1"],
            ),
            (Tick(20), &[]),
            (Used, &["used nothing by 0 reservations"]),
        ],
    );
}

#[test]
fn owner_gone_kills_everything_it_owns() {
    run(
        "every state",
        &[
            (Node(1, "cpu=8"), &[]),
            (
                Spawn(0, "alice", "cpu=1", Pack, 1, 100),
                &["a1: start a1 n1 r1 []"],
            ),
            (
                Spawn(0, "alice", "cpu=1", Pack, 1, 100),
                &["a2: start a2 n1 r2 []"],
            ),
            (
                Spawn(0, "alice", "cpu=1", Pack, 1, 100),
                &["a3: start a3 n1 r3 []"],
            ),
            (
                Spawn(0, "alice", "cpu=1", Pack, 0, 100),
                &["a4: start a4 n1 r4 []"],
            ),
            (
                Spawn(0, "bob", "cpu=1", Pack, 0, 100),
                &["a5: start a5 n1 r5 []"],
            ),
            (Started(0, 1, 1), &[]),
            (Started(0, 4, 1), &[]),
            (Started(0, 5, 1), &[]),
            (
                Failed(10, 3, 1, "x"),
                &["#1 alice a3 restarting n1: x; restart 1 of 1 in 100 ms"],
            ),
            (Failed(10, 4, 1, "y"), &["#2 alice a4 failed n1: y"]),
            (
                OwnerGone(20, "alice"),
                &[
                    "kill a1 n1",
                    "#3 alice a3 stopped -: its owner is gone while waiting to restart",
                ],
            ),
            (Used, &["used 3 cpu by 3 reservations"]),
            (Started(30, 2, 1), &["kill a2 n1"]),
            (
                Stopped(40, 1, 1),
                &["#4 alice a1 stopped n1: its owner is gone"],
            ),
            (
                Stopped(40, 2, 1),
                &["#5 alice a2 stopped n1: its owner is gone"],
            ),
            (OwnerGone(50, "alice"), &[]),
            (Used, &["used 1 cpu by 1 reservations"]),
            (Locate(5), &["running n1"]),
        ],
    );
}

#[test]
fn events_are_numbered_filtered_by_owner_and_bounded() {
    let config = DirectoryConfig {
        max_events: 3,
        ..DirectoryConfig::default()
    };
    run_with(
        "the last three events are kept",
        config,
        &[
            (Node(1, "cpu=8"), &[]),
            (
                Spawn(0, "alice", "cpu=1", Pack, 0, 0),
                &["a1: start a1 n1 r1 []"],
            ),
            (
                Spawn(0, "bob", "cpu=1", Pack, 0, 0),
                &["a2: start a2 n1 r2 []"],
            ),
            (
                Spawn(0, "alice", "cpu=1", Pack, 0, 0),
                &["a3: start a3 n1 r3 []"],
            ),
            (
                Spawn(0, "bob", "cpu=1", Pack, 0, 0),
                &["a4: start a4 n1 r4 []"],
            ),
            (Events("alice", 0), &[]),
            (Failed(1, 1, 1, "e1"), &["#1 alice a1 failed n1: e1"]),
            (Failed(2, 2, 1, "e2"), &["#2 bob a2 failed n1: e2"]),
            (Failed(3, 3, 1, "e3"), &["#3 alice a3 failed n1: e3"]),
            (
                Events("alice", 0),
                &["#1 alice a1 failed n1: e1", "#3 alice a3 failed n1: e3"],
            ),
            (Events("alice", 1), &["#3 alice a3 failed n1: e3"]),
            (Events("alice", 3), &[]),
            (Events("alice", 99), &[]),
            (Events("carol", 0), &[]),
            (Failed(4, 4, 1, "e4"), &["#4 bob a4 failed n1: e4"]),
            // Alice's event 1 is gone: asking from before it says so.
            (Events("alice", 0), &["#3 alice a3 failed n1: e3", "missed"]),
            (Events("alice", 1), &["#3 alice a3 failed n1: e3"]),
            (
                Events("bob", 0),
                &["#2 bob a2 failed n1: e2", "#4 bob a4 failed n1: e4"],
            ),
            (
                Spawn(5, "bob", "cpu=1", Pack, 0, 0),
                &["a5: start a5 n1 r5 []"],
            ),
            (Failed(5, 5, 1, "e5"), &["#5 bob a5 failed n1: e5"]),
            (
                Events("bob", 0),
                &[
                    "#4 bob a4 failed n1: e4",
                    "#5 bob a5 failed n1: e5",
                    "missed",
                ],
            ),
            (
                Events("bob", 1),
                &[
                    "#4 bob a4 failed n1: e4",
                    "#5 bob a5 failed n1: e5",
                    "missed",
                ],
            ),
            (
                Events("bob", 2),
                &["#4 bob a4 failed n1: e4", "#5 bob a5 failed n1: e5"],
            ),
            (Events("carol", 0), &[]),
        ],
    );
}

#[test]
fn the_owners_that_lost_events_are_bounded_too() {
    // Three events kept, and at most three owners remembered as having lost some.
    let config = DirectoryConfig {
        max_events: 3,
        ..DirectoryConfig::default()
    };
    let table = ResourceTable::new();
    table
        .add_node(NodeId(1), res("cpu=100"))
        .expect("a new node");
    let mut directory = ActorDirectory::new(config);
    let owners = ["o0", "o1", "o2", "o3", "o4", "o5", "o6", "o7"];
    for (i, owner) in owners.iter().enumerate() {
        let request = SpawnRequest {
            label: None,
            kind: "worker".to_string(),
            args: Vec::new(),
            resources: res("cpu=1"),
            strategy: Pack,
            process_group: String::new(),
            restart: RestartPolicy::default(),
        };
        let (actor, _) = directory
            .spawn(0, owner, request, &table)
            .expect("room for all");
        let at = u64::try_from(i).expect("small");
        assert_eq!(
            directory.failed(at, actor, NodeId(1), "x", FailureOrigin::Here, &table),
            Ok(())
        );
    }
    // Events 1..=8 went to o0..o7; 6, 7 and 8 are kept. Dropping 4 overflowed the map
    // of owners (o0..o2), so asking from before 3 reports `missed` to anyone: needless
    // for o5, never wrong. o3 and o4 are remembered exactly.
    assert_eq!(directory.last_seq(), 8);
    assert!(directory.log.dropped.len() <= 3);
    for (owner, after, missed, kept) in [
        ("o0", 0, true, 0),
        ("o4", 0, true, 0),
        ("o4", 5, false, 0),
        ("o5", 0, true, 1),
        ("o5", 3, false, 1),
        ("o3", 3, true, 0),
        ("o3", 4, false, 0),
        ("o5", 5, false, 1),
        ("o7", 7, false, 1),
        ("o7", 8, false, 0),
    ] {
        let page = directory.events_after(owner, after);
        assert_eq!(
            (page.missed, page.events.len()),
            (missed, kept),
            "{owner} after {after}"
        );
    }
}

#[test]
fn ended_actors_are_forgotten_oldest_first_and_keep_no_args() {
    let config = DirectoryConfig {
        max_ended: 2,
        ..DirectoryConfig::default()
    };
    let table = ResourceTable::new();
    table.add_node(NodeId(1), res("cpu=8")).expect("a new node");
    let mut directory = ActorDirectory::new(config);
    let mut actors = Vec::new();
    for _ in 0..4 {
        let request = SpawnRequest {
            label: None,
            kind: "worker".to_string(),
            args: b"weights".to_vec(),
            resources: res("cpu=1"),
            strategy: Pack,
            process_group: "torch".to_string(),
            restart: RestartPolicy::default(),
        };
        let (actor, action) = directory.spawn(7, "alice", request, &table).expect("room");
        let ActorAction::Start {
            kind,
            args,
            process_group,
            ..
        } = action
        else {
            panic!("spawn starts: {action:?}");
        };
        assert_eq!(
            (kind.as_str(), args.as_slice(), process_group.as_str()),
            ("worker", b"weights".as_slice(), "torch")
        );
        actors.push(actor);
    }
    for actor in &actors[..3] {
        assert_eq!(
            directory.failed(9, *actor, NodeId(1), "x", FailureOrigin::Here, &table),
            Ok(())
        );
    }
    let known: Vec<u64> = directory.records().map(|record| record.id().0).collect();
    assert_eq!(known, [2, 3, 4]);
    assert_eq!(directory.locate(actors[0]), None);
    let record = directory.get(actors[1]).expect("kept");
    assert_eq!(
        (record.state(), record.args(), record.last_failure()),
        (ActorState::Failed, &[][..], Some("x"))
    );
    let live = directory.get(actors[3]).expect("live");
    assert_eq!(
        (live.args(), live.owner(), live.spawned_at_ms(), live.gpus()),
        (&b"weights"[..], "alice", 7, &[][..])
    );
    assert_eq!(directory.actors_of("alice").count(), 1);
    assert_eq!(directory.actors_on(NodeId(1)).count(), 1);
    assert_eq!(table.totals().reservations, 1);
}

#[test]
fn a_restart_carries_the_same_kind_args_and_group_with_new_gpus() {
    let table = ResourceTable::new();
    table.add_node(NodeId(1), res("gpu=2")).expect("a new node");
    table.add_node(NodeId(2), res("gpu=4")).expect("a new node");
    let mut directory = ActorDirectory::new(DirectoryConfig::default());
    let request = SpawnRequest {
        label: None,
        kind: "trainer".to_string(),
        args: vec![1, 2, 3],
        resources: res("gpu=2"),
        strategy: Pack,
        process_group: "rank0".to_string(),
        restart: RestartPolicy {
            max_restarts: 1,
            backoff_ms: 10,
        },
    };
    let (actor, first) = directory.spawn(0, "job", request, &table).expect("room");
    let holder = table
        .reservation(ReservationId(1))
        .map(|reservation| reservation.owner);
    assert_eq!(holder.as_deref(), Some("actor:1"));
    let lost = table.remove_node(NodeId(1));
    directory.node_lost(5, NodeId(1), "dead", lost.iter().map(|r| r.id), &table);
    let again = directory.tick(15, &table);
    let want = ActorAction::Start {
        actor,
        node: NodeId(2),
        reservation: ReservationId(2),
        gpus: vec![0, 1],
        kind: "trainer".to_string(),
        args: vec![1, 2, 3],
        process_group: "rank0".to_string(),
    };
    assert_eq!(first.node(), NodeId(1));
    assert_eq!(again, [want]);
    assert_eq!(again[0].actor(), actor);
    let record = directory.get(actor).expect("live");
    assert_eq!(record.restarts(), 1);
    assert_eq!(record.last_failure(), Some("node 1 lost: dead"));
    assert_eq!(record.last_origin(), FailureOrigin::NodeLost);
    assert_eq!(record.reservation(), Some(ReservationId(2)));
}

#[test]
fn resources_are_released_exactly_once() {
    // Every way an actor can end or move, then every report that could release twice.
    let table = ResourceTable::new();
    table.add_node(NodeId(1), res("gpu=4")).expect("a new node");
    table.add_node(NodeId(2), res("gpu=4")).expect("a new node");
    let mut directory = ActorDirectory::new(DirectoryConfig::default());
    let spawn = |directory: &mut ActorDirectory, restarts: u32| {
        let request = SpawnRequest {
            label: None,
            kind: "worker".to_string(),
            args: Vec::new(),
            resources: res("gpu=1"),
            strategy: Spread,
            process_group: String::new(),
            restart: RestartPolicy {
                max_restarts: restarts,
                backoff_ms: 0,
            },
        };
        directory.spawn(0, "o", request, &table).expect("room").0
    };
    let actors: Vec<ActorId> = (0..6).map(|i| spawn(&mut directory, i % 2)).collect();
    for actor in &actors {
        let node = directory
            .locate(*actor)
            .and_then(|l| l.node)
            .expect("placed");
        assert_eq!(directory.started(1, *actor, node), None);
    }
    let reports = |directory: &mut ActorDirectory, at: u64| {
        for actor in &actors {
            for node in [NodeId(1), NodeId(2), NodeId(3)] {
                let _ = directory.failed(at, *actor, node, "again", FailureOrigin::Here, &table);
                let _ = directory.stopped(at, *actor, node, &table);
            }
        }
    };
    // The first failure releases; the rest are stale. Half the actors wait to restart.
    reports(&mut directory, 2);
    assert_eq!(table.totals().reservations, 0);
    for node in [NodeId(1), NodeId(2)] {
        let lost = table.remove_node(node);
        directory.node_lost(3, node, "dead", lost.iter().map(|r| r.id), &table);
    }
    reports(&mut directory, 4);
    table.add_node(NodeId(3), res("gpu=4")).expect("a new node");
    let restarted = directory.tick(5, &table);
    assert_eq!(restarted.len(), 3);
    assert_eq!(table.totals().reservations, 3);
    for action in &restarted {
        assert_eq!(directory.started(6, action.actor(), action.node()), None);
    }
    // Each restart fails once for good; node 3 stays, with nothing in use.
    reports(&mut directory, 7);
    directory.node_lost(8, NodeId(1), "dead", [], &table);
    let totals = table.totals();
    assert_eq!((totals.nodes, totals.reservations), (1, 0));
    assert_eq!(totals.used(), Resources::new());
    for actor in &actors {
        let record = directory.get(*actor).expect("kept");
        assert_eq!(record.reservation(), None, "{actor}");
        assert_eq!(record.state(), ActorState::Failed, "{actor}");
    }
    let failures = directory
        .events()
        .filter(|e| e.kind == ActorEventKind::Failed);
    assert_eq!(failures.count(), 6);
    assert_eq!(directory.tick(100, &table), []);
}

#[test]
fn errors_and_names_read_well() {
    let actor = ActorId(7);
    let cases = [
        (DirectoryError::UnknownActor { actor }, "unknown actor 7"),
        (
            DirectoryError::NotOwner { actor },
            "actor 7 belongs to another owner",
        ),
        (
            DirectoryError::from(PlacementError::Busy {
                reason: "needs 1 gpu on one node; 2 of 2 gpu in use".to_string(),
            }),
            "busy: needs 1 gpu on one node; 2 of 2 gpu in use",
        ),
    ];
    for (error, want) in cases {
        assert_eq!(error.to_string(), want);
    }
    let states = [
        (ActorState::Starting, "starting", false),
        (ActorState::Running, "running", false),
        (
            ActorState::Restarting {
                attempt: 1,
                at_ms: 0,
            },
            "restarting",
            false,
        ),
        (ActorState::Stopping { kill: false }, "stopping", false),
        (ActorState::Failed, "failed", true),
        (ActorState::Stopped, "stopped", true),
    ];
    for (state, name, ended) in states {
        assert_eq!(
            (state.to_string().as_str(), state.is_ended()),
            (name, ended)
        );
    }
    let kinds = [
        (ActorEventKind::Failed, "failed"),
        (ActorEventKind::Restarting, "restarting"),
        (ActorEventKind::Restarted, "restarted"),
        (ActorEventKind::Stopped, "stopped"),
    ];
    for (kind, name) in kinds {
        assert_eq!(kind.to_string(), name);
    }
}

#[test]
fn a_node_back_in_a_new_session_keeps_the_actors_of_its_new_session() {
    let table = ResourceTable::new();
    table.add_node(NodeId(1), res("gpu=2")).expect("a new node");
    let mut directory = ActorDirectory::new(DirectoryConfig::default());
    let request = SpawnRequest {
        label: None,
        kind: "worker".to_string(),
        args: Vec::new(),
        resources: res("gpu=1"),
        strategy: Pack,
        process_group: String::new(),
        restart: RestartPolicy::default(),
    };
    let (old, _) = directory
        .spawn(0, "o", request.clone(), &table)
        .expect("room");
    // The node joins again: the head swaps its table entry, an actor is placed on the new
    // session, and only then does the old session's loss reach the directory.
    let lost = table.remove_node(NodeId(1));
    table.add_node(NodeId(1), res("gpu=2")).expect("back");
    let (new, _) = directory.spawn(5, "o", request, &table).expect("room");
    directory.node_lost(10, NodeId(1), "replaced", lost.iter().map(|r| r.id), &table);
    let state = |directory: &ActorDirectory, actor| directory.locate(actor).map(|l| l.state);
    assert_eq!(state(&directory, old), Some(ActorState::Failed));
    assert_eq!(state(&directory, new), Some(ActorState::Starting));
    assert_eq!(
        directory.get(new).and_then(ActorRecord::reservation),
        Some(ReservationId(2))
    );
    assert_eq!(table.totals().reservations, 1);
    // A loss naming no reservation of an actor, or another node's, fails nothing.
    directory.node_lost(11, NodeId(1), "replaced", [ReservationId(1)], &table);
    directory.node_lost(11, NodeId(2), "dead", [ReservationId(2)], &table);
    assert_eq!(state(&directory, new), Some(ActorState::Starting));
    assert_eq!(table.totals().reservations, 1);
}
