//! The trainer actor: one rank of a data-parallel job, hosted in a worker process of its
//! own on its node. It owns a model replica, the optimiser, the rank's loader (whose
//! worker threads fill a bounded in-process queue of batches) and the gradient sync.
//!
//! The job's client drives it with calls, all JSON:
//! `listen` (bind the ring port) → `connect` (join the ring, restore a checkpoint, take
//! rank 0's weights) → `train` (the next `max_steps` steps of an epoch; every rank gets
//! the same count, so the ranks stay in step) → `evaluate` → `save` (rank 0) → `digest`.
//! A decentralized job (`train.sync`) also binds and connects its mixing groups' ports,
//! saves on every rank (rank 0 writes), and ends with `average`.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use pipelines::{
    ClusterShape, EpochBatches, Hooks, Loader, Planner, Rank, RankCursor, Sources, summarize_names,
};
use runtime::{Actor, ActorContext, ActorRegistry, CollectiveOptions, MethodError, RingSecret};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tch::{Device, Kind, Tensor};

use super::checkpoint::{self, CheckpointState};
use super::checkpoint_store;
use super::comm::ring_failure;
use super::ddp::GradSync;
use super::decentral::{self, MixSync};
use super::loss::{cross_entropy_smoothed, topk_correct_tensor};
use super::model::{self, Model};
use super::nccl;
use super::negotiate::{self, Negotiating};
use super::optim::Sgd;
use super::phase::{self, Phase, PhaseRequest};
use super::protocol::{
    AverageRequest, ConnectReply, ConnectRequest, DigestReply, DigestRequest, EpochReceived,
    EvalReply, EvaluateRequest, ListenReply, ListenRequest, LoaderActorsReply, LoaderActorsRequest,
    METHODS, PreloadReply, PreloadRequest, RegroupRequest, ResumeFrom, RollbackRequest,
    SaveRequest, StepRecord, StepTiming, TrainReply, TrainRequest, TrainerMethod,
};
use super::scaler::{LossScaler, StepVerdict};
use super::schedule::{LrSchedule, ScheduleKind};
use super::spec::{
    AllreduceChoice, DeviceSpec, ScheduleSpec, SyncChoice, TrainPlanner, TrainerInit,
};
use super::transfer::{to_device_async, to_host};
use super::weights;

mod decentralized;
mod elastic;

/// Shards a node copies at once when it preloads.
const PRELOAD_JOBS: usize = 4;

/// The actor kind of trainers.
pub const TRAINER_KIND: &str = "trainer";

/// Registers the trainer kind and its monitor's ([`phase::MONITOR_KIND`]).
pub fn register(registry: &mut ActorRegistry) {
    registry.register(TRAINER_KIND, |ctx, args| {
        Ok(Box::new(Trainer::new(ctx, args)?) as Box<dyn Actor>)
    });
    phase::register(registry);
}

struct Running {
    epoch: u64,
    batches: EpochBatches,
    steps: u64,
    planned: u64,
    /// What this run of the epoch received: image sides and the shards of its samples.
    image_sizes: BTreeSet<u32>,
    shards: BTreeSet<Arc<str>>,
}

struct Trainer {
    init: TrainerInit,
    /// The address the ring port binds: the node daemon's (`ActorContext::data_ip`).
    data_ip: IpAddr,
    device: Device,
    model: Model,
    params: Vec<Tensor>,
    buffers: Vec<Tensor>,
    sgd: Sgd,
    schedule: LrSchedule,
    planner: TrainPlanner,
    loader: Loader,
    val_loader: Loader,
    shape: ClusterShape,
    steps_per_epoch: u64,
    listener: Option<std::net::TcpListener>,
    /// A decentralized job's mixing ports, one per group of this rank's schedule.
    mix_listeners: Vec<std::net::TcpListener>,
    /// A decentralized job's neighbour averaging.
    mix: Option<MixSync>,
    /// Why rank 0 made no NCCL id, for the reply that explains the fallback.
    nccl_problem: Option<String>,
    sync: Option<GradSync>,
    running: Option<Running>,
    /// The epoch and cursor a resumed job continues from.
    resume_cursor: Option<RankCursor>,
    global_step: u64,
    scaler: LossScaler,
    mean: Tensor,
    std: Tensor,
    /// The copies this node's shards are being preloaded into (`data.preload`).
    preloader: Option<pipelines::Preloader>,
    /// The loader actors that run this rank's loader workers (`data.loaders = "remote"`).
    remote: Option<crate::load::RemoteLoaderWorkers>,
    /// An elastic job's state at the start of the last `train` call.
    snapshot: Option<elastic::Snapshot>,
    /// The rest of an epoch after a regroup: its plan for this world.
    continued: Option<(u64, pipelines::Plan)>,
    /// Added to the global step to read the schedule, after a regroup.
    lr_offset: i64,
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("rank", &self.init.rank)
            .field("world", &self.init.world)
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

fn json<T: for<'de> Deserialize<'de>>(payload: &[u8], what: &str) -> Result<T, MethodError> {
    serde_json::from_slice(payload).map_err(|e| MethodError::new(format!("bad {what}: {e}")))
}

fn reply<T: Serialize>(value: &T) -> Result<Vec<u8>, MethodError> {
    serde_json::to_vec(value).map_err(|e| MethodError::new(format!("encoding the reply: {e}")))
}

fn fatal(what: &str) -> impl FnOnce(String) -> MethodError + '_ {
    move |e| MethodError::fatal(format!("{what}: {e}"))
}

