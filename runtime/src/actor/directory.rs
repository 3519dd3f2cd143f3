//! The head's actor directory: every actor of the cluster, where it runs, its restart
//! policy, and the events its owner reads. A pure state machine: the caller passes the time
//! in (`u64` ms, as for membership) and the [`ResourceTable`] to reserve and release in.
//!
//! The head's daemon drives an [`ActorDirectory`]: [`spawn`](ActorDirectory::spawn) when a
//! client asks, [`started`](ActorDirectory::started), [`failed`](ActorDirectory::failed) and
//! [`stopped`](ActorDirectory::stopped) as nodes answer and report,
//! [`node_lost`](ActorDirectory::node_lost) when membership ends a node's session,
//! [`stop`](ActorDirectory::stop) and [`owner_gone`](ActorDirectory::owner_gone) for
//! clients, and [`tick`](ActorDirectory::tick) when
//! [`next_deadline`](ActorDirectory::next_deadline) comes. Calls return the
//! [`ActorAction`]s the daemon must send to nodes; nothing here does I/O.
//!
//! Rules:
//! - An actor holds one reservation, named `actor:<id>` in the table, from the moment it
//!   is placed until the head knows it no longer runs: it failed, its node was lost, or its
//!   node confirmed a stop. Each reservation is released exactly once.
//! - A failure (an actor error, its worker's exit, a start that failed, the loss of its
//!   node) releases the reservation. With restarts left the actor is `Restarting` until
//!   `now + backoff` (the policy's backoff doubled per earlier restart, capped at
//!   [`DirectoryConfig::max_backoff_ms`]); `tick` at that deadline places it again, on
//!   any node, by the same strategy. With none left it has `Failed` for good.
//! - A restart that cannot be placed (no node has room) uses up that restart like any
//!   other failure: restarts bound the tries to bring an actor back, whatever stops them,
//!   so a lost cluster ends in `Failed` rather than in waiting forever.
//! - Restarts are counted over the actor's life and never reset. An actor that ends on its
//!   own (its node reports it stopped without being asked) is stopped, not restarted.
//! - A stop is sent once the node has answered the start (a stop overtaking its start on
//!   another stream would find nothing to stop). A graceful stop not confirmed within
//!   [`DirectoryConfig::stop_grace_ms`] becomes a kill.
//! - Reports about an actor from a node it is not on now (a late answer from before a
//!   restart) are stale and ignored; a node that says it started an actor the head does
//!   not want there is told to kill it.
//! - Every failure, restart, end and stop is an event for the actor's owner, numbered by
//!   one sequence for the whole cluster.
//! - The directory reserves and releases, but never adds or removes nodes: the head takes
//!   a node out of the table when its session ends, then tells `node_lost` which
//!   reservations went with it.
//!
//! Memory is bounded: the last [`DirectoryConfig::max_events`] events are kept, and the
//! records of the last [`DirectoryConfig::max_ended`] actors that ended (their arguments
//! dropped); older ones are forgotten and `locate` no longer knows them.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fmt;

use super::error::FailureOrigin;
use super::id::ActorId;
use crate::membership::NodeId;
use crate::placement::{PlacementError, ReservationId, ResourceTable, Resources, Strategy};

/// The origin of the failures the directory finds itself other than a lost node's (a
/// start that failed or could not be placed): they start where they are seen.
const HERE: FailureOrigin = FailureOrigin::Here;

/// The owner of detached actors: no connection's, so none's end kills them, and any
/// client may stop them.
pub(crate) const DETACHED_OWNER: &str = "detached";

/// Limits of the directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirectoryConfig {
    /// The longest pause before a restart, however often the backoff doubled.
    pub max_backoff_ms: u64,
    /// How long a graceful stop may take before the head kills the actor.
    pub stop_grace_ms: u64,
    /// Events kept for owners to read; older ones are dropped.
    pub max_events: usize,
    /// Records of ended (failed or stopped) actors kept for `locate` and `status`.
    pub max_ended: usize,
}

impl Default for DirectoryConfig {
    fn default() -> Self {
        DirectoryConfig {
            max_backoff_ms: 30_000,
            stop_grace_ms: 30_000,
            max_events: 10_000,
            max_ended: 10_000,
        }
    }
}

