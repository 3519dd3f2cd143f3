//! The node daemon: joins the head, keeps its session alive with heartbeats, and serves
//! the head (and, through the actor layer, everyone in the cluster) on its own port.
//!
//! [`Node::start`] joins with the token on a connection without certificate, or with the
//! certificate from an earlier join when the state folder holds one of the pinned CA (the
//! certificate's name is the node's key at the head, so it keeps its node id). It saves
//! the credentials the head hands out in `node/` (mode 0600), binds its port with them, and
//! spawns three tasks: the server ([`handle`]), the heartbeat loop ([`heartbeat`]), which
//! reconnects and joins again on its own when the head restarts or forgets it, and the
//! reports of ended actors to the head. A thread of its own measures the GPUs NVML found
//! (`gpu/sampler.rs`); each heartbeat carries the newest measurement.
//!
//! The server's port is on a thread of its own ([`Server::bind_on_thread`]), where every
//! request is answered, and where the tasks that drive worker processes run (a start
//! spawns them): an actor's answer, from its actix thread or its worker's socket, wakes
//! that one thread, not the workers of a multi-threaded runtime, which on a few busy cores
//! wake each other for nothing (`transport/thread.rs`). The thread ends once the port is
//! closed and its connections are gone; the worker processes then see their socket close
//! and exit, as when the daemon exits. The heartbeats and the reports of ended actors run
//! on the runtime that started the node.
//!
//! Actors: `actors.rs` hosts the node's actors ([`NodeConfig::actors`]) and answers actor
//! requests (starts and stops from the head, calls and tells from anyone in the cluster),
//! and reports each actor that ended to the head. [`Node::set_actor_handler`] replaces it.

mod heartbeat;
mod join;
mod report;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tracing::{Instrument, info, info_span, warn};

pub use crate::hosting::ActorHosting;

use crate::actor::ClusterAccess;
use crate::daemon::{
    ActorHandler, DaemonError, HEAD_NAME, STOP_LINGER, advertised_address, is_control,
    message_name, refused, resolve, resources_wire,
};
use crate::gpu::GpuSampler;
use crate::hosting::NodeActors;
use crate::lifecycle::Lifecycle;
use crate::membership::{NodeId, SessionId};
use crate::resources::NodeResources;
use crate::state::{NODE_RECORD, NodeRecord, StateDir};
use crate::tls::{CaHash, ClientTls, JoinToken, ServerTls};
use crate::transport::{Connection, Peer, Server, TransportError, TransportOptions};
use crate::wire::{BeatKey, Message, NodeDescription};

/// How long a node leaving waits for the head to acknowledge.
const LEAVE_TIMEOUT: Duration = Duration::from_secs(2);

/// How to start a node.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// The head's `ip:port` or `host:port`.
    pub head: String,
    pub token: JoinToken,
    /// The pinned hash of the cluster CA: the node trusts no other head.
    pub ca_hash: CaHash,
    /// Where to listen (`0.0.0.0:0` by default: any free port).
    pub bind: SocketAddr,
    /// The address the head and others use to reach this node (`ip`, `ip:port`,
    /// `host[:port]`); by default the bound address when it is specific, else the
    /// address of this machine on its route to the head.
    pub advertise: Option<String>,
    pub state: StateDir,
    pub resources: NodeResources,
    pub transport: TransportOptions,
    /// The kinds of actor the node hosts and how it starts worker processes.
    pub actors: ActorHosting,
}

/// A running node. Dropping it without [`Node::stop`] is like killing the process: its
/// port closes and the head hears no more heartbeats, nor a goodbye.
#[derive(Debug)]
pub struct Node {
    shared: Arc<Shared>,
}

/// The node's current membership, as the head last accepted it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Session {
    pub(crate) node_id: NodeId,
    pub(crate) session: SessionId,
    pub(crate) heartbeat_ms: u64,
    pub(crate) dead_after_ms: u64,
    /// Where and with which key to send UDP heartbeats; `None`: over QUIC only.
    pub(crate) beat: Option<BeatLink>,
}

/// The head's heartbeat port and this session's key (`wire::beat`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BeatLink {
    pub(crate) port: u16,
    pub(crate) key: BeatKey,
}

/// What the node's tasks share.
pub(crate) struct Shared {
    head: SocketAddr,
    /// The head's address as given, for messages and the record.
    head_text: String,
    description: NodeDescription,
    state: StateDir,
    ca_hash: CaHash,
    tls: ClientTls,
    server: Server,
    local_addr: SocketAddr,
    session: Mutex<Session>,
    /// The connection to the head, once made (heartbeats, rejoins, leave).
    connection: Mutex<Option<Connection>>,
    life: Lifecycle,
    /// The node's own actors, which it fences when its session ends.
    actors: Arc<NodeActors>,
    /// What the node's GPUs are doing, which every heartbeat carries.
    gpus: GpuSampler,
}

