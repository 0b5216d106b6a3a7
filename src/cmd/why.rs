//! `rootrank why ROOM`: the verdict, for people or as JSON.

use std::time::Duration;

use rootrank_core::Verdict;
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
    let api = Api::new(&a.coordinator, Duration::from_millis(a.wait_ms + 5_000))?;
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

/// One short paragraph: what happened, to whom, what to do. The API's JSON is read as the
/// core's own `Verdict` (the type the coordinator serializes), so a field the two disagree on
/// is a compile error or a clear one here, never a silently empty line.
pub fn render(v: &Value) -> String {
    match serde_json::from_value::<Verdict>(v.clone()) {
        Ok(verdict) => render_verdict(&verdict),
        Err(e) => format!(
            "room {}: the coordinator's verdict could not be read ({e}); is it a different rootrank version? \
             `--json` prints it as it came\n",
            v["room"].as_str().unwrap_or("?")
        ),
    }
}

/// [`render`] for a typed verdict.
pub fn render_verdict(v: &Verdict) -> String {
    let mut out = format!("room {}: {} -> {}\n", v.room, v.status.as_str(), v.action.as_str());
    if let Some(c) = &v.culprit {
        let mut who = format!("  culprit: {} rank {}", c.group, c.rank);
        if let Some(pid) = c.pid {
            who.push_str(&format!(" (pid {pid}"));
            if let Some(h) = &c.host {
                who.push_str(&format!(" on {h}"));
            }
            who.push(')');
        }
        out.push_str(&format!("{who}\n  reason:  {} (from {})\n", c.reason, c.source));
        if !c.detail.is_empty() {
            out.push_str(&format!("  detail:  {}\n", first_line(&c.detail)));
        }
        if c.repeat > 1 {
            out.push_str(&format!(
                "  repeat:  failed {} times in the retention window\n",
                c.repeat
            ));
        }
    }
    if let Some(k) = &v.cause {
        out.push_str(&format!(
            "  cause:   {} rank {}: {} (from {})",
            k.group, k.rank, k.reason, k.source
        ));
        if !k.detail.is_empty() {
            out.push_str(&format!(": {}", first_line(&k.detail)));
        }
        out.push('\n');
    }
    // Rule 7: the ranks that died only because a peer vanished, so nobody restarts them first.
    if !v.victims.is_empty() {
        let who: Vec<String> = v
            .victims
            .iter()
            .map(|x| format!("{} rank {}", x.group, x.rank))
            .collect();
        out.push_str(&format!(
            "  victims: {} (died because a peer vanished)\n",
            who.join(", ")
        ));
    }
    // The cause's traceback says more than the culprit's, when there is one.
    let root = v.cause.as_ref().or(v.culprit.as_ref());
    if let Some(tail) = root.and_then(|c| c.log_tail.as_ref()).filter(|t| !t.is_empty()) {
        out.push_str("  last log lines:\n");
        for l in &tail[tail.len().saturating_sub(8)..] {
            out.push_str(&format!("    | {l}\n"));
        }
    }
    out.push_str(&format!("  {}\n", v.explain));
    if let Some(a) = &v.advice {
        out.push_str(&format!("  advice:  {a}\n"));
    }
    // What a scheduler (or a person re-sending the request by hand) may do with it.
    if !v.retry.why.is_empty() {
        out.push_str(&format!("  retry:   {}\n", v.retry.why));
    }
    out
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or("")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_verdict_it_cannot_read_says_so_instead_of_printing_blanks() {
        let out = render(&serde_json::json!({"room": "5", "status": "resolved"}));
        assert!(
            out.starts_with("room 5: the coordinator's verdict could not be read ("),
            "{out}"
        );
        assert!(out.contains("--json"), "{out}");
    }
}
