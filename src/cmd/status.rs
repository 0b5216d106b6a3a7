//! `rootrank status`: groups and ranks at a glance.

use std::time::Duration;

use serde_json::Value;

use super::client::Api;
use super::CoordinatorArgs;

#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    /// Show one group's ranks.
    #[arg(long)]
    pub group: Option<String>,
    #[command(flatten)]
    pub coordinator: CoordinatorArgs,
    /// Print the API's JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: StatusArgs) -> anyhow::Result<u8> {
    let rt = super::runtime()?;
    let api = Api::new(&a.coordinator, Duration::from_secs(5))?;
    let v = match &a.group {
        Some(g) => rt.block_on(api.get(&format!("/v1/groups/{g}"), &[]))?,
        None => rt.block_on(api.get("/v1/groups", &[]))?,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(0);
    }
    let s = |x: &Value| x.as_str().map(str::to_string).unwrap_or_else(|| x.to_string());
    if a.group.is_some() {
        println!("group {} ({} ranks)", s(&v["group"]), s(&v["group_size"]));
        println!(
            "  {:<5} {:<9} {:<18} {:<8} {:<20} last failure",
            "rank", "state", "host", "pid", "incarnation"
        );
        for r in v["ranks"].as_array().into_iter().flatten() {
            let mut lf = r["last_failure"]
                .as_object()
                .map(|f| format!("room {} {}", s(&f["room"]), s(&f["reason"])))
                .unwrap_or_default();
            // v3: a stalled rank says since when, and whether it stalled first (the suspect).
            if let Some(st) = r["stall"].as_object() {
                let secs = st["stalled_ms"].as_u64().map(|ms| format!(" for {} s", ms / 1000));
                lf = format!(
                    "{} (no progress{} since {}){}{}",
                    s(&st["role"]),
                    secs.unwrap_or_default(),
                    r["stalled_since"].as_str().unwrap_or("?"),
                    if lf.is_empty() { "" } else { "; " },
                    lf
                );
            } else if let Some(reason) = r["reason"].as_str() {
                lf = if lf.is_empty() {
                    reason.to_string()
                } else {
                    format!("{reason}; {lf}")
                };
            }
            println!(
                "  {:<5} {:<9} {:<18} {:<8} {:<20} {lf}",
                s(&r["rank"]),
                s(&r["state"]),
                r["host"].as_str().unwrap_or("-"),
                r["pid"].as_u64().map_or("-".into(), |p| p.to_string()),
                r["incarnation"].as_str().unwrap_or("-"),
            );
        }
    } else {
        let groups = v["groups"].as_array().cloned().unwrap_or_default();
        if groups.is_empty() {
            println!("no groups yet: no rank has registered with this coordinator's etcd");
        }
        println!(
            "{:<28} {:<8} {:>5} {:>5} {:>7} {:>5} {:>7}",
            "group", "role", "size", "live", "stalled", "down", "missing"
        );
        for g in groups {
            println!(
                "{:<28} {:<8} {:>5} {:>5} {:>7} {:>5} {:>7}",
                s(&g["group"]),
                g["role"].as_str().unwrap_or("-"),
                s(&g["group_size"]),
                s(&g["live"]),
                g["stalled"].as_u64().unwrap_or(0),
                s(&g["down"]),
                s(&g["missing"])
            );
        }
    }
    Ok(0)
}
