//! [`RingGroup`]: chunked ring allreduce, weighted mean, broadcast and barrier over a [`Link`].

use std::io;
use std::net::SocketAddr;
use std::ops::Range;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use super::link::Link;
use super::{CollectiveError, CollectiveOptions, MAX_INLINE_BYTES, Op, RingSecret};

/// This rank's member of a ring of `world` ranks; operations must be called in the same
/// order with the same sizes on every rank.
#[derive(Debug)]
pub struct RingGroup {
    rank: usize,
    world: usize,
    /// `None` for a world of one, where every operation is local.
    link: Option<Link>,
    options: CollectiveOptions,
    seq: u64,
    poisoned: bool,
    send_bytes: Vec<u8>,
    recv_values: Vec<f32>,
    weighted: Vec<f32>,
    /// Each rank's message of the last header round, by rank: its header's bytes as
    /// [`HEADER_WORDS`] words, then the values it carried inline (wire order).
    messages: Vec<Vec<f32>>,
}

type Result<T> = std::result::Result<T, CollectiveError>;

impl RingGroup {
    /// A whole ring of `world` ranks in this process over in-memory links, by rank.
    pub fn in_memory(world: usize, options: CollectiveOptions) -> Vec<RingGroup> {
        let links = if world > 1 {
            Link::memory_ring(world).into_iter().map(Some).collect()
        } else {
            (0..world).map(|_| None).collect::<Vec<_>>()
        };
        links
            .into_iter()
            .enumerate()
            .map(|(rank, link)| Self::new(rank, world, link, options.clone()))
            .collect()
    }

    /// Joins the TCP ring: accepts the previous rank on `listener` and connects to the
    /// next rank at `next_addr`, retrying until `options.connect_timeout`. Both ends prove
    /// knowledge of `secret` for the ring `ring_id` (the same on every member; the
    /// handshake refuses a peer of another ring); a peer that fails is dropped and
    /// logged, and if no good peer arrives in time the error names the last one that
    /// failed.
    pub async fn connect(
        rank: usize,
        world: usize,
        listener: TcpListener,
        next_addr: SocketAddr,
        secret: &RingSecret,
        ring_id: &str,
        options: CollectiveOptions,
    ) -> Result<RingGroup> {
        if rank >= world {
            return Err(CollectiveError::InvalidArgument {
                rank,
                what: format!("rank {rank} is not below world size {world}"),
            });
        }
        let link = if world > 1 {
            let (timeout, local) = (options.connect_timeout, options.local_sockets);
            Some(
                Link::tcp(
                    rank, world, listener, next_addr, secret, ring_id, timeout, local,
                )
                .await?,
            )
        } else {
            None
        };
        Ok(Self::new(rank, world, link, options))
    }

