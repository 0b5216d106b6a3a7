//! `rootrank why ROOM`: the verdict, for people or as JSON.

use std::time::Duration;

use serde_json::Value;

use super::client::Api;
use super::CoordinatorArgs;

#[derive(clap::Args, Debug)]
pub struct WhyArgs {
    /// The bootstrap_room (decimal).
    pub room: String,
    /// Only this group's ranks.
    #[arg(long)]
    pub group: Option<String>,
    /// Wait up to this long for the verdict to resolve (0..=30000).
    #[arg(long, default_value_t = 0)]
    pub wait_ms: u64,
    #[command(flatten)]
    pub coordinator: CoordinatorArgs,
    /// Print the API's JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: WhyArgs) -> anyhow::Result<u8> {
    let rt = super::runtime()?;
    let api = Api::new(&a.coordinator.coordinator, Duration::from_millis(a.wait_ms + 5_000))?;
    let mut query = vec![("wait_ms", a.wait_ms.to_string())];
    if let Some(g) = &a.group {
        query.push(("group", g.clone()));
    }
    let v = rt.block_on(api.get(&format!("/v1/rooms/{}/verdict", urlencode(&a.room)), &query))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", render(&v));
    }
    Ok(if v["status"] == "resolved" { 0 } else { 3 })
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// One short paragraph: what happened, to whom, what to do.
pub fn render(v: &Value) -> String {
    let s = |x: &Value| x.as_str().map(str::to_string).unwrap_or_else(|| x.to_string());
    let mut out = format!("room {}: {} -> {}\n", s(&v["room"]), s(&v["status"]), s(&v["action"]));
    if let Some(c) = v["culprit"].as_object() {
        let mut who = format!("  culprit: {} rank {}", s(&c["group"]), s(&c["rank"]));
        if let Some(pid) = c.get("pid").and_then(Value::as_u64) {
            who.push_str(&format!(" (pid {pid}"));
            if let Some(h) = c.get("host").and_then(Value::as_str) {
                who.push_str(&format!(" on {h}"));
            }
            who.push(')');
        }
        out.push_str(&format!(
            "{who}\n  reason:  {} (from {})\n",
            s(&c["reason"]),
            s(&c["source"])
        ));
        if let Some(d) = c.get("detail").and_then(Value::as_str).filter(|d| !d.is_empty()) {
            out.push_str(&format!("  detail:  {}\n", d.lines().next().unwrap_or("")));
        }
        if let Some(n) = c.get("repeat").and_then(Value::as_u64).filter(|n| *n > 1) {
            out.push_str(&format!("  repeat:  failed {n} times in the retention window\n"));
        }
    }
    // The cause's traceback says more than the culprit's, when there is one.
    let root = v["cause"].as_object().or(v["culprit"].as_object());
    if let Some(k) = v["cause"].as_object() {
        out.push_str(&format!(
            "  cause:   {} rank {}: {} (from {})",
            s(&k["group"]),
            s(&k["rank"]),
            s(&k["reason"]),
            s(&k["source"])
        ));
        if let Some(d) = k.get("detail").and_then(Value::as_str).filter(|d| !d.is_empty()) {
            out.push_str(&format!(": {}", d.lines().next().unwrap_or("")));
        }
        out.push('\n');
    }
    // Rule 7: the ranks that died only because a peer vanished, so nobody restarts them first.
    if let Some(victims) = v["victims"].as_array().filter(|a| !a.is_empty()) {
        let who: Vec<String> = victims
            .iter()
            .map(|x| format!("{} rank {}", s(&x["group"]), s(&x["rank"])))
            .collect();
        out.push_str(&format!(
            "  victims: {} (died because a peer vanished)\n",
            who.join(", ")
        ));
    }
    if let Some(tail) = root
        .and_then(|c| c.get("log_tail"))
        .and_then(Value::as_array)
        .filter(|t| !t.is_empty())
    {
        out.push_str("  last log lines:\n");
        for l in tail.iter().rev().take(8).collect::<Vec<_>>().into_iter().rev() {
            out.push_str(&format!("    | {}\n", l.as_str().unwrap_or("")));
        }
    }
    out.push_str(&format!("  {}\n", s(&v["explain"])));
    if let Some(a) = v["advice"].as_str() {
        out.push_str(&format!("  advice:  {a}\n"));
    }
    out
}
