//! Requests and responses over QUIC: one UDP port per daemon, one bidirectional stream
//! per request, and unreliable datagrams for what may be lost (heartbeats).
//!
//! A stream carries exactly one request frame and one response frame. A datagram carries
//! one frame, answered (or not) by a datagram: no stream, no task, no retransmission, so
//! the sender matches answers to what it sent and treats silence as a loss. The server
//! tells its [`Handler`] who the peer is ([`PeerIdentity`]): the common name of a
//! verified cluster certificate, or nobody (only the head lets such clients in, so that
//! nodes can join). A bad frame closes its stream, a bad datagram is dropped, a failed
//! handshake closes its connection; none stops the server.

use std::future::Future;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{
    ConnectionError, Endpoint, Incoming, RecvStream, SendDatagramError, SendStream, VarInt,
};
use rustls::pki_types::CertificateDer;
use tracing::{Instrument, debug, info_span, warn};

use crate::tls::{ClientTls, SERVER_NAME, ServerTls, certificate_name};
use crate::wire::{
    DEFAULT_MAX_FRAME, Message, WireError, decode_with_limit, encode, read_frame, write_frame,
};
use thread::ThreadRuntime;

mod thread;

/// Stream and connection error codes this layer sends.
const CODE_OK: u32 = 0;
/// A request frame that could not be read or validated.
const CODE_BAD_FRAME: u32 = 1;
/// A request that did not arrive in time.
const CODE_TIMEOUT: u32 = 2;
/// A certificate that verified but whose name could not be read.
const CODE_BAD_IDENTITY: u32 = 3;

/// Limits and timers of a connection.
#[derive(Debug, Clone)]
pub struct TransportOptions {
    /// The largest frame payload accepted.
    pub max_frame: usize,
    /// How often an idle connection is pinged, so that it stays open.
    pub keep_alive: Duration,
    /// After how long without a packet a connection is dropped.
    pub idle_timeout: Duration,
    /// How long the server waits for a request once a stream is open.
    pub request_timeout: Duration,
    /// Streams a peer may have open at once on one connection.
    pub max_streams: u32,
    /// Whether connections take datagrams. Without them, a peer's
    /// [`Connection::send_datagram`] fails with [`TransportError::NoDatagram`] and it
    /// sends on a stream instead.
    pub datagrams: bool,
}

impl Default for TransportOptions {
    fn default() -> Self {
        Self {
            max_frame: DEFAULT_MAX_FRAME,
            // A third of the idle timeout: two pings may be lost before it ends. Pings of
            // the head's 1,000 idle node connections (heartbeats go over UDP) cost it a
            // third of what they did at 1 s.
            keep_alive: Duration::from_secs(3),
            idle_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
            max_streams: 256,
            datagrams: true,
        }
    }
}

/// Who is on the other end of a connection, as the server sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub address: SocketAddr,
    pub identity: PeerIdentity,
}

/// Whether the peer presented a certificate of the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerIdentity {
    /// A verified cluster certificate with this common name.
    Authenticated { name: String },
    /// No certificate: only a join request may be answered.
    Unauthenticated,
}

impl Peer {
    /// The certificate's name, if the peer is authenticated.
    pub fn name(&self) -> Option<&str> {
        match &self.identity {
            PeerIdentity::Authenticated { name } => Some(name),
            PeerIdentity::Unauthenticated => None,
        }
    }
}

/// Answers requests. Implemented by any `Fn(Peer, Message) -> impl Future<Output =
/// Message>`. Requests run concurrently, one task per stream.
pub trait Handler: Send + Sync + 'static {
    fn handle(&self, peer: Peer, request: Message) -> impl Future<Output = Message> + Send;

    /// Answers a datagram with one (`None`: no answer). Called on the connection's own
    /// task, one datagram after the other, so it must not block. By default every
    /// datagram is dropped.
    fn datagram(&self, peer: &Peer, message: Message) -> Option<Message> {
        debug!(peer = %peer.address, "dropped a datagram: this server takes none");
        let _ = message;
        None
    }

    /// The connection of `peer` ended (closed by either side, or silent past the idle
    /// timeout); requests still running on it carry on. Nothing by default.
    fn disconnected(&self, peer: &Peer) {
        let _ = peer;
    }
}

