//! Who averages with whom in decentralized training: each step, a [`Topology`] cuts the
//! world into groups whose members average their parameters with equal weights. The
//! schedule is a pure function of the world's layout (the node of every rank) and the
//! step, so every rank computes the same groups without talking to anyone.
//!
//! Every step's groups are a partition of the ranks, and a group's members each take the
//! mean of the group. The mixing matrix of a step is therefore doubly stochastic: the
//! mean of the parameters over all ranks never changes, only their spread shrinks.
//! Unlike Decent-DP's topologies, these are defined for every world size; where a rank
//! has no partner in a step, it keeps its own parameters for that step (a group of one).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A decentralized training topology (`train.topology`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Topology {
    /// One group of every rank each step: the global mean (an allreduce of parameters).
    Complete,
    /// Neighbours on the ring of ranks, in pairs. With an even world, even steps pair
    /// (0,1), (2,3), ... and odd steps (1,2), (3,4), ..., (n-1,0). With an odd world, rank
    /// `step mod n` rests and the others pair up in ring order after it, so every ring
    /// edge is used once every n steps.
    Ring,
    /// One peer per step at distance 2^k, k cycling over the bits of the world size:
    /// rank r pairs with r XOR 2^k (that is r + 2^k or r - 2^k), and rests when that rank
    /// does not exist. With a power-of-two world, log2(n) consecutive steps give every
    /// rank the exact global mean.
    OnePeerExponential,
    /// Alternates between the node and the network: even steps average within each node,
    /// odd steps average pairs of whole nodes, chosen as [`Topology::OnePeerExponential`]
    /// chooses ranks, over node indices. On one node, every step averages the node.
    AlternatingExpRing,
}

impl Topology {
    /// Every topology, in the order the docs list them.
    pub const ALL: [Topology; 4] = [
        Topology::Complete,
        Topology::Ring,
        Topology::OnePeerExponential,
        Topology::AlternatingExpRing,
    ];

    /// The name used in configuration files and output.
    pub fn name(self) -> &'static str {
        match self {
            Topology::Complete => "complete",
            Topology::Ring => "ring",
            Topology::OnePeerExponential => "one-peer-exponential",
            Topology::AlternatingExpRing => "alternating-exp-ring",
        }
    }

    /// The groups of `step`: a partition of the ranks `0..nodes.len()`, each group in
    /// ascending rank order and the groups ordered by their first rank. `nodes[r]` is the
    /// node of rank `r` (any labels; only equality matters).
    pub fn groups(self, nodes: &[u32], step: u64) -> Vec<Vec<u32>> {
        let n = nodes.len();
        let mut groups = match self {
            Topology::Complete => vec![(0..n as u32).collect()],
            Topology::Ring => ring_pairs(n, step),
            Topology::OnePeerExponential => exponential_pairs(n, step),
            Topology::AlternatingExpRing => alternating(nodes, step),
        };
        for group in &mut groups {
            group.sort_unstable();
        }
        groups.retain(|group| !group.is_empty());
        groups.sort_unstable_by_key(|group| group[0]);
        groups
    }

    /// The group `rank` belongs to at `step` (itself alone when `rank` is out of range).
    pub fn group_of(self, nodes: &[u32], step: u64, rank: u32) -> Vec<u32> {
        self.groups(nodes, step)
            .into_iter()
            .find(|group| group.contains(&rank))
            .unwrap_or_else(|| vec![rank])
    }

    /// Steps after which the schedule repeats itself.
    pub fn period(self, nodes: &[u32]) -> u64 {
        let n = nodes.len();
        match self {
            Topology::Complete => 1,
            Topology::Ring if n <= 2 => 1,
            Topology::Ring if n.is_multiple_of(2) => 2,
            Topology::Ring => n as u64,
            Topology::OnePeerExponential => u64::from(bits(n)).max(1),
            Topology::AlternatingExpRing => {
                let machines = node_ranks(nodes).len();
                if machines <= 1 {
                    1
                } else {
                    2 * u64::from(bits(machines))
                }
            }
        }
    }

    /// One line per step of one period, for `imgrun plan`: `step 1: {0,3} {1,2}`.
    pub fn describe(self, nodes: &[u32]) -> Vec<String> {
        (0..self.period(nodes))
            .map(|step| {
                let groups: Vec<String> = self
                    .groups(nodes, step)
                    .iter()
                    .map(|group| {
                        let ranks: Vec<String> = group.iter().map(u32::to_string).collect();
                        format!("{{{}}}", ranks.join(","))
                    })
                    .collect();
                format!("step {step}: {}", groups.join(" "))
            })
            .collect()
    }
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The node of every rank of a world laid out as `node_ranks` (ranks on each node, ranks
/// numbered node by node): the `nodes` a [`Topology`] reads.
pub fn node_of_each_rank(node_ranks: &[u32]) -> Vec<u32> {
    node_ranks
        .iter()
        .enumerate()
        .flat_map(|(node, &count)| std::iter::repeat_n(node as u32, count as usize))
        .collect()
}

/// A name that is no topology.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown topology `{0}` (one of complete, ring, one-peer-exponential, alternating-exp-ring)"
)]
pub struct UnknownTopology(pub String);

