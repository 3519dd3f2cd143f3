//! The tables `imgrun jobs` and `imgrun status --watch` print: jobs, one line each, and
//! every rank's phase. A leaf of `src/commands`.

use std::fmt::Write;

use actors::job::{JobStatus, RankView};

/// Every rank's phase, one line each (nothing without ranks).
pub(crate) fn ranks_table(ranks: &[RankView]) -> String {
    let mut out = String::new();
    if ranks.is_empty() {
        return out;
    }
    let _ = writeln!(
        out,
        "\n{:>5} {:>5} {:<28} {:>9} {:>6} {:>8} {:>10} {:>10}",
        "RANK", "NODE", "PHASE", "FOR", "EPOCH", "STEP", "DATA WAIT", "HEARTBEAT"
    );
    for view in ranks {
        let heartbeat = view.heartbeat_ms_ago.map_or("-".to_string(), |ms| {
            format!("{:.1}s ago", ms as f64 / 1000.0)
        });
        let _ = match (&view.phase, &view.problem) {
            (Some(phase), _) => writeln!(
                out,
                "{:>5} {:>5} {:<28} {:>8.1}s {:>6} {:>8} {:>9.1}s {:>10}",
                view.rank,
                view.node,
                phase.describe(),
                phase.seconds,
                phase.epoch.map_or("-".to_string(), |e| e.to_string()),
                phase.step,
                phase.data_wait_s,
                heartbeat
            ),
            (None, problem) => writeln!(
                out,
                "{:>5} {:>5} {}",
                view.rank,
                view.node,
                problem.as_deref().unwrap_or("unknown")
            ),
        };
    }
    out
}

/// The jobs, one line each, under a header.
pub(crate) fn jobs_table(statuses: &[JobStatus]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<24} {:<10} {:>6} {:>13} {:>8} {:>8}  RUN FOLDER (on the head's machine)",
        "JOB", "STATE", "EPOCH", "STEP", "LOSS", "IMG/S"
    );
    for status in statuses {
        let _ = writeln!(
            out,
            "{:<24} {:<10} {:>6} {:>13} {:>8} {:>8}  {}",
            status.name,
            status.state.name(),
            status.epoch.map_or("-".to_string(), |e| e.to_string()),
            format!("{}/{}", status.position, status.steps),
            status.loss.map_or("-".to_string(), |l| format!("{l:.3}")),
            status
                .images_per_s
                .map_or("-".to_string(), |r| format!("{r:.0}")),
            status
                .run_dir
                .as_ref()
                .map_or("-".to_string(), |d| d.display().to_string())
        );
    }
    out
}
