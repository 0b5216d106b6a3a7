#![allow(dead_code)] // each test binary uses a part of it
//! A tiny etcd model for driving the index in tests: keys with leases and revisions, and the
//! coordinator's one write (a `lease_expired` certificate for a vanished live key). Only what
//! both `rules` and `properties` use is here; what one of them alone needs is in that file.

use std::collections::BTreeMap;

use rootrank_core::{time, Event, Index, IndexConfig, Output, RoomId, Verdict, VerdictQuery};
use serde_json::json;

pub const T0: i64 = 1_796_224_805_000;

pub struct World {
    pub index: Index,
    pub events: Vec<Event>,
    pub kv: BTreeMap<String, (Vec<u8>, i64, i64)>, // value, lease, mod_revision
    /// Each present key's create revision.
    pub created: BTreeMap<String, i64>,
    pub rev: i64,
    pub now: i64,
    next_lease: i64,
    pub leases: BTreeMap<(String, u32), i64>,
    /// Every writer of a certificate knows when the incarnation registered (the live key's
    /// revision), and says so.
    pub registered_at_revision: BTreeMap<i64, i64>,
    /// Each incarnation's lease TTL, which its certificates carry.
    pub ttl_of: BTreeMap<i64, u64>,
    /// Each incarnation's group size, which its certificates carry.
    pub size_of: BTreeMap<i64, u32>,
    pub outputs: Vec<Output>,
    /// Emulate the coordinator persisting vanished live keys as certificates.
    pub coordinator_writes: bool,
    /// When each rank's current process started (its live records' `started_at`).
    started_of: BTreeMap<(String, u32), String>,
}

pub fn key_live(g: &str, r: u32) -> String {
    format!("/rootrank/v1/groups/{g}/ranks/{r}/live")
}
pub fn key_down(g: &str, r: u32, inc: i64) -> String {
    format!("/rootrank/v1/groups/{g}/ranks/{r}/down/{inc}")
}
pub fn key_room(g: &str, room: u64, r: u32) -> String {
    format!("/rootrank/v1/groups/{g}/rooms/{room}/ranks/{r}")
}

impl Default for World {
    fn default() -> Self {
        Self::new()
    }
}

impl World {
    pub fn new() -> Self {
        World {
            index: Index::new(IndexConfig::default()),
            events: Vec::new(),
            kv: BTreeMap::new(),
            created: BTreeMap::new(),
            rev: 1,
            now: T0,
            next_lease: 7000,
            leases: BTreeMap::new(),
            registered_at_revision: BTreeMap::new(),
            ttl_of: BTreeMap::new(),
            size_of: BTreeMap::new(),
            outputs: Vec::new(),
            coordinator_writes: true,
            started_of: BTreeMap::new(),
        }
    }

    /// Time passes; as the coordinator does at its deadlines (`sync.rs`), the windows that
    /// ended are written as end keys, create-only (when `coordinator_writes`).
    pub fn advance(&mut self, ms: i64) -> &mut Self {
        self.now += ms;
        if self.coordinator_writes {
            let due = self.index.handle_timeout(self.now);
            self.outputs.extend(due.iter().cloned());
            for o in due {
                self.write_window_end(&o);
            }
        }
        self
    }

    /// Exactly what the coordinator writes for an `Output::WindowEnded`, create-only.
    pub fn write_window_end(&mut self, o: &Output) {
        let Some((window, end)) = o.clone().into_window_end() else {
            return;
        };
        let k = rootrank_core::Keys::new("/rootrank/v1").window_end(&window);
        if !self.kv.contains_key(&k) {
            self.put_raw(&k, serde_json::to_vec(&end).unwrap(), 0);
        }
    }

