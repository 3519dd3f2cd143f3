//! Fault cases, end to end: a disk that fills during a checkpoint, SIGTERM on an embedded
//! and on a running cluster, garbage on every socket, corrupted checkpoints, and bad
//! shards in the middle of training. Real `imgrun` processes on loopback, on the tiny
//! synthetic shards and small CNN of `train/`. Each case is bounded in time,
//! checks the error or outcome it expects, and that nothing it started is left running.
//! `docs/faults.md` lists these cases beside the fault cases tested elsewhere.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use rustix::process::Signal;

use crate::common;
use crate::common::train::{
    Dataset, Finished, GONE_LIMIT, JOB_LIMIT, Job, TrainCluster, assert_checkpoint_at_last_step,
    assert_resumed_as_whole, assert_resumed_from_step, checkpoint_dir, last_step_value, metrics,
    printed_resume_command, read_json, total_steps, wait_for_steps, workers_of,
};
use crate::common::{Machine, is_running, path_str, wait_alive, wait_for};

/// Slurm's default `KillWait`: a job gets this long between SIGTERM and SIGKILL.
const KILL_WAIT: Duration = Duration::from_secs(30);

/// The disk of the runs folder fills after the first checkpoint. The next save fails with
/// an error that names the file and the newest intact checkpoint; the job exits 1 (no
/// abort), leaves no partial folder, and `latest` still names a whole checkpoint, from
/// which the run continues once there is some space again, to its end on the same small
/// disk with a checkpoint every step: the default retention keeps the newest three.
#[test]
fn a_disk_that_fills_during_a_checkpoint_stops_the_job_at_the_newest_intact_one() {
    // Room the filler leaves for metrics.jsonl, and far less than a checkpoint (about
    // 200 KB: the model and its momentum).
    const SLACK: u64 = 16 * 1024;
    let site = Site::embedded();
    let runs = site.runs();
    std::fs::create_dir_all(runs).expect("create runs/");
    let Some(_tmpfs) = Tmpfs::mount(runs, "4m") else {
        return;
    };
    let sets = [
        "train.checkpoint_every_steps=5",
        "train.checkpoint_every_epochs=0",
        "train.eval_every_epochs=0",
    ];
    let run = runs.join("full");
    let checkpoints = run.join("checkpoints");
    let mut job = site.job("full", 40, &sets, &[]);
    wait_for(JOB_LIMIT, "the first checkpoint", || {
        assert!(
            job.running(),
            "the job ended before its first checkpoint:\n{}",
            job.finish(JOB_LIMIT).describe()
        );
        checkpoints.join("latest").exists().then_some(())
    });
    let filler = fill(&runs.join("filler"), SLACK);
    let out = job.finish(JOB_LIMIT);
    job.assert_nothing_left();
    eprintln!("disk full: {}", out.stderr.trim());
    assert_eq!(out.status.signal(), None, "{}", out.describe());
    assert_eq!(out.status.code(), Some(1), "{}", out.describe());
    assert_no_panic(&out);
    let error = &out.stderr;
    assert!(
        error.contains("No space left on device"),
        "{}",
        out.describe()
    );
    let canonical = std::fs::canonicalize(&checkpoints).expect("canonical checkpoints/");
    assert!(
        error.contains("saving checkpoint") && error.contains(&format!("{}/", canonical.display())),
        "the error does not name the file being written:\n{error}"
    );
    let partial: Vec<String> = entries(&checkpoints)
        .into_iter()
        .filter(|n| n.contains(".partial"))
        .collect();
    assert!(partial.is_empty(), "partial files left: {partial:?}");
    let newest = checkpoint_dir(&run);
    let state = read_json(&newest.join("state.json"));
    let saved_step = state["global_step"]
        .as_u64()
        .unwrap_or_else(|| panic!("{}: no global_step in {state}", newest.display()));
    let name = newest.file_name().and_then(|n| n.to_str()).expect("name");
    assert!(
        error.contains(&format!(
            "the newest checkpoint, {}, is intact",
            canonical.join(name).display()
        )),
        "the error does not name the newest checkpoint, {name}:\n{error}"
    );

    // Space again, but little: room for five checkpoints, as on a small disk other files
    // share. The run continues from that checkpoint for two more epochs with a checkpoint
    // at every step, more than the room holds (a run without retention,
    // `train.keep_checkpoints=0`, fills it again): the default retention, the newest 3,
    // keeps it within the disk to its end.
    std::fs::remove_file(&filler).expect("remove the filler");
    let size = dir_size(&newest);
    let _filler = fill(&runs.join("filler"), 5 * size);
    let epochs = state["epoch"].as_u64().expect("epoch") + 2;
    let resume = ["--resume", path_str(&run)];
    let every_step = [
        "train.checkpoint_every_steps=1",
        "train.checkpoint_every_epochs=1",
        "train.eval_every_epochs=0",
    ];
    let mut again = site.job("full", epochs, &every_step, &resume);
    let resumed = again.finish(JOB_LIMIT);
    again.assert_nothing_left();
    assert!(resumed.status.success(), "{}", resumed.describe());
    assert_resumed_from_step(&resumed, saved_step);
    let last = checkpoint_dir(&run);
    assert!(
        last.ends_with(format!("epoch-{epochs:0>4}")),
        "{}",
        last.display()
    );
    let mut kept = entries(&checkpoints);
    kept.sort();
    assert_eq!(kept.len(), 4, "three checkpoints and latest: {kept:?}");
    let last_step = last_step_value(&metrics(&run))
        .and_then(|v| v.as_u64())
        .expect("a last step");
    let steps_after = last_step - saved_step;
    assert!(
        steps_after > 5,
        "only {steps_after} steps after the resume: too few to fill the room"
    );
}

