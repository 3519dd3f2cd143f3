//! The local shard cache with real sources: `pipe:` commands and a loopback HTTP server.
//! Fills, hits with the remote gone, interrupted and failing reads, eviction, concurrent
//! fills and an unusable cache folder.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use pipelines::{
    CacheCounts, CacheOptions, Sample, SampleReader, ShardError, ShardWriter, SourceOptions,
    Sources,
};

/// How long a test waits for its server before calling the test failed.
const PATIENCE: Duration = Duration::from_secs(10);

/// Writes a shard of `n` samples as `dir/<name>` and returns its path and samples. Shards
/// with the same `n` and names of the same length have the same size.
fn write_shard(dir: &Path, name: &str, n: u32) -> (PathBuf, Vec<Sample>) {
    let pattern = dir.join(format!("{name}-%06d.tar"));
    let mut writer = ShardWriter::new(pattern.to_string_lossy(), 1000, 1 << 40).expect("pattern");
    let mut samples = Vec::new();
    for i in 0..n {
        let sample = Sample::new(format!("sample-{i:04}"))
            .with_class(i % 3)
            .with("jpg", vec![i as u8; 1000 + i as usize]);
        writer.write(&sample).expect("write");
        samples.push(sample);
    }
    let shards = writer.finish().expect("finish");
    (shards[0].path.clone(), samples)
}

/// A reader whose sources cache remote shards in `cache`, up to `max_bytes`.
fn reader(cache: &Path, max_bytes: u64) -> SampleReader {
    SampleReader::new(Sources::new(SourceOptions {
        http_attempts: 1,
        http_timeout: PATIENCE,
        cache: Some(CacheOptions {
            dir: cache.to_path_buf(),
            max_bytes,
        }),
        ..SourceOptions::default()
    }))
}

/// Reads `url` whole, returning its samples with `url` cleared and fields sorted (as
/// written), so that they compare with what was written.
fn read(reader: &SampleReader, url: &str) -> Result<Vec<Sample>, ShardError> {
    let mut samples = Vec::new();
    reader.read_all(&[url], &mut |mut sample| {
        assert_eq!(&*sample.url, url, "__url__ is the remote URL, hit or not");
        sample.url = "".into();
        sample.fields.sort();
        samples.push(sample);
        ControlFlow::Continue(())
    })?;
    Ok(samples)
}

fn counts(reader: &SampleReader) -> CacheCounts {
    reader.sources().cache_stats().counts()
}

/// The files in `dir` by kind: (complete entries, partial files, anything else).
fn cache_files(dir: &Path) -> (Vec<String>, Vec<String>, Vec<String>) {
    let mut kinds = (Vec::new(), Vec::new(), Vec::new());
    let listing = std::fs::read_dir(dir).map(|l| l.flatten().collect::<Vec<_>>());
    for item in listing.unwrap_or_default() {
        let name = item.file_name().to_string_lossy().into_owned();
        if name.ends_with(".shard") {
            kinds.0.push(name);
        } else if name.ends_with(".partial") {
            kinds.1.push(name);
        } else {
            kinds.2.push(name);
        }
    }
    kinds.0.sort();
    kinds
}

fn entries(dir: &Path) -> Vec<String> {
    let (complete, partial, other) = cache_files(dir);
    assert!(partial.is_empty(), "partial files left: {partial:?}");
    assert!(other.is_empty(), "stray files: {other:?}");
    complete
}

/// A loopback HTTP server that answers every request with one shard.
struct Server {
    url: String,
    stop: Arc<AtomicBool>,
    thread: JoinHandle<usize>,
}

impl Server {
    /// Serves `path` under `/shards/<file name>`, each request on a thread of its own.
    fn start(path: &Path) -> Self {
        let body: Arc<[u8]> = std::fs::read(path).expect("read shard").into();
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let name = path.file_name().expect("file name").to_string_lossy();
        let url = format!(
            "http://{}/shards/{name}",
            listener.local_addr().expect("bound")
        );
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut answering = Vec::new();
            while let Ok((stream, _)) = listener.accept() {
                if stopping.load(Ordering::SeqCst) {
                    break;
                }
                let body = Arc::clone(&body);
                answering.push(std::thread::spawn(move || answer(stream, &body)));
            }
            let answered = answering.len();
            for thread in answering {
                let _ = thread.join();
            }
            answered
        });
        Self { url, stop, thread }
    }

    /// Closes the port once the requests in hand are answered; returns how many were.
    fn stop(self) -> usize {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop, which then sees the flag.
        let address = self.url["http://".len()..]
            .split('/')
            .next()
            .unwrap_or_default();
        let _ = TcpStream::connect(address);
        self.thread.join().expect("server thread")
    }
}

