//! What the end-to-end tests of the binary share: simulated machines (a state folder
//! each, fast heartbeats) that run the real `imgrun` as separate processes, and bounded
//! polling.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, kill_process, test_kill_process};
use serde_json::Value;

// The workspace's one rule for a test whose precondition is missing here.
pub mod azure;
pub mod loopback;
pub mod s3;
#[path = "../../../pipelines/tests/common/skip.rs"]
pub mod skip;
pub mod train;

pub const HEARTBEAT_MS: &str = "100";
pub const DEAD_AFTER_MS: &str = "1000";

/// One simulated machine: a state folder, and optionally a network namespace.
pub struct Machine {
    pub state: PathBuf,
    pub netns: Option<String>,
    /// More environment for its commands (and the daemons they start).
    pub env: Vec<(String, String)>,
    /// A folder this machine sees empty: its commands (and the daemons and workers they
    /// start) run in a mount namespace of their own with a tmpfs over it, as another
    /// machine would not see this one's disk. Needs root.
    pub private_dir: Option<PathBuf>,
}

/// The `imgrun` under test, with no `IMGRUN_LOG` and no standard input.
pub fn imgrun() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_imgrun"));
    command.env_remove("IMGRUN_LOG").stdin(Stdio::null());
    command
}

/// A UDP port free on loopback now (a head's QUIC port).
pub fn free_udp_port() -> u16 {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind a UDP port");
    socket.local_addr().expect("its address").port()
}

/// `imgrun ARGS` in `cwd`, on no machine's state folder: its standard output, after it
/// succeeded.
pub fn run_ok(args: &[&str], cwd: &Path) -> String {
    let out = imgrun()
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("run imgrun");
    stdout_of_success(args, &out)
}

