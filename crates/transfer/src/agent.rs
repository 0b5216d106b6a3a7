//! A NIXL agent with a UCX backend, DRAM regions it owns, and synchronous
//! WRITEs with notifications and timeouts.

use std::alloc::Layout;
use std::collections::HashSet;
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use nixl_sys::{
    Agent, AgentConfig, Backend, MemType, MemoryRegion, NixlDescriptor, NixlError, NotificationMap, OptArgs,
    RegistrationHandle, XferDescList, XferOp, XferRequest, XferStatus,
};
use serde::{Deserialize, Serialize};

use crate::error::{status_name, TransferError};
use crate::library::NixlLibrary;

/// Alignment of every registered region (one page).
const REGION_ALIGN: usize = 4096;

/// Index of a region registered by [`TransferAgent::register_dram`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RegionId(pub usize);

/// What a peer needs to target one of our regions: publish it next to the
/// agent metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteRegion {
    /// Virtual address in the owner's process.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Device id (0 for DRAM).
    pub dev_id: u64,
}

/// What one completed [`TransferAgent::write`] took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferStats {
    /// From posting the request to seeing it complete.
    pub elapsed: Duration,
    /// Bytes written.
    pub bytes: u64,
}

/// Who drives NIXL/UCX progress for an agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// NIXL's own default: a progress thread with no delay, which spins and
    /// keeps one core busy per agent even when idle.
    Spin,
    /// A progress thread that waits up to `delay` for UCX events between
    /// passes (NIXL's `pthrDelay`).
    Thread {
        /// Longest wait between progress passes.
        delay: Duration,
    },
    /// No progress thread: UCX progresses only inside this agent's calls
    /// (`write` polling, `notifications`). A receiver must then poll
    /// `notifications` for WRITEs to it to complete.
    Caller,
}

impl Progress {
    /// Parses `spin`, `caller`, or a progress-thread delay in microseconds
    /// (`0` means `spin`).
    pub fn parse(v: &str) -> Result<Progress, TransferError> {
        match v.trim() {
            "spin" => Ok(Progress::Spin),
            "caller" => Ok(Progress::Caller),
            n => match n.parse::<u64>() {
                Ok(0) => Ok(Progress::Spin),
                Ok(us) => Ok(Progress::Thread {
                    delay: Duration::from_micros(us),
                }),
                Err(_) => Err(TransferError::InvalidArgument(format!(
                    "{PROGRESS_ENV}={v:?}: use spin, caller or a delay in microseconds"
                ))),
            },
        }
    }
}

/// Env var choosing [`Progress`] for [`TransferAgent::new`]: `spin`,
/// `caller`, or a progress-thread delay in microseconds (e.g. `100`).
pub const PROGRESS_ENV: &str = "ROOTRANK_NIXL_PROGRESS";

/// Options for [`TransferAgent::with_options`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AgentOptions {
    /// Who drives progress.
    pub progress: Progress,
}

impl Default for AgentOptions {
    fn default() -> Self {
        AgentOptions {
            progress: Progress::Thread {
                delay: Duration::from_micros(100),
            },
        }
    }
}

impl AgentOptions {
    /// The defaults, with `ROOTRANK_NIXL_PROGRESS` applied when set.
    pub fn from_env() -> Result<AgentOptions, TransferError> {
        let mut opts = AgentOptions::default();
        if let Ok(v) = std::env::var(PROGRESS_ENV) {
            if !v.trim().is_empty() {
                opts.progress = Progress::parse(&v)?;
            }
        }
        Ok(opts)
    }

    fn agent_config(&self) -> AgentConfig {
        let (thread, delay_us) = match self.progress {
            Progress::Spin => (true, 0),
            Progress::Thread { delay } => (true, u64::try_from(delay.as_micros()).unwrap_or(u64::MAX).max(1)),
            Progress::Caller => (false, 0),
        };
        AgentConfig {
            enable_prog_thread: thread,
            // Metadata goes through the caller (etcd, files): no listener.
            enable_listen_thread: false,
            pthr_delay_us: delay_us,
            thread_sync: nixl_sys::ThreadSync::Default,
            ..AgentConfig::default()
        }
    }
}

