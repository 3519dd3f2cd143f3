//! The Kubernetes adapters of the launcher contract: what a pod's environment says under
//! each kind of job, as pure functions. Every kind runs one `imgrun` process per pod with
//! all the pod's GPUs (pods that run torchrun, one process per GPU, are torchrun's
//! launches). The process index and count:
//! - PyTorchJob (Training Operator v1): `RANK` is the pod's index (Master 0, then the
//!   Workers); `WORLD_SIZE` is the number of pods, or pods × `nprocPerNode` in the
//!   operator's later versions, so `PET_NNODES` is taken first when set: it is never a
//!   count of processes;
//! - TrainJob (Trainer v2): `PET_NODE_RANK` of `PET_NNODES`, head `PET_MASTER_ADDR` on
//!   `PET_MASTER_PORT`, or on `launch.port` when set (the runtime's port is fixed, so a
//!   manifest that chose another sets that);
//! - JobSet: `JOB_INDEX` × [`PODS_PER_JOB_VAR`] + `JOB_COMPLETION_INDEX`, of
//!   [`PROCESSES_VAR`], head [`HEAD_VAR`] (both set by imgrun's manifest);
//! - Indexed Job: `JOB_COMPLETION_INDEX` of [`PROCESSES_VAR`], head [`HEAD_VAR`].

use super::names::{
    COMPLETION_INDEX_VAR, DEFAULT_PORT, HEAD_VAR, IN_KUBERNETES_VAR, JOB_INDEX_VAR,
    JOBSET_NAME_VAR, PODS_PER_JOB_VAR, PROCESSES_VAR,
};
use super::{Launch, LaunchError, LauncherKind, var};

/// Whether `env` looks like a pod of `kind` (for `launch.launcher = "auto"`).
pub(super) fn applies(kind: LauncherKind, env: &dyn Fn(&str) -> Option<String>) -> bool {
    let set = |name| env(name).is_some();
    match kind {
        LauncherKind::PyTorchJob => {
            set(IN_KUBERNETES_VAR) && set("RANK") && set("WORLD_SIZE") && set("MASTER_ADDR")
        }
        LauncherKind::TrainJob => set("PET_NNODES") && set("PET_NODE_RANK"),
        LauncherKind::JobSet => set(JOBSET_NAME_VAR) && set(COMPLETION_INDEX_VAR),
        LauncherKind::IndexedJob => set(COMPLETION_INDEX_VAR),
        LauncherKind::Torchrun | LauncherKind::Slurm => false,
    }
}

/// The launch a pod of `kind` is part of; `port` is `launch.port`: the head's port where
/// the pod's head address names none (0: [`DEFAULT_PORT`]), and a TrainJob's in place of
/// `PET_MASTER_PORT` (0: that).
pub(super) fn launch(
    kind: LauncherKind,
    port: u16,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Launch, LaunchError> {
    let name = kind.name();
    let get = |var_name| var::<u32>(env, name, var_name);
    let (process, processes, master, port, launch_id) = match kind {
        LauncherKind::PyTorchJob => {
            let pods = if env("PET_NNODES").is_some() {
                get("PET_NNODES")?
            } else {
                get("WORLD_SIZE")?
            };
            let master: String = var(env, name, "MASTER_ADDR")?;
            let port = var(env, name, "MASTER_PORT")?;
            (get("RANK")?, pods, master.clone(), port, master)
        }
        LauncherKind::TrainJob => {
            let master: String = var(env, name, "PET_MASTER_ADDR")?;
            // The runtime's port, unless the manifest chose another (`launch.port`).
            let port = if port > 0 {
                port
            } else {
                var(env, name, "PET_MASTER_PORT")?
            };
            let id = env(JOBSET_NAME_VAR).unwrap_or_else(|| master.clone());
            let rank = get("PET_NODE_RANK")?;
            (rank, get("PET_NNODES")?, master, port, id)
        }
        LauncherKind::JobSet | LauncherKind::IndexedJob => {
            let (master, given) = head(env, name)?;
            let port = given.unwrap_or(if port > 0 { port } else { DEFAULT_PORT });
            let id = env(JOBSET_NAME_VAR).unwrap_or_else(|| master.clone());
            let process = index(kind, env)?;
            (process, get(PROCESSES_VAR)?, master, port, id)
        }
        LauncherKind::Torchrun | LauncherKind::Slurm => {
            unreachable!("{name} is not a Kubernetes launcher")
        }
    };
    Ok(Launch {
        kind,
        process,
        processes,
        local_process: 0,
        local_processes: 1,
        master,
        port,
        launch_id,
        secret: None,
    })
}

/// An Indexed Job's pod's process index; a JobSet's across its replicated jobs.
fn index(kind: LauncherKind, env: &dyn Fn(&str) -> Option<String>) -> Result<u32, LaunchError> {
    let name = kind.name();
    let completion: u32 = var(env, name, COMPLETION_INDEX_VAR)?;
    if kind != LauncherKind::JobSet {
        return Ok(completion);
    }
    let job: u32 = env(JOB_INDEX_VAR).map_or(Ok(0), |_| var(env, name, JOB_INDEX_VAR))?;
    match env(PODS_PER_JOB_VAR) {
        Some(_) => Ok(job * var::<u32>(env, name, PODS_PER_JOB_VAR)? + completion),
        None if job == 0 => Ok(completion),
        None => Err(LaunchError::Inconsistent {
            launcher: name,
            message: format!(
                "{JOB_INDEX_VAR} is {job} but {PODS_PER_JOB_VAR} is not set: with several \
                 replicated jobs, say how many pods each has"
            ),
        }),
    }
}

/// [`HEAD_VAR`]: the head's host and the port, if it names one.
fn head(
    env: &dyn Fn(&str) -> Option<String>,
    launcher: &'static str,
) -> Result<(String, Option<u16>), LaunchError> {
    let text: String = var(env, launcher, HEAD_VAR)?;
    split_host_port(&text).map_err(|reason| LaunchError::Invalid {
        launcher,
        name: HEAD_VAR,
        value: text.clone(),
        reason,
    })
}

/// `host`, `host:port`, `[v6]` or `[v6]:port`.
fn split_host_port(text: &str) -> Result<(String, Option<u16>), String> {
    let text = text.trim();
    let (host, port) = match text.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') || host.ends_with(']') => (host, Some(port)),
        _ => (text, None),
    };
    if host.is_empty() {
        return Err("expected a host name, host:port or [address]:port".into());
    }
    let port = port
        .map(|p| {
            p.parse::<u16>()
                .ok()
                .filter(|p| *p > 0)
                .ok_or(format!("`{p}` is not a port"))
        })
        .transpose()?;
    Ok((host.to_owned(), port))
}

