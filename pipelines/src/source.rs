//! Where shard bytes come from: [`Sources`], which picks a source by the form of the URL
//! (local files, `http(s)://`, `pipe:` commands, stdin) and puts transparent
//! gzip/bzip2/xz decompression in front. Above the sources (`http.rs`, `pipe.rs`) and the
//! cache, which share only the leaf `stream.rs` with it.

use std::fmt;
use std::fs;
use std::io::{self, BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::brace::{BraceError, expand_spec};
use crate::cache::{self, CacheStats, ShardCache};
use crate::error::{ShardError, escaped, one_line};
use crate::http::HttpSource;
use crate::members::TarRead;
use crate::pipe::{PipeFailure, PipeSource};
use crate::s3::{ObjectFailure, S3Source};
use crate::shard_name::shard_name;
use crate::stream::{ShardSource, ShardStream, SourceCounts, SourceKind, SourceOptions, Stored};

/// The buffer that finds a stream's compression from its first bytes. Small, because an
/// uncompressed stream keeps it: once drained, reads at least this large pass it by.
const PEEK_BUFFER: usize = 8 << 10;

/// A shard's tar bytes, decompressed: what the reader walks.
pub(crate) enum TarStream {
    /// An uncompressed local file: the bytes read to find its format (`head`, of which
    /// `used` have been read), then the rest of the file. Member data is read from it
    /// into a sample's memory as it is, without zeroing it first.
    File {
        head: Vec<u8>,
        used: usize,
        file: std::fs::File,
    },
    /// Any other stream: a decoder, or a remote or piped source.
    Other(ShardStream),
}

impl fmt::Debug for TarStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::File { file, .. } => f.debug_tuple("File").field(file).finish(),
            Self::Other(_) => f.write_str("Other"),
        }
    }
}

impl Read for TarStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::File { head, used, .. } if *used < head.len() => {
                let n = buf.len().min(head.len() - *used);
                buf[..n].copy_from_slice(&head[*used..*used + n]);
                *used += n;
                Ok(n)
            }
            Self::File { file, .. } => file.read(buf),
            Self::Other(stream) => stream.read(buf),
        }
    }
}

impl TarRead for TarStream {
    fn read_spare(&mut self, out: &mut Vec<u8>) -> Option<io::Result<usize>> {
        match self {
            Self::File { head, used, .. } if *used < head.len() => {
                let n = (out.capacity() - out.len()).min(head.len() - *used);
                out.extend_from_slice(&head[*used..*used + n]);
                *used += n;
                Some(Ok(n))
            }
            Self::File { file, .. } => Some(
                rustix::io::read(&*file, rustix::buffer::spare_capacity(out)).map_err(Into::into),
            ),
            Self::Other(_) => None,
        }
    }
}

/// All sources, chosen by the form of the URL.
#[derive(Debug)]
pub struct Sources {
    options: SourceOptions,
    sources: Vec<Box<dyn ShardSource>>,
    cache: Option<Arc<ShardCache>>,
    cache_stats: Arc<CacheStats>,
    /// Shards opened and failed to open, by [`SourceKind`] (in [`SourceKind::ALL`]'s
    /// order).
    opened: [AtomicU64; SourceKind::ALL.len()],
    failed: [AtomicU64; SourceKind::ALL.len()],
}

impl Default for Sources {
    fn default() -> Self {
        Self::new(SourceOptions::default())
    }
}

impl Sources {
    /// The built-in sources: `pipe:`, `http(s)://`, `s3://`, `-` (stdin), `file:` and
    /// paths.
    /// With a cache configured, its folder is created and stale partial files from dead
    /// fills are removed here.
    pub fn new(options: SourceOptions) -> Self {
        let sources: Vec<Box<dyn ShardSource>> = vec![
            Box::new(PipeSource::new(&options)),
            Box::new(HttpSource::new(&options)),
            Box::new(S3Source::new(&options)),
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
            opened: Default::default(),
            failed: Default::default(),
        }
    }

