//! Whether a job's CUDA trainers average gradients through NCCL: each rank loads the
//! library and takes rank 0's id, joins the communicator and checks a sum and a
//! broadcast, and after each stage the ranks agree over imgrun's ring, so that all switch
//! or none does.

use std::time::Duration;

use runtime::MethodError;
use tch::{Device, Kind, Tensor};

use super::comm::ring_failure;
use super::ddp::GradSync;
use super::nccl;

/// What one rank brings to the negotiation.
pub(super) struct Negotiating {
    pub rank: u32,
    pub world: usize,
    pub device: Device,
    /// `train.allreduce = "nccl"`: a failed stage fails the rank.
    pub required: bool,
    /// This job's gradients may go through NCCL on this rank (CUDA, and not `"ring"`).
    pub may_use: bool,
    /// Why rank 0 made no NCCL id.
    pub problem: Option<String>,
    /// How long joining the communicator may take before it is aborted
    /// ([`init_timeout`]).
    pub init_timeout: Duration,
}

/// How long a rank waits for its NCCL communicator to start: half the job's step timeout
/// (`train.step_timeout_secs`, which the job's wait for `connect` also lasts), so that the
/// rank's typed timeout, and the ranks' agreement to fall back to the ring, come before
/// the job gives up on the call; at least a second.
pub(super) fn init_timeout(step_timeout_secs: u64) -> Duration {
    Duration::from_millis(step_timeout_secs.saturating_mul(500).max(1000))
}

/// Moves `sync` onto NCCL when every rank can: each loads the library and takes rank
/// 0's id, joins the communicator, and checks a sum and a broadcast of known values;
/// after each stage the ranks agree over the ring, so all switch or none does. Returns
/// what averages the gradients, with why NCCL is not used when it is not. Under
/// `train.allreduce = "nccl"` a failed stage fails the rank.
pub(super) fn start_nccl(
    sync: &mut GradSync,
    this: &Negotiating,
    id: Option<&str>,
) -> Result<String, MethodError> {
    let rank = this.rank;
    let required = this.required;
    let fall_back = |stage: &str, why: String| -> Result<String, MethodError> {
        let message = format!("NCCL {stage}: {why}");
        if required {
            return Err(MethodError::fatal(format!(
                "rank {rank}: {message} (train.allreduce = \"nccl\"; \"auto\" falls back \
                 to imgrun's ring)"
            )));
        }
        tracing::warn!(rank, %message, "gradients go through imgrun's ring");
        Ok(format!("imgrun's ring ({message})"))
    };
    // Every rank gets the same id or none, so all take part in the agreement below or
    // none does, whatever device each has.
    let Some(hex) = id else {
        return match (&this.problem, this.device) {
            (Some(why), _) => fall_back("not loaded", why.clone()),
            (None, Device::Cpu) => Ok("imgrun's ring".to_string()),
            (None, _) if !this.may_use => {
                Ok("imgrun's ring (train.allreduce = \"ring\")".to_string())
            }
            (None, _) => fall_back("not loaded", "rank 0 made no unique id".to_string()),
        };
    };
    let loaded = match this.device {
        Device::Cuda(ordinal) => nccl::UniqueId::from_hex(hex)
            .and_then(|id| nccl::library().map(|lib| (lib, id, ordinal)))
            .map_err(|e| e.to_string()),
        other => Err(format!("rank {rank} runs on {other:?}")),
    };
    let (lib, id, ordinal) = match (agree(sync, rank, loaded.as_ref().err())?, loaded) {
        (None, Ok(loaded)) => loaded,
        (Some(why), _) | (None, Err(why)) => return fall_back("not loaded", why),
    };
    let world = this.world;
    let joined =
        nccl::Communicator::init(lib, &id, world, rank as usize, ordinal, this.init_timeout);
    let problem = agree(sync, rank, joined.as_ref().err())?;
    let communicator = match (problem, joined) {
        (None, Ok(communicator)) => communicator,
        (Some(why), _) => return fall_back("not started", why),
        (None, Err(error)) => return fall_back("not started", error.to_string()),
    };
    let checked = self_check(&communicator, rank, world);
    if let Some(why) = agree(sync, rank, checked.err())? {
        return fall_back("failed its check", why);
    }
    let version = lib.version();
    sync.use_device_collective(Box::new(communicator));
    tracing::info!(
        rank,
        version,
        library = lib.library_name(),
        "gradients go through NCCL"
    );
    Ok(format!("NCCL {version}"))
}

/// Whether any rank saw a problem (this rank's is `problem`): the ranks sum their
/// failures over the ring. Returns the reason to report, this rank's own when it has one.
fn agree(
    sync: &mut GradSync,
    rank: u32,
    problem: Option<impl ToString>,
) -> Result<Option<String>, MethodError> {
    let mut failures = [f32::from(u8::from(problem.is_some()))];
    sync.sum(&mut failures)
        .map_err(|e| ring_failure(rank, "agreeing on NCCL", &e))?;
    Ok(match (problem, failures[0]) {
        (Some(problem), _) => Some(problem.to_string()),
        (None, n) if n > 0.0 => Some(format!("it failed on {n} other rank(s)")),
        (None, _) => None,
    })
}

/// Sums and broadcasts known values through `communicator` and checks what comes back.
fn self_check(communicator: &nccl::Communicator, rank: u32, world: usize) -> Result<(), String> {
    let device = Device::Cuda(communicator.device());
    // Odd sizes cross NCCL's chunking without being large.
    let sum = Tensor::f_full([4099], f64::from(rank + 1), (Kind::Float, device))
        .map_err(|e| e.to_string())?;
    communicator
        .all_reduce_sum(&sum)
        .map_err(|e| e.to_string())?;
    let root = Tensor::f_full([1031], f64::from(rank), (Kind::Float, device))
        .map_err(|e| e.to_string())?;
    communicator
        .broadcast(&root, 0)
        .map_err(|e| e.to_string())?;
    let want = (world * (world + 1) / 2) as f64;
    let sum_ok = sum.eq(want).all().int64_value(&[]) != 0;
    let root_ok = root.eq(0.0).all().int64_value(&[]) != 0;
    communicator.check().map_err(|e| e.to_string())?;
    match (sum_ok, root_ok) {
        (true, true) => Ok(()),
        (false, _) => Err(format!("a sum over {world} ranks did not give {want}")),
        (_, false) => Err("a broadcast from rank 0 did not arrive".to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_gets_half_the_step_timeout_and_at_least_a_second() {
        // (train.step_timeout_secs, the communicator's limit)
        let cases = [
            (600, 300_000),
            (10, 5_000),
            (3, 1_500),
            (1, 1_000),
            (0, 1_000),
        ];
        for (step, millis) in cases {
            assert_eq!(init_timeout(step), Duration::from_millis(millis), "{step}");
        }
        assert!(init_timeout(u64::MAX) > Duration::from_secs(1));
    }
}
