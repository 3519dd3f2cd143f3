//! Tests of the resource table: transcripts of changes, then real threads racing.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Barrier, Mutex};
use std::thread;

use super::*;
use crate::placement::choose::tests::res;

/// One call in a transcript.
#[derive(Debug, Clone, Copy)]
enum Op {
    /// `add_node(node, capacity)`, with GPUs numbered by the list when it is not empty.
    Add(u64, &'static str, &'static [u32]),
    Remove(u64),
    Reserve(&'static str, Strategy),
    /// `reserve_all` of the requests separated by `;`.
    Gang(&'static str, Strategy),
    Release(u64),
    Usage,
    Totals,
}

/// Runs `ops` on an empty table and checks what each returned.
fn run(name: &str, ops: &[(Op, &[&str])]) {
    let table = ResourceTable::new();
    for (i, (op, want)) in ops.iter().enumerate() {
        let got = apply(&table, *op);
        assert_eq!(got, *want, "{name}: op {i} {op:?}");
    }
}

fn apply(table: &ResourceTable, op: Op) -> Vec<String> {
    let shown = |result: Result<Vec<Reservation>, PlacementError>| match result {
        Ok(reservations) => reservations.iter().map(show).collect(),
        Err(error) => vec![error.to_string()],
    };
    match op {
        Op::Add(node, capacity, gpus) => {
            let mut capacity = NodeCapacity::new(res(capacity));
            if !gpus.is_empty() {
                capacity = capacity.with_gpu_indices(gpus.iter().copied());
            }
            match table.add_node(NodeId(node), capacity) {
                Ok(()) => vec![],
                Err(error) => vec![error.to_string()],
            }
        }
        Op::Remove(node) => {
            let lost: Vec<String> = table
                .remove_node(NodeId(node))
                .iter()
                .map(|r| format!("r{}", r.id))
                .collect();
            vec![format!("lost {}", lost.join(","))]
        }
        Op::Reserve(request, strategy) => shown(
            table
                .reserve(&res(request), strategy, "solo")
                .map(|r| vec![r]),
        ),
        Op::Gang(requests, strategy) => {
            let requests: Vec<Resources> = requests.split(';').map(res).collect();
            shown(table.reserve_all(&requests, strategy, "gang"))
        }
        Op::Release(id) => shown(table.release(ReservationId(id)).map(|r| vec![r])),
        Op::Usage => table
            .usage()
            .iter()
            .map(|u| {
                let held: Vec<String> = u
                    .reservations
                    .iter()
                    .map(|r| format!("r{}:{}", r.id, r.owner))
                    .collect();
                format!(
                    "n{} used {}; free {}; free gpus [{}]; {}",
                    u.node,
                    u.used,
                    u.free(),
                    indices(&u.free_gpus),
                    held.join(" ")
                )
            })
            .collect(),
        Op::Totals => {
            let t = table.totals();
            vec![format!(
                "{} nodes, {} reservations; total {}; free {}; used {}",
                t.nodes,
                t.reservations,
                t.total,
                t.free,
                t.used()
            )]
        }
    }
}

fn show(r: &Reservation) -> String {
    format!(
        "r{} n{} {} gpus [{}]",
        r.id,
        r.node,
        r.resources,
        r.cuda_visible_devices()
    )
}

fn indices(gpus: &[u32]) -> String {
    let text: Vec<String> = gpus.iter().map(u32::to_string).collect();
    text.join(",")
}

use Op::{Add, Gang, Release, Remove, Reserve, Totals, Usage};
use Strategy::{Node, Pack, Spread};

#[test]
fn gpus_are_handed_out_by_index_and_come_back() {
    run(
        "gpu indices",
        &[
            (Add(1, "cpu=8", &[4, 6, 7]), &[]),
            (Reserve("gpu=2", Pack), &["r1 n1 2 gpu gpus [4,6]"]),
            (
                Reserve("gpu=1 cpu=2", Pack),
                &["r2 n1 1 gpu, 2 cpu gpus [7]"],
            ),
            (
                Reserve("gpu=1", Pack),
                &["busy: needs 1 gpu on one node; 3 of 3 gpu in use"],
            ),
            (Release(1), &["r1 n1 2 gpu gpus [4,6]"]),
            (
                Usage,
                &["n1 used 1 gpu, 2 cpu; free 2 gpu, 6 cpu; free gpus [4,6]; r2:solo"],
            ),
            (Reserve("gpu=1", Pack), &["r3 n1 1 gpu gpus [4]"]),
            (Reserve("cpu=1", Pack), &["r4 n1 1 cpu gpus []"]),
            (Reserve("", Pack), &["r5 n1 nothing gpus []"]),
            (Release(1), &["unknown reservation 1"]),
            (
                Usage,
                &[
                    "n1 used 2 gpu, 3 cpu; free 1 gpu, 5 cpu; free gpus [6]; r2:solo r3:solo r4:solo r5:solo",
                ],
            ),
            (Release(2), &["r2 n1 1 gpu, 2 cpu gpus [7]"]),
            (Release(3), &["r3 n1 1 gpu gpus [4]"]),
            (Release(4), &["r4 n1 1 cpu gpus []"]),
            (Release(5), &["r5 n1 nothing gpus []"]),
            (
                Usage,
                &["n1 used nothing; free 3 gpu, 8 cpu; free gpus [4,6,7]; "],
            ),
        ],
    );
}

#[test]
fn a_refused_request_or_gang_leaves_nothing_reserved() {
    let before = "2 nodes, 1 reservations; total 4 gpu; free 3 gpu; used 1 gpu";
    run(
        "refusals",
        &[
            (Add(1, "gpu=2", &[]), &[]),
            (Add(2, "gpu=2", &[]), &[]),
            (Reserve("gpu=1", Node(NodeId(2))), &["r1 n2 1 gpu gpus [0]"]),
            (Totals, &[before]),
            (
                Gang("gpu=1;gpu=1;gpu=1;gpu=1", Spread),
                &["busy: request 4 of 4: needs 1 gpu on one node; 4 of 4 gpu in use"],
            ),
            (
                Gang("gpu=1;gpu=1;gpu=1;gpu=1;gpu=1", Spread),
                &[
                    "unsatisfiable: 5 requests need 5 gpu in all; even an idle cluster takes only 4 of them",
                ],
            ),
            (
                Gang("gpu=1;tpu=1", Pack),
                &["unsatisfiable: request 2 of 2: needs 1 tpu on one node; no node has any tpu"],
            ),
            (
                Reserve("gpu=3", Spread),
                &["unsatisfiable: needs 3 gpu on one node; the largest node has 2 (node 1)"],
            ),
            (Reserve("gpu=1", Node(NodeId(3))), &["unknown node 3"]),
            (Totals, &[before]),
            (
                Gang("gpu=1;gpu=1;gpu=1", Spread),
                &[
                    "r2 n1 1 gpu gpus [0]",
                    "r3 n1 1 gpu gpus [1]",
                    "r4 n2 1 gpu gpus [1]",
                ],
            ),
            (
                Totals,
                &["2 nodes, 4 reservations; total 4 gpu; free nothing; used 4 gpu"],
            ),
        ],
    );
}

#[test]
fn removing_a_node_returns_what_was_lost_with_it() {
    run(
        "remove",
        &[
            (Add(1, "gpu=2 cpu=4", &[]), &[]),
            (Add(2, "gpu=2 cpu=4", &[]), &[]),
            (Add(2, "gpu=8", &[]), &["node 2 is already in the table"]),
            (
                Gang("gpu=1;gpu=1;gpu=1;gpu=1", Spread),
                &[
                    "r1 n1 1 gpu gpus [0]",
                    "r2 n2 1 gpu gpus [0]",
                    "r3 n1 1 gpu gpus [1]",
                    "r4 n2 1 gpu gpus [1]",
                ],
            ),
            (Remove(1), &["lost r1,r3"]),
            (
                Totals,
                &["1 nodes, 2 reservations; total 2 gpu, 4 cpu; free 4 cpu; used 2 gpu"],
            ),
            (Release(1), &["unknown reservation 1"]),
            (Release(2), &["r2 n2 1 gpu gpus [0]"]),
            (Remove(1), &["lost "]),
            (Reserve("gpu=1", Node(NodeId(1))), &["unknown node 1"]),
            (Add(1, "gpu=1", &[]), &[]),
            (Reserve("gpu=1", Node(NodeId(1))), &["r5 n1 1 gpu gpus [0]"]),
            (
                Usage,
                &[
                    "n1 used 1 gpu; free nothing; free gpus []; r5:solo",
                    "n2 used 1 gpu; free 1 gpu, 4 cpu; free gpus [0]; r4:gang",
                ],
            ),
            (Remove(2), &["lost r4"]),
            (Remove(1), &["lost r5"]),
            (
                Totals,
                &["0 nodes, 0 reservations; total nothing; free nothing; used nothing"],
            ),
        ],
    );
}

#[test]
fn reservations_are_found_by_id() {
    let table = ResourceTable::new();
    table.add_node(NodeId(1), res("gpu=1 cpu=2")).expect("add");
    let r = table
        .reserve(&res("gpu=1"), Pack, "actor:12")
        .expect("reserve");
    assert_eq!(table.reservation(r.id), Some(r.clone()));
    assert_eq!(table.reservation(ReservationId(99)), None);
    assert_eq!(
        table.node_usage(NodeId(1)).map(|u| u.reservations),
        Some(vec![r.clone()])
    );
    assert_eq!(table.node_usage(NodeId(2)), None);
    table.release(r.id).expect("release");
    assert_eq!(table.reservation(r.id), None);
}

/// Many threads race for the last GPUs, rounds on end: exactly as many win as there are
/// GPUs, each with a different one, and the losers are told the table is busy.
#[test]
fn racing_threads_never_share_a_gpu() {
    const THREADS: usize = 8;
    for round in 0..40 {
        let table = ResourceTable::new();
        table.add_node(NodeId(1), res("gpu=2")).expect("add");
        table.add_node(NodeId(2), res("gpu=1")).expect("add");
        let barrier = Barrier::new(THREADS);
        let results: Vec<Result<Reservation, PlacementError>> = thread::scope(|scope| {
            let handles: Vec<_> = (0..THREADS)
                .map(|i| {
                    let (table, barrier) = (&table, &barrier);
                    let strategy = if i % 2 == 0 { Pack } else { Spread };
                    scope.spawn(move || {
                        barrier.wait();
                        table.reserve(&res("gpu=1"), strategy, "racer")
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("racer"))
                .collect()
        });
        let won: HashSet<(NodeId, Vec<u32>)> = results
            .iter()
            .flatten()
            .map(|r| (r.node, r.gpus.clone()))
            .collect();
        let busy = results
            .iter()
            .filter(|r| matches!(r, Err(PlacementError::Busy { .. })))
            .count();
        assert_eq!(
            (won.len(), busy),
            (3, THREADS - 3),
            "round {round}: {results:?}"
        );
        for r in results.iter().flatten() {
            table.release(r.id).expect("release");
        }
        assert_eq!(table.totals().free, res("gpu=3"), "round {round}");
    }
}

/// Gangs that cannot both fit race: one wins whole, the others get nothing at all.
#[test]
fn racing_gangs_win_whole_or_not_at_all() {
    const THREADS: usize = 6;
    for round in 0..40 {
        let table = ResourceTable::new();
        table.add_node(NodeId(1), res("gpu=2 cpu=4")).expect("add");
        table.add_node(NodeId(2), res("gpu=2 cpu=4")).expect("add");
        let gang = vec![res("gpu=1 cpu=1"); 3];
        let barrier = Barrier::new(THREADS);
        let results: Vec<Result<Vec<Reservation>, PlacementError>> = thread::scope(|scope| {
            let handles: Vec<_> = (0..THREADS)
                .map(|_| {
                    let (table, barrier, gang) = (&table, &barrier, &gang);
                    scope.spawn(move || {
                        barrier.wait();
                        table.reserve_all(gang, Spread, "gang")
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("gang"))
                .collect()
        });
        let winners: Vec<&Vec<Reservation>> = results.iter().flatten().collect();
        assert_eq!(winners.len(), 1, "round {round}: {results:?}");
        assert_eq!(winners[0].len(), 3);
        let totals = table.totals();
        assert_eq!(totals.reservations, 3, "round {round}: losers left nothing");
        assert_eq!(totals.used(), res("gpu=3 cpu=3"), "round {round}");
    }
}

/// Threads reserve (single and gangs, every strategy) and release at random for a while,
/// with a reader checking every node as it goes: no GPU is ever held twice, no node gives
/// more than it has, and when all is released the table is back to where it started.
#[test]
fn concurrent_reservations_never_exceed_capacity_and_all_come_back() {
    const THREADS: u64 = 6;
    const OPS: usize = 300;
    let table = ResourceTable::new();
    let capacities = ["gpu=2 cpu=8", "gpu=4 cpu=16 tpu=1", "cpu=4", "gpu=1 cpu=2"];
    for (i, capacity) in capacities.iter().enumerate() {
        table
            .add_node(NodeId(i as u64 + 1), res(capacity))
            .expect("add");
    }
    let initial = table.totals();
    let held_gpus: Mutex<HashSet<(NodeId, u32)>> = Mutex::new(HashSet::new());
    let done = AtomicBool::new(false);
    let requests = [
        "gpu=1",
        "gpu=2",
        "gpu=1 cpu=2",
        "cpu=1",
        "cpu=500m",
        "tpu=1",
        "",
    ];
    let strategies = [Pack, Spread, Node(NodeId(2)), Node(NodeId(4))];
    thread::scope(|scope| {
        scope.spawn(|| {
            let mut checks = 0;
            while !done.load(Ordering::Acquire) || checks == 0 {
                for node in table.usage() {
                    check_node(&node);
                }
                checks += 1;
            }
        });
        let workers: Vec<_> = (0..THREADS)
            .map(|seed| {
                let (table, held_gpus) = (&table, &held_gpus);
                scope.spawn(move || {
                    let mut rng = SplitMix(seed);
                    let mut mine: Vec<Reservation> = Vec::new();
                    let mut granted = 0;
                    for _ in 0..OPS {
                        if rng.below(3) == 0 && !mine.is_empty() {
                            let r = mine.swap_remove(rng.below(mine.len()));
                            let mut held = held_gpus.lock().expect("held");
                            for gpu in &r.gpus {
                                held.remove(&(r.node, *gpu));
                            }
                            drop(held);
                            assert_eq!(table.release(r.id).as_ref(), Ok(&r));
                            continue;
                        }
                        let strategy = strategies[rng.below(strategies.len())];
                        let size = 1 + rng.below(3);
                        let gang: Vec<Resources> = (0..size)
                            .map(|_| res(requests[rng.below(requests.len())]))
                            .collect();
                        let result = if size == 1 {
                            table.reserve(&gang[0], strategy, "single").map(|r| vec![r])
                        } else {
                            table.reserve_all(&gang, strategy, "gang")
                        };
                        let Ok(reservations) = result else { continue };
                        let mut held = held_gpus.lock().expect("held");
                        for r in &reservations {
                            assert_eq!(r.gpus.len() as u64, r.resources.gpus());
                            for gpu in &r.gpus {
                                assert!(held.insert((r.node, *gpu)), "gpu held twice: {r:?}");
                            }
                        }
                        drop(held);
                        granted += reservations.len();
                        mine.extend(reservations);
                    }
                    for r in mine.drain(..) {
                        let mut held = held_gpus.lock().expect("held");
                        for gpu in &r.gpus {
                            held.remove(&(r.node, *gpu));
                        }
                        drop(held);
                        assert_eq!(table.release(r.id).as_ref(), Ok(&r));
                    }
                    granted
                })
            })
            .collect();
        let _stop_reader = SetOnDrop(&done);
        let granted: usize = workers.into_iter().map(|w| w.join().expect("worker")).sum();
        assert!(granted > 100, "the workers got something done: {granted}");
    });
    let totals = table.totals();
    assert_eq!(totals, initial);
    for node in table.usage() {
        assert_eq!(
            (node.free_gpus.len(), node.reservations.len()),
            (node.gpus.len(), 0)
        );
    }
}

/// Nodes are removed and added again while threads reserve and release: every reservation
/// ends exactly once, released by its holder or lost with its node.
#[test]
fn every_reservation_is_released_or_lost_exactly_once() {
    const THREADS: u64 = 4;
    const OPS: usize = 200;
    let table = ResourceTable::new();
    for node in 1..=3 {
        table
            .add_node(NodeId(node), res("gpu=2 cpu=4"))
            .expect("add");
    }
    let initial = table.totals();
    let lost: Mutex<HashSet<ReservationId>> = Mutex::new(HashSet::new());
    let done = AtomicBool::new(false);
    let (granted, released) = thread::scope(|scope| {
        scope.spawn(|| {
            let mut rng = SplitMix(99);
            let mut turns = 0;
            while !done.load(Ordering::Acquire) || turns == 0 {
                let node = NodeId(1 + rng.below(3) as u64);
                let gone = table.remove_node(node);
                lost.lock().expect("lost").extend(gone.iter().map(|r| r.id));
                table.add_node(node, res("gpu=2 cpu=4")).expect("re-add");
                turns += 1;
            }
        });
        let workers: Vec<_> = (0..THREADS)
            .map(|seed| {
                let table = &table;
                scope.spawn(move || {
                    let mut rng = SplitMix(seed);
                    let (mut mine, mut granted, mut released) =
                        (Vec::new(), Vec::new(), Vec::new());
                    for _ in 0..OPS {
                        if rng.below(2) == 0 && !mine.is_empty() {
                            let id = mine.swap_remove(rng.below(mine.len()));
                            match table.release(id) {
                                Ok(_) => released.push(id),
                                Err(error) => {
                                    assert_eq!(error, PlacementError::UnknownReservation { id })
                                }
                            }
                        } else if let Ok(r) = table.reserve(&res("gpu=1 cpu=1"), Spread, "w") {
                            granted.push(r.id);
                            mine.push(r.id);
                        }
                    }
                    for id in mine {
                        if table.release(id).is_ok() {
                            released.push(id);
                        }
                    }
                    (granted, released)
                })
            })
            .collect();
        let _stop_remover = SetOnDrop(&done);
        let mut all = (Vec::new(), Vec::new());
        for worker in workers {
            let (granted, released) = worker.join().expect("worker");
            all.0.extend(granted);
            all.1.extend(released);
        }
        all
    });
    let lost = lost.into_inner().expect("lost");
    let released: HashSet<ReservationId> = released.into_iter().collect();
    assert!(released.is_disjoint(&lost), "released and lost");
    let ended: HashSet<ReservationId> = released.union(&lost).copied().collect();
    let granted: HashSet<ReservationId> = granted.into_iter().collect();
    assert_eq!(ended, granted);
    assert_eq!(table.totals(), initial);
}

/// Sets its flag when dropped, even by a panic: the thread watching the flag stops, so a
/// failing worker fails the test instead of hanging it.
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// What every node must show to any reader at any time.
fn check_node(node: &NodeUsage) {
    assert!(node.used.fits_in(&node.total), "{node:?}");
    let sum = node
        .reservations
        .iter()
        .fold(Resources::new(), |sum, r| sum.saturating_add(&r.resources));
    assert_eq!(sum, node.used, "{node:?}");
    assert_eq!(node.free_gpus.len() as u64, node.free().gpus(), "{node:?}");
    let mut gpus: Vec<u32> = node
        .reservations
        .iter()
        .flat_map(|r| r.gpus.clone())
        .collect();
    gpus.extend(&node.free_gpus);
    gpus.sort_unstable();
    assert_eq!(gpus, node.gpus, "every gpu once: {node:?}");
}

/// SplitMix64: random choices that are the same on every run of a thread.
struct SplitMix(u64);

impl SplitMix {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) % n as u64) as usize
    }
}
