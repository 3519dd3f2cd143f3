//! Checkpoints and resuming: from a mid-epoch checkpoint as an uninterrupted run, at
//! every multiple of the step interval, the newest few kept, and after Ctrl-C with the
//! command the job prints.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rustix::process::Signal;
use serde_json::Value;

use super::steps;
use crate::common::train::{
    JOB_LIMIT, Job, TrainCluster, assert_checkpoint_at_last_step, assert_resumed_from_step,
    last_step_value, metrics, printed_resume_command, read_json, replica_digest, total_steps,
};

/// A job stopped with SIGTERM after a mid-epoch checkpoint and resumed from that
/// checkpoint continues at the saved step and trains exactly as an uninterrupted job: its
/// metrics.jsonl holds every step once (what was written past the checkpoint is
/// dropped) and the resumed epoch's train loss covers the whole epoch. With
/// `train.tensorboard_ranks`, TensorBoard's rank runs hold each step once too.
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

    // Without `train.tensorboard_ranks`, no step record carries the ranks' figures and
    // TensorBoard has no rank runs; the cut and resumed runs below have it on (and train
    // as the whole one does).
    assert!(whole_records.iter().all(|r| r.get("ranks").is_none()));
    assert!(!cluster.runs.join("whole/tb/rank-0").exists());
    let every_ranks = [every[0], every[1], "train.tensorboard_ranks=true"];

    // Interrupted once a checkpoint in the second epoch exists.
    let run = cluster.runs.join("cut");
    let mut job = cluster.job("cut", EPOCHS, &every_ranks, false);
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
        .job_with("cut", EPOCHS, &every_ranks, false, &resume)
        .finish(JOB_LIMIT);
    assert!(resumed.status.success(), "{}", resumed.describe());
    assert_resumed_from_step(&resumed, saved_step);

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
    // TensorBoard charts the same steps, each once with the value metrics.jsonl keeps:
    // the resumed run's START drops the cut run's steps past the checkpoint, not the
    // checkpoint's own.
    if let Some(python) = crate::common::tools_python("tools/pybench.sh") {
        let charted = crate::common::tensorboard_scalars(&python, &run.join("tb"), "train/loss");
        let kept: Vec<(u64, f32)> = steps(&records)
            .into_iter()
            .map(|(step, loss)| (step, loss as f32))
            .collect();
        assert_eq!(
            charted, kept,
            "TensorBoard's train/loss against metrics.jsonl"
        );
        // And each rank's run: every (tag, step, value), the START in each rank's file.
        assert_eq!(
            crate::common::assert_rank_runs_match(&python, &run, &records),
            2
        );
    }
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

/// `checkpoint_every_steps = K` saves a checkpoint at every multiple of K inside an epoch.
#[test]
fn step_checkpoints_land_on_every_multiple() {
    const EVERY: u64 = 3;
    let cluster = TrainCluster::start();
    let every = format!("train.checkpoint_every_steps={EVERY}");
    let sets = [every.as_str(), "train.keep_checkpoints=0"];
    let out = cluster.job("every", 2, &sets, false).finish(JOB_LIMIT);
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

/// `train.keep_checkpoints = 2`: of a run's many step and epoch checkpoints, the newest
/// two remain, the one `latest` names (at the run's last step) among them.
#[test]
fn a_run_keeps_its_newest_checkpoints() {
    let cluster = TrainCluster::start();
    let sets = ["train.checkpoint_every_steps=2", "train.keep_checkpoints=2"];
    let out = cluster.job("kept", 2, &sets, false).finish(JOB_LIMIT);
    assert!(out.status.success(), "{}", out.describe());
    let run = cluster.runs.join("kept");
    let root = run.join("checkpoints");
    let mut kept: Vec<(u64, String)> = std::fs::read_dir(&root)
        .expect("checkpoints")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|name| name != "latest")
        .map(|name| {
            let state = read_json(&root.join(&name).join("state.json"));
            (state["global_step"].as_u64().expect("global_step"), name)
        })
        .collect();
    kept.sort();
    let last = last_step_value(&metrics(&run))
        .and_then(|v| v.as_u64())
        .expect("a last step");
    assert_eq!(kept.len(), 2, "{kept:?}");
    assert_eq!(kept[1].0, last, "{kept:?}");
    assert!(
        kept[0].0 < last && kept[0].0 >= last.saturating_sub(2),
        "{kept:?}"
    );
    let latest = std::fs::read_to_string(root.join("latest")).expect("latest");
    assert_eq!(latest.trim(), kept[1].1);
}

