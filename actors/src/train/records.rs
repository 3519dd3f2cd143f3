//! The records of a run's `metrics.jsonl`, one JSON object a line tagged by `kind`: the
//! one set of types the job writes and `imgrun plot` reads. Fields a reader may find
//! missing in files from earlier versions have defaults; a NaN (a diverged loss) is
//! written as `null` by JSON and read back as NaN.

use serde::{Deserialize, Deserializer, Serialize};

/// One line of `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum MetricsRecord {
    /// The job as it started (or resumed).
    Job(JobRecord),
    /// The ranks' collective, once connected.
    Connect(ConnectRecord),
    /// One optimiser step.
    Step(StepMetrics),
    /// One evaluation.
    Eval(EvalRecord),
    /// The end of an epoch.
    Epoch(EpochRecord),
    /// The job stopped by a signal.
    Stop(StopRecord),
    /// A rank that held the others up in a step (`train.straggler_secs`).
    Late(LateRecord),
    /// The samples one rank trained on in one step (`train.sample_log`).
    Samples(SamplesRecord),
    /// An elastic job that lost ranks and went on with the others (`train.elastic`).
    Regroup(RegroupRecord),
    /// A kind from a newer version, kept in the file and skipped by readers.
    #[serde(other)]
    Unknown,
}

