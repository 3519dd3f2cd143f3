//! `imgrun bench dashboard`: the head's dashboard measured against the goals of its issue,
//! in one process: a real head on loopback (`runtime::Head`) and the real dashboard
//! (`crate::dashboard::start`), a synthetic running job of `--ranks` ranks and
//! `--finished-jobs` finished ones (`synthetic.rs`), and browsers over loopback HTTP with
//! a session (`browser.rs`), on a thread of their own so that their CPU time is left out
//! of the head's.
//!
//! In order, it measures:
//! 1. first load: the bytes a browser fetches to show the overview and the job page, and
//!    any URL of another host in them;
//! 2. the head's CPU and memory for `--seconds` with the dashboard idle, then as long with
//!    `--pages` pages open (the first the overview, the others the job page), which also
//!    gives the delay from each step's end to each page's change event;
//! 3. the overview's pages (`?page=N`, every one) with the finished jobs kept by the
//!    cluster's job archive, then 2. again with them;
//! 4. the last 1,000 lines of the `--log-bytes` log (`job/NAME/log`).
//!
//! It prints each figure as it comes, then a table of figure against goal. Nothing is
//! asserted: the figures are the output.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio::sync::watch;

use super::browser::{Answer, Browser, BrowserThread, OpenPage, outside_urls};
use super::synthetic::{self, Feed, RUNNING_JOB, Spawned};
use super::usage::{Quantiles, Reading, Span, ms};
use crate::units::{human_bytes, parse_size};

#[derive(Debug, clap::Args)]
pub struct DashboardArgs {
    /// Ranks of the synthetic running job.
    #[arg(long, default_value_t = 64)]
    ranks: u32,
    /// Finished jobs the head holds for the overview's pages.
    #[arg(long, default_value_t = 10_000)]
    finished_jobs: u64,
    /// Pages open at once (each follows the dashboard's events).
    #[arg(long, default_value_t = 5)]
    pages: usize,
    /// How long each span of the CPU and memory measure lasts, in seconds.
    #[arg(long, default_value_t = 20.0)]
    seconds: f64,
    /// The size of the running job's log (`1G`, `200MB`).
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    log_bytes: u64,
    /// How often the running job's step advances, in milliseconds.
    #[arg(long, default_value_t = 200)]
    step_ms: u64,
}

/// The goals.
const GOAL_FIRST_LOAD_BYTES: usize = 150_000;
const GOAL_STEP_TO_BROWSER: Duration = Duration::from_secs(1);
const GOAL_CORES: f64 = 0.01;
const GOAL_MEMORY_BYTES: i64 = 50_000_000;
const GOAL_OVERVIEW_P95: Duration = Duration::from_millis(100);
const GOAL_LOG_P95: Duration = Duration::from_millis(200);

/// Longer than the dashboard's snapshot is kept (`SNAPSHOT_MAX_AGE`, 500 ms).
const SNAPSHOT_AGE: Duration = Duration::from_millis(600);

/// Overview pages asked one at a time, each on a fresh snapshot.
const SPACED_PAGES: u64 = 20;

/// Jobs on one page of the overview (`pages.rs`'s).
const JOBS_PER_PAGE: u64 = 50;

/// Times the log page is asked for.
const LOG_REQUESTS: usize = 20;

/// Finished jobs handed to the archive at once, and the longest that may take.
const KEEP_AT_ONCE: usize = 16;
const KEEP_LIMIT: Duration = Duration::from_secs(600);

/// Steps of the running job's `metrics.jsonl` before it starts.
const METRICS_STEPS: u64 = 2000;

/// The paths a browser fetches to show the overview, and the job page (`app.js` and
/// `style.css` again: the dashboard answers `Cache-Control: no-store`).
const OVERVIEW_LOAD: &[&str] = &["/", "/app.js", "/style.css"];
fn job_load() -> [String; 4] {
    [
        format!("/job/{RUNNING_JOB}"),
        "/app.js".to_owned(),
        "/style.css".to_owned(),
        chart_path(),
    ]
}

fn chart_path() -> String {
    format!("/job/{RUNNING_JOB}/chart.svg")
}

