//! End-to-end tests of the cluster commands: `imgrun start --head`, `imgrun join`,
//! `imgrun status` and `imgrun stop`, as background daemons in separate processes on
//! loopback (and in two network namespaces where the test may create them).
//!
//! Each simulated machine has a state folder of its own (`IMGRUN_STATE_DIR`), so that
//! several daemons run side by side on one host. Heartbeats are fast (100 ms, dead after
//! 1 s) so that failure detection is seen quickly; every wait is bounded.

use std::net::UdpSocket;
use std::time::{Duration, Instant};

use rustix::process::{Signal, kill_process};
use serde_json::Value;

use crate::common;
use crate::common::{
    DEAD_AFTER_MS, Machine, Netns, describe, is_running, node_states, nodes, pid_of, wait_alive,
    wait_for,
};

fn total_gpus(status: &Value) -> u64 {
    status["totals"]["gpus"].as_u64().unwrap_or(u64::MAX)
}

#[test]
fn a_head_and_two_nodes_form_a_cluster_that_survives_a_killed_node_and_bad_peers() {
    let root = tempfile::tempdir().expect("temp dir");
    let head = Machine::new(root.path(), "head");
    let one = Machine::new(root.path(), "one");
    let two = Machine::new(root.path(), "two");
    let bind = ["--bind", "127.0.0.1"];

    let join = head.start_head(&["--bind", "127.0.0.1", "--num-gpus", "2"]);
    for (machine, gpus) in [(&one, "1"), (&two, "3")] {
        let out = machine.join(&join, &[&bind[..], &["--num-gpus", gpus]].concat());
        assert!(out.status.success(), "join failed:\n{}", describe(&out));
    }
    let status = wait_alive(&head, 3, Duration::from_secs(5));
    assert_eq!(total_gpus(&status), 6, "{status:#}");
    let text = head.run_ok(&["status"]);
    for word in ["alive", "claimed"] {
        assert!(text.contains(word), "`{word}` missing from status:\n{text}");
    }
    // A node machine sees the same cluster through its own credentials.
    assert_eq!(nodes(&one.status()).len(), 3);

    // Bad peers are refused and the cluster goes on.
    let wrong_token = (join.0.clone(), "0".repeat(join.1.len()), join.2.clone());
    let stranger = Machine::new(root.path(), "stranger");
    let refusals = [
        (wrong_token, "token"),
        (
            (
                join.0.clone(),
                join.1.clone(),
                format!("sha256:{}", "ab".repeat(32)),
            ),
            "ca",
        ),
    ];
    for (credentials, word) in refusals {
        let out = stranger.join(&credentials, &[&bind[..], &["--block"]].concat());
        assert!(
            !out.status.success(),
            "a bad join got in:\n{}",
            describe(&out)
        );
        let stderr = String::from_utf8_lossy(&out.stderr).to_lowercase();
        assert!(stderr.contains(word), "`{word}` not in:\n{stderr}");
    }
    let socket = UdpSocket::bind("127.0.0.1:0").expect("udp socket");
    for size in [0usize, 1, 7, 1200, 1500] {
        let garbage: Vec<u8> = (0..size).map(|i| (i * 131 % 251) as u8).collect();
        socket.send_to(&garbage, &join.0).expect("send garbage");
    }
    assert_eq!(
        nodes(&head.status()).len(),
        3,
        "bad peers changed the cluster"
    );

    // SIGKILL one node: it is declared dead within the window, its GPUs leave the totals,
    // the others stay alive.
    let victim = two.daemon_pids();
    assert_eq!(victim.len(), 1, "one daemon recorded for node two");
    let killed_at = Instant::now();
    kill_process(pid_of(victim[0]).expect("pid"), Signal::KILL).expect("kill -9");
    let status = wait_for(
        Duration::from_secs(5),
        "the killed node declared dead",
        || {
            let status = head.status();
            let dead = node_states(&status).iter().any(|(_, s)| s == "dead");
            dead.then_some(status)
        },
    );
    let detected = killed_at.elapsed();
    eprintln!("killed node declared dead after {detected:?} (window {DEAD_AFTER_MS} ms)");
    let states = node_states(&status);
    assert_eq!(
        states.iter().filter(|(_, s)| s == "alive").count(),
        2,
        "{states:?}"
    );
    assert_eq!(total_gpus(&status), 3, "{status:#}");

    // `stop --all` from the head machine stops the head and the remaining node.
    let daemons: Vec<u32> = [&head, &one].iter().flat_map(|m| m.daemon_pids()).collect();
    assert_eq!(daemons.len(), 2);
    head.run_ok(&["stop", "--all"]);
    wait_for(Duration::from_secs(10), "every daemon gone", || {
        daemons.iter().all(|&p| !is_running(p)).then_some(())
    });
    // The killed node left a stale record; `stop` clears it and says nothing is running.
    let out = two.run_ok(&["stop"]);
    assert!(out.contains("no imgrun daemon"), "{out}");
    assert!(two.daemon_pids().is_empty());
}

