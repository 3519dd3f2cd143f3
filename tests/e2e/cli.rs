//! End-to-end tests of the `imgrun` binary: real processes, real shards, real sockets on
//! loopback.

mod examples;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::Stdio;

use crate::common::{Server, describe, imgrun, run_ok};

/// Generates a small synthetic dataset and returns its folder and brace spec.
fn small_dataset(dir: &Path) -> (PathBuf, String) {
    let out = dir.join("shards");
    let printed = run_ok(
        &[
            "shards",
            "synth",
            out.to_str().expect("utf-8 path"),
            "--classes",
            "3",
            "--per-class",
            "20",
            "--size",
            "32",
            "--maxcount",
            "25",
        ],
        dir,
    );
    let spec = printed.lines().last().expect("spec line").to_string();
    (out, spec)
}

#[test]
fn synth_ls_sum_and_verify_agree() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (out, spec) = small_dataset(dir.path());
    assert!(spec.contains("{000000..000002}"), "spec: {spec}");
    assert!(out.join("manifest.json").is_file() && out.join("classes.txt").is_file());

    let listing = run_ok(&["shards", "ls", &spec], dir.path());
    let counts: Vec<u64> = listing
        .lines()
        .map(|l| {
            l.split('\t')
                .nth(1)
                .and_then(|c| c.split(' ').next())
                .and_then(|c| c.parse().ok())
                .expect("count")
        })
        .collect();
    assert_eq!(counts, [25, 25, 10], "listing:\n{listing}");

    let names: Vec<String> = (0..3)
        .map(|i| out.join(format!("synth-{i:06}.tar")).display().to_string())
        .collect();
    let summed = imgrun()
        .args(["shards", "sum"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child
                .stdin
                .take()
                .expect("stdin")
                .write_all(names.join("\n").as_bytes())?;
            child.wait_with_output()
        })
        .expect("run shards sum");
    assert_eq!(String::from_utf8_lossy(&summed.stdout).trim(), spec);

    let verified = run_ok(&["shards", "verify", &spec], dir.path());
    assert!(
        verified.contains("60 samples, 60 images, 0 problems"),
        "{verified}"
    );
}

#[test]
fn verify_checks_labels_against_the_class_count() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (out, spec) = small_dataset(dir.path());
    let verify = |extra: &[&str]| {
        imgrun()
            .args(["shards", "verify", &spec])
            .args(extra)
            .current_dir(dir.path())
            .output()
            .expect("run verify")
    };
    // Three classes in the manifest, labels 0 to 2: all fine.
    let fine = verify(&[]);
    assert!(fine.status.success(), "{}", describe(&fine));
    // Fewer classes, from the flag or from the manifest beside the shards, as training
    // would be told: the samples of class 2 are out of range.
    let manifest_path = out.join("manifest.json");
    let text = std::fs::read_to_string(&manifest_path).expect("manifest");
    let mut manifest: serde_json::Value = serde_json::from_str(&text).expect("json");
    manifest["classes"] = serde_json::json!(["circle", "square"]);
    for (extra, manifest) in [(&["--classes", "2"][..], None), (&[][..], Some(&manifest))] {
        if let Some(manifest) = manifest {
            std::fs::write(&manifest_path, manifest.to_string()).expect("write manifest");
        }
        let result = verify(extra);
        let stdout = String::from_utf8_lossy(&result.stdout);
        assert!(!result.status.success(), "{}", describe(&result));
        assert!(
            stdout.contains(": label 2 is outside the 2 classes (0 to 1)"),
            "{extra:?}: {stdout}"
        );
        assert!(stdout.contains("synth-0000"), "{stdout} names the shard");
    }
}

