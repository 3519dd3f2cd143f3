//! The messages daemons and clients exchange, as they are archived on the wire.
//!
//! These are plain data (strings, integers, vectors) on purpose: the daemons convert them
//! to and from their domain types (`NodeId`, resources, actor ids) at the boundary, so
//! the domain types never derive the archive traits and a change of wire layout is a
//! change of this file and of [`WIRE_VERSION`] only. Integers have fixed widths (`usize`
//! would archive differently across targets).

use rkyv::{Archive, Deserialize, Serialize};

/// The most lines of a worker's output its node keeps, and so answers with.
pub const MAX_OUTPUT_LINES: u32 = 1000;

/// The version every frame carries; a frame of another version is refused unread.
/// Bump it with any change to the types in this file.
pub const WIRE_VERSION: u16 = 12;

/// Where an actor's failure started (`origin` in the actor messages): in the actor, its
/// own error or a panic.
pub const ORIGIN_HERE: u8 = 0;
/// In another actor it depended on (a peer went away or stopped answering).
pub const ORIGIN_ELSEWHERE: u8 = 1;
/// Its worker process ended without the actor reporting a failure.
pub const ORIGIN_WORKER_EXIT: u8 = 2;
/// Its node was lost.
pub const ORIGIN_NODE_LOST: u8 = 3;

