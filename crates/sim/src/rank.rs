//! A rank process of the simulated deployment (`rootrank sim-rank`).
//!
//! A prefill rank, per room: fills its KV shard with the room's pattern, WRITEs it chunk by
//! chunk into its decode peer's DRAM with SGLang's notification tags, all-reduces its poll
//! state over the parent's hub, and on a group failure either reports its own error (it
//! failed: the transfer agent already recorded a `local` RoomFailure) or, where SGLang would
//! raise the generic `KVTransferError(room, "NIXL KVSender Exception",
//! is_from_another_rank=True)`, records a `propagated` RoomFailure and asks the coordinator.
//!
//! A decode rank drains NIXL notifications, counts chunks per (room, source rank) and checks
//! the bytes once a source's last chunk is in.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rootrank_agent::AgentConfig;
use rootrank_core::Origin;
use rootrank_transfer::RemoteRegion;
use tracing::{debug, error, info, info_span, warn};

use super::{kvpoll, RankOpts, RankRoomReport, Role, GENERIC_SENDER_ERROR};
use crate::pattern;
use crate::SimError;
use rootrank_transfer_agent::NixlLibrary;
use rootrank_transfer_agent::{PeerRef, RankAgent};

/// Runs a rank until the parent says `exit` (or goes away).
pub fn run(opts: RankOpts) -> Result<(), SimError> {
    let lib = rootrank_transfer_agent::load_nixl(opts.nixl_dir.as_deref())?;
    let span = info_span!("sim_rank", role = opts.role.as_str(), group = %opts.group, rank = opts.rank);
    let _enter = span.enter();
    match opts.role {
        Role::Prefill => prefill(&lib, &opts),
        Role::Decode => decode(&lib, &opts),
    }
}

fn agent_config(opts: &RankOpts) -> Result<AgentConfig, SimError> {
    let mut c = AgentConfig::new(
        opts.etcd_endpoints.clone(),
        &opts.group,
        u64::from(opts.rank),
        u64::from(opts.group_size),
    )?;
    // The parent passes etcd's credential files in the environment (see `spawn_rank`).
    c.etcd = rootrank_store::EtcdAccess::new(
        opts.etcd_endpoints.clone(),
        &rootrank_store::EtcdCredentialFiles::from_env(),
    )
    .map_err(rootrank_store::StoreError::from)?;
    c.prefix = opts.prefix.clone();
    c.role = Some(opts.role.as_str().to_string());
    c.lease_ttl = Duration::from_millis(opts.lease_ttl_ms);
    Ok(c)
}

const START_WITHIN: Duration = Duration::from_secs(60);

/// The line channel to the parent's hub.
struct Hub {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    /// Lines read while waiting for something else, handled later in order.
    deferred: VecDeque<String>,
}

impl Hub {
    fn connect(addr: &str) -> Result<Hub, SimError> {
        let stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        Ok(Hub {
            writer: stream.try_clone()?,
            reader: BufReader::new(stream),
            deferred: VecDeque::new(),
        })
    }

    fn send(&mut self, line: &str) -> Result<(), SimError> {
        self.writer.write_all(line.as_bytes())?;
        self.writer.write_all(b"\n")?;
        Ok(())
    }

    /// The next line from the socket (not the deferred queue); `None` when the parent is gone.
    fn read_socket(&mut self) -> Result<Option<String>, SimError> {
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            return Ok(None);
        }
        Ok(Some(line.trim_end().to_string()))
    }

    fn next(&mut self) -> Result<Option<String>, SimError> {
        if let Some(l) = self.deferred.pop_front() {
            return Ok(Some(l));
        }
        self.read_socket()
    }

    /// Waits for a line starting with `want`, deferring room messages; `None` on `exit` or EOF.
    fn wait_for(&mut self, want: &str) -> Result<Option<String>, SimError> {
        loop {
            let Some(line) = self.read_socket()? else {
                return Ok(None);
            };
            if line.starts_with(want) {
                return Ok(Some(line));
            }
            if line == "exit" {
                return Ok(None);
            }
            self.deferred.push_back(line);
        }
    }
}

