//! How to reach etcd: its endpoints and the credentials it asks for (SPEC section 7): TLS
//! (server verification against `--etcd-cacert`, an optional client certificate) and etcd's
//! own user/password auth. Files are read once, when the access is built, so a missing or
//! unreadable file stops start-up with its path instead of failing later inside a retry loop.

use std::path::{Path, PathBuf};

use etcd_client::{Certificate, ConnectOptions, Identity, TlsOptions};

/// The paths an operator gives (flags or `ROOTRANK_ETCD_*`); all optional.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EtcdCredentialFiles {
    /// CA bundle that signed etcd's server certificate (`--etcd-cacert`).
    pub cacert: Option<PathBuf>,
    /// Client certificate (`--etcd-cert`), with its key (`--etcd-key`).
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// etcd user (`--etcd-user`) and the file holding its password (`--etcd-password-file`).
    pub user: Option<String>,
    pub password_file: Option<PathBuf>,
}

impl EtcdCredentialFiles {
    /// The `ROOTRANK_ETCD_*` environment variables (for the Python agent and the plugin, which
    /// have no command line). Empty variables count as unset.
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        EtcdCredentialFiles {
            cacert: var("ROOTRANK_ETCD_CACERT").map(PathBuf::from),
            cert: var("ROOTRANK_ETCD_CERT").map(PathBuf::from),
            key: var("ROOTRANK_ETCD_KEY").map(PathBuf::from),
            user: var("ROOTRANK_ETCD_USER"),
            password_file: var("ROOTRANK_ETCD_PASSWORD_FILE").map(PathBuf::from),
        }
    }

    /// The same files as `ROOTRANK_ETCD_*` variables, for a child process whose own agent
    /// must connect as its parent does ([`EtcdCredentialFiles::from_env`] reads them back).
    pub fn to_env(&self) -> Vec<(&'static str, std::ffi::OsString)> {
        let mut vars = Vec::new();
        for (var, path) in [
            ("ROOTRANK_ETCD_CACERT", &self.cacert),
            ("ROOTRANK_ETCD_CERT", &self.cert),
            ("ROOTRANK_ETCD_KEY", &self.key),
            ("ROOTRANK_ETCD_PASSWORD_FILE", &self.password_file),
        ] {
            if let Some(path) = path {
                vars.push((var, path.clone().into_os_string()));
            }
        }
        if let Some(user) = &self.user {
            vars.push(("ROOTRANK_ETCD_USER", user.into()));
        }
        vars
    }

    pub fn is_empty(&self) -> bool {
        *self == EtcdCredentialFiles::default()
    }
}

/// Why the credentials could not be used; each says which flag or file to fix.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum AccessError {
    #[error("cannot read {what} {path}: {error}")]
    Unreadable {
        what: &'static str,
        path: PathBuf,
        error: String,
    },
    #[error("{what} {path} holds no PEM block (expected -----BEGIN ...-----)")]
    NotPem { what: &'static str, path: PathBuf },
    #[error("--etcd-cert and --etcd-key go together (ROOTRANK_ETCD_CERT / ROOTRANK_ETCD_KEY): one is missing")]
    HalfIdentity,
    #[error("--etcd-user needs --etcd-password-file (ROOTRANK_ETCD_PASSWORD_FILE), and a password file needs a user")]
    HalfUser,
    #[error("the etcd password file {0} is empty")]
    EmptyPassword(PathBuf),
    #[error("etcd TLS options were given but endpoint {0} is not https://: use https:// endpoints with --etcd-cacert")]
    PlainEndpointWithTls(String),
    #[error(
        "endpoint {0} is https:// but no --etcd-cacert (ROOTRANK_ETCD_CACERT) says which CA signed etcd's certificate"
    )]
    HttpsWithoutCa(String),
}

/// Endpoints plus what it takes to be let in. Cheap to clone; `Debug` never shows a secret.
#[derive(Clone, Default)]
pub struct EtcdAccess {
    pub endpoints: Vec<String>,
    /// The TLS files' contents (etcd-client's options are built from them when connecting,
    /// [`EtcdAccess::diagnose_tls`] reads them too).
    pem: Option<TlsPem>,
    user: Option<(String, String)>,
    files: EtcdCredentialFiles,
}

#[derive(Clone)]
struct TlsPem {
    ca: Vec<u8>,
    identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for EtcdAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdAccess")
            .field("endpoints", &self.endpoints)
            .field("tls", &self.pem.is_some())
            .field("user", &self.user.as_ref().map(|(u, _)| u))
            .finish()
    }
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, AccessError> {
    std::fs::read(path).map_err(|e| AccessError::Unreadable {
        what,
        path: path.to_path_buf(),
        error: e.to_string(),
    })
}