/// One request or response. A stream carries one request frame and one response frame;
/// a datagram carries one frame (heartbeats and their answers).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub enum Message {
    /// A node without a certificate asks to join, proving it knows the join token.
    /// The only request the head answers on an unauthenticated connection.
    JoinRequest {
        /// The join token the head printed, compared in constant time. Empty for a node
        /// that joins again on a connection with its cluster certificate.
        token: String,
        /// What the joining node is and offers.
        node: NodeDescription,
    },
    /// The head admits a node and hands it its credentials, signed by the cluster CA.
    JoinAccepted {
        /// The id the head gave the node.
        node_id: u64,
        /// The node's membership session, new at every join and never repeated by a
        /// restarted head; its heartbeats carry it.
        session: u64,
        /// The cluster CA certificate (PEM): the root the node verifies peers against.
        ca_cert_pem: String,
        /// The node's certificate (PEM), its common name being the node's name.
        cert_pem: String,
        /// The node's private key (PKCS#8 PEM).
        key_pem: String,
        /// How often the node sends a heartbeat.
        heartbeat_ms: u32,
        /// After how long without a heartbeat the head declares the node dead.
        dead_after_ms: u32,
        /// The head's UDP port for heartbeats (`wire::beat`), on the address the node
        /// joined; 0: send them over QUIC.
        beat_port: u16,
        /// The session's heartbeat key (32 bytes), which tags every beat and its answer;
        /// empty with `beat_port` 0.
        beat_key: Vec<u8>,
    },
    /// A request was refused (bad token, unauthenticated peer, unknown node...).
    Refused {
        /// Why, for a person to read.
        reason: String,
    },
    /// A node's first message on an authenticated connection after it (or the head)
    /// restarted: "I am this node, from that session".
    Hello {
        /// The node's id.
        node_id: u64,
        /// The head session the node last joined.
        session: u64,
    },
    /// A node is alive.
    Heartbeat {
        /// The node's id.
        node_id: u64,
        /// The head session the node belongs to.
        session: u64,
        /// Increases by one per heartbeat of this node.
        seq: u64,
        /// The node's newest measurement of its GPUs (those NVML answers for; empty
        /// without NVML), as a UDP beat carries it too (`wire::beat`). The head reads at
        /// most [`MAX_BEAT_SAMPLES`](super::MAX_BEAT_SAMPLES) of them.
        gpus: Vec<GpuSampleWire>,
    },
    /// The head received the heartbeat `seq` and keeps the node's session.
    HeartbeatAck {
        /// The heartbeat's `seq`.
        seq: u64,
    },
    /// The head refused the heartbeat `seq` (the session is over: join again). The
    /// answer to a heartbeat sent as a datagram, which the node matches to its beat by
    /// `seq`; on a stream the answer is [`Message::Refused`].
    HeartbeatRefused {
        /// The heartbeat's `seq`.
        seq: u64,
        /// Why, for a person to read; short enough for one datagram.
        reason: String,
    },
    /// A node stops gracefully: the head ends its session now rather than waiting for
    /// its heartbeats to stop. Answered with [`Message::Ack`].
    Leave {
        /// The node's id.
        node_id: u64,
        /// The session it leaves.
        session: u64,
    },
    /// A client asks the head for the state of the cluster.
    StatusRequest,
    /// The state of the cluster.
    StatusReply {
        /// Nodes and reservations.
        status: ClusterStatusWire,
    },
    /// A client asks the head to stop (itself only, or every node too).
    StopRequest {
        /// Stop every node as well as the head.
        all: bool,
    },
    /// Done; nothing to report.
    Ack,
    /// The request could not be served.
    Error {
        /// Why, for a person to read.
        message: String,
    },
    /// Start an actor somewhere in the cluster (client to head).
    ActorSpawn {
        /// The registered kind of actor.
        kind: String,
        /// The actor's constructor arguments, encoded by the caller.
        args: Vec<u8>,
        /// Resources the actor reserves: (name, amount), e.g. `("gpu", 1)`; `cpu` is in
        /// thousandths of a CPU.
        resources: Vec<(String, u64)>,
        /// The placement rule: `pack`, `spread` or `node:<id>`.
        placement: String,
        /// Run in a worker process of its own (for native code such as libtorch) rather
        /// than inside the node daemon. Actors with the same non-empty group share one.
        process_group: String,
        /// How many times the head restarts the actor after a failure (0: never).
        max_restarts: u32,
        /// The pause before the first restart, doubled after each further one.
        restart_backoff_ms: u32,
        /// The job and rank the actor works for, shown by `imgrun status`.
        label: Option<ActorLabelWire>,
        /// Owned by no connection: it outlives its spawner, and any client may stop it.
        detached: bool,
    },
    /// The actor started (head to client).
    ActorSpawned {
        /// The new actor's id.
        actor_id: u64,
        /// The node it runs on.
        node_id: u64,
        /// Where that node accepts calls (`ip:port`).
        address: String,
    },
    /// Start an actor here (head to node, and node to its worker process).
    ActorStart {
        /// The id the head gave the actor.
        actor_id: u64,
        /// The registered kind of actor.
        kind: String,
        /// The actor's constructor arguments.
        args: Vec<u8>,
        /// The worker process group, empty for the node daemon itself.
        process_group: String,
        /// The physical GPU indices reserved for it (`CUDA_VISIBLE_DEVICES`).
        gpus: Vec<u32>,
    },
    /// Stop an actor (client to head, head to node, node to worker): `kill` ends it now,
    /// otherwise it finishes the messages already queued first.
    ActorStop {
        /// The actor.
        actor_id: u64,
        /// Stop now, dropping queued messages.
        kill: bool,
    },
    /// Where does an actor run now (client to head)? Asked again after a restart.
    ActorLocate {
        /// The actor.
        actor_id: u64,
    },
    /// The answer to [`Message::ActorLocate`].
    ActorLocation {
        /// The actor.
        actor_id: u64,
        /// Its node.
        node_id: u64,
        /// Where that node accepts calls (`ip:port`).
        address: String,
        /// `starting`, `running`, `restarting`, `stopping`, `failed` or `stopped`.
        state: String,
        /// Why it last failed, for a person to read; empty if it never did.
        reason: String,
        /// Where that failure started ([`ORIGIN_HERE`] and the other `ORIGIN_` codes).
        origin: u8,
    },
    /// The events of actors this client owns after `after_seq` (client to head); the
    /// head answers at once when there are some, otherwise within `wait_ms`.
    ActorEvents {
        /// The last event already seen (0 for all).
        after_seq: u64,
        /// How long the head may hold the request waiting for an event.
        wait_ms: u32,
    },
    /// The answer to [`Message::ActorEvents`], oldest first.
    ActorEventList {
        /// The events.
        events: Vec<ActorEventWire>,
        /// Some events of this owner after `after_seq` were dropped (the head keeps the
        /// last ones only): the owner should locate its actors rather than trust the list.
        missed: bool,
    },
    /// Call a method of an actor and wait for its reply.
    ActorCall {
        /// The actor.
        actor_id: u64,
        /// Chosen by the caller, echoed in the reply.
        call_id: u64,
        /// The method's name.
        method: String,
        /// The arguments, encoded by the caller.
        payload: Vec<u8>,
        /// How long the caller waits.
        timeout_ms: u32,
    },
    /// The outcome of an [`Message::ActorCall`].
    ActorReply {
        /// The call's `call_id`.
        call_id: u64,
        /// The encoded return value, or why the method failed.
        result: Result<Vec<u8>, String>,
    },
    /// Send an actor a message without waiting for a reply.
    ActorTell {
        /// The actor.
        actor_id: u64,
        /// The method's name.
        method: String,
        /// The arguments, encoded by the caller.
        payload: Vec<u8>,
    },
    /// A call or tell that did not reach a running actor, or a start or stop that failed,
    /// and why (node to caller). A method's own error is an [`Message::ActorReply`] with
    /// `Err` instead: the actor carries on.
    ActorError {
        /// The actor.
        actor_id: u64,
        /// What kept the request from the actor: `unknown` (no such actor here), `failed`,
        /// `stopped`, `killed`, `starting`, `stopping`, `timeout`, `too_large` or `error`.
        cause: String,
        /// Why, for a person to read.
        message: String,
        /// The message had reached the actor before it ended (a call may have run), so
        /// the caller must not send it again elsewhere.
        delivered: bool,
        /// For `failed`: where the failure started ([`ORIGIN_HERE`] and the other
        /// `ORIGIN_` codes); [`ORIGIN_HERE`] otherwise.
        origin: u8,
    },
    /// An actor that ran on a node ended there (node to head), once per actor that
    /// started: the head releases its resources and tells its owner.
    ActorEnded {
        /// The actor.
        actor_id: u64,
        /// The node reporting (the peer must be that node).
        node_id: u64,
        /// `failed`, `stopped` (a graceful stop finished) or `killed`.
        outcome: String,
        /// Why it failed, for a person to read; empty for a stop or a kill.
        reason: String,
        /// Where the failure started ([`ORIGIN_HERE`] and the other `ORIGIN_` codes).
        origin: u8,
    },
    /// The last lines an actor's worker process wrote (anyone to the actor's node): of
    /// an actor hosted there, or of one of the last that ended there.
    ActorOutput {
        /// The actor.
        actor_id: u64,
        /// How many of the newest lines, at most [`MAX_OUTPUT_LINES`].
        lines: u32,
    },
    /// The answer to [`Message::ActorOutput`].
    ActorOutputLines {
        /// The actor.
        actor_id: u64,
        /// Oldest first; each at most 1,000 bytes.
        lines: Vec<String>,
        /// The actor runs in a worker process of its own group; false for one the node
        /// daemon runs itself (whose output is the daemon's log), which has no lines.
        own_process: bool,
    },
    /// An actor stopped with an error, or its worker process exited (worker to node).
    ActorFailed {
        /// The actor.
        actor_id: u64,
        /// Why, for a person to read: the error, or the worker's exit code or signal and
        /// the last lines of its stderr.
        reason: String,
        /// Where the failure started ([`ORIGIN_HERE`] and the other `ORIGIN_` codes).
        origin: u8,
    },
}

