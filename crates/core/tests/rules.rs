//! SPEC section 5, rule by rule: a table of cases.

mod common;
use common::*;
use rootrank_core::{Action, EvidenceKind, Output, RankStateKind, Status, Verdict};

/// The question these rules ask of a world: its verdict, now.
trait Ask {
    fn verdict(&self, room: u64, group: Option<&str>) -> Verdict;
}

impl Ask for World {
    fn verdict(&self, room: u64, group: Option<&str>) -> Verdict {
        verdict_of(&self.index, room, group, self.now)
    }
}

const G: &str = "prefill-0";
const D: &str = "decode-0";

fn group_of_four(w: &mut World) {
    for r in 0..4 {
        w.register(G, r, 4, 5000);
    }
}

#[test]
fn rule1_local_record_names_its_rank_over_propagated_ones() {
    let mut w = World::new();
    group_of_four(&mut w);
    w.record(G, 0, 42, "propagated", "other");
    w.record(G, 2, 42, "local", "nixl_error");
    w.record(G, 1, 42, "propagated", "other");
    let v = w.verdict(42, None);
    assert_eq!(v.status, Status::Resolved);
    assert_eq!(v.action, Action::Abort);
    let c = v.culprit.unwrap();
    assert_eq!(
        (c.group.as_str(), c.rank, c.reason.as_str(), c.source.as_str()),
        (G, 2, "nixl_error", "room_record")
    );
    assert_eq!(c.pid, Some(1002));
    assert_eq!(v.evidence.len(), 3);
    assert!(v.explain.contains("rank 2"), "{}", v.explain);
}

#[test]
fn rule1_first_local_record_by_revision_wins() {
    let mut w = World::new();
    group_of_four(&mut w);
    w.record(G, 3, 7, "local", "transfer_timeout");
    w.advance(-5000); // a later write with an earlier host clock still loses: revision orders
    w.record(G, 1, 7, "local", "nixl_error");
    let c = w.verdict(7, None).culprit.unwrap();
    assert_eq!((c.rank, c.reason.as_str()), (3, "transfer_timeout"));
}

#[test]
fn rule1_the_first_candidate_by_revision_wins_record_or_death() {
    let mut w = World::new();
    group_of_four(&mut w);
    w.vanish(G, 3);
    w.record(G, 1, 9, "local", "peer_disconnect");
    let v = w.verdict(9, None);
    assert_eq!(v.culprit.unwrap().rank, 3, "the death came first");
    assert_eq!(v.action, Action::AbortAndRestartGroup);
    // A record before the death wins the same way.
    let mut w = World::new();
    group_of_four(&mut w);
    w.record(G, 2, 10, "local", "nixl_error");
    w.vanish(G, 0);
    let v = w.verdict(10, None);
    assert_eq!((v.culprit.unwrap().rank, v.action), (2, Action::Abort));
}

/// Issue 9's report: rank 3 died before the rooms' first records; the survivors were told so;
/// a later local record of rank 1 must not change the answer.
#[test]
fn rule2_resolved_is_final_a_later_local_record_does_not_move_the_culprit() {
    let mut w = World::new();
    group_of_four(&mut w);
    w.vanish(G, 3);
    for r in [0, 2] {
        w.record(G, r, 8, "propagated", "other");
    }
    let before = w.verdict(8, None);
    assert_eq!(
        (before.status, before.culprit.as_ref().unwrap().rank),
        (Status::Resolved, 3)
    );
    w.advance(2_000);
    w.record(G, 1, 8, "local", "transfer_timeout");
    let after = w.verdict(8, None);
    let (b, a) = (before.culprit.unwrap(), after.culprit.unwrap());
    assert_eq!((a.group, a.rank, a.incarnation), (b.group, b.rank, b.incarnation));
    assert_eq!(w.index.recent_failures(None, 10)[0].rank, 3);
}

#[test]
fn rule2_a_late_watchdog_certificate_refines_the_reason_and_never_moves_the_culprit() {
    let mut w = World::new();
    group_of_four(&mut w);
    w.record(G, 0, 15, "propagated", "other");
    w.vanish(G, 3);
    w.record(G, 1, 15, "local", "nixl_error");
    assert_eq!(w.verdict(15, None).culprit.unwrap().reason.as_str(), "lease_expired");
    w.advance(9_000); // later than the pending window: the death keeps its own time
    w.certify(G, 3, "oom_host", "watchdog");
    let c = w.verdict(15, None).culprit.unwrap();
    assert_eq!(
        (c.rank, c.reason.as_str(), c.source.as_str()),
        (3, "oom_host", "down_certificate")
    );
    // A clean exit claimed after the rank was seen dead is still a death.
    let mut w = World::new();
    group_of_four(&mut w);
    w.record(G, 0, 16, "propagated", "other");
    w.vanish(G, 2);
    w.certify(G, 2, "shutdown", "supervisor");
    assert_eq!(w.verdict(16, None).culprit.unwrap().rank, 2);
}

#[test]
fn rule5_cause_follows_the_peer_to_its_own_root_cause() {
    let mut w = World::new();
    group_of_four(&mut w);
    for r in 0..4 {
        w.register(D, r, 4, 5000);
    }
    // Prefill rank 2's WRITE failed because decode rank 2 was OOM-killed.
    w.certify(D, 2, "oom_host", "watchdog");
    w.vanish(D, 2);
    w.record_with_peer(
        G,
        2,
        30,
        "local",
        "nixl_error",
        serde_json::json!({"group": D, "rank": 2}),
    );
    let v = w.verdict(30, Some(G));
    let (c, cause) = (v.culprit.unwrap(), v.cause.unwrap());
    assert_eq!((c.group.as_str(), c.rank, c.reason.as_str()), (G, 2, "nixl_error"));
    assert_eq!(c.peer.as_ref().and_then(|p| p.rank), Some(2));
    assert_eq!(
        (cause.group.as_str(), cause.rank, cause.reason.as_str()),
        (D, 2, "oom_host")
    );
    let advice = v.advice.unwrap();
    assert!(
        advice.contains("ran out of memory") && advice.contains("decode-0 rank 2"),
        "{advice}"
    );
}

#[test]
fn rule5_a_peer_named_by_nixl_agent_is_found_and_chains_stop_at_loops_and_four_hops() {
    let mut w = World::new();
    w.register(G, 0, 1, 5000);
    w.register_with_agent(D, 0, 1, 5000, Some("agent-d0"));
    // The prefill rank knows only its decode peer's NIXL agent name (all SGLang gives it).
    w.vanish(D, 0);
    w.record_with_peer(
        G,
        0,
        31,
        "local",
        "peer_disconnect",
        serde_json::json!({"agent": "agent-d0"}),
    );
    let v = w.verdict(31, Some(G));
    let cause = v.cause.unwrap();
    assert_eq!(
        (cause.group.as_str(), cause.rank, cause.reason.as_str()),
        (D, 0, "lease_expired")
    );
    assert_eq!(
        v.culprit.unwrap().peer.unwrap().group.map(|g| g.to_string()),
        Some(D.to_string())
    );
    // A loop: two ranks naming each other end the chain at the other one.
    let mut w = World::new();
    w.register(G, 0, 1, 5000);
    w.register(D, 0, 1, 5000);
    w.record_with_peer(
        G,
        0,
        32,
        "local",
        "nixl_error",
        serde_json::json!({"group": D, "rank": 0}),
    );
    w.record_with_peer(
        D,
        0,
        32,
        "local",
        "nixl_error",
        serde_json::json!({"group": G, "rank": 0}),
    );
    let cause = w.verdict(32, Some(G)).cause.unwrap();
    assert_eq!(cause.group.as_str(), D);
    // A chain longer than 4 hops stops at the fourth.
    let mut w = World::new();
    for g in 0..6 {
        w.register(&format!("g{g}"), 0, 1, 5000);
    }
    for g in 0..6 {
        w.record_with_peer(
            &format!("g{g}"),
            0,
            33,
            "local",
            "nixl_error",
            serde_json::json!({"group": format!("g{}", g + 1), "rank": 0}),
        );
    }
    assert_eq!(w.verdict(33, Some("g0")).cause.unwrap().group.as_str(), "g4");
}