/// How often the head brings a failed actor back, and how fast.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RestartPolicy {
    /// Restarts over the actor's life (0: never).
    pub max_restarts: u32,
    /// The pause before the first restart, doubled before each further one.
    pub backoff_ms: u64,
}

impl RestartPolicy {
    /// The pause before restart `attempt` (1 for the first), at most `max_backoff_ms`.
    pub fn backoff(&self, attempt: u32, max_backoff_ms: u64) -> u64 {
        let factor = 1u64
            .checked_shl(attempt.saturating_sub(1))
            .unwrap_or(u64::MAX);
        self.backoff_ms.saturating_mul(factor).min(max_backoff_ms)
    }
}

/// Which job an actor works for and as which rank, as its spawner names them; `imgrun
/// status` shows it beside the actor.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize)]
pub struct ActorLabel {
    /// The job's name (for a training run, its folder's name).
    pub job: String,
    pub rank: u32,
}

impl ActorLabel {
    pub fn new(job: impl Into<String>, rank: u32) -> Self {
        ActorLabel {
            job: job.into(),
            rank,
        }
    }
}

impl fmt::Display for ActorLabel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "job {} rank {}", self.job, self.rank)
    }
}

/// What a client asks for (the domain form of the wire's `ActorSpawn`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpawnRequest {
    /// The registered kind of actor.
    pub kind: String,
    /// The constructor's arguments, kept to start the actor again after a failure.
    pub args: Vec<u8>,
    pub resources: Resources,
    pub strategy: Strategy,
    /// The worker process it runs in (empty: the node daemon itself).
    pub process_group: String,
    pub restart: RestartPolicy,
    pub label: Option<ActorLabel>,
}

/// Where an actor's life stands, as the head knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActorState {
    /// Placed; the node was told to start it and has not answered yet.
    Starting,
    /// Its node said it started.
    Running,
    /// Failed; restart `attempt` is placed at `at_ms`. Holds no resources meanwhile.
    Restarting { attempt: u32, at_ms: u64 },
    /// Asked to stop (`kill`: at once, dropping queued messages); holds its resources
    /// until its node confirms.
    Stopping { kill: bool },
    /// Failed with no restart left. Final.
    Failed,
    /// Stopped. Final.
    Stopped,
}

impl ActorState {
    /// Failed or stopped: nothing will happen to the actor any more.
    pub fn is_ended(self) -> bool {
        matches!(self, ActorState::Failed | ActorState::Stopped)
    }

    /// `starting`, `running`, `restarting`, `stopping`, `failed` or `stopped`.
    pub fn name(self) -> &'static str {
        match self {
            ActorState::Starting => "starting",
            ActorState::Running => "running",
            ActorState::Restarting { .. } => "restarting",
            ActorState::Stopping { .. } => "stopping",
            ActorState::Failed => "failed",
            ActorState::Stopped => "stopped",
        }
    }
}

impl fmt::Display for ActorState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What the daemon must tell a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ActorAction {
    /// Start `actor` on `node` with the GPUs of `reservation` (`ActorStart` on the wire);
    /// then report [`ActorDirectory::started`] or [`ActorDirectory::start_failed`].
    Start {
        actor: ActorId,
        node: NodeId,
        reservation: ReservationId,
        /// The node's GPU indices held, for `CUDA_VISIBLE_DEVICES`.
        gpus: Vec<u32>,
        kind: String,
        args: Vec<u8>,
        process_group: String,
    },
    /// Stop `actor` on `node` (`ActorStop`); then report [`ActorDirectory::stopped`].
    Stop {
        actor: ActorId,
        node: NodeId,
        kill: bool,
    },
}

impl ActorAction {
    pub fn actor(&self) -> ActorId {
        match *self {
            ActorAction::Start { actor, .. } | ActorAction::Stop { actor, .. } => actor,
        }
    }

    /// The node to send it to.
    pub fn node(&self) -> NodeId {
        match *self {
            ActorAction::Start { node, .. } | ActorAction::Stop { node, .. } => node,
        }
    }
}

/// What an event says happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ActorEventKind {
    /// Failed for good.
    Failed,
    /// Failed, or a restart could not be placed; another restart is due.
    Restarting,
    /// A restart started.
    Restarted,
    /// Stopped (asked by its owner, because its owner is gone, or on its own).
    Stopped,
}

