//! The tests of `manifest.rs`: golden files of every kind, refused specs, and the YAML
//! writer's quoting.

use std::path::Path;

use super::*;
use crate::launch::CaPem;

/// A fixed secret of placeholders: the golden files hold no randomness.
fn fixed_secret() -> JoinSecret {
    JoinSecret {
        token: "0123456789abcdef0123456789abcdef".into(),
        ca_hash: format!("sha256:{}", "0".repeat(64)),
        ca: Some(CaPem {
            cert: "-----BEGIN CERTIFICATE-----\nplaceholder-certificate-line-1\n\
                   placeholder-certificate-line-2\n-----END CERTIFICATE-----\n"
                .into(),
            key: "-----BEGIN PRIVATE KEY-----\nplaceholder-key-line-1\n\
                  placeholder-key-line-2\n-----END PRIVATE KEY-----\n"
                .into(),
        }),
    }
}

/// The golden files' specs, one per kind: between them, every option.
fn golden_spec(kind: ManifestKind) -> ManifestSpec {
    let mut spec = ManifestSpec::new("imgrun-demo", "ghcr.io/example/imgrun:0.1.0", 4);
    spec.kind = kind;
    spec.args = ["--config", "train.toml", "--epochs", "90"]
        .map(String::from)
        .to_vec();
    match kind {
        ManifestKind::IndexedJob => {
            spec.namespace = Some("ml".into());
            spec.gpus_per_pod = 8;
            spec.cpu = Some("32".into());
            spec.memory = Some("256Gi".into());
            spec.queue = Some("team-a".into());
        }
        ManifestKind::JobSet => {
            spec.pods = 2;
            spec.gpus_per_pod = 1;
            spec.grace_secs = 300;
        }
        ManifestKind::TrainJob => {
            spec.namespace = Some("ml".into());
            spec.port = 29500;
            spec.gpus_per_pod = 4;
            spec.queue = Some("team-a".into());
        }
        ManifestKind::PyTorchJob => {
            spec.pods = 3;
            spec.gpus_per_pod = 2;
            spec.memory = Some("64Gi".into());
        }
    }
    spec
}

/// Compares `documents` with `tests/data/k8s/<stem>.yaml` and `<stem>.json`, or writes
/// them when `IMGRUN_UPDATE_GOLDEN` is set.
fn check_golden(stem: &str, documents: &[Node]) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/k8s");
    let json: Vec<serde_json::Value> = documents.iter().map(Node::to_json).collect();
    let json = serde_json::to_string_pretty(&json).expect("plain JSON values") + "\n";
    let files = [("yaml", to_yaml(documents)), ("json", json)];
    for (extension, output) in files {
        let path = dir.join(format!("{stem}.{extension}"));
        if std::env::var_os("IMGRUN_UPDATE_GOLDEN").is_some() {
            std::fs::write(&path, &output)
                .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
            continue;
        }
        let golden = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!("{}: {e} (IMGRUN_UPDATE_GOLDEN=1 writes it)", path.display())
        });
        if golden != output {
            let (golden, output): (Vec<_>, Vec<_>) =
                (golden.lines().collect(), output.lines().collect());
            let line = (0..golden.len().max(output.len()))
                .find(|&i| golden.get(i) != output.get(i))
                .unwrap_or(golden.len());
            panic!(
                "{}:{}: golden {:?}, output {:?} (IMGRUN_UPDATE_GOLDEN=1 rewrites it)",
                path.display(),
                line + 1,
                golden.get(line),
                output.get(line),
            );
        }
    }
}

