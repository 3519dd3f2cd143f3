//! An elastic job's recovery (`train.elastic`): when ranks are lost, the job goes on
//! with the others, from the last step every rank completed, without a checkpoint.
//!
//! 1. **Who is lost.** Every rank is asked to roll back to that step (`rollback`, which
//!    also drops its ring and its epoch's loader). A rank whose process or node is gone
//!    does not answer (`runtime::ActorCallError::is_loss`); nor does one cut off from
//!    the head, which is then killed (fenced). A rank that answers with an error of its
//!    own, or a lost one whose failure was its own error (a bad shard, a diverged loss,
//!    which would recur wherever its work went) fails the job as before.
//! 2. **The step in flight is dropped by all alike.** The survivors' state goes back to
//!    the end of the last call every rank answered, where the job holds every rank's
//!    loader cursor; what a survivor ran past it is undone.
//! 3. **Regroup.** Survivor `i` (in old rank order) becomes rank `i` of the smaller world;
//!    each deals the rest of the epoch the same way (`pipelines::regroup`: the lost
//!    ranks' loader workers go on, where they stood, on the survivors), so every sample
//!    is still served once; the learning rate follows the smaller global batch (linear
//!    rule), each rank keeping its batch size. The ring is re-formed over the survivors
//!    and rank 0's weights broadcast (they are everyone's already).
//!
//! Below `train.min_world`, or at a loss past `train.max_failures`, the job fails instead,
//! with a checkpoint at the step the survivors rolled back to.

use std::time::Duration;

use runtime::ClusterClient;

use super::calls::{Rank, call_all, call_one};
use super::error::During as _;
use super::steps::Position;
use super::watch::FailureWatcher;
use super::{Elastic, JobError, JobSettings};
use crate::train::phase::AbortRequest;
use crate::train::{
    JobSpec, ListenReply, ListenRequest, RegroupRecord, RegroupReply, RegroupRequest,
    RollbackRequest, scaled_lr,
};

/// The job's ranks: who they are, their layout over nodes, an epoch's steps.
pub(super) struct World {
    pub(super) ranks: Vec<Rank>,
    pub(super) node_ranks: Vec<u32>,
    pub(super) steps_per_epoch: u64,
}

/// Ranks lost, why, and the survivors (rolled back to the job's position).
pub(super) struct Losses {
    /// Old rank numbers, ascending, with why each is lost.
    pub(super) lost: Vec<(u32, String)>,
    pub(super) survivors: Vec<Rank>,
    /// Steps the survivors undid (the most any of them ran past the position).
    pub(super) undone: u64,
}

impl Losses {
    pub(super) fn cause(&self) -> String {
        self.lost
            .iter()
            .map(|(_, why)| why.as_str())
            .collect::<Vec<_>>()
            .join("; ")
    }
}

/// After `error` ended the step loop at `at`: the ranks lost and the survivors rolled
/// back to `at`, or `error` itself when it was no loss a job can go on from.
pub(super) async fn find_losses(
    client: &ClusterClient,
    world: &World,
    at: &Position,
    error: JobError,
    watcher: &mut FailureWatcher,
    settings: &JobSettings,
) -> Result<Losses, JobError> {
    if error.interrupted().is_some() || super::watch::head_lost(client).await.is_some() {
        return Err(error);
    }
    // What the head said so far: a rank that failed by its own error ends the job.
    let mut lost: Vec<(u32, String)> = Vec::new();
    for failure in watcher.reported() {
        match failure.rank {
            Some(rank) if failure.loss => lost.push((rank, failure.message)),
            Some(_) if failure.origin == runtime::FailureOrigin::Here => {
                return Err(JobError::Refused(format!(
                    "{}\n  (train.elastic goes on without lost ranks, not after a rank's own \
                     error)",
                    failure.message
                )));
            }
            _ => {}
        }
    }
    // No survivor waits in a collective for a rank that will not answer: each one's
    // monitor aborts it (a lost rank's does not answer, which is fine).
    abort_collectives(&world.ranks).await;
    // Every rank that still answers rolls back, once the call it may still be in ends.
    let wait = Duration::from_millis(settings.dead_after_ms) + Duration::from_secs(5);
    let request = RollbackRequest {
        global_step: at.global_step,
    };
    let mut tasks = tokio::task::JoinSet::new();
    for rank in &world.ranks {
        if lost.iter().any(|(r, _)| *r == rank.rank) {
            continue;
        }
        let rank = rank.clone();
        let request = request.clone();
        tasks.spawn(async move {
            let answer = call_one(&rank, &request, wait).await;
            (rank, answer)
        });
    }
    let mut survivors = Vec::new();
    let mut undone = 0;
    while let Some(joined) = tasks.join_next().await {
        let (rank, answer) =
            joined.map_err(|e| JobError::Refused(format!("a rollback task failed: {e}")))?;
        match answer {
            Ok(reply) => {
                undone = undone.max(reply.undone);
                survivors.push(rank);
            }
            Err(JobError::Call(call)) if call.error.is_loss() => {
                // Fenced: cut off but maybe alive, it must not come back into the job.
                let _ = rank.actor.kill().await;
                lost.push((rank.rank, format!("{}: {}", rank.name(), call.error)));
            }
            Err(other) => {
                return Err(JobError::Refused(format!(
                    "{}\n  (then, rolling back: {other})",
                    error
                )));
            }
        }
    }
    if lost.is_empty() {
        // Everyone answered: the failure was no loss (a timeout, a refusal).
        return Err(error);
    }
    lost.sort_by_key(|(r, _)| *r);
    lost.dedup_by_key(|(r, _)| *r);
    survivors.sort_by_key(|r| r.rank);
    Ok(Losses {
        lost,
        survivors,
        undone,
    })
}

