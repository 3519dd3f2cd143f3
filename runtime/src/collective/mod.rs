//! Collectives between the trainer processes of one job: a ring of byte links and the
//! ring allreduce, weighted mean, broadcast and barrier that DDP gradient averaging needs.
//!
//! A [`RingGroup`] holds this rank's [`Link`]: an ordered, reliable byte pipe to the next
//! rank and from the previous one. Links are in memory ([`RingGroup::in_memory`], for
//! tests) or TCP ([`RingGroup::connect`]; between ranks on one host a Unix domain socket
//! where it can, see [`CollectiveOptions::local_sockets`]), where both ends of every connection prove that
//! they know the job's [`RingSecret`] (HMAC-SHA256 over nonces from both sides, the ring id
//! and both ranks). Data after the handshake is **not encrypted or authenticated**, as
//! with gloo and NCCL: the ring is meant for a trusted cluster network.
//!
//! Every operation starts with a header (operation, sequence number, length, root, ring
//! block size, and how many bytes of values follow it) that goes once around the ring, so every rank sees
//! every other rank's header before any data moves through the chunked ring: ranks that
//! disagree on the operation or its size all fail with [`CollectiveError::Mismatch`]
//! instead of hanging or corrupting the buffer. A small allreduce carries its values
//! inline in that round (see [`CollectiveOptions::inline_bytes`]) and sums only once
//! every header has been compared. After an
//! operation fails (a refused argument aside) the group is poisoned and every later
//! operation fails at once.

mod link;
mod mix;
mod ring;
mod topology;

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

pub use link::{Link, LinkPath, Transport};
pub use mix::{MixError, Mixer};
pub use ring::RingGroup;
pub use topology::{Topology, UnknownTopology, node_of_each_rank};

use crate::secret::{Secret, SecretPurpose};

/// Default size of the chunks a segment is cut into on the wire.
pub const DEFAULT_CHUNK_BYTES: usize = 1 << 20;

/// Default of [`CollectiveOptions::block_bytes`].
pub const DEFAULT_BLOCK_BYTES: usize = 512 << 10;

/// Default of [`CollectiveOptions::inline_bytes`].
pub const DEFAULT_INLINE_BYTES: usize = 128 << 10;

/// Most bytes of values any rank may send inline with its header; a header that announces
/// more is refused (so a peer cannot make a rank allocate more than this for it).
pub const MAX_INLINE_BYTES: usize = 1 << 20;

/// Tunables of a [`RingGroup`].
#[derive(Clone, Debug)]
pub struct CollectiveOptions {
    /// Bytes per chunk on the wire (rounded down to whole `f32`s, at least one).
    pub chunk_bytes: usize,
    /// A ring allreduce runs its reduce-scatter and allgather on blocks of this many
    /// bytes (rounded down to whole `f32`s) one after the other, so each block's values
    /// are still in cache when they are sent on; 0 runs the whole buffer as one block.
    /// Carried in the header: ranks that differ fail with [`CollectiveError::Mismatch`].
    pub block_bytes: usize,
    /// An allreduce whose buffer, times the world size less one, is at most this many
    /// bytes skips the chunked ring: every rank's values travel once around the ring with
    /// its header and every rank sums them in rank order. That is one trip around the
    /// ring instead of three (header round, reduce-scatter, allgather), for n - 1 times
    /// the buffer on each link instead of 2 (n - 1) / n times. 0 turns it off; values
    /// above [`MAX_INLINE_BYTES`] act as that. All ranks must use the same value (ranks
    /// that do not fail with [`CollectiveError::Mismatch`] when their paths differ).
    pub inline_bytes: usize,
    /// Longest one operation may take before it fails with a timeout.
    pub op_timeout: Duration,
    /// Longest [`RingGroup::connect`] may take, retries and handshakes included.
    pub connect_timeout: Duration,
    /// Links a rank to a neighbour on the same host over a Unix domain socket instead of
    /// TCP loopback (less kernel work per byte), falling back to TCP where that fails.
    /// Off: this rank neither listens on nor tries one. On by default.
    pub local_sockets: bool,
}

impl Default for CollectiveOptions {
    fn default() -> Self {
        Self {
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            inline_bytes: DEFAULT_INLINE_BYTES,
            block_bytes: DEFAULT_BLOCK_BYTES,
            op_timeout: Duration::from_secs(300),
            connect_timeout: Duration::from_secs(60),
            local_sockets: true,
        }
    }
}

/// The per-job secret that ring peers prove they know (the head makes one per job).
pub type RingSecret = Secret<RingPurpose>;

/// Marks a [`Secret`] as a ring's.
#[derive(Debug)]
pub enum RingPurpose {}

impl SecretPurpose for RingPurpose {
    const NAME: &'static str = "RingSecret";
}

/// The collective operations, as named in errors and carried in headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    AllreduceSum,
    WeightedMean,
    Broadcast,
    Barrier,
}

impl Op {
    fn code(self) -> u32 {
        match self {
            Op::AllreduceSum => 1,
            Op::WeightedMean => 2,
            Op::Broadcast => 3,
            Op::Barrier => 4,
        }
    }

    fn from_code(code: u32) -> Option<Self> {
        Some(match code {
            1 => Op::AllreduceSum,
            2 => Op::WeightedMean,
            3 => Op::Broadcast,
            4 => Op::Barrier,
            _ => return None,
        })
    }
}

/// Errors of ring setup and collective operations; `rank` is always this rank.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error("rank {rank}: invalid argument: {what}")]
    InvalidArgument { rank: usize, what: String },
    #[error("rank {rank}: cannot connect to rank {peer} at {addr}: {source}")]
    Connect {
        rank: usize,
        peer: usize,
        addr: SocketAddr,
        source: io::Error,
    },
    #[error("rank {rank}: handshake with rank {peer} {path} failed: {reason}")]
    Handshake {
        rank: usize,
        peer: usize,
        /// Boxed: a Unix path's name would make every result of the collectives larger.
        path: Box<LinkPath>,
        reason: String,
    },
    #[error("rank {rank}: rank {peer} closed the link during {what}")]
    PeerClosed {
        rank: usize,
        peer: usize,
        what: &'static str,
    },
    #[error("rank {rank}: i/o with rank {peer} failed during {what}: {source}")]
    Io {
        rank: usize,
        peer: usize,
        what: &'static str,
        source: io::Error,
    },
    #[error("rank {rank}: {what} timed out after {after:?}")]
    Timeout {
        rank: usize,
        what: &'static str,
        after: Duration,
    },
    #[error("rank {rank}: ranks disagree: {detail}")]
    Mismatch { rank: usize, detail: String },
    #[error("rank {rank}: the group failed earlier and cannot be used")]
    Poisoned { rank: usize },
    /// Its owner gave up on the operation in flight (a peer was lost and the job goes on
    /// without it); the group is dropped.
    #[error("rank {rank}: {what} was aborted: a peer is lost")]
    Aborted { rank: usize, what: &'static str },
}
