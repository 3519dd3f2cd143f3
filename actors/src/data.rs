//! The job's data settings ([`DataSpec`]: shards, plan, loader, transforms, sources)
//! and what is made from them: plans, loader and transform settings, the training
//! planner of a size schedule. A leaf of the crate: both the trainer (`train/`) and the
//! loader actor (`load/`) are told a `DataSpec`, and neither is below the other.

use serde::{Deserialize, Serialize};

use pipelines::{
    BatchPolicy, ClusterShape, DecodeLimits, ErrorPolicy, EvalTransform, HookLimits, HookSources,
    Hooks, LoaderConfig, OutputFormat, PlanConfig, PlanError, PlanMode, PlanShard, Planner,
    SourceOptions, TrainTransform, Transform,
};

/// A set of shards with their sample counts where known.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ShardSet {
    pub urls: Vec<String>,
    pub samples: Vec<Option<u64>>,
}

impl ShardSet {
    pub fn plan_shards(&self) -> Vec<PlanShard> {
        self.urls
            .iter()
            .zip(self.samples.iter().chain(std::iter::repeat(&None)))
            .map(|(url, samples)| PlanShard::new(url.clone(), *samples))
            .collect()
    }

    pub fn is_empty(&self) -> bool {
        self.urls.is_empty()
    }

    /// Samples in all, when every count is known.
    pub fn total(&self) -> Option<u64> {
        if self.samples.len() != self.urls.len() {
            return None;
        }
        self.samples.iter().copied().sum()
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DataSpec {
    pub train: ShardSet,
    pub val: ShardSet,
    pub hooks: HookSources,
    pub mode: PlanMode,
    /// How ranks' batch counts are made equal.
    pub policy: BatchPolicy,
    pub epoch_size: Option<u64>,
    pub nominal_size: Option<u64>,
    /// Samples assumed in each training shard whose count is unknown
    /// (`data.samples_per_shard`).
    #[serde(default)]
    pub samples_per_shard: Option<u64>,
    pub seed: u64,
    /// Loader workers per trainer.
    pub loader_workers: u32,
    /// Where they run (`data.loaders`).
    #[serde(default)]
    pub loaders: Loaders,
    /// Loader actors of a job whose loaders are remote (`data.loader_actors`; 0: one per
    /// trainer).
    #[serde(default)]
    pub loader_actors: u32,
    pub shuffle_buffer: usize,
    pub queue_batches: usize,
    pub image_fields: Vec<String>,
    pub label_field: String,
    pub errors: ErrorPolicy,
    /// Train crop side, by epoch: `(first epoch, size)`, sorted; the first entry is epoch 0.
    /// Each entry starts a size phase.
    pub sizes: Vec<(u64, u32)>,
    /// The size phases that read shards of their own (pre-resized copies of `train`), by
    /// first epoch; other size phases read `train`.
    #[serde(default)]
    pub size_phase_train: Vec<(u64, ShardSet)>,
    pub eval_size: u32,
    pub crop_scale: (f32, f32),
    pub resize_ratio: f32,
    pub flip: bool,
    pub sources: SourceSpec,
}

/// The shard sources' settings (`[shards]` of the configuration).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SourceSpec {
    pub read_buffer: usize,
    pub http_timeout_secs: u64,
    pub http_attempts: u32,
    pub http_retry_delay_ms: u64,
    /// 0 for no limit.
    pub pipe_idle_timeout_secs: u64,
    pub cache_dir: Option<String>,
    pub cache_max_bytes: u64,
    /// Where shards are preloaded (`data.preload`), read from there once copied.
    #[serde(default)]
    pub preload_dir: Option<String>,
    /// How `s3://` shards are reached and read (`[s3]`; each process finds its own
    /// credentials).
    #[serde(default)]
    pub s3: pipelines::S3Options,
}

impl SourceSpec {
    pub fn options(&self) -> SourceOptions {
        SourceOptions {
            read_buffer: self.read_buffer,
            http_timeout: std::time::Duration::from_secs(self.http_timeout_secs),
            http_attempts: self.http_attempts,
            http_retry_delay: std::time::Duration::from_millis(self.http_retry_delay_ms),
            pipe_idle_timeout: (self.pipe_idle_timeout_secs > 0)
                .then(|| std::time::Duration::from_secs(self.pipe_idle_timeout_secs)),
            cache: self.cache_dir.as_ref().map(|dir| pipelines::CacheOptions {
                dir: dir.into(),
                max_bytes: self.cache_max_bytes,
            }),
            preloaded: self.preload_dir.as_ref().map(std::path::PathBuf::from),
            s3: self.s3.clone(),
        }
    }
}

/// Where a trainer's loader workers run (`data.loaders`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Loaders {
    /// Threads in the trainer's process.
    #[default]
    Local,
    /// Loader actors, placed by the CPUs they reserve on any node (CPU-only ones too),
    /// streaming `u8` batches to their trainers.
    Remote,
}

