//! A job that is not elastic and loses a part: a killed node daemon, trainer or head, a
//! partition, a paused node. The job fails naming the rank and node it lost, and the
//! lost node fences its trainer.

use std::time::{Duration, Instant};

use rustix::process::{Signal, kill_process};
use serde_json::Value;

use crate::common;
use crate::common::train::{Dataset, Job, SETTLE_LIMIT, TrainCluster, workers_of};
use crate::common::{Netns, is_running, node_states, pid_of, wait_alive, wait_for};

/// SIGKILL the node daemon in the middle of a job.
#[test]
fn a_job_whose_node_daemon_is_killed_fails_naming_the_rank_and_node() {
    a_job_fails_when_its_node_loses(Victim::NodeDaemon);
}

/// SIGKILL the worker process that runs the node's trainer.
#[test]
fn a_job_whose_trainer_process_is_killed_fails_naming_the_rank_and_node() {
    a_job_fails_when_its_node_loses(Victim::Worker);
}

#[derive(Debug, Clone, Copy)]
enum Victim {
    NodeDaemon,
    Worker,
}

/// A decentralized job loses a trainer the same way: the survivor's mixing or its sums
/// end at once, and the error leads with the lost rank.
#[test]
fn a_decentralized_job_whose_trainer_process_is_killed_fails_naming_the_rank_and_node() {
    a_job_with_fails_when_its_node_loses(Victim::Worker, &["train.sync=\"decentralized\""]);
}

fn a_job_fails_when_its_node_loses(victim: Victim) {
    a_job_with_fails_when_its_node_loses(victim, &[]);
}

fn a_job_with_fails_when_its_node_loses(victim: Victim, sets: &[&str]) {
    let cluster = TrainCluster::start();
    let mut job = cluster.job("doomed", 200, sets, false);
    cluster.wait_for_steps(&mut job, "doomed", 2);
    let daemon = cluster.node.daemon_pids();
    assert_eq!(daemon.len(), 1, "one daemon on the node");
    let pid = match victim {
        Victim::NodeDaemon => daemon[0],
        Victim::Worker => {
            let workers = workers_of(daemon[0]);
            assert_eq!(workers.len(), 1, "one trainer on the node: {workers:?}");
            workers[0]
        }
    };
    let killed_at = Instant::now();
    kill_process(pid_of(pid).expect("pid"), Signal::KILL).expect("kill -9");
    let out = job.finish(Duration::from_secs(60));
    let took = killed_at.elapsed();
    eprintln!("{victim:?} killed: `imgrun train` exited after {took:?}");
    assert!(!out.status.success(), "{}", out.describe());
    assert_ne!(out.status.code(), Some(130), "{}", out.describe());
    // The error leads with the rank that failed first and its node (the head's event
    // for it), not with the healthy rank that lost its ring peer.
    let error = &out.stderr;
    let lost = format!("rank 1 (node {})", cluster.node_id);
    assert!(
        error.contains(&lost),
        "the lost rank and its node (`{lost}`) are not named:\n{error}"
    );
    let first_line = error
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_default();
    assert!(
        first_line.contains(&lost),
        "the error does not lead with the root cause:\n{error}"
    );
    if let Victim::NodeDaemon = victim {
        wait_for(SETTLE_LIMIT, "the node declared dead", || {
            let states = node_states(&cluster.head.status());
            states
                .iter()
                .any(|(id, s)| *id == cluster.node_id && s == "dead")
                .then_some(())
        });
    }
    cluster.assert_settled();
}

