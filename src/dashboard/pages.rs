//! The dashboard's pages, drawn on the server from a [`ClusterSnapshot`]: the overview
//! (nodes, GPUs, CPUs, jobs) and one job's page (its status and every rank's phase).
//! Every URL is relative, so the pages work behind `ssh -L`, `kubectl port-forward` or a
//! proxy under a sub-path; every outside string is escaped; nothing is fetched from
//! another host. A page follows the server's change events (`events.rs`) and fetches
//! itself again at each.

use std::fmt::Write;
use std::sync::Arc;

use actors::job::{ClusterSnapshot, JobSnapshot, Jobs, Moment, RankOutputReply};

use super::logs::{LogView, lines_holding};

/// The page shown without a session, `up` below the dashboard's root (`""` or
/// `"../"`): its script trades the token of the URL's fragment for a session cookie and
/// reloads, so any page's URL with `#token=...` opens it.
pub(super) fn login(up: &str) -> String {
    format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>imgrun</title>\n\
         <link rel=\"stylesheet\" href=\"{up}style.css\"><script src=\"{up}app.js\" defer></script>\
         </head>\n<body><h1>imgrun</h1><p id=\"say\">Open the dashboard URL that <code>imgrun \
         start --head</code> printed: it carries the token (<code>#token=...</code>). The head's \
         state folder keeps it in <code>dashboard.json</code>.</p></body></html>\n"
    )
}

/// The pages' script. With `#token=...` in the URL: the token to a session cookie, then
/// the page again without the token in the address bar or the history. On a page with
/// `data-events`: follows the server's change events and fetches the page again at each,
/// the chart at most every 5 s.
pub(super) const SCRIPT: &str = r#"const here = document.currentScript ? document.currentScript.src : location.href;
const m = location.hash.match(/token=([0-9a-f]+)/);
if (m) {
  history.replaceState(null, "", location.pathname + location.search);
  fetch(new URL("login", here), { method: "POST", body: m[1], credentials: "same-origin" }).then((r) => {
    if (r.ok) location.reload();
    else document.getElementById("say").textContent = "The token was refused: open the URL the head printed last.";
  });
}
// The cancel button (with --dashboard-actions): asked once, sent with the session's
// CSRF token.
document.addEventListener("click", (e) => {
  const b = e.target.closest && e.target.closest("button[data-cancel]");
  if (!b || !confirm("Cancel this job? It stops after its step in flight, with a checkpoint.")) return;
  b.disabled = true;
  fetch(new URL(b.dataset.cancel, location.href), {
    method: "POST",
    credentials: "same-origin",
    headers: { "X-CSRF-Token": b.dataset.csrf },
  }).then((r) => { b.textContent = r.ok ? "cancelling…" : "refused (" + r.status + ")"; });
});
const live = document.body.dataset.events;
if (live && window.EventSource) {
  let chartAt = Date.now();
  new EventSource(live).onmessage = () => {
    fetch(location.href, { credentials: "same-origin" })
      .then((r) => (r.ok ? r.text() : null))
      .then((html) => {
        // Not while someone types into the page's search box.
        if (!html || (document.activeElement && document.activeElement.tagName === "INPUT")) return;
        const next = new DOMParser().parseFromString(html, "text/html");
        const chart = document.querySelector("img.chart");
        const fresh = next.querySelector("img.chart");
        if (chart && fresh) {
          if (Date.now() - chartAt >= 5000) {
            chartAt = Date.now();
            chart.src = fresh.getAttribute("src") + "?at=" + chartAt;
          }
          fresh.replaceWith(chart);
        }
        document.body.replaceChildren(...next.body.childNodes);
      });
  };
}
"#;

