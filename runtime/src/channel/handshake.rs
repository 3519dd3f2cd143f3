//! The data channel's handshake: magic and version, then a nonce from each side and an
//! HMAC-SHA256 proof of the secret from each, on a blocking TCP stream with a deadline.
//!
//! ```text
//! connector -> acceptor   MAGIC VERSION nonce_c            (40 bytes)
//! acceptor  -> connector  MAGIC VERSION nonce_a proof_a    (72 bytes)
//! connector -> acceptor   proof_c                          (32 bytes)
//! acceptor  -> connector  1 (accepted) or 0 (refused)      (1 byte)
//! ```
//!
//! `proof_x` is HMAC-SHA256 under the secret over (`PROTOCOL`, role x, nonce_c,
//! nonce_a); each side checks the other's before it sends its own, so a stranger learns
//! nothing it could replay (the other side's nonce is fresh every time).

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use rand::Rng;

use super::ChannelSecret;
use crate::auth::{constant_time_eq, proof};

/// What a data channel peer says first (the ring's is `IMGRING1`).
const MAGIC: &[u8; 7] = b"IMGDATA";
/// The version of this handshake and of the framing after it.
const VERSION: u8 = 1;
/// Names the protocol in every proof, so that no ring proof serves here.
const PROTOCOL: &[u8] = b"imgrun data channel";
const CONNECTOR: &[u8] = b"connector";
const ACCEPTOR: &[u8] = b"acceptor";
const ACCEPTED: u8 = 1;
const REFUSED: u8 = 0;

/// The connecting side; `Err` is the reason, for the caller's error.
pub(super) fn connector(
    stream: &mut TcpStream,
    secret: &ChannelSecret,
    deadline: Instant,
) -> Result<(), String> {
    let mut io = Deadlined { stream, deadline };
    let nonce_c: [u8; 32] = rand::rng().random();
    io.write(&hello(&nonce_c))?;

    let mut reply = [0u8; 72];
    io.read(&mut reply).map_err(|reason| {
        format!(
            "the listener did not answer our hello ({reason}): not a data channel of \
             version {VERSION}?"
        )
    })?;
    check_magic(&reply[..8])?;
    let (nonce_a, proof_a) = reply[8..].split_at(32);
    let expected = proof(secret.as_bytes(), &[PROTOCOL, ACCEPTOR, &nonce_c, nonce_a]);
    if !constant_time_eq(&expected, proof_a) {
        return Err("the listener did not prove knowledge of the secret (wrong secret?)".into());
    }
    let proof_c = proof(secret.as_bytes(), &[PROTOCOL, CONNECTOR, &nonce_c, nonce_a]);
    io.write(&proof_c)?;
    let mut ack = [0u8; 1];
    match io.read(&mut ack) {
        Ok(()) if ack[0] == ACCEPTED => Ok(()),
        _ => Err("the listener refused our proof (wrong secret?)".into()),
    }
}

/// The accepting side; `Err` is the reason, for the log.
pub(super) fn acceptor(
    stream: &mut TcpStream,
    secret: &ChannelSecret,
    deadline: Instant,
) -> Result<(), String> {
    let mut io = Deadlined { stream, deadline };
    let mut greeting = [0u8; 40];
    // The magic first, so that garbage is refused without waiting for 40 bytes.
    io.read(&mut greeting[..8])?;
    check_magic(&greeting[..8])?;
    io.read(&mut greeting[8..])?;
    let nonce_c = &greeting[8..];

    let nonce_a: [u8; 32] = rand::rng().random();
    let mut reply = [0u8; 72];
    reply[..40].copy_from_slice(&hello(&nonce_a));
    reply[40..].copy_from_slice(&proof(
        secret.as_bytes(),
        &[PROTOCOL, ACCEPTOR, nonce_c, &nonce_a],
    ));
    io.write(&reply)?;

    let mut proof_c = [0u8; 32];
    io.read(&mut proof_c).map_err(|reason| {
        format!("the peer did not send its proof ({reason}): it refused ours (wrong secret?)")
    })?;
    let expected = proof(secret.as_bytes(), &[PROTOCOL, CONNECTOR, nonce_c, &nonce_a]);
    if !constant_time_eq(&expected, &proof_c) {
        // Best effort: tell it why before dropping it.
        let _ = io.write(&[REFUSED]);
        return Err(
            "the peer did not prove knowledge of the channel secret (wrong secret?)".into(),
        );
    }
    io.write(&[ACCEPTED])
}

/// What each side sends first: magic, version and its nonce.
fn hello(nonce: &[u8; 32]) -> [u8; 40] {
    let mut hello = [0u8; 40];
    hello[..7].copy_from_slice(MAGIC);
    hello[7] = VERSION;
    hello[8..].copy_from_slice(nonce);
    hello
}

fn check_magic(head: &[u8]) -> Result<(), String> {
    if &head[..7] != MAGIC {
        return Err(format!(
            "not an imgrun data channel peer (it sent {:?} where {:?} belongs)",
            String::from_utf8_lossy(&head[..7]),
            String::from_utf8_lossy(MAGIC)
        ));
    }
    if head[7] != VERSION {
        return Err(format!(
            "the peer speaks data channel version {}; this side speaks {VERSION}",
            head[7]
        ));
    }
    Ok(())
}

/// A stream whose reads and writes all end by one deadline, however the peer trickles.
struct Deadlined<'a> {
    stream: &'a mut TcpStream,
    deadline: Instant,
}

impl Deadlined<'_> {
    fn read(&mut self, buf: &mut [u8]) -> Result<(), String> {
        let mut got = 0;
        while got < buf.len() {
            self.arm()?;
            match self.stream.read(&mut buf[got..]) {
                Ok(0) => {
                    return Err(format!(
                        "closed by the peer after {got} of {} bytes",
                        buf.len()
                    ));
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if is_timeout(&e) => return Err(self.timed_out()),
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok(())
    }

    fn write(&mut self, bytes: &[u8]) -> Result<(), String> {
        let mut sent = 0;
        while sent < bytes.len() {
            self.arm()?;
            match self.stream.write(&bytes[sent..]) {
                Ok(0) => return Err("the peer stopped taking bytes".into()),
                Ok(n) => sent += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if is_timeout(&e) => return Err(self.timed_out()),
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok(())
    }

    /// Sets the socket's timeouts to what is left until the deadline.
    fn arm(&mut self) -> Result<(), String> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(self.timed_out());
        }
        self.stream
            .set_read_timeout(Some(left))
            .and_then(|()| self.stream.set_write_timeout(Some(left)))
            .map_err(|e| format!("setting the handshake's timeout: {e}"))
    }

    fn timed_out(&self) -> String {
        "timed out (the peer was silent or too slow)".into()
    }
}

/// Whether `e` is a socket timeout (`WouldBlock` on Unix, `TimedOut` on Windows).
pub(super) fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// How long the connector waits for its handshake: the listener may first spend its
/// whole handshake timeout on another peer.
pub(super) fn connector_timeout(handshake_timeout: Duration) -> Duration {
    handshake_timeout.saturating_mul(2)
}
