//! Batches and the buffers they live in. A worker allocates its image buffers once and
//! gets each back when the consumer drops the batch, so steady-state loading allocates
//! no pixel memory.

use std::fmt;
use std::sync::{Arc, Mutex};

use crate::plan::LoaderWorkerId;
use crate::transform::OutputFormat;

/// Which sample a batch row holds: its shard and key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SampleId {
    pub url: Arc<str>,
    pub key: String,
}

impl fmt::Display for SampleId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.url, self.key)
    }
}

/// The pixels of a batch: room for `capacity` samples, the first `len` filled.
#[derive(Debug)]
pub enum Images {
    /// `[n, size, size, 3]`, RGB, row-major (NHWC).
    U8(Vec<u8>),
    /// `[n, 3, size, size]`, normalised (NCHW).
    F32(Vec<f32>),
}

impl Images {
    pub(crate) fn zeroed(output: OutputFormat, values: usize) -> Self {
        match output {
            OutputFormat::Uint8Nhwc => Self::U8(vec![0; values]),
            OutputFormat::Float32Chw { .. } => Self::F32(vec![0.0; values]),
        }
    }

    /// Values the buffer holds (filled or not).
    pub(crate) fn values(&self) -> usize {
        match self {
            Self::U8(v) => v.len(),
            Self::F32(v) => v.len(),
        }
    }

    fn fits(&self, output: OutputFormat, values: usize) -> bool {
        let kind_matches = matches!(
            (self, output),
            (Self::U8(_), OutputFormat::Uint8Nhwc)
                | (Self::F32(_), OutputFormat::Float32Chw { .. })
        );
        kind_matches && self.values() == values
    }
}

/// A worker's spare image buffers. Batches return theirs here when dropped.
#[derive(Debug, Clone)]
pub(crate) struct BufferPool {
    spare: Arc<Mutex<Vec<Images>>>,
    output: OutputFormat,
    values: usize,
    keep: usize,
}

impl BufferPool {
    pub fn new(output: OutputFormat, values: usize, keep: usize) -> Self {
        Self {
            spare: Arc::new(Mutex::new(Vec::with_capacity(keep))),
            output,
            values,
            keep,
        }
    }

    /// A buffer of the pool's size: a returned one when there is one.
    pub fn take(&self) -> Images {
        let spare = self.spare.lock().ok().and_then(|mut s| s.pop());
        spare.unwrap_or_else(|| Images::zeroed(self.output, self.values))
    }

    fn give_back(&self, images: Images) {
        if !images.fits(self.output, self.values) {
            return;
        }
        if let Ok(mut spare) = self.spare.lock()
            && spare.len() < self.keep
        {
            spare.push(images);
        }
    }
}

/// One batch of a rank's epoch.
///
/// An *empty* batch (no samples) is what a rank gets when its data has run out but other
/// ranks still have batches (the `join` policy, or samples skipped as bad): the trainer
/// still takes part in the step, weighting by the samples it actually had.
pub struct Batch {
    pub epoch: u64,
    /// Position in the rank's epoch, from 0.
    pub step: u64,
    /// The worker that filled it (`None` for an empty batch).
    pub worker: Option<LoaderWorkerId>,
    /// Side of every image in pixels.
    pub size: u32,
    pub labels: Vec<i64>,
    pub ids: Vec<SampleId>,
    images: Images,
    pool: Option<BufferPool>,
}

impl Batch {
    pub(crate) fn new(
        epoch: u64,
        worker: LoaderWorkerId,
        size: u32,
        images: Images,
        pool: BufferPool,
    ) -> Self {
        Self {
            epoch,
            step: 0,
            worker: Some(worker),
            size,
            labels: Vec::new(),
            ids: Vec::new(),
            images,
            pool: Some(pool),
        }
    }

    pub(crate) fn empty(epoch: u64, step: u64, size: u32, output: OutputFormat) -> Self {
        Self {
            epoch,
            step,
            worker: None,
            size,
            labels: Vec::new(),
            ids: Vec::new(),
            images: Images::zeroed(output, 0),
            pool: None,
        }
    }

