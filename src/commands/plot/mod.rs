//! `imgrun plot RUN_DIR`: draws a run's `metrics.jsonl` to a PNG, a 2x2 grid of training
//! loss, eval accuracy, throughput and learning rate. `imgrun plot JOB` draws a job of
//! the running cluster from anywhere: its coordinator sends the file. `parse.rs` reads the file (leniently where a run's history makes it messy, strictly
//! everywhere else), `draw.rs` draws it.

mod draw;
mod parse;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;

use self::draw::{draw_png, draw_svg, named_title, title};
use self::parse::parse_metrics;
use crate::config::Loaded;

#[derive(Debug, clap::Args)]
pub struct PlotArgs {
    /// The run folder (holds metrics.jsonl), or the name of a job in the running cluster
    /// (`imgrun jobs` lists them), whose file its coordinator sends.
    run_dir: PathBuf,
    /// Address of the cluster's head, for a job [default: the cluster this machine runs
    /// or joined].
    #[arg(long)]
    address: Option<String>,
    /// Where to write the PNG [default: RUN_DIR/metrics.png, or JOB-metrics.png here].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Image width in pixels.
    #[arg(long, default_value_t = DEFAULT_SIZE.0, value_parser = clap::value_parser!(u32).range(320..=8000))]
    width: u32,
    /// Image height in pixels.
    #[arg(long, default_value_t = DEFAULT_SIZE.1, value_parser = clap::value_parser!(u32).range(240..=8000))]
    height: u32,
}

pub fn run(loaded: &Loaded, args: PlotArgs) -> anyhow::Result<ExitCode> {
    if !args.run_dir.exists()
        && let Some(job) = args.run_dir.to_str().filter(|name| !name.contains('/'))
    {
        let bytes = crate::commands::jobs::metrics_of(loaded, args.address.as_deref(), job)
            .with_context(|| {
                format!("{job} is neither a run folder here nor a job of the running cluster")
            })?;
        let out = args
            .out
            .clone()
            .unwrap_or_else(|| PathBuf::from(format!("{job}-metrics.png")));
        let label = PathBuf::from(format!("job {job}: metrics.jsonl"));
        let summary = plot_bytes(&label, &bytes, job, &out, (args.width, args.height))?;
        println!("{}", out.display());
        println!("{summary}");
        return Ok(ExitCode::SUCCESS);
    }
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| args.run_dir.join("metrics.png"));
    let summary = plot_run(&args.run_dir, &out, (args.width, args.height))?;
    println!("{}", out.display());
    println!("{summary}");
    Ok(ExitCode::SUCCESS)
}

/// Draws `run_dir/metrics.jsonl` to the PNG `out` at the default size (for `imgrun
/// train`, which plots when a run ends).
pub fn render(run_dir: &Path, out: &Path) -> anyhow::Result<()> {
    plot_run(run_dir, out, DEFAULT_SIZE)?;
    Ok(())
}

/// Draws a job's metrics `bytes` (fetched from its coordinator) to the PNG `out` at the
/// default size.
pub fn render_bytes(job: &str, bytes: &[u8], out: &Path) -> anyhow::Result<()> {
    let label = PathBuf::from(format!("job {job}: metrics.jsonl"));
    plot_bytes(&label, bytes, job, out, DEFAULT_SIZE)?;
    Ok(())
}

/// Draws a job's metrics `bytes` (fetched from its coordinator) as an SVG document of
/// `size`, for the dashboard: each series thinned to at most [`SVG_POINTS`] points, so
/// the document stays small however long the run.
pub fn svg_of(job: &str, bytes: &[u8], size: (u32, u32)) -> anyhow::Result<String> {
    let label = PathBuf::from(format!("job {job}: metrics.jsonl"));
    let mut metrics = parse_metrics(&label, bytes)?;
    let every = metrics.steps.len().div_ceil(SVG_POINTS).max(1);
    if every > 1 {
        let last = metrics.steps.keys().next_back().copied();
        metrics.steps = std::mem::take(&mut metrics.steps)
            .into_iter()
            .enumerate()
            .filter(|(i, (step, _))| i % every == 0 || Some(*step) == last)
            .map(|(_, point)| point)
            .collect();
    }
    let title = named_title(job.to_owned(), metrics.job.as_ref());
    draw_svg(&metrics, &title, size)
}

/// The most steps a dashboard chart draws.
const SVG_POINTS: usize = 800;

/// Width and height when none are given.
const DEFAULT_SIZE: (u32, u32) = (1600, 1000);

/// Reads `run_dir/metrics.jsonl`, draws it to `out` and returns the one-line summary.
fn plot_run(run_dir: &Path, out: &Path, size: (u32, u32)) -> anyhow::Result<String> {
    let path = run_dir.join("metrics.jsonl");
    let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    plot_bytes(&path, &bytes, run_dir, out, size)
}

/// Draws the metrics `bytes` (read from `path`, named so in messages) of the run `run`
/// to the PNG `out`; returns the one-line summary.
fn plot_bytes(
    path: &Path,
    bytes: &[u8],
    run: impl AsRef<Path>,
    out: &Path,
    size: (u32, u32),
) -> anyhow::Result<String> {
    let run_dir = run.as_ref();
    let metrics = parse_metrics(path, bytes)?;
    if let Some(line) = metrics.skipped_last_line {
        tracing::warn!(file = %path.display(), line, "skipped a truncated last line");
    }
    let title = title(run_dir, metrics.job.as_ref());
    let png = draw_png(&metrics, &title, size)?;
    std::fs::write(out, png).with_context(|| format!("writing {}", out.display()))?;
    Ok(metrics.summary())
}

#[cfg(test)]
mod tests {
    use super::parse::fixtures::{sample, step};
    use super::*;

    #[test]
    fn renders_a_png_of_the_requested_size() {
        let dir = tempfile::tempdir().expect("temp dir");
        let no_eval: String = sample(60, 3)
            .lines()
            .filter(|line| !line.contains(r#""kind":"eval""#))
            .map(|line| format!("{line}\n"))
            .collect();
        let cases = [
            ("full", sample(300, 10), (800, 500)),
            ("no eval records", no_eval, (640, 480)),
            ("one step", step(7, 0, 1.0), (1600, 1000)),
        ];
        for (name, text, (width, height)) in cases {
            let run_dir = dir.path().join(name.replace(' ', "-"));
            std::fs::create_dir(&run_dir).expect("run dir");
            std::fs::write(run_dir.join("metrics.jsonl"), text).expect("metrics");
            let out = run_dir.join("metrics.png");
            let summary = plot_run(&run_dir, &out, (width, height))
                .unwrap_or_else(|e| panic!("{name}: {e:#}"));
            assert!(summary.contains(" steps, "), "{name}: {summary}");
            let reader = image::ImageReader::open(&out)
                .and_then(|reader| reader.with_guessed_format())
                .expect("open the PNG");
            assert_eq!(reader.format(), Some(image::ImageFormat::Png), "{name}");
            assert_eq!(
                reader.into_dimensions().expect("PNG header"),
                (width, height),
                "{name}"
            );
        }
    }
}