pub(super) const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}\
table{border-collapse:collapse;margin:.5em 0 1.5em}\
th,td{padding:.25em .8em;border-bottom:1px solid #ddd;text-align:left}\
td.n{text-align:right;font-variant-numeric:tabular-nums}\
.bad{color:#b00}.muted{color:#777}img.chart{max-width:100%;height:auto}\
div.chart svg{max-width:100%;height:auto}\
pre.log{font-size:.85em;white-space:pre-wrap;overflow-wrap:anywhere}\n";

/// The overview: nodes, and page `page` (from 0) of the jobs.
pub(super) fn overview(snapshot: &ClusterSnapshot, page: usize) -> String {
    let mut html = head("imgrun", "");
    let totals = &snapshot.cluster.totals;
    let _ = write!(
        html,
        "<h1>imgrun</h1><p>{} live node(s), {} CPUs, {} GPU(s); {} job(s)</p>\
         <h2>Nodes</h2><table><tr><th>node</th><th>host</th><th>address</th><th>state</th>\
         <th>CPUs</th><th>GPUs</th><th>heartbeat</th></tr>",
        totals.nodes,
        totals.cpus,
        totals.gpus,
        snapshot.jobs.len()
    );
    for node in &snapshot.cluster.nodes {
        let gpus: Vec<String> = node
            .gpus
            .iter()
            .map(|gpu| match gpu.use_words() {
                Some((busy, memory)) => format!("{}: {} {busy} {memory}", gpu.index, gpu.name),
                None => format!("{}: {}", gpu.index, gpu.name),
            })
            .collect();
        let _ = write!(
            html,
            "<tr><td class=n>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=n>{}</td>\
             <td>{}</td><td class=n>{:.1} s ago</td></tr>",
            node.id.0,
            escape(&node.hostname),
            escape(&node.address),
            node.state,
            node.cpus,
            escape(&gpus.join(", ")),
            node.last_heartbeat_ms_ago as f64 / 1000.0
        );
    }
    html.push_str(
        "</table><h2>Jobs</h2><table><tr><th>job</th><th>state</th><th>epoch</th>\
         <th>step</th><th>loss</th><th>images/s</th><th>checkpoint</th></tr>",
    );
    let (shown, pages) = jobs_page(&snapshot.jobs, page);
    for job in shown {
        job_row(&mut html, job, Some(""));
    }
    html.push_str("</table>");
    if pages > 1 {
        let page = page.min(pages - 1);
        let _ = write!(html, "<p>page {} of {pages}", page + 1);
        if page > 0 {
            let _ = write!(html, " <a href=\"?page={}\">newer</a>", page - 1);
        }
        if page + 1 < pages {
            let _ = write!(html, " <a href=\"?page={}\">more</a>", page + 1);
        }
        html.push_str("</p>");
    }
    html.push_str(&foot(snapshot));
    html
}

/// The jobs the overview lists on one page.
pub(super) const JOBS_PER_PAGE: usize = 50;

/// The jobs of overview page `page` (from 0; past the last, the last): running ones
/// first, then the others, each in name order; and how many pages there are.
fn jobs_page(jobs: &Jobs, page: usize) -> (Vec<&JobSnapshot>, usize) {
    let ended = |job: &&Arc<JobSnapshot>| job.job.as_ref().is_some_and(|s| s.state.is_final());
    let pages = jobs.len().div_ceil(JOBS_PER_PAGE).max(1);
    let first = page.min(pages - 1) * JOBS_PER_PAGE;
    // Each group keeps the name order. Every running job has a coordinator.
    let coordinated = jobs.coordinated();
    let running: Vec<&Arc<JobSnapshot>> = coordinated.iter().filter(|j| !ended(j)).collect();
    let shown: Vec<&Arc<JobSnapshot>> = if running.len() == coordinated.len() {
        // Every ended job is the archive's: its page is reached by index, not a walk.
        let archived = jobs
            .archived()
            .iter()
            .skip(first.saturating_sub(running.len()));
        let running = running.into_iter().skip(first);
        running.chain(archived).take(JOBS_PER_PAGE).collect()
    } else {
        let over = jobs.iter().filter(ended);
        let all = running.into_iter().chain(over);
        all.skip(first).take(JOBS_PER_PAGE).collect()
    };
    (shown.into_iter().map(|job| &**job).collect(), pages)
}

/// One job's row, its name a link to its page when `up` (the way back to the
/// dashboard's root from the page) is given.
fn job_row(html: &mut String, job: &JobSnapshot, up: Option<&str>) {
    let link = match up {
        Some(up) => format!(
            "<a href=\"{up}job/{}\">{}</a>",
            encode_segment(&job.name),
            escape(&job.name)
        ),
        None => escape(&job.name),
    };
    let Some(status) = &job.job else {
        let _ = write!(
            html,
            "<tr><td>{link}</td><td class=bad colspan=6>{}</td></tr>",
            escape(job.problem.as_deref().unwrap_or("no answer"))
        );
        return;
    };
    let _ = write!(
        html,
        "<tr><td>{link}</td><td>{}</td><td class=n>{}</td><td class=n>{}/{}</td>\
         <td class=n>{}</td><td class=n>{}</td><td>{}</td></tr>",
        status.state.name(),
        status.epoch.map_or("-".into(), |e| e.to_string()),
        status.position,
        status.steps,
        status.loss.map_or("-".into(), |l| format!("{l:.4}")),
        status
            .images_per_s
            .map_or("-".into(), |r| format!("{r:.0}")),
        status
            .checkpoint
            .as_ref()
            .map_or("-".into(), |c| format!("step {}", c.global_step)),
    );
}

/// One job's page; `None` when the snapshot has no job of that name. With `csrf` (the
/// session's token, given when the head runs with `--dashboard-actions`), a running job
/// has a button that cancels it.
pub(super) fn job(snapshot: &ClusterSnapshot, name: &str, csrf: Option<&str>) -> Option<String> {
    let job = snapshot.jobs.find(name)?;
    let mut html = head(&format!("imgrun: {}", escape(name)), "../");
    let _ = write!(
        html,
        "<p><a href=\"../\">cluster</a></p><h1>{}</h1>",
        escape(name)
    );
    html.push_str(
        "<table><tr><th>job</th><th>state</th><th>epoch</th><th>step</th><th>loss</th>\
         <th>images/s</th><th>checkpoint</th></tr>",
    );
    job_row(&mut html, job, Some("../"));
    html.push_str("</table>");
    if let Some(outcome) = job.job.as_ref().and_then(|s| s.outcome.as_deref()) {
        let _ = write!(html, "<p>{}</p>", escape(outcome));
    }
    warnings(&mut html, job);
    timeline(&mut html, job);
    let running = job.job.as_ref().is_some_and(|s| !s.state.is_final());
    if let Some(csrf) = csrf.filter(|_| running) {
        let _ = write!(
            html,
            "<p><button data-cancel=\"{}/cancel\" data-csrf=\"{}\">cancel the job</button> \
             <span class=muted>(it stops after its step in flight, with a checkpoint)</span></p>",
            encode_segment(name),
            escape(csrf)
        );
    }
    if !job.ranks.is_empty() {
        html.push_str(
            "<h2>Ranks</h2><table><tr><th>rank</th><th>node</th><th>phase</th><th>for</th>\
             <th>epoch</th><th>step</th><th>data wait</th><th>step p50 / p95</th>\
             <th>data wait, allreduce (all steps)</th><th>heartbeat</th></tr>",
        );
        let totals = job.job.as_ref().map_or(&[][..], |s| &s.rank_totals[..]);
        for view in &job.ranks {
            let tallied = totals.iter().find(|t| t.rank == view.rank);
            let (quantiles, spent) = tallied.map_or(("-".into(), "-".into()), |t| {
                (
                    format!(
                        "{:.3} / {:.3} s{}",
                        t.step_p50_s,
                        t.step_p95_s,
                        if t.straggler {
                            " <b class=bad>straggler</b>"
                        } else {
                            ""
                        }
                    ),
                    format!("{:.1} s, {:.1} s", t.data_wait_s, t.allreduce_s),
                )
            });
            let rank_cell = format!(
                "<a href=\"{}/rank/{rank}/log\" title=\"its log\">{rank}</a>",
                encode_segment(name),
                rank = view.rank
            );
            let heartbeat = view
                .heartbeat_ms_ago
                .map_or("-".into(), |ms| format!("{:.1} s ago", ms as f64 / 1000.0));
            match &view.phase {
                Some(phase) => {
                    let _ = write!(
                        html,
                        "<tr><td class=n>{}</td><td class=n>{}</td><td>{}</td>\
                         <td class=n>{:.1} s</td><td class=n>{}</td><td class=n>{}</td>\
                         <td class=n>{:.1} s</td><td class=n>{quantiles}</td>\
                         <td class=n>{spent}</td><td class=n>{heartbeat}</td></tr>",
                        rank_cell,
                        view.node,
                        escape(&phase.describe()),
                        phase.seconds,
                        phase.epoch.map_or("-".into(), |e| e.to_string()),
                        phase.step,
                        phase.data_wait_s
                    );
                }
                None => {
                    let _ = write!(
                        html,
                        "<tr><td class=n>{}</td><td class=n>{}</td><td class=bad colspan=5>{}\
                         </td><td class=n>{quantiles}</td><td class=n>{spent}</td>\
                         <td class=n>{heartbeat}</td></tr>",
                        rank_cell,
                        view.node,
                        escape(view.problem.as_deref().unwrap_or("unknown"))
                    );
                }
            }
        }
        html.push_str("</table>");
    }
    let _ = write!(
        html,
        "<p><a href=\"{0}/log\">log</a> · <a href=\"{0}/log.txt\" download>download the \
         log</a></p><p><img class=chart src=\"{0}/chart.svg\" alt=\"training loss, eval \
         accuracy, throughput and learning rate\"></p>",
        encode_segment(name)
    );
    if let Some(problem) = &job.problem {
        let _ = write!(html, "<p class=bad>{}</p>", escape(problem));
    }
    html.push_str(&foot(snapshot));
    Some(html)
}

/// The log page of the job `name` (at `job/NAME/log`): its last lines or a search's
/// matches, a search box, and the download.
pub(super) fn log(name: &str, view: &LogView) -> String {
    let segment = encode_segment(name);
    let mut html = head(&format!("imgrun: {} log", escape(name)), "../../");
    let text = match view {
        LogView::Search { text, .. } => text.as_str(),
        LogView::Tail { .. } => "",
    };
    let _ = write!(
        html,
        "<p><a href=\"../../\">cluster</a> / <a href=\"../{segment}\">{name}</a></p>\
         <h1>{name}: log</h1>",
        name = escape(name),
    );
    search_form(&mut html, text);
    match view {
        LogView::Tail { lines, reply } => {
            let shown = String::from_utf8_lossy(&reply.bytes);
            let _ = write!(
                html,
                "<p class=muted>the last {} lines of {} (bytes {} to {} of {})</p>\
                 <pre class=log>{}</pre>",
                shown.lines().count().min(*lines as usize),
                escape(actors::job::LOG_FILE),
                reply.start,
                reply.start + reply.bytes.len() as u64,
                reply.length,
                escape(&shown)
            );
        }
        LogView::Search { text, reply } => {
            let _ = write!(
                html,
                "<p class=muted>{} lines hold <code>{}</code>{}{}</p><pre class=log>",
                reply.matches.len(),
                escape(text),
                if reply.more {
                    " (the newest shown)"
                } else {
                    ""
                },
                if reply.searched_from > 0 {
                    format!(" in the last {} bytes", reply.length - reply.searched_from)
                } else {
                    String::new()
                }
            );
            for found in &reply.matches {
                html.push_str(&escape(&found.line));
                html.push('\n');
            }
            html.push_str("</pre>");
        }
    }
    html.push_str("</body></html>\n");
    html
}

/// A rank's log page (at `job/NAME/rank/N/log`): the newest lines its trainer's process
/// wrote, oldest first, or those of them that hold `text` when it is not empty; a search
/// box, and the download of the lines (`log.txt`). Of the attempt `asked` (`?attempt=`),
/// else the current one; a rank that has had several trainers links to each.
pub(super) fn rank_log(
    name: &str,
    output: &RankOutputReply,
    text: &str,
    asked: Option<u32>,
) -> String {
    let mut html = head(
        &format!("imgrun: {} rank {}", escape(name), output.rank),
        "../../../../",
    );
    let _ = write!(
        html,
        "<p><a href=\"../../../../\">cluster</a> / <a href=\"../../../{segment}\">{name}</a> \
         · <a href=\"../../log\">the job's log</a></p><h1>{name}: rank {rank}</h1>",
        segment = encode_segment(name),
        name = escape(name),
        rank = output.rank,
    );
    attempt_links(&mut html, output);
    if !output.own_process {
        let _ = write!(
            html,
            "<p class=muted>its trainer runs in node {}'s daemon process: its lines are in \
             that daemon's log</p>",
            output.node
        );
        html.push_str("</body></html>\n");
        return html;
    }
    rank_search_form(&mut html, text, asked);
    let shown = if text.is_empty() {
        let _ = write!(
            html,
            "<p class=muted>the newest {} lines its trainer's process wrote on node {} (its \
             messages, its loader's, libtorch's)</p>",
            output.lines.len(),
            output.node
        );
        output.lines.iter().map(String::as_str).collect()
    } else {
        let found = lines_holding(&output.lines, text);
        let _ = write!(
            html,
            "<p class=muted>{} lines hold <code>{}</code>, of the newest {} its trainer's \
             process wrote on node {}</p>",
            found.len(),
            escape(text),
            output.lines.len(),
            output.node
        );
        found
    };
    html.push_str("<pre class=log>");
    for line in shown {
        html.push_str(&escape(line));
        html.push('\n');
    }
    html.push_str("</pre></body></html>\n");
    html
}

/// A rank's attempts as links (`log?attempt=K`), the one shown in bold, when it has had
/// more than one trainer.
fn attempt_links(html: &mut String, output: &RankOutputReply) {
    if output.attempts < 2 {
        return;
    }
    html.push_str("<p>its trainers (an elastic job's regroup or growth gives a rank another):");
    for attempt in 0..output.attempts {
        let last = if attempt + 1 == output.attempts {
            " (newest)"
        } else {
            ""
        };
        if attempt == output.attempt {
            let _ = write!(html, " <b>attempt {attempt}{last}</b>");
        } else {
            let _ = write!(
                html,
                " <a href=\"log?attempt={attempt}\">attempt {attempt}{last}</a>"
            );
        }
    }
    html.push_str("</p>");
}

/// A rank log page's search box, keeping the attempt asked for (`?attempt=`) in the
/// search and the links.
fn rank_search_form(html: &mut String, text: &str, asked: Option<u32>) {
    let Some(attempt) = asked else {
        search_form(html, text);
        return;
    };
    let _ = write!(
        html,
        "<form method=get action=\"log\"><input type=hidden name=attempt value=\"{attempt}\">\
         <input name=q value=\"{}\" placeholder=\"text to find\" size=40> <button>find\
         </button> <a href=\"log?attempt={attempt}\">last lines</a> · <a \
         href=\"log.txt?attempt={attempt}\" download>download</a></form>",
        escape(text)
    );
}

/// A log page's search box (`?q=`) with `text` in it, and its links to the last lines
/// and to the download, all relative to the page (`log`, `log.txt`).
fn search_form(html: &mut String, text: &str) {
    let _ = write!(
        html,
        "<form method=get action=\"log\"><input name=q value=\"{}\" placeholder=\"text to \
         find\" size=40> <button>find</button> <a href=\"log\">last lines</a> · <a \
         href=\"log.txt\" download>download</a></form>",
        escape(text)
    );
}

/// A job as one self-contained page (`imgrun report`): its status, its charts (`svg`,
/// or why there are none) and the last lines of its log, with the style inside and no
/// script, link or request: it opens from a file, without a server.
pub(crate) fn report(
    job: &JobSnapshot,
    svg: Result<&str, &str>,
    log: &str,
    made: std::time::SystemTime,
) -> String {
    let name = escape(&job.name);
    let mut html = format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>imgrun: {name}</title><style>{STYLE}</style></head><body><h1>{name}</h1>\
         <table><tr><th>job</th><th>state</th><th>epoch</th><th>step</th><th>loss</th>\
         <th>images/s</th><th>checkpoint</th></tr>"
    );
    job_row(&mut html, job, None);
    html.push_str("</table>");
    if let Some(status) = &job.job {
        if let Some(outcome) = &status.outcome {
            let _ = write!(html, "<p>{}</p>", escape(outcome));
        }
        if let Some(dir) = &status.run_dir {
            let _ = write!(
                html,
                "<p class=muted>run folder {}</p>",
                escape(&dir.display().to_string())
            );
        }
    }
    warnings(&mut html, job);
    timeline(&mut html, job);
    match svg {
        // The drawing's own XML declaration has no place inside HTML.
        Ok(svg) => {
            let svg = match svg.strip_prefix("<?xml") {
                Some(rest) => rest.split_once("?>").map_or(rest, |(_, svg)| svg),
                None => svg,
            };
            let _ = write!(html, "<div class=chart>{svg}</div>");
        }
        Err(why) => {
            let _ = write!(html, "<p class=bad>no charts: {}</p>", escape(why));
        }
    }
    if log.is_empty() {
        let _ = write!(
            html,
            "<h2>Log</h2><p class=muted>no {} in the run folder (a run of an imgrun \
             older than its log, or one whose log was removed)</p>",
            actors::job::LOG_FILE
        );
    } else {
        let _ = write!(
            html,
            "<h2>Log</h2><p class=muted>the last {} lines of {}</p><pre class=log>{}</pre>",
            log.lines().count(),
            actors::job::LOG_FILE,
            escape(log)
        );
    }
    let _ = writeln!(
        html,
        "<p class=muted>made by imgrun {} on {}</p></body></html>",
        env!("CARGO_PKG_VERSION"),
        httpdate::fmt_http_date(made)
    );
    html
}

/// The job's newest warnings, newest first, when it gave any.
fn warnings(html: &mut String, job: &JobSnapshot) {
    let Some(status) = job.job.as_ref().filter(|s| !s.warnings.is_empty()) else {
        return;
    };
    html.push_str("<h2>Warnings</h2><table>");
    for warning in status.warnings.iter().rev() {
        let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(warning.at_unix_ms);
        let _ = write!(
            html,
            "<tr><td class=muted>{}</td><td>{}</td></tr>",
            httpdate::fmt_http_date(at),
            escape(&warning.text)
        );
    }
    html.push_str("</table>");
}

/// The turns of the job's life, newest first, when it has any.
fn timeline(html: &mut String, job: &JobSnapshot) {
    let Some(status) = job.job.as_ref().filter(|s| !s.timeline.is_empty()) else {
        return;
    };
    html.push_str("<h2>Timeline</h2><table>");
    for entry in status.timeline.iter().rev() {
        let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(entry.at_unix_ms);
        let (kind, text) = moment_words(&entry.moment);
        let _ = write!(
            html,
            "<tr><td class=muted>{}</td><td>{kind}</td><td>{}</td></tr>",
            httpdate::fmt_http_date(at),
            escape(&text)
        );
    }
    html.push_str("</table>");
}

/// A turn of a job's life in words: its kind and what happened.
fn moment_words(moment: &Moment) -> (&'static str, String) {
    match moment {
        Moment::Started { world } => ("started", format!("{world} ranks connected")),
        Moment::Lost { ranks, cause } => ("lost", format!("rank(s) {ranks:?}: {cause}")),
        Moment::Regrouped {
            from_world,
            world,
            epoch,
            step,
            recovery_s,
        } => (
            "regrouped",
            format!(
                "{from_world} -> {world} ranks at epoch {epoch}, global step {step}, in {recovery_s:.1} s"
            ),
        ),
        Moment::Checkpoint {
            epoch,
            global_step,
            seconds,
        } => (
            "checkpoint",
            format!("epoch {epoch}, global step {global_step}, saved in {seconds:.1} s"),
        ),
        Moment::CheckpointFailed { global_step, cause } => (
            "checkpoint failed",
            format!("global step {global_step}: {cause}"),
        ),
        Moment::Ended { state, outcome } => (
            state.name(),
            outcome
                .clone()
                .unwrap_or_else(|| format!("job {}", state.name())),
        ),
    }
}

/// The page's head, with `up` the way back to the dashboard's root (`""` or `"../"`):
/// its style, and its script, which follows the server's change events.
fn head(title: &str, up: &str) -> String {
    format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{title}</title>\
         <link rel=\"stylesheet\" href=\"{up}style.css\"><script src=\"{up}app.js\" defer>\
         </script></head><body data-events=\"{up}events\">"
    )
}

