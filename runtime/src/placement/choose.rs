//! Where a request goes: the pure choice of a node for each [`Strategy`], for one request
//! or a gang, and the words for why nothing fits.

use std::cmp::Ordering;

use super::PlacementError;
use super::quantities::{Amount, Resources, scarcity};
use crate::membership::NodeId;

/// How a request picks among the nodes where it fits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Fill nodes up: the node with the least free of the requested resources (compared
    /// scarcest first: GPUs, custom resources, CPUs, memory), ties to the lowest id.
    /// Keeps whole nodes free for large requests, and a gang's GPUs together.
    Pack,
    /// Spread out: the node with the fewest reservations, then the most free of the
    /// requested resources, then the lowest id. Balances work and limits what one lost
    /// node takes down.
    Spread,
    /// On this node or nowhere.
    Node(NodeId),
}

/// The cluster as a decision about some requests sees it: per node, the amounts of the
/// requested resources only (all a decision looks at), scarcest first. Nodes may come in
/// any order; every choice breaks ties by node id.
#[derive(Debug, Clone, Default)]
pub(crate) struct View {
    names: Vec<String>,
    nodes: Vec<Candidate>,
}

#[derive(Debug, Clone)]
struct Candidate {
    node: NodeId,
    /// Amounts of `View::names`, in that order.
    total: Vec<u64>,
    free: Vec<u64>,
    reservations: usize,
}

impl View {
    /// An empty view for deciding about `requests`.
    pub(crate) fn new(requests: &[Resources]) -> Self {
        let mut names: Vec<&str> = requests
            .iter()
            .flat_map(|r| r.iter().map(|(name, _)| name))
            .collect();
        names.sort_by_key(|name| scarcity(name));
        names.dedup();
        View {
            names: names.into_iter().map(str::to_string).collect(),
            nodes: Vec::new(),
        }
    }

    /// Adds a node offering `total`, of which `used` is in use by `reservations`.
    pub(crate) fn push(
        &mut self,
        node: NodeId,
        total: &Resources,
        used: &Resources,
        reservations: usize,
    ) {
        let total: Vec<u64> = self.names.iter().map(|name| total.get(name)).collect();
        let free = self
            .names
            .iter()
            .zip(&total)
            .map(|(name, offered)| offered.saturating_sub(used.get(name)))
            .collect();
        self.nodes.push(Candidate {
            node,
            total,
            free,
            reservations,
        });
    }

    /// The same nodes with nothing reserved.
    fn idle(&self) -> View {
        let nodes = self.nodes.iter().map(|c| Candidate {
            free: c.total.clone(),
            reservations: 0,
            ..c.clone()
        });
        View {
            names: self.names.clone(),
            nodes: nodes.collect(),
        }
    }

    /// `request` as amounts of `names`. Every name it has is in `names` (see `new`).
    fn need(&self, request: &Resources) -> Vec<u64> {
        self.names.iter().map(|name| request.get(name)).collect()
    }
}

/// The node `request` goes to.
pub(crate) fn choose(
    view: &View,
    request: &Resources,
    strategy: Strategy,
) -> Result<NodeId, PlacementError> {
    let need = view.need(request);
    let chosen = pick(view, &need, strategy)?;
    match chosen {
        Some(i) => Ok(view.nodes[i].node),
        None => Err(why_not(view, &need, request, strategy)),
    }
}

/// The node of each request, in order, as if they were placed one after the other
/// (each sees the ones before it). A gang is `Unsatisfiable` when this same placement
/// would fail on an idle cluster, `Busy` otherwise.
pub(crate) fn choose_all(
    view: &View,
    requests: &[Resources],
    strategy: Strategy,
) -> Result<Vec<NodeId>, PlacementError> {
    let (error, placed) = match place_in_turn(view.clone(), requests, strategy) {
        Ok(chosen) => return Ok(chosen),
        Err(failure) => failure,
    };
    let in_gang =
        |reason: String, i: usize| format!("request {} of {}: {reason}", i + 1, requests.len());
    let reason = match error {
        PlacementError::Busy { reason } => reason,
        PlacementError::Unsatisfiable { reason } => {
            return Err(PlacementError::Unsatisfiable {
                reason: in_gang(reason, placed),
            });
        }
        other => return Err(other),
    };
    Err(match place_in_turn(view.idle(), requests, strategy) {
        Ok(_) => PlacementError::Busy {
            reason: in_gang(reason, placed),
        },
        Err((PlacementError::Unsatisfiable { reason }, i)) => PlacementError::Unsatisfiable {
            reason: in_gang(reason, i),
        },
        Err((PlacementError::Busy { .. }, fitted)) => {
            let needed = requests
                .iter()
                .fold(Resources::new(), |sum, r| sum.saturating_add(r));
            PlacementError::Unsatisfiable {
                reason: format!(
                    "{} requests need {needed} in all; even an idle cluster takes only {fitted} of them",
                    requests.len()
                ),
            }
        }
        Err((other, _)) => other,
    })
}

/// Places `requests` one after the other on `view`; on failure, the error and how many
/// were placed before it.
fn place_in_turn(
    mut view: View,
    requests: &[Resources],
    strategy: Strategy,
) -> Result<Vec<NodeId>, (PlacementError, usize)> {
    let mut chosen = Vec::with_capacity(requests.len());
    for request in requests {
        let need = view.need(request);
        let i = match pick(&view, &need, strategy) {
            Ok(Some(i)) => i,
            Ok(None) => return Err((why_not(&view, &need, request, strategy), chosen.len())),
            Err(error) => return Err((error, chosen.len())),
        };
        let candidate = &mut view.nodes[i];
        for (free, amount) in candidate.free.iter_mut().zip(&need) {
            *free = free.saturating_sub(*amount);
        }
        candidate.reservations += 1;
        chosen.push(candidate.node);
    }
    Ok(chosen)
}

