//! The one way a test gives up when something it needs is missing here (network
//! namespaces, a Python venv): it fails, unless the person running the
//! tests has allowed skipping with `IMGRUN_ALLOW_SKIP=1`. CI never sets it, so a test
//! cannot pass there without having run.
//!
//! One file for the whole workspace, so that every test crate prints and logs skips in
//! the form `tools/test.sh` counts: `pipelines` includes it in its integration tests,
//! the binary's tests through `tests/e2e/common`. (The photos the tests read are in the
//! repository, `assets/photos/`: a test that misses them fails.)

use std::io::Write;

/// Set to `1` to let tests skip on a missing precondition (local runs only).
pub const ALLOW_SKIP: &str = "IMGRUN_ALLOW_SKIP";
/// A file that each skip appends its `SKIPPED` line to (`tools/test.sh` sets it).
pub const SKIP_LOG: &str = "IMGRUN_SKIP_LOG";

/// Gives up on the calling test because `missing` is not there. With
/// `IMGRUN_ALLOW_SKIP=1`, prints `SKIPPED <test>: <missing>` on stderr, appends that line
/// to the file `IMGRUN_SKIP_LOG` names (if set) and returns, and the caller returns
/// next. Otherwise panics, naming what is missing and the variable that allows skipping.
#[track_caller]
pub fn skip_or_fail(missing: &str) {
    let test = test_name();
    if std::env::var_os(ALLOW_SKIP).is_none_or(|value| value != "1") {
        panic!(
            "{test} cannot run: {missing}. Provide it, or set {ALLOW_SKIP}=1 to skip this \
             test locally (CI never skips)"
        );
    }
    let line = format!("SKIPPED {test}: {missing}\n");
    // Straight to the process's stderr: the harness would hide `eprint!` of a passing test.
    let _ = std::io::stderr().write_all(line.as_bytes());
    if let Some(log) = std::env::var_os(SKIP_LOG) {
        // One short append per skip, so that tests in parallel do not interleave lines.
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .and_then(|mut file| file.write_all(line.as_bytes()))
            .unwrap_or_else(|error| {
                panic!(
                    "cannot append to {SKIP_LOG} {}: {error}",
                    log.to_string_lossy()
                )
            });
    }
}

/// The running test's name (libtest names each test's thread after it), or the caller's
/// file and line where the test runs on an unnamed or the main thread.
#[track_caller]
fn test_name() -> String {
    match std::thread::current().name() {
        Some(name) if name != "main" => name.to_owned(),
        _ => std::panic::Location::caller().to_string(),
    }
}
