//! The data channel: an authenticated TCP stream of length-prefixed frames, for bulk data
//! between processes of one job (decoded image batches from loaders to trainers).
//!
//! Blocking (`std::net` and threads), so callers need no async runtime. A
//! [`DataListener`] accepts [`DataStream`]s whose peers prove they know the channel's
//! [`ChannelSecret`]; [`DataStream::connect`] reaches one, retrying while nothing listens
//! yet. Both ends authenticate: after magic bytes and a version byte, each side sends a
//! random nonce and proves the secret by HMAC-SHA256 over both nonces and its role
//! (connector or acceptor), compared in constant time, as the ring's links do. A peer
//! that fails the handshake, or stays silent past the handshake timeout, is logged and
//! dropped, and the listener serves on.
//!
//! On the stream, each frame is `[u64 LE length][payload]`; [`DataStream::send`] writes
//! one frame from several parts with vectored writes (no copy), and [`DataStream::recv`]
//! reads one into a caller's buffer, refusing a length past the caller's limit before
//! allocating it. There is no buffering of our own: backpressure is TCP's, so a receiver
//! that stops reading blocks its sender's `send` once the sockets' buffers are full.
//! Data after the handshake is **not encrypted or authenticated** (as with the ring, gloo
//! and NCCL): the channel is meant for a trusted cluster network.
//!
//! A thread blocked in [`DataListener::accept`] is stopped through a [`ListenerStopper`]
//! ([`DataListener::stopper`]); one blocked in [`DataStream::recv`] by
//! [`DataStream::shutdown`] from another thread (on a [`DataStream::try_clone`]).

mod handshake;
mod listener;
mod stream;

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

pub use listener::{DataListener, ListenerStopper};
pub use stream::DataStream;

use crate::auth::decode_hex;
use crate::secret::{Secret, SecretPurpose};

/// Longest one handshake may take by default.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// The secret that both ends of a channel prove they know; it travels to the other end
/// as hex ([`Secret::to_hex`]), e.g. in an actor's arguments.
pub type ChannelSecret = Secret<ChannelPurpose>;

/// Marks a [`Secret`] as a data channel's.
#[derive(Debug)]
pub enum ChannelPurpose {}

impl SecretPurpose for ChannelPurpose {
    const NAME: &'static str = "ChannelSecret";
}

impl ChannelSecret {
    /// Reads what [`Secret::to_hex`] wrote (either case).
    pub fn from_hex(hex: &str) -> Result<Self, ChannelError> {
        let bytes = decode_hex(hex).ok_or_else(|| ChannelError::BadSecret {
            reason: format!("{} characters that are not all hex digits", hex.len()),
        })?;
        let bytes = <[u8; 32]>::try_from(bytes).map_err(|bytes| ChannelError::BadSecret {
            reason: format!("{} bytes of hex; a secret is 32", bytes.len()),
        })?;
        Ok(Self::from_bytes(bytes))
    }
}

/// Tunables of both ends of a channel.
#[derive(Clone, Debug)]
pub struct ChannelOptions {
    /// Longest the listener's side of one handshake may take, so that a silent or slow
    /// peer holds [`DataListener::accept`] no longer. A connector waits for its handshake
    /// twice as long, since the listener may first spend this long on another peer.
    pub handshake_timeout: Duration,
}

impl Default for ChannelOptions {
    fn default() -> Self {
        Self {
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
        }
    }
}

/// Errors of the data channel; each names the peer (or the listener's address).
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    #[error("not a data channel secret: {reason}")]
    BadSecret { reason: String },
    #[error("cannot listen for data channels on {addr}: {source}")]
    Bind { addr: SocketAddr, source: io::Error },
    #[error("data channel listener on {addr}: accept failed: {source}")]
    Accept { addr: SocketAddr, source: io::Error },
    #[error("data channel listener on {addr} was stopped")]
    Stopped { addr: SocketAddr },
    #[error("cannot connect to the data channel at {peer} (tried for {after:?}): {source}")]
    Connect {
        peer: SocketAddr,
        after: Duration,
        source: io::Error,
    },
    #[error("data channel handshake with {peer} failed: {reason}")]
    Handshake { peer: SocketAddr, reason: String },
    #[error("data channel with {peer}: {what} failed: {source}")]
    Io {
        peer: SocketAddr,
        what: &'static str,
        source: io::Error,
    },
    #[error(
        "{peer} sent a data channel frame of {len} bytes; this receiver takes at most {max_len}"
    )]
    FrameTooLarge {
        peer: SocketAddr,
        len: u64,
        max_len: usize,
    },
    #[error(
        "{peer} closed the data channel mid-frame: {got} of the {expected} bytes of the {part}"
    )]
    Truncated {
        peer: SocketAddr,
        part: &'static str,
        got: u64,
        expected: u64,
    },
    /// No byte of a next frame came within the read timeout; the stream is still usable.
    #[error("no frame from {peer} on the data channel within {after:?}")]
    Idle { peer: SocketAddr, after: Duration },
    #[error(
        "{peer} stalled mid-frame on the data channel for {after:?}: {got} of the {expected} \
         bytes of the {part}"
    )]
    Stalled {
        peer: SocketAddr,
        after: Duration,
        part: &'static str,
        got: u64,
        expected: u64,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_travel_as_hex_and_hide_in_debug() {
        let secret = ChannelSecret::random();
        let hex = secret.to_hex();
        assert_eq!(hex.len(), 64);
        let back = ChannelSecret::from_hex(&hex.to_uppercase()).expect("hex of a secret");
        assert_eq!(back.as_bytes(), secret.as_bytes());
        assert_eq!(format!("{secret:?}"), "ChannelSecret(..)");
        for (bad, says) in [
            ("", "0 bytes"),
            ("ab", "1 bytes"),
            (&hex[..63], "63 characters"),
            (&format!("{hex}00"), "33 bytes"),
            (&format!("{}zz", &hex[..62]), "not all hex"),
        ] {
            let error = ChannelSecret::from_hex(bad).expect_err(bad).to_string();
            assert!(error.contains(says), "{bad:?}: {error}");
        }
    }
}