impl Trainer {
    fn new(ctx: &ActorContext, args: &[u8]) -> Result<Self, MethodError> {
        let init: TrainerInit = json(args, "trainer arguments")?;
        phase::start(init.rank);
        let job = &init.job;
        if init.threads > 0 {
            tch::set_num_threads(i32::try_from(init.threads).unwrap_or(1));
        }
        let device = match init.device {
            DeviceSpec::Cpu => Device::Cpu,
            DeviceSpec::Cuda => {
                let ordinal = ctx.cuda_ordinals().first().copied().unwrap_or(0);
                if !tch::Cuda::is_available() {
                    return Err(MethodError::fatal(format!(
                        "rank {}: a GPU was reserved but libtorch sees no CUDA device",
                        init.rank
                    )));
                }
                Device::Cuda(ordinal as usize)
            }
        };
        if device != Device::Cpu {
            // cuDNN times its convolution algorithms for each new shape once and keeps
            // the fastest (a job's shapes repeat every step).
            tch::Cuda::cudnn_set_benchmark(true);
        }
        tch::manual_seed(job.model.seed as i64);
        let building = |e: tch::TchError| {
            MethodError::fatal(format!("building {}: {e}", job.model.kind.name()))
        };
        let model = Model::new(job.model.kind, job.model.classes, job.model.width, device)
            .map_err(building)?;
        if model::channels_last_weights(job.optim.channels_last, device) {
            model.use_channels_last_weights().map_err(building)?;
        }
        let named_params = model.parameters();
        let params: Vec<Tensor> = named_params
            .iter()
            .map(|(_, t)| t.shallow_clone())
            .collect();
        let buffers = model.buffers().into_iter().map(|(_, t)| t).collect();
        let sgd = Sgd::new(named_params, job.optim.sgd);
        let shape =
            ClusterShape::with_node_ranks(init.node_ranks.clone(), job.data.loader_workers.max(1));
        let planner = job
            .data
            .train_planner(shape.clone(), job.optim.batch_size)
            .map_err(|e| MethodError::fatal(format!("training plan: {e}")))?;
        let first = planner
            .plan(0)
            .map_err(|e| MethodError::fatal(format!("planning epoch 0: {e}")))?;
        let steps_per_epoch = first.steps().ok_or_else(|| {
            MethodError::fatal(
                "the ranks' batch counts are unknown: give the shards a manifest.json with \
                 sample counts, or choose the drop policy with a batch count",
            )
        })?;
        tracing::info!(
            rank = init.rank,
            world = shape.world_size(),
            model = job.model.kind.name(),
            ?device,
            steps_per_epoch,
            loader_workers = job.data.loader_workers,
            "trainer ready"
        );
        let sources = || Sources::new(job.data.sources.options());
        let loader = Loader::new(job.data.train_loader(), sources())
            .map_err(|e| MethodError::fatal(e.to_string()))?;
        let val_loader = Loader::new(job.data.val_loader(), sources())
            .map_err(|e| MethodError::fatal(e.to_string()))?;
        let schedule = schedule(&init, steps_per_epoch);
        let mean = Tensor::from_slice(&pipelines::IMAGENET_MEAN)
            .view([1, 3, 1, 1])
            .to_device(device);
        let std = Tensor::from_slice(&pipelines::IMAGENET_STD)
            .view([1, 3, 1, 1])
            .to_device(device);
        Ok(Self {
            device,
            model,
            params,
            buffers,
            sgd,
            schedule,
            planner,
            loader,
            val_loader,
            shape,
            steps_per_epoch,
            listener: None,
            mix_listeners: Vec::new(),
            mix: None,
            // An NCCL call in flight cannot be aborted yet (the ring's can), so a rank of
            // an elastic job could hang on a lost peer there.
            nccl_problem: (init.job.optim.elastic && device != Device::Cpu).then(|| {
                "train.elastic is on, and an NCCL call waiting for a lost peer cannot be \
                 aborted yet"
                    .to_string()
            }),
            sync: None,
            running: None,
            resume_cursor: None,
            global_step: 0,
            scaler: LossScaler::for_job(
                init.job.optim.loss_scaling,
                init.job.optim.loss_scale_init,
                init.job.optim.precision.autocast_kind(device),
            ),
            mean,
            std,
            preloader: None,
            remote: None,
            snapshot: None,
            continued: None,
            lr_offset: 0,
            init,
            data_ip: ctx.data_ip(),
        })
    }

    fn use_loader_actors(
        &mut self,
        request: LoaderActorsRequest,
    ) -> Result<LoaderActorsReply, MethodError> {
        let workers = self.init.job.data.loader_workers.max(1) as usize;
        if request.loader_actors.len() != workers {
            return Err(MethodError::new(format!(
                "rank {}: {} loader actor addresses for {workers} loader workers",
                self.init.rank,
                request.loader_actors.len()
            )));
        }
        let secret = runtime::channel::ChannelSecret::from_hex(&request.secret)
            .map_err(|e| MethodError::new(format!("the data channel secret: {e}")))?;
        let remote = crate::load::RemoteLoaderWorkers::new(
            self.loader.clone(),
            request.loader_actors,
            secret,
            self.init.job.data.queue_batches,
        );
        let remote_workers = remote.remote_workers() as u32;
        self.remote = Some(remote);
        Ok(LoaderActorsReply { remote_workers })
    }