    /// The shards opened here so far, by kind of source, and the cache's counters.
    pub fn counts(&self) -> SourceCounts {
        let by_kind = |counters: &[AtomicU64; SourceKind::ALL.len()]| {
            SourceKind::ALL
                .iter()
                .zip(counters)
                .map(|(kind, n)| (kind.name().to_string(), n.load(Ordering::Relaxed)))
                .filter(|(_, n)| *n > 0)
                .collect()
        };
        let cache = self.cache_stats.counts();
        SourceCounts {
            opened: by_kind(&self.opened),
            failed: by_kind(&self.failed),
            cache_hits: cache.hits,
            cache_misses: cache.misses,
        }
    }

    /// Counts an open through a source of `kind`, and hands its result on.
    fn counted<T>(&self, kind: SourceKind, result: Result<T, ShardError>) -> Result<T, ShardError> {
        let index = SourceKind::ALL
            .iter()
            .position(|k| *k == kind)
            .unwrap_or_default();
        let counters = if result.is_ok() {
            &self.opened
        } else {
            &self.failed
        };
        counters[index].fetch_add(1, Ordering::Relaxed);
        result
    }

    pub fn options(&self) -> &SourceOptions {
        &self.options
    }

    /// The cache's counters (all zero without a cache), shared with every stream opened
    /// here: a loader may keep a clone and report them.
    pub fn cache_stats(&self) -> Arc<CacheStats> {
        Arc::clone(&self.cache_stats)
    }

    /// Opens a shard and returns its tar bytes, decompressed (behind the read buffer)
    /// when the stream starts with a gzip, bzip2 or xz signature. With a cache, a remote shard
    /// comes from its cached copy when there is one, and is copied into the cache as it
    /// is read otherwise.
    pub fn open(&self, url: &str) -> Result<ShardStream, ShardError> {
        Ok(Box::new(self.open_tar(url)?))
    }

    /// [`open`](Self::open), keeping a local file a file: what the reader walks.
    pub(crate) fn open_tar(&self, url: &str) -> Result<TarStream, ShardError> {
        if let Some(dir) = &self.options.preloaded
            && let Some(copy) = preloaded_copy(dir, url)
        {
            let file = std::fs::File::open(&copy).map_err(|error| ShardError::Open {
                url: format!("{url} (its preloaded copy {})", copy.display()),
                error,
            });
            let file = self.counted(SourceKind::Preloaded, file)?;
            return decompress(url, Stored::File(file), self.options.read_buffer);
        }
        let source = self
            .sources
            .iter()
            .find(|s| s.handles(url))
            .ok_or_else(|| ShardError::BadUrl {
                url: url.to_string(),
                reason: "no source handles this URL".to_string(),
            })?;
        let raw = match &self.cache {
            Some(cache) if cache::is_cacheable(url) => cache.open(url, || source.open_sized(url)),
            _ => match source.open_file(url) {
                Some(file) => file.map(Stored::File),
                None => source.open(url).map(Stored::Stream),
            },
        };
        let raw = self.counted(source.kind(), raw)?;
        decompress(url, raw, self.options.read_buffer)
    }
}

impl Sources {
    /// Opens a shard as its source stores it (maybe compressed), bypassing the cache and
    /// any preloaded copy, with the length the source declares up front when it does
    /// (an HTTP `Content-Length`): what a preload copies.
    pub fn open_stored(&self, url: &str) -> Result<(ShardStream, Option<u64>), ShardError> {
        let source = self
            .sources
            .iter()
            .find(|s| s.handles(url))
            .ok_or_else(|| ShardError::BadUrl {
                url: url.to_string(),
                reason: "no source handles this URL".to_string(),
            })?;
        source.open_sized(url)
    }

