//! The actors a daemon hosts (a node's, and the head's own, since the head is a node
//! too), and its answers to the actor requests addressed to them.
//!
//! [`NodeActors`] puts an actor with no process group in the daemon itself
//! ([`LocalActors`]) and one with a group in that group's worker process
//! ([`WorkerPool`]), and routes calls, tells and stops to where each runs. Only the head
//! starts and stops actors on a node (`ActorStart`, `ActorStop` from the peer `head`);
//! any member of the cluster calls and tells them. Every actor that ended is reported to
//! the head once (a node's `report_exits`; the head records its own): `ActorEnded`, retried while the head is unreachable.
//!
//! Fencing: when the node's session is over (the head refused it, or the node was cut off
//! from the head for the dead window), the head has failed every actor of that session.
//! [`NodeActors::fence`] kills them all and waits for their worker processes to exit;
//! until [`NodeActors::unfence`] (the node is back in a session) it starts nothing.

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{Instrument, info_span, warn};

use crate::actor::{
    ActorError, ActorExit, ActorId, ActorRegistry, ActorSpec, ClusterAccess,
    DEFAULT_MAILBOX_CAPACITY, ExitReason, FailureOrigin, LocalActors, LocalOptions, PoolOptions,
    WorkerCommand, WorkerPool, visible_gpus,
};
use crate::transport::Peer;
use crate::wire::{self, Message};

/// How often a fence looks whether what it killed has ended.
const FENCE_POLL: Duration = Duration::from_millis(20);

/// What a daemon needs to host actors: the kinds it can build, and how to start worker
/// processes. The default hosts nothing (an empty registry) and starts no workers.
#[derive(Debug, Clone)]
pub struct ActorHosting {
    /// The kinds this daemon and its workers can build; the worker program must register
    /// the same ones.
    pub registry: ActorRegistry,
    /// The program worker processes run (the binary passes itself with its hidden
    /// `worker` subcommand); without one, actors with a process group cannot start here.
    pub worker: Option<WorkerCommand>,
    /// Messages that may wait in the mailbox of an actor hosted in the daemon.
    pub mailbox_capacity: usize,
    /// How worker processes run.
    pub pool: PoolOptions,
}

impl Default for ActorHosting {
    fn default() -> Self {
        ActorHosting {
            registry: ActorRegistry::new(),
            worker: None,
            mailbox_capacity: DEFAULT_MAILBOX_CAPACITY,
            pool: PoolOptions::default(),
        }
    }
}

/// The actors of one daemon, in the daemon itself or in its worker processes.
pub(crate) struct NodeActors {
    local: LocalActors,
    pool: Option<WorkerPool>,
    /// The actors started in a worker process; every other one is in `local`.
    pooled: Mutex<HashSet<ActorId>>,
    /// The actors started (or starting) here whose end the head has not been told of.
    unreported: Mutex<HashSet<ActorId>>,
    /// Set by [`NodeActors::fence`] until [`NodeActors::unfence`]: starts are refused.
    fenced: AtomicBool,
}

/// What a fence did.
#[derive(Debug)]
pub(crate) struct Fence {
    /// The actors it killed.
    pub(crate) killed: Vec<ActorId>,
    /// Whether every actor ended and every worker process exited within the limit.
    pub(crate) settled: bool,
}

impl NodeActors {
    /// Starts the hosts (the actix thread of the daemon's actors); every actor that ends
    /// is reported on the returned channel.
    /// `data_ip` is the address the daemon binds; its actors bind their own listeners to
    /// it. `cluster` is how its actors reach the cluster.
    pub(crate) fn new(
        hosting: ActorHosting,
        data_ip: IpAddr,
        cluster: ClusterAccess,
    ) -> Result<(Arc<Self>, mpsc::UnboundedReceiver<ActorExit>), ActorError> {
        let (exits, ended) = mpsc::unbounded_channel();
        let options = LocalOptions {
            mailbox_capacity: hosting.mailbox_capacity,
            visible_gpus: visible_gpus(std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref()),
            data_ip,
            cluster: Some(cluster.clone()),
        };
        let local = LocalActors::new(hosting.registry, options, exits.clone())?;
        let pool_options = PoolOptions {
            data_ip,
            cluster: Some(cluster),
            ..hosting.pool
        };
        let pool = hosting
            .worker
            .map(|command| WorkerPool::new(command, pool_options, exits));
        let actors = NodeActors {
            local,
            pool,
            pooled: Mutex::default(),
            unreported: Mutex::default(),
            fenced: AtomicBool::new(false),
        };
        Ok((Arc::new(actors), ended))
    }

