//! `imgrun bench loader SPEC`: is the loader fast enough for the GPUs a user is about to
//! rent? Runs the training loader (read, decode, the train transform, batch) on the user's
//! own shards and prints its images/s and MB/s, where one worker's time goes stage by
//! stage, and the cores a target rate needs.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use pipelines::{
    BatchPolicy, ClusterShape, DecodeLimits, Hooks, Loader, LoaderConfig, OutputFormat, PlanConfig,
    PlanMode, PlanShard, Planner, Rank, ShardList, TrainTransform, Transform, process_cpu_seconds,
    profile_stages,
};

use crate::config::Loaded;
use crate::units::human_bytes;

#[derive(Debug, clap::Args)]
pub struct LoaderArgs {
    /// Shards: a brace spec (`data/train-{000000..000146}.tar`), `http(s)://` URLs or
    /// `pipe:COMMAND`.
    spec: String,
    /// A base each name goes into: where its `%s` is, or after it.
    #[arg(long)]
    base: Option<String>,
    /// Loader workers (a reader and a decoder thread each) [default: data.loader_workers].
    #[arg(long)]
    loader_workers: Option<u32>,
    /// How long the whole loader runs, in seconds.
    #[arg(long, default_value_t = 20.0)]
    seconds: f64,
    /// Stop after this many batches instead (or at `--seconds`, whichever comes first).
    #[arg(long)]
    batches: Option<u64>,
    /// Images per second you need (the GPUs' rate): prints the cores that takes.
    #[arg(long, value_name = "IMAGES_PER_S")]
    target: Option<f64>,
    /// Sets a configuration key (`--set data.image_size=160`); repeatable.
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
}

