//! `imgrun report RUN -o job.html`: one self-contained HTML page of a job (its status,
//! `imgrun plot`'s charts as SVG, the last lines of its log) that opens from a file,
//! without a server, to keep or send. RUN is a run folder (its `metrics.jsonl` and
//! `job.log`), or the name of a job of the running cluster (then its coordinator sends
//! them, with its status).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use actors::job::{
    JobSnapshot, LOG_FILE, LogFrom, LogRequest, MAX_LOG_PIECE, StatusRequest, read_log_in,
};
use anyhow::Context;

use crate::commands::coordinator::call;
use crate::config::Loaded;

/// The log lines a report keeps.
const LOG_LINES: u64 = 1000;

/// The charts' size in the page.
const CHART_SIZE: (u32, u32) = (1200, 750);

#[derive(Debug, clap::Args)]
pub struct ReportArgs {
    /// A run folder (holds metrics.jsonl), or the name of a job in the running cluster
    /// (`imgrun jobs` lists them).
    run: PathBuf,
    /// The page to write [default: NAME.html here].
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    output: Option<PathBuf>,
    /// Address of the cluster's head, for a job [default: the cluster this machine runs
    /// or joined].
    #[arg(long)]
    address: Option<String>,
}

/// What a report shows.
struct Material {
    job: JobSnapshot,
    metrics: Vec<u8>,
    log: String,
}

pub fn run(loaded: &Loaded, args: ReportArgs) -> anyhow::Result<ExitCode> {
    let material = if args.run.exists() {
        from_folder(&args.run)?
    } else {
        let Some(name) = args.run.to_str().filter(|name| !name.contains('/')) else {
            anyhow::bail!("{}: no such run folder", args.run.display());
        };
        from_cluster(loaded, args.address.as_deref(), name).with_context(|| {
            format!("{name} is neither a run folder here nor a job of the running cluster")
        })?
    };
    let name = material.job.name.clone();
    let svg = crate::commands::plot::svg_of(&name, &material.metrics, CHART_SIZE)
        .map_err(|error| format!("{error:#}"));
    let page = crate::dashboard::report(
        &material.job,
        svg.as_deref().map_err(String::as_str),
        &material.log,
        std::time::SystemTime::now(),
    );
    let output = args
        .output
        .unwrap_or_else(|| PathBuf::from(format!("{name}.html")));
    std::fs::write(&output, &page).with_context(|| format!("writing {}", output.display()))?;
    println!(
        "{}: report of {name} ({:.0} KiB; opens without a server)",
        output.display(),
        page.len() as f64 / 1024.0
    );
    Ok(ExitCode::SUCCESS)
}

/// A run folder's `metrics.jsonl` and the last lines of its `job.log` (a run from before
/// jobs kept one has none).
fn from_folder(dir: &Path) -> anyhow::Result<Material> {
    let metrics_path = dir.join("metrics.jsonl");
    let metrics = std::fs::read(&metrics_path)
        .with_context(|| format!("reading {} (is this a run folder?)", metrics_path.display()))?;
    let log = match read_log_in(dir, &tail()) {
        Ok(reply) => String::from_utf8_lossy(&reply.bytes).into_owned(),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(error) => {
            return Err(error).with_context(|| format!("reading {}", dir.join(LOG_FILE).display()));
        }
    };
    let name = std::fs::canonicalize(dir)
        .ok()
        .and_then(|dir| dir.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "run".to_owned());
    Ok(Material {
        job: JobSnapshot {
            name,
            job: None,
            ranks: Vec::new(),
            problem: Some("drawn from its run folder".to_owned()),
        },
        metrics,
        log,
    })
}

/// The job `name`'s status, metrics and last log lines, from its coordinator.
fn from_cluster(loaded: &Loaded, address: Option<&str>, name: &str) -> anyhow::Result<Material> {
    crate::commands::jobs::in_cluster(loaded, address, |client| async move {
        let actor = crate::commands::jobs::find(&client, name).await?;
        let status = call(&actor, &StatusRequest {}).await?;
        let metrics = crate::commands::jobs::fetch_metrics(&actor).await?;
        // A job that has not made its run folder yet has no log.
        let log = call(&actor, &tail())
            .await
            .map(|reply| String::from_utf8_lossy(&reply.bytes).into_owned())
            .unwrap_or_default();
        Ok(Material {
            job: JobSnapshot {
                name: name.to_owned(),
                job: Some(status),
                ranks: Vec::new(),
                problem: None,
            },
            metrics,
            log,
        })
    })
}

fn tail() -> LogRequest {
    LogRequest {
        from: LogFrom::Tail { lines: LOG_LINES },
        max_bytes: MAX_LOG_PIECE,
    }
}
