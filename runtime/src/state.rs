//! The per-user state folder: where a head keeps its CA, credentials and join token,
//! where a joined node keeps its certificate, and where every daemon started on this
//! machine is recorded, so that later commands (`imgrun status`, `imgrun stop`, a second
//! `imgrun start`) find them.
//!
//! The folder is `$IMGRUN_STATE_DIR`, else `$XDG_STATE_HOME/imgrun`, else
//! `~/.local/state/imgrun`. It is created with mode 0700 and every file in it is written
//! with mode 0600, atomically (a temporary file renamed into place), so a reader never
//! sees half a credential.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::private::{create_private_dir, write_private};

/// The state folder of this user on this machine.
#[derive(Debug, Clone)]
pub struct StateDir {
    root: PathBuf,
}

/// Why the state folder could not be used.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("no state folder: set IMGRUN_STATE_DIR or HOME")]
    NoHome,
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path}: unreadable record: {source}")]
    BadRecord {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}

/// The head's record in the state folder, present while it runs.
pub(crate) const HEAD_RECORD: &str = "head/head.json";
/// The folder of the certificate for commands on the head's machine.
pub(crate) const CLIENT_DIR: &str = "client";
/// Where a node keeps its credentials (`ca.pem`, `node.pem`, `node-key.pem`).
pub(crate) const NODE_DIR: &str = "node";
/// Where a node records the head it joined.
pub(crate) const NODE_RECORD: &str = "node/node.json";

/// What a running head leaves for later commands on its machine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeadRecord {
    /// Address other machines join, `ip:port`.
    pub address: String,
    /// `sha256:<hex>` of the cluster CA certificate.
    pub ca_hash: String,
    pub pid: u32,
    /// Seconds since the Unix epoch.
    pub started: u64,
}

/// What a node leaves in the state folder for later commands (`imgrun status`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct NodeRecord {
    /// The head's address, as given to `imgrun join`.
    pub(crate) head: String,
    pub(crate) node_id: u64,
    /// The node's own advertised address.
    pub(crate) address: String,
    pub(crate) ca_hash: String,
}

/// Which kind of daemon a [`DaemonRecord`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DaemonRole {
    Head,
    Node,
}

/// A daemon started on this machine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaemonRecord {
    pub role: DaemonRole,
    pub pid: u32,
    /// The head it belongs to, `ip:port`.
    pub head: String,
    pub log: PathBuf,
}

impl StateDir {
    /// The folder named by the environment (see the module docs).
    pub fn locate() -> Result<Self, StateError> {
        let var = |name| std::env::var_os(name).filter(|v| !v.is_empty());
        let root = if let Some(dir) = var("IMGRUN_STATE_DIR") {
            PathBuf::from(dir)
        } else if let Some(dir) = var("XDG_STATE_HOME") {
            PathBuf::from(dir).join("imgrun")
        } else if let Some(home) = var("HOME") {
            PathBuf::from(home).join(".local/state/imgrun")
        } else {
            return Err(StateError::NoHome);
        };
        Ok(Self { root })
    }

    pub fn at(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn path(&self, relative: &str) -> PathBuf {
        self.root.join(relative)
    }

    /// Creates `relative` (and the folder itself) with mode 0700 when missing.
    pub fn ensure_dir(&self, relative: &str) -> Result<PathBuf, StateError> {
        let path = self.path(relative);
        create_private_dir(&path).map_err(|source| io_error(&path, source))?;
        Ok(path)
    }

    /// Writes a file with mode 0600, atomically ([`write_private`]).
    pub fn write_private(&self, relative: &str, bytes: &[u8]) -> Result<PathBuf, StateError> {
        let path = self.path(relative);
        if let Some(parent) = path.parent() {
            create_private_dir(parent).map_err(|source| io_error(parent, source))?;
        }
        write_private(&path, bytes).map_err(|source| io_error(&path, source))?;
        Ok(path)
    }

    /// A file's bytes, or `None` when it does not exist.
    pub fn read(&self, relative: &str) -> Result<Option<Vec<u8>>, StateError> {
        let path = self.path(relative);
        match fs::read(&path) {
            Ok(bytes) => Ok(Some(bytes)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(io_error(&path, source)),
        }
    }

    pub fn remove(&self, relative: &str) -> Result<(), StateError> {
        let path = self.path(relative);
        match fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_error(&path, e)),
            _ => Ok(()),
        }
    }

