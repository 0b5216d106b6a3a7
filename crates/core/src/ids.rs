//! The field's identifiers, validated once at the edge (SPEC section 3).
//!
//! A value of these types is valid by construction, so code past the API boundary never
//! re-checks them. Rooms are `u64` limited to `0..=2^63-1` and travel as decimal strings in
//! JSON, because JavaScript clients lose precision above 2^53.

use std::fmt;
use std::sync::Arc;

use serde::{de, Deserialize, Deserializer, Serialize, Serializer};

/// The largest rank count a group may have.
pub const MAX_GROUP_SIZE: u32 = 4096;
/// The largest room id: SGLang's router mints `random.randint(0, 2**63 - 1)`.
pub const MAX_ROOM: u64 = i64::MAX as u64;

/// Why an identifier was rejected; the message says what a valid one looks like.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("invalid group {0:?}: a group is 1-128 characters of [A-Za-z0-9._:-], starting with a letter or digit (e.g. prefill-0)")]
    Group(String),
    #[error("invalid rank {0:?}: a rank is an integer 0 <= rank < group_size <= 4096")]
    Rank(String),
    #[error("invalid group_size {0:?}: an integer 1..=4096")]
    GroupSize(String),
    #[error("invalid room {0:?}: a room is a decimal integer 0..=9223372036854775807 (SGLang's bootstrap_room)")]
    Room(String),
    #[error("invalid reason {0:?}: 1-64 characters of [a-z0-9_] (e.g. nixl_error)")]
    Reason(String),
    #[error("invalid incarnation {0:?}: the etcd lease id of the rank's live key, a positive decimal integer")]
    Incarnation(String),
}

/// One reduction group: the ranks that MIN-all-reduce their poll states together.
/// Cheap to clone (shared string).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupId(Arc<str>);

impl GroupId {
    pub fn new(s: &str) -> Result<Self, IdError> {
        let b = s.as_bytes();
        let ok = !b.is_empty()
            && b.len() <= 128
            && b[0].is_ascii_alphanumeric()
            && b.iter()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b':' | b'-'));
        if ok {
            Ok(GroupId(Arc::from(s)))
        } else {
            Err(IdError::Group(truncate_for_error(s)))
        }
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
impl fmt::Debug for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", &*self.0)
    }
}

/// A rank within its group. Bounded by [`MAX_GROUP_SIZE`]; the bound against the group's own
/// size is checked where both are known.
pub type Rank = u32;

/// Parses a rank from text (path segments, query strings).
pub fn parse_rank(s: &str) -> Result<Rank, IdError> {
    match s.parse::<u32>() {
        Ok(r) if r < MAX_GROUP_SIZE && is_plain_decimal(s) => Ok(r),
        _ => Err(IdError::Rank(truncate_for_error(s))),
    }
}

/// Checks `rank < group_size <= 4096`.
pub fn check_rank(rank: u64, group_size: u64) -> Result<(Rank, u32), IdError> {
    if group_size == 0 || group_size > u64::from(MAX_GROUP_SIZE) {
        return Err(IdError::GroupSize(group_size.to_string()));
    }
    if rank >= group_size {
        return Err(IdError::Rank(format!("{rank} (group_size {group_size})")));
    }
    Ok((rank as Rank, group_size as u32))
}

/// SGLang's `bootstrap_room`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct RoomId(u64);

impl RoomId {
    pub fn new(v: u64) -> Result<Self, IdError> {
        if v <= MAX_ROOM {
            Ok(RoomId(v))
        } else {
            Err(IdError::Room(v.to_string()))
        }
    }
    pub fn parse(s: &str) -> Result<Self, IdError> {
        if !is_plain_decimal(s) {
            return Err(IdError::Room(truncate_for_error(s)));
        }
        s.parse::<u64>()
            .ok()
            .and_then(|v| RoomId::new(v).ok())
            .ok_or_else(|| IdError::Room(truncate_for_error(s)))
    }
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for RoomId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl Serialize for RoomId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for RoomId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // A decimal string per the contract; a JSON integer is accepted too, since older
        // Python clients may send one, as long as it is exact.
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            S(String),
            N(u64),
        }
        match Raw::deserialize(d)? {
            Raw::S(s) => RoomId::parse(&s).map_err(de::Error::custom),
            Raw::N(n) => RoomId::new(n).map_err(de::Error::custom),
        }
    }
}