impl Node {
    /// Joins the head, saves the credentials it hands out, binds, and starts heartbeats.
    /// Fails within [`crate::CONNECT_TIMEOUT`] or so on a wrong token, a wrong CA hash or
    /// an unreachable head, each with its own [`DaemonError`].
    pub async fn start(config: NodeConfig) -> Result<Node, DaemonError> {
        let head = resolve(&config.head).await?;
        // Before the join: a node that cannot host actors does not join.
        let (actors, exits) = NodeActors::new(
            config.actors.clone(),
            config.bind.ip(),
            ClusterAccess {
                state_dir: config.state.root().to_path_buf(),
                head: config.head.clone(),
            },
        )?;
        let listen = listen_address(config.bind)?;
        let address = advertised_address(listen, config.advertise.as_deref(), head)?;
        let description = NodeDescription {
            hostname: config
                .resources
                .hostname
                .clone()
                .unwrap_or_else(|| "unknown".to_owned()),
            address: address.clone(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            resources: resources_wire(&config.resources),
        };
        let stored = join::stored_credentials(&config.state, config.ca_hash);
        let joined = join::first_join(&config, head, stored, &description).await?;
        joined.save(&config.state)?;
        let server_tls = ServerTls::node(&joined.ca, &joined.credentials)?;
        let tls = ClientTls::mutual(&joined.ca, &joined.credentials)?;
        let server = Server::bind_on_thread(
            listen,
            &server_tls,
            config.transport.clone(),
            "imgrun-node-quic",
        )
        .map_err(|source| DaemonError::Listen {
            address: listen,
            source: Box::new(source),
        })?;
        let local_addr = server.local_addr().map_err(|source| DaemonError::Listen {
            address: listen,
            source: Box::new(source),
        })?;
        let shared = Arc::new(Shared {
            head,
            head_text: config.head,
            description,
            state: config.state,
            ca_hash: config.ca_hash,
            tls,
            server,
            local_addr,
            session: Mutex::new(joined.session),
            connection: Mutex::new(None),
            life: Lifecycle::new(Some(actor_handler(actors.clone()))),
            actors: actors.clone(),
            gpus: GpuSampler::start(&config.resources.gpus),
        });
        shared.write_record()?;
        let span = info_span!("node", address = %address);
        let serving = {
            let shared = shared.clone();
            let handler_shared = shared.clone();
            tokio::spawn(
                async move {
                    let handler =
                        move |peer, request| handle(handler_shared.clone(), peer, request);
                    shared.server.accept_loop(handler).await;
                }
                .instrument(span.clone()),
            )
        };
        let beating = tokio::spawn(heartbeat::run(shared.clone()).instrument(span.clone()));
        let reporting =
            tokio::spawn(report::report_exits(shared.clone(), actors, exits).instrument(span));
        shared.life.track([
            serving.abort_handle(),
            beating.abort_handle(),
            reporting.abort_handle(),
        ]);
        info!(
            node = %joined.session.node_id,
            session = %joined.session.session,
            head = %shared.head_text,
            %address,
            "node joined the cluster"
        );
        Ok(Node { shared })
    }

    /// The id the head gave this node (it may change when the head restarts).
    pub fn node_id(&self) -> NodeId {
        self.shared.session().node_id
    }

    /// The current session at the head.
    pub fn session(&self) -> SessionId {
        self.shared.session().session
    }

    /// The address the node listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.local_addr
    }

    /// The address the node told the head.
    pub fn address(&self) -> &str {
        &self.shared.description.address
    }

    /// Resolves once the node stopped: the head told it to, or [`Node::stop`] was called.
    pub async fn stopped(&self) {
        self.shared.life.stopped().await;
    }

    /// Stops gracefully: tells the head it leaves (so its resources are released at once
    /// rather than after the dead window), then closes its port.
    pub async fn stop(&self) {
        if self.shared.life.is_closed() {
            return;
        }
        self.shared.life.abort_tasks();
        self.shared.leave().await;
        self.shared.shutdown();
    }

    /// Routes actor requests (every message outside the control protocol) to `handler`;
    /// until then they are answered with an error. Every peer of a node is authenticated.
    pub fn set_actor_handler(&self, handler: Arc<dyn ActorHandler>) {
        self.shared.life.set_actor_handler(handler);
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.shared.life.abort_tasks();
        self.shared.server.close();
    }
}

