//! Where shard bytes come from: local files, `http(s)://`, `pipe:` commands and stdin,
//! behind one trait, plus transparent gzip/bzip2/xz decompression.

use std::fmt;
use std::io::{self, BufRead, BufReader, Read};
use std::sync::Arc;
use std::time::Duration;

use crate::brace::{BraceError, expand_spec};
use crate::cache::{self, CacheOptions, CacheStats, ShardCache};
use crate::error::ShardError;
use crate::http::HttpSource;
use crate::pipe::{PipeFailure, PipeSource};

/// Default read buffer for shard streams (the Python library's `GOPEN_BUFFER`).
pub const DEFAULT_READ_BUFFER: usize = 1 << 20;

/// A readable shard: the raw (possibly compressed) bytes of one tar file.
pub type ShardStream = Box<dyn Read + Send>;

/// Settings shared by all sources.
#[derive(Debug, Clone)]
pub struct SourceOptions {
    /// Size of the read buffer put in front of every stream, in bytes.
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
        }
    }
}

/// One way of opening shards.
pub trait ShardSource: Send + Sync + fmt::Debug {
    /// Whether this source opens `url`.
    fn handles(&self, url: &str) -> bool;
    /// Opens `url` for streaming. The bytes are returned as stored (maybe compressed).
    fn open(&self, url: &str) -> Result<ShardStream, ShardError>;
    /// Opens `url` as [`open`](Self::open) does, with the length the stream will have
    /// when the source declares it up front (an HTTP `Content-Length`). The cache keeps
    /// a copy only when the bytes read match it.
    fn open_sized(&self, url: &str) -> Result<(ShardStream, Option<u64>), ShardError> {
        Ok((self.open(url)?, None))
    }
}

/// All sources, chosen by the form of the URL.
#[derive(Debug)]
pub struct Sources {
    options: SourceOptions,
    sources: Vec<Box<dyn ShardSource>>,
    cache: Option<Arc<ShardCache>>,
    cache_stats: Arc<CacheStats>,
}

impl Default for Sources {
    fn default() -> Self {
        Self::new(SourceOptions::default())
    }
}

impl Sources {
    /// The built-in sources: `pipe:`, `http(s)://`, `-` (stdin), `file:` and paths.
    /// With a cache configured, its folder is created and stale partial files from dead
    /// fills are removed here.
    pub fn new(options: SourceOptions) -> Self {
        let sources: Vec<Box<dyn ShardSource>> = vec![
            Box::new(PipeSource::new(&options)),
            Box::new(HttpSource::new(&options)),
            Box::new(StdinSource),
            Box::new(FileSource),
        ];
        let cache_stats = Arc::new(CacheStats::default());
        let cache = options
            .cache
            .as_ref()
            .map(|cache| Arc::new(ShardCache::new(cache, Arc::clone(&cache_stats))));
        Self {
            options,
            sources,
            cache,
            cache_stats,
        }
    }

    pub fn options(&self) -> &SourceOptions {
        &self.options
    }

    /// The cache's counters (all zero without a cache), shared with every stream opened
    /// here: a loader may keep a clone and report them.
    pub fn cache_stats(&self) -> Arc<CacheStats> {
        Arc::clone(&self.cache_stats)
    }

    /// Opens a shard and returns its tar bytes: buffered, and decompressed when the
    /// stream starts with a gzip, bzip2 or xz signature. With a cache, a remote shard
    /// comes from its cached copy when there is one, and is copied into the cache as it
    /// is read otherwise.
    pub fn open(&self, url: &str) -> Result<ShardStream, ShardError> {
        let source = self
            .sources
            .iter()
            .find(|s| s.handles(url))
            .ok_or_else(|| ShardError::BadUrl {
                url: url.to_string(),
                reason: "no source handles this URL".to_string(),
            })?;
        let raw = match &self.cache {
            Some(cache) if cache::is_cacheable(url) => {
                cache.open(url, || source.open_sized(url))?
            }
            _ => source.open(url)?,
        };
        decompress(url, BufReader::with_capacity(self.options.read_buffer, raw))
    }
}

/// Local files: plain paths and `file:` / `file://` URLs.
#[derive(Debug)]
struct FileSource;

impl ShardSource for FileSource {
    fn handles(&self, url: &str) -> bool {
        !url.contains("://") || url.starts_with("file:")
    }

    fn open(&self, url: &str) -> Result<ShardStream, ShardError> {
        let path = url
            .strip_prefix("file://")
            .or_else(|| url.strip_prefix("file:"))
            .unwrap_or(url);
        let file = std::fs::File::open(path).map_err(|source| ShardError::Open {
            url: url.to_string(),
            source,
        })?;
        Ok(Box::new(file))
    }
}

/// `-`: the process's standard input.
#[derive(Debug)]
struct StdinSource;

