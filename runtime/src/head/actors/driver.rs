//! The I/O side of the head's actor layer: sends the directory's starts and stops to the
//! nodes (over connections cached per node, or straight to the head's own actors), places
//! restarts when they are due, and turns lost nodes and ended actors into directory calls.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{broadcast, mpsc};
use tracing::{Instrument, debug, info, info_span, warn};

use super::HeadActors;
use crate::actor::{ActorAction, ActorExit, ActorId, ActorSpec};
use crate::daemon::{DaemonError, START_TIMEOUT, message_name};
use crate::head::{ClusterEvent, LossReason, Shared};
use crate::hosting::{outcome, start_reason};
use crate::membership::NodeId;
use crate::transport::{Connection, TransportError};
use crate::wire::Message;

/// How long a node may take to take a stop.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a stop is sent before the head relies on the kill deadline or the node's
/// loss instead.
const STOP_TRIES: u32 = 3;

impl HeadActors {
    /// Sends `action` to its node on a task of its own, and records the answer.
    pub(super) fn execute(self: &Arc<Self>, action: ActorAction) {
        let this = self.clone();
        let span = info_span!("actor", id = %action.actor(), node = %action.node());
        tokio::spawn(
            async move {
                let Some(head) = this.head.upgrade() else {
                    return;
                };
                match action {
                    ActorAction::Start { actor, node, .. } => {
                        match this.send_start(&head, action).await {
                            Ok(()) => {
                                info!("actor restarted");
                                let stop = this.with_directory(&head, |directory, now, _| {
                                    directory.started(now, actor, node)
                                });
                                if let Some(stop) = stop {
                                    this.execute(stop);
                                }
                            }
                            Err(reason) => {
                                warn!(%reason, "restart did not start");
                                // Unknown only if forgotten meanwhile: nothing to do then.
                                let _ = this.with_directory(&head, |directory, now, table| {
                                    directory.start_failed(now, actor, node, &reason, table)
                                });
                            }
                        }
                    }
                    ActorAction::Stop { actor, node, kill } => {
                        this.send_stop(&head, actor, node, kill).await;
                    }
                }
            }
            .instrument(span),
        );
    }

    /// Starts an actor on its node; `Err` says why it did not start.
    pub(super) async fn send_start(
        &self,
        head: &Shared,
        action: ActorAction,
    ) -> Result<(), String> {
        let ActorAction::Start {
            actor,
            node,
            gpus,
            kind,
            args,
            process_group,
            ..
        } = action
        else {
            return Err("not a start".to_owned());
        };
        if node == head.members.own_id() {
            let spec = ActorSpec {
                id: actor,
                kind,
                args,
                gpus,
            };
            return self
                .own
                .start(spec, &process_group)
                .await
                .map_err(|error| start_reason(&error));
        }
        let start = Message::ActorStart {
            actor_id: actor.0,
            kind,
            args,
            process_group,
            gpus,
        };
        match self.request(head, node, &start, START_TIMEOUT).await {
            Ok(Message::Ack) => Ok(()),
            Ok(Message::ActorError { message, .. } | Message::Error { message }) => Err(message),
            Ok(Message::Refused { reason }) => Err(reason),
            Ok(other) => Err(format!("unexpected {}", message_name(&other))),
            Err(error) => {
                if is_timeout(&error) {
                    // It may still start: make sure no copy the head gave up on holds GPUs.
                    let stop = Message::ActorStop {
                        actor_id: actor.0,
                        kill: true,
                    };
                    let _ = self.request(head, node, &stop, STOP_TIMEOUT).await;
                }
                Err(error.to_string())
            }
        }
    }

    /// Stops an actor on its node; its end comes as a report. When the node says the
    /// actor is not there (it ended already), that is the end.
    async fn send_stop(&self, head: &Shared, actor: ActorId, node: NodeId, kill: bool) {
        if node == head.members.own_id() {
            if let Err(error) = self.own.stop(actor, kill).await {
                debug!(%error, "stop of an actor that is not running");
                self.confirm_stopped(head, actor, node);
            }
            return;
        }
        let stop = Message::ActorStop {
            actor_id: actor.0,
            kill,
        };
        for attempt in 1..=STOP_TRIES {
            match self.request(head, node, &stop, STOP_TIMEOUT).await {
                Ok(Message::Ack) => return,
                Ok(Message::ActorError { message, .. }) => {
                    debug!(%message, "stop of an actor that is not running");
                    self.confirm_stopped(head, actor, node);
                    return;
                }
                Ok(other) => {
                    warn!(
                        answer = message_name(&other),
                        "the node did not take the stop"
                    );
                    return;
                }
                Err(error) => {
                    warn!(%error, attempt, "cannot send a stop to the node");
                    if head.members.live_node(node).is_none() {
                        return; // its loss ends the actor
                    }
                }
            }
        }
    }

