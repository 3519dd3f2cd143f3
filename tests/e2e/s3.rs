//! `s3://` shards end to end, against a real S3 API on loopback (moto, started by the
//! test: `common::s3::Moto`) and through a fault proxy in front of it
//! (`common::s3::FaultProxy`): listing, indexing and verifying shards in a bucket, a job
//! that trains from the bucket as from the same shards on disk, reads that resume
//! through cut, stalled and throttled answers with the very same samples, and the errors
//! of a missing object, refused credentials, throttling to the end and an object
//! replaced mid-read; and checkpoints kept in a bucket, from which a killed job whose run
//! folder is gone resumes. Each `imgrun` gets the AWS environment of its test's server
//! alone.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use rustix::process::Signal;

use crate::common::s3::{FaultProxy, Moto};
use crate::common::train::{
    Dataset, JOB_LIMIT, Job, assert_checkpoint_at_last_step, assert_resumed_as_whole,
    checkpoint_dir, logged_sample_names, replica_digest, synth_shards, total_steps, wait_for_steps,
};
use crate::common::{Machine, describe, path_str, skip, wait_alive, wait_for};

const BUCKET: &str = "shards";

/// A bucket holding the tiny training and validation shards of `common::train`, and a
/// machine whose `imgrun` reaches it at `endpoint`.
struct Site {
    moto: Moto,
    machine: Machine,
    data: Dataset,
    root: tempfile::TempDir,
}

impl Site {
    /// `None` (after `skip_or_fail`) where moto cannot be installed here.
    fn start() -> Option<Site> {
        let moto = Moto::start()?;
        let root = tempfile::tempdir().expect("temp dir");
        let data = Dataset::synth(root.path());
        moto.create_bucket(BUCKET);
        moto.upload_dir(BUCKET, "train", &data.train_dir);
        let val_dir = Path::new(data.val.split_once("val-").map_or("", |(dir, _)| dir));
        moto.upload_dir(BUCKET, "val", val_dir);
        let mut machine = Machine::new(root.path(), "reader");
        machine.env = moto.env();
        Some(Site {
            moto,
            machine,
            data,
            root,
        })
    }

    /// The same shards as `data.train` and `data.val`, in the bucket.
    fn sets(&self) -> [String; 2] {
        let name = |spec: &str| spec.rsplit('/').next().unwrap_or(spec).to_string();
        [
            format!(
                "data.train=\"s3://{BUCKET}/train/{}\"",
                name(&self.data.train)
            ),
            format!("data.val=\"s3://{BUCKET}/val/{}\"", name(&self.data.val)),
        ]
    }

    /// Starts the tiny job `name` with `sets`, logging every step's samples.
    fn job(&self, name: &str, sets: &[&str]) -> Job {
        let runs = self.root.path().join("runs");
        let mut sets = sets.to_vec();
        sets.push("train.sample_log=true");
        let args = self
            .data
            .job_args(&runs, name, 2, &sets, false, &[] as &[&str]);
        Job::start(&self.machine, &args, self.root.path())
    }

    /// The samples of every step of the run `name`, each as `SHARD-NAME#KEY` (the URL's
    /// folder, which differs between a bucket and a disk, left out), with their epochs.
    fn samples(&self, name: &str) -> Vec<(u64, Vec<String>)> {
        logged_sample_names(&self.root.path().join("runs").join(name))
    }
}

