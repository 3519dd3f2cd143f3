//! Elastic jobs (`train.elastic`) on three nodes that lose a trainer (SIGKILL, a crash
//! right after a gradient average, a second loss while the ring forms again, a paused
//! node daemon, a partition) and go on, grow back at an epoch's start, or fall below
//! their minimum world; each sample of every epoch served once.

use std::time::Instant;

use runtime::FAILPOINTS_VARIABLE;
use rustix::process::{Signal, kill_process};
use serde_json::Value;

use crate::common;
use crate::common::train::{
    Dataset, JOB_LIMIT, Job, SETTLE_LIMIT, TrainCluster, assert_each_sample_once,
    assert_steps_run_on, checkpoint_dir, last_step_value, logged_samples, metrics, read_json,
    workers_of,
};
use crate::common::{Netns, is_running, node_states, pid_of, wait_for};

/// Elastic training (`train.elastic`): three CPU trainers on three nodes, split epochs
/// whose shards come through a command that waits a second before each, so an epoch
/// stalls in its middle. At the first step of epoch 1, one trainer's process is
/// SIGKILLed. The job goes on with the other two without a checkpoint; at the next
/// epoch's start, the node the trainer ran on has room again and the job grows back to
/// three (the new trainer takes the model and optimiser state from rank 0). The job
/// finishes, the per-sample log shows every sample of every epoch served exactly once
/// (the lost rank's unread samples by the survivors, none twice), the global steps run
/// on without a gap or a repeat, and the three replicas agree at the end.
#[test]
fn an_elastic_job_that_loses_a_trainer_mid_epoch_goes_on_grows_back_and_serves_each_sample_once() {
    let cluster = TrainCluster::start_with(1);
    let total: u64 = cluster.train_counts().iter().sum();
    let sets = cluster.data.audited_elastic_sets(&["train.min_world=2"]);
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    let epochs = 4;
    let mut job = cluster.job("elastic", epochs, &sets, false);
    let run = cluster.runs.join("elastic");
    wait_for(JOB_LIMIT, "the first step of epoch 1", || {
        assert!(
            job.running(),
            "the job ended early:\n{}",
            job.finish(JOB_LIMIT).describe()
        );
        std::fs::read_to_string(run.join("metrics.jsonl"))
            .ok()?
            .contains("\"kind\":\"step\",\"epoch\":1,")
            .then_some(())
    });
    let daemon = cluster.node.daemon_pids();
    let workers = workers_of(daemon[0]);
    assert_eq!(workers.len(), 1, "one trainer on the node: {workers:?}");
    let killed_at = Instant::now();
    kill_process(pid_of(workers[0]).expect("pid"), Signal::KILL).expect("kill -9");
    let lost = assert_timeline_of_a_loss_and_a_growth(&cluster, &mut job);
    assert_a_replaced_trainers_lines_are_kept(&cluster, &mut job, lost);
    let out = job.finish(JOB_LIMIT);
    eprintln!(
        "trainer killed: the job ended {:?} later",
        killed_at.elapsed()
    );
    assert!(out.status.success(), "{}", out.describe());
    let said = format!("{}{}", out.stdout, out.stderr);
    assert!(said.contains("elastic: lost rank(s)"), "{}", out.describe());
    assert!(
        said.contains("replicas: identical on all 3 ranks"),
        "{}",
        out.describe()
    );
    let records = metrics(&run);
    let regroups: Vec<&Value> = records.iter().filter(|r| r["kind"] == "regroup").collect();
    eprintln!("regrouped: {regroups:?}");
    assert_eq!(regroups.len(), 2, "a shrink, then a growth: {regroups:?}");
    let (shrink, growth) = (regroups[0], regroups[1]);
    assert_eq!(shrink["world"], 2, "{shrink}");
    assert_eq!(shrink["lost"].as_array().map(Vec::len), Some(1), "{shrink}");
    assert_eq!(growth["world"], 3, "{growth}");
    assert_eq!(growth["lost"].as_array().map(Vec::len), Some(0), "{growth}");
    assert_eq!(
        growth["step_in_epoch"], 0,
        "grown at an epoch's start: {growth}"
    );
    assert_eq!(growth["epoch"], 2, "{growth}");
    // Every epoch: each sample exactly once over every step and rank, before the loss
    // and after it.
    assert_each_sample_once(logged_samples(&records), epochs, total);
    // The steps after the loss go on from where every rank had completed.
    assert_steps_run_on(&records);
    cluster.assert_settled();
}