impl<F, Fut> Handler for F
where
    F: Fn(Peer, Message) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Message> + Send,
{
    fn handle(&self, peer: Peer, request: Message) -> impl Future<Output = Message> + Send {
        self(peer, request)
    }
}

/// Why a request or a connection failed. Every variant names the peer.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("cannot bind {address}: {source}")]
    Bind {
        address: SocketAddr,
        source: std::io::Error,
    },
    #[error("bad tls configuration for quic: {reason}")]
    Config { reason: String },
    #[error("cannot connect to {peer}: {source}")]
    Connect {
        peer: SocketAddr,
        source: quinn::ConnectError,
    },
    #[error("handshake with {peer} failed: {source}")]
    Handshake {
        peer: SocketAddr,
        source: ConnectionError,
    },
    #[error("connection to {peer} lost: {source}")]
    Closed {
        peer: SocketAddr,
        source: ConnectionError,
    },
    #[error("{peer} did not answer within {after:?}")]
    Timeout { peer: SocketAddr, after: Duration },
    #[error("{peer} closed the stream (code {code})")]
    StreamReset { peer: SocketAddr, code: u64 },
    #[error("{peer} closed the stream without answering")]
    NoResponse { peer: SocketAddr },
    #[error("bad frame from {peer}: {source}")]
    Wire { peer: SocketAddr, source: WireError },
    #[error("{peer} takes no datagram of {size} bytes ({})", datagram_limit(*.max))]
    NoDatagram {
        peer: SocketAddr,
        size: usize,
        /// The largest datagram the connection takes now; `None`: none at all.
        max: Option<usize>,
    },
}

fn datagram_limit(max: Option<usize>) -> String {
    match max {
        Some(max) => format!("at most {max} bytes"),
        None => "no datagrams on this connection".to_owned(),
    }
}

/// A daemon's endpoint: accepts connections, and can open its own from the same port.
#[derive(Debug, Clone)]
pub struct Server {
    endpoint: Endpoint,
    options: TransportOptions,
    /// The endpoint's own thread ([`Server::bind_on_thread`]), where connections are
    /// served; `None`: the runtime that bound it.
    thread: Option<Arc<ThreadRuntime>>,
}

/// Outgoing connections from a fresh UDP socket of their own (a daemon that also serves
/// connects with [`Server::connect`] instead, from its one port).
#[derive(Debug)]
pub enum Client {}

/// An open connection, on which requests run concurrently. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Connection {
    inner: quinn::Connection,
    peer: SocketAddr,
    max_frame: usize,
    /// Whether this side sends datagrams ([`TransportOptions::datagrams`]).
    datagrams: bool,
    /// The socket of a [`Client`] connection, kept as long as the connection.
    _endpoint: Endpoint,
}

impl Server {
    /// Listens on `address` (port 0 picks one) with the default options.
    pub fn bind(address: SocketAddr, tls: &ServerTls) -> Result<Self, TransportError> {
        Self::bind_with(address, tls, TransportOptions::default())
    }

    /// Listens on `address` with `options`.
    pub fn bind_with(
        address: SocketAddr,
        tls: &ServerTls,
        options: TransportOptions,
    ) -> Result<Self, TransportError> {
        let config = server_config(tls, &options)?;
        let endpoint = Endpoint::server(config, address)
            .map_err(|source| TransportError::Bind { address, source })?;
        Ok(Self {
            endpoint,
            options,
            thread: None,
        })
    }

