//! `imgrun plan`: a dry run of a job's epoch planning that prints, per rank and worker,
//! the shards, samples and batches, and what the batch policy does. It reads the same
//! configuration as `imgrun train` (`[data]`, `train.batch_size`; flags are shorthands for
//! `--set` of those keys) and plans through the same planner (`DataSpec::train_planner`),
//! so the steps it prints are the steps the job runs.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use pipelines::{ClusterShape, Plan, render_plan};

use crate::commands::train::data_spec;
use crate::config::Loaded;
use actors::train::SyncChoice;

#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// Training shards, as a brace spec (`data/train-{000000..000146}.tar`) [data.train].
    #[arg(long)]
    shards: Option<String>,
    /// A base each shard name goes into: where its `%s` is (`pipe:gsutil cat
    /// gs://bucket/%s`), or after it (`http://host:8080/`) [data.base].
    #[arg(long)]
    base: Option<String>,
    /// A manifest file or URL with the shards' sample counts, for shards of any source
    /// (made by `imgrun shards index`) [data.manifest].
    #[arg(long)]
    manifest: Option<String>,
    /// Samples assumed in each shard no manifest counts [data.samples_per_shard].
    #[arg(long)]
    samples_per_shard: Option<u64>,
    /// Nodes of the world planned for.
    #[arg(long)]
    nodes: Option<u32>,
    /// Trainers (ranks) on each node: one number for every node, or one per node in
    /// node order (`2,1`: 2 ranks on node 0 and 1 on node 1, as `imgrun train` places
    /// 3 CPU trainers on 2 nodes).
    #[arg(long, default_value = "1", value_name = "N[,N...]")]
    ranks_per_node: String,
    /// Loader workers per rank [data.loader_workers].
    #[arg(long)]
    loader_workers: Option<u32>,
    /// Deprecated: the old name of `--loader-workers`.
    #[arg(long, hide = true, conflicts_with = "loader_workers")]
    workers: Option<u32>,
    /// Samples per rank per step [train.batch_size].
    #[arg(long)]
    batch_size: Option<u64>,
    /// `resampled` (shards drawn with replacement) or `split` (exact epochs) [data.mode].
    #[arg(long)]
    mode: Option<String>,
    /// When ranks disagree on batches: none, join, drop, repeat [data.policy].
    #[arg(long)]
    policy: Option<String>,
    /// Batches every rank runs (implies the drop policy unless `--dsrepeat` is given)
    /// [data.nbatches].
    #[arg(long)]
    nbatches: Option<u64>,
    /// Read the data this many times before truncating (implies the repeat policy)
    /// [data.dsrepeat].
    #[arg(long)]
    dsrepeat: Option<u64>,
    /// [data.seed]
    #[arg(long)]
    seed: Option<u64>,
    /// Samples served per epoch, over all ranks (chopped epochs in split mode)
    /// [data.epoch_size].
    #[arg(long)]
    epoch_size: Option<u64>,
    /// Epoch length reported to schedules and progress [data.nominal_size].
    #[arg(long)]
    nominal_size: Option<u64>,
    /// Folder with the user's hook scripts (reseed.rhai, node_selection.rhai, ...)
    /// [data.hooks].
    #[arg(long)]
    hooks: Option<PathBuf>,
    /// The epoch to plan.
    #[arg(long, default_value_t = 0)]
    epoch: u64,
    /// Sets a configuration key (`--set data.policy=drop`); repeatable.
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
    /// Prints the plan's per-rank figures as JSON instead of the table.
    #[arg(long)]
    json: bool,
}

impl PlanArgs {
    /// The ranks on each node that `--nodes` and `--ranks-per-node` describe.
    fn node_ranks(&self) -> anyhow::Result<Vec<u32>> {
        let counts = self
            .ranks_per_node
            .split(',')
            .map(|n| match n.trim().parse::<u32>() {
                Ok(n) if n > 0 => Ok(n),
                _ => anyhow::bail!(
                    "--ranks-per-node `{}`: expected positive numbers, one for every node \
                     or one per node (`2,1`)",
                    self.ranks_per_node
                ),
            })
            .collect::<anyhow::Result<Vec<u32>>>()?;
        match (counts.as_slice(), self.nodes) {
            ([one], nodes) => Ok(vec![*one; nodes.unwrap_or(1) as usize]),
            (many, Some(nodes)) if nodes as usize != many.len() => anyhow::bail!(
                "--nodes {nodes} and --ranks-per-node `{}` ({} nodes) disagree",
                self.ranks_per_node,
                many.len()
            ),
            (many, _) => Ok(many.to_vec()),
        }
    }

