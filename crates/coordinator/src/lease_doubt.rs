//! When to certify a vanished live key, and as what (SPEC v4, section 5's `lease_lost`).
//!
//! A live key vanishes when its lease runs out. Usually its process died; but when etcd itself
//! stalled for longer than the TTL (SIGSTOPped, a disk that blocks its fsync), every lease
//! runs out at once on resume, though no rank stopped. This coordinator knows when that can
//! be: it saw etcd silent. Then it does not certify a vanished key at once: it holds it for
//! the rank's TTL plus the time an agent takes to notice and re-register, and certifies it
//! `lease_lost` (cause: etcd) if the same process (same host, boot id and pid) registered
//! again meanwhile, `lease_expired` otherwise. A verdict names no uncertified death (the core
//! waits for the certificate), so holding it delays a verdict, and never changes one.
//!
//! A key that rode on its host's lease (v5) vanishes alike when the host died and when only
//! its node-watch stopped: it is always held. With etcd heard throughout, [`HOST_GONE_MS`]:
//! a living agent's own watch sees the vanish with ours and it registers again in
//! milliseconds. Once one process is seen back from such a vanish, a node-watch stopped
//! while its ranks lived (perhaps a fleet's, whose registrations queue up), and every key of
//! a host lease is held its full TTL + [`REREGISTER_MS`] for that long again.
//!
//! A sans-IO state machine: the shell (`sync.rs`) reports the watch going stale and current,
//! passes each vanished key, asks [`LeaseDoubt::poll_timeout`] for its next deadline and calls
//! [`LeaseDoubt::settle`] then and after each batch of events, with the index's answer to "did
//! that process register again?".

use rootrank_core::ids::reasons;
use rootrank_core::{GroupId, Incarnation, LivedOn, Output, Rank, RankDown, Reason};

/// How long after the watch is current again a vanished key is still in doubt: etcd revokes
/// the leases that ran out during the stall within a second or two of resuming (its lessor
/// checks every 500 ms); [`EXTEND_MS`] covers a mass expiry, which it revokes 1,000 a second.
pub const DOUBT_AFTER_RESUME_MS: i64 = 5_000;
/// Each vanished key held keeps the doubt open this much longer (a revocation burst goes on).
pub const EXTEND_MS: i64 = 2_000;
/// The doubt never lasts longer than this after the watch is current again.
pub const DOUBT_AT_MOST_MS: i64 = 60_000;
/// How long an agent may take, after its lease runs out, to register again: one keepalive
/// request's timeout (`rootrank_store::REQUEST_TIMEOUT`) and a second of backoff.
pub const REREGISTER_MS: i64 = 3_000;
/// How long a key that vanished from its host's lease is held when nothing says a node-watch
/// stopped while its ranks lived on: etcd was heard throughout, so a living agent, whose watch
/// on its own key fires with ours, has registered again within milliseconds (one grant, one
/// transaction). A host that died whole is then certified about TTL + 2 s after its death.
pub const HOST_GONE_MS: i64 = 2_000;

/// Whether a vanished key is held, and until when.
#[derive(Debug, Default)]
pub struct LeaseDoubt {
    /// The watch went stale at (monotonic ms): etcd silent, or cut off from us.
    stale_since: Option<i64>,
    /// How long the last silence lasted, for the certificate's detail.
    last_silence_ms: i64,
    /// Vanished keys applied before this are held (0: none).
    doubt_until: i64,
    /// The last moment the doubt may be extended to.
    doubt_cap: i64,
    /// Until then (monotonic ms), a node-watch is known to have stopped while its ranks lived
    /// on (one of them registered again after its key vanished from the host lease): a key
    /// that vanishes from a host lease is held its full TTL + [`REREGISTER_MS`], since other
    /// hosts' agents may be queueing their registrations behind that one (a fleet-wide
    /// node-watch outage loads etcd with them all).
    node_watch_stopped_until: i64,
    held: Vec<Held>,
}

#[derive(Debug)]
struct Held {
    vanished_at_ms: i64,
    /// The longest it is held: its TTL + [`REREGISTER_MS`].
    term_ms: i64,
    /// A key of a host lease that vanished with etcd heard throughout: held only
    /// [`HOST_GONE_MS`] unless a node-watch is known to have stopped.
    host_gone: bool,
    vanished: Output,
}

impl Held {
    fn vanished_on_host_lease(&self) -> bool {
        matches!(
            &self.vanished,
            Output::LiveKeyVanished {
                on_host_lease: true,
                ..
            }
        )
    }

