//! A rank driven by lines of text: the protocol of `rootrank rank` (operators and tests use
//! it as a real rank) and of the benchmarks' rank processes. One driver for both.
//!
//! ```text
//! <- registered incarnation=INC pid=PID        once the agent has registered
//! -> fail ROOM local|propagated REASON [DETAIL...]   <- ok | error: ...
//! -> down REASON [DETAIL...]                          <- ok | error: ...
//! -> flush                                            <- flushed | error: flush timed out
//! -> stats                                            <- published=N dropped=N rejected=N retries=N registrations=N
//! -> exit (or end of input)                           <- bye | bye (shutdown incomplete: etcd unreachable)
//! ```

use std::io::{BufRead, Write};
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use rootrank_core::Origin;

use crate::Agent;

pub const HELP: &str =
    "commands: fail ROOM local|propagated REASON [DETAIL...] | down REASON [DETAIL...] | flush | stats | exit";

/// Waits for the agent to register (up to 30 s), announces it, then answers commands from
/// `input` until `exit` or its end, and shuts the agent down. An agent that never registers
/// is an error (etcd unreachable, or another process holds this rank's live key).
pub fn drive(agent: &Agent, input: impl BufRead, mut out: impl Write) -> std::io::Result<()> {
    let Some(inc) = agent.wait_registered(Duration::from_secs(30)) else {
        if let Some(why) = agent.registration_refused().or_else(|| agent.etcd_refused()) {
            return Err(std::io::Error::other(why));
        }
        return Err(std::io::Error::other(
            "the agent did not register within 30 s: is etcd reachable?",
        ));
    };
    writeln!(out, "registered incarnation={inc} pid={}", std::process::id())?;
    out.flush()?;
    for line in input.lines() {
        let line = line?;
        let words: Vec<&str> = line.split_whitespace().collect();
        let reply = match words.as_slice() {
            [] => continue,
            ["exit"] => break,
            ["help"] => HELP.to_string(),
            ["flush"] => {
                if agent.flush(Duration::from_secs(30)) {
                    "flushed".into()
                } else {
                    "error: flush timed out".into()
                }
            }
            ["stats"] => {
                let s = agent.stats();
                format!(
                    "published={} dropped={} rejected={} retries={} registrations={}",
                    s.published.load(Relaxed),
                    s.dropped.load(Relaxed),
                    s.rejected.load(Relaxed),
                    // Every write retried, a registration's included.
                    s.retries.load(Relaxed) + s.registration_retries.load(Relaxed),
                    s.registrations.load(Relaxed)
                )
            }
            ["fail", room, origin, reason, detail @ ..] => match parse_fail(room, origin) {
                Ok((room, origin)) => match agent.record_failure(room, origin, reason, &detail.join(" "), None) {
                    Ok(()) => "ok".into(),
                    Err(e) => format!("error: {e}"),
                },
                Err(e) => format!("error: {e}"),
            },
            ["down", reason, detail @ ..] => match agent.record_down(reason, &detail.join(" "), None) {
                Ok(()) => "ok".into(),
                Err(e) => format!("error: {e}"),
            },
            _ => format!("error: unknown command; {HELP}"),
        };
        writeln!(out, "{reply}")?;
        out.flush()?;
    }
    let clean = agent.shutdown(Duration::from_secs(10));
    writeln!(
        out,
        "{}",
        if clean {
            "bye"
        } else {
            "bye (shutdown incomplete: etcd unreachable)"
        }
    )?;
    out.flush()
}

fn parse_fail(room: &str, origin: &str) -> Result<(u64, Origin), String> {
    let room: u64 = room
        .parse()
        .map_err(|_| format!("room {room:?} is not a decimal integer"))?;
    let origin = match origin {
        "local" => Origin::Local,
        "propagated" => Origin::Propagated,
        "peer_reported" => Origin::PeerReported,
        other => return Err(format!("origin {other:?}: local, propagated or peer_reported")),
    };
    Ok((room, origin))
}
