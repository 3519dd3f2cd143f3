//! A job's log on the dashboard: `job/NAME/log` shows its last lines (`?lines=`, at most
//! [`MAX_LINES`], default [`DEFAULT_LINES`]) or the lines that hold a text (`?q=`),
//! and follows the job as its page does; `job/NAME/log.txt` downloads all of it, a piece
//! at a time, at most [`MAX_DOWNLOADS`] at once.
//!
//! The log is the job's `job.log`, read by its coordinator, which is found by the job's
//! name in the head's table: nothing of a request reaches a path, a shell or a process
//! argument.
//!
//! A rank's log, `job/NAME/rank/N/log`, is the newest lines of its trainer's process
//! (the trainer's and its loader's messages, libtorch's and NCCL's), which the job's
//! coordinator asks of the rank's node; the rank is one the snapshot lists for the job.
//! Its `?q=` shows the lines that hold a text, by the job log's rule
//! ([`lines_holding`]); `job/NAME/rank/N/log.txt` downloads the lines it keeps. Both take
//! `?attempt=K`, an earlier trainer of the rank (an elastic job's regroup or growth gave
//! it another): K is read as a number and checked against the coordinator's table of
//! the rank's attempts, whose node keeps the lines; it names no path.

use std::sync::Arc;

use actors::job::{
    COORDINATOR_CALL_TIMEOUT, ClusterSnapshot, JobHandle, LogFrom, LogReply, LogRequest,
    LogSearchReply, LogSearchRequest, MAX_LOG_PIECE, RankOutputReply, RankOutputRequest,
    call_coordinator, coordinator,
};
use anyhow::Context as _;
use axum::body::{Body, Bytes};
use runtime::ClusterClient;
use serde::Deserialize;
use tokio::sync::{Semaphore, mpsc};

use super::events::ChannelBody;

/// The lines a log page shows unless it asks for another number.
pub(super) const DEFAULT_LINES: u64 = 1000;

/// The most lines a log page shows.
pub(super) const MAX_LINES: u64 = 10_000;

/// The most matches a search shows (the newest).
const MAX_MATCHES: u64 = 1000;

/// Downloads at once; more are refused until one ends.
pub(super) const MAX_DOWNLOADS: usize = 4;

/// A log page's query.
#[derive(Debug, Default, Deserialize)]
pub(super) struct LogQuery {
    lines: Option<u64>,
    #[serde(default)]
    q: String,
}

/// What a log page shows.
pub(super) enum LogView {
    Tail { lines: u64, reply: LogReply },
    Search { text: String, reply: LogSearchReply },
}

/// The view `query` asks of the job `name`'s log; `None` when there is no such job.
pub(super) async fn view(
    client: &ClusterClient,
    name: &str,
    query: &LogQuery,
) -> anyhow::Result<Option<LogView>> {
    let Some(actor) = coordinator(client, name).await.context("asking the head")? else {
        return Ok(None);
    };
    let text = query.q.trim();
    let view = if text.is_empty() {
        let lines = query.lines.unwrap_or(DEFAULT_LINES).clamp(1, MAX_LINES);
        let request = LogRequest {
            from: LogFrom::Tail { lines },
            max_bytes: MAX_LOG_PIECE,
        };
        let reply = call_coordinator(&actor, &request, COORDINATOR_CALL_TIMEOUT).await?;
        LogView::Tail { lines, reply }
    } else {
        let request = LogSearchRequest {
            text: text.to_owned(),
            max_matches: MAX_MATCHES,
        };
        let reply = call_coordinator(&actor, &request, COORDINATOR_CALL_TIMEOUT).await?;
        LogView::Search {
            text: text.to_owned(),
            reply,
        }
    };
    Ok(Some(view))
}

/// The lines of a rank's output a rank's log page shows (all its node keeps).
const RANK_LINES: u32 = 1000;

/// The rank of the job `name` that `rank` names, when the snapshot lists the job with
/// that rank: the path's text is compared, never used.
pub(super) fn listed_rank(snapshot: &ClusterSnapshot, name: &str, rank: &str) -> Option<u32> {
    let job = snapshot.jobs.find(name)?;
    job.ranks
        .iter()
        .map(|view| view.rank)
        .find(|listed| listed.to_string() == rank)
}

/// A rank's log page's (and download's) query.
#[derive(Debug, Default, Deserialize)]
pub(super) struct RankLogQuery {
    #[serde(default)]
    q: String,
    /// As written: read by [`RankLogQuery::attempt`].
    #[serde(default)]
    attempt: Option<String>,
}

impl RankLogQuery {
    /// The text to find; empty for the newest lines.
    pub(super) fn text(&self) -> &str {
        self.q.trim()
    }

