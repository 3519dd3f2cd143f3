//! End-to-end tests of `imgrun export` and `model.init`: jobs on a head and a joined node
//! (the fixture of `train/`), their checkpoints exported to safetensors and `.pt`,
//! and Python (torch, torchvision and safetensors, from `tools/pybench.sh`) loading the
//! files with `load_state_dict(strict=True)` and matching the logits imgrun computes on a
//! fixed batch. The Python side is `tests/python/weights_check.py`. A job's TensorBoard
//! event files, read by TensorBoard's own reader (`tests/python/tb_check.py`), and
//! `imgrun export tb`.

use std::path::Path;
use std::process::Stdio;

use crate::common;
use crate::common::train::{JOB_LIMIT, TrainCluster, checkpoint_dir};
use crate::common::{describe, path_str};

/// The small CNN and ResNet-18, trained for an epoch, load into PyTorch modules from both
/// formats with the logits imgrun's own model gives; bad requests are named.
#[test]
fn trained_models_load_in_torch_with_imgruns_logits() {
    let Some(python) = common::tools_python("tools/pybench.sh") else {
        return;
    };
    let cluster = TrainCluster::start();
    let dir = cluster.root.path();
    let images = dir.join("images.safetensors");
    run_python(&python, &["images", path_str(&images)]);
    let cases = [
        ("small", "small_cnn", &[][..]),
        (
            "resnet",
            "resnet18",
            &["model.name=resnet18", "data.epoch_size=64"][..],
        ),
    ];
    for (name, model, sets) in cases {
        let mut job = cluster.job(name, 1, sets, false);
        let out = job.finish(JOB_LIMIT);
        assert!(out.status.success(), "{name}: {}", out.describe());
        let run = cluster.runs.join(name);
        let logits = dir.join(format!("{name}.logits.safetensors"));
        let (pt, st) = (
            dir.join(format!("{name}.pt")),
            dir.join(format!("{name}.st")),
        );
        // The run folder's latest checkpoint, with the format named, and the run by its
        // name under train.runs_dir, with the format taken from the extension.
        let printed = export(
            &cluster,
            &[
                path_str(&run),
                "--format",
                "safetensors",
                "-o",
                path_str(&st),
                "--logits-for",
                path_str(&images),
                "--logits-to",
                path_str(&logits),
            ],
        );
        assert!(
            printed.contains(&format!("{model} (4 classes), safetensors")),
            "{printed}"
        );
        let mut by_name = cluster.head.command(&["export", name, "-o", path_str(&pt)]);
        by_name.env("IMGRUN_TRAIN__RUNS_DIR", path_str(&cluster.runs));
        let out = by_name.output().expect("run imgrun export");
        assert!(out.status.success(), "export {name}: {}", describe(&out));
        let width = if model == "small_cnn" { "8" } else { "0" };
        let checked = run_python(
            &python,
            &[
                "check",
                model,
                "4",
                width,
                path_str(&pt),
                path_str(&st),
                path_str(&images),
                path_str(&logits),
            ],
        );
        assert!(checked.contains("strict load"), "{checked}");
    }

    // A named checkpoint of the run, and the errors.
    let small = cluster.runs.join("small");
    let checkpoint = checkpoint_dir(&small);
    let named = checkpoint
        .file_name()
        .and_then(|n| n.to_str())
        .expect("a name");
    let again = dir.join("again.pt");
    export(
        &cluster,
        &[
            path_str(&small),
            "--checkpoint",
            named,
            "-o",
            path_str(&again),
        ],
    );
    export(&cluster, &[path_str(&checkpoint), "-o", path_str(&again)]);
    let (nope, bin, missing) = (
        dir.join("nope"),
        dir.join("w.bin"),
        dir.join("missing/w.pt"),
    );
    let failures = [
        (
            vec![path_str(&nope), "-o", path_str(&again)],
            "nope: no such run",
        ),
        (
            vec![
                path_str(&small),
                "--checkpoint",
                "epoch-9999",
                "-o",
                path_str(&again),
            ],
            "no checkpoint \"epoch-9999\"",
        ),
        (
            vec![path_str(&small), "--format", "onnx", "-o", path_str(&again)],
            "unknown format \"onnx\"; expected one of safetensors, pt",
        ),
        (
            vec![path_str(&small), "-o", path_str(&bin)],
            "w.bin: say --format safetensors or --format pt",
        ),
        (
            vec![path_str(&small), "-o", path_str(&missing)],
            "missing/w.pt: No such file or directory",
        ),
    ];
    for (args, want) in failures {
        let out = cluster.head.run(&args_with_export(&args));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(want),
            "{args:?}: {stderr}"
        );
    }
}

