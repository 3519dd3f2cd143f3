//! Loader benchmark: ImageNet-like JPEG shards to training inputs. imgrun's decoder and
//! train transform against the usual PyTorch pipeline (Python `webdataset`, PIL,
//! torchvision, `DataLoader`) on the same shards, in images/s per worker.
//!
//!     cargo bench -p pipelines --bench loader [-- --samples N --shards N --workers 1,2]
//!
//! The shards are made once from the real photos in `assets/photos/` (without
//! them the benchmark says so and exits): each sample is a random crop of a photo resized
//! to an ImageNet-like size (mostly 500x375 or 500x333; some portrait, square or smaller),
//! JPEG quality 90 with 4:2:0 chroma, plus a `cls`. 3,000 samples (`--samples`, or
//! `IMGRUN_BENCH_SAMPLES`) in 8 shards, kept in `$IMGRUN_CACHE/bench-data`, or
//! `target/bench-data` when `IMGRUN_CACHE` is not set. The sizes are ImageNet's, the
//! files are not: these photos are smoother, so a sample is about 45 KB where ImageNet's
//! average about 110 KB, and decoding is a smaller share of the time than on ImageNet.
//! Python comes from `tools/pybench.sh` and runs `benches/python/loader_bench.py`;
//! without it the output says why the Python rows were skipped.
//!
//! Every row comes after a warm-up of one batch per worker: the decode and transform rows
//! then time one pass over all samples, the loader rows and Python's `DataLoader` the rest
//! of the epoch (the first batch of every worker untimed). Worker `w` of `n` reads shards
//! `w, w + n, ...`, as WebDataset splits shards between `DataLoader` workers. The goal is imgrun >= 3x Python's train images/s per worker
//! (per core). Timings are printed, never asserted. `--only-imgrun` skips Python, for
//! profiling:
//!
//!     perf record -g target/release/deps/loader-<hash> --only-imgrun --workers 1

mod common;
// A crate root looks for modules beside itself; this one is the bench's own.
#[path = "loader/shards.rs"]
mod shards;

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Barrier;
use std::time::Instant;

use common::{data_dir, load_average, machine_line, ratio_line, repo_root, warm};
use pipelines::{
    BatchPolicy, ClusterShape, DecodeLimits, Hooks, Loader, LoaderConfig, OutputFormat, PlanConfig,
    PlanMode, PlanShard, Planner, Rank, SampleReader, Sources, SplitMix64, TrainTransform,
    Transform, TransformError, decode_rgb, process_cpu_seconds,
};
use shards::{DATA_VERSION, ensure_shards};

const DEFAULT_SAMPLES: u64 = 3_000;
const DEFAULT_SHARDS: u64 = 8;
const DEFAULT_WORKERS: [usize; 2] = [1, 2];
/// Output side of the train transform.
const SIZE: u32 = 224;
const BATCH: usize = 256;
/// Untimed images per worker before every row: one batch.
const WARMUP: u64 = BATCH as u64;
/// Of the augmentation and of the generated data.
const SEED: u64 = 20_240_101;
const GOAL_PER_WORKER: f64 = 3.0;

