//! Membership and failure detection: which nodes belong to the cluster, in which session,
//! and which have gone silent. A pure state machine: the caller passes the time in.
//!
//! The head's daemon drives a [`Membership`]: it calls [`Membership::join`],
//! [`Membership::heartbeat`] and [`Membership::leave`] as messages arrive, and
//! [`Membership::tick`] when [`Membership::next_deadline`] comes. Nothing here reads a
//! clock, sleeps or does I/O, so every rule is tested with made-up times.
//!
//! The clock is a `u64` of milliseconds from any origin (the daemon's `Instant` at start,
//! say); it should not go backwards, and where it does nothing is declared early.
//!
//! Rules, for a node silent for `s` ms since its last heartbeat (joining counts as one):
//! - `s >= dead_after_ms / 2`: suspect (still holds its resources; shown by `status`);
//! - `s >= dead_after_ms`: dead, exactly at that deadline and never before. From then on
//!   its session is over: its heartbeats are refused, even before a tick declared it.
//!
//! A node is known by a stable key the caller chooses (host name and listen address, say).
//! When the same key joins again it keeps its [`NodeId`] and gets a new [`SessionId`]; the
//! old session ends then, and messages from it are refused. Every error of `heartbeat` and
//! `leave` means the same thing to the node: join again.
//!
//! Events caused by a call are returned by that call; events caused by time passing are
//! returned by `tick`. Each session ends with exactly one event (`NodeDead`,
//! `NodeReplaced` or `NodeLeft`), after which the daemon releases what it held.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

/// A node of the cluster. It keeps its id when it rejoins with the same key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId(pub u64);

/// One membership of a node, from its join to its death, replacement or leave.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SessionId(pub u64);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Where a node's current session stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NodeState {
    /// Heard from within half the window.
    Alive,
    /// Silent for more than half the window, not yet for all of it.
    Suspect,
    /// Silent for the whole window; the session is over.
    Dead,
    /// Stopped gracefully; the session is over.
    Left,
}

impl NodeState {
    /// Whether the session is still on (alive or suspect): the node holds its resources.
    pub fn is_live(self) -> bool {
        matches!(self, NodeState::Alive | NodeState::Suspect)
    }
}

impl fmt::Display for NodeState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NodeState::Alive => "alive",
            NodeState::Suspect => "suspect",
            NodeState::Dead => "dead",
            NodeState::Left => "left",
        })
    }
}

/// How often nodes send heartbeats and how long the head waits before declaring one dead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MembershipConfig {
    /// How often a node sends a heartbeat (told to the node when it joins).
    pub heartbeat_interval_ms: u64,
    /// Silence after which a node is dead: a few seconds, much faster than Ray's 30+ s.
    pub dead_after_ms: u64,
}

impl Default for MembershipConfig {
    fn default() -> Self {
        MembershipConfig {
            heartbeat_interval_ms: 500,
            dead_after_ms: 3000,
        }
    }
}

impl MembershipConfig {
    /// Silence after which a node is suspect: half the window.
    pub fn suspect_after_ms(&self) -> u64 {
        self.dead_after_ms / 2
    }

    /// Refuses windows a node cannot meet: the interval must be positive and the window
    /// must hold at least two heartbeats, so that one lost heartbeat does not kill a node.
    pub fn validate(&self) -> Result<(), MembershipError> {
        if self.heartbeat_interval_ms == 0
            || self.dead_after_ms < self.heartbeat_interval_ms.saturating_mul(2)
        {
            return Err(MembershipError::BadConfig {
                heartbeat_interval_ms: self.heartbeat_interval_ms,
                dead_after_ms: self.dead_after_ms,
            });
        }
        Ok(())
    }
}

