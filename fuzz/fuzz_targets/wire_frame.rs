//! Fuzzes the wire frame decoder: any bytes, in memory or as a stream of frames, must
//! give messages or a `WireError`, never a panic, a hang or an allocation beyond the
//! frame limit.
//!
//!     cargo +nightly fuzz run wire_frame -- -max_total_time=60
#![no_main]

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use libfuzzer_sys::fuzz_target;
use runtime::wire::{self, WireError};

/// Small, so that a forged length cannot make the reader allocate much.
const MAX_FRAME: usize = 1 << 20;

fuzz_target!(|data: &[u8]| {
    if let Ok(message) = wire::decode_with_limit(data, MAX_FRAME) {
        // Not necessarily the same bytes (padding is not checked), but the same message.
        let again = wire::encode(&message).expect("a decoded message encodes");
        let decoded = wire::decode(&again).expect("an encoded message decodes");
        assert_eq!(decoded, message, "encoding and decoding round-trip");
    }
    let _ = wire::decode(data);

    // As a stream: frames one after the other until the end or an error.
    let mut reader = data;
    let mut frames = 0usize;
    loop {
        match ready(wire::read_frame(&mut reader, MAX_FRAME)) {
            Ok(Some(_)) => frames += 1,
            Ok(None) => break,
            Err(WireError::Io(error)) => panic!("no i/o error from a slice: {error}"),
            Err(error) => {
                let _ = error.to_string();
                break;
            }
        }
        assert!(
            frames <= data.len() / wire::HEADER_LEN,
            "a frame from nowhere"
        );
    }
});

/// Runs a future that never waits: reading from a slice is always ready.
fn ready<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    match future
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
    {
        Poll::Ready(output) => output,
        Poll::Pending => panic!("reading a slice never waits"),
    }
}