fn main() {
    let options = Options::parse().unwrap_or_else(|error| fail(&error));
    let machine_at_start = machine_line();
    let root = repo_root();
    let photos = root.join("assets/photos");
    if !photos.is_dir() {
        println!(
            "loader bench: skipped: no photos in {} (the checkout's assets/photos/)",
            photos.display()
        );
        return;
    }
    let name = format!("{DATA_VERSION}-{}x{}", options.samples, options.shards);
    let dir = data_dir(&root, &name);
    let shards = ensure_shards(&dir, &photos, options.samples, options.shards)
        .unwrap_or_else(|error| fail(&format!("cannot make shards in {}: {error}", dir.display())));
    let urls: Vec<String> = shards
        .paths
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let tar_bytes: u64 = shards
        .paths
        .iter()
        .map(|p| std::fs::metadata(p).map_or(0, |m| m.len()))
        .sum();
    for path in &shards.paths {
        warm(path);
    }
    println!(
        "loader benchmark: {} samples in {} shards ({:.1} MB of tar), {}",
        options.samples,
        shards.paths.len(),
        tar_bytes as f64 / 1e6,
        dir.display()
    );
    println!("data: {}", shards.description);
    println!("machine: {machine_at_start} at start (shared with other work, so timings are noisy)");
    println!(
        "each row: after {WARMUP} warm-up images per worker, one pass over all samples \
         (loaders: the rest of the epoch); worker w of n reads shards w, w+n, ...; batches of {BATCH}"
    );
    println!("rerun: {}", options.rerun());

    let mut rows = Vec::new();
    for &workers in &options.workers {
        rows.push(Row {
            side: Side::Imgrun,
            kind: Kind::Decode,
            workers,
            result: measure(&urls, workers, WARMUP, &|_| decode_step()),
        });
    }
    rows.extend(imgrun_transform_rows(&urls, &options.workers));
    rows.extend(imgrun_loader_rows(&urls, &options.workers));
    let read_only = measure(&urls, 1, 0, &|_| {
        Box::new(|bytes| {
            std::hint::black_box(bytes);
            Ok(())
        })
    });
    let python = if options.only_imgrun {
        Err("--only-imgrun".to_string())
    } else {
        python_rows(&root, &urls, &options.workers)
    };

    match &python {
        Ok(run) => {
            println!("python: {}", run.versions);
            println!("python rerun: {}", run.command);
            rows.extend(run.rows.iter().cloned());
        }
        Err(reason) => println!("python: skipped ({reason})"),
    }

    println!();
    println!(
        "{:<42} {:>7} {:>6} {:>8} {:>7} {:>12} {:>9}",
        "", "workers", "images", "seconds", "img/s", "img/s/worker", "img/CPU-s"
    );
    println!("decode only: shard bytes to full-size RGB8");
    print_rows(&rows, &[Kind::Decode]);
    println!("train transform {SIZE}: RandomResizedCrop + flip, into a batch buffer of {BATCH}");
    print_rows(&rows, &[Kind::TrainU8, Kind::TrainF32]);
    println!(
        "whole loader, train {SIZE}: plan (split), reader threads, shuffle buffer {}, batches of {BATCH}",
        LoaderConfig::default().shuffle_buffer
    );
    print_rows(&rows, &[Kind::LoaderU8, Kind::LoaderF32]);
    if python.is_err() {
        println!("  python rows skipped (see above)");
    }

    println!();
    print_ratios(&rows, &options.workers);
    println!();
    print_breakdown(&rows, read_only.ok());
    println!();
    println!("load average at end: {}", load_average());
}

/// The train transform alone at 224, `u8` NHWC and normalised `f32` CHW, for each
/// worker count: each worker thread streams its shards with a `SampleReader` and applies
/// `TrainTransform` into the next slot of its own batch buffer of 256 images, reused
/// batch after batch (no shuffle buffer, no queues, no labels).
fn imgrun_transform_rows(urls: &[String], workers: &[usize]) -> Vec<Row> {
    let u8_transform = TrainTransform::new(SIZE);
    let f32_transform = TrainTransform {
        output: OutputFormat::IMAGENET_F32,
        ..TrainTransform::new(SIZE)
    };
    let mut rows = Vec::new();
    for kind in [Kind::TrainU8, Kind::TrainF32] {
        for &n in workers {
            let make_step = |worker: usize| match kind {
                Kind::TrainF32 => train_step::<f32>(f32_transform, worker, |t, bytes, rng, out| {
                    t.apply_f32(bytes, rng, out)
                }),
                _ => train_step::<u8>(u8_transform, worker, |t, bytes, rng, out| {
                    t.apply_u8(bytes, rng, out)
                }),
            };
            rows.push(Row {
                side: Side::Imgrun,
                kind,
                workers: n,
                result: measure(urls, n, WARMUP, &make_step),
            });
        }
    }
    rows
}

/// The whole loader at 224, `u8` and `f32`, for each worker count: one rank's epoch of a
/// split plan over the shards (worker `w` of `n` reads shards `w, w + n, ...`), with the
/// default shuffle buffer and queues, timed from the end of the first batch of every
/// worker to the last batch (the rest of the epoch, as Python's row times its loader).
fn imgrun_loader_rows(urls: &[String], workers: &[usize]) -> Vec<Row> {
    let mut rows = Vec::new();
    for (kind, output) in [
        (Kind::LoaderU8, OutputFormat::Uint8Nhwc),
        (Kind::LoaderF32, OutputFormat::IMAGENET_F32),
    ] {
        for &n in workers {
            let transform = Transform::Train(TrainTransform {
                output,
                ..TrainTransform::new(SIZE)
            });
            rows.push(Row {
                side: Side::Imgrun,
                kind,
                workers: n,
                result: loader_epoch(urls, n, transform),
            });
        }
    }
    rows
}

