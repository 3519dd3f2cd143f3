//! The cluster's credentials and the TLS 1.3 configurations built from them.
//!
//! The head owns a cluster CA ([`ClusterCa`]) and signs a certificate for itself and for
//! every node that joins. A joining node has no certificate yet: it knows the head's
//! address, the [`JoinToken`] and the [`CaHash`] (`sha256:<hex>` of the CA certificate,
//! as kubeadm's `--discovery-token-ca-cert-hash`), and trusts the head only if the chain
//! it presents holds that exact CA and the head's certificate verifies against it
//! ([`ClientTls::join`]). Every other connection is mutually authenticated against the
//! CA ([`ClientTls::mutual`], [`ServerTls::node`]); the head alone also lets
//! certificate-less clients in ([`ServerTls::head`]), and the daemon must then accept
//! nothing from them but a join request with the right token.
//!
//! Every certificate carries the DNS name [`SERVER_NAME`], which clients ask for, so
//! verification does not depend on addresses. A peer's name is its certificate's common
//! name. Keys are ECDSA P-256; the crypto provider is ring, passed explicitly.

use std::fmt;
use std::fs;
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use rand::Rng;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, DnsName, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{CertificateError, DigitallySignedStruct, OtherError, RootCertStore, SignatureScheme};
use sha2::{Digest, Sha256};

use crate::auth::{constant_time_eq, decode_hex, encode_hex};

/// The DNS name in every cluster certificate, and the name every client asks for.
pub const SERVER_NAME: &str = "imgrun";

/// The ALPN protocol both sides insist on, so an imgrun daemon never talks to another
/// QUIC service by mistake.
pub const ALPN: &[u8] = b"imgrun/1";

/// The CA's certificate file in a credentials folder.
const CA_CERT_FILE: &str = "ca.pem";
/// The CA's private key file.
const CA_KEY_FILE: &str = "ca-key.pem";
/// A daemon's certificate file.
const CERT_FILE: &str = "node.pem";
/// A daemon's private key file.
const KEY_FILE: &str = "node-key.pem";

/// The CA certificate's common name.
const CA_NAME: &str = "imgrun cluster CA";
/// How long certificates are valid. There is no renewal yet, so this is long.
const VALID_YEARS: i32 = 10;
/// The longest common name a certificate may carry (RFC 5280's upper bound).
const MAX_NAME: usize = 64;

/// Why credentials could not be made, read, written or turned into a configuration.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot make {what}: {source}")]
    Generate {
        what: &'static str,
        source: rcgen::Error,
    },
    #[error("{what}: {reason}")]
    Pem { what: &'static str, reason: String },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("bad certificate name {name:?}: {reason}")]
    BadName { name: String, reason: &'static str },
    #[error("not a CA hash (expected sha256: and 64 hex digits)")]
    BadHash,
    #[error("not a join token (expected 32 hex digits)")]
    BadToken,
    #[error("certificate has no readable common name")]
    NoName,
    #[error("tls configuration: {0}")]
    Config(#[from] rustls::Error),
    #[error("tls client verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
}

/// `sha256:<hex>` of a CA certificate's DER bytes: what a joining node pins.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CaHash([u8; 32]);

/// The secret a node shows to join. 128 random bits as 32 lowercase hex digits,
/// compared in constant time, never printed by `Debug`.
#[derive(Clone)]
pub struct JoinToken(String);

/// The cluster's certificate authority: its certificate and its signing key. Only the
/// head has one.
pub struct ClusterCa {
    certificate: CaCertificate,
    issuer: Issuer<'static, KeyPair>,
}

/// The public half of the cluster CA, which every daemon needs to verify peers.
#[derive(Clone)]
pub struct CaCertificate {
    pem: String,
    der: CertificateDer<'static>,
}

/// A daemon's certificate (signed by the cluster CA) and private key, both PEM.
#[derive(Clone)]
pub struct NodeCredentials {
    pub cert_pem: String,
    pub key_pem: String,
}

/// A name a daemon's certificate is valid for, besides [`SERVER_NAME`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubjectAltName {
    Ip(IpAddr),
    Dns(String),
}

/// How a daemon accepts connections (see [`crate::Server`]).
#[derive(Debug, Clone)]
pub struct ServerTls(Arc<rustls::ServerConfig>);

/// How a daemon or client connects (see [`crate::Client`]).
#[derive(Debug, Clone)]
pub struct ClientTls(Arc<rustls::ClientConfig>);

impl CaHash {
    /// The hash of a certificate's DER bytes.
    pub fn of(cert_der: &[u8]) -> Self {
        Self(Sha256::digest(cert_der).into())
    }
}

impl fmt::Display for CaHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("sha256:")?;
        self.0.iter().try_for_each(|byte| write!(f, "{byte:02x}"))
    }
}

