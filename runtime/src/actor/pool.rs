//! [`WorkerPool`]: the node's actors that run in worker processes, one process per
//! process group, reached over a socket that carries `runtime::wire` frames.
//!
//! The exchange with a worker (every frame a [`Message`]):
//! - node to worker: `ActorStart`, `ActorCall`, `ActorTell`, `ActorStop`;
//! - worker to node: `ActorReply` for a call that returned (a value or a method error);
//!   `ActorLocation { state: "running" }` once an actor started, `ActorFailed` when a
//!   start or an actor failed, `ActorLocation { state: "stopped" | "killed" }` when an
//!   actor ended on request. A call whose actor ended gets no reply: the actor's end
//!   fails it.
//!
//! A group's process starts with its first actor, with `CUDA_VISIBLE_DEVICES` set to that
//! actor's GPUs; later actors of the group must use a subset of them. When a group has no
//! actor left its process is retired: its input closes once the frames queued for it are
//! written, and the worker exits (it is killed if it has not after
//! [`PoolOptions::retire_grace`]). When its last actor is killed, or the pool dropped, it
//! is killed at once (SIGKILL). A worker that exits or dies fails each of its actors with
//! how it ended and the last lines of its output.
//!
//! Output: each process's newest lines are kept ([`WorkerPool::output`]), and after an
//! actor ended (however it ended) the lines of its process stay with its id, for the
//! last [`ENDED_OUTPUTS`](process::ENDED_OUTPUTS) actors that ended: a replaced rank's
//! log. They live in the daemon's memory: a daemon that dies or restarts has none.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tracing::{Instrument, debug, info, info_span, warn};

use super::ActorId;
use super::error::{ActorError, ActorExit, ExitReason, FailureOrigin, Tombstones};
use super::local::{ActorSpec, join};
use super::process::{self, Control, EndedOutputs, PoolOptions, ReadEnd, WorkerCommand};
use crate::wire::{self, Message, WireError};

/// Frames that may wait to be written to one worker; senders wait beyond that.
const OUTGOING_FRAMES: usize = 256;

/// Room for a frame's header and fields around a payload.
pub(crate) const FRAME_OVERHEAD: usize = 4096;

/// The worker processes of a node and the actors in them. Cheap to clone; dropping the
/// last clone kills every worker.
///
/// Order: frames to one worker are written in the order sent, and the worker puts them in
/// its actors' mailboxes in that order; so the messages one task sends to one actor,
/// awaiting each, run in the order sent, as with [`LocalActors`](super::LocalActors).
/// Back-pressure: a worker reads its next frame only once the previous one is in its
/// actor's mailbox, so one actor's full mailbox holds up its whole group; senders then
/// wait (calls within their timeout).
#[derive(Clone)]
pub struct WorkerPool {
    inner: Arc<PoolInner>,
}

struct PoolInner {
    command: WorkerCommand,
    options: PoolOptions,
    state: Mutex<PoolState>,
    exits: mpsc::UnboundedSender<ActorExit>,
    next_call: AtomicU64,
    next_generation: AtomicU64,
}

struct PoolState {
    /// The processes taking new actors, by group name.
    groups: HashMap<String, Arc<Group>>,
    /// Every process not yet ended (retired ones too), by generation.
    controls: HashMap<u64, mpsc::UnboundedSender<Control>>,
    actors: HashMap<ActorId, PoolActor>,
    calls: HashMap<u64, PendingReply>,
    tombstones: Tombstones,
    /// The output of the last actors that ended.
    ended: EndedOutputs,
}

impl Default for PoolState {
    fn default() -> Self {
        PoolState {
            groups: HashMap::new(),
            controls: HashMap::new(),
            actors: HashMap::new(),
            calls: HashMap::new(),
            tombstones: Tombstones::default(),
            ended: EndedOutputs::new(process::ENDED_OUTPUTS),
        }
    }
}

/// One worker process. Its frame channel closes, and with it the worker's input, once no
/// actor refers to it any more.
struct Group {
    name: String,
    /// Tells this process from an earlier or later one of the same group.
    generation: u64,
    pid: u32,
    gpus: Vec<u32>,
    outgoing: mpsc::Sender<Message>,
    /// The newest lines of its output.
    output: Arc<process::LineRing>,
}

