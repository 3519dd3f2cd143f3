//! TensorBoard event files of a run: `runs/NAME/tb/events.out.tfevents.*`, written by the
//! job as it writes `metrics.jsonl` (one writer per run, never one per rank), and by
//! `imgrun export tb RUN` from any earlier run's `metrics.jsonl`. Both go through
//! [`Scalars`], so a run's exported files hold the same events as the ones it wrote live.
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

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use super::JobError;
use crate::train::MetricsRecord;

/// The folder of a run's event files.
pub const TB_DIR: &str = "tb";

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
    /// Seconds since the Unix epoch.
    pub wall_time: f64,
    pub step: u64,
    pub what: What,
}

/// Turns `metrics.jsonl` records into events: a pure function of the records, which keeps
/// only the time the current run started (records carry their seconds since then).
#[derive(Debug, Default)]
pub struct Scalars {
    started: f64,
}

impl Scalars {
    /// When the current run started (its job record's time), in seconds since the Unix
    /// epoch.
    pub fn started(&self) -> f64 {
        self.started
    }

    /// The events of `record`, in the order they are written.
    pub fn events(&mut self, record: &MetricsRecord) -> Vec<Event> {
        let scalar = |tag, value: f64| What::Scalar {
            tag,
            value: value as f32,
        };
        let started = self.started;
        // Scalars of one step, `elapsed_s` after the run started.
        let series = |step: u64, elapsed_s: f64, values: Vec<(&'static str, f64)>| {
            values
                .into_iter()
                .map(|(tag, value)| Event {
                    wall_time: started + elapsed_s,
                    step,
                    what: scalar(tag, value),
                })
                .collect()
        };
        match record {
            MetricsRecord::Job(job) => {
                self.started = job.time as f64;
                // The first step this run writes (see the module's doc).
                let step = job.resumed_at_step.map_or(0, |saved| saved + 1);
                let mut events = Vec::new();
                if job.resumed_at_step.is_some() {
                    events.push(Event {
                        wall_time: self.started,
                        step,
                        what: What::Start,
                    });
                }
                if let Some(world) = job.world {
                    events.push(Event {
                        wall_time: self.started,
                        step,
                        what: scalar("job/world", world.into()),
                    });
                }
                events
            }
            MetricsRecord::Step(s) => {
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
                series(s.step, s.elapsed_s, values)
            }
            MetricsRecord::Eval(e) => series(
                e.step,
                e.elapsed_s,
                vec![
                    ("eval/loss", e.loss),
                    ("eval/top1", e.top1),
                    ("eval/top5", e.top5),
                ],
            ),
            MetricsRecord::Epoch(e) => series(
                e.step,
                e.elapsed_s,
                vec![
                    ("epoch/train_loss", e.train_loss),
                    ("epoch/train_top1", e.train_accuracy),
                    ("epoch/images_per_s", e.images_per_s),
                ],
            ),
            MetricsRecord::Regroup(r) => series(r.step, 0.0, vec![("job/world", r.world.into())]),
            MetricsRecord::Connect(_)
            | MetricsRecord::Stop(_)
            | MetricsRecord::Late(_)
            | MetricsRecord::Samples(_)
            | MetricsRecord::Unknown => Vec::new(),
        }
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

    /// Appends `events`.
    pub fn write(&mut self, events: &[Event]) -> Result<(), JobError> {
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

/// Writes the event file of the run whose `metrics.jsonl` is at `metrics` into `dir`;
/// returns the file and how many events it holds. Lines that are no record (a line cut
/// short by a crash) are skipped, as `imgrun plot` does.
pub fn export(metrics: &Path, dir: &Path) -> Result<(PathBuf, usize), JobError> {
    let open =
        File::open(metrics).map_err(JobError::io(format!("reading {}", metrics.display())))?;
    let mut scalars = Scalars::default();
    let mut file: Option<EventFile> = None;
    let mut count = 0;
    for line in BufReader::new(open).lines() {
        let line = line.map_err(JobError::io(format!("reading {}", metrics.display())))?;
        let Ok(record) = serde_json::from_str::<MetricsRecord>(&line) else {
            continue;
        };
        let events = scalars.events(&record);
        let out = match &mut file {
            Some(file) => file,
            None => file.insert(EventFile::create(dir, scalars.started(), "export")?),
        };
        out.write(&events)?;
        count += events.len();
    }
    let file = file.ok_or_else(|| {
        JobError::Refused(format!("{}: no metrics record in it", metrics.display()))
    })?;
    Ok((file.path, count))
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
    use crate::train::{EvalRecord, JobRecord, StepMetrics};

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
        let (path, count) = export(&metrics, &dir.path().join(TB_DIR)).expect("export");
        assert_eq!(count, 7);
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
}
