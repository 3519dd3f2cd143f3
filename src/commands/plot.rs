//! `imgrun plot RUN_DIR`: draws a run's `metrics.jsonl` to a PNG, a 2x2 grid of training
//! loss, eval accuracy, throughput and learning rate.
//!
//! The file is read leniently where a run's history makes it messy (unknown kinds and
//! keys are ignored, a resumed run drops what the earlier run wrote past its checkpoint and
//! its repeated steps are resolved by the later line, a last line cut short by a kill is
//! skipped) and strictly everywhere else: any other bad line is an error that names the
//! file and line.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::OnceLock;

use actors::train::MetricsRecord;
use anyhow::{Context, anyhow, bail};
use image::ImageEncoder;
use plotters::coord::Shift;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde_json::Value;

use crate::config::Loaded;

#[derive(Debug, clap::Args)]
pub struct PlotArgs {
    /// The run folder (holds metrics.jsonl).
    run_dir: PathBuf,
    /// Where to write the PNG [default: RUN_DIR/metrics.png].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Image width in pixels.
    #[arg(long, default_value_t = DEFAULT_SIZE.0, value_parser = clap::value_parser!(u32).range(320..=8000))]
    width: u32,
    /// Image height in pixels.
    #[arg(long, default_value_t = DEFAULT_SIZE.1, value_parser = clap::value_parser!(u32).range(240..=8000))]
    height: u32,
}

