//! The members of a tar stream, walked with as few copies as the stream allows.
//!
//! Headers are parsed in a small buffer of the walker's own; a member's data goes into
//! the caller's `Vec` with one copy of the part already buffered and one read, straight
//! from the stream, for the rest. A stream that reads into uninitialised memory
//! ([`TarRead::read_spare`]: a local file) fills the `Vec`'s spare capacity as it is;
//! any other stream reads into zeroed memory (`read_to_end` would skip the zeroing but
//! reads 8, 16, 32 KiB... in turn, and on the read benchmark the extra system calls cost
//! more than the zeroing, which itself costs about a tenth of the raw read). Padding and
//! skipped members are passed over in the buffer, never read into a fresh one.
//!
//! The format rules are the `tar` crate's, which the reader used before: ustar, GNU and
//! PAX headers; GNU long names (`L`) and PAX `path` and `size` records apply to the next
//! member; the first all-zero block or the end of the stream ends the archive; a bad
//! checksum is an error. GNU sparse members (`S`, never samples) are passed over with
//! their extension blocks.

use std::io::{self, Read};

/// The size of a tar block: headers are one block, data is padded to whole blocks.
pub(crate) const BLOCK: usize = 512;

/// The walker's buffer. Small, so that it stays in the L1/L2 cache and little member
/// data passes through it: anything past the buffered part is read into its final place.
pub(crate) const WALK_BUFFER: usize = 16 << 10;

/// One member's header, with extension headers (long names, PAX records) applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MemberHeader {
    /// Where the member's own header starts (after any extension headers before it).
    pub header_at: u64,
    /// Where its data starts.
    pub data_at: u64,
    /// Its data's length in bytes.
    pub size: u64,
    /// The type flag: `0` or NUL for a regular file, `7` for a contiguous one, ...
    pub kind: u8,
}

impl MemberHeader {
    /// Python's `isreg()` without sparse files: regular and contiguous files.
    pub fn is_file(&self) -> bool {
        matches!(self.kind, b'0' | 0 | b'7')
    }
}

/// The bytes a walk reads: any [`Read`], and for some streams a read that skips zeroing.
pub(crate) trait TarRead: Read {
    /// Reads once into the spare capacity of `out` (at most all of it) and appends what
    /// was read, without initialising the memory first; `None` when this stream cannot,
    /// and the walk reads into zeroed memory instead.
    fn read_spare(&mut self, out: &mut Vec<u8>) -> Option<io::Result<usize>>;
}

/// Any reader, its member data read into zeroed memory.
#[derive(Debug)]
pub(crate) struct Plain<R>(pub R);

impl<R: Read> Read for Plain<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

impl<R: Read> TarRead for Plain<R> {
    fn read_spare(&mut self, _out: &mut Vec<u8>) -> Option<io::Result<usize>> {
        None
    }
}

/// A tar walk over `stream`.
#[derive(Debug)]
pub(crate) struct Members<R> {
    stream: R,
    buf: Box<[u8]>,
    /// The unread bytes are `buf[start..end]`.
    start: usize,
    end: usize,
    /// Stream offset of `buf[start]`: every byte before it has been used.
    offset: u64,
    /// Bytes of the current member (data and padding) not yet passed.
    pending: u64,
    /// Data bytes of the current member not yet read (part of `pending`).
    data_left: u64,
    /// The current member's name, with long names and PAX paths applied.
    name: Vec<u8>,
    /// Largest GNU long name or PAX record accepted.
    max_extension: u64,
    ended: bool,
}

impl<R: TarRead> Members<R> {
    /// A walk whose long-name and PAX records may be up to `max_extension` bytes.
    pub fn new(stream: R, max_extension: u64) -> Self {
        Self {
            stream,
            buf: vec![0; WALK_BUFFER].into_boxed_slice(),
            start: 0,
            end: 0,
            offset: 0,
            pending: 0,
            data_left: 0,
            name: Vec::new(),
            max_extension,
            ended: false,
        }
    }

    /// The stream offset up to which bytes have been used.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The name of the member [`next`](Self::next) returned last.
    pub fn name(&self) -> &[u8] {
        &self.name
    }