#[test]
fn rule6_advice_says_what_to_do_and_counts_repeats() {
    let mut w = World::new();
    group_of_four(&mut w);
    w.record(G, 0, 40, "propagated", "other");
    w.certify(G, 1, "oom_host", "watchdog");
    let v = w.verdict(40, None);
    assert_eq!(v.culprit.as_ref().unwrap().repeat, 1);
    assert!(v.advice.unwrap().contains("if it recurs, lower --mem-fraction-static"));
    w.register(G, 1, 4, 5000);
    w.advance(70_000);
    w.record(G, 0, 41, "propagated", "other");
    w.certify(G, 1, "oom_host", "watchdog");
    let v = w.verdict(41, None);
    assert_eq!(v.culprit.as_ref().unwrap().repeat, 2);
    let advice = v.advice.unwrap();
    assert!(
        advice.contains("again (2 times)") && advice.contains("--max-total-tokens"),
        "{advice}"
    );
    // The compact answer carries who and why in ~200 bytes.
    let compact = serde_json::to_string(&rootrank_core::CompactVerdict::from(&w.verdict(41, None))).unwrap();
    assert!(compact.len() <= 300, "{} bytes: {compact}", compact.len());
    assert!(
        compact.contains("\"oom_host\"") && compact.contains("\"rank\":1"),
        "{compact}"
    );
}

#[test]
fn rule2_vanished_live_key_after_first_record_is_the_culprit() {
    let mut w = World::new();
    group_of_four(&mut w);
    w.record(G, 0, 11, "propagated", "other");
    w.record(G, 1, 11, "propagated", "other");
    assert_eq!(w.verdict(11, None).status, Status::Pending);
    w.advance(5200);
    w.vanish(G, 2);
    let v = w.verdict(11, None);
    assert_eq!(v.status, Status::Resolved);
    assert_eq!(v.action, Action::AbortAndRestartGroup);
    let c = v.culprit.unwrap();
    assert_eq!(
        (c.rank, c.source.as_str(), c.reason.as_str()),
        (2, "lease_expired", "lease_expired")
    );
    assert_eq!(c.pid, Some(1002));
    assert!(v.evidence.iter().any(|e| e.kind == EvidenceKind::LeaseExpired));
    // The coordinator persisted the death, once.
    let certs = w.kv.keys().filter(|k| k.contains("/down/")).count();
    assert_eq!(certs, 1);
}

#[test]
fn rule2_certificate_names_the_cause_and_refines_a_vanished_key() {
    let mut w = World::new();
    group_of_four(&mut w);
    w.record(G, 0, 12, "propagated", "other");
    w.vanish(G, 3); // lease_expired, persisted by the coordinator
    w.certify(G, 3, "oom_host", "watchdog"); // arrives later, same incarnation: refines
    let v = w.verdict(12, None);
    let c = v.culprit.unwrap();
    assert_eq!(
        (c.rank, c.source.as_str(), c.reason.as_str()),
        (3, "down_certificate", "oom_host")
    );
    assert_eq!(c.log_tail.as_ref().map(Vec::len), Some(2));
    // One death, not two.
    assert_eq!(
        v.evidence.iter().filter(|e| e.kind != EvidenceKind::RoomRecord).count(),
        1
    );
}

#[test]
fn rule2_a_coordinator_certificate_never_overrides_a_specific_one() {
    let mut w = World::new();
    group_of_four(&mut w);
    w.certify(G, 1, "gpu_xid", "watchdog");
    w.vanish(G, 1);
    w.record(G, 0, 13, "propagated", "other");
    let c = w.verdict(13, None).culprit.unwrap();
    assert_eq!(
        (c.rank, c.reason.as_str(), c.source.as_str()),
        (1, "gpu_xid", "down_certificate")
    );
}

#[test]
fn rule2_earliest_death_wins() {
    let mut w = World::new();
    group_of_four(&mut w);
    w.record(G, 0, 14, "propagated", "other");
    w.certify(G, 2, "oom_gpu", "agent");
    w.certify(G, 1, "process_exit", "supervisor");
    assert_eq!(w.verdict(14, None).culprit.unwrap().rank, 2);
}

#[test]
fn rule2_shutdown_is_never_a_culprit() {
    let mut w = World::new();
    group_of_four(&mut w);
    w.record(G, 0, 15, "propagated", "other");
    w.certify(G, 1, "shutdown", "agent");
    w.vanish(G, 1);
    assert_eq!(w.verdict(15, None).status, Status::Pending);
    w.advance(6001);
    let v = w.verdict(15, None);
    assert_eq!((v.status, v.action), (Status::Unknown, Action::Abort));
    assert!(v.culprit.is_none());
}

#[test]
fn rule2_death_window_bounds_old_and_late_deaths() {
    let mut w = World::new();
    group_of_four(&mut w);
    w.certify(G, 3, "oom_host", "watchdog");
    w.advance(360_001); // that death is now older than the window
    w.record(G, 0, 16, "propagated", "other");
    assert_eq!(w.verdict(16, None).status, Status::Pending);
    w.advance(6_001); // past TTL + grace: a death now is unrelated
    w.certify(G, 2, "oom_host", "watchdog");
    assert_eq!(w.verdict(16, None).status, Status::Unknown);

    let mut w = World::new();
    group_of_four(&mut w);
    w.certify(G, 3, "oom_host", "watchdog");
    w.advance(359_000); // inside the window
    w.record(G, 0, 17, "propagated", "other");
    assert_eq!(w.verdict(17, None).culprit.unwrap().rank, 3);
}

#[test]
fn rule2_a_rank_reregistered_before_the_first_record_is_alive_for_the_room() {
    let mut w = World::new();
    group_of_four(&mut w);
    w.vanish(G, 1);
    w.register(G, 1, 4, 5000); // restarted before the room
    w.record(G, 0, 18, "propagated", "other");
    assert_eq!(w.verdict(18, None).status, Status::Pending);

    let mut w = World::new();
    group_of_four(&mut w);
    w.vanish(G, 1);
    w.record(G, 0, 19, "propagated", "other");
    w.register(G, 1, 4, 5000); // restarted after the room's first record: still the culprit
    assert_eq!(w.verdict(19, None).culprit.unwrap().rank, 1);
}

#[test]
fn rule2_a_replaced_incarnation_is_a_death_of_the_old_one() {
    let mut w = World::new();
    group_of_four(&mut w);
    w.record(G, 0, 20, "propagated", "other");
    let old = w.incarnation(G, 2);
    w.register(G, 2, 4, 5000); // new lease over the old key, no delete ever comes
    let c = w.verdict(20, None).culprit.unwrap();
    assert_eq!((c.rank, c.incarnation.map(|i| i.lease_id())), (2, Some(old)));
}

#[test]
fn rule3_and_4_pending_until_the_slowest_lease_plus_grace_then_unknown() {
    let mut w = World::new();
    group_of_four(&mut w);
    w.register(G, 3, 4, 9000); // the slowest rank's TTL decides
    w.record(G, 0, 21, "propagated", "other");
    w.advance(10_000);
    // The window is inclusive (a death dated at its last millisecond counts).
    let v = w.verdict(21, None);
    assert_eq!((v.status, v.action), (Status::Pending, Action::Wait));
    w.advance(1);
    let v = w.verdict(21, None);
    assert_eq!((v.status, v.action), (Status::Unknown, Action::Abort));
    assert!(v.explain.contains("outside the group"), "{}", v.explain);
}

