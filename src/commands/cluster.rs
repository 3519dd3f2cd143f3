//! `imgrun start --head`, `imgrun join`, `imgrun status` and `imgrun stop`: the cluster's
//! daemons and the commands that talk to them.
//!
//! A daemon runs in the foreground with `--block`. Without it, the command starts itself
//! again with `--block` as a background process (its own session, standard error to a log
//! file in the state folder), waits until that process says it is ready (one line on a
//! pipe) or fails (then shows the end of its log), prints how to use it, and returns.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use rustix::process::{Pid, Signal, kill_process, test_kill_process};

use crate::config::{ClusterConfig, Loaded};

/// What a daemon started in the background prints on its pipe once it is ready.
const READY: &str = "imgrun-ready ";

#[derive(Debug, clap::Args)]
pub struct StartArgs {
    /// Start the head of a new cluster (the only kind `start` starts; other machines
    /// `imgrun join` it).
    #[arg(long)]
    head: bool,
    /// UDP port of the nodes' heartbeats [default: cluster.beat_port, 0: any free port].
    #[arg(long)]
    beat_port: Option<u16>,
    /// TCP port of the dashboard and `/metrics` [default: cluster.dashboard_port, 7080;
    /// 0: any free port].
    #[arg(long)]
    dashboard_port: Option<u16>,
    /// Address the dashboard binds [default: cluster.dashboard_bind, 127.0.0.1]. Any
    /// address but loopback serves HTTPS only, with a certificate of the cluster's CA.
    #[arg(long, conflicts_with = "no_dashboard")]
    dashboard_bind: Option<IpAddr>,
    /// Serve no dashboard and no `/metrics`.
    #[arg(long, conflicts_with = "dashboard_port")]
    no_dashboard: bool,
    /// Let a job be cancelled from its dashboard page (the only action there is; the
    /// dashboard is read-only without it).
    #[arg(long, conflicts_with = "no_dashboard")]
    dashboard_actions: bool,
    #[command(flatten)]
    daemon: DaemonArgs,
}

#[derive(Debug, clap::Args)]
pub struct JoinArgs {
    /// The head's address, `ip:port` (printed by `imgrun start --head`).
    address: String,
    /// The join token printed by `imgrun start --head`.
    #[arg(long, env = "IMGRUN_JOIN_TOKEN", hide_env_values = true)]
    token: String,
    /// `sha256:<hex>` of the cluster's CA certificate, printed by `imgrun start --head`.
    #[arg(long)]
    ca_hash: String,
    #[command(flatten)]
    daemon: DaemonArgs,
}

/// What `start` and `join` share.
#[derive(Debug, clap::Args)]
struct DaemonArgs {
    /// UDP port to listen on [default: cluster.port (7070) for the head, cluster.node_port
    /// (0, any) for a node].
    #[arg(long)]
    port: Option<u16>,
    /// Address to bind [default: cluster.bind, 0.0.0.0].
    #[arg(long)]
    bind: Option<IpAddr>,
    /// Address others use to reach this daemon, `ip` or `ip:port` [default:
    /// cluster.advertise, else automatic].
    #[arg(long)]
    advertise: Option<String>,
    /// GPUs to offer: 0 offers none; more than are found claims extra ones (for tests).
    #[arg(long)]
    num_gpus: Option<usize>,
    /// CPUs to offer [default: the logical cores].
    #[arg(long)]
    num_cpus: Option<usize>,
    /// Stay in the foreground instead of starting a background daemon.
    #[arg(long)]
    block: bool,
    /// Print one ready line for the process that started this one (internal).
    #[arg(long, hide = true)]
    notify_ready: bool,
}

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// The head's address [default: from this machine's state folder].
    #[arg(long)]
    address: Option<String>,
    /// Print JSON for scripts.
    #[arg(long, conflicts_with = "watch")]
    json: bool,
    /// Redraw the cluster, its jobs and their ranks every `--every` seconds, until
    /// Ctrl-C (or `--times` redraws).
    #[arg(long)]
    watch: bool,
    /// Seconds between redraws with `--watch`.
    #[arg(long, default_value_t = 2.0, requires = "watch", value_parser = watch_every)]
    every: f64,
    /// Stop after this many redraws with `--watch`.
    #[arg(long, requires = "watch")]
    times: Option<u64>,
}