    /// Starts an actor here: in the daemon when `group` is empty, else in the group's
    /// worker process. Returns once its constructor has finished.
    pub(crate) async fn start(&self, spec: ActorSpec, group: &str) -> Result<(), ActorError> {
        let id = spec.id;
        if self.fenced.load(Ordering::SeqCst) {
            return Err(ActorError::Start {
                actor_id: id,
                kind: spec.kind,
                reason: "this node's session with the head is over and it has not joined \
                         again; it starts no actor until it has"
                    .to_owned(),
            });
        }
        // Before the start: an actor may end before its start returns.
        lock_set(&self.unreported).insert(id);
        let started = self.start_in(spec, group).await;
        if started.is_err() {
            lock_set(&self.unreported).remove(&id);
        }
        started
    }

    async fn start_in(&self, spec: ActorSpec, group: &str) -> Result<(), ActorError> {
        let id = spec.id;
        if group.is_empty() {
            self.lock().remove(&id);
            return self.local.start(spec).await;
        }
        let Some(pool) = &self.pool else {
            return Err(ActorError::Worker {
                group: group.to_owned(),
                reason: "this daemon starts no worker processes (no worker program given)"
                    .to_owned(),
            });
        };
        self.lock().insert(id);
        let started = pool.start_actor(group, spec).await;
        if started.is_err() {
            self.lock().remove(&id);
        }
        started
    }

    /// Kills every actor hosted here and refuses starts until [`NodeActors::unfence`];
    /// then waits, at most `limit`, until every actor has ended and every worker process
    /// has exited. An actor hosted in the daemon itself whose method is running cannot be
    /// interrupted: it counts as ended (as any kill does) and its method finishes.
    pub(crate) async fn fence(&self, limit: Duration) -> Fence {
        self.fenced.store(true, Ordering::SeqCst);
        let mut killed = self.local.actors();
        if let Some(pool) = &self.pool {
            killed.extend(pool.actors());
        }
        killed.sort();
        killed.dedup();
        for &actor in &killed {
            // An actor that ended meanwhile needs no kill.
            let _ = self.stop(actor, true).await;
        }
        let settled = self.wait_until(limit, || self.stopped()).await;
        Fence { killed, settled }
    }

    /// Waits, at most `limit`, until the head has been told of the end of every actor
    /// that ran here (or the reports were given up); whether it was.
    pub(crate) async fn wait_reported(&self, limit: Duration) -> bool {
        self.wait_until(limit, || lock_set(&self.unreported).is_empty())
            .await
    }

    /// The node is in a session again: starts are taken.
    pub(crate) fn unfence(&self) {
        self.fenced.store(false, Ordering::SeqCst);
    }

    /// The head was told of `actor`'s end (or the report was given up).
    pub(crate) fn reported(&self, actor: ActorId) {
        lock_set(&self.unreported).remove(&actor);
    }

    /// Whether no actor runs here and no worker process is left.
    fn stopped(&self) -> bool {
        self.local.actors().is_empty()
            && self
                .pool
                .as_ref()
                .is_none_or(|pool| pool.actors().is_empty() && pool.processes() == 0)
    }