impl std::str::FromStr for Loaders {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "local" => Ok(Self::Local),
            "remote" => Ok(Self::Remote),
            other => Err(format!("`{other}`: expected local or remote")),
        }
    }
}

impl Loaders {
    pub fn name(self) -> &'static str {
        match self {
            Self::Local => "local",
            Self::Remote => "remote",
        }
    }
}

impl DataSpec {
    fn error_policy(&self) -> ErrorPolicy {
        self.errors
    }

    /// The training plan's settings for a world of `shape`.
    pub fn train_plan(&self, shape: ClusterShape, batch_size: u64) -> PlanConfig {
        let mut config = PlanConfig::new(self.train.plan_shards(), shape, batch_size);
        config.seed = self.seed;
        config.mode = self.mode;
        config.policy = self.policy;
        // Exact epochs with the join policy train on every sample once: a worker's last,
        // partial batch is kept (the gradient average is weighted by samples).
        config.drop_partial = !(self.mode == PlanMode::Split && self.policy == BatchPolicy::Join);
        config.epoch_size = self.epoch_size;
        config.nominal_size = self.nominal_size;
        config.default_samples_per_shard = self.samples_per_shard;
        config
    }

    /// The planner of this job's training epochs for a world of `shape`: the one that
    /// `imgrun plan`, the job's client and every trainer use, so all three agree.
    pub fn train_planner(
        &self,
        shape: ClusterShape,
        batch_size: u64,
    ) -> Result<TrainPlanner, PlanError> {
        let planner = |shards: &ShardSet| -> Result<Planner, PlanError> {
            let hooks = Hooks::compile(&self.hooks, HookLimits::default())?;
            let mut config = self.train_plan(shape.clone(), batch_size);
            config.shards = shards.plan_shards();
            Planner::new(config, hooks)
        };
        let mut size_phases = Vec::with_capacity(self.size_phase_train.len());
        for (first, shards) in &self.size_phase_train {
            size_phases.push((*first, planner(shards)?));
        }
        Ok(TrainPlanner {
            base: planner(&self.train)?,
            size_phases,
            starts: self.sizes.iter().map(|(first, _)| *first).collect(),
        })
    }

    /// The first epoch of the size phase `epoch` is in (0 without a size schedule).
    fn size_phase_start(&self, epoch: u64) -> u64 {
        size_phase_start(self.sizes.iter().map(|(first, _)| *first), epoch)
    }

    /// The training shards `epoch` reads: its size phase's own, or `train`.
    pub fn train_set_at(&self, epoch: u64) -> &ShardSet {
        let start = self.size_phase_start(epoch);
        self.size_phase_train
            .iter()
            .find(|(first, _)| *first == start)
            .map_or(&self.train, |(_, set)| set)
    }

    /// The validation plan: exact (every sample once), in order, partial batches kept,
    /// one loader worker per rank, ranks that run out joining with empty batches.
    pub fn val_plan(&self, shape: ClusterShape, batch_size: u64) -> PlanConfig {
        let shape = ClusterShape::with_node_ranks(shape.node_ranks().to_vec(), 1);
        let mut config = PlanConfig::new(self.val.plan_shards(), shape, batch_size);
        config.mode = PlanMode::Split;
        config.policy = BatchPolicy::Join;
        config.drop_partial = false;
        config.shuffle_shards = false;
        config
    }

    pub fn train_loader(&self) -> LoaderConfig {
        LoaderConfig {
            image_fields: self.image_fields.clone(),
            label_field: self.label_field.clone(),
            shuffle_buffer: self.shuffle_buffer,
            shuffle_initial: (self.shuffle_buffer / 10).max(1),
            queue_batches: self.queue_batches.max(1),
            errors: self.error_policy(),
            ..LoaderConfig::default()
        }
    }

    pub fn val_loader(&self) -> LoaderConfig {
        LoaderConfig {
            shuffle_buffer: 0,
            shuffle_initial: 0,
            ..self.train_loader()
        }
    }

    /// The train crop side of `epoch` (progressive resizing).
    pub fn size_at(&self, epoch: u64) -> u32 {
        self.sizes
            .iter()
            .take_while(|(first, _)| *first <= epoch)
            .last()
            .map_or(self.eval_size, |(_, size)| *size)
    }

    pub fn train_transform(&self, epoch: u64) -> Transform {
        Transform::Train(TrainTransform {
            size: self.size_at(epoch),
            scale: self.crop_scale,
            ratio: (3.0 / 4.0, 4.0 / 3.0),
            flip: self.flip,
            output: OutputFormat::Uint8Nhwc,
            limits: DecodeLimits::default(),
        })
    }

    pub fn eval_transform(&self) -> Transform {
        Transform::Eval(EvalTransform {
            size: self.eval_size,
            resize_ratio: self.resize_ratio,
            output: OutputFormat::Uint8Nhwc,
            limits: DecodeLimits::default(),
        })
    }
}

