//! End-to-end tests of the head's dashboard bound off loopback: it serves HTTPS only,
//! with a certificate of the cluster's CA, and refuses to start where it could not say
//! which names it answers to. The client is `curl`, which knows nothing of imgrun: it
//! trusts the head's `head/ca.pem` and nothing else.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

use crate::common::skip::skip_or_fail;
use crate::common::{Machine, describe};

/// The name the dashboard is told it is reached by.
const NAME: &str = "dash.test";

/// What the head's `dashboard.json` says of it.
struct Record {
    url: String,
    port: u16,
    ca_file: PathBuf,
    token: String,
    metrics_token: String,
}

fn record(head: &Machine) -> Record {
    let path = head.state.join("dashboard.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let record: Value = serde_json::from_str(&text).expect("dashboard.json");
    let url = record["url"].as_str().expect("url").to_owned();
    let port = url
        .trim_end_matches('/')
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse().ok())
        .unwrap_or_else(|| panic!("no port in {url}"));
    let text = |key: &str| {
        record[key]
            .as_str()
            .unwrap_or_else(|| panic!("{key}: {record}"))
            .to_owned()
    };
    Record {
        port,
        ca_file: PathBuf::from(text("ca_file")),
        token: text("token"),
        metrics_token: text("metrics_token"),
        url,
    }
}

/// `curl ARGS`, silent but for errors, with a time limit of its own.
fn curl(args: &[&str]) -> Output {
    Command::new("curl")
        .args(["--silent", "--show-error", "--max-time", "10"])
        .args(args)
        .output()
        .expect("run curl")
}

/// `curl ARGS` that must succeed: its standard output.
fn curl_ok(args: &[&str]) -> String {
    let out = curl(args);
    assert!(out.status.success(), "curl {args:?}:\n{}", describe(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn off_loopback_the_dashboard_serves_https_only_with_a_certificate_of_the_cluster_ca() {
    if Command::new("curl").arg("--version").output().is_err() {
        skip_or_fail("no `curl` (Debian's package; tools/test.sh installs it as root)");
        return;
    }
    let root = tempfile::tempdir().expect("temp dir");
    refuses_every_address_without_names(root.path());

    let mut head = Machine::new(root.path(), "head");
    head.env.push((
        "IMGRUN_CLUSTER__DASHBOARD_HOSTS".to_owned(),
        format!("[\"{NAME}\"]"),
    ));
    head.start_head(&["--dashboard-bind", "0.0.0.0", "--dashboard-port", "0"]);
    let dash = record(&head);
    assert_eq!(dash.url, format!("https://{NAME}:{}/", dash.port));
    assert_eq!(dash.ca_file, head.state.join("head").join("ca.pem"));
    let port = dash.port;
    let resolve = format!("{NAME}:{port}:127.0.0.1");
    let scraper = format!("Authorization: Bearer {}", dash.metrics_token);
    let ca = dash.ca_file.to_str().expect("utf-8 path");

    // Trusting the cluster CA: the name it was given, and loopback.
    let metrics = curl_ok(&[
        "--cacert",
        ca,
        "--resolve",
        &resolve,
        "-H",
        &scraper,
        &format!("https://{NAME}:{port}/metrics"),
    ]);
    assert!(metrics.contains("imgrun_node_up"), "{metrics}");
    let page = curl_ok(&["--cacert", ca, &format!("https://127.0.0.1:{port}/")]);
    assert!(page.contains("app.js"), "the login shell: {page}");

    // Trusting only the system's authorities, the certificate is refused (curl's 60).
    let untrusted = curl(&["--resolve", &resolve, &format!("https://{NAME}:{port}/")]);
    assert_eq!(
        untrusted.status.code(),
        Some(60),
        "{}",
        describe(&untrusted)
    );

    // Plain HTTP gets no answer at all.
    let plain = curl(&["-H", &scraper, &format!("http://127.0.0.1:{port}/metrics")]);
    assert!(!plain.status.success(), "{}", describe(&plain));
    assert!(plain.stdout.is_empty(), "{}", describe(&plain));

    // TLS changes no rule: another `Host` is refused even with the right token.
    let session = format!("Authorization: Bearer {}", dash.token);
    let rebound = curl_ok(&[
        "--cacert",
        ca,
        "-H",
        &session,
        "-H",
        "Host: evil.example",
        "--write-out",
        "%{http_code}",
        "--output",
        "/dev/null",
        &format!("https://127.0.0.1:{port}/api/state"),
    ]);
    assert_eq!(rebound, "403");
    let own = curl_ok(&[
        "--cacert",
        ca,
        "--resolve",
        &resolve,
        "-H",
        &session,
        &format!("https://{NAME}:{port}/api/state"),
    ]);
    let state: Value = serde_json::from_str(&own).unwrap_or_else(|e| panic!("{e}: {own}"));
    assert!(
        state["jobs"].is_array() && state["nodes"].is_array(),
        "{own}"
    );
}

/// A head told to bind every address but given no names to answer to does not start
/// (nor stay up without its dashboard), and says which key to set.
fn refuses_every_address_without_names(root: &Path) {
    let head = Machine::new(root, "nameless");
    let out = head.run(&[
        "start",
        "--head",
        "--port",
        "0",
        "--dashboard-bind",
        "0.0.0.0",
        "--dashboard-port",
        "0",
    ]);
    assert!(!out.status.success(), "{}", describe(&out));
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("cluster.dashboard_hosts"), "{said}");
    // Nor does a head without its dashboard stay behind.
    assert_eq!(head.daemon_pids(), Vec::<u32>::new(), "{said}");
}