#[test]
fn a_room_with_no_record_yet_uses_the_query_time() {
    let mut w = World::new();
    group_of_four(&mut w);
    let v = w.verdict(22, Some(G));
    assert_eq!(v.status, Status::Pending);
    assert!(v.culprit.is_none());
    w.certify(G, 2, "nccl_timeout", "supervisor");
    w.advance(30_000);
    let v = w.verdict(22, Some(G));
    assert_eq!(v.culprit.unwrap().rank, 2); // died 30 s before the question
    assert_eq!(w.verdict(22, None).status, Status::Pending); // no group involved, nothing known
}

#[test]
fn group_filter_restricts_records_and_deaths() {
    let mut w = World::new();
    group_of_four(&mut w);
    w.register(D, 0, 1, 5000);
    w.record(D, 0, 23, "local", "nixl_error");
    w.record(G, 0, 23, "propagated", "other");
    assert_eq!(w.verdict(23, None).culprit.unwrap().group.as_str(), D);
    let v = w.verdict(23, Some(G));
    assert_eq!(v.status, Status::Pending);
    assert_eq!(v.groups.len(), 1);
}

#[test]
fn an_old_certificate_never_marks_a_new_incarnation_down() {
    let mut w = World::new();
    group_of_four(&mut w);
    w.certify(G, 1, "oom_host", "watchdog");
    w.vanish(G, 1);
    let view = w.index.group(&rootrank_core::GroupId::new(G).unwrap()).unwrap();
    assert_eq!(view.ranks[1].state, RankStateKind::Down);
    w.register(G, 1, 4, 5000);
    let view = w.index.group(&rootrank_core::GroupId::new(G).unwrap()).unwrap();
    assert_eq!(view.ranks[1].state, RankStateKind::Live);
    let s = &w.index.groups()[0];
    assert_eq!((s.live, s.down, s.missing), (4, 0, 0));
}

#[test]
fn invalid_values_are_skipped_reported_and_change_nothing() {
    let mut w = World::new();
    group_of_four(&mut w);
    w.record(G, 0, 24, "propagated", "other");
    let before = w.verdict(24, None);
    let n = w.outputs.len();
    let bad: &[(&str, &[u8])] = &[
        ("/rootrank/v1/groups/prefill-0/rooms/24/ranks/1", b"{not json"),
        (
            "/rootrank/v1/groups/prefill-0/rooms/24/ranks/2",
            br#"{"v":1,"group":"prefill-0","rank":3,"room":"24","origin":"local","reason":"x"}"#,
        ),
        (
            "/rootrank/v1/groups/prefill-0/rooms/24/ranks/3",
            br#"{"v":7,"group":"prefill-0","rank":3,"room":"24","origin":"local","reason":"x"}"#,
        ),
        (
            "/rootrank/v1/groups/prefill-0/ranks/1/live",
            br#"{"v":1,"group":"prefill-0","rank":1,"group_size":1}"#,
        ),
        (
            "/rootrank/v1/groups/prefill-0/ranks/1/down/99",
            br#"{"v":1,"group":"prefill-0","rank":1,"incarnation":"98","reason":"oom_host","source":"watchdog"}"#,
        ),
        ("/rootrank/v1/groups/bad group/rooms/24/ranks/1", b"{}"),
    ];
    for (k, v) in bad {
        w.put_raw(k, v.to_vec(), 0);
    }
    let invalid: Vec<_> = w.outputs[n..]
        .iter()
        .filter(|o| matches!(o, Output::Invalid { .. }))
        .collect();
    assert_eq!(invalid.len(), bad.len(), "{invalid:?}");
    let after = w.verdict(24, None);
    assert_eq!(
        (after.status, after.evidence.len()),
        (before.status, before.evidence.len())
    );
    assert_eq!(
        w.index.group(&rootrank_core::GroupId::new(G).unwrap()).unwrap().ranks[1].state,
        RankStateKind::Live
    );
}

#[test]
fn retention_deletes_drop_records_and_deaths() {
    let mut w = World::new();
    group_of_four(&mut w);
    w.record(G, 0, 25, "propagated", "other");
    w.certify(G, 2, "oom_host", "watchdog");
    assert_eq!(w.index.room_count(), 1);
    w.delete_raw(&key_room(G, 25, 0));
    let inc = w.incarnation(G, 2);
    w.delete_raw(&key_down(G, 2, inc));
    assert_eq!(w.index.room_count(), 0);
    assert_eq!(w.index.record_count(), 0);
    assert_eq!(w.verdict(25, Some(G)).status, Status::Pending);
}

#[test]
fn resolution_outputs_fire_once_per_room() {
    let mut w = World::new();
    group_of_four(&mut w);
    w.record(G, 0, 26, "propagated", "other");
    w.advance(300);
    w.vanish(G, 3);
    w.record(G, 1, 26, "local", "nixl_error"); // already resolved by the death
    let resolved: Vec<_> = w
        .outputs
        .iter()
        .filter(|o| matches!(o, Output::RoomResolved { .. }))
        .collect();
    assert_eq!(resolved.len(), 1);
    match resolved[0] {
        Output::RoomResolved {
            rank,
            source,
            first_record_observed_ms,
            observed_ms,
            ..
        } => {
            assert_eq!((*rank, source.as_str()), (3, "lease_expired"));
            assert_eq!(observed_ms - first_record_observed_ms, 300);
        }
        _ => unreachable!(),
    }
    assert_eq!(w.index.recent_failures(None, 10).len(), 1);
}

// ---- rule 7 (v3): victims and peer-reported records

/// The survivors of a SIGKILL die in the next gloo all-reduce tens of milliseconds later and
/// are certified `peer_lost` at once; the killed rank's lease expires seconds later.
#[test]
fn rule7_a_victim_is_never_named_over_the_rank_it_lost() {
    let mut w = World::new();
    group_of_four(&mut w);
    w.advance(33);
    for r in [0, 2, 3] {
        w.certify(G, r, "peer_lost", "agent");
    }
    // The killed rank's lease has not expired yet: the victims are not the answer.
    let v = w.verdict(50, Some(G));
    assert_eq!((v.status, v.action), (Status::Pending, Action::Wait), "{}", v.explain);
    assert!(v.culprit.is_none());
    assert_eq!(v.victims.iter().map(|x| x.rank).collect::<Vec<_>>(), vec![0, 2, 3]);
    assert!(v.explain.contains("peer of its collective vanished"), "{}", v.explain);
    w.advance(5_000);
    w.vanish(G, 1);
    let v = w.verdict(50, Some(G));
    assert_eq!(v.status, Status::Resolved);
    let c = v.culprit.unwrap();
    assert_eq!(
        (c.rank, c.reason.as_str(), c.source.as_str()),
        (1, "lease_expired", "lease_expired")
    );
    assert_eq!(v.victims.len(), 3);
    assert!(
        v.explain
            .contains("Victims (died because a peer vanished): prefill-0 rank 0"),
        "{}",
        v.explain
    );
}

#[test]
fn rule7_the_same_culprit_whether_node_watch_wins_the_race_or_not() {
    let named = |watchdog_first: bool| {
        let mut w = World::new();
        group_of_four(&mut w);
        if watchdog_first {
            w.certify(G, 1, "oom_host", "watchdog");
        }
        w.advance(30);
        w.certify(G, 0, "peer_lost", "agent");
        if !watchdog_first {
            w.advance(10);
            w.certify(G, 1, "oom_host", "watchdog");
        }
        w.record(G, 2, 60, "propagated", "other");
        let c = w.verdict(60, None).culprit.unwrap();
        (c.rank, c.reason.to_string())
    };
    assert_eq!(named(true), (1, "oom_host".to_string()));
    assert_eq!(named(false), (1, "oom_host".to_string()));
}