/// A job started from torchvision's freshly initialised ResNet-50 (`torch.save` of its
/// state dict) trains from those weights: at a learning rate of 1e-30 the exported
/// parameters are still torchvision's, and the export's logits match imgrun's. A file of
/// another model is refused before anything starts, naming the tensor and the file.
#[test]
fn a_job_starts_from_torchvisions_resnet50_weights() {
    let Some(python) = common::tools_python("tools/pybench.sh") else {
        return;
    };
    let cluster = TrainCluster::start();
    let dir = cluster.root.path();
    let images = dir.join("images.safetensors");
    run_python(&python, &["images", path_str(&images)]);
    let init = dir.join("torchvision-resnet50.pt");
    run_python(&python, &["torchvision", "resnet50", "4", path_str(&init)]);
    let init_set = format!("model.init={:?}", path_str(&init));
    let sets = [
        "model.name=resnet50",
        "data.epoch_size=64",
        "train.lr=1e-30",
        init_set.as_str(),
    ];
    let mut job = cluster.job("r50", 1, &sets, false);
    let out = job.finish(JOB_LIMIT);
    assert!(out.status.success(), "{}", out.describe());
    let said = format!("tensors from {}", path_str(&init));
    assert!(
        out.stdout.contains("model.init: ")
            && out.stdout.contains(&said)
            && !out.stdout.contains("replaced"),
        "{}",
        out.describe()
    );
    let run = cluster.runs.join("r50");
    let logits = dir.join("r50.logits.safetensors");
    let (pt, st) = (dir.join("r50.pt"), dir.join("r50.safetensors"));
    export(&cluster, &[path_str(&run), "-o", path_str(&pt)]);
    export(
        &cluster,
        &[
            path_str(&run),
            "-o",
            path_str(&st),
            "--logits-for",
            path_str(&images),
            "--logits-to",
            path_str(&logits),
        ],
    );
    let checked = run_python(
        &python,
        &[
            "check",
            "resnet50",
            "4",
            "0",
            path_str(&pt),
            path_str(&st),
            path_str(&images),
            path_str(&logits),
            path_str(&init),
        ],
    );
    assert!(checked.contains("parameters are"), "{checked}");

    // ResNet-18's weights do not fit ResNet-50: refused before the job starts.
    let wrong = dir.join("torchvision-resnet18.pt");
    run_python(&python, &["torchvision", "resnet18", "4", path_str(&wrong)]);
    let wrong_set = format!("model.init={:?}", path_str(&wrong));
    let mut job = cluster.job(
        "wrong",
        1,
        &["model.name=resnet50", wrong_set.as_str()],
        false,
    );
    let out = job.finish(JOB_LIMIT);
    assert!(!out.status.success(), "{}", out.describe());
    assert!(
        out.stderr
            .contains("torchvision-resnet18.pt: has no `layer1.0.bn3.bias`, which resnet50 needs")
            || out
                .stderr
                .contains("torchvision-resnet18.pt: `layer1.0.conv1.weight` has shape"),
        "{}",
        out.describe()
    );
    assert!(!cluster.runs.join("wrong").join("checkpoints").exists());
}

