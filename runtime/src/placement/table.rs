//! The resource table: nodes and their reservations on a `DashMap`, changed atomically
//! under one writer lock.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::{Mutex, MutexGuard, PoisonError};

use dashmap::DashMap;
use dashmap::mapref::entry::Entry;

use super::PlacementError;
use super::choose::{Strategy, View, choose, choose_all};
use super::quantities::{NodeCapacity, Resources};
use crate::membership::NodeId;

/// One reservation, unique for the life of its table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReservationId(pub u64);

impl fmt::Display for ReservationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Resources held on one node by one owner until released (or the node is removed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    pub id: ReservationId,
    pub node: NodeId,
    pub resources: Resources,
    /// The node's GPUs held, as many as `resources.gpus()`, in the node's order.
    pub gpus: Vec<u32>,
    /// Who holds it, e.g. `actor:12`.
    pub owner: String,
}

impl Reservation {
    /// `CUDA_VISIBLE_DEVICES` for the process using this reservation (`2,3`; empty when
    /// it holds no GPU). The indices are the node's, see [`crate::GpuInfo::index`].
    pub fn cuda_visible_devices(&self) -> String {
        let indices: Vec<String> = self.gpus.iter().map(u32::to_string).collect();
        indices.join(",")
    }
}

/// One node's row of [`ResourceTable::usage`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeUsage {
    pub node: NodeId,
    pub total: Resources,
    pub used: Resources,
    /// Every GPU of the node.
    pub gpus: Vec<u32>,
    /// The GPUs no reservation holds.
    pub free_gpus: Vec<u32>,
    /// In id order.
    pub reservations: Vec<Reservation>,
}

impl NodeUsage {
    pub fn free(&self) -> Resources {
        self.total.saturating_sub(&self.used)
    }
}

/// The whole table at a glance (every node in it, which the daemon keeps to live ones).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterTotals {
    pub nodes: usize,
    pub reservations: usize,
    pub total: Resources,
    pub free: Resources,
}

impl ClusterTotals {
    pub fn used(&self) -> Resources {
        self.total.saturating_sub(&self.free)
    }
}

/// What every node offers and what is reserved on it; shared by the head's tasks.
///
/// # Atomicity
///
/// Every change (`add_node`, `remove_node`, `reserve`, `reserve_all`, `release`) holds
/// one mutex, the writer lock, from its first read of the nodes to its last write.
/// Placement needs this: `Pack` and `Spread` compare every node and a gang writes to
/// several, so the choice and the commit must see one cluster that no other change moves
/// in between. With one writer at a time that holds by construction: two requests cannot
/// both take the last GPU, a refused request or gang leaves nothing behind (it is decided
/// on a copy before anything is written), and there is no lock order to get wrong and no
/// retry loop to bound. Locking only the chosen node's entry and re-checking there would
/// let unrelated reservations run in parallel, but cannot make a gang atomic: that needs
/// several entries locked at once, which `DashMap` does not allow from one thread (two
/// entries of one shard deadlock). A decision is one pass over the nodes, microseconds
/// for hundreds of them, so one writer serves far more than the thousands of reservations
/// a second the head needs.
///
/// Readers (`usage`, `totals`, `reservation`) never take the writer lock and never wait
/// for a decision; they see each node consistent on its own, and may see a gang that is
/// being written half done. No one holds two map entries at once, so nothing deadlocks.
#[derive(Debug, Default)]
pub struct ResourceTable {
    nodes: DashMap<NodeId, NodeEntry>,
    /// Where each reservation is, to release it without a search.
    index: DashMap<ReservationId, NodeId>,
    writer: Mutex<Writer>,
}

