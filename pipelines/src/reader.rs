//! Streaming WebDataset reader: tar members grouped into samples by key.
//!
//! The rules are those of Python `webdataset` (see `shared/reference/webdataset-format.md`):
//! only regular files count; metadata members (`__index__`, `__meta__/...`) and names
//! without a dot in their last component are skipped; the key ends at the first dot of the
//! last path component and the extension (lower-cased) is the rest; a sample is a run of
//! consecutive members with the same key; the same extension twice in one run is an error.

use std::io::{self, Read};
use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use crate::error::{ErrorPolicy, ShardError, escaped};
use crate::members::{Members, Plain, TarRead};
use crate::sample::Sample;
use crate::source::{Sources, classify};

/// Largest member accepted by default (a sample field over this is an error).
pub const DEFAULT_MAX_MEMBER: u64 = 1 << 30;

/// How many problems a [`ReadStats`] keeps word for word; the rest are only counted.
const KEPT_PROBLEMS: usize = 64;

/// What reading one or more shards produced and skipped.
#[derive(Debug, Default)]
pub struct ReadStats {
    pub shards: u64,
    pub samples: u64,
    pub payload_bytes: u64,
    pub skipped_samples: u64,
    pub skipped_shards: u64,
    /// The first problems met under [`ErrorPolicy::Skip`], in order.
    pub problems: Vec<ShardError>,
}

impl ReadStats {
    fn record(&mut self, error: ShardError) {
        if error.is_sample_level() {
            self.skipped_samples += 1;
        } else {
            self.skipped_shards += 1;
        }
        tracing::warn!(%error, "skipping bad shard data");
        if self.problems.len() < KEPT_PROBLEMS {
            self.problems.push(error);
        }
    }

    /// Adds another reader's counts to these.
    pub fn merge(&mut self, other: ReadStats) {
        self.shards += other.shards;
        self.samples += other.samples;
        self.payload_bytes += other.payload_bytes;
        self.skipped_samples += other.skipped_samples;
        self.skipped_shards += other.skipped_shards;
        let room = KEPT_PROBLEMS.saturating_sub(self.problems.len());
        self.problems.extend(other.problems.into_iter().take(room));
    }
}

/// Reads samples from shards named by URL, opening them through [`Sources`].
#[derive(Debug, Clone)]
pub struct SampleReader {
    sources: Arc<Sources>,
    policy: ErrorPolicy,
    max_member: u64,
}

impl SampleReader {
    /// The shards its sources opened so far, by kind of source.
    pub fn source_counts(&self) -> crate::SourceCounts {
        self.sources.counts()
    }

    pub fn new(sources: Sources) -> Self {
        Self {
            sources: Arc::new(sources),
            policy: ErrorPolicy::Fail,
            max_member: DEFAULT_MAX_MEMBER,
        }
    }

    pub fn with_policy(mut self, policy: ErrorPolicy) -> Self {
        self.policy = policy;
        self
    }

    pub fn with_max_member(mut self, bytes: u64) -> Self {
        self.max_member = bytes;
        self
    }

    pub fn sources(&self) -> &Sources {
        &self.sources
    }

    pub(crate) fn max_member(&self) -> u64 {
        self.max_member
    }

    /// Streams one shard, calling `visit` for each sample. `visit` may stop early with
    /// `ControlFlow::Break`, which is passed back.
    pub fn read_shard(
        &self,
        url: &str,
        stats: &mut ReadStats,
        visit: &mut dyn FnMut(Sample) -> ControlFlow<()>,
    ) -> Result<ControlFlow<()>, ShardError> {
        self.read_shard_counted(url, None, stats, visit)
    }

