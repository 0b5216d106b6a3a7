//! `rootrank demo`: the whole story on one machine, narrated: a private etcd, an in-process
//! coordinator, a simulated PD deployment (4 prefill + 4 decode ranks, real NIXL), one
//! transfer failure and one SIGKILLed prefill rank.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rootrank_coordinator::CoordinatorConfig;
use rootrank_sim::parent::{Fault, FaultKind, RoomSummary, SimConfig};
use rootrank_sim::rank::culprit_error;
use rootrank_store::embedded::{EmbeddedEtcd, EtcdOptions};
use serde_json::Value;

use super::why::render;

#[derive(clap::Args, Debug)]
pub struct DemoArgs {}

const RANKS: u32 = 4;
const FAIL_RANK: u32 = 2;
const FAIL_AT: u64 = 2;
const KILL_RANK: u32 = 1;
const KILL_AT: u64 = 5;

pub fn run(_a: DemoArgs) -> anyhow::Result<u8> {
    let lib = rootrank_transfer_agent::load_nixl(None).context(
        "rootrank demo runs real NIXL transfers and needs the NIXL runtime: run `make nixl` or `scripts/fetch-nixl.sh`",
    )?;
    let started = Instant::now();
    let dir = std::env::temp_dir().join(format!("rootrank-demo-{}", std::process::id()));
    let etcd_dir = dir.join("etcd");
    let etcd = EmbeddedEtcd::start(&etcd_dir, &EtcdOptions::default()).context("starting a private etcd")?;
    println!("== rootrank demo ==");
    println!("private etcd (pid {}) at {}", etcd.pid().unwrap_or(0), etcd.endpoint());

    // One thread for the coordinator and the simulation, with a quieter log than `info`:
    // the narration is the output (ROOTRANK_LOG still wins when set).
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let filter = std::env::var("ROOTRANK_LOG").unwrap_or_else(|_| "error".into());
    let quiet = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .compact()
        .finish();
    let _quiet = tracing::subscriber::set_default(quiet);
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let url = format!("http://127.0.0.1:{port}");
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let coordinator = rt.spawn(rootrank_coordinator::run(
        CoordinatorConfig::new(vec![etcd.endpoint()], ([127, 0, 0, 1], port).into()),
        async {
            let _ = stop_rx.await;
        },
    ));
    let http = rootrank_tls::http_client(None)?
        .timeout(Duration::from_secs(40))
        .build()?;
    let result = rt.block_on(story(&http, &url, &etcd, &dir, lib.libs_dir().to_path_buf()));
    let _ = stop_tx.send(());
    let _ = rt.block_on(coordinator);
    drop(etcd);
    let _ = std::fs::remove_dir_all(&etcd_dir);
    result?;
    println!(
        "\n(demo took {:.1} s; no process left running)",
        started.elapsed().as_secs_f64()
    );
    Ok(0)
}

async fn get_json(http: &reqwest::Client, url: &str) -> anyhow::Result<Value> {
    Ok(http.get(url).send().await?.error_for_status()?.json().await?)
}

async fn metrics(http: &reqwest::Client, url: &str) -> anyhow::Result<BTreeMap<String, String>> {
    let text = http.get(format!("{url}/metrics")).send().await?.text().await?;
    Ok(text
        .lines()
        .filter(|l| l.starts_with("rootrank_") && !l.contains("_bucket{"))
        .filter_map(|l| l.rsplit_once(' ').map(|(k, v)| (k.to_string(), v.to_string())))
        .collect())
}

