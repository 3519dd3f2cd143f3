//! [`DataStream`]: one authenticated connection carrying `[u64 LE length][payload]` frames.

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use tracing::debug;

use super::handshake::{self, is_timeout};
use super::{ChannelError, ChannelOptions, ChannelSecret};

/// Bytes of a frame's header.
const HEADER_LEN: usize = 8;
/// The least a receive buffer grows by at a time while a frame arrives.
const MIN_GROWTH: usize = 1 << 20;
/// Longest pause between connection attempts while nothing listens.
const MAX_RETRY_DELAY: Duration = Duration::from_millis(500);

/// A framed, authenticated, bidirectional stream to one peer.
///
/// One thread may send while another receives on a [`DataStream::try_clone`]. After an
/// error from `send` or `recv` the stream may be mid-frame and must be dropped; the one
/// exception is [`ChannelError::Idle`] (a read timeout before any byte of a frame).
#[derive(Debug)]
pub struct DataStream {
    stream: TcpStream,
    peer: SocketAddr,
}

impl DataStream {
    /// Connects to `addr` and authenticates both ends; retries "connection refused"
    /// (nothing listens yet) until `timeout`.
    pub fn connect(
        addr: SocketAddr,
        secret: &ChannelSecret,
        timeout: Duration,
    ) -> Result<Self, ChannelError> {
        Self::connect_with(addr, secret, timeout, &ChannelOptions::default())
    }

