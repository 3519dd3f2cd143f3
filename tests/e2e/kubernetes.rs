//! End-to-end tests of `imgrun train` in pods as Kubernetes starts them, without
//! Kubernetes. `imgrun k8s manifest --format json` writes a job's objects; each process
//! gets exactly its pod's environment from them (the container's variables, each
//! `secretKeyRef` read from the Secret, plus what Kubernetes and the kind's operator set:
//! `JOB_COMPLETION_INDEX`, JobSet's names, Trainer's `PET_*`, PyTorchJob's `MASTER_*`,
//! `RANK` and `WORLD_SIZE`) and runs the container's command and arguments. It runs in a
//! mount namespace of its own whose `/etc/hosts` is the test's file, which maps the
//! head's pod name to loopback as a cluster's DNS would (needs root, for `unshare`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::common;
use rustix::process::Signal;

use crate::common::train::{
    Dataset, Finished, JOB_LIMIT, Job, assert_checkpoint_at_last_step, assert_each_sample_once,
    assert_resumed_as_whole, logged_samples, metrics, read_json, replica_digest, total_steps,
    wait_for_steps,
};

/// The job's name in every manifest.
const NAME: &str = "cnn";

/// A job's objects as `imgrun k8s manifest --format json` writes them: the items of its
/// List. Every pod runs `train_args` after `imgrun train`.
fn manifest(kind: &str, pods: u32, port: u16, train_args: &[String]) -> Vec<Value> {
    let out = common::imgrun()
        .args(["k8s", "manifest", "--format", "json", "--name", NAME])
        .args(["--kind", kind, "--image", "imgrun:test"])
        .args(["--pods", &pods.to_string(), "--port", &port.to_string()])
        .arg("--")
        .args(train_args)
        .output()
        .expect("run imgrun k8s manifest");
    let text = common::stdout_of_success(&["k8s", "manifest", kind], &out);
    let list: Value = serde_json::from_str(&text).expect("the manifest is JSON");
    list["items"].as_array().expect("a List's items").clone()
}

/// The item of `kind`.
fn item<'a>(items: &'a [Value], kind: &str) -> &'a Value {
    items
        .iter()
        .find(|item| item["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind} in the manifest"))
}

/// A pod of the job: what its container runs, with the environment it is given.
struct Pod {
    command: Vec<String>,
    env: Vec<(String, String)>,
}

/// The pod of `index` among `pods`, under `kind`: its container and the variables
/// Kubernetes and the kind's operator add. Also returns the head's host name, which the
/// cluster's DNS would resolve.
fn pod(items: &[Value], kind: &str, index: u32, pods: u32, port: u16) -> (Pod, String) {
    let (container, extra, head): (&Value, Vec<(&str, String)>, String) = match kind {
        "indexed-job" => (
            &item(items, "Job")["spec"]["template"]["spec"]["containers"][0],
            vec![("JOB_COMPLETION_INDEX", index.to_string())],
            format!("{NAME}-0.{NAME}"),
        ),
        "jobset" => (
            &item(items, "JobSet")["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
                ["containers"][0],
            vec![
                ("JOBSET_NAME", NAME.to_string()),
                ("REPLICATED_JOB_NAME", "node".to_string()),
                ("JOB_INDEX", "0".to_string()),
                ("JOB_COMPLETION_INDEX", index.to_string()),
            ],
            format!("{NAME}-node-0-0.{NAME}"),
        ),
        // Trainer's torch-distributed runtime: a JobSet whose pods get PET_*.
        "trainjob" => (
            &item(items, "TrainJob")["spec"]["trainer"],
            vec![
                ("PET_NNODES", pods.to_string()),
                ("PET_NPROC_PER_NODE", "1".to_string()),
                ("PET_NODE_RANK", index.to_string()),
                ("PET_MASTER_ADDR", format!("{NAME}-node-0-0.{NAME}")),
                ("PET_MASTER_PORT", port.to_string()),
                ("JOBSET_NAME", NAME.to_string()),
                ("JOB_COMPLETION_INDEX", index.to_string()),
            ],
            format!("{NAME}-node-0-0.{NAME}"),
        ),
        "pytorchjob" => {
            let replica = if index == 0 { "Master" } else { "Worker" };
            let container = &item(items, "PyTorchJob")["spec"]["pytorchReplicaSpecs"][replica]["template"]
                ["spec"]["containers"][0];
            let master_port = container["ports"]
                .as_array()
                .and_then(|ports| ports.iter().find(|p| p["name"] == "pytorchjob-port"))
                .map(|p| p["containerPort"].to_string())
                .expect("the operator's port");
            let extra = vec![
                ("MASTER_ADDR", format!("{NAME}-master-0")),
                ("MASTER_PORT", master_port),
                ("RANK", index.to_string()),
                // The pods, not the processes.
                ("WORLD_SIZE", pods.to_string()),
                ("PYTHONUNBUFFERED", "0".to_string()),
            ];
            (container, extra, format!("{NAME}-master-0"))
        }
        other => panic!("unknown kind {other}"),
    };
    let secret = &item(items, "Secret")["stringData"];
    let mut env: Vec<(String, String)> = container["env"]
        .as_array()
        .expect("the container's env")
        .iter()
        .map(|var| {
            let name = var["name"].as_str().expect("a name").to_string();
            let value = match var["valueFrom"]["secretKeyRef"]["key"].as_str() {
                Some(key) => secret[key].as_str().expect("the Secret holds the key"),
                None => var["value"].as_str().expect("a value or a reference"),
            };
            (name, value.to_string())
        })
        .collect();
    env.push(("KUBERNETES_SERVICE_HOST".into(), "10.96.0.1".into()));
    env.extend(extra.into_iter().map(|(k, v)| (k.to_string(), v)));
    let strings = |value: &Value| -> Vec<String> {
        value
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|s| s.as_str().expect("text").to_string())
                    .collect()
            })
            .unwrap_or_default()
    };
    let command = [strings(&container["command"]), strings(&container["args"])].concat();
    (Pod { command, env }, head)
}

