//! The whole suite at tiny sizes (seconds): it must produce well-formed results. No timing is
//! asserted anywhere; this only proves every part runs end to end and reports its figures.
//!
//! The binary under test is `CARGO_BIN_EXE_rootrank-bench`, which cargo builds before this
//! test; coordinators and ranks are that same binary. The node-memory part runs `rootrank
//! node-watch` from the same target directory, which another package builds: `make test`
//! builds it first, and `cargo test -p rootrank-bench` alone needs `cargo build --bin rootrank`.

use std::process::Command;

use serde_json::Value;

fn num(v: &Value, path: &str) -> f64 {
    let mut cur = v;
    for p in path.split('.') {
        cur = match p.parse::<usize>() {
            Ok(i) => &cur[i],
            Err(_) => &cur[p],
        };
    }
    cur.as_f64().unwrap_or_else(|| panic!("{path} is not a number: {cur}"))
}

fn positive(v: &Value, path: &str) {
    let x = num(v, path);
    assert!(x.is_finite() && x > 0.0, "{path} = {x}, want finite and > 0");
}

#[test]
fn smoke_suite_produces_well_formed_results() {
    let out = tempfile::tempdir().expect("tempdir");
    let output = Command::new(env!("CARGO_BIN_EXE_rootrank-bench"))
        .args(["all", "--smoke", "--out"])
        .arg(out.path())
        .output()
        .expect("run rootrank-bench");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "rootrank-bench all --smoke failed: {stderr}");

    let r: Value = serde_json::from_slice(&std::fs::read(out.path().join("results.json")).expect("results.json"))
        .expect("results.json parses");
    positive(&r, "machine.nproc");
    positive(&r, "machine.mem_total_bytes");
    assert!(r["machine"]["kernel"].as_str().is_some_and(|k| !k.is_empty()));
    assert!(r["git"]["revision"].as_str().is_some());
    let s = &r["sections"];
    for part in ["verdicts", "ingest", "detection", "scale", "agent", "events"] {
        assert!(s[part].is_object(), "section {part} missing");
        assert!(
            s[part].get("error").is_none(),
            "section {part} failed: {}",
            s[part]["error"]
        );
    }

    let runs = s["verdicts"]["runs"].as_array().expect("verdict runs");
    for target in ["verdict", "healthz", "etcd_direct"] {
        assert!(runs.iter().any(|x| x["target"] == target), "no {target} run");
    }
    for run in runs {
        positive(run, "rps");
        positive(run, "latency.p50_us");
        positive(run, "latency.p99_us");
    }
    positive(&s["verdicts"], "ratios.0.verdict_over_healthz_rps");
    positive(&s["verdicts"], "ratios.0.verdict_over_etcd_direct_rps");

    let stage = &s["ingest"]["stages"][0];
    positive(stage, "written");
    positive(stage, "achieved_rate");
    positive(stage, "lag_commit_to_visible.count");
    positive(stage, "cpu.coordinator_us_per_record");
    positive(stage, "cpu.etcd_us_per_record");

    let det = &s["detection"]["variants"][0]["result"];
    positive(det, "resolved");
    positive(det, "kill_to_resolved_ms.p50");
    assert!(s["detection"]["watchdog"]["available"].is_boolean());

    let sc = &s["scale"];
    positive(sc, "coordinator.start_to_ready_s");
    positive(sc, "coordinator.loaded_rss_bytes");
    positive(sc, "core_index.bytes_per_record");
    positive(sc, "verdict.run.rps");
    positive(sc, "keepalive_only.keepalives_per_s");

    positive(&s["agent"], "queue_with_room.mean_ns");
    positive(&s["agent"], "queue_full_dropping.mean_ns");
    assert!(s["agent"]["nixl_write_64k"]["available"].is_boolean());

    let ev = &s["events"]["with_readers"];
    positive(ev, "probes");
    positive(ev, "delivery_lag.count");
    positive(ev, "cpu.coordinator_s");
    assert_eq!(ev["readers_cut_off"], 0, "{ev}");
    assert_eq!(ev["probe_deliveries_missing"], 0, "{ev}");

    // The fleet part: a 3-member cluster, every failure seen, every room resolved, and the
    // one-line summary last on stdout.
    let fl = &s["fleet"]["sizes"][0];
    assert!(fl.get("error").is_none(), "fleet failed: {}", fl["error"]);
    assert_eq!(fl["steady"]["live_at_end"], fl["ranks"], "{fl}");
    positive(fl, "steady.etcd_cpu_ms_per_s");
    positive(fl, "steady.keepalives_per_s");
    positive(fl, "steady.verdict.p50_us");
    positive(fl, "coordinator.rss_steady_bytes");
    assert_eq!(fl["steady"]["metrics_scrape"]["rank_up_series"], 320, "{fl}");
    // Every event subscriber received every certified death.
    assert_eq!(fl["events"]["subscribers"], 20, "{fl}");
    assert_eq!(
        fl["events"]["certified_downs_per_subscriber"]["min"], fl["events"]["deaths"],
        "{fl}"
    );
    for failure in ["host", "rack", "tenth"] {
        positive(fl, &format!("failures.{failure}.all_subscribers_have_every_death_s"));
        positive(fl, &format!("failures.{failure}.all_down_s"));
        positive(fl, &format!("failures.{failure}.all_certified_s"));
        positive(fl, &format!("failures.{failure}.rooms_resolved_s"));
    }
    // One host of the rack: its 8 copies written, then deleted with their leases; the
    // fleet's `groups/` carries every rank's keys.
    assert_eq!(fl["node_watch_events"]["host_scope"], 16, "{fl}");
    assert!(
        fl["node_watch_events"]["fleet_scope"].as_u64().unwrap_or(0) > 2 * 320,
        "{fl}"
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("fleet: 320 ranks, rack of 32 down in ") && last.ends_with(" MiB"),
        "last line: {last}"
    );

    let goals = r["goals"].as_array().expect("goals");
    assert!(goals.len() >= 7);

    let md = std::fs::read_to_string(out.path().join("results.md")).expect("results.md");
    assert!(md.contains("## Performance"));
    let svg = std::fs::read_to_string(out.path().join("latency.svg")).expect("latency.svg");
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("<polyline"));
}
