//! A thread of its own for a server's QUIC endpoint: a single-threaded tokio runtime that
//! runs the endpoint's and its connections' drivers and the tasks that serve their
//! streams.
//!
//! Why: an actor call answered by a node crosses from the task serving its stream to the
//! actor's thread and back. On a multi-threaded runtime, the wake that brings the answer
//! back makes the worker that takes it wake another worker to look for work too (tokio's
//! rule for a worker leaving the search), and the packet that carries the request wakes
//! one as well; on a machine of a few busy cores every such wake is a context switch
//! (`cargo bench -p runtime --bench cluster -- --only remote`: 1.7 times the calls per
//! second of one caller with the whole tokio runtime on one worker). On one thread, the
//! answer wakes that thread and nothing else.
//!
//! The thread ends when quinn drops the last handle on its [`ThreadRuntime`]: once the
//! endpoint is closed and every connection, stream and driver on it is gone.

use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use quinn::{AsyncTimer, AsyncUdpSocket, Runtime, TokioRuntime};
use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// quinn's runtime for an endpoint on a thread of its own: quinn's tokio runtime, entered
/// on that thread's runtime so that its sockets, timers and tasks belong to it.
pub(crate) struct ThreadRuntime {
    handle: Handle,
    /// Dropped with the last handle: ends the thread.
    _stop: oneshot::Sender<()>,
}

impl ThreadRuntime {
    /// Starts the thread, named `name`.
    pub(crate) fn start(name: &str) -> io::Result<Arc<Self>> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                // Resolves (with an error) when the sender is dropped; what still runs on
                // the runtime is dropped with it.
                let _ = runtime.block_on(stopped);
            })?;
        Ok(Arc::new(ThreadRuntime {
            handle,
            _stop: stop,
        }))
    }

    /// Runs `future` on the thread.
    pub(crate) fn spawn<F>(&self, future: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        // Once the thread has ended the task is dropped unpolled, as on any runtime that
        // shut down; it ends only after every endpoint on it is gone.
        drop(self.handle.spawn(future));
    }
}

impl Runtime for ThreadRuntime {
    fn new_timer(&self, at: Instant) -> Pin<Box<dyn AsyncTimer>> {
        let _entered = self.handle.enter();
        TokioRuntime.new_timer(at)
    }

    fn spawn(&self, future: Pin<Box<dyn Future<Output = ()> + Send>>) {
        ThreadRuntime::spawn(self, future);
    }

    fn wrap_udp_socket(&self, socket: std::net::UdpSocket) -> io::Result<Arc<dyn AsyncUdpSocket>> {
        let _entered = self.handle.enter();
        TokioRuntime.wrap_udp_socket(socket)
    }

    fn now(&self) -> Instant {
        TokioRuntime.now()
    }
}

impl fmt::Debug for ThreadRuntime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThreadRuntime").finish_non_exhaustive()
    }
}
