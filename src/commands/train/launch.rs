//! `imgrun train` started by a launcher, one process per machine or per GPU (`torchrun`,
//! Slurm's `srun`), with no `imgrun start`: the processes form a cluster of their own
//! for the job and run it as a cluster job.
//!
//! The launcher numbers its processes (its `RANK` of `WORLD_SIZE`, Slurm's `SLURM_PROCID`
//! of `SLURM_NTASKS`); here that is a [`Launch`]'s `process` of its `processes`, not a
//! trainer's rank: each process joins as a node, which may hold several ranks.
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
use serde::{Deserialize, Serialize};

use crate::config::{Config, LaunchConfig, Launcher};

/// Which launcher started this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LauncherKind {
    Torchrun,
    Slurm,
}

impl LauncherKind {
    fn name(self) -> &'static str {
        match self {
            Self::Torchrun => "torchrun",
            Self::Slurm => "slurm",
        }
    }
}

/// What the launcher says about this process and its job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    pub kind: LauncherKind,
    /// This process's index among the launched processes (the launcher's rank), and how
    /// many there are (its world size).
    pub process: u32,
    pub processes: u32,
    /// Its index among the processes of its machine (the launcher's local rank), and how
    /// many run there.
    pub local_process: u32,
    pub local_processes: u32,
    /// The machine that runs the head (launcher process 0's), and the head's UDP port.
    pub master: String,
    pub port: u16,
    /// The launcher's id of this launch (torchrun's run id, Slurm's job and step).
    pub launch_id: String,
}

impl Launch {
    fn describe(&self) -> String {
        format!(
            "{} process {} of {} (local {} of {}), head at {}:{}",
            self.kind.name(),
            self.process,
            self.processes,
            self.local_process,
            self.local_processes,
            self.master,
            self.port
        )
    }
}

/// The launcher this process runs under, if any, from `env` (the process's environment).
/// `None` when none applies or the launcher started a single process (which runs as an
/// ordinary embedded job).
pub fn detect(
    config: &LaunchConfig,
    env: &dyn Fn(&str) -> Option<String>,
) -> anyhow::Result<Option<Launch>> {
    let torchrun = env("RANK").is_some() && env("WORLD_SIZE").is_some();
    // `srun --pty bash` sets SLURM_STEP_ID too, but for one task.
    let slurm = env("SLURM_STEP_ID").is_some() && env("SLURM_PROCID").is_some();
    let launch = match config.launcher {
        Launcher::None => return Ok(None),
        Launcher::Torchrun => Some(torchrun_launch(env)?),
        Launcher::Slurm => Some(slurm_launch(env, config.port)?),
        Launcher::Auto if torchrun => Some(torchrun_launch(env)?),
        Launcher::Auto if slurm => Some(slurm_launch(env, config.port)?),
        Launcher::Auto => None,
    };
    Ok(launch.filter(|l| l.processes > 1 || config.launcher != Launcher::Auto))
}

/// The variable `name`, parsed, or an error naming it.
fn var<T: std::str::FromStr>(
    env: &dyn Fn(&str) -> Option<String>,
    launcher: &str,
    name: &str,
) -> anyhow::Result<T>
where
    T::Err: std::fmt::Display,
{
    let value = env(name).with_context(|| {
        format!("{launcher}: {name} is not set (launch.launcher = \"none\" runs without it)")
    })?;
    value
        .trim()
        .parse()
        .map_err(|e| anyhow::anyhow!("{launcher}: {name}={value:?}: {e}"))
}

fn torchrun_launch(env: &dyn Fn(&str) -> Option<String>) -> anyhow::Result<Launch> {
    let get = |name| var::<u32>(env, "torchrun", name);
    let (process, processes) = (get("RANK")?, get("WORLD_SIZE")?);
    let local_process = env("LOCAL_RANK").map_or(Ok(0), |_| get("LOCAL_RANK"))?;
    let local_processes = env("LOCAL_WORLD_SIZE").map_or(Ok(1), |_| get("LOCAL_WORLD_SIZE"))?;
    let launch = Launch {
        kind: LauncherKind::Torchrun,
        process,
        processes,
        local_process,
        local_processes,
        master: var(env, "torchrun", "MASTER_ADDR")?,
        port: var(env, "torchrun", "MASTER_PORT")?,
        launch_id: env("TORCHELASTIC_RUN_ID").unwrap_or_else(|| "none".into()),
    };
    check(&launch)?;
    Ok(launch)
}

