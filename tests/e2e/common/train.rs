//! The fixture of the end-to-end tests that train (`train/`, `faults.rs` and others): a
//! head and a joined node as background daemons, tiny synthetic shards, `imgrun train`
//! as a process whose output is collected, and readers of what a run leaves behind
//! (metrics.jsonl, checkpoints, the replica digest).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::process::{Signal, kill_process};
use serde_json::Value;

use super::{Machine, describe, is_running, pid_of, wait_alive, wait_for};

/// The longest any one job of these tests may run.
pub const JOB_LIMIT: Duration = Duration::from_secs(90);
/// How long the cluster may take to settle after a job: reservations released, workers
/// gone.
pub const SETTLE_LIMIT: Duration = Duration::from_secs(15);
/// Per-rank batch size of every job.
pub const BATCH: u64 = 16;
/// How long a process a job started may outlive the job.
pub const GONE_LIMIT: Duration = Duration::from_secs(5);
/// Set on every job these tests start, different for each (its workers inherit it): what
/// finds the processes a job left behind.
const MARK: &str = "IMGRUN_TEST_JOB_MARK";

/// A head and one joined node, with no GPUs, a dataset, and a folder for runs.
pub struct TrainCluster {
    // Dropped before the folder they live in.
    pub head: Machine,
    pub node: Machine,
    /// More joined nodes (`start_with`).
    pub more: Vec<Machine>,
    /// The join line: (address, token, CA hash).
    pub join: (String, String, String),
    pub head_id: u64,
    pub node_id: u64,
    pub data: Dataset,
    pub runs: PathBuf,
    pub root: tempfile::TempDir,
}

impl TrainCluster {
    pub fn start() -> TrainCluster {
        Self::start_with(0)
    }

    /// A head, a node and `more` nodes.
    pub fn start_with(more: usize) -> TrainCluster {
        Self::start_with_env(more, &[])
    }

    /// A head, a node whose daemon (and so its trainers) has `node_env` in its
    /// environment, and `more` nodes.
    pub fn start_with_env(more: usize, node_env: &[(&str, &str)]) -> TrainCluster {
        Self::start_full(more, node_env, &[])
    }

    /// A head started with `head_args` too, and a node.
    pub fn start_head_with(head_args: &[&str]) -> TrainCluster {
        Self::start_full(0, &[], head_args)
    }

    fn start_full(more: usize, node_env: &[(&str, &str)], head_args: &[&str]) -> TrainCluster {
        let root = tempfile::tempdir().expect("temp dir");
        let head = Machine::new(root.path(), "head");
        let mut node = Machine::new(root.path(), "node");
        node.env = node_env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let more: Vec<Machine> = (0..more)
            .map(|i| Machine::new(root.path(), &format!("node{}", i + 2)))
            .collect();
        let mut args = vec!["--bind", "127.0.0.1", "--num-gpus", "0"];
        args.extend_from_slice(head_args);
        let join = head.start_head(&args);
        for machine in std::iter::once(&node).chain(&more) {
            let out = machine.join(&join, &["--bind", "127.0.0.1", "--num-gpus", "0"]);
            assert!(out.status.success(), "join failed:\n{}", describe(&out));
        }
        let status = wait_alive(&head, 2 + more.len(), Duration::from_secs(10));
        // The head is the member at the address nodes join.
        let ids: Vec<(bool, u64)> = super::nodes(&status)
            .iter()
            .filter_map(|n| Some((n["address"] == join.0.as_str(), n["id"].as_u64()?)))
            .collect();
        let id = |head: bool| ids.iter().find(|(h, _)| *h == head).map(|(_, id)| *id);
        let (head_id, node_id) = (id(true).expect("head id"), id(false).expect("node id"));
        let data = Dataset::synth(root.path());
        let runs = root.path().join("runs");
        TrainCluster {
            head,
            node,
            more,
            join,
            head_id,
            node_id,
            data,
            runs,
            root,
        }
    }

    /// Starts `imgrun train` on the head's machine.
    pub fn job(&self, name: &str, epochs: u64, sets: &[&str], plot: bool) -> Job {
        self.job_with(name, epochs, sets, plot, &[])
    }

