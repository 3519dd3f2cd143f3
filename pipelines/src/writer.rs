//! Writing WebDataset shards: one tar at a time ([`TarWriter`]) or a numbered series
//! with size limits ([`ShardWriter`]), byte-for-byte deterministic.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::s3::ObjectWriter;
use crate::sample::{Sample, decode_int_field};
use crate::stream::S3Options;

/// Modification time stamped on every member, so equal input gives equal shards.
pub const FIXED_MTIME: u64 = 1_704_067_200; // 2024-01-01T00:00:00Z

/// Writes samples as tar members named `key.extension`, extensions in sorted order.
pub struct TarWriter<W: Write> {
    builder: tar::Builder<W>,
}

impl<W: Write> std::fmt::Debug for TarWriter<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TarWriter").finish_non_exhaustive()
    }
}

impl<W: Write> TarWriter<W> {
    pub fn new(out: W) -> Self {
        Self {
            builder: tar::Builder::new(out),
        }
    }

    /// Writes one sample; returns its payload bytes.
    pub fn write(&mut self, sample: &Sample) -> io::Result<u64> {
        validate_key(&sample.key)?;
        let mut fields: Vec<&(String, Vec<u8>)> = sample.fields.iter().collect();
        fields.sort_by(|a, b| a.0.cmp(&b.0));
        if let Some(pair) = fields.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("sample `{}` has field `{}` twice", sample.key, pair[0].0),
            ));
        }
        let mut payload = 0;
        for (extension, bytes) in fields {
            if extension.is_empty() || extension.contains('/') {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("sample `{}` has a bad field name `{extension}`", sample.key),
                ));
            }
            let mut header = tar::Header::new_gnu();
            header.set_size(bytes.len() as u64);
            header.set_mode(0o444);
            header.set_mtime(FIXED_MTIME);
            header.set_uid(0);
            header.set_gid(0);
            header.set_username("bigdata")?;
            header.set_groupname("bigdata")?;
            header.set_entry_type(tar::EntryType::Regular);
            let name = format!("{}.{}", sample.key, extension);
            self.builder
                .append_data(&mut header, name, bytes.as_slice())?;
            payload += bytes.len() as u64;
        }
        Ok(payload)
    }

    /// Writes the end-of-archive blocks and returns the output.
    pub fn finish(self) -> io::Result<W> {
        self.builder.into_inner()
    }
}

fn validate_key(key: &str) -> io::Result<()> {
    let bad = key.is_empty()
        || key.starts_with('/')
        || key.split('/').any(|part| part == "..")
        || key
            .rsplit('/')
            .next()
            .is_some_and(|last| last.contains('.'));
    if bad {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "bad sample key `{key}` (empty, absolute, `..`, or a dot in its last component)"
            ),
        ));
    }
    Ok(())
}

/// One finished shard of a [`ShardWriter`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrittenShard {
    pub path: PathBuf,
    pub samples: u64,
    /// Size of the tar file.
    pub bytes: u64,
    /// Sum of the members' sizes.
    pub payload_bytes: u64,
    pub first_key: String,
    pub last_key: String,
    /// Samples per `cls` value (for samples that have one).
    pub class_counts: BTreeMap<i64, u64>,
}

/// Writes a numbered series of shards (`train-%06d.tar`), starting a new one before a
/// write when the current one holds `max_count` samples or `max_size` payload bytes.
///
/// Each shard is written under a temporary name and renamed when it is complete, so a
/// reader never sees half a shard under its final name. A pattern of `s3://` URLs
/// uploads each shard as it is written and completes the upload when the shard is: there
/// too the shard appears whole or not at all.
#[derive(Debug)]
pub struct ShardWriter {
    pattern: String,
    max_count: u64,
    max_size: u64,
    next_index: u64,
    current: Option<OpenShard>,
    finished: Vec<WrittenShard>,
    /// How `s3://` shards are reached.
    s3: S3Options,
}

#[derive(Debug)]
struct OpenShard {
    path: PathBuf,
    /// The temporary file of a local shard, removed if the shard is abandoned (an
    /// object's upload is aborted by its own drop).
    temp: Option<PathBuf>,
    tar: TarWriter<ShardOut>,
    stats: WrittenShard,
}

/// Where an open shard's bytes go until it is complete.
#[derive(Debug)]
enum ShardOut {
    /// A local file under a temporary name, renamed when complete (and removed when the
    /// shard is abandoned).
    File {
        temp: PathBuf,
        file: BufWriter<File>,
    },
    /// An object uploaded as it is written, visible when complete (the upload aborted
    /// when the shard is abandoned).
    Object(Box<ObjectWriter>),
}

