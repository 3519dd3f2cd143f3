//! `/metrics`: a [`ClusterSnapshot`] in the OpenMetrics text format, encoded by the
//! `prometheus-client` crate, for Prometheus to scrape. Labels are bounded: a node, a
//! job, a rank, a phase or a job state; never a step or a sample. A job's label is
//! `imgrun_job`, not `job`, which Prometheus gives every target (a scraped `job` would be
//! renamed `exported_job`).

use std::sync::atomic::AtomicU64;

use actors::job::{ClusterSnapshot, JobSnapshot};
use pipelines::EpochStats;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// The Content-Type of what [`render`] writes (Prometheus refuses a scrape without a
/// valid one).
pub(super) const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(&'static str, String)>;
type Gauges = Family<Labels, Gauge<f64, AtomicU64>>;
type Counters = Family<Labels, Counter<u64>>;
type SecondsCounters = Family<Labels, Counter<f64, AtomicU64>>;

/// The metrics of one scrape.
struct Metrics {
    registry: Registry,
}

impl Metrics {
    fn gauge(&mut self, name: &str, help: &str) -> Gauges {
        let family = Gauges::default();
        self.registry.register(name, help, family.clone());
        family
    }

    fn counter(&mut self, name: &str, help: &str) -> Counters {
        let family = Counters::default();
        self.registry.register(name, help, family.clone());
        family
    }

    fn seconds_counter(&mut self, name: &str, help: &str) -> SecondsCounters {
        let family = SecondsCounters::default();
        self.registry.register(name, help, family.clone());
        family
    }
}

/// `snapshot` in the OpenMetrics text format.
pub(super) fn render(snapshot: &ClusterSnapshot) -> String {
    let mut metrics = Metrics {
        registry: Registry::default(),
    };
    nodes(&mut metrics, snapshot);
    jobs(&mut metrics, &snapshot.jobs);
    let mut text = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut text, &metrics.registry);
    text
}

fn nodes(metrics: &mut Metrics, snapshot: &ClusterSnapshot) {
    let up = metrics.gauge(
        "imgrun_node_up",
        "1 while the head hears the node (alive or suspect), 0 once it is dead or gone",
    );
    let cpus = metrics.gauge("imgrun_node_cpus", "CPUs the node offers");
    let gpus = metrics.gauge("imgrun_node_gpus", "GPUs the node offers");
    let heartbeat = metrics.gauge(
        "imgrun_node_heartbeat_age_seconds",
        "Seconds since the head last heard the node",
    );
    for node in &snapshot.cluster.nodes {
        let labels = vec![
            ("node", node.id.0.to_string()),
            ("hostname", node.hostname.clone()),
        ];
        up.get_or_create(&labels)
            .set(if node.state.is_live() { 1.0 } else { 0.0 });
        cpus.get_or_create(&labels).set(f64::from(node.cpus));
        gpus.get_or_create(&labels).set(node.gpus.len() as f64);
        heartbeat
            .get_or_create(&labels)
            .set(node.last_heartbeat_ms_ago as f64 / 1000.0);
    }
    gpu_use(metrics, snapshot);
}

/// Every GPU's utilisation and memory, where NVML answers (none for a GPU it does not).
fn gpu_use(metrics: &mut Metrics, snapshot: &ClusterSnapshot) {
    let busy = metrics.gauge(
        "imgrun_gpu_utilization_ratio",
        "The share of NVML's last sample period in which the GPU was busy (0 to 1)",
    );
    let used = metrics.gauge(
        "imgrun_gpu_memory_used_bytes",
        "GPU memory in use, from NVML",
    );
    let total = metrics.gauge("imgrun_gpu_memory_bytes", "GPU memory in all");
    for node in &snapshot.cluster.nodes {
        for gpu in &node.gpus {
            let labels = vec![
                ("node", node.id.0.to_string()),
                ("gpu", gpu.index.to_string()),
            ];
            if let Some(percent) = gpu.utilization_percent {
                busy.get_or_create(&labels).set(f64::from(percent) / 100.0);
            }
            if let Some(bytes) = gpu.memory_used_bytes {
                used.get_or_create(&labels).set(bytes as f64);
            }
            if let Some(bytes) = gpu.memory_bytes {
                total.get_or_create(&labels).set(bytes as f64);
            }
        }
    }
}