impl fmt::Debug for CaHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CaHash({self})")
    }
}

impl FromStr for CaHash {
    type Err = TlsError;

    /// Parses `sha256:` and 64 hex digits (either case).
    fn from_str(text: &str) -> Result<Self, TlsError> {
        let hex = text.strip_prefix("sha256:").ok_or(TlsError::BadHash)?;
        let bytes = decode_hex(hex).ok_or(TlsError::BadHash)?;
        Ok(Self(bytes.try_into().map_err(|_| TlsError::BadHash)?))
    }
}

impl JoinToken {
    /// A fresh random token (from the thread's CSPRNG, seeded by the OS).
    pub fn generate() -> Self {
        let bytes: [u8; 16] = rand::rng().random();
        Self(encode_hex(&bytes))
    }

    /// The token, to print for the person who starts nodes.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `candidate` is this token; the time taken does not depend on where they
    /// differ.
    pub fn matches(&self, candidate: &str) -> bool {
        constant_time_eq(self.0.as_bytes(), candidate.as_bytes())
    }
}

impl FromStr for JoinToken {
    type Err = TlsError;

    fn from_str(text: &str) -> Result<Self, TlsError> {
        let text = text.trim();
        let valid =
            text.len() == 32 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        if valid {
            Ok(Self(text.to_owned()))
        } else {
            Err(TlsError::BadToken)
        }
    }
}

impl fmt::Debug for JoinToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JoinToken(<secret>)")
    }
}

impl ClusterCa {
    /// A new CA with a fresh P-256 key.
    pub fn generate() -> Result<Self, TlsError> {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(|source| {
            TlsError::Generate {
                what: "CA key",
                source,
            }
        })?;
        let mut params = CertificateParams::default();
        // A random suffix tells CAs apart, so a certificate of another cluster reads as
        // signed by an unknown issuer rather than as a bad signature.
        let suffix: [u8; 4] = rand::rng().random();
        params.distinguished_name = common_name(&format!("{CA_NAME} {}", encode_hex(&suffix)));
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        set_validity(&mut params);
        let cert = params
            .self_signed(&key)
            .map_err(|source| TlsError::Generate {
                what: "CA certificate",
                source,
            })?;
        Self::from_parts(cert.pem(), cert.der().clone(), key)
    }

