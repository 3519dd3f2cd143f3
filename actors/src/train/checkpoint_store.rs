//! Checkpoints in an object store (`train.checkpoint_store = "s3://bucket/runs"`).
//!
//! Rank 0 writes each checkpoint into the run folder as always ([`checkpoint::write`]),
//! prunes the folder, then copies the checkpoint to `STORE/RUN/checkpoints/NAME/`
//! ([`upload`]): its tensors first and `state.json` last, then the object
//! `STORE/RUN/checkpoints/latest` naming it. A reader that follows `latest` therefore
//! finds a whole checkpoint, and a folder without `state.json` (an upload cut short) is
//! no checkpoint, as in a run folder. [`prune`] then keeps in the store what the run's
//! retention keeps, by the rule the run folder follows ([`checkpoint::to_prune`]),
//! deleting each pruned checkpoint's `state.json` before the rest.
//!
//! `--resume STORE/RUN` (or `STORE/RUN/checkpoints`, or one checkpoint's URL) is found
//! by [`locate`] and copied into the local run folder, `RUNS/RUN/checkpoints/NAME/`
//! ([`download`]), from where the job continues as from a local checkpoint. A trainer
//! that does not see that folder (it runs on another machine) copies it too.
//! Metrics stay in the run folder.

use std::io::Write;
use std::path::{Path, PathBuf};

use pipelines::{ObjectCopyError, ObjectProblem, S3Options, ShardError};

use super::checkpoint::{self, LATEST_FILE, Retention, STATE_FILE, SavedCheckpoint};
use super::file_error::{FileError, bad, io};

/// The folder of a store that holds a run's checkpoints.
const CHECKPOINTS: &str = "checkpoints";

/// Run `run`'s place in `store` (`s3://bucket/runs`): what `--resume` takes.
pub fn run_url(store: &str, run: &str) -> String {
    format!("{}/{run}", store.trim_end_matches('/'))
}

/// Where run `run`'s checkpoints go in `store`.
pub fn run_prefix(store: &str, run: &str) -> String {
    format!("{}/{CHECKPOINTS}", run_url(store, run))
}

/// Whether `text` names a place in an object store rather than a local path.
pub fn is_store_url(text: &str) -> bool {
    pipelines::is_object_url(text)
}