pub(super) fn run(args: &DashboardArgs) -> anyhow::Result<ExitCode> {
    check(args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let figures = runtime.block_on(bench(args))?;
    print_table(args, &figures);
    Ok(ExitCode::SUCCESS)
}

fn check(args: &DashboardArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.seconds.is_finite() && args.seconds > 0.0,
        "--seconds must be a positive number of seconds"
    );
    anyhow::ensure!(args.ranks > 0, "--ranks must be at least 1");
    anyhow::ensure!(args.pages > 0, "--pages must be at least 1");
    anyhow::ensure!(args.step_ms > 0, "--step-ms must be at least 1");
    anyhow::ensure!(args.log_bytes > 0, "--log-bytes must be at least 1 byte");
    Ok(())
}

/// Everything the benchmark measured.
struct Figures {
    first_load: FirstLoad,
    /// Without, then with the finished jobs.
    open: Vec<OpenFigures>,
    overview: Option<OverviewFigures>,
    spawned: Spawned,
    log: LogFigures,
}

/// Sets everything up, measures, and takes it all down (the temporary folder, its log
/// included, goes with it).
async fn bench(args: &DashboardArgs) -> anyhow::Result<Figures> {
    let dir = tempfile::Builder::new()
        .prefix("imgrun-bench-dashboard-")
        .tempdir()
        .context("making a temporary folder")?;
    let run_dir = dir.path().join(RUNNING_JOB);
    std::fs::create_dir(&run_dir).context("making the run folder")?;
    println!(
        "writing a {} job log in {} ...",
        human_bytes(args.log_bytes),
        dir.path().display()
    );
    let (log_bytes, metrics_dir) = (args.log_bytes, run_dir.clone());
    tokio::task::spawn_blocking(move || {
        synthetic::write_run(&metrics_dir, log_bytes, METRICS_STEPS)
    })
    .await
    .context("writing the job's files")??;
    let feed = Arc::new(Feed::new(
        args.ranks,
        Duration::from_millis(args.step_ms),
        run_dir,
    ));
    let setup = Setup::start(dir.path(), Arc::clone(&feed)).await?;
    let figures = measure(args, &setup).await;
    setup.stop().await;
    figures
}

/// The head, the dashboard, the running job and the browsers.
struct Setup {
    head: runtime::Head,
    client: runtime::ClusterClient,
    /// The cluster's job archive, which keeps the finished jobs.
    archive: runtime::ActorRef,
    dashboard: crate::dashboard::Dashboard,
    feed: Arc<Feed>,
    ticker: tokio::task::JoinHandle<()>,
    browsers: BrowserThread,
    browser: Browser,
    /// Before the dashboard started.
    before_dashboard: Reading,
}

impl Setup {
    async fn start(dir: &std::path::Path, feed: Arc<Feed>) -> anyhow::Result<Self> {
        let state = runtime::StateDir::at(dir.join("head"));
        let head = start_head(state.clone(), synthetic::registry(Arc::clone(&feed))).await?;
        let client = runtime::ClusterClient::connect(&state, None)
            .await
            .context("connecting to the head")?;
        synthetic::spawn_running(&client).await?;
        let archive = synthetic::start_archive(&client, head.node_id()).await?;
        let ticker = tokio::spawn(Arc::clone(&feed).tick());
        let before_dashboard = Reading::now();
        let dashboard = start_dashboard(client.clone()).await?;
        let addr = address(&dashboard.record.url)?;
        let browsers = BrowserThread::start()?;
        let token = dashboard.record.token.clone();
        let browser = browsers
            .run(async move {
                let mut browser = Browser::new(addr);
                browser.login(&token).await.map(|_| browser)
            })
            .await??;
        println!(
            "head, dashboard at {} and the {} job started",
            dashboard.record.url, RUNNING_JOB
        );
        Ok(Setup {
            head,
            client,
            archive,
            dashboard,
            feed,
            ticker,
            browsers,
            browser,
            before_dashboard,
        })
    }

