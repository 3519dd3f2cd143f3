//! `imgrun demo`: the main job on the embedded default, with nothing to set up. It
//! generates the synthetic shapes dataset as shards (a train and a held-out val set),
//! starts an embedded cluster with two CPU trainers (or, on a machine with GPUs, CUDA
//! trainers with the same global batch), trains the small CNN (`examples/demo.toml`),
//! prints the per-epoch table and the final validation accuracy, and draws the metrics
//! plot.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use pipelines::{SynthOptions, generate_synthetic};

use crate::commands::progress_bar;
use crate::commands::train::{JobOptions, train_job};
use crate::config::{JobPreset, Loaded, TrainConfig};

/// The demo's job, between the built-in defaults and the user's file.
pub const DEMO_JOB: &str = include_str!("../../examples/demo.toml");

/// Validation top-1 the demo is expected to reach.
const GOAL: f64 = 0.90;

/// Loader workers per CUDA trainer at most: a GPU steps the small CNN far faster than one
/// worker decodes, and the demo's own file asks for one (it was tuned on 2 CPU cores).
const MAX_GPU_LOADER_WORKERS: u32 = 8;

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Where the demo's shards and run go.
    #[arg(long, default_value = "imgrun-demo")]
    out: PathBuf,
    /// Training images per class (10 classes).
    #[arg(long, default_value_t = 1000)]
    per_class: u32,
    /// Validation images per class.
    #[arg(long, default_value_t = 200)]
    val_per_class: u32,
    /// Sets a configuration key of the job (`--set train.epochs=3`); repeatable.
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
    /// Validation top-1 (0 to 1) the run must exceed to succeed.
    #[arg(long, default_value_t = GOAL)]
    goal: f64,
}

/// Who trains the demo, and with what batch and loaders.
#[derive(Debug, Clone, PartialEq, Eq)]
struct DemoWorld {
    /// `train.gpus`: CUDA trainers (0: none, the CPU trainers of the job).
    gpus: u32,
    /// `train.batch_size`: per trainer, so that the global batch (and with it the
    /// learning rate, scaled to it) is the job's whatever the world.
    batch_size: u64,
    /// `data.loader_workers` per trainer.
    loader_workers: u32,
    /// What the demo says it trains on.
    trainers: String,
}

/// The demo's world on a machine with `found` GPUs and `cores` CPUs. The job asks for
/// `cpu_trainers` trainers of `batch_size` each (`train.gpus` = 0: every free GPU). On a
/// machine with GPUs it runs as many CUDA trainers as it has CPU trainers (at most), each
/// with a share of the same global batch, and more loader workers: a GPU outruns one.
fn demo_world(train: &TrainConfig, loader_workers: u32, found: usize, cores: usize) -> DemoWorld {
    let cpu = train.cpu_trainers.max(1);
    let count = |n: u32, what: &str| match n {
        1 => format!("one {what} trainer"),
        2 => format!("two {what} trainers"),
        n => format!("{n} {what} trainers"),
    };
    let found = u32::try_from(found).unwrap_or(u32::MAX);
    if found == 0 {
        return DemoWorld {
            gpus: train.gpus,
            batch_size: train.batch_size,
            loader_workers,
            trainers: count(cpu, "CPU"),
        };
    }
    let gpus = if train.gpus > 0 {
        train.gpus
    } else {
        found.min(cpu)
    };
    let global = train.batch_size * u64::from(cpu);
    let batch_size = (global / u64::from(gpus)).max(1);
    let cores = u32::try_from(cores).unwrap_or(u32::MAX);
    let per_gpu = (cores / gpus).saturating_sub(1);
    DemoWorld {
        gpus,
        batch_size,
        loader_workers: per_gpu.clamp(loader_workers, MAX_GPU_LOADER_WORKERS.max(loader_workers)),
        trainers: format!(
            "{}, batch {batch_size} each (global {})",
            count(gpus, "CUDA"),
            batch_size * u64::from(gpus)
        ),
    }
}

