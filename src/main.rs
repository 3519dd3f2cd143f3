//! The `imgrun` command line: parses arguments, loads the configuration, installs the
//! log subscriber, and hands over to one module per command.

mod commands;
mod config;
mod dashboard;
#[cfg(test)]
mod readme_tests;
mod serve;
mod units;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Distributed data-parallel training of image classifiers from WebDataset shards.
#[derive(Debug, Parser)]
#[command(name = "imgrun", version, about, propagate_version = true)]
struct Cli {
    /// Configuration file (default: ./cluster.toml when present, else built-in defaults;
    /// `demo` takes only its [cluster], [shards] and [serve]).
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Log filter, e.g. `info` or `pipelines=debug` (also IMGRUN_LOG) [default: `info`
    /// for daemons, `warn` otherwise].
    #[arg(long, global = true, env = "IMGRUN_LOG")]
    log: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Runs the main job with nothing to set up: generates a synthetic 10-class dataset as
    /// shards, trains a small CNN on it with two CPU trainers on an embedded cluster, and
    /// fails unless validation top-1 is above 90%.
    Demo(commands::demo::DemoArgs),
    /// Reports libtorch, CUDA, cores, memory and the configuration in use.
    Doctor,
    /// Dry-runs epoch planning for a job: shards, samples and batches per rank and worker,
    /// planned exactly as `imgrun train` plans them.
    Plan(commands::plan::PlanArgs),
    /// The shard toolkit: create, synth, index, ls, dump, sum, verify.
    #[command(subcommand)]
    Shards(commands::shards::ShardsCommand),
    /// Serves a folder of shards over HTTP (with Range support).
    ///
    /// Read-only and without authentication: whoever can reach the address reads every file
    /// in the folder. It listens on every interface (0.0.0.0) unless `--bind` says
    /// otherwise; `--bind 127.0.0.1` serves this machine only.
    Serve(commands::serve::ServeArgs),
    /// Kubernetes: `k8s manifest` writes a training job's objects (a Secret, then an
    /// Indexed Job and its headless Service, a JobSet, a TrainJob or a PyTorchJob).
    #[command(subcommand)]
    K8s(commands::k8s::K8sCommand),
    /// Starts the head of a cluster (`--head`), in the background unless `--block`.
    Start(commands::cluster::StartArgs),
    /// Adds this machine to a cluster: starts a node daemon that joins the head.
    Join(commands::cluster::JoinArgs),
    /// Shows the cluster: nodes, their resources, what is in use and by whom.
    Status(commands::cluster::StatusArgs),
    /// Stops the daemons started on this machine (`--all`: the whole cluster).
    Stop(commands::cluster::StopArgs),
    /// Trains a model data-parallel on the cluster (or an embedded one), one trainer per
    /// GPU or CPU trainers, with evaluation, checkpoints and metrics.
    Train(commands::train::TrainArgs),
    /// Lists the jobs running in the cluster (`imgrun train --detach` submits one).
    Jobs(commands::jobs::JobsArgs),
    /// Shows what a job in the cluster said; `--follow` follows it to its end.
    Logs(commands::jobs::LogsArgs),
    /// Stops a job in the cluster after its step in flight, with a checkpoint (or removes
    /// a finished one from the list).
    Cancel(commands::jobs::CancelArgs),
    /// Benchmarks on your own data: `bench loader SPEC` runs the training loader on your
    /// shards and says whether it can feed the GPUs.
    #[command(subcommand)]
    Bench(commands::bench::BenchCommand),
    /// Writes a run's weights for other tools: a state dict under torchvision's names, as
    /// safetensors or a `torch.save` file.
    Export(commands::export::ExportArgs),
    /// Draws a training run's metrics (loss, accuracy, throughput, learning rate) to a PNG.
    Plot(commands::plot::PlotArgs),
    /// Writes one self-contained HTML page of a job (status, charts, the end of its log)
    /// that opens without a server.
    Report(commands::report::ReportArgs),
    /// Hosts the actors of one process group for the node daemon that started it; its
    /// stdin is the daemon's socket (internal: only daemons run it).
    #[command(hide = true)]
    Worker,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let default_log = match cli.command {
        // A worker's output is its actors' log, kept by its node for `imgrun logs --rank`.
        Command::Start(_) | Command::Join(_) | Command::Worker => commands::cluster::DAEMON_LOG,
        _ => "warn",
    };
    install_logging(cli.log.as_deref().unwrap_or(default_log));
    if matches!(
        cli.command,
        Command::Doctor
            | Command::Plan(_)
            | Command::Shards(_)
            | Command::Status(_)
            | Command::Jobs(_)
            | Command::Logs(_)
            | Command::Plot(_)
            | Command::Export(_)
            | Command::Bench(_)
    ) {
        exit_quietly_on_closed_pipe();
    }
    if let Command::Worker = cli.command {
        // No configuration: the daemon that started this process has read it.
        return runtime::worker_main(commands::cluster::actor_registry());
    }
    let result = config::load(cli.config.as_deref()).and_then(|loaded| {
        announce_configuration(&cli.command, &loaded);
        dispatch(cli.command, &loaded)
    });
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {}", said_once(&error));
            ExitCode::FAILURE
        }
    }
}

