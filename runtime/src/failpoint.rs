//! Named failpoints: places in the code where a test makes a process fail on purpose,
//! at an exact point that a signal from outside could only hit by chance.
//!
//! `IMGRUN_FAILPOINTS` lists them, comma-separated, as `NAME=ACTION` or
//! `NAME=ACTION@N` (only at the N-th time the point is reached, counting from 1; without
//! `@N`, every time). Actions: `exit` (the process ends at once with status 86, as a
//! crash would: no destructor, no reply), and `sleep:MS` (the thread waits MS
//! milliseconds: a stall). The variable is read once per process; an entry that does not
//! parse is reported on stderr once and ignored. Unset, a failpoint costs one atomic
//! load.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The variable that lists the failpoints.
pub const FAILPOINTS_VARIABLE: &str = "IMGRUN_FAILPOINTS";

/// The exit status of a process that a failpoint ended.
pub const FAILPOINT_EXIT: i32 = 86;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Exit,
    Sleep(u64),
}

#[derive(Debug)]
struct Point {
    action: Action,
    /// The hit it fires at (none: every hit).
    at: Option<u64>,
    hits: AtomicU64,
}

fn points() -> &'static HashMap<String, Point> {
    static POINTS: OnceLock<HashMap<String, Point>> = OnceLock::new();
    POINTS.get_or_init(|| {
        let text = std::env::var(FAILPOINTS_VARIABLE).unwrap_or_default();
        let (points, problems) = parse(&text);
        for problem in problems {
            eprintln!("imgrun: {FAILPOINTS_VARIABLE}: {problem} (ignored)");
        }
        points
    })
}

fn parse(text: &str) -> (HashMap<String, Point>, Vec<String>) {
    let mut points = HashMap::new();
    let mut problems = Vec::new();
    for entry in text.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let Some((name, spec)) = entry.split_once('=') else {
            problems.push(format!("`{entry}` is not NAME=ACTION"));
            continue;
        };
        let (action, at) = match spec.split_once('@') {
            Some((action, at)) => match at.parse::<u64>() {
                Ok(at) if at > 0 => (action, Some(at)),
                _ => {
                    problems.push(format!("`{entry}`: `@{at}` is not a hit count from 1"));
                    continue;
                }
            },
            None => (spec, None),
        };
        let action = match action.split_once(':') {
            None if action == "exit" => Action::Exit,
            Some(("sleep", ms)) if ms.parse::<u64>().is_ok() => {
                Action::Sleep(ms.parse().unwrap_or(0))
            }
            _ => {
                problems.push(format!(
                    "`{entry}`: `{action}` is not an action (exit, sleep:MS)"
                ));
                continue;
            }
        };
        points.insert(
            name.trim().to_string(),
            Point {
                action,
                at,
                hits: AtomicU64::new(0),
            },
        );
    }
    (points, problems)
}

/// The failpoint `name`: does what `IMGRUN_FAILPOINTS` says for it, if anything.
pub fn failpoint(name: &str) {
    let points = points();
    if points.is_empty() {
        return;
    }
    let Some(point) = points.get(name) else {
        return;
    };
    let hit = point.hits.fetch_add(1, Ordering::Relaxed) + 1;
    if point.at.is_some_and(|at| at != hit) {
        return;
    }
    match point.action {
        Action::Exit => {
            eprintln!("imgrun: failpoint {name} (hit {hit}): exiting");
            std::process::exit(FAILPOINT_EXIT);
        }
        Action::Sleep(ms) => std::thread::sleep(Duration::from_millis(ms)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failpoints_parse_and_bad_entries_are_named() {
        let (points, problems) = parse("a.b=exit@3, c=sleep:20,d=exit,e=boom,f=exit@0,g");
        assert_eq!(points["a.b"].action, Action::Exit);
        assert_eq!(points["a.b"].at, Some(3));
        assert_eq!(points["c"].action, Action::Sleep(20));
        assert_eq!(points["d"].at, None);
        assert_eq!(points.len(), 3);
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(problems[0].contains("`e=boom`"), "{problems:?}");
        assert!(problems[1].contains("@0"), "{problems:?}");
        assert!(problems[2].contains("`g`"), "{problems:?}");
        // Unlisted points do nothing (this process sets no variable).
        failpoint("nowhere");
    }
}