#[cfg(test)]
mod tests {
    use super::super::tests::env_of;
    use super::super::{Launcher, detect};
    use super::*;

    /// A pod's variables.
    type Vars<'a> = &'a [(&'a str, &'a str)];

    /// What a pod's process is: (kind, process, processes, head, port, launch id).
    type Seen = (LauncherKind, u32, u32, &'static str, u16, &'static str);

    #[test]
    fn each_kind_of_pod_is_read_as_its_operator_sets_it() {
        const K8S: (&str, &str) = (IN_KUBERNETES_VAR, "10.96.0.1");
        let cases: [(Vars, Seen); 7] = [
            // PyTorchJob v1: WORLD_SIZE counts pods, RANK is the pod's.
            (
                &[
                    K8S,
                    ("RANK", "1"),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "r50-master-0"),
                    ("MASTER_PORT", "23456"),
                ],
                (
                    LauncherKind::PyTorchJob,
                    1,
                    2,
                    "r50-master-0",
                    23456,
                    "r50-master-0",
                ),
            ),
            // PyTorchJob with nprocPerNode: WORLD_SIZE is pods × 4, PET_NNODES the pods.
            (
                &[
                    K8S,
                    ("RANK", "2"),
                    ("WORLD_SIZE", "12"),
                    ("PET_NNODES", "3"),
                    ("PET_NPROC_PER_NODE", "4"),
                    ("MASTER_ADDR", "r50-master-0"),
                    ("MASTER_PORT", "23456"),
                ],
                (
                    LauncherKind::PyTorchJob,
                    2,
                    3,
                    "r50-master-0",
                    23456,
                    "r50-master-0",
                ),
            ),
            // TrainJob v2 (a JobSet underneath, so JOB_COMPLETION_INDEX and JOBSET_NAME).
            (
                &[
                    K8S,
                    ("PET_NNODES", "4"),
                    ("PET_NPROC_PER_NODE", "8"),
                    ("PET_NODE_RANK", "3"),
                    ("PET_MASTER_ADDR", "tj-node-0-0.tj"),
                    ("PET_MASTER_PORT", "29400"),
                    (JOBSET_NAME_VAR, "tj"),
                    (COMPLETION_INDEX_VAR, "3"),
                ],
                (LauncherKind::TrainJob, 3, 4, "tj-node-0-0.tj", 29400, "tj"),
            ),
            (
                &[
                    K8S,
                    (JOBSET_NAME_VAR, "js"),
                    (JOB_INDEX_VAR, "0"),
                    (COMPLETION_INDEX_VAR, "1"),
                    (PROCESSES_VAR, "2"),
                    (HEAD_VAR, "js-node-0-0.js"),
                ],
                (LauncherKind::JobSet, 1, 2, "js-node-0-0.js", 29400, "js"),
            ),
            // A JobSet of two replicated jobs of 2 pods each.
            (
                &[
                    K8S,
                    (JOBSET_NAME_VAR, "js"),
                    (JOB_INDEX_VAR, "1"),
                    (COMPLETION_INDEX_VAR, "1"),
                    (PODS_PER_JOB_VAR, "2"),
                    (PROCESSES_VAR, "4"),
                    (HEAD_VAR, "js-node-0-0.js:31000"),
                ],
                (LauncherKind::JobSet, 3, 4, "js-node-0-0.js", 31000, "js"),
            ),
            (
                &[
                    K8S,
                    (COMPLETION_INDEX_VAR, "0"),
                    (PROCESSES_VAR, "3"),
                    (HEAD_VAR, "train-0.train:29500"),
                ],
                (
                    LauncherKind::IndexedJob,
                    0,
                    3,
                    "train-0.train",
                    29500,
                    "train-0.train",
                ),
            ),
            // torchrun inside a pod, one process per GPU: torchrun's launch.
            (
                &[
                    K8S,
                    ("RANK", "5"),
                    ("WORLD_SIZE", "8"),
                    ("LOCAL_RANK", "1"),
                    ("LOCAL_WORLD_SIZE", "4"),
                    ("TORCHELASTIC_RUN_ID", "tj"),
                    ("PET_NNODES", "2"),
                    ("PET_NODE_RANK", "1"),
                    ("MASTER_ADDR", "tj-node-0-0.tj"),
                    ("MASTER_PORT", "29400"),
                ],
                (LauncherKind::Torchrun, 5, 8, "tj-node-0-0.tj", 29400, "tj"),
            ),
        ];
        for (vars, want) in cases {
            let launch = detect(Launcher::Auto, 0, &env_of(vars))
                .unwrap_or_else(|e| panic!("{want:?}: {e}"))
                .unwrap_or_else(|| panic!("{want:?}: no launch"));
            let seen = (
                launch.kind,
                launch.process,
                launch.processes,
                launch.master.as_str(),
                launch.port,
                launch.launch_id.as_str(),
            );
            assert_eq!(seen, want);
            if launch.kind != LauncherKind::Torchrun {
                assert_eq!((launch.local_process, launch.local_processes), (0, 1));
            }
        }
    }

    #[test]
    fn pod_mistakes_name_the_variable() {
        let cases: [(Vars, Launcher, &str); 5] = [
            (
                &[(COMPLETION_INDEX_VAR, "0"), (HEAD_VAR, "t-0.t")],
                Launcher::Auto,
                "indexed-job: IMGRUN_PROCESSES is not set",
            ),
            (
                &[
                    (COMPLETION_INDEX_VAR, "2"),
                    (PROCESSES_VAR, "2"),
                    (HEAD_VAR, "t-0.t"),
                ],
                Launcher::Auto,
                "process 2 of only 2",
            ),
            (
                &[
                    (COMPLETION_INDEX_VAR, "0"),
                    (PROCESSES_VAR, "2"),
                    (HEAD_VAR, "t-0.t:x"),
                ],
                Launcher::Auto,
                "IMGRUN_HEAD=\"t-0.t:x\": `x` is not a port",
            ),
            (
                &[
                    (JOBSET_NAME_VAR, "js"),
                    (JOB_INDEX_VAR, "1"),
                    (COMPLETION_INDEX_VAR, "0"),
                    (PROCESSES_VAR, "2"),
                    (HEAD_VAR, "js-node-0-0.js"),
                ],
                Launcher::Auto,
                "IMGRUN_PODS_PER_JOB is not set",
            ),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "m")],
                Launcher::Only(LauncherKind::PyTorchJob),
                "pytorchjob: MASTER_PORT is not set",
            ),
        ];
        for (vars, launcher, want) in cases {
            let error = detect(launcher, 0, &env_of(vars)).expect_err(want);
            assert!(error.to_string().contains(want), "{error} lacks {want}");
        }
    }

    #[test]
    fn head_addresses_split_into_host_and_port() {
        // The host and port, or `None` for an address refused.
        type HostPort<'a> = Option<(&'a str, Option<u16>)>;
        let cases: [(&str, HostPort); 7] = [
            ("train-0.train", Some(("train-0.train", None))),
            ("train-0.train:29400", Some(("train-0.train", Some(29400)))),
            ("10.0.0.7:1", Some(("10.0.0.7", Some(1)))),
            ("[fd00::7]:29400", Some(("[fd00::7]", Some(29400)))),
            ("fd00::7", Some(("fd00::7", None))),
            (":29400", None),
            ("h:0", None),
        ];
        for (text, want) in cases {
            let got = split_host_port(text);
            match want {
                Some((host, port)) => assert_eq!(got, Ok((host.to_owned(), port)), "{text}"),
                None => assert!(got.is_err(), "{text}: {got:?}"),
            }
        }
    }
}
