//! Joining the head: the first join of [`super::Node::start`], which must fail fast and
//! clearly, and reading the head's answer, which rejoins share.

use std::net::SocketAddr;

use quinn::ConnectionError;
use tracing::{debug, warn};

use super::{BeatLink, NodeConfig, Session};
use crate::daemon::{CONNECT_TIMEOUT, DaemonError};
use crate::membership::{NodeId, SessionId};
use crate::state::NODE_DIR;
use crate::state::StateDir;
use crate::tls::{CaCertificate, CaHash, ClientTls, NodeCredentials};
use crate::transport::{Client, TransportError};
use crate::wire::{BeatKey, Message, NodeDescription};

/// What the head handed out.
pub(super) struct Joined {
    pub(super) session: Session,
    pub(super) ca: CaCertificate,
    pub(super) credentials: NodeCredentials,
}

impl Joined {
    /// Saves the CA certificate and the node's credentials in `node/`, mode 0600.
    pub(super) fn save(&self, state: &StateDir) -> Result<(), DaemonError> {
        let dir = state.ensure_dir(NODE_DIR)?;
        let error = |source| DaemonError::Credentials {
            dir: dir.clone(),
            source,
        };
        self.ca.save(&dir).map_err(error)?;
        self.credentials.save(&dir).map_err(error)
    }
}

/// The credentials of an earlier join, if `state` holds readable ones of the pinned CA.
pub(super) fn stored_credentials(
    state: &StateDir,
    ca_hash: CaHash,
) -> Option<(CaCertificate, NodeCredentials)> {
    let dir = state.path(NODE_DIR);
    let ca = CaCertificate::load(&dir).ok()?;
    if ca.hash() != ca_hash {
        debug!(dir = %dir.display(), "stored credentials belong to another cluster");
        return None;
    }
    match NodeCredentials::load(&dir) {
        Ok(credentials) if credentials.name().is_ok() => Some((ca, credentials)),
        Ok(_) | Err(_) => {
            warn!(dir = %dir.display(), "stored node credentials unreadable; joining as a new node");
            None
        }
    }
}

/// Joins `head` with the token, over a connection with the stored certificate when there
/// is one (the node keeps its id) or without (a new node), all within
/// [`CONNECT_TIMEOUT`] for the connection and as much again for the answer.
pub(super) async fn first_join(
    config: &NodeConfig,
    head: SocketAddr,
    stored: Option<(CaCertificate, NodeCredentials)>,
    description: &NodeDescription,
) -> Result<Joined, DaemonError> {
    let tls = match &stored {
        Some((ca, credentials)) => ClientTls::mutual(ca, credentials)?,
        None => ClientTls::join(config.ca_hash)?,
    };
    let error = |source| join_error(&config.head, config.ca_hash, source);
    let connecting = Client::connect_with(head, &tls, &config.transport);
    let connection = tokio::time::timeout(CONNECT_TIMEOUT, connecting)
        .await
        .map_err(|_| unreachable(&config.head))?
        .map_err(error)?;
    let request = Message::JoinRequest {
        token: config.token.as_str().to_owned(),
        node: description.clone(),
    };
    let reply = connection
        .request(&request, CONNECT_TIMEOUT)
        .await
        .map_err(error)?;
    connection.close();
    accepted(reply, &config.head, config.ca_hash)
}

/// Reads the head's answer to a join: the new session and credentials, after checking
/// that the CA it hands out is the pinned one.
pub(super) fn accepted(reply: Message, head: &str, ca_hash: CaHash) -> Result<Joined, DaemonError> {
    let (node_id, session, ca_cert_pem, cert_pem, key_pem, heartbeat_ms, dead_after_ms, beat) =
        match reply {
            Message::JoinAccepted {
                node_id,
                session,
                ca_cert_pem,
                cert_pem,
                key_pem,
                heartbeat_ms,
                dead_after_ms,
                beat_port,
                beat_key,
            } => (
                node_id,
                session,
                ca_cert_pem,
                cert_pem,
                key_pem,
                heartbeat_ms,
                dead_after_ms,
                // A port without a valid key (or none) means heartbeats over QUIC.
                BeatKey::from_bytes(&beat_key)
                    .filter(|_| beat_port != 0)
                    .map(|key| BeatLink {
                        port: beat_port,
                        key,
                    }),
            ),
            Message::Refused { reason } => {
                return Err(DaemonError::JoinRefused {
                    head: head.to_owned(),
                    reason,
                });
            }
            Message::Error { message } => {
                return Err(DaemonError::Remote {
                    head: head.to_owned(),
                    message,
                });
            }
            other => {
                return Err(DaemonError::UnexpectedReply {
                    peer: head.to_owned(),
                    what: crate::daemon::message_name(&other).to_owned(),
                });
            }
        };
    let ca = CaCertificate::from_pem(&ca_cert_pem)?;
    if ca.hash() != ca_hash {
        return Err(DaemonError::WrongCaHash {
            head: head.to_owned(),
            ca_hash: ca_hash.to_string(),
            reason: format!("it handed out the CA {}", ca.hash()),
        });
    }
    let credentials = NodeCredentials { cert_pem, key_pem };
    // Checks the certificate and key before anything is saved or bound with them.
    ClientTls::mutual(&ca, &credentials)?;
    if heartbeat_ms == 0 || dead_after_ms < heartbeat_ms {
        return Err(DaemonError::UnexpectedReply {
            peer: head.to_owned(),
            what: format!("heartbeat every {heartbeat_ms} ms, dead after {dead_after_ms} ms"),
        });
    }
    Ok(Joined {
        session: Session {
            node_id: NodeId(node_id),
            session: SessionId(session),
            heartbeat_ms: u64::from(heartbeat_ms),
            dead_after_ms: u64::from(dead_after_ms),
            beat,
        },
        ca,
        credentials,
    })
}

/// A failed connection or request of the first join, told apart: silence is an
/// unreachable head, a refused handshake a head that is not the pinned one.
fn join_error(head: &str, ca_hash: CaHash, error: TransportError) -> DaemonError {
    match error {
        TransportError::Timeout { .. }
        | TransportError::Handshake {
            source: ConnectionError::TimedOut,
            ..
        } => unreachable(head),
        TransportError::Handshake { source, .. } => DaemonError::WrongCaHash {
            head: head.to_owned(),
            ca_hash: ca_hash.to_string(),
            reason: source.to_string(),
        },
        source => DaemonError::Request {
            peer: head.to_owned(),
            source: Box::new(source),
        },
    }
}

fn unreachable(head: &str) -> DaemonError {
    DaemonError::Unreachable {
        head: head.to_owned(),
        after: CONNECT_TIMEOUT,
    }
}
