//! What the head and node daemons and the cluster client share: their error type, the
//! hook through which the actor layer answers actor requests, the addresses a daemon
//! advertises, and conversions between discovered resources (and their GPUs' use) and
//! their wire form.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::pin::Pin;
use std::time::{Duration, Instant};

use crate::gpu::GpuSample;
use crate::membership::MembershipError;
use crate::placement::{NodeCapacity, Resources, Strategy};
use crate::resources::NodeResources;
use crate::state::StateError;
use crate::status::{gpu_use_of, gpu_use_wire};
use crate::tls::TlsError;
use crate::transport::{Peer, TransportError};
use crate::wire::{GpuSampleWire, GpuWire, MAX_BEAT_SAMPLES, Message, ResourcesWire};

/// How long a joining node, or a client, waits for the head to answer at all.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a daemon that answered a stop request lets the answer leave before it closes
/// its port (the transport does not report delivery, and closing at once could drop it).
pub(crate) const STOP_LINGER: Duration = Duration::from_millis(100);

/// The longest an `ActorEvents` request is held waiting for an event.
pub(crate) const MAX_EVENT_WAIT: Duration = Duration::from_secs(60);

/// How long a node may take to start an actor (its constructor may load a model).
pub(crate) const START_TIMEOUT: Duration = Duration::from_secs(120);

/// The certificate name of the head: nodes obey stop requests from it only.
pub(crate) const HEAD_NAME: &str = "head";
/// The certificate name of the commands run on the head's machine: the only peer that
/// may stop the cluster.
pub(crate) const CLIENT_NAME: &str = "client";
/// How every node's certificate name starts (`node-<32 hex digits>`); the name is the
/// node's membership key, so a node keeps its id when it joins again with it.
pub(crate) const NODE_PREFIX: &str = "node-";

/// Why a daemon could not start, or a client could not talk to the head. Messages are
/// short, lower case, and name the peer or the file.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    State(#[from] StateError),
    #[error("credentials in {dir}: {source}")]
    Credentials { dir: PathBuf, source: TlsError },
    #[error("cannot make credentials: {0}")]
    Tls(#[from] TlsError),
    #[error("{0}")]
    Membership(#[from] MembershipError),
    #[error("cannot resolve {address}: {reason}")]
    Resolve { address: String, reason: String },
    #[error("bad advertised address {address:?}: expected ip, ip:port or host:port")]
    BadAdvertise { address: String },
    #[error("cannot listen on {address}: {source}")]
    Listen {
        address: SocketAddr,
        source: Box<TransportError>,
    },
    #[error("cannot bind the heartbeat port {address} (UDP): {reason}")]
    BeatPort { address: SocketAddr, reason: String },
    #[error("cannot reach head {head} within {after:?}")]
    Unreachable { head: String, after: Duration },
    #[error(
        "the head's CA certificate does not match {ca_hash}: wrong --ca-hash, or not an imgrun head ({head}: {reason})"
    )]
    WrongCaHash {
        head: String,
        ca_hash: String,
        reason: String,
    },
    #[error("head {head} refused the join: {reason}")]
    JoinRefused { head: String, reason: String },
    #[error("no head running on this machine (no head record in {dir}); give --address")]
    NoHead { dir: PathBuf },
    #[error(
        "no cluster credentials in {dir}: run this on the head's machine or on a node that joined"
    )]
    NoCredentials { dir: PathBuf },
    #[error("head {head} refused the request: {reason}")]
    Refused { head: String, reason: String },
    #[error("head {head} failed the request: {message}")]
    Remote { head: String, message: String },
    #[error("unexpected answer from {peer}: {what}")]
    UnexpectedReply { peer: String, what: String },
    #[error("request to {peer} failed: {source}")]
    Request {
        peer: String,
        source: Box<TransportError>,
    },
    #[error("unknown node {node}")]
    UnknownNode { node: u64 },
    #[error("cannot host actors: {0}")]
    Actors(#[from] crate::actor::ActorError),
}

/// The reply to an actor request, boxed so that handlers can be stored as trait objects.
pub type ActorReply = Pin<Box<dyn Future<Output = Message> + Send>>;

/// Answers the actor requests a daemon receives (every message that is not part of the
/// control protocol: `ActorSpawn`, `ActorCall`, `ActorStart`...). The actor layer sets one
/// with `Head::set_actor_handler` or `Node::set_actor_handler`; until it does, such
/// requests are answered with [`Message::Error`]. Implemented by any `Fn(Peer, Message) ->
/// impl Future<Output = Message>`. The peer is always authenticated: the daemons refuse
/// actor requests from anyone without a cluster certificate before calling this.
pub trait ActorHandler: Send + Sync + 'static {
    fn handle(&self, peer: Peer, request: Message) -> ActorReply;

    /// The connection of an authenticated `peer` ended. The head kills the actors the
    /// peer owned; nothing by default.
    fn disconnected(&self, peer: &Peer) {
        let _ = peer;
    }

    /// The actors that have not ended, for the head's status; none by default (a node's
    /// handler keeps no directory).
    fn actors(&self) -> Vec<crate::status::ActorStatus> {
        Vec::new()
    }
}

