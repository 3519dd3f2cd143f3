//! Heartbeats as plain UDP datagrams, authenticated by a key of the session: the head hands
//! each node a fresh key in its [`Message::JoinAccepted`](super::Message) (over the
//! mutual-TLS join), the node tags every beat with it and the head tags its answer.
//!
//! A datagram is the magic `imgB`, a version byte, the kind (beat or ack), the node id,
//! the session and the beat's `seq` (little-endian `u64`s), the number of GPU samples
//! that follow (a byte, at most [`MAX_BEAT_SAMPLES`]), the samples ([`SAMPLE_LEN`] bytes
//! each: the GPU's index as a little-endian `u32`, its utilisation as a byte, 0 to 100 or
//! `0xFF` for unknown, and its memory in use as a little-endian `u64`, `u64::MAX` for
//! unknown), then HMAC-SHA256 of everything before it. An ack, and a beat of a node
//! without NVML, carries no sample: [`BEAT_LEN`] bytes. Nothing here does I/O:
//! [`BeatPacket::seal`] and [`BeatPacket::seal_with_samples`] make a datagram,
//! [`BeatPacket::read`] reads one's fields unverified (to find the key; the whole layout
//! is checked, so [`BeatPacket::read_samples`] cannot fail after it), [`BeatPacket::verify`]
//! checks its tag, and [`BeatGate`] adds the replay check (a beat is taken only with a
//! `seq` above every one taken before in the session).
//!
//! Versions: [`BEAT_VERSION`] changes with the layout, and a datagram of another version
//! is garbage (its node then beats over QUIC, whose frames carry
//! [`WIRE_VERSION`](super::WIRE_VERSION)). Version 1 had no sample count (62 bytes).

use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

use super::{GpuSampleWire, GpuUseWire};

