//! imgrun's configuration: built-in defaults (the repository's `cluster.toml`, embedded)
//! ← a `cluster.toml` file ← `IMGRUN_*` environment variables ← command-line flags.

use std::path::{Path, PathBuf};
use std::time::Duration;

use actors::train::{AllreduceChoice, Loaders, LossScaling, ModelKind, Precision, SyncChoice};
use anyhow::Context;
use figment::Figment;
use figment::providers::{Env, Format, Toml};
use pipelines::{ErrorPolicy, PlanMode};
use serde::{Deserialize, Deserializer};

/// The defaults, kept in one place: the `cluster.toml` at the root of the repository.
pub const DEFAULTS: &str = include_str!("../cluster.toml");

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub shards: ShardsConfig,
    pub s3: S3Config,
    pub serve: ServeConfig,
    pub cluster: ClusterConfig,
    pub launch: LaunchConfig,
    pub data: DataConfig,
    pub model: ModelConfig,
    pub train: TrainConfig,
}

/// `[data]`: what `imgrun train` reads and how.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    pub train: String,
    pub val: String,
    pub base: String,
    /// A manifest file or URL with the shards' counts and classes; empty: the one
    /// beside the shards.
    pub manifest: String,
    pub hooks: String,
    #[serde(deserialize_with = "choice")]
    pub mode: PlanMode,
    pub policy: String,
    pub nbatches: u64,
    pub dsrepeat: u64,
    pub epoch_size: u64,
    pub nominal_size: u64,
    /// Samples assumed in each shard no manifest counts (0: none).
    pub samples_per_shard: u64,
    /// Copy the shards each node reads into `preload_dir` before training, and read the
    /// copies.
    pub preload: bool,
    /// A node-local folder (the same path on every node).
    pub preload_dir: String,
    pub classes: i64,
    pub seed: u64,
    /// Loader workers per trainer (a reader and a decoder thread each).
    pub loader_workers: u32,
    /// Where they run: threads in the trainer's process, or loader actors on any node.
    #[serde(deserialize_with = "choice")]
    pub loaders: Loaders,
    /// Loader actors of a job with remote loaders (0: one per trainer).
    pub loader_actors: u32,
    pub shuffle_buffer: usize,
    pub queue_batches: usize,
    pub image_fields: Vec<String>,
    pub label_field: String,
    pub image_size: u32,
    pub size_schedule: Vec<SizePhase>,
    pub eval_size: u32,
    pub crop_scale: (f32, f32),
    pub resize_ratio: f32,
    pub flip: bool,
}

/// One entry of `data.size_schedule`: `[epoch, size]`, or a table that may also name the
/// phase's own training shards, read from that epoch on instead of `data.train`:
/// `{ epoch = 0, size = 128, train = "small/train-{000000..000146}.tar" }`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum SizePhase {
    Pair(u64, u32),
    Table(SizePhaseTable),
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SizePhaseTable {
    pub epoch: u64,
    pub size: u32,
    /// Shard spec; empty: `data.train`.
    #[serde(default)]
    pub train: String,
}

impl SizePhase {
    pub fn epoch(&self) -> u64 {
        match self {
            SizePhase::Pair(epoch, _) => *epoch,
            SizePhase::Table(table) => table.epoch,
        }
    }

    pub fn size(&self) -> u32 {
        match self {
            SizePhase::Pair(_, size) => *size,
            SizePhase::Table(table) => table.size,
        }
    }

    /// The phase's own training shards, if it names any.
    pub fn train(&self) -> Option<&str> {
        match self {
            SizePhase::Table(table) if !table.train.is_empty() => Some(&table.train),
            _ => None,
        }
    }
}

/// `[model]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    #[serde(deserialize_with = "choice")]
    pub name: ModelKind,
    pub width: i64,
    pub seed: u64,
    /// A state dict to start from (safetensors or `torch.save`), empty for none.
    pub init: String,
}

/// A choice of a fixed set, read through its type's `FromStr` when the configuration is
/// loaded: a wrong value is refused there with the valid ones, naming the key and where
/// it was set.
fn choice<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: std::str::FromStr,
    T::Err: std::fmt::Display,
{
    let text = String::deserialize(deserializer)?;
    text.parse().map_err(serde::de::Error::custom)
}

/// `train.schedule`: the learning rate's decay after warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    Cosine,
    Step,
    Constant,
}

impl std::str::FromStr for Schedule {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cosine" => Ok(Self::Cosine),
            "step" => Ok(Self::Step),
            "constant" => Ok(Self::Constant),
            other => Err(format!("`{other}`: expected cosine, step or constant")),
        }
    }
}