/// The standard output of `imgrun ARGS`, which must have succeeded.
pub fn stdout_of_success(args: &[&str], out: &Output) -> String {
    assert!(
        out.status.success(),
        "imgrun {args:?} failed:\n{}",
        describe(out)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl Machine {
    pub fn new(root: &Path, name: &str) -> Machine {
        Machine {
            state: root.join(name),
            netns: None,
            env: Vec::new(),
            private_dir: None,
        }
    }

    pub fn command(&self, args: &[&str]) -> Command {
        let mut command = match (&self.netns, &self.private_dir) {
            (Some(ns), _) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, env!("CARGO_BIN_EXE_imgrun")]);
                c.env_remove("IMGRUN_LOG").stdin(Stdio::null());
                c
            }
            (None, Some(dir)) => {
                // `$0` is the folder, `$@` the command; the tmpfs goes when the namespace's
                // last process does.
                let mut c = Command::new("unshare");
                c.args(["--mount", "--propagation", "private", "sh", "-c"])
                    .arg(r#"mount -t tmpfs -o size=64m imgrun-private "$0" && exec "$@""#)
                    .arg(dir)
                    .arg(env!("CARGO_BIN_EXE_imgrun"));
                c.env_remove("IMGRUN_LOG").stdin(Stdio::null());
                c
            }
            (None, None) => imgrun(),
        };
        command
            .args(args)
            .env("IMGRUN_STATE_DIR", &self.state)
            .env("IMGRUN_CLUSTER__HEARTBEAT_MS", HEARTBEAT_MS)
            .env("IMGRUN_CLUSTER__DEAD_AFTER_MS", DEAD_AFTER_MS)
            .env("IMGRUN_CLUSTER__START_TIMEOUT_SECS", "20")
            .envs(self.env.iter().map(|(k, v)| (k, v)));
        command
    }

    pub fn run(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("run imgrun")
    }

    pub fn run_ok(&self, args: &[&str]) -> String {
        stdout_of_success(args, &self.run(args))
    }

    pub fn status(&self) -> Value {
        let text = self.run_ok(&["status", "--json"]);
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("status --json: {e}\n{text}"))
    }

    /// The reservations of `status --json` other than the cluster's job archive's (an
    /// actor the head starts, which holds a place while the cluster runs).
    pub fn job_reservations(&self) -> Vec<Value> {
        let status = self.status();
        let archives: Vec<String> = status["actors"]
            .as_array()
            .map(|actors| {
                actors
                    .iter()
                    .filter(|a| a["kind"] == "job-archive")
                    .map(|a| format!("actor:{}", a["id"]))
                    .collect()
            })
            .unwrap_or_default();
        let reservations = status["reservations"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        reservations
            .into_iter()
            .filter(|r| !archives.iter().any(|owner| r["owner"] == owner.as_str()))
            .collect()
    }

    /// The pids of the daemons recorded in this machine's state folder.
    pub fn daemon_pids(&self) -> Vec<u32> {
        let Ok(entries) = std::fs::read_dir(self.state.join("daemons")) else {
            return Vec::new();
        };
        entries
            .filter_map(Result::ok)
            .filter_map(|e| {
                let text = std::fs::read_to_string(e.path()).ok()?;
                let record: Value = serde_json::from_str(&text).ok()?;
                u32::try_from(record["pid"].as_u64()?).ok()
            })
            .collect()
    }

    /// Starts a head in the background; returns the printed `imgrun join ...` line split
    /// into (address, token, ca hash).
    pub fn start_head(&self, extra: &[&str]) -> (String, String, String) {
        let mut args = vec!["start", "--head", "--port", "0"];
        args.extend_from_slice(extra);
        let out = self.run_ok(&args);
        let line = out
            .lines()
            .map(str::trim)
            .find(|l| l.starts_with("imgrun join "))
            .unwrap_or_else(|| panic!("no join command in:\n{out}"));
        let words: Vec<&str> = line.split_whitespace().collect();
        let flag = |name: &str| {
            let at = words.iter().position(|w| *w == name).expect(name);
            words[at + 1].to_string()
        };
        (words[2].to_string(), flag("--token"), flag("--ca-hash"))
    }

    pub fn join(&self, head: &(String, String, String), extra: &[&str]) -> Output {
        let (address, token, ca_hash) = head;
        let mut args = vec!["join", address, "--token", token, "--ca-hash", ca_hash];
        args.extend_from_slice(extra);
        self.run(&args)
    }
}

impl Drop for Machine {
    /// Whatever happened in the test, no daemon outlives it.
    fn drop(&mut self) {
        for pid in self.daemon_pids() {
            if let Some(pid) = pid_of(pid) {
                let _ = kill_process(pid, Signal::KILL);
            }
        }
    }
}

pub fn pid_of(pid: u32) -> Option<Pid> {
    Pid::from_raw(i32::try_from(pid).ok()?)
}

pub fn is_running(pid: u32) -> bool {
    // A process that exited stays a zombie until its parent reaps it; orphans (daemons
    // whose `imgrun start` has exited, workers of a killed node) wait for init, which may
    // reap them late. A zombie runs nothing: it counts as gone.
    let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let state = stat.rsplit_once(')')?.1.trim_start().chars().next()?;
            Some(state == 'Z' || state == 'X')
        })
        .unwrap_or(false);
    !zombie && pid_of(pid).is_some_and(|p| test_kill_process(p).is_ok())
}

