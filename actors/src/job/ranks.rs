//! The hang doctor: every rank's phase now (from its monitor, which answers while the
//! trainer is busy), for `imgrun jobs JOB --ranks`, and the rank a call in flight waits
//! for, named while it happens; and a rank's own log (the newest lines its trainer's
//! process wrote, kept by its node), of the trainer that holds the rank now or of an
//! earlier attempt (`attempts.rs`), asked of that attempt's node by actor id.

use std::collections::HashSet;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use runtime::ActorCallError;

use super::attempts::{Missing, RankAttempts, Trainer};
use super::calls::{RankHandle, call_one};
use crate::train::phase::{Phase, PhaseRequest, RankPhase};

/// How long a monitor may take to answer before its rank is said not to answer.
const MONITOR_TIMEOUT: Duration = Duration::from_secs(2);

/// One rank as the hang doctor sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankView {
    pub rank: u32,
    pub node: u64,
    /// Its phase, when its monitor answered.
    pub phase: Option<RankPhase>,
    /// Why there is no phase: its monitor did not answer (a process stopped, hung or
    /// gone), or there is none.
    pub problem: Option<String>,
    /// How long ago the head last heard its node's heartbeat, when the head answered.
    #[serde(default)]
    pub heartbeat_ms_ago: Option<u64>,
}

/// Every rank's phase, asked of all monitors at once, and its node's last heartbeat from
/// `client`'s head.
pub(crate) async fn rank_views(
    ranks: &[RankHandle],
    client: Option<&runtime::ClusterClient>,
) -> Vec<RankView> {
    let heartbeats: std::collections::HashMap<u64, u64> = match client {
        Some(client) => match tokio::time::timeout(MONITOR_TIMEOUT, client.status()).await {
            Ok(Ok(status)) => status
                .nodes
                .iter()
                .map(|node| (node.id.0, node.last_heartbeat_ms_ago))
                .collect(),
            _ => Default::default(),
        },
        None => Default::default(),
    };
    let mut tasks = tokio::task::JoinSet::new();
    for rank in ranks {
        let rank = rank.clone();
        tasks.spawn(async move {
            let (phase, problem) = match &rank.monitor {
                None => (None, Some("no monitor (it could not start)".to_string())),
                Some(monitor) => {
                    let asked = RankHandle {
                        actor: monitor.clone(),
                        ..rank.clone()
                    };
                    match call_one(&asked, &PhaseRequest {}, MONITOR_TIMEOUT).await {
                        Ok(phase) => (Some(phase), None),
                        Err(error) => (
                            None,
                            Some(format!(
                                "no answer within {} s (its process is stopped, hung or \
                                 gone): {error}",
                                MONITOR_TIMEOUT.as_secs()
                            )),
                        ),
                    }
                }
            };
            RankView {
                rank: rank.rank,
                node: rank.place.node.0,
                phase,
                problem,
                heartbeat_ms_ago: None,
            }
        });
    }
    let mut views = Vec::new();
    while let Some(Ok(view)) = tasks.join_next().await {
        views.push(view);
    }
    views.sort_by_key(|v| v.rank);
    for view in &mut views {
        view.heartbeat_ms_ago = heartbeats.get(&view.node).copied();
    }
    views
}

/// What to say of the ranks while a step is in flight for longer than `late_secs`: a
/// rank that does not answer, or one still waiting for data or computing while another
/// already waits in the allreduce, each named once (`told` remembers whom).
pub(crate) fn hold_ups(views: &[RankView], late_secs: f64, told: &mut HashSet<u32>) -> Vec<String> {
    let someone_waits = views.iter().any(|v| {
        v.phase
            .as_ref()
            .is_some_and(|p| p.phase == Phase::Averaging)
    });
    let mut said = Vec::new();
    for view in views {
        let name = format!("rank {} (node {})", view.rank, view.node);
        let line = match (&view.phase, &view.problem) {
            (None, Some(problem)) => Some(format!("{name} holds the others up: {problem}")),
            (Some(phase), _)
                if someone_waits
                    && matches!(phase.phase, Phase::WaitingForData | Phase::Computing)
                    && phase.seconds >= late_secs =>
            {
                let why = match phase.phase {
                    Phase::WaitingForData => {
                        "its loader is the bottleneck (more loader workers, local copies \
                         of the shards, or a faster source)"
                    }
                    _ => "it computes slower than the others (a slower or busier machine)",
                };
                let reading = match phase.phase {
                    Phase::WaitingForData => reading_now(&phase.reading),
                    _ => String::new(),
                };
                Some(format!(
                    "{name} has been {} for {:.0} s at step {}{reading} while the others wait \
                     for it in the allreduce: {why}",
                    phase.describe(),
                    phase.seconds,
                    phase.step
                ))
            }
            _ => None,
        };
        if let Some(line) = line
            && told.insert(view.rank)
        {
            said.push(line);
        }
    }
    said
}

