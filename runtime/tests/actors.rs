//! Actors through the cluster, in process, over real QUIC through the test network
//! (`common/net.rs`): a head and two nodes host the test's kinds; a client spawns actors
//! by strategy, calls and tells them wherever they run, stops and kills them, and reads
//! the failures, restarts and stops of its actors as events, down to a node dropped
//! without a word (as SIGKILL leaves it) or cut off from the head.
//!
//! Membership is fast (heartbeats every 50 ms, dead after 500 ms). Nothing sleeps to wait:
//! tests wait for events (long-polled from the head) or answers, each under [`LIMIT`];
//! the one wait without an event (the head noticing a client's connection closed) polls
//! the status under the same limit.

mod common;

use std::sync::{Condvar, Mutex};
use std::time::Duration;

use runtime::{
    Actor, ActorCallError, ActorContext, ActorEvent, ActorEventKind, ActorHosting, ActorRef,
    ActorRegistry, ClusterClient, ClusterStatus, FailureOrigin, MethodError, Node, NodeId,
    Resources, SpawnOptions, Strategy,
};

use common::cluster::TestCluster;
use common::net::{Action, HEAD, Traffic};
use common::{DEAD_AFTER_MS, LIMIT, within};

/// The kinds the daemons host: `probe`, whose methods are named for what they do, and
/// `broken`, whose constructor fails.
fn registry() -> ActorRegistry {
    let mut registry = ActorRegistry::new();
    registry
        .register("probe", |context, args| {
            let total = std::str::from_utf8(args)?.parse().unwrap_or(0);
            Ok(Box::new(Probe {
                context: context.clone(),
                total,
                log: Vec::new(),
            }) as Box<dyn Actor>)
        })
        .register("broken", |_, _| {
            Err(MethodError::new("no checkpoint at /ckpt"))
        });
    registry
}

struct Probe {
    context: ActorContext,
    total: i64,
    /// What `append` was given, in the order the messages ran.
    log: Vec<String>,
}

impl Actor for Probe {
    fn call(&mut self, method: &str, payload: &[u8]) -> Result<Vec<u8>, MethodError> {
        let text = std::str::from_utf8(payload)?;
        let answer = match method {
            "echo" => text.to_owned(),
            "gpus" => format!("{:?}", self.context.gpus()),
            "add" => {
                self.total += text.parse::<i64>()?;
                self.total.to_string()
            }
            "get" => self.total.to_string(),
            "append" => {
                self.log.push(text.to_owned());
                self.log.len().to_string()
            }
            "log" => self.log.join(","),
            "sleep" => {
                std::thread::sleep(Duration::from_millis(text.parse()?));
                String::new()
            }
            "hold" => {
                HOLD.wait();
                "released".to_owned()
            }
            "fail" => return Err(MethodError::fatal(text)),
            "fail_elsewhere" => return Err(MethodError::fatal(text).caused_elsewhere()),
            other => return Err(MethodError::new(format!("no method {other}"))),
        };
        Ok(answer.into_bytes())
    }
}

/// Where the `hold` method waits until the test releases it: a method that is certainly
/// still running when the test sees what its caller got.
static HOLD: Gate = Gate {
    open: Mutex::new(false),
    opened: Condvar::new(),
};

struct Gate {
    open: Mutex<bool>,
    opened: Condvar,
}

impl Gate {
    /// Blocks until [`Gate::release`], or twice [`LIMIT`] (a failed test never releases;
    /// by then it has failed on its own limit).
    fn wait(&self) {
        let open = self
            .open
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let _ = self
            .opened
            .wait_timeout_while(open, 2 * LIMIT, |open| !*open);
    }

    fn release(&self) {
        *self
            .open
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = true;
        self.opened.notify_all();
    }
}

fn hosting() -> ActorHosting {
    ActorHosting {
        registry: registry(),
        ..ActorHosting::default()
    }
}

/// A head (4 CPUs) and two nodes: `one` (2 CPUs) and `gpu` (2 CPUs, 2 GPUs), and a client
/// on the head's machine.
struct Cluster {
    test: TestCluster,
    nodes: Vec<Option<Node>>,
    client: ClusterClient,
}

