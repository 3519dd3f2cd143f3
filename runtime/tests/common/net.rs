//! A test network between the daemons of one process, with a message filter: every UDP
//! datagram between two daemons of a [`TestCluster`](super::cluster::TestCluster) goes
//! through a relay of this module, which passes it, drops it or delays it by the rules
//! set for that pair of names. No root, no network namespace: loopback only.
//!
//! How the traffic is caught:
//! - Each machine reaches the head at an address of its own, `127.C.M.1` on the head's
//!   QUIC port and on its heartbeat port (C: the cluster, M: the machine). The relay
//!   there knows every datagram it gets is from that machine, whatever socket sent it
//!   (the node's endpoint, its heartbeat socket or a client on that machine).
//! - Each node advertises `127.C.M.2:port`, a relay in front of its real port; what
//!   arrives there is from whoever owns the sending address ([`Net::name`]): the head
//!   or another node (anything else is `client`).
//!
//! A relay forwards from one socket per sender, so the daemon behind it sees each peer
//! at an address of its own and answers back the way the datagram came; answers meet the
//! same rules, the other way round. QUIC makes the rest real: a dropped datagram is
//! resent, a partition ends in idle timeouts and missed heartbeats.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::net::UdpSocket;
use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// The name of the head in rules.
pub const HEAD: &str = "head";
/// The name of a sender no daemon owns (a client's own endpoint).
pub const CLIENT: &str = "client";

/// What a rule does to the datagrams it matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Drop,
    Delay(Duration),
}

/// Which datagrams between two names a rule matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Traffic {
    /// Everything: QUIC and heartbeats.
    All,
    /// The plain UDP heartbeats to the head's heartbeat port (and their answers) only.
    Heartbeats,
}

/// What a relay port carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Port {
    Quic,
    Heartbeats,
}

#[derive(Debug, Clone)]
struct Rule {
    between: (String, String),
    traffic: Traffic,
    action: Action,
}

impl Rule {
    /// Whether the rule is between `x` and `y`, either way.
    fn between(&self, x: &str, y: &str) -> bool {
        let (a, b) = (&self.between.0, &self.between.1);
        (a == x && b == y) || (a == y && b == x)
    }

    fn matches(&self, from: &str, to: &str, port: Port) -> bool {
        self.between(from, to) && (self.traffic == Traffic::All || port == Port::Heartbeats)
    }
}

/// The rules and the names of senders, shared by every relay of one network.
#[derive(Debug, Default)]
struct Filter {
    rules: Mutex<Vec<Rule>>,
    names: Mutex<HashMap<SocketAddr, String>>,
}

impl Filter {
    /// What happens to a datagram from `from` to `to`: the first matching rule's action
    /// (none: it passes at once).
    fn action(&self, from: &str, to: &str, port: Port) -> Option<Action> {
        let rules = self.rules.lock().expect("rules");
        rules
            .iter()
            .find(|rule| rule.matches(from, to, port))
            .map(|rule| rule.action)
    }

    fn name_of(&self, address: SocketAddr) -> String {
        let names = self.names.lock().expect("names");
        names
            .get(&address)
            .cloned()
            .unwrap_or_else(|| CLIENT.into())
    }
}

/// The relays of one test cluster, run on a thread of their own (so that a test blocking
/// its own runtime cannot stall the network), and the rules they follow.
pub struct Net {
    filter: Arc<Filter>,
    /// The second byte of this network's addresses, so that clusters of one test binary
    /// never share a relay address.
    cluster: u8,
    handle: Handle,
    _stop: oneshot::Sender<()>,
}

/// Who sent what a relay port receives.
#[derive(Debug, Clone)]
enum Sender {
    /// Everything comes from this machine (the port it reaches the head at).
    Machine(String),
    /// Whoever owns the sending address.
    ByAddress,
}

