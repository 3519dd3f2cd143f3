//! The ring's byte pipes: [`Link`], in memory or over TCP with an HMAC-SHA256 handshake,
//! or over a Unix domain socket between ranks on the same host.
//!
//! A rank that joins a TCP ring also listens on a Linux abstract-namespace Unix socket
//! whose name is derived from the ring id, its rank and its TCP port
//! ([`unix_name`]). A rank whose next rank's address is one of this host's tries that
//! name first (for up to [`UNIX_GRACE`], as the next rank may not be listening yet) and
//! falls back to TCP on any failure. The same handshake runs over either, so a peer
//! that answers on the name but cannot prove the job secret is dropped like a TCP one.
//! Abstract names live in the network namespace, so ranks in another namespace that
//! share the address (containers) never reach each other this way and use TCP.

use std::fmt;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use rand::Rng;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::time::{Instant, timeout_at};
use tracing::{debug, warn};

use super::{CollectiveError, RingSecret};
use crate::auth::{self, constant_time_eq};

/// An ordered, reliable byte pipe to the next rank of a ring and from the previous one.
///
/// The two directions are separate halves, so a rank can send and receive at once.
pub struct Link {
    pub(crate) next: usize,
    pub(crate) prev: usize,
    /// How the bytes to the next rank travel.
    pub(crate) next_transport: Transport,
    /// How the bytes from the previous rank travel.
    pub(crate) prev_transport: Transport,
    pub(crate) tx: WriteHalf,
    pub(crate) rx: ReadHalf,
}

/// Bytes buffered by each in-memory pipe.
const MEMORY_PIPE_BYTES: usize = 256 * 1024;
/// The first bytes a connecting rank sends.
const MAGIC: &[u8; 8] = b"IMGRING1";
/// Longest ring id a handshake accepts.
const MAX_RING_ID_BYTES: usize = 256;
/// Longest one incoming handshake may take, so a silent peer cannot hold the listener.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest pause between connection attempts to the next rank.
const MAX_RETRY_DELAY: Duration = Duration::from_millis(500);
/// Longest a rank keeps trying the Unix socket of a next rank on this host before it
/// falls back to TCP (the next rank binds it only once it joins the ring).
pub(crate) const UNIX_GRACE: Duration = Duration::from_secs(2);
/// Send buffer asked for on a Unix link (the kernel caps it at `net.core.wmem_max`): with
/// the default (208 KiB here) a rank stops for its next one several times per ring step
/// of a 512 KiB block; this gave 10 to 15% more bus bandwidth from 4 MB up (README).
const UNIX_SEND_BUFFER: usize = 4 << 20;

/// How a ring link's bytes travel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// An in-process pipe ([`Link::memory_ring`]).
    Memory,
    /// A TCP connection.
    Tcp,
    /// A Unix domain socket between two ranks on the same host.
    Unix,
}

/// Where a ring handshake ran, as named in errors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkPath {
    /// A TCP connection with the peer at this address.
    Tcp(SocketAddr),
    /// The abstract Unix socket `name` (without the leading NUL) of the rank whose TCP
    /// listener is at `beside`.
    Unix { name: String, beside: SocketAddr },
}

impl fmt::Display for LinkPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LinkPath::Tcp(addr) => write!(f, "at {addr} over TCP"),
            LinkPath::Unix { name, beside } => {
                write!(f, "over unix socket @{name} (beside {beside})")
            }
        }
    }
}

