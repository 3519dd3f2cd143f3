//! One worker process seen from the node: spawning it, its output, its end.
//!
//! The node and the worker talk over a Unix socket pair that is the worker's stdin, in
//! both directions, so that the worker's stdout stays free for whatever actor code prints
//! (libtorch does): stdout and stderr go to one other socket, whose lines are logged at
//! debug level, the last [`PoolOptions::stderr_lines`] kept for the failure reason and the
//! last 1,000 for whoever asks (`WorkerPool::output`: a rank's log), while an actor of
//! the process runs and, for the last [`ENDED_OUTPUTS`] actors that ended
//! ([`EndedOutputs`]), after it ended, as long as the node daemon itself runs.
//!
//! Below the pool (`pool.rs`): with [`WorkerCommand`] and [`PoolOptions`], what the pool
//! is told about its processes.
//!
//! [`PoolOptions::stderr_lines`]: PoolOptions::stderr_lines

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::OwnedFd;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::UnixStream;
use tokio::process::{Child, Command};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{Instrument, debug, info_span, warn};

use super::ActorId;
use crate::wire::DEFAULT_MAX_FRAME;

/// The program a worker process runs: the `imgrun` binary passes its own executable and
/// its hidden `worker` subcommand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerCommand {
    pub program: PathBuf,
    pub args: Vec<String>,
    /// Environment variables set for the worker, over those it inherits.
    pub env: Vec<(String, String)>,
}

impl WorkerCommand {
    /// `program` with `args`.
    pub fn new<I, S>(program: impl Into<PathBuf>, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            program: program.into(),
            args: args.into_iter().map(Into::into).collect(),
            env: Vec::new(),
        }
    }

    /// The same command with `key=value` in its workers' environment.
    #[must_use]
    pub fn with_env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// This process's own executable with `args`.
    pub fn current_exe<I, S>(args: I) -> io::Result<Self>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Ok(Self::new(std::env::current_exe()?, args))
    }
}

/// How a [`WorkerPool`](super::WorkerPool) runs its processes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolOptions {
    /// Lines of a worker's output (stdout and stderr) kept for its failure reason.
    pub stderr_lines: usize,
    /// How long a retired worker may take to exit before it is killed.
    pub retire_grace: Duration,
    /// The largest frame either way between the node and a worker (the worker is told);
    /// payloads must leave 4 KiB of room for the frame around them.
    pub max_frame: usize,
    /// The address the node's daemon binds, which the workers' actors bind their own
    /// listeners to ([`ActorContext::data_ip`](super::ActorContext::data_ip)); the daemon
    /// sets it.
    pub data_ip: IpAddr,
    /// How the workers' actors reach the cluster ([`ActorContext::cluster`](super::ActorContext::cluster));
    /// the daemon sets it.
    pub cluster: Option<super::ClusterAccess>,
}

impl Default for PoolOptions {
    fn default() -> Self {
        Self {
            stderr_lines: 20,
            retire_grace: Duration::from_secs(5),
            max_frame: DEFAULT_MAX_FRAME,
            data_ip: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            cluster: None,
        }
    }
}

/// The environment variable a worker finds its group in (for its own logs).
pub(crate) const GROUP_VARIABLE: &str = "IMGRUN_WORKER_GROUP";

/// The environment variable a worker finds the pool's frame limit in.
pub(crate) const MAX_FRAME_VARIABLE: &str = "IMGRUN_WORKER_MAX_FRAME";

/// The environment variable a worker finds the address its actors' listeners bind in.
pub(crate) const DATA_IP_VARIABLE: &str = "IMGRUN_WORKER_DATA_IP";
/// The hosting daemon's state folder and the head's address ([`super::ClusterAccess`]).
pub(crate) const STATE_DIR_VARIABLE: &str = "IMGRUN_WORKER_STATE_DIR";
pub(crate) const HEAD_VARIABLE: &str = "IMGRUN_WORKER_HEAD";

/// Lines of a worker's output kept for [`super::WorkerPool::output`] (a rank's log).
const OUTPUT_LINES: usize = crate::wire::MAX_OUTPUT_LINES as usize;

/// Longest line of worker output kept; the rest of a longer line is dropped.
const MAX_LINE: usize = 1000;