struct PoolActor {
    group: Arc<Group>,
    kind: String,
    state: PoolEntryState,
}

/// Where a pooled actor is in its life: starting (with whom to tell), running, or asked
/// to stop.
enum PoolEntryState {
    Starting(oneshot::Sender<Result<(), ActorError>>),
    Running,
    Stopping,
}

struct PendingReply {
    actor: ActorId,
    method: String,
    reply: oneshot::Sender<Result<Vec<u8>, ActorError>>,
}

impl WorkerPool {
    /// A pool that starts workers with `command`. Every actor that started and then ended
    /// is reported once on `exits`.
    pub fn new(
        command: WorkerCommand,
        options: PoolOptions,
        exits: mpsc::UnboundedSender<ActorExit>,
    ) -> Self {
        Self {
            inner: Arc::new(PoolInner {
                command,
                options,
                state: Mutex::default(),
                exits,
                next_call: AtomicU64::new(1),
                next_generation: AtomicU64::new(1),
            }),
        }
    }

    /// Starts an actor in `group`'s worker, starting the worker first if it is not
    /// running, and returns once the actor's constructor has finished there. Dropping the
    /// future does not cancel the start.
    pub async fn start_actor(&self, group: &str, spec: ActorSpec) -> Result<(), ActorError> {
        let ActorSpec {
            id,
            kind,
            args,
            gpus,
        } = spec;
        if group.is_empty() {
            return Err(ActorError::Worker {
                group: String::new(),
                reason: "the empty group is the node daemon itself, not a worker".into(),
            });
        }
        self.inner.check_size(id, kind.len(), args.len())?;
        let (outgoing, started) = {
            let mut state = self.inner.lock();
            if state.actors.contains_key(&id) {
                return Err(ActorError::AlreadyExists(id));
            }
            let process = match state.groups.get(group) {
                Some(process) => Arc::clone(process),
                None => self.inner.spawn(&mut state, group, &gpus)?,
            };
            if let Some(gpu) = gpus.iter().find(|gpu| !process.gpus.contains(gpu)) {
                return Err(ActorError::Worker {
                    group: group.to_string(),
                    reason: format!(
                        "it runs with CUDA_VISIBLE_DEVICES={} (the GPUs of its first actor); \
                         actor {id} needs gpu {gpu}",
                        join(&process.gpus)
                    ),
                });
            }
            let (started, outcome) = oneshot::channel();
            let outgoing = process.outgoing.clone();
            state.tombstones.remove(id);
            state.ended.remove(id);
            state.actors.insert(
                id,
                PoolActor {
                    group: process,
                    kind: kind.clone(),
                    state: PoolEntryState::Starting(started),
                },
            );
            (outgoing, outcome)
        };
        let start = Message::ActorStart {
            actor_id: id.0,
            kind,
            args,
            process_group: group.to_string(),
            gpus,
        };
        // If the worker is gone, its end fails the start.
        let _ = outgoing.send(start).await;
        started.await.unwrap_or_else(|_| Err(pool_gone()))
    }