pub fn run(_loaded: &Loaded, args: PlotArgs) -> anyhow::Result<ExitCode> {
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

/// Width and height when none are given.
const DEFAULT_SIZE: (u32, u32) = (1600, 1000);

/// Reads `run_dir/metrics.jsonl`, draws it to `out` and returns the one-line summary.
fn plot_run(run_dir: &Path, out: &Path, size: (u32, u32)) -> anyhow::Result<String> {
    let path = run_dir.join("metrics.jsonl");
    let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    let metrics = parse_metrics(&path, &bytes)?;
    if let Some(line) = metrics.skipped_last_line {
        tracing::warn!(file = %path.display(), line, "skipped a truncated last line");
    }
    let title = title(run_dir, metrics.job.as_ref());
    let png = draw_png(&metrics, &title, size)?;
    std::fs::write(out, png).with_context(|| format!("writing {}", out.display()))?;
    Ok(metrics.summary())
}

/// What a metrics file says, with repeated steps resolved (the later line wins).
#[derive(Debug, Default, PartialEq)]
struct Metrics {
    /// The last job record.
    job: Option<Job>,
    /// Keyed by the global optimiser step.
    steps: BTreeMap<u64, StepPoint>,
    /// Keyed by the step the eval ran at.
    evals: BTreeMap<u64, EvalPoint>,
    /// The epochs that have an epoch record.
    epochs: BTreeSet<u64>,
    /// The 1-based number of a truncated last line that was skipped.
    skipped_last_line: Option<usize>,
}

#[derive(Debug, Default, Clone, PartialEq)]
struct Job {
    model: Option<String>,
    world: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct StepPoint {
    epoch: u64,
    loss: f64,
    lr: f64,
    images_per_s: f64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct EvalPoint {
    epoch: u64,
    loss: f64,
    top1: f64,
    top5: f64,
}

/// Parses the lines of a metrics file; `path` is only used in messages.
fn parse_metrics(path: &Path, bytes: &[u8]) -> anyhow::Result<Metrics> {
    let lines: Vec<&[u8]> = bytes
        .split(|&b| b == b'\n')
        .map(|line| line.strip_suffix(b"\r").unwrap_or(line))
        .collect();
    let last = lines.iter().rposition(|line| !line.trim_ascii().is_empty());
    let Some(last) = last else {
        bail!("{}: the file is empty", path.display());
    };
    let mut metrics = Metrics::default();
    for (index, line) in lines.iter().enumerate().take(last + 1) {
        if line.trim_ascii().is_empty() {
            continue;
        }
        let at = || format!("{}:{}", path.display(), index + 1);
        let value: Value = match serde_json::from_slice(line) {
            Ok(value) => value,
            // A run killed mid-write leaves half a line at the end: JSON that just stops.
            Err(error) if error.is_eof() && index == last => {
                metrics.skipped_last_line = Some(index + 1);
                continue;
            }
            Err(error) => bail!("{}: invalid JSON ({error})", at()),
        };
        metrics
            .add_record(value)
            .map_err(|problem| anyhow!("{}: {problem}", at()))?;
    }
    if metrics.steps.is_empty() {
        bail!("{}: no step records", path.display());
    }
    Ok(metrics)
}

impl Metrics {
    /// Adds one record (a line's JSON); the error is a message without the place.
    fn add_record(&mut self, value: Value) -> Result<(), String> {
        let kind = match &value {
            Value::Object(record) => match record.get("kind") {
                Some(Value::String(kind)) => kind.clone(),
                Some(_) => return Err(r#""kind" is not a string"#.to_string()),
                None => return Err(r#"record has no "kind""#.to_string()),
            },
            _ => return Err("record is not a JSON object".to_string()),
        };
        let record: MetricsRecord =
            serde_json::from_value(value).map_err(|e| format!("{kind} record: {e}"))?;
        match record {
            MetricsRecord::Job(job) => {
                // A resumed job continues after the checkpoint's step: what an earlier
                // run wrote past it is history that did not happen in this run.
                if let Some(at) = job.resumed_at_step {
                    let epoch = job
                        .resumed_epoch
                        .ok_or("job record has \"resumed_at_step\" but no \"resumed_epoch\"")?;
                    self.steps.split_off(&(at + 1));
                    self.evals.split_off(&(at + 1));
                    self.epochs.split_off(&epoch);
                }
                self.job = Some(Job {
                    model: job.model,
                    world: job.world.map(u64::from),
                });
            }
            MetricsRecord::Step(step) => {
                let point = StepPoint {
                    epoch: step.epoch,
                    loss: step.loss,
                    lr: step.lr,
                    images_per_s: step.images_per_s,
                };
                self.steps.insert(step.step, point);
            }
            MetricsRecord::Eval(eval) => {
                let point = EvalPoint {
                    epoch: eval.epoch,
                    loss: eval.loss,
                    top1: eval.top1,
                    top5: eval.top5,
                };
                self.evals.insert(eval.step, point);
            }
            MetricsRecord::Epoch(epoch) => {
                self.epochs.insert(epoch.epoch);
            }
            // Kinds the plot does not draw, and kinds from newer versions.
            MetricsRecord::Connect(_) | MetricsRecord::Stop(_) | MetricsRecord::Unknown => {}
        }
        Ok(())
    }

    /// Top-1 and top-5 accuracy in percent per epoch: the eval with the highest step in
    /// each epoch.
    fn accuracy_per_epoch(&self) -> Vec<(u64, f64, f64)> {
        let mut per_epoch = BTreeMap::new();
        for eval in self.evals.values() {
            per_epoch.insert(eval.epoch, (eval.top1 * 100.0, eval.top5 * 100.0));
        }
        per_epoch
            .into_iter()
            .map(|(epoch, (top1, top5))| (epoch, top1, top5))
            .collect()
    }

    fn summary(&self) -> String {
        let epochs: BTreeSet<u64> = self.steps.values().map(|point| point.epoch).collect();
        let mut summary = format!("{} steps, {} epochs", self.steps.len(), epochs.len());
        if let Some((step, point)) = self.steps.last_key_value() {
            summary += &format!(", last loss {:.4} (step {step})", point.loss);
        }
        let best = self
            .accuracy_per_epoch()
            .into_iter()
            .filter(|(_, top1, _)| top1.is_finite())
            .max_by(|a, b| a.1.total_cmp(&b.1));
        match best {
            Some((epoch, top1, _)) => {
                summary += &format!(", best top-1 {top1:.2}% (epoch {epoch})")
            }
            None => summary += ", no eval records",
        }
        summary
    }
}

fn title(run_dir: &Path, job: Option<&Job>) -> String {
    // `.` and `..` have no file name of their own; the resolved path has.
    let name = run_dir
        .canonicalize()
        .ok()
        .and_then(|path| {
            path.file_name()
                .map(|name| name.to_string_lossy().into_owned())
        })
        .unwrap_or_else(|| run_dir.display().to_string());
    let mut title = name;
    if let Some(model) = job.and_then(|job| job.model.as_deref()) {
        title += &format!(" \u{2014} {model}");
    }
    if let Some(world) = job.and_then(|job| job.world) {
        title += &format!(", world {world}");
    }
    title
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;

const FONT: &str = "sans-serif";
const LOSS: RGBColor = RGBColor(31, 119, 180);
const EVAL: RGBColor = RGBColor(214, 39, 40);
const TOP5: RGBColor = RGBColor(255, 127, 14);
const TOP1: RGBColor = RGBColor(44, 160, 44);
const THROUGHPUT: RGBColor = RGBColor(148, 103, 189);
const LR: RGBColor = RGBColor(140, 86, 75);
const GRID: RGBColor = RGBColor(238, 238, 238);

/// Text sizes, in pixels, scaled to the image.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    title: f64,
    caption: f64,
    label: f64,
}

/// Draws the four panels and returns the image as PNG bytes.
fn draw_png(
    metrics: &Metrics,
    title: &str,
    (width, height): (u32, u32),
) -> anyhow::Result<Vec<u8>> {
    register_font()?;
    let short_side = f64::from(width.min(height * 8 / 5));
    let sizes = Sizes {
        title: (short_side / 50.0).max(12.0),
        caption: (short_side / 70.0).max(10.0),
        label: (short_side / 90.0).max(9.0),
    };
    let mut rgb = vec![0u8; width as usize * height as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, (width, height)).into_drawing_area();
        root.fill(&WHITE)?;
        let top = (sizes.title / 2.0).round() as i32;
        let body = root
            .margin(top, 0, 0, 0)
            .titled(title, (FONT, sizes.title))?;
        let panels = body.split_evenly((2, 2));
        let [loss, accuracy, throughput, lr] = panels.as_slice() else {
            bail!("the drawing area did not split into four panels");
        };
        loss_panel(loss, metrics, sizes)?;
        accuracy_panel(accuracy, metrics, sizes)?;
        throughput_panel(throughput, metrics, sizes)?;
        lr_panel(lr, metrics, sizes)?;
        root.present()?;
    }
    let mut png = Vec::new();
    image::codecs::png::PngEncoder::new(&mut png)
        .write_image(&rgb, width, height, image::ExtendedColorType::Rgb8)
        .context("encoding the PNG")?;
    Ok(png)
}

/// Registers the embedded DejaVu Sans once per process, so text never depends on
/// system fonts.
fn register_font() -> anyhow::Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = REGISTERED.get_or_init(|| {
        let bytes = include_bytes!("../../assets/fonts/DejaVuSans.ttf");
        plotters::style::register_font(FONT, FontStyle::Normal, bytes).is_ok()
    });
    if !ok {
        bail!("the embedded font does not parse");
    }
    Ok(())
}

fn loss_panel(area: &Area, metrics: &Metrics, sizes: Sizes) -> anyhow::Result<()> {
    let caption = "training loss";
    let raw = finite(
        metrics
            .steps
            .iter()
            .map(|(&step, point)| (step as f64, point.loss)),
    );
    if raw.is_empty() {
        return empty_panel(area, caption, "no finite loss values", sizes);
    }
    let eval = finite(
        metrics
            .evals
            .iter()
            .map(|(&step, point)| (step as f64, point.loss)),
    );
    let smoothed = moving_average(&raw);
    let x = padded(raw.iter().map(|p| p.0), 0.0);
    let y = padded(raw.iter().chain(&eval).map(|p| p.1), 0.05);
    let mut chart = chart(area, caption, x, y, sizes)?;
    mesh(&mut chart, "step", "loss", sizes)?;
    let thin = LOSS.mix(0.35).stroke_width(1);
    chart
        .draw_series(LineSeries::new(raw, thin))?
        .label("loss per step")
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], thin));
    let thick = LOSS.stroke_width(2);
    chart
        .draw_series(LineSeries::new(smoothed, thick))?
        .label("moving average")
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], thick));
    if !eval.is_empty() {
        let dot = EVAL.filled();
        chart
            .draw_series(eval.iter().map(|&p| Circle::new(p, 4, dot)))?
            .label("eval loss")
            .legend(move |(x, y)| Circle::new((x + 10, y), 4, dot));
    }
    legend(&mut chart, SeriesLabelPosition::UpperRight, sizes)
}

