//! The harness of the `s3://` tests, checked on its own: moto's S3 server on loopback,
//! its helpers (the `aws` CLI), and each fault of the proxy in front of it, seen from a
//! client: the CLI's retries, or the raw bytes and the timing of a plain socket.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::s3::{FaultProxy, Moto};
use crate::common::{describe, path_str};

const BUCKET: &str = "shards";
/// The test object: 3 MB of random bytes, below the CLI's 8 MB threshold for parts.
const OBJECT: &str = "blob.bin";
const OBJECT_SIZE: usize = 3_000_000;
/// How long a raw read through the proxy may wait for a byte before the test fails.
const READ_LIMIT: Duration = Duration::from_secs(20);

/// Moto stores, lists and deletes what the helpers give it, and the proxy, with no fault
/// planned, forwards a whole object byte for byte.
#[test]
fn moto_keeps_objects_and_the_proxy_forwards_them_whole() {
    let Some(site) = Site::start(false) else {
        return;
    };
    let Site {
        moto, proxy, data, ..
    } = &site;
    assert_eq!(moto.list(BUCKET, ""), [OBJECT]);

    let read = moto.aws_ok(
        &proxy.endpoint(),
        &["s3", "cp", "s3://shards/blob.bin", "-"],
    );
    assert!(
        read == *data,
        "`aws s3 cp` through the proxy read {} bytes unlike the {} put",
        read.len(),
        data.len()
    );
    assert!(
        proxy.requests_seen() >= 1,
        "the CLI did not go through the proxy"
    );
    assert_eq!(proxy.faults_applied(), 0);

    let dir = site.dir.path().join("upload");
    std::fs::create_dir_all(dir.join("sub")).expect("create the folder to upload");
    std::fs::write(dir.join("a.tar"), b"first").expect("write a.tar");
    std::fs::write(dir.join("sub/b.tar"), b"second").expect("write b.tar");
    moto.upload_dir(BUCKET, "train", &dir);
    moto.put(BUCKET, "train/c.tar", b"third");
    let keys = ["train/a.tar", "train/c.tar", "train/sub/b.tar"];
    assert_eq!(moto.list(BUCKET, "train/"), keys);
    moto.delete(BUCKET, "train/a.tar");
    assert_eq!(moto.list(BUCKET, "train/"), keys[1..]);

    // The environment alone (no `--endpoint-url`) takes a client to moto, as it will
    // take `imgrun`.
    let out = Command::new(moto.aws_cli())
        .args(["s3", "cp", "s3://shards/train/c.tar", "-"])
        .envs(moto.env())
        .stdin(Stdio::null())
        .output()
        .expect("run aws");
    assert!(
        out.status.success(),
        "aws with Moto::env(): {}",
        describe(&out)
    );
    assert_eq!(out.stdout, b"third");
}

/// Status faults are answered by the proxy in moto's place: the CLI retries `503 Slow
/// Down` and then reads the range, and takes `403 AccessDenied` as final.
#[test]
fn status_faults_are_answered_in_place_of_moto_and_slow_down_is_retried() {
    let Some(site) = Site::start(false) else {
        return;
    };
    let Site {
        moto, proxy, data, ..
    } = &site;
    let range_file = site.dir.path().join("range");
    let get_range = [
        "s3api",
        "get-object",
        "--bucket",
        BUCKET,
        "--key",
        OBJECT,
        "--range",
        "bytes=0-99",
        path_str(&range_file),
    ];

    proxy.slow_down(2);
    moto.aws_ok(&proxy.endpoint(), &get_range);
    let range = std::fs::read(&range_file).expect("read the range the CLI wrote");
    assert!(range == data[..100], "the range read after two 503s");
    assert_eq!(proxy.faults_applied(), 2);
    assert_eq!(
        (proxy.requests_seen(), proxy.ranged_gets_seen()),
        (3, 3),
        "two answered 503, the third forwarded"
    );

    proxy.status(1, 403, "AccessDenied");
    let out = moto
        .aws(&proxy.endpoint())
        .args(get_range)
        .output()
        .expect("run aws");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("AccessDenied"),
        "a 403 AccessDenied from the proxy: {}\n{stderr}",
        out.status
    );
    assert_eq!(proxy.faults_applied(), 3);
    assert_eq!(proxy.requests_seen(), 4, "the CLI retried a 403");
}

