//! `http://` and `https://` sources, streamed.
//!
//! A shard is never downloaded whole: [`HttpSource::open`] returns as soon as the
//! response headers are in, and the tar reader pulls the body through the socket. Only
//! the request itself is retried (connect failures, timeouts and resets before the
//! response starts, and 5xx answers), with exponential backoff; a body that breaks off
//! later fails the shard with an [`HttpFailure`] rather than ending it early.
//!
//! Timeouts bound connecting and each read (inactivity), never the whole transfer: a
//! large shard over a slow link may take as long as it needs while bytes keep coming.

use std::io::{self, Read};
use std::time::Duration;

use crate::error::ShardError;
use crate::stream::{ShardSource, ShardStream, SourceKind, SourceOptions};

/// The longest pause between two attempts, however many have failed.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(30);

/// Opens `http(s)://` shards through one shared connection pool.
#[derive(Debug)]
pub(crate) struct HttpSource {
    agent: ureq::Agent,
    attempts: u32,
    retry_delay: Duration,
}

impl HttpSource {
    pub(crate) fn new(options: &SourceOptions) -> Self {
        let timeout = Some(options.http_timeout);
        let agent = ureq::Agent::config_builder()
            // Status codes are judged here: 4xx fails at once, 5xx is retried.
            .http_status_as_error(false)
            .user_agent(concat!("imgrun/", env!("CARGO_PKG_VERSION")))
            .timeout_resolve(timeout)
            .timeout_connect(timeout)
            .timeout_per_read(timeout)
            .timeout_per_write(timeout)
            .build()
            .new_agent();
        Self {
            agent,
            attempts: options.http_attempts.max(1),
            retry_delay: options.http_retry_delay,
        }
    }
}

impl ShardSource for HttpSource {
    fn kind(&self) -> SourceKind {
        SourceKind::Http
    }

    fn handles(&self, url: &str) -> bool {
        url.starts_with("http://") || url.starts_with("https://")
    }

    fn open(&self, url: &str) -> Result<ShardStream, ShardError> {
        self.open_sized(url).map(|(stream, _)| stream)
    }

    /// The declared length is the `Content-Length`; ureq gives none for a body it
    /// decompresses (`Content-Encoding`), whose length it does not know.
    fn open_sized(&self, url: &str) -> Result<(ShardStream, Option<u64>), ShardError> {
        let mut delay = self.retry_delay;
        let mut reason = String::new();
        for attempt in 1..=self.attempts {
            let verdict = match self.agent.get(url).call() {
                Ok(response) => judge_status(response.status()).map(|()| response),
                Err(error) => Err(judge_error(&error)),
            };
            match verdict {
                Ok(response) => {
                    let body = response.into_body();
                    let expected = body.content_length();
                    let stream = HttpStream {
                        url: url.to_string(),
                        body: body.into_reader(),
                        expected,
                        received: 0,
                        failure: None,
                    };
                    return Ok((Box::new(stream), expected));
                }
                Err(Failed::Status(status)) => {
                    return Err(ShardError::HttpStatus {
                        url: url.to_string(),
                        status,
                    });
                }
                Err(Failed::Fatal(reason)) => {
                    return Err(ShardError::Http {
                        url: url.to_string(),
                        reason,
                        attempts: attempt,
                    });
                }
                Err(Failed::Transient(why)) => reason = why,
            }
            if attempt < self.attempts {
                tracing::warn!(url, attempt, %reason, ?delay, "HTTP request failed, retrying");
                std::thread::sleep(delay);
                delay = next_delay(delay);
            }
        }
        Err(ShardError::Http {
            url: url.to_string(),
            reason,
            attempts: self.attempts,
        })
    }
}

/// An HTTP failure in the middle of a stream, carried through `io::Error`.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{url}: {reason}")]
pub(crate) struct HttpFailure {
    url: String,
    reason: String,
}

impl HttpFailure {
    pub(crate) fn to_shard_error(&self) -> ShardError {
        ShardError::Http {
            url: self.url.clone(),
            reason: self.reason.clone(),
            attempts: 1,
        }
    }
}

/// Why one attempt did not give a body to read.
#[derive(Debug, PartialEq, Eq)]
enum Failed {
    /// Worth another attempt.
    Transient(String),
    /// The server refused the request for good (4xx, or an unexpected 1xx/3xx).
    Status(u16),
    /// Another attempt would fail the same way.
    Fatal(String),
}