impl ShardOut {
    fn open(path: &Path, s3: &S3Options) -> io::Result<Self> {
        if let Some(url) = path.to_str().filter(|p| crate::s3::is_object_url(p)) {
            return ObjectWriter::create(url, s3)
                .map(|object| Self::Object(Box::new(object)))
                .map_err(io::Error::other);
        }
        let temp = temp_name(path);
        let file = File::create(&temp).map_err(|e| with_path(e, &temp))?;
        Ok(Self::File {
            temp,
            file: BufWriter::with_capacity(1 << 20, file),
        })
    }

    /// Makes the shard visible at `path`; returns its size.
    fn commit(self, path: &Path) -> io::Result<u64> {
        match self {
            Self::File { temp, file } => {
                let file = file.into_inner().map_err(|e| e.into_error())?;
                file.sync_all()?;
                let bytes = file.metadata()?.len();
                std::fs::rename(&temp, path).map_err(|e| with_path(e, path))?;
                Ok(bytes)
            }
            Self::Object(object) => object.finish(),
        }
    }

    /// The temporary file of a local shard.
    fn temp(&self) -> Option<PathBuf> {
        match self {
            Self::File { temp, .. } => Some(temp.clone()),
            Self::Object(_) => None,
        }
    }
}

impl Write for ShardOut {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Self::File { file, .. } => file.write(buf),
            Self::Object(object) => object.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Self::File { file, .. } => file.flush(),
            Self::Object(object) => object.flush(),
        }
    }
}

impl ShardWriter {
    /// `pattern` is a path with one printf-style integer conversion (`%06d`).
    pub fn new(pattern: impl Into<String>, max_count: u64, max_size: u64) -> io::Result<Self> {
        let pattern = pattern.into();
        format_pattern(&pattern, 0)?;
        Ok(Self {
            pattern,
            max_count: max_count.max(1),
            max_size: max_size.max(1),
            next_index: 0,
            current: None,
            finished: Vec::new(),
            s3: S3Options::default(),
        })
    }

    /// Reaches `s3://` shards with `options`.
    pub fn with_s3(mut self, options: S3Options) -> Self {
        self.s3 = options;
        self
    }

    pub fn write(&mut self, sample: &Sample) -> io::Result<()> {
        let full = self.current.as_ref().is_some_and(|c| {
            c.stats.samples >= self.max_count || c.stats.payload_bytes >= self.max_size
        });
        if full {
            self.close_current()?;
        }
        if self.current.is_none() {
            self.open_next()?;
        }
        // Invariant: a shard was opened just above.
        let current = self.current.as_mut().expect("an open shard");
        let payload = current.tar.write(sample)?;
        let stats = &mut current.stats;
        if stats.samples == 0 {
            stats.first_key = sample.key.clone();
        }
        stats.last_key = sample.key.clone();
        stats.samples += 1;
        stats.payload_bytes += payload;
        if let Some(Ok(class)) = sample.field("cls").map(decode_int_field) {
            *stats.class_counts.entry(class).or_default() += 1;
        }
        Ok(())
    }

    /// Closes the last shard and returns all shards written, in order.
    pub fn finish(mut self) -> io::Result<Vec<WrittenShard>> {
        self.close_current()?;
        Ok(std::mem::take(&mut self.finished))
    }

    /// The final path of the shard being written, if one is open.
    pub fn current_path(&self) -> Option<&Path> {
        self.current.as_ref().map(|c| c.path.as_path())
    }

    fn open_next(&mut self) -> io::Result<()> {
        let path = PathBuf::from(format_pattern(&self.pattern, self.next_index)?);
        self.next_index += 1;
        let out = ShardOut::open(&path, &self.s3)?;
        self.current = Some(OpenShard {
            temp: out.temp(),
            tar: TarWriter::new(out),
            stats: WrittenShard {
                path: path.clone(),
                samples: 0,
                bytes: 0,
                payload_bytes: 0,
                first_key: String::new(),
                last_key: String::new(),
                class_counts: BTreeMap::new(),
            },
            path,
        });
        Ok(())
    }

    fn close_current(&mut self) -> io::Result<()> {
        let Some(shard) = self.current.take() else {
            return Ok(());
        };
        let out = shard.tar.finish()?;
        let mut stats = shard.stats;
        stats.bytes = out.commit(&shard.path)?;
        tracing::debug!(path = %shard.path.display(), samples = stats.samples, "shard written");
        self.finished.push(stats);
        Ok(())
    }
}

