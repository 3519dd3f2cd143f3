//! Jobs that run in the cluster (`imgrun train` on a running cluster, with or without
//! `--detach`): `imgrun jobs` lists them, `imgrun jobs JOB` shows one with every rank's
//! phase (the hang doctor),
//! `imgrun logs JOB [--follow]` shows what a job said (and follows it to its end),
//! `imgrun cancel JOB` stops one with a checkpoint, or removes a finished one.
//!
//! Each job is a coordinator actor (`actors::job::COORDINATOR_KIND`) labelled with the
//! job's name, or, once a detached job has ended, a record in the cluster's job archive;
//! these commands find it by name and call it (`actors::job::JobHandle`).

use std::process::ExitCode;
use std::time::Duration;

use actors::job::{
    CancelRequest, FollowRequest, JobHandle, JobOutput, JobState, JobStatus, MetricsRequest,
    RanksRequest, STOP_GRACE, StatusRequest,
};
use anyhow::{Context, bail};
use runtime::ClusterClient;

use crate::commands::coordinator::call;
use crate::commands::tables::{jobs_table, ranks_table};
use crate::commands::terminal::Terminal;
use crate::config::Loaded;

/// How long a follower waits for news in one call.
const FOLLOW_WAIT: Duration = Duration::from_secs(2);

#[derive(Debug, clap::Args)]
pub struct JobsArgs {
    /// One job: its status and, per rank, its node, phase (waiting for data, computing,
    /// averaging, evaluating, checkpointing), how long it has been in it, and its step.
    job: Option<String>,
    /// Address of the cluster's head [default: the cluster this machine runs or joined].
    #[arg(long)]
    address: Option<String>,
    /// Print the jobs as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
pub struct LogsArgs {
    /// The job's name (its run folder's, as `imgrun jobs` lists it).
    job: String,
    /// Keep following the job until it ends.
    #[arg(long, short)]
    follow: bool,
    /// Show this rank's own log instead: the newest lines its trainer's process wrote
    /// (its messages, its loader's, libtorch's and NCCL's), kept by its node.
    #[arg(long, conflicts_with = "follow")]
    rank: Option<u32>,
    /// How many of the rank's newest lines (at most 1,000 are kept).
    #[arg(long, default_value_t = 100, requires = "rank")]
    lines: u32,
    /// Which of the trainers that have held the rank, from 0 (the first): an elastic
    /// job's regroup or growth gives a rank a new trainer, and the node of one that ended
    /// keeps its lines for a while. The current one by default.
    #[arg(long, requires = "rank")]
    attempt: Option<u32>,
    #[arg(long)]
    address: Option<String>,
}

#[derive(Debug, clap::Args)]
pub struct CancelArgs {
    /// The job's name.
    job: String,
    #[arg(long)]
    address: Option<String>,
}

pub fn jobs(loaded: &Loaded, args: JobsArgs) -> anyhow::Result<ExitCode> {
    if let Some(name) = &args.job {
        let (status, ranks) = in_cluster(loaded, args.address.as_deref(), |client| async move {
            let actor = find(&client, name).await?;
            let status = call(&actor, &StatusRequest {}).await?;
            let ranks = if status.state.is_final() {
                Vec::new()
            } else {
                call(&actor, &RanksRequest {}).await?
            };
            Ok((status, ranks))
        })?;
        if args.json {
            let both = serde_json::json!({ "job": status, "ranks": ranks });
            println!("{}", serde_json::to_string_pretty(&both)?);
        } else {
            print!("{}", jobs_table(std::slice::from_ref(&status)));
            print!("{}", ranks_table(&ranks));
        }
        return Ok(ExitCode::SUCCESS);
    }
    let snapshot = in_cluster(loaded, args.address.as_deref(), |client| async move {
        actors::job::snapshot(&client)
            .await
            .context("asking for the cluster's jobs")
    })?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&snapshot.jobs)?);
        return Ok(ExitCode::SUCCESS);
    }
    if snapshot.jobs.is_empty() {
        println!("no jobs (`imgrun train --detach` submits one)");
        return Ok(ExitCode::SUCCESS);
    }
    for job in snapshot.jobs.iter().filter(|job| job.job.is_none()) {
        eprintln!(
            "job {}: {}",
            job.name,
            job.problem.as_deref().unwrap_or("no status")
        );
    }
    let statuses: Vec<JobStatus> = snapshot
        .jobs
        .iter()
        .filter_map(|job| job.job.clone())
        .collect();
    print!("{}", jobs_table(&statuses));
    Ok(ExitCode::SUCCESS)
}