fn slurm_launch(env: &dyn Fn(&str) -> Option<String>, port: u16) -> anyhow::Result<Launch> {
    let get = |name| var::<u32>(env, "slurm", name);
    let (process, processes) = (get("SLURM_PROCID")?, get("SLURM_NTASKS")?);
    let node = get("SLURM_NODEID")?;
    let nodes_var = ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"]
        .into_iter()
        .find(|name| env(name).is_some())
        .context("slurm: neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set")?;
    let hosts = expand_nodelist(&env(nodes_var).unwrap_or_default())
        .map_err(|e| anyhow::anyhow!("slurm: {nodes_var}: {e}"))?;
    let tasks_var = ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"]
        .into_iter()
        .find(|name| env(name).is_some())
        .context("slurm: neither SLURM_STEP_TASKS_PER_NODE nor SLURM_TASKS_PER_NODE is set")?;
    let tasks = tasks_per_node(&env(tasks_var).unwrap_or_default())
        .map_err(|e| anyhow::anyhow!("slurm: {tasks_var}: {e}"))?;
    let total: u32 = tasks.iter().sum();
    anyhow::ensure!(
        total == processes && tasks.len() == hosts.len(),
        "slurm: {tasks_var} gives {total} tasks on {} node(s), SLURM_NTASKS is {processes} and \
         {nodes_var} names {} node(s): the step's variables disagree",
        tasks.len(),
        hosts.len()
    );
    let job_id: u64 = var(env, "slurm", "SLURM_JOB_ID")?;
    let step = env("SLURM_STEP_ID").unwrap_or_default();
    let launch = Launch {
        kind: LauncherKind::Slurm,
        process,
        processes,
        local_process: get("SLURM_LOCALID")?,
        local_processes: tasks
            .get(node as usize)
            .copied()
            .with_context(|| format!("slurm: SLURM_NODEID {node} of {} nodes", tasks.len()))?,
        master: hosts[0].clone(),
        // One port per job, so jobs sharing a first node do not meet.
        port: if port > 0 {
            port
        } else {
            29400 + (job_id % 500) as u16
        },
        launch_id: format!("{job_id}.{step}"),
    };
    check(&launch)?;
    Ok(launch)
}

fn check(launch: &Launch) -> anyhow::Result<()> {
    let name = launch.kind.name();
    anyhow::ensure!(
        launch.process < launch.processes,
        "{name}: process {} of only {} launched processes",
        launch.process,
        launch.processes
    );
    anyhow::ensure!(
        launch.local_processes >= 1 && launch.local_process < launch.local_processes,
        "{name}: local process {} of only {} processes on this machine",
        launch.local_process,
        launch.local_processes
    );
    Ok(())
}

/// A Slurm node list (`gpu[01-04,07],login1`) as host names, zero padding kept.
pub fn expand_nodelist(list: &str) -> Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    let list = list.trim();
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.checked_sub(1).ok_or("an unmatched `]`")?,
            ',' if depth == 0 => {
                hosts.extend(expand_host(&list[start..i])?);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("an unmatched `[`".into());
    }
    hosts.extend(expand_host(&list[start..])?);
    if hosts.is_empty() {
        return Err("no host".into());
    }
    Ok(hosts)
}

/// One item of a node list: text with bracketed ranges, each expanded in turn.
fn expand_host(item: &str) -> Result<Vec<String>, String> {
    if item.is_empty() {
        return Err("an empty host name".into());
    }
    let Some(open) = item.find('[') else {
        return Ok(vec![item.to_string()]);
    };
    let close = item[open..]
        .find(']')
        .map(|c| open + c)
        .ok_or("an unmatched `[`")?;
    let (prefix, ranges, rest) = (&item[..open], &item[open + 1..close], &item[close + 1..]);
    let tails = expand_host_tail(rest)?;
    let mut hosts = Vec::new();
    for range in ranges.split(',') {
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        let parse = |s: &str| {
            s.parse::<u64>()
                .map_err(|_| format!("`{range}` in `{item}` is not a number or range"))
        };
        let (from, to) = (parse(lo)?, parse(hi)?);
        if to < from || to - from > 100_000 {
            return Err(format!("`{range}` in `{item}` is not a usable range"));
        }
        for n in from..=to {
            for tail in &tails {
                hosts.push(format!("{prefix}{n:0width$}{tail}", width = lo.len()));
            }
        }
    }
    Ok(hosts)
}

