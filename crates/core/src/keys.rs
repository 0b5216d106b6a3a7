//! The etcd key layout (SPEC section 4), in both directions.
//!
//! ```text
//! {p}/groups/{group}/ranks/{rank}/live
//! {p}/groups/{group}/ranks/{rank}/down/{incarnation}
//! {p}/groups/{group}/ranks/{rank}/nixl          (rootrank extension: NIXL agent metadata)
//! {p}/groups/{group}/ranks/{rank}/stall         (v3: RankStall, on the liveness lease)
//! {p}/groups/{group}/rooms/{room}/ranks/{rank}
//! {p}/groups/_hosts/{host}/{group}/{rank}/live   (a copy of the live record, same lease)
//! {p}/groups/_hosts/{host}/{group}/{rank}/stall  (a copy of the stall record, same lease)
//! {p}/coordinators/...
//! {p}/coordinators/windows/rooms/{room}                            (v4: a window's end)
//! {p}/coordinators/windows/deaths/{group}/{rank}/{incarnation}
//! {p}/coordinators/windows/victims/{group}/{rank}/{incarnation}
//! ```

use crate::ids::{parse_rank, GroupId, Incarnation, Rank, RoomId};

/// What a key under the prefix names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyKind {
    Live {
        group: GroupId,
        rank: Rank,
    },
    Down {
        group: GroupId,
        rank: Rank,
        incarnation: Incarnation,
    },
    /// A rank's NIXL agent metadata, on its liveness lease (used by the transfer agent).
    Nixl {
        group: GroupId,
        rank: Rank,
    },
    /// v3: the rank is alive but its loop stopped advancing (RankStall, on its liveness lease).
    Stall {
        group: GroupId,
        rank: Rank,
    },
    Room {
        group: GroupId,
        room: RoomId,
        rank: Rank,
    },
    /// v4: a coordinator's record that a window of SPEC section 5 ended (see [`Window`]).
    WindowEnd(Window),
    /// A copy of a rank's live or stall record under its host (written with it, on the same
    /// lease, so both have the same revisions): what `node-watch` watches, so its watch
    /// carries its host's ranks only, whatever the fleet's size. Under `{p}/groups/` because
    /// that is all a rank may write (SPEC section 7); `_` never starts a group id.
    HostCopy {
        host: String,
        group: GroupId,
        rank: Rank,
        of: HostCopyOf,
    },
    Coordinator,
}

/// A window of SPEC section 5, measured on a coordinator's monotonic clock from the revision
/// that opened it. The first coordinator whose clock sees it end writes its end key
/// (create-only), so every replica, and one that loads later, closes it at the same revision.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Window {
    /// A room's pending window (rule 3), opened by its first record: deaths after its end are
    /// no candidates of the room.
    Room(RoomId),
    /// A death's death window: a room whose first record comes after its end does not count it.
    Death(GroupId, Rank, Incarnation),
    /// A victim's window (rule 7): a candidate after its end no longer outranks the victim.
    Victim(GroupId, Rank, Incarnation),
}

/// Which record a [`KeyKind::HostCopy`] copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostCopyOf {
    Live,
    Stall,
}

/// Whether `host` can name a host in a key: 1-253 characters of a host name's
/// ([A-Za-z0-9._-]). A rank whose host is anything else gets no host copies (and so is seen
/// by a `node-watch --watch-scope fleet` only).
pub fn is_key_host(host: &str) -> bool {
    !host.is_empty()
        && host.len() <= 253
        && host
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'))
        && host != "."
        && host != ".."
}

