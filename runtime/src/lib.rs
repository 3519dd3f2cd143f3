//! imgrun's control plane.
//!
//! The head and node daemons ([`Head`], [`Node`]) and the client of a cluster
//! ([`ClusterClient`]), talking request/response over authenticated QUIC ([`transport`
//! types](Server), [`wire`] frames, [`tls`](ClusterCa) credentials); resource discovery
//! ([`discover`]), membership and failure detection ([`Membership`]) and placement
//! ([`ResourceTable`]) as pure state machines the daemons drive; and actors: hosted in a
//! daemon ([`LocalActors`]) or in worker processes ([`WorkerPool`]), placed and restarted
//! by the head, spawned and reached from anywhere through [`ClusterClient::spawn`] and
//! [`ActorRef`]; and the ring collectives trainers average gradients with
//! ([`RingGroup`]); and the data channel that streams bulk bytes between a job's
//! processes ([`channel`]). It knows nothing about tch or shards.

mod actor;
mod auth;
pub mod channel;
mod client;
mod collective;
mod daemon;
mod failpoint;
mod gpu;
mod head;
mod hosting;
pub mod launch;
mod lifecycle;
mod membership;
mod node;
mod placement;
mod private;
mod resources;
mod secret;
mod state;
mod status;
mod tls;
mod transport;
pub mod wire;

pub use actor::{
    Actor, ActorContext, ActorError, ActorEventKind, ActorExit, ActorFactory, ActorId, ActorLabel,
    ActorRegistry, ActorSpec, ClusterAccess, DEFAULT_MAILBOX_CAPACITY, ECHO_KIND, ExitReason,
    FailureOrigin, LocalActors, LocalOptions, MethodError, PoolOptions, RestartPolicy,
    WorkerCommand, WorkerPool, diagnostic_registry, worker_main,
};
pub use client::{
    ActorCallError, ActorEvent, ActorEvents, ActorOutput, ActorRef, ActorStatus, ClusterClient,
    ClusterStatus, GpuStatus, NodeStatus, ReservationStatus, SpawnOptions, StatusTotals,
};
pub use collective::{
    CollectiveError, CollectiveOptions, DEFAULT_BLOCK_BYTES, DEFAULT_CHUNK_BYTES,
    DEFAULT_INLINE_BYTES, Link, LinkPath, MixError, Mixer, RingGroup, RingPurpose, RingSecret,
    Topology, Transport, UnknownTopology, node_of_each_rank,
};
pub use daemon::{ActorHandler, ActorReply, CONNECT_TIMEOUT, DaemonError};
pub use failpoint::{FAILPOINT_EXIT, FAILPOINTS_VARIABLE, failpoint};
pub use gpu::{GpuInfo, GpuSource, MAX_CLAIMED_GPUS, VisibleDevices};
pub use head::{BeatCounts, ClusterEvent, Head, HeadConfig, LossReason, WebTls, web_tls};
pub use membership::{
    Joined, Member, Membership, MembershipConfig, MembershipError, MembershipEvent, NodeId,
    NodeState, SessionId,
};
pub use node::{ActorHosting, Node, NodeConfig};
pub use placement::{
    ClusterTotals, NodeCapacity, NodeUsage, PlacementError, Reservation, ReservationId,
    ResourceTable, Resources, Strategy,
};
pub use private::{create_private, create_private_dir, write_private};
pub use resources::{DiscoverOptions, HostResources, NodeResources, discover, discover_host};
pub use secret::{Secret, SecretPurpose};
pub use state::{DaemonRecord, DaemonRole, HeadRecord, StateDir, StateError};
pub use tls::{
    ALPN, CaCertificate, CaHash, ClientTls, ClusterCa, JoinToken, NodeCredentials, SERVER_NAME,
    ServerTls, SubjectAltName, TlsError, certificate_name,
};
pub use transport::{
    Client, Connection, Handler, Peer, PeerIdentity, Server, TransportError, TransportOptions,
};