#[test]
fn verify_reports_corruption_with_shard_and_offset() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (out, spec) = small_dataset(dir.path());
    let victim = out.join("synth-000001.tar");
    let bytes = std::fs::read(&victim).expect("read shard");
    std::fs::write(&victim, &bytes[..bytes.len() / 2 + 100]).expect("truncate shard");

    let result = imgrun()
        .args(["shards", "verify", &spec])
        .output()
        .expect("run verify");
    assert!(
        !result.status.success(),
        "verify passed a truncated shard:\n{}",
        describe(&result)
    );
    let stdout = String::from_utf8_lossy(&result.stdout);
    assert!(
        stdout.contains("synth-000001.tar: not a valid tar stream at byte"),
        "{stdout}"
    );

    // Reading with the default policy fails, naming the shard; `skip` goes on and counts.
    let failed = imgrun()
        .args(["shards", "dump", &spec])
        .output()
        .expect("run dump");
    assert!(!failed.status.success());
    assert!(
        String::from_utf8_lossy(&failed.stderr).contains("synth-000001.tar"),
        "{}",
        describe(&failed)
    );
    let skipped = imgrun()
        .args(["shards", "dump", &spec, "--on-error", "skip"])
        .output()
        .expect("run dump");
    assert!(skipped.status.success(), "{}", describe(&skipped));
    assert!(
        String::from_utf8_lossy(&skipped.stderr).contains("1 skipped shards"),
        "{}",
        describe(&skipped)
    );
}

/// One client (127.0.0.1) asks for a large shard on 96 connections and reads none of it,
/// with the default limits: 64 slots, at most 32 to one client, a 60 s send timeout. Once
/// the server has every one of those requests, a client at another address (127.0.0.2)
/// asks for a small shard. Without the share per client its request would queue behind
/// the 32 that wait for a slot, for the whole send timeout; with it, 32 stalled replies
/// hold slots, the others wait for the client's own, and the other client is answered.
#[test]
fn one_client_that_stops_reading_never_holds_every_slot() {
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpStream};
    use std::time::{Duration, Instant};
    const CONNECTIONS: usize = 96;
    // Far below the 60 s send timeout that would otherwise free a slot.
    const LIMIT: Duration = Duration::from_secs(20);

    let dir = tempfile::tempdir().expect("temp dir");
    let big = std::fs::File::create(dir.path().join("big.tar")).expect("create");
    big.set_len(32 << 20).expect("grow");
    std::fs::write(dir.path().join("small.tar"), b"small").expect("write");
    // A debug line for each request the server has read, before it waits for a slot.
    let server = Server::start_with(dir.path(), &[("IMGRUN_LOG", "warn,imgrun::serve=debug")]);
    let addr: SocketAddr = server
        .url
        .trim_start_matches("http://")
        .parse()
        .expect("the server's address");
    let head =
        |path: &str| format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
    let stalled: Vec<TcpStream> = (0..CONNECTIONS)
        .map(|_| {
            let mut stream = TcpStream::connect(addr).expect("connect");
            stream
                .write_all(head("/big.tar").as_bytes())
                .expect("send request");
            stream
        })
        .collect();
    let deadline = Instant::now() + LIMIT;
    let mut received = 0;
    while received < CONNECTIONS {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = server
            .log
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("the server read {received} of {CONNECTIONS} requests"));
        if line.contains("request waits for a slot") && line.contains("/big.tar") {
            received += 1;
        }
    }
    // Another client: the same server from another loopback address.
    let socket =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    socket
        .bind(&SocketAddr::from(([127, 0, 0, 2], 0)).into())
        .expect("bind 127.0.0.2");
    socket
        .connect(&addr.into())
        .expect("connect from 127.0.0.2");
    let mut other: TcpStream = socket.into();
    other.set_read_timeout(Some(LIMIT)).expect("timeout");
    other
        .write_all(head("/small.tar").as_bytes())
        .expect("send request");
    let mut reply = Vec::new();
    other
        .read_to_end(&mut reply)
        .expect("the other client is answered while the stalled replies hold their slots");
    let reply = String::from_utf8_lossy(&reply);
    assert!(
        reply.starts_with("HTTP/1.1 200") && reply.ends_with("\r\n\r\nsmall"),
        "{reply}"
    );
    drop(stalled);
}