/// The running job's timeline, as its coordinator keeps it for `imgrun jobs --json` and
/// the dashboard (an attached job's coordinator ends with it, so it is read while the
/// job runs): the ring of three, one rank lost, the shrink to two and the growth back to
/// three (checkpoints between them left out). Returns the rank lost.
fn assert_timeline_of_a_loss_and_a_growth(cluster: &TrainCluster, job: &mut Job) -> u64 {
    let listed = wait_for(JOB_LIMIT, "the timeline's growth back to three", || {
        assert!(
            job.running(),
            "the job ended before its timeline was read:\n{}",
            job.finish(JOB_LIMIT).describe()
        );
        let out = cluster.head.run(&["jobs", "elastic", "--json"]);
        let listed: Value = serde_json::from_slice(&out.stdout).ok()?;
        let grown = listed["job"]["timeline"]
            .as_array()?
            .iter()
            .any(|moment| moment["kind"] == "regrouped" && moment["world"] == 3);
        grown.then_some(listed)
    });
    let timeline = listed["job"]["timeline"].as_array().expect("timeline");
    let moments: Vec<(String, Option<u64>, Option<u64>)> = timeline
        .iter()
        .filter(|moment| moment["kind"] != "checkpoint")
        .map(|moment| {
            let kind = moment["kind"].as_str().unwrap_or("").to_owned();
            match kind.as_str() {
                "lost" => (
                    kind,
                    moment["ranks"].as_array().map(|r| r.len() as u64),
                    None,
                ),
                _ => (
                    kind,
                    moment["from_world"].as_u64(),
                    moment["world"].as_u64(),
                ),
            }
        })
        .collect();
    let expected = [
        ("started", None, Some(3)),
        ("lost", Some(1), None),
        ("regrouped", Some(3), Some(2)),
        ("regrouped", Some(2), Some(3)),
    ]
    .map(|(kind, a, b)| (kind.to_owned(), a, b));
    assert_eq!(moments, expected, "{listed}");
    timeline
        .iter()
        .find(|moment| moment["kind"] == "lost")
        .and_then(|moment| moment["ranks"][0].as_u64())
        .unwrap_or_else(|| panic!("the lost rank: {listed}"))
}

/// A rank's log by attempt, while the job runs on: the lost rank's trainer was killed
/// (its process, SIGKILL) on a node whose daemon lives on, and its rank is held by another
/// trainer since the regroup and the growth; `imgrun logs --rank R --attempt 0` still
/// shows what the killed one wrote (its `trainer ready` in the world of three), its
/// current attempt other lines, and an attempt the rank never had is a clear error.
fn assert_a_replaced_trainers_lines_are_kept(cluster: &TrainCluster, job: &mut Job, rank: u64) {
    assert!(
        job.running(),
        "the job ended before its ranks' logs were read:\n{}",
        job.finish(JOB_LIMIT).describe()
    );
    let rank = rank.to_string();
    let logs = |attempt: Option<&str>| {
        let mut args = vec!["logs", "elastic", "--rank", &rank, "--lines", "1000"];
        args.extend(
            attempt
                .map(|attempt| ["--attempt", attempt])
                .into_iter()
                .flatten(),
        );
        let out = cluster.head.run(&args);
        assert!(out.status.success(), "{args:?}: {}", common::describe(&out));
        let said = String::from_utf8_lossy(&out.stderr).into_owned();
        (String::from_utf8_lossy(&out.stdout).into_owned(), said)
    };
    let (first, said) = logs(Some("0"));
    let ready = format!("trainer ready rank={rank} world=3");
    assert!(
        first.contains(&ready),
        "attempt 0 of rank {rank} lacks {ready:?}:\n{first}"
    );
    assert!(
        said.contains(&format!("rank {rank}: attempt 0 of ")),
        "which attempt: {said}"
    );
    let (current, said) = logs(None);
    assert!(
        said.contains(&format!("rank {rank}: attempt ")) && !said.contains("attempt 0 of"),
        "the current attempt is a later one: {said}"
    );
    assert_ne!(first, current, "the current trainer's lines are its own");
    let out = cluster
        .head
        .run(&["logs", "elastic", "--rank", &rank, "--attempt", "9"]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && said.contains(&format!("rank {rank} has no attempt 9")),
        "{}",
        common::describe(&out)
    );
}