/// `[train]`: optimisation, evaluation, checkpoints and the world.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    pub epochs: u64,
    pub batch_size: u64,
    pub lr: f64,
    pub reference_batch: u64,
    pub momentum: f64,
    pub nesterov: bool,
    pub weight_decay: f64,
    pub label_smoothing: f64,
    pub warmup_epochs: f64,
    pub warmup_start_fraction: f64,
    #[serde(deserialize_with = "choice")]
    pub schedule: Schedule,
    pub final_lr_fraction: f64,
    pub milestones: Vec<u64>,
    pub gamma: f64,
    /// `fp32`, `amp` (float16 autocast on CUDA) or `bf16` (bfloat16 autocast on CUDA).
    #[serde(deserialize_with = "choice")]
    pub precision: Precision,
    /// Channels-last images (and, on CUDA, convolution weights).
    pub channels_last: bool,
    #[serde(deserialize_with = "choice")]
    pub loss_scaling: LossScaling,
    pub loss_scale_init: f64,
    #[serde(deserialize_with = "choice")]
    pub allreduce: AllreduceChoice,
    #[serde(deserialize_with = "choice")]
    pub sync: SyncChoice,
    #[serde(deserialize_with = "choice")]
    pub topology: runtime::Topology,
    pub bucket_mb: f64,
    pub overlap: bool,
    pub eval_every_epochs: u64,
    pub eval_every_steps: u64,
    pub checkpoint_every_epochs: u64,
    pub checkpoint_every_steps: u64,
    /// The newest checkpoints a run keeps (0: every one).
    pub keep_checkpoints: u32,
    /// Also keep the checkpoint of the best validation top-1.
    pub keep_best: bool,
    /// Where rank 0 copies each checkpoint (`s3://bucket/prefix`; empty: nowhere).
    pub checkpoint_store: String,
    pub runs_dir: String,
    pub name: String,
    pub gpus: u32,
    /// CPU trainers when the cluster has no GPU (0: one per node).
    pub cpu_trainers: u32,
    pub threads: u32,
    pub step_timeout_secs: u64,
    pub straggler_secs: f64,
    /// Samples of every step into metrics.jsonl.
    pub sample_log: bool,
    /// Each rank's own step figures into metrics.jsonl and TensorBoard's `tb/rank-N/`.
    pub tensorboard_ranks: bool,
    /// Go on without a lost trainer (`min_world`, `max_failures`).
    pub elastic: bool,
    pub min_world: u32,
    pub max_failures: u32,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardsConfig {
    pub read_buffer: usize,
    #[serde(deserialize_with = "choice")]
    pub error_policy: ErrorPolicy,
    pub max_member: u64,
    pub http_timeout_secs: u64,
    pub http_attempts: u32,
    pub http_retry_delay_ms: u64,
    /// Seconds a `pipe:` command may send nothing; 0 for no limit.
    pub pipe_idle_timeout_secs: u64,
    /// Local cache folder for remote shards; empty for none.
    pub cache_dir: String,
    /// Most the cache keeps, as a size (`100GB`).
    pub cache_max_size: String,
}

/// `[s3]`: how `s3://` URLs are reached (AWS S3 or a store that speaks its API) and
/// read. Credentials are never configuration: each process finds its own, as the AWS
/// tools do.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct S3Config {
    /// The store's URL; empty: the environment's or the profile's, else AWS.
    pub endpoint: String,
    /// Empty: the environment's or the profile's, else `us-east-1`.
    pub region: String,
    /// The AWS profile; empty: `AWS_PROFILE`, else `default`.
    pub profile: String,
    /// Unsigned requests, for public buckets.
    pub anonymous: bool,
    /// Bytes of one ranged GET, as a size (`8MiB`).
    pub chunk_size: String,
    /// Ranged GETs of one shard requested ahead of its reader.
    pub chunks_in_flight: usize,
    /// Most ranged GETs in flight in one process.
    pub max_requests: usize,
    /// One request, its body included, must end within this many seconds; one that
    /// stalls is resumed at its byte offset.
    pub request_timeout_secs: u64,
    /// Tries of one request, resumes of its body included.
    pub attempts: u32,
}

impl S3Config {
    pub fn options(&self) -> pipelines::S3Options {
        let text = |value: &str| (!value.is_empty()).then(|| value.to_string());
        pipelines::S3Options {
            endpoint: text(&self.endpoint),
            region: text(&self.region),
            profile: text(&self.profile),
            anonymous: self.anonymous,
            // Invariant: `validate` checked the size when the config was loaded.
            chunk_bytes: crate::units::parse_size(&self.chunk_size).unwrap_or(8 << 20),
            chunks_in_flight: self.chunks_in_flight,
            max_requests: self.max_requests,
            request_timeout: Duration::from_secs(self.request_timeout_secs),
            attempts: self.attempts,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeConfig {
    pub port: u16,
    pub max_in_flight: usize,
    /// Most of those one client (peer address) may hold at once.
    pub max_per_client: usize,
    pub header_timeout_secs: u64,
    pub send_timeout_secs: u64,
    pub follow_links: bool,
}

/// `[launch]`: `imgrun train` started by torchrun, Slurm or a Kubernetes job on every
/// node, pod or rank.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LaunchConfig {
    #[serde(deserialize_with = "choice")]
    pub launcher: Launcher,
    /// Where process 0 leaves the join line for the others (empty: `<runs_dir>/.rendezvous`).
    pub rendezvous_dir: String,
    /// The head's UDP port where the launcher names none: Slurm (0: 29400 + the job id
    /// modulo 500), an `IMGRUN_HEAD` without a port (0: 29400).
    pub port: u16,
    /// How long the processes wait for each other, and for the head's name to resolve.
    pub timeout_secs: u64,
    /// The GPUs each process offers: -1 those it finds; N exactly N, claimed where
    /// missing (as `imgrun join --num-gpus`).
    pub num_gpus: i64,
}

/// `launch.launcher`: which launcher's environment `imgrun train` reads.
pub use runtime::launch::Launcher;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    pub port: u16,
    pub bind: String,
    pub node_port: u16,
    /// `ip` or `ip:port` others use to reach this daemon; empty for automatic.
    pub advertise: String,
    pub heartbeat_ms: u64,
    pub dead_after_ms: u64,
    /// The head's UDP heartbeat port; 0 for any free port.
    pub beat_port: u16,
    /// Empty for the per-user default.
    pub state_dir: String,
    pub start_timeout_secs: u64,
    /// The address the head's dashboard binds: loopback (plain HTTP), or any other
    /// (HTTPS only, with a certificate of the cluster CA).
    pub dashboard_bind: String,
    /// TCP port of the head's dashboard; 0 for any free port.
    pub dashboard_port: u16,
    /// Host names the dashboard answers to besides the loopback ones.
    pub dashboard_hosts: Vec<String>,
}

/// Where the configuration came from, for `imgrun doctor` and the line every command
/// prints about the file it read.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub config: Config,
    pub file: Option<PathBuf>,
    /// The job sections the file sets that a job preset replaced (see [`JobPreset`]).
    pub ignored_sections: Vec<&'static str>,
    /// `IMGRUN_*` variables of the job sections that a job preset replaced.
    pub ignored_variables: Vec<String>,
}

