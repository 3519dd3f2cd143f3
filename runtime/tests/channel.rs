//! The data channel on loopback: frames of every size byte-exact and in order, both
//! directions at once, refused handshakes on both ends (wrong secret, garbage, silence)
//! with the listener serving on, size limits, closes between and inside frames, read
//! timeouts, stopping a blocked accept or recv, and TCP's backpressure.

#[path = "common/log.rs"]
mod log_writer;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use log_writer::LogWriter;
use runtime::channel::{
    ChannelError, ChannelOptions, ChannelSecret, DataListener, DataStream, ListenerStopper,
};

/// Every test body finishes within this, or the test fails.
const LIMIT: Duration = Duration::from_secs(60);
/// Short, so that silent peers cost the tests little.
const HANDSHAKE: Duration = Duration::from_millis(300);
const MAX: usize = 256 << 20;

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn options() -> ChannelOptions {
    ChannelOptions {
        handshake_timeout: HANDSHAKE,
    }
}

/// Runs `body` on a thread of its own; fails if it errs, panics or runs past [`LIMIT`].
fn bounded<T: Send + 'static>(body: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    let (done, result) = mpsc::channel();
    thread::spawn(move || {
        let _ = done.send(body());
    });
    match result.recv_timeout(LIMIT) {
        Ok(result) => result,
        Err(mpsc::RecvTimeoutError::Timeout) => bail!("not done within {LIMIT:?}"),
        Err(mpsc::RecvTimeoutError::Disconnected) => bail!("the test body panicked"),
    }
}

fn connect(addr: SocketAddr, secret: &ChannelSecret) -> Result<DataStream, ChannelError> {
    DataStream::connect_with(addr, secret, Duration::from_secs(10), &options())
}

/// What the thread returned; an error if it panicked.
fn join<T>(thread: thread::JoinHandle<T>, what: &str) -> Result<T> {
    thread
        .join()
        .map_err(|_| anyhow::anyhow!("the {what} thread panicked"))
}

/// The error of a connection that must fail.
fn refused(addr: SocketAddr, secret: &ChannelSecret) -> Result<ChannelError> {
    match connect(addr, secret) {
        Ok(stream) => bail!("{addr} accepted us as {}", stream.local_addr()?),
        Err(error) => Ok(error),
    }
}

/// A listener accepting on a thread of its own until stopped, its warnings captured.
struct Served {
    addr: SocketAddr,
    accepted: mpsc::Receiver<DataStream>,
    stopper: ListenerStopper,
    logs: Arc<Mutex<Vec<u8>>>,
    thread: thread::JoinHandle<ChannelError>,
}

impl Served {
    fn start(secret: ChannelSecret) -> Result<Self> {
        let listener = DataListener::bind_with(loopback(), secret, options())?;
        let addr = listener.local_addr();
        let stopper = listener.stopper();
        let logs = Arc::new(Mutex::new(Vec::new()));
        let writer_logs = logs.clone();
        let (streams, accepted) = mpsc::channel();
        let thread = thread::spawn(move || {
            let subscriber = tracing_subscriber::fmt()
                .with_ansi(false)
                .with_writer(move || LogWriter(writer_logs.clone()))
                .finish();
            let _guard = tracing::subscriber::set_default(subscriber);
            loop {
                match listener.accept() {
                    Ok(stream) => {
                        if streams.send(stream).is_err() {
                            return ChannelError::Stopped { addr };
                        }
                    }
                    Err(error) => return error,
                }
            }
        });
        Ok(Self {
            addr,
            accepted,
            stopper,
            logs,
            thread,
        })
    }

    fn next(&self) -> Result<DataStream> {
        self.accepted
            .recv_timeout(LIMIT)
            .context("the listener accepted nothing")
    }

    fn logs(&self) -> String {
        String::from_utf8_lossy(&self.logs.lock().expect("log lock")).into_owned()
    }

