//! The head's credentials in the state folder: the cluster CA and the join token, created
//! at the first start and loaded at every later one (so a restarted head is the same
//! cluster to its nodes), and the certificate of the commands run on the head's machine.
//!
//! Layout (every file mode 0600, folders 0700):
//! - `head/ca.pem`, `head/ca-key.pem`: the cluster CA;
//! - `head/token`: the join token;
//! - `client/ca.pem`, `client/node.pem`, `client/node-key.pem`: the certificate (common
//!   name `client`) with which `imgrun status` and `imgrun stop --all` talk to the head.
//!
//! The head's own certificate (common name `head`) is issued at each start and never
//! written: whoever verifies it needs only the CA.

use std::path::{Path, PathBuf};

use tracing::info;

use crate::daemon::{CLIENT_NAME, DaemonError, HEAD_NAME};
use crate::state::{CLIENT_DIR, StateDir};
use crate::tls::{CaCertificate, ClusterCa, JoinToken, NodeCredentials, ServerTls, SubjectAltName};

/// The folder of the CA and the token.
const HEAD_DIR: &str = "head";
/// The join token's file.
const TOKEN_FILE: &str = "head/token";

/// What a head needs to serve.
pub(super) struct HeadCredentials {
    pub(super) ca: ClusterCa,
    pub(super) token: JoinToken,
    /// The head's own certificate.
    pub(super) head: NodeCredentials,
}

/// Loads the CA and token from `state`, creating whichever is missing, issues the head's
/// certificate, and makes sure `client/` holds a certificate of this CA.
pub(super) fn load_or_create(state: &StateDir) -> Result<HeadCredentials, DaemonError> {
    let head_dir = state.ensure_dir(HEAD_DIR)?;
    let ca = load_or_create_ca(&head_dir)?;
    let token = match state.read(TOKEN_FILE)? {
        Some(bytes) => String::from_utf8_lossy(&bytes)
            .parse::<JoinToken>()
            .map_err(|source| DaemonError::Credentials {
                dir: state.path(TOKEN_FILE),
                source,
            })?,
        None => {
            let token = JoinToken::generate();
            state.write_private(TOKEN_FILE, format!("{}\n", token.as_str()).as_bytes())?;
            token
        }
    };
    let head = ca.issue(HEAD_NAME, &[])?;
    ensure_client_credentials(state, &ca)?;
    Ok(HeadCredentials { ca, token, head })
}

/// Puts a CA and a token made elsewhere (a launch's join secret) into `state`, where
/// [`load_or_create`] finds them: the head then serves with the CA its nodes pin.
pub fn preset_credentials(
    state: &StateDir,
    ca: &ClusterCa,
    token: &JoinToken,
) -> Result<(), DaemonError> {
    let head_dir = state.ensure_dir(HEAD_DIR)?;
    ca.save(&head_dir)
        .map_err(|source| DaemonError::Credentials {
            dir: head_dir.clone(),
            source,
        })?;
    state.write_private(TOKEN_FILE, format!("{}\n", token.as_str()).as_bytes())?;
    Ok(())
}

/// How the head's web dashboard serves HTTPS: a certificate the cluster CA signs for
/// `names` (the addresses and host names clients reach it by), and the CA certificate
/// file those clients are to trust. The head must have started once in `state`, so that
/// its CA is there.
pub fn web_tls(state: &StateDir, names: &[SubjectAltName]) -> Result<WebTls, DaemonError> {
    let dir = state.path(HEAD_DIR);
    let ca = ClusterCa::load(&dir).map_err(|source| DaemonError::Credentials {
        dir: dir.clone(),
        source,
    })?;
    let own = ca.issue(WEB_NAME, names)?;
    Ok(WebTls {
        server: ServerTls::web(ca.certificate(), &own)?,
        ca_file: dir.join(CA_CERT_FILE),
    })
}

/// What [`web_tls`] gives.
#[derive(Debug, Clone)]
pub struct WebTls {
    pub server: ServerTls,
    /// `head/ca.pem`: what a browser, `curl --cacert` or a scraper's `ca_file` trusts.
    pub ca_file: PathBuf,
}

/// The common name of the dashboard's certificate.
const WEB_NAME: &str = "dashboard";

