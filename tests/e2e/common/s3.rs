//! A real S3 API on loopback for the tests of `s3://` shard sources, and a fault proxy to
//! put in front of it.
//!
//! - [`Moto`]: moto's S3 server (`python -m moto.server`, from the venv of
//!   `tools/pytools.sh`), started by the test and killed when dropped, with helpers that
//!   fill and read its buckets through the venv's `aws` CLI.
//! - [`FaultProxy`]: a TCP proxy on loopback between the client under test and moto. It
//!   reads each HTTP/1.1 request and response on a connection (a keep-alive connection
//!   carries many), so that a fault planned by the test lands on one request: a body that
//!   breaks off, a body that stalls, or an error status answered in moto's place.
//!
//! Moto answers every request with `Connection: close`, so the clients' connections through
//! the proxy carry one request each; the proxy does not rely on it.

use std::collections::{HashMap, VecDeque};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::loopback::LoopbackServer;
use super::{path_str, tools_python};

/// Moto's S3 server on `127.0.0.1`, started by the test and killed when dropped. Its
/// buckets live in its memory only.
pub struct Moto {
    server: LoopbackServer,
    /// The venv's `aws` CLI, beside its Python.
    aws: PathBuf,
    /// Names the files that [`Moto::put`] writes (in the server's folder, beside the AWS
    /// configuration paths that do not exist), one each.
    uploads: AtomicU64,
}

impl Moto {
    /// Starts the server on a free port and waits until it answers HTTP. `None` (after
    /// `skip_or_fail`) where `tools/pytools.sh` cannot make its venv here.
    pub fn start() -> Option<Moto> {
        let python = tools_python("tools/pytools.sh")?;
        let aws = python.with_file_name("aws");
        assert!(
            aws.is_file(),
            "no aws CLI at {} beside the venv's Python (tools/pytools.sh installs awscli)",
            aws.display()
        );
        let server = LoopbackServer::start("moto", |port, _| {
            let mut command = Command::new(&python);
            command.args([
                "-m",
                "moto.server",
                "-H",
                "127.0.0.1",
                "-p",
                &port.to_string(),
            ]);
            command
        });
        Some(Moto {
            server,
            aws,
            uploads: AtomicU64::new(0),
        })
    }

    /// Where it listens, for a [`FaultProxy`] in front of it.
    pub fn address(&self) -> SocketAddr {
        self.server.address()
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        self.server.endpoint()
    }

    /// The environment that an `imgrun` process or the `aws` CLI needs to reach this
    /// server: test credentials, a region, the endpoint, and AWS configuration files that
    /// do not exist (so that the developer's `~/.aws` is never read).
    pub fn env(&self) -> Vec<(String, String)> {
        self.env_via(&self.endpoint())
    }

    /// [`Moto::env`] with another endpoint in front of this server (a [`FaultProxy`]'s).
    pub fn env_via(&self, endpoint: &str) -> Vec<(String, String)> {
        let nowhere = |name: &str| path_str(&self.server.dir().join(name)).to_owned();
        [
            ("AWS_ACCESS_KEY_ID", "testing".to_owned()),
            ("AWS_SECRET_ACCESS_KEY", "testing".to_owned()),
            ("AWS_DEFAULT_REGION", "us-east-1".to_owned()),
            ("AWS_REGION", "us-east-1".to_owned()),
            ("AWS_ENDPOINT_URL", endpoint.to_owned()),
            ("AWS_CONFIG_FILE", nowhere("no-aws-config")),
            ("AWS_SHARED_CREDENTIALS_FILE", nowhere("no-aws-credentials")),
        ]
        .into_iter()
        .map(|(name, value)| (name.to_owned(), value))
        .collect()
    }

    /// The venv's `aws` CLI against `endpoint` (this server's, or a proxy's in front of
    /// it), with [`Moto::env_via`] and no profile or session token of the developer's.
    pub fn aws(&self, endpoint: &str) -> Command {
        let mut command = Command::new(&self.aws);
        command
            .args(["--endpoint-url", endpoint])
            .envs(self.env_via(endpoint))
            .env_remove("AWS_PROFILE")
            .env_remove("AWS_DEFAULT_PROFILE")
            .env_remove("AWS_SESSION_TOKEN")
            .stdin(Stdio::null());
        command
    }

