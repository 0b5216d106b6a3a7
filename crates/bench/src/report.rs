//! The readable outputs: goals, the Markdown table and the SVG of latency distributions, all
//! made from the results JSON alone (so `rootrank-bench report` can redo them).

use std::fmt::Write as _;

use serde_json::{json, Value};

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

fn find_run<'a>(verdicts: &'a Value, target: &str, conns: u64) -> Option<&'a Value> {
    verdicts["runs"]
        .as_array()?
        .iter()
        .find(|r| r["target"] == target && r["conns"].as_u64() == Some(conns))
}

/// One goal: what was asked, what was measured, met or not and by how much.
fn goal(name: &str, target: &str, measured: f64, unit: &str, met: Option<bool>, by: String) -> Value {
    json!({"goal": name, "target": target, "measured": if measured.is_finite() { json!(measured) } else { Value::Null },
           "unit": unit, "met": met, "by": by})
}

fn at_least(name: &str, target: f64, measured: f64, unit: &str) -> Value {
    let met = measured.is_finite().then_some(measured >= target);
    let by = if !measured.is_finite() {
        "not measured".into()
    } else if measured >= target {
        format!("met, {:.2}x the target", measured / target)
    } else {
        format!(
            "missed: {:.2}x of the target ({:.1}% short)",
            measured / target,
            (1.0 - measured / target) * 100.0
        )
    };
    goal(name, &format!(">= {target} {unit}"), measured, unit, met, by)
}

fn at_most(name: &str, target: f64, measured: f64, unit: &str) -> Value {
    let met = measured.is_finite().then_some(measured <= target);
    let by = if !measured.is_finite() {
        "not measured".into()
    } else if measured <= target {
        format!("met, {:.2}x of the limit", measured / target)
    } else {
        format!("missed: {:.2}x over the limit", measured / target)
    };
    goal(name, &format!("<= {target} {unit}"), measured, unit, met, by)
}

/// The issue's goals, judged from the results.
pub fn goals(results: &Value) -> Vec<Value> {
    let s = &results["sections"];
    let v = &s["verdicts"];
    let mut out = Vec::new();
    let (verdict, compact, healthz, etcd) = (
        find_run(v, "verdict", 16),
        find_run(v, "verdict_compact", 16),
        find_run(v, "healthz", 16),
        find_run(v, "etcd_direct", 16),
    );
    let ratio = |a: Option<&Value>, b: Option<&Value>| match (a, b) {
        (Some(a), Some(b)) if f(&b["rps"]) > 0.0 => f(&a["rps"]) / f(&b["rps"]),
        _ => f64::NAN,
    };
    let p99_ratio = |a: Option<&Value>, b: Option<&Value>| match (a, b) {
        (Some(a), Some(b)) if f(&b["latency"]["p99_us"]) > 0.0 => {
            f(&a["latency"]["p99_us"]) / f(&b["latency"]["p99_us"])
        }
        _ => f64::NAN,
    };
    out.push(at_least(
        "compact verdict rps at 16 conns / /healthz rps",
        0.8,
        ratio(compact, healthz),
        "x",
    ));
    out.push(at_least(
        "full verdict rps at 16 conns / /healthz rps",
        0.7,
        ratio(verdict, healthz),
        "x",
    ));
    out.push(at_most(
        "compact verdict p99 / /healthz p99 at 16 conns",
        1.5,
        p99_ratio(compact, healthz),
        "x",
    ));
    out.push(at_most(
        "full verdict p99 / /healthz p99 at 16 conns",
        1.5,
        p99_ratio(verdict, healthz),
        "x",
    ));
    out.push(at_least(
        "verdict rps at 16 conns / etcd-direct rps",
        10.0,
        ratio(verdict, etcd),
        "x",
    ));
    out.push(at_most(
        "verdict p99 at 16 conns",
        1000.0,
        verdict.map_or(f64::NAN, |r| f(&r["latency"]["p99_us"])),
        "us",
    ));
    let lag = s["ingest"]["stages"]
        .as_array()
        .and_then(|st| st.iter().find(|x| x["offered_rate"].as_u64() == Some(5_000)))
        .map_or(f64::NAN, |x| f(&x["lag_commit_to_visible"]["p99_us"]) / 1e3);
    out.push(at_most("commit-to-visible lag p99 at 5,000 records/s", 10.0, lag, "ms"));
    let c = &s["scale"]["coordinator"];
    let records = s["scale"]["setup"]["records"].as_u64().unwrap_or(0);
    out.push(at_most(
        &format!("coordinator RSS per retained record ({records} records)"),
        200.0,
        f(&c["rss_bytes_per_record"]),
        "bytes",
    ));
    out.push(at_most(
        &format!("coordinator start to /readyz with {records} records"),
        5.0,
        f(&c["start_to_ready_s"]),
        "s",
    ));
    let batched = &s["burst"]["modes"]["batched"];
    out.push(at_most(
        "burst: commit-to-visible lag p99 at 5,000 records/s offered, batched",
        10.0,
        f(&batched["sustained"]["lag_commit_to_visible"]["p99_us"]) / 1e3,
        "ms",
    ));
    out.push(at_most(
        "burst: last enqueue to the last of 500 rooms resolved, batched",
        100.0,
        f(&batched["median"]["last_enqueue_to_last_resolved_ms"]),
        "ms",
    ));
    out.push(at_most(
        "record_failure on the caller's thread (mean, queue with room)",
        1000.0,
        f(&s["agent"]["queue_with_room"]["mean_ns"]),
        "ns",
    ));
    out
}

