//! The worker process's side of a [`WorkerPool`](super::WorkerPool): [`worker_main`].
//!
//! The node passes one end of a Unix socket pair as the worker's stdin and talks over it in
//! both directions (see `pool.rs` for the exchange). The worker hosts its actors with
//! [`LocalActors`], puts the frames it reads into their mailboxes in the order read, and
//! exits as soon as its input ends: when the node retires it, and when the node daemon
//! dies, so a worker never outlives its node.

use std::collections::HashMap;
use std::io;
use std::os::fd::AsFd;
use std::process::ExitCode;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::net::UnixStream;
use tokio::sync::{OwnedRwLockReadGuard, RwLock, mpsc};
use tracing::{debug, warn};

use super::ActorId;
use super::error::{ActorError, ActorExit, ExitReason};
use super::local::{ActorSpec, LocalActors, LocalOptions};
use super::pool::{FRAME_OVERHEAD, write_frames};
use super::process::{
    DATA_IP_VARIABLE, GROUP_VARIABLE, HEAD_VARIABLE, MAX_FRAME_VARIABLE, STATE_DIR_VARIABLE,
};
use super::registry::ActorRegistry;
use crate::wire::{self, DEFAULT_MAX_FRAME, Message, WireError};

/// Frames that may wait to be written to the node.
const OUTGOING_FRAMES: usize = 1024;

/// Runs a worker process: hosts the actors the node starts here until the node closes
/// this process's stdin. Exit codes: 0 when the input ended (or the node went away), 2
/// when the input was not the node's socket or carried something that is not a frame.
pub fn worker_main(registry: ActorRegistry) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("imgrun worker: cannot start an async runtime: {error}");
            return ExitCode::from(2);
        }
    };
    let code = runtime.block_on(serve(registry));
    // Actor threads may be blocked in user code; the process ends without them.
    runtime.shutdown_background();
    code
}

async fn serve(registry: ActorRegistry) -> ExitCode {
    let group = std::env::var(GROUP_VARIABLE).unwrap_or_default();
    let max_frame = std::env::var(MAX_FRAME_VARIABLE)
        .ok()
        .and_then(|max| max.parse().ok())
        .unwrap_or(DEFAULT_MAX_FRAME);
    let channel = match channel_from_stdin() {
        Ok(channel) => channel,
        Err(error) => {
            eprintln!(
                "imgrun worker: stdin is not the node daemon's socket ({error}); workers are \
                 started by the node, not by hand"
            );
            return ExitCode::from(2);
        }
    };
    let data_ip = match std::env::var(DATA_IP_VARIABLE).map(|ip| ip.parse()) {
        Ok(Ok(ip)) => ip,
        Err(_) => LocalOptions::default().data_ip,
        Ok(Err(error)) => {
            eprintln!("imgrun worker: bad {DATA_IP_VARIABLE}: {error}");
            return ExitCode::from(2);
        }
    };
    let cluster = match (
        std::env::var_os(STATE_DIR_VARIABLE),
        std::env::var(HEAD_VARIABLE),
    ) {
        (Some(state_dir), Ok(head)) => Some(super::ClusterAccess {
            state_dir: state_dir.into(),
            head,
        }),
        _ => None,
    };
    let options = LocalOptions {
        visible_gpus: visible_gpus(std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref()),
        data_ip,
        cluster,
        ..LocalOptions::default()
    };
    let (exits, ended) = mpsc::unbounded_channel();
    let actors = match LocalActors::new(registry, options, exits) {
        Ok(actors) => actors,
        Err(error) => {
            eprintln!("imgrun worker: {error}");
            return ExitCode::from(2);
        }
    };
    let (mut read, write) = channel.into_split();
    let (outgoing, frames) = mpsc::channel(OUTGOING_FRAMES);
    let replies = Replies::default();
    tokio::spawn(write_frames(write, frames));
    tokio::spawn(report_exits(ended, outgoing.clone(), replies.clone()));
    debug!(group, "worker ready");
    loop {
        match wire::read_frame(&mut read, max_frame).await {
            Ok(Some(message)) => handle(&actors, message, &outgoing, &replies, max_frame).await,
            // The node closed its end, or went away (perhaps mid-frame).
            Ok(None) | Err(WireError::Io(_) | WireError::Truncated { .. }) => {
                debug!(group, "input closed; worker exits");
                return ExitCode::SUCCESS;
            }
            Err(error) => {
                eprintln!("imgrun worker: bad frame from the node: {error}");
                return ExitCode::from(2);
            }
        }
    }
}

