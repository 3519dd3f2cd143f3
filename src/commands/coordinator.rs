//! Calling a job's coordinator actor from the command line: what `imgrun jobs`, `logs`,
//! `cancel` and a submitted `imgrun train` share. A leaf of `src/commands`.

use actors::job::{COORDINATOR_CALL_TIMEOUT, CoordinatorMethod, call_coordinator};
use runtime::ActorRef;

/// Calls method `M` of a job's coordinator.
pub(crate) async fn call<M: CoordinatorMethod>(
    actor: &ActorRef,
    request: &M,
) -> anyhow::Result<M::Reply> {
    Ok(call_coordinator(actor, request, COORDINATOR_CALL_TIMEOUT).await?)
}
