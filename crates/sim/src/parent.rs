//! `rootrank simulate`: the launcher, router and gloo stand-in of a simulated PD deployment.
//! See the [`super`] module docs for the protocol.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::{kvpoll, RankOpts, RankRoomReport, Role};
use crate::SimError;

/// A fault to inject, at the moment room `at_room` (0-based index) is issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Fault {
    pub kind: FaultKind,
    pub rank: u32,
    pub at_room: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// SIGKILL a prefill rank before the room (as the OOM killer would).
    KillPrefill,
    /// SIGKILL a decode rank in the middle of the room's transfer (between its chunks).
    KillDecode,
    /// SIGSTOP a decode rank before the room.
    StopDecode,
    /// The prefill rank's WRITE targets memory the decode peer never registered: NIXL fails it.
    FailTransfer,
    /// The launcher SIGKILLs a decode rank and starts it again (new NIXL agent, new metadata)
    /// before the room; the prefill side must load the new metadata from etcd.
    RestartDecode,
}

/// How a simulation runs.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// The `rootrank` binary (it is re-run as `rootrank sim-rank`).
    pub exe: PathBuf,
    pub etcd_endpoints: Vec<String>,
    pub prefix: String,
    pub coordinator: Option<String>,
    pub prefill_group: String,
    pub decode_group: String,
    pub ranks: u32,
    /// 0: until stopped.
    pub rooms: u64,
    pub room_rate: f64,
    pub block_size: usize,
    pub chunks: u32,
    pub slots: u32,
    pub lease_ttl_ms: u64,
    pub transfer_timeout_ms: u64,
    /// How long a round waits for a rank that has not contributed (gloo's timeout).
    pub reduce_timeout_ms: u64,
    pub verdict_wait_ms: u64,
    pub faults: Vec<Fault>,
    pub log_dir: PathBuf,
    pub nixl_dir: Option<PathBuf>,
}

/// One room, once it is over.
#[derive(Clone, Debug, Serialize)]
pub struct RoomSummary {
    pub idx: u64,
    pub room: String,
    /// `success`, `failed`, or `incomplete` (stopped before the room was over).
    pub status: &'static str,
    /// The all-reduced KVPoll state.
    pub reduced: Option<u8>,
    /// The culprit as the survivors' verdict (or a rank's own failure) names it.
    pub culprit: Option<serde_json::Value>,
    /// The culprit's own root cause, through its peer (SPEC rule 5), when the verdict has one.
    pub cause: Option<serde_json::Value>,
    pub verdict_status: Option<String>,
    /// Prefill ranks that failed the room themselves: (rank, reason).
    pub local_failures: Vec<(u32, String)>,
    /// Decode ranks' checks of the KV shards: (source rank, intact).
    pub decode_checks: Vec<(u32, bool)>,
    pub faults: Vec<Fault>,
    /// From the router issuing the room to the room being over (queueing included).
    pub latency_ms: Option<f64>,
    pub reports: Vec<RankRoomReport>,
}

impl RoomSummary {
    /// One line for people.
    pub fn line(&self) -> String {
        let culprit = match &self.culprit {
            Some(c) => format!(
                "culprit {} rank {} {} ({})",
                str_of(&c["group"]),
                str_of(&c["rank"]),
                str_of(&c["reason"]),
                str_of(&c["source"])
            ),
            None if self.status == "success" => String::new(),
            None => format!(
                "culprit unknown (verdict {})",
                self.verdict_status.as_deref().unwrap_or("not asked")
            ),
        };
        let culprit = match &self.cause {
            Some(k) => format!(
                "{culprit} <- cause {} rank {} {}",
                str_of(&k["group"]),
                str_of(&k["rank"]),
                str_of(&k["reason"])
            ),
            None => culprit,
        };
        let intact = self.decode_checks.iter().filter(|(_, ok)| *ok).count();
        format!(
            "room {:>3} {:>19} {:<10} decode {intact}/{} intact  {culprit}",
            self.idx,
            self.room,
            self.status,
            self.decode_checks.len()
        )
    }
}

fn str_of(v: &serde_json::Value) -> String {
    v.as_str().map(str::to_string).unwrap_or_else(|| v.to_string())
}

