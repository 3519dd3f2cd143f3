//! End-to-end tests of `imgrun train`: a head and a joined node as background daemons
//! (state folders of their own, fast heartbeats), the job's driver as a separate process
//! that connects to them, and its CPU trainers in worker processes of both daemons, all on
//! loopback, on tiny synthetic shards and the small CNN.
//!
//! Every wait is bounded; a job that does not end in time is killed and fails its test.
//! Each test stops its cluster and checks that no worker process is left.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::common::train::{
    BATCH, Dataset, JOB_LIMIT, Job, SETTLE_LIMIT, TrainCluster, assert_checkpoint_at_last_step,
    assert_each_sample_once, assert_steps_run_on, checkpoint_dir, last_step_value, logged_samples,
    metrics, printed_resume_command, read_json, replica_digest, synth_shards, total_steps,
    workers_of,
};
use crate::common::{
    Machine, Netns, describe, is_running, node_states, pid_of, wait_alive, wait_for,
};
use runtime::FAILPOINTS_VARIABLE;
use rustix::process::{Signal, kill_process};
use serde_json::Value;

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

/// `imgrun plan` and `imgrun train` give one answer: for a table of configurations
/// (modes, policies, partial batches kept by split + join, `dsrepeat`, chopped epochs,
/// several loader workers), the steps `plan --json` prints for each epoch are the steps
/// the job runs in it.
#[test]
fn plan_and_train_agree_on_every_epochs_steps() {
    let cluster = TrainCluster::start();
    let cases: &[(&str, &[&str])] = &[
        ("resampled", &["data.mode=\"resampled\""]),
        (
            "split-join",
            &["data.mode=\"split\"", "data.policy=\"join\""],
        ),
        (
            "split-join-workers",
            &[
                "data.mode=\"split\"",
                "data.policy=\"join\"",
                "data.loader_workers=2",
            ],
        ),
        (
            "split-drop",
            &["data.mode=\"split\"", "data.policy=\"drop\""],
        ),
        (
            "split-repeat",
            &[
                "data.mode=\"split\"",
                "data.policy=\"repeat\"",
                "data.nbatches=9",
                "data.dsrepeat=2",
            ],
        ),
        (
            "split-chopped",
            &[
                "data.mode=\"split\"",
                "data.policy=\"join\"",
                "data.epoch_size=150",
            ],
        ),
        // 3 CPU trainers on 2 nodes: 2 + 1.
        (
            "split-join-uneven",
            &[
                "data.mode=\"split\"",
                "data.policy=\"join\"",
                "train.cpu_trainers=3",
            ],
        ),
        // Decentralized on an odd world (a rank rests each step of the ring topology),
        // with ranks out of data that only mix.
        (
            "split-join-uneven-decentralized",
            &[
                "data.mode=\"split\"",
                "data.policy=\"join\"",
                "train.cpu_trainers=3",
                "train.sync=\"decentralized\"",
                "train.topology=\"ring\"",
            ],
        ),
    ];
    const EPOCHS: u64 = 2;
    for (name, sets) in cases {
        let uneven = sets.contains(&"train.cpu_trainers=3");
        let layout = if uneven { "2,1" } else { "1,1" };
        let planned: Vec<u64> = (0..EPOCHS)
            .map(|epoch| cluster.planned_steps_on(name, sets, epoch, layout))
            .collect();
        let out = cluster.job(name, EPOCHS, sets, false).finish(JOB_LIMIT);
        assert!(out.status.success(), "{name}: {}", out.describe());
        if uneven {
            // The placement used is the one printed and planned.
            assert!(
                out.stdout.contains("2 node(s) with 2+1 ranks")
                    || out.stdout.contains("2 node(s) with 1+2 ranks"),
                "{name}: {}",
                out.describe()
            );
        }
        let records = metrics(&cluster.runs.join(name));
        let ran: Vec<u64> = (0..EPOCHS).map(|e| steps_in_epoch(&records, e)).collect();
        eprintln!("{name}: plan {planned:?}, train {ran:?}");
        assert_eq!(planned, ran, "{name}: plan and train disagree");
    }
    cluster.assert_settled();
}

/// Shards written by Python webdataset, with no manifest, train over `pipe:cat` and over
/// HTTP from `imgrun serve`: resampled mode with an epoch size alone, split mode with a
/// declared count (one shard holds fewer: a warning names it) and with the manifest
/// `imgrun shards index` writes. Split mode without counts is refused, naming that
/// command. `imgrun plan` gives each job's steps.
#[test]
fn python_written_shards_train_without_a_manifest_over_pipe_and_http() {
    let Some(python) = python_with_webdataset() else {
        return;
    };
    let cluster = TrainCluster::start();
    let py = cluster.root.path().join("py");
    std::fs::create_dir_all(&py).expect("create py/");
    let mut written: Vec<PathBuf> = std::fs::read_dir(&cluster.data.train_dir)
        .expect("read the training folder")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "tar"))
        .collect();
    written.sort();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/wds_copy.py");
    let out = std::process::Command::new(&python)
        .arg(script)
        .arg(py.join("py-%06d.tar"))
        .arg("50")
        .args(&written)
        .output()
        .expect("run wds_copy.py");
    assert!(out.status.success(), "wds_copy.py:\n{}", describe(&out));
    assert!(
        !py.join("manifest.json").exists(),
        "Python writes no manifest"
    );

    let server = common::Server::start(&py);
    let names = "py-{000000..000004}.tar";
    let pipe_base = format!("pipe:cat {}/", py.display());
    let http_base = format!("{}/", server.url);
    let manifest = cluster.root.path().join("py-manifest.json");
    let manifest_arg = manifest.display().to_string();
    let index = [
        "shards",
        "index",
        names,
        "--base",
        &http_base,
        "-o",
        &manifest_arg,
    ];
    let printed = cluster.head.run_ok(&index);
    assert!(
        printed.contains("indexed 5 shards: 240 samples"),
        "{printed}"
    );
    let counts: Vec<u64> = read_json(&manifest)["shards"]
        .as_array()
        .expect("shards")
        .iter()
        .map(|s| s["samples"].as_u64().expect("samples"))
        .collect();
    assert_eq!(
        counts,
        cluster.train_counts(),
        "the index counts what Python wrote"
    );

    // The base applies to `data.val` too; these jobs do not evaluate.
    let train = format!("data.train={names:?}");
    let no_val = "data.val=\"\"";
    let base = |base: &str| format!("data.base={base:?}");
    let indexed = format!("data.manifest={manifest_arg:?}");
    let (pipe, http) = (base(&pipe_base), base(&http_base));
    let resampled = [
        "data.mode=\"resampled\"",
        "data.epoch_size=192",
        "data.classes=4",
    ];
    let split = ["data.mode=\"split\"", "data.policy=\"join\""];
    let declared = [
        split[0],
        split[1],
        "data.samples_per_shard=50",
        "data.classes=4",
    ];
    type Case<'a> = (&'a str, &'a str, &'a [&'a str], Option<&'a str>);
    let cases: [Case; 4] = [
        ("pipe-resampled", &pipe, &resampled, None),
        ("http-resampled", &http, &resampled, None),
        (
            "pipe-split-declared",
            &pipe,
            &declared,
            Some("py-000004.tar: the shard holds 40 samples and its count says 50"),
        ),
        (
            "http-split-indexed",
            &http,
            &[split[0], split[1], &indexed],
            None,
        ),
    ];
    for (name, base, extra, warning) in cases {
        let mut sets = vec![train.as_str(), no_val, base];
        sets.extend_from_slice(extra);
        let planned = cluster.planned_steps(name, &sets, 0);
        let out = cluster.job(name, 1, &sets, false).finish(JOB_LIMIT);
        assert!(out.status.success(), "{name}: {}", out.describe());
        let ran = steps_in_epoch(&metrics(&cluster.runs.join(name)), 0);
        eprintln!("{name}: plan {planned}, train {ran}");
        assert_eq!(planned, ran, "{name}: plan and train disagree");
        if let Some(warning) = warning {
            assert!(out.stderr.contains(warning), "{name}: {}", out.describe());
        }
    }
    // Resampled mode serves the epoch size: 192 samples over 2 ranks in batches of 16.
    let steps = steps_in_epoch(&metrics(&cluster.runs.join("pipe-resampled")), 0);
    assert_eq!(steps, 192 / 2 / BATCH);

    // Split mode needs counts, in `plan` as in `train`.
    let unknown = [
        train.as_str(),
        no_val,
        &pipe,
        split[0],
        split[1],
        "data.classes=4",
    ];
    let out = cluster.job("unknown", 1, &unknown, false).finish(JOB_LIMIT);
    assert!(!out.status.success(), "{}", out.describe());
    assert!(
        out.stderr.contains("imgrun shards index"),
        "{}",
        out.describe()
    );
    cluster.assert_settled();
}

