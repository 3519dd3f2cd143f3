//! `bench dashboard`'s browser: HTTP/1.1 over loopback TCP, a request per connection, with
//! the session a page gets by logging in (the token POSTed to `login`, the cookie kept);
//! and an open page: it follows `events` and, on each event, fetches itself again (and
//! its chart every 5 s), as the dashboard's script (`pages::SCRIPT`) does in a browser.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// The longest one request may take before the benchmark gives up on it.
const REQUEST_LIMIT: Duration = Duration::from_secs(60);

/// How often an open job page fetches its chart again (the script's 5 s).
const CHART_EVERY: Duration = Duration::from_secs(5);

/// An answer, as read off the socket.
#[derive(Debug)]
pub(super) struct Answer {
    pub status: u16,
    /// Every byte of the answer: status line, headers and body as sent.
    pub wire_bytes: usize,
    /// The body, its chunked framing taken off.
    pub body: Vec<u8>,
    /// From connecting to the last byte.
    pub took: Duration,
}

/// A browser of one dashboard: its address and, once logged in, the session cookie.
#[derive(Debug, Clone)]
pub(super) struct Browser {
    addr: SocketAddr,
    cookie: Option<String>,
}

impl Browser {
    /// A browser without a session yet.
    pub(super) fn new(addr: SocketAddr) -> Self {
        Browser { addr, cookie: None }
    }

    /// Logs in as the page does: POSTs `token` to `login` and keeps the cookie it sets.
    pub(super) async fn login(&mut self, token: &str) -> anyhow::Result<Answer> {
        let origin = format!("http://{}", self.addr);
        let answer = self
            .request("POST", "/login", &[("Origin", &origin)], token)
            .await?;
        let (answer, cookie) = answer;
        anyhow::ensure!(answer.status == 200, "the login answered {}", answer.status);
        self.cookie = Some(cookie.context("the login set no cookie")?);
        Ok(answer)
    }

    /// `GET path` as a browser asks for a page.
    pub(super) async fn get(&self, path: &str) -> anyhow::Result<Answer> {
        let accept = [("Accept", "text/html,*/*")];
        Ok(self.request("GET", path, &accept, "").await?.0)
    }

    /// One request on a fresh connection; the answer and the cookie it sets, if any.
    async fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> anyhow::Result<(Answer, Option<String>)> {
        let started = Instant::now();
        let mut stream = TcpStream::connect(self.addr)
            .await
            .with_context(|| format!("connecting to the dashboard at {}", self.addr))?;
        stream
            .write_all(self.head(method, path, headers, body).as_bytes())
            .await?;
        let mut bytes = Vec::new();
        tokio::time::timeout(REQUEST_LIMIT, stream.read_to_end(&mut bytes))
            .await
            .with_context(|| format!("{method} {path}: no answer within {REQUEST_LIMIT:?}"))?
            .with_context(|| format!("{method} {path}: reading the answer"))?;
        let (status, cookie, body) =
            parse(&bytes).with_context(|| format!("{method} {path}: a bad answer"))?;
        let answer = Answer {
            status,
            wire_bytes: bytes.len(),
            body,
            took: started.elapsed(),
        };
        Ok((answer, cookie))
    }

    /// The request's head: `Host` the dashboard's address, the session's cookie.
    fn head(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> String {
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n",
            self.addr
        );
        if let Some(cookie) = &self.cookie {
            head.push_str(&format!("Cookie: {cookie}\r\n"));
        }
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
        head
    }

    /// Opens `page` as a browser tab does and follows the dashboard's `events` until
    /// `stop` turns true: each event is refetched as the page's script does; `chart`, a
    /// job page's chart, is fetched again at most every 5 s. Returns when each event came.
    pub(super) async fn open_page(
        &self,
        page: &str,
        chart: Option<&str>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) -> anyhow::Result<OpenPage> {
        let mut stream = self.events().await?;
        let mut seen = OpenPage::default();
        let mut buffer = Vec::new();
        let mut chart_at = Instant::now();
        loop {
            let mut piece = [0_u8; 4096];
            let read = tokio::select! {
                read = stream.read(&mut piece) => read.context("reading the events")?,
                _ = stop.wait_for(|stop| *stop) => return Ok(seen),
            };
            if read == 0 {
                bail!("the dashboard ended the events stream");
            }
            buffer.extend_from_slice(&piece[..read]);
            for _ in 0..take_events(&mut buffer) {
                seen.events.push(Instant::now());
                self.refetch(page, chart, &mut chart_at, &mut seen).await;
            }
        }
    }

