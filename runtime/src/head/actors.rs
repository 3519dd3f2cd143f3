//! The head's actor layer: the cluster's [`ActorDirectory`] behind a mutex, driven by the
//! requests of clients and the reports of nodes, and the head's own actors (the head is a
//! node too).
//!
//! | request                    | from                 | answer                         |
//! |----------------------------|----------------------|--------------------------------|
//! | `ActorSpawn`               | any member           | `ActorSpawned` once started    |
//! | `ActorLocate`              | any member           | `ActorLocation`                |
//! | `ActorStop`                | the actor's owner    | `Ack` (the end is an event)    |
//! | `ActorEvents`              | any member (its own) | `ActorEventList`, long-polled  |
//! | `ActorEnded`               | the node reporting   | `Ack`                          |
//! | `ActorCall`, `ActorTell`   | any member           | the head's own actors answer   |
//!
//! The owner of an actor is the connection that spawned it, named by the peer's
//! certificate name and address (`client@10.0.0.5:41234`): only it stops the actor and
//! reads its events, and when that connection ends its actors are killed. The directory
//! is pure; `driver.rs` sends what it decides to the nodes, places restarts when they are
//! due, and turns lost nodes into failures.

mod driver;
mod parse;

use parse::{parse_label, spawn_request};

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use tokio::sync::{Notify, mpsc, watch};
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tracing::{Instrument, info, info_span, warn};

use super::Shared;
use crate::actor::{
    ActorDirectory, ActorExit, ActorId, DETACHED_OWNER, DirectoryConfig, DirectoryError,
    FailureOrigin, RestartPolicy, SpawnRequest,
};
use crate::daemon::{ActorHandler, ActorReply, MAX_EVENT_WAIT, NODE_PREFIX, message_name, refused};
use crate::hosting::NodeActors;
use crate::membership::NodeId;
use crate::placement::ResourceTable;
use crate::status::ActorStatus;
use crate::transport::{Connection, Peer};
use crate::wire::{ActorEventWire, Message};

/// The most events one `ActorEventList` carries; the owner asks again for the rest.
const MAX_EVENTS_PER_REPLY: usize = 1000;

/// The head's actor layer. Its tasks hold it; the head holds its handler.
pub(super) struct HeadActors {
    head: Weak<Shared>,
    /// The actors the head hosts itself.
    own: Arc<NodeActors>,
    table: Arc<ResourceTable>,
    directory: Mutex<ActorDirectory>,
    /// The seq of the latest event: owners waiting for theirs watch it.
    last_seq: watch::Sender<u64>,
    /// Wakes the ticker when the directory's next deadline moved.
    wake: Notify,
    /// Connections to nodes, with the address each was made to.
    links: Mutex<HashMap<NodeId, (String, Connection)>>,
}

/// What the head answers actor requests with.
struct ActorRequests(Arc<HeadActors>);

impl ActorHandler for ActorRequests {
    fn handle(&self, peer: Peer, request: Message) -> ActorReply {
        Box::pin(self.0.clone().serve(peer, request))
    }

    fn disconnected(&self, peer: &Peer) {
        self.0.owner_gone(&owner_of(peer));
    }

    fn actors(&self) -> Vec<ActorStatus> {
        self.0
            .lock()
            .records()
            .filter(|record| !record.state().is_ended())
            .map(|record| ActorStatus {
                id: record.id(),
                kind: record.kind().to_owned(),
                node: record.node(),
                state: record.state().name().to_owned(),
                label: record.label().cloned(),
            })
            .collect()
    }
}

impl HeadActors {
    /// Sets up the head's actor layer on `shared`: hosts the head's own actors (`own`,
    /// whose ends arrive on `exits`), answers actor requests, and starts the tasks that
    /// follow lost nodes and due restarts. Returns those tasks, for the head to abort.
    pub(super) fn start(
        shared: &Arc<Shared>,
        own: Arc<NodeActors>,
        exits: mpsc::UnboundedReceiver<ActorExit>,
    ) -> Vec<AbortHandle> {
        let this = Arc::new(HeadActors {
            head: Arc::downgrade(shared),
            own,
            table: shared.members.table(),
            directory: Mutex::new(ActorDirectory::new(DirectoryConfig::default())),
            last_seq: watch::Sender::new(0),
            wake: Notify::new(),
            links: Mutex::default(),
        });
        // Subscribed before the handler is set: no loss is missed.
        let losses = shared.members.subscribe();
        shared
            .life
            .set_actor_handler(Arc::new(ActorRequests(this.clone())));
        let span = info_span!("actors");
        [
            tokio::spawn(driver::run_ticker(this.clone()).instrument(span.clone())),
            tokio::spawn(driver::run_losses(this.clone(), losses).instrument(span.clone())),
            tokio::spawn(driver::run_own_exits(this, exits).instrument(span)),
        ]
        .iter()
        .map(tokio::task::JoinHandle::abort_handle)
        .collect()
    }