/// A measured delay.
#[derive(Clone, Debug, Serialize)]
pub struct Measurement {
    pub what: String,
    pub ms: f64,
}

/// What a simulation did.
#[derive(Clone, Debug, Serialize)]
pub struct SimReport {
    pub rooms: Vec<RoomSummary>,
    pub measurements: Vec<Measurement>,
    pub log_dir: PathBuf,
    pub stopped_early: bool,
    /// Bytes each prefill rank WRITEs per room (block size x chunks).
    pub shard_bytes: u64,
    /// Prefill and decode pids, by rank.
    pub prefill_pids: Vec<u32>,
    pub decode_pids: Vec<u32>,
}

/// The rank processes. Dropping this kills (SIGCONT, then SIGKILL) and reaps every one still
/// running, so no exit path of the parent leaves a rank behind.
struct Children {
    procs: Vec<(Role, u32, Child)>,
}

impl Children {
    fn get(&mut self, role: Role, rank: u32) -> Option<&mut Child> {
        self.procs
            .iter_mut()
            .find(|(r, k, _)| *r == role && *k == rank)
            .map(|(_, _, c)| c)
    }

    fn signal(&mut self, role: Role, rank: u32, sig: i32) -> bool {
        match self.get(role, rank) {
            Some(c) => {
                // SAFETY: kill(2) on our own, not yet reaped child; no memory involved.
                unsafe { libc::kill(c.id() as i32, sig) == 0 }
            }
            None => false,
        }
    }

    fn all_exited(&mut self) -> bool {
        self.procs
            .iter_mut()
            .all(|(_, _, c)| matches!(c.try_wait(), Ok(Some(_))))
    }

    fn kill_all(&mut self) {
        for (_, _, c) in &mut self.procs {
            if let Ok(None) = c.try_wait() {
                // SAFETY: as in `signal`. SIGCONT first: a stopped child must run to die cleanly.
                unsafe { libc::kill(c.id() as i32, libc::SIGCONT) };
                let _ = c.kill();
            }
            let _ = c.wait();
        }
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        self.kill_all();
    }
}

