//! The launcher contract: which launcher started this `imgrun` process (torchrun,
//! Slurm's `srun`), what it says about the process and its job, and what the process
//! then offers as a node: pure functions of the environment, table-tested. `carry`
//! carries a launch out ([`lead`], [`follow`], [`finish`]): process 0 starts a head and
//! leaves a [`Rendezvous`] record where every process sees it, the others join it.
//!
//! The launcher numbers its processes (its `RANK` of `WORLD_SIZE`, Slurm's `SLURM_PROCID`
//! of `SLURM_NTASKS`); here that is a [`Launch`]'s `process` of its `processes`, not a
//! trainer's rank: each process joins as a node, which may hold several ranks.

mod carry;
mod kubernetes;
pub mod manifest;
pub mod names;
mod secret;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use carry::{Followed, LaunchFailure, LaunchSettings, Led, finish, follow, lead};
pub use secret::{CaPem, JoinSecret, join_secret};

use crate::resources::{DiscoverOptions, NodeResources, discover};
use crate::{NodeStatus, VisibleDevices};

/// `launch.launcher`: which launcher's environment `imgrun train` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// The first that applies, in [`LauncherKind::ALL`]'s order.
    Auto,
    None,
    Only(LauncherKind),
}

impl std::str::FromStr for Launcher {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "none" => Ok(Self::None),
            other => LauncherKind::ALL
                .into_iter()
                .find(|kind| kind.name() == other)
                .map(Self::Only)
                .ok_or_else(|| {
                    let names: Vec<&str> = LauncherKind::ALL.iter().map(|k| k.name()).collect();
                    format!("`{other}`: expected auto, none, {}", names.join(", "))
                }),
        }
    }
}

/// Which launcher started this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LauncherKind {
    Torchrun,
    /// Kubeflow Training Operator v1's PyTorchJob, one process per pod.
    PyTorchJob,
    /// Kubeflow Trainer v2's TrainJob, one process per pod.
    TrainJob,
    JobSet,
    /// A plain Kubernetes Indexed Job (with a headless Service).
    IndexedJob,
    Slurm,
}

impl LauncherKind {
    /// Every kind, in the order `auto` tries them: torchrun's workers first (under a
    /// PyTorchJob or a TrainJob whose pods run torchrun too), then the Kubernetes kinds,
    /// most specific first, then Slurm.
    pub const ALL: [Self; 6] = [
        Self::Torchrun,
        Self::PyTorchJob,
        Self::TrainJob,
        Self::JobSet,
        Self::IndexedJob,
        Self::Slurm,
    ];

