//! The state of the cluster as commands see it: [`ClusterStatus`], a domain type that
//! serialises to JSON (`imgrun status --json`) and converts to and from
//! [`ClusterStatusWire`]. Per-node use and the totals are derived here, from the nodes
//! and the reservations, on both sides of the wire. The head adds its live actors, with
//! the job and rank each was labelled with. `render.rs` is its text table (`imgrun
//! status`). The head builds it and the client reads it, so it belongs to neither.

mod render;

use std::collections::BTreeMap;

use serde::{Serialize, Serializer};

use crate::actor::{ActorId, ActorLabel};
use crate::gpu::GpuUse;
use crate::membership::{NodeId, NodeState};
use crate::wire::{
    ActorLabelWire, ActorStatusWire, ClusterStatusWire, GpuUseWire, GpuWire, NodeStatusWire,
    ReservationWire, ResourcesWire,
};

/// Every node the head knows (dead ones too), what is reserved, and the totals.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ClusterStatus {
    /// The head's session: changes when the head restarts.
    pub head_session: u64,
    /// In node id order.
    pub nodes: Vec<NodeStatus>,
    pub reservations: Vec<ReservationStatus>,
    pub totals: StatusTotals,
    /// The actors that have not ended, in id order.
    pub actors: Vec<ActorStatus>,
}

/// One actor that has not ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ActorStatus {
    #[serde(serialize_with = "actor_id")]
    pub id: ActorId,
    pub kind: String,
    /// Its node; none while it waits for a restart.
    #[serde(serialize_with = "optional_node_id")]
    pub node: Option<NodeId>,
    /// `starting`, `running`, `restarting` or `stopping`.
    pub state: String,
    /// `job` and `rank` (JSON fields beside the others), when its spawner gave them.
    #[serde(flatten)]
    pub label: Option<ActorLabel>,
}

/// One node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeStatus {
    #[serde(serialize_with = "node_id")]
    pub id: NodeId,
    /// Where the node accepts connections.
    pub address: String,
    pub hostname: String,
    #[serde(serialize_with = "display")]
    pub state: NodeState,
    /// Since the node's current session started.
    pub uptime_ms: u64,
    pub last_heartbeat_ms_ago: u64,
    pub cpus: u32,
    pub memory_bytes: Option<u64>,
    pub gpus: Vec<GpuStatus>,
    /// What reservations hold on the node: resource name to amount (`cpu` in thousandths,
    /// `memory` in bytes).
    pub used: BTreeMap<String, u64>,
}

/// One GPU of a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuStatus {
    pub index: u32,
    /// The model (`claimed GPU` for one claimed with `--num-gpus`).
    pub name: String,
    pub memory_bytes: Option<u64>,
    pub uuid: String,
    /// The share of NVML's last sample period (1/6 s to 1 s) in which the GPU was busy,
    /// 0 to 100, from its node's newest heartbeat. `None` where NVML does not answer: a
    /// node without NVML (GPUs found by `nvidia-smi`), a claimed GPU, a failed read, a
    /// node whose session is over.
    pub utilization_percent: Option<u32>,
    /// Memory in use, from the same measurement; `None` where NVML does not answer.
    pub memory_used_bytes: Option<u64>,
}

/// Resources held on a node, and by whom.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReservationStatus {
    #[serde(serialize_with = "node_id")]
    pub node: NodeId,
    /// E.g. `actor:12`.
    pub owner: String,
    pub resources: BTreeMap<String, u64>,
}

/// What the live nodes (alive or suspect) offer together, and what of it is in use.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct StatusTotals {
    /// Live nodes.
    pub nodes: usize,
    pub cpus: u64,
    pub memory_bytes: u64,
    pub gpus: u64,
    pub reservations: usize,
    /// Resource name to amount, over every reservation.
    pub used: BTreeMap<String, u64>,
}

