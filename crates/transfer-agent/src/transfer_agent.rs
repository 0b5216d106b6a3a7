//! A rank's transfer agent: a NIXL agent and a rootrank agent in one rank process.
//!
//! On start it creates the NIXL agent (named by a random UUID, as SGLang does), registers its
//! DRAM regions, starts the rootrank agent and keeps a [`NixlRecord`] (metadata and region
//! descriptors) at `{prefix}/groups/{g}/ranks/{r}/nixl` on the liveness lease, so the record
//! vanishes with the rank. Peers are loaded from the same keys of other ranks. Every transfer
//! error becomes a `local` RoomFailure with the peer named: the first-hand record that SGLang's
//! `record_failure(room, reason)` keeps only in process memory.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rootrank_agent::{Agent, AgentConfig};
use rootrank_core::{Keys, Origin, Peer};
use rootrank_store::etcd_client::Client;
use rootrank_transfer::{NixlLibrary, RegionId, RemoteRegion, TransferAgent, TransferError, TransferStats};
use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

use crate::error::{RoomTransferError, TransferAgentError};

/// The liveness-lease key suffix holding a rank's [`NixlRecord`].
pub const NIXL_SUFFIX: &str = "nixl";

/// What a rank publishes at `{prefix}/groups/{g}/ranks/{r}/nixl`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NixlRecord {
    pub v: u32,
    /// The NIXL agent name (a UUID per process).
    pub agent: String,
    /// `TransferAgent::local_metadata()`, hex-encoded.
    pub metadata_hex: String,
    /// The rank's registered regions, in registration order.
    pub regions: Vec<RemoteRegion>,
    #[serde(default)]
    pub host: Option<String>,
    #[serde(default)]
    pub pid: Option<u32>,
}

/// A transfer peer: a rank of some group.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PeerRef {
    pub group: String,
    pub rank: u32,
}

impl PeerRef {
    pub fn new(group: &str, rank: u32) -> Self {
        PeerRef {
            group: group.to_string(),
            rank,
        }
    }
}

#[derive(Debug)]
struct LoadedPeer {
    agent: String,
    /// The etcd mod revision of the record we loaded. It also changes when the same process
    /// re-puts the same record (the agent re-attaches it after re-registering), so what tells
    /// a restart is the agent name or the metadata, not the revision.
    mod_revision: i64,
    metadata_hex: String,
    regions: Vec<RemoteRegion>,
    endpoint: Option<String>,
    /// Set after a failed transfer: re-read the record before the next one.
    stale: bool,
}

/// A rank's NIXL agent with the rootrank agent built in. See the module docs.
pub struct RankAgent {
    // Field order is drop order: NIXL goes before the rootrank agent, so a peer never sees
    // our metadata key outlive the agent it describes by more than a lease.
    nixl: TransferAgent,
    regions: Vec<RegionId>,
    peers: HashMap<PeerRef, LoadedPeer>,
    agent: Option<Agent>,
    etcd: Client,
    keys: Keys,
    group: String,
    rank: u32,
    /// Until when etcd reads are skipped after one failed: transfers must not wait on an
    /// unreachable etcd (the agent's rule: never block the host).
    etcd_quiet_until: Option<Instant>,
    // A private runtime for the few etcd reads (peer metadata): the rank's own code is
    // synchronous, like a scheduler loop; NIXL calls are blocking.
    rt: tokio::runtime::Runtime,
}

impl std::fmt::Debug for RankAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankAgent")
            .field("group", &self.group)
            .field("rank", &self.rank)
            .field("nixl", &self.nixl)
            .finish()
    }
}

/// How long one etcd read may take before the caller sees an error.
const ETCD_READ_TIMEOUT: Duration = Duration::from_secs(1);
/// How long refreshes and disconnect checks skip etcd after a failed read.
const ETCD_QUIET: Duration = Duration::from_secs(5);