    async fn stop(self) {
        self.ticker.abort();
        drop(self.browsers);
        self.dashboard.stop().await;
        drop(self.client);
        self.head.stop().await;
    }
}

async fn start_head(
    state: runtime::StateDir,
    registry: runtime::ActorRegistry,
) -> anyhow::Result<runtime::Head> {
    let resources = runtime::discover(&runtime::DiscoverOptions {
        num_gpus: Some(0),
        visible_devices: runtime::VisibleDevices::Set("-1".to_owned()),
        ..runtime::DiscoverOptions::default()
    });
    let config = runtime::HeadConfig {
        actors: runtime::ActorHosting {
            registry,
            ..runtime::ActorHosting::default()
        },
        ..runtime::HeadConfig::loopback(state, resources)
    };
    runtime::Head::start(config)
        .await
        .context("starting the head")
}

async fn start_dashboard(
    client: runtime::ClusterClient,
) -> anyhow::Result<crate::dashboard::Dashboard> {
    let options = crate::dashboard::DashboardOptions {
        bind: IpAddr::V4(Ipv4Addr::LOCALHOST),
        port: 0,
        tls: None,
        hosts: Vec::new(),
        draw_chart: crate::commands::plot::svg_of,
        actions: false,
    };
    crate::dashboard::start(options, client)
        .await
        .context("starting the dashboard")
}

/// The dashboard's address, from its URL (`http://127.0.0.1:PORT/`).
fn address(url: &str) -> anyhow::Result<SocketAddr> {
    url.trim_start_matches("http://")
        .trim_end_matches('/')
        .parse()
        .with_context(|| format!("the dashboard's URL `{url}` is not http://ADDRESS/"))
}

async fn measure(args: &DashboardArgs, setup: &Setup) -> anyhow::Result<Figures> {
    let first_load = first_load(setup).await?;
    let mut open = vec![
        open_pages(
            args,
            setup,
            "the running job only",
            (setup.before_dashboard, "just before the dashboard started"),
        )
        .await?,
    ];
    println!("keeping {} finished jobs ...", args.finished_jobs);
    let spawned = synthetic::keep_finished(
        &setup.archive,
        0..args.finished_jobs,
        KEEP_AT_ONCE,
        KEEP_LIMIT,
    )
    .await;
    print_spawned(&spawned);
    // The dashboard's snapshot may be up to 500 ms old: the overview is measured on one
    // taken once every finished job was up.
    tokio::time::sleep(SNAPSHOT_AGE).await;
    let before_overview = Reading::now();
    let overview = if spawned.count > 0 {
        Some(overview_pages(setup, spawned.count + 1).await?)
    } else {
        None
    };
    let label = format!("with {} finished jobs", spawned.count);
    open.push(
        open_pages(
            args,
            setup,
            &label,
            (before_overview, "the finished jobs were up"),
        )
        .await?,
    );
    let log = log_pages(setup, args.log_bytes).await?;
    Ok(Figures {
        first_load,
        open,
        overview,
        spawned,
        log,
    })
}

fn print_spawned(spawned: &Spawned) {
    println!(
        "  {} finished jobs kept in {:.1} s{}",
        spawned.count,
        spawned.took.as_secs_f64(),
        spawned
            .stopped
            .as_ref()
            .map_or(String::new(), |why| format!("; stopped: {why}"))
    );
}

/// What a browser fetches to show a page.
struct FirstLoad {
    /// Each path with its status and bytes on the wire, the overview's then the job page's.
    overview: Vec<(String, u16, usize)>,
    job: Vec<(String, u16, usize)>,
    /// The login shell a browser gets before its session (`/` without a cookie).
    login_shell: usize,
    /// URLs of another host found in any of it.
    outside: Vec<String>,
}

impl FirstLoad {
    fn bytes(load: &[(String, u16, usize)]) -> usize {
        load.iter().map(|(_, _, bytes)| bytes).sum()
    }
}

