//! The head daemon: the cluster's CA, its membership and its resource table, served over
//! QUIC on one UDP port.
//!
//! [`Head::start`] loads the CA and the join token from the state folder (or creates them
//! on first start, so a restarted head is the same cluster and its nodes come back), binds,
//! registers the head itself as a node with its resources, and spawns two tasks: the
//! server ([`handler`] answers every request, deciding first who may ask what) and the
//! ticker, which sleeps until membership's next deadline and ends the sessions of silent
//! nodes there; and a thread on a UDP port of its own for the nodes' heartbeats
//! ([`beats`], each beat tagged with its session's key). Membership and placement stay
//! pure; [`members::Members`] is the thin driver that passes them the time and keeps the
//! table in step with the sessions (and each session's heartbeat key).
//!
//! The actor layer (`actors.rs`) runs the cluster's actor directory on these: node
//! events from [`Head::subscribe`] (with the reservations a lost node held), the
//! [`Head::resource_table`], connections to nodes; and it hosts the head's own actors
//! ([`HeadConfig::actors`]). [`Head::set_actor_handler`] replaces it.

mod actors;
mod beats;
mod credentials;
mod handler;
mod members;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::broadcast;
use tracing::{Instrument, info, info_span, warn};

pub use beats::BeatCounts;
pub use credentials::{WebTls, preset_credentials, web_tls};
pub use members::{ClusterEvent, LossReason};

use crate::actor::ClusterAccess;
use crate::daemon::{
    ActorHandler, CONNECT_TIMEOUT, DaemonError, PUBLIC_PROBE, STOP_LINGER, advertised_address,
    resolve, resources_wire,
};
use crate::gpu::GpuSampler;
use crate::hosting::ActorHosting;
use crate::hosting::NodeActors;
use crate::lifecycle::Lifecycle;
use crate::membership::{MembershipConfig, NodeId, SessionId};
use crate::placement::ResourceTable;
use crate::resources::NodeResources;
use crate::state::{HEAD_RECORD, HeadRecord, StateDir};
use crate::status::ClusterStatus;
use crate::tls::{CaHash, ClientTls, ClusterCa, JoinToken, ServerTls};
use crate::transport::{Connection, Server, TransportError, TransportOptions};
use crate::wire::NodeDescription;
use members::Members;

/// How long the head tries to bind a port that is still held: a head restarted in the same
/// process finds its previous socket closing for a moment.
const BIND_RETRY: Duration = Duration::from_secs(3);

/// How to start a head.
#[derive(Debug, Clone)]
pub struct HeadConfig {
    /// Where to listen, e.g. `0.0.0.0:7070` (port 0: any free port).
    pub bind: SocketAddr,
    /// The address nodes use to reach the head (`ip`, `ip:port`, `host[:port]`); by
    /// default the bound address when it is specific, else this machine's address on its
    /// default route, else 127.0.0.1.
    pub advertise: Option<String>,
    pub state: StateDir,
    /// What the head offers as a node of its own (as in Ray, the head also runs work).
    pub resources: NodeResources,
    pub membership: MembershipConfig,
    pub transport: TransportOptions,
    /// The kinds of actor the head hosts as a node, and how it starts worker processes.
    pub actors: ActorHosting,
    /// The UDP port of the nodes' heartbeats, on the bound address; 0: any free port (a
    /// port that cannot be bound then only costs a warning, and nodes beat over QUIC).
    /// Behind a firewall or NAT, give one and let it through: a node that cannot reach
    /// it beats over QUIC, which costs the head more.
    pub beat_port: u16,
}

impl HeadConfig {
    /// A head on this machine only: any free port on 127.0.0.1, its heartbeats on any
    /// free UDP port, default membership, transport and actor hosting. The embedded
    /// cluster, the tests and the benchmarks start from it and change what they need
    /// (`HeadConfig { membership, ..HeadConfig::loopback(state, resources) }`).
    pub fn loopback(state: StateDir, resources: NodeResources) -> HeadConfig {
        HeadConfig {
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            state,
            resources,
            membership: MembershipConfig::default(),
            transport: TransportOptions::default(),
            actors: ActorHosting::default(),
            beat_port: 0,
        }
    }
}

