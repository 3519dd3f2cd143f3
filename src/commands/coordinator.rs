//! Calling a job's coordinator actor from the command line: what `imgrun jobs`, `logs`,
//! `cancel` and a submitted `imgrun train` share. A leaf of `src/commands`.

use actors::job::{COORDINATOR_CALL_TIMEOUT, CoordinatorMethod, JobHandle, call_coordinator};

/// Calls method `M` of a job (its coordinator, or the archive once it has ended).
pub(crate) async fn call<M: CoordinatorMethod>(
    actor: &JobHandle,
    request: &M,
) -> anyhow::Result<M::Reply> {
    Ok(call_coordinator(actor, request, COORDINATOR_CALL_TIMEOUT).await?)
}
