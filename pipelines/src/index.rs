//! Indexing shards that came without a manifest (written by Python webdataset or tarp,
//! served by any web server, read through `pipe:`): every shard is read through, in
//! parallel, and counted into the same [`Manifest`] that `shards create` writes.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Read};
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{ErrorPolicy, ShardError};
use crate::manifest::{Manifest, ManifestShard, shard_name};
use crate::members::TarRead;
use crate::reader::{ReadStats, SampleReader, Walk};
use crate::sample::decode_int_field;

/// How [`index_shards`] reads.
#[derive(Debug, Clone)]
pub struct IndexOptions {
    /// Shards read at once (each on a thread of its own).
    pub jobs: usize,
    /// The integer label field whose values are counted per class (`cls`).
    pub label_field: String,
}

impl Default for IndexOptions {
    fn default() -> Self {
        Self {
            jobs: 8,
            label_field: "cls".to_string(),
        }
    }
}

/// Why a set of shards could not be indexed.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    #[error("no shards to index")]
    Empty,
    /// The manifest matches shards by file name, so two shards may not share one.
    #[error(
        "`{first}` and `{second}` have the same file name `{name}`; a manifest tells shards apart by file name"
    )]
    SameName {
        name: String,
        first: String,
        second: String,
    },
    #[error(transparent)]
    Shard(#[from] ShardError),
    #[error("{url}: sample `{key}`: label field `{field}`: {reason}")]
    Label {
        url: String,
        key: String,
        field: String,
        reason: String,
    },
}

/// Reads every shard of `urls` through and returns their manifest: per shard its
/// samples, bytes (the tar stream's length, the file's size for uncompressed shards) and
/// samples per class (the integer `label_field`; samples without one are counted but in
/// no class), in the order of `urls`. The classes are named by their index, `"0"` to
/// `"N-1"` for the largest label `N-1` seen.
///
/// Up to `options.jobs` shards are read at once; `progress` is told of each shard done.
/// Any problem fails the whole index (whatever `reader`'s policy): it names the shard,
/// and for tar damage the byte offset, of the first failing shard in `urls`' order.
pub fn index_shards(
    reader: &SampleReader,
    urls: &[String],
    options: &IndexOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Manifest, IndexError> {
    if urls.is_empty() {
        return Err(IndexError::Empty);
    }
    check_names(urls)?;
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let results: Mutex<Vec<Option<Result<ManifestShard, IndexError>>>> =
        Mutex::new((0..urls.len()).map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..options.jobs.clamp(1, urls.len()) {
            scope.spawn(|| {
                while !failed.load(Ordering::Relaxed) {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(url) = urls.get(i) else { break };
                    let result = index_one(reader, url, &options.label_field);
                    if result.is_err() {
                        failed.store(true, Ordering::Relaxed);
                    } else {
                        progress(1);
                    }
                    if let Ok(mut results) = results.lock() {
                        results[i] = Some(result);
                    }
                }
            });
        }
    });
    let results = results
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    // Shards are claimed in order and each claimed one has its result, so in that order
    // the first failure comes before any shard left unread because of it.
    let mut shards = Vec::with_capacity(urls.len());
    for result in results {
        match result {
            Some(Ok(shard)) => shards.push(shard),
            Some(Err(error)) => return Err(error),
            None => break,
        }
    }
    let classes = shards
        .iter()
        .flat_map(|s| s.class_counts.keys())
        .filter_map(|class| class.parse::<u64>().ok())
        .max()
        .map_or(0, |largest| largest + 1);
    Ok(Manifest::from_shards(
        (0..classes).map(|c| c.to_string()).collect(),
        shards,
    ))
}

/// Every shard's manifest name is unique.
fn check_names(urls: &[String]) -> Result<(), IndexError> {
    let mut seen: HashMap<&str, &String> = HashMap::new();
    for url in urls {
        let name = shard_name(url);
        if let Some(first) = seen.insert(name, url) {
            return Err(IndexError::SameName {
                name: name.to_string(),
                first: first.clone(),
                second: url.clone(),
            });
        }
    }
    Ok(())
}

/// One shard read through and counted.
fn index_one(
    reader: &SampleReader,
    url: &str,
    label_field: &str,
) -> Result<ManifestShard, IndexError> {
    let stream = reader.sources().open_tar(url)?;
    let mut bytes = 0;
    let counted = Counting {
        inner: stream,
        bytes: &mut bytes,
    };
    let mut samples = 0;
    let mut counts: BTreeMap<u64, u64> = BTreeMap::new();
    let mut bad_label = None;
    let mut stats = ReadStats::default();
    // A break only comes with `bad_label` set, which is checked below.
    let walk = Walk {
        url: Arc::from(url),
        policy: ErrorPolicy::Fail,
        max_member: reader.max_member(),
    };
    let _flow = walk.samples(counted, &mut stats, &mut |sample| {
        samples += 1;
        let Some(label) = sample.field(label_field) else {
            return ControlFlow::Continue(());
        };
        match decode_int_field(label)
            .and_then(|class| u64::try_from(class).map_err(|_| format!("{class} is negative")))
        {
            Ok(class) => {
                *counts.entry(class).or_default() += 1;
                ControlFlow::Continue(())
            }
            Err(reason) => {
                bad_label = Some(IndexError::Label {
                    url: url.to_string(),
                    key: sample.key,
                    field: label_field.to_string(),
                    reason,
                });
                ControlFlow::Break(())
            }
        }
    })?;
    if let Some(error) = bad_label {
        return Err(error);
    }
    Ok(ManifestShard {
        name: shard_name(url).to_string(),
        samples,
        bytes,
        class_counts: counts
            .into_iter()
            .map(|(class, count)| (class.to_string(), count))
            .collect(),
    })
}