/// The bytes of the files in `dir` (one level, as a checkpoint folder is).
fn dir_size(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("entry").metadata().expect("metadata").len())
        .sum()
}

/// SIGTERM in the middle of a job on an embedded cluster: see [`sigterm_case`].
#[test]
fn sigterm_on_an_embedded_cluster_checkpoints_and_the_resumed_run_matches() {
    sigterm_case(Site::embedded());
}

/// SIGTERM in the middle of a job on a running cluster: see [`sigterm_case`].
/// (`train::checkpoints` resumes a SIGTERMed job from an earlier checkpoint; this resumes
/// from the one the signal wrote, with the command the job printed.)
#[test]
fn sigterm_on_a_running_cluster_checkpoints_and_the_resumed_run_matches() {
    sigterm_case(Site::Cluster(Box::new(TrainCluster::start())));
}

/// A job told to stop by SIGTERM (a batch scheduler's first signal) exits 143 within
/// Slurm's `KillWait`, with a checkpoint at its last completed step and the command that
/// resumes it; none of its trainers outlives it by more than a few seconds and the
/// cluster keeps no reservation of it. That command, run as printed, ends with the
/// weights of an uninterrupted run, to the bit.
fn sigterm_case(site: Site) {
    // 21 steps, run three times (whole, cut, resumed): the signal comes after step 3 with
    // most of the job ahead, which is all `saved_step < total` needs.
    const EPOCHS: u64 = 3;
    let quick = [
        "train.eval_every_epochs=0",
        "train.checkpoint_every_epochs=0",
    ];
    let mut whole = site.job("whole", EPOCHS, &quick, &[]);
    let whole = whole.finish(JOB_LIMIT);
    assert!(whole.status.success(), "{}", whole.describe());

    let run = site.runs().join("cut");
    let mut job = site.job("cut", EPOCHS, &quick, &[]);
    wait_for_steps(&mut job, &run, 3);
    let trainers = site.trainers(&job);
    assert!(!trainers.is_empty(), "no trainer process seen");
    let signalled = Instant::now();
    job.signal(Signal::TERM);
    let out = job.finish(KILL_WAIT);
    let took = signalled.elapsed();
    eprintln!("SIGTERM: `imgrun train` exited after {took:?}");
    wait_for(GONE_LIMIT, "the job's trainers gone", || {
        trainers.iter().all(|&p| !is_running(p)).then_some(())
    });
    job.assert_nothing_left();
    site.assert_settled();

    assert_eq!(out.status.code(), Some(143), "{}", out.describe());
    assert!(
        out.stderr.contains("interrupted by SIGTERM"),
        "{}",
        out.stderr
    );
    let saved_step = assert_checkpoint_at_last_step(&run);
    let total = total_steps(&out.stdout, EPOCHS);
    assert!(saved_step < total, "not cut: step {saved_step} of {total}");
    let command = printed_resume_command(&out.stderr, &run);

    let mut resumed = site.shell(&command);
    let resumed = resumed.finish(JOB_LIMIT);
    assert!(
        resumed.status.success(),
        "{command}\n{}",
        resumed.describe()
    );
    assert_resumed_as_whole(&resumed, saved_step, &whole);
    site.assert_settled();
}

