//! The configuration turned into the job every trainer gets, checked before anything
//! starts.

use std::path::PathBuf;

use actors::job::{Elastic, JobRequest, JobSettings};
use actors::train::{
    DataSpec, JobSpec, ModelSpec, OptimSpec, ScheduleSpec, SgdConfig, ShardSet, SourceSpec,
};
use anyhow::{Context, bail};
use pipelines::{HookSources, Manifest, ShardList};

use crate::config::{Config, Schedule};

/// The configuration turned into what every trainer gets.
/// `resuming`: the job continues from a checkpoint, whose weights replace `model.init`'s.
pub(crate) fn job_spec(config: &Config, resuming: bool) -> anyhow::Result<JobSpec> {
    let model = &config.model;
    let train = &config.train;
    let (data, manifest) = data_spec(config)?;
    let kind = model.name;
    let classes = match config.data.classes {
        0 => manifest
            .map(|m| m.classes.len() as i64)
            .filter(|&c| c > 0)
            .context(
                "data.classes is 0 and the training shards have no manifest naming the \
                 classes: set data.classes, or index the shards with `imgrun shards index \
                 SPEC -o manifest.json` and set data.manifest",
            )?,
        n => n,
    };
    let schedule = match train.schedule {
        Schedule::Cosine => ScheduleSpec::Cosine {
            final_fraction: train.final_lr_fraction,
        },
        Schedule::Step => ScheduleSpec::Step {
            milestones: train.milestones.clone(),
            gamma: train.gamma,
        },
        Schedule::Constant => ScheduleSpec::Constant,
    };
    let (loss_scaling, allreduce) = (train.loss_scaling, train.allreduce);
    Ok(JobSpec {
        data,
        model: ModelSpec {
            kind,
            classes,
            width: model.width,
            seed: model.seed,
            init: if resuming {
                None
            } else {
                init_weights(config, classes)?
            },
        },
        optim: OptimSpec {
            epochs: train.epochs,
            batch_size: train.batch_size,
            // Scaled once the world size is known.
            lr: train.lr,
            sgd: SgdConfig {
                momentum: train.momentum,
                nesterov: train.nesterov,
                weight_decay: train.weight_decay,
            },
            label_smoothing: train.label_smoothing,
            warmup_epochs: train.warmup_epochs,
            warmup_start_fraction: train.warmup_start_fraction,
            schedule,
            bucket_bytes: (train.bucket_mb.max(0.001) * 1e6) as usize,
            overlap: train.overlap,
            precision: train.precision,
            channels_last: train.channels_last,
            loss_scaling,
            loss_scale_init: train.loss_scale_init,
            allreduce,
            sync: train.sync,
            topology: train.topology,
            elastic: train.elastic,
        },
    })
}

/// `model.init` as an absolute path, once a model of the job's kind and class count has
/// been loaded from it here (so a file that does not fit fails before anything starts);
/// says what loading it does.
fn init_weights(config: &Config, classes: i64) -> anyhow::Result<Option<PathBuf>> {
    let model = &config.model;
    if model.init.is_empty() {
        return Ok(None);
    }
    let path =
        std::path::absolute(&model.init).with_context(|| format!("model.init: {}", model.init))?;
    let outcome = actors::train::weights::check_init(model.name, classes, model.width, &path)
        .context("model.init")?;
    println!("{}", outcome.describe(&path));
    Ok(Some(path))
}

