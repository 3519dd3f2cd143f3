//! What callers of actors get back when something goes wrong, and how actors end.

use std::collections::{HashMap, VecDeque};
use std::fmt;

use super::id::ActorId;

/// Why a start, call, tell or stop of an actor failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ActorError {
    /// The method returned a (non-fatal) error; the actor carries on.
    #[error("actor {actor_id}: {method}: {message}")]
    Method {
        actor_id: ActorId,
        method: String,
        message: String,
    },
    /// The actor failed for good: a fatal error, a panic, its worker process died.
    /// `origin` says where the failure started (this actor, another, its process).
    #[error("actor {actor_id} failed: {reason}")]
    Failed {
        actor_id: ActorId,
        reason: String,
        origin: FailureOrigin,
    },
    /// The actor was killed; what was queued for it was dropped.
    #[error("actor {0} was killed")]
    Killed(ActorId),
    /// The actor stopped gracefully.
    #[error("actor {0} stopped")]
    Stopped(ActorId),
    /// The actor is still starting or already stopping, and takes no messages.
    #[error("actor {actor_id} is {state}")]
    NotRunning {
        actor_id: ActorId,
        state: &'static str,
    },
    /// No actor of that id runs here, nor ended here recently.
    #[error("no actor {0} here")]
    NotFound(ActorId),
    /// An actor of that id already runs here.
    #[error("actor {0} already runs here")]
    AlreadyExists(ActorId),
    /// No constructor is registered under that kind.
    #[error("unknown actor kind '{kind}' (registered: {})", list(registered))]
    UnknownKind {
        kind: String,
        registered: Vec<String>,
    },
    /// The constructor failed or panicked, or the worker died before the actor started.
    #[error("actor {actor_id} ({kind}) did not start: {reason}")]
    Start {
        actor_id: ActorId,
        kind: String,
        reason: String,
    },
    /// No reply within the caller's timeout. The call may still run.
    #[error("actor {actor_id} did not answer '{method}' within {timeout_ms} ms")]
    Timeout {
        actor_id: ActorId,
        method: String,
        timeout_ms: u64,
    },
    /// A payload too large for one frame to a worker process.
    #[error("payload of {len} bytes for actor {actor_id} exceeds the limit of {max}")]
    TooLarge {
        actor_id: ActorId,
        len: usize,
        max: usize,
    },
    /// A worker process could not be started or cannot host the actor.
    #[error("worker process for group '{group}': {reason}")]
    Worker { group: String, reason: String },
    /// The actor runtime itself is gone (shut down, or its threads could not start).
    #[error("actor runtime: {reason}")]
    Runtime { reason: String },
}

fn list(kinds: &[String]) -> String {
    if kinds.is_empty() {
        "none".to_string()
    } else {
        kinds.join(", ")
    }
}

/// Where an actor's failure started, so that whoever watches several actors can tell
/// the failure that came first from those that follow from it, and an actor that is
/// gone with its process or node from one that failed by its own error. Decisions about
/// a failure are made on this, never on the text of its reason (which is for people).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum FailureOrigin {
    /// In the actor that failed: its own error or a panic. What a failure is unless the
    /// actor says otherwise.
    #[default]
    Here,
    /// In another actor this one depended on: a peer went away or stopped answering, and
    /// this actor cannot go on without it (see [`MethodError::caused_elsewhere`]).
    ///
    /// [`MethodError::caused_elsewhere`]: crate::MethodError::caused_elsewhere
    Elsewhere,
    /// Its worker process ended (it exited, was killed by a signal, or sent a bad frame)
    /// without the actor reporting a failure of its own.
    WorkerExit,
    /// Its node was lost: no heartbeat in time, or the node left or was replaced.
    NodeLost,
}

impl FailureOrigin {
    /// Whether the failure follows from another actor's.
    pub fn is_elsewhere(self) -> bool {
        self == FailureOrigin::Elsewhere
    }

    /// Whether the actor is gone with its worker process or its node rather than by an
    /// error of its own: what a program that can go on without it (an elastic job)
    /// survives, while an actor's own error would recur wherever its work went.
    pub fn is_loss(self) -> bool {
        matches!(self, FailureOrigin::WorkerExit | FailureOrigin::NodeLost)
    }

    /// Its code on the wire (`origin` of the wire's actor messages).
    pub(crate) fn to_wire(self) -> u8 {
        match self {
            FailureOrigin::Here => 0,
            FailureOrigin::Elsewhere => 1,
            FailureOrigin::WorkerExit => 2,
            FailureOrigin::NodeLost => 3,
        }
    }