    /// The venv's `aws` CLI, for a command made by hand (a pipe in a shell, a
    /// benchmark); with [`Moto::env`] alone it reaches this server.
    pub fn aws_cli(&self) -> &Path {
        &self.aws
    }

    /// Runs `aws ARGS` against `endpoint`, which must succeed; its standard output.
    pub fn aws_ok(&self, endpoint: &str, args: &[&str]) -> Vec<u8> {
        let out = self
            .aws(endpoint)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("run {}: {e}", self.aws.display()));
        assert!(
            out.status.success(),
            "aws {} (against {endpoint}) failed: {}\nstderr:\n{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    }

    pub fn create_bucket(&self, name: &str) {
        self.aws_ok(
            &self.endpoint(),
            &["s3api", "create-bucket", "--bucket", name],
        );
    }

    /// Stores `bytes` as `bucket/key` (one PutObject).
    pub fn put(&self, bucket: &str, key: &str, bytes: &[u8]) {
        let number = self.uploads.fetch_add(1, Ordering::Relaxed);
        let file = self.server.dir().join(format!("upload-{number}"));
        std::fs::write(&file, bytes).expect("write the object to upload");
        self.put_file(bucket, key, &file);
        let _ = std::fs::remove_file(&file);
    }

    /// Stores the file at `path` as `bucket/key` (one PutObject, so its ETag is the MD5
    /// of its bytes).
    pub fn put_file(&self, bucket: &str, key: &str, path: &Path) {
        let args = ["s3api", "put-object", "--bucket", bucket, "--key", key];
        self.aws_ok(
            &self.endpoint(),
            &[&args[..], &["--body", path_str(path)]].concat(),
        );
    }

    /// Stores every file under `dir` as `bucket/PREFIX/RELATIVE-PATH` (`RELATIVE-PATH`
    /// alone for an empty prefix), with `aws s3 cp --recursive`: files past 8 MB go up in
    /// parts, so their ETags are not MD5s of their bytes.
    pub fn upload_dir(&self, bucket: &str, prefix: &str, dir: &Path) {
        let prefix = prefix.trim_end_matches('/');
        let destination = match prefix {
            "" => format!("s3://{bucket}/"),
            _ => format!("s3://{bucket}/{prefix}/"),
        };
        let args = ["s3", "cp", "--recursive", "--only-show-errors"];
        self.aws_ok(
            &self.endpoint(),
            &[&args[..], &[path_str(dir), &destination]].concat(),
        );
    }

    /// The bytes of the object `key` in `bucket`.
    pub fn get(&self, bucket: &str, key: &str) -> Vec<u8> {
        self.aws_ok(
            &self.endpoint(),
            &["s3", "cp", &format!("s3://{bucket}/{key}"), "-"],
        )
    }

    pub fn delete(&self, bucket: &str, key: &str) {
        let args = ["s3api", "delete-object", "--bucket", bucket, "--key", key];
        self.aws_ok(&self.endpoint(), &args);
    }

    /// The keys in `bucket` that start with `prefix`, in S3's order (by their bytes).
    pub fn list(&self, bucket: &str, prefix: &str) -> Vec<String> {
        let args = [
            "s3api",
            "list-objects-v2",
            "--bucket",
            bucket,
            "--prefix",
            prefix,
        ];
        let query = ["--query", "Contents[].Key", "--output", "json"];
        let out = self.aws_ok(&self.endpoint(), &[&args[..], &query[..]].concat());
        // `null` when no key matches.
        let keys: Option<Vec<String>> = serde_json::from_slice(&out).unwrap_or_else(|e| {
            panic!(
                "list-objects-v2 of {bucket}/{prefix}: {e}\n{}",
                String::from_utf8_lossy(&out)
            )
        });
        keys.unwrap_or_default()
    }
}

/// A TCP proxy on `127.0.0.1` that forwards each connection it accepts to a target (moto),
/// request by request, and applies the faults the test plans to the requests they match.
/// Stopped when dropped: it stops accepting, cuts every open connection and joins its
/// threads.
///
/// Faults are consumed in the order planned, one request each. The next fault applies to
/// the next request it matches (a status fault matches any request; a cut or a stall
/// only a GET whose head has a `Range:` header), and requests it does not match pass
/// through untouched meanwhile.
pub struct FaultProxy {
    address: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<Vec<JoinHandle<()>>>>,
}

impl FaultProxy {
    /// Starts the proxy on a free port of `127.0.0.1`, in front of `target`.
    pub fn start(target: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the fault proxy");
        let address = listener.local_addr().expect("the proxy's address");
        let shared = Arc::new(Shared {
            target,
            stop: AtomicBool::new(false),
            plan: Mutex::new(VecDeque::new()),
            open: Mutex::new(HashMap::new()),
            problems: Mutex::new(Vec::new()),
            requests_seen: AtomicU64::new(0),
            ranged_gets_seen: AtomicU64::new(0),
            faults_applied: AtomicU64::new(0),
        });
        let accepting = Arc::clone(&shared);
        let accept = std::thread::Builder::new()
            .name(format!("fault-proxy-{}", address.port()))
            .spawn(move || accept_connections(listener, accepting))
            .expect("start the proxy's accept thread");
        FaultProxy {
            address,
            shared,
            accept: Some(accept),
        }
    }

