//! [`Mixer`]: one rank's side of decentralized averaging. Each step the [`Topology`] puts
//! the rank in a group; the group's members replace a buffer with its mean over them.
//!
//! A rank meets only a few distinct groups over a period of its schedule (two neighbours
//! on the ring, one peer per distance on the exponential graph), so the mixer holds one
//! small ring ([`RingGroup`]) per distinct group and runs the group's mean on it: the
//! members end bit-identical, a disagreement on the operation or its size fails every
//! member instead of corrupting the buffer, and a lost member fails the others within the
//! ring's operation timeout. A group of one (a rank that rests in a step) does nothing.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use tokio::net::TcpListener;

use super::{CollectiveError, CollectiveOptions, RingGroup, RingSecret, Topology};

/// Why a mixing step failed.
#[derive(Debug, thiserror::Error)]
pub enum MixError {
    /// Positions inside `group` are what the inner error calls ranks.
    #[error(
        "rank {rank}: mixing at step {step} with ranks {group:?} (the ranks below are positions in that group): {source}"
    )]
    Group {
        rank: u32,
        step: u64,
        group: Vec<u32>,
        source: CollectiveError,
    },
    #[error(
        "rank {rank}: connecting the group {group:?} (the ranks below are positions in it): {source}"
    )]
    Connect {
        rank: u32,
        group: Vec<u32>,
        source: CollectiveError,
    },
    #[error("rank {rank}: {given} listener(s) for {} group(s) {groups:?}", groups.len())]
    Listeners {
        rank: u32,
        given: usize,
        groups: Vec<Vec<u32>>,
    },
    #[error("rank {rank} is not below the world size {world}")]
    NoSuchRank { rank: u32, world: usize },
    /// Its owner gave up on the mixing in flight (a peer is lost); the mixer is dropped.
    #[error("mixing was aborted: a peer is lost")]
    Aborted,
    #[error("rank {rank}: no address for rank {peer} of the group {group:?}")]
    NoAddress {
        rank: u32,
        peer: u32,
        group: Vec<u32>,
    },
}

/// This rank's groups over one period of a [`Topology`], each with its ring.
#[derive(Debug)]
pub struct Mixer {
    rank: u32,
    topology: Topology,
    nodes: Vec<u32>,
    period: u64,
    /// The index into `groups` of each step of the period (`None`: this rank rests).
    by_step: Vec<Option<usize>>,
    groups: Vec<(Vec<u32>, RingGroup)>,
}

impl Mixer {
    /// The distinct groups of `rank` (two members or more) over one period of
    /// `topology` on a world laid out as `nodes` (the node of every rank), in the order
    /// they first occur.
    pub fn groups_of(topology: Topology, nodes: &[u32], rank: u32) -> Vec<Vec<u32>> {
        let mut groups: Vec<Vec<u32>> = Vec::new();
        for step in 0..topology.period(nodes) {
            let group = topology.group_of(nodes, step, rank);
            if group.len() > 1 && !groups.contains(&group) {
                groups.push(group);
            }
        }
        groups
    }

    /// Every rank's mixer of a world in this process, over in-memory links (tests).
    pub fn in_memory(topology: Topology, nodes: &[u32], options: CollectiveOptions) -> Vec<Mixer> {
        let world = nodes.len();
        let mut rings: BTreeMap<(Vec<u32>, u32), RingGroup> = BTreeMap::new();
        for rank in 0..world as u32 {
            for group in Self::groups_of(topology, nodes, rank) {
                if group[0] == rank {
                    let members = RingGroup::in_memory(group.len(), options.clone());
                    for (member, ring) in group.iter().zip(members) {
                        rings.insert((group.clone(), *member), ring);
                    }
                }
            }
        }
        (0..world as u32)
            .map(|rank| {
                let groups = Self::groups_of(topology, nodes, rank)
                    .into_iter()
                    .map(|group| {
                        // Every member's ring was made when the group's first rank was seen.
                        let ring = rings
                            .remove(&(group.clone(), rank))
                            .expect("each group's rings are made with its first rank");
                        (group, ring)
                    })
                    .collect();
                Self::new(rank, topology, nodes, groups)
            })
            .collect()
    }