    fn new(rank: usize, world: usize, link: Option<Link>, options: CollectiveOptions) -> Self {
        Self {
            rank,
            world,
            link,
            options,
            seq: 0,
            poisoned: false,
            send_bytes: Vec::new(),
            recv_values: Vec::new(),
            weighted: Vec::new(),
            messages: Vec::new(),
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// This rank's link to its neighbours; `None` in a world of one.
    pub fn link(&self) -> Option<&Link> {
        self.link.as_ref()
    }

    /// Replaces `buffer` on every rank with the element-wise sum over all ranks.
    pub async fn allreduce_sum(&mut self, buffer: &mut [f32]) -> Result<()> {
        let header = self.begin(Op::AllreduceSum, buffer.len(), 0)?;
        let limit = self.options.op_timeout;
        let result = tokio::time::timeout(limit, self.allreduce(header, buffer)).await;
        self.finish(result, "allreduce")
    }

    /// Replaces `buffer` with `sum(buffer_r * weight_r) / sum(weight_r)` over ranks `r`,
    /// or with zeros when the total weight is 0, and returns the total weight. A rank out
    /// of data joins with weight 0 (its buffer is ignored).
    pub async fn allreduce_mean_weighted(
        &mut self,
        buffer: &mut [f32],
        weight: f32,
    ) -> Result<f32> {
        if !(weight.is_finite() && weight >= 0.0) {
            return Err(CollectiveError::InvalidArgument {
                rank: self.rank,
                what: format!("weight {weight} is not a finite number >= 0"),
            });
        }
        let header = self.begin(Op::WeightedMean, buffer.len(), 0)?;
        let mut scaled = std::mem::take(&mut self.weighted);
        scaled.clear();
        if weight > 0.0 {
            scaled.extend(buffer.iter().map(|x| x * weight));
        } else {
            // Ignored means ignored: NaN or infinity times 0 would poison every rank.
            scaled.resize(buffer.len(), 0.0);
        }
        scaled.push(weight);
        let limit = self.options.op_timeout;
        let result = tokio::time::timeout(limit, self.allreduce(header, &mut scaled)).await;
        let outcome = self.finish(result, "weighted mean");
        if outcome.is_ok() {
            let (sums, total) = scaled.split_at(buffer.len());
            let total = total[0];
            if total > 0.0 {
                for (x, sum) in buffer.iter_mut().zip(sums) {
                    *x = sum / total;
                }
            } else {
                buffer.fill(0.0);
            }
        }
        let total = scaled.last().copied().unwrap_or(0.0);
        self.weighted = scaled;
        outcome.map(|()| total)
    }

    /// Copies `root`'s `buffer` into `buffer` on every rank.
    pub async fn broadcast(&mut self, buffer: &mut [f32], root: usize) -> Result<()> {
        if root >= self.world {
            return Err(CollectiveError::InvalidArgument {
                rank: self.rank,
                what: format!(
                    "broadcast root {root} is not below world size {}",
                    self.world
                ),
            });
        }
        let header = self.begin(Op::Broadcast, buffer.len(), root)?;
        let limit = self.options.op_timeout;
        let result = tokio::time::timeout(limit, self.broadcast_inner(header, buffer, root)).await;
        self.finish(result, "broadcast")
    }

    /// Returns once every rank has entered the barrier.
    pub async fn barrier(&mut self) -> Result<()> {
        let header = self.begin(Op::Barrier, 0, 0)?;
        let limit = self.options.op_timeout;
        let result = tokio::time::timeout(limit, self.circulate(header, &[])).await;
        self.finish(result, "barrier")
    }

    fn begin(&mut self, op: Op, len: usize, root: usize) -> Result<Header> {
        if self.poisoned {
            return Err(CollectiveError::Poisoned { rank: self.rank });
        }
        self.seq += 1;
        Ok(Header {
            op: op.code(),
            root: root as u32,
            seq: self.seq,
            len: len as u64,
            inline: 0,
            block: 0,
        })
    }

    fn finish(
        &mut self,
        result: std::result::Result<Result<()>, tokio::time::error::Elapsed>,
        what: &'static str,
    ) -> Result<()> {
        let result = match result {
            Ok(result) => result,
            Err(_) => Err(CollectiveError::Timeout {
                rank: self.rank,
                what,
                after: self.options.op_timeout,
            }),
        };
        if result.is_err() {
            // The peers' positions in the byte streams are unknown now.
            self.poisoned = true;
        }
        result
    }

    async fn allreduce(&mut self, mut header: Header, buffer: &mut [f32]) -> Result<()> {
        if self.world == 1 {
            return Ok(());
        }
        if self.inlined(buffer.len()) {
            return self.allreduce_inline(header, buffer).await;
        }
        let block = self.block_elems();
        header.block = block as u64;
        self.circulate(header, &[]).await?;
        // A block's reduce-scatter and allgather run back to back while its values are
        // still in cache, instead of each pass streaming the whole buffer from memory.
        for part in buffer.chunks_mut(block) {
            self.ring_pass(part).await?;
        }
        Ok(())
    }

    /// Reduce-scatter then allgather of `buffer` around the ring.
    async fn ring_pass(&mut self, buffer: &mut [f32]) -> Result<()> {
        let (n, r) = (self.world, self.rank);
        let len = buffer.len();
        // Reduce-scatter: after step s, segment r - s - 1 holds s + 2 ranks' values; at
        // the end rank r holds the full sum of segment r + 1.
        for step in 0..n - 1 {
            let send = segment(len, n, (r + n - step) % n);
            let recv = segment(len, n, (r + 2 * n - step - 1) % n);
            self.step(buffer, send, recv, Apply::Add).await?;
        }
        // Allgather: pass the summed segments on around the ring.
        for step in 0..n - 1 {
            let send = segment(len, n, (r + 1 + n - step) % n);
            let recv = segment(len, n, (r + n - step) % n);
            self.step(buffer, send, recv, Apply::Copy).await?;
        }
        Ok(())
    }

    /// Sends `buffer[send]` to the next rank while receiving `buffer[recv]` from the
    /// previous one. Sending and receiving are two futures polled together, so the sender
    /// streams ahead (as far as the socket buffers allow) while the receiver adds what
    /// arrived, instead of both waiting for each other.
    ///
    /// The sender hands the kernel the whole segment at once (each `write` takes what the
    /// socket buffer has room for). The receiver adds values as soon as they arrive, from
    /// a scratch buffer of at most one chunk that stays in cache, with a loop the compiler
    /// vectorises; a copy step reads straight into `buffer`.
    async fn step(
        &mut self,
        buffer: &mut [f32],
        send: Range<usize>,
        recv: Range<usize>,
        apply: Apply,
    ) -> Result<()> {
        let chunk = self.chunk_elems();
        let Self {
            rank,
            link,
            send_bytes,
            recv_values,
            ..
        } = self;
        let rank = *rank;
        let Link {
            next, prev, tx, rx, ..
        } = link_of(rank, link)?;
        let (next, prev) = (*next, *prev);
        let (outgoing, incoming) = split_disjoint(rank, buffer, &send, &recv)?;
        let sending = async {
            // Chunks only matter where values need encoding (big-endian machines).
            let parts = if cfg!(target_endian = "little") {
                outgoing.len().max(1)
            } else {
                chunk
            };
            for part in outgoing.chunks(parts) {
                tx.write_all(wire_bytes(part, send_bytes))
                    .await
                    .map_err(|e| io_error(rank, next, "allreduce", e))?;
            }
            Ok::<_, CollectiveError>(())
        };
        let receiving = async {
            match apply {
                Apply::Add => add_incoming(rx, incoming, chunk, recv_values).await,
                Apply::Copy => read_values(rx, incoming, recv_values).await,
            }
            .map_err(|e| io_error(rank, prev, "allreduce", e))
        };
        tokio::try_join!(sending, receiving)?;
        Ok(())
    }

    async fn broadcast_inner(
        &mut self,
        header: Header,
        buffer: &mut [f32],
        root: usize,
    ) -> Result<()> {
        if self.world == 1 {
            return Ok(());
        }
        self.circulate(header, &[]).await?;
        let chunk = self.chunk_elems();
        let forward = (self.rank + 1) % self.world != root;
        let whole = 0..buffer.len();
        for k in 0..buffer.len().div_ceil(chunk) {
            let part = clamp(&whole, k * chunk, chunk);
            let Self {
                rank,
                link,
                send_bytes,
                recv_values,
                ..
            } = self;
            let link = link_of(*rank, link)?;
            if *rank != root {
                read_values(&mut link.rx, &mut buffer[part.clone()], recv_values)
                    .await
                    .map_err(|e| io_error(*rank, link.prev, "broadcast", e))?;
            }
            if forward {
                link.tx
                    .write_all(wire_bytes(&buffer[part.clone()], send_bytes))
                    .await
                    .map_err(|e| io_error(*rank, link.next, "broadcast", e))?;
            }
        }
        Ok(())
    }

    /// Whether an allreduce of `len` values goes inline with the header round.
    fn inlined(&self, len: usize) -> bool {
        let limit = self.options.inline_bytes.min(MAX_INLINE_BYTES);
        len.saturating_mul(4).saturating_mul(self.world - 1) <= limit
            && len.saturating_mul(4) <= MAX_INLINE_BYTES
    }

    /// Allreduce of a small buffer: every rank's values go once around the ring with its
    /// header, then every rank sums all of them in rank order (so all get the same bits).
    async fn allreduce_inline(&mut self, mut header: Header, buffer: &mut [f32]) -> Result<()> {
        header.inline = buffer.len() as u64 * 4;
        self.circulate(header, buffer).await?;
        let rank = self.rank;
        let carried = self.messages.iter().map(|m| &m[HEADER_WORDS..]);
        for (k, values) in carried.enumerate() {
            if values.len() != buffer.len() {
                // Equal headers announce equal lengths, and each message was read to its
                // header's length; this guards that reasoning, not the peers.
                return Err(CollectiveError::Mismatch {
                    rank,
                    detail: format!(
                        "rank {k} carried {} values, this rank {}",
                        values.len(),
                        buffer.len()
                    ),
                });
            }
        }
        let mut messages = self.messages.iter_mut().map(|m| &mut m[HEADER_WORDS..]);
        if let Some(first) = messages.next() {
            from_wire(first);
            buffer.copy_from_slice(first);
        }
        for values in messages {
            from_wire(values);
            add(buffer, values);
        }
        Ok(())
    }

    /// Passes every rank's message (its header, then the `values` it carries inline,
    /// none outside [`Self::allreduce_inline`]) once around the ring, which makes it a
    /// barrier too, and fails on every rank if any two headers disagree. Afterwards
    /// `self.messages[k]` holds rank k's message. Each message says how long it is, so
    /// ranks that disagree still read and forward whole messages: every rank finishes
    /// the round and fails, none waits for bytes that never come.
    async fn circulate(&mut self, ours: Header, values: &[f32]) -> Result<()> {
        let (n, rank) = (self.world, self.rank);
        if n == 1 {
            return Ok(());
        }
        self.messages.resize_with(n, Vec::new);
        let own = &mut self.messages[rank];
        own.resize(HEADER_WORDS + values.len(), 0.0);
        let (head, own_values) = own.split_at_mut(HEADER_WORDS);
        bytemuck::cast_slice_mut(head).copy_from_slice(&ours.encode());
        own_values.copy_from_slice(values);
        to_wire(own_values);
        let mut first_mismatch = None;
        for step in 0..n - 1 {
            let (send_from, recv_from) = ((rank + n - step) % n, (rank + 2 * n - step - 1) % n);
            let mut incoming = std::mem::take(&mut self.messages[recv_from]);
            let outgoing = &self.messages[send_from];
            let link = link_of(rank, &mut self.link)?;
            let (next, prev) = (link.next, link.prev);
            let Link { tx, rx, .. } = link;
            let result = tokio::try_join!(
                async {
                    tx.write_all(bytemuck::cast_slice(outgoing.as_slice()))
                        .await
                        .map_err(|e| io_error(rank, next, "header exchange", e))
                },
                read_message(rank, prev, rx, &mut incoming),
            );
            self.messages[recv_from] = incoming;
            let ((), theirs) = result?;
            if theirs != ours && first_mismatch.is_none() {
                first_mismatch = Some((recv_from, theirs));
            }
        }
        match first_mismatch {
            None => Ok(()),
            Some((from, theirs)) => Err(CollectiveError::Mismatch {
                rank,
                detail: format!(
                    "rank {from} runs {}, this rank runs {}",
                    theirs.describe(),
                    ours.describe()
                ),
            }),
        }
    }

    /// Values per block of a ring allreduce (a whole buffer when blocks are off).
    fn block_elems(&self) -> usize {
        match self.options.block_bytes / 4 {
            0 => usize::MAX,
            block => block,
        }
    }

    fn chunk_elems(&self) -> usize {
        (self.options.chunk_bytes / 4).max(1)
    }
}

#[derive(Clone, Copy)]
enum Apply {
    Add,
    Copy,
}

/// What every rank announces before an operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Header {
    op: u32,
    root: u32,
    seq: u64,
    len: u64,
    /// Bytes of values that follow the header on the wire.
    inline: u64,
    /// Values per block of a ring allreduce (0 for other operations).
    block: u64,
}

/// A header's length in `f32` words (messages are stored as words, so the values after
/// it can be viewed as `f32`s in place).
const HEADER_WORDS: usize = Header::BYTES / 4;

impl Header {
    const BYTES: usize = 40;