/// An error and its causes on one line, as `{:#}` writes them, but each cause said once:
/// a cause whose words its error already holds (an error that writes its `source` into
/// its own message, as many library errors do) is not written again.
fn said_once(error: &anyhow::Error) -> String {
    let mut text = error.to_string();
    for cause in error.chain().skip(1) {
        let cause = cause.to_string();
        if !text.contains(&cause) {
            text.push_str(": ");
            text.push_str(&cause);
        }
    }
    text
}

/// Says which configuration file a command read, on standard error. The demo says it
/// itself, with the job keys it sets aside.
fn announce_configuration(command: &Command, loaded: &config::Loaded) {
    if matches!(command, Command::Demo(_)) {
        return;
    }
    if let Some(line) = loaded.describe_sources() {
        eprintln!("imgrun: {line}");
    }
}

fn dispatch(command: Command, loaded: &config::Loaded) -> anyhow::Result<ExitCode> {
    match command {
        Command::Demo(args) => commands::demo::run(loaded, args),
        Command::Doctor => commands::doctor::run(loaded),
        Command::Plan(args) => commands::plan::run(loaded, args),
        Command::Bench(command) => commands::bench::run(loaded, command),
        Command::Shards(command) => commands::shards::run(loaded, command),
        Command::Serve(args) => commands::serve::run(loaded, args),
        Command::K8s(command) => commands::k8s::run(loaded, command),
        // The dashboard draws a job's charts as `imgrun plot` does.
        Command::Start(args) => commands::cluster::start(loaded, args, commands::plot::svg_of),
        Command::Join(args) => commands::cluster::join(loaded, args),
        Command::Status(args) => commands::cluster::status(loaded, args),
        Command::Stop(args) => commands::cluster::stop(loaded, args),
        Command::Train(args) => commands::train::run(loaded, args),
        Command::Jobs(args) => commands::jobs::jobs(loaded, args),
        Command::Logs(args) => commands::jobs::logs(loaded, args),
        Command::Cancel(args) => commands::jobs::cancel(loaded, args),
        Command::Plot(args) => commands::plot::run(loaded, args),
        Command::Report(args) => commands::report::run(loaded, args),
        Command::Export(args) => commands::export::run(loaded, args),
        // Returned above, before the configuration is read; the same if it were not.
        Command::Worker => Ok(runtime::worker_main(commands::cluster::actor_registry())),
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
        // Colours only on a terminal: a daemon's standard error is its log file.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

/// Report commands end quietly when their reader goes away (`imgrun shards ls | head`), as
/// `cat` does. Rust ignores SIGPIPE, so `println!` to a closed pipe would panic. Commands
/// that hold sockets (daemons, `train`, `serve`) keep ignoring it: a peer closing a TCP
/// stream must be an error there, not the end of the process.
#[allow(unsafe_code)] // one libc call: no safe wrapper sets a signal's disposition
fn exit_quietly_on_closed_pipe() {
    // SAFETY: called from main before this process starts any thread; SIG_DFL is a valid
    // disposition for SIGPIPE.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

#[cfg(test)]
mod tests {
    use super::said_once;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot read {path}: {source}")]
    struct Repeats {
        path: &'static str,
        source: std::io::Error,
    }

    #[test]
    fn an_error_says_each_cause_once() {
        let io = || std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        // A library error that writes its source into its message, under a context.
        let error = anyhow::Error::from(Repeats {
            path: "runs/a/state.json",
            source: io(),
        })
        .context("resuming run a");
        assert_eq!(
            said_once(&error),
            "resuming run a: cannot read runs/a/state.json: no such file"
        );
        // Causes that add words are all said, in order.
        let error = anyhow::Error::from(io())
            .context("reading x")
            .context("planning");
        assert_eq!(said_once(&error), "planning: reading x: no such file");
    }
}