/// A trainer that crashes right after a gradient average (a failpoint: its process
/// exits once every rank has the step's average, before it steps): the survivors have
/// stepped, go on into the next step and fail there, and roll back the steps of the
/// failed call, so that the step in flight is dropped by all alike. The job goes on
/// without the lost rank and grows back at the next epoch (where the new trainer, in the
/// same daemon's environment, crashes at its own 9th step); every sample of every epoch
/// is still served once, the global steps run on without a gap or a repeat, and the
/// replicas agree at the end.
#[test]
fn an_elastic_job_drops_the_step_a_crashed_rank_took_part_in_on_every_survivor() {
    let failpoint = [(FAILPOINTS_VARIABLE, "trainer.after_average=exit@9")];
    let cluster = TrainCluster::start_with_env(1, &failpoint);
    let total: u64 = cluster.train_counts().iter().sum();
    let sets = [
        "data.mode=\"split\"",
        "train.elastic=true",
        "train.sample_log=true",
    ];
    let epochs = 4;
    let out = cluster.job("crash", epochs, &sets, false).finish(JOB_LIMIT);
    assert!(out.status.success(), "{}", out.describe());
    let records = metrics(&cluster.runs.join("crash"));
    let regroups: Vec<&Value> = records.iter().filter(|r| r["kind"] == "regroup").collect();
    eprintln!("regrouped: {regroups:?}");
    let shrink = regroups.first().expect("a regroup record");
    assert_eq!(shrink["lost"].as_array().map(Vec::len), Some(1), "{shrink}");
    assert!(
        shrink["step"].as_u64().is_some_and(|s| s < 9),
        "the job goes on from before the crashed step: {shrink}"
    );
    assert_each_sample_once(logged_samples(&records), epochs, total);
    assert_steps_run_on(&records);
    // The trainer that grew back on the node crashes at its own 9th step too.
    let world = regroups
        .last()
        .and_then(|r| r["world"].as_u64())
        .unwrap_or(0);
    assert!(
        out.stdout
            .contains(&format!("replicas: identical on all {world} ranks")),
        "{}",
        out.describe()
    );
    cluster.assert_settled();
}

/// An elastic job that falls below `train.min_world` fails, with a checkpoint at the
/// last step every rank completed, and `--resume` continues from it.
#[test]
fn an_elastic_job_below_its_minimum_world_fails_with_a_checkpoint_it_resumes_from() {
    let cluster = TrainCluster::start();
    let slow = cluster.data.slow_train_sets();
    let sets = [
        "data.mode=\"split\"",
        "train.elastic=true",
        "train.min_world=2",
        slow[0].as_str(),
        slow[1].as_str(),
    ];
    let mut job = cluster.job("small", 3, &sets, false);
    cluster.wait_for_steps(&mut job, "small", 2);
    let workers = workers_of(cluster.node.daemon_pids()[0]);
    assert_eq!(workers.len(), 1, "one trainer on the node: {workers:?}");
    kill_process(pid_of(workers[0]).expect("pid"), Signal::KILL).expect("kill -9");
    let out = job.finish(JOB_LIMIT);
    assert!(!out.status.success(), "{}", out.describe());
    let error = &out.stderr;
    assert!(
        error.contains("fewer than train.min_world = 2") && error.contains("--resume"),
        "{}",
        out.describe()
    );
    let run = cluster.runs.join("small");
    let last = last_step_value(&metrics(&run))
        .and_then(|v| v.as_u64())
        .expect("a step record");
    let state = read_json(&checkpoint_dir(&run).join("state.json"));
    assert_eq!(
        state["global_step"].as_u64(),
        Some(last),
        "the checkpoint is not at the last step every rank completed: {state}"
    );
    eprintln!("checkpoint at step {last}:\n{error}");
    let resumed = cluster
        .job_with(
            "small",
            3,
            &sets,
            false,
            &["--resume".to_string(), run.display().to_string()],
        )
        .finish(JOB_LIMIT);
    assert!(resumed.status.success(), "{}", resumed.describe());
    cluster.assert_settled();
}