    fn encode(&self) -> [u8; Self::BYTES] {
        let mut bytes = [0u8; Self::BYTES];
        bytes[0..4].copy_from_slice(&self.op.to_le_bytes());
        bytes[4..8].copy_from_slice(&self.root.to_le_bytes());
        bytes[8..16].copy_from_slice(&self.seq.to_le_bytes());
        bytes[16..24].copy_from_slice(&self.len.to_le_bytes());
        bytes[24..32].copy_from_slice(&self.inline.to_le_bytes());
        bytes[32..40].copy_from_slice(&self.block.to_le_bytes());
        bytes
    }

    fn decode(bytes: &[u8; Self::BYTES]) -> Self {
        let u32_at =
            |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
        let u64_at = |i: usize| u64::from(u32_at(i)) | (u64::from(u32_at(i + 4)) << 32);
        Self {
            op: u32_at(0),
            root: u32_at(4),
            seq: u64_at(8),
            len: u64_at(16),
            inline: u64_at(24),
            block: u64_at(32),
        }
    }

    fn describe(&self) -> String {
        let op = match Op::from_code(self.op) {
            Some(Op::Broadcast) => format!("broadcast from rank {}", self.root),
            Some(op) => format!("{op:?}"),
            None => format!("unknown operation {}", self.op),
        };
        let path = match (self.inline, self.block) {
            (0, 0) => String::new(),
            (0, block) => format!(" (ring, blocks of {block})"),
            _ => " (inline)".to_string(),
        };
        format!("{op} #{} of {} elements{path}", self.seq, self.len)
    }
}

/// Segment `i` of `n` near-equal parts of `0..len` (the first `len % n` one longer).
fn segment(len: usize, n: usize, i: usize) -> Range<usize> {
    let (base, extra) = (len / n, len % n);
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

/// Chunk of `range` starting `offset` into it, at most `chunk` long (empty past its end).
fn clamp(range: &Range<usize>, offset: usize, chunk: usize) -> Range<usize> {
    let start = (range.start + offset).min(range.end);
    start..(start + chunk).min(range.end)
}

/// `buffer[send]` to read and `buffer[recv]` to write; one step's two segments never
/// overlap (they are different segments of the ring).
fn split_disjoint<'a>(
    rank: usize,
    buffer: &'a mut [f32],
    send: &Range<usize>,
    recv: &Range<usize>,
) -> Result<(&'a [f32], &'a mut [f32])> {
    if send.end <= recv.start {
        let (left, right) = buffer.split_at_mut(recv.start);
        Ok((&left[send.clone()], &mut right[..recv.len()]))
    } else if recv.end <= send.start {
        let (left, right) = buffer.split_at_mut(send.start);
        Ok((&right[..send.len()], &mut left[recv.clone()]))
    } else {
        Err(CollectiveError::InvalidArgument {
            rank,
            what: format!("segments {send:?} and {recv:?} overlap"),
        })
    }
}

/// Little-endian bytes of `values`; written element by element into a sized buffer,
/// which compiles to a plain copy (an `extend` over bytes does not).
fn encode(values: &[f32], bytes: &mut Vec<u8>) {
    bytes.resize(values.len() * 4, 0);
    for (out, v) in bytes.chunks_exact_mut(4).zip(values) {
        out.copy_from_slice(&v.to_le_bytes());
    }
}

/// `values` as they go on the wire (little-endian): on a little-endian machine the
/// values' own memory, with no copy; elsewhere encoded into `scratch`.
fn wire_bytes<'a>(values: &'a [f32], scratch: &'a mut Vec<u8>) -> &'a [u8] {
    if cfg!(target_endian = "little") {
        bytemuck::cast_slice(values)
    } else {
        encode(values, scratch);
        scratch
    }
}

/// Reads `values.len()` wire values into `values`: straight into their memory on a
/// little-endian machine, through `scratch` elsewhere.
async fn read_values<R: AsyncRead + Unpin>(
    rx: &mut R,
    values: &mut [f32],
    scratch: &mut Vec<f32>,
) -> io::Result<()> {
    if cfg!(target_endian = "little") {
        rx.read_exact(bytemuck::cast_slice_mut(values)).await?;
    } else {
        scratch.clear();
        scratch.resize(values.len(), 0.0);
        rx.read_exact(bytemuck::cast_slice_mut(scratch.as_mut_slice()))
            .await?;
        values.copy_from_slice(scratch);
        from_wire(values);
    }
    Ok(())
}

/// Adds `values.len()` wire values from `rx` into `values` as they arrive, through
/// `scratch` (grown to at most `chunk` values), so each value is added while the bytes
/// the kernel just copied are still in cache.
async fn add_incoming<R: AsyncRead + Unpin>(
    rx: &mut R,
    values: &mut [f32],
    chunk: usize,
    scratch: &mut Vec<f32>,
) -> io::Result<()> {
    let longest = chunk.min(values.len());
    if scratch.len() < longest {
        scratch.resize(longest, 0.0);
    }
    for part in values.chunks_mut(chunk) {
        let wire = &mut scratch[..part.len()];
        let want = part.len() * 4;
        let (mut filled, mut added) = (0, 0);
        while filled < want {
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut *wire);
            let n = rx.read(&mut bytes[filled..want]).await?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            filled += n;
            let whole = filled / 4;
            from_wire(&mut wire[added..whole]);
            add(&mut part[added..whole], &wire[added..whole]);
            added = whole;
        }
    }
    Ok(())
}