    /// Answers one actor request from `peer`.
    async fn serve(self: Arc<Self>, peer: Peer, request: Message) -> Message {
        let Some(head) = self.head.upgrade() else {
            return refused("the head is stopping");
        };
        match request {
            Message::ActorSpawn {
                kind,
                args,
                resources,
                placement,
                process_group,
                max_restarts,
                restart_backoff_ms,
                label,
                detached,
            } => {
                let label = match label.map(|l| parse_label(l.job, l.rank)).transpose() {
                    Ok(label) => label,
                    Err(message) => return Message::Error { message },
                };
                let mut request = match spawn_request(
                    kind,
                    args,
                    &resources,
                    &placement,
                    process_group,
                    RestartPolicy {
                        max_restarts,
                        backoff_ms: u64::from(restart_backoff_ms),
                    },
                ) {
                    Ok(request) => request,
                    Err(message) => return Message::Error { message },
                };
                request.label = label;
                let owner = if detached {
                    DETACHED_OWNER.to_owned()
                } else {
                    owner_of(&peer)
                };
                let span = info_span!("spawn", %owner, kind = %request.kind);
                self.spawn(&head, owner, request).instrument(span).await
            }
            Message::ActorLocate { actor_id } => self.locate(&head, ActorId(actor_id)),
            Message::ActorStop { actor_id, kill } => {
                let owner = owner_of(&peer);
                let stopped = self.with_directory(&head, |directory, now, _| {
                    directory.stop(now, &owner, ActorId(actor_id), kill)
                });
                match stopped {
                    Ok(action) => {
                        info!(actor = actor_id, kill, %owner, "actor stop asked");
                        if let Some(action) = action {
                            self.execute(action);
                        }
                        Message::Ack
                    }
                    Err(error @ DirectoryError::NotOwner { .. }) => refused(error.to_string()),
                    Err(error) => unknown(actor_id, &error),
                }
            }
            Message::ActorEvents { after_seq, wait_ms } => {
                let wait = Duration::from_millis(u64::from(wait_ms)).min(MAX_EVENT_WAIT);
                self.events(&owner_of(&peer), after_seq, wait).await
            }
            Message::ActorEnded {
                actor_id,
                node_id,
                outcome,
                reason,
                origin,
            } => {
                let node = NodeId(node_id);
                let name = peer.name().unwrap_or_default();
                if !name.starts_with(NODE_PREFIX) || !head.members.owns(name, node) {
                    warn!(peer = %peer.address, name, node = node_id, "refused a report for another node");
                    return refused(format!("only node {node} reports its actors"));
                }
                let origin = FailureOrigin::from_wire(origin);
                self.ended(&head, ActorId(actor_id), node, &outcome, &reason, origin);
                Message::Ack
            }
            request @ (Message::ActorCall { .. }
            | Message::ActorTell { .. }
            | Message::ActorOutput { .. }) => {
                let name = message_name(&request);
                let answer = self.own.serve(&peer, request, false).await;
                answer
                    .unwrap_or_else(|| refused(format!("the head does not serve {name} requests")))
            }
            other => refused(format!(
                "the head does not serve a {}",
                message_name(&other)
            )),
        }
    }

    /// Places an actor, starts it on its node, and answers once it runs (or why not).
    async fn spawn(
        self: &Arc<Self>,
        head: &Arc<Shared>,
        owner: String,
        request: SpawnRequest,
    ) -> Message {
        let kind = request.kind.clone();
        let placed = self.with_directory(head, |directory, now, table| {
            directory.spawn(now, &owner, request, table)
        });
        let (actor, action) = match placed {
            Ok(placed) => placed,
            Err(error) => {
                info!(%error, "spawn refused");
                return Message::Error {
                    message: format!("cannot place an actor of kind '{kind}': {error}"),
                };
            }
        };
        let node = action.node();
        match self.send_start(head, action).await {
            Ok(()) => {
                let stop = self.with_directory(head, |directory, now, _| {
                    directory.started(now, actor, node)
                });
                if let Some(stop) = stop {
                    self.execute(stop);
                }
                info!(%actor, %node, "actor spawned");
                Message::ActorSpawned {
                    actor_id: actor.0,
                    node_id: node.0,
                    address: address_of(head, node),
                }
            }
            Err(reason) => {
                warn!(%actor, %node, %reason, "actor did not start");
                self.with_directory(head, |directory, now, table| {
                    directory.spawn_failed(now, actor, &reason, table);
                });
                Message::Error {
                    message: format!(
                        "actor {actor} ({kind}) did not start on node {node}: {reason}"
                    ),
                }
            }
        }
    }

