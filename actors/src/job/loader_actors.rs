//! The job's loader actors (`data.loaders = "remote"`): spawned where the cluster has
//! CPUs free, each given a share of the ranks' loader workers, and each rank told which
//! loader actor runs each of its workers.

use std::net::SocketAddr;
use std::time::Duration;

use runtime::channel::ChannelSecret;
use runtime::{ActorLabel, ActorRef, ClusterClient, NodeId, Resources, SpawnOptions, Strategy};

use super::JobError;
use super::calls::{RankHandle, call_all, to_json};
use super::output::JobOutput;
use super::world::Trainers;
use crate::load::{AddressRequest, LOADER_KIND, LoaderInit, LoaderMethod};
use crate::train::{JobSpec, LoaderActorsRequest};

/// CPU a loader actor reserves per loader worker it runs (a decoder thread, and a reader
/// thread that mostly waits).
const CPU_MILLIS_PER_WORKER: u64 = 1000;

/// Where the job's loader actors run, how many loader workers each runs and how many
/// CPUs it reserves: the decision [`start`] carries out, from the whole CPUs each live
/// node has free (after what is reserved there, the job's trainers included).
///
/// - The ranks' `pairs` loader workers (every rank's every worker) are split as evenly as
///   they go over `wanted` actors (`data.loader_actors`; the caller passes one per rank
///   for 0), never more actors than workers, each reserving a CPU per worker.
/// - Largest first, each actor goes to the node with the most CPUs still free (ties: the
///   lower node id).
/// - Where some actor does not fit, the workers are split over one more actor, and so on
///   down to one worker an actor.
/// - Where even that does not fit (fewer CPUs free than workers), each node with a CPU
///   free runs one actor that reserves all of them, the workers dealt out in proportion
///   to those CPUs: the workers share the CPUs there are.
///
/// The number of loader workers, on which the plan depends, never changes. Only a
/// cluster without a free CPU has no placement.
pub(crate) fn size_loader_actors(
    free: &[(NodeId, u32)],
    pairs: u32,
    wanted: u32,
) -> Result<Vec<LoaderPlace>, NoRoom> {
    let pairs = pairs.max(1);
    for count in wanted.clamp(1, pairs)..=pairs {
        let loads = (0..count).map(|k| pairs / count + u32::from(k < pairs % count));
        let mut left: Vec<(NodeId, u32)> = free.to_vec();
        let mut placed = Vec::with_capacity(count as usize);
        for workers in loads {
            let roomiest = left
                .iter_mut()
                .max_by_key(|(node, cpus)| (*cpus, std::cmp::Reverse(*node)));
            match roomiest {
                Some((node, cpus)) if *cpus >= workers => {
                    *cpus -= workers;
                    placed.push(LoaderPlace {
                        node: *node,
                        workers,
                        cpus: workers,
                    });
                }
                _ => break,
            }
        }
        if placed.len() == count as usize {
            return Ok(placed);
        }
    }
    // Fewer CPUs than workers: every free CPU, shared.
    let mut nodes: Vec<(NodeId, u32)> = free.iter().copied().filter(|(_, c)| *c > 0).collect();
    nodes.sort_by_key(|(node, cpus)| (std::cmp::Reverse(*cpus), *node));
    nodes.truncate(pairs as usize);
    let total: u64 = nodes.iter().map(|(_, cpus)| u64::from(*cpus)).sum();
    if total == 0 {
        return Err(NoRoom { pairs });
    }
    // Each node's share of the workers by its CPUs (at least one), the rest to the
    // roomiest first.
    let mut placed: Vec<LoaderPlace> = nodes
        .iter()
        .map(|(node, cpus)| LoaderPlace {
            node: *node,
            workers: u32::try_from(u64::from(pairs) * u64::from(*cpus) / total)
                .unwrap_or(pairs)
                .max(1),
            cpus: *cpus,
        })
        .collect();
    let mut dealt: u32 = placed.iter().map(|p| p.workers).sum();
    let actors = placed.len();
    let mut k = 0;
    while dealt < pairs {
        placed[k % actors].workers += 1;
        dealt += 1;
        k += 1;
    }
    while dealt > pairs {
        // Only the minimum of one each can overshoot; take back from the largest.
        if let Some(largest) = placed.iter_mut().max_by_key(|p| p.workers) {
            largest.workers -= 1;
        }
        dealt -= 1;
    }
    Ok(placed)
}

/// One loader actor of [`size_loader_actors`]: its node, the loader workers it runs, the CPUs
/// it reserves (as many as its workers, unless the cluster has fewer free).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LoaderPlace {
    pub(crate) node: NodeId,
    pub(crate) workers: u32,
    pub(crate) cpus: u32,
}