/// The first bytes of every heartbeat datagram.
pub const BEAT_MAGIC: [u8; 4] = *b"imgB";
/// The layout's version; a datagram of another is refused.
pub const BEAT_VERSION: u8 = 2;
/// Bytes of the tag (a whole HMAC-SHA256).
const TAG_LEN: usize = 32;
/// Bytes before the samples: magic, version, kind, node, session, seq, sample count.
const HEADER_LEN: usize = 4 + 1 + 1 + 3 * 8 + 1;
/// Where the sample count is.
const COUNT_AT: usize = HEADER_LEN - 1;
/// Bytes of one GPU sample: index (`u32`), utilisation (`u8`), memory used (`u64`).
pub const SAMPLE_LEN: usize = 4 + 1 + 8;
/// The most GPU samples one beat carries; a node's further GPUs are left out.
pub const MAX_BEAT_SAMPLES: usize = 64;
/// Bytes of a datagram without samples: every ack, and a beat that carries none.
pub const BEAT_LEN: usize = HEADER_LEN + TAG_LEN;
/// Bytes of the longest datagram (a beat with [`MAX_BEAT_SAMPLES`] samples; 895): a
/// reader's buffer needs one more, to tell a longer datagram from it.
pub const MAX_BEAT_LEN: usize = BEAT_LEN + MAX_BEAT_SAMPLES * SAMPLE_LEN;
/// Bytes of a session key.
pub const BEAT_KEY_LEN: usize = 32;
/// The utilisation byte of a sample that has none.
const UNKNOWN_PERCENT: u8 = 0xFF;
/// The memory of a sample that has none.
const UNKNOWN_BYTES: u64 = u64::MAX;

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
    #[error("not a heartbeat datagram ({len} bytes: too short, or magic or version wrong)")]
    Garbage { len: usize },
    #[error(
        "malformed heartbeat datagram ({len} bytes): {samples} gpu samples declared, or a bad one"
    )]
    BadSamples { len: usize, samples: u8 },
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
            BeatError::BadSamples { .. } => "bad samples",
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
    /// The datagram of this packet without samples (every ack), tagged with `key`.
    pub fn seal(&self, key: &hmac::Key) -> [u8; BEAT_LEN] {
        let mut datagram = [0u8; BEAT_LEN];
        self.write_header(&mut datagram, 0);
        let tag = hmac::sign(key, &datagram[..HEADER_LEN]);
        datagram[HEADER_LEN..].copy_from_slice(tag.as_ref());
        datagram
    }

    /// The datagram of this packet with `samples` (the first [`MAX_BEAT_SAMPLES`] of
    /// them), tagged with `key`. A utilisation above 100 is sent as 100.
    pub fn seal_with_samples(&self, samples: &[GpuSampleWire], key: &hmac::Key) -> Vec<u8> {
        let samples = &samples[..samples.len().min(MAX_BEAT_SAMPLES)];
        let body = HEADER_LEN + samples.len() * SAMPLE_LEN;
        let mut datagram = vec![0u8; body + TAG_LEN];
        // At most MAX_BEAT_SAMPLES (64), so the count fits its byte.
        self.write_header(
            &mut datagram,
            u8::try_from(samples.len()).unwrap_or(u8::MAX),
        );
        for (sample, bytes) in samples
            .iter()
            .zip(datagram[HEADER_LEN..body].chunks_exact_mut(SAMPLE_LEN))
        {
            write_sample(sample, bytes);
        }
        let tag = hmac::sign(key, &datagram[..body]);
        datagram[body..].copy_from_slice(tag.as_ref());
        datagram
    }

    /// The fields of `datagram`, which must be of `kind`, NOT yet verified: look up the
    /// key they name, then [`BeatPacket::verify`]. The whole layout is checked, samples
    /// included (an ack carries none).
    pub fn read(datagram: &[u8], kind: BeatKind) -> Result<BeatPacket, BeatError> {
        let len = datagram.len();
        if len < BEAT_LEN || datagram[..4] != BEAT_MAGIC || datagram[4] != BEAT_VERSION {
            return Err(BeatError::Garbage { len });
        }
        if datagram[5] != kind as u8 {
            return Err(BeatError::WrongKind {
                expected: kind,
                found: datagram[5],
            });
        }
        let samples = sample_bytes(datagram)?;
        if kind == BeatKind::Ack && !samples.is_empty() {
            return Err(BeatError::BadSamples {
                len,
                samples: datagram[COUNT_AT],
            });
        }
        Ok(BeatPacket {
            kind,
            node_id: word(datagram, 6),
            session: word(datagram, 14),
            seq: word(datagram, 22),
        })
    }

    /// The GPU samples of `datagram`, in the order sent; NOT verified: take them only
    /// from a datagram its gate took. Never fails on a datagram [`BeatPacket::read`]
    /// read.
    pub fn read_samples(datagram: &[u8]) -> Result<Vec<GpuSampleWire>, BeatError> {
        if datagram.len() < BEAT_LEN {
            return Err(BeatError::Garbage {
                len: datagram.len(),
            });
        }
        Ok(sample_bytes(datagram)?
            .chunks_exact(SAMPLE_LEN)
            .filter_map(read_sample)
            .collect())
    }

    /// Checks the tag of `datagram` (already [`BeatPacket::read`]) against `key`, in
    /// constant time.
    pub fn verify(datagram: &[u8], key: &hmac::Key) -> Result<(), BeatError> {
        let Some(body) = datagram
            .len()
            .checked_sub(TAG_LEN)
            .filter(|&body| body >= HEADER_LEN)
        else {
            return Err(BeatError::Garbage {
                len: datagram.len(),
            });
        };
        hmac::verify(key, &datagram[..body], &datagram[body..]).map_err(|_| BeatError::BadTag)
    }

    /// The acknowledgement of this beat, the same fields of the other kind.
    pub fn ack(&self) -> BeatPacket {
        BeatPacket {
            kind: BeatKind::Ack,
            ..*self
        }
    }

    /// Writes the header, with `samples` as the sample count, at the start of `datagram`.
    fn write_header(&self, datagram: &mut [u8], samples: u8) {
        datagram[..4].copy_from_slice(&BEAT_MAGIC);
        datagram[4] = BEAT_VERSION;
        datagram[5] = self.kind as u8;
        datagram[6..14].copy_from_slice(&self.node_id.to_le_bytes());
        datagram[14..22].copy_from_slice(&self.session.to_le_bytes());
        datagram[22..30].copy_from_slice(&self.seq.to_le_bytes());
        datagram[COUNT_AT] = samples;
    }
}

/// The samples' bytes of a datagram of at least [`BEAT_LEN`] bytes, once its length
/// agrees with its sample count (at most [`MAX_BEAT_SAMPLES`]) and every sample's
/// utilisation byte is a percentage or unknown.
fn sample_bytes(datagram: &[u8]) -> Result<&[u8], BeatError> {
    let count = datagram[COUNT_AT];
    let bad = BeatError::BadSamples {
        len: datagram.len(),
        samples: count,
    };
    let samples = usize::from(count);
    if samples > MAX_BEAT_SAMPLES || datagram.len() != BEAT_LEN + samples * SAMPLE_LEN {
        return Err(bad);
    }
    let bytes = &datagram[HEADER_LEN..HEADER_LEN + samples * SAMPLE_LEN];
    if bytes
        .chunks_exact(SAMPLE_LEN)
        .any(|sample| read_sample(sample).is_none())
    {
        return Err(bad);
    }
    Ok(bytes)
}