fn us(v: &Value) -> String {
    let x = f(v);
    if !x.is_finite() {
        "-".into()
    } else if x >= 10_000.0 {
        format!("{:.1} ms", x / 1e3)
    } else {
        format!("{x:.0} us")
    }
}

fn num(v: &Value, digits: usize) -> String {
    let x = f(v);
    if x.is_finite() {
        format!("{x:.digits$}")
    } else {
        "-".into()
    }
}

pub fn markdown(results: &Value) -> String {
    let mut m = String::new();
    let s = &results["sections"];
    let mach = &results["machine"];
    let _ = writeln!(m, "# rootrank benchmark results\n");
    let _ = writeln!(
        m,
        "- revision `{}`{} | mode `{}` | started {}\n- machine: {} CPUs ({}), {:.1} GiB RAM, kernel {}\n- every figure is taken side by side with its reference in the same run; the machine is shared, so absolute figures are noisy and the ratios are the comparison\n",
        results["git"]["revision"].as_str().unwrap_or("?"),
        if results["git"]["dirty"] == true { " (dirty)" } else { "" },
        results["mode"].as_str().unwrap_or("?"),
        results["started_at"].as_str().unwrap_or("?"),
        mach["nproc"],
        mach["cpu_model"].as_str().unwrap_or("?"),
        f(&mach["mem_total_bytes"]) / (1u64 << 30) as f64,
        mach["kernel"].as_str().unwrap_or("?"),
    );
    let _ = writeln!(
        m,
        "## Performance (goals)\n\n| goal | target | measured | verdict |\n|---|---|---|---|"
    );
    for g in results["goals"].as_array().into_iter().flatten() {
        let met = match g["met"].as_bool() {
            Some(true) => "MET",
            Some(false) => "MISSED",
            None => "n/a",
        };
        let _ = writeln!(
            m,
            "| {} | {} | {} {} | {met}: {} |",
            g["goal"].as_str().unwrap_or(""),
            g["target"].as_str().unwrap_or(""),
            num(&g["measured"], 2),
            g["unit"].as_str().unwrap_or(""),
            g["by"].as_str().unwrap_or("")
        );
    }
    verdicts_section(&mut m, &s["verdicts"]);
    ingest_section(&mut m, &s["ingest"]);
    detection_section(&mut m, &s["detection"]);
    scale_section(&mut m, &s["scale"]);
    agent_section(&mut m, &s["agent"]);
    burst_section(&mut m, &s["burst"]);
    keepalive_section(&mut m, &s["keepalive"]);
    startup_section(&mut m, &s["startup"]);
    node_memory_section(&mut m, &s["node_memory"]);
    events_section(&mut m, &s["events"]);
    security_section(&mut m, &s["security"]);
    long_polls_section(&mut m, &s["long_polls"]);
    mass_death_section(&mut m, &s["mass_death"]);
    fleet_section(&mut m, &s["fleet"]);
    let _ = writeln!(
        m,
        "\nLatency distributions: `latency.svg`. All figures: `results.json`."
    );
    m
}

fn verdicts_section(m: &mut String, v: &Value) {
    if !v.is_object() {
        return;
    }
    let st = &v["setup"];
    let _ = writeln!(
        m,
        "\n## 1. Verdict lookups\n\n{} groups x {} ranks, {} rooms x {} records ({} records), {} s per run.\n\n| conns | target | tool | rps | p50 | p99 | p99.9 | max | errors | server CPU/req |\n|---|---|---|---|---|---|---|---|---|---|",
        st["groups"], st["ranks_per_group"], st["rooms"], st["records_per_room"], st["records"], num(&st["duration_s"], 0)
    );
    for r in v["runs"].as_array().into_iter().flatten() {
        let l = &r["latency"];
        let _ = writeln!(
            m,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} us ({}) |",
            r["conns"],
            r["target"].as_str().unwrap_or(""),
            if r["tool"].as_str().unwrap_or("").starts_with("wrk") {
                "wrk"
            } else {
                "rust loop"
            },
            num(&r["rps"], 0),
            us(&l["p50_us"]),
            us(&l["p99_us"]),
            us(&l["p999_us"]),
            us(&l["max_us"]),
            r["errors"],
            num(&r["server_cpu_us_per_request"], 1),
            r["server"].as_str().unwrap_or("")
        );
    }
    let _ = writeln!(m, "\n| conns | verdict / healthz rps | verdict / etcd-direct rps | etcd-direct p99 / verdict p99 |\n|---|---|---|---|");
    for r in v["ratios"].as_array().into_iter().flatten() {
        let _ = writeln!(
            m,
            "| {} | {}x | {}x | {}x |",
            r["conns"],
            num(&r["verdict_over_healthz_rps"], 2),
            num(&r["verdict_over_etcd_direct_rps"], 1),
            num(&r["etcd_direct_p99_over_verdict_p99"], 1)
        );
    }
}

