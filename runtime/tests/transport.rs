//! The secure transport on loopback: who gets through which configuration, that bad
//! peers (wrong CA, garbage datagrams, garbage frames) close their own stream or
//! connection and never the server, and QUIC datagrams: answered, dropped when bad,
//! refused where a side takes none. A server on a thread of its own serves there, and
//! the thread ends with it.

use std::future::Future;
use std::net::{SocketAddr, UdpSocket};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use runtime::wire::{Message, WIRE_VERSION, encode};
use runtime::{
    CaHash, Client, ClientTls, ClusterCa, Connection, Handler, NodeCredentials, Peer, PeerIdentity,
    Server, ServerTls, TransportError, TransportOptions,
};

/// Every test finishes well within this, or fails.
const LIMIT: Duration = Duration::from_secs(60);
/// How long a single request may take.
const REQUEST: Duration = Duration::from_secs(10);

async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    match tokio::time::timeout(LIMIT, future).await {
        Ok(value) => value,
        Err(_) => panic!("{what}: not done within {LIMIT:?}"),
    }
}

/// A CA with credentials for a head and a node.
struct Certificates {
    ca: ClusterCa,
    head: NodeCredentials,
    node: NodeCredentials,
}

fn certificates() -> Certificates {
    let ca = ClusterCa::generate().expect("ca");
    let head = ca.issue("head", &[]).expect("head credentials");
    let node = ca.issue("gpu-01", &[]).expect("node credentials");
    Certificates { ca, head, node }
}

impl Certificates {
    fn head_tls(&self) -> ServerTls {
        ServerTls::head(self.ca.certificate(), &self.head).expect("head tls")
    }

    fn node_tls(&self) -> ServerTls {
        ServerTls::node(self.ca.certificate(), &self.node).expect("node tls")
    }

    fn member(&self, name: &str) -> ClientTls {
        let creds = self.ca.issue(name, &[]).expect("credentials");
        ClientTls::mutual(self.ca.certificate(), &creds).expect("client tls")
    }
}

/// Answers a heartbeat with its ack, never answers a stop request, and answers anything
/// else with who the peer is.
async fn handler(peer: Peer, request: Message) -> Message {
    match request {
        Message::Heartbeat { seq, .. } => Message::HeartbeatAck { seq },
        Message::StopRequest { .. } => std::future::pending().await,
        _ => Message::Error {
            message: match peer.identity {
                PeerIdentity::Authenticated { name } => format!("authenticated:{name}"),
                PeerIdentity::Unauthenticated => "unauthenticated".to_owned(),
            },
        },
    }
}

/// A server on a free loopback port, serving [`handler`].
fn serve(tls: &ServerTls) -> (Server, SocketAddr) {
    let server = Server::bind(SocketAddr::from(([127, 0, 0, 1], 0)), tls).expect("bind");
    let address = server.local_addr().expect("local address");
    let serving = server.clone();
    tokio::spawn(async move { serving.accept_loop(handler).await });
    (server, address)
}

/// Who the server says we are.
async fn identity(connection: &Connection) -> String {
    match connection.request(&Message::StatusRequest, REQUEST).await {
        Ok(Message::Error { message }) => message,
        other => panic!("unexpected answer {other:?}"),
    }
}

async fn heartbeat(connection: &Connection, seq: u64) -> Result<Message, TransportError> {
    let beat = Message::Heartbeat {
        node_id: 1,
        session: 1,
        seq,
        gpus: Vec::new(),
    };
    connection.request(&beat, REQUEST).await
}

/// Fails if `result` (a connection, or a first request on it) got past the handshake.
fn assert_refused<T: std::fmt::Debug>(
    what: &str,
    result: Result<T, TransportError>,
    peer: SocketAddr,
) {
    match result {
        Err(error @ TransportError::Handshake { .. }) => {
            assert!(
                error.to_string().contains(&peer.to_string()),
                "{what}: {error}"
            );
        }
        other => panic!("{what}: expected a failed handshake, got {other:?}"),
    }
}

/// Connects and makes one request: a certificate the server refuses may only show once
/// the client sends something, since in TLS 1.3 the client finishes first.
async fn connect_and_ask(peer: SocketAddr, tls: &ClientTls) -> Result<Message, TransportError> {
    let connection = Client::connect(peer, tls).await?;
    connection.request(&Message::StatusRequest, REQUEST).await
}

#[tokio::test]
async fn a_joining_node_with_the_right_ca_hash_gets_in_unauthenticated() {
    let cluster = certificates();
    let (_server, address) = serve(&cluster.head_tls());
    let join = ClientTls::join(cluster.ca.ca_hash()).expect("join tls");
    let connection = within("connect", Client::connect(address, &join))
        .await
        .expect("connect");
    assert_eq!(
        within("ask", identity(&connection)).await,
        "unauthenticated"
    );
}