/// Acts on one frame from the node. Waits only until a message is in its actor's mailbox,
/// so frames are handed on in the order read; results come back from tasks of their own.
async fn handle(
    actors: &LocalActors,
    message: Message,
    outgoing: &mpsc::Sender<Message>,
    replies: &Replies,
    max_frame: usize,
) {
    match message {
        Message::ActorStart {
            actor_id,
            kind,
            args,
            gpus,
            ..
        } => {
            let spec = ActorSpec {
                id: ActorId(actor_id),
                kind,
                args,
                gpus,
            };
            let actors = actors.clone();
            let outgoing = outgoing.clone();
            tokio::spawn(async move {
                let answer = match actors.start(spec).await {
                    Ok(()) => location(actor_id, "running"),
                    Err(ActorError::Start { reason, .. }) => Message::ActorFailed {
                        actor_id,
                        reason,
                        origin: wire::ORIGIN_HERE,
                    },
                    Err(error) => Message::ActorFailed {
                        actor_id,
                        reason: error.to_string(),
                        origin: wire::ORIGIN_HERE,
                    },
                };
                let _ = outgoing.send(answer).await;
            });
        }
        Message::ActorCall {
            actor_id,
            call_id,
            method,
            payload,
            timeout_ms,
        } => {
            let actor = ActorId(actor_id);
            let timeout = std::time::Duration::from_millis(u64::from(timeout_ms));
            // Taken before the call can run, given up once its reply is queued.
            let in_flight = replies.in_flight(actor);
            match actors.send_call(actor, &method, payload, timeout).await {
                Ok(pending) => {
                    let outgoing = outgoing.clone();
                    tokio::spawn(async move {
                        if let Some(reply) = reply_frame(call_id, pending.reply().await, max_frame)
                        {
                            let _ = outgoing.send(reply).await;
                        }
                        drop(in_flight);
                    });
                }
                Err(error) => {
                    if let Some(reply) = reply_frame(call_id, Err(error), max_frame) {
                        let _ = outgoing.send(reply).await;
                    }
                }
            }
        }
        Message::ActorTell {
            actor_id,
            method,
            payload,
        } => {
            if let Err(error) = actors.tell(ActorId(actor_id), &method, payload).await {
                debug!(%error, "tell not delivered");
            }
        }
        Message::ActorStop { actor_id, kill } => {
            if let Err(error) = actors.stop(ActorId(actor_id), kill) {
                debug!(%error, "stop not delivered");
            }
        }
        _ => warn!("unexpected message from the node; ignored"),
    }
}

/// The reply to a call, or none when the actor ended (its end, reported on its own, fails
/// the call on the node) or the node has stopped waiting.
fn reply_frame(
    call_id: u64,
    result: Result<Vec<u8>, ActorError>,
    max_frame: usize,
) -> Option<Message> {
    let max = max_frame.saturating_sub(FRAME_OVERHEAD);
    let result = match result {
        Ok(value) if value.len() > max => Err(format!(
            "reply of {} bytes exceeds the limit of {max}",
            value.len()
        )),
        Ok(value) => Ok(value),
        Err(ActorError::Method { message, .. }) => Err(message),
        Err(
            ActorError::Failed { .. }
            | ActorError::Killed(_)
            | ActorError::Stopped(_)
            | ActorError::Timeout { .. },
        ) => return None,
        Err(error) => Err(error.to_string()),
    };
    Some(Message::ActorReply { call_id, result })
}

/// Keeps the replies of an actor's calls ahead of the report of its end, which fails the
/// calls still pending on the node: without it, a call that ran just before a graceful
/// stop could be failed by the stop (the reply and the report come from different tasks).
#[derive(Debug, Clone, Default)]
struct Replies {
    actors: Arc<Mutex<HashMap<ActorId, Arc<RwLock<()>>>>>,
}

impl Replies {
    fn lock(&self, actor: ActorId) -> Arc<RwLock<()>> {
        let mut actors = self.actors.lock().unwrap_or_else(PoisonError::into_inner);
        Arc::clone(actors.entry(actor).or_default())
    }

