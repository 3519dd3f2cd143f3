//! What the trainers read: the steps `imgrun plan` and `imgrun train` agree on, shards
//! written by Python over a pipe and HTTP, a rank that waits for data, the image-size
//! schedule across phases, and user hooks that choose shards.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::{assert_resumed_steps_match, steps};
use crate::common;
use crate::common::train::{
    BATCH, JOB_LIMIT, TrainCluster, metrics, read_json, replica_digest, synth_shards,
};
use crate::common::{describe, wait_for};

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
    let Some(python) = common::tools_python("tools/pytools.sh") else {
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

/// A rank whose loader is slow holds every rank up in the gradient average: the job
/// names it, its node and why, and records it in the metrics. Rank 1's shards come
/// through a command that waits 3 s before it sends anything, and then until the test
/// has seen the wait (a file it creates): on a loaded machine a fixed wait could end
/// before `imgrun jobs` answers once.
#[test]
fn a_rank_that_waits_for_data_is_named_with_its_node_and_why() {
    let cluster = TrainCluster::start();
    let dir = cluster.data.train_dir.display().to_string();
    let seen_marker = cluster.root.path().join("rank-1-seen-waiting");
    let shard = |i: usize| format!("{dir}/train-{i:06}.tar");
    let slow = |i: usize| {
        format!(
            "pipe:sh -c 'sleep 3; while [ ! -e {} ]; do sleep 0.1; done; cat {}'",
            seen_marker.display(),
            shard(i)
        )
    };
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
    std::fs::write(&seen_marker, b"").expect("write the marker the slow shards wait for");
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
            && out.stderr.contains(", reading pipe:sh -c 'sleep 3; "),
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

/// The step records of `epoch`.
fn steps_in_epoch(records: &[Value], epoch: u64) -> u64 {
    records
        .iter()
        .filter(|r| r["kind"] == "step" && r["epoch"] == epoch)
        .count() as u64
}