/// Page-aligned, zeroed host memory, freed on drop.
struct DramBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

impl DramBuf {
    fn new(len: usize) -> Result<DramBuf, TransferError> {
        let layout = Layout::from_size_align(len, REGION_ALIGN)
            .map_err(|e| TransferError::InvalidArgument(format!("region of {len} bytes: {e}")))?;
        // SAFETY: layout has a non-zero size (checked by the caller) and a
        // valid power-of-two alignment.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw)
            .ok_or_else(|| TransferError::InvalidArgument(format!("could not allocate {len} bytes")))?;
        Ok(DramBuf { ptr, layout })
    }

    fn len(&self) -> usize {
        self.layout.size()
    }
}

// SAFETY: a DramBuf exclusively owns its allocation (like a Box<[u8]>), so
// moving it to another thread is sound.
unsafe impl Send for DramBuf {}

impl Drop for DramBuf {
    fn drop(&mut self) {
        // SAFETY: ptr was returned by alloc_zeroed with this very layout and
        // is freed only here.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// The descriptor nixl-sys registers: address and length of a [`DramBuf`].
#[derive(Debug)]
struct DramDesc {
    addr: usize,
    len: usize,
}

impl MemoryRegion for DramDesc {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for DramDesc {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }

    fn device_id(&self) -> u64 {
        0
    }
}

struct Region {
    // Declared before `buf` so it is deregistered before the memory is freed.
    _reg: RegistrationHandle,
    buf: DramBuf,
}

/// A NIXL agent with a UCX backend.
///
/// Owns the DRAM regions it registers; peers are loaded from metadata bytes
/// the caller exchanges (etcd, files, ...). All calls are synchronous.
pub struct TransferAgent {
    // Field order is drop order: abandoned requests are released and regions
    // deregistered while the agent is alive; the agent (and its backend) go
    // last. `Drop` leaks instead what NIXL may still be reading.
    /// WRITEs that timed out and were still in progress: kept, not released,
    /// until NIXL says they settled (releasing an active request does not
    /// make NIXL let go of its buffers; nixl-sys ignores the release status).
    abandoned: Vec<XferRequest>,
    regions: Vec<Region>,
    peers: HashSet<String>,
    backend: Backend,
    agent: Agent,
    name: String,
    _lib: NixlLibrary,
}

impl std::fmt::Debug for TransferAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferAgent")
            .field("name", &self.name)
            .field("regions", &self.regions.len())
            .field("peers", &self.peers)
            .finish()
    }
}

impl Drop for TransferAgent {
    fn drop(&mut self) {
        self.reap_abandoned();
        if !self.abandoned.is_empty() {
            // NIXL may still read these requests' local buffers (a peer that never came
            // back): leak the requests, the regions and so the agent they hold, rather than
            // free memory a transfer may read. Bounded: only what timed out and never settled.
            tracing::warn!(
                agent = %self.name,
                transfers = self.abandoned.len(),
                "dropping a NIXL agent with WRITEs still in progress; leaking their buffers"
            );
            std::mem::forget(std::mem::take(&mut self.abandoned));
            std::mem::forget(std::mem::take(&mut self.regions));
        }
    }
}

/// How often `write` looks at a transfer's status once the first
/// millisecond of busy polling is over.
const POLL_SLEEP: Duration = Duration::from_micros(50);
const BUSY_POLL: Duration = Duration::from_millis(1);

impl TransferAgent {
    /// Creates a NIXL agent called `name` with a UCX backend (default plugin
    /// parameters) and [`AgentOptions::from_env`].
    pub fn new(lib: &NixlLibrary, name: &str) -> Result<TransferAgent, TransferError> {
        TransferAgent::with_options(lib, name, AgentOptions::from_env()?)
    }