    /// The `events` stream, its answer's head read and checked.
    async fn events(&self) -> anyhow::Result<TcpStream> {
        let mut stream = TcpStream::connect(self.addr).await?;
        let head = self.head("GET", "/events", &[("Accept", "text/event-stream")], "");
        stream.write_all(head.as_bytes()).await?;
        let mut got = Vec::new();
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            let mut byte = [0_u8; 1];
            anyhow::ensure!(stream.read(&mut byte).await? == 1, "events: no answer");
            got.push(byte[0]);
        }
        let top = String::from_utf8_lossy(&got);
        anyhow::ensure!(
            top.starts_with("HTTP/1.1 200"),
            "events refused: {}",
            top.lines().next().unwrap_or("")
        );
        Ok(stream)
    }

    /// What the page's script does on an event: the page again, and the chart when 5 s
    /// have passed since it was last fetched.
    async fn refetch(
        &self,
        page: &str,
        chart: Option<&str>,
        chart_at: &mut Instant,
        seen: &mut OpenPage,
    ) {
        let fetched = self.get(page).await;
        seen.count(fetched);
        if let Some(chart) = chart
            && chart_at.elapsed() >= CHART_EVERY
        {
            *chart_at = Instant::now();
            let fetched = self.get(&format!("{chart}?at={}", seen.events.len())).await;
            seen.count(fetched);
        }
    }
}

