//! An optional local cache for remote shards (WebDataset's "preload to local SSD"):
//! filled on first read, checked against the declared size, bounded by LRU eviction.
//!
//! Only `http(s)://` URLs and `pipe:` commands are cached; local files and stdin never
//! are. The cache holds the bytes as the source gave them (maybe compressed), so a hit
//! goes through the same buffer and decompression as a remote read.
//!
//! An entry is one file, `<dir>/<tail>.<hash>.shard`, named by [`entry_name`]: a readable
//! tail of the URL plus a hash of the whole URL. A miss streams the source to the caller
//! through a [`Fill`], which writes the same bytes to a partial file with a name unique to
//! the process and the fill. Only a stream read to its end without error, whose length
//! matches what the source declared (HTTP `Content-Length`) and that fits the cache, is
//! synced to disk and renamed to the entry name; anything else removes the partial file.
//! The cache judges bytes, not samples: a stream that ends well is kept even if its tar
//! turns out bad, as the source would give the same bytes again.
//!
//! So an entry that exists is complete, with no sidecar to consult: entry names are only
//! ever created by `rename(2)` of a file whose data was already synced, and a rename is
//! atomic (a reader sees no file or the whole file, even across a crash). Two fills of the
//! same URL write different partial files and the last rename wins, replacing a complete
//! copy with an identical one. A process killed mid-fill leaves a partial file, which no
//! lookup ever opens (it has another name) and which [`ShardCache::new`] removes once it
//! has not been written to for [`STALE_PARTIAL`].
//!
//! Cache trouble (a folder that cannot be created or written, a full disk) never fails a
//! read: it is logged with the path, counted, and the shard is streamed uncached.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use crate::error::ShardError;
use crate::stream::{CacheOptions, ShardStream, Stored};

/// A partial file not written to for this long belongs to a fill that died: a live HTTP
/// fill writes at least once per read timeout. Should a live fill's file be removed
/// anyway (a command silent this long), its rename fails and the copy is not kept.
pub(crate) const STALE_PARTIAL: Duration = Duration::from_secs(10 * 60);

/// Ending of complete entries; only files named so are looked up and evicted.
const ENTRY_SUFFIX: &str = ".shard";
/// Ending of files being filled.
const PARTIAL_SUFFIX: &str = ".partial";
/// Most characters of the URL kept in an entry name.
const TAIL_CHARS: usize = 64;

/// Numbers the fills of this process, for unique partial names.
static FILLS: AtomicU64 = AtomicU64::new(0);

/// Counters of one [`Sources`](crate::Sources)' cache, updated by every stream it opens.
#[derive(Debug, Default)]
pub struct CacheStats {
    hits: AtomicU64,
    misses: AtomicU64,
    fills: AtomicU64,
    discarded: AtomicU64,
    evictions: AtomicU64,
    errors: AtomicU64,
}

/// What the cache has done so far (a snapshot of [`CacheStats`]).
///
/// Every miss whose source opened ends as one fill or one discard once its stream is
/// read to the end or dropped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheCounts {
    /// Opens served from a complete cached copy.
    pub hits: u64,
    /// Opens of cacheable URLs with no cached copy.
    pub misses: u64,
    /// Copies completed and kept.
    pub fills: u64,
    /// Misses whose bytes were not kept: the stream failed, was dropped before its end,
    /// did not match its declared length, was larger than the cache, or could not be
    /// written.
    pub discarded: u64,
    /// Complete copies removed to stay under the size limit.
    pub evictions: u64,
    /// Cache I/O failures, each logged with its path.
    pub errors: u64,
}

impl CacheStats {
    pub fn counts(&self) -> CacheCounts {
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        CacheCounts {
            hits: load(&self.hits),
            misses: load(&self.misses),
            fills: load(&self.fills),
            discarded: load(&self.discarded),
            evictions: load(&self.evictions),
            errors: load(&self.errors),
        }
    }

