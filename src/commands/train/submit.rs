//! A job run by a coordinator actor in the running cluster: `imgrun train` follows it
//! to its end (Ctrl-C cancels it), `imgrun train --detach` submits it and returns.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use actors::job::{
    COORDINATOR_KIND, CancelRequest, CoordinatorInit, FollowRequest, HeadLost, Interrupted,
    JobError, JobHandle, JobOutput, JobRequest, JobState, JobStatus, JobSummary, Progress,
    STOP_GRACE, head_lost,
};
use anyhow::{Context, bail};
use runtime::{ActorLabel, ActorRef, ClusterClient, SpawnOptions, Strategy};

use super::{JobOptions, StopSignals};
use crate::commands::coordinator::call;
use crate::commands::terminal::Terminal;
use crate::config::Config;

/// How long the command waits for news in one call to the coordinator.
const FOLLOW_WAIT: Duration = Duration::from_secs(1);

/// Submits the job of `request` to the running cluster and says how to follow it.
pub(super) fn submit_detached(
    config: &Config,
    options: &JobOptions,
    request: JobRequest,
) -> anyhow::Result<ExitCode> {
    if options.embedded {
        bail!(
            "--detach runs the job in the running cluster, and --embedded makes a cluster that \
             ends with this command: drop one of them"
        );
    }
    let state = crate::commands::cluster::state_dir(&config.cluster)?;
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let (name, run_dir, node) = tokio.block_on(async {
        let client = match ClusterClient::connect(&state, options.address.as_deref()).await {
            Ok(client) => client,
            Err(runtime::DaemonError::NoHead { .. }) if options.address.is_none() => bail!(
                "--detach needs a running cluster, which outlives this command: start one \
                 with `imgrun start --head` (without --detach, a job runs on a cluster of its \
                 own for its length)"
            ),
            Err(error) => return Err(error).context("connecting to the cluster"),
        };
        let coordinator = spawn_coordinator(&client, request, true).await?;
        Ok((coordinator.name, coordinator.run_dir, coordinator.node))
    })?;
    println!(
        "job {name} submitted: it runs in the cluster, its coordinator on node {node} (the head's)"
    );
    let commands = [
        (
            format!("imgrun logs {name} --follow"),
            "follows it to its end",
        ),
        (
            format!("imgrun jobs {name}"),
            "shows it, and every rank's phase",
        ),
        (
            format!("imgrun cancel {name}"),
            "stops it with a checkpoint",
        ),
    ];
    let width = commands.iter().map(|(c, _)| c.len()).max().unwrap_or(0);
    for (command, what) in commands {
        println!("  {command:<width$}   {what}");
    }
    println!("run folder: {} (on the head's machine)", run_dir.display());
    Ok(ExitCode::SUCCESS)
}

