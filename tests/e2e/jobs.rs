//! End-to-end tests of jobs that run in the cluster: `imgrun train --detach` submits a
//! job to a head and a joined node (background daemons on loopback), its coordinator runs
//! it there, and `imgrun jobs`, `imgrun logs` and `imgrun cancel` reach it from separate
//! processes. Every wait is bounded; each test checks that nothing is left running.

use std::time::Duration;

use rustix::process::Signal;
use serde_json::Value;

use crate::common;
use crate::common::train::{
    Dataset, JOB_LIMIT, Job, TrainCluster, assert_checkpoint_at_last_step, metrics, workers_of,
};
use crate::common::{describe, wait_for};

/// Steps recorded so far in the run `name`'s metrics.
fn steps_of(cluster: &TrainCluster, name: &str) -> usize {
    metrics(&cluster.runs.join(name))
        .iter()
        .filter(|r| r["kind"] == "step")
        .count()
}

fn submit(cluster: &TrainCluster, name: &str, epochs: u64, sets: &[&str]) -> String {
    let mut args = cluster.data.args(&cluster.runs, name, epochs);
    for set in sets {
        args.extend(["--set".to_string(), set.to_string()]);
    }
    args.push("--detach".to_string());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    cluster.head.run_ok(&args)
}

/// The jobs of `jobs --json`: each its `name`, its coordinator's status (`job`) and its
/// `ranks`.
fn jobs(cluster: &TrainCluster) -> Vec<Value> {
    let out = cluster.head.run_ok(&["jobs", "--json"]);
    serde_json::from_str::<Value>(&out)
        .expect("jobs --json")
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// A detached job runs in the cluster and outlives the commands around it:
/// `imgrun train --detach` returns at once, `imgrun jobs` lists the job, `imgrun logs
/// --follow` prints the job's tables to its end; the ended job's coordinator hands it to
/// the cluster's job archive, which answers for it (`jobs`, `logs`, `plot`, a second job
/// of its name refused); a follower killed mid-job does not stop a second job, which
/// `imgrun cancel` then stops with a checkpoint at its last step. Cancelling the finished
/// job removes it from the archive, and nothing is left running.
#[test]
fn a_detached_job_is_listed_followed_and_cancelled_with_a_checkpoint() {
    let cluster = TrainCluster::start();
    let said = submit(&cluster, "detached", 2, &[]);
    assert!(said.contains("job detached submitted"), "{said}");
    assert!(said.contains("imgrun logs detached --follow"), "{said}");
    let listed = jobs(&cluster);
    assert!(
        listed.iter().any(|j| j["name"] == "detached"),
        "not listed: {listed:?}"
    );

    let mut follower = Job::start(
        &cluster.head,
        &["logs", "detached", "--follow"].map(String::from),
        cluster.root.path(),
    );
    let out = follower.finish(JOB_LIMIT);
    assert!(out.status.success(), "{}", out.describe());
    for words in [
        "train loss",
        "trainers: 2 up",
        "replicas: identical on all 2 ranks",
    ] {
        assert!(
            out.stdout.contains(words),
            "`{words}` not in:\n{}",
            out.describe()
        );
    }
    assert!(
        out.stderr.contains("done: validation top-1"),
        "{}",
        out.describe()
    );
    let archived = archived_by(&cluster, "detached");
    let finished = jobs(&cluster);
    let job = finished
        .iter()
        .find(|j| j["name"] == "detached")
        .expect("a finished job stays listed");
    assert_eq!(job["job"]["state"], "succeeded", "{job}");
    assert_eq!(
        job["job"], archived,
        "the archive keeps the status the job ended with"
    );
    // The archive answers for it: its log, its own page of `jobs`, and its name.
    let out = cluster.head.run(&["logs", "detached"]);
    assert!(out.status.success(), "{}", describe(&out));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("replicas: identical"), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("done: validation top-1"),
        "{}",
        describe(&out)
    );
    let one: Value =
        serde_json::from_str(&cluster.head.run_ok(&["jobs", "detached", "--json"])).expect("json");
    assert_eq!(one["job"]["timeline"], archived["timeline"]);
    assert_eq!(one["ranks"], serde_json::json!([]));
    let mut again = cluster.data.args(&cluster.runs, "detached", 1);
    again.push("--detach".to_string());
    let again: Vec<&str> = again.iter().map(String::as_str).collect();
    let out = cluster.head.run(&again);
    assert!(!out.status.success(), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("already has a job named `detached`"),
        "{}",
        describe(&out)
    );
    assert!(steps_of(&cluster, "detached") > 0);
    // Its metrics are drawn from anywhere: the coordinator sends them.
    let png = cluster.root.path().join("detached.png");
    let png_arg = png.display().to_string();
    let drawn = cluster
        .head
        .run_ok(&["plot", "detached", "--out", png_arg.as_str()]);
    assert!(drawn.contains(" steps, "), "{drawn}");
    assert!(std::fs::metadata(&png).is_ok_and(|m| m.len() > 1000));
    let out = cluster.head.run(&["plot", "nowhere"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("neither a run folder here nor a job"),
        "{}",
        describe(&out)
    );

    // A long job, followed by a process that is then killed: the job goes on.
    submit(&cluster, "long", 200, &[]);
    let mut follower = Job::start(
        &cluster.head,
        &["logs", "long", "--follow"].map(String::from),
        cluster.root.path(),
    );
    wait_for(JOB_LIMIT, "steps of the long job", || {
        (steps_of(&cluster, "long") >= 3).then_some(())
    });
    follower.signal(Signal::KILL);
    let _ = follower.finish(Duration::from_secs(10));
    let before = steps_of(&cluster, "long");
    wait_for(
        JOB_LIMIT,
        "the long job going on without its follower",
        || (steps_of(&cluster, "long") > before + 2).then_some(()),
    );

    let out = cluster.head.run(&["cancel", "long"]);
    assert!(out.status.success(), "{}", describe(&out));
    let said = String::from_utf8_lossy(&out.stdout);
    for words in ["interrupted by cancel", "continue with --resume"] {
        assert!(
            said.contains(words),
            "`{words}` not in:\n{}",
            describe(&out)
        );
    }
    assert_checkpoint_at_last_step(&cluster.runs.join("long"));
    let left = jobs(&cluster);
    assert!(
        left.iter().all(|j| j["name"] != "long"),
        "a cancelled job is removed: {left:?}"
    );

    let out = cluster.head.run(&["cancel", "detached"]);
    assert!(out.status.success(), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("had already succeeded; removed"),
        "{}",
        describe(&out)
    );
    assert!(jobs(&cluster).is_empty());
    let out = cluster.head.run(&["logs", "nope"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no job named `nope`"),
        "{}",
        describe(&out)
    );
    cluster.assert_settled();
    let daemons = cluster.head.daemon_pids();
    assert!(daemons.iter().all(|&d| workers_of(d).is_empty()));
}

/// Waits until the ended job `name`'s coordinator has handed it to the cluster's job
/// archive and ended: the head lists no coordinator of it, and an archive. Its status, as
/// `jobs --json` shows it then.
fn archived_by(cluster: &TrainCluster, name: &str) -> Value {
    let limit = Duration::from_secs(60);
    wait_for(limit, "the ended job's coordinator to hand it over", || {
        let out = cluster.head.run_ok(&["status", "--json"]);
        let status: Value = serde_json::from_str(&out).expect("status --json");
        let actors = status["actors"].as_array().cloned().unwrap_or_default();
        let coordinator = actors
            .iter()
            .any(|a| a["kind"] == "job" && a["job"] == name);
        let archive = actors.iter().any(|a| a["kind"] == "job-archive");
        assert!(archive, "the head runs a job archive: {status}");
        let job = status["jobs"]
            .as_array()
            .and_then(|jobs| jobs.iter().find(|j| j["name"] == name).cloned());
        job.filter(|_| !coordinator).map(|job| job["job"].clone())
    })
}

/// Without a running cluster there is nothing to detach to: the command says how to
/// start one, and nothing runs.
#[test]
fn detach_without_a_cluster_says_how_to_start_one() {
    let root = tempfile::tempdir().expect("temp dir");
    let machine = common::Machine::new(root.path(), "alone");
    let data = Dataset::synth(root.path());
    let mut args = data.args(&root.path().join("runs"), "alone", 1);
    args.push("--detach".to_string());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = machine.run(&args);
    assert!(!out.status.success(), "{}", describe(&out));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("imgrun start --head"), "{}", describe(&out));
}
