//! Section 1: actor messages through `LocalActors` (the actor on a thread of its own in
//! this process) and through a `WorkerPool` (the actor in a worker process, this binary
//! re-executed with `worker`, reached over a Unix socket): tells pipelined, and calls from
//! 1, 8 and 64 tasks.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use runtime::{
    Actor, ActorError, ActorId, ActorRegistry, ActorSpec, LocalActors, LocalOptions, MethodError,
    PoolOptions, WorkerCommand, WorkerPool,
};

use crate::Options;
use crate::measure::{CpuMeter, Run, run_header, run_row, timed_calls};

/// The actor every row talks to.
const ACTOR: ActorId = ActorId(1);
const KIND: &str = "echo";
/// The worker process group.
const GROUP: &str = "bench";
/// What every call and tell carries.
const PAYLOAD: usize = 16;
/// No call of a healthy run comes near it.
const TIMEOUT: Duration = Duration::from_secs(30);
/// Calls before each host is timed.
const WARM_UP: usize = 500;
/// The caller tasks of the concurrent rows.
const CONCURRENT: [usize; 2] = [8, 64];

/// The kinds this binary hosts, in this process and as a worker: `echo`, whose `echo`
/// returns its payload, `told` the number of `count` tells so far.
pub fn registry() -> ActorRegistry {
    let mut registry = ActorRegistry::new();
    registry.register(KIND, |_ctx, _args| {
        Ok(Box::new(Echo { told: 0 }) as Box<dyn Actor>)
    });
    registry
}

struct Echo {
    told: u64,
}

impl Actor for Echo {
    fn call(&mut self, method: &str, payload: &[u8]) -> Result<Vec<u8>, MethodError> {
        match method {
            "echo" => Ok(payload.to_vec()),
            "told" => Ok(self.told.to_le_bytes().to_vec()),
            other => Err(MethodError::new(format!("no method {other}"))),
        }
    }

    fn tell(&mut self, method: &str, _payload: &[u8]) -> Result<(), MethodError> {
        match method {
            "count" => {
                self.told += 1;
                Ok(())
            }
            other => Err(MethodError::new(format!("no method {other}"))),
        }
    }
}

/// Where the actor runs.
#[derive(Clone)]
enum Host {
    Local(LocalActors),
    Worker(WorkerPool),
}

impl Host {
    async fn call(&self, method: &str, payload: Vec<u8>) -> Result<Vec<u8>, ActorError> {
        match self {
            Host::Local(actors) => actors.call(ACTOR, method, payload, TIMEOUT).await,
            Host::Worker(pool) => pool.call(ACTOR, method, payload, TIMEOUT).await,
        }
    }

    async fn tell(&self, method: &str, payload: Vec<u8>) -> Result<(), ActorError> {
        match self {
            Host::Local(actors) => actors.tell(ACTOR, method, payload).await,
            Host::Worker(pool) => pool.tell(ACTOR, method, payload).await,
        }
    }

    /// The processes that do the work: this one, and the worker if there is one.
    fn pids(&self) -> Vec<u32> {
        match self {
            Host::Local(_) => vec![std::process::id()],
            Host::Worker(pool) => std::iter::once(std::process::id())
                .chain(pool.pid(GROUP))
                .collect(),
        }
    }

    async fn told(&self) -> Result<u64> {
        let reply = self.call("told", Vec::new()).await?;
        let bytes: [u8; 8] = reply
            .as_slice()
            .try_into()
            .context("`told` answered something else than a u64")?;
        Ok(u64::from_le_bytes(bytes))
    }
}

