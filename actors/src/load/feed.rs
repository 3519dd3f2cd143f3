//! The trainer's side of remote loader workers: a feed thread per worker that asks its
//! loader actor for the worker's batches and passes them on, and runs the worker in the
//! trainer's own process from the last batch passed on when the loader actor is lost.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pipelines::{
    EpochTally, FrameDecoder, Loader, LoaderError, LoaderWorkerCursor, LoaderWorkerMsg,
    LoaderWorkerPlacement, LoaderWorkerRun,
};
use runtime::channel::{ChannelSecret, DataStream};

use super::protocol::LoadRequest;

/// How long a feed tries to reach its loader actor before it runs the worker here.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a feed waits for its loader's next frame before it calls the loader lost.
const FRAME_TIMEOUT: Duration = Duration::from_secs(120);
/// Largest frame a feed accepts beyond the batch's pixels (its header).
const MAX_HEADER: usize = 64 << 20;

/// Places a rank's loader workers: those the job gave to a loader actor are fed from it,
/// the others run here.
#[derive(Clone)]
pub struct RemoteLoaderWorkers {
    /// The trainer's own loader, for its local workers and for those whose loader is lost.
    loader: Loader,
    /// Each worker's loader actor (`None`: the worker runs here).
    loader_actors: Vec<Option<SocketAddr>>,
    secret: ChannelSecret,
    queue: usize,
    /// Loader actors found lost: their workers run here from then on.
    lost: Arc<Mutex<BTreeSet<SocketAddr>>>,
}

impl RemoteLoaderWorkers {
    pub fn new(
        loader: Loader,
        loader_actors: Vec<Option<SocketAddr>>,
        secret: ChannelSecret,
        queue: usize,
    ) -> Self {
        Self {
            loader,
            loader_actors,
            secret,
            queue: queue.max(1),
            lost: Arc::default(),
        }
    }

    /// Workers fed by loader actors.
    pub fn remote_workers(&self) -> usize {
        self.loader_actors.iter().flatten().count()
    }
}

impl std::fmt::Debug for RemoteLoaderWorkers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteLoaderWorkers")
            .field("loader_actors", &self.loader_actors)
            .finish_non_exhaustive()
    }
}

impl LoaderWorkerPlacement for RemoteLoaderWorkers {
    fn start(
        &mut self,
        run: LoaderWorkerRun,
        tally: &EpochTally,
    ) -> Result<Receiver<LoaderWorkerMsg>, LoaderError> {
        let (tx, rx) = sync_channel(self.queue);
        let addr = self
            .loader_actors
            .get(run.plan.worker.0 as usize)
            .copied()
            .flatten();
        let lost = |addr: &SocketAddr| {
            self.lost
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(addr)
        };
        let Some(addr) = addr.filter(|a| !lost(a)) else {
            self.loader.start_worker(run, tally, tx)?;
            return Ok(rx);
        };
        let feed = Feed {
            run,
            addr,
            secret: self.secret.clone(),
            loader: self.loader.clone(),
            tally: tally.clone(),
            queue: self.queue,
            lost: self.lost.clone(),
        };
        let name = format!("imgrun-feed-r{}w{}", feed.run.rank, feed.run.plan.worker);
        std::thread::Builder::new()
            .name(name)
            .spawn(move || feed.run(tx))
            .map_err(|source| LoaderError::Thread { source })?;
        Ok(rx)
    }
}

struct Feed {
    run: LoaderWorkerRun,
    addr: SocketAddr,
    secret: ChannelSecret,
    loader: Loader,
    tally: EpochTally,
    queue: usize,
    lost: Arc<Mutex<BTreeSet<SocketAddr>>>,
}

impl Feed {
    fn run(self, tx: SyncSender<LoaderWorkerMsg>) {
        let mut last = self.run.resume;
        let Err(problem) = self.pass_on(&tx, &mut last) else {
            return;
        };
        let (rank, worker) = (self.run.rank, self.run.plan.worker);
        let message = format!(
            "rank {rank} loader worker {worker}: the loader actor at {} was lost ({problem}); \
             the worker goes on in the trainer's process after its batch {} (sample {}), and \
             so do the loader's workers in later epochs",
            self.addr, last.batches, last.consumed
        );
        tracing::warn!("{message}");
        self.tally.note(message);
        self.lost
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(self.addr);
        let run = LoaderWorkerRun {
            resume: last,
            ..self.run.clone()
        };
        if let Err(error) = self.loader.start_worker(run, &self.tally, tx.clone()) {
            let _ = tx.send(LoaderWorkerMsg::Failed(error));
        }
    }

    /// Passes on the loader actor's messages until the worker's end (Ok) or until the
    /// loader is lost (Err), keeping in `last` the cursor of the last batch passed on.
    fn pass_on(
        &self,
        tx: &SyncSender<LoaderWorkerMsg>,
        last: &mut LoaderWorkerCursor,
    ) -> Result<(), String> {
        let run = &self.run;
        let mut stream = DataStream::connect(self.addr, &self.secret, CONNECT_TIMEOUT)
            .map_err(|e| e.to_string())?;
        stream
            .set_read_timeout(Some(FRAME_TIMEOUT))
            .map_err(|e| e.to_string())?;
        let request = LoadRequest {
            epoch: run.epoch,
            rank: run.rank.0,
            size: run.transform.size(),
            batch_size: run.batch_size,
            drop_partial: run.drop_partial,
            plan: run.plan.clone(),
            resume: *last,
        };
        let request = serde_json::to_vec(&request).map_err(|e| e.to_string())?;
        stream.send(&[&request]).map_err(|e| e.to_string())?;
        let mut decoder = FrameDecoder::new(
            run.rank,
            run.plan.worker,
            run.transform,
            run.batch_size,
            self.queue + 2,
        )
        .map_err(|e| e.to_string())?;
        let max = run.transform.slot_len() * run.batch_size + MAX_HEADER;
        loop {
            let mut frame = decoder.buffer();
            if !stream.recv(&mut frame, max).map_err(|e| e.to_string())? {
                return Err("it closed the channel before the worker's end".into());
            }
            let (msg, stats) = decoder.decode(frame).map_err(|e| e.to_string())?;
            self.tally.add(&stats);
            let cursor = match &msg {
                LoaderWorkerMsg::Batch(_, cursor) => Some(*cursor),
                LoaderWorkerMsg::Done | LoaderWorkerMsg::Failed(_) => None,
            };
            if tx.send(msg).is_err() {
                // The epoch is over for the trainer: hang up, which stops the worker.
                stream.shutdown();
                return Ok(());
            }
            match cursor {
                Some(cursor) => *last = cursor,
                None => return Ok(()),
            }
        }
    }
}