/// The sections that describe a training job rather than the machines and shards.
pub const JOB_SECTIONS: [&str; 3] = ["data", "model", "train"];

/// A job that a command brings with it (the demo's): its `[data]`, `[model]` and `[train]`
/// are the built-in defaults with the preset over them, then `--set` overrides. Job keys
/// of the configuration file and of `IMGRUN_*` variables do not apply, so a `cluster.toml`
/// in the working folder (the checkout's own, or a user's ImageNet job) never turns the
/// demo into another job; its `[cluster]`, `[shards]` and `[serve]` still apply.
#[derive(Debug, Clone, Copy)]
pub struct JobPreset<'a> {
    /// How errors name it, e.g. `the demo's job (examples/demo.toml)`.
    pub name: &'static str,
    pub text: &'a str,
}

/// Loads the configuration. `explicit` is `--config`; without it a `cluster.toml` in the
/// working folder is used when present.
pub fn load(explicit: Option<&Path>) -> anyhow::Result<Loaded> {
    load_with(explicit, None, &[])
}

/// [`load`] with a job `preset` (see [`JobPreset`]) and `overrides` (`section.key=value`,
/// the value in TOML syntax, or a bare word taken as a string) over everything else.
pub fn load_with(
    explicit: Option<&Path>,
    preset: Option<JobPreset<'_>>,
    overrides: &[String],
) -> anyhow::Result<Loaded> {
    let file = match explicit {
        Some(path) => {
            anyhow::ensure!(
                path.is_file(),
                "config file {} does not exist",
                path.display()
            );
            Some(path.to_path_buf())
        }
        None => Some(PathBuf::from("cluster.toml")).filter(|p| p.is_file()),
    };
    let mut figment = Figment::from(Named::new(Toml::string(DEFAULTS), "the built-in defaults"));
    if let Some(path) = &file {
        figment = figment.merge(Toml::file_exact(path));
    }
    if let Some(layer) = gopen_buffer(std::env::var_os("GOPEN_BUFFER").as_deref())? {
        figment = figment.merge(layer);
    }
    figment = figment.merge(
        // Only `IMGRUN_SECTION__KEY` variables are configuration; others such as
        // `IMGRUN_LOG` or `IMGRUN_CACHE` are read elsewhere.
        Env::prefixed("IMGRUN_")
            .filter(|key| key.as_str().contains("__"))
            .split("__"),
    );
    let mut ignored_sections = Vec::new();
    let mut ignored_variables = Vec::new();
    if let Some(preset) = preset {
        let job = preset_job(preset)?;
        if let Some(path) = &file {
            ignored_sections = job_sections_in(path);
        }
        ignored_variables = job_variables();
        figment = figment.merge(Named::new(Toml::string(&job), preset.name));
    }
    for item in overrides {
        figment = figment.merge(Named::new(
            Toml::string(&override_toml(item)?),
            format!("`--set {item}`"),
        ));
    }
    let config: Config = figment
        .extract()
        .map_err(|e| anyhow::anyhow!(describe(e)))?;
    validate(&config).map_err(|e| {
        let origin = figment
            .find_metadata(e.key)
            .map_or_else(|| "the configuration".to_string(), |m| origin(m, e.key));
        anyhow::anyhow!(
            "bad configuration key `{}` in {origin}: {}",
            e.key,
            e.message
        )
    })?;
    Ok(Loaded {
        config,
        file,
        ignored_sections,
        ignored_variables,
    })
}

