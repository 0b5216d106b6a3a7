//! Certifying a rank process that exited, from its parent. SGLang's launcher learns that a
//! scheduler died (its subprocess watchdog polls every second) before anything else on the
//! node, and then kills the dead rank's siblings at once when crash dumps are off: without a
//! certificate their leases expire in an order that has nothing to do with who died first,
//! and the first expiry would be named. So the launcher certifies the process it found dead,
//! with its exit status, before its cleanup: the first death is the one named.
//!
//! The rank is found by its live record: the same pid, in this process's pid namespace, on
//! this host and boot (a parent and its child always share them). Blocks the calling thread
//! for at most the given timeout (on its own single-threaded runtime); never panics.

use std::time::{Duration, Instant};

use rootrank_core::ids::reasons;
use rootrank_core::records::{DownSource, ExitInfo, Origin, RankDown, RankLive, RoomFailure, SCHEMA_VERSION};
use rootrank_core::{time, GroupId, Incarnation, KeyKind, Keys, Rank, Reason, RoomId};
use rootrank_store::etcd_client::GetOptions;
use rootrank_store::{EtcdAccess, LazyClient, Retained, RetainedWriter, Written};

use crate::procfs;
use crate::AgentError;

/// A child process that exited, as its parent saw it.
#[derive(Clone, Debug)]
pub struct ExitedProcess {
    pub pid: u32,
    /// The exit code, when it exited.
    pub code: Option<i32>,
    /// The signal that ended it, when one did (SIGKILL: 9).
    pub signal: Option<i32>,
    /// For people: who saw it and how (e.g. "SGLang's launcher saw scheduler_1 exit").
    pub detail: String,
    /// The rooms the parent had in flight on it (SGLang's launcher: its requests' bootstrap
    /// rooms). Each becomes a `propagated` record of every rank certified: the process could
    /// not say which rooms died with it, and a peer still waiting on one of them (a prefill
    /// whose decode died before asking for the KV) learns from its verdict that it will never
    /// conclude. Never a root cause: the death is the candidate.
    pub rooms: Vec<RoomId>,
}