/// The index of the node `need` goes to, `None` when it fits nowhere.
fn pick(view: &View, need: &[u64], strategy: Strategy) -> Result<Option<usize>, PlacementError> {
    let fits = |c: &Candidate| need.iter().zip(&c.free).all(|(n, f)| n <= f);
    // Free amounts of the requested resources only, scarcest first.
    let by_free = |a: &Candidate, b: &Candidate| {
        (0..need.len())
            .filter(|&i| need[i] > 0)
            .map(|i| a.free[i].cmp(&b.free[i]))
            .find(|order| order.is_ne())
            .unwrap_or(Ordering::Equal)
    };
    let fitting = view.nodes.iter().enumerate().filter(|(_, c)| fits(c));
    Ok(match strategy {
        Strategy::Pack => fitting
            .min_by(|(_, a), (_, b)| by_free(a, b).then(a.node.cmp(&b.node)))
            .map(|(i, _)| i),
        Strategy::Spread => fitting
            .min_by(|(_, a), (_, b)| {
                (a.reservations.cmp(&b.reservations))
                    .then(by_free(b, a))
                    .then(a.node.cmp(&b.node))
            })
            .map(|(i, _)| i),
        Strategy::Node(node) => {
            let i = view
                .nodes
                .iter()
                .position(|c| c.node == node)
                .ok_or(PlacementError::UnknownNode { node })?;
            fits(&view.nodes[i]).then_some(i)
        }
    })
}

/// Why `request` (as `need`) fits on no node: `Unsatisfiable` when it would not fit even
/// on an idle node, `Busy` when it would.
fn why_not(view: &View, need: &[u64], request: &Resources, strategy: Strategy) -> PlacementError {
    let (nodes, place): (Vec<&Candidate>, String) = match strategy {
        Strategy::Node(node) => (
            view.nodes.iter().filter(|c| c.node == node).collect(),
            format!("node {node}"),
        ),
        Strategy::Pack | Strategy::Spread => (view.nodes.iter().collect(), "one node".to_string()),
    };
    let pinned = matches!(strategy, Strategy::Node(_));
    let requested: Vec<(usize, &str, u64)> = (0..need.len())
        .filter(|&i| need[i] > 0)
        .map(|i| (i, view.names[i].as_str(), need[i]))
        .collect();
    let needs =
        |name: &str, amount: u64| format!("needs {} on {place}", Amount::named(name, amount));
    if nodes.is_empty() {
        return PlacementError::Unsatisfiable {
            reason: format!("needs {request} on {place}; the cluster has no nodes"),
        };
    }
    let fits_idle = |c: &&Candidate| requested.iter().all(|&(i, _, n)| n <= c.total[i]);
    if !nodes.iter().any(fits_idle) {
        for &(i, name, amount) in &requested {
            let (largest, node) = most(&nodes, |c| c.total[i]);
            if largest >= amount {
                continue;
            }
            let has = match (largest, pinned) {
                (0, true) => format!("it has no {name}"),
                (0, false) => format!("no node has any {name}"),
                (_, true) => format!("it has {}", Amount::bare(name, largest)),
                (_, false) => format!(
                    "the largest node has {} (node {node})",
                    Amount::bare(name, largest)
                ),
            };
            return PlacementError::Unsatisfiable {
                reason: format!("{}; {has}", needs(name, amount)),
            };
        }
        return PlacementError::Unsatisfiable {
            reason: format!("needs {request} on {place}; no node has all of it"),
        };
    }
    for &(i, name, amount) in &requested {
        let (most_free, node) = most(&nodes, |c| c.free[i]);
        if most_free >= amount {
            continue;
        }
        let total = nodes
            .iter()
            .fold(0u64, |sum, c| sum.saturating_add(c.total[i]));
        let free = nodes
            .iter()
            .fold(0u64, |sum, c| sum.saturating_add(c.free[i]));
        let in_use = format!(
            "{} of {} in use",
            Amount::bare(name, total.saturating_sub(free)),
            Amount::named(name, total)
        );
        let reason = match (most_free, pinned) {
            (0, _) => format!("{}; {in_use}", needs(name, amount)),
            (_, true) => format!(
                "{}; {} free, {in_use}",
                needs(name, amount),
                Amount::bare(name, most_free)
            ),
            (_, false) => format!(
                "{}; the most free is {} (node {node}), {in_use}",
                needs(name, amount),
                Amount::bare(name, most_free)
            ),
        };
        return PlacementError::Busy { reason };
    }
    PlacementError::Busy {
        reason: format!("needs {request} on {place}; no node has all of it free now"),
    }
}

/// The largest `amount` among `nodes` and its node (the lowest id among equals).
fn most(nodes: &[&Candidate], amount: impl Fn(&Candidate) -> u64) -> (u64, NodeId) {
    nodes
        .iter()
        .map(|c| (amount(c), c.node))
        .max_by(|(a, x), (b, y)| a.cmp(b).then(y.cmp(x)))
        .unwrap_or((0, NodeId(0)))
}

#[cfg(test)]
#[path = "choose_tests.rs"]
pub(super) mod tests;
