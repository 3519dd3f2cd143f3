//! The loader end to end on real shard files: plans from the planner, worker threads,
//! shuffle buffers, decoding into batches, the batch policy's padding, bad data, and
//! resuming an epoch from a cursor.

use std::collections::BTreeMap;
use std::io::Cursor;
use std::path::Path;
use std::time::{Duration, Instant};

use pipelines::{
    Batch, BatchPolicy, ClusterShape, EvalTransform, Hooks, Loader, LoaderConfig, LoaderError,
    OutputFormat, Plan, PlanConfig, PlanMode, PlanShard, Planner, Rank, RankCursor, Sample,
    SampleId, Sources, TarWriter, TrainTransform, Transform,
};

/// The label of sample `j` of shard `i`.
fn label(i: usize, j: usize) -> i64 {
    ((i * 31 + j) % 7) as i64
}

fn png(i: usize, j: usize) -> Vec<u8> {
    let image = image::RgbImage::from_fn(14, 10, |x, y| {
        image::Rgb([(i * 40) as u8, (j * 3) as u8, (x * 9 + y * 5) as u8])
    });
    let mut out = Cursor::new(Vec::new());
    image
        .write_to(&mut out, image::ImageFormat::Png)
        .expect("encode png");
    out.into_inner()
}

/// Writes one shard per count (`s{i}-{j}` keys, a PNG and a label each) and returns
/// them with their counts, as a manifest would give them.
fn write_shards(dir: &Path, counts: &[u64]) -> Vec<PlanShard> {
    counts
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let path = dir.join(format!("part-{i:06}.tar"));
            let file = std::fs::File::create(&path).expect("create shard");
            let mut tar = TarWriter::new(file);
            for j in 0..n as usize {
                let sample = Sample::new(format!("s{i}-{j:04}"))
                    .with("png", png(i, j))
                    .with("cls", label(i, j).to_string());
                tar.write(&sample).expect("write sample");
            }
            tar.finish().expect("finish shard");
            PlanShard::new(path.to_string_lossy(), Some(n))
        })
        .collect()
}

fn planned(
    shards: Vec<PlanShard>,
    shape: ClusterShape,
    batch: u64,
    tune: impl Fn(&mut PlanConfig),
) -> Planner {
    let mut config = PlanConfig::new(shards, shape, batch);
    config.mode = PlanMode::Split;
    config.policy = BatchPolicy::Join;
    config.drop_partial = false;
    config.seed = 11;
    tune(&mut config);
    Planner::new(config, Hooks::builtin()).expect("valid plan settings")
}

fn loader(tune: impl Fn(&mut LoaderConfig)) -> Loader {
    let mut config = LoaderConfig {
        shuffle_buffer: 16,
        shuffle_initial: 4,
        ..LoaderConfig::default()
    };
    tune(&mut config);
    Loader::new(config, Sources::default()).expect("valid loader settings")
}

fn eval(size: u32) -> Transform {
    Transform::Eval(EvalTransform::new(size))
}

fn train(size: u32) -> Transform {
    Transform::Train(TrainTransform::new(size))
}

/// A batch as plain data: (step, ids, labels, pixels).
type Seen = (u64, Vec<SampleId>, Vec<i64>, Vec<u8>);

fn seen(batch: &Batch) -> Seen {
    let pixels = batch.pixels_u8().expect("u8 output").to_vec();
    (batch.step, batch.ids.clone(), batch.labels.clone(), pixels)
}

fn run_epoch(loader: &Loader, plan: &Plan, rank: u32, transform: Transform) -> Vec<Seen> {
    loader
        .epoch(plan, Rank(rank), transform, None)
        .expect("epoch starts")
        .map(|b| seen(&b.expect("batch loads")))
        .collect()
}

fn key_label(id: &SampleId) -> i64 {
    let (i, j) = id.key[1..].split_once('-').expect("s<i>-<j> key");
    label(
        i.parse().expect("shard index"),
        j.parse().expect("sample index"),
    )
}