    /// Where it listens, for a raw client.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.address)
    }

    /// For the next `requests` ranged GETs: forwards the response's head and only the
    /// first `body_bytes` bytes of its body, then closes both connections (a body that
    /// breaks off).
    pub fn cut_after(&self, requests: usize, body_bytes: u64) {
        self.plan(requests, Fault::Cut { body_bytes });
    }

    /// For the next `requests` ranged GETs: forwards the response's head and the first
    /// `body_bytes` bytes of its body, sends nothing more for `duration` while holding
    /// both connections open, then closes them.
    pub fn stall(&self, requests: usize, body_bytes: u64, duration: Duration) {
        self.plan(
            requests,
            Fault::Stall {
                body_bytes,
                duration,
            },
        );
    }

    /// Answers the next `requests` requests of any kind with `503 Slow Down` and S3's
    /// `SlowDown` error (`<Error><Code>SlowDown</Code><Message>Please reduce your request
    /// rate.</Message></Error>`), without forwarding them; then closes the connection.
    pub fn slow_down(&self, requests: usize) {
        self.status(requests, 503, "SlowDown");
    }

    /// Answers the next `requests` requests of any kind with the status `code` and an S3
    /// error whose code is `s3_code` (`AccessDenied`, `InternalError`...), without
    /// forwarding them; then closes the connection.
    pub fn status(&self, requests: usize, code: u16, s3_code: &str) {
        let s3_code = s3_code.to_owned();
        self.plan(requests, Fault::Status { code, s3_code });
    }

    /// How many planned faults requests have met so far.
    pub fn faults_applied(&self) -> u64 {
        self.shared.faults_applied.load(Ordering::SeqCst)
    }

    /// How many request heads the proxy has read, faulted or not.
    pub fn requests_seen(&self) -> u64 {
        self.shared.requests_seen.load(Ordering::SeqCst)
    }

    /// How many of those were GETs with a `Range:` header.
    pub fn ranged_gets_seen(&self) -> u64 {
        self.shared.ranged_gets_seen.load(Ordering::SeqCst)
    }

    fn plan(&self, requests: usize, fault: Fault) {
        let mut plan = lock(&self.shared.plan);
        plan.extend(std::iter::repeat_n(fault, requests));
    }
}