/// A network partition mid-job: the veth link between the head's and the node's network
/// namespaces is cut (no packet refused, none answered). The job fails within seconds,
/// naming the cut-off rank and its node, instead of hanging in the ring; the node, cut
/// off for the dead window, fences its trainer by itself (kills it, its process ends);
/// once the link is back, the node joins again. Needs root and `ip`.
#[test]
fn a_partition_mid_job_fails_it_naming_the_cut_off_node_which_fences_its_trainer() {
    let net = match Netns::create() {
        Ok(net) => net,
        Err(missing) => return common::skip::skip_or_fail(&missing),
    };
    let root = tempfile::tempdir().expect("temp dir");
    let (head, node, status) = net.cluster(root.path());
    let node_id = common::nodes(&status)
        .iter()
        .find(|n| {
            n["address"]
                .as_str()
                .is_some_and(|a| a.starts_with(&net.addresses[1]))
        })
        .and_then(|n| n["id"].as_u64())
        .expect("the node's id");
    let data = Dataset::synth(root.path());
    let runs = root.path().join("runs");
    let mut job = Job::start(&head, &data.args(&runs, "cut", 200), root.path());
    common::train::wait_for_steps(&mut job, &runs.join("cut"), 2);
    let daemon = node.daemon_pids();
    assert_eq!(daemon.len(), 1, "one daemon on the node");
    let trainers = workers_of(daemon[0]);
    assert_eq!(trainers.len(), 1, "one trainer on the node: {trainers:?}");

    net.cut();
    let cut_at = Instant::now();
    let out = job.finish(Duration::from_secs(60));
    eprintln!(
        "link cut: `imgrun train` exited after {:?}",
        cut_at.elapsed()
    );
    assert!(!out.status.success(), "{}", out.describe());
    let lost = format!("rank 1 (node {node_id})");
    assert!(
        out.stderr.contains(&lost),
        "the cut-off rank and its node (`{lost}`) are not named:\n{}",
        out.describe()
    );
    // Cut off for the dead window, the node kills its trainer without being told.
    wait_for(
        Duration::from_secs(20),
        "the cut-off node's trainer gone",
        || trainers.iter().all(|&pid| !is_running(pid)).then_some(()),
    );
    eprintln!("trainer fenced {:?} after the cut", cut_at.elapsed());
    net.restore();
    wait_alive(&head, 2, Duration::from_secs(20));
    head.run_ok(&["stop", "--all"]);
    let pids: Vec<u32> = [&head, &node]
        .iter()
        .flat_map(|m| m.daemon_pids())
        .collect();
    wait_for(Duration::from_secs(10), "daemons gone", || {
        pids.iter().all(|&p| !is_running(p)).then_some(())
    });
}

/// SIGSTOP the node's daemon alone: its worker runs on, unsupervised.
#[test]
fn a_paused_node_daemon_stops_the_failed_jobs_trainer_before_it_counts_as_free() {
    a_paused_node_comes_back_fenced(Pause::Daemon);
}

/// SIGSTOP the node's daemon and its worker: both resume together.
#[test]
fn a_paused_node_with_its_worker_stops_the_failed_jobs_trainer_before_it_counts_as_free() {
    a_paused_node_comes_back_fenced(Pause::DaemonAndWorkers);
}

#[derive(Debug, Clone, Copy)]
enum Pause {
    Daemon,
    DaemonAndWorkers,
}