fn ingest_section(m: &mut String, i: &Value) {
    if !i.is_object() {
        return;
    }
    let _ = writeln!(
        m,
        "\n## 2. Ingest\n\n{} agents ({} groups x {} ranks), {} s per stage. CPU is per record written; cores = CPU s / wall s.\n\n| offered/s | achieved/s | dropped | drain s | lag p50 | lag p99 | lag max | probes | coordinator us/rec | etcd us/rec | bench+agents us/rec | coord cores | etcd cores | saturated |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        i["setup"]["agents"], i["setup"]["groups"], i["setup"]["ranks_per_group"], num(&i["setup"]["stage_s"], 0)
    );
    for st in i["stages"].as_array().into_iter().flatten() {
        let l = &st["lag_commit_to_visible"];
        let c = &st["cpu"];
        let _ = writeln!(
            m,
            "| {} | {} | {} | {} | {} | {} | {} | {} ({} failed) | {} | {} | {} | {} | {} | {} |",
            st["offered_rate"],
            num(&st["achieved_rate"], 0),
            st["dropped_queue_full"],
            num(&st["drain_s"], 2),
            us(&l["p50_us"]),
            us(&l["p99_us"]),
            us(&l["max_us"]),
            l["count"],
            st["probe_failures"],
            num(&c["coordinator_us_per_record"], 1),
            num(&c["etcd_us_per_record"], 1),
            num(&c["bench_and_agents_us_per_record"], 1),
            num(&c["coordinator_cores"], 2),
            num(&c["etcd_cores"], 2),
            st["saturated"]
        );
    }
}

fn detection_section(m: &mut String, d: &Value) {
    if !d.is_object() {
        return;
    }
    let _ = writeln!(m, "\n## 3. Detection (SIGKILL to resolved verdict)\n\n| variant | kills | resolved | p50 ms | p90 ms | p99 ms | max ms | culprit sources | wall s |\n|---|---|---|---|---|---|---|---|---|");
    for x in d["variants"].as_array().into_iter().flatten() {
        if let Some(sk) = x["skipped"].as_str() {
            let _ = writeln!(
                m,
                "| {} | skipped: {sk} | | | | | | | |",
                x["name"].as_str().unwrap_or("")
            );
            continue;
        }
        let r = &x["result"];
        let k = &r["kill_to_resolved_ms"];
        let _ = writeln!(
            m,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            x["name"].as_str().unwrap_or(""),
            r["kills"],
            r["resolved"],
            num(&k["p50"], 0),
            num(&k["p90"], 0),
            num(&k["p99"], 0),
            num(&k["max"], 0),
            r["culprit_sources"],
            num(&r["wall_s"], 1)
        );
    }
    let w = &d["watchdog"];
    if w["available"] == true {
        let k = &w["result"]["kill_to_resolved_ms"];
        let _ = writeln!(
            m,
            "| with_watchdog_ttl_5s | {} | {} | {} | {} | {} | {} | {} | {} |",
            w["result"]["kills"],
            w["result"]["resolved"],
            num(&k["p50"], 0),
            num(&k["p90"], 0),
            num(&k["p99"], 0),
            num(&k["max"], 0),
            w["result"]["culprit_sources"],
            num(&w["result"]["wall_s"], 1)
        );
        if let Some(e) = w["error"].as_str() {
            let _ = writeln!(m, "\nwith_watchdog: error: {e}");
        }
    } else {
        let _ = writeln!(
            m,
            "| with_watchdog | not available: {} | | | | | | | |",
            w["reason"].as_str().unwrap_or("")
        );
    }
}