impl Drop for FaultProxy {
    /// Stops accepting, cuts the open connections and joins every thread. Then fails the
    /// test if a client sent what the proxy cannot forward (a chunked request body).
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wakes the accept thread, which sees the flag and returns.
        let _ = TcpStream::connect(self.address);
        let connections = match self.accept.take().map(JoinHandle::join) {
            Some(Ok(connections)) => connections,
            _ => Vec::new(),
        };
        for (client, upstream) in lock(&self.shared.open).values() {
            let _ = client.shutdown(Shutdown::Both);
            let _ = upstream.shutdown(Shutdown::Both);
        }
        for connection in connections {
            let _ = connection.join();
        }
        let problems = lock(&self.shared.problems);
        if !problems.is_empty() && !std::thread::panicking() {
            panic!(
                "the fault proxy could not forward:\n{}",
                problems.join("\n")
            );
        }
    }
}

/// A fault planned for one request.
#[derive(Clone, Debug)]
enum Fault {
    Cut { body_bytes: u64 },
    Stall { body_bytes: u64, duration: Duration },
    Status { code: u16, s3_code: String },
}

impl Fault {
    fn matches(&self, request: &RequestHead) -> bool {
        match self {
            Fault::Status { .. } => true,
            Fault::Cut { .. } | Fault::Stall { .. } => request.is_ranged_get(),
        }
    }
}

/// What the proxy's threads and the test share.
struct Shared {
    target: SocketAddr,
    stop: AtomicBool,
    /// Faults not yet applied, the next first.
    plan: Mutex<VecDeque<Fault>>,
    /// Clones of each open connection's (client, upstream) sockets, by connection
    /// number, to cut them on drop.
    open: Mutex<HashMap<u64, (TcpStream, TcpStream)>>,
    /// What clients sent that the proxy cannot forward.
    problems: Mutex<Vec<String>>,
    requests_seen: AtomicU64,
    ranged_gets_seen: AtomicU64,
    faults_applied: AtomicU64,
}

impl Shared {
    /// Counts `request`, and takes the next planned fault if it matches it.
    fn fault_for(&self, request: &RequestHead) -> Option<Fault> {
        self.requests_seen.fetch_add(1, Ordering::SeqCst);
        if request.is_ranged_get() {
            self.ranged_gets_seen.fetch_add(1, Ordering::SeqCst);
        }
        let mut plan = lock(&self.plan);
        if !plan.front().is_some_and(|fault| fault.matches(request)) {
            return None;
        }
        let fault = plan.pop_front()?;
        self.faults_applied.fetch_add(1, Ordering::SeqCst);
        Some(fault)
    }
}

/// Locks `mutex`, whose data stays whole if a thread panicked holding it (each change is
/// one push, pop or insert).
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The accept loop: a thread per connection until the stop flag is set. Returns those
/// threads, for the proxy's drop to join once it has cut their sockets.
fn accept_connections(listener: TcpListener, shared: Arc<Shared>) -> Vec<JoinHandle<()>> {
    let mut connections = Vec::new();
    for (number, client) in (0u64..).zip(listener.incoming()) {
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        let Ok(client) = client else { continue };
        let shared = Arc::clone(&shared);
        connections.push(std::thread::spawn(move || {
            forward_connection(number, client, &shared);
        }));
    }
    connections
}

/// Forwards one client connection to the target, request by request, until either side
/// closes, a fault ends it, or the proxy stops.
fn forward_connection(number: u64, client: TcpStream, shared: &Shared) {
    let Ok(upstream) = TcpStream::connect(shared.target) else {
        return;
    };
    let (Ok(client_copy), Ok(upstream_copy)) = (client.try_clone(), upstream.try_clone()) else {
        return;
    };
    lock(&shared.open).insert(number, (client_copy, upstream_copy));
    // Registered before this check, so a drop that set the flag after it cuts the sockets.
    if !shared.stop.load(Ordering::SeqCst) {
        let mut connection = Connection::new(client, upstream);
        while let Ok(Carry::On) = connection.exchange(shared) {}
        connection.close();
    }
    if let Some((client, upstream)) = lock(&shared.open).remove(&number) {
        let _ = client.shutdown(Shutdown::Both);
        let _ = upstream.shutdown(Shutdown::Both);
    }
}

