//! The head's resource table and placement: what every node offers, what is reserved on
//! it and by whom, and where a new request goes.
//!
//! [`ResourceTable`] holds the nodes the head's daemon adds (alive ones; it removes a node
//! when membership says its session ended). [`ResourceTable::reserve`] and
//! [`ResourceTable::reserve_all`] pick nodes by a [`Strategy`] and reserve atomically:
//! all or nothing, never more than a node has. A request refused is either
//! `Unsatisfiable` (no node could ever take it, so waiting is pointless) or `Busy` (it
//! would fit if others released theirs). Like membership, nothing here reads a clock or
//! does I/O.

mod choose;
mod quantities;
mod table;

pub use choose::Strategy;
pub use quantities::{NodeCapacity, Resources};
pub use table::{ClusterTotals, NodeUsage, Reservation, ReservationId, ResourceTable};

use crate::membership::NodeId;

/// Why a placement or a release was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// No node could take the request even with nothing reserved.
    #[error("unsatisfiable: {reason}")]
    Unsatisfiable { reason: String },
    /// A node could take the request once others release what they hold.
    #[error("busy: {reason}")]
    Busy { reason: String },
    #[error("unknown node {node}")]
    UnknownNode { node: NodeId },
    #[error("node {node} is already in the table")]
    NodeExists { node: NodeId },
    #[error("unknown reservation {id}")]
    UnknownReservation { id: ReservationId },
}