impl MetricsRecord {
    /// The `kind` tag of this record.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Job(_) => "job",
            Self::Connect(_) => "connect",
            Self::Step(_) => "step",
            Self::Eval(_) => "eval",
            Self::Epoch(_) => "epoch",
            Self::Stop(_) => "stop",
            Self::Late(_) => "late",
            Self::Samples(_) => "samples",
            Self::Regroup(_) => "regroup",
            Self::Unknown => "unknown",
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct JobRecord {
    /// Seconds since the Unix epoch.
    #[serde(default)]
    pub time: u64,
    #[serde(default)]
    pub world: Option<u32>,
    #[serde(default)]
    pub nodes: Option<u32>,
    /// Ranks on each node.
    #[serde(default)]
    pub node_ranks: Vec<u32>,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub classes: Option<i64>,
    #[serde(default)]
    pub global_batch: Option<u64>,
    /// The learning rate after scaling.
    #[serde(default)]
    pub lr: Option<f64>,
    #[serde(default)]
    pub epochs: Option<u64>,
    /// The checkpoint a resumed job started from.
    #[serde(default)]
    pub resumed_from: Option<String>,
    /// A resumed job continues after this global step: what an earlier run wrote past it
    /// did not happen in this run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_at_step: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_epoch: Option<u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ConnectRecord {
    pub buckets: usize,
    /// `ring` or `NCCL <version>`.
    pub allreduce: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    pub epoch: u64,
    /// The global optimiser step, from 1.
    pub step: u64,
    #[serde(deserialize_with = "number_or_nan")]
    pub loss: f64,
    #[serde(default, deserialize_with = "number_or_nan")]
    pub accuracy: f64,
    #[serde(deserialize_with = "number_or_nan")]
    pub lr: f64,
    #[serde(default)]
    pub samples: u64,
    #[serde(deserialize_with = "number_or_nan")]
    pub images_per_s: f64,
    #[serde(default)]
    pub data_wait_s: f64,
    /// Forward and backward (the ranks' mean).
    #[serde(default)]
    pub compute_s: f64,
    #[serde(default)]
    pub allreduce_s: f64,
    /// The step's wall time: its slowest rank's.
    #[serde(default)]
    pub step_s: f64,
    /// Seconds since the job started, when the step ended.
    #[serde(default)]
    pub elapsed_s: f64,
    /// The dynamic loss scale, when the job scales its loss.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// Whether the step was skipped for overflowing gradients (with `loss_scale`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped: Option<bool>,
    /// Each rank's own figures of the step, by rank (`train.tensorboard_ranks`); empty
    /// (and not written) without that option.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<RankStep>,
}

/// One rank's own figures of one step, as that rank measured them (the step record's
/// `data_wait_s`, `compute_s` and `allreduce_s` are the ranks' means, its `step_s` the
/// slowest rank's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct RankStep {
    pub rank: u32,
    /// From asking its loader for the batch to the end of its optimiser step.
    pub step_s: f64,
    /// Waiting for the batch.
    pub data_wait_s: f64,
    /// Forward and backward.
    pub compute_s: f64,
    /// Waiting for the gradient average.
    pub allreduce_s: f64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EvalRecord {
    pub epoch: u64,
    pub step: u64,
    #[serde(deserialize_with = "number_or_nan")]
    pub loss: f64,
    #[serde(deserialize_with = "number_or_nan")]
    pub top1: f64,
    #[serde(deserialize_with = "number_or_nan")]
    pub top5: f64,
    #[serde(default)]
    pub samples: u64,
    #[serde(default)]
    pub elapsed_s: f64,
    /// A decentralized job's: the largest distance of a replica from the replicas' mean
    /// (Euclidean, over parameters and buffers); the mean is what was evaluated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica_spread: Option<f64>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EpochRecord {
    pub epoch: u64,
    #[serde(default)]
    pub step: u64,
    #[serde(default, deserialize_with = "number_or_nan")]
    pub train_loss: f64,
    #[serde(default, deserialize_with = "number_or_nan")]
    pub train_accuracy: f64,
    #[serde(default)]
    pub steps: u64,
    #[serde(default)]
    pub samples: u64,
    #[serde(default)]
    pub images_per_s: f64,
    #[serde(default)]
    pub data_wait_fraction: f64,
    #[serde(default)]
    pub seconds: f64,
    #[serde(default)]
    pub elapsed_s: f64,
    /// Per rank: the image sides it trained on (this run's part of a resumed epoch).
    #[serde(default)]
    pub image_sizes: Vec<Vec<u32>>,
    /// Per rank: a brace summary of the shards its samples came from.
    #[serde(default)]
    pub train_shards: Vec<String>,
    /// Bad samples and shards skipped over all ranks (`shards.error_policy = "skip"`).
    #[serde(default)]
    pub skipped: u64,
}

/// An elastic job lost `lost` (old rank numbers) and went on from `step` (the last step
/// every rank completed; the step in flight was dropped) with `world` ranks.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RegroupRecord {
    pub epoch: u64,
    pub step: u64,
    /// `step`'s place in `epoch` (0: the epoch's start).
    pub step_in_epoch: u64,
    pub lost: Vec<u32>,
    /// Why, as the head or the ranks said it.
    pub cause: String,
    pub world: u32,
    pub node_ranks: Vec<u32>,
    /// The global batch and the learning rate (linear rule) from here on.
    pub global_batch: u64,
    pub lr: f64,
    /// Steps the survivors had run past `step` and undid.
    pub undone: u64,
    /// From the failure seen to the lost ranks known and the survivors rolled back, in
    /// seconds.
    #[serde(default)]
    pub found_s: f64,
    /// From the failure seen to the ring re-formed, in seconds.
    pub recovery_s: f64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StopRecord {
    /// `SIGINT` or `SIGTERM`.
    pub signal: String,
    pub epoch: u64,
    pub step: u64,
    /// The checkpoint to resume from, if any.
    #[serde(default)]
    pub checkpoint: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LateRecord {
    pub epoch: u64,
    pub step: u64,
    pub rank: u32,
    /// The node it runs on.
    pub node: u64,
    /// How much longer its own work took than the quickest rank's.
    pub behind_s: f64,
    pub cause: super::straggler::LateCause,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplesRecord {
    pub epoch: u64,
    pub step: u64,
    pub rank: u32,
    /// Each sample as `URL#key`, in the batch's order.
    pub samples: Vec<String>,
}

/// A number, or `null` read as NaN (how JSON carries a NaN loss).
fn number_or_nan<'de, D: Deserializer<'de>>(deserializer: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(deserializer)?.unwrap_or(f64::NAN))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_read_what_earlier_versions_wrote() {
        let step = MetricsRecord::Step(StepMetrics {
            epoch: 1,
            step: 7,
            loss: 0.5,
            lr: 0.1,
            images_per_s: 900.0,
            loss_scale: Some(65536.0),
            skipped: Some(false),
            ..StepMetrics::default()
        });
        let line = serde_json::to_string(&step).expect("encode");
        assert!(
            line.starts_with(r#"{"kind":"step","epoch":1,"step":7"#),
            "{line}"
        );
        assert_eq!(
            serde_json::from_str::<MetricsRecord>(&line).expect("decode"),
            step
        );

        // Without per-rank figures a step record says nothing of them (as before the
        // option existed); with them they round-trip.
        assert!(!line.contains("ranks"), "{line}");
        let MetricsRecord::Step(mut with_ranks) = step.clone() else {
            unreachable!("built as a step record")
        };
        with_ranks.ranks = vec![RankStep {
            rank: 1,
            step_s: 0.5,
            data_wait_s: 0.25,
            compute_s: 0.125,
            allreduce_s: 0.0625,
        }];
        let with_ranks = MetricsRecord::Step(with_ranks);
        let line = serde_json::to_string(&with_ranks).expect("encode");
        assert!(
            line.ends_with(
                r#""ranks":[{"rank":1,"step_s":0.5,"data_wait_s":0.25,"compute_s":0.125,"allreduce_s":0.0625}]}"#
            ),
            "{line}"
        );
        assert_eq!(
            serde_json::from_str::<MetricsRecord>(&line).expect("decode"),
            with_ranks
        );

        // A NaN loss travels as null and comes back as NaN.
        let nan = r#"{"kind":"step","epoch":0,"step":1,"loss":null,"lr":0.1,"images_per_s":1}"#;
        let Ok(MetricsRecord::Step(read)) = serde_json::from_str(nan) else {
            panic!("a step record");
        };
        assert!(read.loss.is_nan());
        // A kind from a newer version is skipped, not an error.
        let newer = serde_json::from_str::<MetricsRecord>(r#"{"kind":"elastic","ranks":3}"#);
        assert_eq!(newer.expect("newer kind"), MetricsRecord::Unknown);
        let err = serde_json::from_str::<MetricsRecord>(r#"{"kind":"eval","epoch":0,"step":1}"#)
            .expect_err("no loss");
        assert!(err.to_string().contains("missing field `loss`"), "{err}");
    }
}