fn scale_section(m: &mut String, sc: &Value) {
    if !sc.is_object() {
        return;
    }
    let (st, p, k, c, ci) = (
        &sc["setup"],
        &sc["populate"],
        &sc["keepalive_only"],
        &sc["coordinator"],
        &sc["core_index"],
    );
    let vr = &sc["verdict"]["run"];
    let _ = writeln!(m, "\n## 4. Scale\n\n{} groups x {} ranks = {} live leases (TTL {} s, renewed every {} ms over {} connections), {} retained records in {} rooms.\n",
        st["groups"], st["ranks_per_group"], st["live_leases"], st["lease_ttl_s"], st["keepalive_interval_ms"], st["keepalive_connections"], st["records"], st["rooms"]);
    let _ = writeln!(m, "| figure | value |\n|---|---|");
    let rows: Vec<(&str, String)> = vec![
        (
            "records written to etcd",
            format!(
                "{} in {} s ({} /s)",
                st["records"],
                num(&p["records_s"], 1),
                num(&p["records_per_s"], 0)
            ),
        ),
        (
            "coordinator start to /readyz",
            format!(
                "{} s (coordinator CPU in that time: {} s, the rest is waiting on etcd; live ranks seen at ready: {})",
                num(&c["start_to_ready_s"], 2),
                num(&c["cpu_s_at_ready"], 2),
                c["live_ranks_seen_at_ready"]
            ),
        ),
        (
            "start to /readyz: serial load before / 1 reader / default readers",
            format!(
                "{} s / {} s / {} s (etcd CPU {} / {} / {} s)",
                num(&sc["startup"]["before"]["load_s"], 2),
                num(&sc["startup"]["runs"][0]["start_to_ready_s"], 2),
                num(&sc["startup"]["runs"][1]["start_to_ready_s"], 2),
                num(&sc["startup"]["before"]["etcd_cpu_s"], 2),
                num(&sc["startup"]["runs"][0]["etcd_cpu_s"][0], 2),
                num(&sc["startup"]["runs"][1]["etcd_cpu_s"][0], 2),
            ),
        ),
        (
            "coordinator RSS empty / loaded / peak (HWM)",
            format!(
                "{:.1} / {:.1} / {:.1} MiB",
                f(&c["empty_rss_bytes"]) / 1048576.0,
                f(&c["loaded_rss_bytes"]) / 1048576.0,
                f(&c["loaded_hwm_bytes"]) / 1048576.0
            ),
        ),
        (
            "coordinator RSS per record (loaded - empty) / records",
            format!(
                "{} bytes (peak: {} bytes)",
                num(&c["rss_bytes_per_record"], 1),
                num(&c["hwm_bytes_per_record"], 1)
            ),
        ),
        (
            "core index alone, bytes per record (counting allocator)",
            format!(
                "{} bytes ({} live keys: {} bytes each)",
                num(&ci["bytes_per_record"], 1),
                ci["live_keys"],
                num(&ci["live_key_bytes_each"], 0)
            ),
        ),
        (
            "core index alone, apply rate",
            format!("{} records/s in-process", num(&ci["records_applied_per_s"], 0)),
        ),
        (
            "coordinator RSS / core index bytes per record",
            format!(
                "{}x",
                num(&json!(f(&c["rss_bytes_per_record"]) / f(&ci["bytes_per_record"])), 2)
            ),
        ),
        (
            "verdicts at this size (wrk, 16 conns)",
            format!(
                "{} rps, p50 {}, p99 {}, p99.9 {}",
                num(&vr["rps"], 0),
                us(&vr["latency"]["p50_us"]),
                us(&vr["latency"]["p99_us"]),
                us(&vr["latency"]["p999_us"])
            ),
        ),
        (
            "keepalives only: rate",
            format!("{} /s", num(&k["keepalives_per_s"], 0)),
        ),
        (
            "keepalives only: etcd CPU",
            format!(
                "{} cores ({} us per keepalive); bench client {} cores",
                num(&k["etcd_cpu_cores"], 2),
                num(&k["etcd_cpu_us_per_keepalive"], 1),
                num(&k["bench_client_cpu_cores"], 2)
            ),
        ),
        (
            "keepalives needed / achieved",
            format!(
                "{} /s needed (leases / interval), {} /s achieved; live keys written {}, lost {}",
                num(&p["keepalives_needed_per_s"], 0),
                num(&k["keepalives_per_s"], 0),
                p["live_keys_written"],
                p["live_keys_lost"]
            ),
        ),
        (
            "keepalive failures / expired leases",
            format!(
                "{} / {} (first error: {})",
                k["failed"],
                k["expired_leases"],
                k["first_error"].as_str().unwrap_or("none")
            ),
        ),
        ("etcd RSS", format!("{:.0} MiB", f(&k["etcd_rss_bytes"]) / 1048576.0)),
    ];
    for (a, b) in rows {
        let _ = writeln!(m, "| {a} | {b} |");
    }
}

fn agent_section(m: &mut String, a: &Value) {
    if !a.is_object() {
        return;
    }
    let (w, fl, n) = (&a["queue_with_room"], &a["queue_full_dropping"], &a["nixl_write_64k"]);
    let _ = writeln!(
        m,
        "\n## 5. Agent overhead\n\n| case | calls | mean ns | p50 ns | p99 ns | p99.9 ns |\n|---|---|---|---|---|---|"
    );
    for (name, x) in [
        ("record_failure, queue with room", w),
        ("record_failure, queue full (drop)", fl),
    ] {
        let _ = writeln!(
            m,
            "| {name} | {} | {} | {} | {} | {} |",
            x["calls"],
            num(&x["mean_ns"], 0),
            num(&x["p50_ns"], 0),
            num(&x["p99_ns"], 0),
            num(&x["p999_ns"], 0)
        );
    }
    if n["available"] == true {
        let _ = writeln!(
            m,
            "| one NIXL WRITE of 64 KiB (UCX, DRAM) | {} | {} | {} | {} | |",
            n["iters"],
            num(&json!(f(&n["mean_us"]) * 1e3), 0),
            num(&json!(f(&n["p50_us"]) * 1e3), 0),
            num(&json!(f(&n["p99_us"]) * 1e3), 0)
        );
        let _ = writeln!(
            m,
            "\nrecord_failure (mean) / NIXL 64 KiB WRITE (p50): {}",
            num(&a["record_failure_over_nixl_64k_p50"], 4)
        );
    } else {
        let _ = writeln!(
            m,
            "| NIXL 64 KiB WRITE | not available: {} | | | | |",
            n["reason"].as_str().unwrap_or("")
        );
    }
}

