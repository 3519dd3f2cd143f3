//! Worker processes, for real: this test binary is its own worker. Started with `worker`
//! it runs `worker_main`; otherwise it runs the cases below in turn, each against a fresh
//! `WorkerPool` and bounded in time, and prints one line per case (`harness = false`, so
//! that the re-executed binary has a `main` of its own). Arguments select cases by name
//! as with libtest (`NAME`, `--skip NAME`). The last case runs a worker through a head,
//! as the cluster does: spawned by a client, killed with SIGKILL, restarted; the one after
//! it, through a node that joined a head (whose port, and the tasks that drive its worker
//! processes, are on a thread of the node's own).

mod common;

use std::future::Future;
use std::pin::Pin;
use std::process::ExitCode;
use std::task::Poll;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use runtime::{
    Actor, ActorCallError, ActorContext, ActorError, ActorEvent, ActorEventKind, ActorExit,
    ActorHosting, ActorId, ActorRegistry, ActorSpec, ClusterAccess, ClusterClient, ExitReason,
    FailureOrigin, MethodError, NodeId, PoolOptions, Resources, SpawnOptions, Strategy,
    WorkerCommand, WorkerPool, worker_main,
};
use tokio::sync::mpsc::UnboundedReceiver;

use common::LIMIT;
use common::cluster::TestCluster;

type Case = fn() -> Pin<Box<dyn Future<Output = Result<()>> + Send>>;

/// `(name, case)` for each async fn named.
macro_rules! cases {
    ($($case:ident),* $(,)?) => {
        &[$((stringify!($case), || Box::pin($case()))),*]
    };
}

const CASES: &[(&str, Case)] = cases![
    actors_of_a_group_share_its_process,
    the_worker_sees_the_gpus_of_its_group,
    the_worker_has_the_environment_of_its_command,
    the_worker_reaches_the_cluster_its_daemon_is_in,
    sigkill_fails_every_actor_of_the_worker,
    an_exit_fails_with_its_code_and_last_stderr,
    a_workers_output_is_kept_for_whoever_asks,
    an_ended_actors_output_is_kept_however_it_ended,
    a_panic_fails_only_that_actor,
    a_failure_caused_elsewhere_keeps_its_origin,
    starts_that_cannot_happen_say_why,
    calls_sent_before_a_graceful_stop_get_their_replies,
    stopping_the_last_actor_retires_the_worker,
    killing_the_last_actor_kills_the_worker,
    dropping_the_pool_leaves_no_worker_alive,
    a_worker_ends_with_its_node,
    frames_follow_the_pools_limit,
    a_killed_worker_fails_its_cluster_actor_for_the_owner,
    a_joined_nodes_worker_answers_calls_and_ends_with_the_node,
    an_ended_actors_output_is_asked_of_its_node_by_id,
];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("worker") => return worker_main(registry()),
        Some("node") => return node(),
        _ => {}
    }
    // As libtest reads them: names to run (by substring), `--skip NAME`; other flags are
    // ignored.
    let (mut filters, mut skips) = (Vec::new(), Vec::new());
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        if arg == "--skip" {
            skips.extend(rest.next());
        } else if !arg.starts_with('-') {
            filters.push(arg);
        }
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            println!("cannot start tokio: {error}");
            return ExitCode::FAILURE;
        }
    };
    let (mut passed, mut failed) = (0, 0);
    for (name, case) in CASES {
        let chosen = filters.is_empty() || filters.iter().any(|f| name.contains(f.as_str()));
        if !chosen || skips.iter().any(|skip| name.contains(skip.as_str())) {
            continue;
        }
        let outcome = runtime.block_on(async {
            // A task of its own, so that a panic is a failure of this case only.
            match tokio::time::timeout(LIMIT, tokio::spawn(case())).await {
                Ok(Ok(result)) => result,
                Ok(Err(panic)) => Err(anyhow::anyhow!("panicked: {panic}")),
                Err(_) => Err(anyhow::anyhow!("took longer than {LIMIT:?}")),
            }
        });
        match outcome {
            Ok(()) => {
                println!("test workers::{name} ... ok");
                passed += 1;
            }
            Err(error) => {
                println!("test workers::{name} ... FAILED\n    {error:#}");
                failed += 1;
            }
        }
    }
    let verdict = if failed == 0 { "ok" } else { "FAILED" };
    println!("\ntest result: {verdict}. {passed} passed; {failed} failed");
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The kinds a worker hosts: `probe` (methods named for what they do) and `counter`.
fn registry() -> ActorRegistry {
    let mut registry = ActorRegistry::new();
    registry
        .register("probe", |ctx, _args| {
            Ok(Box::new(Probe { ctx: ctx.clone() }) as Box<dyn Actor>)
        })
        .register("counter", |_ctx, args| {
            let start = std::str::from_utf8(args)?.parse::<i64>().unwrap_or(0);
            Ok(Box::new(Counter { total: start }) as Box<dyn Actor>)
        });
    registry
}