    /// When this key's hold runs out, given whether a node-watch is known to have stopped.
    fn due(&self, node_watch_stopped: bool) -> i64 {
        let hold = if self.host_gone && !node_watch_stopped {
            HOST_GONE_MS
        } else {
            self.term_ms
        };
        self.vanished_at_ms.saturating_add(hold)
    }
}

impl LeaseDoubt {
    pub fn new() -> Self {
        Self::default()
    }

    /// The watch was lost (etcd silent for the follower's limit, or an error).
    pub fn stale(&mut self, now_ms: i64) {
        self.stale_since.get_or_insert(now_ms);
    }

    /// The watch is current again: vanished keys that arrive now may be leases etcd let run
    /// out while it was silent.
    pub fn current(&mut self, now_ms: i64) {
        if let Some(since) = self.stale_since.take() {
            self.last_silence_ms = now_ms.saturating_sub(since);
            self.doubt_until = now_ms.saturating_add(DOUBT_AFTER_RESUME_MS);
            self.doubt_cap = now_ms.saturating_add(DOUBT_AT_MOST_MS);
        }
    }

    /// Whether a vanished key seen now is in doubt.
    pub fn in_doubt(&self, now_ms: i64) -> bool {
        self.stale_since.is_some() || now_ms < self.doubt_until
    }

    /// A live key vanished (`Output::LiveKeyVanished`): `Some` to certify now, `None` when it
    /// is held until [`LeaseDoubt::settle`] releases it.
    pub fn vanished(&mut self, vanished: Output, now_ms: i64) -> Option<Output> {
        let Output::LiveKeyVanished {
            lease_ttl_ms,
            on_host_lease,
            ..
        } = &vanished
        else {
            return Some(vanished);
        };
        // A key on its host's lease (v5) vanishes the same way when the host died and when
        // only its node-watch stopped (the ranks then register again on their own leases):
        // always held, and only the etcd doubt opens the window below.
        let host_lease = *on_host_lease;
        let in_doubt = self.in_doubt(now_ms);
        if !host_lease && !in_doubt {
            return Some(vanished);
        }
        let ttl = lease_ttl_ms.map_or(0, |t| i64::try_from(t).unwrap_or(i64::MAX));
        if !host_lease && self.stale_since.is_none() {
            self.doubt_until = self
                .doubt_until
                .max(now_ms.saturating_add(EXTEND_MS))
                .min(self.doubt_cap);
        }
        self.held.push(Held {
            vanished_at_ms: now_ms,
            term_ms: ttl.saturating_add(REREGISTER_MS),
            // With etcd heard throughout, a living agent has registered again long before
            // HOST_GONE_MS; after a silence it may itself be retrying: the full term applies.
            host_gone: host_lease && !in_doubt,
            vanished,
        });
        None
    }

    /// How many vanished keys are held.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// The next moment [`LeaseDoubt::settle`] has something to do.
    pub fn poll_timeout(&self) -> Option<i64> {
        let stopped = self.node_watch_stopped_until > 0;
        let held = self.held.iter().map(|h| h.due(stopped)).min()?;
        // When the known stop ends, the shorter holds may be due at once.
        Some(if stopped {
            held.min(self.node_watch_stopped_until)
        } else {
            held
        })
    }