impl Loaded {
    /// The line a command prints about the configuration it read, or `None` when it read
    /// no file and no job key was set aside.
    pub fn describe_sources(&self) -> Option<String> {
        let file = self.file.as_ref().map(|path| {
            let shown = std::fs::canonicalize(path).unwrap_or_else(|_| path.clone());
            format!("configuration from {}", shown.display())
        });
        let mut ignored: Vec<String> = self
            .ignored_sections
            .iter()
            .map(|s| format!("[{s}]"))
            .collect();
        ignored.extend(self.ignored_variables.iter().cloned());
        match (file, ignored.is_empty()) {
            (None, true) => None,
            (Some(file), true) => Some(file),
            (file, false) => Some(format!(
                "{}{} not used: this command brings its own job (change it with --set)",
                file.map(|f| format!("{f}; its ")).unwrap_or_default(),
                ignored.join(", ")
            )),
        }
    }
}

/// A provider under a name of our choosing, so errors say where a value came from
/// (`--set train.epochs=x`) rather than figment's "TOML source string".
struct Named<P> {
    inner: P,
    name: String,
}

impl<P> Named<P> {
    fn new(inner: P, name: impl Into<String>) -> Self {
        Named {
            inner,
            name: name.into(),
        }
    }
}

impl<P: figment::Provider> figment::Provider for Named<P> {
    fn metadata(&self) -> figment::Metadata {
        figment::Metadata::named(self.name.clone())
    }

    fn data(
        &self,
    ) -> Result<figment::value::Map<figment::Profile, figment::value::Dict>, figment::Error> {
        self.inner.data()
    }
}

/// The job sections of the built-in defaults with `preset` over them, as TOML.
fn preset_job(preset: JobPreset<'_>) -> anyhow::Result<String> {
    // Invariant: DEFAULTS is the repository's cluster.toml, parsed by `defaults_parse`.
    let mut defaults: toml::Table = toml::from_str(DEFAULTS).context("the built-in defaults")?;
    let preset_table: toml::Table =
        toml::from_str(preset.text).with_context(|| preset.name.to_string())?;
    let mut job = toml::Table::new();
    for section in JOB_SECTIONS {
        let mut table = match defaults.remove(section) {
            Some(toml::Value::Table(table)) => table,
            _ => toml::Table::new(),
        };
        if let Some(toml::Value::Table(over)) = preset_table.get(section) {
            table.extend(over.clone());
        }
        job.insert(section.to_string(), toml::Value::Table(table));
    }
    toml::to_string(&job).context("writing the preset job")
}

/// The job sections that the file at `path` has, unless it is the built-in defaults
/// themselves (the checkout's own `cluster.toml`).
fn job_sections_in(path: &Path) -> Vec<&'static str> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    if text == DEFAULTS {
        return Vec::new();
    }
    let file = toml::from_str::<toml::Table>(&text).unwrap_or_default();
    JOB_SECTIONS
        .into_iter()
        .filter(|section| file.contains_key(*section))
        .collect()
}

/// The `IMGRUN_DATA__*`, `IMGRUN_MODEL__*` and `IMGRUN_TRAIN__*` variables set now.
fn job_variables() -> Vec<String> {
    let mut names: Vec<String> = std::env::vars_os()
        .filter_map(|(name, _)| name.into_string().ok())
        .filter(|name| {
            JOB_SECTIONS.iter().any(|section| {
                name.to_ascii_lowercase()
                    .starts_with(&format!("imgrun_{section}__"))
            })
        })
        .collect();
    names.sort();
    names
}

/// Where the value of `key` (`section.name`) came from, for an error: the file's whole
/// path, the exact environment variable, or the provider's own name.
fn origin(metadata: &figment::Metadata, key: &str) -> String {
    match &metadata.source {
        // The whole path: figment's own display shortens it relative to the working folder.
        Some(figment::Source::File(path)) => format!("{} ({})", metadata.name, path.display()),
        Some(source) => format!("{} ({source})", metadata.name),
        None if metadata.name.contains("environment") => format!(
            "the environment variable IMGRUN_{}",
            key.to_ascii_uppercase().replace('.', "__")
        ),
        None => metadata.name.to_string(),
    }
}

/// Python webdataset's `GOPEN_BUFFER` (the read buffer in bytes, `-1` for the default)
/// as `shards.read_buffer`: merged right before the `IMGRUN_*` variables, so that
/// `IMGRUN_SHARDS__READ_BUFFER` and `--set shards.read_buffer=...` win over it.
fn gopen_buffer(
    value: Option<&std::ffi::OsStr>,
) -> anyhow::Result<Option<figment::providers::Data<Toml>>> {
    let Some(value) = value else {
        return Ok(None);
    };
    let text = value.to_string_lossy();
    if text.trim() == "-1" {
        return Ok(None);
    }
    let bytes = crate::units::parse_size(&text)
        .ok()
        .filter(|&bytes| bytes > 0)
        .with_context(|| {
            format!(
                "environment variable GOPEN_BUFFER=`{text}` (the read buffer, \
                 shards.read_buffer): expected a positive number of bytes such as 1048576 \
                 or 4MiB, or -1 for the default"
            )
        })?;
    Ok(Some(Toml::string(&format!(
        "[shards]\nread_buffer = {bytes}\n"
    ))))
}

