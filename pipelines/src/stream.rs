//! What every shard source shares, and nothing else: the stream a source opens
//! ([`ShardStream`], [`Stored`]), the [`ShardSource`] trait, and the [`SourceOptions`]
//! every source reads (with the cache's [`CacheOptions`] and `s3://`'s [`S3Options`]).
//! The leaf below `source.rs`, `http.rs`, `s3.rs`, `pipe.rs` and `cache.rs`.

use std::fmt;
use std::io::{self, Read};
use std::path::PathBuf;
use std::time::Duration;

use crate::error::ShardError;

/// Default read buffer for shard streams (the Python library's `GOPEN_BUFFER`).
pub const DEFAULT_READ_BUFFER: usize = 1 << 20;

/// A readable shard: the raw (possibly compressed) bytes of one tar file.
pub type ShardStream = Box<dyn Read + Send>;

/// Settings shared by all sources.
#[derive(Debug, Clone)]
pub struct SourceOptions {
    /// Size of the read buffer in front of a compressed stream's decoder, in bytes. An
    /// uncompressed tar needs none: the reader reads its headers in blocks of its own
    /// and each member's data straight into the sample, one copy from the source.
    pub read_buffer: usize,
    /// Connect and read timeout for HTTP.
    pub http_timeout: Duration,
    /// How many times an HTTP request is tried when the connection fails.
    pub http_attempts: u32,
    /// Pause before the first retry; doubled after each failure.
    pub http_retry_delay: Duration,
    /// A `pipe:` command that sends no output for this long (or closes its output and
    /// does not exit within it) fails its shard, and its process group is killed;
    /// `None` waits forever.
    pub pipe_idle_timeout: Option<Duration>,
    /// A local cache for `http(s)://` and `pipe:` shards; `None` reads them remotely
    /// every time.
    pub cache: Option<CacheOptions>,
    /// The folder of preloaded copies (`data.preload_dir`): a shard with a copy there,
    /// made from its URL, is read from it.
    pub preloaded: Option<std::path::PathBuf>,
    /// How `s3://` shards are reached and read.
    pub s3: S3Options,
}

impl Default for SourceOptions {
    fn default() -> Self {
        Self {
            read_buffer: DEFAULT_READ_BUFFER,
            http_timeout: Duration::from_secs(30),
            http_attempts: 5,
            http_retry_delay: Duration::from_millis(200),
            pipe_idle_timeout: Some(Duration::from_secs(60)),
            cache: None,
            preloaded: None,
            s3: S3Options::default(),
        }
    }
}

/// How `s3://` shards are reached and read (`[s3]` of the configuration). Credentials
/// are not here: each process finds its own, as the AWS tools do (see `s3.rs`), so none
/// travels in a job's settings.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct S3Options {
    /// The store's URL (`http://127.0.0.1:9000`, `https://storage.googleapis.com`).
    /// `None`: `AWS_ENDPOINT_URL_S3`, `AWS_ENDPOINT_URL`, the profile's `endpoint_url`,
    /// else AWS itself.
    pub endpoint: Option<String>,
    /// `None`: `AWS_REGION`, `AWS_DEFAULT_REGION`, the profile's `region`, else
    /// `us-east-1`.
    pub region: Option<String>,
    /// The profile of the AWS credentials and config files; `None`: `AWS_PROFILE`, else
    /// `default`.
    pub profile: Option<String>,
    /// Unsigned requests, for public buckets: no credentials are looked for.
    pub anonymous: bool,
    /// Bytes of one ranged GET.
    pub chunk_bytes: u64,
    /// Ranged GETs of one shard requested ahead of the reader.
    pub chunks_in_flight: usize,
    /// Most ranged GETs in flight in one process, over all its shards.
    pub max_requests: usize,
    /// One request, its body included, must end within this; one that stalls is
    /// resumed at its byte offset.
    pub request_timeout: Duration,
    /// Tries of one request (first try and retries, resumes of its body included).
    pub attempts: u32,
}