/// Strings and keys YAML could misread, for `scalars.yaml`, which
/// `tests/python/k8s_validate.py --round-trip-only` reads back.
fn scalars_document() -> Node {
    let strings = [
        "plain",
        "two words",
        "",
        "true",
        "Yes",
        "off",
        "y",
        "NULL",
        "~",
        "None",
        "123",
        "-1",
        "0x1f",
        "0o17",
        "1.5",
        "1e3",
        ".inf",
        ".NaN",
        "2001-12-14",
        "1:20",
        "-dash",
        "- item",
        "a: b",
        "a:b",
        "a #c",
        "#c",
        "@at",
        "`tick",
        "'single",
        "\"double\"",
        "back\\slash",
        "{flow}",
        "[flow]",
        "a, b",
        "?q",
        "!tag",
        "&anchor",
        "*alias",
        "%directive",
        "|pipe",
        ">fold",
        "tab\there",
        "cr\rlf",
        "e\u{301}",
        "\u{e9}t\u{e9}",
        "line\u{2028}separator",
        "nel\u{85}",
        "bom\u{feff}",
        "crab \u{1f980}",
        "bell\u{7}",
        "del\u{7f}",
        "trailing ",
        " leading",
        "one\ntwo",
        "one\ntwo\n",
        "one\ntwo\n\n",
        " lead\nx",
        "\nlead",
        "x\n  indented\n",
        "a\n\nb\n",
        "x\n---\n...\n",
        "k: |\n  v",
        "trailing \nspace ",
        "x\n   \n",
    ];
    let keys = ["true", "a b", "nvidia.com/gpu", "", "1", "-", "é"];
    let numbers = [0, -1, i64::MAX, i64::MIN].map(Node::Int);
    Node::map([
        ("strings", Node::list(strings)),
        ("keys", Node::map(keys.map(|k| (k, Node::from(k))))),
        ("numbers", Node::List(numbers.into())),
        ("booleans", Node::list([true, false])),
        (
            "empty",
            Node::map([("list", Node::List(vec![])), ("map", Node::Map(vec![]))]),
        ),
        (
            "nested",
            Node::List(vec![
                Node::list(["a", "b"]),
                Node::List(vec![Node::map([
                    ("k", "v".into()),
                    ("l", Node::list(["x"])),
                ])]),
                Node::list(["multi\nline\n"]),
                Node::List(vec![]),
            ]),
        ),
    ])
}

#[test]
fn manifests_match_the_golden_files() {
    for kind in ManifestKind::ALL {
        let documents = manifest(&golden_spec(kind), &fixed_secret())
            .unwrap_or_else(|e| panic!("{}: {e}", kind.name()));
        check_golden(kind.name(), &documents);
    }
    check_golden(
        "scalars",
        &[scalars_document(), Node::from("a\nb"), Node::Int(1)],
    );
}

#[test]
fn scalars_are_quoted_where_yaml_would_misread_them() {
    let cases = [
        ("imgrun", "imgrun"),
        ("None", "None"),
        ("nvidia.com/gpu", "nvidia.com/gpu"),
        ("true", "\"true\""),
        ("Off", "\"Off\""),
        ("4", "\"4\""),
        ("", "\"\""),
        ("host:29400", "\"host:29400\""),
        ("a\"b\\c", "\"a\\\"b\\\\c\""),
        ("\u{e9}", "\"\\u00e9\""),
        ("\u{2028}", "\"\\u2028\""),
        ("\u{1f980}", "\"\\U0001f980\""),
    ];
    for (text, want) in cases {
        assert_eq!(scalar(text), want, "{text:?}");
    }
}

#[test]
fn refused_specs_name_their_field() {
    type Change = fn(&mut ManifestSpec);
    let cases: [(&str, Change); 17] = [
        ("name", |s| s.name = "Imgrun".into()),
        ("name", |s| s.name = "1job".into()),
        ("name", |s| s.name = "job-".into()),
        ("name", |s| s.name = "job.a".into()),
        ("name", |s| s.name = "a".repeat(53)),
        ("name", |s| {
            // 52 + "-worker-10000": a host name of 65 characters.
            (s.name, s.kind, s.pods) = ("a".repeat(52), ManifestKind::PyTorchJob, 10_002);
        }),
        ("namespace", |s| s.namespace = Some("Team_A".into())),
        ("image", |s| s.image = String::new()),
        ("image", |s| s.image = "a b".into()),
        ("pods", |s| s.pods = 0),
        ("pods", |s| s.pods = 100_001),
        ("port", |s| s.port = 0),
        ("queue", |s| s.queue = Some(String::new())),
        ("queue", |s| s.queue = Some("team a".into())),
        ("queue", |s| s.queue = Some("q".repeat(64))),
        ("cpu", |s| s.cpu = Some("lots".into())),
        ("memory", |s| s.memory = Some("64GB".into())),
    ];
    for (field, change) in cases {
        let mut spec = golden_spec(ManifestKind::IndexedJob);
        change(&mut spec);
        match manifest(&spec, &fixed_secret()) {
            Err(error @ ManifestError::Invalid { field: refused, .. }) => {
                assert_eq!(refused, field, "{spec:?}: {error}");
                assert!(error.to_string().starts_with(field), "{error}");
            }
            other => panic!("{spec:?}: {other:?}, not a refused {field}"),
        }
    }
    let mut longest = golden_spec(ManifestKind::JobSet);
    (longest.name, longest.pods) = ("a".repeat(52), 100);
    assert!(
        manifest(&longest, &fixed_secret()).is_ok(),
        "a 63-character host name"
    );
    let no_ca = JoinSecret {
        ca: None,
        ..fixed_secret()
    };
    let spec = golden_spec(ManifestKind::IndexedJob);
    assert_eq!(manifest(&spec, &no_ca), Err(ManifestError::NoCa));
}