impl ActorEventKind {
    /// `failed`, `restarting`, `restarted` or `stopped`, as on the wire.
    pub fn name(self) -> &'static str {
        match self {
            ActorEventKind::Failed => "failed",
            ActorEventKind::Restarting => "restarting",
            ActorEventKind::Restarted => "restarted",
            ActorEventKind::Stopped => "stopped",
        }
    }
}

impl ActorEventKind {
    /// The kind named `name` ([`ActorEventKind::name`]).
    pub fn from_name(name: &str) -> Option<Self> {
        [
            ActorEventKind::Failed,
            ActorEventKind::Restarting,
            ActorEventKind::Restarted,
            ActorEventKind::Stopped,
        ]
        .into_iter()
        .find(|kind| kind.name() == name)
    }
}

impl fmt::Display for ActorEventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Something that happened to an actor, for its owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActorEvent {
    /// One more than the previous event of the cluster; the first is 1.
    pub seq: u64,
    pub at_ms: u64,
    pub actor: ActorId,
    pub owner: String,
    /// The node concerned: where it failed, stopped or restarted; `None` when it was on
    /// none (a restart that could not be placed, a stop while waiting to restart).
    pub node: Option<NodeId>,
    pub kind: ActorEventKind,
    /// Why, for a person to read.
    pub reason: String,
    /// Where a failure (`Failed`, `Restarting`) started; `Here` for other events.
    pub origin: FailureOrigin,
}

/// The answer to [`ActorDirectory::events_after`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventPage {
    /// The owner's events after the asked seq that are still kept, oldest first.
    pub events: Vec<ActorEvent>,
    /// Some events of this owner after the asked seq were dropped (or may have been):
    /// the owner should `locate` its actors rather than trust the page to be complete.
    pub missed: bool,
}

/// Where an actor is, for `locate`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActorLocation {
    /// Its node while starting, running or stopping; `None` otherwise.
    pub node: Option<NodeId>,
    pub state: ActorState,
}

/// Why the directory refused a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DirectoryError {
    /// The table's refusal, word for word ("unsatisfiable: needs 4 gpu on one node; ...").
    #[error(transparent)]
    Placement {
        #[from]
        source: PlacementError,
    },
    #[error("unknown actor {actor}")]
    UnknownActor { actor: ActorId },
    #[error("actor {actor} belongs to another owner")]
    NotOwner { actor: ActorId },
}

/// One actor as the directory knows it.
#[derive(Debug, Clone)]
pub struct ActorRecord {
    id: ActorId,
    owner: String,
    kind: String,
    args: Vec<u8>,
    resources: Resources,
    strategy: Strategy,
    process_group: String,
    restart: RestartPolicy,
    label: Option<ActorLabel>,
    spawned_at_ms: u64,
    state: ActorState,
    /// Some exactly while starting, running or stopping.
    node: Option<NodeId>,
    /// Some while it holds resources; taken when they are released.
    reservation: Option<ReservationId>,
    gpus: Vec<u32>,
    restarts: u32,
    last_failure: Option<String>,
    /// Where the last failure started.
    last_origin: FailureOrigin,
    /// Some while stopping.
    stop: Option<StopOrder>,
}

// The readers are for tests today, and for a listing of actors in `status` (not yet).
#[allow(dead_code)]
impl ActorRecord {
    pub fn id(&self) -> ActorId {
        self.id
    }

    /// Who spawned it and reads its events.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// The constructor's arguments (empty once the actor ended).
    pub fn args(&self) -> &[u8] {
        &self.args
    }

    pub fn resources(&self) -> &Resources {
        &self.resources
    }

    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    pub fn process_group(&self) -> &str {
        &self.process_group
    }

    pub fn restart(&self) -> RestartPolicy {
        self.restart
    }

    /// The job and rank its spawner gave.
    pub fn label(&self) -> Option<&ActorLabel> {
        self.label.as_ref()
    }

    pub fn spawned_at_ms(&self) -> u64 {
        self.spawned_at_ms
    }

    pub fn state(&self) -> ActorState {
        self.state
    }

    /// Its node while starting, running or stopping.
    pub fn node(&self) -> Option<NodeId> {
        self.node
    }

    /// The reservation it holds, if any.
    pub fn reservation(&self) -> Option<ReservationId> {
        self.reservation
    }