impl Drop for ShardWriter {
    /// A writer dropped before `finish` (an error, a cancelled job) leaves no
    /// half-written shard behind.
    fn drop(&mut self) {
        if let Some(shard) = self.current.take() {
            drop(shard.tar);
            if let Some(temp) = shard.temp {
                let _ = std::fs::remove_file(&temp);
            }
        }
    }
}

fn temp_name(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    path.with_file_name(name)
}

fn with_path(error: io::Error, path: &Path) -> io::Error {
    io::Error::new(error.kind(), format!("{}: {error}", path.display()))
}

/// Formats a printf-style pattern with exactly one integer conversion (`%d`, `%6d`,
/// `%06d`); `%%` is a literal percent sign.
pub fn format_pattern(pattern: &str, value: u64) -> io::Result<String> {
    let bad = |why: &str| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("shard name pattern `{pattern}`: {why}"),
        )
    };
    let mut out = String::with_capacity(pattern.len() + 8);
    let mut conversions = 0;
    let mut chars = pattern.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        if chars.peek() == Some(&'%') {
            chars.next();
            out.push('%');
            continue;
        }
        let zero = chars.peek() == Some(&'0');
        if zero {
            chars.next();
        }
        let mut width = String::new();
        while let Some(d) = chars.peek().filter(|d| d.is_ascii_digit()) {
            width.push(*d);
            chars.next();
        }
        if chars.next() != Some('d') {
            return Err(bad("only integer conversions like %06d are supported"));
        }
        let width: usize = if width.is_empty() {
            0
        } else {
            width.parse().map_err(|_| bad("width too large"))?
        };
        if zero {
            out.push_str(&format!("{value:0width$}"));
        } else {
            out.push_str(&format!("{value:width$}"));
        }
        conversions += 1;
    }
    if conversions != 1 {
        return Err(bad("needs exactly one integer conversion such as %06d"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_format_like_printf() {
        let cases: &[(&str, u64, Option<&str>)] = &[
            ("a-%06d.tar", 7, Some("a-000007.tar")),
            ("a-%d.tar", 12, Some("a-12.tar")),
            ("a-%3d.tar", 5, Some("a-  5.tar")),
            ("100%%-%02d", 3, Some("100%-03")),
            ("plain.tar", 0, None),
            ("%d-%d", 0, None),
            ("%s.tar", 0, None),
        ];
        for (pattern, value, want) in cases {
            let got = format_pattern(pattern, *value).ok();
            assert_eq!(got.as_deref(), *want, "pattern {pattern}");
        }
    }

    #[test]
    fn members_are_written_in_sorted_extension_order() {
        let sample = Sample::new("k")
            .with("txt", b"t".to_vec())
            .with_class(2)
            .with("jpg", b"j".to_vec());
        let mut tar = TarWriter::new(Vec::new());
        tar.write(&sample).expect("write to memory");
        let bytes = tar.finish().expect("finish");
        let mut archive = tar::Archive::new(bytes.as_slice());
        let names: Vec<String> = archive
            .entries()
            .expect("entries")
            .map(|e| {
                e.expect("entry")
                    .path()
                    .expect("path")
                    .display()
                    .to_string()
            })
            .collect();
        assert_eq!(names, ["k.cls", "k.jpg", "k.txt"]);
    }

    #[test]
    fn an_unfinished_writer_leaves_no_partial_shard() {
        let dir = tempfile::tempdir().expect("temp dir");
        let pattern = dir.path().join("s-%02d.tar");
        let mut writer = ShardWriter::new(pattern.to_string_lossy(), 2, 1 << 30).expect("pattern");
        for i in 0..3 {
            writer
                .write(&Sample::new(format!("k{i}")).with_class(i))
                .expect("write");
        }
        assert_eq!(
            writer.current_path(),
            Some(dir.path().join("s-01.tar").as_path())
        );
        drop(writer);
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .expect("list")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(
            names,
            ["s-00.tar"],
            "the finished shard stays, the partial one goes"
        );
    }

    #[test]
    fn bad_keys_and_fields_are_refused() {
        let cases = [
            Sample::new("").with("jpg", b"x".to_vec()),
            Sample::new("a.b").with("jpg", b"x".to_vec()),
            Sample::new("../x").with("jpg", b"x".to_vec()),
            Sample::new("/abs").with("jpg", b"x".to_vec()),
            Sample::new("k")
                .with("jpg", b"x".to_vec())
                .with("jpg", b"y".to_vec()),
            Sample::new("k").with("", b"x".to_vec()),
        ];
        for sample in cases {
            let mut tar = TarWriter::new(Vec::new());
            assert!(tar.write(&sample).is_err(), "accepted {sample:?}");
        }
    }
}
