//! The head and node daemons and the cluster client, in process, over real QUIC through
//! the test network (`common/net.rs`): joins and their refusals, failure detection of a
//! node dropped without a word (as SIGKILL leaves it) or cut off by a partition, rejoins,
//! heartbeats cut from their port, a slow link, a restarted head, heartbeats as datagrams
//! and on streams, stopping the cluster, and what a client sees from the head's machine
//! and from a node's.
//!
//! Membership is fast (heartbeats every 50 ms, dead after 500 ms). Nothing sleeps to wait:
//! tests wait for the head's events, the daemons' `stopped()`, or requests, each under
//! [`LIMIT`].

mod common;
#[path = "common/log.rs"]
mod log_writer;

use std::net::{SocketAddr, UdpSocket};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use runtime::wire::{
    BeatGate, BeatKey, BeatKind, BeatPacket, GpuSampleWire, GpuUseWire, GpuWire, Message,
    NodeDescription, ResourcesWire,
};
use runtime::{
    ActorHosting, CONNECT_TIMEOUT, CaHash, Client, ClientTls, ClusterCa, ClusterClient,
    ClusterEvent, ClusterStatus, Connection, DaemonError, Head, HeadConfig, JoinToken, LossReason,
    MembershipConfig, Node, NodeConfig, NodeId, NodeState, Peer, Resources, StateDir, Strategy,
    TransportOptions,
};

use common::cluster::TestCluster;
use common::net::{Action, HEAD, Traffic};
use common::{DEAD_AFTER_MS, HEARTBEAT_MS, LIMIT, resources, within};
use log_writer::LogWriter;
use tokio::sync::broadcast;

/// The cluster of most tests: a head of 4 CPUs and 2 GPUs, default actor hosting.
async fn start() -> TestCluster {
    TestCluster::start(2, ActorHosting::default()).await
}

async fn wait_status(
    head: &Head,
    what: &str,
    done: impl Fn(&ClusterStatus) -> bool,
) -> ClusterStatus {
    let mut events = head.subscribe();
    within(what, async {
        loop {
            let status = head.status();
            if done(&status) {
                return status;
            }
            match events.recv().await {
                Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => panic!("{what}: head gone"),
            }
        }
    })
    .await
}

/// Waits for the first event that `wanted` picks.
async fn wait_event<T>(
    events: &mut broadcast::Receiver<ClusterEvent>,
    what: &str,
    wanted: impl Fn(ClusterEvent) -> Option<T>,
) -> T {
    within(what, async {
        loop {
            match events.recv().await {
                Ok(event) => {
                    if let Some(found) = wanted(event) {
                        return found;
                    }
                }
                Err(error) => panic!("{what}: {error}"),
            }
        }
    })
    .await
}

/// (id, state) of every node, in id order.
fn states(status: &ClusterStatus) -> Vec<(NodeId, NodeState)> {
    status.nodes.iter().map(|n| (n.id, n.state)).collect()
}

fn alive(status: &ClusterStatus) -> usize {
    status
        .nodes
        .iter()
        .filter(|n| n.state == NodeState::Alive)
        .count()
}

#[tokio::test]
async fn a_head_and_two_nodes_form_a_cluster_with_their_resources() {
    let cluster = start().await;
    let one = cluster.join("one", 1).await;
    // `two` advertises nothing: its address is the one it bound (`one`'s is the test
    // network's relay in front of it).
    let mut config = cluster.node_config("two", 2, 3);
    config.advertise = None;
    let two = within("two", cluster.start_node("two", config))
        .await
        .expect("two joins");
    let status = cluster.head.status();
    let expected = [
        (
            cluster.head.node_id(),
            "head",
            cluster.head.join_address(),
            2,
        ),
        (one.node_id(), "one", one.address().to_owned(), 1),
        (two.node_id(), "two", two.address().to_owned(), 3),
    ];
    assert_eq!(status.nodes.len(), expected.len(), "{status}");
    for (id, host, address, gpus) in expected {
        let node = status
            .node(id)
            .unwrap_or_else(|| panic!("node {id} in {status}"));
        assert_eq!(
            (
                node.hostname.as_str(),
                &node.address,
                node.state,
                node.gpus.len()
            ),
            (host, &address, NodeState::Alive, gpus)
        );
        assert!(node.gpus.iter().all(|gpu| gpu.name == "claimed GPU"));
    }
    assert_eq!(two.local_addr().to_string(), two.address());
    let totals = &status.totals;
    assert_eq!((totals.nodes, totals.cpus, totals.gpus), (3, 8, 6));
    let text = status.to_string();
    for word in ["NODE", "alive", "2x claimed GPU", "totals: 8 cpus"] {
        assert!(text.contains(word), "{word:?} missing from:\n{text}");
    }
    let json = serde_json::to_value(&status).expect("json");
    assert_eq!(json["totals"]["gpus"], 6);
    assert_eq!(json["nodes"][1]["state"], "alive");

    // Clients on the head's machine and on a node's see the same cluster.
    for machine in ["head", "one"] {
        let client = within(
            machine,
            ClusterClient::connect(&cluster.state(machine), None),
        )
        .await
        .unwrap_or_else(|error| panic!("client on {machine}: {error}"));
        let seen = within("status", client.status()).await.expect("status");
        assert_eq!(states(&seen), states(&status), "from {machine}");
        assert_eq!(seen.totals.gpus, 6);
    }
    // Credentials on disk are private.
    for file in ["node/node-key.pem", "node/node.pem", "node/node.json"] {
        let path = cluster.state("one").path(file);
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&path).expect("metadata").permissions(),
        );
        assert_eq!(mode & 0o777, 0o600, "{}", path.display());
    }
}