/// Builds and parses keys under one prefix.
#[derive(Clone, Debug)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    /// `prefix` without a trailing slash, e.g. `/rootrank/v1`.
    pub fn new(prefix: &str) -> Self {
        Keys {
            prefix: prefix.trim_end_matches('/').to_string(),
        }
    }
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
    /// Everything rootrank owns, for the coordinator's snapshot and watch.
    pub fn root(&self) -> String {
        format!("{}/", self.prefix)
    }
    pub fn live(&self, group: &GroupId, rank: Rank) -> String {
        format!("{}/groups/{group}/ranks/{rank}/live", self.prefix)
    }
    pub fn down(&self, group: &GroupId, rank: Rank, incarnation: Incarnation) -> String {
        format!("{}/groups/{group}/ranks/{rank}/down/{incarnation}", self.prefix)
    }
    /// A certificate key no rank has, for a start-up write-permission probe that etcd checks
    /// but never applies (`rootrank_store::connect_checked`).
    pub fn probe_certificate(&self) -> String {
        format!("{}/groups/rootrank-permission-probe/ranks/0/down/1", self.prefix)
    }
    pub fn nixl(&self, group: &GroupId, rank: Rank) -> String {
        self.rank_attachment(group, rank, "nixl")
    }
    pub fn stall(&self, group: &GroupId, rank: Rank) -> String {
        self.rank_attachment(group, rank, "stall")
    }
    /// A key an agent keeps on its rank's liveness lease (`nixl` is the one rootrank uses).
    pub fn rank_attachment(&self, group: &GroupId, rank: Rank, suffix: &str) -> String {
        format!("{}/groups/{group}/ranks/{rank}/{suffix}", self.prefix)
    }
    pub fn room(&self, group: &GroupId, room: RoomId, rank: Rank) -> String {
        format!("{}/groups/{group}/rooms/{room}/ranks/{rank}", self.prefix)
    }
    /// Every host's copies (`HostCopy`): what the coordinator's snapshot skips.
    pub fn all_host_copies(&self) -> String {
        format!("{}/groups/_hosts/", self.prefix)
    }
    /// What `node-watch` on `host` watches: the copies of its ranks' live and stall records.
    pub fn host_copies(&self, host: &str) -> String {
        format!("{}/groups/_hosts/{host}/", self.prefix)
    }
    /// Every key of one rank under its group: live, stall, attachments and certificates (the
    /// trailing `/` keeps rank 1 from reading rank 10's).
    pub fn rank_keys(&self, group: &GroupId, rank: Rank) -> String {
        format!("{}/groups/{group}/ranks/{rank}/", self.prefix)
    }
    /// One rank's copies under its host; `None` as for [`Keys::host_copy`].
    pub fn host_copies_of(&self, host: &str, group: &GroupId, rank: Rank) -> Option<String> {
        is_key_host(host).then(|| format!("{}{group}/{rank}/", self.host_copies(host)))
    }
    /// The copy of a rank's live or stall record under its host; `None` when `host` cannot
    /// be a key segment ([`is_key_host`]).
    pub fn host_copy(&self, host: &str, group: &GroupId, rank: Rank, of: HostCopyOf) -> Option<String> {
        let leaf = match of {
            HostCopyOf::Live => "live",
            HostCopyOf::Stall => "stall",
        };
        is_key_host(host).then(|| format!("{}{group}/{rank}/{leaf}", self.host_copies(host)))
    }
    pub fn coordinators(&self) -> String {
        format!("{}/coordinators/", self.prefix)
    }
    /// Where a coordinator records that `window` ended.
    pub fn window_end(&self, window: &Window) -> String {
        match window {
            Window::Room(room) => format!("{}/coordinators/windows/rooms/{room}", self.prefix),
            Window::Death(g, r, i) => format!("{}/coordinators/windows/deaths/{g}/{r}/{i}", self.prefix),
            Window::Victim(g, r, i) => format!("{}/coordinators/windows/victims/{g}/{r}/{i}", self.prefix),
        }
    }

    /// Parses a key; `None` for anything that is not rootrank's layout.
    pub fn parse(&self, key: &[u8]) -> Option<KeyKind> {
        let key = std::str::from_utf8(key).ok()?;
        let rest = key.strip_prefix(self.prefix.as_str())?.strip_prefix('/')?;
        let parts: Vec<&str> = rest.split('/').collect();
        match parts.as_slice() {
            ["coordinators", "windows", "rooms", room] => {
                Some(KeyKind::WindowEnd(Window::Room(RoomId::parse(room).ok()?)))
            }
            ["coordinators", "windows", kind @ ("deaths" | "victims"), g, r, i] => {
                let (g, r, i) = (GroupId::new(g).ok()?, parse_rank(r).ok()?, Incarnation::parse(i).ok()?);
                Some(KeyKind::WindowEnd(if *kind == "deaths" {
                    Window::Death(g, r, i)
                } else {
                    Window::Victim(g, r, i)
                }))
            }
            ["coordinators", "windows", ..] => None,
            ["coordinators", ..] => Some(KeyKind::Coordinator),
            ["groups", "_hosts", host, g, r, leaf @ ("live" | "stall")] if is_key_host(host) => {
                Some(KeyKind::HostCopy {
                    host: host.to_string(),
                    group: GroupId::new(g).ok()?,
                    rank: parse_rank(r).ok()?,
                    of: if *leaf == "live" {
                        HostCopyOf::Live
                    } else {
                        HostCopyOf::Stall
                    },
                })
            }
            ["groups", g, "ranks", r, "live"] => Some(KeyKind::Live {
                group: GroupId::new(g).ok()?,
                rank: parse_rank(r).ok()?,
            }),
            ["groups", g, "ranks", r, "nixl"] => Some(KeyKind::Nixl {
                group: GroupId::new(g).ok()?,
                rank: parse_rank(r).ok()?,
            }),
            ["groups", g, "ranks", r, "stall"] => Some(KeyKind::Stall {
                group: GroupId::new(g).ok()?,
                rank: parse_rank(r).ok()?,
            }),
            ["groups", g, "ranks", r, "down", i] => Some(KeyKind::Down {
                group: GroupId::new(g).ok()?,
                rank: parse_rank(r).ok()?,
                incarnation: Incarnation::parse(i).ok()?,
            }),
            ["groups", g, "rooms", room, "ranks", r] => Some(KeyKind::Room {
                group: GroupId::new(g).ok()?,
                room: RoomId::parse(room).ok()?,
                rank: parse_rank(r).ok()?,
            }),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let k = Keys::new("/rootrank/v1/");
        let g = GroupId::new("10.0.0.5:8998").unwrap();
        let room = RoomId::new(i64::MAX as u64).unwrap();
        let inc = Incarnation::new(7587).unwrap();
        assert_eq!(
            k.parse(k.live(&g, 3).as_bytes()),
            Some(KeyKind::Live {
                group: g.clone(),
                rank: 3
            })
        );
        assert_eq!(
            k.parse(k.down(&g, 3, inc).as_bytes()),
            Some(KeyKind::Down {
                group: g.clone(),
                rank: 3,
                incarnation: inc
            })
        );
        assert_eq!(
            k.parse(k.room(&g, room, 1).as_bytes()),
            Some(KeyKind::Room {
                group: g.clone(),
                room,
                rank: 1
            })
        );
        assert_eq!(
            k.parse(k.stall(&g, 1).as_bytes()),
            Some(KeyKind::Stall {
                group: g.clone(),
                rank: 1
            })
        );
        assert_eq!(
            k.parse(k.nixl(&g, 0).as_bytes()),
            Some(KeyKind::Nixl {
                group: g.clone(),
                rank: 0
            })
        );
        for of in [HostCopyOf::Live, HostCopyOf::Stall] {
            let key = k.host_copy("gpu-node-7.dc1", &g, 3, of).unwrap();
            assert_eq!(
                k.parse(key.as_bytes()),
                Some(KeyKind::HostCopy {
                    host: "gpu-node-7.dc1".into(),
                    group: g.clone(),
                    rank: 3,
                    of
                })
            );
            assert!(key.starts_with(&k.host_copies("gpu-node-7.dc1")));
        }
        assert_eq!(
            k.host_copy("h", &g, 0, HostCopyOf::Live).as_deref(),
            Some("/rootrank/v1/groups/_hosts/h/10.0.0.5:8998/0/live")
        );
        for bad_host in ["", "a/b", "..", "h st"] {
            assert_eq!(k.host_copy(bad_host, &g, 0, HostCopyOf::Live), None, "{bad_host:?}");
        }
        for w in [
            Window::Room(room),
            Window::Death(g.clone(), 2, inc),
            Window::Victim(g.clone(), 0, inc),
        ] {
            assert_eq!(k.parse(k.window_end(&w).as_bytes()), Some(KeyKind::WindowEnd(w)));
        }
        assert_eq!(
            k.room(&GroupId::new("p").unwrap(), RoomId::new(5).unwrap(), 0),
            "/rootrank/v1/groups/p/rooms/5/ranks/0"
        );
    }

    #[test]
    fn rejects_foreign_and_malformed_keys() {
        let k = Keys::new("/rootrank/v1");
        for bad in [
            "/other/groups/g/ranks/0/live",
            "/rootrank/v1x/groups/g/ranks/0/live",
            "/rootrank/v1/groups/g/ranks/-1/live",
            "/rootrank/v1/groups/g/ranks/0/live/extra",
            "/rootrank/v1/groups/g/rooms/abc/ranks/0",
            "/rootrank/v1/groups/g/ranks/0/down/0",
            "/rootrank/v1/groups/-g/ranks/0/live",
            "/rootrank/v1/coordinators/windows/rooms/02009",
            "/rootrank/v1/coordinators/windows/deaths/g/0",
            "/rootrank/v1/groups/_hosts/h/g/0/down",
            "/rootrank/v1/groups/_hosts/../g/0/live",
            "/rootrank/v1/groups/_hosts/h/-g/0/live",
        ] {
            assert_eq!(k.parse(bad.as_bytes()), None, "{bad}");
        }
        assert_eq!(k.parse(b"\xff\xfe"), None);
    }
}
