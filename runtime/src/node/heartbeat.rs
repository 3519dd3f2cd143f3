//! The node's heartbeat loop: one heartbeat per interval on its connection to the head;
//! on a refusal (the head forgot the session: it restarted, or declared the node dead),
//! a rejoin with the node's certificate; on a lost connection, a new one after an
//! exponential backoff. A lost connection alone does not rejoin: the session may still be
//! on, and a rejoin would end it and release what the node holds.
//!
//! Every beat carries the node's newest GPU samples (`gpu/sampler.rs`, 13 bytes a GPU; none
//! without NVML), taken from the sampling thread's last measurement without waiting for
//! NVML.
//!
//! Heartbeats go as plain UDP datagrams to the head's heartbeat port, tagged with the
//! session's key (`wire::beat`; the key came with the join, over mutual TLS), and the
//! head answers each one it takes with a tagged acknowledgement of its `seq`; an answer
//! that does not verify, or repeats a `seq`, is ignored. The head answers nothing else on
//! that port: after a beat that went unanswered, the next goes over the QUIC connection,
//! as a datagram that the head answers with a datagram naming its `seq`: acknowledged (it
//! keeps the session) or refused with a reason (join again; the head forgot the session
//! and its key). Then UDP again. A beat unanswered within its
//! interval is only missed, as its datagram or the answer may have been lost: the next
//! one goes out on time, and an acknowledgement of any beat of the session counts,
//! however late. The head is lost when the connection ends, or once no heartbeat was
//! acknowledged for the dead window; never sooner. Answers to beats sent before the
//! current session began (before the last rejoin) are stale and ignored, so an old
//! refusal cannot end a new session. A head that takes no datagrams gets each heartbeat
//! on a stream of its own instead, answered or lost within the dead window.
//!
//! Fencing: a session the head refused, or one not acknowledged for the dead window, is
//! over at the head, which has failed its actors (or is gone). The node then kills every
//! actor it hosts and waits for their worker processes to exit before it joins again, so
//! that its resources are counted free only once nothing of the old session uses them.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UdpSocket;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::join::accepted;
use super::{BeatLink, Session, Shared};
use crate::daemon::{message_name, samples_wire};
use crate::transport::{Connection, TransportError};
use crate::wire::{BEAT_LEN, BeatGate, BeatKind, BeatPacket, Message};

/// The first pause after a failure; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// How long a new connection to the head may take.
const RECONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a fence waits for the worker processes it killed to exit.
const FENCE_LIMIT: Duration = Duration::from_secs(10);
/// How long a node about to join again waits for the head to hear of the actors it
/// killed (reports from the old session must not reach the head after the new one began).
const REPORT_LIMIT: Duration = Duration::from_secs(10);

/// What became of one heartbeat.
#[derive(Debug)]
enum Beat {
    /// The head acknowledged a beat of the current session; its answer came `at`.
    Acked { at: Instant },
    /// The head refused the session: join again.
    Refused(String),
    /// No answer within the interval: a datagram may have been lost, or the head.
    Missed,
    /// No answer: the connection or the head is gone.
    Lost(TransportError),
}