/// How a join is made wrong, and a word its error must hold.
type BadJoin = (&'static str, fn(&mut NodeConfig, SocketAddr), &'static str);

#[tokio::test]
async fn bad_joins_fail_fast_with_clear_errors_and_leave_the_head_alone() {
    let cluster = start().await;
    let one = cluster.join("one", 1).await;
    let silent = UdpSocket::bind("127.0.0.1:0").expect("silent socket");
    let silent_address = silent.local_addr().expect("address");
    let cases: [BadJoin; 3] = [
        (
            "wrong token",
            |c, _| c.token = JoinToken::generate(),
            "refused the join: bad token",
        ),
        (
            "wrong ca hash",
            |c, _| c.ca_hash = ClusterCa::generate().expect("ca").ca_hash(),
            "does not match sha256:",
        ),
        (
            "no head there",
            |c, silent| c.head = silent.to_string(),
            "cannot reach head",
        ),
    ];
    for (what, spoil, word) in cases {
        let mut config = cluster.node_config(what, 2, 1);
        spoil(&mut config, silent_address);
        // Each join gives up by itself: connecting and the answer have CONNECT_TIMEOUT
        // each, and only the silent head makes it wait one out; three are ample on a
        // loaded machine, and far below "retries until someone stops it".
        let limit = 3 * CONNECT_TIMEOUT;
        let error = tokio::time::timeout(limit, Node::start(config))
            .await
            .unwrap_or_else(|_| panic!("{what}: the join did not give up within {limit:?}"))
            .expect_err(what);
        let message = error.to_string();
        assert!(message.contains(word), "{what}: {message}");
    }

    // Without a certificate, nothing but a join with the token is answered.
    let connection = connect_to_join(&cluster.head).await;
    let join = join_request(&JoinToken::generate(), "intruder", "0");
    let heartbeat = Message::Heartbeat {
        node_id: one.node_id().0,
        session: one.session().0,
        seq: 1,
        gpus: Vec::new(),
    };
    for request in [
        join,
        heartbeat,
        Message::StatusRequest,
        Message::StopRequest { all: true },
        Message::ActorLocate { actor_id: 1 },
    ] {
        let answer = within("ask", connection.request(&request, LIMIT))
            .await
            .expect("answer");
        assert!(
            matches!(answer, Message::Refused { .. }),
            "{request:?} got {answer:?}"
        );
    }

    // Random datagrams to the head's port change nothing.
    let socket = UdpSocket::bind("127.0.0.1:0").expect("udp socket");
    let mut rng = StdRng::seed_from_u64(4);
    for _ in 0..200 {
        let mut datagram = vec![0u8; rng.random_range(1..1500)];
        rng.fill(datagram.as_mut_slice());
        socket
            .send_to(&datagram, cluster.head.local_addr())
            .expect("send");
    }
    let status = within("status", async {
        let client = ClusterClient::connect(&cluster.state("head"), None).await?;
        client.status().await
    })
    .await
    .expect("status after garbage");
    let sessions: Vec<_> = status.live_nodes().map(|n| n.id).collect();
    assert_eq!(
        sessions,
        [cluster.head.node_id(), one.node_id()],
        "{status}"
    );
    assert_eq!(
        cluster.head.live_node(one.node_id()).map(|(s, _)| s),
        Some(one.session())
    );
}

