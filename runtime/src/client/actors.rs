//! [`ActorRef`]: a handle on an actor anywhere in the cluster, through which calls and
//! tells go straight to the actor's node over mutual TLS, and stops go to the head.
//!
//! A handle follows its actor: when the node says the actor is not there (it failed, was
//! restarted elsewhere, or the node forgot it), or the node cannot be reached, the handle
//! asks the head where the actor runs now, once, and sends again only if the first
//! message certainly did not reach it (delivery stays at most once: a call whose
//! connection broke after it was sent is not repeated). When the client's events said
//! the actor failed or restarted, its handles ask the head before their next message.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;
use tracing::debug;

use super::{ActorCallError, ClientInner, NodeLink};
use crate::actor::{ActorId, FailureOrigin};
use crate::daemon::message_name;
use crate::membership::NodeId;
use crate::transport::TransportError;
use crate::wire::Message;

/// How long asking for an actor's output may take.
const OUTPUT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a tell may wait for room in a full mailbox.
const TELL_TIMEOUT: Duration = Duration::from_secs(60);
/// How long requests to the head about actors (locate, stop) may take.
pub(super) const HEAD_TIMEOUT: Duration = Duration::from_secs(15);
/// Time allowed beyond a call's own timeout for the node's answer to travel, and for the
/// head to say where the actor went: a quarter of the timeout, within these bounds.
const ANSWER_MARGIN: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(2));

/// How long past its `timeout` a call may wait for an answer (see [`ANSWER_MARGIN`]).
fn answer_margin(timeout: Duration) -> Duration {
    (timeout / 4).clamp(ANSWER_MARGIN.0, ANSWER_MARGIN.1)
}

/// A handle on an actor anywhere in the cluster. Cheap to clone; clones share where the
/// actor was last seen, and may be used from many tasks at once. It keeps the client's
/// connection to the head open: the actors a client owns are killed when that connection
/// ends, so keep the client or a handle while they should run.
#[derive(Clone)]
pub struct ActorRef {
    id: ActorId,
    place: Arc<Mutex<Place>>,
    client: Arc<ClientInner>,
}

/// Where an actor was last seen running.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Place {
    node: NodeId,
    address: String,
}

/// Where the head says an actor is.
pub(super) enum Located {
    Running(Place),
    Not(NotRunning),
}

/// The newest lines of an actor's worker process ([`ActorRef::output`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActorOutput {
    /// Oldest first.
    pub lines: Vec<String>,
    /// False for an actor its node daemon runs itself: it has no output of its own (it
    /// is in the daemon's log), and `lines` is empty.
    pub own_process: bool,
}

/// An actor the head says is not running: its state, why it last failed and where that
/// failure started, and its node if it has one.
pub(super) struct NotRunning {
    state: String,
    reason: String,
    origin: FailureOrigin,
    node: Option<NodeId>,
}

/// What one attempt at a message to the actor's node came to.
enum Attempt<T> {
    Done(Result<T, ActorCallError>),
    /// The actor is not there, or the node could not be reached; `resend`: the message
    /// certainly did not reach the actor.
    Relocate {
        error: ActorCallError,
        resend: bool,
    },
}

impl ActorRef {
    pub(super) fn new(
        id: ActorId,
        node: NodeId,
        address: String,
        client: Arc<ClientInner>,
    ) -> Self {
        ActorRef {
            id,
            place: Arc::new(Mutex::new(Place { node, address })),
            client,
        }
    }

    pub fn id(&self) -> ActorId {
        self.id
    }

    /// The node the actor was last seen on.
    pub fn node(&self) -> NodeId {
        self.place().node
    }

    /// Where that node accepts calls (`ip:port`).
    pub fn address(&self) -> String {
        self.place().address
    }