#[test]
fn a_split_epoch_serves_every_sample_once_with_equal_steps_per_rank() {
    let dir = tempfile::tempdir().expect("temp dir");
    let counts = [23, 17, 30, 9, 21];
    let shards = write_shards(dir.path(), &counts);
    let planner = planned(shards, ClusterShape::new(1, 2, 3), 4, |_| {});
    let plan = planner.plan(0).expect("plan");
    let steps = plan.steps().expect("consistent under join");
    let loader = loader(|_| {});
    let mut all = Vec::new();
    for rank in 0..2 {
        let batches = run_epoch(&loader, &plan, rank, eval(8));
        assert_eq!(
            batches.len() as u64,
            steps,
            "rank {rank} runs the planned steps"
        );
        for (step, (at, ids, labels, pixels)) in batches.into_iter().enumerate() {
            assert_eq!(at, step as u64);
            assert!(ids.len() <= 4);
            assert_eq!(pixels.len(), ids.len() * 8 * 8 * 3);
            for (id, label) in ids.iter().zip(&labels) {
                assert_eq!(*label, key_label(id), "{id}");
            }
            all.extend(ids);
        }
    }
    let total: u64 = counts.iter().sum();
    assert_eq!(all.len() as u64, total);
    all.sort();
    all.dedup();
    assert_eq!(all.len() as u64, total, "no sample twice");
}

#[test]
fn batches_depend_on_the_plan_only_and_epochs_differ() {
    let dir = tempfile::tempdir().expect("temp dir");
    let shards = write_shards(dir.path(), &[40, 40]);
    let planner = planned(shards, ClusterShape::new(1, 1, 2), 8, |_| {});
    let loader = loader(|_| {});
    let epoch0 = planner.plan(0).expect("plan");
    let first = run_epoch(&loader, &epoch0, 0, train(8));
    let again = run_epoch(&loader, &epoch0, 0, train(8));
    assert_eq!(
        first, again,
        "same plan, same batches: order, crops and flips"
    );
    let epoch1 = planner.plan(1).expect("plan");
    let next = run_epoch(&loader, &epoch1, 0, train(8));
    let ids = |run: &[Seen]| run.iter().flat_map(|s| s.1.clone()).collect::<Vec<_>>();
    assert_ne!(ids(&first), ids(&next), "another epoch, another order");
    let mut a = ids(&first);
    let mut b = ids(&next);
    a.sort();
    b.sort();
    assert_eq!(a, b, "the same samples");
}

#[test]
fn a_resumed_epoch_continues_exactly_where_it_stopped() {
    let dir = tempfile::tempdir().expect("temp dir");
    let shards = write_shards(dir.path(), &[25, 18, 31, 7]);
    let planner = planned(shards, ClusterShape::new(1, 1, 3), 5, |_| {});
    let plan = planner.plan(2).expect("plan");
    for mix in [1, 3] {
        let loader = loader(|c| c.mix_batches = mix);
        let whole = run_epoch(&loader, &plan, 0, train(8));
        assert!(whole.len() > 6);
        for cut in [0, 1, 4, whole.len() / 2, whole.len() - 1, whole.len()] {
            let mut epoch = loader
                .epoch(&plan, Rank(0), train(8), None)
                .expect("epoch starts");
            let mut got: Vec<Seen> = epoch
                .by_ref()
                .take(cut)
                .map(|b| seen(&b.expect("batch")))
                .collect();
            // As a checkpoint would store it.
            let saved = serde_json::to_string(epoch.cursor()).expect("cursor serialises");
            drop(epoch);
            let cursor: RankCursor = serde_json::from_str(&saved).expect("cursor parses");
            assert_eq!(cursor.steps, cut as u64);
            let resumed = loader
                .epoch(&plan, Rank(0), train(8), Some(&cursor))
                .expect("resumed epoch starts");
            got.extend(resumed.map(|b| seen(&b.expect("batch"))));
            assert_eq!(got, whole, "mixing {mix}, interrupted after {cut} batches");
        }
    }
}

