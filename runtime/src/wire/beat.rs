//! Heartbeats as plain UDP datagrams, authenticated by a key of the session: the head hands
//! each node a fresh key in its [`Message::JoinAccepted`](super::Message) (over the
//! mutual-TLS join), the node tags every beat with it and the head tags its answer.
//!
//! A datagram is [`BEAT_LEN`] bytes: the magic `imgB`, a version byte, the kind (beat or
//! ack), the node id, the session and the beat's `seq` (little-endian `u64`s), then
//! HMAC-SHA256 of everything before it. Nothing here does I/O: [`BeatPacket::seal`] makes a
//! datagram, [`BeatPacket::read`] reads one's fields unverified (to find the key),
//! [`BeatPacket::verify`] checks its tag, and [`BeatGate`] adds the replay check (a beat
//! is taken only with a `seq` above every one taken before in the session).

use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

/// The first bytes of every heartbeat datagram.
pub const BEAT_MAGIC: [u8; 4] = *b"imgB";
/// The layout's version; a datagram of another is refused.
pub const BEAT_VERSION: u8 = 1;
/// Bytes of the tag (a whole HMAC-SHA256).
const TAG_LEN: usize = 32;
/// Bytes before the tag.
const BODY_LEN: usize = 4 + 1 + 1 + 3 * 8;
/// Bytes of every heartbeat datagram.
pub const BEAT_LEN: usize = BODY_LEN + TAG_LEN;
/// Bytes of a session key.
pub const BEAT_KEY_LEN: usize = 32;

/// A session's heartbeat key. Its `Debug` shows no byte of it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct BeatKey([u8; BEAT_KEY_LEN]);

impl std::fmt::Debug for BeatKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BeatKey(..)")
    }
}

impl BeatKey {
    /// A new random key from the operating system's generator.
    pub fn generate() -> Result<Self, BeatError> {
        let mut bytes = [0u8; BEAT_KEY_LEN];
        SystemRandom::new()
            .fill(&mut bytes)
            .map_err(|_| BeatError::NoRandom)?;
        Ok(Self(bytes))
    }

    /// The key handed out in a join answer; `None` unless it has [`BEAT_KEY_LEN`] bytes.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Self)
    }

    pub fn as_bytes(&self) -> &[u8; BEAT_KEY_LEN] {
        &self.0
    }

    /// The key ready to sign and verify with (set up once, used for many datagrams).
    pub fn hmac(&self) -> hmac::Key {
        hmac::Key::new(hmac::HMAC_SHA256, &self.0)
    }
}

/// What a datagram is: a node's beat, or the head's acknowledgement of one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BeatKind {
    Beat = 1,
    Ack = 2,
}

/// The fields of a heartbeat datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BeatPacket {
    pub kind: BeatKind,
    pub node_id: u64,
    pub session: u64,
    pub seq: u64,
}

/// Why a heartbeat datagram was refused; each is counted apart by the head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BeatError {
    #[error("not a heartbeat datagram ({len} bytes, magic or version wrong)")]
    Garbage { len: usize },
    #[error("a {found:?} where a {expected:?} was due")]
    WrongKind { expected: BeatKind, found: u8 },
    #[error("node {node} has no heartbeat key at this head")]
    UnknownNode { node: u64 },
    #[error("session {session} of node {node} is not its current one")]
    WrongSession { node: u64, session: u64 },
    #[error("bad tag: forged, or signed with another key")]
    BadTag,
    #[error("seq {seq} replayed (last taken {last})")]
    Replayed { seq: u64, last: u64 },
    #[error("the head ended session {session} of node {node}")]
    SessionOver { node: u64, session: u64 },
    #[error("the operating system's random generator failed")]
    NoRandom,
}

impl BeatError {
    /// A short name, for counters and logs.
    pub fn name(&self) -> &'static str {
        match self {
            BeatError::Garbage { .. } => "garbage",
            BeatError::WrongKind { .. } => "wrong kind",
            BeatError::UnknownNode { .. } => "unknown node",
            BeatError::WrongSession { .. } => "wrong session",
            BeatError::BadTag => "bad tag",
            BeatError::Replayed { .. } => "replayed",
            BeatError::SessionOver { .. } => "session over",
            BeatError::NoRandom => "no random",
        }
    }
}

