//! TensorBoard event files of a run: `runs/NAME/tb/events.out.tfevents.*`, written by the
//! job as it writes `metrics.jsonl` (one writer per run, never one per rank), and by
//! `imgrun export tb RUN` from any earlier run's `metrics.jsonl`. Both go through
//! [`EventFiles`] (and so [`Scalars`]), so a run's exported files hold the same events as
//! the ones it wrote live.
//!
//! The format is TensorFlow's record file: each record is its length (u64, little
//! endian), the masked CRC-32C of those 8 bytes, the data, and the data's masked CRC-32C;
//! each record's data is one protobuf `Event` (`wall_time` = 1, `step` = 2,
//! `file_version` = 3, `summary` = 5, `session_log` = 7; 6 is the retired
//! `log_message`). The first event of a file says `brain.Event:2`. Scalars are
//! `Summary.Value`s (`tag` = 1, `simple_value` = 2). A resumed run begins with a `SessionLog` of status `START` at the first step it writes,
//! one past its checkpoint's, so TensorBoard drops what an earlier run wrote past the
//! checkpoint (as `metrics.jsonl`'s rewind does) and shows one curve. (TensorBoard keeps
//! only the events of steps below a `START`'s: at the checkpoint's own step it would drop
//! that step's values too, which no run writes again.)
//!
//! Tags, by record:
//! - step: `train/loss`, `train/top1` (the batch's accuracy), `train/lr`,
//!   `train/images_per_s`, `train/data_wait` (seconds), `train/allreduce_ms`, and
//!   `train/loss_scale` when the job scales its loss;
//! - eval: `eval/loss`, `eval/top1`, `eval/top5`;
//! - epoch (at the epoch's last step): `epoch/train_loss`, `epoch/train_top1`,
//!   `epoch/images_per_s`;
//! - job and regroup: `job/world`, the number of ranks from that step on.
//!
//! Per-rank runs (`train.tensorboard_ranks`): a step record that carries each rank's own
//! figures also goes, rank by rank, to a run of its own, `tb/rank-N/`, with the same tags
//! in every rank's run so that TensorBoard overlays them: `rank/step_s`,
//! `rank/data_wait` (seconds), `rank/compute_s` and `rank/allreduce_ms`. The coordinator
//! writes them too; no rank writes a file. A resumed run's first event in each rank's run
//! is the same `START` as in the main one.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use super::JobError;
use crate::train::{MetricsRecord, RankStep, StepMetrics};

/// The folder of a run's event files.
pub const TB_DIR: &str = "tb";

/// Which TensorBoard run (a folder of event files) an event goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Run {
    /// The job's figures, in `tb/` itself.
    Main,
    /// One rank's own figures, in `tb/rank-N/`.
    Rank(u32),
}

impl Run {
    /// The folder of this run's event files, in the run folder's `tb` folder.
    pub fn dir(self, tb: &Path) -> PathBuf {
        match self {
            Run::Main => tb.to_path_buf(),
            Run::Rank(rank) => tb.join(format!("rank-{rank}")),
        }
    }
}

/// What one event says, besides its time and step.
#[derive(Debug, Clone, PartialEq)]
pub enum What {
    Scalar {
        tag: &'static str,
        value: f32,
    },
    /// A (resumed) run starts here: TensorBoard drops later steps of earlier files.
    Start,
}

/// One event of the file.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// The run (event file) it goes to.
    pub run: Run,
    /// Seconds since the Unix epoch.
    pub wall_time: f64,
    pub step: u64,
    pub what: What,
}

/// Turns `metrics.jsonl` records into events: a pure function of the records, which keeps
/// only the time the current run started (records carry their seconds since then), the
/// step its `START` marks, and which ranks' runs have had their `START`.
#[derive(Debug, Default)]
pub struct Scalars {
    started: f64,
    /// A resumed run's first step, where its `START` goes; none for a fresh run.
    start_step: Option<u64>,
    /// The ranks with an event since the current run started.
    ranks_begun: BTreeSet<u32>,
}

