//! imgrun's control plane.
//!
//! Today this crate discovers the resources of the machine it runs on (cores, memory);
//! the cluster (head, nodes, QUIC transport, membership and actors) grows here next.
//! It knows nothing about tch or shards.

mod resources;

pub use resources::{HostResources, discover_host};