fn accuracy_panel(area: &Area, metrics: &Metrics, sizes: Sizes) -> anyhow::Result<()> {
    let caption = "eval accuracy per epoch";
    let per_epoch = metrics.accuracy_per_epoch();
    let top1 = finite(
        per_epoch
            .iter()
            .map(|&(epoch, top1, _)| (epoch as f64, top1)),
    );
    let top5 = finite(
        per_epoch
            .iter()
            .map(|&(epoch, _, top5)| (epoch as f64, top5)),
    );
    if top1.is_empty() && top5.is_empty() {
        return empty_panel(area, caption, "no eval records", sizes);
    }
    let x = padded(top1.iter().chain(&top5).map(|p| p.0), 0.0);
    let x = (x.start - 0.5)..(x.end + 0.5);
    let y = padded(top1.iter().chain(&top5).map(|p| p.1), 0.08);
    let y = y.start.max(0.0)..y.end.min(100.0);
    let mut chart = chart(area, caption, x, y, sizes)?;
    chart
        .configure_mesh()
        .x_desc("epoch")
        .y_desc("accuracy (%)")
        .x_label_formatter(&|x| whole_number(*x))
        .y_label_formatter(&|y| tick(*y))
        .label_style((FONT, sizes.label))
        .axis_desc_style((FONT, sizes.label))
        .light_line_style(GRID)
        .draw()?;
    for (points, color, name) in [(top5, TOP5, "top-5"), (top1, TOP1, "top-1")] {
        let Some(&(_, last)) = points.last() else {
            continue;
        };
        let style = color.stroke_width(2);
        let dot = color.filled();
        chart.draw_series(LineSeries::new(points.iter().copied(), style))?;
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 4, dot)))?
            .label(format!("{name} (final {last:.2}%)"))
            .legend(move |(x, y)| {
                EmptyElement::at((x, y))
                    + PathElement::new([(0, 0), (20, 0)], style)
                    + Circle::new((10, 0), 4, dot)
            });
    }
    legend(&mut chart, SeriesLabelPosition::LowerRight, sizes)
}