/// A head and one node as daemons, both alive, and a client of the head's machine in this
/// process, for the actor tests.
struct ActorCluster {
    // Dropped last: the machines' folders live in it.
    head: Machine,
    node: Machine,
    join: (String, String, String),
    // Before the runtime: its connections close on that runtime.
    client: runtime::ClusterClient,
    tokio: tokio::runtime::Runtime,
    _root: tempfile::TempDir,
}

/// How long any one step of the actor tests may take.
const STEP_LIMIT: Duration = Duration::from_secs(30);

impl ActorCluster {
    fn start(gpus: &str) -> ActorCluster {
        let root = tempfile::tempdir().expect("temp dir");
        let head = Machine::new(root.path(), "head");
        let node = Machine::new(root.path(), "node");
        let join = head.start_head(&["--bind", "127.0.0.1", "--num-gpus", gpus]);
        let out = node.join(&join, &["--bind", "127.0.0.1", "--num-gpus", gpus]);
        assert!(out.status.success(), "join failed:\n{}", describe(&out));
        wait_alive(&head, 2, Duration::from_secs(5));
        let tokio = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio");
        let head_state = runtime::StateDir::at(&head.state);
        let connecting = runtime::ClusterClient::connect(&head_state, None);
        let client = block_within(&tokio, STEP_LIMIT, "connect", connecting).expect("client");
        ActorCluster {
            head,
            node,
            join,
            client,
            tokio,
            _root: root,
        }
    }

    /// Runs `future` on the test's runtime, within [`STEP_LIMIT`].
    fn block<T>(&self, what: &str, future: impl std::future::Future<Output = T>) -> T {
        block_within(&self.tokio, STEP_LIMIT, what, future)
    }

    /// Drops the client (its actors end with its connection), stops the cluster from the
    /// head's machine and waits for the daemons to go.
    fn stop(self) {
        let daemons: Vec<u32> = [&self.head, &self.node]
            .iter()
            .flat_map(|m| m.daemon_pids())
            .collect();
        drop(self.client);
        self.head.run_ok(&["stop", "--all"]);
        wait_for(Duration::from_secs(10), "daemons gone", || {
            daemons.iter().all(|&pid| !is_running(pid)).then_some(())
        });
    }
}