    /// The node's GPU indices it holds.
    pub fn gpus(&self) -> &[u32] {
        &self.gpus
    }

    /// Restarts placed so far.
    pub fn restarts(&self) -> u32 {
        self.restarts
    }

    /// Why it last failed.
    pub fn last_failure(&self) -> Option<&str> {
        self.last_failure.as_deref()
    }

    /// Where the last failure started (`Here` if it never failed).
    pub fn last_origin(&self) -> FailureOrigin {
        self.last_origin
    }

    fn start_action(&self, node: NodeId, reservation: ReservationId) -> ActorAction {
        ActorAction::Start {
            actor: self.id,
            node,
            reservation,
            gpus: self.gpus.clone(),
            kind: self.kind.clone(),
            args: self.args.clone(),
            process_group: self.process_group.clone(),
        }
    }

    /// Gives its resources back (once: the reservation is taken) and leaves its node;
    /// returns the node it was on.
    fn release(&mut self, table: &ResourceTable) -> Option<NodeId> {
        if let Some(id) = self.reservation.take() {
            // Refused only when the node left the table, which dropped it already (or
            // came back in a new session, which does not hold it).
            let _ = table.release(id);
        }
        self.gpus.clear();
        self.node.take()
    }
}

/// A stop on its way.
#[derive(Debug, Clone)]
struct StopOrder {
    /// For the `stopped` event.
    reason: String,
    /// The node was told (it is not before it answered the start).
    sent: bool,
    /// When a graceful stop sent becomes a kill.
    kill_at_ms: Option<u64>,
}

/// The head's view of every actor. See the module docs for the rules.
#[derive(Debug)]
pub struct ActorDirectory {
    config: DirectoryConfig,
    actors: BTreeMap<ActorId, ActorRecord>,
    /// Ended actors, oldest first, to forget beyond `max_ended`.
    ended: VecDeque<ActorId>,
    log: EventLog,
    next_actor: u64,
}

impl ActorDirectory {
    /// An empty directory; actor ids count from 1.
    pub fn new(config: DirectoryConfig) -> Self {
        ActorDirectory {
            config,
            actors: BTreeMap::new(),
            ended: VecDeque::new(),
            log: EventLog::new(config.max_events),
            next_actor: 1,
        }
    }

    #[allow(dead_code)] // the head uses the default configuration; tests read it
    pub fn config(&self) -> &DirectoryConfig {
        &self.config
    }

    /// Places a new actor of `owner` and reserves its resources in `table`, or refuses
    /// with nothing reserved. The actor is `Starting`; the daemon sends the returned
    /// `Start` to its node.
    pub fn spawn(
        &mut self,
        now: u64,
        owner: &str,
        request: SpawnRequest,
        table: &ResourceTable,
    ) -> Result<(ActorId, ActorAction), DirectoryError> {
        let id = ActorId(self.next_actor);
        let reservation = table.reserve(&request.resources, request.strategy, &holder(id))?;
        self.next_actor += 1;
        let record = ActorRecord {
            id,
            owner: owner.to_string(),
            kind: request.kind,
            args: request.args,
            resources: request.resources,
            strategy: request.strategy,
            process_group: request.process_group,
            restart: request.restart,
            label: request.label,
            spawned_at_ms: now,
            state: ActorState::Starting,
            node: Some(reservation.node),
            reservation: Some(reservation.id),
            gpus: reservation.gpus,
            restarts: 0,
            last_failure: None,
            last_origin: FailureOrigin::Here,
            stop: None,
        };
        let action = record.start_action(reservation.node, reservation.id);
        self.actors.insert(id, record);
        Ok((id, action))
    }

    /// `node` answered a `Start`: the actor runs there. Returns a `Stop` when the head no
    /// longer wants it there: a stop was asked meanwhile (sent now), or the actor has
    /// moved on, ended or is unknown (a kill, so that no stray copy holds its GPUs).
    pub fn started(&mut self, now: u64, actor: ActorId, node: NodeId) -> Option<ActorAction> {
        let stray = ActorAction::Stop {
            actor,
            node,
            kill: true,
        };
        let Some(record) = self.actors.get_mut(&actor) else {
            return Some(stray);
        };
        if record.node != Some(node) {
            return Some(stray);
        }
        match record.state {
            ActorState::Starting => {
                record.state = ActorState::Running;
                if record.restarts > 0 {
                    let reason = format!(
                        "restart {} of {} on node {node}",
                        record.restarts, record.restart.max_restarts
                    );
                    self.log.push(
                        now,
                        record,
                        Some(node),
                        ActorEventKind::Restarted,
                        reason,
                        HERE,
                    );
                }
                None
            }
            ActorState::Stopping { kill } => {
                let order = record.stop.as_mut().filter(|order| !order.sent)?;
                order.sent = true;
                order.kill_at_ms = (!kill).then(|| now.saturating_add(self.config.stop_grace_ms));
                Some(ActorAction::Stop { actor, node, kill })
            }
            _ => None,
        }
    }

