//! The head's answer to every request: first who may ask what, then the request itself.
//!
//! | request               | no certificate | `node-*`             | `client` | other |
//! |-----------------------|----------------|----------------------|----------|-------|
//! | `JoinRequest`         | with the token | token or none (its own name is its key) | no | no |
//! | `Heartbeat`, `Leave`  | no             | for its own node id  | no       | no    |
//! | `StatusRequest`       | no             | yes                  | yes      | yes   |
//! | `StopRequest`         | no             | no                   | yes      | no    |
//! | actor messages        | no             | actor handler        | actor handler | actor handler |
//!
//! Stopping the cluster is for the head's machine (`client`, whose key only the head's
//! state folder holds): a node's certificate lives on a worker, which should not be able
//! to take the whole cluster down. Every refusal is a [`Message::Refused`]; refusals of
//! peers without a certificate are logged as warnings with their address. While the head
//! stops, it refuses every request but a node's report of an ended actor, which it
//! acknowledges without a record (its nodes' actors end as it stops them).
//!
//! Heartbeats come mostly over UDP, to `beats.rs`, which takes them by the session key
//! handed out here in the `JoinAccepted`. They also come as QUIC datagrams (see
//! `node/heartbeat.rs`, after a UDP beat went unanswered); each is answered by a
//! datagram under the same rules, [`Message::HeartbeatAck`] or
//! [`Message::HeartbeatRefused`] with its `seq`, and logged at debug level only. Any
//! other datagram is dropped.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use rand::Rng;
use tokio::task::JoinSet;
use tracing::{debug, error, info, warn};

use super::Shared;
use crate::daemon::{CLIENT_NAME, HEAD_NAME, NODE_PREFIX, is_control, message_name, refused};
use crate::gpu::MAX_CLAIMED_GPUS;
use crate::membership::{NodeId, SessionId};
use crate::transport::{Handler, Peer, PeerIdentity};
use crate::wire::{GpuSampleWire, Message, NodeDescription};

/// How long the head waits for each node to confirm a stop.
const NODE_STOP_TIMEOUT: Duration = Duration::from_secs(3);
/// The longest strings a node may describe itself with.
const MAX_HOSTNAME: usize = 255;
const MAX_ADDRESS: usize = 300;
const MAX_VERSION: usize = 64;
const MAX_GPU_TEXT: usize = 256;
/// The longest reason a refused heartbeat datagram carries, so that it fits in any
/// datagram QUIC takes (at least 1,200 bytes per packet).
const MAX_DATAGRAM_REASON: usize = 256;

/// Who the peer is, as far as the head's rules go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role<'a> {
    /// No certificate: may only join, with the token.
    Stranger,
    /// A node; its certificate name is its membership key.
    Node(&'a str),
    /// The commands on the head's machine (or the head itself).
    Operator,
    /// Another certificate of the cluster (a future worker process, say).
    Member,
}

impl<'a> Role<'a> {
    fn of(peer: &'a Peer) -> Self {
        match &peer.identity {
            PeerIdentity::Unauthenticated => Role::Stranger,
            PeerIdentity::Authenticated { name } if name.starts_with(NODE_PREFIX) => {
                Role::Node(name)
            }
            PeerIdentity::Authenticated { name } if name == CLIENT_NAME || name == HEAD_NAME => {
                Role::Operator
            }
            PeerIdentity::Authenticated { .. } => Role::Member,
        }
    }
}

/// The head's [`Handler`]: [`handle`] for each request, and the actor layer told when an
/// authenticated peer's connection ends (its actors are killed).
pub(super) struct Requests(pub(super) Arc<Shared>);

impl Handler for Requests {
    fn handle(&self, peer: Peer, request: Message) -> impl Future<Output = Message> + Send {
        handle(self.0.clone(), peer, request)
    }