    fn confirm_stopped(&self, head: &Shared, actor: ActorId, node: NodeId) {
        let _ = self.with_directory(head, |directory, now, table| {
            directory.stopped(now, actor, node, table)
        });
    }

    /// One request to `node`, on the cached connection (made again when it closed or the
    /// node's address changed).
    async fn request(
        &self,
        head: &Shared,
        node: NodeId,
        message: &Message,
        timeout: Duration,
    ) -> Result<Message, DaemonError> {
        let connection = self.link(head, node).await?;
        connection
            .request(message, timeout)
            .await
            .map_err(|source| {
                if connection.is_closed() {
                    self.forget_link(node);
                }
                DaemonError::Request {
                    peer: format!("node {node} ({})", connection.peer()),
                    source: Box::new(source),
                }
            })
    }

    async fn link(&self, head: &Shared, node: NodeId) -> Result<Connection, DaemonError> {
        let (_, address) = head
            .members
            .live_node(node)
            .ok_or(DaemonError::UnknownNode { node: node.0 })?;
        let cached = self
            .lock_links()
            .get(&node)
            .filter(|(at, connection)| *at == address && !connection.is_closed())
            .map(|(_, connection)| connection.clone());
        if let Some(connection) = cached {
            return Ok(connection);
        }
        let connection = head.connect(&address).await?;
        self.lock_links()
            .insert(node, (address, connection.clone()));
        Ok(connection)
    }

    fn forget_link(&self, node: NodeId) {
        if let Some((_, connection)) = self.lock_links().remove(&node) {
            connection.close();
        }
    }

    fn lock_links(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<NodeId, (String, Connection)>> {
        self.links
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Places restarts and kills overdue stops when the directory's next deadline comes.
pub(super) async fn run_ticker(this: Arc<HeadActors>) {
    loop {
        let woken = this.wake.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        let Some(head) = this.head.upgrade() else {
            return;
        };
        let (actions, deadline) = this.with_directory(&head, |directory, now, table| {
            (directory.tick(now, table), directory.next_deadline())
        });
        let until = deadline.map(|at| head.members.instant(at));
        drop(head);
        for action in actions {
            this.execute(action);
        }
        match until {
            Some(until) => {
                tokio::select! {
                    () = tokio::time::sleep_until(until.into()) => {}
                    () = &mut woken => {}
                }
            }
            None => woken.await,
        }
    }
}

/// Fails the actors of every node whose session ends, by the reservations it took along.
pub(super) async fn run_losses(
    this: Arc<HeadActors>,
    mut events: broadcast::Receiver<ClusterEvent>,
) {
    loop {
        let event = events.recv().await;
        let Some(head) = this.head.upgrade() else {
            return;
        };
        match event {
            Ok(ClusterEvent::NodeLost {
                node,
                reason,
                reservations,
                ..
            }) => {
                this.forget_link(node);
                let why = match reason {
                    LossReason::Dead => format!(
                        "no heartbeat for {} ms",
                        head.members.config().dead_after_ms
                    ),
                    LossReason::Left => "it left the cluster".to_owned(),
                    LossReason::Replaced => "it restarted and joined again".to_owned(),
                };
                this.with_directory(&head, |directory, now, table| {
                    directory.node_lost(now, node, &why, reservations.iter().map(|r| r.id), table);
                });
            }
            Ok(_) => {}
            Err(broadcast::error::RecvError::Lagged(missed)) => {
                warn!(
                    missed,
                    "missed node events; checking every actor's reservation"
                );
                this.with_directory(&head, |directory, now, table| {
                    let gone: Vec<(NodeId, _)> = directory
                        .records()
                        .filter_map(|record| Some((record.node()?, record.reservation()?)))
                        .filter(|(_, reservation)| table.reservation(*reservation).is_none())
                        .collect();
                    for (node, reservation) in gone {
                        directory.node_lost(now, node, "lost", [reservation], table);
                    }
                });
            }
            Err(broadcast::error::RecvError::Closed) => return,
        }
    }
}

/// Records the ends of the head's own actors.
pub(super) async fn run_own_exits(
    this: Arc<HeadActors>,
    mut exits: mpsc::UnboundedReceiver<ActorExit>,
) {
    while let Some(exit) = exits.recv().await {
        this.own.ended(exit.actor_id);
        this.own.reported(exit.actor_id);
        let Some(head) = this.head.upgrade() else {
            return;
        };
        let (outcome, reason, origin) = outcome(&exit.reason);
        let node = head.members.own_id();
        this.ended(&head, exit.actor_id, node, outcome, &reason, origin);
    }
}

fn is_timeout(error: &DaemonError) -> bool {
    matches!(
        error,
        DaemonError::Request { source, .. } if matches!(**source, TransportError::Timeout { .. })
    )
}
