//! The hang doctor's first question: which rank holds the others up, and why. Every rank
//! waits in the gradient average for the slowest; what differs between ranks is the work
//! before it, waiting for data and forward/backward. A rank whose own work took longer
//! than the quickest rank's by more than a threshold is late, and the part that grew
//! most says why.

use serde::{Deserialize, Serialize};

use super::protocol::StepTiming;

/// Why a late rank was late.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LateCause {
    /// Its loader did not have the batch ready: reading or decoding is its bottleneck.
    WaitingForData,
    /// Its forward and backward pass took longer: a slower or busier device.
    Computing,
}

impl LateCause {
    /// What it means, for a person.
    pub fn explain(self) -> &'static str {
        match self {
            Self::WaitingForData => {
                "waiting for data: its loader is the bottleneck (more loader workers, local \
                 copies of the shards, or a faster source)"
            }
            Self::Computing => {
                "computing: its forward and backward pass is slower (a busier machine or a \
                 slower device)"
            }
        }
    }
}

/// A rank that held the others up in one step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Late {
    pub rank: usize,
    /// How much longer its own work took than the quickest rank's, in seconds.
    pub behind_s: f64,
    pub cause: LateCause,
}

/// The latest rank of one step, from every rank's timing (in rank order), when it is
/// behind the quickest by more than `threshold_s`; none with one rank or a threshold
/// of 0.
pub fn late_rank(timings: &[StepTiming], threshold_s: f64) -> Option<Late> {
    if timings.len() < 2 || threshold_s <= 0.0 {
        return None;
    }
    let own = |t: &StepTiming| t.data_wait_s + t.compute_s;
    let quickest = timings.iter().map(own).fold(f64::INFINITY, f64::min);
    let (rank, latest) = timings
        .iter()
        .enumerate()
        .max_by(|a, b| own(a.1).total_cmp(&own(b.1)))?;
    let behind_s = own(latest) - quickest;
    if behind_s <= threshold_s {
        return None;
    }
    let least =
        |part: fn(&StepTiming) -> f64| timings.iter().map(part).fold(f64::INFINITY, f64::min);
    let extra_wait = latest.data_wait_s - least(|t| t.data_wait_s);
    let extra_compute = latest.compute_s - least(|t| t.compute_s);
    let cause = if extra_wait >= extra_compute {
        LateCause::WaitingForData
    } else {
        LateCause::Computing
    };
    Some(Late {
        rank,
        behind_s,
        cause,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing(data_wait_s: f64, compute_s: f64) -> StepTiming {
        StepTiming {
            seconds: data_wait_s + compute_s + 0.1,
            data_wait_s,
            compute_s,
            allreduce_s: 0.1,
        }
    }

    #[test]
    fn the_late_rank_and_its_cause() {
        let even = [timing(0.01, 0.20), timing(0.02, 0.21), timing(0.01, 0.19)];
        assert_eq!(late_rank(&even, 1.0), None, "no rank is late");
        let starved = [timing(0.01, 0.20), timing(3.00, 0.20), timing(0.01, 0.20)];
        let late = late_rank(&starved, 1.0).expect("rank 1 is late");
        assert_eq!((late.rank, late.cause), (1, LateCause::WaitingForData));
        assert!((late.behind_s - 2.99).abs() < 1e-9, "{late:?}");
        let slow = [timing(0.01, 2.50), timing(0.01, 0.20)];
        let late = late_rank(&slow, 1.0).expect("rank 0 is late");
        assert_eq!((late.rank, late.cause), (0, LateCause::Computing));
        assert_eq!(late_rank(&slow, 0.0), None, "0 turns it off");
        assert_eq!(
            late_rank(&slow[..1], 1.0),
            None,
            "one rank waits for nobody"
        );
    }
}
