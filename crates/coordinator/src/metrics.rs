//! The metrics of SPEC section 8. No room id ever becomes a label: rooms are unbounded.

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

use rootrank_core::Index;

use crate::series::Series;

pub struct Metrics {
    registry: Registry,
    // Families labelled by group (and rank) are `Series`: prometheus' own vectors merge
    // label sets such as ("prefill-1", "10") and ("prefill-11", "0") (see series.rs).
    pub root_causes: Series,
    pub verdicts: IntCounterVec,
    pub failure_records: Series,
    pub invalid_records: IntCounterVec,
    pub rank_up: Series,
    pub index_rooms: IntGauge,
    pub resolution_seconds: Histogram,
    pub watch_restarts: IntCounter,
    pub http_duration: HistogramVec,
    pub http_connections: IntGauge,
    pub http_connections_refused: IntCounter,

    pub rank_stalled: Series,
    pub events_readers: IntGauge,
    /// v4: 1 while etcd raises the alarm (`NOSPACE`, `CORRUPT`), else 0.
    pub etcd_alarm: IntGaugeVec,
    /// One scrape at a time refills and gathers the index-derived gauges: two Prometheus
    /// servers scraping at once would otherwise see each other's reset (partial series).
    render_lock: std::sync::Mutex<()>,
}

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let root_causes = Series::counter(
            "rootrank_root_causes_total",
            "Rooms resolved, by the rank that really failed them and why",
            &["group", "rank", "reason", "source"],
        )?;
        let verdicts = IntCounterVec::new(
            Opts::new("rootrank_verdicts_total", "Verdicts served, by status"),
            &["status"],
        )?;
        let failure_records = Series::counter(
            "rootrank_failure_records_total",
            "Room failure records indexed, by group and origin",
            &["group", "origin"],
        )?;
        let invalid_records = IntCounterVec::new(
            Opts::new(
                "rootrank_invalid_records_total",
                "Malformed values found in etcd and skipped, by kind",
            ),
            &["kind"],
        )?;
        let rank_up = Series::gauge(
            "rootrank_rank_up",
            "1 while the rank's live key exists and it is not certified down",
            &["group", "rank"],
        )?;
        let index_rooms = IntGauge::new("rootrank_index_rooms", "Rooms held in the coordinator's index")?;
        let resolution_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "rootrank_resolution_seconds",
                "From a room's first record to its verdict resolving",
            )
            .buckets(vec![
                0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0,
            ]),
        )?;
        let watch_restarts = IntCounter::new(
            "rootrank_etcd_watch_restarts_total",
            "etcd watches re-created after an error, disconnect or compaction",
        )?;
        let http_duration = HistogramVec::new(
            HistogramOpts::new(
                "rootrank_http_request_duration_seconds",
                "HTTP request latency, by route and status",
            )
            .buckets(vec![
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0,
            ]),
            &["route", "status"],
        )?;
        let http_connections = IntGauge::new("rootrank_http_connections", "HTTP connections open now")?;
        let http_connections_refused = IntCounter::new(
            "rootrank_http_connections_refused_total",
            "HTTP connections closed on arrival because --max-connections were open",
        )?;
        let rank_stalled = Series::gauge(
            "rootrank_rank_stalled",
            "1 while a live rank's loop is not advancing (its RankStall record exists), else 0",
            &["group", "rank"],
        )?;
        let events_readers = IntGauge::new("rootrank_events_readers", "Clients following GET /v1/events now")?;
        let etcd_alarm = IntGaugeVec::new(
            Opts::new(
                "rootrank_etcd_alarm",
                "1 while etcd raises this alarm (NOSPACE: its database is full and it refuses writes), else 0",
            ),
            &["alarm"],
        )?;
        for a in crate::alarms::KNOWN {
            etcd_alarm.with_label_values(&[a]);
        }
        registry.register(Box::new(etcd_alarm.clone()))?;
        registry.register(Box::new(rank_stalled.clone()))?;
        registry.register(Box::new(events_readers.clone()))?;
        registry.register(Box::new(http_connections.clone()))?;
        registry.register(Box::new(http_connections_refused.clone()))?;
        registry.register(Box::new(root_causes.clone()))?;
        registry.register(Box::new(verdicts.clone()))?;
        registry.register(Box::new(failure_records.clone()))?;
        registry.register(Box::new(invalid_records.clone()))?;
        registry.register(Box::new(rank_up.clone()))?;
        registry.register(Box::new(index_rooms.clone()))?;
        registry.register(Box::new(resolution_seconds.clone()))?;
        registry.register(Box::new(watch_restarts.clone()))?;
        registry.register(Box::new(http_duration.clone()))?;
        // Every status appears from the start, so dashboards see zeros rather than gaps.
        for s in ["resolved", "pending", "unknown"] {
            verdicts.with_label_values(&[s]);
        }
        for k in ["key", "live", "down", "room", "stall", "overwrite"] {
            invalid_records.with_label_values(&[k]);
        }
        Ok(Metrics {
            registry,
            root_causes,
            verdicts,
            failure_records,
            invalid_records,
            rank_up,
            index_rooms,
            resolution_seconds,
            watch_restarts,
            http_duration,
            http_connections,
            http_connections_refused,
            etcd_alarm,
            rank_stalled,
            events_readers,
            render_lock: std::sync::Mutex::new(()),
        })
    }

    /// Drops every series labelled with one of `groups` (their counters): the index forgot
    /// them. One pass over the series for a whole batch of groups.
    pub fn forget_groups(&self, groups: &std::collections::HashSet<&str>) {
        if groups.is_empty() {
            return;
        }
        for series in [&self.root_causes, &self.failure_records] {
            series.retain(|labels| labels.first().is_none_or(|g| !groups.contains(g.as_str())));
        }
    }

    /// Renders the text exposition; gauges derived from the index are refreshed first.
    pub fn render(&self, index: &Index) -> String {
        // A poisoned lock only means a scrape panicked: the gauges are refilled below anyway.
        let _one_scrape = self.render_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.rank_up.replace(
            index
                .rank_liveness()
                .into_iter()
                .map(|(g, r, up)| (vec![g.as_str().to_string(), r.to_string()], f64::from(u8::from(up)))),
        );
        self.rank_stalled
            .replace(index.rank_stalls().into_iter().map(|(g, r, stalled)| {
                (
                    vec![g.as_str().to_string(), r.to_string()],
                    f64::from(u8::from(stalled)),
                )
            }));
        self.index_rooms.set(index.room_count() as i64);
        let mut buf = Vec::new();
        if TextEncoder::new().encode(&self.registry.gather(), &mut buf).is_err() {
            return String::new();
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rootrank_core::{Event, IndexConfig};

    fn index_with_ranks(n: u32) -> Index {
        let mut index = Index::new(IndexConfig::default());
        for rank in 0..n {
            let value = serde_json::json!({
                "v": 1, "group": "g", "rank": rank, "group_size": n, "host": "h", "pid": 1000 + rank,
                "lease_ttl_ms": 5000, "started_at": "2026-01-01T00:00:00.000Z", "agent": "rootrank-agent/0.1.0"
            });
            index.apply(Event::Put {
                key: format!("/rootrank/v1/groups/g/ranks/{rank}/live").into_bytes(),
                value: value.to_string().into_bytes(),
                lease: i64::from(100 + rank),
                revision: i64::from(rank) + 2,
                create_revision: i64::from(rank) + 2,
                observed_at_ms: 0,
            });
        }
        index
    }

    #[test]
    fn a_forgotten_group_takes_its_series_along() {
        let metrics = Metrics::new().unwrap();
        for g in ["a-0", "b-0"] {
            metrics.failure_records.inc(&[g, "local"]);
            metrics.root_causes.inc(&[g, "1", "nixl_error", "room_record"]);
        }
        metrics.forget_groups(&["a-0"].into_iter().collect());
        let text = metrics.render(&Index::new(IndexConfig::default()));
        assert!(!text.contains("group=\"a-0\""), "{text}");
        assert_eq!(text.matches("group=\"b-0\"").count(), 2, "{text}");
    }

    /// `prefill-1` rank 10 and `prefill-11` rank 0 (TP 16 and group names ending in a number)
    /// are two series, each with its own value: prometheus' vectors merged them.
    #[test]
    fn every_rank_of_groups_whose_names_run_into_their_ranks_has_its_series() {
        let mut index = Index::new(IndexConfig::default());
        let mut revision = 2;
        for group in ["prefill-1", "prefill-11"] {
            for rank in 0..16u32 {
                let value = serde_json::json!({
                    "v": 1, "group": group, "rank": rank, "group_size": 16, "host": "h", "pid": 1000 + rank,
                    "lease_ttl_ms": 5000, "started_at": "2026-01-01T00:00:00.000Z", "agent": "rootrank-agent/0.1.0"
                });
                index.apply(Event::Put {
                    key: format!("/rootrank/v1/groups/{group}/ranks/{rank}/live").into_bytes(),
                    value: value.to_string().into_bytes(),
                    lease: 100 + revision,
                    revision,
                    create_revision: revision,
                    observed_at_ms: 0,
                });
                revision += 1;
            }
        }
        let metrics = Metrics::new().unwrap();
        let text = metrics.render(&index);
        assert_eq!(text.matches("rootrank_rank_up{").count(), 32, "{text}");
        assert!(
            text.contains("rootrank_rank_up{group=\"prefill-11\",rank=\"0\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("rootrank_rank_up{group=\"prefill-1\",rank=\"10\"} 1\n"),
            "{text}"
        );
    }

    /// Two Prometheus servers scraping one replica at once: each scrape sees every series
    /// (without the render lock one scrape's reset lands between another's refill and gather).
    #[test]
    fn concurrent_scrapes_each_see_every_series() {
        let metrics = std::sync::Arc::new(Metrics::new().unwrap());
        let index = std::sync::Arc::new(index_with_ranks(64));
        assert_eq!(metrics.render(&index).matches("rootrank_rank_up{").count(), 64);
        let scrapers: Vec<_> = (0..4)
            .map(|_| {
                let (metrics, index) = (metrics.clone(), index.clone());
                std::thread::spawn(move || {
                    (0..200)
                        .map(|_| metrics.render(&index).matches("rootrank_rank_up{").count())
                        .filter(|n| *n != 64)
                        .count()
                })
            })
            .collect();
        let partial: usize = scrapers.into_iter().map(|t| t.join().unwrap()).sum();
        assert_eq!(partial, 0, "scrapes saw partial rank_up series");
    }
}