#[tokio::test]
async fn a_killed_node_is_declared_dead_in_its_window_and_comes_back_with_its_id() {
    let cluster = start().await;
    let survivor = cluster.join("survivor", 1).await;
    let victim = cluster.join("victim", 3).await;
    let (victim_id, victim_session) = (victim.node_id(), victim.session());
    let held = cluster
        .head
        .resource_table()
        .reserve(
            &Resources::new().with_gpus(2),
            Strategy::Node(victim_id),
            "actor:7",
        )
        .expect("reserve on the victim");
    let mut events = cluster.head.subscribe();

    // Dropping the node is what SIGKILL leaves: no leave, no more heartbeats.
    let killed_at = Instant::now();
    drop(victim);
    let lost = wait_event(&mut events, "victim declared dead", |event| match event {
        ClusterEvent::NodeLost {
            node,
            reason,
            reservations,
            ..
        } if node == victim_id => Some((reason, reservations)),
        _ => None,
    })
    .await;
    let detected = killed_at.elapsed();
    assert_eq!(lost, (LossReason::Dead, vec![held]));
    // Dead `dead_after` after its last heartbeat, which came at most one interval (and a
    // little scheduling) before the kill: never sooner, and on a loaded machine somewhat
    // later. The upper bound only has to tell the configured window from the default
    // (3 s); the exact deadline is membership_tests.rs's to check, on a simulated clock.
    let window = Duration::from_millis(DEAD_AFTER_MS);
    let earliest = window - Duration::from_millis(2 * HEARTBEAT_MS);
    let latest = 5 * window;
    assert!(
        MembershipConfig::default().dead_after_ms >= 6 * DEAD_AFTER_MS,
        "the default window must stand apart from the test's"
    );
    assert!(
        detected >= earliest && detected < latest,
        "declared dead after {detected:?}, window {window:?} (bounds {earliest:?}..{latest:?})"
    );
    let status = cluster.head.status();
    assert_eq!(
        status.node(victim_id).map(|n| n.state),
        Some(NodeState::Dead)
    );
    assert_eq!(
        status.node(survivor.node_id()).map(|n| n.state),
        Some(NodeState::Alive)
    );
    assert_eq!(
        (status.totals.nodes, status.totals.gpus),
        (2, 3),
        "{status}"
    );
    assert!(status.reservations.is_empty());
    assert!(cluster.head.live_node(victim_id).is_none());

    // The same machine joins again: same node id (its certificate), new session.
    let back = cluster.join("victim", 3).await;
    assert_eq!(back.node_id(), victim_id);
    assert_ne!(back.session(), victim_session);
    let status = cluster.head.status();
    assert_eq!(alive(&status), 3, "{status}");
    assert_eq!(status.totals.gpus, 6);
}

#[tokio::test]
async fn nodes_come_back_to_a_restarted_head() {
    let cluster = start().await;
    let one = cluster.join("one", 1).await;
    let two = cluster.join("two", 1).await;
    let (ca_hash, token) = (cluster.head.ca_hash(), cluster.head.token().clone());

    let cluster = cluster.restart_head().await;
    let head = &cluster.head;
    assert_eq!(
        (head.ca_hash(), head.token().as_str()),
        (ca_hash, token.as_str())
    );
    let status = wait_status(head, "both nodes back", |status| alive(status) == 3).await;
    let mut addresses: Vec<&str> = status.nodes.iter().map(|n| n.address.as_str()).collect();
    addresses.sort_unstable();
    let head_address = head.join_address();
    let mut expected = vec![one.address(), two.address(), &head_address];
    expected.sort_unstable();
    assert_eq!(addresses, expected);
}

/// The heartbeat port answers only a fresh beat tagged with a live session's key: forged,
/// replayed, foreign and garbage datagrams are counted by reason and never answered, and
/// do not disturb the session; once the session is over (the node went silent and was
/// declared dead), even a well-tagged beat of it is refused.
/// A free UDP port on loopback (free when this returns; taken by nobody in the meantime on
/// a test machine, in practice).
fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|socket| socket.local_addr())
        .expect("a free udp port")
        .port()
}