    /// Samples in the batch.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    fn values(&self) -> usize {
        self.len() * self.size as usize * self.size as usize * 3
    }

    /// The filled pixels when the output is `u8` NHWC: `len * size * size * 3` bytes.
    pub fn pixels_u8(&self) -> Option<&[u8]> {
        match &self.images {
            Images::U8(v) => Some(&v[..self.values()]),
            Images::F32(_) => None,
        }
    }

    /// The filled values when the output is normalised `f32` NCHW.
    pub fn pixels_f32(&self) -> Option<&[f32]> {
        match &self.images {
            Images::F32(v) => Some(&v[..self.values()]),
            Images::U8(_) => None,
        }
    }

    pub(crate) fn images_mut(&mut self) -> &mut Images {
        &mut self.images
    }

    fn slot(&self, index: usize) -> std::ops::Range<usize> {
        let len = self.size as usize * self.size as usize * 3;
        index * len..(index + 1) * len
    }

    /// Copies sample `index` (pixels, label, id) into `held`.
    pub(crate) fn lift(&self, index: usize, held: &mut Held) {
        let range = self.slot(index);
        match (&self.images, &mut held.pixels) {
            (Images::U8(src), Images::U8(dst)) => {
                dst.clear();
                dst.extend_from_slice(&src[range]);
            }
            (Images::F32(src), Images::F32(dst)) => {
                dst.clear();
                dst.extend_from_slice(&src[range]);
            }
            (Images::U8(src), dst) => *dst = Images::U8(src[range].to_vec()),
            (Images::F32(src), dst) => *dst = Images::F32(src[range].to_vec()),
        }
        held.label = self.labels[index];
        held.id.clone_from(&self.ids[index]);
    }

    /// Writes `held` over sample `index`.
    pub(crate) fn put(&mut self, index: usize, held: &Held) {
        let range = self.slot(index);
        match (&mut self.images, &held.pixels) {
            (Images::U8(dst), Images::U8(src)) => dst[range].copy_from_slice(src),
            (Images::F32(dst), Images::F32(src)) => dst[range].copy_from_slice(src),
            // Batches of one epoch share one output format.
            _ => return,
        }
        self.labels[index] = held.label;
        self.ids[index].clone_from(&held.id);
    }
}

/// One sample lifted out of a batch while samples move between batches.
#[derive(Debug)]
pub(crate) struct Held {
    pixels: Images,
    label: i64,
    id: SampleId,
}

impl Default for Held {
    fn default() -> Self {
        Self {
            pixels: Images::U8(Vec::new()),
            label: 0,
            id: SampleId {
                url: Arc::from(""),
                key: String::new(),
            },
        }
    }
}

impl fmt::Debug for Batch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Batch")
            .field("epoch", &self.epoch)
            .field("step", &self.step)
            .field("worker", &self.worker)
            .field("size", &self.size)
            .field("len", &self.len())
            .finish_non_exhaustive()
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.give_back(std::mem::replace(&mut self.images, Images::U8(Vec::new())));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_batches_return_their_buffers() {
        let pool = BufferPool::new(OutputFormat::Uint8Nhwc, 12, 2);
        let images = pool.take();
        let ptr = match &images {
            Images::U8(v) => v.as_ptr(),
            Images::F32(_) => unreachable!("u8 pool"),
        };
        drop(Batch::new(0, LoaderWorkerId(0), 2, images, pool.clone()));
        match pool.take() {
            Images::U8(v) => assert_eq!(v.as_ptr(), ptr, "the same allocation comes back"),
            Images::F32(_) => panic!("wrong kind"),
        }
    }

    #[test]
    fn the_pool_keeps_at_most_its_limit() {
        let pool = BufferPool::new(OutputFormat::Uint8Nhwc, 3, 1);
        for _ in 0..3 {
            drop(Batch::new(
                0,
                LoaderWorkerId(0),
                1,
                pool.take(),
                pool.clone(),
            ));
        }
        let held = pool.spare.lock().map(|s| s.len()).unwrap_or(0);
        assert_eq!(held, 1);
    }
}