    /// Calls `method` and waits at most `timeout` for the result.
    pub async fn call(
        &self,
        actor: ActorId,
        method: &str,
        payload: Vec<u8>,
        timeout: Duration,
    ) -> Result<Vec<u8>, ActorError> {
        self.inner.check_size(actor, method.len(), payload.len())?;
        let deadline = Instant::now().checked_add(timeout);
        let call_id = self.inner.next_call.fetch_add(1, Ordering::Relaxed);
        let (outgoing, reply) = {
            let mut state = self.inner.lock();
            let outgoing = state.running(actor)?.outgoing.clone();
            let (sender, reply) = oneshot::channel();
            let pending = PendingReply {
                actor,
                method: method.to_string(),
                reply: sender,
            };
            state.calls.insert(call_id, pending);
            (outgoing, reply)
        };
        // Forgets the call if this future ends (time out, or dropped) before its reply.
        let _forget = ForgetCall {
            pool: &self.inner,
            call_id,
        };
        let message = Message::ActorCall {
            actor_id: actor.0,
            call_id,
            method: method.to_string(),
            payload,
            timeout_ms: u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX),
        };
        let exchange = async {
            // If the worker is gone, its end answers the call.
            let _ = outgoing.send(message).await;
            reply.await
        };
        let outcome = match deadline {
            Some(deadline) => tokio::time::timeout_at(deadline, exchange).await.ok(),
            None => Some(exchange.await),
        };
        match outcome {
            Some(Ok(result)) => result,
            Some(Err(_)) => Err(pool_gone()),
            None => Err(ActorError::Timeout {
                actor_id: actor,
                method: method.to_string(),
                timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
            }),
        }
    }

    /// Sends `method` without waiting for it to run: returns once the frame is queued for
    /// the worker, waiting while that queue is full. Cancel-safe.
    pub async fn tell(
        &self,
        actor: ActorId,
        method: &str,
        payload: Vec<u8>,
    ) -> Result<(), ActorError> {
        self.inner.check_size(actor, method.len(), payload.len())?;
        let outgoing = self.inner.lock().running(actor)?.outgoing.clone();
        let message = Message::ActorTell {
            actor_id: actor.0,
            method: method.to_string(),
            payload,
        };
        outgoing
            .send(message)
            .await
            .map_err(|_| ActorError::Failed {
                actor_id: actor,
                reason: "its worker process is gone".into(),
                origin: FailureOrigin::WorkerExit,
            })
    }

    /// Stops an actor. Gracefully (`kill: false`): new messages are refused at once, what
    /// was sent before runs, then the worker reports the stop, which is reported on the
    /// exit channel. `kill: true`: its callers get "actor N was killed" and the exit is
    /// reported at once; the worker is killed with SIGKILL if no other actor runs in it,
    /// otherwise it drops what is queued for the actor (a method already running there
    /// finishes first). Stopping an actor still starting kills it; its start fails.
    pub async fn stop(&self, actor: ActorId, kill: bool) -> Result<(), ActorError> {
        let send = {
            let mut state = self.inner.lock();
            let Some(entry) = state.actors.get_mut(&actor) else {
                return Err(state.tombstones.missing(actor));
            };
            match (&entry.state, kill) {
                (PoolEntryState::Stopping, false) => None,
                (PoolEntryState::Running, false) => {
                    entry.state = PoolEntryState::Stopping;
                    Some((entry.group.outgoing.clone(), false))
                }
                // A kill, or a stop of an actor still starting (nothing of it queued).
                _ => {
                    let outgoing = entry.group.outgoing.clone();
                    let ended = state.end(actor, ExitReason::Killed, &self.inner.exits);
                    match ended {
                        Some(group) if state.is_empty(&group) => {
                            state.retire(&group, Control::Kill);
                            None
                        }
                        _ => Some((outgoing, true)),
                    }
                }
            }
        };
        if let Some((outgoing, kill)) = send {
            let message = Message::ActorStop {
                actor_id: actor.0,
                kill,
            };
            // If the worker is gone, the actor has ended anyway.
            let _ = outgoing.send(message).await;
        }
        Ok(())
    }

    /// The newest `count` lines the worker process of `actor` wrote, oldest first (an
    /// actor starting or stopping too: its process is there), or, for one of the last
    /// [`ENDED_OUTPUTS`](process::ENDED_OUTPUTS) actors that ended, the newest lines its
    /// process wrote until it exited. For another actor, why it does not run here.
    pub fn output(&self, actor: ActorId, count: usize) -> Result<Vec<String>, ActorError> {
        let state = self.inner.lock();
        match state.actors.get(&actor) {
            Some(entry) => Ok(entry.group.output.last(count)),
            None => state
                .ended
                .last(actor, count)
                .ok_or_else(|| state.tombstones.missing(actor)),
        }
    }

    /// The pid of `group`'s worker process, if one takes actors now.
    pub fn pid(&self, group: &str) -> Option<u32> {
        self.inner
            .lock()
            .groups
            .get(group)
            .map(|process| process.pid)
    }

    /// The actors hosted here (starting, running or stopping).
    pub fn actors(&self) -> Vec<ActorId> {
        let mut ids: Vec<ActorId> = self.inner.lock().actors.keys().copied().collect();
        ids.sort();
        ids
    }

    /// How many worker processes have not ended yet (retired and killed ones count until
    /// they have exited and been reaped).
    pub fn processes(&self) -> usize {
        self.inner.lock().controls.len()
    }
}