    /// Listens on `address` with `options`, on a thread of its own named `name`: the
    /// endpoint, its connections and the tasks that serve their streams (the handler's
    /// futures included) run there, on a single-threaded runtime, whatever runtime calls
    /// this. For a daemon whose requests hand work to other threads (actor calls), whose
    /// answers then wake this one thread rather than a pool's workers. The thread ends
    /// once the server is closed and all its connections are gone.
    pub fn bind_on_thread(
        address: SocketAddr,
        tls: &ServerTls,
        options: TransportOptions,
        name: &str,
    ) -> Result<Self, TransportError> {
        let config = server_config(tls, &options)?;
        let bind_error = |source| TransportError::Bind { address, source };
        let thread = ThreadRuntime::start(name).map_err(bind_error)?;
        let socket = std::net::UdpSocket::bind(address).map_err(bind_error)?;
        let runtime: Arc<dyn quinn::Runtime> = thread.clone();
        let endpoint = Endpoint::new(
            quinn::EndpointConfig::default(),
            Some(config),
            socket,
            runtime,
        )
        .map_err(bind_error)?;
        Ok(Self {
            endpoint,
            options,
            thread: Some(thread),
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> Result<SocketAddr, TransportError> {
        self.endpoint
            .local_addr()
            .map_err(|source| TransportError::Bind {
                address: SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)),
                source,
            })
    }

    /// Accepts connections and serves their requests with `handler` until
    /// [`Server::close`]. Each connection and each stream runs on a task of its own.
    pub async fn accept_loop<H: Handler>(&self, handler: H) {
        let handler = Arc::new(handler);
        while let Some(incoming) = self.endpoint.accept().await {
            let span = info_span!("connection", peer = %incoming.remote_address());
            let connection = serve_connection(incoming, handler.clone(), self.options.clone());
            match &self.thread {
                Some(thread) => thread.spawn(connection.instrument(span)),
                None => drop(tokio::spawn(connection.instrument(span))),
            }
        }
        debug!("server closed");
    }

    /// Opens a connection to `peer` from this server's port.
    pub async fn connect(
        &self,
        peer: SocketAddr,
        tls: &ClientTls,
    ) -> Result<Connection, TransportError> {
        connect_from(self.endpoint.clone(), peer, tls, &self.options).await
    }

    /// Closes every connection and ends [`Server::accept_loop`].
    pub fn close(&self) {
        self.endpoint
            .close(VarInt::from_u32(CODE_OK), b"server closed");
    }
}

impl Client {
    /// Connects to `peer` with the default options.
    pub async fn connect(peer: SocketAddr, tls: &ClientTls) -> Result<Connection, TransportError> {
        Self::connect_with(peer, tls, &TransportOptions::default()).await
    }

    /// Connects to `peer` with `options`.
    pub async fn connect_with(
        peer: SocketAddr,
        tls: &ClientTls,
        options: &TransportOptions,
    ) -> Result<Connection, TransportError> {
        let local = match peer {
            SocketAddr::V4(_) => SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)),
            SocketAddr::V6(_) => SocketAddr::from((Ipv6Addr::UNSPECIFIED, 0)),
        };
        let endpoint = Endpoint::client(local).map_err(|source| TransportError::Bind {
            address: local,
            source,
        })?;
        connect_from(endpoint, peer, tls, options).await
    }
}

impl Connection {
    /// The server's address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// Sends `request` on a stream of its own and waits at most `timeout` for the answer.
    pub async fn request(
        &self,
        request: &Message,
        timeout: Duration,
    ) -> Result<Message, TransportError> {
        let frame = crate::wire::encode(request).map_err(|source| TransportError::Wire {
            peer: self.peer,
            source,
        })?;
        self.request_encoded(&frame, timeout).await
    }

    /// Sends bytes already framed by [`crate::wire::encode`] (to forward a frame, or to
    /// repeat one request without encoding it again) and waits at most `timeout` for the
    /// answer. The server validates them as any frame.
    pub async fn request_encoded(
        &self,
        frame: &[u8],
        timeout: Duration,
    ) -> Result<Message, TransportError> {
        tokio::time::timeout(timeout, self.exchange(frame))
            .await
            .map_err(|_| TransportError::Timeout {
                peer: self.peer,
                after: timeout,
            })?
    }

    /// Sends `message` as one datagram: unreliable (it may be lost, or arrive after a
    /// later one) and unanswered unless the peer's [`Handler::datagram`] answers, which
    /// [`Connection::read_datagram`] then reads. Fails with
    /// [`TransportError::NoDatagram`] when the peer takes no datagrams or not one this
    /// large: send it with [`Connection::request`] instead.
    pub fn send_datagram(&self, message: &Message) -> Result<(), TransportError> {
        let frame = encode(message).map_err(|source| TransportError::Wire {
            peer: self.peer,
            source,
        })?;
        self.send_datagram_encoded(frame)
    }