    /// [`DataStream::connect`] with the given options.
    pub fn connect_with(
        addr: SocketAddr,
        secret: &ChannelSecret,
        timeout: Duration,
        options: &ChannelOptions,
    ) -> Result<Self, ChannelError> {
        let started = Instant::now();
        let deadline = started + timeout;
        let mut delay = Duration::from_millis(10);
        let mut stream = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let attempt = if left.is_zero() {
                Err(io::Error::from(io::ErrorKind::TimedOut))
            } else {
                TcpStream::connect_timeout(&addr, left)
            };
            match attempt {
                Ok(stream) => break stream,
                Err(e)
                    if e.kind() == io::ErrorKind::ConnectionRefused
                        && Instant::now() + delay < deadline =>
                {
                    std::thread::sleep(delay);
                    delay = (delay * 2).min(MAX_RETRY_DELAY);
                }
                Err(source) => {
                    return Err(ChannelError::Connect {
                        peer: addr,
                        after: started.elapsed(),
                        source,
                    });
                }
            }
        };
        let handshake_deadline =
            Instant::now() + handshake::connector_timeout(options.handshake_timeout);
        handshake::connector(&mut stream, secret, handshake_deadline)
            .map_err(|reason| ChannelError::Handshake { peer: addr, reason })?;
        let stream = Self::authenticated(stream, addr)?;
        debug!(peer = %addr, "data channel connected");
        Ok(stream)
    }

    /// Wraps a stream whose handshake succeeded: no timeouts, no Nagle delay.
    pub(super) fn authenticated(stream: TcpStream, peer: SocketAddr) -> Result<Self, ChannelError> {
        let failed = |source| ChannelError::Io {
            peer,
            what: "setting up the socket after the handshake",
            source,
        };
        stream.set_read_timeout(None).map_err(failed)?;
        stream.set_write_timeout(None).map_err(failed)?;
        stream.set_nodelay(true).map_err(failed)?;
        Ok(Self { stream, peer })
    }

    /// Sends one frame made of `parts` concatenated, with vectored writes (the parts are
    /// not copied). Blocks while the peer's buffers are full.
    pub fn send(&mut self, parts: &[&[u8]]) -> Result<(), ChannelError> {
        let len: usize = parts.iter().map(|part| part.len()).sum();
        let header = (len as u64).to_le_bytes();
        let mut slices = Vec::with_capacity(parts.len() + 1);
        slices.push(IoSlice::new(&header));
        slices.extend(
            parts
                .iter()
                .filter(|part| !part.is_empty())
                .map(|part| IoSlice::new(part)),
        );
        let mut slices = &mut slices[..];
        while !slices.is_empty() {
            match self.stream.write_vectored(slices) {
                Ok(0) => {
                    return Err(self.io_error("sending a frame", io::ErrorKind::WriteZero.into()));
                }
                Ok(n) => IoSlice::advance_slices(&mut slices, n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io_error("sending a frame", e)),
            }
        }
        Ok(())
    }

    /// Receives one frame into `buf`: cleared, then grown as the bytes arrive and never
    /// beyond `max_len`; a frame declaring more is refused before any of it is read.
    /// `Ok(false)` on a clean end of stream (the peer closed between frames, or this side
    /// shut down); a close mid-frame is an error.
    pub fn recv(&mut self, buf: &mut Vec<u8>, max_len: usize) -> Result<bool, ChannelError> {
        buf.clear();
        let mut header = [0u8; HEADER_LEN];
        let mut got = 0;
        while got < HEADER_LEN {
            match self.stream.read(&mut header[got..]) {
                Ok(0) if got == 0 => return Ok(false),
                Ok(0) => return Err(self.truncated("header", got, HEADER_LEN)),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if is_timeout(&e) && got == 0 => {
                    return Err(ChannelError::Idle {
                        peer: self.peer,
                        after: self.read_timeout(),
                    });
                }
                Err(e) if is_timeout(&e) => return Err(self.stalled("header", got, HEADER_LEN)),
                Err(e) => return Err(self.io_error("receiving a frame header", e)),
            }
        }
        let declared = u64::from_le_bytes(header);
        let len = match usize::try_from(declared) {
            Ok(len) if len <= max_len => len,
            _ => {
                return Err(ChannelError::FrameTooLarge {
                    peer: self.peer,
                    len: declared,
                    max_len,
                });
            }
        };
        while buf.len() < len {
            let left = len - buf.len();
            // Grow with what actually arrives, at most doubling, rather than trusting the
            // header; a buffer kept from earlier frames is already large enough.
            let step = if buf.capacity() >= len {
                left
            } else {
                left.min(buf.len().max(MIN_GROWTH))
            };
            buf.reserve_exact(step);
            // `read_to_end` reads straight into the spare capacity (no zeroing), and
            // `take` stops it at the step, so it never grows the buffer itself.
            match (&mut self.stream).take(step as u64).read_to_end(buf) {
                Ok(n) if n == step => {}
                Ok(_) => return Err(self.truncated("payload", buf.len(), len)),
                Err(e) if is_timeout(&e) => return Err(self.stalled("payload", buf.len(), len)),
                Err(e) => return Err(self.io_error("receiving a frame", e)),
            }
        }
        Ok(true)
    }

    /// Another handle on the same stream, so that one thread reads while another writes.
    pub fn try_clone(&self) -> Result<DataStream, ChannelError> {
        let stream = self
            .stream
            .try_clone()
            .map_err(|e| self.io_error("cloning the stream", e))?;
        Ok(Self {
            stream,
            peer: self.peer,
        })
    }

    /// How long `recv` waits for bytes before it fails (`None`: for ever); shared with
    /// the clones of this stream.
    pub fn set_read_timeout(&self, timeout: Option<Duration>) -> Result<(), ChannelError> {
        self.stream
            .set_read_timeout(timeout)
            .map_err(|e| self.io_error("setting the read timeout", e))
    }

    /// How long `send` waits for the peer to take bytes before it fails (`None`: for
    /// ever); shared with the clones of this stream.
    pub fn set_write_timeout(&self, timeout: Option<Duration>) -> Result<(), ChannelError> {
        self.stream
            .set_write_timeout(timeout)
            .map_err(|e| self.io_error("setting the write timeout", e))
    }

    /// The address of the other end.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// The address of this end.
    pub fn local_addr(&self) -> Result<SocketAddr, ChannelError> {
        self.stream
            .local_addr()
            .map_err(|e| self.io_error("reading the local address", e))
    }

    /// Shuts both directions of the stream (and of all its clones): a thread blocked in
    /// `recv` wakes with `Ok(false)` (or an error mid-frame), one blocked in `send` with
    /// an error, and the peer sees the end of the stream.
    pub fn shutdown(&self) {
        // Fails only when already shut down or reset, which is the goal anyway.
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    fn read_timeout(&self) -> Duration {
        self.stream
            .read_timeout()
            .ok()
            .flatten()
            .unwrap_or_default()
    }

    fn io_error(&self, what: &'static str, source: io::Error) -> ChannelError {
        ChannelError::Io {
            peer: self.peer,
            what,
            source,
        }
    }

    fn truncated(&self, part: &'static str, got: usize, expected: usize) -> ChannelError {
        ChannelError::Truncated {
            peer: self.peer,
            part,
            got: got as u64,
            expected: expected as u64,
        }
    }

    fn stalled(&self, part: &'static str, got: usize, expected: usize) -> ChannelError {
        ChannelError::Stalled {
            peer: self.peer,
            after: self.read_timeout(),
            part,
            got: got as u64,
            expected: expected as u64,
        }
    }
}