#[tokio::test]
async fn a_wrong_ca_hash_fails_the_handshake() {
    let cluster = certificates();
    let (_server, address) = serve(&cluster.head_tls());
    let other = ClusterCa::generate().expect("other ca");
    let zeros: CaHash = format!("sha256:{}", "0".repeat(64)).parse().expect("hash");
    for pinned in [other.ca_hash(), zeros] {
        let join = ClientTls::join(pinned).expect("join tls");
        let result = within("connect", Client::connect(address, &join)).await;
        let error = match result {
            Err(error @ TransportError::Handshake { .. }) => error,
            other => panic!("expected a failed handshake, got {other:?}"),
        };
        let message = error.to_string();
        assert!(message.contains(&address.to_string()), "{message}");
        assert!(message.contains("pinned CA hash"), "{message}");
    }
}

#[tokio::test]
async fn members_are_authenticated_by_name_on_head_and_node() {
    let cluster = certificates();
    let (_head, head_address) = serve(&cluster.head_tls());
    let (_node, node_address) = serve(&cluster.node_tls());
    let member = cluster.member("gpu-02");
    for address in [head_address, node_address] {
        let connection = within("connect", Client::connect(address, &member))
            .await
            .expect("connect");
        assert_eq!(
            within("ask", identity(&connection)).await,
            "authenticated:gpu-02"
        );
    }
}

#[tokio::test]
async fn a_server_can_connect_from_its_own_port() {
    let cluster = certificates();
    let (_head, head_address) = serve(&cluster.head_tls());
    let (node, node_address) = serve(&cluster.node_tls());
    let member = ClientTls::mutual(cluster.ca.certificate(), &cluster.node).expect("client tls");
    let connection = within("connect", node.connect(head_address, &member))
        .await
        .expect("connect");
    assert_eq!(
        within("ask", identity(&connection)).await,
        "authenticated:gpu-01"
    );
    assert_ne!(node_address, head_address);
}

#[tokio::test]
async fn certificates_of_another_ca_are_refused() {
    let cluster = certificates();
    let (_head, head_address) = serve(&cluster.head_tls());
    let (_node, node_address) = serve(&cluster.node_tls());
    let other = ClusterCa::generate().expect("other ca");
    let intruder = other.issue("intruder", &[]).expect("intruder credentials");
    // The intruder trusts our CA for the server, but shows a certificate of its own CA.
    let intruder_tls =
        ClientTls::mutual(cluster.ca.certificate(), &intruder).expect("intruder tls");
    for (what, address) in [("node", node_address), ("head", head_address)] {
        let result = within(what, connect_and_ask(address, &intruder_tls)).await;
        assert_refused(what, result, address);
    }
    // A node server lets nobody in without a certificate.
    let join = ClientTls::join(cluster.ca.ca_hash()).expect("join tls");
    let result = within("join to node", connect_and_ask(node_address, &join)).await;
    assert_refused("join to node", result, node_address);
    // And a member does not trust a server of another CA.
    let impostor = ServerTls::node(other.certificate(), &intruder).expect("impostor tls");
    let (_impostor, impostor_address) = serve(&impostor);
    let result = within(
        "impostor",
        Client::connect(impostor_address, &cluster.member("gpu-02")),
    )
    .await;
    assert_refused("impostor", result, impostor_address);
}

#[tokio::test]
async fn garbage_datagrams_do_not_disturb_the_server() {
    let cluster = certificates();
    let (_server, address) = serve(&cluster.node_tls());
    let socket = UdpSocket::bind("127.0.0.1:0").expect("udp socket");
    let mut rng = StdRng::seed_from_u64(7);
    for round in 0..200 {
        let len = if round % 2 == 0 {
            1200
        } else {
            rng.random_range(1..1500)
        };
        let mut datagram = vec![0u8; len];
        rng.fill(datagram.as_mut_slice());
        if round % 4 == 0 {
            // A long header with QUIC v1: the server parses it as an Initial packet.
            datagram[0] = 0xC0 | (datagram[0] & 0x0F);
            datagram[1..5].copy_from_slice(&1u32.to_be_bytes());
        }
        socket.send_to(&datagram, address).expect("send garbage");
    }
    let member = cluster.member("gpu-02");
    let connection = within("connect", Client::connect(address, &member))
        .await
        .expect("connect");
    let ack = within("heartbeat", heartbeat(&connection, 1))
        .await
        .expect("heartbeat");
    assert_eq!(ack, Message::HeartbeatAck { seq: 1 });
}

