//! Watching a job from outside its calls: the head's events for its trainers (a rank
//! that failed, a node lost), and whether the head itself is still there.

use std::collections::BTreeMap;
use std::time::Duration;

use runtime::{ClusterClient, FailureOrigin, NodeId};

use super::calls::RankHandle;
use super::error::RankFailure;

/// How long the head may take to answer a status request before a job that failed calls
/// it lost.
const HEAD_PROBE: Duration = Duration::from_secs(5);

/// Why the head is lost, if it is: its connection ended, or it did not answer a status
/// request within [`HEAD_PROBE`]. The connection is then closed, so that what the client
/// still asks of the head (killing trainers) fails at once rather than waiting.
pub async fn head_lost(client: &ClusterClient) -> Option<String> {
    let why = if client.connection().is_closed() {
        "the connection to it ended".to_owned()
    } else {
        match tokio::time::timeout(HEAD_PROBE, client.status()).await {
            Ok(Err(
                error @ (runtime::DaemonError::Unreachable { .. }
                | runtime::DaemonError::Request { .. }),
            )) => error.to_string(),
            // It answered, if not with a status.
            Ok(_) => return None,
            Err(_) => format!(
                "it did not answer a status request within {} s",
                HEAD_PROBE.as_secs()
            ),
        }
    };
    client.connection().close();
    Some(format!("lost the head node at {}: {why}", client.head()))
}

/// Watches the head's events for the job's trainers: any failure or stop we did not ask
/// for ends the job, naming the rank, node and cause; so does the end of the connection
/// to the head.
pub(crate) struct FailureWatcher {
    pub(crate) failures: tokio::sync::mpsc::Receiver<RankFailure>,
    pub(crate) task: tokio::task::JoinHandle<()>,
}

impl FailureWatcher {
    pub(crate) fn start(client: ClusterClient, ranks: &[RankHandle]) -> Self {
        let by_id: BTreeMap<u64, (u32, NodeId)> = ranks
            .iter()
            .map(|r| (r.actor.id().0, (r.rank, r.place.node)))
            .collect();
        let (tx, failures) = tokio::sync::mpsc::channel(4);
        let task = tokio::spawn(async move {
            let mut after = 0;
            loop {
                let page = match client.events(after, Duration::from_secs(30)).await {
                    Ok(page) => page,
                    Err(error) if client.connection().is_closed() => {
                        let message = format!("lost the head node at {}: {error}", client.head());
                        let failure = RankFailure {
                            message,
                            origin: FailureOrigin::Here,
                            rank: None,
                        };
                        let _ = tx.send(failure).await;
                        return;
                    }
                    Err(_) => {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                };
                for event in page.events {
                    after = after.max(event.seq);
                    if let Some((rank, node)) = by_id.get(&event.actor.0) {
                        let node = event.node.unwrap_or(*node);
                        let message =
                            format!("rank {rank} (node {node}) {}: {}", event.kind, event.reason);
                        let failure = RankFailure {
                            message,
                            origin: event.origin,
                            rank: Some(*rank),
                        };
                        let _ = tx.send(failure).await;
                    }
                }
            }
        });
        Self { failures, task }
    }

    /// Within `wait`, the failure of a rank that did not fail because a ring peer went
    /// away (a trainer that crashed, or one on a lost node), or the loss of the head, if
    /// the head reports one.
    pub(crate) async fn root_cause(&mut self, wait: Duration) -> Option<String> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let failure = tokio::time::timeout_at(deadline, self.failures.recv())
                .await
                .ok()??;
            if !failure.origin.is_elsewhere() {
                return Some(failure.message);
            }
        }
    }

    pub(crate) async fn failure(&mut self) -> RankFailure {
        match self.failures.recv().await {
            Some(failure) => failure,
            None => std::future::pending().await,
        }
    }

    pub(crate) fn stop(&self) {
        self.task.abort();
    }
}
