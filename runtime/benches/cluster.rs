//! Cluster benchmark: what the control plane costs on loopback, against the goals
//! for a remote actor call (p50 under 200 µs, over 20,000 calls/s) and for a join (visible
//! in the status in under 1 s).
//!
//!     cargo bench -p runtime --bench cluster [-- [--quick] [--only SECTION,...] [--nodes N,...]]
//!
//! Sections, each a table (`--only` takes their names, comma-separated):
//! 1. `local`: actor messages through `LocalActors` (tells pipelined, calls from 1, 8 and
//!    64 tasks), then the same through a `WorkerPool` whose worker is this binary
//!    re-executed with `worker`;
//! 2. `transport`: one request and its answer over mutual-TLS QUIC (`Server`,
//!    `Connection::request`), from 1 caller and from 8 and 64 callers on one connection:
//!    the floor under a remote actor call;
//! 3. `join`: from `Node::start` until `ClusterClient::status` shows the node alive, with
//!    the parts a join is made of timed on their own;
//! 4. `heartbeats`: the head's CPU while N nodes heartbeat every 500 ms (default 100 and
//!    1,000; `--nodes N[,M...]`, e.g. `--nodes 3000,5000,10000` to find where a 2-core
//!    machine gives up). The nodes are light fakes that speak the join and heartbeat
//!    protocol over the real transport (each beat a tagged UDP datagram to the head's
//!    heartbeat port, answered by one; QUIC after an unanswered one), in
//!    a child process (this binary re-executed with `fake-nodes`), so this process's CPU
//!    time is the head's alone;
//! 5. `remote`: remote actor calls through the cluster API (`ClusterClient::spawn`, then
//!    `ActorRef::call` from 1, 8 and 64 tasks) to an actor on a joined node, in the node
//!    daemon and in a worker process (this binary re-executed with `remote-worker`).
//!
//! `--quick` shortens every run, for smoke tests. Figures are printed, never asserted;
//! the machine's load is printed with them, since other builds may share it. To profile
//! the head alone, attach to this process (not the fake nodes) once the nodes joined:
//!
//!     perf record -g -p <pid of target/release/deps/cluster-<hash> --only heartbeats> -- sleep 8

#[path = "cluster/actors.rs"]
mod actors;
#[path = "cluster/fake_nodes.rs"]
mod fake_nodes;
#[path = "cluster/heartbeats.rs"]
mod heartbeats;
#[path = "cluster/join.rs"]
mod join;
#[path = "cluster/measure.rs"]
mod measure;
#[path = "cluster/remote.rs"]
mod remote;
#[path = "cluster/transport.rs"]
mod transport;

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use measure::{load_average, machine_line, micros, utc_now};

/// The goals for a remote actor call and a join.
const GOAL_CALL_P50: Duration = Duration::from_micros(200);
const GOAL_CALLS_PER_S: f64 = 20_000.0;
const GOAL_JOIN: Duration = Duration::from_secs(1);

/// The sections, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Section {
    Local,
    Transport,
    Join,
    Heartbeats,
    Remote,
}

const SECTIONS: [(Section, &str); 5] = [
    (Section::Local, "local"),
    (Section::Transport, "transport"),
    (Section::Join, "join"),
    (Section::Heartbeats, "heartbeats"),
    (Section::Remote, "remote"),
];

/// What the command line asks for.
#[derive(Debug, Clone)]
pub struct Options {
    /// Short runs, for smoke tests.
    pub quick: bool,
    /// The cluster sizes of the heartbeat section.
    pub nodes: Vec<usize>,
    sections: Vec<Section>,
}