    /// `node` could not start the actor (it refused, or did not answer): a failure like
    /// any other, see [`ActorDirectory::failed`].
    pub fn start_failed(
        &mut self,
        now: u64,
        actor: ActorId,
        node: NodeId,
        reason: &str,
        table: &ResourceTable,
    ) -> Result<(), DirectoryError> {
        self.failed(now, actor, node, reason, HERE, table)
    }

    /// The first start of `actor` failed (its node refused it, did not answer, or was lost
    /// meanwhile) and its spawner gets that error instead of the actor: it fails for good
    /// whatever its restart policy, since nobody holds it yet and a kind that cannot start
    /// would only fail again. Releases what it holds; nothing for an ended actor.
    pub fn spawn_failed(&mut self, now: u64, actor: ActorId, reason: &str, table: &ResourceTable) {
        let Some(record) = self.actors.get_mut(&actor) else {
            return;
        };
        if record.state.is_ended() {
            return;
        }
        let node = record.release(table);
        record.stop = None;
        record.last_failure = Some(reason.to_string());
        record.last_origin = HERE;
        record.state = ActorState::Failed;
        self.log.push(
            now,
            record,
            node,
            ActorEventKind::Failed,
            reason.to_string(),
            HERE,
        );
        self.ended(actor);
    }

    /// `node` reports that the actor failed (its error, or its worker's exit), where that
    /// failure started (`origin`, kept in its events). Releases its resources, then
    /// restarts it after the backoff or marks it failed for good. An actor that was
    /// stopping is stopped. A report from a node the actor is not on now, or about an
    /// ended actor, is ignored; only an unknown actor is an error.
    pub fn failed(
        &mut self,
        now: u64,
        actor: ActorId,
        node: NodeId,
        reason: &str,
        origin: FailureOrigin,
        table: &ResourceTable,
    ) -> Result<(), DirectoryError> {
        let record = self.record(actor)?;
        if record.node != Some(node) {
            return Ok(());
        }
        if matches!(record.state, ActorState::Stopping { .. }) {
            self.finish_stop(now, actor, Some(reason), table);
        } else {
            self.fail(now, actor, reason.to_string(), origin, table);
        }
        Ok(())
    }

    /// `node` confirms the actor no longer runs there: after a `Stop`, or because it ended
    /// on its own. Releases its resources; the actor is stopped. Ignored like `failed`.
    pub fn stopped(
        &mut self,
        now: u64,
        actor: ActorId,
        node: NodeId,
        table: &ResourceTable,
    ) -> Result<(), DirectoryError> {
        let record = self.record(actor)?;
        if record.node != Some(node) {
            return Ok(());
        }
        if record.stop.is_none() {
            let reason = format!("ended on node {node}");
            record.stop = Some(StopOrder {
                reason,
                sent: true,
                kill_at_ms: None,
            });
        }
        self.finish_stop(now, actor, None, table);
        Ok(())
    }

    /// Membership ended `node`'s session (`why`: dead, left, replaced) and the table lost
    /// the reservations `lost` with it (those of the head's `NodeLost`): every actor that
    /// held one of them fails with the reason `node N lost: why`, in id order; actors that
    /// were stopping are stopped. Going by reservation rather than by node keeps actors
    /// that the node's next session took meanwhile (it keeps its id) out of it.
    pub fn node_lost(
        &mut self,
        now: u64,
        node: NodeId,
        why: &str,
        lost: impl IntoIterator<Item = ReservationId>,
        table: &ResourceTable,
    ) {
        let lost: HashSet<ReservationId> = lost.into_iter().collect();
        let reason = format!("node {node} lost: {why}");
        let holders: Vec<ActorId> = self
            .actors_on(node)
            .filter(|record| record.reservation.is_some_and(|id| lost.contains(&id)))
            .map(ActorRecord::id)
            .collect();
        for actor in holders {
            let stopping = self
                .actors
                .get(&actor)
                .is_some_and(|record| record.stop.is_some());
            if stopping {
                self.finish_stop(now, actor, Some(&reason), table);
            } else {
                self.fail(now, actor, reason.clone(), FailureOrigin::NodeLost, table);
            }
        }
    }