/// What a joining node tells the head about itself.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct NodeDescription {
    /// The machine's host name.
    pub hostname: String,
    /// Where the node accepts connections (`ip:port`).
    pub address: String,
    /// The node's `imgrun` version, to spot mixed clusters.
    pub version: String,
    /// What the node offers.
    pub resources: ResourcesWire,
}

/// The resources a node offers.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct ResourcesWire {
    /// Logical CPUs.
    pub cpus: u32,
    /// Memory, when known.
    pub memory_bytes: Option<u64>,
    /// The GPUs.
    pub gpus: Vec<GpuWire>,
}

/// One GPU of a node.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct GpuWire {
    /// The physical index on its node.
    pub index: u32,
    /// The model, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// Total memory, when the driver says.
    pub memory_bytes: Option<u64>,
    /// `GPU-xxxxxxxx-...`, or `claimed-<i>` for a claimed GPU.
    pub uuid: String,
}

/// What one GPU is doing, as its node last measured it through NVML.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct GpuUseWire {
    /// The share of NVML's last sample period in which the GPU was busy, 0 to 100;
    /// unknown when NVML did not say.
    pub utilization_percent: Option<u8>,
    /// Memory in use, when NVML said.
    pub memory_used_bytes: Option<u64>,
}

/// A node's measurement of one of its GPUs, in a heartbeat.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct GpuSampleWire {
    /// The GPU's physical index on its node, as in its [`GpuWire::index`].
    pub index: u32,
    /// What it was doing.
    pub usage: GpuUseWire,
}