/// The pod's process, in a mount namespace whose `/etc/hosts` is `hosts`.
fn start(pod: &Pod, hosts: &Path, root: &Path, index: u32) -> Job {
    assert_eq!(pod.command[0], "imgrun", "the container runs imgrun");
    let mut command = Command::new("unshare");
    command
        .args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(r#"mount --bind "$0" /etc/hosts && exec "$@""#)
        .arg(hosts)
        .arg(env!("CARGO_BIN_EXE_imgrun"))
        .args(&pod.command[1..])
        .env_remove("IMGRUN_LOG")
        .env("IMGRUN_STATE_DIR", root.join(format!("state-{index}")))
        .env("IMGRUN_CLUSTER__HEARTBEAT_MS", "200")
        .env("IMGRUN_CLUSTER__DEAD_AFTER_MS", "3000")
        .env("IMGRUN_LAUNCH__TIMEOUT_SECS", "60")
        .envs(pod.env.iter().map(|(k, v)| (k, v)));
    Job::spawn(command, root)
}

/// A hosts file in `root` that maps `names` to loopback (none: only `localhost`).
fn hosts_file(root: &Path, names: &[&str]) -> PathBuf {
    let path = root.join("hosts");
    write_hosts(&path, names);
    path
}

/// Rewrites the hosts file in place: a bind mount keeps the file it was made on.
fn write_hosts(path: &Path, names: &[&str]) {
    let mut text = "127.0.0.1 localhost\n".to_string();
    for name in names {
        text.push_str(&format!("127.0.0.1 {name}\n"));
    }
    std::fs::write(path, text).expect("write the hosts file");
}

/// `imgrun train`'s arguments for a 2-process job `name` of `epochs` on `data`, quick: no
/// evaluation, no plot.
fn train_args(root: &Path, data: &Dataset, name: &str, epochs: u64, more: &[&str]) -> Vec<String> {
    let mut args = data.args(&root.join("runs"), name, epochs)[1..].to_vec();
    args.extend(["--no-plot", "--set", "train.eval_every_epochs=0"].map(String::from));
    args.extend(more.iter().map(|s| s.to_string()));
    args
}

/// A job of 2 pods under `kind`, each running `imgrun train ARGS`: their processes, and
/// the head's name. `hosts` is the pods' hosts file; by default one that resolves the
/// head's name from the start.
fn start_pods(
    root: &Path,
    kind: &str,
    args: &[String],
    hosts: Option<&Path>,
) -> (Vec<Job>, String) {
    start_pods_with(root, kind, 2, args, hosts, &[])
}

/// [`start_pods`], of `count` pods, with `more` variables in every pod.
fn start_pods_with(
    root: &Path,
    kind: &str,
    count: u32,
    args: &[String],
    hosts: Option<&Path>,
    more: &[(&str, &str)],
) -> (Vec<Job>, String) {
    let port = common::free_udp_port();
    let items = manifest(kind, count, port, args);
    let mut pods: Vec<(Pod, String)> = (0..count)
        .map(|i| pod(&items, kind, i, count, port))
        .collect();
    for (pod, _) in &mut pods {
        pod.env
            .extend(more.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    }
    let head = pods[0].1.clone();
    let own_hosts;
    let hosts = match hosts {
        Some(path) => path,
        None => {
            own_hosts = hosts_file(root, &[&head]);
            &own_hosts
        }
    };
    let jobs = pods
        .iter()
        .enumerate()
        .map(|(i, (pod, _))| start(pod, hosts, root, i as u32))
        .collect();
    (jobs, head)
}

/// Runs the pods to their end.
fn finish_all(jobs: Vec<Job>, limit: Duration) -> Vec<Finished> {
    jobs.into_iter().map(|mut job| job.finish(limit)).collect()
}

/// The pods of `kind` ended well, process 0 joined by the join secret of the environment.
fn assert_trained_together(kind: &str, finished: &[Finished]) {
    let first = format!("launch: {kind} process 0 of 2");
    let says = [
        first.as_str(),
        "with the join secret of the environment",
        "launch: all 2 processes joined",
        "replicas: identical on all 2 ranks",
    ];
    common::train::assert_launched_together(kind, finished, &says);
}

/// Every kind trains the same job: the same replicas at the end.
#[test]
fn pods_of_every_kind_train_one_job_to_the_same_replicas() {
    let root = tempfile::tempdir().expect("temp dir");
    let data = Dataset::synth(root.path());
    let mut digests = Vec::new();
    for kind in ["indexed-job", "jobset", "trainjob", "pytorchjob"] {
        let dir = root.path().join(kind);
        std::fs::create_dir_all(&dir).expect("a folder per kind");
        let args = train_args(&dir, &data, kind, 2, &[]);
        let (jobs, _) = start_pods(&dir, kind, &args, None);
        let finished = finish_all(jobs, JOB_LIMIT);
        assert_trained_together(kind, &finished);
        digests.push((kind, replica_digest(&finished[0].stdout)));
    }
    let first = &digests[0].1;
    assert!(
        digests.iter().all(|(_, digest)| digest == first),
        "the kinds trained different replicas: {digests:?}"
    );
}

/// The head's pod name resolves only 10 s after the pods start (a headless Service
/// publishes a pod once it runs): the other pod waits for it, saying so, and the job runs.
#[test]
fn a_head_whose_name_resolves_only_after_ten_seconds_is_waited_for() {
    let root = tempfile::tempdir().expect("temp dir");
    let data = Dataset::synth(root.path());
    let hosts = hosts_file(root.path(), &[]);
    let args = train_args(root.path(), &data, "late", 2, &[]);
    let (jobs, head) = start_pods(root.path(), "indexed-job", &args, Some(&hosts));
    std::thread::sleep(Duration::from_secs(10));
    write_hosts(&hosts, &[&head]);
    let finished = finish_all(jobs, JOB_LIMIT);
    assert_trained_together("indexed-job", &finished);
    let waited = format!("launch: waiting for the head at {head}:");
    assert!(
        finished[1].stdout.contains(&waited),
        "pod 1 said nothing of the wait:\n{}",
        finished[1].describe()
    );
}

/// A pod whose head's name never resolves gives up after `launch.timeout_secs`, naming
/// the address, how often it tried, and why the last try failed.
#[test]
fn a_head_whose_name_never_resolves_is_named_with_what_was_tried() {
    let root = tempfile::tempdir().expect("temp dir");
    let data = Dataset::synth(root.path());
    let port = common::free_udp_port();
    let args = train_args(root.path(), &data, "alone", 1, &[]);
    let items = manifest("indexed-job", 2, port, &args);
    let (mut pod, head) = pod(&items, "indexed-job", 1, 2, port);
    // After `start`'s own: the pod's variables come last.
    pod.env
        .push(("IMGRUN_LAUNCH__TIMEOUT_SECS".into(), "4".into()));
    let hosts = hosts_file(root.path(), &[]);
    let mut alone = start(&pod, &hosts, root.path(), 1);
    let done = alone.finish(Duration::from_secs(30));
    assert!(!done.status.success(), "{}", done.describe());
    let want = format!("could not join the job's head at {head}:{port} within 4 s (");
    assert!(done.stderr.contains(&want), "{}", done.describe());
    assert!(done.stderr.contains(" tries;"), "{}", done.describe());
}

/// Every pod of a job gets SIGTERM mid-epoch, as when Kueue preempts it or its nodes are
/// drained: pod 1 serves on while process 0 checkpoints the step in flight, then is
/// stopped by the head (exit 0); process 0 exits 143 with the command that resumes. The
/// pods started again with `--resume` end with the uninterrupted job's replicas.
#[test]
fn sigterm_to_every_pod_mid_epoch_checkpoints_and_the_job_resumes_as_whole() {
    const EPOCHS: u64 = 3;
    let root = tempfile::tempdir().expect("temp dir");
    let data = Dataset::synth(root.path());
    let quick = ["--set", "train.checkpoint_every_epochs=0"];
    let whole_args = train_args(root.path(), &data, "whole", EPOCHS, &quick);
    let (jobs, _) = start_pods(root.path(), "indexed-job", &whole_args, None);
    let whole = finish_all(jobs, JOB_LIMIT);
    assert_trained_together("indexed-job", &whole);

    let run = root.path().join("runs/cut");
    let cut_args = train_args(root.path(), &data, "cut", EPOCHS, &quick);
    let (mut jobs, _) = start_pods(root.path(), "indexed-job", &cut_args, None);
    wait_for_steps(&mut jobs[0], &run, 3);
    for job in &jobs {
        job.signal(Signal::TERM);
    }
    let cut = finish_all(jobs, Duration::from_secs(60));
    assert_eq!(cut[0].status.code(), Some(143), "{}", cut[0].describe());
    assert!(
        cut[0].stderr.contains("interrupted by SIGTERM"),
        "{}",
        cut[0].describe()
    );
    for want in [
        "SIGTERM: this node serves on",
        "the job's head stopped this node",
    ] {
        assert!(
            cut[1].stdout.contains(want),
            "pod 1: no `{want}`:\n{}",
            cut[1].describe()
        );
    }
    assert!(cut[1].status.success(), "{}", cut[1].describe());
    let saved_step = assert_checkpoint_at_last_step(&run);
    let total = total_steps(&cut[0].stdout, EPOCHS);
    assert!(saved_step < total, "not cut: step {saved_step} of {total}");

    let resume = ["--resume".to_string(), run.display().to_string()];
    let resumed_args = [cut_args, resume.to_vec()].concat();
    let (jobs, _) = start_pods(root.path(), "indexed-job", &resumed_args, None);
    let resumed = finish_all(jobs, JOB_LIMIT);
    assert_trained_together("indexed-job", &resumed);
    assert_resumed_as_whole(&resumed[0], saved_step, &whole[0]);
}

/// What `imgrun k8s manifest` writes for every kind, with GPUs, requests, a namespace and
/// a Kueue queue, validates offline (`tests/python/k8s_validate.py`): Kubernetes' own
/// strict schemas for the Secret, the Service and the Job, the projects' CRD schemas for
/// the JobSet, the TrainJob and the PyTorchJob, with any field they do not name refused.
#[test]
fn the_manifests_of_every_kind_validate_offline() {
    let Some(python) = common::tools_python("tools/pytools.sh") else {
        return;
    };
    let root = tempfile::tempdir().expect("temp dir");
    let mut files = Vec::new();
    for kind in ["indexed-job", "jobset", "trainjob", "pytorchjob"] {
        let out = common::imgrun()
            .args(["k8s", "manifest", "--kind", kind, "--name", "r50"])
            .args(["--image", "registry.example.com/imgrun:0.1", "--pods", "3"])
            .args(["--gpus-per-pod", "8", "--cpu", "60", "--memory", "400Gi"])
            .args([
                "--namespace",
                "ml",
                "--queue",
                "team-a",
                "--grace-secs",
                "300",
            ])
            .args(["--", "--config", "/etc/imgrun/job.toml"])
            .output()
            .expect("run imgrun k8s manifest");
        let yaml = common::stdout_of_success(&["k8s", "manifest", kind], &out);
        let path = root.path().join(format!("{kind}.yaml"));
        std::fs::write(&path, yaml).expect("write the manifest");
        files.push(path);
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/k8s_validate.py");
    let out = Command::new(python)
        .arg(script)
        .args(&files)
        .output()
        .expect("run k8s_validate.py");
    assert!(out.status.success(), "{}", common::describe(&out));
}

/// A PyTorchJob's `WORLD_SIZE` counts pods, not processes: 2 pods with 2 GPUs each (claimed
/// ones, `launch.num_gpus = 2`, as `imgrun join --num-gpus 2`) make one job of 4 GPU
/// ranks, 2 per pod, not 2. (Claimed GPUs have no CUDA behind them: the job plans its 4
/// ranks, then its trainers cannot start here, which is all this checks beyond the plan.)
#[test]
fn a_pytorchjob_of_two_pods_with_two_gpus_each_plans_four_ranks() {
    let root = tempfile::tempdir().expect("temp dir");
    let data = Dataset::synth(root.path());
    let args = train_args(root.path(), &data, "gpus", 1, &[]);
    let gpus = [("IMGRUN_LAUNCH__NUM_GPUS", "2")];
    let (jobs, _) = start_pods_with(root.path(), "pytorchjob", 2, &args, None, &gpus);
    let finished = finish_all(jobs, JOB_LIMIT);
    let leader = &finished[0].stdout;
    for want in [
        "launch: pytorchjob process 0 of 2 (local 0 of 1)",
        "launch: all 2 processes joined (4 GPU(s))",
        "4 GPU trainer(s) on node 1, node 2: 2 node(s) x 2 rank(s)",
    ] {
        assert!(
            leader.contains(want),
            "no `{want}`:\n{}",
            finished[0].describe()
        );
    }
    assert!(
        finished[1]
            .stdout
            .contains("launch: pytorchjob process 1 of 2 (local 0 of 1)")
            && finished[1]
                .stdout
                .contains("the job's head stopped this node"),
        "{}",
        finished[1].describe()
    );
}

/// An elastic job (`train.elastic`, at least 2 ranks, split epochs whose samples are
/// logged) of 3 pods loses pod 2 mid-epoch (its process SIGKILLed, as when its node
/// fails): the job shrinks to 2 ranks and goes on to its end, serving every sample of
/// every epoch once; pod 1 is stopped by the head as usual.
#[test]
fn an_elastic_job_of_three_pods_that_loses_one_shrinks_and_goes_on() {
    const EPOCHS: u64 = 3;
    let root = tempfile::tempdir().expect("temp dir");
    let data = Dataset::synth(root.path());
    let mut sets = Vec::new();
    for set in data.audited_elastic_sets(&["train.min_world=2"]) {
        sets.extend(["--set".to_string(), set]);
    }
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    let args = train_args(root.path(), &data, "elastic", EPOCHS, &sets);
    let (mut jobs, _) = start_pods_with(root.path(), "indexed-job", 3, &args, None, &[]);
    let run = root.path().join("runs/elastic");
    common::wait_for(JOB_LIMIT, "the first step of epoch 1", || {
        assert!(jobs[0].running(), "the job ended early");
        std::fs::read_to_string(run.join("metrics.jsonl"))
            .ok()?
            .contains("\"kind\":\"step\",\"epoch\":1,")
            .then_some(())
    });
    jobs[2].signal(Signal::KILL);
    let done = finish_all(jobs, JOB_LIMIT);
    let leader = &done[0];
    assert!(leader.status.success(), "{}", leader.describe());
    let said = format!("{}{}", leader.stdout, leader.stderr);
    for want in [
        "elastic: lost rank(s)",
        "replicas: identical on all 2 ranks",
    ] {
        assert!(said.contains(want), "no `{want}`:\n{}", leader.describe());
    }
    assert!(
        done[1].stdout.contains("the job's head stopped this node"),
        "{}",
        done[1].describe()
    );
    let records = metrics(&run);
    let regroups: Vec<&Value> = records.iter().filter(|r| r["kind"] == "regroup").collect();
    assert_eq!(regroups.len(), 1, "one shrink: {regroups:?}");
    assert_eq!(regroups[0]["world"], 2, "{}", regroups[0]);
    let manifest = read_json(&data.train_dir.join("manifest.json"));
    let total: u64 = manifest["shards"]
        .as_array()
        .expect("shards")
        .iter()
        .map(|s| s["samples"].as_u64().expect("samples"))
        .sum();
    assert_each_sample_once(logged_samples(&records), EPOCHS, total);
}
