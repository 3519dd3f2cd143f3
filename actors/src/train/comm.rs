//! A communication thread: one connection state (the gradient ring, a decentralized
//! job's mixing groups) on a single-threaded tokio runtime of its own, running jobs in
//! the order they are sent, so that the trainer's thread computes while bytes move.

use std::future::Future;
use std::sync::mpsc;
use std::thread::JoinHandle;

use super::ddp::SyncError;

/// Every communication thread of this process ends the job it runs (and then itself)
/// when this changes: [`abort_all`].
fn aborts() -> &'static tokio::sync::watch::Sender<u64> {
    static ABORTS: std::sync::OnceLock<tokio::sync::watch::Sender<u64>> =
        std::sync::OnceLock::new();
    ABORTS.get_or_init(|| tokio::sync::watch::Sender::new(0))
}

/// Aborts the job every communication thread of this process runs now: it answers
/// with its `aborted` value and ends, dropping its connections (so its peers see them
/// end). An elastic job's trainers do this when a peer is lost, so that none waits in a
/// collective for a rank that will not answer.
pub(crate) fn abort_all() {
    aborts().send_modify(|n| *n += 1);
}

/// A thread that owns a connection state and runs jobs `J` on it, answering `R` for each.
pub(super) struct CommThread<J, R> {
    jobs: Option<mpsc::Sender<J>>,
    done: mpsc::Receiver<R>,
    thread: Option<JoinHandle<()>>,
}

impl<J, R> std::fmt::Debug for CommThread<J, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommThread").finish_non_exhaustive()
    }
}

impl<J: Send + 'static, R: Send + 'static> CommThread<J, R> {
    /// Starts thread `name`. It forms its state with `connect` on its own runtime (where
    /// the state's sockets then live) and hands back `describe(&state)`, then runs every
    /// job sent with `run`; a job cut short by [`abort_all`] is answered
    /// `aborted(&state)`.
    pub(super) fn start<S, E, T, F, Fut, D, H>(
        name: &str,
        connect: F,
        describe: D,
        mut run: H,
        aborted: fn(&S) -> R,
    ) -> Result<(Self, T), SyncError>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<S, E>>,
        E: Into<SyncError>,
        S: 'static,
        D: FnOnce(&S) -> T + Send + 'static,
        T: Send + 'static,
        H: AsyncFnMut(&mut S, J) -> R + Send + 'static,
    {
        let (jobs, job_rx) = mpsc::channel::<J>();
        let (done_tx, done) = mpsc::channel();
        let (ready_tx, ready) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                let tokio = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(tokio) => tokio,
                    Err(error) => {
                        let _ = ready_tx.send(Err(SyncError::Thread(error)));
                        return;
                    }
                };
                let mut state = match tokio.block_on(connect()) {
                    Ok(state) => state,
                    Err(error) => {
                        let _ = ready_tx.send(Err(error.into()));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(describe(&state)));
                let mut abort = aborts().subscribe();
                while let Ok(job) = job_rx.recv() {
                    let result = tokio.block_on(async {
                        tokio::select! {
                            result = run(&mut state, job) => Some(result),
                            _ = abort.changed() => None,
                        }
                    });
                    let Some(result) = result else {
                        let _ = done_tx.send(aborted(&state));
                        break;
                    };
                    if done_tx.send(result).is_err() {
                        break;
                    }
                }
            })
            .map_err(SyncError::Thread)?;
        let described = ready.recv().map_err(|_| SyncError::ThreadGone)??;
        let comm = CommThread {
            jobs: Some(jobs),
            done,
            thread: Some(thread),
        };
        Ok((comm, described))
    }

    pub(super) fn send(&self, job: J) -> Result<(), SyncError> {
        self.jobs
            .as_ref()
            .ok_or(SyncError::ThreadGone)?
            .send(job)
            .map_err(|_| SyncError::ThreadGone)
    }

    /// Another handle on the job queue (for gradient hooks that send from within
    /// backward). While one lives, dropping this thread waits for it to go.
    pub(super) fn sender(&self) -> Result<mpsc::Sender<J>, SyncError> {
        self.jobs.clone().ok_or(SyncError::ThreadGone)
    }

    /// The answer to the oldest job not yet received.
    pub(super) fn receive(&self) -> Result<R, SyncError> {
        self.done.recv().map_err(|_| SyncError::ThreadGone)
    }
}

impl<J, R> Drop for CommThread<J, R> {
    fn drop(&mut self) {
        // Closing the job channel ends the thread's loop once its current job ends
        // (which a dead peer ends with the operation timeout at worst).
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