impl ShardSource for StdinSource {
    fn handles(&self, url: &str) -> bool {
        url == "-"
    }

    fn open(&self, _url: &str) -> Result<ShardStream, ShardError> {
        Ok(Box::new(io::stdin()))
    }
}

/// Compression detected from the first bytes of a stream.
fn decompress(url: &str, mut stream: BufReader<ShardStream>) -> Result<ShardStream, ShardError> {
    let head = stream
        .fill_buf()
        .map_err(|e| crate::reader::classify(url, 0, e))?;
    let decoded: ShardStream = if head.starts_with(&[0x1f, 0x8b]) {
        Box::new(flate2::bufread::MultiGzDecoder::new(stream))
    } else if head.starts_with(b"BZh") {
        Box::new(bzip2::bufread::MultiBzDecoder::new(stream))
    } else if head.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0x00]) {
        Box::new(liblzma::bufread::XzDecoder::new_multi_decoder(stream))
    } else {
        Box::new(stream)
    };
    Ok(decoded)
}

/// A source's own failure carried through `io::Error` by a stream (a pipe command that
/// exited badly, an HTTP failure mid-stream), recovered as a [`ShardError`].
pub(crate) fn source_failure(error: &io::Error) -> Option<ShardError> {
    // `io::Error::source` skips the wrapped error itself, so unwrap with `get_ref`.
    let mut current: Option<&(dyn std::error::Error + 'static)> = error
        .get_ref()
        .map(|e| e as &(dyn std::error::Error + 'static));
    while let Some(e) = current {
        if let Some(pipe) = e.downcast_ref::<PipeFailure>() {
            return Some(pipe.to_shard_error());
        }
        if let Some(http) = e.downcast_ref::<crate::http::HttpFailure>() {
            return Some(http.to_shard_error());
        }
        current = match e.downcast_ref::<io::Error>() {
            Some(inner) => inner
                .get_ref()
                .map(|e| e as &(dyn std::error::Error + 'static)),
            None => e.source(),
        };
    }
    None
}

/// A list of shard URLs, from a brace spec, optionally under a base.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardList {
    pub urls: Vec<String>,
}

impl ShardList {
    /// Expands a spec such as `data/train-{000000..000146}.tar::extra-{0..3}.tar`.
    pub fn from_spec(spec: &str) -> Result<Self, BraceError> {
        Ok(Self {
            urls: expand_spec(spec)?,
        })
    }

    /// The training scripts' convention: a base such as `pipe:curl -s
    /// http://host:8080/%s` where each shard name replaces `%s`. A base without `%s` is
    /// a folder or URL prefix that the names are appended to (with a `/` if missing).
    pub fn from_base(base: &str, names_spec: &str) -> Result<Self, BraceError> {
        let names = expand_spec(names_spec)?;
        let urls = names
            .iter()
            .map(|name| {
                if base.contains("%s") {
                    base.replace("%s", name)
                } else if base.is_empty() || base.ends_with('/') {
                    format!("{base}{name}")
                } else {
                    format!("{base}/{name}")
                }
            })
            .collect();
        Ok(Self { urls })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_substitutes_or_joins() {
        let cases = [
            (
                "pipe:curl -s http://h:8080/%s",
                "a-{0..1}.tar",
                vec![
                    "pipe:curl -s http://h:8080/a-0.tar",
                    "pipe:curl -s http://h:8080/a-1.tar",
                ],
            ),
            ("/data", "x.tar", vec!["/data/x.tar"]),
            ("http://h/d/", "x.tar", vec!["http://h/d/x.tar"]),
            ("", "x.tar", vec!["x.tar"]),
        ];
        for (base, names, want) in cases {
            let got = ShardList::from_base(base, names).expect("valid spec").urls;
            assert_eq!(got, want, "base {base:?} names {names:?}");
        }
    }

    #[test]
    fn sources_are_chosen_by_url_form() {
        let sources = Sources::default();
        let cases = [
            ("pipe:cat x", "PipeSource"),
            ("http://h/x.tar", "HttpSource"),
            ("https://h/x.tar", "HttpSource"),
            ("-", "StdinSource"),
            ("file:/tmp/x.tar", "FileSource"),
            ("/tmp/x.tar", "FileSource"),
            ("rel/x.tar", "FileSource"),
        ];
        for (url, want) in cases {
            let found = sources
                .sources
                .iter()
                .find(|s| s.handles(url))
                .map(|s| format!("{s:?}"));
            let found = found.unwrap_or_default();
            assert!(
                found.starts_with(want),
                "{url}: chose {found}, wanted {want}"
            );
        }
    }

    #[test]
    fn unknown_scheme_is_refused() {
        let err = Sources::default().open("s3://bucket/x.tar").err();
        assert!(matches!(err, Some(ShardError::BadUrl { .. })), "{err:?}");
    }
}