fn jobs(metrics: &mut Metrics, jobs: &actors::job::Jobs) {
    let state = metrics.gauge(
        "imgrun_job_state",
        "1 for the job's state (running, stopping, succeeded, failed, cancelled)",
    );
    let epoch = metrics.gauge("imgrun_job_epoch", "The epoch the job is in");
    let position = metrics.gauge("imgrun_job_epoch_step", "Steps done in the epoch");
    let steps = metrics.gauge("imgrun_job_epoch_steps", "Steps in the epoch");
    let loss = metrics.gauge("imgrun_loss", "The newest training loss");
    let rate = metrics.gauge(
        "imgrun_images_per_second",
        "Training images per second over the newest steps, all ranks together",
    );
    let checkpoint = metrics.gauge(
        "imgrun_checkpoint_step",
        "The global step of the job's newest checkpoint",
    );
    let checkpoint_s = metrics.gauge(
        "imgrun_checkpoint_seconds",
        "How long writing the job's newest checkpoint took",
    );
    let lr = metrics.gauge("imgrun_learning_rate", "The newest step's learning rate");
    let step_s = metrics.gauge(
        "imgrun_step_seconds",
        "The newest step's wall time (its slowest rank's)",
    );
    let data_wait = metrics.gauge(
        "imgrun_step_data_wait_seconds",
        "The newest step's wait for data, the ranks' mean",
    );
    let allreduce = metrics.gauge(
        "imgrun_step_allreduce_seconds",
        "The newest step's gradient averaging, the ranks' mean",
    );
    let mut ranks = RankMetrics::new(metrics);
    for job in jobs.iter() {
        let Some(status) = &job.job else {
            continue;
        };
        let labels = vec![("imgrun_job", job.name.clone())];
        let with_state = vec![
            ("imgrun_job", job.name.clone()),
            ("state", status.state.name().to_owned()),
        ];
        state.get_or_create(&with_state).set(1.0);
        if let Some(e) = status.epoch {
            epoch.get_or_create(&labels).set(e as f64);
        }
        position.get_or_create(&labels).set(status.position as f64);
        steps.get_or_create(&labels).set(status.steps as f64);
        if let Some(l) = status.loss {
            loss.get_or_create(&labels).set(f64::from(l));
        }
        if let Some(r) = status.images_per_s {
            rate.get_or_create(&labels).set(r);
        }
        for (family, value) in [
            (&lr, status.lr),
            (&step_s, status.step_s),
            (&data_wait, status.data_wait_s),
            (&allreduce, status.allreduce_s),
        ] {
            if let Some(value) = value {
                family.get_or_create(&labels).set(value);
            }
        }
        if let Some(saved) = &status.checkpoint {
            checkpoint
                .get_or_create(&labels)
                .set(saved.global_step as f64);
            if let Some(seconds) = saved.seconds {
                checkpoint_s.get_or_create(&labels).set(seconds);
            }
        }
        ranks.add(job);
    }
}

/// The per-rank families.
struct RankMetrics {
    step: Counters,
    phase: Gauges,
    phase_seconds: Gauges,
    data_wait: Gauges,
    heartbeat: Gauges,
    totals: TotalMetrics,
}