impl<F, Fut> ActorHandler for F
where
    F: Fn(Peer, Message) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Message> + Send + 'static,
{
    fn handle(&self, peer: Peer, request: Message) -> ActorReply {
        Box::pin(self(peer, request))
    }
}

/// Whether a message belongs to the control protocol (join, heartbeat, status, stop)
/// rather than to the actor layer, which gets everything else.
pub(crate) fn is_control(message: &Message) -> bool {
    matches!(
        message,
        Message::JoinRequest { .. }
            | Message::JoinAccepted { .. }
            | Message::Refused { .. }
            | Message::Hello { .. }
            | Message::Heartbeat { .. }
            | Message::HeartbeatAck { .. }
            | Message::HeartbeatRefused { .. }
            | Message::Leave { .. }
            | Message::StatusRequest
            | Message::StatusReply { .. }
            | Message::StopRequest { .. }
            | Message::Ack
            | Message::Error { .. }
    )
}

/// Milliseconds since the daemon started: the time membership is driven with.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Clock {
    start: Instant,
}

impl Clock {
    pub(crate) fn start() -> Self {
        Clock {
            start: Instant::now(),
        }
    }

    pub(crate) fn now_ms(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The instant `ms` milliseconds after the start.
    pub(crate) fn instant(&self, ms: u64) -> Instant {
        self.start + Duration::from_millis(ms)
    }
}

/// The address others use to reach a daemon bound to `bound`: `advertise` when given (an
/// `ip`, `ip:port`, `host` or `host:port`; without a port, the bound one), else the bound
/// address when it is specific, else the source address of the route toward `toward` (the
/// head, for a node; any public address, for the head), else 127.0.0.1.
pub(crate) fn advertised_address(
    bound: SocketAddr,
    advertise: Option<&str>,
    toward: SocketAddr,
) -> Result<String, DaemonError> {
    advertise_with(bound, advertise, || route_source(toward))
}

/// Where to look for the head's default route: a documentation address (RFC 5737) that
/// no packet is ever sent to.
pub(crate) const PUBLIC_PROBE: SocketAddr =
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1)), 9);

/// The pure part of [`advertised_address`]; `route` finds the source address.
fn advertise_with(
    bound: SocketAddr,
    advertise: Option<&str>,
    route: impl FnOnce() -> Option<IpAddr>,
) -> Result<String, DaemonError> {
    let port = bound.port();
    let Some(text) = advertise.map(str::trim).filter(|text| !text.is_empty()) else {
        if !bound.ip().is_unspecified() {
            return Ok(bound.to_string());
        }
        let ip = route().unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
        return Ok(SocketAddr::new(ip, port).to_string());
    };
    let bad = || DaemonError::BadAdvertise {
        address: text.to_owned(),
    };
    if let Ok(address) = text.parse::<SocketAddr>() {
        let port = if address.port() == 0 {
            port
        } else {
            address.port()
        };
        return Ok(SocketAddr::new(address.ip(), port).to_string());
    }
    let bare = text.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, port).to_string());
    }
    let (host, host_port) = match text.rsplit_once(':') {
        Some((host, given)) => (host, given.parse::<u16>().map_err(|_| bad())?),
        None => (text, port),
    };
    let valid_host = !host.is_empty()
        && host.len() <= 253
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
    if !valid_host {
        return Err(bad());
    }
    Ok(format!("{host}:{host_port}"))
}

/// The local address the kernel would send from toward `toward` (a connected UDP socket
/// picks its route; nothing is sent), unless it is unspecified or the lookup fails.
fn route_source(toward: SocketAddr) -> Option<IpAddr> {
    let any = match toward {
        SocketAddr::V4(_) => SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)),
        SocketAddr::V6(_) => SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, 0)),
    };
    let socket = UdpSocket::bind(any).ok()?;
    socket.connect(toward).ok()?;
    let ip = socket.local_addr().ok()?.ip();
    (!ip.is_unspecified()).then_some(ip)
}

/// Resolves `ip:port` or `host:port` to one socket address (the first the resolver
/// gives), within [`CONNECT_TIMEOUT`].
pub(crate) async fn resolve(address: &str) -> Result<SocketAddr, DaemonError> {
    if let Ok(address) = address.parse::<SocketAddr>() {
        return Ok(address);
    }
    let error = |reason: String| DaemonError::Resolve {
        address: address.to_owned(),
        reason,
    };
    let found = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::lookup_host(address))
        .await
        .map_err(|_| error(format!("no answer within {CONNECT_TIMEOUT:?}")))?
        .map_err(|e| error(e.to_string()))?;
    let mut found: Vec<SocketAddr> = found.collect();
    // IPv4 first: the daemons bind IPv4 by default.
    found.sort_by_key(|address| !address.is_ipv4());
    found
        .into_iter()
        .next()
        .ok_or_else(|| error("no address".to_owned()))
}