async fn first_load(setup: &Setup) -> anyhow::Result<FirstLoad> {
    let browser = setup.browser.clone();
    let shell = Browser::new(address(&setup.dashboard.record.url)?);
    let overview_load: Vec<String> = OVERVIEW_LOAD.iter().map(|&p| p.to_owned()).collect();
    let load = setup
        .browsers
        .run(async move {
            let login_shell = shell.get("/").await?;
            let overview = fetch_all(&browser, overview_load).await?;
            let job = fetch_all(&browser, job_load()).await?;
            anyhow::Ok((login_shell, overview, job))
        })
        .await??;
    let (login_shell, overview, job) = load;
    let mut outside = outside_urls(&String::from_utf8_lossy(&login_shell.body));
    for (_, answer) in overview.iter().chain(&job) {
        outside.extend(outside_urls(&String::from_utf8_lossy(&answer.body)));
    }
    let listed = |load: Vec<(String, Answer)>| {
        load.into_iter()
            .map(|(path, answer)| (path, answer.status, answer.wire_bytes))
            .collect::<Vec<_>>()
    };
    let load = FirstLoad {
        overview: listed(overview),
        job: listed(job),
        login_shell: login_shell.wire_bytes,
        outside,
    };
    print_first_load(&load);
    Ok(load)
}

async fn fetch_all(
    browser: &Browser,
    paths: impl IntoIterator<Item = String>,
) -> anyhow::Result<Vec<(String, Answer)>> {
    let mut fetched = Vec::new();
    for path in paths {
        let answer = browser.get(&path).await?;
        fetched.push((path, answer));
    }
    Ok(fetched)
}

fn print_first_load(load: &FirstLoad) {
    println!("first load (bytes on the wire, headers included):");
    println!(
        "  login shell (before the session)  {:>9}",
        load.login_shell
    );
    for (path, status, bytes) in load.overview.iter().chain(&load.job) {
        println!("  {path:<34} {bytes:>9}  ({status})");
    }
    println!(
        "  overview {} bytes, job page {} bytes; URLs of another host: {}",
        FirstLoad::bytes(&load.overview),
        FirstLoad::bytes(&load.job),
        if load.outside.is_empty() {
            "none".to_owned()
        } else {
            load.outside.join(", ")
        }
    );
}

/// The head's cost idle and with pages open, and the delays of the step ends.
struct OpenFigures {
    label: String,
    idle: Span,
    open: Span,
    /// Resident memory at the end of the open span less the baseline's, and what the
    /// baseline was taken before.
    since: &'static str,
    /// Resident memory at the end of the open span less `baseline`'s.
    memory: Option<i64>,
    delays: Option<Quantiles>,
    /// Step ends no page heard of before the pages closed, of those counted.
    missed: usize,
    counted: usize,
    events: usize,
    fetched: usize,
    failed: usize,
    /// Pages that could not open (refused or broken streams).
    broken: Vec<String>,
}