/// `imgrun shards ls/index/verify` on `s3://` shards, by pattern and by brace spec; a job
/// trains from the bucket exactly as from the same shards on disk: the same samples in
/// every step and the same final replicas.
#[test]
fn shards_in_a_bucket_list_index_verify_and_train_as_on_disk() {
    let Some(site) = Site::start() else {
        return;
    };
    let pattern = format!("s3://{BUCKET}/train/*.tar");
    let listed = site.machine.run_ok(&["shards", "ls", &pattern]);
    let lines: Vec<&str> = listed.lines().collect();
    assert_eq!(lines.len(), 5, "five shards listed:\n{listed}");
    assert!(
        lines[0].starts_with(&format!("s3://{BUCKET}/train/train-000000.tar\t50 samples")),
        "{listed}"
    );
    let local = site.machine.run_ok(&["shards", "ls", &site.data.train]);
    let columns = |text: &str| -> Vec<String> {
        text.lines()
            .map(|l| l.split_once('\t').map_or("", |(_, rest)| rest).to_string())
            .collect()
    };
    assert_eq!(
        columns(&listed),
        columns(&local),
        "the same shards as on disk"
    );

    // With a shard cache, a second read needs no store: its endpoint is gone.
    let cache = site.root.path().join("cache");
    let brace = format!("s3://{BUCKET}/train/train-{{000000..000004}}.tar");
    let cached_ls = |endpoint: &str| {
        let mut command = site.machine.command(&["shards", "ls", &brace]);
        command.envs([
            ("IMGRUN_SHARDS__CACHE_DIR", path_str(&cache)),
            ("AWS_ENDPOINT_URL", endpoint),
            ("IMGRUN_S3__ATTEMPTS", "1"),
        ]);
        let out = command.output().expect("run imgrun shards ls");
        assert!(out.status.success(), "{}", describe(&out));
        columns(&String::from_utf8_lossy(&out.stdout))
    };
    assert_eq!(cached_ls(&site.moto.endpoint()), columns(&local));
    assert_eq!(
        cached_ls("http://127.0.0.1:9"),
        columns(&local),
        "read from the cache"
    );

    let manifest = site.root.path().join("s3-manifest.json");
    let printed = site
        .machine
        .run_ok(&["shards", "index", &pattern, "-o", path_str(&manifest)]);
    assert!(printed.contains("indexed 5 shards"), "{printed}");
    let verified = site.machine.run(&["shards", "verify", &pattern]);
    assert!(verified.status.success(), "{}", describe(&verified));

    let [train, val] = site.sets();
    let from_disk = site.job("disk", &[]).finish(JOB_LIMIT);
    assert!(from_disk.status.success(), "{}", from_disk.describe());
    let from_bucket = site.job("bucket", &[&train, &val]).finish(JOB_LIMIT);
    assert!(from_bucket.status.success(), "{}", from_bucket.describe());
    let samples = site.samples("bucket");
    assert!(!samples.is_empty(), "no samples logged");
    assert_eq!(
        samples,
        site.samples("disk"),
        "the same samples in every step"
    );
    assert_eq!(
        replica_digest(&from_bucket.stdout),
        replica_digest(&from_disk.stdout),
        "the same final replicas"
    );

    // `data.preload` copies the bucket's shards to a local folder, byte for byte, and the
    // job reads the copies.
    let local = site.root.path().join("local-ssd");
    let preload_dir = format!("data.preload_dir={:?}", path_str(&local));
    let preloaded = site
        .job(
            "preloaded",
            &[&train, &val, "data.preload=true", &preload_dir],
        )
        .finish(JOB_LIMIT);
    assert!(preloaded.status.success(), "{}", preloaded.describe());
    let copies = crate::common::tar_names(&local);
    // Resampled epochs draw shards with replacement: the shards the job reads, no more.
    assert!(
        preloaded
            .stdout
            .contains(&format!("preload: {} shard(s) copied", copies.len())),
        "copies {copies:?}\n{}",
        preloaded.describe()
    );
    assert!(copies.contains(&"val-000001.tar".to_string()), "{copies:?}");
    let val_dir = site.data.val.split_once("val-").map_or("", |(dir, _)| dir);
    for name in &copies {
        let dir = match name.starts_with("val-") {
            true => Path::new(val_dir),
            false => site.data.train_dir.as_path(),
        };
        let original = std::fs::read(dir.join(name)).expect("original");
        let copy = std::fs::read(local.join(name)).expect("copy");
        assert!(original == copy, "{name}: the copy differs from its shard");
    }
    assert_eq!(site.samples("preloaded"), site.samples("disk"));
    drop(site.moto);
}