fn expand_host_tail(rest: &str) -> Result<Vec<String>, String> {
    if rest.is_empty() {
        Ok(vec![String::new()])
    } else {
        expand_host(rest)
    }
}

/// Slurm's tasks per node (`8(x2),4`): one count per node.
pub fn tasks_per_node(spec: &str) -> Result<Vec<u32>, String> {
    let mut counts = Vec::new();
    for item in spec.trim().split(',') {
        let (count, repeat) = match item.split_once("(x") {
            Some((count, repeat)) => {
                let repeat = repeat
                    .strip_suffix(')')
                    .ok_or_else(|| format!("`{item}`: expected N(xM)"))?;
                (
                    count,
                    repeat.parse::<u32>().map_err(|_| format!("`{item}`"))?,
                )
            }
            None => (item, 1),
        };
        let count = count
            .parse::<u32>()
            .map_err(|_| format!("`{item}` is not a task count"))?;
        if repeat > 100_000 {
            return Err(format!("`{item}`: too many nodes"));
        }
        counts.extend(std::iter::repeat_n(count, repeat as usize));
    }
    Ok(counts)
}

/// The join line process 0 writes for the others.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Rendezvous {
    address: String,
    token: String,
    ca_hash: String,
    /// How many processes were launched (the file's key is `world`).
    #[serde(rename = "world")]
    processes: u32,
}

/// The rendezvous file of `launch` (by its launcher, id, head and port).
fn rendezvous_path(config: &Config, launch: &Launch) -> PathBuf {
    let dir = if config.launch.rendezvous_dir.is_empty() {
        Path::new(&config.train.runs_dir).join(".rendezvous")
    } else {
        PathBuf::from(&config.launch.rendezvous_dir)
    };
    let clean = |s: &str| -> String {
        s.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '.' {
                    c
                } else {
                    '_'
                }
            })
            .collect()
    };
    dir.join(format!(
        "{}-{}-{}-{}.json",
        launch.kind.name(),
        clean(&launch.launch_id),
        clean(&launch.master),
        launch.port
    ))
}