    /// Stops an actor for its `owner`: `kill` drops its queued messages, otherwise it
    /// finishes them (killed after `stop_grace_ms`). Returns the `Stop` to send now, if
    /// any; an actor waiting to restart stops at once. Stopping an ended actor does
    /// nothing; a kill upgrades a graceful stop.
    pub fn stop(
        &mut self,
        now: u64,
        owner: &str,
        actor: ActorId,
        kill: bool,
    ) -> Result<Option<ActorAction>, DirectoryError> {
        let owned_by = &self.record(actor)?.owner;
        if owned_by != owner && owned_by != DETACHED_OWNER {
            return Err(DirectoryError::NotOwner { actor });
        }
        let reason = if kill {
            "killed by its owner"
        } else {
            "stopped by its owner"
        };
        Ok(self.order_stop(now, actor, kill, reason))
    }

    /// `owner` is gone (its client disconnected): kills everything it owns.
    pub fn owner_gone(&mut self, now: u64, owner: &str) -> Vec<ActorAction> {
        let owned: Vec<ActorId> = self.actors_of(owner).map(ActorRecord::id).collect();
        owned
            .into_iter()
            .filter_map(|actor| self.order_stop(now, actor, true, "its owner is gone"))
            .collect()
    }

    /// Applies the passage of time up to `now`: places the restarts that are due (in
    /// deadline order, then id order) and kills graceful stops past their grace. Returns
    /// the actions to send. Idempotent at the same time.
    pub fn tick(&mut self, now: u64, table: &ResourceTable) -> Vec<ActorAction> {
        let mut due: Vec<(u64, ActorId)> = self
            .actors
            .values()
            .filter_map(|record| Some((record.deadline()?, record.id)))
            .filter(|(deadline, _)| *deadline <= now)
            .collect();
        due.sort_unstable();
        let mut actions = Vec::new();
        for (_, actor) in due {
            let Some(record) = self.actors.get_mut(&actor) else {
                continue;
            };
            match record.state {
                ActorState::Restarting { attempt, .. } => {
                    record.restarts = attempt;
                    match table.reserve(&record.resources, record.strategy, &holder(actor)) {
                        Ok(reservation) => {
                            record.state = ActorState::Starting;
                            record.node = Some(reservation.node);
                            record.reservation = Some(reservation.id);
                            record.gpus = reservation.gpus;
                            actions.push(record.start_action(reservation.node, reservation.id));
                        }
                        Err(error) => {
                            let reason = format!(
                                "restart {attempt} of {} could not be placed: {error}",
                                record.restart.max_restarts
                            );
                            self.fail(now, actor, reason, HERE, table);
                        }
                    }
                }
                ActorState::Stopping { .. } => {
                    let (Some(order), Some(node)) = (record.stop.as_mut(), record.node) else {
                        continue;
                    };
                    order.kill_at_ms = None;
                    record.state = ActorState::Stopping { kill: true };
                    actions.push(ActorAction::Stop {
                        actor,
                        node,
                        kill: true,
                    });
                }
                _ => {}
            }
        }
        actions
    }

    /// When `tick` next has something to do (a restart or a kill due), so the daemon
    /// sleeps exactly until then; `None` when nothing is pending. A time in the past means:
    /// tick now.
    pub fn next_deadline(&self) -> Option<u64> {
        self.actors.values().filter_map(ActorRecord::deadline).min()
    }

    /// Where the actor is and in which state; `None` for an unknown or forgotten actor.
    pub fn locate(&self, actor: ActorId) -> Option<ActorLocation> {
        self.actors.get(&actor).map(|record| ActorLocation {
            node: record.node,
            state: record.state,
        })
    }