/// Through a proxy that answers 503 Slow Down, cuts bodies short and stalls one past the
/// request timeout, a job reads the bucket in 64 KiB ranges, resumes every range, and
/// serves the very same samples in every step, with the same replicas, as a fault-free
/// run from disk.
#[test]
fn cut_stalled_and_throttled_reads_resume_with_the_same_samples() {
    let Some(mut site) = Site::start() else {
        return;
    };
    let proxy = FaultProxy::start(site.moto.address());
    site.machine.env = site.moto.env_via(&proxy.endpoint());
    proxy.slow_down(3);
    proxy.cut_after(3, 10_000);
    proxy.stall(1, 5_000, Duration::from_secs(5));
    proxy.cut_after(2, 0);
    let [train, val] = site.sets();
    let small_ranges = [
        train.as_str(),
        val.as_str(),
        "s3.chunk_size=\"64KiB\"",
        "s3.request_timeout_secs=2",
    ];
    let faulty = site.job("faulty", &small_ranges).finish(JOB_LIMIT);
    assert!(faulty.status.success(), "{}", faulty.describe());
    assert_eq!(
        proxy.faults_applied(),
        9,
        "every planned fault met a request"
    );
    assert!(
        proxy.ranged_gets_seen() > 20,
        "the shards were read in many ranges ({})",
        proxy.ranged_gets_seen()
    );
    let clean = site.job("clean", &[]).finish(JOB_LIMIT);
    assert!(clean.status.success(), "{}", clean.describe());
    assert_eq!(
        site.samples("faulty"),
        site.samples("clean"),
        "the same samples in every step"
    );
    assert_eq!(
        replica_digest(&faulty.stdout),
        replica_digest(&clean.stdout)
    );
}

/// A missing object, refused credentials and throttling to the end each fail with their
/// own words and the bucket and key; an object replaced while a read of it is stalled
/// fails with its ETag rather than mixing two versions.
#[test]
fn object_errors_name_bucket_key_and_cause() {
    let Some(mut site) = Site::start() else {
        return;
    };
    let missing = format!("s3://{BUCKET}/train/nope.tar");
    let out = site.machine.run(&["shards", "ls", &missing]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{}", describe(&out));
    assert!(
        said.contains("no such object (404 Not Found)")
            && said.contains("bucket `shards`, key `train/nope.tar`"),
        "{}",
        describe(&out)
    );
    let out = site
        .machine
        .run(&["shards", "ls", "s3://shards/train/none-*.tar"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("the pattern matches no object"),
        "{}",
        describe(&out)
    );

    let args = [
        "shards",
        "synth",
        "s3://no-bucket/x/",
        "--per-class",
        "2",
        "--size",
        "16",
    ];
    let out = site.machine.run(&args);
    assert!(!out.status.success(), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no such bucket (404 Not Found)"),
        "{}",
        describe(&out)
    );

    let proxy = FaultProxy::start(site.moto.address());
    site.machine.env = site.moto.env_via(&proxy.endpoint());
    let shard = format!("s3://{BUCKET}/train/train-000000.tar");
    let few_tries = [("IMGRUN_S3__ATTEMPTS", "3")];
    let ls = |env: &[(&str, &str)]| {
        let mut command = site.machine.command(&["shards", "ls", &shard]);
        command.envs(env.iter().copied());
        command.output().expect("run imgrun shards ls")
    };
    proxy.status(1, 403, "AccessDenied");
    let out = ls(&few_tries);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("access denied (403)"),
        "{}",
        describe(&out)
    );
    proxy.slow_down(3);
    let out = ls(&few_tries);
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .contains("503 Slow Down (throttled) to the end, after 3 attempts"),
        "{}",
        describe(&out)
    );
    assert_eq!(proxy.faults_applied(), 4);

    // A read stalls in its first range; meanwhile the object is replaced, so the resumed
    // range finds another ETag.
    let (_, replacement) = synth_shards(site.root.path(), "other", 10, 50, 7, 32);
    let other = Path::new(replacement.split_once("other-").map_or("", |(dir, _)| dir))
        .join("other-000000.tar");
    proxy.stall(1, 1_000, Duration::from_secs(10));
    let mut command = site.machine.command(&["shards", "ls", &shard]);
    command.envs([
        ("IMGRUN_S3__REQUEST_TIMEOUT_SECS", "4"),
        ("IMGRUN_S3__CHUNK_SIZE", "64KiB"),
    ]);
    let mut reading = Job::spawn(command, site.root.path());
    wait_for(Duration::from_secs(30), "the stalled range", || {
        (proxy.faults_applied() == 5).then_some(())
    });
    site.moto.put_file(BUCKET, "train/train-000000.tar", &other);
    let out = reading.finish(JOB_LIMIT);
    assert!(!out.status.success(), "{}", out.describe());
    assert!(
        out.stdout.contains("the object changed while it was read")
            && out.stdout.contains("key `train/train-000000.tar`"),
        "{}",
        out.describe()
    );
}

