//! SPEC section 7 on real etcd run the way production runs it: TLS with client certificates
//! (certificates made here with openssl), and etcd's own auth with the least roles of
//! `scripts/etcd-roles.sh`; and the coordinator's HTTPS with a bearer token. Every component
//! works with the right credentials; each wrong one stops start-up (serve, node-watch) or is
//! reported by the agent, quickly, with what was refused, and writes nothing.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rootrank_agent::{Agent, AgentConfig};
use rootrank_store::etcd_client::GetOptions;
use rootrank_store::{EtcdAccess, EtcdCredentialFiles};
use rootrank_testkit::pki::{enable_auth_with_roles, password_file, Pki, TlsEtcd};
use rootrank_testkit::{eventually, rootrank_bin, Coordinator, Etcd, Rank};
use serde_json::Value;

const T: Duration = Duration::from_secs(20);
const PREFIX: &str = "/rootrank/v1";

/// Runs `rootrank ARGS` expecting it to stop on its own; (exit code, stderr, how long it took).
fn run_to_exit(args: &[String]) -> (i32, String, Duration) {
    let started = Instant::now();
    let mut child = Command::new(rootrank_bin())
        .args(args)
        .env("NO_COLOR", "1")
        .env("ROOTRANK_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A start-up that does not stop is the bug this guards against: kill it after 20 s.
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > T {
            let _ = child.kill();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let took = started.elapsed();
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        took,
    )
}

fn args(parts: &[&str], more: &[String]) -> Vec<String> {
    parts
        .iter()
        .map(|s| s.to_string())
        .chain(more.iter().cloned())
        .collect()
}

/// Every key under the prefix, read with credentials that may read it all.
async fn keys(access: &EtcdAccess) -> Vec<String> {
    let mut c = rootrank_store::connect(access).await.unwrap();
    let got = c
        .get(PREFIX, Some(GetOptions::new().with_prefix().with_keys_only()))
        .await
        .unwrap();
    got.kvs()
        .iter()
        .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
        .collect()
}

async fn resolved(c: &Coordinator, room: u64) -> Value {
    eventually(T, "a resolved verdict", || async {
        let (status, v) = c.get(&format!("/v1/rooms/{room}/verdict")).await.ok()?;
        (status == 200 && v["status"] == "resolved").then_some(v)
    })
    .await
    .unwrap()
}

/// An in-process agent with `access`; how long until it says etcd refuses it, and what.
fn agent_refusal(access: EtcdAccess) -> (String, Duration) {
    let mut cfg = AgentConfig::new(access.endpoints.clone(), "refused-0", 0, 1).unwrap();
    cfg.etcd = access;
    cfg.lease_ttl = Duration::from_secs(1);
    let started = Instant::now();
    let agent = Agent::start(cfg).unwrap();
    assert_eq!(agent.wait_registered(T), None, "a refused agent does not register");
    let why = agent.etcd_refused().expect("the agent says etcd refuses it");
    let took = started.elapsed();
    // Retrying quietly: still refused, still not registered.
    std::thread::sleep(Duration::from_millis(500));
    assert!(agent.etcd_refused().is_some());
    assert_eq!(agent.incarnation(), None);
    assert!(agent.shutdown(Duration::from_secs(5)));
    (why, took)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_client_certificates_every_component_works() {
    let pki = Pki::new().unwrap();
    let etcd = TlsEtcd::start(&pki, true).unwrap();
    let ep = etcd.endpoint();
    let good = pki.flags("ca", Some("client"));
    let flags: Vec<&str> = good.iter().map(String::as_str).collect();
    let coord = Coordinator::start(&ep, &flags).await.unwrap();
    let watch = rootrank_testkit::node::NodeWatch::start_with(&ep, &flags).unwrap();

    // A rank registers and publishes; its verdict is served.
    let mut ranks: Vec<Rank> = (0..2)
        .map(|r| Rank::start_with(&ep, "tls-0", r, 2, 30_000, &good).unwrap())
        .collect();
    ranks[1].fail(7, "local", "nixl_error", "NIXL_ERR_BACKEND").unwrap();
    ranks[0]
        .fail(7, "propagated", "other", "NIXL KVSender Exception")
        .unwrap();
    let v = resolved(&coord, 7).await;
    assert_eq!(v["culprit"]["rank"], 1, "{v}");

    // node-watch certifies a SIGKILLed rank over TLS (its 30 s lease has not run out: the
    // verdict can only come from node-watch's certificate).
    watch.wait_watching("tls-0", 0, ranks[0].pid).await.unwrap();
    ranks[0].kill9();
    ranks[1]
        .fail(8, "propagated", "other", "NIXL KVSender Exception")
        .unwrap();
    let v = resolved(&coord, 8).await;
    assert_eq!(v["culprit"]["rank"], 0, "{v}");
    assert_eq!(v["culprit"]["reason"], "process_exit", "{v}");

    // The supervisor certifies its child's exit over TLS, and hands the credentials to the
    // child in its environment (the child prints what it got).
    let (code, _, _) = run_to_exit(&args(
        &[
            "run",
            "--etcd-endpoints",
            &ep,
            "--group",
            "tls-run",
            "--rank",
            "0",
            "--group-size",
            "1",
            "--agent-grace-ms",
            "200",
        ],
        &[
            good.clone(),
            vec![
                "--".into(),
                "sh".into(),
                "-c".into(),
                "test -n \"$ROOTRANK_ETCD_CACERT\" && test -n \"$ROOTRANK_ETCD_KEY\" && sleep 1 && exit 3".into(),
            ],
        ]
        .concat(),
    ));
    assert_eq!(code, 3, "the child saw the credentials and exited 3");
    let access = EtcdAccess::new(vec![ep.clone()], &pki.files("ca", Some("client"))).unwrap();
    let certs: Vec<String> = keys(&access)
        .await
        .into_iter()
        .filter(|k| k.starts_with(&format!("{PREFIX}/groups/tls-run/ranks/0/down/")))
        .collect();
    assert_eq!(certs.len(), 1, "the supervisor's certificate: {certs:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_wrong_tls_credential_is_refused_clearly_and_writes_nothing() {
    let pki = Pki::new().unwrap();
    let etcd = TlsEtcd::start(&pki, true).unwrap();
    let ep = etcd.endpoint();
    let cases = [
        (
            "a CA that did not sign etcd's certificate",
            pki.files("rogue-ca", Some("client")),
        ),
        ("no client certificate", pki.files("ca", None)),
        (
            "a client certificate etcd does not trust",
            pki.files("ca", Some("rogue-client")),
        ),
        ("an expired client certificate", pki.files("ca", Some("expired-client"))),
    ];
    for (what, files) in cases {
        let flags = flags_of(&files);
        for cmd in ["serve", "node-watch"] {
            let mut a = args(&[cmd, "--etcd-endpoints", &ep], &flags);
            if cmd == "serve" {
                a.extend(["--listen".to_string(), "127.0.0.1:0".to_string()]);
            }
            let (code, stderr, took) = run_to_exit(&a);
            eprintln!("{cmd} with {what}: exit {code} after {took:?}: {}", stderr.trim());
            assert_eq!(code, 1, "{cmd} with {what} stops: {stderr}");
            assert!(
                stderr.contains("refused us") && stderr.contains("TLS"),
                "{cmd} with {what}: {stderr}"
            );
        }
        let (why, took) = agent_refusal(EtcdAccess::new(vec![ep.clone()], &files).unwrap());
        eprintln!("agent with {what}: refused after {took:?}: {why}");
        assert!(why.contains("TLS"), "{what}: {why}");
    }
    let good = EtcdAccess::new(vec![ep], &pki.files("ca", Some("client"))).unwrap();
    assert_eq!(keys(&good).await, Vec::<String>::new(), "nothing was written");
}

fn flags_of(f: &EtcdCredentialFiles) -> Vec<String> {
    let mut out = Vec::new();
    let paths = [
        ("--etcd-cacert", &f.cacert),
        ("--etcd-cert", &f.cert),
        ("--etcd-key", &f.key),
        ("--etcd-password-file", &f.password_file),
    ];
    for (flag, p) in paths {
        if let Some(p) = p {
            out.extend([flag.to_string(), p.display().to_string()]);
        }
    }
    if let Some(u) = &f.user {
        out.extend(["--etcd-user".to_string(), u.clone()]);
    }
    out
}

fn user(dir: &Path, name: &str, password: &str) -> EtcdCredentialFiles {
    EtcdCredentialFiles {
        user: Some(name.to_string()),
        password_file: Some(password_file(dir, &format!("{name}-{password}"), password).unwrap()),
        ..EtcdCredentialFiles::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_auth_with_the_least_roles() {
    let etcd = Etcd::start().unwrap();
    let ep = etcd.endpoint();
    enable_auth_with_roles(&ep, PREFIX).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let rank_user = user(dir.path(), "rootrank-rank", "rootrank-rank-pw");
    let coord_user = user(dir.path(), "rootrank-coordinator", "rootrank-coordinator-pw");
    let node_user = user(dir.path(), "rootrank-node", "rootrank-node-pw");
    let root = EtcdAccess::new(vec![ep.clone()], &user(dir.path(), "root", "root-pw")).unwrap();

    // Less than a component needs: each stops at start-up and says what was refused.
    let wrong_password = user(dir.path(), "rootrank-coordinator", "not-the-password");
    for (cmd, files, expect) in [
        ("serve", &wrong_password, "authentication failed"),
        ("serve", &rank_user, "permission denied"),
        ("node-watch", &rank_user, "permission denied"),
        ("node-watch", &wrong_password, "authentication failed"),
    ] {
        let mut a = args(&[cmd, "--etcd-endpoints", &ep], &flags_of(files));
        if cmd == "serve" {
            a.extend(["--listen".to_string(), "127.0.0.1:0".to_string()]);
        }
        let (code, stderr, took) = run_to_exit(&a);
        eprintln!(
            "{cmd} as {:?}: exit {code} after {took:?}: {}",
            files.user,
            stderr.trim()
        );
        assert_eq!(code, 1, "{stderr}");
        assert!(stderr.contains(expect), "{cmd}: {stderr}");
        assert!(
            stderr.contains(files.user.as_deref().unwrap()),
            "names the user: {stderr}"
        );
    }
    let (why, took) =
        agent_refusal(EtcdAccess::new(vec![ep.clone()], &user(dir.path(), "rootrank-rank", "nope")).unwrap());
    eprintln!("agent with a wrong password: refused after {took:?}: {why}");
    assert!(why.contains("authentication failed"), "{why}");
    // A user whose role has no key of ours (here: only a foreign prefix).
    rootrank_testkit::pki::etcdctl(&ep, Some("root:root-pw"), &["role", "add", "elsewhere"]).unwrap();
    rootrank_testkit::pki::etcdctl(
        &ep,
        Some("root:root-pw"),
        &[
            "role",
            "grant-permission",
            "elsewhere",
            "readwrite",
            "--prefix=true",
            "/other/",
        ],
    )
    .unwrap();
    rootrank_testkit::pki::etcdctl(
        &ep,
        Some("root:root-pw"),
        &["user", "add", "outsider", "--new-user-password=o-pw"],
    )
    .unwrap();
    rootrank_testkit::pki::etcdctl(
        &ep,
        Some("root:root-pw"),
        &["user", "grant-role", "outsider", "elsewhere"],
    )
    .unwrap();
    let (why, _) = agent_refusal(EtcdAccess::new(vec![ep.clone()], &user(dir.path(), "outsider", "o-pw")).unwrap());
    assert!(why.contains("permission denied"), "{why}");
    assert_eq!(
        keys(&root).await,
        Vec::<String>::new(),
        "nothing was written by any refused attempt"
    );

    // Exactly the right role: each component works.
    let coord = Coordinator::start(
        &ep,
        &flags_of(&coord_user).iter().map(String::as_str).collect::<Vec<_>>(),
    )
    .await
    .unwrap();
    let node_flags = flags_of(&node_user);
    let watch =
        rootrank_testkit::node::NodeWatch::start_with(&ep, &node_flags.iter().map(String::as_str).collect::<Vec<_>>())
            .unwrap();
    let rank_flags = flags_of(&rank_user);
    let mut ranks: Vec<Rank> = (0..2)
        .map(|r| Rank::start_with(&ep, "auth-0", r, 2, 30_000, &rank_flags).unwrap())
        .collect();
    ranks[0].fail(11, "local", "nixl_error", "NIXL_ERR_BACKEND").unwrap();
    ranks[1]
        .fail(11, "propagated", "other", "NIXL KVSender Exception")
        .unwrap();
    assert_eq!(resolved(&coord, 11).await["culprit"]["rank"], 0);
    watch.wait_watching("auth-0", 1, ranks[1].pid).await.unwrap();
    ranks[1].kill9();
    ranks[0]
        .fail(12, "propagated", "other", "NIXL KVSender Exception")
        .unwrap();
    let v = resolved(&coord, 12).await;
    assert_eq!(
        (v["culprit"]["rank"].clone(), v["culprit"]["reason"].clone()),
        (1.into(), "process_exit".into()),
        "{v}"
    );

    // The rank's role reaches nothing outside {p}/groups/: not the coordinators' keys, not
    // another prefix.
    let rank_access = EtcdAccess::new(vec![ep.clone()], &rank_user).unwrap();
    let mut c = rootrank_store::connect(&rank_access).await.unwrap();
    for key in [format!("{PREFIX}/coordinators/forged"), "/other/forged".to_string()] {
        let e = c.put(key.clone(), "x", None).await.unwrap_err();
        assert_eq!(
            rootrank_store::Refusal::of(&e).map(|r| matches!(r, rootrank_store::Refusal::Permission(_))),
            Some(true),
            "{key}: {e}"
        );
    }
    assert!(c
        .get(format!("{PREFIX}/coordinators/"), Some(GetOptions::new().with_prefix()))
        .await
        .is_err());
    // The coordinator's presence is there (its role may write it).
    assert!(keys(&root)
        .await
        .iter()
        .any(|k| k.starts_with(&format!("{PREFIX}/coordinators/"))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_and_a_bearer_token_on_the_coordinator() {
    let pki = Pki::new().unwrap();
    let etcd = Etcd::start().unwrap();
    let ep = etcd.endpoint();
    let dir = tempfile::tempdir().unwrap();
    let token_file = password_file(dir.path(), "token", "t0ken-for-operators").unwrap();
    let port = rootrank_testkit::free_port().unwrap();
    let base = format!("https://127.0.0.1:{port}");
    let serve = |token: &Path| {
        args(
            &[
                "serve",
                "--etcd-endpoints",
                &ep,
                "--listen",
                &format!("127.0.0.1:{port}"),
            ],
            &[
                "--tls-cert".into(),
                pki.path("server.pem").display().to_string(),
                "--tls-key".into(),
                pki.path("server.key").display().to_string(),
                "--auth-token-file".into(),
                token.display().to_string(),
            ],
        )
    };

    // A token file that is missing or empty stops start-up with what to fix.
    let (code, stderr, _) = run_to_exit(&serve(&dir.path().join("missing")));
    assert_eq!(code, 1);
    assert!(stderr.contains("cannot read token file"), "{stderr}");
    let empty = dir.path().join("empty");
    std::fs::write(&empty, "\n").unwrap();
    let (code, stderr, _) = run_to_exit(&serve(&empty));
    assert_eq!(code, 1);
    assert!(stderr.contains("is empty"), "{stderr}");

    // World-readable: served, with a warning.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let log = dir.path().join("serve.log");
    let _serving = KillOnDrop(
        Command::new(rootrank_bin())
            .args(serve(&token_file))
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let http = rootrank_tls::http_client(Some(&pki.path("ca.pem")))
        .unwrap()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let get = |path: &str, auth: Option<Vec<u8>>| {
        let mut req = http.get(format!("{base}{path}"));
        if let Some(a) = auth {
            req = req.header("authorization", reqwest::header::HeaderValue::from_bytes(&a).unwrap());
        }
        async move {
            let r = req.send().await?;
            let status = r.status().as_u16();
            Ok::<_, reqwest::Error>((status, r.text().await?))
        }
    };
    eventually(T, "the coordinator answers over HTTPS", || async {
        matches!(get("/readyz", None).await, Ok((200, _))).then_some(())
    })
    .await
    .unwrap();
    assert!(std::fs::read_to_string(&log)
        .unwrap()
        .contains("readable by other users"));

    let mut rank = Rank::start(&ep, "https-0", 0, 1, 1_000).unwrap();
    rank.fail(21, "local", "nixl_error", "secret traceback line").unwrap();
    let bearer = b"Bearer t0ken-for-operators".to_vec();
    eventually(T, "the verdict, with the token", || async {
        let (s, body) = get("/v1/rooms/21/verdict", Some(bearer.clone())).await.ok()?;
        (s == 200 && body.contains("\"resolved\"")).then_some(())
    })
    .await
    .unwrap();

    // Without the token (or with a wrong, huge or malformed one): 401, and nothing about a rank.
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    let bad: Vec<Option<Vec<u8>>> = vec![
        None,
        Some(b"Bearer wrong".to_vec()),
        Some(b"Bearer ".to_vec()),
        Some(b"Basic dDBrZW4=".to_vec()),
        Some([b"Bearer ".as_slice(), &vec![b'a'; 60_000]].concat()),
        Some(b"Bearer t0ken-for-operators\xff".to_vec()),
    ];
    for auth in bad {
        for path in [
            "/v1/rooms/21/verdict",
            "/v1/groups",
            "/v1/groups/https-0",
            "/v1/failures",
            "/v1/health",
            "/v1/events?since=0",
        ] {
            let (status, body) = get(path, auth.clone()).await.unwrap();
            assert!(status == 401 || status == 431, "{path} {status}");
            assert!(
                !body.contains("secret traceback") && !body.contains(host.trim()),
                "{path}: {body}"
            );
        }
    }
    // Open routes stay open.
    for path in ["/healthz", "/readyz", "/metrics", "/"] {
        assert_eq!(get(path, None).await.unwrap().0, 200, "{path}");
    }
    assert!(
        get("/metrics", None).await.unwrap().1.contains("status=\"401\""),
        "401s are counted"
    );

    // The CLI: without the token it says what to pass; with it, the verdict.
    let why = |extra: &[&str]| {
        let out = Command::new(rootrank_bin())
            .args([
                "why",
                "21",
                "--coordinator",
                &base,
                "--cacert",
                &pki.path("ca.pem").display().to_string(),
            ])
            .args(extra)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let (code, out) = why(&[]);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("--token-file"), "{out}");
    let (code, out) = why(&["--token-file", &token_file.display().to_string()]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("https-0 rank 0"), "{out}");
    // The scheme is case-insensitive (RFC 7235).
    for scheme in ["BEARER", "bearer", "bEaReR"] {
        let auth = format!("{scheme} t0ken-for-operators").into_bytes();
        assert_eq!(get("/v1/groups", Some(auth)).await.unwrap().0, 200, "{scheme}");
    }
    // Plain HTTP to the HTTPS port is told to use https (it used to be a bare close), no data
    // is served, and the server carries on.
    let plain = rootrank_tls::http_client(None).unwrap().build().unwrap();
    let r = plain
        .get(format!("http://127.0.0.1:{port}/v1/groups"))
        .header("authorization", "Bearer t0ken-for-operators")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let text = r.text().await.unwrap();
    assert!(text.contains("use https://"), "{text}");
    assert!(!text.contains("https-0"), "{text}");
    assert_eq!(get("/readyz", None).await.unwrap().0, 200);
}

/// A child killed when the test ends, failed assertions included.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