/// Every string in `node`.
fn strings(node: &Node) -> Vec<&str> {
    match node {
        Node::Str(s) => vec![s],
        Node::List(items) => items.iter().flat_map(strings).collect(),
        Node::Map(entries) => entries
            .iter()
            .flat_map(|(k, v)| std::iter::once(k.as_str()).chain(strings(v)))
            .collect(),
        Node::Bool(_) | Node::Int(_) => Vec::new(),
    }
}

#[test]
fn the_secret_reaches_the_pods_only_by_reference() {
    let secret = fixed_secret();
    for kind in ManifestKind::ALL {
        let documents = manifest(&golden_spec(kind), &secret)
            .unwrap_or_else(|e| panic!("{}: {e}", kind.name()));
        let secret_strings = strings(&documents[0]);
        assert!(secret_strings.contains(&secret.token.as_str()), "{kind:?}");
        let rest: Vec<&str> = documents[1..].iter().flat_map(strings).collect();
        for text in &rest {
            let leaks = text.contains(&secret.token)
                || text.contains(&secret.ca_hash)
                || text.contains("-----BEGIN");
            assert!(!leaks, "{kind:?}: {text:?} outside the Secret");
        }
        for (var, key) in SECRET_VARS {
            assert!(
                rest.contains(&var) && rest.contains(&key),
                "{kind:?} lacks {var}"
            );
        }
        assert!(rest.contains(&"imgrun-demo-join"), "{kind:?}");
    }
}

#[test]
fn a_fresh_ca_prints_as_literal_blocks() {
    let ca = JoinSecret::generate()
        .expect("a fresh secret")
        .ca
        .expect("its CA");
    assert!(is_literal_block(&ca.cert), "{:?}", ca.cert);
    // Not the key itself in a message.
    assert!(is_literal_block(&ca.key), "the key's PEM");
}

#[test]
fn a_pytorchjob_of_one_pod_has_no_workers() {
    let mut spec = golden_spec(ManifestKind::PyTorchJob);
    spec.pods = 1;
    let documents = manifest(&spec, &fixed_secret()).expect("valid");
    let replicas = documents[1]
        .get("spec")
        .and_then(|spec| spec.get("pytorchReplicaSpecs"))
        .expect("replica specs");
    assert!(replicas.get("Worker").is_none(), "{replicas:?}");
    let master = replicas.get("Master").expect("a Master");
    assert_eq!(master.get("replicas"), Some(&Node::Int(1)));
}

#[test]
fn kinds_go_by_their_launcher_names() {
    let names = ManifestKind::ALL.map(ManifestKind::name);
    assert_eq!(names, ["indexed-job", "jobset", "trainjob", "pytorchjob"]);
    for kind in ManifestKind::ALL {
        assert_eq!(kind.name().parse::<ManifestKind>(), Ok(kind));
    }
    let unknown = ManifestError::UnknownKind { name: "job".into() };
    assert_eq!("job".parse::<ManifestKind>(), Err(unknown));
    assert_eq!(ManifestKind::default(), ManifestKind::IndexedJob);
}