/// Why a node's message was refused. Every variant tells the node to join again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MembershipError {
    #[error("unknown node {node}")]
    UnknownNode { node: NodeId },
    #[error("node {node}: session {session} is not the current one ({current})")]
    StaleSession {
        node: NodeId,
        session: SessionId,
        current: SessionId,
    },
    #[error("node {node}: session {session} is over ({state})")]
    SessionEnded {
        node: NodeId,
        session: SessionId,
        state: NodeState,
    },
    #[error(
        "node {node}: session {session} was silent for {silent_for_ms} ms, the limit is {dead_after_ms} ms"
    )]
    Expired {
        node: NodeId,
        session: SessionId,
        silent_for_ms: u64,
        dead_after_ms: u64,
    },
    #[error(
        "bad membership timing: heartbeat every {heartbeat_interval_ms} ms, dead after {dead_after_ms} ms (needs a positive interval and a window of at least two)"
    )]
    BadConfig {
        heartbeat_interval_ms: u64,
        dead_after_ms: u64,
    },
}

/// A change the daemon acts on (log it; on the end of a session, release what it held).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MembershipEvent {
    /// Silent for half the window.
    NodeSuspect {
        node: NodeId,
        session: SessionId,
        last_heartbeat_ms: u64,
        silent_for_ms: u64,
    },
    /// A suspect node was heard from again.
    NodeRecovered {
        node: NodeId,
        session: SessionId,
        silent_for_ms: u64,
    },
    /// Silent for the whole window: the session is over.
    NodeDead {
        node: NodeId,
        session: SessionId,
        last_heartbeat_ms: u64,
        silent_for_ms: u64,
    },
    /// The node joined again while its old session was still on: the old one is over.
    NodeReplaced {
        node: NodeId,
        old_session: SessionId,
        new_session: SessionId,
    },
    /// The node stopped gracefully: the session is over.
    NodeLeft { node: NodeId, session: SessionId },
}

impl MembershipEvent {
    /// The node the event is about.
    pub fn node(&self) -> NodeId {
        match *self {
            MembershipEvent::NodeSuspect { node, .. }
            | MembershipEvent::NodeRecovered { node, .. }
            | MembershipEvent::NodeDead { node, .. }
            | MembershipEvent::NodeReplaced { node, .. }
            | MembershipEvent::NodeLeft { node, .. } => node,
        }
    }

    /// The session this event ends, if it ends one: whatever that session held (resources,
    /// actors) is lost.
    pub fn ended_session(&self) -> Option<SessionId> {
        match *self {
            MembershipEvent::NodeDead { session, .. }
            | MembershipEvent::NodeLeft { session, .. } => Some(session),
            MembershipEvent::NodeReplaced { old_session, .. } => Some(old_session),
            MembershipEvent::NodeSuspect { .. } | MembershipEvent::NodeRecovered { .. } => None,
        }
    }
}

/// What [`Membership::join`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Joined {
    pub node: NodeId,
    pub session: SessionId,
    /// The end of the node's previous session when it was still on: `NodeReplaced`, or
    /// `NodeDead` when it had been silent past the window without a tick noticing.
    pub ended: Option<MembershipEvent>,
}

/// One node as membership knows it, with the caller's information `T` about it.
#[derive(Debug, Clone)]
pub struct Member<T> {
    id: NodeId,
    key: String,
    session: SessionId,
    state: NodeState,
    joined_at_ms: u64,
    last_heartbeat_ms: u64,
    info: T,
}

impl<T> Member<T> {
    pub fn id(&self) -> NodeId {
        self.id
    }

    /// The stable key the node joined with.
    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn session(&self) -> SessionId {
        self.session
    }

    /// The state as of the last call or tick.
    pub fn state(&self) -> NodeState {
        self.state
    }

    /// When the current session joined.
    pub fn joined_at_ms(&self) -> u64 {
        self.joined_at_ms
    }

    /// When the node was last heard from (the join counts).
    pub fn last_heartbeat_ms(&self) -> u64 {
        self.last_heartbeat_ms
    }

    /// What the caller said about the node when it last joined.
    pub fn info(&self) -> &T {
        &self.info
    }
}

