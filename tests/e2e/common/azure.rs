//! Azure Blob Storage on loopback for the tests of `az://` URLs: Azurite's blob server
//! (`tools/azurite.sh`), started by the test in a process group of its own and killed
//! when dropped, its containers made, filled and read through Microsoft's own Python client
//! (`tests/python/azure_blob.py`, in the venv of `tools/pytools.sh`).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::loopback::LoopbackServer;
use super::{describe, path_str, tools_python};

/// Azurite's blob server on `127.0.0.1`, keeping its blobs in a temporary folder.
pub struct Azurite {
    server: LoopbackServer,
    /// The venv's Python, which runs `azure_blob.py`.
    python: PathBuf,
}

impl Azurite {
    /// Starts the server on a free port and waits until it answers HTTP. `None` (after
    /// `skip_or_fail`) where `tools/azurite.sh` or `tools/pytools.sh` cannot install what
    /// it needs here.
    pub fn start() -> Option<Azurite> {
        let azurite = tools_python("tools/azurite.sh")?;
        let python = tools_python("tools/pytools.sh")?;
        let server = LoopbackServer::start("Azurite", |port, dir| {
            let mut command = Command::new(&azurite);
            command
                .args(["--blobHost", "127.0.0.1", "--blobPort", &port.to_string()])
                .args(["--location", path_str(dir), "--skipApiVersionCheck"]);
            command
        });
        Some(Azurite { server, python })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        self.server.endpoint()
    }

    /// The environment that an `imgrun` process needs to reach this server: the emulator's
    /// account at its address, and no Azure account of the developer's.
    pub fn env(&self) -> Vec<(String, String)> {
        [
            ("AZURE_STORAGE_USE_EMULATOR", "true".to_owned()),
            ("AZURITE_BLOB_STORAGE_URL", self.endpoint()),
            ("AZURE_STORAGE_ACCOUNT_NAME", "devstoreaccount1".to_owned()),
        ]
        .into_iter()
        .map(|(name, value)| (name.to_owned(), value))
        .collect()
    }

    /// Runs `azure_blob.py` with `args`; its stdout.
    fn blob(&self, args: &[&str]) -> Vec<u8> {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/azure_blob.py");
        let out = Command::new(&self.python)
            .arg(&script)
            .arg(self.endpoint())
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("run {}: {e}", self.python.display()));
        assert!(
            out.status.success(),
            "azure_blob.py {}: {}",
            args.join(" "),
            describe(&out)
        );
        out.stdout
    }

    pub fn create_container(&self, name: &str) {
        self.blob(&["create", name]);
    }

    /// Every file of `dir` as a blob `PREFIX/NAME` of `container`.
    pub fn upload_dir(&self, container: &str, prefix: &str, dir: &Path) {
        self.blob(&["upload-dir", container, prefix, path_str(dir)]);
    }

    /// The names in `container` that start with `prefix`.
    pub fn list(&self, container: &str, prefix: &str) -> Vec<String> {
        String::from_utf8_lossy(&self.blob(&["list", container, prefix]))
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// The bytes of the blob `name` in `container`.
    pub fn get(&self, container: &str, name: &str) -> Vec<u8> {
        self.blob(&["get", container, name])
    }
}