async fn story(
    http: &reqwest::Client,
    url: &str,
    etcd: &EmbeddedEtcd,
    dir: &std::path::Path,
    nixl_dir: std::path::PathBuf,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !matches!(http.get(format!("{url}/readyz")).send().await, Ok(r) if r.status().is_success()) {
        if Instant::now() > deadline {
            bail!("the coordinator at {url} did not become ready in 20 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!("coordinator (in this process) at {url}");
    let before = metrics(http, url).await?;

    let config = SimConfig {
        exe: std::env::current_exe()?,
        etcd_endpoints: vec![etcd.endpoint()],
        etcd_files: Default::default(),
        prefix: "/rootrank/v1".into(),
        coordinator: Some(url.to_string()),
        prefill_group: "prefill-0".into(),
        decode_group: "decode-0".into(),
        ranks: RANKS,
        rooms: 8,
        room_rate: 4.0,
        block_size: 256 << 10,
        chunks: 2,
        slots: 8,
        // 1 s leases so a SIGKILLed rank's death shows within about a second (default 5 s).
        lease_ttl_ms: 1_000,
        transfer_timeout_ms: 2_000,
        reduce_timeout_ms: 3_000,
        verdict_wait_ms: 6_000,
        faults: vec![
            Fault {
                kind: FaultKind::FailTransfer,
                rank: FAIL_RANK,
                at_room: FAIL_AT,
            },
            Fault {
                kind: FaultKind::KillPrefill,
                rank: KILL_RANK,
                at_room: KILL_AT,
            },
        ],
        log_dir: dir.join("logs"),
        nixl_dir: Some(nixl_dir),
    };
    println!(
        "\nA simulated PD deployment: {RANKS} prefill + {RANKS} decode rank processes, each with a NIXL agent \
         (UCX, DRAM) and a rootrank agent (1 s liveness leases). Every prefill rank WRITEs its KV shard of each \
         room into its decode peer; the prefill ranks MIN-all-reduce their poll states like gloo.\n\
         Faults: room {FAIL_AT}: prefill rank {FAIL_RANK}'s WRITE fails inside NIXL; room {KILL_AT}: prefill rank \
         {KILL_RANK} is SIGKILLed (no log line, like the OOM killer).\n"
    );
    let mut print = |s: &RoomSummary| println!("  {}", s.line());
    let report = rootrank_sim::parent::run(config, std::future::pending::<()>(), &mut print).await?;

    for (title, idx, rank) in [
        ("a transfer failure", FAIL_AT, FAIL_RANK),
        ("a SIGKILLed prefill rank", KILL_AT, KILL_RANK),
    ] {
        let Some(room) = report.rooms.iter().find(|r| r.idx == idx) else {
            continue;
        };
        println!("\n-- room {} ({title}, prefill rank {rank}) --", room.room);
        if let Some(r) = room.reports.iter().find(|r| r.generic.is_some()) {
            println!(
                "What a survivor (rank {}) hits without rootrank, as SGLang logs it:",
                r.rank
            );
            println!("  {}", r.generic.as_deref().unwrap_or(""));
            let room_id: u64 = room.room.parse().unwrap_or(0);
            if let Some(with) = r.verdict.as_ref().and_then(|v| culprit_error(room_id, v)) {
                println!("What it raises instead, having asked the coordinator where SGLang raises the generic error:");
                println!("  {with}");
            }
        }
        if let Some(own) = room.reports.iter().find_map(|r| r.error.as_ref().map(|e| (r.rank, e))) {
            println!(
                "What rank {} itself saw (before rootrank, only in its own process):",
                own.0
            );
            println!("  {}", own.1);
        }
        println!("What `rootrank why {} --group prefill-0` says:", room.room);
        let v = get_json(
            http,
            &format!("{url}/v1/rooms/{}/verdict?group=prefill-0&wait_ms=5000", room.room),
        )
        .await?;
        for line in render(&v).lines() {
            println!("  {line}");
        }
    }
    if !report.measurements.is_empty() {
        println!();
        for m in &report.measurements {
            println!("measured: {}: {:.0} ms", m.what, m.ms);
        }
    }
    let after = metrics(http, url).await?;
    println!(
        "\nMetrics that moved (GET /metrics before and after, rootrank_* lines, histogram buckets left out; \
         ranks that exited cleanly have no rank_up series; the killed one reads 0):"
    );
    for (k, v) in &after {
        let old = before.get(k).map(String::as_str);
        if old != Some(v.as_str()) && !k.starts_with("rootrank_http_request_duration") {
            println!("  {k} {} -> {v}", old.unwrap_or("(absent)"));
        }
    }
    println!(
        "\nRank logs (grep them as you would SGLang's): {}",
        report.log_dir.display()
    );
    Ok(())
}