/// 2xx is a body; 5xx, 408 (request timeout) and 429 (too many requests) are worth
/// another try, as `curl --retry` has it; anything else is final.
fn judge_status(status: ureq::http::StatusCode) -> Result<(), Failed> {
    let code = status.as_u16();
    if status.is_success() {
        Ok(())
    } else if status.is_server_error() || code == 408 || code == 429 {
        let name = status.canonical_reason().unwrap_or("error");
        Err(Failed::Transient(format!("server answered {code} {name}")))
    } else {
        Err(Failed::Status(code))
    }
}

/// Network trouble before the response started is transient; a bad URL, a TLS or
/// protocol error or a redirect loop is not.
fn judge_error(error: &ureq::Error) -> Failed {
    match error {
        ureq::Error::Io(_)
        | ureq::Error::Timeout(_)
        | ureq::Error::HostNotFound
        | ureq::Error::ConnectionFailed => Failed::Transient(describe(error)),
        _ => Failed::Fatal(describe(error)),
    }
}

/// A short reason for an error message, e.g. "connection refused".
fn describe(error: &ureq::Error) -> String {
    match error {
        ureq::Error::Io(e) => describe_io(e),
        ureq::Error::Timeout(phase) => format!("timed out ({phase})"),
        other => other.to_string(),
    }
}

fn describe_io(error: &io::Error) -> String {
    if let Some(inner) = error
        .get_ref()
        .and_then(|e| e.downcast_ref::<ureq::Error>())
    {
        return describe(inner);
    }
    match error.kind() {
        io::ErrorKind::ConnectionRefused => "connection refused".to_string(),
        io::ErrorKind::ConnectionReset => "connection reset".to_string(),
        io::ErrorKind::ConnectionAborted => "connection aborted".to_string(),
        io::ErrorKind::UnexpectedEof => "connection closed early".to_string(),
        io::ErrorKind::TimedOut => "timed out".to_string(),
        _ => error.to_string(),
    }
}

fn next_delay(delay: Duration) -> Duration {
    delay.saturating_mul(2).min(MAX_RETRY_DELAY)
}

/// A response body being read. A failure sticks: once the body broke, every later
/// read reports it again instead of a clean end of stream.
struct HttpStream {
    url: String,
    body: ureq::BodyReader<'static>,
    expected: Option<u64>,
    received: u64,
    failure: Option<HttpFailure>,
}