#[test]
fn mixing_shuffles_samples_across_workers_and_keeps_batch_sizes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let shards = write_shards(dir.path(), &[21, 19, 22, 18]);
    let planner = planned(shards, ClusterShape::new(1, 1, 2), 6, |_| {});
    let plan = planner.plan(0).expect("plan");
    let plain = run_epoch(&loader(|_| {}), &plan, 0, train(8));
    let mixed = run_epoch(&loader(|c| c.mix_batches = 4), &plan, 0, train(8));
    let sizes = |run: &[Seen]| run.iter().map(|s| s.1.len()).collect::<Vec<_>>();
    assert_eq!(sizes(&plain), sizes(&mixed), "every batch keeps its size");
    // Each sample keeps its pixels and label: only its batch and row change.
    let rows = |run: &[Seen]| {
        let mut rows = BTreeMap::new();
        for (_, ids, labels, pixels) in run {
            let row = pixels.len() / ids.len().max(1);
            for (k, id) in ids.iter().enumerate() {
                rows.insert(
                    id.clone(),
                    (labels[k], pixels[k * row..(k + 1) * row].to_vec()),
                );
            }
        }
        rows
    };
    assert_eq!(rows(&plain), rows(&mixed));
    let shards_in = |ids: &[SampleId]| {
        let mut urls: Vec<&str> = ids.iter().map(|id| &*id.url).collect();
        urls.sort_unstable();
        urls.dedup();
        urls.len()
    };
    // Worker 0 reads shards 0 and 2, worker 1 shards 1 and 3; unmixed, a batch comes
    // from one worker, mostly one shard; mixed, batches draw from several.
    assert!(plain.iter().all(|s| shards_in(&s.1) <= 2));
    assert!(
        mixed.iter().any(|s| shards_in(&s.1) >= 3),
        "samples cross workers"
    );
    assert_ne!(plain, mixed);
}

#[test]
fn a_cursor_from_another_plan_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let shards = write_shards(dir.path(), &[12, 12]);
    let planner = planned(shards.clone(), ClusterShape::new(1, 1, 2), 4, |_| {});
    let loader = loader(|_| {});
    let plan0 = planner.plan(0).expect("plan");
    let mut epoch = loader.epoch(&plan0, Rank(0), eval(8), None).expect("epoch");
    epoch.next().expect("a batch").expect("loads");
    let cursor = epoch.cursor().clone();
    drop(epoch);
    let plan1 = planner.plan(1).expect("plan");
    let reseeded = planned(shards, ClusterShape::new(1, 1, 2), 4, |c| c.seed = 12)
        .plan(0)
        .expect("plan");
    for (plan, what) in [(&plan1, "epoch 0, not 1"), (&reseeded, "different plan")] {
        match loader.epoch(plan, Rank(0), eval(8), Some(&cursor)) {
            Err(LoaderError::Cursor { problem }) => assert!(problem.contains(what), "{problem}"),
            other => panic!("expected a cursor error, got {other:?}"),
        }
    }
}

#[test]
fn the_join_policy_pads_short_ranks_with_empty_batches() {
    let dir = tempfile::tempdir().expect("temp dir");
    // Rank 0 gets shards 0 and 2 (30 samples), rank 1 shard 1 (5).
    let shards = write_shards(dir.path(), &[15, 5, 15]);
    let planner = planned(shards, ClusterShape::new(1, 2, 1), 5, |_| {});
    let plan = planner.plan(0).expect("plan");
    let loader = loader(|_| {});
    let long = run_epoch(&loader, &plan, 0, eval(8));
    let short = run_epoch(&loader, &plan, 1, eval(8));
    assert_eq!(long.len(), 6);
    assert_eq!(short.len(), 6);
    let sizes: Vec<usize> = short.iter().map(|s| s.1.len()).collect();
    assert_eq!(sizes, [5, 0, 0, 0, 0, 0]);
}

#[test]
fn resampled_epochs_give_every_rank_the_same_batches() {
    let dir = tempfile::tempdir().expect("temp dir");
    let shards = write_shards(dir.path(), &[10, 13, 8]);
    let planner = planned(shards, ClusterShape::new(2, 1, 2), 4, |c| {
        c.mode = PlanMode::Resampled;
        c.policy = BatchPolicy::None;
        c.drop_partial = true;
        c.epoch_size = Some(96);
    });
    let plan = planner.plan(0).expect("plan");
    let loader = loader(|_| {});
    let steps = plan.steps().expect("resampled plans are consistent");
    for rank in 0..2 {
        let batches = run_epoch(&loader, &plan, rank, eval(8));
        assert_eq!(batches.len() as u64, steps);
        assert!(batches.iter().all(|b| b.1.len() == 4), "full batches only");
    }
}