    /// The CA from its certificate and key (PEM), as [`ClusterCa::save`] writes them.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self, TlsError> {
        let certificate = CaCertificate::from_pem(cert_pem)?;
        let key = KeyPair::from_pem(key_pem).map_err(|error| TlsError::Pem {
            what: "CA key",
            reason: error.to_string(),
        })?;
        Self::from_parts(certificate.pem, certificate.der, key)
    }

    /// The public half, for daemons and for [`CaHash`].
    pub fn certificate(&self) -> &CaCertificate {
        &self.certificate
    }

    /// The hash a joining node pins.
    pub fn ca_hash(&self) -> CaHash {
        self.certificate.hash()
    }

    /// Signs a certificate (with a fresh P-256 key) for the daemon or client `name`,
    /// valid as server and as client. It always holds [`SERVER_NAME`]; `alt_names` adds
    /// addresses or DNS names.
    pub fn issue(
        &self,
        name: &str,
        alt_names: &[SubjectAltName],
    ) -> Result<NodeCredentials, TlsError> {
        check_name(name)?;
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(|source| {
            TlsError::Generate {
                what: "key",
                source,
            }
        })?;
        let mut params = CertificateParams::default();
        params.distinguished_name = common_name(name);
        params.subject_alt_names = std::iter::once(SubjectAltName::Dns(SERVER_NAME.to_owned()))
            .chain(alt_names.iter().cloned())
            .map(san_type)
            .collect::<Result<_, _>>()?;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        set_validity(&mut params);
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(|source| TlsError::Generate {
                what: "certificate",
                source,
            })?;
        Ok(NodeCredentials {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// The CA's private key, PEM: for a secret store that hands it to the head (a
    /// Kubernetes Secret), never for a log.
    pub fn key_pem(&self) -> String {
        self.issuer.key().serialize_pem()
    }

    /// Writes `ca.pem` and `ca-key.pem` into `dir` (created if missing), mode 0600.
    pub fn save(&self, dir: &Path) -> Result<(), TlsError> {
        self.certificate.save(dir)?;
        write_private(
            dir,
            CA_KEY_FILE,
            self.issuer.key().serialize_pem().as_bytes(),
        )
    }

    /// Reads what [`ClusterCa::save`] wrote.
    pub fn load(dir: &Path) -> Result<Self, TlsError> {
        Self::from_pem(
            &read_text(dir, CA_CERT_FILE)?,
            &read_text(dir, CA_KEY_FILE)?,
        )
    }

    fn from_parts(
        pem: String,
        der: CertificateDer<'static>,
        key: KeyPair,
    ) -> Result<Self, TlsError> {
        // The issuer takes the CA's subject and key identifier from the certificate itself,
        // so certificates signed by a loaded CA chain exactly like those of a fresh one.
        let issuer = Issuer::from_ca_cert_der(&der, key).map_err(|source| TlsError::Generate {
            what: "CA issuer",
            source,
        })?;
        Ok(Self {
            certificate: CaCertificate { pem, der },
            issuer,
        })
    }
}

impl fmt::Debug for ClusterCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterCa")
            .field("hash", &self.ca_hash())
            .finish_non_exhaustive()
    }
}

impl CaCertificate {
    /// Parses a PEM file holding exactly one certificate.
    pub fn from_pem(pem: &str) -> Result<Self, TlsError> {
        let der = single_certificate(pem, "CA certificate")?;
        Ok(Self {
            pem: pem.to_owned(),
            der,
        })
    }

    /// The PEM text, to hand to a joining node.
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// The hash a joining node pins.
    pub fn hash(&self) -> CaHash {
        CaHash::of(&self.der)
    }

    /// Writes `ca.pem` into `dir` (created if missing), mode 0600.
    pub fn save(&self, dir: &Path) -> Result<(), TlsError> {
        write_private(dir, CA_CERT_FILE, self.pem.as_bytes())
    }

    /// Reads what [`CaCertificate::save`] wrote.
    pub fn load(dir: &Path) -> Result<Self, TlsError> {
        Self::from_pem(&read_text(dir, CA_CERT_FILE)?)
    }

    fn roots(&self) -> Result<Arc<RootCertStore>, TlsError> {
        let mut roots = RootCertStore::empty();
        roots.add(self.der.clone())?;
        Ok(Arc::new(roots))
    }
}

impl fmt::Debug for CaCertificate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CaCertificate")
            .field("hash", &self.hash())
            .finish_non_exhaustive()
    }
}

impl NodeCredentials {
    /// The common name of the certificate: the daemon's name in the cluster.
    pub fn name(&self) -> Result<String, TlsError> {
        let der = single_certificate(&self.cert_pem, "certificate")?;
        certificate_name(&der)
    }