fn throughput_panel(area: &Area, metrics: &Metrics, sizes: Sizes) -> anyhow::Result<()> {
    let caption = "throughput";
    let points = finite(
        metrics
            .steps
            .iter()
            .map(|(&step, point)| (step as f64, point.images_per_s)),
    );
    let Some(median) = median(points.iter().map(|p| p.1)) else {
        return empty_panel(area, caption, "no finite throughput values", sizes);
    };
    let x = padded(points.iter().map(|p| p.0), 0.0);
    let y = padded(points.iter().map(|p| p.1), 0.05);
    let y = y.start.max(0.0)..y.end;
    let ends = [(x.start, median), (x.end, median)];
    let mut chart = chart(area, caption, x, y, sizes)?;
    mesh(&mut chart, "step", "images/s", sizes)?;
    let thin = THROUGHPUT.stroke_width(1);
    chart
        .draw_series(LineSeries::new(points, thin))?
        .label("images/s per step")
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], thin));
    let dashed = BLACK.stroke_width(2);
    chart
        .draw_series(DashedLineSeries::new(ends, 10, 6, dashed))?
        .label(format!("median {median:.0} images/s"))
        .legend(move |(x, y)| {
            EmptyElement::at((x, y))
                + PathElement::new([(0, 0), (8, 0)], dashed)
                + PathElement::new([(12, 0), (20, 0)], dashed)
        });
    legend(&mut chart, SeriesLabelPosition::LowerRight, sizes)
}

