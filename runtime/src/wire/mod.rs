//! The only types that cross the network, and their framing.
//!
//! Everything a daemon sends or receives is a [`Message`] in a frame: a length, the
//! [`WIRE_VERSION`] and an rkyv archive that is validated before use. Daemons convert
//! these plain types to their domain types at the boundary; nothing outside this module
//! derives the archive traits.

mod beat;
mod frame;
mod messages;

pub use beat::{
    BEAT_KEY_LEN, BEAT_LEN, BeatError, BeatGate, BeatKey, BeatKind, BeatPacket, MAX_BEAT_LEN,
    MAX_BEAT_SAMPLES, SAMPLE_LEN,
};
pub use frame::{
    DEFAULT_MAX_FRAME, HEADER_LEN, WireError, decode, decode_with_limit, encode, read_frame,
    write_frame,
};
pub use messages::{
    ActorEventWire, ActorLabelWire, ActorStatusWire, ClusterStatusWire, GpuSampleWire, GpuUseWire,
    GpuWire, MAX_OUTPUT_LINES, Message, NodeDescription, NodeStatusWire, ORIGIN_ELSEWHERE,
    ORIGIN_HERE, ORIGIN_NODE_LOST, ORIGIN_WORKER_EXIT, ReservationWire, ResourcesWire,
    WIRE_VERSION,
};