/// `imgrun shards synth` straight into a bucket: the shards (one past a 5 MiB upload part,
/// so uploaded in parts), `manifest.json` and `classes.txt` appear there and nowhere on
/// disk, no upload is left open, and Python webdataset reads them back through `pipe:aws
/// s3 cp` sample for sample as the same synth writes them on disk. `shards index -o` puts
/// a manifest in the bucket too.
#[test]
fn shards_written_straight_to_a_bucket_read_back_in_python() {
    let Some(site) = Site::start() else {
        return;
    };
    let Some(python) = crate::common::tools_python("tools/pytools.sh") else {
        return;
    };
    let synth = |out: &str| crate::common::synth_two_part_shards(&site.machine, out);
    let printed = synth(&format!("s3://{BUCKET}/up/"));
    assert!(
        printed.contains(&format!("s3://{BUCKET}/up/up-{{000000..000001}}.tar")),
        "{printed}"
    );
    let local = site.root.path().join("up");
    synth(path_str(&local));
    let keys = site.moto.list(BUCKET, "up/");
    assert_eq!(
        keys,
        [
            "up/classes.txt",
            "up/manifest.json",
            "up/up-000000.tar",
            "up/up-000001.tar"
        ],
        "in the bucket"
    );
    let big = std::fs::metadata(local.join("up-000000.tar"))
        .expect("shard")
        .len();
    assert!(
        big > 5 << 20,
        "the first shard ({big} bytes) spans two upload parts"
    );
    let open = site.moto.aws_ok(
        &site.moto.endpoint(),
        &["s3api", "list-multipart-uploads", "--bucket", BUCKET],
    );
    assert!(
        !String::from_utf8_lossy(&open).contains("UploadId"),
        "uploads left open: {}",
        String::from_utf8_lossy(&open)
    );
    let manifest = site.moto.aws_ok(
        &site.moto.endpoint(),
        &["s3", "cp", &format!("s3://{BUCKET}/up/manifest.json"), "-"],
    );
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&manifest).expect("manifest json"),
        crate::common::train::read_json(&local.join("manifest.json")),
    );

    // Python webdataset, through `pipe:aws s3 cp`, copies what it reads.
    let aws = path_str(site.moto.aws_cli()).to_string();
    let endpoint = site.moto.endpoint();
    let urls: Vec<String> = ["up-000000.tar", "up-000001.tar"]
        .iter()
        .map(|name| format!("pipe:{aws} --endpoint-url {endpoint} s3 cp s3://{BUCKET}/up/{name} -"))
        .collect();
    let copy = site.root.path().join("py");
    std::fs::create_dir_all(&copy).expect("create py/");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/wds_copy.py");
    let out = std::process::Command::new(&python)
        .arg(script)
        .arg(copy.join("py-%06d.tar"))
        .arg("1000")
        .args(&urls)
        .envs(site.moto.env())
        .output()
        .expect("run wds_copy.py");
    assert!(out.status.success(), "wds_copy.py:\n{}", describe(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "360");
    let dump = |spec: &str| site.machine.run_ok(&["shards", "dump", spec]);
    assert_eq!(
        dump(path_str(&copy.join("py-000000.tar"))),
        dump(&format!("{}/up-{{000000..000001}}.tar", local.display())),
        "Python read back what was written"
    );

    let index = site.machine.run_ok(&[
        "shards",
        "index",
        &format!("s3://{BUCKET}/up/*.tar"),
        "-o",
        &format!("s3://{BUCKET}/indexed/"),
    ]);
    assert!(
        index.contains(&format!("wrote s3://{BUCKET}/indexed/manifest.json")),
        "{index}"
    );
    assert_eq!(
        site.moto.list(BUCKET, "indexed/"),
        ["indexed/manifest.json"]
    );
}

