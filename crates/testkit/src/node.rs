//! A `rootrank node-watch` process, and reads of the live records and down certificates it
//! and `rootrank run` write.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rootrank_store::etcd_client::{Client, GetOptions};

use crate::harness::{eventually, kill_child};
use crate::rootrank_bin;

/// A `rootrank node-watch` process with its log in a file.
pub struct NodeWatch {
    child: Option<Child>,
    extra: Vec<String>,
    log: PathBuf,
    endpoint: String,
    _dir: tempfile::TempDir,
}

impl NodeWatch {
    pub fn start(endpoint: &str) -> anyhow::Result<NodeWatch> {
        Self::start_with(endpoint, &[])
    }

    /// With more flags. `ROOTRANK_TEST_HOST_LEASE_TTL_MS` set (as `make test` does for a
    /// second run of the node-watch tests) adds `--host-lease-ttl-ms` with it, unless the
    /// test gives one itself: every node-watch test then runs with the ranks on the host lease.
    pub fn start_with(endpoint: &str, extra: &[&str]) -> anyhow::Result<NodeWatch> {
        let dir = tempfile::tempdir()?;
        let mut extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        if let Some(ttl) = host_lease_mode() {
            if !extra.iter().any(|a| a == "--host-lease-ttl-ms") {
                extra.extend(["--host-lease-ttl-ms".to_string(), ttl.to_string()]);
            }
        }
        let mut w = NodeWatch {
            child: None,
            extra,
            log: dir.path().join("node-watch.log"),
            endpoint: endpoint.to_string(),
            _dir: dir,
        };
        w.spawn()?;
        Ok(w)
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log)?;
        let child = Command::new(rootrank_bin())
            .args(["node-watch", "--etcd-endpoints", &self.endpoint])
            .args(&self.extra)
            .env("ROOTRANK_LOG", "info,rootrank_node=debug")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.child = Some(child);
        Ok(())
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the watchdog says it watches `group/rank` with this pid.
    pub async fn wait_watching(&self, group: &str, rank: u32, pid: u32) -> anyhow::Result<()> {
        let needle = format!("watching {group}/{rank} pid {pid} ");
        eventually(
            Duration::from_secs(20),
            &format!("node-watch watching {needle}"),
            || {
                let found = self.log_text().contains(&needle);
                async move { found.then_some(()) }
            },
        )
        .await
        .map_err(|e| anyhow::anyhow!("{e}; node-watch log:\n{}", self.log_text()))
    }

    /// SIGKILL, so it cannot tidy anything up.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            kill_child(&mut c);
        }
    }

    /// Killed and started again, with an emptied log.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill9();
        std::fs::write(&self.log, "")?;
        self.spawn()
    }
}

impl Drop for NodeWatch {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The host lease TTL every node-watch of this test run holds (`ROOTRANK_TEST_HOST_LEASE_TTL_MS`),
/// or `None`: each rank keeps its own lease.
pub fn host_lease_mode() -> Option<u64> {
    std::env::var("ROOTRANK_TEST_HOST_LEASE_TTL_MS").ok()?.parse().ok()
}

pub async fn client(endpoint: &str) -> anyhow::Result<Client> {
    Ok(rootrank_store::connect(&rootrank_store::EtcdAccess::plain(vec![endpoint.to_string()])).await?)
}

/// One stored key: its value as JSON and how many times it was written.
#[derive(Debug, Clone)]
pub struct Stored {
    pub key: String,
    pub value: serde_json::Value,
    pub version: i64,
}

fn stored(kvs: &[rootrank_store::etcd_client::KeyValue]) -> Vec<Stored> {
    kvs.iter()
        .map(|kv| Stored {
            key: String::from_utf8_lossy(kv.key()).into_owned(),
            value: serde_json::from_slice(kv.value()).unwrap_or(serde_json::Value::Null),
            version: kv.version(),
        })
        .collect()
}

/// Every key under `prefix`.
pub async fn list(endpoint: &str, prefix: &str) -> anyhow::Result<Vec<Stored>> {
    let mut c = client(endpoint).await?;
    let resp = c.get(prefix, Some(GetOptions::new().with_prefix())).await?;
    Ok(stored(resp.kvs()))
}

pub fn down_prefix(group: &str, rank: u32) -> String {
    format!("/rootrank/v1/groups/{group}/ranks/{rank}/down/")
}

pub fn live_key(group: &str, rank: u32) -> String {
    format!("/rootrank/v1/groups/{group}/ranks/{rank}/live")
}

/// Registers a rank by hand the way its agent does: `record` (a `RankLive`) at its live key
/// and at its host's copy (`rootrank_core::Keys::host_copy`, what a node-watch watches), in
/// one transaction on `lease`.
pub async fn register_by_hand(
    c: &mut rootrank_store::etcd_client::Client,
    group: &str,
    rank: u32,
    record: &serde_json::Value,
    lease: i64,
) -> anyhow::Result<()> {
    use rootrank_store::etcd_client::{PutOptions, Txn, TxnOp};
    let host = record["host"]
        .as_str()
        .ok_or_else(|| anyhow::anyhow!("the record names no host: {record}"))?;
    let value = record.to_string();
    let opts = Some(PutOptions::new().with_lease(lease));
    let copy = format!("/rootrank/v1/groups/_hosts/{host}/{group}/{rank}/live");
    c.txn(Txn::new().and_then([
        TxnOp::put(live_key(group, rank), value.clone(), opts.clone()),
        TxnOp::put(copy, value, opts),
    ]))
    .await?;
    Ok(())
}

/// Waits for the certificate of one incarnation.
pub async fn wait_certificate(endpoint: &str, group: &str, rank: u32, incarnation: &str) -> anyhow::Result<Stored> {
    let key = format!("{}{incarnation}", down_prefix(group, rank));
    eventually(Duration::from_secs(30), &format!("certificate {key}"), || {
        let key = key.clone();
        async move {
            list(endpoint, &key)
                .await
                .ok()
                .and_then(|v| v.into_iter().find(|s| s.key == key))
        }
    })
    .await
}

/// Every down certificate of `group/rank`, counted behind a revision barrier: waits for the
/// first one, then writes a marker key (outside the `/rootrank/v1/` keyspace, so no rootrank
/// process reacts to it) and reads the certificates as of the marker's revision. Every write
/// etcd applied before the marker is in that count, so a duplicate certificate written at
/// about the same time as the first one is not missed by counting at the moment the first
/// appeared.
pub async fn certificates_after_barrier(endpoint: &str, group: &str, rank: u32) -> anyhow::Result<Vec<Stored>> {
    let prefix = down_prefix(group, rank);
    eventually(
        Duration::from_secs(30),
        &format!("a certificate under {prefix}"),
        || async { list(endpoint, &prefix).await.ok().filter(|v| !v.is_empty()) },
    )
    .await?;
    let mut c = client(endpoint).await?;
    let marker = format!("/rootrank-test/barrier/{group}/{rank}");
    let put = c.put(marker.as_str(), "", None).await?;
    let revision = put
        .header()
        .map(|h| h.revision())
        .ok_or_else(|| anyhow::anyhow!("etcd put answered without a header"))?;
    let at = |opts: GetOptions| opts.with_revision(revision);
    let seen = c.get(marker.as_str(), Some(at(GetOptions::new()))).await?;
    anyhow::ensure!(
        seen.kvs().len() == 1,
        "the barrier key is not visible at its own revision {revision}"
    );
    let resp = c
        .get(prefix.as_str(), Some(at(GetOptions::new().with_prefix())))
        .await?;
    Ok(stored(resp.kvs()))
}
