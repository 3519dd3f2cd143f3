//! Tests of [`LocalActors`] from a tokio multi-thread runtime, as the daemons use it. Actors
//! that must be caught mid-method block on a gate the test opens; nothing sleeps.

use std::future::Future;
use std::pin::Pin;
use std::sync::Condvar;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::Poll;

use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::mpsc::error::TryRecvError;

use super::*;
use crate::actor::{Actor, MethodError};

/// Bounds every test, so that a bug shows as a failure rather than a hung run.
const LIMIT: Duration = Duration::from_secs(20);

/// What the test sees of its probes, and the gate that holds them in `block`.
struct Harness {
    open: Mutex<bool>,
    opened: Condvar,
    /// A permit per probe that entered `block`.
    entered: Semaphore,
    /// A permit per probe dropped.
    dropped: Semaphore,
    stopping: AtomicUsize,
    log: Mutex<Vec<String>>,
}

impl Harness {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            open: Mutex::new(false),
            opened: Condvar::new(),
            entered: Semaphore::new(0),
            dropped: Semaphore::new(0),
            stopping: AtomicUsize::new(0),
            log: Mutex::new(Vec::new()),
        })
    }

    fn open_gate(&self) {
        *self.open.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.opened.notify_all();
    }

    fn wait_at_gate(&self) -> Result<(), MethodError> {
        self.entered.add_permits(1);
        let open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let (_open, wait) = self
            .opened
            .wait_timeout_while(open, LIMIT, |open| !*open)
            .unwrap_or_else(PoisonError::into_inner);
        if wait.timed_out() {
            return Err(MethodError::new("the gate never opened"));
        }
        Ok(())
    }

    async fn entered(&self) {
        bounded(self.entered.acquire())
            .await
            .expect("semaphore open")
            .forget();
    }

    async fn dropped(&self) {
        bounded(self.dropped.acquire())
            .await
            .expect("semaphore open")
            .forget();
    }

    fn log(&self) -> Vec<String> {
        self.log
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// The test actor; its methods are named for what they do.
struct Probe {
    harness: Arc<Harness>,
    count: i64,
}

impl Actor for Probe {
    fn call(&mut self, method: &str, payload: &[u8]) -> Result<Vec<u8>, MethodError> {
        let text = std::str::from_utf8(payload)?;
        match method {
            "echo" => Ok(payload.to_vec()),
            "add" => {
                self.count += text.parse::<i64>()?;
                Ok(self.count.to_string().into_bytes())
            }
            "log" => {
                let mut log = self
                    .harness
                    .log
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                log.push(text.to_string());
                Ok(Vec::new())
            }
            "block" => self.harness.wait_at_gate().map(|()| Vec::new()),
            "fail" => Err(MethodError::new("bad input")),
            "fatal" => Err(MethodError::fatal("cuda error")),
            "panic" => panic!("kaboom"),
            other => Err(MethodError::new(format!("no method {other}"))),
        }
    }

    fn stopping(&mut self) {
        self.harness.stopping.fetch_add(1, Ordering::SeqCst);
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        self.harness.dropped.add_permits(1);
    }
}

struct Setup {
    actors: LocalActors,
    exits: UnboundedReceiver<ActorExit>,
    harness: Arc<Harness>,
}

/// A host with the kinds `probe`, `slow` (its constructor waits at the gate), `broken`
/// (its constructor fails) and `explosive` (it panics), and one probe started as actor 1.
async fn setup(mailbox_capacity: usize) -> Setup {
    let harness = Harness::new();
    let mut registry = ActorRegistry::new();
    let probes = Arc::clone(&harness);
    registry
        .register("probe", move |_ctx, _args| {
            let harness = Arc::clone(&probes);
            Ok(Box::new(Probe { harness, count: 0 }) as Box<dyn Actor>)
        })
        .register("slow", {
            let harness = Arc::clone(&harness);
            move |_ctx, _args| {
                harness.wait_at_gate()?;
                let harness = Arc::clone(&harness);
                Ok(Box::new(Probe { harness, count: 0 }) as Box<dyn Actor>)
            }
        })
        .register("broken", |_ctx, _args| {
            Err(MethodError::new("no checkpoint"))
        })
        .register("explosive", |_ctx, _args| panic!("bad weights"));
    let (sender, exits) = mpsc::unbounded_channel();
    let options = LocalOptions {
        mailbox_capacity,
        ..LocalOptions::default()
    };
    let actors = LocalActors::new(registry, options, sender).expect("actix system");
    bounded(actors.start(probe(1))).await.expect("probe starts");
    Setup {
        actors,
        exits,
        harness,
    }
}

fn probe(id: u64) -> ActorSpec {
    spec(id, "probe")
}

fn spec(id: u64, kind: &str) -> ActorSpec {
    ActorSpec {
        id: ActorId(id),
        kind: kind.to_string(),
        args: Vec::new(),
        gpus: Vec::new(),
    }
}

async fn bounded<F: Future>(future: F) -> F::Output {
    tokio::time::timeout(LIMIT, future)
        .await
        .expect("the test took too long")
}

async fn call(
    actors: &LocalActors,
    id: u64,
    method: &str,
    payload: &str,
) -> Result<String, String> {
    bounded(actors.call(ActorId(id), method, payload.into(), LIMIT))
        .await
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .map_err(|error| error.to_string())
}

async fn next_exit(exits: &mut UnboundedReceiver<ActorExit>) -> ActorExit {
    bounded(exits.recv()).await.expect("exit channel open")
}

/// Polls `future` once: `None` if it is still pending.
async fn poll_once<F: Future + Unpin>(future: &mut F) -> Option<F::Output> {
    std::future::poll_fn(|cx| {
        Poll::Ready(match Pin::new(&mut *future).poll(cx) {
            Poll::Ready(output) => Some(output),
            Poll::Pending => None,
        })
    })
    .await
}

/// Puts a call to probe 1 in its mailbox and waits for the reply in the background.
async fn queue_call(
    setup: &Setup,
    method: &str,
    payload: &str,
) -> tokio::task::JoinHandle<Result<String, String>> {
    let send = setup
        .actors
        .send_call(ActorId(1), method, payload.into(), LIMIT);
    let pending = bounded(send).await.expect("queued");
    tokio::spawn(async move {
        pending
            .reply()
            .await
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
            .map_err(|error| error.to_string())
    })
}

/// Starts a `block` call in the background and returns once the probe is at the gate.
async fn block(setup: &Setup, id: u64) -> tokio::task::JoinHandle<Result<String, String>> {
    let actors = setup.actors.clone();
    let blocked = tokio::spawn(async move { call(&actors, id, "block", "").await });
    setup.harness.entered().await;
    blocked
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_and_tells_from_one_task_run_in_send_order() {
    let setup = setup(4).await;
    let mut want = Vec::new();
    for i in 0..200 {
        let item = i.to_string();
        if i % 3 == 0 {
            assert_eq!(
                call(&setup.actors, 1, "log", &item).await,
                Ok(String::new())
            );
        } else {
            let tell = setup
                .actors
                .tell(ActorId(1), "log", item.clone().into_bytes());
            bounded(tell).await.expect("tell");
        }
        want.push(item);
    }
    // A call after the tells returns once they all ran.
    assert_eq!(
        call(&setup.actors, 1, "echo", "done").await,
        Ok("done".into())
    );
    assert_eq!(setup.harness.log(), want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn method_errors_go_back_to_the_caller_and_the_actor_carries_on() {
    let mut setup = setup(4).await;
    let cases = [
        ("fail", "", "actor 1: fail: bad input"),
        ("add", "x", "actor 1: add: invalid digit found in string"),
        ("nope", "", "actor 1: nope: no method nope"),
    ];
    for (method, payload, want) in cases {
        assert_eq!(
            call(&setup.actors, 1, method, payload).await,
            Err(want.into())
        );
    }
    assert_eq!(call(&setup.actors, 1, "add", "2").await, Ok("2".into()));
    assert!(matches!(setup.exits.try_recv(), Err(TryRecvError::Empty)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fatal_errors_and_panics_fail_only_that_actor() {
    let cases = [
        ("fatal", "fatal: cuda error"),
        ("panic", "panicked in panic: kaboom"),
    ];
    for (method, reason) in cases {
        let mut setup = setup(4).await;
        bounded(setup.actors.start(probe(2)))
            .await
            .expect("second probe");
        let failed = format!("actor 1 failed: {reason}");
        assert_eq!(
            call(&setup.actors, 1, method, "").await,
            Err(failed.clone()),
            "{method}"
        );
        let exit = next_exit(&mut setup.exits).await;
        assert_eq!(exit.actor_id, ActorId(1));
        assert_eq!(exit.reason, ExitReason::failed(reason));
        // Later callers learn why; the other actor and the host carry on.
        assert_eq!(call(&setup.actors, 1, "echo", "hi").await, Err(failed));
        assert_eq!(call(&setup.actors, 2, "echo", "hi").await, Ok("hi".into()));
        bounded(setup.actors.start(probe(1)))
            .await
            .expect("restart with the same id");
        assert_eq!(call(&setup.actors, 1, "add", "5").await, Ok("5".into()));
        assert_eq!(setup.actors.actors(), vec![ActorId(1), ActorId(2)]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_that_cannot_happen_say_why() {
    let mut setup = setup(4).await;
    let cases = [
        (
            spec(7, "trainer"),
            "unknown actor kind 'trainer' (registered: broken, explosive, probe, slow)",
        ),
        (
            spec(7, "broken"),
            "actor 7 (broken) did not start: no checkpoint",
        ),
        (
            spec(7, "explosive"),
            "actor 7 (explosive) did not start: constructor panicked: bad weights",
        ),
        (probe(1), "actor 1 already runs here"),
    ];
    for (spec, want) in cases {
        let error = bounded(setup.actors.start(spec)).await.expect_err(want);
        assert_eq!(error.to_string(), want);
    }
    // A failed start frees its id and reports no exit.
    bounded(setup.actors.start(probe(7)))
        .await
        .expect("id 7 is free");
    assert!(matches!(setup.exits.try_recv(), Err(TryRecvError::Empty)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_given_up_leaves_nothing_behind() {
    let mut setup = setup(4).await;
    let actors = setup.actors.clone();
    let start = tokio::spawn(async move { actors.start(spec(5, "slow")).await });
    setup.harness.entered().await;
    start.abort();
    assert!(
        bounded(start)
            .await
            .is_err_and(|error| error.is_cancelled())
    );
    setup.harness.open_gate();
    // Built after all, the actor is dropped; its id is free and nothing is reported.
    setup.harness.dropped().await;
    bounded(setup.actors.start(probe(5)))
        .await
        .expect("id 5 is free");
    assert_eq!(call(&setup.actors, 5, "add", "2").await, Ok("2".into()));
    assert!(matches!(setup.exits.try_recv(), Err(TryRecvError::Empty)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_actors_are_refused() {
    let setup = setup(4).await;
    assert_eq!(
        call(&setup.actors, 9, "echo", "").await,
        Err("no actor 9 here".into())
    );
    let tell = setup.actors.tell(ActorId(9), "echo", Vec::new()).await;
    assert_eq!(tell, Err(ActorError::NotFound(ActorId(9))));
    assert_eq!(
        setup.actors.stop(ActorId(9), false),
        Err(ActorError::NotFound(ActorId(9)))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_times_out_and_is_skipped_if_it_had_not_run() {
    let setup = setup(4).await;
    let blocked = block(&setup, 1).await;
    let timeout = Duration::from_millis(50);
    let late = setup
        .actors
        .call(ActorId(1), "log", b"late".to_vec(), timeout);
    let error = bounded(late).await.expect_err("times out");
    assert_eq!(
        error.to_string(),
        "actor 1 did not answer 'log' within 50 ms"
    );
    setup.harness.open_gate();
    assert_eq!(bounded(blocked).await.expect("task"), Ok(String::new()));
    assert_eq!(
        call(&setup.actors, 1, "log", "next").await,
        Ok(String::new())
    );
    assert_eq!(setup.harness.log(), vec!["next".to_string()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_mailbox_makes_senders_wait() {
    let setup = setup(2).await;
    let blocked = block(&setup, 1).await;
    // The running `block` holds no permit: two messages fit, the third waits.
    for item in ["a", "b"] {
        let tell = setup.actors.tell(ActorId(1), "log", item.into());
        bounded(tell).await.expect("room in the mailbox");
    }
    let mut third = Box::pin(setup.actors.tell(ActorId(1), "log", b"c".to_vec()));
    assert_eq!(poll_once(&mut third).await, None, "waits for room");
    let timeout = Duration::from_millis(20);
    let call = setup.actors.call(ActorId(1), "log", b"x".to_vec(), timeout);
    let error = bounded(call)
        .await
        .expect_err("no room before the deadline");
    assert!(matches!(error, ActorError::Timeout { .. }), "{error}");
    setup.harness.open_gate();
    bounded(third).await.expect("room once the actor runs");
    assert_eq!(bounded(blocked).await.expect("task"), Ok(String::new()));
    assert_eq!(call_log(&setup).await, vec!["a", "b", "c"]);
}

/// The probe's log, once what was queued before has run.
async fn call_log(setup: &Setup) -> Vec<String> {
    assert_eq!(call(&setup.actors, 1, "echo", "").await, Ok(String::new()));
    setup.harness.log()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_runs_what_is_queued_first() {
    let mut setup = setup(4).await;
    let blocked = block(&setup, 1).await;
    bounded(setup.actors.tell(ActorId(1), "log", b"a".to_vec()))
        .await
        .expect("tell");
    let queued = queue_call(&setup, "add", "3").await;
    setup.actors.stop(ActorId(1), false).expect("stop");
    let refused = call(&setup.actors, 1, "echo", "").await;
    assert_eq!(refused, Err("actor 1 is stopping".into()));
    setup.harness.open_gate();
    assert_eq!(bounded(blocked).await.expect("task"), Ok(String::new()));
    assert_eq!(bounded(queued).await.expect("task"), Ok("3".into()));
    let exit = next_exit(&mut setup.exits).await;
    assert_eq!(exit.reason, ExitReason::Stopped);
    // Stopping ran, and the actor was dropped before its exit was reported.
    assert_eq!(setup.harness.stopping.load(Ordering::SeqCst), 1);
    assert_eq!(setup.harness.dropped.available_permits(), 1);
    assert_eq!(setup.harness.log(), vec!["a".to_string()]);
    assert_eq!(
        call(&setup.actors, 1, "echo", "").await,
        Err("actor 1 stopped".into())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_queued_before_a_graceful_stop_gets_its_reply() {
    for _ in 0..20 {
        let setup = setup(DEFAULT_MAILBOX_CAPACITY).await;
        let mut queued = Vec::new();
        for _ in 0..50 {
            queued.push(queue_call(&setup, "add", "1").await);
        }
        setup.actors.stop(ActorId(1), false).expect("stop");
        for (i, reply) in queued.into_iter().enumerate() {
            let want = Ok((i + 1).to_string());
            assert_eq!(bounded(reply).await.expect("task"), want);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_drops_what_is_queued_and_fails_its_callers_at_once() {
    let mut setup = setup(4).await;
    let blocked = block(&setup, 1).await;
    bounded(setup.actors.tell(ActorId(1), "log", b"a".to_vec()))
        .await
        .expect("tell");
    let queued = queue_call(&setup, "log", "b").await;
    setup.actors.stop(ActorId(1), true).expect("kill");
    // While the actor is still blocked: its callers and the daemon know at once.
    let killed = Err("actor 1 was killed".to_string());
    assert_eq!(bounded(queued).await.expect("task"), killed);
    assert_eq!(next_exit(&mut setup.exits).await.reason, ExitReason::Killed);
    assert_eq!(call(&setup.actors, 1, "echo", "").await, killed);
    setup.harness.open_gate();
    // The running method finishes (a thread cannot be interrupted); nothing queued runs.
    let finished = bounded(blocked).await.expect("task");
    assert!(
        finished == Ok(String::new()) || finished == killed,
        "{finished:?}"
    );
    setup.harness.dropped().await;
    assert_eq!(setup.harness.log(), Vec::<String>::new());
    assert_eq!(setup.harness.stopping.load(Ordering::SeqCst), 0);
    assert!(matches!(setup.exits.try_recv(), Err(TryRecvError::Empty)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_host_does_not_wait_for_a_blocked_actor() {
    let mut setup = setup(4).await;
    let blocked = block(&setup, 1).await;
    drop(setup.actors);
    setup.harness.open_gate();
    let _ = bounded(blocked).await.expect("task");
    // The actor's thread ends once its method returns, and the host's channel closes.
    setup.harness.dropped().await;
    assert_eq!(bounded(setup.exits.recv()).await, None);
}

#[test]
fn gpus_are_numbered_as_cuda_sees_them() {
    type Case<'a> = (&'a [u32], Option<&'a [u32]>, Result<&'a [u32], &'a str>);
    let cases: [Case; 5] = [
        (&[3, 1], None, Ok(&[3, 1])),
        (&[3, 1], Some(&[2, 3, 1]), Ok(&[1, 2])),
        (&[], Some(&[]), Ok(&[])),
        (
            &[0],
            Some(&[]),
            Err("gpu 0 is not visible to this process (CUDA_VISIBLE_DEVICES=)"),
        ),
        (
            &[5],
            Some(&[0, 1]),
            Err("gpu 5 is not visible to this process (CUDA_VISIBLE_DEVICES=0,1)"),
        ),
    ];
    for (gpus, visible, want) in cases {
        let want = want.map(<[u32]>::to_vec).map_err(str::to_string);
        assert_eq!(
            cuda_ordinals(gpus, visible),
            want,
            "{gpus:?} in {visible:?}"
        );
    }
}
