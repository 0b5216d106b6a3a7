//! The values rootrank stores in etcd (SPEC section 4). Every value is a JSON object with
//! `"v": 1`; readers ignore fields they do not know, so newer writers stay readable.

use serde::{Deserialize, Serialize};

use crate::ids::{check_rank, GroupId, IdError, Incarnation, Rank, Reason, RoomId};

/// The only schema version this reader understands.
pub const SCHEMA_VERSION: u32 = 1;
/// `detail` is capped so one chatty traceback cannot bloat etcd or the coordinator.
pub const MAX_DETAIL_BYTES: usize = 4096;
/// `log_tail` is capped likewise (lines x bytes).
pub const MAX_LOG_TAIL_LINES: usize = 100;
pub const MAX_LOG_LINE_BYTES: usize = 1024;

/// Why a stored value was rejected.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("not a rootrank record: {0}")]
    Json(#[from] serde_json::Error),
    #[error("unsupported schema version {0} (this reader understands v=1; upgrade the coordinator)")]
    Version(u64),
    #[error(transparent)]
    Id(#[from] IdError),
    #[error("record disagrees with its key: {0}")]
    KeyMismatch(String),
    #[error("lease_ttl_ms {0} is out of range (1..={MAX_LEASE_TTL_MS}); the rank's agent wrote a TTL no lease has")]
    LeaseTtl(u64),
    #[error(
        "at {0:?} is not an RFC 3339 time (e.g. 2026-12-06T03:04:05.678Z); the writer's clock formatting is broken"
    )]
    At(String),
}

/// `at` is for people, but a writer that cannot format a time is not trusted with the rest.
fn check_at(at: Option<&str>) -> Result<(), RecordError> {
    match at {
        Some(text) if crate::time::parse_ms(text).is_none() => {
            let mut shown = text.to_string();
            truncate_utf8(&mut shown, 80);
            Err(RecordError::At(shown))
        }
        _ => Ok(()),
    }
}

/// The longest liveness lease a live record may claim (one day). The verdict windows add
/// the slowest TTL to other spans, so an unbounded value would overflow them.
pub const MAX_LEASE_TTL_MS: u64 = 86_400_000;

/// Where a room failure was seen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Origin {
    /// This rank saw the failure itself: a root-cause candidate.
    Local,
    /// This rank only learned of it through the group's MIN all-reduce: never a root cause.
    Propagated,
    /// v3: this rank's transfer peer told it that the peer failed the room (SGLang's decode
    /// side learns a prefill failure from the prefill's status message): never a root cause
    /// in its own group; the verdict follows `peer` (SPEC rule 7).
    PeerReported,
}

impl Origin {
    pub fn as_str(self) -> &'static str {
        match self {
            Origin::Local => "local",
            Origin::Propagated => "propagated",
            Origin::PeerReported => "peer_reported",
        }
    }
}

/// Who wrote a down certificate. Ordered by how much the writer can know about the death.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DownSource {
    Agent,
    Watchdog,
    Supervisor,
    Coordinator,
}

impl DownSource {
    pub fn as_str(self) -> &'static str {
        match self {
            DownSource::Agent => "agent",
            DownSource::Watchdog => "watchdog",
            DownSource::Supervisor => "supervisor",
            DownSource::Coordinator => "coordinator",
        }
    }
}

/// The transfer peer a failure was seen against.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Peer {
    #[serde(default)]
    pub group: Option<String>,
    #[serde(default)]
    pub rank: Option<u32>,
    #[serde(default)]
    pub agent: Option<String>,
    #[serde(default)]
    pub endpoint: Option<String>,
}

/// How a process ended, when someone saw it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ExitInfo {
    #[serde(default)]
    pub code: Option<i32>,
    #[serde(default)]
    pub signal: Option<i32>,
}

