//! `imgrun train`: one data-parallel job on the cluster.
//!
//! The command turns the configuration into a job request (`spec.rs`), reaches the
//! cluster or starts an embedded one for the job (`cluster.rs`), runs the job
//! (`actors::job`, which spawns, wires and drives the trainers) and renders what it says
//! (`src/commands/terminal.rs`). Ctrl-C or SIGTERM asks the job to stop after the step in flight with
//! a checkpoint (for at most [`STOP_GRACE`]); then the command prints the command line
//! that continues the run.

mod cluster;
mod launch;
mod spec;
mod submit;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use actors::job::{
    Interrupted, JobError, JobSummary, STOP_GRACE, StopControl, Trainers, run_to_end_or_stop,
};
use anyhow::Context;

use crate::config::{Config, Loaded};
use cluster::Cluster;
pub(crate) use spec::data_spec;
use spec::job_request;

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
    /// CPU trainers when the cluster has no GPUs (0: one per node) [train.cpu_trainers].
    #[arg(long)]
    cpu_trainers: Option<u32>,
    /// Deprecated: the old name of `--cpu-trainers`.
    #[arg(long, hide = true, conflicts_with = "cpu_trainers")]
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
    /// Submit the job to the running cluster and return: it runs there, on the head's
    /// node, and outlives this command (`imgrun jobs`, `imgrun logs JOB --follow`,
    /// `imgrun cancel JOB`).
    #[arg(long)]
    detach: bool,
}

pub fn run(loaded: &Loaded, args: TrainArgs) -> anyhow::Result<ExitCode> {
    let mut loaded = crate::config::load_with(loaded.file.as_deref(), None, &args.set)?;
    let train = &mut loaded.config.train;
    if let Some(gpus) = args.gpus {
        train.gpus = gpus;
    }
    if let Some(count) = args.workers {
        eprintln!("imgrun: --workers is deprecated: it is --cpu-trainers now");
        train.cpu_trainers = count;
    }
    if let Some(count) = args.cpu_trainers {
        train.cpu_trainers = count;
    }
    if let Some(epochs) = args.epochs {
        train.epochs = epochs;
    }
    if let Some(name) = &args.name {
        train.name = name.clone();
    }
    let launch = launch::detect(&loaded.config.launch, &|name| std::env::var(name).ok())?;
    if let Some(launch) = &launch {
        anyhow::ensure!(
            !args.detach && args.address.is_none(),
            "--detach and --address do not apply to a job started by {} (launch.launcher): \
             its processes are the job's cluster",
            launch.kind.name()
        );
        if launch.process != 0 {
            return launch::follow(&loaded.config, launch);
        }
    }
    let options = JobOptions {
        address: args.address,
        embedded: args.embedded,
        resume: args.resume,
        plot: !args.no_plot,
        launch,
    };
    if args.detach {
        let request = job_request(&loaded.config, options.resume.clone())?;
        return submit::submit_detached(&loaded.config, &options, request);
    }
    let args: Vec<String> = std::env::args().collect();
    match train_job(&loaded.config, &options) {
        Ok(_) => Ok(ExitCode::SUCCESS),
        Err(error) => match error.downcast::<JobError>() {
            Ok(error) => {
                if let Some(interrupted) = error.interrupted() {
                    eprintln!("{}", interrupted_report(interrupted, &args));
                    return Ok(ExitCode::from(exit_code(interrupted)));
                }
                match error
                    .head_lost()
                    .and_then(|lost| lost.progress.run_dir.clone())
                {
                    Some(run)
                        if error
                            .head_lost()
                            .is_some_and(|l| l.progress.checkpoint.is_some()) =>
                    {
                        Err(anyhow::anyhow!(
                            "{error}\nto continue this run once the head is back:\n  {}",
                            resume_command(&args, &run)
                        ))
                    }
                    _ => Err(error.into()),
                }
            }
            Err(error) => Err(error),
        },
    }
}

/// How to run a job, beside its configuration.
#[derive(Debug, Clone, Default)]
pub struct JobOptions {
    pub address: Option<String>,
    pub embedded: bool,
    pub resume: Option<PathBuf>,
    pub plot: bool,
    /// Started by a launcher, as its process 0 (`launch.rs`).
    pub launch: Option<runtime::launch::Launch>,
}

/// 128 + the signal's number, as a shell reports a process the signal ended.
fn exit_code(interrupted: &Interrupted) -> u8 {
    if interrupted.by == "SIGTERM" {
        143
    } else {
        130
    }
}