/// Runs the job of `request` through a coordinator on the head's node, owned by this
/// command's connection, and renders what it says until it ends. The first Ctrl-C or
/// SIGTERM asks it to stop with a checkpoint; a second kills it at once.
pub(super) async fn run_attached(
    client: &ClusterClient,
    request: JobRequest,
    signals: &mut StopSignals,
) -> anyhow::Result<(JobSummary, Option<Vec<u8>>)> {
    let coordinator = spawn_coordinator(client, request, false).await?;
    let actor = &coordinator.actor;
    let job = JobHandle::from(actor.clone());
    let terminal = Terminal::default();
    let mut after = 0;
    let mut asked: Option<&'static str> = None;
    let mut last: Option<JobStatus> = None;
    let followed = loop {
        let request = FollowRequest {
            after,
            wait_ms: FOLLOW_WAIT.as_millis() as u64,
        };
        let follow = call(&job, &request);
        tokio::select! {
            reply = follow => match reply {
                Ok(reply) => {
                    let caught_up = reply.events.is_empty();
                    for event in reply.events {
                        terminal.event(event);
                    }
                    after = reply.next;
                    let done = reply.status.state.is_final() && caught_up;
                    last = Some(reply.status);
                    if done {
                        break Ok(());
                    }
                }
                Err(error) => break Err(error),
            },
            signal = signals.next() => match asked {
                None => {
                    terminal.finish();
                    eprintln!(
                        "\n{signal}: stopping after the step in flight with a checkpoint (at \
                         most {} s; {signal} again stops at once)",
                        STOP_GRACE.as_secs()
                    );
                    call(&job, &CancelRequest { by: signal.to_string() })
                        .await
                        .context("asking the job to stop")?;
                    asked = Some(signal);
                }
                Some(first) => {
                    let _ = actor.kill().await;
                    let interrupted = Interrupted::late(
                        first,
                        progress(last.as_ref()),
                        format!("{signal} again: stopped at once"),
                    );
                    return Err(JobError::Interrupted(Box::new(interrupted)).into());
                }
            },
        }
    };
    terminal.finish();
    if let Err(error) = followed {
        if let Some(why) = head_lost(client).await {
            let lost = HeadLost {
                message: why,
                progress: progress(last.as_ref()),
            };
            return Err(JobError::HeadLost(Box::new(lost)).into());
        }
        return Err(error.context(format!("following job {}", coordinator.name)));
    }
    let status = last.context("the job ended without a status")?;
    // A run folder on the head's machine, not this one: its metrics come from the
    // coordinator, to be drawn here.
    let remote_metrics = match &status.run_dir {
        Some(run)
            if status.state == JobState::Succeeded && !run.join("metrics.jsonl").is_file() =>
        {
            crate::commands::jobs::fetch_metrics(&job).await.ok()
        }
        _ => None,
    };
    // The job has ended: its coordinator has nothing more to say.
    let _ = actor.stop().await;
    match status.state {
        JobState::Succeeded => Ok((
            status
                .summary
                .context("a job that succeeded without a summary")?,
            remote_metrics,
        )),
        JobState::Cancelled => {
            let by = match status.stopped_by.as_deref() {
                Some("SIGTERM") => "SIGTERM",
                Some("SIGINT") => "SIGINT",
                _ => "cancel",
            };
            let interrupted = Interrupted {
                by,
                progress: progress(Some(&status)),
                late: status.late.clone(),
            };
            Err(JobError::Interrupted(Box::new(interrupted)).into())
        }
        _ => bail!(
            "{}",
            status
                .outcome
                .unwrap_or_else(|| "the job failed".to_string())
        ),
    }
}

/// A job's coordinator, once started.
struct Coordinator {
    name: String,
    run_dir: PathBuf,
    node: runtime::NodeId,
    actor: ActorRef,
}

/// Starts the coordinator of `request` on the head's node, in the head's daemon;
/// `detached`: owned by no connection.
async fn spawn_coordinator(
    client: &ClusterClient,
    mut request: JobRequest,
    detached: bool,
) -> anyhow::Result<Coordinator> {
    // The coordinator runs in another process, perhaps on another machine: paths are
    // made whole here.
    let settings = &mut request.settings;
    settings.runs_dir = absolute(&settings.runs_dir)?;
    settings.name = settings.run_name();
    if let Some(resume) = &mut request.resume
        && resume.as_path() != Path::new("latest")
        && !resume
            .to_str()
            .is_some_and(actors::train::checkpoint_store::is_store_url)
    {
        *resume = absolute(resume)?;
    }
    let name = settings.name.clone();
    let run_dir = settings.runs_dir.join(&name);
    let taken = actors::job::coordinator(client, &name)
        .await
        .context("looking for a job of the same name")?;
    if taken.is_some() {
        bail!(
            "the cluster already has a job named `{name}` (`imgrun jobs` lists them; \
             `imgrun cancel {name}` removes it): choose another --name"
        );
    }
    let status = client
        .status()
        .await
        .context("asking for the cluster's status")?;
    let node = status
        .nodes
        .iter()
        .find(|node| node.address == client.head())
        .map(|node| node.id)
        .context("the head is not among the cluster's nodes")?;
    let init = CoordinatorInit {
        name: name.clone(),
        request,
        detached,
    };
    let args = serde_json::to_vec(&init).context("encoding the job")?;
    let mut spawn = SpawnOptions::new(COORDINATOR_KIND)
        .args(args)
        .strategy(Strategy::Node(node))
        .label(ActorLabel::new(&name, 0));
    if detached {
        spawn = spawn.detached();
    }
    let actor = client
        .spawn(spawn)
        .await
        .with_context(|| format!("starting the coordinator of job {name}"))?;
    Ok(Coordinator {
        name,
        run_dir,
        node,
        actor,
    })
}

/// Where the job stood at its last status.
fn progress(status: Option<&JobStatus>) -> Progress {
    Progress {
        run_dir: status.and_then(|s| s.run_dir.clone()),
        checkpoint: status.and_then(|s| s.checkpoint.clone()),
    }
}

fn absolute(path: &Path) -> anyhow::Result<PathBuf> {
    std::path::absolute(path).with_context(|| format!("making {} absolute", path.display()))
}
