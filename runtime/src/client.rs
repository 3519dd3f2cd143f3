//! The cluster client behind `imgrun status` and `imgrun stop --all`, and later behind
//! the drivers that spawn actors: a mutually authenticated connection to the head, made
//! with the credentials found in this machine's state folder.
//!
//! On the head's machine it uses the `client` certificate the head issues at start (the
//! one allowed to stop the cluster) and the address in the head record; on a node's, the
//! node's own certificate and the head address it joined.

mod render;
mod status;

use std::path::PathBuf;
use std::time::Duration;

pub use status::{ClusterStatus, GpuStatus, NodeStatus, ReservationStatus, StatusTotals};

use crate::daemon::{CONNECT_TIMEOUT, DaemonError, message_name, resolve};
use crate::head::{CLIENT_DIR, HEAD_RECORD};
use crate::node::{NODE_DIR, NODE_RECORD, NodeRecord};
use crate::state::{HeadRecord, StateDir};
use crate::tls::{CaCertificate, ClientTls, NodeCredentials};
use crate::transport::{Client, Connection, TransportError, TransportOptions};
use crate::wire::Message;

/// How long a client waits for the head's answer; a stop of the whole cluster waits for
/// every node's confirmation first.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

/// A connection to the head.
#[derive(Debug)]
pub struct ClusterClient {
    connection: Connection,
    head: String,
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
            connection,
            head: address,
        })
    }

    /// The state of the cluster.
    pub async fn status(&self) -> Result<ClusterStatus, DaemonError> {
        match self.request(&Message::StatusRequest).await? {
            Message::StatusReply { status } => {
                ClusterStatus::from_wire(status).map_err(|what| DaemonError::UnexpectedReply {
                    peer: self.head.clone(),
                    what,
                })
            }
            other => Err(self.unexpected(other)),
        }
    }

    /// Stops the head; with `all`, the head stops every node first. Only the head's
    /// machine may do this.
    pub async fn stop(&self, all: bool) -> Result<(), DaemonError> {
        match self
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
            Ok(other) => Err(self.unexpected(other)),
            Err(source) => Err(request_error(&self.head, source)),
        }
    }

    /// The connection, for other requests (actors).
    pub fn connection(&self) -> &Connection {
        &self.connection
    }

    /// The head's address.
    pub fn head(&self) -> &str {
        &self.head
    }

    async fn request(&self, request: &Message) -> Result<Message, DaemonError> {
        self.connection
            .request(request, REQUEST_TIMEOUT)
            .await
            .map_err(|source| request_error(&self.head, source))
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
