//! Metric families keyed by their whole label tuples.
//!
//! prometheus 0.14's vectors (`IntGaugeVec`, `IntCounterVec`) find a child by a hash of its
//! label values written one after the other with no separator (`MetricVecCore::
//! hash_label_values`), so `{group="prefill-1",rank="10"}` and `{group="prefill-11",rank="0"}`
//! are one child there: the second label set updates the first's series and never appears
//! itself. With TP 16 and group names that end in a number (SGLang's `...-dp1`, `...-dp11`)
//! that hides ranks from `rootrank_rank_up`, and so from the dead-rank alert. Families whose
//! labels are a group and a rank use this instead: a map from the label values themselves.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

use prometheus::core::{Collector, Desc};
use prometheus::proto::{self, MetricFamily, MetricType};

/// One family: label values -> value. Cloning shares it (register one clone, update another).
#[derive(Clone)]
pub struct Series(Arc<Inner>);

struct Inner {
    desc: Desc,
    kind: MetricType,
    labels: Vec<String>,
    values: Mutex<BTreeMap<Vec<String>, f64>>,
}

impl Series {
    pub fn gauge(name: &str, help: &str, labels: &[&str]) -> Result<Series, prometheus::Error> {
        Series::new(name, help, labels, MetricType::GAUGE)
    }

    pub fn counter(name: &str, help: &str, labels: &[&str]) -> Result<Series, prometheus::Error> {
        Series::new(name, help, labels, MetricType::COUNTER)
    }

    fn new(name: &str, help: &str, labels: &[&str], kind: MetricType) -> Result<Series, prometheus::Error> {
        let labels: Vec<String> = labels.iter().map(|l| l.to_string()).collect();
        let desc = Desc::new(name.into(), help.into(), labels.clone(), HashMap::new())?;
        Ok(Series(Arc::new(Inner {
            desc,
            kind,
            labels,
            values: Mutex::new(BTreeMap::new()),
        })))
    }

    fn values(&self) -> std::sync::MutexGuard<'_, BTreeMap<Vec<String>, f64>> {
        // A poisoned lock only means an update panicked between two plain map operations.
        self.0.values.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds one to the series of `labels` (one value per label, in the family's order).
    pub fn inc(&self, labels: &[&str]) {
        *self
            .values()
            .entry(labels.iter().map(|l| l.to_string()).collect())
            .or_insert(0.0) += 1.0;
    }

    /// Replaces every series with `series` (a gauge refilled from the index at each scrape).
    pub fn replace(&self, series: impl IntoIterator<Item = (Vec<String>, f64)>) {
        let fresh: BTreeMap<Vec<String>, f64> = series.into_iter().collect();
        *self.values() = fresh;
    }

    /// Keeps the series whose label values `keep` accepts.
    pub fn retain(&self, mut keep: impl FnMut(&[String]) -> bool) {
        self.values().retain(|labels, _| keep(labels));
    }
}

impl Collector for Series {
    fn desc(&self) -> Vec<&Desc> {
        vec![&self.0.desc]
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let mut family = MetricFamily::default();
        family.set_name(self.0.desc.fq_name.clone());
        family.set_help(self.0.desc.help.clone());
        family.set_field_type(self.0.kind);
        for (values, v) in self.values().iter() {
            let pairs: Vec<proto::LabelPair> = self
                .0
                .labels
                .iter()
                .zip(values)
                .map(|(name, value)| {
                    let mut pair = proto::LabelPair::default();
                    pair.set_name(name.clone());
                    pair.set_value(value.clone());
                    pair
                })
                .collect();
            let mut metric = proto::Metric::from_label(pairs);
            if self.0.kind == MetricType::COUNTER {
                let mut c = proto::Counter::default();
                c.set_value(*v);
                metric.set_counter(c);
            } else {
                let mut g = proto::Gauge::default();
                g.set_value(*v);
                metric.set_gauge(g);
            }
            family.mut_metric().push(metric);
        }
        vec![family]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The collision prometheus 0.14's vectors have: both series are served, each its own.
    #[test]
    fn label_values_that_concatenate_alike_stay_two_series() {
        let vec = prometheus::IntGaugeVec::new(prometheus::Opts::new("v", "h"), &["group", "rank"]).unwrap();
        vec.with_label_values(&["prefill-1", "10"]).set(1);
        vec.with_label_values(&["prefill-11", "0"]).set(0);
        assert_eq!(vec.collect()[0].get_metric().len(), 1, "prometheus' vector merges them");

        let s = Series::gauge("rootrank_rank_up", "h", &["group", "rank"]).unwrap();
        s.replace([
            (vec!["prefill-1".into(), "10".into()], 1.0),
            (vec!["prefill-11".into(), "0".into()], 0.0),
        ]);
        let registry = prometheus::Registry::new();
        registry.register(Box::new(s.clone())).unwrap();
        let mut buf = Vec::new();
        prometheus::Encoder::encode(&prometheus::TextEncoder::new(), &registry.gather(), &mut buf).unwrap();
        let text = String::from_utf8(buf).unwrap();
        assert!(
            text.contains("rootrank_rank_up{group=\"prefill-1\",rank=\"10\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("rootrank_rank_up{group=\"prefill-11\",rank=\"0\"} 0\n"),
            "{text}"
        );
        assert!(text.contains("# TYPE rootrank_rank_up gauge\n"), "{text}");
    }

    #[test]
    fn counters_count_and_forget() {
        let s = Series::counter("c_total", "h", &["group", "rank"]).unwrap();
        s.inc(&["g-1", "10"]);
        s.inc(&["g-11", "0"]);
        s.inc(&["g-11", "0"]);
        let f = &s.collect()[0];
        assert_eq!(f.get_field_type(), MetricType::COUNTER);
        let values: Vec<f64> = f.get_metric().iter().map(|m| m.get_counter().get_value()).collect();
        assert_eq!(values, [1.0, 2.0]);
        s.retain(|l| l[0] != "g-11");
        assert_eq!(s.collect()[0].get_metric().len(), 1);
    }
}