fn burst_section(m: &mut String, b: &Value) {
    if !b.is_object() {
        return;
    }
    let _ = writeln!(
        m,
        "\n## 6. Burst (one rank fails {} rooms at once; {} records per burst)\n\nMedians over {} bursts per mode; the sustained stage offers {} records/s from {} agents.\n\n| mode | first record to last room resolved ms | last enqueue to last resolved ms | all written ms | etcd us/record | coordinator us/record | sustained achieved/s | lag p50 | lag p99 | etcd us/record (sustained) |\n|---|---|---|---|---|---|---|---|---|---|",
        b["setup"]["rooms"], b["setup"]["records_per_burst"], b["setup"]["bursts_per_mode"],
        b["setup"]["sustained_rate"], b["setup"]["sustained_agents"]
    );
    for mode in ["single", "batched"] {
        let x = &b["modes"][mode];
        let (md, st) = (&x["median"], &x["sustained"]);
        let _ = writeln!(
            m,
            "| {mode} (max_batch {}) | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            x["max_batch"],
            num(&md["first_record_to_last_resolved_ms"], 1),
            num(&md["last_enqueue_to_last_resolved_ms"], 1),
            num(&md["first_record_to_all_written_ms"], 1),
            num(&md["etcd_us_per_record"], 1),
            num(&md["coordinator_us_per_record"], 1),
            num(&st["achieved_rate"], 0),
            us(&st["lag_commit_to_visible"]["p50_us"]),
            us(&st["lag_commit_to_visible"]["p99_us"]),
            num(&st["cpu"]["etcd_us_per_record"], 1)
        );
    }
}

fn keepalive_section(m: &mut String, k: &Value) {
    if !k.is_object() {
        return;
    }
    let _ = writeln!(
        m,
        "\n## 7. Keepalives ({})\n\n| lease TTL | keepalive every | leases | keepalives/s | etcd cores | etcd us/keepalive | ranks per etcd core | failed | expired |\n|---|---|---|---|---|---|---|---|---|",
        k["setup"]["etcd"].as_str().unwrap_or("")
    );
    for v in k["variants"].as_array().into_iter().flatten() {
        let _ = writeln!(
            m,
            "| {} s | {} ms | {} | {} | {} | {} | {} | {} | {} |",
            v["lease_ttl_s"],
            v["keepalive_interval_ms"],
            v["leases"],
            num(&v["keepalives_per_s"], 0),
            num(&v["etcd_cores"], 3),
            num(&v["etcd_us_per_keepalive"], 1),
            num(&v["ranks_per_etcd_core"], 0),
            v["failed"],
            v["expired"]
        );
    }
}

fn startup_section(m: &mut String, su: &Value) {
    if !su.is_object() {
        return;
    }
    let _ = writeln!(
        m,
        "\n## 9. Start-up ({} records, no leases)\n\n| load | spawn to /readyz s | coordinator CPU s | etcd CPU s |\n|---|---|---|---|\n| serial, before (in-process) | {} | {} | {} |",
        su["setup"]["records"],
        num(&su["before"]["load_s"], 2),
        num(&su["before"]["loader_cpu_s"], 2),
        num(&su["before"]["etcd_cpu_s"], 2)
    );
    for r in su["runs"].as_array().into_iter().flatten() {
        let _ = writeln!(
            m,
            "| {} reader(s) | {} | {} | {} |",
            r["readers"],
            num(&r["start_to_ready_s"], 2),
            num(&r["coordinator_cpu_s"], 2),
            num(&r["etcd_cpu_s"][0], 2)
        );
    }
}

fn node_memory_section(m: &mut String, n: &Value) {
    if !n.is_object() {
        return;
    }
    let mib = |v: &Value| num(&json!(f(v) / 1048576.0), 1);
    let _ = writeln!(
        m,
        "\n## 8. node-watch memory\n\n| etcd holds | RSS MiB | peak RSS MiB | start to loaded s |\n|---|---|---|---|\n| nothing | {} | {} | {} |\n| {} room records, `--watch-scope fleet` | {} | {} | {} |\n| the same, `--watch-scope host` (default) | {} | {} | {} |\n\nRSS ratio (fleet scope): {}",
        mib(&n["empty"]["rss_bytes"]), mib(&n["empty"]["hwm_bytes"]), num(&n["empty"]["start_to_loaded_s"], 2),
        n["setup"]["records"], mib(&n["populated"]["rss_bytes"]), mib(&n["populated"]["hwm_bytes"]),
        num(&n["populated"]["start_to_loaded_s"], 2),
        mib(&n["populated_host_scope"]["rss_bytes"]), mib(&n["populated_host_scope"]["hwm_bytes"]),
        num(&n["populated_host_scope"]["start_to_loaded_s"], 2), num(&n["rss_ratio"], 2)
    );
}

fn events_section(m: &mut String, e: &Value) {
    if !e.is_object() {
        return;
    }
    let w = &e["with_readers"];
    let q = &e["quiet"];
    let _ = writeln!(
        m,
        "\n## 10. Events (`GET /v1/events`: {} readers, {} records/s offered)\n\n| | achieved records/s | delivery lag p50 ms | p99 ms | max ms | coordinator cores | etcd cores | bench + readers cores | readers cut off | probe deliveries missing |\n|---|---|---|---|---|---|---|---|---|---|\n| no reader | {} | | | | {} | {} | {} | | |\n| {} readers | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n\nCoordinator RSS: {} MiB before the readers, {} MiB with them connected, {} MiB after the stage.",
        e["setup"]["readers"], e["setup"]["offered_records_per_s"],
        num(&q["achieved_records_per_s"], 0), num(&q["cpu"]["coordinator_cores"], 2), num(&q["cpu"]["etcd_cores"], 2),
        num(&q["cpu"]["bench_and_readers_cores"], 2),
        e["setup"]["readers"], num(&w["achieved_records_per_s"], 0),
        num(&json!(f(&w["delivery_lag"]["p50_us"]) / 1e3), 2), num(&json!(f(&w["delivery_lag"]["p99_us"]) / 1e3), 2),
        num(&json!(f(&w["delivery_lag"]["max_us"]) / 1e3), 2),
        num(&w["cpu"]["coordinator_cores"], 2), num(&w["cpu"]["etcd_cores"], 2), num(&w["cpu"]["bench_and_readers_cores"], 2),
        w["readers_cut_off"], w["probe_deliveries_missing"],
        num(&json!(f(&e["coordinator_rss_bytes"]["before_readers"]) / 1048576.0), 1),
        num(&json!(f(&e["coordinator_rss_bytes"]["readers_connected"]) / 1048576.0), 1),
        num(&json!(f(&e["coordinator_rss_bytes"]["after_stage"]) / 1048576.0), 1),
    );
}

