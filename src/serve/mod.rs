//! `imgrun serve`: an HTTP server for a folder of shards, in place of the nginx
//! container of typical training recipes.
//!
//! Files are streamed from disk in chunks, never buffered whole, with `Range` (206, and
//! 416 for a range outside the file) and `HEAD`, by `tower_http`'s `ServeDir`, which also
//! refuses any path that would leave the folder (`..`, absolute or percent-encoded).
//! Symbolic links are followed only while they stay inside the folder (a 404 otherwise,
//! and `GET /` does not list them); `follow_links` lets them point anywhere, for a folder
//! of links to shards stored elsewhere. `GET /` lists the shards (`*.tar*`, `*.tgz`), one
//! name a line.
//!
//! At most `max_in_flight` requests are handled at once. A request holds its slot until
//! its body has been sent or the client has gone, not merely until its headers are out,
//! so the limit bounds open files and transfers; later requests wait for a slot. A client
//! that stops reading holds its slot for at most the send timeout, and a connection that
//! sends no request is closed after the header timeout (`connection.rs`), so stalled and
//! silent clients cost a slot or a socket for a while, never the server. One client (a
//! peer address) holds at most `max_per_client` slots at once (`clients.rs`): its stalled
//! connections never take every slot from the others. Each request is logged once, at
//! info level, when its body is done.

mod clients;
mod connection;
mod links;

pub(crate) use connection::serve_connections;

pub use connection::Timeouts;

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use anyhow::Context as _;
use axum::Router;
use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tower_http::services::ServeDir;

use clients::{ClientSlot, Clients};

/// Bytes read from disk and sent per chunk of a file body.
const CHUNK: usize = 256 * 1024;

/// What `imgrun serve` serves, where, and how much at once.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// The folder of shards; nothing outside it is served.
    pub dir: PathBuf,
    /// Address to listen on; port 0 picks a free port.
    pub bind: SocketAddr,
    /// Most requests handled at once; the rest wait.
    pub max_in_flight: usize,
    /// Most of those one client (peer address) may hold; its others wait.
    pub max_per_client: usize,
    /// How long a client may stay silent or stop reading.
    pub timeouts: Timeouts,
    /// Whether symbolic links may lead out of the folder.
    pub follow_links: bool,
}

/// Binds, then serves until `shutdown` resolves. `on_ready` is called with the bound
/// address (port 0 → real port) before serving.
///
/// On shutdown, new connections are refused and the requests in flight are finished.
pub async fn serve(
    options: ServeOptions,
    on_ready: impl FnOnce(SocketAddr),
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let ServeOptions {
        dir,
        bind,
        max_in_flight,
        max_per_client,
        timeouts,
        follow_links,
    } = options;
    let shown = dir.display().to_string();
    let metadata = tokio::fs::metadata(&dir)
        .await
        .with_context(|| format!("cannot serve {shown}"))?;
    anyhow::ensure!(metadata.is_dir(), "cannot serve {shown}: not a folder");
    anyhow::ensure!(max_in_flight > 0, "max_in_flight must be at least 1");
    anyhow::ensure!(max_per_client > 0, "max_per_client must be at least 1");
    anyhow::ensure!(
        !timeouts.header.is_zero() && !timeouts.send.is_zero(),
        "the header and send timeouts must be positive"
    );
    // Links are judged against the folder's real path (it may itself be a link).
    let dir = tokio::fs::canonicalize(&dir)
        .await
        .with_context(|| format!("cannot serve {shown}: resolving its path"))?;
    let listener = tokio::net::TcpListener::bind(bind)
        .await
        .with_context(|| format!("cannot listen on {bind}"))?;
    let addr = listener
        .local_addr()
        .with_context(|| format!("reading the address bound for {bind}"))?;
    let app = router(dir, max_in_flight, max_per_client, follow_links);
    tracing::info!(
        dir = %shown,
        %addr,
        max_in_flight,
        max_per_client,
        header_timeout_ms = timeouts.header.as_millis() as u64,
        send_timeout_ms = timeouts.send.as_millis() as u64,
        follow_links,
        "serving shards"
    );
    on_ready(addr);
    connection::serve_connections(listener, app, timeouts, None, shutdown).await;
    tracing::info!(%addr, "server stopped");
    Ok(())
}