fn loader_epoch(urls: &[String], workers: usize, transform: Transform) -> Result<Measured, String> {
    let shards = PlanShard::from_urls(urls.iter().cloned());
    let mut config = PlanConfig::new(
        shards,
        ClusterShape::new(1, 1, workers as u32),
        BATCH as u64,
    );
    config.mode = PlanMode::Split;
    config.policy = BatchPolicy::Join;
    config.drop_partial = false;
    config.shuffle_shards = false;
    let plan = Planner::new(config, Hooks::builtin())
        .and_then(|planner| planner.plan(0))
        .map_err(|e| e.to_string())?;
    let loader =
        Loader::new(LoaderConfig::default(), Sources::default()).map_err(|e| e.to_string())?;
    let mut batches = loader
        .epoch(&plan, Rank(0), transform, None)
        .map_err(|e| e.to_string())?;
    // Warm-up, as for the other rows and Python's: the first batch of every worker (they
    // take turns), which also starts the threads and fills the shuffle buffer.
    for batch in batches.by_ref().take(workers) {
        batch.map_err(|e| e.to_string())?;
    }
    let cpu_at_start = process_cpu_seconds();
    let start = Instant::now();
    let mut images = 0;
    for batch in batches {
        images += batch.map_err(|e| e.to_string())?.len() as u64;
    }
    let seconds = start.elapsed().as_secs_f64();
    let cpu_seconds = cpu_at_start
        .zip(process_cpu_seconds())
        .map(|(start, end)| end - start);
    Ok(Measured {
        images,
        seconds,
        cpu_seconds,
    })
}

/// Command-line options (after `--`); unknown arguments (such as cargo's `--bench`) are
/// ignored.
#[derive(Debug, Clone)]
struct Options {
    samples: u64,
    shards: u64,
    workers: Vec<usize>,
    only_imgrun: bool,
}

impl Options {
    fn parse() -> Result<Self, String> {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let value = |flag: &str| {
            args.iter()
                .position(|a| a == flag)
                .map(|i| {
                    args.get(i + 1)
                        .cloned()
                        .ok_or(format!("{flag} needs a value"))
                })
                .transpose()
        };
        let number = |text: &str, what: &str| {
            text.parse::<u64>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or(format!("{what} must be a positive integer, not `{text}`"))
        };
        let samples =
            match value("--samples")?.or_else(|| std::env::var("IMGRUN_BENCH_SAMPLES").ok()) {
                Some(text) => number(&text, "--samples")?,
                None => DEFAULT_SAMPLES,
            };
        let shards = match value("--shards")? {
            Some(text) => number(&text, "--shards")?,
            None => DEFAULT_SHARDS,
        };
        let workers = match value("--workers")? {
            Some(text) => text
                .split(',')
                .map(|n| number(n, "--workers").map(|n| n as usize))
                .collect::<Result<Vec<_>, _>>()?,
            None => DEFAULT_WORKERS.to_vec(),
        };
        Ok(Self {
            samples,
            // A shard holds at least one sample.
            shards: shards.min(samples),
            workers,
            only_imgrun: args.iter().any(|a| a == "--only-imgrun"),
        })
    }

    /// The command that runs this benchmark again with these options.
    fn rerun(&self) -> String {
        let workers: Vec<String> = self.workers.iter().map(usize::to_string).collect();
        format!(
            "cargo bench -p pipelines --bench loader -- --samples {} --shards {} --workers {}{}",
            self.samples,
            self.shards,
            workers.join(","),
            if self.only_imgrun {
                " --only-imgrun"
            } else {
                ""
            }
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Imgrun,
    Python,
}

/// What a row measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Shard bytes to a full-size RGB8 image.
    Decode,
    /// Train transform into a `u8` NHWC batch slot.
    TrainU8,
    /// Train transform into a normalised `f32` CHW batch slot.
    TrainF32,
    /// The whole loader (`pipelines::Loader`: reader threads, shuffle buffer, batches,
    /// queues), `u8` NHWC.
    LoaderU8,
    /// The whole loader, normalised `f32` CHW.
    LoaderF32,
}

/// One row of the table.
#[derive(Debug, Clone)]
struct Row {
    side: Side,
    kind: Kind,
    workers: usize,
    result: Result<Measured, String>,
}

impl Row {
    fn name(&self) -> &'static str {
        match (self.side, self.kind) {
            (Side::Imgrun, Kind::Decode) => "imgrun decode_rgb",
            (Side::Imgrun, Kind::TrainU8) => "imgrun TrainTransform, u8 NHWC",
            (Side::Imgrun, Kind::TrainF32) => "imgrun TrainTransform, f32 CHW normalised",
            (Side::Imgrun, Kind::LoaderU8) => "imgrun Loader, u8 NHWC",
            (Side::Imgrun, Kind::LoaderF32) => "imgrun Loader, f32 CHW normalised",
            (Side::Python, Kind::Decode) => "python PIL open + convert('RGB')",
            // Python's pipeline has one output: torchvision's normalised float tensor.
            (Side::Python, Kind::TrainU8 | Kind::TrainF32 | Kind::LoaderU8 | Kind::LoaderF32) => {
                "python torchvision + DataLoader, f32 CHW"
            }
        }
    }
}

