//! The driver of the head's membership: passes it the time, keeps the resource table in
//! step with the sessions (a node is in the table exactly while its session is on), logs,
//! and tells subscribers what happened. It also keeps the GPU samples of each node's
//! newest heartbeat (the head's own from its sampler), which the status shows as each
//! GPU's use ([`use_of_each`]) while that session is on.
//!
//! Every change holds one mutex around the membership, and the table changes inside it,
//! so a join and the ticker's verdict on the same node cannot interleave. The table's own
//! writer lock is taken inside that mutex, never the other way round.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use tokio::sync::{Notify, broadcast};
use tracing::{info, warn};

use crate::daemon::{Clock, capacity_of, samples_of};
use crate::gpu::{GpuSample, GpuSampler, GpuUse, is_claimed_uuid};
use crate::membership::{
    Member, Membership, MembershipConfig, MembershipError, MembershipEvent, NodeId, SessionId,
};
use crate::placement::{Reservation, ResourceTable};
use crate::status::{ClusterStatus, GpuStatus, NodeStatus, ReservationStatus};
use crate::wire::{
    BEAT_LEN, BeatError, BeatGate, BeatKey, BeatKind, BeatPacket, GpuSampleWire, GpuWire,
    NodeDescription,
};

/// The membership key of the head itself; nodes' keys are their certificate names.
const HEAD_KEY: &str = "head";
/// Events a subscriber may fall behind before it is told it lagged.
const EVENT_BACKLOG: usize = 1024;

/// Something that happened to a node, for the actor layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterEvent {
    /// A session started (a new node, or one that joined again); the node is in the
    /// resource table.
    NodeJoined {
        node: NodeId,
        session: SessionId,
        address: String,
    },
    /// Silent for half the window; it still holds its resources.
    NodeSuspect { node: NodeId, session: SessionId },
    /// A suspect node was heard from again.
    NodeRecovered { node: NodeId, session: SessionId },
    /// A session ended: the node left the resource table, and with it `reservations`,
    /// whose owners (actors) must be told. When the node joined again (`Replaced`), its
    /// `NodeJoined` follows.
    NodeLost {
        node: NodeId,
        session: SessionId,
        reason: LossReason,
        reservations: Vec<Reservation>,
    },
}

/// Why a session ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossReason {
    /// Silent for the whole window.
    Dead,
    /// Stopped gracefully.
    Left,
    /// Joined again (restarted, or reconnected after the head forgot it) before the old
    /// session ended.
    Replaced,
}

/// The head's membership, resource table and event stream.
pub(super) struct Members {
    clock: Clock,
    inner: Mutex<Inner>,
    table: Arc<ResourceTable>,
    events: broadcast::Sender<ClusterEvent>,
    changed: Notify,
    /// The session the head gave itself first: the cluster's session in the status.
    head_session: SessionId,
    /// What the head's own GPUs are doing (it sends itself no heartbeats).
    own_gpus: GpuSampler,
}

struct Inner {
    membership: Membership<NodeDescription>,
    own: NodeId,
    own_session: SessionId,
    /// The heartbeat key and replay check of each node's session (UDP beats).
    beats: HashMap<NodeId, BeatGate>,
    /// The GPU samples of each node's newest heartbeat taken.
    samples: HashMap<NodeId, NodeSamples>,
}

/// The GPU samples a node's heartbeat carried, and the session of that heartbeat: those
/// of an earlier session say nothing about the GPUs now.
struct NodeSamples {
    session: SessionId,
    gpus: Vec<GpuSample>,
}

impl Members {
    /// A membership holding the head itself, described by `own`, whose GPUs `own_gpus`
    /// measures.
    pub(super) fn new(
        config: MembershipConfig,
        own: NodeDescription,
        first: SessionId,
        own_gpus: GpuSampler,
    ) -> Self {
        let clock = Clock::start();
        let table = Arc::new(ResourceTable::new());
        let mut membership = Membership::with_first_session(config, first);
        let capacity = capacity_of(&own.resources);
        let joined = membership.join(clock.now_ms(), HEAD_KEY, own);
        // The table is new and empty: the head's node cannot be in it yet.
        let _ = table.add_node(joined.node, capacity);
        let (events, _) = broadcast::channel(EVENT_BACKLOG);
        Members {
            clock,
            inner: Mutex::new(Inner {
                membership,
                own: joined.node,
                own_session: joined.session,
                beats: HashMap::new(),
                samples: HashMap::new(),
            }),
            table,
            events,
            changed: Notify::new(),
            head_session: joined.session,
            own_gpus,
        }
    }