impl BeatPacket {
    /// The datagram of this packet, tagged with `key`.
    pub fn seal(&self, key: &hmac::Key) -> [u8; BEAT_LEN] {
        let mut datagram = [0u8; BEAT_LEN];
        datagram[..4].copy_from_slice(&BEAT_MAGIC);
        datagram[4] = BEAT_VERSION;
        datagram[5] = self.kind as u8;
        datagram[6..14].copy_from_slice(&self.node_id.to_le_bytes());
        datagram[14..22].copy_from_slice(&self.session.to_le_bytes());
        datagram[22..30].copy_from_slice(&self.seq.to_le_bytes());
        let tag = hmac::sign(key, &datagram[..BODY_LEN]);
        datagram[BODY_LEN..].copy_from_slice(tag.as_ref());
        datagram
    }

    /// The fields of `datagram`, which must be of `kind`, NOT yet verified: look up the
    /// key they name, then [`BeatPacket::verify`].
    pub fn read(datagram: &[u8], kind: BeatKind) -> Result<BeatPacket, BeatError> {
        let garbage = BeatError::Garbage {
            len: datagram.len(),
        };
        if datagram.len() != BEAT_LEN || datagram[..4] != BEAT_MAGIC || datagram[4] != BEAT_VERSION
        {
            return Err(garbage);
        }
        if datagram[5] != kind as u8 {
            return Err(BeatError::WrongKind {
                expected: kind,
                found: datagram[5],
            });
        }
        let word = |at: usize| {
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(&datagram[at..at + 8]);
            u64::from_le_bytes(bytes)
        };
        Ok(BeatPacket {
            kind,
            node_id: word(6),
            session: word(14),
            seq: word(22),
        })
    }

    /// Checks the tag of `datagram` (already [`BeatPacket::read`]) against `key`, in
    /// constant time.
    pub fn verify(datagram: &[u8], key: &hmac::Key) -> Result<(), BeatError> {
        if datagram.len() != BEAT_LEN {
            return Err(BeatError::Garbage {
                len: datagram.len(),
            });
        }
        hmac::verify(key, &datagram[..BODY_LEN], &datagram[BODY_LEN..])
            .map_err(|_| BeatError::BadTag)
    }

    /// The acknowledgement of this beat, the same fields of the other kind.
    pub fn ack(&self) -> BeatPacket {
        BeatPacket {
            kind: BeatKind::Ack,
            ..*self
        }
    }
}

/// One side's check of the datagrams of one session: the right session, a valid tag, and
/// a `seq` above every one taken before (so a recorded datagram cannot be played again;
/// one that arrives after a later one is refused too, which costs a heartbeat nothing).
#[derive(Debug)]
pub struct BeatGate {
    node_id: u64,
    session: u64,
    key: hmac::Key,
    /// The highest `seq` taken; 0 before the first (beats start at 1).
    last: u64,
}

impl BeatGate {
    pub fn new(node_id: u64, session: u64, key: &BeatKey) -> Self {
        Self {
            node_id,
            session,
            key: key.hmac(),
            last: 0,
        }
    }

    pub fn session(&self) -> u64 {
        self.session
    }

    pub fn key(&self) -> &hmac::Key {
        &self.key
    }

    /// Takes `datagram` if it is a valid `kind` of this gate's session with a new `seq`.
    pub fn take(&mut self, datagram: &[u8], kind: BeatKind) -> Result<BeatPacket, BeatError> {
        let packet = BeatPacket::read(datagram, kind)?;
        self.take_read(datagram, packet)
    }

