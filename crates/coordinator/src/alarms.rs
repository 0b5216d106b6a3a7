//! v4: etcd's own faults, named. etcd raises an alarm when its database reaches
//! `--quota-backend-bytes` (`NOSPACE`: it then refuses every write, so certificates for
//! vanished keys cannot be persisted and a restarted replica would answer differently) or
//! finds its data corrupt (`CORRUPT`). The watch still delivers, so nothing else would show
//! it: this task reads etcd's alarm list every [`EVERY`], and `/readyz` answers 503 naming the
//! alarm while one is raised, with `rootrank_etcd_alarm{alarm}` at 1.

use std::sync::Arc;
use std::time::Duration;

use rootrank_store::etcd_client::{AlarmAction, AlarmType, Client};
use tracing::{debug, error, info};

use crate::{CoordinatorConfig, Shared};

/// How often the alarm list is read: one small request, far below anything etcd notices.
pub const EVERY: Duration = Duration::from_secs(2);

/// The alarms etcd 3.4 can raise, as `rootrank_etcd_alarm`'s labels.
pub const KNOWN: [&str; 2] = ["NOSPACE", "CORRUPT"];

fn name(alarm: AlarmType) -> Option<&'static str> {
    match alarm {
        AlarmType::Nospace => Some("NOSPACE"),
        AlarmType::Corrupt => Some("CORRUPT"),
        AlarmType::None => None,
    }
}

/// What `/readyz` says of an alarm: what it means here and what an operator does.
pub fn explain(alarm: &str) -> String {
    match alarm {
        "NOSPACE" => "etcd alarm NOSPACE: etcd database space exceeded, so etcd refuses every write (certificates of deaths are not persisted); compact and defragment etcd or raise --quota-backend-bytes, then `etcdctl alarm disarm`".into(),
        other => format!("etcd alarm {other}: see `etcdctl alarm list` and etcd's log"),
    }
}

pub async fn run(config: CoordinatorConfig, shared: Arc<Shared>) {
    let mut client: Option<Client> = None;
    loop {
        if client.is_none() {
            client = rootrank_store::connect(&config.etcd).await.ok();
        }
        if let Some(c) = client.as_mut() {
            let asked = tokio::time::timeout(
                rootrank_store::REQUEST_TIMEOUT,
                c.alarm(AlarmAction::Get, AlarmType::None, None),
            )
            .await;
            match asked {
                Ok(Ok(resp)) => {
                    let mut raised: Vec<&'static str> = resp.alarms().iter().filter_map(|m| name(m.alarm())).collect();
                    raised.sort_unstable();
                    raised.dedup();
                    publish(&shared, raised);
                }
                // An outage is the watch's to report; the alarms keep their last state.
                Ok(Err(e)) => {
                    debug!(error = %e, "cannot read etcd's alarms; retrying");
                    client = None;
                }
                Err(_) => debug!("reading etcd's alarms timed out; retrying"),
            }
        }
        tokio::time::sleep(EVERY).await;
    }
}

fn publish(shared: &Shared, raised: Vec<&'static str>) {
    let Ok(mut now) = shared.etcd_alarms.lock() else { return };
    if *now == raised {
        return;
    }
    for a in KNOWN {
        shared
            .metrics
            .etcd_alarm
            .with_label_values(&[a])
            .set(i64::from(raised.contains(&a)));
    }
    for a in raised.iter().filter(|a| !now.contains(a)) {
        error!(alarm = a, "{}", explain(a));
    }
    for a in now.iter().filter(|a| !raised.contains(a)) {
        info!(alarm = a, "etcd alarm disarmed");
    }
    *now = raised;
}