/// `{p}/groups/{group}/ranks/{rank}/live`, on the rank's liveness lease.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankLive {
    pub v: u32,
    pub group: GroupId,
    pub rank: Rank,
    pub group_size: u32,
    #[serde(default)]
    pub role: Option<String>,
    #[serde(default)]
    pub host: Option<String>,
    #[serde(default)]
    pub pid: Option<u32>,
    #[serde(default)]
    pub boot_id: Option<String>,
    #[serde(default)]
    pub started_at: Option<String>,
    #[serde(default)]
    pub lease_ttl_ms: Option<u64>,
    #[serde(default)]
    pub agent: Option<String>,
    #[serde(default)]
    pub nixl_agent: Option<String>,
    #[serde(default)]
    pub gpu: Option<String>,
    /// v3: addresses by which peers know this rank or its instance (a prefill's bootstrap
    /// `host:port` as decode reaches it), so a peer named only by endpoint is found (rule 5).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<String>,
    /// v3: the inode of the rank's `/proc/self/ns/pid`: `pid` is a pid in that namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid_ns: Option<u64>,
    /// v3: field 22 of the rank's `/proc/self/stat` (start time in clock ticks after boot),
    /// so whoever acts on `pid` can check it is still the same process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_ticks: Option<u64>,
    /// v5: present when the live key rides on its host's lease (`node-watch --host-lease`
    /// adopted it): the rank's incarnation, its own lease id, which no longer carries the key.
    /// Absent: the incarnation is the key's own lease, as ever.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incarnation: Option<Incarnation>,
}

impl RankLive {
    /// The incarnation of a live key that rides on `lease`: the record's own word when its
    /// host adopted it, else the lease. A key on no lease is no incarnation in either mode.
    pub fn incarnation_on(&self, lease: i64) -> Result<Incarnation, IdError> {
        let own = Incarnation::new(lease)?;
        Ok(self.incarnation.unwrap_or(own))
    }

    /// Whether the key rides on a lease that is not its incarnation's: its host's.
    pub fn on_host_lease(&self, lease: i64) -> bool {
        self.incarnation.is_some_and(|i| i.lease_id() != lease)
    }
}

/// `{p}/groups/{group}/rooms/{room}/ranks/{rank}`, on a retention lease, written once.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RoomFailure {
    pub v: u32,
    pub group: GroupId,
    pub rank: Rank,
    pub room: RoomId,
    pub origin: Origin,
    pub reason: Reason,
    #[serde(default)]
    pub detail: String,
    #[serde(default)]
    pub at: Option<String>,
    #[serde(default)]
    pub incarnation: Option<Incarnation>,
    #[serde(default)]
    pub peer: Option<Peer>,
}

/// `{p}/groups/{group}/ranks/{rank}/down/{incarnation}`, on a retention lease.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankDown {
    pub v: u32,
    pub group: GroupId,
    pub rank: Rank,
    pub incarnation: Incarnation,
    pub reason: Reason,
    #[serde(default)]
    pub detail: String,
    pub source: DownSource,
    #[serde(default)]
    pub at: Option<String>,
    #[serde(default)]
    pub exit: Option<ExitInfo>,
    #[serde(default)]
    pub log_tail: Option<Vec<String>>,
    /// rootrank extension (not in SPEC v1): the dead process, so a verdict can name it after
    /// the live record is gone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// rootrank extension (not in SPEC v1): the revision at which the coordinator saw the
    /// live key vanish, so a reloaded coordinator orders this death exactly as a watching one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_revision: Option<i64>,
    /// rootrank extension (not in SPEC v1): the revision at which this incarnation registered,
    /// for the "re-registered before the room's first record" rule after a reload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registered_revision: Option<i64>,
    /// rootrank extension (not in SPEC v1): the dead incarnation's lease TTL (its live
    /// record's `lease_ttl_ms`), so a group's pending window keeps counting it for as long as
    /// the certificate exists, on every replica, after its live record is gone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ttl_ms: Option<u64>,
    /// rootrank extensions (not in SPEC v1): the dead incarnation's `group_size` and `role`,
    /// so a group whose ranks are all dead keeps its shape on a replica started after.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_size: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
}

/// v3 `{p}/groups/{group}/ranks/{rank}/stall`, on the rank's liveness lease: the rank is
/// alive (its agent thread keeps the lease) but its loop has not advanced for `stalled_ms`.
/// Written once per stall by the rank's agent thread, deleted when the loop advances again.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankStall {
    pub v: u32,
    pub group: GroupId,
    pub rank: Rank,
    pub incarnation: Incarnation,
    /// When the loop last advanced (RFC 3339), for people: ordering is by etcd revision.
    #[serde(default)]
    pub since: Option<String>,
    #[serde(default)]
    pub stalled_ms: Option<u64>,
    #[serde(default)]
    pub in_flight: Option<Vec<RoomId>>,
    #[serde(default)]
    pub stack: Option<Vec<String>>,
}