    /// `urls` with every `s3://` pattern (`*` or `?` in the key's last part:
    /// `s3://bucket/train/shard-*.tar`) replaced by the objects it matches, in key order.
    /// A pattern that matches nothing is an error naming it.
    pub fn expand_patterns(&self, urls: Vec<String>) -> Result<Vec<String>, ShardError> {
        if !urls.iter().any(|url| crate::s3::is_pattern(url)) {
            return Ok(urls);
        }
        let s3 = S3Source::new(&self.options);
        let mut expanded = Vec::with_capacity(urls.len());
        for url in urls {
            if !crate::s3::is_pattern(&url) {
                expanded.push(url);
                continue;
            }
            let matched = s3.list(&url)?;
            if matched.is_empty() {
                return Err(ShardError::BadUrl {
                    url,
                    reason: "the pattern matches no object".to_string(),
                });
            }
            expanded.extend(matched);
        }
        Ok(expanded)
    }
}

/// The local file a shard URL names: a plain path, or a `file:` / `file://` URL. None
/// for `http(s)://`, `s3://`, `pipe:` and standard input (`-`). The one rule for which shards are
/// local, for every command.
pub fn local_path(url: &str) -> Option<&std::path::Path> {
    if url == "-" || url.starts_with("pipe:") {
        return None;
    }
    let path = match url
        .strip_prefix("file://")
        .or_else(|| url.strip_prefix("file:"))
    {
        Some(path) => path,
        None if url.contains("://") => return None,
        None => url,
    };
    Some(std::path::Path::new(path))
}

/// The folder of a local shard (`.` for a bare file name).
pub fn local_folder(url: &str) -> Option<&std::path::Path> {
    let path = local_path(url)?;
    Some(match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => std::path::Path::new("."),
    })
}

/// Local files: plain paths and `file:` / `file://` URLs.
#[derive(Debug)]
struct FileSource;

impl ShardSource for FileSource {
    fn kind(&self) -> SourceKind {
        SourceKind::File
    }

    fn handles(&self, url: &str) -> bool {
        !url.contains("://") || url.starts_with("file:")
    }

    fn open(&self, url: &str) -> Result<ShardStream, ShardError> {
        Ok(Box::new(open_local(url)?))
    }

    fn open_file(&self, url: &str) -> Option<Result<std::fs::File, ShardError>> {
        Some(open_local(url))
    }
}

/// The local file a URL names, opened.
fn open_local(url: &str) -> Result<std::fs::File, ShardError> {
    let path = local_path(url).unwrap_or(std::path::Path::new(url));
    std::fs::File::open(path).map_err(|error| ShardError::Open {
        url: url.to_string(),
        error,
    })
}

/// `-`: the process's standard input.
#[derive(Debug)]
struct StdinSource;

impl ShardSource for StdinSource {
    fn kind(&self) -> SourceKind {
        SourceKind::Stdin
    }

    fn handles(&self, url: &str) -> bool {
        url == "-"
    }

    fn open(&self, _url: &str) -> Result<ShardStream, ShardError> {
        Ok(Box::new(io::stdin()))
    }
}

/// Compression detected from the first bytes of a stream. A compressed stream's decoder
/// reads through a buffer of `read_buffer` bytes; an uncompressed one is returned behind
/// only the small buffer that looked at its start (a local file: the bytes that were read
/// from it to look).
fn decompress(url: &str, raw: Stored, read_buffer: usize) -> Result<TarStream, ShardError> {
    let stream = match raw {
        Stored::File(mut file) => {
            let mut head = vec![0; PEEK_BUFFER];
            let n = loop {
                match file.read(&mut head) {
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    result => break result.map_err(|e| classify(url, 0, e))?,
                }
            };
            head.truncate(n);
            let Some(compression) = Compression::of(&head) else {
                return Ok(TarStream::File {
                    head,
                    used: 0,
                    file,
                });
            };
            let bytes = io::Cursor::new(head).chain(file);
            compression.decoder(BufReader::with_capacity(read_buffer, bytes))
        }
        Stored::Stream(raw) => {
            let mut stream = BufReader::with_capacity(PEEK_BUFFER, raw);
            let head = stream.fill_buf().map_err(|e| classify(url, 0, e))?;
            match Compression::of(head) {
                Some(compression) => {
                    compression.decoder(BufReader::with_capacity(read_buffer, stream))
                }
                None => Box::new(stream),
            }
        }
    };
    Ok(TarStream::Other(stream))
}