impl Link {
    /// Sends all of `bytes` to the next rank.
    pub async fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.tx.write_all(bytes).await
    }

    /// Fills all of `buf` from the previous rank.
    pub async fn recv(&mut self, buf: &mut [u8]) -> io::Result<()> {
        self.rx.read_exact(buf).await.map(|_| ())
    }

    /// The rank this link sends to.
    pub fn next(&self) -> usize {
        self.next
    }

    /// The rank this link receives from.
    pub fn prev(&self) -> usize {
        self.prev
    }

    /// How the bytes to the next rank travel.
    pub fn next_transport(&self) -> Transport {
        self.next_transport
    }

    /// How the bytes from the previous rank travel.
    pub fn prev_transport(&self) -> Transport {
        self.prev_transport
    }

    /// The links of a whole ring of `world` ranks in this process, indexed by rank.
    pub fn memory_ring(world: usize) -> Vec<Link> {
        // Pipe `i` carries rank i's bytes to rank i + 1, so rank i reads pipe i - 1.
        let (writers, mut readers): (Vec<_>, Vec<_>) = (0..world)
            .map(|_| tokio::io::duplex(MEMORY_PIPE_BYTES))
            .unzip();
        readers.rotate_right(1);
        writers
            .into_iter()
            .zip(readers)
            .enumerate()
            .map(|(rank, (tx, rx))| Link {
                next: (rank + 1) % world,
                prev: (rank + world - 1) % world,
                next_transport: Transport::Memory,
                prev_transport: Transport::Memory,
                tx: Box::new(tx),
                rx: Box::new(rx),
            })
            .collect()
    }

    /// Builds this rank's TCP link: accepts the previous rank on `listener` and connects
    /// to the next at `next_addr` (retrying until `timeout`), authenticating both. With
    /// `local_sockets`, a neighbour on this host is linked over a Unix socket instead
    /// (see the module documentation), falling back to TCP.
    #[allow(clippy::too_many_arguments)] // RingGroup::connect's arguments and the switch
    pub(crate) async fn tcp(
        rank: usize,
        world: usize,
        listener: TcpListener,
        next_addr: SocketAddr,
        secret: &RingSecret,
        ring_id: &str,
        timeout: Duration,
        local_sockets: bool,
    ) -> Result<Link, CollectiveError> {
        let deadline = Instant::now() + timeout;
        let ring = Ring {
            rank,
            world,
            secret,
            ring_id,
        };
        // Abstract socket names are Linux's alone; elsewhere the ring is TCP only.
        let local_sockets = local_sockets && cfg!(target_os = "linux");
        let unix = if local_sockets {
            ring.bind_unix(&listener)
        } else {
            None
        };
        let (outgoing, incoming) = tokio::try_join!(
            ring.connect_next(next_addr, local_sockets, deadline, timeout),
            ring.accept_prev(&listener, unix.as_ref(), deadline, timeout),
        )?;
        let (next_transport, _, tx) = outgoing.into_halves();
        let (prev_transport, rx, _) = incoming.into_halves();
        Ok(Link {
            next: ring.next(),
            prev: ring.prev(),
            next_transport,
            prev_transport,
            tx,
            rx,
        })
    }
}

/// A connected ring stream of either kind.
enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

type ReadHalf = Box<dyn AsyncRead + Send + Unpin>;
type WriteHalf = Box<dyn AsyncWrite + Send + Unpin>;

impl Stream {
    /// How its bytes travel, and its two halves (a half dropped shuts its direction).
    fn into_halves(self) -> (Transport, ReadHalf, WriteHalf) {
        match self {
            Stream::Tcp(stream) => {
                let (rx, tx) = stream.into_split();
                (Transport::Tcp, Box::new(rx), Box::new(tx))
            }
            Stream::Unix(stream) => {
                let (rx, tx) = stream.into_split();
                (Transport::Unix, Box::new(rx), Box::new(tx))
            }
        }
    }
}

/// The abstract Unix socket name of `rank` of the ring `ring_id` whose TCP listener has
/// `port`: the ring id enters hashed, so any id fits the 107 bytes a name may have.
pub(crate) fn unix_name(ring_id: &str, rank: usize, port: u16) -> String {
    let digest = Sha256::digest(ring_id.as_bytes());
    format!(
        "imgrun-ring/{}/{rank}/{port}",
        auth::encode_hex(&digest[..8])
    )
}

/// Whether `ip` is loopback, unspecified or assigned to this host (in this network
/// namespace): only such an address can be bound.
fn is_local(ip: IpAddr) -> bool {
    ip.is_loopback() || ip.is_unspecified() || std::net::UdpSocket::bind((ip, 0)).is_ok()
}

#[cfg(target_os = "linux")]
fn bind_abstract(name: &str) -> io::Result<UnixListener> {
    use std::os::linux::net::SocketAddrExt;
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
    let listener = std::os::unix::net::UnixListener::bind_addr(&addr)?;
    listener.set_nonblocking(true)?;
    UnixListener::from_std(listener)
}

#[cfg(target_os = "linux")]
async fn connect_abstract(name: &str) -> io::Result<UnixStream> {
    use std::os::linux::net::SocketAddrExt;
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
    // A connect to a listening Unix socket completes at once (or fails at once).
    let stream = std::os::unix::net::UnixStream::connect_addr(&addr)?;
    stream.set_nonblocking(true)?;
    UnixStream::from_std(stream)
}