#[test]
fn rule7_a_local_record_outranks_an_earlier_victim() {
    let mut w = World::new();
    group_of_four(&mut w);
    w.record(G, 0, 61, "propagated", "other");
    w.certify(G, 0, "peer_lost", "agent");
    w.advance(200);
    w.record(G, 3, 61, "local", "nixl_error");
    let c = w.verdict(61, None).culprit.unwrap();
    assert_eq!((c.rank, c.reason.as_str()), (3, "nixl_error"));
}

#[test]
fn rule7_a_victim_alone_is_named_once_nothing_else_can_show_up_and_stays_named() {
    let mut w = World::new();
    group_of_four(&mut w);
    w.record(G, 2, 62, "propagated", "other");
    w.certify(G, 2, "peer_lost", "agent");
    assert_eq!(w.verdict(62, None).status, Status::Pending);
    w.advance(6_001); // the slowest TTL (5 s) + 1 s after the victim's death
    let v = w.verdict(62, None);
    assert_eq!(v.status, Status::Resolved, "{}", v.explain);
    let c = v.culprit.unwrap();
    assert_eq!((c.rank, c.reason.as_str()), (2, "peer_lost"));
    // A death after that window is unrelated: the answer stays (rule 2).
    w.vanish(G, 1);
    let c = w.verdict(62, None).culprit.unwrap();
    assert_eq!((c.rank, c.reason.as_str()), (2, "peer_lost"));
}

#[test]
fn a_window_ends_when_its_end_key_lands_not_at_a_local_deadline() {
    // A victim is named only once its window passed. The index says when its clock sees
    // that (`poll_timeout`); the shell writes the window's end key; the room resolves at the
    // revision that key landed at, on every replica alike.
    let mut w = World::new();
    w.coordinator_writes = false; // this test is the shell
    group_of_four(&mut w);
    w.record(G, 2, 63, "propagated", "other");
    w.certify(G, 2, "peer_lost", "agent");
    let victim_end = w.now + 6_001;
    let deadline = w.index.poll_timeout().expect("open windows have deadlines");
    assert!(deadline <= victim_end, "{deadline} vs {victim_end}");
    assert!(
        w.index.handle_timeout(deadline - 1).is_empty(),
        "nothing before the deadline"
    );
    let out = w.index.handle_timeout(victim_end);
    let ends: Vec<_> = out
        .iter()
        .filter_map(|o| match o {
            Output::WindowEnded { window, .. } => Some(window.clone()),
            _ => None,
        })
        .collect();
    assert!(
        ends.iter().any(|e| matches!(e, rootrank_core::Window::Victim(_, 2, _))),
        "{ends:?}"
    );
    assert!(!out.iter().any(|o| matches!(o, Output::RoomResolved { .. })), "{out:?}");
    w.now = victim_end + 60_000;
    assert_eq!(
        w.verdict(63, None).status,
        Status::Pending,
        "no end key in etcd yet: still pending, whatever this clock says"
    );
    let before = w.outputs.len();
    for o in &out {
        w.write_window_end(o);
    }
    let end_revision = w.rev;
    let resolved: Vec<_> = w.outputs[before..]
        .iter()
        .filter_map(|o| match o {
            Output::RoomResolved { room, rank, reason, .. } => Some((room.get(), *rank, reason.as_str().to_string())),
            _ => None,
        })
        .collect();
    assert_eq!(resolved, vec![(63, 2, "peer_lost".to_string())]);
    assert!(w.index.revision() <= end_revision);
    assert!(
        w.index.handle_timeout(w.now + 10_000).iter().all(|o| !matches!(
            o,
            Output::WindowEnded {
                window: rootrank_core::Window::Victim(..),
                ..
            }
        )),
        "asked once"
    );

    // A room nobody can resolve any more (no candidate at all) turns unknown when its end
    // key lands, and only then.
    let mut w = World::new();
    w.coordinator_writes = false;
    group_of_four(&mut w);
    w.record(G, 1, 64, "propagated", "other");
    let deadline = w.index.poll_timeout().expect("pending");
    let out = w.index.handle_timeout(deadline);
    assert!(
        out.iter().any(|o| matches!(
            o,
            Output::WindowEnded {
                window: rootrank_core::Window::Room(_),
                ..
            }
        )),
        "{out:?}"
    );
    w.now = deadline + 3_600_000;
    assert_eq!(w.verdict(64, None).status, Status::Pending);
    for o in &out {
        w.write_window_end(o);
    }
    assert_eq!(w.verdict(64, None).status, Status::Unknown);
    // A death after the end key is no candidate, however soon after on anyone's clock.
    w.vanish(G, 3);
    assert_eq!(w.verdict(64, None).status, Status::Unknown);
}

#[test]
fn group_size_and_role_come_from_the_newest_live_records_whatever_the_read_order() {
    // Ranks of one group that disagree (a misconfigured restart): the group's size is the
    // newest live record's and its role the newest that names one, by etcd revision, on a
    // replica that watched and on ones that loaded the same keys in any order (a snapshot read
    // in parallel parts applies pages in no fixed order).
    let mut w = World::new();
    let g = "mixed-0";
    let put = |w: &mut World, r: u32, size: u32, role: Option<&str>| {
        w.register(g, r, size, 5000);
        let lease = w.incarnation(g, r);
        let mut v = serde_json::json!({"v":1,"group":g,"rank":r,"group_size":size,"host":"host-a","pid":2000 + r,
            "lease_ttl_ms":5000,"started_at":rootrank_core::time::format_ms(w.now)});
        if let Some(role) = role {
            v["role"] = role.into();
        }
        w.put_raw(&key_live(g, r), v.to_string().into_bytes(), lease);
    };
    put(&mut w, 0, 2, Some("prefill"));
    put(&mut w, 1, 4, Some("decode"));
    put(&mut w, 2, 3, None);
    let id = rootrank_core::GroupId::new(g).unwrap();
    let summary = |idx: &rootrank_core::Index| {
        let s = idx.groups().into_iter().find(|s| s.group == id).expect("the group");
        (s.group_size, s.role)
    };
    let watched = summary(&w.index);
    assert_eq!(watched, (3, Some("decode".to_string())));
    let events = snapshot_events(&w);
    for order in [events.clone(), events.iter().rev().cloned().collect::<Vec<_>>()] {
        let mut idx = rootrank_core::Index::new(rootrank_core::IndexConfig::default());
        idx.load_snapshot(order, w.rev);
        assert_eq!(summary(&idx), watched);
    }
}

/// A prefill rank that publishes the bootstrap endpoint decode knows it by.
fn register_prefill(w: &mut World, g: &str, r: u32, size: u32, endpoint: &str) {
    w.register(g, r, size, 5000);
    let lease = w.incarnation(g, r);
    let v = serde_json::json!({"v":1,"group":g,"rank":r,"group_size":size,"role":"prefill","host":"host-a","pid":1000 + r,
        "lease_ttl_ms":5000,"started_at":rootrank_core::time::format_ms(w.now),"endpoints":[endpoint]});
    w.put_raw(&key_live(g, r), v.to_string().into_bytes(), lease);
}