/// The per-rank families of the job's running totals (labels `imgrun_job` and `rank`:
/// a finished job's ranks have no node any more).
struct TotalMetrics {
    data_wait: SecondsCounters,
    allreduce: SecondsCounters,
    late: Counters,
    last_step: Gauges,
    p50: Gauges,
    p95: Gauges,
    straggler: Gauges,
    /// The loader counters of [`LOADER_COUNTERS`], in its order.
    loader: Vec<Counters>,
    /// Shards opened and failed to open, by kind of source; shard cache hits and misses.
    opened: Counters,
    failed: Counters,
    cache_hits: Counters,
    cache_misses: Counters,
}

/// One loader counter: its name, help, and its count in a rank's totals.
type LoaderCounter = (&'static str, &'static str, fn(&EpochStats) -> u64);

/// Every rank's loader counters.
const LOADER_COUNTERS: [LoaderCounter; 6] = [
    (
        "imgrun_loader_samples",
        "Samples the rank's loader handed out in batches",
        |t| t.samples,
    ),
    (
        "imgrun_loader_batches",
        "Batches with samples the rank's loader handed out",
        |t| t.batches,
    ),
    (
        "imgrun_loader_empty_batches",
        "Empty batches the rank's loader handed out (the join policy, or data short of the plan)",
        |t| t.empty_batches,
    ),
    (
        "imgrun_loader_bad_samples",
        "Samples the rank's loader skipped as bad (undecodable image, missing or bad label)",
        |t| t.bad_samples,
    ),
    (
        "imgrun_loader_skipped_in_shards",
        "Samples the shard reader skipped (duplicate fields, oversized members)",
        |t| t.skipped_in_shards,
    ),
    (
        "imgrun_loader_skipped_shards",
        "Shards (or the rest of shards) the rank's reader could not read and skipped",
        |t| t.skipped_shards,
    ),
];

impl TotalMetrics {
    fn new(metrics: &mut Metrics) -> Self {
        TotalMetrics {
            data_wait: metrics.seconds_counter(
                "imgrun_data_wait_seconds",
                "Seconds the rank waited for data, over every step of the job",
            ),
            allreduce: metrics.seconds_counter(
                "imgrun_allreduce_seconds",
                "Seconds the rank waited for the gradient average, over every step of the job",
            ),
            late: metrics.counter(
                "imgrun_rank_late_steps",
                "Steps the rank was the late rank of (the one the others waited for)",
            ),
            last_step: metrics.gauge(
                "imgrun_last_step_timestamp_seconds",
                "When the rank's newest step ended, in seconds since the Unix epoch (alert on \
                 time() minus this)",
            ),
            p50: metrics.gauge(
                "imgrun_rank_step_p50_seconds",
                "The median of the rank's step time over its last 100 steps",
            ),
            p95: metrics.gauge(
                "imgrun_rank_step_p95_seconds",
                "The 95th percentile of the rank's step time over its last 100 steps",
            ),
            straggler: metrics.gauge(
                "imgrun_rank_straggler",
                "1 when the rank was the late one in at least half of its last 100 steps",
            ),
            loader: LOADER_COUNTERS
                .iter()
                .map(|(name, help, _)| metrics.counter(name, help))
                .collect(),
            opened: metrics.counter(
                "imgrun_shards_opened",
                "Shards the rank's process opened, by kind of source (file, http, pipe, stdin, \
                 preloaded)",
            ),
            failed: metrics.counter(
                "imgrun_shard_open_failures",
                "Shards the rank's process failed to open, by kind of source",
            ),
            cache_hits: metrics.counter(
                "imgrun_shard_cache_hits",
                "Shard opens the rank's process served from the node's shard cache",
            ),
            cache_misses: metrics.counter(
                "imgrun_shard_cache_misses",
                "Shard opens of cacheable URLs that found no copy in the node's shard cache",
            ),
        }
    }