    /// The attempt asked for: `Ok(None)` for the current one (no `attempt`, or an empty
    /// one), `Err(())` when it is not a number.
    pub(super) fn attempt(&self) -> Result<Option<u32>, ()> {
        match self.attempt.as_deref().map(str::trim) {
            None | Some("") => Ok(None),
            Some(text) if text.bytes().all(|b| b.is_ascii_digit()) => {
                text.parse().map(Some).map_err(|_| ())
            }
            Some(_) => Err(()),
        }
    }
}

/// The lines of `lines` that hold `text` as it is written, case and all, oldest first:
/// the rule of the job log's search (`actors::job::search_log`), so that both pages find
/// the same lines. An empty `text` holds none, as there.
pub(super) fn lines_holding<'a>(lines: &'a [String], text: &str) -> Vec<&'a str> {
    if text.is_empty() {
        return Vec::new();
    }
    lines
        .iter()
        .map(String::as_str)
        .filter(|line| line.contains(text))
        .collect()
}

/// A rank's kept lines as a file: each ended by a line end.
pub(super) fn rank_file(output: &RankOutputReply) -> String {
    let mut file = String::with_capacity(output.lines.iter().map(|l| l.len() + 1).sum());
    for line in &output.lines {
        file.push_str(line);
        file.push('\n');
    }
    file
}

/// A rank's download's file name, `NAME-rank-N.log` (`NAME-rank-N-attempt-K.log` for
/// an attempt asked by number), by [`file_name`]'s rule.
pub(super) fn rank_file_name(name: &str, rank: u32, attempt: Option<u32>) -> String {
    match attempt {
        None => file_name(&format!("{name}-rank-{rank}")),
        Some(attempt) => file_name(&format!("{name}-rank-{rank}-attempt-{attempt}")),
    }
}

/// What the job's coordinator gave for a rank's log.
pub(super) enum RankLog {
    Lines(RankOutputReply),
    NoSuchJob,
    /// The attempt asked for is past the rank's last, by the coordinator's table.
    NoSuchAttempt,
}

/// Rank `rank`'s newest output lines, of attempt `attempt` (the current one when
/// `None`), asked of the job `name`'s coordinator. When an attempt asked for by number
/// is refused, the coordinator's table says whether the rank has it.
pub(super) async fn rank_output(
    client: &ClusterClient,
    name: &str,
    rank: u32,
    attempt: Option<u32>,
) -> anyhow::Result<RankLog> {
    let Some(actor) = coordinator(client, name).await.context("asking the head")? else {
        return Ok(RankLog::NoSuchJob);
    };
    let request = RankOutputRequest {
        rank,
        lines: RANK_LINES,
        attempt,
    };
    let refused = match call_coordinator(&actor, &request, COORDINATOR_CALL_TIMEOUT).await {
        Ok(reply) => return Ok(RankLog::Lines(reply)),
        Err(refused) => refused,
    };
    let Some(asked) = attempt else {
        return Err(refused.into());
    };
    let current = RankOutputRequest {
        rank,
        lines: 0,
        attempt: None,
    };
    match call_coordinator(&actor, &current, COORDINATOR_CALL_TIMEOUT).await {
        Ok(current) if asked >= current.attempts => Ok(RankLog::NoSuchAttempt),
        _ => Err(refused.into()),
    }
}

/// The downloads' share of the server.
pub(super) struct Downloads {
    open: Arc<Semaphore>,
}

/// Why a download did not start.
pub(super) enum Refused {
    NoSuchJob,
    Busy,
}

impl Downloads {
    pub(super) fn new() -> Self {
        Downloads {
            open: Arc::new(Semaphore::new(MAX_DOWNLOADS)),
        }
    }

    /// The job `name`'s log as it is now (later lines are left for a later download), a
    /// piece at a time.
    pub(super) async fn start(
        &self,
        client: &ClusterClient,
        name: &str,
    ) -> anyhow::Result<Result<Body, Refused>> {
        let Ok(permit) = Arc::clone(&self.open).try_acquire_owned() else {
            return Ok(Err(Refused::Busy));
        };
        let Some(actor) = coordinator(client, name).await.context("asking the head")? else {
            return Ok(Err(Refused::NoSuchJob));
        };
        // The first piece now, so that a job without a log is an error, not an empty file.
        let first = piece(&actor, 0).await?;
        let (send, receive) = mpsc::channel(2);
        tokio::spawn(send_rest(actor, first, send));
        Ok(Ok(Body::new(ChannelBody {
            receive,
            _permit: permit,
        })))
    }
}