#[test]
fn rule7_a_peer_reported_record_follows_the_peer_group() {
    let mut w = World::new();
    let p = "prefill-node-a:8998-dp0";
    for r in 0..2 {
        register_prefill(&mut w, p, r, 2, "10.0.0.5:8998");
    }
    w.register(D, 0, 1, 5000);
    let peer = serde_json::json!({"endpoint":"10.0.0.5:8998","rank":1});
    w.record_with_peer(D, 0, 70, "peer_reported", "other", peer);
    // The decode rank is never the culprit in its own group; the prefill group may still
    // show a death.
    let v = w.verdict(70, Some(D));
    assert_eq!(v.status, Status::Pending, "{}", v.explain);
    assert!(v.groups.iter().any(|g| g.as_str() == p), "{:?}", v.groups);
    assert!(
        v.explain
            .contains("was told by its transfer peer, which is prefill-node-a:8998-dp0"),
        "{}",
        v.explain
    );
    w.outputs.clear();
    w.certify(p, 1, "oom_host", "watchdog");
    let v = w.verdict(70, Some(D));
    assert_eq!((v.status, v.action), (Status::Resolved, Action::AbortAndRestartGroup));
    let c = v.culprit.unwrap();
    assert_eq!(
        (c.group.as_str(), c.rank, c.reason.as_str(), c.source.as_str()),
        (p, 1, "oom_host", "down_certificate")
    );
    // The death in the peer group resolved the decode room for the metrics and the history.
    assert!(
        w.outputs
            .iter()
            .any(|o| matches!(o, Output::RoomResolved { room, .. } if room.get() == 70)),
        "{:?}",
        w.outputs
    );
    // Without a group the same answer.
    assert_eq!(w.verdict(70, None).culprit.unwrap().rank, 1);
}

#[test]
fn rule7_a_peer_reported_record_with_an_unknown_peer_is_unknown_with_its_words() {
    let mut w = World::new();
    w.register(D, 0, 1, 5000);
    let peer = serde_json::json!({"endpoint":"10.9.9.9:8998"});
    w.record_with_peer(D, 0, 71, "peer_reported", "peer_disconnect", peer);
    let v = w.verdict(71, Some(D));
    assert_eq!((v.status, v.action), (Status::Unknown, Action::Abort));
    assert!(v.culprit.is_none());
    assert!(v.explain.contains("which rootrank does not know"), "{}", v.explain);
    assert!(v.explain.contains("NIXL KVSender Exception"), "{}", v.explain);
}

#[test]
fn rule7_an_endpoint_shared_by_dp_groups_picks_the_group_with_the_room() {
    let mut w = World::new();
    for dp in 0..2 {
        register_prefill(&mut w, &format!("prefill-a-dp{dp}"), 0, 1, "10.0.0.5:8998");
    }
    w.register(D, 0, 1, 5000);
    w.record("prefill-a-dp1", 0, 72, "local", "nixl_error");
    let peer = serde_json::json!({"endpoint":"10.0.0.5:8998","rank":0});
    w.record_with_peer(D, 0, 72, "peer_reported", "other", peer);
    let c = w.verdict(72, Some(D)).culprit.unwrap();
    assert_eq!(
        (c.group.as_str(), c.rank, c.reason.as_str()),
        ("prefill-a-dp1", 0, "nixl_error")
    );
}

// ---- v3: stalls (RankStall records on the liveness lease)

fn key_stall(g: &str, r: u32) -> String {
    format!("/rootrank/v1/groups/{g}/ranks/{r}/stall")
}

fn stall(w: &mut World, g: &str, r: u32, stack: Option<&[&str]>) {
    let inc = w.incarnation(g, r);
    let v = serde_json::json!({"v":1,"group":g,"rank":r,"incarnation":inc.to_string(),
        "since":"2026-12-03T01:00:00.000Z","stalled_ms":12_000,"in_flight":["42"],"stack":stack});
    w.put_raw(&key_stall(g, r), v.to_string().into_bytes(), inc);
}

fn stall_on(w: &mut World, g: &str, r: u32, lease: i64) {
    let inc = w.incarnation(g, r);
    let v = serde_json::json!({"v":1,"group":g,"rank":r,"incarnation":inc.to_string(),
        "since":"2026-12-03T01:00:00.000Z","stalled_ms":12_000,"in_flight":null,"stack":null});
    w.put_raw(&key_stall(g, r), v.to_string().into_bytes(), lease);
}

#[test]
fn v5_a_rank_on_its_hosts_lease_keeps_its_incarnation_its_stall_and_says_how_it_vanished() {
    let mut w = World::new();
    w.coordinator_writes = false;
    let inc0 = w.register(G, 0, 2, 5000);
    let inc1 = w.register(G, 1, 2, 5000);
    let host_lease = 900_001;
    let before = w.outputs.len();
    w.adopt(G, 0, host_lease);
    w.adopt(G, 1, host_lease);
    assert!(
        !w.outputs[before..]
            .iter()
            .any(|o| matches!(o, Output::RankChanged { .. } | Output::Invalid { .. })),
        "moving to the host's lease is no new registration: {:?}",
        &w.outputs[before..]
    );
    let view = w.index.group(&rootrank_core::GroupId::new(G).unwrap()).unwrap();
    let incs: Vec<_> = view.ranks.iter().map(|r| r.incarnation.map(|i| i.lease_id())).collect();
    assert_eq!(incs, vec![Some(inc0), Some(inc1)]);
    // Its stall record rides on the host lease too; on a lease of nobody's it is refused.
    stall_on(&mut w, G, 1, host_lease);
    assert_eq!(states(&w.index), vec![RankStateKind::Live, RankStateKind::Stalled]);
    let before = w.outputs.len();
    stall_on(&mut w, G, 0, 31_337);
    assert!(w.outputs[before..]
        .iter()
        .any(|o| matches!(o, Output::Invalid { kind: "stall", .. })));
    // The host lease runs out: each vanish says it rode on the host's lease.
    w.vanish(G, 0);
    let gone: Vec<_> = w
        .outputs
        .iter()
        .filter_map(|o| match o {
            Output::LiveKeyVanished {
                rank,
                incarnation,
                on_host_lease,
                detail,
                ..
            } => Some((
                *rank,
                incarnation.lease_id(),
                *on_host_lease,
                detail.contains("host's lease"),
            )),
            _ => None,
        })
        .collect();
    assert_eq!(gone, vec![(0, inc0, true, true)]);
    // A rank on its own lease vanishes as ever.
    let inc2 = w.register("decode-0", 0, 1, 5000);
    w.vanish("decode-0", 0);
    assert!(w.outputs.iter().any(|o| matches!(o,
        Output::LiveKeyVanished { incarnation, on_host_lease: false, .. } if incarnation.lease_id() == inc2)));
}

fn states(idx: &rootrank_core::Index) -> Vec<RankStateKind> {
    let g = rootrank_core::GroupId::new(G).unwrap();
    idx.group(&g).unwrap().ranks.iter().map(|r| r.state).collect()
}

