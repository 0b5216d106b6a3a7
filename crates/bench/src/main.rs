//! `rootrank-bench`: see the crate docs (src/lib.rs) and mk/bench.mk.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use rootrank_bench::{
    agent_cost, burst, detection, events, ingest, keepalive, long_polls, node_memory, scale, startup,
    util::parse_duration, verdicts, Env, Suite,
};

// Counts allocations only while the core-index measurement turns it on (see alloc.rs).
#[global_allocator]
static GLOBAL: rootrank_bench::alloc::Counting = rootrank_bench::alloc::Counting;

#[derive(Parser, Debug)]
#[command(
    name = "rootrank-bench",
    about = "rootrank against its alternatives and its limits, side by side"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args, Debug)]
struct Out {
    /// Output directory (results.json, results.md, latency.svg). Default: bench-results
    /// for `all`, bench-results/PART for one part.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Every part (what `make bench` runs); --smoke for tiny sizes.
    All {
        #[arg(long)]
        smoke: bool,
        #[command(flatten)]
        out: Out,
    },
    /// 1. Verdict lookups vs /healthz vs etcd-direct.
    Verdicts {
        #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
        conns: Vec<usize>,
        #[arg(long, default_value = "10s")]
        duration: String,
        #[arg(long, default_value_t = 64)]
        groups: usize,
        #[arg(long, default_value_t = 8)]
        ranks: u32,
        #[arg(long, default_value_t = 10_000)]
        rooms: usize,
        #[arg(long, default_value_t = 8)]
        records_per_room: u32,
        #[command(flatten)]
        out: Out,
    },
    /// 2. Ingest: records/s from many agents, commit-to-visible lag, CPU per record.
    Ingest {
        /// Agents publish one record at a time each (create-if-absent, waiting for the commit),
        /// so the offered rate needs enough of them: 32 top out near 2,600 records/s here.
        #[arg(long, default_value_t = 128)]
        agents: usize,
        #[arg(long, value_delimiter = ',', default_value = "500,1000,2000,5000,10000,20000")]
        rates: Vec<u64>,
        #[arg(long, default_value = "6s")]
        duration: String,
        #[arg(long, default_value_t = 50.0)]
        probe_rate: f64,
        /// The agents' max_batch (1: one put per record, as before batching).
        #[arg(long, default_value_t = rootrank_store::MAX_BATCH_RECORDS)]
        max_batch: usize,
        #[command(flatten)]
        out: Out,
    },
    /// 3. Detection: SIGKILL to resolved verdict.
    Detection {
        #[arg(long, default_value_t = 50)]
        kills: usize,
        /// Lease TTLs in seconds.
        #[arg(long, value_delimiter = ',', default_value = "5,1")]
        ttls: Vec<u64>,
        #[arg(long, default_value_t = 25)]
        batch: usize,
        #[arg(long)]
        no_watchdog: bool,
        #[command(flatten)]
        out: Out,
    },
    /// 4. Scale: many live leases and a million records.
    Scale {
        #[arg(long, default_value_t = 2_000)]
        groups: usize,
        #[arg(long, default_value_t = 16)]
        ranks: u32,
        #[arg(long, default_value_t = 1_000_000)]
        records: usize,
        /// Live lease TTL (30 s by default: see ScaleCfg::full for why not 5 s).
        #[arg(long, default_value_t = 30)]
        ttl_s: i64,
        #[arg(long, default_value = "10s")]
        keepalive_window: String,
        #[arg(long, default_value = "10s")]
        duration: String,
        #[command(flatten)]
        out: Out,
    },
    /// 10. Events: GET /v1/events followed by many readers under a sustained record rate.
    Events {
        #[arg(long, default_value_t = 1_000)]
        readers: usize,
        #[arg(long, default_value_t = 5_000)]
        rate: u64,
        #[arg(long, default_value_t = 32)]
        agents: usize,
        #[arg(long, default_value = "8s")]
        duration: String,
        #[arg(long, default_value_t = 20.0)]
        probe_rate: f64,
        #[command(flatten)]
        out: Out,
    },
    /// 13. A mass death: live keys on one lease revoked under read load, by size.
    MassDeath {
        #[arg(long, value_delimiter = ',', default_value = "1000,10000,100000")]
        sizes: Vec<usize>,
        #[arg(long, default_value_t = 3)]
        readers: usize,
        #[command(flatten)]
        out: Out,
    },
    /// 14. The fleet: simulated ranks on a 3-member etcd cluster, steady load and failures.
    Fleet {
        #[arg(long, value_delimiter = ',', default_value = "10000,30000")]
        sizes: Vec<usize>,
        #[arg(long, default_value_t = 15)]
        ttl_s: i64,
        /// Keepalives/s etcd is given; a larger fleet gets a longer TTL (0: always --ttl-s).
        #[arg(long, default_value_t = 2000.0)]
        keepalive_budget: f64,
        #[arg(long, default_value_t = 40)]
        rack_hosts: usize,
        #[arg(long, default_value = "15s")]
        window: String,
        /// One lease per host of 8 ranks, as `node-watch --host-lease-ttl-ms` holds (v5), instead
        /// of one per rank.
        #[arg(long)]
        host_lease: bool,
        /// `GET /v1/events` readers connected through the failures.
        #[arg(long, default_value_t = 1000)]
        subscribers: usize,
        /// After the failures, this many failed rooms (one record each) are written and a second
        /// coordinator is started on the fleet with them: its start-up and RSS (0: skipped).
        #[arg(long, default_value_t = 0)]
        rooms: usize,
        #[command(flatten)]
        out: Out,
    },
    /// 12. Long polls parked on their rooms while other rooms' records stream in.
    LongPolls {
        #[arg(long, default_value_t = 2_000)]
        polls: usize,
        #[arg(long, default_value_t = 5_000)]
        rate: u64,
        #[arg(long, default_value_t = 32)]
        agents: usize,
        #[arg(long, default_value = "8s")]
        duration: String,
        #[arg(long, default_value_t = 10.0)]
        probe_rate: f64,
        #[command(flatten)]
        out: Out,
    },
    /// 11. Security: verdicts over HTTPS + token next to HTTP; agent publishes over etcd TLS next to plain.
    Security {
        #[arg(long, default_value_t = 2_000)]
        rooms: usize,
        #[arg(long, default_value_t = 16)]
        conns: usize,
        #[arg(long, default_value = "10s")]
        duration: String,
        #[arg(long, default_value_t = 500)]
        publishes: usize,
        #[command(flatten)]
        out: Out,
    },
    /// 5. Agent overhead: record_failure on the caller's thread, next to a NIXL 64 KiB WRITE.
    Agent {
        #[arg(long, default_value_t = 100_000)]
        calls: usize,
        #[arg(long)]
        no_nixl: bool,
        #[arg(long, default_value_t = 1.0)]
        nixl_scale: f64,
        #[command(flatten)]
        out: Out,
    },
    /// 6. Burst: one rank fails every room in flight; batched vs one put per record.
    Burst {
        #[arg(long, default_value_t = 500)]
        rooms: usize,
        #[arg(long, default_value_t = 5)]
        bursts: usize,
        /// The sustained stage's offered records/s.
        #[arg(long, default_value_t = 5_000)]
        rate: u64,
        #[arg(long, default_value_t = 32)]
        agents: usize,
        #[arg(long, default_value = "6s")]
        duration: String,
        #[command(flatten)]
        out: Out,
    },
    /// 7. Keepalives: ranks per etcd core at given lease TTLs (TTL_S:LEASES,...).
    Keepalive {
        #[arg(long, value_delimiter = ',', default_value = "5:6000,30:36000")]
        variants: Vec<String>,
        #[arg(long, default_value = "10s")]
        window: String,
        #[command(flatten)]
        out: Out,
    },
    /// 8. node-watch memory with a million room records in etcd vs none.
    NodeMemory {
        #[arg(long, default_value_t = 1_000_000)]
        records: usize,
        #[arg(long, default_value_t = 1_000)]
        groups: usize,
        #[command(flatten)]
        out: Out,
    },
    /// 9. Start-up: spawn to /readyz with a million records, by snapshot reader count,
    ///    next to the serial load the coordinator did before.
    Startup {
        #[arg(long, default_value_t = 1_000_000)]
        records: usize,
        #[arg(long, default_value_t = 2_000)]
        groups: usize,
        #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
        readers: Vec<usize>,
        /// Records per room, 1..=8 (1: the fleet goal's rooms, each recorded by one rank).
        #[arg(long, default_value_t = 8)]
        per_room: u32,
        #[command(flatten)]
        out: Out,
    },
    /// Re-make results.md and latency.svg from results.json.
    Report {
        #[command(flatten)]
        out: Out,
    },
    /// The coordinator (rootrank_coordinator::run), as a child of the suite.
    #[command(hide = true)]
    ServeCoordinator {
        #[arg(long, value_delimiter = ',')]
        etcd_endpoints: Vec<String>,
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long, default_value = "/rootrank/v1")]
        prefix: String,
        #[arg(long, default_value_t = rootrank_store::DEFAULT_READERS)]
        snapshot_readers: usize,
        #[arg(long, requires = "tls_key")]
        tls_cert: Option<PathBuf>,
        #[arg(long, requires = "tls_cert")]
        tls_key: Option<PathBuf>,
        #[arg(long)]
        auth_token_file: Option<PathBuf>,
    },
    /// A rank with an embedded agent, driven over stdin.
    #[command(hide = true)]
    Rank {
        #[arg(long, value_delimiter = ',')]
        etcd_endpoints: Vec<String>,
        #[arg(long)]
        group: String,
        #[arg(long)]
        rank: u64,
        #[arg(long)]
        group_size: u64,
        #[arg(long, default_value_t = 5_000)]
        lease_ttl_ms: u64,
    },
}

