//! `pipe:COMMAND` sources: the shard is the standard output of a shell command.
//!
//! The command runs in a process group of its own. Its exit status is checked when its
//! output ends: 0 and 141 (SIGPIPE, which `head` and early-closing readers cause) are
//! fine; anything else fails the shard with the command and the tail of its standard
//! error. A command that sends no output for the idle timeout, or closes its output and
//! does not exit within it, fails the shard the same way. Whichever way the stream ends
//! (end, failure, timeout, or the reader dropping it), nothing of the command's process
//! group is left running: a background child that keeps the pipe open cannot hang the
//! reader or outlive it.

use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::{ShardError, escaped};
use crate::stream::{ShardSource, ShardStream, SourceKind, SourceOptions};

/// How much of a failing command's standard error is kept.
const STDERR_TAIL: usize = 2048;

/// How long a finished command's standard error may take to reach its end (a process
/// outside the group may hold it open; the tail read so far is reported then).
const STDERR_GRACE: Duration = Duration::from_secs(2);

#[derive(Debug)]
pub(crate) struct PipeSource {
    idle_timeout: Option<Duration>,
}

impl PipeSource {
    pub(crate) fn new(options: &SourceOptions) -> Self {
        Self {
            idle_timeout: options.pipe_idle_timeout,
        }
    }
}

impl ShardSource for PipeSource {
    fn kind(&self) -> SourceKind {
        SourceKind::Pipe
    }

    fn handles(&self, url: &str) -> bool {
        url.starts_with("pipe:")
    }

    fn open(&self, url: &str) -> Result<ShardStream, ShardError> {
        let command = url.trim_start_matches("pipe:").to_string();
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(&command)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own group (id = the shell's pid), so every process the command starts
            // can be ended together.
            .process_group(0)
            .spawn()
            .map_err(|error| ShardError::Open {
                url: url.to_string(),
                error,
            })?;
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let tail = Arc::new(Mutex::new(Vec::new()));
        let (done_tx, done) = std::sync::mpsc::channel::<()>();
        if let Some(mut stderr) = stderr {
            let tail = tail.clone();
            std::thread::spawn(move || {
                let mut chunk = [0u8; 4096];
                while let Ok(n) = stderr.read(&mut chunk) {
                    if n == 0 {
                        break;
                    }
                    let mut kept = tail.lock().unwrap_or_else(|p| p.into_inner());
                    kept.extend_from_slice(&chunk[..n]);
                    let excess = kept.len().saturating_sub(STDERR_TAIL);
                    kept.drain(..excess);
                }
                // The receiver may be gone already; then nobody waits for this.
                let _ = done_tx.send(());
            });
        }
        Ok(Box::new(PipeStream {
            url: url.to_string(),
            command,
            child,
            stdout,
            stderr_tail: tail,
            stderr_done: done,
            idle_timeout: self.idle_timeout,
            finished: false,
        }))
    }
}

/// The standard output of a running command; checks the exit status at the end.
struct PipeStream {
    url: String,
    command: String,
    child: Child,
    stdout: Option<ChildStdout>,
    stderr_tail: Arc<Mutex<Vec<u8>>>,
    /// Signalled (or disconnected) when the standard error reaches its end.
    stderr_done: Receiver<()>,
    idle_timeout: Option<Duration>,
    /// The command has been reaped and its group ended; reads return the end.
    finished: bool,
}

impl Read for PipeStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.finished {
            return Ok(0);
        }
        let Some(out) = self.stdout.as_mut() else {
            return Ok(0);
        };
        if let Some(limit) = self.idle_timeout
            && !readable_within(out, limit)?
        {
            let status = format!("no output for {limit:?} (the pipe idle timeout)");
            return Err(self.fail(status));
        }
        let n = out.read(buf)?;
        if n == 0 && !buf.is_empty() {
            self.stdout = None;
            return self.finish().map(|()| 0);
        }
        Ok(n)
    }
}

impl PipeStream {
    /// The output ended: waits (within the idle timeout) for the shell to exit, ends
    /// what is left of its group, and checks the status.
    fn finish(&mut self) -> io::Result<()> {
        if !self.exited_within(self.idle_timeout)? {
            let limit = self.idle_timeout.unwrap_or_default();
            let status = format!(
                "its output closed but it did not exit within {limit:?} (the pipe idle timeout)"
            );
            return Err(self.fail(status));
        }
        // The shell is a zombie, so its pid (the group's id) cannot be reused yet.
        kill_group(&self.child);
        self.finished = true;
        let status = self.child.wait()?;
        let _ = self.stderr_done.recv_timeout(STDERR_GRACE);
        if status_is_success(status) {
            return Ok(());
        }
        Err(self.failure(describe(status)))
    }