impl ResourceTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a node offering `capacity` (a [`NodeCapacity`], or plain [`Resources`] whose
    /// GPUs are numbered from 0). A node already there must be removed first.
    pub fn add_node(
        &self,
        node: NodeId,
        capacity: impl Into<NodeCapacity>,
    ) -> Result<(), PlacementError> {
        let _writer = self.lock();
        match self.nodes.entry(node) {
            Entry::Occupied(_) => Err(PlacementError::NodeExists { node }),
            Entry::Vacant(vacant) => {
                vacant.insert(NodeEntry::new(capacity.into()));
                Ok(())
            }
        }
    }

    /// Removes a node and returns the reservations lost with it (in id order), for the
    /// daemon to report to their owners. Nothing for a node not in the table.
    pub fn remove_node(&self, node: NodeId) -> Vec<Reservation> {
        let _writer = self.lock();
        let Some((_, entry)) = self.nodes.remove(&node) else {
            return Vec::new();
        };
        for id in entry.reservations.keys() {
            self.index.remove(id);
        }
        entry.reservations.into_values().collect()
    }

    /// Reserves `request` for `owner` on the node `strategy` picks, or refuses it with
    /// nothing reserved.
    pub fn reserve(
        &self,
        request: &Resources,
        strategy: Strategy,
        owner: &str,
    ) -> Result<Reservation, PlacementError> {
        let mut writer = self.lock();
        let node = choose(&self.view(std::slice::from_ref(request)), request, strategy)?;
        Ok(self.commit(&mut writer, node, request, owner))
    }

    /// Reserves every request for `owner` (a gang: one per trainer, say), placed in order
    /// so that each sees the ones before it (`Spread` spreads them, `Pack` packs them), or
    /// refuses them all with nothing reserved. The reservations come back in request order.
    pub fn reserve_all(
        &self,
        requests: &[Resources],
        strategy: Strategy,
        owner: &str,
    ) -> Result<Vec<Reservation>, PlacementError> {
        let mut writer = self.lock();
        let nodes = choose_all(&self.view(requests), requests, strategy)?;
        Ok(requests
            .iter()
            .zip(nodes)
            .map(|(request, node)| self.commit(&mut writer, node, request, owner))
            .collect())
    }

    /// Gives back a reservation; returns what it held.
    pub fn release(&self, id: ReservationId) -> Result<Reservation, PlacementError> {
        let _writer = self.lock();
        let (_, node) = self
            .index
            .remove(&id)
            .ok_or(PlacementError::UnknownReservation { id })?;
        // The index and the nodes change together under the writer lock, so an indexed
        // reservation is on a node in the table.
        let mut entry = self
            .nodes
            .get_mut(&node)
            .expect("indexed node is in the table");
        Ok(entry
            .release(id)
            .expect("indexed reservation is on its node"))
    }

    /// The reservation `id`, if it is held.
    pub fn reservation(&self, id: ReservationId) -> Option<Reservation> {
        let node = *self.index.get(&id)?;
        self.nodes.get(&node)?.reservations.get(&id).cloned()
    }

    /// Every node: what it offers, what is used, by which reservations; in id order.
    pub fn usage(&self) -> Vec<NodeUsage> {
        let mut usage: Vec<NodeUsage> = self
            .nodes
            .iter()
            .map(|entry| entry.usage(*entry.key()))
            .collect();
        usage.sort_by_key(|u| u.node);
        usage
    }

    /// One node's row of [`ResourceTable::usage`].
    pub fn node_usage(&self, node: NodeId) -> Option<NodeUsage> {
        self.nodes.get(&node).map(|entry| entry.usage(node))
    }

    /// What the nodes in the table offer together, and what of it is free.
    pub fn totals(&self) -> ClusterTotals {
        let mut totals = ClusterTotals::default();
        for entry in self.nodes.iter() {
            totals.nodes += 1;
            totals.reservations += entry.reservations.len();
            totals.total = totals.total.saturating_add(entry.capacity.resources());
            totals.free = totals.free.saturating_add(&entry.free());
        }
        totals
    }

    /// The writer lock. A panic while it was held can only come from a broken invariant
    /// (the `expect`s above), never from a request, so the table is used on regardless.
    fn lock(&self) -> MutexGuard<'_, Writer> {
        self.writer.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Every node as a decision about `requests` sees it. Called under the writer lock.
    fn view(&self, requests: &[Resources]) -> View {
        let mut view = View::new(requests);
        for entry in self.nodes.iter() {
            let reservations = entry.reservations.len();
            view.push(
                *entry.key(),
                entry.capacity.resources(),
                &entry.used,
                reservations,
            );
        }
        view
    }

    /// Writes a reservation the writer chose on a copy of the table.
    fn commit(
        &self,
        writer: &mut Writer,
        node: NodeId,
        request: &Resources,
        owner: &str,
    ) -> Reservation {
        let id = ReservationId(writer.next_reservation);
        writer.next_reservation += 1;
        // `node` was a candidate read under the writer lock, which every removal holds.
        let mut entry = self
            .nodes
            .get_mut(&node)
            .expect("chosen node is in the table");
        let reservation = entry.reserve(Reservation {
            id,
            node,
            resources: request.clone(),
            gpus: Vec::new(),
            owner: owner.to_string(),
        });
        drop(entry);
        self.index.insert(id, node);
        reservation
    }
}

