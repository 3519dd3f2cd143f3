//! `events`: server-sent events that tell an open page the cluster changed, so that it
//! fetches itself again (the page's script, `pages::SCRIPT`). The server looks at the
//! snapshot every [`LOOK_EVERY`] and sends one event when what a page shows changed (a
//! job's state, epoch or step, a rank's phase or step, a node's state), at most
//! [`MAX_STREAMS`] streams at once; a comment every [`KEEP_ALIVE`] keeps proxies from
//! closing a quiet stream. A stream ends when its page goes away or the dashboard stops.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use actors::job::ClusterSnapshot;
use axum::body::{Body, Bytes, HttpBody};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};

/// How often a stream looks at the snapshot.
const LOOK_EVERY: Duration = Duration::from_millis(250);

/// How long a stream may stay silent before a keep-alive comment.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// The most streams open at once; more are refused (the page then stays as it is).
pub(super) const MAX_STREAMS: usize = 16;

/// What a page shows of `snapshot`, hashed: equal while nothing a page shows changed.
/// Ended jobs count as the snapshot's one number for them (their status never changes),
/// so a head of thousands of ended jobs hashes only its running ones.
pub(super) fn version(snapshot: &ClusterSnapshot) -> u64 {
    let mut hash = DefaultHasher::new();
    for node in &snapshot.cluster.nodes {
        (node.id.0, node.state.to_string()).hash(&mut hash);
    }
    snapshot.jobs.ended().hash(&mut hash);
    let ended = |job: &&std::sync::Arc<actors::job::JobSnapshot>| {
        job.job
            .as_ref()
            .is_some_and(|status| status.state.is_final())
    };
    let coordinated = snapshot.jobs.coordinated().iter();
    for job in coordinated.filter(|job| !ended(job)) {
        job.name.hash(&mut hash);
        job.problem.hash(&mut hash);
        if let Some(status) = &job.job {
            (status.state.name(), status.epoch, status.position).hash(&mut hash);
            status
                .checkpoint
                .as_ref()
                .map(|c| c.global_step)
                .hash(&mut hash);
        }
        for rank in &job.ranks {
            rank.rank.hash(&mut hash);
            rank.problem.hash(&mut hash);
            if let Some(phase) = &rank.phase {
                (phase.phase.name(), phase.epoch, phase.step).hash(&mut hash);
            }
        }
    }
    hash.finish()
}

/// The streams' share of the server.
pub(super) struct Streams {
    open: Arc<Semaphore>,
    /// Turns true when the dashboard stops: every stream ends.
    stopping: watch::Receiver<bool>,
}

impl Streams {
    pub(super) fn new(stopping: watch::Receiver<bool>) -> Self {
        Streams {
            open: Arc::new(Semaphore::new(MAX_STREAMS)),
            stopping,
        }
    }

    /// A stream of change events fed by `look` (the snapshot's version, or none while it
    /// cannot be read); `None` when [`MAX_STREAMS`] are open.
    pub(super) fn open<F, Fut>(&self, look: F) -> Option<Body>
    where
        F: Fn() -> Fut + Send + 'static,
        Fut: Future<Output = Option<u64>> + Send,
    {
        let permit = Arc::clone(&self.open).try_acquire_owned().ok()?;
        let (send, receive) = mpsc::channel::<std::io::Result<Bytes>>(4);
        let mut stopping = self.stopping.clone();
        tokio::spawn(async move {
            let mut seen = look().await;
            let mut said = Instant::now();
            // Tells the browser to try again after 2 s if the stream breaks.
            if send
                .send(Ok(Bytes::from_static(b"retry: 2000\n\n")))
                .await
                .is_err()
            {
                return;
            }
            loop {
                tokio::select! {
                    () = tokio::time::sleep(LOOK_EVERY) => {}
                    // Stopping, or the dashboard gone.
                    _ = stopping.changed() => return,
                }
                let now = look().await;
                let message = if now.is_some() && now != seen {
                    seen = now;
                    Some(Bytes::from(format!("data: {:x}\n\n", now.unwrap_or(0))))
                } else if said.elapsed() >= KEEP_ALIVE {
                    Some(Bytes::from_static(b": still here\n\n"))
                } else {
                    None
                };
                if let Some(message) = message {
                    said = Instant::now();
                    if send.send(Ok(message)).await.is_err() {
                        return;
                    }
                }
                if send.is_closed() {
                    return;
                }
            }
        });
        Some(Body::new(ChannelBody {
            receive,
            _permit: permit,
        }))
    }
}

/// The body of a streamed answer: what its task sends, until the client goes away (the
/// task then sees its channel closed) or the task ends; an error cuts the answer short.
/// It holds its share of the server (`_permit`) while it lasts.
pub(super) struct ChannelBody {
    pub(super) receive: mpsc::Receiver<std::io::Result<Bytes>>,
    pub(super) _permit: OwnedSemaphorePermit,
}

impl HttpBody for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        self.receive
            .poll_recv(cx)
            .map(|piece| piece.map(|piece| piece.map(http_body::Frame::data)))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use actors::job::{JobSnapshot, JobState, JobStatus, Jobs};
    use runtime::ClusterStatus;

    use super::*;

    fn job(name: &str, state: JobState, position: u64) -> Arc<JobSnapshot> {
        let mut status = JobStatus::new(name, state, None);
        status.position = position;
        Arc::new(JobSnapshot {
            name: name.to_owned(),
            job: Some(status),
            ranks: Vec::new(),
            problem: None,
        })
    }

    fn snapshot(running_step: u64, ended_outcome: &str, ended: u64) -> ClusterSnapshot {
        let mut done = JobStatus::new("done", JobState::Succeeded, None);
        done.outcome = Some(ended_outcome.to_owned());
        let done = Arc::new(JobSnapshot {
            name: "done".to_owned(),
            job: Some(done),
            ranks: Vec::new(),
            problem: None,
        });
        let running = vec![job("run", JobState::Running, running_step)];
        ClusterSnapshot {
            taken_at_unix_ms: 0,
            cluster: ClusterStatus::new(1, Vec::new(), Vec::new()),
            jobs: Jobs::new(running, Arc::new(vec![done]), ended),
        }
    }

    #[test]
    fn the_version_follows_running_jobs_and_the_ended_ones_number_only() {
        let base = version(&snapshot(3, "a", 7));
        assert_eq!(base, version(&snapshot(3, "a", 7)));
        assert_ne!(base, version(&snapshot(4, "a", 7)), "a running job stepped");
        assert_ne!(
            base,
            version(&snapshot(3, "a", 8)),
            "an ended job came or went"
        );
        assert_eq!(
            base,
            version(&snapshot(3, "b", 7)),
            "an ended job is not looked at one by one"
        );
    }
}