#[test]
fn the_image_size_and_output_can_change_per_epoch() {
    let dir = tempfile::tempdir().expect("temp dir");
    let shards = write_shards(dir.path(), &[9]);
    let planner = planned(shards, ClusterShape::new(1, 1, 1), 3, |_| {});
    let loader = loader(|_| {});
    for (epoch, size) in [(0, 6), (1, 12)] {
        let plan = planner.plan(epoch).expect("plan");
        for batch in loader
            .epoch(&plan, Rank(0), train(size), None)
            .expect("epoch")
        {
            let batch = batch.expect("loads");
            assert_eq!(batch.size, size);
            assert_eq!(
                batch.pixels_u8().map(<[u8]>::len),
                Some(3 * (size * size * 3) as usize)
            );
        }
    }
    let mut normalised = TrainTransform::new(6);
    normalised.output = OutputFormat::IMAGENET_F32;
    let plan = planner.plan(2).expect("plan");
    for batch in loader
        .epoch(&plan, Rank(0), Transform::Train(normalised), None)
        .expect("epoch")
    {
        let batch = batch.expect("loads");
        let values = batch.pixels_f32().expect("f32 output");
        assert_eq!(values.len(), 3 * 3 * 6 * 6);
        assert!(values.iter().all(|v| v.is_finite() && v.abs() < 3.0));
    }
}

/// A shard with good samples and, at `bad`, samples that cannot be used.
fn shard_with_bad_samples(path: &Path) -> PlanShard {
    let file = std::fs::File::create(path).expect("create shard");
    let mut tar = TarWriter::new(file);
    let good = |j: usize| {
        Sample::new(format!("s0-{j:04}"))
            .with("png", png(0, j))
            .with("cls", label(0, j).to_string())
    };
    for j in 0..10 {
        let sample = match j {
            3 => Sample::new(format!("s0-{j:04}"))
                .with("png", b"\x89PNG\r\n\x1a\nnot really".to_vec())
                .with("cls", "1"),
            6 => Sample::new(format!("s0-{j:04}")).with("png", png(0, j)),
            _ => good(j),
        };
        tar.write(&sample).expect("write");
    }
    tar.finish().expect("finish");
    PlanShard::new(path.to_string_lossy(), Some(10))
}

#[test]
fn bad_samples_are_skipped_and_counted_or_fail_the_epoch() {
    let dir = tempfile::tempdir().expect("temp dir");
    let shard = shard_with_bad_samples(&dir.path().join("bad-000000.tar"));
    let planner = planned(vec![shard], ClusterShape::new(1, 1, 1), 4, |_| {});
    let plan = planner.plan(0).expect("plan");
    let steps = plan.steps().expect("consistent");

    let skipping = loader(|_| {});
    let mut epoch = skipping
        .epoch(&plan, Rank(0), eval(8), None)
        .expect("epoch");
    let sizes: Vec<usize> = epoch.by_ref().map(|b| b.expect("skips").len()).collect();
    assert_eq!(sizes.len() as u64, steps, "still the planned steps");
    assert_eq!(sizes.iter().sum::<usize>(), 8);
    let stats = epoch.stats();
    assert_eq!(stats.bad_samples, 2);
    assert_eq!(stats.samples, 8);
    let problems = stats.problems.join("\n");
    assert!(
        problems.contains("s0-0003") && problems.contains("png"),
        "{problems}"
    );
    assert!(
        problems.contains("s0-0006") && problems.contains("`cls`"),
        "{problems}"
    );

    let failing = loader(|c| c.errors = pipelines::ErrorPolicy::Fail);
    let error = failing
        .epoch(&plan, Rank(0), eval(8), None)
        .expect("epoch")
        .find_map(Result::err)
        .expect("the bad sample fails the epoch");
    let message = error.to_string();
    assert!(
        message.contains("bad-000000.tar") && message.contains("sample `s0-000"),
        "{message}"
    );
}

