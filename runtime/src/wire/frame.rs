//! Frames: `[u32 LE payload length][u16 LE wire version][rkyv payload]`.
//!
//! Bytes from a peer are hostile. The length is checked against the caller's limit before
//! anything is allocated for the payload, the version before the payload is read, and
//! the payload is validated (bytecheck) in an aligned copy before a [`Message`] is built
//! from it. Every failure is a [`WireError`]; nothing here panics on input.

use std::io;

use rkyv::rancor;
use rkyv::util::AlignedVec;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::messages::{Message, WIRE_VERSION};

/// Bytes before the payload: the length (u32 LE) and the version (u16 LE).
pub const HEADER_LEN: usize = 6;

/// The default limit on a frame's payload.
pub const DEFAULT_MAX_FRAME: usize = 16 << 20;

/// Payloads are read in pieces of at most this size, so a peer that announces a large
/// frame and sends little costs little memory.
const READ_CHUNK: usize = 64 << 10;

/// The alignment rkyv's archives need, with room to spare.
const ALIGN: usize = 16;

/// Why a frame could not be encoded, read or decoded.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("frame of {len} bytes exceeds the limit of {max}")]
    TooLarge { len: u64, max: usize },
    #[error("truncated frame: {got} of {expected} bytes")]
    Truncated { expected: u64, got: u64 },
    #[error("wire version {found}, expected {expected}")]
    Version { found: u16, expected: u16 },
    #[error("{extra} bytes after the frame")]
    Trailing { extra: usize },
    #[error("invalid payload: {reason}")]
    Invalid { reason: String },
    #[error("cannot encode message: {reason}")]
    Encode { reason: String },
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
}