/// The interrupt's summary and, when there is a checkpoint, the command line `args`
/// (this process's) with `--resume <run folder>` in place of any `--resume` given.
fn interrupted_report(interrupted: &Interrupted, args: &[String]) -> String {
    let mut text = interrupted.summary();
    if let Some(run) = interrupted.resumable() {
        text.push_str(&format!(
            "\nto continue this run:\n  {}",
            resume_command(args, run)
        ));
    }
    text
}

/// `args` as a shell command line that resumes from `run`: any `--resume` dropped and
/// `--resume <run>` appended; arguments quoted where a shell would split or expand them.
fn resume_command(args: &[String], run: &Path) -> String {
    let mut words: Vec<String> = Vec::new();
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        if arg == "--resume" {
            rest.next();
        } else if !arg.starts_with("--resume=") {
            words.push(arg.clone());
        }
    }
    words.push("--resume".to_string());
    words.push(run.display().to_string());
    words
        .iter()
        .map(|w| shell_quote(w))
        .collect::<Vec<_>>()
        .join(" ")
}

fn shell_quote(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,@%+".contains(c));
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// Ctrl-C and SIGTERM, as one stream of signal names. Both are listened to from the
/// start: a signal that arrives while nobody awaits `next` (the caller busy with another
/// branch of its `select!`) is kept for the next call, not lost.
///
/// A signal delivered again within [`SAME_SIGNAL`] of the last one is that one's echo,
/// not a second request: a terminal's Ctrl-C reaches every process of its group, and
/// torchrun, `srun` and `timeout` also pass it on to their children, so one press can
/// arrive twice, and must not end the job at once instead of at a checkpoint.
pub(super) struct StopSignals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    last: Option<(&'static str, Instant)>,
}

/// How long after a signal the same signal counts as its echo (see [`StopSignals`]).
const SAME_SIGNAL: Duration = Duration::from_secs(1);

impl StopSignals {
    fn new() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        let int = signal(SignalKind::interrupt()).context("listening for SIGINT")?;
        let term = signal(SignalKind::terminate()).context("listening for SIGTERM")?;
        Ok(StopSignals {
            int,
            term,
            last: None,
        })
    }

    pub(super) async fn next(&mut self) -> &'static str {
        loop {
            let signal = tokio::select! {
                _ = self.int.recv() => "SIGINT",
                _ = self.term.recv() => "SIGTERM",
            };
            let now = Instant::now();
            let echo = is_echo(self.last, signal, now);
            self.last = Some((signal, now));
            if !echo {
                return signal;
            }
        }
    }
}

