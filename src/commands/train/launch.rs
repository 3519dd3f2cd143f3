//! `imgrun train` started by a launcher, one process per machine or per GPU (`torchrun`,
//! Slurm's `srun`), with no `imgrun start`: the processes form a cluster of their own
//! for the job and run it as a cluster job.
//!
//! What the launcher says (which process this is, of how many, where the head runs) is
//! read by the launcher contract, `runtime::launch`; this carries it out.
//!
//! Launcher process 0 starts a head on `MASTER_ADDR`'s machine (UDP port `MASTER_PORT`;
//! torchrun's store uses the TCP port of that number) and writes the join line (address,
//! token, CA hash) into a rendezvous file, mode 0600, in a folder every process sees
//! (`launch.rendezvous_dir`, by default `<train.runs_dir>/.rendezvous`: on the shared
//! filesystem the job's runs go to). Every other process reads it, joins as a node with
//! its share of the machine (its GPU by its index among the machine's processes, or the
//! GPUs the launcher gave it), and waits; process 0 waits for all of them (saying who is
//! missing when the time is up), runs the job on them, then stops them. Only processes
//! that can read the file can join: the same user, as with a secret file. A process that
//! dies fails the job, as a lost node does.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use runtime::launch::{Launch, Rendezvous};

use crate::config::{Config, LaunchConfig};

/// The launcher this process runs under, if any (see [`runtime::launch::detect`]).
pub fn detect(
    config: &LaunchConfig,
    env: &dyn Fn(&str) -> Option<String>,
) -> anyhow::Result<Option<Launch>> {
    Ok(runtime::launch::detect(config.launcher, config.port, env)?)
}

/// The rendezvous file of `launch`, in `launch.rendezvous_dir` (by default
/// `<train.runs_dir>/.rendezvous`).
fn rendezvous_path(config: &Config, launch: &Launch) -> PathBuf {
    let dir = if config.launch.rendezvous_dir.is_empty() {
        Path::new(&config.train.runs_dir).join(".rendezvous")
    } else {
        PathBuf::from(&config.launch.rendezvous_dir)
    };
    runtime::launch::rendezvous_path(&dir, launch)
}