/// Plans training epochs, each with the shards of its size phase (see
/// [`DataSpec::size_phase_train`]); a pure function of the epoch, as [`Planner`] is.
pub struct TrainPlanner {
    base: Planner,
    size_phases: Vec<(u64, Planner)>,
    starts: Vec<u64>,
}

impl std::fmt::Debug for TrainPlanner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let own: Vec<u64> = self.size_phases.iter().map(|(first, _)| *first).collect();
        f.debug_struct("TrainPlanner")
            .field("size_phase_starts", &self.starts)
            .field("size_phases_with_own_shards", &own)
            .finish_non_exhaustive()
    }
}

impl TrainPlanner {
    pub fn plan(&self, epoch: u64) -> Result<pipelines::Plan, PlanError> {
        let start = size_phase_start(self.starts.iter().copied(), epoch);
        self.size_phases
            .iter()
            .find(|(first, _)| *first == start)
            .map_or(&self.base, |(_, planner)| planner)
            .plan(epoch)
    }
}

/// The last of the sorted size phase `starts` at or before `epoch` (0 when none is).
fn size_phase_start(starts: impl Iterator<Item = u64>, epoch: u64) -> u64 {
    starts
        .take_while(|first| *first <= epoch)
        .last()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progressive_sizes_follow_the_epoch() {
        let mut data = test_data();
        data.sizes = vec![(0, 128), (3, 192), (6, 224)];
        let got: Vec<u32> = (0..8).map(|e| data.size_at(e)).collect();
        assert_eq!(got, [128, 128, 128, 192, 192, 192, 224, 224]);
        data.sizes.clear();
        assert_eq!(data.size_at(5), data.eval_size);
    }

    #[test]
    fn size_phases_read_their_own_shards_from_their_first_epoch() {
        let mut data = test_data();
        let set = |name: &str| ShardSet {
            urls: vec![format!("{name}-000.tar"), format!("{name}-001.tar")],
            samples: vec![Some(40), Some(40)],
        };
        data.train = set("full");
        data.sizes = vec![(0, 128), (3, 192), (6, 224)];
        data.size_phase_train = vec![(0, set("small")), (3, set("medium"))];
        let read: Vec<&str> = (0..8)
            .map(|e| data.train_set_at(e).urls[0].as_str())
            .collect();
        assert_eq!(
            read,
            [
                "small-000.tar",
                "small-000.tar",
                "small-000.tar",
                "medium-000.tar",
                "medium-000.tar",
                "medium-000.tar",
                "full-000.tar",
                "full-000.tar"
            ]
        );
        // The planner plans each epoch from its size phase's shards.
        let planner = data
            .train_planner(ClusterShape::new(1, 1, 1), 8)
            .expect("planner");
        for epoch in 0..8 {
            let plan = planner.plan(epoch).expect("plan");
            let urls: Vec<&str> = plan.ranks[0].workers[0]
                .items
                .iter()
                .map(|item| item.url.as_str())
                .collect();
            let want = &data.train_set_at(epoch).urls;
            assert!(
                !urls.is_empty() && urls.iter().all(|u| want.iter().any(|w| w == u)),
                "epoch {epoch}: {urls:?} not from {want:?}"
            );
        }
    }

    #[test]
    fn shard_sets_pair_urls_with_counts() {
        let set = ShardSet {
            urls: vec!["a.tar".into(), "b.tar".into()],
            samples: vec![Some(3)],
        };
        let shards = set.plan_shards();
        assert_eq!(shards[0], PlanShard::new("a.tar", Some(3)));
        assert_eq!(shards[1], PlanShard::new("b.tar", None));
        assert_eq!(set.total(), None);
    }

    pub(crate) fn test_data() -> DataSpec {
        DataSpec {
            train: ShardSet::default(),
            val: ShardSet::default(),
            hooks: HookSources::default(),
            mode: PlanMode::Resampled,
            policy: BatchPolicy::Join,
            epoch_size: None,
            nominal_size: None,
            samples_per_shard: None,
            seed: 0,
            loader_workers: 1,
            loaders: Loaders::Local,
            loader_actors: 0,
            shuffle_buffer: 100,
            queue_batches: 2,
            image_fields: vec!["jpg".into()],
            label_field: "cls".into(),
            errors: ErrorPolicy::Skip,
            sizes: vec![(0, 32)],
            size_phase_train: Vec::new(),
            eval_size: 32,
            crop_scale: (0.35, 1.0),
            resize_ratio: 1.0,
            flip: true,
            sources: SourceSpec {
                read_buffer: 1 << 16,
                http_timeout_secs: 30,
                http_attempts: 1,
                http_retry_delay_ms: 100,
                pipe_idle_timeout_secs: 60,
                cache_dir: None,
                cache_max_bytes: 0,
                preload_dir: None,
                s3: pipelines::S3Options::default(),
            },
        }
    }
}
