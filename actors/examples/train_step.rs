//! The trainer's compute ceiling: forward, backward and SGD steps of one replica on a
//! fixed random batch, with no loader and no communication, the same code `imgrun train`
//! runs per step (models, loss, loss scaling, autocast on CUDA in the job's precision,
//! channels-last images and weights, cuDNN's benchmark mode, and `GradSync`'s on-device
//! average, here over a world of one whose sums are no-ops), through the library
//! functions the trainer calls. Compared with the images/s of a real `imgrun train` job of
//! the same model, size and batch, the gap is what the loader and the synchronisation
//! cost (`tools/gpu_check.sh`).
//!
//!     cargo run --release -p actors --example train_step -- \
//!         --device cuda --model resnet50 --size 224 --batch 128 --precision bf16 --steps 60
//!
//! `--precision fp32|amp|bf16` is `train.precision` (`--amp` is `--precision amp`);
//! `--channels-last` (the default, as `train.channels_last`) or `--no-channels-last`.
//! Prints one line of figures (after `--warmup` steps that are not timed), then, last, one
//! JSON object with `images_per_s`.

use std::time::Instant;

use actors::train::{
    DeviceCollective, GradSync, LossScaler, Model, ModelKind, Precision, Sgd, SgdConfig, SyncError,
    channels_last_weights, cross_entropy_smoothed, to_channels_last,
};
use anyhow::{Context, bail};
use runtime::{CollectiveOptions, RingGroup};
use tch::{Device, Kind, Tensor};

/// The collective of a world of one: every sum and broadcast leaves the tensor as it is.
#[derive(Debug)]
struct WorldOfOne;

impl DeviceCollective for WorldOfOne {
    fn all_reduce_sum(&self, _tensor: &Tensor) -> Result<(), SyncError> {
        Ok(())
    }

    fn broadcast(&self, _tensor: &Tensor, _root: usize) -> Result<(), SyncError> {
        Ok(())
    }
}

struct Args {
    device: Device,
    model: ModelKind,
    width: i64,
    size: i64,
    batch: i64,
    classes: i64,
    precision: Precision,
    channels_last: bool,
    steps: u32,
    warmup: u32,
}

fn parse() -> anyhow::Result<Args> {
    let mut args = Args {
        device: Device::Cpu,
        model: ModelKind::SmallCnn,
        width: 16,
        size: 48,
        batch: 64,
        classes: 1000,
        precision: Precision::Fp32,
        channels_last: true,
        steps: 30,
        warmup: 5,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        // Switches, which take no value.
        match flag.as_str() {
            "--amp" => {
                args.precision = Precision::Amp;
                continue;
            }
            "--channels-last" => {
                args.channels_last = true;
                continue;
            }
            "--no-channels-last" => {
                args.channels_last = false;
                continue;
            }
            _ => {}
        }
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        let number = || {
            value
                .parse::<i64>()
                .with_context(|| format!("{flag} {value}"))
        };
        match flag.as_str() {
            "--device" => {
                args.device = match value.as_str() {
                    "cpu" => Device::Cpu,
                    "cuda" => Device::Cuda(0),
                    other => bail!("--device {other}: expected cpu or cuda"),
                }
            }
            "--model" => args.model = value.parse().map_err(|e| anyhow::anyhow!("{e}"))?,
            "--width" => args.width = number()?,
            "--size" => args.size = number()?,
            "--batch" => args.batch = number()?,
            "--classes" => args.classes = number()?,
            "--precision" => {
                args.precision = value
                    .parse()
                    .map_err(|e| anyhow::anyhow!("--precision {e}"))?;
            }
            "--steps" => args.steps = u32::try_from(number()?)?,
            "--warmup" => args.warmup = u32::try_from(number()?)?,
            other => bail!(
                "unknown flag {other} (--device, --model, --width, --size, --batch, --classes, \
                 --precision, --amp, --channels-last, --no-channels-last, --steps, --warmup)"
            ),
        }
    }
    if args.device != Device::Cpu && !tch::Cuda::is_available() {
        bail!("--device cuda: libtorch sees no CUDA device");
    }
    Ok(args)
}

fn main() -> anyhow::Result<()> {
    let args = parse()?;
    if args.device != Device::Cpu {
        tch::Cuda::cudnn_set_benchmark(true);
    }
    tch::manual_seed(0);
    let model = Model::new(args.model, args.classes, args.width, args.device)?;
    if channels_last_weights(args.channels_last, args.device) {
        model.use_channels_last_weights()?;
    }
    let mut sgd = Sgd::new(
        model.parameters(),
        SgdConfig {
            momentum: 0.9,
            nesterov: false,
            weight_decay: 5e-5,
        },
    );
    let autocast = args.precision.autocast_kind(args.device);
    let mut scaler = LossScaler::for_job(actors::train::LossScaling::Auto, 65536.0, autocast);
    let images = Tensor::randn(
        [args.batch, 3, args.size, args.size],
        (Kind::Float, args.device),
    );
    // As the trainer hands batches over: channels-last, or contiguous NCHW.
    let images = if args.channels_last {
        to_channels_last(&images)?
    } else {
        images
    };
    let labels = Tensor::randint(args.classes, [args.batch], (Kind::Int64, args.device));
    let params: Vec<Tensor> = model.parameters().into_iter().map(|(_, t)| t).collect();
    let ring = RingGroup::in_memory(1, CollectiveOptions::default())
        .pop()
        .context("a ring of one")?;
    let mut grads = GradSync::start(move || async move { Ok(ring) }, &params, 25_000_000)?;
    grads.use_device_collective(Box::new(WorldOfOne));
    let mut started = Instant::now();
    let mut skipped = 0;
    for step in 0..args.warmup + args.steps {
        if step == args.warmup {
            sync(args.device);
            started = Instant::now();
        }
        sgd.zero_grad();
        let logits = args
            .precision
            .autocast(args.device, || model.forward_t(&images, true))?;
        let loss = cross_entropy_smoothed(&logits.to_kind(Kind::Float), &labels, 0.1);
        (&loss * scaler.scale()).backward();
        let stats = grads.average(
            &params,
            args.batch as f32,
            &mut [],
            (1.0 / scaler.scale()) as f32,
        )?;
        match scaler.update(stats.finite) {
            actors::train::StepVerdict::Apply => sgd.step(0.01),
            _ => skipped += 1,
        }
    }
    sync(args.device);
    let seconds = started.elapsed().as_secs_f64();
    let images_per_s = f64::from(args.steps) * args.batch as f64 / seconds;
    println!(
        "{} {}px batch {} on {:?} {}{}: {:.1} images/s, {:.1} ms/step over {} steps ({} \
         skipped)",
        args.model.name(),
        args.size,
        args.batch,
        args.device,
        args.precision,
        if args.channels_last {
            " channels-last"
        } else {
            ""
        },
        images_per_s,
        seconds * 1e3 / f64::from(args.steps),
        args.steps,
        skipped
    );
    println!(
        "{}",
        serde_json::json!({
            "model": args.model.name(), "size": args.size, "batch": args.batch,
            "device": format!("{:?}", args.device),
            "amp": autocast == Some(Kind::Half),
            "precision": args.precision.name(), "channels_last": args.channels_last,
            "images_per_s": images_per_s, "steps": args.steps, "skipped": skipped,
        })
    );
    Ok(())
}

fn sync(device: Device) {
    if let Device::Cuda(index) = device {
        tch::Cuda::synchronize(index as i64);
    }
}