    fn add(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Whether shards at `url` are cached: remote ones only.
pub(crate) fn is_cacheable(url: &str) -> bool {
    url.starts_with("http://")
        || url.starts_with("https://")
        || crate::s3::is_object_url(url)
        || url.starts_with("pipe:")
}

/// The cache folder with its limit and counters.
#[derive(Debug)]
pub(crate) struct ShardCache {
    dir: PathBuf,
    max_bytes: u64,
    stats: Arc<CacheStats>,
}

impl ShardCache {
    /// Creates the folder when missing and removes partial files of dead fills. Failures
    /// are logged and counted; every open then streams uncached.
    pub(crate) fn new(options: &CacheOptions, stats: Arc<CacheStats>) -> Self {
        let cache = Self {
            dir: options.dir.clone(),
            max_bytes: options.max_bytes,
            stats,
        };
        match fs::create_dir_all(&cache.dir) {
            Ok(()) => cache.remove_stale_partials(SystemTime::now(), STALE_PARTIAL),
            Err(error) => cache.trouble(
                &cache.dir,
                &error,
                "cannot create the shard cache folder, reading uncached",
            ),
        }
        cache
    }

    /// Opens `url` from its cached copy, or through `open_source` (which also returns the
    /// declared length, if any) with the bytes copied into the cache as they are read.
    pub(crate) fn open(
        self: &Arc<Self>,
        url: &str,
        open_source: impl FnOnce() -> Result<(ShardStream, Option<u64>), ShardError>,
    ) -> Result<Stored, ShardError> {
        let name = entry_name(url);
        let entry = self.dir.join(&name);
        // Whether to try a fill on a miss: not when the folder cannot even be read.
        let usable = match File::open(&entry) {
            Ok(file) if file.metadata().is_ok_and(|m| m.is_file()) => {
                // The time of last use, for eviction. Failing to record it only makes
                // the entry look older than it is.
                if let Err(error) = file.set_modified(SystemTime::now()) {
                    tracing::debug!(path = %entry.display(), %error, "cannot touch cached shard");
                }
                CacheStats::add(&self.stats.hits);
                tracing::debug!(url, path = %entry.display(), "shard cache hit");
                return Ok(Stored::File(file));
            }
            // Not a file (a folder of that name, say): the rename will tell.
            Ok(_) => true,
            Err(error) if error.kind() == io::ErrorKind::NotFound => true,
            Err(error) => {
                self.trouble(&entry, &error, "cannot open cached shard, reading uncached");
                false
            }
        };
        CacheStats::add(&self.stats.misses);
        let (source, declared) = open_source()?;
        if !usable {
            CacheStats::add(&self.stats.discarded);
            return Ok(Stored::Stream(source));
        }
        if declared.is_some_and(|n| n > self.max_bytes) {
            tracing::debug!(url, declared, "shard larger than the cache, not kept");
            CacheStats::add(&self.stats.discarded);
            return Ok(Stored::Stream(source));
        }
        let fill = FILLS.fetch_add(1, Ordering::Relaxed);
        let partial = self.dir.join(format!(
            "{name}.{}-{fill}{PARTIAL_SUFFIX}",
            std::process::id()
        ));
        let file = match File::options().write(true).create_new(true).open(&partial) {
            Ok(file) => file,
            Err(error) => {
                self.trouble(
                    &partial,
                    &error,
                    "cannot write to the shard cache, reading uncached",
                );
                CacheStats::add(&self.stats.discarded);
                return Ok(Stored::Stream(source));
            }
        };
        Ok(Stored::Stream(Box::new(Fill {
            cache: Arc::clone(self),
            url: url.to_string(),
            source,
            declared,
            written: 0,
            partial: Some((partial, file)),
            entry,
        })))
    }

    /// Removes least recently used entries until the complete ones fit `max_bytes`,
    /// never `keep` (the entry just written).
    fn evict(&self, keep: &Path) {
        let mut entries = match self.entries() {
            Ok(entries) => entries,
            Err(error) => {
                return self.trouble(
                    &self.dir,
                    &error,
                    "cannot list the shard cache, nothing evicted",
                );
            }
        };
        let mut total: u64 = entries.iter().map(|e| e.size).sum();
        if total <= self.max_bytes {
            return;
        }
        entries.sort_by(|a, b| (a.used, &a.path).cmp(&(b.used, &b.path)));
        for entry in entries {
            if total <= self.max_bytes {
                break;
            }
            if entry.path == keep {
                continue;
            }
            match fs::remove_file(&entry.path) {
                Ok(()) => {
                    CacheStats::add(&self.stats.evictions);
                    tracing::debug!(path = %entry.path.display(), size = entry.size, "evicted cached shard");
                    total -= entry.size;
                }
                // Another process evicted it first.
                Err(error) if error.kind() == io::ErrorKind::NotFound => total -= entry.size,
                Err(error) => self.trouble(&entry.path, &error, "cannot evict cached shard"),
            }
        }
    }

    /// The complete entries with their sizes and times of last use.
    fn entries(&self) -> io::Result<Vec<Entry>> {
        let mut entries = Vec::new();
        for item in fs::read_dir(&self.dir)? {
            let item = item?;
            if !item.file_name().to_string_lossy().ends_with(ENTRY_SUFFIX) {
                continue;
            }
            // Gone since the listing: another process evicted it.
            let Ok(meta) = item.metadata() else { continue };
            if meta.is_file() {
                entries.push(Entry {
                    path: item.path(),
                    size: meta.len(),
                    used: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                });
            }
        }
        Ok(entries)
    }

    /// Removes partial files last written more than `age` before `now`.
    fn remove_stale_partials(&self, now: SystemTime, age: Duration) {
        let Ok(listing) = fs::read_dir(&self.dir) else {
            return;
        };
        for item in listing.flatten() {
            if !item.file_name().to_string_lossy().ends_with(PARTIAL_SUFFIX) {
                continue;
            }
            let written = item.metadata().and_then(|m| m.modified());
            let stale = written.is_ok_and(|t| now.duration_since(t).is_ok_and(|d| d > age));
            if stale {
                let path = item.path();
                match fs::remove_file(&path) {
                    Ok(()) => {
                        tracing::debug!(path = %path.display(), "removed stale partial shard")
                    }
                    Err(error) if error.kind() == io::ErrorKind::NotFound => {}
                    Err(error) => self.trouble(&path, &error, "cannot remove stale partial shard"),
                }
            }
        }
    }

    /// Logs and counts a cache I/O failure; the read goes on.
    fn trouble(&self, path: &Path, error: &io::Error, what: &'static str) {
        CacheStats::add(&self.stats.errors);
        tracing::warn!(path = %path.display(), %error, "{what}");
    }
}

/// The file name of `url`'s entry: the last characters of the URL with anything but
/// ASCII letters, digits, `.` and `-` made `_`, then a 64-bit FNV-1a hash of the whole
/// URL, so URLs that share a tail never share an entry. FNV-1a is fixed by its
/// definition, so names stay the same across builds and processes.
pub(crate) fn entry_name(url: &str) -> String {
    let mut safe = String::with_capacity(url.len());
    for c in url.chars() {
        let c = if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
            c
        } else {
            '_'
        };
        if !(c == '_' && safe.ends_with('_')) {
            safe.push(c);
        }
    }
    // All ASCII now, so any byte index is a character boundary.
    let tail = &safe[safe.len().saturating_sub(TAIL_CHARS)..];
    let tail = tail
        .trim_start_matches(['_', '.', '-'])
        .trim_end_matches('_');
    let tail = if tail.is_empty() { "shard" } else { tail };
    let hash = url.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{tail}.{hash:016x}{ENTRY_SUFFIX}")
}

/// A complete entry, for eviction.
struct Entry {
    path: PathBuf,
    size: u64,
    used: SystemTime,
}

/// A source stream on a miss: gives the caller the bytes and writes them to a partial
/// file, renamed to the entry when the stream ends well and removed otherwise.
struct Fill {
    cache: Arc<ShardCache>,
    url: String,
    source: ShardStream,
    declared: Option<u64>,
    written: u64,
    /// The partial file; `None` once kept or given up.
    partial: Option<(PathBuf, File)>,
    entry: PathBuf,
}

impl Read for Fill {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = match self.source.read(buf) {
            Ok(n) => n,
            Err(error) => {
                if error.kind() != io::ErrorKind::Interrupted {
                    self.discard("the source failed");
                }
                return Err(error);
            }
        };
        if n == 0 {
            if !buf.is_empty() {
                self.finish();
            }
        } else {
            self.keep(&buf[..n]);
        }
        Ok(n)
    }
}

