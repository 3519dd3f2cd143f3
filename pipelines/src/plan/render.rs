//! `render_plan`: the text `imgrun plan` prints (like the seeds' `simdist --showsplits`).

use std::fmt::Write;

use super::config::list_batches;
use super::config::{BatchPolicy, PlanMode};
use super::policy::{Consistency, Plan};
use super::shards::WorkItem;

/// A plan as text: the settings, then per rank and worker its shards, samples and
/// batches, what the policy did, and whether every rank runs the same number of steps.
pub fn render_plan(plan: &Plan) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = write_plan(&mut out, plan);
    out
}

fn write_plan(out: &mut String, plan: &Plan) -> std::fmt::Result {
    let cluster = &plan.cluster;
    writeln!(
        out,
        "epoch {}: {} mode, seed {}, {} shard(s){}",
        plan.epoch,
        plan.mode.name(),
        plan.seed,
        plan.shards,
        plan.dataset_samples
            .map(|n| format!(" ({n} samples)"))
            .unwrap_or_default(),
    )?;
    if plan.assumed_counts > 0 {
        writeln!(
            out,
            "  {} shard count(s) assumed (no manifest entry)",
            plan.assumed_counts
        )?;
    }
    writeln!(
        out,
        "cluster: {} = {} rank(s), {} worker(s) per rank",
        cluster.layout(),
        cluster.world_size(),
        cluster.workers_per_rank,
    )?;
    writeln!(
        out,
        "batches: {} samples, partial batches {}; policy: {}",
        plan.batch_size,
        if plan.drop_partial { "dropped" } else { "kept" },
        describe_policy(plan.policy),
    )?;
    if let Some(size) = plan.epoch_size {
        let what = if plan.mode == PlanMode::Split {
            "chopped epochs of"
        } else {
            "epochs of"
        };
        writeln!(out, "{what} {size} samples")?;
    }
    if let (Some(nominal), Some(batches)) = (plan.nominal_size, plan.nominal_batches()) {
        writeln!(
            out,
            "nominal epoch: {nominal} samples, {batches} batches per rank"
        )?;
    }
    for (hook, file) in &plan.hooks {
        if !file.ends_with("(built-in)") {
            writeln!(out, "hook {hook}: {file}")?;
        }
    }
    for rank in &plan.ranks {
        write!(
            out,
            "rank {} (node {}): {} samples, {} batches",
            rank.rank,
            rank.node,
            count(rank.samples),
            count(rank.batches)
        )?;
        let notes = [
            (rank.empty_batches, "empty"),
            (rank.dropped_batches, "dropped"),
            (rank.repeated_batches, "repeated"),
        ];
        for (n, what) in notes.iter().filter(|(n, _)| *n > 0) {
            write!(out, ", {n} {what}")?;
        }
        writeln!(out)?;
        for worker in &rank.workers {
            write!(
                out,
                "  worker {}: {} samples, {} batches",
                worker.worker,
                count(worker.samples),
                count(worker.batches)
            )?;
            if worker.dropped_batches > 0 {
                write!(out, ", {} dropped", worker.dropped_batches)?;
            }
            if worker.stream_offset > 0 {
                write!(out, ", from stream position {}", worker.stream_offset)?;
            }
            writeln!(out, ", seed {:#018x}", worker.seed)?;
            for item in &worker.items {
                writeln!(out, "    {}", describe_item(item))?;
            }
        }
    }
    match &plan.consistency {
        Consistency::Consistent { steps } => {
            writeln!(out, "consistent: every rank runs {steps} steps")
        }
        Consistency::Inconsistent { batches } => writeln!(
            out,
            "INCONSISTENT: ranks run different numbers of batches ({}); training would hang: choose a policy (join, drop, repeat)",
            list_batches(batches),
        ),
        Consistency::Unknown {
            shards_without_counts,
        } => writeln!(
            out,
            "cannot check batch consistency: {shards_without_counts} shard(s) have no sample count",
        ),
    }
}

fn describe_policy(policy: BatchPolicy) -> String {
    let to = |nbatches: Option<u64>| match nbatches {
        Some(n) => format!("{n} batches"),
        None => "the smallest rank".to_string(),
    };
    match policy {
        BatchPolicy::None => "none".to_string(),
        BatchPolicy::Join => "join (ranks that run out take empty batches)".to_string(),
        BatchPolicy::Drop { nbatches } => format!("drop to {}", to(nbatches)),
        BatchPolicy::Repeat { dsrepeat, nbatches } => format!(
            "repeat the data {dsrepeat}x, then truncate to {}",
            to(nbatches)
        ),
    }
}

fn describe_item(item: &WorkItem) -> String {
    let mut text = item.url.clone();
    if item.stride > 1 {
        let _ = write!(
            text,
            " [samples {}, {}, ...: every {}]",
            item.start,
            item.start + item.stride,
            item.stride
        );
    } else if item.start > 0 {
        let _ = write!(text, " [from sample {}]", item.start);
    }
    match (item.take, item.samples) {
        (Some(take), _) => {
            let _ = write!(text, ", first {take}");
        }
        (None, Some(samples)) => {
            let _ = write!(text, " ({samples})");
        }
        (None, None) => {}
    }
    text
}

fn count(n: Option<u64>) -> String {
    n.map_or_else(|| "?".to_string(), |n| n.to_string())
}
