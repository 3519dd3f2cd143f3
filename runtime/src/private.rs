//! Files only their owner may read (mode 0600): credentials, join tokens, the rendezvous
//! record a launcher leaves for its other processes, daemon logs. Every such file in
//! imgrun is written here, so the permission and the atomic rename are done one way.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Creates `dir` and any missing parent with mode 0700 (folders that exist keep theirs).
pub fn create_private_dir(dir: &Path) -> io::Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// Writes `path` with mode 0600, atomically: a reader sees the old file or the whole new
/// one, never part of it. The bytes go to a partial file beside `path`, made fresh with
/// mode 0600 (a stale one from a crashed writer is removed first, so no older permission
/// carries over), synced, then renamed over `path`. The folder must exist.
pub fn write_private(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let partial = partial_path(path);
    match fs::remove_file(&partial) {
        Err(error) if error.kind() != io::ErrorKind::NotFound => return Err(error),
        _ => {}
    }
    let written = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&partial)
        .and_then(|mut file| {
            file.write_all(bytes)?;
            file.sync_all()
        })
        .and_then(|()| fs::rename(&partial, path));
    if written.is_err() {
        let _ = fs::remove_file(&partial);
    }
    written
}

/// Opens `path` for writing from its start with mode 0600, whether it is new or was
/// there before with another mode (a log file, written as it goes).
pub fn create_private(path: &Path) -> io::Result<File> {
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    // `mode` applies only to a file that `open` creates.
    file.set_permissions(fs::Permissions::from_mode(0o600))?;
    Ok(file)
}

/// `.NAME.PID.partial` beside `path`: hidden, and one per writing process.
fn partial_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    path.with_file_name(format!(".{name}.{}.partial", std::process::id()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).expect("metadata").permissions().mode() & 0o777
    }

    #[test]
    fn a_private_file_is_0600_whatever_was_there_before() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("token");
        fs::write(&path, b"old").expect("an open file");
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).expect("chmod");
        // A stale partial file with a wide mode, as a crashed writer leaves it.
        let partial = partial_path(&path);
        fs::write(&partial, b"half").expect("stale partial");
        fs::set_permissions(&partial, fs::Permissions::from_mode(0o666)).expect("chmod");

        write_private(&path, b"new").expect("write");
        assert_eq!(fs::read(&path).expect("read"), b"new");
        assert_eq!(mode(&path), 0o600);
        assert!(!partial.exists(), "the partial file is renamed into place");
    }

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_partial() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("missing-folder").join("token");
        let error = write_private(&path, b"new").expect_err("no folder");
        assert_eq!(error.kind(), io::ErrorKind::NotFound);
        assert!(!partial_path(&path).exists());
    }

    #[test]
    fn a_private_log_is_0600_and_starts_empty() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("head.log");
        fs::write(&path, b"an older run").expect("write");
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).expect("chmod");
        let mut file = create_private(&path).expect("create");
        file.write_all(b"started").expect("write");
        assert_eq!(fs::read(&path).expect("read"), b"started");
        assert_eq!(mode(&path), 0o600);
    }

    #[test]
    fn a_private_folder_is_0700() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("a").join("b");
        create_private_dir(&path).expect("create");
        assert_eq!(mode(&path), 0o700);
        assert_eq!(mode(&dir.path().join("a")), 0o700);
    }
}