/// Random bytes and garbled QUIC datagrams (real client Initials replayed, bit-flipped
/// and truncated) to both daemons' UDP ports, random bytes to `imgrun serve` and to any
/// port a trainer listens on while a job runs: the daemons and the server serve on, the
/// job finishes, and `imgrun status` answers as before.
#[test]
fn garbage_on_every_socket_leaves_the_daemons_and_the_server_serving() {
    let cluster = TrainCluster::start();
    let server = common::Server::start(&cluster.data.train_dir);
    let daemons: Vec<u32> = [&cluster.head, &cluster.node]
        .iter()
        .flat_map(|m| m.daemon_pids())
        .collect();
    let quick = [
        "train.eval_every_epochs=0",
        "train.checkpoint_every_epochs=0",
    ];
    let mut job = cluster.job("noisy", 6, &quick, false);
    cluster.wait_for_steps(&mut job, "noisy", 1);

    let initial = client_initial(&cluster.head);
    let mut rng = SplitMix(0x00fa_017e);
    let status = cluster.head.status();
    let quic: Vec<SocketAddr> = common::nodes(&status)
        .iter()
        .map(|n| {
            let address = n["address"].as_str().expect("address");
            address.parse().expect("a node's address")
        })
        .collect();
    assert_eq!(quic.len(), 2, "{status}");
    for &address in &quic {
        flood_udp(address, &initial, &mut rng);
    }
    // A trainer's ring port listens from `listen` until it has accepted the previous rank,
    // before the first step; whatever listens now gets garbage too.
    let ring_ports: BTreeSet<u16> = daemons
        .iter()
        .flat_map(|&d| workers_of(d))
        .flat_map(listening_ports)
        .collect();
    eprintln!("trainer ports listening during the job: {ring_ports:?}");
    for &port in &ring_ports {
        garbage_tcp(SocketAddr::from(([127, 0, 0, 1], port)), &mut rng);
    }
    let served: SocketAddr = server
        .url
        .trim_start_matches("http://")
        .parse()
        .expect("the server's address");
    garbage_tcp(served, &mut rng);

    let out = job.finish(JOB_LIMIT);
    assert!(out.status.success(), "{}", out.describe());
    assert!(
        out.stdout.contains("replicas: identical on all 2 ranks"),
        "{}",
        out.stdout
    );
    for &pid in &daemons {
        assert!(is_running(pid), "daemon {pid} is gone");
    }
    wait_alive(&cluster.head, 2, Duration::from_secs(10));
    let table = cluster.head.run_ok(&["status"]);
    assert!(table.contains("alive"), "{table}");
    cluster.node.run_ok(&["status"]);
    for machine in [&cluster.head, &cluster.node] {
        for log in entries(&machine.state.join("logs")) {
            let text =
                std::fs::read_to_string(machine.state.join("logs").join(&log)).unwrap_or_default();
            assert!(!text.contains("panicked"), "a panic in {log}:\n{text}");
        }
    }
    // The server answers a request as before.
    let shard = cluster.data.train_dir.join("train-000000.tar");
    let want = std::fs::read(&shard).expect("read the shard");
    let got = http_get(served, "/train-000000.tar");
    assert!(got.starts_with(b"HTTP/1.1 200"), "{}", head_of(&got));
    assert!(got.ends_with(&want), "the body is not the shard");
    cluster.assert_settled();
}

