//! Helpers shared by the benchmark programs: where their data lives, the machine they
//! run on, the Python they compare against, and how they print ratios.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository root (the workspace folder above `pipelines/`).
pub fn repo_root() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    root.canonicalize().unwrap_or(root)
}

/// Where a benchmark keeps the data it generates: `$IMGRUN_CACHE/bench-data/NAME`, or
/// `target/bench-data/NAME` when `IMGRUN_CACHE` is not set.
pub fn data_dir(root: &Path, name: &str) -> PathBuf {
    match std::env::var_os("IMGRUN_CACHE") {
        Some(cache) => PathBuf::from(cache).join("bench-data").join(name),
        None => root.join("target/bench-data").join(name),
    }
}

/// Prints `BENCH bench: MESSAGE` to stderr and exits with status 1.
pub fn fail(bench: &str, message: &str) -> ! {
    eprintln!("{bench} bench: {message}");
    std::process::exit(1);
}

/// Reads a file to its end, so that it is in the page cache.
pub fn warm(path: &Path) {
    let mut buffer = vec![0u8; 1 << 20];
    if let Ok(mut file) = std::fs::File::open(path) {
        while matches!(file.read(&mut buffer), Ok(n) if n > 0) {}
    }
}

/// `N cores, load average A B C`: timings mean little without it.
pub fn machine_line() -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cores} cores, load average {}", load_average())
}

/// The 1, 5 and 15 minute load averages, as `/proc/loadavg` gives them.
pub fn load_average() -> String {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load: Vec<&str> = load.split_whitespace().take(3).collect();
    if load.is_empty() {
        "unknown".into()
    } else {
        load.join(" ")
    }
}

/// One line of a ratio table: the measured ratio, the goal (if any) and whether it is met.
pub fn ratio_line(name: &str, value: Option<f64>, goal: Option<f64>) {
    let goal_text = goal.map_or("-".into(), |goal| format!(">= {goal}x"));
    match (value, goal) {
        (Some(value), Some(goal)) => {
            let verdict = if value >= goal { "met" } else { "BELOW GOAL" };
            println!("{name:<36} {value:>9.2}x {goal_text:>8}  {verdict}");
        }
        (Some(value), None) => println!("{name:<36} {value:>9.2}x {goal_text:>8}"),
        (None, _) => println!("{name:<36} {:>10} {goal_text:>8}", "-"),
    }
}

/// The Python that a `tools/*.sh` script prints (creating its venv on first use). On
/// failure, the script's last line of stderr says why (for example "PyPI unreachable").
pub fn tool_python(root: &Path, script: &str) -> Result<String, String> {
    let out = Command::new("bash")
        .arg(script)
        .current_dir(root)
        .output()
        .map_err(|e| format!("cannot run {script}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{script} failed: {}", last_line(&out.stderr)));
    }
    // What the script says while installing (only on first use).
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Runs a Python script that prints one JSON value and parses it.
pub fn python_json(
    python: &str,
    script: &Path,
    args: &[String],
) -> Result<serde_json::Value, String> {
    let name = script.file_name().map_or_else(
        || script.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let out = Command::new(python)
        .arg(script)
        .args(args)
        .output()
        .map_err(|e| format!("cannot run {python}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{name} failed: {}", last_line(&out.stderr)));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| format!("bad output from {name}: {e}"))
}

fn last_line(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    text.lines().last().unwrap_or("no message").to_string()
}