/// Encodes `message` as one frame, header included.
pub fn encode(message: &Message) -> Result<Vec<u8>, WireError> {
    let payload = rkyv::to_bytes::<rancor::Error>(message).map_err(|error| WireError::Encode {
        reason: error.to_string(),
    })?;
    let len = u32::try_from(payload.len()).map_err(|_| WireError::TooLarge {
        len: payload.len() as u64,
        max: u32::MAX as usize,
    })?;
    let mut frame = Vec::with_capacity(HEADER_LEN + payload.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(&WIRE_VERSION.to_le_bytes());
    frame.extend_from_slice(&payload);
    Ok(frame)
}

/// Decodes exactly one frame of at most [`DEFAULT_MAX_FRAME`] payload bytes.
pub fn decode(frame: &[u8]) -> Result<Message, WireError> {
    decode_with_limit(frame, DEFAULT_MAX_FRAME)
}

/// Decodes exactly one frame whose payload is at most `max` bytes; `frame` must hold
/// that frame and nothing else.
pub fn decode_with_limit(frame: &[u8], max: usize) -> Result<Message, WireError> {
    let Some((header, rest)) = frame.split_first_chunk::<HEADER_LEN>() else {
        return Err(WireError::Truncated {
            expected: HEADER_LEN as u64,
            got: frame.len() as u64,
        });
    };
    let len = check_header(header, max)?;
    if rest.len() < len {
        return Err(WireError::Truncated {
            expected: (HEADER_LEN + len) as u64,
            got: frame.len() as u64,
        });
    }
    if rest.len() > len {
        return Err(WireError::Trailing {
            extra: rest.len() - len,
        });
    }
    let mut payload = AlignedVec::<ALIGN>::with_capacity(len);
    payload.extend_from_slice(rest);
    validate(&payload)
}

/// Writes `message` as one frame. Does not flush or finish the stream.
pub async fn write_frame<W>(writer: &mut W, message: &Message) -> Result<(), WireError>
where
    W: AsyncWrite + Unpin + ?Sized,
{
    let frame = encode(message)?;
    writer.write_all(&frame).await?;
    Ok(())
}

/// Reads one frame whose payload is at most `max` bytes. `Ok(None)` when the stream ends
/// cleanly before a frame starts; a stream that ends inside a frame is
/// [`WireError::Truncated`].
pub async fn read_frame<R>(reader: &mut R, max: usize) -> Result<Option<Message>, WireError>
where
    R: AsyncRead + Unpin + ?Sized,
{
    let mut header = [0u8; HEADER_LEN];
    let got = read_up_to(reader, &mut header).await?;
    if got == 0 {
        return Ok(None);
    }
    if got < HEADER_LEN {
        return Err(WireError::Truncated {
            expected: HEADER_LEN as u64,
            got: got as u64,
        });
    }
    let len = check_header(&header, max)?;

    // Grow with what actually arrives rather than trusting the announced length.
    let mut payload = AlignedVec::<ALIGN>::with_capacity(len.min(READ_CHUNK));
    let mut chunk = vec![0u8; len.min(READ_CHUNK)];
    while payload.len() < len {
        let want = (len - payload.len()).min(chunk.len());
        let n = reader.read(&mut chunk[..want]).await?;
        if n == 0 {
            return Err(WireError::Truncated {
                expected: (HEADER_LEN + len) as u64,
                got: (HEADER_LEN + payload.len()) as u64,
            });
        }
        payload.extend_from_slice(&chunk[..n]);
    }
    validate(&payload).map(Some)
}

/// Checks the version and the length; returns the payload length.
fn check_header(header: &[u8; HEADER_LEN], max: usize) -> Result<usize, WireError> {
    let [l0, l1, l2, l3, v0, v1] = *header;
    let found = u16::from_le_bytes([v0, v1]);
    if found != WIRE_VERSION {
        return Err(WireError::Version {
            found,
            expected: WIRE_VERSION,
        });
    }
    let len = u32::from_le_bytes([l0, l1, l2, l3]);
    match usize::try_from(len) {
        Ok(len) if len <= max => Ok(len),
        _ => Err(WireError::TooLarge {
            len: u64::from(len),
            max,
        }),
    }
}

/// Validates the archive, then builds the message from it.
fn validate(payload: &AlignedVec<ALIGN>) -> Result<Message, WireError> {
    rkyv::from_bytes::<Message, rancor::Error>(payload).map_err(|error| WireError::Invalid {
        reason: error.to_string(),
    })
}

/// Fills `buf` unless the stream ends first; returns how many bytes were read.
async fn read_up_to<R>(reader: &mut R, buf: &mut [u8]) -> io::Result<usize>
where
    R: AsyncRead + Unpin + ?Sized,
{
    let mut filled = 0;
    while filled < buf.len() {
        let n = reader.read(&mut buf[filled..]).await?;
        if n == 0 {
            break;
        }
        filled += n;
    }
    Ok(filled)
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::wire::messages::ArchivedMessage;
    use crate::wire::{ActorLabelWire, ActorStatusWire, ReservationWire, ResourcesWire};
    use crate::wire::{ClusterStatusWire, GpuWire, NodeDescription, NodeStatusWire};
    use crate::wire::{GpuSampleWire, GpuUseWire};

    fn resources() -> ResourcesWire {
        ResourcesWire {
            cpus: 64,
            memory_bytes: Some(512 << 30),
            gpus: vec![GpuWire {
                index: 0,
                name: "NVIDIA H100 80GB HBM3".into(),
                memory_bytes: None,
                uuid: "GPU-0123".into(),
            }],
        }
    }

    /// One of every message, with non-trivial contents.
    fn every_message() -> Vec<Message> {
        vec![
            Message::JoinRequest {
                token: "0123456789abcdef0123456789abcdef".into(),
                node: NodeDescription {
                    hostname: "gpu-01".into(),
                    address: "10.0.0.2:7100".into(),
                    version: "0.1.0".into(),
                    resources: resources(),
                },
            },
            Message::JoinAccepted {
                node_id: 7,
                session: u64::MAX,
                ca_cert_pem: "-----BEGIN CERTIFICATE-----".into(),
                cert_pem: "cert".into(),
                key_pem: "key".into(),
                heartbeat_ms: 1000,
                dead_after_ms: 10_000,
                beat_port: 40_000,
                beat_key: vec![9; 32],
            },
            Message::Refused {
                reason: "bad token".into(),
            },
            Message::Hello {
                node_id: 7,
                session: 3,
            },
            Message::Heartbeat {
                node_id: 7,
                session: 3,
                seq: 99,
                gpus: vec![
                    GpuSampleWire {
                        index: 3,
                        usage: GpuUseWire {
                            utilization_percent: Some(37),
                            memory_used_bytes: Some(12 << 30),
                        },
                    },
                    GpuSampleWire {
                        index: 0,
                        usage: GpuUseWire::default(),
                    },
                ],
            },
            Message::HeartbeatAck { seq: 99 },
            Message::HeartbeatRefused {
                seq: 99,
                reason: "unknown session: join again".into(),
            },
            Message::Leave {
                node_id: 7,
                session: 3,
            },
            Message::StatusRequest,
            Message::StatusReply {
                status: ClusterStatusWire {
                    session: 3,
                    nodes: vec![NodeStatusWire {
                        node_id: 7,
                        address: "10.0.0.2:7100".into(),
                        hostname: "gpu-01".into(),
                        state: "alive".into(),
                        uptime_ms: 12,
                        last_heartbeat_ms_ago: 3,
                        resources: resources(),
                        gpu_use: vec![GpuUseWire {
                            utilization_percent: Some(100),
                            memory_used_bytes: None,
                        }],
                    }],
                    reservations: vec![ReservationWire {
                        node_id: 7,
                        owner: "actor:1".into(),
                        resources: vec![("gpu".into(), 1), ("cpu".into(), 4)],
                    }],
                    actors: vec![ActorStatusWire {
                        actor_id: 1,
                        kind: "trainer".into(),
                        node_id: 7,
                        state: "running".into(),
                        label: Some(ActorLabelWire {
                            job: "run-1".into(),
                            rank: 0,
                        }),
                    }],
                },
            },
            Message::StopRequest { all: true },
            Message::Ack,
            Message::Error {
                message: "é → ✓".into(),
            },
            Message::ActorSpawn {
                kind: "trainer".into(),
                args: vec![0, 1, 2, 255],
                resources: vec![("gpu".into(), 1)],
                placement: "spread".into(),
                process_group: "rank0".into(),
                max_restarts: 3,
                restart_backoff_ms: 500,
                label: Some(ActorLabelWire {
                    job: "run-1".into(),
                    rank: 3,
                }),
                detached: true,
            },
            Message::ActorSpawned {
                actor_id: 1,
                node_id: 7,
                address: "10.0.0.7:7070".into(),
            },
            Message::ActorStart {
                actor_id: 1,
                kind: "trainer".into(),
                args: vec![4; 10],
                process_group: String::new(),
                gpus: vec![0, 3],
            },
            Message::ActorStop {
                actor_id: 1,
                kill: true,
            },
            Message::ActorLocate { actor_id: 1 },
            Message::ActorLocation {
                actor_id: 1,
                node_id: 7,
                address: "[::1]:7071".into(),
                state: "restarting".into(),
                reason: "panicked in step".into(),
                origin: crate::wire::ORIGIN_HERE,
            },
            Message::ActorEvents {
                after_seq: 10,
                wait_ms: 1000,
            },
            Message::ActorEventList {
                events: vec![crate::wire::ActorEventWire {
                    seq: 11,
                    actor_id: 1,
                    node_id: 7,
                    kind: "restarting".into(),
                    reason: "worker killed by signal 9 (SIGKILL)".into(),
                    origin: crate::wire::ORIGIN_WORKER_EXIT,
                }],
                missed: true,
            },
            Message::ActorCall {
                actor_id: 1,
                call_id: 2,
                method: "step".into(),
                payload: vec![9; 1000],
                timeout_ms: 5000,
            },
            Message::ActorReply {
                call_id: 2,
                result: Ok(vec![1, 2, 3]),
            },
            Message::ActorReply {
                call_id: 3,
                result: Err("out of memory".into()),
            },
            Message::ActorTell {
                actor_id: 1,
                method: "stop".into(),
                payload: Vec::new(),
            },
            Message::ActorFailed {
                actor_id: 1,
                reason: "lost its ring peer".into(),
                origin: crate::wire::ORIGIN_ELSEWHERE,
            },
            Message::ActorError {
                actor_id: 1,
                cause: "unknown".into(),
                message: "no actor 1 here".into(),
                delivered: false,
                origin: crate::wire::ORIGIN_HERE,
            },
            Message::ActorEnded {
                actor_id: 1,
                node_id: 7,
                outcome: "failed".into(),
                reason: "panicked in step: out of memory".into(),
                origin: crate::wire::ORIGIN_NODE_LOST,
            },
            Message::ActorOutput {
                actor_id: 1,
                lines: 1000,
            },
            Message::ActorOutputLines {
                actor_id: 1,
                lines: vec!["INFO loader ready".into(), String::new()],
                own_process: true,
            },
        ]
    }

    fn frame(len: u32, version: u16, payload: &[u8]) -> Vec<u8> {
        let mut bytes = len.to_le_bytes().to_vec();
        bytes.extend_from_slice(&version.to_le_bytes());
        bytes.extend_from_slice(payload);
        bytes
    }

    /// Decodes `bytes` both ways (in memory and from a stream) with a limit of `max`.
    fn decode_both(
        bytes: &[u8],
        max: usize,
    ) -> (
        Result<Message, WireError>,
        Result<Option<Message>, WireError>,
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a current-thread runtime");
        let streamed = runtime.block_on(async {
            let mut reader = bytes;
            read_frame(&mut reader, max).await
        });
        (decode_with_limit(bytes, max), streamed)
    }

    #[test]
    fn every_message_round_trips() {
        for message in every_message() {
            let bytes = encode(&message).expect("encode");
            assert_eq!(decode(&bytes).expect("decode"), message);
            let (_, streamed) = decode_both(&bytes, DEFAULT_MAX_FRAME);
            assert_eq!(streamed.expect("read").as_ref(), Some(&message));
        }
    }

    #[test]
    fn frames_follow_each_other_on_a_stream_and_end_cleanly() {
        let messages = every_message();
        let mut bytes = Vec::new();
        for message in &messages {
            bytes.extend(encode(message).expect("encode"));
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a current-thread runtime");
        let read = runtime.block_on(async {
            let mut reader = bytes.as_slice();
            let mut read = Vec::new();
            while let Some(message) = read_frame(&mut reader, DEFAULT_MAX_FRAME).await? {
                read.push(message);
            }
            Ok::<_, WireError>(read)
        });
        assert_eq!(read.expect("read"), messages);
    }

    /// What a bad frame must be refused as.
    #[derive(Debug)]
    enum Expect {
        Truncated,
        TooLarge,
        Version,
        Invalid,
        /// `read_frame` only: a clean end of stream.
        CleanEnd,
    }

    fn matches(error: &WireError, expect: &Expect) -> bool {
        matches!(
            (error, expect),
            (WireError::Truncated { .. }, Expect::Truncated)
                | (WireError::TooLarge { .. }, Expect::TooLarge)
                | (WireError::Version { .. }, Expect::Version)
                | (WireError::Invalid { .. }, Expect::Invalid)
        )
    }

    #[test]
    fn bad_frames_are_refused_with_the_right_error() {
        let good = encode(&Message::HeartbeatAck { seq: 5 }).expect("encode");
        let payload = &good[HEADER_LEN..];
        let len = payload.len() as u32;
        // The root (the enum, its tag first) sits at the end of the archive.
        let mut unknown_variant = good.clone();
        let tag = good.len() - std::mem::size_of::<ArchivedMessage>();
        unknown_variant[tag] = 0xEE;

        // (case, bytes, limit, decode's verdict, read_frame's verdict)
        let cases: Vec<(&str, Vec<u8>, usize, Expect, Expect)> = vec![
            (
                "empty",
                Vec::new(),
                1024,
                Expect::Truncated,
                Expect::CleanEnd,
            ),
            (
                "half a header",
                vec![1, 0, 0],
                1024,
                Expect::Truncated,
                Expect::Truncated,
            ),
            (
                "header only",
                frame(len, WIRE_VERSION, &[]),
                1024,
                Expect::Truncated,
                Expect::Truncated,
            ),
            (
                "short payload",
                frame(len, WIRE_VERSION, &payload[..payload.len() - 1]),
                1024,
                Expect::Truncated,
                Expect::Truncated,
            ),
            (
                "over the limit",
                good.clone(),
                payload.len() - 1,
                Expect::TooLarge,
                Expect::TooLarge,
            ),
            (
                "huge length",
                frame(u32::MAX, WIRE_VERSION, payload),
                DEFAULT_MAX_FRAME,
                Expect::TooLarge,
                Expect::TooLarge,
            ),
            (
                "old version",
                frame(len, 0, payload),
                1024,
                Expect::Version,
                Expect::Version,
            ),
            (
                "future version",
                frame(len, WIRE_VERSION + 1, payload),
                1024,
                Expect::Version,
                Expect::Version,
            ),
            (
                "empty payload",
                frame(0, WIRE_VERSION, &[]),
                1024,
                Expect::Invalid,
                Expect::Invalid,
            ),
            (
                "all ones",
                frame(len, WIRE_VERSION, &vec![0xFF; payload.len()]),
                1024,
                Expect::Invalid,
                Expect::Invalid,
            ),
            (
                "unknown variant",
                unknown_variant,
                1024,
                Expect::Invalid,
                Expect::Invalid,
            ),
            (
                "text",
                frame(5, WIRE_VERSION, b"hello"),
                1024,
                Expect::Invalid,
                Expect::Invalid,
            ),
        ];
        for (case, bytes, max, in_memory, streamed) in cases {
            let (decoded, read) = decode_both(&bytes, max);
            match decoded {
                Err(error) => assert!(
                    matches(&error, &in_memory),
                    "{case}: decode gave {error}, expected {in_memory:?}"
                ),
                Ok(message) => panic!("{case}: decode accepted {message:?}"),
            }
            match (read, &streamed) {
                (Ok(None), Expect::CleanEnd) => {}
                (Err(error), expect) => assert!(
                    matches(&error, expect),
                    "{case}: read_frame gave {error}, expected {expect:?}"
                ),
                (other, expect) => panic!("{case}: read_frame gave {other:?}, expected {expect:?}"),
            }
        }
    }

    #[test]
    fn trailing_bytes_are_refused_in_memory() {
        let mut bytes = encode(&Message::Ack).expect("encode");
        bytes.push(0);
        assert!(matches!(
            decode(&bytes),
            Err(WireError::Trailing { extra: 1 })
        ));
    }

    #[test]
    fn errors_read_as_short_messages() {
        let error = decode(&frame(u32::MAX, WIRE_VERSION, &[])).expect_err("too large");
        assert_eq!(
            error.to_string(),
            "frame of 4294967295 bytes exceeds the limit of 16777216"
        );
        let old = WIRE_VERSION - 1;
        let error = decode(&frame(0, old, &[])).expect_err("version");
        assert_eq!(
            error.to_string(),
            format!("wire version {old}, expected {WIRE_VERSION}")
        );
    }

    #[test]
    fn random_and_mutated_bytes_never_panic() {
        let mut rng = StdRng::seed_from_u64(0x1f2e3d4c);
        let valid: Vec<Vec<u8>> = every_message()
            .iter()
            .map(|message| encode(message).expect("encode"))
            .collect();
        let mut accepted = 0;
        for round in 0..4000 {
            let bytes = if round % 2 == 0 {
                // Random bytes behind a plausible header, so they reach the validator.
                let len = rng.random_range(0..512usize);
                let mut payload = vec![0u8; len];
                rng.fill(payload.as_mut_slice());
                frame(len as u32, WIRE_VERSION, &payload)
            } else {
                // A valid frame with a few bytes of its payload changed.
                let mut bytes = valid[rng.random_range(0..valid.len())].clone();
                for _ in 0..rng.random_range(1..4) {
                    let at = rng.random_range(HEADER_LEN..bytes.len());
                    bytes[at] = rng.random();
                }
                bytes
            };
            let (decoded, read) = decode_both(&bytes, DEFAULT_MAX_FRAME);
            if let Ok(message) = &decoded {
                accepted += 1;
                // Whatever validates must be a message that encodes again.
                encode(message).expect("a decoded message encodes");
            }
            assert_eq!(
                decoded.is_ok(),
                matches!(read, Ok(Some(_))),
                "both ways agree"
            );
        }
        // Most mutations hit string bytes or integers and still validate; random
        // payloads almost never do. Both kinds of outcome must have happened.
        assert!(accepted > 0 && accepted < 4000, "accepted {accepted}");
    }
}