/// `values += wire`, element by element (a loop the compiler vectorises).
fn add(values: &mut [f32], wire: &[f32]) {
    for (x, w) in values.iter_mut().zip(wire) {
        *x += w;
    }
}

/// Turns native values into their little-endian wire form (nothing to do on a
/// little-endian machine).
fn to_wire(values: &mut [f32]) {
    if cfg!(target_endian = "big") {
        for x in values {
            *x = f32::from_bits(x.to_bits().to_le());
        }
    }
}

/// Turns values read as little-endian wire bytes into native ones (nothing to do on a
/// little-endian machine).
fn from_wire(values: &mut [f32]) {
    if cfg!(target_endian = "big") {
        for x in values {
            *x = f32::from_bits(u32::from_le(x.to_bits()));
        }
    }
}

fn link_of(rank: usize, link: &mut Option<Link>) -> Result<&mut Link> {
    link.as_mut()
        .ok_or_else(|| CollectiveError::InvalidArgument {
            rank,
            what: "a world of one has no link".into(),
        })
}

/// Reads one header-round message from the previous rank into `into` (header words,
/// then its inline values) and returns its header. A header that announces more than
/// [`MAX_INLINE_BYTES`], or bytes that are not whole values, is refused before anything
/// is allocated for it.
async fn read_message<R: AsyncRead + Unpin>(
    rank: usize,
    prev: usize,
    rx: &mut R,
    into: &mut Vec<f32>,
) -> Result<Header> {
    let what = "header exchange";
    let mut head = [0u8; Header::BYTES];
    rx.read_exact(&mut head)
        .await
        .map_err(|e| io_error(rank, prev, what, e))?;
    let header = Header::decode(&head);
    let inline = usize::try_from(header.inline)
        .ok()
        .filter(|&n| n <= MAX_INLINE_BYTES && n % 4 == 0)
        .ok_or_else(|| CollectiveError::Mismatch {
            rank,
            detail: format!(
                "rank {prev} announced {} inline bytes (at most {MAX_INLINE_BYTES}, whole values)",
                header.inline
            ),
        })?;
    into.resize(HEADER_WORDS + inline / 4, 0.0);
    let (words, values) = into.split_at_mut(HEADER_WORDS);
    bytemuck::cast_slice_mut(words).copy_from_slice(&head);
    rx.read_exact(bytemuck::cast_slice_mut(values))
        .await
        .map_err(|e| io_error(rank, prev, what, e))?;
    Ok(header)
}

