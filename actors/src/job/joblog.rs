//! The job's log: `job.log` in its run folder, every line the job said (its plan, epoch
//! summaries, warnings, how it ended), each stamped with its UTC time, across every
//! attempt and resume of the run. The coordinator writes it ([`Journal`]); the dashboard
//! and `imgrun report` read it through the coordinator's `log` and `log_search` methods,
//! which look at a bounded number of bytes whatever the file's size:
//!
//! - the last lines: read backwards from the end, a block at a time, until enough line
//!   ends are seen;
//! - a range of bytes (following, downloading a piece at a time);
//! - a search for a text in the newest [`SEARCH_WINDOW`] bytes.
//!
//! A log is never addressed by a path from a request: the coordinator knows its own run
//! folder.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::JobState;

/// The log's file name in the run folder.
pub const LOG_FILE: &str = "job.log";

/// The most bytes one [`LogRequest`] returns.
pub const MAX_LOG_PIECE: u64 = 4 << 20;

/// How far back from the end a [`LogSearchRequest`] looks.
pub const SEARCH_WINDOW: u64 = 64 << 20;

/// The longest line a search match returns (longer ones are cut, with `…`).
const MAX_MATCH_LINE: usize = 4096;

/// Lines said before the run folder exists wait for it, up to this many bytes.
const MAX_WAITING: usize = 1 << 20;

/// How many bytes a backward scan reads at once.
const BLOCK: u64 = 64 << 10;

/// A piece of the job's log: the last `lines` lines, or the bytes from `offset`; at most
/// `max_bytes` (capped at [`MAX_LOG_PIECE`]) either way.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LogRequest {
    pub from: LogFrom,
    pub max_bytes: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFrom {
    Tail { lines: u64 },
    Offset { offset: u64 },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LogReply {
    pub bytes: Vec<u8>,
    /// The offset of `bytes`' first byte.
    pub start: u64,
    /// The file's length now.
    pub length: u64,
}

/// The lines of the newest [`SEARCH_WINDOW`] bytes that contain `text` (as it is
/// written, case and all), oldest first; at most `max_matches` of them, the newest.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LogSearchRequest {
    pub text: String,
    pub max_matches: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LogSearchReply {
    pub matches: Vec<LogMatch>,
    /// More lines matched than `max_matches`: the oldest were left out.
    pub more: bool,
    /// Where the search began: 0, or the file's length less [`SEARCH_WINDOW`].
    pub searched_from: u64,
    pub length: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogMatch {
    /// The offset of the line's first byte.
    pub offset: u64,
    pub line: String,
}

/// The writer of a job's log. Lines said before [`Journal::open`] wait in memory; a
/// failed write is reported once and ends the log (never the job).
pub struct Journal {
    target: Target,
}

enum Target {
    Waiting(Vec<u8>),
    Open(File),
    Broken,
}

impl Journal {
    pub fn new() -> Self {
        Journal {
            target: Target::Waiting(Vec::new()),
        }
    }

    /// Appends `text` (each of its lines) stamped with `now`.
    pub fn line(&mut self, now: std::time::SystemTime, text: &str) {
        let stamped = stamp(now, text);
        match &mut self.target {
            Target::Waiting(waiting) => {
                if waiting.len() + stamped.len() <= MAX_WAITING {
                    waiting.extend_from_slice(stamped.as_bytes());
                }
            }
            Target::Open(file) => {
                if let Err(error) = file.write_all(stamped.as_bytes()) {
                    tracing::warn!(%error, "writing the job's log; it ends here");
                    self.target = Target::Broken;
                }
            }
            Target::Broken => {}
        }
    }

    /// Writes to `dir/job.log` from now on (appending: a resumed run continues its log),
    /// beginning with the lines that waited.
    pub fn open(&mut self, dir: &Path) -> io::Result<()> {
        let path = dir.join(LOG_FILE);
        let mut file = File::options().create(true).append(true).open(&path)?;
        if let Target::Waiting(waiting) = &self.target {
            file.write_all(waiting)?;
        }
        self.target = Target::Open(file);
        Ok(())
    }
}

impl Journal {
    /// Appends how the job ended: `job <state>: <outcome>`.
    pub fn ended(&mut self, now: std::time::SystemTime, state: JobState, outcome: Option<&str>) {
        let ended = match outcome {
            Some(outcome) => format!("job {}: {outcome}", state.name()),
            None => format!("job {}", state.name()),
        };
        self.line(now, &ended);
    }
}

impl std::fmt::Debug for Journal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.target {
            Target::Waiting(waiting) => format!("waiting ({} bytes)", waiting.len()),
            Target::Open(_) => "open".to_string(),
            Target::Broken => "broken".to_string(),
        };
        f.debug_struct("Journal").field("state", &state).finish()
    }
}

impl Default for Journal {
    fn default() -> Self {
        Journal::new()
    }
}