/// The `[data]` (and `[shards]`) part of the job: what `imgrun plan` plans with, exactly
/// as the trainers will; and the training shards' manifest, when there is one.
pub(crate) fn data_spec(config: &Config) -> anyhow::Result<(DataSpec, Option<Manifest>)> {
    let data = &config.data;
    anyhow::ensure!(
        !data.train.is_empty(),
        "data.train is empty: name the training shards (e.g. --set data.train='\"/data/train-{{000000..000146}}.tar\"')"
    );
    anyhow::ensure!(
        config.train.batch_size > 0,
        "train.batch_size must be at least 1"
    );
    // Manifests are read fresh every time, never from the shard cache.
    let sources = pipelines::Sources::new(pipelines::SourceOptions {
        cache: None,
        ..config.source_options()
    });
    let manifest = (!data.manifest.is_empty()).then_some(data.manifest.as_str());
    let (train_set, manifest) =
        shard_set(&data.train, &data.base, manifest, &sources).context("data.train")?;
    let val_set = if data.val.is_empty() {
        ShardSet::default()
    } else {
        shard_set(&data.val, &data.base, None, &sources)
            .context("data.val")?
            .0
    };
    let hooks_dir = (!data.hooks.is_empty()).then(|| PathBuf::from(&data.hooks));
    let hooks = HookSources::read(hooks_dir.as_deref()).context("data.hooks")?;
    let policy = pipelines::BatchPolicy::parse(
        &data.policy,
        (data.nbatches > 0).then_some(data.nbatches),
        (data.dsrepeat > 0).then_some(data.dsrepeat),
    )
    .map_err(|e| anyhow::anyhow!("data.policy: {e}"))?;
    let mode = data.mode;
    let pairs: Vec<(u64, u32)> = data
        .size_schedule
        .iter()
        .map(|phase| (phase.epoch(), phase.size()))
        .collect();
    let sizes = size_schedule(data.image_size, &pairs)?;
    let mut size_phase_train = Vec::new();
    for phase in &data.size_schedule {
        let Some(spec) = phase.train() else { continue };
        let what = || format!("data.size_schedule: the phase from epoch {}", phase.epoch());
        let (set, _) = shard_set(spec, &data.base, None, &sources).with_context(what)?;
        if let (Some(phase_total), Some(total)) = (set.total(), train_set.total()) {
            anyhow::ensure!(
                phase_total == total,
                "{}: its shards hold {phase_total} samples and data.train's {total}; a \
                 phase's shards must be a copy of the training set (e.g. made with `imgrun \
                 shards create --resize`)",
                what()
            );
        }
        size_phase_train.push((phase.epoch(), set));
    }
    let (lo, hi) = data.crop_scale;
    anyhow::ensure!(
        0.0 < lo && lo <= hi && hi <= 1.0,
        "data.crop_scale [{lo}, {hi}] must satisfy 0 < min <= max <= 1"
    );
    let shards = &config.shards;
    let spec = DataSpec {
        train: train_set,
        val: val_set,
        hooks,
        mode,
        policy,
        epoch_size: (data.epoch_size > 0).then_some(data.epoch_size),
        nominal_size: (data.nominal_size > 0).then_some(data.nominal_size),
        samples_per_shard: (data.samples_per_shard > 0).then_some(data.samples_per_shard),
        seed: data.seed,
        loader_workers: data.loader_workers.max(1),
        loaders: data.loaders,
        loader_actors: data.loader_actors,
        shuffle_buffer: data.shuffle_buffer,
        queue_batches: data.queue_batches.max(1),
        image_fields: data.image_fields.clone(),
        label_field: data.label_field.clone(),
        errors: shards.error_policy,
        sizes,
        size_phase_train,
        eval_size: data.eval_size,
        crop_scale: data.crop_scale,
        resize_ratio: data.resize_ratio,
        flip: data.flip,
        sources: SourceSpec {
            read_buffer: shards.read_buffer,
            http_timeout_secs: shards.http_timeout_secs,
            http_attempts: shards.http_attempts,
            http_retry_delay_ms: shards.http_retry_delay_ms,
            pipe_idle_timeout_secs: shards.pipe_idle_timeout_secs,
            cache_dir: (!shards.cache_dir.is_empty()).then(|| shards.cache_dir.clone()),
            cache_max_bytes: crate::units::parse_size(&shards.cache_max_size).unwrap_or(0),
            preload_dir: if data.preload {
                let dir = std::path::absolute(&data.preload_dir)
                    .with_context(|| format!("data.preload_dir: {}", data.preload_dir))?;
                Some(dir.display().to_string())
            } else {
                None
            },
            s3: config.s3.options(),
        },
    };
    Ok((spec, manifest))
}

/// The train crop side by epoch: `data.size_schedule`'s `[epoch, size]` entries, from
/// epoch 0 (where the schedule has no epoch-0 entry, `data.image_size` holds until its
/// first one).
fn size_schedule(image_size: u32, schedule: &[(u64, u32)]) -> anyhow::Result<Vec<(u64, u32)>> {
    let mut sizes = schedule.to_vec();
    sizes.sort_unstable_by_key(|(epoch, _)| *epoch);
    if let Some(pair) = sizes.windows(2).find(|w| w[0].0 == w[1].0) {
        bail!(
            "data.size_schedule names epoch {} twice ({} and {} px)",
            pair[0].0,
            pair[0].1,
            pair[1].1
        );
    }
    if let Some((epoch, size)) = sizes.iter().find(|(_, size)| *size == 0) {
        bail!("data.size_schedule: epoch {epoch} has size {size}; sizes must be positive");
    }
    if sizes.first().is_none_or(|(epoch, _)| *epoch > 0) {
        anyhow::ensure!(image_size > 0, "data.image_size must be positive");
        sizes.insert(0, (0, image_size));
    }
    Ok(sizes)
}