impl Default for S3Options {
    fn default() -> Self {
        Self {
            endpoint: None,
            region: None,
            profile: None,
            anonymous: false,
            chunk_bytes: 8 << 20,
            chunks_in_flight: 4,
            max_requests: 64,
            request_timeout: Duration::from_secs(60),
            attempts: 10,
        }
    }
}

/// The kinds of shard source, as the counters of [`SourceCounts`] name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SourceKind {
    /// A local file (a path or a `file:` URL).
    File,
    /// `http://` or `https://`.
    Http,
    /// `pipe:` a command's standard output.
    Pipe,
    /// `s3://`: an object in AWS S3 or a store that speaks its API.
    S3,
    /// `-`: this process's standard input.
    Stdin,
    /// The node-local copy `data.preload` made.
    Preloaded,
}

impl SourceKind {
    pub const ALL: [SourceKind; 6] = [
        SourceKind::File,
        SourceKind::Http,
        SourceKind::Pipe,
        SourceKind::S3,
        SourceKind::Stdin,
        SourceKind::Preloaded,
    ];

    /// Its name in counters and labels.
    pub fn name(self) -> &'static str {
        match self {
            SourceKind::File => "file",
            SourceKind::Http => "http",
            SourceKind::Pipe => "pipe",
            SourceKind::S3 => "s3",
            SourceKind::Stdin => "stdin",
            SourceKind::Preloaded => "preloaded",
        }
    }
}

/// Shards opened through one [`Sources`](crate::Sources), by kind of source: how many
/// opened and how many failed to open; and its cache's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SourceCounts {
    /// By [`SourceKind::name`]; kinds never opened are absent.
    pub opened: std::collections::BTreeMap<String, u64>,
    pub failed: std::collections::BTreeMap<String, u64>,
    /// Opens served from the shard cache's complete copy, and opens that found none.
    pub cache_hits: u64,
    pub cache_misses: u64,
}

impl SourceCounts {
    /// Adds `other`'s counts to these.
    pub fn merge(&mut self, other: &SourceCounts) {
        for (kind, n) in &other.opened {
            *self.opened.entry(kind.clone()).or_default() += n;
        }
        for (kind, n) in &other.failed {
            *self.failed.entry(kind.clone()).or_default() += n;
        }
        self.cache_hits += other.cache_hits;
        self.cache_misses += other.cache_misses;
    }
}

/// One way of opening shards.
pub trait ShardSource: Send + Sync + fmt::Debug {
    /// Whether this source opens `url`.
    fn handles(&self, url: &str) -> bool;
    /// Which kind of source it is, for its counters.
    fn kind(&self) -> SourceKind;
    /// Opens `url` for streaming. The bytes are returned as stored (maybe compressed).
    fn open(&self, url: &str) -> Result<ShardStream, ShardError>;
    /// Opens `url` as [`open`](Self::open) does, with the length the stream will have
    /// when the source declares it up front (an HTTP `Content-Length`). The cache keeps
    /// a copy only when the bytes read match it.
    fn open_sized(&self, url: &str) -> Result<(ShardStream, Option<u64>), ShardError> {
        Ok((self.open(url)?, None))
    }

    /// Opens `url` as a local file, where this source reads local files: the reader then
    /// reads member data from it straight into samples. `None` for any other source.
    fn open_file(&self, _url: &str) -> Option<Result<std::fs::File, ShardError>> {
        None
    }
}

/// A shard's bytes as stored (maybe compressed), as a source opened them.
pub(crate) enum Stored {
    /// A local file: a path, a preloaded copy or a cache hit.
    File(std::fs::File),
    Stream(ShardStream),
}

impl Read for Stored {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::File(file) => file.read(buf),
            Self::Stream(stream) => stream.read(buf),
        }
    }
}

/// Where remote shards are cached, and how much may be kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheOptions {
    /// The cache folder, created when missing. Threads and processes may share it.
    pub dir: PathBuf,
    /// Most bytes of complete entries kept; the least recently used go first. Fills in
    /// progress come on top (one partial shard per reading thread).
    pub max_bytes: u64,
}
