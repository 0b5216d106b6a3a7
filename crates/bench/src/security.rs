//! Part 11: what security costs (SPEC section 7), each side by side with plain in one run:
//! verdict lookups over HTTPS with a bearer token next to plain HTTP (the same etcd state, two
//! coordinators, wrk), and an agent's publish latency (`record_failure` to the record on a
//! watch, one record at a time) over etcd with TLS and client certificates next to plain etcd.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rootrank_agent::{Agent, AgentConfig};
use rootrank_core::Origin;
use rootrank_store::EtcdAccess;
use rootrank_testkit::pki::{Pki, TlsEtcd};
use serde_json::{json, Value};

use crate::load;
use crate::procs::{self, Coordinator, Env};
use crate::state::{self, KeepAlives};
use crate::util::Dist;
use crate::verdicts::{self, PREFIX};

#[derive(Clone, Debug)]
pub struct SecurityCfg {
    pub rooms: usize,
    pub conns: usize,
    pub duration: Duration,
    /// Records published one at a time per variant of the agent's latency.
    pub publishes: usize,
}

impl SecurityCfg {
    pub fn full() -> Self {
        SecurityCfg {
            rooms: 2_000,
            conns: 16,
            duration: Duration::from_secs(10),
            publishes: 500,
        }
    }
    pub fn smoke() -> Self {
        SecurityCfg {
            rooms: 20,
            conns: 4,
            duration: Duration::from_secs(1),
            publishes: 20,
        }
    }
}

const TOKEN: &str = "bench-token-0123456789abcdef";

pub async fn run(env: &Env, cfg: &SecurityCfg) -> anyhow::Result<Value> {
    let dir = env.subdir("security")?;
    let pki = tokio::task::spawn_blocking(Pki::new).await??;
    let token_file = dir.join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n"))?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600))?;
    }

    // Verdicts: one etcd state, a plain coordinator and an HTTPS + token one.
    let etcd = procs::start_etcd(&dir, &[])?;
    let endpoint = etcd.endpoint();
    let clients = state::clients(&endpoint, 2).await?;
    let data = state::populate(&clients, PREFIX, "prefill", 8, 8, 60, cfg.rooms, 8, 1).await?;
    let keepalives = KeepAlives::start(
        &clients,
        &data.leases,
        Duration::from_secs(20),
        Duration::from_secs(3600),
    );
    let plain = Coordinator::start(env, &endpoint, PREFIX, Duration::from_secs(60)).await?;
    let secure_args = vec![
        "--tls-cert".to_string(),
        pki.path("server.pem").display().to_string(),
        "--tls-key".into(),
        pki.path("server.key").display().to_string(),
        "--auth-token-file".into(),
        token_file.display().to_string(),
    ];
    let secure = Coordinator::start_https(
        env,
        &endpoint,
        PREFIX,
        Duration::from_secs(60),
        &secure_args,
        &pki.path("ca.pem"),
    )
    .await?;
    let paths = verdicts::verdict_paths(&data.rooms, 10_000);
    let first = paths.first().context("no rooms")?;
    verdicts::check_resolved(&plain.url, first).await?;
    check_token(&secure.url, first, &pki).await?;
    let header = format!("Authorization: Bearer {TOKEN}");
    let mut runs = Vec::new();
    for (name, coord, headers) in [("http", &plain, vec![]), ("https_token", &secure, vec![header])] {
        let (work, url, paths, conns, duration) = (
            env.work.clone(),
            coord.url.clone(),
            paths.clone(),
            cfg.conns,
            cfg.duration,
        );
        let target = format!("verdict_{name}");
        let run = tokio::task::spawn_blocking(move || {
            load::wrk_with(&work, &target, &url, &paths, conns, duration, &headers)
        })
        .await??;
        if run.errors > 0 {
            bail!("{name}: {} of {} requests failed", run.errors, run.requests);
        }
        runs.push(run);
    }
    keepalives.stop();
    drop((plain, secure));

    // The agent's publish latency, plain etcd and TLS etcd with client certificates.
    // (Blocks this task for the etcd start, ~0.5 s: nothing else runs in this part now.)
    let tls_etcd = TlsEtcd::start(&pki, true)?;
    let variants = [
        ("plain", EtcdAccess::plain(vec![endpoint.clone()])),
        (
            "tls_client_cert",
            EtcdAccess::new(vec![tls_etcd.endpoint()], &pki.files("ca", Some("client")))?,
        ),
    ];
    let mut publish = serde_json::Map::new();
    for (name, access) in variants {
        let n = cfg.publishes;
        let dist = tokio::task::spawn_blocking(move || publish_latency(access, name, n)).await??;
        publish.insert(name.to_string(), serde_json::to_value(dist)?);
    }
    let (h, s) = (&runs[0], &runs[1]);
    Ok(json!({
        "setup": {
            "rooms": cfg.rooms, "conns": cfg.conns, "duration_s": cfg.duration.as_secs_f64(),
            "publishes": cfg.publishes,
            "note": "one run, same machine and etcd state: plain and secure side by side; certificates are P-256 ECDSA made with openssl",
        },
        "verdicts": runs,
        "publish": publish,
        "ratios": {
            "https_token_over_http_rps": verdicts::ratio(s.rps, h.rps),
            "https_token_p99_over_http_p99": verdicts::ratio(s.latency.p99_us, h.latency.p99_us),
            "tls_over_plain_publish_p50": verdicts::ratio(
                publish["tls_client_cert"]["p50_us"].as_f64().unwrap_or(0.0),
                publish["plain"]["p50_us"].as_f64().unwrap_or(0.0)),
            "tls_over_plain_publish_p99": verdicts::ratio(
                publish["tls_client_cert"]["p99_us"].as_f64().unwrap_or(0.0),
                publish["plain"]["p99_us"].as_f64().unwrap_or(0.0)),
        },
    }))
}