/// Whether a connection carries on after an exchange.
enum Carry {
    On,
    Close,
}

/// One client connection and its connection to the target, each read through a buffer.
struct Connection {
    client: BufReader<TcpStream>,
    upstream: BufReader<TcpStream>,
}

impl Connection {
    fn new(client: TcpStream, upstream: TcpStream) -> Connection {
        Connection {
            client: BufReader::new(client),
            upstream: BufReader::new(upstream),
        }
    }

    /// One request and its response, with the fault planned for it if any.
    fn exchange(&mut self, shared: &Shared) -> io::Result<Carry> {
        let Some(head) = read_head(&mut self.client)? else {
            return Ok(Carry::Close);
        };
        let request = RequestHead::parse(&head)?;
        let fault = shared.fault_for(&request);
        if request.chunked {
            lock(&shared.problems).push(format!(
                "a chunked request body ({} {}): the proxy reads Content-Length bodies only",
                request.method, request.target
            ));
            self.answer_error(&request, 501, "NotImplemented")?;
            return Ok(Carry::Close);
        }
        if let Some(Fault::Status { code, s3_code }) = &fault {
            // A client that waits for `100 Continue` sends no body; others send it whole
            // before reading, and a socket closed on unread bytes would reset.
            if !request.expects_continue {
                copy_exactly(&mut self.client, &mut io::sink(), request.content_length)?;
            }
            self.answer_error(&request, *code, s3_code)?;
            return Ok(Carry::Close);
        }
        if request.expects_continue {
            // Answered here and the header dropped (SigV4 does not sign it), so that the
            // body follows at once and the target never sends an interim response.
            self.client
                .get_mut()
                .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")?;
        }
        self.upstream.get_mut().write_all(&request.forwarded)?;
        copy_exactly(
            &mut self.client,
            self.upstream.get_mut(),
            request.content_length,
        )?;
        let response = self.forward_response_head()?;
        let body = response.body(&request);
        let client = self.client.get_mut();
        match fault {
            None => {
                forward_body(&mut self.upstream, client, &body)?;
                let open = !response.closes && !request.closes && body != Body::UntilClose;
                Ok(if open { Carry::On } else { Carry::Close })
            }
            Some(Fault::Cut { body_bytes }) => {
                io::copy(&mut (&mut self.upstream).take(body.cap(body_bytes)), client)?;
                Ok(Carry::Close)
            }
            Some(Fault::Stall {
                body_bytes,
                duration,
            }) => {
                io::copy(&mut (&mut self.upstream).take(body.cap(body_bytes)), client)?;
                client.flush()?;
                hold(duration, &shared.stop);
                Ok(Carry::Close)
            }
            Some(Fault::Status { .. }) => unreachable!("answered above"),
        }
    }

    /// Reads the target's response head, forwarding any interim (1xx) responses before
    /// it, and forwards it to the client.
    fn forward_response_head(&mut self) -> io::Result<ResponseHead> {
        loop {
            let head = read_head(&mut self.upstream)?
                .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "the target closed"))?;
            self.client.get_mut().write_all(&head)?;
            let response = ResponseHead::parse(&head)?;
            if !(100..200).contains(&response.status) {
                return Ok(response);
            }
        }
    }

    /// Answers `request` in the target's place with `code` and an S3 error document,
    /// closing the connection after it.
    fn answer_error(&mut self, request: &RequestHead, code: u16, s3_code: &str) -> io::Result<()> {
        let body = s3_error_body(s3_code);
        let mut answer = format!(
            "HTTP/1.1 {code} {}\r\nContent-Type: application/xml\r\nContent-Length: {}\r\n\
             x-amz-request-id: FAULTPROXY\r\nConnection: close\r\n\r\n",
            reason_phrase(code),
            body.len()
        );
        if request.method != "HEAD" {
            answer.push_str(&body);
        }
        let client = self.client.get_mut();
        client.write_all(answer.as_bytes())?;
        client.flush()
    }

    fn close(self) {
        let _ = self.client.get_ref().shutdown(Shutdown::Both);
        let _ = self.upstream.get_ref().shutdown(Shutdown::Both);
    }
}