/// A running head. Dropping it without [`Head::stop`] is like killing the process: its
/// port closes, its record stays in the state folder.
#[derive(Debug)]
pub struct Head {
    shared: Arc<Shared>,
}

/// What the head's tasks share.
pub(crate) struct Shared {
    members: Members,
    ca: ClusterCa,
    token: JoinToken,
    /// The head's own certificate as a client, to reach nodes.
    own_tls: ClientTls,
    server: Server,
    local_addr: SocketAddr,
    join_address: String,
    state: StateDir,
    /// The UDP port of heartbeats (`beats.rs`); 0 if it could not be bound.
    beat_port: u16,
    beat_counters: beats::BeatCounters,
    /// Set on the first stop request: later requests are refused.
    stopping: AtomicBool,
    life: Lifecycle,
}

impl Head {
    /// Loads or creates the cluster's credentials in `config.state` (`head/`), binds,
    /// writes the head record (`head/head.json`), registers the head as a node and starts
    /// serving. Also (re)issues the certificate that commands on this machine use
    /// (`client/`, common name `client`).
    pub async fn start(config: HeadConfig) -> Result<Head, DaemonError> {
        config.membership.validate()?;
        let credentials = credentials::load_or_create(&config.state)?;
        let server_tls = ServerTls::head(credentials.ca.certificate(), &credentials.head)?;
        let own_tls = ClientTls::mutual(credentials.ca.certificate(), &credentials.head)?;
        let server = bind(config.bind, &server_tls, &config.transport).await?;
        let beat_socket = bind_beats(&config).await?;
        let local_addr = server.local_addr().map_err(|source| DaemonError::Listen {
            address: config.bind,
            source: Box::new(source),
        })?;
        let join_address =
            advertised_address(local_addr, config.advertise.as_deref(), PUBLIC_PROBE)?;
        let own = NodeDescription {
            hostname: config
                .resources
                .hostname
                .clone()
                .unwrap_or_else(|| "unknown".to_owned()),
            address: join_address.clone(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            resources: resources_wire(&config.resources),
        };
        let (own_actors, own_exits) = NodeActors::new(
            config.actors,
            config.bind.ip(),
            ClusterAccess {
                state_dir: config.state.root().to_path_buf(),
                head: join_address.clone(),
            },
        )?;
        let own_gpus = GpuSampler::start(&config.resources.gpus);
        let members = Members::new(config.membership, own, first_session(), own_gpus);
        let record = HeadRecord {
            address: join_address.clone(),
            ca_hash: credentials.ca.ca_hash().to_string(),
            pid: std::process::id(),
            started: unix_seconds(),
        };
        config.state.write_record(HEAD_RECORD, &record)?;
        let beat_port = beat_socket
            .as_ref()
            .and_then(|socket| socket.local_addr().ok())
            .map_or(0, |address| address.port());
        let shared = Arc::new(Shared {
            members,
            ca: credentials.ca,
            token: credentials.token,
            own_tls,
            server,
            local_addr,
            join_address,
            state: config.state,
            beat_port,
            beat_counters: beats::BeatCounters::default(),
            stopping: AtomicBool::new(false),
            life: Lifecycle::new(None),
        });
        let span = info_span!("head", address = %shared.join_address);
        let actor_tasks = {
            let _entered = span.enter();
            actors::HeadActors::start(&shared, own_actors, own_exits)
        };
        let serving = {
            let shared = shared.clone();
            let handler = handler::Requests(shared.clone());
            tokio::spawn(
                async move { shared.server.accept_loop(handler).await }.instrument(span.clone()),
            )
        };
        let ticking = tokio::spawn(run_ticker(shared.clone()).instrument(span));
        if let Some(socket) = beat_socket
            && let Err(error) = beats::spawn(socket, Arc::downgrade(&shared))
        {
            warn!(%error, "cannot start the heartbeat thread; its port answers nothing");
        }
        shared
            .life
            .track([serving.abort_handle(), ticking.abort_handle()]);
        shared.life.track(actor_tasks);
        info!(
            address = %shared.join_address,
            bound = %shared.local_addr,
            ca_hash = %shared.ca.ca_hash(),
            node = %shared.members.own_id(),
            "head started"
        );
        Ok(Head { shared })
    }

    /// The address the head listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.local_addr
    }

