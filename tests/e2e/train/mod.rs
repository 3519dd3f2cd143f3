//! End-to-end tests of `imgrun train`, by subject: a head and joined nodes as background
//! daemons (state folders of their own, fast heartbeats), the job's driver as a separate
//! process that connects to them, and its CPU trainers in worker processes of the
//! daemons, all on loopback, on tiny synthetic shards and the small CNN.
//!
//! Every wait is bounded; a job that does not end in time is killed and fails its test.
//! Each test stops its cluster and checks that no worker process is left.

mod basics;
mod checkpoints;
mod data;
mod elastic;
mod failures;
mod sync;

use std::collections::BTreeMap;

use serde_json::Value;

/// A resumed run's steps (each step's loss, by step) are the whole run's, each once.
fn assert_resumed_steps_match(after: &BTreeMap<u64, f64>, whole: &BTreeMap<u64, f64>) {
    assert_eq!(after.len(), whole.len(), "each step once after the resume");
    for (step, loss) in after {
        assert_eq!(Some(loss), whole.get(step), "step {step} after the resume");
    }
}

/// Global step → loss of the step records.
fn steps(records: &[Value]) -> BTreeMap<u64, f64> {
    records
        .iter()
        .filter(|r| r["kind"] == "step")
        .map(|r| {
            let step = r["step"].as_u64().expect("step");
            (step, r["loss"].as_f64().expect("loss"))
        })
        .collect()
}
