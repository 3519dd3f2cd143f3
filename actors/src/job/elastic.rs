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
//! with a checkpoint at the step the survivors rolled back to. When to do which is
//! decided by `recovery.rs`; this file makes the calls.

use std::time::Duration;

use pipelines::RankCursor;
use runtime::ClusterClient;

use super::calls::{RankHandle, agreed, call_all, call_one};
use super::error::During as _;
use super::error::RankFailure;
use super::recovery::GiveUp;
use super::spawn::spawn_trainers;
use super::steps::Position;
use super::watch::FailureWatcher;
use super::world::{RankPlace, Trainers};
use super::{JobError, JobSettings};
use crate::train::phase::AbortRequest;
use crate::train::{
    JobSpec, ListenReply, ListenRequest, RegroupRecord, RegroupReply, RegroupRequest,
    RollbackRequest, scaled_lr,
};

/// The job's ranks: who they are, their layout over nodes, an epoch's steps.
pub(super) struct World {
    pub(super) ranks: Vec<RankHandle>,
    pub(super) node_ranks: Vec<u32>,
    pub(super) steps_per_epoch: u64,
}

/// Ranks lost, why, and the survivors (rolled back to the job's position).
pub(super) struct Losses {
    /// Old rank numbers, ascending, with why each is lost.
    pub(super) lost: Vec<(u32, String)>,
    pub(super) survivors: Vec<RankHandle>,
    /// Steps the survivors undid (the most any of them ran past the position).
    pub(super) undone: u64,
}

impl Losses {
    /// The old rank numbers of the ranks lost.
    pub(super) fn lost_ranks(&self) -> Vec<u32> {
        self.lost.iter().map(|(r, _)| *r).collect()
    }

    /// The job's error when these losses take it past a limit (`why`, from the job's
    /// [`Recovery`](super::recovery::Recovery)).
    pub(super) fn beyond(&self, why: GiveUp) -> Option<JobError> {
        let lost = self.lost_ranks();
        let cause = self.cause();
        match why {
            GiveUp::PastMaxFailures {
                failures,
                max_failures,
            } => Some(JobError::Refused(format!(
                "lost rank(s) {lost:?}: {cause}; that is {failures} loss(es), past \
                 train.max_failures = {max_failures}"
            ))),
            GiveUp::BelowMinWorld { left, min_world } => Some(JobError::Refused(format!(
                "lost rank(s) {lost:?}: {cause}; {left} rank(s) left, fewer than \
                 train.min_world = {min_world}"
            ))),
            GiveUp::ChangeFailed => None,
        }
    }

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
    // No survivor waits in a collective for a rank that will not answer: each one's
    // monitor aborts it (a lost rank's does not answer, which is fine). The aborts must
    // be over before the survivors form a new ring, which one would end.
    let aborts = tokio::spawn(abort_collectives(world.ranks.clone()));
    // Every rank that still answers rolls back, once the call it may still be in ends; a
    // rank is lost when its call says it is gone, or when the head says so first (a
    // lost node: after the failure-detection window).
    let wait = Duration::from_millis(settings.dead_after_ms) + Duration::from_secs(5);
    let request = RollbackRequest {
        global_step: at.global_step,
    };
    let mut tasks = tokio::task::JoinSet::new();
    for rank in &world.ranks {
        let rank = rank.clone();
        let request = request.clone();
        tasks.spawn(async move {
            let answer = call_one(&rank, &request, wait).await;
            (rank, answer)
        });
    }
    let mut lost: Vec<(u32, String)> = Vec::new();
    let mut survivors = Vec::new();
    let mut undone = 0;
    let own_error = |message: String| {
        JobError::Refused(format!(
            "{message}\n  (train.elastic goes on without lost ranks, not after a rank's own \
             error)"
        ))
    };
    // The head's word that ended the step loop, if it did.
    if let JobError::RankFailed(failure) = &error
        && let Some(rank) = failure.rank
    {
        if failure.is_loss() {
            lost.push((rank, failure.message.clone()));
        } else if failure.origin == runtime::FailureOrigin::Here {
            return Err(own_error(failure.message.clone()));
        }
    }
    while survivors.len() + lost.len() < world.ranks.len() {
        tokio::select! {
            joined = tasks.join_next() => {
                let Some(joined) = joined else { break };
                let (rank, answer) = joined
                    .map_err(|e| JobError::Refused(format!("a rollback task failed: {e}")))?;
                if lost.iter().any(|(r, _)| *r == rank.rank) {
                    continue;
                }
                match answer {
                    Ok(reply) => {
                        undone = undone.max(reply.undone);
                        survivors.push(rank);
                    }
                    Err(JobError::Call(call)) if call.error.is_loss() => {
                        // Fenced: cut off but maybe alive, it must not come back.
                        let _ = rank.actor.kill().await;
                        lost.push((rank.rank, format!("{}: {}", rank.name(), call.error)));
                    }
                    Err(other) => {
                        return Err(JobError::Refused(format!(
                            "{error}\n  (then, rolling back: {other})"
                        )));
                    }
                }
            }
            failure = watcher.failure() => {
                let decided: Vec<u32> = survivors.iter().map(|s: &RankHandle| s.rank).collect();
                match judge(&failure, &lost, &decided) {
                    Verdict::Lost(rank) => lost.push((rank, failure.message)),
                    Verdict::OwnError => return Err(own_error(failure.message)),
                    Verdict::Nothing => {}
                }
            }
        }
    }
    tasks.abort_all();
    let _ = aborts.await;
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

/// What the head's word on a rank means while the ranks are sorted into lost and
/// survivors.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Lost(u32),
    /// Its own error, which would recur wherever its work went: the job fails.
    OwnError,
    Nothing,
}

