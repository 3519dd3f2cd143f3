//! How whoever runs a job asks it to stop (a signal's name, or `cancel`), and what the
//! job tells it back: where it stands, and its ranks for the hang doctor.

use std::sync::{Arc, Mutex};

use super::calls::Rank;
use super::error::Progress;
use super::ranks::{RankView, rank_views};

/// How whoever runs the job tells the step loop to stop (a signal's name, or `cancel`),
/// and what the loop tells it back.
#[derive(Clone)]
pub struct StopControl {
    requested: tokio::sync::watch::Receiver<Option<&'static str>>,
    progress: Arc<Mutex<Progress>>,
    /// The job's ranks, once spawned, and the cluster they run on, for the hang doctor.
    ranks: Arc<Mutex<(Vec<Rank>, Option<runtime::ClusterClient>)>>,
}

impl std::fmt::Debug for StopControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StopControl")
            .field("requested", &*self.requested.borrow())
            .field("progress", &*self.progress())
            .finish_non_exhaustive()
    }
}

/// The sending half of a [`StopControl`]: asks the job to stop.
#[derive(Debug)]
pub struct StopRequest(tokio::sync::watch::Sender<Option<&'static str>>);

impl StopRequest {
    /// Asks the job to stop after the step in flight; `by` names who asked (`SIGINT`,
    /// `SIGTERM`, `cancel`).
    pub fn stop(&self, by: &'static str) {
        let _ = self.0.send(Some(by));
    }
}

impl StopControl {
    pub fn new() -> (StopRequest, StopControl) {
        let (tx, requested) = tokio::sync::watch::channel(None);
        let control = StopControl {
            requested,
            progress: Arc::new(Mutex::new(Progress::default())),
            ranks: Arc::default(),
        };
        (StopRequest(tx), control)
    }

    /// Where the job stands now.
    pub fn progress(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn set_ranks(&self, ranks: &[Rank], client: &runtime::ClusterClient) {
        *self.ranks.lock().unwrap_or_else(|e| e.into_inner()) =
            (ranks.to_vec(), Some(client.clone()));
    }

    /// Every rank's phase now, from its monitor, with its node's last heartbeat (none
    /// before the ranks are up).
    pub async fn rank_views(&self) -> Vec<RankView> {
        let (ranks, client) = self.ranks.lock().unwrap_or_else(|e| e.into_inner()).clone();
        rank_views(&ranks, client.as_ref()).await
    }

    pub(super) fn requested(&self) -> Option<&'static str> {
        *self.requested.borrow()
    }

    /// The stop requests, to wait for one.
    pub(crate) fn watch(&self) -> tokio::sync::watch::Receiver<Option<&'static str>> {
        self.requested.clone()
    }
}