struct Probe {
    ctx: ActorContext,
}

impl Actor for Probe {
    fn call(&mut self, method: &str, payload: &[u8]) -> Result<Vec<u8>, MethodError> {
        let text = match method {
            "echo" => return Ok(payload.to_vec()),
            "pid" => std::process::id().to_string(),
            "cuda_env" => ["CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"]
                .map(|name| match std::env::var(name) {
                    Ok(value) => format!("{name}={value}"),
                    Err(_) => format!("{name} unset"),
                })
                .join(" "),
            "env" => {
                let name = std::str::from_utf8(payload)?;
                std::env::var(name).unwrap_or_else(|_| format!("{name} unset"))
            }
            "ordinals" => format!("{:?}", self.ctx.cuda_ordinals()),
            "cluster" => match self.ctx.cluster() {
                Some(access) => format!("{} {}", access.state_dir.display(), access.head),
                None => "none".to_string(),
            },
            "zeros" => return Ok(vec![0; std::str::from_utf8(payload)?.parse()?]),
            "print" => {
                // Actor code may write to stdout: it is not the node's channel.
                for i in 0..100 {
                    println!("line {i} on stdout");
                }
                String::new()
            }
            "hang" => loop {
                std::thread::park();
            },
            "crash" => {
                eprintln!("about to crash: checkpoint missing");
                std::process::exit(3);
            }
            "panic" => panic!("kaboom"),
            "fail_elsewhere" => {
                return Err(MethodError::fatal("its peer went away").caused_elsewhere());
            }
            other => return Err(MethodError::new(format!("no method {other}"))),
        };
        Ok(text.into_bytes())
    }
}

struct Counter {
    total: i64,
}

impl Actor for Counter {
    fn call(&mut self, method: &str, payload: &[u8]) -> Result<Vec<u8>, MethodError> {
        match method {
            "add" => self.total += std::str::from_utf8(payload)?.parse::<i64>()?,
            "get" => {}
            other => return Err(MethodError::new(format!("no method {other}"))),
        }
        Ok(self.total.to_string().into_bytes())
    }
}

/// A pool whose workers are this binary, and the channel its actors' exits arrive on.
fn pool() -> Result<(WorkerPool, UnboundedReceiver<ActorExit>)> {
    let command = WorkerCommand::current_exe(["worker"]).context("finding this test binary")?;
    Ok(pool_of(command))
}

fn pool_of(command: WorkerCommand) -> (WorkerPool, UnboundedReceiver<ActorExit>) {
    pool_with(command, PoolOptions::default())
}

fn pool_with(
    command: WorkerCommand,
    options: PoolOptions,
) -> (WorkerPool, UnboundedReceiver<ActorExit>) {
    let (exits, ended) = tokio::sync::mpsc::unbounded_channel();
    (WorkerPool::new(command, options, exits), ended)
}

async fn start(pool: &WorkerPool, group: &str, id: u64, kind: &str, gpus: &[u32]) -> Result<()> {
    let spec = ActorSpec {
        id: ActorId(id),
        kind: kind.to_string(),
        args: Vec::new(),
        gpus: gpus.to_vec(),
    };
    pool.start_actor(group, spec)
        .await
        .with_context(|| format!("starting actor {id} ({kind}) in group '{group}'"))
}

async fn call(
    pool: &WorkerPool,
    id: u64,
    method: &str,
    payload: &str,
) -> Result<String, ActorError> {
    let reply = pool
        .call(ActorId(id), method, payload.into(), LIMIT)
        .await?;
    Ok(String::from_utf8_lossy(&reply).into_owned())
}

async fn pid_of(pool: &WorkerPool, id: u64) -> Result<u32> {
    let pid = call(pool, id, "pid", "").await?;
    pid.parse().with_context(|| format!("pid {pid:?}"))
}

/// The next exits, sorted by actor.
async fn exits(ended: &mut UnboundedReceiver<ActorExit>, count: usize) -> Result<Vec<ActorExit>> {
    let mut exits = Vec::new();
    while exits.len() < count {
        exits.push(ended.recv().await.context("exit channel closed")?);
    }
    exits.sort_by_key(|exit| exit.actor_id);
    Ok(exits)
}

/// Where a failed actor's failure started; `None` for a stop or a kill.
fn origin(exit: &ActorExit) -> Option<FailureOrigin> {
    match &exit.reason {
        ExitReason::Failed { origin, .. } => Some(*origin),
        _ => None,
    }
}

