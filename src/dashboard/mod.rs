//! The head's dashboard: a web view of the cluster and its jobs (read-only unless
//! `--dashboard-actions`, which lets a job be cancelled), and Prometheus
//! `/metrics`, served by `imgrun start --head` on loopback (`cluster.dashboard_port`,
//! `--no-dashboard`) through the HTTP stack `imgrun serve` uses (its slots, its share per
//! client, its header and send timeouts). Bound to another address
//! (`cluster.dashboard_bind`) it serves HTTPS only, with a certificate of the cluster CA
//! (`listen.rs` decides).
//!
//! Everything it shows comes from one [`ClusterSnapshot`] (`actors::job::snapshot`), as
//! `imgrun status --json` and `imgrun jobs --json` do, taken at most every
//! [`SNAPSHOT_MAX_AGE`] however many pages and scrapers ask.
//!
//! Routes: `/` the overview (a login shell without a session), `job/NAME` one job,
//! `job/NAME/chart.svg` its charts (`charts.rs`), `job/NAME/log` and `job/NAME/log.txt`
//! its log (`logs.rs`), `events` the change events the pages
//! follow (`events.rs`),
//! `api/state` the snapshot as JSON, `metrics` (`metrics.rs`), `login` (the page's script
//! trades the token of the URL it was opened with for a session cookie), `app.js` and
//! `style.css`. Which request is answered is `policy.rs`'s decision; the secrets are
//! `sessions.rs`'s; the pages are `pages.rs`'s. Every answer carries a
//! Content-Security-Policy that allows nothing from another origin and no framing, and no
//! CORS header. A job is found by its name in the snapshot, never by a path: no request
//! input reaches a file, a shell or a process argument.

mod charts;
mod events;
mod listen;
mod logs;
mod metrics;
mod pages;
mod policy;
mod sessions;

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actors::job::ClusterSnapshot;
use anyhow::Context as _;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use runtime::ClusterClient;
use serde::{Deserialize, Serialize};

use crate::serve::{Timeouts, serve_connections, with_slots};
use policy::{Credential, Hosts, Seen};
use sessions::{COOKIE, Sessions};

/// The oldest snapshot a request is answered from.
const SNAPSHOT_MAX_AGE: Duration = Duration::from_millis(500);

/// The largest `api/state` answer; a bigger snapshot is refused, not sent.
const MAX_STATE_BYTES: usize = 16 << 20;

/// Requests handled at once, and by one client.
const MAX_IN_FLIGHT: usize = 32;
const MAX_PER_CLIENT: usize = 8;

/// The largest request body (the login's token).
const MAX_BODY_BYTES: usize = 1024;

/// The record of a running dashboard, in the head's state folder (mode 0600).
pub const RECORD: &str = "dashboard.json";

/// Where the dashboard is and how to get in: what the head prints once, kept for its
/// owner and for tests.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DashboardRecord {
    /// `http://127.0.0.1:PORT/`, or `https://...` off loopback.
    pub url: String,
    /// The CA certificate a client of an `https://` dashboard trusts (`head/ca.pem`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<std::path::PathBuf>,
    /// Opening `url#token=TOKEN` starts a session.
    pub token: String,
    /// The bearer token that `/metrics` scrapers send.
    pub metrics_token: String,
}

pub use listen::{certificate_names, needs_tls};

/// Draws a job's charts: its name and `metrics.jsonl` bytes to an SVG document of a size.
/// `main.rs` gives `imgrun plot`'s (`commands::plot::svg_of`), so that the dashboard
/// names nothing of the commands and no command names the plot's drawing to start it.
pub type DrawChart = fn(&str, &[u8], (u32, u32)) -> anyhow::Result<String>;

/// What the dashboard is started with.
#[derive(Debug, Clone)]
pub struct DashboardOptions {
    /// The address to bind: loopback, or any other with `tls`.
    pub bind: IpAddr,
    /// TCP port; 0 for any free one. A port that is taken falls back to a free one.
    pub port: u16,
    /// The certificate to serve HTTPS with; required off loopback
    /// ([`needs_tls`]), unused on it.
    pub tls: Option<runtime::WebTls>,
    /// Host names it answers to besides the loopback ones.
    pub hosts: Vec<String>,
    /// How a job's charts are drawn.
    pub draw_chart: DrawChart,
    /// Whether a job can be cancelled from its page (`--dashboard-actions`); nothing
    /// else ever can be done from the dashboard.
    pub actions: bool,
}