/// The compressions a shard may come in, known by their first bytes.
#[derive(Debug, Clone, Copy)]
enum Compression {
    Gzip,
    Bzip2,
    Xz,
}

impl Compression {
    fn of(head: &[u8]) -> Option<Self> {
        if head.starts_with(&[0x1f, 0x8b]) {
            Some(Self::Gzip)
        } else if head.starts_with(b"BZh") {
            Some(Self::Bzip2)
        } else if head.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0x00]) {
            Some(Self::Xz)
        } else {
            None
        }
    }

    /// The decoder of `stream`, which is behind the read buffer.
    fn decoder<R: BufRead + Send + 'static>(self, stream: R) -> ShardStream {
        match self {
            Self::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(stream)),
            Self::Bzip2 => Box::new(bzip2::bufread::MultiBzDecoder::new(stream)),
            Self::Xz => Box::new(liblzma::bufread::XzDecoder::new_multi_decoder(stream)),
        }
    }
}

/// Turns an I/O error from the tar layer into a shard error, keeping a source's own
/// error (a failed pipe command, an HTTP failure) when there is one underneath.
pub(crate) fn classify(url: &str, offset: u64, error: io::Error) -> ShardError {
    if let Some(source_error) = source_failure(&error) {
        return source_error;
    }
    match error.kind() {
        io::ErrorKind::InvalidData
        | io::ErrorKind::UnexpectedEof
        | io::ErrorKind::Other
        | io::ErrorKind::InvalidInput => ShardError::Corrupt {
            url: url.to_string(),
            offset,
            reason: escaped(one_line(&error).as_bytes()),
        },
        _ => ShardError::Read {
            url: url.to_string(),
            offset,
            error,
        },
    }
}

/// The local copy of `url` in `dir`, and its record of where it came from.
pub fn preloaded_path(dir: &Path, url: &str) -> PathBuf {
    dir.join(shard_name(url))
}

pub(crate) fn source_record(copy: &Path) -> PathBuf {
    let mut name = copy.as_os_str().to_owned();
    name.push(".source");
    PathBuf::from(name)
}