/// `failure` against the ranks already found `lost` and the `survivors` (which answered
/// their rollback). A lost rank's later events say nothing new: a rank this job fenced
/// ends "killed by its owner", and its process's exit may be told after that.
fn judge(failure: &RankFailure, lost: &[(u32, String)], survivors: &[u32]) -> Verdict {
    let Some(rank) = failure.rank else {
        return Verdict::Nothing;
    };
    if lost.iter().any(|(r, _)| *r == rank) {
        return Verdict::Nothing;
    }
    if failure.is_loss() {
        if survivors.contains(&rank) {
            Verdict::Nothing
        } else {
            Verdict::Lost(rank)
        }
    } else if failure.origin == runtime::FailureOrigin::Here {
        Verdict::OwnError
    } else {
        Verdict::Nothing
    }
}

/// Appends to `node_ranks` the ranks on each node of `nodes` (ranks in order, numbered
/// node by node: a run of one node is one entry).
fn count_by_node(node_ranks: &mut Vec<u32>, nodes: impl IntoIterator<Item = runtime::NodeId>) {
    let mut last = None;
    for node in nodes {
        if last == Some(node)
            && let Some(count) = node_ranks.last_mut()
        {
            *count += 1;
        } else {
            node_ranks.push(1);
            last = Some(node);
        }
    }
}

/// Has every rank's monitor abort the collective its trainer waits in, within a second
/// (and the call's margin).
async fn abort_collectives(ranks: Vec<RankHandle>) {
    let mut tasks = tokio::task::JoinSet::new();
    for rank in &ranks {
        let Some(monitor) = &rank.monitor else {
            continue;
        };
        let asked = RankHandle {
            actor: monitor.clone(),
            ..rank.clone()
        };
        let wait = Duration::from_secs(1);
        tasks.spawn(async move {
            let _ = call_one(&asked, &AbortRequest {}, wait).await;
        });
    }
    while tasks.join_next().await.is_some() {}
}

/// A smaller world the survivors regrouped into, before its ring is wired.
pub(super) struct Regrouped {
    pub(super) world: World,
    pub(super) listens: Vec<ListenReply>,
    pub(super) record: RegroupRecord,
    /// The steps of the epoch the job regrouped in, in the new world.
    pub(super) epoch_steps: u64,
    /// The job's position, as the new world's ranks hold it.
    pub(super) at: Position,
}

