//! The actix side of [`LocalActors`](super::LocalActors): an actix system on a thread of
//! its own, and one arbiter (an OS thread with its own event loop) per actor, hosting a
//! [`Host`] that runs the actor's code.
//!
//! Why an arbiter per actor rather than a `SyncArbiter`: actor code blocks (libtorch), so
//! it must have a thread to itself, and actix's `SyncArbiter` has an unbounded queue,
//! restarts an actor that stops (by calling its factory again) and has no way to report a
//! failed constructor. An arbiter per actor gives each actor its thread, construction on
//! that thread, and a normal actix `Context` that really stops.
//!
//! The daemons run on tokio; actix needs a `System` registered on the thread that creates
//! arbiters. [`ActixThread`] runs that system on a dedicated thread and creates every
//! arbiter there; what comes back (`Addr`, channels) is `Send` and used from any tokio
//! task.

use std::any::Any;
use std::io;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;

use tokio::sync::{OwnedSemaphorePermit, oneshot, watch};
use tracing::{Span, debug, warn};

use super::ActorId;
use super::error::{ActorError, ExitReason, FailureOrigin};
use super::registry::{Actor, MethodError};

/// An actix system running on its own thread, stopped (with every arbiter) on drop.
pub(crate) struct ActixThread {
    system: actix::System,
    thread: Option<JoinHandle<()>>,
}

impl ActixThread {
    pub(crate) fn start() -> io::Result<Self> {
        let (sender, receiver) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("imgrun-actix".into())
            .spawn(move || {
                let runner = actix::System::new();
                if sender.send(actix::System::current()).is_ok()
                    && let Err(error) = runner.run()
                {
                    warn!(%error, "actix system ended with an error");
                }
            })?;
        let system = receiver
            .recv()
            .map_err(|_| io::Error::other("the actix system thread ended as it started"))?;
        Ok(Self {
            system,
            thread: Some(thread),
        })
    }

    /// Runs `construct` on a new arbiter: a thread of its own with an event loop, on which
    /// `construct` starts the actor (or stops the arbiter if it cannot). False when the
    /// system has stopped.
    pub(crate) fn spawn_on_new_arbiter<F>(&self, construct: F) -> bool
    where
        F: FnOnce() + Send + 'static,
    {
        // Arbiters are created on the system's thread, where actix finds its `System`.
        self.system.arbiter().spawn_fn(move || {
            let arbiter = actix::Arbiter::new();
            // Dropping the `Arbiter` leaves its thread running; the actor stops it.
            arbiter.spawn_fn(construct);
        })
    }
}

