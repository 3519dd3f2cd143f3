//! `imgrun train --detach`: the job submitted to the running cluster, where a coordinator
//! actor on the head's node runs it; the command returns once it has started.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use actors::job::{COORDINATOR_KIND, CoordinatorInit, JobRequest};
use anyhow::{Context, bail};
use runtime::{ActorLabel, ClusterClient, SpawnOptions, Strategy};

use super::JobOptions;
use crate::config::Config;

/// Submits the job of `request` and says how to follow it.
pub(super) fn submit(
    config: &Config,
    options: &JobOptions,
    mut request: JobRequest,
) -> anyhow::Result<ExitCode> {
    if options.embedded {
        bail!(
            "--detach runs the job in the running cluster, and --embedded makes a cluster that \
             ends with this command: drop one of them"
        );
    }
    // The coordinator runs in another process, elsewhere: paths are made whole here.
    let settings = &mut request.settings;
    settings.runs_dir = absolute(&settings.runs_dir)?;
    if settings.name.is_empty() {
        settings.name = format!("run-{}", unix_seconds());
    }
    if let Some(resume) = &mut request.resume
        && resume.as_path() != Path::new("latest")
    {
        *resume = absolute(resume)?;
    }
    let name = settings.name.clone();
    let run_dir = settings.runs_dir.join(&name);
    let state = crate::commands::cluster::state_dir(&config.cluster)?;
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let node = tokio.block_on(async {
        let client = match ClusterClient::connect(&state, options.address.as_deref()).await {
            Ok(client) => client,
            Err(runtime::DaemonError::NoHead { .. }) if options.address.is_none() => bail!(
                "--detach needs a running cluster, which outlives this command: start one \
                 with `imgrun start --head` (without --detach, a job runs on a cluster of its \
                 own for its length)"
            ),
            Err(error) => return Err(error).context("connecting to the cluster"),
        };
        let taken = crate::commands::jobs::coordinators(&client).await?;
        if taken.iter().any(|(job, _)| *job == name) {
            bail!(
                "the cluster already has a job named `{name}` (`imgrun jobs` lists them; \
                 `imgrun cancel {name}` removes it): choose another --name"
            );
        }
        let status = client
            .status()
            .await
            .context("asking for the cluster's status")?;
        let head = status
            .nodes
            .iter()
            .find(|node| node.address == client.head())
            .map(|node| node.id)
            .context("the head is not among the cluster's nodes")?;
        let init = CoordinatorInit {
            name: name.clone(),
            request,
        };
        let args = serde_json::to_vec(&init).context("encoding the job")?;
        let spawn = SpawnOptions::new(COORDINATOR_KIND)
            .args(args)
            .strategy(Strategy::Node(head))
            .process_group(format!("job-{}-{}", std::process::id(), unix_seconds()))
            .label(ActorLabel::new(&name, 0))
            .detached();
        client
            .spawn(spawn)
            .await
            .with_context(|| format!("starting the coordinator of job {name}"))?;
        Ok(head)
    })?;
    println!(
        "job {name} submitted: it runs in the cluster, its coordinator on node {node} (the head's)"
    );
    println!("  imgrun logs {name} --follow   follows it to its end");
    println!("  imgrun jobs                   lists the cluster's jobs");
    println!("  imgrun cancel {name}          stops it with a checkpoint");
    println!("run folder: {} (on the head's machine)", run_dir.display());
    Ok(ExitCode::SUCCESS)
}

fn absolute(path: &Path) -> anyhow::Result<PathBuf> {
    std::path::absolute(path).with_context(|| format!("making {} absolute", path.display()))
}

fn unix_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