impl Scalars {
    /// When the current run started (its job record's time), in seconds since the Unix
    /// epoch.
    pub fn started(&self) -> f64 {
        self.started
    }

    /// The events of `record`, in the order they are written.
    pub fn events(&mut self, record: &MetricsRecord) -> Vec<Event> {
        match record {
            MetricsRecord::Job(job) => {
                self.started = job.time as f64;
                // The first step this run writes (see the module's doc).
                self.start_step = job.resumed_at_step.map(|saved| saved + 1);
                self.ranks_begun.clear();
                let step = self.start_step.unwrap_or(0);
                let mut events = Vec::new();
                if self.start_step.is_some() {
                    events.push(self.start(Run::Main, step));
                }
                if let Some(world) = job.world {
                    events.push(self.scalar(Run::Main, (step, 0.0), "job/world", world.into()));
                }
                events
            }
            MetricsRecord::Step(s) => self.step_events(s),
            MetricsRecord::Eval(e) => self.series(
                Run::Main,
                (e.step, e.elapsed_s),
                &[
                    ("eval/loss", e.loss),
                    ("eval/top1", e.top1),
                    ("eval/top5", e.top5),
                ],
            ),
            MetricsRecord::Epoch(e) => self.series(
                Run::Main,
                (e.step, e.elapsed_s),
                &[
                    ("epoch/train_loss", e.train_loss),
                    ("epoch/train_top1", e.train_accuracy),
                    ("epoch/images_per_s", e.images_per_s),
                ],
            ),
            MetricsRecord::Regroup(r) => {
                self.series(Run::Main, (r.step, 0.0), &[("job/world", r.world.into())])
            }
            MetricsRecord::Connect(_)
            | MetricsRecord::Stop(_)
            | MetricsRecord::Late(_)
            | MetricsRecord::Samples(_)
            | MetricsRecord::Unknown => Vec::new(),
        }
    }

    /// A step record's events: the job's scalars, then each rank's in its own run.
    fn step_events(&mut self, s: &StepMetrics) -> Vec<Event> {
        let mut values = vec![
            ("train/loss", s.loss),
            ("train/top1", s.accuracy),
            ("train/lr", s.lr),
            ("train/images_per_s", s.images_per_s),
            ("train/data_wait", s.data_wait_s),
            ("train/allreduce_ms", s.allreduce_s * 1e3),
        ];
        if let Some(scale) = s.loss_scale {
            values.push(("train/loss_scale", scale));
        }
        let mut events = self.series(Run::Main, (s.step, s.elapsed_s), &values);
        for rank in &s.ranks {
            events.extend(self.rank_events(rank, s.step, s.elapsed_s));
        }
        events
    }

    /// One rank's events of a step, led by its run's `START` at its first step of a
    /// resumed run.
    fn rank_events(&mut self, figures: &RankStep, step: u64, elapsed_s: f64) -> Vec<Event> {
        let run = Run::Rank(figures.rank);
        let mut events = Vec::new();
        if self.ranks_begun.insert(figures.rank)
            && let Some(start) = self.start_step
        {
            events.push(self.start(run, start));
        }
        events.extend(self.series(
            run,
            (step, elapsed_s),
            &[
                ("rank/step_s", figures.step_s),
                ("rank/data_wait", figures.data_wait_s),
                ("rank/compute_s", figures.compute_s),
                ("rank/allreduce_ms", figures.allreduce_s * 1e3),
            ],
        ));
        events
    }

    /// A `START` of `run` at `step`, when the current run started.
    fn start(&self, run: Run, step: u64) -> Event {
        Event {
            run,
            wall_time: self.started,
            step,
            what: What::Start,
        }
    }