    /// The address nodes join (`ip:port`), as advertised.
    pub fn join_address(&self) -> String {
        self.shared.join_address.clone()
    }

    pub fn token(&self) -> &JoinToken {
        &self.shared.token
    }

    pub fn ca_hash(&self) -> CaHash {
        self.shared.ca.ca_hash()
    }

    /// `imgrun join <address> --token <token> --ca-hash <sha256:...>`.
    pub fn join_command(&self) -> String {
        format!(
            "imgrun join {} --token {} --ca-hash {}",
            self.shared.join_address,
            self.shared.token.as_str(),
            self.shared.ca.ca_hash()
        )
    }

    /// The UDP port of heartbeats (0: none, nodes beat over QUIC).
    pub fn beat_port(&self) -> u16 {
        self.shared.beat_port
    }

    /// What the heartbeat port received and refused so far.
    pub fn beat_counts(&self) -> BeatCounts {
        self.shared.beat_counters.counts()
    }

    /// The head's own node id.
    pub fn node_id(&self) -> NodeId {
        self.shared.members.own_id()
    }

    /// Resolves once the head stopped: a stop request was served or [`Head::stop`] called.
    pub async fn stopped(&self) {
        self.shared.life.stopped().await;
    }

    /// Stops gracefully: closes the port (nodes lose their connection and keep trying to
    /// reconnect) and removes the head record. Does not stop the nodes.
    pub async fn stop(&self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        self.shared.shutdown();
    }

    /// The state of the cluster, as clients get it.
    pub fn status(&self) -> ClusterStatus {
        let actors = self
            .shared
            .actor_handler()
            .map(|handler| handler.actors())
            .unwrap_or_default();
        self.shared.members.status().with_actors(actors)
    }

    /// Node events (joins, suspicions, losses with the reservations lost), from now on.
    /// A receiver that falls more than 1024 events behind gets `Lagged` and should read
    /// [`Head::status`] again.
    pub fn subscribe(&self) -> broadcast::Receiver<ClusterEvent> {
        self.shared.members.subscribe()
    }

    /// The resource table, in which the actor layer reserves. The head adds a node when
    /// its session starts and removes it when it ends.
    pub fn resource_table(&self) -> Arc<ResourceTable> {
        self.shared.members.table()
    }

    /// The head's clock: milliseconds since it started, as membership sees them.
    pub fn now_ms(&self) -> u64 {
        self.shared.members.now_ms()
    }

    /// The current session of a node whose session is on, and its address.
    pub fn live_node(&self, node: NodeId) -> Option<(SessionId, String)> {
        self.shared.members.live_node(node)
    }

    /// A mutually authenticated connection from the head's port to a live node, for
    /// actor requests; the node sees the peer name `head`.
    pub async fn connect_node(&self, node: NodeId) -> Result<Connection, DaemonError> {
        let (_, address) = self
            .live_node(node)
            .ok_or(DaemonError::UnknownNode { node: node.0 })?;
        self.shared.connect(&address).await
    }

    /// Routes actor requests (every message outside the control protocol) from
    /// authenticated peers to `handler`; until then they are answered with an error.
    pub fn set_actor_handler(&self, handler: Arc<dyn ActorHandler>) {
        self.shared.life.set_actor_handler(handler);
    }
}

impl Drop for Head {
    fn drop(&mut self) {
        self.shared.life.abort_tasks();
        self.shared.server.close();
    }
}

