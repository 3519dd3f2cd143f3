//! Carrying a [`Launch`] out: process 0 starts a head on the launcher's master machine;
//! every other process joins it as a node with its share of the machine, and serves until
//! the head stops it. Process 0 waits for all of them (saying who is missing when the time
//! is up) and runs the job on them; [`finish`] stops them. How the others learn the join
//! token and the CA to pin:
//! - from a [`Rendezvous`] record process 0 writes, mode 0600, where every process sees it:
//!   only processes that can read the file can join (the same user, as with a secret
//!   file);
//! - or, with a [`JoinSecret`] in every process's environment (a Kubernetes Secret),
//!   from there: process 0's head serves with the secret's CA and token, the others join
//!   the head's name, retrying with backoff while it does not resolve or answer yet (a
//!   pod's name resolves only once its pod runs).
//!
//! What each step did is told to a `report` of the caller's (the binary prints it); what
//! went wrong is a [`LaunchFailure`].

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::names::TOKEN_VAR;
use super::{GpuShareError, JoinSecret, Launch, Rendezvous, nodes_without_gpus, resources};
use crate::tls::{ClusterCa, JoinToken};
use crate::{
    ActorHosting, ClusterClient, DaemonError, Head, HeadConfig, MembershipConfig, Node, NodeConfig,
    NodeStatus, StateDir, TransportOptions,
};

/// How a launch is carried out: where its rendezvous file is, how long its processes wait
/// for each other, and what the head and the nodes run.
#[derive(Debug, Clone)]
pub struct LaunchSettings {
    /// The rendezvous file (`rendezvous_path` in a folder every process sees); unused
    /// when the launch has its join secret from the environment.
    pub rendezvous: PathBuf,
    /// How long process 0 waits for the others, and they for its record.
    pub timeout: Duration,
    pub membership: MembershipConfig,
    /// The head's heartbeat port (0: any).
    pub beat_port: u16,
    /// The GPUs each process offers (`launch.num_gpus`; `None`: those it finds).
    pub num_gpus: Option<usize>,
    pub actors: ActorHosting,
}

/// Why a launch could not be carried out.
#[derive(Debug, thiserror::Error)]
pub enum LaunchFailure {
    #[error(transparent)]
    Resources(#[from] GpuShareError),
    #[error("{launch}: starting the head on UDP port {port}: {error}")]
    HeadStart {
        launch: String,
        port: u16,
        error: DaemonError,
    },
    #[error("{launch}: the join secret of the environment: {error}")]
    Secret { launch: String, error: DaemonError },
    #[error("writing the rendezvous file {}: {error}", path.display())]
    Rendezvous {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("connecting to the job's head: {0}")]
    Connect(DaemonError),
    #[error(
        "launch: {joined} of {processes} processes joined within {} s (by host: \
         {by_host:?}). The others {}",
        timeout.as_secs(), missing_hint(rendezvous.as_deref(), master, *port)
    )]
    Missing {
        joined: usize,
        processes: u32,
        by_host: BTreeMap<String, usize>,
        timeout: Duration,
        /// The rendezvous file; `None` with the join secret from the environment.
        rendezvous: Option<PathBuf>,
        port: u16,
        master: String,
    },
    #[error(
        "launch: {} of {nodes} processes see no GPU ({}) while the others do: check \
         CUDA_VISIBLE_DEVICES and the launcher's GPU options",
        without.len(), without.join(", ")
    )]
    MixedGpus { without: Vec<String>, nodes: usize },
    #[error(
        "launch: {launch} could not join the job's head within {} s: {last} (process 0 \
         writes the rendezvous file there once its head is up; the folder must be one \
         every process sees: launch.rendezvous_dir)",
        timeout.as_secs()
    )]
    Join {
        launch: String,
        timeout: Duration,
        last: String,
    },
    #[error(
        "launch: {launch} could not join the job's head at {address} within {} s \
         ({attempts} tries; the name resolves once process 0's pod runs, and UDP port \
         {port} must reach it): {last}",
        timeout.as_secs()
    )]
    JoinByName {
        launch: String,
        address: String,
        port: u16,
        attempts: u32,
        timeout: Duration,
        last: String,
    },
    #[error("launch: the job's head ({master}:{port}, process 0) has been unreachable for 30 s")]
    HeadGone { master: String, port: u16 },
}

/// What [`LaunchFailure::Missing`] says the others could not do.
fn missing_hint(rendezvous: Option<&Path>, master: &str, port: u16) -> String {
    match rendezvous {
        Some(path) => format!(
            "did not find or could not use {} (it must be on a filesystem they see: \
             launch.rendezvous_dir), or cannot reach UDP port {port} on {master}",
            path.display()
        ),
        None => format!(
            "did not resolve {master} or cannot reach UDP port {port} on it, or hold \
             another join secret ({TOKEN_VAR})"
        ),
    }
}

/// Process 0's cluster: the head, a client of it, and the rendezvous file the others
/// joined through (`None` with the join secret from the environment).
#[derive(Debug)]
pub struct Led {
    pub head: Head,
    pub client: ClusterClient,
    pub rendezvous: Option<PathBuf>,
}

