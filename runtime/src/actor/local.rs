//! [`LocalActors`]: the actors one process hosts (the node daemon, or one worker process),
//! each on a thread of its own, reached from any tokio task.
//!
//! Mailboxes are bounded by [`LocalOptions::mailbox_capacity`] messages waiting (the one
//! running is not counted). A call or tell first takes a permit of the actor's semaphore,
//! waiting while the mailbox is full (back-pressure), and the actor gives the permit back
//! when it takes the message. The bound is ours rather than actix's: actix's capacity
//! check is bypassed by every cloned `Addr` and by `do_send` (actix issues #329, #515), so
//! messages go in with `do_send` once a permit is held.

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use tokio::sync::{Semaphore, mpsc, oneshot, watch};
use tokio::time::Instant;
use tracing::{debug, info_span};

use super::ActorId;
use super::error::{ActorError, ActorExit, ExitReason, Tombstones};
use super::host::{ActixThread, ExitSink, Host, Mail, Shared, panic_message};
use super::registry::{ActorContext, ActorRegistry};

/// Messages that may wait in one actor's mailbox by default.
pub const DEFAULT_MAILBOX_CAPACITY: usize = 64;

/// How a [`LocalActors`] runs its actors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalOptions {
    /// Messages that may wait in one actor's mailbox (at least 1); senders wait beyond.
    pub mailbox_capacity: usize,
    /// The physical GPU indices this process sees, in `CUDA_VISIBLE_DEVICES` order, to
    /// number an actor's GPUs as CUDA does here; `None` when every GPU is visible in
    /// physical order. A worker process sets it from its environment.
    pub visible_gpus: Option<Vec<u32>>,
    /// What [`ActorContext::data_ip`] tells actors: the address the node's daemon binds.
    pub data_ip: IpAddr,
    /// What [`ActorContext::cluster`] tells actors.
    pub cluster: Option<super::ClusterAccess>,
}

impl Default for LocalOptions {
    fn default() -> Self {
        Self {
            mailbox_capacity: DEFAULT_MAILBOX_CAPACITY,
            visible_gpus: None,
            data_ip: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            cluster: None,
        }
    }
}

/// What to start: the actor's id, its registered kind, its encoded constructor arguments
/// and the physical indices of the GPUs reserved for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActorSpec {
    pub id: ActorId,
    pub kind: String,
    pub args: Vec<u8>,
    pub gpus: Vec<u32>,
}

/// The actors of one process, each on its own actix arbiter (a thread). Cheap to clone;
/// the actors are stopped when the last clone is dropped.
///
/// Order: the messages one task sends to one actor (awaiting each `call` or `tell`) are
/// processed in the order sent. Messages from different tasks interleave in the order
/// they entered the mailbox.
#[derive(Clone)]
pub struct LocalActors {
    inner: Arc<Inner>,
}

struct Inner {
    registry: ActorRegistry,
    options: LocalOptions,
    table: Arc<Table>,
    // Declared last: dropped after the table, it stops every arbiter.
    system: ActixThread,
}

/// The actors by id, shared with their hosts (which report their own end).
struct Table {
    state: Mutex<TableState>,
    exits: mpsc::UnboundedSender<ActorExit>,
}

#[derive(Default)]
struct TableState {
    actors: HashMap<ActorId, Slot>,
    tombstones: Tombstones,
}

enum Slot {
    Starting,
    Running(Arc<Entry>),
}

struct Entry {
    addr: actix::Addr<Host>,
    permits: Arc<Semaphore>,
    shared: Arc<Shared>,
}

/// A call in an actor's mailbox; [`PendingCall::reply`] waits for its result.
pub(crate) struct PendingCall {
    actor: ActorId,
    method: String,
    timeout: Duration,
    deadline: Option<Instant>,
    reply: oneshot::Receiver<Result<Vec<u8>, ActorError>>,
    exit: watch::Receiver<Option<ExitReason>>,
}

impl LocalActors {
    /// Starts the actix system (a thread) that will host the actors of `registry`. Every
    /// actor that ends is reported once on `exits`.
    pub fn new(
        registry: ActorRegistry,
        options: LocalOptions,
        exits: mpsc::UnboundedSender<ActorExit>,
    ) -> Result<Self, ActorError> {
        let system = ActixThread::start().map_err(|error| ActorError::Runtime {
            reason: format!("cannot start the actix system thread: {error}"),
        })?;
        let table = Arc::new(Table {
            state: Mutex::default(),
            exits,
        });
        Ok(Self {
            inner: Arc::new(Inner {
                registry,
                options,
                table,
                system,
            }),
        })
    }