/// No placement of the loader actors exists: no live node has a CPU free.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NoRoom {
    pub(crate) pairs: u32,
}

/// Which loader actor runs each (rank, worker): dealt out in turn over the ranks' workers,
/// so that each actor serves as many ranks as it can and each rank several actors; an
/// actor that runs its share (`loads`) is passed over.
pub(crate) fn deal(world_size: u32, workers: u32, loads: &[u32]) -> Vec<Vec<usize>> {
    let mut by_rank = vec![Vec::with_capacity(workers as usize); world_size as usize];
    let mut left = loads.to_vec();
    let mut next = 0;
    for _ in 0..workers {
        for rank in by_rank.iter_mut() {
            // The loads add up to the workers: some actor has room.
            for _ in 0..left.len() {
                let k = next % left.len().max(1);
                next += 1;
                if left[k] > 0 {
                    left[k] -= 1;
                    rank.push(k);
                    break;
                }
            }
        }
    }
    by_rank
}

/// Whole CPUs free on each live node, from the cluster's status.
fn free_cpus(status: &runtime::ClusterStatus) -> Vec<(NodeId, u32)> {
    status
        .live_nodes()
        .map(|node| {
            let free = node.free_cpu_millis() / CPU_MILLIS_PER_WORKER;
            (node.id, u32::try_from(free).unwrap_or(u32::MAX))
        })
        .collect()
}

