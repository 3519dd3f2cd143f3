//! The rules a job's choices must keep, in one place. Every way a job is asked for (the
//! command line, a request submitted to a coordinator, a test) goes through
//! [`JobRequest::validate`](super::JobRequest::validate) before anything starts, and the
//! configuration's own check calls [`check_choices`] with the same choices, so that a
//! wrong file is refused before its shards are read, naming the key and its origin.
//! A leaf of `job/`: it depends on no other file of the folder.

use crate::train::{AllreduceChoice, Loaders, SyncChoice};

/// The choices of a job that the rules relate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobChoices {
    /// `train.elastic`.
    pub elastic: bool,
    /// `train.sync`.
    pub sync: SyncChoice,
    /// `train.allreduce`.
    pub allreduce: AllreduceChoice,
    /// `data.loaders`.
    pub loaders: Loaders,
    /// `data.preload`.
    pub preload: bool,
}

/// A rule the choices break: the key to change and why, for a person to read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key} {problem}")]
pub struct RuleError {
    /// The configuration key the message is about (`train.elastic`).
    pub key: &'static str,
    /// What is wrong with it and what to choose instead.
    pub problem: &'static str,
}

/// The first rule `choices` break, if any.
pub fn check_choices(choices: &JobChoices) -> Result<(), RuleError> {
    let refuse = |key, problem| Err(RuleError { key, problem });
    if choices.preload && choices.loaders == Loaders::Remote {
        return refuse(
            "data.preload",
            "is true and data.loaders is \"remote\": a preload copies shards to the \
             trainers' nodes, and remote loaders read on theirs. Use the shard cache \
             (shards.cache_dir) on the loaders' nodes instead, or local loaders",
        );
    }
    if choices.elastic && choices.sync == SyncChoice::Decentralized {
        return refuse(
            "train.elastic",
            "is true and train.sync is \"decentralized\": an elastic job re-forms the ring \
             over the survivors, not yet the mixing groups; use train.sync = \"allreduce\"",
        );
    }
    if choices.elastic && choices.allreduce == AllreduceChoice::Nccl {
        return refuse(
            "train.elastic",
            "is true and train.allreduce is \"nccl\": an NCCL call waiting for a lost peer \
             cannot be aborted yet, so elastic jobs average over imgrun's ring; use \
             train.allreduce = \"auto\" or \"ring\"",
        );
    }
    if choices.elastic && choices.loaders == Loaders::Remote {
        return refuse(
            "train.elastic",
            "is true and data.loaders is \"remote\": the survivors of a lost rank take \
             over its loader workers in their own processes; use data.loaders = \"local\"",
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rule_names_its_key_and_the_rest_pass() {
        let fine = JobChoices {
            elastic: false,
            sync: SyncChoice::Allreduce,
            allreduce: AllreduceChoice::Auto,
            loaders: Loaders::Local,
            preload: false,
        };
        let elastic = JobChoices {
            elastic: true,
            ..fine
        };
        let cases = [
            (fine, None),
            (elastic, None),
            (
                JobChoices {
                    preload: true,
                    loaders: Loaders::Remote,
                    ..fine
                },
                Some(("data.preload", "data.loaders is \"remote\"")),
            ),
            (
                JobChoices {
                    preload: true,
                    ..elastic
                },
                None,
            ),
            (
                JobChoices {
                    sync: SyncChoice::Decentralized,
                    ..elastic
                },
                Some(("train.elastic", "train.sync is \"decentralized\"")),
            ),
            (
                JobChoices {
                    allreduce: AllreduceChoice::Nccl,
                    ..elastic
                },
                Some(("train.elastic", "train.allreduce is \"nccl\"")),
            ),
            (
                JobChoices {
                    loaders: Loaders::Remote,
                    ..elastic
                },
                Some(("train.elastic", "data.loaders is \"remote\"")),
            ),
            (
                JobChoices {
                    sync: SyncChoice::Decentralized,
                    allreduce: AllreduceChoice::Nccl,
                    loaders: Loaders::Remote,
                    ..fine
                },
                None,
            ),
        ];
        for (choices, want) in cases {
            let got = check_choices(&choices).err();
            match (got, want) {
                (None, None) => {}
                (Some(error), Some((key, words))) => {
                    assert_eq!(error.key, key, "{choices:?}");
                    assert!(error.to_string().contains(words), "{choices:?}: {error}");
                }
                (got, want) => panic!("{choices:?}: got {got:?}, want {want:?}"),
            }
        }
    }
}
