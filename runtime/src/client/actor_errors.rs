//! [`ActorCallError`]: why a spawn, call, tell or stop through the cluster client failed,
//! naming the actor, its node and the reason.

use std::time::Duration;

use crate::actor::{ActorId, FailureOrigin};
use crate::daemon::DaemonError;
use crate::membership::NodeId;

/// Why a spawn, call, tell or stop of an actor failed. Messages name the actor, the node
/// it was on, and why.
#[derive(Debug, thiserror::Error)]
pub enum ActorCallError {
    /// The head could not place or start the actor; nothing is reserved for it.
    #[error("cannot spawn an actor of kind '{kind}': {reason}")]
    Spawn { kind: String, reason: String },
    /// The method returned an error; the actor carries on.
    #[error("actor {actor} on node {node}: {method}: {message}")]
    Method {
        actor: ActorId,
        node: NodeId,
        method: String,
        message: String,
    },
    /// No answer within the caller's timeout. The method may still run.
    #[error(
        "actor {actor} on node {node} did not answer '{method}' within {after:?}; it may still run it"
    )]
    Timeout {
        actor: ActorId,
        node: NodeId,
        method: String,
        after: Duration,
    },
    /// The actor failed (for good, or it is not back yet). `origin` says whether the
    /// failure started in it or follows from another actor's (its peer went away).
    #[error("actor {actor} on node {node} failed: {reason}")]
    Failed {
        actor: ActorId,
        node: NodeId,
        reason: String,
        origin: FailureOrigin,
    },
    /// The actor does not take messages now: `restarting`, `starting`, `stopping` or
    /// `stopped`, with why it last failed when it did, and where that failure started.
    #[error("actor {actor} is {state}{}", last_failure(reason))]
    NotRunning {
        actor: ActorId,
        state: String,
        reason: String,
        origin: FailureOrigin,
    },
    /// The actor was stopped or killed (`how`).
    #[error("actor {actor} on node {node} was {how}")]
    Ended {
        actor: ActorId,
        node: NodeId,
        how: String,
    },
    /// The node refused the message (too large, or another error it names).
    #[error("actor {actor} on node {node}: {message}")]
    Rejected {
        actor: ActorId,
        node: NodeId,
        message: String,
    },
    /// The connection to the actor's node had ended (the node stopped or was lost).
    #[error("node {node} ({address}) of actor {actor} closed its connection")]
    NodeGone {
        actor: ActorId,
        node: NodeId,
        address: String,
    },
    /// The actor's node could not be reached; `sent`: the message had left, so a call may
    /// or may not have run.
    #[error("cannot reach actor {actor} on node {node} ({address}){}: {reason}", if *sent { " after sending; it may or may not have run" } else { "" })]
    Unreachable {
        actor: ActorId,
        node: NodeId,
        address: String,
        reason: String,
        sent: bool,
    },
    /// The head knows no such actor (never spawned, or ended long ago and forgotten).
    #[error("unknown actor {actor}")]
    Unknown { actor: ActorId },
    /// The node asked for an actor's output is not in the cluster now (`state`: `dead`,
    /// `left`, or `unknown` to the head): what it kept is out of reach.
    #[error("node {node}, asked for the output of actor {actor}, is {state}")]
    NodeNotLive {
        actor: ActorId,
        node: NodeId,
        state: String,
    },
    /// The node keeps no output of the actor: it never ran there, it ended too long ago
    /// (a node keeps the lines of its last ended actors only), or the node daemon
    /// restarted since.
    #[error(
        "node {node} keeps no output of actor {actor} (it never ran there, ended too long \
         ago, or the node restarted since)"
    )]
    NoOutput { actor: ActorId, node: NodeId },
    /// The head could not be asked, or refused.
    #[error(transparent)]
    Head(#[from] DaemonError),
}

impl ActorCallError {
    /// For a failed actor, where its failure started; `None` for every other error.
    pub fn failure_origin(&self) -> Option<FailureOrigin> {
        match self {
            ActorCallError::Failed { origin, .. } => Some(*origin),
            _ => None,
        }
    }
}

impl ActorCallError {
    /// Whether the actor is gone with its process or its node (it ended without failing
    /// by its own error): its worker process ended, its node was lost or closed its
    /// connection, cannot be reached or does not answer, or it was killed. A program
    /// that can go on without the actor (an elastic job) tells these from the actor's
    /// own errors, which would recur wherever its work went. Decided on the failure's
    /// [`FailureOrigin`], never on the text of its reason.
    pub fn is_loss(&self) -> bool {
        match self {
            ActorCallError::Failed { origin, .. } | ActorCallError::NotRunning { origin, .. } => {
                origin.is_loss()
            }
            ActorCallError::Timeout { .. }
            | ActorCallError::Ended { .. }
            | ActorCallError::NodeGone { .. }
            | ActorCallError::Unreachable { .. } => true,
            _ => false,
        }
    }
}

fn last_failure(reason: &str) -> String {
    if reason.is_empty() {
        String::new()
    } else {
        format!(" (last failure: {reason})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn losses_are_told_from_an_actors_own_failures_by_origin_whatever_the_words() {
        // The same words under each origin, and words that once meant a loss: only the
        // origin decides.
        let reasons = [
            "node 2 lost: no heartbeat for 3000 ms",
            "worker process for group 'g' (pid 4) killed by signal 9 (SIGKILL)",
            "the loss diverged",
            "",
        ];
        let origins = [
            (FailureOrigin::Here, false),
            (FailureOrigin::Elsewhere, false),
            (FailureOrigin::WorkerExit, true),
            (FailureOrigin::NodeLost, true),
        ];
        for reason in reasons {
            for (origin, loss) in origins {
                let failed = ActorCallError::Failed {
                    actor: ActorId(1),
                    node: NodeId(2),
                    reason: reason.to_string(),
                    origin,
                };
                assert_eq!(failed.is_loss(), loss, "{origin:?} {reason:?}");
                let restarting = ActorCallError::NotRunning {
                    actor: ActorId(1),
                    state: "restarting".into(),
                    reason: reason.to_string(),
                    origin,
                };
                assert_eq!(restarting.is_loss(), loss, "{origin:?} {reason:?}");
            }
        }
    }

    #[test]
    fn errors_name_the_actor_the_node_and_why() {
        let (actor, node) = (ActorId(3), NodeId(2));
        let cases = [
            (
                ActorCallError::Timeout {
                    actor,
                    node,
                    method: "step".into(),
                    after: Duration::from_millis(250),
                },
                "actor 3 on node 2 did not answer 'step' within 250ms; it may still run it",
            ),
            (
                ActorCallError::NotRunning {
                    actor,
                    state: "restarting".into(),
                    reason: "node 2 lost: no heartbeat for 500 ms".into(),
                    origin: FailureOrigin::NodeLost,
                },
                "actor 3 is restarting (last failure: node 2 lost: no heartbeat for 500 ms)",
            ),
            (
                ActorCallError::Unreachable {
                    actor,
                    node,
                    address: "10.0.0.2:7100".into(),
                    reason: "connection lost".into(),
                    sent: true,
                },
                "cannot reach actor 3 on node 2 (10.0.0.2:7100) after sending; it may or may \
                 not have run: connection lost",
            ),
            (
                ActorCallError::Failed {
                    actor,
                    node,
                    reason: "panicked in step: boom".into(),
                    origin: FailureOrigin::Here,
                },
                "actor 3 on node 2 failed: panicked in step: boom",
            ),
        ];
        for (error, want) in cases {
            assert_eq!(error.to_string(), want);
        }
    }
}
