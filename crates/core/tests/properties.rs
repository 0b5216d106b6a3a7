//! Properties of the verdict core over random histories of a group of four ranks.

mod common;
use common::*;
use proptest::prelude::*;
use rootrank_core::{GroupId, Index, Origin, RankStateKind, Status};

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
            prop_oneof![Just("oom_host"), Just("shutdown"), Just("gpu_xid")],
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
        prop_assert_eq!(verdicts(&w.index, w.now), verdicts(&w.snapshot_index(), w.now));
    }

    /// The first local record always wins, and a propagated record is never a culprit.
    #[test]
    fn first_local_wins_and_propagated_never_blamed(ops in prop::collection::vec(op(), 0..40)) {
        let w = run(&ops);
        for room in ROOMS {
            let v = w.verdict(room, None);
            let first_local = w.events.iter().find_map(|ev| match ev {
                rootrank_core::Event::Put { key, value, revision, .. } if String::from_utf8_lossy(key).contains(&format!("/rooms/{room}/")) => {
                    let r = rootrank_core::RoomFailure::parse(value).ok()?;
                    (r.origin == Origin::Local).then_some((r.rank, *revision))
                }
                _ => None,
            });
            match first_local {
                Some((rank, _)) => {
                    let c = v.culprit.clone().unwrap();
                    prop_assert_eq!((c.rank, c.source), (rank, "room_record"));
                }
                None => prop_assert!(v.culprit.as_ref().is_none_or(|c| c.source != "room_record")),
            }
            if let Some(c) = &v.culprit {
                prop_assert_ne!(c.reason.as_str(), "shutdown");
            }
            prop_assert_eq!(v.status == Status::Resolved, v.culprit.is_some());
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