impl PoolInner {
    fn lock(&self) -> MutexGuard<'_, PoolState> {
        // Each change leaves the state consistent; a panic elsewhere leaves it usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn check_size(&self, actor: ActorId, name: usize, payload: usize) -> Result<(), ActorError> {
        let max = self.options.max_frame.saturating_sub(FRAME_OVERHEAD);
        let len = name.saturating_add(payload);
        if len > max {
            return Err(ActorError::TooLarge {
                actor_id: actor,
                len,
                max,
            });
        }
        Ok(())
    }

    /// Starts `name`'s worker process and the tasks that write to it, read from it and
    /// wait for its end.
    fn spawn(
        self: &Arc<Self>,
        state: &mut PoolState,
        name: &str,
        gpus: &[u32],
    ) -> Result<Arc<Group>, ActorError> {
        let spawned =
            process::spawn(&self.command, name, &join(gpus), &self.options).map_err(|error| {
                ActorError::Worker {
                    group: name.to_string(),
                    reason: format!("cannot start {}: {error}", self.command.program.display()),
                }
            })?;
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let process::Spawned {
            child,
            pid,
            channel,
            output: output_task,
            lines,
        } = spawned;
        let span = info_span!("worker", group = name, pid);
        let (read, write) = channel.into_split();
        let (outgoing, outgoing_frames) = mpsc::channel(OUTGOING_FRAMES);
        let (control, controls) = mpsc::unbounded_channel();
        tokio::spawn(write_frames(write, outgoing_frames).instrument(span.clone()));
        let reader = read_frames(
            read,
            Arc::downgrade(self),
            generation,
            self.options.max_frame,
        );
        let reader = tokio::spawn(reader.instrument(span.clone()));
        let pool = Arc::downgrade(self);
        let group = name.to_string();
        let grace = self.options.retire_grace;
        let output = Arc::clone(&lines);
        let stderr_lines = self.options.stderr_lines;
        let supervisor = async move {
            let (status, bad_frame) =
                process::supervise(child, reader, output_task, controls, grace).await;
            let reason_lines = lines.last(stderr_lines);
            let reason =
                process::describe_end(&group, pid, &status, bad_frame.as_deref(), &reason_lines);
            match pool.upgrade() {
                Some(pool) => pool.worker_ended(generation, &group, reason),
                None => debug!(%reason, "worker process ended after its pool"),
            }
        };
        tokio::spawn(supervisor.instrument(span));
        info!(group = name, pid, gpus = %join(gpus), "worker process started");
        let process = Arc::new(Group {
            name: name.to_string(),
            generation,
            pid,
            gpus: gpus.to_vec(),
            outgoing,
            output,
        });
        state.groups.insert(name.to_string(), Arc::clone(&process));
        state.controls.insert(generation, control);
        Ok(process)
    }

    /// Handles a frame from the worker of `generation`. Frames about actors of other
    /// processes are ignored: a worker speaks for its own actors only.
    fn dispatch(&self, generation: u64, message: Message) {
        let mut state = self.lock();
        match message {
            Message::ActorReply { call_id, result } => {
                let Some(pending) = state.calls.get(&call_id) else {
                    return; // the caller gave up
                };
                if state.generation_of(pending.actor) != Some(generation) {
                    warn!(call_id, "reply from a worker to a call it did not get");
                    return;
                }
                if let Some(pending) = state.calls.remove(&call_id) {
                    let result = result.map_err(|message| ActorError::Method {
                        actor_id: pending.actor,
                        method: pending.method,
                        message,
                    });
                    let _ = pending.reply.send(result);
                }
            }
            Message::ActorLocation {
                actor_id,
                state: actor_state,
                ..
            } => {
                let actor = ActorId(actor_id);
                if state.generation_of(actor) != Some(generation) {
                    if actor_state == "running" {
                        // Killed while it started: the worker must drop it.
                        self.kill_stray(&state, generation, actor);
                    }
                    return;
                }
                match actor_state.as_str() {
                    "running" => {
                        if let Some(entry) = state.actors.get_mut(&actor) {
                            match std::mem::replace(&mut entry.state, PoolEntryState::Running) {
                                PoolEntryState::Starting(started) => {
                                    let _ = started.send(Ok(()));
                                }
                                other => entry.state = other,
                            }
                        }
                    }
                    "stopped" => self.ended(&mut state, actor, ExitReason::Stopped),
                    "killed" => self.ended(&mut state, actor, ExitReason::Killed),
                    other => debug!(actor = %actor, state = other, "unknown actor state"),
                }
            }
            Message::ActorFailed {
                actor_id,
                reason,
                origin,
            } => {
                let actor = ActorId(actor_id);
                if state.generation_of(actor) == Some(generation) {
                    let origin = FailureOrigin::from_wire(origin);
                    self.ended(&mut state, actor, ExitReason::Failed { reason, origin });
                }
            }
            _ => warn!("unexpected message from a worker; ignored"),
        }
    }

    /// An actor of a live worker ended; retires the worker if it was the last.
    fn ended(&self, state: &mut PoolState, actor: ActorId, reason: ExitReason) {
        if let Some(group) = state.end(actor, reason, &self.exits)
            && state.is_empty(&group)
        {
            state.retire(&group, Control::Retire);
        }
    }

    fn kill_stray(&self, state: &PoolState, generation: u64, actor: ActorId) {
        let outgoing = state
            .groups
            .values()
            .find(|group| group.generation == generation)
            .map(|group| group.outgoing.clone());
        if let Some(outgoing) = outgoing {
            let stop = Message::ActorStop {
                actor_id: actor.0,
                kill: true,
            };
            tokio::spawn(async move { outgoing.send(stop).await });
        }
    }

    /// The worker of `generation` ended: each of its actors failed with `reason`.
    fn worker_ended(&self, generation: u64, group: &str, reason: String) {
        let mut state = self.lock();
        state.controls.remove(&generation);
        if state.groups.get(group).map(|g| g.generation) == Some(generation) {
            state.groups.remove(group);
        }
        let mut actors: Vec<ActorId> = state
            .actors
            .iter()
            .filter(|(_, entry)| entry.group.generation == generation)
            .map(|(id, _)| *id)
            .collect();
        if actors.is_empty() {
            debug!(%reason, "worker process ended");
            return;
        }
        actors.sort();
        warn!(%reason, actors = ?actors, "worker process ended; its actors failed");
        for actor in actors {
            let exit = ExitReason::Failed {
                reason: reason.clone(),
                origin: FailureOrigin::WorkerExit,
            };
            state.end(actor, exit, &self.exits);
        }
    }
}