    /// The certificates to write now: `lease_lost` for each held key whose process registered
    /// again (`lived_on` asks the index), `lease_expired` for each whose hold ran out.
    pub fn settle(
        &mut self,
        now_ms: i64,
        lived_on: impl Fn(&GroupId, Rank, Incarnation) -> Option<LivedOn>,
    ) -> Vec<RankDown> {
        let mut out = Vec::new();
        let silence_s = self.last_silence_ms as f64 / 1000.0;
        // Who registered again, asked once per held key, before any hold is judged: one
        // process back from a host lease's vanish means a node-watch stopped somewhere, and
        // holds every other key of a host lease to its full term.
        let again: Vec<Option<LivedOn>> = self
            .held
            .iter()
            .map(|h| match &h.vanished {
                Output::LiveKeyVanished {
                    group,
                    rank,
                    incarnation,
                    ..
                } => lived_on(group, *rank, *incarnation),
                _ => None,
            })
            .collect();
        for (h, a) in self.held.iter().zip(&again) {
            if a.is_some() && h.vanished_on_host_lease() {
                self.node_watch_stopped_until = self.node_watch_stopped_until.max(now_ms.saturating_add(h.term_ms));
            }
        }
        if self.node_watch_stopped_until <= now_ms {
            self.node_watch_stopped_until = 0;
        }
        let stopped = self.node_watch_stopped_until > 0;
        let mut again = again.into_iter();
        self.held.retain(|h| {
            let again = again.next().flatten();
            let Output::LiveKeyVanished { on_host_lease, .. } = &h.vanished else {
                return false;
            };
            if again.is_none() && now_ms < h.due(stopped) {
                return true;
            }
            if let Some(mut down) = h.vanished.clone().into_coordinator_certificate() {
                if let Some(l) = again {
                    let (why, on_its_own) = if *on_host_lease {
                        (
                            "its live key rode on its host's lease, which ran out (the host's node-watch stopped or lost etcd)".to_string(),
                            " on its own lease",
                        )
                    } else {
                        (
                            format!("its lease ran out after etcd was silent for {silence_s:.1} s (this coordinator heard nothing from it)"),
                            "",
                        )
                    };
                    down.reason = Reason::well_known(reasons::LEASE_LOST);
                    down.detail = format!(
                        "{why}; the same process (pid {}{}) registered again{on_its_own} as incarnation {} at revision {}: not a crash",
                        l.pid,
                        l.host.map(|h| format!(" on {h}")).unwrap_or_default(),
                        l.incarnation,
                        l.revision,
                    );
                }
                out.push(down);
            }
            false
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rank 0's process, registered again as incarnation `inc` on `host`.
    fn back_as(inc: i64, host: &str) -> LivedOn {
        LivedOn {
            incarnation: Incarnation::new(inc).unwrap(),
            revision: 20,
            pid: 40,
            host: Some(host.into()),
        }
    }

    fn vanished(rank: Rank, inc: i64, ttl: u64) -> Output {
        Output::LiveKeyVanished {
            group: GroupId::new("g").unwrap(),
            rank,
            incarnation: Incarnation::new(inc).unwrap(),
            revision: 10,
            at_ms: 0,
            detail: "its live key vanished".into(),
            host: Some("h".into()),
            pid: Some(40 + rank),
            registered_revision: 2,
            lease_ttl_ms: Some(ttl),
            group_size: 4,
            role: None,
            on_host_lease: false,
        }
    }

    #[test]
    fn with_etcd_heard_throughout_a_vanished_key_is_certified_at_once() {
        let mut d = LeaseDoubt::new();
        assert!(d.vanished(vanished(0, 7, 5000), 1_000).is_some());
        assert_eq!(d.poll_timeout(), None);
    }

    #[test]
    fn after_a_silence_the_process_that_registered_again_lost_its_lease_and_the_other_died() {
        let mut d = LeaseDoubt::new();
        d.stale(1_000);
        d.current(11_000);
        assert!(d.vanished(vanished(0, 7, 5000), 11_200).is_none());
        assert!(d.vanished(vanished(1, 8, 5000), 11_300).is_none());
        assert_eq!(d.poll_timeout(), Some(11_200 + 5000 + REREGISTER_MS));
        // Rank 0's process registered again; rank 1's did not (yet).
        let lived_on = |_: &GroupId, rank: Rank, _: Incarnation| (rank == 0).then(|| back_as(9, "h"));
        let now = d.settle(12_000, lived_on);
        assert_eq!(now.len(), 1);
        assert_eq!(now[0].rank, 0);
        assert_eq!(now[0].reason.as_str(), "lease_lost");
        assert!(now[0].detail.contains("silent for 10.0 s"), "{}", now[0].detail);
        assert!(d.settle(16_000, lived_on).is_empty());
        let late = d.settle(11_300 + 5000 + REREGISTER_MS, lived_on);
        assert_eq!(late.len(), 1);
        assert_eq!(late[0].rank, 1);
        assert_eq!(late[0].reason.as_str(), "lease_expired");
        assert_eq!(d.held(), 0);
    }

    #[test]
    fn a_key_on_its_hosts_lease_is_held_with_etcd_heard_throughout() {
        let mut d = LeaseDoubt::new();
        assert!(
            d.vanished(on_host(vanished(0, 7, 5000)), 1_000).is_none(),
            "node-watch may only have stopped"
        );
        assert!(d.vanished(on_host(vanished(1, 8, 5000)), 1_000).is_none());
        assert!(!d.in_doubt(1_000), "a host lease opens no etcd doubt for other keys");
        assert!(d.vanished(vanished(2, 9, 5000), 1_000).is_some());
        // Rank 0's process registered again on its own lease; rank 1's host is gone.
        let lived_on = |_: &GroupId, rank: Rank, _: Incarnation| (rank == 0).then(|| back_as(11, "h"));
        let now = d.settle(1_200, lived_on);
        assert_eq!(now.len(), 1);
        assert_eq!(now[0].reason.as_str(), "lease_lost");
        assert!(now[0].detail.contains("host's lease"), "{}", now[0].detail);
        assert!(d.settle(1_000 + 5000 + REREGISTER_MS - 1, lived_on).is_empty());
        let late = d.settle(1_000 + 5000 + REREGISTER_MS, lived_on);
        assert_eq!(late.len(), 1);
        assert_eq!((late[0].rank, late[0].reason.as_str()), (1, "lease_expired"));
    }

    fn on_host(mut o: Output) -> Output {
        if let Output::LiveKeyVanished { on_host_lease, .. } = &mut o {
            *on_host_lease = true;
        }
        o
    }

    fn nobody_again(_: &GroupId, _: Rank, _: Incarnation) -> Option<LivedOn> {
        None
    }

    #[test]
    fn a_host_that_died_whole_is_certified_host_gone_ms_after_its_lease_ran_out() {
        let mut d = LeaseDoubt::new();
        assert!(d.vanished(on_host(vanished(0, 7, 15_000)), 1_000).is_none());
        assert!(d.vanished(on_host(vanished(1, 8, 15_000)), 1_010).is_none());
        assert_eq!(d.poll_timeout(), Some(1_000 + HOST_GONE_MS));
        assert!(d.settle(1_000 + HOST_GONE_MS - 1, nobody_again).is_empty());
        let gone = d.settle(1_000 + HOST_GONE_MS, nobody_again);
        assert_eq!(gone.len(), 1);
        assert_eq!((gone[0].rank, gone[0].reason.as_str()), (0, "lease_expired"));
        assert_eq!(d.settle(1_010 + HOST_GONE_MS, nobody_again).len(), 1);
        assert_eq!(d.held(), 0);
    }

    #[test]
    fn after_a_silence_a_key_of_a_host_lease_is_held_its_full_term() {
        let mut d = LeaseDoubt::new();
        d.stale(0);
        d.current(1_000);
        assert!(d.vanished(on_host(vanished(0, 7, 5_000)), 1_500).is_none());
        assert_eq!(d.poll_timeout(), Some(1_500 + 5_000 + REREGISTER_MS));
        assert!(d.settle(1_500 + HOST_GONE_MS, nobody_again).is_empty());
    }

    #[test]
    fn one_rank_back_from_a_host_lease_holds_every_other_host_lease_key_its_full_term() {
        let mut d = LeaseDoubt::new();
        // Host h1's node-watch stopped: its rank 0 comes back; host h2's rank 1 has not yet
        // (its registration may queue behind a fleet's), and rank 2 vanishes a little later.
        assert!(d.vanished(on_host(vanished(0, 7, 5_000)), 1_000).is_none());
        assert!(d.vanished(on_host(vanished(1, 8, 5_000)), 1_000).is_none());
        let back = |_: &GroupId, rank: Rank, _: Incarnation| (rank == 0).then(|| back_as(11, "h1"));
        assert_eq!(d.settle(1_100, back).len(), 1, "rank 0: lease_lost");
        assert!(d.vanished(on_host(vanished(2, 9, 5_000)), 1_500).is_none());
        let full = 5_000 + REREGISTER_MS;
        assert_eq!(d.poll_timeout(), Some(1_000 + full));
        assert!(d.settle(1_000 + HOST_GONE_MS, nobody_again).is_empty());
        assert_eq!(d.settle(1_000 + full, nobody_again)[0].rank, 1);
        // The known stop ends 8 s after rank 0 came back; rank 2 is then due at once.
        assert_eq!(d.poll_timeout(), Some(1_100 + full));
        let late = d.settle(1_100 + full, nobody_again);
        assert_eq!((late[0].rank, late[0].reason.as_str()), (2, "lease_expired"));
        // With the stop over, a host lease key is held HOST_GONE_MS again.
        assert!(d.vanished(on_host(vanished(3, 10, 5_000)), 20_000).is_none());
        assert_eq!(d.poll_timeout(), Some(20_000 + HOST_GONE_MS));
    }

    #[test]
    fn the_doubt_ends_after_the_resume_and_a_burst_extends_it_up_to_a_bound() {
        let mut d = LeaseDoubt::new();
        d.stale(0);
        assert!(d.in_doubt(500), "while stale, everything is in doubt");
        d.current(1_000);
        assert!(d.in_doubt(1_000 + DOUBT_AFTER_RESUME_MS - 1));
        assert!(!d.in_doubt(1_000 + DOUBT_AFTER_RESUME_MS));
        // A burst: each held key keeps the doubt open a little longer, never past the cap.
        let mut t = 1_000;
        while t < 1_000 + DOUBT_AT_MOST_MS + 10_000 {
            let _ = d.vanished(vanished(0, 7, 1000), t);
            t += 1_000;
        }
        assert!(!d.in_doubt(1_000 + DOUBT_AT_MOST_MS));
        // A second current with no stale in between changes nothing.
        d.current(100_000);
        assert!(!d.in_doubt(100_000));
    }
}