    /// Sends bytes already framed by [`crate::wire::encode`] as one datagram, as
    /// [`Connection::send_datagram`] does. The peer validates them as any frame.
    pub fn send_datagram_encoded(&self, frame: impl Into<Bytes>) -> Result<(), TransportError> {
        send_datagram(&self.inner, self.peer, self.datagrams, frame.into())
    }

    /// The next datagram from the peer that is a valid frame; others are dropped with a
    /// debug log. Fails only when the connection ends. Each datagram goes to one reader.
    pub async fn read_datagram(&self) -> Result<Message, TransportError> {
        loop {
            let bytes = self
                .inner
                .read_datagram()
                .await
                .map_err(|error| lost(self.peer, error))?;
            if let Some(message) = decode_datagram(self.peer, &bytes, self.max_frame) {
                return Ok(message);
            }
        }
    }

    /// Whether the connection has ended (closed by either side, or lost): requests on it
    /// fail at once, so a cache should connect again.
    pub fn is_closed(&self) -> bool {
        self.inner.close_reason().is_some()
    }

    /// Closes the connection; requests in flight fail with [`TransportError::Closed`].
    pub fn close(&self) {
        self.inner.close(VarInt::from_u32(CODE_OK), b"closed");
    }

    async fn exchange(&self, frame: &[u8]) -> Result<Message, TransportError> {
        let peer = self.peer;
        let (mut send, mut recv) = self
            .inner
            .open_bi()
            .await
            .map_err(|error| lost(peer, error))?;
        send.write_all(frame)
            .await
            .map_err(|error| write_error(peer, error))?;
        // Finishing fails only if the stream is already gone, which the read reports.
        let _ = send.finish();
        match read_frame(&mut recv, self.max_frame).await {
            Ok(Some(reply)) => Ok(reply),
            Ok(None) => Err(TransportError::NoResponse { peer }),
            Err(error) => Err(read_error(peer, error)),
        }
    }
}

async fn connect_from(
    endpoint: Endpoint,
    peer: SocketAddr,
    tls: &ClientTls,
    options: &TransportOptions,
) -> Result<Connection, TransportError> {
    let crypto =
        QuicClientConfig::try_from(tls.rustls()).map_err(|error| TransportError::Config {
            reason: error.to_string(),
        })?;
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    config.transport_config(transport_config(options)?);
    let connecting = endpoint
        .connect_with(config, peer, SERVER_NAME)
        .map_err(|source| TransportError::Connect { peer, source })?;
    let inner = connecting
        .await
        .map_err(|source| TransportError::Handshake { peer, source })?;
    Ok(Connection {
        inner,
        peer,
        max_frame: options.max_frame,
        datagrams: options.datagrams,
        _endpoint: endpoint,
    })
}

fn server_config(
    tls: &ServerTls,
    options: &TransportOptions,
) -> Result<quinn::ServerConfig, TransportError> {
    let crypto =
        QuicServerConfig::try_from(tls.rustls()).map_err(|error| TransportError::Config {
            reason: error.to_string(),
        })?;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    config.transport_config(transport_config(options)?);
    Ok(config)
}

fn transport_config(
    options: &TransportOptions,
) -> Result<Arc<quinn::TransportConfig>, TransportError> {
    let idle = quinn::IdleTimeout::try_from(options.idle_timeout).map_err(|error| {
        TransportError::Config {
            reason: format!("idle timeout: {error}"),
        }
    })?;
    let mut config = quinn::TransportConfig::default();
    config
        .keep_alive_interval(Some(options.keep_alive))
        .max_idle_timeout(Some(idle))
        .max_concurrent_bidi_streams(VarInt::from_u32(options.max_streams))
        .max_concurrent_uni_streams(VarInt::from_u32(0));
    if !options.datagrams {
        // The peer learns from the transport parameters that this side takes none.
        config.datagram_receive_buffer_size(None);
    }
    Ok(Arc::new(config))
}