/// What a node offers, as the wire carries it.
pub(crate) fn resources_wire(resources: &NodeResources) -> ResourcesWire {
    ResourcesWire {
        cpus: u32::try_from(resources.cpus).unwrap_or(u32::MAX),
        memory_bytes: resources.memory_bytes,
        gpus: resources
            .gpus
            .iter()
            .map(|gpu| GpuWire {
                index: gpu.index,
                name: gpu.name.clone(),
                memory_bytes: gpu.memory_bytes,
                uuid: gpu.uuid.clone(),
            })
            .collect(),
    }
}

/// A node's newest samples as its heartbeat carries them: the first
/// [`MAX_BEAT_SAMPLES`], all a UDP beat holds.
pub(crate) fn samples_wire(samples: &[GpuSample]) -> Vec<GpuSampleWire> {
    samples
        .iter()
        .take(MAX_BEAT_SAMPLES)
        .map(|sample| GpuSampleWire {
            index: sample.index,
            usage: gpu_use_wire(sample.usage),
        })
        .collect()
}

/// The samples of a heartbeat: the first [`MAX_BEAT_SAMPLES`] (a UDP beat carries no
/// more; a QUIC one is cut to as many).
pub(crate) fn samples_of(wire: &[GpuSampleWire]) -> Vec<GpuSample> {
    wire.iter()
        .take(MAX_BEAT_SAMPLES)
        .map(|sample| GpuSample {
            index: sample.index,
            usage: gpu_use_of(sample.usage),
        })
        .collect()
}

/// What the head's resource table holds for a node that offers `resources`.
pub(crate) fn capacity_of(resources: &ResourcesWire) -> NodeCapacity {
    let quantities = Resources::new()
        .with_cpus(u64::from(resources.cpus))
        .with_memory_bytes(resources.memory_bytes.unwrap_or(0));
    NodeCapacity::new(quantities).with_gpu_indices(resources.gpus.iter().map(|gpu| gpu.index))
}

/// How a [`Strategy`] travels (`pack`, `spread`, `node:<id>`).
pub(crate) fn placement_text(strategy: Strategy) -> String {
    match strategy {
        Strategy::Pack => "pack".to_owned(),
        Strategy::Spread => "spread".to_owned(),
        Strategy::Node(node) => format!("node:{node}"),
    }
}

/// A refusal from the head: a node or a client should act on [`Message::Refused`] only.
pub(crate) fn refused(reason: impl Into<String>) -> Message {
    Message::Refused {
        reason: reason.into(),
    }
}

