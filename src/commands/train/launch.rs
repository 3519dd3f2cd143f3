//! `imgrun train` started by a launcher, one process per machine or per GPU (`torchrun`,
//! Slurm's `srun`), with no `imgrun start`: the processes form a cluster of their own
//! for the job and run it as a cluster job. The launcher contract and its carrying out
//! are `runtime::launch`'s; this gives them the configuration (the rendezvous folder,
//! `launch.rendezvous_dir`, by default `<train.runs_dir>/.rendezvous`: on the shared
//! filesystem the job's runs go to), the actors the processes host, the terminal and
//! the signals.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use runtime::launch::{Followed, Launch, LaunchSettings};

use crate::config::{Config, LaunchConfig};

/// The launcher this process runs under, if any (see [`runtime::launch::detect`]).
pub fn detect(
    config: &LaunchConfig,
    env: &dyn Fn(&str) -> Option<String>,
) -> anyhow::Result<Option<Launch>> {
    Ok(runtime::launch::detect(config.launcher, config.port, env)?)
}

/// How this configuration carries `launch` out.
fn settings(config: &Config, launch: &Launch) -> LaunchSettings {
    let dir = if config.launch.rendezvous_dir.is_empty() {
        Path::new(&config.train.runs_dir).join(".rendezvous")
    } else {
        PathBuf::from(&config.launch.rendezvous_dir)
    };
    LaunchSettings {
        rendezvous: runtime::launch::rendezvous_path(&dir, launch),
        timeout: Duration::from_secs(config.launch.timeout_secs),
        membership: crate::commands::cluster::membership(&config.cluster),
        beat_port: config.cluster.beat_port,
        num_gpus: usize::try_from(config.launch.num_gpus).ok(),
        actors: crate::commands::cluster::actor_hosting(),
    }
}

/// Process 0's cluster: the head, its state folder, a client, and the rendezvous file.
pub(super) struct Led {
    pub(super) head: runtime::Head,
    pub(super) dir: tempfile::TempDir,
    pub(super) client: runtime::ClusterClient,
    pub(super) rendezvous: Option<PathBuf>,
}

/// Process 0: the head and every process joined (see [`runtime::launch::lead`]).
pub(super) async fn lead(config: &Config, launch: &Launch) -> anyhow::Result<Led> {
    println!("launch: {}", launch.describe());
    let dir = tempfile::Builder::new()
        .prefix("imgrun-launch-")
        .tempdir()
        .context("making the head's state folder")?;
    let led = runtime::launch::lead(launch, dir.path(), settings(config, launch), &|line| {
        println!("{line}")
    })
    .await?;
    Ok(Led {
        head: led.head,
        dir,
        client: led.client,
        rendezvous: led.rendezvous,
    })
}

/// Every process but process 0: joins process 0's head as a node and serves it until the
/// head stops it (exit 0), a second signal comes (130) or the head goes away (an error).
/// The first SIGTERM or Ctrl-C does not end it: a launcher or Kubernetes signals every
/// process of the job at once (a preemption, a drain, `scancel`, Ctrl-C in a terminal),
/// and process 0 then checkpoints the step in flight, which needs this node's trainers.
pub fn follow(config: &Config, launch: &Launch) -> anyhow::Result<ExitCode> {
    println!("launch: {}", launch.describe());
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    tokio.block_on(async {
        let dir = tempfile::Builder::new()
            .prefix("imgrun-launch-")
            .tempdir()
            .context("making the node's state folder")?;
        let signals = super::StopSignals::new()?;
        let followed = runtime::launch::follow(
            launch,
            dir.path(),
            settings(config, launch),
            &|line| println!("{line}"),
            leave_on_second_signal(signals),
        )
        .await?;
        Ok(match followed {
            Followed::Stopped => {
                println!("launch: the job's head stopped this node");
                ExitCode::SUCCESS
            }
            Followed::Signalled(signal) => {
                eprintln!("launch: {signal} again: left the job");
                ExitCode::from(130)
            }
        })
    })
}

/// The second signal's name, once the first has been told.
async fn leave_on_second_signal(mut signals: super::StopSignals) -> &'static str {
    let first = signals.next().await;
    println!(
        "launch: {first}: this node serves on until the job's head stops it (process 0, \
         signalled too, checkpoints the step in flight first); {first} again leaves now"
    );
    signals.next().await
}