    fn listen(&mut self) -> Result<ListenReply, MethodError> {
        let listener = std::net::TcpListener::bind((self.data_ip, 0)).map_err(|e| {
            MethodError::new(format!("binding the ring port on {}: {e}", self.data_ip))
        })?;
        let port = listener
            .local_addr()
            .map_err(|e| MethodError::new(e.to_string()))?
            .port();
        self.listener = Some(listener);
        self.mix_listeners.clear();
        let mut mix_ports = Vec::new();
        if self.decentralized() {
            let groups = runtime::Mixer::groups_of(
                self.init.job.optim.topology,
                &self.rank_nodes(),
                self.init.rank,
            );
            for group in groups {
                let listener = std::net::TcpListener::bind((self.data_ip, 0))
                    .and_then(|l| Ok((l.local_addr()?.port(), l)))
                    .map_err(|e| {
                        MethodError::new(format!(
                            "binding the mixing port of the group {group:?} on {}: {e}",
                            self.data_ip
                        ))
                    })?;
                mix_ports.push(listener.0);
                self.mix_listeners.push(listener.1);
            }
        }
        let nccl_id = if self.init.rank == 0 && self.may_use_nccl() {
            match nccl::library().and_then(|lib| lib.unique_id()) {
                Ok(id) => Some(id.to_hex()),
                Err(error) => {
                    self.nccl_problem = Some(error.to_string());
                    None
                }
            }
        } else {
            None
        };
        Ok(ListenReply {
            nccl_id,
            mix_ports,
            port,
            steps_per_epoch: self.steps_per_epoch,
            total_steps: self.schedule.total_steps,
            parameters: self.params.iter().map(Tensor::numel).sum(),
            device: format!("{:?}", self.device),
        })
    }

    fn connect(&mut self, request: ConnectRequest) -> Result<ConnectReply, MethodError> {
        runtime::failpoint("trainer.connect");
        let listener = self
            .listener
            .take()
            .ok_or_else(|| MethodError::new("connect before listen"))?;
        let secret = parse_secret(&request.secret)?;
        let (rank, world) = (self.init.rank as usize, self.init.world as usize);
        let options = CollectiveOptions {
            op_timeout: std::time::Duration::from_secs(request.op_timeout_secs.max(1)),
            ..CollectiveOptions::default()
        };
        let ring_id = request.ring_id.clone();
        let next = request.next;
        let connect = move || async move {
            let listener = listener
                .set_nonblocking(true)
                .and_then(|()| tokio::net::TcpListener::from_std(listener))
                .map_err(|e| runtime::CollectiveError::InvalidArgument {
                    rank,
                    what: format!("the ring's listening socket: {e}"),
                })?;
            runtime::RingGroup::connect(rank, world, listener, next, &secret, &ring_id, options)
                .await
        };
        let bucket_bytes = self.init.job.optim.bucket_bytes;
        let mut sync = GradSync::start(connect, &self.params, bucket_bytes)
            .map_err(|e| ring_failure(self.init.rank, "joining the ring", &e))?;
        let allreduce = self.start_nccl(&mut sync, &request)?;
        if self.init.job.optim.overlap && !self.decentralized() {
            sync.overlap_backward(&self.params)
                .map_err(|e| MethodError::fatal(format!("rank {rank}: {e}")))?;
        }
        if self.decentralized() {
            self.connect_mixer(&request)?;
        }
        let mut own_replica = false;
        if let Some(resume) = &request.resume {
            own_replica = self.restore(resume)?;
        } else if let (0, Some(path), false) = (rank, &self.init.job.model.init, request.regrouped)
        {
            // Rank 0's weights are everyone's: the broadcast below hands them out.
            weights::load_init(&self.model, path)
                .map_err(|e| MethodError::fatal(format!("rank 0: model.init: {e}")))?;
        }
        let everything: Vec<Tensor> = self
            .params
            .iter()
            .chain(&self.buffers)
            .map(Tensor::shallow_clone)
            .collect();
        // A decentralized job resumes with every rank's own replica (the same choice on
        // every rank: they read one checkpoint).
        if !own_replica {
            sync.broadcast(&everything, 0).map_err(|e| {
                MethodError::fatal(format!("rank {rank}: broadcasting weights: {e}"))
            })?;
        }
        if request.regrouped {
            self.share_state(&mut sync)?;
        }
        let buckets = sync.buckets();
        self.sync = Some(sync);
        let allreduce = if self.decentralized() {
            let topology = self.init.job.optim.topology;
            format!(
                "none (decentralized: parameters mixed over the {topology} topology; \
                 broadcasts and sums through {allreduce})"
            )
        } else {
            allreduce
        };
        Ok(ConnectReply { buckets, allreduce })
    }

    fn decentralized(&self) -> bool {
        self.init.job.optim.sync == SyncChoice::Decentralized
    }

    /// The node of every rank, as the topology reads the world.
    fn rank_nodes(&self) -> Vec<u32> {
        runtime::node_of_each_rank(&self.init.node_ranks)
    }

    /// Whether this job's gradients may go through NCCL on this rank.
    fn may_use_nccl(&self) -> bool {
        self.device != Device::Cpu
            && self.init.job.optim.allreduce != AllreduceChoice::Ring
            && !self.elastic()
    }

    /// Moves `sync` onto NCCL when every rank can (see [`negotiate::start_nccl`]), giving
    /// the communicator half the job's step timeout (`request.op_timeout_secs`, from
    /// `train.step_timeout_secs`; [`negotiate::init_timeout`]) to start; returns what
    /// averages the gradients.
    fn start_nccl(
        &self,
        sync: &mut GradSync,
        request: &ConnectRequest,
    ) -> Result<String, MethodError> {
        let rank = Negotiating {
            rank: self.init.rank,
            world: self.init.world as usize,
            device: self.device,
            required: self.init.job.optim.allreduce == AllreduceChoice::Nccl,
            may_use: self.may_use_nccl(),
            problem: self.nccl_problem.clone(),
            init_timeout: negotiate::init_timeout(request.op_timeout_secs),
        };
        negotiate::start_nccl(sync, &rank, request.nccl_id.as_deref())
    }

