//! Loader actors: a rank's loader workers run on another node (`data.loaders =
//! "remote"`), and their batches travel to the rank's trainer over a data channel of the
//! runtime.
//!
//! The split is at the loader worker, the unit the plan already has: the trainer plans
//! its epoch as it always does and, for each worker the job gave to a loader actor,
//! sends that actor the worker's [`pipelines::LoaderWorkerRun`] (its part of the plan, its
//! cursor) on a data channel of its own; the actor runs the worker's reader and decoder
//! threads exactly as the trainer would and streams back its messages as frames
//! ([`pipelines::encode_frame`]): `u8` pixels, labels, sample ids, the worker's cursor
//! after each batch, and its counts. The trainer takes the workers' batches in the same
//! fixed turn as local ones, so plans, step counts, cursors and resumes are the same
//! whichever loader placement a job uses.
//!
//! A loader actor that is lost costs no sample and repeats none: the trainer's feed
//! (`feed.rs`) remembers the cursor of the last batch it passed on, and starts the
//! worker again in its own process from there; batches that were in flight are made
//! again, identically.

mod feed;
mod protocol;
mod server;

pub use feed::RemoteLoaderWorkers;
pub use protocol::{
    AddressRequest, LOADER_KIND, LoadRequest, LoaderAddress, LoaderInit, LoaderMethod,
};

/// Registers the loader kind.
pub fn register(registry: &mut runtime::ActorRegistry) {
    registry.register(LOADER_KIND, |ctx, args| {
        Ok(Box::new(server::LoaderActor::new(ctx, args)?) as Box<dyn runtime::Actor>)
    });
}
