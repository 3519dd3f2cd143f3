//! Training at its simplest: two CPU trainers on two nodes learn, evaluate, agree and
//! checkpoint; bad configuration is refused before anything starts.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::steps;
use crate::common::Machine;
use crate::common::train::{
    Dataset, JOB_LIMIT, Job, TrainCluster, checkpoint_dir, last_step_value, metrics, read_json,
    workers_of,
};

/// Two trainers on two daemons learn, evaluate, agree bit for bit, checkpoint and plot.
#[test]
fn two_cpu_trainers_on_two_nodes_learn_agree_and_checkpoint() {
    let cluster = TrainCluster::start();
    let mut job = cluster.job("first", 3, &[], true);
    let mut on_daemons = BTreeMap::new();
    // Where the trainers run, seen in the process tree while the job goes on.
    let deadline = Instant::now() + JOB_LIMIT;
    while job.running() && Instant::now() < deadline {
        for (name, machine) in [("head", &cluster.head), ("node", &cluster.node)] {
            for daemon in machine.daemon_pids() {
                for worker in workers_of(daemon) {
                    on_daemons.insert(worker, name);
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = job.finish(JOB_LIMIT);
    assert!(out.status.success(), "{}", out.describe());
    let printed = &out.stdout;
    assert!(
        printed.contains(&format!("cluster: head at {}", cluster.join.0)),
        "{printed}"
    );
    assert!(
        printed.contains(&format!(
            "2 CPU trainer(s) on node {}, node {}: 2 node(s) x 1 rank(s)",
            cluster.head_id, cluster.node_id
        )),
        "{printed}"
    );
    assert!(
        printed.contains("replicas: identical on all 2 ranks"),
        "{printed}"
    );
    // CPU trainers average through the ring, and say so.
    assert!(
        printed.contains("gradients averaged with imgrun's ring"),
        "{printed}"
    );
    let mut hosts: Vec<&str> = on_daemons.values().copied().collect();
    hosts.sort_unstable();
    assert_eq!(hosts, ["head", "node"], "one worker under each daemon");

    let run = cluster.runs.join("first");
    let records = metrics(&run);
    for kind in ["job", "connect", "step", "eval", "epoch"] {
        assert!(
            records.iter().any(|r| r["kind"] == kind),
            "no {kind} record in {}",
            run.display()
        );
    }
    assert_steps_have_their_own_figures(&records);
    let losses: Vec<f64> = steps(&records).into_values().collect();
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (first, last) = (mean(&losses[..5]), mean(&losses[losses.len() - 5..]));
    eprintln!("loss: first 5 steps {first:.4}, last 5 steps {last:.4}");
    assert!(last < first, "the loss did not decrease: {losses:?}");
    assert_eq!(
        records.iter().filter(|r| r["kind"] == "epoch").count(),
        3,
        "one epoch record per epoch"
    );
    let eval = records.iter().rfind(|r| r["kind"] == "eval").expect("eval");
    assert_eq!(eval["samples"], 60, "every validation sample once: {eval}");

    let latest = checkpoint_dir(&run);
    for file in ["model.ot", "optimizer.ot", "state.json"] {
        let size = std::fs::metadata(latest.join(file)).map_or(0, |m| m.len());
        assert!(size > 0, "{} has no {file}", latest.display());
    }
    let state = read_json(&latest.join("state.json"));
    assert_eq!(state["epoch"], 3, "{state}");
    assert_eq!(
        Some(state["global_step"].clone()),
        last_step_value(&records)
    );
    let png = std::fs::read(run.join("metrics.png")).expect("metrics.png");
    assert!(png.starts_with(b"\x89PNG"), "metrics.png is not a PNG");

    cluster.assert_settled();
}

/// Bad input is refused before anything runs, with a message that names it.
#[test]
fn bad_input_is_refused_with_a_clear_error() {
    let root = tempfile::tempdir().expect("temp dir");
    // No cluster: every case must fail before one is needed.
    let lonely = Machine::new(root.path(), "lonely");
    let data = Dataset::synth(root.path());
    let missing = root.path().join("missing/x-{000..003}.tar");
    let missing = format!("data.train={:?}", missing.display().to_string());
    let cases: [(&str, &str, &[&str]); 15] = [
        ("unknown key", "train.epoch=3", &["train.epoch", "epochs"]),
        (
            "empty training set",
            "data.train=",
            &["data.train is empty"],
        ),
        (
            "a spec naming no shards",
            "data.train=::",
            &["data.train", "names no shards"],
        ),
        (
            "unbalanced braces",
            "data.train=a-{0..3.tar",
            &["data.train", "unbalanced braces"],
        ),
        (
            "shards that do not exist",
            &missing,
            &["no such shard", "missing/x-000.tar", "4 of the 4"],
        ),
        (
            "a model name typo",
            "model.name=resnet5O",
            &["model.name", "resnet5O", "small_cnn"],
        ),
        ("a mode typo", "data.mode=splitt", &["data.mode", "splitt"]),
        (
            "a loss scaling typo",
            "train.loss_scaling=static",
            &["train.loss_scaling", "static", "dynamic"],
        ),
        (
            "a precision typo",
            "train.precision=fp16",
            &["train.precision", "fp16", "fp32", "amp", "bf16"],
        ),
        (
            "a channels_last that is not a boolean",
            "train.channels_last=sometimes",
            &["train.channels_last"],
        ),
        (
            "a scale that is not positive",
            "train.loss_scale_init=0.0",
            &["train.loss_scale_init", "positive"],
        ),
        (
            "an allreduce typo",
            "train.allreduce=mpi",
            &["train.allreduce", "mpi", "nccl"],
        ),
        (
            "an epoch smaller than a batch on each rank",
            "data.epoch_size=10",
            &["no samples to train on"],
        ),
        (
            "a learning rate that is not a number",
            "train.lr=nan",
            &["train.lr", "out of range"],
        ),
        (
            "an image size no memory holds",
            "data.image_size=100000",
            &["data.image_size", "4096"],
        ),
    ];
    let runs = root.path().join("runs");
    for (what, set, words) in cases {
        let mut args = data.args(&runs, "bad", 1);
        args.extend(["--set".to_string(), set.to_string()]);
        let out = Job::start(&lonely, &args, root.path()).finish(Duration::from_secs(30));
        assert!(!out.status.success(), "{what}: {}", out.describe());
        for word in words {
            assert!(
                out.stderr.contains(word),
                "{what}: `{word}` not in:\n{}",
                out.stderr
            );
        }
        assert!(
            !runs.join("bad").exists(),
            "{what}: a run folder was made for a refused job"
        );
    }
}

/// Each step record has figures of its own: its time (`step_s`, never the same as the
/// step before, as it was when a call's figures were repeated for each of its steps),
/// the images/s that time gives, and when it ended (`elapsed_s`, increasing).
fn assert_steps_have_their_own_figures(records: &[Value]) {
    let step_records: Vec<&Value> = records.iter().filter(|r| r["kind"] == "step").collect();
    let number =
        |r: &Value, key: &str| r[key].as_f64().unwrap_or_else(|| panic!("no {key} in {r}"));
    for r in &step_records {
        let (step_s, images_per_s) = (number(r, "step_s"), number(r, "images_per_s"));
        assert!(step_s > 0.0, "{r}");
        let want = number(r, "samples") / step_s;
        assert!(
            (images_per_s - want).abs() <= 1e-9 * want,
            "images/s is not this step's samples over its time: {r}"
        );
        assert!(
            number(r, "data_wait_s") <= step_s && number(r, "allreduce_s") <= step_s,
            "{r}"
        );
    }
    for pair in step_records.windows(2) {
        assert_ne!(
            number(pair[0], "step_s"),
            number(pair[1], "step_s"),
            "two steps with one time:\n{}\n{}",
            pair[0],
            pair[1]
        );
        assert!(
            number(pair[0], "elapsed_s") < number(pair[1], "elapsed_s"),
            "{}\n{}",
            pair[0],
            pair[1]
        );
    }
}