/// A checkpoint damaged on disk (a truncated or garbled tensor file, a garbled or cut
/// state.json, a `latest` naming nothing) is refused on `--resume` with an error that
/// names the file: exit status 1, no panic, no abort.
#[test]
fn a_corrupted_checkpoint_is_refused_naming_the_file() {
    type Damage = fn(&Path);
    fn cut(path: &Path) {
        let len = std::fs::metadata(path).expect("metadata").len();
        truncate(path, len / 2);
    }
    let site = Site::embedded();
    let quick = ["train.eval_every_epochs=0"];
    let base = site.job("base", 1, &quick, &[]).finish(JOB_LIMIT);
    assert!(base.status.success(), "{}", base.describe());
    let saved = checkpoint_dir(&site.runs().join("base"));
    let cases: [(&str, Damage, &str); 6] = [
        (
            "model.ot cut in half",
            |d| cut(&d.join("model.ot")),
            "model.ot",
        ),
        (
            "model.ot garbled",
            |d| garble(&d.join("model.ot")),
            "model.ot",
        ),
        (
            "optimizer.ot cut in half",
            |d| cut(&d.join("optimizer.ot")),
            "optimizer.ot",
        ),
        (
            "state.json garbled",
            |d| garble(&d.join("state.json")),
            "state.json",
        ),
        (
            "state.json cut in half",
            |d| cut(&d.join("state.json")),
            "state.json",
        ),
        (
            "latest names a missing folder",
            |d| std::fs::remove_dir_all(d).expect("remove the checkpoint"),
            "latest",
        ),
    ];
    for (i, (what, damage, file)) in cases.into_iter().enumerate() {
        let run = site.runs().join(format!("damaged-{i}"));
        let copy = run
            .join("checkpoints")
            .join(saved.file_name().expect("name"));
        copy_dir(&saved, &copy);
        std::fs::copy(
            saved.with_file_name("latest"),
            run.join("checkpoints/latest"),
        )
        .expect("copy latest");
        damage(&copy);
        let flags = ["--resume", path_str(&run)];
        let mut job = site.job("damaged", 2, &quick, &flags);
        let out = job.finish(JOB_LIMIT);
        job.assert_nothing_left();
        eprintln!("{what}: {}", out.stderr.trim());
        assert_eq!(out.status.signal(), None, "{what}: {}", out.describe());
        assert_eq!(out.status.code(), Some(1), "{what}: {}", out.describe());
        assert_no_panic(&out);
        assert!(
            !out.stderr.contains("Exception raised from") && !out.stderr.contains("frame #"),
            "{what}: libtorch's stack trace in the error:\n{}",
            out.stderr
        );
        let named = run.join("checkpoints");
        let canonical = std::fs::canonicalize(&named).unwrap_or(named.clone());
        assert!(
            [named, canonical]
                .iter()
                .any(|dir| out.stderr.contains(&format!("{}/", dir.display())))
                && out.stderr.contains(file),
            "{what}: the damaged file is not named:\n{}",
            out.stderr
        );
    }
}