    /// [`read_shard`](Self::read_shard), adding the bytes received from the source (as
    /// stored, before decompression) to `received` as they arrive.
    pub fn read_shard_counted(
        &self,
        url: &str,
        received: Option<Arc<AtomicU64>>,
        stats: &mut ReadStats,
        visit: &mut dyn FnMut(Sample) -> ControlFlow<()>,
    ) -> Result<ControlFlow<()>, ShardError> {
        let stream = match self.sources.open_tar(url) {
            Ok(stream) => stream,
            Err(error) => return self.handle_shard_error(error, stats),
        };
        let stream = Counting {
            inner: stream,
            counter: received,
        };
        let walk = Walk {
            url: Arc::from(url),
            policy: self.policy,
            max_member: self.max_member,
        };
        match walk.samples(stream, stats, visit) {
            Ok(flow) => Ok(flow),
            Err(error) => self.handle_shard_error(error, stats),
        }
    }

    /// Streams every shard in order.
    pub fn read_all<S: AsRef<str>>(
        &self,
        urls: &[S],
        visit: &mut dyn FnMut(Sample) -> ControlFlow<()>,
    ) -> Result<ReadStats, ShardError> {
        let mut stats = ReadStats::default();
        for url in urls {
            if self.read_shard(url.as_ref(), &mut stats, visit)?.is_break() {
                break;
            }
        }
        Ok(stats)
    }

    /// Reads every shard into memory (for tests and small data).
    pub fn collect<S: AsRef<str>>(
        &self,
        urls: &[S],
    ) -> Result<(Vec<Sample>, ReadStats), ShardError> {
        let mut samples = Vec::new();
        let stats = self.read_all(urls, &mut |s| {
            samples.push(s);
            ControlFlow::Continue(())
        })?;
        Ok((samples, stats))
    }

    fn handle_shard_error(
        &self,
        error: ShardError,
        stats: &mut ReadStats,
    ) -> Result<ControlFlow<()>, ShardError> {
        match self.policy {
            ErrorPolicy::Fail => Err(error),
            ErrorPolicy::Skip => {
                stats.record(error);
                Ok(ControlFlow::Continue(()))
            }
        }
    }
}

/// The samples of one already-open tar stream.
#[derive(Debug)]
pub struct ShardSamples<R> {
    url: Arc<str>,
    stream: R,
    policy: ErrorPolicy,
    max_member: u64,
}

impl<R: Read> ShardSamples<R> {
    pub fn new(url: &str, stream: R) -> Self {
        Self {
            url: Arc::from(url),
            stream,
            policy: ErrorPolicy::Fail,
            max_member: DEFAULT_MAX_MEMBER,
        }
    }

    pub fn with_policy(mut self, policy: ErrorPolicy) -> Self {
        self.policy = policy;
        self
    }

    pub fn with_max_member(mut self, bytes: u64) -> Self {
        self.max_member = bytes;
        self
    }

    /// Calls `visit` for every sample. Sample-level problems (a duplicate extension, an
    /// oversized member) are skipped and counted under [`ErrorPolicy::Skip`]; a problem
    /// that makes the rest of the stream unreadable is returned (the caller decides
    /// whether that skips the shard). After the last member the stream is read to its
    /// end, so that a `pipe:` command's exit status is always checked.
    pub fn for_each(
        self,
        stats: &mut ReadStats,
        visit: &mut dyn FnMut(Sample) -> ControlFlow<()>,
    ) -> Result<ControlFlow<()>, ShardError> {
        let walk = Walk {
            url: self.url,
            policy: self.policy,
            max_member: self.max_member,
        };
        walk.samples(Plain(self.stream), stats, visit)
    }
}

/// The samples of one shard's tar walk, under a policy and a member limit.
pub(crate) struct Walk {
    pub url: Arc<str>,
    pub policy: ErrorPolicy,
    pub max_member: u64,
}