    pub fn job_with(
        &self,
        name: &str,
        epochs: u64,
        sets: &[&str],
        plot: bool,
        flags: &[String],
    ) -> Job {
        let args = self
            .data
            .job_args(&self.runs, name, epochs, sets, plot, flags);
        Job::start(&self.head, &args, self.root.path())
    }

    /// The steps `imgrun plan --json` gives epoch `epoch` of the job `name` with `sets`,
    /// on this cluster's 2 nodes with one trainer each.
    pub fn planned_steps(&self, name: &str, sets: &[&str], epoch: u64) -> u64 {
        self.planned_steps_on(name, sets, epoch, "1,1")
    }

    /// The same, with `node_ranks` trainers on the nodes (`2,1`).
    pub fn planned_steps_on(&self, name: &str, sets: &[&str], epoch: u64, node_ranks: &str) -> u64 {
        let mut args: Vec<String> = self.data.args(&self.runs, name, 1);
        // `train --name N --epochs E` become `plan --nodes 2 --epoch e --json`.
        args.splice(0..5, ["plan".to_string()]);
        args.extend(
            sets.iter()
                .flat_map(|s| ["--set".to_string(), s.to_string()]),
        );
        args.extend(["--ranks-per-node", node_ranks, "--json", "--epoch"].map(String::from));
        args.push(epoch.to_string());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = self.head.run(&args);
        assert!(
            out.status.success(),
            "{name}: plan failed:\n{}",
            describe(&out)
        );
        let plan: Value = serde_json::from_slice(&out.stdout).expect("plan --json");
        plan["steps"].as_u64().expect("the plan's steps")
    }

    /// Waits until the run has `count` step records, failing if the job ends first.
    pub fn wait_for_steps(&self, job: &mut Job, name: &str, count: usize) {
        wait_for_steps(job, &self.runs.join(name), count);
    }

    /// The per-shard sample counts of the training set, from its manifest.
    pub fn train_counts(&self) -> Vec<u64> {
        let manifest = read_json(&self.data.train_dir.join("manifest.json"));
        manifest["shards"]
            .as_array()
            .expect("shards")
            .iter()
            .map(|s| s["samples"].as_u64().expect("samples"))
            .collect()
    }

    /// Every machine of the cluster, the head first.
    pub fn machines(&self) -> impl Iterator<Item = &Machine> {
        [&self.head, &self.node].into_iter().chain(&self.more)
    }

    /// After a job: no reservation left on the head, no worker process left on any
    /// live daemon.
    pub fn assert_settled(&self) {
        wait_for(SETTLE_LIMIT, "no reservation left", || {
            let left = self.head.job_reservations().len();
            (left == 0).then_some(())
        });
        let daemons: Vec<u32> = self
            .machines()
            .flat_map(Machine::daemon_pids)
            .filter(|&p| is_running(p))
            .collect();
        wait_for(SETTLE_LIMIT, "no worker process left", || {
            daemons
                .iter()
                .all(|&d| workers_of(d).is_empty())
                .then_some(())
        });
    }
}