/// `train.keep_best`: with one newest checkpoint kept, the one of the best validation
/// top-1 stays too. Every checkpoint of this run has an evaluation at its step (every two
/// steps and at each epoch's end), which its `state.json` records; what remains is
/// `latest` and the checkpoint of the best evaluation (the newest of equals).
#[test]
fn a_run_keeps_its_best_checkpoint_by_validation_top1() {
    let cluster = TrainCluster::start();
    let sets = [
        "train.checkpoint_every_steps=2",
        "train.eval_every_steps=2",
        "train.keep_checkpoints=1",
        "train.keep_best=true",
    ];
    let out = cluster.job("best", 2, &sets, false).finish(JOB_LIMIT);
    assert!(out.status.success(), "{}", out.describe());
    let run = cluster.runs.join("best");
    let root = run.join("checkpoints");
    let kept: BTreeMap<u64, (String, Option<f64>)> = std::fs::read_dir(&root)
        .expect("checkpoints")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|name| name != "latest")
        .map(|name| {
            let state = read_json(&root.join(&name).join("state.json"));
            let step = state["global_step"].as_u64().expect("global_step");
            (step, (name, state["val_top1"].as_f64()))
        })
        .collect();
    let records = metrics(&run);
    let evals: BTreeMap<u64, f64> = records
        .iter()
        .filter(|r| r["kind"] == "eval")
        .map(|r| {
            let step = r["step"].as_u64().expect("step");
            (step, r["top1"].as_f64().expect("top1"))
        })
        .collect();
    // The newest of the best: the last step whose top-1 is the largest.
    let best = evals
        .iter()
        .fold(
            None,
            |best: Option<(u64, f64)>, (&step, &top1)| match best {
                Some((_, b)) if b > top1 => best,
                _ => Some((step, top1)),
            },
        )
        .expect("evaluations");
    let last = last_step_value(&records)
        .and_then(|v| v.as_u64())
        .expect("a last step");
    let want: Vec<u64> = BTreeMap::from([(best.0, ()), (last, ())])
        .into_keys()
        .collect();
    assert_eq!(
        kept.keys().copied().collect::<Vec<_>>(),
        want,
        "{kept:?}, evals {evals:?}"
    );
    for (step, (name, top1)) in &kept {
        assert_eq!(
            *top1,
            evals.get(step).copied(),
            "{name}: its state's val_top1"
        );
    }
    let latest = std::fs::read_to_string(root.join("latest")).expect("latest");
    assert_eq!(latest.trim(), kept[&last].0);
}

/// While a job runs, `imgrun status` names its job and each trainer's rank. Ctrl-C then
/// lets the step in flight end, saves a checkpoint at the last completed step, stops
/// every trainer, exits with 130 and prints the command that continues the run; that
/// command, run as printed, finishes the job with every step in metrics.jsonl once.
#[test]
fn ctrl_c_checkpoints_the_last_step_and_prints_the_command_that_resumes() {
    // Long enough to be running still when the signal comes, after the status checks
    // (an epoch can take 0.2 s on an idle machine: 12 epochs once ended before it); no
    // evaluations or checkpoints before the end. Under a full test run an epoch can take
    // 4 s, so the resumed run gets three times the usual limit.
    const EPOCHS: u64 = 30;
    let quick = [
        "train.eval_every_epochs=0",
        "train.checkpoint_every_epochs=0",
    ];
    let cluster = TrainCluster::start();
    let mut job = cluster.job("interrupted", EPOCHS, &quick, false);
    cluster.wait_for_steps(&mut job, "interrupted", 1);
    let table = cluster.head.run_ok(&["status"]);
    let status = cluster.head.status();
    let reserved = cluster.head.job_reservations().len();
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

    let resumed =
        Job::start_shell(&cluster.head, &command, cluster.root.path()).finish(3 * JOB_LIMIT);
    assert!(
        resumed.status.success(),
        "{command}\n{}",
        resumed.describe()
    );
    assert_resumed_from_step(&resumed, saved_step);
    assert_each_step_once(&metrics(&run), total);
    cluster.assert_settled();
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