/// `cut_after` forwards the head of a ranged GET's answer and the planned bytes of its
/// body, then closes; the fault spent, the same request gets the whole range.
#[test]
fn a_cut_ranged_get_delivers_the_planned_bytes_then_closes() {
    let Some(site) = Site::start(true) else {
        return;
    };
    let Site { proxy, data, .. } = &site;
    proxy.cut_after(1, 1000);
    let cut = raw_get(proxy.address(), "bytes=0-2999999");
    assert!(
        cut.head.starts_with("HTTP/1.1 206") && cut.head.contains("Content-Length: 3000000"),
        "moto's head of the whole range, forwarded: {}",
        cut.head
    );
    assert_eq!(cut.body.len(), 1000, "body bytes before the close");
    assert!(cut.body == data[..1000]);
    assert_eq!(proxy.faults_applied(), 1);

    let whole = raw_get(proxy.address(), "bytes=0-2999999");
    assert!(whole.head.starts_with("HTTP/1.1 206"), "{}", whole.head);
    assert_eq!(whole.body.len(), OBJECT_SIZE);
    assert!(whole.body == *data, "the whole range after the cut");
    assert_eq!((proxy.faults_applied(), proxy.ranged_gets_seen()), (1, 2));
}

/// `stall` forwards the head and the planned bytes of the body, then nothing while it
/// holds the connection open for the planned time, then closes.
#[test]
fn a_stalled_ranged_get_delivers_the_planned_bytes_then_nothing_until_it_closes() {
    const STALL: Duration = Duration::from_secs(2);
    let Some(site) = Site::start(true) else {
        return;
    };
    let Site { proxy, data, .. } = &site;
    proxy.stall(1, 100, STALL);
    let stalled = raw_get(proxy.address(), "bytes=0-999");
    assert!(stalled.head.starts_with("HTTP/1.1 206"), "{}", stalled.head);
    assert_eq!(stalled.body.len(), 100, "body bytes before the close");
    assert!(stalled.body == data[..100]);
    let silence = stalled.closed_at - stalled.body_done_at;
    assert!(
        silence >= STALL.mul_f32(0.75),
        "the proxy closed {silence:?} after the last byte, not about {STALL:?}"
    );
    assert_eq!(proxy.faults_applied(), 1);
}

/// A bucket in a fresh moto with the test object in it, and a proxy in front.
struct Site {
    // Dropped first: its connection threads end before moto does.
    proxy: FaultProxy,
    moto: Moto,
    /// The test object's bytes.
    data: Vec<u8>,
    dir: tempfile::TempDir,
}

impl Site {
    /// `public`: the object can be read without signing (a raw request), as with a
    /// `public-read` ACL.
    fn start(public: bool) -> Option<Site> {
        let moto = Moto::start()?;
        let proxy = FaultProxy::start(moto.address());
        let dir = tempfile::tempdir().expect("a temporary folder");
        moto.create_bucket(BUCKET);
        let data = random_bytes(OBJECT_SIZE);
        let file = dir.path().join(OBJECT);
        std::fs::write(&file, &data).expect("write the test object");
        if public {
            let args = ["s3api", "put-object", "--bucket", BUCKET, "--key", OBJECT];
            let body = ["--body", path_str(&file), "--acl", "public-read"];
            moto.aws_ok(&moto.endpoint(), &[&args[..], &body[..]].concat());
        } else {
            moto.put_file(BUCKET, OBJECT, &file);
        }
        Some(Site {
            proxy,
            moto,
            data,
            dir,
        })
    }
}

/// What a raw GET read before the proxy closed the connection.
struct RawReply {
    head: String,
    body: Vec<u8>,
    /// Since the request was sent: when the last body byte came, and when the connection
    /// closed.
    body_done_at: Duration,
    closed_at: Duration,
}

/// An unsigned GET of the test object through `proxy`, with `Range: range`, read until the
/// connection closes.
fn raw_get(proxy: SocketAddr, range: &str) -> RawReply {
    let mut stream = TcpStream::connect(proxy).expect("connect to the proxy");
    stream
        .set_read_timeout(Some(READ_LIMIT))
        .expect("set a read timeout");
    let request = format!(
        "GET /{BUCKET}/{OBJECT} HTTP/1.1\r\nHost: {proxy}\r\nRange: {range}\r\n\
         Connection: close\r\n\r\n"
    );
    let sent = Instant::now();
    stream
        .write_all(request.as_bytes())
        .expect("send the request");
    let mut received = Vec::new();
    let mut last_byte_at = Duration::ZERO;
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let read = stream
            .read(&mut buffer)
            .unwrap_or_else(|e| panic!("read through the proxy (after {:?}): {e}", sent.elapsed()));
        if read == 0 {
            break;
        }
        received.extend_from_slice(&buffer[..read]);
        last_byte_at = sent.elapsed();
    }
    let closed_at = sent.elapsed();
    let end = received
        .windows(4)
        .position(|window| window == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no whole head in {:?}", String::from_utf8_lossy(&received)))
        + 4;
    RawReply {
        head: String::from_utf8_lossy(&received[..end]).into_owned(),
        body: received[end..].to_vec(),
        body_done_at: last_byte_at,
        closed_at,
    }
}

/// `len` bytes that do not repeat or compress (splitmix64 from a fixed seed).
fn random_bytes(len: usize) -> Vec<u8> {
    let mut state: u64 = 0x5eed;
    let mut bytes = Vec::with_capacity(len + 8);
    while bytes.len() < len {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        bytes.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    bytes.truncate(len);
    bytes
}