/// A running dashboard; it stops when this is dropped or [`Dashboard::stop`]ped.
pub struct Dashboard {
    pub record: DashboardRecord,
    /// Ends the change streams, which would otherwise keep the server's shutdown waiting.
    stop_streams: tokio::sync::watch::Sender<bool>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Dashboard {
    /// Finishes the requests in flight and stops.
    pub async fn stop(mut self) {
        let _ = self.stop_streams.send(true);
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.task).await;
    }
}

/// A job as one self-contained HTML page (`imgrun report`), drawn as the dashboard draws
/// its job page: its status, its charts (`svg`, or why there are none) and the last
/// lines of its log.
pub fn report(
    job: &actors::job::JobSnapshot,
    svg: Result<&str, &str>,
    log: &str,
    made: std::time::SystemTime,
) -> String {
    pages::report(job, svg, log, made)
}

/// Binds where `options` says and serves the dashboard of `client`'s cluster.
pub async fn start(options: DashboardOptions, client: ClusterClient) -> anyhow::Result<Dashboard> {
    let scheme = listen::scheme(options.bind, &options.hosts, options.tls.is_some())?;
    let listener = bind(options.bind, options.port).await?;
    let addr = listener.local_addr().context("the dashboard's address")?;
    let (tls, ca_file) = match (&options.tls, scheme) {
        (Some(tls), listen::Scheme::Https) => (
            Some(tokio_rustls::TlsAcceptor::from(tls.server.rustls())),
            Some(tls.ca_file.clone()),
        ),
        _ => (None, None),
    };
    let record = DashboardRecord {
        url: listen::url(scheme, addr, &options.hosts),
        ca_file,
        token: sessions::secret(),
        metrics_token: sessions::secret(),
    };
    let (stop_streams, streams_stopping) = tokio::sync::watch::channel(false);
    let app = router(Arc::new(Shared {
        hosts: Hosts::new(addr.ip(), &options.hosts),
        actions: options.actions,
        sessions: Sessions::new(record.token.clone(), record.metrics_token.clone()),
        charts: charts::Charts::new(client.clone(), options.draw_chart),
        streams: events::Streams::new(streams_stopping),
        downloads: logs::Downloads::new(),
        client: client.clone(),
        snapshots: Snapshots::new(client),
    }));
    let timeouts = Timeouts {
        header: Duration::from_secs(10),
        send: Duration::from_secs(30),
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        serve_connections(listener, app, timeouts, tls, async {
            let _ = stopped.await;
        })
        .await;
    });
    tracing::info!(%addr, "dashboard serving");
    Ok(Dashboard {
        record,
        stop_streams,
        stop: Some(stop),
        task,
    })
}

/// A listener on `ip:port`, or on a free port of `ip` when `port` is taken.
async fn bind(ip: IpAddr, port: u16) -> anyhow::Result<tokio::net::TcpListener> {
    match tokio::net::TcpListener::bind((ip, port)).await {
        Ok(listener) => Ok(listener),
        Err(error) if error.kind() == std::io::ErrorKind::AddrInUse && port != 0 => {
            tracing::warn!(port, "the dashboard's port is taken; using a free one");
            tokio::net::TcpListener::bind((ip, 0))
                .await
                .with_context(|| format!("binding the dashboard on {ip}"))
        }
        Err(error) => Err(error).with_context(|| format!("binding the dashboard on {ip}:{port}")),
    }
}

/// What every request shares.
struct Shared {
    hosts: Hosts,
    actions: bool,
    sessions: Sessions,
    snapshots: Snapshots,
    charts: charts::Charts,
    streams: events::Streams,
    downloads: logs::Downloads,
    client: ClusterClient,
}