    /// A JSON record, or `None` when it does not exist.
    pub fn read_record<T: for<'de> Deserialize<'de>>(
        &self,
        relative: &str,
    ) -> Result<Option<T>, StateError> {
        let Some(bytes) = self.read(relative)? else {
            return Ok(None);
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|source| StateError::BadRecord {
                path: self.path(relative),
                source,
            })
    }

    pub fn write_record<T: Serialize>(&self, relative: &str, record: &T) -> Result<(), StateError> {
        // Serialising plain records of strings and numbers cannot fail.
        let bytes = serde_json::to_vec_pretty(record).unwrap_or_default();
        self.write_private(relative, &bytes).map(drop)
    }

    /// Records a daemon started on this machine.
    pub fn add_daemon(&self, record: &DaemonRecord) -> Result<(), StateError> {
        self.write_record(&format!("daemons/{}.json", record.pid), record)
    }

    pub fn remove_daemon(&self, pid: u32) -> Result<(), StateError> {
        self.remove(&format!("daemons/{pid}.json"))
    }

    /// The daemons recorded on this machine (unreadable records are skipped).
    pub fn daemons(&self) -> Result<Vec<DaemonRecord>, StateError> {
        let dir = self.path("daemons");
        let entries = match fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => return Err(io_error(&dir, source)),
        };
        let mut records: Vec<DaemonRecord> = entries
            .filter_map(Result::ok)
            .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
            .filter_map(|e| {
                let name = format!("daemons/{}", e.file_name().to_string_lossy());
                self.read_record(&name).ok().flatten()
            })
            .collect();
        records.sort_by_key(|r| r.pid);
        Ok(records)
    }
}

fn io_error(path: &Path, source: io::Error) -> StateError {
    StateError::Io {
        path: path.to_path_buf(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn mode(path: &Path) -> u32 {
        fs::metadata(path)
            .map(|m| m.permissions().mode() & 0o777)
            .unwrap_or(0)
    }

    #[test]
    fn files_are_private_and_replaced_atomically() {
        let dir = tempfile::tempdir().expect("temp dir");
        let state = StateDir::at(dir.path().join("state"));
        let path = state.write_private("head/token", b"one").expect("write");
        assert_eq!(mode(&path), 0o600);
        assert_eq!(mode(&state.path("head")), 0o700);
        state.write_private("head/token", b"two").expect("rewrite");
        assert_eq!(
            state.read("head/token").expect("read"),
            Some(b"two".to_vec())
        );
        assert_eq!(state.read("head/missing").expect("read"), None);
        let leftovers: Vec<_> = fs::read_dir(state.path("head"))
            .expect("list")
            .filter_map(Result::ok)
            .map(|e| e.file_name())
            .collect();
        assert_eq!(leftovers.len(), 1, "no temporary files left: {leftovers:?}");
    }

    #[test]
    fn daemon_records_round_trip() {
        let dir = tempfile::tempdir().expect("temp dir");
        let state = StateDir::at(dir.path());
        let record = |pid, role| DaemonRecord {
            role,
            pid,
            head: "127.0.0.1:7070".into(),
            log: dir.path().join("x.log"),
        };
        state
            .add_daemon(&record(42, DaemonRole::Node))
            .expect("add");
        state.add_daemon(&record(7, DaemonRole::Head)).expect("add");
        state
            .write_private("daemons/garbage.json", b"{not json")
            .expect("write");
        let found = state.daemons().expect("list");
        assert_eq!(
            found,
            [record(7, DaemonRole::Head), record(42, DaemonRole::Node)]
        );
        state.remove_daemon(42).expect("remove");
        state.remove_daemon(42).expect("removing twice is fine");
        assert_eq!(state.daemons().expect("list").len(), 1);
    }

    #[test]
    fn a_bad_record_names_its_file() {
        let dir = tempfile::tempdir().expect("temp dir");
        let state = StateDir::at(dir.path());
        state
            .write_private("head/head.json", b"[1,")
            .expect("write");
        let error = state
            .read_record::<HeadRecord>("head/head.json")
            .expect_err("bad json");
        assert!(error.to_string().contains("head.json"), "{error}");
    }
}