#[test]
fn a_missing_shard_is_skipped_or_named() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut shards = write_shards(dir.path(), &[8, 8]);
    let gone = dir.path().join("gone-000000.tar");
    shards.push(PlanShard::new(gone.to_string_lossy(), Some(8)));
    let planner = planned(shards, ClusterShape::new(1, 1, 1), 4, |_| {});
    let plan = planner.plan(0).expect("plan");

    let mut epoch = loader(|_| {})
        .epoch(&plan, Rank(0), eval(8), None)
        .expect("epoch");
    let served: usize = epoch.by_ref().map(|b| b.expect("skips").len()).sum();
    assert_eq!(served, 16);
    assert_eq!(epoch.stats().skipped_shards, 1);

    let error = loader(|c| c.errors = pipelines::ErrorPolicy::Fail)
        .epoch(&plan, Rank(0), eval(8), None)
        .expect("epoch")
        .find_map(Result::err)
        .expect("fails");
    assert!(error.to_string().contains("gone-000000.tar"), "{error}");
}

#[test]
fn dropping_an_epoch_early_stops_its_workers() {
    // Rank 7 of 8: its threads (`imgrun-load-r7w…`, `imgrun-read-r7w…`) are this test's
    // alone among the tests running beside it in this process.
    const RANK: u32 = 7;
    let dir = tempfile::tempdir().expect("temp dir");
    let shards = write_shards(dir.path(), &[400, 400]);
    let planner = planned(shards, ClusterShape::new(1, 8, 2), 4, |_| {});
    let plan = planner.plan(0).expect("plan");
    let loader = loader(|c| c.queue_batches = 1);
    assert!(
        rank_threads(RANK).is_empty(),
        "{:?} before any epoch",
        rank_threads(RANK)
    );
    // Each worker has 50 samples, and an epoch is dropped after its first batch: with one
    // batch queued, its workers are blocked handing over the next ones.
    let (report, dropped) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut running = Vec::new();
        for _ in 0..20 {
            let mut epoch = loader
                .epoch(&plan, Rank(RANK), eval(8), None)
                .expect("epoch");
            epoch.next().expect("a batch").expect("loads");
            running = rank_threads(RANK);
        }
        let _ = report.send(running);
    });
    let limit = Duration::from_secs(60);
    let running = dropped.recv_timeout(limit).unwrap_or_else(|error| {
        panic!("starting and dropping 20 epochs: {error} (blocked {limit:?}, or panicked)")
    });
    // Seen while the last epoch was alive: the check below looks for the right names.
    assert!(
        !running.is_empty(),
        "no loader threads seen for rank {RANK}"
    );
    // Every thread of the dropped epochs ends by itself.
    let deadline = Instant::now() + limit;
    loop {
        let left = rank_threads(RANK);
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "threads of dropped epochs still running after {limit:?}: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The names of this process's loader threads of `rank` (as Linux keeps them, cut to 15
/// bytes).
fn rank_threads(rank: u32) -> Vec<String> {
    let prefixes = [
        format!("imgrun-load-r{rank}w"),
        format!("imgrun-read-r{rank}w"),
    ];
    let tasks = std::fs::read_dir("/proc/self/task").expect("list /proc/self/task");
    tasks
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .map(|name| name.trim_end().to_owned())
        .filter(|name| prefixes.iter().any(|p| name.starts_with(p.as_str())))
        .collect()
}

#[test]
fn planned_batches_match_what_the_loader_serves_per_worker() {
    let dir = tempfile::tempdir().expect("temp dir");
    let shards = write_shards(dir.path(), &[13, 22, 9, 17, 30, 4]);
    let planner = planned(shards, ClusterShape::new(2, 1, 2), 4, |c| {
        c.policy = BatchPolicy::Drop { nbatches: None };
        c.drop_partial = true;
    });
    let plan = planner.plan(0).expect("plan");
    let loader = loader(|_| {});
    for rank in 0..2u32 {
        let mut per_worker: BTreeMap<u32, u64> = BTreeMap::new();
        for batch in loader
            .epoch(&plan, Rank(rank), eval(8), None)
            .expect("epoch")
        {
            let batch = batch.expect("loads");
            assert_eq!(batch.len(), 4, "drop_partial: full batches only");
            *per_worker
                .entry(batch.worker.expect("data batch").0)
                .or_default() += 1;
        }
        let want: BTreeMap<u32, u64> = plan.ranks[rank as usize]
            .workers
            .iter()
            .map(|w| (w.worker.0, w.batches.expect("known")))
            .filter(|&(_, n)| n > 0)
            .collect();
        assert_eq!(per_worker, want, "rank {rank}");
    }
}

/// Runs workers in this process, but passes every batch through the frame encoding, as a
/// loader actor and its trainer do; worker `cut` stops after `cut_after` frames, as a
/// lost loader does, and is started again from the cursor of the last batch passed on.
struct Framed {
    loader: Loader,
    cut: u32,
    cut_after: usize,
    restarts: std::sync::Arc<std::sync::atomic::AtomicU32>,
}

impl pipelines::LoaderWorkerPlacement for Framed {
    fn start(
        &mut self,
        run: pipelines::LoaderWorkerRun,
        tally: &pipelines::EpochTally,
    ) -> Result<std::sync::mpsc::Receiver<pipelines::LoaderWorkerMsg>, LoaderError> {
        use pipelines::{FrameDecoder, LoaderWorkerMsg, LoaderWorkerRun, encode_frame};
        use std::sync::mpsc::sync_channel;
        let (tx, rx) = sync_channel(2);
        let loader = self.loader.clone();
        let tally = tally.clone();
        let cut_after = (run.plan.worker.0 == self.cut).then_some(self.cut_after);
        let restarts = self.restarts.clone();
        std::thread::spawn(move || {
            let start = |run: LoaderWorkerRun| {
                let (remote_tx, remote_rx) = sync_channel(2);
                let remote = pipelines::EpochTally::default();
                loader
                    .start_worker(run, &remote, remote_tx)
                    .expect("worker starts");
                (remote_rx, remote)
            };
            let mut decoder =
                FrameDecoder::new(run.rank, run.plan.worker, run.transform, run.batch_size, 4)
                    .expect("decoder");
            let (mut remote_rx, mut remote) = start(run.clone());
            let (mut header, mut reported) = (Vec::new(), pipelines::EpochStats::default());
            let mut last = run.resume;
            let mut frames = 0;
            loop {
                let Ok(msg) = remote_rx.recv() else { return };
                if cut_after == Some(frames) {
                    // The loader is lost with what it had in flight; start again from
                    // the last batch passed on.
                    drop(remote_rx);
                    restarts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    (remote_rx, remote) = start(LoaderWorkerRun {
                        resume: last,
                        ..run.clone()
                    });
                    reported = pipelines::EpochStats::default();
                    frames += 1;
                    continue;
                }
                frames += 1;
                let now = remote.stats();
                let pixels =
                    encode_frame(&msg, now.since(&reported), &mut header).expect("encodes");
                reported = now;
                let mut frame = decoder.buffer();
                frame.clear();
                frame.extend_from_slice(pixels);
                frame.extend_from_slice(&header);
                let (msg, stats) = decoder.decode(frame).expect("decodes");
                tally.add(&stats);
                let end = !matches!(msg, LoaderWorkerMsg::Batch(..));
                if let LoaderWorkerMsg::Batch(_, cursor) = &msg {
                    last = *cursor;
                }
                if tx.send(msg).is_err() || end {
                    return;
                }
            }
        });
        Ok(rx)
    }
}

#[test]
fn batches_through_frames_and_a_worker_restarted_mid_epoch_match_local_loading() {
    let dir = tempfile::tempdir().expect("temp dir");
    let shards = write_shards(dir.path(), &[23, 17, 30, 9, 21, 14]);
    let planner = planned(shards, ClusterShape::new(1, 2, 3), 4, |_| {});
    let plan = planner.plan(0).expect("plan");
    let loader = loader(|c| c.mix_batches = 2);
    for rank in 0..2 {
        let local = run_epoch(&loader, &plan, rank, train(8));
        for (cut, cut_after) in [(9, 0), (0, 0), (1, 2), (2, 3)] {
            let restarts = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
            let mut framed = Framed {
                loader: loader.clone(),
                cut,
                cut_after,
                restarts: restarts.clone(),
            };
            let placed: Vec<Seen> = loader
                .epoch_placed(&plan, Rank(rank), train(8), None, &mut framed)
                .expect("epoch starts")
                .map(|b| seen(&b.expect("batch loads")))
                .collect();
            assert_eq!(
                placed, local,
                "rank {rank}, worker {cut} lost after {cut_after} frames"
            );
            let expected = u32::from(cut < 3);
            assert_eq!(
                restarts.load(std::sync::atomic::Ordering::Relaxed),
                expected
            );
        }
    }
}

/// Runs `plan`'s epoch on every rank up to `cut` batches; returns what each served and
/// each rank's cursor there.
fn run_until(
    loader: &Loader,
    plan: &Plan,
    cut: usize,
    transform: Transform,
) -> (Vec<Vec<Seen>>, Vec<RankCursor>) {
    let mut served = Vec::new();
    let mut cursors = Vec::new();
    for rank in 0..plan.ranks.len() as u32 {
        let mut epoch = loader
            .epoch(plan, Rank(rank), transform, None)
            .expect("epoch starts");
        served.push(
            epoch
                .by_ref()
                .take(cut)
                .map(|b| seen(&b.expect("batch")))
                .collect(),
        );
        cursors.push(epoch.cursor().clone());
    }
    (served, cursors)
}

/// A shrink mid-epoch: three ranks run a few steps, rank 1 is lost, and the two
/// survivors take over its loader workers where they stood. Every sample of the epoch
/// is served exactly once (what rank 1 served before the loss counts, what it had not
/// served comes from the survivors), the survivors run the same number of steps, and
/// rank 1's workers go on with the very batches (ids, crops) they would have served.
#[test]
fn survivors_of_a_lost_rank_serve_the_rest_of_its_epoch_exactly_once() {
    let dir = tempfile::tempdir().expect("temp dir");
    let counts = [23, 17, 30, 9, 21, 14, 26];
    let total: u64 = counts.iter().sum();
    let shards = write_shards(dir.path(), &counts);
    let planner = planned(shards, ClusterShape::new(3, 1, 2), 4, |_| {});
    let plan = planner.plan(1).expect("plan");
    let loader = loader(|_| {});
    let whole: Vec<Vec<Seen>> = (0..3)
        .map(|r| run_epoch(&loader, &plan, r, train(8)))
        .collect();
    for cut in [0, 3, 7] {
        let (before, cursors) = run_until(&loader, &plan, cut, train(8));
        let survivors = [Rank(0), Rank(2)];
        let regrouped = pipelines::regroup(
            &plan,
            &cursors,
            &survivors,
            ClusterShape::with_node_ranks(vec![1, 1], 2),
        )
        .expect("regroup");
        let steps = regrouped.plan.steps().expect("consistent under join");
        let mut after = Vec::new();
        for rank in 0..2u32 {
            let rest: Vec<Seen> = loader
                .epoch(
                    &regrouped.plan,
                    Rank(rank),
                    train(8),
                    Some(&regrouped.cursors[rank as usize]),
                )
                .expect("the rest starts")
                .map(|b| seen(&b.expect("batch")))
                .collect();
            assert_eq!(
                rest.len() as u64 + cut as u64,
                steps,
                "cut {cut} rank {rank}"
            );
            assert_eq!(rest.first().map(|s| s.0), Some(cut as u64), "steps go on");
            after.push(rest);
        }
        // Survivor 0 keeps its own stream first: its next batch is the one it would
        // have served.
        assert_eq!(after[0][0], whole[0][cut]);
        let mut ids: Vec<SampleId> = before
            .iter()
            .chain(&after)
            .flatten()
            .flat_map(|s| s.1.clone())
            .collect();
        assert_eq!(ids.len() as u64, total, "cut {cut}: every sample served");
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len() as u64, total, "cut {cut}: no sample twice");
        // Each of rank 1's unserved batches comes out whole, pixels and all.
        let rest_of_lost: Vec<&Seen> = whole[1][cut..].iter().filter(|s| !s.1.is_empty()).collect();
        let served_after: Vec<(&Vec<SampleId>, &Vec<u8>)> =
            after.iter().flatten().map(|s| (&s.1, &s.3)).collect();
        for lost in rest_of_lost {
            assert!(
                served_after.contains(&(&lost.1, &lost.3)),
                "cut {cut}: rank 1's batch {} is served as it would have been",
                lost.0
            );
        }

        // A second loss in the same epoch regroups the regrouped plan.
        let (_, cursors) = {
            let mut served = Vec::new();
            let mut cursors = Vec::new();
            for rank in 0..2u32 {
                let mut epoch = loader
                    .epoch(
                        &regrouped.plan,
                        Rank(rank),
                        train(8),
                        Some(&regrouped.cursors[rank as usize]),
                    )
                    .expect("epoch");
                served.push(epoch.by_ref().take(2).count());
                cursors.push(epoch.cursor().clone());
            }
            (served, cursors)
        };
        let last = pipelines::regroup(
            &regrouped.plan,
            &cursors,
            &[Rank(1)],
            ClusterShape::with_node_ranks(vec![1], 2),
        )
        .expect("regroup again");
        assert_eq!(
            last.plan.ranks[0].workers.len(),
            6,
            "one rank runs all six workers"
        );
        assert_eq!(last.cursors[0].steps, cut as u64 + 2);
    }
}