/// Images of one timed pass, its wall-clock time, and the CPU time of the threads or
/// processes that did the work (when the platform tells).
#[derive(Debug, Clone, Copy)]
struct Measured {
    images: u64,
    seconds: f64,
    cpu_seconds: Option<f64>,
}

impl Measured {
    fn per_second(&self) -> f64 {
        self.images as f64 / self.seconds.max(1e-9)
    }

    fn per_worker(&self, workers: usize) -> f64 {
        self.per_second() / workers.max(1) as f64
    }

    fn per_cpu_second(&self) -> Option<f64> {
        self.cpu_seconds
            .map(|cpu| self.images as f64 / cpu.max(1e-9))
    }

    /// Milliseconds of CPU (or, without CPU times, of one worker's wall clock) per image.
    fn ms_per_image(&self, workers: usize) -> f64 {
        1e3 / self
            .per_cpu_second()
            .unwrap_or_else(|| self.per_worker(workers))
    }
}

fn fail(message: &str) -> ! {
    common::fail("loader", message)
}

fn find(rows: &[Row], side: Side, kind: Kind, workers: usize) -> Option<Measured> {
    rows.iter()
        .find(|r| r.side == side && r.kind == kind && r.workers == workers)
        .and_then(|r| r.result.as_ref().ok().copied())
}

fn print_rows(rows: &[Row], kinds: &[Kind]) {
    for row in rows.iter().filter(|r| kinds.contains(&r.kind)) {
        let name = row.name();
        match &row.result {
            Ok(m) => println!(
                "  {name:<40} {:>7} {:>6} {:>8.3} {:>7.0} {:>12.0} {:>9}",
                row.workers,
                m.images,
                m.seconds,
                m.per_second(),
                m.per_worker(row.workers),
                m.per_cpu_second().map_or("-".into(), |v| format!("{v:.0}")),
            ),
            Err(error) => println!("  {name:<40} {:>7}  failed: {error}", row.workers),
        }
    }
}

/// A figure of merit of a row with this many workers.
type Figure = fn(&Measured, usize) -> Option<f64>;

/// imgrun over Python for the train transform, per worker and per CPU-second.
fn print_ratios(rows: &[Row], workers: &[usize]) {
    let measures: [(&str, Figure); 2] = [
        ("img/s per worker", |m, n| Some(m.per_worker(n))),
        ("images per CPU-second", |m, _| m.per_cpu_second()),
    ];
    for (what, measure) in measures {
        println!(
            "{:<36} {:>10} {:>8}",
            format!("train {SIZE}, {what}"),
            "measured",
            "goal"
        );
        for &n in workers {
            let python = find(rows, Side::Python, Kind::TrainF32, n).and_then(|m| measure(&m, n));
            for (kind, label) in [
                (Kind::LoaderF32, "loader f32"),
                (Kind::LoaderU8, "loader u8"),
                (Kind::TrainF32, "transform f32"),
                (Kind::TrainU8, "transform u8"),
            ] {
                let imgrun = find(rows, Side::Imgrun, kind, n).and_then(|m| measure(&m, n));
                let plural = if n == 1 { "" } else { "s" };
                ratio_line(
                    &format!("  {n} worker{plural}: imgrun {label} / python"),
                    imgrun.zip(python).map(|(i, p)| i / p),
                    Some(GOAL_PER_WORKER),
                );
            }
        }
    }
    let imgrun = find(rows, Side::Imgrun, Kind::Decode, 1);
    let python = find(rows, Side::Python, Kind::Decode, 1);
    ratio_line(
        "decode, 1 thread: imgrun / PIL",
        imgrun
            .zip(python)
            .map(|(i, p)| i.per_second() / p.per_second()),
        None,
    );
}

