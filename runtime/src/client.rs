//! The cluster client behind `imgrun status` and `imgrun stop --all`, and behind the
//! drivers that spawn actors: a mutually authenticated connection to the head, made with
//! the credentials found in this machine's state folder, and connections to the nodes
//! its actors run on (`actors.rs`).
//!
//! On the head's machine it uses the `client` certificate the head issues at start (the
//! one allowed to stop the cluster) and the address in the head record; on a node's, the
//! node's own certificate and the head address it joined.

mod actor_errors;
mod actors;
mod spawn;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

pub use crate::status::{
    ActorStatus, ClusterStatus, GpuStatus, NodeStatus, ReservationStatus, StatusTotals,
};
pub use actor_errors::ActorCallError;
pub use actors::{ActorOutput, ActorRef};
pub use spawn::{ActorEvent, ActorEvents, SpawnOptions};

use crate::actor::ActorId;
use crate::daemon::{CONNECT_TIMEOUT, DaemonError, message_name, resolve};
use crate::state::{
    CLIENT_DIR, HEAD_RECORD, HeadRecord, NODE_DIR, NODE_RECORD, NodeRecord, StateDir,
};
use crate::tls::{CaCertificate, ClientTls, NodeCredentials};
use crate::transport::{Client, Connection, TransportError, TransportOptions};
use crate::wire::Message;

/// How long a client waits for the head's answer; a stop of the whole cluster waits for
/// every node's confirmation first.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

/// A connection to the head, and to the nodes of the actors reached through it. Cheap to
/// clone (clones share the connections). The actors it spawns live while its connection
/// to the head does: dropping the client and every [`ActorRef`] from it kills them.
#[derive(Debug, Clone)]
pub struct ClusterClient {
    inner: Arc<ClientInner>,
}

/// What a client and its actor handles share.
#[derive(Debug)]
pub(crate) struct ClientInner {
    connection: Connection,
    head: String,
    tls: ClientTls,
    /// Connections to nodes, by address.
    nodes: Mutex<HashMap<String, Connection>>,
    /// Actors that events showed restarting, restarted or failed since a handle last
    /// asked where they run: their handles ask the head before the next message, rather
    /// than send it to a node that may be gone.
    moved: Mutex<HashSet<ActorId>>,
    next_call: AtomicU64,
}

/// Why no connection to a node was had.
pub(crate) enum NodeLink {
    /// The one cached had ended: the node stopped or was lost (it is forgotten now).
    Closed,
    /// A new one could not be made.
    Failed(String),
}

impl ClusterClient {
    /// Connects to the head with the credentials in `state`: the head's `client`
    /// certificate and its record when this machine runs the head, else the node's
    /// certificate and the head it joined. `head` overrides the address of the records.
    pub async fn connect(state: &StateDir, head: Option<&str>) -> Result<Self, DaemonError> {
        let head_record: Option<HeadRecord> = state.read_record(HEAD_RECORD)?;
        let node_record: Option<NodeRecord> = state.read_record(NODE_RECORD)?;
        let client = load_credentials(state, CLIENT_DIR);
        let node = load_credentials(state, NODE_DIR);
        let (address, (ca, credentials)) = match head {
            Some(address) => match client.or(node) {
                Some(credentials) => (address.to_owned(), credentials),
                None => {
                    return Err(DaemonError::NoCredentials {
                        dir: state.root().to_owned(),
                    });
                }
            },
            None => match (head_record, client, node_record, node) {
                (Some(record), Some(credentials), _, _) => (record.address, credentials),
                (_, _, Some(record), Some(credentials)) => (record.head, credentials),
                _ => {
                    return Err(DaemonError::NoHead {
                        dir: state.path("head"),
                    });
                }
            },
        };
        let peer = resolve(&address).await?;
        let tls =
            ClientTls::mutual(&ca, &credentials).map_err(|source| DaemonError::Credentials {
                dir: state.root().to_owned(),
                source,
            })?;
        let options = TransportOptions::default();
        let connecting = Client::connect_with(peer, &tls, &options);
        let connection = tokio::time::timeout(CONNECT_TIMEOUT, connecting)
            .await
            .map_err(|_| DaemonError::Unreachable {
                head: address.clone(),
                after: CONNECT_TIMEOUT,
            })?
            .map_err(|source| request_error(&address, source))?;
        Ok(ClusterClient {
            inner: Arc::new(ClientInner {
                connection,
                head: address,
                tls,
                nodes: Mutex::default(),
                moved: Mutex::default(),
                next_call: AtomicU64::new(1),
            }),
        })
    }