    /// A scalar of `run` at `step`, `elapsed_s` after the current run started.
    fn scalar(
        &self,
        run: Run,
        (step, elapsed_s): (u64, f64),
        tag: &'static str,
        value: f64,
    ) -> Event {
        Event {
            run,
            wall_time: self.started + elapsed_s,
            step,
            what: What::Scalar {
                tag,
                value: value as f32,
            },
        }
    }

    /// Scalars of `run` at one step, `elapsed_s` after the current run started.
    fn series(&self, run: Run, at: (u64, f64), values: &[(&'static str, f64)]) -> Vec<Event> {
        values
            .iter()
            .map(|&(tag, value)| self.scalar(run, at, tag, value))
            .collect()
    }
}

/// An event file being written: records appended and flushed as they come, so that
/// TensorBoard sees a running job's steps.
#[derive(Debug)]
pub struct EventFile {
    file: File,
    path: PathBuf,
}

impl EventFile {
    /// A new event file in `dir` (made if missing), named for `wall_time` and `suffix`
    /// (a file per job start, so that a resumed run's file follows the earlier ones).
    pub fn create(dir: &Path, wall_time: f64, suffix: &str) -> Result<EventFile, JobError> {
        std::fs::create_dir_all(dir)
            .map_err(JobError::io(format!("creating {}", dir.display())))?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_else(|_| "localhost".into());
        let name = format!(
            "events.out.tfevents.{:010}.{host}.{}.{suffix}",
            wall_time as u64,
            std::process::id()
        );
        let path = dir.join(name);
        let file =
            File::create(&path).map_err(JobError::io(format!("creating {}", path.display())))?;
        let mut events = EventFile { file, path };
        events.append(&encode_event(wall_time, 0, Body::Version))?;
        Ok(events)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `events` (whatever their [`Run`]: the caller picks the file).
    pub fn write<'a>(
        &mut self,
        events: impl IntoIterator<Item = &'a Event>,
    ) -> Result<(), JobError> {
        for event in events {
            let body = match &event.what {
                What::Scalar { tag, value } => Body::Scalar { tag, value: *value },
                What::Start => Body::Start,
            };
            self.append(&encode_event(event.wall_time, event.step, body))?;
        }
        Ok(())
    }

    fn append(&mut self, data: &[u8]) -> Result<(), JobError> {
        self.file
            .write_all(&record(data))
            .map_err(JobError::io(format!("writing {}", self.path.display())))
    }
}

/// The one writer of a run's event files: records in, each event appended to its
/// [`Run`]'s file in the `tb` folder, a file made at its run's first event (named for
/// the time the current run started and `suffix`). The job keeps one per job start;
/// `imgrun export tb` one for the whole `metrics.jsonl`.
#[derive(Debug)]
pub struct EventFiles {
    tb: PathBuf,
    suffix: &'static str,
    scalars: Scalars,
    files: BTreeMap<Run, EventFile>,
}

impl EventFiles {
    /// Writes into `tb` (the run folder's `tb/`), naming files with `suffix`.
    pub fn new(tb: &Path, suffix: &'static str) -> EventFiles {
        EventFiles {
            tb: tb.to_path_buf(),
            suffix,
            scalars: Scalars::default(),
            files: BTreeMap::new(),
        }
    }

    /// Appends the events of `record`; returns how many.
    pub fn write(&mut self, record: &MetricsRecord) -> Result<usize, JobError> {
        let events = self.scalars.events(record);
        let runs: BTreeSet<Run> = events.iter().map(|e| e.run).collect();
        for run in runs {
            self.file(run)?
                .write(events.iter().filter(|e| e.run == run))?;
        }
        Ok(events.len())
    }

    /// `run`'s file, made if it is not yet.
    pub fn file(&mut self, run: Run) -> Result<&mut EventFile, JobError> {
        if !self.files.contains_key(&run) {
            let file = EventFile::create(&run.dir(&self.tb), self.scalars.started(), self.suffix)?;
            self.files.insert(run, file);
        }
        // Invariant: inserted just above when missing.
        Ok(self.files.get_mut(&run).expect("the run's file"))
    }

    /// The files written so far, the main one first, then the ranks' by rank.
    pub fn paths(&self) -> impl Iterator<Item = &Path> {
        self.files.values().map(EventFile::path)
    }
}

/// What [`export`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct Exported {
    /// The main event file.
    pub file: PathBuf,
    /// Each rank's event file, by rank (none when the records carry no rank's figures).
    pub rank_files: Vec<PathBuf>,
    /// Events over every file.
    pub events: usize,
}

/// Writes the event files of the run whose `metrics.jsonl` is at `metrics` into `dir`
/// (the main one, and `rank-N/` ones when its step records carry each rank's figures).
/// Lines that are no record (a line cut short by a crash) are skipped, as `imgrun plot`
/// does.
pub fn export(metrics: &Path, dir: &Path) -> Result<Exported, JobError> {
    let open =
        File::open(metrics).map_err(JobError::io(format!("reading {}", metrics.display())))?;
    let mut files = EventFiles::new(dir, "export");
    let mut records = 0;
    let mut events = 0;
    for line in BufReader::new(open).lines() {
        let line = line.map_err(JobError::io(format!("reading {}", metrics.display())))?;
        let Ok(record) = serde_json::from_str::<MetricsRecord>(&line) else {
            continue;
        };
        records += 1;
        events += files.write(&record)?;
    }
    if records == 0 {
        return Err(JobError::Refused(format!(
            "{}: no metrics record in it",
            metrics.display()
        )));
    }
    let file = files.file(Run::Main)?.path().to_path_buf();
    let rank_files = files.paths().skip(1).map(Path::to_path_buf).collect();
    Ok(Exported {
        file,
        rank_files,
        events,
    })
}

/// What an event carries.
enum Body<'a> {
    Version,
    Scalar { tag: &'a str, value: f32 },
    Start,
}

/// The protobuf bytes of one `Event`.
fn encode_event(wall_time: f64, step: u64, body: Body) -> Vec<u8> {
    let mut event = Vec::with_capacity(64);
    // wall_time: field 1, 64-bit.
    event.push(1 << 3 | 1);
    event.extend_from_slice(&wall_time.to_le_bytes());
    if step != 0 {
        // step: field 2, varint.
        event.push(2 << 3);
        varint(&mut event, step);
    }
    match body {
        Body::Version => {
            // file_version: field 3, bytes.
            bytes_field(&mut event, 3, b"brain.Event:2");
        }
        Body::Scalar { tag, value } => {
            // Summary.Value: tag (1, bytes), simple_value (2, 32-bit).
            let mut value_bytes = Vec::with_capacity(tag.len() + 8);
            bytes_field(&mut value_bytes, 1, tag.as_bytes());
            value_bytes.push(2 << 3 | 5);
            value_bytes.extend_from_slice(&value.to_le_bytes());
            // Summary: value (1, bytes); Event.summary: field 5.
            let mut summary = Vec::with_capacity(value_bytes.len() + 4);
            bytes_field(&mut summary, 1, &value_bytes);
            bytes_field(&mut event, 5, &summary);
        }
        Body::Start => {
            // SessionLog: status (1, varint) START = 1; Event.session_log: field 7.
            bytes_field(&mut event, 7, &[1 << 3, 1]);
        }
    }
    event
}

fn varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn bytes_field(out: &mut Vec<u8>, field: u8, bytes: &[u8]) {
    out.push(field << 3 | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// TensorFlow's record framing of `data`.
fn record(data: &[u8]) -> Vec<u8> {
    let length = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&length);
    out.extend_from_slice(&masked_crc(&length).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

/// TensorFlow's masked CRC-32C.
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::{EvalRecord, JobRecord, RankStep, StepMetrics};

    /// Reads records back: (data) per record, checking both CRCs.
    fn records(bytes: &[u8]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            let length: [u8; 8] = bytes[at..at + 8].try_into().expect("length");
            let crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().expect("crc"));
            assert_eq!(crc, masked_crc(&length));
            let len = u64::from_le_bytes(length) as usize;
            let data = &bytes[at + 12..at + 12 + len];
            let crc =
                u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().expect("crc"));
            assert_eq!(crc, masked_crc(data));
            out.push(data.to_vec());
            at += 16 + len;
        }
        out
    }