/// The state of the cluster as the head sees it.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct ClusterStatusWire {
    /// The head's session.
    pub session: u64,
    /// Every node the head knows, dead ones included.
    pub nodes: Vec<NodeStatusWire>,
    /// The reservations in use.
    pub reservations: Vec<ReservationWire>,
    /// The actors that have not ended, in id order.
    pub actors: Vec<ActorStatusWire>,
}

/// Which job an actor works for, and as which rank.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct ActorLabelWire {
    /// The job's name (a training run's folder name).
    pub job: String,
    /// The actor's rank in the job.
    pub rank: u32,
}

/// One actor in a [`ClusterStatusWire`].
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct ActorStatusWire {
    /// The actor's id.
    pub actor_id: u64,
    /// Its registered kind.
    pub kind: String,
    /// Its node; 0 while it has none (restarting).
    pub node_id: u64,
    /// `starting`, `running`, `restarting` or `stopping`.
    pub state: String,
    /// Its job and rank, when its spawner gave them.
    pub label: Option<ActorLabelWire>,
}

/// One node in a [`ClusterStatusWire`].
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct NodeStatusWire {
    /// The node's id.
    pub node_id: u64,
    /// Where the node accepts connections (`ip:port`).
    pub address: String,
    /// The machine's host name.
    pub hostname: String,
    /// The membership state, e.g. `alive`, `suspect`, `dead`.
    pub state: String,
    /// Time since the node joined.
    pub uptime_ms: u64,
    /// Time since the head last heard from the node.
    pub last_heartbeat_ms_ago: u64,
    /// What the node offers.
    pub resources: ResourcesWire,
    /// What each GPU of `resources.gpus` is doing, in the same order, from the node's
    /// newest heartbeat; a GPU past the end of this list is unknown.
    pub gpu_use: Vec<GpuUseWire>,
}

/// Resources reserved on a node, and by whom.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct ReservationWire {
    /// The node the resources are on.
    pub node_id: u64,
    /// Who holds them, e.g. `actor:12`.
    pub owner: String,
    /// (name, amount) pairs, e.g. `("gpu", 1)`.
    pub resources: Vec<(String, u64)>,
}

/// Something that happened to an actor, for its owner.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct ActorEventWire {
    /// Increases by one per event of the cluster; the owner asks for those after it.
    pub seq: u64,
    /// The actor.
    pub actor_id: u64,
    /// The node it ran on.
    pub node_id: u64,
    /// `failed` (for good), `restarting`, `restarted` or `stopped`.
    pub kind: String,
    /// Why, for a person to read.
    pub reason: String,
    /// Where a failure (`failed`, `restarting`) started ([`ORIGIN_HERE`] and the other
    /// `ORIGIN_` codes); [`ORIGIN_HERE`] for other events.
    pub origin: u8,
}