    fn add(&self, job: &JobSnapshot) {
        let Some(status) = &job.job else {
            return;
        };
        for totals in &status.rank_totals {
            let labels = vec![
                ("imgrun_job", job.name.clone()),
                ("rank", totals.rank.to_string()),
            ];
            self.data_wait
                .get_or_create(&labels)
                .inc_by(totals.data_wait_s);
            self.allreduce
                .get_or_create(&labels)
                .inc_by(totals.allreduce_s);
            self.late.get_or_create(&labels).inc_by(totals.late_steps);
            self.last_step
                .get_or_create(&labels)
                .set(totals.last_step_unix_ms as f64 / 1000.0);
            self.p50.get_or_create(&labels).set(totals.step_p50_s);
            self.p95.get_or_create(&labels).set(totals.step_p95_s);
            self.straggler
                .get_or_create(&labels)
                .set(f64::from(u8::from(totals.straggler)));
            for (family, (_, _, count)) in self.loader.iter().zip(LOADER_COUNTERS) {
                family.get_or_create(&labels).inc_by(count(&totals.loader));
            }
            let sources = &totals.sources;
            for (family, by_kind) in [
                (&self.opened, &sources.opened),
                (&self.failed, &sources.failed),
            ] {
                for (kind, n) in by_kind {
                    let mut labels = labels.clone();
                    labels.push(("source", kind.clone()));
                    family.get_or_create(&labels).inc_by(*n);
                }
            }
            self.cache_hits
                .get_or_create(&labels)
                .inc_by(sources.cache_hits);
            self.cache_misses
                .get_or_create(&labels)
                .inc_by(sources.cache_misses);
        }
    }
}

impl RankMetrics {
    fn new(metrics: &mut Metrics) -> Self {
        RankMetrics {
            step: metrics.counter(
                "imgrun_step",
                "The global step the rank works on (its steps done + 1 while it trains)",
            ),
            phase: metrics.gauge(
                "imgrun_rank_phase",
                "1 for what the rank is doing now (waiting for data, computing, averaging, ...)",
            ),
            phase_seconds: metrics.gauge(
                "imgrun_rank_phase_seconds",
                "How long the rank has been in its phase",
            ),
            data_wait: metrics.gauge(
                "imgrun_epoch_data_wait_seconds",
                "Seconds the rank waited for its loader's batches in this epoch",
            ),
            heartbeat: metrics.gauge(
                "imgrun_rank_heartbeat_age_seconds",
                "Seconds since the head last heard the rank's node",
            ),
            totals: TotalMetrics::new(metrics),
        }
    }