    /// The next member's header, or `None` at the end of the archive. Whatever is left
    /// of the previous member is passed over first. An error carries, in `Err.1`, the
    /// offset of the block where the problem was found.
    pub fn next(&mut self) -> Result<Option<MemberHeader>, (u64, io::Error)> {
        if self.ended {
            return Ok(None);
        }
        let at = self.offset;
        self.skip_pending().map_err(|e| (at, e))?;
        let mut long_name: Option<Vec<u8>> = None;
        let mut long_link = false;
        let mut pax: Option<Vec<u8>> = None;
        loop {
            let header_at = self.offset;
            let fail = |error: io::Error| (header_at, error);
            let available = self.fill(BLOCK).map_err(fail)?;
            if available > 0 && available < BLOCK {
                return Err(fail(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("truncated header: {available} of {BLOCK} bytes"),
                )));
            }
            let at_end = available == 0
                || self.buf[self.start..self.start + BLOCK]
                    .iter()
                    .all(|&b| b == 0);
            if at_end {
                self.ended = true;
                if long_name.is_some() || long_link || pax.is_some() {
                    return Err(fail(corrupt(
                        "members found describing a future member but no future member found",
                    )));
                }
                return Ok(None);
            }
            let block: &[u8; BLOCK] = self.buf[self.start..self.start + BLOCK]
                .try_into()
                .map_err(|_| fail(corrupt("header block out of the buffer")))?;
            let header = Header(block);
            header.check_sum().map_err(fail)?;
            let kind = header.kind();
            let recognized = header.is_ustar() || header.is_gnu();
            let is_extension = matches!(kind, b'L' | b'K' | b'x' | b'g');
            let mut size = header.size().map_err(fail)?;
            if let Some(records) = pax.as_deref().filter(|_| !is_extension)
                && let Some(pax_size) = pax_number(records, b"size")
            {
                size = pax_size;
            }
            let padded = size
                .checked_next_multiple_of(BLOCK as u64)
                .ok_or_else(|| fail(corrupt("size overflow")))?;
            if recognized && matches!(kind, b'L' | b'K' | b'x') {
                let twice = match kind {
                    b'L' => long_name.is_some(),
                    b'K' => long_link,
                    _ => pax.is_some(),
                };
                if twice {
                    return Err(fail(corrupt(
                        "two extension entries of one kind describing the same member",
                    )));
                }
                if size > self.max_extension {
                    return Err(fail(corrupt(&format!(
                        "extension record of {size} bytes, over the limit of {}",
                        self.max_extension
                    ))));
                }
                self.consume(BLOCK);
                let mut data = Vec::new();
                self.pending = padded;
                self.data_left = size;
                self.read_data(&mut data).map_err(fail)?;
                if (data.len() as u64) < size {
                    return Err(fail(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "truncated extension record",
                    )));
                }
                self.skip_pending().map_err(fail)?;
                match kind {
                    b'L' => long_name = Some(data),
                    b'K' => long_link = true,
                    _ => pax = Some(data),
                }
                continue;
            }

