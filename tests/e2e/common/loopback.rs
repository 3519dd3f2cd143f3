//! A server process the tests start on a free port of `127.0.0.1` (moto, Azurite): in a
//! process group of its own, its output in a log of its own, waited for until it answers
//! HTTP, and killed with its group when dropped.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rustix::process::{Signal, kill_process_group};

use super::pid_of;

/// How long a server may take to answer its first request (moto's Python imports it all
/// first).
const START_LIMIT: Duration = Duration::from_secs(30);

pub struct LoopbackServer {
    child: Child,
    address: SocketAddr,
    /// Its log, and whatever its owner keeps beside it.
    dir: tempfile::TempDir,
    name: &'static str,
}

impl LoopbackServer {
    /// Starts `command(port, folder)` (the server `name`, told to listen on `port` and
    /// to keep its files in `folder`) and waits until it answers HTTP. A port found free
    /// may be taken before the server binds it: then it exits, and another port is tried.
    pub fn start(name: &'static str, command: impl Fn(u16, &Path) -> Command) -> LoopbackServer {
        let mut last_log = String::new();
        for _ in 0..3 {
            let dir = tempfile::tempdir().expect("a temporary folder for the server");
            let log = File::create(dir.path().join("server.log")).expect("create its log");
            let port = free_port();
            let child = command(port, dir.path())
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("clone its log"))
                .stderr(log)
                .process_group(0)
                .spawn()
                .unwrap_or_else(|e| panic!("start {name}: {e}"));
            let mut server = LoopbackServer {
                child,
                address: SocketAddr::from(([127, 0, 0, 1], port)),
                dir,
                name,
            };
            if server.wait_until_answering() {
                return server;
            }
            last_log = server.log();
        }
        panic!("{name} exited three times before answering; its last log:\n{last_log}");
    }

    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.address)
    }

    /// A folder of the server's owner, removed with it.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn wait_until_answering(&mut self) -> bool {
        let deadline = Instant::now() + START_LIMIT;
        loop {
            if answers_http(self.address) {
                return true;
            }
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            assert!(
                Instant::now() < deadline,
                "{} did not answer on {} within {START_LIMIT:?}; its log:\n{}",
                self.name,
                self.address,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }
}

impl Drop for LoopbackServer {
    fn drop(&mut self) {
        // The group is the one `process_group(0)` made, whose id is the server's pid.
        if let Some(group) = pid_of(self.child.id()) {
            let _ = kill_process_group(group, Signal::KILL);
        }
        let _ = self.child.wait();
    }
}

/// A port of `127.0.0.1` that was free a moment ago.
pub fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().expect("the bound address").port()
}

/// Whether something on `address` answers a request with an HTTP status line.
pub fn answers_http(address: SocketAddr) -> bool {
    let Ok(mut stream) = TcpStream::connect_timeout(&address, Duration::from_secs(1)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let request = format!("GET / HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    let mut start = [0u8; 5];
    stream.write_all(request.as_bytes()).is_ok()
        && stream.read_exact(&mut start).is_ok()
        && &start == b"HTTP/"
}
