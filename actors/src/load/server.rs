//! The loader actor: a data channel listener whose every connection runs one loader
//! worker for a trainer and streams its frames back.

use std::net::SocketAddr;
use std::sync::mpsc::sync_channel;
use std::time::Duration;

use pipelines::{
    EpochStats, EpochTally, Loader, LoaderWorkerMsg, LoaderWorkerRun, Rank, Sources, encode_frame,
};
use runtime::channel::{ChannelSecret, DataListener, DataStream};
use runtime::{Actor, ActorContext, MethodError};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::protocol::{AddressRequest, LoadRequest, LoaderAddress, LoaderInit, LoaderMethod};
use crate::data::DataSpec;

/// Longest first frame (the request) a loader accepts.
const MAX_REQUEST: usize = 16 << 20;

pub(super) struct LoaderActor {
    addr: SocketAddr,
}

impl LoaderActor {
    pub(super) fn new(ctx: &ActorContext, args: &[u8]) -> Result<Self, MethodError> {
        let init: LoaderInit = serde_json::from_slice(args)
            .map_err(|e| MethodError::fatal(format!("bad loader arguments: {e}")))?;
        let secret = ChannelSecret::from_hex(&init.secret)
            .map_err(|e| MethodError::fatal(format!("the data channel secret: {e}")))?;
        let sources = Sources::new(init.data.sources.options());
        let loader = Loader::new(init.data.train_loader(), sources)
            .map_err(|e| MethodError::fatal(e.to_string()))?;
        let listener = DataListener::bind(SocketAddr::new(ctx.data_ip(), 0), secret)
            .map_err(|e| MethodError::fatal(format!("binding the data channel: {e}")))?;
        let addr = listener.local_addr();
        let data = init.data;
        std::thread::Builder::new()
            .name("imgrun-loader-accept".into())
            .spawn(move || accept(&listener, &data, &loader))
            .map_err(|e| MethodError::fatal(format!("starting the data channel: {e}")))?;
        tracing::info!(%addr, workers = init.workers, "loader actor serves its data channel");
        Ok(Self { addr })
    }
}

/// Serves each trainer's channel on a thread of its own, for as long as the process
/// lives (the actor's process ends with the actor).
fn accept(listener: &DataListener, data: &DataSpec, loader: &Loader) {
    loop {
        match listener.accept() {
            Ok(stream) => {
                let (data, loader) = (data.clone(), loader.clone());
                let spawned = std::thread::Builder::new()
                    .name("imgrun-loader-serve".into())
                    .spawn(move || {
                        let peer = stream.peer();
                        if let Err(problem) = serve(stream, &data, &loader) {
                            tracing::warn!(%peer, "a data channel ended early: {problem}");
                        }
                    });
                if let Err(error) = spawned {
                    tracing::warn!("cannot serve a data channel: {error}");
                }
            }
            Err(error) => {
                tracing::warn!("the data channel listener failed: {error}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Runs the worker the channel's first frame asks for and sends its frames until its
/// end, or until the trainer hangs up (which stops the worker).
fn serve(mut stream: DataStream, data: &DataSpec, loader: &Loader) -> Result<(), String> {
    let mut first = Vec::new();
    if !stream
        .recv(&mut first, MAX_REQUEST)
        .map_err(|e| e.to_string())?
    {
        return Ok(());
    }
    let request: LoadRequest =
        serde_json::from_slice(&first).map_err(|e| format!("bad load request: {e}"))?;
    let transform = data.train_transform(request.epoch);
    let (rank, worker) = (request.rank, request.plan.worker);
    if transform.size() != request.size {
        let message = format!(
            "rank {rank} worker {worker}: the trainer expects {} px images in epoch {} and \
             the job's schedule says {} px",
            request.size,
            request.epoch,
            transform.size()
        );
        let failed = LoaderWorkerMsg::Failed(pipelines::LoaderError::Config {
            field: "size",
            problem: message.clone(),
        });
        send(&mut stream, &failed, EpochStats::default())?;
        return Err(message);
    }
    let run = LoaderWorkerRun {
        epoch: request.epoch,
        rank: Rank(rank),
        plan: request.plan,
        batch_size: request.batch_size,
        drop_partial: request.drop_partial,
        transform,
        resume: request.resume,
    };
    let queue = data.queue_batches.max(1);
    let (tx, rx) = sync_channel(queue);
    let tally = EpochTally::default();
    if let Err(error) = loader.start_worker(run, &tally, tx) {
        send(
            &mut stream,
            &LoaderWorkerMsg::Failed(error),
            EpochStats::default(),
        )?;
        return Ok(());
    }
    let mut reported = EpochStats::default();
    for msg in rx {
        let now = tally.stats();
        let end = !matches!(msg, LoaderWorkerMsg::Batch(..));
        send(&mut stream, &msg, now.since(&reported))?;
        reported = now;
        if end {
            break;
        }
    }
    Ok(())
}

fn send(stream: &mut DataStream, msg: &LoaderWorkerMsg, stats: EpochStats) -> Result<(), String> {
    let mut header = Vec::new();
    let pixels = encode_frame(msg, stats, &mut header).map_err(|e| e.to_string())?;
    stream
        .send(&[pixels, &header])
        .map_err(|e| format!("sending to the trainer: {e}"))
}

impl Actor for LoaderActor {
    fn call(&mut self, method: &str, payload: &[u8]) -> Result<Vec<u8>, MethodError> {
        match method {
            AddressRequest::NAME => answer(payload, |_: AddressRequest| {
                Ok(LoaderAddress { addr: self.addr })
            }),
            other => Err(MethodError::new(format!(
                "loaders have no method `{other}` ({})",
                AddressRequest::NAME
            ))),
        }
    }
}

fn answer<M: LoaderMethod>(
    payload: &[u8],
    run: impl FnOnce(M) -> Result<M::Reply, MethodError>,
) -> Result<Vec<u8>, MethodError> {
    let request: M = decode(payload, M::NAME)?;
    encode(&run(request)?)
}

fn decode<T: DeserializeOwned>(payload: &[u8], what: &str) -> Result<T, MethodError> {
    serde_json::from_slice(payload).map_err(|e| MethodError::new(format!("bad {what}: {e}")))
}

fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, MethodError> {
    serde_json::to_vec(value).map_err(|e| MethodError::new(format!("encoding the reply: {e}")))
}