    /// The flags as `--set` items, before the explicit `--set`s (which win).
    fn overrides(&self) -> Vec<String> {
        let text = |key: &str, value: &str| format!("{key}={value:?}");
        let number = |key: &str, value: u64| format!("{key}={value}");
        let mut out = Vec::new();
        if let Some(shards) = &self.shards {
            out.push(text("data.train", shards));
        }
        if let Some(base) = &self.base {
            out.push(text("data.base", base));
        }
        if let Some(manifest) = &self.manifest {
            out.push(text("data.manifest", manifest));
        }
        if let Some(n) = self.samples_per_shard {
            out.push(number("data.samples_per_shard", n));
        }
        if let Some(count) = self.workers {
            eprintln!("imgrun: --workers is deprecated: it is --loader-workers now");
            out.push(number("data.loader_workers", count.into()));
        }
        if let Some(count) = self.loader_workers {
            out.push(number("data.loader_workers", count.into()));
        }
        if let Some(batch) = self.batch_size {
            out.push(number("train.batch_size", batch));
        }
        if let Some(mode) = &self.mode {
            out.push(text("data.mode", mode));
        }
        // `--nbatches` alone means the drop policy and `--dsrepeat` the repeat policy, as
        // in the WebDataset simdist example, unless a policy is named.
        let policy = match (&self.policy, self.nbatches, self.dsrepeat) {
            (Some(policy), _, _) => Some(policy.as_str()),
            (None, _, Some(_)) => Some("repeat"),
            (None, Some(_), None) => Some("drop"),
            (None, None, None) => None,
        };
        if let Some(policy) = policy {
            out.push(text("data.policy", policy));
        }
        if let Some(n) = self.nbatches {
            out.push(number("data.nbatches", n));
        }
        if let Some(n) = self.dsrepeat {
            out.push(number("data.dsrepeat", n));
        }
        if let Some(seed) = self.seed {
            out.push(number("data.seed", seed));
        }
        if let Some(size) = self.epoch_size {
            out.push(number("data.epoch_size", size));
        }
        if let Some(size) = self.nominal_size {
            out.push(number("data.nominal_size", size));
        }
        if let Some(hooks) = &self.hooks {
            out.push(text("data.hooks", &hooks.display().to_string()));
        }
        out.extend(self.set.iter().cloned());
        out
    }
}

pub fn run(loaded: &Loaded, args: PlanArgs) -> anyhow::Result<ExitCode> {
    let config = crate::config::load_with(loaded.file.as_deref(), None, &args.overrides())?;
    let (data, _) = data_spec(&config.config)?;
    let node_ranks = args.node_ranks()?;
    anyhow::ensure!(!node_ranks.is_empty(), "--nodes must be at least 1");
    let shape = ClusterShape::with_node_ranks(node_ranks.clone(), data.loader_workers);
    let train = &config.config.train;
    let batch_size = config.config.train.batch_size;
    let plan = data
        .train_planner(shape, batch_size)
        .and_then(|planner| planner.plan(args.epoch))
        .with_context(|| format!("planning epoch {}", args.epoch))?;
    if args.json {
        let mut json = plan_json(&plan);
        json["sync"] = train.sync.name().into();
        json["precision"] = train.precision.name().into();
        json["channels_last"] = train.channels_last.into();
        if train.sync == SyncChoice::Decentralized {
            let nodes = runtime::node_of_each_rank(&node_ranks);
            let period = train.topology.period(&nodes);
            json["topology"] = train.topology.name().into();
            json["mixing"] = (0..period)
                .map(|step| train.topology.groups(&nodes, step))
                .collect::<Vec<_>>()
                .into();
        }
        println!("{json}");
    } else {
        print!("{}", render_plan(&plan));
        for line in actors::job::sync_lines(train.sync, train.topology, &node_ranks) {
            println!("{}", line.trim_start());
        }
        let elastic = train.elastic.then_some(actors::job::Elastic {
            min_world: train.min_world,
            max_failures: train.max_failures,
        });
        println!("{}", actors::job::elastic_line(elastic).trim_start());
        let compute = actors::job::compute_line(train.precision, train.channels_last, None);
        println!("{}", compute.trim_start());
    }
    // The job's own check: what `imgrun train` would refuse, this refuses.
    match actors::job::trainable_steps(&plan) {
        Ok(_) => Ok(ExitCode::SUCCESS),
        Err(problem) => {
            eprintln!("error: {problem:#}");
            Ok(ExitCode::FAILURE)
        }
    }
}

/// The figures a script or test compares with a job: the steps every rank runs (null
/// when the ranks disagree or counts are unknown) and each rank's samples and batches.
fn plan_json(plan: &Plan) -> serde_json::Value {
    let ranks: Vec<serde_json::Value> = plan
        .ranks
        .iter()
        .map(|rank| {
            serde_json::json!({
                "rank": rank.rank.0,
                "node": rank.node,
                "samples": rank.samples,
                "batches": rank.batches,
            })
        })
        .collect();
    serde_json::json!({
        "epoch": plan.epoch,
        "mode": plan.mode.name(),
        "world": plan.cluster.world_size(),
        "node_ranks": plan.cluster.node_ranks(),
        "batch_size": plan.batch_size,
        "partial_batches_kept": !plan.drop_partial,
        "steps": plan.steps(),
        "ranks": ranks,
    })
}