    /// Held by a call from before it can run until its reply is queued. `None` once the
    /// actor's end is being reported: the call fails with that end and gets no reply.
    fn in_flight(&self, actor: ActorId) -> Option<OwnedRwLockReadGuard<()>> {
        self.lock(actor).try_read_owned().ok()
    }

    /// Waits until every reply of `actor` in flight is queued.
    async fn settled(&self, actor: ActorId) {
        let lock = self.lock(actor);
        let _settled = lock.write().await;
        let mut actors = self.actors.lock().unwrap_or_else(PoisonError::into_inner);
        actors.remove(&actor);
    }
}

/// Tells the node about every actor that ended here, after the replies it gave.
async fn report_exits(
    mut ended: mpsc::UnboundedReceiver<ActorExit>,
    outgoing: mpsc::Sender<Message>,
    replies: Replies,
) {
    while let Some(ActorExit { actor_id, reason }) = ended.recv().await {
        replies.settled(actor_id).await;
        let message = match reason {
            ExitReason::Failed { reason, origin } => Message::ActorFailed {
                actor_id: actor_id.0,
                reason,
                origin: origin.to_wire(),
            },
            ExitReason::Stopped => location(actor_id.0, "stopped"),
            ExitReason::Killed => location(actor_id.0, "killed"),
        };
        if outgoing.send(message).await.is_err() {
            return;
        }
    }
}

fn location(actor_id: u64, state: &str) -> Message {
    Message::ActorLocation {
        actor_id,
        node_id: 0,
        address: String::new(),
        state: state.to_string(),
        reason: String::new(),
        origin: wire::ORIGIN_HERE,
    }
}

/// This process's stdin as the socket the node passed, or an error if it is not a socket.
fn channel_from_stdin() -> io::Result<UnixStream> {
    let stdin = io::stdin().as_fd().try_clone_to_owned()?;
    let stream = std::os::unix::net::UnixStream::from(stdin);
    // Fails (ENOTSOCK) unless stdin is a socket.
    stream.local_addr()?;
    stream.set_nonblocking(true)?;
    UnixStream::from_std(stream)
}

/// The GPUs a `CUDA_VISIBLE_DEVICES` value shows, when it lists physical indices (as the
/// pool sets it); `None` when unset or in another form (UUIDs).
pub(crate) fn visible_gpus(value: Option<&str>) -> Option<Vec<u32>> {
    let value = value?.trim();
    if value.is_empty() {
        return Some(Vec::new());
    }
    value
        .split(',')
        .map(|index| index.trim().parse::<u32>().ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::actor::FailureOrigin;

    #[test]
    fn visible_gpus_are_read_as_the_pool_writes_them() {
        let cases: [(Option<&str>, Option<&[u32]>); 5] = [
            (None, None),
            (Some(""), Some(&[])),
            (Some("3,1"), Some(&[3, 1])),
            (Some(" 0 "), Some(&[0])),
            (Some("GPU-1234,0"), None),
        ];
        for (value, want) in cases {
            assert_eq!(visible_gpus(value), want.map(<[u32]>::to_vec), "{value:?}");
        }
    }

    #[test]
    fn calls_whose_actor_ended_get_no_reply() {
        let cases = [
            (Ok(b"ok".to_vec()), Some(Ok(b"ok".to_vec()))),
            (
                Ok(b"long".to_vec()),
                Some(Err("reply of 4 bytes exceeds the limit of 3".to_string())),
            ),
            (
                Err(ActorError::Method {
                    actor_id: ActorId(1),
                    method: "step".into(),
                    message: "bad batch".into(),
                }),
                Some(Err("bad batch".to_string())),
            ),
            (
                Err(ActorError::NotFound(ActorId(1))),
                Some(Err("no actor 1 here".into())),
            ),
            (Err(ActorError::Killed(ActorId(1))), None),
            (
                Err(ActorError::Failed {
                    actor_id: ActorId(1),
                    reason: "panicked".into(),
                    origin: FailureOrigin::Here,
                }),
                None,
            ),
        ];
        for (result, want) in cases {
            let got = reply_frame(7, result, 4096 + 3).map(|message| match message {
                Message::ActorReply { call_id: 7, result } => result,
                other => panic!("not a reply: {other:?}"),
            });
            assert_eq!(got, want);
        }
    }
}
