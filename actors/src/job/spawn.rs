//! Starting a world's trainers: one trainer actor (and its monitor) per place, the
//! shards each node preloads, and the ring the ranks form.

use std::time::Duration;

use runtime::{ActorLabel, ClusterClient, Resources, SpawnOptions, Strategy};

use super::calls::{RankHandle, call_all, to_json};
use super::error::JobError;
use super::output::{JobEvent, JobOutput};
use super::world::{RankPlace, Trainers};
use crate::train::phase::MONITOR_KIND;
use crate::train::{
    ConnectReply, ConnectRequest, DeviceSpec, JobSpec, ListenReply, MixPeer, PreloadReply,
    PreloadRequest, ResumeFrom, SyncChoice, TRAINER_KIND, TrainerInit,
};

/// Spawns one trainer per place, ranks `first..` in order, each labelled with the job's
/// name and its rank (what `imgrun status` shows), for a world of `node_ranks[i]` ranks
/// on node `i`.
pub(super) async fn spawn_trainers(
    client: &ClusterClient,
    trainers: &Trainers,
    job: &JobSpec,
    job_name: &str,
    places: &[RankPlace],
    (node_ranks, first): (&[u32], u32),
) -> Result<Vec<RankHandle>, JobError> {
    let world_size: u32 = node_ranks.iter().sum();
    // Unique per job, also among the jobs of one coordinator host (the head's daemon).
    static JOBS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let serial = JOBS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let group = format!("train-{}-{serial}", std::process::id());
    let mut tasks = tokio::task::JoinSet::new();
    for (i, place) in places.iter().enumerate() {
        let r = first as usize + i;
        let init = TrainerInit {
            rank: r as u32,
            world: world_size,
            node_ranks: node_ranks.to_vec(),
            threads: place.threads,
            device: if place.gpu {
                DeviceSpec::Cuda
            } else {
                DeviceSpec::Cpu
            },
            job: job.clone(),
        };
        let resources = if place.gpu {
            Resources::new().with_gpus(1)
        } else {
            Resources::new().with_cpu_millis(place.cpu_millis)
        };
        let process_group = format!("{group}-rank{r}");
        let label = ActorLabel::new(job_name, r as u32);
        let options = SpawnOptions::new(TRAINER_KIND)
            .args(to_json(&init))
            .resources(resources)
            .strategy(Strategy::Node(place.node))
            .process_group(&process_group)
            .label(label.clone());
        // The rank's monitor shares its trainer's process, to read its phase.
        let monitor = SpawnOptions::new(MONITOR_KIND)
            .strategy(Strategy::Node(place.node))
            .process_group(process_group)
            .label(label);
        let client = client.clone();
        let place = place.clone();
        tasks.spawn(async move {
            let spawned = client.spawn(options).await;
            let monitor = match &spawned {
                Ok(_) => match client.spawn(monitor).await {
                    Ok(monitor) => Some(monitor),
                    Err(error) => {
                        tracing::warn!(rank = r, %error, "no monitor for the rank: its phase cannot be shown");
                        None
                    }
                },
                Err(_) => None,
            };
            (r, place, spawned, monitor)
        });
    }
    let mut ranks = Vec::new();
    let mut failure = None;
    while let Some(joined) = tasks.join_next().await {
        let (r, place, spawned, monitor) =
            joined.map_err(|error| JobError::Refused(format!("a spawn task failed: {error}")))?;
        if let Some(monitor) = &monitor {
            trainers.add(monitor.clone());
        }
        match spawned {
            Ok(actor) => {
                trainers.add(actor.clone());
                ranks.push(RankHandle {
                    rank: r as u32,
                    place,
                    actor,
                    monitor,
                });
            }
            Err(error) => {
                failure.get_or_insert_with(|| {
                    format!(
                        "rank {r} (node {}): starting its trainer: {error}",
                        place.node
                    )
                });
            }
        }
    }
    if let Some(failure) = failure {
        return Err(JobError::Refused(failure));
    }
    ranks.sort_by_key(|r| r.rank);
    Ok(ranks)
}

/// How the job's ranks form their ring: its secret, its id, the ring's timeout.
pub(super) struct Ring {
    pub(super) secret: String,
    /// The ring's id (the run folder's path), which its handshake checks.
    pub(super) id: String,
    pub(super) op_timeout_secs: u64,
}

impl Ring {
    /// Connects `ranks` into a ring through the ports of their `listens` (and a
    /// decentralized job's mixing groups); restores `resume` or hands out rank 0's
    /// weights. `regrouped`: the survivors of a loss, whose weights are the model.
    pub(super) async fn wire(
        &self,
        job: &JobSpec,
        ranks: &[RankHandle],
        listens: &[ListenReply],
        resume: Option<ResumeFrom>,
        regrouped: bool,
        timeout: Duration,
    ) -> Result<Vec<ConnectReply>, JobError> {
        let mix_peers: Vec<MixPeer> = if job.optim.sync == SyncChoice::Decentralized {
            ranks
                .iter()
                .map(|rank| MixPeer {
                    ip: rank
                        .place
                        .ip
                        .parse()
                        .unwrap_or(std::net::IpAddr::from([127, 0, 0, 1])),
                    ports: listens[rank.rank as usize].mix_ports.clone(),
                })
                .collect()
        } else {
            Vec::new()
        };
        call_all(
            ranks,
            |rank| {
                let next = &ranks[(rank.rank as usize + 1) % ranks.len()];
                let port = listens[next.rank as usize].port;
                let next_addr = format!("{}:{port}", next.place.ip)
                    .parse()
                    .unwrap_or_else(|_| std::net::SocketAddr::from(([127, 0, 0, 1], port)));
                ConnectRequest {
                    next: next_addr,
                    secret: self.secret.clone(),
                    ring_id: self.id.clone(),
                    op_timeout_secs: self.op_timeout_secs,
                    resume: resume.clone(),
                    nccl_id: listens[0].nccl_id.clone(),
                    mix_peers: mix_peers.clone(),
                    regrouped,
                }
            },
            timeout,
        )
        .await
    }
}

/// Has every node copy the shards its ranks read into `dir`, a second of copying per call
/// so that progress shows, until all are in place.
pub(super) async fn preload(
    ranks: &[RankHandle],
    dir: &str,
    output: &dyn JobOutput,
    timeout: Duration,
) -> Result<(), JobError> {
    let started = std::time::Instant::now();
    let (copied, present, bytes) = loop {
        let replies: Vec<PreloadReply> =
            call_all(ranks, |_| PreloadRequest { seconds: 1.0 }, timeout).await?;
        let done: u64 = replies.iter().map(|r| r.done).sum();
        let total: u64 = replies.iter().map(|r| r.total).sum();
        let present: u64 = replies.iter().map(|r| r.present).sum();
        let bytes: u64 = replies.iter().map(|r| r.bytes).sum();
        output.event(JobEvent::Preloading { done, total, bytes });
        if done >= total {
            break (done - present.min(done), present, bytes);
        }
    };
    output.event(JobEvent::Preloaded);
    output.info(format!(
        "preload: {copied} shard(s) copied ({:.1} MB) and {present} already there (over all \
         nodes), in {dir} on each node, in {:.1} s; the job reads the copies",
        bytes as f64 / 1e6,
        started.elapsed().as_secs_f64()
    ));
    Ok(())
}