    fn add(&mut self, job: &JobSnapshot) {
        self.totals.add(job);
        for view in &job.ranks {
            let labels = vec![
                ("imgrun_job", job.name.clone()),
                ("rank", view.rank.to_string()),
                ("node", view.node.to_string()),
            ];
            if let Some(ms) = view.heartbeat_ms_ago {
                self.heartbeat
                    .get_or_create(&labels)
                    .set(ms as f64 / 1000.0);
            }
            let Some(phase) = &view.phase else {
                continue;
            };
            self.step.get_or_create(&labels).inc_by(phase.step);
            self.phase_seconds.get_or_create(&labels).set(phase.seconds);
            self.data_wait.get_or_create(&labels).set(phase.data_wait_s);
            let mut with_phase = labels;
            with_phase.push(("phase", phase.phase.name().to_owned()));
            self.phase.get_or_create(&with_phase).set(1.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use actors::job::{JobSnapshot, JobState, JobStatus, RankTotals, RankView, Saved};
    use actors::train::phase::{Phase, RankPhase};
    use runtime::{ClusterStatus, NodeId, NodeState, NodeStatus};

    use super::*;

    fn node(id: u64, state: NodeState) -> NodeStatus {
        NodeStatus {
            id: NodeId(id),
            address: format!("127.0.0.1:{}", 7000 + id),
            hostname: format!("host{id}"),
            state,
            uptime_ms: 1000,
            last_heartbeat_ms_ago: 250,
            cpus: 8,
            memory_bytes: None,
            gpus: Vec::new(),
            used: BTreeMap::new(),
        }
    }

    fn rank(rank: u32, node: u64, phase: Option<Phase>) -> RankView {
        RankView {
            rank,
            node,
            phase: phase.map(|phase| RankPhase {
                rank,
                phase,
                seconds: 1.5,
                epoch: Some(2),
                step: 41,
                bucket: None,
                reading: Vec::new(),
                data_wait_s: 0.25,
            }),
            problem: phase
                .is_none()
                .then(|| "its monitor did not answer".to_owned()),
            heartbeat_ms_ago: Some(500),
        }
    }

    /// Every family is named as documented, a job is labelled `imgrun_job` (never `job`,
    /// which Prometheus keeps for its scrape job), and a rank without a phase is left out of
    /// the per-phase families rather than given made-up values.
    #[test]
    fn a_snapshot_is_encoded_with_its_documented_names_and_labels() {
        let mut measured = node(1, NodeState::Alive);
        let gpu = |index: u32, percent: Option<u32>, used: Option<u64>| runtime::GpuStatus {
            index,
            name: "NVIDIA H100 80GB HBM3".to_owned(),
            memory_bytes: Some(80 << 30),
            uuid: format!("GPU-{index}"),
            utilization_percent: percent,
            memory_used_bytes: used,
        };
        measured.gpus = vec![gpu(0, Some(37), Some(12 << 30)), gpu(1, None, None)];
        let cluster = ClusterStatus::new(7, vec![measured, node(2, NodeState::Dead)], Vec::new());
        let status = JobStatus {
            name: "r50".to_owned(),
            state: JobState::Running,
            run_dir: None,
            epoch: Some(2),
            position: 5,
            steps: 20,
            loss: Some(1.5),
            images_per_s: Some(1234.5),
            lr: Some(0.4),
            step_s: Some(0.125),
            data_wait_s: None,
            allreduce_s: Some(0.0625),
            rank_totals: vec![RankTotals {
                rank: 1,
                steps: 40,
                data_wait_s: 2.5,
                allreduce_s: 0.75,
                last_step_unix_ms: 1_795_891_300_500,
                step_p50_s: 0.125,
                step_p95_s: 0.25,
                late_steps: 30,
                straggler: true,
                loader: pipelines::EpochStats {
                    samples: 2560,
                    batches: 40,
                    bad_samples: 3,
                    ..Default::default()
                },
                sources: pipelines::SourceCounts {
                    opened: [("file".to_string(), 12), ("pipe".to_string(), 3)].into(),
                    failed: [("pipe".to_string(), 1)].into(),
                    cache_hits: 0,
                    cache_misses: 0,
                },
            }],
            warnings: Vec::new(),
            timeline: Vec::new(),
            checkpoint: Some(Saved {
                dir: "runs/r50/checkpoints/step-00000040".into(),
                epoch: 2,
                global_step: 40,
                step_in_epoch: 0,
                seconds: Some(1.5),
                store_run: None,
            }),
            outcome: None,
            stopped_by: None,
            late: None,
            summary: None,
        };
        let snapshot = ClusterSnapshot {
            taken_at_unix_ms: 0,
            cluster,
            jobs: actors::job::Jobs::from(vec![
                std::sync::Arc::new(JobSnapshot {
                    name: "r50".to_owned(),
                    job: Some(status),
                    ranks: vec![rank(0, 1, Some(Phase::Averaging)), rank(1, 2, None)],
                    problem: None,
                }),
                std::sync::Arc::new(JobSnapshot {
                    name: "stuck".to_owned(),
                    job: None,
                    ranks: Vec::new(),
                    problem: Some("no answer".to_owned()),
                }),
            ]),
        };
        let text = render(&snapshot);
        for line in [
            r#"imgrun_node_up{node="1",hostname="host1"} 1.0"#,
            r#"imgrun_node_up{node="2",hostname="host2"} 0.0"#,
            r#"imgrun_job_state{imgrun_job="r50",state="running"} 1.0"#,
            r#"imgrun_job_epoch_step{imgrun_job="r50"} 5.0"#,
            r#"imgrun_loss{imgrun_job="r50"} 1.5"#,
            r#"imgrun_learning_rate{imgrun_job="r50"} 0.4"#,
            r#"imgrun_step_seconds{imgrun_job="r50"} 0.125"#,
            r#"imgrun_step_allreduce_seconds{imgrun_job="r50"} 0.0625"#,
            r#"imgrun_step_total{imgrun_job="r50",rank="0",node="1"} 41"#,
            r#"imgrun_rank_phase{imgrun_job="r50",rank="0",node="1",phase="averaging"} 1.0"#,
            r#"imgrun_epoch_data_wait_seconds{imgrun_job="r50",rank="0",node="1"} 0.25"#,
            r#"imgrun_rank_heartbeat_age_seconds{imgrun_job="r50",rank="1",node="2"} 0.5"#,
            "# TYPE imgrun_step counter",
            r#"imgrun_checkpoint_step{imgrun_job="r50"} 40.0"#,
            r#"imgrun_checkpoint_seconds{imgrun_job="r50"} 1.5"#,
            r#"imgrun_data_wait_seconds_total{imgrun_job="r50",rank="1"} 2.5"#,
            r#"imgrun_allreduce_seconds_total{imgrun_job="r50",rank="1"} 0.75"#,
            r#"imgrun_rank_late_steps_total{imgrun_job="r50",rank="1"} 30"#,
            r#"imgrun_last_step_timestamp_seconds{imgrun_job="r50",rank="1"} 1795891300.5"#,
            r#"imgrun_rank_step_p50_seconds{imgrun_job="r50",rank="1"} 0.125"#,
            r#"imgrun_rank_step_p95_seconds{imgrun_job="r50",rank="1"} 0.25"#,
            r#"imgrun_rank_straggler{imgrun_job="r50",rank="1"} 1.0"#,
            r#"imgrun_loader_samples_total{imgrun_job="r50",rank="1"} 2560"#,
            r#"imgrun_loader_batches_total{imgrun_job="r50",rank="1"} 40"#,
            r#"imgrun_loader_bad_samples_total{imgrun_job="r50",rank="1"} 3"#,
            r#"imgrun_loader_skipped_shards_total{imgrun_job="r50",rank="1"} 0"#,
            r#"imgrun_shards_opened_total{imgrun_job="r50",rank="1",source="file"} 12"#,
            r#"imgrun_shards_opened_total{imgrun_job="r50",rank="1",source="pipe"} 3"#,
            r#"imgrun_shard_open_failures_total{imgrun_job="r50",rank="1",source="pipe"} 1"#,
            r#"imgrun_shard_cache_hits_total{imgrun_job="r50",rank="1"} 0"#,
            r#"imgrun_gpu_utilization_ratio{node="1",gpu="0"} 0.37"#,
            r#"imgrun_gpu_memory_used_bytes{node="1",gpu="0"} 12884901888.0"#,
            r#"imgrun_gpu_memory_bytes{node="1",gpu="1"} 85899345920.0"#,
        ] {
            assert!(text.lines().any(|l| l == line), "no `{line}` in:\n{text}");
        }
        // A GPU NVML does not answer for has no utilisation, not a made-up 0.
        assert!(
            !text.contains(r#"imgrun_gpu_utilization_ratio{node="1",gpu="1"}"#),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert!(!text.contains("{job=") && !text.contains(",job="), "{text}");
        assert!(!text.contains("rank=\"1\",node=\"2\",phase"), "{text}");
        assert!(
            !text.contains("stuck"),
            "a job without a status has no series: {text}"
        );
        assert!(
            !text.contains("imgrun_step_data_wait_seconds{"),
            "no value, no series: {text}"
        );
    }
}