/// `, reading URL (N bytes so far)` for the shards a rank's loader reads now.
fn reading_now(reading: &[crate::train::phase::ShardRead]) -> String {
    let shards: Vec<String> = reading
        .iter()
        .take(2)
        .map(|r| format!("{} ({} bytes so far)", r.url, r.bytes))
        .collect();
    match shards.len() {
        0 => String::new(),
        _ if reading.len() > 2 => format!(
            ", reading {} and {} more",
            shards.join(", "),
            reading.len() - 2
        ),
        _ => format!(", reading {}", shards.join(", ")),
    }
}

/// The newest lines rank `rank`'s trainer process wrote: its own log (the trainer's and
/// its loader's messages) and its libraries' (libtorch, NCCL), kept by its node. Of the
/// trainer that holds the rank now, or of an earlier one (`attempt`), which its node
/// keeps for a while after it ended, as long as that node's daemon runs.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RankOutputRequest {
    pub rank: u32,
    /// How many of the newest lines; at most 1,000 are kept.
    pub lines: u32,
    /// Which of the trainers that held the rank, from 0 (the first); `None` for the one
    /// that holds it now.
    #[serde(default)]
    pub attempt: Option<u32>,
}

/// The answer to a [`RankOutputRequest`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RankOutputReply {
    pub rank: u32,
    /// The node of the attempt shown.
    pub node: u64,
    /// Oldest first.
    pub lines: Vec<String>,
    /// False when the trainer runs in its node daemon's own process (its lines are in
    /// the daemon's log), which leaves `lines` empty.
    pub own_process: bool,
    /// The attempt shown, from 0.
    #[serde(default)]
    pub attempt: u32,
    /// How many attempts the rank has had (trainers that held it, the current one too).
    #[serde(default)]
    pub attempts: u32,
}

/// Why a rank's output could not be given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RankOutputError {
    /// No trainer holds the rank now (`attempts`: how many once did).
    #[error("the job has no rank {rank} now (its ranks: {ranks:?}){}", earlier(*attempts))]
    NoSuchRank {
        rank: u32,
        ranks: Vec<u32>,
        attempts: u32,
    },
    #[error("rank {rank} has no attempt {attempt} (it has had {attempts}{})", numbered(*attempts))]
    NoSuchAttempt {
        rank: u32,
        attempt: u32,
        attempts: u32,
    },
    /// The attempt's node keeps no lines of it, or is not in the cluster now.
    #[error(
        "the lines of rank {rank}'s attempt {attempt} (actor {actor} on node {node}) are gone: {reason}"
    )]
    Gone {
        rank: u32,
        attempt: u32,
        actor: u64,
        node: u64,
        reason: String,
    },
    #[error("rank {rank}'s node did not give its output: {reason}")]
    Unanswered { rank: u32, reason: String },
}

fn earlier(attempts: u32) -> String {
    match attempts {
        0 => String::new(),
        1 => "; its one earlier trainer is attempt 0".to_string(),
        n => format!("; its {n} earlier trainers are attempts 0 to {}", n - 1),
    }
}

fn numbered(attempts: u32) -> String {
    match attempts {
        0 => String::new(),
        1 => ": attempt 0".to_string(),
        n => format!(": attempts 0 to {}", n - 1),
    }
}