/// A failure or death reason, `[a-z0-9_]{1,64}`. Unknown values from newer agents are kept.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Reason(Arc<str>);

impl Reason {
    pub fn new(s: &str) -> Result<Self, IdError> {
        let ok = !s.is_empty()
            && s.len() <= 64
            && s.bytes()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_');
        if ok {
            Ok(Reason(Arc::from(s)))
        } else {
            Err(IdError::Reason(truncate_for_error(s)))
        }
    }
    /// A reason from [`reasons`]; the constants there are valid by inspection (and tested).
    pub fn well_known(s: &'static str) -> Self {
        Reason(Arc::from(s))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
    /// A victim's death (SPEC rule 7): never chosen while another candidate could show up.
    pub fn is_peer_lost(&self) -> bool {
        &*self.0 == reasons::PEER_LOST
    }
    /// A clean exit: never a root cause.
    pub fn is_shutdown(&self) -> bool {
        &*self.0 == reasons::SHUTDOWN
    }
    /// v4: a lease etcd let run out while it was silent, of a process that lived on: no
    /// death, so never a root cause (the rank's own records still are).
    pub fn is_lease_lost(&self) -> bool {
        &*self.0 == reasons::LEASE_LOST
    }
    /// Whether a death of this reason may be a room's culprit at all.
    pub fn may_be_culprit(&self) -> bool {
        !self.is_shutdown() && !self.is_lease_lost()
    }
}

impl std::borrow::Borrow<str> for Reason {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
impl fmt::Debug for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", &*self.0)
    }
}

/// The well-known reasons of SPEC section 3 (others are accepted as they are).
pub mod reasons {
    pub const OOM_GPU: &str = "oom_gpu";
    pub const OOM_HOST: &str = "oom_host";
    pub const NCCL_TIMEOUT: &str = "nccl_timeout";
    pub const UCX_ERROR: &str = "ucx_error";
    pub const NIXL_ERROR: &str = "nixl_error";
    pub const TRANSFER_TIMEOUT: &str = "transfer_timeout";
    pub const BOOTSTRAP_TIMEOUT: &str = "bootstrap_timeout";
    pub const PEER_DISCONNECT: &str = "peer_disconnect";
    pub const PYTHON_EXCEPTION: &str = "python_exception";
    pub const PANIC: &str = "panic";
    pub const PROCESS_EXIT: &str = "process_exit";
    pub const GPU_XID: &str = "gpu_xid";
    pub const LEASE_EXPIRED: &str = "lease_expired";
    pub const ABORTED: &str = "aborted";
    pub const SHUTDOWN: &str = "shutdown";
    pub const OTHER: &str = "other";
    /// v3: the rank died because a peer of its collective vanished (a victim, rule 7).
    pub const PEER_LOST: &str = "peer_lost";
    /// v3: the rank is alive but its loop stopped advancing.
    pub const STALLED: &str = "stalled";
    /// v4: the lease ran out while etcd was silent, and the same process registered again.
    pub const LEASE_LOST: &str = "lease_lost";
}

/// A rank's incarnation: the etcd lease id of its live key. A restarted rank is a new one.
/// Lease ids are positive, so `Option<Incarnation>` costs no more than an `i64`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct Incarnation(std::num::NonZeroI64);

impl Incarnation {
    // Evaluated at compile time: 1 is non-zero.
    pub(crate) const MIN: Incarnation = match std::num::NonZeroI64::new(1) {
        Some(one) => Incarnation(one),
        None => Incarnation(std::num::NonZeroI64::MAX),
    };
    pub(crate) const MAX: Incarnation = Incarnation(std::num::NonZeroI64::MAX);