fn io_error(rank: usize, peer: usize, what: &'static str, source: io::Error) -> CollectiveError {
    match source.kind() {
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted => CollectiveError::PeerClosed { rank, peer, what },
        _ => CollectiveError::Io {
            rank,
            peer,
            what,
            source,
        },
    }
}

#[cfg(test)]
mod tests {
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use tokio::io::ReadBuf;

    use super::*;

    /// Hands out its bytes 1 to 7 at a time, so values are split across reads.
    struct Trickle {
        bytes: Vec<u8>,
        at: usize,
        step: usize,
    }

    impl AsyncRead for Trickle {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            let this = &mut *self;
            let n = this
                .step
                .min(buf.remaining())
                .min(this.bytes.len() - this.at);
            buf.put_slice(&this.bytes[this.at..this.at + n]);
            this.at += n;
            this.step = this.step % 7 + 1;
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn add_incoming_adds_values_split_across_reads() {
        for len in [0usize, 1, 2, 5, 17, 100] {
            for chunk in [1, 3, 64] {
                let wire: Vec<u8> = (0..len)
                    .flat_map(|i| (10.0 * i as f32).to_le_bytes())
                    .collect();
                let mut values: Vec<f32> = (0..len).map(|i| i as f32).collect();
                let mut scratch = vec![0.5; 2];
                let mut rx = Trickle {
                    bytes: wire.clone(),
                    at: 0,
                    step: 1,
                };
                add_incoming(&mut rx, &mut values, chunk, &mut scratch)
                    .await
                    .expect("whole stream");
                let want: Vec<f32> = (0..len).map(|i| 11.0 * i as f32).collect();
                assert_eq!(values, want, "len {len} chunk {chunk}");
                if len > 0 {
                    // One byte short: an error, not a hang or a partial value.
                    let mut rx = Trickle {
                        bytes: wire[..wire.len() - 1].to_vec(),
                        at: 0,
                        step: 3,
                    };
                    let err = add_incoming(&mut rx, &mut values, chunk, &mut scratch)
                        .await
                        .expect_err("truncated stream");
                    assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
                }
            }
        }
    }

