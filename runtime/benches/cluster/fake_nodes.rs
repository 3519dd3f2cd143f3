//! The fake nodes of section 4, run in a child process (this binary with `fake-nodes`),
//! so that the parent's CPU time is the head's alone.
//!
//! Each fake node does what `runtime/src/node/join.rs` and `heartbeat.rs` do, over the
//! real transport: it joins with the token on a connection without certificate, then
//! heartbeats on a mutual-TLS connection with the certificate the head handed out, every
//! interval the head asked for, as datagrams answered by datagrams (on a stream if the
//! head takes no datagrams); a beat unanswered within its interval is missed, and the
//! head lost only once nothing was acknowledged for the dead window. When the head hands
//! out a heartbeat port and key, beats go as tagged UDP datagrams instead (one socket per
//! fake node), one over QUIC after each that goes unanswered. On a refusal it
//! joins again on that connection (no token), on a lost connection it reconnects after a
//! backoff (50 ms doubling to 2 s).
//! It binds no port of its own and serves nothing: the nodes share a few UDP sockets
//! (`Server` endpoints that accept nothing, `Server::connect` from them), which the head
//! cannot tell from one socket per node.
//!
//! The parent talks over stdin and stdout, one line each way:
//! - the child prints `ready joined=N failed=F seconds=S` once every node joined (or
//!   gave up), `failed REASON` if it cannot start at all;
//! - to `report` on stdin it answers `counts acked=.. missed=.. refused=.. lost=..
//!   rejoined=.. rtt_p50_us=.. rtt_p99_us=.. rtt_max_us=..`, the round trips being those
//!   of the heartbeats acknowledged within their interval since the previous report;
//! - at the end of stdin it exits (also when the parent dies).

use std::io::BufRead;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use runtime::wire::{
    BEAT_LEN, BeatGate, BeatKey, BeatKind, BeatPacket, GpuWire, Message, NodeDescription,
    ResourcesWire,
};
use runtime::{
    CaCertificate, CaHash, Client, ClientTls, Connection, NodeCredentials, Server, ServerTls,
    TransportError,
};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

/// Joins in flight at once.
const JOIN_CONCURRENCY: usize = 16;
/// Tries per node before it counts as failed.
const JOIN_TRIES: usize = 3;
/// As the node daemon: how long a connection may take, and its backoff.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// GPUs each fake node claims, as a training node would offer.
const GPUS: u32 = 8;

/// How the parent starts the child.
#[derive(Debug, Clone)]
pub struct Config {
    pub head: SocketAddr,
    pub token: String,
    pub ca_hash: CaHash,
    pub nodes: usize,
    /// UDP sockets the nodes share.
    pub sockets: usize,
}

impl Config {
    /// The arguments after `fake-nodes`.
    pub fn to_args(&self) -> Vec<String> {
        vec![
            self.head.to_string(),
            self.token.clone(),
            self.ca_hash.to_string(),
            self.nodes.to_string(),
            self.sockets.to_string(),
        ]
    }

    fn from_args(args: &[String]) -> Result<Config> {
        let [head, token, ca_hash, nodes, sockets] = args else {
            bail!("usage: fake-nodes HEAD TOKEN CA_HASH NODES SOCKETS");
        };
        Ok(Config {
            head: head.parse().context("head address")?,
            token: token.clone(),
            ca_hash: ca_hash.parse().context("ca hash")?,
            nodes: nodes.parse().context("nodes")?,
            sockets: sockets.parse::<usize>().context("sockets")?.max(1),
        })
    }
}