/// What this process offers as a node: its GPU by its local process index when every
/// process of the machine sees all of them, the GPUs the launcher gave it otherwise, and its share of
/// the CPUs. A count of GPUs that fits neither is refused, naming both.
fn resources(launch: &Launch) -> anyhow::Result<runtime::NodeResources> {
    let all = runtime::discover(&runtime::DiscoverOptions::default());
    let seen = all.gpus.len() as u32;
    let visible = if launch.local_processes > 1 && seen == launch.local_processes {
        let gpu = &all.gpus[launch.local_process as usize];
        runtime::VisibleDevices::Set(gpu.uuid.clone())
    } else if launch.local_processes > 1 && seen > 1 {
        anyhow::bail!(
            "{}: this process sees {seen} GPUs and {} processes run on this machine: \
             give each process one GPU (`srun --gpus-per-task=1`), or let each see all \
             {} so that local rank picks one, or start one process per machine",
            launch.describe(),
            launch.local_processes,
            launch.local_processes
        );
    } else {
        runtime::VisibleDevices::Inherit
    };
    let cpus = (all.cpus / launch.local_processes.max(1) as usize).max(1);
    Ok(runtime::discover(&runtime::DiscoverOptions {
        num_cpus: Some(cpus),
        visible_devices: visible,
        ..runtime::DiscoverOptions::default()
    }))
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
        resources: resources(launch)?,
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

/// Every node offers GPUs or none does: a process that sees none among others that do
/// would make a CPU trainer among GPU ones.
fn check_gpus(nodes: &[&runtime::NodeStatus]) -> anyhow::Result<()> {
    let without: Vec<String> = nodes
        .iter()
        .filter(|n| n.gpus.is_empty())
        .map(|n| format!("node {} on {}", n.id, n.hostname))
        .collect();
    if !without.is_empty() && without.len() < nodes.len() {
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
        resources: resources(launch)?,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_lists_expand_as_slurm_writes_them() {
        let cases: [(&str, &[&str]); 6] = [
            ("gpu01", &["gpu01"]),
            (
                "gpu[01-04,07]",
                &["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"],
            ),
            ("a[8-10],login1", &["a8", "a9", "a10", "login1"]),
            ("r[1-2]-n[01-02]", &["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
            ("node[009-011]", &["node009", "node010", "node011"]),
            ("x,y", &["x", "y"]),
        ];
        for (list, want) in cases {
            assert_eq!(expand_nodelist(list).expect(list), want, "{list}");
        }
        for bad in ["", "gpu[01-", "gpu]", "gpu[a-b]", "gpu[5-1]", "a,,b"] {
            assert!(expand_nodelist(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn tasks_per_node_expand_repeats() {
        assert_eq!(tasks_per_node("8(x2),4").expect("parse"), vec![8, 8, 4]);
        assert_eq!(tasks_per_node("2").expect("parse"), vec![2]);
        assert_eq!(tasks_per_node("1(x3)").expect("parse"), vec![1, 1, 1]);
        for bad in ["", "x", "8(x2", "8(xz)", "-1"] {
            assert!(tasks_per_node(bad).is_err(), "{bad:?}");
        }
    }

    fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: BTreeMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| map.get(name).cloned()
    }

    fn config(launcher: Launcher) -> LaunchConfig {
        LaunchConfig {
            launcher,
            rendezvous_dir: String::new(),
            port: 0,
            timeout_secs: 120,
        }
    }

    #[test]
    fn torchrun_and_slurm_are_read_and_an_interactive_shell_is_not_a_launch() {
        let torchrun = env_of(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "gpu01"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_RUN_ID", "r50"),
        ]);
        let launch = detect(&config(Launcher::Auto), &torchrun)
            .expect("valid")
            .expect("a launch");
        assert_eq!(
            launch,
            Launch {
                kind: LauncherKind::Torchrun,
                process: 3,
                processes: 8,
                local_process: 1,
                local_processes: 2,
                master: "gpu01".into(),
                port: 29500,
                launch_id: "r50".into(),
            }
        );
        let slurm = env_of(&[
            ("SLURM_JOB_ID", "4321"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_PROCID", "9"),
            ("SLURM_NTASKS", "10"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "2"),
            ("SLURM_JOB_NODELIST", "gpu[01-02],cpu7"),
            ("SLURM_TASKS_PER_NODE", "4(x2),2"),
        ]);
        let launch = detect(&config(Launcher::Auto), &slurm)
            .expect("valid")
            .expect("a launch");
        assert_eq!(
            (
                launch.process,
                launch.processes,
                launch.local_processes,
                launch.master.as_str()
            ),
            (9, 10, 2, "gpu01")
        );
        assert_eq!(
            (launch.port, launch.launch_id.as_str()),
            (29400 + 321, "4321.0")
        );
        // An interactive shell on a node: SLURM_* without a step of several tasks.
        let shell = env_of(&[("SLURM_JOB_ID", "4321"), ("SLURM_NODEID", "0")]);
        assert_eq!(
            detect(&config(Launcher::Auto), &shell).expect("valid"),
            None
        );
        let one = env_of(&[
            ("SLURM_JOB_ID", "1"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "0"),
            ("SLURM_JOB_NODELIST", "a1"),
            ("SLURM_TASKS_PER_NODE", "1"),
        ]);
        assert_eq!(detect(&config(Launcher::Auto), &one).expect("valid"), None);
        assert_eq!(
            detect(&config(Launcher::None), &torchrun).expect("valid"),
            None
        );
    }

    #[test]
    fn launcher_mistakes_name_the_variable() {
        type Vars<'a> = &'a [(&'a str, &'a str)];
        let cases: [(Vars, Launcher, &str); 4] = [
            (&[("RANK", "0")], Launcher::Torchrun, "WORLD_SIZE"),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "two")],
                Launcher::Auto,
                "WORLD_SIZE=\"two\"",
            ),
            (
                &[
                    ("RANK", "4"),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "a"),
                    ("MASTER_PORT", "1"),
                ],
                Launcher::Auto,
                "process 4 of only 2 launched processes",
            ),
            (
                &[
                    ("SLURM_JOB_ID", "1"),
                    ("SLURM_STEP_ID", "0"),
                    ("SLURM_PROCID", "0"),
                    ("SLURM_NTASKS", "3"),
                    ("SLURM_LOCALID", "0"),
                    ("SLURM_NODEID", "0"),
                    ("SLURM_JOB_NODELIST", "a[1-2]"),
                    ("SLURM_TASKS_PER_NODE", "2(x2)"),
                ],
                Launcher::Auto,
                "disagree",
            ),
        ];
        for (vars, launcher, want) in cases {
            let error = detect(&config(launcher), &env_of(vars)).expect_err(want);
            assert!(
                format!("{error:#}").contains(want),
                "{error:#} lacks {want}"
            );
        }
    }
}