/// A node paused until the head declares it dead (and the job fails) comes back: it must
/// kill the trainer of its old session before the head counts it live again, so that
/// `imgrun status` never shows its CPUs free while that trainer's process runs.
fn a_paused_node_comes_back_fenced(pause: Pause) {
    let cluster = TrainCluster::start();
    let mut job = cluster.job("paused", 200, &[], false);
    cluster.wait_for_steps(&mut job, "paused", 2);
    let daemon = cluster.node.daemon_pids();
    assert_eq!(daemon.len(), 1, "one daemon on the node");
    let daemon = daemon[0];
    let workers = workers_of(daemon);
    assert_eq!(workers.len(), 1, "one trainer on the node: {workers:?}");
    let paused: Vec<u32> = match pause {
        Pause::Daemon => vec![daemon],
        Pause::DaemonAndWorkers => vec![daemon, workers[0]],
    };
    let signal_all = |signal: Signal| {
        for &pid in &paused {
            kill_process(pid_of(pid).expect("pid"), signal).expect("signal the node");
        }
    };
    signal_all(Signal::STOP);
    // Resumed whatever happens below, so that the cluster can be stopped.
    struct Resume<F: Fn(Signal)>(F);
    impl<F: Fn(Signal)> Drop for Resume<F> {
        fn drop(&mut self) {
            (self.0)(Signal::CONT);
        }
    }
    let resume = Resume(signal_all);
    let out = job.finish(Duration::from_secs(60));
    assert!(!out.status.success(), "{}", out.describe());
    let lost = format!("rank 1 (node {})", cluster.node_id);
    assert!(
        out.stderr.contains(&lost),
        "the lost rank and its node (`{lost}`) are not named:\n{}",
        out.stderr
    );
    wait_for(SETTLE_LIMIT, "the node declared dead", || {
        node_states(&cluster.head.status())
            .iter()
            .any(|(id, s)| *id == cluster.node_id && s == "dead")
            .then_some(())
    });
    drop(resume);
    let resumed_at = Instant::now();
    // From now on, whenever the head shows the node alive with nothing reserved on it,
    // the old trainer's process must be gone.
    let mut seen_free = 0;
    wait_for(
        SETTLE_LIMIT,
        "the node alive again and its worker gone",
        || {
            let status = cluster.head.status();
            let node = common::nodes(&status)
                .into_iter()
                .find(|n| n["id"].as_u64() == Some(cluster.node_id))?;
            let alive = node["state"] == "alive";
            let free = node["used"].get("cpu").and_then(Value::as_u64).unwrap_or(0) == 0;
            let running = workers.iter().any(|&w| is_running(w));
            if alive && free {
                seen_free += 1;
                assert!(
                    !running,
                    "{pause:?}: the head counts node {}'s CPUs free while the failed job's \
                 trainer (pid {}) still runs there:\n{status:#}",
                    cluster.node_id, workers[0]
                );
            }
            (alive && !running).then_some(())
        },
    );
    eprintln!(
        "{pause:?}: node alive again and its old trainer gone {:?} after SIGCONT ({seen_free} \
         status reads showed it free)",
        resumed_at.elapsed()
    );
    cluster.assert_settled();
}

/// SIGKILL the head's daemon in the middle of a job: `imgrun train` says it lost the head
/// (not that a ring peer failed) and how to continue, and no trainer is left anywhere.
#[test]
fn a_job_whose_head_is_killed_says_the_head_was_lost_and_leaves_no_trainer() {
    let cluster = TrainCluster::start();
    let mut job = cluster.job("headless", 200, &["train.checkpoint_every_steps=2"], false);
    cluster.wait_for_steps(&mut job, "headless", 4);
    let head = cluster.head.daemon_pids();
    let node = cluster.node.daemon_pids();
    assert_eq!((head.len(), node.len()), (1, 1), "one daemon each");
    let trainers: Vec<u32> = [head[0], node[0]]
        .iter()
        .flat_map(|&d| workers_of(d))
        .collect();
    assert_eq!(trainers.len(), 2, "a trainer on each daemon: {trainers:?}");
    let killed_at = Instant::now();
    kill_process(pid_of(head[0]).expect("pid"), Signal::KILL).expect("kill -9 the head");
    let out = job.finish(Duration::from_secs(60));
    let took = killed_at.elapsed();
    assert!(!out.status.success(), "{}", out.describe());
    let first_line = out
        .stderr
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_default();
    let lost = format!("lost the head node at {}", cluster.join.0);
    assert!(
        first_line.contains(&lost),
        "the error does not lead with `{lost}`:\n{}",
        out.describe()
    );
    for words in ["cannot continue", "--resume"] {
        assert!(
            out.stderr.contains(words),
            "`{words}` not in:\n{}",
            out.stderr
        );
    }
    wait_for(SETTLE_LIMIT, "no trainer process left", || {
        trainers.iter().all(|&p| !is_running(p)).then_some(())
    });
    eprintln!(
        "head killed: `imgrun train` exited after {took:?}, every trainer gone after {:?}; \
         it said:\n{}",
        killed_at.elapsed(),
        out.stderr
    );
    assert!(is_running(node[0]), "the node daemon lives on");
}