#[cfg(not(target_os = "linux"))]
fn bind_abstract(_name: &str) -> io::Result<UnixListener> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "abstract unix sockets are Linux-only",
    ))
}

#[cfg(not(target_os = "linux"))]
async fn connect_abstract(_name: &str) -> io::Result<UnixStream> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "abstract unix sockets are Linux-only",
    ))
}

impl fmt::Debug for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Link")
            .field("next", &self.next)
            .field("prev", &self.prev)
            .field("next_transport", &self.next_transport)
            .field("prev_transport", &self.prev_transport)
            .finish_non_exhaustive()
    }
}

/// One rank's view of the ring during setup.
struct Ring<'a> {
    rank: usize,
    world: usize,
    secret: &'a RingSecret,
    ring_id: &'a str,
}

impl Ring<'_> {
    fn next(&self) -> usize {
        (self.rank + 1) % self.world
    }

    fn prev(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }

    /// Binds this rank's abstract Unix socket next to its TCP `listener`; `None` (and a
    /// log line) where it cannot, so the previous rank falls back to TCP.
    fn bind_unix(&self, listener: &TcpListener) -> Option<(UnixListener, LinkPath)> {
        let beside = match listener.local_addr() {
            Ok(addr) => addr,
            Err(e) => {
                warn!(rank = self.rank, error = %e, "no local address; ring over TCP only");
                return None;
            }
        };
        let name = unix_name(self.ring_id, self.rank, beside.port());
        let bound = bind_abstract(&name);
        let path = LinkPath::Unix { name, beside };
        match bound {
            Ok(unix) => Some((unix, path)),
            Err(e) => {
                warn!(rank = self.rank, %path, error = %e,
                    "cannot listen on the unix socket; the previous rank will use TCP");
                None
            }
        }
    }

    async fn connect_next(
        &self,
        addr: SocketAddr,
        local_sockets: bool,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Stream, CollectiveError> {
        let mut refused = None;
        if local_sockets && is_local(addr.ip()) {
            match self.connect_next_unix(addr, deadline).await {
                Ok(stream) => return Ok(Stream::Unix(stream)),
                Err(error) => refused = error,
            }
        }
        match (
            self.connect_next_tcp(addr, deadline, timeout).await,
            refused,
        ) {
            (Ok(stream), _) => Ok(Stream::Tcp(stream)),
            // The next rank refused us over its Unix socket and then went away (it
            // failed, as we did): its refusal says more than the closed port.
            (
                Err(CollectiveError::Connect { .. } | CollectiveError::Timeout { .. }),
                Some(refusal),
            ) => Err(refusal),
            (Err(error), _) => Err(error),
        }
    }

    /// Tries the Unix socket of the next rank, whose TCP listener is at `beside`, for up
    /// to [`UNIX_GRACE`]. Fails (with a log line) when it is not there, or with the
    /// handshake's error when that fails, for the caller to fall back to TCP.
    async fn connect_next_unix(
        &self,
        beside: SocketAddr,
        deadline: Instant,
    ) -> Result<UnixStream, Option<CollectiveError>> {
        let peer = self.next();
        let name = unix_name(self.ring_id, peer, beside.port());
        let give_up = deadline.min(Instant::now() + UNIX_GRACE);
        let mut delay = Duration::from_millis(10);
        let mut stream = loop {
            match connect_abstract(&name).await {
                Ok(stream) => break stream,
                Err(error) if Instant::now() + delay >= give_up => {
                    debug!(rank = self.rank, peer, %name, %error, "no unix socket; using TCP");
                    return Err(None);
                }
                // Not listening yet: the next rank may still be starting.
                Err(_) => {
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(MAX_RETRY_DELAY);
                }
            }
        };
        let path = LinkPath::Unix { name, beside };
        if let Err(error) = socket2::SockRef::from(&stream).set_send_buffer_size(UNIX_SEND_BUFFER) {
            debug!(rank = self.rank, peer, %path, %error, "unix socket keeps its send buffer");
        }
        let limit = deadline.min(Instant::now() + HANDSHAKE_TIMEOUT);
        let reason = match timeout_at(limit, self.prove_to_next(&mut stream)).await {
            Ok(Ok(())) => {
                debug!(rank = self.rank, peer, %path, "ring link to next rank up");
                return Ok(stream);
            }
            Ok(Err(reason)) => reason,
            Err(_) => "timed out".to_string(),
        };
        warn!(rank = self.rank, peer, %path, %reason, "ring handshake failed; trying TCP");
        Err(Some(CollectiveError::Handshake {
            rank: self.rank,
            peer,
            path: Box::new(path),
            reason,
        }))
    }

    async fn connect_next_tcp(
        &self,
        addr: SocketAddr,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<TcpStream, CollectiveError> {
        let peer = self.next();
        let mut delay = Duration::from_millis(10);
        let mut stream = loop {
            match timeout_at(deadline, TcpStream::connect(addr)).await {
                Ok(Ok(stream)) => break stream,
                Ok(Err(source)) if Instant::now() + delay >= deadline => {
                    return Err(CollectiveError::Connect {
                        rank: self.rank,
                        peer,
                        addr,
                        source,
                    });
                }
                // Not listening yet: the next rank may still be starting.
                Ok(Err(_)) => {
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(MAX_RETRY_DELAY);
                }
                Err(_) => return Err(self.timeout("connecting to the next rank", timeout)),
            }
        };
        let handshake_failed = |reason: String| CollectiveError::Handshake {
            rank: self.rank,
            peer,
            path: Box::new(LinkPath::Tcp(addr)),
            reason,
        };
        stream
            .set_nodelay(true)
            .map_err(|e| handshake_failed(format!("set_nodelay: {e}")))?;
        match timeout_at(deadline, self.prove_to_next(&mut stream)).await {
            Ok(Ok(())) => {
                debug!(rank = self.rank, peer, %addr, "ring link to next rank up");
                Ok(stream)
            }
            Ok(Err(reason)) => Err(handshake_failed(reason)),
            Err(_) => Err(handshake_failed("timed out".into())),
        }
    }

    /// Accepts the previous rank on the TCP `listener` or the Unix one, whichever it
    /// proves itself on first.
    async fn accept_prev(
        &self,
        listener: &TcpListener,
        unix: Option<&(UnixListener, LinkPath)>,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Stream, CollectiveError> {
        let peer = self.prev();
        let mut last_failure = None;
        loop {
            let accept = async {
                let tcp = async {
                    let (stream, addr) = listener
                        .accept()
                        .await
                        .map_err(|e| ("accepting the previous rank over TCP", e))?;
                    Ok((Stream::Tcp(stream), LinkPath::Tcp(addr)))
                };
                let Some((unix, unix_path)) = unix else {
                    return tcp.await;
                };
                tokio::select! {
                    accepted = tcp => accepted,
                    accepted = unix.accept() => match accepted {
                        Ok((stream, _)) => Ok((Stream::Unix(stream), unix_path.clone())),
                        Err(e) => Err(("accepting the previous rank over the unix socket", e)),
                    },
                }
            };
            let (mut stream, path) = match timeout_at(deadline, accept).await {
                Ok(Ok(accepted)) => accepted,
                Ok(Err((what, source))) => {
                    return Err(CollectiveError::Io {
                        rank: self.rank,
                        peer,
                        what,
                        source,
                    });
                }
                Err(_) => {
                    return Err(last_failure.unwrap_or_else(|| {
                        self.timeout("waiting for the previous rank", timeout)
                    }));
                }
            };
            let limit = deadline.min(Instant::now() + HANDSHAKE_TIMEOUT);
            let verified = match &mut stream {
                Stream::Tcp(tcp) => timeout_at(limit, self.verify_prev(tcp)).await,
                Stream::Unix(unix) => timeout_at(limit, self.verify_prev(unix)).await,
            };
            let result = match verified {
                Ok(Ok(())) => match &stream {
                    Stream::Tcp(tcp) => tcp.set_nodelay(true).map_err(|e| e.to_string()),
                    Stream::Unix(_) => Ok(()),
                },
                Ok(Err(reason)) => Err(reason),
                Err(_) => Err("timed out".into()),
            };
            match result {
                Ok(()) => {
                    debug!(rank = self.rank, peer, %path, "ring link from previous rank up");
                    return Ok(stream);
                }
                Err(reason) => {
                    // A stranger or a misconfigured rank: drop it and serve on.
                    warn!(rank = self.rank, peer, %path, %reason, "ring handshake refused");
                    last_failure = Some(CollectiveError::Handshake {
                        rank: self.rank,
                        peer,
                        path: Box::new(path),
                        reason,
                    });
                }
            }
        }
    }

    /// Connecting side: hello, check the acceptor's proof, send ours, await the ack.
    async fn prove_to_next<S>(&self, stream: &mut S) -> Result<(), String>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let (from, to) = (self.rank as u32, self.next() as u32);
        let nonce_c: [u8; 32] = rand::rng().random();
        let mut hello = Vec::with_capacity(64 + self.ring_id.len());
        hello.extend_from_slice(MAGIC);
        hello.extend_from_slice(&(self.ring_id.len() as u16).to_le_bytes());
        hello.extend_from_slice(self.ring_id.as_bytes());
        hello.extend_from_slice(&from.to_le_bytes());
        hello.extend_from_slice(&(self.world as u32).to_le_bytes());
        hello.extend_from_slice(&nonce_c);
        stream.write_all(&hello).await.map_err(io_reason)?;

        let mut reply = [0u8; 64];
        stream.read_exact(&mut reply).await.map_err(|e| {
            format!("peer refused our hello (wrong ring id, world or ring order?): {e}")
        })?;
        let (nonce_a, mac_a) = reply.split_at(32);
        let expected = proof(
            self.secret,
            b"acceptor",
            self.ring_id,
            from,
            to,
            &nonce_c,
            nonce_a,
        );
        if !constant_time_eq(&expected, mac_a) {
            return Err("peer did not prove knowledge of the job secret".into());
        }
        let mac_c = proof(
            self.secret,
            b"connector",
            self.ring_id,
            from,
            to,
            &nonce_c,
            nonce_a,
        );
        stream.write_all(&mac_c).await.map_err(io_reason)?;
        let mut ack = [0u8; 1];
        match stream.read_exact(&mut ack).await {
            Ok(_) if ack[0] == 1 => Ok(()),
            _ => Err("peer refused our proof (wrong secret?)".into()),
        }
    }

    /// Accepting side: check the hello, prove, check the connector's proof, ack.
    async fn verify_prev<S>(&self, stream: &mut S) -> Result<(), String>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let mut head = [0u8; 10];
        stream.read_exact(&mut head).await.map_err(io_reason)?;
        if &head[..8] != MAGIC {
            return Err("not an imgrun ring peer (bad magic)".into());
        }
        let id_len = u16::from_le_bytes([head[8], head[9]]) as usize;
        if id_len > MAX_RING_ID_BYTES {
            return Err(format!("ring id of {id_len} bytes is too long"));
        }
        let mut rest = vec![0u8; id_len + 4 + 4 + 32];
        stream.read_exact(&mut rest).await.map_err(io_reason)?;
        let (ring_id, rest) = rest.split_at(id_len);
        let (from, rest) = rest.split_at(4);
        let (world, nonce_c) = rest.split_at(4);
        let from = u32::from_le_bytes([from[0], from[1], from[2], from[3]]);
        let world = u32::from_le_bytes([world[0], world[1], world[2], world[3]]);
        if ring_id != self.ring_id.as_bytes() {
            return Err(format!(
                "peer is in ring {:?}, not {:?}",
                String::from_utf8_lossy(ring_id),
                self.ring_id
            ));
        }
        if world as usize != self.world || from as usize != self.prev() {
            return Err(format!(
                "peer says it is rank {from} of {world}; expected rank {} of {}",
                self.prev(),
                self.world
            ));
        }
        let to = self.rank as u32;
        let nonce_a: [u8; 32] = rand::rng().random();
        let mac_a = proof(
            self.secret,
            b"acceptor",
            self.ring_id,
            from,
            to,
            nonce_c,
            &nonce_a,
        );
        let mut reply = [0u8; 64];
        reply[..32].copy_from_slice(&nonce_a);
        reply[32..].copy_from_slice(&mac_a);
        stream.write_all(&reply).await.map_err(io_reason)?;
        let mut mac_c = [0u8; 32];
        stream
            .read_exact(&mut mac_c)
            .await
            .map_err(|_| "peer closed the handshake (it refused our proof?)".to_string())?;
        let expected = proof(
            self.secret,
            b"connector",
            self.ring_id,
            from,
            to,
            nonce_c,
            &nonce_a,
        );
        if !constant_time_eq(&expected, &mac_c) {
            return Err("peer did not prove knowledge of the job secret".into());
        }
        stream.write_all(&[1]).await.map_err(io_reason)
    }

    fn timeout(&self, what: &'static str, after: Duration) -> CollectiveError {
        CollectiveError::Timeout {
            rank: self.rank,
            what,
            after,
        }
    }
}

