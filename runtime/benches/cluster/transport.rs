//! Section 2: one request and its answer over mutual-TLS QUIC, the floor under a remote
//! actor call. A `Server` with a node's TLS configuration answers an `ActorCall` carrying
//! 16 bytes with an `ActorReply` carrying them back; callers share one `Connection`.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use runtime::wire::Message;
use runtime::{Client, ClientTls, ClusterCa, Connection, Peer, Server, ServerTls};

use crate::Options;
use crate::measure::{
    CpuMeter, Latencies, Run, micros, millis, run_header, run_row, timed_calls, udp_receive_drops,
};

const PAYLOAD: usize = 16;
const TIMEOUT: Duration = Duration::from_secs(10);
const WARM_UP: usize = 1000;
/// Callers sharing the connection in the concurrent rows.
const CONCURRENT: [usize; 2] = [8, 64];

/// What the summary needs.
#[derive(Debug, Clone)]
pub struct Figures {
    pub sequential_p50: Duration,
    pub sequential_rate: f64,
    /// The most requests per second of the concurrent rows, and with how many callers.
    pub best_rate: (usize, f64),
}

pub async fn run(options: &Options) -> Result<Figures> {
    println!(
        "2. transport: request/response over QUIC with mutual TLS, client and server in this \
         process ({PAYLOAD}-byte ActorCall answered by an ActorReply; each row runs {:.1} s)",
        options.run_time().as_secs_f64()
    );
    let ca = ClusterCa::generate().context("generating a CA")?;
    let server_credentials = ca.issue("node-bench", &[]).context("server certificate")?;
    let client_credentials = ca.issue("client", &[]).context("client certificate")?;
    let server_tls = ServerTls::node(ca.certificate(), &server_credentials)?;
    let client_tls = ClientTls::mutual(ca.certificate(), &client_credentials)?;

    let (server, accepting, address) = serve(&server_tls)?;
    handshakes(options, address, &client_tls).await?;
    let drops_before = udp_receive_drops();
    run_header("callers");
    let outcome = rows(options, address, &client_tls, "").await;
    server.close();
    accepting.abort();
    let figures = outcome?;

    // The same on a runtime of one thread: no wake-ups across threads, no contention on
    // the connection's lock. A daemon on a busy machine runs like this.
    let single = {
        let (options, server_tls, client_tls) = (options.clone(), server_tls, client_tls);
        tokio::task::spawn_blocking(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("starting a one-thread runtime")?;
            runtime.block_on(async {
                let (server, accepting, address) = serve(&server_tls)?;
                let outcome = rows(&options, address, &client_tls, ", 1 thread").await;
                server.close();
                accepting.abort();
                outcome
            })
        })
        .await
        .context("the one-thread runtime panicked")??
    };
    if let Some((before, after)) = drops_before.zip(udp_receive_drops()) {
        println!(
            "UDP datagrams dropped for a full receive buffer during these rows (machine-wide): {}",
            after.saturating_sub(before)
        );
    }
    println!(
        "one request takes {:.1} µs end to end at 1 caller ({:.1} µs with client and server on \
         one thread); at {} callers the connection serves {:.1}x as many as at 1",
        micros(figures.sequential_p50),
        micros(single.sequential_p50),
        figures.best_rate.0,
        figures.best_rate.1 / figures.sequential_rate.max(1e-9)
    );
    Ok(figures)
}

/// A server answering with [`echo`] on a free loopback port, on the current runtime.
fn serve(tls: &ServerTls) -> Result<(Server, tokio::task::JoinHandle<()>, SocketAddr)> {
    let server = Server::bind(SocketAddr::from(([127, 0, 0, 1], 0)), tls)?;
    let address = server.local_addr()?;
    let serving = server.clone();
    let accepting = tokio::spawn(async move { serving.accept_loop(echo).await });
    Ok((server, accepting, address))
}

/// Handshakes: a fresh client endpoint (UDP socket) each, as `Client::connect` makes.
async fn handshakes(options: &Options, address: SocketAddr, tls: &ClientTls) -> Result<()> {
    let handshakes = if options.quick { 5 } else { 20 };
    let mut times = Vec::with_capacity(handshakes);
    for _ in 0..handshakes {
        let start = Instant::now();
        let connection = Client::connect(address, tls).await?;
        times.push(start.elapsed());
        connection.close();
    }
    let handshake = Latencies::new(times);
    println!(
        "connect (new UDP socket, QUIC + TLS 1.3 handshake, both certificates verified): \
         p50 {:.2} ms, min {:.2} ms, max {:.2} ms over {}",
        millis(handshake.median()),
        millis(handshake.min()),
        millis(handshake.max()),
        handshake.len()
    );
    Ok(())
}

/// The rows on one connection: 1 caller, then [`CONCURRENT`] callers; `suffix` goes
/// after the number of callers.
async fn rows(
    options: &Options,
    address: SocketAddr,
    tls: &ClientTls,
    suffix: &str,
) -> Result<Figures> {
    let connection = Client::connect(address, tls).await?;
    for i in 0..WARM_UP {
        request(&connection, i as u64).await?;
    }
    let run_time = options.run_time();
    let me = [std::process::id()];
    let meter = CpuMeter::start(&me);
    let mut sequential = requests(&connection, 1, run_time).await?;
    sequential.cpu = meter.elapsed();
    run_row(&format!("1{suffix}"), "request, sequential", &sequential);
    let latencies = sequential
        .latencies
        .as_ref()
        .context("the sequential run timed its requests")?;
    let mut figures = Figures {
        sequential_p50: latencies.median(),
        sequential_rate: sequential.per_second(),
        best_rate: (1, sequential.per_second()),
    };
    for callers in CONCURRENT {
        let meter = CpuMeter::start(&me);
        let mut run = requests(&connection, callers, run_time).await?;
        run.cpu = meter.elapsed();
        run_row(&format!("{callers}{suffix}"), "request, 1 connection", &run);
        if run.per_second() > figures.best_rate.1 {
            figures.best_rate = (callers, run.per_second());
        }
    }
    connection.close();
    Ok(figures)
}

/// Requests from `callers` tasks on one connection for `run_time`, each waiting for its
/// answer before the next.
async fn requests(connection: &Connection, callers: usize, run_time: Duration) -> Result<Run> {
    let connection = connection.clone();
    timed_calls(callers, run_time, move |caller, n| {
        let connection = connection.clone();
        async move { request(&connection, ((caller as u64) << 32) + n).await }
    })
    .await
}

/// One call, checked.
async fn request(connection: &Connection, call_id: u64) -> Result<()> {
    let call = Message::ActorCall {
        actor_id: 1,
        call_id,
        method: "echo".to_owned(),
        payload: vec![7; PAYLOAD],
        timeout_ms: 10_000,
    };
    match connection.request(&call, TIMEOUT).await? {
        Message::ActorReply {
            call_id: answered,
            result: Ok(payload),
        } if answered == call_id && payload.len() == PAYLOAD => Ok(()),
        other => bail!("unexpected answer {other:?}"),
    }
}

/// The server's side: an actor that echoes, with no actor behind it.
async fn echo(_peer: Peer, request: Message) -> Message {
    match request {
        Message::ActorCall {
            call_id, payload, ..
        } => Message::ActorReply {
            call_id,
            result: Ok(payload),
        },
        _ => Message::Error {
            message: "only ActorCall here".to_owned(),
        },
    }
}