            self.name.clear();
            match (&long_name, pax.as_deref().and_then(pax_path)) {
                (Some(long), _) => self
                    .name
                    .extend_from_slice(long.strip_suffix(&[0]).unwrap_or(long.as_slice())),
                (None, Some(path)) => self.name.extend_from_slice(path),
                (None, None) => header.path(&mut self.name),
            }
            let sparse_extended = if kind == b'S' {
                if !header.is_gnu() {
                    return Err(fail(corrupt("sparse entry type listed but not GNU header")));
                }
                header.0[482] == 1
            } else {
                false
            };
            self.consume(BLOCK);
            if sparse_extended {
                self.skip_sparse_blocks().map_err(|e| (self.offset, e))?;
            }
            self.pending = padded;
            self.data_left = size;
            return Ok(Some(MemberHeader {
                header_at,
                data_at: self.offset,
                size,
                kind,
            }));
        }
    }

    /// Appends the current member's data to `out` (reserving room for all of it first).
    /// Returns fewer bytes than the member declares only when the stream ends early.
    pub fn read_data(&mut self, out: &mut Vec<u8>) -> io::Result<()> {
        let Ok(want) = usize::try_from(self.data_left) else {
            return Err(corrupt("member larger than memory"));
        };
        out.try_reserve_exact(want)
            .map_err(|e| io::Error::new(io::ErrorKind::OutOfMemory, e))?;
        let mut left = want;
        while left > 0 {
            let buffered = (self.end - self.start).min(left);
            if buffered > 0 {
                out.extend_from_slice(&self.buf[self.start..self.start + buffered]);
                self.consume(buffered);
                left -= buffered;
            } else if left >= self.buf.len() / 2 {
                // Large: straight from the stream into its place, in one read where the
                // stream allows.
                let got = read_into(&mut self.stream, out, left)?;
                self.offset += got as u64;
                self.pending -= got as u64;
                left -= got;
                if got == 0 {
                    break;
                }
            } else if self.fill(1)? == 0 {
                // Small: a refill brings the next headers along.
                break;
            }
        }
        self.data_left = left as u64;
        Ok(())
    }

    /// Reads the rest of the stream, after the end of the archive, and returns its total
    /// length: a source sees its end, and a `pipe:` command's exit status is checked.
    pub fn drain(&mut self) -> io::Result<u64> {
        self.consume(self.end - self.start);
        loop {
            let n = read_some(&mut self.stream, &mut self.buf)?;
            if n == 0 {
                return Ok(self.offset);
            }
            self.offset += n as u64;
        }
    }

    /// Passes over what is left of the current member.
    fn skip_pending(&mut self) -> io::Result<()> {
        while self.pending > 0 {
            let buffered = (self.end - self.start) as u64;
            if buffered == 0 && self.fill(1)? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "the stream ends {} bytes before the next header",
                        self.pending
                    ),
                ));
            }
            let n = self.pending.min((self.end - self.start) as u64);
            // `n` is at most the buffered byte count, a usize.
            self.consume(n as usize);
        }
        self.data_left = 0;
        Ok(())
    }

    /// Passes over the extension blocks of a GNU sparse header (each says whether
    /// another follows in its byte 504).
    fn skip_sparse_blocks(&mut self) -> io::Result<()> {
        loop {
            if self.fill(BLOCK)? < BLOCK {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "failed to read a sparse extension block",
                ));
            }
            let more = self.buf[self.start + 504] == 1;
            self.consume(BLOCK);
            if !more {
                return Ok(());
            }
        }
    }

    /// Marks `n` buffered bytes used.
    fn consume(&mut self, n: usize) {
        self.start += n;
        self.offset += n as u64;
        if self.pending > 0 {
            self.pending = self.pending.saturating_sub(n as u64);
        }
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// Makes at least `want` bytes (at most the buffer's size) available when the stream
    /// has them, reading as much as fits; returns how many are available.
    fn fill(&mut self, want: usize) -> io::Result<usize> {
        if self.end - self.start >= want {
            return Ok(self.end - self.start);
        }
        self.buf.copy_within(self.start..self.end, 0);
        self.end -= self.start;
        self.start = 0;
        while self.end < want {
            let n = read_some(&mut self.stream, &mut self.buf[self.end..])?;
            if n == 0 {
                break;
            }
            self.end += n;
        }
        Ok(self.end)
    }
}

/// Appends up to `n` bytes from `stream` to `out` in reads as large as the rest: fewer
/// only at the end of the stream. Into `out`'s spare capacity as it is when the stream
/// can and that capacity is exactly `n` (never past the member's data, which the next
/// header follows); into zeroed memory otherwise.
fn read_into<R: TarRead>(stream: &mut R, out: &mut Vec<u8>, n: usize) -> io::Result<usize> {
    let start = out.len();
    if out.capacity() - start == n {
        loop {
            let filled = out.len() - start;
            if filled == n {
                return Ok(n);
            }
            match stream.read_spare(out) {
                Some(Ok(0)) => return Ok(filled),
                Some(Ok(_)) => {}
                Some(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                Some(Err(e)) => return Err(e),
                // Not a stream that reads into spare memory (or no longer one): the
                // rest through zeroed memory.
                None => return Ok(filled + read_zeroed(stream, out, n - filled)?),
            }
        }
    }
    read_zeroed(stream, out, n)
}

/// [`read_into`] through zeroed memory.
fn read_zeroed<R: Read>(stream: &mut R, out: &mut Vec<u8>, n: usize) -> io::Result<usize> {
    let start = out.len();
    out.resize(start + n, 0);
    let mut filled = start;
    while filled < out.len() {
        let got = match read_some(stream, &mut out[filled..]) {
            Ok(got) => got,
            Err(e) => {
                out.truncate(filled);
                return Err(e);
            }
        };
        if got == 0 {
            break;
        }
        filled += got;
    }
    out.truncate(filled);
    Ok(filled - start)
}

/// One `read`, retried when interrupted.
fn read_some<R: Read>(stream: &mut R, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        match stream.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            result => return result,
        }
    }
}