/// Parses a record in one pass over its bytes (a coordinator parses a million of them at
/// start-up). Only when that fails is the version read on its own, so a record of another
/// schema version is reported as such rather than as whatever field it lacks.
/// v4: a coordinator's record that a window of SPEC section 5 ended (key
/// `{p}/coordinators/windows/...`, create-only, on a retention lease). What counts is the
/// revision at which it landed; the fields are for people.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WindowEnd {
    pub v: u32,
    /// The revision that opened the window (a room's first record, a death).
    pub opened_revision: i64,
    /// How long the window was, on the writing coordinator's monotonic clock.
    pub length_ms: i64,
    /// The coordinator that saw it end first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
}

impl WindowEnd {
    pub fn parse(raw: &[u8]) -> Result<Self, RecordError> {
        parse_versioned(raw, |r: &WindowEnd| r.v)
    }
}

fn parse_versioned<T: serde::de::DeserializeOwned>(raw: &[u8], version: impl Fn(&T) -> u32) -> Result<T, RecordError> {
    match serde_json::from_slice::<T>(raw) {
        Ok(r) if version(&r) == SCHEMA_VERSION => Ok(r),
        Ok(r) => Err(RecordError::Version(u64::from(version(&r)))),
        Err(e) => {
            check_version(raw)?;
            Err(e.into())
        }
    }
}

fn check_version(raw: &[u8]) -> Result<(), RecordError> {
    #[derive(Deserialize)]
    struct V {
        v: u64,
    }
    let v: V = serde_json::from_slice(raw)?;
    if v.v != u64::from(SCHEMA_VERSION) {
        return Err(RecordError::Version(v.v));
    }
    Ok(())
}

/// Cuts `s` to at most `max` bytes on a character boundary.
pub fn truncate_utf8(s: &mut String, max: usize) {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
}

impl RankLive {
    pub fn parse(raw: &[u8]) -> Result<Self, RecordError> {
        let r: RankLive = parse_versioned(raw, |r: &RankLive| r.v)?;
        check_rank(u64::from(r.rank), u64::from(r.group_size))?;
        if let Some(ttl) = r.lease_ttl_ms.filter(|t| !(1..=MAX_LEASE_TTL_MS).contains(t)) {
            return Err(RecordError::LeaseTtl(ttl));
        }
        Ok(r)
    }
}

impl RoomFailure {
    pub fn parse(raw: &[u8]) -> Result<Self, RecordError> {
        let mut r: RoomFailure = parse_versioned(raw, |r: &RoomFailure| r.v)?;
        check_at(r.at.as_deref())?;
        // An over-long detail from some other writer is cut, not rejected: the failure
        // itself is the information that matters.
        truncate_utf8(&mut r.detail, MAX_DETAIL_BYTES);
        Ok(r)
    }
}

impl RankDown {
    pub fn parse(raw: &[u8]) -> Result<Self, RecordError> {
        let mut r: RankDown = parse_versioned(raw, |r: &RankDown| r.v)?;
        check_at(r.at.as_deref())?;
        truncate_utf8(&mut r.detail, MAX_DETAIL_BYTES);
        if let Some(tail) = r.log_tail.as_mut() {
            clamp_log_tail(tail);
        }
        Ok(r)
    }
}

impl RankStall {
    pub fn parse(raw: &[u8]) -> Result<Self, RecordError> {
        let mut r: RankStall = parse_versioned(raw, |r: &RankStall| r.v)?;
        if let Some(stack) = r.stack.as_mut() {
            clamp_stack(stack);
        }
        if let Some(rooms) = r.in_flight.as_mut() {
            rooms.truncate(MAX_IN_FLIGHT);
        }
        Ok(r)
    }
}

/// A stall record lists at most this many rooms in flight (a rank has a few dozen at most).
pub const MAX_IN_FLIGHT: usize = 256;

/// Keeps the first [`MAX_LOG_TAIL_LINES`] lines of a stack (the stalled thread comes first),
/// each cut to [`MAX_LOG_LINE_BYTES`].
pub fn clamp_stack(stack: &mut Vec<String>) {
    stack.truncate(MAX_LOG_TAIL_LINES);
    for line in stack.iter_mut() {
        truncate_utf8(line, MAX_LOG_LINE_BYTES);
    }
}