#[test]
fn regrouping_refuses_cursors_it_cannot_continue() {
    let dir = tempfile::tempdir().expect("temp dir");
    let shards = write_shards(dir.path(), &[20, 20, 20]);
    let planner = planned(shards, ClusterShape::new(3, 1, 1), 4, |_| {});
    let plan = planner.plan(0).expect("plan");
    let loader = loader(|_| {});
    let (_, mut cursors) = run_until(&loader, &plan, 2, eval(8));
    let two = ClusterShape::with_node_ranks(vec![1, 1], 1);
    let refused =
        |cursors: &[RankCursor], survivors: &[Rank], shape: ClusterShape| match pipelines::regroup(
            &plan, cursors, survivors, shape,
        ) {
            Err(LoaderError::Regroup { problem } | LoaderError::Cursor { problem }) => problem,
            other => panic!("not refused: {other:?}"),
        };
    assert!(refused(&cursors[..2], &[Rank(0), Rank(1)], two.clone()).contains("2 cursors"));
    assert!(refused(&cursors, &[Rank(1), Rank(0)], two.clone()).contains("ascending"));
    assert!(refused(&cursors, &[Rank(0), Rank(5)], two.clone()).contains("rank 5"));
    assert!(refused(&cursors, &[Rank(0)], two.clone()).contains("not the 1 survivors"));
    cursors[2].steps += 1;
    assert!(refused(&cursors, &[Rank(0), Rank(1)], two).contains("same step"));
}