fn router(dir: PathBuf, max_in_flight: usize, max_per_client: usize, follow_links: bool) -> Router {
    let files = ServeDir::new(&dir)
        .append_index_html_on_directories(false)
        .with_buf_chunk_size(CHUNK);
    let folder = Arc::new(Folder { dir, follow_links });
    let app = Router::new()
        .route("/", get(list_shards))
        .with_state(Arc::clone(&folder))
        .fallback_service(files)
        .layer(middleware::from_fn_with_state(folder, links::stay_inside));
    with_slots(app, max_in_flight, max_per_client)
}

/// `app` with the stack's limits: at most `max_in_flight` requests at once, at most
/// `max_per_client` of them from one peer address, each holding its slot until its body
/// is sent, and one access log line per request. What every HTTP server of imgrun
/// (`imgrun serve`, the head's dashboard) runs under.
pub(crate) fn with_slots(app: Router, max_in_flight: usize, max_per_client: usize) -> Router {
    let slots = Arc::new(Slots {
        server: Arc::new(Semaphore::new(max_in_flight)),
        clients: Clients::new(max_per_client),
    });
    app.layer(middleware::from_fn_with_state(slots, track))
}

/// The folder served (its real path) and whether links may leave it.
#[derive(Debug)]
struct Folder {
    dir: PathBuf,
    follow_links: bool,
}

/// The server's slots, and each client's share of them.
#[derive(Debug)]
struct Slots {
    server: Arc<Semaphore>,
    clients: Arc<Clients>,
}

/// Waits for one of its client's slots, then one of the server's, runs the request, and
/// hands the slots and the access log line to the response body, which keeps them until
/// it is done.
async fn track(State(slots): State<Arc<Slots>>, request: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    let peer = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|info| info.0);
    tracing::debug!(%method, %path, peer = ?peer, "request waits for a slot");
    let client_slot = slots.clients.acquire(peer.map(|p| p.ip())).await;
    let Ok(slot) = Arc::clone(&slots.server).acquire_owned().await else {
        // Only a closed semaphore fails, and nothing closes this one.
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    };
    let response = next.run(request).await;
    let status = response.status();
    response.map(|inner| {
        Body::new(Tracked {
            inner,
            _slot: slot,
            _client_slot: client_slot,
            entry: Entry {
                method,
                path,
                peer,
                status,
                started,
                bytes: 0,
                complete: false,
            },
        })
    })
}

/// `GET /`: the shard files in the folder, sorted, one name a line.
async fn list_shards(State(folder): State<Arc<Folder>>) -> Response {
    let dir = &folder.dir;
    match shard_names(&folder).await {
        Ok(names) => {
            let text: String = names.iter().map(|name| format!("{name}\n")).collect();
            ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response()
        }
        Err(error) => {
            tracing::warn!(dir = %dir.display(), %error, "cannot list the shard folder");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "cannot list the shard folder\n",
            )
                .into_response()
        }
    }
}