fn foot(snapshot: &ClusterSnapshot) -> String {
    let taken = std::time::UNIX_EPOCH + std::time::Duration::from_millis(snapshot.taken_at_unix_ms);
    format!(
        "<p class=muted>as of {}; head session {}</p></body></html>\n",
        httpdate::fmt_http_date(taken),
        snapshot.cluster.head_session
    )
}

/// `text` safe inside an element or a quoted attribute.
pub(super) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `text` as one path segment of a URL: every byte but ASCII letters and digits
/// percent-encoded.
fn encode_segment(text: &str) -> String {
    percent_encoding::utf8_percent_encode(text, percent_encoding::NON_ALPHANUMERIC).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outside_text_is_escaped_and_names_are_one_path_segment() {
        assert_eq!(
            escape("<a href=\"x\">'&'</a>"),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
        assert_eq!(encode_segment("run1"), "run1");
        assert_eq!(encode_segment("../x y/é"), "%2E%2E%2Fx%20y%2F%C3%A9");
    }

    #[test]
    fn a_rank_log_page_shows_its_lines_or_a_search_escaped() {
        let output = |own_process| RankOutputReply {
            rank: 1,
            node: 4,
            lines: ["trainer ready rank=1 world=2", "<b>step</b> 1", "step 2"]
                .map(String::from)
                .to_vec(),
            own_process,
            attempt: 0,
            attempts: 1,
        };
        let form = "<form method=get action=\"log\"><input name=q value=\"";
        let download = "<a href=\"log.txt\" download>download</a>";
        // (text, the page holds, the page does not hold)
        let table: [(&str, &[&str], &[&str]); 4] = [
            (
                "",
                &[
                    form,
                    download,
                    "the newest 3 lines",
                    "&lt;b&gt;step&lt;/b&gt; 1\nstep 2\n</pre>",
                ],
                &["lines hold", "<b>"],
            ),
            (
                "step",
                &[
                    "2 lines hold <code>step</code>, of the newest 3",
                    "<pre class=log>&lt;b&gt;step&lt;/b&gt; 1\nstep 2\n</pre>",
                    "value=\"step\"",
                ],
                &["trainer ready"],
            ),
            (
                "<b>",
                &["1 lines hold <code>&lt;b&gt;</code>", "value=\"&lt;b&gt;\""],
                &["<b>", "step 2"],
            ),
            (
                "STEP",
                &["0 lines hold <code>STEP</code>", "<pre class=log></pre>"],
                &["step 2"],
            ),
        ];
        for (text, holds, lacks) in table {
            let page = rank_log("a\"b", &output(true), text, None);
            assert!(
                page.contains("<h1>a&quot;b: rank 1</h1>"),
                "{text:?}: {page}"
            );
            for wanted in holds {
                assert!(page.contains(wanted), "{text:?} lacks {wanted:?}: {page}");
            }
            for unwanted in lacks {
                assert!(
                    !page.contains(unwanted),
                    "{text:?} holds {unwanted:?}: {page}"
                );
            }
        }
        // A trainer in its daemon's process: no lines here, so no search or download.
        let page = rank_log("run", &output(false), "step", None);
        assert!(page.contains("node 4's daemon process"), "{page}");
        assert!(!page.contains(form) && !page.contains("log.txt"), "{page}");
    }

    #[test]
    fn a_rank_log_page_links_to_each_attempt_and_keeps_the_one_asked() {
        let output = |attempt, attempts| RankOutputReply {
            rank: 2,
            node: 3,
            lines: vec!["trainer ready rank=2 world=3".to_string()],
            own_process: true,
            attempt,
            attempts,
        };
        // (shown, of, asked, the page holds, the page does not hold)
        type Row<'a> = (u32, u32, Option<u32>, &'a [&'a str], &'a [&'a str]);
        let table: [Row; 3] = [
            (
                0,
                1,
                None,
                &["<a href=\"log.txt\" download>"],
                &["attempt 0", "?attempt="],
            ),
            (
                2,
                3,
                None,
                &[
                    "<a href=\"log?attempt=0\">attempt 0</a>",
                    "<a href=\"log?attempt=1\">attempt 1</a>",
                    "<b>attempt 2 (newest)</b>",
                    "<a href=\"log.txt\" download>",
                ],
                &["name=attempt"],
            ),
            (
                0,
                3,
                Some(0),
                &[
                    "<b>attempt 0</b>",
                    "<a href=\"log?attempt=2\">attempt 2 (newest)</a>",
                    "<input type=hidden name=attempt value=\"0\">",
                    "<a href=\"log.txt?attempt=0\" download>",
                ],
                &["<a href=\"log?attempt=0\">attempt"],
            ),
        ];
        for (shown, of, asked, holds, lacks) in table {
            let page = rank_log("run", &output(shown, of), "", asked);
            for wanted in holds {
                assert!(
                    page.contains(wanted),
                    "{shown} of {of}: lacks {wanted:?}: {page}"
                );
            }
            for unwanted in lacks {
                assert!(
                    !page.contains(unwanted),
                    "{shown} of {of}: holds {unwanted:?}: {page}"
                );
            }
        }
    }

    #[test]
    fn every_turn_of_a_job_reads_as_words() {
        use actors::job::JobState;
        let table = [
            (Moment::Started { world: 4 }, "started", "4 ranks connected"),
            (
                Moment::Lost {
                    ranks: vec![2],
                    cause: "rank 2: node 1 left".to_string(),
                },
                "lost",
                "rank(s) [2]: rank 2: node 1 left",
            ),
            (
                Moment::Regrouped {
                    from_world: 4,
                    world: 3,
                    epoch: 1,
                    step: 40,
                    recovery_s: 2.25,
                },
                "regrouped",
                "4 -> 3 ranks at epoch 1, global step 40, in 2.2 s",
            ),
            (
                Moment::Checkpoint {
                    epoch: 2,
                    global_step: 80,
                    seconds: 0.5,
                },
                "checkpoint",
                "epoch 2, global step 80, saved in 0.5 s",
            ),
            (
                Moment::CheckpointFailed {
                    global_step: 81,
                    cause: "disk full".to_string(),
                },
                "checkpoint failed",
                "global step 81: disk full",
            ),
            (
                Moment::Ended {
                    state: JobState::Succeeded,
                    outcome: None,
                },
                "succeeded",
                "job succeeded",
            ),
        ];
        for (moment, kind, text) in table {
            assert_eq!(
                moment_words(&moment),
                (kind, text.to_string()),
                "{moment:?}"
            );
        }
    }

    #[test]
    fn the_overview_lists_running_jobs_first_a_page_at_a_time() {
        let job = |name: String, state: &str| {
            Arc::new(JobSnapshot {
                job: Some(
                    serde_json::from_value(serde_json::json!({
                        "name": name, "state": state, "position": 0, "steps": 0
                    }))
                    .expect("a status"),
                ),
                name,
                ranks: Vec::new(),
                problem: None,
            })
        };
        // 120 finished jobs, and 3 running ones whose names sort among them; the finished
        // ones all the archive's, or 10 of them still with their coordinators.
        let done: Vec<Arc<JobSnapshot>> = (0..120)
            .map(|i| job(format!("done-{i:03}"), "succeeded"))
            .collect();
        let mut running: Vec<Arc<JobSnapshot>> = (0..3)
            .map(|i| job(format!("a-run-{i}"), "running"))
            .collect();
        running.push(job("z-run".to_string(), "stopping"));
        for coordinated_done in [0, 10] {
            let mut coordinated = running.clone();
            coordinated.extend(done[..coordinated_done].iter().cloned());
            let archived = Arc::new(done[coordinated_done..].to_vec());
            let jobs = Jobs::new(coordinated, archived, 0);
            let names = |page| -> (Vec<String>, usize) {
                let (shown, pages) = jobs_page(&jobs, page);
                (shown.iter().map(|j| j.name.clone()).collect(), pages)
            };
            let (first, pages) = names(0);
            assert_eq!(pages, 3);
            assert_eq!(first.len(), JOBS_PER_PAGE);
            assert_eq!(
                first[..5],
                ["a-run-0", "a-run-1", "a-run-2", "z-run", "done-000"]
            );
            let (second, _) = names(1);
            assert_eq!(second[0], format!("done-{:03}", JOBS_PER_PAGE - 4));
            let (last, _) = names(2);
            assert_eq!(last.len(), 124 - 2 * JOBS_PER_PAGE);
            assert_eq!(last.last().map(String::as_str), Some("done-119"));
            // Past the last page: the last.
            assert_eq!(names(99).0, last);
        }
        assert_eq!(jobs_page(&Jobs::default(), 0).1, 1);
    }
}