/// The newest `lines` lines of the process of the rank's attempt that `request` names:
/// the current trainer's asked through its handle (and, should that fail, of its node by
/// id: it may have just ended), an earlier one's of its node by actor id.
pub(crate) async fn rank_output(
    ranks: &[RankHandle],
    attempts: &RankAttempts,
    client: Option<&runtime::ClusterClient>,
    request: &RankOutputRequest,
) -> Result<RankOutputReply, RankOutputError> {
    let (rank, lines) = (request.rank, request.lines);
    let found = attempts
        .find(rank, request.attempt)
        .map_err(|missing| match missing {
            Missing::Rank { ranks, attempts } => RankOutputError::NoSuchRank {
                rank,
                ranks,
                attempts,
            },
            Missing::Attempt { attempts } => RankOutputError::NoSuchAttempt {
                rank,
                attempt: request.attempt.unwrap_or_default(),
                attempts,
            },
        })?;
    let Trainer { actor, node } = found.trainer;
    let handle = ranks
        .iter()
        .find(|handle| found.current && handle.rank == rank && handle.actor.id() == actor);
    let on_node = async {
        match client {
            Some(client) => client.actor_output_on(node, actor, lines).await,
            None => Err(ActorCallError::NodeNotLive {
                actor,
                node,
                state: "not known here (no cluster client)".to_string(),
            }),
        }
    };
    let output = match handle {
        Some(handle) => match handle.actor.output(lines).await {
            Ok(output) => Ok(output),
            Err(error) => on_node.await.map_err(|_| error),
        },
        None => on_node.await,
    };
    let output = output.map_err(|error| match error {
        ActorCallError::NoOutput { .. } | ActorCallError::NodeNotLive { .. } => {
            RankOutputError::Gone {
                rank,
                attempt: found.attempt,
                actor: actor.0,
                node: node.0,
                reason: error.to_string(),
            }
        }
        error => RankOutputError::Unanswered {
            rank,
            reason: error.to_string(),
        },
    })?;
    Ok(RankOutputReply {
        rank,
        node: node.0,
        lines: output.lines,
        own_process: output.own_process,
        attempt: found.attempt,
        attempts: found.attempts,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_rank_or_attempt_says_which_there_are() {
        let cases = [
            (
                RankOutputError::NoSuchRank {
                    rank: 2,
                    ranks: vec![0, 1],
                    attempts: 0,
                },
                "the job has no rank 2 now (its ranks: [0, 1])",
            ),
            (
                RankOutputError::NoSuchRank {
                    rank: 2,
                    ranks: vec![0, 1],
                    attempts: 2,
                },
                "the job has no rank 2 now (its ranks: [0, 1]); its 2 earlier trainers are \
                 attempts 0 to 1",
            ),
            (
                RankOutputError::NoSuchAttempt {
                    rank: 1,
                    attempt: 9,
                    attempts: 2,
                },
                "rank 1 has no attempt 9 (it has had 2: attempts 0 to 1)",
            ),
            (
                RankOutputError::NoSuchAttempt {
                    rank: 1,
                    attempt: 1,
                    attempts: 1,
                },
                "rank 1 has no attempt 1 (it has had 1: attempt 0)",
            ),
        ];
        for (error, want) in cases {
            assert_eq!(error.to_string(), want);
        }
    }

    fn view(rank: u32, phase: Option<(Phase, f64)>) -> RankView {
        RankView {
            rank,
            node: u64::from(rank) + 1,
            phase: phase.map(|(phase, seconds)| RankPhase {
                rank,
                phase,
                seconds,
                epoch: Some(0),
                step: 7,
                bucket: None,
                reading: vec![crate::train::phase::ShardRead {
                    worker: 0,
                    url: "http://host/train-000123.tar".to_string(),
                    bytes: 0,
                }],
                data_wait_s: 0.0,
            }),
            problem: phase.is_none().then(|| "no answer within 2 s".to_string()),
            heartbeat_ms_ago: None,
        }
    }

    #[test]
    fn the_rank_the_others_wait_for_is_named_once() {
        let cases: [(&[RankView], &[&str]); 5] = [
            // Everyone computes: nobody is waited for yet.
            (
                &[
                    view(0, Some((Phase::Computing, 9.0))),
                    view(1, Some((Phase::Computing, 9.0))),
                ],
                &[],
            ),
            (
                &[
                    view(0, Some((Phase::Averaging, 9.0))),
                    view(1, Some((Phase::WaitingForData, 9.0))),
                ],
                &[
                    "rank 1 (node 2) has been waiting for data for 9 s at step 7, reading \
                   http://host/train-000123.tar (0 bytes so far)",
                ],
            ),
            // Not late enough yet.
            (
                &[
                    view(0, Some((Phase::Averaging, 9.0))),
                    view(1, Some((Phase::Computing, 1.0))),
                ],
                &[],
            ),
            (
                &[view(0, Some((Phase::Averaging, 9.0))), view(1, None)],
                &["rank 1 (node 2) holds the others up: no answer within 2 s"],
            ),
            (
                &[
                    view(0, Some((Phase::Computing, 5.0))),
                    view(1, Some((Phase::Averaging, 5.0))),
                    view(2, Some((Phase::Averaging, 5.0))),
                ],
                &["rank 0 (node 1) has been computing for 5 s"],
            ),
        ];
        for (views, want) in cases {
            let mut told = HashSet::new();
            let said = hold_ups(views, 3.0, &mut told);
            assert_eq!(said.len(), want.len(), "{said:?}");
            for (line, want) in said.iter().zip(want) {
                assert!(line.starts_with(want), "{line}\nwant {want}");
            }
            // Said once per call.
            assert!(hold_ups(views, 3.0, &mut told).is_empty());
        }
    }
}