    /// Calls `method` and waits at most `timeout` for its result. On a timeout or a lost
    /// connection the method may or may not have run (see docs/runtime-semantics.md).
    pub async fn call(
        &self,
        method: &str,
        payload: impl Into<Vec<u8>>,
        timeout: Duration,
    ) -> Result<Vec<u8>, ActorCallError> {
        let request = Message::ActorCall {
            actor_id: self.id.0,
            call_id: self.client.next_call.fetch_add(1, Ordering::Relaxed),
            method: method.to_owned(),
            payload: payload.into(),
            timeout_ms: u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX),
        };
        self.deliver(&request, method, timeout, |answer| match answer {
            Message::ActorReply { result, .. } => Ok(result),
            other => Err(Box::new(other)),
        })
        .await
    }

    /// Sends `method` without waiting for it to run: returns once it is in the actor's
    /// mailbox (waiting while that is full, at most a minute). Its result is dropped.
    pub async fn tell(
        &self,
        method: &str,
        payload: impl Into<Vec<u8>>,
    ) -> Result<(), ActorCallError> {
        let request = Message::ActorTell {
            actor_id: self.id.0,
            method: method.to_owned(),
            payload: payload.into(),
        };
        self.deliver(&request, method, TELL_TIMEOUT, |answer| match answer {
            Message::Ack => Ok(Ok(())),
            other => Err(Box::new(other)),
        })
        .await
    }

    /// The newest `lines` lines (at most 1,000) its worker process wrote to its standard
    /// output and error: its own log and its libraries' messages, oldest first. Its node
    /// answers, whatever the actor is busy with.
    pub async fn output(&self, lines: u32) -> Result<ActorOutput, ActorCallError> {
        let request = Message::ActorOutput {
            actor_id: self.id.0,
            lines,
        };
        self.deliver(&request, "output", OUTPUT_TIMEOUT, |answer| match answer {
            Message::ActorOutputLines {
                lines, own_process, ..
            } => Ok(Ok(ActorOutput { lines, own_process })),
            other => Err(Box::new(other)),
        })
        .await
    }

    /// Stops the actor gracefully: what is queued runs, then it ends (a `stopped` event).
    /// Only its owner may.
    pub async fn stop(&self) -> Result<(), ActorCallError> {
        self.end(false).await
    }

    /// Kills the actor: queued messages are dropped. Only its owner may.
    pub async fn kill(&self) -> Result<(), ActorCallError> {
        self.end(true).await
    }

    /// Asks the head where the actor runs now, and follows it there.
    pub async fn locate(&self) -> Result<(), ActorCallError> {
        match self.relocate().await? {
            Located::Running(_) => Ok(()),
            Located::Not(not) => Err(self.not_running(not)),
        }
    }

    async fn end(&self, kill: bool) -> Result<(), ActorCallError> {
        let request = Message::ActorStop {
            actor_id: self.id.0,
            kill,
        };
        match self.client.request_head(&request, HEAD_TIMEOUT).await? {
            Message::Ack => Ok(()),
            Message::ActorError { .. } => Err(ActorCallError::Unknown { actor: self.id }),
            other => Err(self.client.unexpected(other).into()),
        }
    }

    /// Sends `request` to the actor's node, following the actor once if it is not there.
    /// `answered` takes the answers meant for this request (a method's error as `Err`)
    /// and gives the others back.
    async fn deliver<T>(
        &self,
        request: &Message,
        method: &str,
        timeout: Duration,
        answered: impl Fn(Message) -> Result<Result<T, String>, Box<Message>>,
    ) -> Result<T, ActorCallError> {
        // A timeout beyond what a clock can hold waits for a year, which is forever here.
        let far = || Instant::now() + Duration::from_secs(365 * 24 * 3600);
        let deadline = Instant::now().checked_add(timeout).unwrap_or_else(far);
        // Everything, following the actor included, ends by then.
        let end = deadline
            .checked_add(answer_margin(timeout))
            .unwrap_or_else(far);
        let left = || end.saturating_duration_since(Instant::now());
        if self.client.take_moved(self.id) {
            // An event said the actor failed or restarted: its node may be gone, and a
            // message sent there would wait for the connection to time out.
            if let Located::Not(not) = self.relocate_within(left()).await? {
                return Err(self.not_running(not));
            }
        }
        let first = Try {
            place: self.place(),
            method,
            timeout,
            deadline,
            end,
            fresh: false,
        };
        let (error, resend) = match self.attempt(&first, request, &answered).await {
            Attempt::Done(result) => return result,
            Attempt::Relocate { error, resend } => (error, resend),
        };
        if left().is_zero() {
            // No time left to ask the head where the actor went.
            return Err(error);
        }
        debug!(actor = %self.id, %error, resend, "following the actor");
        match self.relocate_within(left()).await {
            Ok(Located::Running(place)) if resend => {
                let again = Try {
                    place,
                    fresh: true,
                    ..first
                };
                match self.attempt(&again, request, &answered).await {
                    Attempt::Done(result) => result,
                    Attempt::Relocate { error, .. } => Err(error),
                }
            }
            Ok(Located::Running(_)) | Err(_) => Err(error),
            Ok(Located::Not(not)) => Err(self.not_running(not)),
        }
    }

    /// One try at the place in `at`.
    async fn attempt<T>(
        &self,
        at: &Try<'_>,
        request: &Message,
        answered: &impl Fn(Message) -> Result<Result<T, String>, Box<Message>>,
    ) -> Attempt<T> {
        let (actor, node) = (self.id, at.place.node);
        let address = || at.place.address.clone();
        let left = at.deadline.saturating_duration_since(Instant::now());
        let connection = match self.client.node(&at.place.address, left, at.fresh).await {
            Ok(connection) => connection,
            Err(NodeLink::Closed) => {
                let error = ActorCallError::NodeGone {
                    actor,
                    node,
                    address: address(),
                };
                return Attempt::Relocate {
                    error,
                    resend: true,
                };
            }
            Err(NodeLink::Failed(reason)) => {
                let error = ActorCallError::Unreachable {
                    actor,
                    node,
                    address: address(),
                    reason,
                    sent: false,
                };
                return Attempt::Relocate {
                    error,
                    resend: true,
                };
            }
        };
        let wait = at.end.saturating_duration_since(Instant::now());
        let timed_out = || ActorCallError::Timeout {
            actor,
            node,
            method: at.method.to_owned(),
            after: at.timeout,
        };
        let answer = match connection.request(request, wait).await {
            Ok(answer) => answer,
            // Not even the node's own timeout came back: is the node still there?
            Err(TransportError::Timeout { .. }) => {
                return Attempt::Relocate {
                    error: timed_out(),
                    resend: false,
                };
            }
            Err(source) => {
                let error = ActorCallError::Unreachable {
                    actor,
                    node,
                    address: address(),
                    reason: source.to_string(),
                    sent: true,
                };
                return Attempt::Relocate {
                    error,
                    resend: false,
                };
            }
        };
        let other = match answered(answer) {
            Ok(result) => {
                return Attempt::Done(result.map_err(|message| ActorCallError::Method {
                    actor,
                    node,
                    method: at.method.to_owned(),
                    message,
                }));
            }
            Err(other) => other,
        };
        let rejected = |message| ActorCallError::Rejected {
            actor,
            node,
            message,
        };
        let (cause, message, delivered, origin) = match *other {
            Message::ActorError {
                cause,
                message,
                delivered,
                origin,
                ..
            } => (cause, message, delivered, FailureOrigin::from_wire(origin)),
            Message::Error { message } | Message::Refused { reason: message } => {
                return Attempt::Done(Err(rejected(message)));
            }
            other => {
                let message = format!("unexpected {}", message_name(&other));
                return Attempt::Done(Err(rejected(message)));
            }
        };
        let error = match cause.as_str() {
            "timeout" => return Attempt::Done(Err(timed_out())),
            "failed" => ActorCallError::Failed {
                actor,
                node,
                reason: message,
                origin,
            },
            "stopped" | "killed" => ActorCallError::Ended {
                actor,
                node,
                how: cause,
            },
            "unknown" | "starting" | "stopping" => rejected(message),
            _ => return Attempt::Done(Err(rejected(message))),
        };
        if delivered {
            // It ended with this message in its mailbox or running it: no second try.
            return Attempt::Done(Err(error));
        }
        // Not delivered: the actor does not run there (now).
        Attempt::Relocate {
            error,
            resend: true,
        }
    }

    /// Asks the head where the actor is; follows it when it runs.
    pub(super) async fn relocate(&self) -> Result<Located, ActorCallError> {
        self.relocate_within(HEAD_TIMEOUT).await
    }

    /// [`Self::relocate`], the head's answer waited for at most `wait`.
    async fn relocate_within(&self, wait: Duration) -> Result<Located, ActorCallError> {
        let request = Message::ActorLocate {
            actor_id: self.id.0,
        };
        match self.client.request_head(&request, wait).await? {
            Message::ActorLocation {
                node_id,
                address,
                state,
                reason,
                origin,
                ..
            } => {
                let node = (node_id != 0).then_some(NodeId(node_id));
                if state == "running" && !address.is_empty() {
                    let place = Place {
                        node: NodeId(node_id),
                        address,
                    };
                    *self.lock_place() = place.clone();
                    return Ok(Located::Running(place));
                }
                Ok(Located::Not(NotRunning {
                    state,
                    reason,
                    origin: FailureOrigin::from_wire(origin),
                    node,
                }))
            }
            Message::ActorError { .. } => Err(ActorCallError::Unknown { actor: self.id }),
            other => Err(self.client.unexpected(other).into()),
        }
    }

    /// The error for an actor the head says is not running.
    pub(super) fn not_running(&self, not: NotRunning) -> ActorCallError {
        let node = not.node.unwrap_or_else(|| self.node());
        match not.state.as_str() {
            "failed" => ActorCallError::Failed {
                actor: self.id,
                node,
                reason: not.reason,
                origin: not.origin,
            },
            _ => ActorCallError::NotRunning {
                actor: self.id,
                state: not.state,
                reason: not.reason,
                origin: not.origin,
            },
        }
    }

    fn place(&self) -> Place {
        self.lock_place().clone()
    }

    fn lock_place(&self) -> std::sync::MutexGuard<'_, Place> {
        self.place.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One try of a message: where, and within what.