/// Where the time of one worker goes, from the one-worker rows: CPU milliseconds per image.
fn print_breakdown(rows: &[Row], read_only: Option<Measured>) {
    let ms = |side, kind| find(rows, side, kind, 1).map(|m| m.ms_per_image(1));
    let read = read_only.map(|m| m.ms_per_image(1));
    let decode = ms(Side::Imgrun, Kind::Decode);
    let train_u8 = ms(Side::Imgrun, Kind::TrainU8);
    let train_f32 = ms(Side::Imgrun, Kind::TrainF32);
    let minus = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| a - b);
    let line = |name: &str, value: Option<f64>| match value {
        Some(v) => println!("  {name:<54} {v:>6.2}"),
        None => println!("  {name:<54} {:>6}", "-"),
    };
    println!("where one worker's time goes (ms of CPU per image, from the 1-worker rows)");
    line("imgrun: read shards (SampleReader, no decode)", read);
    line(
        "imgrun: decode full size (decode row - read)",
        minus(decode, read),
    );
    line(
        // The train transform decodes only the crop's region (with libjpeg-turbo: the
        // rows above entropy-decoded only, the columns beside it not at all), so this is
        // the resample and write less what the crop leaves undecoded: it can be negative.
        "imgrun: train u8 - full decode (resample, less decoded)",
        minus(train_u8, decode),
    );
    line(
        "imgrun: f32 normalised CHW instead (f32 - u8)",
        minus(train_f32, train_u8),
    );
    line("imgrun: train u8, total", train_u8);
    let python_decode = ms(Side::Python, Kind::Decode);
    let python_train = ms(Side::Python, Kind::TrainF32);
    line("python: read + PIL decode (decode row)", python_decode);
    line(
        "python: torchvision, collate, IPC (train - decode)",
        minus(python_train, python_decode),
    );
    line("python: train f32, total", python_train);
}

/// What a worker thread does with each image. Made once per thread, owning its buffers.
type ImageStep = Box<dyn FnMut(&[u8]) -> Result<(), String>>;

fn decode_step() -> ImageStep {
    let limits = DecodeLimits::default();
    Box::new(move |bytes| {
        let image = decode_rgb(bytes, None, &limits).map_err(|e| e.to_string())?;
        std::hint::black_box(image);
        Ok(())
    })
}

/// `TrainTransform::apply_u8` or `apply_f32`.
type Apply<T> = fn(&TrainTransform, &[u8], &mut SplitMix64, &mut [T]) -> Result<(), TransformError>;

/// `transform` into the next slot of a batch buffer allocated here, once.
fn train_step<T: Copy + Default + 'static>(
    transform: TrainTransform,
    worker: usize,
    apply: Apply<T>,
) -> ImageStep {
    let slot = transform.output.slot_len(transform.size);
    let mut batch = vec![T::default(); BATCH * slot];
    let mut rng = SplitMix64::new(SEED ^ worker as u64);
    let mut next = 0;
    Box::new(move |bytes| {
        let out = &mut batch[next * slot..(next + 1) * slot];
        apply(&transform, bytes, &mut rng, out).map_err(|e| e.to_string())?;
        next = (next + 1) % BATCH;
        if next == 0 {
            std::hint::black_box(&mut batch);
        }
        Ok(())
    })
}