    fn datagram(&self, peer: &Peer, message: Message) -> Option<Message> {
        let Message::Heartbeat {
            node_id,
            session,
            seq,
            gpus,
        } = message
        else {
            debug!(peer = %peer.address, message = message_name(&message), "dropped a datagram that is not a heartbeat");
            return None;
        };
        Some(match heartbeat(&self.0, peer, node_id, session, &gpus) {
            Ok(()) => Message::HeartbeatAck { seq },
            Err(reason) => Message::HeartbeatRefused {
                seq,
                reason: shortened(reason, MAX_DATAGRAM_REASON),
            },
        })
    }

    fn disconnected(&self, peer: &Peer) {
        if peer.name().is_none() {
            return;
        }
        if let Some(handler) = self.0.actor_handler() {
            handler.disconnected(peer);
        }
    }
}

/// Answers one request.
pub(super) async fn handle(shared: Arc<Shared>, peer: Peer, request: Message) -> Message {
    if shared.is_stopping() {
        if let Message::ActorEnded { actor_id, .. } = &request
            && matches!(Role::of(&peer), Role::Node(_))
        {
            // A normal end: the head stops its nodes, whose actors end meanwhile. Their
            // reports need no record in a directory that goes away with the head, and
            // refusing them would have each node warn of it.
            debug!(actor = actor_id, peer = %peer.address, "an ended actor's report while the head stops");
            return Message::Ack;
        }
        return refused("the head is stopping");
    }
    let role = Role::of(&peer);
    if role == Role::Stranger && !matches!(request, Message::JoinRequest { .. }) {
        warn!(peer = %peer.address, request = message_name(&request), "refused a request from a peer without a certificate");
        return refused("join first: this connection has no cluster certificate");
    }
    match request {
        Message::JoinRequest { token, node } => join(&shared, &peer, role, &token, node),
        Message::Heartbeat {
            node_id,
            session,
            seq,
            gpus,
        } => match heartbeat(&shared, &peer, node_id, session, &gpus) {
            Ok(()) => Message::HeartbeatAck { seq },
            Err(reason) => refused(reason),
        },
        Message::Leave { node_id, session } => {
            let Role::Node(key) = role else {
                return refused("only nodes leave");
            };
            match shared
                .members
                .leave(key, NodeId(node_id), SessionId(session))
            {
                Ok(()) => Message::Ack,
                Err(reason) => refused(format!("unknown session ({reason})")),
            }
        }
        Message::StatusRequest => {
            let actors = shared
                .actor_handler()
                .map(|handler| handler.actors())
                .unwrap_or_default();
            Message::StatusReply {
                status: shared.members.status().with_actors(actors).to_wire(),
            }
        }
        Message::StopRequest { all } => {
            if role != Role::Operator {
                warn!(peer = %peer.address, name = peer.name(), "refused a stop request");
                return refused(
                    "only the head's machine may stop the cluster: run `imgrun stop --all` there",
                );
            }
            stop(&shared, &peer, all).await
        }
        request if is_control(&request) => {
            refused(format!("a {} is not a request", message_name(&request)))
        }
        request => match shared.actor_handler() {
            Some(handler) => handler.handle(peer, request).await,
            None => Message::Error {
                message: "no actor runtime on this head".to_owned(),
            },
        },
    }
}

/// Whether the head keeps the session a heartbeat names, on a stream or in a datagram
/// (and then the GPU samples it carries); if not, why.
fn heartbeat(
    shared: &Shared,
    peer: &Peer,
    node_id: u64,
    session: u64,
    gpus: &[GpuSampleWire],
) -> Result<(), String> {
    if shared.is_stopping() {
        return Err("the head is stopping".to_owned());
    }
    let Role::Node(key) = Role::of(peer) else {
        debug!(peer = %peer.address, name = peer.name(), "refused a heartbeat from a peer that is no node");
        return Err("only nodes send heartbeats".to_owned());
    };
    shared
        .members
        .heartbeat(key, NodeId(node_id), SessionId(session), gpus)
        .map_err(|reason| {
            debug!(peer = %peer.address, node = node_id, %reason, "heartbeat refused");
            format!("unknown session: join again ({reason})")
        })
}

/// `text` cut to at most `max` bytes, at a character boundary.
fn shortened(mut text: String, max: usize) -> String {
    if text.len() > max {
        let end = (0..=max)
            .rev()
            .find(|&at| text.is_char_boundary(at))
            .unwrap_or(0);
        text.truncate(end);
    }
    text
}