/// A short name of a message, for logs and errors (never its contents, which may hold
/// credentials).
pub(crate) fn message_name(message: &Message) -> &'static str {
    match message {
        Message::JoinRequest { .. } => "join request",
        Message::JoinAccepted { .. } => "join accepted",
        Message::Refused { .. } => "refused",
        Message::Hello { .. } => "hello",
        Message::Heartbeat { .. } => "heartbeat",
        Message::HeartbeatAck { .. } => "heartbeat ack",
        Message::HeartbeatRefused { .. } => "heartbeat refused",
        Message::Leave { .. } => "leave",
        Message::StatusRequest => "status request",
        Message::StatusReply { .. } => "status reply",
        Message::StopRequest { .. } => "stop request",
        Message::Ack => "ack",
        Message::Error { .. } => "error",
        Message::ActorSpawn { .. } => "actor spawn",
        Message::ActorSpawned { .. } => "actor spawned",
        Message::ActorStart { .. } => "actor start",
        Message::ActorStop { .. } => "actor stop",
        Message::ActorLocate { .. } => "actor locate",
        Message::ActorLocation { .. } => "actor location",
        Message::ActorEvents { .. } => "actor events",
        Message::ActorEventList { .. } => "actor event list",
        Message::ActorCall { .. } => "actor call",
        Message::ActorReply { .. } => "actor reply",
        Message::ActorTell { .. } => "actor tell",
        Message::ActorError { .. } => "actor error",
        Message::ActorEnded { .. } => "actor ended",
        Message::ActorFailed { .. } => "actor failed",
        Message::ActorOutput { .. } => "actor output",
        Message::ActorOutputLines { .. } => "actor output lines",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::GpuUse;
    use crate::wire::GpuUseWire;

    #[test]
    fn advertised_addresses() {
        let any: SocketAddr = "0.0.0.0:7070".parse().expect("address");
        let lan: Option<IpAddr> = Some("10.0.0.5".parse().expect("ip"));
        // (bound, advertise, source of the default route, advertised; None: refused)
        let cases = [
            (any, None, lan, Some("10.0.0.5:7070")),
            (any, None, None, Some("127.0.0.1:7070")),
            (any, Some(""), lan, Some("10.0.0.5:7070")),
            (
                "127.0.0.1:9000".parse().expect("address"),
                None,
                lan,
                Some("127.0.0.1:9000"),
            ),
            (any, Some("192.168.1.2"), None, Some("192.168.1.2:7070")),
            (any, Some("192.168.1.2:80"), None, Some("192.168.1.2:80")),
            (any, Some("192.168.1.2:0"), None, Some("192.168.1.2:7070")),
            (any, Some("::1"), None, Some("[::1]:7070")),
            (any, Some("[fe80::1]"), None, Some("[fe80::1]:7070")),
            (any, Some("gpu-01.lan"), None, Some("gpu-01.lan:7070")),
            (any, Some(" gpu-01:81 "), None, Some("gpu-01:81")),
            (any, Some("gpu 01"), None, None),
            (any, Some("gpu-01:port"), None, None),
        ];
        for (bound, advertise, route, want) in cases {
            let got = advertise_with(bound, advertise, || route).ok();
            assert_eq!(got.as_deref(), want, "{bound} {advertise:?} {route:?}");
        }
    }

    #[test]
    fn the_route_to_loopback_starts_at_loopback() {
        let toward: SocketAddr = "127.0.0.1:9".parse().expect("address");
        assert_eq!(route_source(toward), Some(IpAddr::V4(Ipv4Addr::LOCALHOST)));
    }

    #[test]
    fn messages_read_well() {
        let cases = [
            (
                DaemonError::JoinRefused {
                    head: "10.0.0.5:7070".into(),
                    reason: "bad token".into(),
                },
                "head 10.0.0.5:7070 refused the join: bad token",
            ),
            (
                DaemonError::Unreachable {
                    head: "1.2.3.4:7070".into(),
                    after: Duration::from_secs(5),
                },
                "cannot reach head 1.2.3.4:7070 within 5s",
            ),
            (
                DaemonError::NoHead {
                    dir: PathBuf::from("/state"),
                },
                "no head running on this machine (no head record in /state); give --address",
            ),
        ];
        for (error, want) in cases {
            assert_eq!(error.to_string(), want);
        }
    }

    #[test]
    fn gpu_use_crosses_the_wire_within_range() {
        let usage = |percent, used| GpuUse {
            utilization_percent: percent,
            memory_used_bytes: used,
        };
        // (domain, wire, back from the wire)
        let cases = [
            (usage(None, None), (None, None), usage(None, None)),
            (
                usage(Some(37), Some(12 << 30)),
                (Some(37), Some(12 << 30)),
                usage(Some(37), Some(12 << 30)),
            ),
            (
                usage(Some(0), Some(0)),
                (Some(0), Some(0)),
                usage(Some(0), Some(0)),
            ),
            (
                usage(Some(100), None),
                (Some(100), None),
                usage(Some(100), None),
            ),
            (
                usage(Some(250), None),
                (Some(100), None),
                usage(Some(100), None),
            ),
        ];
        for (domain, (percent, used), back) in cases {
            let wire = gpu_use_wire(domain);
            assert_eq!(
                (wire.utilization_percent, wire.memory_used_bytes),
                (percent, used),
                "{domain:?}"
            );
            assert_eq!(gpu_use_of(wire), back, "{domain:?}");
        }
        let hostile = GpuUseWire {
            utilization_percent: Some(101),
            memory_used_bytes: Some(1),
        };
        assert_eq!(gpu_use_of(hostile), usage(None, Some(1)));
        let many: Vec<GpuSampleWire> = (0..100)
            .map(|index| GpuSampleWire {
                index,
                usage: hostile,
            })
            .collect();
        let read = samples_of(&many);
        assert_eq!(read.len(), MAX_BEAT_SAMPLES);
        assert_eq!(samples_wire(&read)[3].index, 3);
        let more: Vec<GpuSample> = (0..100)
            .map(|index| GpuSample {
                index,
                usage: GpuUse::default(),
            })
            .collect();
        assert_eq!(samples_wire(&more).len(), MAX_BEAT_SAMPLES);
    }

    #[test]
    fn control_and_actor_messages_are_told_apart() {
        assert!(is_control(&Message::StatusRequest));
        assert!(is_control(&Message::Leave {
            node_id: 1,
            session: 2
        }));
        assert!(!is_control(&Message::ActorLocate { actor_id: 1 }));
        assert_eq!(
            message_name(&Message::ActorLocate { actor_id: 1 }),
            "actor locate"
        );
    }
}
