//! imgrun's configuration: built-in defaults (the repository's `cluster.toml`, embedded)
//! ← a `cluster.toml` file ← `IMGRUN_*` environment variables ← command-line flags.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use figment::Figment;
use figment::providers::{Env, Format, Toml};
use serde::Deserialize;

/// The defaults, kept in one place: the `cluster.toml` at the root of the repository.
pub const DEFAULTS: &str = include_str!("../cluster.toml");

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub shards: ShardsConfig,
    pub serve: ServeConfig,
    pub cluster: ClusterConfig,
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
    pub hooks: String,
    pub mode: String,
    pub policy: String,
    pub nbatches: u64,
    pub dsrepeat: u64,
    pub epoch_size: u64,
    pub nominal_size: u64,
    pub classes: i64,
    pub seed: u64,
    pub workers: u32,
    pub shuffle_buffer: usize,
    pub queue_batches: usize,
    pub image_fields: Vec<String>,
    pub label_field: String,
    pub image_size: u32,
    pub size_schedule: Vec<(u64, u32)>,
    pub eval_size: u32,
    pub crop_scale: (f32, f32),
    pub resize_ratio: f32,
    pub flip: bool,
}

/// `[model]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub name: String,
    pub width: i64,
    pub seed: u64,
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
    pub schedule: String,
    pub final_lr_fraction: f64,
    pub milestones: Vec<u64>,
    pub gamma: f64,
    pub precision: String,
    pub loss_scaling: String,
    pub loss_scale_init: f64,
    pub allreduce: String,
    pub bucket_mb: f64,
    pub eval_every_epochs: u64,
    pub eval_every_steps: u64,
    pub checkpoint_every_epochs: u64,
    pub checkpoint_every_steps: u64,
    pub runs_dir: String,
    pub name: String,
    pub gpus: u32,
    pub workers: u32,
    pub threads: u32,
    pub step_timeout_secs: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardsConfig {
    pub read_buffer: usize,
    pub error_policy: String,
    pub max_member: u64,
    pub http_timeout_secs: u64,
    pub http_attempts: u32,
    pub http_retry_delay_ms: u64,
    /// Local cache folder for remote shards; empty for none.
    pub cache_dir: String,
    /// Most the cache keeps, as a size (`100GB`).
    pub cache_max_size: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeConfig {
    pub port: u16,
    pub max_in_flight: usize,
}

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
    /// Empty for the per-user default.
    pub state_dir: String,
    pub start_timeout_secs: u64,
}

/// Where the configuration came from, for `imgrun doctor`.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub config: Config,
    pub file: Option<PathBuf>,
}

/// Loads the configuration. `explicit` is `--config`; without it a `cluster.toml` in the
/// working folder is used when present.
pub fn load(explicit: Option<&Path>) -> anyhow::Result<Loaded> {
    load_with(explicit, None, &[])
}