/// Actors through the real daemons: a client in this process spawns `echo` actors over a
/// head and a node, in worker processes (the binary re-executed as `imgrun worker`), calls
/// them, sees their reservations in `imgrun status`, and stops them.
#[test]
fn echo_actors_spread_over_the_daemons_run_in_workers_and_stop() {
    use runtime::{ActorEventKind, Resources, SpawnOptions, Strategy};

    let cluster = ActorCluster::start("1");
    let (head, client, limit) = (&cluster.head, &cluster.client, STEP_LIMIT);
    let daemons: Vec<u32> = [head, &cluster.node]
        .iter()
        .flat_map(|m| m.daemon_pids())
        .collect();
    let mut actors = Vec::new();
    for _ in 0..2 {
        let options = SpawnOptions::new(runtime::ECHO_KIND)
            .resources(Resources::new().with_gpus(1))
            .strategy(Strategy::Spread)
            .process_group("diag");
        let spawned = cluster.block("spawn", client.spawn(options));
        actors.push(spawned.expect("spawn echo"));
    }
    assert_ne!(
        actors[0].node(),
        actors[1].node(),
        "spread over both daemons"
    );
    let mut pids = Vec::new();
    for actor in &actors {
        let call = |method: &'static str, payload: &'static str| {
            let reply = cluster
                .block(method, actor.call(method, payload, limit))
                .unwrap_or_else(|error| panic!("{method}: {error}"));
            String::from_utf8_lossy(&reply).into_owned()
        };
        assert_eq!(call("echo", "hello"), "hello");
        let pid: u32 = call("pid", "").parse().expect("pid");
        assert!(
            !daemons.contains(&pid),
            "actor {} runs in a daemon",
            actor.id()
        );
        pids.push(pid);
        let gpus: Value = serde_json::from_str(&call("gpus", "")).expect("gpus json");
        assert_eq!(gpus["cuda_visible_devices"], "0", "{gpus}");
        assert_eq!(gpus["reserved"], serde_json::json!([0]), "{gpus}");
        // The daemons bind 127.0.0.1; so do the actors' own listeners.
        assert_eq!(call("data_ip", ""), "127.0.0.1");
    }

    // `imgrun status` shows who holds what.
    let status = head.status();
    let mut owners: Vec<(String, u64)> = head
        .job_reservations()
        .iter()
        .map(|r| {
            let owner = r["owner"].as_str().unwrap_or("?").to_string();
            (owner, r["resources"]["gpu"].as_u64().unwrap_or(0))
        })
        .collect();
    owners.sort();
    let mut want: Vec<(String, u64)> = actors
        .iter()
        .map(|a| (format!("actor:{}", a.id()), 1))
        .collect();
    want.sort();
    assert_eq!(owners, want, "{status:#}");
    let text = head.run_ok(&["status"]);
    assert!(
        text.contains(&format!("actor:{}", actors[0].id())),
        "{text}"
    );

    // Stopped: `stopped` events, nothing reserved, the workers retired.
    for actor in &actors {
        cluster.block("stop", actor.stop()).expect("stop");
    }
    let mut stopped = 0;
    let mut seen = 0;
    while stopped < actors.len() {
        let asked = client.events(seen, Duration::from_secs(5));
        let page = cluster.block("events", asked).expect("events");
        for event in &page.events {
            assert_eq!(event.kind, ActorEventKind::Stopped, "{event:?}");
            stopped += 1;
            seen = event.seq;
        }
    }
    let status = head.status();
    assert_eq!(head.job_reservations().len(), 0, "{status:#}");
    wait_for(Duration::from_secs(10), "workers gone", || {
        pids.iter().all(|&pid| !is_running(pid)).then_some(())
    });
    cluster.stop();
}