    /// Restores the checkpoint; true when this rank took its own replica from it (a
    /// decentralized job's checkpoint, resumed by a decentralized job).
    fn restore(&mut self, resume: &ResumeFrom) -> Result<bool, MethodError> {
        let state = &resume.state;
        let layout = |node_ranks: &[u32]| ClusterShape::with_node_ranks(node_ranks.to_vec(), 1);
        if state.world != self.init.world
            || (!state.node_ranks.is_empty() && state.node_ranks != self.init.node_ranks)
        {
            return Err(MethodError::fatal(format!(
                "{}: saved by {} ranks ({}), this job has {} ({}); resume with the same \
                 layout",
                resume.dir.display(),
                state.world,
                layout(&state.node_ranks).layout(),
                self.init.world,
                layout(&self.init.node_ranks).layout()
            )));
        }
        if let Some(url) = &resume.store
            && !resume.dir.join(checkpoint::STATE_FILE).is_file()
        {
            checkpoint_store::download(url, &resume.dir, &self.init.job.data.sources.s3)
                .map_err(|e| MethodError::fatal(format!("copying the checkpoint: {e}")))?;
        }
        let (saved, momentum) =
            checkpoint::read_tensors(&resume.dir).map_err(|e| MethodError::fatal(e.to_string()))?;
        let mut targets = self.model.parameters();
        targets.extend(self.model.buffers());
        checkpoint::restore(&resume.dir, &saved, &targets)
            .map_err(|e| MethodError::fatal(e.to_string()))?;
        self.sgd
            .load_state(&momentum)
            .map_err(|e| MethodError::fatal(format!("{}: {e}", resume.dir.display())))?;
        self.global_step = state.global_step;
        if let Some(saved) = state.loss_scale {
            self.scaler.restore(saved);
        }
        self.resume_cursor = state
            .cursors
            .iter()
            .find(|c| c.rank == self.init.rank)
            .cloned();
        if !self.decentralized() {
            return Ok(false);
        }
        let Some(mine) = checkpoint::read_replica(&resume.dir, self.init.rank)
            .map_err(|e| MethodError::fatal(e.to_string()))?
        else {
            return Ok(false);
        };
        let (momentum, model): (Vec<_>, Vec<_>) = mine
            .into_iter()
            .partition(|(name, _)| name.starts_with(super::optim::MOMENTUM_PREFIX));
        let replicas = resume.dir.join(checkpoint::REPLICAS_FILE);
        let mut targets = self.model.parameters();
        targets.extend(self.model.buffers());
        let mine: Vec<(String, Tensor)> = model;
        checkpoint::restore(&replicas, &mine, &targets)
            .map_err(|e| MethodError::fatal(e.to_string()))?;
        self.sgd
            .load_state(&momentum)
            .map_err(|e| MethodError::fatal(format!("{}: {e}", replicas.display())))?;
        Ok(true)
    }

    /// Copies this node's shards into `data.preload_dir` for at most the request's
    /// seconds (finishing the shards begun). The first rank of each node copies what any
    /// rank of its node reads in any epoch, and its val shards; the others have nothing
    /// to copy.
    fn preload(&mut self, request: PreloadRequest) -> Result<PreloadReply, MethodError> {
        let sources = pipelines::Sources::new(pipelines::SourceOptions {
            cache: None,
            preloaded: None,
            ..self.init.job.data.sources.options()
        });
        if self.preloader.is_none() {
            let dir = self
                .init
                .job
                .data
                .sources
                .preload_dir
                .clone()
                .ok_or_else(|| MethodError::new("data.preload is off"))?;
            let urls = self.node_shards()?;
            let preloader = pipelines::Preloader::new(std::path::Path::new(&dir), &urls, &sources)
                .map_err(|e| MethodError::new(format!("rank {}: {e}", self.init.rank)))?;
            self.preloader = Some(preloader);
        }
        let preloader = self
            .preloader
            .as_mut()
            .ok_or_else(|| MethodError::new("no preload"))?;
        let seconds = std::time::Duration::from_secs_f64(request.seconds.clamp(0.1, 60.0));
        let progress = preloader
            .run(&sources, PRELOAD_JOBS, seconds)
            .map_err(|e| MethodError::new(format!("rank {}: {e}", self.init.rank)))?;
        Ok(PreloadReply {
            done: progress.done as u64,
            total: progress.total as u64,
            present: progress.present as u64,
            bytes: progress.bytes,
        })
    }

    /// The shards this node reads: for its first rank, those of every rank of the node in
    /// every epoch of the job, and the val shards; none for the node's other ranks.
    fn node_shards(&self) -> Result<Vec<String>, MethodError> {
        let rank = self.init.rank;
        let mut first = 0u32;
        let mut node = None;
        for (i, &count) in self.init.node_ranks.iter().enumerate() {
            if rank < first + count {
                node = Some((i as u32, first));
                break;
            }
            first += count;
        }
        let Some((node, first)) = node else {
            return Ok(Vec::new());
        };
        if rank != first {
            return Ok(Vec::new());
        }
        let mut urls: Vec<String> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for epoch in 0..self.init.job.optim.epochs {
            let plan = self
                .planner
                .plan(epoch)
                .map_err(|e| MethodError::new(format!("planning epoch {epoch}: {e}")))?;
            for rank_plan in plan.ranks.iter().filter(|r| r.node == node) {
                for item in rank_plan.workers.iter().flat_map(|w| &w.items) {
                    if seen.insert(item.url.clone()) {
                        urls.push(item.url.clone());
                    }
                }
            }
        }
        for url in &self.init.job.data.val.urls {
            if seen.insert(url.clone()) {
                urls.push(url.clone());
            }
        }
        Ok(urls)
    }