    fn emit(&mut self, ev: Event) {
        self.events.push(ev.clone());
        let out = self.index.apply(ev);
        let vanished: Vec<Output> = out
            .iter()
            .filter(|o| matches!(o, Output::LiveKeyVanished { .. }))
            .cloned()
            .collect();
        self.outputs.extend(out);
        if self.coordinator_writes {
            for o in vanished {
                // Exactly what the coordinator writes (`sync.rs`), create-if-absent.
                let Some(down) = o.into_coordinator_certificate() else {
                    continue;
                };
                let k = key_down(down.group.as_str(), down.rank, down.incarnation.lease_id());
                if !self.kv.contains_key(&k) {
                    self.put_raw(&k, serde_json::to_vec(&down).unwrap(), 0);
                }
            }
        }
    }

    pub fn put_raw(&mut self, key: &str, value: Vec<u8>, lease: i64) {
        self.rev += 1;
        self.kv.insert(key.to_string(), (value.clone(), lease, self.rev));
        let create_revision = *self.created.entry(key.to_string()).or_insert(self.rev);
        let ev = Event::Put {
            key: key.as_bytes().to_vec(),
            value,
            lease,
            revision: self.rev,
            create_revision,
            observed_at_ms: self.now,
        };
        self.emit(ev);
    }

    pub fn delete_raw(&mut self, key: &str) {
        if self.kv.remove(key).is_none() {
            return;
        }
        self.created.remove(key);
        self.rev += 1;
        let ev = Event::Delete {
            key: key.as_bytes().to_vec(),
            revision: self.rev,
            observed_at_ms: self.now,
        };
        self.emit(ev);
    }

    /// A rank registers a new incarnation; returns its lease id.
    pub fn register(&mut self, g: &str, r: u32, size: u32, ttl_ms: u64) -> i64 {
        self.register_with_agent(g, r, size, ttl_ms, None)
    }

    /// The same, naming the rank's NIXL agent in its live record.
    pub fn register_with_agent(&mut self, g: &str, r: u32, size: u32, ttl_ms: u64, nixl_agent: Option<&str>) -> i64 {
        self.started_of.insert((g.to_string(), r), time::format_ms(self.now));
        self.register_process(g, r, size, ttl_ms, nixl_agent)
    }

    /// The same process registers a new incarnation (its lease was lost, it lived on).
    pub fn register_again(&mut self, g: &str, r: u32, size: u32, ttl_ms: u64) -> i64 {
        self.register_process(g, r, size, ttl_ms, None)
    }

    fn register_process(&mut self, g: &str, r: u32, size: u32, ttl_ms: u64, nixl_agent: Option<&str>) -> i64 {
        let started_at = self.started_of.get(&(g.to_string(), r)).cloned().unwrap_or_default();
        self.next_lease += 1;
        let lease = self.next_lease;
        self.leases.insert((g.to_string(), r), lease);
        let v = json!({"v":1,"group":g,"rank":r,"group_size":size,"role":"prefill","host":"host-a","pid":1000 + r,
            "boot_id":"boot-a","lease_ttl_ms":ttl_ms,"started_at":started_at,"agent":"rootrank-agent/0.1.0","nixl_agent":nixl_agent});
        self.put_raw(&key_live(g, r), v.to_string().into_bytes(), lease);
        self.registered_at_revision.insert(lease, self.rev);
        self.ttl_of.insert(lease, ttl_ms);
        self.size_of.insert(lease, size);
        lease
    }

    /// v5: node-watch adopts the rank: its live key moves to the host's lease, the record
    /// naming the rank's own lease as its incarnation.
    pub fn adopt(&mut self, g: &str, r: u32, host_lease: i64) {
        let inc = self.incarnation(g, r);
        let Some((value, _, _)) = self.kv.get(&key_live(g, r)).cloned() else {
            return;
        };
        let mut v: serde_json::Value = serde_json::from_slice(&value).unwrap();
        v["incarnation"] = json!(inc.to_string());
        self.put_raw(&key_live(g, r), v.to_string().into_bytes(), host_lease);
    }

    pub fn vanish(&mut self, g: &str, r: u32) {
        self.delete_raw(&key_live(g, r));
    }

