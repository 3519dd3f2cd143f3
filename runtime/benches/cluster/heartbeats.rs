//! Section 4: the head's CPU while N nodes heartbeat at the default interval (500 ms)
//! through the real transport. The head runs in this process, the fake nodes in a child
//! process (`fake_nodes.rs`), so this process's CPU time is the head's alone. After every
//! node joined and a warm-up, the CPU time of both processes is read over a window, with
//! the heartbeats the nodes got acknowledged in it; then the head's status says whether
//! every node stayed alive, and its events whether any went suspect or dead meanwhile.

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use runtime::{ClusterEvent, Head, HeadConfig, LossReason, NodeState, StateDir};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{ChildStdin, ChildStdout, Command};
use tokio::sync::broadcast;

use crate::Options;
use crate::fake_nodes;
use crate::join::resources;
use crate::measure::{cpu_time, millis, udp_receive_drops};

/// UDP sockets the fake nodes share.
const SOCKETS: usize = 16;
/// The longest the joins of one cluster may take.
const JOIN_LIMIT: Duration = Duration::from_secs(180);

/// One cluster size's figures.
#[derive(Debug)]
struct Row {
    nodes: usize,
    joined: usize,
    join_time: Duration,
    join_head_cpu: Duration,
    beats_per_s: f64,
    head_cpu: f64,
    head_per_beat: Duration,
    fakes_cpu: Option<f64>,
    rtt_p50: Duration,
    rtt_p99: Duration,
    rtt_max: Duration,
    missed: u64,
    refused: u64,
    lost: u64,
    /// Suspect and dead events at the head in the window, and over the whole run.
    window_events: (u64, u64),
    all_events: (u64, u64),
    /// Datagrams dropped for a full receive buffer in the window, machine-wide.
    udp_drops: Option<u64>,
    alive_at_end: usize,
    not_alive_at_end: Vec<(NodeState, usize)>,
}

pub async fn run(options: &Options) -> Result<()> {
    let (warm_up, window) = if options.quick {
        (Duration::from_secs(1), Duration::from_secs(3))
    } else {
        (Duration::from_secs(2), Duration::from_secs(10))
    };
    println!(
        "4. heartbeats: the head's CPU with N nodes heartbeating every 500 ms (default \
         membership: suspect after 1.5 s, dead after 3 s). Fake nodes speak the join and \
         heartbeat protocol: the join over mutual TLS, connections kept open ({SOCKETS} shared UDP \
         sockets), each beat a UDP datagram tagged with the session key and answered by one \
         (one socket per node), in a child process; measured over {:.0} s after every node joined and {:.0} s \
         of warm-up",
        window.as_secs_f64(),
        warm_up.as_secs_f64()
    );
    let mut rows = Vec::new();
    for &nodes in &options.nodes {
        rows.push(
            cluster(nodes, warm_up, window)
                .await
                .with_context(|| format!("{nodes} nodes"))?,
        );
    }
    println!(
        "{:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>12} {:>9} {:>9}",
        "nodes",
        "beats/s",
        "head CPU",
        "µs/beat",
        "fakes CPU",
        "rtt p50",
        "rtt p99",
        "suspect/dead",
        "alive",
        "joins in"
    );
    for row in &rows {
        println!(
            "{:>6} {:>9.0} {:>8.1}% {:>9.1} {:>9} {:>6.2} ms {:>6.2} ms {:>12} {:>9} {:>7.2} s",
            row.nodes,
            row.beats_per_s,
            row.head_cpu * 100.0,
            row.head_per_beat.as_secs_f64() * 1e6,
            row.fakes_cpu
                .map_or("-".to_owned(), |cpu| format!("{:.1}%", cpu * 100.0)),
            millis(row.rtt_p50),
            millis(row.rtt_p99),
            format!("{}/{}", row.window_events.0, row.window_events.1),
            format!("{}/{}", row.alive_at_end, row.nodes),
            row.join_time.as_secs_f64(),
        );
    }
    println!(
        "CPU in % of one core; µs/beat: head CPU time per acknowledged heartbeat (everything \
         the head did in the window, divided); rtt: a heartbeat's round trip as the fake \
         nodes see it (their own scheduling included); suspect/dead: events at the head \
         in the window"
    );
    for row in &rows {
        let per_join = row.join_head_cpu.as_secs_f64() * 1e3 / row.joined.max(1) as f64;
        println!(
            "{} nodes: joins took {:.2} s of wall time and {:.2} s of head CPU ({per_join:.2} \
             ms per join: two handshakes and a certificate); in the window max rtt {:.1} \
             ms and {} UDP datagrams dropped for a full receive buffer (machine-wide); over \
             the whole run {} heartbeats missed (no answer within the interval), {} refused, \
             {} lost, {} suspect and {} dead events",
            row.nodes,
            row.join_time.as_secs_f64(),
            row.join_head_cpu.as_secs_f64(),
            millis(row.rtt_max),
            row.udp_drops
                .map_or("an unknown number of".to_owned(), |drops| drops.to_string()),
            row.missed,
            row.refused,
            row.lost,
            row.all_events.0,
            row.all_events.1
        );
        for (state, count) in &row.not_alive_at_end {
            println!("  {count} nodes {state} at the end");
        }
        if row.joined < row.nodes {
            println!("  only {} of {} nodes joined", row.joined, row.nodes);
        }
    }
    if let [small, .., large] = rows.as_slice() {
        println!(
            "scaling {} -> {} nodes ({:.0}x): head CPU {:.1}x, per heartbeat {:.2}x",
            small.nodes,
            large.nodes,
            large.nodes as f64 / small.nodes as f64,
            large.head_cpu / small.head_cpu.max(1e-9),
            large.head_per_beat.as_secs_f64() / small.head_per_beat.as_secs_f64().max(1e-12)
        );
    }
    Ok(())
}

