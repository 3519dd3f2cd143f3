//! Spawning from the client's side: [`SpawnOptions`], [`ClusterClient::spawn`],
//! [`ClusterClient::actor`] for a handle on an actor spawned elsewhere, and
//! [`ClusterClient::events`], what happened to the actors this client owns.

use std::time::Duration;

use super::actors::{ActorRef, HEAD_TIMEOUT, Located};
use super::{ActorCallError, ClusterClient};
use crate::actor::{ActorEventKind, ActorId, ActorLabel, FailureOrigin, RestartPolicy};
use crate::daemon::DaemonError;
use crate::daemon::{MAX_EVENT_WAIT, START_TIMEOUT, placement_text};
use crate::membership::NodeId;
use crate::placement::{Resources, Strategy};
use crate::wire::{ActorLabelWire, Message};

/// What to spawn, where, and how to bring it back after a failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpawnOptions {
    /// The registered kind (see [`crate::ActorRegistry`]).
    pub kind: String,
    /// The constructor's arguments, encoded by the caller.
    pub args: Vec<u8>,
    /// What the actor reserves on its node (e.g. `Resources::new().with_gpus(1)`).
    pub resources: Resources,
    pub strategy: Strategy,
    /// The worker process it runs in; empty: inside the node daemon (no native code).
    pub process_group: String,
    /// Restarts after failures; `None`: never.
    pub restart: Option<RestartPolicy>,
    /// The job and rank it works for, shown by `imgrun status`.
    pub label: Option<ActorLabel>,
    /// Owned by no connection (see [`SpawnOptions::detached`]).
    pub detached: bool,
}

impl SpawnOptions {
    /// An actor of `kind` with no arguments, no resources, spread, in the daemon, never
    /// restarted.
    pub fn new(kind: impl Into<String>) -> Self {
        SpawnOptions {
            kind: kind.into(),
            args: Vec::new(),
            resources: Resources::new(),
            strategy: Strategy::Spread,
            process_group: String::new(),
            restart: None,
            label: None,
            detached: false,
        }
    }

    /// The actor outlives the client that spawns it: it is owned by no connection, so
    /// it is not killed when that client disconnects, and any client of the cluster may
    /// stop it. Its events are nobody's to read; callers ask the actor itself. For work
    /// that must survive its submitter, such as a detached training job.
    pub fn detached(mut self) -> Self {
        self.detached = true;
        self
    }

    pub fn args(mut self, args: impl Into<Vec<u8>>) -> Self {
        self.args = args.into();
        self
    }

    pub fn resources(mut self, resources: Resources) -> Self {
        self.resources = resources;
        self
    }

    pub fn strategy(mut self, strategy: Strategy) -> Self {
        self.strategy = strategy;
        self
    }

    pub fn process_group(mut self, group: impl Into<String>) -> Self {
        self.process_group = group.into();
        self
    }

    /// Labels the actor with its job and rank (shown by `imgrun status`).
    pub fn label(mut self, label: ActorLabel) -> Self {
        self.label = Some(label);
        self
    }

    /// At most `max_restarts` restarts, the first after `backoff`, doubling.
    pub fn restart(mut self, max_restarts: u32, backoff: Duration) -> Self {
        self.restart = Some(RestartPolicy {
            max_restarts,
            backoff_ms: u64::try_from(backoff.as_millis()).unwrap_or(u64::MAX),
        });
        self
    }
}

/// Something that happened to an actor this client owns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActorEvent {
    /// Increases by one per event of the whole cluster; ask for those after it next.
    pub seq: u64,
    pub actor: ActorId,
    /// The node concerned, if any (none for a restart that found no room).
    pub node: Option<NodeId>,
    pub kind: ActorEventKind,
    /// Why, for a person to read ("panicked in step: ...; restart 1 of 3 in 500 ms").
    pub reason: String,
    /// For a failure (`Failed`, `Restarting`): whether it started in this actor or
    /// follows from another actor's; `Here` for other events.
    pub origin: FailureOrigin,
}