pub fn logs(loaded: &Loaded, args: LogsArgs) -> anyhow::Result<ExitCode> {
    if let Some(rank) = args.rank {
        return rank_log(loaded, &args, rank);
    }
    let status = in_cluster(loaded, args.address.as_deref(), |client| async move {
        let actor = find(&client, &args.job).await?;
        follow(&actor, args.follow).await
    })?;
    Ok(exit_code(&status, args.follow))
}

/// `imgrun logs JOB --rank N [--attempt K]`: the rank's newest output lines, of its
/// current trainer or of attempt K, asked of its node by the job's coordinator; which
/// attempt of how many on stderr when the rank has had more than one.
fn rank_log(loaded: &Loaded, args: &LogsArgs, rank: u32) -> anyhow::Result<ExitCode> {
    let request = actors::job::RankOutputRequest {
        rank,
        lines: args.lines,
        attempt: args.attempt,
    };
    let output = in_cluster(loaded, args.address.as_deref(), |client| async move {
        let actor = find(&client, &args.job).await?;
        call(&actor, &request)
            .await
            .with_context(|| format!("asking job {} for rank {rank}'s log", args.job))
    })?;
    if let Some(line) = attempt_line(&output) {
        eprintln!("{line}");
    }
    if !output.own_process {
        eprintln!(
            "rank {rank}'s trainer runs in node {}'s daemon process: its lines are in that \
             daemon's log",
            output.node
        );
    }
    for line in &output.lines {
        println!("{line}");
    }
    Ok(ExitCode::SUCCESS)
}

/// Which attempt of a rank's log is shown, when the rank has had more than one trainer.
fn attempt_line(output: &actors::job::RankOutputReply) -> Option<String> {
    (output.attempts > 1).then(|| {
        let which = if output.attempt + 1 == output.attempts {
            "the newest"
        } else {
            "an earlier trainer"
        };
        format!(
            "rank {}: attempt {} of {} ({which}, on node {}; --attempt 0 to {} for the others)",
            output.rank,
            output.attempt,
            output.attempts,
            output.node,
            output.attempts - 1
        )
    })
}

pub fn cancel(loaded: &Loaded, args: CancelArgs) -> anyhow::Result<ExitCode> {
    let status = in_cluster(loaded, args.address.as_deref(), |client| async move {
        let actor = find(&client, &args.job).await?;
        let status = call(&actor, &CancelRequest::default()).await?;
        if status.state.is_final() {
            println!(
                "job {} had already {}; removed from the list",
                status.name,
                status.state.name()
            );
        } else {
            println!(
                "job {}: stopping after the step in flight with a checkpoint (at most {} s)",
                status.name,
                STOP_GRACE.as_secs()
            );
        }
        let status = wait_final(&actor).await?;
        actor
            .remove()
            .await
            .with_context(|| format!("removing job {}", status.name))?;
        Ok(status)
    })?;
    if let Some(outcome) = &status.outcome {
        println!("{outcome}");
    }
    Ok(ExitCode::SUCCESS)
}

/// The `metrics.jsonl` of the job `name`, fetched from its coordinator a piece at a time.
pub(crate) fn metrics_of(
    loaded: &Loaded,
    address: Option<&str>,
    name: &str,
) -> anyhow::Result<Vec<u8>> {
    in_cluster(loaded, address, |client| async move {
        fetch_metrics(&find(&client, name).await?).await
    })
}

/// The `metrics.jsonl` of the job whose coordinator is `actor`, a piece at a time.
pub(crate) async fn fetch_metrics(actor: &JobHandle) -> anyhow::Result<Vec<u8>> {
    {
        let mut bytes = Vec::new();
        loop {
            let piece = call(
                actor,
                &MetricsRequest {
                    offset: bytes.len() as u64,
                    max_bytes: 4 << 20,
                },
            )
            .await?;
            let done = piece.bytes.is_empty()
                || bytes.len() as u64 + piece.bytes.len() as u64 >= piece.length;
            bytes.extend_from_slice(&piece.bytes);
            if done {
                return Ok(bytes);
            }
        }
    }
}