fn router(shared: Arc<Shared>) -> Router {
    let app = Router::new()
        .route("/", get(index))
        .route("/job/{name}", get(job_page))
        .route("/job/{name}/chart.svg", get(chart))
        .route("/job/{name}/log", get(log_page))
        .route("/job/{name}/log.txt", get(log_download))
        .route("/job/{name}/rank/{rank}/log", get(rank_log_page))
        .route("/job/{name}/rank/{rank}/log.txt", get(rank_log_download))
        .route("/job/{name}/cancel", post(cancel))
        .route("/api/state", get(state))
        .route("/events", get(events))
        .route("/metrics", get(prometheus))
        .route("/login", post(login))
        .route(
            "/app.js",
            get(|| async { static_file("text/javascript; charset=utf-8", pages::SCRIPT) }),
        )
        .route(
            "/style.css",
            get(|| async { static_file("text/css; charset=utf-8", pages::STYLE) }),
        )
        .fallback(|| async { (StatusCode::NOT_FOUND, "not found\n") })
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn_with_state(Arc::clone(&shared), guard))
        .with_state(shared);
    with_slots(app, MAX_IN_FLIGHT, MAX_PER_CLIENT)
}

/// Who the request proved to be: a session (by cookie or the dashboard token as bearer),
/// the metrics token, or nobody.
fn credential(shared: &Shared, headers: &HeaderMap) -> Credential {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "));
    if let Some(token) = bearer {
        if shared.sessions.is_token(token) {
            return Credential::Session { csrf_ok: true };
        }
        if shared.sessions.is_metrics_token(token) {
            return Credential::Metrics;
        }
    }
    let Some(session) = session_id(headers).and_then(|id| shared.sessions.find(id)) else {
        return Credential::None;
    };
    let csrf = headers
        .get("x-csrf-token")
        .and_then(|value| value.to_str().ok());
    Credential::Session {
        csrf_ok: csrf.is_some_and(|csrf| csrf == session.csrf),
    }
}

/// The session id of the request's cookie.
fn session_id(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .find_map(|pair| pair.trim().strip_prefix(COOKIE)?.strip_prefix('='))
}

/// Answers only what `policy::check` allows, and puts the security headers on every
/// answer.
async fn guard(State(shared): State<Arc<Shared>>, request: Request, next: Next) -> Response {
    let headers = request.headers();
    let text = |name| {
        headers
            .get(name)
            .and_then(|v: &HeaderValue| v.to_str().ok())
    };
    let credential = credential(&shared, headers);
    let wants_page = request.method() == axum::http::Method::GET
        && text(header::ACCEPT).is_some_and(|accept| accept.contains("text/html"));
    let seen = Seen {
        method: request.method(),
        path: request.uri().path(),
        host: text(header::HOST),
        origin: text(header::ORIGIN),
        credential,
    };
    let mut response = match policy::check(&shared.hosts, shared.actions, &seen) {
        Ok(()) => {
            let mut request = request;
            request.extensions_mut().insert(credential);
            next.run(request).await
        }
        Err(policy::Refusal::Unauthenticated) if wants_page => {
            // A page opened without a session: the login shell, which a URL with
            // `#token=...` gets past.
            let depth = request.uri().path().matches('/').count().saturating_sub(1);
            let body = pages::login(&"../".repeat(depth));
            let headers = [(header::CONTENT_TYPE, "text/html; charset=utf-8")];
            (StatusCode::UNAUTHORIZED, headers, body).into_response()
        }
        Err(refusal) => {
            let status = match refusal {
                policy::Refusal::Unauthenticated => StatusCode::UNAUTHORIZED,
                _ => StatusCode::FORBIDDEN,
            };
            (status, format!("{refusal}\n")).into_response()
        }
    };
    let headers = response.headers_mut();
    for (name, value) in [
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'self'; frame-ancestors 'none'",
        ),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::CACHE_CONTROL, "no-store"),
        (header::X_FRAME_OPTIONS, "DENY"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

fn static_file(content_type: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, content_type)], body).into_response()
}

fn html(body: String) -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], body).into_response()
}