    fn start_epoch(&mut self, epoch: u64) -> Result<(), MethodError> {
        let plan = self.epoch_plan(epoch)?;
        let planned = plan.steps().ok_or_else(|| {
            MethodError::fatal(format!(
                "epoch {epoch}: the ranks' batch counts are unknown"
            ))
        })?;
        if planned == 0 {
            return Err(MethodError::fatal(format!(
                "epoch {epoch} has no samples to train on: the shards' counts are 0, or the \
                 hooks left the ranks no shards"
            )));
        }
        let cursor = self.resume_cursor.take().filter(|c| c.epoch == epoch);
        let steps = cursor.as_ref().map_or(0, |c| c.steps);
        tracing::info!(
            rank = self.init.rank,
            epoch,
            steps = planned,
            from_step = steps,
            "epoch starts"
        );
        let (rank, transform) = (
            Rank(self.init.rank),
            self.init.job.data.train_transform(epoch),
        );
        let batches = match self.remote.as_mut() {
            Some(remote) => {
                self.loader
                    .epoch_placed(&plan, rank, transform, cursor.as_ref(), remote)
            }
            None => self.loader.epoch(&plan, rank, transform, cursor.as_ref()),
        }
        .map_err(|e| MethodError::fatal(format!("starting epoch {epoch}: {e}")))?;
        phase::reading(Some(batches.reading()));
        self.running = Some(Running {
            epoch,
            batches,
            steps,
            planned,
            image_sizes: BTreeSet::new(),
            shards: BTreeSet::new(),
        });
        Ok(())
    }

    fn train(&mut self, request: TrainRequest) -> Result<TrainReply, MethodError> {
        self.take_snapshot();
        if self
            .running
            .as_ref()
            .is_none_or(|r| r.epoch != request.epoch)
        {
            self.start_epoch(request.epoch)?;
        }
        let started = Instant::now();
        let mut reply = TrainReply {
            epoch: request.epoch,
            step_in_epoch: 0,
            steps_in_epoch: 0,
            epoch_done: false,
            global_step: self.global_step,
            steps: Vec::new(),
            seconds: 0.0,
            data_wait_s: 0.0,
            compute_s: 0.0,
            allreduce_s: 0.0,
            samples: 0,
            cursor: None,
            skipped: 0,
            problems: Vec::new(),
            loader: pipelines::EpochStats::default(),
            sources: pipelines::SourceCounts::default(),
            received: None,
        };
        for _ in 0..request.max_steps {
            let Some(running) = self.running.as_mut() else {
                break;
            };
            if running.steps >= running.planned {
                break;
            }
            let step_started = Instant::now();
            phase::at(request.epoch, self.global_step + 1);
            phase::enter(Phase::WaitingForData);
            let batch = match running.batches.next() {
                Some(Ok(batch)) => batch,
                Some(Err(e)) => {
                    return Err(MethodError::fatal(format!(
                        "rank {} epoch {}: {e}",
                        self.init.rank, request.epoch
                    )));
                }
                None => {
                    return Err(MethodError::fatal(format!(
                        "rank {} epoch {}: the loader ended after {} of {} batches",
                        self.init.rank, request.epoch, running.steps, running.planned
                    )));
                }
            };
            if !batch.is_empty() {
                running.image_sizes.insert(batch.size);
                for id in &batch.ids {
                    // The URL is shared by every sample of its shard: a count, not a copy.
                    running.shards.insert(Arc::clone(&id.url));
                }
            }
            running.steps += 1;
            let data_wait_s = step_started.elapsed().as_secs_f64();
            phase::enter(Phase::Computing);
            let mut step = self.step(&batch)?;
            if request.sample_ids {
                step.sample_ids = batch.ids.iter().map(ToString::to_string).collect();
            }
            step.timing.data_wait_s = data_wait_s;
            step.timing.seconds = step_started.elapsed().as_secs_f64();
            reply.data_wait_s += step.timing.data_wait_s;
            reply.compute_s += step.timing.compute_s;
            reply.allreduce_s += step.timing.allreduce_s;
            reply.samples += batch.len() as u64;
            reply.steps.push(step);
        }
        let running = self
            .running
            .as_ref()
            .ok_or_else(|| MethodError::new("no epoch running"))?;
        let mut stats = running.batches.stats();
        reply.step_in_epoch = running.steps;
        reply.steps_in_epoch = running.planned;
        reply.epoch_done = running.steps >= running.planned;
        reply.global_step = self.global_step;
        reply.cursor = (!reply.epoch_done).then(|| running.batches.cursor().clone());
        reply.skipped = stats.skipped();
        reply.problems = std::mem::take(&mut stats.problems);
        reply.loader = stats;
        reply.sources = self.loader.source_counts();
        reply.sources.merge(&self.val_loader.source_counts());
        reply.seconds = started.elapsed().as_secs_f64();
        if reply.epoch_done {
            reply.received = Some(EpochReceived {
                image_sizes: running.image_sizes.iter().copied().collect(),
                shards: summarize_names(&running.shards.iter().collect::<Vec<_>>()),
            });
            self.running = None;
            phase::reading(None);
        }
        Ok(reply)
    }