/// A shard truncated in the middle of a member, met in the middle of an epoch:
/// `shards.error_policy = "fail"` fails the job naming the shard and the byte offset;
/// `"skip"` skips what is left of it, says so, and the job finishes.
#[test]
fn a_truncated_shard_mid_training_fails_the_job_or_is_skipped() {
    let site = Site::embedded();
    let data = site.data();
    let bad_dir = site.root().join("bad");
    copy_dir(&data.train_dir, &bad_dir);
    let bad = bad_dir.join("train-000002.tar");
    let len = std::fs::metadata(&bad).expect("metadata").len();
    // Inside a member: 100 bytes past the middle, not on a 512-byte block.
    let cut_at = len / 2 / 512 * 512 + 100;
    truncate(&bad, cut_at);
    let train = format!(
        "data.train={:?}",
        format!("{}/train-{{000000..000004}}.tar", bad_dir.display())
    );
    let common = [
        train.as_str(),
        "data.mode=\"split\"",
        "data.policy=\"join\"",
        "train.eval_every_epochs=0",
    ];
    let with = |policy: &'static str| -> Vec<&str> {
        let mut sets = common.to_vec();
        sets.push(policy);
        sets
    };

    let mut job = site.job("fail", 2, &with("shards.error_policy=\"fail\""), &[]);
    let failed = job.finish(JOB_LIMIT);
    job.assert_nothing_left();
    assert_eq!(failed.status.code(), Some(1), "{}", failed.describe());
    assert_no_panic(&failed);
    let error = &failed.stderr;
    eprintln!("fail: {}", error.trim());
    assert!(
        error.contains("train-000002.tar") && error.contains(" at byte "),
        "the shard and offset are not named:\n{error}"
    );
    let steps_before = metrics(&site.runs().join("fail"))
        .iter()
        .filter(|r| r["kind"] == "step")
        .count();
    assert!(steps_before > 0, "the job failed before training");

    let mut job = site.job("skip", 2, &with("shards.error_policy=\"skip\""), &[]);
    let skipped = job.finish(JOB_LIMIT);
    job.assert_nothing_left();
    assert!(skipped.status.success(), "{}", skipped.describe());
    eprintln!("skip: {}", skipped.stderr.trim());
    assert!(
        skipped
            .stderr
            .lines()
            .any(|l| l.starts_with("warning:") && l.contains("train-000002.tar")),
        "the skipped shard is not reported:\n{}",
        skipped.stderr
    );
    let counted: Vec<u64> = metrics(&site.runs().join("skip"))
        .iter()
        .filter(|r| r["kind"] == "epoch")
        .map(|r| r["skipped"].as_u64().unwrap_or(0))
        .collect();
    assert_eq!(counted.len(), 2, "{counted:?}");
    assert!(
        counted.iter().all(|&n| n > 0),
        "every epoch read the bad shard and counts what it skipped: {counted:?}"
    );
    assert!(
        skipped.stderr.contains("bad sample(s) or shard(s) skipped"),
        "{}",
        skipped.stderr
    );
}

// ---------------------------------------------------------------------------------------
// Fixture

/// Where jobs run: an embedded cluster (a machine with no daemon, so `imgrun train` starts
/// one for the job) or a running head with a joined node.
enum Site {
    Embedded {
        machine: Box<Machine>,
        data: Dataset,
        runs: PathBuf,
        root: tempfile::TempDir,
    },
    Cluster(Box<TrainCluster>),
}

impl Site {
    fn embedded() -> Site {
        let root = tempfile::tempdir().expect("temp dir");
        let machine = Box::new(Machine::new(root.path(), "lonely"));
        let data = Dataset::synth(root.path());
        let runs = root.path().join("runs");
        Site::Embedded {
            machine,
            data,
            runs,
            root,
        }
    }

    fn machine(&self) -> &Machine {
        match self {
            Site::Embedded { machine, .. } => machine,
            Site::Cluster(cluster) => &cluster.head,
        }
    }

    fn data(&self) -> &Dataset {
        match self {
            Site::Embedded { data, .. } => data,
            Site::Cluster(cluster) => &cluster.data,
        }
    }

    fn runs(&self) -> &Path {
        match self {
            Site::Embedded { runs, .. } => runs,
            Site::Cluster(cluster) => &cluster.runs,
        }
    }

    fn root(&self) -> &Path {
        match self {
            Site::Embedded { root, .. } => root.path(),
            Site::Cluster(cluster) => cluster.root.path(),
        }
    }

    /// Starts `imgrun train` of the tiny job `name` with `sets` and `flags`, no plot.
    fn job(&self, name: &str, epochs: u64, sets: &[&str], flags: &[&str]) -> Job {
        let args = self
            .data()
            .job_args(self.runs(), name, epochs, sets, false, flags);
        Job::start(self.machine(), &args, self.root())
    }