impl Fill {
    fn keep(&mut self, bytes: &[u8]) {
        let Some((path, file)) = &mut self.partial else {
            return;
        };
        let total = self.written + bytes.len() as u64;
        if total > self.cache.max_bytes {
            return self.discard("larger than the cache");
        }
        if let Err(error) = file.write_all(bytes) {
            let path = path.clone();
            self.cache.trouble(
                &path,
                &error,
                "cannot write to the shard cache, reading uncached",
            );
            return self.discard("write failed");
        }
        self.written = total;
    }

    /// The source ended well: keep the copy if it is whole.
    fn finish(&mut self) {
        let filling = self.partial.is_some();
        if let Some(declared) = self.declared.filter(|&n| filling && n != self.written) {
            tracing::warn!(
                url = %self.url,
                declared,
                read = self.written,
                "shard length differs from the declared one, not cached"
            );
            return self.discard("length mismatch");
        }
        let Some((path, file)) = self.partial.take() else {
            return;
        };
        // Data first, then the name: an entry that exists is complete even after a
        // crash. The time is set here (and on every hit) from one clock for LRU order.
        let kept = file
            .set_modified(SystemTime::now())
            .and_then(|()| file.sync_all())
            .and_then(|()| fs::rename(&path, &self.entry));
        drop(file);
        match kept {
            Ok(()) => {
                CacheStats::add(&self.cache.stats.fills);
                tracing::debug!(url = %self.url, path = %self.entry.display(), bytes = self.written, "shard cached");
                self.cache.evict(&self.entry);
            }
            Err(error) => {
                self.cache
                    .trouble(&path, &error, "cannot complete cached shard, not kept");
                CacheStats::add(&self.cache.stats.discarded);
                remove_partial(&path);
            }
        }
    }