/// Under `drop`, the regrouped ranks are cut to the shortest one: equal steps, no sample
/// twice, and the plan says how many batches it dropped.
#[test]
fn a_regroup_under_drop_cuts_the_ranks_to_the_shortest_and_repeats_nothing() {
    let dir = tempfile::tempdir().expect("temp dir");
    let shards = write_shards(dir.path(), &[23, 17, 30, 9, 21, 14]);
    let planner = planned(shards, ClusterShape::new(3, 1, 2), 4, |c| {
        c.policy = BatchPolicy::Drop { nbatches: None };
    });
    let plan = planner.plan(0).expect("plan");
    let loader = loader(|_| {});
    let (before, cursors) = run_until(&loader, &plan, 2, eval(8));
    let regrouped = pipelines::regroup(
        &plan,
        &cursors,
        &[Rank(1), Rank(2)],
        ClusterShape::with_node_ranks(vec![1, 1], 2),
    )
    .expect("regroup");
    let steps = regrouped.plan.steps().expect("consistent under drop");
    let mut ids: Vec<SampleId> = before.iter().flatten().flat_map(|s| s.1.clone()).collect();
    for rank in 0..2u32 {
        let rest: Vec<Seen> = loader
            .epoch(
                &regrouped.plan,
                Rank(rank),
                eval(8),
                Some(&regrouped.cursors[rank as usize]),
            )
            .expect("the rest starts")
            .map(|b| seen(&b.expect("batch")))
            .collect();
        assert_eq!(rest.len() as u64 + 2, steps, "rank {rank}");
        assert!(
            rest.iter().all(|s| !s.1.is_empty()),
            "no empty batch under drop"
        );
        ids.extend(rest.into_iter().flat_map(|s| s.1));
    }
    let served = ids.len();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), served, "no sample twice");
    let dropped: u64 = regrouped.plan.ranks.iter().map(|r| r.dropped_batches).sum();
    let (left, empty): (Vec<u64>, Vec<u64>) = regrouped.left.iter().copied().unzip();
    assert!(left.iter().all(|&l| l == left[0]) && empty.iter().all(|&e| e == 0));
    eprintln!("served {served} of 114 samples; {dropped} batch(es) dropped by the regroup");
}