    /// Writes `node.pem` and `node-key.pem` into `dir` (created if missing), mode 0600.
    pub fn save(&self, dir: &Path) -> Result<(), TlsError> {
        write_private(dir, CERT_FILE, self.cert_pem.as_bytes())?;
        write_private(dir, KEY_FILE, self.key_pem.as_bytes())
    }

    /// Reads what [`NodeCredentials::save`] wrote.
    pub fn load(dir: &Path) -> Result<Self, TlsError> {
        Ok(Self {
            cert_pem: read_text(dir, CERT_FILE)?,
            key_pem: read_text(dir, KEY_FILE)?,
        })
    }

    /// The certificate chain to present (own certificate, then the CA's) and the key.
    fn chain_and_key(
        &self,
        ca: &CaCertificate,
    ) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsError> {
        let own = single_certificate(&self.cert_pem, "certificate")?;
        let key = PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes()).map_err(|error| {
            TlsError::Pem {
                what: "private key",
                reason: error.to_string(),
            }
        })?;
        Ok((vec![own, ca.der.clone()], key))
    }
}

impl fmt::Debug for NodeCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeCredentials")
            .field("name", &self.name().ok())
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// The head: presents `own` (with the CA certificate), accepts clients with a cluster
    /// certificate, and also clients with none (joining nodes). A client with a
    /// certificate that does not verify is refused in the handshake.
    pub fn head(ca: &CaCertificate, own: &NodeCredentials) -> Result<Self, TlsError> {
        let verifier = WebPkiClientVerifier::builder_with_provider(ca.roots()?, provider())
            .allow_unauthenticated()
            .build()?;
        server_config(ca, own, verifier)
    }

    /// A node: presents `own` and accepts only clients with a cluster certificate.
    pub fn node(ca: &CaCertificate, own: &NodeCredentials) -> Result<Self, TlsError> {
        let verifier =
            WebPkiClientVerifier::builder_with_provider(ca.roots()?, provider()).build()?;
        server_config(ca, own, verifier)
    }

    /// An HTTPS server of the head (its dashboard): presents `own` (with the CA
    /// certificate) to any client, asks none for a certificate, and speaks HTTP/1.1.
    /// Browsers and scrapers trust it once they trust the cluster CA's `ca.pem`.
    pub fn web(ca: &CaCertificate, own: &NodeCredentials) -> Result<Self, TlsError> {
        let (chain, key) = own.chain_and_key(ca)?;
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_no_client_auth()
            .with_single_cert(chain, key)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(ServerTls(Arc::new(config)))
    }

    /// The rustls configuration, for a server outside this crate (the dashboard's).
    pub fn rustls(&self) -> Arc<rustls::ServerConfig> {
        self.0.clone()
    }
}

impl ClientTls {
    /// A joining node: no client certificate; trusts the server only if its chain holds
    /// the CA certificate with hash `pinned` and its certificate verifies against that CA
    /// alone.
    pub fn join(pinned: CaHash) -> Result<Self, TlsError> {
        let verifier = PinnedCaVerifier {
            pinned,
            provider: provider(),
        };
        let mut config = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_no_client_auth();
        config.alpn_protocols = vec![ALPN.to_vec()];
        Ok(Self(Arc::new(config)))
    }

    /// A member of the cluster: presents `own`, trusts servers whose certificate verifies
    /// against the cluster CA.
    pub fn mutual(ca: &CaCertificate, own: &NodeCredentials) -> Result<Self, TlsError> {
        let (chain, key) = own.chain_and_key(ca)?;
        let mut config = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(ca.roots()?)
            .with_client_auth_cert(chain, key)?;
        config.alpn_protocols = vec![ALPN.to_vec()];
        Ok(Self(Arc::new(config)))
    }

    pub(crate) fn rustls(&self) -> Arc<rustls::ClientConfig> {
        self.0.clone()
    }
}