/// Events at the head, counted as they come.
#[derive(Debug, Default)]
struct EventCounts {
    suspected: AtomicU64,
    dead: AtomicU64,
}

impl EventCounts {
    /// (suspect, dead) events so far.
    fn read(&self) -> (u64, u64) {
        (
            self.suspected.load(Ordering::Relaxed),
            self.dead.load(Ordering::Relaxed),
        )
    }
}

/// One cluster of `nodes` fake nodes and a fresh head.
async fn cluster(nodes: usize, warm_up: Duration, window: Duration) -> Result<Row> {
    let dir = tempfile::tempdir().context("temporary folder")?;
    let head = Head::start(HeadConfig::loopback(
        StateDir::at(dir.path().join("head")),
        resources(),
    ))
    .await
    .context("starting the head")?;
    let counts = Arc::new(EventCounts::default());
    let counting = tokio::spawn(count_events(head.subscribe(), counts.clone()));
    let outcome = measure(&head, nodes, warm_up, window, &counts).await;
    counting.abort();
    head.stop().await;
    outcome
}

async fn measure(
    head: &Head,
    nodes: usize,
    warm_up: Duration,
    window: Duration,
    counts: &EventCounts,
) -> Result<Row> {
    let me = std::process::id();
    let config = fake_nodes::Config {
        head: head.local_addr(),
        token: head.token().as_str().to_owned(),
        ca_hash: head.ca_hash(),
        nodes,
        sockets: SOCKETS,
    };
    let mut child = Command::new(std::env::current_exe().context("finding this binary")?)
        .arg("fake-nodes")
        .args(config.to_args())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .context("starting the fake nodes")?;
    let child_pid = child.id();
    let mut stdin = child.stdin.take().context("child stdin")?;
    let mut lines = BufReader::new(child.stdout.take().context("child stdout")?).lines();

    let start = Instant::now();
    let cpu_start = cpu_time(me).context("reading this process's CPU time")?;
    let ready = tokio::time::timeout(JOIN_LIMIT, lines.next_line())
        .await
        .context("the fake nodes did not join in time")??
        .context("the fake nodes exited")?;
    let join_time = start.elapsed();
    let join_head_cpu = cpu_time(me).unwrap_or_default().saturating_sub(cpu_start);
    let Some(ready) = ready.strip_prefix("ready ") else {
        bail!("fake nodes: {ready}");
    };
    if ready.contains("first_error") {
        println!("fake nodes: {ready}");
    }
    let joined = number(&fields(ready), "joined")? as usize;

    tokio::time::sleep(warm_up).await;
    let before = report(&mut stdin, &mut lines).await?;
    let (t0, head0) = (Instant::now(), cpu_time(me).unwrap_or_default());
    let fakes0 = child_pid.and_then(cpu_time);
    let events0 = counts.read();
    let drops0 = udp_receive_drops();
    tokio::time::sleep(window).await;
    let after = report(&mut stdin, &mut lines).await?;
    let (elapsed, head1) = (t0.elapsed(), cpu_time(me).unwrap_or_default());
    let fakes1 = child_pid.and_then(cpu_time);
    let events1 = counts.read();
    let drops1 = udp_receive_drops();

    let status = head.status();
    let mut alive_at_end = 0;
    let mut others: HashMap<NodeState, usize> = HashMap::new();
    for node in status.nodes.iter().filter(|n| n.id != head.node_id()) {
        if node.state == NodeState::Alive {
            alive_at_end += 1;
        } else {
            *others.entry(node.state).or_default() += 1;
        }
    }

    // The end of its input ends the child; it is killed if it lingers.
    drop(stdin);
    if tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .is_err()
    {
        child.kill().await.context("killing the fake nodes")?;
    }

    let delta = |key: &str| -> Result<u64> {
        Ok(number(&after, key)?.saturating_sub(number(&before, key)?))
    };
    let acked = delta("acked")?;
    let head_cpu = head1.saturating_sub(head0);
    let micros = |key: &str| number(&after, key).map(Duration::from_micros);
    Ok(Row {
        nodes,
        joined,
        join_time,
        join_head_cpu,
        beats_per_s: acked as f64 / elapsed.as_secs_f64(),
        head_cpu: head_cpu.as_secs_f64() / elapsed.as_secs_f64(),
        head_per_beat: head_cpu / u32::try_from(acked.max(1)).unwrap_or(u32::MAX),
        fakes_cpu: fakes0
            .zip(fakes1)
            .map(|(a, b)| b.saturating_sub(a).as_secs_f64() / elapsed.as_secs_f64()),
        rtt_p50: micros("rtt_p50_us")?,
        rtt_p99: micros("rtt_p99_us")?,
        rtt_max: micros("rtt_max_us")?,
        missed: number(&after, "missed")?,
        refused: number(&after, "refused")?,
        lost: number(&after, "lost")?,
        window_events: (events1.0 - events0.0, events1.1 - events0.1),
        all_events: counts.read(),
        udp_drops: drops0.zip(drops1).map(|(a, b)| b.saturating_sub(a)),
        alive_at_end,
        not_alive_at_end: others.into_iter().collect(),
    })
}

