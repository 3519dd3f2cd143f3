//! A loader worker's messages as frames of bytes: how a loader elsewhere (a loader actor)
//! sends a rank its batches, and how the rank gets them back as batches in pooled
//! buffers.
//!
//! A frame is `[pixels][header][u32 LE header length]`. The pixels come first so that
//! the buffer a frame is received into becomes the batch's image buffer as it is, with
//! no copy. The header is JSON: what the message is, the batch's labels and sample ids
//! (each shard's URL once), the worker's cursor after it, and the counts the worker
//! gathered since its previous frame. Only `u8` batches travel: they are a quarter of
//! the size of normalised floats, and the trainer normalises on its device.

use std::collections::HashMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::batch::{Batch, BufferPool, Images, SampleId};
use super::cursor::LoaderWorkerCursor;
use super::stats::EpochStats;
use super::worker::LoaderWorkerMsg;
use super::{LoaderError, Transform};
use crate::plan::{LoaderWorkerId, Rank};
use crate::transform::OutputFormat;

/// Bytes of the trailer that gives the header's length.
const TRAILER: usize = 4;
/// Distinct shard URLs a decoder keeps shared before it starts afresh.
const KEPT_URLS: usize = 4096;

/// Why a frame could not be made or read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("only uint8 batches travel between processes; this loader makes float batches")]
    Float,
    #[error("a frame of {len} bytes is too short for its header length")]
    Short { len: usize },
    #[error("the frame's header says {header} bytes and the frame has {len}")]
    HeaderLength { header: usize, len: usize },
    #[error("the frame's header is not valid: {0}")]
    Header(String),
    #[error("the frame's batch does not add up: {0}")]
    Batch(String),
}

#[derive(Debug, Serialize, Deserialize)]
enum Header {
    Batch {
        epoch: u64,
        worker: u32,
        size: u32,
        labels: Vec<i64>,
        /// The batch's shard URLs, each once; `ids` index into it.
        urls: Vec<String>,
        ids: Vec<(u32, String)>,
        cursor: LoaderWorkerCursor,
        stats: EpochStats,
    },
    Done {
        stats: EpochStats,
    },
    Failed {
        message: String,
        stats: EpochStats,
    },
}

/// Writes `msg`'s frame, with `stats` (the worker's counts since its previous frame):
/// the header and trailer into `header` (cleared first), and returns the pixels. Send the
/// pixels, then `header`, as one frame.
pub fn encode_frame<'a>(
    msg: &'a LoaderWorkerMsg,
    stats: EpochStats,
    header: &mut Vec<u8>,
) -> Result<&'a [u8], FrameError> {
    header.clear();
    let (head, pixels): (Header, &[u8]) = match msg {
        LoaderWorkerMsg::Batch(batch, cursor) => {
            let pixels = if batch.is_empty() {
                &[][..]
            } else {
                batch.pixels_u8().ok_or(FrameError::Float)?
            };
            let mut urls: Vec<String> = Vec::new();
            let mut ids = Vec::with_capacity(batch.ids.len());
            for id in &batch.ids {
                // A batch's samples come from a few shards, in runs.
                let index = match urls.iter().rposition(|u| **u == *id.url) {
                    Some(index) => index,
                    None => {
                        urls.push(id.url.to_string());
                        urls.len() - 1
                    }
                };
                ids.push((index as u32, id.key.clone()));
            }
            let head = Header::Batch {
                epoch: batch.epoch,
                worker: batch.worker.map_or(0, |w| w.0),
                size: batch.size,
                labels: batch.labels.clone(),
                urls,
                ids,
                cursor: *cursor,
                stats,
            };
            (head, pixels)
        }
        LoaderWorkerMsg::Done => (Header::Done { stats }, &[][..]),
        LoaderWorkerMsg::Failed(error) => {
            let message = error.to_string();
            (Header::Failed { message, stats }, &[][..])
        }
    };
    serde_json::to_writer(&mut *header, &head).map_err(|e| FrameError::Header(e.to_string()))?;
    let len = u32::try_from(header.len())
        .map_err(|_| FrameError::Header(format!("{} bytes is too long", header.len())))?;
    header.extend_from_slice(&len.to_le_bytes());
    Ok(pixels)
}

/// Turns one worker's frames back into its messages, the batches in buffers of a pool
/// (so steady-state receiving allocates no pixel memory: take each frame's buffer from
/// [`FrameDecoder::buffer`]).
#[derive(Debug)]
pub struct FrameDecoder {
    rank: Rank,
    worker: LoaderWorkerId,
    size: u32,
    batch_size: usize,
    pool: BufferPool,
    urls: HashMap<String, Arc<str>>,
}

