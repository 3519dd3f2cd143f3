//! A node's reports of its ended actors to the head.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tracing::{debug, warn};

use super::Shared;
use crate::actor::ActorExit;
use crate::daemon::message_name;
use crate::hosting::{NodeActors, outcome};
use crate::wire::Message;

/// How many times a node tries to report an ended actor before it gives up (the head
/// then learns of the end only if it loses the node).
const REPORT_TRIES: u32 = 12;
/// The first pause between tries; it doubles up to [`MAX_REPORT_PAUSE`].
const FIRST_REPORT_PAUSE: Duration = Duration::from_millis(50);
const MAX_REPORT_PAUSE: Duration = Duration::from_secs(2);
/// How long one report may wait for the head's answer.
const REPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// Reports every actor that ends on this node to the head, in order, each retried with
/// backoff while the head is unreachable; runs until its task is aborted.
pub(super) async fn report_exits(
    shared: Arc<Shared>,
    actors: Arc<NodeActors>,
    mut exits: mpsc::UnboundedReceiver<ActorExit>,
) {
    while let Some(ActorExit { actor_id, reason }) = exits.recv().await {
        actors.ended(actor_id);
        let (outcome, reason, origin) = outcome(&reason);
        let mut pause = FIRST_REPORT_PAUSE;
        for attempt in 1..=REPORT_TRIES {
            let report = Message::ActorEnded {
                actor_id: actor_id.0,
                node_id: shared.session().node_id.0,
                outcome: outcome.to_owned(),
                reason: reason.clone(),
                origin: origin.to_wire(),
            };
            let answer = match shared.connection(REPORT_TIMEOUT).await {
                Ok(connection) => connection.request(&report, REPORT_TIMEOUT).await,
                Err(error) => Err(error),
            };
            match answer {
                Ok(Message::Ack) => {
                    debug!(actor = %actor_id, outcome, "reported an ended actor");
                    break;
                }
                Ok(other) => {
                    warn!(actor = %actor_id, answer = message_name(&other), "the head did not take the report of an ended actor");
                    break;
                }
                Err(error) if attempt == REPORT_TRIES => {
                    warn!(actor = %actor_id, %error, "cannot report an ended actor to the head; giving up");
                    break;
                }
                Err(error) => {
                    debug!(actor = %actor_id, %error, attempt, "cannot report an ended actor yet");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(MAX_REPORT_PAUSE);
                }
            }
        }
        actors.reported(actor_id);
    }
}