/// `text`'s lines, each begun with `now` in RFC 3339 (UTC, milliseconds).
fn stamp(now: std::time::SystemTime, text: &str) -> String {
    let at = time::OffsetDateTime::from(now);
    let at = format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
        at.year(),
        u8::from(at.month()),
        at.day(),
        at.hour(),
        at.minute(),
        at.second(),
        at.millisecond()
    );
    let mut out = String::with_capacity(text.len() + 32);
    for line in text.lines() {
        out.push_str(&at);
        out.push(' ');
        out.push_str(line);
        out.push('\n');
    }
    if out.is_empty() {
        out.push_str(&at);
        out.push('\n');
    }
    out
}

/// Answers `request` from `log`, whose length is `length`.
pub fn read<R: Read + Seek>(
    log: &mut R,
    length: u64,
    request: &LogRequest,
) -> io::Result<LogReply> {
    let max = request.max_bytes.clamp(1, MAX_LOG_PIECE);
    let start = match request.from {
        LogFrom::Tail { lines } => tail_start(log, length, lines, max)?,
        LogFrom::Offset { offset } => offset.min(length),
    };
    let mut bytes = Vec::new();
    log.seek(SeekFrom::Start(start))?;
    log.take(max.min(length - start)).read_to_end(&mut bytes)?;
    Ok(LogReply {
        bytes,
        start,
        length,
    })
}

/// Where the last `lines` lines of `log` begin, no further back than `max_bytes` from
/// its end (then at the first whole line after that point, where there is one).
fn tail_start<R: Read + Seek>(
    log: &mut R,
    length: u64,
    lines: u64,
    max_bytes: u64,
) -> io::Result<u64> {
    if lines == 0 {
        return Ok(length);
    }
    let floor = length.saturating_sub(max_bytes);
    // The last line's end is not the end of a line before it.
    let mut end = length;
    let mut seen = 0;
    let mut block = vec![0; BLOCK as usize];
    let mut skip_last = true;
    while end > floor {
        let from = end.saturating_sub(BLOCK).max(floor);
        let piece = &mut block[..(end - from) as usize];
        log.seek(SeekFrom::Start(from))?;
        log.read_exact(piece)?;
        for (i, byte) in piece.iter().enumerate().rev() {
            if *byte != b'\n' {
                skip_last = false;
                continue;
            }
            if skip_last {
                skip_last = false;
                continue;
            }
            seen += 1;
            if seen == lines {
                return Ok(from + i as u64 + 1);
            }
        }
        end = from;
    }
    if floor == 0 {
        return Ok(0);
    }
    // Cut by `max_bytes`: begin at the first whole line.
    let mut piece = Vec::new();
    log.seek(SeekFrom::Start(floor - 1))?;
    log.take(length - floor + 1).read_to_end(&mut piece)?;
    Ok(match memchr::memchr(b'\n', &piece) {
        Some(i) if (floor + i as u64) < length => floor + i as u64,
        _ => floor,
    })
}

/// Answers `request` from `log`, whose length is `length`.
pub fn search<R: Read + Seek>(
    log: &mut R,
    length: u64,
    request: &LogSearchRequest,
) -> io::Result<LogSearchReply> {
    let searched_from = length.saturating_sub(SEARCH_WINDOW);
    let mut reply = LogSearchReply {
        matches: Vec::new(),
        more: false,
        searched_from,
        length,
    };
    if request.text.is_empty() || request.max_matches == 0 {
        return Ok(reply);
    }
    let finder = memchr::memmem::Finder::new(request.text.as_bytes());
    log.seek(SeekFrom::Start(searched_from))?;
    let mut reader = BufReader::with_capacity(1 << 20, log.take(length - searched_from));
    let mut offset = searched_from;
    let mut line = Vec::new();
    let keep = usize::try_from(request.max_matches).unwrap_or(usize::MAX);
    let mut found = std::collections::VecDeque::new();
    loop {
        line.clear();
        let read = reader.read_until(b'\n', &mut line)?;
        if read == 0 {
            break;
        }
        if finder.find(&line).is_some() {
            if found.len() == keep {
                found.pop_front();
                reply.more = true;
            }
            found.push_back(LogMatch {
                offset,
                line: shown(&line),
            });
        }
        offset += read as u64;
    }
    reply.matches = found.into();
    Ok(reply)
}

/// A line as a match shows it: without its line end, cut at [`MAX_MATCH_LINE`] bytes.
fn shown(line: &[u8]) -> String {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    if line.len() <= MAX_MATCH_LINE {
        return String::from_utf8_lossy(line).into_owned();
    }
    let mut text = String::from_utf8_lossy(&line[..MAX_MATCH_LINE]).into_owned();
    text.push('…');
    text
}

/// Opens `run_dir`'s log and answers `request` from it.
pub fn read_in(run_dir: &Path, request: &LogRequest) -> io::Result<LogReply> {
    let (mut file, length) = open_log(run_dir)?;
    read(&mut file, length, request)
}

/// Opens `run_dir`'s log and answers `request` from it.
pub(super) fn search_in(run_dir: &Path, request: &LogSearchRequest) -> io::Result<LogSearchReply> {
    let (mut file, length) = open_log(run_dir)?;
    search(&mut file, length, request)
}