impl FrameDecoder {
    /// For the frames of worker `worker` of `rank`, whose batches hold at most
    /// `batch_size` images made by `transform`; `keep` buffers are kept for reuse.
    pub fn new(
        rank: Rank,
        worker: LoaderWorkerId,
        transform: Transform,
        batch_size: usize,
        keep: usize,
    ) -> Result<Self, FrameError> {
        if transform.output() != OutputFormat::Uint8Nhwc {
            return Err(FrameError::Float);
        }
        let values = transform.slot_len() * batch_size;
        Ok(Self {
            rank,
            worker,
            size: transform.size(),
            batch_size,
            pool: BufferPool::new(OutputFormat::Uint8Nhwc, values, keep),
            urls: HashMap::new(),
        })
    }

    /// A buffer to receive the next frame into (a pooled one when a batch gave its back).
    pub fn buffer(&self) -> Vec<u8> {
        match self.pool.take() {
            Images::U8(buffer) => buffer,
            Images::F32(_) => Vec::new(),
        }
    }

    /// The message in `frame`, and the counts its worker sent with it.
    pub fn decode(
        &mut self,
        mut frame: Vec<u8>,
    ) -> Result<(LoaderWorkerMsg, EpochStats), FrameError> {
        let len = frame.len();
        let Some(at) = len.checked_sub(TRAILER) else {
            return Err(FrameError::Short { len });
        };
        let mut trailer = [0u8; TRAILER];
        trailer.copy_from_slice(&frame[at..]);
        let header_len = u32::from_le_bytes(trailer) as usize;
        let Some(pixels) = at.checked_sub(header_len) else {
            return Err(FrameError::HeaderLength {
                header: header_len,
                len,
            });
        };
        let head: Header = serde_json::from_slice(&frame[pixels..at])
            .map_err(|e| FrameError::Header(e.to_string()))?;
        match head {
            Header::Done { stats } => Ok((LoaderWorkerMsg::Done, stats)),
            Header::Failed { message, stats } => {
                let error = LoaderError::Remote {
                    rank: self.rank,
                    worker: self.worker.0,
                    message,
                };
                Ok((LoaderWorkerMsg::Failed(error), stats))
            }
            Header::Batch {
                epoch,
                worker,
                size,
                labels,
                urls,
                ids,
                cursor,
                stats,
            } => {
                self.check(worker, size, &labels, &ids, &urls, pixels)?;
                let shared: Vec<Arc<str>> = urls.into_iter().map(|u| self.intern(u)).collect();
                frame.truncate(pixels);
                frame.resize(self.batch_size * self.slot_len(), 0);
                let mut batch = Batch::new(
                    epoch,
                    LoaderWorkerId(worker),
                    size,
                    Images::U8(frame),
                    self.pool.clone(),
                );
                batch.labels = labels;
                batch.ids = ids
                    .into_iter()
                    .map(|(url, key)| SampleId {
                        url: shared[url as usize].clone(),
                        key,
                    })
                    .collect();
                Ok((LoaderWorkerMsg::Batch(batch, cursor), stats))
            }
        }
    }

    fn slot_len(&self) -> usize {
        self.size as usize * self.size as usize * 3
    }

    fn check(
        &self,
        worker: u32,
        size: u32,
        labels: &[i64],
        ids: &[(u32, String)],
        urls: &[String],
        pixels: usize,
    ) -> Result<(), FrameError> {
        let problem = if worker != self.worker.0 {
            format!("it comes from worker {worker}, expected {}", self.worker)
        } else if size != self.size {
            format!("its images are {size} px, expected {} px", self.size)
        } else if labels.len() > self.batch_size {
            format!(
                "{} samples in a batch of at most {}",
                labels.len(),
                self.batch_size
            )
        } else if labels.len() != ids.len() {
            format!("{} labels and {} sample ids", labels.len(), ids.len())
        } else if pixels != labels.len() * self.slot_len() {
            format!(
                "{pixels} bytes of pixels for {} images of {} bytes",
                labels.len(),
                self.slot_len()
            )
        } else if let Some((url, _)) = ids.iter().find(|(url, _)| *url as usize >= urls.len()) {
            format!("a sample names URL {url} of {}", urls.len())
        } else {
            return Ok(());
        };
        Err(FrameError::Batch(problem))
    }