/// Admits a node: with the token on a connection without certificate (a new key), or with
/// its certificate (its name is its key; a token, if sent, must be right too).
fn join(
    shared: &Shared,
    peer: &Peer,
    role: Role<'_>,
    token: &str,
    node: NodeDescription,
) -> Message {
    let key = match role {
        Role::Stranger if shared.token.matches(token) => new_node_key(),
        Role::Node(key) if token.is_empty() || shared.token.matches(token) => key.to_owned(),
        Role::Stranger | Role::Node(_) => {
            warn!(peer = %peer.address, name = peer.name(), "refused a join: bad token");
            return refused("bad token");
        }
        Role::Operator | Role::Member => return refused("only nodes join"),
    };
    if let Err(reason) = check_description(&node) {
        warn!(peer = %peer.address, %reason, "refused a join: bad node description");
        return refused(format!("bad node description: {reason}"));
    }
    let credentials = match shared.ca.issue(&key, &[]) {
        Ok(credentials) => credentials,
        Err(error) => {
            error!(%error, "cannot issue a node certificate");
            return Message::Error {
                message: format!("cannot issue a certificate: {error}"),
            };
        }
    };
    let (node_id, session, beat_key) = shared.members.join(&key, node);
    let (beat_port, beat_key) = match (shared.beat_port, beat_key) {
        (port, Some(beat_key)) if port != 0 => (port, beat_key.as_bytes().to_vec()),
        _ => (0, Vec::new()),
    };
    let config = shared.members.config();
    Message::JoinAccepted {
        node_id: node_id.0,
        session: session.0,
        ca_cert_pem: shared.ca.certificate().pem().to_owned(),
        cert_pem: credentials.cert_pem,
        key_pem: credentials.key_pem,
        heartbeat_ms: u32::try_from(config.heartbeat_interval_ms).unwrap_or(u32::MAX),
        dead_after_ms: u32::try_from(config.dead_after_ms).unwrap_or(u32::MAX),
        beat_port,
        beat_key,
    }
}

/// Stops every node (when `all`), answers, and stops the head once the answer left.
async fn stop(shared: &Arc<Shared>, peer: &Peer, all: bool) -> Message {
    shared
        .stopping
        .store(true, std::sync::atomic::Ordering::SeqCst);
    info!(peer = %peer.address, all, "stop requested");
    if all {
        stop_nodes(shared).await;
    }
    shared.shutdown_after_reply();
    Message::Ack
}

/// Asks every live node to stop, all at once, each within [`NODE_STOP_TIMEOUT`].
async fn stop_nodes(shared: &Arc<Shared>) {
    let mut asks = JoinSet::new();
    for (node, address) in shared.members.live_nodes() {
        let shared = shared.clone();
        asks.spawn(async move {
            let asked = async {
                let connection = shared.connect(&address).await?;
                let answer = connection
                    .request(&Message::StopRequest { all: false }, NODE_STOP_TIMEOUT)
                    .await
                    .map_err(|source| crate::daemon::DaemonError::Request {
                        peer: address.clone(),
                        source: Box::new(source),
                    })?;
                connection.close();
                Ok::<_, crate::daemon::DaemonError>(answer)
            };
            match tokio::time::timeout(NODE_STOP_TIMEOUT, asked).await {
                Ok(Ok(Message::Ack)) => info!(%node, %address, "node stopped"),
                Ok(Ok(other)) => {
                    warn!(%node, %address, answer = message_name(&other), "node did not stop")
                }
                Ok(Err(error)) => warn!(%node, %address, %error, "cannot stop node"),
                Err(_) => warn!(%node, %address, "node did not confirm the stop in time"),
            }
        });
    }
    while asks.join_next().await.is_some() {}
}

/// A fresh membership key (and certificate name) for a node joining with the token.
fn new_node_key() -> String {
    let bytes: [u8; 16] = rand::rng().random();
    let hex: String = bytes.iter().map(|byte| format!("{byte:02x}")).collect();
    format!("{NODE_PREFIX}{hex}")
}