/// 64 clients that request a shard far larger than the socket buffers and never read it
/// hold every slot (`max_in_flight` is 64), and 64 more connect and never send anything.
/// A fresh request is still answered (once the stalled ones have passed the send
/// timeout), and the server closes every stalled and every silent connection.
#[test]
fn stalled_readers_and_silent_connections_cost_the_server_nothing_for_long() {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::time::{Duration, Instant};
    const CLIENTS: usize = 64;
    const BIG: u64 = 32 << 20;
    // Generous: the timeouts are 1 s; this is the most any step may take.
    const LIMIT: Duration = Duration::from_secs(30);

    let dir = tempfile::tempdir().expect("temp dir");
    // Sparse: 32 MiB of zeros costs no disk.
    let big = std::fs::File::create(dir.path().join("big.tar")).expect("create");
    big.set_len(BIG).expect("grow");
    std::fs::write(dir.path().join("small.tar"), b"small").expect("write");
    let server = Server::start_with(
        dir.path(),
        &[
            ("IMGRUN_SERVE__HEADER_TIMEOUT_SECS", "1"),
            ("IMGRUN_SERVE__SEND_TIMEOUT_SECS", "1"),
            ("IMGRUN_SERVE__MAX_IN_FLIGHT", "64"),
            // Every slot to the one client, as if it were a proxy for all.
            ("IMGRUN_SERVE__MAX_PER_CLIENT", "64"),
            // The access log, which says when a reply is given up.
            ("IMGRUN_LOG", "info"),
        ],
    );
    let addr = server.url.trim_start_matches("http://").to_string();
    let request = |path: &str| {
        let mut stream = TcpStream::connect(&addr).expect("connect");
        stream.set_read_timeout(Some(LIMIT)).expect("timeout");
        let head = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
        stream.write_all(head.as_bytes()).expect("send request");
        stream
    };
    // Each stalled reader takes the first bytes of its reply, so it holds a slot, then
    // reads no more.
    let mut stalled: Vec<TcpStream> = (0..CLIENTS)
        .map(|_| {
            let mut stream = request("/big.tar");
            let mut head = [0; 12];
            stream.read_exact(&mut head).expect("the reply starts");
            assert_eq!(&head, b"HTTP/1.1 200");
            stream
        })
        .collect();
    let mut silent: Vec<TcpStream> = (0..CLIENTS)
        .map(|_| TcpStream::connect(&addr).expect("connect"))
        .collect();

    let asked = Instant::now();
    let mut reply = Vec::new();
    let answered = request("/small.tar").read_to_end(&mut reply);
    eprintln!("fresh request answered after {:?}", asked.elapsed());
    answered.expect("the fresh request is answered in time");
    let reply = String::from_utf8_lossy(&reply);
    assert!(
        reply.starts_with("HTTP/1.1 200") && reply.ends_with("\r\n\r\nsmall"),
        "{reply}"
    );

    // The server gives up every stalled response (its access log says so) ...
    let deadline = Instant::now() + LIMIT;
    let mut abandoned = 0;
    while abandoned < CLIENTS {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = server
            .log
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("{abandoned} of {CLIENTS} stalled replies given up"));
        if line.contains("path=/big.tar") && line.contains("complete=false") {
            abandoned += 1;
        }
    }
    // ... and closes their connections: reading ends (EOF or reset) before the whole
    // shard came. Silent connections end without a byte.
    let received = |stream: &mut TcpStream| -> u64 {
        let mut buffer = vec![0; 1 << 20];
        let mut total = 0u64;
        loop {
            match stream.read(&mut buffer) {
                Ok(0) => return total,
                Ok(n) => total += n as u64,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return total,
                Err(e) => panic!("the connection is still open after {total} bytes: {e}"),
            }
        }
    };
    for (i, stream) in stalled.iter_mut().enumerate() {
        let got = received(stream);
        assert!(got < BIG, "stalled reader {i} got all {got} bytes");
    }
    for (i, stream) in silent.iter_mut().enumerate() {
        assert_eq!(received(stream), 0, "silent connection {i}");
    }
}

#[test]
fn files_http_and_pipes_yield_identical_samples() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (out, spec) = small_dataset(dir.path());
    let server = Server::start(&out);
    let names = "synth-{000000..000002}.tar";
    let from_file = run_ok(&["shards", "dump", &spec], dir.path());
    assert_eq!(from_file.lines().count(), 120, "two fields per sample");
    let http_base = format!("{}/%s", server.url);
    let variants: Vec<Vec<String>> = vec![
        vec!["--base".into(), http_base.clone()],
        vec!["--base".into(), format!("pipe:curl -s -f {http_base}")],
        vec!["--base".into(), format!("pipe:cat {}/%s", out.display())],
    ];
    for extra in variants {
        let mut args = vec!["shards".to_string(), "dump".to_string(), names.to_string()];
        args.extend(extra.iter().cloned());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        assert_eq!(run_ok(&args, dir.path()), from_file, "imgrun {args:?}");
    }

    // A missing shard over HTTP is a clear error naming the URL and the status.
    let missing = format!("{}/nope.tar", server.url);
    let result = imgrun()
        .args(["shards", "ls", &missing])
        .output()
        .expect("run ls");
    assert!(!result.status.success());
    let stdout = String::from_utf8_lossy(&result.stdout);
    assert!(
        stdout.contains(&missing) && stdout.contains("404"),
        "{}",
        describe(&result)
    );
}