/// Asks the child for its counters.
async fn report(
    stdin: &mut ChildStdin,
    lines: &mut Lines<BufReader<ChildStdout>>,
) -> Result<HashMap<String, String>> {
    stdin.write_all(b"report\n").await?;
    stdin.flush().await?;
    let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
        .await
        .context("the fake nodes did not report")??
        .context("the fake nodes exited")?;
    match line.strip_prefix("counts ") {
        Some(counts) => Ok(fields(counts)),
        None => bail!("fake nodes: {line}"),
    }
}

/// `key=value` pairs of a line.
fn fields(line: &str) -> HashMap<String, String> {
    line.split_whitespace()
        .filter_map(|pair| pair.split_once('='))
        .map(|(key, value)| (key.to_owned(), value.to_owned()))
        .collect()
}

fn number(fields: &HashMap<String, String>, key: &str) -> Result<u64> {
    fields
        .get(key)
        .and_then(|value| value.parse().ok())
        .with_context(|| format!("no number {key} from the fake nodes"))
}

async fn count_events(mut events: broadcast::Receiver<ClusterEvent>, counts: Arc<EventCounts>) {
    loop {
        match events.recv().await {
            Ok(ClusterEvent::NodeSuspect { .. }) => {
                counts.suspected.fetch_add(1, Ordering::Relaxed);
            }
            Ok(ClusterEvent::NodeLost {
                reason: LossReason::Dead,
                ..
            }) => {
                counts.dead.fetch_add(1, Ordering::Relaxed);
            }
            Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
            Err(broadcast::error::RecvError::Closed) => return,
        }
    }
}
