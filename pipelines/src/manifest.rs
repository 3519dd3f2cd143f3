//! The manifest written beside a set of shards: per shard its samples, bytes and class
//! counts, plus the class list. Planning (exact epochs) and training (number of classes)
//! read it back, matching its entries to shards by [`shard_name`].

use std::collections::BTreeMap;
use std::io::{self, Read};
use std::path::Path;

use serde::{Deserialize, Serialize};

pub use crate::shard_name::shard_name;
use crate::source::Sources;
use crate::writer::WrittenShard;

/// File name of the manifest in a shard folder.
pub const MANIFEST_FILE: &str = "manifest.json";

/// Current manifest format version.
const MANIFEST_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub version: u32,
    /// Class names; a sample's `cls` is an index into this list.
    pub classes: Vec<String>,
    pub shards: Vec<ManifestShard>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestShard {
    /// File name, relative to the manifest's folder.
    pub name: String,
    pub samples: u64,
    pub bytes: u64,
    /// Samples per class index (as decimal strings, JSON keys being strings).
    pub class_counts: BTreeMap<String, u64>,
}

impl Manifest {
    pub fn new(classes: Vec<String>, shards: &[WrittenShard]) -> Self {
        let shards = shards
            .iter()
            .map(|s| ManifestShard {
                name: s
                    .path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                samples: s.samples,
                bytes: s.bytes,
                class_counts: s
                    .class_counts
                    .iter()
                    .map(|(class, count)| (class.to_string(), *count))
                    .collect(),
            })
            .collect();
        Self {
            version: MANIFEST_VERSION,
            classes,
            shards,
        }
    }

    /// A manifest of shards already counted.
    pub fn from_shards(classes: Vec<String>, shards: Vec<ManifestShard>) -> Self {
        Self {
            version: MANIFEST_VERSION,
            classes,
            shards,
        }
    }

    pub fn total_samples(&self) -> u64 {
        self.shards.iter().map(|s| s.samples).sum()
    }

    pub fn total_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.bytes).sum()
    }

    /// Writes `manifest.json` and `classes.txt` into `dir` (atomically: temp + rename).
    pub fn write_to(&self, dir: &Path) -> io::Result<()> {
        self.write_file(&dir.join(MANIFEST_FILE))?;
        write_atomic(&dir.join("classes.txt"), self.classes_text().as_bytes())
    }

    /// `classes.txt`: the class names, a line each.
    pub fn classes_text(&self) -> String {
        let mut classes = self.classes.join("\n");
        if !classes.is_empty() {
            classes.push('\n');
        }
        classes
    }

    /// Writes the manifest alone to `path` (atomically: temp + rename).
    pub fn write_file(&self, path: &Path) -> io::Result<()> {
        let json = serde_json::to_vec_pretty(self).map_err(io::Error::other)?;
        write_atomic(path, &json)
    }

    /// Reads `manifest.json` from `dir`.
    pub fn read_from(dir: &Path) -> io::Result<Self> {
        let path = dir.join(MANIFEST_FILE);
        let bytes = std::fs::read(&path)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
        Self::from_json(&bytes, &path.display().to_string())
    }

    /// Reads a manifest from any location a shard could be at (a path, `file:`,
    /// `http(s)://`, a `pipe:` command), through `sources`.
    pub fn open(location: &str, sources: &Sources) -> io::Result<Self> {
        let mut bytes = Vec::new();
        sources
            .open(location)
            .map_err(|e| io::Error::other(e.to_string()))?
            .read_to_end(&mut bytes)
            .map_err(|e| io::Error::new(e.kind(), format!("{location}: {e}")))?;
        Self::from_json(&bytes, location)
    }

    /// Parses manifest JSON; `origin` names where it came from in errors.
    pub fn from_json(bytes: &[u8], origin: &str) -> io::Result<Self> {
        let manifest: Self = serde_json::from_slice(bytes)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{origin}: {e}")))?;
        if manifest.version != MANIFEST_VERSION {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{origin}: manifest version {} is not supported (expected {MANIFEST_VERSION})",
                    manifest.version
                ),
            ));
        }
        Ok(manifest)
    }
}

fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let temp = path.with_extension("partial");
    std::fs::write(&temp, bytes)?;
    std::fs::rename(&temp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_known_by_their_file_name() {
        let cases = [
            ("data/a-000001.tar", "a-000001.tar"),
            ("a-000001.tar", "a-000001.tar"),
            ("file:/d/a.tar.gz", "a.tar.gz"),
            ("http://h:8080/d/a-000001.tar", "a-000001.tar"),
            ("https://h/d/a.tar?X-Sig=abc/def#x", "a.tar"),
            ("pipe:cat /d/a-000001.tar", "a-000001.tar"),
            ("pipe:curl -s -f http://h/d/a.tar -o -", "a.tar"),
            ("pipe:gsutil cat 'gs://b/a.tar'", "a.tar"),
            ("pipe:aws s3 cp s3://b/a.tar - | zcat", "a.tar"),
            ("pipe:cat x", "x"),
        ];
        for (url, want) in cases {
            assert_eq!(shard_name(url), want, "{url}");
        }
    }

    #[test]
    fn round_trips_and_refuses_unknown_keys() {
        let dir = tempfile::tempdir().expect("temp dir");
        let shard = WrittenShard {
            path: dir.path().join("a-000000.tar"),
            samples: 3,
            bytes: 10240,
            payload_bytes: 30,
            first_key: "a".into(),
            last_key: "c".into(),
            class_counts: [(0, 2), (1, 1)].into_iter().collect(),
        };
        let manifest = Manifest::new(vec!["cat".into(), "dog".into()], &[shard]);
        manifest.write_to(dir.path()).expect("write");
        assert_eq!(Manifest::read_from(dir.path()).expect("read"), manifest);
        assert_eq!(
            std::fs::read_to_string(dir.path().join("classes.txt")).expect("classes"),
            "cat\ndog\n"
        );
        std::fs::write(
            dir.path().join(MANIFEST_FILE),
            br#"{"version":1,"classes":[],"shards":[],"extra":1}"#,
        )
        .expect("write");
        let err = Manifest::read_from(dir.path())
            .expect_err("unknown key")
            .to_string();
        assert!(
            err.contains("extra") && err.contains(MANIFEST_FILE),
            "{err}"
        );
    }
}
