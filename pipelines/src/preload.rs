//! Copies of shards on node-local disk, made before training (`data.preload`): shards on
//! a network drive, behind HTTP or a `pipe:` command are copied once into a local folder,
//! and every later open of such a shard reads the local copy.
//!
//! A copy is written to a partial file unique to the process, synced, checked against
//! the length its source declares (a local file's size, an HTTP `Content-Length`), and
//! renamed into place; beside it, `NAME.source` holds the URL it came from, so a copy
//! of another shard with the same file name is never read for this one. A copy that is
//! present, from the same URL and (when its source declares one) of the same length is
//! kept. Before copying, the free space of the folder must hold the shards whose sizes
//! are known.

use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::ShardError;
use crate::inspect::human_bytes;
use crate::shard_name::shard_name;
use crate::source::{Sources, local_path, preloaded_copy, preloaded_path, source_record};

/// Why preloading stopped.
#[derive(Debug, thiserror::Error)]
pub enum PreloadError {
    #[error("data.preload_dir {}: {error}", dir.display())]
    Dir { dir: PathBuf, error: io::Error },
    #[error(
        "preloading needs {} for {count} shard(s) in {} and it has {} free: free space, \
         or set data.preload_dir to a larger disk",
        human_bytes(*needed), dir.display(), human_bytes(*available)
    )]
    NoRoom {
        dir: PathBuf,
        count: usize,
        needed: u64,
        available: u64,
    },
    #[error("two shards would be preloaded to the same file {}: {first} and {second}", path.display())]
    SameName {
        path: PathBuf,
        first: String,
        second: String,
    },
    #[error("{url}: preloading it into {}: {error}", path.display())]
    Write {
        url: String,
        path: PathBuf,
        error: io::Error,
    },
    #[error("{url}: its copy holds {got} bytes and its source declared {expected}")]
    Length {
        url: String,
        got: u64,
        expected: u64,
    },
    #[error("{0}")]
    Read(#[from] ShardError),
}

/// What one round of [`Preloader::run`] did, and what is left.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PreloadProgress {
    /// Shards whose copy is in place (copied now, or found there).
    pub done: usize,
    pub total: usize,
    /// Shards that were already there when asked.
    pub present: usize,
    /// Bytes copied so far.
    pub bytes: u64,
}

impl PreloadProgress {
    pub fn finished(&self) -> bool {
        self.done == self.total
    }
}

/// Copies a list of shards into a folder, a few at a time, so that whoever drives it can
/// report progress between rounds.
#[derive(Debug)]
pub struct Preloader {
    dir: PathBuf,
    /// Shards left to check or copy, in order.
    left: Vec<String>,
    progress: PreloadProgress,
}

impl Preloader {
    /// Checks the folder and the names, finds the copies already in place, and checks
    /// that the folder has room for the rest whose sizes are known.
    pub fn new(dir: &Path, urls: &[String], sources: &Sources) -> Result<Self, PreloadError> {
        let dir_error = |error| PreloadError::Dir {
            dir: dir.to_path_buf(),
            error,
        };
        fs::create_dir_all(dir).map_err(dir_error)?;
        let mut seen: std::collections::HashMap<PathBuf, &str> = Default::default();
        let mut left = Vec::new();
        let mut present = 0;
        let mut needed = 0u64;
        for url in urls {
            let path = preloaded_path(dir, url);
            match seen.insert(path.clone(), url) {
                // The same URL twice: copied once.
                Some(first) if first == url => continue,
                Some(first) => {
                    return Err(PreloadError::SameName {
                        path,
                        first: first.to_string(),
                        second: url.clone(),
                    });
                }
                None => {}
            }
            let declared = declared_length(url, sources);
            let in_place = preloaded_copy(dir, url).is_some_and(|copy| {
                declared.is_none_or(|n| fs::metadata(copy).is_ok_and(|m| m.len() == n))
            });
            if in_place {
                present += 1;
            } else {
                needed += declared.unwrap_or(0);
                left.push(url.clone());
            }
        }
        let available = free_space(dir).map_err(dir_error)?;
        if needed > available {
            return Err(PreloadError::NoRoom {
                dir: dir.to_path_buf(),
                count: left.len(),
                needed,
                available,
            });
        }
        Ok(Preloader {
            dir: dir.to_path_buf(),
            progress: PreloadProgress {
                done: present,
                total: present + left.len(),
                present,
                bytes: 0,
            },
            left,
        })
    }

    /// Copies shards, `jobs` at a time, until none is left or `budget` has passed (the
    /// shards begun are finished); returns the progress so far.
    pub fn run(
        &mut self,
        sources: &Sources,
        jobs: usize,
        budget: Duration,
    ) -> Result<PreloadProgress, PreloadError> {
        let started = Instant::now();
        while !self.left.is_empty() && started.elapsed() < budget {
            let take = jobs.max(1).min(self.left.len());
            let round: Vec<String> = self.left.drain(..take).collect();
            let copied: Vec<Result<u64, PreloadError>> = std::thread::scope(|scope| {
                let handles: Vec<_> = round
                    .iter()
                    .map(|url| scope.spawn(|| copy_one(&self.dir, url, sources)))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| match h.join() {
                        Ok(result) => result,
                        Err(panic) => std::panic::resume_unwind(panic),
                    })
                    .collect()
            });
            for result in copied {
                self.progress.bytes += result?;
                self.progress.done += 1;
            }
        }
        Ok(self.progress)
    }
}

/// The length `url`'s source declares up front: a local file's size. HTTP and `pipe:`
/// declare theirs only when opened (checked then).
fn declared_length(url: &str, _sources: &Sources) -> Option<u64> {
    local_path(url)
        .and_then(|path| fs::metadata(path).ok())
        .map(|m| m.len())
}

