//! The node's heartbeat loop: one heartbeat per interval on its connection to the head;
//! on a refusal (the head forgot the session: it restarted, or declared the node dead),
//! a rejoin with the node's certificate; on a lost connection, a new one after an
//! exponential backoff. A lost connection alone does not rejoin: the session may still be
//! on, and a rejoin would end it and release what the node holds.
//!
//! Fencing: a session the head refused, or one not acknowledged for the dead window, is
//! over at the head, which has failed its actors (or is gone). The node then kills every
//! actor it hosts and waits for their worker processes to exit before it joins again, so
//! that its resources are counted free only once nothing of the old session uses them.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::Shared;
use super::join::accepted;
use crate::daemon::message_name;
use crate::transport::TransportError;
use crate::wire::Message;

/// The first pause after a failure; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// How long a new connection to the head may take.
const RECONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a fence waits for the worker processes it killed to exit.
const FENCE_LIMIT: Duration = Duration::from_secs(10);
/// How long a node about to join again waits for the head to hear of the actors it
/// killed (reports from the old session must not reach the head after the new one began).
const REPORT_LIMIT: Duration = Duration::from_secs(10);

/// What became of one heartbeat.
enum Beat {
    Acked,
    /// The head refused the session: join again.
    Refused(String),
    /// No answer: the connection or the head is gone.
    Lost(TransportError),
}

/// Sends heartbeats until the task is aborted.
pub(super) async fn run(shared: Arc<Shared>) {
    let mut seq = 0u64;
    let mut backoff = FIRST_BACKOFF;
    let mut lost = false;
    // When the head last acknowledged this node's session (or it joined).
    let mut last_ack = Instant::now();
    // Whether the actors of the current session were killed.
    let mut fenced = false;
    loop {
        let session = shared.session();
        let started = Instant::now();
        seq += 1;
        let outcome = beat(&shared, seq).await;
        let pause = match outcome {
            Beat::Acked => {
                if lost {
                    info!(node = %session.node_id, "reached the head again");
                    lost = false;
                }
                last_ack = Instant::now();
                if fenced {
                    // The head kept the session after all (it was itself stopped for as
                    // long); it learns of the killed actors from the node's reports.
                    info!(node = %session.node_id, "the head kept this node's session; taking actors again");
                    shared.actors.unfence();
                    fenced = false;
                }
                backoff = FIRST_BACKOFF;
                let interval = Duration::from_millis(session.heartbeat_ms);
                tokio::time::sleep_until(started + interval).await;
                continue;
            }
            Beat::Refused(reason) => {
                debug!(node = %session.node_id, %reason, "heartbeat refused; joining again");
                if !fenced {
                    fence(&shared, "the head ended its session").await;
                    fenced = true;
                }
                if !shared.actors.wait_reported(REPORT_LIMIT).await {
                    warn!(
                        node = %session.node_id,
                        limit_ms = REPORT_LIMIT.as_millis() as u64,
                        "the head was not told of every killed actor in time; joining again anyway"
                    );
                }
                match rejoin(&shared).await {
                    Ok(()) => {
                        shared.actors.unfence();
                        fenced = false;
                        last_ack = Instant::now();
                        backoff = FIRST_BACKOFF;
                        lost = false;
                        continue;
                    }
                    Err(reason) => {
                        warn!(%reason, "cannot join the head again");
                        backoff
                    }
                }
            }
            Beat::Lost(error) => {
                if !lost {
                    warn!(%error, "lost the head; reconnecting");
                    lost = true;
                } else {
                    debug!(%error, "head still unreachable");
                }
                shared.forget_connection();
                let window = Duration::from_millis(session.dead_after_ms);
                if !fenced && last_ack.elapsed() >= window {
                    fence(&shared, "cut off from the head for the dead window").await;
                    fenced = true;
                }
                backoff
            }
        };
        tokio::time::sleep(pause).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Kills every actor of the node's session (over at the head: `why`) and waits for their
/// worker processes to exit.
async fn fence(shared: &Shared, why: &'static str) {
    let session = shared.session();
    let fence = shared.actors.fence(FENCE_LIMIT).await;
    if fence.killed.is_empty() {
        info!(node = %session.node_id, session = %session.session, why, "session over; no actor to stop");
    } else {
        warn!(
            node = %session.node_id,
            session = %session.session,
            why,
            killed = ?fence.killed,
            "session over: killed the actors it hosted"
        );
    }
    if !fence.settled {
        warn!(
            node = %session.node_id,
            limit_ms = FENCE_LIMIT.as_millis() as u64,
            "killed actors or their worker processes had not ended in time"
        );
    }
}

/// One heartbeat, waiting at most the dead window for its answer (past it, the session
/// is over anyway).
async fn beat(shared: &Shared, seq: u64) -> Beat {
    let session = shared.session();
    let connection = match shared.connection(RECONNECT_TIMEOUT).await {
        Ok(connection) => connection,
        Err(error) => return Beat::Lost(error),
    };
    let heartbeat = Message::Heartbeat {
        node_id: session.node_id.0,
        session: session.session.0,
        seq,
    };
    let timeout = Duration::from_millis(session.dead_after_ms.max(session.heartbeat_ms));
    match connection.request(&heartbeat, timeout).await {
        Ok(Message::HeartbeatAck { .. }) => Beat::Acked,
        Ok(Message::Refused { reason }) => Beat::Refused(reason),
        Ok(other) => Beat::Refused(format!("unexpected {}", message_name(&other))),
        Err(error) => Beat::Lost(error),
    }
}

/// Joins again with the node's certificate (no token): a new session, perhaps a new node
/// id if the head restarted.
async fn rejoin(shared: &Shared) -> Result<(), String> {
    let connection = shared
        .connection(RECONNECT_TIMEOUT)
        .await
        .map_err(|error| error.to_string())?;
    let request = Message::JoinRequest {
        token: String::new(),
        node: shared.description.clone(),
    };
    let timeout = Duration::from_millis(shared.session().dead_after_ms).max(RECONNECT_TIMEOUT);
    let reply = match connection.request(&request, timeout).await {
        Ok(reply) => reply,
        Err(error) => {
            shared.forget_connection();
            return Err(error.to_string());
        }
    };
    let joined = accepted(reply, &shared.head_text, shared.ca_hash).map_err(|e| e.to_string())?;
    info!(
        node = %joined.session.node_id,
        session = %joined.session.session,
        head = %shared.head_text,
        "joined the head again"
    );
    shared.set_session(joined.session);
    Ok(())
}