/// Part 12: what parked long polls cost the coordinator per record, and how soon a probe's
/// poll answers after its record's commit.
fn long_polls_section(m: &mut String, x: &Value) {
    if !x.is_object() {
        return;
    }
    let (q, p) = (&x["quiet"], &x["parked"]);
    let ms = |v: &Value| num(&json!(f(v) / 1e3), 2);
    let _ = writeln!(
        m,
        "\n## 12. Long polls ({} parked on rooms nobody writes, {} records/s offered to other rooms)\n\n| | achieved records/s | coordinator us/record | coordinator cores | probe wake p50 ms | p99 ms | max ms | probes not resolved |\n|---|---|---|---|---|---|---|---|\n| no parked poll | {} | {} | {} | {} | {} | {} | {} |\n| {} parked | {} | {} | {} | {} | {} | {} | {} |\n\nParked polls answered during the stage (each only at its own 30 s wait's end): {}.",
        x["setup"]["polls"], x["setup"]["offered_records_per_s"],
        num(&q["achieved_records_per_s"], 0), num(&q["coordinator_us_per_record"], 1), num(&q["cpu"]["coordinator_cores"], 2),
        ms(&q["probe_wake"]["p50_us"]), ms(&q["probe_wake"]["p99_us"]), ms(&q["probe_wake"]["max_us"]), q["probes_not_resolved"],
        x["setup"]["polls"],
        num(&p["achieved_records_per_s"], 0), num(&p["coordinator_us_per_record"], 1), num(&p["cpu"]["coordinator_cores"], 2),
        ms(&p["probe_wake"]["p50_us"]), ms(&p["probe_wake"]["p99_us"]), ms(&p["probe_wake"]["max_us"]), p["probes_not_resolved"],
        x["parked_polls_answered_during_stage"],
    );
}

/// Part 11: what TLS and the token cost, plain and secure side by side.
fn security_section(m: &mut String, x: &Value) {
    if !x.is_object() {
        return;
    }
    let _ = writeln!(
        m,
        "\n## 11. Security (same run, same etcd state)\n\n| verdict lookups, {} connections | requests/s | p50 | p99 |\n|---|---|---|---|",
        x["setup"]["conns"]
    );
    for run in x["verdicts"].as_array().into_iter().flatten() {
        let _ = writeln!(
            m,
            "| {} | {} | {} | {} |",
            run["target"].as_str().unwrap_or("").trim_start_matches("verdict_"),
            num(&run["rps"], 0),
            us(&run["latency"]["p50_us"]),
            us(&run["latency"]["p99_us"])
        );
    }
    let _ = writeln!(
        m,
        "\n| agent publish (record_failure to the record on a watch, one at a time) | p50 | p99 | max |\n|---|---|---|---|"
    );
    for name in ["plain", "tls_client_cert"] {
        let d = &x["publish"][name];
        let _ = writeln!(
            m,
            "| {name} | {} | {} | {} |",
            us(&d["p50_us"]),
            us(&d["p99_us"]),
            us(&d["max_us"])
        );
    }
    let r = &x["ratios"];
    let _ = writeln!(
        m,
        "\nHTTPS + token over HTTP: {}x the requests/s, {}x the p99. etcd TLS over plain: {}x the publish p50, {}x the p99.",
        num(&r["https_token_over_http_rps"], 2),
        num(&r["https_token_p99_over_http_p99"], 2),
        num(&r["tls_over_plain_publish_p50"], 2),
        num(&r["tls_over_plain_publish_p99"], 2)
    );
}

/// A series for the plot: a name and (percent, microseconds) points.
struct Series {
    name: String,
    points: Vec<(f64, f64)>,
}

fn cdf_of(name: String, dist: &Value) -> Option<Series> {
    let points: Vec<(f64, f64)> = dist["cdf"]
        .as_array()?
        .iter()
        .filter_map(|p| Some((p.get(0)?.as_f64()?, p.get(1)?.as_f64()?)))
        .filter(|(_, v)| *v > 0.0 && v.is_finite())
        .collect();
    (!points.is_empty()).then_some(Series { name, points })
}