/// Reads a request head and sends `body` with its length.
fn answer(stream: TcpStream, body: &[u8]) {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
        line.clear();
    }
    let mut stream = reader.into_inner();
    let head = format!(
        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    // A client that stops early closes the socket; that is its choice.
    let _ = stream
        .write_all(head.as_bytes())
        .and_then(|()| stream.write_all(body));
}

/// A remote shard and how to take it away.
enum Remote {
    /// `pipe:cat` of a file, gone once the file is deleted.
    Pipe(PathBuf),
    /// An HTTP server, gone once stopped.
    Http(Server),
}

impl Remote {
    fn pipe(path: &Path) -> (String, Self) {
        (
            format!("pipe:cat '{}'", path.display()),
            Self::Pipe(path.to_path_buf()),
        )
    }

    fn http(path: &Path) -> (String, Self) {
        let server = Server::start(path);
        (server.url.clone(), Self::Http(server))
    }

    fn take_away(self) {
        match self {
            Self::Pipe(path) => std::fs::remove_file(path).expect("delete shard"),
            Self::Http(server) => assert_eq!(server.stop(), 1, "requests answered"),
        }
    }
}

#[test]
fn a_remote_shard_is_filled_once_then_read_from_the_cache() {
    let dir = tempfile::tempdir().expect("temp dir");
    type Make = fn(&Path) -> (String, Remote);
    let cases: [(&str, bool, Make); 3] = [
        ("pipe", false, Remote::pipe),
        ("gzip pipe", true, Remote::pipe),
        ("http", false, Remote::http),
    ];
    let uncached = SampleReader::new(Sources::new(SourceOptions {
        http_attempts: 1,
        ..SourceOptions::default()
    }));
    for (i, (name, compressed, make)) in cases.into_iter().enumerate() {
        let (tar, written) = write_shard(dir.path(), &format!("case{i}"), 30);
        let path = if compressed { gzip(&tar) } else { tar };
        let cache = dir.path().join(format!("cache{i}"));
        let reader = reader(&cache, 1 << 30);
        let (url, remote) = make(&path);

        let first = read(&reader, &url).unwrap_or_else(|e| panic!("{name}: first read: {e}"));
        assert!(first == written, "{name}: first read's samples");
        let stored = entries(&cache);
        assert_eq!(stored.len(), 1, "{name}: one entry after the fill");
        let cached = std::fs::read(cache.join(&stored[0])).expect("read entry");
        let remote_bytes = std::fs::read(&path).expect("read shard");
        assert!(
            cached == remote_bytes,
            "{name}: the entry holds the bytes as stored"
        );

        remote.take_away();
        assert!(read(&uncached, &url).is_err(), "{name}: the remote is gone");

        let second = read(&reader, &url).unwrap_or_else(|e| panic!("{name}: second read: {e}"));
        assert!(second == written, "{name}: the hit's samples");
        assert_eq!(entries(&cache), stored, "{name}: entries after the hit");
        let want = CacheCounts {
            hits: 1,
            misses: 1,
            fills: 1,
            ..CacheCounts::default()
        };
        assert_eq!(counts(&reader), want, "{name}");
    }
}

fn gzip(path: &Path) -> PathBuf {
    let bytes = std::fs::read(path).expect("read shard");
    let out = path.with_extension("tar.gz");
    let file = std::fs::File::create(&out).expect("create");
    let mut encoder = flate2::write::GzEncoder::new(file, flate2::Compression::fast());
    encoder.write_all(&bytes).expect("gzip");
    encoder.finish().expect("gzip finish");
    out
}

#[test]
fn a_read_stopped_early_keeps_nothing() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (path, _) = write_shard(dir.path(), "s", 50);
    let server = Server::start(&path);
    let urls = [format!("pipe:cat '{}'", path.display()), server.url.clone()];
    for (i, url) in urls.iter().enumerate() {
        let cache = dir.path().join(format!("cache{i}"));
        let reader = reader(&cache, 1 << 30);
        let mut seen = 0;
        reader
            .read_all(&[url], &mut |_| {
                seen += 1;
                if seen == 5 {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            })
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        assert_eq!(seen, 5, "{url}");
        assert_eq!(entries(&cache), Vec::<String>::new(), "{url}");
        let counts = counts(&reader);
        assert_eq!(
            (counts.misses, counts.fills, counts.discarded),
            (1, 0, 1),
            "{url}: {counts:?}"
        );
    }
    assert_eq!(server.stop(), 1, "requests answered");
}

