//! What the in-process daemon tests share: the time limit on every wait, fast membership,
//! and the resources of a simulated node.

use std::future::Future;
use std::time::Duration;

// Each test binary uses part of these.
#[allow(dead_code)]
pub mod cluster;
#[allow(dead_code)]
pub mod net;

use runtime::{DiscoverOptions, NodeResources, VisibleDevices, discover};

/// Every wait of a test finishes within this, or the test fails.
pub const LIMIT: Duration = Duration::from_secs(30);
/// Fast membership, so that failure detection is seen quickly.
pub const HEARTBEAT_MS: u64 = 50;
pub const DEAD_AFTER_MS: u64 = 500;

/// `future`, or a panic naming `what` after [`LIMIT`].
pub async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    match tokio::time::timeout(LIMIT, future).await {
        Ok(value) => value,
        Err(_) => panic!("{what}: not done within {LIMIT:?}"),
    }
}

/// What a node of `cpus` CPUs and `gpus` claimed GPUs offers (the machine's GPUs hidden).
pub fn resources(name: &str, cpus: usize, gpus: usize) -> NodeResources {
    let mut resources = discover(&DiscoverOptions {
        num_cpus: Some(cpus),
        num_gpus: Some(gpus),
        visible_devices: VisibleDevices::Set("-1".to_owned()),
    });
    resources.hostname = Some(name.to_owned());
    resources
}