impl Shared {
    /// Closes the port, removes the record and says so; only the first call does anything.
    fn shutdown(&self) {
        if !self.life.close() {
            return;
        }
        self.server.close();
        if let Err(error) = self.state.remove(HEAD_RECORD) {
            warn!(%error, "cannot remove the head record");
        }
        info!(address = %self.join_address, "head stopped");
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

    fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// Connects from the head's port to a daemon at `address` with the head's certificate.
    async fn connect(&self, address: &str) -> Result<Connection, DaemonError> {
        let peer = resolve(address).await?;
        let request_error = |source| DaemonError::Request {
            peer: address.to_owned(),
            source: Box::new(source),
        };
        tokio::time::timeout(CONNECT_TIMEOUT, self.server.connect(peer, &self.own_tls))
            .await
            .map_err(|_| {
                request_error(TransportError::Timeout {
                    peer,
                    after: CONNECT_TIMEOUT,
                })
            })?
            .map_err(request_error)
    }

    fn actor_handler(&self) -> Option<Arc<dyn ActorHandler>> {
        self.life.actor_handler()
    }
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Head")
            .field("address", &self.join_address)
            .field("ca_hash", &self.ca.ca_hash())
            .finish_non_exhaustive()
    }
}

/// Sleeps until membership's next deadline (or a change), and applies the time there.
async fn run_ticker(shared: Arc<Shared>) {
    loop {
        let changed = shared.members.changed();
        let deadline = shared.members.advance();
        tokio::select! {
            () = tokio::time::sleep_until(shared.members.instant(deadline).into()) => {}
            () = changed => {}
        }
    }
}

/// Binds `address`, retrying for [`BIND_RETRY`] while a specific port is still in use.
async fn bind(
    address: SocketAddr,
    tls: &ServerTls,
    options: &TransportOptions,
) -> Result<Server, DaemonError> {
    retry_while_in_use(
        || Server::bind_with(address, tls, options.clone()),
        |error| {
            address.port() != 0
                && matches!(error, TransportError::Bind { source, .. }
                    if source.kind() == std::io::ErrorKind::AddrInUse)
        },
    )
    .await
    .map_err(|source| DaemonError::Listen {
        address,
        source: Box::new(source),
    })
}

/// Calls `bind` again while `in_use` says its error is a port still held, for up to
/// [`BIND_RETRY`]; then returns what it gave last.
async fn retry_while_in_use<T, E>(
    mut bind: impl FnMut() -> Result<T, E>,
    in_use: impl Fn(&E) -> bool,
) -> Result<T, E> {
    let deadline = tokio::time::Instant::now() + BIND_RETRY;
    let mut pause = Duration::from_millis(20);
    loop {
        match bind() {
            Err(error) if in_use(&error) && tokio::time::Instant::now() + pause < deadline => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(500));
            }
            result => return result,
        }
    }
}

/// The heartbeat port: the one asked for (its failure is the head's), else any free one
/// (its failure a warning: nodes then beat over QUIC).
async fn bind_beats(config: &HeadConfig) -> Result<Option<std::net::UdpSocket>, DaemonError> {
    let address = SocketAddr::new(config.bind.ip(), config.beat_port);
    if config.beat_port == 0 {
        return Ok(beats::bind(address)
            .inspect_err(|error| {
                warn!(%error, ip = %address.ip(), "cannot bind a heartbeat port; nodes beat over QUIC");
            })
            .ok());
    }
    if config.beat_port == config.bind.port() {
        return Err(DaemonError::BeatPort {
            address,
            reason: "it is the head's QUIC port; give another".to_owned(),
        });
    }
    retry_while_in_use(
        || beats::bind(address),
        |error| error.kind() == std::io::ErrorKind::AddrInUse,
    )
    .await
    .map(Some)
    .map_err(|error| DaemonError::BeatPort {
        address,
        reason: error.to_string(),
    })
}

/// The first membership session of this head: microseconds since the Unix epoch, so a
/// restarted head never hands out a session of its previous life again.
fn first_session() -> SessionId {
    let micros = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |since| since.as_micros());
    SessionId(u64::try_from(micros).unwrap_or(u64::MAX / 2).max(1))
}

fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs())
}