    #[test]
    fn the_masked_crc_is_tensorflows() {
        // CRC-32C check value (RFC 3720) and its mask.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(
            masked_crc(b"123456789"),
            0xe306_9283u32.rotate_right(15).wrapping_add(0xa282_ead8)
        );
    }

    #[test]
    fn events_encode_as_protobuf() {
        let cases: [(Body, &[u8]); 3] = [
            (Body::Version, b"\x1a\x0dbrain.Event:2"),
            // Event.session_log is field 7 (tag 0x3a); SessionLog.status START = 1.
            (Body::Start, b"\x3a\x02\x08\x01"),
            (
                Body::Scalar {
                    tag: "a/b",
                    value: 1.5,
                },
                b"\x2a\x0c\x0a\x0a\x0a\x03a/b\x15\x00\x00\xc0\x3f",
            ),
        ];
        for (body, tail) in cases {
            let event = encode_event(2.0, 300, body);
            let mut head = vec![0x09];
            head.extend_from_slice(&2.0f64.to_le_bytes());
            head.extend_from_slice(&[0x10, 0xac, 0x02]);
            assert_eq!(&event[..head.len()], &head[..]);
            assert_eq!(&event[head.len()..], tail);
        }
    }

    #[test]
    fn records_become_scalars_and_a_resume_starts_a_session() {
        let mut scalars = Scalars::default();
        let job = MetricsRecord::Job(JobRecord {
            time: 1000,
            world: Some(2),
            resumed_at_step: Some(7),
            ..JobRecord::default()
        });
        let step = MetricsRecord::Step(StepMetrics {
            step: 8,
            loss: 2.5,
            accuracy: 0.25,
            lr: 0.1,
            images_per_s: 100.0,
            data_wait_s: 0.5,
            allreduce_s: 0.002,
            elapsed_s: 3.0,
            ..StepMetrics::default()
        });
        let eval = MetricsRecord::Eval(EvalRecord {
            step: 8,
            loss: 1.0,
            top1: 0.5,
            top5: 0.75,
            elapsed_s: 4.0,
            ..EvalRecord::default()
        });
        let mut got = Vec::new();
        for record in [job, step, eval] {
            for event in scalars.events(&record) {
                let what = match event.what {
                    What::Scalar { tag, value } => format!("{tag}={value}"),
                    What::Start => "start".into(),
                };
                assert_eq!(event.run, Run::Main, "{what}");
                got.push((event.wall_time, event.step, what));
            }
        }
        let want: Vec<(f64, u64, String)> = [
            (1000.0, 8, "start"),
            (1000.0, 8, "job/world=2"),
            (1003.0, 8, "train/loss=2.5"),
            (1003.0, 8, "train/top1=0.25"),
            (1003.0, 8, "train/lr=0.1"),
            (1003.0, 8, "train/images_per_s=100"),
            (1003.0, 8, "train/data_wait=0.5"),
            (1003.0, 8, "train/allreduce_ms=2"),
            (1004.0, 8, "eval/loss=1"),
            (1004.0, 8, "eval/top1=0.5"),
            (1004.0, 8, "eval/top5=0.75"),
        ]
        .into_iter()
        .map(|(t, s, w)| (t, s, w.to_owned()))
        .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn an_export_frames_every_event_and_begins_with_the_version() {
        let dir = tempfile::tempdir().expect("temp dir");
        let metrics = dir.path().join("metrics.jsonl");
        std::fs::write(
            &metrics,
            "{\"kind\":\"job\",\"time\":5,\"world\":1}\n\
             {\"kind\":\"step\",\"epoch\":0,\"step\":1,\"loss\":2.0,\"lr\":0.1,\"images_per_s\":9}\n\
             {\"kind\":\"step\",\"epoch\":0,\"st\n",
        )
        .expect("write");
        let exported = export(&metrics, &dir.path().join(TB_DIR)).expect("export");
        assert_eq!(exported.events, 7);
        assert_eq!(exported.rank_files, Vec::<PathBuf>::new());
        let path = exported.file;
        let name = path
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        assert!(
            name.starts_with("events.out.tfevents.0000000005."),
            "{name}"
        );
        let records = records(&std::fs::read(&path).expect("read"));
        assert_eq!(records.len(), 8);
        assert!(records[0].ends_with(b"brain.Event:2"));

        std::fs::write(&metrics, "not json\n").expect("write");
        let error = export(&metrics, dir.path()).expect_err("nothing to export");
        assert!(error.to_string().contains("no metrics record"), "{error}");
    }

    /// A job record at time 1000 (resumed after `resumed_at_step`, if some).
    fn job(resumed_at_step: Option<u64>) -> MetricsRecord {
        MetricsRecord::Job(JobRecord {
            time: 1000,
            world: Some(2),
            resumed_at_step,
            ..JobRecord::default()
        })
    }

    /// A step record `step` seconds after the job started, with the ranks' figures of
    /// `ranks` (rank r: step time r + 0.5, data wait r + 0.25, compute r + 0.125,
    /// allreduce r + 0.001 s).
    fn step(step: u64, ranks: &[u32]) -> MetricsRecord {
        MetricsRecord::Step(StepMetrics {
            step,
            loss: 2.0,
            elapsed_s: step as f64,
            ranks: ranks
                .iter()
                .map(|&rank| {
                    let r = f64::from(rank);
                    RankStep {
                        rank,
                        step_s: r + 0.5,
                        data_wait_s: r + 0.25,
                        compute_s: r + 0.125,
                        allreduce_s: r + 0.001,
                    }
                })
                .collect(),
            ..StepMetrics::default()
        })
    }

    /// `event` as `RUN STEP WHAT @WALL_TIME`.
    fn line(event: &Event) -> String {
        let run = match event.run {
            Run::Main => "main".to_owned(),
            Run::Rank(rank) => format!("rank-{rank}"),
        };
        let what = match &event.what {
            What::Scalar { tag, value } => format!("{tag}={value}"),
            What::Start => "start".to_owned(),
        };
        format!("{run} {} {what} @{}", event.step, event.wall_time)
    }

    /// The four lines of rank `rank`'s step `step` (as [`step`] makes them).
    fn rank_lines(rank: u32, step: u64) -> Vec<String> {
        let r = rank as f32;
        let ms = ((f64::from(rank) + 0.001) * 1e3) as f32;
        [
            format!("rank/step_s={}", r + 0.5),
            format!("rank/data_wait={}", r + 0.25),
            format!("rank/compute_s={}", r + 0.125),
            format!("rank/allreduce_ms={ms}"),
        ]
        .into_iter()
        .map(|what| format!("rank-{rank} {step} {what} @{}", 1000 + step))
        .collect()
    }

    #[test]
    fn the_ranks_figures_become_runs_of_their_own_with_a_start_after_a_resume() {
        let start = |rank: u32, step: u64| vec![format!("rank-{rank} {step} start @1000")];
        // (what the case is, its records, the rank runs' lines, in groups).
        type Case = (&'static str, Vec<MetricsRecord>, Vec<Vec<String>>);
        let cases: Vec<Case> = vec![
            (
                "no ranks' figures: no rank runs",
                vec![job(None), step(1, &[])],
                vec![],
            ),
            (
                "a fresh run: each rank's scalars, no start",
                vec![job(None), step(1, &[0, 1])],
                vec![rank_lines(0, 1), rank_lines(1, 1)],
            ),
            (
                "a resumed run: each rank's run starts at its first step, once",
                vec![job(Some(7)), step(8, &[0, 1]), step(9, &[0, 1])],
                vec![
                    start(0, 8),
                    rank_lines(0, 8),
                    start(1, 8),
                    rank_lines(1, 8),
                    rank_lines(0, 9),
                    rank_lines(1, 9),
                ],
            ),
            (
                "a run and its resume in one file: the resume starts each rank again",
                vec![
                    job(None),
                    step(1, &[0]),
                    step(2, &[0]),
                    job(Some(1)),
                    step(2, &[0]),
                ],
                vec![
                    rank_lines(0, 1),
                    rank_lines(0, 2),
                    start(0, 2),
                    rank_lines(0, 2),
                ],
            ),
            (
                "a rank that joins a resumed run later starts at the run's first step",
                vec![job(Some(7)), step(8, &[0]), step(9, &[0, 1])],
                vec![
                    start(0, 8),
                    rank_lines(0, 8),
                    rank_lines(0, 9),
                    start(1, 8),
                    rank_lines(1, 9),
                ],
            ),
        ];
        for (name, records, want) in cases {
            let (mut with, mut without) = (Scalars::default(), Scalars::default());
            let mut got = Vec::new();
            for record in &records {
                let events = with.events(record);
                // The job's own events are the same with the ranks' figures or without.
                let mut stripped = record.clone();
                if let MetricsRecord::Step(s) = &mut stripped {
                    s.ranks.clear();
                }
                let main: Vec<Event> = events
                    .iter()
                    .filter(|e| e.run == Run::Main)
                    .cloned()
                    .collect();
                assert_eq!(main, without.events(&stripped), "{name}");
                got.extend(events.iter().filter(|e| e.run != Run::Main).map(line));
            }
            assert_eq!(got, want.concat(), "{name}");
        }
    }

    #[test]
    fn an_export_writes_the_rank_runs_the_live_writer_wrote_byte_for_byte() {
        let dir = tempfile::tempdir().expect("temp dir");
        let written_records = [job(None), step(1, &[0, 1]), job(Some(1)), step(2, &[0, 1])];
        let mut live = EventFiles::new(&dir.path().join("live"), "imgrun");
        let mut text = String::new();
        for record in &written_records {
            live.write(record).expect("write");
            text.push_str(&serde_json::to_string(record).expect("encode"));
            text.push('\n');
        }
        let metrics = dir.path().join("metrics.jsonl");
        std::fs::write(&metrics, text).expect("write");
        let exported = export(&metrics, &dir.path().join("exported")).expect("export");
        // Main: 2 job/world, a start, 2 steps of 6; each rank: a start and 2 steps of 4.
        assert_eq!(exported.events, 2 + 1 + 12 + 2 * 9);
        let live: Vec<&Path> = live.paths().collect();
        let mut written = vec![exported.file.clone()];
        written.extend(exported.rank_files.iter().cloned());
        assert_eq!(written.len(), 3, "{written:?}");
        for (live, exported) in live.iter().zip(&written) {
            // The same folder under each writer's `tb`: the main one, or `rank-N/`.
            let folder = |path: &Path, tb: &str| {
                let inside = path.strip_prefix(dir.path().join(tb)).expect("under tb");
                inside.parent().map(Path::to_path_buf)
            };
            assert_eq!(folder(live, "live"), folder(exported, "exported"));
            let bytes = std::fs::read(exported).expect("read");
            assert_eq!(
                std::fs::read(live).expect("read"),
                bytes,
                "{}",
                exported.display()
            );
            assert!(records(&bytes)[0].ends_with(b"brain.Event:2"));
        }
        assert!(written[1].starts_with(dir.path().join("exported").join("rank-0")));
        assert!(written[2].starts_with(dir.path().join("exported").join("rank-1")));
    }
}