/// A reader that counts the bytes read through it.
struct Counting<'a, R> {
    inner: R,
    bytes: &'a mut u64,
}

impl<R: Read> Read for Counting<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        *self.bytes += n as u64;
        Ok(n)
    }
}

impl<R: TarRead> TarRead for Counting<'_, R> {
    fn read_spare(&mut self, out: &mut Vec<u8>) -> Option<io::Result<usize>> {
        let read = self.inner.read_spare(out)?;
        if let Ok(n) = read {
            *self.bytes += n as u64;
        }
        Some(read)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::Sources;
    use crate::synth::{SynthOptions, generate_synthetic};
    use crate::writer::TarWriter;

    fn reader() -> SampleReader {
        SampleReader::new(Sources::default())
    }

    /// Synthetic shards in `dir`; their URLs and the manifest written with them.
    fn synth(dir: &std::path::Path) -> (Vec<String>, Manifest) {
        let options = SynthOptions {
            classes: 4,
            per_class: 9,
            size: 16,
            max_count: 10,
            threads: 2,
            ..SynthOptions::default()
        };
        let report = generate_synthetic(dir, &options, &|_| {}).expect("generate");
        let urls = report
            .shards
            .iter()
            .map(|s| s.path.display().to_string())
            .collect();
        (urls, report.manifest)
    }

    #[test]
    fn counts_what_the_writer_counted_whatever_the_jobs() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (urls, written) = synth(dir.path());
        assert_eq!(urls.len(), 4);
        for jobs in [1, 3, 16] {
            let done = AtomicUsize::new(0);
            let options = IndexOptions {
                jobs,
                ..IndexOptions::default()
            };
            let manifest = index_shards(&reader(), &urls, &options, &|n| {
                done.fetch_add(n as usize, Ordering::Relaxed);
            })
            .expect("index");
            assert_eq!(manifest.shards, written.shards, "jobs {jobs}");
            assert_eq!(manifest.classes, ["0", "1", "2", "3"]);
            assert_eq!(done.load(Ordering::Relaxed), urls.len());
        }
    }

    #[test]
    fn members_read_from_the_file_into_samples_are_counted_whole() {
        // Larger than the tar walk's buffer, so most of each is read from the file
        // straight into the sample.
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("big.tar");
        let mut tar = TarWriter::new(std::fs::File::create(&path).expect("create"));
        for i in 0..3u8 {
            let big = vec![i; 5 * crate::members::WALK_BUFFER + usize::from(i)];
            let sample = crate::Sample::new(format!("k{i}")).with("bin", big);
            tar.write(&sample.with("cls", b"1".to_vec()))
                .expect("write");
        }
        tar.finish().expect("finish");
        let url = path.display().to_string();
        let manifest =
            index_shards(&reader(), &[url], &IndexOptions::default(), &|_| {}).expect("index");
        let length = std::fs::metadata(&path).expect("stat").len();
        assert_eq!(
            (manifest.shards[0].samples, manifest.shards[0].bytes),
            (3, length)
        );
    }

    /// A shard of samples with these `cls` bytes (`None`: no label).
    fn labelled(path: &std::path::Path, labels: &[Option<&[u8]>]) -> String {
        let file = std::fs::File::create(path).expect("create");
        let mut tar = TarWriter::new(file);
        for (i, label) in labels.iter().enumerate() {
            let mut sample = crate::Sample::new(format!("k{i}")).with("txt", "x");
            if let Some(label) = label {
                sample = sample.with("cls", label.to_vec());
            }
            tar.write(&sample).expect("write");
        }
        tar.finish().expect("finish");
        path.display().to_string()
    }

    #[test]
    fn bad_shards_and_labels_are_named() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (mut urls, _) = synth(dir.path());
        let good = labelled(&dir.path().join("l.tar"), &[Some(b"7\n"), None, Some(b"7")]);
        let manifest =
            index_shards(&reader(), &[good], &IndexOptions::default(), &|_| {}).expect("index");
        assert_eq!(manifest.shards[0].samples, 3);
        assert_eq!(
            manifest.shards[0].class_counts,
            [("7".to_string(), 2)].into()
        );
        assert_eq!(manifest.classes.len(), 8);

        let bad = labelled(&dir.path().join("b.tar"), &[Some(b"1"), Some(b"-2")]);
        let err = index_shards(&reader(), &[bad], &IndexOptions::default(), &|_| {})
            .expect_err("negative label")
            .to_string();
        assert!(
            err.contains("b.tar: sample `k1`") && err.contains("negative"),
            "{err}"
        );

        // Cut the third of four shards short: the error names it and the offset, even
        // with the later shards read by other jobs.
        let victim = &urls[2];
        let bytes = std::fs::read(victim).expect("read");
        std::fs::write(victim, &bytes[..bytes.len() / 2 + 100]).expect("truncate");
        let err = index_shards(&reader(), &urls, &IndexOptions::default(), &|_| {})
            .expect_err("truncated shard")
            .to_string();
        assert!(
            err.contains(victim.as_str()) && err.contains("at byte"),
            "{err}"
        );

        urls.push(format!("pipe:cat {}", urls[0]));
        let err = index_shards(&reader(), &urls, &IndexOptions::default(), &|_| {})
            .expect_err("same name")
            .to_string();
        assert!(err.contains("same file name `synth-000000.tar`"), "{err}");
        let err =
            index_shards(&reader(), &[], &IndexOptions::default(), &|_| {}).expect_err("nothing");
        assert!(matches!(err, IndexError::Empty));
    }
}
