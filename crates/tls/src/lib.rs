//! rootrank's HTTP security material (SPEC section 7), in one place:
//!
//! - [`server_config`]: `--tls-cert/--tls-key` into a rustls server config (the coordinator's HTTPS).
//! - [`http_client`]: every HTTP client rootrank builds (CLI, simulator, tests, benchmarks),
//!   with rustls on the ring provider explicitly and the roots from `--cacert` (or the system
//!   bundle). reqwest is built without a default crypto provider, and building a client any
//!   other way would panic: this is the one way.
//! - [`AuthToken`]: the coordinator's bearer token, read from `--auth-token-file`, compared in
//!   constant time.
//!
//! etcd's TLS is not here: etcd-client takes PEM bytes itself (see `rootrank_store::EtcdAccess`).

#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// What went wrong with a TLS or token file; each names the file and the flag.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {what} {path}: {error}")]
    Unreadable {
        what: &'static str,
        path: PathBuf,
        error: String,
    },
    #[error("{what} {path} holds no usable PEM {expected}")]
    NoPem {
        what: &'static str,
        path: PathBuf,
        expected: &'static str,
    },
    #[error("--tls-cert {cert} and --tls-key {key} do not make a usable server identity: {error}")]
    BadIdentity { cert: PathBuf, key: PathBuf, error: String },
    #[error("the token file {0} is empty: put the token on its first line")]
    EmptyToken(PathBuf),
    #[error("the token in {0} is not usable in an HTTP header (printable ASCII, no spaces, at most 4096 bytes)")]
    BadToken(PathBuf),
    #[error("cannot build the HTTP client: {0}")]
    Client(String),
}

// ring, deprecated in rustls 0.23.48 for lacking post-quantum key exchange, is what tonic
// (etcd-client) uses already; aws-lc would add a cmake build to the wheel's zig toolchain.
#[allow(deprecated)]
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| TlsError::Unreadable {
        what,
        path: path.to_path_buf(),
        error: e.to_string(),
    })
}

fn certificates(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(what, path)?;
    let certs: Vec<_> = CertificateDer::pem_slice_iter(&pem).filter_map(Result::ok).collect();
    if certs.is_empty() {
        return Err(TlsError::NoPem {
            what,
            path: path.to_path_buf(),
            expected: "CERTIFICATE block",
        });
    }
    Ok(certs)
}

/// The coordinator's HTTPS identity from `--tls-cert` (chain, leaf first) and `--tls-key`.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let chain = certificates("--tls-cert", cert)?;
    let key_pem = read("--tls-key", key)?;
    let private = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| TlsError::NoPem {
        what: "--tls-key",
        path: key.to_path_buf(),
        expected: "PRIVATE KEY block",
    })?;
    let bad = |e: rustls::Error| TlsError::BadIdentity {
        cert: cert.to_path_buf(),
        key: key.to_path_buf(),
        error: e.to_string(),
    };
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(bad)?
        .with_no_client_auth()
        .with_single_cert(chain, private)
        .map_err(bad)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Where the system's CA bundle is on Debian-like systems (used when no `--cacert` is given).
const SYSTEM_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// A reqwest client builder for rootrank's HTTP clients: `https://` URLs are verified
/// against `cacert` (a PEM bundle), or the system bundle when `None`; `http://` works as ever.
pub fn http_client(cacert: Option<&Path>) -> Result<reqwest::ClientBuilder, TlsError> {
    let config = match cacert {
        Some(path) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in certificates("--cacert", path)? {
                roots
                    .add(c)
                    .map_err(|e| TlsError::Client(format!("--cacert {}: {e}", path.display())))?;
            }
            client_config(roots)?
        }
        // Parsed once per process: tests and the CLI build clients often.
        None => match SYSTEM.get_or_init(|| client_config(system_roots()).map_err(|e| e.to_string())) {
            Ok(c) => c.clone(),
            Err(e) => return Err(TlsError::Client(e.clone())),
        },
    };
    Ok(reqwest::Client::builder().tls_backend_preconfigured(config))
}

static SYSTEM: std::sync::OnceLock<Result<rustls::ClientConfig, String>> = std::sync::OnceLock::new();

fn system_roots() -> rustls::RootCertStore {
    let mut roots = rustls::RootCertStore::empty();
    if let Ok(pem) = std::fs::read(SYSTEM_BUNDLE) {
        let (_added, _ignored) =
            roots.add_parsable_certificates(CertificateDer::pem_slice_iter(&pem).filter_map(Result::ok));
    }
    roots
}

