//! End-to-end tests of `imgrun train` started by a launcher on every rank, with no
//! `imgrun start`: local processes with the environment torchrun gives them, and with
//! the one Slurm's `srun` gives them, train the small CNN together with identical
//! replicas; a process of the job that dies fails the job, naming it; processes that
//! never meet each give up naming what is missing.

use std::path::Path;
use std::process::Command;

use rustix::process::{Signal, kill_process};

use crate::common;
use crate::common::train::{Dataset, Finished, JOB_LIMIT, Job};

/// `imgrun train` as launcher process `rank`, with `vars` as its launcher's environment.
fn process(root: &Path, data: &Dataset, rank: usize, vars: &[(String, String)]) -> Job {
    let mut command = common::imgrun();
    command
        .args(data.args(&root.join("runs"), "launched", 2))
        .args(["--no-plot", "--set", "train.eval_every_epochs=0"])
        .env("IMGRUN_STATE_DIR", root.join(format!("state-{rank}")))
        .env("IMGRUN_CLUSTER__HEARTBEAT_MS", "200")
        .env("IMGRUN_CLUSTER__DEAD_AFTER_MS", "3000")
        .env("IMGRUN_LAUNCH__TIMEOUT_SECS", "60")
        .envs(vars.iter().map(|(k, v)| (k, v)));
    Job::spawn(command, root)
}