/// Which page of the overview's jobs to show (`?page=N`, from 0).
#[derive(Debug, Default, serde::Deserialize)]
struct PageQuery {
    page: Option<usize>,
}

/// `/`: the overview with a session, else the login shell.
async fn index(
    State(shared): State<Arc<Shared>>,
    axum::Extension(credential): axum::Extension<Credential>,
    Query(query): Query<PageQuery>,
) -> Response {
    if !matches!(credential, Credential::Session { .. }) {
        return html(pages::login(""));
    }
    let page = query.page.unwrap_or(0);
    match shared.snapshots.get().await {
        Ok(snapshot) => html(pages::overview(&snapshot, page)),
        Err(error) => unavailable(&error),
    }
}

async fn job_page(
    State(shared): State<Arc<Shared>>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Response {
    // With actions on, the page carries its session's CSRF token for the cancel button.
    let csrf = session_id(&headers)
        .and_then(|id| shared.sessions.find(id))
        .filter(|_| shared.actions)
        .map(|session| session.csrf);
    match shared.snapshots.get().await {
        Ok(snapshot) => match pages::job(&snapshot, &name, csrf.as_deref()) {
            Some(page) => html(page),
            None => (StatusCode::NOT_FOUND, "no such job\n").into_response(),
        },
        Err(error) => unavailable(&error),
    }
}

async fn chart(State(shared): State<Arc<Shared>>, Path(name): Path<String>) -> Response {
    match shared.charts.svg(&name).await {
        Ok(Some(svg)) => (
            [(header::CONTENT_TYPE, "image/svg+xml")],
            svg.as_str().to_owned(),
        )
            .into_response(),
        Ok(None) => (StatusCode::NOT_FOUND, "no such job\n").into_response(),
        Err(error) => unavailable(&error),
    }
}

/// `job/NAME/log`: the job's last lines, or the lines that hold `?q=`.
async fn log_page(
    State(shared): State<Arc<Shared>>,
    Path(name): Path<String>,
    Query(query): Query<logs::LogQuery>,
) -> Response {
    match logs::view(&shared.client, &name, &query).await {
        Ok(Some(view)) => html(pages::log(&name, &view)),
        Ok(None) => (StatusCode::NOT_FOUND, "no such job\n").into_response(),
        Err(error) => unavailable(&error),
    }
}

/// `job/NAME/rank/N/log`: rank N's newest output lines, or those that hold `?q=`, for a
/// rank the job lists now; of its attempt K with `?attempt=K`.
async fn rank_log_page(
    State(shared): State<Arc<Shared>>,
    Path((name, rank)): Path<(String, String)>,
    Query(query): Query<logs::RankLogQuery>,
) -> Response {
    match listed_rank_output(&shared, &name, &rank, &query).await {
        Ok((output, asked)) => html(pages::rank_log(&name, &output, query.text(), asked)),
        Err(refused) => refused,
    }
}

/// `job/NAME/rank/N/log.txt`: the lines rank N's node keeps (of attempt K with
/// `?attempt=K`), as a file to save.
async fn rank_log_download(
    State(shared): State<Arc<Shared>>,
    Path((name, rank)): Path<(String, String)>,
    Query(query): Query<logs::RankLogQuery>,
) -> Response {
    let (output, asked) = match listed_rank_output(&shared, &name, &rank, &query).await {
        Ok(found) => found,
        Err(refused) => return refused,
    };
    if !output.own_process {
        // Not an empty file: its lines are in another process's log.
        return (
            StatusCode::NOT_FOUND,
            format!(
                "rank {}'s trainer runs in node {}'s daemon process: its lines are in that \
                 daemon's log\n",
                output.rank, output.node
            ),
        )
            .into_response();
    }
    let disposition = format!(
        "attachment; filename=\"{}\"",
        logs::rank_file_name(&name, output.rank, asked)
    );
    let Ok(disposition) = HeaderValue::from_str(&disposition) else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; charset=utf-8"),
            ),
            (header::CONTENT_DISPOSITION, disposition),
        ],
        logs::rank_file(&output),
    )
        .into_response()
}