#[tokio::test]
async fn a_head_beats_on_the_port_it_is_given_and_refuses_one_it_cannot_have() {
    let port = free_udp_port();
    let cluster = TestCluster::start_with(2, ActorHosting::default(), |config| {
        config.beat_port = port;
    })
    .await;
    assert_eq!(cluster.head.beat_port(), port);
    let _node = cluster.join("one", 0).await;
    until("a beat taken on the given port", || {
        cluster.head.beat_counts().accepted > 0
    })
    .await;

    // A port held by another socket, and the head's own QUIC port: the head does not start,
    // and says which port.
    let held = std::net::UdpSocket::bind("127.0.0.1:0").expect("udp socket");
    let held_port = held.local_addr().expect("address").port();
    let quic_port = free_udp_port();
    for (what, bind_port, beat_port) in [("held", 0, held_port), ("quic", quic_port, quic_port)] {
        let dir = tempfile::tempdir().expect("temp dir");
        let config = HeadConfig {
            bind: SocketAddr::from(([127, 0, 0, 1], bind_port)),
            beat_port,
            ..HeadConfig::loopback(
                StateDir::at(dir.path().join("head")),
                resources("head", 4, 2),
            )
        };
        let error = within(what, Head::start(config))
            .await
            .expect_err("a head on a port it cannot have");
        assert!(
            matches!(&error, DaemonError::BeatPort { address, .. } if address.port() == beat_port),
            "{what}: {error:?}"
        );
        let text = error.to_string();
        assert!(
            text.contains(&format!("heartbeat port 127.0.0.1:{beat_port}")),
            "{what}: {text}"
        );
    }
    drop(held);
}