/// The thread the benchmark's browsers run on: a runtime of its own on one thread, so
/// that their CPU time ([`BrowserThread::cpu_s`]) can be told apart from the head's.
#[derive(Debug)]
pub(super) struct BrowserThread {
    handle: tokio::runtime::Handle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl BrowserThread {
    pub(super) fn start() -> anyhow::Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the browsers' runtime")?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("bench-browsers".to_owned())
            .spawn(move || {
                let _ = runtime.block_on(stopped);
            })
            .context("starting the browsers' thread")?;
        Ok(BrowserThread {
            handle,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Runs `work` on the browsers' thread and waits for it.
    pub(super) async fn run<T: Send + 'static>(
        &self,
        work: impl Future<Output = T> + Send + 'static,
    ) -> anyhow::Result<T> {
        self.handle
            .spawn(work)
            .await
            .context("a task of the browsers' thread failed")
    }

    /// Starts `work` on the browsers' thread.
    pub(super) fn spawn<T: Send + 'static>(
        &self,
        work: impl Future<Output = T> + Send + 'static,
    ) -> tokio::task::JoinHandle<T> {
        self.handle.spawn(work)
    }

    /// The browsers' thread's CPU seconds so far.
    pub(super) async fn cpu_s(&self) -> f64 {
        self.run(async { super::usage::thread_cpu_s() })
            .await
            .ok()
            .flatten()
            .unwrap_or(0.0)
    }
}

impl Drop for BrowserThread {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// What one open page saw.
#[derive(Debug, Default)]
pub(super) struct OpenPage {
    /// When each change event arrived.
    pub events: Vec<Instant>,
    /// Pages and charts fetched again, and those that failed (an error or not 200).
    pub fetched: usize,
    pub failed: usize,
}

impl OpenPage {
    fn count(&mut self, fetched: anyhow::Result<Answer>) {
        self.fetched += 1;
        if !fetched.is_ok_and(|answer| answer.status == 200) {
            self.failed += 1;
        }
    }
}

/// Removes the complete server-sent events (`data:` messages ended by a blank line) at
/// the front of `buffer` and returns how many there were; comments and the `retry:`
/// line count for nothing. The stream's chunk sizes are hex lines, never `data:`.
fn take_events(buffer: &mut Vec<u8>) -> usize {
    let mut events = 0;
    while let Some(end) = buffer.windows(2).position(|w| w == b"\n\n") {
        if buffer[..end].windows(5).any(|w| w == b"data:") {
            events += 1;
        }
        buffer.drain(..end + 2);
    }
    events
}

/// An answer's status, `Set-Cookie` pair (`name=value`) and body (unchunked).
fn parse(bytes: &[u8]) -> anyhow::Result<(u16, Option<String>, Vec<u8>)> {
    let split = bytes
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("no end of the headers")?;
    let top = String::from_utf8_lossy(&bytes[..split]);
    let body = &bytes[split + 4..];
    let mut lines = top.lines();
    let status = lines
        .next()
        .and_then(|line| line.split(' ').nth(1))
        .and_then(|code| code.parse().ok())
        .context("no status line")?;
    let mut cookie = None;
    let mut chunked = false;
    for (name, value) in lines.filter_map(|line| line.split_once(':')) {
        let value = value.trim();
        match name.trim().to_ascii_lowercase().as_str() {
            "set-cookie" => cookie = value.split(';').next().map(str::to_owned),
            "transfer-encoding" => chunked = value.contains("chunked"),
            _ => {}
        }
    }
    let body = if chunked {
        unchunk(body).context("a bad chunked body")?
    } else {
        body.to_vec()
    };
    Ok((status, cookie, body))
}

/// The data of a chunked body.
fn unchunk(mut rest: &[u8]) -> Option<Vec<u8>> {
    let mut data = Vec::new();
    loop {
        let line_end = rest.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&rest[..line_end]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(data);
        }
        let after = rest.get(line_end + 2..)?;
        data.extend_from_slice(after.get(..size)?);
        rest = after.get(size + 2..)?;
    }
}

/// The absolute `http://` and `https://` URLs in `text` that a browser would fetch or
/// follow: every one but XML namespace names (`xmlns="http://www.w3.org/2000/svg"`), which
/// name a vocabulary and are never requested.
pub(super) fn outside_urls(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (at, _) in text.match_indices("http") {
        let rest = &text[at..];
        if !(rest.starts_with("http://") || rest.starts_with("https://")) {
            continue;
        }
        let before = text[..at]
            .trim_end_matches(['"', '\''])
            .trim_end_matches('=');
        let attribute = before.rsplit([' ', '<', '\n']).next().unwrap_or("");
        if attribute.starts_with("xmlns") {
            continue;
        }
        let end = rest
            .find(|c: char| c.is_whitespace() || matches!(c, '"' | '\'' | ')' | '<' | '>'))
            .unwrap_or(rest.len());
        found.push(rest[..end].to_owned());
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_counted_once_complete() {
        let mut buffer = b"6\r\nretry: 2000\n\n\r\n".to_vec();
        assert_eq!(take_events(&mut buffer), 0);
        buffer.extend_from_slice(b"c\r\ndata: 1f\n\n\r\nd\r\n: still here\n\ndata: 2");
        assert_eq!(take_events(&mut buffer), 1);
        buffer.extend_from_slice(b"0\n\n");
        assert_eq!(take_events(&mut buffer), 1);
        assert!(!buffer.windows(5).any(|w| w == b"data:"));
    }

    #[test]
    fn an_answer_is_read_plain_or_chunked() {
        let plain =
            b"HTTP/1.1 200 OK\r\nset-cookie: s=abc; HttpOnly\r\ncontent-length: 2\r\n\r\nhi";
        let (status, cookie, body) = parse(plain).expect("parses");
        assert_eq!(
            (status, cookie.as_deref(), &body[..]),
            (200, Some("s=abc"), &b"hi"[..])
        );
        let chunked =
            b"HTTP/1.1 401 Unauthorized\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        let (status, cookie, body) = parse(chunked).expect("parses");
        assert_eq!((status, cookie, &body[..]), (401, None, &b"abcde"[..]));
        assert!(parse(b"HTTP/1.1 200 OK\r\n").is_err());
        assert!(parse(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n").is_err());
    }

    #[test]
    fn only_urls_that_would_be_fetched_are_outside() {
        for (text, expected) in [
            (r#"<link href="style.css"><script src="app.js">"#, vec![]),
            (
                r#"<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink='http://www.w3.org/1999/xlink'>"#,
                vec![],
            ),
            (
                r#"<img src="https://cdn.example/x.png"><a href=http://e.org/a>"#,
                vec!["https://cdn.example/x.png", "http://e.org/a"],
            ),
            (
                "body{background:url(http://e.org/b.png)}",
                vec!["http://e.org/b.png"],
            ),
            ("fetch(new URL(\"login\", here))", vec![]),
        ] {
            assert_eq!(outside_urls(text), expected, "{text}");
        }
    }
}