/// One sample from its [`SAMPLE_LEN`] bytes; `None` for a utilisation byte that is no
/// percentage (101 to 254).
fn read_sample(bytes: &[u8]) -> Option<GpuSampleWire> {
    let mut index = [0u8; 4];
    index.copy_from_slice(bytes.get(..4)?);
    let utilization_percent = match *bytes.get(4)? {
        UNKNOWN_PERCENT => None,
        percent @ 0..=100 => Some(percent),
        _ => return None,
    };
    let memory = word(bytes.get(5..13)?, 0);
    Some(GpuSampleWire {
        index: u32::from_le_bytes(index),
        usage: GpuUseWire {
            utilization_percent,
            memory_used_bytes: (memory != UNKNOWN_BYTES).then_some(memory),
        },
    })
}

/// Writes `sample` into its [`SAMPLE_LEN`] bytes.
fn write_sample(sample: &GpuSampleWire, bytes: &mut [u8]) {
    bytes[..4].copy_from_slice(&sample.index.to_le_bytes());
    bytes[4] = sample
        .usage
        .utilization_percent
        .map_or(UNKNOWN_PERCENT, |percent| percent.min(100));
    let memory = sample.usage.memory_used_bytes.unwrap_or(UNKNOWN_BYTES);
    bytes[5..13].copy_from_slice(&memory.to_le_bytes());
}