impl PoolState {
    /// The process of a running actor, or why the actor takes no messages.
    fn running(&self, actor: ActorId) -> Result<&Arc<Group>, ActorError> {
        match self.actors.get(&actor) {
            Some(PoolActor {
                group,
                state: PoolEntryState::Running,
                ..
            }) => Ok(group),
            Some(PoolActor { state, .. }) => Err(ActorError::NotRunning {
                actor_id: actor,
                state: match state {
                    PoolEntryState::Starting(_) => "starting",
                    _ => "stopping",
                },
            }),
            None => Err(self.tombstones.missing(actor)),
        }
    }

    fn generation_of(&self, actor: ActorId) -> Option<u64> {
        self.actors.get(&actor).map(|entry| entry.group.generation)
    }

    /// Forgets an actor that ended: its pending calls fail, a start in progress fails,
    /// and a started actor's exit is reported. Returns its process.
    fn end(
        &mut self,
        actor: ActorId,
        reason: ExitReason,
        exits: &mpsc::UnboundedSender<ActorExit>,
    ) -> Option<Arc<Group>> {
        let entry = self.actors.remove(&actor)?;
        self.ended.insert(actor, Arc::clone(&entry.group.output));
        let error = reason.error(actor);
        let calls: Vec<u64> = self
            .calls
            .iter()
            .filter(|(_, pending)| pending.actor == actor)
            .map(|(call_id, _)| *call_id)
            .collect();
        for call_id in calls {
            if let Some(pending) = self.calls.remove(&call_id) {
                let _ = pending.reply.send(Err(error.clone()));
            }
        }
        match entry.state {
            PoolEntryState::Starting(started) => {
                let error = match reason {
                    ExitReason::Failed { reason, .. } => ActorError::Start {
                        actor_id: actor,
                        kind: entry.kind,
                        reason,
                    },
                    _ => error,
                };
                let _ = started.send(Err(error));
            }
            PoolEntryState::Running | PoolEntryState::Stopping => {
                self.tombstones.insert(actor, reason.clone());
                let _ = exits.send(ActorExit {
                    actor_id: actor,
                    reason,
                });
            }
        }
        Some(entry.group)
    }