fn panels(results: &Value) -> Vec<(String, Vec<Series>)> {
    let s = &results["sections"];
    let mut out = Vec::new();
    let mut conns: Vec<u64> = s["verdicts"]["runs"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["conns"].as_u64())
        .collect();
    conns.dedup();
    for c in conns {
        let series = ["verdict", "verdict_compact", "healthz", "etcd_direct"]
            .iter()
            .filter_map(|t| {
                find_run(&s["verdicts"], t, c)
                    .and_then(|r| cdf_of(format!("{t} ({} rps)", num(&r["rps"], 0)), &r["latency"]))
            })
            .collect();
        out.push((format!("1. Lookups at {c} connection(s)"), series));
    }
    let ingest: Vec<Series> = s["ingest"]["stages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|st| {
            cdf_of(
                format!("{}/s offered", st["offered_rate"]),
                &st["lag_commit_to_visible"],
            )
        })
        .collect();
    out.push(("2. Ingest: etcd commit to verdict visible".into(), ingest));
    let mut det: Vec<Series> = s["detection"]["variants"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|x| cdf_of(x["name"].as_str().unwrap_or("").to_string(), &x["result"]["latency"]))
        .collect();
    if let Some(w) = cdf_of("with_watchdog".into(), &s["detection"]["watchdog"]["result"]["latency"]) {
        det.push(w);
    }
    out.push(("3. Detection: SIGKILL to resolved verdict".into(), det));
    let mut sc = Vec::new();
    if let Some(x) = cdf_of(
        "verdict at scale, 16 conns".into(),
        &s["scale"]["verdict"]["run"]["latency"],
    ) {
        sc.push(x);
    }
    out.push(("4. Lookups at scale".into(), sc));
    let ag = [
        ("queue with room", "queue_with_room"),
        ("queue full", "queue_full_dropping"),
    ]
    .iter()
    .filter_map(|(n, k)| cdf_of(format!("record_failure, {n}"), &s["agent"][*k]["per_call"]))
    .collect();
    out.push(("5. record_failure on the caller's thread".into(), ag));
    out
}