    /// Connects this rank's groups over TCP. `listeners` holds one listener per group of
    /// [`Mixer::groups_of`], in that order; `address(group, peer)` is where `peer` listens
    /// for `group`. Within a group, each member accepts the one before it and connects to
    /// the one after it (in rank order), proving knowledge of `secret` for
    /// the ring `{ring_id}/mix/{group}`.
    #[allow(clippy::too_many_arguments)] // RingGroup::connect's arguments and the schedule's
    pub async fn connect(
        rank: u32,
        topology: Topology,
        nodes: &[u32],
        listeners: Vec<TcpListener>,
        address: impl Fn(&[u32], u32) -> Option<SocketAddr>,
        secret: &RingSecret,
        ring_id: &str,
        options: CollectiveOptions,
    ) -> Result<Mixer, MixError> {
        let world = nodes.len();
        if rank as usize >= world {
            return Err(MixError::NoSuchRank { rank, world });
        }
        let wanted = Self::groups_of(topology, nodes, rank);
        if listeners.len() != wanted.len() {
            return Err(MixError::Listeners {
                rank,
                given: listeners.len(),
                groups: wanted,
            });
        }
        // One group after the other, in the order of their first step. Every member
        // orders a group by the same first step, so the incomplete group that occurs
        // first has all its members at it, and the connections cannot wait in a circle.
        let mut groups = Vec::with_capacity(wanted.len());
        for (group, listener) in wanted.into_iter().zip(listeners) {
            let position = group.iter().position(|&r| r == rank).unwrap_or(0);
            let next = group[(position + 1) % group.len()];
            let Some(next_addr) = address(&group, next) else {
                return Err(MixError::NoAddress {
                    rank,
                    peer: next,
                    group,
                });
            };
            let group_ring_id = format!("{ring_id}/mix/{group:?}");
            let connected = RingGroup::connect(
                position,
                group.len(),
                listener,
                next_addr,
                secret,
                &group_ring_id,
                options.clone(),
            )
            .await;
            match connected {
                Ok(ring) => groups.push((group, ring)),
                Err(source) => {
                    return Err(MixError::Connect {
                        rank,
                        group,
                        source,
                    });
                }
            }
        }
        Ok(Self::new(rank, topology, nodes, groups))
    }

    fn new(
        rank: u32,
        topology: Topology,
        nodes: &[u32],
        groups: Vec<(Vec<u32>, RingGroup)>,
    ) -> Mixer {
        let period = topology.period(nodes);
        let by_step = (0..period)
            .map(|step| {
                let group = topology.group_of(nodes, step, rank);
                groups.iter().position(|(members, _)| *members == group)
            })
            .collect();
        Mixer {
            rank,
            topology,
            nodes: nodes.to_vec(),
            period,
            by_step,
            groups,
        }
    }

    pub fn rank(&self) -> u32 {
        self.rank
    }

    pub fn topology(&self) -> Topology {
        self.topology
    }

    /// The ranks this rank averages with at `step`, itself included.
    pub fn group(&self, step: u64) -> Vec<u32> {
        self.topology.group_of(&self.nodes, step, self.rank)
    }

    /// Replaces `buffer` with its mean over this rank's group of `step`; returns the
    /// group's size (1: this rank rests and `buffer` is unchanged). Every member must
    /// call it for the same step with a buffer of the same length.
    pub async fn mix(&mut self, step: u64, buffer: &mut [f32]) -> Result<usize, MixError> {
        let Some(index) = self.by_step[(step % self.period) as usize] else {
            return Ok(1);
        };
        let (group, ring) = &mut self.groups[index];
        ring.allreduce_mean_weighted(buffer, 1.0)
            .await
            .map_err(|source| MixError::Group {
                rank: self.rank,
                step,
                group: group.clone(),
                source,
            })?;
        Ok(group.len())
    }
}