/// A report piped into a reader that stops early (`| head -1`) ends quietly, as `cat`
/// does: killed by SIGPIPE, no panic on stderr.
#[test]
fn a_report_into_a_closed_pipe_ends_quietly() {
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir().expect("temp dir");
    let mut child = imgrun()
        .args(["shards", "synth"])
        .arg(dir.path().join("many"))
        .args(["--classes", "2", "--per-class", "1500", "--size", "8"])
        .args(["--maxcount", "1", "--threads", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run imgrun");
    // Read one line, then close the pipe while 3000 report lines (more than a pipe holds) are still to come.
    let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
    let mut first = String::new();
    stdout.read_line(&mut first).expect("first line");
    drop(stdout);
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut stderr)
        .expect("stderr");
    let status = child.wait().expect("wait");
    assert!(first.starts_with("wrote 3000 samples"), "{first}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(status.signal(), Some(libc::SIGPIPE), "{status}: {stderr}");
}

#[test]
fn doctor_runs_a_tensor_op() {
    let dir = tempfile::tempdir().expect("temp dir");
    let report = run_ok(&["doctor"], dir.path());
    assert!(report.contains("tensor smoke test: ok"), "{report}");
    assert!(report.contains("libtorch:         2.11.0"), "{report}");
    // The torch wheel carries NCCL; it loads without a GPU.
    assert!(report.contains("nccl:             2."), "{report}");
    assert!(
        report.contains("config:           built-in defaults"),
        "{report}"
    );
}

#[test]
fn config_mistakes_name_the_key_and_file() {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(
        dir.path().join("cluster.toml"),
        "[shards]\nread_bufer = 4096\n",
    )
    .expect("write config");
    let result = imgrun()
        .arg("doctor")
        .current_dir(dir.path())
        .output()
        .expect("run doctor");
    assert!(!result.status.success());
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(
        stderr.contains("read_bufer") && stderr.contains("cluster.toml"),
        "{stderr}"
    );

    // The environment overrides files, and is checked the same way.
    let result = imgrun()
        .arg("doctor")
        .env("IMGRUN_SHARDS__ERROR_POLICY", "sometimes")
        .current_dir(std::env::temp_dir())
        .output()
        .expect("run doctor");
    assert!(!result.status.success());
    assert!(
        String::from_utf8_lossy(&result.stderr).contains("error_policy"),
        "{}",
        describe(&result)
    );

    // A bad value is blamed on where it was set: the exact variable, the `--set` item, the
    // file; never on the built-in defaults.
    let empty = tempfile::tempdir().expect("temp dir");
    type Vars = &'static [(&'static str, &'static str)];
    let cases: [(Vars, &[&str], &str); 6] = [
        (
            &[("IMGRUN_SHARDS__ERROR_POLICY", "sometimes")],
            &["doctor"],
            "the environment variable IMGRUN_SHARDS__ERROR_POLICY",
        ),
        (
            &[("IMGRUN_SHARDS__READ_BUFFER", "big")],
            &["doctor"],
            "the environment variable IMGRUN_SHARDS__READ_BUFFER",
        ),
        (
            &[("IMGRUN_CLUSTER__BIND", "everywhere")],
            &["doctor"],
            "the environment variable IMGRUN_CLUSTER__BIND",
        ),
        (
            &[],
            &[
                "plan",
                "--shards",
                "x.tar",
                "--set",
                "train.batch_size=\"many\"",
            ],
            "`--set train.batch_size=\"many\"`",
        ),
        // Out of range: refused at load, naming the key and where it was set.
        (
            &[("IMGRUN_TRAIN__LR", "nan")],
            &["plan", "--shards", "x.tar"],
            "the environment variable IMGRUN_TRAIN__LR",
        ),
        (
            &[],
            &[
                "plan",
                "--shards",
                "x.tar",
                "--set",
                "data.image_size=100000",
            ],
            "`--set data.image_size=100000`",
        ),
    ];
    for (env, args, want) in cases {
        let result = imgrun()
            .args(args)
            .envs(env.iter().copied())
            .current_dir(empty.path())
            .output()
            .expect("run imgrun");
        let stderr = String::from_utf8_lossy(&result.stderr);
        assert!(!result.status.success(), "{env:?} {args:?}: {stderr}");
        assert!(
            stderr.contains(want),
            "{env:?} {args:?}: `{stderr}` lacks `{want}`"
        );
        assert!(!stderr.contains("built-in defaults"), "{stderr}");
    }

    // Every command says which file it read.
    std::fs::write(
        dir.path().join("cluster.toml"),
        "[shards]\nread_buffer = 4096\n",
    )
    .expect("write config");
    let out2 = imgrun()
        .args(["shards", "sum", "a-000000.tar"])
        .current_dir(dir.path())
        .output()
        .expect("run shards sum");
    let path = dir
        .path()
        .canonicalize()
        .expect("canonical")
        .join("cluster.toml");
    assert!(
        String::from_utf8_lossy(&out2.stderr)
            .contains(&format!("imgrun: configuration from {}", path.display())),
        "{}",
        describe(&out2)
    );
}

/// `imgrun demo` from a folder with a `cluster.toml` (the checkout's own, or a user's
/// ImageNet job) still runs the demo's job: the small CNN on two CPU trainers for the
/// demo's epochs, with the file's `[shards]` honoured and its job sections set aside out
/// loud. The checkout's own file sets nothing aside.
#[test]
fn the_demo_runs_its_own_job_whatever_cluster_toml_is_in_the_folder() {
    let checkout = concat!(env!("CARGO_MANIFEST_DIR"), "/cluster.toml");
    let user = "[shards]\nread_buffer = 65536\n\n[data]\nmode = \"split\"\nimage_size = 224\n\n\
                [model]\nname = \"resnet50\"\n\n[train]\nepochs = 90\ncpu_trainers = 1\n";
    for (name, text) in [
        (
            "the checkout's",
            std::fs::read_to_string(checkout).expect("read cluster.toml"),
        ),
        ("a user's", user.to_string()),
    ] {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("cluster.toml"), &text).expect("write config");
        // A tiny, short demo: this checks the job it runs, not its accuracy.
        let out = imgrun()
            .args(["demo", "--per-class", "8", "--val-per-class", "2"])
            .args(["--set", "train.epochs=1", "--set", "train.batch_size=16"])
            .env("IMGRUN_TRAIN__EPOCHS", "90")
            .current_dir(dir.path())
            .output()
            .expect("run demo");
        let stdout = String::from_utf8_lossy(&out.stdout);
        for want in [
            "small_cnn",
            "2 CPU trainer(s)",
            "configuration from",
            "IMGRUN_TRAIN__EPOCHS",
        ] {
            assert!(
                stdout.contains(want),
                "{name}: lacks `{want}`:\n{}",
                describe(&out)
            );
        }
        assert!(
            stdout.contains("epoch 0") || stdout.contains("    0 "),
            "{name}: no epoch ran:\n{}",
            describe(&out)
        );
        assert!(!stdout.contains("resnet50"), "{name}: {}", describe(&out));
        let sets_aside = stdout.contains("[data], [model], [train]");
        assert_eq!(sets_aside, name == "a user's", "{name}: {}", describe(&out));
        // The job, run here without a cluster, keeps its log as a coordinator does.
        let log = job_log_under(dir.path()).expect("a job.log in the demo's run folder");
        let first = log.lines().next().unwrap_or_default();
        assert!(first.contains("Z "), "{name}: a stamped line: {first}");
        let last = log.lines().last().unwrap_or_default();
        assert!(last.contains(" job succeeded: done: "), "{name}: {log}");
    }
}

/// The text of the first `job.log` found under `dir`.
fn job_log_under(dir: &std::path::Path) -> Option<String> {
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if let Some(log) = job_log_under(&path) {
                return Some(log);
            }
        } else if path.file_name().is_some_and(|n| n == "job.log") {
            return std::fs::read_to_string(path).ok();
        }
    }
    None
}