fn lr_panel(area: &Area, metrics: &Metrics, sizes: Sizes) -> anyhow::Result<()> {
    let caption = "learning rate";
    let points = finite(
        metrics
            .steps
            .iter()
            .map(|(&step, point)| (step as f64, point.lr)),
    );
    if points.is_empty() {
        return empty_panel(area, caption, "no finite learning rates", sizes);
    }
    let x = padded(points.iter().map(|p| p.0), 0.0);
    let y = padded(points.iter().map(|p| p.1), 0.05);
    let y = y.start.max(0.0)..y.end;
    let mut chart = chart(area, caption, x, y, sizes)?;
    mesh(&mut chart, "step", "learning rate", sizes)?;
    chart.draw_series(LineSeries::new(points, LR.stroke_width(2)))?;
    Ok(())
}

type Chart<'a, 'b> =
    ChartContext<'a, BitMapBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

fn chart<'a, 'b>(
    area: &'a Area<'b>,
    caption: &str,
    x: Range<f64>,
    y: Range<f64>,
    sizes: Sizes,
) -> anyhow::Result<Chart<'a, 'b>> {
    let chart = ChartBuilder::on(area)
        .caption(caption, (FONT, sizes.caption))
        .margin(sizes.label.round() as u32)
        .x_label_area_size((sizes.label * 3.0).round() as u32)
        .y_label_area_size((sizes.label * 5.5).round() as u32)
        .build_cartesian_2d(x, y)?;
    Ok(chart)
}

/// Grid, tick labels and axis names for a panel with steps along x.
fn mesh(chart: &mut Chart, x_desc: &str, y_desc: &str, sizes: Sizes) -> anyhow::Result<()> {
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_label_formatter(&|x| whole_number(*x))
        .y_label_formatter(&|y| tick(*y))
        .label_style((FONT, sizes.label))
        .axis_desc_style((FONT, sizes.label))
        .light_line_style(GRID)
        .draw()?;
    Ok(())
}

fn legend<'a, 'b: 'a>(
    chart: &mut Chart<'a, 'b>,
    position: SeriesLabelPosition,
    sizes: Sizes,
) -> anyhow::Result<()> {
    chart
        .configure_series_labels()
        .position(position)
        .label_font((FONT, sizes.label))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .draw()?;
    Ok(())
}

/// A panel that says why it has no chart.
fn empty_panel(area: &Area, caption: &str, message: &str, sizes: Sizes) -> anyhow::Result<()> {
    let (width, height) = area.dim_in_pixel();
    let center =
        |size| TextStyle::from((FONT, size).into_font()).pos(Pos::new(HPos::Center, VPos::Center));
    let middle = (width as i32 / 2, height as i32 / 2);
    area.draw_text(
        caption,
        &center(sizes.caption),
        (middle.0, sizes.caption as i32),
    )?;
    area.draw_text(
        message,
        &center(sizes.caption).color(&RGBColor(120, 120, 120)),
        middle,
    )?;
    Ok(())
}

/// The points whose value is finite (a diverged loss is NaN or infinite).
fn finite(points: impl Iterator<Item = (f64, f64)>) -> Vec<(f64, f64)> {
    points.filter(|(_, y)| y.is_finite()).collect()
}

/// A trailing moving average over about a twentieth of the points.
fn moving_average(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let window = (points.len() / 20).clamp(1, 200);
    let mut sum = 0.0;
    let mut averaged = Vec::with_capacity(points.len());
    for (i, &(x, y)) in points.iter().enumerate() {
        sum += y;
        if i >= window {
            sum -= points[i - window].1;
        }
        averaged.push((x, sum / (i + 1).min(window) as f64));
    }
    averaged
}

