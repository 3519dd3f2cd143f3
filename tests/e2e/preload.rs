//! End-to-end test of `data.preload`: a job on a head and a joined node copies the shards
//! each node reads into a node-local folder before training and reads the copies; a
//! second job finds them in place and never touches the source.

use crate::common::train::{JOB_LIMIT, TrainCluster};

/// Shards read through a `pipe:` command that works only while `gate` exists are
/// preloaded, once, by each node; with the gate gone, a second job trains from the
/// copies alone. A folder that cannot be made is refused naming the key.
#[test]
fn shards_are_preloaded_once_per_node_and_the_copies_are_read() {
    let cluster = TrainCluster::start();
    let dir = cluster.data.train_dir.display().to_string();
    let gate = cluster.root.path().join("gate");
    std::fs::write(&gate, b"open").expect("gate");
    let train = format!(
        "data.train=\"pipe:sh -c 'test -e {} && cat {dir}/train-{{000000..000004}}.tar'\"",
        gate.display()
    );
    let manifest = format!("data.manifest=\"{dir}/manifest.json\"");
    let local = cluster.root.path().join("local-ssd");
    let preload_dir = format!("data.preload_dir={:?}", local.display().to_string());
    let sets = [
        train.as_str(),
        manifest.as_str(),
        "data.preload=true",
        preload_dir.as_str(),
    ];

    let first = cluster.job("first", 2, &sets, false).finish(JOB_LIMIT);
    assert!(first.status.success(), "{}", first.describe());
    // Both nodes share this machine's folder here: the first node's copies are found by
    // the second or both copy; either way each shard is in place once.
    let said = first
        .stdout
        .lines()
        .find(|l| l.starts_with("preload: "))
        .unwrap_or_else(|| panic!("no preload line:\n{}", first.describe()))
        .to_string();
    assert!(said.contains("shard(s) copied"), "{said}");
    let copies = crate::common::tar_names(&local);
    let train_copies: Vec<String> = (0..5).map(|i| format!("train-{i:06}.tar")).collect();
    let mut want = train_copies.clone();
    want.extend((0..2).map(|i| format!("val-{i:06}.tar")));
    assert_eq!(copies, want, "one copy per training and validation shard");
    for name in &train_copies {
        let original = std::fs::read(cluster.data.train_dir.join(name)).expect("original");
        let copy = std::fs::read(local.join(name)).expect("copy");
        assert!(original == copy, "{name}: the copy differs from its shard");
    }

    // The source is gone: only the copies can feed the job.
    std::fs::remove_file(&gate).expect("close the gate");
    let second = cluster.job("second", 1, &sets, false).finish(JOB_LIMIT);
    assert!(second.status.success(), "{}", second.describe());
    assert!(
        second
            .stdout
            .contains("preload: 0 shard(s) copied (0.0 MB) and "),
        "{}",
        second.describe()
    );
    assert!(
        second.stdout.contains("replicas: identical"),
        "{}",
        second.describe()
    );

    // A preload folder that cannot be made is named.
    let blocked = cluster.root.path().join("a-file");
    std::fs::write(&blocked, b"").expect("file");
    let bad = format!(
        "data.preload_dir={:?}",
        blocked.join("sub").display().to_string()
    );
    let sets = [
        train.as_str(),
        manifest.as_str(),
        "data.preload=true",
        bad.as_str(),
    ];
    let out = cluster.job("blocked", 1, &sets, false).finish(JOB_LIMIT);
    assert!(!out.status.success(), "{}", out.describe());
    assert!(
        out.stderr.contains("data.preload_dir"),
        "{}",
        out.describe()
    );
    cluster.assert_settled();
}