    /// Waits until the listener logged `count` refusals; returns its log.
    fn refusals(&self, count: usize) -> Result<String> {
        let deadline = Instant::now() + LIMIT;
        loop {
            let logs = self.logs();
            if logs.matches("data channel handshake refused").count() >= count {
                return Ok(logs);
            }
            ensure!(
                Instant::now() < deadline,
                "fewer than {count} refusals in:\n{logs}"
            );
            thread::sleep(Duration::from_millis(10));
        }
    }

    fn stop(self) -> Result<ChannelError> {
        self.stopper.stop();
        join(self.thread, "listener")
    }
}

/// A connected pair on a fresh listener: (connector's end, acceptor's end).
fn pair() -> Result<(DataStream, DataStream)> {
    let secret = ChannelSecret::random();
    let listener = DataListener::bind_with(loopback(), secret.clone(), options())?;
    let addr = listener.local_addr();
    let connector = thread::spawn(move || connect(addr, &secret));
    let acceptor = listener.accept()?;
    let connector = join(connector, "connector")??;
    Ok((connector, acceptor))
}

/// Bytes that differ with `seed` and position, so a shifted or mixed frame shows.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| (i.wrapping_mul(31) ^ seed.wrapping_mul(0x9e37_79b9)) as u8)
        .collect()
}

#[test]
fn frames_of_every_size_arrive_byte_exact_in_order() -> Result<()> {
    bounded(|| {
        let (mut tx, mut rx) = pair()?;
        let sizes = [0, 1, 7, 8, 9, 65_535, 65_536, 65_537, (5 << 20) + 3];
        let frames: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(seed, &len)| pattern(seed as u64, len))
            .collect();
        let expected = frames.clone();
        let sender = thread::spawn(move || -> Result<()> {
            for frame in &frames {
                // The same frame cut into parts, empty ones included.
                let third = frame.len() / 3;
                let (a, rest) = frame.split_at(third);
                let (b, c) = rest.split_at(third);
                tx.send(&[a, b])?;
                tx.send(&[])?;
                tx.send(&[&[], a, &[], b, c])?;
            }
            // Many small frames in a row, each naming its number.
            for i in 0u32..5_000 {
                tx.send(&[&i.to_le_bytes(), &pattern(u64::from(i), i as usize % 100)])?;
            }
            Ok(())
        });
        let mut buf = Vec::new();
        for (seed, frame) in expected.iter().enumerate() {
            let third = frame.len() / 3;
            for (what, want) in [
                ("first two parts", &frame[..2 * third]),
                ("empty frame", &[][..]),
                ("whole frame", &frame[..]),
            ] {
                ensure!(rx.recv(&mut buf, MAX)?, "stream ended before frame {seed}");
                ensure!(
                    buf == want,
                    "frame {seed} ({what}, {} bytes) came back as {} different bytes",
                    want.len(),
                    buf.len()
                );
            }
        }
        for i in 0u32..5_000 {
            ensure!(
                rx.recv(&mut buf, MAX)?,
                "stream ended before small frame {i}"
            );
            ensure!(buf[..4] == i.to_le_bytes(), "small frame {i} out of order");
            ensure!(buf[4..] == pattern(u64::from(i), i as usize % 100)[..]);
        }
        join(sender, "sender")??;
        ensure!(!rx.recv(&mut buf, MAX)?, "a frame after the last one");
        Ok(())
    })
}

#[test]
fn both_directions_flow_at_once_on_cloned_streams() -> Result<()> {
    bounded(|| {
        let (left, right) = pair()?;
        // Each end sends more than the sockets buffer while the other sends too, so this
        // finishes only if both directions really flow at once.
        const FRAMES: u64 = 24;
        const LEN: usize = 4 << 20;
        let run = |stream: DataStream, seed: u64| -> Result<thread::JoinHandle<Result<()>>> {
            let mut reader = stream.try_clone()?;
            let mut writer = stream;
            let sender = thread::spawn(move || -> Result<()> {
                for i in 0..FRAMES {
                    writer.send(&[&pattern(seed + i, LEN)])?;
                }
                Ok(())
            });
            Ok(thread::spawn(move || -> Result<()> {
                let mut buf = Vec::new();
                for i in 0..FRAMES {
                    ensure!(reader.recv(&mut buf, MAX)?, "ended before frame {i}");
                    ensure!(
                        buf == pattern((1 - seed / 100) * 100 + i, LEN),
                        "frame {i} differs"
                    );
                }
                join(sender, "sender")?
            }))
        };
        let a = run(left, 0)?;
        let b = run(right, 100)?;
        for side in [a, b] {
            join(side, "side")??;
        }
        Ok(())
    })
}