const COLORS: &[&str] = &[
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

fn fmt_us(v: f64) -> String {
    if v >= 1e6 {
        format!("{}s", v / 1e6)
    } else if v >= 1e3 {
        format!("{}ms", v / 1e3)
    } else if v >= 1.0 {
        format!("{v}us")
    } else {
        format!("{}ns", v * 1e3)
    }
}

/// Latency CDFs, one panel per figure: x = latency (log scale), y = percent of requests at or
/// below it. Hand-written SVG, no plotting dependency.
pub fn svg(results: &Value) -> String {
    let panels = panels(results);
    let (w, h, ml, mr, mt, mb) = (760.0, 300.0, 70.0, 250.0, 36.0, 44.0);
    let total_h = h * panels.len() as f64 + 40.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{total_h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="10" y="22" font-size="16">rootrank-bench latency distributions (CDF; x log scale) — rev {}</text>"#,
        esc(results["git"]["revision"]
            .as_str()
            .unwrap_or("?")
            .get(..12)
            .unwrap_or("?"))
    );
    for (pi, (title, series)) in panels.iter().enumerate() {
        let y0 = 40.0 + pi as f64 * h;
        let (pw, ph) = (w - ml - mr, h - mt - mb);
        let (px, py) = (ml, y0 + mt);
        let _ = writeln!(
            s,
            r#"<text x="{ml}" y="{}" font-size="14">{}</text>"#,
            y0 + 20.0,
            esc(title)
        );
        let _ = writeln!(
            s,
            r##"<rect x="{px}" y="{py}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>"##
        );
        let vals: Vec<f64> = series.iter().flat_map(|x| x.points.iter().map(|p| p.1)).collect();
        if vals.is_empty() {
            let _ = writeln!(
                s,
                r##"<text x="{}" y="{}" fill="#888">no data in this run</text>"##,
                px + 20.0,
                py + ph / 2.0
            );
            continue;
        }
        let lo = vals.iter().cloned().fold(f64::INFINITY, f64::min).max(1e-3);
        let hi = vals.iter().cloned().fold(0.0, f64::max).max(lo * 10.0);
        let (l0, l1) = (lo.log10().floor(), hi.log10().ceil());
        let xmap = |v: f64| px + (v.max(lo).log10() - l0) / (l1 - l0) * pw;
        let ymap = |q: f64| py + ph - q / 100.0 * ph;
        let mut d = l0;
        while d <= l1 + 1e-9 {
            let x = px + (d - l0) / (l1 - l0) * pw;
            let _ = writeln!(
                s,
                r##"<line x1="{x:.1}" y1="{py}" x2="{x:.1}" y2="{}" stroke="#ddd"/><text x="{x:.1}" y="{}" text-anchor="middle">{}</text>"##,
                py + ph,
                py + ph + 16.0,
                fmt_us(10f64.powf(d))
            );
            d += 1.0;
        }
        for q in [0.0, 25.0, 50.0, 75.0, 90.0, 99.0, 100.0] {
            let y = ymap(q);
            let _ = writeln!(
                s,
                r##"<line x1="{px}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#eee"/><text x="{}" y="{:.1}" text-anchor="end">p{q}</text>"##,
                px + pw,
                px - 6.0,
                y + 4.0
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">latency</text>"#,
            px + pw / 2.0,
            py + ph + 34.0
        );
        for (si, se) in series.iter().enumerate() {
            let c = COLORS[si % COLORS.len()];
            let pts: Vec<String> = se
                .points
                .iter()
                .map(|(q, v)| format!("{:.1},{:.1}", xmap(*v), ymap(*q)))
                .collect();
            let _ = writeln!(
                s,
                r#"<polyline fill="none" stroke="{c}" stroke-width="2" points="{}"/>"#,
                pts.join(" ")
            );
            let ly = py + 14.0 + si as f64 * 18.0;
            let _ = writeln!(
                s,
                r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{c}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
                px + pw + 10.0,
                px + pw + 30.0,
                px + pw + 36.0,
                ly + 4.0,
                esc(&se.name)
            );
        }
    }
    let _ = writeln!(s, "</svg>");
    s
}

/// Part 13: a mass death, by size.
fn mass_death_section(m: &mut String, x: &Value) {
    let Some(sizes) = x["sizes"].as_array() else {
        return;
    };
    let mib = |v: &Value| num(&json!(f(v) / 1048576.0), 1);
    let _ = writeln!(
        m,
        "\n## 13. Mass death (N live keys on one lease revoked, {} `get --prefix --keys-only` loops on etcd)\n\n| keys | etcd revoke s | all down on the coordinator s | all certified in etcd s | all applied by node-watch s | `/readyz` 200 / other meanwhile | coordinator RSS MiB before / after / peak |\n|---|---|---|---|---|---|---|",
        x["setup"]["readers"]
    );
    for r in sizes {
        if let Some(e) = r["error"].as_str() {
            let _ = writeln!(m, "| {} | failed: {e} | | | | | |", r["keys"]);
            continue;
        }
        let _ = writeln!(
            m,
            "| {} | {} | {} | {} | {} | {} / {} | {} / {} / {} |",
            r["keys"],
            num(&r["revoke_s"], 2),
            num(&r["all_down_coordinator_s"], 2),
            num(&r["all_certified_s"], 2),
            num(&r["all_down_node_watch_s"], 2),
            r["readyz_during"]["ok_200"],
            r["readyz_during"]["other"],
            mib(&r["coordinator_rss_before_bytes"]),
            mib(&r["coordinator_rss_after_bytes"]),
            mib(&r["coordinator_rss_peak_bytes"]),
        );
    }
}

/// Part 14: the fleet, by size.
fn fleet_section(m: &mut String, x: &Value) {
    let Some(sizes) = x["sizes"].as_array() else {
        return;
    };
    let mib = |v: &Value| num(&json!(f(v) / 1048576.0), 1);
    let ms = |v: &Value| num(&json!(f(v) / 1e3), 2);
    let _ = writeln!(
        m,
        "\n## 14. Fleet (3-member etcd cluster, lease TTL {} s or what keeps keepalives within {}/s, groups of 16 on two hosts of 8)\n\n| ranks | etcd CPU ms/s: idle / steady (per 1,000 ranks, above idle) | keepalives/s | etcd µs per keepalive | coordinator start to `/readyz` s | coordinator RSS MiB steady / peak | verdict p50 / p99 ms | long-poll wake p50 / p99 ms | host: down / certified / rooms resolved s | rack of {}: down / certified / resolved s | its rank processes only, node-watches alive (host leases): down / certified / resolved s | 10 %: down / certified / resolved s | etcd keys a node-watch received over the run: host scope / fleet scope | rack: every one of the event subscribers has every death, s |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        x["setup"]["ttl_s"], x["setup"]["keepalive_budget_per_s"], x["setup"]["rack_ranks"]
    );
    for r in sizes {
        if let Some(e) = r["error"].as_str() {
            let _ = writeln!(m, "| {} | failed: {e} | | | | | | | | | | | | |", r["ranks"]);
            continue;
        }
        let st = &r["steady"];
        let fail = |k: &str| {
            let v = &r["failures"][k];
            if v.is_null() {
                return "-".to_string();
            }
            format!(
                "{} / {} / {}",
                num(&v["all_down_s"], 2),
                num(&v["all_certified_s"], 2),
                num(&v["rooms_resolved_s"], 2)
            )
        };
        let _ = writeln!(
            m,
            "| {} ({}) | {} / {} ({}) | {} | {} | {} | {} / {} | {} / {} | {} / {} | {} | {} | {} | {} | {} / {} | {} ({}) |",
            r["ranks"],
            r["ttl_s"],
            num(&st["etcd_idle_ms_per_s"], 0),
            num(&st["etcd_cpu_ms_per_s"], 0),
            num(&st["etcd_cpu_ms_per_s_per_1000_ranks"], 1),
            num(&st["keepalives_per_s"], 0),
            num(&st["etcd_cpu_us_per_keepalive"], 0),
            num(&r["coordinator"]["start_to_ready_s"], 2),
            mib(&r["coordinator"]["rss_steady_bytes"]),
            mib(&r["coordinator"]["rss_peak_bytes"]),
            ms(&st["verdict"]["p50_us"]),
            ms(&st["verdict"]["p99_us"]),
            ms(&st["long_poll_wake"]["p50_us"]),
            ms(&st["long_poll_wake"]["p99_us"]),
            fail("host"),
            fail("rack"),
            fail("rack_processes"),
            fail("tenth"),
            r["node_watch_events"]["host_scope"],
            r["node_watch_events"]["fleet_scope"],
            num(&r["failures"]["rack"]["all_subscribers_have_every_death_s"], 2),
            r["events"]["subscribers"],
        );
    }
    if let Some(s) = x["summary"].as_str() {
        let _ = writeln!(m, "\n{s}");
    }
}
