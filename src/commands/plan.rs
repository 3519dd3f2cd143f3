//! `imgrun plan`: a dry run of epoch planning that prints, per rank and worker, the
//! shards, samples and batches, and what the batch policy does.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use pipelines::{
    BatchPolicy, ClusterShape, HookLimits, Hooks, Manifest, PlanConfig, PlanMode, PlanShard,
    Planner, ShardList, render_plan,
};

use crate::config::Loaded;

#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// Shards, as a brace spec (`data/train-{000000..000146}.tar`).
    #[arg(long)]
    shards: String,
    /// manifest.json with per-shard sample counts [default: the one beside local shards].
    #[arg(long)]
    manifest: Option<PathBuf>,
    /// Samples assumed for shards the manifest does not list.
    #[arg(long)]
    samples_per_shard: Option<u64>,
    #[arg(long, default_value_t = 1)]
    nodes: u32,
    #[arg(long, default_value_t = 1)]
    ranks_per_node: u32,
    /// Loader workers per rank.
    #[arg(long, default_value_t = 1)]
    workers: u32,
    #[arg(long)]
    batch_size: u64,
    /// `resampled` (shards drawn with replacement) or `split` (exact epochs).
    #[arg(long, default_value = "resampled")]
    mode: PlanMode,
    /// When ranks disagree on batches: none, join, drop, repeat.
    #[arg(long, default_value = "none")]
    policy: String,
    /// Batches every rank runs (implies `--policy drop` unless `--dsrepeat` is given).
    #[arg(long)]
    nbatches: Option<u64>,
    /// Read the data this many times before truncating (implies `--policy repeat`).
    #[arg(long)]
    dsrepeat: Option<u64>,
    /// Keep each worker's last partial batch.
    #[arg(long)]
    partial: bool,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, default_value_t = 0)]
    epoch: u64,
    /// Samples served per epoch, over all ranks (chopped epochs in split mode).
    #[arg(long)]
    epoch_size: Option<u64>,
    /// Epoch length reported to schedules and progress.
    #[arg(long)]
    nominal_size: Option<u64>,
    /// Folder with the user's hook scripts (reseed.rhai, node_selection.rhai, ...).
    #[arg(long)]
    hooks: Option<PathBuf>,
}

fn policy(args: &PlanArgs) -> anyhow::Result<BatchPolicy> {
    BatchPolicy::parse(&args.policy, args.nbatches, args.dsrepeat)
        .map_err(|e| anyhow::anyhow!("--policy: {e}"))
}

/// The manifest given, or the one beside the first shard when the shards are local.
fn find_manifest(args: &PlanArgs, urls: &[String]) -> anyhow::Result<Option<Manifest>> {
    if let Some(path) = &args.manifest {
        let dir = path.parent().unwrap_or(Path::new("."));
        anyhow::ensure!(
            path.file_name()
                .is_some_and(|n| n == pipelines::MANIFEST_FILE),
            "--manifest must point to a {} file",
            pipelines::MANIFEST_FILE
        );
        return Ok(Some(Manifest::read_from(dir)?));
    }
    let local_dir = urls
        .first()
        .filter(|u| !u.contains(':') || u.starts_with("file:"))
        .map(|u| {
            Path::new(u.trim_start_matches("file:"))
                .parent()
                .unwrap_or(Path::new("."))
                .to_path_buf()
        });
    match local_dir {
        Some(dir) if dir.join(pipelines::MANIFEST_FILE).is_file() => {
            Ok(Some(Manifest::read_from(&dir)?))
        }
        _ => Ok(None),
    }
}

pub fn run(_loaded: &Loaded, args: PlanArgs) -> anyhow::Result<ExitCode> {
    let urls = ShardList::from_spec(&args.shards)
        .with_context(|| format!("shard spec `{}`", args.shards))?
        .urls;
    let shards = match find_manifest(&args, &urls)? {
        Some(manifest) => PlanShard::with_manifest(&urls, &manifest),
        None => PlanShard::from_urls(urls),
    };
    let mut config = PlanConfig::new(
        shards,
        ClusterShape::new(args.nodes, args.ranks_per_node, args.workers),
        args.batch_size,
    );
    config.seed = args.seed;
    config.drop_partial = !args.partial;
    config.mode = args.mode;
    config.policy = policy(&args)?;
    config.epoch_size = args.epoch_size;
    config.nominal_size = args.nominal_size;
    config.default_samples_per_shard = args.samples_per_shard;
    let hooks = Hooks::load(args.hooks.as_deref(), HookLimits::default())?;
    let plan = Planner::new(config, hooks)?.plan(args.epoch)?;
    print!("{}", render_plan(&plan));
    match plan.check() {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(problem) => {
            eprintln!("error: {problem}");
            Ok(ExitCode::FAILURE)
        }
    }
}