/// The CA certificate's file in [`HEAD_DIR`].
const CA_CERT_FILE: &str = "ca.pem";

/// The CA in `dir`, or a new one saved there when there is none. A CA that is there but
/// unreadable is an error: replacing it would cut off every node of the cluster.
fn load_or_create_ca(dir: &Path) -> Result<ClusterCa, DaemonError> {
    let credentials_error = |source| DaemonError::Credentials {
        dir: dir.to_owned(),
        source,
    };
    let present = [CA_CERT_FILE, "ca-key.pem"]
        .iter()
        .any(|file| dir.join(file).exists());
    if present {
        return ClusterCa::load(dir).map_err(credentials_error);
    }
    let ca = ClusterCa::generate()?;
    ca.save(dir).map_err(credentials_error)?;
    info!(ca_hash = %ca.ca_hash(), dir = %dir.display(), "created the cluster CA");
    Ok(ca)
}

/// Issues the `client` certificate unless `client/` already holds one of this CA.
fn ensure_client_credentials(state: &StateDir, ca: &ClusterCa) -> Result<(), DaemonError> {
    let dir = state.path(CLIENT_DIR);
    let current = CaCertificate::load(&dir).is_ok_and(|saved| saved.hash() == ca.ca_hash())
        && NodeCredentials::load(&dir).is_ok_and(|saved| saved.name().is_ok());
    if current {
        return Ok(());
    }
    let credentials_error = |source| DaemonError::Credentials {
        dir: dir.clone(),
        source,
    };
    let client = ca.issue(CLIENT_NAME, &[])?;
    client.save(&dir).map_err(credentials_error)?;
    ca.certificate().save(&dir).map_err(credentials_error)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_created_once_and_reloaded() {
        let dir = tempfile::tempdir().expect("temp dir");
        let state = StateDir::at(dir.path().join("state"));
        let first = load_or_create(&state).expect("first start");
        let client = NodeCredentials::load(&state.path(CLIENT_DIR)).expect("client");
        assert_eq!(client.name().expect("name"), CLIENT_NAME);
        assert_eq!(first.head.name().expect("name"), HEAD_NAME);
        let again = load_or_create(&state).expect("second start");
        assert_eq!(again.ca.ca_hash(), first.ca.ca_hash());
        assert_eq!(again.token.as_str(), first.token.as_str());
        let client_again = NodeCredentials::load(&state.path(CLIENT_DIR)).expect("client");
        assert_eq!(client_again.cert_pem, client.cert_pem, "kept, not reissued");
    }

    #[test]
    fn a_broken_ca_or_token_is_an_error_not_a_new_cluster() {
        let cases = [("head/ca-key.pem", "ca-key"), ("head/token", "token")];
        for (file, what) in cases {
            let dir = tempfile::tempdir().expect("temp dir");
            let state = StateDir::at(dir.path());
            load_or_create(&state).expect("first start");
            state.write_private(file, b"garbage").expect("break it");
            let Err(error) = load_or_create(&state) else {
                panic!("{what}: a broken file was accepted");
            };
            assert!(
                matches!(error, DaemonError::Credentials { .. }),
                "{what}: {error}"
            );
            assert!(error.to_string().contains("head"), "{what}: {error}");
        }
    }

    #[test]
    fn the_web_certificate_is_the_cluster_cas_and_needs_one() {
        let dir = tempfile::tempdir().expect("temp dir");
        let state = StateDir::at(dir.path().join("state"));
        let Err(error) = web_tls(&state, &[]) else {
            panic!("a head that never started has no CA to sign with");
        };
        assert!(matches!(error, DaemonError::Credentials { .. }), "{error}");
        let head = load_or_create(&state).expect("first start");
        let names = [SubjectAltName::Dns("dash.example".to_owned())];
        let web = web_tls(&state, &names).expect("web tls");
        let trusted = CaCertificate::load(web.ca_file.parent().expect("folder")).expect("ca.pem");
        assert_eq!(trusted.hash(), head.ca.ca_hash());
        assert_eq!(
            web.server.rustls().alpn_protocols,
            vec![b"http/1.1".to_vec()]
        );
    }
}