/// Decentralized training lands in AllReduce's accuracy band on the demo's data within
/// the same epochs: `imgrun demo` with four CPU trainers, once averaging gradients and
/// once each rank averaging its parameters with one peer per step (one-peer-exponential),
/// on a smaller demo (600 images per class, batches of 32 per rank, the demo's 10
/// epochs). The runs are deterministic; on this data they reached 88.7% and 87.8%.
#[test]
fn four_decentralized_trainers_reach_allreduces_accuracy_on_the_demo() {
    let dir = tempfile::tempdir().expect("temp dir");
    let top1 = |sync: &str| -> f64 {
        let out = imgrun()
            .args(["demo", "--per-class", "600", "--val-per-class", "100"])
            .args(["--out", &dir.path().join("demo").display().to_string()])
            .args([
                "--set",
                "train.cpu_trainers=4",
                "--set",
                "train.batch_size=32",
            ])
            .args(["--set", &format!("train.sync=\"{sync}\"")])
            .current_dir(dir.path())
            .output()
            .expect("run demo");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains("4 CPU trainer(s)"),
            "{sync}: {}",
            describe(&out)
        );
        stdout
            .lines()
            .find_map(|line| line.split_once("validation top-1 "))
            .and_then(|(_, rest)| rest.split_once('%'))
            .and_then(|(number, _)| number.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{sync}: no final top-1:\n{}", describe(&out)))
    };
    let allreduce = top1("allreduce");
    let decentralized = top1("decentralized");
    eprintln!("top-1: allreduce {allreduce:.2}%, decentralized {decentralized:.2}%");
    assert!(allreduce > 80.0, "allreduce reached only {allreduce:.2}%");
    assert!(
        decentralized > allreduce - 3.0,
        "decentralized reached {decentralized:.2}%, allreduce {allreduce:.2}%"
    );
}