    /// As [`BeatGate::take`], for a datagram already read into `packet`.
    pub fn take_read(
        &mut self,
        datagram: &[u8],
        packet: BeatPacket,
    ) -> Result<BeatPacket, BeatError> {
        if packet.node_id != self.node_id || packet.session != self.session {
            return Err(BeatError::WrongSession {
                node: packet.node_id,
                session: packet.session,
            });
        }
        BeatPacket::verify(datagram, &self.key)?;
        if packet.seq <= self.last {
            return Err(BeatError::Replayed {
                seq: packet.seq,
                last: self.last,
            });
        }
        self.last = packet.seq;
        Ok(packet)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn beat(seq: u64) -> BeatPacket {
        BeatPacket {
            kind: BeatKind::Beat,
            node_id: 7,
            session: 42,
            seq,
        }
    }

    #[test]
    fn the_gate_takes_only_fresh_beats_tagged_with_the_session_key() {
        let key = BeatKey::generate().expect("random key");
        let other = BeatKey::generate().expect("random key");
        let sealed = |packet: BeatPacket, key: &BeatKey| packet.seal(&key.hmac()).to_vec();
        let mut flipped = sealed(beat(3), &key);
        flipped[BEAT_LEN - 1] ^= 1;
        let mut seq_changed = sealed(beat(3), &key);
        seq_changed[22] = 9;
        let mut wrong_version = sealed(beat(3), &key);
        wrong_version[4] = BEAT_VERSION + 1;
        // (datagram, what the gate says), in this order on one gate.
        let cases: Vec<(Vec<u8>, Result<u64, BeatError>)> = vec![
            (sealed(beat(1), &key), Ok(1)),
            (
                sealed(beat(1), &key),
                Err(BeatError::Replayed { seq: 1, last: 1 }),
            ),
            (sealed(beat(3), &key), Ok(3)),
            (
                sealed(beat(2), &key),
                Err(BeatError::Replayed { seq: 2, last: 3 }),
            ),
            (sealed(beat(4), &other), Err(BeatError::BadTag)),
            (flipped, Err(BeatError::BadTag)),
            (seq_changed, Err(BeatError::BadTag)),
            (
                sealed(beat(5).ack(), &key),
                Err(BeatError::WrongKind {
                    expected: BeatKind::Beat,
                    found: 2,
                }),
            ),
            (
                sealed(
                    BeatPacket {
                        session: 41,
                        ..beat(5)
                    },
                    &key,
                ),
                Err(BeatError::WrongSession {
                    node: 7,
                    session: 41,
                }),
            ),
            (
                sealed(
                    BeatPacket {
                        node_id: 8,
                        ..beat(5)
                    },
                    &key,
                ),
                Err(BeatError::WrongSession {
                    node: 8,
                    session: 42,
                }),
            ),
            (wrong_version, Err(BeatError::Garbage { len: BEAT_LEN })),
            (vec![], Err(BeatError::Garbage { len: 0 })),
            (b"imgB".to_vec(), Err(BeatError::Garbage { len: 4 })),
            (
                vec![0xFF; BEAT_LEN],
                Err(BeatError::Garbage { len: BEAT_LEN }),
            ),
            (
                vec![0; BEAT_LEN + 1],
                Err(BeatError::Garbage { len: BEAT_LEN + 1 }),
            ),
            (sealed(beat(4), &key), Ok(4)),
        ];
        let mut gate = BeatGate::new(7, 42, &key);
        for (index, (datagram, want)) in cases.into_iter().enumerate() {
            let got = gate
                .take(&datagram, BeatKind::Beat)
                .map(|packet| packet.seq);
            assert_eq!(got, want, "case {index}");
        }
    }

    #[test]
    fn a_sealed_packet_reads_back_and_an_ack_is_no_beat() {
        let key = BeatKey::generate().expect("random key").hmac();
        let packet = beat(u64::MAX);
        let datagram = packet.seal(&key);
        assert_eq!(BeatPacket::read(&datagram, BeatKind::Beat), Ok(packet));
        assert_eq!(BeatPacket::verify(&datagram, &key), Ok(()));
        let ack = packet.ack().seal(&key);
        assert_eq!(BeatPacket::read(&ack, BeatKind::Ack), Ok(packet.ack()));
        assert!(BeatPacket::read(&ack, BeatKind::Beat).is_err());
        assert_eq!(
            format!("{:?}", BeatKey::from_bytes(&[1; 32])),
            "Some(BeatKey(..))"
        );
        assert_eq!(BeatKey::from_bytes(&[1; 31]), None);
    }
}