    /// Like [`TransferAgent::new`], with explicit options.
    pub fn with_options(lib: &NixlLibrary, name: &str, options: AgentOptions) -> Result<TransferAgent, TransferError> {
        if name.is_empty() || name.contains('\0') {
            return Err(TransferError::InvalidArgument(format!(
                "agent name {name:?} must be non-empty and contain no NUL"
            )));
        }
        let agent = Agent::new_configured(name, &options.agent_config()).map_err(|e| {
            TransferError::backend(
                "create_agent",
                &e,
                format!("agent {name}; check the NIXL install ({})", lib.capi_path().display()),
            )
        })?;
        let (_mems, params) = agent.get_plugin_params("UCX").map_err(|e| {
            TransferError::backend(
                "get_plugin_params",
                &e,
                format!(
                    "UCX plugin not found or not loadable; NIXL_PLUGIN_DIR={:?} (NIXL looks \
                     next to libnixl.so when it is unset: {})",
                    std::env::var("NIXL_PLUGIN_DIR").unwrap_or_default(),
                    lib.plugin_dir().display()
                ),
            )
        })?;
        let backend = agent.create_backend("UCX", &params).map_err(|e| {
            TransferError::backend(
                "create_backend",
                &e,
                format!(
                    "UCX backend for agent {name}; UCX_TLS={} (it must include tcp)",
                    std::env::var("UCX_TLS").unwrap_or_default()
                ),
            )
        })?;
        Ok(TransferAgent {
            abandoned: Vec::new(),
            regions: Vec::new(),
            peers: HashSet::new(),
            backend,
            agent,
            name: name.to_string(),
            _lib: *lib,
        })
    }

    /// This agent's name, as peers see it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Allocates `len` zeroed, page-aligned bytes of host memory and registers
    /// them with NIXL. The region lives as long as the agent.
    pub fn register_dram(&mut self, len: usize) -> Result<RegionId, TransferError> {
        if len == 0 {
            return Err(TransferError::InvalidArgument(
                "cannot register an empty region".to_string(),
            ));
        }
        let buf = DramBuf::new(len)?;
        let desc = DramDesc {
            addr: buf.ptr.as_ptr() as usize,
            len: buf.len(),
        };
        let reg = self
            .agent
            .register_memory(&desc, None)
            .map_err(|e| TransferError::backend("register_mem", &e, format!("{len} bytes of DRAM")))?;
        self.regions.push(Region { _reg: reg, buf });
        Ok(RegionId(self.regions.len() - 1))
    }

    fn region(&self, id: RegionId) -> Result<&Region, TransferError> {
        self.regions.get(id.0).ok_or_else(|| {
            TransferError::InvalidArgument(format!(
                "region {} does not exist (agent {} has {})",
                id.0,
                self.name,
                self.regions.len()
            ))
        })
    }

    /// The length in bytes of a local region.
    pub fn region_len(&self, id: RegionId) -> Result<usize, TransferError> {
        Ok(self.region(id)?.buf.len())
    }

    /// The range `offset..offset + len` of region `id`, checked.
    fn span(&self, id: RegionId, offset: usize, len: usize) -> Result<*mut u8, TransferError> {
        let r = self.region(id)?;
        match offset.checked_add(len) {
            Some(end) if end <= r.buf.len() => {
                // SAFETY: offset <= end <= the allocation's length.
                Ok(unsafe { r.buf.ptr.as_ptr().add(offset) })
            }
            _ => Err(TransferError::InvalidArgument(format!(
                "bytes {offset}..{offset}+{len} are outside region {} ({} bytes)",
                id.0,
                r.buf.len()
            ))),
        }
    }