/// The survivors as ranks `0..n` of a smaller world: each regroups (the rest of the
/// epoch at `at`, the learning rate for the new global batch, `record.lr`, which the
/// caller makes the job's) and binds a new ring port; the caller wires the ring.
pub(super) async fn regroup(
    job: &JobSpec,
    settings: &JobSettings,
    losses: &Losses,
    at: &Position,
) -> Result<Regrouped, JobError> {
    let n = losses.survivors.len() as u32;
    let lost = losses.lost_ranks();
    // Ranks are numbered node by node, so the survivors in order are too.
    let mut node_ranks: Vec<u32> = Vec::new();
    count_by_node(
        &mut node_ranks,
        losses.survivors.iter().map(|r| r.place.node),
    );
    let ranks: Vec<RankHandle> = losses
        .survivors
        .iter()
        .enumerate()
        .map(|(i, rank)| RankHandle {
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
    let epoch_steps = agreed(replies.iter().map(|r| r.steps_in_epoch), |first, bad, v| {
        format!(
            "the survivors disagree on the rest of epoch {}: rank 0 plans {first} steps, \
             rank {bad} {v}",
            at.epoch
        )
    })?;
    let listens: Vec<ListenReply> = call_all(&ranks, |_| ListenRequest {}, long)
        .await
        .during(|| "the survivors binding their ring ports".to_string())?;
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
        found_s: 0.0,
        recovery_s: 0.0,
    };
    let cursors: Vec<RankCursor> = replies.iter().filter_map(|r| r.cursor.clone()).collect();
    let told = if at.cursors.is_empty() {
        0
    } else {
        ranks.len()
    };
    if cursors.len() != told {
        return Err(JobError::Refused(format!(
            "regrouping the survivors: {} of {} rank(s) told where they stand in epoch {}",
            cursors.len(),
            ranks.len(),
            at.epoch
        )));
    }
    Ok(Regrouped {
        world: World {
            ranks,
            node_ranks,
            steps_per_epoch: replies[0].steps_per_epoch,
        },
        listens,
        record,
        epoch_steps,
        at: Position {
            cursors,
            ..at.clone()
        },
    })
}

/// What the job says when it regrouped.
pub(super) fn regroup_line(record: &RegroupRecord, old_world_size: usize, old_lr: f64) -> String {
    if record.lost.is_empty() {
        return format!(
            "elastic: {}; growing from {old_world_size} to {} ranks at epoch {} (global step {}); \
             global batch {}, lr {old_lr:.4} -> {:.4}; the new ranks took the model and \
             optimiser state from rank 0, in {:.1} s",
            record.cause,
            record.world,
            record.epoch,
            record.step,
            record.global_batch,
            record.lr,
            record.recovery_s
        );
    }
    format!(
        "elastic: lost rank(s) {:?} ({}); going on with {} of {old_world_size} ranks from global \
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

/// Grows the job at an epoch's start (`at`) onto `places`: the ranks let go of their
/// ring, take their place in the larger world (new ranks after the old, the learning
/// rate for the larger global batch), the new trainers start, and every rank binds a
/// ring port; the caller wires the ring, over which the new ranks receive the model and
/// the optimiser state.
pub(super) async fn grow(
    (client, trainers, job_name): (&ClusterClient, &Trainers, &str),
    job: &mut JobSpec,
    settings: &JobSettings,
    world: &World,
    places: &[RankPlace],
    at: &Position,
) -> Result<(World, Vec<ListenReply>, RegroupRecord), JobError> {
    let long = Duration::from_secs(settings.step_timeout_secs.max(10));
    let mut node_ranks = world.node_ranks.clone();
    count_by_node(&mut node_ranks, places.iter().map(|p| p.node));
    let old = world.ranks.len() as u32;
    let n: u32 = node_ranks.iter().sum();
    let global_batch = job.optim.batch_size * u64::from(n);
    let lr = scaled_lr(settings.lr, global_batch, settings.reference_batch.max(1));
    let request = RollbackRequest {
        global_step: at.global_step,
    };
    call_all(&world.ranks, |_| request.clone(), long)
        .await
        .during(|| "the ranks letting go of their ring to grow".to_string())?;
    let survivors: Vec<u32> = (0..old).collect();
    call_all::<RegroupRequest>(
        &world.ranks,
        |rank| RegroupRequest {
            rank: rank.rank,
            node_ranks: node_ranks.clone(),
            survivors: survivors.clone(),
            epoch: at.epoch,
            cursors: Vec::new(),
            lr,
        },
        long,
    )
    .await
    .during(|| "the ranks taking their place in the larger world".to_string())?;
    job.optim.lr = lr;
    let joined =
        spawn_trainers(client, trainers, job, job_name, places, (&node_ranks, old)).await?;
    let mut ranks = world.ranks.clone();
    ranks.extend(joined);
    let listens: Vec<ListenReply> = call_all(&ranks, |_| ListenRequest {}, long)
        .await
        .during(|| "the larger world binding its ring ports".to_string())?;
    let steps_per_epoch = agreed(
        listens.iter().map(|l| l.steps_per_epoch),
        |first, bad, v| {
            format!(
                "ranks disagree on the larger world's epoch: rank 0 plans {first} steps, rank {bad} {v}"
            )
        },
    )?;
    let nodes: Vec<String> = places.iter().map(|p| format!("node {}", p.node)).collect();
    let record = RegroupRecord {
        epoch: at.epoch,
        step: at.global_step,
        step_in_epoch: 0,
        lost: Vec::new(),
        cause: format!("room for {} more on {}", places.len(), nodes.join(", ")),
        world: n,
        node_ranks: node_ranks.clone(),
        global_batch,
        lr,
        undone: 0,
        found_s: 0.0,
        recovery_s: 0.0,
    };
    Ok((
        World {
            ranks,
            node_ranks,
            steps_per_epoch,
        },
        listens,
        record,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use runtime::FailureOrigin;

    fn failure(rank: u32, reason: &str, origin: FailureOrigin) -> RankFailure {
        RankFailure {
            message: format!("rank {rank} (node 2) stopped: {reason}"),
            origin,
            rank: Some(rank),
        }
    }

    #[test]
    fn a_fenced_ranks_end_after_its_loss_is_no_error_of_its_own() {
        // The rollback call found rank 1 gone and the job fenced it; the head then told
        // of its stop, the fence first (seen in CI: the job failed here). A stop is no
        // failure: its event carries the origin `Here`.
        let fenced = failure(
            1,
            "killed by its owner; worker process for group 'g' (pid 7) killed by signal 9 \
             (SIGKILL); no stderr output",
            FailureOrigin::Here,
        );
        assert!(!fenced.is_loss());
        let lost = vec![(1, "rank 1: gone".to_string())];
        assert_eq!(judge(&fenced, &lost, &[0]), Verdict::Nothing);
        // Before the job knew, the same words are a rank's own end, and fail the job.
        assert_eq!(judge(&fenced, &[], &[0]), Verdict::OwnError);
    }

    #[test]
    fn losses_and_own_errors_are_told_apart_once_per_rank() {
        for origin in [FailureOrigin::WorkerExit, FailureOrigin::NodeLost] {
            let crashed = failure(2, "killed by signal 9 (SIGKILL)", origin);
            assert_eq!(judge(&crashed, &[], &[0]), Verdict::Lost(2));
            let lost = vec![(2, "rank 2: gone".to_string())];
            assert_eq!(judge(&crashed, &lost, &[0]), Verdict::Nothing);
            // A survivor answered its rollback: a late word of its loss changes nothing.
            assert_eq!(judge(&crashed, &[], &[2]), Verdict::Nothing);
        }
        let bad_shard = failure(0, "rank 0 epoch 1: bad shard", FailureOrigin::Here);
        assert_eq!(judge(&bad_shard, &[], &[]), Verdict::OwnError);
        let elsewhere = failure(0, "a ring peer went away", FailureOrigin::Elsewhere);
        assert_eq!(judge(&elsewhere, &[], &[]), Verdict::Nothing);
        let head = RankFailure {
            rank: None,
            ..failure(0, "lost the head", FailureOrigin::Here)
        };
        assert_eq!(judge(&head, &[], &[]), Verdict::Nothing);
    }

    #[test]
    fn the_verdict_reads_the_origin_never_the_words() {
        // Words that once decided a loss ("node N lost:", "worker process for group"), and
        // words that mean nothing, under every origin: the verdict follows the origin.
        let words = [
            "node 3 lost: no heartbeat for 3000 ms",
            "worker process for group 'rank0' (pid 9) exited with code 1",
            "the loss diverged",
            "Knoten 3 verloren",
            "",
        ];
        let want = [
            (FailureOrigin::Here, Verdict::OwnError),
            (FailureOrigin::Elsewhere, Verdict::Nothing),
            (FailureOrigin::WorkerExit, Verdict::Lost(1)),
            (FailureOrigin::NodeLost, Verdict::Lost(1)),
        ];
        for reason in words {
            for (origin, verdict) in &want {
                let seen = judge(&failure(1, reason, *origin), &[], &[0]);
                assert_eq!(&seen, verdict, "{origin:?} {reason:?}");
            }
        }
    }
}