    fn locate(&self, head: &Shared, actor: ActorId) -> Message {
        let found = {
            let directory = self.lock();
            directory.locate(actor).map(|location| {
                let record = directory.get(actor);
                let reason = record
                    .and_then(|record| record.last_failure())
                    .unwrap_or_default()
                    .to_owned();
                let origin = record
                    .map(|record| record.last_origin())
                    .unwrap_or_default();
                (location, reason, origin)
            })
        };
        match found {
            Some((location, reason, origin)) => Message::ActorLocation {
                actor_id: actor.0,
                node_id: location.node.map_or(0, |node| node.0),
                address: location
                    .node
                    .map(|node| address_of(head, node))
                    .unwrap_or_default(),
                state: location.state.name().to_owned(),
                reason,
                origin: origin.to_wire(),
            },
            None => unknown(actor.0, &DirectoryError::UnknownActor { actor }),
        }
    }

    /// `owner`'s events after `after_seq`: at once if there are some, else the first ones
    /// within `wait` (an empty list when none came).
    async fn events(&self, owner: &str, after_seq: u64, wait: Duration) -> Message {
        let deadline = Instant::now() + wait;
        let mut seq = self.last_seq.subscribe();
        loop {
            seq.borrow_and_update();
            let mut page = self.lock().events_after(owner, after_seq);
            let waited = Instant::now() >= deadline;
            if !page.events.is_empty() || page.missed || waited {
                page.events.truncate(MAX_EVENTS_PER_REPLY);
                let events = page
                    .events
                    .into_iter()
                    .map(|event| ActorEventWire {
                        seq: event.seq,
                        actor_id: event.actor.0,
                        node_id: event.node.map_or(0, |node| node.0),
                        kind: event.kind.name().to_owned(),
                        reason: event.reason,
                        origin: event.origin.to_wire(),
                    })
                    .collect();
                return Message::ActorEventList {
                    events,
                    missed: page.missed,
                };
            }
            // A closed channel cannot happen (`self` holds the sender); treat it as time up.
            let _ = tokio::time::timeout_at(deadline, seq.changed()).await;
        }
    }

    /// A node (or the head itself) says an actor ended there.
    fn ended(
        &self,
        head: &Shared,
        actor: ActorId,
        node: NodeId,
        outcome: &str,
        reason: &str,
        origin: FailureOrigin,
    ) {
        info!(%actor, %node, outcome, reason, ?origin, "actor ended");
        let recorded = self.with_directory(head, |directory, now, table| match outcome {
            "failed" => directory.failed(now, actor, node, reason, origin, table),
            _ => directory.stopped(now, actor, node, table),
        });
        if let Err(error) = recorded {
            // A report about an actor the directory forgot: nothing to do.
            warn!(%actor, %node, %error, "report about an unknown actor");
        }
    }

    /// The connection of `owner` ended: its actors are killed.
    fn owner_gone(self: &Arc<Self>, owner: &str) {
        let Some(head) = self.head.upgrade() else {
            return;
        };
        let actions =
            self.with_directory(&head, |directory, now, _| directory.owner_gone(now, owner));
        if !actions.is_empty() {
            info!(
                owner,
                actors = actions.len(),
                "owner gone; killing its actors"
            );
        }
        for action in actions {
            self.execute(action);
        }
    }

    /// Runs `change` on the directory at the head's time, then wakes the owners waiting for
    /// events and the ticker when the next deadline moved. Never held across an await.
    fn with_directory<R>(
        &self,
        head: &Shared,
        change: impl FnOnce(&mut ActorDirectory, u64, &ResourceTable) -> R,
    ) -> R {
        let now = head.members.now_ms();
        let mut directory = self.lock();
        let before = directory.next_deadline();
        let result = change(&mut directory, now, &self.table);
        let moved = directory.next_deadline() != before;
        let seq = directory.last_seq();
        drop(directory);
        self.last_seq.send_if_modified(|last| {
            let news = *last != seq;
            *last = seq;
            news
        });
        if moved {
            self.wake.notify_one();
        }
        result
    }

    fn lock(&self) -> MutexGuard<'_, ActorDirectory> {
        // The directory changes only through its methods, none of which panics on input.
        self.directory
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// The owner name of the actors `peer` spawns: its certificate name and address.
fn owner_of(peer: &Peer) -> String {
    format!("{}@{}", peer.name().unwrap_or("?"), peer.address)
}

/// Where `node` accepts calls, or nothing once its session ended.
fn address_of(head: &Shared, node: NodeId) -> String {
    head.members
        .live_node(node)
        .map(|(_, address)| address)
        .unwrap_or_default()
}

/// The answer about an actor the directory does not know (or forgot).
fn unknown(actor_id: u64, error: &DirectoryError) -> Message {
    Message::ActorError {
        actor_id,
        cause: "unknown".to_owned(),
        message: error.to_string(),
        delivered: false,
        origin: crate::wire::ORIGIN_HERE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_are_named_by_certificate_and_address() {
        let peer = Peer {
            address: "10.0.0.5:41234".parse().expect("address"),
            identity: crate::transport::PeerIdentity::Authenticated {
                name: "client".into(),
            },
        };
        assert_eq!(owner_of(&peer), "client@10.0.0.5:41234");
    }
}