impl Options {
    /// How long one timed run of a throughput row lasts.
    pub fn run_time(&self) -> Duration {
        if self.quick {
            Duration::from_millis(300)
        } else {
            Duration::from_millis(1500)
        }
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // The re-executed roles first: they must not print the benchmark's header.
    match args.first().map(String::as_str) {
        Some("worker") => return runtime::worker_main(actors::registry()),
        Some("fake-nodes") => return fake_nodes::main(&args[1..]),
        Some("remote-worker") => return remote::worker_main(),
        _ => {}
    }
    let options = match parse(&args) {
        Ok(options) => options,
        Err(error) => {
            eprintln!("cluster bench: {error:#}");
            eprintln!(
                "usage: cargo bench -p runtime --bench cluster -- [--quick] [--nodes N[,M...]] \
                 [--only local,transport,join,heartbeats,remote]"
            );
            return ExitCode::FAILURE;
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("cluster bench: cannot start tokio: {error}");
            return ExitCode::FAILURE;
        }
    };
    let code = match runtime.block_on(run(&options)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("cluster bench: {error:#}");
            ExitCode::FAILURE
        }
    };
    // Nothing of ours is left running; anything stuck (an actor thread) must not hold the
    // exit.
    runtime.shutdown_timeout(Duration::from_secs(2));
    code
}

/// What the sections measured, for the summary.
#[derive(Debug, Default)]
struct Findings {
    transport: Option<transport::Figures>,
    join: Option<join::Figures>,
    remote: Option<remote::Figures>,
}

