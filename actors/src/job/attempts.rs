//! Each rank's attempts: which trainer actors have held a rank number, on which node, so
//! that a rank's log can be asked for by job, rank and attempt (`imgrun logs JOB --rank N
//! --attempt K`) after its trainer was replaced. A pure table, changed only by
//! [`RankAttempts::with_world`]; the asking is `ranks.rs`'s.
//!
//! The rules, each time the job's ranks are set (its first world, each world after a
//! regroup or a growth, and again for the same world):
//! - attempt 0 of rank N is the first trainer that held N; a rank whose trainer (its
//!   actor, or that actor's node) differs from its newest attempt's gets a new attempt,
//!   numbered on; the same trainer again changes nothing;
//! - a rank the new world lacks keeps its attempts, all ended, and is not current; a
//!   world that has it again adds to them;
//! - nothing is forgotten: a job has as many attempts as its worlds gave trainers.
//!
//! A survivor that a regroup numbered anew is an attempt of its new rank and stays one of
//! its old: its process's lines are one log, whatever rank it held when it wrote them.

use std::collections::{BTreeMap, BTreeSet};

use runtime::{ActorId, NodeId};

/// One trainer that held a rank: its actor and its node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Trainer {
    pub(crate) actor: ActorId,
    pub(crate) node: NodeId,
}

/// Every rank's attempts, oldest first, and the ranks of the world now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RankAttempts {
    ranks: BTreeMap<u32, Vec<Trainer>>,
    current: BTreeSet<u32>,
}

/// The attempt a request names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Found {
    pub(crate) attempt: u32,
    /// How many attempts the rank has had.
    pub(crate) attempts: u32,
    pub(crate) trainer: Trainer,
    /// Whether it is the trainer that holds the rank now.
    pub(crate) current: bool,
}

/// Why a request names no attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Missing {
    /// The current attempt of a rank the world lacks now (`attempts`: how many it had).
    Rank { ranks: Vec<u32>, attempts: u32 },
    /// An attempt past the rank's last.
    Attempt { attempts: u32 },
}

impl RankAttempts {
    /// The table once the job's world is `world`: each rank with its trainer.
    pub(crate) fn with_world(&self, world: &[(u32, Trainer)]) -> RankAttempts {
        let mut next = RankAttempts {
            ranks: self.ranks.clone(),
            current: world.iter().map(|(rank, _)| *rank).collect(),
        };
        for (rank, trainer) in world {
            let attempts = next.ranks.entry(*rank).or_default();
            if attempts.last() != Some(trainer) {
                attempts.push(*trainer);
            }
        }
        next
    }

