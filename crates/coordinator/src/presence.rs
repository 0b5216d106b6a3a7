//! `{p}/coordinators/{id}`: each replica announces itself on a lease of its own, so operators
//! (and `etcdctl get --prefix`) see which coordinators serve. Replicas need no leader: the
//! only thing they write besides this (lease_expired certificates) is create-if-absent.

use std::time::Duration;

use rootrank_core::Keys;
use rootrank_store::etcd_client::PutOptions;
use rootrank_store::Backoff;
use tracing::debug;

use crate::CoordinatorConfig;

const TTL_S: i64 = 10;

pub async fn run(config: CoordinatorConfig, listen: std::net::SocketAddr) {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .trim()
        .to_string();
    let id = format!(
        "{}-{}-{}",
        if host.is_empty() { "host" } else { &host },
        std::process::id(),
        listen.port()
    );
    let key = format!("{}{id}", Keys::new(&config.index.prefix).coordinators());
    let value = serde_json::json!({
        "v": 1, "id": id, "host": host, "pid": std::process::id(), "listen": listen.to_string(),
        "started_at": rootrank_core::time::format_ms(rootrank_store::unix_ms()),
        "version": env!("CARGO_PKG_VERSION"),
    })
    .to_string();
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    loop {
        let attempt = async {
            let mut client = rootrank_store::connect(&config.etcd).await.map_err(|e| e.to_string())?;
            let lease = client.lease_grant(TTL_S, None).await.map_err(|e| e.to_string())?.id();
            client
                .put(key.clone(), value.clone(), Some(PutOptions::new().with_lease(lease)))
                .await
                .map_err(|e| e.to_string())?;
            let (mut keeper, mut stream) = client.lease_keep_alive(lease).await.map_err(|e| e.to_string())?;
            loop {
                tokio::time::sleep(Duration::from_secs(3)).await;
                keeper.keep_alive().await.map_err(|e| e.to_string())?;
                match stream.message().await {
                    Ok(Some(r)) if r.ttl() > 0 => {}
                    other => return Err::<(), String>(format!("presence lease lost: {other:?}")),
                }
            }
        };
        if let Err(e) = attempt.await {
            debug!(error = %e, "coordinator presence: retrying");
        }
        tokio::time::sleep(backoff.next_pause()).await;
    }
}