/// `section.key=value` as a TOML table, for figment.
fn override_toml(item: &str) -> anyhow::Result<String> {
    let (key, value) = item
        .split_once('=')
        .with_context(|| format!("override `{item}`: expected SECTION.KEY=VALUE"))?;
    let (section, name) = key
        .trim()
        .split_once('.')
        .with_context(|| format!("override `{item}`: expected SECTION.KEY=VALUE"))?;
    let value = value.trim();
    let parsed = format!("v = {value}");
    let value = if toml::from_str::<toml::Table>(&parsed).is_ok() {
        value.to_string()
    } else {
        format!("{value:?}")
    };
    Ok(format!("[{section}]\n{name} = {value}\n"))
}

/// Keys that were renamed so that one name means one thing: (old, new).
const RENAMED: [(&str, &str); 2] = [
    ("train.workers", "train.cpu_trainers"),
    ("data.workers", "data.loader_workers"),
];

/// One line per figment error, each naming the key and where it was set.
fn describe(error: figment::Error) -> String {
    error
        .into_iter()
        .map(|e| {
            let key = e.path.join(".");
            let origin = e
                .metadata
                .as_ref()
                .map_or_else(|| "the configuration".to_string(), |m| origin(m, &key));
            if key.is_empty() {
                format!("bad configuration in {origin}: {}", e.kind)
            } else if let Some((_, new)) = RENAMED.iter().find(|(old, _)| *old == key) {
                format!("configuration key `{key}` in {origin} was renamed: it is `{new}` now")
            } else {
                format!("bad configuration key `{key}` in {origin}: {}", e.kind)
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A value that parses but is not allowed: the key (`section.name`) and why.
#[derive(Debug)]
struct Invalid {
    key: &'static str,
    message: String,
}

fn invalid(key: &'static str, message: impl std::fmt::Display) -> Invalid {
    Invalid {
        key,
        message: message.to_string(),
    }
}

/// `[s3]`'s checks.
fn validate_s3(s3: &S3Config) -> Result<(), Invalid> {
    let is_url = ["http://", "https://"]
        .iter()
        .any(|scheme| s3.endpoint.starts_with(scheme));
    if !s3.endpoint.is_empty() && !is_url {
        return Err(invalid(
            "s3.endpoint",
            format!("`{}` is not an http:// or https:// URL", s3.endpoint),
        ));
    }
    let chunk =
        crate::units::parse_size(&s3.chunk_size).map_err(|e| invalid("s3.chunk_size", e))?;
    if chunk < 64 << 10 {
        return Err(invalid("s3.chunk_size", "must be at least 64KiB"));
    }
    for (key, value) in [
        ("s3.chunks_in_flight", s3.chunks_in_flight as u64),
        ("s3.max_requests", s3.max_requests as u64),
        ("s3.request_timeout_secs", s3.request_timeout_secs),
        ("s3.attempts", u64::from(s3.attempts)),
    ] {
        if value == 0 {
            return Err(invalid(key, "must be at least 1"));
        }
    }
    Ok(())
}

/// `train.checkpoint_store`: empty, or an `s3://` bucket with an optional prefix.
fn validate_checkpoint_store(store: &str) -> Result<(), Invalid> {
    const KEY: &str = "train.checkpoint_store";
    if store.is_empty() {
        return Ok(());
    }
    let rest = ["s3://", "az://"]
        .iter()
        .find_map(|scheme| store.strip_prefix(scheme));
    let Some(rest) = rest else {
        return Err(invalid(
            KEY,
            format!(
                "`{store}` is not an object store's URL (s3://BUCKET/PREFIX or \
                 az://CONTAINER/PREFIX)"
            ),
        ));
    };
    let bucket = rest.split('/').next().unwrap_or_default();
    if bucket.is_empty() || rest.contains(['*', '?', '{']) {
        return Err(invalid(
            KEY,
            format!("`{store}` names no bucket, or a pattern (s3://BUCKET/PREFIX)"),
        ));
    }
    Ok(())
}

/// Checks what parsing alone cannot; the error names the key so that its origin can be
/// found.
fn validate(config: &Config) -> Result<(), Invalid> {
    let shards = &config.shards;
    if shards.read_buffer == 0 {
        return Err(invalid("shards.read_buffer", "must be positive"));
    }
    if shards.http_attempts == 0 {
        return Err(invalid("shards.http_attempts", "must be at least 1"));
    }
    crate::units::parse_size(&shards.cache_max_size)
        .map_err(|e| invalid("shards.cache_max_size", e))?;
    validate_s3(&config.s3)?;
    validate_checkpoint_store(&config.train.checkpoint_store)?;
    if config.serve.max_in_flight == 0 {
        return Err(invalid("serve.max_in_flight", "must be positive"));
    }
    if config.serve.max_per_client == 0 {
        return Err(invalid("serve.max_per_client", "must be positive"));
    }
    if config.serve.header_timeout_secs == 0 {
        return Err(invalid("serve.header_timeout_secs", "must be positive"));
    }
    if config.serve.send_timeout_secs == 0 {
        return Err(invalid("serve.send_timeout_secs", "must be positive"));
    }
    if config.data.preload && config.data.preload_dir.is_empty() {
        return Err(invalid(
            "data.preload_dir",
            "is empty and data.preload is true: name a node-local folder, e.g. \
             \"/local/ssd/imgrun\"",
        ));
    }
    let cluster = &config.cluster;
    cluster
        .bind
        .parse::<std::net::IpAddr>()
        .map_err(|e| invalid("cluster.bind", format!("`{}`: {e}", cluster.bind)))?;
    cluster
        .dashboard_bind
        .parse::<std::net::IpAddr>()
        .map_err(|e| {
            invalid(
                "cluster.dashboard_bind",
                format!("`{}`: {e}", cluster.dashboard_bind),
            )
        })?;
    runtime::MembershipConfig {
        heartbeat_interval_ms: cluster.heartbeat_ms,
        dead_after_ms: cluster.dead_after_ms,
    }
    .validate()
    .map_err(|e| {
        invalid(
            "cluster.dead_after_ms",
            format!("with cluster.heartbeat_ms: {e}"),
        )
    })?;
    if cluster.start_timeout_secs == 0 {
        return Err(invalid("cluster.start_timeout_secs", "must be positive"));
    }
    if config.launch.num_gpus < -1 {
        return Err(invalid(
            "launch.num_gpus",
            "must be -1 (the GPUs found) or a count",
        ));
    }
    check_job_ranges(config)
}

/// The largest image side a job may crop, evaluate or schedule: a batch of 256 such RGB
/// images is 16 GiB of f32 pixels already.
const MAX_IMAGE_SIDE: u64 = 4096;

/// Every number of `[data]`, `[model]` and `[train]` within the range where it means
/// something, so that `data.image_size = 100000` or `train.lr = nan` is refused at load,
/// naming the key (and so its origin), not in an allocation or a NaN loss later.
fn check_job_ranges(config: &Config) -> Result<(), Invalid> {
    let data = &config.data;
    let train = &config.train;
    pipelines::BatchPolicy::parse(
        &data.policy,
        (data.nbatches > 0).then_some(data.nbatches),
        (data.dsrepeat > 0).then_some(data.dsrepeat),
    )
    .map_err(|e| invalid("data.policy", e))?;
    let whole = |key: &'static str, value: u64, lo: u64, hi: u64| {
        if (lo..=hi).contains(&value) {
            Ok(())
        } else {
            Err(invalid(
                key,
                format!("{value} is out of range: expected {lo} to {hi}"),
            ))
        }
    };
    // `lo` is excluded when `open` (a rate of 0 means nothing), `hi` always included.
    let real = |key: &'static str, value: f64, lo: f64, open: bool, hi: f64| {
        let above = if open { value > lo } else { value >= lo };
        if value.is_finite() && above && value <= hi {
            Ok(())
        } else {
            let low = match (open, lo == 0.0) {
                (true, true) => "a positive number".to_string(),
                (true, false) => format!("a number above {lo}"),
                (false, _) => format!("a number from {lo}"),
            };
            let high = if hi >= 1e6 {
                format!("{hi:e}")
            } else {
                hi.to_string()
            };
            Err(invalid(
                key,
                format!("{value} is out of range: expected {low} up to {high}"),
            ))
        }
    };
    whole("data.image_size", data.image_size.into(), 1, MAX_IMAGE_SIDE)?;
    whole("data.eval_size", data.eval_size.into(), 1, MAX_IMAGE_SIDE)?;
    for phase in &data.size_schedule {
        whole("data.size_schedule", phase.size().into(), 1, MAX_IMAGE_SIDE)?;
    }
    whole("data.loader_workers", data.loader_workers.into(), 1, 256)?;
    whole("data.queue_batches", data.queue_batches as u64, 1, 1024)?;
    whole(
        "data.shuffle_buffer",
        data.shuffle_buffer as u64,
        0,
        10_000_000,
    )?;
    whole("data.dsrepeat", data.dsrepeat, 0, 1_000)?;
    if data.classes < 0 {
        return Err(invalid(
            "data.classes",
            format!("{} is negative (0: from the manifest)", data.classes),
        ));
    }
    real(
        "data.resize_ratio",
        data.resize_ratio.into(),
        0.0,
        true,
        1.0,
    )?;
    let width = u64::try_from(config.model.width).unwrap_or(0);
    whole("model.width", width, 1, 4096)?;
    whole("train.epochs", train.epochs, 1, 1_000_000)?;
    whole("train.batch_size", train.batch_size, 1, 1 << 20)?;
    whole("train.reference_batch", train.reference_batch, 1, 1 << 30)?;
    real("train.lr", train.lr, 0.0, true, 1000.0)?;
    real("train.momentum", train.momentum, 0.0, false, 1.0)?;
    real("train.weight_decay", train.weight_decay, 0.0, false, 1.0)?;
    real(
        "train.label_smoothing",
        train.label_smoothing,
        0.0,
        false,
        1.0,
    )?;
    real("train.warmup_epochs", train.warmup_epochs, 0.0, false, 1e6)?;
    real(
        "train.warmup_start_fraction",
        train.warmup_start_fraction,
        0.0,
        false,
        1.0,
    )?;
    real(
        "train.final_lr_fraction",
        train.final_lr_fraction,
        0.0,
        false,
        1.0,
    )?;
    real("train.gamma", train.gamma, 0.0, true, 1.0)?;
    real(
        "train.loss_scale_init",
        train.loss_scale_init,
        0.0,
        true,
        f32::MAX.into(),
    )?;
    real("train.bucket_mb", train.bucket_mb, 0.0, true, 4096.0)?;
    whole(
        "train.step_timeout_secs",
        train.step_timeout_secs,
        1,
        86_400,
    )?;
    whole("train.threads", train.threads.into(), 0, 1024)?;
    real(
        "train.straggler_secs",
        train.straggler_secs,
        0.0,
        false,
        86_400.0,
    )?;
    whole("train.min_world", train.min_world.into(), 1, 1 << 20)?;
    // The rules between a job's choices live with the job (`actors::job::check_choices`),
    // which every job request is checked against too.
    actors::job::check_choices(&actors::job::JobChoices {
        elastic: train.elastic,
        sync: train.sync,
        allreduce: train.allreduce,
        loaders: config.data.loaders,
        preload: config.data.preload,
    })
    .map_err(|error| invalid(error.key, error.problem))?;
    Ok(())
}

impl ShardsConfig {
    /// The sources' settings of `[shards]`, with `[s3]`'s `s3`.
    pub fn source_options(&self, s3: &S3Config) -> pipelines::SourceOptions {
        pipelines::SourceOptions {
            s3: s3.options(),
            read_buffer: self.read_buffer,
            http_timeout: Duration::from_secs(self.http_timeout_secs),
            http_attempts: self.http_attempts,
            http_retry_delay: Duration::from_millis(self.http_retry_delay_ms),
            pipe_idle_timeout: (self.pipe_idle_timeout_secs > 0)
                .then(|| Duration::from_secs(self.pipe_idle_timeout_secs)),
            cache: (!self.cache_dir.is_empty()).then(|| pipelines::CacheOptions {
                dir: PathBuf::from(&self.cache_dir),
                // Invariant: `validate` checked the size when the config was loaded.
                max_bytes: crate::units::parse_size(&self.cache_max_size).unwrap_or(0),
            }),
            preloaded: None,
        }
    }
}

impl Config {
    /// The shard sources' settings (`[shards]` and `[s3]`).
    pub fn source_options(&self) -> pipelines::SourceOptions {
        self.shards.source_options(&self.s3)
    }

    /// A reader with these settings; `policy` overrides the configured error policy.
    pub fn reader(&self, policy: Option<pipelines::ErrorPolicy>) -> pipelines::SampleReader {
        pipelines::SampleReader::new(pipelines::Sources::new(self.source_options()))
            .with_policy(policy.unwrap_or(self.shards.error_policy))
            .with_max_member(self.shards.max_member)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_parse() {
        let loaded = load(Some(Path::new("cluster.toml"))).expect("the shipped defaults load");
        assert_eq!(loaded.config.serve.port, 8080);
    }

    #[test]
    fn cache_settings_reach_the_sources() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("cluster.toml");
        let cases = [
            ("", None),
            (
                "[shards]\ncache_dir = \"/ssd/shards\"\ncache_max_size = \"2GiB\"\n",
                Some(pipelines::CacheOptions {
                    dir: PathBuf::from("/ssd/shards"),
                    max_bytes: 2 << 30,
                }),
            ),
        ];
        for (text, want) in cases {
            std::fs::write(&path, text).expect("write config");
            let loaded = load(Some(&path)).expect(text);
            assert_eq!(loaded.config.source_options().cache, want, "{text:?}");
        }
    }

    #[test]
    fn s3_settings_reach_the_sources() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("cluster.toml");
        let text = "[s3]\nendpoint = \"http://127.0.0.1:9000\"\nregion = \"\"\n\
                    anonymous = true\nchunk_size = \"16MiB\"\nrequest_timeout_secs = 5\n";
        std::fs::write(&path, text).expect("write config");
        let loaded = load(Some(&path)).expect(text);
        let s3 = loaded.config.source_options().s3;
        assert_eq!(s3.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
        assert_eq!(s3.region, None, "empty is the environment's");
        assert!(s3.anonymous);
        assert_eq!(s3.chunk_bytes, 16 << 20);
        assert_eq!(s3.request_timeout, Duration::from_secs(5));
        assert_eq!(s3.attempts, 10);
    }

    #[test]
    fn gopen_buffer_sets_the_read_buffer_under_explicit_settings() {
        use std::ffi::OsStr;
        let read_buffer = |layers: Vec<figment::providers::Data<Toml>>| {
            let mut figment = Figment::from(Toml::string(DEFAULTS));
            for layer in layers {
                figment = figment.merge(layer);
            }
            figment
                .extract::<Config>()
                .expect("config")
                .shards
                .read_buffer
        };
        let layer = |value: &str| gopen_buffer(Some(OsStr::new(value))).expect(value);
        let default = read_buffer(vec![]);
        assert_eq!(layer("-1").map(|_| ()), None);
        assert!(gopen_buffer(None).expect("unset").is_none());
        let cases = [
            ("4194304", 4_194_304),
            ("4MiB", 4 << 20),
            (" 65536\n", 65_536),
        ];
        for (value, want) in cases {
            let gopen = layer(value).expect("a layer");
            assert_eq!(read_buffer(vec![gopen]), want, "{value:?}");
        }
        assert_ne!(default, 4_194_304);
        // What is merged after it (IMGRUN_SHARDS__READ_BUFFER, --set) wins.
        let explicit = Toml::string("[shards]\nread_buffer = 1000\n");
        let gopen = layer("4194304").expect("a layer");
        assert_eq!(read_buffer(vec![gopen, explicit]), 1000);
        for bad in ["big", "0", "-2", ""] {
            let Err(err) = gopen_buffer(Some(OsStr::new(bad))) else {
                panic!("GOPEN_BUFFER={bad:?} was taken");
            };
            let err = format!("{err:#}");
            assert!(err.contains("GOPEN_BUFFER"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn unknown_and_bad_keys_name_key_and_file() {
        let dir = tempfile::tempdir().expect("temp dir");
        let cases = [
            ("[shards]\nread_bufer = 10\n", "read_bufer"),
            ("[shardz]\n", "shardz"),
            ("[shards]\nread_buffer = \"big\"\n", "shards.read_buffer"),
            (
                "[shards]\nerror_policy = \"ignore\"\n",
                "shards.error_policy",
            ),
            (
                "[shards]\ncache_max_size = \"lots\"\n",
                "shards.cache_max_size",
            ),
            ("[shards\n", "cluster.toml"),
            ("[s3]\nendpoint = \"minio:9000\"\n", "s3.endpoint"),
            ("[s3]\nchunk_size = \"4KiB\"\n", "s3.chunk_size"),
            ("[s3]\nchunk_size = \"big\"\n", "s3.chunk_size"),
            ("[s3]\nattempts = 0\n", "s3.attempts"),
            ("[s3]\nmax_requests = 0\n", "s3.max_requests"),
            ("[s3]\naccess_key = \"AKI\"\n", "access_key"),
            (
                "[train]\ncheckpoint_store = \"/mnt/runs\"\n",
                "train.checkpoint_store",
            ),
            (
                "[train]\ncheckpoint_store = \"s3:///runs\"\n",
                "train.checkpoint_store",
            ),
            ("[cluster]\nbind = \"everywhere\"\n", "cluster.bind"),
            (
                "[cluster]\ndashboard_bind = \"my-laptop\"\n",
                "cluster.dashboard_bind",
            ),
            (
                "[cluster]\nheartbeat_ms = 5000\ndead_after_ms = 1000\n",
                "cluster.dead_after_ms",
            ),
            ("[cluster]\nhead = \"x\"\n", "head"),
            ("[data]\nimage_size = 100000\n", "data.image_size"),
            ("[data]\nimage_size = 0\n", "data.image_size"),
            (
                "[data]\nsize_schedule = [[0, 99999]]\n",
                "data.size_schedule",
            ),
            ("[data]\nclasses = -3\n", "data.classes"),
            ("[train]\nlr = -1.0\n", "train.lr"),
            ("[train]\nlr = nan\n", "train.lr"),
            ("[train]\nlr = inf\n", "train.lr"),
            ("[train]\nmomentum = 1.5\n", "train.momentum"),
            ("[train]\nepochs = 0\n", "train.epochs"),
            ("[train]\nbatch_size = 0\n", "train.batch_size"),
            ("[model]\nwidth = 0\n", "model.width"),
            ("[train]\nworkers = 2\n", "it is `train.cpu_trainers` now"),
            ("[data]\nworkers = 2\n", "it is `data.loader_workers` now"),
            // Choices are typed: a wrong one is refused at load with the valid ones.
            ("[data]\nmode = \"splitt\"\n", "resampled or split"),
            ("[data]\npolicy = \"sometimes\"\n", "data.policy"),
            ("[model]\nname = \"vgg\"\n", "small_cnn"),
            (
                "[train]\nschedule = \"linear\"\n",
                "cosine, step or constant",
            ),
            ("[train]\nprecision = \"fp16\"\n", "fp32, amp or bf16"),
            ("[train]\nchannels_last = \"yes\"\n", "channels_last"),
            ("[train]\nallreduce = \"mpi\"\n", "train.allreduce"),
            ("[shards]\nerror_policy = \"ignore\"\n", "`fail` or `skip`"),
            ("[data]\nloaders = \"elsewhere\"\n", "local or remote"),
            (
                "[train]\nelastic = true\nsync = \"decentralized\"\n",
                "train.elastic",
            ),
            (
                "[train]\nelastic = true\n[data]\nloaders = \"remote\"\n",
                "data.loaders = \"local\"",
            ),
            ("[train]\nmin_world = 0\n", "train.min_world"),
            (
                "[train]\nelastic = true\nallreduce = \"nccl\"\n",
                "imgrun's ring",
            ),
            (
                "[data]\nloaders = \"remote\"\npreload = true\npreload_dir = \"/x\"\n",
                "shards.cache_dir",
            ),
        ];
        for (text, want) in cases {
            let path = dir.path().join("cluster.toml");
            std::fs::write(&path, text).expect("write config");
            let err = format!("{:#}", load(Some(&path)).expect_err(text));
            assert!(err.contains(want), "{text:?}: `{err}` lacks `{want}`");
            assert!(
                err.contains(&path.display().to_string()),
                "{text:?}: `{err}` lacks the file"
            );
        }
    }
}