/// Refuses descriptions a node could not honestly send: they are stored and shown.
fn check_description(node: &NodeDescription) -> Result<(), String> {
    let too_long = |what: &str, text: &str, max: usize| {
        (text.len() > max).then(|| format!("{what} longer than {max} bytes"))
    };
    let problem = too_long("host name", &node.hostname, MAX_HOSTNAME)
        .or_else(|| too_long("address", &node.address, MAX_ADDRESS))
        .or_else(|| too_long("version", &node.version, MAX_VERSION))
        .or_else(|| {
            (node.address.is_empty() || !node.address.contains(':'))
                .then(|| "address is not host:port".to_owned())
        })
        .or_else(|| {
            (node.resources.gpus.len() > MAX_CLAIMED_GPUS)
                .then(|| format!("more than {MAX_CLAIMED_GPUS} gpus"))
        })
        .or_else(|| {
            node.resources.gpus.iter().find_map(|gpu| {
                too_long("gpu name", &gpu.name, MAX_GPU_TEXT)
                    .or_else(|| too_long("gpu uuid", &gpu.uuid, MAX_GPU_TEXT))
            })
        });
    match problem {
        Some(problem) => Err(problem),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{GpuWire, ResourcesWire};

    fn description() -> NodeDescription {
        NodeDescription {
            hostname: "gpu-01".into(),
            address: "10.0.0.2:7100".into(),
            version: "0.1.0".into(),
            resources: ResourcesWire {
                cpus: 8,
                memory_bytes: None,
                gpus: vec![GpuWire {
                    index: 0,
                    name: "claimed GPU".into(),
                    memory_bytes: None,
                    uuid: "claimed-0".into(),
                }],
            },
        }
    }

    #[test]
    fn node_descriptions_are_checked() {
        type Change = fn(&mut NodeDescription);
        let cases: [(Change, Option<&str>); 6] = [
            (|_| {}, None),
            (|d| d.hostname = "x".repeat(256), Some("host name")),
            (|d| d.address = String::new(), Some("address")),
            (|d| d.address = "10.0.0.2".into(), Some("address")),
            (
                |d| d.resources.gpus[0].name = "x".repeat(257),
                Some("gpu name"),
            ),
            (
                |d| d.resources.gpus = vec![d.resources.gpus[0].clone(); 1025],
                Some("gpus"),
            ),
        ];
        for (change, want) in cases {
            let mut node = description();
            change(&mut node);
            match (check_description(&node), want) {
                (Ok(()), None) => {}
                (Err(reason), Some(word)) => assert!(reason.contains(word), "{reason}"),
                (got, want) => panic!("{got:?}, wanted {want:?}"),
            }
        }
    }

    #[test]
    fn refusal_reasons_are_cut_at_character_boundaries() {
        let cases = [
            ("short", 10, "short"),
            ("exactly", 7, "exactly"),
            ("too long", 3, "too"),
            ("é→✓", 4, "é"),
            ("é→✓", 5, "é→"),
            ("", 0, ""),
        ];
        for (text, max, want) in cases {
            assert_eq!(shortened(text.to_owned(), max), want, "{text:?} to {max}");
        }
    }

    #[test]
    fn roles_follow_certificate_names() {
        let peer = |identity| Peer {
            address: "127.0.0.1:1".parse().expect("address"),
            identity,
        };
        let named = |name: &str| PeerIdentity::Authenticated { name: name.into() };
        let cases = [
            (peer(PeerIdentity::Unauthenticated), Role::Stranger),
            (peer(named("node-ab")), Role::Node("node-ab")),
            (peer(named("client")), Role::Operator),
            (peer(named("head")), Role::Operator),
            (peer(named("worker-1")), Role::Member),
        ];
        for (peer, role) in &cases {
            assert_eq!(Role::of(peer), *role, "{peer:?}");
        }
        let key = new_node_key();
        assert!(key.starts_with(NODE_PREFIX) && key.len() == 37, "{key}");
    }
}