/// Whether `signal`, arriving at `now`, repeats `last` within [`SAME_SIGNAL`].
fn is_echo(last: Option<(&'static str, Instant)>, signal: &str, now: Instant) -> bool {
    last.is_some_and(|(name, at)| name == signal && now.duration_since(at) < SAME_SIGNAL)
}

/// Runs a job to its end, or to a checkpoint at its last step when Ctrl-C or SIGTERM
/// arrives (then the error is a [`JobError::Interrupted`]), and draws its metrics.
pub fn train_job(config: &Config, options: &JobOptions) -> anyhow::Result<JobSummary> {
    let request = job_request(config, options.resume.clone())?;
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let (summary, remote_metrics) = tokio.block_on(async {
        let mut signals = StopSignals::new()?;
        let (stop_request, stop) = StopControl::new();
        let cluster = tokio::select! {
            cluster = Cluster::connect(config, options) => cluster?,
            signal = signals.next() => {
                let progress = stop.progress().clone();
                let interrupted = Interrupted::in_time(signal, progress);
                return Err(JobError::Interrupted(Box::new(interrupted)).into());
            }
        };
        if cluster.embedded.is_none() {
            // A running cluster runs the job in a coordinator of its own.
            return submit::run_attached(&cluster.client, request, &mut signals).await;
        }
        let trainers = Trainers::default();
        let output = crate::commands::terminal::Terminal::keeping_log();
        let job = actors::job::run(&cluster.client, request, &output, &stop, &trainers);
        // The first signal asks the job to stop; a second ends it at once.
        let at_once = async {
            let first = signals.next().await;
            eprintln!(
                "\n{first}: stopping after the step in flight with a checkpoint (at most {} s; \
                 {first} again stops at once)",
                STOP_GRACE.as_secs()
            );
            stop_request.stop(first);
            let again = signals.next().await;
            JobError::Interrupted(Box::new(Interrupted::late(
                first,
                stop.progress().clone(),
                format!("{again} again: stopped at once"),
            )))
        };
        let outcome = run_to_end_or_stop(job, &stop, at_once, STOP_GRACE).await;
        output.ended(&outcome);
        let outcome = outcome.map_err(anyhow::Error::from);
        trainers.kill_all().await;
        cluster.shutdown().await;
        outcome.map(|summary| (summary, None))
    })?;
    if options.plot {
        plot(&summary, remote_metrics.as_deref());
    }
    Ok(summary)
}

/// Draws the run's metrics to `metrics.png` in its folder; a run whose folder is on the
/// head's machine, not this one, is drawn to `NAME-metrics.png` here from `remote`, the
/// metrics its job's coordinator sent.
fn plot(summary: &JobSummary, remote: Option<&[u8]>) {
    let drawn = match remote {
        None => {
            let out = summary.run_dir.join("metrics.png");
            crate::commands::plot::render(&summary.run_dir, &out).map(|()| out)
        }
        Some(bytes) => {
            let name = summary
                .run_dir
                .file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
            let out = PathBuf::from(format!("{name}-metrics.png"));
            crate::commands::plot::render_bytes(&name, bytes, &out).map(|()| out)
        }
    };
    match drawn {
        Ok(out) => println!("plot: {}", out.display()),
        Err(error) => eprintln!("warning: drawing the metrics failed: {error:#}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use actors::job::Progress;

    #[test]
    fn a_signal_repeated_within_a_second_is_an_echo_and_any_other_is_a_second_request() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let table = [
            (None, "SIGINT", 0, false),
            (Some(("SIGINT", 0)), "SIGINT", 5, true),
            (Some(("SIGINT", 0)), "SIGINT", 999, true),
            (Some(("SIGINT", 0)), "SIGINT", 1000, false),
            (Some(("SIGINT", 0)), "SIGTERM", 5, false),
            (Some(("SIGTERM", 0)), "SIGINT", 5, false),
        ];
        for (last, signal, at, echo) in table {
            let last = last.map(|(name, at)| (name, ms(at)));
            assert_eq!(
                is_echo(last, signal, ms(at)),
                echo,
                "{last:?} then {signal} at {at} ms"
            );
        }
    }

    #[test]
    fn the_resume_command_replaces_any_resume_and_quotes_what_a_shell_would_split() {
        let run = Path::new("/runs/my run");
        let cases: [(&[&str], &str); 4] = [
            (
                &["imgrun", "train", "--epochs", "3"],
                "imgrun train --epochs 3 --resume '/runs/my run'",
            ),
            (
                &["imgrun", "train", "--resume", "old", "--name", "x"],
                "imgrun train --name x --resume '/runs/my run'",
            ),
            (
                &[
                    "./imgrun",
                    "train",
                    "--resume=latest",
                    "--set",
                    "data.train=\"a b\"",
                ],
                "./imgrun train --set 'data.train=\"a b\"' --resume '/runs/my run'",
            ),
            (
                &["imgrun", "train", "--set", "model.name='x'"],
                r"imgrun train --set 'model.name='\''x'\''' --resume '/runs/my run'",
            ),
        ];
        for (args, want) in cases {
            let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
            assert_eq!(resume_command(&args, run), want, "{args:?}");
        }
    }

    #[test]
    fn an_interrupt_names_the_checkpoint_or_says_there_is_none() {
        let progress = Progress {
            run_dir: Some(PathBuf::from("/runs/a")),
            checkpoint: Some(actors::job::Saved {
                dir: PathBuf::from("/runs/a/checkpoints/step-00000012"),
                epoch: 1,
                global_step: 12,
                step_in_epoch: 2,
                seconds: Some(1.5),
                store_run: Some("s3://b/runs/a".to_string()),
            }),
        };
        let args = ["imgrun".to_string(), "train".to_string()];
        let saved = interrupted_report(&Interrupted::in_time("SIGINT", progress.clone()), &args);
        for word in [
            "interrupted by SIGINT",
            "saved checkpoint: /runs/a/checkpoints/step-00000012",
            "global step 12; written in 1.5 s)",
            "  imgrun train --resume /runs/a",
            "(or, on any machine, --resume s3://b/runs/a)",
        ] {
            assert!(saved.contains(word), "`{word}` not in:\n{saved}");
        }
        let late = Interrupted::late("SIGTERM", progress, "no step ended within 20 s".into());
        assert_eq!(exit_code(&late), 143);
        let text = interrupted_report(&late, &args);
        assert!(text.contains("no step ended within 20 s"), "{text}");
        assert!(text.contains("last checkpoint: /runs/a/"), "{text}");
        assert!(text.contains("--resume /runs/a"), "{text}");
        let none = interrupted_report(&Interrupted::in_time("SIGINT", Progress::default()), &args);
        assert!(none.contains("nothing to resume"), "{none}");
        assert!(!none.contains("--resume"), "{none}");
    }
}
