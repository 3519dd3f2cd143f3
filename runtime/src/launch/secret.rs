//! A launch's join secret from the environment (a Kubernetes Secret as `secretKeyRef`
//! variables) rather than from a rendezvous file: the join token and the CA hash every
//! process needs, and the CA itself, which only process 0's head needs. Read and checked
//! as a pure function of the environment; [`JoinSecret::generate`] makes a fresh one for
//! a manifest.

use std::fmt;

use super::LaunchError;
use super::names::{CA_CERT_VAR, CA_HASH_VAR, CA_KEY_VAR, TOKEN_VAR};
use crate::tls::{CaHash, ClusterCa, JoinToken, TlsError};

/// The join secret a launch's processes share.
#[derive(Clone, PartialEq, Eq)]
pub struct JoinSecret {
    /// The join token (32 hex digits).
    pub token: String,
    /// The CA's hash, `sha256:...`, that joining nodes pin.
    pub ca_hash: String,
    /// The CA's certificate and key, PEM: what process 0's head serves with. `None` in
    /// the other processes, which need not see the key.
    pub ca: Option<CaPem>,
}

/// A cluster CA as PEM text.
#[derive(Clone, PartialEq, Eq)]
pub struct CaPem {
    pub cert: String,
    pub key: String,
}

// The key never reaches a log.
impl fmt::Debug for CaPem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<CA certificate and key>")
    }
}

impl JoinSecret {
    /// A fresh CA and token.
    pub fn generate() -> Result<Self, TlsError> {
        let ca = ClusterCa::generate()?;
        Ok(Self {
            token: JoinToken::generate().as_str().to_owned(),
            ca_hash: ca.ca_hash().to_string(),
            ca: Some(CaPem {
                cert: ca.certificate().pem().to_owned(),
                key: ca.key_pem(),
            }),
        })
    }
}

// The token and the key never reach a log.
impl fmt::Debug for JoinSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JoinSecret")
            .field("ca_hash", &self.ca_hash)
            .field("ca", &self.ca)
            .finish_non_exhaustive()
    }
}

/// The join secret in `env`, if [`TOKEN_VAR`] is set: the others must be too, and must
/// fit (the token's form, the hash's form, the CA's hash equal to the one given). Process
/// 0 (`head`) needs the CA; the others ignore it.
pub fn join_secret(
    launcher: &'static str,
    head: bool,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<JoinSecret>, LaunchError> {
    let Some(token) = env(TOKEN_VAR) else {
        return Ok(None);
    };
    let invalid = |name: &'static str, value: &str, error: TlsError| LaunchError::Invalid {
        launcher,
        name,
        // Never the secret itself in a message.
        value: format!("<{} characters>", value.len()),
        reason: error.to_string(),
    };
    let missing = |name| LaunchError::Missing { launcher, name };
    let token = token.trim().to_owned();
    token
        .parse::<JoinToken>()
        .map_err(|e| invalid(TOKEN_VAR, &token, e))?;
    let ca_hash = env(CA_HASH_VAR).ok_or(missing(CA_HASH_VAR))?;
    let ca_hash = ca_hash.trim().to_owned();
    let pinned: CaHash = ca_hash.parse().map_err(|e| LaunchError::Invalid {
        launcher,
        name: CA_HASH_VAR,
        value: ca_hash.clone(),
        reason: format!("{e}"),
    })?;
    if !head {
        return Ok(Some(JoinSecret {
            token,
            ca_hash,
            ca: None,
        }));
    }
    let cert = env(CA_CERT_VAR).ok_or(missing(CA_CERT_VAR))?;
    let key = env(CA_KEY_VAR).ok_or(missing(CA_KEY_VAR))?;
    let ca = ClusterCa::from_pem(&cert, &key).map_err(|e| invalid(CA_CERT_VAR, &cert, e))?;
    if ca.ca_hash() != pinned {
        return Err(LaunchError::Inconsistent {
            launcher,
            message: format!(
                "{CA_CERT_VAR} is the CA {} but {CA_HASH_VAR} pins {ca_hash}: the others \
                 would refuse this head (take all four values from one Secret)",
                ca.ca_hash()
            ),
        });
    }
    Ok(Some(JoinSecret {
        token,
        ca_hash,
        ca: Some(CaPem { cert, key }),
    }))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn env_of(vars: Vec<(&'static str, String)>) -> impl Fn(&str) -> Option<String> {
        let map: BTreeMap<&str, String> = vars.into_iter().collect();
        move |name| map.get(name).cloned()
    }

    #[test]
    fn a_secret_from_the_environment_is_whole_and_fits_together() {
        let secret = JoinSecret::generate().expect("a fresh secret");
        let ca = secret.ca.clone().expect("a fresh secret has its CA");
        let other = JoinSecret::generate().expect("another");
        let all = || {
            vec![
                (TOKEN_VAR, secret.token.clone()),
                (CA_HASH_VAR, secret.ca_hash.clone()),
                (CA_CERT_VAR, ca.cert.clone()),
                (CA_KEY_VAR, ca.key.clone()),
            ]
        };
        let head = join_secret("indexed-job", true, &env_of(all())).expect("valid");
        assert_eq!(head, Some(secret.clone()));
        let follower = join_secret("indexed-job", false, &env_of(all()[..2].to_vec()))
            .expect("a follower needs no CA");
        assert_eq!(follower.expect("a secret").ca, None);
        assert_eq!(join_secret("indexed-job", true, &env_of(vec![])), Ok(None));

        let without = |name: &str| all().into_iter().filter(|(k, _)| *k != name).collect();
        let with = |name: &str, value: String| {
            all()
                .into_iter()
                .map(|(k, v)| (k, if k == name { value.clone() } else { v }))
                .collect()
        };
        let cases: [(Vec<(&'static str, String)>, &str); 5] = [
            (without(CA_HASH_VAR), "IMGRUN_CA_HASH is not set"),
            (without(CA_KEY_VAR), "IMGRUN_CA_KEY is not set"),
            (
                with(TOKEN_VAR, "short".into()),
                "IMGRUN_JOIN_TOKEN=\"<5 characters>\"",
            ),
            (
                with(CA_HASH_VAR, "md5:00".into()),
                "IMGRUN_CA_HASH=\"md5:00\"",
            ),
            (
                with(CA_HASH_VAR, other.ca_hash.clone()),
                "the others would refuse",
            ),
        ];
        for (vars, want) in cases {
            let error = join_secret("indexed-job", true, &env_of(vars)).expect_err(want);
            assert!(error.to_string().contains(want), "{error} lacks {want}");
            assert!(!error.to_string().contains(&secret.token), "{error}");
        }
        let debug = format!("{secret:?}");
        assert!(
            !debug.contains(&secret.token) && !debug.contains("PRIVATE"),
            "{debug}"
        );
    }
}