impl RankAgent {
    /// Creates the NIXL agent, registers one DRAM region per entry of `region_sizes`, starts
    /// the rootrank agent (with `nixl_agent` set) and waits up to `register_within` for it to
    /// register and publish the NIXL record.
    pub fn start(
        lib: &NixlLibrary,
        mut config: AgentConfig,
        region_sizes: &[usize],
        register_within: Duration,
    ) -> Result<RankAgent, TransferAgentError> {
        let group = config.group.to_string();
        let rank = config.rank;
        let name = crate::random_uuid();
        let mut nixl = TransferAgent::new(lib, &name)?;
        let mut regions = Vec::with_capacity(region_sizes.len());
        let mut descriptors = Vec::with_capacity(region_sizes.len());
        for &len in region_sizes {
            let id = nixl.register_dram(len)?;
            descriptors.push(nixl.region_descriptor(id)?);
            regions.push(id);
        }
        // Metadata after the regions: it carries them.
        let record = NixlRecord {
            v: 1,
            agent: name.clone(),
            metadata_hex: crate::hex::encode(&nixl.local_metadata()?),
            regions: descriptors,
            host: config.host.clone(),
            pid: Some(config.pid),
        };
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let endpoints = config.etcd.endpoints.clone();
        let etcd = rt.block_on(rootrank_store::connect(&config.etcd))?;
        let keys = Keys::new(&config.prefix);
        config.nixl_agent = Some(name.clone());
        let agent = Agent::start(config)?;
        let value = serde_json::to_vec(&record)?;
        agent.attach_to_liveness(NIXL_SUFFIX, value)?;
        let not_registered = || TransferAgentError::NotRegistered {
            group: group.clone(),
            rank,
            secs: register_within.as_secs(),
            endpoints: endpoints.join(","),
        };
        agent.wait_registered(register_within).ok_or_else(not_registered)?;
        // Registered is not enough: peers look for the NIXL key, so wait for it too.
        if !agent.flush(register_within) {
            return Err(not_registered());
        }
        info!(group = %group, rank, nixl_agent = %name, "transfer agent started");
        Ok(RankAgent {
            nixl,
            regions,
            peers: HashMap::new(),
            agent: Some(agent),
            etcd,
            keys,
            group,
            rank,
            etcd_quiet_until: None,
            rt,
        })
    }

    /// The NIXL agent's name.
    pub fn name(&self) -> &str {
        self.nixl.name()
    }

    /// The embedded rootrank agent (for propagated records, down certificates, flush).
    pub fn agent(&self) -> Option<&Agent> {
        self.agent.as_ref()
    }

    /// Copies bytes `offset..offset + out.len()` of local region `index` into `out` (read
    /// after its writer's notification; see `rootrank_transfer::Agent::read_region`).
    pub fn read_region(&self, index: usize, offset: usize, out: &mut [u8]) -> Result<(), TransferAgentError> {
        Ok(self.nixl.read_region(self.region_id(index)?, offset, out)?)
    }

    /// A copy of local region `index`.
    pub fn region_to_vec(&self, index: usize) -> Result<Vec<u8>, TransferAgentError> {
        Ok(self.nixl.region_to_vec(self.region_id(index)?)?)
    }

    /// Copies `data` into local region `index` at `offset` (to fill a source buffer).
    pub fn write_region(&mut self, index: usize, offset: usize, data: &[u8]) -> Result<(), TransferAgentError> {
        let id = self.region_id(index)?;
        Ok(self.nixl.write_region(id, offset, data)?)
    }

    fn region_id(&self, index: usize) -> Result<RegionId, TransferAgentError> {
        self.regions
            .get(index)
            .copied()
            .ok_or_else(|| TransferAgentError::NoSuchRegion {
                group: self.group.clone(),
                rank: self.rank,
                index,
                count: self.regions.len(),
            })
    }

    /// Drains the notifications received so far: (sender agent, message).
    pub fn notifications(&mut self) -> Result<Vec<(String, Vec<u8>)>, TransferAgentError> {
        Ok(self.nixl.notifications()?)
    }

    /// Where `peer` publishes its NIXL record (for error messages; the group is validated
    /// where the key is read).
    fn peer_key(&self, peer: &PeerRef) -> String {
        format!(
            "{}/groups/{}/ranks/{}/{NIXL_SUFFIX}",
            self.keys.prefix(),
            peer.group,
            peer.rank
        )
    }