    /// Copies bytes `offset..offset + out.len()` of a local region into `out`.
    ///
    /// Peers write into registered regions by DMA behind the process's back, so the agent
    /// never hands out a `&[u8]` over one (a shared reference promises the bytes do not
    /// change while it lives): reads are copies through a raw pointer. Read a region once
    /// its writer's notification has arrived; before that the bytes may be partly written.
    pub fn read_region(&self, id: RegionId, offset: usize, out: &mut [u8]) -> Result<(), TransferError> {
        let src = self.span(id, offset, out.len())?;
        // SAFETY: `src..src + out.len()` lies inside the live allocation (checked by `span`);
        // `out` is a distinct Rust buffer, so the two do not overlap. No reference to the
        // region's memory is created.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// A copy of a whole local region (see [`Agent::read_region`]).
    pub fn region_to_vec(&self, id: RegionId) -> Result<Vec<u8>, TransferError> {
        let mut out = vec![0u8; self.region_len(id)?];
        self.read_region(id, 0, &mut out)?;
        Ok(out)
    }

    /// Copies `data` into a local region at `offset` (to fill a source buffer before a
    /// WRITE). Like reads, through a raw pointer: no `&mut [u8]` over DMA-able memory.
    pub fn write_region(&mut self, id: RegionId, offset: usize, data: &[u8]) -> Result<(), TransferError> {
        let dst = self.span(id, offset, data.len())?;
        // SAFETY: inside the live allocation (checked by `span`); `data` is a distinct buffer.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        Ok(())
    }

    /// What a peer needs to WRITE into a local region.
    pub fn region_descriptor(&self, id: RegionId) -> Result<RemoteRegion, TransferError> {
        let r = self.region(id)?;
        Ok(RemoteRegion {
            addr: r.buf.ptr.as_ptr() as u64,
            len: r.buf.len() as u64,
            dev_id: 0,
        })
    }

    /// This agent's metadata (connection info and registered regions), for
    /// peers' [`TransferAgent::load_peer`]. Register regions first.
    pub fn local_metadata(&self) -> Result<Vec<u8>, TransferError> {
        self.agent
            .get_local_md()
            .map_err(|e| TransferError::backend("get_local_md", &e, format!("agent {}", self.name)))
    }

    /// Loads a peer's metadata; returns the peer's agent name.
    pub fn load_peer(&mut self, metadata: &[u8]) -> Result<String, TransferError> {
        if metadata.is_empty() {
            return Err(TransferError::InvalidArgument("peer metadata is empty".to_string()));
        }
        let name = self.agent.load_remote_md(metadata).map_err(|e| {
            TransferError::backend(
                "load_remote_md",
                &e,
                format!(
                    "{} bytes of peer metadata not loadable (corrupt, or an agent of that name \
                     is already loaded: for a restarted peer use replace_peer)",
                    metadata.len()
                ),
            )
        })?;
        self.peers.insert(name.clone());
        Ok(name)
    }

    /// Forgets `peer` if loaded, then loads `metadata`: for a peer that
    /// restarted and published new metadata under the same name (NIXL
    /// refuses to load a second copy of a known agent). Returns the name
    /// found in `metadata`, which should be `peer`.
    pub fn replace_peer(&mut self, peer: &str, metadata: &[u8]) -> Result<String, TransferError> {
        if self.peers.contains(peer) {
            self.forget_peer(peer)?;
        }
        self.load_peer(metadata)
    }

    /// Whether a peer's metadata is loaded.
    pub fn has_peer(&self, peer: &str) -> bool {
        self.peers.contains(peer)
    }

    /// Whether NIXL itself holds metadata for `peer`. (NIXL 1.5.1 keeps a
    /// dead peer's metadata, so this is no liveness probe.)
    pub fn nixl_knows_peer(&self, peer: &str) -> bool {
        self.agent.check_remote_metadata(peer, None)
    }

    /// Drops a peer's metadata (and its connection), so a restarted peer can
    /// be loaded again with its new metadata.
    pub fn forget_peer(&mut self, peer: &str) -> Result<(), TransferError> {
        if !self.peers.remove(peer) {
            return Err(TransferError::PeerNotLoaded { peer: peer.to_string() });
        }
        self.agent
            .invalidate_remote_md(peer)
            .map_err(|e| TransferError::backend("invalidate_remote_md", &e, format!("peer {peer}")))
    }

    /// WRITEs `len` bytes from `local_region[local_offset..]` to
    /// `remote[remote_offset..]` on `peer`, with `notification` delivered to
    /// the peer once the data is there, and waits until it completes, fails
    /// or `timeout` passes.
    ///
    /// On timeout [`TransferError::Timeout`] is returned and the request is
    /// kept until NIXL says it settled ([`TransferAgent::abandoned_transfers`]):
    /// its local buffer stays valid while NIXL may still read it. The remote
    /// range then holds unspecified bytes, and the notification may or may
    /// not arrive later.
    ///
    /// Error classification: NIXL reports a dead peer only as
    /// `NIXL_ERR_BACKEND` from `post_xfer_req` / `get_xfer_status` (the
    /// "remote agent ... was disconnected" text goes to stderr only, and NIXL
    /// 1.5.1 keeps the peer's metadata loaded). Such an error becomes
    /// [`TransferError::Backend`] (reason `nixl_error`) with `op`, the status
    /// name and `peer` set, so [`TransferError::is_transfer_failure`] is true.
    /// It is not guessed to be a disconnect; a caller that knows the peer is
    /// gone upgrades it with [`TransferError::confirm_disconnect`].
    /// A peer that is alive but not progressing (SIGSTOP, partition) gives no
    /// error at all: that is what `timeout` is for.
    // The flat argument list mirrors a NIXL WRITE one to one (peer, local
    // range, remote range, notification, deadline); callers name each.
    #[allow(clippy::too_many_arguments)]
    pub fn write(
        &mut self,
        peer: &str,
        local_region: RegionId,
        local_offset: usize,
        remote: &RemoteRegion,
        remote_offset: u64,
        len: usize,
        notification: &[u8],
        timeout: Duration,
    ) -> Result<TransferStats, TransferError> {
        self.reap_abandoned();
        if !self.peers.contains(peer) {
            return Err(TransferError::PeerNotLoaded { peer: peer.to_string() });
        }
        if len == 0 {
            return Err(TransferError::InvalidArgument(
                "a write needs at least one byte".to_string(),
            ));
        }
        let local = self.region(local_region)?;
        let local_end = local_offset.checked_add(len);
        if local_end.is_none_or(|end| end > local.buf.len()) {
            return Err(TransferError::InvalidArgument(format!(
                "local range {local_offset}+{len} exceeds region {} of {} bytes",
                local_region.0,
                local.buf.len()
            )));
        }
        let remote_end = remote_offset.checked_add(len as u64);
        if remote_end.is_none_or(|end| end > remote.len) {
            return Err(TransferError::InvalidArgument(format!(
                "remote range {remote_offset}+{len} exceeds the peer region of {} bytes",
                remote.len
            )));
        }
        let local_addr = local.buf.ptr.as_ptr() as usize + local_offset;
        let remote_addr = usize::try_from(remote.addr.saturating_add(remote_offset))
            .map_err(|_| TransferError::InvalidArgument("remote address overflows".into()))?;

        let ctx = |what: &str| format!("{what}; WRITE of {len} bytes to peer {peer}");
        let mut local_list = XferDescList::new(MemType::Dram)
            .map_err(|e| TransferError::backend("create_xfer_dlist", &e, ctx("local list")))?;
        local_list.add_desc(local_addr, len, 0);
        let mut remote_list = XferDescList::new(MemType::Dram)
            .map_err(|e| TransferError::backend("create_xfer_dlist", &e, ctx("remote list")))?;
        remote_list.add_desc(remote_addr, len, remote.dev_id);

        let mut opt = OptArgs::new().map_err(|e| TransferError::backend("create_opt_args", &e, ctx("options")))?;
        opt.add_backend(&self.backend)
            .map_err(|e| TransferError::backend("opt_args_add_backend", &e, ctx("options")))?;
        if !notification.is_empty() {
            opt.set_notification_message(notification)
                .map_err(|e| TransferError::backend("opt_args_set_notif", &e, ctx("options")))?;
            opt.set_has_notification(true)
                .map_err(|e| TransferError::backend("opt_args_set_notif", &e, ctx("options")))?;
        }

        let req = self
            .agent
            .create_xfer_req(XferOp::Write, &local_list, &remote_list, peer, Some(&opt))
            .map_err(|e| {
                TransferError::backend(
                    "create_xfer_req",
                    &e,
                    ctx(&format!(
                        "the remote range is not registered in the metadata loaded for {peer} \
                         (stale metadata from before a restart? use replace_peer)"
                    )),
                )
                .with_peer(peer)
            })?;

        let start = Instant::now();
        let posted = self.agent.post_xfer_req(&req, Some(&opt));
        let mut in_progress = posted.map_err(|e| self.transfer_error("post_xfer_req", &e, peer, len))?;
        while in_progress {
            match self.agent.get_xfer_status(&req) {
                Ok(XferStatus::Success) => in_progress = false,
                Ok(XferStatus::InProgress) => {
                    let waited = start.elapsed();
                    if waited >= timeout {
                        // Not released: NIXL may still read the local buffer.
                        self.abandoned.push(req);
                        return Err(TransferError::Timeout {
                            after_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
                            peer: peer.to_string(),
                        });
                    }
                    if waited < BUSY_POLL {
                        std::thread::yield_now();
                    } else {
                        std::thread::sleep(POLL_SLEEP);
                    }
                }
                Err(e) => return Err(self.transfer_error("get_xfer_status", &e, peer, len)),
            }
        }
        Ok(TransferStats {
            elapsed: start.elapsed(),
            bytes: len as u64,
        })
    }

    /// WRITEs that timed out and that NIXL has not settled yet (a stopped or
    /// cut-off peer). Settled ones are released first.
    pub fn abandoned_transfers(&mut self) -> usize {
        self.reap_abandoned();
        self.abandoned.len()
    }

    /// Releases the abandoned requests NIXL is done with (succeeded or failed).
    fn reap_abandoned(&mut self) {
        let agent = &self.agent;
        self.abandoned
            .retain(|req| matches!(agent.get_xfer_status(req), Ok(XferStatus::InProgress)));
    }

    fn transfer_error(&self, op: &'static str, err: &NixlError, peer: &str, len: usize) -> TransferError {
        TransferError::Backend {
            op,
            status: status_name(err).to_string(),
            detail: format!(
                "WRITE of {len} bytes to peer {peer} failed ({err}); the peer process may have \
                 died or disconnected (NIXL logs \"remote agent ... was disconnected\" on stderr \
                 then); after it restarts, load its new metadata with replace_peer"
            ),
            peer: Some(peer.to_string()),
        }
    }

    /// Drains the notifications received so far: (sender agent, message).
    pub fn notifications(&mut self) -> Result<Vec<(String, Vec<u8>)>, TransferError> {
        let mut map =
            NotificationMap::new().map_err(|e| TransferError::backend("create_notif_map", &e, "notifications"))?;
        self.agent
            .get_notifications(&mut map, None)
            .map_err(|e| TransferError::backend("get_notifs", &e, format!("agent {}", self.name)))?;
        let mut out = Vec::new();
        let agents: Vec<String> = map
            .agents()
            .map(|a| a.map(str::to_string))
            .collect::<Result<_, _>>()
            .map_err(|e| TransferError::backend("notif_map_get_agent", &e, "notifications"))?;
        for agent in agents {
            let msgs = map
                .get_notifications(&agent)
                .map_err(|e| TransferError::backend("notif_map_get_notifs", &e, "notifications"))?;
            for msg in msgs {
                let msg = msg.map_err(|e| TransferError::backend("notif_map_get_notif", &e, "notifications"))?;
                out.push((agent.clone(), msg));
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_parses() {
        assert_eq!(Progress::parse("spin").ok(), Some(Progress::Spin));
        assert_eq!(Progress::parse(" caller ").ok(), Some(Progress::Caller));
        assert_eq!(Progress::parse("0").ok(), Some(Progress::Spin));
        assert_eq!(
            Progress::parse("250").ok(),
            Some(Progress::Thread {
                delay: Duration::from_micros(250)
            })
        );
        let e = Progress::parse("fast").expect_err("bad value");
        assert_eq!(e.reason(), "other");
        assert!(e.to_string().contains(PROGRESS_ENV));
    }

    #[test]
    fn default_progress_is_a_waiting_thread() {
        let cfg = AgentOptions::default().agent_config();
        assert!(cfg.enable_prog_thread);
        assert_eq!(cfg.pthr_delay_us, 100);
        assert!(!cfg.enable_listen_thread);
        let caller = AgentOptions {
            progress: Progress::Caller,
        }
        .agent_config();
        assert!(!caller.enable_prog_thread);
    }
}