pub fn describe(out: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Polls `check` every 50 ms until it returns `Some`, for at most `limit`.
pub fn wait_for<T>(limit: Duration, what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?}: {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn nodes(status: &Value) -> Vec<Value> {
    status["nodes"].as_array().cloned().unwrap_or_default()
}

/// Waits until `head`'s status shows `count` nodes alive, and returns that status.
pub fn wait_alive(head: &Machine, count: usize, limit: Duration) -> Value {
    wait_for(limit, &format!("{count} nodes alive"), || {
        let status = head.status();
        let alive = node_states(&status)
            .iter()
            .filter(|(_, s)| s == "alive")
            .count();
        (alive == count).then_some(status)
    })
}

pub fn node_states(status: &Value) -> Vec<(u64, String)> {
    let mut states: Vec<(u64, String)> = nodes(status)
        .iter()
        .map(|n| {
            (
                n["id"].as_u64().unwrap_or(u64::MAX),
                n["state"].as_str().unwrap_or("?").to_string(),
            )
        })
        .collect();
    states.sort();
    states
}

/// `imgrun serve` of a folder on loopback, in the background, killed on drop.
pub struct Server {
    child: Child,
    /// The folder's URL, without a trailing `/`.
    pub url: String,
    /// Its log lines (stderr), as they come.
    pub log: std::sync::mpsc::Receiver<String>,
}

impl Server {
    pub fn start(dir: &Path) -> Self {
        Self::start_with(dir, &[])
    }

    /// With `env` set (`IMGRUN_SERVE__*`, `IMGRUN_LOG`).
    pub fn start_with(dir: &Path, env: &[(&str, &str)]) -> Self {
        let mut child = imgrun()
            .envs(env.iter().copied())
            .args(["serve", path_str(dir)])
            .args(["--port", "0", "--bind", "127.0.0.1"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start imgrun serve");
        let stderr = child.stderr.take().expect("stderr");
        let (lines, log) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if lines.send(line).is_err() {
                    break;
                }
            }
        });
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read the serving line");
        let url = line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap_or_else(|| panic!("no URL in `{line}`"))
            .trim_end_matches('/')
            .to_string();
        Self { child, url, log }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A pair of network namespaces with a veth link, removed on drop.
pub struct Netns {
    pub names: [String; 2],
    pub addresses: [String; 2],
    /// The veth ends, in the namespaces of `names`.
    devices: [String; 2],
}

impl Netns {
    /// The pair, or why it cannot be made here.
    pub fn create() -> Result<Netns, String> {
        // Unique to this pair: tests of one process make pairs side by side. (Interface
        // names fit in 15 bytes: `imga`, a pid of at most 7 digits and `x` leave 3 for
        // the count.)
        static PAIRS: AtomicU32 = AtomicU32::new(0);
        let tag = format!(
            "{}x{}",
            std::process::id(),
            PAIRS.fetch_add(1, Ordering::Relaxed)
        );
        let names = [format!("imgrun-a-{tag}"), format!("imgrun-b-{tag}")];
        let addresses = ["10.77.0.1".to_string(), "10.77.0.2".to_string()];
        let devices = [format!("imga{tag}"), format!("imgb{tag}")];
        let net = Netns {
            names,
            addresses,
            devices,
        };
        let [a, b] = &net.names;
        let [va, vb] = &net.devices;
        let steps: Vec<Vec<String>> = vec![
            vec!["netns".into(), "add".into(), a.clone()],
            vec!["netns".into(), "add".into(), b.clone()],
            vec![
                "link".into(),
                "add".into(),
                va.clone(),
                "netns".into(),
                a.clone(),
                "type".into(),
                "veth".into(),
                "peer".into(),
                "name".into(),
                vb.clone(),
                "netns".into(),
                b.clone(),
            ],
        ];
        let inside = |ns: &str, args: &[&str]| -> Vec<String> {
            let mut v: Vec<String> = vec!["-n".into(), ns.into()];
            v.extend(args.iter().map(|s| s.to_string()));
            v
        };
        let mut all = steps;
        for (ns, dev, ip) in [(a, va, &net.addresses[0]), (b, vb, &net.addresses[1])] {
            all.push(inside(
                ns,
                &["addr", "add", &format!("{ip}/24"), "dev", dev],
            ));
            all.push(inside(ns, &["link", "set", dev, "up"]));
            all.push(inside(ns, &["link", "set", "lo", "up"]));
        }
        for step in all {
            // A failed step drops `net`, which removes what the earlier steps made.
            let run = Command::new("ip").args(&step).stdin(Stdio::null()).output();
            let failed = match run {
                Err(error) => format!("cannot run `ip`: {error}"),
                Ok(out) if out.status.success() => continue,
                Ok(out) => String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            };
            return Err(format!(
                "cannot create network namespaces here (needs root and `ip`): `ip {}`: {failed}",
                step.join(" ")
            ));
        }
        Ok(net)
    }
}

impl Netns {
    /// A head's and a node's machine under `root`, in the first and the second namespace.
    pub fn machines(&self, root: &Path) -> (Machine, Machine) {
        let mut head = Machine::new(root, "head");
        head.netns = Some(self.names[0].clone());
        let mut node = Machine::new(root, "node");
        node.netns = Some(self.names[1].clone());
        (head, node)
    }

    /// [`Netns::machines`] as a cluster of no GPUs: the head started on the first
    /// address, the node joined from the second; with the head's status once both live.
    pub fn cluster(&self, root: &Path) -> (Machine, Machine, Value) {
        let (head, node) = self.machines(root);
        let join = head.start_head(&["--bind", &self.addresses[0], "--num-gpus", "0"]);
        let out = node.join(&join, &["--bind", &self.addresses[1], "--num-gpus", "0"]);
        assert!(out.status.success(), "join failed:\n{}", describe(&out));
        let status = wait_alive(&head, 2, Duration::from_secs(10));
        (head, node, status)
    }

    /// Cuts the link (both ends down): a partition, with no packet refused.
    pub fn cut(&self) {
        self.set_link("down");
    }

    /// Brings the link back up.
    pub fn restore(&self) {
        self.set_link("up");
    }

    fn set_link(&self, state: &str) {
        for (ns, dev) in self.names.iter().zip(&self.devices) {
            let out = Command::new("ip")
                .args(["-n", ns, "link", "set", dev, state])
                .stdin(Stdio::null())
                .output()
                .expect("run ip");
            assert!(
                out.status.success(),
                "ip -n {ns} link set {dev} {state}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for name in &self.names {
            let _ = Command::new("ip")
                .args(["netns", "del", name])
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// The names of the `.tar` files in `dir`, sorted.
pub fn tar_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tar"))
        .collect();
    names.sort();
    names
}

/// `imgrun shards synth` of 360 192-pixel images (about 27 KB each) into `out`, as
/// `up-000000.tar` (300 of them, about 8 MB: two parts of an upload) and `up-000001.tar`;
/// what it printed. The same command writes the same bytes wherever `out` is.
pub fn synth_two_part_shards(machine: &Machine, out: &str) -> String {
    let args = [
        "shards",
        "synth",
        out,
        "--classes",
        "3",
        "--per-class",
        "120",
        "--size",
        "192",
        "--maxcount",
        "300",
        "--seed",
        "5",
        "--prefix",
        "up",
        "--threads",
        "1",
    ];
    machine.run_ok(&args)
}

/// A path as the `&str` an argument needs (the tests' temporary paths are UTF-8).
pub fn path_str(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 path")
}

/// The Python of a venv script of `tools/` (`pytools.sh`: webdataset; `pybench.sh`:
/// torch, torchvision, safetensors), or the program an install script makes
/// (`azurite.sh`), which the script prints; `None` (after `skip_or_fail`) where the
/// script says, exiting 2, that something it needs is missing.
pub fn tools_python(script: &str) -> Option<PathBuf> {
    let out = Command::new("bash")
        .arg(script)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run bash {script}: {e}"));
    if out.status.code() == Some(2) {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let why = stderr.lines().last().map(str::to_owned);
        skip::skip_or_fail(&why.unwrap_or_else(|| format!("{script}: exit 2")));
        return None;
    }
    assert!(out.status.success(), "{script}:\n{}", describe(&out));
    Some(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// What TensorBoard's own reader (`tests/python/tb_check.py`, run by `python` of
/// `tools/pybench.sh`) charts for `tag` from the event files in `dir`: (step, value).
pub fn tensorboard_scalars(python: &Path, dir: &Path, tag: &str) -> Vec<(u64, f32)> {
    let mut scalars = tensorboard_charts(python, dir);
    scalars
        .remove(tag)
        .unwrap_or_else(|| panic!("no {tag} in {}: {scalars:?}", dir.display()))
}

/// Every tag TensorBoard's own reader charts from the event files in `dir` (a run of
/// TensorBoard's, not the folders in it), with its (step, value)s.
pub fn tensorboard_charts(
    python: &Path,
    dir: &Path,
) -> std::collections::BTreeMap<String, Vec<(u64, f32)>> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/tb_check.py");
    let read = Command::new(python)
        .arg(&script)
        .arg(dir)
        .stdin(Stdio::null())
        .output()
        .expect("run python");
    assert!(read.status.success(), "tb_check.py: {}", describe(&read));
    let scalars: std::collections::BTreeMap<String, Vec<(u64, f64)>> =
        serde_json::from_slice(&read.stdout).expect("json of {tag: [[step, value]]}");
    scalars
        .into_iter()
        .map(|(tag, points)| {
            let points = points.into_iter().map(|(s, v)| (s, v as f32)).collect();
            (tag, points)
        })
        .collect()
}

/// Checks the per-rank TensorBoard runs of the run folder `run` (`train.tensorboard_ranks`)
/// against its `records` (metrics.jsonl): TensorBoard's own reader finds a run
/// `tb/rank-N/` for each rank the step records carry, and in it exactly the rank's
/// figures at f32, by tag, every step once (a resume's `START` dropping what an earlier
/// run wrote past its checkpoint). Returns how many rank runs there are.
pub fn assert_rank_runs_match(python: &Path, run: &Path, records: &[Value]) -> usize {
    type Charts = std::collections::BTreeMap<String, Vec<(u64, f32)>>;
    let mut want: std::collections::BTreeMap<u64, Charts> = Default::default();
    for record in records.iter().filter(|r| r["kind"] == "step") {
        let step = record["step"].as_u64().expect("step");
        let ranks = record["ranks"]
            .as_array()
            .expect("a step record with ranks");
        for figures in ranks {
            let figure = |key: &str| figures[key].as_f64().expect(key);
            let rank = figures["rank"].as_u64().expect("rank");
            let charts = want.entry(rank).or_default();
            for (tag, value) in [
                ("rank/step_s", figure("step_s")),
                ("rank/data_wait", figure("data_wait_s")),
                ("rank/compute_s", figure("compute_s")),
                ("rank/allreduce_ms", figure("allreduce_s") * 1e3),
            ] {
                charts
                    .entry(tag.to_owned())
                    .or_default()
                    .push((step, value as f32));
            }
        }
    }
    let tb = run.join("tb");
    let mut folders: Vec<String> = std::fs::read_dir(&tb)
        .unwrap_or_else(|error| panic!("{}: {error}", tb.display()))
        .map(|entry| entry.expect("entry"))
        .filter(|entry| entry.path().is_dir())
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .collect();
    folders.sort();
    let mut named: Vec<String> = want.keys().map(|rank| format!("rank-{rank}")).collect();
    named.sort();
    assert_eq!(folders, named, "the rank runs in {}", tb.display());
    for (rank, charts) in &want {
        let charted = tensorboard_charts(python, &tb.join(format!("rank-{rank}")));
        assert_eq!(
            &charted, charts,
            "TensorBoard's rank-{rank} against metrics.jsonl"
        );
    }
    want.len()
}

/// The first `program` on `PATH`, as a shell would find it.
pub fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|dir| Path::new(dir).join(program))
        .find(|path| path.is_file())
}