/// Copies the checkpoint folder `local` (written by [`checkpoint::write`]) to
/// `prefix/NAME/`, `state.json` last, then makes it the store's latest.
pub fn upload(prefix: &str, local: &Path, options: &S3Options) -> Result<(), FileError> {
    let name = folder_name(local)?;
    let mut files = Vec::new();
    for entry in std::fs::read_dir(local).map_err(io(local))? {
        let entry = entry.map_err(io(local))?;
        if entry.path().is_file() {
            files.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    for file in upload_order(files) {
        let path = local.join(&file);
        let url = format!("{prefix}/{name}/{file}");
        let mut source = std::fs::File::open(&path).map_err(io(&path))?;
        let mut writer = pipelines::ObjectWriter::create(&url, options)
            .map_err(|error| object_error(&url, &error))?;
        std::io::copy(&mut source, &mut writer).map_err(|error| write_error(&url, error))?;
        writer.finish().map_err(|error| write_error(&url, error))?;
    }
    let latest = format!("{prefix}/{LATEST_FILE}");
    pipelines::put_object(&latest, format!("{name}\n").into_bytes(), options)
        .map_err(|error| write_error(&latest, error))
}

/// A checkpoint's files in the order they go up: `state.json`, which makes the folder a
/// checkpoint, after all the others.
fn upload_order(mut files: Vec<String>) -> Vec<String> {
    files.sort_by_key(|file| (file == STATE_FILE, file.clone()));
    files
}

/// Removes from `prefix` the checkpoints that `retention` does not keep (the rule of
/// [`checkpoint::to_prune`], with the store's `latest`); returns their names. A folder
/// without a readable `state.json` is no checkpoint and stays.
pub fn prune(
    prefix: &str,
    retention: Retention,
    options: &S3Options,
) -> Result<Vec<String>, FileError> {
    if retention.keep == 0 {
        return Ok(Vec::new());
    }
    let listed =
        pipelines::list_objects(prefix, options).map_err(|error| object_error(prefix, &error))?;
    let latest_url = format!("{prefix}/{LATEST_FILE}");
    let latest = String::from_utf8_lossy(&read_small(&latest_url, options)?).into_owned();
    let mut saved = Vec::new();
    for name in checkpoint_names(prefix, &listed) {
        let url = format!("{prefix}/{name}/{STATE_FILE}");
        let state = read_small(&url, options)
            .ok()
            .and_then(|bytes| serde_json::from_slice::<checkpoint::CheckpointState>(&bytes).ok());
        if let Some(state) = state {
            saved.push(SavedCheckpoint {
                name,
                global_step: state.global_step,
                val_top1: state.val_top1,
            });
        }
    }
    let doomed = checkpoint::to_prune(&saved, latest.trim(), retention);
    for name in &doomed {
        let folder = format!("{prefix}/{name}/");
        let state = format!("{folder}{STATE_FILE}");
        pipelines::delete_object(&state, options).map_err(|error| object_error(&state, &error))?;
        for url in listed.iter().filter(|url| url.starts_with(&folder)) {
            pipelines::delete_object(url, options).map_err(|error| object_error(url, &error))?;
        }
    }
    Ok(doomed)
}

/// The checkpoints among the objects `listed` under `prefix`: the names of the folders
/// that hold a `state.json`, in order.
fn checkpoint_names(prefix: &str, listed: &[String]) -> Vec<String> {
    let folder = format!("{}/", prefix.trim_end_matches('/'));
    let mut names: Vec<String> = listed
        .iter()
        .filter_map(|url| url.strip_prefix(&folder))
        .filter_map(|rest| rest.strip_suffix(&format!("/{STATE_FILE}")))
        .filter(|name| !name.is_empty() && !name.contains('/'))
        .map(str::to_string)
        .collect();
    names.sort();
    names
}

/// A checkpoint found in a store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredCheckpoint {
    /// The checkpoint's folder, `STORE/RUN/checkpoints/NAME`.
    pub url: String,
    /// The store, `STORE`.
    pub store: String,
    /// Its run's name, and its own.
    pub run: String,
    pub name: String,
}

impl StoredCheckpoint {
    /// The checkpoint at `url`, when `url` has the shape `STORE/RUN/checkpoints/NAME`.
    fn at(url: &str) -> Option<Self> {
        let url = url.trim_end_matches('/');
        let (prefix, name) = url.rsplit_once('/')?;
        let run_folder = prefix.strip_suffix(&format!("/{CHECKPOINTS}"))?;
        let (store, run) = run_folder.rsplit_once('/')?;
        let has_bucket = is_store_url(store)
            && store
                .split_once("://")
                .is_some_and(|(_, bucket)| !bucket.is_empty());
        if name.is_empty() || run.is_empty() || !has_bucket {
            return None;
        }
        Some(Self {
            url: url.to_string(),
            store: store.to_string(),
            run: run.to_string(),
            name: name.to_string(),
        })
    }
}

/// Where to look for the checkpoint that `url` names, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Candidate {
    /// A checkpoint's own folder (it holds `state.json`).
    Checkpoint(String),
    /// A run's `checkpoints/` folder, whose `latest` names one.
    Latest(String),
}

/// The places `url` may mean: one checkpoint's folder, a run's `checkpoints/` folder or
/// a run's folder.
fn candidates(url: &str) -> Vec<Candidate> {
    let url = url.trim_end_matches('/');
    if url.ends_with(&format!("/{CHECKPOINTS}")) {
        return vec![Candidate::Latest(url.to_string())];
    }
    vec![
        Candidate::Checkpoint(url.to_string()),
        Candidate::Latest(format!("{url}/{CHECKPOINTS}")),
    ]
}

/// The checkpoint `url` names in its store: a checkpoint's folder, or the latest of a
/// run (`STORE/RUN`) or of its `checkpoints/` folder.
pub fn locate(url: &str, options: &S3Options) -> Result<StoredCheckpoint, FileError> {
    for candidate in candidates(url) {
        let folder = match candidate {
            Candidate::Checkpoint(folder) => {
                let state = format!("{folder}/{STATE_FILE}");
                if read_if_there(&state, options)?.is_none() {
                    continue;
                }
                folder
            }
            Candidate::Latest(prefix) => {
                let latest = format!("{prefix}/{LATEST_FILE}");
                let Some(named) = read_if_there(&latest, options)? else {
                    continue;
                };
                let name = String::from_utf8_lossy(&named).trim().to_string();
                let folder = format!("{prefix}/{name}");
                let state = format!("{folder}/{STATE_FILE}");
                if name.is_empty() || read_if_there(&state, options)?.is_none() {
                    return Err(bad(
                        Path::new(&latest),
                        format!("names `{name}`, which holds no {STATE_FILE}"),
                    ));
                }
                folder
            }
        };
        return StoredCheckpoint::at(&folder).ok_or_else(|| {
            bad(
                Path::new(&folder),
                format!("a checkpoint outside a run: want STORE/RUN/{CHECKPOINTS}/NAME"),
            )
        });
    }
    Err(bad(
        Path::new(url),
        format!(
            "no checkpoint there: neither {STATE_FILE} nor {CHECKPOINTS}/{LATEST_FILE} under it"
        ),
    ))
}

