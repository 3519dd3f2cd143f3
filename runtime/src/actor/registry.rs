//! What actor code implements and how it is found: the [`Actor`] trait, the
//! [`ActorContext`] a constructor gets, [`MethodError`], and the [`ActorRegistry`] of
//! constructors by kind name.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use super::ActorId;
use super::error::{ActorError, FailureOrigin};

/// User code that the runtime hosts: one instance per actor, called one message at a
/// time on a thread of its own, so a method may block (libtorch) without holding up
/// anything else.
///
/// Payloads are bytes the caller encoded (JSON, rkyv, raw tensors: the runtime does not
/// look inside). A method that returns a [`MethodError::fatal`] or panics ends the
/// actor: it is reported failed and never called again.
pub trait Actor: Send + 'static {
    /// Runs `method` with `payload` and returns the encoded result.
    fn call(&mut self, method: &str, payload: &[u8]) -> Result<Vec<u8>, MethodError>;

    /// Runs `method` for a caller that does not wait for a result. By default, [`call`]
    /// with the result dropped. A non-fatal error is logged (nobody waits for it).
    ///
    /// [`call`]: Actor::call
    fn tell(&mut self, method: &str, payload: &[u8]) -> Result<(), MethodError> {
        self.call(method, payload).map(drop)
    }

    /// Runs once on a graceful stop, after the messages queued before the stop. Not on a
    /// kill or a failure. The actor is dropped right after it, on its own thread.
    fn stopping(&mut self) {}
}

/// Why a method (or a constructor) failed. Non-fatal errors go back to the caller and the
/// actor carries on; a fatal one also ends the actor.
///
/// Any `std::error::Error` converts into a non-fatal one, so `?` works in actor code.
#[derive(Clone, PartialEq, Eq)]
pub struct MethodError {
    message: String,
    fatal: bool,
    origin: FailureOrigin,
}

impl MethodError {
    /// An error for the caller; the actor carries on.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            fatal: false,
            origin: FailureOrigin::Here,
        }
    }

    /// An error after which the actor cannot go on (a CUDA error, lost state): it is
    /// reported failed and stops.
    pub fn fatal(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            fatal: true,
            origin: FailureOrigin::Here,
        }
    }

    /// Marks the error as following from another actor's failure (a peer this actor
    /// works with went away or stopped answering): [`FailureOrigin::Elsewhere`]. The
    /// mark travels with the actor's failure to its callers and its owner's events, so
    /// a program that watches many actors can look past it for the failure that came
    /// first.
    pub fn caused_elsewhere(mut self) -> Self {
        self.origin = FailureOrigin::Elsewhere;
        self
    }

    /// Where the failure started: [`FailureOrigin::Here`] unless the actor said
    /// [`caused_elsewhere`](Self::caused_elsewhere).
    pub fn origin(&self) -> FailureOrigin {
        self.origin
    }

    /// Whether the actor ends with this error.
    pub fn is_fatal(&self) -> bool {
        self.fatal
    }

    /// What went wrong, for a person to read.
    pub fn message(&self) -> &str {
        &self.message
    }
}

// Like anyhow's error, `MethodError` does not implement `std::error::Error` itself, which
// is what lets every error type convert into it.
impl<E: std::error::Error> From<E> for MethodError {
    fn from(error: E) -> Self {
        Self::new(error.to_string())
    }
}

impl fmt::Display for MethodError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl fmt::Debug for MethodError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match (self.fatal, self.origin) {
            (false, _) => "error",
            (true, FailureOrigin::Elsewhere) => "fatal, caused elsewhere",
            (true, _) => "fatal",
        };
        write!(f, "MethodError({kind}: {:?})", self.message)
    }
}

/// How an actor reaches the cluster that hosts it, as a program on its machine does:
/// the hosting daemon's state folder (whose credentials a `ClusterClient` uses) and the
/// head's address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterAccess {
    pub state_dir: std::path::PathBuf,
    pub head: String,
}

/// What a constructor learns about the actor it builds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActorContext {
    id: ActorId,
    gpus: Vec<u32>,
    cuda_ordinals: Vec<u32>,
    data_ip: IpAddr,
    cluster: Option<ClusterAccess>,
}

impl ActorContext {
    pub(crate) fn new(
        id: ActorId,
        gpus: Vec<u32>,
        cuda_ordinals: Vec<u32>,
        data_ip: IpAddr,
    ) -> Self {
        Self {
            id,
            gpus,
            cuda_ordinals,
            data_ip,
            cluster: None,
        }
    }

    pub(crate) fn with_cluster(mut self, cluster: Option<ClusterAccess>) -> Self {
        self.cluster = cluster;
        self
    }

    /// The id the head gave the actor.
    pub fn id(&self) -> ActorId {
        self.id
    }

    /// The physical indices (on its node) of the GPUs reserved for the actor.
    pub fn gpus(&self) -> &[u32] {
        &self.gpus
    }

    /// The same GPUs as CUDA numbers them in this process (`cuda:N`): their positions in
    /// the process's `CUDA_VISIBLE_DEVICES`, or the physical indices when it is unset.
    pub fn cuda_ordinals(&self) -> &[u32] {
        &self.cuda_ordinals
    }

    /// The address the actor's own listeners (data-plane sockets such as a ring port)
    /// bind: the one its node's daemon binds for the cluster, so a daemon started with
    /// `--bind 127.0.0.1` exposes nothing beyond it (unspecified when the daemon binds
    /// every interface).
    pub fn data_ip(&self) -> IpAddr {
        self.data_ip
    }

    /// How to reach the cluster from this actor (an actor that spawns and drives others,
    /// such as a job's coordinator, connects a `ClusterClient` with it); none when the
    /// actor is hosted outside a cluster's daemon.
    pub fn cluster(&self) -> Option<&ClusterAccess> {
        self.cluster.as_ref()
    }
}

/// Builds an actor from its context and the encoded constructor arguments. Runs on the
/// actor's own thread; may block (load a model). An error or a panic fails the start.
pub type ActorFactory =
    dyn Fn(&ActorContext, &[u8]) -> Result<Box<dyn Actor>, MethodError> + Send + Sync;

/// The kinds of actor a process can host, by name. Cheap to clone (shared).
///
/// The node daemon and its worker processes must register the same kinds: the binary
/// builds one registry and hands it to both.
#[derive(Clone, Default)]
pub struct ActorRegistry {
    kinds: BTreeMap<String, Arc<ActorFactory>>,
}

impl ActorRegistry {
    /// A registry with no kinds.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `factory` under `kind`; a later registration of the same kind replaces it.
    pub fn register<F>(&mut self, kind: impl Into<String>, factory: F) -> &mut Self
    where
        F: Fn(&ActorContext, &[u8]) -> Result<Box<dyn Actor>, MethodError> + Send + Sync + 'static,
    {
        self.kinds.insert(kind.into(), Arc::new(factory));
        self
    }

    /// The registered kinds, sorted.
    pub fn kinds(&self) -> impl Iterator<Item = &str> {
        self.kinds.keys().map(String::as_str)
    }

    /// The constructor of `kind`, or an error that names it and lists the registered ones.
    pub(crate) fn factory(&self, kind: &str) -> Result<Arc<ActorFactory>, ActorError> {
        self.kinds
            .get(kind)
            .cloned()
            .ok_or_else(|| ActorError::UnknownKind {
                kind: kind.to_string(),
                registered: self.kinds().map(str::to_string).collect(),
            })
    }
}

impl fmt::Debug for ActorRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ActorRegistry")
            .field("kinds", &self.kinds.keys().collect::<Vec<_>>())
            .finish()
    }
}