/// The head's view of the cluster's nodes. `T` is whatever the daemon keeps per node.
#[derive(Debug, Clone)]
pub struct Membership<T> {
    config: MembershipConfig,
    members: BTreeMap<NodeId, Member<T>>,
    keys: HashMap<String, NodeId>,
    next_node: u64,
    next_session: u64,
}

impl<T> Membership<T> {
    /// An empty membership; node ids and sessions count from 1.
    pub fn new(config: MembershipConfig) -> Self {
        Self::with_first_session(config, SessionId(1))
    }

    /// An empty membership whose sessions count from `first`: a restarted head picks a
    /// `first` above any session it gave before (from its clock, say), so that messages
    /// of sessions from its previous life are refused rather than mistaken for current.
    pub fn with_first_session(config: MembershipConfig, first: SessionId) -> Self {
        Membership {
            config,
            members: BTreeMap::new(),
            keys: HashMap::new(),
            next_node: 1,
            next_session: first.0,
        }
    }

    pub fn config(&self) -> &MembershipConfig {
        &self.config
    }

    /// Admits a node under `key` at `now`, with a new session. A key seen before keeps its
    /// node id, and its previous session ends (see [`Joined::ended`]).
    pub fn join(&mut self, now: u64, key: impl Into<String>, info: T) -> Joined {
        let key = key.into();
        let session = SessionId(self.next_session);
        self.next_session = self.next_session.saturating_add(1);
        let dead_after_ms = self.config.dead_after_ms;
        if let Some(member) = self.keys.get(&key).and_then(|id| self.members.get_mut(id)) {
            let ended = member.end_for_rejoin(now, session, dead_after_ms);
            member.session = session;
            member.state = NodeState::Alive;
            member.joined_at_ms = now;
            member.last_heartbeat_ms = now;
            member.info = info;
            return Joined {
                node: member.id,
                session,
                ended,
            };
        }
        let id = NodeId(self.next_node);
        self.next_node = self.next_node.saturating_add(1);
        self.keys.insert(key.clone(), id);
        self.members.insert(
            id,
            Member {
                id,
                key,
                session,
                state: NodeState::Alive,
                joined_at_ms: now,
                last_heartbeat_ms: now,
                info,
            },
        );
        Joined {
            node: id,
            session,
            ended: None,
        }
    }

    /// Records a heartbeat of `node` in `session`. Returns `NodeRecovered` when the node was
    /// suspect. An error (unknown node, old or ended session, silence past the window) tells
    /// the node to join again; the state is left as it was.
    pub fn heartbeat(
        &mut self,
        now: u64,
        node: NodeId,
        session: SessionId,
    ) -> Result<Option<MembershipEvent>, MembershipError> {
        let member = self.live_member(now, node, session)?;
        let silent_for_ms = now.saturating_sub(member.last_heartbeat_ms);
        member.last_heartbeat_ms = member.last_heartbeat_ms.max(now);
        if member.state == NodeState::Suspect {
            member.state = NodeState::Alive;
            return Ok(Some(MembershipEvent::NodeRecovered {
                node,
                session,
                silent_for_ms,
            }));
        }
        Ok(None)
    }

    /// Ends `session` of `node` gracefully. Refused like a heartbeat would be: a node that
    /// was silent past the window is declared dead by `tick`, not left.
    pub fn leave(
        &mut self,
        now: u64,
        node: NodeId,
        session: SessionId,
    ) -> Result<MembershipEvent, MembershipError> {
        let member = self.live_member(now, node, session)?;
        member.state = NodeState::Left;
        Ok(MembershipEvent::NodeLeft { node, session })
    }

