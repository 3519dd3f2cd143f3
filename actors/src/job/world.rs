//! The world a job gets on its cluster: how many trainers, where, with how many
//! threads; the trainers it spawned (to stop them whatever happens); and the check that
//! the first epoch's plan can run on that world.

use runtime::{ActorRef, NodeId, Resources};

use super::error::During as _;
use super::{JobError, JobSettings};
use crate::train::JobSpec;

/// The trainers a job spawned, kept where whoever runs the job can stop them even when
/// the job's own future was dropped.
#[derive(Debug, Default)]
pub struct Trainers(std::sync::Mutex<Vec<ActorRef>>);

impl Trainers {
    pub(crate) fn add(&self, trainer: ActorRef) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(trainer);
    }

    /// Kills every trainer spawned so far (a trainer stuck in a collective would not get
    /// to a graceful stop) and forgets them.
    pub async fn kill_all(&self) {
        let trainers = std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()));
        let mut tasks = tokio::task::JoinSet::new();
        for trainer in trainers {
            tasks.spawn(async move {
                let _ = trainer.kill().await;
            });
        }
        while tasks.join_next().await.is_some() {}
    }
}

/// Plans the first epoch here, so a bad hook or missing counts fail before any trainer
/// starts (each trainer plans every epoch again for itself, with the same planner).
pub fn check_plan(job: &JobSpec, node_ranks: &[u32]) -> Result<(), JobError> {
    let shape =
        pipelines::ClusterShape::with_node_ranks(node_ranks.to_vec(), job.data.loader_workers);
    let plan = job
        .data
        .train_planner(shape, job.optim.batch_size)
        .and_then(|planner| planner.plan(0))
        .map_err(|error| JobError::Refused(format!("planning the first epoch: {error}")))?;
    trainable_steps(&plan).during(|| "planning the first epoch".to_string())?;
    Ok(())
}

/// The steps every rank runs in `plan`, or why the job cannot run it: trainers count
/// their steps ahead (for the schedule, progress and checkpoints), so a plan whose
/// batch counts are unknown is refused here, as `imgrun plan` refuses it.
pub fn trainable_steps(plan: &pipelines::Plan) -> Result<u64, JobError> {
    plan.check()
        .map_err(|error| JobError::Refused(error.to_string()))?;
    let Some(steps) = plan.steps() else {
        let missing = match plan.consistency {
            pipelines::Consistency::Unknown {
                shards_without_counts,
            } => shards_without_counts,
            _ => 0,
        };
        return Err(JobError::Refused(format!(
            "the ranks' batch counts are unknown: {missing} shard(s) have no sample count. \
             Index the shards with `imgrun shards index SPEC -o manifest.json` and set \
             data.manifest to it (or keep it beside local shards), declare \
             data.samples_per_shard, or use resampled mode with data.epoch_size"
        )));
    };
    if steps == 0 {
        return Err(JobError::Refused(format!(
            "epoch {} has no samples to train on: the shards' counts add up to {} and every \
             rank would run 0 steps (a manifest or data.samples_per_shard that says 0, hooks \
             that leave the ranks no shards, or data.epoch_size smaller than a batch per rank)",
            plan.epoch,
            plan.dataset_samples
                .map_or("?".to_string(), |n| n.to_string())
        )));
    }
    Ok(steps)
}

/// Where one rank runs.
#[derive(Debug, Clone)]
pub struct RankPlace {
    pub node: NodeId,
    /// The node's IP, where its trainers' ring ports are reached.
    pub ip: String,
    pub gpu: bool,
    pub threads: u32,
    /// The node's CPUs this rank reserves, in thousandths: its share of the node.
    pub cpu_millis: u64,
}

