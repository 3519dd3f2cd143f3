//! `imgrun demo`: the main job on the embedded default, with nothing to set up. It
//! generates the synthetic shapes dataset as shards (a train and a held-out val set),
//! starts an embedded cluster with two CPU trainers, trains the small CNN
//! (`examples/demo.toml`), prints the per-epoch table and the final validation accuracy,
//! and draws the metrics plot.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use pipelines::{SynthOptions, generate_synthetic};

use crate::commands::progress_bar;
use crate::commands::train::{JobOptions, train_job};
use crate::config::{JobPreset, Loaded};

/// The demo's job, between the built-in defaults and the user's file.
pub const DEMO_JOB: &str = include_str!("../../examples/demo.toml");

/// Validation top-1 the demo is expected to reach.
const GOAL: f64 = 0.90;

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
    let config = crate::config::load_with(
        loaded.file.as_deref(),
        Some(JobPreset {
            name: "the demo's job (examples/demo.toml)",
            text: DEMO_JOB,
        }),
        &overrides,
    )?;
    let trainers = match config.config.train.cpu_trainers {
        0 => "one CPU trainer".to_string(),
        2 => "two CPU trainers".to_string(),
        n => format!("{n} CPU trainers"),
    };
    println!("\n== 2/2 training the small CNN on an embedded cluster with {trainers}");
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
    if top1 > GOAL {
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!(
            "error: validation top-1 {:.2}% is not above the demo's goal of {:.0}%",
            top1 * 100.0,
            GOAL * 100.0
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