/// The child's `main`.
pub fn main(args: &[String]) -> ExitCode {
    match serve(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("fake nodes: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn serve(args: &[String]) -> Result<()> {
    let config = Arc::new(Config::from_args(args)?);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting tokio")?;
    let counters = Arc::new(Counters::default());
    {
        let counters = counters.clone();
        runtime.spawn(async move {
            match start(config, counters).await {
                Ok(ready) => println!("{ready}"),
                Err(error) => println!("failed {error:#}"),
            }
        });
    }
    for line in std::io::stdin().lock().lines() {
        if line.context("reading stdin")?.trim() == "report" {
            println!("{}", counters.report());
        }
    }
    // The parent closed stdin: done.
    runtime.shutdown_background();
    Ok(())
}

/// What the nodes did, for the parent.
#[derive(Default)]
struct Counters {
    acked: AtomicU64,
    /// Beats not answered within their interval.
    missed: AtomicU64,
    refused: AtomicU64,
    lost: AtomicU64,
    rejoined: AtomicU64,
    /// Round trips of acknowledged heartbeats since the last report, in µs.
    round_trips: Mutex<Vec<u32>>,
}

impl Counters {
    fn report(&self) -> String {
        let mut round_trips = std::mem::take(
            &mut *self
                .round_trips
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        round_trips.sort_unstable();
        let at = |p: f64| {
            if round_trips.is_empty() {
                return 0;
            }
            let rank = ((p / 100.0) * round_trips.len() as f64).ceil() as usize;
            round_trips[rank.clamp(1, round_trips.len()) - 1]
        };
        format!(
            "counts acked={} missed={} refused={} lost={} rejoined={} rtt_p50_us={} \
             rtt_p99_us={} rtt_max_us={}",
            self.acked.load(Ordering::Relaxed),
            self.missed.load(Ordering::Relaxed),
            self.refused.load(Ordering::Relaxed),
            self.lost.load(Ordering::Relaxed),
            self.rejoined.load(Ordering::Relaxed),
            at(50.0),
            at(99.0),
            round_trips.last().copied().unwrap_or(0),
        )
    }

    /// A beat acknowledged; its round trip if it was the beat just sent (not a late one).
    fn acked(&self, round_trip: Option<Duration>) {
        self.acked.fetch_add(1, Ordering::Relaxed);
        let Some(round_trip) = round_trip else {
            return;
        };
        let micros = u32::try_from(round_trip.as_micros()).unwrap_or(u32::MAX);
        self.round_trips
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(micros);
    }
}

/// One fake node's membership, as the head last accepted it.
#[derive(Debug, Clone, Copy)]
struct Session {
    node_id: u64,
    session: u64,
    heartbeat: Duration,
    dead_after: Duration,
    /// The head's heartbeat port and the session's key; `None`: beats over QUIC.
    beat: Option<(u16, BeatKey)>,
}

/// What a join hands out.
struct Joined {
    session: Session,
    ca: CaCertificate,
    credentials: NodeCredentials,
}

/// Joins every node (a few at a time), each starting its heartbeats once joined; returns
/// the `ready` line.
async fn start(config: Arc<Config>, counters: Arc<Counters>) -> Result<String> {
    let begin = Instant::now();
    let join_tls = Arc::new(ClientTls::join(config.ca_hash)?);
    // The first node joins from a socket of its own; its certificate lets the shared
    // sockets be bound (a `Server` needs one, though these accept nothing).
    let connection = connect(config.head, None, &join_tls).await?;
    let first = join(&connection, &config, 0, &config.token).await?;
    connection.close();
    let server_tls = ServerTls::node(&first.ca, &first.credentials)?;
    let sockets: Vec<Server> = (0..config.sockets)
        .map(|_| Server::bind(SocketAddr::from(([127, 0, 0, 1], 0)), &server_tls))
        .collect::<Result<_, _>>()
        .context("binding the shared sockets")?;
    let mut failed = 0usize;
    let mut first_error = None;
    match begin_heartbeats(&config, &sockets[0], 0, first, &counters).await {
        Ok(()) => {}
        Err(error) => {
            failed += 1;
            first_error = Some(format!("{error:#}"));
        }
    }

    let permits = Arc::new(Semaphore::new(JOIN_CONCURRENCY));
    let mut joins = JoinSet::new();
    for index in 1..config.nodes {
        let permit = permits.clone().acquire_owned().await?;
        let config = config.clone();
        let socket = sockets[index % sockets.len()].clone();
        let join_tls = join_tls.clone();
        let counters = counters.clone();
        joins.spawn(async move {
            let _permit = permit;
            let mut last = None;
            for _ in 0..JOIN_TRIES {
                let attempt = async {
                    let connection = connect(config.head, Some(&socket), &join_tls).await?;
                    let joined = join(&connection, &config, index, &config.token).await;
                    connection.close();
                    begin_heartbeats(&config, &socket, index, joined?, &counters).await
                };
                match attempt.await {
                    Ok(()) => return Ok(()),
                    Err(error) => last = Some(error),
                }
            }
            Err(last.unwrap_or_else(|| anyhow::anyhow!("no try")))
        });
    }
    while let Some(done) = joins.join_next().await {
        if let Err(error) = done
            .context("a join task panicked")
            .and_then(|joined| joined)
        {
            failed += 1;
            first_error.get_or_insert_with(|| format!("{error:#}"));
        }
    }
    Ok(format!(
        "ready joined={} failed={failed} seconds={:.3}{}",
        config.nodes - failed,
        begin.elapsed().as_secs_f64(),
        first_error.map_or(String::new(), |error| format!(" first_error={error}"))
    ))
}

/// Connects to the head for the node's heartbeats and starts them (its first one now, as
/// the node daemon does).
async fn begin_heartbeats(
    config: &Arc<Config>,
    socket: &Server,
    index: usize,
    joined: Joined,
    counters: &Arc<Counters>,
) -> Result<()> {
    let tls = ClientTls::mutual(&joined.ca, &joined.credentials)?;
    let connection = connect(config.head, Some(socket), &tls).await?;
    let node = FakeNode {
        index,
        config: config.clone(),
        socket: socket.clone(),
        tls,
        session: joined.session,
        counters: counters.clone(),
    };
    tokio::spawn(node.heartbeats(connection));
    Ok(())
}

struct FakeNode {
    /// Which fake node, for the description sent on a rejoin.
    index: usize,
    config: Arc<Config>,
    socket: Server,
    tls: ClientTls,
    session: Session,
    counters: Arc<Counters>,
}

/// What became of one beat.
enum Beat {
    /// Acknowledged: the beat just sent, with its round trip.
    Acked(Duration),
    /// Not acknowledged in time, but earlier beats of the session were (late; counted).
    LateAcked,
    Refused,
    Missed,
    Lost,
}

impl FakeNode {
    /// Heartbeats forever, as `runtime/src/node/heartbeat.rs` does.
    async fn heartbeats(mut self, connection: Connection) {
        let mut connection = Some(connection);
        let mut seq = 0u64;
        let mut first_seq = 1u64;
        let mut last_ack = Instant::now();
        let mut backoff = FIRST_BACKOFF;
        // UDP beats as the node daemon sends them: after one goes unanswered, one over QUIC.
        let mut udp: Option<(tokio::net::UdpSocket, BeatGate)> = None;
        let mut quic_next = false;
        loop {
            let started = Instant::now();
            seq += 1;
            let current = match connection.clone() {
                Some(current) => current,
                None => match connect(self.config.head, Some(&self.socket), &self.tls).await {
                    Ok(current) => {
                        connection = Some(current.clone());
                        current
                    }
                    Err(_) => {
                        self.counters.lost.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                        continue;
                    }
                },
            };
            let beat = Message::Heartbeat {
                node_id: self.session.node_id,
                session: self.session.session,
                seq,
                gpus: Vec::new(),
            };
            let deadline = started + self.session.heartbeat;
            let udp_link = self.session.beat.filter(|_| !quic_next);
            quic_next = false;
            let outcome = if let Some((port, key)) = udp_link {
                let outcome = self
                    .udp_beat(&mut udp, port, key, seq, started, deadline)
                    .await;
                quic_next = matches!(outcome, Beat::Missed);
                outcome
            } else {
                match current.send_datagram(&beat) {
                    Ok(()) => {
                        answer(&current, seq, first_seq, started, deadline, &self.counters).await
                    }
                    Err(TransportError::NoDatagram { .. }) => {
                        let timeout = self.session.dead_after.max(self.session.heartbeat);
                        match current.request(&beat, timeout).await {
                            Ok(Message::HeartbeatAck { .. }) => Beat::Acked(started.elapsed()),
                            Ok(_) => Beat::Refused,
                            Err(_) => Beat::Lost,
                        }
                    }
                    Err(_) => Beat::Lost,
                }
            };
            match outcome {
                Beat::Acked(_) | Beat::LateAcked => {
                    if let Beat::Acked(round_trip) = outcome {
                        self.counters.acked(Some(round_trip));
                    }
                    last_ack = Instant::now();
                    backoff = FIRST_BACKOFF;
                    tokio::time::sleep_until(deadline.into()).await;
                    continue;
                }
                Beat::Missed if last_ack.elapsed() < self.session.dead_after => {
                    self.counters.missed.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                Beat::Refused => {
                    self.counters.refused.fetch_add(1, Ordering::Relaxed);
                    match join(&current, &self.config, self.index, "").await {
                        Ok(joined) => {
                            self.counters.rejoined.fetch_add(1, Ordering::Relaxed);
                            self.session = joined.session;
                            first_seq = seq + 1;
                            last_ack = Instant::now();
                            backoff = FIRST_BACKOFF;
                            continue;
                        }
                        Err(_) => connection = None,
                    }
                }
                Beat::Missed | Beat::Lost => {
                    self.counters.lost.fetch_add(1, Ordering::Relaxed);
                    connection = None;
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }
}

impl FakeNode {
    /// One beat as a UDP datagram tagged with the session's key, as
    /// `runtime/src/node/heartbeat.rs` sends it, and its answer awaited until `deadline`.
    async fn udp_beat(
        &self,
        udp: &mut Option<(tokio::net::UdpSocket, BeatGate)>,
        port: u16,
        key: BeatKey,
        seq: u64,
        sent: Instant,
        deadline: Instant,
    ) -> Beat {
        let session = self.session.session;
        if udp
            .as_ref()
            .is_none_or(|(_, gate)| gate.session() != session)
        {
            let to = SocketAddr::new(self.config.head.ip(), port);
            let opened = async {
                let socket =
                    tokio::net::UdpSocket::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
                socket.connect(to).await?;
                std::io::Result::Ok(socket)
            };
            match opened.await {
                Ok(socket) => {
                    *udp = Some((socket, BeatGate::new(self.session.node_id, session, &key)))
                }
                Err(_) => return Beat::Missed,
            }
        }
        let Some((socket, gate)) = udp.as_mut() else {
            return Beat::Missed;
        };
        let datagram = BeatPacket {
            kind: BeatKind::Beat,
            node_id: self.session.node_id,
            session,
            seq,
        }
        .seal(gate.key());
        if socket.send(&datagram).await.is_err() {
            return Beat::Missed;
        }
        let mut buffer = [0u8; BEAT_LEN + 1];
        let mut late_acks = false;
        loop {
            let received = tokio::select! {
                received = socket.recv(&mut buffer) => received,
                () = tokio::time::sleep_until(deadline.into()) => {
                    return if late_acks { Beat::LateAcked } else { Beat::Missed };
                }
            };
            match received.map(|len| gate.take(&buffer[..len], BeatKind::Ack)) {
                Ok(Ok(ack)) if ack.seq == seq => return Beat::Acked(sent.elapsed()),
                Ok(Ok(_)) => {
                    self.counters.acked(None);
                    late_acks = true;
                }
                Ok(Err(_)) => {}
                Err(_) => {
                    tokio::time::sleep_until(deadline.into()).await;
                    return if late_acks {
                        Beat::LateAcked
                    } else {
                        Beat::Missed
                    };
                }
            }
        }
    }
}

/// Reads the head's datagrams until one answers the beat `seq` (sent at `sent`) or
/// refuses the session, or until `deadline`, as the node daemon does: a late
/// acknowledgement of an earlier beat of the session counts if the beat's own does not
/// come in time.
async fn answer(
    connection: &Connection,
    seq: u64,
    first_seq: u64,
    sent: Instant,
    deadline: Instant,
    counters: &Counters,
) -> Beat {
    let mut late_acks = false;
    loop {
        let message = tokio::select! {
            message = connection.read_datagram() => message,
            () = tokio::time::sleep_until(deadline.into()) => {
                return if late_acks { Beat::LateAcked } else { Beat::Missed };
            }
        };
        match message {
            Ok(Message::HeartbeatAck { seq: acked }) if acked == seq => {
                return Beat::Acked(sent.elapsed());
            }
            Ok(Message::HeartbeatAck { seq: acked }) if acked >= first_seq => {
                counters.acked(None);
                late_acks = true;
            }
            Ok(Message::HeartbeatRefused { seq: refused, .. }) if refused >= first_seq => {
                return Beat::Refused;
            }
            Ok(_) => {}
            Err(_) => return Beat::Lost,
        }
    }
}

/// A connection to the head, from a shared socket or from a new one.
async fn connect(head: SocketAddr, socket: Option<&Server>, tls: &ClientTls) -> Result<Connection> {
    let connecting = async {
        match socket {
            Some(socket) => socket.connect(head, tls).await,
            None => Client::connect(head, tls).await,
        }
    };
    tokio::time::timeout(CONNECT_TIMEOUT, connecting)
        .await
        .context("connecting to the head timed out")?
        .context("connecting to the head")
}

/// Sends a join (with `token` on a connection without certificate, or none on the
/// node's own) and reads the answer as `runtime/src/node/join.rs` does.
async fn join(
    connection: &Connection,
    config: &Config,
    index: usize,
    token: &str,
) -> Result<Joined> {
    let request = Message::JoinRequest {
        token: token.to_owned(),
        node: description(index),
    };
    let reply = connection
        .request(&request, CONNECT_TIMEOUT)
        .await
        .context("join request")?;
    let Message::JoinAccepted {
        node_id,
        session,
        ca_cert_pem,
        cert_pem,
        key_pem,
        heartbeat_ms,
        dead_after_ms,
        beat_port,
        beat_key,
    } = reply
    else {
        bail!("join answered with {reply:?}");
    };
    let ca = CaCertificate::from_pem(&ca_cert_pem)?;
    ensure!(
        ca.hash() == config.ca_hash,
        "the head handed out another CA"
    );
    ensure!(heartbeat_ms > 0, "heartbeat every 0 ms");
    Ok(Joined {
        session: Session {
            node_id,
            session,
            heartbeat: Duration::from_millis(u64::from(heartbeat_ms)),
            dead_after: Duration::from_millis(u64::from(dead_after_ms)),
            beat: BeatKey::from_bytes(&beat_key)
                .filter(|_| beat_port != 0)
                .map(|key| (beat_port, key)),
        },
        ca,
        credentials: NodeCredentials { cert_pem, key_pem },
    })
}

/// What fake node `index` says it is: 8 CPUs, 64 GiB, 8 claimed GPUs.
fn description(index: usize) -> NodeDescription {
    NodeDescription {
        hostname: format!("fake-{index}"),
        // Nobody connects to it: the address is only shown in the status.
        address: format!("127.0.0.1:{}", 20_000 + index % 40_000),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        resources: ResourcesWire {
            cpus: 8,
            memory_bytes: Some(64 << 30),
            gpus: (0..GPUS)
                .map(|gpu| GpuWire {
                    index: gpu,
                    name: "claimed GPU".to_owned(),
                    memory_bytes: None,
                    uuid: format!("claimed-{gpu}"),
                })
                .collect(),
        },
    }
}