/// Prints the job's events so far (and, with `follow`, until it ends), then how it ended
/// or where it stands; returns its last status.
pub(crate) async fn follow(actor: &JobHandle, follow: bool) -> anyhow::Result<JobStatus> {
    let terminal = Terminal::default();
    let mut after = 0;
    loop {
        let wait = if follow { FOLLOW_WAIT } else { Duration::ZERO };
        let reply = call(
            actor,
            &FollowRequest {
                after,
                wait_ms: wait.as_millis() as u64,
            },
        )
        .await?;
        let caught_up = reply.events.is_empty();
        for event in reply.events {
            terminal.event(event);
        }
        after = reply.next;
        let status = reply.status;
        if status.state.is_final() && caught_up {
            terminal.finish();
            match status.state {
                JobState::Succeeded => {}
                _ => eprintln!("job {} {}:", status.name, status.state.name()),
            }
            if let Some(outcome) = &status.outcome {
                eprintln!("{outcome}");
            }
            return Ok(status);
        }
        if !follow && caught_up {
            terminal.finish();
            eprintln!(
                "job {} is {} (epoch {}, step {}/{}); `imgrun logs {} --follow` follows it",
                status.name,
                status.state.name(),
                status.epoch.map_or("-".to_string(), |e| e.to_string()),
                status.position,
                status.steps,
                status.name
            );
            return Ok(status);
        }
    }
}

/// 0 for a job that succeeded or (without `--follow`) still runs; 1 otherwise.
fn exit_code(status: &JobStatus, follow: bool) -> ExitCode {
    match status.state {
        JobState::Succeeded => ExitCode::SUCCESS,
        JobState::Running | JobState::Stopping if !follow => ExitCode::SUCCESS,
        _ => ExitCode::FAILURE,
    }
}

/// Waits until the job has ended.
async fn wait_final(actor: &JobHandle) -> anyhow::Result<JobStatus> {
    let deadline = tokio::time::Instant::now() + STOP_GRACE + Duration::from_secs(30);
    let mut after = 0;
    loop {
        let reply = call(
            actor,
            &FollowRequest {
                after,
                wait_ms: FOLLOW_WAIT.as_millis() as u64,
            },
        )
        .await?;
        after = reply.next;
        if reply.status.state.is_final() {
            return Ok(reply.status);
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "job {} did not stop within {} s",
                reply.status.name,
                (STOP_GRACE + Duration::from_secs(30)).as_secs()
            );
        }
    }
}

/// The job `name` (its coordinator, or the archive once it has ended), or an error
/// listing the jobs there are.
pub(crate) async fn find(client: &ClusterClient, name: &str) -> anyhow::Result<JobHandle> {
    if let Some(job) = actors::job::coordinator(client, name)
        .await
        .context("looking the job up")?
    {
        return Ok(job);
    }
    let names = actors::job::job_names(client)
        .await
        .context("listing the cluster's jobs")?;
    bail!("no job named `{name}`: {}", some_jobs(&names))
}

/// The most job names an error lists.
const LISTED_NAMES: usize = 20;

/// `names` as an error lists them: the first [`LISTED_NAMES`], then how many more.
fn some_jobs(names: &[String]) -> String {
    match names.len() {
        0 => "the cluster has no jobs".to_owned(),
        n if n <= LISTED_NAMES => format!("the cluster's jobs are {}", names.join(", ")),
        n => format!(
            "the cluster's jobs are {} and {} more (`imgrun jobs` lists them)",
            names[..LISTED_NAMES].join(", "),
            n - LISTED_NAMES
        ),
    }
}

/// Runs `work` with a client of the running cluster.
pub(crate) fn in_cluster<T, F, Fut>(
    loaded: &Loaded,
    address: Option<&str>,
    work: F,
) -> anyhow::Result<T>
where
    F: FnOnce(ClusterClient) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let state = crate::commands::cluster::state_dir(&loaded.config.cluster)?;
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    tokio.block_on(async {
        let client = ClusterClient::connect(&state, address)
            .await
            .context("connecting to the cluster (jobs run in a cluster: `imgrun start --head`)")?;
        work(client).await
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_log_says_which_attempt_when_there_are_several() {
        let reply = |attempt, attempts| actors::job::RankOutputReply {
            rank: 1,
            node: 3,
            lines: Vec::new(),
            own_process: true,
            attempt,
            attempts,
        };
        let cases = [
            (0, 0, None),
            (0, 1, None),
            (
                0,
                2,
                Some(
                    "rank 1: attempt 0 of 2 (an earlier trainer, on node 3; --attempt 0 to 1 for the others)",
                ),
            ),
            (
                2,
                3,
                Some(
                    "rank 1: attempt 2 of 3 (the newest, on node 3; --attempt 0 to 2 for the others)",
                ),
            ),
        ];
        for (attempt, attempts, want) in cases {
            assert_eq!(
                attempt_line(&reply(attempt, attempts)).as_deref(),
                want,
                "{attempt} of {attempts}"
            );
        }
    }
}