    /// `owner`'s events with a seq above `after_seq` (0 for all kept), oldest first, and
    /// whether some of them were dropped. The daemon may send a prefix and let the owner
    /// ask again from the last seq it got.
    pub fn events_after(&self, owner: &str, after_seq: u64) -> EventPage {
        self.log.after(owner, after_seq)
    }

    /// Every kept event, oldest first (for logs and `status`).
    #[allow(dead_code)] // read by tests; `status` does not list events yet
    pub fn events(&self) -> impl Iterator<Item = &ActorEvent> {
        self.log.events.iter()
    }

    /// The seq of the latest event (0 before the first): a waiting `ActorEvents` request
    /// has news when this moved.
    pub fn last_seq(&self) -> u64 {
        self.log.next_seq - 1
    }

    pub fn get(&self, actor: ActorId) -> Option<&ActorRecord> {
        self.actors.get(&actor)
    }

    /// Every actor kept (live ones and the last ended ones), in id order, for `status`:
    /// which actor of which owner holds what, where.
    pub fn records(&self) -> impl Iterator<Item = &ActorRecord> {
        self.actors.values()
    }

    /// The actors starting, running or stopping on `node`, in id order.
    pub fn actors_on(&self, node: NodeId) -> impl Iterator<Item = &ActorRecord> {
        self.actors
            .values()
            .filter(move |record| record.node == Some(node))
    }

    /// `owner`'s actors that have not ended, in id order.
    pub fn actors_of<'a>(&'a self, owner: &'a str) -> impl Iterator<Item = &'a ActorRecord> {
        self.actors
            .values()
            .filter(move |record| record.owner == owner && !record.state.is_ended())
    }

    fn record(&mut self, actor: ActorId) -> Result<&mut ActorRecord, DirectoryError> {
        self.actors
            .get_mut(&actor)
            .ok_or(DirectoryError::UnknownActor { actor })
    }

    /// A failure of a live actor: releases it, then restarting or failed.
    fn fail(
        &mut self,
        now: u64,
        actor: ActorId,
        reason: String,
        origin: FailureOrigin,
        table: &ResourceTable,
    ) {
        let Some(record) = self.actors.get_mut(&actor) else {
            return;
        };
        let node = record.release(table);
        record.last_failure = Some(reason.clone());
        record.last_origin = origin;
        let max = record.restart.max_restarts;
        if record.restarts < max {
            let attempt = record.restarts + 1;
            let backoff = record.restart.backoff(attempt, self.config.max_backoff_ms);
            record.state = ActorState::Restarting {
                attempt,
                at_ms: now.saturating_add(backoff),
            };
            let reason = format!("{reason}; restart {attempt} of {max} in {backoff} ms");
            self.log.push(
                now,
                record,
                node,
                ActorEventKind::Restarting,
                reason,
                origin,
            );
            return;
        }
        record.state = ActorState::Failed;
        let reason = match max {
            0 => reason,
            _ => format!("{reason}; no restarts left ({max} used)"),
        };
        self.log
            .push(now, record, node, ActorEventKind::Failed, reason, origin);
        self.ended(actor);
    }

    /// Asks an actor to stop; the `Stop` to send now, if any.
    fn order_stop(
        &mut self,
        now: u64,
        actor: ActorId,
        kill: bool,
        reason: &str,
    ) -> Option<ActorAction> {
        let grace = self.config.stop_grace_ms;
        let record = self.actors.get_mut(&actor)?;
        match (record.state, record.node) {
            (ActorState::Restarting { .. }, _) => {
                record.state = ActorState::Stopped;
                let reason = format!("{reason} while waiting to restart");
                self.log
                    .push(now, record, None, ActorEventKind::Stopped, reason, HERE);
                self.ended(actor);
                None
            }
            (ActorState::Starting | ActorState::Running, Some(node)) => {
                // Not before the node answered the start; `started` sends it then.
                let sent = record.state == ActorState::Running;
                record.state = ActorState::Stopping { kill };
                record.stop = Some(StopOrder {
                    reason: reason.to_string(),
                    sent,
                    kill_at_ms: (sent && !kill).then(|| now.saturating_add(grace)),
                });
                sent.then_some(ActorAction::Stop { actor, node, kill })
            }
            (ActorState::Stopping { kill: false }, Some(node)) if kill => {
                let order = record.stop.as_mut()?;
                record.state = ActorState::Stopping { kill: true };
                order.reason = reason.to_string();
                order.kill_at_ms = None;
                order.sent.then_some(ActorAction::Stop {
                    actor,
                    node,
                    kill: true,
                })
            }
            _ => None,
        }
    }