impl Cluster {
    async fn start() -> Cluster {
        let test = TestCluster::start(0, hosting()).await;
        let mut nodes = Vec::new();
        for (machine, gpus) in [("one", 0), ("gpu", 2)] {
            nodes.push(Some(test.join(machine, gpus).await));
        }
        let client = test.client("head").await;
        Cluster {
            test,
            nodes,
            client,
        }
    }

    /// Node ids: the head, `one`, `gpu`.
    fn ids(&self) -> [NodeId; 3] {
        let node = |i: usize| self.nodes[i].as_ref().expect("node running").node_id();
        [self.test.head.node_id(), node(0), node(1)]
    }

    async fn spawn(&self, options: SpawnOptions) -> ActorRef {
        let kind = options.kind.clone();
        within("spawn", self.client.spawn(options))
            .await
            .unwrap_or_else(|error| panic!("spawn {kind}: {error}"))
    }

    /// Three actors spread over the nodes (one each), each restarted once on failure; and
    /// the one on `node`.
    async fn spread_restartable(&self, node: NodeId) -> (Vec<ActorRef>, ActorRef) {
        let mut actors = Vec::new();
        for _ in 0..3 {
            let options = probe(1, Strategy::Spread).restart(1, Duration::from_millis(10));
            actors.push(self.spawn(options).await);
        }
        let on_node = actors
            .iter()
            .find(|a| a.node() == node)
            .unwrap_or_else(|| panic!("an actor on node {node}"))
            .clone();
        (actors, on_node)
    }

    async fn status(&self) -> ClusterStatus {
        within("status", self.client.status())
            .await
            .expect("status")
    }
}

fn probe(cpus: u64, strategy: Strategy) -> SpawnOptions {
    SpawnOptions::new("probe")
        .resources(Resources::new().with_cpus(cpus))
        .strategy(strategy)
}

async fn call(actor: &ActorRef, method: &str, payload: &str) -> Result<String, ActorCallError> {
    let reply = within(method, actor.call(method, payload, LIMIT)).await?;
    Ok(String::from_utf8_lossy(&reply).into_owned())
}

/// Reads `client`'s events after `seen` until `done` holds for those read; moves `seen`.
async fn events_until(
    client: &ClusterClient,
    seen: &mut u64,
    done: impl Fn(&[ActorEvent]) -> bool,
) -> Vec<ActorEvent> {
    let mut events = Vec::new();
    within("events", async {
        while !done(&events) {
            let page = client
                .events(*seen, Duration::from_secs(5))
                .await
                .expect("events");
            assert!(!page.missed, "events missed");
            if let Some(last) = page.events.last() {
                *seen = last.seq;
            }
            events.extend(page.events);
        }
    })
    .await;
    events
}

fn kinds(events: &[ActorEvent]) -> Vec<(u64, ActorEventKind)> {
    events.iter().map(|e| (e.actor.0, e.kind)).collect()
}

/// (owner, node) of every reservation, sorted.
fn reservations(status: &ClusterStatus) -> Vec<(String, NodeId)> {
    let mut held: Vec<(String, NodeId)> = status
        .reservations
        .iter()
        .map(|r| (r.owner.clone(), r.node))
        .collect();
    held.sort();
    held
}