    /// The state of the cluster.
    pub async fn status(&self) -> Result<ClusterStatus, DaemonError> {
        let inner = &self.inner;
        match inner
            .request_head(&Message::StatusRequest, REQUEST_TIMEOUT)
            .await?
        {
            Message::StatusReply { status } => {
                ClusterStatus::from_wire(status).map_err(|what| DaemonError::UnexpectedReply {
                    peer: inner.head.clone(),
                    what,
                })
            }
            other => Err(inner.unexpected(other)),
        }
    }

    /// Stops the head; with `all`, the head stops every node first. Only the head's
    /// machine may do this.
    pub async fn stop(&self, all: bool) -> Result<(), DaemonError> {
        let inner = &self.inner;
        match inner
            .connection
            .request(&Message::StopRequest { all }, REQUEST_TIMEOUT)
            .await
        {
            Ok(Message::Ack) => Ok(()),
            // The head closed its port as it stopped, before its answer arrived.
            Err(TransportError::Closed {
                source: quinn::ConnectionError::ApplicationClosed(_),
                ..
            }) => Ok(()),
            Ok(other) => Err(inner.unexpected(other)),
            Err(source) => Err(request_error(&inner.head, source)),
        }
    }

    /// The connection to the head, for other requests.
    pub fn connection(&self) -> &Connection {
        &self.inner.connection
    }

    /// The head's address.
    pub fn head(&self) -> &str {
        &self.inner.head
    }
}

impl ClientInner {
    async fn request_head(
        &self,
        request: &Message,
        timeout: Duration,
    ) -> Result<Message, DaemonError> {
        self.connection
            .request(request, timeout)
            .await
            .map_err(|source| request_error(&self.head, source))
    }

    /// A connection to the node at `address`: the cached one, or a new one made within
    /// `within` (at most [`CONNECT_TIMEOUT`]). A cached one that has ended is
    /// [`NodeLink::Closed`] (and stays cached, so that every handle on that node asks the
    /// head where its actor went) unless `fresh`, which connects again.
    async fn node(
        &self,
        address: &str,
        within: Duration,
        fresh: bool,
    ) -> Result<Connection, NodeLink> {
        {
            let mut nodes = self.lock_nodes();
            if let Some(connection) = nodes.get(address) {
                if !connection.is_closed() {
                    return Ok(connection.clone());
                }
                if !fresh {
                    return Err(NodeLink::Closed);
                }
                nodes.remove(address);
            }
        }
        if address.is_empty() {
            return Err(NodeLink::Failed("its node is not known".to_owned()));
        }
        let peer = resolve(address)
            .await
            .map_err(|error| NodeLink::Failed(error.to_string()))?;
        let within = within.min(CONNECT_TIMEOUT);
        let options = TransportOptions::default();
        let connecting = Client::connect_with(peer, &self.tls, &options);
        let connection = match tokio::time::timeout(within, connecting).await {
            Ok(Ok(connection)) => connection,
            Ok(Err(error)) => return Err(NodeLink::Failed(error.to_string())),
            Err(_) => return Err(NodeLink::Failed(format!("no answer within {within:?}"))),
        };
        // Another task may have connected meanwhile: use one connection per node.
        let mut nodes = self.lock_nodes();
        let cached = nodes
            .entry(address.to_owned())
            .or_insert_with(|| connection.clone());
        if cached.is_closed() {
            *cached = connection;
        }
        Ok(cached.clone())
    }

    /// Notes that `actor` moved or ended, as an event said.
    pub(crate) fn mark_moved(&self, actor: ActorId) {
        self.moved
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(actor);
    }

    /// Whether an event said `actor` moved or ended since this was last asked.
    pub(crate) fn take_moved(&self, actor: ActorId) -> bool {
        self.moved
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&actor)
    }

    fn lock_nodes(&self) -> MutexGuard<'_, HashMap<String, Connection>> {
        // A map of connections: consistent after every statement.
        self.nodes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The error for an answer that is not the one expected.
    fn unexpected(&self, answer: Message) -> DaemonError {
        let head = self.head.clone();
        match answer {
            Message::Refused { reason } => DaemonError::Refused { head, reason },
            Message::Error { message } => DaemonError::Remote { head, message },
            other => DaemonError::UnexpectedReply {
                peer: head,
                what: message_name(&other).to_owned(),
            },
        }
    }
}

/// The CA certificate and credentials in `state/dir`, if both are there and readable.
fn load_credentials(state: &StateDir, dir: &str) -> Option<(CaCertificate, NodeCredentials)> {
    let dir: PathBuf = state.path(dir);
    Some((
        CaCertificate::load(&dir).ok()?,
        NodeCredentials::load(&dir).ok()?,
    ))
}

fn request_error(head: &str, source: TransportError) -> DaemonError {
    match source {
        TransportError::Timeout { after, .. } => DaemonError::Unreachable {
            head: head.to_owned(),
            after,
        },
        source => DaemonError::Request {
            peer: head.to_owned(),
            source: Box::new(source),
        },
    }
}
