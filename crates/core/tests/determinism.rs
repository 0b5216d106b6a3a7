//! Outputs are a function of the events: two replicas fed the same events emit the same
//! outputs in the same order (the order reaches logs, metrics and the certificate writer).

mod common;
use common::*;
use rootrank_core::Output;

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
            Output::RoomResolved { room, .. } => Some(room.get()),
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