fn client_config(roots: rustls::RootCertStore) -> Result<rustls::ClientConfig, TlsError> {
    Ok(rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Client(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// The coordinator's bearer token. `Debug` never shows it.
#[derive(Clone)]
pub struct AuthToken(Arc<[u8]>);

impl std::fmt::Debug for AuthToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AuthToken(..)")
    }
}

/// Longest token accepted (and the longest `Authorization` value worth comparing).
pub const MAX_TOKEN_BYTES: usize = 4096;

impl AuthToken {
    /// The first line of `path`, trimmed. A file others can read is accepted with a warning
    /// (anyone on the host who reads it can read every rank's tracebacks).
    pub fn from_file(path: &Path) -> Result<AuthToken, TlsError> {
        let raw = read("token file", path)?;
        let text = String::from_utf8_lossy(&raw);
        let token = text.lines().next().unwrap_or("").trim();
        if token.is_empty() {
            return Err(TlsError::EmptyToken(path.to_path_buf()));
        }
        if token.len() > MAX_TOKEN_BYTES || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(TlsError::BadToken(path.to_path_buf()));
        }
        if let Some(mode) = world_readable(path) {
            tracing::warn!(
                path = %path.display(),
                mode = format!("{mode:o}"),
                "the token file is readable by other users; chmod 600 it"
            );
        }
        Ok(AuthToken(token.as_bytes().into()))
    }

    /// The token itself (for a client's `Authorization` header).
    pub fn expose(&self) -> &str {
        std::str::from_utf8(&self.0).unwrap_or("")
    }

    /// Whether an `Authorization` header value is `Bearer <this token>`, in time that does
    /// not depend on where a guess first differs.
    /// The scheme is case-insensitive (RFC 7235 section 2.1: `BEARER` is `Bearer`).
    pub fn accepts(&self, authorization: &[u8]) -> bool {
        let Some((scheme, given)) = authorization.split_at_checked(7) else {
            return false;
        };
        if !scheme.eq_ignore_ascii_case(b"Bearer ") {
            return false;
        }
        constant_time_eq(given, &self.0)
    }
}

/// Equal length and equal bytes, examining every byte of `expected` whatever `given` is.
fn constant_time_eq(given: &[u8], expected: &[u8]) -> bool {
    let mut diff = (given.len() != expected.len()) as u8;
    for (i, e) in expected.iter().enumerate() {
        let g = given.get(i).copied().unwrap_or(!*e);
        diff |= g ^ e;
    }
    std::hint::black_box(diff) == 0
}

/// The file's permission bits when group or others may read it.
fn world_readable(path: &Path) -> Option<u32> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).ok()?.permissions().mode() & 0o777;
    (mode & 0o044 != 0).then_some(mode)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_whole_and_exact() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t");
        std::fs::write(&p, "s3cret-token\nignored\n").unwrap();
        let t = AuthToken::from_file(&p).unwrap();
        assert!(t.accepts(b"Bearer s3cret-token"));
        assert!(!t.accepts(b"Bearer s3cret-toke"));
        assert!(!t.accepts(b"Bearer s3cret-token2"));
        assert!(!t.accepts(b"Basic s3cret-token"));
        assert!(t.accepts(b"BEARER s3cret-token") && t.accepts(b"bEaReR s3cret-token"));
        assert!(!t.accepts(b"Bearer  s3cret-token") && !t.accepts(b"Bearers3cret-token"));
        assert!(!t.accepts(b""));
        assert!(!t.accepts(&vec![b'a'; 100_000]));
        assert!(!format!("{t:?}").contains("s3cret"));
        std::fs::write(&p, "\n").unwrap();
        assert!(matches!(AuthToken::from_file(&p), Err(TlsError::EmptyToken(_))));
        std::fs::write(&p, "has space\n").unwrap();
        assert!(matches!(AuthToken::from_file(&p), Err(TlsError::BadToken(_))));
        assert!(matches!(
            AuthToken::from_file(&dir.path().join("missing")),
            Err(TlsError::Unreadable { .. })
        ));
    }

    #[test]
    fn files_without_pem_name_the_flag() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("junk");
        std::fs::write(&p, "not a certificate").unwrap();
        let e = server_config(&p, &p).unwrap_err().to_string();
        assert!(e.contains("--tls-cert"), "{e}");
        let e = http_client(Some(&p)).unwrap_err().to_string();
        assert!(e.contains("--cacert"), "{e}");
        assert!(http_client(None).unwrap().build().is_ok());
    }
}
