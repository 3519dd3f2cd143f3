//! The cluster a job runs on (the running one or an embedded one) and the world it
//! gets: how many trainers, where, with how many threads.

use anyhow::Context;
use runtime::{ActorRef, ClusterClient, NodeId, Resources};

use super::JobOptions;
use crate::config::Config;

/// The cluster a job runs on: the running one, or one embedded in this process.
pub(super) struct Cluster {
    pub(super) client: ClusterClient,
    pub(super) embedded: Option<(runtime::Head, tempfile::TempDir)>,
    pub(super) trainers: std::sync::Mutex<Vec<ActorRef>>,
}

impl Cluster {
    pub(super) async fn connect(config: &Config, options: &JobOptions) -> anyhow::Result<Self> {
        let state = crate::commands::cluster::state_dir(&config.cluster)?;
        if !options.embedded {
            match ClusterClient::connect(&state, options.address.as_deref()).await {
                Ok(client) => {
                    println!("cluster: head at {}", client.head());
                    return Ok(Self {
                        client,
                        embedded: None,
                        trainers: Default::default(),
                    });
                }
                Err(runtime::DaemonError::NoHead { .. }) if options.address.is_none() => {}
                Err(error) => {
                    return Err(error).context(
                        "connecting to the cluster (`imgrun stop` clears the records of a \
                         cluster that is gone; --embedded runs on a cluster of its own)",
                    );
                }
            }
        }
        let dir = tempfile::Builder::new()
            .prefix("imgrun-embedded-")
            .tempdir()
            .context("making the embedded cluster's state folder")?;
        let state = runtime::StateDir::at(dir.path());
        let head = runtime::Head::start(runtime::HeadConfig {
            bind: "127.0.0.1:0".parse().context("loopback address")?,
            advertise: None,
            state: state.clone(),
            resources: runtime::discover(&runtime::DiscoverOptions::default()),
            membership: crate::commands::cluster::membership(&config.cluster),
            transport: runtime::TransportOptions::default(),
            actors: crate::commands::cluster::actor_hosting(),
        })
        .await
        .context("starting the embedded cluster")?;
        let client = ClusterClient::connect(&state, Some(&head.join_address()))
            .await
            .context("connecting to the embedded cluster")?;
        println!(
            "cluster: embedded, on this machine only (no running cluster was found; \
             `imgrun start --head` starts one)"
        );
        Ok(Self {
            client,
            embedded: Some((head, dir)),
            trainers: Default::default(),
        })
    }

    pub(super) async fn stop_trainers(&self) {
        let trainers =
            std::mem::take(&mut *self.trainers.lock().unwrap_or_else(|e| e.into_inner()));
        let mut tasks = tokio::task::JoinSet::new();
        for trainer in trainers {
            tasks.spawn(async move {
                // A trainer stuck in a collective would not get to a graceful stop.
                let _ = trainer.kill().await;
            });
        }
        while tasks.join_next().await.is_some() {}
    }

    pub(super) async fn shutdown(self) {
        if let Some((head, _dir)) = self.embedded {
            head.stop().await;
        }
    }
}

/// Where one rank runs.
#[derive(Debug, Clone)]
pub(super) struct RankPlace {
    pub(super) node: NodeId,
    /// The node's IP, where its trainers' ring ports are reached.
    pub(super) ip: String,
    pub(super) gpu: bool,
    pub(super) threads: u32,
    /// The node's CPUs this rank reserves, in thousandths: its share of the node.
    pub(super) cpu_millis: u64,
}

/// The world: one rank per free GPU (or `gpus` of them), else CPU trainers; and the
/// ranks on each node used. Ranks are numbered node by node.
pub(super) fn plan_world(
    status: &runtime::ClusterStatus,
    train: &crate::config::TrainConfig,
) -> anyhow::Result<(Vec<RankPlace>, Vec<u32>)> {
    let live: Vec<&runtime::NodeStatus> = status.live_nodes().collect();
    anyhow::ensure!(!live.is_empty(), "the cluster has no live node");
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
        anyhow::ensure!(
            train.gpus == 0,
            "train.gpus = {} but the cluster has no free GPU",
            train.gpus
        );
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
        let ip = node
            .address
            .rsplit_once(':')
            .map_or(node.address.as_str(), |(ip, _)| ip)
            .trim_matches(['[', ']'])
            .to_string();
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

/// `want` slots taken round-robin over nodes with `free` slots each.
pub(super) fn take_spread(free: &[u32], want: u32) -> Vec<u32> {
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
    pub(super) fn slots_spread_round_robin() {
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