/// The world: one rank per free GPU (or `gpus` of them), else CPU trainers; and the
/// ranks on each node used. Ranks are numbered node by node.
pub fn plan_world(
    status: &runtime::ClusterStatus,
    train: &JobSettings,
) -> Result<(Vec<RankPlace>, Vec<u32>), JobError> {
    let live: Vec<&runtime::NodeStatus> = status.live_nodes().collect();
    if live.is_empty() {
        return Err(JobError::Refused(
            "the cluster has no live node".to_string(),
        ));
    }
    let free_gpus: Vec<u32> = live
        .iter()
        .map(|n| {
            (n.gpus.len() as u64).saturating_sub(n.used.get(Resources::GPU).copied().unwrap_or(0))
                as u32
        })
        .collect();
    let total_gpus: u32 = free_gpus.iter().sum();
    let mut per_node: Vec<u32> = if total_gpus > 0 {
        let want = if train.gpus == 0 {
            total_gpus
        } else {
            train.gpus.min(total_gpus)
        };
        take_spread(&free_gpus, want)
    } else {
        if train.gpus != 0 {
            return Err(JobError::Refused(format!(
                "train.gpus = {} but the cluster has no free GPU",
                train.gpus
            )));
        }
        let want = if train.cpu_trainers == 0 {
            live.len() as u32
        } else {
            train.cpu_trainers
        };
        take_spread(&vec![u32::MAX; live.len()], want)
    };
    let used_nodes: Vec<usize> = (0..live.len()).filter(|&i| per_node[i] > 0).collect();
    let mut ranks = Vec::new();
    for &i in &used_nodes {
        let node = live[i];
        let here = per_node[i];
        let cpus = node.cpus.max(1);
        let free_cpu_millis = (u64::from(cpus) * 1000)
            .saturating_sub(node.used.get(Resources::CPU).copied().unwrap_or(0))
            .max(u64::from(here));
        let threads = match train.threads {
            0 => (cpus / here).max(1),
            t => t,
        };
        let ip = node_ip(node);
        for _ in 0..here {
            ranks.push(RankPlace {
                node: node.id,
                ip: ip.clone(),
                gpu: total_gpus > 0,
                threads,
                cpu_millis: free_cpu_millis / u64::from(here),
            });
        }
    }
    per_node.retain(|&c| c > 0);
    Ok((ranks, per_node))
}

/// Places for up to `want` more trainers on live nodes of `status` that run none of the
/// job's ranks (`taken`, the places of its ranks), of the job's kind: one CPU trainer on
/// a node with a CPU free, or one GPU trainer per free GPU.
pub(super) fn room_to_grow(
    status: &runtime::ClusterStatus,
    taken: &[RankPlace],
    settings: &JobSettings,
    want: usize,
) -> Vec<RankPlace> {
    let gpu = taken.first().is_some_and(|p| p.gpu);
    let mut places = Vec::new();
    for node in status.live_nodes() {
        if taken.iter().any(|p| p.node == node.id) {
            continue;
        }
        let cpus = u64::from(node.cpus.max(1));
        let used = |kind: &str| node.used.get(kind).copied().unwrap_or(0);
        let free_cpu_millis = (cpus * 1000).saturating_sub(used(Resources::CPU));
        let slots = if gpu {
            (node.gpus.len() as u64).saturating_sub(used(Resources::GPU))
        } else {
            u64::from(free_cpu_millis >= 1000)
        };
        for _ in 0..slots {
            if places.len() >= want {
                return places;
            }
            let threads = match settings.threads {
                0 if gpu => (cpus / slots.max(1)).max(1) as u32,
                0 => (free_cpu_millis / 1000).max(1) as u32,
                t => t,
            };
            places.push(RankPlace {
                node: node.id,
                ip: node_ip(node),
                gpu,
                threads,
                cpu_millis: if gpu { 0 } else { free_cpu_millis },
            });
        }
    }
    places
}

/// The node's IP, where its trainers' ring ports are reached.
fn node_ip(node: &runtime::NodeStatus) -> String {
    node.address
        .rsplit_once(':')
        .map_or(node.address.as_str(), |(ip, _)| ip)
        .trim_matches(['[', ']'])
        .to_string()
}

/// `want` slots taken round-robin over nodes with `free` slots each.
pub(crate) fn take_spread(free: &[u32], want: u32) -> Vec<u32> {
    let mut taken = vec![0u32; free.len()];
    let mut left = want;
    while left > 0 {
        let mut progressed = false;
        for (slot, &cap) in taken.iter_mut().zip(free) {
            if left > 0 && *slot < cap {
                *slot += 1;
                left -= 1;
                progressed = true;
            }
        }
        if !progressed {
            break;
        }
    }
    taken
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_spread_round_robin() {
        let cases: [(&[u32], u32, &[u32]); 5] = [
            (&[2, 2], 4, &[2, 2]),
            (&[2, 2], 3, &[2, 1]),
            (&[1, 4], 4, &[1, 3]),
            (&[8], 2, &[2]),
            (&[1, 1], 5, &[1, 1]),
        ];
        for (free, want, expect) in cases {
            assert_eq!(take_spread(free, want), expect, "{free:?} want {want}");
        }
    }
}