impl Shared {
    pub(crate) fn session(&self) -> Session {
        *self.session.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records a new session (after a rejoin); the record follows a changed node id.
    fn set_session(&self, session: Session) {
        let previous = std::mem::replace(
            &mut *self.session.lock().unwrap_or_else(PoisonError::into_inner),
            session,
        );
        if previous.node_id != session.node_id
            && let Err(error) = self.write_record()
        {
            warn!(%error, "cannot update the node record");
        }
    }

    fn write_record(&self) -> Result<(), DaemonError> {
        let record = NodeRecord {
            head: self.head_text.clone(),
            node_id: self.session().node_id.0,
            address: self.description.address.clone(),
            ca_hash: self.ca_hash.to_string(),
        };
        Ok(self.state.write_record(NODE_RECORD, &record)?)
    }

    /// The connection to the head, made from the node's port when there is none.
    async fn connection(&self, timeout: Duration) -> Result<Connection, TransportError> {
        if let Some(connection) = self.lock_connection().clone() {
            // A connection the head closed (it restarted) is made again at once.
            if !connection.is_closed() {
                return Ok(connection);
            }
        }
        let connection = tokio::time::timeout(timeout, self.server.connect(self.head, &self.tls))
            .await
            .map_err(|_| TransportError::Timeout {
                peer: self.head,
                after: timeout,
            })??;
        *self.lock_connection() = Some(connection.clone());
        Ok(connection)
    }

    /// Drops the connection to the head, so that the next request makes a new one.
    fn forget_connection(&self) {
        if let Some(connection) = self.lock_connection().take() {
            connection.close();
        }
    }

    /// Tells the head this node leaves (connecting first if no connection is open: the
    /// heartbeats go over UDP); never fails.
    async fn leave(&self) {
        let connection = match self.connection(LEAVE_TIMEOUT).await {
            Ok(connection) => connection,
            Err(error) => {
                warn!(%error, "cannot tell the head this node leaves");
                return;
            }
        };
        let session = self.session();
        let leave = Message::Leave {
            node_id: session.node_id.0,
            session: session.session.0,
        };
        match connection.request(&leave, LEAVE_TIMEOUT).await {
            Ok(Message::Ack) => info!(node = %session.node_id, "left the cluster"),
            Ok(other) => warn!(
                answer = message_name(&other),
                "the head did not take the leave"
            ),
            Err(error) => warn!(%error, "cannot tell the head this node leaves"),
        }
    }

    /// Closes the port and says so; only the first call does anything.
    fn shutdown(&self) {
        if !self.life.close() {
            return;
        }
        self.forget_connection();
        self.server.close();
        info!(node = %self.session().node_id, "node stopped");
        self.life.stopped_now();
    }

    /// Stops after [`STOP_LINGER`], once the answer to the stop request is on its way.
    fn shutdown_after_reply(self: &Arc<Self>) {
        let shared = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(STOP_LINGER).await;
            shared.shutdown();
        });
    }

    fn actor_handler(&self) -> Option<Arc<dyn ActorHandler>> {
        self.life.actor_handler()
    }

    fn lock_connection(&self) -> MutexGuard<'_, Option<Connection>> {
        self.connection
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("head", &self.head_text)
            .field("address", &self.description.address)
            .field("session", &self.session())
            .finish_non_exhaustive()
    }
}

/// Answers a request to the node: a stop from the head, actor requests through the actor
/// handler, and nothing else. Runs on the server's thread.
async fn handle(shared: Arc<Shared>, peer: Peer, request: Message) -> Message {
    match request {
        Message::StopRequest { .. } if peer.name() == Some(HEAD_NAME) => {
            info!(peer = %peer.address, "the head asked this node to stop");
            shared.shutdown_after_reply();
            Message::Ack
        }
        Message::StopRequest { .. } => {
            warn!(peer = %peer.address, name = peer.name(), "refused a stop request");
            refused("only the head may stop a node")
        }
        request if is_control(&request) => refused(format!(
            "a node does not serve a {}",
            message_name(&request)
        )),
        request => match shared.actor_handler() {
            Some(handler) => handler.handle(peer, request).await,
            None => Message::Error {
                message: "no actor runtime on this node".to_owned(),
            },
        },
    }
}

/// The node's own actor handler: its actors answer calls and tells from anyone, starts and
/// stops from the head.
fn actor_handler(actors: Arc<NodeActors>) -> Arc<dyn ActorHandler> {
    Arc::new(move |peer: Peer, request: Message| {
        let actors = actors.clone();
        async move {
            let from_head = peer.name() == Some(HEAD_NAME);
            let name = message_name(&request);
            match actors.serve(&peer, request, from_head).await {
                Some(answer) => answer,
                None => refused(format!("a node does not serve {name} requests")),
            }
        }
    })
}

/// `bind`, with a free port chosen now when it asks for any: the node must tell the head
/// its address before it has the certificate to bind its server with. (Another process
/// could take the port in between; binding then fails with a clear error.)
fn listen_address(bind: SocketAddr) -> Result<SocketAddr, DaemonError> {
    if bind.port() != 0 {
        return Ok(bind);
    }
    let listen_error = |source| DaemonError::Listen {
        address: bind,
        source: Box::new(TransportError::Bind {
            address: bind,
            source,
        }),
    };
    let probe = std::net::UdpSocket::bind(bind).map_err(listen_error)?;
    probe.local_addr().map_err(listen_error)
}