struct Try<'a> {
    place: Place,
    method: &'a str,
    timeout: Duration,
    /// When the actor's node gives up on the call.
    deadline: Instant,
    /// When the caller gives up: the deadline and the answer's margin.
    end: Instant,
    /// Connect again if the cached connection to the node has ended.
    fresh: bool,
}

impl std::fmt::Debug for ActorRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let place = self.place();
        f.debug_struct("ActorRef")
            .field("id", &self.id)
            .field("node", &place.node)
            .field("address", &place.address)
            .finish()
    }
}

impl super::ClusterClient {
    /// The newest `lines` lines (at most 1,000) of actor `actor`'s worker process, asked
    /// of node `node` itself, whether the actor runs there or ended there lately: a node
    /// keeps the lines of its last 64 ended actors (stopped, killed, failed, or their
    /// process died) while its daemon runs. The head is asked where the node is, not
    /// where the actor is: it may have forgotten the actor. Not followed elsewhere.
    pub async fn actor_output_on(
        &self,
        node: NodeId,
        actor: ActorId,
        lines: u32,
    ) -> Result<ActorOutput, ActorCallError> {
        let status = self.status().await?;
        let member = status.nodes.iter().find(|member| member.id == node);
        let address = match member {
            Some(member) if member.state.is_live() => member.address.clone(),
            _ => {
                let state = member.map_or("unknown".to_owned(), |m| m.state.to_string());
                return Err(ActorCallError::NodeNotLive { actor, node, state });
            }
        };
        let connection = match self.inner.node(&address, OUTPUT_TIMEOUT, true).await {
            Ok(connection) => connection,
            Err(NodeLink::Closed) => {
                return Err(ActorCallError::NodeGone {
                    actor,
                    node,
                    address,
                });
            }
            Err(NodeLink::Failed(reason)) => {
                return Err(ActorCallError::Unreachable {
                    actor,
                    node,
                    address,
                    reason,
                    sent: false,
                });
            }
        };
        let request = Message::ActorOutput {
            actor_id: actor.0,
            lines,
        };
        let answer = connection
            .request(&request, OUTPUT_TIMEOUT)
            .await
            .map_err(|source| ActorCallError::Unreachable {
                actor,
                node,
                address,
                reason: source.to_string(),
                sent: true,
            })?;
        match answer {
            Message::ActorOutputLines {
                lines, own_process, ..
            } => Ok(ActorOutput { lines, own_process }),
            // Not running there, and no lines kept.
            Message::ActorError { cause, .. }
                if matches!(cause.as_str(), "unknown" | "failed" | "stopped" | "killed") =>
            {
                Err(ActorCallError::NoOutput { actor, node })
            }
            Message::ActorError { message, .. }
            | Message::Error { message }
            | Message::Refused { reason: message } => Err(ActorCallError::Rejected {
                actor,
                node,
                message,
            }),
            other => Err(ActorCallError::Rejected {
                actor,
                node,
                message: format!("unexpected {}", message_name(&other)),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_waits_a_quarter_of_its_timeout_more_within_bounds() {
        let ms = Duration::from_millis;
        assert_eq!(answer_margin(ms(100)), ms(100));
        assert_eq!(answer_margin(ms(1_000)), ms(250));
        assert_eq!(answer_margin(ms(4_000)), ms(1_000));
        assert_eq!(
            answer_margin(Duration::from_secs(60)),
            Duration::from_secs(2)
        );
        assert_eq!(answer_margin(Duration::MAX), Duration::from_secs(2));
    }
}