impl ClusterStatus {
    /// The status of `nodes` with `reservations`; per-node use and totals are derived.
    pub fn new(
        head_session: u64,
        mut nodes: Vec<NodeStatus>,
        reservations: Vec<ReservationStatus>,
    ) -> Self {
        nodes.sort_by_key(|node| node.id);
        let mut totals = StatusTotals::default();
        for node in &mut nodes {
            node.used.clear();
            for reservation in reservations.iter().filter(|r| r.node == node.id) {
                add_into(&mut node.used, &reservation.resources);
            }
            if node.state.is_live() {
                totals.nodes += 1;
                totals.cpus += u64::from(node.cpus);
                totals.memory_bytes += node.memory_bytes.unwrap_or(0);
                totals.gpus += node.gpus.len() as u64;
            }
        }
        for reservation in &reservations {
            add_into(&mut totals.used, &reservation.resources);
        }
        totals.reservations = reservations.len();
        ClusterStatus {
            head_session,
            nodes,
            reservations,
            totals,
            actors: Vec::new(),
        }
    }

    /// This status with `actors` (put in id order).
    pub fn with_actors(mut self, mut actors: Vec<ActorStatus>) -> Self {
        actors.sort_by_key(|actor| actor.id);
        self.actors = actors;
        self
    }

    /// The nodes whose session is on.
    pub fn live_nodes(&self) -> impl Iterator<Item = &NodeStatus> {
        self.nodes.iter().filter(|node| node.state.is_live())
    }

    /// The node with this id.
    pub fn node(&self, id: NodeId) -> Option<&NodeStatus> {
        self.nodes.iter().find(|node| node.id == id)
    }

    pub fn to_wire(&self) -> ClusterStatusWire {
        ClusterStatusWire {
            session: self.head_session,
            nodes: self.nodes.iter().map(NodeStatus::to_wire).collect(),
            reservations: self
                .reservations
                .iter()
                .map(|reservation| ReservationWire {
                    node_id: reservation.node.0,
                    owner: reservation.owner.clone(),
                    resources: reservation
                        .resources
                        .iter()
                        .map(|(name, amount)| (name.clone(), *amount))
                        .collect(),
                })
                .collect(),
            actors: self
                .actors
                .iter()
                .map(|actor| ActorStatusWire {
                    actor_id: actor.id.0,
                    kind: actor.kind.clone(),
                    node_id: actor.node.map_or(0, |node| node.0),
                    state: actor.state.clone(),
                    label: actor.label.as_ref().map(|label| ActorLabelWire {
                        job: label.job.clone(),
                        rank: label.rank,
                    }),
                })
                .collect(),
        }
    }

    /// Reads a status from the wire; a state this version does not know is an error.
    pub fn from_wire(wire: ClusterStatusWire) -> Result<Self, String> {
        let nodes = wire
            .nodes
            .into_iter()
            .map(NodeStatus::from_wire)
            .collect::<Result<_, _>>()?;
        let reservations = wire
            .reservations
            .into_iter()
            .map(|reservation| ReservationStatus {
                node: NodeId(reservation.node_id),
                owner: reservation.owner,
                resources: sum_pairs(reservation.resources),
            })
            .collect();
        let actors = wire
            .actors
            .into_iter()
            .map(|actor| ActorStatus {
                id: ActorId(actor.actor_id),
                kind: actor.kind,
                node: (actor.node_id != 0).then_some(NodeId(actor.node_id)),
                state: actor.state,
                label: actor
                    .label
                    .map(|label| ActorLabel::new(label.job, label.rank)),
            })
            .collect();
        Ok(ClusterStatus::new(wire.session, nodes, reservations).with_actors(actors))
    }
}

impl NodeStatus {
    /// The CPU (in thousandths) of the node that no reservation holds.
    pub fn free_cpu_millis(&self) -> u64 {
        let used = self
            .used
            .get(crate::placement::Resources::CPU)
            .copied()
            .unwrap_or(0);
        (u64::from(self.cpus) * 1000).saturating_sub(used)
    }

    fn to_wire(&self) -> NodeStatusWire {
        NodeStatusWire {
            node_id: self.id.0,
            address: self.address.clone(),
            hostname: self.hostname.clone(),
            state: self.state.to_string(),
            uptime_ms: self.uptime_ms,
            last_heartbeat_ms_ago: self.last_heartbeat_ms_ago,
            resources: ResourcesWire {
                cpus: self.cpus,
                memory_bytes: self.memory_bytes,
                gpus: self
                    .gpus
                    .iter()
                    .map(|gpu| GpuWire {
                        index: gpu.index,
                        name: gpu.name.clone(),
                        memory_bytes: gpu.memory_bytes,
                        uuid: gpu.uuid.clone(),
                    })
                    .collect(),
            },
            gpu_use: self
                .gpus
                .iter()
                .map(|gpu| {
                    gpu_use_wire(GpuUse {
                        utilization_percent: gpu.utilization_percent,
                        memory_used_bytes: gpu.memory_used_bytes,
                    })
                })
                .collect(),
        }
    }