/// The local copy of `url`, when one made from that URL is in `dir`.
pub fn preloaded_copy(dir: &Path, url: &str) -> Option<PathBuf> {
    let copy = preloaded_path(dir, url);
    let from = fs::read_to_string(source_record(&copy)).ok()?;
    (from == url && copy.is_file()).then_some(copy)
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
        if let Some(object) = e.downcast_ref::<ObjectFailure>() {
            return Some(object.to_shard_error());
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

/// A spec that cannot be expanded, or a base that cannot apply to its names.
#[derive(Debug, thiserror::Error)]
pub enum ShardListError {
    #[error(transparent)]
    Spec(#[from] BraceError),
    #[error("base `{base}` cannot apply to `{name}`: {reason}")]
    Base {
        base: String,
        name: String,
        reason: String,
    },
}

impl ShardList {
    /// Expands a spec such as `data/train-{000000..000146}.tar::extra-{0..3}.tar`.
    pub fn from_spec(spec: &str) -> Result<Self, BraceError> {
        Ok(Self {
            urls: expand_spec(spec)?,
        })
    }

    /// Expands `spec` and puts each name under `base`, the rule of training scripts
    /// written for Python webdataset (`--base='pipe:gsutil cat gs://bucket/%s'`,
    /// `--base='pipe:curl -s http://host:8080/'`): the name goes where the base's `%s`
    /// is, or after the base when it has none: directly when the base ends with `/` or a
    /// space, after a `/` for a folder or URL prefix. An empty base leaves the names as
    /// they are.
    ///
    /// A base that cannot apply is an error, never ignored: a name that is already a full
    /// URL, `pipe:` command, absolute path or `-`; a `%s` in the spec (the base holds it);
    /// a base with more than one `%s`; a `pipe:` base with no `%s` that does not end with
    /// `/` or a space (where the name goes in the command would be a guess).
    pub fn from_spec_with_base(spec: &str, base: &str) -> Result<Self, ShardListError> {
        let names = expand_spec(spec)?;
        if base.is_empty() {
            return Ok(Self { urls: names });
        }
        let refuse = |name: &str, reason: String| ShardListError::Base {
            base: base.to_string(),
            name: name.to_string(),
            reason,
        };
        if spec.contains("%s") {
            return Err(refuse(
                spec,
                "the spec holds `%s`; the base does (each name from the spec goes where \
                 the base's `%s` is)"
                    .to_string(),
            ));
        }
        let slots = base.matches("%s").count();
        if slots > 1 {
            return Err(refuse(
                spec,
                format!("the base holds `%s` {slots} times; it takes one"),
            ));
        }
        let is_pipe = base.starts_with("pipe:");
        if slots == 0 && is_pipe && !base.ends_with('/') && !base.ends_with(char::is_whitespace) {
            return Err(refuse(
                spec,
                "a `pipe:` base without `%s` must end with `/` or a space; put `%s` where \
                 each shard name goes (e.g. `pipe:cat /data/%s`)"
                    .to_string(),
            ));
        }
        let urls = names
            .into_iter()
            .map(|name| {
                if let Some(form) = full_location(&name) {
                    return Err(refuse(
                        &name,
                        format!(
                            "the name is already {form}; give names relative to the base, \
                             or no base"
                        ),
                    ));
                }
                Ok(if slots == 1 {
                    base.replacen("%s", &name, 1)
                } else if is_pipe || base.ends_with('/') {
                    format!("{base}{name}")
                } else {
                    format!("{base}/{name}")
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { urls })
    }
}

/// What kind of complete location `name` is, if it is one a base cannot go in front of.
fn full_location(name: &str) -> Option<&'static str> {
    if name == "-" {
        Some("standard input (`-`)")
    } else if name.starts_with("pipe:") {
        Some("a `pipe:` command")
    } else if name.contains("://") || name.starts_with("file:") {
        Some("a full URL")
    } else if name.starts_with('/') {
        Some("an absolute path")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The base rule: `(base, spec, Ok(urls) or Err(words the error holds))`.
    #[test]
    fn local_shards_are_paths_and_file_urls() {
        let cases = [
            ("data/a.tar", Some("data/a.tar"), Some("data")),
            ("a.tar", Some("a.tar"), Some(".")),
            ("file:/d/a.tar", Some("/d/a.tar"), Some("/d")),
            ("file:///d/a.tar", Some("/d/a.tar"), Some("/d")),
            ("http://h/a.tar", None, None),
            ("pipe:cat a.tar", None, None),
            ("-", None, None),
        ];
        for (url, path, folder) in cases {
            let as_str = |p: Option<&std::path::Path>| p.map(|p| p.display().to_string());
            assert_eq!(as_str(local_path(url)), path.map(String::from), "{url}");
            assert_eq!(as_str(local_folder(url)), folder.map(String::from), "{url}");
        }
    }

    #[test]
    fn bases_take_each_name_where_their_percent_s_is_or_after_them() {
        let ok = |urls: &[&str]| Ok::<_, &str>(urls.iter().map(|u| u.to_string()).collect());
        // (base, spec, the URLs or words of the error)
        type Case<'a> = (&'a str, &'a str, Result<Vec<String>, &'a str>);
        let cases: Vec<Case> = vec![
            (
                "pipe:gsutil cat gs://bucket/%s",
                "a-{0..1}.tar",
                ok(&[
                    "pipe:gsutil cat gs://bucket/a-0.tar",
                    "pipe:gsutil cat gs://bucket/a-1.tar",
                ]),
            ),
            (
                "pipe:curl -s http://host:8080/",
                "a-0.tar",
                ok(&["pipe:curl -s http://host:8080/a-0.tar"]),
            ),
            ("pipe:cat ", "a-0.tar", ok(&["pipe:cat a-0.tar"])),
            (
                "pipe:curl -s -f http://h/%s -o -",
                "d/x.tar",
                ok(&["pipe:curl -s -f http://h/d/x.tar -o -"]),
            ),
            ("/data", "x.tar", ok(&["/data/x.tar"])),
            ("/data/", "x.tar", ok(&["/data/x.tar"])),
            ("http://h/d/", "x.tar", ok(&["http://h/d/x.tar"])),
            ("http://h:8080", "x.tar", ok(&["http://h:8080/x.tar"])),
            ("http://h/%s.gz", "x.tar", ok(&["http://h/x.tar.gz"])),
            (
                "",
                "/abs/x.tar::pipe:cat y",
                ok(&["/abs/x.tar", "pipe:cat y"]),
            ),
            ("http://h/", "http://other/x.tar", Err("already a full URL")),
            ("/data", "/abs/x.tar", Err("already an absolute path")),
            (
                "/data",
                "a.tar::pipe:cat b.tar",
                Err("already a `pipe:` command"),
            ),
            ("/data", "-", Err("standard input")),
            ("/data", "file:x.tar", Err("already a full URL")),
            ("http://h/", "%s/x.tar", Err("the spec holds `%s`")),
            ("pipe:cat %s %s", "x.tar", Err("2 times")),
            ("pipe:cat", "x.tar", Err("must end with `/` or a space")),
            ("/data", "x-{1..", Err("unbalanced")),
        ];
        for (base, spec, want) in cases {
            let got = ShardList::from_spec_with_base(spec, base).map(|list| list.urls);
            match (got, want) {
                (Ok(got), Ok(want)) => assert_eq!(got, want, "base {base:?} spec {spec:?}"),
                (Err(error), Err(words)) => {
                    let text = error.to_string();
                    assert!(text.contains(words), "base {base:?} spec {spec:?}: {text}");
                    if !matches!(error, ShardListError::Spec(_)) {
                        assert!(text.contains(base), "{text} does not name the base");
                    }
                }
                (got, want) => panic!("base {base:?} spec {spec:?}: got {got:?}, want {want:?}"),
            }
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
        let err = Sources::default().open("gs://bucket/x.tar").err();
        assert!(matches!(err, Some(ShardError::BadUrl { .. })), "{err:?}");
    }

    #[test]
    fn opens_are_counted_by_kind_of_source() {
        let dir = tempfile::tempdir().expect("temp dir");
        let shard = dir.path().join("a.tar");
        std::fs::write(&shard, [0u8; 1024]).expect("write");
        let sources = Sources::default();
        let shard = shard.display().to_string();
        assert!(sources.open(&shard).is_ok());
        assert!(sources.open(&format!("file:{shard}")).is_ok());
        assert!(sources.open(&format!("{shard}.missing")).is_err());
        assert!(sources.open("pipe:true").is_ok());
        // A URL no source handles is no source's open.
        assert!(sources.open("gs://bucket/x.tar").is_err());
        let counts = sources.counts();
        let named = |pairs: &[(&str, u64)]| -> std::collections::BTreeMap<String, u64> {
            pairs.iter().map(|(k, n)| (k.to_string(), *n)).collect()
        };
        assert_eq!(counts.opened, named(&[("file", 2), ("pipe", 1)]));
        assert_eq!(counts.failed, named(&[("file", 1)]));
        let mut twice = counts.clone();
        twice.merge(&counts);
        assert_eq!(twice.opened, named(&[("file", 4), ("pipe", 2)]));
    }
}