fn corrupt(reason: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, reason.to_string())
}

/// A header block and its fields.
struct Header<'a>(&'a [u8; BLOCK]);

impl Header<'_> {
    fn kind(&self) -> u8 {
        self.0[156]
    }

    fn is_ustar(&self) -> bool {
        &self.0[257..263] == b"ustar\0" && &self.0[263..265] == b"00"
    }

    fn is_gnu(&self) -> bool {
        &self.0[257..263] == b"ustar " && &self.0[263..265] == b" \0"
    }

    /// The sum of the header's bytes, the checksum field counted as spaces, must be the
    /// octal number in that field.
    fn check_sum(&self) -> io::Result<()> {
        // Summed whole (which vectorises), then the field taken out and spaces put in.
        let all: u32 = self.0.iter().map(|&b| u32::from(b)).sum();
        let field: u32 = self.0[148..156].iter().map(|&b| u32::from(b)).sum();
        let sum = u64::from(all - field + 8 * u32::from(b' '));
        let stored = octal(&self.0[148..156], "checksum")?;
        if stored != sum {
            return Err(corrupt("archive header checksum mismatch"));
        }
        Ok(())
    }

    /// The size field: octal, or GNU's base-256 when its first byte has the high bit.
    fn size(&self) -> io::Result<u64> {
        let field = &self.0[124..136];
        if field[0] & 0x80 == 0 {
            return octal(field, "size");
        }
        // Base-256: the last 8 bytes hold the number (larger would not fit in a u64).
        Ok(field[4..]
            .iter()
            .fold(0u64, |n, &b| (n << 8) | u64::from(b)))
    }

    /// The name field, with a ustar header's prefix.
    fn path(&self, into: &mut Vec<u8>) {
        let name = until_nul(&self.0[..100]);
        if self.is_ustar() && (self.0[345] != 0 || self.0[..100].contains(&b'\\')) {
            let prefix = until_nul(&self.0[345..500]);
            if !prefix.is_empty() {
                into.extend_from_slice(prefix);
                into.push(b'/');
            }
        }
        into.extend_from_slice(name);
    }
}

fn until_nul(field: &[u8]) -> &[u8] {
    field
        .iter()
        .position(|&b| b == 0)
        .map_or(field, |end| &field[..end])
}

/// An octal header field: text up to the first NUL, surrounding spaces allowed.
fn octal(field: &[u8], what: &str) -> io::Result<u64> {
    let text = until_nul(field);
    std::str::from_utf8(text)
        .ok()
        .and_then(|t| u64::from_str_radix(t.trim(), 8).ok())
        .ok_or_else(|| {
            corrupt(&format!(
                "the {what} field `{}` is not an octal number",
                crate::error::escaped(text)
            ))
        })
}

/// PAX records (`LEN KEY=VALUE\n`), in order, up to the first malformed one.
fn pax_records(records: &[u8]) -> impl Iterator<Item = Option<(&[u8], &[u8])>> {
    records
        .split(|&b| b == b'\n')
        .take_while(|line| !line.is_empty())
        .map(|line| {
            let space = line.iter().position(|&b| b == b' ')?;
            let length: usize = std::str::from_utf8(&line[..space]).ok()?.parse().ok()?;
            if line.len() + 1 != length {
                return None;
            }
            let record = &line[space + 1..];
            let equals = record.iter().position(|&b| b == b'=')?;
            Some((&record[..equals], &record[equals + 1..]))
        })
}

/// The first `path` record among the well-formed ones.
fn pax_path(records: &[u8]) -> Option<&[u8]> {
    pax_records(records)
        .flatten()
        .find(|(key, _)| *key == b"path")
        .map(|(_, value)| value)
}

