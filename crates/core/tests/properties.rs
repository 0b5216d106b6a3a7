//! Properties of the verdict core over random histories of a group of four ranks.

mod common;
use common::*;
use proptest::prelude::*;
use rootrank_core::{CulpritSource, EvidenceKind, GroupId, Index, Origin, RankStateKind, Status};

const G: &str = "prefill-0";
const ROOMS: [u64; 3] = [1, 2, 9_223_372_036_854_775_807];

#[derive(Clone, Debug)]
enum Op {
    Advance(i64),
    Register(u32),
    Vanish(u32),
    Certify(u32, &'static str, &'static str),
    Record(u32, usize, bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0i64..8_000).prop_map(Op::Advance),
        (0u32..4).prop_map(Op::Register),
        (0u32..4).prop_map(Op::Vanish),
        (
            0u32..4,
            prop_oneof![Just("oom_host"), Just("shutdown"), Just("gpu_xid"), Just("peer_lost")],
            prop_oneof![Just("watchdog"), Just("agent"), Just("supervisor")]
        )
            .prop_map(|(r, reason, src)| Op::Certify(r, reason, src)),
        (0u32..4, 0usize..ROOMS.len(), any::<bool>()).prop_map(|(r, room, local)| Op::Record(r, room, local)),
    ]
}

/// Runs a history. Each rank registers at most twice (see ARCHITECTURE.md on reloads).
fn run(ops: &[Op]) -> World {
    let mut w = World::new();
    let mut registrations = [0u8; 4];
    for r in 0..4 {
        w.register(G, r, 4, 5000);
        registrations[r as usize] = 1;
    }
    for op in ops {
        match op {
            Op::Advance(ms) => {
                w.advance(*ms);
            }
            Op::Register(r) if registrations[*r as usize] < 2 => {
                registrations[*r as usize] += 1;
                w.register(G, *r, 4, 5000);
            }
            Op::Register(_) => {}
            Op::Vanish(r) => w.vanish(G, *r),
            Op::Certify(r, reason, src) => w.certify(G, *r, reason, src),
            Op::Record(r, room, local) => w.record(
                G,
                *r,
                ROOMS[*room],
                if *local { "local" } else { "propagated" },
                "nixl_error",
            ),
        }
    }
    w
}