    /// One optimiser step on `batch` (empty when this rank is out of data), with its
    /// compute and allreduce times; the caller adds the rest of the timing.
    fn step(&mut self, batch: &pipelines::Batch) -> Result<StepRecord, MethodError> {
        if self.decentralized() {
            return self.step_decentralized(batch);
        }
        let computing = Instant::now();
        let n = batch.len();
        self.sync
            .as_mut()
            .ok_or_else(|| MethodError::new("train before connect"))?
            .before_backward(n as f32)
            .map_err(|e| ring_failure(self.init.rank, "arming the gradient hooks", &e))?;
        let extra = self.forward_backward(batch);
        if extra.is_err()
            && let Some(sync) = self.sync.as_mut()
        {
            sync.abandon_step();
        }
        let mut extra = extra?;
        let compute_s = computing.elapsed().as_secs_f64();
        phase::enter(Phase::Averaging);
        let lr_step = self.lr_step();
        let sync = self
            .sync
            .as_mut()
            .ok_or_else(|| MethodError::new("train before connect"))?;
        let stats = sync
            .average(
                &self.params,
                n as f32,
                &mut extra,
                (1.0 / self.scaler.scale()) as f32,
            )
            .map_err(|e| ring_failure(self.init.rank, "averaging gradients", &e))?;
        // Every rank has the average; this one ends before it steps (tests).
        runtime::failpoint("trainer.after_average");
        let lr = self.schedule.lr_at(lr_step);
        let loss_scale = self.scaler.scale();
        // Every rank sees the same averaged bits, so all take the same verdict.
        let verdict = self.scaler.update(stats.finite);
        match verdict {
            StepVerdict::Diverged => {
                return Err(MethodError::fatal(format!(
                    "step {}: the averaged gradients are not finite (the loss diverged; \
                     try a lower train.lr or a longer warm-up)",
                    self.global_step + 1
                )));
            }
            // An overflow under loss scaling: the step is skipped, as PyTorch's
            // GradScaler does, and the scale was halved.
            StepVerdict::Skip => {}
            StepVerdict::Apply if stats.samples > 0.0 => self.sgd.step(lr),
            StepVerdict::Apply => {}
        }
        if !self.buffers.is_empty() {
            sync.broadcast(&self.buffers, 0)
                .map_err(|e| ring_failure(self.init.rank, "broadcasting buffers", &e))?;
        }
        self.global_step += 1;
        Ok(StepRecord {
            step: self.global_step,
            loss: extra[0],
            accuracy: extra[1],
            lr,
            samples: stats.samples as u64,
            loss_scale: self.scaler.enabled().then_some(loss_scale),
            skipped: verdict == StepVerdict::Skip,
            timing: StepTiming {
                compute_s,
                allreduce_s: stats.wait.as_secs_f64(),
                ..StepTiming::default()
            },
            sample_ids: Vec::new(),
        })
    }

    /// Zeroes the gradients, then (on a batch with samples) runs forward and backward of
    /// the (scaled) loss; returns the batch's mean loss and top-1 accuracy.
    ///
    /// Host synchronisations of a CUDA step on NCCL: 2, where there were 6. Here the loss
    /// and the top-1 count come back in one transfer after backward is queued (before:
    /// the loss's `double_value` and the count's `int64_value`), and the labels go up
    /// from pinned memory without waiting, like the images (before: a pageable copy, which
    /// waits for the device); `GradSync::average` then reads once (before: an upload of
    /// the extra values, a read of the sums and one of the finite flag). On the ring the
    /// staging of each bucket through the host comes on top, as before.
    fn forward_backward(&mut self, batch: &pipelines::Batch) -> Result<[f32; 2], MethodError> {
        let n = batch.len();
        self.sgd.zero_grad();
        if n == 0 {
            return Ok([0.0; 2]);
        }
        let (images, labels) = self.tensors(batch)?;
        let logits = self.forward(&images, true)?;
        let loss = cross_entropy_smoothed(
            &logits.to_kind(Kind::Float),
            &labels,
            self.init.job.optim.label_smoothing,
        );
        let scaled = if self.scaler.enabled() {
            &loss * self.scaler.scale()
        } else {
            loss.shallow_clone()
        };
        scaled
            .f_backward()
            .map_err(|e| fatal("backward")(e.to_string()))?;
        let correct = topk_correct_tensor(&logits, &labels, 1);
        let read =
            to_host(&[loss, correct]).map_err(|e| fatal("reading the loss")(e.to_string()))?;
        Ok([read[0] as f32, read[1] as f32 / n as f32])
    }

    /// The model's logits for `images`, under the job's precision (autocast on CUDA).
    fn forward(&self, images: &Tensor, train: bool) -> Result<Tensor, MethodError> {
        self.init
            .job
            .optim
            .precision
            .autocast(self.device, || self.model.forward_t(images, train))
            .map_err(|e| MethodError::fatal(e.to_string()))
    }

    /// The replica's parameters and buffers, in order (what mixing averages).
    fn state_tensors(&self) -> Vec<Tensor> {
        self.params
            .iter()
            .chain(&self.buffers)
            .map(Tensor::shallow_clone)
            .collect()
    }

    /// The batch as a normalised float NCHW tensor on the device (channels-last in memory
    /// under `train.channels_last`), and its labels, checked against the number of classes.
    fn tensors(&self, batch: &pipelines::Batch) -> Result<(Tensor, Tensor), MethodError> {
        let classes = self.model.classes();
        if let Some(i) = batch.labels.iter().position(|&l| l < 0 || l >= classes) {
            let id = &batch.ids[i];
            return Err(MethodError::fatal(format!(
                "{}: sample `{}` has label {}, outside the model's {classes} classes",
                id.url,
                pipelines::escaped(id.key.as_bytes()),
                batch.labels[i]
            )));
        }
        let pixels = batch
            .pixels_u8()
            .ok_or_else(|| MethodError::fatal("the loader gave float images; expected bytes"))?;
        let size = i64::from(batch.size);
        let n = batch.len() as i64;
        let images = to_device_async(
            &Tensor::from_slice(&pixels[..(n * size * size * 3) as usize]).view([n, size, size, 3]),
            self.device,
        )
        .map_err(|e| fatal("uploading the images")(e.to_string()))?;
        let images =
            (images.permute([0, 3, 1, 2]).to_kind(Kind::Float) / 255.0 - &self.mean) / &self.std;
        let labels = to_device_async(&Tensor::from_slice(&batch.labels), self.device)
            .map_err(|e| fatal("uploading the labels")(e.to_string()))?;
        // Under `train.channels_last` the images stay channels-last, the loader's NHWC
        // layout seen as NCHW (the ops above keep it), on both devices: libtorch's CPU
        // convolutions, pooling and BatchNorm take the small CNN's forward and backward in
        // about 0.55x the time they take on NCHW (README, "Layout"), and on CUDA cuDNN's
        // NHWC kernels meet the channels-last weights. Every rank runs the same kernels,
        // so replicas stay identical.
        let images = if self.init.job.optim.channels_last {
            images
        } else {
            images.contiguous()
        };
        Ok((images, labels))
    }