async fn shard_names(folder: &Folder) -> io::Result<Vec<String>> {
    let mut entries = tokio::fs::read_dir(&folder.dir).await?;
    let mut names = Vec::new();
    while let Some(entry) = entries.next_entry().await? {
        // A name that is not UTF-8 cannot be written in a URL as it is.
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        let is_shard = name.contains(".tar") || name.ends_with(".tgz");
        // `metadata` follows links, as serving does; a link serving would refuse is not
        // listed.
        if is_shard
            && tokio::fs::metadata(entry.path())
                .await
                .is_ok_and(|m| m.is_file())
            && (folder.follow_links || links::inside(&folder.dir, &entry.path()).await)
        {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// One access log line, written when the response body is dropped.
struct Entry {
    method: Method,
    path: String,
    peer: Option<SocketAddr>,
    status: StatusCode,
    started: Instant,
    bytes: u64,
    complete: bool,
}

impl Drop for Entry {
    fn drop(&mut self) {
        let peer = self.peer.map(|p| p.to_string()).unwrap_or_default();
        tracing::info!(
            method = %self.method,
            path = %self.path,
            status = self.status.as_u16(),
            bytes = self.bytes,
            ms = self.started.elapsed().as_millis() as u64,
            complete = self.complete,
            peer = %peer,
            "request"
        );
    }
}

/// A response body that holds its request's slots and counts what it sends.
struct Tracked {
    inner: Body,
    _slot: OwnedSemaphorePermit,
    _client_slot: ClientSlot,
    entry: Entry,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                self.entry.bytes += frame.data_ref().map_or(0, |data| data.len() as u64);
            }
            Poll::Ready(None) => self.entry.complete = true,
            Poll::Ready(Some(Err(_))) | Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::Mutex;
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    use tokio::sync::oneshot;
    use tokio::task::JoinHandle;

    use super::*;

    /// How long a test waits for the server before calling the test failed.
    const PATIENCE: Duration = Duration::from_secs(10);
    const SECRET: &[u8] = b"top secret, outside the shard folder";

    struct Running {
        addr: SocketAddr,
        stop: oneshot::Sender<()>,
        task: JoinHandle<anyhow::Result<()>>,
    }

    /// The options of `imgrun serve` with its defaults, on a free loopback port.
    fn options(dir: &Path, max_in_flight: usize) -> ServeOptions {
        ServeOptions {
            dir: dir.to_path_buf(),
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            max_in_flight,
            max_per_client: max_in_flight,
            timeouts: Timeouts {
                header: Duration::from_secs(30),
                send: Duration::from_secs(60),
            },
            follow_links: false,
        }
    }

    async fn start(dir: &Path, max_in_flight: usize) -> Running {
        start_with(options(dir, max_in_flight)).await
    }

    async fn start_with(options: ServeOptions) -> Running {
        let (ready, bound) = oneshot::channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(serve(
            options,
            move |addr| {
                let _ = ready.send(addr);
            },
            async move {
                let _ = stopped.await;
            },
        ));
        let addr = bound.await.expect("server reports its address");
        Running { addr, stop, task }
    }

    impl Running {
        async fn stop(self) {
            let _ = self.stop.send(());
            let result = tokio::time::timeout(PATIENCE, self.task).await;
            result
                .expect("server stops")
                .expect("server task")
                .expect("server ran cleanly");
        }
    }

    /// A response as it came over the wire.
    #[derive(Debug)]
    struct Reply {
        status: u16,
        /// The header lines, lower-cased.
        head: String,
        body: Vec<u8>,
    }

    /// Sends one raw request (so `..` reaches the server as written) and reads the reply.
    async fn fetch(addr: SocketAddr, method: &str, path: &str, headers: &str) -> Reply {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        send(&mut stream, method, path, headers).await;
        let mut bytes = Vec::new();
        let read = tokio::time::timeout(PATIENCE, stream.read_to_end(&mut bytes)).await;
        read.expect("reply in time").expect("read reply");
        parse(&bytes)
    }

    async fn send(stream: &mut TcpStream, method: &str, path: &str, headers: &str) {
        let request =
            format!("{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n{headers}\r\n");
        stream
            .write_all(request.as_bytes())
            .await
            .expect("send request");
    }

    fn parse(bytes: &[u8]) -> Reply {
        let end = bytes
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("complete head");
        let head = String::from_utf8_lossy(&bytes[..end]).to_lowercase();
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .expect("status line");
        Reply {
            status,
            head,
            body: bytes[end + 4..].to_vec(),
        }
    }

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8).collect()
    }

    /// A shard folder inside a temporary folder that also holds a secret.
    fn shard_folder(shard: &[u8]) -> (tempfile::TempDir, PathBuf) {
        let root = tempfile::tempdir().expect("temp dir");
        let dir = root.path().join("shards");
        std::fs::create_dir_all(dir.join("sub")).expect("mkdir");
        std::fs::write(root.path().join("secret.txt"), SECRET).expect("write");
        std::fs::write(dir.join("a-000000.tar"), shard).expect("write");
        std::fs::write(dir.join("b-000001.tar.gz"), b"gz").expect("write");
        std::fs::write(dir.join("notes.txt"), b"not a shard").expect("write");
        std::fs::write(dir.join("sub/c.tar"), b"nested").expect("write");
        (root, dir)
    }

    /// Log lines written while the guard lives, on this thread.
    fn capture_logs() -> (Arc<Mutex<Vec<u8>>>, tracing::subscriber::DefaultGuard) {
        let logs = Arc::new(Mutex::new(Vec::new()));
        let sink = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .with_writer(move || Sink(sink.clone()))
            .finish();
        (logs, tracing::subscriber::set_default(subscriber))
    }

    struct Sink(Arc<Mutex<Vec<u8>>>);

    impl io::Write for Sink {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    struct Case {
        method: &'static str,
        path: &'static str,
        headers: &'static str,
        status: u16,
        /// The exact body, when it matters.
        body: Option<Vec<u8>>,
        /// Lines the response head must contain (lower case).
        head: &'static [&'static str],
    }

    fn case(method: &'static str, path: &'static str, status: u16) -> Case {
        Case {
            method,
            path,
            headers: "",
            status,
            body: None,
            head: &[],
        }
    }

    // The default test runtime has one thread, so the captured log sees the server.
    #[tokio::test]
    async fn files_ranges_and_refusals() {
        let shard = pattern(300_000);
        let (_root, dir) = shard_folder(&shard);
        let (logs, _guard) = capture_logs();
        let server = start(&dir, 4).await;
        let cases = [
            Case {
                body: Some(shard.clone()),
                head: &["content-length: 300000", "accept-ranges: bytes"],
                ..case("GET", "/a-000000.tar", 200)
            },
            Case {
                headers: "Range: bytes=10-19\r\n",
                body: Some(shard[10..20].to_vec()),
                head: &["content-range: bytes 10-19/300000", "content-length: 10"],
                ..case("GET", "/a-000000.tar", 206)
            },
            Case {
                headers: "Range: bytes=-5\r\n",
                body: Some(shard[shard.len() - 5..].to_vec()),
                head: &["content-range: bytes 299995-299999/300000"],
                ..case("GET", "/a-000000.tar", 206)
            },
            Case {
                headers: "Range: bytes=300000-\r\n",
                head: &["content-range: bytes */300000"],
                ..case("GET", "/a-000000.tar", 416)
            },
            Case {
                body: Some(Vec::new()),
                head: &["content-length: 300000"],
                ..case("HEAD", "/a-000000.tar", 200)
            },
            Case {
                body: Some(b"nested".to_vec()),
                ..case("GET", "/sub/c.tar", 200)
            },
            Case {
                body: Some(b"a-000000.tar\nb-000001.tar.gz\n".to_vec()),
                head: &["content-type: text/plain; charset=utf-8"],
                ..case("GET", "/", 200)
            },
            case("GET", "/missing.tar", 404),
            case("GET", "/sub", 404),
            case("POST", "/a-000000.tar", 405),
            case("GET", "/../secret.txt", 404),
            case("GET", "/%2e%2e/secret.txt", 404),
            case("GET", "/sub/../../secret.txt", 404),
            case("GET", "/../etc/passwd", 404),
        ];
        let requests = cases.len();
        for case in cases {
            let reply = fetch(server.addr, case.method, case.path, case.headers).await;
            let name = format!("{} {} {}", case.method, case.path, case.headers.trim());
            assert_eq!(reply.status, case.status, "{name}: {}", reply.head);
            if let Some(body) = case.body {
                assert!(reply.body == body, "{name}: got {} bytes", reply.body.len());
            }
            for line in case.head {
                assert!(
                    reply.head.contains(line),
                    "{name}: no `{line}` in {}",
                    reply.head
                );
            }
            let leaked = reply.body.windows(SECRET.len()).any(|w| w == SECRET);
            assert!(!leaked, "{name}: served a file outside the folder");
        }
        server.stop().await;

        let logs =
            String::from_utf8_lossy(&logs.lock().unwrap_or_else(|p| p.into_inner())).into_owned();
        let lines: Vec<&str> = logs.lines().filter(|l| l.contains(" request ")).collect();
        assert_eq!(
            lines.len(),
            requests,
            "one access line per request:\n{logs}"
        );
        let ranged = "method=GET path=/a-000000.tar status=206 bytes=10 ";
        assert!(
            lines.iter().any(|l| l.contains(ranged)),
            "no `{ranged}` in\n{logs}"
        );
    }

    #[tokio::test]
    async fn a_request_holds_its_slot_until_its_body_is_sent() {
        // Far more than the socket buffers hold, so an unread body stays in flight.
        let big = vec![7u8; 64 << 20];
        let (_root, dir) = shard_folder(&big);
        let server = start(&dir, 1).await;

        let mut stalled = TcpStream::connect(server.addr).await.expect("connect");
        send(&mut stalled, "GET", "/a-000000.tar", "").await;
        let mut head = vec![0; 4096];
        let n = stalled
            .read(&mut head)
            .await
            .expect("headers of the big file");
        assert!(
            head[..n].starts_with(b"HTTP/1.1 200"),
            "{:?}",
            String::from_utf8_lossy(&head[..n])
        );

        let mut waiting = TcpStream::connect(server.addr).await.expect("connect");
        send(&mut waiting, "GET", "/sub/c.tar", "").await;
        let mut reply = Vec::new();
        let early =
            tokio::time::timeout(Duration::from_millis(300), waiting.read_to_end(&mut reply));
        assert!(
            early.await.is_err(),
            "second request answered while the slot was taken"
        );

        drop(stalled);
        let read = tokio::time::timeout(PATIENCE, waiting.read_to_end(&mut reply)).await;
        read.expect("answered once the slot is free")
            .expect("read reply");
        let reply = parse(&reply);
        assert_eq!((reply.status, reply.body.as_slice()), (200, &b"nested"[..]));
        server.stop().await;
    }

    #[tokio::test]
    async fn bad_folder_or_busy_port_is_named() {
        let root = tempfile::tempdir().expect("temp dir");
        let missing = root.path().join("no-such-folder");
        let busy = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let busy_addr = busy.local_addr().expect("bound");
        let cases = [
            (
                missing.clone(),
                SocketAddr::from(([127, 0, 0, 1], 0)),
                missing.display().to_string(),
            ),
            (root.path().to_path_buf(), busy_addr, busy_addr.to_string()),
        ];
        for (dir, bind, named) in cases {
            let options = ServeOptions {
                bind,
                ..options(&dir, 4)
            };
            let result = serve(options, |_| panic!("must not get ready"), async {}).await;
            let message = format!("{:#}", result.expect_err("serve must fail"));
            assert!(
                message.contains(&named),
                "`{message}` does not name `{named}`"
            );
        }
    }

    /// Reads what the server sends until it closes the connection, for at most
    /// `PATIENCE`; returns the bytes, or `None` if the connection stayed open.
    async fn read_until_closed(stream: &mut TcpStream) -> Option<usize> {
        let mut total = 0;
        let mut buffer = vec![0; 1 << 20];
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            match tokio::time::timeout_at(deadline, stream.read(&mut buffer)).await {
                Err(_) => return None,
                Ok(Ok(0) | Err(_)) => return Some(total),
                Ok(Ok(n)) => total += n,
            }
        }
    }

    #[tokio::test]
    async fn a_client_that_stops_reading_loses_its_slot_after_the_send_timeout() {
        let big = vec![7u8; 64 << 20];
        let (_root, dir) = shard_folder(&big);
        let send = Duration::from_millis(500);
        let mut options = options(&dir, 1);
        options.timeouts.send = send;
        let server = start_with(options).await;

        let mut stalled = TcpStream::connect(server.addr).await.expect("connect");
        send_request(&mut stalled, "/a-000000.tar").await;
        let waiting_since = std::time::Instant::now();
        let reply = fetch(server.addr, "GET", "/sub/c.tar", "").await;
        assert_eq!((reply.status, reply.body.as_slice()), (200, &b"nested"[..]));
        assert!(
            waiting_since.elapsed() >= send,
            "answered while the stalled client still held the only slot"
        );
        // The stalled client was cut off: what it reads ends before the whole file.
        let got = read_until_closed(&mut stalled).await;
        let got = got.expect("the stalled connection is closed");
        assert!(got < big.len(), "the stalled client got all {got} bytes");
        server.stop().await;
    }

    #[tokio::test]
    async fn a_connection_that_sends_no_request_is_closed_after_the_header_timeout() {
        let (_root, dir) = shard_folder(b"shard");
        let mut options = options(&dir, 4);
        options.timeouts.header = Duration::from_millis(300);
        let server = start_with(options).await;
        let mut silent = TcpStream::connect(server.addr).await.expect("connect");
        let mut partial = TcpStream::connect(server.addr).await.expect("connect");
        partial
            .write_all(b"GET /a-000000.tar HTTP/1.1\r\nHost: te")
            .await
            .expect("send part of a head");
        for (name, stream) in [("silent", &mut silent), ("partial head", &mut partial)] {
            let got = read_until_closed(stream).await;
            assert!(got.is_some(), "{name}: the connection stayed open");
        }
        // A request sent in time is answered as ever.
        let reply = fetch(server.addr, "GET", "/a-000000.tar", "").await;
        assert_eq!((reply.status, reply.body.as_slice()), (200, &b"shard"[..]));
        server.stop().await;
    }

    async fn send_request(stream: &mut TcpStream, path: &str) {
        send(stream, "GET", path, "").await;
    }

    #[tokio::test]
    async fn links_out_of_the_folder_are_refused_unless_followed() {
        let (root, dir) = shard_folder(b"shard");
        let link = |target: &Path, name: &str| {
            std::os::unix::fs::symlink(target, dir.join(name)).expect("symlink");
        };
        link(&root.path().join("secret.txt"), "out.tar");
        link(Path::new("a-000000.tar"), "in.tar");
        link(root.path(), "up");
        link(Path::new("sub"), "down");
        // The folder itself may be reached through a link.
        let via = root.path().join("via-link");
        std::os::unix::fs::symlink(&dir, &via).expect("symlink");
        let inside: &[(&str, &[u8])] = &[
            ("/in.tar", b"shard"),
            ("/down/c.tar", b"nested"),
            ("/a-000000.tar", b"shard"),
        ];
        let outside: &[(&str, &[u8])] = &[("/out.tar", SECRET), ("/up/secret.txt", SECRET)];
        for follow_links in [false, true] {
            let server = start_with(ServeOptions {
                follow_links,
                ..options(&via, 4)
            })
            .await;
            for &(path, body) in inside {
                let reply = fetch(server.addr, "GET", path, "").await;
                assert_eq!((reply.status, reply.body.as_slice()), (200, body), "{path}");
            }
            for &(path, body) in outside {
                let reply = fetch(server.addr, "GET", path, "").await;
                let expected = if follow_links {
                    (200, body)
                } else {
                    (404, &b"not found\n"[..])
                };
                assert_eq!(
                    (reply.status, reply.body.as_slice()),
                    expected,
                    "{path}, follow_links {follow_links}"
                );
            }
            let listing = fetch(server.addr, "GET", "/", "").await;
            let listed = String::from_utf8_lossy(&listing.body).into_owned();
            let expected = if follow_links {
                "a-000000.tar\nb-000001.tar.gz\nin.tar\nout.tar\n"
            } else {
                "a-000000.tar\nb-000001.tar.gz\nin.tar\n"
            };
            assert_eq!(listed, expected, "follow_links {follow_links}");
            server.stop().await;
        }
    }
}
