//! Fuzzes the UDP heartbeat datagram check: any bytes, read as a beat or as an ack and
//! taken by a session's gate, must give a refusal (a forged tag above all) or, for the
//! one sealed beat this target mixes in, an acceptance; never a panic.
//!
//!     cargo +nightly fuzz run heartbeat -- -max_total_time=60
#![no_main]

use libfuzzer_sys::fuzz_target;
use runtime::wire::{
    BEAT_LEN, BeatError, BeatGate, BeatKey, BeatKind, BeatPacket, MAX_BEAT_LEN, SAMPLE_LEN,
};

fuzz_target!(|data: &[u8]| {
    // A fixed key: the fuzzer cannot know it, so no datagram of its own may pass.
    let key = BeatKey::from_bytes(&[7; 32]).expect("32 bytes");
    let mut gate = BeatGate::new(1, 2, &key);
    for kind in [BeatKind::Beat, BeatKind::Ack] {
        let _ = BeatPacket::read(data, kind);
        match gate.take(data, kind) {
            Ok(_) => panic!("a datagram passed without the key"),
            Err(error) => {
                let _ = (error.name(), error.to_string());
                // A beat is its header and tag, then whole GPU samples.
                let fits = (BEAT_LEN..=MAX_BEAT_LEN).contains(&data.len())
                    && (data.len() - BEAT_LEN) % SAMPLE_LEN == 0;
                if !fits {
                    assert!(
                        matches!(
                            error,
                            BeatError::Garbage { .. } | BeatError::BadSamples { .. }
                        ),
                        "{error}"
                    );
                }
            }
        }
    }
    // The genuine beat still passes after whatever came before it.
    let beat = BeatPacket {
        kind: BeatKind::Beat,
        node_id: 1,
        session: 2,
        seq: u64::MAX,
    };
    let datagram = beat.seal(&key.hmac());
    assert_eq!(gate.take(&datagram, BeatKind::Beat), Ok(beat));
});