impl Net {
    pub fn new() -> Net {
        static CLUSTERS: AtomicU8 = AtomicU8::new(0);
        let cluster = CLUSTERS.fetch_add(1, Ordering::Relaxed) % 250 + 1;
        let (handle_tx, handle_rx) = std::sync::mpsc::channel();
        let (stop, stopped) = oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("test-net".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("the test network's runtime");
                handle_tx.send(runtime.handle().clone()).expect("handle");
                // Until the Net is dropped; its relays end with the runtime.
                let _ = runtime.block_on(stopped);
            })
            .expect("the test network's thread");
        let handle = handle_rx.recv().expect("the test network starts");
        Net {
            filter: Arc::default(),
            cluster,
            handle,
            _stop: stop,
        }
    }

    /// Datagrams between `a` and `b`, both ways, that `traffic` selects, are dropped or
    /// delayed from now on (replacing an earlier rule for the pair and traffic).
    pub fn set(&self, a: &str, b: &str, traffic: Traffic, action: Action) {
        let mut rules = self.filter.rules.lock().expect("rules");
        rules.retain(|rule| !(rule.between(a, b) && rule.traffic == traffic));
        rules.push(Rule {
            between: (a.into(), b.into()),
            traffic,
            action,
        });
    }

    /// Every rule between `a` and `b` is gone: their datagrams pass again.
    pub fn heal(&self, a: &str, b: &str) {
        let mut rules = self.filter.rules.lock().expect("rules");
        rules.retain(|rule| !rule.between(a, b));
    }

    /// Datagrams a daemon sends from `address` are `who`'s.
    pub fn name(&self, address: SocketAddr, who: &str) {
        let mut names = self.filter.names.lock().expect("names");
        names.insert(address, who.into());
    }

    /// The address machine number `machine` (from 1) reaches the head at.
    pub fn head_ip(&self, machine: u8) -> Ipv4Addr {
        Ipv4Addr::new(127, self.cluster, machine, 1)
    }

    /// Relays for `machine` (named `who`) in front of the head's QUIC port and its
    /// heartbeat port, at [`Net::head_ip`]; returns the address the machine joins at.
    pub fn head_link(&self, machine: u8, who: &str, head: SocketAddr, beat_port: u16) -> String {
        let ip = self.head_ip(machine);
        let sender = Sender::Machine(who.into());
        let quic = SocketAddr::from((ip, head.port()));
        self.relay(quic, target(head), HEAD, sender.clone(), Port::Quic);
        if beat_port != 0 {
            let front = SocketAddr::from((ip, beat_port));
            let behind = SocketAddr::from((head.ip(), beat_port));
            self.relay(front, target(behind), HEAD, sender, Port::Heartbeats);
        }
        quic.to_string()
    }

    /// A relay in front of node `who`, machine number `machine`, whose real address is
    /// only known once it has started: the node advertises the address returned, and
    /// [`Behind::set`] tells the relay where to forward (until then, datagrams are dropped
    /// as a port that is not open yet would).
    pub fn node_front(&self, machine: u8, who: &str) -> (String, Behind) {
        let front = SocketAddr::from((Ipv4Addr::new(127, self.cluster, machine, 2), 0));
        let behind = Behind(Arc::default());
        let bound = self.relay(front, behind.0.clone(), who, Sender::ByAddress, Port::Quic);
        (bound.to_string(), behind)
    }

    /// Starts a relay at `front` (port 0: any), forwarding to `behind` for `owner`.
    fn relay(
        &self,
        front: SocketAddr,
        behind: Arc<OnceLock<SocketAddr>>,
        owner: &str,
        sender: Sender,
        port: Port,
    ) -> SocketAddr {
        let socket = std::net::UdpSocket::bind(front)
            .unwrap_or_else(|error| panic!("test network: bind {front}: {error}"));
        socket
            .set_nonblocking(true)
            .expect("a non-blocking relay socket");
        let bound = socket.local_addr().expect("relay address");
        let (owner, filter) = (owner.to_owned(), self.filter.clone());
        self.handle.spawn(async move {
            let relay = Relay {
                front: Arc::new(UdpSocket::from_std(socket).expect("relay socket")),
                behind,
                owner,
                sender,
                port,
                filter,
            };
            relay.run().await;
        });
        bound
    }
}
/// Where a node's relay forwards, once the node is up.
#[derive(Debug, Clone)]
pub struct Behind(Arc<OnceLock<SocketAddr>>);

impl Behind {
    pub fn set(&self, address: SocketAddr) {
        let _ = self.0.set(address);
    }
}

fn target(address: SocketAddr) -> Arc<OnceLock<SocketAddr>> {
    let cell = OnceLock::new();
    let _ = cell.set(address);
    Arc::new(cell)
}

/// One relay port: what arrives at `front` goes to `behind` from a socket per sender,
/// and what comes back on that socket goes to the sender from `front`.
struct Relay {
    front: Arc<UdpSocket>,
    behind: Arc<OnceLock<SocketAddr>>,
    owner: String,
    sender: Sender,
    port: Port,
    filter: Arc<Filter>,
}

impl Relay {
    async fn run(self) {
        let mut backs: HashMap<SocketAddr, Arc<UdpSocket>> = HashMap::new();
        let mut buffer = vec![0u8; 65_536];
        loop {
            let (len, from) = match self.front.recv_from(&mut buffer).await {
                Ok(received) => received,
                // An ICMP "port unreachable" for an earlier answer: the sender is gone.
                Err(_) => continue,
            };
            let Some(&behind) = self.behind.get() else {
                continue;
            };
            let who = match &self.sender {
                Sender::Machine(name) => name.clone(),
                Sender::ByAddress => self.filter.name_of(from),
            };
            let back = match backs.get(&from) {
                Some(back) => back.clone(),
                None => {
                    let Ok(back) = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).await else {
                        continue;
                    };
                    if back.connect(behind).await.is_err() {
                        continue;
                    }
                    let back = Arc::new(back);
                    backs.insert(from, back.clone());
                    tokio::spawn(answers(
                        back.clone(),
                        self.front.clone(),
                        from,
                        Route {
                            from: self.owner.clone(),
                            to: who.clone(),
                            port: self.port,
                        },
                        self.filter.clone(),
                    ));
                    back
                }
            };
            let datagram = buffer[..len].to_vec();
            let action = self.filter.action(&who, &self.owner, self.port);
            carry(action, async move {
                let _ = back.send(&datagram).await;
            })
            .await;
        }
    }
}

/// Which way a relay's answers go, for the rules.
struct Route {
    from: String,
    to: String,
    port: Port,
}

/// Answers from the daemon behind a relay, on the socket of one sender, back to it.
async fn answers(
    back: Arc<UdpSocket>,
    front: Arc<UdpSocket>,
    sender: SocketAddr,
    route: Route,
    filter: Arc<Filter>,
) {
    let mut buffer = vec![0u8; 65_536];
    loop {
        let len = match back.recv(&mut buffer).await {
            Ok(len) => len,
            // The daemon's port is closed (killed, or not restarted yet): keep listening,
            // as a restarted head takes the same port again.
            Err(_) => continue,
        };
        let datagram = buffer[..len].to_vec();
        let front = front.clone();
        let action = filter.action(&route.from, &route.to, route.port);
        carry(action, async move {
            let _ = front.send_to(&datagram, sender).await;
        })
        .await;
    }
}

/// Sends now, later or never, as `action` says.
async fn carry(action: Option<Action>, send: impl Future<Output = ()> + Send + 'static) {
    match action {
        None => send.await,
        Some(Action::Drop) => {}
        Some(Action::Delay(delay)) => {
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                send.await;
            });
        }
    }
}