    fn is_empty(&self, group: &Group) -> bool {
        !self
            .actors
            .values()
            .any(|entry| entry.group.generation == group.generation)
    }

    /// Takes `group` out of service: `Retire` lets it exit once its input closes, `Kill`
    /// kills it now.
    fn retire(&mut self, group: &Group, how: Control) {
        if self.groups.get(&group.name).map(|g| g.generation) == Some(group.generation) {
            self.groups.remove(&group.name);
        }
        if let Some(control) = self.controls.get(&group.generation) {
            let _ = control.send(how);
        }
        debug!(
            group = group.name,
            pid = group.pid,
            ?how,
            "worker process retired"
        );
    }
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        for control in state.controls.values() {
            let _ = control.send(Control::Kill);
        }
    }
}

/// Removes a call's pending reply when its caller stops waiting.
struct ForgetCall<'a> {
    pool: &'a PoolInner,
    call_id: u64,
}

impl Drop for ForgetCall<'_> {
    fn drop(&mut self) {
        self.pool.lock().calls.remove(&self.call_id);
    }
}

/// Writes frames to a worker in order. When the channel closes (no actor refers to the
/// worker any more) the socket's write side is shut: the worker sees the end of its input.
pub(crate) async fn write_frames(mut write: OwnedWriteHalf, mut frames: mpsc::Receiver<Message>) {
    while let Some(message) = frames.recv().await {
        if let Err(error) = wire::write_frame(&mut write, &message).await {
            debug!(%error, "cannot write to the other process");
            return;
        }
    }
}

/// Reads a worker's frames until it closes its end or sends something that is not one.
async fn read_frames(
    mut read: OwnedReadHalf,
    pool: Weak<PoolInner>,
    generation: u64,
    max_frame: usize,
) -> ReadEnd {
    loop {
        match wire::read_frame(&mut read, max_frame).await {
            Ok(Some(message)) => match pool.upgrade() {
                Some(pool) => pool.dispatch(generation, message),
                None => return ReadEnd::Closed,
            },
            Ok(None) => return ReadEnd::Closed,
            // The worker went away, perhaps mid-frame or with our frames unread (a reset).
            Err(WireError::Io(_) | WireError::Truncated { .. }) => return ReadEnd::Closed,
            Err(error) => return ReadEnd::Bad(error.to_string()),
        }
    }
}

fn pool_gone() -> ActorError {
    ActorError::Runtime {
        reason: "the worker pool was dropped".into(),
    }
}

impl fmt::Debug for WorkerPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.inner.lock();
        let mut groups: Vec<(&str, u32)> = state
            .groups
            .values()
            .map(|group| (group.name.as_str(), group.pid))
            .collect();
        groups.sort();
        f.debug_struct("WorkerPool")
            .field("command", &self.inner.command)
            .field("groups", &groups)
            .field("actors", &state.actors.len())
            .finish()
    }
}