/// How long, once the worker has exited, its last frames and output may take to arrive
/// (longer only if something it started still holds its sockets).
const DRAIN: Duration = Duration::from_secs(2);

/// A worker process just started.
pub(crate) struct Spawned {
    pub(crate) child: Child,
    pub(crate) pid: u32,
    /// The node's end of the worker's stdin socket.
    pub(crate) channel: UnixStream,
    /// Collects the worker's stdout and stderr.
    pub(crate) output: JoinHandle<()>,
    pub(crate) lines: Arc<LineRing>,
}

/// Starts `command` for `group`, with `CUDA_VISIBLE_DEVICES` set to `gpus`, physical
/// indices (an empty string for none: such a worker sees no GPU), and
/// `CUDA_DEVICE_ORDER=PCI_BUS_ID` so that CUDA reads them in NVML's order, not its own
/// fastest-first one.
pub(crate) fn spawn(
    command: &WorkerCommand,
    group: &str,
    gpus: &str,
    options: &PoolOptions,
) -> io::Result<Spawned> {
    let (channel, theirs) = std::os::unix::net::UnixStream::pair()?;
    let (output, output_theirs) = std::os::unix::net::UnixStream::pair()?;
    let stderr = output_theirs.try_clone()?;
    let mut process = Command::new(&command.program);
    process
        .args(&command.args)
        .envs(command.env.iter().map(|(key, value)| (key, value)))
        .env("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        .env("CUDA_VISIBLE_DEVICES", gpus)
        .env(GROUP_VARIABLE, group)
        .env(MAX_FRAME_VARIABLE, options.max_frame.to_string())
        .env(DATA_IP_VARIABLE, options.data_ip.to_string())
        .envs(options.cluster.iter().flat_map(|cluster| {
            [
                (STATE_DIR_VARIABLE, cluster.state_dir.as_os_str().to_owned()),
                (HEAD_VARIABLE, cluster.head.clone().into()),
            ]
        }))
        .stdin(Stdio::from(OwnedFd::from(theirs)))
        .stdout(Stdio::from(OwnedFd::from(output_theirs)))
        .stderr(Stdio::from(OwnedFd::from(stderr)))
        // A process group of its own: Ctrl-C at the terminal of a program that hosts
        // workers (an embedded cluster) goes to that program, which stops them in order,
        // not to the workers in the middle of a step.
        .process_group(0)
        .kill_on_drop(true);
    let child = process.spawn()?;
    // Our copies of the worker's ends close here, so that its exit ends both streams.
    drop(process);
    let pid = child.id().unwrap_or_default();
    channel.set_nonblocking(true)?;
    output.set_nonblocking(true)?;
    let channel = UnixStream::from_std(channel)?;
    let output = UnixStream::from_std(output)?;
    let lines = Arc::new(LineRing::new(OUTPUT_LINES.max(options.stderr_lines)));
    let span = info_span!("worker", group, pid);
    let output = tokio::spawn(collect_output(output, Arc::clone(&lines)).instrument(span));
    Ok(Spawned {
        child,
        pid,
        channel,
        output,
        lines,
    })
}

/// What the pool asks of a worker's supervisor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Control {
    /// It has no actor left and its input is closing: kill it if it has not exited within
    /// the grace period.
    Retire,
    /// SIGKILL it now.
    Kill,
}

/// How the reading of a worker's frames ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ReadEnd {
    /// The worker closed its end (it exited, normally).
    Closed,
    /// The worker sent something that is not a frame.
    Bad(String),
}

