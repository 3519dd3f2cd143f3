//! imgrun's data path: WebDataset shards and where they come from.
//!
//! This crate reads and writes WebDataset tar shards exactly as the Python `webdataset`
//! library does (see `ARCHITECTURE.md` and the format notes in `docs/`), opens shards
//! from local paths, `http(s)://` URLs, `pipe:` commands and standard input, and holds
//! the shard toolkit behind `imgrun shards`: converting image folders, generating the
//! synthetic demo dataset, listing, summarising and verifying shards.
//!
//! It knows nothing about QUIC, actors or libtorch; everything here is plain blocking
//! I/O meant to run on threads of its own.
//!
//! Modules, bottom up: a module uses only those on the lines before its own.
//! 1. `brace`, `error`, `sample`, `shard_name`, `transform/`: leaves.
//! 2. `members` (the tar walk), `stream` (what every shard source shares), `writer`.
//! 3. `cache`, `http`, `pipe`: the sources below `source`.
//! 4. `source` (the dispatcher, which also finds a preloaded copy), then `reader`, then
//!    `inspect`, `manifest`, then `preload` (which copies shards through `source`).
//! 5. `index`, `plan/`, `produce`.
//! 6. `folder`, `loader/`, `profile`.
//! 7. `synth`.

mod brace;
mod cache;
mod error;
mod folder;
mod http;
mod index;
mod inspect;
mod loader;
mod manifest;
mod members;
mod pipe;
mod plan;
mod preload;
mod produce;
mod profile;
mod reader;
mod s3;
mod sample;
mod shard_name;
mod source;
mod stream;
mod synth;
mod transform;
mod writer;

pub use brace::{BraceError, expand_braces, expand_spec, summarize_names};
pub use cache::{CacheCounts, CacheStats};
pub use error::{ErrorPolicy, ObjectProblem, ShardError, escaped};
pub use folder::{CreateOptions, ImageFolder, create_from_folder};
pub use index::{IndexError, IndexOptions, index_shards};
pub use inspect::{
    Problem, ShardSummary, VerifyChecks, VerifyReport, human_bytes, summarize_shard, verify_shard,
};
pub use loader::{
    Batch, EpochBatches, EpochStats, EpochTally, FrameDecoder, FrameError, Images, Loader,
    LoaderConfig, LoaderError, LoaderWorkerCursor, LoaderWorkerMsg, LoaderWorkerPlacement,
    LoaderWorkerRun, RankCursor, ReadingNow, Regrouped, SampleId, ShardReading, Transform,
    encode_frame, regroup,
};
pub use manifest::{MANIFEST_FILE, Manifest, ManifestShard};
pub use plan::{
    BatchPolicy, ClusterShape, Consistency, HookError, HookLimits, HookName, HookSources, Hooks,
    LoaderWorkerId, LoaderWorkerPlan, Plan, PlanConfig, PlanError, PlanMode, PlanShard, Planner,
    Rank, RankPlan, SplitMix64, WorkItem, derive_seed, mix64, render_plan,
};
pub use preload::{PreloadError, PreloadProgress, Preloader};
pub use produce::{CreateError, CreateReport};
pub use profile::{StageProfile, process_cpu_seconds, profile_stages};
pub use reader::{ReadStats, SampleReader, ShardSamples};
pub use s3::{
    ObjectCopyError, ObjectWriter, copy_object, delete_object, is_object_url, list_objects,
    put_object,
};
pub use sample::{Sample, decode_int_field};
pub use shard_name::shard_name;
pub use source::{
    ShardList, ShardListError, Sources, local_folder, local_path, preloaded_copy, preloaded_path,
};
pub use stream::{
    CacheOptions, DEFAULT_READ_BUFFER, S3Options, ShardSource, ShardStream, SourceCounts,
    SourceKind, SourceOptions,
};
pub use synth::{SynthOptions, generate_synthetic};
pub use transform::{
    CropBox, DecodeLimits, EvalTransform, IMAGENET_MEAN, IMAGENET_STD, ImageFormat, ImageHeader,
    OutputFormat, TrainTransform, TransformError, decode_rgb, random_resized_crop, read_header,
};
pub use writer::{ShardWriter, TarWriter, WrittenShard, format_pattern};