#[test]
fn create_from_the_repository_photos() {
    let photos = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/photos");
    assert!(photos.is_dir(), "{} is absent", photos.display());
    let dir = tempfile::tempdir().expect("temp dir");
    let src = dir.path().join("src");
    let mut copied = 0;
    for (i, entry) in std::fs::read_dir(&photos)
        .expect("list photos")
        .flatten()
        .enumerate()
    {
        let name = entry.file_name().to_string_lossy().to_lowercase();
        if !(name.ends_with(".jpg") || name.ends_with(".png")) {
            continue;
        }
        let class = src.join(if i % 2 == 0 { "even" } else { "odd" });
        std::fs::create_dir_all(&class).expect("class dir");
        std::fs::copy(entry.path(), class.join(entry.file_name())).expect("copy photo");
        copied += 1;
    }
    let out = dir.path().join("out");
    let printed = run_ok(
        &[
            "shards",
            "create",
            src.to_str().expect("utf-8"),
            out.to_str().expect("utf-8"),
            "--prefix",
            "photos",
            "--maxcount",
            "5",
            "--resize",
            "64",
        ],
        dir.path(),
    );
    let spec = printed.lines().last().expect("spec line");
    let verified = run_ok(&["shards", "verify", spec], dir.path());
    assert!(
        verified.contains(&format!("{copied} samples, {copied} images, 0 problems")),
        "{verified}"
    );
}