/// Waits for the worker to exit and says how it ended (and the bad frame, if it sent
/// one). Kills it when asked (or when the pool is gone), when its frames go bad, and when
/// it closed its channel or was retired but has not exited `grace` later.
pub(crate) async fn supervise(
    mut child: Child,
    mut reader: JoinHandle<ReadEnd>,
    output: JoinHandle<()>,
    mut control: mpsc::UnboundedReceiver<Control>,
    grace: Duration,
) -> (io::Result<ExitStatus>, Option<String>) {
    let mut read_end = None;
    let mut control_open = true;
    let mut kill_at: Option<Instant> = None;
    let far = || Instant::now() + Duration::from_secs(86_400);
    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            command = control.recv(), if control_open => match command {
                Some(Control::Retire) => {
                    kill_at.get_or_insert_with(|| Instant::now() + grace);
                }
                Some(Control::Kill) => kill(&mut child, "asked to"),
                None => {
                    control_open = false;
                    kill(&mut child, "its pool is gone");
                }
            },
            end = &mut reader, if read_end.is_none() => {
                let end = end.unwrap_or_else(|error| ReadEnd::Bad(error.to_string()));
                match &end {
                    ReadEnd::Bad(_) => kill(&mut child, "bad frame"),
                    ReadEnd::Closed => {
                        kill_at.get_or_insert_with(|| Instant::now() + grace);
                    }
                }
                read_end = Some(end);
            },
            () = tokio::time::sleep_until(kill_at.unwrap_or_else(far)), if kill_at.is_some() => {
                kill_at = None;
                kill(&mut child, "did not exit");
            },
        }
    };
    // What the worker wrote before it exited still counts: replies, and the last lines.
    if read_end.is_none() {
        match tokio::time::timeout(DRAIN, &mut reader).await {
            Ok(end) => read_end = Some(end.unwrap_or_else(|e| ReadEnd::Bad(e.to_string()))),
            Err(_) => reader.abort(),
        }
    }
    let output_abort = output.abort_handle();
    if tokio::time::timeout(DRAIN, output).await.is_err() {
        output_abort.abort();
    }
    let bad = match read_end {
        Some(ReadEnd::Bad(error)) => Some(error),
        _ => None,
    };
    (status, bad)
}

fn kill(child: &mut Child, why: &str) {
    debug!(why, "killing worker process");
    if let Err(error) = child.start_kill() {
        // It exited already: `wait` reports it.
        debug!(%error, "cannot kill worker process");
    }
}

/// Why a worker's actors failed: how it ended and the last lines it wrote.
pub(crate) fn describe_end(
    group: &str,
    pid: u32,
    status: &io::Result<ExitStatus>,
    bad_frame: Option<&str>,
    lines: &[String],
) -> String {
    let mut reason = format!("worker process for group '{group}' (pid {pid}) ");
    if let Some(error) = bad_frame {
        reason.push_str(&format!("sent a bad frame ({error}); "));
    }
    match status {
        Ok(status) => reason.push_str(&describe_status(*status)),
        Err(error) => reason.push_str(&format!("could not be waited for: {error}")),
    }
    if lines.is_empty() {
        reason.push_str("; no stderr output");
    } else {
        reason.push_str("; last stderr:\n");
        reason.push_str(&lines.join("\n"));
    }
    reason
}

/// `exited with code 3`, `killed by signal 9 (SIGKILL)`.
pub(crate) fn describe_status(status: ExitStatus) -> String {
    if let Some(code) = status.code() {
        return format!("exited with code {code}");
    }
    match status.signal() {
        Some(signal) => {
            let core = if status.core_dumped() {
                ", core dumped"
            } else {
                ""
            };
            format!("killed by signal {signal} ({}{core})", signal_name(signal))
        }
        None => format!("ended with status {status}"),
    }
}

/// The name of a Linux signal number.
fn signal_name(signal: i32) -> &'static str {
    match signal {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        4 => "SIGILL",
        5 => "SIGTRAP",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        10 => "SIGUSR1",
        11 => "SIGSEGV",
        12 => "SIGUSR2",
        13 => "SIGPIPE",
        14 => "SIGALRM",
        15 => "SIGTERM",
        24 => "SIGXCPU",
        25 => "SIGXFSZ",
        31 => "SIGSYS",
        _ => "unknown signal",
    }
}

/// The last lines a worker wrote.
#[derive(Debug)]
pub(crate) struct LineRing {
    capacity: usize,
    lines: Mutex<VecDeque<String>>,
}

impl LineRing {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity,
            lines: Mutex::new(VecDeque::with_capacity(capacity)),
        }
    }

    fn push(&self, line: String) {
        let mut lines = self.lines.lock().unwrap_or_else(PoisonError::into_inner);
        if lines.len() == self.capacity {
            lines.pop_front();
        }
        if self.capacity > 0 {
            lines.push_back(line);
        }
    }

    /// The newest `count` lines, oldest first.
    pub(crate) fn last(&self, count: usize) -> Vec<String> {
        let lines = self.lines.lock().unwrap_or_else(PoisonError::into_inner);
        let skip = lines.len().saturating_sub(count);
        lines.iter().skip(skip).cloned().collect()
    }
}

