//! The job's ranks and its typed calls to them: one method to every rank at once, or to
//! one, with the failure named by rank and node.

use std::collections::BTreeMap;
use std::time::Duration;

use runtime::ActorRef;
use serde::Serialize;

use super::error::{JobError, RankCallError};
use super::world::RankPlace;
use crate::train::TrainerMethod;

/// The job's handle on a rank: its index (a `pipelines::Rank`'s number), where it runs,
/// and its trainer's and monitor's actors.
#[derive(Clone)]
pub(crate) struct RankHandle {
    pub(crate) rank: u32,
    pub(crate) place: RankPlace,
    pub(crate) actor: ActorRef,
    /// The actor that reads the trainer's phase at any time ([`crate::train::phase`]).
    pub(crate) monitor: Option<ActorRef>,
}

impl RankHandle {
    pub(crate) fn name(&self) -> String {
        format!("rank {} (node {})", self.rank, self.place.node)
    }
}

/// Calls method `M` on every rank at once, each with its `request`, and returns the
/// replies in rank order; the first failure ends the call, naming the rank and node.
pub(crate) async fn call_all<M: TrainerMethod>(
    ranks: &[RankHandle],
    request: impl Fn(&RankHandle) -> M,
    timeout: Duration,
) -> Result<Vec<M::Reply>, JobError> {
    let mut tasks = tokio::task::JoinSet::new();
    for rank in ranks {
        let rank = rank.clone();
        let payload = to_json(&request(&rank));
        tasks.spawn(async move {
            let outcome = call_payload::<M>(&rank, payload, timeout).await;
            (rank.rank, outcome)
        });
    }
    let mut replies: BTreeMap<u32, M::Reply> = BTreeMap::new();
    while let Some(joined) = tasks.join_next().await {
        let (rank, outcome) =
            joined.map_err(|error| JobError::Refused(format!("a call task failed: {error}")))?;
        replies.insert(rank, outcome?);
    }
    Ok(replies.into_values().collect())
}

/// Calls method `M` on one rank.
pub(crate) async fn call_one<M: TrainerMethod>(
    rank: &RankHandle,
    request: &M,
    timeout: Duration,
) -> Result<M::Reply, JobError> {
    call_payload::<M>(rank, to_json(request), timeout).await
}

async fn call_payload<M: TrainerMethod>(
    rank: &RankHandle,
    payload: Vec<u8>,
    timeout: Duration,
) -> Result<M::Reply, JobError> {
    let method = M::NAME;
    let bytes = rank
        .actor
        .call(method, payload, timeout)
        .await
        .map_err(|error| {
            JobError::Call(Box::new(RankCallError {
                rank: rank.name(),
                method,
                error,
            }))
        })?;
    serde_json::from_slice::<M::Reply>(&bytes).map_err(|error| {
        JobError::Refused(format!("{}: {method}: bad reply: {error}", rank.name()))
    })
}

/// The value every rank's reply gives (rank 0's), or, when one gives another, the job's
/// error that `disagree(rank 0's, that rank, its value)` words.
pub(crate) fn agreed(
    values: impl IntoIterator<Item = u64>,
    disagree: impl FnOnce(u64, usize, u64) -> String,
) -> Result<u64, JobError> {
    let values: Vec<u64> = values.into_iter().collect();
    let first = values.first().copied().unwrap_or(0);
    match values.iter().position(|&v| v != first) {
        Some(bad) => Err(JobError::Refused(disagree(first, bad, values[bad]))),
        None => Ok(first),
    }
}

pub(crate) fn to_json<T: Serialize>(value: &T) -> Vec<u8> {
    // Invariant: these request types hold only strings, numbers and paths, which always
    // encode.
    serde_json::to_vec(value).unwrap_or_default()
}