fn main() -> ExitCode {
    match real_main() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("rootrank-bench: error: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn real_main() -> anyhow::Result<ExitCode> {
    let cli = Cli::parse();
    let (suite, mode, out) = match cli.cmd {
        Cmd::ServeCoordinator {
            etcd_endpoints,
            listen,
            prefix,
            snapshot_readers,
            tls_cert,
            tls_key,
            auth_token_file,
        } => {
            rootrank_bench::procs::serve_coordinator(
                etcd_endpoints,
                listen,
                prefix,
                snapshot_readers,
                tls_cert.zip(tls_key),
                auth_token_file,
            )?;
            return Ok(ExitCode::SUCCESS);
        }
        Cmd::Rank {
            etcd_endpoints,
            group,
            rank,
            group_size,
            lease_ttl_ms,
        } => {
            rootrank_bench::procs::rank_main(etcd_endpoints, &group, rank, group_size, lease_ttl_ms)?;
            return Ok(ExitCode::SUCCESS);
        }
        Cmd::Report { out } => {
            let dir = out.out.unwrap_or_else(|| PathBuf::from("bench-results"));
            let path = dir.join("results.json");
            let results: serde_json::Value =
                serde_json::from_slice(&std::fs::read(&path).with_context(|| path.display().to_string())?)?;
            rootrank_bench::write_outputs(&dir, &results)?;
            return Ok(ExitCode::SUCCESS);
        }
        cmd => suite_of(cmd)?,
    };
    run_suite(&suite, mode, &out)
}

/// The suite a benchmark command asks for, its mode, and where its results go.
fn suite_of(cmd: Cmd) -> anyhow::Result<(Suite, &'static str, PathBuf)> {
    Ok(match cmd {
        Cmd::All { smoke, out } => (
            if smoke { Suite::smoke() } else { Suite::full() },
            if smoke { "smoke" } else { "full" },
            out.out.unwrap_or_else(|| PathBuf::from("bench-results")),
        ),
        Cmd::Verdicts {
            conns,
            duration,
            groups,
            ranks,
            rooms,
            records_per_room,
            out,
        } => (
            Suite {
                verdicts: Some(verdicts::VerdictsCfg {
                    groups,
                    ranks,
                    rooms,
                    records_per_room,
                    conns,
                    duration: parse_duration(&duration)?,
                }),
                ..Suite::default()
            },
            "verdicts",
            out.out.unwrap_or_else(|| PathBuf::from("bench-results/verdicts")),
        ),
        Cmd::Ingest {
            agents,
            rates,
            duration,
            probe_rate,
            max_batch,
            out,
        } => (
            Suite {
                ingest: Some(ingest::IngestCfg {
                    agents,
                    rates,
                    duration: parse_duration(&duration)?,
                    probe_rate,
                    max_batch,
                }),
                ..Suite::default()
            },
            "ingest",
            out.out.unwrap_or_else(|| PathBuf::from("bench-results/ingest")),
        ),
        Cmd::Detection {
            kills,
            ttls,
            batch,
            no_watchdog,
            out,
        } => (
            Suite {
                detection: Some(detection::DetectionCfg {
                    variants: ttls.iter().map(|t| (*t, kills)).collect(),
                    skipped: vec![],
                    batch,
                    watchdog: !no_watchdog,
                }),
                ..Suite::default()
            },
            "detection",
            out.out.unwrap_or_else(|| PathBuf::from("bench-results/detection")),
        ),
        Cmd::Scale {
            groups,
            ranks,
            records,
            ttl_s,
            keepalive_window,
            duration,
            out,
        } => (
            Suite {
                scale: Some(scale::ScaleCfg {
                    groups,
                    ranks,
                    records,
                    records_per_room: 8,
                    ttl_s,
                    keepalive_window: parse_duration(&keepalive_window)?,
                    verdict_duration: parse_duration(&duration)?,
                    conns: 16,
                }),
                ..Suite::default()
            },
            "scale",
            out.out.unwrap_or_else(|| PathBuf::from("bench-results/scale")),
        ),
        Cmd::Burst {
            rooms,
            bursts,
            rate,
            agents,
            duration,
            out,
        } => (
            Suite {
                burst: Some(burst::BurstCfg {
                    rooms,
                    bursts,
                    rate,
                    agents,
                    duration: parse_duration(&duration)?,
                    probe_rate: 50.0,
                }),
                ..Suite::default()
            },
            "burst",
            out.out.unwrap_or_else(|| PathBuf::from("bench-results/burst")),
        ),
        Cmd::Keepalive { variants, window, out } => (
            Suite {
                keepalive: Some(keepalive::KeepaliveCfg {
                    variants: variants
                        .iter()
                        .map(|v| {
                            let (t, n) = v
                                .split_once(':')
                                .with_context(|| format!("variant {v:?}: TTL_S:LEASES"))?;
                            Ok((t.parse()?, n.parse()?))
                        })
                        .collect::<anyhow::Result<_>>()?,
                    min_window: parse_duration(&window)?,
                }),
                ..Suite::default()
            },
            "keepalive",
            out.out.unwrap_or_else(|| PathBuf::from("bench-results/keepalive")),
        ),
        Cmd::NodeMemory { records, groups, out } => (
            Suite {
                node_memory: Some(node_memory::NodeMemoryCfg { records, groups }),
                ..Suite::default()
            },
            "node_memory",
            out.out.unwrap_or_else(|| PathBuf::from("bench-results/node_memory")),
        ),
        Cmd::Startup {
            records,
            groups,
            readers,
            per_room,
            out,
        } => (
            Suite {
                startup: Some(startup::StartupCfg {
                    records,
                    groups,
                    readers,
                    per_room,
                }),
                ..Suite::default()
            },
            "startup",
            out.out.unwrap_or_else(|| PathBuf::from("bench-results/startup")),
        ),
        Cmd::MassDeath { sizes, readers, out } => (
            Suite {
                mass_death: Some(rootrank_bench::mass_death::MassDeathCfg { sizes, readers }),
                ..Suite::default()
            },
            "mass-death",
            out.out.unwrap_or_else(|| PathBuf::from("bench-results/mass-death")),
        ),
        Cmd::Fleet {
            sizes,
            ttl_s,
            keepalive_budget,
            rack_hosts,
            window,
            host_lease,
            subscribers,
            rooms,
            out,
        } => (
            Suite {
                fleet: Some(rootrank_bench::fleet::FleetCfg {
                    sizes,
                    ttl_s,
                    keepalive_budget: (keepalive_budget > 0.0).then_some(keepalive_budget),
                    rack_hosts,
                    window: parse_duration(&window)?,
                    subscribers,
                    host_lease,
                    rooms,
                }),
                ..Suite::default()
            },
            "fleet",
            out.out.unwrap_or_else(|| PathBuf::from("bench-results/fleet")),
        ),
        Cmd::LongPolls {
            polls,
            rate,
            agents,
            duration,
            probe_rate,
            out,
        } => (
            Suite {
                long_polls: Some(long_polls::LongPollsCfg {
                    polls,
                    rate,
                    agents,
                    duration: parse_duration(&duration)?,
                    probe_rate,
                }),
                ..Suite::default()
            },
            "long-polls",
            out.out.unwrap_or_else(|| PathBuf::from("bench-results/long-polls")),
        ),
        Cmd::Events {
            readers,
            rate,
            agents,
            duration,
            probe_rate,
            out,
        } => (
            Suite {
                events: Some(events::EventsCfg {
                    readers,
                    rate,
                    agents,
                    duration: parse_duration(&duration)?,
                    probe_rate,
                }),
                ..Suite::default()
            },
            "events",
            out.out.unwrap_or_else(|| PathBuf::from("bench-results/events")),
        ),
        Cmd::Security {
            rooms,
            conns,
            duration,
            publishes,
            out,
        } => (
            Suite {
                security: Some(rootrank_bench::security::SecurityCfg {
                    rooms,
                    conns,
                    duration: parse_duration(&duration)?,
                    publishes,
                }),
                ..Suite::default()
            },
            "security",
            out.out.unwrap_or_else(|| PathBuf::from("bench-results/security")),
        ),
        Cmd::Agent {
            calls,
            no_nixl,
            nixl_scale,
            out,
        } => (
            Suite {
                agent: Some(agent_cost::AgentCfg {
                    calls,
                    nixl: !no_nixl,
                    nixl_scale,
                }),
                ..Suite::default()
            },
            "agent",
            out.out.unwrap_or_else(|| PathBuf::from("bench-results/agent")),
        ),
        Cmd::ServeCoordinator { .. } | Cmd::Rank { .. } | Cmd::Report { .. } => {
            anyhow::bail!("not a benchmark suite (a helper command)")
        }
    })
}

/// Runs a suite in a scratch directory and writes its results.
fn run_suite(suite: &Suite, mode: &'static str, out: &std::path::Path) -> anyhow::Result<ExitCode> {
    // The suite's scratch (etcd data: a few GB at full scale) lives in a temp dir removed at
    // the end; RRBENCH_KEEP=1 keeps it (logs) for a post-mortem.
    let work = tempfile::Builder::new().prefix("rootrank-bench.").tempdir()?;
    let env = Env {
        exe: std::env::current_exe()?,
        repo: std::env::var_os("ROOTRANK_REPO")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))),
        work: work.path().to_path_buf(),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let results = rt.block_on(rootrank_bench::run(&env, suite, mode));
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    rootrank_bench::write_outputs(out, &results)?;
    if std::env::var_os("RRBENCH_KEEP").is_some() {
        let kept = work.keep();
        eprintln!("rootrank-bench: scratch kept in {}", kept.display());
    }
    eprintln!(
        "rootrank-bench: wrote {}/results.json, results.md, latency.svg",
        out.display()
    );
    // The fleet part ends with its one-line summary (issue 29), after everything else.
    if let Some(line) = results["sections"]["fleet"]["summary"].as_str() {
        println!("{line}");
    }
    let failed = results["sections"]
        .as_object()
        .is_some_and(|s| s.values().any(|v| v.get("error").is_some()));
    Ok(if failed { ExitCode::from(1) } else { ExitCode::SUCCESS })
}
