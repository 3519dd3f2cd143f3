//! End-to-end tests of remote loaders (`data.loaders = "remote"`): a trainer on one node
//! fed by a loader actor on the other, compared sample by sample with the same job on
//! local loader threads; and a loader actor killed mid-epoch, after which its trainer
//! runs the rest of the worker's epoch with no sample lost or repeated.

use std::collections::BTreeMap;
use std::time::Duration;

use rustix::process::{Signal, kill_process};

use crate::common;
use crate::common::train::{
    Finished, JOB_LIMIT, Job, TrainCluster, assert_each_sample_once, logged_samples, metrics,
    printed_resume_command, replica_digest, workers_of,
};
use crate::common::wait_for;

/// Every job here: split epochs (each sample once), one CPU trainer (on one node, all of
/// whose CPUs it reserves, so the loader actor goes to the other), two loader workers,
/// and the samples of every step.
const SETS: [&str; 4] = [
    "data.mode=\"split\"",
    "train.cpu_trainers=1",
    "data.loader_workers=2",
    "train.sample_log=true",
];

/// (epoch, step, rank) → the step's samples, from a run's `samples` records.
fn samples(cluster: &TrainCluster, name: &str) -> BTreeMap<(u64, u64, u64), Vec<String>> {
    metrics(&cluster.runs.join(name))
        .into_iter()
        .filter(|r| r["kind"] == "samples")
        .map(|r| {
            let at = (
                r["epoch"].as_u64().expect("epoch"),
                r["step"].as_u64().expect("step"),
                r["rank"].as_u64().expect("rank"),
            );
            let ids = r["samples"]
                .as_array()
                .expect("samples")
                .iter()
                .map(|s| s.as_str().expect("a sample id").to_string())
                .collect();
            (at, ids)
        })
        .collect()
}

/// The node a line of the output names after `prefix`, e.g. `trainer(s) on node 3:`.
fn node_after(finished: &Finished, prefix: &str) -> u64 {
    let line = finished
        .stdout
        .lines()
        .find(|l| l.contains(prefix))
        .unwrap_or_else(|| panic!("no line with {prefix:?}:\n{}", finished.describe()));
    let rest = &line[line.find(prefix).expect("found") + prefix.len()..];
    let digits: String = rest
        .trim_start()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("no node number in {line:?}"))
}

#[test]
fn remote_loaders_on_another_node_give_the_trainer_the_same_batches_as_local_ones() {
    let cluster = TrainCluster::start();
    let total: u64 = cluster.train_counts().iter().sum();
    let local = cluster.job("local", 2, &SETS, false).finish(JOB_LIMIT);
    assert!(local.status.success(), "{}", local.describe());
    let mut remote_sets = SETS.to_vec();
    remote_sets.push("data.loaders=\"remote\"");
    let remote = cluster
        .job("remote", 2, &remote_sets, false)
        .finish(JOB_LIMIT);
    assert!(remote.status.success(), "{}", remote.describe());

    let trainer_node = node_after(&remote, "trainer(s) on node");
    let loader_node = node_after(&remote, "loader actor(s) on node(s)");
    assert_ne!(
        trainer_node, loader_node,
        "the loader actor should run on the node the trainer left free:\n{}",
        remote.stdout
    );
    let (local_seen, remote_seen) = (samples(&cluster, "local"), samples(&cluster, "remote"));
    assert!(!local_seen.is_empty(), "no samples records");
    let records = metrics(&cluster.runs.join("local"));
    assert_each_sample_once(logged_samples(&records), 2, total);
    assert_eq!(
        remote_seen, local_seen,
        "the remote loaders served other batches"
    );
    assert_eq!(
        replica_digest(&remote.stdout),
        replica_digest(&local.stdout),
        "the same batches should train the same model"
    );
    cluster.assert_settled();
}