/// The common name of a certificate (DER).
pub fn certificate_name(cert_der: &[u8]) -> Result<String, TlsError> {
    let (_, cert) = x509_parser::parse_x509_certificate(cert_der).map_err(|_| TlsError::NoName)?;
    let name = cert
        .subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .ok_or(TlsError::NoName)?;
    Ok(name.to_owned())
}

/// Verifies a server against the one CA certificate in its chain whose hash was pinned.
#[derive(Debug)]
struct PinnedCaVerifier {
    pinned: CaHash,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for PinnedCaVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let (pinned, others): (Vec<_>, Vec<_>) = intermediates
            .iter()
            .cloned()
            .partition(|cert| CaHash::of(cert) == self.pinned);
        let Some(ca) = pinned.into_iter().next() else {
            return Err(rustls::Error::InvalidCertificate(CertificateError::Other(
                OtherError(Arc::new(NotPinned)),
            )));
        };
        let mut roots = RootCertStore::empty();
        roots.add(ca)?;
        let verifier =
            WebPkiServerVerifier::builder_with_provider(Arc::new(roots), self.provider.clone())
                .build()
                .map_err(|error| rustls::Error::General(error.to_string()))?;
        verifier.verify_server_cert(end_entity, &others, server_name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        // Unreachable with TLS 1.3 only, but verified properly all the same.
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// The handshake error when the server's chain lacks the pinned CA.
#[derive(thiserror::Error)]
#[error("no certificate in the server's chain matches the pinned CA hash")]
struct NotPinned;

/// rustls shows this error with `Debug`: make that the message too.
impl fmt::Debug for NotPinned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// ring, passed to every builder rather than installed process-wide.
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn server_config(
    ca: &CaCertificate,
    own: &NodeCredentials,
    verifier: Arc<dyn rustls::server::danger::ClientCertVerifier>,
) -> Result<ServerTls, TlsError> {
    let (chain, key) = own.chain_and_key(ca)?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)?;
    config.alpn_protocols = vec![ALPN.to_vec()];
    Ok(ServerTls(Arc::new(config)))
}

fn single_certificate(pem: &str, what: &'static str) -> Result<CertificateDer<'static>, TlsError> {
    let mut certs = CertificateDer::pem_slice_iter(pem.as_bytes());
    let first = certs.next().ok_or(TlsError::Pem {
        what,
        reason: "no certificate".to_owned(),
    })?;
    let first = first.map_err(|error| TlsError::Pem {
        what,
        reason: error.to_string(),
    })?;
    if certs.next().is_some() {
        return Err(TlsError::Pem {
            what,
            reason: "more than one certificate".to_owned(),
        });
    }
    Ok(first)
}

fn san_type(alt: SubjectAltName) -> Result<SanType, TlsError> {
    let dns = match alt {
        SubjectAltName::Ip(ip) => return Ok(SanType::IpAddress(ip)),
        SubjectAltName::Dns(dns) => dns,
    };
    let bad = |name: String| TlsError::BadName {
        name,
        reason: "not a DNS name",
    };
    // rcgen only checks for ASCII; ask for a name a verifier would accept.
    if DnsName::try_from(dns.as_str()).is_err() {
        return Err(bad(dns));
    }
    match dns.as_str().try_into() {
        Ok(ia5) => Ok(SanType::DnsName(ia5)),
        Err(_) => Err(bad(dns)),
    }
}

fn common_name(name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    dn
}

fn check_name(name: &str) -> Result<(), TlsError> {
    let reason = if name.is_empty() {
        "empty"
    } else if name.len() > MAX_NAME {
        "longer than 64 bytes"
    } else if name.chars().any(char::is_control) {
        "control characters"
    } else {
        return Ok(());
    };
    Err(TlsError::BadName {
        name: name.to_owned(),
        reason,
    })
}

/// From yesterday (clocks in a cluster disagree a little) for [`VALID_YEARS`].
fn set_validity(params: &mut CertificateParams) {
    let days = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs() / 86_400);
    let (year, month, day) = civil_from_days(days.saturating_sub(1));
    // `date_time_ymd` panics on dates `time` cannot represent: keep the year well inside
    // its range, and avoid 29 February ten years on.
    let year = year.clamp(1970, 9000);
    params.not_before = rcgen::date_time_ymd(year, month, day);
    params.not_after = rcgen::date_time_ymd(year + VALID_YEARS, month, day.min(28));
    let mut serial: [u8; 16] = rand::rng().random();
    serial[0] &= 0x7f; // positive, as RFC 5280 wants
    params.serial_number = Some(SerialNumber::from_slice(&serial));
}

/// (year, month, day) of a count of days since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: u64) -> (i32, u8, u8) {
    let z = i64::try_from(days).unwrap_or(i64::MAX / 2) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (
        i32::try_from(year).unwrap_or(i32::MAX),
        u8::try_from(month).unwrap_or(1),
        u8::try_from(day).unwrap_or(1),
    )
}