pub fn run(loaded: &Loaded, args: DemoArgs) -> anyhow::Result<ExitCode> {
    println!(
        "== 1/2 generating the synthetic shapes dataset in {}",
        args.out.display()
    );
    let train = generate(&args.out.join("train"), "demo-train", args.per_class, 1)?;
    let val = generate(&args.out.join("val"), "demo-val", args.val_per_class, 2)?;

    let name = actors::job::timestamped_name("demo");
    let mut overrides = vec![
        format!("data.train={}", toml_string(&train)),
        format!("data.val={}", toml_string(&val)),
        format!(
            "train.runs_dir={}",
            toml_string(&args.out.join("runs").display().to_string())
        ),
        format!("train.name={}", toml_string(&name)),
    ];
    overrides.extend(args.set.iter().cloned());
    let mut config = crate::config::load_with(
        loaded.file.as_deref(),
        Some(JobPreset {
            name: "the demo's job (examples/demo.toml)",
            text: DEMO_JOB,
        }),
        &overrides,
    )?;
    // The embedded cluster is this machine: what its node will offer.
    let node = runtime::discover(&runtime::DiscoverOptions::default());
    let world = demo_world(
        &config.config.train,
        config.config.data.loader_workers,
        node.gpus.len(),
        node.cpus,
    );
    config.config.train.gpus = world.gpus;
    config.config.train.batch_size = world.batch_size;
    config.config.data.loader_workers = world.loader_workers;
    println!(
        "\n== 2/2 training the small CNN on an embedded cluster with {}",
        world.trainers
    );
    if let Some(line) = config.describe_sources() {
        println!("   {line}");
    }
    let started = Instant::now();
    let summary = train_job(
        &config.config,
        &JobOptions {
            embedded: true,
            plot: true,
            ..JobOptions::default()
        },
    )?;
    let top1 = summary.top1.unwrap_or(0.0);
    println!(
        "\ndone in {:.0} s: validation top-1 {:.2}%, top-5 {:.2}%; loss {:.3} -> {:.3}; {:.0} images/s",
        started.elapsed().as_secs_f64(),
        top1 * 100.0,
        summary.top5.unwrap_or(0.0) * 100.0,
        summary.first_loss.unwrap_or(f32::NAN),
        summary.last_loss.unwrap_or(f32::NAN),
        summary.images_per_s
    );
    println!(
        "run folder: {} (metrics.jsonl, metrics.png, checkpoints/)",
        summary.run_dir.display()
    );
    if top1 > args.goal {
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!(
            "error: validation top-1 {:.2}% is not above the demo's goal of {:.0}%",
            top1 * 100.0,
            args.goal * 100.0
        );
        Ok(ExitCode::FAILURE)
    }
}

/// Generates one split; returns its shards as a brace spec.
fn generate(dir: &Path, prefix: &str, per_class: u32, seed: u64) -> anyhow::Result<String> {
    let options = SynthOptions {
        per_class,
        seed,
        prefix: prefix.to_string(),
        max_count: 250,
        ..SynthOptions::default()
    };
    let started = Instant::now();
    let bar = progress_bar(u64::from(options.classes) * u64::from(per_class), prefix);
    let report = generate_synthetic(dir, &options, &|n| bar.inc(n))?;
    bar.finish_and_clear();
    println!(
        "   {}: {} images in {} shards ({:.1} s)",
        report.spec,
        report.manifest.total_samples(),
        report.shards.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(report.spec)
}

/// `text` as a TOML string literal.
fn toml_string(text: &str) -> String {
    format!("{text:?}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_demo_keeps_its_global_batch_on_any_world() {
        let job = crate::config::load_with(
            None,
            Some(JobPreset {
                name: "demo",
                text: DEMO_JOB,
            }),
            &[],
        )
        .expect("the demo's job loads")
        .config;
        let (batch, workers) = (job.train.batch_size, job.data.loader_workers);
        assert_eq!((job.train.cpu_trainers, batch, workers), (2, 64, 1));
        // (GPUs found, cores, train.gpus) -> (gpus, batch, loader workers, trainers)
        let cases = [
            (0, 2, 0, (0, 64, 1, "two CPU trainers")),
            (0, 64, 0, (0, 64, 1, "two CPU trainers")),
            (
                1,
                16,
                0,
                (1, 128, 8, "one CUDA trainer, batch 128 each (global 128)"),
            ),
            (
                1,
                2,
                0,
                (1, 128, 1, "one CUDA trainer, batch 128 each (global 128)"),
            ),
            (
                2,
                8,
                0,
                (2, 64, 3, "two CUDA trainers, batch 64 each (global 128)"),
            ),
            (
                8,
                96,
                0,
                (2, 64, 8, "two CUDA trainers, batch 64 each (global 128)"),
            ),
            (
                8,
                96,
                4,
                (4, 32, 8, "4 CUDA trainers, batch 32 each (global 128)"),
            ),
        ];
        for (found, cores, gpus, (want_gpus, want_batch, want_workers, want_text)) in cases {
            let mut train = job.train.clone();
            train.gpus = gpus;
            let world = demo_world(&train, workers, found, cores);
            assert_eq!(
                world,
                DemoWorld {
                    gpus: want_gpus,
                    batch_size: want_batch,
                    loader_workers: want_workers,
                    trainers: want_text.to_string(),
                },
                "{found} GPUs, {cores} cores, train.gpus {gpus}"
            );
        }
    }
}