#[tokio::test]
async fn strategies_place_actors_and_gpus_follow_their_reservation() {
    let cluster = Cluster::start().await;
    let [head, one, gpu] = cluster.ids();

    // Spread over an idle cluster: one actor per node.
    let mut spread = Vec::new();
    for _ in 0..3 {
        spread.push(cluster.spawn(probe(1, Strategy::Spread)).await);
    }
    let mut nodes: Vec<NodeId> = spread.iter().map(ActorRef::node).collect();
    nodes.sort();
    assert_eq!(nodes, [head, one, gpu]);
    for actor in &spread {
        assert_eq!(call(actor, "echo", "hi").await.expect("echo"), "hi");
    }
    let status = cluster.status().await;
    let held: Vec<String> = reservations(&status).into_iter().map(|r| r.0).collect();
    let want: Vec<String> = spread.iter().map(|a| format!("actor:{}", a.id())).collect();
    assert_eq!(held, want, "{status}");
    for actor in &spread {
        within("stop", actor.stop()).await.expect("stop");
    }
    let mut seen = 0;
    events_until(&cluster.client, &mut seen, |events| events.len() == 3).await;
    assert!(cluster.status().await.reservations.is_empty());

    // Pack fills the fullest node that fits first: `one` (2 CPUs, lowest id of the two
    // smallest), then `gpu`.
    let mut packed = Vec::new();
    for _ in 0..3 {
        packed.push(cluster.spawn(probe(1, Strategy::Pack)).await);
    }
    let nodes: Vec<NodeId> = packed.iter().map(ActorRef::node).collect();
    assert_eq!(nodes, [one, one, gpu]);

    // A GPU request goes to the node with GPUs; the actor sees its own GPU.
    let mut gpus = Vec::new();
    for _ in 0..2 {
        let options = SpawnOptions::new("probe").resources(Resources::new().with_gpus(1));
        let actor = cluster.spawn(options).await;
        assert_eq!(actor.node(), gpu);
        gpus.push(call(&actor, "gpus", "").await.expect("gpus"));
    }
    gpus.sort();
    assert_eq!(gpus, ["[0]", "[1]"]);

    // Asking for more than any node has is refused, with nothing reserved.
    let before = reservations(&cluster.status().await);
    let options = SpawnOptions::new("probe").resources(Resources::new().with_gpus(4));
    let error = within("spawn", cluster.client.spawn(options))
        .await
        .expect_err("4 gpus");
    let want = format!("needs 4 gpu on one node; the largest node has 2 (node {gpu})");
    assert!(error.to_string().contains(&want), "{error}");
    assert!(
        error
            .to_string()
            .starts_with("cannot spawn an actor of kind 'probe'"),
        "{error}"
    );
    assert_eq!(reservations(&cluster.status().await), before);
    let options = probe(1, Strategy::Node(NodeId(99)));
    let error = within("spawn", cluster.client.spawn(options))
        .await
        .expect_err("no node 99");
    assert!(error.to_string().contains("99"), "{error}");
    assert_eq!(reservations(&cluster.status().await), before);
}

#[tokio::test]
async fn starts_that_fail_say_where_and_why_and_reserve_nothing() {
    let cluster = Cluster::start().await;
    let [_, one, _] = cluster.ids();
    let cases = [
        (
            SpawnOptions::new("broken").strategy(Strategy::Node(one)),
            format!("did not start on node {one}: no checkpoint at /ckpt"),
        ),
        (
            SpawnOptions::new("trainer").strategy(Strategy::Node(one)),
            "unknown actor kind 'trainer' (registered: broken, probe)".to_owned(),
        ),
        (
            SpawnOptions::new("probe").process_group("gpu0"),
            "this daemon starts no worker processes".to_owned(),
        ),
        (
            SpawnOptions::new("probe").resources(Resources::new().with("TPU", 1)),
            "bad resource name 'TPU'".to_owned(),
        ),
    ];
    for (options, want) in cases {
        let error = within("spawn", cluster.client.spawn(options))
            .await
            .expect_err("refused");
        assert!(error.to_string().contains(&want), "{error}\nwant: {want}");
    }
    assert!(cluster.status().await.reservations.is_empty());
    // The client owns failed actors' events too: a failed start is a `failed` event.
    let mut seen = 0;
    let events = events_until(&cluster.client, &mut seen, |events| events.len() == 3).await;
    assert!(
        events.iter().all(|e| e.kind == ActorEventKind::Failed),
        "{events:?}"
    );
}