    /// Applies the passage of time up to `now`: nodes silent for half the window become
    /// suspect, nodes silent for the whole window dead. Idempotent: a second tick at the
    /// same time returns nothing. Events come in node id order.
    pub fn tick(&mut self, now: u64) -> Vec<MembershipEvent> {
        let dead_after_ms = self.config.dead_after_ms;
        let suspect_after_ms = self.config.suspect_after_ms();
        let mut events = Vec::new();
        for member in self.members.values_mut() {
            if !member.state.is_live() {
                continue;
            }
            let silent_for_ms = now.saturating_sub(member.last_heartbeat_ms);
            if silent_for_ms >= dead_after_ms {
                member.state = NodeState::Dead;
                events.push(MembershipEvent::NodeDead {
                    node: member.id,
                    session: member.session,
                    last_heartbeat_ms: member.last_heartbeat_ms,
                    silent_for_ms,
                });
            } else if member.state == NodeState::Alive && silent_for_ms >= suspect_after_ms {
                member.state = NodeState::Suspect;
                events.push(MembershipEvent::NodeSuspect {
                    node: member.id,
                    session: member.session,
                    last_heartbeat_ms: member.last_heartbeat_ms,
                    silent_for_ms,
                });
            }
        }
        events
    }

    /// When `tick` next has something to do (the earliest suspect or dead deadline of a
    /// live node), so the daemon sleeps exactly until then; `None` with no live node. A
    /// time in the past means: tick now.
    pub fn next_deadline(&self) -> Option<u64> {
        let suspect_after_ms = self.config.suspect_after_ms();
        let dead_after_ms = self.config.dead_after_ms;
        self.alive()
            .map(|member| {
                let wait = match member.state {
                    NodeState::Alive => suspect_after_ms,
                    _ => dead_after_ms,
                };
                member.last_heartbeat_ms.saturating_add(wait)
            })
            .min()
    }

    /// The node with this id, whatever its state.
    pub fn get(&self, node: NodeId) -> Option<&Member<T>> {
        self.members.get(&node)
    }

    /// The node that joined under `key`, whatever its state.
    pub fn find(&self, key: &str) -> Option<&Member<T>> {
        self.keys.get(key).and_then(|id| self.members.get(id))
    }

    /// Every node ever seen, dead and left ones included, in id order.
    pub fn nodes(&self) -> impl Iterator<Item = &Member<T>> {
        self.members.values()
    }

    /// The nodes whose session is on (alive or suspect), in id order.
    pub fn alive(&self) -> impl Iterator<Item = &Member<T>> {
        self.members.values().filter(|m| m.state.is_live())
    }

    /// The member `node` if `session` is its current, live, unexpired session.
    fn live_member(
        &mut self,
        now: u64,
        node: NodeId,
        session: SessionId,
    ) -> Result<&mut Member<T>, MembershipError> {
        let dead_after_ms = self.config.dead_after_ms;
        let member = self
            .members
            .get_mut(&node)
            .ok_or(MembershipError::UnknownNode { node })?;
        if member.session != session {
            return Err(MembershipError::StaleSession {
                node,
                session,
                current: member.session,
            });
        }
        if !member.state.is_live() {
            return Err(MembershipError::SessionEnded {
                node,
                session,
                state: member.state,
            });
        }
        let silent_for_ms = now.saturating_sub(member.last_heartbeat_ms);
        if silent_for_ms >= dead_after_ms {
            return Err(MembershipError::Expired {
                node,
                session,
                silent_for_ms,
                dead_after_ms,
            });
        }
        Ok(member)
    }
}

impl<T> Member<T> {
    /// The event that ends this member's session because it joins again as `new_session`,
    /// when the session had not ended yet.
    fn end_for_rejoin(
        &self,
        now: u64,
        new_session: SessionId,
        dead_after_ms: u64,
    ) -> Option<MembershipEvent> {
        if !self.state.is_live() {
            return None;
        }
        let silent_for_ms = now.saturating_sub(self.last_heartbeat_ms);
        Some(if silent_for_ms >= dead_after_ms {
            MembershipEvent::NodeDead {
                node: self.id,
                session: self.session,
                last_heartbeat_ms: self.last_heartbeat_ms,
                silent_for_ms,
            }
        } else {
            MembershipEvent::NodeReplaced {
                node: self.id,
                old_session: self.session,
                new_session,
            }
        })
    }
}

#[cfg(test)]
#[path = "membership_tests.rs"]
mod tests;