    pub fn incarnation(&self, g: &str, r: u32) -> i64 {
        self.leases.get(&(g.to_string(), r)).copied().unwrap_or(1)
    }

    /// A certificate from a specific writer: create-if-absent, or over the coordinator's.
    pub fn certify(&mut self, g: &str, r: u32, reason: &str, source: &str) {
        let inc = self.incarnation(g, r);
        let k = key_down(g, r, inc);
        let mut observed_revision = serde_json::Value::Null;
        let mut at = time::format_ms(self.now);
        let registered_revision = json!(self.registered_at_revision.get(&inc));
        if let Some((v, _, _)) = self.kv.get(&k) {
            let existing: serde_json::Value = serde_json::from_slice(v).unwrap_or_default();
            if existing["source"] != "coordinator" {
                return;
            }
            // Writers keep the coordinator's observed revision, and its time when earlier, when
            // they refine its certificate (rootrank_store::put_certificate).
            observed_revision = existing["observed_revision"].clone();
            if let Some(prev) = existing["at"].as_str() {
                if time::parse_ms(prev).unwrap_or(i64::MAX) < self.now {
                    at = prev.to_string();
                }
            }
        }
        let v = json!({"v":1,"group":g,"rank":r,"incarnation":inc.to_string(),"reason":reason,"detail":format!("{reason} seen by {source}"),
            "source":source,"host":"host-a","pid":1000 + r,"at":at,"exit":{"code":null,"signal":9},"log_tail":["Traceback (most recent call last):","RuntimeError: boom"],
            "observed_revision":observed_revision,"registered_revision":registered_revision,"lease_ttl_ms":self.ttl_of.get(&inc),
            "group_size":self.size_of.get(&inc),"role":self.size_of.get(&inc).map(|_| "prefill")});
        self.put_raw(&k, v.to_string().into_bytes(), 0);
    }

    /// A room record: create-if-absent, first reason wins.
    pub fn record(&mut self, g: &str, r: u32, room: u64, origin: &str, reason: &str) {
        self.record_with_peer(g, r, room, origin, reason, serde_json::Value::Null);
    }

    /// A room record naming the transfer peer it failed against.
    pub fn record_with_peer(
        &mut self,
        g: &str,
        r: u32,
        room: u64,
        origin: &str,
        reason: &str,
        peer: serde_json::Value,
    ) {
        let k = key_room(g, room, r);
        if self.kv.contains_key(&k) {
            return;
        }
        let inc = self.incarnation(g, r);
        let v = json!({"v":1,"group":g,"rank":r,"room":room.to_string(),"origin":origin,"reason":reason,
            "detail":if origin == "local" { format!("NIXL transfer encountered ERR room={room}") } else { "NIXL KVSender Exception".to_string() },
            "at":time::format_ms(self.now),"incarnation":inc.to_string(),"peer":peer});
        self.put_raw(&k, v.to_string().into_bytes(), 0);
    }
}

pub fn verdict_of(index: &Index, room: u64, group: Option<&str>, now: i64) -> Verdict {
    index.verdict(&VerdictQuery {
        room: RoomId::new(room).unwrap(),
        group: group.map(|g| rootrank_core::GroupId::new(g).unwrap()),
        asked_at_ms: now,
        now_ms: now,
    })
}

/// The index a restarted coordinator would build from the world's current etcd state.
pub fn snapshot_index(w: &World) -> Index {
    let mut idx = Index::new(IndexConfig::default());
    idx.load_snapshot(snapshot_events(w), w.rev);
    idx
}

/// The world's etcd state as a snapshot read delivers it, in key order.
pub fn snapshot_events(w: &World) -> Vec<rootrank_core::Event> {
    w.kv.iter()
        .map(|(k, (v, lease, rev))| rootrank_core::Event::Put {
            key: k.as_bytes().to_vec(),
            value: v.clone(),
            lease: *lease,
            revision: *rev,
            create_revision: w.created.get(k).copied().unwrap_or(*rev),
            observed_at_ms: w.now,
        })
        .collect()
}