/// A numeric record, looked for up to the first malformed record.
fn pax_number(records: &[u8], key: &[u8]) -> Option<u64> {
    for record in pax_records(records) {
        let (k, value) = record?;
        if k == key {
            return std::str::from_utf8(value).ok()?.parse().ok();
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tar of `(type flag, name, data)` members, ustar headers written by the `tar`
    /// crate (GNU long names for regular files whose names do not fit).
    fn tar_of(members: &[(u8, &[u8], &[u8])]) -> Vec<u8> {
        let mut builder = tar::Builder::new(Vec::new());
        for &(kind, name, data) in members {
            let mut header = tar::Header::new_gnu();
            header.set_size(data.len() as u64);
            header.set_mode(0o644);
            header.set_entry_type(tar::EntryType::new(kind));
            if name.len() <= 100 {
                if let Some(gnu) = header.as_gnu_mut() {
                    gnu.name[..name.len()].copy_from_slice(name);
                }
                header.set_cksum();
                builder.append(&header, data).expect("append");
            } else {
                let name = std::str::from_utf8(name).expect("utf-8 long name");
                builder
                    .append_data(&mut header, name, data)
                    .expect("append long");
            }
        }
        builder.into_inner().expect("finish")
    }

    /// A ustar PAX record list holding `records`.
    fn pax(records: &[(&str, &str)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (key, value) in records {
            let body = format!(" {key}={value}\n");
            // The length counts its own digits.
            let mut length = body.len() + 1;
            while format!("{length}{body}").len() != length {
                length += 1;
            }
            out.extend_from_slice(format!("{length}{body}").as_bytes());
        }
        out
    }

    /// A stream that hands out at most `chunk` bytes a read, to cut members anywhere;
    /// with `spare`, member data comes through [`TarRead::read_spare`] as from a file.
    struct Trickle<'a> {
        bytes: &'a [u8],
        chunk: usize,
        spare: bool,
    }

    impl<'a> Trickle<'a> {
        fn new(bytes: &'a [u8], chunk: usize) -> Self {
            Self {
                bytes,
                chunk,
                spare: false,
            }
        }

        fn spare(bytes: &'a [u8], chunk: usize) -> Self {
            Self {
                bytes,
                chunk,
                spare: true,
            }
        }
    }

    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = buf.len().min(self.chunk).min(self.bytes.len());
            buf[..n].copy_from_slice(&self.bytes[..n]);
            self.bytes = &self.bytes[n..];
            Ok(n)
        }
    }

    impl TarRead for Trickle<'_> {
        fn read_spare(&mut self, out: &mut Vec<u8>) -> Option<io::Result<usize>> {
            if !self.spare {
                return None;
            }
            let room = out.capacity() - out.len();
            let n = room.min(self.chunk).min(self.bytes.len());
            out.extend_from_slice(&self.bytes[..n]);
            assert!(out.len() <= out.capacity(), "read past the spare capacity");
            self.bytes = &self.bytes[n..];
            Some(Ok(n))
        }
    }

    /// Every member as (name, header offset, data offset, data), or the first error with
    /// its offset.
    type Walked = Vec<(Vec<u8>, u64, u64, Vec<u8>)>;

    fn walk<R: TarRead>(stream: R) -> Result<Walked, (u64, String)> {
        let mut members = Members::new(stream, 1 << 20);
        let mut seen = Vec::new();
        while let Some(member) = members.next().map_err(|(at, e)| (at, e.to_string()))? {
            let mut data = Vec::new();
            if member.is_file() && member.size <= 1 << 20 {
                members
                    .read_data(&mut data)
                    .map_err(|e| (member.data_at, e.to_string()))?;
                if (data.len() as u64) < member.size {
                    let at = member.data_at + data.len() as u64;
                    return Err((at, "truncated data".to_string()));
                }
            }
            seen.push((
                members.name().to_vec(),
                member.header_at,
                member.data_at,
                data,
            ));
        }
        members
            .drain()
            .map_err(|e| (members.offset(), e.to_string()))?;
        Ok(seen)
    }

    /// Rewrites a header block's checksum after an edit.
    fn reseal(block: &mut [u8]) {
        block[148..156].fill(b' ');
        let sum: u32 = block.iter().map(|&b| u32::from(b)).sum();
        block[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    }

    fn filled(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect()
    }

    #[test]
    fn members_of_every_size_come_whole_through_any_read_pattern() {
        // Sizes around the buffer and its half (where reads switch to going direct), and
        // tiny ones between, so that members start and end anywhere in the buffer.
        let sizes = [
            0,
            1,
            511,
            512,
            513,
            WALK_BUFFER / 2 - 1,
            WALK_BUFFER / 2,
            WALK_BUFFER - BLOCK,
            WALK_BUFFER - 1,
            WALK_BUFFER,
            WALK_BUFFER + 1,
            3 * WALK_BUFFER + 7,
            2,
        ];
        let datas: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| filled(n, i as u8))
            .collect();
        let names: Vec<String> = (0..sizes.len()).map(|i| format!("k{i}.bin")).collect();
        let members: Vec<(u8, &[u8], &[u8])> = names
            .iter()
            .zip(&datas)
            .map(|(name, data)| (b'0', name.as_bytes(), data.as_slice()))
            .collect();
        let bytes = tar_of(&members);
        for chunk in [
            1,
            7,
            512,
            4096,
            WALK_BUFFER - 3,
            WALK_BUFFER + 5,
            usize::MAX,
        ] {
            for stream in [Trickle::new(&bytes, chunk), Trickle::spare(&bytes, chunk)] {
                let spare = stream.spare;
                let got = walk(stream).unwrap_or_else(|e| panic!("chunk {chunk}: {e:?}"));
                assert_eq!(got.len(), sizes.len(), "chunk {chunk}, spare {spare}");
                let mut at = 0u64;
                for ((name, header_at, data_at, data), want) in got.iter().zip(&members) {
                    let case = format!("chunk {chunk}, spare {spare}: {:?}", want.1);
                    assert_eq!(name.as_slice(), want.1, "{case}");
                    assert_eq!(data.as_slice(), want.2, "{case}");
                    assert_eq!((*header_at, *data_at), (at, at + 512), "{case}");
                    at += 512 + (want.2.len() as u64).next_multiple_of(512);
                }
            }
        }
    }

    #[test]
    fn long_names_pax_records_and_sparse_headers_apply_like_the_tar_crate() {
        let long = format!("{}/x.jpg", "d".repeat(150));
        let mut bytes = tar_of(&[(b'0', long.as_bytes(), b"long")]);
        bytes.truncate(bytes.len() - 1024);
        // PAX `path` and `size` for the next member; its header says 9 bytes, PAX 3.
        let records = pax(&[("mtime", "1"), ("path", "pax/name.cls"), ("size", "3")]);
        let mut builder = tar::Builder::new(Vec::new());
        let mut x = tar::Header::new_ustar();
        x.set_entry_type(tar::EntryType::XHeader);
        x.set_size(records.len() as u64);
        x.set_cksum();
        builder.append(&x, records.as_slice()).expect("pax");
        let mut file = tar::Header::new_ustar();
        file.set_path("short.cls").expect("path");
        file.set_size(9);
        file.set_cksum();
        builder.append(&file, &b"abc"[..]).expect("file");
        // A GNU sparse member with one extension block after its header.
        let mut sparse = tar::Header::new_gnu();
        sparse.set_path("s.bin").expect("path");
        sparse.set_entry_type(tar::EntryType::GNUSparse);
        sparse.set_size(512);
        if let Some(gnu) = sparse.as_gnu_mut() {
            gnu.isextended[0] = 1;
        }
        sparse.set_cksum();
        let mut sparse_bytes = sparse.as_bytes().to_vec();
        sparse_bytes.extend_from_slice(&[0; 512]); // extension block, the last
        sparse_bytes.extend_from_slice(&[5; 512]); // data
        let tail = builder.into_inner().expect("finish");
        // `builder.append` of 9 declared bytes wrote only 3 and padded to 512: the PAX
        // size of 3 is what makes this stream line up.
        let (pax_part, end) = tail.split_at(tail.len() - 1024);
        bytes.extend_from_slice(pax_part);
        bytes.extend_from_slice(&sparse_bytes);
        bytes.extend_from_slice(&tar_of(&[(b'0', b"after.txt", b"z")]));
        let _ = end;
        let got = walk(Plain(bytes.as_slice())).expect("valid");
        let shape: Vec<(String, usize)> = got
            .iter()
            .map(|(name, _, _, data)| (String::from_utf8_lossy(name).into_owned(), data.len()))
            .collect();
        assert_eq!(
            shape,
            [
                (long.clone(), 4),
                ("pax/name.cls".to_string(), 3),
                ("s.bin".to_string(), 0),
                ("after.txt".to_string(), 1),
            ]
        );
        assert_eq!(got[1].3, b"abc");
    }

    #[test]
    fn truncated_and_bad_streams_fail_at_their_offsets() {
        let big = filled(3 * WALK_BUFFER + 100, 1);
        let whole = tar_of(&[(b'0', b"a.bin", b"xy"), (b'0', b"b.bin", &big)]);
        let long = format!("{}.jpg", "n".repeat(120));
        let long_tar = tar_of(&[(b'0', long.as_bytes(), b"1")]);
        let big_at = 1024 + 512;
        let cut = |len: usize| whole[..len].to_vec();
        let mut bad_sum = whole.clone();
        bad_sum[1024 + 3] ^= 1;
        let mut bad_size = whole.clone();
        bad_size[1024 + 124..1024 + 136].copy_from_slice(b"12345678z01\0");
        reseal(&mut bad_size[1024..1024 + 512]);
        let cases: &[(&str, Vec<u8>, u64, &str)] = &[
            ("cut in a header", cut(1024 + 100), 1024, "truncated header"),
            (
                "cut in buffered data",
                cut(big_at + 100),
                big_at as u64 + 100,
                "truncated data",
            ),
            (
                "cut in data read directly",
                cut(big_at + 2 * WALK_BUFFER + 9),
                (big_at + 2 * WALK_BUFFER + 9) as u64,
                "truncated data",
            ),
            (
                "cut in padding",
                cut(big_at + big.len() + 3),
                (big_at + big.len()) as u64,
                "bytes before the next header",
            ),
            (
                "cut in a long name",
                long_tar[..600].to_vec(),
                0,
                "truncated extension",
            ),
            (
                "cut in a long name's padding",
                long_tar[..700].to_vec(),
                0,
                "before the next header",
            ),
            ("bad checksum", bad_sum, 1024, "checksum mismatch"),
            ("bad size", bad_size, 1024, "the size field `12345678z01`"),
            (
                "a long name and nothing after",
                long_tar[..1024].to_vec(),
                1024,
                "no future member",
            ),
        ];
        for (name, bytes, at, reason) in cases {
            for chunk in [usize::MAX, 1000] {
                for stream in [Trickle::new(bytes, chunk), Trickle::spare(bytes, chunk)] {
                    let spare = stream.spare;
                    let error = walk(stream).expect_err(name);
                    assert_eq!(
                        error.0, *at,
                        "{name}, chunk {chunk}, spare {spare}: {error:?}"
                    );
                    assert!(
                        error.1.contains(reason),
                        "{name}: {error:?} lacks `{reason}`"
                    );
                }
            }
        }
    }

    #[test]
    fn damaged_tars_give_members_or_an_error_never_a_panic() {
        use rand::{Rng, SeedableRng};
        let long = format!("{}.jpg", "k".repeat(130));
        let big = filled(40_000, 9);
        let base = tar_of(&[
            (b'0', long.as_bytes(), b"x"),
            (b'0', b"a.jpg", &big),
            (b'5', b"d", b""),
            (b'0', b"a.cls", b"7"),
        ]);
        let headers = [0, 1024, 1536, 1536 + 40_448, 1536 + 40_448 + 512];
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(19);
        for round in 0..2000 {
            let mut bytes = base.clone();
            let header = headers[rng.random_range(0..headers.len())];
            match round % 3 {
                0 => {
                    let at = header + rng.random_range(0..BLOCK);
                    bytes[at] = rng.random();
                    if rng.random_bool(0.5) {
                        reseal(&mut bytes[header..header + BLOCK]);
                    }
                }
                1 => bytes.truncate(rng.random_range(0..base.len())),
                _ => {
                    // Any size, in octal or base-256.
                    let field = &mut bytes[header + 124..header + 136];
                    rng.fill(field);
                    reseal(&mut bytes[header..header + BLOCK]);
                }
            }
            for chunk in [usize::MAX, 777] {
                for stream in [Trickle::new(&bytes, chunk), Trickle::spare(&bytes, chunk)] {
                    if let Err((at, error)) = walk(stream) {
                        assert!(at <= bytes.len() as u64, "round {round}: {error} at {at}");
                    }
                }
            }
        }
    }
}