#[test]
fn v3_the_first_stall_by_revision_is_the_suspect_and_the_others_wait() {
    let mut w = World::new();
    group_of_four(&mut w);
    w.outputs.clear();
    stall(&mut w, G, 2, None);
    assert!(
        w.outputs.iter().any(|o| matches!(
            o,
            Output::RankChanged {
                rank: 2,
                state: RankStateKind::Stalled,
                ..
            }
        )),
        "{:?}",
        w.outputs
    );
    stall(&mut w, G, 0, None);
    stall(&mut w, G, 1, None);
    // node-watch adds rank 2's stack later: a rewrite does not move its place in the order.
    stall(
        &mut w,
        G,
        2,
        Some(&["Thread 0x7f (active): \"MainThread\"", "    recv (socket.py:12)"]),
    );
    let g = rootrank_core::GroupId::new(G).unwrap();
    let view = w.index.group(&g).unwrap();
    let s = &view.ranks[2];
    assert_eq!(s.state, RankStateKind::Stalled);
    assert_eq!(s.stall.as_ref().unwrap().role, rootrank_core::StallRole::Suspect);
    assert_eq!(s.stack.as_ref().unwrap().len(), 2);
    assert_eq!(
        view.ranks[0].stall.as_ref().unwrap().role,
        rootrank_core::StallRole::Waiting
    );
    assert_eq!(view.ranks[3].state, RankStateKind::Live);
    assert_eq!(w.index.first_stall(&g), Some(2));
    // A reload sees the same suspect (create revision, not the rewrite's).
    assert_eq!(snapshot_index(&w).first_stall(&g), Some(2));
    assert_eq!(states(&snapshot_index(&w)), states(&w.index));
    // Health names the three stalled ranks; the metric says stalled but up.
    let unhealthy = w.index.unhealthy(std::slice::from_ref(&g));
    assert_eq!(unhealthy.iter().map(|u| u.rank).collect::<Vec<_>>(), vec![0, 1, 2]);
    assert!(unhealthy[0].reason.contains("12 s"), "{:?}", unhealthy[0]);
    assert_eq!(w.index.rank_stalls().iter().filter(|(_, _, s)| *s).count(), 3);
    assert!(w.index.rank_liveness().iter().all(|(_, _, up)| *up));
    // A room waiting on the group says who is stalled while nothing else is known.
    w.record(G, 0, 42, "propagated", "other");
    let v = w.verdict(42, None);
    assert_eq!(v.status, Status::Pending);
    assert!(
        v.explain
            .contains("prefill-0 rank 2 is stalled (alive, no progress for 12 s; stalled first: the suspect)"),
        "{}",
        v.explain
    );
    // Rank 2 advances again: live, and rank 0 (next by revision) is the suspect.
    w.outputs.clear();
    w.delete_raw(&key_stall(G, 2));
    assert!(
        w.outputs.iter().any(|o| matches!(
            o,
            Output::RankChanged {
                rank: 2,
                state: RankStateKind::Live,
                ..
            }
        )),
        "{:?}",
        w.outputs
    );
    assert_eq!(w.index.first_stall(&g), Some(0));
    // Rank 0 dies while stalled: down, not stalled; its lease takes the stall key along.
    w.outputs.clear();
    let inc0 = w.incarnation(G, 0);
    w.vanish(G, 0);
    w.delete_raw(&key_stall(G, 0));
    assert_eq!(states(&w.index)[0], RankStateKind::Down);
    assert!(
        w.outputs.iter().any(|o| matches!(
            o,
            Output::RankChanged {
                rank: 0,
                state: RankStateKind::Down,
                ..
            }
        )),
        "{:?}",
        w.outputs
    );
    assert!(
        !w.outputs.iter().any(|o| matches!(
            o,
            Output::RankChanged {
                rank: 0,
                state: RankStateKind::Live,
                ..
            }
        )),
        "{:?}",
        w.outputs
    );
    // The coordinator's certificate for the vanished key persists the death: the rank is sent
    // again (v4: certified now), in the same state and reason.
    assert!(
        w.kv.keys().any(|k| k.contains("/ranks/0/down/")),
        "the world persisted the death"
    );
    let downs = w
        .outputs
        .iter()
        .filter(|o| {
            matches!(
                o,
                Output::RankChanged {
                    rank: 0,
                    state: RankStateKind::Down,
                    ..
                }
            )
        })
        .count();
    assert_eq!(downs, 2, "{:?}", w.outputs);
    assert_eq!(
        w.index
            .death_certified(&g, 0, rootrank_core::Incarnation::new(inc0).unwrap(), w.rev),
        Some(true)
    );
    assert_eq!(w.index.first_stall(&g), Some(1));
    assert!(w.index.unhealthy(&[rootrank_core::GroupId::new("nobody").unwrap()])[0]
        .reason
        .contains("never registered"));
}

#[test]
fn v3_a_stall_record_off_its_incarnations_lease_is_invalid_and_changes_nothing() {
    let mut w = World::new();
    group_of_four(&mut w);
    w.outputs.clear();
    let inc = w.incarnation(G, 1);
    let v = serde_json::json!({"v":1,"group":G,"rank":1,"incarnation":inc.to_string()});
    w.put_raw(&key_stall(G, 1), v.to_string().into_bytes(), inc + 100);
    w.put_raw(&key_stall(G, 2), b"{\"v\":1,\"group\":\"prefill-0\"}".to_vec(), inc);
    let kinds: Vec<_> = w
        .outputs
        .iter()
        .filter_map(|o| match o {
            Output::Invalid { kind, .. } => Some(*kind),
            _ => None,
        })
        .collect();
    assert_eq!(kinds, vec!["stall", "stall"]);
    assert!(states(&w.index).iter().all(|s| *s == RankStateKind::Live));
}

/// The ranks whose live key vanished, as the outputs say.
fn vanished_ranks(outputs: &[Output]) -> Vec<u32> {
    outputs
        .iter()
        .filter_map(|o| match o {
            Output::LiveKeyVanished { rank, .. } => Some(*rank),
            _ => None,
        })
        .collect()
}

#[test]
fn a_reload_after_compaction_counts_the_deaths_it_did_not_watch() {
    // The replica's index before its watch went down.
    let mut w = World::new();
    w.coordinator_writes = false; // no replica was watching to certify anything
    group_of_four(&mut w);
    let before = snapshot_index(&w);
    let lost_at = w.now;
    w.advance(1_000);
    // While nobody watched: rank 1's lease expired (the delete compacted away), rank 3
    // re-registered, and rank 0 recorded room 31 as propagated (a victim's view).
    w.vanish(G, 1);
    w.vanish(G, 3);
    w.register(G, 3, 4, 5000);
    w.advance(200);
    w.record(G, 0, 31, "propagated", "other");
    let mut fresh = snapshot_index(&w);
    assert_eq!(verdict_of(&fresh, 31, Some(G), w.now).status, Status::Pending);

    let out = fresh.carry_vanished_from(&before, lost_at);
    // Rank 1 died; rank 3's old incarnation ended too (replaced); ranks 0 and 2 live on.
    assert_eq!(vanished_ranks(&out), vec![1, 3]);
    // v4: a vanished key names no culprit before it is certified (it may yet be `lease_lost`).
    let v = verdict_of(&fresh, 31, Some(G), w.now);
    assert_eq!(v.status, Status::Pending, "{v:?}");
    assert!(v.explain.contains("not certified yet"), "{}", v.explain);
    // The reloading replica certifies what it carried, as it does every vanished key; the
    // certificate reaches its index through the watch.
    w.certify(G, 1, "lease_expired", "coordinator");
    let certificate = w.events.last().cloned().expect("the certificate's event");
    fresh.apply(certificate);
    let v = verdict_of(&fresh, 31, Some(G), w.now);
    let c = v.culprit.as_ref().expect("a culprit");
    assert_eq!(
        (v.status, c.rank, c.reason.as_str()),
        (Status::Resolved, 1, "lease_expired"),
        "{v:?}"
    );
    // As the replica that watched it all says.
    let watched = w.verdict(31, Some(G));
    assert_eq!(watched.culprit.as_ref().map(|c| c.rank), Some(1));
    // Once rank 1 is certified (the certificate is in the next snapshot), it is not carried
    // again; rank 3's replaced incarnation still is.
    let again = snapshot_index(&w).carry_vanished_from(&before, lost_at);
    assert_eq!(vanished_ranks(&again), vec![3]);
}