/// SIGKILL a node daemon that hosts an actor in a worker process: its worker goes with it,
/// the owner hears of the loss once the node is declared dead, the actor restarts on the
/// head (its restart policy), and the same handle reaches it there. A call made before
/// the head knows ends by its own timeout.
#[test]
fn an_actor_on_a_killed_node_restarts_elsewhere_and_its_handle_follows() {
    use runtime::{ActorEventKind, SpawnOptions, Strategy};

    let cluster = ActorCluster::start("0");
    let (node, join, client, limit) = (&cluster.node, &cluster.join, &cluster.client, STEP_LIMIT);
    // Spread puts one actor on each daemon; the one on the node is the victim's.
    let mut actors = Vec::new();
    for _ in 0..2 {
        let options = SpawnOptions::new(runtime::ECHO_KIND)
            .strategy(Strategy::Spread)
            .process_group("diag")
            .restart(2, Duration::from_millis(100));
        actors.push(
            cluster
                .block("spawn", client.spawn(options))
                .expect("spawn"),
        );
    }
    let moving = actors
        .iter()
        .find(|a| a.address() != join.0)
        .expect("an actor on the node")
        .clone();
    let lost_node = moving.node();
    let call = |method: &'static str| {
        let reply = cluster
            .block(method, moving.call(method, "hi", limit))
            .unwrap_or_else(|error| panic!("{method}: {error}"));
        String::from_utf8_lossy(&reply).into_owned()
    };
    assert_eq!(call("echo"), "hi");
    let worker: u32 = call("pid").parse().expect("pid");

    let victim = node.daemon_pids();
    assert_eq!(victim.len(), 1);
    let killed_at = Instant::now();
    kill_process(pid_of(victim[0]).expect("pid"), Signal::KILL).expect("kill -9");
    // A call to it now ends by its own timeout (and a margin of a quarter of it), neither
    // waiting for the head to declare the node lost nor 2 s beyond, as it once did.
    let short = Duration::from_millis(500);
    let calling = Instant::now();
    let answer = cluster.block("a call to the killed node", moving.call("echo", "x", short));
    let took = calling.elapsed();
    eprintln!("a {short:?} call to the killed node ended after {took:?}: {answer:?}");
    if let Err(error) = &answer {
        assert!(error.is_loss(), "{error}");
    }
    assert!(
        took < Duration::from_millis(2_000),
        "a {short:?} call to a killed node took {took:?}: {answer:?}"
    );
    wait_for(Duration::from_secs(10), "the node's worker gone", || {
        (!is_running(worker)).then_some(())
    });
    eprintln!(
        "the node's worker gone {:?} after SIGKILL",
        killed_at.elapsed()
    );

    // Events for the moved actor: restarting (node lost), then restarted on the head.
    let mut seen = 0;
    let mut kinds = Vec::new();
    while !kinds.contains(&ActorEventKind::Restarted) {
        let asked = client.events(seen, Duration::from_secs(5));
        let page = cluster.block("events", asked).expect("events");
        for event in page.events {
            seen = event.seq;
            if event.actor != moving.id() {
                continue;
            }
            if event.kind == ActorEventKind::Restarting {
                assert_eq!(event.origin, runtime::FailureOrigin::NodeLost, "{event:?}");
                eprintln!(
                    "owner told of the loss {:?} after SIGKILL (window {DEAD_AFTER_MS} ms)",
                    killed_at.elapsed()
                );
            }
            kinds.push(event.kind);
        }
        assert!(killed_at.elapsed() < limit, "no restart within {limit:?}");
    }
    assert_eq!(
        kinds,
        [ActorEventKind::Restarting, ActorEventKind::Restarted],
        "events of actor {}",
        moving.id()
    );
    assert_eq!(call("echo"), "hi", "the handle reaches the restarted actor");
    assert_ne!(moving.node(), lost_node, "restarted on another node");
    let other = actors
        .iter()
        .find(|a| a.id() != moving.id())
        .expect("other");
    let reply = cluster.block("other", other.call("echo", "still", limit));
    assert_eq!(reply.expect("the other actor still answers"), b"still");

    cluster.stop();
}