/// Completes the handshake, then serves each stream of the connection on its own task.
async fn serve_connection<H: Handler>(
    incoming: Incoming,
    handler: Arc<H>,
    options: TransportOptions,
) {
    let address = incoming.remote_address();
    let connection = match incoming.await {
        Ok(connection) => connection,
        // This endpoint closing (the daemon stopping) ends the handshakes in flight: no
        // fault of the peer's, nor news.
        Err(quinn::ConnectionError::LocallyClosed) => {
            debug!(peer = %address, "handshake ended: this endpoint closed");
            return;
        }
        Err(error) => {
            warn!(peer = %address, %error, "handshake failed");
            return;
        }
    };
    let identity = match identity_of(&connection) {
        Some(identity) => identity,
        None => {
            warn!(peer = %address, "peer certificate has no readable name; connection closed");
            connection.close(
                VarInt::from_u32(CODE_BAD_IDENTITY),
                b"unreadable certificate name",
            );
            return;
        }
    };
    debug!(peer = %address, ?identity, "connection accepted");
    let peer = Peer { address, identity };
    // Datagrams on a task of their own, which ends with the connection: waking it polls
    // nothing of the streams.
    let datagrams = serve_datagrams(
        connection.clone(),
        peer.clone(),
        handler.clone(),
        options.clone(),
    );
    tokio::spawn(datagrams.in_current_span());
    loop {
        match connection.accept_bi().await {
            Ok((send, recv)) => {
                let stream =
                    serve_stream(peer.clone(), send, recv, handler.clone(), options.clone());
                tokio::spawn(stream.in_current_span());
            }
            Err(error) => {
                debug!(peer = %address, %error, "connection ended");
                handler.disconnected(&peer);
                return;
            }
        }
    }
}

/// Answers the connection's datagrams, one after the other, until it ends.
async fn serve_datagrams<H: Handler>(
    connection: quinn::Connection,
    peer: Peer,
    handler: Arc<H>,
    options: TransportOptions,
) {
    while let Ok(bytes) = connection.read_datagram().await {
        answer_datagram(&connection, &peer, &*handler, &bytes, &options);
    }
}

/// Decodes one datagram and sends the handler's answer, if any, as a datagram. A bad
/// datagram, or an answer that cannot be sent, is dropped with a debug log.
fn answer_datagram<H: Handler>(
    connection: &quinn::Connection,
    peer: &Peer,
    handler: &H,
    bytes: &[u8],
    options: &TransportOptions,
) {
    let Some(message) = decode_datagram(peer.address, bytes, options.max_frame) else {
        return;
    };
    let Some(answer) = handler.datagram(peer, message) else {
        return;
    };
    let sent = encode(&answer)
        .map_err(|source| TransportError::Wire {
            peer: peer.address,
            source,
        })
        .and_then(|frame| send_datagram(connection, peer.address, options.datagrams, frame.into()));
    if let Err(error) = sent {
        debug!(peer = %peer.address, %error, "datagram answer not sent");
    }
}

/// A datagram's frame, or `None` (logged at debug level) if it is not a valid one.
fn decode_datagram(peer: SocketAddr, bytes: &[u8], max_frame: usize) -> Option<Message> {
    match decode_with_limit(bytes, max_frame) {
        Ok(message) => Some(message),
        Err(error) => {
            debug!(%peer, len = bytes.len(), %error, "dropped a bad datagram");
            None
        }
    }
}

/// Queues one datagram on `connection`, if this side sends datagrams and the peer takes
/// one this large.
fn send_datagram(
    connection: &quinn::Connection,
    peer: SocketAddr,
    enabled: bool,
    frame: Bytes,
) -> Result<(), TransportError> {
    let size = frame.len();
    let max = connection.max_datagram_size().filter(|_| enabled);
    if max.is_none_or(|max| size > max) {
        return Err(TransportError::NoDatagram { peer, size, max });
    }
    match connection.send_datagram(frame) {
        Ok(()) => Ok(()),
        Err(SendDatagramError::ConnectionLost(error)) => Err(lost(peer, error)),
        // The limit moved (a smaller path MTU) or the peer disabled datagrams.
        Err(SendDatagramError::TooLarge) => Err(TransportError::NoDatagram {
            peer,
            size,
            max: connection.max_datagram_size(),
        }),
        Err(SendDatagramError::UnsupportedByPeer | SendDatagramError::Disabled) => {
            Err(TransportError::NoDatagram {
                peer,
                size,
                max: None,
            })
        }
    }
}