    fn read_record(&mut self, peer: &PeerRef) -> Result<Option<(NixlRecord, i64)>, TransferAgentError> {
        let group = rootrank_core::GroupId::new(&peer.group).map_err(|source| TransferAgentError::BadPeerGroup {
            group: peer.group.clone(),
            source,
        })?;
        let key = self.keys.nixl(&group, peer.rank);
        let mut etcd = self.etcd.clone();
        let read = self
            .rt
            .block_on(async { tokio::time::timeout(ETCD_READ_TIMEOUT, etcd.get(key.as_str(), None)).await });
        let resp = match read {
            Ok(Ok(resp)) => {
                self.etcd_quiet_until = None;
                resp
            }
            Ok(Err(e)) => {
                self.etcd_quiet_until = Some(Instant::now() + ETCD_QUIET);
                return Err(e.into());
            }
            Err(_) => {
                self.etcd_quiet_until = Some(Instant::now() + ETCD_QUIET);
                return Err(TransferAgentError::EtcdSlow {
                    key,
                    waited_ms: ETCD_READ_TIMEOUT.as_millis() as u64,
                });
            }
        };
        let Some(kv) = resp.kvs().first() else {
            return Ok(None);
        };
        let bad = |detail: String| TransferAgentError::BadPeerRecord {
            group: peer.group.clone(),
            rank: peer.rank,
            key: key.clone(),
            detail,
        };
        let record: NixlRecord = serde_json::from_slice(kv.value()).map_err(|e| bad(e.to_string()))?;
        if record.v != 1 {
            return Err(bad(format!("schema version {} (this reader knows 1)", record.v)));
        }
        Ok(Some((record, kv.mod_revision())))
    }