    async fn wait_until(&self, limit: Duration, done: impl Fn() -> bool) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if done() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(FENCE_POLL).await;
        }
    }

    /// Calls `method` of an actor hosted here, waiting at most `timeout`.
    pub(crate) async fn call(
        &self,
        actor: ActorId,
        method: &str,
        payload: Vec<u8>,
        timeout: Duration,
    ) -> Result<Vec<u8>, ActorError> {
        match self.pool_of(actor) {
            Some(pool) => pool.call(actor, method, payload, timeout).await,
            None => self.local.call(actor, method, payload, timeout).await,
        }
    }

    /// Puts `method` in the actor's mailbox (waiting while it is full).
    pub(crate) async fn tell(
        &self,
        actor: ActorId,
        method: &str,
        payload: Vec<u8>,
    ) -> Result<(), ActorError> {
        match self.pool_of(actor) {
            Some(pool) => pool.tell(actor, method, payload).await,
            None => self.local.tell(actor, method, payload).await,
        }
    }

    /// The newest `count` lines of the output of an actor hosted here, or of one that
    /// ended here lately in a worker process (the pool keeps the last ones), and whether
    /// it has a worker process of its own: one the daemon runs itself has no lines of its
    /// own (they are the daemon's log).
    pub(crate) fn output(
        &self,
        actor: ActorId,
        count: usize,
    ) -> Result<(Vec<String>, bool), ActorError> {
        match self.pool_of(actor) {
            Some(pool) => pool.output(actor, count).map(|lines| (lines, true)),
            None if self.local.actors().contains(&actor) => Ok((Vec::new(), false)),
            None => Err(ActorError::NotFound(actor)),
        }
    }

    /// Stops (or kills) an actor hosted here; its end is reported on the exit channel.
    pub(crate) async fn stop(&self, actor: ActorId, kill: bool) -> Result<(), ActorError> {
        match self.pool_of(actor) {
            Some(pool) => pool.stop(actor, kill).await,
            None => self.local.stop(actor, kill),
        }
    }

    /// Forgets where an actor that ended ran (a late caller still learns why it ended).
    pub(crate) fn ended(&self, actor: ActorId) {
        self.lock().remove(&actor);
    }

    /// Answers an actor request for the actors hosted here: calls and tells from anyone,
    /// starts and stops only `from_head`. `None` for a request that is not for a node.
    pub(crate) async fn serve(
        &self,
        peer: &Peer,
        request: Message,
        from_head: bool,
    ) -> Option<Message> {
        let answer = match request {
            Message::ActorCall {
                actor_id,
                call_id,
                method,
                payload,
                timeout_ms,
            } => {
                let actor = ActorId(actor_id);
                let timeout = Duration::from_millis(u64::from(timeout_ms));
                // An end after the actor was found running may have come from this very
                // call: the caller must not send it again (at most once).
                let running = self.is_running(actor);
                match self.call(actor, &method, payload, timeout).await {
                    Ok(value) => Message::ActorReply {
                        call_id,
                        result: Ok(value),
                    },
                    Err(ActorError::Method { message, .. }) => Message::ActorReply {
                        call_id,
                        result: Err(message),
                    },
                    Err(error) => {
                        let ended = matches!(
                            error,
                            ActorError::Failed { .. }
                                | ActorError::Killed(_)
                                | ActorError::Stopped(_)
                        );
                        let mut reply = error_reply(actor, &error);
                        if let Message::ActorError { delivered, .. } = &mut reply {
                            *delivered = running && ended;
                        }
                        reply
                    }
                }
            }
            Message::ActorOutput { actor_id, lines } => {
                let count = lines.min(crate::wire::MAX_OUTPUT_LINES) as usize;
                match self.output(ActorId(actor_id), count) {
                    Ok((lines, own_process)) => Message::ActorOutputLines {
                        actor_id,
                        lines,
                        own_process,
                    },
                    Err(error) => error_reply(ActorId(actor_id), &error),
                }
            }
            Message::ActorTell {
                actor_id,
                method,
                payload,
            } => match self.tell(ActorId(actor_id), &method, payload).await {
                Ok(()) => Message::Ack,
                Err(error) => error_reply(ActorId(actor_id), &error),
            },
            Message::ActorStart { .. } | Message::ActorStop { .. } if !from_head => {
                warn!(peer = %peer.address, name = peer.name(), "refused an actor start or stop");
                return Some(crate::daemon::refused(
                    "only the head starts and stops actors on a node",
                ));
            }
            Message::ActorStart {
                actor_id,
                kind,
                args,
                process_group,
                gpus,
            } => {
                let actor = ActorId(actor_id);
                let span = info_span!("actor", id = %actor, kind = %kind, group = %process_group);
                let spec = ActorSpec {
                    id: actor,
                    kind,
                    args,
                    gpus,
                };
                match self.start(spec, &process_group).instrument(span).await {
                    Ok(()) => Message::Ack,
                    Err(error) => Message::ActorError {
                        actor_id,
                        cause: "error".to_owned(),
                        message: start_reason(&error),
                        delivered: false,
                        origin: wire::ORIGIN_HERE,
                    },
                }
            }
            Message::ActorStop { actor_id, kill } => {
                match self.stop(ActorId(actor_id), kill).await {
                    Ok(()) => Message::Ack,
                    Err(error) => error_reply(ActorId(actor_id), &error),
                }
            }
            _ => return None,
        };
        Some(answer)
    }

    /// Whether `actor` runs (or is stopping) here.
    fn is_running(&self, actor: ActorId) -> bool {
        match self.pool_of(actor) {
            Some(pool) => pool.actors().contains(&actor),
            None => self.local.actors().contains(&actor),
        }
    }

    /// The pool when `actor` runs (or ran) in a worker process: started there, or unknown
    /// to the daemon's own host (the pool may still remember how it ended).
    fn pool_of(&self, actor: ActorId) -> Option<&WorkerPool> {
        let pool = self.pool.as_ref()?;
        (self.lock().contains(&actor) || self.local.knows_nothing_of(actor)).then_some(pool)
    }

    fn lock(&self) -> MutexGuard<'_, HashSet<ActorId>> {
        lock_set(&self.pooled)
    }
}