    pub(super) fn own_id(&self) -> NodeId {
        self.lock().own
    }

    pub(super) fn config(&self) -> MembershipConfig {
        *self.lock().membership.config()
    }

    pub(super) fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    pub(super) fn instant(&self, ms: u64) -> Instant {
        self.clock.instant(ms)
    }

    pub(super) fn table(&self) -> Arc<ResourceTable> {
        self.table.clone()
    }

    pub(super) fn subscribe(&self) -> broadcast::Receiver<ClusterEvent> {
        self.events.subscribe()
    }

    /// Resolves when the membership changed in a way the ticker should look at.
    pub(super) fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }

    /// Admits the node `key` (a new session; a key seen before keeps its id) and puts it
    /// in the resource table. Returns the session's heartbeat key too (`None` if the
    /// system's random generator failed: the node then beats over QUIC).
    pub(super) fn join(
        &self,
        key: &str,
        node: NodeDescription,
    ) -> (NodeId, SessionId, Option<BeatKey>) {
        let beat_key = match BeatKey::generate() {
            Ok(beat_key) => Some(beat_key),
            Err(error) => {
                warn!(%error, "no heartbeat key for a joining node; it beats over QUIC");
                None
            }
        };
        let now = self.clock.now_ms();
        let address = node.address.clone();
        let (hostname, cpus, gpus) = (
            node.hostname.clone(),
            node.resources.cpus,
            node.resources.gpus.len(),
        );
        let capacity = capacity_of(&node.resources);
        let mut inner = self.lock();
        let joined = inner.membership.join(now, key, node);
        if let Some(ended) = joined.ended {
            self.end_session(&ended);
        }
        // A node is in the table only while a session is on; the one that just ended was
        // removed above, so the node is not in the table now.
        let _ = self.table.add_node(joined.node, capacity);
        inner.samples.remove(&joined.node);
        match &beat_key {
            Some(beat_key) => {
                let gate = BeatGate::new(joined.node.0, joined.session.0, beat_key);
                inner.beats.insert(joined.node, gate);
            }
            None => {
                inner.beats.remove(&joined.node);
            }
        }
        drop(inner);
        info!(
            node = %joined.node,
            session = %joined.session,
            %address,
            %hostname,
            cpus,
            gpus,
            "node joined"
        );
        self.send(ClusterEvent::NodeJoined {
            node: joined.node,
            session: joined.session,
            address,
        });
        self.changed.notify_one();
        (joined.node, joined.session, beat_key)
    }

    /// Records the UDP heartbeat in `datagram` if it is a fresh beat of a live session,
    /// tagged with that session's key, and the GPU samples it carries; returns the
    /// acknowledgement to send back.
    pub(super) fn datagram_beat(&self, datagram: &[u8]) -> Result<[u8; BEAT_LEN], BeatError> {
        let packet = BeatPacket::read(datagram, BeatKind::Beat)?;
        // The layout, samples included, was checked by `read`: this cannot fail.
        let samples = BeatPacket::read_samples(datagram)?;
        let node = NodeId(packet.node_id);
        let session = SessionId(packet.session);
        let now = self.clock.now_ms();
        let mut inner = self.lock();
        let gate = inner
            .beats
            .get_mut(&node)
            .ok_or(BeatError::UnknownNode { node: node.0 })?;
        gate.take_read(datagram, packet)?;
        let ack = packet.ack().seal(gate.key());
        match inner.membership.heartbeat(now, node, session) {
            Ok(event) => {
                record_samples(&mut inner, node, session, &samples);
                drop(inner);
                if let Some(event) = event {
                    self.report(&event);
                }
                Ok(ack)
            }
            Err(_) => {
                // The session ended (dead, left): its key goes with it.
                inner.beats.remove(&node);
                Err(BeatError::SessionOver {
                    node: node.0,
                    session: packet.session,
                })
            }
        }
    }

    /// Records a heartbeat of `node` in `session` from the peer named `key`, with the GPU
    /// samples it carries.
    pub(super) fn heartbeat(
        &self,
        key: &str,
        node: NodeId,
        session: SessionId,
        samples: &[GpuSampleWire],
    ) -> Result<(), String> {
        let now = self.clock.now_ms();
        let mut inner = self.lock();
        check_owner(&inner.membership, key, node)?;
        match inner.membership.heartbeat(now, node, session) {
            Ok(event) => {
                record_samples(&mut inner, node, session, samples);
                drop(inner);
                if let Some(event) = event {
                    self.report(&event);
                }
                Ok(())
            }
            Err(error) => Err(error.to_string()),
        }
    }

    /// Ends `session` of `node` gracefully, at the request of the peer named `key`.
    pub(super) fn leave(&self, key: &str, node: NodeId, session: SessionId) -> Result<(), String> {
        let now = self.clock.now_ms();
        let mut inner = self.lock();
        check_owner(&inner.membership, key, node)?;
        let event = inner
            .membership
            .leave(now, node, session)
            .map_err(|error| error.to_string())?;
        inner.beats.remove(&node);
        self.end_session(&event);
        drop(inner);
        self.changed.notify_one();
        Ok(())
    }

    /// Applies the time: keeps the head itself alive, ends the sessions of silent nodes.
    /// Returns when to call again (ms on the clock).
    pub(super) fn advance(&self) -> u64 {
        let now = self.clock.now_ms();
        let mut inner = self.lock();
        self.advance_locked(&mut inner, now);
        let dead_after_ms = inner.membership.config().dead_after_ms;
        inner
            .membership
            .next_deadline()
            .unwrap_or(now.saturating_add(dead_after_ms))
    }

    /// The state of the cluster now (the time applied first, so a node silent past its
    /// window shows dead even if the ticker has not run yet).
    pub(super) fn status(&self) -> ClusterStatus {
        let now = self.clock.now_ms();
        let own_samples = self.own_gpus.latest();
        let mut inner = self.lock();
        self.advance_locked(&mut inner, now);
        let nodes = inner
            .membership
            .nodes()
            .map(|member| {
                let samples = if member.id() == inner.own {
                    own_samples.as_slice()
                } else {
                    inner
                        .samples
                        .get(&member.id())
                        .filter(|samples| {
                            samples.session == member.session() && member.state().is_live()
                        })
                        .map_or(&[][..], |samples| samples.gpus.as_slice())
                };
                node_status(member, now, samples)
            })
            .collect();
        drop(inner);
        let reservations = self
            .table
            .usage()
            .into_iter()
            .flat_map(|usage| usage.reservations)
            .map(|reservation| ReservationStatus {
                node: reservation.node,
                owner: reservation.owner,
                resources: reservation
                    .resources
                    .iter()
                    .map(|(name, amount)| (name.to_owned(), amount))
                    .collect(),
            })
            .collect();
        ClusterStatus::new(self.head_session.0, nodes, reservations)
    }

    /// The session and address of `node`, if its session is on.
    pub(super) fn live_node(&self, node: NodeId) -> Option<(SessionId, String)> {
        let inner = self.lock();
        let member = inner.membership.get(node)?;
        member
            .state()
            .is_live()
            .then(|| (member.session(), member.info().address.clone()))
    }

    /// Whether `node` belongs to the peer named `key` (its certificate name).
    pub(super) fn owns(&self, key: &str, node: NodeId) -> bool {
        check_owner(&self.lock().membership, key, node).is_ok()
    }

    /// Every node with a session on, but the head: (id, address).
    pub(super) fn live_nodes(&self) -> Vec<(NodeId, String)> {
        let inner = self.lock();
        inner
            .membership
            .alive()
            .filter(|member| member.id() != inner.own)
            .map(|member| (member.id(), member.info().address.clone()))
            .collect()
    }

    fn advance_locked(&self, inner: &mut Inner, now: u64) {
        // The head is a member that never sends heartbeats: it is alive while it runs.
        let (own, own_session) = (inner.own, inner.own_session);
        if let Err(error) = inner.membership.heartbeat(now, own, own_session) {
            // Only when this task was starved past the window: join again.
            warn!(%error, "the head's own session expired; joining again");
            let description = inner
                .membership
                .get(own)
                .map(|member| member.info().clone());
            if let Some(description) = description {
                let capacity = capacity_of(&description.resources);
                let joined = inner.membership.join(now, HEAD_KEY, description);
                if let Some(ended) = joined.ended {
                    self.end_session(&ended);
                }
                let _ = self.table.add_node(joined.node, capacity);
                inner.own_session = joined.session;
            }
        }
        for event in inner.membership.tick(now) {
            self.report(&event);
        }
    }

    /// Logs `event`, tells subscribers, and takes a node whose session ended out of the
    /// table. Called with the membership locked when it ends a session.
    fn report(&self, event: &MembershipEvent) {
        match *event {
            MembershipEvent::NodeSuspect {
                node,
                session,
                silent_for_ms,
                ..
            } => {
                warn!(%node, %session, silent_for_ms, "node suspect: no heartbeat for half the window");
                self.send(ClusterEvent::NodeSuspect { node, session });
            }
            MembershipEvent::NodeRecovered {
                node,
                session,
                silent_for_ms,
            } => {
                info!(%node, %session, silent_for_ms, "node heard from again");
                self.send(ClusterEvent::NodeRecovered { node, session });
            }
            _ => self.end_session(event),
        }
    }

    /// Removes the node of an ended session from the table and reports what it held.
    fn end_session(&self, event: &MembershipEvent) {
        let (node, session, reason) = match *event {
            MembershipEvent::NodeDead {
                node,
                session,
                silent_for_ms,
                ..
            } => {
                info!(%node, %session, silent_for_ms, "node dead: no heartbeat for the whole window");
                (node, session, LossReason::Dead)
            }
            MembershipEvent::NodeLeft { node, session } => {
                info!(%node, %session, "node left");
                (node, session, LossReason::Left)
            }
            MembershipEvent::NodeReplaced {
                node,
                old_session,
                new_session,
            } => {
                info!(%node, session = %old_session, %new_session, "node joined again; its previous session ended");
                (node, old_session, LossReason::Replaced)
            }
            MembershipEvent::NodeSuspect { .. } | MembershipEvent::NodeRecovered { .. } => return,
        };
        let reservations = self.table.remove_node(node);
        for reservation in &reservations {
            warn!(
                %node,
                reservation = %reservation.id,
                owner = %reservation.owner,
                resources = %reservation.resources,
                "reservation lost with its node"
            );
        }
        self.send(ClusterEvent::NodeLost {
            node,
            session,
            reason,
            reservations,
        });
    }

    fn send(&self, event: ClusterEvent) {
        // An error only means nobody subscribed.
        let _ = self.events.send(event);
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Nothing under this lock panics on input; a poisoned lock holds a consistent
        // membership all the same.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Refuses a message about `node` from a peer that is not that node.
fn check_owner(
    membership: &Membership<NodeDescription>,
    key: &str,
    node: NodeId,
) -> Result<(), String> {
    match membership.get(node) {
        Some(member) if member.key() == key => Ok(()),
        Some(_) => Err(format!(
            "node {node} belongs to another certificate than {key}"
        )),
        None => Err(MembershipError::UnknownNode { node }.to_string()),
    }
}

/// The samples of a heartbeat of `node` taken in `session`, replacing those before.
fn record_samples(inner: &mut Inner, node: NodeId, session: SessionId, samples: &[GpuSampleWire]) {
    inner.samples.insert(
        node,
        NodeSamples {
            session,
            gpus: samples_of(samples),
        },
    );
}

fn node_status(member: &Member<NodeDescription>, now: u64, samples: &[GpuSample]) -> NodeStatus {
    let info = member.info();
    let gpus = &info.resources.gpus;
    NodeStatus {
        id: member.id(),
        address: info.address.clone(),
        hostname: info.hostname.clone(),
        state: member.state(),
        uptime_ms: now.saturating_sub(member.joined_at_ms()),
        last_heartbeat_ms_ago: now.saturating_sub(member.last_heartbeat_ms()),
        cpus: info.resources.cpus,
        memory_bytes: info.resources.memory_bytes,
        gpus: gpus
            .iter()
            .zip(use_of_each(gpus, samples))
            .map(|(gpu, usage)| GpuStatus {
                index: gpu.index,
                name: gpu.name.clone(),
                memory_bytes: gpu.memory_bytes,
                uuid: gpu.uuid.clone(),
                utilization_percent: usage.utilization_percent,
                memory_used_bytes: usage.memory_used_bytes,
            })
            .collect(),
        used: Default::default(),
    }
}

/// The use of each of a node's `gpus` (as it described them when it joined), in their
/// order, from the `samples` of its newest heartbeat:
/// - a GPU's use is that of the first sample of its physical index;
/// - a GPU no sample names is unknown;
/// - a claimed GPU is unknown whatever the samples say: its index is only its position
///   among the node's GPUs, which a real GPU's index may equal;
/// - a sample of an index the node does not offer is ignored.
fn use_of_each(gpus: &[GpuWire], samples: &[GpuSample]) -> Vec<GpuUse> {
    gpus.iter()
        .map(|gpu| {
            if is_claimed_uuid(&gpu.uuid) {
                return GpuUse::default();
            }
            samples
                .iter()
                .find(|sample| sample.index == gpu.index)
                .map_or_else(GpuUse::default, |sample| sample.usage)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: u32, uuid: &str) -> GpuWire {
        GpuWire {
            index,
            name: "NVIDIA H100 80GB HBM3".into(),
            memory_bytes: Some(80 << 30),
            uuid: uuid.into(),
        }
    }

    fn sample(index: u32, percent: u32) -> GpuSample {
        GpuSample {
            index,
            usage: used(percent),
        }
    }

    /// The use a sample of `percent` carries: that percentage and as many GiB.
    fn used(percent: u32) -> GpuUse {
        GpuUse {
            utilization_percent: Some(percent),
            memory_used_bytes: Some(u64::from(percent) << 30),
        }
    }

    const NONE: GpuUse = GpuUse {
        utilization_percent: None,
        memory_used_bytes: None,
    };

    #[test]
    fn samples_fill_the_gpus_they_name() {
        let partial = GpuSample {
            index: 1,
            usage: GpuUse {
                utilization_percent: None,
                memory_used_bytes: Some(7),
            },
        };
        // (what, the node's GPUs, its samples, each GPU's use)
        type Case = (&'static str, Vec<GpuWire>, Vec<GpuSample>, Vec<GpuUse>);
        let cases: Vec<Case> = vec![
            ("no gpus", vec![], vec![sample(0, 5)], vec![]),
            (
                "no samples",
                vec![gpu(0, "GPU-a"), gpu(1, "GPU-b")],
                vec![],
                vec![NONE, NONE],
            ),
            (
                "by index, in any order",
                vec![gpu(0, "GPU-a"), gpu(1, "GPU-b")],
                vec![sample(1, 20), sample(0, 10)],
                vec![used(10), used(20)],
            ),
            (
                "physical indices, not positions",
                vec![gpu(3, "GPU-d"), gpu(1, "GPU-b")],
                vec![sample(1, 20), sample(3, 40)],
                vec![used(40), used(20)],
            ),
            (
                "a missing sample is unknown",
                vec![gpu(0, "GPU-a"), gpu(1, "GPU-b")],
                vec![sample(0, 10)],
                vec![used(10), NONE],
            ),
            (
                "a sample of an unknown gpu is ignored",
                vec![gpu(0, "GPU-a")],
                vec![sample(5, 50), sample(0, 10)],
                vec![used(10)],
            ),
            (
                "a claimed gpu is unknown, even where its position is a sampled index",
                vec![gpu(2, "GPU-c"), gpu(1, "claimed-1"), gpu(2, "claimed-2")],
                vec![sample(2, 20), sample(1, 10)],
                vec![used(20), NONE, NONE],
            ),
            (
                "the first sample of an index counts",
                vec![gpu(0, "GPU-a")],
                vec![sample(0, 10), sample(0, 90)],
                vec![used(10)],
            ),
            (
                "a part-known sample stays part-known",
                vec![gpu(1, "GPU-b")],
                vec![partial],
                vec![partial.usage],
            ),
        ];
        for (what, gpus, samples, want) in cases {
            assert_eq!(use_of_each(&gpus, &samples), want, "{what}");
        }
    }

    fn description(gpus: Vec<GpuWire>) -> NodeDescription {
        NodeDescription {
            hostname: "gpu-01".into(),
            address: "10.0.0.2:7100".into(),
            version: "0.1.0".into(),
            resources: crate::wire::ResourcesWire {
                cpus: 8,
                memory_bytes: None,
                gpus,
            },
        }
    }

    fn wire(index: u32, percent: u8) -> GpuSampleWire {
        GpuSampleWire {
            index,
            usage: crate::status::gpu_use_wire(used(u32::from(percent))),
        }
    }

    /// Each GPU's use of `node` in the status.
    fn uses(members: &Members, node: NodeId) -> Vec<GpuUse> {
        let status = members.status();
        let node = status.node(node).expect("the node is in the status");
        node.gpus
            .iter()
            .map(|gpu| GpuUse {
                utilization_percent: gpu.utilization_percent,
                memory_used_bytes: gpu.memory_used_bytes,
            })
            .collect()
    }

    #[test]
    fn the_status_shows_the_newest_samples_of_a_session_that_is_on() {
        let members = Members::new(
            MembershipConfig::default(),
            description(vec![gpu(0, "GPU-h")]),
            SessionId(1),
            GpuSampler::fixed(vec![sample(0, 50)]),
        );
        let head = members.own_id();
        assert_eq!(uses(&members, head), [used(50)]);
        let gpus = vec![gpu(0, "GPU-a"), gpu(1, "claimed-1")];
        let (node, session, key) = members.join("node-a", description(gpus.clone()));
        let key = key.expect("a heartbeat key").hmac();
        let beat = |seq| BeatPacket {
            kind: BeatKind::Beat,
            node_id: node.0,
            session: session.0,
            seq,
        };
        assert_eq!(uses(&members, node), [NONE, NONE], "before any beat");
        // (what, a heartbeat, whether the head takes it, each GPU's use after it)
        type Step<'a> = (&'a str, Box<dyn Fn() -> bool + 'a>, bool, [GpuUse; 2]);
        let steps: Vec<Step> = vec![
            (
                "a UDP beat",
                Box::new(|| {
                    let datagram = beat(1).seal_with_samples(&[wire(0, 10), wire(1, 99)], &key);
                    members.datagram_beat(&datagram).is_ok()
                }),
                true,
                [used(10), NONE],
            ),
            (
                "a QUIC beat",
                Box::new(|| {
                    members
                        .heartbeat("node-a", node, session, &[wire(0, 30)])
                        .is_ok()
                }),
                true,
                [used(30), NONE],
            ),
            (
                "a replayed UDP beat",
                Box::new(|| {
                    let datagram = beat(1).seal_with_samples(&[wire(0, 70)], &key);
                    members.datagram_beat(&datagram).is_ok()
                }),
                false,
                [used(30), NONE],
            ),
            (
                "a beat of another node's certificate",
                Box::new(|| {
                    members
                        .heartbeat("node-b", node, session, &[wire(0, 70)])
                        .is_ok()
                }),
                false,
                [used(30), NONE],
            ),
            (
                "a UDP beat without samples",
                Box::new(|| members.datagram_beat(&beat(2).seal(&key)).is_ok()),
                true,
                [NONE, NONE],
            ),
        ];
        for (what, step, taken, want) in steps {
            assert_eq!(step(), taken, "{what}");
            assert_eq!(uses(&members, node), want, "{what}");
        }
        members
            .heartbeat("node-a", node, session, &[wire(0, 30)])
            .expect("a beat");
        let (again, _, _) = members.join("node-a", description(gpus));
        assert_eq!(again, node);
        assert_eq!(uses(&members, node), [NONE, NONE], "a new session");
        assert_eq!(uses(&members, head), [used(50)]);
    }
}