/// The output of the job `name`'s rank that the path's `rank` names, when the snapshot
/// lists the job with that rank, of the attempt `query` asks for (when the coordinator's
/// table has it), with that attempt; else the answer to send.
async fn listed_rank_output(
    shared: &Shared,
    name: &str,
    rank: &str,
    query: &logs::RankLogQuery,
) -> Result<(actors::job::RankOutputReply, Option<u32>), Response> {
    let not_found = |what: &'static str| (StatusCode::NOT_FOUND, what).into_response();
    let Ok(attempt) = query.attempt() else {
        return Err(not_found("no such attempt (a number from 0)\n"));
    };
    let snapshot = shared.snapshots.get().await.map_err(|e| unavailable(&e))?;
    let Some(rank) = logs::listed_rank(&snapshot, name, rank) else {
        return Err(not_found("no such job or rank\n"));
    };
    match logs::rank_output(&shared.client, name, rank, attempt).await {
        Ok(logs::RankLog::Lines(output)) => Ok((output, attempt)),
        Ok(logs::RankLog::NoSuchJob) => Err(not_found("no such job\n")),
        Ok(logs::RankLog::NoSuchAttempt) => Err(not_found("no such attempt of that rank\n")),
        Err(error) => Err(unavailable(&error)),
    }
}

/// `job/NAME/log.txt`: the job's whole log, as a file to save.
async fn log_download(State(shared): State<Arc<Shared>>, Path(name): Path<String>) -> Response {
    match shared.downloads.start(&shared.client, &name).await {
        Ok(Ok(body)) => {
            let disposition = format!("attachment; filename=\"{}\"", logs::file_name(&name));
            let Ok(disposition) = HeaderValue::from_str(&disposition) else {
                return StatusCode::INTERNAL_SERVER_ERROR.into_response();
            };
            (
                [
                    (
                        header::CONTENT_TYPE,
                        HeaderValue::from_static("text/plain; charset=utf-8"),
                    ),
                    (header::CONTENT_DISPOSITION, disposition),
                ],
                body,
            )
                .into_response()
        }
        Ok(Err(logs::Refused::NoSuchJob)) => {
            (StatusCode::NOT_FOUND, "no such job\n").into_response()
        }
        Ok(Err(logs::Refused::Busy)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("already {} downloads of logs\n", logs::MAX_DOWNLOADS),
        )
            .into_response(),
        Err(error) => unavailable(&error),
    }
}

/// `job/NAME/cancel` (with `--dashboard-actions`, which the policy checked): asks the
/// job to stop after its step in flight with a checkpoint, as `imgrun cancel` does; the
/// finished job stays listed until `imgrun cancel` removes it.
async fn cancel(State(shared): State<Arc<Shared>>, Path(name): Path<String>) -> Response {
    let actor = match actors::job::coordinator(&shared.client, &name).await {
        Ok(Some(actor)) => actor,
        Ok(None) => return (StatusCode::NOT_FOUND, "no such job\n").into_response(),
        Err(error) => return unavailable(&anyhow::Error::new(error).context("asking the head")),
    };
    let request = actors::job::CancelRequest::default();
    match actors::job::call_coordinator(&actor, &request, actors::job::COORDINATOR_CALL_TIMEOUT)
        .await
    {
        Ok(status) => {
            tracing::info!(job = %name, "job cancelled from the dashboard");
            (
                [(header::CONTENT_TYPE, "application/json")],
                serde_json::to_vec(&status).unwrap_or_default(),
            )
                .into_response()
        }
        Err(error) => unavailable(&anyhow::Error::new(error)),
    }
}

/// `events`: a change event each time what the pages show changes.
async fn events(State(shared): State<Arc<Shared>>) -> Response {
    let look_shared = Arc::clone(&shared);
    let look = move || {
        let shared = Arc::clone(&look_shared);
        async move { shared.snapshots.version().await.ok() }
    };
    match shared.streams.open(look) {
        Some(body) => ([(header::CONTENT_TYPE, "text/event-stream")], body).into_response(),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("already {} pages follow the cluster\n", events::MAX_STREAMS),
        )
            .into_response(),
    }
}