impl Drop for TrainCluster {
    /// Stops the cluster and anything it started, whatever happened in the test.
    fn drop(&mut self) {
        let daemons: Vec<u32> = self.machines().flat_map(Machine::daemon_pids).collect();
        let workers: Vec<u32> = daemons.iter().flat_map(|&d| workers_of(d)).collect();
        let _ = self.head.run(&["stop", "--all"]);
        let deadline = Instant::now() + Duration::from_secs(10);
        while daemons.iter().chain(&workers).any(|&p| is_running(p)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        // Machine's own drop kills daemons still recorded; workers are killed here.
        for &pid in &workers {
            if let Some(pid) = pid_of(pid).filter(|_| is_running(pid)) {
                let _ = kill_process(pid, Signal::KILL);
            }
        }
    }
}

/// Waits until the run in `run` has `count` step records, failing if the job ends first.
pub fn wait_for_steps(job: &mut Job, run: &Path, count: usize) {
    let deadline = Instant::now() + JOB_LIMIT;
    loop {
        assert!(
            job.running(),
            "the job ended early:\n{}",
            job.finish(JOB_LIMIT).describe()
        );
        let done = std::fs::read_to_string(run.join("metrics.jsonl"))
            .map(|t| t.matches("\"kind\":\"step\"").count())
            .unwrap_or(0);
        if done >= count {
            return;
        }
        assert!(Instant::now() < deadline, "fewer than {count} steps");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `imgrun shards synth` of 4 classes into `root/name`, with the shards named after the
/// folder: the folder and the spec it prints.
pub fn synth_shards(
    root: &Path,
    name: &str,
    per_class: u32,
    maxcount: u32,
    seed: u64,
    size: u32,
) -> (PathBuf, String) {
    let dir = root.join(name);
    let number = |n: u64| n.to_string();
    let out = super::imgrun()
        .args(["shards", "synth"])
        .arg(&dir)
        .args(["--classes", "4", "--per-class", &number(per_class.into())])
        .args(["--size", &number(size.into())])
        .args([
            "--maxcount",
            &number(maxcount.into()),
            "--seed",
            &number(seed),
        ])
        .args(["--prefix", name, "--threads", "1"])
        .output()
        .expect("run imgrun shards synth");
    assert!(out.status.success(), "synth failed:\n{}", describe(&out));
    let spec = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .expect("spec line")
        .to_string();
    (dir, spec)
}

/// Tiny synthetic shards: 5 training shards of unequal size (50, 50, 50, 50, 40 samples
/// of 4 classes) and 2 validation shards of 30, 32-pixel images.
pub struct Dataset {
    pub train_dir: PathBuf,
    pub train: String,
    pub val: String,
}

impl Dataset {
    pub fn synth(root: &Path) -> Dataset {
        let (train_dir, train) = synth_shards(root, "train", 60, 50, 1, 32);
        let (_, val) = synth_shards(root, "val", 15, 30, 2, 32);
        Dataset {
            train_dir,
            train,
            val,
        }
    }

    /// The training set through a command that waits a second before each shard, with
    /// its manifest, as `--set`s: an epoch takes seconds and stalls in its middle.
    pub fn slow_train_sets(&self) -> [String; 2] {
        let dir = self.train_dir.display().to_string();
        [
            format!("data.train=\"pipe:sh -c 'sleep 1; cat {dir}/train-{{000000..000004}}.tar'\""),
            format!("data.manifest=\"{dir}/manifest.json\""),
        ]
    }

    /// An elastic job in `split` mode whose samples are logged, over the slow training
    /// set ([`Dataset::slow_train_sets`]), as `--set`s, then `more`: what the elastic tests
    /// that audit every sample run.
    pub fn audited_elastic_sets(&self, more: &[&str]) -> Vec<String> {
        let mut sets: Vec<String> = [
            "data.mode=\"split\"",
            "train.elastic=true",
            "train.sample_log=true",
        ]
        .iter()
        .chain(more)
        .map(|s| s.to_string())
        .collect();
        sets.extend(self.slow_train_sets());
        sets
    }

    /// [`Dataset::args`], then `sets`, `--no-plot` unless `plot`, and `flags`: what every
    /// test that starts the tiny job runs.
    pub fn job_args(
        &self,
        runs: &Path,
        name: &str,
        epochs: u64,
        sets: &[&str],
        plot: bool,
        flags: &[impl AsRef<str>],
    ) -> Vec<String> {
        let mut args = self.args(runs, name, epochs);
        for set in sets {
            args.extend(["--set".to_string(), set.to_string()]);
        }
        if !plot {
            args.push("--no-plot".to_string());
        }
        args.extend(flags.iter().map(|f| f.as_ref().to_string()));
        args
    }

    /// The arguments of a small job on this data: the small CNN of width 8 on 32-pixel
    /// images, one loader worker, batches of 16, no warm-up.
    pub fn args(&self, runs: &Path, name: &str, epochs: u64) -> Vec<String> {
        let quoted = |key: &str, value: &str| format!("{key}={value:?}");
        let mut args = vec![
            "train".to_string(),
            "--name".to_string(),
            name.to_string(),
            "--epochs".to_string(),
            epochs.to_string(),
        ];
        let sets = [
            quoted("data.train", &self.train),
            quoted("data.val", &self.val),
            quoted("train.runs_dir", &runs.display().to_string()),
            "data.loader_workers=1".to_string(),
            "data.shuffle_buffer=100".to_string(),
            "data.image_size=32".to_string(),
            "data.eval_size=32".to_string(),
            "data.resize_ratio=1.0".to_string(),
            "data.crop_scale=[1.0, 1.0]".to_string(),
            "data.flip=false".to_string(),
            "model.name=small_cnn".to_string(),
            "model.width=8".to_string(),
            format!("train.batch_size={BATCH}"),
            "train.lr=0.4".to_string(),
            "train.reference_batch=32".to_string(),
            "train.warmup_epochs=0.0".to_string(),
            "train.label_smoothing=0.0".to_string(),
            // A rank lost in a collective fails the job in seconds, not minutes.
            "train.step_timeout_secs=20".to_string(),
        ];
        for set in sets {
            args.extend(["--set".to_string(), set]);
        }
        args
    }
}

/// A running `imgrun` whose output is collected by threads of its own; killed on drop.
pub struct Job {
    child: Child,
    stdout: Option<JoinHandle<String>>,
    stderr: Option<JoinHandle<String>>,
    /// The value of [`MARK`] in its environment and its processes'.
    mark: String,
}

/// What an ended job printed.
pub struct Finished {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Finished {
    pub fn describe(&self) -> String {
        format!(
            "status {}\nstdout:\n{}\nstderr:\n{}",
            self.status, self.stdout, self.stderr
        )
    }
}

impl Job {
    pub fn start(machine: &Machine, args: &[String], cwd: &Path) -> Job {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Job::spawn(machine.command(&args), cwd)
    }

    /// Runs a command line through `sh`, with `machine`'s environment.
    pub fn start_shell(machine: &Machine, line: &str, cwd: &Path) -> Job {
        let template = machine.command(&[]);
        let mut command = std::process::Command::new("sh");
        command.args(["-c", line]);
        for (key, value) in template.get_envs() {
            match value {
                Some(value) => command.env(key, value),
                None => command.env_remove(key),
            };
        }
        Job::spawn(command, cwd)
    }

    pub fn spawn(mut command: std::process::Command, cwd: &Path) -> Job {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let mark = format!(
            "{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let mut child = command
            .env(MARK, &mark)
            .current_dir(cwd)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start imgrun train");
        let collect = |mut pipe: Box<dyn Read + Send>| {
            std::thread::spawn(move || {
                let mut text = String::new();
                let _ = pipe.read_to_string(&mut text);
                text
            })
        };
        let stdout = child.stdout.take().map(|p| collect(Box::new(p)));
        let stderr = child.stderr.take().map(|p| collect(Box::new(p)));
        Job {
            child,
            stdout,
            stderr,
            mark,
        }
    }

    /// The process id of the job's `imgrun` (of `sh` for [`Job::start_shell`]).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    pub fn signal(&self, signal: Signal) {
        let pid = pid_of(self.child.id()).expect("pid");
        kill_process(pid, signal).expect("signal the job");
    }

    /// Waits for the job to end within `limit`; kills it and fails the test otherwise.
    pub fn finish(&mut self, limit: Duration) -> Finished {
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                break status;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                let out = self.output_so_far();
                panic!("imgrun did not end within {limit:?}:\n{out}");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let take =
            |h: Option<JoinHandle<String>>| h.and_then(|h| h.join().ok()).unwrap_or_default();
        Finished {
            status,
            stdout: take(self.stdout.take()),
            stderr: take(self.stderr.take()),
        }
    }

    /// No process that the job started (its workers included) runs [`GONE_LIMIT`] after
    /// it ended.
    pub fn assert_nothing_left(&self) {
        let needle = format!("{MARK}={}", self.mark);
        let left = || -> Vec<u32> {
            let Ok(entries) = std::fs::read_dir("/proc") else {
                return Vec::new();
            };
            entries
                .filter_map(Result::ok)
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .filter(|&pid| {
                    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
                    environ
                        .split(|&b| b == 0)
                        .any(|var| var == needle.as_bytes())
                })
                .filter(|&pid| is_running(pid))
                .collect()
        };
        let deadline = Instant::now() + GONE_LIMIT;
        loop {
            let running = left();
            if running.is_empty() {
                return;
            }
            if Instant::now() >= deadline {
                let lines: Vec<String> = running
                    .iter()
                    .map(|pid| {
                        let cmdline =
                            std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                        format!(
                            "{pid}: {}",
                            String::from_utf8_lossy(&cmdline).replace('\0', " ")
                        )
                    })
                    .collect();
                panic!(
                    "processes of the job still run {GONE_LIMIT:?} after it:\n{}",
                    lines.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn output_so_far(&mut self) -> String {
        let take =
            |h: Option<JoinHandle<String>>| h.and_then(|h| h.join().ok()).unwrap_or_default();
        format!(
            "stdout:\n{}\nstderr:\n{}",
            take(self.stdout.take()),
            take(self.stderr.take())
        )
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if self.running() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The `imgrun worker` processes started by the daemon `daemon`.
pub fn workers_of(daemon: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| is_running(pid))
        .filter(|&pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let parent = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            parent == Some(daemon) && cmdline.split(|&b| b == 0).any(|arg| arg == b"worker")
        })
        .collect()
}

pub fn read_json(path: &Path) -> Value {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(Value::Null)
}

/// Every record of a run's metrics.jsonl.
pub fn metrics(run: &Path) -> Vec<Value> {
    let path = run.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect()
}

/// Every step's samples of the run at `run`, with their epochs, each as `SHARD-NAME#KEY`:
/// the URL's folder, which differs between a bucket and a disk, left out.
pub fn logged_sample_names(run: &Path) -> Vec<(u64, Vec<String>)> {
    logged_samples(&metrics(run))
        .map(|(epoch, ids)| {
            let ids = ids
                .iter()
                .map(|id| id.rsplit('/').next().unwrap_or(id).to_string())
                .collect();
            (epoch, ids)
        })
        .collect()
}

/// The run's latest checkpoint is at the last step its metrics.jsonl records (the step
/// an interrupted job completed last); returns that step.
pub fn assert_checkpoint_at_last_step(run: &Path) -> u64 {
    let records = metrics(run);
    let last = last_step_value(&records)
        .and_then(|v| v.as_u64())
        .expect("a step record");
    let state = read_json(&checkpoint_dir(run).join("state.json"));
    assert_eq!(
        state["global_step"].as_u64(),
        Some(last),
        "the checkpoint is not at the last completed step: {state}"
    );
    let stop = records
        .iter()
        .rfind(|r| r["kind"] == "stop")
        .expect("a stop record");
    assert_eq!(stop["step"].as_u64(), Some(last), "{stop}");
    last
}

/// The job's steps in all: `N steps per epoch` from its output times `epochs`.
pub fn total_steps(stdout: &str, epochs: u64) -> u64 {
    let per_epoch = stdout
        .lines()
        .find_map(|l| {
            let (before, _) = l.split_once(" steps per epoch")?;
            before.rsplit(' ').next()?.parse::<u64>().ok()
        })
        .unwrap_or_else(|| panic!("no steps per epoch in:\n{stdout}"));
    per_epoch * epochs
}

pub fn last_step_value(records: &[Value]) -> Option<Value> {
    records
        .iter()
        .rfind(|r| r["kind"] == "step")
        .map(|r| r["step"].clone())
}

/// The checkpoint folder `checkpoints/latest` names.
pub fn checkpoint_dir(run: &Path) -> PathBuf {
    let checkpoints = run.join("checkpoints");
    let named = std::fs::read_to_string(checkpoints.join("latest"))
        .unwrap_or_else(|e| panic!("{}/latest: {e}", checkpoints.display()));
    let dir = checkpoints.join(named.trim());
    assert!(
        dir.is_dir(),
        "latest names {named:?}, which is not a folder"
    );
    dir
}

/// The resumed run continued from global step `saved_step` (its `resuming:` line).
pub fn assert_resumed_from_step(resumed: &Finished, saved_step: u64) {
    assert!(
        resumed
            .stdout
            .contains(&format!("global step {saved_step})")),
        "{}",
        resumed.stdout
    );
}

/// The processes a launcher started for one job (`what`: the launch's name in messages),
/// process 0 first, all ended well and quietly: each exited 0 with nothing that looks like
/// a problem on its standard error, process 0 said each of `leader_says`, and the others
/// were stopped by its head.
pub fn assert_launched_together(what: &str, finished: &[Finished], leader_says: &[&str]) {
    for (index, done) in finished.iter().enumerate() {
        assert!(
            done.status.success(),
            "{what} process {index}:\n{}",
            done.describe()
        );
        assert!(
            !done.stderr.contains(" WARN ") && !done.stderr.contains(" ERROR "),
            "{what} process {index} warned at a normal end:\n{}",
            done.describe()
        );
    }
    for want in leader_says {
        assert!(
            finished[0].stdout.contains(want),
            "{what}: process 0 did not say `{want}`:\n{}",
            finished[0].describe()
        );
    }
    for done in &finished[1..] {
        assert!(
            done.stdout.contains("the job's head stopped this node"),
            "{what}:\n{}",
            done.describe()
        );
    }
}

/// The resumed run continued from global step `saved_step` and ended with the weights of
/// the uninterrupted run `whole`, to the bit.
pub fn assert_resumed_as_whole(resumed: &Finished, saved_step: u64, whole: &Finished) {
    assert_resumed_from_step(resumed, saved_step);
    assert_eq!(
        replica_digest(&resumed.stdout),
        replica_digest(&whole.stdout),
        "the final weights of the resumed and the uninterrupted run"
    );
}

/// The hash prefix of `replicas: identical on all N ranks (sha256 ...)`.
pub fn replica_digest(stdout: &str) -> String {
    stdout
        .lines()
        .find_map(|l| l.split_once("(sha256 "))
        .map(|(_, rest)| rest.trim_end_matches(')').to_string())
        .unwrap_or_else(|| panic!("no replica digest in:\n{stdout}"))
}

/// The `imgrun train ... --resume RUN` line an interrupted job printed after "to continue
/// this run:", checked to resume `run`.
pub fn printed_resume_command(stderr: &str, run: &Path) -> String {
    let command = stderr
        .lines()
        .skip_while(|l| !l.starts_with("to continue this run:"))
        .nth(1)
        .unwrap_or_else(|| panic!("no resume command in:\n{stderr}"))
        .trim()
        .to_string();
    assert!(
        command.ends_with(&format!("--resume {}", run.display())),
        "{command}"
    );
    command
}

/// Each sample of the training set (`total` of them) exactly once in each of `epochs`:
/// `seen` gives every step's samples (of every rank) with the step's epoch.
pub fn assert_each_sample_once<'a>(
    seen: impl IntoIterator<Item = (u64, Vec<&'a str>)>,
    epochs: u64,
    total: u64,
) {
    let seen: Vec<(u64, Vec<&str>)> = seen.into_iter().collect();
    for epoch in 0..epochs {
        let mut ids: Vec<&str> = seen
            .iter()
            .filter(|(e, _)| *e == epoch)
            .flat_map(|(_, ids)| ids.iter().copied())
            .collect();
        let served = ids.len();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), served, "epoch {epoch}: a sample served twice");
        assert_eq!(served as u64, total, "epoch {epoch}: samples served");
    }
}

/// The samples of every `samples` record of a run, with their epochs.
pub fn logged_samples(records: &[Value]) -> impl Iterator<Item = (u64, Vec<&str>)> {
    records.iter().filter(|r| r["kind"] == "samples").map(|r| {
        let ids = r["samples"]
            .as_array()
            .expect("samples")
            .iter()
            .map(|s| s.as_str().expect("a sample id"))
            .collect();
        (r["epoch"].as_u64().expect("epoch"), ids)
    })
}

/// The global steps of a run's step records run on without a gap or a repeat.
pub fn assert_steps_run_on(records: &[Value]) {
    let steps: Vec<u64> = records
        .iter()
        .filter(|r| r["kind"] == "step")
        .filter_map(|r| r["step"].as_u64())
        .collect();
    assert!(
        steps.windows(2).all(|w| w[1] == w[0] + 1),
        "global steps run on without a gap or a repeat: {steps:?}"
    );
}