#[tokio::test]
async fn a_bad_frame_closes_its_stream_only() {
    let cluster = certificates();
    let (_server, address) = serve(&cluster.node_tls());
    let connection = within(
        "connect",
        Client::connect(address, &cluster.member("gpu-02")),
    )
    .await
    .expect("connect");
    let good = encode(&Message::Ack).expect("encode");
    let payload_len = (good.len() - 6) as u32;
    let frame = |len: u32, version: u16, payload: &[u8]| {
        let mut bytes = len.to_le_bytes().to_vec();
        bytes.extend_from_slice(&version.to_le_bytes());
        bytes.extend_from_slice(payload);
        bytes
    };
    let cases: [(&str, Vec<u8>); 6] = [
        ("text", b"hello, server".to_vec()),
        (
            "future version",
            frame(payload_len, WIRE_VERSION + 1, &good[6..]),
        ),
        ("truncated", frame(100, WIRE_VERSION, &[0; 10])),
        ("oversized", frame(u32::MAX, WIRE_VERSION, &[])),
        ("invalid archive", frame(32, WIRE_VERSION, &[0xAB; 32])),
        ("half a header", vec![1, 2, 3]),
    ];
    for (seq, (case, bytes)) in (0u64..).zip(cases) {
        let result = within(case, connection.request_encoded(&bytes, REQUEST)).await;
        match result {
            Err(TransportError::StreamReset { code: 1, .. }) => {}
            other => panic!("{case}: expected the stream closed, got {other:?}"),
        }
        let ack = within(case, heartbeat(&connection, seq)).await;
        assert_eq!(
            ack.expect("the next request works"),
            Message::HeartbeatAck { seq },
            "{case}"
        );
    }
    // A stream that ends before any frame is no request; it gets no answer.
    let result = within("empty", connection.request_encoded(&[], REQUEST)).await;
    assert!(
        matches!(result, Err(TransportError::NoResponse { .. })),
        "{result:?}"
    );
    // The frame a client would have sent is accepted as such.
    let ack = within("pre-encoded", connection.request_encoded(&good, REQUEST)).await;
    assert!(matches!(ack, Ok(Message::Error { .. })), "{ack:?}");
}

#[tokio::test]
async fn many_concurrent_requests_on_one_connection_all_complete() {
    let cluster = certificates();
    let (_server, address) = serve(&cluster.node_tls());
    let connection = within(
        "connect",
        Client::connect(address, &cluster.member("gpu-02")),
    )
    .await
    .expect("connect");
    let mut requests = tokio::task::JoinSet::new();
    for seq in 0..1000u64 {
        let connection = connection.clone();
        requests.spawn(async move { (seq, heartbeat(&connection, seq).await) });
    }
    let mut answered = 0;
    while let Some(done) = within("requests", requests.join_next()).await {
        let (seq, ack) = done.expect("request task");
        assert_eq!(ack.expect("answer"), Message::HeartbeatAck { seq });
        answered += 1;
    }
    assert_eq!(answered, 1000);
}