/// The answer to [`ClusterClient::events`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ActorEvents {
    /// Oldest first; at most 1,000 (ask again after the last seq for more).
    pub events: Vec<ActorEvent>,
    /// Some events after the asked seq were dropped by the head (it keeps the last
    /// 10,000): locate the actors rather than trust the list to be complete.
    pub missed: bool,
}

impl ClusterClient {
    /// Asks the head to place an actor by its options' strategy, reserve its resources and
    /// start it; returns once its constructor has finished on its node. A request that
    /// cannot be placed is refused with the reason and reserves nothing.
    pub async fn spawn(&self, options: SpawnOptions) -> Result<ActorRef, ActorCallError> {
        let restart = options.restart.unwrap_or_default();
        let request = Message::ActorSpawn {
            kind: options.kind.clone(),
            args: options.args,
            resources: options
                .resources
                .iter()
                .map(|(name, amount)| (name.to_owned(), amount))
                .collect(),
            placement: placement_text(options.strategy),
            process_group: options.process_group,
            max_restarts: restart.max_restarts,
            restart_backoff_ms: u32::try_from(restart.backoff_ms).unwrap_or(u32::MAX),
            label: options.label.map(|label| ActorLabelWire {
                job: label.job,
                rank: label.rank,
            }),
            detached: options.detached,
        };
        let refused = |reason| ActorCallError::Spawn {
            kind: options.kind.clone(),
            reason,
        };
        match self
            .inner
            .request_head(&request, START_TIMEOUT + HEAD_TIMEOUT)
            .await?
        {
            Message::ActorSpawned {
                actor_id,
                node_id,
                address,
            } => Ok(ActorRef::new(
                ActorId(actor_id),
                NodeId(node_id),
                address,
                self.inner.clone(),
            )),
            Message::Error { message } => Err(refused(message)),
            Message::Refused { reason } => Err(refused(reason)),
            other => Err(self.inner.unexpected(other).into()),
        }
    }

    /// A handle on the actor `id` (spawned by anyone), where the head says it runs.
    pub async fn actor(&self, id: ActorId) -> Result<ActorRef, ActorCallError> {
        let actor = ActorRef::new(id, NodeId(0), String::new(), self.inner.clone());
        match actor.relocate().await? {
            Located::Running(_) => Ok(actor),
            Located::Not(not) => Err(actor.not_running(not)),
        }
    }

    /// The events of the actors this client owns with a seq above `after_seq` (0: all
    /// kept): at once when there are some, otherwise the first within `wait` (at most 60
    /// s), or none.
    pub async fn events(
        &self,
        after_seq: u64,
        wait: Duration,
    ) -> Result<ActorEvents, ActorCallError> {
        let wait = wait.min(MAX_EVENT_WAIT);
        let request = Message::ActorEvents {
            after_seq,
            wait_ms: u32::try_from(wait.as_millis()).unwrap_or(u32::MAX),
        };
        match self
            .inner
            .request_head(&request, wait + HEAD_TIMEOUT)
            .await?
        {
            Message::ActorEventList { events, missed } => {
                let events = events
                    .into_iter()
                    .map(|event| {
                        let kind = ActorEventKind::from_name(&event.kind).ok_or_else(|| {
                            DaemonError::UnexpectedReply {
                                peer: self.inner.head.clone(),
                                what: format!("event kind '{}'", event.kind),
                            }
                        })?;
                        let actor = ActorId(event.actor_id);
                        if kind != ActorEventKind::Stopped {
                            self.inner.mark_moved(actor);
                        }
                        Ok(ActorEvent {
                            seq: event.seq,
                            actor,
                            node: (event.node_id != 0).then_some(NodeId(event.node_id)),
                            kind,
                            reason: event.reason,
                            origin: FailureOrigin::from_wire(event.origin),
                        })
                    })
                    .collect::<Result<_, DaemonError>>()?;
                Ok(ActorEvents { events, missed })
            }
            other => Err(self.inner.unexpected(other).into()),
        }
    }
}