impl Walk {
    /// [`ShardSamples::for_each`] over `stream`.
    pub fn samples<R: TarRead>(
        self,
        stream: R,
        stats: &mut ReadStats,
        visit: &mut dyn FnMut(Sample) -> ControlFlow<()>,
    ) -> Result<ControlFlow<()>, ShardError> {
        let url = self.url;
        let mut members = Members::new(stream, self.max_member);
        let mut grouper = Grouper::new(url.clone());
        stats.shards += 1;
        while let Some(member) = members
            .next()
            .map_err(|(offset, e)| classify(&url, offset, e))?
        {
            // Python's `isreg()`: regular files and contiguous files.
            if !member.is_file() {
                continue;
            }
            let Some((key, extension)) = split_member_name(members.name()) else {
                continue;
            };
            if grouper.poisoned(key) {
                continue;
            }
            let size = member.size;
            if size > self.max_member {
                let error = ShardError::MemberTooLarge {
                    url: url.to_string(),
                    // For messages only: a hostile name is shown escaped, never raw.
                    name: escaped(members.name()),
                    offset: member.header_at,
                    size,
                    limit: self.max_member,
                };
                sample_problem(self.policy, error, stats)?;
                grouper.poison(key);
                continue;
            }
            // The key is a prefix of the name, which stays put while the data is read.
            let key_len = key.len();
            // `size` is within the member limit, so the buffer is bounded.
            let mut bytes = Vec::new();
            members
                .read_data(&mut bytes)
                .map_err(|e| classify(&url, member.data_at, e))?;
            if (bytes.len() as u64) < size {
                return Err(ShardError::Corrupt {
                    url: url.to_string(),
                    offset: member.data_at + bytes.len() as u64,
                    reason: format!(
                        "truncated: member `{}` declares {size} bytes but only {} follow",
                        escaped(members.name()),
                        bytes.len()
                    ),
                });
            }
            let key = &members.name()[..key_len];
            match grouper.push(key, extension, bytes, member.header_at) {
                Ok(Some(done)) => {
                    stats.samples += 1;
                    stats.payload_bytes += done.payload_bytes();
                    if visit(done).is_break() {
                        return Ok(ControlFlow::Break(()));
                    }
                }
                Ok(None) => {}
                Err(error) => sample_problem(self.policy, error, stats)?,
            }
        }
        if let Some(done) = grouper.finish() {
            stats.samples += 1;
            stats.payload_bytes += done.payload_bytes();
            if visit(done).is_break() {
                return Ok(ControlFlow::Break(()));
            }
        }
        // Drain trailing padding so that the source sees its end (and a pipe its status).
        let total = members
            .drain()
            .map_err(|e| classify(&url, members.offset(), e))?;
        if total == 0 {
            // Python's tarfile refuses these too (`empty file`); an empty tar has 1 KiB.
            return Err(ShardError::Corrupt {
                url: url.to_string(),
                offset: 0,
                reason: "empty file".to_string(),
            });
        }
        Ok(ControlFlow::Continue(()))
    }
}

/// Splits a member name into key and lower-cased extension, or `None` if the member is
/// not part of any sample (metadata, or no dot in the last path component).
///
/// This mirrors the Python library's `^((?:.*/|)[^.]+)[.]([^/]*)$` together with its
/// metadata filters: the key ends at the first dot of the last component, and the run of
/// dot-free characters before that dot must start at the beginning of the name or right
/// after a `/` (so `dir/.hidden.jpg` has key `dir/`, while `.hidden.jpg` is skipped).
///
/// It works on the raw bytes of the name: names that are not UTF-8 group by their bytes
/// (as Python's surrogate escapes do) and are shown with U+FFFD replacements.
pub(crate) fn split_member_name(name: &[u8]) -> Option<(&[u8], String)> {
    if is_metadata(name) {
        return None;
    }
    let last_start = name.iter().rposition(|&b| b == b'/').map_or(0, |i| i + 1);
    let dot = last_start + name[last_start..].iter().position(|&b| b == b'.')?;
    let run_start = name[..dot]
        .iter()
        .rposition(|&b| b == b'.')
        .map_or(0, |i| i + 1);
    let anchored = (run_start..dot).any(|p| p == 0 || name[p - 1] == b'/');
    if !anchored {
        return None;
    }
    Some((
        &name[..dot],
        String::from_utf8_lossy(&name[dot + 1..]).to_lowercase(),
    ))
}

