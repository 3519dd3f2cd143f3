//! What the job counts per rank across its steps, for the views of a running job (the
//! dashboard's ranks table, `/metrics`, `imgrun jobs --json`): running totals of steps,
//! data wait and allreduce time, the time of its newest step, its step time's median and
//! 95th percentile over its last [`WINDOW`] steps, and how often it was the step's late
//! rank (the one the straggler check names).
//!
//! A pure tally: the step loop hands it every step's timings and the time, and it
//! answers [`RankTotals`]. A rank is known by its rank number; a world that shrinks or
//! grows keeps the totals of the ranks that stay.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use pipelines::{EpochStats, SourceCounts};

use crate::train::StepTiming;

/// The steps a rank's step time quantiles are taken over.
pub const WINDOW: usize = 100;

/// A rank is flagged a straggler when it was the late rank in at least this share of its
/// window's steps.
const STRAGGLER_SHARE: f64 = 0.5;

/// One rank's totals.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RankTotals {
    pub rank: u32,
    pub steps: u64,
    /// Seconds waiting for data and for the gradient average, over every step.
    pub data_wait_s: f64,
    pub allreduce_s: f64,
    /// When its newest step ended, in milliseconds since the Unix epoch.
    pub last_step_unix_ms: u64,
    /// Its step time's median and 95th percentile over its last [`WINDOW`] steps.
    pub step_p50_s: f64,
    pub step_p95_s: f64,
    /// Steps it was the late rank of.
    pub late_steps: u64,
    /// Late in at least half of its last [`WINDOW`] steps.
    pub straggler: bool,
    /// What its loader served and skipped, over the job's epochs so far (since its
    /// coordinator started: a resumed job counts from its resume); without `problems`,
    /// which go to the job's lines.
    #[serde(default)]
    pub loader: EpochStats,
    /// The shards its process opened, by kind of source (its own loader's: with
    /// `data.loaders = "remote"`, the loader actors' opens are not counted here).
    #[serde(default)]
    pub sources: SourceCounts,
}

/// The running tally.
#[derive(Debug, Clone, Default)]
pub struct RankTally {
    ranks: BTreeMap<u32, Tally>,
}

#[derive(Debug, Clone, Default)]
struct Tally {
    totals: RankTotals,
    /// The last [`WINDOW`] steps: their time and whether the rank was late.
    window: VecDeque<(f64, bool)>,
    /// Its loader's totals over the epochs it finished, and in the epoch it is in.
    loader_done: EpochStats,
    loader_epoch: EpochStats,
}

impl RankTally {
    /// Counts one step: `timings` by rank number, `late` the rank the straggler check
    /// named, `now_ms` when the step's figures arrived.
    pub fn step(&mut self, timings: &[(u32, StepTiming)], late: Option<u32>, now_ms: u64) {
        for (rank, timing) in timings {
            let tally = self.ranks.entry(*rank).or_default();
            let totals = &mut tally.totals;
            totals.rank = *rank;
            totals.steps += 1;
            totals.data_wait_s += timing.data_wait_s;
            totals.allreduce_s += timing.allreduce_s;
            totals.last_step_unix_ms = now_ms;
            let was_late = late == Some(*rank);
            totals.late_steps += u64::from(was_late);
            if tally.window.len() == WINDOW {
                tally.window.pop_front();
            }
            tally.window.push_back((timing.seconds, was_late));
        }
    }

    /// Rank `rank`'s process has opened `counts` shards so far.
    pub fn sourced(&mut self, rank: u32, counts: &SourceCounts) {
        let tally = self.ranks.entry(rank).or_default();
        tally.totals.rank = rank;
        tally.totals.sources = counts.clone();
    }

    /// Rank `rank`'s loader has served `epoch_so_far` in its epoch, which is over when
    /// `epoch_done`.
    pub fn loaded(&mut self, rank: u32, epoch_so_far: &EpochStats, epoch_done: bool) {
        let tally = self.ranks.entry(rank).or_default();
        tally.totals.rank = rank;
        let now = EpochStats {
            problems: Vec::new(),
            ..epoch_so_far.clone()
        };
        if epoch_done {
            tally.loader_done.merge(&now);
            tally.loader_epoch = EpochStats::default();
        } else {
            tally.loader_epoch = now;
        }
    }