#[test]
fn status_and_stop_without_a_cluster_say_so() {
    let root = tempfile::tempdir().expect("temp dir");
    let lonely = Machine::new(root.path(), "lonely");
    let out = lonely.run(&["status"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no head"), "{stderr}");
    let out = lonely.run_ok(&["stop"]);
    assert!(out.contains("no imgrun daemon"), "{out}");
    let out = lonely.run(&["start"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--head"));
}

#[test]
fn a_second_head_on_one_machine_is_refused() {
    let root = tempfile::tempdir().expect("temp dir");
    let head = Machine::new(root.path(), "head");
    head.start_head(&["--bind", "127.0.0.1"]);
    let out = head.run(&["start", "--head", "--port", "0", "--bind", "127.0.0.1"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("already running"), "{stderr}");
    head.run_ok(&["stop"]);
}

/// A daemon started under the usual soft open-file limit (1,024) raises it to its hard
/// limit: every actor it hosts (a listed job's coordinator, a loader) holds descriptors.
#[test]
fn a_daemon_raises_its_open_file_limit_to_the_hard_one() {
    let hard = rustix::process::getrlimit(rustix::process::Resource::Nofile).maximum;
    if hard.is_some_and(|hard| hard <= 1024) {
        common::skip::skip_or_fail("a hard open-file limit above 1,024 (`ulimit -Hn`)");
        return;
    }
    let root = tempfile::tempdir().expect("temp dir");
    let head = Machine::new(root.path(), "head");
    let out = std::process::Command::new("sh")
        .args(["-c", "ulimit -Sn 1024 && exec \"$0\" \"$@\""])
        .arg(env!("CARGO_BIN_EXE_imgrun"))
        .args([
            "start",
            "--head",
            "--port",
            "0",
            "--bind",
            "127.0.0.1",
            "--no-dashboard",
        ])
        .env("IMGRUN_STATE_DIR", &head.state)
        .env_remove("IMGRUN_LOG")
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run sh");
    assert!(out.status.success(), "{}", describe(&out));
    let pids = head.daemon_pids();
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", pids[0])).expect("limits");
    head.run_ok(&["stop"]);
    let open_files: Vec<&str> = limits
        .lines()
        .find(|line| line.starts_with("Max open files"))
        .expect("Max open files")
        .split_whitespace()
        .collect();
    // `Max open files SOFT HARD files`
    assert_eq!(open_files[3], open_files[4], "{limits}");
    assert_ne!(open_files[3], "1024", "{limits}");
}

/// Everything a daemon writes in its state folder, its log included, is readable by
/// its user alone.
#[test]
fn a_daemons_state_folder_and_log_are_private() {
    use std::os::unix::fs::PermissionsExt;
    let root = tempfile::tempdir().expect("temp dir");
    let head = Machine::new(root.path(), "head");
    head.start_head(&["--bind", "127.0.0.1"]);
    let mut found = Vec::new();
    let mut folders = vec![head.state.clone()];
    while let Some(folder) = folders.pop() {
        for entry in std::fs::read_dir(&folder).expect("read the state folder") {
            let path = entry.expect("entry").path();
            let meta = std::fs::symlink_metadata(&path).expect("metadata");
            if meta.is_dir() {
                folders.push(path.clone());
            }
            found.push((path, meta.permissions().mode() & 0o777));
        }
    }
    head.run_ok(&["stop"]);
    assert!(
        found
            .iter()
            .any(|(path, _)| path.extension().is_some_and(|e| e == "log")),
        "no log in {found:?}"
    );
    let open: Vec<String> = found
        .iter()
        .filter(|(_, mode)| mode & 0o077 != 0)
        .map(|(path, mode)| format!("{} {mode:o}", path.display()))
        .collect();
    assert!(open.is_empty(), "open to others: {open:#?}");
}

/// Two network namespaces joined by a veth pair, so that head and node really have
/// different addresses. Needs root and `ip` (to create namespaces); fails without them
/// unless skipping is allowed (`IMGRUN_ALLOW_SKIP=1`).
#[test]
fn a_node_in_another_network_namespace_joins_over_a_veth_pair() {
    let net = match Netns::create() {
        Ok(net) => net,
        Err(missing) => return common::skip::skip_or_fail(&missing),
    };
    let root = tempfile::tempdir().expect("temp dir");
    let (head, node) = net.machines(root.path());

    let join = head.start_head(&["--bind", &net.addresses[0], "--num-gpus", "0"]);
    assert!(join.0.starts_with(&net.addresses[0]), "{join:?}");
    let out = node.join(&join, &["--bind", &net.addresses[1], "--num-gpus", "1"]);
    assert!(out.status.success(), "join failed:\n{}", describe(&out));
    let status = wait_alive(&head, 2, Duration::from_secs(5));
    let addresses: Vec<String> = nodes(&status)
        .iter()
        .filter_map(|n| n["address"].as_str().map(str::to_string))
        .collect();
    assert!(
        addresses.iter().any(|a| a.starts_with(&net.addresses[1])),
        "the node's own address is not in {addresses:?}"
    );
    head.run_ok(&["stop", "--all"]);
    let pids: Vec<u32> = [&head, &node]
        .iter()
        .flat_map(|m| m.daemon_pids())
        .collect();
    wait_for(Duration::from_secs(10), "daemons gone", || {
        pids.iter().all(|&p| !is_running(p)).then_some(())
    });
}

/// Runs `future` on `tokio`, failing the test if it takes longer than `limit`.
fn block_within<T>(
    tokio: &tokio::runtime::Runtime,
    limit: Duration,
    what: &str,
    future: impl std::future::Future<Output = T>,
) -> T {
    tokio
        .block_on(async { tokio::time::timeout(limit, future).await })
        .unwrap_or_else(|_| panic!("{what}: not done within {limit:?}"))
}