/// Groups come and go (the plugin names them after an instance's `host:port`, new at every
/// restart): once etcd holds nothing for one (its records and certificates left with their
/// retention leases), the index forgets it, and holds what an index loaded now would.
#[test]
fn a_group_etcd_holds_nothing_for_is_forgotten() {
    let mut w = World::new();
    let restarts = 50u64;
    for i in 0..restarts {
        let g = format!("prefill-host:{}-dp0", 9000 + i);
        w.register(&g, 0, 1, 1000);
        w.register_with_agent(&g, 1, 2, 1000, Some(&format!("agent-{i}")));
        w.record(&g, 0, i + 1, "local", "nixl_error");
        w.vanish(&g, 0);
        w.vanish(&g, 1);
    }
    // The instance that runs now.
    w.register(G, 0, 1, 1000);
    assert_eq!(w.index.groups().len(), restarts as usize + 1);
    // Records expire first; the certificates (here: the coordinator's, for the vanished live
    // keys) are still held, so every group stays.
    let records: Vec<String> = w.kv.keys().filter(|k| k.contains("/rooms/")).cloned().collect();
    for k in records {
        w.delete_raw(&k);
    }
    assert_eq!(w.index.groups().len(), restarts as usize + 1);
    assert_eq!(w.index.record_count(), 0);
    // Then the certificates: etcd holds nothing for the old instances any more.
    let certs: Vec<String> = w.kv.keys().filter(|k| k.contains("/down/")).cloned().collect();
    assert_eq!(
        certs.len(),
        2 * restarts as usize,
        "the coordinator certified each vanished key"
    );
    for k in certs {
        w.delete_raw(&k);
    }
    let left: Vec<String> = w.index.groups().into_iter().map(|g| g.group.to_string()).collect();
    assert_eq!(left, vec![G.to_string()], "only the group with a live rank is left");
    assert_eq!(
        format!("{:?}", w.index.groups()),
        format!("{:?}", snapshot_index(&w).groups())
    );
    // A record that names an old instance's NIXL agent no longer leads there (rule 5 finds
    // nothing, as on a replica started now).
    w.record_with_peer(
        G,
        0,
        777,
        "peer_reported",
        "other",
        serde_json::json!({"agent": "agent-3"}),
    );
    assert_eq!(
        format!("{:?}", w.verdict(777, None)),
        format!("{:?}", verdict_of(&snapshot_index(&w), 777, None, w.now))
    );
}

/// Issue 28: a writer's clock decides nothing. The survivor records the generic error with
/// its clock from 10 minutes behind to 10 minutes ahead; a sibling dies 0.1 s later (its
/// lease runs out), and a second sibling's agent, its clock as skewed, certifies its own
/// death after the room's window ended. Every skew gives the answer of no skew.
#[test]
fn writers_clocks_skewed_by_ten_minutes_either_way_change_no_verdict() {
    let answer = |skew_ms: i64| {
        let mut w = World::new();
        group_of_four(&mut w);
        let at = rootrank_core::time::format_ms(w.now + skew_ms);
        let v = serde_json::json!({"v":1,"group":G,"rank":0,"room":"90","origin":"propagated","reason":"other",
            "detail":"NIXL KVSender Exception","at":at,"incarnation":w.incarnation(G, 0).to_string(),"peer":null});
        w.put_raw(&key_room(G, 90, 0), v.to_string().into_bytes(), 0);
        let pending = w.verdict(90, None).status;
        w.advance(100);
        w.vanish(G, 1);
        let first = w.verdict(90, None);
        w.advance(10_000); // past the room's window: its end key is written
        let late_at = rootrank_core::time::format_ms(w.now + skew_ms - 20_000);
        let inc = w.incarnation(G, 2);
        let down = serde_json::json!({"v":1,"group":G,"rank":2,"incarnation":inc.to_string(),"reason":"oom_host",
            "detail":"killed","source":"agent","at":late_at,"exit":null,"log_tail":null});
        w.put_raw(&key_down(G, 2, inc), down.to_string().into_bytes(), 0);
        let last = w.verdict(90, None);
        let c = last.culprit.as_ref().map(|c| (c.rank, c.reason.as_str().to_string()));
        (pending, first.status, last.status, c)
    };
    let straight = answer(0);
    assert_eq!(
        straight,
        (
            Status::Pending,
            Status::Resolved,
            Status::Resolved,
            Some((1, "lease_expired".to_string()))
        )
    );
    for skew in [-600_000, -60_000, -10_000, 10_000, 60_000, 600_000] {
        assert_eq!(answer(skew), straight, "writers {skew} ms off");
    }
}

/// The death window counts by the revision of a death's end key, not by `at`: a death six
/// minutes old (its end key written) is no candidate of a room recorded now, even when the
/// certificate's `at` claims it happened a second ago; a fresh one is, whatever its `at`.
#[test]
fn the_death_window_is_measured_here_not_by_the_certificates_at() {
    let mut w = World::new();
    group_of_four(&mut w);
    let inc = w.incarnation(G, 3);
    let down = serde_json::json!({"v":1,"group":G,"rank":3,"incarnation":inc.to_string(),"reason":"oom_host",
        "detail":"killed","source":"agent","at":rootrank_core::time::format_ms(w.now - 3_600_000),"exit":null,"log_tail":null});
    w.put_raw(&key_down(G, 3, inc), down.to_string().into_bytes(), 0);
    w.advance(1_000);
    w.record(G, 0, 91, "propagated", "other");
    let c = w
        .verdict(91, None)
        .culprit
        .expect("a fresh death counts, whatever its at says");
    assert_eq!(c.rank, 3);
    w.advance(360_000); // the death window's end key is written
    w.record(G, 1, 92, "propagated", "other");
    w.advance(10_000);
    assert_eq!(
        w.verdict(92, None).status,
        Status::Unknown,
        "{}",
        w.verdict(92, None).explain
    );
    assert_eq!(
        w.verdict(91, None).culprit.map(|c| c.rank),
        Some(3),
        "resolved is final"
    );
}

/// The coordinator's certificates for the live keys of `ranks` that vanished since output
/// `from`, with `reason` (what `rootrank_coordinator::lease_doubt` writes after etcd was silent).
fn certify_vanished(w: &mut World, from: usize, ranks: &[u32], reason: &str) {
    let vanished: Vec<Output> = w.outputs[from..]
        .iter()
        .filter(|o| matches!(o, Output::LiveKeyVanished { rank, .. } if ranks.contains(rank)))
        .cloned()
        .collect();
    for o in vanished {
        let mut down = o.into_coordinator_certificate().unwrap();
        down.reason = rootrank_core::Reason::new(reason).unwrap();
        let k = key_down(down.group.as_str(), down.rank, down.incarnation.lease_id());
        w.put_raw(&k, serde_json::to_vec(&down).unwrap(), 0);
    }
}

#[test]
fn v4_a_vanished_live_key_names_no_culprit_until_it_is_certified() {
    let mut w = World::new();
    w.coordinator_writes = false; // this test is the coordinator
    group_of_four(&mut w);
    w.record(G, 0, 70, "propagated", "other");
    let from = w.outputs.len();
    w.vanish(G, 1);
    w.advance(60_000);
    let v = w.verdict(70, None);
    assert_eq!(v.status, Status::Pending, "{}", v.explain);
    assert!(v.explain.contains("not certified yet"), "{}", v.explain);
    certify_vanished(&mut w, from, &[1], "lease_expired");
    let v = w.verdict(70, None);
    assert_eq!(v.status, Status::Resolved, "{}", v.explain);
    let c = v.culprit.unwrap();
    assert_eq!((c.rank, c.reason.as_str()), (1, "lease_expired"));
    // The resolution is announced once, at the certificate's revision.
    let resolved: Vec<i64> = w.outputs[from..]
        .iter()
        .filter_map(|o| match o {
            Output::RoomResolved { revision, .. } => Some(*revision),
            _ => None,
        })
        .collect();
    assert_eq!(resolved, vec![w.rev]);
    // A restarted replica agrees.
    let snap = snapshot_index(&w);
    assert_eq!(verdict_of(&snap, 70, None, w.now), w.verdict(70, None));
}