/// Copies `url` into `dir` through a partial file; returns the bytes copied.
fn copy_one(dir: &Path, url: &str, sources: &Sources) -> Result<u64, PreloadError> {
    let copy = preloaded_path(dir, url);
    let partial = dir.join(format!(
        ".{}.partial-{}",
        shard_name(url),
        std::process::id()
    ));
    let write_error = |error| PreloadError::Write {
        url: url.to_string(),
        path: copy.clone(),
        error,
    };
    let (mut stream, declared) = sources.open_stored(url)?;
    let declared = declared.or_else(|| declared_length(url, sources));
    let outcome = (|| {
        let mut file = fs::File::create(&partial).map_err(write_error)?;
        let mut buffer = vec![0u8; 1 << 20];
        let mut total = 0u64;
        loop {
            let n = match stream.read(&mut buffer) {
                Ok(0) => break,
                Ok(n) => n,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(error) => {
                    return Err(PreloadError::Read(ShardError::Read {
                        url: url.to_string(),
                        offset: total,
                        error,
                    }));
                }
            };
            file.write_all(&buffer[..n]).map_err(write_error)?;
            total += n as u64;
        }
        if let Some(expected) = declared
            && expected != total
        {
            return Err(PreloadError::Length {
                url: url.to_string(),
                got: total,
                expected,
            });
        }
        file.sync_all().map_err(write_error)?;
        fs::write(source_record(&copy), url).map_err(write_error)?;
        fs::rename(&partial, &copy).map_err(write_error)?;
        Ok(total)
    })();
    if outcome.is_err() {
        let _ = fs::remove_file(&partial);
    }
    outcome
}

/// Bytes free for this user in the file system holding `dir`.
fn free_space(dir: &Path) -> io::Result<u64> {
    let stat = rustix::fs::statvfs(dir)?;
    Ok(stat.f_bavail.saturating_mul(stat.f_frsize))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::SourceOptions;

    fn shard(dir: &Path, name: &str, bytes: &[u8]) -> String {
        let path = dir.join(name);
        fs::write(&path, bytes).expect("write");
        path.display().to_string()
    }

    #[test]
    fn copies_once_keeps_what_is_in_place_and_reads_only_its_own_copies() {
        let drive = tempfile::tempdir().expect("tmp");
        let local = tempfile::tempdir().expect("tmp");
        let sources = Sources::new(SourceOptions::default());
        let a = shard(drive.path(), "a.tar", &[1u8; 3000]);
        let b = shard(drive.path(), "b.tar", &[2u8; 5000]);
        // Another URL of a shard named `a.tar`.
        let piped = format!("pipe:cat {a}");
        let urls = vec![a.clone(), b.clone()];
        let mut preloader = Preloader::new(local.path(), &urls, &sources).expect("new");
        let progress = preloader
            .run(&sources, 1, Duration::from_secs(60))
            .expect("run");
        assert_eq!(
            progress,
            PreloadProgress {
                done: 2,
                total: 2,
                present: 0,
                bytes: 8000
            }
        );
        let copy = preloaded_copy(local.path(), &a).expect("a's copy");
        assert_eq!(fs::read(copy).expect("read"), vec![1u8; 3000]);
        // The same name from another URL is not this shard's copy.
        assert!(preloaded_copy(local.path(), &piped).is_none());
        // Again: both in place, nothing copied.
        let mut again = Preloader::new(local.path(), &urls, &sources).expect("new");
        let progress = again
            .run(&sources, 2, Duration::from_secs(60))
            .expect("run");
        assert_eq!((progress.present, progress.bytes), (2, 0));
        // A source that changed length is copied again.
        shard(drive.path(), "a.tar", &[3u8; 100]);
        let mut changed = Preloader::new(local.path(), &urls, &sources).expect("new");
        let progress = changed
            .run(&sources, 2, Duration::from_secs(60))
            .expect("run");
        assert_eq!((progress.present, progress.bytes), (1, 100));
        // Two shards with one file name cannot share the folder.
        let error = Preloader::new(local.path(), &[a.clone(), piped.clone()], &sources)
            .expect_err("same name");
        assert!(error.to_string().contains("the same file"), "{error}");
        // No partial file is left behind.
        let names: Vec<String> = fs::read_dir(local.path())
            .expect("dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.contains("partial")), "{names:?}");
    }

    #[test]
    fn a_failing_source_leaves_nothing_and_is_named() {
        let local = tempfile::tempdir().expect("tmp");
        let sources = Sources::new(SourceOptions::default());
        let url = "pipe:sh -c 'printf abc; exit 3' x.tar".to_string();
        let mut preloader =
            Preloader::new(local.path(), std::slice::from_ref(&url), &sources).expect("new");
        let error = preloader
            .run(&sources, 1, Duration::from_secs(60))
            .expect_err("fails");
        assert!(error.to_string().contains("x.tar"), "{error}");
        assert!(preloaded_copy(local.path(), &url).is_none());
        assert_eq!(fs::read_dir(local.path()).expect("dir").count(), 0);
    }

    #[test]
    fn room_is_checked_before_copying() {
        let drive = tempfile::tempdir().expect("tmp");
        let sources = Sources::new(SourceOptions::default());
        let big = drive.path().join("big.tar");
        let file = fs::File::create(&big).expect("create");
        let local = tempfile::tempdir().expect("tmp");
        // A sparse file 1 GB larger than the free space.
        let free = free_space(local.path()).expect("statvfs");
        file.set_len(free + (1 << 30)).expect("set_len");
        let error = Preloader::new(local.path(), &[big.display().to_string()], &sources)
            .expect_err("no room");
        let text = error.to_string();
        assert!(text.contains("free") && text.contains("1 shard"), "{text}");
    }
}
