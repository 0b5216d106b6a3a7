//! A stalled rank's Python stack (SPEC v3 `RankStall.stack`), read by node-watch with py-spy.
//!
//! Why py-spy: it reads a live CPython process's frames from outside (process_vm_readv, the
//! interpreter's own structures, every version SGLang runs on), including a thread that holds
//! the GIL in a C call, which no in-process hook can; it is maintained, ships as a static
//! binary wheel on PyPI, and `py-spy dump` pauses the process only for the read (~40 ms here).
//! Writing a frame walker of our own would mean tracking CPython's internals per version.
//!
//! The stack is added to the same stall record (a transaction on its create revision, same
//! lease), so it neither outlives the stall nor moves the record's place in the group's
//! order of stalls.

use std::path::PathBuf;
use std::time::Duration;

use rootrank_core::records::clamp_stack;
use rootrank_store::etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use tracing::{debug, info, warn};

use crate::sync::StallKv;

/// How long py-spy may take before the stack is given up.
pub const DUMP_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs `py-spy dump --pid PID` and returns its lines.
pub async fn dump(py_spy: &std::path::Path, pid: u32) -> Result<Vec<String>, String> {
    let child = tokio::process::Command::new(py_spy)
        .args(["dump", "--pid", &pid.to_string()])
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(DUMP_TIMEOUT, child).await {
        Err(_) => Err(format!("py-spy took over {DUMP_TIMEOUT:?}")),
        Ok(Err(e)) => Err(format!("cannot run {}: {e}", py_spy.display())),
        Ok(Ok(out)) if !out.status.success() => Err(format!(
            "py-spy exited {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Ok(Ok(out)) => {
            let mut lines = busy_threads_first(&String::from_utf8_lossy(&out.stdout));
            clamp_stack(&mut lines);
            Ok(lines)
        }
    }
}

/// py-spy's dump with the main thread first (the scheduler loop: py-spy calls it `idle` when
/// it is stuck in a C call), then the threads doing something, then the idle ones, so the
/// lines kept in the record are the ones that matter: a real SGLang scheduler has a dozen
/// idle helper threads.
pub fn busy_threads_first(dump: &str) -> Vec<String> {
    let mut head = Vec::new();
    let mut threads: Vec<Vec<String>> = Vec::new();
    for line in dump.lines().filter(|l| !l.trim().is_empty()) {
        if line.starts_with("Thread ") {
            threads.push(vec![line.to_string()]);
        } else if let Some(t) = threads.last_mut() {
            t.push(line.to_string());
        } else {
            head.push(line.to_string());
        }
    }
    // Stable: py-spy's own order within each rank.
    threads.sort_by_key(|t| {
        let h = &t[0];
        (!h.contains("\"MainThread\""), h.contains("(idle)"))
    });
    head.into_iter().chain(threads.into_iter().flatten()).collect()
}

/// Reads the stack of `pid` (the stalled rank, in node-watch's pid namespace) and adds it to
/// its stall record, if that record is still the same stall.
pub(crate) async fn attach(py_spy: PathBuf, pid: u32, stall: StallKv, etcd: rootrank_store::EtcdAccess) {
    let group = stall.record.group.clone();
    let rank = stall.record.rank;
    let stack = match dump(&py_spy, pid).await {
        Ok(s) if !s.is_empty() => s,
        Ok(_) => return,
        Err(e) => {
            warn!(%group, rank, pid, error = %e, "could not read the stalled rank's stack");
            return;
        }
    };
    let mut record = stall.record;
    record.stack = Some(stack);
    let Ok(value) = serde_json::to_vec(&record) else { return };
    let mut client = match rootrank_store::connect(&etcd).await {
        Ok(c) => c,
        Err(e) => {
            warn!(%group, rank, error = %e, "cannot reach etcd to add the stalled rank's stack");
            return;
        }
    };
    let txn = Txn::new()
        .when([Compare::create_revision(
            stall.key.clone(),
            CompareOp::Equal,
            stall.create_revision,
        )])
        .and_then([TxnOp::put(
            stall.key,
            value,
            Some(PutOptions::new().with_lease(stall.lease)),
        )]);
    match tokio::time::timeout(rootrank_store::REQUEST_TIMEOUT, client.txn(txn)).await {
        Ok(Ok(r)) if r.succeeded() => info!(%group, rank, pid, "added the stalled rank's stack to its stall record"),
        Ok(Ok(_)) => debug!(%group, rank, "the stall ended before its stack was read"),
        other => warn!(%group, rank, ?other, "could not add the stalled rank's stack"),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn busy_and_main_threads_come_first() {
        let dump = "Process 1: python\nPython v3.11.7\n\nThread 2 (idle): \"worker\"\n    get (q.py:1)\nThread 3 (active): \"other\"\n    run (o.py:2)\nThread 1 (active): \"MainThread\"\n    sleep (m.py:3)\n";
        assert_eq!(
            super::busy_threads_first(dump),
            vec![
                "Process 1: python",
                "Python v3.11.7",
                "Thread 1 (active): \"MainThread\"",
                "    sleep (m.py:3)",
                "Thread 3 (active): \"other\"",
                "    run (o.py:2)",
                "Thread 2 (idle): \"worker\"",
                "    get (q.py:1)",
            ]
        );
    }
}
