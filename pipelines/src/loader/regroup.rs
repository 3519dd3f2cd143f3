//! The rest of an epoch for fewer ranks: when ranks are lost mid-epoch, the survivors
//! take over the lost ranks' loader workers where they stood, so that every sample of
//! the epoch is still served once (an elastic job's shrink).
//!
//! A worker's stream is a pure function of its plan (items, seed), and its cursor says
//! how much of it was served; so a worker moves to another rank whole, with its seed and
//! position, and goes on exactly as it would have on its own rank. Each survivor keeps
//! its own workers (same order, same turn) and adopts lost ones, each going to the
//! survivor with the fewest batches left so far, so the ranks stay as even as the
//! workers allow; the plan's batch policy evens out the rest (`join` pads with empty
//! batches, `drop` and `repeat` cut to the shortest rank).

use super::LoaderError;
use super::cursor::{LoaderWorkerCursor, RankCursor};
use crate::plan::{
    BatchPolicy, ClusterShape, Consistency, LoaderWorkerId, LoaderWorkerPlan, Plan, Rank, RankPlan,
};

/// The rest of an epoch for the surviving ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Regrouped {
    /// The epoch's plan for the smaller world: every survivor's workers, its own first,
    /// then the lost ranks' it adopted; the step count is the whole epoch's (the steps
    /// already run plus those left).
    pub plan: Plan,
    /// Where each new rank continues: pass `cursors[r]` with `plan` to the loader.
    pub cursors: Vec<RankCursor>,
    /// Batches every new rank has left to serve (after the policy), and padding.
    pub left: Vec<(u64, u64)>,
}