/// Process 0: the head (its state in `state`), the rendezvous file, and every process
/// joined; the job then runs on the returned cluster (and [`finish`] stops the others).
pub async fn lead(
    launch: &Launch,
    state: &Path,
    settings: LaunchSettings,
    report: &dyn Fn(String),
) -> Result<Led, LaunchFailure> {
    let state = StateDir::at(state);
    if let Some(secret) = &launch.secret {
        preset(&state, secret).map_err(|error| LaunchFailure::Secret {
            launch: launch.describe(),
            error,
        })?;
    }
    let head = Head::start(HeadConfig {
        bind: std::net::SocketAddr::from(([0, 0, 0, 0], launch.port)),
        advertise: Some(format!("{}:{}", launch.master, launch.port)),
        state: state.clone(),
        resources: resources(launch, settings.num_gpus)?,
        membership: settings.membership,
        transport: TransportOptions::default(),
        actors: settings.actors,
        beat_port: settings.beat_port,
    })
    .await
    .map_err(|error| LaunchFailure::HeadStart {
        launch: launch.describe(),
        port: launch.port,
        error,
    })?;
    let path = match &launch.secret {
        Some(_) => {
            report(format!(
                "launch: the others join {}:{} with the join secret of the environment",
                launch.master, launch.port
            ));
            None
        }
        None => Some(write_rendezvous(
            launch,
            &head,
            settings.rendezvous,
            report,
        )?),
    };
    // On this machine, by loopback: the head's advertised name may not resolve yet even
    // here (a pod's name resolves once the pod runs).
    let own = std::net::SocketAddr::from(([127, 0, 0, 1], head.local_addr().port()));
    let client = ClusterClient::connect(&state, Some(&own.to_string()))
        .await
        .map_err(LaunchFailure::Connect)?;
    let deadline = Instant::now() + settings.timeout.max(Duration::from_secs(1));
    loop {
        let status = client.status().await.map_err(LaunchFailure::Connect)?;
        let live: Vec<&NodeStatus> = status.live_nodes().collect();
        if live.len() as u32 >= launch.processes {
            let without = nodes_without_gpus(&live);
            if !without.is_empty() {
                return Err(LaunchFailure::MixedGpus {
                    without,
                    nodes: live.len(),
                });
            }
            report(format!(
                "launch: all {} processes joined ({} GPU(s))",
                launch.processes,
                live.iter().map(|n| n.gpus.len()).sum::<usize>()
            ));
            break;
        }
        if Instant::now() > deadline {
            if let Some(path) = &path {
                let _ = std::fs::remove_file(path);
            }
            let mut by_host = BTreeMap::new();
            for node in &live {
                *by_host.entry(node.hostname.clone()).or_default() += 1;
            }
            return Err(LaunchFailure::Missing {
                joined: live.len(),
                processes: launch.processes,
                by_host,
                timeout: settings.timeout,
                rendezvous: path,
                port: launch.port,
                master: launch.master.clone(),
            });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(Led {
        head,
        client,
        rendezvous: path,
    })
}

/// Puts the join secret's CA and token where the head loads its credentials from.
fn preset(state: &StateDir, secret: &JoinSecret) -> Result<(), DaemonError> {
    // `detect` gives process 0 the CA, checked against the pinned hash, and a valid token.
    let ca = secret
        .ca
        .as_ref()
        .expect("process 0's join secret holds the CA");
    let ca = ClusterCa::from_pem(&ca.cert, &ca.key).map_err(|source| DaemonError::Credentials {
        dir: state.path("head"),
        source,
    })?;
    let token: JoinToken = secret
        .token
        .parse()
        .map_err(|source| DaemonError::Credentials {
            dir: state.path("head/token"),
            source,
        })?;
    crate::head::preset_credentials(state, &ca, &token)
}

/// Writes the record the others join through; returns its path.
fn write_rendezvous(
    launch: &Launch,
    head: &Head,
    path: PathBuf,
    report: &dyn Fn(String),
) -> Result<PathBuf, LaunchFailure> {
    let record = Rendezvous {
        address: head.join_address(),
        token: head.token().as_str().to_string(),
        ca_hash: head.ca_hash().to_string(),
        processes: launch.processes,
    };
    let bytes = serde_json::to_vec(&record).expect("a rendezvous record serialises");
    write_private(&path, &bytes).map_err(|error| LaunchFailure::Rendezvous {
        path: path.clone(),
        error,
    })?;
    report(format!("launch: rendezvous file {}", path.display()));
    Ok(path)
}

/// Process 0, after the job: stops the other processes' nodes and removes the rendezvous
/// file, if there is one.
pub async fn finish(client: &ClusterClient, rendezvous: Option<&Path>) {
    let _ = client.stop(true).await;
    if let Some(path) = rendezvous {
        let _ = std::fs::remove_file(path);
    }
}

/// How a process other than process 0 left the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Followed {
    /// The head stopped this node: the job is over.
    Stopped,
    /// `stop` fired with this signal's name: the node left.
    Signalled(&'static str),
}

/// Every process but process 0: joins process 0's head as a node (its state in `state`)
/// and serves it until the head stops it, `stop` fires, or the head has been unreachable
/// for 30 s.
pub async fn follow(
    launch: &Launch,
    state: &Path,
    settings: LaunchSettings,
    report: &dyn Fn(String),
    stop: impl Future<Output = &'static str>,
) -> Result<Followed, LaunchFailure> {
    let node = match &launch.secret {
        Some(secret) => join_by_name(launch, secret, &settings, state, report).await?,
        None => join(launch, &settings, state).await?,
    };
    report(format!(
        "launch: joined as node {}; the job runs from process 0",
        node.node_id()
    ));
    let state = StateDir::at(state);
    let mut gone_since: Option<Instant> = None;
    tokio::pin!(stop);
    loop {
        tokio::select! {
            () = node.stopped() => return Ok(Followed::Stopped),
            signal = &mut stop => {
                node.stop().await;
                return Ok(Followed::Signalled(signal));
            }
            () = tokio::time::sleep(Duration::from_secs(2)) => {
                if head_answers(&state).await {
                    gone_since = None;
                } else if gone_since.get_or_insert_with(Instant::now).elapsed()
                    > Duration::from_secs(30)
                {
                    node.stop().await;
                    return Err(LaunchFailure::HeadGone {
                        master: launch.master.clone(),
                        port: launch.port,
                    });
                }
            }
        }
    }
}

/// Whether the head this node joined answers a status request.
async fn head_answers(state: &StateDir) -> bool {
    let ask = async {
        let client = ClusterClient::connect(state, None).await.ok()?;
        client.status().await.ok()
    };
    tokio::time::timeout(Duration::from_secs(5), ask)
        .await
        .ok()
        .flatten()
        .is_some()
}

/// Reads the rendezvous file and joins, trying again (a file from an earlier launch with
/// the same id, or none yet, or a head not yet reachable) until the settings' timeout.
async fn join(
    launch: &Launch,
    settings: &LaunchSettings,
    state: &Path,
) -> Result<Node, LaunchFailure> {
    let path = &settings.rendezvous;
    let deadline = Instant::now() + settings.timeout.max(Duration::from_secs(1));
    let mut last = format!("{} does not exist yet", path.display());
    loop {
        if let Some(record) = std::fs::read(path)
            .ok()
            .and_then(|b| serde_json::from_slice::<Rendezvous>(&b).ok())
        {
            match start_node(launch, &record, state, settings).await {
                Ok(node) => return Ok(node),
                Err(error) => last = format!("joining {}: {error}", record.address),
            }
        }
        if Instant::now() > deadline {
            return Err(LaunchFailure::Join {
                launch: launch.describe(),
                timeout: settings.timeout,
                last,
            });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Joins the head by its name with the join secret of the environment, retrying with
/// backoff (0.5 s, doubling to 5 s) until the settings' timeout: the name may not resolve
/// yet, or the head not answer yet.
async fn join_by_name(
    launch: &Launch,
    secret: &JoinSecret,
    settings: &LaunchSettings,
    state: &Path,
    report: &dyn Fn(String),
) -> Result<Node, LaunchFailure> {
    let record = Rendezvous {
        address: format!("{}:{}", launch.master, launch.port),
        token: secret.token.clone(),
        ca_hash: secret.ca_hash.clone(),
        processes: launch.processes,
    };
    let started = Instant::now();
    let deadline = started + settings.timeout.max(Duration::from_secs(1));
    let (mut attempts, mut pause) = (0u32, Duration::from_millis(500));
    loop {
        attempts += 1;
        let last = match start_node(launch, &record, state, settings).await {
            Ok(node) => return Ok(node),
            Err(error) => error,
        };
        if Instant::now() + pause > deadline {
            return Err(LaunchFailure::JoinByName {
                launch: launch.describe(),
                address: record.address,
                port: launch.port,
                attempts,
                timeout: settings.timeout,
                last,
            });
        }
        if attempts == 1 || attempts % 10 == 0 {
            report(format!(
                "launch: waiting for the head at {} ({} s so far): {last}",
                record.address,
                started.elapsed().as_secs()
            ));
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(5));
    }
}

async fn start_node(
    launch: &Launch,
    record: &Rendezvous,
    state: &Path,
    settings: &LaunchSettings,
) -> Result<Node, String> {
    let token = record
        .token
        .parse()
        .map_err(|e| format!("the token: {e}"))?;
    let ca_hash = record
        .ca_hash
        .parse()
        .map_err(|e| format!("the CA hash: {e}"))?;
    Node::start(NodeConfig {
        head: record.address.clone(),
        token,
        ca_hash,
        bind: std::net::SocketAddr::from(([0, 0, 0, 0], 0)),
        advertise: None,
        state: StateDir::at(state),
        resources: resources(launch, settings.num_gpus).map_err(|e| e.to_string())?,
        transport: TransportOptions::default(),
        actors: settings.actors.clone(),
    })
    .await
    .map_err(|e| e.to_string())
}

/// Writes `bytes` to `path` with mode 0600, atomically ([`crate::write_private`]),
/// creating its folder (in the shared runs folder, with the default mode) when missing.
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    crate::write_private(path, bytes)
}