fn lock_set(set: &Mutex<HashSet<ActorId>>) -> MutexGuard<'_, HashSet<ActorId>> {
    // A set of ids: consistent after every statement.
    set.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The wire's `ActorError` for a request that did not reach a running actor. The message
/// leaves out the actor's id, which the caller names.
pub(crate) fn error_reply(actor: ActorId, error: &ActorError) -> Message {
    let mut origin = FailureOrigin::Here;
    let (cause, message) = match error {
        ActorError::NotFound(_) => ("unknown", "no such actor on this node".to_owned()),
        ActorError::Failed {
            reason,
            origin: failed,
            ..
        } => {
            origin = *failed;
            ("failed", reason.clone())
        }
        ActorError::Killed(_) => ("killed", "killed".to_owned()),
        ActorError::Stopped(_) => ("stopped", "stopped".to_owned()),
        ActorError::NotRunning { state, .. } => (*state, format!("still {state}")),
        ActorError::Timeout {
            method, timeout_ms, ..
        } => (
            "timeout",
            format!("did not answer '{method}' within {timeout_ms} ms"),
        ),
        ActorError::TooLarge { .. } => ("too_large", error.to_string()),
        other => ("error", other.to_string()),
    };
    Message::ActorError {
        actor_id: actor.0,
        cause: cause.to_owned(),
        message,
        delivered: false,
        origin: origin.to_wire(),
    }
}

/// Why a start failed, without the "actor N (kind) did not start" that the head adds.
pub(crate) fn start_reason(error: &ActorError) -> String {
    match error {
        ActorError::Start { reason, .. } => reason.clone(),
        other => other.to_string(),
    }
}

/// How an ended actor is reported to the head: (outcome, reason, where a failure started).
pub(crate) fn outcome(reason: &ExitReason) -> (&'static str, String, FailureOrigin) {
    match reason {
        ExitReason::Failed { reason, origin } => ("failed", reason.clone(), *origin),
        ExitReason::Stopped => ("stopped", String::new(), FailureOrigin::Here),
        ExitReason::Killed => ("killed", String::new(), FailureOrigin::Here),
    }
}