/// Copies the checkpoint at `url` into the folder `to` (made whole or not at all, as a
/// checkpoint written here is) and makes it the latest of `to`'s parent. Another process
/// that copied it there first is as good.
pub fn download(url: &str, to: &Path, options: &S3Options) -> Result<(), FileError> {
    let folder = format!("{}/", url.trim_end_matches('/'));
    let listed =
        pipelines::list_objects(&folder, options).map_err(|error| object_error(url, &error))?;
    let files: Vec<&str> = listed
        .iter()
        .filter_map(|object| object.strip_prefix(&folder))
        .filter(|file| !file.contains('/'))
        .collect();
    if !files.contains(&STATE_FILE) {
        return Err(bad(
            Path::new(url),
            format!("no checkpoint there (no {STATE_FILE})"),
        ));
    }
    let root = to
        .parent()
        .ok_or_else(|| bad(to, "a checkpoint folder needs a parent folder"))?;
    std::fs::create_dir_all(root).map_err(io(root))?;
    let name = folder_name(to)?;
    // Trainers of one process may copy the same checkpoint at once: each into its own.
    static DOWNLOADS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let partial = root.join(format!(
        ".{name}.download-{}-{}",
        std::process::id(),
        DOWNLOADS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let copied = copy_files(&folder, &files, &partial, options);
    if let Err(error) = copied {
        let _ = std::fs::remove_dir_all(&partial);
        return Err(error);
    }
    if let Err(error) = std::fs::rename(&partial, to) {
        let _ = std::fs::remove_dir_all(&partial);
        if !to.join(STATE_FILE).is_file() {
            return Err(io(to)(error));
        }
    }
    let latest = root.join(LATEST_FILE);
    std::fs::write(&latest, format!("{name}\n")).map_err(io(&latest))
}

/// `files` of the store's `folder` into the new local folder `to`, synced.
fn copy_files(
    folder: &str,
    files: &[&str],
    to: &Path,
    options: &S3Options,
) -> Result<(), FileError> {
    std::fs::create_dir(to).map_err(io(to))?;
    for file in files {
        let url = format!("{folder}{file}");
        let path = to.join(file);
        let mut out = std::fs::File::create(&path).map_err(io(&path))?;
        pipelines::copy_object(&url, &mut out, options).map_err(|error| match error {
            ObjectCopyError::Read(error) => object_error(&url, &error),
            ObjectCopyError::Write { error, .. } => io(&path)(error),
        })?;
        out.flush().map_err(io(&path))?;
        out.sync_all().map_err(io(&path))?;
    }
    Ok(())
}

/// A small object's bytes, or `None` where it is not there.
fn read_if_there(url: &str, options: &S3Options) -> Result<Option<Vec<u8>>, FileError> {
    let mut bytes = Vec::new();
    match pipelines::copy_object(url, &mut bytes, options) {
        Ok(_) => Ok(Some(bytes)),
        Err(error) if error.problem() == Some(&ObjectProblem::Missing) => Ok(None),
        Err(ObjectCopyError::Read(error)) => Err(object_error(url, &error)),
        Err(ObjectCopyError::Write { error, .. }) => Err(write_error(url, error)),
    }
}

/// A small object's bytes (`latest`, a `state.json`).
fn read_small(url: &str, options: &S3Options) -> Result<Vec<u8>, FileError> {
    let mut bytes = Vec::new();
    pipelines::copy_object(url, &mut bytes, options).map_err(|error| match error {
        ObjectCopyError::Read(error) => object_error(url, &error),
        ObjectCopyError::Write { error, .. } => write_error(url, error),
    })?;
    Ok(bytes)
}

/// The last part of a checkpoint folder's path: its name.
fn folder_name(dir: &Path) -> Result<String, FileError> {
    dir.file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .ok_or_else(|| bad(dir, "a checkpoint folder needs a name"))
}

/// A store's error about the object at `url`: what went wrong, with bucket and key when
/// the store answered.
fn object_error(url: &str, error: &ShardError) -> FileError {
    let message = match error {
        ShardError::Object {
            bucket,
            key,
            problem,
            ..
        } => format!("{problem} (bucket `{bucket}`, key `{key}`)"),
        other => other.to_string(),
    };
    bad(Path::new(url), message)
}

/// An upload's failure, named by `url` once: the store's words in the I/O error of
/// `pipelines::ObjectWriter` begin with it already.
fn write_error(url: &str, error: std::io::Error) -> FileError {
    let text = error.to_string();
    match text.strip_prefix(&format!("{url}: ")) {
        Some(rest) => bad(Path::new(url), rest),
        None => FileError::Io {
            path: PathBuf::from(url),
            error,
        },
    }
}

/// The object [`check`] writes and deletes.
const CHECK_OBJECT: &str = ".imgrun-write-check";

/// Whether `store` takes a write (its bucket is there and the credentials may write),
/// found by writing and deleting a small object there: before a job trains for a first
/// checkpoint it could not keep.
pub fn check(store: &str, options: &S3Options) -> Result<(), FileError> {
    let url = format!("{}/{CHECK_OBJECT}", store.trim_end_matches('/'));
    pipelines::put_object(&url, b"imgrun\n".to_vec(), options)
        .map_err(|error| write_error(&url, error))?;
    pipelines::delete_object(&url, options).map_err(|error| object_error(&url, &error))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_json_goes_up_last() {
        let files = ["state.json", "optimizer.ot", "model.ot", "replicas.ot"];
        assert_eq!(
            upload_order(files.iter().map(|f| f.to_string()).collect()),
            ["model.ot", "optimizer.ot", "replicas.ot", "state.json"]
        );
    }

    #[test]
    fn a_run_prefix_is_the_store_the_run_and_its_checkpoints() {
        for (store, want) in [
            ("s3://b/runs", "s3://b/runs/r1/checkpoints"),
            ("s3://b/runs/", "s3://b/runs/r1/checkpoints"),
            ("s3://b", "s3://b/r1/checkpoints"),
        ] {
            assert_eq!(run_prefix(store, "r1"), want, "{store}");
        }
    }

    #[test]
    fn checkpoints_are_the_folders_with_a_state() {
        let prefix = "s3://b/runs/r/checkpoints";
        let listed: Vec<String> = [
            "latest",
            "epoch-0001/model.ot",
            "epoch-0001/state.json",
            // An upload cut short: no state.
            "epoch-0002/model.ot",
            "step-000010/state.json",
            "deeper/x/state.json",
        ]
        .iter()
        .map(|key| format!("{prefix}/{key}"))
        .chain(["s3://b/runs/other/checkpoints/e/state.json".to_string()])
        .collect();
        assert_eq!(
            checkpoint_names(prefix, &listed),
            ["epoch-0001", "step-000010"]
        );
        assert_eq!(checkpoint_names(&format!("{prefix}/"), &listed).len(), 2);
    }

    #[test]
    fn a_resume_url_is_a_checkpoint_a_checkpoints_folder_or_a_run() {
        use Candidate::{Checkpoint, Latest};
        let table: &[(&str, Vec<Candidate>)] = &[
            (
                "s3://b/runs/r",
                vec![
                    Checkpoint("s3://b/runs/r".into()),
                    Latest("s3://b/runs/r/checkpoints".into()),
                ],
            ),
            (
                "s3://b/runs/r/",
                vec![
                    Checkpoint("s3://b/runs/r".into()),
                    Latest("s3://b/runs/r/checkpoints".into()),
                ],
            ),
            (
                "s3://b/runs/r/checkpoints/",
                vec![Latest("s3://b/runs/r/checkpoints".into())],
            ),
            (
                "s3://b/runs/r/checkpoints/epoch-0002",
                vec![
                    Checkpoint("s3://b/runs/r/checkpoints/epoch-0002".into()),
                    Latest("s3://b/runs/r/checkpoints/epoch-0002/checkpoints".into()),
                ],
            ),
        ];
        for (url, want) in table {
            assert_eq!(&candidates(url), want, "{url}");
        }
    }

    #[test]
    fn a_stored_checkpoint_is_store_run_checkpoints_name() {
        let found = StoredCheckpoint::at("s3://b/runs/r1/checkpoints/epoch-0002/")
            .expect("a checkpoint's place");
        assert_eq!(
            found,
            StoredCheckpoint {
                url: "s3://b/runs/r1/checkpoints/epoch-0002".into(),
                store: "s3://b/runs".into(),
                run: "r1".into(),
                name: "epoch-0002".into(),
            }
        );
        let top = StoredCheckpoint::at("s3://b/r1/checkpoints/e").expect("a run at the top");
        assert_eq!((top.store.as_str(), top.run.as_str()), ("s3://b", "r1"));
        for not_one in [
            "s3://b/runs/r1/epoch-0002",
            "s3://b/checkpoints/e",
            "s3://r1/checkpoints/e",
            "s3://b/runs/r1/checkpoints/",
        ] {
            assert_eq!(StoredCheckpoint::at(not_one), None, "{not_one}");
        }
    }
}
