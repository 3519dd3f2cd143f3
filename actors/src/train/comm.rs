//! A communication thread: one connection state (the gradient ring, a decentralized
//! job's mixing groups) on a single-threaded tokio runtime of its own, running ops in
//! the order they are sent, so that the trainer's thread computes while bytes move.
//! Beside it, what a failed synchronisation is ([`SyncError`]) and what it makes of the
//! trainer's call (`ring_failure`: a peer's failure, or this rank's own).

use std::future::Future;
use std::sync::mpsc;
use std::thread::JoinHandle;

use runtime::{CollectiveError, MethodError};

use super::nccl::NcclError;

/// Why a synchronisation failed.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error("the communication thread stopped")]
    ThreadGone,
    #[error("cannot start the communication thread: {0}")]
    Thread(std::io::Error),
    #[error("{0}")]
    Tensor(#[from] tch::TchError),
    #[error(transparent)]
    Nccl(#[from] NcclError),
    #[error(transparent)]
    Mix(#[from] runtime::MixError),
    #[error("overlapped allreduce: {0}")]
    Overlap(String),
    /// [`abort_all`] came while the connections still formed:
    /// the job lost a peer meanwhile.
    #[error("the connections were still forming when the job aborted them (a peer was lost)")]
    AbortedForming,
}

/// A fatal error for a failed ring operation, [caused elsewhere] (and saying so) when the
/// cause is another rank (its link closed or failed, or it stopped answering). A job's
/// client looks past these for the root cause.
///
/// [caused elsewhere]: MethodError::caused_elsewhere
pub(super) fn ring_failure(rank: u32, what: &str, error: &SyncError) -> MethodError {
    let collective = match error {
        SyncError::Collective(error) => Some(error),
        SyncError::Mix(
            runtime::MixError::Group { source, .. } | runtime::MixError::Connect { source, .. },
        ) => Some(source),
        _ => None,
    };
    // A ring that cannot form (a peer refused, or hung up in the handshake) is a peer's
    // doing too: in one job every rank has the coordinator's same settings.
    let peer = matches!(
        collective,
        Some(
            CollectiveError::Connect { .. }
                | CollectiveError::Handshake { .. }
                | CollectiveError::PeerClosed { .. }
                | CollectiveError::Io { .. }
                | CollectiveError::Timeout { .. }
                | CollectiveError::Poisoned { .. }
                | CollectiveError::Aborted { .. }
        )
    ) || matches!(
        error,
        SyncError::Mix(runtime::MixError::Aborted) | SyncError::AbortedForming
    );
    if peer {
        MethodError::fatal(format!("rank {rank}: {what} ({PEER_FAILURE}): {error}"))
            .caused_elsewhere()
    } else {
        MethodError::fatal(format!("rank {rank}: {what}: {error}"))
    }
}

/// Said of a trainer failure that follows from another rank's (its ring peer went away or
/// stopped answering), for the person reading it; programs ask the failure's
/// [`runtime::FailureOrigin`] instead.
const PEER_FAILURE: &str = "lost its ring peer";

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

/// What a communication thread started now listens to: every [`abort_all`] from now on.
pub(super) fn abort_signal() -> AbortSignal {
    AbortSignal(aborts().subscribe())
}

/// The aborts one communication thread obeys (a test gives its own).
#[derive(Debug)]
pub(super) struct AbortSignal(tokio::sync::watch::Receiver<u64>);

impl AbortSignal {
    /// Runs `work` on `tokio` to its end, or `None` once an abort comes first.
    fn unless_aborted<F: Future>(
        &mut self,
        tokio: &tokio::runtime::Runtime,
        work: F,
    ) -> Option<F::Output> {
        tokio.block_on(async {
            tokio::select! {
                output = work => Some(output),
                _ = self.0.changed() => None,
            }
        })
    }
}

/// A thread that owns a connection state and runs ops `K` on it, answering `R` for
/// each.
pub(super) struct CommThread<K, R> {
    ops: Option<mpsc::Sender<K>>,
    done: mpsc::Receiver<R>,
    thread: Option<JoinHandle<()>>,
}

impl<K, R> std::fmt::Debug for CommThread<K, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommThread").finish_non_exhaustive()
    }
}