/// Deals the rest of `plan`'s epoch over `survivors` (old ranks, ascending: survivor `i`
/// becomes rank `i` of `cluster`), from every old rank's `cursors`, all taken at the
/// same step with unmixed batches (`data.mix_batches = 1`).
pub fn regroup(
    plan: &Plan,
    cursors: &[RankCursor],
    survivors: &[Rank],
    cluster: ClusterShape,
) -> Result<Regrouped, LoaderError> {
    let fail = |problem: String| Err(LoaderError::Regroup { problem });
    let world = plan.ranks.len();
    if cursors.len() != world {
        return fail(format!(
            "{} cursors for the {world} ranks of epoch {}'s plan",
            cursors.len(),
            plan.epoch
        ));
    }
    if survivors.is_empty() || survivors.windows(2).any(|w| w[0] >= w[1]) {
        return fail(format!(
            "the surviving ranks {survivors:?} are not a non-empty ascending list"
        ));
    }
    if let Some(bad) = survivors.iter().find(|r| r.0 as usize >= world) {
        return fail(format!("rank {bad} is not one of the plan's {world}"));
    }
    if cluster.world_size() as usize != survivors.len() {
        return fail(format!(
            "the new world ({}) has {} ranks, not the {} survivors",
            cluster.layout(),
            cluster.world_size(),
            survivors.len()
        ));
    }
    if plan.steps().is_none() {
        return fail(format!(
            "epoch {}'s plan does not know every rank's batch count",
            plan.epoch
        ));
    }
    let at = cursors[0].steps;
    for (r, (cursor, rank_plan)) in cursors.iter().zip(&plan.ranks).enumerate() {
        if cursor.rank as usize != r {
            return fail(format!("cursor {r} is rank {}'s", cursor.rank));
        }
        cursor.check(plan, rank_plan, cursor.mix_batches)?;
        if cursor.mix_batches > 1 {
            return fail(
                "batches are mixed across workers (data.mix_batches > 1): a worker cannot \
                 move to another rank in the middle of a block"
                    .to_string(),
            );
        }
        if cursor.steps != at {
            return fail(format!(
                "rank 0's cursor is at step {at}, rank {r}'s at {}: cursors must be taken \
                 at the same step",
                cursor.steps
            ));
        }
    }
    // Each old worker with what it has left.
    let left_of = |plan: &LoaderWorkerPlan, cursor: &LoaderWorkerCursor| {
        plan.batches
            .map(|b| b.saturating_sub(cursor.batches))
            .unwrap_or(0)
    };
    let mut ranks: Vec<Vec<(LoaderWorkerPlan, LoaderWorkerCursor)>> = survivors
        .iter()
        .map(|r| {
            let old = &plan.ranks[r.0 as usize];
            old.workers
                .iter()
                .cloned()
                .zip(cursors[r.0 as usize].workers.iter().copied())
                .collect()
        })
        .collect();
    let mut left: Vec<u64> = ranks
        .iter()
        .map(|workers| workers.iter().map(|(p, c)| left_of(p, c)).sum())
        .collect();
    for (old, rank_plan) in plan.ranks.iter().enumerate() {
        if survivors.contains(&Rank(old as u32)) {
            continue;
        }
        for (worker, cursor) in rank_plan.workers.iter().zip(&cursors[old].workers) {
            let to = (0..left.len()).min_by_key(|&i| (left[i], i)).unwrap_or(0);
            left[to] += left_of(worker, cursor);
            ranks[to].push((worker.clone(), *cursor));
        }
    }
    let most = left.iter().copied().max().unwrap_or(0);
    let least = left.iter().copied().min().unwrap_or(0);
    let target = match plan.policy {
        BatchPolicy::None | BatchPolicy::Join => most,
        BatchPolicy::Drop { .. } | BatchPolicy::Repeat { .. } => least,
    };
    let mut new_plan = Plan {
        cluster: cluster.clone(),
        ranks: Vec::with_capacity(ranks.len()),
        ..plan.clone()
    };
    let mut counts = Vec::with_capacity(ranks.len());
    for (i, workers) in ranks.iter_mut().enumerate() {
        let rank = Rank(i as u32);
        let serve = target.min(left[i]);
        // Cut to `serve` batches, one per worker in turn, as the planner cuts a rank.
        let remaining: Vec<u64> = workers.iter().map(|(p, c)| left_of(p, c)).collect();
        let quotas = crate::plan::round_robin(&remaining, serve);
        let mut dropped = 0;
        for (w, ((worker, cursor), quota)) in workers.iter_mut().zip(quotas).enumerate() {
            worker.worker = LoaderWorkerId(w as u32);
            if let Some(batches) = worker.batches {
                let cut = batches - (cursor.batches + quota).min(batches);
                worker.batches = Some(batches - cut);
                worker.dropped_batches += cut;
                dropped += cut;
            }
        }
        let empty = match plan.policy {
            BatchPolicy::Join => target - serve,
            _ => 0,
        };
        counts.push(serve + empty);
        new_plan.ranks.push(RankPlan {
            rank,
            node: cluster.node_of(rank),
            workers: workers.iter().map(|(p, _)| p.clone()).collect(),
            samples: None,
            batches: Some(serve),
            empty_batches: empty,
            dropped_batches: dropped,
            repeated_batches: 0,
        });
    }
    new_plan.consistency = if counts.iter().all(|&c| c == counts[0]) {
        Consistency::Consistent {
            steps: at + counts.first().copied().unwrap_or(0),
        }
    } else {
        Consistency::Inconsistent {
            batches: counts.iter().map(|c| at + c).collect(),
        }
    };
    let mut new_cursors = Vec::with_capacity(ranks.len());
    for (i, workers) in ranks.iter().enumerate() {
        let rank_plan = &new_plan.ranks[i];
        let mut cursor = RankCursor::start(&new_plan, rank_plan, 1);
        cursor.steps = at;
        cursor.turn = cursors[survivors[i].0 as usize].turn;
        cursor.workers = workers.iter().map(|(_, c)| *c).collect();
        new_cursors.push(cursor);
    }
    let left = counts
        .iter()
        .zip(&new_plan.ranks)
        .map(|(&c, r)| (c - r.empty_batches, r.empty_batches))
        .collect();
    Ok(Regrouped {
        plan: new_plan,
        cursors: new_cursors,
        left,
    })
}
