//! Actors: user code registered by kind name, hosted by the node daemon or by one of its
//! worker processes, reached by messages.
//!
//! - `registry.rs`: [`Actor`] (what user code implements), [`MethodError`],
//!   [`ActorContext`], and [`ActorRegistry`], constructors by kind name.
//! - `local.rs` + `host.rs`: [`LocalActors`] hosts actors in this process, each on an
//!   actix arbiter (a thread of its own, so blocking code blocks only its actor) with a
//!   bounded mailbox; an actix system on a thread of its own makes it usable from tokio.
//! - `pool.rs` + `process.rs`: [`WorkerPool`] hosts actors in worker processes, one per
//!   process group, started by re-executing a [`WorkerCommand`] with the group's
//!   `CUDA_VISIBLE_DEVICES`, talking `wire` frames over a socket that is the worker's
//!   stdin. A worker's death fails each of its actors with its exit code or signal and
//!   the last lines of its output. `worker.rs`: [`worker_main`], the worker's side.
//! - Both report every actor that started and then ended, once, as an [`ActorExit`] on a
//!   channel the daemon gives them.
//! - `directory.rs` is the head's side: where every actor of the cluster runs, restarts.
//! - `diagnostic.rs`: the kind `echo`, registered by the binary, to try a cluster out.
//!
//! Files, bottom up: a file uses only files on the lines before its own.
//! 1. `id`: the leaf.
//! 2. `error`.
//! 3. `directory`, `registry`.
//! 4. `host`, `process`.
//! 5. `diagnostic`, `local`.
//! 6. `pool`.
//! 7. `worker`.
//!
//! Semantics callers may rely on (see [`LocalActors`], [`WorkerPool`]):
//! - the messages one task sends to one actor, awaiting each, run in the order sent;
//! - a mailbox holds at most `mailbox_capacity` waiting messages; senders wait beyond
//!   that (back-pressure), within their timeout for calls;
//! - a graceful stop runs what is queued (callers get their replies), then
//!   [`Actor::stopping`]; a kill drops what is queued and its callers get "actor N was
//!   killed" at once; a method already running on a thread is never interrupted, except
//!   by killing its worker process;
//! - a fatal [`MethodError`] or a panic in actor code fails that actor only, with the
//!   message as the reason; never the process that hosts it; the failure's
//!   [`FailureOrigin`] (`Elsewhere` when the actor said it follows from another actor's)
//!   reaches its callers and its owner's events;
//! - an error does not mean the method did not run (a timed-out call that had started
//!   completes; one that had not is skipped).

mod diagnostic;
pub(crate) mod directory;
mod error;
mod host;
mod id;
mod local;
mod pool;
pub(crate) mod process;
mod registry;
mod worker;

pub use diagnostic::{ECHO_KIND, diagnostic_registry};
pub(crate) use directory::{
    ActorAction, ActorDirectory, DETACHED_OWNER, DirectoryConfig, DirectoryError, SpawnRequest,
};
pub use directory::{ActorEventKind, ActorLabel, RestartPolicy};
pub use error::{ActorError, ActorExit, ExitReason, FailureOrigin};
pub use id::ActorId;
pub use local::{ActorSpec, DEFAULT_MAILBOX_CAPACITY, LocalActors, LocalOptions};
pub use pool::WorkerPool;
pub use process::{PoolOptions, WorkerCommand};
pub use registry::{Actor, ActorContext, ActorFactory, ActorRegistry, ClusterAccess, MethodError};
pub(crate) use worker::visible_gpus;
pub use worker::worker_main;