#[tokio::test]
async fn the_heartbeat_port_answers_only_fresh_beats_of_a_live_session() {
    let cluster = start().await;
    let port = cluster.head.beat_port();
    assert_ne!(port, 0, "the head has a heartbeat port");
    // A node of our own making, as `fake_nodes.rs` in the cluster bench: a join with the
    // token, which hands out the session's heartbeat key.
    let join = join_request(cluster.head.token(), "beater", env!("CARGO_PKG_VERSION"));
    let (node_id, session, beat_port, key) = join_by_hand(&cluster.head, &join).await;
    assert_eq!(beat_port, port);
    let mut events = cluster.head.subscribe();

    let socket = beat_socket(port).await;
    let beat = |seq, node_id, key: &BeatKey| {
        BeatPacket {
            kind: BeatKind::Beat,
            node_id,
            session,
            seq,
        }
        .seal(&key.hmac())
    };
    let mut gate = BeatGate::new(node_id, session, &key);
    let first = beat(1, node_id, &key);
    let other_key = BeatKey::generate().expect("key");
    let mut flipped = beat(2, node_id, &key);
    // The seq's last byte: the tag no longer matches.
    flipped[29] ^= 0x40;
    let mut long = beat(3, node_id, &key).to_vec();
    long.push(0);
    let ack = BeatPacket {
        kind: BeatKind::Ack,
        node_id,
        session,
        seq: 300,
    }
    .seal(&key.hmac());
    // (what, datagram, its own answer if it deserves one). A datagram that deserves none
    // is followed by a fresh beat, whose answer must then be the first to come: the head
    // reads its port in order.
    let cases: Vec<(&str, Vec<u8>, Option<u64>)> = vec![
        ("a fresh beat", first.to_vec(), Some(1)),
        ("the same beat again", first.to_vec(), None),
        ("an older seq", beat(1, node_id, &key).to_vec(), None),
        ("another key", beat(200, node_id, &other_key).to_vec(), None),
        ("a changed byte", flipped.to_vec(), None),
        (
            "another node",
            beat(200, node_id + 1000, &key).to_vec(),
            None,
        ),
        ("empty", Vec::new(), None),
        ("a byte too long", long, None),
        ("text", b"hello, head".to_vec(), None),
        ("an ack", ack.to_vec(), None),
        (
            "a fresh beat after all that",
            beat(400, node_id, &key).to_vec(),
            Some(400),
        ),
    ];
    let mut probe = 100u64;
    for (what, datagram, own) in cases {
        socket.send(&datagram).await.expect("send");
        let want = match own {
            Some(seq) => seq,
            None => {
                probe += 1;
                socket
                    .send(&beat(probe, node_id, &key))
                    .await
                    .expect("send");
                probe
            }
        };
        let mut buffer = [0u8; 128];
        let len = within(what, socket.recv(&mut buffer))
            .await
            .expect("receive");
        let got = gate.take(&buffer[..len], BeatKind::Ack).map(|ack| ack.seq);
        assert_eq!(got, Ok(want), "{what}");
    }
    let counts = cluster.head.beat_counts();
    assert_eq!(
        (
            counts.forged,
            counts.replayed,
            counts.unknown,
            counts.garbage
        ),
        (2, 2, 1, 4),
        "{counts:?}"
    );
    assert_eq!(counts.accepted, 11, "{counts:?}");
    assert_eq!(
        cluster.head.live_node(NodeId(node_id)).map(|(s, _)| s.0),
        Some(session)
    );

    // Silent, the node is declared dead in its window; its key then opens nothing.
    wait_event(
        &mut events,
        "the silent node declared dead",
        |event| match event {
            ClusterEvent::NodeLost { node, reason, .. } if node == NodeId(node_id) => Some(reason),
            _ => None,
        },
    )
    .await;
    socket.send(&beat(1000, node_id, &key)).await.expect("send");
    let refused = within("the refusal counted", async {
        loop {
            let counts = cluster.head.beat_counts();
            if counts.unknown == 2 {
                return counts;
            }
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert_eq!(refused.accepted, counts.accepted, "{refused:?}");
    let mut buffer = [0u8; 128];
    assert!(
        socket.try_recv(&mut buffer).is_err(),
        "a beat of an ended session was answered"
    );
}

/// Heartbeats keep a node's session for many dead windows, every one acknowledged in
/// time (the node never thinks the head lost), and a head restarted under it refuses the
/// session and sees the node join again: as datagrams, and on streams to a head that
/// takes no datagrams.
#[tokio::test]
async fn heartbeats_keep_the_session_and_a_refusal_rejoins_with_or_without_datagrams() {
    // The test's runtime runs every task on this thread: the daemons' warnings land here.
    let logs = Arc::new(Mutex::new(Vec::new()));
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .with_writer(move || LogWriter(writer.clone()))
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let warnings = || String::from_utf8_lossy(&logs.lock().expect("log lock")).into_owned();
    for datagrams in [true, false] {
        let case = if datagrams { "datagrams" } else { "streams" };
        let transport = TransportOptions {
            datagrams,
            ..TransportOptions::default()
        };
        let cluster = TestCluster::start_with(2, ActorHosting::default(), |config| {
            config.transport = transport;
        })
        .await;
        let node = cluster.join("one", 1).await;
        let (id, session) = (node.node_id(), node.session());
        let mut events = cluster.head.subscribe();
        let before = warnings().len();
        // Time has to pass here: nothing may happen in it.
        tokio::time::sleep(Duration::from_millis(4 * DEAD_AFTER_MS)).await;
        // Suspicion (half the window) is left out: a loaded machine may stall this
        // thread that long.
        let meanwhile = warnings().split_off(before);
        assert!(
            !meanwhile.contains("runtime::node"),
            "{case}: the node warned\n{meanwhile}"
        );
        while let Ok(event) = events.try_recv() {
            assert!(
                !matches!(
                    event,
                    ClusterEvent::NodeLost { node, .. } if node == id
                ),
                "{case}: {event:?}"
            );
        }
        assert_eq!(
            cluster.head.live_node(id).map(|(s, _)| s),
            Some(session),
            "{case}"
        );
        assert_eq!(node.session(), session, "{case}");

        let cluster = cluster.restart_head().await;
        let head = &cluster.head;
        wait_status(head, case, |status| alive(status) == 2).await;
        let rejoined = head.live_node(id).map(|(s, _)| s);
        assert!(
            rejoined.is_some_and(|new| new != session),
            "{case}: the node is back in a new session ({rejoined:?})"
        );
    }
}

#[tokio::test]
async fn stop_all_from_the_head_machine_stops_every_daemon() {
    let cluster = start().await;
    let nodes = [cluster.join("one", 0).await, cluster.join("two", 1).await];
    let state = cluster.state("head");
    assert!(state.read("head/head.json").expect("read").is_some());
    let client = within("connect", ClusterClient::connect(&state, None))
        .await
        .expect("client");
    within("stop all", client.stop(true))
        .await
        .expect("stop all");
    within("head stopped", cluster.head.stopped()).await;
    for node in &nodes {
        within("node stopped", node.stopped()).await;
    }
    assert!(state.read("head/head.json").expect("read").is_none());
}

#[tokio::test]
async fn clients_on_nodes_see_the_cluster_but_cannot_stop_it_and_nodes_leave() {
    let cluster = start().await;
    let one = cluster.join("one", 1).await;
    let two = cluster.join("two", 2).await;
    let client = within(
        "connect",
        ClusterClient::connect(&cluster.state("two"), None),
    )
    .await
    .expect("client on a node");
    let error = within("stop", client.stop(true))
        .await
        .expect_err("refused");
    assert!(matches!(error, DaemonError::Refused { .. }), "{error}");
    assert!(
        error.to_string().contains("only the head's machine"),
        "{error}"
    );
    let error = within(
        "no head",
        ClusterClient::connect(&cluster.state("empty"), None),
    )
    .await
    .expect_err("no credentials");
    assert!(
        error
            .to_string()
            .contains("no head running on this machine"),
        "{error}"
    );

    // The actor layer's hook: requests that are not control messages go to it (a node's
    // own actor layer serves only starts, stops, calls and tells).
    one.set_actor_handler(Arc::new(|peer: Peer, request: Message| async move {
        Message::Error {
            message: format!("{} asked for {request:?}", peer.name().unwrap_or("?")),
        }
    }));
    for (node, answer) in [
        (one.node_id(), "head asked for ActorLocate"),
        (two.node_id(), "a node does not serve actor locate requests"),
    ] {
        let connection = within("connect", cluster.head.connect_node(node))
            .await
            .expect("connect");
        let reply = within(
            "ask",
            connection.request(&Message::ActorLocate { actor_id: 9 }, LIMIT),
        )
        .await
        .expect("reply");
        let (Message::Error { message } | Message::Refused { reason: message }) = reply else {
            panic!("unexpected {reply:?}");
        };
        assert!(message.contains(answer), "{message}");
    }

    // A graceful stop ends the session at once.
    let mut events = cluster.head.subscribe();
    within("leave", one.stop()).await;
    let reason = wait_event(&mut events, "node left", |event| match event {
        ClusterEvent::NodeLost { node, reason, .. } if node == one.node_id() => Some(reason),
        _ => None,
    })
    .await;
    assert_eq!(reason, LossReason::Left);
    let status = within("status", client.status()).await.expect("status");
    assert_eq!(
        status.node(one.node_id()).map(|n| n.state),
        Some(NodeState::Left)
    );
    assert_eq!(
        (status.totals.nodes, status.totals.gpus),
        (2, 4),
        "{status}"
    );
}

/// Polls `done` every 20 ms until it holds, under [`LIMIT`].
async fn until(what: &str, done: impl Fn() -> bool) {
    within(what, async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

/// No `NodeLost` of `node` among the events received so far.
fn not_lost(events: &mut broadcast::Receiver<ClusterEvent>, node: NodeId, case: &str) {
    while let Ok(event) = events.try_recv() {
        assert!(
            !matches!(event, ClusterEvent::NodeLost { node: lost, .. } if lost == node),
            "{case}: {event:?}"
        );
    }
}

/// A partition between a node and the head (the test network drops every datagram
/// between them, both ways): the head declares the node dead and frees what it held, the
/// other node is untouched, and once the link heals the node joins again in a new
/// session, with its id.
#[tokio::test]
async fn a_node_cut_off_from_the_head_is_declared_dead_and_joins_again_once_the_link_heals() {
    let cluster = start().await;
    let one = cluster.join("one", 1).await;
    let two = cluster.join("two", 1).await;
    let (id, session) = (one.node_id(), one.session());
    let held = cluster
        .head
        .resource_table()
        .reserve(
            &Resources::new().with_gpus(1),
            Strategy::Node(id),
            "actor:3",
        )
        .expect("reserve on one");
    let mut events = cluster.head.subscribe();

    cluster.net.set("one", HEAD, Traffic::All, Action::Drop);
    let lost = wait_event(&mut events, "one declared dead", |event| match event {
        ClusterEvent::NodeLost {
            node,
            reason,
            reservations,
            ..
        } if node == id => Some((reason, reservations)),
        _ => None,
    })
    .await;
    assert_eq!(lost, (LossReason::Dead, vec![held]));
    let status = cluster.head.status();
    assert_eq!(status.node(id).map(|n| n.state), Some(NodeState::Dead));
    assert_eq!(
        cluster.head.live_node(two.node_id()).map(|(s, _)| s),
        Some(two.session()),
        "{status}"
    );

    cluster.net.heal("one", HEAD);
    let rejoined = wait_event(&mut events, "one joins again", |event| match event {
        ClusterEvent::NodeJoined { node, session, .. } if node == id => Some(session),
        _ => None,
    })
    .await;
    assert_ne!(rejoined, session);
    until("one in its new session", || one.session() == rejoined).await;
    let status = wait_status(&cluster.head, "three alive", |s| alive(s) == 3).await;
    assert_eq!(status.totals.gpus, 4, "{status}");
}

/// Heartbeats whose UDP port is cut (the test network drops them and their answers)
/// go over the node's QUIC connection instead: the session holds for several dead
/// windows, though not one beat reaches the heartbeat port.
#[tokio::test]
async fn heartbeats_cut_from_their_port_go_over_quic_and_keep_the_session() {
    let cluster = start().await;
    let one = cluster.join("one", 0).await;
    let (id, session) = (one.node_id(), one.session());
    until("a beat on the heartbeat port", || {
        cluster.head.beat_counts().accepted > 0
    })
    .await;

    cluster
        .net
        .set("one", HEAD, Traffic::Heartbeats, Action::Drop);
    let mut events = cluster.head.subscribe();
    // One beat may have been on its way when the rule came in.
    let accepted = cluster.head.beat_counts().accepted + 1;
    // Time has to pass here: nothing may happen in it.
    tokio::time::sleep(Duration::from_millis(4 * DEAD_AFTER_MS)).await;
    not_lost(&mut events, id, "heartbeats cut");
    assert_eq!(cluster.head.live_node(id).map(|(s, _)| s), Some(session));
    assert_eq!(one.session(), session);
    let counts = cluster.head.beat_counts();
    assert!(counts.accepted <= accepted, "{counts:?}");
}

/// A slow link (every datagram between a node and the head 100 ms late, both ways: a
/// round trip of 200 ms against a dead window of 500 ms) keeps its session, and what
/// crosses it arrives, later.
#[tokio::test]
async fn a_slow_link_keeps_its_session_and_delivers_late() {
    let cluster = start().await;
    let one = cluster.join("one", 0).await;
    let (id, session) = (one.node_id(), one.session());
    let delay = Duration::from_millis(100);
    cluster
        .net
        .set("one", HEAD, Traffic::All, Action::Delay(delay));
    let mut events = cluster.head.subscribe();

    // A client on `one` reaches the head over the slow link: its connection and its
    // request cost at least a round trip each.
    let asked = Instant::now();
    let client = cluster.client("one").await;
    let status = within("status", client.status()).await.expect("status");
    let took = asked.elapsed();
    assert!(took >= 4 * delay, "status over the slow link in {took:?}");
    assert_eq!(alive(&status), 2, "{status}");

    // Time has to pass here: nothing may happen in it.
    tokio::time::sleep(Duration::from_millis(4 * DEAD_AFTER_MS)).await;
    not_lost(&mut events, id, "slow link");
    assert_eq!(cluster.head.live_node(id).map(|(s, _)| s), Some(session));
    assert_eq!(one.session(), session);
}

#[tokio::test]
async fn the_join_command_is_what_nodes_type() {
    let cluster = start().await;
    let head = &cluster.head;
    let command = head.join_command();
    let words: Vec<&str> = command.split_whitespace().collect();
    assert_eq!(words.len(), 7, "{command}");
    assert_eq!(words[..3], ["imgrun", "join", head.join_address().as_str()]);
    assert_eq!((words[3], words[5]), ("--token", "--ca-hash"));
    let token: JoinToken = words[4].parse().expect("token");
    assert!(head.token().matches(token.as_str()));
    assert_eq!(words[6].parse::<CaHash>().ok(), Some(head.ca_hash()));
    assert_eq!(head.join_address(), head.local_addr().to_string());
}

#[tokio::test]
async fn gpu_use_a_beat_carries_shows_in_every_clients_status() {
    let cluster = start().await;
    let port = cluster.head.beat_port();
    assert_ne!(port, 0, "the head has a heartbeat port");
    // A node of our own making with a GPU NVML found (index 3 on its machine) and one
    // claimed with --num-gpus (index 1: its position).
    let gpu = |index, name: &str, uuid: &str| GpuWire {
        index,
        name: name.into(),
        memory_bytes: (index == 3).then_some(80 << 30),
        uuid: uuid.into(),
    };
    let join = Message::JoinRequest {
        token: cluster.head.token().as_str().to_owned(),
        node: NodeDescription {
            hostname: "sampled".into(),
            address: "127.0.0.1:1".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            resources: ResourcesWire {
                cpus: 1,
                memory_bytes: None,
                gpus: vec![
                    gpu(3, "NVIDIA H100 80GB HBM3", "GPU-34a0491e-4652"),
                    gpu(1, "claimed GPU", "claimed-1"),
                ],
            },
        },
    };
    let (node_id, session, _, key) = join_by_hand(&cluster.head, &join).await;
    let node = NodeId(node_id);
    let uses = |status: &ClusterStatus| -> Vec<(Option<u32>, Option<u64>)> {
        let node = status.node(node).expect("the node in the status");
        node.gpus
            .iter()
            .map(|gpu| (gpu.utilization_percent, gpu.memory_used_bytes))
            .collect()
    };
    assert_eq!(
        uses(&cluster.head.status()),
        [(None, None), (None, None)],
        "before any beat"
    );

    let socket = beat_socket(port).await;
    let sample = |index, percent, used| GpuSampleWire {
        index,
        usage: GpuUseWire {
            utilization_percent: Some(percent),
            memory_used_bytes: Some(used),
        },
    };
    // The claimed GPU's index gets a sample too, which the head must not believe.
    let samples = [sample(3, 37, 12_992_000_000), sample(1, 99, 1 << 30)];
    let datagram = BeatPacket {
        kind: BeatKind::Beat,
        node_id,
        session,
        seq: 1,
    }
    .seal_with_samples(&samples, &key.hmac());
    socket.send(&datagram).await.expect("send");
    let mut buffer = [0u8; 128];
    let len = within("the beat's ack", socket.recv(&mut buffer))
        .await
        .expect("receive");
    let mut gate = BeatGate::new(node_id, session, &key);
    assert_eq!(
        gate.take(&buffer[..len], BeatKind::Ack).map(|ack| ack.seq),
        Ok(1)
    );

    let want = [(Some(37), Some(12_992_000_000)), (None, None)];
    assert_eq!(uses(&cluster.head.status()), want, "at the head");
    let client = within(
        "client",
        ClusterClient::connect(&cluster.state("head"), None),
    )
    .await
    .expect("client");
    let seen = within("status", client.status()).await.expect("status");
    assert_eq!(uses(&seen), want, "through the wire");
    let text = seen.to_string();
    assert!(text.contains("37%   12.1/80.0 GiB"), "{text}");
    let json = serde_json::to_value(&seen).expect("json");
    let nodes = json["nodes"].as_array().expect("nodes");
    let ours = nodes
        .iter()
        .find(|found| found["id"] == node_id)
        .expect("the node in the json");
    let gpus = &ours["gpus"];
    assert_eq!(gpus[0]["utilization_percent"], 37, "{json}");
    assert!(gpus[1]["utilization_percent"].is_null(), "{json}");
}

/// A connection to `head` with no certificate: what a machine about to join has.
/// Joins `head` with `join` as a node of the test's own making: its node id, session,
/// the head's heartbeat port and the session's heartbeat key.
async fn join_by_hand(head: &Head, join: &Message) -> (u64, u64, u16, BeatKey) {
    let connection = connect_to_join(head).await;
    let answer = within("join", connection.request(join, LIMIT))
        .await
        .expect("join answer");
    connection.close();
    let Message::JoinAccepted {
        node_id,
        session,
        beat_port,
        beat_key,
        ..
    } = answer
    else {
        panic!("join answered {answer:?}");
    };
    let key = BeatKey::from_bytes(&beat_key).expect("a 32-byte key");
    (node_id, session, beat_port, key)
}

async fn connect_to_join(head: &Head) -> Connection {
    let tls = ClientTls::join(head.ca_hash()).expect("join tls");
    within("connect", Client::connect(head.local_addr(), &tls))
        .await
        .expect("connect")
}

/// A join with `token` from a one-CPU machine named `hostname`, of `version`.
fn join_request(token: &JoinToken, hostname: &str, version: &str) -> Message {
    Message::JoinRequest {
        token: token.as_str().to_owned(),
        node: NodeDescription {
            hostname: hostname.into(),
            address: "127.0.0.1:1".into(),
            version: version.into(),
            resources: ResourcesWire {
                cpus: 1,
                memory_bytes: None,
                gpus: vec![],
            },
        },
    }
}

/// A UDP socket on loopback that sends to the head's heartbeat port `port`.
async fn beat_socket(port: u16) -> tokio::net::UdpSocket {
    let socket = tokio::net::UdpSocket::bind("127.0.0.1:0")
        .await
        .expect("udp socket");
    socket
        .connect(SocketAddr::from(([127, 0, 0, 1], port)))
        .await
        .expect("connect udp");
    socket
}