    fn intern(&mut self, url: String) -> Arc<str> {
        if let Some(shared) = self.urls.get(&url) {
            return shared.clone();
        }
        if self.urls.len() >= KEPT_URLS {
            self.urls.clear();
        }
        let shared: Arc<str> = Arc::from(url.as_str());
        self.urls.insert(url, shared.clone());
        shared
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transform::TrainTransform;

    fn transform() -> Transform {
        Transform::Train(TrainTransform::new(2))
    }

    fn batch(pool: &BufferPool, samples: usize) -> Batch {
        let mut batch = Batch::new(3, LoaderWorkerId(1), 2, pool.take(), pool.clone());
        if let Images::U8(pixels) = batch.images_mut() {
            for (i, v) in pixels.iter_mut().enumerate() {
                *v = i as u8;
            }
        }
        for i in 0..samples {
            batch.labels.push(i as i64 * 10);
            batch.ids.push(SampleId {
                url: Arc::from(if i < 2 { "a.tar" } else { "b.tar" }),
                key: format!("k{i}"),
            });
        }
        batch
    }

    fn frame(msg: &LoaderWorkerMsg, stats: EpochStats) -> Vec<u8> {
        let mut header = Vec::new();
        let pixels = encode_frame(msg, stats, &mut header).expect("encodes");
        [pixels, &header[..]].concat()
    }

    #[test]
    fn a_batch_comes_back_as_it_was_sent() {
        let pool = BufferPool::new(OutputFormat::Uint8Nhwc, 4 * 12, 2);
        let sent = batch(&pool, 3);
        let cursor = LoaderWorkerCursor {
            batches: 5,
            samples: 40,
            consumed: 41,
        };
        let stats = EpochStats {
            bad_samples: 1,
            problems: vec!["x: bad".into()],
            ..EpochStats::default()
        };
        let bytes = frame(&LoaderWorkerMsg::Batch(sent, cursor), stats.clone());
        let mut decoder =
            FrameDecoder::new(Rank(0), LoaderWorkerId(1), transform(), 4, 2).expect("decoder");
        let (msg, got_stats) = decoder.decode(bytes).expect("decodes");
        assert_eq!(got_stats, stats);
        let LoaderWorkerMsg::Batch(got, got_cursor) = msg else {
            panic!("not a batch: {msg:?}");
        };
        assert_eq!(got_cursor, cursor);
        assert_eq!(got.labels, vec![0, 10, 20]);
        assert_eq!(got.ids[2].to_string(), "b.tar#k2");
        assert!(Arc::ptr_eq(&got.ids[0].url, &got.ids[1].url));
        let expected: Vec<u8> = (0..36).map(|i| i as u8).collect();
        assert_eq!(got.pixels_u8(), Some(&expected[..]));
        assert_eq!(
            (got.epoch, got.worker, got.size),
            (3, Some(LoaderWorkerId(1)), 2)
        );
    }

    #[test]
    fn done_and_failed_come_back() {
        let mut decoder =
            FrameDecoder::new(Rank(2), LoaderWorkerId(0), transform(), 4, 2).expect("decoder");
        let (msg, _) = decoder
            .decode(frame(&LoaderWorkerMsg::Done, EpochStats::default()))
            .expect("decodes");
        assert!(matches!(msg, LoaderWorkerMsg::Done));
        let failed = LoaderWorkerMsg::Failed(LoaderError::Config {
            field: "x",
            problem: "broken".into(),
        });
        let (msg, _) = decoder
            .decode(frame(&failed, EpochStats::default()))
            .expect("decodes");
        let LoaderWorkerMsg::Failed(error) = msg else {
            panic!("not a failure");
        };
        assert_eq!(
            error.to_string(),
            "rank 2 loader worker 0: invalid loader setting `x`: broken"
        );
    }

    #[test]
    fn bad_frames_are_errors_that_say_why() {
        let pool = BufferPool::new(OutputFormat::Uint8Nhwc, 4 * 12, 2);
        let good = frame(
            &LoaderWorkerMsg::Batch(batch(&pool, 2), LoaderWorkerCursor::default()),
            EpochStats::default(),
        );
        let mut decoder =
            FrameDecoder::new(Rank(0), LoaderWorkerId(1), transform(), 4, 2).expect("decoder");
        let mut cut = good.clone();
        cut.remove(0);
        let mut long_header = good.clone();
        let at = long_header.len() - 4;
        long_header[at..].copy_from_slice(&u32::MAX.to_le_bytes());
        let mut other_worker =
            FrameDecoder::new(Rank(0), LoaderWorkerId(0), transform(), 4, 2).expect("decoder");
        let cases: Vec<(&str, Result<_, FrameError>)> = vec![
            ("empty", decoder.decode(Vec::new()).map(drop)),
            ("garbage", decoder.decode(b"garbage!".to_vec()).map(drop)),
            ("cut", decoder.decode(cut).map(drop)),
            ("header length", decoder.decode(long_header).map(drop)),
            ("worker", other_worker.decode(good.clone()).map(drop)),
        ];
        for (case, result) in cases {
            let error = result.expect_err(case);
            assert!(!error.to_string().is_empty(), "{case}");
        }
        let mut small =
            FrameDecoder::new(Rank(0), LoaderWorkerId(1), transform(), 1, 2).expect("decoder");
        let error = small.decode(good).map(drop).expect_err("too many samples");
        assert!(
            error
                .to_string()
                .contains("2 samples in a batch of at most 1")
        );
    }

    #[test]
    fn float_batches_do_not_travel() {
        let float = Transform::Train(TrainTransform {
            output: OutputFormat::IMAGENET_F32,
            ..TrainTransform::new(2)
        });
        let error = FrameDecoder::new(Rank(0), LoaderWorkerId(0), float, 4, 2).expect_err("float");
        assert_eq!(error, FrameError::Float);
    }
}