fn verdicts(index: &Index, now: i64) -> Vec<serde_json::Value> {
    ROOMS
        .iter()
        .flat_map(|room| [None, Some(G)].map(|g| serde_json::to_value(verdict_of(index, *room, g, now)).unwrap()))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// A coordinator that reloads from etcd (restart, compaction) at any revision and then
    /// watches on answers exactly as one that watched the whole history.
    #[test]
    fn reload_at_any_revision_equals_watching(ops in prop::collection::vec(op(), 0..40), cut in 0usize..60) {
        let w = run(&ops);
        let cut = cut.min(w.events.len());
        // Replay: snapshot of the state as of event `cut`, then the rest incrementally.
        let mut state = std::collections::BTreeMap::new();
        for ev in &w.events[..cut] {
            match ev {
                rootrank_core::Event::Put { key, .. } => { state.insert(key.clone(), ev.clone()); }
                rootrank_core::Event::Delete { key, .. } => { state.remove(key); }
            }
        }
        let mut reloaded = Index::new(rootrank_core::IndexConfig::default());
        let snap_rev = w.events[..cut].last().map_or(0, |e| e.revision());
        reloaded.load_snapshot(state.into_values().collect(), snap_rev);
        for ev in &w.events[cut..] {
            reloaded.apply(ev.clone());
        }
        for now in [w.now, w.now + 3_000, w.now + 70_000] {
            prop_assert_eq!(verdicts(&w.index, now), verdicts(&reloaded, now));
        }
        prop_assert_eq!(verdicts(&w.index, w.now), verdicts(&snapshot_index(&w), w.now));
        // The history of root causes too, byte for byte (no map order leaks into it).
        let failures = |i: &Index| serde_json::to_string(&i.recent_failures(None, 100)).unwrap();
        prop_assert_eq!(failures(&w.index), failures(&reloaded));
        prop_assert_eq!(failures(&w.index), failures(&snapshot_index(&w)));
        // A short page is the head of the whole list (it stops reading the log early).
        for index in [&w.index, &reloaded] {
            let all = index.recent_failures(None, 100);
            for limit in 0..=all.len() {
                let page = serde_json::to_string(&index.recent_failures(None, limit)).unwrap();
                prop_assert_eq!(page, serde_json::to_string(&all[..limit]).unwrap());
            }
        }
    }

    /// A snapshot read in parallel parts arrives in any order: the index it builds is the
    /// same as from one read in key order (verdicts, root-cause history, group views).
    #[test]
    fn a_snapshot_in_any_order_builds_the_same_index(ops in prop::collection::vec(op(), 0..40), seed in any::<u64>()) {
        let w = run(&ops);
        let ordered = snapshot_index(&w);
        let mut kvs: Vec<rootrank_core::Event> = snapshot_events(&w);
        // Fisher-Yates with a seeded splitmix64: a reproducible permutation per case.
        let mut state = seed;
        for i in (1..kvs.len()).rev() {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            kvs.swap(i, (z % (i as u64 + 1)) as usize);
        }
        let mut shuffled = Index::new(rootrank_core::IndexConfig::default());
        let half = kvs.len() / 2;
        let rest = kvs.split_off(half);
        shuffled.load_snapshot_page(rest);
        shuffled.load_snapshot_page(kvs);
        shuffled.finish_snapshot(w.rev);
        for now in [w.now, w.now + 3_000, w.now + 70_000] {
            prop_assert_eq!(verdicts(&ordered, now), verdicts(&shuffled, now));
        }
        let failures = |i: &Index| serde_json::to_string(&i.recent_failures(None, 100)).unwrap();
        prop_assert_eq!(failures(&ordered), failures(&shuffled));
        let group = |i: &Index| serde_json::to_string(&i.group(&GroupId::new(G).unwrap())).unwrap();
        prop_assert_eq!(group(&ordered), group(&shuffled));
    }

    /// Rules 1 and 2 (v2): the culprit is the earliest candidate by revision (a `local`
    /// record or a death), a propagated record or a clean shutdown never is; and once a room
    /// with records is resolved, every later revision names the same (group, rank,
    /// incarnation), whatever the time of the question. Checked after every event.
    #[test]
    fn resolved_is_final_and_propagated_never_blamed(ops in prop::collection::vec(op(), 0..40)) {
        let w = run(&ops);
        let mut index = Index::new(rootrank_core::IndexConfig::default());
        let mut first: std::collections::BTreeMap<(u64, bool), (String, u32, Option<String>)> = Default::default();
        for ev in &w.events {
            let now = match ev {
                rootrank_core::Event::Put { observed_at_ms, .. } | rootrank_core::Event::Delete { observed_at_ms, .. } => *observed_at_ms,
            };
            index.apply(ev.clone());
            for room in ROOMS {
                for g in [None, Some(G)] {
                    for at in [now, now + 3_000, now + 70_000] {
                        let v = verdict_of(&index, room, g, at);
                        prop_assert_eq!(v.status == Status::Resolved, v.culprit.is_some());
                        let Some(c) = &v.culprit else { continue };
                        prop_assert_ne!(c.reason.as_str(), "shutdown");
                        if c.source == CulpritSource::RoomRecord {
                            let local = v.evidence.iter().any(|e| e.rank == c.rank && e.origin == Some(Origin::Local));
                            prop_assert!(local, "a culprit record must be local");
                        }
                        // Rule 1: no candidate in the evidence is earlier than the culprit; rule 7:
                        // a victim (peer_lost) only when no other candidate came before it.
                        let is_victim = |e: &rootrank_core::Evidence| e.origin.is_none() && e.reason.as_str() == "peer_lost"
                            && v.victims.iter().any(|x| x.group == e.group && x.rank == e.rank);
                        let victim = c.reason.as_str() == "peer_lost" && v.victims.iter().any(|x| x.rank == c.rank);
                        let culprit_rev = v.evidence.iter()
                            .filter(|e| e.rank == c.rank && (e.origin == Some(Origin::Local) || e.origin.is_none()))
                            .filter(|e| victim == is_victim(e))
                            .map(|e| e.revision).min();
                        let earliest = v.evidence.iter()
                            .filter(|e| e.origin != Some(Origin::Propagated) && !is_victim(e))
                            .map(|e| e.revision).min();
                        if victim {
                            prop_assert!(earliest.is_none_or(|e| Some(e) > culprit_rev), "a victim was named over an earlier candidate");
                        } else {
                            prop_assert_eq!(culprit_rev, earliest);
                        }
                        if v.evidence.iter().all(|e| e.kind != EvidenceKind::RoomRecord) {
                            continue; // without records the question's time sets the windows
                        }
                        if victim && at != now {
                            continue; // a victim stands once its window passed: only now says so
                        }
                        let who = (c.group.to_string(), c.rank, c.incarnation.map(|i| i.to_string()));
                        let seen = first.entry((room, g.is_some())).or_insert_with(|| who.clone());
                        prop_assert_eq!(&*seen, &who, "room {} resolved once, then named another culprit", room);
                    }
                }
            }
        }
    }

    /// v3 `/v1/events` across a coordinator restart: a reader that saw the events of a
    /// watching replica up to revision `cut`, then resumes on a replica restarted from etcd
    /// (its catch-up after `cut`), ends with the same state as a reader that watched it all:
    /// every rank's last state and reason, and every resolved room.
    #[test]
    fn resuming_on_a_restarted_replica_misses_nothing(ops in prop::collection::vec(op(), 0..40), cut in 0i64..80) {
        use rootrank_core::{CatchUpEvent, Output};
        type Ranks = std::collections::BTreeMap<u32, (RankStateKind, Option<String>)>;
        fn fold_output(o: &Output, ranks: &mut Ranks, rooms: &mut std::collections::BTreeSet<u64>) {
            match o {
                Output::RankChanged { rank, state, reason, .. } => {
                    ranks.insert(*rank, (*state, reason.as_ref().map(|r| r.to_string())));
                }
                Output::RoomResolved { room, .. } => {
                    rooms.insert(room.get());
                }
                _ => {}
            }
        }
        let w = run(&ops);
        let (mut watched, mut watched_rooms) = (Ranks::new(), std::collections::BTreeSet::new());
        for o in &w.outputs {
            fold_output(o, &mut watched, &mut watched_rooms);
        }
        let (mut resumed, mut resumed_rooms) = (Ranks::new(), std::collections::BTreeSet::new());
        let revision_of = |o: &Output| match o {
            Output::RankChanged { revision, .. } | Output::RoomResolved { revision, .. } => Some(*revision),
            _ => None,
        };
        for o in w.outputs.iter().filter(|o| revision_of(o).is_some_and(|r| r <= cut)) {
            fold_output(o, &mut resumed, &mut resumed_rooms);
        }
        let restarted = snapshot_index(&w);
        let catch_up = restarted.catch_up(usize::MAX);
        prop_assert_eq!(catch_up.floor, 0);
        let revs: Vec<i64> = catch_up.events.iter().map(CatchUpEvent::revision).collect();
        prop_assert!(revs.windows(2).all(|p| p[0] <= p[1]), "not in revision order: {:?}", revs);
        for e in catch_up.events.iter().filter(|e| e.revision() > cut) {
            match e {
                CatchUpEvent::Rank { rank, state, reason, .. } => {
                    resumed.insert(*rank, (*state, reason.as_ref().map(|r| r.to_string())));
                }
                CatchUpEvent::Resolved { room, .. } => {
                    resumed_rooms.insert(room.get());
                }
            }
        }
        // Every room the watching replica announced. The catch-up may hold more: a room whose
        // pending window ran out with no event after it resolves in a verdict asked now, but a
        // watching replica announces it only at its next event (no timer feeds the index yet).
        prop_assert!(watched_rooms.is_subset(&resumed_rooms), "missed rooms: {:?} vs {:?}", watched_rooms, resumed_rooms);
        // Every rank registered at the start, so both readers know all four.
        prop_assert_eq!(&watched, &resumed);
        // Bounded: the oldest are dropped and the floor says from where the rest is whole.
        let small = restarted.catch_up(2);
        prop_assert!(small.events.len() <= 2);
        if catch_up.events.len() > 2 {
            prop_assert_eq!(small.floor, catch_up.events[catch_up.events.len() - 3].revision());
        }
    }

    /// A live rank is shown live unless its own incarnation has a certificate.
    #[test]
    fn old_certificates_never_mark_a_new_incarnation_down(ops in prop::collection::vec(op(), 0..40)) {
        let w = run(&ops);
        let view = w.index.group(&GroupId::new(G).unwrap()).unwrap();
        for r in 0..4u32 {
            let live_key = w.kv.get(&key_live(G, r));
            let state = view.ranks[r as usize].state;
            match live_key {
                Some((_, lease, _)) => {
                    let own_cert = w.kv.contains_key(&key_down(G, r, *lease));
                    prop_assert_eq!(state == RankStateKind::Live, !own_cert, "rank {} {:?}", r, state);
                }
                None => prop_assert_ne!(state, RankStateKind::Live),
            }
        }
    }
}

// Outputs are a function of the events: two replicas fed the same events emit the same
// outputs in the same order (the order reaches logs, metrics and the certificate writer).
fn resolved_after_a_death() -> Vec<u64> {
    let mut w = World::new();
    w.register("g", 0, 2, 5000);
    w.register("g", 1, 2, 5000);
    // Rooms that only rank 0's propagated records name wait for a death in the group.
    for i in 0..64u64 {
        w.record("g", 0, (i * 7919) % 1000 + 1, "propagated", "other");
    }
    w.outputs.clear();
    w.vanish("g", 1);
    w.outputs
        .iter()
        .filter_map(|o| match o {
            rootrank_core::Output::RoomResolved { room, .. } => Some(room.get()),
            _ => None,
        })
        .collect()
}

#[test]
fn a_death_resolves_the_rooms_waiting_on_it_in_room_order_on_every_replica() {
    let a = resolved_after_a_death();
    let b = resolved_after_a_death();
    assert_eq!(a.len(), 64);
    assert_eq!(a, b, "two replicas, same events, same outputs in the same order");
    assert!(a.windows(2).all(|w| w[0] < w[1]), "room order: {a:?}");
}