async fn state(State(shared): State<Arc<Shared>>) -> Response {
    let snapshot = match shared.snapshots.get().await {
        Ok(snapshot) => snapshot,
        Err(error) => return unavailable(&error),
    };
    match serde_json::to_vec(&*snapshot) {
        Ok(json) if json.len() <= MAX_STATE_BYTES => {
            ([(header::CONTENT_TYPE, "application/json")], json).into_response()
        }
        Ok(json) => (
            StatusCode::INSUFFICIENT_STORAGE,
            format!(
                "the state is {} bytes, over the dashboard's cap of {MAX_STATE_BYTES}\n",
                json.len()
            ),
        )
            .into_response(),
        Err(error) => unavailable(&anyhow::Error::new(error)),
    }
}

async fn prometheus(State(shared): State<Arc<Shared>>) -> Response {
    match shared.snapshots.get().await {
        Ok(snapshot) => (
            [(header::CONTENT_TYPE, metrics::CONTENT_TYPE)],
            metrics::render(&snapshot),
        )
            .into_response(),
        Err(error) => unavailable(&error),
    }
}

/// `login`: the dashboard's token (the body) for a session cookie.
async fn login(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let token = std::str::from_utf8(&body).unwrap_or("").trim();
    if !shared.sessions.is_token(token) {
        return (StatusCode::UNAUTHORIZED, "wrong token\n").into_response();
    }
    let session = shared.sessions.open();
    let cookie = format!("{COOKIE}={}; HttpOnly; SameSite=Strict; Path=/", session.id);
    let Ok(cookie) = HeaderValue::from_str(&cookie) else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    (
        [(header::SET_COOKIE, cookie)],
        serde_json::json!({ "csrf": session.csrf }).to_string(),
    )
        .into_response()
}

fn unavailable(error: &anyhow::Error) -> Response {
    tracing::warn!(error = %format!("{error:#}"), "the dashboard cannot read the cluster's state");
    (
        StatusCode::SERVICE_UNAVAILABLE,
        format!("cannot read the cluster's state: {error:#}\n"),
    )
        .into_response()
}

/// The newest snapshot, taken again once it is older than [`SNAPSHOT_MAX_AGE`]; requests
/// that arrive while one is taken wait for it rather than take their own. Its version
/// (what the change events compare) is worked out once, for every open stream.
struct Snapshots {
    client: ClusterClient,
    newest: tokio::sync::Mutex<Option<Taken>>,
    /// Finished jobs, asked of their coordinators (or the job archive) once, and the
    /// handles of the actors asked.
    cache: actors::job::SnapshotCache,
}

/// A snapshot, when it was taken, and its version once a stream asked.
#[derive(Clone)]
struct Taken {
    at: Instant,
    snapshot: Arc<ClusterSnapshot>,
    version: Arc<std::sync::OnceLock<u64>>,
}

impl Snapshots {
    fn new(client: ClusterClient) -> Self {
        Snapshots {
            client,
            newest: tokio::sync::Mutex::new(None),
            cache: actors::job::SnapshotCache::default(),
        }
    }

    async fn get(&self) -> anyhow::Result<Arc<ClusterSnapshot>> {
        Ok(self.taken().await?.snapshot)
    }

    /// The newest snapshot's [`events::version`].
    async fn version(&self) -> anyhow::Result<u64> {
        let taken = self.taken().await?;
        Ok(*taken
            .version
            .get_or_init(|| events::version(&taken.snapshot)))
    }

    async fn taken(&self) -> anyhow::Result<Taken> {
        let mut newest = self.newest.lock().await;
        if let Some(taken) = &*newest
            && taken.at.elapsed() < SNAPSHOT_MAX_AGE
        {
            return Ok(taken.clone());
        }
        let snapshot = Arc::new(
            actors::job::snapshot_keeping(&self.client, &self.cache)
                .await
                .context("asking the head")?,
        );
        let taken = Taken {
            at: Instant::now(),
            snapshot,
            version: Arc::default(),
        };
        *newest = Some(taken.clone());
        Ok(taken)
    }
}