fn read_pem(what: &'static str, path: &Path) -> Result<Vec<u8>, AccessError> {
    let pem = read(what, path)?;
    if !pem.windows(11).any(|w| w == b"-----BEGIN ") {
        return Err(AccessError::NotPem {
            what,
            path: path.to_path_buf(),
        });
    }
    Ok(pem)
}

impl EtcdAccess {
    /// Plain endpoints, no credentials (the private etcd on loopback, tests).
    pub fn plain(endpoints: Vec<String>) -> Self {
        EtcdAccess {
            endpoints,
            ..EtcdAccess::default()
        }
    }

    /// Endpoints with the credentials in `files`, read and checked now.
    pub fn new(endpoints: Vec<String>, files: &EtcdCredentialFiles) -> Result<Self, AccessError> {
        let tls_asked = files.cacert.is_some() || files.cert.is_some() || files.key.is_some();
        if tls_asked {
            if let Some(e) = endpoints.iter().find(|e| !e.starts_with("https://")) {
                return Err(AccessError::PlainEndpointWithTls(e.clone()));
            }
        } else if let Some(e) = endpoints.iter().find(|e| e.starts_with("https://")) {
            return Err(AccessError::HttpsWithoutCa(e.clone()));
        }
        let pem = if tls_asked {
            let Some(ca_path) = &files.cacert else {
                return Err(AccessError::HttpsWithoutCa(
                    endpoints.first().cloned().unwrap_or_default(),
                ));
            };
            let ca = read_pem("--etcd-cacert", ca_path)?;
            let identity = match (&files.cert, &files.key) {
                (Some(cert), Some(key)) => Some((read_pem("--etcd-cert", cert)?, read_pem("--etcd-key", key)?)),
                (None, None) => None,
                _ => return Err(AccessError::HalfIdentity),
            };
            Some(TlsPem { ca, identity })
        } else {
            None
        };
        let user = match (&files.user, &files.password_file) {
            (Some(user), Some(path)) => {
                let raw = read("--etcd-password-file", path)?;
                let password = String::from_utf8_lossy(&raw).trim_end_matches(['\n', '\r']).to_string();
                if password.is_empty() {
                    return Err(AccessError::EmptyPassword(path.clone()));
                }
                Some((user.clone(), password))
            }
            (None, None) => None,
            _ => return Err(AccessError::HalfUser),
        };
        Ok(EtcdAccess {
            endpoints,
            pem,
            user,
            files: files.clone(),
        })
    }

    /// The files this access was built from (to hand to a child process).
    pub fn files(&self) -> &EtcdCredentialFiles {
        &self.files
    }

    /// The etcd user, if any (for error messages: "refused user X").
    pub fn user(&self) -> Option<&str> {
        self.user.as_ref().map(|(u, _)| u.as_str())
    }

    pub fn uses_tls(&self) -> bool {
        self.pem.is_some()
    }

    /// Who we are to etcd, for messages: "user rootrank-rank over TLS with a client certificate".
    pub fn identity(&self) -> String {
        let who = match self.user() {
            Some(u) => format!("user {u}"),
            None => "no etcd user".to_string(),
        };
        let how = match (&self.pem, &self.files.cert) {
            (None, _) => "plain",
            (Some(_), Some(_)) => "TLS with a client certificate",
            (Some(_), None) => "TLS without a client certificate",
        };
        format!("{who}, {how}")
    }

    /// Why etcd's TLS turns us away, when a connection failed without saying: with TLS 1.3,
    /// a server that rejects the client certificate (missing, untrusted, expired) says so in
    /// an alert after the handshake, which the gRPC stack reports as a closed connection.
    /// One handshake of our own to the first endpoint, then a short read, finds the alert.
    pub(crate) async fn diagnose_tls(&self) -> Option<String> {
        let pem = self.pem.as_ref()?;
        let endpoint = self.endpoints.first()?;
        let hostport = endpoint.strip_prefix("https://")?.trim_end_matches('/');
        let host = hostport
            .rsplit_once(':')
            .map_or(hostport, |(h, _)| h)
            .trim_matches(['[', ']']);
        let config = client_config(pem).ok()?;
        let name = rustls_pki_types::ServerName::try_from(host.to_string()).ok()?;
        let probe = async {
            let tcp = tokio::net::TcpStream::connect(hostport).await.ok()?;
            let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
            let mut stream = match connector.connect(name, tcp).await {
                Ok(s) => s,
                Err(e) => return crate::tls_error_in(&e),
            };
            let mut buf = [0u8; 64];
            match tokio::time::timeout(std::time::Duration::from_millis(500), {
                use tokio::io::AsyncReadExt;
                stream.read(&mut buf)
            })
            .await
            {
                Ok(Err(e)) => crate::tls_error_in(&e),
                _ => None,
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(2), probe)
            .await
            .ok()
            .flatten()
    }

    pub(crate) fn apply(&self, mut opts: ConnectOptions) -> ConnectOptions {
        if let Some(pem) = &self.pem {
            let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(pem.ca.clone()));
            if let Some((cert, key)) = &pem.identity {
                tls = tls.identity(Identity::from_pem(cert.clone(), key.clone()));
            }
            opts = opts.with_tls(tls);
        }
        if let Some((user, password)) = &self.user {
            opts = opts.with_user(user.clone(), password.clone());
        }
        opts
    }
}