/// [`load`] with a `preset` (TOML text, e.g. the demo's job) between the built-in defaults
/// and the file, and `overrides` (`section.key=value`, the value in TOML syntax, or a
/// bare word taken as a string) over everything else.
pub fn load_with(
    explicit: Option<&Path>,
    preset: Option<&str>,
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
    let mut figment = Figment::from(Toml::string(DEFAULTS));
    if let Some(text) = preset {
        figment = figment.merge(Toml::string(text));
    }
    if let Some(path) = &file {
        figment = figment.merge(Toml::file_exact(path));
    }
    figment = figment.merge(
        // Only `IMGRUN_SECTION__KEY` variables are configuration; others such as
        // `IMGRUN_LOG` or `IMGRUN_CACHE` are read elsewhere.
        Env::prefixed("IMGRUN_")
            .filter(|key| key.as_str().contains("__"))
            .split("__"),
    );
    for item in overrides {
        figment = figment.merge(Toml::string(&override_toml(item)?));
    }
    let config: Config = figment
        .extract()
        .map_err(|e| anyhow::anyhow!(describe(e)))?;
    validate(&config).with_context(|| match &file {
        Some(path) => format!("in {}", path.display()),
        None => "in the built-in defaults".to_string(),
    })?;
    Ok(Loaded { config, file })
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

/// One line per figment error, each naming the key and where it was set.
fn describe(error: figment::Error) -> String {
    error
        .into_iter()
        .map(|e| {
            let key = e.path.join(".");
            let origin = e
                .metadata
                .as_ref()
                .map(|m| match &m.source {
                    // The whole path: figment's own display shortens it relative to the
                    // working folder.
                    Some(figment::Source::File(path)) => {
                        format!("{} ({})", m.name, path.display())
                    }
                    Some(source) => format!("{} ({source})", m.name),
                    None => m.name.to_string(),
                })
                .unwrap_or_else(|| "configuration".to_string());
            if key.is_empty() {
                format!("bad configuration in {origin}: {}", e.kind)
            } else {
                format!("bad configuration key `{key}` in {origin}: {}", e.kind)
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn validate(config: &Config) -> anyhow::Result<()> {
    config
        .shards
        .error_policy
        .parse::<pipelines::ErrorPolicy>()
        .map_err(|e| anyhow::anyhow!("shards.error_policy: {e}"))?;
    anyhow::ensure!(
        config.shards.read_buffer > 0,
        "shards.read_buffer must be positive"
    );
    anyhow::ensure!(
        config.shards.http_attempts > 0,
        "shards.http_attempts must be at least 1"
    );
    crate::units::parse_size(&config.shards.cache_max_size)
        .map_err(|e| anyhow::anyhow!("shards.cache_max_size: {e}"))?;
    anyhow::ensure!(
        config.serve.max_in_flight > 0,
        "serve.max_in_flight must be positive"
    );
    let cluster = &config.cluster;
    cluster
        .bind
        .parse::<std::net::IpAddr>()
        .map_err(|e| anyhow::anyhow!("cluster.bind `{}`: {e}", cluster.bind))?;
    runtime::MembershipConfig {
        heartbeat_interval_ms: cluster.heartbeat_ms,
        dead_after_ms: cluster.dead_after_ms,
    }
    .validate()
    .map_err(|e| anyhow::anyhow!("cluster.heartbeat_ms / cluster.dead_after_ms: {e}"))?;
    anyhow::ensure!(
        cluster.start_timeout_secs > 0,
        "cluster.start_timeout_secs must be positive"
    );
    Ok(())
}

impl ShardsConfig {
    pub fn source_options(&self) -> pipelines::SourceOptions {
        pipelines::SourceOptions {
            read_buffer: self.read_buffer,
            http_timeout: Duration::from_secs(self.http_timeout_secs),
            http_attempts: self.http_attempts,
            http_retry_delay: Duration::from_millis(self.http_retry_delay_ms),
            cache: (!self.cache_dir.is_empty()).then(|| pipelines::CacheOptions {
                dir: PathBuf::from(&self.cache_dir),
                // Invariant: `validate` checked the size when the config was loaded.
                max_bytes: crate::units::parse_size(&self.cache_max_size).unwrap_or(0),
            }),
        }
    }

    /// A reader with these settings; `policy` overrides the configured error policy.
    pub fn reader(&self, policy: Option<pipelines::ErrorPolicy>) -> pipelines::SampleReader {
        // Invariant: `validate` checked the policy when the config was loaded.
        let configured = self.error_policy.parse().unwrap_or_default();
        pipelines::SampleReader::new(pipelines::Sources::new(self.source_options()))
            .with_policy(policy.unwrap_or(configured))
            .with_max_member(self.max_member)
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
            assert_eq!(
                loaded.config.shards.source_options().cache,
                want,
                "{text:?}"
            );
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
            ("[cluster]\nbind = \"everywhere\"\n", "cluster.bind"),
            (
                "[cluster]\nheartbeat_ms = 5000\ndead_after_ms = 1000\n",
                "cluster.dead_after_ms",
            ),
            ("[cluster]\nhead = \"x\"\n", "head"),
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