    fn from_wire(wire: NodeStatusWire) -> Result<Self, String> {
        let state = parse_state(&wire.state)
            .ok_or_else(|| format!("node {}: unknown state {:?}", wire.node_id, wire.state))?;
        Ok(NodeStatus {
            id: NodeId(wire.node_id),
            address: wire.address,
            hostname: wire.hostname,
            state,
            uptime_ms: wire.uptime_ms,
            last_heartbeat_ms_ago: wire.last_heartbeat_ms_ago,
            cpus: wire.resources.cpus,
            memory_bytes: wire.resources.memory_bytes,
            gpus: wire
                .resources
                .gpus
                .into_iter()
                .enumerate()
                .map(|(position, gpu)| {
                    let usage = wire
                        .gpu_use
                        .get(position)
                        .copied()
                        .map(gpu_use_of)
                        .unwrap_or_default();
                    GpuStatus {
                        index: gpu.index,
                        name: gpu.name,
                        memory_bytes: gpu.memory_bytes,
                        uuid: gpu.uuid,
                        utilization_percent: usage.utilization_percent,
                        memory_used_bytes: usage.memory_used_bytes,
                    }
                })
                .collect(),
            used: BTreeMap::new(),
        })
    }
}

fn parse_state(text: &str) -> Option<NodeState> {
    [
        NodeState::Alive,
        NodeState::Suspect,
        NodeState::Dead,
        NodeState::Left,
    ]
    .into_iter()
    .find(|state| state.to_string() == text)
}

fn add_into(sum: &mut BTreeMap<String, u64>, amounts: &BTreeMap<String, u64>) {
    for (name, amount) in amounts {
        let total = sum.entry(name.clone()).or_default();
        *total = total.saturating_add(*amount);
    }
}

/// (name, amount) pairs as a map, amounts of a repeated name added.
fn sum_pairs(pairs: Vec<(String, u64)>) -> BTreeMap<String, u64> {
    let mut sum = BTreeMap::new();
    for (name, amount) in pairs {
        let total: &mut u64 = sum.entry(name).or_default();
        *total = total.saturating_add(amount);
    }
    sum
}

fn node_id<S: Serializer>(id: &NodeId, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_u64(id.0)
}

fn optional_node_id<S: Serializer>(id: &Option<NodeId>, serializer: S) -> Result<S::Ok, S::Error> {
    match id {
        Some(id) => serializer.serialize_u64(id.0),
        None => serializer.serialize_none(),
    }
}

fn actor_id<S: Serializer>(id: &ActorId, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_u64(id.0)
}

fn display<S: Serializer>(value: &NodeState, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.collect_str(value)
}

/// A GPU's use as the wire carries it (a heartbeat's sample, a status).
pub(crate) fn gpu_use_wire(usage: GpuUse) -> GpuUseWire {
    GpuUseWire {
        utilization_percent: usage
            .utilization_percent
            .map(|percent| u8::try_from(percent.min(100)).unwrap_or(100)),
        memory_used_bytes: usage.memory_used_bytes,
    }
}