    /// Attempt `attempt` of `rank`, or its current one when `None`.
    pub(crate) fn find(&self, rank: u32, attempt: Option<u32>) -> Result<Found, Missing> {
        let attempts = self.ranks.get(&rank).map_or(&[][..], Vec::as_slice);
        let count = u32::try_from(attempts.len()).unwrap_or(u32::MAX);
        let current = self.current.contains(&rank);
        let index = match attempt {
            Some(attempt) => attempt,
            None if current => count.saturating_sub(1),
            None => {
                return Err(Missing::Rank {
                    ranks: self.current.iter().copied().collect(),
                    attempts: count,
                });
            }
        };
        let Some(trainer) = attempts.get(index as usize) else {
            return Err(Missing::Attempt { attempts: count });
        };
        Ok(Found {
            attempt: index,
            attempts: count,
            trainer: *trainer,
            current: current && index + 1 == count,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A trainer by its actor's number, on the node of the same number's tens.
    fn t(actor: u64) -> Trainer {
        Trainer {
            actor: ActorId(actor),
            node: NodeId(actor / 10),
        }
    }

    /// `rank: actor@node …, *` for the current ranks, one rank a line.
    fn table(attempts: &RankAttempts) -> Vec<String> {
        attempts
            .ranks
            .iter()
            .map(|(rank, trainers)| {
                let list: Vec<String> = trainers
                    .iter()
                    .map(|t| format!("{}@{}", t.actor.0, t.node.0))
                    .collect();
                let now = if attempts.current.contains(rank) {
                    " *"
                } else {
                    ""
                };
                format!("{rank}: {}{now}", list.join(" "))
            })
            .collect()
    }

    #[test]
    fn each_world_adds_an_attempt_to_the_ranks_whose_trainer_changed() {
        // (what happens, the world set, the table after it)
        type World<'a> = &'a [(u32, Trainer)];
        let steps: [(&str, World, &[&str]); 7] = [
            (
                "the first world",
                &[(0, t(10)), (1, t(20)), (2, t(30))],
                &["0: 10@1 *", "1: 20@2 *", "2: 30@3 *"],
            ),
            (
                "the same world again",
                &[(0, t(10)), (1, t(20)), (2, t(30))],
                &["0: 10@1 *", "1: 20@2 *", "2: 30@3 *"],
            ),
            (
                "rank 1 lost: rank 2's trainer is rank 1 now",
                &[(0, t(10)), (1, t(30))],
                &["0: 10@1 *", "1: 20@2 30@3 *", "2: 30@3"],
            ),
            (
                "grown back: a new trainer is rank 2",
                &[(0, t(10)), (1, t(30)), (2, t(21))],
                &["0: 10@1 *", "1: 20@2 30@3 *", "2: 30@3 21@2 *"],
            ),
            (
                "the same actor on another node (restarted there)",
                &[
                    (0, t(10)),
                    (1, t(30)),
                    (
                        2,
                        Trainer {
                            actor: ActorId(21),
                            node: NodeId(5),
                        },
                    ),
                ],
                &["0: 10@1 *", "1: 20@2 30@3 *", "2: 30@3 21@2 21@5 *"],
            ),
            (
                "down to one",
                &[(0, t(10))],
                &["0: 10@1 *", "1: 20@2 30@3", "2: 30@3 21@2 21@5"],
            ),
            (
                "rank 1 again, its last trainer back",
                &[(0, t(10)), (1, t(30))],
                &["0: 10@1 *", "1: 20@2 30@3 *", "2: 30@3 21@2 21@5"],
            ),
        ];
        let mut attempts = RankAttempts::default();
        for (what, world, want) in steps {
            attempts = attempts.with_world(world);
            assert_eq!(table(&attempts), want, "{what}");
        }
    }

    #[test]
    fn a_request_finds_its_attempt_or_says_why_not() {
        let attempts = RankAttempts::default()
            .with_world(&[(0, t(10)), (1, t(20)), (2, t(30))])
            .with_world(&[(0, t(10)), (1, t(30))]);
        let found = |attempt, attempts, actor, current| {
            Ok(Found {
                attempt,
                attempts,
                trainer: t(actor),
                current,
            })
        };
        // (rank, attempt asked, what is found)
        let cases = [
            (0, None, found(0, 1, 10, true)),
            (0, Some(0), found(0, 1, 10, true)),
            (1, None, found(1, 2, 30, true)),
            (1, Some(0), found(0, 2, 20, false)),
            (1, Some(1), found(1, 2, 30, true)),
            (1, Some(2), Err(Missing::Attempt { attempts: 2 })),
            (1, Some(u32::MAX), Err(Missing::Attempt { attempts: 2 })),
            (2, Some(0), found(0, 1, 30, false)),
            (
                2,
                None,
                Err(Missing::Rank {
                    ranks: vec![0, 1],
                    attempts: 1,
                }),
            ),
            (
                7,
                None,
                Err(Missing::Rank {
                    ranks: vec![0, 1],
                    attempts: 0,
                }),
            ),
            (7, Some(0), Err(Missing::Attempt { attempts: 0 })),
        ];
        for (rank, attempt, want) in cases {
            assert_eq!(
                attempts.find(rank, attempt),
                want,
                "rank {rank} {attempt:?}"
            );
        }
        let none = RankAttempts::default();
        assert_eq!(
            none.find(0, None),
            Err(Missing::Rank {
                ranks: Vec::new(),
                attempts: 0
            }),
            "before the first world"
        );
    }
}