/// How many ended actors' output a pool keeps ([`EndedOutputs`]).
pub(crate) const ENDED_OUTPUTS: usize = 64;

/// The output of the last `capacity` actors that ended (stopped, killed, failed, or their
/// process died), by actor: the [`LineRing`] of the process each ran in, which takes that
/// process's lines until it has exited. Several actors of one process share its ring. The
/// oldest end is forgotten first; an actor that starts again under its id is forgotten
/// at its start.
#[derive(Debug)]
pub(crate) struct EndedOutputs {
    capacity: usize,
    rings: HashMap<ActorId, Arc<LineRing>>,
    order: VecDeque<ActorId>,
}

impl EndedOutputs {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity,
            rings: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    /// `actor` ended; `ring` holds its process's lines.
    pub(crate) fn insert(&mut self, actor: ActorId, ring: Arc<LineRing>) {
        if self.rings.insert(actor, ring).is_some() {
            self.order.retain(|id| *id != actor);
        }
        self.order.push_back(actor);
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.rings.remove(&old);
            }
        }
    }

    /// Forgets `actor` (it starts again under the same id).
    pub(crate) fn remove(&mut self, actor: ActorId) {
        if self.rings.remove(&actor).is_some() {
            self.order.retain(|id| *id != actor);
        }
    }

    /// The newest `count` lines of `actor`'s process, oldest first, if it is kept.
    pub(crate) fn last(&self, actor: ActorId, count: usize) -> Option<Vec<String>> {
        self.rings.get(&actor).map(|ring| ring.last(count))
    }
}

/// Reads the worker's output to its end, line by line.
async fn collect_output(mut output: UnixStream, ring: Arc<LineRing>) {
    let mut splitter = LineSplitter::default();
    let mut buffer = vec![0u8; 8192];
    loop {
        match output.read(&mut buffer).await {
            Ok(0) => break,
            Ok(n) => {
                for line in splitter.push(&buffer[..n]) {
                    debug!(line, "worker output");
                    ring.push(line);
                }
            }
            Err(error) => {
                warn!(%error, "cannot read worker output");
                break;
            }
        }
    }
    if let Some(line) = splitter.finish() {
        debug!(line, "worker output");
        ring.push(line);
    }
}

/// Splits bytes into lines (lossy UTF-8, `\r` trimmed), keeping at most [`MAX_LINE`]
/// bytes of each and marking the cut with `…`.
#[derive(Debug, Default)]
pub(crate) struct LineSplitter {
    partial: Vec<u8>,
    cut: bool,
}