    /// Runs a command line through `sh`, with the machine's environment.
    fn shell(&self, line: &str) -> Job {
        Job::start_shell(self.machine(), line, self.root())
    }

    /// The trainer processes of `job`, which is running: the `imgrun worker` children of
    /// the job (embedded) or of the cluster's daemons.
    fn trainers(&self, job: &Job) -> Vec<u32> {
        match self {
            Site::Embedded { .. } => workers_of(job.pid()),
            Site::Cluster(cluster) => [&cluster.head, &cluster.node]
                .iter()
                .flat_map(|m| m.daemon_pids())
                .flat_map(workers_of)
                .collect(),
        }
    }

    /// After a job: on a running cluster, no reservation and no worker left.
    fn assert_settled(&self) {
        if let Site::Cluster(cluster) = self {
            cluster.assert_settled();
        }
    }
}

/// A tmpfs mounted over a folder, unmounted on drop.
struct Tmpfs {
    at: PathBuf,
}

impl Tmpfs {
    /// Mounts a tmpfs of `size` (`4m`) at `at`; `None` after `skip_or_fail` where this
    /// machine does not allow it (the test needs root).
    fn mount(at: &Path, size: &str) -> Option<Tmpfs> {
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0755")])
            .arg("imgrun-faults")
            .arg(at)
            .output();
        match out {
            Ok(out) if out.status.success() => Some(Tmpfs {
                at: at.to_path_buf(),
            }),
            Ok(out) => {
                common::skip::skip_or_fail(&format!(
                    "mounting a tmpfs at {} (needs root): {}",
                    at.display(),
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
                None
            }
            Err(error) => {
                common::skip::skip_or_fail(&format!("running mount: {error}"));
                None
            }
        }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let unmounted = Command::new("umount")
            .arg(&self.at)
            .status()
            .is_ok_and(|s| s.success());
        if !unmounted {
            // Something still holds it open: detach it now, it goes when released.
            let _ = Command::new("umount").arg("-l").arg(&self.at).status();
        }
    }
}

/// Writes zeros to `path` until the disk is full, then frees `slack` bytes of it.
fn fill(path: &Path, slack: u64) -> PathBuf {
    let mut file = std::fs::File::create(path).expect("create the filler");
    let chunk = vec![0u8; 64 * 1024];
    let mut written = 0u64;
    loop {
        match file.write(&chunk) {
            Ok(0) => break,
            Ok(n) => written += n as u64,
            Err(e) if e.raw_os_error() == Some(28) => break,
            Err(e) => panic!("{}: {e}", path.display()),
        }
    }
    file.set_len(written.saturating_sub(slack))
        .expect("free the slack");
    path.to_path_buf()
}

fn assert_no_panic(out: &Finished) {
    for word in [
        "panicked",
        "RUST_BACKTRACE",
        "core dumped",
        "terminate called",
    ] {
        assert!(
            !out.stderr.contains(word),
            "`{word}` in the output:\n{}",
            out.describe()
        );
    }
}

fn entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("create the copy");
    for entry in std::fs::read_dir(from).expect("read the folder") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), to.join(entry.file_name())).expect("copy a file");
    }
}

fn truncate(path: &Path, len: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|f| f.set_len(len))
        .unwrap_or_else(|e| panic!("truncating {}: {e}", path.display()));
}

/// Overwrites `path` with random bytes of the same length.
fn garble(path: &Path) {
    let len = std::fs::metadata(path).expect("metadata").len() as usize;
    let mut rng = SplitMix(len as u64);
    std::fs::write(path, rng.bytes(len)).expect("garble");
}

/// SplitMix64: random bytes, the same for a seed.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next() as u8).collect()
    }
}

