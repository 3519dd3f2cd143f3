//! Errors of the shard data path, the policy that says what to do with them, and the
//! escaping of outside bytes that go into their messages.

use std::fmt::{self, Write as _};
use std::io;

/// What the data path does when a shard or a sample is bad.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorPolicy {
    /// Stop at the first problem and return it.
    #[default]
    Fail,
    /// Skip the bad sample (or the rest of a shard that cannot be read on), count it,
    /// and go on.
    Skip,
}

impl std::str::FromStr for ErrorPolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fail" => Ok(Self::Fail),
            "skip" => Ok(Self::Skip),
            other => Err(format!(
                "unknown error policy `{other}` (expected `fail` or `skip`)"
            )),
        }
    }
}

/// Everything that can go wrong while opening or reading a shard.
///
/// Every variant names the shard (`url`) and, where it applies, the byte offset in the
/// uncompressed tar stream where the problem was found.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    // The I/O error is in the message and not the error's source, so that a report of
    // the whole chain says it once.
    #[error("{url}: cannot open: {error}")]
    Open { url: String, error: io::Error },
    #[error("{url}: read failed at byte {offset}: {error}")]
    Read {
        url: String,
        offset: u64,
        error: io::Error,
    },
    #[error("{url}: not a valid tar stream at byte {offset}: {reason}")]
    Corrupt {
        url: String,
        offset: u64,
        reason: String,
    },
    #[error("{url}: duplicate file name in tar file: `{key}.{extension}` at byte {offset}")]
    DuplicateField {
        url: String,
        key: String,
        extension: String,
        offset: u64,
    },
    #[error("{url}: member `{name}` at byte {offset} is {size} bytes, over the limit of {limit}")]
    MemberTooLarge {
        url: String,
        name: String,
        offset: u64,
        size: u64,
        limit: u64,
    },
    #[error(
        "{url}: command `{command}` failed with {status}{}",
        stderr_suffix(stderr_tail)
    )]
    Pipe {
        url: String,
        command: String,
        status: String,
        stderr_tail: String,
    },
    #[error("{url}: HTTP {status}")]
    HttpStatus { url: String, status: u16 },
    #[error("{url}: {reason} (after {attempts} attempts)")]
    Http {
        url: String,
        reason: String,
        attempts: u32,
    },
    #[error("{url}: unsupported shard URL: {reason}")]
    BadUrl { url: String, reason: String },
    #[error("{url}: {problem} (bucket `{bucket}`, key `{key}`)")]
    Object {
        url: String,
        bucket: String,
        key: String,
        problem: ObjectProblem,
    },
}

/// Why an `s3://` object could not be read, from the store's last answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ObjectProblem {
    /// 404: no such bucket or key.
    Missing,
    /// 404 to a write: no such bucket.
    NoBucket,
    /// 401 or 403: the credentials (or their absence) are refused.
    Denied { status: u16 },
    /// 503 Slow Down until the attempts ran out.
    Throttled { attempts: u32 },
    /// The object's ETag is no longer the one it had when the shard was opened.
    Changed { etag: String },
    /// Another status the store answered last.
    Status { status: u16 },
    /// No answer (connection, timeout, TLS), or an answer that makes no sense.
    Failed { reason: String },
}

impl fmt::Display for ObjectProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Missing => f.write_str("no such object (404 Not Found)"),
            Self::NoBucket => f.write_str("no such bucket (404 Not Found): create it first"),
            Self::Denied { status } => write!(
                f,
                "access denied ({status}): check the credentials (AWS_ACCESS_KEY_ID, \
                 AWS_PROFILE), or set s3.anonymous for a public bucket"
            ),
            Self::Throttled { attempts } => write!(
                f,
                "the store answered 503 Slow Down (throttled) to the end, after {attempts} \
                 attempts"
            ),
            Self::Changed { etag } => write!(
                f,
                "the object changed while it was read (its ETag is no longer {etag}); a \
                 shard must not be replaced during an epoch"
            ),
            Self::Status { status } => write!(f, "the store answered HTTP {status}"),
            Self::Failed { reason } => f.write_str(reason),
        }
    }
}

impl ShardError {
    /// The shard this error is about.
    pub fn url(&self) -> &str {
        match self {
            Self::Open { url, .. }
            | Self::Read { url, .. }
            | Self::Corrupt { url, .. }
            | Self::DuplicateField { url, .. }
            | Self::MemberTooLarge { url, .. }
            | Self::Pipe { url, .. }
            | Self::HttpStatus { url, .. }
            | Self::Http { url, .. }
            | Self::BadUrl { url, .. }
            | Self::Object { url, .. } => url,
        }
    }

    /// Whether reading can go on in the same shard after this error (only sample-level
    /// problems); otherwise the rest of the shard is lost.
    pub fn is_sample_level(&self) -> bool {
        matches!(
            self,
            Self::DuplicateField { .. } | Self::MemberTooLarge { .. }
        )
    }
}

/// An error and its causes in one line, each cause said once.
pub(crate) fn one_line(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(inner) = cause {
        let more = inner.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        cause = inner.source();
    }
    text
}

/// Outside bytes (tar member names, sample keys, a command's standard error) as they go
/// into a message: printable text as it is, control and other unprintable characters
/// escaped as Rust does (`\n`, `\u{1b}`), and bytes that are not UTF-8 as `\xNN`, so
/// a hostile name can neither drive the terminal nor break a log line.
pub fn escaped(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        for c in chunk.valid().chars() {
            let escape = c.escape_debug();
            // `escape_debug` also escapes quotes and backslashes, which are printable.
            if escape.len() > 1 && !matches!(c, '\\' | '\'' | '"') {
                out.extend(escape);
            } else {
                out.push(c);
            }
        }
        for byte in chunk.invalid() {
            let _ = write!(out, "\\x{byte:02x}");
        }
    }
    out
}

fn stderr_suffix(tail: &str) -> String {
    if tail.trim().is_empty() {
        String::new()
    } else {
        format!("; stderr: {}", tail.trim())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A report of the whole chain (`{:#}`) says an I/O cause once: it is in the message,
    /// not the source as well.
    #[test]
    fn io_causes_are_said_once() {
        let missing = || io::Error::from(io::ErrorKind::NotFound);
        let errors = [
            ShardError::Open {
                url: "a.tar".into(),
                error: missing(),
            },
            ShardError::Read {
                url: "a.tar".into(),
                offset: 7,
                error: missing(),
            },
        ];
        for error in errors {
            assert!(std::error::Error::source(&error).is_none(), "{error}");
            assert!(error.to_string().contains("entity not found"), "{error}");
        }
    }

    #[test]
    fn outside_bytes_are_escaped_for_messages() {
        let cases: &[(&[u8], &str)] = &[
            (b"n01440764_10026", "n01440764_10026"),
            ("caf\u{e9}/it's \"x\"".as_bytes(), "caf\u{e9}/it's \"x\""),
            (b"a\nb\tc\r", "a\\nb\\tc\\r"),
            (b"\x1b[2Jgone\x07", "\\u{1b}[2Jgone\\u{7}"),
            (b"\xff\xfekey\x00", "\\xff\\xfekey\\0"),
            ("rtl\u{202e}gpj.exe".as_bytes(), "rtl\\u{202e}gpj.exe"),
            (br"C:\data", r"C:\data"),
        ];
        for (bytes, want) in cases {
            assert_eq!(escaped(bytes), *want, "escaping {bytes:?}");
        }
    }
}
