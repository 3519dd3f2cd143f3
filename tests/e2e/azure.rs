//! `az://` URLs end to end against Azure's own emulator on loopback (Azurite, started by
//! the test: `common::azure::Azurite`), its containers made, filled and read through
//! Microsoft's Python client: listing shards by pattern, shards written straight into a
//! container (a shard of two blocks among them) read back by that client byte for byte, a
//! job that trains from the container exactly as from the same shards on disk and keeps
//! its checkpoints there, a resume from the container, and a missing blob named.

use std::path::Path;

use crate::common::azure::Azurite;
use crate::common::train::{
    Dataset, JOB_LIMIT, Job, checkpoint_dir, logged_sample_names, replica_digest,
};
use crate::common::{Machine, path_str};

const CONTAINER: &str = "shards";
const RUNS: &str = "runs";

#[test]
fn shards_and_checkpoints_in_azure_blob_storage_as_on_disk() {
    let Some(azurite) = Azurite::start() else {
        return;
    };
    let root = tempfile::tempdir().expect("temp dir");
    let data = Dataset::synth(root.path());
    azurite.create_container(CONTAINER);
    azurite.create_container(RUNS);
    azurite.upload_dir(CONTAINER, "train", &data.train_dir);
    let val_dir = Path::new(data.val.split_once("val-").map_or("", |(dir, _)| dir));
    azurite.upload_dir(CONTAINER, "val", val_dir);
    let mut machine = Machine::new(root.path(), "reader");
    machine.env = azurite.env();

    // Listing by pattern gives what the same shards on disk give.
    let columns = |text: &str| -> Vec<String> {
        text.lines()
            .map(|l| l.split_once('\t').map_or("", |(_, rest)| rest).to_string())
            .collect()
    };
    let listed = machine.run_ok(&["shards", "ls", &format!("az://{CONTAINER}/train/*.tar")]);
    assert_eq!(listed.lines().count(), 5, "five shards:\n{listed}");
    assert_eq!(
        columns(&listed),
        columns(&machine.run_ok(&["shards", "ls", &data.train])),
        "the same shards as on disk"
    );

    // Shards written straight into the container: the first, of about 8 MB, goes up in
    // two blocks; Microsoft's client reads back the bytes the same synth writes on disk.
    let synth = |out: &str| crate::common::synth_two_part_shards(&machine, out);
    synth(&format!("az://{CONTAINER}/up/"));
    let local = root.path().join("up");
    synth(path_str(&local));
    assert_eq!(
        azurite.list(CONTAINER, "up/"),
        [
            "up/classes.txt",
            "up/manifest.json",
            "up/up-000000.tar",
            "up/up-000001.tar"
        ]
    );
    for name in ["up-000000.tar", "up-000001.tar", "manifest.json"] {
        let on_disk = std::fs::read(local.join(name)).expect("the local copy");
        let in_container = azurite.get(CONTAINER, &format!("up/{name}"));
        assert!(
            in_container == on_disk,
            "{name} differs from the one on disk"
        );
    }
    let big = std::fs::metadata(local.join("up-000000.tar"))
        .expect("shard")
        .len();
    assert!(
        big > 5 << 20,
        "the first shard ({big} bytes) spans two blocks"
    );

    // A job from the container, with its checkpoints there too, equals one from disk.
    let runs = root.path().join("runs");
    let name = |spec: &str| spec.rsplit('/').next().unwrap_or(spec).to_string();
    let train = format!(
        "data.train=\"az://{CONTAINER}/train/{}\"",
        name(&data.train)
    );
    let val = format!("data.val=\"az://{CONTAINER}/val/{}\"", name(&data.val));
    let store = format!("train.checkpoint_store=\"az://{RUNS}/team\"");
    let job = |run: &str, epochs: u64, sets: &[&str], flags: &[&str]| {
        let mut sets = sets.to_vec();
        sets.push("train.sample_log=true");
        let args = data.job_args(&runs, run, epochs, &sets, false, flags);
        Job::start(&machine, &args, root.path()).finish(JOB_LIMIT)
    };
    let from_disk = job("disk", 2, &[], &[]);
    assert!(from_disk.status.success(), "{}", from_disk.describe());
    let from_container = job("azure", 2, &[&train, &val, &store], &[]);
    assert!(
        from_container.status.success(),
        "{}",
        from_container.describe()
    );
    assert_eq!(
        logged_sample_names(&runs.join("azure")),
        logged_sample_names(&runs.join("disk"))
    );
    assert!(
        !logged_sample_names(&runs.join("disk")).is_empty(),
        "no samples logged"
    );
    assert_eq!(
        replica_digest(&from_container.stdout),
        replica_digest(&from_disk.stdout)
    );
    let latest = azurite.get(RUNS, "team/azure/checkpoints/latest");
    let latest = String::from_utf8_lossy(&latest).trim().to_string();
    let local_latest = checkpoint_dir(&runs.join("azure"));
    assert_eq!(
        Some(latest.as_str()),
        local_latest.file_name().and_then(|n| n.to_str())
    );
    let state = azurite.get(RUNS, &format!("team/azure/checkpoints/{latest}/state.json"));
    assert!(
        state == std::fs::read(local_latest.join("state.json")).expect("state.json"),
        "the stored state.json differs from the run folder's"
    );

    // The run folder gone, `--resume az://...` continues the run for a third epoch.
    std::fs::remove_dir_all(runs.join("azure")).expect("remove the run folder");
    let resumed = job(
        "resumed",
        3,
        &[&train, &val],
        &["--resume", &format!("az://{RUNS}/team/azure")],
    );
    assert!(resumed.status.success(), "{}", resumed.describe());
    assert!(
        resumed.stdout.contains("copied from the store") && resumed.stdout.contains("    2 "),
        "{}",
        resumed.stdout
    );

    // A missing blob is named, with its container and name.
    let missing = machine.run(&["shards", "ls", &format!("az://{CONTAINER}/train/gone.tar")]);
    let text = String::from_utf8_lossy(&missing.stdout);
    assert!(
        text.contains("no such object (404 Not Found) (bucket `shards`, key `train/gone.tar`)"),
        "{text}"
    );
}