impl<K: Send + 'static, R: Send + 'static> CommThread<K, R> {
    /// Starts thread `name`. It forms its state with `connect` on its own runtime (where
    /// the state's sockets then live) and hands back `describe(&state)`, then runs every
    /// op sent with `run`; an op cut short by [`abort_all`] is answered
    /// `aborted(&state)`. `abort` is taken before connecting: an abort while the
    /// connections form (a peer lost before it bound or answered) ends the forming with
    /// [`SyncError::AbortedForming`], rather than leaving it to retry a dead peer until
    /// the connect deadline.
    pub(super) fn start<S, E, T, F, Fut, D, H>(
        name: &str,
        abort: AbortSignal,
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
        H: AsyncFnMut(&mut S, K) -> R + Send + 'static,
    {
        let (ops, op_rx) = mpsc::channel::<K>();
        let (done_tx, done) = mpsc::channel();
        let (ready_tx, ready) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                let mut abort = abort;
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
                let formed = abort
                    .unless_aborted(&tokio, connect())
                    .map_or(Err(SyncError::AbortedForming), |f| f.map_err(Into::into));
                let mut state = match formed {
                    Ok(state) => state,
                    Err(error) => {
                        let _ = ready_tx.send(Err(error));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(describe(&state)));
                while let Ok(op) = op_rx.recv() {
                    let Some(result) = abort.unless_aborted(&tokio, run(&mut state, op)) else {
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
            ops: Some(ops),
            done,
            thread: Some(thread),
        };
        Ok((comm, described))
    }

    pub(super) fn send(&self, op: K) -> Result<(), SyncError> {
        self.ops
            .as_ref()
            .ok_or(SyncError::ThreadGone)?
            .send(op)
            .map_err(|_| SyncError::ThreadGone)
    }

    /// Another handle on the op queue (for gradient hooks that send from within
    /// backward). While one lives, dropping this thread waits for it to go.
    pub(super) fn sender(&self) -> Result<mpsc::Sender<K>, SyncError> {
        self.ops.clone().ok_or(SyncError::ThreadGone)
    }

    /// The answer to the oldest op not yet received.
    pub(super) fn receive(&self) -> Result<R, SyncError> {
        self.done.recv().map_err(|_| SyncError::ThreadGone)
    }
}

impl<K, R> Drop for CommThread<K, R> {
    fn drop(&mut self) {
        // Closing the op channel ends the thread's loop once its current op ends
        // (which a dead peer ends with the operation timeout at worst).
        self.ops = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// A signal of the test's own, so that other tests' threads are not aborted.
    fn own_signal() -> (tokio::sync::watch::Sender<u64>, AbortSignal) {
        let (tx, rx) = tokio::sync::watch::channel(0);
        (tx, AbortSignal(rx))
    }

    fn abort_after(tx: tokio::sync::watch::Sender<u64>, wait: Duration) {
        std::thread::spawn(move || {
            std::thread::sleep(wait);
            tx.send_modify(|n| *n += 1);
            // Kept until the thread under test has seen it.
            std::thread::sleep(Duration::from_secs(5));
        });
    }

    #[test]
    fn an_abort_while_the_connections_form_ends_the_forming() {
        let (tx, signal) = own_signal();
        abort_after(tx, Duration::from_millis(50));
        let started = Instant::now();
        // A ring that would form only after 20 s (a peer retried until the deadline).
        let result = CommThread::<u32, u32>::start(
            "test-comm",
            signal,
            || async {
                tokio::time::sleep(Duration::from_secs(20)).await;
                Ok::<_, SyncError>(())
            },
            |_: &()| (),
            async |_: &mut (), op| op,
            |_: &()| 0,
        );
        assert!(
            matches!(result, Err(SyncError::AbortedForming)),
            "{result:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(15));
    }

    #[test]
    fn an_abort_during_a_job_answers_it_aborted_and_ends_the_thread() {
        let (tx, signal) = own_signal();
        let (comm, described) = CommThread::<u32, u32>::start(
            "test-comm",
            signal,
            || async { Ok::<_, SyncError>(7u32) },
            |state: &u32| *state,
            async |state: &mut u32, op: u32| {
                if op == 0 {
                    std::future::pending::<()>().await;
                }
                *state + op
            },
            |_: &u32| u32::MAX,
        )
        .expect("formed");
        assert_eq!(described, 7);
        comm.send(1).expect("send");
        assert_eq!(comm.receive().expect("answer"), 8);
        comm.send(0).expect("send");
        abort_after(tx, Duration::from_millis(50));
        assert_eq!(comm.receive().expect("answer"), u32::MAX);
        // The thread ended: its answers channel is closed.
        assert!(matches!(comm.receive(), Err(SyncError::ThreadGone)));
    }
}