fn io_reason(e: io::Error) -> String {
    e.to_string()
}

/// HMAC over the role and everything both sides agreed on.
fn proof(
    secret: &RingSecret,
    role: &[u8],
    ring_id: &str,
    from: u32,
    to: u32,
    nonce_c: &[u8],
    nonce_a: &[u8],
) -> [u8; 32] {
    auth::proof(
        secret.as_bytes(),
        &[
            role,
            ring_id.as_bytes(),
            &from.to_le_bytes(),
            &to.to_le_bytes(),
            nonce_c,
            nonce_a,
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::{CollectiveOptions, RingGroup};

    /// A stranger holds rank 1's Unix socket name, so rank 1 cannot listen on it and rank
    /// 0's handshake there fails: rank 0 falls back to TCP, rank 1 still reaches rank 0
    /// over its Unix socket, and the sums are right.
    #[cfg(target_os = "linux")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stranger_on_the_unix_name_sends_that_link_to_tcp() -> anyhow::Result<()> {
        let ring_id = "stranger-test";
        let listeners = [
            TcpListener::bind("127.0.0.1:0").await?,
            TcpListener::bind("127.0.0.1:0").await?,
        ];
        let addrs = [listeners[0].local_addr()?, listeners[1].local_addr()?];
        let stranger = bind_abstract(&unix_name(ring_id, 1, addrs[1].port()))?;
        let stranger = tokio::spawn(async move {
            // Accepts and hangs up on everyone.
            while let Ok((stream, _)) = stranger.accept().await {
                drop(stream);
            }
        });
        let secret = RingSecret::from_bytes([3; 32]);
        let tasks: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(rank, listener)| {
                let (next, secret) = (addrs[(rank + 1) % 2], secret.clone());
                tokio::spawn(async move {
                    let options = CollectiveOptions::default();
                    let mut group =
                        RingGroup::connect(rank, 2, listener, next, &secret, ring_id, options)
                            .await?;
                    let link = group
                        .link()
                        .map(|l| (l.next_transport(), l.prev_transport()));
                    let mut values = vec![rank as f32 + 1.0; 100_003];
                    group.allreduce_sum(&mut values).await?;
                    anyhow::Ok((link, values))
                })
            })
            .collect();
        let mut results = Vec::new();
        for task in tasks {
            results.push(tokio::time::timeout(Duration::from_secs(20), task).await???);
        }
        stranger.abort();
        assert_eq!(results[0].0, Some((Transport::Tcp, Transport::Unix)));
        assert_eq!(results[1].0, Some((Transport::Unix, Transport::Tcp)));
        for (_, values) in results {
            assert!(values.iter().all(|&v| v == 3.0));
        }
        Ok(())
    }

    #[test]
    fn unix_names_differ_by_ring_id_rank_and_port_and_fit() {
        let long_id = "j".repeat(MAX_RING_ID_BYTES);
        let names = [
            unix_name("a", 0, 1),
            unix_name("b", 0, 1),
            unix_name("a", 1, 1),
            unix_name("a", 0, 2),
            unix_name(&long_id, usize::MAX, u16::MAX),
        ];
        for (i, a) in names.iter().enumerate() {
            assert!(a.len() < 108, "{a}");
            for b in &names[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }

    #[test]
    fn proofs_bind_role_ranks_and_nonces() {
        let secret = RingSecret::from_bytes([7; 32]);
        let base = proof(&secret, b"acceptor", "ring", 0, 1, &[1; 32], &[2; 32]);
        let variants = [
            proof(&secret, b"connector", "ring", 0, 1, &[1; 32], &[2; 32]),
            proof(&secret, b"acceptor", "rung", 0, 1, &[1; 32], &[2; 32]),
            proof(&secret, b"acceptor", "ring", 1, 0, &[1; 32], &[2; 32]),
            proof(&secret, b"acceptor", "ring", 0, 1, &[2; 32], &[1; 32]),
            proof(
                &RingSecret::from_bytes([8; 32]),
                b"acceptor",
                "ring",
                0,
                1,
                &[1; 32],
                &[2; 32],
            ),
        ];
        for variant in variants {
            assert_ne!(base, variant);
        }
        assert!(constant_time_eq(&base, &base));
        assert!(!constant_time_eq(&base, &base[..31]));
    }
}
