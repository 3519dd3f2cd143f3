//! The hang doctor: every rank's phase now (from its monitor, which answers while the
//! trainer is busy), for `imgrun jobs JOB --ranks`, and the rank a call in flight waits
//! for, named while it happens; and a rank's own log (the newest lines its trainer's
//! process wrote, kept by its node).

use std::collections::HashSet;
use std::time::Duration;

use serde::{Deserialize, Serialize};

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

#[cfg(test)]
mod tests {
    use super::*;

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

/// The newest lines rank `rank`'s trainer process wrote: its own log (the trainer's and
/// its loader's messages) and its libraries' (libtorch, NCCL), kept by its node.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RankOutputRequest {
    pub rank: u32,
    /// How many of the newest lines; at most 1,000 are kept.
    pub lines: u32,
}

/// The answer to a [`RankOutputRequest`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RankOutputReply {
    pub rank: u32,
    pub node: u64,
    /// Oldest first.
    pub lines: Vec<String>,
    /// False when the trainer runs in its node daemon's own process (its lines are in
    /// the daemon's log), which leaves `lines` empty.
    pub own_process: bool,
}

/// Why a rank's output could not be given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RankOutputError {
    #[error("the job has no rank {rank} now (its ranks: {ranks:?})")]
    NoSuchRank { rank: u32, ranks: Vec<u32> },
    #[error("rank {rank}'s node did not give its output: {reason}")]
    Unanswered { rank: u32, reason: String },
}

/// The newest `lines` lines of rank `rank`'s trainer process, asked of its node.
pub(crate) async fn rank_output(
    ranks: &[RankHandle],
    rank: u32,
    lines: u32,
) -> Result<RankOutputReply, RankOutputError> {
    let Some(handle) = ranks.iter().find(|handle| handle.rank == rank) else {
        return Err(RankOutputError::NoSuchRank {
            rank,
            ranks: ranks.iter().map(|handle| handle.rank).collect(),
        });
    };
    let output = handle
        .actor
        .output(lines)
        .await
        .map_err(|error| RankOutputError::Unanswered {
            rank,
            reason: error.to_string(),
        })?;
    Ok(RankOutputReply {
        rank,
        node: handle.place.node.0,
        lines: output.lines,
        own_process: output.own_process,
    })
}