fn median(values: impl Iterator<Item = f64>) -> Option<f64> {
    let mut values: Vec<f64> = values.collect();
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    match values.len() {
        0 => None,
        n if n % 2 == 1 => Some(values[mid]),
        _ => Some((values[mid - 1] + values[mid]) / 2.0),
    }
}

/// The range of `values` widened by `pad` of its span on each side; never empty.
fn padded(values: impl Iterator<Item = f64>, pad: f64) -> Range<f64> {
    let (low, high) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(low, high), v| {
        (low.min(v), high.max(v))
    });
    if !low.is_finite() || !high.is_finite() {
        return 0.0..1.0;
    }
    let span = high - low;
    if span <= f64::EPSILON * high.abs().max(1.0) {
        let half = (high.abs() * 0.1).max(0.5);
        return (low - half)..(high + half);
    }
    (low - span * pad)..(high + span * pad)
}

/// Labels integer ticks only (steps, epochs).
fn whole_number(x: f64) -> String {
    if (x - x.round()).abs() < 1e-9 {
        format!("{}", x.round())
    } else {
        String::new()
    }
}

/// A short tick label that also reads for small learning rates.
fn tick(y: f64) -> String {
    let magnitude = y.abs();
    if magnitude == 0.0 {
        "0".to_string()
    } else if magnitude < 1e-3 {
        format!("{y:.1e}")
    } else if magnitude >= 1e5 {
        format!("{y:.2e}")
    } else {
        let text = format!("{y:.4}");
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "run/metrics.jsonl";

    fn parse(text: &str) -> anyhow::Result<Metrics> {
        parse_metrics(Path::new(FILE), text.as_bytes())
    }

    fn step(step: u64, epoch: u64, loss: f64) -> String {
        format!(
            r#"{{"kind":"step","epoch":{epoch},"step":{step},"loss":{loss},"lr":0.1,"images_per_s":400.0,"data_wait_s":0.01,"allreduce_s":0.02,"step_s":0.3,"elapsed_s":1.0}}"#
        )
    }

    /// A run of `steps` steps over `epochs` epochs that looks like training.
    fn sample(steps: u64, epochs: u64) -> String {
        let per_epoch = steps / epochs;
        let mut lines = vec![
            r#"{"kind":"job","time":1700000000,"world":2,"model":"small_cnn","global_batch":128,"seed":7}"#.to_string(),
        ];
        for s in 1..=steps {
            let epoch = (s - 1) / per_epoch;
            let t = s as f64;
            let loss = 2.3 * (-t / 80.0).exp() + 0.3 + 0.15 * (t * 1.7).sin();
            let lr = if s < 30 {
                0.1 * t / 30.0
            } else {
                0.1 * (1.0 + (std::f64::consts::PI * t / steps as f64).cos()) / 2.0
            };
            let ips = 900.0 + 60.0 * (t * 0.9).sin() - if s < 5 { 500.0 } else { 0.0 };
            lines.push(format!(
                r#"{{"kind":"step","epoch":{epoch},"step":{s},"loss":{loss},"lr":{lr},"images_per_s":{ips},"data_wait_s":0.01,"allreduce_s":0.02,"step_s":0.14,"elapsed_s":{}}}"#,
                t * 0.14
            ));
            if s % per_epoch == 0 {
                let e = epoch as f64;
                let top1 = 0.35 + 0.4 * (1.0 - (-e / 3.0).exp());
                let top5 = 0.7 + 0.27 * (1.0 - (-e / 2.5).exp());
                lines.push(format!(
                    r#"{{"kind":"eval","epoch":{epoch},"step":{s},"loss":{},"top1":{top1},"top5":{top5},"samples":1000,"elapsed_s":1.0}}"#,
                    loss + 0.1
                ));
                lines.push(format!(
                    r#"{{"kind":"epoch","epoch":{epoch},"step":{s},"train_loss":{loss},"images_per_s":880.0,"data_wait_fraction":0.02,"seconds":4.2,"elapsed_s":1.0}}"#
                ));
            }
        }
        lines.join("\n") + "\n"
    }

    #[test]
    fn parses_a_good_file() {
        let text = [
            r#"{"kind":"job","time":1,"world":2,"model":"small_cnn","global_batch":128,"new":{"x":1}}"#.to_string(),
            step(1, 0, 2.0),
            step(2, 0, 1.9),
            step(3, 0, 1.8),
            step(4, 1, 1.7),
            r#"{"kind":"eval","epoch":1,"step":4,"loss":1.2,"top1":0.4,"top5":0.8,"samples":10,"elapsed_s":1}"#.to_string(),
            r#"{"kind":"epoch","epoch":1,"step":4,"train_loss":1.3,"images_per_s":1,"data_wait_fraction":0,"seconds":1,"elapsed_s":1}"#.to_string(),
            r#"{"kind":"checkpoint","step":3,"path":"ckpt-3"}"#.to_string(),
            // Resumed from step 1: steps 2 and 3 are written again, and what the first
            // run wrote past step 1 (step 4, its eval and epoch 1) is gone.
            r#"{"kind":"job","time":2,"world":4,"model":"small_cnn","resumed_at_step":1,"resumed_epoch":0}"#.to_string(),
            step(2, 0, 1.5),
            step(3, 1, 1.4),
            String::new(),
            r#"{"kind":"eval","epoch":1,"step":3,"loss":1.2,"top1":0.5,"top5":0.9,"samples":10,"elapsed_s":1,"extra":true}"#.to_string(),
            r#"{"kind":"epoch","epoch":1,"step":3,"train_loss":1.3,"images_per_s":1,"data_wait_fraction":0,"seconds":1,"elapsed_s":1}"#.to_string(),
        ]
        .join("\n");
        let metrics = parse(&text).expect("a good file parses");
        let losses: Vec<(u64, f64)> = metrics.steps.iter().map(|(&s, p)| (s, p.loss)).collect();
        assert_eq!(losses, [(1, 2.0), (2, 1.5), (3, 1.4)]);
        assert_eq!(
            metrics.job,
            Some(Job {
                model: Some("small_cnn".into()),
                world: Some(4)
            })
        );
        assert_eq!(metrics.accuracy_per_epoch(), [(1, 50.0, 90.0)]);
        assert_eq!(metrics.epochs, BTreeSet::from([1]));
        assert_eq!(metrics.skipped_last_line, None);
        assert_eq!(
            metrics.summary(),
            "3 steps, 2 epochs, last loss 1.4000 (step 3), best top-1 50.00% (epoch 1)"
        );
    }

    #[test]
    fn a_null_loss_reads_as_nan() {
        let text = r#"{"kind":"step","epoch":0,"step":1,"loss":null,"lr":0.1,"images_per_s":1}"#;
        let metrics = parse(text).expect("null is a NaN loss");
        assert!(metrics.steps[&1].loss.is_nan());
    }

    #[test]
    fn bad_files_name_the_line() {
        let good = step(1, 0, 1.0);
        let cases: &[(&str, String, &str)] = &[
            (
                "empty",
                String::new(),
                "run/metrics.jsonl: the file is empty",
            ),
            (
                "blank lines",
                "\n \n".into(),
                "run/metrics.jsonl: the file is empty",
            ),
            (
                "no steps",
                r#"{"kind":"job","world":1}"#.into(),
                "run/metrics.jsonl: no step records",
            ),
            (
                "not JSON",
                format!("{good}\nnot json\n{good}"),
                "run/metrics.jsonl:2: invalid JSON",
            ),
            (
                "a resume point that is not a step",
                format!("{good}\n{{\"kind\":\"job\",\"resumed_at_step\":-1,\"resumed_epoch\":0}}"),
                "run/metrics.jsonl:2: job record: invalid value: integer `-1`, expected u64",
            ),
            (
                "a resume without its epoch",
                format!("{good}\n{{\"kind\":\"job\",\"resumed_at_step\":1}}"),
                r#"run/metrics.jsonl:2: job record has "resumed_at_step" but no "resumed_epoch""#,
            ),
            (
                "truncated line in the middle",
                format!("{good}\n{{\"kind\":\"st\n{good}"),
                "run/metrics.jsonl:2: invalid JSON",
            ),
            (
                "bad syntax on the last line",
                format!("{good}\n{{\"kind\":\"step\"]"),
                "run/metrics.jsonl:2: invalid JSON",
            ),
            (
                "not an object",
                format!("{good}\n[1,2]"),
                "run/metrics.jsonl:2: record is not a JSON object",
            ),
            (
                "no kind",
                format!("{good}\n{{\"step\":1}}"),
                r#"run/metrics.jsonl:2: record has no "kind""#,
            ),
            (
                "step without loss",
                format!(
                    "{good}\n\n{}",
                    r#"{"kind":"step","epoch":0,"step":2,"lr":0.1,"images_per_s":1}"#
                ),
                "run/metrics.jsonl:3: step record: missing field `loss`",
            ),
            (
                "loss as a string",
                r#"{"kind":"step","epoch":0,"step":2,"loss":"1","lr":0.1,"images_per_s":1}"#.into(),
                r#"run/metrics.jsonl:1: step record: invalid type: string "1", expected f64"#,
            ),
            (
                "negative step",
                r#"{"kind":"step","epoch":0,"step":-2,"loss":1,"lr":0.1,"images_per_s":1}"#.into(),
                "run/metrics.jsonl:1: step record: invalid value: integer `-2`, expected u64",
            ),
            (
                "eval without top1",
                format!(
                    "{good}\n{}",
                    r#"{"kind":"eval","epoch":0,"step":1,"loss":1,"top5":0.9}"#
                ),
                "run/metrics.jsonl:2: eval record: missing field `top1`",
            ),
            (
                "epoch without epoch",
                format!("{good}\n{}", r#"{"kind":"epoch","step":1,"train_loss":1}"#),
                "run/metrics.jsonl:2: epoch record: missing field `epoch`",
            ),
        ];
        for (name, text, expected) in cases {
            let error = parse(text).expect_err(name);
            let message = format!("{error:#}");
            assert!(
                message.starts_with(expected),
                "{name}: got {message:?}, want {expected:?}"
            );
        }
    }

    #[test]
    fn skips_a_truncated_last_line() {
        let cut = step(3, 0, 1.0);
        for (name, tail) in [
            ("mid-key", &cut[..20]),
            (
                "mid-number",
                &cut[..cut.find("1.0").map_or(cut.len(), |at| at + 2)],
            ),
            ("before the brace", &cut[..cut.len() - 1]),
        ] {
            let text = format!("{}\n{}\n{tail}", step(1, 0, 2.0), step(2, 0, 1.5));
            let metrics = parse(&text).unwrap_or_else(|e| panic!("{name}: {e:#}"));
            assert_eq!(metrics.skipped_last_line, Some(3), "{name}");
            assert_eq!(metrics.steps.len(), 2, "{name}");
        }
    }

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

    #[test]
    fn helpers() {
        assert_eq!(median([3.0, 1.0, 2.0].into_iter()), Some(2.0));
        assert_eq!(median([4.0, 1.0, 2.0, 3.0].into_iter()), Some(2.5));
        assert_eq!(median(std::iter::empty()), None);
        assert_eq!(padded([5.0].into_iter(), 0.1), 4.5..5.5);
        assert_eq!(padded([0.0, 10.0].into_iter(), 0.1), -1.0..11.0);
        let averaged = moving_average(&[(0.0, 1.0), (1.0, 3.0)]);
        assert_eq!(averaged, [(0.0, 1.0), (1.0, 3.0)]);
        assert_eq!(tick(0.1), "0.1");
        assert_eq!(tick(0.00005), "5.0e-5");
        assert_eq!(whole_number(3.0), "3");
        assert_eq!(whole_number(2.5), "");
    }
}