fn spawn_rank(config: &SimConfig, opts: &RankOpts) -> Result<Child, SimError> {
    let log_path = config.log_dir.join(format!("{}-{}.log", opts.group, opts.rank));
    let log = std::fs::OpenOptions::new().create(true).append(true).open(&log_path)?;
    let json = serde_json::to_string(opts).map_err(|e| SimError::Sim(e.to_string()))?;
    let parent = std::process::id() as i32;
    let mut cmd = Command::new(&config.exe);
    cmd.arg("sim-rank")
        .arg("--opts")
        .arg(json)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    if std::env::var_os("ROOTRANK_LOG").is_none() {
        cmd.env("ROOTRANK_LOG", "info");
    }
    // SAFETY: only async-signal-safe calls (setpgid, prctl, getppid, _exit) between fork and
    // exec. Own process group: a terminal's ^C reaches the parent only, which then stops the
    // ranks cleanly. PDEATHSIG: if the parent dies anyhow (even SIGKILL), the rank dies too.
    // (PDEATHSIG follows the spawning thread: spawn only from the thread that lives longest.)
    unsafe {
        cmd.pre_exec(move || {
            libc::setpgid(0, 0);
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    Ok(cmd.spawn()?)
}

enum Ev {
    Line(u64, String),
    Closed(u64),
    Measured(String, f64),
}

#[derive(Default)]
struct Round {
    room: u64,
    issued_at: Option<Instant>,
    first_at: Option<Instant>,
    contrib: BTreeMap<u32, u8>,
    resolved: Option<(u8, Instant)>,
    dones: BTreeMap<u32, RankRoomReport>,
    decode: BTreeMap<u32, bool>,
    faults: Vec<Fault>,
}

/// Runs the simulation until `rooms` rooms are over (or `shutdown` resolves), printing each
/// room through `on_room`. Must be polled on the thread that outlives the ranks (see
/// `spawn_rank`): `block_on` it on the main thread.
pub async fn run(
    config: SimConfig,
    shutdown: impl std::future::Future<Output = ()>,
    on_room: &mut dyn FnMut(&RoomSummary),
) -> Result<SimReport, SimError> {
    if config.ranks == 0 || config.ranks > 256 {
        return Err(SimError::Sim(format!("--ranks {}: 1..=256", config.ranks)));
    }
    for f in &config.faults {
        if f.rank >= config.ranks {
            return Err(SimError::Sim(format!(
                "fault {:?} names rank {} of a group of {}",
                f.kind, f.rank, config.ranks
            )));
        }
    }
    if !(config.room_rate > 0.0 && config.room_rate.is_finite()) {
        return Err(SimError::Sim(
            "--room-rate must be a positive number of rooms per second".into(),
        ));
    }
    std::fs::create_dir_all(&config.log_dir)?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let hub = listener.local_addr()?.to_string();
    let mut etcd = rootrank_store::connect(&config.etcd_endpoints).await?;

    let mut children = Children { procs: Vec::new() };
    let mut rank_opts: HashMap<(Role, u32), RankOpts> = HashMap::new();
    for (role, group, peer_group) in [
        (Role::Decode, &config.decode_group, &config.prefill_group),
        (Role::Prefill, &config.prefill_group, &config.decode_group),
    ] {
        for rank in 0..config.ranks {
            let opts = RankOpts {
                role,
                group: group.clone(),
                rank,
                group_size: config.ranks,
                peer_group: peer_group.clone(),
                etcd_endpoints: config.etcd_endpoints.clone(),
                prefix: config.prefix.clone(),
                coordinator: config.coordinator.clone(),
                hub: hub.clone(),
                block_size: config.block_size,
                chunks: config.chunks,
                slots: config.slots,
                lease_ttl_ms: config.lease_ttl_ms,
                transfer_timeout_ms: config.transfer_timeout_ms,
                verdict_wait_ms: config.verdict_wait_ms,
                nixl_dir: config.nixl_dir.clone(),
            };
            let child = spawn_rank(&config, &opts)?;
            children.procs.push((role, rank, child));
            rank_opts.insert((role, rank), opts);
        }
    }

    let (tx, mut rx) = mpsc::unbounded_channel::<Ev>();
    let mut writers: HashMap<u64, mpsc::UnboundedSender<String>> = HashMap::new();
    let (conn_tx, mut conn_rx) = mpsc::unbounded_channel();
    {
        let tx = tx.clone();
        tokio::spawn(async move {
            let mut next_id = 0u64;
            while let Ok((stream, _)) = listener.accept().await {
                let _ = stream.set_nodelay(true);
                let id = next_id;
                next_id += 1;
                let (read, mut write) = stream.into_split();
                let (wtx, mut wrx) = mpsc::unbounded_channel::<String>();
                tokio::spawn(async move {
                    while let Some(line) = wrx.recv().await {
                        if write.write_all(line.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
                if conn_tx.send((id, wtx)).is_err() {
                    return;
                }
                let tx = tx.clone();
                tokio::spawn(async move {
                    let mut lines = BufReader::new(read).lines();
                    while let Ok(Some(line)) = lines.next_line().await {
                        if tx.send(Ev::Line(id, line)).is_err() {
                            return;
                        }
                    }
                    let _ = tx.send(Ev::Closed(id));
                });
            }
        });
    }

    // Start-up: every rank says hello once its agent is registered and its peer loaded.
    let mut who: HashMap<u64, (Role, u32)> = HashMap::new();
    let mut conn_of: HashMap<(Role, u32), u64> = HashMap::new();
    let mut pids: HashMap<(Role, u32), u32> = HashMap::new();
    let start_deadline = Instant::now() + Duration::from_secs(90);
    tokio::pin!(shutdown);
    while who.len() < 2 * config.ranks as usize {
        tokio::select! {
            Some((id, w)) = conn_rx.recv() => { writers.insert(id, w); }
            Some(ev) = rx.recv() => {
                if let Ev::Line(id, line) = ev {
                    let w: Vec<&str> = line.split_whitespace().collect();
                    if let ["hello", role, rank, pid] = w.as_slice() {
                        let role = if *role == "prefill" { Role::Prefill } else { Role::Decode };
                        if let (Ok(rank), Ok(pid)) = (rank.parse::<u32>(), pid.parse::<u32>()) {
                            who.insert(id, (role, rank));
                            conn_of.insert((role, rank), id);
                            pids.insert((role, rank), pid);
                        }
                    }
                }
            }
            _ = tokio::time::sleep(Duration::from_millis(20)) => {
                for (role, rank, c) in &mut children.procs {
                    if let Ok(Some(status)) = c.try_wait() {
                        let log = config.log_dir.join(format!("{}-{rank}.log",
                            if *role == Role::Prefill { &config.prefill_group } else { &config.decode_group }));
                        let tail = std::fs::read_to_string(&log).unwrap_or_default();
                        let tail: Vec<&str> = tail.lines().rev().take(5).collect();
                        let tail: Vec<&str> = tail.into_iter().rev().collect();
                        return Err(SimError::Sim(format!(
                            "{} rank {rank} exited during start-up ({status}); {}:\n{}",
                            role.as_str(), log.display(), tail.join("\n"))));
                    }
                }
                if Instant::now() > start_deadline {
                    return Err(SimError::Sim(format!(
                        "only {} of {} ranks came up within 90 s; logs in {}",
                        who.len(), 2 * config.ranks, config.log_dir.display())));
                }
            }
            _ = &mut shutdown => {
                return Err(SimError::Sim("stopped during start-up".into()));
            }
        }
    }
    info!(ranks = config.ranks, hub = %hub, "simulated deployment up");
    let send = |writers: &HashMap<u64, mpsc::UnboundedSender<String>>, id: Option<&u64>, line: String| {
        if let Some(w) = id.and_then(|id| writers.get(id)) {
            let _ = w.send(line + "\n");
        }
    };

    let period = Duration::from_secs_f64(1.0 / config.room_rate);
    let mut next_issue = Instant::now();
    let mut issued = 0u64;
    let mut rounds: BTreeMap<u64, Round> = BTreeMap::new();
    let mut finished: Vec<RoomSummary> = Vec::new();
    let mut measurements: Vec<Measurement> = Vec::new();
    let mut dead_prefill: std::collections::BTreeSet<u32> = Default::default();
    let mut stopped: Vec<(Role, u32)> = Vec::new();
    let mut prefill_killed_at: HashMap<u64, i64> = HashMap::new(); // room idx -> unix ms of the kill
    let reduce_timeout = Duration::from_millis(config.reduce_timeout_ms);
    let finalize_after = Duration::from_millis(config.verdict_wait_ms + config.transfer_timeout_ms + 5_000);
    let mut tick = tokio::time::interval(Duration::from_millis(2));
    let mut stopped_early = false;
    // A rank being restarted: rooms wait until it says hello again.
    let mut restarting: Option<(Role, u32)> = None;
    let mut restart_deadline = Instant::now();
    let mut faults_applied: Option<u64> = None;
    let prefix = config.prefix.trim_end_matches('/').to_string();

    loop {
        tokio::select! {
            Some((id, w)) = conn_rx.recv() => { writers.insert(id, w); }
            Some(ev) = rx.recv() => match ev {
                Ev::Closed(id) => {
                    if let Some((Role::Prefill, rank)) = who.get(&id).copied() {
                        debug!(rank, "prefill rank's hub connection closed");
                        dead_prefill.insert(rank);
                    }
                }
                Ev::Measured(what, ms) => measurements.push(Measurement { what, ms }),
                Ev::Line(id, line) => {
                    if let ["hello", role, rank, pid] = line.split_whitespace().collect::<Vec<_>>().as_slice() {
                        // A restarted rank.
                        let role = if *role == "prefill" { Role::Prefill } else { Role::Decode };
                        if let (Ok(rank), Ok(pid)) = (rank.parse::<u32>(), pid.parse::<u32>()) {
                            who.insert(id, (role, rank));
                            conn_of.insert((role, rank), id);
                            pids.insert((role, rank), pid);
                            if restarting == Some((role, rank)) {
                                restarting = None;
                            }
                        }
                        continue;
                    }
                    let Some((role, rank)) = who.get(&id).copied() else { continue };
                    let (verb, rest) = line.split_once(' ').unwrap_or((line.as_str(), ""));
                    match (role, verb) {
                        (Role::Prefill, "reduce") => {
                            let mut it = rest.split_whitespace().filter_map(|x| x.parse::<u64>().ok());
                            if let (Some(idx), Some(state)) = (it.next(), it.next()) {
                                let Some(r) = rounds.get_mut(&idx) else { continue };
                                let state = u8::try_from(state).unwrap_or(kvpoll::FAILED);
                                r.contrib.insert(rank, state);
                                r.first_at.get_or_insert_with(Instant::now);
                                if let Some((min, _)) = r.resolved {
                                    // Late: the others went on without it, as after a gloo timeout.
                                    send(&writers, Some(&id), format!("result {idx} {}", min.min(state)));
                                }
                            }
                        }
                        (Role::Prefill, "midway") => {
                            let Ok(idx) = rest.trim().parse::<u64>() else { continue };
                            let room = rounds.get(&idx).map_or(0, |r| r.room);
                            if let Some(child) = children.get(Role::Decode, rank) {
                                let _ = child.kill();
                                let _ = child.wait(); // reaped: its sockets are closed
                                warn!(idx, room, rank, "injected: SIGKILL of decode rank mid-transfer");
                                let key = format!("{prefix}/groups/{}/rooms/{room}/ranks/{rank}", config.prefill_group);
                                spawn_record_probe(&mut etcd, key, "decode SIGKILL -> local record in etcd".into(), tx.clone());
                            }
                            send(&writers, Some(&id), format!("go {idx}"));
                        }
                        (Role::Prefill, "done") => {
                            match serde_json::from_str::<RankRoomReport>(rest) {
                                Ok(rep) => { if let Some(r) = rounds.get_mut(&rep.idx) { r.dones.insert(rank, rep); } }
                                Err(e) => warn!(error = %e, "bad done report"),
                            }
                        }
                        (Role::Decode, "recv") => {
                            let w: Vec<&str> = rest.split_whitespace().collect();
                            if let [idx, src, ok] = w.as_slice() {
                                if let (Ok(idx), Ok(src)) = (idx.parse::<u64>(), src.parse::<u32>()) {
                                    if let Some(r) = rounds.get_mut(&idx) { r.decode.insert(src, *ok == "ok"); }
                                }
                            }
                        }
                        _ => debug!(line, "ignored rank message"),
                    }
                }
            },
            _ = tick.tick() => {}
            _ = &mut shutdown => { stopped_early = true; break; }
        }

        let now = Instant::now();
        // Issue rooms that are due.
        while (config.rooms == 0 || issued < config.rooms) && now >= next_issue {
            let idx = issued;
            let faults: Vec<Fault> = config.faults.iter().copied().filter(|f| f.at_room == idx).collect();
            // A fault "at room K" must hit room K, not a room the ranks are still busy with:
            // let every earlier room finish first (the ranks work through rooms in order).
            if (!faults.is_empty() && !rounds.is_empty()) || restarting.is_some() {
                break;
            }
            if faults_applied != Some(idx) {
                faults_applied = Some(idx);
                if let Some(f) = faults.iter().find(|f| f.kind == FaultKind::RestartDecode) {
                    if let (Some(child), Some(opts)) = (
                        children.get(Role::Decode, f.rank),
                        rank_opts.get(&(Role::Decode, f.rank)),
                    ) {
                        let _ = child.kill();
                        let _ = child.wait();
                        let fresh = spawn_rank(&config, opts)?;
                        *child = fresh;
                        warn!(idx, rank = f.rank, "injected: decode rank SIGKILLed and started again");
                        restarting = Some((Role::Decode, f.rank));
                        restart_deadline = now + Duration::from_secs(60);
                        break;
                    }
                }
            }
            let room = rootrank_transfer_agent::random_room();
            for f in &faults {
                match f.kind {
                    FaultKind::KillPrefill => {
                        if children.signal(Role::Prefill, f.rank, libc::SIGKILL) {
                            prefill_killed_at.insert(idx, rootrank_store::unix_ms());
                            warn!(idx, room, rank = f.rank, "injected: SIGKILL of prefill rank");
                        }
                    }
                    FaultKind::StopDecode => {
                        if children.signal(Role::Decode, f.rank, libc::SIGSTOP) {
                            stopped.push((Role::Decode, f.rank));
                            warn!(idx, room, rank = f.rank, "injected: SIGSTOP of decode rank");
                            let key = format!("{prefix}/groups/{}/rooms/{room}/ranks/{}", config.prefill_group, f.rank);
                            spawn_record_probe(
                                &mut etcd,
                                key,
                                "decode SIGSTOP -> local record in etcd".into(),
                                tx.clone(),
                            );
                        }
                    }
                    FaultKind::KillDecode | FaultKind::FailTransfer | FaultKind::RestartDecode => {}
                }
            }
            for rank in 0..config.ranks {
                send(
                    &writers,
                    conn_of.get(&(Role::Decode, rank)),
                    format!("room {idx} {room}"),
                );
            }
            for rank in 0..config.ranks {
                let fault = faults.iter().find(|f| f.rank == rank).map_or("-", |f| match f.kind {
                    FaultKind::FailTransfer => "fail",
                    FaultKind::KillDecode => "pause",
                    _ => "-",
                });
                send(
                    &writers,
                    conn_of.get(&(Role::Prefill, rank)),
                    format!("room {idx} {room} {fault}"),
                );
            }
            rounds.insert(
                idx,
                Round {
                    room,
                    issued_at: Some(now),
                    faults,
                    ..Round::default()
                },
            );
            issued += 1;
            next_issue = (next_issue + period).max(now); // no burst after a pause
        }

        if restarting.is_some() && now > restart_deadline {
            return Err(SimError::Sim(format!(
                "a restarted rank ({restarting:?}) did not come back within 60 s; logs in {}",
                config.log_dir.display()
            )));
        }

        // Resolve all-reduce rounds: every rank contributed or is dead, or the timeout passed
        // since the first contribution (a silent rank counts as Failed, as after a gloo timeout).
        for (idx, r) in rounds.iter_mut() {
            if r.resolved.is_some() {
                continue;
            }
            let all_in = (0..config.ranks).all(|k| r.contrib.contains_key(&k) || dead_prefill.contains(&k));
            // As in gloo, the timeout runs from when a rank enters the collective: a room still
            // queued behind earlier ones (no contribution yet) is late, not failed.
            let timed_out = r.first_at.is_some_and(|f| now >= f + reduce_timeout);
            if all_in || timed_out {
                let missing = (0..config.ranks).any(|k| !r.contrib.contains_key(&k));
                let min = if missing {
                    kvpoll::FAILED
                } else {
                    r.contrib.values().copied().min().unwrap_or(kvpoll::FAILED)
                };
                r.resolved = Some((min, now));
                for k in r.contrib.keys() {
                    send(
                        &writers,
                        conn_of.get(&(Role::Prefill, *k)),
                        format!("result {idx} {min}"),
                    );
                }
            }
        }

        // Finish rooms: resolved, and every rank that took part has reported (or time is up).
        let done_idx: Vec<u64> = rounds
            .iter()
            .filter(|(_, r)| match r.resolved {
                Some((_, at)) => {
                    let reported = r
                        .contrib
                        .keys()
                        .all(|k| r.dones.contains_key(k) || dead_prefill.contains(k));
                    // Decode's checks of the shards whose WRITEs completed: wait for them too,
                    // so the summary's counts do not race the ranks' messages.
                    let sent_ok = r.dones.values().filter(|d| d.own == kvpoll::SUCCESS).count();
                    let decoded = r.decode.len() >= sent_ok;
                    (reported && decoded) || now >= at + finalize_after
                }
                None => false,
            })
            .map(|(i, _)| *i)
            .collect();
        for idx in done_idx {
            let Some(r) = rounds.remove(&idx) else { continue };
            let summary = summarize(
                &config.prefill_group,
                idx,
                r,
                "",
                prefill_killed_at.get(&idx).copied(),
                &mut measurements,
            );
            on_room(&summary);
            finished.push(summary);
        }

        if config.rooms > 0 && issued >= config.rooms && rounds.is_empty() {
            break;
        }
    }

    // Stop: resume stopped ranks, ask everyone to exit, wait, then kill what is left.
    for (role, rank) in &stopped {
        children.signal(*role, *rank, libc::SIGCONT);
    }
    for id in who.keys() {
        send(&writers, Some(id), "exit".to_string());
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while !children.all_exited() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    children.kill_all();
    for (idx, r) in std::mem::take(&mut rounds) {
        let summary = summarize(&config.prefill_group, idx, r, "incomplete", None, &mut measurements);
        on_room(&summary);
        finished.push(summary);
    }
    finished.sort_by_key(|s| s.idx);
    let pid_list = |role| {
        (0..config.ranks)
            .map(|k| pids.get(&(role, k)).copied().unwrap_or(0))
            .collect()
    };
    Ok(SimReport {
        rooms: finished,
        measurements,
        log_dir: config.log_dir.clone(),
        stopped_early,
        shard_bytes: (config.block_size * config.chunks.max(1) as usize) as u64,
        prefill_pids: pid_list(Role::Prefill),
        decode_pids: pid_list(Role::Decode),
    })
}

fn summarize(
    group: &str,
    idx: u64,
    r: Round,
    force: &'static str,
    killed_at: Option<i64>,
    m: &mut Vec<Measurement>,
) -> RoomSummary {
    let reduced = r.resolved.map(|(min, _)| min);
    let status = if !force.is_empty() || reduced.is_none() {
        "incomplete"
    } else if reduced == Some(kvpoll::SUCCESS) {
        "success"
    } else {
        "failed"
    };
    let local_failures: Vec<(u32, String)> = r
        .dones
        .values()
        .filter(|d| d.own == kvpoll::FAILED)
        .map(|d| (d.rank, d.reason.clone().unwrap_or_default()))
        .collect();
    let resolved_verdict = r
        .dones
        .values()
        .filter_map(|d| d.verdict.as_ref())
        .find(|v| v["status"] == "resolved");
    let any_verdict = r.dones.values().find_map(|d| d.verdict.as_ref());
    let culprit = resolved_verdict.map(|v| v["culprit"].clone()).or_else(|| {
        local_failures.first().map(|(rank, reason)| {
            // No survivor asked (every rank failed itself): the lowest failing rank's own report.
            serde_json::json!({"group": group, "rank": rank, "reason": reason, "source": "own_report"})
        })
    });
    if let Some(kill_ms) = killed_at {
        for d in r.dones.values() {
            if let (Some(at), Some(v)) = (d.verdict_at_ms, &d.verdict) {
                if v["status"] == "resolved" {
                    m.push(Measurement {
                        what: format!("prefill SIGKILL -> resolved verdict at survivor rank {}", d.rank),
                        ms: (at - kill_ms) as f64,
                    });
                }
            }
        }
    }
    RoomSummary {
        idx,
        room: r.room.to_string(),
        status,
        reduced,
        culprit,
        cause: resolved_verdict.map(|v| v["cause"].clone()).filter(|k| !k.is_null()),
        verdict_status: resolved_verdict
            .or(any_verdict)
            .and_then(|v| v["status"].as_str().map(str::to_string)),
        local_failures,
        decode_checks: r.decode.into_iter().collect(),
        faults: r.faults,
        latency_ms: r.issued_at.map(|t| t.elapsed().as_secs_f64() * 1000.0),
        reports: r.dones.into_values().collect(),
    }
}

/// Polls etcd for `key` every millisecond (up to 30 s) and reports how long it took to appear.
fn spawn_record_probe(
    etcd: &mut rootrank_store::etcd_client::Client,
    key: String,
    what: String,
    tx: mpsc::UnboundedSender<Ev>,
) {
    let mut etcd = etcd.clone();
    let start = Instant::now();
    tokio::spawn(async move {
        while start.elapsed() < Duration::from_secs(30) {
            if let Ok(resp) = etcd.get(key.as_str(), None).await {
                if !resp.kvs().is_empty() {
                    let _ = tx.send(Ev::Measured(what, start.elapsed().as_secs_f64() * 1000.0));
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    });
}
