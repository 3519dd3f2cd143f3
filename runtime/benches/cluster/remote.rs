//! Section 5: remote actor calls through the cluster API, as a program uses it: a head and
//! a joined node in this process, a `ClusterClient` from the head's state folder, `echo`
//! actors spawned on the node (`Strategy::Node`), one inside the node daemon and one in a
//! worker process (this binary re-executed with `remote-worker`), then `ActorRef::call`
//! from 1, 8 and 64 tasks. Every call crosses QUIC from the client to the node.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use runtime::{
    ActorHosting, ActorRef, ClusterClient, ECHO_KIND, Head, HeadConfig, Node, NodeConfig,
    SpawnOptions, StateDir, Strategy, TransportOptions, WorkerCommand, diagnostic_registry,
};

use crate::Options;
use crate::measure::{CpuMeter, Run, run_header, run_row, timed_calls};

/// Bytes of each call's payload, as in the other sections.
const PAYLOAD: usize = 16;
/// Concurrent callers after the sequential row.
const CONCURRENT: [usize; 2] = [8, 64];
/// Calls before timing, to open connections and warm caches.
const WARM_UP: usize = 200;

/// What the summary needs, for the actor in the daemon.
#[derive(Debug, Clone)]
pub struct Figures {
    pub sequential_p50: Duration,
    pub sequential_rate: f64,
    pub best_rate: (usize, f64),
}

/// The worker side of this section's actors.
pub fn worker_main() -> std::process::ExitCode {
    runtime::worker_main(diagnostic_registry())
}

pub async fn run(options: &Options) -> Result<Figures> {
    println!(
        "5. remote actor calls: ClusterClient on the head's machine calling `echo` actors on \
         a joined node ({PAYLOAD}-byte payloads; head, node and client in this process, \
         worker processes apart; each row runs {:.1} s)",
        options.run_time().as_secs_f64()
    );
    let dir = tempfile::tempdir().context("temporary folder")?;
    let hosting = || ActorHosting {
        registry: diagnostic_registry(),
        worker: WorkerCommand::current_exe(["remote-worker"]).ok(),
        ..ActorHosting::default()
    };
    let resources = crate::join::resources();
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let head = Head::start(HeadConfig {
        actors: hosting(),
        ..HeadConfig::loopback(StateDir::at(dir.path().join("head")), resources.clone())
    })
    .await
    .context("starting the head")?;
    let node = Node::start(NodeConfig {
        head: head.join_address(),
        token: head.token().clone(),
        ca_hash: head.ca_hash(),
        bind: loopback,
        advertise: None,
        state: StateDir::at(dir.path().join("node")),
        resources,
        transport: TransportOptions::default(),
        actors: hosting(),
    })
    .await
    .context("starting the node")?;
    let client = ClusterClient::connect(&StateDir::at(dir.path().join("head")), None)
        .await
        .context("connecting the client")?;

    run_header("actor host");
    let mut figures = None;
    for (host, group) in [("node daemon", ""), ("worker process", "bench")] {
        let actor = client
            .spawn(
                SpawnOptions::new(ECHO_KIND)
                    .strategy(Strategy::Node(node.node_id()))
                    .process_group(group),
            )
            .await
            .with_context(|| format!("spawning echo in the {host}"))?;
        for _ in 0..WARM_UP {
            call(&actor).await?;
        }
        let me = [std::process::id()];
        let meter = CpuMeter::start(&me);
        let mut sequential = calls(&actor, 1, options.run_time()).await?;
        sequential.cpu = meter.elapsed();
        run_row(host, "call, 1 task", &sequential);
        let latencies = sequential.latencies.as_ref().context("timed calls")?;
        let mut found = Figures {
            sequential_p50: latencies.median(),
            sequential_rate: sequential.per_second(),
            best_rate: (1, sequential.per_second()),
        };
        for tasks in CONCURRENT {
            let meter = CpuMeter::start(&me);
            let mut run = calls(&actor, tasks, options.run_time()).await?;
            run.cpu = meter.elapsed();
            run_row(host, &format!("call, {tasks} tasks"), &run);
            if run.per_second() > found.best_rate.1 {
                found.best_rate = (tasks, run.per_second());
            }
        }
        actor.kill().await.context("killing the actor")?;
        figures.get_or_insert(found);
    }
    println!(
        "CPU: this process (client, head and node daemon), not the worker process; a call \
         goes client -> node over QUIC, and for the worker on over its socket"
    );
    node.stop().await;
    head.stop().await;
    figures.context("no actor was measured")
}

/// `tasks` callers on one actor for `run_time`, each waiting for its reply before the next.
async fn calls(actor: &ActorRef, tasks: usize, run_time: Duration) -> Result<Run> {
    let actor = actor.clone();
    timed_calls(tasks, run_time, move |_, _| {
        let actor = actor.clone();
        async move { call(&actor).await }
    })
    .await
}

/// One call, its answer checked.
async fn call(actor: &ActorRef) -> Result<()> {
    let payload = [7u8; PAYLOAD];
    let reply = actor
        .call("echo", payload.to_vec(), Duration::from_secs(10))
        .await
        .context("calling echo")?;
    anyhow::ensure!(reply == payload, "echo answered {} bytes", reply.len());
    Ok(())
}