    /// From its code on the wire. A code this build does not know (a peer's frames carry
    /// the same wire version, so only a bug sends one) is taken as the actor's own
    /// failure: the choice that makes no program go on without it.
    pub(crate) fn from_wire(code: u8) -> Self {
        match code {
            1 => FailureOrigin::Elsewhere,
            2 => FailureOrigin::WorkerExit,
            3 => FailureOrigin::NodeLost,
            _ => FailureOrigin::Here,
        }
    }
}

/// How an actor ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitReason {
    /// A graceful stop: the messages queued before it were processed.
    Stopped,
    /// A kill: what was queued was dropped.
    Killed,
    /// A fatal error, a panic, or the death of its worker process, for a person to read,
    /// and where that failure started.
    Failed {
        reason: String,
        origin: FailureOrigin,
    },
}

impl ExitReason {
    /// A failure that started in the actor itself.
    pub fn failed(reason: impl Into<String>) -> Self {
        ExitReason::Failed {
            reason: reason.into(),
            origin: FailureOrigin::Here,
        }
    }

    /// Whether the actor failed (rather than being stopped or killed on request).
    pub fn is_failure(&self) -> bool {
        matches!(self, ExitReason::Failed { .. })
    }

    /// The error a caller of the ended actor gets.
    pub fn error(&self, actor_id: ActorId) -> ActorError {
        match self {
            ExitReason::Stopped => ActorError::Stopped(actor_id),
            ExitReason::Killed => ActorError::Killed(actor_id),
            ExitReason::Failed { reason, origin } => ActorError::Failed {
                actor_id,
                reason: reason.clone(),
                origin: *origin,
            },
        }
    }
}

impl fmt::Display for ExitReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExitReason::Stopped => f.write_str("stopped"),
            ExitReason::Killed => f.write_str("killed"),
            ExitReason::Failed { reason, .. } => write!(f, "failed: {reason}"),
        }
    }
}

/// An actor ended; sent once per actor that ran, on the channel its host was given. The
/// node daemon forwards failures to the head and confirms stops.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActorExit {
    pub actor_id: ActorId,
    pub reason: ExitReason,
}

/// How many ended actors a host remembers, so that a late caller learns why the actor
/// ended rather than that it does not exist.
const TOMBSTONES: usize = 1024;

/// The reasons of the last [`TOMBSTONES`] actors that ended.
#[derive(Debug, Default)]
pub(crate) struct Tombstones {
    reasons: HashMap<ActorId, ExitReason>,
    order: VecDeque<ActorId>,
}

impl Tombstones {
    pub(crate) fn insert(&mut self, actor: ActorId, reason: ExitReason) {
        if self.reasons.insert(actor, reason).is_none() {
            self.order.push_back(actor);
        }
        while self.order.len() > TOMBSTONES {
            if let Some(old) = self.order.pop_front() {
                self.reasons.remove(&old);
            }
        }
    }

    /// Forgets `actor` (it starts again with the same id).
    pub(crate) fn remove(&mut self, actor: ActorId) {
        if self.reasons.remove(&actor).is_some() {
            self.order.retain(|id| *id != actor);
        }
    }

    /// The error for a caller of `actor`, which does not run here.
    pub(crate) fn missing(&self, actor: ActorId) -> ActorError {
        self.reasons
            .get(&actor)
            .map_or(ActorError::NotFound(actor), |reason| reason.error(actor))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_kind_names_the_kind_and_the_registered_ones() {
        let cases: [(&[&str], &str); 2] = [
            (
                &["counter", "echo"],
                "unknown actor kind 'trainer' (registered: counter, echo)",
            ),
            (&[], "unknown actor kind 'trainer' (registered: none)"),
        ];
        for (registered, want) in cases {
            let error = ActorError::UnknownKind {
                kind: "trainer".into(),
                registered: registered.iter().map(|k| k.to_string()).collect(),
            };
            assert_eq!(error.to_string(), want);
        }
    }

    #[test]
    fn tombstones_remember_the_last_exits_only() {
        let mut tombstones = Tombstones::default();
        for id in 0..TOMBSTONES as u64 + 10 {
            tombstones.insert(ActorId(id), ExitReason::Killed);
        }
        assert_eq!(
            tombstones.missing(ActorId(3)),
            ActorError::NotFound(ActorId(3))
        );
        let last = ActorId(TOMBSTONES as u64 + 9);
        assert_eq!(tombstones.missing(last), ActorError::Killed(last));
        tombstones.remove(last);
        assert_eq!(tombstones.missing(last), ActorError::NotFound(last));
        assert_eq!(tombstones.order.len(), tombstones.reasons.len());
    }
}