/// Keeps the last [`MAX_LOG_TAIL_LINES`] lines, each cut to [`MAX_LOG_LINE_BYTES`].
pub fn clamp_log_tail(tail: &mut Vec<String>) {
    if tail.len() > MAX_LOG_TAIL_LINES {
        tail.drain(..tail.len() - MAX_LOG_TAIL_LINES);
    }
    for line in tail.iter_mut() {
        truncate_utf8(line, MAX_LOG_LINE_BYTES);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn room_failure_round_trip_and_unknown_fields() {
        let raw = br#"{"v":1,"group":"prefill-0","rank":2,"room":"9223372036854775807","origin":"local",
            "reason":"nixl_error","detail":"NIXL_ERR_BACKEND","at":"2026-12-02T15:20:05.123Z",
            "incarnation":"7587","peer":{"group":"decode-0","rank":2,"agent":"a1","endpoint":null},
            "from_the_future":{"x":1}}"#;
        let r = RoomFailure::parse(raw).unwrap();
        assert_eq!(r.room.get(), i64::MAX as u64);
        assert_eq!(r.origin, Origin::Local);
        let back = serde_json::to_value(&r).unwrap();
        assert_eq!(back["room"], "9223372036854775807");
        assert_eq!(back["incarnation"], "7587");
    }

    #[test]
    fn required_fields_and_version() {
        assert!(matches!(
            RoomFailure::parse(br#"{"v":2,"group":"g","rank":0,"room":"1","origin":"local","reason":"x"}"#),
            Err(RecordError::Version(2))
        ));
        assert!(RoomFailure::parse(br#"{"v":1,"group":"g","rank":0,"room":"1","origin":"local"}"#).is_err());
        assert!(
            RoomFailure::parse(br#"{"v":1,"group":"g","rank":0,"room":"1","origin":"elsewhere","reason":"x"}"#)
                .is_err()
        );
        assert!(RoomFailure::parse(b"not json").is_err());
        // An `at` that is no time is refused (it used to become "now"); none at all is fine.
        let at =
            |at: &str| format!(r#"{{"v":1,"group":"g","rank":0,"room":"1","origin":"local","reason":"x","at":{at}}}"#);
        assert!(matches!(
            RoomFailure::parse(at(r#""yesterday""#).as_bytes()),
            Err(RecordError::At(_))
        ));
        assert!(RoomFailure::parse(at(r#""2026-12-06T03:04:05Z""#).as_bytes()).is_ok());
        assert!(RoomFailure::parse(at("null").as_bytes()).is_ok());
        assert!(RankLive::parse(br#"{"v":1,"group":"g","rank":4,"group_size":4}"#).is_err());
        assert!(RankLive::parse(br#"{"v":1,"group":"g","rank":3,"group_size":4}"#).is_ok());
        // A TTL no lease has would overflow the verdict's windows: refused at parse.
        for ttl in ["0", "86400001", "18446744073709551615"] {
            let raw = format!(r#"{{"v":1,"group":"g","rank":0,"group_size":1,"lease_ttl_ms":{ttl}}}"#);
            assert!(
                matches!(RankLive::parse(raw.as_bytes()), Err(RecordError::LeaseTtl(_))),
                "{ttl}"
            );
        }
        let raw = br#"{"v":1,"group":"g","rank":0,"group_size":1,"lease_ttl_ms":86400000}"#;
        assert_eq!(RankLive::parse(raw).unwrap().lease_ttl_ms, Some(MAX_LEASE_TTL_MS));
        assert!(RankDown::parse(
            br#"{"v":1,"group":"g","rank":3,"incarnation":"0","reason":"oom_host","source":"watchdog"}"#
        )
        .is_err());
    }

    #[test]
    fn long_detail_is_cut_on_a_char_boundary() {
        let detail = "é".repeat(3000);
        let raw =
            serde_json::json!({"v":1,"group":"g","rank":0,"room":"1","origin":"local","reason":"x","detail":detail});
        let r = RoomFailure::parse(raw.to_string().as_bytes()).unwrap();
        assert!(r.detail.len() <= MAX_DETAIL_BYTES && r.detail.len() >= MAX_DETAIL_BYTES - 1);
    }
}