#[test]
fn failing_commands_leave_nothing_cached() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (path, _) = write_shard(dir.path(), "s", 10);
    let cache = dir.path().join("cache");
    let reader = reader(&cache, 1 << 30);
    let urls = [
        format!("pipe:cat '{}'; exit 1", path.display()),
        "pipe:exit 1".to_string(),
    ];
    for url in &urls {
        let err = read(&reader, url).expect_err(url);
        assert!(err.to_string().starts_with(url.as_str()), "{url}: {err}");
        assert_eq!(entries(&cache), Vec::<String>::new(), "{url}");
    }
    let counts = counts(&reader);
    assert_eq!(
        (counts.misses, counts.fills, counts.discarded),
        (2, 0, 2),
        "{counts:?}"
    );
}

#[test]
fn the_least_recently_used_shard_is_evicted() {
    let dir = tempfile::tempdir().expect("temp dir");
    const NAMES: [&str; 3] = ["a", "b", "c"];
    let shards: Vec<_> = NAMES
        .iter()
        .map(|name| write_shard(dir.path(), name, 20).0)
        .collect();
    let size = std::fs::metadata(&shards[0]).expect("shard").len();
    let url = |i: usize| format!("pipe:cat '{}'", shards[i].display());
    // Whether shard `i` has an entry (the shards hold the same bytes; entry names end
    // with the tail of the URL).
    let cached = |cache: &Path, i: usize| {
        let tail = format!("_{}-000000.tar.", NAMES[i]);
        entries(cache).iter().any(|e| e.contains(&tail))
    };

    // Room for two shards: fill a, fill b, use a again, fill c: b goes.
    let cache = dir.path().join("cache");
    let reader = reader(&cache, size * 5 / 2);
    for (i, hits) in [(0, 0), (1, 0), (0, 1), (2, 1)] {
        read(&reader, &url(i)).unwrap_or_else(|e| panic!("shard {i}: {e}"));
        assert_eq!(counts(&reader).hits, hits, "after shard {i}");
    }
    assert!(cached(&cache, 0), "a was used last but one");
    assert!(!cached(&cache, 1), "b was least recently used");
    assert!(cached(&cache, 2), "c was just written");
    assert_eq!(entries(&cache).len(), 2);
    assert_eq!(counts(&reader).evictions, 1);

    // A shard larger than the whole cache is read but not kept.
    let small = dir.path().join("small");
    let reader = self::reader(&small, size / 2);
    assert_eq!(read(&reader, &url(0)).expect("read").len(), 20);
    assert_eq!(entries(&small), Vec::<String>::new());
    assert_eq!(counts(&reader).discarded, 1);
}

#[test]
fn concurrent_fills_of_one_shard_agree() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (path, written) = write_shard(dir.path(), "s", 40);
    let threads = 6;
    let server = Server::start(&path);
    let urls = [format!("pipe:cat '{}'", path.display()), server.url.clone()];
    let mut misses = Vec::new();
    for (i, url) in urls.iter().enumerate() {
        let cache = dir.path().join(format!("cache{i}"));
        let reader = reader(&cache, 1 << 30);
        std::thread::scope(|scope| {
            let running: Vec<_> = (0..threads)
                .map(|_| scope.spawn(|| read(&reader, url)))
                .collect();
            for thread in running {
                let samples = thread.join().expect("reader thread");
                let samples = samples.unwrap_or_else(|e| panic!("{url}: {e}"));
                assert!(samples == written, "{url}: samples");
            }
        });
        assert_eq!(entries(&cache).len(), 1, "{url}");
        let after = read(&reader, url).unwrap_or_else(|e| panic!("{url}: {e}"));
        assert!(after == written, "{url}: samples from the cache");
        let counts = counts(&reader);
        assert_eq!(
            counts.hits + counts.misses,
            threads as u64 + 1,
            "{url}: {counts:?}"
        );
        assert!(counts.hits >= 1, "{url}: {counts:?}");
        assert_eq!(
            counts.fills + counts.discarded,
            counts.misses,
            "{url}: {counts:?}"
        );
        misses.push(counts.misses);
    }
    assert_eq!(server.stop() as u64, misses[1], "one HTTP request per miss");
}

#[test]
fn an_unwritable_cache_folder_still_reads() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (path, written) = write_shard(dir.path(), "s", 10);
    let blocker = dir.path().join("not-a-folder");
    std::fs::write(&blocker, b"").expect("write");
    // Under a regular file: no user, root included, can create it.
    let reader = reader(&blocker.join("cache"), 1 << 30);
    let url = format!("pipe:cat '{}'", path.display());
    for _ in 0..2 {
        let samples = read(&reader, &url).expect("reads uncached");
        assert!(samples == written);
    }
    // One error creating the folder, then one per shard that could not be kept.
    let want = CacheCounts {
        misses: 2,
        discarded: 2,
        errors: 3,
        ..CacheCounts::default()
    };
    assert_eq!(counts(&reader), want);
}