pub(super) fn run(loaded: &Loaded, args: LoaderArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        args.seconds.is_finite() && args.seconds > 0.0,
        "--seconds must be a positive number of seconds"
    );
    anyhow::ensure!(
        args.target.is_none_or(|t| t.is_finite() && t > 0.0),
        "--target must be a positive number of images per second"
    );
    let loaded = crate::config::load_with(loaded.file.as_deref(), None, &args.set)?;
    let config = &loaded.config;
    let data = &config.data;
    let urls = ShardList::from_spec_with_base(&args.spec, args.base.as_deref().unwrap_or(""))
        .with_context(|| format!("shard spec `{}`", args.spec))?
        .urls;
    anyhow::ensure!(
        !urls.is_empty(),
        "shard spec `{}` names no shards",
        args.spec
    );
    let workers = args.loader_workers.unwrap_or(data.loader_workers).max(1);
    let batch = config.train.batch_size.max(1);
    let transform = TrainTransform {
        size: data.image_size,
        scale: data.crop_scale,
        ratio: (3.0 / 4.0, 4.0 / 3.0),
        flip: data.flip,
        output: OutputFormat::Uint8Nhwc,
        limits: DecodeLimits::default(),
    };
    println!(
        "loader benchmark: {} shard(s) of `{}`, {} px crops, batches of {batch}, {workers} \
         loader worker(s)",
        urls.len(),
        args.spec,
        data.image_size
    );

    let reader = config.reader(None);
    let stages = profile_stages(&reader, &urls, &data.image_fields, &transform, 2000, 10.0)
        .context("reading the shards")?;
    anyhow::ensure!(
        stages.images > 0,
        "no sample of `{}` has an image field ({})",
        args.spec,
        data.image_fields.join(", ")
    );
    println!(
        "\none worker's stages, one thread, over the first {} images ({}, {} a mean image):",
        stages.images,
        human_bytes(stages.image_bytes),
        human_bytes(stages.image_bytes / stages.images)
    );
    let line = |what: &str, seconds: f64| {
        println!(
            "  {what:<44} {:>7.3} ms/image  {:>8.0} images/s",
            stages.ms_per_image(seconds),
            stages.images as f64 / seconds.max(1e-9)
        );
    };
    line("read (tar stream to samples)", stages.read_s);
    line("decode at full size (for reference)", stages.decode_s);
    line(
        "train transform (decode, crop, resize, flip)",
        stages.transform_s,
    );
    if stages.bad_images > 0 {
        println!(
            "  {} image(s) did not decode (the loader skips or fails on them, by shards.error_policy)",
            stages.bad_images
        );
    }

    // The whole loader, as a job runs it: resampled epochs of a fixed size, so unknown
    // counts need no manifest. The epoch is sized to outlast the run.
    let per_image_s = (stages.read_s + stages.transform_s) / stages.images as f64;
    let expected = (args.seconds / per_image_s.max(1e-6) * f64::from(workers) * 2.0) as u64;
    // With `--batches`, every worker gets its share in whole batches.
    let wanted = args.batches.map_or(expected, |b| {
        b.div_ceil(u64::from(workers))
            .saturating_mul(u64::from(workers))
            .saturating_mul(batch)
    });
    let epoch_size = wanted.clamp(batch * u64::from(workers), 50_000_000);
    let mut plan_config = PlanConfig::new(
        PlanShard::from_urls(urls.iter().cloned()),
        ClusterShape::new(1, 1, workers),
        batch,
    );
    plan_config.mode = PlanMode::Resampled;
    plan_config.policy = BatchPolicy::Join;
    plan_config.epoch_size = Some(epoch_size);
    let plan = Planner::new(plan_config, Hooks::builtin())
        .and_then(|planner| planner.plan(0))
        .context("planning the benchmark's epoch")?;
    let loader = Loader::new(
        LoaderConfig {
            image_fields: data.image_fields.clone(),
            label_field: data.label_field.clone(),
            shuffle_buffer: data.shuffle_buffer,
            shuffle_initial: (data.shuffle_buffer / 10).max(1),
            queue_batches: data.queue_batches.max(1),
            errors: config.shards.error_policy,
            ..LoaderConfig::default()
        },
        pipelines::Sources::new(config.source_options()),
    )
    .context("starting the loader")?;
    let limit = Duration::from_secs_f64(args.seconds);
    let max_batches = args.batches.unwrap_or(u64::MAX);
    let cpu_at_start = process_cpu_seconds();
    let started = Instant::now();
    let (mut images, mut batches) = (0u64, 0u64);
    let mut epoch = loader
        .epoch(&plan, Rank(0), Transform::Train(transform), None)
        .context("starting the loader's workers")?;
    for next in epoch.by_ref() {
        let batch = next.context("loading")?;
        images += batch.len() as u64;
        batches += 1;
        if batches >= max_batches || started.elapsed() >= limit {
            break;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu_s = cpu_at_start
        .zip(process_cpu_seconds())
        .map(|(start, end)| end - start);
    let skipped = epoch.stats().bad_samples;
    drop(epoch);
    anyhow::ensure!(images > 0, "the loader gave no image in {seconds:.1} s");
    let rate = images as f64 / seconds;
    let mean_image = stages.image_bytes as f64 / stages.images as f64;
    println!(
        "\nwhole loader, {workers} worker(s), {batches} batches in {seconds:.1} s: {rate:.0} \
         images/s, {}/s of images",
        human_bytes((rate * mean_image) as u64)
    );
    if skipped > 0 {
        println!("  {skipped} bad sample(s) skipped");
    }
    if let Some(cpu_s) = cpu_s.filter(|&c| c > 0.0) {
        let per_core = images as f64 / cpu_s;
        println!(
            "  {:.1} CPU core(s) busy: {per_core:.0} images/s per core",
            cpu_s / seconds
        );
        if let Some(target) = args.target {
            println!(
                "  {target:.0} images/s takes about {:.1} core(s) of this machine at this rate \
                 (with {} loader workers or more)",
                target / per_core,
                (target / per_core).ceil()
            );
        }
    } else if args.target.is_some() {
        println!("  (CPU time is not readable here: no estimate of the cores --target needs)");
    }
    Ok(ExitCode::SUCCESS)
}