/// A GPU's use from the wire: a utilisation above 100, which no node sends, is unknown.
pub(crate) fn gpu_use_of(wire: GpuUseWire) -> GpuUse {
    GpuUse {
        utilization_percent: wire
            .utilization_percent
            .filter(|percent| *percent <= 100)
            .map(u32::from),
        memory_used_bytes: wire.memory_used_bytes,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A status with a live head, a live node holding one GPU for `actor:3`, a dead node.
    /// No GPU has a measurement (see [`measured`]).
    pub(crate) fn sample() -> ClusterStatus {
        let gpu = |index| GpuStatus {
            index,
            name: "NVIDIA H100 80GB HBM3".into(),
            memory_bytes: Some(80 << 30),
            uuid: format!("GPU-{index}"),
            utilization_percent: None,
            memory_used_bytes: None,
        };
        let node = |id, state, gpus: Vec<GpuStatus>| NodeStatus {
            id: NodeId(id),
            address: format!("10.0.0.{id}:7070"),
            hostname: format!("gpu-{id:02}"),
            state,
            uptime_ms: 3_723_000,
            last_heartbeat_ms_ago: 120,
            cpus: 16,
            memory_bytes: Some(64 << 30),
            gpus,
            used: BTreeMap::new(),
        };
        let reservation = ReservationStatus {
            node: NodeId(2),
            owner: "actor:3".into(),
            resources: [("gpu".to_owned(), 1), ("cpu".to_owned(), 2000)].into(),
        };
        let actor = |id, label| ActorStatus {
            id: ActorId(id),
            kind: "trainer".into(),
            node: Some(NodeId(2)),
            state: "running".into(),
            label,
        };
        ClusterStatus::new(
            7,
            vec![
                node(3, NodeState::Dead, vec![gpu(0)]),
                node(1, NodeState::Alive, vec![]),
                node(2, NodeState::Suspect, vec![gpu(0), gpu(1)]),
            ],
            vec![reservation],
        )
        .with_actors(vec![
            actor(4, None),
            actor(3, Some(ActorLabel::new("run-1", 0))),
        ])
    }

    /// [`sample`] with node 2's GPU 0 measured in full and its GPU 1 only in part.
    pub(crate) fn measured() -> ClusterStatus {
        let mut status = sample();
        let gpus = &mut status.nodes[1].gpus;
        gpus[0].utilization_percent = Some(37);
        gpus[0].memory_used_bytes = Some(12_992_000_000);
        gpus[1].memory_used_bytes = Some(512 << 20);
        status
    }

    #[test]
    fn totals_count_live_nodes_and_every_reservation() {
        let status = sample();
        let ids: Vec<u64> = status.nodes.iter().map(|node| node.id.0).collect();
        assert_eq!(ids, [1, 2, 3]);
        let totals = &status.totals;
        assert_eq!(
            (totals.nodes, totals.cpus, totals.gpus, totals.reservations),
            (2, 32, 2, 1)
        );
        assert_eq!(totals.memory_bytes, 128 << 30);
        assert_eq!(totals.used.get("gpu"), Some(&1));
        assert_eq!(status.nodes[1].used.get("cpu"), Some(&2000));
        assert!(status.nodes[0].used.is_empty());
    }

    #[test]
    fn the_wire_round_trips_and_refuses_unknown_states() {
        for status in [sample(), measured()] {
            assert_eq!(
                ClusterStatus::from_wire(status.to_wire()),
                Ok(status.clone())
            );
        }
        let status = measured();
        let mut short = status.to_wire();
        // A list of uses shorter than the GPUs: the others are unknown.
        short.nodes[1].gpu_use.truncate(1);
        let read = ClusterStatus::from_wire(short).expect("status");
        assert_eq!(read.nodes[1].gpus[0], status.nodes[1].gpus[0]);
        assert_eq!(read.nodes[1].gpus[1].memory_used_bytes, None);
        let mut wire = status.to_wire();
        wire.nodes[0].state = "zombie".into();
        let error = ClusterStatus::from_wire(wire).expect_err("unknown state");
        assert!(error.contains("zombie"), "{error}");
    }

    #[test]
    fn json_has_the_fields_scripts_read() {
        let json = serde_json::to_value(sample()).expect("json");
        assert_eq!(json["nodes"][0]["id"], 1);
        assert_eq!(json["nodes"][1]["state"], "suspect");
        assert_eq!(json["nodes"][1]["gpus"][1]["name"], "NVIDIA H100 80GB HBM3");
        let gpu = &json["nodes"][1]["gpus"][0];
        assert!(gpu["utilization_percent"].is_null() && gpu["memory_used_bytes"].is_null());
        let json = serde_json::to_value(measured()).expect("json");
        let gpu = &json["nodes"][1]["gpus"][0];
        assert_eq!(gpu["utilization_percent"], 37);
        assert_eq!(gpu["memory_used_bytes"], 12_992_000_000u64);
        assert_eq!(json["totals"]["gpus"], 2);
        assert_eq!(json["reservations"][0]["owner"], "actor:3");
        let actor = &json["actors"][0];
        assert_eq!(
            (&actor["id"], &actor["kind"], &actor["node"]),
            (&3.into(), &"trainer".into(), &2.into())
        );
        assert_eq!(
            (&actor["job"], &actor["rank"]),
            (&"run-1".into(), &0.into())
        );
        assert!(json["actors"][1].get("job").is_none(), "no label, no job");
    }
}
