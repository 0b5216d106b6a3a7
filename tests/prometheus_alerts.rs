//! A real Prometheus (Debian's server) scrapes two coordinator replicas with the job of
//! `docker/prometheus.yml` (targets moved to loopback) and the rules of `dashboards/alerts.yml`:
//! a SIGKILLed rank fires `RootrankRankDown` through Prometheus's own API, both replicas
//! export the same root-cause counters, and the alert resolves when the rank is back.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rootrank_testkit::{eventually, free_port, repo_root, Coordinator, Etcd, Rank};
use serde_json::Value;

struct Prometheus {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `docker/prometheus.yml` as shipped, with the coordinator targets moved to `targets`, the
/// rules file pointed at the repository's `dashboards/alerts.yml`, and 1 s intervals so the
/// test does not wait on 15 s scrapes. Every edit must apply: a changed file fails here.
fn config(targets: &[String]) -> String {
    let shipped = std::fs::read_to_string(repo_root().join("docker/prometheus.yml")).unwrap();
    let rules = repo_root().join("dashboards/alerts.yml");
    let list = targets.iter().map(|t| format!("{t:?}")).collect::<Vec<_>>().join(", ");
    let mut out = shipped.clone();
    for (from, to) in [
        ("scrape_interval: 15s", "scrape_interval: 1s".to_string()),
        ("evaluation_interval: 15s", "evaluation_interval: 1s".to_string()),
        ("  - rules/*.yml", format!("  - {}", rules.display())),
        (r#"targets: ["rootrank:9750"]"#, format!("targets: [{list}]")),
    ] {
        assert!(out.contains(from), "docker/prometheus.yml no longer has {from:?}");
        out = out.replace(from, &to);
    }
    out
}

fn start_prometheus(targets: &[String]) -> Prometheus {
    let bin = ["/usr/bin/prometheus", "/usr/sbin/prometheus"]
        .into_iter()
        .find(|p| std::path::Path::new(p).is_file())
        .expect("prometheus not installed: scripts/deps.sh installs Debian's prometheus");
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("prometheus.yml");
    std::fs::write(&cfg, config(targets)).unwrap();
    let port = free_port().unwrap();
    let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
    let child = Command::new(bin)
        .arg(format!("--config.file={}", cfg.display()))
        .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    Prometheus {
        child,
        url: format!("http://127.0.0.1:{port}"),
        _dir: dir,
    }
}

async fn api(prom: &Prometheus, path: &str) -> Option<Value> {
    let (status, body) = rootrank_testkit::get(&format!("{}{path}", prom.url)).await.ok()?;
    (status == 200).then_some(body)
}

/// Firing RootrankRankDown alerts, as (group, rank).
async fn firing_rank_down(prom: &Prometheus) -> Option<Vec<(String, String)>> {
    let v = api(prom, "/api/v1/alerts").await?;
    Some(
        v["data"]["alerts"]
            .as_array()?
            .iter()
            .filter(|a| a["labels"]["alertname"] == "RootrankRankDown" && a["state"] == "firing")
            .map(|a| {
                let l = &a["labels"];
                (
                    l["group"].as_str().unwrap_or("").to_string(),
                    l["rank"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_rank_fires_rank_down_through_prometheus_and_it_resolves_when_back() {
    let etcd = Etcd::start().unwrap();
    let ep = etcd.endpoint();
    let a = Coordinator::start(&ep, &[]).await.unwrap();
    let b = Coordinator::start(&ep, &[]).await.unwrap();
    let targets = vec![format!("127.0.0.1:{}", a.port()), format!("127.0.0.1:{}", b.port())];
    let prom = start_prometheus(&targets);

    let mut r0 = Rank::start(&ep, "prom-0", 0, 2, 1_000).unwrap();
    let mut r1 = Rank::start(&ep, "prom-0", 1, 2, 1_000).unwrap();
    // Both replicas scraped, the group's ranks up.
    eventually(
        Duration::from_secs(60),
        "both replicas scraped with the group up",
        || async {
            let v = api(&prom, "/api/v1/query?query=rootrank_rank_up%7Bgroup%3D%22prom-0%22%7D").await?;
            let series = v["data"]["result"].as_array()?;
            (series.len() == 4 && series.iter().all(|s| s["value"][1] == "1")).then_some(())
        },
    )
    .await
    .unwrap();

    // Rank 1 dies; rank 0 reports two rooms it saw fail (propagated): both resolve to rank 1.
    r1.kill9();
    for room in [7001u64, 7002] {
        r0.fail(room, "propagated", "other", "NIXL KVSender Exception").unwrap();
    }
    let fired = eventually(
        Duration::from_secs(150),
        "RootrankRankDown firing for prom-0 rank 1",
        || async {
            let f = firing_rank_down(&prom).await?;
            f.contains(&("prom-0".to_string(), "1".to_string())).then_some(f)
        },
    )
    .await
    .unwrap();
    assert!(
        !fired.contains(&("prom-0".to_string(), "0".to_string())),
        "only the dead rank pages: {fired:?}"
    );

    // The replicas fold the same etcd state: the root-cause counters read the same from both.
    let by_instance = eventually(
        Duration::from_secs(30),
        "root causes scraped from both replicas",
        || async {
            let q = "/api/v1/query?query=rootrank_root_causes_total%7Bgroup%3D%22prom-0%22%7D";
            let v = api(&prom, q).await?;
            let mut seen: Vec<(String, String, String, String)> = v["data"]["result"]
                .as_array()?
                .iter()
                .map(|s| {
                    let m = &s["metric"];
                    let f = |k: &str| m[k].as_str().unwrap_or("").to_string();
                    (
                        f("instance"),
                        f("rank"),
                        f("source"),
                        s["value"][1].as_str().unwrap_or("").to_string(),
                    )
                })
                .collect();
            seen.sort();
            (seen.len() == 2 && seen.iter().all(|s| s.3 == "2")).then_some(seen)
        },
    )
    .await
    .unwrap();
    assert_eq!(by_instance[0].1, "1", "{by_instance:?}");
    assert_eq!(by_instance[0].2, "lease_expired", "{by_instance:?}");
    assert_eq!(
        (&by_instance[0].1, &by_instance[0].2, &by_instance[0].3),
        (&by_instance[1].1, &by_instance[1].2, &by_instance[1].3),
        "the same counter on both replicas: {by_instance:?}"
    );

    // Rank 1 comes back (a new incarnation): the alert resolves.
    let _r1b = Rank::start(&ep, "prom-0", 1, 2, 1_000).unwrap();
    eventually(Duration::from_secs(60), "RootrankRankDown resolved", || async {
        let f = firing_rank_down(&prom).await?;
        (!f.contains(&("prom-0".to_string(), "1".to_string()))).then_some(())
    })
    .await
    .unwrap();
}
