//! `rootrank watch` (SPEC v3 section 7): follows `GET /v1/events`, one line per event for
//! people or JSON lines with `--json`. Reconnects on its own (to the next replica too) and
//! resumes after the last revision it printed; a 410 (`compacted`) is an error to report.

use std::time::Duration;

use anyhow::anyhow;
use serde_json::Value;

use super::CoordinatorArgs;

#[derive(clap::Args, Debug)]
pub struct WatchArgs {
    /// Only events of this group (rank changes; resolved rooms that involve it).
    #[arg(long)]
    pub group: Option<String>,
    /// Start after this etcd revision (default: from now).
    #[arg(long)]
    pub since: Option<u64>,
    #[command(flatten)]
    pub coordinator: CoordinatorArgs,
    /// Print each event's JSON on one line.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: WatchArgs) -> anyhow::Result<u8> {
    let rt = super::runtime()?;
    rt.block_on(follow(a))
}

async fn follow(a: WatchArgs) -> anyhow::Result<u8> {
    let bases = super::client::replica_urls(&a.coordinator.coordinator)?;
    let http = a.coordinator.http()?;
    let mut since = a.since;
    let mut pause = Duration::from_millis(200);
    let mut i = 0usize;
    loop {
        let base = &bases[i % bases.len()];
        let mut query: Vec<(&str, String)> = Vec::new();
        if let Some(s) = since {
            query.push(("since", s.to_string()));
        }
        if let Some(g) = &a.group {
            query.push(("group", g.clone()));
        }
        let sent = http
            .get(format!("{base}/v1/events"))
            .query(&query)
            .header("accept", "text/event-stream")
            .send()
            .await;
        let mut resp = match sent {
            Ok(r) if r.status().is_success() => r,
            Ok(r) => {
                let status = r.status().as_u16();
                let body: Value = r.json().await.unwrap_or(Value::Null);
                let msg = body["error"]["message"].as_str().unwrap_or("no message");
                let code = body["error"]["code"].as_str().unwrap_or("error");
                if status == 503 {
                    eprintln!("rootrank watch: {base}: {code}: {msg}; trying again");
                } else {
                    return Err(anyhow!("{base} answered {status} {code}: {msg}"));
                }
                i += 1;
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
                continue;
            }
            Err(e) => {
                eprintln!("rootrank watch: {base}: {e}; trying again");
                i += 1;
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        pause = Duration::from_millis(200);
        let mut buf = String::new();
        let mut data = String::new();
        let mut id: Option<u64> = None;
        // The coordinator sends a keep-alive every 15 s: silence for 45 s is a dead peer.
        while let Ok(Ok(Some(chunk))) = tokio::time::timeout(Duration::from_secs(45), resp.chunk()).await {
            buf.push_str(&String::from_utf8_lossy(&chunk));
            while let Some(nl) = buf.find('\n') {
                let line: String = buf.drain(..=nl).collect();
                let line = line.trim_end_matches(['\r', '\n']);
                if line.is_empty() {
                    if let Some(n) = id.take() {
                        since = Some(n);
                    }
                    if !data.is_empty() {
                        let ev: Value = serde_json::from_str(&data).unwrap_or(Value::Null);
                        data.clear();
                        if ev["event"] == "error" {
                            eprintln!(
                                "rootrank watch: {}; resuming",
                                ev["message"].as_str().unwrap_or("cut off")
                            );
                            break;
                        }
                        print_event(&ev, a.json);
                    }
                    continue;
                }
                if let Some(v) = line.strip_prefix("data:") {
                    if !data.is_empty() {
                        data.push('\n');
                    }
                    data.push_str(v.strip_prefix(' ').unwrap_or(v));
                } else if let Some(v) = line.strip_prefix("id:") {
                    id = v.trim().parse().ok();
                }
            }
        }
        eprintln!(
            "rootrank watch: the stream from {base} ended; resuming after revision {}",
            since.unwrap_or(0)
        );
    }
}

fn print_event(ev: &Value, json: bool) {
    if json {
        println!("{ev}");
        return;
    }
    let s = |x: &Value| x.as_str().map(str::to_string).unwrap_or_else(|| x.to_string());
    match ev["event"].as_str() {
        Some("rank") => println!(
            "rev {:<8} {} rank {} {}{}",
            s(&ev["revision"]),
            s(&ev["group"]),
            s(&ev["rank"]),
            s(&ev["state"]),
            match (ev["reason"].as_str(), ev["certified"].as_bool()) {
                // v4: a vanished live key, before its certificate says it was a death.
                (Some(r), Some(false)) => format!(" ({r}, not certified yet)"),
                (Some(r), _) => format!(" ({r})"),
                (None, _) => String::new(),
            }
        ),
        Some("resolved") => {
            let v = &ev["verdict"];
            let c = &v["culprit"];
            println!(
                "rev {:<8} room {} resolved: {} rank {} {} ({})",
                s(&ev["revision"]),
                s(&v["room"]),
                s(&c["group"]),
                s(&c["rank"]),
                s(&c["reason"]),
                s(&c["source"])
            );
        }
        _ => println!("{ev}"),
    }
}