/// Sleeps for `duration` in short steps, returning early when the proxy stops.
fn hold(duration: Duration, stop: &AtomicBool) {
    let end = Instant::now() + duration;
    while !stop.load(Ordering::SeqCst) {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        std::thread::sleep(left.min(Duration::from_millis(20)));
    }
}

/// The most a request or response head may take.
const HEAD_LIMIT: usize = 64 * 1024;

/// Reads a message head, up to and with its empty line. `None` when the peer closed before
/// sending a byte of it (the end of a keep-alive connection).
fn read_head(reader: &mut impl BufRead) -> io::Result<Option<Vec<u8>>> {
    let mut head = Vec::new();
    loop {
        let before = head.len();
        let read = reader.read_until(b'\n', &mut head)?;
        if read == 0 {
            if head.is_empty() {
                return Ok(None);
            }
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "closed within a message head",
            ));
        }
        if head.len() > HEAD_LIMIT {
            return Err(invalid("a message head past 64 KiB"));
        }
        let line = &head[before..];
        if line == b"\r\n" || line == b"\n" {
            return Ok(Some(head));
        }
    }
}

/// What the proxy needs of a request head.
struct RequestHead {
    method: String,
    target: String,
    has_range: bool,
    content_length: u64,
    chunked: bool,
    expects_continue: bool,
    closes: bool,
    /// The head as sent on to the target: without `Expect: 100-continue`.
    forwarded: Vec<u8>,
}

impl RequestHead {
    fn parse(head: &[u8]) -> io::Result<RequestHead> {
        let text = std::str::from_utf8(head).map_err(|_| invalid("a request head not UTF-8"))?;
        let mut lines = text.split_inclusive('\n');
        let request_line = lines.next().unwrap_or_default();
        let mut words = request_line.split_whitespace();
        let (Some(method), Some(target)) = (words.next(), words.next()) else {
            return Err(invalid("a request line without a method and a target"));
        };
        let mut request = RequestHead {
            method: method.to_owned(),
            target: target.to_owned(),
            has_range: false,
            content_length: 0,
            chunked: false,
            expects_continue: false,
            closes: false,
            forwarded: request_line.as_bytes().to_vec(),
        };
        for line in lines {
            if let Some((name, value)) = line.split_once(':') {
                let value = value.trim();
                match name.trim().to_ascii_lowercase().as_str() {
                    "range" => request.has_range = true,
                    "content-length" => request.content_length = parse_length(value)?,
                    "transfer-encoding" => request.chunked = has_token(value, "chunked"),
                    "connection" => request.closes = has_token(value, "close"),
                    "expect" if value.eq_ignore_ascii_case("100-continue") => {
                        request.expects_continue = true;
                        continue;
                    }
                    _ => {}
                }
            }
            request.forwarded.extend_from_slice(line.as_bytes());
        }
        Ok(request)
    }

    fn is_ranged_get(&self) -> bool {
        self.method == "GET" && self.has_range
    }
}

/// What the proxy needs of a response head.
struct ResponseHead {
    status: u16,
    content_length: Option<u64>,
    chunked: bool,
    closes: bool,
}

impl ResponseHead {
    fn parse(head: &[u8]) -> io::Result<ResponseHead> {
        let text = std::str::from_utf8(head).map_err(|_| invalid("a response head not UTF-8"))?;
        let mut lines = text.lines();
        let status_line = lines.next().unwrap_or_default();
        let mut words = status_line.split_whitespace();
        let version = words.next().unwrap_or_default();
        let status = words
            .next()
            .and_then(|code| code.parse().ok())
            .ok_or_else(|| invalid("a status line without a status"))?;
        let mut response = ResponseHead {
            status,
            content_length: None,
            chunked: false,
            closes: version == "HTTP/1.0",
        };
        for (name, value) in lines.filter_map(|line| line.split_once(':')) {
            let value = value.trim();
            match name.trim().to_ascii_lowercase().as_str() {
                "content-length" => response.content_length = Some(parse_length(value)?),
                "transfer-encoding" => response.chunked = has_token(value, "chunked"),
                "connection" if has_token(value, "close") => response.closes = true,
                "connection" if has_token(value, "keep-alive") => response.closes = false,
                _ => {}
            }
        }
        Ok(response)
    }