#[test]
fn a_wrong_secret_is_refused_on_both_ends_and_the_listener_serves_on() -> Result<()> {
    bounded(|| {
        let secret = ChannelSecret::random();
        let served = Served::start(secret.clone())?;
        let addr = served.addr;

        // A connector with another secret: it finds the listener cannot prove its secret.
        let error = refused(addr, &ChannelSecret::random())?;
        let message = error.to_string();
        ensure!(
            matches!(error, ChannelError::Handshake { peer, .. } if peer == addr)
                && message.contains(&addr.to_string())
                && message.contains("wrong secret"),
            "{message}"
        );
        // The listener saw it give up.
        let logs = served.refusals(1)?;
        ensure!(logs.contains("wrong secret"), "{logs}");

        // A good peer is still served, and its stream works.
        let mut good = connect(addr, &secret)?;
        let mut accepted = served.next()?;
        ensure!(accepted.peer() == good.local_addr()?);
        good.send(&[b"after the refusal"])?;
        let mut buf = Vec::new();
        ensure!(accepted.recv(&mut buf, 100)? && buf == b"after the refusal");

        // A listener with another secret than the connector's: refused the same way.
        let other = Served::start(ChannelSecret::random())?;
        let error = refused(other.addr, &secret)?;
        ensure!(
            error.to_string().contains("did not prove knowledge"),
            "{error}"
        );
        other.stop()?;

        ensure!(matches!(served.stop()?, ChannelError::Stopped { .. }));
        Ok(())
    })
}

#[test]
fn garbage_and_silent_peers_cost_the_listener_one_handshake_timeout() -> Result<()> {
    bounded(|| {
        let secret = ChannelSecret::random();
        let served = Served::start(secret.clone())?;
        let addr = served.addr;

        // Garbage: refused at the magic, and its connection closed.
        let mut garbage = TcpStream::connect(addr)?;
        garbage.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")?;
        let mut rest = Vec::new();
        let _ = garbage.read_to_end(&mut rest);
        ensure!(
            rest.is_empty(),
            "the listener answered garbage with {rest:?}"
        );
        let logs = served.refusals(1)?;
        ensure!(logs.contains("not an imgrun data channel peer"), "{logs}");

        // The right magic with another version.
        let mut future = TcpStream::connect(addr)?;
        future.write_all(b"IMGDATA\x02")?;
        let _ = future.read_to_end(&mut rest);
        let logs = served.refusals(2)?;
        ensure!(logs.contains("speaks data channel version 2"), "{logs}");

        // A silent peer, kept open: the listener gives up on it after its timeout.
        let silent = TcpStream::connect(addr)?;
        let logs = served.refusals(3)?;
        ensure!(logs.contains("timed out"), "{logs}");
        ensure!(logs.contains(&silent.local_addr()?.to_string()), "{logs}");

        // A peer that leaves half-way through its hello.
        let mut quitter = TcpStream::connect(addr)?;
        quitter.write_all(b"IMGDATA\x01 half a nonce")?;
        drop(quitter);
        let logs = served.refusals(4)?;
        ensure!(logs.contains("closed by the peer after"), "{logs}");

        // Then a good peer gets through.
        let mut good = connect(addr, &secret)?;
        let mut accepted = served.next()?;
        accepted.send(&[b"served"])?;
        let mut buf = Vec::new();
        ensure!(good.recv(&mut buf, 100)? && buf == b"served");
        drop(silent);
        served.stop()?;
        Ok(())
    })
}

