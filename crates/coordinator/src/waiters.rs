//! Long polls wait on their room, not on every revision. The follower wakes a room's waiters
//! when something about that room changed (a record, its resolution), and every waiter when
//! something any room may depend on changed (a rank's state, a reload, the loss of etcd: a
//! replica that is no longer current answers 503 at once). A waiter also looks again when its
//! verdict may change by time alone (`Index::verdict_wait`), so nothing else wakes it: a
//! million waiting polls cost nothing per etcd event that is not theirs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use rootrank_core::RoomId;
use tokio::sync::Notify;

#[derive(Default)]
pub struct RoomWaiters {
    rooms: Mutex<HashMap<RoomId, Arc<Notify>>>,
}

/// One long poll's registration; leaving (drop) forgets the room once nobody waits on it.
pub struct RoomWaiter<'a> {
    waiters: &'a RoomWaiters,
    room: RoomId,
    notify: Arc<Notify>,
}

impl RoomWaiters {
    pub fn watch(&self, room: RoomId) -> RoomWaiter<'_> {
        let notify = self
            .lock()
            .entry(room)
            .or_insert_with(|| Arc::new(Notify::new()))
            .clone();
        RoomWaiter {
            waiters: self,
            room,
            notify,
        }
    }

    /// Something about `room` changed.
    pub fn wake(&self, room: RoomId) {
        if let Some(n) = self.lock().get(&room) {
            n.notify_waiters();
        }
    }

    /// Something every room may depend on changed.
    pub fn wake_all(&self) {
        for n in self.lock().values() {
            n.notify_waiters();
        }
    }

    /// Rooms somebody waits on (for tests and metrics).
    pub fn rooms(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<RoomId, Arc<Notify>>> {
        // The map holds no invariant a panic could break halfway.
        self.rooms.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl RoomWaiter<'_> {
    /// Armed before the waiter looks at the index, so a wake between its look and its wait is
    /// not lost (`Notify::notify_waiters` wakes only futures that exist).
    pub fn notify(&self) -> &Notify {
        &self.notify
    }
}

impl Drop for RoomWaiter<'_> {
    fn drop(&mut self) {
        let mut rooms = self.waiters.lock();
        // The map's reference and ours: nobody else waits on this room.
        if rooms.get(&self.room).is_some_and(|n| Arc::strong_count(n) == 2) {
            rooms.remove(&self.room);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn room(n: u64) -> RoomId {
        RoomId::new(n).unwrap()
    }

    #[tokio::test]
    async fn a_wake_reaches_the_rooms_waiters_only() {
        let w = RoomWaiters::default();
        let a = w.watch(room(1));
        let b = w.watch(room(2));
        let fa = a.notify().notified();
        let fb = b.notify().notified();
        tokio::pin!(fa, fb);
        fa.as_mut().enable();
        fb.as_mut().enable();
        w.wake(room(1));
        assert!(tokio::time::timeout(Duration::from_secs(5), fa).await.is_ok());
        assert!(tokio::time::timeout(Duration::from_millis(50), fb).await.is_err());
    }

    #[tokio::test]
    async fn wake_all_reaches_every_waiter_and_a_wake_before_the_wait_is_not_lost() {
        let w = RoomWaiters::default();
        let a = w.watch(room(1));
        let b = w.watch(room(2));
        let fa = a.notify().notified();
        let fb = b.notify().notified();
        tokio::pin!(fa, fb);
        fa.as_mut().enable();
        fb.as_mut().enable();
        w.wake_all();
        // Woken although the wake came before the await.
        assert!(tokio::time::timeout(Duration::from_secs(5), fa).await.is_ok());
        assert!(tokio::time::timeout(Duration::from_secs(5), fb).await.is_ok());
    }

    #[test]
    fn a_room_is_forgotten_when_its_last_waiter_leaves() {
        let w = RoomWaiters::default();
        let a = w.watch(room(1));
        let b = w.watch(room(1));
        let c = w.watch(room(2));
        assert_eq!(w.rooms(), 2);
        drop(a);
        assert_eq!(w.rooms(), 2, "b still waits on room 1");
        drop(b);
        drop(c);
        assert_eq!(w.rooms(), 0);
    }
}
