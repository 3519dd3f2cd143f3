//! The server's connections: the accept loop and the two time limits that keep a slow
//! or silent client from holding the server.
//!
//! - A connection must send a complete request head within `header_timeout` of being
//!   accepted (or of its previous response), else it is closed: idle connections and
//!   slowloris clients cost a socket for that long, never more (hyper's
//!   `header_read_timeout`, which covers the wait for the first byte too).
//! - Every write to the client must make progress within `send_timeout` ([`SendDeadline`]):
//!   a client that stops reading a body loses its connection, and its request the slot it
//!   held, once the socket buffers are full and that much time has passed without a byte
//!   taken.
//!
//! With a TLS acceptor (the dashboard off loopback), each connection first completes its
//! TLS handshake, within the header timeout too, in its own task: a client that stalls
//! there holds its socket, never the accept loop.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Sleep;
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt as _;

/// How long a client may take before the server closes its connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// To send a complete request head, counted from the connection's accept or its
    /// previous response.
    pub header: Duration,
    /// For one write to make progress: the longest the server waits for the client to
    /// take more bytes of a response.
    pub send: Duration,
}

/// How long the accept loop pauses after an error that is not the peer's (out of file
/// descriptors, say), so it does not spin.
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// Serves `app` on `listener` until `shutdown` resolves; then accepts nothing more, lets
/// the requests in flight finish (each still bound by the send timeout) and returns.
pub(crate) async fn serve_connections(
    listener: TcpListener,
    app: Router,
    timeouts: Timeouts,
    tls: Option<TlsAcceptor>,
    shutdown: impl Future<Output = ()>,
) {
    // Every connection task holds a receiver; `closed` resolves when all have ended.
    let (stop, stopping) = watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) if is_peer_error(&error) => continue,
                Err(error) => {
                    tracing::warn!(%error, "cannot accept a connection");
                    tokio::time::sleep(ACCEPT_PAUSE).await;
                    continue;
                }
            },
        };
        let client = Client {
            peer,
            app: app.clone(),
            timeouts,
            stopping: stopping.clone(),
        };
        match &tls {
            None => tokio::spawn(client.serve(stream)),
            Some(tls) => tokio::spawn(client.serve_tls(tls.clone(), stream)),
        };
    }
    drop(listener);
    let _ = stop.send(true);
    drop(stopping);
    stop.closed().await;
}

/// One accepted connection and what serving it needs.
struct Client {
    peer: SocketAddr,
    app: Router,
    timeouts: Timeouts,
    stopping: watch::Receiver<bool>,
}

impl Client {
    /// Completes the TLS handshake within the header timeout, then serves HTTP on it.
    async fn serve_tls(self, tls: TlsAcceptor, stream: TcpStream) {
        match tokio::time::timeout(self.timeouts.header, tls.accept(stream)).await {
            Ok(Ok(stream)) => self.serve(stream).await,
            Ok(Err(error)) => {
                tracing::debug!(peer = %self.peer, %error, "TLS handshake failed");
            }
            Err(_) => tracing::debug!(peer = %self.peer, "TLS handshake timed out"),
        }
    }

    /// Serves HTTP/1 on `stream` until it closes, breaks a time limit or the server
    /// stops.
    async fn serve<S>(self, stream: S)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let Self {
            peer,
            app,
            timeouts,
            mut stopping,
        } = self;
        let io = TokioIo::new(SendDeadline::new(stream, timeouts.send));
        let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
            let mut request = request.map(Body::new);
            request.extensions_mut().insert(ConnectInfo(peer));
            app.clone().oneshot(request)
        });
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(timeouts.header);
        let mut conn = std::pin::pin!(builder.serve_connection(io, service));
        let mut stopped = false;
        let result = loop {
            tokio::select! {
                result = conn.as_mut() => break result,
                changed = stopping.changed(), if !stopped => {
                    // The server is stopping (or gone): finish the request in flight, then
                    // close.
                    let _ = changed;
                    stopped = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
        };
        if let Err(error) = result {
            // Timeouts and clients that went away end here; the access log has the request.
            tracing::debug!(%peer, %error, "connection closed");
        }
    }
}

/// Errors of one incoming connection (it was reset before it was accepted), not of the
/// listener.
fn is_peer_error(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset
    )
}

/// A stream whose writes must make progress: a write (or flush, or shutdown) that stays
/// pending for `limit` fails with [`io::ErrorKind::TimedOut`]. Any write that goes
/// through starts the clock afresh. Reads are untouched.
pub(super) struct SendDeadline<S> {
    inner: S,
    limit: Duration,
    /// Armed while a write is pending.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<S> SendDeadline<S> {
    pub(super) fn new(inner: S, limit: Duration) -> Self {
        Self {
            inner,
            limit,
            stalled: None,
        }
    }

    /// What a write that returned `polled` becomes: pending until the limit, then an
    /// error; a ready result disarms the clock.
    fn watch<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.stalled = None;
            return polled;
        }
        let limit = self.limit;
        let stalled = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match stalled.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client took no bytes for {limit:?}"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for SendDeadline<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for SendDeadline<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.watch(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.watch(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_flush(cx);
        self.watch(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.watch(cx, polled)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A write into a pipe nobody reads fails once the limit has passed; while the other
    /// end reads, writes go on however long they take in all.
    #[tokio::test]
    async fn a_write_that_makes_no_progress_times_out() {
        let limit = Duration::from_millis(300);
        let (ours, mut theirs) = tokio::io::duplex(1024);
        let mut stream = SendDeadline::new(ours, limit);
        let chunk = [7u8; 512];
        // Progress: each write goes through because the other side reads, for three
        // times the limit in all (the pauses are the time under test).
        let started = Instant::now();
        while started.elapsed() < 3 * limit {
            stream.write_all(&chunk).await.expect("write with a reader");
            let mut back = [0u8; 512];
            theirs.read_exact(&mut back).await.expect("read");
            tokio::time::sleep(limit / 3).await;
        }
        // No progress: the buffer fills, then the write waits, then fails.
        let started = Instant::now();
        let error = loop {
            if let Err(error) = stream.write_all(&chunk).await {
                break error;
            }
        };
        assert_eq!(error.kind(), io::ErrorKind::TimedOut, "{error}");
        assert!(started.elapsed() >= limit, "{:?}", started.elapsed());
        drop(theirs);
    }
}