/// Reads one request, answers it, and finishes the stream.
async fn serve_stream<H: Handler>(
    peer: Peer,
    mut send: SendStream,
    mut recv: RecvStream,
    handler: Arc<H>,
    options: TransportOptions,
) {
    let address = peer.address;
    let request = match tokio::time::timeout(
        options.request_timeout,
        read_frame(&mut recv, options.max_frame),
    )
    .await
    {
        Ok(Ok(Some(request))) => request,
        Ok(Ok(None)) => {
            debug!(peer = %address, "stream ended without a request");
            return;
        }
        Ok(Err(WireError::Io(error))) => {
            debug!(peer = %address, %error, "stream lost before its request");
            return;
        }
        Ok(Err(error)) => {
            warn!(peer = %address, %error, "bad request frame; stream closed");
            close_stream(&mut send, &mut recv, CODE_BAD_FRAME);
            return;
        }
        Err(_) => {
            warn!(peer = %address, after = ?options.request_timeout, "request timed out; stream closed");
            close_stream(&mut send, &mut recv, CODE_TIMEOUT);
            return;
        }
    };
    let reply = handler.handle(peer, request).await;
    match write_frame(&mut send, &reply).await {
        Ok(()) => {
            // Fails only if the peer already stopped the stream; nothing left to do then.
            let _ = send.finish();
        }
        Err(error) => debug!(peer = %address, %error, "reply not delivered"),
    }
}

fn close_stream(send: &mut SendStream, recv: &mut RecvStream, code: u32) {
    // Either side may already be closed; closing again is harmless.
    let _ = send.reset(VarInt::from_u32(code));
    let _ = recv.stop(VarInt::from_u32(code));
}

/// The identity in the peer's verified certificate chain, or `None` if there is a
/// certificate but its name cannot be read.
fn identity_of(connection: &quinn::Connection) -> Option<PeerIdentity> {
    let Some(identity) = connection.peer_identity() else {
        return Some(PeerIdentity::Unauthenticated);
    };
    // quinn's rustls session reports the chain as this type; rustls has verified it
    // against the cluster CA before the connection was accepted.
    let chain = identity.downcast::<Vec<CertificateDer<'static>>>().ok()?;
    match chain.first() {
        None => Some(PeerIdentity::Unauthenticated),
        Some(cert) => certificate_name(cert)
            .ok()
            .map(|name| PeerIdentity::Authenticated { name }),
    }
}

/// Maps a failure to read the answer, which may hide a reset or a lost connection.
fn read_error(peer: SocketAddr, error: WireError) -> TransportError {
    if let WireError::Io(io) = &error {
        let inner = io.get_ref();
        if let Some(read) = inner.and_then(|e| e.downcast_ref::<quinn::ReadError>()) {
            match read {
                quinn::ReadError::Reset(code) => {
                    return TransportError::StreamReset {
                        peer,
                        code: code.into_inner(),
                    };
                }
                quinn::ReadError::ConnectionLost(lost_with) => {
                    return lost(peer, lost_with.clone());
                }
                _ => {}
            }
        }
    }
    TransportError::Wire {
        peer,
        source: error,
    }
}

fn write_error(peer: SocketAddr, error: quinn::WriteError) -> TransportError {
    match error {
        quinn::WriteError::Stopped(code) => TransportError::StreamReset {
            peer,
            code: code.into_inner(),
        },
        quinn::WriteError::ConnectionLost(source) => lost(peer, source),
        other => TransportError::Wire {
            peer,
            source: WireError::Io(other.into()),
        },
    }
}

/// A lost connection; one the server closed with a TLS alert (a client certificate
/// refused after the client thought it was done) is a failed handshake.
fn lost(peer: SocketAddr, source: ConnectionError) -> TransportError {
    let tls_alert = |code: u64| (0x100..0x200).contains(&code);
    let refused = match &source {
        ConnectionError::ConnectionClosed(close) => tls_alert(close.error_code.into()),
        ConnectionError::TransportError(error) => tls_alert(error.code.into()),
        _ => false,
    };
    if refused {
        TransportError::Handshake { peer, source }
    } else {
        TransportError::Closed { peer, source }
    }
}