#[test]
fn a_connector_refuses_a_listener_that_is_not_a_data_channel() -> Result<()> {
    bounded(|| {
        let impostor = TcpListener::bind(loopback())?;
        let addr = impostor.local_addr()?;
        let server = thread::spawn(move || -> Result<()> {
            let (mut stream, _) = impostor.accept()?;
            let mut hello = [0u8; 40];
            stream.read_exact(&mut hello)?;
            stream.write_all(&[b'x'; 72])?;
            Ok(())
        });
        let error = refused(addr, &ChannelSecret::random())?;
        ensure!(
            error
                .to_string()
                .contains("not an imgrun data channel peer")
                && error.to_string().contains(&addr.to_string()),
            "{error}"
        );
        join(server, "impostor")??;
        Ok(())
    })
}

#[test]
fn connect_waits_for_a_late_listener_and_names_an_absent_one() -> Result<()> {
    bounded(|| {
        // A port that nothing listens on (freed just now).
        let addr = TcpListener::bind(loopback())?.local_addr()?;
        let error = DataStream::connect(addr, &ChannelSecret::random(), Duration::from_millis(200))
            .err()
            .context("connected to nothing")?;
        ensure!(
            matches!(error, ChannelError::Connect { peer, .. } if peer == addr),
            "{error}"
        );
        ensure!(error.to_string().contains(&addr.to_string()), "{error}");

        // The listener comes after the connector started trying.
        let secret = ChannelSecret::random();
        let connector = {
            let secret = secret.clone();
            thread::spawn(move || connect(addr, &secret))
        };
        let listener = DataListener::bind_with(addr, secret, options())?;
        let mut accepted = listener.accept()?;
        let mut stream = join(connector, "connector")??;
        stream.send(&[b"late"])?;
        let mut buf = Vec::new();
        ensure!(accepted.recv(&mut buf, 10)? && buf == b"late");
        Ok(())
    })
}

#[test]
fn a_frame_over_the_limit_is_refused_before_it_is_allocated() -> Result<()> {
    bounded(|| {
        let (mut tx, mut rx) = pair()?;
        let peer = rx.peer();
        let sender = thread::spawn(move || tx.send(&[&vec![9u8; 2 << 20]]));
        let mut buf = Vec::new();
        let error = rx
            .recv(&mut buf, 1 << 20)
            .err()
            .context("an oversized frame was taken")?;
        ensure!(
            matches!(error, ChannelError::FrameTooLarge { len, max_len, .. }
                if len == 2 << 20 && max_len == 1 << 20),
            "{error}"
        );
        let message = error.to_string();
        for part in [peer.to_string(), "2097152".into(), "1048576".into()] {
            ensure!(message.contains(&part), "{message} lacks {part}");
        }
        ensure!(buf.capacity() == 0, "{} bytes allocated", buf.capacity());
        // The refusing side closes; the sender then fails instead of hanging.
        drop(rx);
        let _ = sender.join();
        Ok(())
    })
}

#[test]
fn a_close_between_frames_ends_cleanly_and_inside_one_is_an_error() -> Result<()> {
    bounded(|| {
        // Between frames: both frames, then the end.
        let (mut tx, mut rx) = pair()?;
        tx.send(&[b"one"])?;
        tx.send(&[b"two"])?;
        drop(tx);
        let mut buf = Vec::new();
        ensure!(rx.recv(&mut buf, 10)? && buf == b"one");
        ensure!(rx.recv(&mut buf, 10)? && buf == b"two");
        ensure!(!rx.recv(&mut buf, 10)?, "a frame after the close");

        // Inside a frame: the sender gives up on a frame larger than the sockets
        // buffer (its write timeout) and closes, having sent part of it.
        let (mut tx, mut rx) = pair()?;
        const LEN: usize = 192 << 20;
        tx.set_write_timeout(Some(Duration::from_millis(300)))?;
        let sent = tx.send(&[&vec![1u8; LEN]]);
        ensure!(
            matches!(
                sent,
                Err(ChannelError::Io {
                    what: "sending a frame",
                    ..
                })
            ),
            "{sent:?}"
        );
        drop(tx);
        let error = rx
            .recv(&mut buf, LEN)
            .err()
            .context("a cut frame was taken as whole or as the end")?;
        ensure!(
            matches!(error, ChannelError::Truncated { part: "payload", expected, got, .. }
                if expected == LEN as u64 && got < expected),
            "{error}"
        );
        ensure!(
            error.to_string().contains(&rx.peer().to_string()),
            "{error}"
        );
        ensure!(buf.len() < LEN);
        Ok(())
    })
}