    /// The kinds this host can start.
    pub fn registry(&self) -> &ActorRegistry {
        &self.inner.registry
    }

    /// Starts an actor: its constructor runs on the actor's new thread, and this returns
    /// when it has finished (an error or a panic there is a [`ActorError::Start`]).
    /// Dropping the future cancels the start: an actor built meanwhile is dropped, unseen.
    pub async fn start(&self, spec: ActorSpec) -> Result<(), ActorError> {
        let ActorSpec {
            id,
            kind,
            args,
            gpus,
        } = spec;
        let factory = self.inner.registry.factory(&kind)?;
        let ordinals = cuda_ordinals(&gpus, self.inner.options.visible_gpus.as_deref())
            .map_err(|reason| start_error(id, &kind, reason))?;
        {
            let mut state = self.inner.table.lock();
            if state.actors.contains_key(&id) {
                return Err(ActorError::AlreadyExists(id));
            }
            state.actors.insert(id, Slot::Starting);
            state.tombstones.remove(id);
        }
        // Undoes the reservation unless the actor is registered.
        let mut reservation = Reservation {
            table: &self.inner.table,
            id,
            done: false,
        };

        let table: Weak<Table> = Arc::downgrade(&self.inner.table);
        let on_exit: Weak<dyn ExitSink> = table;
        let shared = Arc::new(Shared::new(id, on_exit));
        let capacity = self.inner.options.mailbox_capacity;
        let context = ActorContext::new(id, gpus, ordinals, self.inner.options.data_ip)
            .with_cluster(self.inner.options.cluster.clone());
        let span = info_span!("actor", id = %id, kind = %kind);
        let (started, outcome) = oneshot::channel();
        let host_shared = Arc::clone(&shared);
        let construct = move || {
            let _entered = span.enter();
            match catch_unwind(AssertUnwindSafe(|| factory(&context, &args))) {
                Ok(Ok(actor)) => {
                    let host = Host::new(actor, host_shared, span.clone());
                    if let Err(Ok(addr)) = started.send(Ok(actix::Actor::start(host))) {
                        // The start was given up: stop the actor, which nobody can reach.
                        addr.do_send(Mail::Kill);
                    }
                }
                Ok(Err(error)) => {
                    let _ = started.send(Err(error.message().to_string()));
                    actix::Arbiter::current().stop();
                }
                Err(panic) => {
                    let reason = format!("constructor panicked: {}", panic_message(&*panic));
                    let _ = started.send(Err(reason));
                    actix::Arbiter::current().stop();
                }
            }
        };
        if !self.inner.system.spawn_on_new_arbiter(construct) {
            return Err(shut_down());
        }
        let addr = match outcome.await {
            Ok(Ok(addr)) => addr,
            Ok(Err(reason)) => return Err(start_error(id, &kind, reason)),
            Err(_) => return Err(start_error(id, &kind, "its thread could not start".into())),
        };
        let entry = Arc::new(Entry {
            addr,
            permits: Arc::new(Semaphore::new(capacity.clamp(1, Semaphore::MAX_PERMITS))),
            shared,
        });
        {
            let mut state = self.inner.table.lock();
            // An actor that ended already (the system shut down) is not registered; one
            // that ends after this is removed by its own report, which takes this lock.
            let exit = entry.shared.subscribe();
            if let Some(reason) = exit.borrow().as_ref() {
                return Err(start_error(id, &kind, reason.to_string()));
            }
            state.actors.insert(id, Slot::Running(entry));
            reservation.done = true;
        }
        debug!(actor = %id, kind, "actor started");
        Ok(())
    }

    /// Calls `method` and waits at most `timeout` for the result, time spent waiting for
    /// room in the mailbox included. A call whose caller gave up before it ran is skipped;
    /// one already running completes and its result is dropped.
    pub async fn call(
        &self,
        actor: ActorId,
        method: &str,
        payload: Vec<u8>,
        timeout: Duration,
    ) -> Result<Vec<u8>, ActorError> {
        self.send_call(actor, method, payload, timeout)
            .await?
            .reply()
            .await
    }