impl Read for HttpStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(failure) = &self.failure {
            return Err(io::Error::other(failure.clone()));
        }
        match self.body.read(buf) {
            Ok(n) => {
                self.received += n as u64;
                Ok(n)
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Err(e),
            Err(e) => {
                let of = self
                    .expected
                    .map(|n| format!(" of {n}"))
                    .unwrap_or_default();
                let failure = HttpFailure {
                    url: self.url.clone(),
                    reason: format!(
                        "body broke off after {}{of} bytes: {}",
                        self.received,
                        describe_io(&e)
                    ),
                };
                self.failure = Some(failure.clone());
                Err(io::Error::other(failure))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::mpsc;

    use super::*;

    /// How long a test waits for its server or client before calling the test failed:
    /// far more than any case needs, far less than the default 30 s HTTP timeout.
    const PATIENCE: Duration = Duration::from_secs(10);
    /// The HTTP timeout of cases with a silent server, the only ones that wait one out.
    const SILENT_TIMEOUT: Duration = Duration::from_millis(300);

    /// What the test server does with one connection.
    enum Reply {
        /// Reads the request, sends these bytes and closes.
        Raw(Vec<u8>),
        /// Closes at once without reading the request.
        Drop,
        /// Reads the request and answers nothing until the client hangs up.
        Silent,
    }

    fn response(status: &str, headers: &str, body: &[u8]) -> Reply {
        let mut bytes = format!(
            "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n{headers}\r\n",
            body.len()
        )
        .into_bytes();
        bytes.extend_from_slice(body);
        Reply::Raw(bytes)
    }

    fn ok(body: &[u8]) -> Reply {
        response("200 OK", "", body)
    }

    /// Serves one connection per reply, in order, on a loopback port, then stops. The
    /// receiver yields the request paths once every reply has been given.
    fn serve(replies: Vec<Reply>) -> (String, mpsc::Receiver<Vec<String>>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let url = format!("http://{}/shard.tar", listener.local_addr().expect("bound"));
        let (done, finished) = mpsc::channel();
        std::thread::spawn(move || {
            let mut paths = Vec::new();
            for reply in replies {
                let Ok((stream, _)) = listener.accept() else {
                    return;
                };
                match reply {
                    Reply::Drop => drop(stream),
                    Reply::Raw(bytes) => {
                        let (path, mut stream) = read_request(stream);
                        paths.push(path);
                        // The client may already have given up; that is its verdict.
                        let _ = stream.write_all(&bytes);
                    }
                    Reply::Silent => {
                        let (path, mut stream) = read_request(stream);
                        paths.push(path);
                        let _ = io::copy(&mut stream, &mut io::sink());
                    }
                }
            }
            let _ = done.send(paths);
        });
        (url, finished)
    }

    /// Reads a request head and returns its path.
    fn read_request(stream: TcpStream) -> (String, TcpStream) {
        let mut reader = BufReader::new(stream);
        let mut first = String::new();
        let _ = reader.read_line(&mut first);
        let mut line = String::new();
        while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
            line.clear();
        }
        let path = first.split(' ').nth(1).unwrap_or_default().to_string();
        (path, reader.into_inner())
    }

    fn options(attempts: u32, timeout: Duration) -> SourceOptions {
        SourceOptions {
            http_timeout: timeout,
            http_attempts: attempts,
            http_retry_delay: Duration::from_millis(1),
            ..SourceOptions::default()
        }
    }

    /// What a case expects from opening and reading the shard.
    #[derive(Debug)]
    enum Want {
        Body(Vec<u8>),
        Status(u16),
        /// `ShardError::Http` from `open`, after this many attempts, with this in the reason.
        Failed(u32, &'static str),
        /// Opens, then reading fails with an `HttpFailure` after these bytes.
        Broken(usize),
    }

    struct Case {
        name: &'static str,
        /// No replies: the port is closed.
        replies: Vec<Reply>,
        attempts: u32,
        want: Want,
        /// The paths requested, in order, when it matters.
        paths: &'static [&'static str],
    }

    fn check(case: Case) {
        let Case {
            name,
            replies,
            attempts,
            want,
            paths,
        } = case;
        let closed = replies.is_empty();
        // Only a silent server makes the client wait a timeout out; elsewhere a timeout
        // that fired would be a wrong outcome, so it is set too long to fire.
        let silent = replies.iter().any(|reply| matches!(reply, Reply::Silent));
        let timeout = if silent { SILENT_TIMEOUT } else { PATIENCE };
        let (url, finished) = serve(replies);
        if closed {
            // With nothing to serve, the server thread drops its listener and ends.
            let _ = finished.recv_timeout(PATIENCE);
        }
        // On a thread of its own, so that a client that hangs fails the case instead of
        // hanging the test.
        let (report, outcome) = mpsc::channel();
        let target = url.clone();
        std::thread::spawn(move || {
            let source = HttpSource::new(&options(attempts, timeout));
            let outcome = source.open(&target).map(|mut stream| {
                let mut bytes = Vec::new();
                let read = stream.read_to_end(&mut bytes);
                let again = stream.read(&mut [0; 16]);
                (bytes, read, again)
            });
            let _ = report.send(outcome);
        });
        // The slowest case, two silent attempts, takes twice SILENT_TIMEOUT.
        let outcome = outcome
            .recv_timeout(PATIENCE)
            .unwrap_or_else(|_| panic!("{name}: no outcome within {PATIENCE:?}"));
        match (&want, outcome) {
            (Want::Body(body), Ok((bytes, Ok(_), Ok(0)))) => {
                assert!(
                    bytes == *body,
                    "{name}: got {} bytes, wanted {}",
                    bytes.len(),
                    body.len()
                );
            }
            (Want::Status(want), Err(ShardError::HttpStatus { url: got, status })) => {
                assert_eq!((status, got.as_str()), (*want, url.as_str()), "{name}");
            }
            (
                Want::Failed(n, needle),
                Err(ShardError::Http {
                    url: got,
                    reason,
                    attempts,
                }),
            ) => {
                assert_eq!(
                    (attempts, got.as_str()),
                    (*n, url.as_str()),
                    "{name}: {reason}"
                );
                assert!(
                    reason.contains(needle),
                    "{name}: reason `{reason}` lacks `{needle}`"
                );
            }
            (Want::Broken(n), Ok((bytes, Err(error), again))) => {
                assert_eq!(bytes.len(), *n, "{name}: bytes before the break");
                let failure = error
                    .get_ref()
                    .and_then(|e| e.downcast_ref::<HttpFailure>());
                let shard_error = failure.map(HttpFailure::to_shard_error);
                assert!(
                    matches!(&shard_error, Some(ShardError::Http { url: got, .. }) if *got == url),
                    "{name}: {error} gave {shard_error:?}"
                );
                assert!(
                    again.is_err(),
                    "{name}: a read after the break must fail again"
                );
            }
            (want, got) => {
                let got = got.map(|(bytes, read, again)| {
                    (
                        bytes.len(),
                        read.map_err(|e| e.to_string()),
                        again.map_err(|e| e.to_string()),
                    )
                });
                panic!("{name}: wanted {want:?}, got {got:?}");
            }
        }
        if !closed {
            let served = finished.recv_timeout(PATIENCE);
            let served = served.unwrap_or_else(|_| panic!("{name}: client made too few requests"));
            if !paths.is_empty() {
                assert_eq!(served, paths, "{name}: paths requested");
            }
        }
    }

    /// Deterministic bytes that no off-by-one can pass for one another.
    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8).collect()
    }

    #[test]
    fn requests_are_retried_or_failed_as_they_deserve() {
        let body = pattern(100_000);
        let short = {
            let mut bytes = b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n".to_vec();
            bytes.extend_from_slice(&pattern(400));
            Reply::Raw(bytes)
        };
        let cases = [
            Case {
                name: "200 is read whole",
                replies: vec![ok(&body)],
                attempts: 3,
                want: Want::Body(body.clone()),
                paths: &["/shard.tar"],
            },
            Case {
                name: "404 fails at once",
                replies: vec![response("404 Not Found", "", b"no such shard")],
                attempts: 3,
                want: Want::Status(404),
                paths: &["/shard.tar"],
            },
            Case {
                name: "closed port is retried, then refused",
                replies: vec![],
                attempts: 3,
                want: Want::Failed(3, "connection refused"),
                paths: &[],
            },
            Case {
                name: "dropped connection is retried",
                replies: vec![Reply::Drop, ok(&body)],
                attempts: 3,
                want: Want::Body(body.clone()),
                paths: &["/shard.tar"],
            },
            Case {
                name: "503 is retried",
                replies: vec![response("503 Service Unavailable", "", b""), ok(b"tar")],
                attempts: 2,
                want: Want::Body(b"tar".to_vec()),
                paths: &["/shard.tar", "/shard.tar"],
            },
            Case {
                name: "500 every time gives up",
                replies: vec![
                    response("500 Internal Server Error", "", b""),
                    response("500 Internal Server Error", "", b""),
                ],
                attempts: 2,
                want: Want::Failed(2, "500 Internal Server Error"),
                paths: &[],
            },
            Case {
                name: "redirect is followed",
                replies: vec![
                    response("302 Found", "Location: /moved.tar\r\n", b""),
                    ok(b"x"),
                ],
                attempts: 1,
                want: Want::Body(b"x".to_vec()),
                paths: &["/shard.tar", "/moved.tar"],
            },
            Case {
                name: "body shorter than Content-Length breaks",
                replies: vec![short],
                attempts: 3,
                want: Want::Broken(400),
                paths: &[],
            },
            Case {
                name: "silent server times out",
                replies: vec![Reply::Silent, Reply::Silent],
                attempts: 2,
                want: Want::Failed(2, "timed out"),
                paths: &[],
            },
        ];
        for case in cases {
            check(case);
        }
    }

    #[test]
    fn body_is_streamed_without_a_size_limit() {
        // Over ureq's 10 MB default for whole-body helpers.
        let half = 6 << 20;
        let body = pattern(2 * half);
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let url = format!("http://{}/big.tar", listener.local_addr().expect("bound"));
        let (go, wait) = mpsc::channel::<()>();
        let sent = body.clone();
        let server = std::thread::spawn(move || {
            let (stream, _) = listener.accept().expect("client connects");
            let (_, mut stream) = read_request(stream);
            let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", sent.len());
            stream.write_all(head.as_bytes())?;
            stream.write_all(&sent[..half])?;
            // The rest only once the client has read the first half: a client that
            // wanted the whole body before returning gets a short body instead.
            if wait.recv_timeout(PATIENCE).is_ok() {
                stream.write_all(&sent[half..])?;
            }
            io::Result::Ok(())
        });

        let source = HttpSource::new(&options(1, Duration::from_secs(5)));
        let mut stream = source.open(&url).expect("open streams");
        let mut got = vec![0; half];
        stream.read_exact(&mut got).expect("first half");
        go.send(()).expect("server waits");
        stream.read_to_end(&mut got).expect("second half");
        assert!(
            got == body,
            "got {} bytes, wanted {}",
            got.len(),
            body.len()
        );
        server
            .join()
            .expect("server thread")
            .expect("server writes");
    }

    #[test]
    fn backoff_doubles_up_to_a_cap() {
        let mut delay = Duration::from_millis(200);
        let mut seen = Vec::new();
        for _ in 0..10 {
            seen.push(delay.as_millis());
            delay = next_delay(delay);
        }
        assert_eq!(seen[..4], [200, 400, 800, 1600]);
        assert_eq!(seen[9], MAX_RETRY_DELAY.as_millis());
    }
}