    /// Loads `peer`'s NIXL metadata from etcd, waiting up to `within` for it to appear.
    /// Reloads it when the record changed since it was loaded (a restarted peer).
    pub fn connect_peer(&mut self, peer: &PeerRef, within: Duration) -> Result<(), TransferAgentError> {
        let deadline = rootrank_store::deadline_after(within);
        loop {
            match self.read_record(peer)? {
                Some((record, rev)) => return self.load(peer, record, rev),
                None if Instant::now() >= deadline => {
                    return Err(TransferAgentError::PeerMissing {
                        group: peer.group.clone(),
                        rank: peer.rank,
                        key: self.peer_key(peer),
                        waited_ms: u64::try_from(within.as_millis()).unwrap_or(u64::MAX),
                    })
                }
                None => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    /// Re-reads `peer`'s record and reloads it if it changed (or was marked stale by a failed
    /// transfer). Returns whether NIXL now holds different metadata. A vanished record (the
    /// peer's lease expired) leaves the old metadata in place: a write will fail and say so.
    ///
    /// Within a few seconds of a failed etcd read this returns `Ok(false)` at once, so a
    /// transfer path that refreshes before every room is not slowed by an etcd outage.
    pub fn refresh_peer(&mut self, peer: &PeerRef) -> Result<bool, TransferAgentError> {
        if self.etcd_quiet() {
            return Ok(false);
        }
        let current = self.peers.get(peer).map(|p| (p.agent.clone(), p.metadata_hex.clone()));
        match self.read_record(peer)? {
            Some((record, rev)) if current.as_ref() != Some(&(record.agent.clone(), record.metadata_hex.clone())) => {
                self.load(peer, record, rev)?;
                Ok(true)
            }
            _ => {
                if let Some(p) = self.peers.get_mut(peer) {
                    p.stale = false;
                }
                Ok(false)
            }
        }
    }

    fn load(&mut self, peer: &PeerRef, record: NixlRecord, mod_revision: i64) -> Result<(), TransferAgentError> {
        if let Some(p) = self.peers.get_mut(peer) {
            if p.agent == record.agent && p.metadata_hex == record.metadata_hex {
                p.mod_revision = mod_revision;
                return Ok(());
            }
        }
        let md = crate::hex::decode(&record.metadata_hex).ok_or_else(|| TransferAgentError::BadPeerRecord {
            group: peer.group.clone(),
            rank: peer.rank,
            key: self.peer_key(peer),
            detail: "metadata_hex is not hex".into(),
        })?;
        // A restarted peer has a new agent name (a new UUID); drop the old one so NIXL closes
        // its connection, then load the new metadata (replace_peer handles a reused name).
        if let Some(old) = self.peers.get(peer) {
            if old.agent != record.agent && self.nixl.has_peer(&old.agent) {
                let old_name = old.agent.clone();
                if let Err(e) = self.nixl.forget_peer(&old_name) {
                    warn!(peer = %old_name, error = %e, "could not forget a restarted peer's old metadata");
                }
            }
        }
        let loaded = self.nixl.replace_peer(&record.agent, &md)?;
        let endpoint = match (&record.host, record.pid) {
            (Some(h), Some(pid)) => Some(format!("{h} pid {pid}")),
            (Some(h), None) => Some(h.clone()),
            _ => None,
        };
        info!(group = %self.group, rank = self.rank, peer_group = %peer.group, peer_rank = peer.rank,
            peer_agent = %loaded, mod_revision, "peer metadata loaded");
        self.peers.insert(
            peer.clone(),
            LoadedPeer {
                agent: loaded,
                mod_revision,
                metadata_hex: record.metadata_hex,
                regions: record.regions,
                endpoint,
                stale: false,
            },
        );
        Ok(())
    }

    /// The descriptor of `peer`'s region `index`, as loaded.
    pub fn peer_region(&self, peer: &PeerRef, index: usize) -> Result<RemoteRegion, TransferAgentError> {
        let p = self.peers.get(peer).ok_or_else(|| TransferAgentError::PeerMissing {
            group: peer.group.clone(),
            rank: peer.rank,
            key: "(not connected: call connect_peer first)".into(),
            waited_ms: 0,
        })?;
        p.regions.get(index).copied().ok_or(TransferAgentError::NoSuchRegion {
            group: peer.group.clone(),
            rank: peer.rank,
            index,
            count: p.regions.len(),
        })
    }

    /// The rootrank `Peer` of a loaded peer, as records name it.
    pub fn peer_info(&self, peer: &PeerRef) -> Peer {
        let p = self.peers.get(peer);
        Peer {
            group: Some(peer.group.clone()),
            rank: Some(peer.rank),
            agent: p.map(|p| p.agent.clone()),
            endpoint: p.and_then(|p| p.endpoint.clone()),
        }
    }

    /// WRITEs `len` bytes of local region `local_region` at `local_offset` into `peer`'s
    /// region `remote_region` at `remote_offset`, with `notification`, for `room`.
    ///
    /// A peer marked stale by an earlier failure is re-read from etcd first (it may have
    /// restarted). On failure the error is recorded as a `local` RoomFailure (see
    /// [`RankAgent::write_room_to`]).
    #[allow(clippy::too_many_arguments)]
    pub fn write_room(
        &mut self,
        room: u64,
        peer: &PeerRef,
        local_region: usize,
        local_offset: usize,
        remote_region: usize,
        remote_offset: u64,
        len: usize,
        notification: &[u8],
        timeout: Duration,
    ) -> Result<TransferStats, Box<RoomTransferError>> {
        if self.peers.get(peer).is_none_or(|p| p.stale) {
            if let Err(e) = self.refresh_peer(peer) {
                debug!(error = %e, "could not refresh a stale peer; writing with what is loaded");
            }
        }
        let remote = match self.peer_region(peer, remote_region) {
            Ok(r) => r,
            // Never connected (or its metadata never came): what NIXL says of a peer it has
            // not loaded, as `write_room_to` does; the peer is named, so a verdict's cause
            // follows it to the peer's own death.
            Err(TransferAgentError::PeerMissing { .. }) => {
                return Err(self.record(room, peer, not_loaded(peer).into()));
            }
            Err(e) => return Err(self.record(room, peer, e)),
        };
        self.write_room_to(
            room,
            peer,
            local_region,
            local_offset,
            &remote,
            remote_offset,
            len,
            notification,
            timeout,
        )
    }

    /// Like [`RankAgent::write_room`], to an explicit remote range (which NIXL checks against
    /// the peer's registered memory: a range the peer never registered fails inside NIXL).
    ///
    /// On failure: a transfer failure while the peer's NIXL record is gone or replaced is
    /// confirmed as `peer_disconnect` (etcd is the independent evidence NIXL's C API lacks);
    /// otherwise the reason is the error's own (`nixl_error`, `transfer_timeout`). The record
    /// is enqueued (never waited for) and the peer is marked stale for the next transfer.
    #[allow(clippy::too_many_arguments)]
    pub fn write_room_to(
        &mut self,
        room: u64,
        peer: &PeerRef,
        local_region: usize,
        local_offset: usize,
        remote: &RemoteRegion,
        remote_offset: u64,
        len: usize,
        notification: &[u8],
        timeout: Duration,
    ) -> Result<TransferStats, Box<RoomTransferError>> {
        let local = match self.region_id(local_region) {
            Ok(local) => local,
            Err(e) => return Err(self.record(room, peer, e)),
        };
        let result = match self.peers.get(peer) {
            Some(p) => {
                let name = p.agent.clone();
                self.nixl.write(
                    &name,
                    local,
                    local_offset,
                    remote,
                    remote_offset,
                    len,
                    notification,
                    timeout,
                )
            }
            None => Err(not_loaded(peer)),
        };
        result.map_err(|err| {
            let err = if err.is_transfer_failure() && self.peer_gone(peer) {
                err.confirm_disconnect()
            } else {
                err
            };
            self.record(room, peer, err.into())
        })
    }

    /// Whether etcd shows the peer we loaded is gone: its NIXL record vanished (lease
    /// expired) or names another agent (it restarted).
    fn peer_gone(&mut self, peer: &PeerRef) -> bool {
        if self.etcd_quiet() {
            return false; // no evidence either way: keep NIXL's own reason
        }
        let loaded = self.peers.get(peer).map(|p| p.agent.clone());
        match (self.read_record(peer), loaded) {
            (Ok(None), Some(_)) => true,
            (Ok(Some((rec, _))), Some(agent)) => rec.agent != agent,
            _ => false,
        }
    }

    fn etcd_quiet(&self) -> bool {
        self.etcd_quiet_until.is_some_and(|t| Instant::now() < t)
    }

    fn record(&mut self, room: u64, peer: &PeerRef, error: TransferAgentError) -> Box<RoomTransferError> {
        let reason = error.reason();
        let status = error.nixl_status().unwrap_or("");
        let info = self.peer_info(peer);
        // SGLang's own text first (what operators grep for), then what rootrank adds.
        let detail = format!(
            "NIXL transfer encountered ERR room={room}: {}to {} rank {} (agent {}): {error}",
            if status.is_empty() {
                String::new()
            } else {
                format!("[{status}] ")
            },
            peer.group,
            peer.rank,
            info.agent.as_deref().unwrap_or("unknown"),
        );
        if let Some(p) = self.peers.get_mut(peer) {
            p.stale = true;
        }
        let recorded = match &self.agent {
            Some(a) => match a.record_failure(room, Origin::Local, reason, &detail, Some(info.clone())) {
                Ok(()) => true,
                Err(e) => {
                    warn!(room, error = %e, "could not record the room failure");
                    false
                }
            },
            None => false,
        };
        warn!(group = %self.group, rank = self.rank, room, reason, nixl_status = status, peer_group = %peer.group,
            peer_rank = peer.rank, "transfer failed; recorded a local room failure");
        Box::new(RoomTransferError {
            room,
            reason,
            detail,
            peer: info,
            error,
            recorded,
        })
    }

    /// A clean exit: the rootrank agent writes its `shutdown` certificate and revokes the
    /// lease (which removes the NIXL record); then NIXL is torn down.
    pub fn shutdown(mut self, timeout: Duration) -> bool {
        self.agent.take().is_some_and(|a| a.shutdown(timeout))
    }
}

/// What NIXL says of a peer it has not loaded, naming the rank.
fn not_loaded(peer: &PeerRef) -> TransferError {
    TransferError::PeerNotLoaded {
        peer: format!("{} rank {}", peer.group, peer.rank),
    }
}