/// A job writes its metrics as a TensorBoard event file in the run's `tb/` as it runs;
/// TensorBoard's own reader (`tests/python/tb_check.py`) finds every step's loss there,
/// as `metrics.jsonl` has it; with `train.tensorboard_ranks` each rank's figures go to a
/// run of its own, `tb/rank-N/`, every (tag, step, value) as `metrics.jsonl` has it;
/// `imgrun export tb` writes the same bytes, every file, from `metrics.jsonl`, and will
/// not add a second file to a `tb/` that has one.
#[test]
fn a_job_writes_tensorboard_events_that_tensorboard_reads_and_export_tb_repeats() {
    let Some(python) = common::tools_python("tools/pybench.sh") else {
        return;
    };
    let cluster = TrainCluster::start();
    let mut job = cluster.job("tb", 1, &["train.tensorboard_ranks=true"], false);
    let out = job.finish(JOB_LIMIT);
    assert!(out.status.success(), "{}", out.describe());
    let run = cluster.runs.join("tb");
    let event_files = |dir: &Path| -> Vec<std::path::PathBuf> {
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .unwrap_or_else(|error| panic!("{}: {error}", dir.display()))
            .map(|entry| entry.expect("entry").path())
            .filter(|path| path.to_string_lossy().contains("tfevents"))
            .collect();
        files.sort();
        files
    };
    let live = event_files(&run.join("tb"));
    assert_eq!(live.len(), 1, "{live:?}");
    // The cluster's two ranks, each in a run of its own.
    let records = common::train::metrics(&run);
    assert_eq!(common::assert_rank_runs_match(&python, &run, &records), 2);
    let live_ranks: Vec<_> = (0..2)
        .map(|rank| event_files(&run.join("tb").join(format!("rank-{rank}"))))
        .collect();

    // What TensorBoard charts: every step's loss, at its step.
    let charted = common::tensorboard_scalars(&python, &run.join("tb"), "train/loss");
    let recorded: Vec<(u64, f32)> = records
        .iter()
        .filter(|r| r["kind"] == "step")
        .map(|r| {
            let step = r["step"].as_u64().expect("step");
            (step, r["loss"].as_f64().expect("loss") as f32)
        })
        .collect();
    assert!(!recorded.is_empty());
    assert_eq!(charted, recorded);
    for tag in ["train/lr", "train/images_per_s", "eval/top1", "job/world"] {
        assert!(
            !common::tensorboard_scalars(&python, &run.join("tb"), tag).is_empty(),
            "no {tag}"
        );
    }

    // The export writes the same events, byte for byte.
    let exported = cluster.root.path().join("exported");
    let printed = export(&cluster, &["tb", path_str(&run), "-o", path_str(&exported)]);
    assert!(printed.contains("tensorboard --logdir"), "{printed}");
    let again = event_files(&exported);
    assert_eq!(again.len(), 1, "{again:?}");
    assert_eq!(
        std::fs::read(&again[0]).expect("read"),
        std::fs::read(&live[0]).expect("read")
    );
    assert!(printed.contains("and 2 ranks' runs"), "{printed}");
    for (rank, live) in live_ranks.iter().enumerate() {
        let again = event_files(&exported.join(format!("rank-{rank}")));
        assert_eq!((again.len(), live.len()), (1, 1), "rank {rank}: {again:?}");
        assert_eq!(
            std::fs::read(&again[0]).expect("read"),
            std::fs::read(&live[0]).expect("read"),
            "rank {rank}'s exported events against the live ones"
        );
    }
    let out = cluster
        .head
        .command(&["export", "tb", path_str(&run)])
        .output()
        .expect("run imgrun export tb");
    assert!(!out.status.success(), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("already holds event files"),
        "{}",
        describe(&out)
    );
}

fn args_with_export<'a>(args: &[&'a str]) -> Vec<&'a str> {
    let mut all = vec!["export"];
    all.extend_from_slice(args);
    all
}

/// `imgrun export ARGS` on the head's machine; its standard output.
fn export(cluster: &TrainCluster, args: &[&str]) -> String {
    cluster.head.run_ok(&args_with_export(args))
}

/// Runs the check script; its standard output, after it succeeded.
fn run_python(python: &Path, args: &[&str]) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/weights_check.py");
    let out = std::process::Command::new(python)
        .arg(&script)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "weights_check.py {args:?}:\n{}",
        describe(&out)
    );
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    println!("weights_check.py {}:\n{printed}", args[0]);
    printed
}