/// The Python of `tools/pytools.sh`, which has the `webdataset` library; `None` (after
/// `skip_or_fail`) where the script says something it needs is missing here.
fn python_with_webdataset() -> Option<PathBuf> {
    let out = std::process::Command::new("bash")
        .arg("tools/pytools.sh")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdin(Stdio::null())
        .output()
        .expect("run bash tools/pytools.sh");
    if out.status.code() == Some(2) {
        let stderr = String::from_utf8_lossy(&out.stderr);
        common::skip::skip_or_fail(stderr.lines().last().unwrap_or("tools/pytools.sh: exit 2"));
        return None;
    }
    assert!(
        out.status.success(),
        "tools/pytools.sh:\n{}",
        describe(&out)
    );
    Some(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// A rank whose loader is slow holds every rank up in the gradient average: the job
/// names it, its node and why, and records it in the metrics. Rank 1's shards come
/// through a command that waits 3 s before it sends anything.
#[test]
fn a_rank_that_waits_for_data_is_named_with_its_node_and_why() {
    let cluster = TrainCluster::start();
    let dir = cluster.data.train_dir.display().to_string();
    let shard = |i: usize| format!("{dir}/train-{i:06}.tar");
    let slow = |i: usize| format!("pipe:sh -c 'sleep 3; cat {}'", shard(i));
    // Split mode gives rank r the shards r, r + 2, ...: rank 1 reads 1 and 3.
    let spec = [shard(0), slow(1), shard(2), slow(3), shard(4)].join("::");
    let train = format!("data.train={spec:?}");
    let sets = [
        train.as_str(),
        "data.mode=\"split\"",
        "data.policy=\"join\"",
        "train.straggler_secs=1.0",
    ];
    let mut job = cluster.job("late", 1, &sets, false);
    // While it happens: `imgrun jobs late` shows rank 1 waiting for data, from its
    // monitor, while rank 0 answers too.
    let seen = wait_for(JOB_LIMIT, "rank 1 seen waiting for data", || {
        let out = cluster.head.run(&["jobs", "late", "--json"]);
        if !out.status.success() {
            assert!(job.running(), "the job ended before its ranks were seen");
            return None;
        }
        let view: Value = serde_json::from_slice(&out.stdout).ok()?;
        let ranks = view["ranks"].as_array()?.clone();
        // Waiting for data, with the shard its loader reads (a slow `pipe:` one).
        let waiting = ranks.iter().any(|r| {
            let reads_the_slow_pipe = r["phase"]["reading"].as_array().is_some_and(|shards| {
                shards
                    .iter()
                    .any(|s| s["url"].as_str().is_some_and(|u| u.starts_with("pipe:sh")))
            });
            r["rank"] == 1 && r["phase"]["phase"] == "waiting_for_data" && reads_the_slow_pipe
        });
        (waiting && ranks.len() == 2).then_some(ranks)
    });
    assert!(
        seen[0]["phase"]["phase"].is_string(),
        "rank 0 answers: {seen:?}"
    );
    // Each rank with its epoch's data wait so far and its node's last heartbeat.
    let rank1 = &seen[1];
    assert!(
        rank1["phase"]["data_wait_s"].as_f64() > Some(0.0),
        "rank 1's data wait: {rank1}"
    );
    for rank in &seen {
        assert!(
            rank["heartbeat_ms_ago"].as_u64().is_some(),
            "no heartbeat: {rank}"
        );
    }
    let out = job.finish(JOB_LIMIT);
    assert!(out.status.success(), "{}", out.describe());
    assert!(
        out.stderr.contains("has been waiting for data for")
            && out.stderr.contains(", reading pipe:sh -c 'sleep 3; cat "),
        "no live word of the rank the others wait for and its shard:\n{}",
        out.describe()
    );
    let node = cluster.node_id;
    let head = cluster.head_id;
    let named = [node, head].iter().any(|n| {
        out.stderr
            .contains(&format!("warning: rank 1 (node {n}) is "))
    });
    assert!(named, "rank 1 is not named:\n{}", out.describe());
    assert!(
        out.stderr.contains("behind the others at step") && out.stderr.contains("waiting for data"),
        "{}",
        out.describe()
    );
    assert!(
        out.stderr.contains("held the others up on"),
        "no epoch summary:\n{}",
        out.describe()
    );
    // Rank 0 reads local files: it never waits for data. (On a loaded machine it may
    // fall behind computing now and then, which is named as such.)
    let rank0_waits = out
        .stderr
        .lines()
        .any(|l| l.starts_with("warning: rank 0 ") && l.contains("waiting for data"));
    assert!(!rank0_waits, "{}", out.describe());
    let waits: Vec<Value> = metrics(&cluster.runs.join("late"))
        .into_iter()
        .filter(|r| r["kind"] == "late" && r["cause"] == "waiting_for_data")
        .collect();
    assert!(!waits.is_empty(), "no late record of a wait for data");
    for record in &waits {
        assert_eq!(record["rank"], 1, "{record}");
        assert!(
            record["behind_s"].as_f64().is_some_and(|s| s > 1.0),
            "{record}"
        );
    }
    cluster.assert_settled();
}

/// Progressive resizing as the DAWNBench recipe does it: the size schedule holds from
/// epoch 0, and a phase reading pre-resized copies of the shards switches to the full
/// shards at its epoch boundary, in a whole run and in one resumed from the checkpoint
/// just before the switch. Each rank reports the image sides and shards it trained on.
#[test]
fn the_size_schedule_holds_from_epoch_0_and_a_phase_switches_shards_across_a_resume() {
    const EPOCHS: u64 = 3;
    let cluster = TrainCluster::start();
    // A 16-pixel copy of the training set: the same samples and counts.
    let (small_dir, small) = synth_shards(cluster.root.path(), "small", 60, 50, 1, 16);
    let schedule =
        format!("data.size_schedule=[{{ epoch = 0, size = 16, train = {small:?} }}, [2, 24]]");
    let sets = [schedule.as_str(), "train.checkpoint_every_epochs=1"];
    let whole = cluster
        .job("phases", EPOCHS, &sets, false)
        .finish(JOB_LIMIT);
    assert!(whole.status.success(), "{}", whole.describe());
    let run = cluster.runs.join("phases");
    let records = metrics(&run);
    let received = |records: &[Value], epoch: u64| -> (Vec<Value>, Vec<String>) {
        let record = records
            .iter()
            .rfind(|r| r["kind"] == "epoch" && r["epoch"] == epoch)
            .unwrap_or_else(|| panic!("no epoch {epoch} record"));
        let sizes = record["image_sizes"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let shards = record["train_shards"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        (sizes, shards)
    };
    let small_folder = small_dir.display().to_string();
    let full_folder = cluster.data.train_dir.display().to_string();
    let expect = |records: &[Value], epoch: u64, size: u64, folder: &str| {
        let (sizes, shards) = received(records, epoch);
        assert_eq!(
            sizes,
            vec![serde_json::json!([size]); 2],
            "epoch {epoch}: the sides each rank received"
        );
        assert_eq!(shards.len(), 2, "epoch {epoch}: {shards:?}");
        for spec in &shards {
            assert!(
                spec.starts_with(folder),
                "epoch {epoch}: read {spec}, expected shards in {folder}"
            );
        }
    };
    expect(&records, 0, 16, &small_folder);
    expect(&records, 1, 16, &small_folder);
    expect(&records, 2, 24, &full_folder);
    let whole_steps = steps(&records);

    // Resumed from the checkpoint after epoch 1: the switch still happens at epoch 2, and
    // the steps after it are the whole run's to the bit.
    let checkpoint = run.join("checkpoints").join("epoch-0002");
    let resume = ["--resume".to_string(), checkpoint.display().to_string()];
    let resumed = cluster
        .job_with("phases", EPOCHS, &sets, false, &resume)
        .finish(JOB_LIMIT);
    assert!(resumed.status.success(), "{}", resumed.describe());
    let records = metrics(&run);
    expect(&records, 2, 24, &full_folder);
    assert_resumed_steps_match(&steps(&records), &whole_steps);
    cluster.assert_settled();
}

/// Decentralized training (`train.sync`): four CPU trainers on two nodes each take their
/// own steps and average their parameters with one peer per step. The plan prints the
/// schedule, the job learns, every evaluation records how far the replicas are from
/// their mean (which is what it evaluates), checkpoints keep every rank's replica, the
/// job ends with one model, and a job resumed from the checkpoint after epoch 2 takes
/// the whole run's steps to the bit and ends with its model.
#[test]
fn a_decentralized_job_mixes_with_its_neighbours_and_resumes_exactly() {
    const EPOCHS: u64 = 3;
    let cluster = TrainCluster::start();
    let sets = [
        "train.sync=\"decentralized\"",
        "train.topology=\"one-peer-exponential\"",
        "train.cpu_trainers=4",
        "train.checkpoint_every_epochs=1",
    ];
    let whole = cluster
        .job("decent", EPOCHS, &sets, false)
        .finish(JOB_LIMIT);
    assert!(whole.status.success(), "{}", whole.describe());
    let printed = &whole.stdout;
    for line in [
        "2 node(s) x 2 rank(s)",
        "sync        decentralized, one-peer-exponential topology; the groups repeat every 2 step(s):",
        "step 0: {0,1} {2,3}",
        "step 1: {0,2} {1,3}",
        "replicas: each replaced by the mean of all 4",
        "replicas: identical on all 4 ranks",
    ] {
        assert!(printed.contains(line), "no `{line}` in:\n{printed}");
    }
    let run = cluster.runs.join("decent");
    let records = metrics(&run);
    let whole_steps = steps(&records);
    let losses: Vec<f64> = whole_steps.values().copied().collect();
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (first, last) = (mean(&losses[..3]), mean(&losses[losses.len() - 3..]));
    assert!(last < first, "the loss did not decrease: {losses:?}");
    let evals: Vec<&Value> = records.iter().filter(|r| r["kind"] == "eval").collect();
    assert_eq!(evals.len() as u64, EPOCHS, "one evaluation per epoch");
    for eval in &evals {
        let spread = eval["replica_spread"].as_f64().unwrap_or(-1.0);
        assert!(
            spread > 0.0,
            "the replicas differ before an evaluation: {eval}"
        );
    }
    let checkpoint = run.join("checkpoints").join("epoch-0002");
    for file in ["model.ot", "optimizer.ot", "replicas.ot", "state.json"] {
        let size = std::fs::metadata(checkpoint.join(file)).map_or(0, |m| m.len());
        assert!(size > 0, "{} has no {file}", checkpoint.display());
    }

    // Resumed after epoch 2 (index 1): every rank takes its own replica back.
    let resume = ["--resume".to_string(), checkpoint.display().to_string()];
    let resumed = cluster
        .job_with("decent", EPOCHS, &sets, false, &resume)
        .finish(JOB_LIMIT);
    assert!(resumed.status.success(), "{}", resumed.describe());
    assert_resumed_steps_match(&steps(&metrics(&run)), &whole_steps);
    assert_eq!(
        replica_digest(&resumed.stdout),
        replica_digest(&whole.stdout),
        "the resumed job ends with the whole run's model"
    );
    cluster.assert_settled();
}

/// Split mode over an uneven number of shards (five shards of unequal size for two ranks):
/// every rank plans the same steps, the rank out of data joins with empty batches, and
/// user hooks change the plan: the shipped scripts reproduce the built-in behaviour bit
/// for bit, a reversing `shard_shuffle` trains on a different order, and a failing one
/// fails the job with its file and line.
#[test]
fn split_mode_with_user_hooks_that_take_effect_or_fail_the_job() {
    let cluster = TrainCluster::start();
    let hooks = cluster.root.path().join("hooks");
    let (reverse, failing) = (hooks.join("reverse"), hooks.join("failing"));
    for dir in [&reverse, &failing] {
        std::fs::create_dir_all(dir).expect("hooks folder");
    }
    std::fs::write(
        reverse.join("shard_shuffle.rhai"),
        "fn shard_shuffle(shards, ctx) { shards.reverse(); shards }\n",
    )
    .expect("write hook");
    let failing_file = failing.join("shard_shuffle.rhai");
    std::fs::write(
        &failing_file,
        "fn shard_shuffle(shards, ctx) {\n    throw \"this hook refuses\";\n}\n",
    )
    .expect("write hook");
    let shipped = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts");

    // Rank r reads shards r, r + 2, ...; with the join policy its last partial batch is
    // kept, so every sample counts once; the longer rank sets the steps.
    let counts = cluster.train_counts();
    let per_rank: Vec<u64> = (0..2)
        .map(|r| counts.iter().skip(r).step_by(2).sum::<u64>())
        .collect();
    let batches: Vec<u64> = per_rank.iter().map(|n| n.div_ceil(BATCH)).collect();
    let steps_per_epoch = batches.iter().copied().max().unwrap_or(0);
    assert_ne!(batches[0], batches[1], "the shards should be uneven");
    let want_samples: Vec<u64> = (0..steps_per_epoch)
        .map(|k| {
            per_rank
                .iter()
                .map(|n| n.saturating_sub(k * BATCH).min(BATCH))
                .sum()
        })
        .collect();
    assert_eq!(
        want_samples.iter().sum::<u64>(),
        counts.iter().sum::<u64>(),
        "every sample once per epoch"
    );

    let split = ["data.mode=split", "data.policy=join"];
    let mut digests = BTreeMap::new();
    let mut losses = BTreeMap::new();
    for (name, hooks) in [
        ("builtin", None),
        ("shipped", Some(shipped.to_string())),
        ("reversed", Some(reverse.display().to_string())),
    ] {
        let hook_set = hooks.map(|dir| format!("data.hooks={dir:?}"));
        let extra: Vec<&str> = split.iter().copied().chain(hook_set.as_deref()).collect();
        let out = cluster.job(name, 2, &extra, false).finish(JOB_LIMIT);
        assert!(out.status.success(), "{name}: {}", out.describe());
        assert!(
            out.stdout
                .contains(&format!("{steps_per_epoch} steps per epoch")),
            "{name}: {}",
            out.stdout
        );
        let records = metrics(&cluster.runs.join(name));
        for epoch in 0..2 {
            let samples: Vec<u64> = records
                .iter()
                .filter(|r| r["kind"] == "step" && r["epoch"] == epoch)
                .map(|r| r["samples"].as_u64().unwrap_or(0))
                .collect();
            assert_eq!(
                samples, want_samples,
                "{name}: samples per step, epoch {epoch}"
            );
        }
        digests.insert(name, replica_digest(&out.stdout));
        losses.insert(name, steps(&records));
    }
    assert_eq!(
        losses["builtin"], losses["shipped"],
        "the shipped scripts as user hooks train exactly as the built-in ones"
    );
    assert_eq!(digests["builtin"], digests["shipped"]);
    assert_ne!(
        losses["shipped"], losses["reversed"],
        "the reversing hook changed nothing"
    );
    assert_ne!(digests["shipped"], digests["reversed"]);

    let failing_set = format!("data.hooks={:?}", failing.display().to_string());
    let extra = [split[0], split[1], failing_set.as_str()];
    let out = cluster.job("failing", 2, &extra, false).finish(JOB_LIMIT);
    assert!(!out.status.success(), "{}", out.describe());
    for word in [
        format!("{}:2", failing_file.display()),
        "shard_shuffle".to_string(),
        "this hook refuses".to_string(),
    ] {
        assert!(
            out.stderr.contains(&word),
            "`{word}` not in:\n{}",
            out.stderr
        );
    }
    cluster.assert_settled();
}

/// A job stopped with SIGTERM after a mid-epoch checkpoint and resumed from that
/// checkpoint continues at the saved step and trains exactly as an uninterrupted job: its
/// metrics.jsonl holds every step once (what was written past the checkpoint is
/// dropped) and the resumed epoch's train loss covers the whole epoch.
#[test]
fn a_job_resumed_from_a_mid_epoch_checkpoint_continues_as_an_uninterrupted_one() {
    const EPOCHS: u64 = 3;
    // Every step: `checkpoint_every_steps` saves only when a call of several steps ends on
    // a multiple (see `step_checkpoints_land_on_every_multiple`), so a larger interval
    // may never save mid-epoch. No epoch checkpoints, so `latest` stays mid-epoch.
    let every = [
        "train.checkpoint_every_steps=1",
        "train.checkpoint_every_epochs=0",
    ];
    let cluster = TrainCluster::start();

    let whole = cluster
        .job("whole", EPOCHS, &every, false)
        .finish(JOB_LIMIT);
    assert!(whole.status.success(), "{}", whole.describe());
    let whole_records = metrics(&cluster.runs.join("whole"));
    let whole_steps = steps(&whole_records);
    let whole_digest = replica_digest(&whole.stdout);

    // Interrupted once a checkpoint in the second epoch exists.
    let run = cluster.runs.join("cut");
    let mut job = cluster.job("cut", EPOCHS, &every, false);
    let checkpoints = run.join("checkpoints");
    let deadline = Instant::now() + JOB_LIMIT;
    let mid_epoch = loop {
        assert!(
            job.running(),
            "the job ended before a checkpoint in epoch 1:\n{}",
            job.finish(JOB_LIMIT).describe()
        );
        assert!(Instant::now() < deadline, "no checkpoint in epoch 1");
        let named = std::fs::read_to_string(checkpoints.join("latest")).unwrap_or_default();
        let dir = checkpoints.join(named.trim());
        let state = read_json(&dir.join("state.json"));
        if named.starts_with("step-")
            && state["epoch"].as_u64() >= Some(1)
            && state["step_in_epoch"].as_u64() > Some(0)
        {
            break dir;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    job.signal(Signal::TERM);
    let cut = job.finish(JOB_LIMIT);
    assert_eq!(cut.status.code(), Some(143), "{}", cut.describe());
    assert!(
        cut.stderr.contains("interrupted by SIGTERM"),
        "{}",
        cut.stderr
    );
    assert_checkpoint_at_last_step(&run);
    cluster.assert_settled();

    // Resumed from the mid-epoch checkpoint seen above, which the run went past: the
    // records after it are dropped from metrics.jsonl.
    let saved_dir = mid_epoch;
    let saved = read_json(&saved_dir.join("state.json"));
    let saved_step = saved["global_step"].as_u64().expect("global_step");
    assert!(
        saved["step_in_epoch"].as_u64() > Some(0),
        "not a mid-epoch checkpoint: {saved}"
    );
    let resume = ["--resume".to_string(), saved_dir.display().to_string()];
    let resumed = cluster
        .job_with("cut", EPOCHS, &every, false, &resume)
        .finish(JOB_LIMIT);
    assert!(resumed.status.success(), "{}", resumed.describe());
    assert!(
        resumed
            .stdout
            .contains(&format!("global step {saved_step})")),
        "{}",
        resumed.stdout
    );

    let records = metrics(&run);
    let job_at = records
        .iter()
        .rposition(|r| r["kind"] == "job")
        .expect("job record");
    assert!(
        records[job_at]["resumed_from"]
            .as_str()
            .is_some_and(|p| p.ends_with(
                saved_dir
                    .file_name()
                    .and_then(|n| n.to_str())
                    .unwrap_or("?")
            )),
        "{}",
        records[job_at]
    );
    assert_eq!(
        records[job_at]["resumed_at_step"], saved_step,
        "the job record names the step it continues after (imgrun plot cuts there)"
    );
    let after = steps(&records[job_at..]);
    assert_eq!(
        after.keys().next().copied(),
        Some(saved_step + 1),
        "the first step after resuming"
    );
    assert_each_step_once(&records, whole_steps.len() as u64);
    assert!(
        records
            .iter()
            .filter(|r| r["kind"] == "stop")
            .all(|r| r["step"].as_u64() <= Some(saved_step)),
        "the stop record past the checkpoint was dropped"
    );
    // Every epoch's summary, the resumed one included, as the uninterrupted job's.
    let epoch_losses = |records: &[Value]| -> Vec<(u64, f64, u64)> {
        records
            .iter()
            .filter(|r| r["kind"] == "epoch")
            .map(|r| {
                let field = |k: &str| r[k].as_f64().expect(k);
                (
                    field("epoch") as u64,
                    field("train_loss"),
                    field("steps") as u64,
                )
            })
            .collect()
    };
    let resumed_epoch = saved["epoch"].as_u64().expect("epoch");
    let (whole_epochs, cut_epochs) = (epoch_losses(&whole_records), epoch_losses(&records));
    eprintln!("epoch train losses: whole {whole_epochs:?}, resumed {cut_epochs:?}");
    assert_eq!(
        cut_epochs, whole_epochs,
        "epoch summaries (epoch {resumed_epoch} resumed mid-way)"
    );
    assert_eq!(
        after.keys().last(),
        whole_steps.keys().last(),
        "the final global step"
    );
    // Same data order, same weights, same threads: the CPU math is the same to the bit,
    // so no tolerance is needed.
    let worst = after
        .iter()
        .map(|(step, loss)| (loss - whole_steps[step]).abs())
        .fold(0.0f64, f64::max);
    eprintln!(
        "resumed at global step {saved_step} of {}: largest loss difference from the \
         uninterrupted job {worst:e}",
        whole_steps.len()
    );
    let whole_after: BTreeMap<u64, f64> = whole_steps
        .range(saved_step + 1..)
        .map(|(s, l)| (*s, *l))
        .collect();
    assert_eq!(after, whole_after, "step losses after resuming");
    assert_eq!(
        replica_digest(&resumed.stdout),
        whole_digest,
        "the final weights of the resumed and the uninterrupted job"
    );
    cluster.assert_settled();
}

/// Loss scaling multiplies the loss by a power of two before backward and the averaged
/// gradients by its inverse, which is exact in fp32: a job with dynamic scaling trains bit
/// for bit as one without. From a scale so large that the scaled gradients overflow, the
/// first steps are skipped, each halving the scale, until steps apply. NCCL, asked for
/// between CPU trainers, is refused before anything starts.
#[test]
fn loss_scaling_is_exact_and_an_overflow_skips_steps() {
    const EPOCHS: u64 = 2;
    let cluster = TrainCluster::start();
    let plain = cluster.job("plain", EPOCHS, &[], false).finish(JOB_LIMIT);
    assert!(plain.status.success(), "{}", plain.describe());
    let dynamic = r#"train.loss_scaling="dynamic""#;
    let scaled = cluster
        .job(
            "scaled",
            EPOCHS,
            &[dynamic, "train.loss_scale_init=1048576.0"],
            false,
        )
        .finish(JOB_LIMIT);
    assert!(scaled.status.success(), "{}", scaled.describe());
    let plain_records = metrics(&cluster.runs.join("plain"));
    let scaled_records = metrics(&cluster.runs.join("scaled"));
    assert_eq!(
        steps(&scaled_records),
        steps(&plain_records),
        "step losses with and without loss scaling"
    );
    assert_eq!(
        replica_digest(&scaled.stdout),
        replica_digest(&plain.stdout),
        "final weights with and without loss scaling"
    );
    let step_records = |records: &[Value]| -> Vec<Value> {
        records
            .iter()
            .filter(|r| r["kind"] == "step")
            .cloned()
            .collect()
    };
    assert!(
        step_records(&plain_records)
            .iter()
            .all(|r| r.get("loss_scale").is_none()),
        "a job without loss scaling records no scale"
    );
    for record in step_records(&scaled_records) {
        assert_eq!(record["loss_scale"], 1048576.0, "{record}");
        assert_eq!(record["skipped"], false, "{record}");
    }

    let huge = 2f64.powi(127);
    let init = format!("train.loss_scale_init={huge:e}");
    let overflow = cluster
        .job("overflow", EPOCHS, &[dynamic, &init], false)
        .finish(JOB_LIMIT);
    assert!(overflow.status.success(), "{}", overflow.describe());
    let records = step_records(&metrics(&cluster.runs.join("overflow")));
    let scales: Vec<(f64, bool)> = records
        .iter()
        .map(|r| {
            let scale = r["loss_scale"].as_f64().expect("loss_scale");
            (scale, r["skipped"].as_bool().expect("skipped"))
        })
        .collect();
    eprintln!("overflow run, (scale, skipped) per step: {scales:?}");
    assert_eq!(scales[0], (huge, true), "the first step overflows");
    for pair in scales.windows(2) {
        let ((scale, skipped), (next, _)) = (pair[0], pair[1]);
        let want = if skipped { scale / 2.0 } else { scale };
        assert_eq!(next, want, "a skipped step halves the scale: {scales:?}");
    }
    let applied = scales.iter().filter(|(_, skipped)| !skipped).count();
    assert!(applied > 0, "no step applied: {scales:?}");
    assert!(
        !scales.last().expect("steps").1,
        "the last step still overflowed: {scales:?}"
    );
    assert!(
        overflow
            .stdout
            .contains("replicas: identical on all 2 ranks"),
        "{}",
        overflow.stdout
    );

    let nccl = cluster
        .job("nccl", 1, &[r#"train.allreduce="nccl""#], false)
        .finish(JOB_LIMIT);
    assert!(!nccl.status.success(), "{}", nccl.describe());
    assert!(
        nccl.stderr.contains("train.allreduce") && nccl.stderr.contains("CUDA"),
        "{}",
        nccl.stderr
    );

    // Decentralized: each rank unscales its own gradients, as exactly. (Its overflow
    // cannot be forced here: nothing sums the scaled gradients of several ranks, and
    // this model's do not leave f32's range at the largest scale the key takes.)
    let decentralized = r#"train.sync="decentralized""#;
    let plain = cluster
        .job("plain-d", EPOCHS, &[decentralized], false)
        .finish(JOB_LIMIT);
    assert!(plain.status.success(), "{}", plain.describe());
    let scaled = cluster
        .job(
            "scaled-d",
            EPOCHS,
            &[decentralized, dynamic, "train.loss_scale_init=1048576.0"],
            false,
        )
        .finish(JOB_LIMIT);
    assert!(scaled.status.success(), "{}", scaled.describe());
    assert_eq!(
        steps(&metrics(&cluster.runs.join("scaled-d"))),
        steps(&metrics(&cluster.runs.join("plain-d"))),
        "decentralized step losses with and without loss scaling"
    );
    assert_eq!(
        replica_digest(&scaled.stdout),
        replica_digest(&plain.stdout),
        "decentralized final weights with and without loss scaling"
    );
    cluster.assert_settled();
}

/// Averaging behind backward (`train.overlap`, buckets of 10 kB so that a step crosses
/// many) gives the job the ring gives after backward: the same step losses and the same
/// final weights, identical on both ranks.
#[test]
fn an_overlapped_allreduce_trains_exactly_as_one_after_backward() {
    const EPOCHS: u64 = 2;
    let cluster = TrainCluster::start();
    let small = "train.bucket_mb=0.01";
    let after = cluster
        .job("after", EPOCHS, &[small, "train.overlap=false"], false)
        .finish(JOB_LIMIT);
    assert!(after.status.success(), "{}", after.describe());
    let overlapped = cluster
        .job("overlapped", EPOCHS, &[small, "train.overlap=true"], false)
        .finish(JOB_LIMIT);
    assert!(overlapped.status.success(), "{}", overlapped.describe());
    for out in [&after, &overlapped] {
        assert!(
            out.stdout.contains("replicas: identical on all 2 ranks"),
            "{}",
            out.stdout
        );
    }
    assert_eq!(
        steps(&metrics(&cluster.runs.join("overlapped"))),
        steps(&metrics(&cluster.runs.join("after"))),
        "step losses with and without overlap"
    );
    assert_eq!(
        replica_digest(&overlapped.stdout),
        replica_digest(&after.stdout),
        "final weights with and without overlap"
    );
    cluster.assert_settled();
}

/// `checkpoint_every_steps = K` saves a checkpoint at every multiple of K inside an epoch.
#[test]
fn step_checkpoints_land_on_every_multiple() {
    const EVERY: u64 = 3;
    let cluster = TrainCluster::start();
    let every = format!("train.checkpoint_every_steps={EVERY}");
    let out = cluster.job("every", 2, &[&every], false).finish(JOB_LIMIT);
    assert!(out.status.success(), "{}", out.describe());
    let records = metrics(&cluster.runs.join("every"));
    let per_epoch = records
        .iter()
        .filter(|r| r["kind"] == "step" && r["epoch"] == 0)
        .count() as u64;
    let total = last_step_value(&records)
        .and_then(|v| v.as_u64())
        .unwrap_or(0);
    let want: Vec<String> = (1..=total)
        .filter(|s| s % EVERY == 0 && s % per_epoch != 0)
        .map(|s| format!("step-{s:08}"))
        .collect();
    let mut have: Vec<String> = std::fs::read_dir(cluster.runs.join("every/checkpoints"))
        .expect("checkpoints")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("step-"))
        .collect();
    have.sort();
    assert_eq!(have, want);

    // Resuming a finished run with the same epochs says so instead of exiting 0.
    let run = cluster.runs.join("every").display().to_string();
    let flags = ["--resume".to_string(), run];
    let again = cluster
        .job_with("every", 2, &[], false, &flags)
        .finish(JOB_LIMIT);
    assert!(!again.status.success(), "{}", again.describe());
    assert!(
        again.stderr.contains("that run is complete") && again.stderr.contains("--epochs 3"),
        "{}",
        again.describe()
    );
}

/// SIGKILL the node daemon in the middle of a job.
#[test]
fn a_job_whose_node_daemon_is_killed_fails_naming_the_rank_and_node() {
    a_job_fails_when_its_node_loses(Victim::NodeDaemon);
}

/// SIGKILL the worker process that runs the node's trainer.
#[test]
fn a_job_whose_trainer_process_is_killed_fails_naming_the_rank_and_node() {
    a_job_fails_when_its_node_loses(Victim::Worker);
}

#[derive(Debug, Clone, Copy)]
enum Victim {
    NodeDaemon,
    Worker,
}

/// A decentralized job loses a trainer the same way: the survivor's mixing or its sums
/// end at once, and the error leads with the lost rank.
#[test]
fn a_decentralized_job_whose_trainer_process_is_killed_fails_naming_the_rank_and_node() {
    a_job_with_fails_when_its_node_loses(Victim::Worker, &["train.sync=\"decentralized\""]);
}

fn a_job_fails_when_its_node_loses(victim: Victim) {
    a_job_with_fails_when_its_node_loses(victim, &[]);
}

fn a_job_with_fails_when_its_node_loses(victim: Victim, sets: &[&str]) {
    let cluster = TrainCluster::start();
    let mut job = cluster.job("doomed", 200, sets, false);
    cluster.wait_for_steps(&mut job, "doomed", 2);
    let daemon = cluster.node.daemon_pids();
    assert_eq!(daemon.len(), 1, "one daemon on the node");
    let pid = match victim {
        Victim::NodeDaemon => daemon[0],
        Victim::Worker => {
            let workers = workers_of(daemon[0]);
            assert_eq!(workers.len(), 1, "one trainer on the node: {workers:?}");
            workers[0]
        }
    };
    let killed_at = Instant::now();
    kill_process(pid_of(pid).expect("pid"), Signal::KILL).expect("kill -9");
    let out = job.finish(Duration::from_secs(60));
    let took = killed_at.elapsed();
    eprintln!("{victim:?} killed: `imgrun train` exited after {took:?}");
    assert!(!out.status.success(), "{}", out.describe());
    assert_ne!(out.status.code(), Some(130), "{}", out.describe());
    // The error leads with the rank that failed first and its node (the head's event
    // for it), not with the healthy rank that lost its ring peer.
    let error = &out.stderr;
    let lost = format!("rank 1 (node {})", cluster.node_id);
    assert!(
        error.contains(&lost),
        "the lost rank and its node (`{lost}`) are not named:\n{error}"
    );
    let first_line = error
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_default();
    assert!(
        first_line.contains(&lost),
        "the error does not lead with the root cause:\n{error}"
    );
    if let Victim::NodeDaemon = victim {
        wait_for(SETTLE_LIMIT, "the node declared dead", || {
            let states = node_states(&cluster.head.status());
            states
                .iter()
                .any(|(id, s)| *id == cluster.node_id && s == "dead")
                .then_some(())
        });
    }
    cluster.assert_settled();
}

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

/// A network partition mid-job: the veth link between the head's and the node's network
/// namespaces is cut (no packet refused, none answered). The job fails within seconds,
/// naming the cut-off rank and its node, instead of hanging in the ring; the node, cut
/// off for the dead window, fences its trainer by itself (kills it, its process ends);
/// once the link is back, the node joins again. Needs root and `ip`.
#[test]
fn a_partition_mid_job_fails_it_naming_the_cut_off_node_which_fences_its_trainer() {
    let net = match Netns::create() {
        Ok(net) => net,
        Err(missing) => return common::skip::skip_or_fail(&missing),
    };
    let root = tempfile::tempdir().expect("temp dir");
    let (head, node, status) = net.cluster(root.path());
    let node_id = common::nodes(&status)
        .iter()
        .find(|n| {
            n["address"]
                .as_str()
                .is_some_and(|a| a.starts_with(&net.addresses[1]))
        })
        .and_then(|n| n["id"].as_u64())
        .expect("the node's id");
    let data = Dataset::synth(root.path());
    let runs = root.path().join("runs");
    let mut job = Job::start(&head, &data.args(&runs, "cut", 200), root.path());
    common::train::wait_for_steps(&mut job, &runs.join("cut"), 2);
    let daemon = node.daemon_pids();
    assert_eq!(daemon.len(), 1, "one daemon on the node");
    let trainers = workers_of(daemon[0]);
    assert_eq!(trainers.len(), 1, "one trainer on the node: {trainers:?}");

    net.cut();
    let cut_at = Instant::now();
    let out = job.finish(Duration::from_secs(60));
    eprintln!(
        "link cut: `imgrun train` exited after {:?}",
        cut_at.elapsed()
    );
    assert!(!out.status.success(), "{}", out.describe());
    let lost = format!("rank 1 (node {node_id})");
    assert!(
        out.stderr.contains(&lost),
        "the cut-off rank and its node (`{lost}`) are not named:\n{}",
        out.describe()
    );
    // Cut off for the dead window, the node kills its trainer without being told.
    wait_for(
        Duration::from_secs(20),
        "the cut-off node's trainer gone",
        || trainers.iter().all(|&pid| !is_running(pid)).then_some(()),
    );
    eprintln!("trainer fenced {:?} after the cut", cut_at.elapsed());
    net.restore();
    wait_alive(&head, 2, Duration::from_secs(20));
    head.run_ok(&["stop", "--all"]);
    let pids: Vec<u32> = [&head, &node]
        .iter()
        .flat_map(|m| m.daemon_pids())
        .collect();
    wait_for(Duration::from_secs(10), "daemons gone", || {
        pids.iter().all(|&p| !is_running(p)).then_some(())
    });
}

/// SIGSTOP the node's daemon alone: its worker runs on, unsupervised.
#[test]
fn a_paused_node_daemon_stops_the_failed_jobs_trainer_before_it_counts_as_free() {
    a_paused_node_comes_back_fenced(Pause::Daemon);
}

/// SIGSTOP the node's daemon and its worker: both resume together.
#[test]
fn a_paused_node_with_its_worker_stops_the_failed_jobs_trainer_before_it_counts_as_free() {
    a_paused_node_comes_back_fenced(Pause::DaemonAndWorkers);
}

#[derive(Debug, Clone, Copy)]
enum Pause {
    Daemon,
    DaemonAndWorkers,
}

/// A node paused until the head declares it dead (and the job fails) comes back: it must
/// kill the trainer of its old session before the head counts it live again, so that
/// `imgrun status` never shows its CPUs free while that trainer's process runs.
fn a_paused_node_comes_back_fenced(pause: Pause) {
    let cluster = TrainCluster::start();
    let mut job = cluster.job("paused", 200, &[], false);
    cluster.wait_for_steps(&mut job, "paused", 2);
    let daemon = cluster.node.daemon_pids();
    assert_eq!(daemon.len(), 1, "one daemon on the node");
    let daemon = daemon[0];
    let workers = workers_of(daemon);
    assert_eq!(workers.len(), 1, "one trainer on the node: {workers:?}");
    let paused: Vec<u32> = match pause {
        Pause::Daemon => vec![daemon],
        Pause::DaemonAndWorkers => vec![daemon, workers[0]],
    };
    let signal_all = |signal: Signal| {
        for &pid in &paused {
            kill_process(pid_of(pid).expect("pid"), signal).expect("signal the node");
        }
    };
    signal_all(Signal::STOP);
    // Resumed whatever happens below, so that the cluster can be stopped.
    struct Resume<F: Fn(Signal)>(F);
    impl<F: Fn(Signal)> Drop for Resume<F> {
        fn drop(&mut self) {
            (self.0)(Signal::CONT);
        }
    }
    let resume = Resume(signal_all);
    let out = job.finish(Duration::from_secs(60));
    assert!(!out.status.success(), "{}", out.describe());
    let lost = format!("rank 1 (node {})", cluster.node_id);
    assert!(
        out.stderr.contains(&lost),
        "the lost rank and its node (`{lost}`) are not named:\n{}",
        out.stderr
    );
    wait_for(SETTLE_LIMIT, "the node declared dead", || {
        node_states(&cluster.head.status())
            .iter()
            .any(|(id, s)| *id == cluster.node_id && s == "dead")
            .then_some(())
    });
    drop(resume);
    let resumed_at = Instant::now();
    // From now on, whenever the head shows the node alive with nothing reserved on it,
    // the old trainer's process must be gone.
    let mut seen_free = 0;
    wait_for(
        SETTLE_LIMIT,
        "the node alive again and its worker gone",
        || {
            let status = cluster.head.status();
            let node = common::nodes(&status)
                .into_iter()
                .find(|n| n["id"].as_u64() == Some(cluster.node_id))?;
            let alive = node["state"] == "alive";
            let free = node["used"].get("cpu").and_then(Value::as_u64).unwrap_or(0) == 0;
            let running = workers.iter().any(|&w| is_running(w));
            if alive && free {
                seen_free += 1;
                assert!(
                    !running,
                    "{pause:?}: the head counts node {}'s CPUs free while the failed job's \
                 trainer (pid {}) still runs there:\n{status:#}",
                    cluster.node_id, workers[0]
                );
            }
            (alive && !running).then_some(())
        },
    );
    eprintln!(
        "{pause:?}: node alive again and its old trainer gone {:?} after SIGCONT ({seen_free} \
         status reads showed it free)",
        resumed_at.elapsed()
    );
    cluster.assert_settled();
}

/// SIGKILL the head's daemon in the middle of a job: `imgrun train` says it lost the head
/// (not that a ring peer failed) and how to continue, and no trainer is left anywhere.
#[test]
fn a_job_whose_head_is_killed_says_the_head_was_lost_and_leaves_no_trainer() {
    let cluster = TrainCluster::start();
    let mut job = cluster.job("headless", 200, &["train.checkpoint_every_steps=2"], false);
    cluster.wait_for_steps(&mut job, "headless", 4);
    let head = cluster.head.daemon_pids();
    let node = cluster.node.daemon_pids();
    assert_eq!((head.len(), node.len()), (1, 1), "one daemon each");
    let trainers: Vec<u32> = [head[0], node[0]]
        .iter()
        .flat_map(|&d| workers_of(d))
        .collect();
    assert_eq!(trainers.len(), 2, "a trainer on each daemon: {trainers:?}");
    let killed_at = Instant::now();
    kill_process(pid_of(head[0]).expect("pid"), Signal::KILL).expect("kill -9 the head");
    let out = job.finish(Duration::from_secs(60));
    let took = killed_at.elapsed();
    assert!(!out.status.success(), "{}", out.describe());
    let first_line = out
        .stderr
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_default();
    let lost = format!("lost the head node at {}", cluster.join.0);
    assert!(
        first_line.contains(&lost),
        "the error does not lead with `{lost}`:\n{}",
        out.describe()
    );
    for words in ["cannot continue", "--resume"] {
        assert!(
            out.stderr.contains(words),
            "`{words}` not in:\n{}",
            out.stderr
        );
    }
    wait_for(SETTLE_LIMIT, "no trainer process left", || {
        trainers.iter().all(|&p| !is_running(p)).then_some(())
    });
    eprintln!(
        "head killed: `imgrun train` exited after {took:?}, every trainer gone after {:?}; \
         it said:\n{}",
        killed_at.elapsed(),
        out.stderr
    );
    assert!(is_running(node[0]), "the node daemon lives on");
}

/// While a job runs, `imgrun status` names its job and each trainer's rank. Ctrl-C then
/// lets the step in flight end, saves a checkpoint at the last completed step, stops
/// every trainer, exits with 130 and prints the command that continues the run; that
/// command, run as printed, finishes the job with every step in metrics.jsonl once.
#[test]
fn ctrl_c_checkpoints_the_last_step_and_prints_the_command_that_resumes() {
    // Long enough to be running still when the signal comes (three epochs can take a
    // second); no evaluations or checkpoints before the end, so the resumed run is short.
    const EPOCHS: u64 = 12;
    let quick = [
        "train.eval_every_epochs=0",
        "train.checkpoint_every_epochs=0",
    ];
    let cluster = TrainCluster::start();
    let mut job = cluster.job("interrupted", EPOCHS, &quick, false);
    cluster.wait_for_steps(&mut job, "interrupted", 1);
    let table = cluster.head.run_ok(&["status"]);
    let status = cluster.head.status();
    let reserved = status["reservations"].as_array().map_or(0, Vec::len);
    // One per trainer holds CPUs (the coordinator and the monitors reserve a place only).
    let holding = status["reservations"].as_array().map_or(0, |r| {
        r.iter()
            .filter(|r| r["resources"]["cpu"].as_u64() > Some(0))
            .count()
    });
    assert_eq!(
        holding, 2,
        "one reservation with CPUs per trainer while it runs"
    );
    assert_eq!(
        reserved, 5,
        "and the coordinator's and each rank's monitor's"
    );
    let mut trainers: Vec<(String, u64, String)> = status["actors"]
        .as_array()
        .expect("actors in status --json")
        .iter()
        .filter(|a| a["kind"] == "trainer")
        .map(|a| {
            let job = a["job"].as_str().unwrap_or("?").to_string();
            (
                job,
                a["rank"].as_u64().unwrap_or(99),
                a["state"].to_string(),
            )
        })
        .collect();
    trainers.sort();
    let running = "\"running\"".to_string();
    assert_eq!(
        trainers,
        [
            ("interrupted".to_string(), 0, running.clone()),
            ("interrupted".to_string(), 1, running)
        ],
        "{status}"
    );
    let row = table
        .lines()
        .find(|l| l.contains("trainer") && l.split_whitespace().last() == Some("1"))
        .unwrap_or_else(|| panic!("no row for rank 1 in:\n{table}"));
    assert!(row.contains("interrupted"), "{table}");

    assert!(job.running(), "the job ended before the signal");
    let signalled = Instant::now();
    job.signal(Signal::INT);
    let out = job.finish(Duration::from_secs(30));
    eprintln!(
        "SIGINT: `imgrun train` exited after {:?}",
        signalled.elapsed()
    );
    assert_eq!(out.status.code(), Some(130), "{}", out.describe());
    assert!(
        out.stderr.contains("interrupted by SIGINT"),
        "{}",
        out.stderr
    );
    let run = cluster.runs.join("interrupted");
    let (saved_step, total) = (
        assert_checkpoint_at_last_step(&run),
        total_steps(&out.stdout, EPOCHS),
    );
    assert!(
        saved_step < total,
        "the job was not cut: step {saved_step} of {total}"
    );
    let command = printed_resume_command(&out.stderr, &run);
    cluster.assert_settled();

    let resumed = Job::start_shell(&cluster.head, &command, cluster.root.path()).finish(JOB_LIMIT);
    assert!(
        resumed.status.success(),
        "{command}\n{}",
        resumed.describe()
    );
    assert!(
        resumed
            .stdout
            .contains(&format!("global step {saved_step})")),
        "{}",
        resumed.stdout
    );
    assert_each_step_once(&metrics(&run), total);
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
    let cases: [(&str, &str, &[&str]); 13] = [
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

/// The step records of `epoch`.
fn steps_in_epoch(records: &[Value], epoch: u64) -> u64 {
    records
        .iter()
        .filter(|r| r["kind"] == "step" && r["epoch"] == epoch)
        .count() as u64
}

/// Global step → loss of the step records.
/// A resumed run's steps (each step's loss, by step) are the whole run's, each once.
fn assert_resumed_steps_match(after: &BTreeMap<u64, f64>, whole: &BTreeMap<u64, f64>) {
    assert_eq!(after.len(), whole.len(), "each step once after the resume");
    for (step, loss) in after {
        assert_eq!(Some(loss), whole.get(step), "step {step} after the resume");
    }
}

fn steps(records: &[Value]) -> BTreeMap<u64, f64> {
    records
        .iter()
        .filter(|r| r["kind"] == "step")
        .map(|r| {
            let step = r["step"].as_u64().expect("step");
            (step, r["loss"].as_f64().expect("loss"))
        })
        .collect()
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

/// The run's step records number 1 to `total`, each once.
fn assert_each_step_once(records: &[Value], total: u64) {
    let mut numbers: Vec<u64> = records
        .iter()
        .filter(|r| r["kind"] == "step")
        .filter_map(|r| r["step"].as_u64())
        .collect();
    numbers.sort_unstable();
    let want: Vec<u64> = (1..=total).collect();
    assert_eq!(numbers, want, "every step once in metrics.jsonl");
}
