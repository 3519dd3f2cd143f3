//! imgrun's control plane.
//!
//! Today this crate discovers the resources of the machine it runs on (cores, memory);
//! the cluster (head, nodes, QUIC transport, membership and actors) grows here next.
//! It knows nothing about tch or shards.

mod gpu;
mod membership;
mod placement;
mod resources;
mod state;
mod tls;
mod transport;
pub mod wire;

pub use gpu::{GpuInfo, GpuSource, MAX_CLAIMED_GPUS, VisibleDevices};
pub use membership::{
    Joined, Member, Membership, MembershipConfig, MembershipError, MembershipEvent, NodeId,
    NodeState, SessionId,
};
pub use placement::{
    ClusterTotals, NodeCapacity, NodeUsage, PlacementError, Reservation, ReservationId,
    ResourceTable, Resources, Strategy,
};
pub use resources::{DiscoverOptions, HostResources, NodeResources, discover, discover_host};
pub use state::{DaemonRecord, DaemonRole, HeadRecord, StateDir, StateError};
pub use tls::{
    ALPN, CaCertificate, CaHash, ClientTls, ClusterCa, JoinToken, NodeCredentials, SERVER_NAME,
    ServerTls, SubjectAltName, TlsError, certificate_name,
};
pub use transport::{
    Client, Connection, Handler, Peer, PeerIdentity, Server, TransportError, TransportOptions,
};