impl Drop for ActixThread {
    fn drop(&mut self) {
        // Stops every arbiter too. A thread blocked in actor code ends when that code
        // returns; nobody waits for it. The system's own thread runs none.
        self.system.stop();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// What one actor's host and its callers share.
pub(crate) struct Shared {
    pub(crate) id: ActorId,
    killed: AtomicBool,
    stopping: AtomicBool,
    exit: watch::Sender<Option<ExitReason>>,
    on_exit: Weak<dyn ExitSink>,
}

/// Where a host reports its actor's end (the [`LocalActors`](super::LocalActors) table).
pub(crate) trait ExitSink: Send + Sync {
    fn exited(&self, actor: &Shared, reason: &ExitReason);
}

impl Shared {
    pub(crate) fn new(id: ActorId, on_exit: Weak<dyn ExitSink>) -> Self {
        Self {
            id,
            killed: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            exit: watch::Sender::new(None),
            on_exit,
        }
    }

    /// Records how the actor ended; only the first call counts. Callers waiting on the
    /// actor wake up with that reason, and the host is told (once).
    pub(crate) fn finish(&self, reason: ExitReason) -> bool {
        let first = self.exit.send_if_modified(|slot| {
            if slot.is_some() {
                return false;
            }
            *slot = Some(reason.clone());
            true
        });
        if first && let Some(sink) = self.on_exit.upgrade() {
            sink.exited(self, &reason);
        }
        first
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<Option<ExitReason>> {
        self.exit.subscribe()
    }

    pub(crate) fn kill(&self) {
        self.killed.store(true, Ordering::SeqCst);
    }

    fn is_killed(&self) -> bool {
        self.killed.load(Ordering::SeqCst)
    }

    pub(crate) fn begin_stop(&self) -> bool {
        !self.stopping.swap(true, Ordering::SeqCst)
    }

    pub(crate) fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }
}

/// A message to a [`Host`]. Calls and tells carry the mailbox permit their sender took;
/// it is returned when the host takes the message.
pub(crate) enum Mail {
    Call {
        method: String,
        payload: Vec<u8>,
        reply: oneshot::Sender<Result<Vec<u8>, ActorError>>,
        permit: OwnedSemaphorePermit,
    },
    Tell {
        method: String,
        payload: Vec<u8>,
        permit: OwnedSemaphorePermit,
    },
    /// Graceful stop: behind what is queued.
    Stop,
    /// Wakes the host after [`Shared::kill`]; everything before it is dropped unread.
    Kill,
}

impl actix::Message for Mail {
    type Result = ();
}

/// The actix actor that runs one user [`Actor`] on its arbiter's thread.
pub(crate) struct Host {
    actor: Option<Box<dyn Actor>>,
    shared: Arc<Shared>,
    span: Span,
}

impl Host {
    pub(crate) fn new(actor: Box<dyn Actor>, shared: Arc<Shared>, span: Span) -> Self {
        Self {
            actor: Some(actor),
            shared,
            span,
        }
    }

    /// Runs `f` on the actor, turning a fatal error or a panic into the actor's failure.
    fn run<T>(
        &mut self,
        method: &str,
        ctx: &mut actix::Context<Self>,
        f: impl FnOnce(&mut dyn Actor) -> Result<T, MethodError>,
    ) -> Result<T, ActorError> {
        let id = self.shared.id;
        let Some(actor) = self.actor.as_deref_mut() else {
            return Err(ActorError::Stopped(id));
        };
        let (reason, origin) = match catch_unwind(AssertUnwindSafe(|| f(actor))) {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(error)) if !error.is_fatal() => {
                return Err(ActorError::Method {
                    actor_id: id,
                    method: method.to_string(),
                    message: error.message().to_string(),
                });
            }
            Ok(Err(error)) => (format!("{method}: {}", error.message()), error.origin()),
            Err(panic) => (
                format!("panicked in {method}: {}", panic_message(&*panic)),
                FailureOrigin::Here,
            ),
        };
        warn!(%reason, ?origin, "actor failed");
        // A failed actor is not used again; it is dropped when its context ends.
        self.shared.finish(ExitReason::Failed {
            reason: reason.clone(),
            origin,
        });
        actix::ActorContext::stop(ctx);
        Err(ActorError::Failed {
            actor_id: id,
            reason,
            origin,
        })
    }
}

impl actix::Actor for Host {
    type Context = actix::Context<Self>;

    fn stopped(&mut self, _ctx: &mut Self::Context) {
        let _entered = self.span.clone().entered();
        // Drop the user's actor here, before the stop is reported, so that what it holds
        // (GPU memory) is released by then.
        if let Some(actor) = self.actor.take()
            && catch_unwind(AssertUnwindSafe(move || drop(actor))).is_err()
        {
            warn!("actor panicked while being dropped");
        }
        self.shared.finish(ExitReason::Stopped);
        debug!("actor ended");
        actix::Arbiter::current().stop();
    }
}

impl actix::Handler<Mail> for Host {
    type Result = ();

    fn handle(&mut self, mail: Mail, ctx: &mut Self::Context) {
        let span = self.span.clone();
        let _entered = span.enter();
        if self.shared.is_killed() {
            // Whatever was queued before the kill is dropped; its callers already have
            // their error.
            actix::ActorContext::stop(ctx);
            return;
        }
        match mail {
            Mail::Call {
                method,
                payload,
                reply,
                permit,
            } => {
                drop(permit);
                if reply.is_closed() {
                    debug!(method, "caller gave up before the call ran; skipped");
                    return;
                }
                let result = self.run(&method, ctx, |actor| actor.call(&method, &payload));
                let _ = reply.send(result);
            }
            Mail::Tell {
                method,
                payload,
                permit,
            } => {
                drop(permit);
                let result = self.run(&method, ctx, |actor| actor.tell(&method, &payload));
                if let Err(ActorError::Method { message, .. }) = result {
                    warn!(method, error = %message, "tell failed");
                }
            }
            Mail::Stop => {
                if let Some(actor) = self.actor.as_deref_mut()
                    && catch_unwind(AssertUnwindSafe(|| actor.stopping())).is_err()
                {
                    warn!("actor panicked in stopping");
                }
                actix::ActorContext::stop(ctx);
            }
            Mail::Kill => actix::ActorContext::stop(ctx),
        }
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        // Reached without `stopped` only when the system shut down under the actor.
        self.shared.finish(ExitReason::Killed);
    }
}

/// The message of a panic payload (`panic!` gives a `&str` or a `String`).
pub(crate) fn panic_message(panic: &(dyn Any + Send)) -> String {
    if let Some(message) = panic.downcast_ref::<&str>() {
        (*message).to_string()
    } else if let Some(message) = panic.downcast_ref::<String>() {
        message.clone()
    } else {
        "a panic without a message".to_string()
    }
}