fn is_metadata(name: &[u8]) -> bool {
    let dunder = |part: &[u8]| part.len() >= 4 && part.starts_with(b"__") && part.ends_with(b"__");
    let has_slash = name.contains(&b'/');
    // A top-level `__...__`, or `^__[^/]*__($|/)`: a first path component `__...__`.
    let first = name.split(|&b| b == b'/').next().unwrap_or(name);
    (!has_slash && name.starts_with(b"__") && name.ends_with(b"__")) || dunder(first)
}

fn sample_problem(
    policy: ErrorPolicy,
    error: ShardError,
    stats: &mut ReadStats,
) -> Result<(), ShardError> {
    match policy {
        ErrorPolicy::Fail => Err(error),
        ErrorPolicy::Skip => {
            stats.record(error);
            Ok(())
        }
    }
}

/// Groups consecutive members by key.
struct Grouper {
    url: Arc<str>,
    current: Option<Sample>,
    /// The raw bytes of the current sample's key (keys compare as bytes).
    current_key: Vec<u8>,
    poisoned_key: Option<Vec<u8>>,
}

impl Grouper {
    fn new(url: Arc<str>) -> Self {
        Self {
            url,
            current: None,
            current_key: Vec::new(),
            poisoned_key: None,
        }
    }

    /// Whether `key` belongs to a run that was dropped; a new key clears the mark.
    fn poisoned(&mut self, key: &[u8]) -> bool {
        match &self.poisoned_key {
            Some(bad) if bad == key => true,
            Some(_) => {
                self.poisoned_key = None;
                false
            }
            None => false,
        }
    }

    /// Drops the sample being built if it has `key`, and ignores the rest of its run.
    fn poison(&mut self, key: &[u8]) {
        if self.current.is_some() && self.current_key == key {
            self.current = None;
        }
        self.poisoned_key = Some(key.to_vec());
    }

    /// Adds a member; returns the previous sample when this member starts a new one.
    fn push(
        &mut self,
        key: &[u8],
        extension: String,
        bytes: Vec<u8>,
        offset: u64,
    ) -> Result<Option<Sample>, ShardError> {
        let mut finished = None;
        if self.current.is_none() || self.current_key != key {
            finished = self.current.take();
            self.current_key.clear();
            self.current_key.extend_from_slice(key);
            self.current = Some(Sample {
                key: String::from_utf8_lossy(key).into_owned(),
                url: self.url.clone(),
                fields: Vec::with_capacity(2),
            });
        }
        // Invariant: `current` was set just above when it was empty.
        let current = self.current.as_mut().expect("a current sample");
        if current.fields.iter().any(|(e, _)| *e == extension) {
            let error = ShardError::DuplicateField {
                url: self.url.to_string(),
                key: escaped(&self.current_key),
                extension: escaped(extension.as_bytes()),
                offset,
            };
            // A duplicate is only possible within the current run, so no finished
            // sample is pending here.
            self.poison(key);
            return Err(error);
        }
        current.fields.push((extension, bytes));
        Ok(finished)
    }

    fn finish(&mut self) -> Option<Sample> {
        self.current.take()
    }
}

/// A stream that adds the bytes read through it to a shared counter, when it has one.
struct Counting {
    inner: crate::source::TarStream,
    counter: Option<Arc<AtomicU64>>,
}