/// A survivor that crashes while an elastic job re-forms its ring after a loss (a
/// failpoint: its second `connect`, the first after the loss): the other survivor
/// outlives the failed ring, the job finds the second loss as it found the first and
/// goes on alone, then grows back to three at the next epoch. Every sample of every
/// epoch is still served once, the global steps run on, the replicas agree.
#[test]
fn an_elastic_job_that_loses_a_survivor_while_its_ring_forms_again_goes_on() {
    let failpoint = [(FAILPOINTS_VARIABLE, "trainer.connect=exit@2")];
    let cluster = TrainCluster::start_with_env(1, &failpoint);
    let total: u64 = cluster.train_counts().iter().sum();
    let sets = cluster.data.audited_elastic_sets(&[]);
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    let epochs = 3;
    let mut job = cluster.job("twice", epochs, &sets, false);
    cluster.wait_for_steps(&mut job, "twice", 2);
    // The trainer on the third node is lost; the one on `node` crashes rejoining.
    let workers = workers_of(cluster.more[0].daemon_pids()[0]);
    assert_eq!(
        workers.len(),
        1,
        "one trainer on the third node: {workers:?}"
    );
    kill_process(pid_of(workers[0]).expect("pid"), Signal::KILL).expect("kill -9");
    let out = job.finish(JOB_LIMIT);
    assert!(out.status.success(), "{}", out.describe());
    assert!(
        out.stdout.contains("replicas: identical on all 3 ranks"),
        "{}",
        out.describe()
    );
    let records = metrics(&cluster.runs.join("twice"));
    let regroups: Vec<&Value> = records.iter().filter(|r| r["kind"] == "regroup").collect();
    eprintln!("regrouped: {regroups:?}");
    let worlds: Vec<u64> = regroups
        .iter()
        .filter_map(|r| r["world"].as_u64())
        .collect();
    assert_eq!(
        worlds,
        [2, 1, 3],
        "two shrinks, then a growth: {regroups:?}"
    );
    assert_eq!(
        regroups[0]["lost"],
        serde_json::json!([2]),
        "{}",
        regroups[0]
    );
    // Ranks of the world of two: the crashed one was its rank 1.
    assert_eq!(
        regroups[1]["lost"],
        serde_json::json!([1]),
        "{}",
        regroups[1]
    );
    assert_eq!(regroups[0]["step"], regroups[1]["step"], "{regroups:?}");
    assert_each_sample_once(logged_samples(&records), epochs, total);
    assert_steps_run_on(&records);
    cluster.assert_settled();
}