/// The WebDataset `simdist` example: 10 shards over 3 ranks x 3 workers, batch 10, no
/// partial batches (`--policy none`). The ranks disagree; `--nbatches 26` and `--nbatches
/// 32 --dsrepeat 2` make them agree; the join policy keeps partial batches, as jobs do.
#[test]
fn plan_reproduces_the_simdist_example() {
    let dir = tempfile::tempdir().expect("temp dir");
    let shards: Vec<serde_json::Value> = (0..10)
        .map(|i| serde_json::json!({"name": format!("s-{i:06}.tar"), "samples": 86 + i, "bytes": 0, "class_counts": {}}))
        .collect();
    let manifest = serde_json::json!({"version": 1, "classes": [], "shards": shards});
    std::fs::write(dir.path().join("manifest.json"), manifest.to_string()).expect("write manifest");
    let spec = format!("{}/s-{{000000..000009}}.tar", dir.path().display());
    // The shards must exist, as for a job: a missing one is named, not planned as `?`.
    let out = imgrun()
        .args(["plan", "--shards", &spec])
        .output()
        .expect("run plan");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{}", describe(&out));
    assert!(
        stderr.contains("no such shard") && stderr.contains("s-000000.tar"),
        "{stderr}"
    );
    // The plan reads only their counts.
    for i in 0..10 {
        std::fs::write(dir.path().join(format!("s-{i:06}.tar")), b"").expect("write shard");
    }
    let base = [
        "plan",
        "--shards",
        &spec,
        "--nodes",
        "3",
        "--loader-workers",
        "3",
        "--batch-size",
        "10",
        "--mode",
        "split",
    ];
    let cases: &[(&[&str], bool, &str)] = &[
        (
            &["--policy", "none"],
            false,
            "rank 0: 35, rank 1: 26, rank 2: 26",
        ),
        (&["--nbatches", "26"], true, "every rank runs 26 steps"),
        (
            &["--nbatches", "32"],
            false,
            "rank 0: 32, rank 1: 26, rank 2: 26",
        ),
        (
            &["--nbatches", "32", "--dsrepeat", "2"],
            true,
            "every rank runs 32 steps",
        ),
        // As `imgrun train` runs it: split + join keeps each worker's partial batch.
        (&["--policy", "join"], true, "every rank runs 38 steps"),
    ];
    for (extra, ok, want) in cases {
        let out = imgrun().args(base).args(*extra).output().expect("run plan");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(out.status.success(), *ok, "{extra:?}:\n{text}");
        assert!(text.contains(want), "{extra:?}: lacks `{want}`:\n{text}");
    }

    // A decentralized job's plan shows its topology's schedule, in text and JSON; an
    // unknown topology is refused, naming the key.
    let decentralized = [
        "--policy",
        "join",
        "--set",
        "train.sync=\"decentralized\"",
        "--set",
        "train.topology=\"ring\"",
    ];
    let out = imgrun()
        .args(base)
        .args(decentralized)
        .output()
        .expect("run plan");
    let stdout = String::from_utf8_lossy(&out.stdout);
    for want in [
        "sync        decentralized, ring topology; the groups repeat every 3 step(s):",
        "step 0: {0} {1,2}",
        "step 1: {0,2} {1}",
    ] {
        assert!(stdout.contains(want), "lacks `{want}`:\n{}", describe(&out));
    }
    let out = imgrun()
        .args(base)
        .args(decentralized)
        .arg("--json")
        .output()
        .expect("run plan");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("plan --json");
    assert_eq!(json["sync"], "decentralized", "{json}");
    assert_eq!(json["topology"], "ring", "{json}");
    assert_eq!(
        json["mixing"][0],
        serde_json::json!([[0], [1, 2]]),
        "{json}"
    );
    assert_eq!(json["mixing"].as_array().map(Vec::len), Some(3), "{json}");
    let out = imgrun()
        .args(base)
        .args(["--set", "train.topology=\"torus\""])
        .output()
        .expect("run plan");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{}", describe(&out));
    assert!(
        stderr.contains("train.topology") && stderr.contains("unknown topology `torus`"),
        "{stderr}"
    );

    // A broken user hook is reported with its file, line and column.
    let hooks = dir.path().join("hooks");
    std::fs::create_dir(&hooks).expect("hooks dir");
    std::fs::write(
        hooks.join("shard_shuffle.rhai"),
        "fn shard_shuffle(shards, ctx) {\n  shards.reverse(\n}\n",
    )
    .expect("write hook");
    let out = imgrun()
        .args(base)
        .args(["--hooks", hooks.to_str().expect("utf-8")])
        .output()
        .expect("run plan");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("shard_shuffle.rhai:3:1"), "{stderr}");
}

