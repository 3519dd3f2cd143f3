//! The in-process test cluster: a head with fast membership, nodes that join it as
//! machines of their own (a state folder each), clients on any machine, and a
//! [`Net`] between them whose filter drops or delays the datagrams between chosen
//! daemons. Every runtime test that needs a cluster starts from [`TestCluster::start`].

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;

use runtime::{
    ActorHosting, ClusterClient, DaemonError, Head, HeadConfig, MembershipConfig, Node, NodeConfig,
    StateDir, TransportOptions,
};
use tempfile::TempDir;

use super::net::{Behind, HEAD, Net};
use super::{DEAD_AFTER_MS, HEARTBEAT_MS, resources, within};

/// A head and the machines that joined it, in a temporary folder.
pub struct TestCluster {
    pub dir: TempDir,
    pub head: Head,
    /// The network between the daemons: its rules cut or slow their links.
    pub net: Net,
    hosting: ActorHosting,
    /// The head's configuration as it was first started.
    configured: HeadConfig,
    /// Machine names, in the order they first joined (machine numbers from 1).
    machines: Mutex<Vec<String>>,
    /// The relays in front of nodes that have not started yet, by advertised address.
    fronts: Mutex<HashMap<String, Behind>>,
}

impl TestCluster {
    /// A head of 4 CPUs and `gpus` GPUs (the machine's own hidden), with fast membership,
    /// hosting `hosting`'s kinds of actor (as its nodes will).
    pub async fn start(gpus: usize, hosting: ActorHosting) -> TestCluster {
        Self::start_with(gpus, hosting, |_| {}).await
    }

    /// [`TestCluster::start`], with the head's configuration changed by `configure`.
    pub async fn start_with(
        gpus: usize,
        hosting: ActorHosting,
        configure: impl FnOnce(&mut HeadConfig),
    ) -> TestCluster {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut config = head_config(&dir, gpus, hosting.clone());
        configure(&mut config);
        let configured = config.clone();
        let head = within("head start", Head::start(config))
            .await
            .expect("head starts");
        let net = Net::new();
        net.name(head.local_addr(), HEAD);
        TestCluster {
            dir,
            head,
            net,
            hosting,
            configured,
            machines: Mutex::default(),
            fronts: Mutex::default(),
        }
    }

    /// The configuration the head started with, on the ports it has now.
    pub fn head_config(&self) -> HeadConfig {
        HeadConfig {
            bind: self.head.local_addr(),
            beat_port: self.head.beat_port(),
            ..self.configured.clone()
        }
    }

    /// Stops the head and starts it again on its ports, from its state folder (its CA,
    /// token and node ids kept), as a restarted head process would.
    pub async fn restart_head(self) -> TestCluster {
        let config = self.head_config();
        within("head stops", self.head.stop()).await;
        within("head stopped", self.head.stopped()).await;
        // Its port is free only once it is dropped.
        drop(self.head);
        let head = within("head restarts", Head::start(config))
            .await
            .expect("head restarts on its ports");
        TestCluster { head, ..self }
    }

    /// The state folder of `machine` (`head` is the head's).
    pub fn state(&self, machine: &str) -> StateDir {
        StateDir::at(self.dir.path().join(machine))
    }

    /// The number of `machine` in the network's addresses (from 1).
    fn machine_number(&self, machine: &str) -> u8 {
        let mut machines = self.machines.lock().expect("machines");
        let index = match machines.iter().position(|m| m == machine) {
            Some(index) => index,
            None => {
                machines.push(machine.to_owned());
                let number = machines.len() as u8;
                let head = self.head.local_addr();
                self.net
                    .head_link(number, machine, head, self.head.beat_port());
                machines.len() - 1
            }
        };
        index as u8 + 1
    }

    /// How `machine`, offering `cpus` CPUs and `gpus` GPUs, joins: at its own address of
    /// the head, advertising a relay of the network in front of its port.
    pub fn node_config(&self, machine: &str, cpus: usize, gpus: usize) -> NodeConfig {
        let number = self.machine_number(machine);
        let (advertise, behind) = self.net.node_front(number, machine);
        let head = SocketAddr::from((self.net.head_ip(number), self.head.local_addr().port()));
        self.fronts
            .lock()
            .expect("fronts")
            .insert(advertise.clone(), behind);
        NodeConfig {
            head: head.to_string(),
            token: self.head.token().clone(),
            ca_hash: self.head.ca_hash(),
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: Some(advertise),
            state: self.state(machine),
            resources: resources(machine, cpus, gpus),
            transport: TransportOptions::default(),
            actors: self.hosting.clone(),
        }
    }

    /// Starts a node of `machine` from `config` (made by [`TestCluster::node_config`],
    /// perhaps changed), and connects the network's relay to it.
    pub async fn start_node(&self, machine: &str, config: NodeConfig) -> Result<Node, DaemonError> {
        let advertise = config.advertise.clone().unwrap_or_default();
        let node = Node::start(config).await?;
        self.net.name(node.local_addr(), machine);
        if let Some(behind) = self.fronts.lock().expect("fronts").remove(&advertise) {
            behind.set(node.local_addr());
        }
        Ok(node)
    }

    /// `machine` joins with 2 CPUs and `gpus` GPUs; a refusal fails the test.
    pub async fn join(&self, machine: &str, gpus: usize) -> Node {
        let config = self.node_config(machine, 2, gpus);
        within(machine, self.start_node(machine, config))
            .await
            .unwrap_or_else(|error| panic!("{machine} joins: {error}"))
    }

    /// A new client on `machine` (its own connection: another owner).
    pub async fn client(&self, machine: &str) -> ClusterClient {
        within("client", ClusterClient::connect(&self.state(machine), None))
            .await
            .expect("client connects")
    }
}

/// A head on a free loopback port, 4 CPUs and `gpus` GPUs, fast membership.
fn head_config(dir: &TempDir, gpus: usize, hosting: ActorHosting) -> HeadConfig {
    HeadConfig {
        membership: MembershipConfig {
            heartbeat_interval_ms: HEARTBEAT_MS,
            dead_after_ms: DEAD_AFTER_MS,
        },
        actors: hosting,
        ..HeadConfig::loopback(
            StateDir::at(dir.path().join("head")),
            resources("head", 4, gpus),
        )
    }
}