/// The shards of `spec` under `base` (the rule of [`ShardList::from_spec_with_base`]),
/// with their sample counts from `manifest` (a file or URL, `data.manifest`, which must
/// list every shard) or else from the manifest.json beside them, and that manifest.
/// Manifest entries are matched to shards by file name ([`pipelines::shard_name`]).
pub(crate) fn shard_set(
    spec: &str,
    base: &str,
    manifest: Option<&str>,
    sources: &pipelines::Sources,
) -> anyhow::Result<(ShardSet, Option<Manifest>)> {
    let urls = ShardList::from_spec_with_base(spec, base)
        .with_context(|| format!("shard spec `{spec}`"))?
        .urls;
    let urls = sources
        .expand_patterns(urls)
        .with_context(|| format!("shard spec `{spec}`"))?;
    anyhow::ensure!(!urls.is_empty(), "shard spec `{spec}` names no shards");
    let missing: Vec<&String> = urls
        .iter()
        .filter(|u| pipelines::local_path(u).is_some_and(|path| !path.is_file()))
        .collect();
    if let Some(first) = missing.first() {
        bail!(
            "no such shard: {first} ({} of the {} shards of `{spec}` are missing)",
            missing.len(),
            urls.len()
        );
    }
    let manifest = match manifest {
        Some(location) => Some(named_manifest(location, &urls, sources)?),
        None => manifest_beside(&urls, sources),
    };
    let samples = match &manifest {
        Some(manifest) => pipelines::PlanShard::with_manifest(&urls, manifest)
            .into_iter()
            .map(|s| s.samples)
            .collect(),
        None => vec![None; urls.len()],
    };
    Ok((ShardSet { urls, samples }, manifest))
}

/// The manifest at `location` (`data.manifest`), which must list every shard of `urls`.
fn named_manifest(
    location: &str,
    urls: &[String],
    sources: &pipelines::Sources,
) -> anyhow::Result<Manifest> {
    let manifest = Manifest::open(location, sources)
        .with_context(|| format!("reading data.manifest `{location}`"))?;
    let listed: std::collections::HashSet<&str> =
        manifest.shards.iter().map(|s| s.name.as_str()).collect();
    let unlisted: Vec<&String> = urls
        .iter()
        .filter(|url| !listed.contains(pipelines::shard_name(url)))
        .collect();
    if let Some(first) = unlisted.first() {
        bail!(
            "data.manifest `{location}` lists no shard named `{}` (for {first}); {} of the {} \
             shards are not in it: index them with `imgrun shards index SPEC -o FILE`",
            pipelines::shard_name(first),
            unlisted.len(),
            urls.len()
        );
    }
    Ok(manifest)
}

/// The manifest.json beside the first shard: in its folder for local files, at the same
/// URL path for `http(s)://` shards (as `imgrun serve` and any static file server give
/// it) and under the same prefix for `s3://` ones; none for `pipe:` commands.
pub(super) fn manifest_beside(urls: &[String], sources: &pipelines::Sources) -> Option<Manifest> {
    let first = urls.first()?;
    if ["http://", "https://"]
        .iter()
        .any(|scheme| first.starts_with(scheme))
        || pipelines::is_object_url(first)
    {
        let (folder, _) = first.rsplit_once('/')?;
        let url = format!("{folder}/{}", pipelines::MANIFEST_FILE);
        let read = sources
            .open(&url)
            .map_err(|e| e.to_string())
            .and_then(|stream| serde_json::from_reader(stream).map_err(|e| e.to_string()));
        return match read {
            Ok(manifest) => Some(manifest),
            Err(error) => {
                tracing::info!(%url, %error, "no manifest beside the shards");
                None
            }
        };
    }
    Manifest::read_from(pipelines::local_folder(first)?).ok()
}