/// Has every rank's monitor abort the collective its trainer waits in, for at most a
/// second.
async fn abort_collectives(ranks: &[Rank]) {
    let mut tasks = tokio::task::JoinSet::new();
    for rank in ranks {
        let Some(monitor) = &rank.monitor else {
            continue;
        };
        let asked = Rank {
            actor: monitor.clone(),
            ..rank.clone()
        };
        tasks.spawn(async move {
            let _ = call_one(&asked, &AbortRequest {}, Duration::from_secs(1)).await;
        });
    }
    while tasks.join_next().await.is_some() {}
}

/// The survivors as ranks `0..n` of a smaller world: each regroups (the rest of the
/// epoch at `at`, the learning rate for the new global batch) and binds a new ring
/// port; the caller wires the ring.
pub(super) async fn regroup(
    job: &mut JobSpec,
    settings: &JobSettings,
    elastic: Elastic,
    losses: &Losses,
    at: &Position,
    failures: u32,
) -> Result<(World, Vec<ListenReply>, RegroupRecord, u64), JobError> {
    let n = losses.survivors.len() as u32;
    let lost: Vec<u32> = losses.lost.iter().map(|(r, _)| *r).collect();
    if failures > elastic.max_failures {
        return Err(JobError::Refused(format!(
            "lost rank(s) {lost:?}: {}; that is {failures} loss(es), past train.max_failures \
             = {}",
            losses.cause(),
            elastic.max_failures
        )));
    }
    if n < elastic.min_world {
        return Err(JobError::Refused(format!(
            "lost rank(s) {lost:?}: {}; {n} rank(s) left, fewer than train.min_world = {}",
            losses.cause(),
            elastic.min_world
        )));
    }
    // Ranks are numbered node by node, so the survivors in order are too.
    let mut node_ranks: Vec<u32> = Vec::new();
    let mut last_node = None;
    for rank in &losses.survivors {
        if last_node == Some(rank.place.node) {
            if let Some(count) = node_ranks.last_mut() {
                *count += 1;
            }
        } else {
            node_ranks.push(1);
            last_node = Some(rank.place.node);
        }
    }
    let ranks: Vec<Rank> = losses
        .survivors
        .iter()
        .enumerate()
        .map(|(i, rank)| Rank {
            rank: i as u32,
            ..rank.clone()
        })
        .collect();
    let global_batch = job.optim.batch_size * u64::from(n);
    let lr = scaled_lr(settings.lr, global_batch, settings.reference_batch.max(1));
    let long = Duration::from_secs(settings.step_timeout_secs.max(10));
    let survivors: Vec<u32> = losses.survivors.iter().map(|r| r.rank).collect();
    let replies: Vec<RegroupReply> = call_all(
        &ranks,
        |rank| RegroupRequest {
            rank: rank.rank,
            node_ranks: node_ranks.clone(),
            survivors: survivors.clone(),
            epoch: at.epoch,
            cursors: at.cursors.clone(),
            lr,
        },
        long,
    )
    .await
    .during(|| "regrouping the survivors".to_string())?;
    if let Some(bad) = replies
        .iter()
        .position(|r| r.steps_in_epoch != replies[0].steps_in_epoch)
    {
        return Err(JobError::Refused(format!(
            "the survivors disagree on the rest of epoch {}: rank 0 plans {} steps, rank \
             {bad} {}",
            at.epoch, replies[0].steps_in_epoch, replies[bad].steps_in_epoch
        )));
    }
    let listens: Vec<ListenReply> = call_all(&ranks, |_| ListenRequest {}, long)
        .await
        .during(|| "the survivors binding their ring ports".to_string())?;
    job.optim.lr = lr;
    let record = RegroupRecord {
        epoch: at.epoch,
        step: at.global_step,
        step_in_epoch: at.step_in_epoch,
        lost,
        cause: losses.cause(),
        world: n,
        node_ranks: node_ranks.clone(),
        global_batch,
        lr,
        undone: losses.undone,
        recovery_s: 0.0,
    };
    Ok((
        World {
            ranks,
            node_ranks,
            steps_per_epoch: replies[0].steps_per_epoch,
        },
        listens,
        record,
        replies[0].steps_in_epoch,
    ))
}

/// What the job says when it regrouped.
pub(super) fn regroup_line(record: &RegroupRecord, old_world: usize, old_lr: f64) -> String {
    format!(
        "elastic: lost rank(s) {:?} ({}); going on with {} of {old_world} ranks from global \
         step {} (step {} of epoch {}){}; global batch {}, lr {old_lr:.4} -> {:.4} (each rank \
         keeps its batch); recovered in {:.1} s",
        record.lost,
        record.cause,
        record.world,
        record.step,
        record.step_in_epoch,
        record.epoch,
        if record.undone > 0 {
            format!(", {} step(s) in flight dropped", record.undone)
        } else {
            String::new()
        },
        record.global_batch,
        record.lr,
        record.recovery_s
    )
}