/// An elastic job whose node daemon is paused (SIGSTOP; its trainer's process runs on,
/// unsupervised): the head declares the node lost after its window, the other rank goes
/// on alone to the end, each sample of every epoch once. Resumed afterwards, the node
/// kills the old trainer (fencing) before it counts as free again.
#[test]
fn an_elastic_job_whose_node_daemon_is_paused_goes_on_and_the_node_comes_back_fenced() {
    let cluster = TrainCluster::start();
    let total: u64 = cluster.train_counts().iter().sum();
    let sets = cluster.data.audited_elastic_sets(&[]);
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    let epochs = 3;
    let mut job = cluster.job("paused", epochs, &sets, false);
    cluster.wait_for_steps(&mut job, "paused", 2);
    let daemon = cluster.node.daemon_pids();
    assert_eq!(daemon.len(), 1, "one daemon on the node");
    let workers = workers_of(daemon[0]);
    assert_eq!(workers.len(), 1, "one trainer on the node: {workers:?}");
    let signal = |signal: Signal| {
        kill_process(pid_of(daemon[0]).expect("pid"), signal).expect("signal the daemon");
    };
    signal(Signal::STOP);
    // Resumed whatever happens below, so that the cluster can be stopped.
    struct Resume<F: Fn(Signal)>(F);
    impl<F: Fn(Signal)> Drop for Resume<F> {
        fn drop(&mut self) {
            (self.0)(Signal::CONT);
        }
    }
    let resume = Resume(signal);
    let paused_at = Instant::now();
    let out = job.finish(JOB_LIMIT);
    eprintln!(
        "daemon paused: the job ended {:?} later",
        paused_at.elapsed()
    );
    assert!(out.status.success(), "{}", out.describe());
    assert!(
        out.stdout.contains("replicas: identical on all 1 ranks"),
        "{}",
        out.describe()
    );
    let records = metrics(&cluster.runs.join("paused"));
    let regroups: Vec<&Value> = records.iter().filter(|r| r["kind"] == "regroup").collect();
    eprintln!("regrouped: {regroups:?}");
    assert_eq!(regroups.len(), 1, "a shrink, no growth: {regroups:?}");
    assert_eq!(regroups[0]["world"], 1, "{}", regroups[0]);
    let cause = regroups[0]["cause"].as_str().unwrap_or_default();
    let node = format!("node {}", cluster.node_id);
    assert!(
        cause.contains(&node),
        "the paused {node} is not named: {cause}"
    );
    assert_each_sample_once(logged_samples(&records), epochs, total);
    assert_steps_run_on(&records);
    drop(resume);
    wait_for(
        SETTLE_LIMIT,
        "the node alive again and its trainer gone",
        || {
            let alive = node_states(&cluster.head.status())
                .iter()
                .any(|(id, s)| *id == cluster.node_id && s == "alive");
            (alive && !workers.iter().any(|&w| is_running(w))).then_some(())
        },
    );
    cluster.assert_settled();
}

/// An elastic job whose node is cut off by a partition (the veth link between the
/// head's and the node's network namespaces goes down: no packet answered, no link
/// closed): the survivor, waiting in the ring for a peer that will not answer, is
/// aborted out of it once the head declares the node lost, and trains on alone to the
/// end, each sample of every epoch once. Needs root and `ip`.
#[test]
fn an_elastic_job_cut_off_from_a_node_by_a_partition_goes_on_without_it() {
    let net = match Netns::create() {
        Ok(net) => net,
        Err(missing) => return common::skip::skip_or_fail(&missing),
    };
    let root = tempfile::tempdir().expect("temp dir");
    let (head, _node, _) = net.cluster(root.path());
    let data = Dataset::synth(root.path());
    let runs = root.path().join("runs");
    let epochs = 4;
    let mut args = data.args(&runs, "cut", epochs);
    let slow = data.slow_train_sets();
    for set in [
        "data.mode=\"split\"",
        "train.elastic=true",
        "train.sample_log=true",
        &slow[0],
        &slow[1],
    ] {
        args.extend(["--set".to_string(), set.to_string()]);
    }
    let mut job = Job::start(&head, &args, root.path());
    common::train::wait_for_steps(&mut job, &runs.join("cut"), 2);
    net.cut();
    let cut_at = Instant::now();
    let out = job.finish(JOB_LIMIT);
    eprintln!("link cut: the job ended {:?} later", cut_at.elapsed());
    assert!(out.status.success(), "{}", out.describe());
    assert!(
        out.stdout.contains("replicas: identical on all 1 ranks"),
        "{}",
        out.describe()
    );
    let records = metrics(&runs.join("cut"));
    let regroup = records
        .iter()
        .find(|r| r["kind"] == "regroup")
        .unwrap_or_else(|| panic!("no regroup record:\n{}", out.describe()));
    eprintln!("regrouped: {regroup}");
    assert_eq!(regroup["world"], 1, "{regroup}");
    let total: u64 = {
        let manifest = read_json(&data.train_dir.join("manifest.json"));
        manifest["shards"]
            .as_array()
            .expect("shards")
            .iter()
            .map(|s| s["samples"].as_u64().expect("samples"))
            .sum()
    };
    assert_each_sample_once(logged_samples(&records), epochs, total);
    net.restore();
    head.run_ok(&["stop", "--all"]);
}
