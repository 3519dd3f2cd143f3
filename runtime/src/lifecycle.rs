//! What the head and the node daemons share from start to stop: the tasks they spawned,
//! the handler of actor requests, and the one-way change from running to stopped, which
//! callers can wait for. Each daemon adds only what is its own around it (the head
//! removes its record; the node tells the head it leaves).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use tokio::sync::watch;
use tokio::task::AbortHandle;

use crate::daemon::ActorHandler;

/// A daemon's running state.
pub(crate) struct Lifecycle {
    /// Set by the first [`Lifecycle::close`].
    closed: AtomicBool,
    stopped: watch::Sender<bool>,
    tasks: Mutex<Vec<AbortHandle>>,
    actor_handler: RwLock<Option<Arc<dyn ActorHandler>>>,
}

impl Lifecycle {
    pub(crate) fn new(actor_handler: Option<Arc<dyn ActorHandler>>) -> Self {
        Lifecycle {
            closed: AtomicBool::new(false),
            stopped: watch::Sender::new(false),
            tasks: Mutex::new(Vec::new()),
            actor_handler: RwLock::new(actor_handler),
        }
    }

    /// Keeps `tasks`, to abort them when the daemon stops.
    pub(crate) fn track(&self, tasks: impl IntoIterator<Item = AbortHandle>) {
        self.tasks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(tasks);
    }

    /// Aborts every task tracked so far.
    pub(crate) fn abort_tasks(&self) {
        let tasks = std::mem::take(&mut *self.tasks.lock().unwrap_or_else(PoisonError::into_inner));
        for task in tasks {
            task.abort();
        }
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Begins the stop: true for the first caller only, whose tasks are aborted; that
    /// caller closes what the daemon owns and then calls [`Lifecycle::stopped_now`].
    pub(crate) fn close(&self) -> bool {
        if self.closed.swap(true, Ordering::SeqCst) {
            return false;
        }
        self.abort_tasks();
        true
    }

    /// Tells whoever waits in [`Lifecycle::stopped`] that the daemon has stopped.
    pub(crate) fn stopped_now(&self) {
        self.stopped.send_replace(true);
    }

    /// Resolves once the daemon has stopped.
    pub(crate) async fn stopped(&self) {
        let mut stopped = self.stopped.subscribe();
        // Fails only when the sender is gone, which `self` keeps alive.
        let _ = stopped.wait_for(|stopped| *stopped).await;
    }

    pub(crate) fn actor_handler(&self) -> Option<Arc<dyn ActorHandler>> {
        self.actor_handler
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub(crate) fn set_actor_handler(&self, handler: Arc<dyn ActorHandler>) {
        *self
            .actor_handler
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Some(handler);
    }
}