#[tokio::test]
async fn calls_and_tells_reach_actors_on_any_node_and_time_out() {
    let cluster = Cluster::start().await;
    let [head, one, _] = cluster.ids();
    let local = cluster
        .spawn(probe(1, Strategy::Node(head)).args("100"))
        .await;
    let remote = cluster.spawn(probe(1, Strategy::Node(one))).await;
    assert_eq!((local.node(), remote.node()), (head, one));
    assert_eq!(
        remote.address(),
        cluster.nodes[0].as_ref().expect("one").address()
    );

    // Tells from one task run in order, before the call that follows them.
    for i in 1..=10 {
        within("tell", remote.tell("add", i.to_string()))
            .await
            .expect("tell");
    }
    assert_eq!(call(&remote, "get", "").await.expect("get"), "55");
    assert_eq!(call(&local, "get", "").await.expect("get"), "100");

    // Clones of a handle, from many tasks at once.
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..40 {
        let actor = if i % 2 == 0 {
            local.clone()
        } else {
            remote.clone()
        };
        tasks.spawn(async move { call(&actor, "add", "1").await });
    }
    while let Some(done) = within("calls", tasks.join_next()).await {
        done.expect("task").expect("add");
    }
    assert_eq!(call(&local, "get", "").await.expect("get"), "120");
    assert_eq!(call(&remote, "get", "").await.expect("get"), "75");

    // A method error goes back to the caller; the actor carries on.
    let error = call(&remote, "divide", "").await.expect_err("no method");
    let want = format!(
        "actor {} on node {one}: divide: no method divide",
        remote.id()
    );
    assert_eq!(error.to_string(), want);

    // A call that takes too long times out, naming the actor, its node and the method.
    // The method is held until the caller has its error, so the error cannot have waited
    // for the method; the late answer, once released, is not taken for the next call's.
    let error = within(
        "held call",
        remote.call("hold", "", Duration::from_millis(100)),
    )
    .await
    .expect_err("times out while the method is held");
    HOLD.release();
    let want = format!(
        "actor {} on node {one} did not answer 'hold' within 100ms; it may still run it",
        remote.id()
    );
    assert_eq!(error.to_string(), want);
    assert!(matches!(error, ActorCallError::Timeout { .. }));
    assert_eq!(call(&remote, "echo", "after").await.expect("echo"), "after");

    // Another client (a node's machine) may call, but not stop, what this one spawned.
    let other = cluster.test.client("one").await;
    let theirs = within("actor", other.actor(remote.id()))
        .await
        .expect("locate");
    assert_eq!(call(&theirs, "get", "").await.expect("get"), "75");
    let error = within("stop", theirs.stop()).await.expect_err("not owner");
    assert!(
        error.to_string().contains("belongs to another owner"),
        "{error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_callers_messages_run_in_the_order_sent_under_concurrent_callers() {
    const CALLERS: usize = 8;
    const MESSAGES: usize = 40;
    let cluster = Cluster::start().await;
    let [head, one, _] = cluster.ids();
    // On a node (answered on the node's server thread) and on the head.
    for node in [one, head] {
        let actor = cluster.spawn(probe(1, Strategy::Node(node))).await;
        let mut callers = tokio::task::JoinSet::new();
        for caller in 0..CALLERS {
            let actor = actor.clone();
            // Tells and calls mixed: a tell is answered once it is in the mailbox, so the
            // message after it must run after it.
            callers.spawn(async move {
                for n in 0..MESSAGES {
                    let entry = format!("{caller}:{n}");
                    if n % 2 == 0 {
                        within("tell", actor.tell("append", entry)).await?;
                    } else {
                        call(&actor, "append", &entry).await?;
                    }
                }
                Ok::<_, ActorCallError>(())
            });
        }
        while let Some(done) = within("callers", callers.join_next()).await {
            done.expect("caller task").expect("append");
        }
        let log = call(&actor, "log", "").await.expect("log");
        let mut next = [0usize; CALLERS];
        for entry in log.split(',') {
            let (caller, n) = entry.split_once(':').expect("caller:n");
            let (caller, n): (usize, usize) = (
                caller.parse().expect("caller"),
                n.parse().expect("message number"),
            );
            assert_eq!(
                n, next[caller],
                "on node {node}: caller {caller}'s message {n} ran out of order: {log}"
            );
            next[caller] += 1;
        }
        assert_eq!(
            next, [MESSAGES; CALLERS],
            "on node {node}: messages lost: {log}"
        );
    }
}

#[tokio::test]
async fn stop_and_kill_release_what_the_actors_held() {
    let cluster = Cluster::start().await;
    let [_, one, gpu] = cluster.ids();
    let stopped = cluster.spawn(probe(1, Strategy::Node(one))).await;
    let killed = cluster
        .spawn(
            SpawnOptions::new("probe")
                .resources(Resources::new().with_gpus(2))
                .strategy(Strategy::Pack),
        )
        .await;
    assert_eq!(killed.node(), gpu);
    let status = cluster.status().await;
    assert_eq!(status.totals.used.get("gpu"), Some(&2), "{status}");
    assert_eq!(status.reservations.len(), 2, "{status}");

    // A stop lets what is queued finish first; a kill does not wait.
    within("tell", stopped.tell("sleep", "100"))
        .await
        .expect("tell");
    within("stop", stopped.stop()).await.expect("stop");
    within("kill", killed.kill()).await.expect("kill");
    let mut seen = 0;
    let events = events_until(&cluster.client, &mut seen, |events| events.len() == 2).await;
    let mut ended = kinds(&events);
    ended.sort();
    let mut want = vec![
        (stopped.id().0, ActorEventKind::Stopped),
        (killed.id().0, ActorEventKind::Stopped),
    ];
    want.sort();
    assert_eq!(ended, want, "{events:?}");
    let reasons: Vec<&str> = events.iter().map(|e| e.reason.as_str()).collect();
    assert!(reasons.contains(&"stopped by its owner"), "{reasons:?}");
    assert!(reasons.contains(&"killed by its owner"), "{reasons:?}");
    let status = cluster.status().await;
    assert!(status.reservations.is_empty(), "{status}");
    assert!(status.totals.used.is_empty(), "{status}");

    let error = call(&stopped, "echo", "").await.expect_err("stopped");
    assert!(error.to_string().contains("is stopped"), "{error}");
}

#[tokio::test]
async fn failures_reach_the_owner_and_restarts_are_followed_by_the_handle() {
    let cluster = Cluster::start().await;
    let [_, one, _] = cluster.ids();
    let mut seen = 0;

    // No restart policy: a fatal error fails the actor for good.
    let fragile = cluster.spawn(probe(1, Strategy::Node(one))).await;
    let error = call(&fragile, "fail", "cuda error")
        .await
        .expect_err("fails");
    assert!(matches!(error, ActorCallError::Failed { .. }), "{error}");
    let events = events_until(&cluster.client, &mut seen, |events| !events.is_empty()).await;
    assert_eq!(kinds(&events), [(fragile.id().0, ActorEventKind::Failed)]);
    assert_eq!(events[0].reason, "fail: cuda error");
    assert_eq!(events[0].node, Some(one));
    let error = call(&fragile, "echo", "")
        .await
        .expect_err("failed for good");
    assert_eq!(
        error.to_string(),
        format!(
            "actor {} on node {one} failed: fail: cuda error",
            fragile.id()
        )
    );
    assert!(cluster.status().await.reservations.is_empty());

    // With restarts: restarting, then restarted (state is not kept), and the same handle
    // reaches the new actor.
    let sturdy = cluster
        .spawn(
            probe(1, Strategy::Spread)
                .args("7")
                .restart(2, Duration::from_millis(20)),
        )
        .await;
    assert_eq!(call(&sturdy, "add", "1").await.expect("add"), "8");
    call(&sturdy, "fail", "lost state")
        .await
        .expect_err("fails");
    let events = events_until(&cluster.client, &mut seen, |events| events.len() == 2).await;
    let id = sturdy.id().0;
    assert_eq!(
        kinds(&events),
        [
            (id, ActorEventKind::Restarting),
            (id, ActorEventKind::Restarted)
        ]
    );
    assert_eq!(
        events[0].reason,
        "fail: lost state; restart 1 of 2 in 20 ms"
    );
    assert_eq!(
        call(&sturdy, "get", "").await.expect("get after restart"),
        "7"
    );
    let status = cluster.status().await;
    assert_eq!(reservations(&status).len(), 1, "{status}");
}

#[tokio::test]
async fn a_failure_caused_elsewhere_arrives_typed_at_callers_and_in_events() {
    let cluster = Cluster::start().await;
    let [head, one, _] = cluster.ids();
    let mut seen = 0;
    // On a node (its end report crosses to the head) and on the head itself; the first
    // with a restart, so its `Restarting` event carries the origin too.
    let elsewhere = (FailureOrigin::Elsewhere, "fail_elsewhere");
    let cases = [
        (one, 1, ActorEventKind::Restarting, elsewhere),
        (head, 0, ActorEventKind::Failed, elsewhere),
        (
            one,
            0,
            ActorEventKind::Failed,
            (FailureOrigin::Here, "fail"),
        ),
    ];
    for (node, restarts, kind, (origin, method)) in cases {
        let options = probe(1, Strategy::Node(node)).restart(restarts, Duration::from_millis(20));
        let actor = cluster.spawn(options).await;
        let error = call(&actor, method, "peer gone").await.expect_err("fails");
        assert_eq!(error.failure_origin(), Some(origin), "{error}");
        assert_eq!(
            error.to_string(),
            format!(
                "actor {} on node {node} failed: {method}: peer gone",
                actor.id()
            )
        );
        let events = events_until(&cluster.client, &mut seen, |events| {
            events.iter().any(|e| e.kind == kind)
        })
        .await;
        let event = events.iter().find(|e| e.kind == kind).expect("the event");
        assert_eq!(
            (event.actor, event.origin),
            (actor.id(), origin),
            "{events:?}"
        );
        if kind == ActorEventKind::Failed {
            // A later caller learns it from the head's record of the actor.
            let error = call(&actor, "echo", "").await.expect_err("failed for good");
            assert_eq!(error.failure_origin(), Some(origin), "{error}");
        }
    }
    // Events that are not failures come from nowhere else.
    let actor = cluster.spawn(probe(1, Strategy::Node(one))).await;
    within("stop", actor.stop()).await.expect("stop");
    let events = events_until(&cluster.client, &mut seen, |events| {
        events.iter().any(|e| e.kind == ActorEventKind::Stopped)
    })
    .await;
    assert!(
        events.iter().all(|e| e.origin == FailureOrigin::Here),
        "{events:?}"
    );
}

#[tokio::test]
async fn a_dropped_node_fails_its_actors_and_restarts_land_on_survivors() {
    let mut cluster = Cluster::start().await;
    let [head, one, gpu] = cluster.ids();
    // Spread: one actor per node; the one on `one` dies with it.
    let (_spread, doomed) = cluster.spread_restartable(one).await;
    let plain = cluster.spawn(probe(1, Strategy::Node(one))).await;
    assert_eq!(call(&doomed, "add", "5").await.expect("add"), "5");

    // How soon the head notices is `cluster.rs`'s to check (and membership_tests.rs's, on
    // a simulated clock); here, what it does then, within the usual limit.
    drop(cluster.nodes[0].take());
    let mut seen = 0;
    let events = events_until(&cluster.client, &mut seen, |events| {
        events.iter().any(|e| e.kind == ActorEventKind::Restarted)
            && events.iter().any(|e| e.kind == ActorEventKind::Failed)
    })
    .await;
    let lost = format!("node {one} lost: no heartbeat for {DEAD_AFTER_MS} ms");
    let mut seen_kinds = kinds(&events);
    seen_kinds.sort();
    let mut want = vec![
        (doomed.id().0, ActorEventKind::Restarting),
        (doomed.id().0, ActorEventKind::Restarted),
        (plain.id().0, ActorEventKind::Failed),
    ];
    want.sort();
    assert_eq!(seen_kinds, want, "{events:?}");
    for event in &events {
        match event.kind {
            ActorEventKind::Restarted => assert_ne!(event.node, Some(one)),
            _ => assert!(event.reason.starts_with(&lost), "{event:?}"),
        }
    }

    // The handle follows the restarted actor to its new node (state not kept).
    assert_eq!(call(&doomed, "get", "").await.expect("get"), "0");
    assert!([head, gpu].contains(&doomed.node()), "{doomed:?}");
    let error = call(&plain, "echo", "").await.expect_err("failed");
    assert!(error.to_string().contains(&lost), "{error}");
    let status = cluster.status().await;
    assert_eq!(reservations(&status).len(), 3, "{status}");
    assert!(
        status.reservations.iter().all(|r| r.node != one),
        "{status}"
    );
}

/// A partition between a node and the head (the test network drops everything between
/// them): its actor fails with the cause `NodeLost` and restarts elsewhere; once the link
/// heals the node joins again, and each actor is still held once, where its handle finds
/// it.
#[tokio::test]
async fn a_node_cut_off_from_the_head_loses_its_actors_and_rejoins_without_them() {
    let cluster = Cluster::start().await;
    let [head, one, gpu] = cluster.ids();
    let (actors, doomed) = cluster.spread_restartable(one).await;
    assert_eq!(call(&doomed, "add", "5").await.expect("add"), "5");

    cluster
        .test
        .net
        .set("one", HEAD, Traffic::All, Action::Drop);
    let mut seen = 0;
    let events = events_until(&cluster.client, &mut seen, |events| {
        events.iter().any(|e| e.kind == ActorEventKind::Restarted)
    })
    .await;
    let restarting = events
        .iter()
        .find(|e| e.kind == ActorEventKind::Restarting)
        .unwrap_or_else(|| panic!("no restart in {events:?}"));
    assert_eq!(
        (restarting.node, restarting.origin),
        (Some(one), FailureOrigin::NodeLost),
        "{events:?}"
    );
    // The handle follows the restarted instance (its state not kept).
    assert_eq!(call(&doomed, "get", "").await.expect("get"), "0");
    assert!([head, gpu].contains(&doomed.node()), "{doomed:?}");

    cluster.test.net.heal("one", HEAD);
    let status = within("one back", async {
        loop {
            let status = cluster.status().await;
            if status.live_nodes().any(|n| n.id == one) {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let mut want: Vec<(String, NodeId)> = actors
        .iter()
        .map(|a| (format!("actor:{}", a.id()), a.node()))
        .collect();
    want.sort();
    assert_eq!(reservations(&status), want, "{status}");
    assert_eq!(call(&doomed, "add", "2").await.expect("add"), "2");
}

#[tokio::test]
async fn a_client_that_goes_away_takes_its_actors_along() {
    let cluster = Cluster::start().await;
    let [_, one, _] = cluster.ids();
    let other = cluster.test.client("head").await;
    let actor = within("spawn", other.spawn(probe(1, Strategy::Node(one))))
        .await
        .expect("spawn");
    let id = actor.id();
    assert_eq!(cluster.status().await.reservations.len(), 1);
    let kept = within("actor", cluster.client.actor(id))
        .await
        .expect("locate");
    drop((actor, other));
    // The head hears the connection close; there is no event for another owner's actors,
    // so this polls the status.
    within("released", async {
        while !cluster.status().await.reservations.is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let error = call(&kept, "echo", "").await.expect_err("killed");
    assert!(error.to_string().contains("is stopped"), "{error}");
}

/// A detached actor is nobody's: its spawner's disconnect, which takes the spawner's
/// other actors along, leaves it running, and another client may stop it.
#[tokio::test]
async fn a_detached_actor_outlives_its_spawner_and_any_client_stops_it() {
    let cluster = Cluster::start().await;
    let [_, one, _] = cluster.ids();
    let other = cluster.test.client("head").await;
    let owned = within("spawn", other.spawn(probe(1, Strategy::Node(one))))
        .await
        .expect("spawn owned");
    let detached = within(
        "spawn",
        other.spawn(probe(1, Strategy::Node(one)).detached()),
    )
    .await
    .expect("spawn detached");
    let id = detached.id();
    assert_eq!(cluster.status().await.reservations.len(), 2);
    drop((owned, detached, other));
    // The spawner's owned actor going is the sign that the head saw it disconnect.
    within("the owned actor released", async {
        while cluster.status().await.reservations.len() != 1 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let kept = within("actor", cluster.client.actor(id))
        .await
        .expect("the detached actor is still running");
    assert_eq!(
        call(&kept, "echo", "still here").await.expect("echo"),
        "still here"
    );
    within("stop", kept.stop())
        .await
        .expect("any client stops it");
    within("released", async {
        while !cluster.status().await.reservations.is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}