/// One row: `workers` threads, thread `w` over shards `w, w + workers, ...`. Each thread
/// makes its step, runs it on its first `warmup` images, and waits for the others; the
/// timed part is one pass of every thread over all of its shards.
fn measure(
    urls: &[String],
    workers: usize,
    warmup: u64,
    make_step: &(dyn Fn(usize) -> ImageStep + Sync),
) -> Result<Measured, String> {
    let barrier = Barrier::new(workers + 1);
    std::thread::scope(|scope| {
        let barrier = &barrier;
        let handles: Vec<_> = (0..workers)
            .map(|worker| {
                let mine: Vec<&str> = urls
                    .iter()
                    .skip(worker)
                    .step_by(workers)
                    .map(String::as_str)
                    .collect();
                scope.spawn(move || {
                    let reader = SampleReader::new(Sources::default());
                    let mut step = make_step(worker);
                    let warmed = match warmup {
                        0 => Ok(0),
                        n => feed_images(&reader, &mine, n, &mut step),
                    };
                    barrier.wait();
                    warmed?;
                    let cpu_at_start = thread_cpu_ns();
                    let images = feed_images(&reader, &mine, u64::MAX, &mut step)?;
                    let cpu = cpu_at_start
                        .zip(thread_cpu_ns())
                        .map(|(start, end)| end.saturating_sub(start));
                    Ok::<_, String>((images, cpu))
                })
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        let results: Vec<_> = handles.into_iter().map(|h| h.join()).collect();
        let seconds = start.elapsed().as_secs_f64();
        let mut measured = Measured {
            images: 0,
            seconds,
            cpu_seconds: Some(0.0),
        };
        for result in results {
            let (images, cpu_ns) = result.map_err(|_| "a worker thread panicked".to_string())??;
            measured.images += images;
            measured.cpu_seconds = measured
                .cpu_seconds
                .zip(cpu_ns)
                .map(|(sum, ns)| sum + ns as f64 / 1e9);
        }
        Ok(measured)
    })
}

/// Gives the `jpg` of each sample of `urls`, in order, to `step`; stops after `limit`.
fn feed_images(
    reader: &SampleReader,
    urls: &[&str],
    limit: u64,
    step: &mut ImageStep,
) -> Result<u64, String> {
    let mut images = 0;
    let mut failure = None;
    reader
        .read_all(urls, &mut |sample| {
            let result = match sample.field("jpg") {
                Some(bytes) => step(bytes),
                None => Err("no jpg field".into()),
            };
            match result {
                Ok(()) => images += 1,
                Err(error) => {
                    failure = Some(format!("{}: sample `{}`: {error}", sample.url, sample.key));
                    return ControlFlow::Break(());
                }
            }
            if images >= limit {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })
        .map_err(|e| e.to_string())?;
    failure.map_or(Ok(images), Err)
}

/// CPU time of the calling thread in nanoseconds, from Linux's schedstat.
fn thread_cpu_ns() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    text.split_whitespace().next()?.parse().ok()
}

/// The Python side, from `loader_bench.py`.
struct PythonRun {
    rows: Vec<Row>,
    versions: String,
    command: String,
}

fn python_rows(root: &Path, urls: &[String], workers: &[usize]) -> Result<PythonRun, String> {
    let python = common::tool_python(root, "tools/pybench.sh")?;
    let script = root.join("pipelines/benches/python/loader_bench.py");
    let workers: Vec<String> = workers.iter().map(usize::to_string).collect();
    let mut args = vec![
        "--workers".to_string(),
        workers.join(","),
        "--batch-size".to_string(),
        BATCH.to_string(),
    ];
    // The shards are every tar of their folder, and a glob lists them in order.
    let shards = urls.first().map_or_else(
        || PathBuf::from("SHARD..."),
        |url| Path::new(url).with_file_name("*.tar"),
    );
    let command = format!(
        "{python} {} {} {}",
        script.display(),
        args.join(" "),
        shards.display()
    );
    args.extend_from_slice(urls);
    let report = common::python_json(&python, &script, &args)?;
    let versions = report["versions"]
        .as_object()
        .map(|versions| {
            let text: Vec<String> = versions
                .iter()
                .map(|(name, version)| format!("{name} {}", version.as_str().unwrap_or("?")))
                .collect();
            text.join(", ")
        })
        .unwrap_or_default();
    let rows = report["rows"]
        .as_array()
        .ok_or("loader_bench.py printed no rows")?
        .iter()
        .map(|row| {
            let kind = match row["kind"].as_str() {
                Some("decode") => Kind::Decode,
                Some("train_f32") => Kind::TrainF32,
                other => return Err(format!("loader_bench.py: unknown row kind {other:?}")),
            };
            let measured = Measured {
                images: row["images"].as_u64().unwrap_or(0),
                seconds: row["seconds"].as_f64().unwrap_or(f64::NAN),
                cpu_seconds: row["cpu_seconds"].as_f64(),
            };
            Ok(Row {
                side: Side::Python,
                kind,
                workers: row["workers"].as_u64().unwrap_or(1) as usize,
                result: Ok(measured),
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(PythonRun {
        rows,
        versions,
        command,
    })
}
