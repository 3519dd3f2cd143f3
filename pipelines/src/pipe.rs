//! `pipe:COMMAND` sources: the shard is the standard output of a shell command.
//!
//! The command's exit status is checked when its output ends: 0 and 141 (SIGPIPE, which
//! `head` and early-closing readers cause) are fine; anything else fails the shard with
//! the command and the tail of its standard error.

use std::io::{self, Read};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::error::ShardError;
use crate::source::{ShardSource, ShardStream};

/// How much of a failing command's standard error is kept.
const STDERR_TAIL: usize = 2048;

#[derive(Debug)]
pub(crate) struct PipeSource;

impl ShardSource for PipeSource {
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
            .spawn()
            .map_err(|source| ShardError::Open {
                url: url.to_string(),
                source,
            })?;
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let tail = Arc::new(Mutex::new(Vec::new()));
        let collector = stderr.map(|mut stderr| {
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
            })
        });
        Ok(Box::new(PipeStream {
            url: url.to_string(),
            command,
            child,
            stdout,
            stderr_tail: tail,
            collector,
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
    collector: Option<JoinHandle<()>>,
    finished: bool,
}

impl Read for PipeStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.finished {
            return Ok(0);
        }
        let n = match self.stdout.as_mut() {
            Some(out) => out.read(buf)?,
            None => 0,
        };
        if n == 0 && !buf.is_empty() {
            self.finished = true;
            self.stdout = None;
            let status = self.child.wait()?;
            if let Some(collector) = self.collector.take() {
                let _ = collector.join();
            }
            if !status_is_success(status) {
                let tail = self.stderr_tail.lock().unwrap_or_else(|p| p.into_inner());
                return Err(io::Error::other(PipeFailure {
                    url: self.url.clone(),
                    command: self.command.clone(),
                    status: describe(status),
                    stderr_tail: String::from_utf8_lossy(&tail).into_owned(),
                }));
            }
        }
        Ok(n)
    }
}

impl Drop for PipeStream {
    fn drop(&mut self) {
        if !self.finished {
            // The reader stopped early: the command's output is no longer wanted.
            let _ = self.child.kill();
            let _ = self.child.wait();
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