impl FromStr for Topology {
    type Err = UnknownTopology;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        Topology::ALL
            .into_iter()
            .find(|topology| topology.name() == name)
            .ok_or_else(|| UnknownTopology(name.to_owned()))
    }
}

/// Bits needed to name `n` things (the rounds of an exponential schedule): 0 for n <= 1.
fn bits(n: usize) -> u32 {
    if n <= 1 {
        0
    } else {
        usize::BITS - (n - 1).leading_zeros()
    }
}

fn ring_pairs(n: usize, step: u64) -> Vec<Vec<u32>> {
    if n <= 2 {
        return vec![(0..n as u32).collect()];
    }
    let at = |i: usize| (i % n) as u32;
    if n.is_multiple_of(2) {
        let offset = (step % 2) as usize;
        (0..n / 2)
            .map(|i| vec![at(offset + 2 * i), at(offset + 2 * i + 1)])
            .collect()
    } else {
        let rest = (step % n as u64) as usize;
        let mut groups = vec![vec![rest as u32]];
        groups.extend((0..n / 2).map(|i| vec![at(rest + 1 + 2 * i), at(rest + 2 + 2 * i)]));
        groups
    }
}

/// Pairs `i <-> i XOR 2^k` among `0..n`, with `k = step mod bits(n)`; the unpaired rest.
fn exponential_pairs(n: usize, step: u64) -> Vec<Vec<u32>> {
    let rounds = bits(n);
    if rounds == 0 {
        return vec![(0..n as u32).collect()];
    }
    let distance = 1usize << (step % u64::from(rounds));
    (0..n)
        .filter_map(|i| {
            let peer = i ^ distance;
            if peer >= n {
                Some(vec![i as u32])
            } else if i < peer {
                Some(vec![i as u32, peer as u32])
            } else {
                None
            }
        })
        .collect()
}

fn alternating(nodes: &[u32], step: u64) -> Vec<Vec<u32>> {
    let machines = node_ranks(nodes);
    if machines.len() <= 1 || step.is_multiple_of(2) {
        return machines;
    }
    exponential_pairs(machines.len(), step / 2)
        .into_iter()
        .map(|pair| {
            pair.iter()
                .flat_map(|&machine| machines[machine as usize].iter().copied())
                .collect()
        })
        .collect()
}

