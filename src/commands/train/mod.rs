//! `imgrun train`: one data-parallel job on the cluster.
//!
//! The client connects to the running cluster (or starts an embedded one for the job),
//! sizes the world from the free GPUs (else CPU trainers), spawns one trainer actor per
//! rank in a worker process of its own on its node, wires the ranks into a ring, and then
//! drives them: the same number of steps to every rank per call, evaluation, checkpoints,
//! metrics, progress. Every trainer failure or node loss ends the job with the rank, node
//! and cause; the loss of the head ends it saying so, with the command that resumes. Ctrl-C or SIGTERM lets the step in flight end (for at most [`STOP_GRACE`]),
//! saves a checkpoint at the last completed step, stops every trainer and prints the
//! command that continues the run.

mod driver;
mod metrics;
mod spec;
mod steps;
mod world;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;

use crate::config::{Config, Loaded};
use driver::Driver;
use spec::job_spec;
pub(crate) use spec::{data_spec, trainable_steps};
use steps::{Progress, StopControl};
use world::Cluster;

/// How long a stopping job may take to end its step in flight and save a checkpoint.
pub const STOP_GRACE: Duration = Duration::from_secs(20);

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
    let options = JobOptions {
        address: args.address,
        embedded: args.embedded,
        resume: args.resume,
        plot: !args.no_plot,
    };
    match train_job(&loaded.config, &options) {
        Ok(_) => Ok(ExitCode::SUCCESS),
        Err(error) => match error.downcast::<Interrupted>() {
            Ok(interrupted) => {
                let args: Vec<String> = std::env::args().collect();
                eprintln!("{}", interrupted.report(&args));
                Ok(ExitCode::from(interrupted.exit_code()))
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
}

/// A job stopped by a signal, and where it stands: its run folder and newest
/// checkpoint, and why no checkpoint at its last step was written when none was.
#[derive(Debug)]
pub struct Interrupted {
    signal: &'static str,
    progress: Progress,
    /// Why the job could not stop at a checkpoint of its last step.
    late: Option<String>,
}

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.summary())
    }
}

impl std::error::Error for Interrupted {}

impl Interrupted {
    fn in_time(signal: &'static str, progress: Progress) -> Self {
        Interrupted {
            signal,
            progress,
            late: None,
        }
    }

    fn late(signal: &'static str, progress: Progress, why: String) -> Self {
        Interrupted {
            signal,
            progress,
            late: Some(why),
        }
    }

    /// 128 + the signal's number, as a shell reports a process the signal ended.
    pub fn exit_code(&self) -> u8 {
        if self.signal == "SIGTERM" { 143 } else { 130 }
    }

    /// One paragraph: what happened, and the checkpoint to continue from.
    fn summary(&self) -> String {
        let mut text = format!("interrupted by {}: every trainer was stopped", self.signal);
        if let Some(why) = &self.late {
            text.push_str(&format!("; no checkpoint at the last step ({why})"));
        }
        match (&self.progress.checkpoint, &self.progress.run_dir) {
            (Some(saved), Some(run)) => text.push_str(&format!(
                "\n{} checkpoint: {} (epoch {}, step {} of the epoch, global step {}); \
                 continue with --resume {}",
                if self.late.is_some() { "last" } else { "saved" },
                saved.dir.display(),
                saved.epoch,
                saved.step_in_epoch,
                saved.global_step,
                run.display()
            )),
            _ => {
                text.push_str("\nno checkpoint was written: nothing to resume; start the job again")
            }
        }
        text
    }

    /// The summary and, when there is a checkpoint, the command line `args` (this
    /// process's) with `--resume <run folder>` in place of any `--resume` given.
    pub fn report(&self, args: &[String]) -> String {
        let mut text = self.summary();
        if let (Some(_), Some(run)) = (&self.progress.checkpoint, &self.progress.run_dir) {
            text.push_str(&format!(
                "\nto continue this run:\n  {}",
                resume_command(args, run)
            ));
        }
        text
    }
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

/// Ctrl-C and SIGTERM, as one stream of signal names.
struct StopSignals {
    term: tokio::signal::unix::Signal,
}

impl StopSignals {
    fn new() -> anyhow::Result<Self> {
        let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("listening for SIGTERM")?;
        Ok(StopSignals { term })
    }

    async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => "SIGINT",
            _ = self.term.recv() => "SIGTERM",
        }
    }
}

/// Runs a job to its end, or to a checkpoint at its last step when Ctrl-C or SIGTERM
/// arrives (then the error is an [`Interrupted`]).
pub fn train_job(config: &Config, options: &JobOptions) -> anyhow::Result<JobSummary> {
    let job = job_spec(config)?;
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    tokio.block_on(async {
        let mut signals = StopSignals::new()?;
        let (stop_tx, requested) = tokio::sync::watch::channel(None);
        let stop = StopControl {
            requested,
            progress: Arc::new(Mutex::new(Progress::default())),
        };
        let cluster = tokio::select! {
            cluster = Cluster::connect(config, options) => cluster?,
            signal = signals.next() => {
                return Err(Interrupted::in_time(signal, Progress::default()).into());
            }
        };
        let outcome = async {
            let mut driver = std::pin::pin!(Driver::start(config, options, job, &cluster, &stop));
            tokio::select! {
            outcome = &mut driver => outcome,
            signal = signals.next() => {
                eprintln!(
                    "\n{signal}: stopping after the step in flight with a checkpoint (at most \
                     {} s; {signal} again stops at once)",
                    STOP_GRACE.as_secs()
                );
                let _ = stop_tx.send(Some(signal));
                let late = |why: String| -> anyhow::Error {
                    Interrupted::late(signal, stop.progress().clone(), why).into()
                };
                tokio::select! {
                    outcome = &mut driver => match outcome {
                        Err(error) if !error.is::<Interrupted>() => {
                            Err(late(format!("the job failed while stopping: {error:#}")))
                        }
                        other => other,
                    },
                    () = tokio::time::sleep(STOP_GRACE) => Err(late(format!(
                        "no step ended within {} s", STOP_GRACE.as_secs()
                    ))),
                    again = signals.next() => Err(late(format!("{again} again: stopped at once"))),
                }
            }
            }
        }
        .await;
        cluster.stop_trainers().await;
        cluster.shutdown().await;
        outcome
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
            checkpoint: Some(steps::Saved {
                dir: PathBuf::from("/runs/a/checkpoints/step-00000012"),
                epoch: 1,
                global_step: 12,
                step_in_epoch: 2,
            }),
        };
        let args = ["imgrun".to_string(), "train".to_string()];
        let saved = Interrupted::in_time("SIGINT", progress.clone()).report(&args);
        for word in [
            "interrupted by SIGINT",
            "saved checkpoint: /runs/a/checkpoints/step-00000012",
            "global step 12",
            "  imgrun train --resume /runs/a",
        ] {
            assert!(saved.contains(word), "`{word}` not in:\n{saved}");
        }
        let late = Interrupted::late("SIGTERM", progress, "no step ended within 20 s".into());
        assert_eq!(late.exit_code(), 143);
        let text = late.report(&args);
        assert!(text.contains("no step ended within 20 s"), "{text}");
        assert!(text.contains("last checkpoint: /runs/a/"), "{text}");
        assert!(text.contains("--resume /runs/a"), "{text}");
        let none = Interrupted::in_time("SIGINT", Progress::default()).report(&args);
        assert!(none.contains("nothing to resume"), "{none}");
        assert!(!none.contains("--resume"), "{none}");
    }
}