    /// Evaluates on this rank's share of the validation set; a decentralized job
    /// evaluates the replicas' mean, then takes its own replica back.
    fn evaluate(&mut self) -> Result<EvalReply, MethodError> {
        // The same answer on every rank, so either all average or none.
        if !self.decentralized() || self.init.job.data.val.is_empty() {
            return self.evaluate_model();
        }
        let (own, distance) = self.take_mean_state()?;
        let evaluated = self.evaluate_model();
        decentral::write_state(&self.state_tensors(), &own).map_err(|e| {
            MethodError::fatal(format!(
                "rank {}: taking back its replica: {e}",
                self.init.rank
            ))
        })?;
        let mut reply = evaluated?;
        reply.replica_distance = Some(distance);
        Ok(reply)
    }

    fn evaluate_model(&mut self) -> Result<EvalReply, MethodError> {
        let started = Instant::now();
        let mut reply = EvalReply {
            samples: 0,
            loss_sum: 0.0,
            top1: 0,
            top5: 0,
            seconds: 0.0,
            replica_distance: None,
        };
        let data = &self.init.job.data;
        if data.val.is_empty() {
            return Ok(reply);
        }
        let batch_size = self.init.job.optim.batch_size;
        let planner = Planner::new(
            data.val_plan(self.shape.clone(), batch_size),
            Hooks::builtin(),
        )
        .map_err(|e| MethodError::new(format!("validation plan: {e}")))?;
        let plan = planner
            .plan(0)
            .map_err(|e| MethodError::new(format!("validation plan: {e}")))?;
        let batches = self
            .val_loader
            .epoch(&plan, Rank(self.init.rank), data.eval_transform(), None)
            .map_err(|e| MethodError::new(format!("validation: {e}")))?;
        let _guard = tch::no_grad_guard();
        for batch in batches {
            let batch = batch.map_err(|e| MethodError::new(format!("validation: {e}")))?;
            if batch.is_empty() {
                continue;
            }
            let (images, labels) = self.tensors(&batch)?;
            let logits = self.forward(&images, false)?.to_kind(Kind::Float);
            let loss = cross_entropy_smoothed(&logits, &labels, 0.0);
            let top1 = topk_correct_tensor(&logits, &labels, 1);
            let top5 = topk_correct_tensor(&logits, &labels, 5);
            // One transfer per batch (before: three).
            let read = to_host(&[loss, top1, top5])
                .map_err(|e| MethodError::new(format!("validation: {e}")))?;
            reply.loss_sum += read[0] * batch.len() as f64;
            reply.top1 += read[1] as u64;
            reply.top5 += read[2] as u64;
            reply.samples += batch.len() as u64;
        }
        reply.seconds = started.elapsed().as_secs_f64();
        Ok(reply)
    }

    fn save(&mut self, request: SaveRequest) -> Result<PathBuf, MethodError> {
        if self.decentralized() {
            return self.save_replicas(request);
        }
        let mut model = self.model.parameters();
        model.extend(self.model.buffers());
        self.write_checkpoint(request, &model, &self.sgd.state(), &[])
    }

    /// Writes checkpoint `request` of these tensors (see [`checkpoint::write`]), with the
    /// loss scaler's state.
    fn write_checkpoint(
        &self,
        request: SaveRequest,
        model: &[(String, Tensor)],
        optimizer: &[(String, Tensor)],
        replicas: &[(String, Tensor)],
    ) -> Result<PathBuf, MethodError> {
        let state = CheckpointState {
            loss_scale: self.scaler.state(),
            ..request.state
        };
        let saved = checkpoint::write(
            &request.root,
            &request.name,
            model,
            optimizer,
            replicas,
            &state,
        )
        .map_err(|e| MethodError::new(format!("saving a checkpoint: {e}")))?;
        // The save stands whatever pruning does: a folder that cannot be removed costs
        // disk, not the job.
        let retention = checkpoint::Retention {
            keep: request.keep as usize,
            keep_best: request.keep_best,
        };
        match checkpoint::prune(&request.root, retention) {
            Ok(removed) if !removed.is_empty() => {
                tracing::info!(?removed, ?retention, "older checkpoints removed");
            }
            Ok(_) => {}
            Err(error) => tracing::warn!("pruning old checkpoints: {error}"),
        }
        if let Some(prefix) = &request.store {
            self.copy_to_store(prefix, &saved, retention)?;
        }
        Ok(saved)
    }

    /// Copies the checkpoint `saved` to `prefix` in the checkpoint store and prunes the
    /// store as the run folder was. A copy that fails fails the save (the run folder
    /// keeps the checkpoint); a pruning that fails costs storage, not the job.
    fn copy_to_store(
        &self,
        prefix: &str,
        saved: &Path,
        retention: checkpoint::Retention,
    ) -> Result<(), MethodError> {
        let options = &self.init.job.data.sources.s3;
        let started = std::time::Instant::now();
        checkpoint_store::upload(prefix, saved, options).map_err(|e| {
            MethodError::new(format!(
                "saving a checkpoint: copying it to the checkpoint store: {e}"
            ))
        })?;
        tracing::info!(
            to = prefix,
            seconds = started.elapsed().as_secs_f64(),
            "checkpoint copied to the store"
        );
        match checkpoint_store::prune(prefix, retention, options) {
            Ok(removed) if !removed.is_empty() => {
                tracing::info!(
                    ?removed,
                    to = prefix,
                    "older checkpoints removed from the store"
                );
            }
            Ok(_) => {}
            Err(error) => tracing::warn!("pruning old checkpoints in the store: {error}"),
        }
        Ok(())
    }