/// Measures `--seconds` idle, then `--seconds` with `--pages` pages open; `baseline` is
/// the reading the memory is counted from, and what it was taken before.
async fn open_pages(
    args: &DashboardArgs,
    setup: &Setup,
    label: &str,
    baseline: (Reading, &'static str),
) -> anyhow::Result<OpenFigures> {
    let span = Duration::from_secs_f64(args.seconds);
    println!(
        "{label}: {:.0} s idle, then {:.0} s with {} pages open ...",
        args.seconds, args.seconds, args.pages
    );
    let idle = measure_span(setup, span).await;
    let (stop, stopping) = watch::channel(false);
    let pages = open_all(setup, args.pages, &stopping).await;
    let opened = Instant::now();
    let open = measure_span(setup, span).await;
    let closing = Instant::now();
    let _ = stop.send(true);
    let mut seen = Vec::new();
    for page in pages {
        seen.push(page.await.context("a page's task")?);
    }
    let figures = open_figures(
        setup,
        label,
        (idle, open),
        (opened, closing),
        seen,
        baseline,
    );
    print_open(&figures);
    Ok(figures)
}

/// Opens `count` pages on the browsers' thread: the overview first, then the job page.
async fn open_all(
    setup: &Setup,
    count: usize,
    stopping: &watch::Receiver<bool>,
) -> Vec<tokio::task::JoinHandle<anyhow::Result<OpenPage>>> {
    (0..count)
        .map(|index| {
            let browser = setup.browser.clone();
            let stopping = stopping.clone();
            let (page, chart) = match index {
                0 => ("/".to_owned(), None),
                _ => (format!("/job/{RUNNING_JOB}"), Some(chart_path())),
            };
            setup
                .browsers
                .spawn(async move { browser.open_page(&page, chart.as_deref(), stopping).await })
        })
        .collect()
}

/// The process's CPU and memory over `span`, the browsers' CPU left out.
async fn measure_span(setup: &Setup, span: Duration) -> Span {
    let browsers_start = setup.browsers.cpu_s().await;
    let start = Reading::now();
    tokio::time::sleep(span).await;
    let end = Reading::now();
    let browsers_cpu = setup.browsers.cpu_s().await - browsers_start;
    Span::between(start, end, browsers_cpu)
}

fn open_figures(
    setup: &Setup,
    label: &str,
    (idle, open): (Span, Span),
    (opened, closing): (Instant, Instant),
    seen: Vec<anyhow::Result<OpenPage>>,
    baseline: (Reading, &'static str),
) -> OpenFigures {
    let feed = &setup.feed;
    // The step ends counted: from a second after the pages opened to 1.5 s before they
    // closed, so that each had its chance to be heard.
    let first = feed.steps_at(opened + Duration::from_secs(1)) + 1;
    let last = feed.steps_at(
        closing
            .checked_sub(Duration::from_millis(1500))
            .unwrap_or(opened),
    );
    let heard = Heard::of(seen, feed, first..=last);
    OpenFigures {
        label: label.to_owned(),
        since: baseline.1,
        idle,
        open,
        memory: open
            .rss_end
            .zip(baseline.0.rss())
            .map(|(end, base)| end as i64 - base as i64),
        delays: Quantiles::of(&heard.delays),
        missed: heard.missed,
        counted: heard.delays.len() + heard.missed,
        events: heard.events,
        fetched: heard.fetched,
        failed: heard.failed,
        broken: heard.broken,
    }
}

/// What the open pages heard, all together.
#[derive(Default)]
struct Heard {
    delays: Vec<Duration>,
    missed: usize,
    events: usize,
    fetched: usize,
    failed: usize,
    broken: Vec<String>,
}

impl Heard {
    /// The pages' events against the ends of `steps` of the job `feed`.
    fn of(
        seen: Vec<anyhow::Result<OpenPage>>,
        feed: &Feed,
        steps: std::ops::RangeInclusive<u64>,
    ) -> Self {
        let answered = feed.answered();
        let mut heard = Heard::default();
        for page in seen {
            let page = match page {
                Ok(page) => page,
                Err(error) => {
                    heard.broken.push(format!("{error:#}"));
                    continue;
                }
            };
            let ended = |step| feed.step_ended(step);
            let (delays, missed) = step_delays(&page.events, &answered, ended, steps.clone());
            heard.delays.extend(delays);
            heard.missed += missed;
            heard.events += page.events.len();
            heard.fetched += page.fetched;
            heard.failed += page.failed;
        }
        heard
    }
}

/// For one page: the delay from the end of each step of `steps` to the first change event
/// the page got once a snapshot had seen that step (`answered`: when the job's status was
/// answered, with its steps done; the newest answer before an event is the snapshot the
/// event tells of); and how many of `steps` no event told of.
fn step_delays(
    events: &[Instant],
    answered: &[(Instant, u64)],
    step_ended: impl Fn(u64) -> Instant,
    steps: std::ops::RangeInclusive<u64>,
) -> (Vec<Duration>, usize) {
    let mut delays = Vec::new();
    let mut told = steps.start().saturating_sub(1);
    for &event in events {
        let seen = answered
            .iter()
            .take_while(|(at, _)| *at <= event)
            .map(|&(_, steps_done)| steps_done)
            .max();
        let Some(seen) = seen else { continue };
        for step in (told + 1)..=seen.min(*steps.end()) {
            if step >= *steps.start() {
                delays.push(event.saturating_duration_since(step_ended(step)));
            }
        }
        told = told.max(seen);
    }
    let missed = steps.filter(|step| *step > told).count();
    (delays, missed)
}

fn print_open(figures: &OpenFigures) {
    let cores = |span: &Span| {
        span.cores
            .map_or("?".to_owned(), |c| format!("{:.2}%", c * 100.0))
    };
    let growth = |span: &Span| span.rss_growth().map_or("?".to_owned(), signed_bytes);
    println!(
        "  idle: {} of a core, memory {}; pages open: {} of a core (the browsers' own {:.2}% left \
         out), memory {}; dashboard memory since {}: {}",
        cores(&figures.idle),
        growth(&figures.idle),
        cores(&figures.open),
        figures.open.client_cores * 100.0,
        growth(&figures.open),
        figures.since,
        figures.memory.map_or("?".to_owned(), signed_bytes)
    );
    println!(
        "  {} events, {} pages and charts fetched again ({} failed); step end to browser: {} \
         ({} step ends counted, {} never heard of){}",
        figures.events,
        figures.fetched,
        figures.failed,
        quantiles_text(figures.delays.as_ref()),
        figures.counted,
        figures.missed,
        if figures.broken.is_empty() {
            String::new()
        } else {
            format!("; pages that failed: {}", figures.broken.join("; "))
        }
    );
}

/// The overview's pages with the finished jobs.
struct OverviewFigures {
    jobs: u64,
    pages: u64,
    /// The first request (the dashboard asks every finished job's coordinator once).
    first: Duration,
    /// Every page, back to back: most answered from the snapshot the first one took.
    latency: Option<Quantiles>,
    /// Pages each asked once the snapshot aged out.
    fresh: Option<Quantiles>,
    failed: usize,
    /// Distinct finished jobs named on the pages.
    listed: usize,
    /// Rows that show a problem instead of the job's status (its coordinator did not
    /// answer the snapshot in time).
    problems: usize,
}

async fn overview_pages(setup: &Setup, jobs: u64) -> anyhow::Result<OverviewFigures> {
    let pages = jobs.div_ceil(JOBS_PER_PAGE);
    let browser = setup.browser.clone();
    let (first, answers) = setup
        .browsers
        .run(async move {
            let first = browser.get("/").await?;
            let paths = (0..pages).map(|page| format!("/?page={page}"));
            anyhow::Ok((first.took, fetch_all(&browser, paths).await?))
        })
        .await??;
    let latency: Vec<Duration> = answers.iter().map(|(_, a)| a.took).collect();
    let (mut listed, mut problems) = (std::collections::HashSet::new(), 0);
    for (_, answer) in &answers {
        let body = String::from_utf8_lossy(&answer.body);
        listed.extend(finished_names(&body));
        problems += body.matches("<td class=bad").count();
    }
    let fresh = spaced_pages(setup, pages).await?;
    let figures = OverviewFigures {
        jobs,
        pages,
        first,
        latency: Quantiles::of(&latency),
        fresh: Quantiles::of(&fresh),
        failed: answers.iter().filter(|(_, a)| a.status != 200).count(),
        listed: listed.len(),
        problems,
    };
    println!(
        "overview of {jobs} jobs, {pages} pages: first (cold) {:.0} ms; every page back to \
         back: {} ({} failed); {} distinct finished jobs named, {} shown with a problem; {} \
         pages each on a fresh snapshot: {}",
        ms(figures.first),
        quantiles_text(figures.latency.as_ref()),
        figures.failed,
        figures.listed,
        figures.problems,
        fresh.len(),
        quantiles_text(figures.fresh.as_ref()),
    );
    Ok(figures)
}

/// The latency of up to [`SPACED_PAGES`] of the overview's `pages`, spread over them, each
/// asked once the dashboard's snapshot has aged out: what a person paging through pays.
async fn spaced_pages(setup: &Setup, pages: u64) -> anyhow::Result<Vec<Duration>> {
    let count = pages.min(SPACED_PAGES);
    let picked: Vec<u64> = (0..count)
        .map(|i| i * (pages - 1) / (count - 1).max(1))
        .collect();
    let browser = setup.browser.clone();
    setup
        .browsers
        .run(async move {
            let mut took = Vec::new();
            for page in picked {
                tokio::time::sleep(SNAPSHOT_AGE).await;
                let answer = browser.get(&format!("/?page={page}")).await?;
                anyhow::ensure!(
                    answer.status == 200,
                    "page {page} answered {}",
                    answer.status
                );
                took.push(answer.took);
            }
            anyhow::Ok(took)
        })
        .await?
}

/// The finished jobs' names in `text`.
fn finished_names(text: &str) -> Vec<String> {
    let prefix = "bench-finished-";
    text.match_indices(prefix)
        .filter_map(|(at, _)| text.get(at..at + prefix.len() + 5))
        .filter(|name| name[prefix.len()..].bytes().all(|b| b.is_ascii_digit()))
        .map(str::to_owned)
        .collect()
}

/// The log page's latency.
struct LogFigures {
    latency: Option<Quantiles>,
    bytes: usize,
    failed: usize,
}

async fn log_pages(setup: &Setup, log_bytes: u64) -> anyhow::Result<LogFigures> {
    let browser = setup.browser.clone();
    let path = format!("/job/{RUNNING_JOB}/log");
    let answers = setup
        .browsers
        .run(async move { fetch_all(&browser, std::iter::repeat_n(path, LOG_REQUESTS)).await })
        .await??;
    let latency: Vec<Duration> = answers.iter().map(|(_, a)| a.took).collect();
    let figures = LogFigures {
        latency: Quantiles::of(&latency),
        bytes: answers.first().map_or(0, |(_, a)| a.wire_bytes),
        failed: answers.iter().filter(|(_, a)| a.status != 200).count(),
    };
    println!(
        "log page (last 1,000 lines of a {} log), {LOG_REQUESTS} requests: {} ({} bytes each, {} \
         failed)",
        human_bytes(log_bytes),
        quantiles_text(figures.latency.as_ref()),
        figures.bytes,
        figures.failed
    );
    Ok(figures)
}

fn quantiles_text(quantiles: Option<&Quantiles>) -> String {
    quantiles.map_or("no samples".to_owned(), |q| {
        format!(
            "p50 {:.0} ms, p95 {:.0} ms, max {:.0} ms",
            ms(q.p50),
            ms(q.p95),
            ms(q.max)
        )
    })
}

fn signed_bytes(bytes: i64) -> String {
    let sign = if bytes < 0 { "-" } else { "+" };
    format!("{sign}{}", human_bytes(bytes.unsigned_abs()))
}

/// The table of figure against goal.
fn print_table(args: &DashboardArgs, figures: &Figures) {
    println!(
        "\n{} ranks, {} pages, {} finished jobs asked ({} spawned), {} log, {:.0} s spans:\n",
        args.ranks,
        args.pages,
        args.finished_jobs,
        figures.spawned.count,
        human_bytes(args.log_bytes),
        args.seconds
    );
    println!("{:<48} {:<62} {:<16} met", "figure", "measured", "goal");
    for (figure, measured, goal, met) in table_rows(figures) {
        let met = match met {
            Some(true) => "yes",
            Some(false) => "NO",
            None => "?",
        };
        println!("{figure:<48} {measured:<62} {goal:<16} {met}");
    }
}

type Row = (String, String, String, Option<bool>);

fn table_rows(figures: &Figures) -> Vec<Row> {
    let mut rows = first_load_rows(&figures.first_load);
    for open in &figures.open {
        rows.extend(open_rows(open));
    }
    if let Some(overview) = &figures.overview {
        rows.extend(overview_rows(overview));
    }
    let log_p95 = figures.log.latency.map(|q| q.p95);
    rows.push((
        "last 1,000 lines of the log".to_owned(),
        quantiles_text(figures.log.latency.as_ref()),
        "<= 200 ms".to_owned(),
        log_p95.map(|p95| p95 <= GOAL_LOG_P95 && figures.log.failed == 0),
    ));
    rows
}

fn overview_rows(overview: &OverviewFigures) -> Vec<Row> {
    let complete = overview.listed as u64 + 1 == overview.jobs
        && overview.failed == 0
        && overview.problems == 0;
    let met = |q: Option<Quantiles>| q.map(|q| q.p95 <= GOAL_OVERVIEW_P95 && complete);
    vec![
        (
            format!("overview, {} jobs: every page, back to back", overview.jobs),
            format!(
                "{}; {} pages, {} finished listed, {} with a problem",
                quantiles_text(overview.latency.as_ref()),
                overview.pages,
                overview.listed,
                overview.problems
            ),
            "p95 <= 100 ms".to_owned(),
            met(overview.latency),
        ),
        (
            format!("overview, {} jobs: a fresh snapshot each", overview.jobs),
            quantiles_text(overview.fresh.as_ref()),
            "p95 <= 100 ms".to_owned(),
            met(overview.fresh),
        ),
    ]
}

fn first_load_rows(load: &FirstLoad) -> Vec<Row> {
    let row = |what: &str, bytes: usize| {
        (
            format!("first load, {what}"),
            format!("{bytes} bytes"),
            "<= 150 KB".to_owned(),
            Some(bytes <= GOAL_FIRST_LOAD_BYTES),
        )
    };
    vec![
        row("overview", FirstLoad::bytes(&load.overview)),
        row("job page", FirstLoad::bytes(&load.job)),
        (
            "first load, URLs of another host".to_owned(),
            if load.outside.is_empty() {
                "none".to_owned()
            } else {
                load.outside.join(" ")
            },
            "none".to_owned(),
            Some(load.outside.is_empty()),
        ),
    ]
}

fn open_rows(open: &OpenFigures) -> Vec<Row> {
    let extra = open.open.cores.zip(open.idle.cores).map(|(o, i)| o - i);
    let max = open.delays.map(|q| q.max);
    vec![
        (
            format!("step end to browser ({})", open.label),
            quantiles_text(open.delays.as_ref()),
            "<= 1 s".to_owned(),
            (open.counted > 0)
                .then(|| open.missed == 0 && max.is_some_and(|max| max <= GOAL_STEP_TO_BROWSER)),
        ),
        (
            format!("head CPU for the pages ({})", open.label),
            extra.map_or("?".to_owned(), |e| format!("{:+.2}% of a core", e * 100.0)),
            "<= 1% of a core".to_owned(),
            extra.map(|e| e <= GOAL_CORES),
        ),
        (
            format!("dashboard memory ({})", open.label),
            open.memory.map_or("?".to_owned(), signed_bytes),
            "<= 50 MB".to_owned(),
            open.memory.map(|m| m <= GOAL_MEMORY_BYTES),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_step_end_is_timed_to_the_first_event_that_tells_of_it() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // Steps end every 100 ms; snapshots answered at 250 ms (2 done) and 520 ms (5).
        let answered = [(at(250), 2), (at(520), 5)];
        let ended = |step: u64| at(step * 100);
        for (events, steps, want, missed) in [
            // An event at 260 tells of steps 1 and 2; one at 530 of 3 to 5.
            (vec![260, 530], 1..=5, vec![160, 60, 230, 130, 30], 0),
            // Before any snapshot, an event tells of nothing; step 5 is never told.
            (vec![100, 260], 1..=5, vec![160, 60], 3),
            // Steps before the range are not counted, nor told twice.
            (vec![260, 270, 530], 3..=4, vec![230, 130], 0),
        ] {
            let events: Vec<Instant> = events.into_iter().map(at).collect();
            let (delays, got_missed) = step_delays(&events, &answered, ended, steps);
            let want: Vec<Duration> = want.into_iter().map(Duration::from_millis).collect();
            assert_eq!((delays, got_missed), (want, missed));
        }
    }

    #[test]
    fn finished_jobs_are_found_by_name() {
        let text = "<a href=\"job/bench-finished-00042\">bench-finished-00042</a> bench-finished-x";
        assert_eq!(finished_names(text), vec!["bench-finished-00042"; 2]);
    }
}