/// A real QUIC client Initial datagram, as `imgrun status` sends it: caught on a UDP
/// socket that never answers.
fn client_initial(machine: &Machine) -> Vec<u8> {
    let socket = UdpSocket::bind("127.0.0.1:0").expect("bind udp");
    socket
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let address = socket.local_addr().expect("address").to_string();
    let mut status = machine
        .command(&["status", "--address", &address])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start imgrun status");
    let mut buf = vec![0u8; 65536];
    let got = socket.recv(&mut buf);
    let _ = status.kill();
    let _ = status.wait();
    let n = got.expect("no QUIC Initial from `imgrun status` within 10 s");
    buf.truncate(n);
    // A long header with the fixed bit set: an Initial.
    assert!(n >= 1200 && buf[0] & 0xc0 == 0xc0, "not a client Initial");
    buf
}

/// Thousands of bad datagrams to `to`: the Initial replayed, bit-flipped and truncated,
/// random long and short headers, random bytes of every length.
fn flood_udp(to: SocketAddr, initial: &[u8], rng: &mut SplitMix) {
    let socket = UdpSocket::bind("127.0.0.1:0").expect("bind udp");
    let mut sent = 0;
    for round in 0..3000 {
        let datagram = match round % 6 {
            0 => initial.to_vec(),
            1 => {
                let mut d = initial.to_vec();
                for _ in 0..1 + rng.below(8) {
                    let at = rng.below(d.len());
                    d[at] ^= 1 << rng.below(8);
                }
                d
            }
            2 => initial[..rng.below(initial.len())].to_vec(),
            3 => {
                let mut d = rng.bytes(1200);
                d[0] = 0xc0 | (d[0] & 0x3f);
                d[1..5].copy_from_slice(&1u32.to_be_bytes());
                d
            }
            4 => {
                let len = 1 + rng.below(64);
                let mut d = rng.bytes(len);
                d[0] = 0x40 | (d[0] & 0x3f);
                d
            }
            _ => {
                let len = rng.below(1500);
                rng.bytes(len)
            }
        };
        if socket.send_to(&datagram, to).is_ok() {
            sent += 1;
        }
    }
    eprintln!("{sent} bad datagrams sent to {to}");
}

/// Connections that send random bytes (and a request line followed by them) to `to`
/// and close, each bounded in time.
fn garbage_tcp(to: SocketAddr, rng: &mut SplitMix) {
    for round in 0..20 {
        let Ok(mut stream) = TcpStream::connect_timeout(&to, Duration::from_secs(2)) else {
            continue;
        };
        let _ = stream.set_write_timeout(Some(Duration::from_secs(2)));
        let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
        let mut bytes = if round % 2 == 0 {
            Vec::new()
        } else {
            b"GET /train-000000.tar HTTP/1.1\r\n".to_vec()
        };
        let len = 1 + rng.below(64 * 1024);
        bytes.extend(rng.bytes(len));
        let _ = stream.write_all(&bytes);
        let _ = stream.read(&mut [0u8; 1024]);
    }
}

/// The TCP ports `pid` listens on (from its socket inodes and /proc/net).
fn listening_ports(pid: u32) -> Vec<u16> {
    let inodes: BTreeSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|rd| {
            rd.filter_map(|e| {
                let link = std::fs::read_link(e.ok()?.path()).ok()?;
                let link = link.to_str()?;
                Some(
                    link.strip_prefix("socket:[")?
                        .trim_end_matches(']')
                        .to_string(),
                )
            })
            .collect()
        })
        .unwrap_or_default();
    let mut ports = Vec::new();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(state), Some(inode)) =
                (fields.get(1), fields.get(3), fields.get(9))
            else {
                continue;
            };
            let port = local
                .rsplit_once(':')
                .and_then(|(_, p)| u16::from_str_radix(p, 16).ok());
            if *state == "0A" && inodes.contains(*inode) {
                ports.extend(port);
            }
        }
    }
    ports
}

/// `GET path` on a fresh connection; the whole response.
fn http_get(to: SocketAddr, path: &str) -> Vec<u8> {
    let mut stream =
        TcpStream::connect_timeout(&to, Duration::from_secs(5)).expect("connect to the server");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .expect("send the request");
    let mut response = Vec::new();
    stream
        .read_to_end(&mut response)
        .expect("read the response");
    response
}

fn head_of(response: &[u8]) -> String {
    String::from_utf8_lossy(&response[..response.len().min(200)]).into_owned()
}