/// The little-endian `u64` at `at` of `bytes`, which holds it.
fn word(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(word)
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

    fn sample(index: u32, percent: Option<u8>, used: Option<u64>) -> GpuSampleWire {
        GpuSampleWire {
            index,
            usage: GpuUseWire {
                utilization_percent: percent,
                memory_used_bytes: used,
            },
        }
    }

    #[test]
    fn samples_travel_with_a_beat_and_read_back() {
        let key = BeatKey::generate().expect("random key");
        let mut gate = BeatGate::new(7, 42, &key);
        let many: Vec<GpuSampleWire> = (0..70).map(|i| sample(i, Some(1), Some(2))).collect();
        // (samples sealed, samples read back), each case a fresh beat on one gate.
        let cases: Vec<(Vec<GpuSampleWire>, Vec<GpuSampleWire>)> = vec![
            (vec![], vec![]),
            (
                vec![sample(0, Some(37), Some(12 << 30))],
                vec![sample(0, Some(37), Some(12 << 30))],
            ),
            (
                vec![
                    sample(3, None, Some(0)),
                    sample(u32::MAX, Some(0), None),
                    sample(1, Some(100), Some(u64::MAX - 1)),
                ],
                vec![
                    sample(3, None, Some(0)),
                    sample(u32::MAX, Some(0), None),
                    sample(1, Some(100), Some(u64::MAX - 1)),
                ],
            ),
            // Out of range on the way in: a percentage is at most 100, and u64::MAX
            // bytes is the mark of unknown.
            (
                vec![sample(2, Some(250), Some(u64::MAX))],
                vec![sample(2, Some(100), None)],
            ),
            (many.clone(), many[..MAX_BEAT_SAMPLES].to_vec()),
        ];
        for (seq, (sent, want)) in (1..).zip(cases) {
            let datagram = beat(seq).seal_with_samples(&sent, &key.hmac());
            assert_eq!(datagram.len(), BEAT_LEN + want.len() * SAMPLE_LEN, "{seq}");
            assert_eq!(gate.take(&datagram, BeatKind::Beat), Ok(beat(seq)), "{seq}");
            assert_eq!(BeatPacket::read_samples(&datagram), Ok(want), "{seq}");
        }
        let no_samples = beat(9).seal_with_samples(&[], &key.hmac());
        assert_eq!(no_samples, beat(9).seal(&key.hmac()).to_vec());
        assert_eq!(
            beat(1).seal_with_samples(&many, &key.hmac()).len(),
            MAX_BEAT_LEN
        );
    }

    #[test]
    fn malformed_and_truncated_beats_are_refused_clearly() {
        let key = BeatKey::generate().expect("random key").hmac();
        let two = [sample(0, Some(5), Some(1 << 20)), sample(1, None, None)];
        let whole = beat(5).seal_with_samples(&two, &key);
        let with = |at: usize, value: u8| {
            let mut datagram = whole.clone();
            datagram[at] = value;
            datagram
        };
        let garbage = |len| Err(BeatError::Garbage { len });
        let bad = |len, samples| Err(BeatError::BadSamples { len, samples });
        let mut version_1 = beat(5).seal(&key)[..].to_vec();
        version_1[4] = 1;
        version_1.remove(30);
        let ack_with_samples = {
            let mut datagram = whole.clone();
            datagram[5] = BeatKind::Ack as u8;
            datagram
        };
        // (what, datagram, kind read as, what reading it says)
        type Case = (
            &'static str,
            Vec<u8>,
            BeatKind,
            Result<BeatPacket, BeatError>,
        );
        let cases: Vec<Case> = vec![
            ("whole", whole.clone(), BeatKind::Beat, Ok(beat(5))),
            ("empty", vec![], BeatKind::Beat, garbage(0)),
            (
                "header cut",
                whole[..20].to_vec(),
                BeatKind::Beat,
                garbage(20),
            ),
            (
                "one byte short of no sample",
                whole[..BEAT_LEN - 1].to_vec(),
                BeatKind::Beat,
                garbage(BEAT_LEN - 1),
            ),
            (
                "a sample cut",
                whole[..whole.len() - 1].to_vec(),
                BeatKind::Beat,
                bad(whole.len() - 1, 2),
            ),
            (
                "a byte more",
                [whole.as_slice(), &[0]].concat(),
                BeatKind::Beat,
                bad(whole.len() + 1, 2),
            ),
            (
                "more samples declared",
                with(30, 3),
                BeatKind::Beat,
                bad(whole.len(), 3),
            ),
            (
                "fewer samples declared",
                with(30, 1),
                BeatKind::Beat,
                bad(whole.len(), 1),
            ),
            (
                "too many samples",
                with(30, 255),
                BeatKind::Beat,
                bad(whole.len(), 255),
            ),
            (
                "no percentage",
                with(HEADER_LEN + 4, 101),
                BeatKind::Beat,
                bad(whole.len(), 2),
            ),
            (
                "an ack with samples",
                ack_with_samples,
                BeatKind::Ack,
                bad(whole.len(), 2),
            ),
            (
                "version 1",
                version_1,
                BeatKind::Beat,
                garbage(BEAT_LEN - 1),
            ),
            (
                "next version",
                with(4, BEAT_VERSION + 1),
                BeatKind::Beat,
                garbage(whole.len()),
            ),
        ];
        for (what, datagram, kind, want) in cases {
            assert_eq!(BeatPacket::read(&datagram, kind), want, "{what}");
            if let Err(error) = want {
                assert!(!error.to_string().is_empty() && !error.name().is_empty());
            }
        }
        assert!(
            BeatError::BadSamples {
                len: 70,
                samples: 3
            }
            .to_string()
            .contains("3 gpu samples"),
        );
    }

    #[test]
    fn random_and_mutated_datagrams_never_panic() {
        use rand::rngs::StdRng;
        use rand::{Rng, SeedableRng};
        let key = BeatKey::generate().expect("random key");
        let whole = beat(5).seal_with_samples(
            &[sample(0, Some(5), Some(1)), sample(1, None, None)],
            &key.hmac(),
        );
        let mut rng = StdRng::seed_from_u64(31);
        for round in 0..20_000 {
            let datagram = if round % 2 == 0 {
                let mut mutated = whole.clone();
                let at = rng.random_range(0..mutated.len());
                mutated[at] = rng.random();
                mutated.truncate(rng.random_range(0..=mutated.len()));
                mutated
            } else {
                let len = rng.random_range(0..=MAX_BEAT_LEN + 1);
                (0..len).map(|_| rng.random()).collect()
            };
            let mut gate = BeatGate::new(7, 42, &key);
            for kind in [BeatKind::Beat, BeatKind::Ack] {
                let read = BeatPacket::read(&datagram, kind);
                if read.is_ok() {
                    assert!(BeatPacket::read_samples(&datagram).is_ok(), "{datagram:?}");
                }
                let _ = gate.take(&datagram, kind);
            }
            let _ = BeatPacket::read_samples(&datagram);
            let _ = BeatPacket::verify(&datagram, gate.key());
        }
    }
}
