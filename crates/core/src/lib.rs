//! rootrank's verdict core.
//!
//! Everything that decides "which rank really failed room R" lives here, and nothing in this
//! crate does I/O, reads a clock or awaits. The shells around it (the coordinator's etcd watch,
//! the HTTP server) feed it raw etcd events stamped with the time they were observed and ask it
//! for verdicts at a time they choose. That makes every rule of SPEC section 5 testable
//! exhaustively and deterministically: same events, same revisions, same verdict.
//!
//! - [`ids`]: the field's identifiers (group, rank, room, incarnation, reason) and their validation.
//! - [`records`]: the JSON values stored in etcd (RankLive, RankDown, RoomFailure).
//! - [`keys`]: the etcd key layout (SPEC section 4), both directions.
//! - [`index`]: the state machine: events in, outputs out, queries answered from memory.
//! - [`verdict`]: the verdict rules and the Verdict JSON.
//! - [`time`]: RFC 3339 with milliseconds, both directions, without a clock.

#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic))]
mod advice;
pub mod fatal;
pub mod ids;
pub mod index;
pub mod keys;
pub mod records;
pub mod time;
pub mod verdict;
pub mod views;

pub use ids::{GroupId, IdError, Incarnation, Rank, Reason, RoomId};
pub use index::RootCause;
pub use index::{Event, Index, IndexConfig, LivedOn, Output};
pub use keys::{is_key_host, HostCopyOf, KeyKind, Keys, Window};
pub use records::{
    DownSource, ExitInfo, Origin, Peer, RankDown, RankLive, RankStall, RecordError, RoomFailure, WindowEnd,
};
pub use verdict::{
    Action, Avoid, CompactCause, CompactCulprit, CompactRetry, CompactVerdict, Culprit, CulpritSource, Evidence,
    EvidenceKind, PeerRef, Retry, Status, Verdict, VerdictQuery, Victim,
};
pub use views::{
    CatchUp, CatchUpEvent, GroupSummary, GroupView, RankStateKind, RankView, StallRole, StallView, UnhealthyRank,
};