#[test]
fn a_loader_actor_killed_mid_epoch_loses_and_repeats_no_sample() {
    let cluster = TrainCluster::start();
    let total: u64 = cluster.train_counts().iter().sum();
    let epochs = 2;
    // A worker's epoch takes seconds, so the loader is killed with most of it ahead.
    let slow = cluster.data.slow_train_sets();
    let mut sets = SETS.to_vec();
    sets.extend(slow.iter().map(String::as_str));
    let local = cluster.job("local", epochs, &sets, false).finish(JOB_LIMIT);
    assert!(local.status.success(), "{}", local.describe());

    sets.push("data.loaders=\"remote\"");
    let mut job = cluster.job("killed", epochs, &sets, false);
    cluster.wait_for_steps(&mut job, "killed", 1);
    let daemons: Vec<u32> = [&cluster.head, &cluster.node]
        .iter()
        .flat_map(|m| m.daemon_pids())
        .collect();
    let loader = wait_for(
        Duration::from_secs(20),
        "the loader actor's process",
        || {
            daemons.iter().flat_map(|&d| workers_of(d)).find(|&pid| {
                std::fs::read(format!("/proc/{pid}/environ"))
                    .unwrap_or_default()
                    .split(|&b| b == 0)
                    .any(|v| v.starts_with(b"IMGRUN_WORKER_GROUP=load-"))
            })
        },
    );
    // Worker processes run with imgrun's malloc settings, or the user's own. (glibc parses
    // GLIBC_TUNABLES in place at start, turning its `:`s into NULs.)
    let tunables = std::env::var("GLIBC_TUNABLES").unwrap_or_else(|_| {
        "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824".to_owned()
    });
    let environ = String::from_utf8_lossy(
        &std::fs::read(format!("/proc/{loader}/environ")).unwrap_or_default(),
    )
    .replace('\0', ":");
    let environ = format!(":{environ}");
    assert!(
        environ.contains(&format!(":GLIBC_TUNABLES={tunables}:")),
        "the loader's worker has no GLIBC_TUNABLES={tunables}: {environ}"
    );
    let pid = common::pid_of(loader).expect("the loader's pid");
    kill_process(pid, Signal::KILL).expect("kill the loader");
    let killed = job.finish(JOB_LIMIT);
    assert!(killed.status.success(), "{}", killed.describe());
    let said = format!("{}{}", killed.stdout, killed.stderr);
    let lost: Vec<&str> = said.lines().filter(|l| l.contains("was lost")).collect();
    for line in &lost {
        eprintln!("{line}");
    }
    // Lost mid-stream: a channel that broke, not one that could not be opened.
    assert!(
        lost.iter().any(
            |l| l.contains("goes on in the trainer's process") && !l.contains("cannot connect")
        ),
        "the job should say that the loader was lost mid-epoch and what happened:\n{}",
        killed.describe()
    );
    let (local_seen, killed_seen) = (samples(&cluster, "local"), samples(&cluster, "killed"));
    let records = metrics(&cluster.runs.join("killed"));
    assert_each_sample_once(logged_samples(&records), epochs, total);
    assert_eq!(
        killed_seen, local_seen,
        "the batches after the loss should be the ones the loader would have sent"
    );
    cluster.assert_settled();
}

#[test]
fn a_job_stopped_with_remote_loaders_resumes_with_local_ones_on_the_same_samples() {
    let cluster = TrainCluster::start();
    let total: u64 = cluster.train_counts().iter().sum();
    let epochs = 2;
    let slow = cluster.data.slow_train_sets();
    let mut sets = SETS.to_vec();
    sets.extend(slow.iter().map(String::as_str));
    let whole = cluster.job("whole", epochs, &sets, false).finish(JOB_LIMIT);
    assert!(whole.status.success(), "{}", whole.describe());

    sets.push("data.loaders=\"remote\"");
    let mut job = cluster.job("cut", epochs, &sets, false);
    cluster.wait_for_steps(&mut job, "cut", 2);
    job.signal(Signal::INT);
    let cut = job.finish(JOB_LIMIT);
    assert_eq!(cut.status.code(), Some(130), "{}", cut.describe());
    let run = cluster.runs.join("cut");
    let command = printed_resume_command(&cut.stderr, &run);
    cluster.assert_settled();

    // The same run, continued with the loaders in the trainer's process.
    let command = format!("{command} --set 'data.loaders=\"local\"'");
    let resumed = Job::start_shell(&cluster.head, &command, cluster.root.path()).finish(JOB_LIMIT);
    assert!(resumed.status.success(), "{}", resumed.describe());
    let (whole_seen, cut_seen) = (samples(&cluster, "whole"), samples(&cluster, "cut"));
    let records = metrics(&cluster.runs.join("cut"));
    assert_each_sample_once(logged_samples(&records), epochs, total);
    assert_eq!(
        cut_seen, whole_seen,
        "a run stopped and resumed elsewhere should see the uninterrupted run's samples"
    );
    cluster.assert_settled();
}
