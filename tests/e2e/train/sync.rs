//! How ranks combine their work, each checked to the bit: decentralized mixing with
//! neighbours, loss scaling, and an allreduce overlapped with backward.

use serde_json::Value;

use super::{assert_resumed_steps_match, steps};
use crate::common::train::{JOB_LIMIT, TrainCluster, metrics, replica_digest};

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