/// Spawns the job's loader actors, asks each for its data channel's address, and tells
/// every rank where its workers' batches come from.
pub(crate) async fn start(
    client: &ClusterClient,
    trainers: &Trainers,
    job: &JobSpec,
    job_name: &str,
    ranks: &[RankHandle],
    output: &dyn JobOutput,
    timeout: Duration,
) -> Result<(), JobError> {
    let world_size = ranks.len() as u32;
    let workers = job.data.loader_workers.max(1);
    let pairs = world_size * workers;
    let wanted = match job.data.loader_actors {
        0 => world_size,
        n => n,
    };
    let status = client
        .status()
        .await
        .map_err(JobError::cluster("asking for the cluster's free CPUs"))?;
    let free = free_cpus(&status);
    let placed = size_loader_actors(&free, pairs, wanted).map_err(|room| {
        JobError::Refused(format!(
            "data.loaders = \"remote\": no node has a CPU free for the {} loader workers of \
             {world_size} rank(s): add a node (`imgrun join`), or use data.loaders = \"local\"",
            room.pairs
        ))
    })?;
    let cpus: u32 = placed.iter().map(|p| p.cpus).sum();
    if cpus < pairs {
        output.info(format!(
            "loaders: the cluster has {cpus} CPU(s) free for {pairs} loader workers; they \
             share them (add a node or lower data.loader_workers for a CPU each)"
        ));
    }
    let load: Vec<u32> = placed.iter().map(|p| p.workers).collect();
    let count = load.len() as u32;
    let dealt = deal(world_size, workers, &load);
    let secret = ChannelSecret::random();
    static JOBS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let serial = JOBS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut tasks = tokio::task::JoinSet::new();
    for (k, &served) in load.iter().enumerate() {
        let init = LoaderInit {
            data: job.data.clone(),
            secret: secret.to_hex(),
            workers: served,
        };
        let first_rank = dealt.iter().position(|r| r.contains(&k)).unwrap_or(0) as u32;
        let options = SpawnOptions::new(LOADER_KIND)
            .args(to_json(&init))
            .resources(
                Resources::new().with_cpu_millis(CPU_MILLIS_PER_WORKER * u64::from(placed[k].cpus)),
            )
            .strategy(Strategy::Node(placed[k].node))
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
                        "loader actor {k} ({} loader workers, {} CPUs, node {}): starting it: \
                         {error}",
                        load[k], placed[k].cpus, placed[k].node
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
    let addrs = addresses(&actors, timeout).await?;
    let loader_actors: Vec<Vec<Option<SocketAddr>>> = dealt
        .iter()
        .map(|rank| rank.iter().map(|&k| Some(addrs[k])).collect())
        .collect();
    call_all(
        ranks,
        |rank| LoaderActorsRequest {
            loader_actors: loader_actors[rank.rank as usize].clone(),
            secret: secret.to_hex(),
        },
        timeout,
    )
    .await?;
    let mut nodes: Vec<String> = actors.iter().map(|a| a.node().to_string()).collect();
    nodes.sort();
    nodes.dedup();
    output.info(format!(
        "loaders: {} loader actor(s) on node(s) {} run the {pairs} loader workers of {world_size} \
         rank(s), sending uint8 batches over data channels",
        actors.len(),
        nodes.join(", ")
    ));
    Ok(())
}

/// The address of each loader actor's data channel, in order.
async fn addresses(actors: &[ActorRef], timeout: Duration) -> Result<Vec<SocketAddr>, JobError> {
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
    Ok(addrs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_are_dealt_out_over_ranks_first() {
        assert_eq!(deal(2, 2, &[2, 2]), vec![vec![0, 0], vec![1, 1]]);
        assert_eq!(deal(2, 2, &[1, 1, 1, 1]), vec![vec![0, 2], vec![1, 3]]);
        assert_eq!(deal(3, 2, &[6]), vec![vec![0, 0], vec![0, 0], vec![0, 0]]);
        assert_eq!(deal(1, 4, &[2, 2]), vec![vec![0, 1, 0, 1]]);
        // Uneven shares: an actor that runs its share is passed over.
        assert_eq!(deal(2, 2, &[3, 1]), vec![vec![0, 0], vec![1, 0]]);
        for (world_size, workers, actors) in [(4, 3, 5), (1, 1, 1), (8, 4, 3)] {
            let pairs = world_size * workers;
            let loads: Vec<u32> = (0..actors)
                .map(|k| pairs / actors + u32::from(k < pairs % actors))
                .collect();
            let dealt = deal(world_size, workers, &loads);
            let mut load = vec![0; actors as usize];
            for a in dealt.iter().flatten() {
                load[*a] += 1;
            }
            assert_eq!(load, loads, "{world_size} {workers} {actors}");
        }
    }

    #[test]
    fn loader_actors_are_sized_to_the_free_cpus_without_changing_the_workers() {
        let n = |id, cpus| (NodeId(id), cpus);
        /// Free CPUs by node, loader workers, actors wanted; then (node, workers, CPUs)
        /// of each actor, or none for no placement.
        type Case<'a> = (&'a [(NodeId, u32)], u32, u32, Option<&'a [(u64, u32, u32)]>);
        let cases: &[Case] = &[
            // Room as asked: one actor per rank, spread, a CPU a worker.
            (&[n(1, 8), n(2, 8)], 8, 2, Some(&[(1, 4, 4), (2, 4, 4)])),
            // Actors of 2 do not both fit: three actors (2, 1, 1).
            (
                &[n(1, 1), n(2, 1), n(3, 2)],
                4,
                2,
                Some(&[(3, 2, 2), (1, 1, 1), (2, 1, 1)]),
            ),
            // Actors of 3 fit on no node of 2: three of 2 do.
            (
                &[n(1, 2), n(2, 2), n(3, 2), n(4, 2)],
                6,
                2,
                Some(&[(1, 2, 2), (2, 2, 2), (3, 2, 2)]),
            ),
            // Never more actors than workers; a node takes several actors.
            (&[n(1, 16)], 3, 8, Some(&[(1, 1, 1), (1, 1, 1), (1, 1, 1)])),
            // Three nodes of 2 CPUs, 2 CPU trainers holding their nodes' CPUs, 4 workers
            // a rank (the defaults): the 8 workers share the 2 CPUs of the third node.
            (&[n(1, 0), n(2, 0), n(3, 2)], 8, 2, Some(&[(3, 8, 2)])),
            // Fewer CPUs than workers on several nodes: shares by CPUs, at least one.
            (&[n(1, 3), n(2, 1)], 8, 2, Some(&[(1, 6, 3), (2, 2, 1)])),
            (
                &[n(1, 1), n(2, 1), n(3, 1)],
                4,
                4,
                Some(&[(1, 2, 1), (2, 1, 1), (3, 1, 1)]),
            ),
            // No CPU free anywhere: no placement.
            (&[n(1, 0), n(2, 0)], 4, 1, None),
            (&[], 4, 1, None),
        ];
        for (free, pairs, wanted, want) in cases {
            let got = size_loader_actors(free, *pairs, *wanted);
            match want {
                Some(want) => {
                    let want: Vec<LoaderPlace> = want
                        .iter()
                        .map(|&(node, workers, cpus)| LoaderPlace {
                            node: NodeId(node),
                            workers,
                            cpus,
                        })
                        .collect();
                    assert_eq!(got, Ok(want), "{free:?} {pairs} {wanted}");
                    let served: u32 = got.iter().flatten().map(|p| p.workers).sum();
                    assert_eq!(served, *pairs, "every worker runs somewhere");
                }
                None => assert!(got.is_err(), "{free:?} {pairs} {wanted}: {got:?}"),
            }
        }
    }
}