/// The ranks of each node, nodes in the order of their first rank.
fn node_ranks(nodes: &[u32]) -> Vec<Vec<u32>> {
    let mut machines: Vec<(u32, Vec<u32>)> = Vec::new();
    for (rank, &node) in nodes.iter().enumerate() {
        match machines.iter_mut().find(|(label, _)| *label == node) {
            Some((_, ranks)) => ranks.push(rank as u32),
            None => machines.push((node, vec![rank as u32])),
        }
    }
    machines.into_iter().map(|(_, ranks)| ranks).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// World layouts: one rank per node, two per node, and uneven nodes.
    fn layouts(n: usize) -> Vec<Vec<u32>> {
        let mut uneven = Vec::new();
        let mut node = 0;
        while uneven.len() < n {
            uneven.extend(std::iter::repeat_n(node, (node as usize % 3) + 1));
            node += 1;
        }
        uneven.truncate(n);
        vec![
            (0..n as u32).collect(),
            (0..n as u32).map(|r| r / 2).collect(),
            uneven,
        ]
    }

    /// Each rank's vector after averaging within the step's groups.
    fn mix(groups: &[Vec<u32>], values: &mut [Vec<f64>]) {
        for group in groups {
            let dim = values[group[0] as usize].len();
            let mut mean = vec![0.0; dim];
            for &rank in group {
                for (m, v) in mean.iter_mut().zip(&values[rank as usize]) {
                    *m += v / group.len() as f64;
                }
            }
            for &rank in group {
                values[rank as usize].clone_from(&mean);
            }
        }
    }

    fn spread(values: &[Vec<f64>]) -> f64 {
        let dim = values[0].len();
        (0..dim)
            .map(|d| {
                let (lo, hi) = values.iter().fold((f64::MAX, f64::MIN), |(lo, hi), v| {
                    (lo.min(v[d]), hi.max(v[d]))
                });
                hi - lo
            })
            .fold(0.0, f64::max)
    }

    fn start_values(n: usize) -> Vec<Vec<f64>> {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        (0..n)
            .map(|_| {
                (0..3)
                    .map(|_| {
                        state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
                        (state >> 11) as f64 / (1u64 << 53) as f64 * 10.0 - 5.0
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn every_step_is_a_partition_of_the_ranks_and_the_schedule_repeats() {
        for n in 1..=16 {
            for nodes in layouts(n) {
                for topology in Topology::ALL {
                    let period = topology.period(&nodes);
                    for step in 0..3 * period + 2 {
                        let groups = topology.groups(&nodes, step);
                        let mut seen: Vec<u32> = groups.iter().flatten().copied().collect();
                        seen.sort_unstable();
                        assert_eq!(
                            seen,
                            (0..n as u32).collect::<Vec<_>>(),
                            "{topology} n={n} nodes={nodes:?} step {step}: {groups:?}"
                        );
                        assert!(groups.windows(2).all(|w| w[0][0] < w[1][0]));
                        assert!(groups.iter().all(|g| g.windows(2).all(|w| w[0] < w[1])));
                        assert_eq!(groups, topology.groups(&nodes, step + period));
                        for rank in 0..n as u32 {
                            assert!(topology.group_of(&nodes, step, rank).contains(&rank));
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn pairwise_topologies_use_one_peer_and_the_named_distances() {
        for n in 2..=16usize {
            let nodes: Vec<u32> = (0..n as u32).collect();
            for step in 0..2 * Topology::OnePeerExponential.period(&nodes) {
                for group in Topology::OnePeerExponential.groups(&nodes, step) {
                    assert!(group.len() <= 2);
                    if let [a, b] = group[..] {
                        let distance = b - a;
                        assert!(distance.is_power_of_two(), "n={n} {a},{b}");
                        let k = step % Topology::OnePeerExponential.period(&nodes);
                        assert_eq!(distance, 1 << k, "n={n} step {step}");
                    }
                }
            }
            for step in 0..2 * Topology::Ring.period(&nodes) {
                for group in Topology::Ring.groups(&nodes, step) {
                    assert!(group.len() <= 2);
                    if let [a, b] = group[..] {
                        assert!(
                            b - a == 1 || (a == 0 && b as usize == n - 1),
                            "n={n} {a},{b}"
                        );
                    }
                }
            }
        }
        // Even worlds: nobody rests on the ring.
        let nodes: Vec<u32> = (0..6).collect();
        assert_eq!(
            Topology::Ring.describe(&nodes),
            ["step 0: {0,1} {2,3} {4,5}", "step 1: {0,5} {1,2} {3,4}"]
        );
        assert_eq!(
            Topology::OnePeerExponential.describe(&(0..4).collect::<Vec<_>>()),
            ["step 0: {0,1} {2,3}", "step 1: {0,2} {1,3}"]
        );
    }

    #[test]
    fn the_alternating_topology_averages_each_node_then_pairs_of_nodes() {
        let nodes = [0, 0, 1, 1, 2, 2, 3, 3];
        assert_eq!(
            Topology::AlternatingExpRing.describe(&nodes),
            [
                "step 0: {0,1} {2,3} {4,5} {6,7}",
                "step 1: {0,1,2,3} {4,5,6,7}",
                "step 2: {0,1} {2,3} {4,5} {6,7}",
                "step 3: {0,1,4,5} {2,3,6,7}",
            ]
        );
        assert_eq!(
            Topology::AlternatingExpRing.describe(&[7, 7, 7]),
            ["step 0: {0,1,2}"]
        );
    }

    #[test]
    fn mixing_keeps_the_mean_and_brings_the_replicas_together() {
        for n in 1..=16 {
            for nodes in layouts(n) {
                for topology in Topology::ALL {
                    let mut values = start_values(n);
                    let mean = |values: &[Vec<f64>]| -> Vec<f64> {
                        (0..3)
                            .map(|d| values.iter().map(|v| v[d]).sum::<f64>() / n as f64)
                            .collect()
                    };
                    let before = mean(&values);
                    let initial = spread(&values);
                    let period = topology.period(&nodes);
                    // A connected schedule contracts over every span of one period.
                    let rounds = 40;
                    for step in 0..rounds * period {
                        mix(&topology.groups(&nodes, step), &mut values);
                        let now = mean(&values);
                        for (a, b) in before.iter().zip(&now) {
                            assert!((a - b).abs() < 1e-9, "{topology} n={n} step {step}");
                        }
                    }
                    assert!(
                        spread(&values) <= initial * 1e-3 || n == 1,
                        "{topology} n={n} nodes={nodes:?}: spread {} from {initial}",
                        spread(&values)
                    );
                }
            }
        }
    }

    #[test]
    fn a_power_of_two_world_reaches_the_exact_mean_in_one_exponential_period() {
        for n in [2usize, 4, 8, 16] {
            let nodes: Vec<u32> = (0..n as u32).collect();
            let mut values = start_values(n);
            for step in 0..Topology::OnePeerExponential.period(&nodes) {
                mix(
                    &Topology::OnePeerExponential.groups(&nodes, step),
                    &mut values,
                );
            }
            assert!(spread(&values) < 1e-12, "n={n}: {}", spread(&values));
        }
    }

    #[test]
    fn names_round_trip_and_a_wrong_name_lists_the_choices() {
        for topology in Topology::ALL {
            assert_eq!(topology.name().parse::<Topology>(), Ok(topology));
            let json = serde_json::to_string(&topology).expect("a unit variant serialises");
            assert_eq!(json, format!("\"{}\"", topology.name()));
        }
        let error = "star"
            .parse::<Topology>()
            .expect_err("no topology is called star")
            .to_string();
        assert!(error.contains("`star`") && error.contains("one-peer-exponential"));
    }
}