/// Sends `first` and the pieces after it, up to the log's length when `first` was read.
async fn send_rest(actor: JobHandle, first: LogReply, send: mpsc::Sender<std::io::Result<Bytes>>) {
    let end = first.length;
    let mut offset = first.bytes.len() as u64;
    let mut next = Ok(first);
    loop {
        let mut reply = match next {
            Ok(reply) => reply,
            Err(error) => {
                let _ = send.send(Err(std::io::Error::other(error))).await;
                return;
            }
        };
        reply
            .bytes
            .truncate(usize::try_from(end.saturating_sub(reply.start)).unwrap_or(usize::MAX));
        if reply.bytes.is_empty() || send.send(Ok(Bytes::from(reply.bytes))).await.is_err() {
            return;
        }
        if offset >= end {
            return;
        }
        next = piece(&actor, offset).await.map_err(|e| format!("{e:#}"));
        if let Ok(reply) = &next {
            offset += reply.bytes.len() as u64;
        }
    }
}

async fn piece(actor: &JobHandle, offset: u64) -> anyhow::Result<LogReply> {
    let request = LogRequest {
        from: LogFrom::Offset { offset },
        max_bytes: MAX_LOG_PIECE,
    };
    Ok(call_coordinator(actor, &request, COORDINATOR_CALL_TIMEOUT).await?)
}

/// A download's file name for the job `name`: its letters, digits, `.`, `-` and `_`,
/// every other character `_`.
pub(super) fn file_name(name: &str) -> String {
    let safe: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{}.log", safe.trim_start_matches('.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_download_is_named_by_safe_characters_only() {
        for (name, file) in [
            ("run1", "run1.log"),
            ("resnet-50_a.b", "resnet-50_a.b.log"),
            ("a\"b\r\nc", "a_b__c.log"),
            ("../x", "_x.log"),
            ("é", "_.log"),
        ] {
            assert_eq!(file_name(name), file, "{name:?}");
        }
        assert_eq!(rank_file_name("run1", 3, None), "run1-rank-3.log");
        assert_eq!(rank_file_name("../a b", 0, None), "_a_b-rank-0.log");
    }

    #[test]
    fn a_rank_search_finds_the_lines_that_hold_the_text_as_written() {
        let lines: Vec<String> = [
            "trainer ready rank=0 world=2",
            "step 1 loss 2.3",
            "Trainer stopped",
            "<b>trainer ready</b> again",
        ]
        .map(String::from)
        .to_vec();
        for (text, found) in [
            (
                "trainer ready",
                &["trainer ready rank=0 world=2", "<b>trainer ready</b> again"][..],
            ),
            ("loss", &["step 1 loss 2.3"][..]),
            // Case and all, as the job log's search.
            ("TRAINER", &[][..]),
            ("Trainer", &["Trainer stopped"][..]),
            ("<b>", &["<b>trainer ready</b> again"][..]),
            ("absent", &[][..]),
            ("", &[][..]),
        ] {
            assert_eq!(lines_holding(&lines, text), found, "{text:?}");
        }
        assert!(lines_holding(&[], "x").is_empty());
    }

    #[test]
    fn a_rank_query_is_trimmed_and_a_file_ends_each_line() {
        for (q, text) in [("", ""), ("  ", ""), (" ready \t", "ready"), ("a b", "a b")] {
            let query = RankLogQuery {
                q: q.to_owned(),
                attempt: None,
            };
            assert_eq!(query.text(), text, "{q:?}");
        }
        let output = |lines: &[&str]| RankOutputReply {
            rank: 1,
            node: 2,
            lines: lines.iter().map(|l| l.to_string()).collect(),
            own_process: true,
            attempt: 0,
            attempts: 1,
        };
        assert_eq!(rank_file(&output(&[])), "");
        assert_eq!(rank_file(&output(&["a", "", "b"])), "a\n\nb\n");
    }

    #[test]
    fn an_attempt_is_a_number_or_refused() {
        // (the query's `attempt`, as written; what it asks)
        type Asked = Result<Option<u32>, ()>;
        let cases: [(Option<&str>, Asked); 10] = [
            (None, Ok(None)),
            (Some(""), Ok(None)),
            (Some("0"), Ok(Some(0))),
            (Some(" 2 "), Ok(Some(2))),
            (Some("007"), Ok(Some(7))),
            (Some("-1"), Err(())),
            (Some("+1"), Err(())),
            (Some("1.0"), Err(())),
            (Some("../../etc/passwd"), Err(())),
            (Some("99999999999"), Err(())),
        ];
        for (attempt, want) in cases {
            let query = RankLogQuery {
                q: String::new(),
                attempt: attempt.map(str::to_owned),
            };
            assert_eq!(query.attempt(), want, "{attempt:?}");
        }
        assert_eq!(
            rank_file_name("run", 2, Some(0)),
            "run-rank-2-attempt-0.log"
        );
    }
}
