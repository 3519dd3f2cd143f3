//! End-to-end tests of the head's dashboard (`imgrun start --head` serves it on loopback):
//! a real head and node, a real detached job, and requests over real sockets. The
//! dashboard, `imgrun status --json`, `imgrun jobs --json` and `/metrics` (read by the
//! parser of PyPI `prometheus-client`) must agree on the running job; a request without
//! the token, with another `Host`, from another origin or naming a path is refused.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::common::skip::skip_or_fail;
use crate::common::train::{JOB_LIMIT, TrainCluster, metrics};
use crate::common::{Machine, describe, tools_python, wait_for};

/// The dashboard's record in the head's state folder.
struct Dashboard {
    addr: SocketAddr,
    token: String,
    metrics_token: String,
}

fn dashboard(head: &Machine) -> Dashboard {
    let path = head.state.join("dashboard.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let record: Value = serde_json::from_str(&text).expect("dashboard.json");
    let url = record["url"].as_str().expect("url");
    let addr = url
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .parse()
        .expect("the dashboard's address");
    Dashboard {
        addr,
        token: record["token"].as_str().expect("token").to_owned(),
        metrics_token: record["metrics_token"]
            .as_str()
            .expect("metrics_token")
            .to_owned(),
    }
}

/// An answer: status, headers (lower-case names), body.
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// One request on a fresh connection; `headers` go after `Host`.
fn request(
    to: SocketAddr,
    method: &str,
    path: &str,
    host: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Answer {
    try_request(to, method, path, host, headers, body)
        .unwrap_or_else(|e| panic!("{method} {path} of {to}: {e}"))
}

/// [`request`], or why there was no answer.
fn try_request(
    to: SocketAddr,
    method: &str,
    path: &str,
    host: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> std::io::Result<Answer> {
    let mut stream = TcpStream::connect_timeout(&to, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    stream.write_all(head.as_bytes())?;
    let mut bytes = Vec::new();
    stream.read_to_end(&mut bytes)?;
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let bad = || std::io::Error::other(format!("not an HTTP answer: {text}"));
    let (top, body) = text.split_once("\r\n\r\n").ok_or_else(bad)?;
    let mut lines = top.lines();
    let status = lines
        .next()
        .and_then(|line| line.split(' ').nth(1))
        .and_then(|code| code.parse().ok())
        .ok_or_else(bad)?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked {
        unchunk(body).ok_or_else(bad)?
    } else {
        body.to_owned()
    };
    Ok(Answer {
        status,
        headers,
        body,
    })
}

/// A chunked body's data.
fn unchunk(mut rest: &str) -> Option<String> {
    let mut data = String::new();
    loop {
        let (size, after) = rest.split_once("\r\n")?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(data);
        }
        data.push_str(after.get(..size)?);
        rest = after.get(size + 2..)?;
    }
}

/// `GET path` with a right `Host` and a bearer token.
fn get(dash: &Dashboard, path: &str, token: &str) -> Answer {
    let host = dash.addr.to_string();
    let bearer = format!("Bearer {token}");
    request(
        dash.addr,
        "GET",
        path,
        &host,
        &[("Authorization", &bearer)],
        "",
    )
}

/// `/metrics` through PyPI `prometheus-client`'s OpenMetrics parser: (name, labels, value).
fn parse_metrics(python: &std::path::Path, text: &str) -> Vec<(String, Value, f64)> {
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/metrics_check.py");
    let mut child = Command::new(python)
        .arg(&script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run python");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write the metrics");
    let out = child.wait_with_output().expect("python");
    assert!(
        out.status.success(),
        "metrics_check.py: {}\n{text}",
        describe(&out)
    );
    let samples: Vec<Value> = serde_json::from_slice(&out.stdout).expect("json");
    samples
        .into_iter()
        .map(|s| {
            (
                s[0].as_str().expect("name").to_owned(),
                s[1].clone(),
                s[2].as_f64().expect("value"),
            )
        })
        .collect()
}

/// (job, rank, node) of every rank in a snapshot's `jobs` (as `status --json` and
/// `api/state` print them, and `jobs --json` lists them).
fn ranks_of(jobs: &Value) -> BTreeSet<(String, u64, u64)> {
    let mut ranks = BTreeSet::new();
    for job in jobs.as_array().expect("jobs") {
        for rank in job["ranks"].as_array().expect("ranks") {
            ranks.insert((
                job["name"].as_str().expect("name").to_owned(),
                rank["rank"].as_u64().expect("rank"),
                rank["node"].as_u64().expect("node"),
            ));
        }
    }
    ranks
}

fn job_states(jobs: &Value) -> BTreeSet<(String, String)> {
    jobs.as_array()
        .expect("jobs")
        .iter()
        .map(|job| {
            (
                job["name"].as_str().expect("name").to_owned(),
                job["job"]["state"].as_str().expect("state").to_owned(),
            )
        })
        .collect()
}

fn node_ids(status: &Value) -> BTreeSet<u64> {
    status["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .map(|n| n["id"].as_u64().expect("id"))
        .collect()
}

/// A running job as the dashboard's state, its pages, `imgrun status --json`, `imgrun
/// jobs --json` and `/metrics` show it: the same job, state, ranks and nodes everywhere;
/// and every request the dashboard must refuse is refused.
#[test]
fn the_dashboard_status_jobs_and_metrics_agree_on_a_running_job() {
    let cluster = TrainCluster::start_head_with(&["--dashboard-actions"]);
    let mut args = cluster.data.args(&cluster.runs, "watched", 200);
    args.push("--detach".to_string());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    cluster.head.run_ok(&args);
    let steps = || {
        metrics(&cluster.runs.join("watched"))
            .iter()
            .filter(|r| r["kind"] == "step")
            .count()
    };
    wait_for(JOB_LIMIT, "steps of the watched job", || {
        (steps() >= 2).then_some(())
    });
    let dash = dashboard(&cluster.head);
    refusals(&dash);
    let session = pages(&dash);
    log_pages(&dash, &session, &cluster.runs.join("watched"));
    rank_logs(&dash, &session, &cluster);
    // The terminal's view of the same: drawn twice, each with the job and its two ranks.
    let watched = cluster
        .head
        .run_ok(&["status", "--watch", "--every", "0.2", "--times", "2"]);
    assert_eq!(
        watched.matches("(every 0.2 s; Ctrl-C ends)").count(),
        2,
        "{watched}"
    );
    assert_eq!(watched.matches("\nwatched:").count(), 2, "{watched}");
    assert!(
        watched.contains("RANK") && watched.contains("running"),
        "{watched}"
    );
    let Some(python) = tools_python("tools/pytools.sh") else {
        return;
    };
    in_chromium(&dash, &python);
    // The chart follows the job: drawn again once more steps are in its metrics.
    let before = chart(&dash, &session);
    let seen = steps();
    wait_for(JOB_LIMIT, "more steps of the watched job", || {
        (steps() >= seen + 2).then_some(())
    });
    wait_for(Duration::from_secs(10), "the chart drawn again", || {
        (chart(&dash, &session) != before).then_some(())
    });

    let state: Value = serde_json::from_str(&get(&dash, "/api/state", &dash.token).body)
        .expect("api/state is JSON");
    let status = cluster.head.status();
    let listed: Value =
        serde_json::from_str(&cluster.head.run_ok(&["jobs", "--json"])).expect("jobs --json");
    let answer = get(&dash, "/metrics", &dash.metrics_token);
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(
        answer.header("content-type"),
        Some("application/openmetrics-text; version=1.0.0; charset=utf-8")
    );
    let samples = parse_metrics(&python, &answer.body);

    let running = BTreeSet::from([("watched".to_owned(), "running".to_owned())]);
    assert_eq!(job_states(&state["jobs"]), running, "api/state");
    assert_eq!(job_states(&status["jobs"]), running, "status --json");
    assert_eq!(job_states(&listed), running, "jobs --json");
    let scraped: BTreeSet<(String, String)> = samples
        .iter()
        .filter(|(name, _, value)| name == "imgrun_job_state" && *value == 1.0)
        .map(|(_, labels, _)| {
            (
                labels["imgrun_job"]
                    .as_str()
                    .expect("imgrun_job")
                    .to_owned(),
                labels["state"].as_str().expect("state").to_owned(),
            )
        })
        .collect();
    assert_eq!(scraped, running, "/metrics");
    for name in [
        "imgrun_learning_rate",
        "imgrun_step_seconds",
        "imgrun_images_per_second",
    ] {
        assert!(
            samples.iter().any(|(n, labels, value)| n == name
                && labels["imgrun_job"] == "watched"
                && value.is_finite()
                && *value > 0.0),
            "no {name} of the job in /metrics"
        );
    }

    let ranks = ranks_of(&state["jobs"]);
    assert_eq!(ranks.len(), 2, "two ranks: {ranks:?}");
    assert_eq!(ranks_of(&status["jobs"]), ranks, "status --json");
    assert_eq!(ranks_of(&listed), ranks, "jobs --json");
    let label =
        |labels: &Value, key: &str| -> u64 { labels[key].as_str().expect(key).parse().expect(key) };
    let scraped: BTreeSet<(String, u64, u64)> = samples
        .iter()
        .filter(|(name, _, _)| name == "imgrun_step_total")
        .map(|(_, labels, _)| {
            (
                labels["imgrun_job"]
                    .as_str()
                    .expect("imgrun_job")
                    .to_owned(),
                label(labels, "rank"),
                label(labels, "node"),
            )
        })
        .collect();
    assert_eq!(scraped, ranks, "/metrics");
    assert!(
        samples
            .iter()
            .filter(|(name, _, _)| name == "imgrun_step_total")
            .all(|(_, _, step)| *step >= 1.0),
        "every rank has taken steps"
    );

    // Every rank's running totals, in the state and in /metrics.
    let rank_numbers: BTreeSet<u64> = ranks.iter().map(|(_, rank, _)| *rank).collect();
    let tallied: BTreeSet<u64> = state["jobs"][0]["job"]["rank_totals"]
        .as_array()
        .expect("rank_totals")
        .iter()
        .map(|t| t["rank"].as_u64().expect("rank"))
        .collect();
    assert_eq!(tallied, rank_numbers, "api/state's rank_totals");
    // The job's timeline begins with its ring of two ranks.
    let timeline = &state["jobs"][0]["job"]["timeline"][0];
    assert_eq!(
        (timeline["kind"].as_str(), timeline["world"].as_u64()),
        (Some("started"), Some(2)),
        "api/state's timeline: {timeline}"
    );
    for name in [
        "imgrun_data_wait_seconds_total",
        "imgrun_allreduce_seconds_total",
        "imgrun_last_step_timestamp_seconds",
        "imgrun_rank_step_p95_seconds",
        "imgrun_loader_samples_total",
        "imgrun_loader_batches_total",
        "imgrun_shards_opened_total",
    ] {
        let scraped: BTreeSet<u64> = samples
            .iter()
            .filter(|(n, labels, value)| {
                n == name && labels["imgrun_job"] == "watched" && *value > 0.0
            })
            .map(|(_, labels, _)| label(labels, "rank"))
            .collect();
        assert_eq!(scraped, rank_numbers, "{name} in /metrics");
    }
    let nodes = node_ids(&state);
    assert_eq!(nodes.len(), 2);
    assert_eq!(node_ids(&status), nodes, "status --json");
    let scraped: BTreeSet<u64> = samples
        .iter()
        .filter(|(name, _, value)| name == "imgrun_node_up" && *value == 1.0)
        .map(|(_, labels, _)| label(labels, "node"))
        .collect();
    assert_eq!(scraped, nodes, "/metrics");

    prometheus_scrapes(&dash, &ranks, cluster.root.path());
    cancel_from_the_page(&dash, &session, &cluster);
    reports(&cluster);
    let out = cluster.head.run(&["cancel", "watched"]);
    assert!(out.status.success(), "{}", describe(&out));
    let log = std::fs::read_to_string(cluster.runs.join("watched/job.log")).expect("job.log");
    let tail: Vec<&str> = log.lines().rev().take(4).collect();
    assert!(
        tail.iter().any(|line| line.contains(" job cancelled: ")),
        "the log ends with how: {tail:?}"
    );
    cluster.assert_settled();
}

/// Each rank's own log: the newest lines its trainer's process wrote, kept by its node,
/// on the page the ranks table links to and from `imgrun logs --rank`; its search shows
/// the lines that hold a text and how many, its `log.txt` downloads them; a rank the job
/// does not list has no page and no download.
fn rank_logs(dash: &Dashboard, session: &str, cluster: &TrainCluster) {
    let job = browse(dash, "/job/watched", session);
    assert!(
        job.body.contains("href=\"watched/rank/1/log\""),
        "{}",
        job.body
    );
    // The lines of a page's `<pre class=log>`, as escaped.
    let shown_lines = |page: &str| -> Vec<String> {
        page.split_once("<pre class=log>")
            .and_then(|(_, rest)| rest.split_once("</pre>"))
            .map(|(shown, _)| shown.lines().map(String::from).collect())
            .unwrap_or_default()
    };
    for rank in [0, 1] {
        let ready = format!("trainer ready rank={rank} world=2");
        let page = browse(dash, &format!("/job/watched/rank/{rank}/log"), session);
        assert_eq!(page.status, 200, "rank {rank}: {}", page.body);
        assert!(page.body.contains(&ready), "rank {rank}: {}", page.body);
        assert!(
            page.body.contains("<input name=q") && page.body.contains("href=\"log.txt\""),
            "rank {rank}: the search box and the download: {}",
            page.body
        );
        let found = browse(
            dash,
            &format!("/job/watched/rank/{rank}/log?q=trainer+ready"),
            session,
        );
        assert_eq!(found.status, 200, "rank {rank}: {}", found.body);
        let shown = shown_lines(&found.body);
        assert!(
            shown.iter().any(|line| line.contains(&ready)),
            "rank {rank}: {}",
            found.body
        );
        assert!(
            shown.iter().all(|line| line.contains("trainer ready")),
            "rank {rank}: only matches: {shown:?}"
        );
        let counted = format!("{} lines hold <code>trainer ready</code>", shown.len());
        assert!(found.body.contains(&counted), "rank {rank}: {}", found.body);
        let absent = browse(
            dash,
            &format!("/job/watched/rank/{rank}/log?q=no+such+text+here"),
            session,
        );
        assert_eq!(absent.status, 200, "rank {rank}: {}", absent.body);
        assert!(
            absent
                .body
                .contains("0 lines hold <code>no such text here</code>")
                && shown_lines(&absent.body).is_empty(),
            "rank {rank}: {}",
            absent.body
        );
        let download = browse(dash, &format!("/job/watched/rank/{rank}/log.txt"), session);
        assert_eq!(download.status, 200, "rank {rank}: {}", download.body);
        assert_eq!(
            download.header("content-disposition"),
            Some(format!("attachment; filename=\"watched-rank-{rank}.log\"").as_str())
        );
        assert_eq!(
            download.header("content-type"),
            Some("text/plain; charset=utf-8")
        );
        assert!(
            download.body.lines().any(|line| line.contains(&ready)),
            "rank {rank}: {}",
            download.body
        );
    }
    assert_query_escaped(dash, "/job/watched/rank/0/log?q=%3Cscript%3E", session);
    for path in [
        "/job/watched/rank/7/log",
        "/job/watched/rank/..%2F0/log",
        "/job/watched/rank/0x/log",
        "/job/elsewhere/rank/0/log",
        "/job/watched/rank/7/log.txt",
        "/job/watched/rank/..%2F0/log.txt",
        "/job/watched/rank/0x/log.txt",
        "/job/elsewhere/rank/0/log.txt",
        // An attempt is a number the coordinator's table has: this job's ranks have had
        // one trainer each.
        "/job/watched/rank/0/log?attempt=1",
        "/job/watched/rank/0/log?attempt=-1",
        "/job/watched/rank/0/log?attempt=..%2F0",
        "/job/watched/rank/0/log.txt?attempt=1",
        "/job/watched/rank/0/log.txt?attempt=x",
    ] {
        let answer = browse(dash, path, session);
        assert_eq!(answer.status, 404, "{path}: {}", answer.body);
    }
    let first = browse(dash, "/job/watched/rank/0/log?attempt=0", session);
    assert_eq!(first.status, 200, "{}", first.body);
    assert!(
        first.body.contains("trainer ready rank=0 world=2")
            && first.body.contains("href=\"log.txt?attempt=0\"")
            && !first.body.contains("log?attempt=1"),
        "attempt 0, the only one: {}",
        first.body
    );
    let saved = browse(dash, "/job/watched/rank/0/log.txt?attempt=0", session);
    assert_eq!(saved.status, 200, "{}", saved.body);
    assert_eq!(
        saved.header("content-disposition"),
        Some("attachment; filename=\"watched-rank-0-attempt-0.log\"")
    );
    // Behind the same guard as every route: no session, no lines.
    let here = dash.addr.to_string();
    let anonymous = request(
        dash.addr,
        "GET",
        "/job/watched/rank/0/log.txt",
        &here,
        &[],
        "",
    );
    assert_eq!(anonymous.status, 401, "{}", anonymous.body);
    assert!(
        !anonymous.body.contains("trainer ready"),
        "{}",
        anonymous.body
    );
    let all = cluster
        .head
        .run_ok(&["logs", "watched", "--rank", "1", "--lines", "1000"]);
    assert!(all.contains("trainer ready rank=1 world=2"), "{all}");
    let newest = cluster
        .head
        .run_ok(&["logs", "watched", "--rank", "1", "--lines", "2"]);
    assert_eq!(newest.lines().count(), 2, "{newest}");
    let missing = cluster.head.run(&["logs", "watched", "--rank", "5"]);
    assert!(!missing.status.success(), "{}", describe(&missing));
    assert!(
        String::from_utf8_lossy(&missing.stderr).contains("no rank 5"),
        "{}",
        describe(&missing)
    );
}

/// `--dashboard-actions`: the job's page has a cancel button carrying its session's CSRF
/// token; a cancel without it is refused, one with it stops the job with a checkpoint.
fn cancel_from_the_page(dash: &Dashboard, session: &str, cluster: &TrainCluster) {
    let page = browse(dash, "/job/watched", session);
    assert!(
        page.body.contains("<h2>Timeline</h2>") && page.body.contains("2 ranks connected"),
        "the job's timeline: {}",
        page.body
    );
    assert!(
        page.body.contains("data-cancel=\"watched/cancel\""),
        "{}",
        page.body
    );
    let csrf = page
        .body
        .split("data-csrf=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .expect("the page's CSRF token");
    let here = dash.addr.to_string();
    let origin = format!("http://{here}");
    let post =
        |path: &str, headers: &[(&str, &str)]| request(dash.addr, "POST", path, &here, headers, "");
    let watched = "/job/watched/cancel";
    let without = post(watched, &[("Cookie", session), ("Origin", &origin)]);
    assert_eq!(without.status, 403, "{}", without.body);
    let cross = post(
        watched,
        &[
            ("Cookie", session),
            ("Origin", "http://evil.example"),
            ("X-CSRF-Token", csrf),
        ],
    );
    assert_eq!(cross.status, 403, "{}", cross.body);
    let none = post(
        "/job/nope/cancel",
        &[
            ("Cookie", session),
            ("Origin", &origin),
            ("X-CSRF-Token", csrf),
        ],
    );
    assert_eq!(none.status, 404, "{}", none.body);
    let asked = post(
        watched,
        &[
            ("Cookie", session),
            ("Origin", &origin),
            ("X-CSRF-Token", csrf),
        ],
    );
    assert_eq!(asked.status, 200, "{}", asked.body);
    wait_for(JOB_LIMIT, "the job cancelled from its page", || {
        let listed: Value = serde_json::from_str(&cluster.head.run_ok(&["jobs", "--json"])).ok()?;
        (job_states(&listed) == BTreeSet::from([("watched".into(), "cancelled".into())]))
            .then_some(())
    });
    // Its timeline ends with the checkpoint the cancel saved, then the end.
    let listed: Value =
        serde_json::from_str(&cluster.head.run_ok(&["jobs", "watched", "--json"])).expect("json");
    let kinds: Vec<&str> = listed["job"]["timeline"]
        .as_array()
        .expect("timeline")
        .iter()
        .map(|t| t["kind"].as_str().expect("kind"))
        .collect();
    assert_eq!(kinds.first(), Some(&"started"), "{listed}");
    assert!(kinds.ends_with(&["checkpoint", "ended"]), "{listed}");
    assert_eq!(
        listed["job"]["timeline"]
            .as_array()
            .and_then(|t| t.last())
            .map(|t| t["state"].clone()),
        Some(Value::from("cancelled")),
        "{listed}"
    );
}

/// `imgrun report`, of the job in the cluster and of its run folder: one page with its
/// charts and the end of its log, that asks for nothing outside itself.
fn reports(cluster: &TrainCluster) {
    let run = cluster.runs.join("watched");
    let from_job = cluster.root.path().join("job.html");
    let from_folder = cluster.root.path().join("folder.html");
    for (what, page) in [
        ("watched".to_owned(), &from_job),
        (run.display().to_string(), &from_folder),
    ] {
        let said = cluster
            .head
            .run_ok(&["report", &what, "-o", &page.display().to_string()]);
        assert!(said.contains("opens without a server"), "{said}");
        let html = std::fs::read_to_string(page).expect("the report");
        for part in [
            "<h1>watched</h1>",
            "<svg",
            "training loss",
            " job cancelled: ",
        ] {
            assert!(html.contains(part), "{what}: no {part:?} in the report");
        }
        for outside in ["src=", "href=", "<script", "<link", "url("] {
            assert!(!html.contains(outside), "{what}: {outside:?} in the report");
        }
    }
    let job = std::fs::read_to_string(&from_job).expect("report");
    assert!(job.contains("cancelled"), "the job's state: {job}");
    let out = cluster.head.run(&["report", "nope", "-o", "x.html"]);
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("nope is neither a run folder here nor a job"),
        "{said}"
    );
}

/// The job's log: its page shows the lines of `run/job.log`, a search finds them and
/// escapes what it shows, the download is the file; no job, no log.
fn log_pages(dash: &Dashboard, session: &str, run: &std::path::Path) {
    let disk = std::fs::read_to_string(run.join("job.log")).expect("the run's job.log");
    let first = disk.lines().next().expect("a line in job.log");
    let page = browse(dash, "/job/watched/log", session);
    assert_eq!(page.status, 200, "{}", page.body);
    assert!(page.body.contains(first), "{first:?} not in {}", page.body);
    let short = browse(dash, "/job/watched/log?lines=1", session);
    assert!(short.body.contains("the last 1 lines"), "{}", short.body);
    // A line of the plan, found by a word of it (its time stamp begins it).
    let word = "run ";
    let found = browse(dash, "/job/watched/log?q=run+", session);
    assert_eq!(found.status, 200, "{}", found.body);
    let wanted: Vec<&str> = disk.lines().filter(|line| line.contains(word)).collect();
    assert!(!wanted.is_empty(), "no {word:?} in {disk}");
    for line in &wanted {
        assert!(
            found.body.contains(line),
            "{line:?} not found: {}",
            found.body
        );
    }
    assert_query_escaped(dash, "/job/watched/log?q=%3Cscript%3E", session);
    let download = browse(dash, "/job/watched/log.txt", session);
    assert_eq!(download.status, 200, "{}", download.body);
    assert_eq!(
        download.header("content-disposition"),
        Some("attachment; filename=\"watched.log\"")
    );
    let disk = std::fs::read_to_string(run.join("job.log")).expect("job.log");
    assert!(
        download.body.len() >= first.len() && disk.starts_with(&download.body),
        "the download is the file as it was: {:?}",
        download.body
    );
    for path in [
        "/job/nope/log",
        "/job/nope/log.txt",
        "/job/..%2Fwatched/log",
    ] {
        let answer = browse(dash, path, session);
        assert_eq!(answer.status, 404, "{path}: {}", answer.body);
    }
}

/// What the dashboard must refuse, asked of the real server.
fn refusals(dash: &Dashboard) {
    let here = dash.addr.to_string();
    let origin = format!("http://{here}");
    let bearer = format!("Bearer {}", dash.token);
    let no_token = request(dash.addr, "GET", "/api/state", &here, &[], "");
    assert_eq!(no_token.status, 401, "{}", no_token.body);
    let metrics = request(dash.addr, "GET", "/metrics", &here, &[], "");
    assert_eq!(metrics.status, 401, "{}", metrics.body);
    // The metrics token reads `/metrics` only.
    let state = get(dash, "/api/state", &dash.metrics_token);
    assert_eq!(state.status, 401, "{}", state.body);
    // DNS rebinding: the right token under another name.
    let rebound = request(
        dash.addr,
        "GET",
        "/api/state",
        "evil.example",
        &[("Authorization", &bearer)],
        "",
    );
    assert_eq!(rebound.status, 403, "{}", rebound.body);
    // A login from another site, even with the right token.
    let cross = request(
        dash.addr,
        "POST",
        "/login",
        &here,
        &[("Origin", "http://evil.example")],
        &dash.token,
    );
    assert_eq!(cross.status, 403, "{}", cross.body);
    let wrong = request(
        dash.addr,
        "POST",
        "/login",
        &here,
        &[("Origin", &origin)],
        "00",
    );
    assert_eq!(wrong.status, 401, "{}", wrong.body);
    // Paths, globs and folders name nothing.
    for path in [
        "/job/..%2F..%2Fetc%2Fpasswd",
        "/job/%2e%2e",
        "/job/*",
        "/job/watched/../../x",
        "/logs/..%2Fx",
        "/job/..%2F..%2Fx/log",
        "/job/%2e%2e/log.txt",
        "/job/watched/log/../../../x",
        "/job/*/log.txt",
        "//etc/passwd",
    ] {
        let answer = get(dash, path, &dash.token);
        assert_eq!(answer.status, 404, "{path}: {}", answer.body);
    }
    assert_eq!(
        no_token.header("content-security-policy"),
        Some("default-src 'self'; frame-ancestors 'none'"),
        "every answer, a refusal too"
    );
    assert_eq!(no_token.header("access-control-allow-origin"), None);
}

/// `GET path` with a right `Host` and the session cookie `session` (`name=value`).
/// A page whose query is `<script>` answers it escaped, never as markup.
fn assert_query_escaped(dash: &Dashboard, path: &str, session: &str) {
    let hostile = browse(dash, path, session);
    assert_eq!(hostile.status, 200, "{}", hostile.body);
    assert!(hostile.body.contains("&lt;script&gt;"), "{}", hostile.body);
    assert!(!hostile.body.contains("<script>"), "{}", hostile.body);
}

fn browse(dash: &Dashboard, path: &str, session: &str) -> Answer {
    let here = dash.addr.to_string();
    request(dash.addr, "GET", path, &here, &[("Cookie", session)], "")
}

/// The job's chart, fetched with the session cookie `session`.
fn chart(dash: &Dashboard, session: &str) -> String {
    let answer = browse(dash, "/job/watched/chart.svg", session);
    assert_eq!(answer.status, 200, "{}", answer.body);
    answer.body
}

/// The job's page opened in headless Chromium (Debian's package, driven through its
/// DevTools protocol by `tests/python/browser_check.py`) with the token in the URL, as a
/// user opens the line the head printed: the page logs in by itself, shows both ranks
/// and the chart, and follows the job in place (the server's change events), not by
/// reloading.
fn in_chromium(dash: &Dashboard, python: &std::path::Path) {
    if Command::new("chromium").arg("--version").output().is_err() {
        skip_or_fail("no `chromium` (Debian's package; tools/test.sh installs it as root)");
        return;
    }
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/browser_check.py");
    let url = format!("http://{}/job/watched#token={}", dash.addr, dash.token);
    let mut browser = Command::new(python)
        .arg(&script)
        .args([url.as_str(), "4", "4"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run browser_check.py");
    wait_for(Duration::from_secs(90), "browser_check.py", || {
        browser.try_wait().expect("browser_check.py")
    });
    let out = browser.wait_with_output().expect("browser_check.py");
    assert!(out.status.success(), "browser_check.py: {}", describe(&out));
    let seen: Value = serde_json::from_slice(&out.stdout).expect("json");
    let first = seen["first"].as_str().expect("first");
    let second = seen["second"].as_str().expect("second");
    for text in [first, second] {
        let ranks = text
            .split("Ranks")
            .nth(1)
            .unwrap_or_else(|| panic!("no ranks in:\n{text}"));
        let rows: Vec<&str> = ranks
            .lines()
            .filter(|line| line.starts_with("0\t") || line.starts_with("1\t"))
            .collect();
        assert_eq!(rows.len(), 2, "a row per rank:\n{text}");
    }
    assert_ne!(first, second, "the page follows the job");
    assert_eq!(
        seen["same_document"], true,
        "updated in place, not reloaded: {seen}"
    );
    assert!(
        seen["chart_width"].as_u64().is_some_and(|w| w > 0),
        "the chart is shown: {seen}"
    );
}

/// The page trades the token for a session cookie that opens the pages; the cookie.
fn pages(dash: &Dashboard) -> String {
    let here = dash.addr.to_string();
    let origin = format!("http://{here}");
    let shell = request(dash.addr, "GET", "/", &here, &[], "");
    assert_eq!(shell.status, 200);
    assert!(shell.body.contains("app.js"), "{}", shell.body);
    assert!(!shell.body.contains("watched"), "no data without a session");
    let login = request(
        dash.addr,
        "POST",
        "/login",
        &here,
        &[("Origin", &origin)],
        &dash.token,
    );
    assert_eq!(login.status, 200, "{}", login.body);
    let cookie = login.header("set-cookie").expect("a session cookie");
    for attribute in ["HttpOnly", "SameSite=Strict"] {
        assert!(cookie.contains(attribute), "{cookie}");
    }
    let session = cookie.split(';').next().expect("name=value");
    let overview = browse(dash, "/", session);
    assert_eq!(overview.status, 200);
    assert!(
        overview.body.contains("href=\"job/watched\""),
        "{}",
        overview.body
    );
    // A page past the last of the job list is its last: here, the one job.
    let paged = browse(dash, "/?page=7", session);
    assert_eq!(paged.status, 200, "{}", paged.body);
    assert!(
        paged.body.contains("href=\"job/watched\""),
        "{}",
        paged.body
    );
    let job = browse(dash, "/job/watched", session);
    assert_eq!(job.status, 200, "{}", job.body);
    assert!(job.body.contains("<h2>Ranks</h2>"), "{}", job.body);
    assert!(
        job.body.contains("src=\"watched/chart.svg\""),
        "{}",
        job.body
    );
    // The charts, drawn on the server from the job's metrics.
    let chart = browse(dash, "/job/watched/chart.svg", session);
    assert_eq!(chart.status, 200, "{}", chart.body);
    assert_eq!(chart.header("content-type"), Some("image/svg+xml"));
    assert!(
        chart.body.starts_with("<svg"),
        "{}",
        &chart.body[..chart.body.len().min(300)]
    );
    for caption in ["training loss", "throughput", "learning rate"] {
        assert!(chart.body.contains(caption), "`{caption}` not in the chart");
    }
    let none = browse(dash, "/job/nope/chart.svg", session);
    assert_eq!(none.status, 404, "{}", none.body);
    assert!(
        !job.body.contains("http://") && !job.body.contains("https://"),
        "nothing from another host: {}",
        job.body
    );
    // A page opened without a session is the login shell, which gets past it with the
    // token of its URL.
    let shell = request(
        dash.addr,
        "GET",
        "/job/watched",
        &here,
        &[("Accept", "text/html")],
        "",
    );
    assert_eq!(shell.status, 401);
    assert!(shell.body.contains("src=\"../app.js\""), "{}", shell.body);
    assert!(!shell.body.contains("Ranks"), "{}", shell.body);
    session.to_owned()
}

/// Debian's `prometheus` scrapes `/metrics` with the metrics token, and its query API
/// answers `imgrun_step_total` for every rank.
fn prometheus_scrapes(
    dash: &Dashboard,
    ranks: &BTreeSet<(String, u64, u64)>,
    root: &std::path::Path,
) {
    if Command::new("prometheus")
        .arg("--version")
        .output()
        .is_err()
    {
        skip_or_fail("no `prometheus` (Debian's package; tools/test.sh installs it as root)");
        return;
    }
    let dir = root.join("prometheus");
    std::fs::create_dir_all(&dir).expect("prometheus folder");
    let token_file = dir.join("token");
    std::fs::write(&token_file, &dash.metrics_token).expect("token file");
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n  - job_name: imgrun\n    \
             authorization:\n      credentials_file: {}\n    static_configs:\n      - targets: ['{}']\n",
            token_file.display(),
            dash.addr
        ),
    )
    .expect("prometheus.yml");
    let web = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port for prometheus");
    let mut server = Command::new("prometheus")
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address={web}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("log")).expect("log"))
        .spawn()
        .expect("start prometheus");
    let query = |path: &str| -> Option<Value> {
        let answer = try_request(web, "GET", path, "localhost", &[], "").ok()?;
        (answer.status == 200).then(|| serde_json::from_str(&answer.body).ok())?
    };
    let found = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        wait_for(
            Duration::from_secs(60),
            "prometheus scraping imgrun_step_total",
            || {
                let answer = query("/api/v1/query?query=imgrun_step_total")?;
                let series: BTreeSet<(String, u64, u64)> = answer["data"]["result"]
                    .as_array()?
                    .iter()
                    .filter_map(|r| {
                        let m = &r["metric"];
                        Some((
                            m["imgrun_job"].as_str()?.to_owned(),
                            m["rank"].as_str()?.parse().ok()?,
                            m["node"].as_str()?.parse().ok()?,
                        ))
                    })
                    .collect();
                (series == *ranks).then_some(series)
            },
        )
    }));
    let _ = server.kill();
    let _ = server.wait();
    if found.is_err() {
        let targets = query("/api/v1/targets");
        let log = std::fs::read_to_string(dir.join("log")).unwrap_or_default();
        panic!("prometheus did not scrape the ranks; targets: {targets:?}\n{log}");
    }
}
