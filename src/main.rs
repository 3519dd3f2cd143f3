//! The `imgrun` command line: parses arguments, loads the configuration, installs the
//! log subscriber, and hands over to one module per command.

mod commands;
mod config;
mod serve;
mod units;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Distributed data-parallel training of image classifiers from WebDataset shards.
#[derive(Debug, Parser)]
#[command(name = "imgrun", version, about, propagate_version = true)]
struct Cli {
    /// Configuration file (default: ./cluster.toml when present, else built-in defaults).
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Log filter, e.g. `info` or `pipelines=debug` (also IMGRUN_LOG).
    #[arg(long, global = true, env = "IMGRUN_LOG", default_value = "warn")]
    log: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Runs the embedded demo: generates a dataset as shards, then reads and verifies it.
    Demo(commands::demo::DemoArgs),
    /// Reports libtorch, CUDA, cores, memory and the configuration in use.
    Doctor,
    /// Dry-runs epoch planning: shards, samples and batches per rank and worker.
    Plan(commands::plan::PlanArgs),
    /// The shard toolkit: create, synth, ls, sum, verify.
    #[command(subcommand)]
    Shards(commands::shards::ShardsCommand),
    /// Serves a folder of shards over HTTP (with Range support).
    Serve(commands::serve::ServeArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    install_logging(&cli.log);
    let result = config::load(cli.config.as_deref()).and_then(|loaded| match cli.command {
        Command::Demo(args) => commands::demo::run(&loaded, args),
        Command::Doctor => commands::doctor::run(&loaded),
        Command::Plan(args) => commands::plan::run(&loaded, args),
        Command::Shards(command) => commands::shards::run(&loaded, command),
        Command::Serve(args) => commands::serve::run(&loaded, args),
    });
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn install_logging(filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter).unwrap_or_else(|e| {
        eprintln!("warning: bad log filter `{filter}` ({e}); using `warn`");
        tracing_subscriber::EnvFilter::new("warn")
    });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}