    /// The end of a stop: releases the actor, which is stopped. `also` is what ended it
    /// when that was not the node's confirmation (a failure, the node's loss).
    fn finish_stop(&mut self, now: u64, actor: ActorId, also: Option<&str>, table: &ResourceTable) {
        let Some(record) = self.actors.get_mut(&actor) else {
            return;
        };
        let node = record.release(table);
        record.state = ActorState::Stopped;
        let order = record.stop.take();
        let mut reason = order.map_or_else(|| "stopped".to_string(), |order| order.reason);
        if let Some(also) = also {
            reason = format!("{reason}; {also}");
        }
        self.log
            .push(now, record, node, ActorEventKind::Stopped, reason, HERE);
        self.ended(actor);
    }

    /// Records that `actor` ended: drops its arguments, and forgets the oldest ended
    /// actors beyond `max_ended`.
    fn ended(&mut self, actor: ActorId) {
        if let Some(record) = self.actors.get_mut(&actor) {
            record.args = Vec::new();
        }
        self.ended.push_back(actor);
        while self.ended.len() > self.config.max_ended {
            if let Some(oldest) = self.ended.pop_front() {
                self.actors.remove(&oldest);
            }
        }
    }
}

impl ActorRecord {
    /// When `tick` has work for this actor: a restart, or a graceful stop to kill.
    fn deadline(&self) -> Option<u64> {
        match self.state {
            ActorState::Restarting { at_ms, .. } => Some(at_ms),
            ActorState::Stopping { .. } => self.stop.as_ref()?.kill_at_ms,
            _ => None,
        }
    }
}

/// The name of an actor's reservations in the resource table.
fn holder(actor: ActorId) -> String {
    format!("actor:{actor}")
}

/// The last events of the cluster, numbered by one sequence.
///
/// Seqs in `events` are consecutive, so the events after a seq are a suffix found by
/// arithmetic. When an event is dropped, its owner's entry in `dropped` remembers the
/// highest seq of theirs that went, which tells an owner asking from before it that its
/// page is incomplete. That map holds at most `max` owners; past that it is cleared and
/// `forgotten` keeps the highest seq it held, so that asking from before it reports
/// `missed` for every owner (which may be needless, never wrong).
#[derive(Debug)]
struct EventLog {
    events: VecDeque<ActorEvent>,
    max: usize,
    next_seq: u64,
    dropped: HashMap<String, u64>,
    forgotten: u64,
}

impl EventLog {
    fn new(max: usize) -> Self {
        EventLog {
            events: VecDeque::new(),
            max,
            next_seq: 1,
            dropped: HashMap::new(),
            forgotten: 0,
        }
    }

    fn push(
        &mut self,
        now: u64,
        record: &ActorRecord,
        node: Option<NodeId>,
        kind: ActorEventKind,
        reason: String,
        origin: FailureOrigin,
    ) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.events.push_back(ActorEvent {
            seq,
            at_ms: now,
            actor: record.id,
            owner: record.owner.clone(),
            node,
            kind,
            reason,
            origin,
        });
        while self.events.len() > self.max {
            let Some(old) = self.events.pop_front() else {
                break;
            };
            if !self.dropped.contains_key(&old.owner) && self.dropped.len() >= self.max {
                let highest = self.dropped.values().copied().max().unwrap_or(0);
                self.forgotten = self.forgotten.max(highest);
                self.dropped.clear();
            }
            self.dropped.insert(old.owner, old.seq);
        }
    }

    fn after(&self, owner: &str, after_seq: u64) -> EventPage {
        let first = self.events.front().map_or(self.next_seq, |event| event.seq);
        let skip = after_seq.saturating_add(1).saturating_sub(first);
        let events = self
            .events
            .iter()
            .skip(usize::try_from(skip).unwrap_or(usize::MAX))
            .filter(|event| event.owner == owner)
            .cloned()
            .collect();
        let dropped = self.dropped.get(owner).copied().unwrap_or(0);
        EventPage {
            events,
            missed: dropped > after_seq || self.forgotten > after_seq,
        }
    }
}

#[cfg(test)]
#[path = "directory_tests.rs"]
mod tests;