/// What only the holder of the writer lock may touch.
#[derive(Debug)]
struct Writer {
    next_reservation: u64,
}

impl Default for Writer {
    fn default() -> Self {
        Writer {
            next_reservation: 1,
        }
    }
}

/// One node in the table.
///
/// Invariants: `used` is the sum of the reservations' resources and fits in the capacity;
/// `held_gpus` are the reservations' GPUs, so the free GPU indices number exactly the
/// free `gpu` quantity.
#[derive(Debug)]
struct NodeEntry {
    capacity: NodeCapacity,
    used: Resources,
    held_gpus: BTreeSet<u32>,
    reservations: BTreeMap<ReservationId, Reservation>,
}

impl NodeEntry {
    fn new(capacity: NodeCapacity) -> Self {
        NodeEntry {
            capacity,
            used: Resources::new(),
            held_gpus: BTreeSet::new(),
            reservations: BTreeMap::new(),
        }
    }

    fn free(&self) -> Resources {
        self.capacity.resources().saturating_sub(&self.used)
    }

    fn free_gpus(&self) -> impl Iterator<Item = u32> + '_ {
        self.capacity
            .gpu_indices()
            .iter()
            .copied()
            .filter(|index| !self.held_gpus.contains(index))
    }

    /// Records `reservation` (which fits in what is free), handing it the first free GPUs.
    fn reserve(&mut self, mut reservation: Reservation) -> Reservation {
        let wanted = usize::try_from(reservation.resources.gpus()).unwrap_or(usize::MAX);
        reservation.gpus = self.free_gpus().take(wanted).collect();
        debug_assert_eq!(reservation.gpus.len(), wanted, "gpu count fits");
        debug_assert!(reservation.resources.fits_in(&self.free()), "request fits");
        self.held_gpus.extend(reservation.gpus.iter().copied());
        self.used = self.used.saturating_add(&reservation.resources);
        self.reservations
            .insert(reservation.id, reservation.clone());
        reservation
    }

    fn release(&mut self, id: ReservationId) -> Option<Reservation> {
        let reservation = self.reservations.remove(&id)?;
        for index in &reservation.gpus {
            self.held_gpus.remove(index);
        }
        self.used = self.used.saturating_sub(&reservation.resources);
        Some(reservation)
    }

    fn usage(&self, node: NodeId) -> NodeUsage {
        NodeUsage {
            node,
            total: self.capacity.resources().clone(),
            used: self.used.clone(),
            gpus: self.capacity.gpu_indices().to_vec(),
            free_gpus: self.free_gpus().collect(),
            reservations: self.reservations.values().cloned().collect(),
        }
    }
}

#[cfg(test)]
#[path = "table_tests.rs"]
mod tests;