/// Checkpoints to a bucket (`train.checkpoint_store`): each goes there too, pruned to
/// `train.keep_checkpoints` with `latest` naming the newest; a job stopped by SIGTERM
/// mid-epoch copies its last checkpoint there before it exits; with its run folder gone,
/// `--resume s3://BUCKET/PREFIX/RUN` copies it back, goes on saving there, and ends with
/// the weights of an uninterrupted run.
#[test]
fn checkpoints_in_a_bucket_resume_a_killed_job_whose_run_folder_is_gone() {
    const EPOCHS: u64 = 3;
    const STORE_BUCKET: &str = "checkpoints";
    let Some(site) = Site::start() else {
        return;
    };
    site.moto.create_bucket(STORE_BUCKET);
    let runs = site.root.path().join("runs");
    let store = format!("train.checkpoint_store=\"s3://{STORE_BUCKET}/team\"");
    let sets = [
        store.as_str(),
        "train.eval_every_epochs=0",
        "train.checkpoint_every_steps=3",
        "train.keep_checkpoints=2",
    ];
    let start = |name: &str, flags: &[&str]| {
        let args = site.data.job_args(&runs, name, EPOCHS, &sets, false, flags);
        Job::start(&site.machine, &args, site.root.path())
    };
    let whole = start("whole", &[]).finish(JOB_LIMIT);
    assert!(whole.status.success(), "{}", whole.describe());

    let run = runs.join("cut");
    let mut job = start("cut", &[]);
    wait_for_steps(&mut job, &run, 8);
    job.signal(Signal::TERM);
    let cut = job.finish(JOB_LIMIT);
    assert_eq!(cut.status.code(), Some(143), "{}", cut.describe());
    let url = format!("s3://{STORE_BUCKET}/team/cut");
    assert!(
        cut.stderr
            .contains(&format!("(or, on any machine, --resume {url})")),
        "{}",
        cut.stderr
    );
    let saved_step = assert_checkpoint_at_last_step(&run);
    assert!(
        saved_step < total_steps(&cut.stdout, EPOCHS),
        "not cut: step {saved_step}"
    );
    let local_latest = checkpoint_dir(&run);
    let stored = |run: &str| -> (String, Vec<String>) {
        let prefix = format!("team/{run}/checkpoints/");
        let keys = site.moto.list(STORE_BUCKET, &prefix);
        let names: Vec<String> = keys
            .iter()
            .filter_map(|k| k.strip_prefix(&prefix)?.strip_suffix("/state.json"))
            .map(str::to_string)
            .collect();
        let latest = site.moto.get(STORE_BUCKET, &format!("{prefix}latest"));
        (String::from_utf8_lossy(&latest).trim().to_string(), names)
    };
    let (latest, names) = stored("cut");
    assert_eq!(
        Some(latest.as_str()),
        local_latest.file_name().and_then(|n| n.to_str()),
        "the store's latest is the run folder's"
    );
    assert_eq!(names.len(), 2, "pruned to keep_checkpoints: {names:?}");
    assert!(names.contains(&latest), "{latest} in {names:?}");
    let in_store = site.moto.get(
        STORE_BUCKET,
        &format!("team/cut/checkpoints/{latest}/model.ot"),
    );
    let on_disk = std::fs::read(local_latest.join("model.ot")).expect("model.ot");
    assert!(
        in_store == on_disk,
        "the stored model.ot differs from the saved one"
    );

    // Another machine: the run folder is not there.
    std::fs::remove_dir_all(&run).expect("remove the run folder");
    let resumed = start("resumed", &["--resume", &url]).finish(JOB_LIMIT);
    assert!(resumed.status.success(), "{}", resumed.describe());
    assert!(
        resumed.stdout.contains("copied from the store"),
        "{}",
        resumed.stdout
    );
    assert_resumed_as_whole(&resumed, saved_step, &whole);
    let (latest, names) = stored("cut");
    assert_eq!(
        Some(latest.as_str()),
        checkpoint_dir(&run).file_name().and_then(|n| n.to_str()),
        "the resumed run saved on into the store"
    );
    assert!(names.len() <= 2, "{names:?}");

    // A store whose bucket is missing is refused before the job trains, naming it.
    let args = site.data.job_args(
        &runs,
        "nowhere",
        EPOCHS,
        &[
            "train.checkpoint_store=\"s3://no-such-bucket/team\"",
            "train.checkpoint_every_steps=3",
        ],
        false,
        &[] as &[&str],
    );
    let nowhere = Job::start(&site.machine, &args, site.root.path()).finish(JOB_LIMIT);
    assert!(!nowhere.status.success(), "{}", nowhere.describe());
    assert!(
        nowhere.stderr.contains(
            "train.checkpoint_store: s3://no-such-bucket/team/.imgrun-write-check: no such bucket"
        ) && !nowhere.stdout.contains("epoch "),
        "{}",
        nowhere.stderr
    );

    // A URL with no checkpoint under it is named.
    let missing = format!("s3://{STORE_BUCKET}/team/nothing");
    let refused = start("refused", &["--resume", &missing]).finish(JOB_LIMIT);
    assert!(!refused.status.success(), "{}", refused.describe());
    assert!(
        refused.stderr.contains(&missing) && refused.stderr.contains("no checkpoint there"),
        "{}",
        refused.stderr
    );
}

