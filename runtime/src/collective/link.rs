//! The ring's byte pipes: [`Link`], in memory or over TCP with an HMAC-SHA256 handshake.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use rand::Rng;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
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
    pub(crate) tx: Box<dyn AsyncWrite + Send + Unpin>,
    pub(crate) rx: Box<dyn AsyncRead + Send + Unpin>,
}

/// Bytes buffered by each in-memory pipe.
const MEMORY_PIPE_BYTES: usize = 256 * 1024;
/// The first bytes a connecting rank sends.
const MAGIC: &[u8; 8] = b"IMGRING1";
/// Longest job id a handshake accepts.
const MAX_JOB_BYTES: usize = 256;
/// Longest one incoming handshake may take, so a silent peer cannot hold the listener.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest pause between connection attempts to the next rank.
const MAX_RETRY_DELAY: Duration = Duration::from_millis(500);

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
                tx: Box::new(tx),
                rx: Box::new(rx),
            })
            .collect()
    }

    /// Builds this rank's TCP link: accepts the previous rank on `listener` and connects
    /// to the next at `next_addr` (retrying until `timeout`), authenticating both.
    pub(crate) async fn tcp(
        rank: usize,
        world: usize,
        listener: TcpListener,
        next_addr: SocketAddr,
        secret: &RingSecret,
        job: &str,
        timeout: Duration,
    ) -> Result<Link, CollectiveError> {
        let deadline = Instant::now() + timeout;
        let ring = Ring {
            rank,
            world,
            secret,
            job,
        };
        let (outgoing, incoming) = tokio::try_join!(
            ring.connect_next(next_addr, deadline, timeout),
            ring.accept_prev(&listener, deadline, timeout),
        )?;
        let (_, tx) = outgoing.into_split();
        let (rx, _) = incoming.into_split();
        Ok(Link {
            next: ring.next(),
            prev: ring.prev(),
            tx: Box::new(tx),
            rx: Box::new(rx),
        })
    }
}

impl fmt::Debug for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Link")
            .field("next", &self.next)
            .field("prev", &self.prev)
            .finish_non_exhaustive()
    }
}

/// One rank's view of the ring during setup.
struct Ring<'a> {
    rank: usize,
    world: usize,
    secret: &'a RingSecret,
    job: &'a str,
}

impl Ring<'_> {
    fn next(&self) -> usize {
        (self.rank + 1) % self.world
    }

    fn prev(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }

    async fn connect_next(
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
            addr,
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

    async fn accept_prev(
        &self,
        listener: &TcpListener,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<TcpStream, CollectiveError> {
        let peer = self.prev();
        let mut last_failure = None;
        loop {
            let (mut stream, addr) = match timeout_at(deadline, listener.accept()).await {
                Ok(Ok(accepted)) => accepted,
                Ok(Err(source)) => {
                    return Err(CollectiveError::Io {
                        rank: self.rank,
                        peer,
                        what: "accepting the previous rank",
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
            let result = match timeout_at(limit, self.verify_prev(&mut stream)).await {
                Ok(Ok(())) => stream.set_nodelay(true).map_err(|e| e.to_string()),
                Ok(Err(reason)) => Err(reason),
                Err(_) => Err("timed out".into()),
            };
            match result {
                Ok(()) => {
                    debug!(rank = self.rank, peer, %addr, "ring link from previous rank up");
                    return Ok(stream);
                }
                Err(reason) => {
                    // A stranger or a misconfigured rank: drop it and serve on.
                    warn!(rank = self.rank, peer, %addr, %reason, "ring handshake refused");
                    last_failure = Some(CollectiveError::Handshake {
                        rank: self.rank,
                        peer,
                        addr,
                        reason,
                    });
                }
            }
        }
    }

    /// Connecting side: hello, check the acceptor's proof, send ours, await the ack.
    async fn prove_to_next(&self, stream: &mut TcpStream) -> Result<(), String> {
        let (from, to) = (self.rank as u32, self.next() as u32);
        let nonce_c: [u8; 32] = rand::rng().random();
        let mut hello = Vec::with_capacity(64 + self.job.len());
        hello.extend_from_slice(MAGIC);
        hello.extend_from_slice(&(self.job.len() as u16).to_le_bytes());
        hello.extend_from_slice(self.job.as_bytes());
        hello.extend_from_slice(&from.to_le_bytes());
        hello.extend_from_slice(&(self.world as u32).to_le_bytes());
        hello.extend_from_slice(&nonce_c);
        stream.write_all(&hello).await.map_err(io_reason)?;

        let mut reply = [0u8; 64];
        stream.read_exact(&mut reply).await.map_err(|e| {
            format!("peer refused our hello (wrong job, world or ring order?): {e}")
        })?;
        let (nonce_a, mac_a) = reply.split_at(32);
        let expected = proof(
            self.secret,
            b"acceptor",
            self.job,
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
            self.job,
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
    async fn verify_prev(&self, stream: &mut TcpStream) -> Result<(), String> {
        let mut head = [0u8; 10];
        stream.read_exact(&mut head).await.map_err(io_reason)?;
        if &head[..8] != MAGIC {
            return Err("not an imgrun ring peer (bad magic)".into());
        }
        let job_len = u16::from_le_bytes([head[8], head[9]]) as usize;
        if job_len > MAX_JOB_BYTES {
            return Err(format!("job id of {job_len} bytes is too long"));
        }
        let mut rest = vec![0u8; job_len + 4 + 4 + 32];
        stream.read_exact(&mut rest).await.map_err(io_reason)?;
        let (job, rest) = rest.split_at(job_len);
        let (from, rest) = rest.split_at(4);
        let (world, nonce_c) = rest.split_at(4);
        let from = u32::from_le_bytes([from[0], from[1], from[2], from[3]]);
        let world = u32::from_le_bytes([world[0], world[1], world[2], world[3]]);
        if job != self.job.as_bytes() {
            return Err(format!(
                "peer is in job {:?}, not {:?}",
                String::from_utf8_lossy(job),
                self.job
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
            self.job,
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
            self.job,
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
    job: &str,
    from: u32,
    to: u32,
    nonce_c: &[u8],
    nonce_a: &[u8],
) -> [u8; 32] {
    auth::proof(
        secret.as_bytes(),
        &[
            role,
            job.as_bytes(),
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

    #[test]
    fn proofs_bind_role_ranks_and_nonces() {
        let secret = RingSecret::from_bytes([7; 32]);
        let base = proof(&secret, b"acceptor", "job", 0, 1, &[1; 32], &[2; 32]);
        let variants = [
            proof(&secret, b"connector", "job", 0, 1, &[1; 32], &[2; 32]),
            proof(&secret, b"acceptor", "jib", 0, 1, &[1; 32], &[2; 32]),
            proof(&secret, b"acceptor", "job", 1, 0, &[1; 32], &[2; 32]),
            proof(&secret, b"acceptor", "job", 0, 1, &[2; 32], &[1; 32]),
            proof(
                &RingSecret::from_bytes([8; 32]),
                b"acceptor",
                "job",
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