/// Writes `dir/name` with mode 0600, atomically ([`crate::private::write_private`]),
/// creating `dir` with mode 0700 when missing.
fn write_private(dir: &Path, name: &str, contents: &[u8]) -> Result<(), TlsError> {
    let io_error = |path: &Path| {
        let path = path.to_owned();
        move |source| TlsError::Io { path, source }
    };
    crate::private::create_private_dir(dir).map_err(io_error(dir))?;
    let path = dir.join(name);
    crate::private::write_private(&path, contents).map_err(io_error(&path))
}

fn read_text(dir: &Path, name: &str) -> Result<String, TlsError> {
    let path = dir.join(name);
    fs::read_to_string(&path).map_err(|source| TlsError::Io { path, source })
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn ca_hash_is_sha256_of_the_der_in_hex() {
        let ca = ClusterCa::generate().expect("ca");
        let text = ca.ca_hash().to_string();
        assert!(text.starts_with("sha256:"), "{text}");
        let hex = &text["sha256:".len()..];
        assert_eq!(hex.len(), 64);
        assert!(
            hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')),
            "{text}"
        );
        let der = single_certificate(ca.certificate().pem(), "ca").expect("der");
        assert_eq!(hex, encode_hex(&Sha256::digest(&der)));
        assert_eq!(text.parse::<CaHash>().expect("parse"), ca.ca_hash());
        assert_eq!(
            text.to_uppercase()
                .replace("SHA256", "sha256")
                .parse::<CaHash>()
                .expect("upper"),
            ca.ca_hash()
        );
    }

    #[test]
    fn bad_ca_hashes_are_refused() {
        let good = format!("sha256:{}", "ab".repeat(32));
        assert!(good.parse::<CaHash>().is_ok());
        for bad in [
            String::new(),
            "sha256:".to_owned(),
            "ab".repeat(32),
            format!("sha1:{}", "ab".repeat(32)),
            format!("sha256:{}", "ab".repeat(31)),
            format!("sha256:{}a", "ab".repeat(32)),
            format!("sha256:{}", "zz".repeat(32)),
            format!("sha256:{}é", "ab".repeat(31)),
            format!("sha256:+{}", "a".repeat(63)),
        ] {
            assert!(
                matches!(bad.parse::<CaHash>(), Err(TlsError::BadHash)),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn join_tokens_compare_exactly() {
        let token = JoinToken::generate();
        assert_eq!(token.as_str().len(), 32);
        assert_ne!(token.as_str(), JoinToken::generate().as_str());
        let same: JoinToken = token.as_str().parse().expect("parse");
        assert!(token.matches(same.as_str()));
        let text = token.as_str();
        let last_changed = format!(
            "{}{}",
            &text[..31],
            if text.ends_with('0') { '1' } else { '0' }
        );
        for wrong in [
            String::new(),
            last_changed,
            text[..31].to_owned(),
            format!("{text}0"),
            text.to_uppercase(),
        ] {
            assert!(!token.matches(&wrong) || wrong == text, "{wrong:?}");
        }
        assert!(
            !format!("{token:?}").contains(text),
            "Debug hides the token"
        );
        for bad in [
            "",
            "0123",
            "0123456789abcdef0123456789abcdeg",
            "0123456789ABCDEF0123456789ABCDEF",
        ] {
            assert!(bad.parse::<JoinToken>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn issued_certificates_carry_the_name() {
        let ca = ClusterCa::generate().expect("ca");
        let alt = [
            SubjectAltName::Ip("10.0.0.2".parse().expect("ip")),
            SubjectAltName::Dns("gpu-01.lan".into()),
        ];
        let creds = ca.issue("gpu-01", &alt).expect("issue");
        assert_eq!(creds.name().expect("name"), "gpu-01");
        assert!(
            !format!("{creds:?}").contains("PRIVATE"),
            "Debug hides the key"
        );
        for bad in ["", "a\nb", &"x".repeat(65)] {
            assert!(
                matches!(ca.issue(bad, &[]), Err(TlsError::BadName { .. })),
                "{bad:?}"
            );
        }
        let bad_dns = [SubjectAltName::Dns("not a name".into())];
        assert!(matches!(
            ca.issue("n", &bad_dns),
            Err(TlsError::BadName { .. })
        ));
    }

    #[test]
    fn credentials_round_trip_through_files_with_mode_0600() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = ClusterCa::generate().expect("ca");
        let creds = ca.issue("head", &[]).expect("issue");
        let ca_dir = dir.path().join("ca");
        let node_dir = dir.path().join("node");
        ca.save(&ca_dir).expect("save ca");
        creds.save(&node_dir).expect("save creds");
        ca.certificate()
            .save(&node_dir)
            .expect("save ca certificate");
        for (folder, file) in [
            (&ca_dir, CA_CERT_FILE),
            (&ca_dir, CA_KEY_FILE),
            (&node_dir, CERT_FILE),
            (&node_dir, KEY_FILE),
            (&node_dir, CA_CERT_FILE),
        ] {
            let mode = fs::metadata(folder.join(file))
                .expect("metadata")
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600, "{file}");
        }
        let loaded = ClusterCa::load(&ca_dir).expect("load ca");
        assert_eq!(loaded.ca_hash(), ca.ca_hash());
        assert_eq!(
            CaCertificate::load(&node_dir)
                .expect("load ca certificate")
                .hash(),
            ca.ca_hash()
        );
        let loaded_creds = NodeCredentials::load(&node_dir).expect("load creds");
        assert_eq!(loaded_creds.cert_pem, creds.cert_pem);
        assert_eq!(loaded_creds.key_pem, creds.key_pem);
        // A loaded CA still issues certificates that build working configurations.
        let issued = loaded.issue("gpu-02", &[]).expect("issue from loaded ca");
        ServerTls::node(loaded.certificate(), &issued).expect("server config");
        ClientTls::mutual(ca.certificate(), &issued).expect("client config");
        // Saving again replaces the files.
        ca.save(&ca_dir).expect("save again");
        assert!(matches!(
            ClusterCa::load(&dir.path().join("missing")),
            Err(TlsError::Io { .. })
        ));
    }

    #[test]
    fn bad_pem_is_refused() {
        let ca = ClusterCa::generate().expect("ca");
        let two = format!("{}{}", ca.certificate().pem(), ca.certificate().pem());
        for bad in ["", "not pem", two.as_str()] {
            assert!(
                matches!(CaCertificate::from_pem(bad), Err(TlsError::Pem { .. })),
                "{bad:?}"
            );
        }
        assert!(ClusterCa::from_pem(ca.certificate().pem(), "junk").is_err());
    }

    #[test]
    fn civil_dates_are_right() {
        for (days, date) in [
            (0, (1970, 1, 1)),
            (59, (1970, 3, 1)),
            (11_016, (2000, 2, 29)),
            (19_723, (2024, 1, 1)),
            (20_513, (2026, 3, 1)),
        ] {
            assert_eq!(civil_from_days(days), date, "{days}");
        }
    }
}