fn prefill(lib: &NixlLibrary, opts: &RankOpts) -> Result<(), SimError> {
    let mut hub = Hub::connect(&opts.hub)?;
    let shard = opts.block_size * opts.chunks as usize;
    let mut agent = RankAgent::start(lib, agent_config(opts)?, &[shard], START_WITHIN)?;
    let peer = PeerRef::new(&opts.peer_group, opts.rank);
    agent.connect_peer(&peer, START_WITHIN)?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let http = rootrank_tls::http_client(None)
        .map_err(|e| SimError::Sim(e.to_string()))?
        .timeout(Duration::from_millis(opts.verdict_wait_ms + 5_000))
        .build()
        .map_err(|e| SimError::Sim(format!("HTTP client: {e}")))?;
    hub.send(&format!("hello prefill {} {}", opts.rank, std::process::id()))?;
    info!(peer_agent = ?agent.peer_info(&peer).agent, "prefill rank ready");

    while let Some(line) = hub.next()? {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["exit"] => break,
            ["room", idx, room, fault] => {
                let (Ok(idx), Ok(room)) = (idx.parse::<u64>(), room.parse::<u64>()) else {
                    warn!(line, "bad room message");
                    continue;
                };
                let fault = (*fault).to_string();
                let Some(report) = prefill_room(&mut agent, &mut hub, &rt, &http, opts, &peer, idx, room, &fault)?
                else {
                    break; // the parent said exit (or went away) mid-room
                };
                let json = serde_json::to_string(&report).map_err(|e| SimError::Sim(e.to_string()))?;
                hub.send(&format!("done {json}"))?;
            }
            _ => debug!(line, "ignored hub message"),
        }
    }
    let clean = agent.shutdown(Duration::from_secs(5));
    info!(clean, "prefill rank exiting");
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn prefill_room(
    agent: &mut RankAgent,
    hub: &mut Hub,
    rt: &tokio::runtime::Runtime,
    http: &reqwest::Client,
    opts: &RankOpts,
    peer: &PeerRef,
    idx: u64,
    room: u64,
    fault: &str,
) -> Result<Option<RankRoomReport>, SimError> {
    let span = info_span!("room", group = %opts.group, rank = opts.rank, room, idx);
    let _enter = span.enter();
    let block = opts.block_size;
    let chunks = opts.chunks.max(1);
    {
        let mut src = vec![0u8; chunks as usize * block];
        for c in 0..chunks {
            let start = c as usize * block;
            pattern::fill(&mut src[start..start + block], room, opts.rank, c);
        }
        agent.write_region(0, 0, &src)?;
    }
    // Per room, as SGLang's decode side re-registers with the bootstrap server per request:
    // pick up a restarted peer's new metadata before writing (one etcd read).
    match agent.refresh_peer(peer) {
        Ok(true) => info!(
            peer_rank = peer.rank,
            "decode peer changed (restarted?); loaded its new metadata"
        ),
        Ok(false) => {}
        Err(e) => warn!(error = %e, "could not refresh the decode peer's metadata"),
    }
    let timeout = Duration::from_millis(opts.transfer_timeout_ms);
    let slot_base = (idx % u64::from(opts.slots.max(1))) * (block as u64) * u64::from(chunks);
    let mut failure = None;
    let mut transfer_us = 0u64;

    if fault == "fail" {
        // An injected transfer failure, made real: a WRITE into a range the decode peer never
        // registered. NIXL itself refuses it (create_xfer_req), as it would a stale or corrupt
        // descriptor, and the transfer agent records what NIXL said.
        let real = agent.peer_region(peer, 0)?;
        let bogus = RemoteRegion {
            addr: real.addr.wrapping_add(real.len).wrapping_add(1 << 30),
            len: real.len,
            dev_id: real.dev_id,
        };
        let tag = format!("{room}_kv_0_{}_{}", u8::from(chunks == 1), opts.rank);
        if let Err(e) = agent.write_room_to(room, peer, 0, 0, &bogus, 0, block, tag.as_bytes(), timeout) {
            failure = Some(e);
        }
    } else {
        for c in 0..chunks {
            if c == 1 && fault == "pause" {
                // Fault injection point: the launcher kills our decode peer between chunks.
                hub.send(&format!("midway {idx}"))?;
                if hub.wait_for(&format!("go {idx}"))?.is_none() {
                    return Ok(None);
                }
            }
            let is_last = u8::from(c + 1 == chunks);
            let tag = format!("{room}_kv_{c}_{is_last}_{}", opts.rank);
            let offset = c as usize * block;
            match agent.write_room(
                room,
                peer,
                0,
                offset,
                0,
                slot_base + offset as u64,
                block,
                tag.as_bytes(),
                timeout,
            ) {
                Ok(stats) => transfer_us += u64::try_from(stats.elapsed.as_micros()).unwrap_or(u64::MAX),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
    }

    let own = if failure.is_some() {
        kvpoll::FAILED
    } else {
        kvpoll::SUCCESS
    };
    hub.send(&format!("reduce {idx} {own}"))?;
    let Some(line) = hub.wait_for(&format!("result {idx} "))? else {
        return Ok(None);
    };
    let reduced = line
        .split_whitespace()
        .nth(2)
        .and_then(|s| s.parse::<u8>().ok())
        .unwrap_or(kvpoll::FAILED);
    let mut report = RankRoomReport {
        idx,
        room: room.to_string(),
        rank: opts.rank,
        own,
        reduced,
        transfer_us: Some(transfer_us),
        ..RankRoomReport::default()
    };
    if reduced != kvpoll::FAILED {
        debug!(state = kvpoll::name(reduced), "room done");
        return Ok(Some(report));
    }
    if let Some(f) = failure {
        // This rank failed itself: SGLang's record_failure path; the transfer agent has
        // already published the `local` record.
        let text = format!("KVTransferError(bootstrap_room={room}): {}", f.detail);
        error!(
            "Prefill transfer failed for request rank={} bootstrap_room={room} with exception {text}",
            opts.rank
        );
        report.error = Some(text);
        report.reason = Some(f.reason.to_string());
        return Ok(Some(report));
    }
    // Only the all-reduce said Failed: NixlKVSender.failure_exception()'s fallback branch.
    let generic = format!("KVTransferError(bootstrap_room={room}): {GENERIC_SENDER_ERROR}");
    error!(
        "Prefill transfer failed for request rank={} bootstrap_room={room} with exception {generic}",
        opts.rank
    );
    report.generic = Some(generic);
    if let Some(a) = agent.agent() {
        if let Err(e) = a.record_failure(room, Origin::Propagated, "other", GENERIC_SENDER_ERROR, None) {
            warn!(error = %e, "could not record the propagated failure");
        }
    }
    if let Some(base) = &opts.coordinator {
        let url = format!("{}/v1/rooms/{room}/verdict", base.trim_end_matches('/'));
        let query = [
            ("group", opts.group.clone()),
            ("wait_ms", opts.verdict_wait_ms.min(30_000).to_string()),
            ("asking_rank", opts.rank.to_string()),
        ];
        let asked = rt.block_on(async {
            let resp = http.get(&url).query(&query).send().await?;
            resp.error_for_status()?.json::<serde_json::Value>().await
        });
        match asked {
            Ok(v) => {
                report.verdict_at_ms = Some(rootrank_store::unix_ms());
                log_culprit(room, &v);
                report.verdict = Some(v);
            }
            Err(e) => warn!(error = %e, "could not ask the coordinator; raising the generic error"),
        }
    }
    Ok(Some(report))
}

/// What the rank raises instead of the generic error: the culprit the coordinator names.
/// `None` when the verdict is not resolved (the rank then keeps the generic error).
pub fn culprit_error(room: u64, v: &serde_json::Value) -> Option<String> {
    let s = |x: &serde_json::Value| x.as_str().map(str::to_string).unwrap_or_else(|| x.to_string());
    let c = v["culprit"].as_object().filter(|_| v["status"] == "resolved")?;
    let mut text = format!(
        "KVTransferError(bootstrap_room={room}): failed at {} rank {}: {} ({}): {}",
        s(&c["group"]),
        s(&c["rank"]),
        s(&c["reason"]),
        s(&c["source"]),
        c.get("detail").and_then(|d| d.as_str()).unwrap_or("")
    );
    if let Some(k) = v["cause"].as_object() {
        text.push_str(&format!(
            "; cause: {} rank {}: {}",
            s(&k["group"]),
            s(&k["rank"]),
            s(&k["reason"])
        ));
    }
    Some(text)
}

fn log_culprit(room: u64, v: &serde_json::Value) {
    match culprit_error(room, v) {
        Some(text) => error!("{text}"),
        None => warn!(
            "KVTransferError(bootstrap_room={room}): rootrank verdict {}: {}",
            v["status"].as_str().unwrap_or("?"),
            v["explain"].as_str().unwrap_or("")
        ),
    }
}

/// Chunks seen so far for one (room, source rank).
#[derive(Default)]
struct Arrivals {
    seen: u32,
    last: Option<u32>,
}

fn decode(lib: &NixlLibrary, opts: &RankOpts) -> Result<(), SimError> {
    let mut hub = Hub::connect(&opts.hub)?;
    let slots = u64::from(opts.slots.max(1));
    let chunks = opts.chunks.max(1);
    let slot_len = opts.block_size * chunks as usize;
    let mut agent = RankAgent::start(lib, agent_config(opts)?, &[slot_len * slots as usize], START_WITHIN)?;
    hub.send(&format!("hello decode {} {}", opts.rank, std::process::id()))?;
    info!("decode rank ready");

    // A reader thread, so the main loop can drain NIXL notifications while waiting for the hub.
    let (tx, rx) = mpsc::channel::<Option<String>>();
    let mut reader = hub.reader;
    std::thread::Builder::new()
        .name("hub-reader".into())
        .spawn(move || loop {
            let mut line = String::new();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => {
                    let _ = tx.send(None);
                    return;
                }
                Ok(_) => {
                    if tx.send(Some(line.trim_end().to_string())).is_err() {
                        return;
                    }
                }
            }
        })?;
    let mut writer = hub.writer;

    let mut rooms: BTreeMap<u64, u64> = BTreeMap::new(); // idx -> room
    let mut room_idx: HashMap<u64, u64> = HashMap::new(); // room -> idx
    let mut arrivals: HashMap<(u64, u32), Arrivals> = HashMap::new();
    let mut unknown: Vec<(u64, u32, u32, bool)> = Vec::new(); // notifications before their room message
    'main: loop {
        let mut busy = false;
        loop {
            match rx.try_recv() {
                Ok(Some(line)) => {
                    busy = true;
                    let words: Vec<&str> = line.split_whitespace().collect();
                    match words.as_slice() {
                        ["exit"] => break 'main,
                        ["room", idx, room] => {
                            if let (Ok(i), Ok(r)) = (idx.parse::<u64>(), room.parse::<u64>()) {
                                rooms.insert(i, r);
                                room_idx.insert(r, i);
                                // Forget rooms long gone (their sources died): bounded memory.
                                while rooms.len() > 4096 {
                                    if let Some((_, old)) = rooms.pop_first() {
                                        room_idx.remove(&old);
                                        arrivals.retain(|(r, _), _| *r != old);
                                    }
                                }
                            }
                        }
                        _ => debug!(line, "ignored hub message"),
                    }
                }
                Ok(None) | Err(mpsc::TryRecvError::Disconnected) => break 'main,
                Err(mpsc::TryRecvError::Empty) => break,
            }
        }
        let mut events: Vec<(u64, u32, u32, bool)> = std::mem::take(&mut unknown);
        for (_from, msg) in agent.notifications()? {
            busy = true;
            match parse_tag(&msg) {
                Some(t) => events.push(t),
                None => warn!(tag = %String::from_utf8_lossy(&msg), "notification with an unknown tag"),
            }
        }
        for (room, chunk, src, is_last) in events {
            let Some(&idx) = room_idx.get(&room) else {
                unknown.push((room, chunk, src, is_last));
                continue;
            };
            let a = arrivals.entry((room, src)).or_default();
            a.seen += 1;
            if is_last {
                a.last = Some(chunk);
            }
            if a.last.is_some_and(|l| a.seen == l + 1) {
                arrivals.remove(&(room, src));
                let base = (idx % slots) as usize * slot_len;
                let mut bytes = vec![0u8; chunks as usize * opts.block_size];
                agent.read_region(0, base, &mut bytes)?;
                let ok = (0..chunks).all(|c| {
                    let s = c as usize * opts.block_size;
                    pattern::check(&bytes[s..s + opts.block_size], room, src, c)
                });
                let span = info_span!("room", group = %opts.group, rank = opts.rank, room, idx);
                span.in_scope(|| {
                    if ok {
                        debug!(src, "KV shard arrived intact")
                    } else {
                        error!(src, "KV shard arrived corrupt")
                    }
                });
                let line = format!("recv {idx} {src} {}\n", if ok { "ok" } else { "bad" });
                if writer.write_all(line.as_bytes()).is_err() {
                    break 'main;
                }
            }
        }
        if unknown.len() > 100_000 {
            unknown.clear(); // never mapped: the parent is not sending rooms any more
        }
        if !busy {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let started = Instant::now();
    let clean = agent.shutdown(Duration::from_secs(5));
    info!(
        clean,
        took_ms = started.elapsed().as_millis() as u64,
        "decode rank exiting"
    );
    Ok(())
}

/// `{room}_kv_{chunk}_{is_last}_{src_rank}` -> (room, chunk, src_rank, is_last).
pub fn parse_tag(msg: &[u8]) -> Option<(u64, u32, u32, bool)> {
    let s = std::str::from_utf8(msg).ok()?;
    let mut it = s.split('_');
    let room = it.next()?.parse().ok()?;
    if it.next()? != "kv" {
        return None;
    }
    let chunk = it.next()?.parse().ok()?;
    let is_last = match it.next()? {
        "0" => false,
        "1" => true,
        _ => return None,
    };
    let src = it.next()?.parse().ok()?;
    if it.next().is_some() {
        return None;
    }
    Some((room, chunk, src, is_last))
}

#[cfg(test)]
mod tests {
    #[test]
    fn tags_parse() {
        assert_eq!(
            super::parse_tag(b"9223372036854775807_kv_1_1_3"),
            Some((i64::MAX as u64, 1, 3, true))
        );
        assert_eq!(super::parse_tag(b"5_kv_0_0_0"), Some((5, 0, 0, false)));
        assert_eq!(super::parse_tag(b"5_kv_0_2_0"), None);
        assert_eq!(super::parse_tag(b"5_aux_0_1_0"), None);
        assert_eq!(super::parse_tag(b"5_kv_0_1_0_x"), None);
    }
}