    /// Ends the command's whole group and returns the failure to report.
    fn fail(&mut self, status: String) -> io::Error {
        kill_group(&self.child);
        self.finished = true;
        self.stdout = None;
        let _ = self.child.wait();
        // Members are dead, so the standard error ends unless a process that left the
        // group holds it: do not wait long for that.
        if let Err(RecvTimeoutError::Timeout) = self.stderr_done.recv_timeout(STDERR_GRACE) {
            tracing::debug!(url = %self.url, "pipe command's standard error still open");
        }
        self.failure(status)
    }

    fn failure(&self, status: String) -> io::Error {
        let tail = self.stderr_tail.lock().unwrap_or_else(|p| p.into_inner());
        io::Error::other(PipeFailure {
            url: self.url.clone(),
            command: self.command.clone(),
            status,
            stderr_tail: escaped(tail.trim_ascii()),
        })
    }

    /// Whether the shell exited within `limit` (forever without one), leaving it
    /// unreaped.
    fn exited_within(&self, limit: Option<Duration>) -> io::Result<bool> {
        let deadline = limit.map(|limit| Instant::now() + limit);
        let mut pause = Duration::from_millis(1);
        loop {
            if has_exited(&self.child)? {
                return Ok(true);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(false);
            }
            // Nearly always the shell has exited by the time its output ends; polling
            // covers the rest without a thread per command.
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }
}

impl Drop for PipeStream {
    fn drop(&mut self) {
        if !self.finished {
            // The reader stopped early: the command's output is no longer wanted.
            kill_group(&self.child);
            let _ = self.child.wait();
        }
    }
}

/// Waits until `out` has bytes (or its end) to read, for at most `limit`.
#[allow(unsafe_code)] // poll(2): std has no read with a timeout on a pipe
fn readable_within(out: &ChildStdout, limit: Duration) -> io::Result<bool> {
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let millis = i32::try_from(left.as_micros().div_ceil(1000)).unwrap_or(i32::MAX);
        let mut fd = libc::pollfd {
            fd: out.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `fd` is one valid pollfd that lives across the call.
        let ready = unsafe { libc::poll(&mut fd, 1, millis) };
        match ready {
            n if n > 0 => return Ok(true),
            0 if Instant::now() >= deadline => return Ok(false),
            0 => continue,
            _ => {
                let error = io::Error::last_os_error();
                if error.kind() != io::ErrorKind::Interrupted {
                    return Err(error);
                }
            }
        }
    }
}

/// Whether `child` has exited, without reaping it (so its pid stays reserved).
#[allow(unsafe_code)] // waitid(2) with WNOWAIT: std's `try_wait` reaps
fn has_exited(child: &Child) -> io::Result<bool> {
    // SAFETY: a zeroed siginfo_t is a valid out-parameter; `si_pid` stays 0 when no
    // child changed state (WNOHANG).
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    let options = libc::WEXITED | libc::WNOHANG | libc::WNOWAIT;
    // SAFETY: `info` is valid for writes; `child.id()` is our unreaped child.
    let rc = unsafe { libc::waitid(libc::P_PID, child.id(), &mut info, options) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: waitid filled `info` (or left it zeroed) for a WEXITED wait.
    Ok(unsafe { info.si_pid() } != 0)
}

/// SIGKILL to every process in the command's group. Only called while the shell (the
/// group leader) is unreaped, so the group id still names this group.
#[allow(unsafe_code)] // killpg(2): std signals single processes only
fn kill_group(child: &Child) {
    if let Ok(group) = libc::pid_t::try_from(child.id()) {
        // SAFETY: killpg has no memory effects; ESRCH (group already empty) is fine.
        unsafe {
            libc::killpg(group, libc::SIGKILL);
        }
    }
}

fn status_is_success(status: ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt;
    status.success() || status.code() == Some(141) || status.signal() == Some(13)
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(signal)) => format!("signal {signal}"),
        _ => status.to_string(),
    }
}

/// A failed command, carried through `io::Error` to the tar reader.
#[derive(Debug, Clone, thiserror::Error)]
#[error("command `{command}` failed with {status}")]
pub(crate) struct PipeFailure {
    url: String,
    command: String,
    status: String,
    /// Escaped for display.
    stderr_tail: String,
}

impl PipeFailure {
    pub(crate) fn to_shard_error(&self) -> ShardError {
        ShardError::Pipe {
            url: self.url.clone(),
            command: self.command.clone(),
            status: self.status.clone(),
            stderr_tail: self.stderr_tail.clone(),
        }
    }
}