impl LineSplitter {
    pub(crate) fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        let mut lines = Vec::new();
        for piece in bytes.split_inclusive(|b| *b == b'\n') {
            let (body, ended) = match piece.strip_suffix(b"\n") {
                Some(body) => (body, true),
                None => (piece, false),
            };
            let room = MAX_LINE.saturating_sub(self.partial.len());
            if body.len() > room {
                self.cut = true;
            }
            self.partial
                .extend_from_slice(&body[..body.len().min(room)]);
            if ended {
                lines.push(self.take());
            }
        }
        lines
    }

    /// The last line, if the output did not end with a newline.
    pub(crate) fn finish(&mut self) -> Option<String> {
        (!self.partial.is_empty() || self.cut).then(|| self.take())
    }

    fn take(&mut self) -> String {
        let bytes = std::mem::take(&mut self.partial);
        let mut line = String::from_utf8_lossy(&bytes)
            .trim_end_matches('\r')
            .to_string();
        if std::mem::take(&mut self.cut) {
            line.push('…');
        }
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_is_split_into_bounded_lines() {
        let long = "x".repeat(MAX_LINE + 10);
        let cases: [(&[&str], &[&str]); 5] = [
            (&["one\ntwo\n"], &["one", "two"]),
            (&["par", "tial\nrest"], &["partial", "rest"]),
            (&["crlf\r\n", "\n"], &["crlf", ""]),
            (
                &[&long, "\nnext\n"],
                &[&format!("{}…", &long[..MAX_LINE]), "next"],
            ),
            (&["bad \u{fffd}\n"], &["bad \u{fffd}"]),
        ];
        for (chunks, want) in cases {
            let mut splitter = LineSplitter::default();
            let mut got: Vec<String> = chunks
                .iter()
                .flat_map(|c| splitter.push(c.as_bytes()))
                .collect();
            got.extend(splitter.finish());
            assert_eq!(got, want, "{chunks:?}");
        }
    }

    #[test]
    fn the_ring_keeps_the_last_lines() {
        let ring = LineRing::new(3);
        for i in 0..5 {
            ring.push(i.to_string());
        }
        assert_eq!(ring.last(10), ["2", "3", "4"]);
        assert_eq!(ring.last(2), ["3", "4"]);
        assert!(ring.last(0).is_empty());
        let empty = LineRing::new(0);
        empty.push("x".into());
        assert!(empty.last(10).is_empty());
    }

    #[test]
    fn the_last_ended_actors_keep_their_lines() {
        let ring = |line: &str| {
            let ring = Arc::new(LineRing::new(2));
            ring.push(line.to_string());
            ring
        };
        let mut ended = EndedOutputs::new(3);
        for id in 1..=4 {
            ended.insert(ActorId(id), ring(&format!("actor {id}")));
        }
        // (actor, what is kept) after each step below.
        let kept = |ended: &EndedOutputs| -> Vec<(u64, Option<Vec<String>>)> {
            (1..=5)
                .map(|id| (id, ended.last(ActorId(id), 10)))
                .collect()
        };
        let lines = |id: u64| Some(vec![format!("actor {id}")]);
        assert_eq!(
            kept(&ended),
            [
                (1, None),
                (2, lines(2)),
                (3, lines(3)),
                (4, lines(4)),
                (5, None)
            ],
            "the oldest of four forgotten"
        );
        // Ended again: now the newest, so 3 goes first.
        ended.insert(ActorId(2), ring("actor 2"));
        ended.insert(ActorId(5), ring("actor 5"));
        assert_eq!(
            kept(&ended),
            [
                (1, None),
                (2, lines(2)),
                (3, None),
                (4, lines(4)),
                (5, lines(5))
            ]
        );
        ended.remove(ActorId(4));
        assert_eq!(ended.last(ActorId(4), 10), None, "started again");
        assert_eq!(ended.order.len(), ended.rings.len());
        // A shared ring: lines its process writes after the end are kept too.
        let shared = ring("before");
        ended.insert(ActorId(9), Arc::clone(&shared));
        shared.push("after".to_string());
        assert_eq!(
            ended.last(ActorId(9), 10),
            Some(vec!["before".to_string(), "after".to_string()])
        );
        assert_eq!(ended.last(ActorId(9), 1), Some(vec!["after".to_string()]));
        assert!(EndedOutputs::new(0).last(ActorId(1), 1).is_none());
        let mut none = EndedOutputs::new(0);
        none.insert(ActorId(1), ring("x"));
        assert_eq!(
            none.last(ActorId(1), 1),
            None,
            "a capacity of 0 keeps nothing"
        );
    }

    #[test]
    fn ends_are_described_with_the_last_lines() {
        let exited = ExitStatus::from_raw(3 << 8);
        let killed = ExitStatus::from_raw(9);
        let aborted = ExitStatus::from_raw(6 | 0x80);
        let lines = ["loading".to_string(), "oops".to_string()];
        let cases = [
            (
                Ok(exited),
                None,
                &lines[..],
                "worker process for group 'rank0' (pid 42) exited with code 3; \
                 last stderr:\nloading\noops",
            ),
            (
                Ok(killed),
                None,
                &[],
                "worker process for group 'rank0' (pid 42) killed by signal 9 (SIGKILL); \
                 no stderr output",
            ),
            (
                Ok(aborted),
                None,
                &[],
                "worker process for group 'rank0' (pid 42) killed by signal 6 (SIGABRT, core \
                 dumped); no stderr output",
            ),
            (
                Ok(killed),
                Some("wire version 7, expected 2"),
                &[],
                "worker process for group 'rank0' (pid 42) sent a bad frame (wire version 7, \
                 expected 2); killed by signal 9 (SIGKILL); no stderr output",
            ),
        ];
        for (status, bad, lines, want) in cases {
            assert_eq!(describe_end("rank0", 42, &status, bad, lines), want);
        }
    }
}