/// Process 0: the head, the rendezvous file, and every process joined; the job then runs
/// on the returned cluster (and [`finish`] stops the others).
pub(super) async fn lead(config: &Config, launch: &Launch) -> anyhow::Result<Led> {
    println!("launch: {}", launch.describe());
    let dir = tempfile::Builder::new()
        .prefix("imgrun-launch-")
        .tempdir()
        .context("making the head's state folder")?;
    let state = runtime::StateDir::at(dir.path());
    let head = runtime::Head::start(runtime::HeadConfig {
        bind: std::net::SocketAddr::from(([0, 0, 0, 0], launch.port)),
        advertise: Some(format!("{}:{}", launch.master, launch.port)),
        state: state.clone(),
        resources: runtime::launch::resources(launch)?,
        membership: crate::commands::cluster::membership(&config.cluster),
        transport: runtime::TransportOptions::default(),
        actors: crate::commands::cluster::actor_hosting(),
        beat_port: config.cluster.beat_port,
    })
    .await
    .with_context(|| {
        format!(
            "{}: starting the head on UDP port {}",
            launch.describe(),
            launch.port
        )
    })?;
    let path = rendezvous_path(config, launch);
    let record = Rendezvous {
        address: head.join_address(),
        token: head.token().as_str().to_string(),
        ca_hash: head.ca_hash().to_string(),
        processes: launch.processes,
    };
    write_private(&path, &serde_json::to_vec(&record)?)
        .with_context(|| format!("writing the rendezvous file {}", path.display()))?;
    println!("launch: rendezvous file {}", path.display());
    let client = runtime::ClusterClient::connect(&state, Some(&head.join_address()))
        .await
        .context("connecting to the job's head")?;
    let deadline = Instant::now() + Duration::from_secs(config.launch.timeout_secs.max(1));
    loop {
        let status = client.status().await.context("asking the head for nodes")?;
        let live: Vec<&runtime::NodeStatus> = status.live_nodes().collect();
        if live.len() as u32 >= launch.processes {
            check_gpus(&live)?;
            println!(
                "launch: all {} processes joined ({} GPU(s))",
                launch.processes,
                live.iter().map(|n| n.gpus.len()).sum::<usize>()
            );
            break;
        }
        if Instant::now() > deadline {
            let _ = std::fs::remove_file(&path);
            let mut hosts: BTreeMap<&str, usize> = BTreeMap::new();
            for node in &live {
                *hosts.entry(node.hostname.as_str()).or_default() += 1;
            }
            anyhow::bail!(
                "launch: {} of {} processes joined within {} s (by host: {hosts:?}). The \
                 others did not find or could not use {} (it must be on a filesystem they \
                 see: launch.rendezvous_dir), or cannot reach UDP port {} on {}",
                live.len(),
                launch.processes,
                config.launch.timeout_secs,
                path.display(),
                launch.port,
                launch.master
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(Led {
        head,
        dir,
        client,
        rendezvous: path,
    })
}

/// Process 0's cluster: the head, its state folder, a client, and the rendezvous file.
pub(super) struct Led {
    pub(super) head: runtime::Head,
    pub(super) dir: tempfile::TempDir,
    pub(super) client: runtime::ClusterClient,
    pub(super) rendezvous: PathBuf,
}

/// Every node offers GPUs or none does (see [`runtime::launch::nodes_without_gpus`]).
fn check_gpus(nodes: &[&runtime::NodeStatus]) -> anyhow::Result<()> {
    let without = runtime::launch::nodes_without_gpus(nodes);
    if !without.is_empty() {
        anyhow::bail!(
            "launch: {} of {} processes see no GPU ({}) while the others do: check \
             CUDA_VISIBLE_DEVICES and the launcher's GPU options",
            without.len(),
            nodes.len(),
            without.join(", ")
        );
    }
    Ok(())
}

/// Process 0, after the job: stops the other processes' nodes and removes the rendezvous
/// file.
pub(super) async fn finish(client: &runtime::ClusterClient, rendezvous: &Path) {
    let _ = client.stop(true).await;
    let _ = std::fs::remove_file(rendezvous);
}

/// Every process but process 0: joins process 0's head as a node and serves it until the head
/// stops it (exit 0) or goes away (exit 1).
pub fn follow(config: &Config, launch: &Launch) -> anyhow::Result<ExitCode> {
    println!("launch: {}", launch.describe());
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    tokio.block_on(async {
        let path = rendezvous_path(config, launch);
        let dir = tempfile::Builder::new()
            .prefix("imgrun-launch-")
            .tempdir()
            .context("making the node's state folder")?;
        let node = join(config, launch, &path, dir.path()).await?;
        println!(
            "launch: joined as node {}; the job runs from process 0",
            node.node_id()
        );
        let state = runtime::StateDir::at(dir.path());
        let mut signals = super::StopSignals::new()?;
        let mut gone_since: Option<Instant> = None;
        loop {
            tokio::select! {
                () = node.stopped() => {
                    println!("launch: the job's head stopped this node");
                    return Ok(ExitCode::SUCCESS);
                }
                signal = signals.next() => {
                    node.stop().await;
                    eprintln!("launch: {signal}: left the job");
                    return Ok(ExitCode::from(130));
                }
                () = tokio::time::sleep(Duration::from_secs(2)) => {
                    if head_answers(&state).await {
                        gone_since = None;
                    } else if gone_since.get_or_insert_with(Instant::now).elapsed()
                        > Duration::from_secs(30)
                    {
                        node.stop().await;
                        anyhow::bail!(
                            "launch: the job's head ({}:{}, process 0) has been unreachable \
                             for 30 s",
                            launch.master,
                            launch.port
                        );
                    }
                }
            }
        }
    })
}

/// Whether the head this node joined answers a status request.
async fn head_answers(state: &runtime::StateDir) -> bool {
    let ask = async {
        let client = runtime::ClusterClient::connect(state, None).await.ok()?;
        client.status().await.ok()
    };
    tokio::time::timeout(Duration::from_secs(5), ask)
        .await
        .ok()
        .flatten()
        .is_some()
}

/// Reads the rendezvous file and joins, trying again (a file from an earlier launch with
/// the same id, or none yet) until `launch.timeout_secs`.
async fn join(
    config: &Config,
    launch: &Launch,
    path: &Path,
    state: &Path,
) -> anyhow::Result<runtime::Node> {
    let deadline = Instant::now() + Duration::from_secs(config.launch.timeout_secs.max(1));
    let mut last = format!("{} does not exist yet", path.display());
    loop {
        if let Some(record) = std::fs::read(path)
            .ok()
            .and_then(|b| serde_json::from_slice::<Rendezvous>(&b).ok())
        {
            match start_node(launch, &record, state).await {
                Ok(node) => return Ok(node),
                Err(error) => last = format!("joining {}: {error:#}", record.address),
            }
        }
        if Instant::now() > deadline {
            anyhow::bail!(
                "launch: {} could not join the job's head within {} s: {last} (process 0 \
                 writes the rendezvous file there once its head is up; the folder must be \
                 one every process sees: launch.rendezvous_dir)",
                launch.describe(),
                config.launch.timeout_secs
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn start_node(
    launch: &Launch,
    record: &Rendezvous,
    state: &Path,
) -> anyhow::Result<runtime::Node> {
    let node = runtime::Node::start(runtime::NodeConfig {
        head: record.address.clone(),
        token: record.token.parse().context("the token")?,
        ca_hash: record.ca_hash.parse().context("the CA hash")?,
        bind: std::net::SocketAddr::from(([0, 0, 0, 0], 0)),
        advertise: None,
        state: runtime::StateDir::at(state),
        resources: runtime::launch::resources(launch)?,
        transport: runtime::TransportOptions::default(),
        actors: crate::commands::cluster::actor_hosting(),
    })
    .await?;
    Ok(node)
}

/// Writes `bytes` to `path` with mode 0600, atomically ([`runtime::write_private`]),
/// creating its folder (in the shared runs folder, with the default mode) when missing.
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    runtime::write_private(path, bytes)
}
