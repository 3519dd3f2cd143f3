//! Section 3: how long a node takes to join, from `Node::start` until the cluster's status
//! (`ClusterClient::status`, as `imgrun status` asks) shows it alive; a fresh node with a
//! fresh state folder each time, against one head in this process. Then the parts a join
//! is made of, timed on their own, to show what dominates.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use runtime::{
    ActorHosting, Client, ClientTls, ClusterCa, ClusterClient, ClusterEvent, DiscoverOptions, Head,
    HeadConfig, Node, NodeConfig, NodeResources, NodeState, StateDir, TransportOptions,
    VisibleDevices, discover,
};
use tokio::sync::broadcast;

use crate::Options;
use crate::measure::{Latencies, millis};

/// What the summary needs.
#[derive(Debug, Clone)]
pub struct Figures {
    pub visible_median: Duration,
    pub visible_max: Duration,
}

pub async fn run(options: &Options) -> Result<Figures> {
    let joins = if options.quick { 3 } else { 10 };
    println!(
        "3. join: Node::start until ClusterClient::status shows the node alive ({joins} fresh \
         nodes, state folders under {}, default membership: heartbeat 500 ms)",
        std::env::temp_dir().display()
    );
    let dir = tempfile::tempdir().context("temporary folder")?;
    let resources = resources();
    let head = Head::start(HeadConfig::loopback(
        StateDir::at(dir.path().join("head")),
        resources.clone(),
    ))
    .await
    .context("starting the head")?;
    let client = Arc::new(
        ClusterClient::connect(&StateDir::at(dir.path().join("head")), None)
            .await
            .context("connecting the cluster client")?,
    );

    let mut at_head = Vec::new();
    let mut started = Vec::new();
    let mut visible = Vec::new();
    for i in 0..joins {
        let mut resources = resources.clone();
        resources.hostname = Some(format!("bench-join-{i}"));
        let config = NodeConfig {
            head: head.join_address(),
            token: head.token().clone(),
            ca_hash: head.ca_hash(),
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            state: StateDir::at(dir.path().join(format!("node-{i}"))),
            resources,
            transport: TransportOptions::default(),
            actors: ActorHosting::default(),
        };
        let events = head.subscribe();
        let begin = Instant::now();
        let joined = tokio::spawn(first_join(events, begin));
        let node = Node::start(config)
            .await
            .with_context(|| format!("node {i} joining"))?;
        started.push(begin.elapsed());
        loop {
            let status = client.status().await.context("status")?;
            match status.node(node.node_id()).map(|n| n.state) {
                Some(NodeState::Alive) => break,
                Some(state) => bail!("node {} is {state} right after its join", node.node_id()),
                None if begin.elapsed() > Duration::from_secs(30) => {
                    bail!("node {} not in the status after 30 s", node.node_id())
                }
                None => {}
            }
        }
        visible.push(begin.elapsed());
        at_head.push(joined.await.context("event task")??);
        node.stop().await;
    }

    let at_head = Latencies::new(at_head);
    let started = Latencies::new(started);
    let visible = Latencies::new(visible);
    println!(
        "{:<58} {:>9} {:>9} {:>9}",
        "from Node::start to", "min ms", "median ms", "max ms"
    );
    for (what, latencies) in [
        (
            "the head admits it (NodeJoined event at the head)",
            &at_head,
        ),
        (
            "Node::start returns (credentials saved, port bound)",
            &started,
        ),
        ("ClusterClient::status shows it alive", &visible),
    ] {
        println!(
            "{what:<58} {:>9.2} {:>9.2} {:>9.2}",
            millis(latencies.min()),
            millis(latencies.median()),
            millis(latencies.max())
        );
    }
    parts(&head, &client, options).await?;
    head.stop().await;
    Ok(Figures {
        visible_median: visible.median(),
        visible_max: visible.max(),
    })
}

/// Waits for the next node to join and says when, after `begin`.
async fn first_join(
    mut events: broadcast::Receiver<ClusterEvent>,
    begin: Instant,
) -> Result<Duration> {
    loop {
        match events.recv().await {
            Ok(ClusterEvent::NodeJoined { .. }) => return Ok(begin.elapsed()),
            Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
            Err(broadcast::error::RecvError::Closed) => bail!("the head went away"),
        }
    }
}

/// The parts of a join on their own: the certificate the head issues, the node's first
/// handshake (no certificate, pinned CA), the four files a node writes with fsync, and
/// one status request.
async fn parts(head: &Head, client: &ClusterClient, options: &Options) -> Result<()> {
    let reps = if options.quick { 3 } else { 10 };
    let ca = ClusterCa::generate()?;
    let mut issue = Vec::new();
    for i in 0..reps {
        let start = Instant::now();
        ca.issue(&format!("node-{i:032x}"), &[])?;
        issue.push(start.elapsed());
    }
    let join_tls = ClientTls::join(head.ca_hash())?;
    let mut handshake = Vec::new();
    for _ in 0..reps {
        let start = Instant::now();
        let connection = Client::connect(head.local_addr(), &join_tls).await?;
        handshake.push(start.elapsed());
        connection.close();
    }
    let dir = tempfile::tempdir()?;
    let state = StateDir::at(dir.path());
    let pem = ca.issue("node-files", &[])?;
    let mut files = Vec::new();
    for i in 0..reps {
        let start = Instant::now();
        for (name, bytes) in [
            ("ca.pem", ca.certificate().pem().as_bytes()),
            ("node.pem", pem.cert_pem.as_bytes()),
            ("node-key.pem", pem.key_pem.as_bytes()),
            (
                "node.json",
                b"{\"head\": \"127.0.0.1:1\", \"node_id\": 1}".as_slice(),
            ),
        ] {
            state.write_private(&format!("node-{i}/{name}"), bytes)?;
        }
        files.push(start.elapsed());
    }
    let mut status = Vec::new();
    for _ in 0..reps {
        let start = Instant::now();
        client.status().await?;
        status.push(start.elapsed());
    }
    println!(
        "{:<58} {:>9} {:>9} {:>9}",
        "parts, timed alone", "min ms", "median ms", "max ms"
    );
    for (what, samples) in [
        (
            "certificate issued by the CA (P-256 key + signature)",
            issue,
        ),
        (
            "join handshake (new UDP socket, no client certificate)",
            handshake,
        ),
        ("4 state files written (write, fsync, rename each)", files),
        ("one status request on an open connection", status),
    ] {
        let latencies = Latencies::new(samples);
        println!(
            "{what:<58} {:>9.2} {:>9.2} {:>9.2}",
            millis(latencies.min()),
            millis(latencies.median()),
            millis(latencies.max())
        );
    }
    Ok(())
}

/// What every node (and the head) offers: 8 CPUs and 8 claimed GPUs, the machine's GPUs
/// hidden, so that discovery is quick and the same everywhere.
pub fn resources() -> NodeResources {
    discover(&DiscoverOptions {
        num_cpus: Some(8),
        num_gpus: Some(8),
        visible_devices: VisibleDevices::Set("-1".to_owned()),
    })
}