    fn discard(&mut self, reason: &'static str) {
        if let Some((path, file)) = self.partial.take() {
            drop(file);
            remove_partial(&path);
            CacheStats::add(&self.cache.stats.discarded);
            tracing::debug!(url = %self.url, reason, "shard not cached");
        }
    }
}

impl Drop for Fill {
    fn drop(&mut self) {
        self.discard("the stream was dropped before its end");
    }
}

fn remove_partial(path: &Path) {
    match fs::remove_file(path) {
        Ok(()) => {}
        Err(error) if error.kind() == io::ErrorKind::NotFound => {}
        // Left for the stale-partial cleanup; it is never read.
        Err(error) => tracing::warn!(path = %path.display(), %error, "cannot remove partial shard"),
    }
}

#[cfg(test)]
mod tests {
    use std::io::Cursor;

    use super::*;

    /// A source that yields `bytes` and then fails with `error` if set.
    struct Scripted {
        bytes: Cursor<Vec<u8>>,
        error: Option<io::ErrorKind>,
    }

    impl Read for Scripted {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = self.bytes.read(buf)?;
            match self.error {
                Some(kind) if n == 0 => Err(io::Error::new(kind, "scripted failure")),
                _ => Ok(n),
            }
        }
    }

    fn cache(dir: &Path, max_bytes: u64) -> Arc<ShardCache> {
        let options = CacheOptions {
            dir: dir.to_path_buf(),
            max_bytes,
        };
        Arc::new(ShardCache::new(&options, Arc::default()))
    }

    /// Opens `url` through `cache` from a scripted source and reads it to the end,
    /// returning what was read (or the read error) and whether the source was asked.
    fn read_through(
        cache: &Arc<ShardCache>,
        url: &str,
        bytes: &[u8],
        declared: Option<u64>,
        error: Option<io::ErrorKind>,
    ) -> (io::Result<Vec<u8>>, bool) {
        let mut asked = false;
        let opened = cache.open(url, || {
            asked = true;
            let source = Scripted {
                bytes: Cursor::new(bytes.to_vec()),
                error,
            };
            Ok((Box::new(source) as ShardStream, declared))
        });
        let mut stream = match opened {
            Ok(stream) => stream,
            Err(error) => return (Err(io::Error::other(error)), asked),
        };
        let mut got = Vec::new();
        let read = stream.read_to_end(&mut got).map(|_| got);
        (read, asked)
    }

    /// Names of the files in `dir`, sorted.
    fn files(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .map(|listing| {
                listing
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    }

    #[test]
    fn entry_names_are_readable_stable_and_distinct() {
        let cases = [
            (
                "http://h:8080/data/train-000001.tar",
                "http_h_8080_data_train-000001.tar.",
            ),
            (
                "pipe:curl -s 'http://h/a b.tar'",
                "pipe_curl_-s_http_h_a_b.tar.",
            ),
            ("pipe:///", "pipe."),
            ("//", "shard."),
        ];
        for (url, prefix) in cases {
            let name = entry_name(url);
            assert!(name.starts_with(prefix), "{url}: {name}");
            assert!(name.ends_with(ENTRY_SUFFIX), "{url}: {name}");
            assert_eq!(name, entry_name(url), "{url}: stable");
        }
        // The hash is pinned: changing it orphans every existing cache.
        assert_eq!(entry_name("pipe:x"), "pipe_x.fb5c4d9f532088f3.shard");
        // A long URL keeps its tail, and the same tail under two URLs gives two names.
        let a = format!("http://a/{}/train-000001.tar", "x".repeat(100));
        let b = format!("http://b/{}/train-000001.tar", "x".repeat(100));
        let (name_a, name_b) = (entry_name(&a), entry_name(&b));
        assert!(name_a.len() < 100, "{name_a}");
        assert!(name_a.contains("x_train-000001.tar."), "{name_a}");
        assert_ne!(name_a, name_b);
    }

    #[test]
    fn only_remote_urls_are_cacheable() {
        let cases = [
            ("http://h/x.tar", true),
            ("https://h/x.tar", true),
            ("pipe:cat x.tar", true),
            ("x.tar", false),
            ("/data/x.tar", false),
            ("file:/data/x.tar", false),
            ("s3://bucket/x.tar", true),
            ("-", false),
        ];
        for (url, want) in cases {
            assert_eq!(is_cacheable(url), want, "{url}");
        }
    }

    /// What one scripted read leaves behind.
    struct Case {
        name: &'static str,
        bytes: Vec<u8>,
        declared: Option<u64>,
        error: Option<io::ErrorKind>,
        max_bytes: u64,
        /// Whether the copy is kept (and so a second read is a hit).
        kept: bool,
    }

    #[test]
    fn only_whole_matching_streams_are_kept() {
        let bytes: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
        let len = bytes.len() as u64;
        let cases = [
            Case {
                name: "declared length matches",
                bytes: bytes.clone(),
                declared: Some(len),
                error: None,
                max_bytes: 1 << 20,
                kept: true,
            },
            Case {
                name: "nothing declared",
                bytes: bytes.clone(),
                declared: None,
                error: None,
                max_bytes: 1 << 20,
                kept: true,
            },
            Case {
                name: "exactly the cache size",
                bytes: bytes.clone(),
                declared: None,
                error: None,
                max_bytes: len,
                kept: true,
            },
            Case {
                name: "declared more than read",
                bytes: bytes.clone(),
                declared: Some(len + 1),
                error: None,
                max_bytes: 1 << 20,
                kept: false,
            },
            Case {
                name: "declared less than read",
                bytes: bytes.clone(),
                declared: Some(len - 1),
                error: None,
                max_bytes: 1 << 20,
                kept: false,
            },
            Case {
                name: "source fails at the end",
                bytes: bytes.clone(),
                declared: None,
                error: Some(io::ErrorKind::ConnectionReset),
                max_bytes: 1 << 20,
                kept: false,
            },
            Case {
                name: "larger than the cache",
                bytes: bytes.clone(),
                declared: None,
                error: None,
                max_bytes: len - 1,
                kept: false,
            },
            Case {
                name: "declared larger than the cache",
                bytes: bytes.clone(),
                declared: Some(len),
                error: None,
                max_bytes: len - 1,
                kept: false,
            },
        ];
        for case in cases {
            let dir = tempfile::tempdir().expect("temp dir");
            let cache = cache(dir.path(), case.max_bytes);
            let url = "pipe:scripted";
            let (first, asked) = read_through(&cache, url, &case.bytes, case.declared, case.error);
            assert!(asked, "{}: first read asks the source", case.name);
            match (case.error, first) {
                (None, Ok(got)) => assert!(got == case.bytes, "{}: bytes", case.name),
                (Some(kind), Err(error)) => assert_eq!(error.kind(), kind, "{}", case.name),
                (_, other) => panic!("{}: first read gave {other:?}", case.name),
            }
            let want_files = if case.kept {
                vec![entry_name(url)]
            } else {
                vec![]
            };
            assert_eq!(files(dir.path()), want_files, "{}: files", case.name);
            let (second, asked) = read_through(&cache, url, b"other", None, None);
            let second = second.unwrap_or_else(|e| panic!("{}: second read: {e}", case.name));
            assert_eq!(
                asked, !case.kept,
                "{}: second read asks the source",
                case.name
            );
            let want = if case.kept { &case.bytes[..] } else { b"other" };
            assert!(second == want, "{}: second read's bytes", case.name);
            let counts = cache.stats.counts();
            assert_eq!(
                (counts.hits, counts.fills + counts.discarded, counts.errors),
                (u64::from(case.kept), 2 - u64::from(case.kept), 0),
                "{}: {counts:?}",
                case.name
            );
        }
    }

    #[test]
    fn a_stream_dropped_early_leaves_nothing() {
        let dir = tempfile::tempdir().expect("temp dir");
        let cache = cache(dir.path(), 1 << 20);
        let mut stream = cache
            .open("pipe:x", || {
                let source = Cursor::new(vec![7u8; 10_000]);
                Ok((Box::new(source) as ShardStream, Some(10_000)))
            })
            .expect("open");
        let mut some = [0u8; 100];
        stream.read_exact(&mut some).expect("read some");
        assert_eq!(files(dir.path()).len(), 1, "a partial file while filling");
        drop(stream);
        assert_eq!(files(dir.path()), Vec::<String>::new());
        let counts = cache.stats.counts();
        assert_eq!((counts.misses, counts.discarded), (1, 1), "{counts:?}");
    }

    #[test]
    fn a_failed_open_caches_nothing() {
        let dir = tempfile::tempdir().expect("temp dir");
        let cache = cache(dir.path(), 1 << 20);
        let opened = cache.open("http://h/x.tar", || {
            Err(ShardError::HttpStatus {
                url: "http://h/x.tar".to_string(),
                status: 404,
            })
        });
        assert!(matches!(
            opened,
            Err(ShardError::HttpStatus { status: 404, .. })
        ));
        assert_eq!(files(dir.path()), Vec::<String>::new());
    }

    #[test]
    fn least_recently_used_entries_are_evicted_first() {
        let dir = tempfile::tempdir().expect("temp dir");
        // Room for two 1000-byte entries.
        let cache = cache(dir.path(), 2500);
        let bytes = vec![1u8; 1000];
        for url in ["pipe:a", "pipe:b"] {
            let (read, _) = read_through(&cache, url, &bytes, None, None);
            read.expect("fill");
        }
        // `a` used again, so `b` is the least recently used when `c` comes.
        let (_, asked) = read_through(&cache, "pipe:a", &bytes, None, None);
        assert!(!asked, "a is a hit");
        let (read, _) = read_through(&cache, "pipe:c", &bytes, None, None);
        read.expect("fill");
        let mut want = vec![entry_name("pipe:a"), entry_name("pipe:c")];
        want.sort();
        assert_eq!(files(dir.path()), want);
        assert_eq!(cache.stats.counts().evictions, 1);
    }

    #[test]
    fn stale_partial_files_are_removed_on_start() {
        let dir = tempfile::tempdir().expect("temp dir");
        let now = SystemTime::now();
        let cases = [
            ("x.shard.1-0.partial", STALE_PARTIAL * 2, false),
            ("x.shard.1-1.partial", Duration::ZERO, true),
            // Not a partial file: left alone however old.
            ("notes.txt", STALE_PARTIAL * 2, true),
        ];
        for (name, age, _) in &cases {
            let file = File::create(dir.path().join(name)).expect("create");
            file.set_modified(now - *age).expect("set time");
        }
        let _cache = cache(dir.path(), 1 << 20);
        for (name, _, kept) in cases {
            assert_eq!(dir.path().join(name).exists(), kept, "{name}");
        }
    }

    #[test]
    fn an_unusable_cache_folder_streams_uncached() {
        let dir = tempfile::tempdir().expect("temp dir");
        let blocker = dir.path().join("file");
        fs::write(&blocker, b"not a folder").expect("write");
        // Under a regular file, so no user (not even root) can create it.
        let cache = cache(&blocker.join("cache"), 1 << 20);
        for _ in 0..2 {
            let (read, asked) = read_through(&cache, "pipe:x", b"bytes", None, None);
            assert_eq!(read.expect("read").as_slice(), b"bytes");
            assert!(asked);
        }
        let counts = cache.stats.counts();
        assert_eq!((counts.hits, counts.fills), (0, 0), "{counts:?}");
        assert!(counts.errors >= 2, "{counts:?}");
    }
}
