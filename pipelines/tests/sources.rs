//! Reading the same shards through every local source: paths, `file:`, `pipe:`, and
//! compressed tars; plus the failures each source must report clearly.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use pipelines::{ErrorPolicy, Sample, SampleReader, ShardError, ShardWriter, Sources};

/// Writes `n` samples into one shard in `dir` and returns its path and samples.
fn write_shard(dir: &Path, n: u32) -> (PathBuf, Vec<Sample>) {
    let mut writer =
        ShardWriter::new(dir.join("s-%06d.tar").to_string_lossy(), 1000, 1 << 40).expect("pattern");
    let mut samples = Vec::new();
    for i in 0..n {
        let sample = Sample::new(format!("sample-{i:04}"))
            .with("jpg", vec![i as u8; 100 + i as usize])
            .with_class(i % 3);
        writer.write(&sample).expect("write");
        samples.push(sample);
    }
    let shards = writer.finish().expect("finish");
    (shards[0].path.clone(), samples)
}

fn read_all(
    urls: &[String],
    policy: ErrorPolicy,
) -> Result<(Vec<Sample>, pipelines::ReadStats), ShardError> {
    SampleReader::new(Sources::default())
        .with_policy(policy)
        .collect(urls)
}

/// Key and fields of each sample.
type Normalized = Vec<(String, Vec<(String, Vec<u8>)>)>;

/// Fields sorted by name, as written.
fn normalized(samples: &[Sample]) -> Normalized {
    samples
        .iter()
        .map(|s| {
            let mut fields = s.fields.clone();
            fields.sort();
            (s.key.clone(), fields)
        })
        .collect()
}

fn compress(path: &Path, kind: &str) -> PathBuf {
    let bytes = std::fs::read(path).expect("read shard");
    let out = path.with_extension(format!("tar.{kind}"));
    let file = std::fs::File::create(&out).expect("create");
    match kind {
        "gz" => {
            let mut e = flate2::write::GzEncoder::new(file, flate2::Compression::fast());
            e.write_all(&bytes).expect("gz");
            e.finish().expect("gz finish");
        }
        "bz2" => {
            let mut e = bzip2::write::BzEncoder::new(file, bzip2::Compression::fast());
            e.write_all(&bytes).expect("bz2");
            e.finish().expect("bz2 finish");
        }
        "xz" => {
            let mut e = liblzma::write::XzEncoder::new(file, 1);
            e.write_all(&bytes).expect("xz");
            e.finish().expect("xz finish");
        }
        other => panic!("no compressor {other}"),
    }
    out
}

#[test]
fn every_local_source_yields_the_same_samples() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (path, written) = write_shard(dir.path(), 25);
    let p = path.display().to_string();
    let urls = [
        p.clone(),
        format!("file:{p}"),
        format!("file://{p}"),
        format!("pipe:cat '{p}'"),
        format!("pipe:cat '{p}'; exit 141"),
        compress(&path, "gz").display().to_string(),
        compress(&path, "bz2").display().to_string(),
        compress(&path, "xz").display().to_string(),
        format!("pipe:cat '{}'", path.with_extension("tar.gz").display()),
    ];
    for url in urls {
        let (samples, stats) = read_all(std::slice::from_ref(&url), ErrorPolicy::Fail)
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        assert_eq!(normalized(&samples), normalized(&written), "{url}");
        assert!(
            samples.iter().all(|s| *s.url == *url),
            "{url}: __url__ kept"
        );
        assert_eq!(stats.samples, 25);
    }
}

#[test]
fn failing_sources_name_the_shard_and_cause() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (path, _) = write_shard(dir.path(), 3);
    let p = path.display().to_string();
    let cases = [
        (
            "pipe:false".to_string(),
            "command `false` failed with exit status 1",
        ),
        (
            "pipe:echo no such bucket >&2; exit 3".to_string(),
            "failed with exit status 3; stderr: no such bucket",
        ),
        (
            format!("pipe:cat '{p}'; exit 2"),
            "failed with exit status 2",
        ),
        ("pipe:kill -9 $$".to_string(), "failed with signal 9"),
        (
            dir.path().join("missing.tar").display().to_string(),
            "missing.tar: cannot open",
        ),
        ("s3://bucket/x.tar".to_string(), "unsupported shard URL"),
    ];
    for (url, want) in cases {
        let err = read_all(std::slice::from_ref(&url), ErrorPolicy::Fail)
            .expect_err(&url)
            .to_string();
        assert!(err.contains(want), "{url}: `{err}` lacks `{want}`");
        assert!(
            err.starts_with(&url),
            "{url}: `{err}` does not start with the shard"
        );
    }
}

#[test]
fn skip_policy_counts_bad_shards_and_keeps_good_ones() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (path, written) = write_shard(dir.path(), 10);
    let garbage = dir.path().join("garbage.tar");
    std::fs::write(&garbage, vec![0x42u8; 5000]).expect("write garbage");
    let urls = vec![
        garbage.display().to_string(),
        "pipe:exit 4".to_string(),
        path.display().to_string(),
        dir.path().join("missing.tar").display().to_string(),
    ];
    let (samples, stats) = read_all(&urls, ErrorPolicy::Skip).expect("skip policy never fails");
    assert_eq!(normalized(&samples), normalized(&written));
    assert_eq!(stats.skipped_shards, 3);
    assert_eq!(stats.problems.len(), 3);
    assert!(
        stats.problems[0]
            .to_string()
            .contains("garbage.tar: not a valid tar stream at byte 0")
    );
}

#[test]
fn a_reader_that_stops_early_stops_the_pipe() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (path, _) = write_shard(dir.path(), 50);
    // `yes` would run forever if the reader did not kill it after stopping.
    let url = format!("pipe:cat '{}'; yes", path.display());
    let reader = SampleReader::new(Sources::default());
    let mut seen = 0;
    let stats = reader
        .read_all(&[url], &mut |_| {
            seen += 1;
            if seen == 5 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })
        .expect("read");
    assert_eq!(seen, 5);
    assert_eq!(stats.samples, 5);
}
