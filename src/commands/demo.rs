//! `imgrun demo`: the main job on the embedded default dataset. Until training lands it
//! generates the synthetic shapes dataset as shards, reads every shard back (timing the
//! raw sample iteration), and verifies that every image and label decodes.

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use pipelines::{ErrorPolicy, Manifest, SynthOptions, generate_synthetic, verify_shard};

use crate::commands::{progress_bar, shards::print_report};
use crate::config::Loaded;
use crate::units::human_bytes;

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Where the demo's shards go.
    #[arg(long, default_value = "imgrun-demo")]
    out: PathBuf,
    /// Classes of the generated dataset.
    #[arg(long, default_value_t = 10)]
    classes: u32,
    /// Images per class.
    #[arg(long, default_value_t = 500)]
    per_class: u32,
    /// Image side in pixels.
    #[arg(long, default_value_t = 64)]
    size: u32,
}

pub fn run(loaded: &Loaded, args: DemoArgs) -> anyhow::Result<ExitCode> {
    println!(
        "== 1/3 generating {} x {} synthetic images into {}",
        args.classes,
        args.per_class,
        args.out.display()
    );
    let options = SynthOptions {
        classes: args.classes,
        per_class: args.per_class,
        size: args.size,
        prefix: "demo-train".to_string(),
        ..SynthOptions::default()
    };
    let started = Instant::now();
    let bar = progress_bar(u64::from(args.classes) * u64::from(args.per_class), "synth");
    let report = generate_synthetic(&args.out, &options, &|n| bar.inc(n))?;
    bar.finish_and_clear();
    print_report(&report);
    println!("   took {:.2} s", started.elapsed().as_secs_f64());

    let urls: Vec<String> = report
        .shards
        .iter()
        .map(|s| s.path.display().to_string())
        .collect();
    println!("== 2/3 reading the shards back");
    let reader = loaded.config.shards.reader(Some(ErrorPolicy::Fail));
    let started = Instant::now();
    let mut per_class = vec![0u64; report.manifest.classes.len()];
    let stats = reader.read_all(&urls, &mut |sample| {
        if let Some(Ok(class)) = sample.int_field("cls") {
            if let Some(count) = usize::try_from(class)
                .ok()
                .and_then(|c| per_class.get_mut(c))
            {
                *count += 1;
            }
        }
        ControlFlow::Continue(())
    })?;
    let seconds = started.elapsed().as_secs_f64().max(1e-9);
    println!(
        "   {} samples, {} in {:.3} s: {:.0} samples/s, {:.1} MB/s",
        stats.samples,
        human_bytes(stats.payload_bytes),
        seconds,
        stats.samples as f64 / seconds,
        stats.payload_bytes as f64 / seconds / 1e6
    );
    let manifest = Manifest::read_from(&args.out)?;
    for (class, name) in manifest.classes.iter().enumerate() {
        println!(
            "   class {class:>2} {name:<24} {:>6} samples",
            per_class[class]
        );
    }
    anyhow::ensure!(
        stats.samples == manifest.total_samples(),
        "read {} samples but the manifest lists {}",
        stats.samples,
        manifest.total_samples()
    );

    println!("== 3/3 verifying every image and label");
    let (mut images, mut problems) = (0, 0);
    for url in &urls {
        let report = verify_shard(&reader, url, Some("cls"));
        images += report.images;
        for problem in &report.problems {
            println!("   {problem}");
        }
        problems += report.problems.len();
    }
    println!("   {images} images decoded, {problems} problems");
    println!("done: shards in {}", args.out.display());
    Ok(if problems == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