fn failure(exit: &ActorExit) -> Result<&str> {
    match &exit.reason {
        ExitReason::Failed { reason, .. } => Ok(reason),
        other => bail!("actor {} ended {other}, not by a failure", exit.actor_id),
    }
}

/// Whether `pid` is a live process (a zombie counts as gone).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which is in parentheses.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

/// Waits until `pid` is gone. The kernel offers no event for another process's end to a
/// process that is not its parent, so this polls, with the case's time limit as the bound.
async fn gone(pid: u32) {
    while alive(pid) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
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

async fn actors_of_a_group_share_its_process() -> Result<()> {
    let (pool, _ended) = pool()?;
    start(&pool, "g", 1, "probe", &[]).await?;
    start(&pool, "g", 2, "counter", &[]).await?;
    start(&pool, "h", 3, "probe", &[]).await?;
    ensure!(call(&pool, 1, "echo", "hi").await? == "hi");
    for i in 1..=10 {
        pool.tell(ActorId(2), "add", i.to_string().into_bytes())
            .await?;
    }
    ensure!(
        call(&pool, 2, "get", "").await? == "55",
        "tells ran in order before the call"
    );
    let g = pid_of(&pool, 1).await?;
    ensure!(
        pool.pid("g") == Some(g),
        "pool says {:?}, worker says {g}",
        pool.pid("g")
    );
    ensure!(
        pid_of(&pool, 3).await? != g,
        "groups 'g' and 'h' share a process"
    );
    // What actor code prints on stdout does not disturb the channel.
    ensure!(call(&pool, 1, "print", "").await?.is_empty());
    ensure!(call(&pool, 1, "echo", "still").await? == "still");
    let error = call(&pool, 2, "divide", "")
        .await
        .expect_err("no such method");
    ensure!(
        error.to_string() == "actor 2: divide: no method divide",
        "{error}"
    );
    Ok(())
}

async fn the_worker_sees_the_gpus_of_its_group() -> Result<()> {
    let (pool, _ended) = pool()?;
    start(&pool, "gpu", 1, "probe", &[3, 1]).await?;
    start(&pool, "gpu", 2, "probe", &[1]).await?;
    start(&pool, "cpu", 3, "probe", &[]).await?;
    let cases = [
        (
            1,
            "cuda_env",
            "CUDA_VISIBLE_DEVICES=3,1 CUDA_DEVICE_ORDER=PCI_BUS_ID",
        ),
        (1, "ordinals", "[0, 1]"),
        (2, "ordinals", "[1]"),
        (
            3,
            "cuda_env",
            "CUDA_VISIBLE_DEVICES= CUDA_DEVICE_ORDER=PCI_BUS_ID",
        ),
        (3, "ordinals", "[]"),
    ];
    for (id, method, want) in cases {
        let got = call(&pool, id, method, "").await?;
        ensure!(got == want, "actor {id} {method}: {got}, want {want}");
    }
    let error = start(&pool, "gpu", 4, "probe", &[5])
        .await
        .expect_err("gpu 5 is not the group's");
    let want = "worker process for group 'gpu': it runs with CUDA_VISIBLE_DEVICES=3,1 (the GPUs \
                of its first actor); actor 4 needs gpu 5";
    ensure!(format!("{:#}", error).ends_with(want), "{error:#}");
    Ok(())
}

async fn the_worker_has_the_environment_of_its_command() -> Result<()> {
    let command = WorkerCommand::current_exe(["worker"])
        .context("finding this test binary")?
        .with_env("IMGRUN_TEST_SETTING", "from the command")
        // The pool's own variables win over the command's.
        .with_env("CUDA_DEVICE_ORDER", "FASTEST_FIRST");
    let (pool, _ended) = pool_of(command);
    start(&pool, "env", 1, "probe", &[]).await?;
    for (name, want) in [
        ("IMGRUN_TEST_SETTING", "from the command"),
        ("CUDA_DEVICE_ORDER", "PCI_BUS_ID"),
        // Inherited from this process.
        ("PATH", std::env::var("PATH")?.as_str()),
    ] {
        let got = call(&pool, 1, "env", name).await?;
        ensure!(got == want, "{name}: {got}, want {want}");
    }
    Ok(())
}

async fn the_worker_reaches_the_cluster_its_daemon_is_in() -> Result<()> {
    let command = WorkerCommand::current_exe(["worker"]).context("finding this test binary")?;
    let (pool, _ended) = pool_with(
        command.clone(),
        PoolOptions {
            cluster: Some(ClusterAccess {
                state_dir: "/var/lib/imgrun state".into(),
                head: "10.0.0.1:7400".into(),
            }),
            ..PoolOptions::default()
        },
    );
    start(&pool, "job", 1, "probe", &[]).await?;
    let got = call(&pool, 1, "cluster", "").await?;
    ensure!(got == "/var/lib/imgrun state 10.0.0.1:7400", "{got}");
    let (outside, _ended) = pool_of(command);
    start(&outside, "job", 2, "probe", &[]).await?;
    let got = call(&outside, 2, "cluster", "").await?;
    ensure!(got == "none", "a pool outside a cluster: {got}");
    Ok(())
}

async fn sigkill_fails_every_actor_of_the_worker() -> Result<()> {
    let (pool, mut ended) = pool()?;
    start(&pool, "k", 1, "probe", &[]).await?;
    start(&pool, "k", 2, "probe", &[]).await?;
    let pid = pid_of(&pool, 1).await?;
    let mut hang = Box::pin(pool.call(ActorId(1), "hang", Vec::new(), LIMIT));
    ensure!(poll_once(&mut hang).await.is_none(), "hang returned");
    // Frames to one worker go in order: once this echo is back, `hang` reached actor 1.
    ensure!(call(&pool, 2, "echo", "x").await? == "x");
    let status = std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .context("running kill")?;
    ensure!(status.success(), "kill -9 {pid}: {status}");
    let signal = format!("worker process for group 'k' (pid {pid}) killed by signal 9 (SIGKILL)");
    match hang.await {
        Err(ActorError::Failed {
            reason,
            origin: FailureOrigin::WorkerExit,
            ..
        }) if reason.starts_with(&signal) => {}
        other => bail!("the pending call got {other:?}"),
    }
    let exits = exits(&mut ended, 2).await?;
    for (exit, id) in exits.iter().zip([1, 2]) {
        ensure!(
            exit.actor_id == ActorId(id)
                && failure(exit)?.starts_with(&signal)
                && origin(exit) == Some(FailureOrigin::WorkerExit),
            "{exit:?}"
        );
    }
    let later = call(&pool, 2, "echo", "")
        .await
        .expect_err("actor 2 is gone");
    ensure!(
        later
            .to_string()
            .starts_with(&format!("actor 2 failed: {signal}")),
        "{later}"
    );
    ensure!(pool.pid("k").is_none());
    // The group starts a fresh process for its next actor.
    start(&pool, "k", 3, "probe", &[]).await?;
    ensure!(pid_of(&pool, 3).await? != pid);
    Ok(())
}

async fn an_exit_fails_with_its_code_and_last_stderr() -> Result<()> {
    let (pool, mut ended) = pool()?;
    start(&pool, "c", 1, "probe", &[]).await?;
    let pid = pid_of(&pool, 1).await?;
    let want = format!(
        "worker process for group 'c' (pid {pid}) exited with code 3; last stderr:\nabout to \
         crash: checkpoint missing"
    );
    match call(&pool, 1, "crash", "").await {
        Err(ActorError::Failed {
            reason,
            origin: FailureOrigin::WorkerExit,
            ..
        }) if reason == want => {}
        other => bail!("the call got {other:?}, want the reason {want:?}"),
    }
    let exit = exits(&mut ended, 1).await?.remove(0);
    ensure!(failure(&exit)? == want, "{exit:?}");
    ensure!(origin(&exit) == Some(FailureOrigin::WorkerExit), "{exit:?}");
    Ok(())
}

/// What a worker writes (its actors' prints, its log, its libraries' messages) is kept,
/// the newest lines, for whoever asks for an actor's output (a rank's log).
async fn a_workers_output_is_kept_for_whoever_asks() -> Result<()> {
    let (pool, _ended) = pool()?;
    start(&pool, "o", 1, "probe", &[]).await?;
    ensure!(call(&pool, 1, "print", "").await?.is_empty());
    // The output arrives on a socket of its own, a little after the call's reply.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let lines = loop {
        let lines = pool.output(ActorId(1), 1000)?;
        if lines.len() >= 100 || tokio::time::Instant::now() > deadline {
            break lines;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let want: Vec<String> = (0..100).map(|i| format!("line {i} on stdout")).collect();
    ensure!(lines == want, "{lines:?}");
    ensure!(pool.output(ActorId(1), 2)? == want[98..], "the newest two");
    ensure!(
        matches!(pool.output(ActorId(9), 10), Err(ActorError::NotFound(_))),
        "no such actor"
    );
    Ok(())
}

/// The newest lines of `actor`'s process once they number `count` (they arrive on a
/// socket of their own, a little after a call's reply), or what there is at the limit.
async fn output_of(pool: &WorkerPool, actor: u64, count: usize) -> Result<Vec<String>> {
    let deadline = tokio::time::Instant::now() + LIMIT / 2;
    loop {
        let lines = pool.output(ActorId(actor), 1000)?;
        if lines.len() >= count || tokio::time::Instant::now() > deadline {
            return Ok(lines);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// An actor's lines outlive it, however it ended (a graceful stop, a kill, its process's
/// death), and can be asked for by its id until a later start of that id.
async fn an_ended_actors_output_is_kept_however_it_ended() -> Result<()> {
    let (pool, mut ended) = pool()?;
    let printed: Vec<String> = (0..100).map(|i| format!("line {i} on stdout")).collect();
    // (actor, how it ends, the reason reported, the lines kept beyond the printed ones)
    let crashed = ["about to crash: checkpoint missing".to_string()];
    let cases: [(u64, &str, &[String]); 3] =
        [(1, "stop", &[]), (2, "kill", &[]), (3, "crash", &crashed)];
    for (id, how, more) in cases {
        start(&pool, &format!("e{id}"), id, "probe", &[]).await?;
        call(&pool, id, "print", "").await?;
        let pid = pid_of(&pool, id).await?;
        ensure!(
            output_of(&pool, id, 100).await? == printed,
            "{how}: before its end"
        );
        match how {
            "stop" => pool.stop(ActorId(id), false).await?,
            "kill" => pool.stop(ActorId(id), true).await?,
            _ => ensure!(call(&pool, id, "crash", "").await.is_err(), "a crash fails"),
        }
        let exit = exits(&mut ended, 1).await?.remove(0);
        ensure!(exit.actor_id == ActorId(id), "{how}: {exit:?}");
        gone(pid).await;
        let mut want = printed.clone();
        want.extend_from_slice(more);
        let kept = output_of(&pool, id, want.len()).await?;
        ensure!(
            kept == want,
            "{how}: kept after its end: {:?}",
            &kept[kept.len().saturating_sub(3)..]
        );
        ensure!(
            pool.output(ActorId(id), 1)? == want[want.len() - 1..],
            "{how}: the newest"
        );
    }
    // A later start under the same id has its own process's lines only.
    start(&pool, "e1", 1, "probe", &[]).await?;
    ensure!(
        pool.output(ActorId(1), 1000)?.is_empty(),
        "a fresh process has no lines"
    );
    ensure!(
        matches!(pool.output(ActorId(9), 10), Err(ActorError::NotFound(_))),
        "an actor that never ran here"
    );
    Ok(())
}

async fn a_panic_fails_only_that_actor() -> Result<()> {
    let (pool, mut ended) = pool()?;
    start(&pool, "p", 1, "probe", &[]).await?;
    start(&pool, "p", 2, "probe", &[]).await?;
    let pid = pid_of(&pool, 2).await?;
    let error = call(&pool, 1, "panic", "").await.expect_err("panics");
    ensure!(
        error.to_string() == "actor 1 failed: panicked in panic: kaboom",
        "{error}"
    );
    let exit = exits(&mut ended, 1).await?.remove(0);
    ensure!(exit.actor_id == ActorId(1) && failure(&exit)? == "panicked in panic: kaboom");
    // A panic is the actor's own failure, though it ends it as a process exit would.
    ensure!(origin(&exit) == Some(FailureOrigin::Here), "{exit:?}");
    ensure!(pid_of(&pool, 2).await? == pid, "the worker carried on");
    Ok(())
}

async fn a_failure_caused_elsewhere_keeps_its_origin() -> Result<()> {
    let (pool, mut ended) = pool()?;
    start(&pool, "e", 1, "probe", &[]).await?;
    let reason = "fail_elsewhere: its peer went away";
    match call(&pool, 1, "fail_elsewhere", "").await {
        Err(ActorError::Failed {
            reason: got,
            origin: FailureOrigin::Elsewhere,
            ..
        }) if got == reason => {}
        other => bail!("the call got {other:?}, want a failure caused elsewhere"),
    }
    let exit = exits(&mut ended, 1).await?.remove(0);
    let want = ExitReason::Failed {
        reason: reason.to_owned(),
        origin: FailureOrigin::Elsewhere,
    };
    ensure!(exit.reason == want, "{exit:?}");
    Ok(())
}

async fn starts_that_cannot_happen_say_why() -> Result<()> {
    let (pool, _ended) = pool()?;
    let error = start(&pool, "u", 1, "trainer", &[])
        .await
        .expect_err("unknown kind");
    let want = "actor 1 (trainer) did not start: unknown actor kind 'trainer' (registered: \
                counter, probe)";
    ensure!(format!("{error:#}").ends_with(want), "{error:#}");
    ensure!(
        pool.pid("u").is_none(),
        "a worker left without actors is retired"
    );
    let error = start(&pool, "", 2, "probe", &[])
        .await
        .expect_err("no group");
    ensure!(format!("{error:#}").contains("the empty group is the node daemon itself"));

    let missing = WorkerCommand::new("/nonexistent/imgrun", ["worker"]);
    let (pool, _ended) = pool_of(missing);
    let error = start(&pool, "m", 1, "probe", &[])
        .await
        .expect_err("no program");
    let want = "worker process for group 'm': cannot start /nonexistent/imgrun: No such file";
    ensure!(format!("{error:#}").contains(want), "{error:#}");

    let impostor = WorkerCommand::new("/bin/sh", ["-c", "echo not a worker >&2; exit 4"]);
    let (pool, _ended) = pool_of(impostor);
    let error = start(&pool, "i", 1, "probe", &[])
        .await
        .expect_err("not a worker");
    let text = format!("{error:#}");
    ensure!(
        text.contains("actor 1 (probe) did not start: worker process for group 'i' (pid ")
            && text.ends_with(") exited with code 4; last stderr:\nnot a worker"),
        "{text}"
    );
    Ok(())
}

async fn calls_sent_before_a_graceful_stop_get_their_replies() -> Result<()> {
    let (pool, mut ended) = pool()?;
    for round in 0..10u64 {
        start(&pool, "q", round, "counter", &[]).await?;
        let mut calls = Vec::new();
        for _ in 0..50 {
            let mut call = Box::pin(pool.call(ActorId(round), "add", b"1".to_vec(), LIMIT));
            ensure!(
                poll_once(&mut call).await.is_none(),
                "a call returned before it was sent"
            );
            calls.push(call);
        }
        pool.stop(ActorId(round), false).await?;
        for (i, call) in calls.into_iter().enumerate() {
            let reply = call
                .await
                .with_context(|| format!("round {round}, call {i}"))?;
            ensure!(
                reply == (i + 1).to_string().into_bytes(),
                "round {round}, call {i}"
            );
        }
        let exit = exits(&mut ended, 1).await?.remove(0);
        ensure!(exit.actor_id == ActorId(round) && exit.reason == ExitReason::Stopped);
    }
    Ok(())
}

async fn stopping_the_last_actor_retires_the_worker() -> Result<()> {
    let (pool, mut ended) = pool()?;
    start(&pool, "s", 1, "counter", &[]).await?;
    let pid = pool.pid("s").context("worker of 's'")?;
    pool.tell(ActorId(1), "add", b"4".to_vec()).await?;
    pool.stop(ActorId(1), false).await?;
    let refused = call(&pool, 1, "get", "").await.expect_err("stopping");
    ensure!(refused.to_string() == "actor 1 is stopping", "{refused}");
    let exit = exits(&mut ended, 1).await?.remove(0);
    ensure!(exit.reason == ExitReason::Stopped, "{exit:?}");
    ensure!(pool.pid("s").is_none());
    gone(pid).await;
    ensure!(
        ended.try_recv().is_err(),
        "a retired worker's exit fails nothing"
    );
    Ok(())
}

async fn killing_the_last_actor_kills_the_worker() -> Result<()> {
    let (pool, mut ended) = pool()?;
    start(&pool, "x", 1, "probe", &[]).await?;
    start(&pool, "x", 2, "probe", &[]).await?;
    let pid = pid_of(&pool, 1).await?;
    let mut hang = Box::pin(pool.call(ActorId(1), "hang", Vec::new(), LIMIT));
    ensure!(poll_once(&mut hang).await.is_none(), "hang returned");
    pool.stop(ActorId(1), true).await?;
    match hang.await {
        Err(ActorError::Killed(ActorId(1))) => {}
        other => bail!("the pending call got {other:?}"),
    }
    ensure!(exits(&mut ended, 1).await?[0].reason == ExitReason::Killed);
    // Actor 1 is still in its method (a thread cannot be interrupted); actor 2 carries on.
    ensure!(call(&pool, 2, "echo", "on").await? == "on");
    pool.stop(ActorId(2), true).await?;
    ensure!(exits(&mut ended, 1).await?[0].reason == ExitReason::Killed);
    gone(pid).await;
    ensure!(
        ended.try_recv().is_err(),
        "a killed worker's exit fails nothing more"
    );
    Ok(())
}

async fn dropping_the_pool_leaves_no_worker_alive() -> Result<()> {
    let (pool, _ended) = pool()?;
    start(&pool, "a", 1, "probe", &[]).await?;
    start(&pool, "b", 2, "probe", &[]).await?;
    let pids = [pid_of(&pool, 1).await?, pid_of(&pool, 2).await?];
    let mut hang = Box::pin(pool.call(ActorId(2), "hang", Vec::new(), LIMIT));
    ensure!(poll_once(&mut hang).await.is_none(), "hang returned");
    drop(hang);
    drop(pool);
    for pid in pids {
        gone(pid).await;
    }
    Ok(())
}

async fn a_worker_ends_with_its_node() -> Result<()> {
    let exe = std::env::current_exe().context("finding this test binary")?;
    let mut node = tokio::process::Command::new(exe)
        .arg("node")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("starting the stand-in node")?;
    let stdout = node.stdout.take().context("node stdout")?;
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    let line = lines
        .next_line()
        .await?
        .context("the node printed no worker pid")?;
    let worker: u32 = line
        .parse()
        .with_context(|| format!("worker pid {line:?}"))?;
    ensure!(alive(worker), "worker {worker} is not running");
    node.start_kill().context("killing the node")?;
    node.wait().await?;
    gone(worker).await;
    Ok(())
}

/// A stand-in node daemon: starts a worker with one actor, prints the worker's pid, and
/// waits until it is killed (or its stdin closes).
fn node() -> ExitCode {
    let run = async {
        let (pool, _ended) = pool()?;
        start(&pool, "o", 1, "probe", &[]).await?;
        println!("{}", pid_of(&pool, 1).await?);
        let wait = tokio::task::spawn_blocking(|| {
            std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new())
        });
        wait.await??;
        anyhow::Ok(())
    };
    let outcome = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(anyhow::Error::from)
        .and_then(|runtime| runtime.block_on(run));
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("stand-in node: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn frames_follow_the_pools_limit() -> Result<()> {
    let command = WorkerCommand::current_exe(["worker"])?;
    for max_frame in [64 << 10, 32 << 20] {
        let options = PoolOptions {
            max_frame,
            ..PoolOptions::default()
        };
        let (pool, _ended) = pool_with(command.clone(), options);
        start(&pool, "f", 1, "probe", &[]).await?;
        // Payload and method name, or reply, in what a frame leaves beside its fields.
        let limit = max_frame - 4096;
        let room = limit - "echo".len();
        // Up to the limit both ways, beyond the default limit too.
        let big = pool.call(ActorId(1), "echo", vec![7; room], LIMIT).await?;
        ensure!(big.len() == room && big.iter().all(|b| *b == 7));
        let error = pool
            .call(ActorId(1), "echo", vec![7; room + 1], LIMIT)
            .await;
        ensure!(
            matches!(error, Err(ActorError::TooLarge { .. })),
            "{error:?}"
        );
        let error = call(&pool, 1, "zeros", &(limit + 1).to_string()).await;
        let want = format!(
            "actor 1: zeros: reply of {} bytes exceeds the limit of {limit}",
            limit + 1
        );
        ensure!(
            error.as_ref().map_err(ToString::to_string) == Err(want),
            "{error:?}"
        );
        ensure!(call(&pool, 1, "echo", "fine").await? == "fine");
    }
    Ok(())
}

/// The test's kinds, each group of actors in a worker process (this binary, `worker`).
fn hosting() -> Result<ActorHosting> {
    Ok(ActorHosting {
        registry: registry(),
        worker: Some(WorkerCommand::current_exe(["worker"])?),
        ..ActorHosting::default()
    })
}

async fn a_killed_worker_fails_its_cluster_actor_for_the_owner() -> Result<()> {
    let cluster = TestCluster::start(2, hosting()?).await;
    let client = cluster.client("head").await;
    let options = SpawnOptions::new("probe")
        .resources(Resources::new().with_gpus(1))
        .process_group("trainer")
        .restart(1, Duration::from_millis(10));
    let actor = client.spawn(options).await?;
    let text = |bytes: Vec<u8>| String::from_utf8_lossy(&bytes).into_owned();
    let env = text(actor.call("cuda_env", "", LIMIT).await?);
    ensure!(
        env == "CUDA_VISIBLE_DEVICES=0 CUDA_DEVICE_ORDER=PCI_BUS_ID",
        "{env}"
    );
    let mut seen = 0;
    let mut pids = Vec::new();
    for round in 0..2 {
        let pid: u32 = text(actor.call("pid", "", LIMIT).await?).parse()?;
        ensure!(
            pid != std::process::id(),
            "the actor runs in the test process"
        );
        ensure!(
            !pids.contains(&pid),
            "round {round}: the same worker {pid} again"
        );
        pids.push(pid);
        let status = std::process::Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()
            .context("running kill")?;
        ensure!(status.success(), "kill -9 {pid}: {status}");
        let signal = format!("(pid {pid}) killed by signal 9 (SIGKILL)");
        // The first kill is restarted (a fresh worker), the second is the end.
        let want: &[ActorEventKind] = match round {
            0 => &[ActorEventKind::Restarting, ActorEventKind::Restarted],
            _ => &[ActorEventKind::Failed],
        };
        let events = events(&client, &mut seen, want.len()).await?;
        let got: Vec<ActorEventKind> = events.iter().map(|e| e.kind).collect();
        ensure!(got == want, "round {round}: {events:?}");
        ensure!(
            events[0].reason.contains(&signal),
            "round {round}: {events:?}"
        );
    }
    ensure!(client.status().await?.reservations.is_empty());
    Ok(())
}

async fn a_joined_nodes_worker_answers_calls_and_ends_with_the_node() -> Result<()> {
    let cluster = TestCluster::start(0, hosting()?).await;
    let node = cluster.join("node", 0).await;
    let client = cluster.client("head").await;
    let options = SpawnOptions::new("probe")
        .strategy(Strategy::Node(node.node_id()))
        .process_group("g");
    let actor = client.spawn(options).await?;
    let text = |bytes: Vec<u8>| String::from_utf8_lossy(&bytes).into_owned();
    let pid: u32 = text(actor.call("pid", "", LIMIT).await?).parse()?;
    ensure!(
        pid != std::process::id() && alive(pid),
        "the actor runs in worker {pid}"
    );
    // Calls from several tasks at once, each answered with its own payload.
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..16 {
        let actor = actor.clone();
        calls.spawn(async move {
            let sent = format!("call {i}");
            let got = actor.call("echo", sent.clone(), LIMIT).await?;
            ensure!(got == sent.as_bytes(), "{sent}: {got:?}");
            anyhow::Ok(())
        });
    }
    while let Some(done) = calls.join_next().await {
        done??;
    }
    // Its output, asked of its node through the client.
    actor.call("print", "", LIMIT).await?;
    let deadline = tokio::time::Instant::now() + LIMIT;
    let output = loop {
        let output = actor.output(3).await?;
        if output.lines.len() == 3 || tokio::time::Instant::now() > deadline {
            break output;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    ensure!(output.own_process, "{output:?}");
    ensure!(
        output.lines
            == [
                "line 97 on stdout",
                "line 98 on stdout",
                "line 99 on stdout"
            ],
        "{output:?}"
    );
    node.stop().await;
    drop(node);
    gone(pid).await;
    Ok(())
}

/// A client asks a node for the lines of an actor that ended there (killed by its owner,
/// or its process died), by the actor's id, after the head has let the actor go; and is
/// told, by a typed error, when the node keeps none or is not in the cluster.
async fn an_ended_actors_output_is_asked_of_its_node_by_id() -> Result<()> {
    let cluster = TestCluster::start(0, hosting()?).await;
    let node = cluster.join("node", 0).await;
    let client = cluster.client("head").await;
    let on = node.node_id();
    let newest = [
        "line 97 on stdout",
        "line 98 on stdout",
        "line 99 on stdout",
    ];
    for (group, end) in [("killed", "kill"), ("crashed", "crash")] {
        let options = SpawnOptions::new("probe")
            .strategy(Strategy::Node(on))
            .process_group(group);
        let actor = client.spawn(options).await?;
        actor.call("print", "", LIMIT).await?;
        let pid: u32 = String::from_utf8_lossy(&actor.call("pid", "", LIMIT).await?).parse()?;
        match end {
            "kill" => actor.kill().await?,
            _ => ensure!(
                actor.call("crash", "", LIMIT).await.is_err(),
                "a crash fails"
            ),
        }
        gone(pid).await;
        let want: Vec<&str> = match end {
            "kill" => newest.to_vec(),
            _ => vec![newest[1], newest[2], "about to crash: checkpoint missing"],
        };
        // Its end reaches the node's pool as the node learns it: wait for the lines.
        let deadline = tokio::time::Instant::now() + LIMIT / 2;
        let output = loop {
            let output = client.actor_output_on(on, actor.id(), 3).await;
            let done = matches!(&output, Ok(output) if output.lines == want);
            if done || tokio::time::Instant::now() > deadline {
                break output?;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        ensure!(
            output.own_process && output.lines == want,
            "{end}: {output:?}"
        );
    }
    match client.actor_output_on(on, ActorId(9999), 3).await {
        Err(ActorCallError::NoOutput { actor, node }) if actor == ActorId(9999) && node == on => {}
        other => bail!("an actor that never ran there: {other:?}"),
    }
    match client.actor_output_on(NodeId(4242), ActorId(1), 3).await {
        Err(ActorCallError::NodeNotLive { state, .. }) if state == "unknown" => {}
        other => bail!("a node the head does not know: {other:?}"),
    }
    node.stop().await;
    Ok(())
}

/// The next `count` events of `client`'s actors after `seen`.
async fn events(client: &ClusterClient, seen: &mut u64, count: usize) -> Result<Vec<ActorEvent>> {
    let mut events = Vec::new();
    while events.len() < count {
        let page = client.events(*seen, Duration::from_secs(5)).await?;
        if let Some(last) = page.events.last() {
            *seen = last.seq;
        }
        events.extend(page.events);
    }
    Ok(events)
}
