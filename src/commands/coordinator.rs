//! Calling a job's coordinator actor from the command line: what `imgrun jobs`, `logs`,
//! `cancel` and a submitted `imgrun train` share. A leaf of `src/commands`.

use std::time::Duration;

use actors::job::CoordinatorMethod;
use anyhow::Context;
use runtime::ActorRef;

/// How long one call to a coordinator may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Calls method `M` of a job's coordinator.
pub(crate) async fn call<M: CoordinatorMethod>(
    actor: &ActorRef,
    request: &M,
) -> anyhow::Result<M::Reply> {
    let payload = serde_json::to_vec(request).context("encoding a request")?;
    let bytes = actor
        .call(M::NAME, payload, CALL_TIMEOUT)
        .await
        .with_context(|| format!("asking the job's coordinator ({})", M::NAME))?;
    serde_json::from_slice(&bytes)
        .with_context(|| format!("the job's coordinator answered {} badly", M::NAME))
}