#[tokio::test]
async fn a_slow_answer_times_out_and_the_connection_goes_on() {
    let cluster = certificates();
    let (_server, address) = serve(&cluster.node_tls());
    let connection = within(
        "connect",
        Client::connect(address, &cluster.member("gpu-02")),
    )
    .await
    .expect("connect");
    let after = Duration::from_millis(200);
    let result = within(
        "stop",
        connection.request(&Message::StopRequest { all: false }, after),
    )
    .await;
    match result {
        Err(error @ TransportError::Timeout { .. }) => {
            assert!(error.to_string().contains(&address.to_string()), "{error}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    let ack = within("heartbeat", heartbeat(&connection, 9))
        .await
        .expect("heartbeat");
    assert_eq!(ack, Message::HeartbeatAck { seq: 9 });
}

#[tokio::test]
async fn closing_ends_the_accept_loop_and_its_connections() {
    let cluster = certificates();
    let server =
        Server::bind(SocketAddr::from(([127, 0, 0, 1], 0)), &cluster.node_tls()).expect("bind");
    let address = server.local_addr().expect("local address");
    let serving = server.clone();
    let accept_loop = tokio::spawn(async move { serving.accept_loop(handler).await });
    let connection = within(
        "connect",
        Client::connect(address, &cluster.member("gpu-02")),
    )
    .await
    .expect("connect");
    within("heartbeat", heartbeat(&connection, 1))
        .await
        .expect("heartbeat");
    server.close();
    within("accept loop", accept_loop)
        .await
        .expect("accept loop ends");
    let result = within("after close", heartbeat(&connection, 2)).await;
    assert!(
        matches!(result, Err(TransportError::Closed { .. })),
        "{result:?}"
    );
}

#[tokio::test]
async fn a_server_on_a_thread_of_its_own_serves_there_and_the_thread_ends_with_it() {
    // At most 15 bytes: what Linux keeps of a thread's name.
    const THREAD: &str = "quic-test-own";
    let cluster = certificates();
    let server = Server::bind_on_thread(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        &cluster.node_tls(),
        TransportOptions::default(),
        THREAD,
    )
    .expect("bind");
    let address = server.local_addr().expect("local address");
    let serving = server.clone();
    // Answers a heartbeat with its ack and anything else with the thread it runs on.
    let on_thread = |_peer: Peer, request: Message| async move {
        match request {
            Message::Heartbeat { seq, .. } => Message::HeartbeatAck { seq },
            _ => Message::Error {
                message: std::thread::current().name().unwrap_or("").to_owned(),
            },
        }
    };
    let accept_loop = tokio::spawn(async move { serving.accept_loop(on_thread).await });
    let connection = within(
        "connect",
        Client::connect(address, &cluster.member("gpu-02")),
    )
    .await
    .expect("connect");
    assert_eq!(identity(&connection).await, THREAD);
    let mut requests = tokio::task::JoinSet::new();
    for seq in 0..1000u64 {
        let connection = connection.clone();
        requests.spawn(async move { (seq, heartbeat(&connection, seq).await) });
    }
    while let Some(done) = within("requests", requests.join_next()).await {
        let (seq, ack) = done.expect("request task");
        assert_eq!(ack.expect("answer"), Message::HeartbeatAck { seq });
    }
    assert_eq!(threads_named(THREAD), 1, "one thread serves");
    server.close();
    within("accept loop", accept_loop)
        .await
        .expect("accept loop ends");
    drop((server, connection));
    // The thread ends once its endpoint and connections are gone; nothing announces it,
    // so this looks, within the test's limit.
    within("the server's thread ends", async {
        while threads_named(THREAD) > 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
}

/// How many threads of this process are named `name`.
fn threads_named(name: &str) -> usize {
    let tasks = std::fs::read_dir("/proc/self/task").expect("/proc/self/task");
    tasks
        .filter_map(Result::ok)
        .filter_map(|task| std::fs::read_to_string(task.path().join("comm")).ok())
        .filter(|comm| comm.trim_end() == name)
        .count()
}

/// [`handler`] on streams; on datagrams, a heartbeat's ack (refused for `seq` 0) and
/// nothing for anything else, keeping every datagram it was given.
#[derive(Default)]
struct Datagrams {
    seen: Arc<Mutex<Vec<Message>>>,
}

impl Handler for Datagrams {
    fn handle(&self, peer: Peer, request: Message) -> impl Future<Output = Message> + Send {
        handler(peer, request)
    }

    fn datagram(&self, _peer: &Peer, message: Message) -> Option<Message> {
        self.seen
            .lock()
            .expect("nothing panics holding it")
            .push(message.clone());
        match message {
            Message::Heartbeat { seq: 0, .. } => Some(Message::HeartbeatRefused {
                seq: 0,
                reason: "no session".into(),
            }),
            Message::Heartbeat { seq, .. } => Some(Message::HeartbeatAck { seq }),
            _ => None,
        }
    }
}

/// A server with `options` serving [`Datagrams`], and a member's connection to it made
/// with `client`.
async fn datagram_pair(
    options: TransportOptions,
    client: TransportOptions,
) -> (Server, Connection, Arc<Mutex<Vec<Message>>>) {
    let cluster = certificates();
    let server = Server::bind_with(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        &cluster.node_tls(),
        options,
    )
    .expect("bind");
    let address = server.local_addr().expect("local address");
    let handler = Datagrams::default();
    let seen = handler.seen.clone();
    let serving = server.clone();
    tokio::spawn(async move { serving.accept_loop(handler).await });
    let connection = within(
        "connect",
        Client::connect_with(address, &cluster.member("gpu-02"), &client),
    )
    .await
    .expect("connect");
    (server, connection, seen)
}

/// Sends the heartbeat `seq` as a datagram until an answer naming it comes (a datagram
/// may be lost, even on loopback), and returns that answer.
async fn beat_by_datagram(connection: &Connection, seq: u64) -> Message {
    let beat = Message::Heartbeat {
        node_id: 1,
        session: 1,
        seq,
        gpus: Vec::new(),
    };
    within("datagram answer", async {
        loop {
            connection.send_datagram(&beat).expect("send datagram");
            let answer = tokio::time::timeout(Duration::from_millis(500), async {
                loop {
                    match connection.read_datagram().await.expect("read datagram") {
                        Message::HeartbeatAck { seq: got }
                        | Message::HeartbeatRefused { seq: got, .. }
                            if got != seq => {}
                        answer => return answer,
                    }
                }
            })
            .await;
            if let Ok(answer) = answer {
                return answer;
            }
        }
    })
    .await
}

#[tokio::test]
async fn datagrams_are_answered_by_datagrams_and_bad_ones_are_dropped() {
    let (_server, connection, seen) =
        datagram_pair(TransportOptions::default(), TransportOptions::default()).await;
    assert_eq!(
        beat_by_datagram(&connection, 1).await,
        Message::HeartbeatAck { seq: 1 }
    );
    assert_eq!(
        beat_by_datagram(&connection, 0).await,
        Message::HeartbeatRefused {
            seq: 0,
            reason: "no session".into()
        }
    );
    let good = encode(&Message::Ack).expect("encode");
    let frame = |len: u32, version: u16, payload: &[u8]| {
        let mut bytes = len.to_le_bytes().to_vec();
        bytes.extend_from_slice(&version.to_le_bytes());
        bytes.extend_from_slice(payload);
        bytes
    };
    let garbage: [(&str, Vec<u8>); 7] = [
        ("empty", Vec::new()),
        ("text", b"hello, server".to_vec()),
        (
            "future version",
            frame((good.len() - 6) as u32, WIRE_VERSION + 1, &good[6..]),
        ),
        ("truncated", frame(100, WIRE_VERSION, &[0; 10])),
        ("oversized", frame(u32::MAX, WIRE_VERSION, &[])),
        ("invalid archive", frame(32, WIRE_VERSION, &[0xAB; 32])),
        ("trailing bytes", [good.as_slice(), &[0]].concat()),
    ];
    for (case, bytes) in garbage {
        connection
            .send_datagram_encoded(bytes)
            .unwrap_or_else(|error| panic!("{case}: {error}"));
    }
    // A valid message the handler does not answer.
    connection.send_datagram(&Message::Ack).expect("send ack");
    // Datagrams from one sender are not reordered on loopback in practice, but may be:
    // the next answer proves the connection goes on, not that garbage came first.
    assert_eq!(
        beat_by_datagram(&connection, 2).await,
        Message::HeartbeatAck { seq: 2 }
    );
    // Only valid frames reach the handler: heartbeats and the ack.
    let seen = seen.lock().expect("nothing panicked holding it").clone();
    assert!(
        seen.iter()
            .all(|m| matches!(m, Message::Heartbeat { .. } | Message::Ack)),
        "{seen:?}"
    );
    // Streams work beside datagrams.
    let ack = within("heartbeat", heartbeat(&connection, 3))
        .await
        .expect("heartbeat");
    assert_eq!(ack, Message::HeartbeatAck { seq: 3 });
}

#[tokio::test]
async fn datagrams_are_refused_where_a_side_takes_none_or_they_do_not_fit() {
    let off = TransportOptions {
        datagrams: false,
        ..TransportOptions::default()
    };
    let beat = Message::Heartbeat {
        node_id: 1,
        session: 1,
        seq: 1,
        gpus: Vec::new(),
    };
    // (case, server options, client options)
    let cases = [
        (
            "the server takes none",
            off.clone(),
            TransportOptions::default(),
        ),
        (
            "the client sends none",
            TransportOptions::default(),
            off.clone(),
        ),
    ];
    for (case, server, client) in cases {
        let (_server, connection, _) = datagram_pair(server, client).await;
        match connection.send_datagram(&beat) {
            Err(error @ TransportError::NoDatagram { max: None, .. }) => {
                let text = error.to_string();
                assert!(
                    text.contains("no datagrams on this connection"),
                    "{case}: {text}"
                );
            }
            other => panic!("{case}: expected no datagrams, got {other:?}"),
        }
        // What the heartbeat falls back to.
        let ack = within(case, heartbeat(&connection, 1)).await.expect(case);
        assert_eq!(ack, Message::HeartbeatAck { seq: 1 }, "{case}");
    }
    let (_server, connection, _) =
        datagram_pair(TransportOptions::default(), TransportOptions::default()).await;
    let large = Message::Error {
        message: "x".repeat(64 << 10),
    };
    match connection.send_datagram(&large) {
        Err(TransportError::NoDatagram {
            size,
            max: Some(max),
            ..
        }) => assert!(size > max, "{size} bytes refused with a limit of {max}"),
        other => panic!("expected too large a datagram, got {other:?}"),
    }
}