/// What `imgrun train` submits: the trainers' job and how to run it, from the
/// configuration.
pub(crate) fn job_request(config: &Config, resume: Option<PathBuf>) -> anyhow::Result<JobRequest> {
    let train = &config.train;
    Ok(JobRequest {
        spec: job_spec(config, resume.is_some())?,
        settings: JobSettings {
            gpus: train.gpus,
            cpu_trainers: train.cpu_trainers,
            threads: train.threads,
            lr: train.lr,
            reference_batch: train.reference_batch,
            step_timeout_secs: train.step_timeout_secs,
            eval_every_epochs: train.eval_every_epochs,
            eval_every_steps: train.eval_every_steps,
            checkpoint_every_epochs: train.checkpoint_every_epochs,
            checkpoint_every_steps: train.checkpoint_every_steps,
            keep_checkpoints: train.keep_checkpoints,
            keep_best: train.keep_best,
            checkpoint_store: (!train.checkpoint_store.is_empty())
                .then(|| train.checkpoint_store.clone()),
            straggler_secs: train.straggler_secs,
            sample_log: train.sample_log,
            tensorboard_ranks: train.tensorboard_ranks,
            runs_dir: PathBuf::from(&train.runs_dir),
            name: train.name.clone(),
            dead_after_ms: config.cluster.dead_after_ms,
            elastic: train.elastic.then_some(Elastic {
                min_world: train.min_world,
                max_failures: train.max_failures,
            }),
        },
        resume,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Serves `body` at every path once per connection, `connections` times.
    fn serve(body: String, connections: usize) -> String {
        use std::io::{BufRead, BufReader, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = listener.local_addr().expect("address");
        std::thread::spawn(move || {
            for stream in listener.incoming().take(connections) {
                let Ok(mut stream) = stream else { continue };
                let mut reader = BufReader::new(stream.try_clone().expect("clone"));
                let mut line = String::new();
                let mut path = String::new();
                while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
                    if path.is_empty() {
                        path = line.split(' ').nth(1).unwrap_or_default().to_string();
                    }
                    line.clear();
                }
                let (status, body) = if path.ends_with(pipelines::MANIFEST_FILE) && !body.is_empty()
                {
                    ("200 OK", body.as_str())
                } else {
                    ("404 Not Found", "")
                };
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        format!("http://{address}")
    }

    #[test]
    fn the_size_schedule_holds_from_epoch_0() {
        type Sizes = &'static [(u64, u32)];
        let cases: [(u32, Sizes, Result<Sizes, &str>); 6] = [
            (224, &[], Ok(&[(0, 224)])),
            (224, &[(0, 128), (30, 224)], Ok(&[(0, 128), (30, 224)])),
            (224, &[(30, 224), (0, 128)], Ok(&[(0, 128), (30, 224)])),
            (160, &[(5, 224)], Ok(&[(0, 160), (5, 224)])),
            (224, &[(0, 128), (0, 160)], Err("epoch 0 twice")),
            (224, &[(3, 0)], Err("sizes must be positive")),
        ];
        for (image_size, schedule, want) in cases {
            let got = size_schedule(image_size, schedule).map_err(|e| e.to_string());
            match (got, want) {
                (Ok(got), Ok(want)) => assert_eq!(got, want, "{schedule:?}"),
                (Err(got), Err(want)) => assert!(got.contains(want), "{got} lacks {want}"),
                (got, want) => panic!("{schedule:?}: got {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn counts_and_classes_come_from_a_manifest_served_beside_http_shards() {
        let manifest = serde_json::json!({
            "version": 1,
            "classes": ["cat", "dog"],
            "shards": [
                {"name": "d-000.tar", "samples": 7, "bytes": 100, "class_counts": {"0": 3, "1": 4}},
                {"name": "d-001.tar", "samples": 5, "bytes": 100, "class_counts": {"0": 2, "1": 3}}
            ]
        });
        let base = serve(manifest.to_string(), 4);
        let sources = pipelines::Sources::new(pipelines::SourceOptions::default());
        let spec = format!("{base}/data/d-{{000..001}}.tar");
        let (set, found) = shard_set(&spec, "", None, &sources).expect("shard set");
        assert_eq!(set.samples, [Some(7), Some(5)]);
        assert_eq!(found.map(|m| m.classes.len()), Some(2));
        // A server without one: counts unknown, no error.
        let bare = serve(String::new(), 4);
        let (set, found) =
            shard_set(&format!("{bare}/d-000.tar"), "", None, &sources).expect("shard set");
        assert_eq!(set.samples, [None]);
        assert!(found.is_none());
    }
}
