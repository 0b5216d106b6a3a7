//! Certificates made with `openssl` for one test, and etcd started with TLS or auth on: the
//! shapes production etcd runs in (SPEC section 7), on loopback.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rootrank_store::embedded::{EmbeddedEtcd, EtcdOptions};
use rootrank_store::{EtcdAccess, EtcdCredentialFiles};

/// A throwaway CA with a server certificate for 127.0.0.1, a client certificate it signed,
/// and a rogue CA with a client certificate of its own (the wrong certificate).
pub struct Pki {
    dir: tempfile::TempDir,
}

fn openssl(dir: &Path, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .context("running openssl (Debian: apt-get install openssl; scripts/deps.sh installs it)")?;
    if !out.status.success() {
        bail!("openssl {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

impl Pki {
    pub fn new() -> anyhow::Result<Pki> {
        let dir = tempfile::tempdir()?;
        let d = dir.path();
        std::fs::write(
            d.join("server.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n",
        )?;
        std::fs::write(d.join("client.ext"), "extendedKeyUsage=clientAuth\n")?;
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
        for ca in ["ca", "rogue-ca"] {
            let mut args = vec!["req", "-x509"];
            args.extend(ec);
            let (key, pem, subj) = (
                format!("{ca}.key"),
                format!("{ca}.pem"),
                format!("/CN=rootrank-test-{ca}"),
            );
            args.extend(["-keyout", &key, "-out", &pem, "-days", "2", "-subj", &subj]);
            openssl(d, &args)?;
        }
        for (name, ca, ext, cn, days) in [
            ("server", "ca", "server.ext", "etcd", "2"),
            ("client", "ca", "client.ext", "root", "2"),
            ("rogue-client", "rogue-ca", "client.ext", "root", "2"),
            // Valid until the second it was made: expired from the next one.
            ("expired-client", "ca", "client.ext", "root", "0"),
        ] {
            let (key, csr, pem) = (format!("{name}.key"), format!("{name}.csr"), format!("{name}.pem"));
            let subj = format!("/CN={cn}");
            let mut args = vec!["req"];
            args.extend(ec);
            args.extend(["-keyout", &key, "-out", &csr, "-subj", &subj]);
            openssl(d, &args)?;
            let (ca_pem, ca_key) = (format!("{ca}.pem"), format!("{ca}.key"));
            openssl(
                d,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &csr,
                    "-CA",
                    &ca_pem,
                    "-CAkey",
                    &ca_key,
                    "-CAcreateserial",
                    "-out",
                    &pem,
                    "-days",
                    days,
                    "-extfile",
                    ext,
                ],
            )?;
        }
        // Past the expired certificate's last valid second.
        std::thread::sleep(Duration::from_millis(1100));
        Ok(Pki { dir })
    }

    /// `ca.pem`, `server.pem`/`server.key`, `client.pem`/`client.key`, `rogue-ca.pem`,
    /// `rogue-client.pem`/`rogue-client.key`, `expired-client.pem`/`.key` (signed by `ca`,
    /// expired one second after [`Pki::new`]).
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Credentials that trust `ca` and present `client` (a `rogue-client` is signed by the rogue CA).
    pub fn files(&self, ca: &str, client: Option<&str>) -> EtcdCredentialFiles {
        EtcdCredentialFiles {
            cacert: Some(self.path(&format!("{ca}.pem"))),
            cert: client.map(|c| self.path(&format!("{c}.pem"))),
            key: client.map(|c| self.path(&format!("{c}.key"))),
            ..EtcdCredentialFiles::default()
        }
    }

    /// The same as `rootrank` flags.
    pub fn flags(&self, ca: &str, client: Option<&str>) -> Vec<String> {
        let f = self.files(ca, client);
        let mut out = Vec::new();
        let pairs = [
            ("--etcd-cacert", f.cacert),
            ("--etcd-cert", f.cert),
            ("--etcd-key", f.key),
        ];
        for (flag, path) in pairs {
            if let Some(p) = path {
                out.push(flag.to_string());
                out.push(p.display().to_string());
            }
        }
        out
    }
}

/// An etcd that speaks only TLS on its client port, with client certificates required when
/// `client_cert_auth`.
pub struct TlsEtcd {
    pub inner: EmbeddedEtcd,
    _dir: tempfile::TempDir,
}

impl TlsEtcd {
    pub fn start(pki: &Pki, client_cert_auth: bool) -> anyhow::Result<TlsEtcd> {
        let dir = tempfile::tempdir()?;
        let port = crate::free_port()?;
        let url = format!("https://127.0.0.1:{port}");
        let mut extra: Vec<String> = vec![
            "--listen-client-urls".into(),
            url.clone(),
            "--advertise-client-urls".into(),
            url,
            "--cert-file".into(),
            pki.path("server.pem").display().to_string(),
            "--key-file".into(),
            pki.path("server.key").display().to_string(),
        ];
        if client_cert_auth {
            extra.extend([
                "--client-cert-auth".into(),
                "--trusted-ca-file".into(),
                pki.path("ca.pem").display().to_string(),
            ]);
        }
        let opts = EtcdOptions {
            client_port: port,
            extra_args: extra,
            // etcd's /health is behind TLS now: readiness is checked below with a real client.
            wait_healthy: false,
            ..EtcdOptions::default()
        };
        let inner = EmbeddedEtcd::start(dir.path(), &opts)?;
        let etcd = TlsEtcd { inner, _dir: dir };
        let access = EtcdAccess::new(vec![etcd.endpoint()], &pki.files("ca", Some("client")))?;
        wait_answers(&access)?;
        Ok(etcd)
    }

    pub fn endpoint(&self) -> String {
        format!("https://127.0.0.1:{}", self.inner.client_port())
    }
}

/// Waits (up to 20 s) until etcd answers a read with these credentials.
/// (On a thread of its own: callers may be inside a runtime.)
pub fn wait_answers(access: &EtcdAccess) -> anyhow::Result<()> {
    let access = access.clone();
    std::thread::spawn(move || wait_answers_blocking(&access))
        .join()
        .map_err(|_| anyhow::anyhow!("the etcd readiness probe panicked"))?
}

fn wait_answers_blocking(access: &EtcdAccess) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let deadline = Instant::now() + Duration::from_secs(20);
    rt.block_on(async {
        loop {
            let attempt = async {
                let mut c = rootrank_store::connect(access).await?;
                c.get("health-probe", None)
                    .await
                    .map_err(|e| rootrank_store::StoreError::from_etcd(access, e))?;
                Ok::<(), rootrank_store::StoreError>(())
            };
            match attempt.await {
                Ok(()) => return Ok(()),
                Err(e) if Instant::now() > deadline => bail!("etcd did not answer in 20 s: {e}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    })
}

/// `etcdctl` against `endpoint` (plain) with `args`; its stdout.
pub fn etcdctl(endpoint: &str, user: Option<&str>, args: &[&str]) -> anyhow::Result<String> {
    let mut cmd = Command::new("etcdctl");
    cmd.env("ETCDCTL_API", "3").arg("--endpoints").arg(endpoint);
    if let Some(u) = user {
        cmd.arg("--user").arg(u);
    }
    let out = cmd.args(args).output().context("running etcdctl")?;
    if !out.status.success() {
        bail!("etcdctl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Turns etcd's auth on with the least roles and users of `scripts/etcd-roles.sh` (the
/// README's commands, run as they are): users `rootrank-rank`, `rootrank-coordinator` and
/// `rootrank-node`, each with its role and the password `{user}-pw`; `root` has `root-pw`.
pub fn enable_auth_with_roles(endpoint: &str, prefix: &str) -> anyhow::Result<()> {
    let script = crate::repo_root().join("scripts/etcd-roles.sh");
    let out = Command::new("bash")
        .arg(&script)
        .arg(prefix)
        .env("ETCDCTL_ENDPOINTS", endpoint)
        .env("ROOTRANK_ROOT_PASSWORD", "root-pw")
        .env("ROOTRANK_RANK_PASSWORD", "rootrank-rank-pw")
        .env("ROOTRANK_COORDINATOR_PASSWORD", "rootrank-coordinator-pw")
        .env("ROOTRANK_NODE_PASSWORD", "rootrank-node-pw")
        .output()
        .context("running scripts/etcd-roles.sh")?;
    if !out.status.success() {
        bail!(
            "scripts/etcd-roles.sh failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// A password file holding `password` (mode 600), in `dir`.
pub fn password_file(dir: &Path, user: &str, password: &str) -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join(format!("{user}.password"));
    std::fs::write(&p, format!("{password}\n"))?;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600))?;
    Ok(p)
}