/// The secure coordinator answers the verdict with the token and 401 without it.
async fn check_token(url: &str, path: &str, pki: &Pki) -> anyhow::Result<()> {
    let http = rootrank_tls::http_client(Some(&pki.path("ca.pem")))?
        .timeout(Duration::from_secs(5))
        .build()?;
    let without = http.get(format!("{url}{path}")).send().await?.status().as_u16();
    let with: Value = http
        .get(format!("{url}{path}"))
        .bearer_auth(TOKEN)
        .send()
        .await?
        .json()
        .await?;
    if without != 401 || with["status"] != "resolved" {
        bail!("the HTTPS coordinator answered {without} without the token and {with} with it");
    }
    Ok(())
}

/// One record at a time: from `record_failure` to the record arriving on a watch of etcd
/// (the same credentials), i.e. what a reader sees. The first few, while the agent connects,
/// are left out. (`flush` is not the clock: it polls every millisecond.)
fn publish_latency(access: EtcdAccess, group: &str, n: usize) -> anyhow::Result<Dist> {
    let group = format!("bench-{}", group.replace('_', "-"));
    let mut cfg = AgentConfig::new(access.endpoints.clone(), &group, 0, 1)?;
    cfg.etcd = access.clone();
    cfg.prefix = PREFIX.to_string();
    let agent = Agent::start(cfg)?;
    if agent.wait_registered(Duration::from_secs(20)).is_none() {
        bail!("{group}: the agent did not register: {:?}", agent.etcd_refused());
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let samples = rt.block_on(async {
        let mut client = rootrank_store::connect(&access).await?;
        let rooms = format!("{PREFIX}/groups/{group}/rooms/");
        let mut stream = client
            .watch(
                rooms,
                Some(rootrank_store::etcd_client::WatchOptions::new().with_prefix()),
            )
            .await?;
        let mut samples = Vec::with_capacity(n);
        for i in 0..(n + 5) {
            let t = Instant::now();
            agent.record_failure(i as u64 + 1, Origin::Local, "nixl_error", "bench", None)?;
            let seen = tokio::time::timeout(Duration::from_secs(10), async {
                while let Some(resp) = stream.message().await? {
                    if !resp.events().is_empty() {
                        return anyhow::Ok(());
                    }
                }
                bail!("the watch ended")
            })
            .await;
            match seen {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e),
                Err(_) => bail!("{group}: record {i} not seen on the watch within 10 s"),
            }
            if i >= 5 {
                samples.push(t.elapsed());
            }
        }
        anyhow::Ok(samples)
    })?;
    agent.shutdown(Duration::from_secs(5));
    Ok(Dist::from_durations(&samples))
}
