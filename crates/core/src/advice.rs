//! Rule 6's advice: what an operator does about a culprit, by its root reason. The serving
//! engine's own knobs (SGLang's flags and ports) are named in one table, [`SGLANG`], so the
//! rest of the advice is the engine's business only through it.

use crate::verdict::{Culprit, CulpritSource};

/// What SGLang lets an operator change about a reason, in SGLang's words.
const SGLANG: &[(&str, &str)] = &[
    (
        "oom_host",
        "lower --mem-fraction-static, --max-total-tokens or --chunked-prefill-size",
    ),
    (
        "oom_gpu",
        "lower --mem-fraction-static, --max-total-tokens or --chunked-prefill-size",
    ),
    (
        "bootstrap_timeout",
        "check that the other instance is up and its bootstrap port reachable",
    ),
];

fn engine(reason: &str) -> &'static str {
    SGLANG
        .iter()
        .find(|(r, _)| *r == reason)
        .map_or("check the serving engine's settings for it", |(_, hint)| hint)
}

/// Rule 6: one or two sentences for an operator at 3 a.m., chosen by the root reason (the
/// cause's when there is one) and by how often the culprit failed.
pub(crate) fn advice(c: &Culprit, cause: Option<&Culprit>) -> String {
    let root = cause.unwrap_or(c);
    let who = |x: &Culprit| {
        let at = x.host.as_deref().map(|h| format!(" on {h}")).unwrap_or_default();
        format!("{} rank {}{at}", x.group, x.rank)
    };
    let peer = cause.map(who).or_else(|| {
        c.peer.as_ref().and_then(|p| match (&p.group, p.rank, &p.agent) {
            (Some(g), Some(r), _) => Some(format!("{g} rank {r}")),
            (_, _, Some(a)) => Some(format!("the rank with NIXL agent {a}")),
            _ => None,
        })
    });
    let again = if root.repeat > 1 {
        format!(" It failed {} times in the retention window.", root.repeat)
    } else {
        String::new()
    };
    let restart = "restart the group so its ranks re-bootstrap";
    match root.reason.as_str() {
        "oom_host" | "oom_gpu" if root.repeat > 1 => format!(
            "{} ran out of memory again ({} times): {} for that instance, then {restart}.",
            who(root),
            root.repeat,
            engine(root.reason.as_str())
        ),
        "oom_host" | "oom_gpu" => format!(
            "{} ran out of memory: {restart}; if it recurs, {}.",
            who(root),
            engine(root.reason.as_str())
        ),
        "nccl_timeout" | "ucx_error" | "transfer_timeout" | "nixl_error" | "peer_disconnect" => format!(
            "Check {} and the network between it and {} (UCX_TLS, NIC and link errors); abort the request.{again}",
            peer.unwrap_or_else(|| "the transfer peer".into()),
            who(c)
        ),
        "bootstrap_timeout" => format!(
            "The handshake with {} never completed: {}.{again}",
            peer.unwrap_or_else(|| "the peer instance".into()),
            engine("bootstrap_timeout")
        ),
        "lease_expired" => format!(
            "{} stopped renewing its lease (killed, hung or cut off from etcd): check the process, then {restart}. Run `rootrank node-watch` on its host to learn why ranks die.{again}",
            who(root)
        ),
        "python_exception" | "panic" | "process_exit" => format!(
            "{} died of {}: read the cause's log_tail for the traceback, then {restart}.{again}",
            who(root),
            root.reason
        ),
        "gpu_xid" => format!("{} hit a GPU fault (Xid): drain that GPU or host, then {restart} elsewhere.{again}", who(root)),
        "aborted" => "The request was aborted (by the client, the router or the other side): nothing to repair.".into(),
        _ if root.source != CulpritSource::RoomRecord => format!("{} died ({}): {restart}.{again}", who(root), root.reason),
        _ => format!("{} failed the transfer ({}): see the detail; abort the request.{again}", who(root), root.reason),
    }
}