#[test]
fn v4_a_lost_lease_is_no_death_but_a_rank_that_died_in_the_stall_still_is() {
    let mut w = World::new();
    w.coordinator_writes = false;
    group_of_four(&mut w);
    let old: Vec<i64> = (0..4).map(|r| w.incarnation(G, r)).collect();
    // Rooms in flight when etcd stalled: rank 0 saw only the generic error of 71; rank 2
    // failed 72 itself.
    w.record(G, 0, 71, "propagated", "other");
    w.record(G, 2, 72, "local", "nixl_error");
    // etcd resumes: every lease ran out. Ranks 0-2's processes register again; rank 3 died.
    let from = w.outputs.len();
    for r in 0..4 {
        w.vanish(G, r);
    }
    let still_in_doubt = w.verdict(71, None);
    assert_eq!(still_in_doubt.status, Status::Pending, "{}", still_in_doubt.explain);
    for r in 0..3 {
        w.register_again(G, r, 4, 5000);
    }
    let g = rootrank_core::GroupId::new(G).unwrap();
    for r in 0..3 {
        let inc = rootrank_core::Incarnation::new(old[r as usize]).unwrap();
        let lived = w.index.lived_on(&g, r, inc).expect("the same process registered again");
        assert_eq!(lived.pid, 1000 + r);
    }
    let rank3 = rootrank_core::Incarnation::new(old[3]).unwrap();
    assert_eq!(w.index.lived_on(&g, 3, rank3), None, "rank 3 did not come back");
    // What the coordinator writes then: lease_lost for 0-2, lease_expired for 3 (later: its
    // hold runs out).
    let vanished_at: Vec<i64> = w.outputs[from..]
        .iter()
        .filter_map(|o| match o {
            Output::LiveKeyVanished { revision, .. } => Some(*revision),
            _ => None,
        })
        .collect();
    certify_vanished(&mut w, from, &[0, 1, 2], "lease_lost");
    // What the events stream says of each vanish, at the vanish's revision (a replica that
    // applies the vanish and the other replica's certificate in one batch): not certified.
    for r in 0..3 {
        let inc = rootrank_core::Incarnation::new(old[r as usize]).unwrap();
        assert_eq!(
            w.index.death_certified(&g, r, inc, vanished_at[r as usize]),
            Some(false)
        );
        assert_eq!(w.index.death_certified(&g, r, inc, w.rev), Some(true));
    }
    let v = w.verdict(71, None);
    assert_eq!(v.status, Status::Pending, "rank 3 is not certified yet: {}", v.explain);
    certify_vanished(&mut w, from, &[3], "lease_expired");

    let v = w.verdict(71, None);
    assert_eq!(v.status, Status::Resolved, "{}", v.explain);
    let c = v.culprit.unwrap();
    assert_eq!(
        (c.rank, c.reason.as_str()),
        (3, "lease_expired"),
        "never a rank that lived on"
    );
    let c = w.verdict(72, None).culprit.unwrap();
    assert_eq!(
        (c.rank, c.reason.as_str()),
        (2, "nixl_error"),
        "its own record still counts"
    );

    // A group where every lease was lost and nobody died: no culprit, ever.
    let mut w = World::new();
    w.coordinator_writes = false;
    group_of_four(&mut w);
    w.record(G, 0, 73, "propagated", "other");
    let from = w.outputs.len();
    for r in 0..4 {
        w.vanish(G, r);
        w.register_again(G, r, 4, 5000);
    }
    certify_vanished(&mut w, from, &[0, 1, 2, 3], "lease_lost");
    w.advance(6_001);
    let ends: Vec<Output> = w.index.handle_timeout(w.now);
    for o in &ends {
        w.write_window_end(o);
    }
    let v = w.verdict(73, None);
    assert_eq!(v.status, Status::Unknown, "{}", v.explain);
    assert!(v.culprit.is_none());
    // A process that really restarted is no lease lost (a new start time).
    let inc = w.incarnation(G, 1);
    w.vanish(G, 1);
    w.register(G, 1, 4, 5000);
    let g = rootrank_core::GroupId::new(G).unwrap();
    assert_eq!(
        w.index.lived_on(&g, 1, rootrank_core::Incarnation::new(inc).unwrap()),
        None
    );
}

#[test]
fn retry_advice_names_what_to_avoid_only_when_it_is_known() {
    let mut w = World::new();
    let (a, b) = ("prefill-a", "prefill-b");
    for r in 0..2 {
        register_prefill(&mut w, a, r, 2, "10.0.0.5:8998");
    }
    register_prefill(&mut w, b, 0, 1, "10.0.0.6:8998");
    w.register(D, 0, 1, 5000);
    // The decode only knows its prefill peer failed: while a death could still show up,
    // a retry may land on the very instance that is dying.
    let peer = serde_json::json!({"endpoint":"10.0.0.5:8998","rank":1});
    w.record_with_peer(D, 0, 90, "peer_reported", "other", peer);
    let v = w.verdict(90, Some(D));
    assert_eq!(v.status, Status::Pending, "{}", v.explain);
    assert!(!v.retry.safe && v.retry.avoid.is_empty(), "{:?}", v.retry);
    // Prefill A rank 1 dies: retry elsewhere, never on A (the whole instance is out).
    w.certify(a, 1, "oom_host", "watchdog");
    let v = w.verdict(90, Some(D));
    assert_eq!(v.status, Status::Resolved, "{}", v.explain);
    assert!(v.retry.safe, "{:?}", v.retry);
    let avoid: Vec<_> = v
        .retry
        .avoid
        .iter()
        .map(|x| (x.group.as_str(), x.endpoints.clone(), x.dead))
        .collect();
    assert_eq!(avoid, vec![(a, vec!["10.0.0.5:8998".to_string()], true)]);
    assert!(v.retry.why.contains("avoid prefill-a (a rank died)"), "{}", v.retry.why);
    // The compact answer carries the same advice, still small.
    let compact = rootrank_core::CompactVerdict::from(&v);
    assert_eq!(
        (compact.retry.safe, compact.retry.avoid.clone()),
        (true, v.retry.avoid.clone())
    );
    let text = serde_json::to_string(&compact).unwrap();
    assert!(text.len() <= 320, "{} bytes: {text}", text.len());

    // Prefill B's write failed because the decode rank died: avoid the decode, not B.
    w.record_with_peer(b, 0, 91, "local", "nixl_error", serde_json::json!({"group":D,"rank":0}));
    w.certify(D, 0, "oom_host", "watchdog");
    let v = w.verdict(91, None);
    assert_eq!((v.status, v.action), (Status::Resolved, Action::Abort), "{}", v.explain);
    let avoid: Vec<_> = v.retry.avoid.iter().map(|x| (x.group.as_str(), x.dead)).collect();
    assert_eq!(avoid, vec![(D, true)], "{:?}", v.retry);

    // Nothing of ours failed: safe, nothing to avoid. Aborted on purpose: not safe.
    let mut w = World::new();
    register_prefill(&mut w, b, 0, 1, "10.0.0.6:8998");
    w.register(D, 0, 1, 5000);
    w.record_with_peer(
        D,
        0,
        92,
        "peer_reported",
        "other",
        serde_json::json!({"endpoint":"10.9.9.9:1"}),
    );
    let v = w.verdict(92, Some(D));
    assert_eq!(v.status, Status::Unknown);
    assert!(v.retry.safe && v.retry.avoid.is_empty(), "{:?}", v.retry);
    w.record(b, 0, 93, "local", "aborted");
    let v = w.verdict(93, None);
    assert_eq!(v.status, Status::Resolved);
    assert!(!v.retry.safe && v.retry.avoid.is_empty(), "{:?}", v.retry);
}