fn vars(pairs: &[(&str, String)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

fn torchrun(rank: usize, world: usize, port: u16, id: &str) -> Vec<(String, String)> {
    vars(&[
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("LOCAL_WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", port.to_string()),
        ("TORCHELASTIC_RUN_ID", id.to_string()),
    ])
}

fn slurm(rank: usize, world: usize, port: u16, job: u32) -> Vec<(String, String)> {
    vars(&[
        ("SLURM_JOB_ID", job.to_string()),
        ("SLURM_STEP_ID", "0".to_string()),
        ("SLURM_PROCID", rank.to_string()),
        ("SLURM_NTASKS", world.to_string()),
        ("SLURM_LOCALID", rank.to_string()),
        ("SLURM_NODEID", "0".to_string()),
        ("SLURM_JOB_NODELIST", "localhost".to_string()),
        ("SLURM_TASKS_PER_NODE", world.to_string()),
        ("IMGRUN_LAUNCH__PORT", port.to_string()),
    ])
}

/// Runs the job's processes to their end; returns what each printed, by rank.
fn run_all(
    root: &Path,
    data: &Dataset,
    env: impl Fn(usize) -> Vec<(String, String)>,
) -> Vec<Finished> {
    let jobs: Vec<Job> = (0..2).map(|r| process(root, data, r, &env(r))).collect();
    jobs.into_iter()
        .map(|mut job| job.finish(JOB_LIMIT))
        .collect()
}

/// Both processes ended well; two trainers, one per process, with identical replicas.
fn assert_trained_together(finished: &[Finished]) {
    let says = [
        "launch: all 2 processes joined",
        "2 CPU trainer(s) on node",
        "replicas: identical on all 2 ranks",
    ];
    common::train::assert_launched_together("launch", finished, &says);
}

#[test]
fn processes_started_as_torchrun_starts_them_train_one_job() {
    let root = tempfile::tempdir().expect("temp dir");
    let data = Dataset::synth(root.path());
    let port = common::free_udp_port();
    let id = format!("t{}", std::process::id());
    let finished = run_all(root.path(), &data, |r| torchrun(r, 2, port, &id));
    assert_trained_together(&finished);
    let rendezvous = root.path().join("runs/.rendezvous");
    let left: Vec<_> = std::fs::read_dir(&rendezvous)
        .map(|d| d.filter_map(Result::ok).map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "rendezvous files left behind: {left:?}");
}

/// A port free on loopback now for both TCP (torchrun's store) and UDP (the head's QUIC).
fn free_tcp_and_udp_port() -> u16 {
    for _ in 0..100 {
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a TCP port");
        let port = tcp.local_addr().expect("its address").port();
        if std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no port free for both TCP and UDP in 100 tries");
}

/// The README's torchrun line (`torchrun --nproc-per-node 2 --no-python
/// target/release/imgrun train --config job.toml`) under the real torchrun of the torch
/// venv that `make test` puts on `PATH`, with a port of its own: both processes end well,
/// the job trains two ranks with identical replicas, and nothing warns.
#[test]
fn the_readme_torchrun_line_trains_under_the_real_torchrun() {
    let Some(torchrun) = common::which("torchrun") else {
        return common::skip::skip_or_fail(
            "torchrun on PATH (the torch venv's: make test puts it there; by hand, eval \
             \"$(bash tools/libtorch.sh)\")",
        );
    };
    let root = tempfile::tempdir().expect("temp dir");
    let data = Dataset::synth(root.path());
    let job = format!(
        "[data]\ntrain = {:?}\nval = {:?}\nloader_workers = 1\nshuffle_buffer = 100\n\
         image_size = 32\neval_size = 32\nresize_ratio = 1.0\ncrop_scale = [1.0, 1.0]\n\
         flip = false\n\n[model]\nname = \"small_cnn\"\nwidth = 8\n\n[train]\nepochs = 1\n\
         batch_size = 16\nlr = 0.4\nreference_batch = 32\nwarmup_epochs = 0.0\n\
         eval_every_epochs = 0\n",
        data.train, data.val
    );
    std::fs::write(root.path().join("job.toml"), job).expect("write job.toml");
    let port = free_tcp_and_udp_port().to_string();
    let mut command = Command::new(torchrun);
    command
        .args([
            "--nproc-per-node",
            "2",
            "--master-port",
            &port,
            "--no-python",
        ])
        .arg(env!("CARGO_BIN_EXE_imgrun"))
        .args(["train", "--config", "job.toml", "--no-plot"])
        .env_remove("IMGRUN_LOG")
        .env("IMGRUN_STATE_DIR", root.path().join("state"))
        .env("IMGRUN_LAUNCH__TIMEOUT_SECS", "60");
    let done = Job::spawn(command, root.path()).finish(JOB_LIMIT);
    assert!(done.status.success(), "{}", done.describe());
    for want in [
        "launch: all 2 processes joined",
        "replicas: identical on all 2 ranks",
        "the job's head stopped this node",
    ] {
        assert!(done.stdout.contains(want), "{want:?}:\n{}", done.describe());
    }
    assert!(
        !done.stderr.contains(" WARN ") && !done.stderr.contains(" ERROR "),
        "a normal end warned:\n{}",
        done.describe()
    );
}

#[test]
fn processes_started_as_srun_starts_them_train_one_job() {
    let root = tempfile::tempdir().expect("temp dir");
    let data = Dataset::synth(root.path());
    let port = common::free_udp_port();
    let finished = run_all(root.path(), &data, |r| {
        slurm(r, 2, port, std::process::id())
    });
    assert_trained_together(&finished);
}

#[test]
fn a_process_of_the_job_that_dies_fails_the_job_naming_its_node() {
    let root = tempfile::tempdir().expect("temp dir");
    let data = Dataset::synth(root.path());
    let port = common::free_udp_port();
    let id = format!("k{}", std::process::id());
    let mut leader = process(root.path(), &data, 0, &torchrun(0, 2, port, &id));
    let follower = process(root.path(), &data, 1, &torchrun(1, 2, port, &id));
    let run = root.path().join("runs/launched");
    common::train::wait_for_steps(&mut leader, &run, 2);
    let pid = common::pid_of(follower.pid()).expect("the follower's pid");
    kill_process(pid, Signal::KILL).expect("kill process 1");
    let done = leader.finish(JOB_LIMIT);
    assert!(!done.status.success(), "{}", done.describe());
    assert!(
        done.stderr.contains("node") && done.stderr.contains("rank 1"),
        "the job should name the rank and node it lost:\n{}",
        done.describe()
    );
    drop(follower);
}

/// A launch whose other processes never come: process 0 alone gives up after
/// `launch.timeout_secs`, saying how many joined and where the rendezvous file is, and
/// removes that file; a process other than 0 alone gives up saying it found no file.
#[test]
fn a_launch_whose_processes_never_meet_names_what_is_missing() {
    let root = tempfile::tempdir().expect("temp dir");
    let data = Dataset::synth(root.path());
    let port = common::free_udp_port();
    let alone = |rank: usize| {
        let mut vars = torchrun(rank, 2, port, &format!("alone-{rank}"));
        vars.push(("IMGRUN_LAUNCH__TIMEOUT_SECS".into(), "3".into()));
        let out = process(root.path(), &data, rank, &vars).finish(JOB_LIMIT);
        assert!(!out.status.success(), "{}", out.describe());
        out.stderr
    };
    let lead = alone(0);
    assert!(
        lead.contains("launch: 1 of 2 processes joined within 3 s (by host:")
            && lead.contains("torchrun-alone_0-127.0.0.1")
            && lead.contains(&format!("cannot reach UDP port {port} on 127.0.0.1")),
        "{lead}"
    );
    let rendezvous = root.path().join("runs").join(".rendezvous");
    let left: Vec<_> = std::fs::read_dir(&rendezvous)
        .map(|entries| entries.filter_map(Result::ok).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "rendezvous files left: {left:?}");
    let follower = alone(1);
    assert!(
        follower.contains("torchrun process 1 of 2 (local 1 of 2)")
            && follower.contains("could not join the job's head within 3 s")
            && follower.contains("does not exist yet"),
        "{follower}"
    );
}