    /// Every rank's totals, by rank.
    pub fn totals(&self) -> Vec<RankTotals> {
        self.ranks
            .values()
            .map(|tally| {
                let mut seconds: Vec<f64> = tally.window.iter().map(|(s, _)| *s).collect();
                seconds.sort_by(f64::total_cmp);
                let late = tally.window.iter().filter(|(_, late)| *late).count();
                RankTotals {
                    step_p50_s: quantile(&seconds, 0.5),
                    step_p95_s: quantile(&seconds, 0.95),
                    straggler: !seconds.is_empty()
                        && late as f64 >= STRAGGLER_SHARE * seconds.len() as f64,
                    loader: {
                        let mut loader = tally.loader_done.clone();
                        loader.merge(&tally.loader_epoch);
                        loader
                    },
                    ..tally.totals.clone()
                }
            })
            .collect()
    }
}

/// The `q` quantile of `sorted` (nearest rank); 0 when it is empty.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let index = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[index]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing(seconds: f64, data_wait_s: f64, allreduce_s: f64) -> StepTiming {
        StepTiming {
            seconds,
            data_wait_s,
            compute_s: seconds - data_wait_s - allreduce_s,
            allreduce_s,
        }
    }

    #[test]
    fn totals_add_up_and_quantiles_follow_the_window() {
        let mut tally = RankTally::default();
        assert!(tally.totals().is_empty());
        // Rank 1 is late at every step but the first; rank 0 never.
        for step in 0..200u64 {
            let late = (step > 0).then_some(1);
            let fast = timing(1.0 + (step % 10) as f64 * 0.1, 0.25, 0.5);
            let slow = timing(2.0, 1.0, 0.5);
            tally.step(&[(0, fast), (1, slow)], late, 1000 + step);
        }
        let totals = tally.totals();
        let (zero, one) = (&totals[0], &totals[1]);
        assert_eq!((zero.rank, one.rank), (0, 1));
        assert_eq!((zero.steps, one.steps), (200, 200));
        assert!(
            (zero.data_wait_s - 50.0).abs() < 1e-9,
            "{}",
            zero.data_wait_s
        );
        assert!(
            (one.allreduce_s - 100.0).abs() < 1e-9,
            "{}",
            one.allreduce_s
        );
        assert_eq!(zero.last_step_unix_ms, 1199);
        // Rank 0's last 100 steps take 1.0 to 1.9 s, ten of each.
        assert!((zero.step_p50_s - 1.4).abs() < 1e-9, "{}", zero.step_p50_s);
        assert!((zero.step_p95_s - 1.9).abs() < 1e-9, "{}", zero.step_p95_s);
        assert_eq!((zero.late_steps, one.late_steps), (0, 199));
        assert_eq!((zero.straggler, one.straggler), (false, true));
    }

    #[test]
    fn a_rank_that_stops_being_late_stops_being_a_straggler() {
        let mut tally = RankTally::default();
        let t = timing(1.0, 0.1, 0.1);
        for _ in 0..WINDOW {
            tally.step(&[(0, t), (1, t)], Some(1), 0);
        }
        assert!(tally.totals()[1].straggler);
        for _ in 0..WINDOW / 2 + 1 {
            tally.step(&[(0, t), (1, t)], None, 0);
        }
        let one = &tally.totals()[1];
        assert!(!one.straggler);
        assert_eq!(one.late_steps, WINDOW as u64);
    }

    #[test]
    fn quantiles_are_nearest_rank() {
        for (values, q, expected) in [
            (vec![], 0.5, 0.0),
            (vec![3.0], 0.95, 3.0),
            (vec![1.0, 2.0], 0.5, 1.0),
            (vec![1.0, 2.0, 3.0, 4.0], 0.95, 4.0),
            (vec![1.0, 2.0, 3.0, 4.0], 0.5, 2.0),
        ] {
            assert_eq!(quantile(&values, q), expected, "{values:?} {q}");
        }
    }

    #[test]
    fn loader_totals_add_finished_epochs_to_the_one_in_flight() {
        let stats = |samples: u64, bad: u64| EpochStats {
            samples,
            batches: samples / 4,
            bad_samples: bad,
            ..EpochStats::default()
        };
        let mut tally = RankTally::default();
        tally.loaded(0, &stats(8, 1), false);
        tally.loaded(0, &stats(16, 2), false);
        assert_eq!(tally.totals()[0].loader.samples, 16, "the epoch so far");
        tally.loaded(0, &stats(40, 3), true);
        tally.loaded(0, &stats(4, 0), false);
        let loader = &tally.totals()[0].loader;
        assert_eq!(
            (loader.samples, loader.batches, loader.bad_samples),
            (44, 11, 3)
        );
        tally.loaded(0, &stats(40, 1), true);
        assert_eq!(tally.totals()[0].loader.samples, 80);
    }
}