pub async fn run(options: &Options) -> Result<()> {
    println!(
        "1. actor messages ({PAYLOAD}-byte payloads, default mailbox of {} messages; each \
         row runs {:.1} s)",
        runtime::DEFAULT_MAILBOX_CAPACITY,
        options.run_time().as_secs_f64()
    );
    run_header("host");
    let spec = ActorSpec {
        id: ACTOR,
        kind: KIND.to_owned(),
        args: Vec::new(),
        gpus: Vec::new(),
    };

    let (exits, _ended) = tokio::sync::mpsc::unbounded_channel();
    let local = LocalActors::new(registry(), LocalOptions::default(), exits)
        .context("starting LocalActors")?;
    local
        .start(spec.clone())
        .await
        .context("starting the local actor")?;
    rows("in process", &Host::Local(local.clone()), options).await?;
    local.stop(ACTOR, true).context("killing the local actor")?;
    drop(local);

    let (exits, _ended) = tokio::sync::mpsc::unbounded_channel();
    let command = WorkerCommand::current_exe(["worker"]).context("finding this binary")?;
    let pool = WorkerPool::new(command, PoolOptions::default(), exits);
    pool.start_actor(GROUP, spec)
        .await
        .context("starting the actor in a worker process")?;
    let worker = pool.pid(GROUP);
    let outcome = rows("worker process", &Host::Worker(pool.clone()), options).await;
    // Killing the group's last actor kills its worker (SIGKILL) at once.
    pool.stop(ACTOR, true)
        .await
        .context("killing the worker's actor")?;
    drop(pool);
    if let Some(pid) = worker {
        wait_gone(pid).await;
    }
    outcome
}

/// The rows of one host.
async fn rows(name: &str, host: &Host, options: &Options) -> Result<()> {
    let payload = vec![7u8; PAYLOAD];
    for _ in 0..WARM_UP {
        host.call("echo", payload.clone()).await?;
    }
    let run_time = options.run_time();

    let pids = host.pids();
    let told_before = host.told().await?;
    let meter = CpuMeter::start(&pids);
    let mut tells = tell_pipelined(host, run_time).await?;
    tells.cpu = meter.elapsed();
    let told = host.told().await? - told_before;
    ensure!(
        told + 1 >= tells.messages,
        "{name}: {} tells sent, the actor counted {told}",
        tells.messages - 1
    );
    run_row(name, "tell, pipelined", &tells);

    for tasks in std::iter::once(1).chain(CONCURRENT) {
        let meter = CpuMeter::start(&pids);
        let mut run = calls(host, tasks, run_time).await?;
        run.cpu = meter.elapsed();
        let pattern = if tasks == 1 {
            "call, 1 task".to_owned()
        } else {
            format!("call, {tasks} tasks")
        };
        run_row(name, &pattern, &run);
    }
    Ok(())
}

/// Tells from one task for `run_time`, then one call that returns once they all ran
/// (the mailbox is in order); the final call counts as a message.
async fn tell_pipelined(host: &Host, run_time: Duration) -> Result<Run> {
    let payload = vec![7u8; PAYLOAD];
    let start = Instant::now();
    let mut sent = 0u64;
    loop {
        for _ in 0..256 {
            host.tell("count", payload.clone()).await?;
        }
        sent += 256;
        if start.elapsed() >= run_time {
            break;
        }
    }
    host.call("echo", payload).await?;
    Ok(Run {
        messages: sent + 1,
        elapsed: start.elapsed(),
        latencies: None,
        cpu: None,
    })
}

/// Calls from `tasks` tasks for `run_time`, each waiting for its answer before the next.
async fn calls(host: &Host, tasks: usize, run_time: Duration) -> Result<Run> {
    let host = host.clone();
    let payload = Arc::new(vec![7u8; PAYLOAD]);
    timed_calls(tasks, run_time, move |_, _| {
        let (host, payload) = (host.clone(), payload.clone());
        async move {
            let reply = host.call("echo", payload.to_vec()).await?;
            if reply.len() != PAYLOAD {
                bail!("echo answered {} bytes", reply.len());
            }
            Ok(())
        }
    })
    .await
}

/// Waits (at most 5 s) until process `pid` is gone and reaped, so that no worker outlives
/// its section.
async fn wait_gone(pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::path::Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