    /// Puts a call in the actor's mailbox (waiting for room until the deadline); the
    /// returned [`PendingCall`] waits for its result. Worker processes use the two halves
    /// to keep the order of the frames they read while replies come back in any order.
    pub(crate) async fn send_call(
        &self,
        actor: ActorId,
        method: &str,
        payload: Vec<u8>,
        timeout: Duration,
    ) -> Result<PendingCall, ActorError> {
        let deadline = Instant::now().checked_add(timeout);
        let entry = self.entry(actor)?;
        let mut exit = entry.shared.subscribe();
        let permit = tokio::select! {
            permit = Arc::clone(&entry.permits).acquire_owned() => {
                permit.map_err(|_| shut_down())?
            }
            reason = ended(&mut exit) => return Err(reason.error(actor)),
            () = until(deadline) => return Err(timed_out(actor, method, timeout)),
        };
        check_open(&entry, &exit)?;
        let (reply, receiver) = oneshot::channel();
        entry.addr.do_send(Mail::Call {
            method: method.to_string(),
            payload,
            reply,
            permit,
        });
        Ok(PendingCall {
            actor,
            method: method.to_string(),
            timeout,
            deadline,
            reply: receiver,
            exit,
        })
    }

    /// Sends `method` without waiting for it to run: returns once the message is in the
    /// mailbox, waiting while the mailbox is full. Cancel-safe: dropped before it returns,
    /// it leaves nothing queued.
    pub async fn tell(
        &self,
        actor: ActorId,
        method: &str,
        payload: Vec<u8>,
    ) -> Result<(), ActorError> {
        let entry = self.entry(actor)?;
        let mut exit = entry.shared.subscribe();
        let permit = tokio::select! {
            permit = Arc::clone(&entry.permits).acquire_owned() => {
                permit.map_err(|_| shut_down())?
            }
            reason = ended(&mut exit) => return Err(reason.error(actor)),
        };
        check_open(&entry, &exit)?;
        entry.addr.do_send(Mail::Tell {
            method: method.to_string(),
            payload,
            permit,
        });
        Ok(())
    }

    /// Stops an actor. Gracefully (`kill: false`): messages already queued run, then
    /// [`Actor::stopping`](super::Actor::stopping), and the exit is reported when it has
    /// ended; new messages are refused at once. `kill: true`: queued messages are dropped,
    /// their callers get "actor N was killed" at once, and the exit is reported at once;
    /// a method already running cannot be interrupted (it is a thread) and finishes first.
    pub fn stop(&self, actor: ActorId, kill: bool) -> Result<(), ActorError> {
        let entry = self.entry_even_stopping(actor)?;
        if kill {
            entry.shared.kill();
            entry.shared.finish(ExitReason::Killed);
            entry.addr.do_send(Mail::Kill);
        } else if entry.shared.begin_stop() {
            entry.addr.do_send(Mail::Stop);
        }
        Ok(())
    }

    /// The actors running (or stopping) here.
    pub fn actors(&self) -> Vec<ActorId> {
        let state = self.inner.table.lock();
        let mut ids: Vec<ActorId> = state
            .actors
            .iter()
            .filter(|(_, slot)| matches!(slot, Slot::Running(_)))
            .map(|(id, _)| *id)
            .collect();
        ids.sort();
        ids
    }

    /// Whether this host has neither the actor (starting, running or stopping) nor a
    /// record of its end.
    pub(crate) fn knows_nothing_of(&self, actor: ActorId) -> bool {
        let state = self.inner.table.lock();
        !state.actors.contains_key(&actor)
            && state.tombstones.missing(actor) == ActorError::NotFound(actor)
    }

    fn entry(&self, actor: ActorId) -> Result<Arc<Entry>, ActorError> {
        let entry = self.entry_even_stopping(actor)?;
        if entry.shared.is_stopping() {
            return Err(ActorError::NotRunning {
                actor_id: actor,
                state: "stopping",
            });
        }
        Ok(entry)
    }

    fn entry_even_stopping(&self, actor: ActorId) -> Result<Arc<Entry>, ActorError> {
        let state = self.inner.table.lock();
        match state.actors.get(&actor) {
            Some(Slot::Running(entry)) => Ok(Arc::clone(entry)),
            Some(Slot::Starting) => Err(ActorError::NotRunning {
                actor_id: actor,
                state: "starting",
            }),
            None => Err(state.tombstones.missing(actor)),
        }
    }
}