fn open_log(run_dir: &Path) -> io::Result<(File, u64)> {
    let file = File::open(run_dir.join(LOG_FILE))?;
    let length = file.metadata()?.len();
    Ok((file, length))
}

#[cfg(test)]
mod tests {
    use std::io::Cursor;
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;

    fn tail(text: &str, lines: u64, max_bytes: u64) -> String {
        let mut log = Cursor::new(text.as_bytes().to_vec());
        let request = LogRequest {
            from: LogFrom::Tail { lines },
            max_bytes,
        };
        let reply = read(&mut log, text.len() as u64, &request).expect("read");
        assert_eq!(
            &text.as_bytes()[reply.start as usize..][..reply.bytes.len()],
            &reply.bytes[..],
            "start names the bytes' place"
        );
        String::from_utf8(reply.bytes).expect("utf-8")
    }

    #[test]
    fn the_tail_is_the_last_whole_lines_within_the_cap() {
        let ten: String = (1..=10).map(|i| format!("line {i}\n")).collect();
        let long = "x".repeat(200_000) + "\nend\n";
        // (log, lines, max bytes, expected)
        let cases: [(&str, u64, u64, &str); 10] = [
            ("", 5, 100, ""),
            ("a\nb\nc\n", 2, 100, "b\nc\n"),
            ("a\nb\nc", 2, 100, "b\nc"),
            ("a\nb\nc\n", 3, 100, "a\nb\nc\n"),
            ("a\nb\nc\n", 9, 100, "a\nb\nc\n"),
            ("a\nb\nc\n", 1, 100, "c\n"),
            ("a\nb\nc\n", 0, 100, ""),
            (&ten, 3, 1000, "line 8\nline 9\nline 10\n"),
            // The cap cuts "line 8": the tail begins at the next whole line.
            (&ten, 3, 16, "line 9\nline 10\n"),
            (&long, 2, 1 << 20, &long),
        ];
        for (i, (log, lines, max, expected)) in cases.into_iter().enumerate() {
            assert_eq!(tail(log, lines, max), expected, "case {i}");
        }
        // Across blocks: the last 3 of 100,000 lines.
        let many: String = (0..100_000).map(|i| format!("{i:08}\n")).collect();
        assert_eq!(tail(&many, 3, 1 << 20), "00099997\n00099998\n00099999\n");
    }

    #[test]
    fn a_range_is_read_from_its_offset_and_capped() {
        let text = b"0123456789";
        let mut log = Cursor::new(text.to_vec());
        for (offset, max, expected) in [(0, 4, "0123"), (8, 4, "89"), (20, 4, ""), (3, 0, "3")] {
            let request = LogRequest {
                from: LogFrom::Offset { offset },
                max_bytes: max,
            };
            let reply = read(&mut log, 10, &request).expect("read");
            assert_eq!(String::from_utf8(reply.bytes).expect("utf-8"), expected);
            assert_eq!(reply.length, 10);
        }
    }

    #[test]
    fn a_search_keeps_the_newest_matches_with_their_offsets() {
        let text = "a warning: one\nb fine\nc warning: two\nd warning: three\n";
        let mut log = Cursor::new(text.as_bytes().to_vec());
        let request = |text: &str, max_matches| LogSearchRequest {
            text: text.into(),
            max_matches,
        };
        let reply = search(&mut log, text.len() as u64, &request("warning", 2)).expect("search");
        assert!(reply.more);
        assert_eq!(
            reply.matches,
            [
                LogMatch {
                    offset: 22,
                    line: "c warning: two".into()
                },
                LogMatch {
                    offset: 37,
                    line: "d warning: three".into()
                },
            ]
        );
        let reply = search(&mut log, text.len() as u64, &request("fine", 9)).expect("search");
        assert!(!reply.more);
        assert_eq!(reply.matches.len(), 1);
        for nothing in [request("", 9), request("Warning", 9), request("warning", 0)] {
            let reply = search(&mut log, text.len() as u64, &nothing).expect("search");
            assert!(reply.matches.is_empty());
        }
    }

    #[test]
    fn lines_are_stamped_and_wait_for_the_folder() {
        let at = UNIX_EPOCH + Duration::from_millis(1_795_891_300_123);
        assert_eq!(
            stamp(at, "one\ntwo"),
            "2026-11-28T18:41:40.123Z one\n2026-11-28T18:41:40.123Z two\n"
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let mut journal = Journal::new();
        journal.line(at, "before");
        journal.open(dir.path()).expect("open");
        journal.line(at, "after");
        let mut again = Journal::new();
        again.open(dir.path()).expect("open again");
        again.line(at, "resumed");
        let text = std::fs::read_to_string(dir.path().join(LOG_FILE)).expect("log");
        let texts: Vec<&str> = text.lines().map(|l| &l[25..]).collect();
        assert_eq!(texts, ["before", "after", "resumed"]);
    }
}