impl Counting {
    fn count(&self, n: usize) {
        if let Some(counter) = &self.counter {
            counter.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

impl Read for Counting {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count(n);
        Ok(n)
    }
}

impl TarRead for Counting {
    fn read_spare(&mut self, out: &mut Vec<u8>) -> Option<io::Result<usize>> {
        let read = self.inner.read_spare(out)?;
        if let Ok(n) = read {
            self.count(n);
        }
        Some(read)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tar with the given regular-file members, in order.
    pub(crate) fn tar_of(members: &[(&str, &[u8])]) -> Vec<u8> {
        let mut builder = tar::Builder::new(Vec::new());
        for (name, data) in members {
            let mut header = tar::Header::new_gnu();
            header.set_size(data.len() as u64);
            header.set_mode(0o644);
            header.set_entry_type(tar::EntryType::Regular);
            builder
                .append_data(&mut header, name, *data)
                .expect("append to memory");
        }
        builder.into_inner().expect("finish in memory")
    }

    #[test]
    fn a_counted_read_says_how_many_bytes_came_from_the_source() {
        let dir = tempfile::tempdir().expect("tmp");
        // A member larger than the walk's buffer, read from the file into spare memory.
        let big = vec![8u8; 3 * crate::members::WALK_BUFFER + 5];
        let bytes = tar_of(&[
            ("a.cls", b"1"),
            ("a.txt", b"hello"),
            ("b.cls", b"2"),
            ("b.jpg", &big),
        ]);
        let path = dir.path().join("s.tar");
        std::fs::write(&path, &bytes).expect("write");
        let reader = SampleReader::new(crate::source::Sources::new(Default::default()));
        let received = Arc::new(AtomicU64::new(0));
        let mut stats = ReadStats::default();
        let mut keys = Vec::new();
        let _flow = reader
            .read_shard_counted(
                &path.display().to_string(),
                Some(received.clone()),
                &mut stats,
                &mut |s| {
                    keys.push(s.key.clone());
                    ControlFlow::Continue(())
                },
            )
            .expect("read");
        assert_eq!(keys, ["a", "b"]);
        // Every byte of the stored shard went through the counter.
        assert_eq!(
            received.load(std::sync::atomic::Ordering::Relaxed),
            bytes.len() as u64
        );
    }

    fn read(bytes: &[u8], policy: ErrorPolicy) -> (Result<Vec<Sample>, ShardError>, ReadStats) {
        let mut stats = ReadStats::default();
        let mut samples = Vec::new();
        let result = ShardSamples::new("mem.tar", bytes)
            .with_policy(policy)
            .with_max_member(1000)
            .for_each(&mut stats, &mut |s| {
                samples.push(s);
                ControlFlow::Continue(())
            });
        (result.map(|_| samples), stats)
    }

    /// [`read`] through [`SampleReader`] from a local file, which reads member data
    /// into spare memory rather than zeroed memory: samples, or the error with the
    /// file's name shown as `mem.tar`.
    fn read_file(
        bytes: &[u8],
        policy: ErrorPolicy,
        max_member: u64,
    ) -> (Result<Vec<Sample>, String>, ReadStats) {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("mem.tar");
        std::fs::write(&path, bytes).expect("write");
        let url = path.display().to_string();
        let reader = SampleReader::new(crate::source::Sources::new(Default::default()))
            .with_policy(policy)
            .with_max_member(max_member);
        let mut stats = ReadStats::default();
        let mut samples = Vec::new();
        let result = reader.read_shard(&url, &mut stats, &mut |s| {
            samples.push(s);
            ControlFlow::Continue(())
        });
        let result = result
            .map(|_| samples)
            .map_err(|e| e.to_string().replace(&url, "mem.tar"));
        (result, stats)
    }

    /// Keys and field names of each sample, for compact comparisons.
    fn shape(samples: &[Sample]) -> Vec<String> {
        samples
            .iter()
            .map(|s| {
                let fields: Vec<&str> = s.fields.iter().map(|(e, _)| e.as_str()).collect();
                format!("{}:{}", s.key, fields.join(","))
            })
            .collect()
    }

    #[test]
    fn member_names_split_like_the_python_library() {
        let cases: &[(&str, Option<(&str, &str)>)] = &[
            ("n01440764_10026.JPEG", Some(("n01440764_10026", "jpeg"))),
            ("a/b.c/d.e.f", Some(("a/b.c/d", "e.f"))),
            (
                "2023-01-01T12:00:00.123.jpg",
                Some(("2023-01-01T12:00:00", "123.jpg")),
            ),
            ("dir/.hidden.jpg", Some(("dir/", "hidden.jpg"))),
            ("a/b/.x.jpg", Some(("a/b/", "x.jpg"))),
            ("k.Seg.PNG", Some(("k", "seg.png"))),
            ("a.", Some(("a", ""))),
            ("noext", None),
            ("a.b/c", None),
            (".hidden.jpg", None),
            ("a.b/.x.jpg", None),
            ("__index__", None),
            ("__meta__/x.json", None),
            ("__meta__.json", Some(("__meta__", "json"))),
            ("a/__meta__.json", Some(("a/__meta__", "json"))),
            ("a/__meta__", None),
        ];
        for (name, want) in cases {
            let got = split_member_name(name.as_bytes());
            let got = got
                .as_ref()
                .map(|(k, e)| (std::str::from_utf8(k).expect("utf-8 key"), e.as_str()));
            assert_eq!(got, *want, "member {name}");
        }
    }

    #[test]
    fn consecutive_members_form_samples() {
        type Members<'a> = &'a [(&'a str, &'a [u8])];
        let cases: &[(Members, &[&str])] = &[
            (
                &[("a.jpg", b"1"), ("a.cls", b"0"), ("b.jpg", b"2")],
                &["a:jpg,cls", "b:jpg"],
            ),
            // A key that comes back later starts a new sample.
            (
                &[("a.jpg", b"1"), ("b.jpg", b"2"), ("a.cls", b"0")],
                &["a:jpg", "b:jpg", "a:cls"],
            ),
            // Metadata and dotless names are skipped without breaking a run.
            (
                &[
                    ("__index__", b"x"),
                    ("a.jpg", b"1"),
                    ("noext", b"z"),
                    ("a.cls", b"0"),
                ],
                &["a:jpg,cls"],
            ),
            (&[("d/x.jpg", b"1"), ("d/x.txt", b"t")], &["d/x:jpg,txt"]),
            (&[], &[]),
        ];
        for (members, want) in cases {
            let (samples, _) = read(&tar_of(members), ErrorPolicy::Fail);
            let samples = samples.expect("valid tar");
            assert_eq!(shape(&samples), *want, "members {members:?}");
            assert!(samples.iter().all(|s| &*s.url == "mem.tar"));
        }
    }

    #[test]
    fn directories_are_not_members() {
        let mut builder = tar::Builder::new(Vec::new());
        let mut dir = tar::Header::new_gnu();
        dir.set_entry_type(tar::EntryType::Directory);
        dir.set_size(0);
        builder
            .append_data(&mut dir, "a.d/", &b""[..])
            .expect("dir");
        let mut file = tar::Header::new_gnu();
        file.set_size(1);
        builder
            .append_data(&mut file, "a.jpg", &b"1"[..])
            .expect("file");
        let bytes = builder.into_inner().expect("finish");
        let (samples, _) = read(&bytes, ErrorPolicy::Fail);
        assert_eq!(shape(&samples.expect("valid")), ["a:jpg"]);
    }

    #[test]
    fn bad_input_is_reported_with_offsets_or_skipped() {
        let good = tar_of(&[("a.jpg", b"1"), ("b.jpg", b"2")]);
        let duplicate = tar_of(&[
            ("a.jpg", b"1"),
            ("b.jpg", b"2"),
            ("b.jpg", b"3"),
            ("c.jpg", b"4"),
        ]);
        let oversized_data = vec![7u8; 2000];
        let oversized = tar_of(&[
            ("a.jpg", b"1"),
            ("b.jpg", &oversized_data),
            ("b.cls", b"1"),
            ("c.jpg", b"4"),
        ]);
        let mut truncated = tar_of(&[("a.jpg", b"1"), ("b.jpg", &[9u8; 900])]);
        truncated.truncate(512 * 3 + 100);
        let garbage: Vec<u8> = (0..3000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut bad_checksum = good.clone();
        bad_checksum[512 * 2 + 10] ^= 0x55; // second header's name

        struct Case<'a> {
            name: &'a str,
            bytes: &'a [u8],
            fail_error: Option<&'a str>,
            skip_samples: &'a [&'a str],
            skipped_samples: u64,
        }
        let cases = [
            Case {
                name: "good",
                bytes: &good,
                fail_error: None,
                skip_samples: &["a:jpg", "b:jpg"],
                skipped_samples: 0,
            },
            Case {
                name: "duplicate",
                bytes: &duplicate,
                fail_error: Some("mem.tar: duplicate file name in tar file: `b.jpg` at byte 2048"),
                skip_samples: &["a:jpg", "c:jpg"],
                skipped_samples: 1,
            },
            Case {
                name: "oversized",
                bytes: &oversized,
                fail_error: Some(
                    "mem.tar: member `b.jpg` at byte 1024 is 2000 bytes, over the limit of 1000",
                ),
                skip_samples: &["a:jpg", "c:jpg"],
                skipped_samples: 1,
            },
            Case {
                name: "truncated",
                bytes: &truncated,
                fail_error: Some(
                    "mem.tar: not a valid tar stream at byte 1636: truncated: member `b.jpg` declares 900 bytes but only 100 follow",
                ),
                skip_samples: &[],
                skipped_samples: 0,
            },
            Case {
                name: "garbage",
                bytes: &garbage,
                fail_error: Some("mem.tar: not a valid tar stream at byte 0"),
                skip_samples: &[],
                skipped_samples: 0,
            },
            Case {
                name: "zero bytes",
                bytes: &[],
                fail_error: Some("mem.tar: not a valid tar stream at byte 0: empty file"),
                skip_samples: &[],
                skipped_samples: 0,
            },
            Case {
                name: "bad checksum",
                bytes: &bad_checksum,
                fail_error: Some("mem.tar: not a valid tar stream at byte 1024"),
                skip_samples: &[],
                skipped_samples: 0,
            },
        ];
        for case in cases {
            let (result, _) = read(case.bytes, ErrorPolicy::Fail);
            // A local file gives the same error, at the same byte.
            let (from_file, _) = read_file(case.bytes, ErrorPolicy::Fail, 1000);
            assert_eq!(
                from_file.map(|samples| shape(&samples)),
                result
                    .as_ref()
                    .map(|samples| shape(samples))
                    .map_err(|e| e.to_string()),
                "{}: from a file",
                case.name
            );
            match (result, case.fail_error) {
                (Ok(_), None) => {}
                (Err(e), Some(want)) => {
                    assert!(
                        e.to_string().starts_with(want),
                        "{}: `{e}` does not start with `{want}`",
                        case.name
                    )
                }
                (got, want) => panic!("{}: got {got:?}, wanted error {want:?}", case.name),
            }
            let (result, stats) = read(case.bytes, ErrorPolicy::Skip);
            if let Ok(samples) = result {
                assert_eq!(
                    shape(&samples),
                    case.skip_samples,
                    "{}: samples kept under skip",
                    case.name
                );
                let (from_file, file_stats) = read_file(case.bytes, ErrorPolicy::Skip, 1000);
                let from_file = from_file.map(|samples| shape(&samples));
                assert_eq!(from_file, Ok(shape(&samples)), "{}: from a file", case.name);
                assert_eq!(file_stats.skipped_samples, case.skipped_samples);
            }
            assert_eq!(
                stats.skipped_samples, case.skipped_samples,
                "{}: skipped count",
                case.name
            );
        }
    }

    #[test]
    fn members_at_the_limit_are_read_and_one_byte_more_is_not() {
        // `read` allows 1000 bytes a member; the data spans the reader's buffer.
        let at_limit = vec![3u8; 1000];
        let over = vec![4u8; 1001];
        let bytes = tar_of(&[("a.jpg", &at_limit), ("b.jpg", &over), ("c.jpg", b"c")]);
        let (samples, stats) = read(&bytes, ErrorPolicy::Skip);
        let samples = samples.expect("skips the big one");
        assert_eq!(shape(&samples), ["a:jpg", "c:jpg"]);
        assert_eq!(samples[0].fields[0].1, at_limit);
        assert_eq!(stats.skipped_samples, 1);
        let (result, _) = read(&bytes, ErrorPolicy::Fail);
        let error = result.expect_err("over the limit").to_string();
        assert_eq!(
            error,
            "mem.tar: member `b.jpg` at byte 1536 is 1001 bytes, over the limit of 1000"
        );
    }

    #[test]
    fn a_stream_cut_in_a_large_member_names_the_byte_where_it_ends() {
        // Larger than the tar walk's buffer, so most of it is read straight from the
        // stream; cut 40,000 bytes into it.
        let big = vec![5u8; 3 * crate::members::WALK_BUFFER];
        let mut bytes = tar_of(&[("a.jpg", b"1"), ("b.jpg", &big)]);
        bytes.truncate(1024 + 512 + 40_000);
        let mut stats = ReadStats::default();
        let error = ShardSamples::new("mem.tar", bytes.as_slice())
            .for_each(&mut stats, &mut |_| ControlFlow::Continue(()))
            .expect_err("truncated");
        let want = format!(
            "mem.tar: not a valid tar stream at byte 41536: truncated: member `b.jpg` \
             declares {} bytes but only 40000 follow",
            big.len()
        );
        assert_eq!(error.to_string(), want);
        // The same from a file, whose member data is read into spare memory.
        let reader = |bytes: &[u8]| {
            let (result, _) = read_file(bytes, ErrorPolicy::Fail, DEFAULT_MAX_MEMBER);
            result.map(|samples| shape(&samples))
        };
        assert_eq!(reader(&bytes), Err(want));
        // Cut in a later member, after a whole large one.
        let mut bytes = tar_of(&[("a.jpg", &big), ("b.jpg", &big)]);
        // `big` fills whole blocks: the second header follows it directly.
        let second_data = 512 + big.len() + 512;
        bytes.truncate(second_data + 7);
        assert_eq!(
            reader(&bytes),
            Err(format!(
                "mem.tar: not a valid tar stream at byte {}: truncated: member `b.jpg` \
                 declares {} bytes but only 7 follow",
                second_data + 7,
                big.len()
            ))
        );
    }

    #[test]
    fn hostile_member_names_are_escaped_in_errors() {
        /// Raw member name and data.
        type Member<'a> = (&'a [u8], &'a [u8]);
        fn raw_tar(members: &[Member<'_>]) -> Vec<u8> {
            let mut builder = tar::Builder::new(Vec::new());
            for (name, data) in members {
                let mut header = tar::Header::new_gnu();
                if let Some(gnu) = header.as_gnu_mut() {
                    gnu.name[..name.len()].copy_from_slice(name);
                }
                header.set_size(data.len() as u64);
                header.set_mode(0o644);
                header.set_entry_type(tar::EntryType::Regular);
                header.set_cksum();
                builder.append(&header, *data).expect("append to memory");
            }
            builder.into_inner().expect("finish in memory")
        }
        let big = [7u8; 2000];
        let cases: &[(&[Member<'_>], &str)] = &[
            (
                &[(b"k\x1b[2J\xff.jpg", &big)],
                "member `k\\u{1b}[2J\\xff.jpg` at byte 0 is 2000 bytes",
            ),
            (
                &[(b"d\x07\xfe.jpg", b"1"), (b"d\x07\xfe.jpg", b"2")],
                "duplicate file name in tar file: `d\\u{7}\\xfe.jpg` at byte 1024",
            ),
        ];
        for (members, want) in cases {
            let (result, _) = read(&raw_tar(members), ErrorPolicy::Fail);
            let message = result.expect_err(want).to_string();
            assert!(message.contains(want), "`{message}` lacks `{want}`");
            assert!(
                !message.chars().any(|c| c.is_control() || c == '\u{fffd}'),
                "{message:?} is not plain text"
            );
        }
    }

    #[test]
    fn early_stop_is_passed_back() {
        let bytes = tar_of(&[("a.jpg", b"1"), ("b.jpg", b"2"), ("c.jpg", b"3")]);
        let mut seen = 0;
        let flow = ShardSamples::new("mem.tar", bytes.as_slice())
            .for_each(&mut ReadStats::default(), &mut |_| {
                seen += 1;
                if seen == 2 {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            })
            .expect("valid");
        assert!(flow.is_break());
        assert_eq!(seen, 2);
    }
}
