//! `imgrun train`: one data-parallel job on the cluster.
//!
//! The client connects to the running cluster (or starts an embedded one for the job),
//! sizes the world from the free GPUs (else CPU trainers), spawns one trainer actor per
//! rank in a worker process of its own on its node, wires the ranks into a ring, and then
//! drives them: the same number of steps to every rank per call, evaluation, checkpoints,
//! metrics, progress. Every trainer failure or node loss ends the job with the rank, node
//! and cause; Ctrl-C stops every trainer.

mod driver;
mod spec;
mod steps;
mod world;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;

use crate::config::{Config, Loaded};
use driver::Driver;
pub(crate) use spec::data_spec;
use spec::job_spec;
use world::Cluster;

#[derive(Debug, clap::Args)]
pub struct TrainArgs {
    /// Address of the cluster's head [default: the cluster this machine runs or joined;
    /// without one, an embedded cluster for the length of the job].
    #[arg(long)]
    address: Option<String>,
    /// Start an embedded cluster even when one is running.
    #[arg(long, conflicts_with = "address")]
    embedded: bool,
    /// GPU trainers (0: every free GPU).
    #[arg(long)]
    gpus: Option<u32>,
    /// CPU trainers when the cluster has no GPUs (0: one per node).
    #[arg(long)]
    workers: Option<u32>,
    /// Epochs to train (train.epochs).
    #[arg(long)]
    epochs: Option<u64>,
    /// Run name (its folder is runs_dir/NAME).
    #[arg(long)]
    name: Option<String>,
    /// Continue from a checkpoint: its folder, a run folder, or `latest` (the newest run's
    /// latest checkpoint).
    #[arg(long, value_name = "PATH")]
    resume: Option<PathBuf>,
    /// Sets a configuration key for this run (`--set train.lr=0.2`); repeatable.
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
    /// Do not draw metrics.png at the end.
    #[arg(long)]
    no_plot: bool,
}

/// What a finished job reports.
#[derive(Debug, Clone)]
pub struct JobSummary {
    pub run_dir: PathBuf,
    pub top1: Option<f64>,
    pub top5: Option<f64>,
    pub first_loss: Option<f32>,
    pub last_loss: Option<f32>,
    pub images_per_s: f64,
}

pub fn run(loaded: &Loaded, args: TrainArgs) -> anyhow::Result<ExitCode> {
    let mut loaded = crate::config::load_with(loaded.file.as_deref(), None, &args.set)?;
    let train = &mut loaded.config.train;
    if let Some(gpus) = args.gpus {
        train.gpus = gpus;
    }
    if let Some(workers) = args.workers {
        train.workers = workers;
    }
    if let Some(epochs) = args.epochs {
        train.epochs = epochs;
    }
    if let Some(name) = &args.name {
        train.name = name.clone();
    }
    let options = JobOptions {
        address: args.address,
        embedded: args.embedded,
        resume: args.resume,
        plot: !args.no_plot,
    };
    match train_job(&loaded.config, &options) {
        Ok(_) => Ok(ExitCode::SUCCESS),
        Err(error) if error.is::<Cancelled>() => {
            eprintln!("cancelled: every trainer was stopped");
            Ok(ExitCode::from(130))
        }
        Err(error) => Err(error),
    }
}

/// How to run a job, beside its configuration.
#[derive(Debug, Clone, Default)]
pub struct JobOptions {
    pub address: Option<String>,
    pub embedded: bool,
    pub resume: Option<PathBuf>,
    pub plot: bool,
}

#[derive(Debug, thiserror::Error)]
#[error("cancelled")]
struct Cancelled;

/// Runs a job to its end.
pub fn train_job(config: &Config, options: &JobOptions) -> anyhow::Result<JobSummary> {
    let job = job_spec(config)?;
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    tokio.block_on(async {
        let cluster = Cluster::connect(config, options).await?;
        let driver = Driver::start(config, options, job, &cluster);
        let outcome = tokio::select! {
            outcome = driver => outcome,
            _ = tokio::signal::ctrl_c() => Err(Cancelled.into()),
        };
        cluster.stop_trainers().await;
        cluster.shutdown().await;
        outcome
    })
}