impl PendingCall {
    /// Waits for the call's result until its deadline.
    pub(crate) async fn reply(self) -> Result<Vec<u8>, ActorError> {
        let PendingCall {
            actor,
            method,
            timeout,
            deadline,
            mut reply,
            mut exit,
        } = self;
        tokio::select! {
            biased;
            result = &mut reply => match result {
                Ok(result) => result,
                // Dropped unanswered: the actor ended first.
                Err(_) => Err(ended(&mut exit).await.error(actor)),
            },
            // The actor replies before it records its end, but this branch may see the end
            // between that reply and the poll of the first branch: look again.
            reason = ended(&mut exit) => match reply.try_recv() {
                Ok(result) => result,
                Err(_) => Err(reason.error(actor)),
            },
            () = until(deadline) => Err(timed_out(actor, &method, timeout)),
        }
    }
}

impl Table {
    fn lock(&self) -> MutexGuard<'_, TableState> {
        // The state stays consistent between statements; a panic elsewhere leaves it usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl ExitSink for Table {
    /// Forgets the actor, remembers why it ended, tells the daemon. Only for the actor
    /// registered under that id: one whose start was given up is never reported.
    fn exited(&self, actor: &Shared, reason: &ExitReason) {
        let mut state = self.lock();
        let registered = match state.actors.get(&actor.id) {
            Some(Slot::Running(entry)) => std::ptr::eq(Arc::as_ptr(&entry.shared), actor),
            _ => false,
        };
        if !registered {
            return;
        }
        let actor = actor.id;
        state.actors.remove(&actor);
        state.tombstones.insert(actor, reason.clone());
        let _ = self.exits.send(ActorExit {
            actor_id: actor,
            reason: reason.clone(),
        });
    }
}

/// Frees a start's slot in the table unless the actor got registered.
struct Reservation<'a> {
    table: &'a Table,
    id: ActorId,
    done: bool,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.done {
            let mut state = self.table.lock();
            if matches!(state.actors.get(&self.id), Some(Slot::Starting)) {
                state.actors.remove(&self.id);
            }
        }
    }
}

/// The CUDA numbers of `gpus` in a process that sees `visible` (physical indices in
/// `CUDA_VISIBLE_DEVICES` order; `None`: all, in physical order).
fn cuda_ordinals(gpus: &[u32], visible: Option<&[u32]>) -> Result<Vec<u32>, String> {
    let Some(visible) = visible else {
        return Ok(gpus.to_vec());
    };
    gpus.iter()
        .map(|gpu| {
            visible
                .iter()
                .position(|v| v == gpu)
                .and_then(|i| u32::try_from(i).ok())
                .ok_or_else(|| {
                    format!(
                        "gpu {gpu} is not visible to this process (CUDA_VISIBLE_DEVICES={})",
                        join(visible)
                    )
                })
        })
        .collect()
}

/// `3,1`: indices as `CUDA_VISIBLE_DEVICES` lists them.
pub(crate) fn join(gpus: &[u32]) -> String {
    gpus.iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Refuses a message that got its permit while the actor ended or began to stop.
fn check_open(entry: &Entry, exit: &watch::Receiver<Option<ExitReason>>) -> Result<(), ActorError> {
    if let Some(reason) = exit.borrow().as_ref() {
        return Err(reason.error(entry.shared.id));
    }
    if entry.shared.is_stopping() {
        return Err(ActorError::NotRunning {
            actor_id: entry.shared.id,
            state: "stopping",
        });
    }
    Ok(())
}

/// Resolves when the actor has ended, with how.
async fn ended(exit: &mut watch::Receiver<Option<ExitReason>>) -> ExitReason {
    match exit.wait_for(Option::is_some).await {
        Ok(reason) => reason.clone().unwrap_or(ExitReason::Killed),
        // The sender lives in `Shared`, which the waiting caller holds through `Entry`
        // or `PendingCall`... except once every host is gone: treat that as a kill.
        Err(_) => ExitReason::Killed,
    }
}

/// Resolves at `deadline`, or never.
async fn until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

fn timed_out(actor: ActorId, method: &str, timeout: Duration) -> ActorError {
    ActorError::Timeout {
        actor_id: actor,
        method: method.to_string(),
        timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
    }
}

fn start_error(actor: ActorId, kind: &str, reason: String) -> ActorError {
    ActorError::Start {
        actor_id: actor,
        kind: kind.to_string(),
        reason,
    }
}

fn shut_down() -> ActorError {
    ActorError::Runtime {
        reason: "the actor runtime has shut down".into(),
    }
}

impl fmt::Debug for LocalActors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalActors")
            .field("registry", &self.inner.registry)
            .field("options", &self.inner.options)
            .field("actors", &self.actors())
            .finish()
    }
}

impl fmt::Debug for PendingCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PendingCall")
            .field("actor", &self.actor)
            .field("method", &self.method)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
#[path = "local_tests.rs"]
mod tests;
