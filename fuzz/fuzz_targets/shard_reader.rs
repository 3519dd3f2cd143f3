//! Fuzzes the tar sample reader: any bytes, under both error policies, must give samples
//! or an error, never a panic, a hang or an unbounded allocation.
//!
//!     cargo +nightly fuzz run shard_reader -- -max_total_time=60
#![no_main]

use std::ops::ControlFlow;

use libfuzzer_sys::fuzz_target;
use pipelines::{ErrorPolicy, ReadStats, ShardSamples};

/// Small enough that a forged member size cannot make the reader allocate much.
const MAX_MEMBER: u64 = 1 << 20;

fuzz_target!(|data: &[u8]| {
    for policy in [ErrorPolicy::Fail, ErrorPolicy::Skip] {
        let mut stats = ReadStats::default();
        let mut seen = 0u64;
        let result = ShardSamples::new("fuzz.tar", data)
            .with_policy(policy)
            .with_max_member(MAX_MEMBER)
            .for_each(&mut stats, &mut |sample| {
                assert!(!sample.fields.is_empty(), "a sample has at least one field");
                assert!(
                    sample.payload_bytes() <= data.len() as u64,
                    "payload from nowhere"
                );
                seen += 1;
                ControlFlow::Continue(())
            });
        assert_eq!(stats.samples, seen, "every sample counted once");
        if policy == ErrorPolicy::Fail {
            assert_eq!(stats.skipped_samples, 0, "nothing is skipped under Fail");
        }
        if let Err(error) = result {
            assert_eq!(error.url(), "fuzz.tar");
            let _ = error.to_string();
        }
    }
});