/// `--every`: at least a tenth of a second, at most an hour.
fn watch_every(text: &str) -> Result<f64, String> {
    let every: f64 = text
        .parse()
        .map_err(|_| format!("not a number of seconds: {text}"))?;
    if (0.1..=3600.0).contains(&every) {
        Ok(every)
    } else {
        Err(format!("{every} s: between 0.1 and 3600"))
    }
}

#[derive(Debug, clap::Args)]
pub struct StopArgs {
    /// Stop the whole cluster through the head: every node, then the head.
    #[arg(long)]
    all: bool,
    /// The head's address for `--all` [default: from this machine's state folder].
    #[arg(long)]
    address: Option<String>,
}

/// The log level a daemon uses when none is given.
pub const DAEMON_LOG: &str = "info";

/// Starts the head; its dashboard draws a job's charts with `draw_chart`.
pub fn start(
    loaded: &Loaded,
    args: StartArgs,
    draw_chart: crate::dashboard::DrawChart,
) -> anyhow::Result<ExitCode> {
    if !args.head {
        bail!(
            "`imgrun start` starts a head: add --head; to add this machine to a cluster, run \
             the `imgrun join ...` line that `imgrun start --head` printed"
        );
    }
    let cluster = &loaded.config.cluster;
    let state = state_dir(cluster)?;
    refuse_second_head(&state)?;
    if !args.daemon.block {
        return background("head", &state, cluster);
    }
    let daemon = &args.daemon;
    let config = runtime::HeadConfig {
        bind: SocketAddr::new(
            bind_ip(daemon, cluster)?,
            daemon.port.unwrap_or(cluster.port),
        ),
        advertise: advertise(daemon, cluster),
        state: state.clone(),
        resources: resources(daemon),
        membership: membership(cluster),
        transport: runtime::TransportOptions::default(),
        actors: actor_hosting(),
        beat_port: args.beat_port.unwrap_or(cluster.beat_port),
    };
    raise_open_file_limit();
    let tokio = async_runtime()?;
    tokio.block_on(async {
        let head = runtime::Head::start(config)
            .await
            .context("starting the head")?;
        let record = daemon_record(runtime::DaemonRole::Head, &head.join_address(), &state)?;
        start_job_archive(&state, head.node_id()).await;
        let dashboard = if args.no_dashboard {
            None
        } else {
            match start_dashboard(&args, cluster, &state, draw_chart).await {
                Ok(dashboard) => Some(dashboard),
                Err(error) => {
                    // A head without the dashboard it was asked for does not stay up, nor
                    // its record.
                    head.stop().await;
                    forget(&state, &record);
                    return Err(error);
                }
            }
        };
        let message = format!(
            "imgrun head started at {} (pid {}; {})\n\nTo add a machine to this cluster, run \
             on it:\n\n  {}\n\n{}See the cluster with `imgrun status`; stop it with `imgrun \
             stop --all`.",
            head.join_address(),
            std::process::id(),
            match head.beat_port() {
                0 => "heartbeats over QUIC".to_owned(),
                port => format!("heartbeats on UDP port {port}"),
            },
            head.join_command(),
            dashboard
                .as_ref()
                .map_or(String::new(), |d| dashboard_lines(&d.record, &state)),
        );
        ready(daemon, &message)?;
        tokio::select! {
            () = head.stopped() => tracing::info!("head stopped on request"),
            signal = shutdown_signal() => {
                tracing::info!(signal, "head stopping");
                head.stop().await;
            }
        }
        if let Some(dashboard) = dashboard {
            dashboard.stop().await;
            let _ = state.remove(crate::dashboard::RECORD);
        }
        forget(&state, &record);
        anyhow::Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// Starts the cluster's archive of ended jobs on the head's node. Without it (it could
/// not start: said in the log), ended jobs stay with their coordinators.
async fn start_job_archive(state: &runtime::StateDir, head: runtime::NodeId) {
    let started = match runtime::ClusterClient::connect(state, None).await {
        Ok(client) => actors::job::start_archive(&client, head)
            .await
            .map_err(anyhow::Error::from),
        Err(error) => Err(anyhow::Error::from(error)),
    };
    if let Err(error) = started {
        tracing::warn!(
            error = %format!("{error:#}"),
            "the job archive did not start: ended jobs stay with their coordinators"
        );
    }
}

/// Starts the head's dashboard with a client of the head, and keeps its record (tokens
/// included) in the state folder, mode 0600.
async fn start_dashboard(
    args: &StartArgs,
    cluster: &ClusterConfig,
    state: &runtime::StateDir,
    draw_chart: crate::dashboard::DrawChart,
) -> anyhow::Result<crate::dashboard::Dashboard> {
    let client = runtime::ClusterClient::connect(state, None)
        .await
        .context("connecting the dashboard to the head")?;
    let bind = match args.dashboard_bind {
        Some(ip) => ip,
        // Invariant: `config::validate` checked it.
        None => cluster
            .dashboard_bind
            .parse()
            .with_context(|| format!("cluster.dashboard_bind `{}`", cluster.dashboard_bind))?,
    };
    let hosts = &cluster.dashboard_hosts;
    let tls = if crate::dashboard::needs_tls(bind) {
        let names = crate::dashboard::certificate_names(bind, hosts);
        let tls = runtime::web_tls(state, &names)
            .context("issuing the dashboard's certificate from the cluster CA")?;
        Some(tls)
    } else {
        None
    };
    let options = crate::dashboard::DashboardOptions {
        bind,
        port: args.dashboard_port.unwrap_or(cluster.dashboard_port),
        tls,
        hosts: hosts.clone(),
        draw_chart,
        actions: args.dashboard_actions,
    };
    let dashboard = crate::dashboard::start(options, client)
        .await
        .context("starting the dashboard (`--no-dashboard` starts the head without it)")?;
    state
        .write_record(crate::dashboard::RECORD, &dashboard.record)
        .context("keeping the dashboard's record")?;
    Ok(dashboard)
}

/// What the head says of its dashboard: the URL with its token, where scrapers find
/// theirs, and, for HTTPS, the CA certificate clients trust.
fn dashboard_lines(
    record: &crate::dashboard::DashboardRecord,
    state: &runtime::StateDir,
) -> String {
    let reach = match &record.ca_file {
        None => "this machine only; from elsewhere `ssh -L`".to_owned(),
        Some(ca) => format!(
            "HTTPS with a certificate of the cluster CA: trust {} (`curl --cacert`, the \
             browser's authorities, a scrape config's `tls_config.ca_file`)",
            ca.display()
        ),
    };
    format!(
        "Dashboard ({reach}):\n\n  {url}#token={token}\n\n\
         Prometheus metrics: {url}metrics with the bearer token `metrics_token` of {file}.\n\n",
        url = record.url,
        token = record.token,
        file = state.root().join(crate::dashboard::RECORD).display(),
    )
}

pub fn join(loaded: &Loaded, args: JoinArgs) -> anyhow::Result<ExitCode> {
    let cluster = &loaded.config.cluster;
    let state = state_dir(cluster)?;
    let token: runtime::JoinToken = args.token.trim().parse().context("--token")?;
    let ca_hash: runtime::CaHash = args
        .ca_hash
        .trim()
        .parse()
        .with_context(|| format!("--ca-hash `{}`", args.ca_hash))?;
    if !args.daemon.block {
        return background("node", &state, cluster);
    }
    let daemon = &args.daemon;
    let config = runtime::NodeConfig {
        head: args.address.clone(),
        token,
        ca_hash,
        bind: SocketAddr::new(
            bind_ip(daemon, cluster)?,
            daemon.port.unwrap_or(cluster.node_port),
        ),
        advertise: advertise(daemon, cluster),
        state: state.clone(),
        resources: resources(daemon),
        transport: runtime::TransportOptions::default(),
        actors: actor_hosting(),
    };
    raise_open_file_limit();
    let tokio = async_runtime()?;
    tokio.block_on(async {
        let node = runtime::Node::start(config)
            .await
            .with_context(|| format!("joining the cluster of {}", args.address))?;
        let record = daemon_record(runtime::DaemonRole::Node, &args.address, &state)?;
        let message = format!(
            "joined the cluster of {} as node {} (pid {}); see it with `imgrun status`",
            args.address,
            node.node_id(),
            std::process::id()
        );
        ready(daemon, &message)?;
        tokio::select! {
            () = node.stopped() => tracing::info!("node stopped on request"),
            signal = shutdown_signal() => {
                tracing::info!(signal, "node leaving");
                node.stop().await;
            }
        }
        forget(&state, &record);
        anyhow::Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}

pub fn status(loaded: &Loaded, args: StatusArgs) -> anyhow::Result<ExitCode> {
    let state = state_dir(&loaded.config.cluster)?;
    let tokio = async_runtime()?;
    let client = tokio.block_on(runtime::ClusterClient::connect(
        &state,
        args.address.as_deref(),
    ))?;
    if args.watch {
        return tokio.block_on(watch(&client, &args));
    }
    if args.json {
        // The cluster and its jobs: the snapshot the dashboard and `/metrics` read too.
        let snapshot = tokio
            .block_on(actors::job::snapshot(&client))
            .context("asking for the cluster's status")?;
        println!("{}", serde_json::to_string_pretty(&snapshot)?);
    } else {
        print!("{}", tokio.block_on(client.status())?);
        // The head's dashboard, when it runs on this machine: where, and where its token is.
        let record: Option<crate::dashboard::DashboardRecord> =
            state.read_record(crate::dashboard::RECORD).ok().flatten();
        if let (Some(record), None) = (record, &args.address) {
            println!(
                "\ndashboard: {} (open it as URL#token=TOKEN, the token of {})",
                record.url,
                state.root().join(crate::dashboard::RECORD).display()
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `status --watch`: the cluster, its jobs and their ranks, drawn again every `--every`
/// seconds (over the last drawing on a terminal; one after another otherwise).
async fn watch(client: &runtime::ClusterClient, args: &StatusArgs) -> anyhow::Result<ExitCode> {
    use std::io::IsTerminal;
    let terminal = std::io::stdout().is_terminal();
    let mut drawn = 0;
    // Finished jobs are asked of their coordinators (or the archive) once.
    let cache = actors::job::SnapshotCache::default();
    loop {
        let snapshot = actors::job::snapshot_keeping(client, &cache)
            .await
            .context("asking for the cluster's status")?;
        let mut page = format!("{}", snapshot.cluster);
        let statuses: Vec<_> = snapshot.jobs.iter().filter_map(|j| j.job.clone()).collect();
        if !statuses.is_empty() {
            page.push('\n');
            page.push_str(&crate::commands::tables::jobs_table(&statuses));
        }
        for job in snapshot.jobs.iter() {
            if let Some(problem) = &job.problem {
                page.push_str(&format!("job {}: {problem}\n", job.name));
            }
            if !job.ranks.is_empty() {
                page.push_str(&format!("\n{}:", job.name));
                page.push_str(&crate::commands::tables::ranks_table(&job.ranks));
            }
        }
        let taken = std::time::UNIX_EPOCH + Duration::from_millis(snapshot.taken_at_unix_ms);
        page.push_str(&format!(
            "\nas of {} (every {} s; Ctrl-C ends)\n",
            httpdate::fmt_http_date(taken),
            args.every
        ));
        if terminal {
            // Home, the page, then clear what is left of an older, longer one.
            let clear = if drawn == 0 { "\x1b[2J" } else { "" };
            print!("{clear}\x1b[H{}\x1b[J", page.replace('\n', "\x1b[K\n"));
        } else {
            println!("{page}");
        }
        drawn += 1;
        if args.times.is_some_and(|times| drawn >= times) {
            return Ok(ExitCode::SUCCESS);
        }
        tokio::time::sleep(Duration::from_secs_f64(args.every)).await;
    }
}

pub fn stop(loaded: &Loaded, args: StopArgs) -> anyhow::Result<ExitCode> {
    let state = state_dir(&loaded.config.cluster)?;
    if args.all {
        let tokio = async_runtime()?;
        tokio.block_on(async {
            let client = runtime::ClusterClient::connect(&state, args.address.as_deref()).await?;
            client.stop(true).await
        })?;
        println!("asked the head to stop the cluster");
    }
    let mut stopped = 0;
    for record in state.daemons()? {
        let Some(pid) = alive(record.pid) else {
            // A daemon that died without cleaning up (SIGKILL, reboot).
            state.remove_daemon(record.pid)?;
            continue;
        };
        let how = terminate(pid, Duration::from_secs(10));
        state.remove_daemon(record.pid)?;
        println!(
            "stopped the {} daemon (pid {}, head {}){how}",
            role_name(record.role),
            record.pid,
            record.head
        );
        stopped += 1;
    }
    if stopped == 0 && !args.all {
        println!("no imgrun daemon is running on this machine");
    }
    Ok(ExitCode::SUCCESS)
}

/// Starts this command again with `--block --notify-ready` in the background and waits
/// for it to be ready.
fn background(
    role: &str,
    state: &runtime::StateDir,
    cluster: &ClusterConfig,
) -> anyhow::Result<ExitCode> {
    let logs = state.ensure_dir("logs")?;
    let started = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let log = logs.join(format!("{role}-{started}.log"));
    // Private like the rest of the state folder: a log names peers, actors and paths.
    let log_file = runtime::create_private(&log)
        .with_context(|| format!("creating the log {}", log.display()))?;
    let exe = std::env::current_exe().context("finding the imgrun binary")?;
    let mut args: Vec<OsString> = std::env::args_os().skip(1).collect();
    args.push("--block".into());
    args.push("--notify-ready".into());
    let mut child = Command::new(&exe)
        .args(&args)
        .env("IMGRUN_DAEMON_LOG", &log)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log_file)
        .spawn()
        .with_context(|| format!("starting {}", exe.display()))?;
    let stdout = child.stdout.take().context("the daemon's pipe")?;
    let (lines, received) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(cluster.start_timeout_secs);
    let message = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match received.recv_timeout(left) {
            Ok(line) => match line.strip_prefix(READY) {
                Some(rest) => break rest.replace("\\n", "\n"),
                None => continue,
            },
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                let _ = child.wait();
                bail!(
                    "the {role} daemon was not ready within {}s; its log ({}) ends with:\n{}",
                    cluster.start_timeout_secs,
                    log.display(),
                    log_tail(&log)
                );
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = child.wait().context("waiting for the daemon")?;
                bail!(
                    "the {role} daemon failed to start ({status}); its log ({}) ends with:\n{}",
                    log.display(),
                    log_tail(&log)
                );
            }
        }
    };
    // The daemon runs whether or not anyone reads this: a closed standard output (`|
    // grep -m1`) is no failure, and no panic.
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{message}\n\nlog: {}", log.display()).and_then(|()| out.flush());
    Ok(ExitCode::SUCCESS)
}

/// Says the daemon is ready: on the pipe when started in the background (the starting
/// process prints it), else on standard output.
fn ready(daemon: &DaemonArgs, message: &str) -> anyhow::Result<()> {
    if daemon.notify_ready {
        // A session of its own, so that closing the terminal that started it does not
        // send it SIGHUP. Fails only for a process group leader, which this is not.
        let _ = rustix::process::setsid();
        let mut out = std::io::stdout().lock();
        writeln!(out, "{READY}{}", message.replace('\n', "\\n"))?;
        out.flush()?;
    } else {
        println!("{message}");
    }
    Ok(())
}

fn refuse_second_head(state: &runtime::StateDir) -> anyhow::Result<()> {
    for record in state.daemons()? {
        if record.role == runtime::DaemonRole::Head && alive(record.pid).is_some() {
            bail!(
                "a head is already running on this machine (pid {}, address {}); stop it with \
                 `imgrun stop` first",
                record.pid,
                record.head
            );
        }
    }
    Ok(())
}

fn daemon_record(
    role: runtime::DaemonRole,
    head: &str,
    state: &runtime::StateDir,
) -> anyhow::Result<runtime::DaemonRecord> {
    let record = runtime::DaemonRecord {
        role,
        pid: std::process::id(),
        head: head.to_string(),
        log: std::env::var_os("IMGRUN_DAEMON_LOG")
            .map(PathBuf::from)
            .unwrap_or_default(),
    };
    state
        .add_daemon(&record)
        .context("recording the daemon in the state folder")?;
    Ok(record)
}

fn forget(state: &runtime::StateDir, record: &runtime::DaemonRecord) {
    if let Err(error) = state.remove_daemon(record.pid) {
        tracing::warn!(%error, "cannot remove the daemon's record");
    }
}

/// Waits for SIGTERM or SIGINT and names it.
async fn shutdown_signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        let _ = tokio::signal::ctrl_c().await;
        return "SIGINT";
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = tokio::signal::ctrl_c() => "SIGINT",
    }
}

/// SIGTERM, then SIGKILL if the process is still there after `grace`. Says how it ended.
fn terminate(pid: Pid, grace: Duration) -> &'static str {
    if kill_process(pid, Signal::TERM).is_err() {
        return "";
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if !running(pid) {
            return "";
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = kill_process(pid, Signal::KILL);
    " (killed: it did not stop within 10s of SIGTERM)"
}

/// The process, if it is running.
fn alive(pid: u32) -> Option<Pid> {
    let pid = Pid::from_raw(i32::try_from(pid).ok()?)?;
    running(pid).then_some(pid)
}

/// Whether `pid` exists and is not a zombie: a daemon that exited stays one until init
/// reaps it (its `imgrun start` parent exited long ago), which may take a while.
fn running(pid: Pid) -> bool {
    let zombie = std::fs::read_to_string(format!("/proc/{}/stat", pid.as_raw_nonzero()))
        .ok()
        .and_then(|stat| {
            let state = stat.rsplit_once(')')?.1.trim_start().chars().next()?;
            Some(matches!(state, 'Z' | 'X'))
        })
        .unwrap_or(false);
    !zombie && test_kill_process(pid).is_ok()
}

fn role_name(role: runtime::DaemonRole) -> &'static str {
    match role {
        runtime::DaemonRole::Head => "head",
        runtime::DaemonRole::Node => "node",
    }
}

fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let tail = &lines[lines.len().saturating_sub(20)..];
    if tail.is_empty() {
        "  (empty)".to_string()
    } else {
        tail.iter()
            .map(|l| format!("  {l}"))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

pub(crate) fn state_dir(cluster: &ClusterConfig) -> anyhow::Result<runtime::StateDir> {
    if cluster.state_dir.is_empty() {
        runtime::StateDir::locate().context("finding the state folder")
    } else {
        Ok(runtime::StateDir::at(&cluster.state_dir))
    }
}

fn bind_ip(daemon: &DaemonArgs, cluster: &ClusterConfig) -> anyhow::Result<IpAddr> {
    match daemon.bind {
        Some(ip) => Ok(ip),
        // Invariant: `config::validate` checked it.
        None => cluster
            .bind
            .parse()
            .with_context(|| format!("cluster.bind `{}`", cluster.bind)),
    }
}

fn advertise(daemon: &DaemonArgs, cluster: &ClusterConfig) -> Option<String> {
    daemon
        .advertise
        .clone()
        .or_else(|| Some(cluster.advertise.clone()))
        .filter(|a| !a.is_empty())
}

fn resources(daemon: &DaemonArgs) -> runtime::NodeResources {
    runtime::discover(&runtime::DiscoverOptions {
        num_gpus: daemon.num_gpus,
        num_cpus: daemon.num_cpus,
        ..runtime::DiscoverOptions::default()
    })
}

/// The kinds of actor this binary hosts, in its daemons and in their worker processes
/// alike: the diagnostic `echo` and the trainers of `imgrun train`.
pub fn actor_registry() -> runtime::ActorRegistry {
    let mut registry = runtime::diagnostic_registry();
    actors::train::register(&mut registry);
    actors::job::register(&mut registry);
    actors::load::register(&mut registry);
    registry
}

/// How the daemons host actors: this binary's kinds, and worker processes that are this
/// binary again (`imgrun worker`).
pub(crate) fn actor_hosting() -> runtime::ActorHosting {
    let worker = match runtime::WorkerCommand::current_exe(["worker"]) {
        Ok(command) => Some(with_malloc_tunables(
            command,
            std::env::var_os("GLIBC_TUNABLES").is_some(),
        )),
        Err(error) => {
            tracing::warn!(%error, "cannot find this binary; actors with a process group cannot start here");
            None
        }
    };
    runtime::ActorHosting {
        registry: actor_registry(),
        worker,
        ..runtime::ActorHosting::default()
    }
}

/// glibc's malloc settings for worker processes, unless `GLIBC_TUNABLES` is set already
/// (then the workers inherit it, as they do every variable).
///
/// libtorch allocates and frees each step's activations and gradients on the CPU, many of
/// them over glibc's initial mmap threshold: by default each such buffer is mapped, its
/// pages faulted in and zeroed, and unmapped again, every step. Keeping blocks up to 32 MiB
/// on the heap and not trimming it below 1 GiB reuses them instead, as PyTorch's CUDA
/// caching allocator does on the GPU. One forward and backward of the small CNN, batch 64,
/// one thread: 64 ms of CPU before, 49 ms after (`actors/benches/python/layout_bench.py`,
/// README). The cost is memory kept at the step's peak instead of returned between steps.
const MALLOC_TUNABLES: &str =
    "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824";

fn with_malloc_tunables(
    command: runtime::WorkerCommand,
    already_set: bool,
) -> runtime::WorkerCommand {
    if already_set {
        command
    } else {
        command.with_env("GLIBC_TUNABLES", MALLOC_TUNABLES)
    }
}

pub(crate) fn membership(cluster: &ClusterConfig) -> runtime::MembershipConfig {
    runtime::MembershipConfig {
        heartbeat_interval_ms: cluster.heartbeat_ms,
        dead_after_ms: cluster.dead_after_ms,
    }
}

/// Raises this daemon's open-file limit to its hard limit: every actor it hosts (a
/// job's coordinator, which stays while the job is listed, a loader) holds descriptors,
/// and the usual soft limit of 1,024 would hold only a few hundred jobs. A limit it
/// cannot raise is said in its log, and the daemon runs on.
fn raise_open_file_limit() {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    let Some(hard) = limit.maximum else {
        return;
    };
    if limit.current.is_some_and(|soft| soft >= hard) {
        return;
    }
    let raised = Rlimit {
        current: Some(hard),
        maximum: Some(hard),
    };
    match setrlimit(Resource::Nofile, raised) {
        Ok(()) => tracing::info!(from = ?limit.current, to = hard, "raised the open-file limit"),
        Err(error) => {
            tracing::warn!(%error, soft = ?limit.current, hard, "cannot raise the open-file limit");
        }
    }
}

fn async_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}