/// What a message from the head says about the beats of the current session, the first
/// of which was `first_seq`.
#[derive(Debug, PartialEq, Eq)]
enum Answer {
    /// The head keeps the session: it acknowledged the beat `seq`.
    Acked { seq: u64 },
    /// The head ended the session.
    Refused(String),
    /// An answer to a beat of an earlier session: it says nothing about this one.
    Stale,
    /// No answer to a heartbeat at all (named).
    Unexpected(&'static str),
}

impl Answer {
    fn of(message: Message, first_seq: u64) -> Answer {
        match message {
            Message::HeartbeatAck { seq } if seq >= first_seq => Answer::Acked { seq },
            Message::HeartbeatRefused { seq, reason } if seq >= first_seq => {
                Answer::Refused(reason)
            }
            Message::HeartbeatAck { .. } | Message::HeartbeatRefused { .. } => Answer::Stale,
            other => Answer::Unexpected(message_name(&other)),
        }
    }
}

/// Sends heartbeats until the task is aborted.
pub(super) async fn run(shared: Arc<Shared>) {
    let mut seq = 0u64;
    // The first beat of the current session: answers to earlier ones are stale.
    let mut first_seq = 1u64;
    let mut backoff = FIRST_BACKOFF;
    let mut lost = false;
    // When the head last acknowledged this node's session (or it joined).
    let mut last_ack = Instant::now();
    // Whether the actors of the current session were killed.
    let mut fenced = false;
    let mut beats = Beats::default();
    loop {
        let session = shared.session();
        let started = Instant::now();
        seq += 1;
        let interval = Duration::from_millis(session.heartbeat_ms);
        let window = Duration::from_millis(session.dead_after_ms);
        let outcome = match beats
            .beat(&shared, seq, first_seq, started + interval)
            .await
        {
            Beat::Missed if last_ack.elapsed() >= window => Beat::Lost(TransportError::Timeout {
                peer: shared.head,
                after: window,
            }),
            outcome => outcome,
        };
        let pause = match outcome {
            Beat::Acked { at } => {
                if lost {
                    info!(node = %session.node_id, "reached the head again");
                    lost = false;
                }
                last_ack = at;
                if fenced {
                    // The head kept the session after all (it was itself stopped for as
                    // long); it learns of the killed actors from the node's reports.
                    info!(node = %session.node_id, "the head kept this node's session; taking actors again");
                    shared.actors.unfence();
                    fenced = false;
                }
                backoff = FIRST_BACKOFF;
                tokio::time::sleep_until(started + interval).await;
                continue;
            }
            Beat::Missed => {
                // The interval is over: the next beat goes out now.
                debug!(node = %session.node_id, seq, "heartbeat not acknowledged within its interval");
                continue;
            }
            Beat::Refused(reason) => {
                debug!(node = %session.node_id, %reason, "heartbeat refused; joining again");
                if !fenced {
                    fence(&shared, "the head ended its session").await;
                    fenced = true;
                }
                if !shared.actors.wait_reported(REPORT_LIMIT).await {
                    warn!(
                        node = %session.node_id,
                        limit_ms = REPORT_LIMIT.as_millis() as u64,
                        "the head was not told of every killed actor in time; joining again anyway"
                    );
                }
                match rejoin(&shared).await {
                    Ok(()) => {
                        first_seq = seq + 1;
                        shared.actors.unfence();
                        fenced = false;
                        last_ack = Instant::now();
                        backoff = FIRST_BACKOFF;
                        lost = false;
                        continue;
                    }
                    Err(reason) => {
                        warn!(%reason, "cannot join the head again");
                        backoff
                    }
                }
            }
            Beat::Lost(error) => {
                if !lost {
                    warn!(%error, "lost the head; reconnecting");
                    lost = true;
                } else {
                    debug!(%error, "head still unreachable");
                }
                shared.forget_connection();
                if !fenced && last_ack.elapsed() >= window {
                    fence(&shared, "cut off from the head for the dead window").await;
                    fenced = true;
                }
                backoff
            }
        };
        tokio::time::sleep(pause).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Kills every actor of the node's session (over at the head: `why`) and waits for their
/// worker processes to exit.
async fn fence(shared: &Shared, why: &'static str) {
    let session = shared.session();
    let fence = shared.actors.fence(FENCE_LIMIT).await;
    if fence.killed.is_empty() {
        info!(node = %session.node_id, session = %session.session, why, "session over; no actor to stop");
    } else {
        warn!(
            node = %session.node_id,
            session = %session.session,
            why,
            killed = ?fence.killed,
            "session over: killed the actors it hosted"
        );
    }
    if !fence.settled {
        warn!(
            node = %session.node_id,
            limit_ms = FENCE_LIMIT.as_millis() as u64,
            "killed actors or their worker processes had not ended in time"
        );
    }
}

/// How the node sends its heartbeats: as UDP datagrams tagged with the session's key
/// while the head answers them; after one goes unanswered, the next over QUIC (which
/// carries the head's refusal of a session it ended or forgot), then UDP again. After
/// [`UDP_TRIES`] unanswered UDP beats in a row (a firewall, say), [`QUIC_SPELL`] beats go
/// over QUIC before UDP is tried again, so that the head hears the node every interval.
#[derive(Debug, Default)]
struct Beats {
    /// The socket and the check of the head's answers, for the current session.
    udp: Option<UdpBeats>,
    /// Whether the next beat goes over QUIC.
    quic_next: bool,
    /// UDP beats of the session unanswered in a row.
    udp_misses: u32,
    /// Beats left to send over QUIC before UDP is tried again.
    quic_spell: u32,
    /// The session the counts above are of: a new one starts afresh.
    session: u64,
}

/// Unanswered UDP beats in a row after which the node beats over QUIC for a while.
const UDP_TRIES: u32 = 3;
/// How many beats then go over QUIC (10 s at the default interval).
const QUIC_SPELL: u32 = 20;

#[derive(Debug)]
struct UdpBeats {
    /// Connected to the head's heartbeat port: datagrams from elsewhere are not read.
    socket: UdpSocket,
    to: SocketAddr,
    /// Takes only acknowledgements tagged with the session's key, each `seq` once.
    gate: BeatGate,
}

impl Beats {
    /// One heartbeat, its answer awaited until `deadline` (the next beat's time).
    async fn beat(&mut self, shared: &Shared, seq: u64, first_seq: u64, deadline: Instant) -> Beat {
        let session = shared.session();
        if self.session != session.session.0 {
            self.session = session.session.0;
            self.quic_next = false;
            self.udp_misses = 0;
            self.quic_spell = 0;
        }
        let udp = session
            .beat
            .filter(|_| !self.quic_next && self.quic_spell == 0);
        if let Some(link) = udp {
            let outcome = self.udp_beat(shared, session, link, seq, deadline).await;
            match outcome {
                Beat::Missed => {
                    self.quic_next = true;
                    self.udp_misses += 1;
                    if self.udp_misses >= UDP_TRIES {
                        info!(
                            node = %session.node_id,
                            misses = self.udp_misses,
                            "the head's heartbeat port does not answer; beating over QUIC for a while"
                        );
                        self.udp_misses = 0;
                        self.quic_spell = QUIC_SPELL;
                    }
                }
                Beat::Acked { .. } => self.udp_misses = 0,
                Beat::Refused(_) | Beat::Lost(_) => {}
            }
            return outcome;
        }
        self.quic_next = false;
        self.quic_spell = self.quic_spell.saturating_sub(1);
        beat(shared, seq, first_seq, deadline).await
    }

    /// One beat over UDP; `Missed` if no answer of the session came in time (or the
    /// socket failed: the next beat goes over QUIC, which tells more).
    async fn udp_beat(
        &mut self,
        shared: &Shared,
        session: Session,
        link: BeatLink,
        seq: u64,
        deadline: Instant,
    ) -> Beat {
        let to = SocketAddr::new(shared.head.ip(), link.port);
        let current = self
            .udp
            .as_ref()
            .is_some_and(|udp| udp.to == to && udp.gate.session() == session.session.0);
        if !current {
            self.udp = match UdpBeats::open(to, session, link).await {
                Ok(udp) => Some(udp),
                Err(error) => {
                    debug!(%to, %error, "cannot open a heartbeat socket; beating over QUIC");
                    return Beat::Missed;
                }
            };
        }
        let Some(udp) = self.udp.as_mut() else {
            return Beat::Missed;
        };
        let datagram = BeatPacket {
            kind: BeatKind::Beat,
            node_id: session.node_id.0,
            session: session.session.0,
            seq,
        }
        .seal_with_samples(&samples_wire(&shared.gpus.latest()), udp.gate.key());
        if let Err(error) = udp.socket.send(&datagram).await {
            debug!(%to, %error, "heartbeat datagram not sent");
            return Beat::Missed;
        }
        // One byte more than an answer, so that a longer datagram reads as too long.
        let mut buffer = [0u8; BEAT_LEN + 1];
        let mut late_ack = None;
        loop {
            let received = tokio::select! {
                received = udp.socket.recv(&mut buffer) => received,
                () = tokio::time::sleep_until(deadline) => {
                    return late_ack.map_or(Beat::Missed, |at| Beat::Acked { at });
                }
            };
            match received.map(|len| udp.gate.take(&buffer[..len], BeatKind::Ack)) {
                Ok(Ok(ack)) if ack.seq == seq => return Beat::Acked { at: Instant::now() },
                // An answer to an earlier beat of the session, late.
                Ok(Ok(_)) => late_ack = Some(Instant::now()),
                Ok(Err(error)) => {
                    debug!(%to, reason = error.name(), %error, "refused a heartbeat answer");
                }
                // An ICMP error of an earlier beat (the port closed), say: wait out the
                // interval rather than read again at once.
                Err(error) => {
                    debug!(%to, %error, "heartbeat socket: receive failed");
                    tokio::time::sleep_until(deadline).await;
                    return late_ack.map_or(Beat::Missed, |at| Beat::Acked { at });
                }
            }
        }
    }
}

impl UdpBeats {
    async fn open(to: SocketAddr, session: Session, link: BeatLink) -> std::io::Result<Self> {
        let local = match to {
            SocketAddr::V4(_) => SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)),
            SocketAddr::V6(_) => SocketAddr::from((Ipv6Addr::UNSPECIFIED, 0)),
        };
        let socket = UdpSocket::bind(local).await?;
        socket.connect(to).await?;
        Ok(UdpBeats {
            socket,
            to,
            gate: BeatGate::new(session.node_id.0, session.session.0, &link.key),
        })
    }
}

/// One heartbeat over QUIC: a datagram, and its answer awaited until `deadline` (the
/// next beat's time); or, to a head that takes no datagrams, a request on a stream.
async fn beat(shared: &Shared, seq: u64, first_seq: u64, deadline: Instant) -> Beat {
    let session = shared.session();
    let connection = match shared.connection(RECONNECT_TIMEOUT).await {
        Ok(connection) => connection,
        Err(error) => return Beat::Lost(error),
    };
    let heartbeat = Message::Heartbeat {
        node_id: session.node_id.0,
        session: session.session.0,
        seq,
        gpus: samples_wire(&shared.gpus.latest()),
    };
    match connection.send_datagram(&heartbeat) {
        Ok(()) => answer(&connection, seq, first_seq, deadline).await,
        Err(error @ TransportError::NoDatagram { .. }) => {
            debug!(%error, "heartbeat on a stream");
            beat_on_stream(&connection, &heartbeat, session).await
        }
        Err(error) => Beat::Lost(error),
    }
}

/// Reads the head's datagrams until one answers the beat `seq` or refuses the session,
/// or until `deadline`. An acknowledgement of an earlier beat of the session (a late
/// one) counts as such if the beat's own does not come in time.
async fn answer(connection: &Connection, seq: u64, first_seq: u64, deadline: Instant) -> Beat {
    let mut late_ack = None;
    loop {
        let message = tokio::select! {
            message = connection.read_datagram() => message,
            () = tokio::time::sleep_until(deadline) => {
                return late_ack.map_or(Beat::Missed, |at| Beat::Acked { at });
            }
        };
        match message.map(|message| Answer::of(message, first_seq)) {
            Ok(Answer::Acked { seq: acked }) if acked == seq => {
                return Beat::Acked { at: Instant::now() };
            }
            Ok(Answer::Acked { .. }) => late_ack = Some(Instant::now()),
            Ok(Answer::Refused(reason)) => return Beat::Refused(reason),
            Ok(Answer::Stale) => debug!(
                seq,
                first_seq, "ignored an answer to a heartbeat of an earlier session"
            ),
            Ok(Answer::Unexpected(name)) => debug!(
                message = name,
                "ignored a datagram that answers no heartbeat"
            ),
            Err(error) => return Beat::Lost(error),
        }
    }
}

/// One heartbeat on a stream of its own, waiting at most the dead window for its answer
/// (past it, the session is over anyway).
async fn beat_on_stream(connection: &Connection, heartbeat: &Message, session: Session) -> Beat {
    let timeout = Duration::from_millis(session.dead_after_ms.max(session.heartbeat_ms));
    match connection.request(heartbeat, timeout).await {
        Ok(Message::HeartbeatAck { .. }) => Beat::Acked { at: Instant::now() },
        Ok(Message::Refused { reason } | Message::HeartbeatRefused { reason, .. }) => {
            Beat::Refused(reason)
        }
        Ok(other) => Beat::Refused(format!("unexpected {}", message_name(&other))),
        Err(error) => Beat::Lost(error),
    }
}

/// Joins again with the node's certificate (no token): a new session, perhaps a new node
/// id if the head restarted.
async fn rejoin(shared: &Shared) -> Result<(), String> {
    let connection = shared
        .connection(RECONNECT_TIMEOUT)
        .await
        .map_err(|error| error.to_string())?;
    let request = Message::JoinRequest {
        token: String::new(),
        node: shared.description.clone(),
    };
    let timeout = Duration::from_millis(shared.session().dead_after_ms).max(RECONNECT_TIMEOUT);
    let reply = match connection.request(&request, timeout).await {
        Ok(reply) => reply,
        Err(error) => {
            shared.forget_connection();
            return Err(error.to_string());
        }
    };
    let joined = accepted(reply, &shared.head_text, shared.ca_hash).map_err(|e| e.to_string())?;
    info!(
        node = %joined.session.node_id,
        session = %joined.session.session,
        head = %shared.head_text,
        "joined the head again"
    );
    shared.set_session(joined.session);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_read_against_the_first_beat_of_the_session() {
        let refused = |seq| Message::HeartbeatRefused {
            seq,
            reason: "unknown session".into(),
        };
        // (message, first beat of the session, what it means)
        let cases = [
            (
                Message::HeartbeatAck { seq: 7 },
                1,
                Answer::Acked { seq: 7 },
            ),
            (
                Message::HeartbeatAck { seq: 7 },
                7,
                Answer::Acked { seq: 7 },
            ),
            (Message::HeartbeatAck { seq: 6 }, 7, Answer::Stale),
            (refused(7), 7, Answer::Refused("unknown session".into())),
            (refused(9), 7, Answer::Refused("unknown session".into())),
            (refused(6), 7, Answer::Stale),
            (Message::Ack, 1, Answer::Unexpected("ack")),
            (
                Message::Refused {
                    reason: "no".into(),
                },
                1,
                Answer::Unexpected("refused"),
            ),
        ];
        for (message, first_seq, want) in cases {
            let case = format!("{message:?} from {first_seq}");
            assert_eq!(Answer::of(message, first_seq), want, "{case}");
        }
    }
}
