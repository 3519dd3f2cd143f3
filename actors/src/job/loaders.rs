//! The job's loader actors (`data.loaders = "remote"`): spawned where the cluster has
//! CPUs free, each given a share of the ranks' loader workers, and each rank told which
//! loader actor runs each of its workers.

use std::net::SocketAddr;
use std::time::Duration;

use runtime::channel::ChannelSecret;
use runtime::{ActorLabel, ActorRef, ClusterClient, Resources, SpawnOptions, Strategy};

use super::JobError;
use super::calls::{Rank, call_all, to_json};
use super::output::JobOutput;
use super::world::Trainers;
use crate::load::{AddressRequest, LOADER_KIND, LoaderInit, LoaderMethod};
use crate::train::{JobSpec, LoadersRequest};

/// CPU a loader actor reserves per loader worker it runs (a decoder thread, and a reader
/// thread that mostly waits).
const CPU_MILLIS_PER_WORKER: u64 = 1000;

/// Which loader actor runs each (rank, worker): dealt out in turn over the ranks' workers,
/// so that each actor serves as many ranks as it can and each rank several actors.
pub(crate) fn deal(world: u32, workers: u32, actors: u32) -> Vec<Vec<usize>> {
    let actors = actors.max(1) as usize;
    let mut by_rank = vec![Vec::with_capacity(workers as usize); world as usize];
    let mut next = 0;
    for _ in 0..workers {
        for rank in by_rank.iter_mut() {
            rank.push(next % actors);
            next += 1;
        }
    }
    by_rank
}

/// Spawns the job's loader actors, asks each for its data channel's address, and tells
/// every rank where its workers' batches come from.
pub(crate) async fn start(
    client: &ClusterClient,
    trainers: &Trainers,
    job: &JobSpec,
    job_name: &str,
    ranks: &[Rank],
    output: &dyn JobOutput,
    timeout: Duration,
) -> Result<(), JobError> {
    let world = ranks.len() as u32;
    let workers = job.data.loader_workers.max(1);
    let pairs = world * workers;
    let count = match job.data.loader_actors {
        0 => world,
        n => n,
    }
    .min(pairs)
    .max(1);
    let dealt = deal(world, workers, count);
    let mut load = vec![0u32; count as usize];
    for actor in dealt.iter().flatten() {
        load[*actor] += 1;
    }
    let secret = ChannelSecret::random();
    static JOBS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let serial = JOBS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut tasks = tokio::task::JoinSet::new();
    for (k, &served) in load.iter().enumerate() {
        let init = LoaderInit {
            job: job.clone(),
            secret: secret.to_hex(),
            workers: served,
        };
        let first_rank = dealt.iter().position(|r| r.contains(&k)).unwrap_or(0) as u32;
        let options = SpawnOptions::new(LOADER_KIND)
            .args(to_json(&init))
            .resources(Resources::new().with_cpu_millis(CPU_MILLIS_PER_WORKER * u64::from(served)))
            .strategy(Strategy::Spread)
            .process_group(format!("load-{}-{serial}-{k}", std::process::id()))
            .label(ActorLabel::new(job_name, first_rank));
        let client = client.clone();
        tasks.spawn(async move { (k, client.spawn(options).await) });
    }
    let mut actors: Vec<Option<ActorRef>> = vec![None; count as usize];
    let mut failure = None;
    while let Some(joined) = tasks.join_next().await {
        let (k, spawned) =
            joined.map_err(|error| JobError::Refused(format!("a spawn task failed: {error}")))?;
        match spawned {
            Ok(actor) => {
                trainers.add(actor.clone());
                actors[k] = Some(actor);
            }
            Err(error) => {
                failure.get_or_insert_with(|| {
                    format!(
                        "loader actor {k} ({} loader workers, {} CPUs): starting it: {error}",
                        load[k],
                        load[k] as u64 * CPU_MILLIS_PER_WORKER / 1000
                    )
                });
            }
        }
    }
    if let Some(failure) = failure {
        return Err(JobError::Refused(format!(
            "{failure}. data.loaders = \"remote\" places loader actors on nodes with free \
             CPUs: add a node (`imgrun join`), lower data.loader_workers, or use \
             data.loaders = \"local\""
        )));
    }
    let actors: Vec<ActorRef> = actors.into_iter().flatten().collect();
    let mut addrs = Vec::with_capacity(actors.len());
    for (k, actor) in actors.iter().enumerate() {
        let bytes = actor
            .call(AddressRequest::NAME, to_json(&AddressRequest {}), timeout)
            .await
            .map_err(|error| {
                JobError::Refused(format!("loader actor {k} (node {}): {error}", actor.node()))
            })?;
        let reply: <AddressRequest as LoaderMethod>::Reply = serde_json::from_slice(&bytes)
            .map_err(|error| JobError::Refused(format!("loader actor {k}: bad reply: {error}")))?;
        addrs.push(reply.addr);
    }
    let loaders: Vec<Vec<Option<SocketAddr>>> = dealt
        .iter()
        .map(|rank| rank.iter().map(|&k| Some(addrs[k])).collect())
        .collect();
    call_all(
        ranks,
        |rank| LoadersRequest {
            loaders: loaders[rank.rank as usize].clone(),
            secret: secret.to_hex(),
        },
        timeout,
    )
    .await?;
    let mut nodes: Vec<String> = actors.iter().map(|a| a.node().to_string()).collect();
    nodes.sort();
    nodes.dedup();
    output.info(format!(
        "loaders: {} loader actor(s) on node(s) {} run the {pairs} loader workers of {world} \
         rank(s), sending uint8 batches over data channels",
        actors.len(),
        nodes.join(", ")
    ));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_are_dealt_out_over_ranks_first() {
        assert_eq!(deal(2, 2, 2), vec![vec![0, 0], vec![1, 1]]);
        assert_eq!(deal(2, 2, 4), vec![vec![0, 2], vec![1, 3]]);
        assert_eq!(deal(3, 2, 1), vec![vec![0, 0], vec![0, 0], vec![0, 0]]);
        assert_eq!(deal(1, 4, 2), vec![vec![0, 1, 0, 1]]);
        for (world, workers, actors) in [(4, 3, 5), (1, 1, 1), (8, 4, 3)] {
            let dealt = deal(world, workers, actors);
            let mut load = vec![0; actors as usize];
            for a in dealt.iter().flatten() {
                load[*a] += 1;
            }
            let (lo, hi) = (load.iter().min(), load.iter().max());
            assert!(
                hi.zip(lo).is_some_and(|(hi, lo)| hi - lo <= 1),
                "{world} {workers} {actors}: {load:?}"
            );
        }
    }
}
