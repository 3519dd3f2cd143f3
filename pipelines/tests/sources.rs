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
        ("gs://bucket/x.tar".to_string(), "unsupported shard URL"),
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

/// Processes whose command line holds `marker` (live ones: a zombie's is empty).
fn processes_with(marker: &str) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|cmdline| String::from_utf8_lossy(&cmdline).replace('\0', " "))
        .filter(|cmdline| cmdline.contains(marker))
        .collect()
}

#[test]
fn a_silent_pipe_command_times_out_and_its_group_is_killed() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (path, _) = write_shard(dir.path(), 5);
    let p = path.display().to_string();
    // Sleep lengths unique to this run, so the processes can be told from anyone else's.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let unique = format!("{}{nanos}", std::process::id());
    let sleep = |n: u32| format!("sleep 6{n}.{unique}");
    let cases = [
        // Never writes.
        (format!("pipe:{}", sleep(1)), "no output for 1s"),
        // Writes the shard, but a background child holds the pipe open.
        (format!("pipe:{} & cat '{p}'", sleep(2)), "no output for 1s"),
        // The same child behind a second shell.
        (
            format!("pipe:sh -c '{} & cat {p}'", sleep(3)),
            "no output for 1s",
        ),
        // Closes its output, then never exits.
        (
            format!("pipe:cat '{p}'; exec >&-; {}", sleep(4)),
            "did not exit within 1s",
        ),
    ];
    for (n, (url, want)) in (1..).zip(cases) {
        // On a thread, so that a read that hangs fails the test instead of hanging it.
        let (tx, rx) = std::sync::mpsc::channel();
        let shard = url.clone();
        std::thread::spawn(move || {
            let reader = SampleReader::new(Sources::new(pipelines::SourceOptions {
                pipe_idle_timeout: Some(std::time::Duration::from_secs(1)),
                ..Default::default()
            }));
            let _ = tx.send(reader.collect(&[shard]).map(|_| ()));
        });
        // Generous: the point is that it ends, not how fast.
        let err = match rx.recv_timeout(std::time::Duration::from_secs(30)) {
            Ok(result) => result.expect_err(&url).to_string(),
            Err(_) => panic!("{url}: still reading after 30 s"),
        };
        assert!(err.starts_with(&url), "{url}: `{err}` names the shard");
        assert!(
            err.contains("command `"),
            "{url}: `{err}` names the command"
        );
        assert!(err.contains(want), "{url}: `{err}` lacks `{want}`");
        // SIGKILL is delivered asynchronously: allow the processes a while to go.
        let marker = sleep(n);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !processes_with(&marker).is_empty() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(processes_with(&marker), Vec::<String>::new(), "{url}");
    }
}