/// Writes a down certificate (source `supervisor`, reason `process_exit`) for every rank
/// whose live record names `exited.pid` in this process's pid namespace, host and boot.
/// Then records `exited.rooms` for each of them (`propagated`, reason `process_exit`).
/// Returns the ranks certified (written now or already certified by someone else first).
pub fn certify_exited(
    etcd: EtcdAccess,
    prefix: &str,
    exited: &ExitedProcess,
    timeout: Duration,
) -> Result<Vec<(GroupId, Rank)>, AgentError> {
    if exited.pid == 0 {
        return Err(AgentError::Config("pid 0 is not a process".into()));
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(AgentError::Thread)?;
    let deadline = Instant::now() + timeout;
    runtime.block_on(async {
        match tokio::time::timeout(timeout, certify(etcd, prefix, exited, deadline)).await {
            Ok(result) => result,
            Err(_) => Err(AgentError::Etcd(format!(
                "etcd did not take the certificate of pid {} within {timeout:?}",
                exited.pid
            ))),
        }
    })
}

async fn certify(
    access: EtcdAccess,
    prefix: &str,
    exited: &ExitedProcess,
    deadline: Instant,
) -> Result<Vec<(GroupId, Rank)>, AgentError> {
    let keys = Keys::new(prefix);
    let mut etcd = LazyClient::new(access.clone());
    let client = etcd.client().await.map_err(|e| AgentError::Etcd(e.to_string()))?;
    let groups = format!("{}groups/", keys.root());
    let got = client
        .get(groups.as_str(), Some(GetOptions::new().with_prefix()))
        .await
        .map_err(|e| AgentError::Etcd(rootrank_store::StoreError::from_etcd(&access, e).to_string()))?;
    let me = Identity::of_this_process();
    let mut found = Vec::new();
    for kv in got.kvs() {
        if !matches!(keys.parse(kv.key()), Some(KeyKind::Live { .. })) {
            continue;
        }
        let Ok(live) = RankLive::parse(kv.value()) else {
            continue;
        };
        let Ok(incarnation) = live.incarnation_on(kv.lease()) else {
            continue;
        };
        if me.names(&live, exited.pid) {
            found.push((live, incarnation, kv.create_revision()));
        }
    }
    let mut writer = RetainedWriter::new(LazyClient::connected(access, client.clone()), RETENTION);
    let mut certified = Vec::new();
    for (live, incarnation, registered) in found {
        let down = RankDown {
            v: SCHEMA_VERSION,
            group: live.group.clone(),
            rank: live.rank,
            incarnation,
            reason: Reason::well_known(reasons::PROCESS_EXIT),
            detail: exited.detail.clone(),
            source: DownSource::Supervisor,
            at: Some(time::format_ms(rootrank_store::unix_ms())),
            exit: Some(ExitInfo {
                code: exited.code,
                signal: exited.signal,
            }),
            log_tail: None,
            host: live.host.clone(),
            pid: live.pid,
            observed_revision: None,
            registered_revision: Some(registered),
            lease_ttl_ms: live.lease_ttl_ms,
            group_size: Some(live.group_size),
            role: live.role.clone(),
        };
        let key = keys.down(&live.group, live.rank, incarnation);
        match writer
            .write(Retained::Certificate { key: &key, down: &down }, Some(deadline))
            .await
        {
            Written::Yes | Written::AlreadyThere => {}
            Written::GaveUp | Written::Rejected => {
                return Err(AgentError::Etcd(format!("etcd did not take {key}")));
            }
        }
        let records = room_records(&keys, &live, incarnation, exited)?;
        let batch: Vec<(&str, &[u8])> = records.iter().map(|(k, v)| (k.as_str(), v.as_slice())).collect();
        let written = writer.write_records(&batch, Some(deadline)).await;
        if let Some(i) = written
            .iter()
            .position(|w| matches!(w, Written::GaveUp | Written::Rejected))
        {
            return Err(AgentError::Etcd(format!("etcd did not take {}", batch[i].0)));
        }
        certified.push((live.group, live.rank));
    }
    Ok(certified)
}

/// The `propagated` records of the rooms the exited process had in flight, for one of its ranks.
fn room_records(
    keys: &Keys,
    live: &RankLive,
    incarnation: Incarnation,
    exited: &ExitedProcess,
) -> Result<Vec<(String, Vec<u8>)>, AgentError> {
    let at = time::format_ms(rootrank_store::unix_ms());
    let mut detail = format!("in flight when this rank's process exited: {}", exited.detail);
    rootrank_core::records::truncate_utf8(&mut detail, rootrank_core::records::MAX_DETAIL_BYTES);
    let mut out = Vec::with_capacity(exited.rooms.len());
    for &room in exited.rooms.iter().take(MAX_ROOMS) {
        let rec = RoomFailure {
            v: SCHEMA_VERSION,
            group: live.group.clone(),
            rank: live.rank,
            room,
            origin: Origin::Propagated,
            reason: Reason::well_known(reasons::PROCESS_EXIT),
            detail: detail.clone(),
            at: Some(at.clone()),
            incarnation: Some(incarnation),
            peer: None,
        };
        let value = serde_json::to_vec(&rec).map_err(|e| AgentError::Config(e.to_string()))?;
        out.push((keys.room(&live.group, room, live.rank), value));
    }
    Ok(out)
}

/// At most this many rooms per certified rank (SGLang's default `--max-running-requests` and
/// its queues stay far below it).
pub const MAX_ROOMS: usize = 4096;

/// How long the certificate stays in etcd (as the agent's records: the retention window).
const RETENTION: Duration = Duration::from_secs(600);

/// What a parent shares with its child: host, boot and pid namespace.
struct Identity {
    host: Option<String>,
    boot_id: Option<String>,
    pid_ns: Option<u64>,
}

impl Identity {
    fn of_this_process() -> Self {
        Identity {
            host: crate::read_trimmed("/proc/sys/kernel/hostname"),
            boot_id: crate::read_trimmed("/proc/sys/kernel/random/boot_id"),
            pid_ns: procfs::pid_ns(None),
        }
    }

    /// Whether `live` is the record of process `pid` seen from here. A field either side
    /// does not know is not held against it; a field both know must agree.
    fn names(&self, live: &RankLive, pid: u32) -> bool {
        fn agree<T: PartialEq>(a: &Option<T>, b: &Option<T>) -> bool {
            match (a, b) {
                (Some(a), Some(b)) => a == b,
                _ => true,
            }
        }
        live.pid == Some(pid)
            && agree(&self.host, &live.host)
            && agree(&self.boot_id, &live.boot_id)
            && agree(&self.pid_ns, &live.pid_ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(pid: u32, host: &str, pid_ns: Option<u64>) -> RankLive {
        let raw = serde_json::json!({"v": 1, "group": "g", "rank": 0, "group_size": 1, "pid": pid, "host": host,
            "boot_id": "b", "pid_ns": pid_ns});
        RankLive::parse(raw.to_string().as_bytes()).unwrap()
    }

    #[test]
    fn a_record_is_named_only_by_the_same_pid_host_boot_and_pid_namespace() {
        let me = Identity {
            host: Some("vm".into()),
            boot_id: Some("b".into()),
            pid_ns: Some(7),
        };
        assert!(me.names(&live(42, "vm", Some(7)), 42));
        assert!(me.names(&live(42, "vm", None), 42)); // an older agent without pid_ns
        assert!(!me.names(&live(42, "vm", Some(7)), 43));
        assert!(!me.names(&live(42, "other", Some(7)), 42));
        // The same number in a container's own pid namespace is another process.
        assert!(!me.names(&live(42, "vm", Some(8)), 42));
    }
}