    pub fn new(lease: i64) -> Result<Self, IdError> {
        match std::num::NonZeroI64::new(lease) {
            Some(v) if lease > 0 => Ok(Incarnation(v)),
            _ => Err(IdError::Incarnation(lease.to_string())),
        }
    }
    pub fn parse(s: &str) -> Result<Self, IdError> {
        if !is_plain_decimal(s) {
            return Err(IdError::Incarnation(truncate_for_error(s)));
        }
        s.parse::<i64>()
            .ok()
            .and_then(|v| Incarnation::new(v).ok())
            .ok_or_else(|| IdError::Incarnation(truncate_for_error(s)))
    }
    pub fn lease_id(self) -> i64 {
        self.0.get()
    }
}

impl fmt::Display for Incarnation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl Serialize for Incarnation {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for Incarnation {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            S(String),
            N(i64),
        }
        match Raw::deserialize(d)? {
            Raw::S(s) => Incarnation::parse(&s).map_err(de::Error::custom),
            Raw::N(n) => Incarnation::new(n).map_err(de::Error::custom),
        }
    }
}

impl Serialize for GroupId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}
impl<'de> Deserialize<'de> for GroupId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        GroupId::new(&s).map_err(de::Error::custom)
    }
}
impl Serialize for Reason {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}
impl<'de> Deserialize<'de> for Reason {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        Reason::new(&s).map_err(de::Error::custom)
    }
}

/// Digits only: no sign, no spaces, no leading `+` (which `str::parse` would accept).
/// Canonical decimal: digits only, no leading zero (`02009` is not room 2009: a key written
/// so is not one rootrank wrote, and two spellings of one room would be two keys).
fn is_plain_decimal(s: &str) -> bool {
    !s.is_empty() && s.len() <= 20 && s.bytes().all(|c| c.is_ascii_digit()) && (s.len() == 1 || !s.starts_with('0'))
}

/// Errors echo the bad input, but never more than a screenful of it.
fn truncate_for_error(s: &str) -> String {
    const MAX: usize = 80;
    if s.len() <= MAX {
        return s.to_string();
    }
    let mut end = MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes)", &s[..end], s.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups() {
        for ok in [
            "prefill-0",
            "10.0.0.5:8998/dp0".split('/').next().unwrap_or(""),
            "a",
            "A.b_c:d-e",
        ] {
            assert!(GroupId::new(ok).is_ok(), "{ok}");
        }
        assert!(GroupId::new(&"g".repeat(128)).is_ok());
        for bad in ["", "-x", ".x", "a/b", "a b", "é", &"g".repeat(129)] {
            assert!(GroupId::new(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn rooms() {
        assert_eq!(RoomId::parse("0").map(RoomId::get), Ok(0));
        assert_eq!(
            RoomId::parse("9223372036854775807").map(RoomId::get),
            Ok(i64::MAX as u64)
        );
        for bad in [
            "",
            "-1",
            "+1",
            " 1",
            "1.0",
            "9223372036854775808",
            "18446744073709551616",
            "abc",
            "0x10",
            "02009",
            "00",
        ] {
            assert!(RoomId::parse(bad).is_err(), "{bad}");
        }
        let j = serde_json::to_string(&RoomId::new(123).unwrap()).unwrap();
        assert_eq!(j, "\"123\"");
        let r: RoomId = serde_json::from_str("\"9223372036854775807\"").unwrap();
        assert_eq!(r.get(), i64::MAX as u64);
        assert!(serde_json::from_str::<RoomId>("-5").is_err());
    }

    #[test]
    fn reasons_and_ranks() {
        assert!(Reason::new("nixl_error").is_ok());
        assert!(Reason::new("from_a_newer_agent_2").is_ok());
        for bad in ["", "NIXL", "a-b", "a b", &"x".repeat(65)] {
            assert!(Reason::new(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_rank("3"), Ok(3));
        assert!(parse_rank("4096").is_err());
        assert!(parse_rank("-1").is_err());
        assert!(parse_rank("03").is_err());
        assert_eq!(parse_rank("0"), Ok(0));
        assert!(check_rank(3, 4).is_ok());
        assert!(check_rank(4, 4).is_err());
        assert!(check_rank(0, 0).is_err());
        assert!(check_rank(0, 4097).is_err());
    }

    #[test]
    fn long_bad_input_is_truncated_in_errors() {
        let e = GroupId::new(&"x/".repeat(10_000)).unwrap_err().to_string();
        assert!(e.len() < 400, "{e}");
    }
}