    /// The name in `launch.launcher` and in messages.
    pub fn name(self) -> &'static str {
        match self {
            Self::Torchrun => "torchrun",
            Self::PyTorchJob => "pytorchjob",
            Self::TrainJob => "trainjob",
            Self::JobSet => "jobset",
            Self::IndexedJob => "indexed-job",
            Self::Slurm => "slurm",
        }
    }

    /// Whether `env` looks like this launcher's (for `auto`).
    fn applies(self, env: &dyn Fn(&str) -> Option<String>) -> bool {
        let set = |name| env(name).is_some();
        match self {
            // Outside Kubernetes, RANK and WORLD_SIZE alone are torchrun's (or a script's
            // that sets them as torchrun would); inside, only with a worker's variables.
            Self::Torchrun => {
                set("RANK")
                    && set("WORLD_SIZE")
                    && (!set(names::IN_KUBERNETES_VAR)
                        || set("LOCAL_RANK")
                        || set("TORCHELASTIC_RUN_ID"))
            }
            Self::Slurm => set("SLURM_STEP_ID") && set("SLURM_PROCID"),
            kubernetes => kubernetes::applies(kubernetes, env),
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
    /// The join secret from the environment: the others join the head with it rather
    /// than through a rendezvous file.
    pub secret: Option<JoinSecret>,
}

impl Launch {
    /// `torchrun process 3 of 8 (local 1 of 2), head at gpu01:29500`.
    pub fn describe(&self) -> String {
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

/// Why the launcher's environment cannot be used: the variable and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LaunchError {
    #[error("{launcher}: {name} is not set (launch.launcher = \"none\" runs without it)")]
    Missing {
        launcher: &'static str,
        name: &'static str,
    },
    #[error("{launcher}: {name}={value:?}: {reason}")]
    Invalid {
        launcher: &'static str,
        name: &'static str,
        value: String,
        reason: String,
    },
    /// The variables each parse but do not fit together.
    #[error("{launcher}: {message}")]
    Inconsistent {
        launcher: &'static str,
        message: String,
    },
}

/// The launcher this process runs under, if any, from `env` (the process's environment):
/// `launcher` says which to read; `port` is the head's UDP port where the launcher names
/// none (Slurm; an Indexed Job's or JobSet's head given without one; 0: 29400 + the job
/// id modulo 500 under Slurm, [`names::DEFAULT_PORT`] elsewhere). `None` when none
/// applies or the launcher started a single process (which runs as an ordinary embedded
/// job). A join secret in the environment ([`join_secret`]) comes with the launch.
pub fn detect(
    launcher: Launcher,
    port: u16,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<Launch>, LaunchError> {
    let kind = match launcher {
        Launcher::None => return Ok(None),
        Launcher::Only(kind) => kind,
        Launcher::Auto => match LauncherKind::ALL.into_iter().find(|k| k.applies(env)) {
            Some(kind) => kind,
            None => return Ok(None),
        },
    };
    let mut launch = match kind {
        LauncherKind::Torchrun => torchrun_launch(env)?,
        LauncherKind::Slurm => slurm_launch(env, port)?,
        kubernetes => kubernetes::launch(kubernetes, port, env)?,
    };
    check(&launch)?;
    if launch.processes == 1 && launcher == Launcher::Auto {
        return Ok(None);
    }
    launch.secret = join_secret(kind.name(), launch.process == 0, env)?;
    Ok(Some(launch))
}

/// The variable `name`, parsed, or an error naming it.
pub(super) fn var<T: std::str::FromStr>(
    env: &dyn Fn(&str) -> Option<String>,
    launcher: &'static str,
    name: &'static str,
) -> Result<T, LaunchError>
where
    T::Err: std::fmt::Display,
{
    let value = env(name).ok_or(LaunchError::Missing { launcher, name })?;
    value
        .trim()
        .parse()
        .map_err(|e: T::Err| LaunchError::Invalid {
            launcher,
            name,
            value: value.clone(),
            reason: e.to_string(),
        })
}

fn torchrun_launch(env: &dyn Fn(&str) -> Option<String>) -> Result<Launch, LaunchError> {
    let get = |name| var::<u32>(env, "torchrun", name);
    let (process, processes) = (get("RANK")?, get("WORLD_SIZE")?);
    let local_process = env("LOCAL_RANK").map_or(Ok(0), |_| get("LOCAL_RANK"))?;
    let local_processes = env("LOCAL_WORLD_SIZE").map_or(Ok(1), |_| get("LOCAL_WORLD_SIZE"))?;
    Ok(Launch {
        kind: LauncherKind::Torchrun,
        process,
        processes,
        local_process,
        local_processes,
        master: var(env, "torchrun", "MASTER_ADDR")?,
        port: var(env, "torchrun", "MASTER_PORT")?,
        launch_id: env("TORCHELASTIC_RUN_ID").unwrap_or_else(|| "none".into()),
        secret: None,
    })
}

fn slurm_launch(env: &dyn Fn(&str) -> Option<String>, port: u16) -> Result<Launch, LaunchError> {
    const SLURM: &str = "slurm";
    let get = |name| var::<u32>(env, SLURM, name);
    let (process, processes) = (get("SLURM_PROCID")?, get("SLURM_NTASKS")?);
    let node = get("SLURM_NODEID")?;
    let first_set = |names: [&'static str; 2]| {
        names
            .into_iter()
            .find(|name| env(name).is_some())
            .ok_or(LaunchError::Missing {
                launcher: SLURM,
                name: names[1],
            })
    };
    let invalid = |name: &'static str, reason: String| LaunchError::Invalid {
        launcher: SLURM,
        name,
        value: env(name).unwrap_or_default(),
        reason,
    };
    let nodes_var = first_set(["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"])?;
    let hosts =
        expand_nodelist(&env(nodes_var).unwrap_or_default()).map_err(|e| invalid(nodes_var, e))?;
    let tasks_var = first_set(["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"])?;
    let tasks =
        tasks_per_node(&env(tasks_var).unwrap_or_default()).map_err(|e| invalid(tasks_var, e))?;
    let total: u32 = tasks.iter().sum();
    if total != processes || tasks.len() != hosts.len() {
        return Err(LaunchError::Inconsistent {
            launcher: SLURM,
            message: format!(
                "{tasks_var} gives {total} tasks on {} node(s), SLURM_NTASKS is {processes} and \
                 {nodes_var} names {} node(s): the step's variables disagree",
                tasks.len(),
                hosts.len()
            ),
        });
    }
    let job_id: u64 = var(env, SLURM, "SLURM_JOB_ID")?;
    let step = env("SLURM_STEP_ID").unwrap_or_default();
    let local_processes =
        tasks
            .get(node as usize)
            .copied()
            .ok_or_else(|| LaunchError::Inconsistent {
                launcher: SLURM,
                message: format!("SLURM_NODEID {node} of {} nodes", tasks.len()),
            })?;
    Ok(Launch {
        kind: LauncherKind::Slurm,
        process,
        processes,
        local_process: get("SLURM_LOCALID")?,
        local_processes,
        master: hosts[0].clone(),
        // One port per job, so jobs sharing a first node do not meet.
        port: if port > 0 {
            port
        } else {
            29400 + (job_id % 500) as u16
        },
        launch_id: format!("{job_id}.{step}"),
        secret: None,
    })
}

fn check(launch: &Launch) -> Result<(), LaunchError> {
    let launcher = launch.kind.name();
    if launch.process >= launch.processes {
        return Err(LaunchError::Inconsistent {
            launcher,
            message: format!(
                "process {} of only {} launched processes",
                launch.process, launch.processes
            ),
        });
    }
    if launch.local_processes == 0 || launch.local_process >= launch.local_processes {
        return Err(LaunchError::Inconsistent {
            launcher,
            message: format!(
                "local process {} of only {} processes on this machine",
                launch.local_process, launch.local_processes
            ),
        });
    }
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
pub struct Rendezvous {
    pub address: String,
    pub token: String,
    pub ca_hash: String,
    /// How many processes were launched (the file's key is `world`).
    #[serde(rename = "world")]
    pub processes: u32,
}

/// The rendezvous file of `launch` in `dir` (by its launcher, id, head and port), so that
/// launches that share the folder do not meet.
pub fn rendezvous_path(dir: &Path, launch: &Launch) -> PathBuf {
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

/// Why a process cannot offer its share of the machine.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{launch}: this process sees {seen} GPUs and {processes} processes run on this machine: \
     give each process one GPU (`srun --gpus-per-task=1`), or let each see all {processes} \
     so that local rank picks one, or start one process per machine"
)]
pub struct GpuShareError {
    pub launch: String,
    pub seen: u32,
    pub processes: u32,
}

/// What this process offers as a node: its GPU by its local process index when every
/// process of the machine sees all of them, the GPUs the launcher gave it otherwise, and
/// its share of the CPUs. A count of GPUs that fits neither is refused, naming both.
/// `num_gpus` (`launch.num_gpus`) overrides the GPUs found: exactly that many, claimed
/// where missing (as `imgrun join --num-gpus`).
pub fn resources(launch: &Launch, num_gpus: Option<usize>) -> Result<NodeResources, GpuShareError> {
    let all = discover(&DiscoverOptions::default());
    if num_gpus.is_some() {
        let cpus = (all.cpus / launch.local_processes.max(1) as usize).max(1);
        return Ok(discover(&DiscoverOptions {
            num_cpus: Some(cpus),
            num_gpus,
            ..DiscoverOptions::default()
        }));
    }
    let seen = all.gpus.len() as u32;
    let visible = if launch.local_processes > 1 && seen == launch.local_processes {
        let gpu = &all.gpus[launch.local_process as usize];
        VisibleDevices::Set(gpu.uuid.clone())
    } else if launch.local_processes > 1 && seen > 1 {
        return Err(GpuShareError {
            launch: launch.describe(),
            seen,
            processes: launch.local_processes,
        });
    } else {
        VisibleDevices::Inherit
    };
    let cpus = (all.cpus / launch.local_processes.max(1) as usize).max(1);
    Ok(discover(&DiscoverOptions {
        num_cpus: Some(cpus),
        visible_devices: visible,
        ..DiscoverOptions::default()
    }))
}

/// The nodes that offer no GPU when others do (`node ID on HOST` each): a process that
/// sees none among others that do would make a CPU trainer among GPU ones. Empty when
/// all offer GPUs or none does.
pub fn nodes_without_gpus(nodes: &[&NodeStatus]) -> Vec<String> {
    let without: Vec<String> = nodes
        .iter()
        .filter(|n| n.gpus.is_empty())
        .map(|n| format!("node {} on {}", n.id, n.hostname))
        .collect();
    if without.len() < nodes.len() {
        without
    } else {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

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
    fn rendezvous_files_differ_by_launcher_id_head_and_port() {
        let launch = Launch {
            kind: LauncherKind::Slurm,
            process: 0,
            processes: 2,
            local_process: 0,
            local_processes: 1,
            master: "gpu01.cluster".into(),
            port: 29721,
            launch_id: "4321.0".into(),
            secret: None,
        };
        let dir = Path::new("/runs/.rendezvous");
        assert_eq!(
            rendezvous_path(dir, &launch),
            dir.join("slurm-4321.0-gpu01.cluster-29721.json")
        );
        let odd = Launch {
            kind: LauncherKind::Torchrun,
            launch_id: "a/b c".into(),
            master: "[::1]".into(),
            ..launch.clone()
        };
        assert_eq!(
            rendezvous_path(dir, &odd),
            dir.join("torchrun-a_b_c-___1_-29721.json"),
            "no separator or space of an id reaches the file name"
        );
        let other_step = Launch {
            launch_id: "4321.1".into(),
            ..launch.clone()
        };
        assert_ne!(
            rendezvous_path(dir, &other_step),
            rendezvous_path(dir, &launch)
        );
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

    /// An environment of `vars` only (the tests of the adapters share it).
    pub(super) fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: BTreeMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| map.get(name).cloned()
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
        let launch = detect(Launcher::Auto, 0, &torchrun)
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
                secret: None,
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
        let launch = detect(Launcher::Auto, 0, &slurm)
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
        assert_eq!(detect(Launcher::Auto, 0, &shell).expect("valid"), None);
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
        assert_eq!(detect(Launcher::Auto, 0, &one).expect("valid"), None);
        assert_eq!(detect(Launcher::None, 0, &torchrun).expect("valid"), None);
    }

    #[test]
    fn launcher_mistakes_name_the_variable() {
        type Vars<'a> = &'a [(&'a str, &'a str)];
        let cases: [(Vars, Launcher, &str); 4] = [
            (
                &[("RANK", "0")],
                Launcher::Only(LauncherKind::Torchrun),
                "WORLD_SIZE",
            ),
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
            let error = detect(launcher, 0, &env_of(vars)).expect_err(want);
            assert!(error.to_string().contains(want), "{error} lacks {want}");
        }
    }
}