    fn digest(&self) -> Result<DigestReply, MethodError> {
        let mut hasher = Sha256::new();
        let mut values = Vec::new();
        for tensor in self.params.iter().chain(&self.buffers) {
            let flat = tensor
                .to_device(Device::Cpu)
                .to_kind(Kind::Float)
                .contiguous();
            values.resize(flat.numel(), 0.0f32);
            flat.f_copy_data(&mut values, flat.numel())
                .map_err(|e| MethodError::new(e.to_string()))?;
            for v in &values {
                hasher.update(v.to_le_bytes());
            }
        }
        Ok(DigestReply {
            sha256: format!("{:x}", hasher.finalize()),
        })
    }
}

impl Actor for Trainer {
    fn call(&mut self, method: &str, payload: &[u8]) -> Result<Vec<u8>, MethodError> {
        match method {
            EvaluateRequest::NAME => phase::enter(Phase::Evaluating),
            PreloadRequest::NAME => phase::enter(Phase::Preloading),
            SaveRequest::NAME => phase::enter(Phase::Checkpointing),
            _ => {}
        }
        // An elastic job's trainer outlives a lost peer in any method.
        let result = self.dispatch(method, payload).map_err(|e| self.survive(e));
        if method != ListenRequest::NAME && method != PhaseRequest::NAME {
            phase::enter(Phase::Idle);
        }
        result
    }
}

impl Trainer {
    fn dispatch(&mut self, method: &str, payload: &[u8]) -> Result<Vec<u8>, MethodError> {
        match method {
            PhaseRequest::NAME => answer(payload, |_: PhaseRequest| {
                phase::now().ok_or_else(|| MethodError::new("no phase recorded"))
            }),
            ListenRequest::NAME => answer(payload, |_: ListenRequest| self.listen()),
            PreloadRequest::NAME => answer(payload, |request| self.preload(request)),
            LoaderActorsRequest::NAME => answer(payload, |request| self.use_loader_actors(request)),
            ConnectRequest::NAME => answer(payload, |request| self.connect(request)),
            TrainRequest::NAME => answer(payload, |request| self.train(request)),
            EvaluateRequest::NAME => answer(payload, |_: EvaluateRequest| self.evaluate()),
            SaveRequest::NAME => answer(payload, |request| self.save(request)),
            DigestRequest::NAME => answer(payload, |_: DigestRequest| self.digest()),
            AverageRequest::NAME => answer(payload, |_: AverageRequest| self.average()),
            RollbackRequest::NAME => answer(payload, |request| self.rollback(request)),
            RegroupRequest::NAME => answer(payload, |request| self.regroup(request)),
            other => Err(MethodError::new(format!(
                "trainers have no method `{other}` ({})",
                METHODS.join(", ")
            ))),
        }
    }
}

/// Reads the request of method `M`, runs it, and encodes its reply.
fn answer<M: TrainerMethod>(
    payload: &[u8],
    run: impl FnOnce(M) -> Result<M::Reply, MethodError>,
) -> Result<Vec<u8>, MethodError> {
    let request: M = json(payload, &format!("{} request", M::NAME))?;
    reply(&run(request)?)
}

fn parse_secret(hex: &str) -> Result<RingSecret, MethodError> {
    let bytes: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| {
            hex.get(i..i + 2)
                .and_then(|b| u8::from_str_radix(b, 16).ok())
        })
        .collect::<Option<_>>()
        .ok_or_else(|| MethodError::new("the ring secret is not hex"))?;
    let bytes: [u8; 32] = bytes
        .try_into()
        .map_err(|_| MethodError::new("the ring secret is not 32 bytes"))?;
    Ok(RingSecret::from_bytes(bytes))
}

/// Hex of a ring secret, as `connect` takes it.
pub fn secret_hex(secret: &RingSecret) -> String {
    secret
        .as_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn schedule(init: &TrainerInit, steps_per_epoch: u64) -> LrSchedule {
    let optim = &init.job.optim;
    let to_steps = |epochs: f64| (epochs * steps_per_epoch as f64).round() as u64;
    let kind = match &optim.schedule {
        ScheduleSpec::Cosine { final_fraction } => ScheduleKind::Cosine {
            final_fraction: *final_fraction,
        },
        ScheduleSpec::Step { milestones, gamma } => ScheduleKind::Step {
            milestones: milestones.iter().map(|&e| to_steps(e as f64)).collect(),
            gamma: *gamma,
        },
        ScheduleSpec::Constant => ScheduleKind::Constant,
    };
    LrSchedule {
        base_lr: optim.lr,
        warmup_steps: to_steps(optim.warmup_epochs),
        warmup_start_fraction: optim.warmup_start_fraction,
        total_steps: optim.epochs * steps_per_epoch,
        kind,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_round_trip_through_hex() {
        let secret = RingSecret::random();
        let back = parse_secret(&secret_hex(&secret)).expect("parse");
        assert_eq!(back.as_bytes(), secret.as_bytes());
        for bad in ["", "zz", &"ab".repeat(31), &"ab".repeat(33)] {
            assert!(parse_secret(bad).is_err(), "{bad:?}");
        }
    }
}
