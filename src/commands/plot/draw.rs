//! Drawing parsed metrics: a 2x2 grid of training loss, eval accuracy, throughput and
//! learning rate, as a PNG (`imgrun plot`) or an SVG (the dashboard's job page), by one
//! drawing over any plotters backend.

use std::ops::Range;
use std::path::Path;
use std::sync::OnceLock;

use anyhow::{Context, bail};
use image::ImageEncoder;
use plotters::coord::Shift;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::parse::{Job, Metrics};

pub(super) fn title(run_dir: &Path, job: Option<&Job>) -> String {
    // `.` and `..` have no file name of their own; the resolved path has.
    let name = run_dir
        .canonicalize()
        .ok()
        .and_then(|path| {
            path.file_name()
                .map(|name| name.to_string_lossy().into_owned())
        })
        .unwrap_or_else(|| run_dir.display().to_string());
    named_title(name, job)
}

/// The title of the run called `name`: its name, model and world size.
pub(super) fn named_title(name: String, job: Option<&Job>) -> String {
    let mut title = name;
    if let Some(model) = job.and_then(|job| job.model.as_deref()) {
        title += &format!(" \u{2014} {model}");
    }
    if let Some(world) = job.and_then(|job| job.world) {
        title += &format!(", world {world}");
    }
    title
}

/// A plotters backend whose errors can travel as `anyhow` errors.
trait Backend: DrawingBackend<ErrorType: 'static> {}

impl<B: DrawingBackend<ErrorType: 'static>> Backend for B {}

type Area<B> = DrawingArea<B, Shift>;

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
pub(super) fn draw_png(
    metrics: &Metrics,
    title: &str,
    (width, height): (u32, u32),
) -> anyhow::Result<Vec<u8>> {
    register_font()?;
    let mut rgb = vec![0u8; width as usize * height as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, (width, height)).into_drawing_area();
        draw(&root, metrics, title, (width, height))?;
        root.present()?;
    }
    let mut png = Vec::new();
    image::codecs::png::PngEncoder::new(&mut png)
        .write_image(&rgb, width, height, image::ExtendedColorType::Rgb8)
        .context("encoding the PNG")?;
    Ok(png)
}

/// Draws the four panels and returns the image as an SVG document.
pub(super) fn draw_svg(
    metrics: &Metrics,
    title: &str,
    (width, height): (u32, u32),
) -> anyhow::Result<String> {
    register_font()?;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
        draw(&root, metrics, title, (width, height))?;
        root.present()?;
    }
    Ok(svg)
}

/// The title above a 2x2 grid of the panels, text sized to the image.
fn draw<B: Backend>(
    root: &Area<B>,
    metrics: &Metrics,
    title: &str,
    (width, height): (u32, u32),
) -> anyhow::Result<()> {
    let short_side = f64::from(width.min(height * 8 / 5));
    let sizes = Sizes {
        title: (short_side / 50.0).max(12.0),
        caption: (short_side / 70.0).max(10.0),
        label: (short_side / 90.0).max(9.0),
    };
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
    Ok(())
}

/// Registers the embedded DejaVu Sans once per process, so text never depends on
/// system fonts.
fn register_font() -> anyhow::Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = REGISTERED.get_or_init(|| {
        let bytes = include_bytes!("../../../assets/fonts/DejaVuSans.ttf");
        plotters::style::register_font(FONT, FontStyle::Normal, bytes).is_ok()
    });
    if !ok {
        bail!("the embedded font does not parse");
    }
    Ok(())
}

fn loss_panel<B: Backend>(area: &Area<B>, metrics: &Metrics, sizes: Sizes) -> anyhow::Result<()> {
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

fn accuracy_panel<B: Backend>(
    area: &Area<B>,
    metrics: &Metrics,
    sizes: Sizes,
) -> anyhow::Result<()> {
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

fn throughput_panel<B: Backend>(
    area: &Area<B>,
    metrics: &Metrics,
    sizes: Sizes,
) -> anyhow::Result<()> {
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

fn lr_panel<B: Backend>(area: &Area<B>, metrics: &Metrics, sizes: Sizes) -> anyhow::Result<()> {
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

type Chart<'a, B> = ChartContext<'a, B, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

fn chart<'a, B: Backend>(
    area: &'a Area<B>,
    caption: &str,
    x: Range<f64>,
    y: Range<f64>,
    sizes: Sizes,
) -> anyhow::Result<Chart<'a, B>> {
    let chart = ChartBuilder::on(area)
        .caption(caption, (FONT, sizes.caption))
        .margin(sizes.label.round() as u32)
        .x_label_area_size((sizes.label * 3.0).round() as u32)
        .y_label_area_size((sizes.label * 5.5).round() as u32)
        .build_cartesian_2d(x, y)?;
    Ok(chart)
}

/// Grid, tick labels and axis names for a panel with steps along x.
fn mesh<B: Backend>(
    chart: &mut Chart<'_, B>,
    x_desc: &str,
    y_desc: &str,
    sizes: Sizes,
) -> anyhow::Result<()> {
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

fn legend<'a, B: Backend + 'a>(
    chart: &mut Chart<'a, B>,
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
fn empty_panel<B: Backend>(
    area: &Area<B>,
    caption: &str,
    message: &str,
    sizes: Sizes,
) -> anyhow::Result<()> {
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