// ring: see rootrank-tls (the provider tonic uses too).
#[allow(deprecated)]
fn client_config(pem: &TlsPem) -> Result<rustls::ClientConfig, rustls::Error> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let mut roots = rustls::RootCertStore::empty();
    roots.add_parsable_certificates(CertificateDer::pem_slice_iter(&pem.ca).filter_map(Result::ok));
    let builder =
        rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots);
    match &pem.identity {
        Some((cert, key)) => {
            let chain: Vec<_> = CertificateDer::pem_slice_iter(cert).filter_map(Result::ok).collect();
            let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| rustls::Error::General(e.to_string()))?;
            builder.with_client_auth_cert(chain, key)
        }
        None => Ok(builder.with_no_client_auth()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(dir: &Path) -> (PathBuf, PathBuf) {
        let pem = dir.join("ca.pem");
        std::fs::write(&pem, "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n").unwrap();
        let pw = dir.join("pw");
        std::fs::write(&pw, "secret\n").unwrap();
        (pem, pw)
    }

    #[test]
    fn bad_combinations_are_refused_with_the_flag_to_fix() {
        let dir = tempfile::tempdir().unwrap();
        let (pem, pw) = files(dir.path());
        let https = vec!["https://127.0.0.1:2379".to_string()];
        let http = vec!["http://127.0.0.1:2379".to_string()];
        let tls = EtcdCredentialFiles {
            cacert: Some(pem.clone()),
            ..Default::default()
        };
        assert!(matches!(
            EtcdAccess::new(http.clone(), &tls),
            Err(AccessError::PlainEndpointWithTls(_))
        ));
        assert!(matches!(
            EtcdAccess::new(https.clone(), &EtcdCredentialFiles::default()),
            Err(AccessError::HttpsWithoutCa(_))
        ));
        let half = EtcdCredentialFiles {
            cert: Some(pem.clone()),
            ..tls.clone()
        };
        assert_eq!(
            EtcdAccess::new(https.clone(), &half).unwrap_err(),
            AccessError::HalfIdentity
        );
        let user_only = EtcdCredentialFiles {
            user: Some("u".into()),
            ..Default::default()
        };
        assert_eq!(
            EtcdAccess::new(http.clone(), &user_only).unwrap_err(),
            AccessError::HalfUser
        );
        let missing = EtcdCredentialFiles {
            cacert: Some(dir.path().join("nope.pem")),
            ..Default::default()
        };
        assert!(matches!(
            EtcdAccess::new(https.clone(), &missing),
            Err(AccessError::Unreadable { .. })
        ));
        let not_pem = EtcdCredentialFiles {
            cacert: Some(pw.clone()),
            ..Default::default()
        };
        assert!(matches!(
            EtcdAccess::new(https.clone(), &not_pem),
            Err(AccessError::NotPem { .. })
        ));
        let empty = dir.path().join("empty");
        std::fs::write(&empty, "\n").unwrap();
        let empty_pw = EtcdCredentialFiles {
            user: Some("u".into()),
            password_file: Some(empty),
            ..Default::default()
        };
        assert!(matches!(
            EtcdAccess::new(http.clone(), &empty_pw),
            Err(AccessError::EmptyPassword(_))
        ));
        let ok = EtcdAccess::new(
            https,
            &EtcdCredentialFiles {
                user: Some("u".into()),
                password_file: Some(pw),
                ..tls
            },
        )
        .unwrap();
        assert_eq!(ok.user(), Some("u"));
        assert!(!format!("{ok:?}").contains("secret"), "Debug never shows the password");
    }
}
