//! The error of reading or writing one of a job's files (a checkpoint, a weights file):
//! the file, and what went wrong with it.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum FileError {
    // The I/O error is part of the message and not a `source`, so that a report of the
    // whole chain (`{:#}`) does not say it twice.
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path}: {message}")]
    Bad { path: PathBuf, message: String },
}

/// Maps an I/O error on `path` to a [`FileError`].
pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> FileError + '_ {
    move |error| FileError::Io {
        path: path.to_path_buf(),
        error,
    }
}

/// `path` holds something it should not.
pub(crate) fn bad(path: &Path, message: impl ToString) -> FileError {
    FileError::Bad {
        path: path.to_path_buf(),
        message: message.to_string(),
    }
}

/// libtorch's error without the C++ stack trace it carries (`Exception raised from ...`
/// and dozens of `frame #N` lines): what went wrong, on one line.
pub(crate) fn torch(path: &Path, error: tch::TchError) -> FileError {
    let text = error.to_string();
    let message = text
        .split("\nException raised from")
        .next()
        .unwrap_or(&text)
        .trim()
        .replace('\n', " ");
    bad(path, message)
}
