//! Where a trainer is right now, readable while it is busy: the trainer writes its phase
//! into its process's board as it goes (waiting for data, computing, averaging, ...), and
//! the rank's monitor, a second actor in the same worker process, reads it and answers
//! at any time, even while the trainer is stuck in a step. That is how the job tells
//! which rank holds the others up while it happens, and `imgrun jobs JOB --ranks` shows
//! each rank's phase.

use std::sync::Mutex;
use std::time::Instant;

use runtime::{Actor, ActorRegistry, MethodError};

use super::protocol::TrainerMethod;

/// The monitor's methods and what they answer (with the trainer's, in `protocol.rs`).
pub use super::protocol::{AbortRequest, Phase, PhaseRequest, RankPhase, ShardRead};

/// The monitor's actor kind.
pub const MONITOR_KIND: &str = "trainer-monitor";

struct Board {
    rank: u32,
    phase: Phase,
    since: Instant,
    epoch: Option<u64>,
    step: u64,
    bucket: Option<(usize, usize)>,
    /// The loader of the epoch in progress.
    reading: Option<std::sync::Arc<pipelines::ReadingNow>>,
    /// Seconds waited for data in `epoch` before the current phase.
    waited: f64,
}

impl Board {
    /// Seconds waited for data in the epoch, the current phase included.
    fn data_wait(&self) -> f64 {
        let now = if self.phase == Phase::WaitingForData {
            self.since.elapsed().as_secs_f64()
        } else {
            0.0
        };
        self.waited + now
    }
}

/// The board of this process: one trainer per worker process (each rank has a process
/// group of its own).
static BOARD: Mutex<Option<Board>> = Mutex::new(None);

fn board() -> std::sync::MutexGuard<'static, Option<Board>> {
    BOARD.lock().unwrap_or_else(|e| e.into_inner())
}

/// The trainer of `rank` starts in this process.
pub(crate) fn start(rank: u32) {
    *board() = Some(Board {
        rank,
        phase: Phase::Starting,
        since: Instant::now(),
        epoch: None,
        step: 0,
        bucket: None,
        reading: None,
        waited: 0.0,
    });
}

/// The epoch in progress reads through `reading` (none between epochs).
pub(crate) fn reading(reading: Option<std::sync::Arc<pipelines::ReadingNow>>) {
    if let Some(board) = board().as_mut() {
        board.reading = reading;
    }
}

/// The trainer enters `phase` now.
pub(crate) fn enter(phase: Phase) {
    if let Some(board) = board().as_mut()
        && board.phase != phase
    {
        board.waited = board.data_wait();
        board.phase = phase;
        board.since = Instant::now();
        board.bucket = None;
    }
}

/// The trainer waits for gradient bucket `bucket` (0-based) of `buckets` to be averaged.
pub(crate) fn averaging(bucket: usize, buckets: usize) {
    enter(Phase::Averaging);
    if let Some(board) = board().as_mut() {
        board.bucket = Some((bucket + 1, buckets));
    }
}

/// The trainer works on global step `step` of `epoch`.
pub(crate) fn at(epoch: u64, step: u64) {
    if let Some(board) = board().as_mut() {
        if board.epoch != Some(epoch) {
            board.waited = 0.0;
            if board.phase == Phase::WaitingForData {
                board.since = Instant::now();
            }
        }
        board.epoch = Some(epoch);
        board.step = step;
    }
}

/// Where this process's trainer is, if one runs here.
pub fn now() -> Option<RankPhase> {
    board().as_ref().map(|board| RankPhase {
        rank: board.rank,
        phase: board.phase,
        seconds: board.since.elapsed().as_secs_f64(),
        epoch: board.epoch,
        step: board.step,
        bucket: board.bucket,
        data_wait_s: board.data_wait(),
        reading: board
            .reading
            .as_ref()
            .map(|reading| {
                reading
                    .snapshot()
                    .into_iter()
                    .map(|r| ShardRead {
                        worker: r.worker,
                        url: r.url,
                        bytes: r.bytes,
                    })
                    .collect()
            })
            .unwrap_or_default(),
    })
}

/// Registers the monitor's kind.
pub fn register(registry: &mut ActorRegistry) {
    registry.register(MONITOR_KIND, |_ctx, _args| {
        Ok(Box::new(Monitor) as Box<dyn Actor>)
    });
}

/// Answers [`PhaseRequest`] from the board of its process.
struct Monitor;

impl Actor for Monitor {
    fn call(&mut self, method: &str, _payload: &[u8]) -> Result<Vec<u8>, MethodError> {
        if method == AbortRequest::NAME {
            super::comm::abort_all();
            return serde_json::to_vec(&()).map_err(|error| MethodError::new(error.to_string()));
        }
        if method != PhaseRequest::NAME {
            return Err(MethodError::new(format!(
                "a trainer's monitor has no method '{method}' (it has {}, {})",
                PhaseRequest::NAME,
                AbortRequest::NAME
            )));
        }
        let phase = now().ok_or_else(|| {
            MethodError::new(
                "no trainer runs in this process: spawn the monitor in its rank's group",
            )
        })?;
        serde_json::to_vec(&phase).map_err(|error| MethodError::new(error.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_board_follows_the_trainer() {
        start(3);
        let first = now().expect("started");
        assert_eq!(
            (first.rank, first.phase, first.step),
            (3, Phase::Starting, 0)
        );
        at(1, 12);
        enter(Phase::WaitingForData);
        std::thread::sleep(std::time::Duration::from_millis(20));
        // Entering the same phase again keeps its start.
        enter(Phase::WaitingForData);
        let waiting = now().expect("running");
        assert_eq!(waiting.phase, Phase::WaitingForData);
        assert_eq!((waiting.epoch, waiting.step), (Some(1), 12));
        assert!(waiting.seconds >= 0.02, "{waiting:?}");
        assert!(waiting.data_wait_s >= 0.02, "{waiting:?}");
        enter(Phase::Computing);
        let computing = now().expect("running");
        assert!(computing.seconds < waiting.seconds);
        // The wait is kept after it ends, and summed over the epoch's waits.
        assert!(
            computing.data_wait_s >= waiting.data_wait_s,
            "{computing:?}"
        );
        enter(Phase::WaitingForData);
        std::thread::sleep(std::time::Duration::from_millis(10));
        let again = now().expect("running").data_wait_s;
        assert!(again >= computing.data_wait_s + 0.01, "{again}");
        // A new epoch starts its count afresh.
        enter(Phase::Computing);
        at(2, 13);
        assert_eq!(now().expect("running").data_wait_s, 0.0);
        averaging(2, 5);
        assert_eq!(
            now().expect("running").describe(),
            "averaging (bucket 3 of 5)"
        );
        enter(Phase::Computing);
        assert_eq!(now().expect("running").bucket, None);
        let mut monitor = Monitor;
        let reply = monitor.call("phase", b"{}").expect("phase");
        let read: RankPhase = serde_json::from_slice(&reply).expect("json");
        assert_eq!(read.phase, Phase::Computing);
        assert!(monitor.call("nap", b"").is_err());
    }
}