/// Two machines, and the node does not see the head's disk (its daemon, and so its
/// trainer, runs in a mount namespace with an empty tmpfs over the runs folder): a job
/// that keeps its checkpoints in a bucket is stopped by SIGTERM, its run folder removed,
/// and `--resume s3://...` continues it. The head copies the checkpoint into its run
/// folder; the node's trainer, which cannot see that copy, fetches its own from the
/// bucket; the job ends with the weights of an uninterrupted run.
#[test]
fn a_trainer_that_cannot_see_the_run_folder_resumes_from_the_bucket() {
    const EPOCHS: u64 = 2;
    let Some(site) = Site::start() else {
        return;
    };
    site.moto.create_bucket("checkpoints");
    let root = site.root.path();
    let runs = root.join("runs");
    std::fs::create_dir_all(&runs).expect("create runs/");
    // Only root may make a mount namespace here.
    let probe = Command::new("unshare")
        .args(["--mount", "true"])
        .output()
        .map(|out| out.status.success());
    if probe.as_ref().is_ok_and(|made| !made) || probe.is_err() {
        skip::skip_or_fail("a mount namespace for the node (`unshare --mount`, needs root)");
        return;
    }
    let mut head = Machine::new(root, "head");
    head.env = site.moto.env();
    let mut node = Machine::new(root, "node");
    node.env = site.moto.env();
    node.private_dir = Some(runs.clone());
    let seen = runs.join("seen.tar");
    std::fs::copy(site.data.train_dir.join("train-000000.tar"), &seen).expect("copy a shard");
    assert!(
        head.run(&["shards", "ls", path_str(&seen)])
            .status
            .success()
    );
    assert!(
        !node
            .run(&["shards", "ls", path_str(&seen)])
            .status
            .success(),
        "the node sees the head's runs folder"
    );

    let bind = ["--bind", "127.0.0.1", "--num-gpus", "0"];
    let join = head.start_head(&bind);
    let joined = node.join(&join, &bind);
    assert!(joined.status.success(), "{}", describe(&joined));
    wait_alive(&head, 2, Duration::from_secs(10));
    let sets = [
        "train.checkpoint_store=\"s3://checkpoints/team\"",
        "train.eval_every_epochs=0",
        "train.checkpoint_every_steps=3",
    ];
    let start = |name: &str, flags: &[&str]| {
        let args = site.data.job_args(&runs, name, EPOCHS, &sets, false, flags);
        Job::start(&head, &args, root)
    };
    let whole = start("whole", &[]).finish(JOB_LIMIT);
    assert!(whole.status.success(), "{}", whole.describe());
    assert!(
        whole.stdout.contains("2 node(s) x 1 rank(s)"),
        "{}",
        whole.stdout
    );

    let run = runs.join("cut");
    let mut job = start("cut", &[]);
    wait_for_steps(&mut job, &run, 4);
    job.signal(Signal::TERM);
    let cut = job.finish(JOB_LIMIT);
    assert_eq!(cut.status.code(), Some(143), "{}", cut.describe());
    let saved_step = assert_checkpoint_at_last_step(&run);
    std::fs::remove_dir_all(&run).expect("remove the run folder");

    let resumed = start("resumed", &["--resume", "s3://checkpoints/team/cut"]).finish(JOB_LIMIT);
    assert!(resumed.status.success(), "{}", resumed.describe());
    assert_resumed_as_whole(&resumed, saved_step, &whole);
}