#[test]
fn a_read_timeout_before_a_frame_leaves_the_stream_usable() -> Result<()> {
    bounded(|| {
        let (mut tx, mut rx) = pair()?;
        rx.set_read_timeout(Some(Duration::from_millis(50)))?;
        let mut buf = Vec::new();
        let error = rx
            .recv(&mut buf, 10)
            .err()
            .context("a frame from nowhere")?;
        ensure!(matches!(error, ChannelError::Idle { .. }), "{error}");
        tx.send(&[b"now"])?;
        rx.set_read_timeout(None)?;
        ensure!(rx.recv(&mut buf, 10)? && buf == b"now");
        Ok(())
    })
}

#[test]
fn shutdown_wakes_a_blocked_recv_and_stop_a_blocked_accept() -> Result<()> {
    bounded(|| {
        let (tx, rx) = pair()?;
        let mut reader = rx.try_clone()?;
        let blocked = thread::spawn(move || reader.recv(&mut Vec::new(), 10));
        rx.shutdown();
        let woke = join(blocked, "reader")?;
        ensure!(matches!(woke, Ok(false)), "{woke:?}");
        drop(tx);

        let listener = DataListener::bind(loopback(), ChannelSecret::random())?;
        let addr = listener.local_addr();
        let stopper = listener.stopper();
        let accepting = thread::spawn(move || (listener.accept(), listener.accept()));
        stopper.stop();
        let (first, second) = join(accepting, "acceptor")?;
        for result in [first, second] {
            ensure!(
                matches!(&result, Err(ChannelError::Stopped { addr: a }) if *a == addr),
                "{result:?}"
            );
        }
        Ok(())
    })
}

#[test]
fn a_receiver_that_stops_reading_blocks_its_sender() -> Result<()> {
    bounded(|| {
        let (mut tx, mut rx) = pair()?;
        // Far more than loopback sockets buffer (tens of MB at most).
        const FRAMES: usize = 64;
        const LEN: usize = 4 << 20;
        let sent = Arc::new(AtomicUsize::new(0));
        let sender = {
            let sent = sent.clone();
            thread::spawn(move || -> Result<()> {
                let frame = pattern(5, LEN);
                for _ in 0..FRAMES {
                    tx.send(&[&frame])?;
                    sent.fetch_add(1, Ordering::SeqCst);
                }
                Ok(())
            })
        };
        // Wait until the sender makes no more progress, then check that it is stuck
        // short of the end rather than finished.
        let mut last = usize::MAX;
        loop {
            thread::sleep(Duration::from_millis(200));
            let now = sent.load(Ordering::SeqCst);
            if now == last {
                break;
            }
            last = now;
        }
        ensure!(
            !sender.is_finished() && last < FRAMES,
            "the sender finished {last} of {FRAMES} frames without a reader"
        );
        // Reading lets it go on to the end.
        let mut buf = Vec::new();
        for i in 0..FRAMES {
            ensure!(rx.recv(&mut buf, MAX)?, "ended before frame {i}");
            ensure!(buf.len() == LEN && buf[..64] == pattern(5, 64)[..]);
        }
        join(sender, "sender")??;
        ensure!(sent.load(Ordering::SeqCst) == FRAMES);
        Ok(())
    })
}