async fn run(options: &Options) -> Result<()> {
    println!(
        "cluster benchmark{}: control plane on loopback (127.0.0.1), release build",
        if options.quick { " (--quick)" } else { "" }
    );
    println!("machine: {}", machine_line());
    println!("date: {}", utc_now());
    println!(
        "runtime: tokio multi-thread ({} workers, as the daemons), QUIC (quinn) with TLS 1.3 \
         (rustls, ring), rkyv frames",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let mut findings = Findings::default();
    for (section, name) in SECTIONS {
        if !options.sections.contains(&section) {
            continue;
        }
        println!();
        match section {
            Section::Local => actors::run(options)
                .await
                .context("section local (actor messages)")?,
            Section::Transport => {
                findings.transport =
                    Some(transport::run(options).await.context("section transport")?);
            }
            Section::Join => {
                findings.join = Some(join::run(options).await.context("section join")?);
            }
            Section::Heartbeats => heartbeats::run(options)
                .await
                .context("section heartbeats")?,
            Section::Remote => {
                findings.remote = Some(remote::run(options).await.context("section remote")?);
            }
        }
        println!("(load average after {name}: {})", load_average());
    }
    println!();
    summary(&findings);
    Ok(())
}

/// The goals against what was measured.
fn summary(findings: &Findings) {
    println!(
        "summary against the issue's goals (remote call p50 < 200 µs and > 20,000 calls/s; join visible < 1 s)"
    );
    println!(
        "{:<52} {:>12} {:>12}  verdict",
        "figure", "measured", "goal"
    );
    let verdict = |met: bool| if met { "met" } else { "NOT MET" };
    match &findings.transport {
        Some(figures) => {
            let p50 = figures.sequential_p50;
            println!(
                "{:<52} {:>9.0} µs {:>9} µs  {}",
                "transport floor: request p50, 1 caller",
                micros(p50),
                format!("< {}", GOAL_CALL_P50.as_micros()),
                verdict(p50 < GOAL_CALL_P50)
            );
            let (callers, rate) = figures.best_rate;
            println!(
                "{:<52} {:>10.0}/s {:>10}/s  {}",
                format!("transport floor: requests/s, best ({callers} callers)"),
                rate,
                "> 20000",
                verdict(rate > GOAL_CALLS_PER_S)
            );
            println!(
                "{:<52} {:>10.0}/s {:>10}/s  {}",
                "transport floor: requests/s, 1 caller",
                figures.sequential_rate,
                "> 20000",
                verdict(figures.sequential_rate > GOAL_CALLS_PER_S)
            );
        }
        None => println!("{:<52} {:>12}", "transport floor", "not run"),
    }
    match &findings.join {
        Some(figures) => {
            let median = figures.visible_median;
            println!(
                "{:<52} {:>9.2} ms {:>9} ms  {}",
                "join: Node::start until status shows it, median",
                median.as_secs_f64() * 1e3,
                format!("< {}", GOAL_JOIN.as_millis()),
                verdict(median < GOAL_JOIN)
            );
            println!(
                "{:<52} {:>9.2} ms {:>9} ms  {}",
                "join: the same, slowest",
                figures.visible_max.as_secs_f64() * 1e3,
                format!("< {}", GOAL_JOIN.as_millis()),
                verdict(figures.visible_max < GOAL_JOIN)
            );
        }
        None => println!("{:<52} {:>12}", "join", "not run"),
    }
    match &findings.remote {
        Some(figures) => {
            let p50 = figures.sequential_p50;
            println!(
                "{:<52} {:>9.0} µs {:>9} µs  {}",
                "remote actor call p50, 1 caller (in the daemon)",
                micros(p50),
                format!("< {}", GOAL_CALL_P50.as_micros()),
                verdict(p50 < GOAL_CALL_P50)
            );
            let (tasks, rate) = figures.best_rate;
            println!(
                "{:<52} {:>10.0}/s {:>10}/s  {}",
                format!("remote actor calls/s, best ({tasks} callers)"),
                rate,
                "> 20000",
                verdict(rate > GOAL_CALLS_PER_S)
            );
            println!(
                "{:<52} {:>10.0}/s {:>10}/s  {}",
                "remote actor calls/s, 1 caller",
                figures.sequential_rate,
                "> 20000",
                verdict(figures.sequential_rate > GOAL_CALLS_PER_S)
            );
        }
        None => println!("{:<52} {:>12}", "remote actor call", "not run"),
    }
    println!(
        "The transport floor is one request and its answer on an open mutual-TLS QUIC \
         connection, client and server in this process; a remote actor call adds the \
         actor's mailbox (section 1) and the routing to it on top."
    );
}

fn parse(args: &[String]) -> Result<Options> {
    let mut options = Options {
        quick: false,
        nodes: Vec::new(),
        sections: SECTIONS.iter().map(|(section, _)| *section).collect(),
    };
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "--quick" => options.quick = true,
            "--nodes" => {
                let value = rest.next().context("--nodes needs a number")?;
                options.nodes = value
                    .split(',')
                    .map(|n| {
                        n.trim()
                            .replace('_', "")
                            .parse::<usize>()
                            .ok()
                            .filter(|n| *n > 0)
                            .with_context(|| format!("--nodes {value}: not a positive number"))
                    })
                    .collect::<Result<_>>()?;
            }
            "--only" => {
                let value = rest.next().context("--only needs a section")?;
                options.sections = value
                    .split(',')
                    .map(|name| section_named(name.trim()))
                    .collect::<Result<_>>()?;
            }
            // What cargo passes to every bench target.
            "--bench" => {}
            other => bail!("unknown argument {other:?}"),
        }
    }
    if options.nodes.is_empty() {
        options.nodes = if options.quick {
            vec![100]
        } else {
            vec![100, 1000]
        };
    }
    Ok(options)
}

/// A section by name, number (1-5) or a prefix of its name.
fn section_named(name: &str) -> Result<Section> {
    if let Ok(number) = name.parse::<usize>()
        && let Some((section, _)) = number.checked_sub(1).and_then(|i| SECTIONS.get(i))
    {
        return Ok(*section);
    }
    let matches: Vec<Section> = SECTIONS
        .iter()
        .filter(|(_, full)| !name.is_empty() && full.starts_with(name))
        .map(|(section, _)| *section)
        .collect();
    match matches.as_slice() {
        [section] => Ok(*section),
        _ => bail!(
            "no section {name:?} (sections: {})",
            SECTIONS.map(|(_, name)| name).join(", ")
        ),
    }
}