    /// How this response's body is framed, as an answer to `request`.
    fn body(&self, request: &RequestHead) -> Body {
        if request.method == "HEAD" || matches!(self.status, 100..200 | 204 | 304) {
            Body::Length(0)
        } else if self.chunked {
            Body::Chunked
        } else if let Some(length) = self.content_length {
            Body::Length(length)
        } else {
            Body::UntilClose
        }
    }
}

/// How a response body is framed.
#[derive(Debug, PartialEq)]
enum Body {
    Length(u64),
    Chunked,
    UntilClose,
}

impl Body {
    /// How many bytes on the wire a fault that lets `bytes` through may forward: no more
    /// than the body (for a chunked body, its chunk lines count).
    fn cap(&self, bytes: u64) -> u64 {
        match self {
            Body::Length(length) => bytes.min(*length),
            Body::Chunked | Body::UntilClose => bytes,
        }
    }
}

/// Forwards one whole body from `from` to `to`.
fn forward_body(from: &mut impl BufRead, to: &mut impl Write, body: &Body) -> io::Result<()> {
    match body {
        Body::Length(length) => copy_exactly(from, to, *length),
        Body::UntilClose => io::copy(from, to).map(drop),
        Body::Chunked => loop {
            let mut size_line = Vec::new();
            from.read_until(b'\n', &mut size_line)?;
            to.write_all(&size_line)?;
            let size = std::str::from_utf8(&size_line)
                .ok()
                .and_then(|line| line.split(';').next())
                .and_then(|size| u64::from_str_radix(size.trim(), 16).ok())
                .ok_or_else(|| invalid("a chunk without a size"))?;
            if size == 0 {
                // The trailer, up to and with its empty line.
                let trailer = read_head(from)?.unwrap_or_default();
                return to.write_all(&trailer);
            }
            // The chunk and the CRLF after it.
            copy_exactly(from, to, size + 2)?;
        },
    }
}

/// Copies exactly `length` bytes, failing if `from` ends before.
fn copy_exactly(from: &mut impl Read, to: &mut impl Write, length: u64) -> io::Result<()> {
    let copied = io::copy(&mut from.take(length), to)?;
    if copied < length {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("a body ended after {copied} of {length} bytes"),
        ));
    }
    Ok(())
}

fn parse_length(value: &str) -> io::Result<u64> {
    value
        .parse()
        .map_err(|_| invalid("a Content-Length that is not a number"))
}

/// Whether the comma-separated header `value` holds `token`, in any case.
fn has_token(value: &str, token: &str) -> bool {
    value
        .split(',')
        .any(|item| item.trim().eq_ignore_ascii_case(token))
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_owned())
}

/// S3's error document for `s3_code`, with the message S3 gives the common ones.
fn s3_error_body(s3_code: &str) -> String {
    let message = match s3_code {
        "SlowDown" => "Please reduce your request rate.",
        "AccessDenied" => "Access Denied",
        "InternalError" => "We encountered an internal error. Please try again.",
        "ServiceUnavailable" => "Please reduce your request rate.",
        "NoSuchKey" => "The specified key does not exist.",
        _ => "Injected by the test's fault proxy.",
    };
    format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{s3_code}</Code>\
         <Message>{message}</Message></Error>"
    )
}

fn reason_phrase(code: u16) -> &'static str {
    match code {
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        412 => "Precondition Failed",
        416 => "Requested Range Not Satisfiable",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Slow Down",
        _ => "Injected Fault",
    }
}