/// `shards index` writes for shards without one the manifest `shards synth` wrote beside
/// them, from files or through `pipe:` under a base; `plan` takes it with `--manifest`;
/// a damaged shard is named with its byte offset.
#[test]
fn shards_index_writes_the_manifest_and_plan_takes_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (shards, spec) = small_dataset(dir.path());
    let written: serde_json::Value = serde_json::from_slice(
        &std::fs::read(shards.join("manifest.json")).expect("read manifest"),
    )
    .expect("manifest json");
    // The same tars with no manifest, as Python webdataset leaves them.
    let bare = dir.path().join("bare");
    std::fs::create_dir(&bare).expect("bare dir");
    let mut names = Vec::new();
    for entry in std::fs::read_dir(&shards).expect("read shards") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "tar") {
            let name = path.file_name().expect("name").to_owned();
            std::fs::copy(&path, bare.join(&name)).expect("copy shard");
            names.push(name.to_string_lossy().into_owned());
        }
    }
    names.sort();
    let bare_spec = spec.replace(&shards.display().to_string(), &bare.display().to_string());
    let printed = run_ok(&["shards", "index", &bare_spec], dir.path());
    assert!(
        printed.contains("indexed 3 shards: 60 samples"),
        "{printed}"
    );
    let indexed: serde_json::Value = serde_json::from_slice(
        &std::fs::read(bare.join("manifest.json")).expect("the index beside the shards"),
    )
    .expect("manifest json");
    // Class names are not in the shards: the index names classes by their label.
    assert_eq!(
        indexed["shards"], written["shards"],
        "the index counts as synth did"
    );
    assert_eq!(indexed["classes"], serde_json::json!(["0", "1", "2"]));

    // Through `pipe:` under a base, into a file of its own.
    let relative = spec.rsplit('/').next().expect("names");
    let base = format!("pipe:cat {}/%s", bare.display());
    let file = dir.path().join("piped.json");
    let file_arg = file.to_str().expect("utf-8");
    run_ok(
        &["shards", "index", relative, "--base", &base, "-o", file_arg],
        dir.path(),
    );
    let piped: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&file).expect("read")).expect("json");
    assert_eq!(piped["shards"], written["shards"]);

    // `plan` of the piped shards: unknown counts are refused naming the command that
    // gets them; with the manifest, every sample is planned.
    let plan = |extra: &[&str]| {
        imgrun()
            .args([
                "plan", "--shards", relative, "--base", &base, "--mode", "split",
            ])
            .args(["--policy", "join", "--nodes", "2", "--batch-size", "8"])
            .args(extra)
            .output()
            .expect("run plan")
    };
    let out = plan(&[]);
    assert!(!out.status.success(), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("imgrun shards index"),
        "{}",
        describe(&out)
    );
    let out = plan(&["--manifest", file_arg, "--json"]);
    assert!(out.status.success(), "{}", describe(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("plan json");
    let samples: u64 = json["ranks"]
        .as_array()
        .expect("ranks")
        .iter()
        .map(|r| r["samples"].as_u64().expect("samples"))
        .sum();
    assert_eq!(samples, 60);

    // A base that cannot apply is an error naming it.
    let out = imgrun()
        .args([
            "shards",
            "index",
            &bare_spec,
            "--base",
            "http://h/",
            "-o",
            file_arg,
        ])
        .output()
        .expect("run index");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("base `http://h/` cannot apply"), "{stderr}");

    // A shard cut short fails the index, naming it and the offset.
    let victim = bare.join(&names[1]);
    let bytes = std::fs::read(&victim).expect("read shard");
    std::fs::write(&victim, &bytes[..bytes.len() / 2 + 100]).expect("truncate");
    let out = imgrun()
        .args(["shards", "index", &bare_spec, "-o", file_arg])
        .output()
        .expect("run index");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&names[1]) && stderr.contains("at byte"),
        "{stderr}"
    );
}

/// `imgrun bench loader` runs the training loader on the user's shards and prints the
/// stages, the whole loader's rate and the cores a target needs; with shards that hold
/// no image it says so.
#[test]
fn bench_loader_reports_stages_rate_and_the_cores_a_target_needs() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (_, spec) = small_dataset(dir.path());
    let out = imgrun()
        .args([
            "bench",
            "loader",
            &spec,
            "--seconds",
            "30",
            "--batches",
            "3",
        ])
        .args(["--target", "1000", "--loader-workers", "2"])
        .args(["--set", "data.image_size=32", "--set", "train.batch_size=8"])
        .output()
        .expect("run bench loader");
    assert!(out.status.success(), "{}", describe(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    for want in [
        "3 shard(s)",
        "32 px crops, batches of 8, 2 loader worker(s)",
        "over the first 60 images",
        "train transform (decode, crop, resize, flip)",
        "whole loader, 2 worker(s), 3 batches in",
        "1000 images/s takes about",
    ] {
        assert!(text.contains(want), "lacks `{want}`:\n{text}");
    }

    // Shards whose samples hold no image field.
    let pattern = dir.path().join("text-%03d.tar");
    let mut writer =
        pipelines::ShardWriter::new(pattern.to_string_lossy(), 10, u64::MAX).expect("pattern");
    writer
        .write(&pipelines::Sample::new("a").with("txt", "hi"))
        .expect("write");
    let bare = writer.finish().expect("finish")[0].path.clone();
    let out = imgrun()
        .args(["bench", "loader", bare.to_str().expect("utf-8")])
        .output()
        .expect("run bench loader");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("has an image field (jpg, jpeg, png)"),
        "{stderr}"
    );
}
