//! The head's UDP heartbeat port: one thread that reads the nodes' beats (`wire::beat`),
//! takes those tagged with a live session's key and newer than the last one taken, and
//! answers each with a tagged acknowledgement; the GPU samples a beat carries go to the
//! membership with it. No QUIC, no task and no wake-up of the async runtime per beat: a
//! beat costs two system calls and two HMACs, and the thread reads beats in batches (at
//! most [`BATCH_PAUSE`] apart), not one wake-up per beat.
//!
//! Anything else is refused unanswered (so the port cannot be used to reflect traffic),
//! counted by reason ([`BeatCounts`]) and logged at debug level; a warning sums the
//! refusals up at most every [`WARN_EVERY`]. A node whose beats go unanswered falls back
//! to a heartbeat over its QUIC connection, which the head answers with a refusal when
//! the session is over (`node/heartbeat.rs`).

use std::io::ErrorKind;
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use super::Shared;
use crate::wire::{BEAT_LEN, BeatError, MAX_BEAT_LEN};

/// How often the thread looks whether the head is gone, when no datagram comes.
const POLL: Duration = Duration::from_millis(500);
/// The pause after a batch of datagrams: what a beat's answer may wait at most, besides
/// its handling (against an interval of 500 ms and a dead window of 3 s).
const BATCH_PAUSE: Duration = Duration::from_millis(5);
/// The least time between two warnings about refused datagrams.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// What the heartbeat port received since the head started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BeatCounts {
    /// Beats taken and acknowledged.
    pub accepted: u64,
    /// Datagrams that are no heartbeat (wrong size, magic, version, kind or samples).
    pub garbage: u64,
    /// Beats whose tag did not verify with their session's key: forged.
    pub forged: u64,
    /// Beats with a `seq` already taken: replayed (or reordered).
    pub replayed: u64,
    /// Beats of a node or session the head does not know (any more): join again.
    pub unknown: u64,
}

/// The counters behind [`BeatCounts`], shared with the thread.
#[derive(Debug, Default)]
pub(super) struct BeatCounters {
    accepted: AtomicU64,
    garbage: AtomicU64,
    forged: AtomicU64,
    replayed: AtomicU64,
    unknown: AtomicU64,
}

impl BeatCounters {
    pub(super) fn counts(&self) -> BeatCounts {
        let read = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        BeatCounts {
            accepted: read(&self.accepted),
            garbage: read(&self.garbage),
            forged: read(&self.forged),
            replayed: read(&self.replayed),
            unknown: read(&self.unknown),
        }
    }

    fn refused(&self, error: &BeatError) {
        let counter = match error {
            BeatError::Garbage { .. }
            | BeatError::BadSamples { .. }
            | BeatError::WrongKind { .. }
            | BeatError::NoRandom => &self.garbage,
            BeatError::BadTag => &self.forged,
            BeatError::Replayed { .. } => &self.replayed,
            BeatError::UnknownNode { .. }
            | BeatError::WrongSession { .. }
            | BeatError::SessionOver { .. } => &self.unknown,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Binds the heartbeat port at `address` (port 0: any free port).
pub(super) fn bind(address: SocketAddr) -> std::io::Result<UdpSocket> {
    let socket = UdpSocket::bind(address)?;
    socket.set_read_timeout(Some(POLL))?;
    Ok(socket)
}

/// Serves `socket` on a thread of its own until the head is dropped or stopping.
pub(super) fn spawn(socket: UdpSocket, shared: Weak<Shared>) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("imgrun-beats".to_owned())
        .spawn(move || serve(&socket, &shared))
        .map(drop)
}

fn serve(socket: &UdpSocket, shared: &Weak<Shared>) {
    // One byte more than the longest beat, so that a longer datagram reads as too long.
    let mut buffer = [0u8; MAX_BEAT_LEN + 1];
    let mut refused_since_warning = 0u64;
    let mut last_warning: Option<Instant> = None;
    // Blocking while nothing comes; once a datagram came, a batch: what arrived, read
    // without blocking, then a pause of BATCH_PAUSE (beats collect in the socket's buffer
    // meanwhile), so that a busy port wakes the thread a few hundred times a second rather
    // than once per beat.
    let mut batch = false;
    loop {
        let received = socket.recv_from(&mut buffer);
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if shared.is_stopping() {
            return;
        }
        let (len, from) = match received {
            Ok(received) => {
                if !batch && socket.set_nonblocking(true).is_ok() {
                    batch = true;
                }
                received
            }
            Err(error) if error.kind() == ErrorKind::WouldBlock && batch => {
                // The batch is read: pause, then wait blocking again.
                batch = false;
                if let Err(error) = socket.set_nonblocking(false) {
                    warn!(%error, "heartbeat port: cannot block again; polling it");
                }
                std::thread::sleep(BATCH_PAUSE);
                continue;
            }
            Err(error) if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                continue;
            }
            Err(error) => {
                // An ICMP error of an earlier send (a node gone), or a signal: go on.
                debug!(%error, "heartbeat port: receive failed");
                continue;
            }
        };
        match answer(&shared, &buffer[..len]) {
            Ok(ack) => {
                shared
                    .beat_counters
                    .accepted
                    .fetch_add(1, Ordering::Relaxed);
                if let Err(error) = socket.send_to(&ack, from) {
                    debug!(%from, %error, "heartbeat acknowledgement not sent");
                }
            }
            Err(error) => {
                shared.beat_counters.refused(&error);
                debug!(%from, len, reason = error.name(), %error, "refused a heartbeat datagram");
                refused_since_warning += 1;
                if last_warning.is_none_or(|at| at.elapsed() >= WARN_EVERY) {
                    warn!(
                        refused = refused_since_warning,
                        counts = ?shared.beat_counters.counts(),
                        "heartbeat port refused datagrams (forged, replayed, stale or garbage)"
                    );
                    refused_since_warning = 0;
                    last_warning = Some(Instant::now());
                }
            }
        }
    }
}

fn answer(shared: &Arc<Shared>, datagram: &[u8]) -> Result<[u8; BEAT_LEN], BeatError> {
    shared.members.datagram_beat(datagram)
}