    #[test]
    fn segments_tile_the_buffer() {
        for len in [0, 1, 2, 7, 8, 9, 100, 101] {
            for n in 1..=8 {
                let mut next = 0;
                for i in 0..n {
                    let s = segment(len, n, i);
                    assert_eq!(s.start, next, "len {len} n {n} i {i}");
                    assert!(s.len() == len / n || s.len() == len / n + 1);
                    next = s.end;
                }
                assert_eq!(next, len, "len {len} n {n}");
            }
        }
    }

    #[test]
    fn headers_round_trip() {
        let header = Header {
            op: Op::Broadcast.code(),
            root: 3,
            seq: u64::MAX - 1,
            len: 1 << 40,
            inline: 12,
            block: 7,
        };
        assert_eq!(Header::decode(&header.encode()), header);
        assert_eq!(
            header.describe(),
            format!(
                "broadcast from rank 3 #{} of {} elements (inline)",
                u64::MAX - 1,
                1u64 << 40
            )
        );
    }

    #[test]
    fn split_disjoint_finds_both_segments() {
        let mut buffer: Vec<f32> = (0..10).map(|i| i as f32).collect();
        for (send, recv) in [(0..3, 3..7), (5..10, 0..5), (4..4, 4..6), (2..2, 2..2)] {
            let (s, r) = split_disjoint(0, &mut buffer, &send, &recv).expect("disjoint");
            assert_eq!(s.len(), send.len());
            assert_eq!(r.len(), recv.len());
            assert_eq!(
                s.first().copied(),
                (!send.is_empty()).then_some(send.start as f32)
            );
            assert_eq!(
                r.first().copied(),
                (!recv.is_empty()).then_some(recv.start as f32)
            );
        }
        assert!(split_disjoint(0, &mut buffer, &(0..4), &(3..6)).is_err());
    }

    fn decode_one(bytes: &[u8]) -> f32 {
        f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
    }

    #[test]
    fn encode_is_little_endian() {
        let mut bytes = vec![9; 3];
        encode(&[1.0, -2.5], &mut bytes);
        assert_eq!(bytes.len(), 8);
        assert_eq!(decode_one(&bytes[0..4]), 1.0);
        assert_eq!(decode_one(&bytes[4..8]), -2.5);
        assert_eq!(bytes[0..4], 1.0f32.to_le_bytes());
    }

    #[test]
    fn clamp_stays_inside() {
        assert_eq!(clamp(&(10..15), 0, 4), 10..14);
        assert_eq!(clamp(&(10..15), 4, 4), 14..15);
        assert_eq!(clamp(&(10..15), 8, 4), 15..15);
    }
}
