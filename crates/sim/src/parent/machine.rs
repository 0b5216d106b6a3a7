//! The parent's decisions as a deterministic state machine: no I/O, no clock, no async.
//!
//! The shell ([`super::run`]) turns what happens (a hub line from a rank, a closed hub
//! connection, its 2 ms tick, a probe's result, a shutdown request) into an [`Event`], hands
//! it to [`Deployment::handle`] with the time it observed it ([`Now`]), and executes the
//! [`Command`]s that come back, in order. Everything else lives here: when the next room is
//! due and which fault hits it, the MIN of each all-reduce round and when a silent rank counts
//! as Failed, when a room is over and what its summary says. Tests drive it line by line and
//! move the time by hand.
//!
//! Phases: `Starting` (until every rank said hello) -> `Running` (rooms) -> `Stopping` (ranks
//! told to exit, the shell reaps them) -> `Done` (report or failure handed out).
//!
//! It logs through `tracing`, as a diagnostic only: nothing it decides depends on the logs.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use super::{Fault, FaultKind, Measurement, RoomSummary, SimConfig, SimReport};
use crate::{kvpoll, RankRoomReport, Role};

/// The shell's name for one accepted hub connection.
pub(super) type ConnId = u64;

/// How long start-up may take: every rank loads NIXL, registers and loads its peer.
const START_TIMEOUT: Duration = Duration::from_secs(90);
/// How long a restarted rank may take to say hello again.
const RESTART_TIMEOUT: Duration = Duration::from_secs(60);

/// The time of an event, as the shell read its clocks: monotonic for deadlines, Unix ms to
/// compare with the ranks' own timestamps (`verdict_at_ms`).
#[derive(Clone, Copy, Debug)]
pub(super) struct Now {
    pub at: Instant,
    pub unix_ms: i64,
}

/// Something that happened, as the shell saw it.
#[derive(Debug)]
pub(super) enum Event {
    /// A line from a rank's hub connection (newline stripped).
    Line { conn: ConnId, line: String },
    /// A hub connection closed (EOF or error): its rank is gone.
    Closed { conn: ConnId },
    /// The shell's periodic tick: deadlines and rooms fall due only on time.
    Tick,
    /// A rank process exited. The shell watches only during start-up (later, exits are the
    /// faults' doing); `log_tail` is the end of its log, for the error message.
    RankExited {
        role: Role,
        rank: u32,
        status: String,
        log_tail: String,
    },
    /// The answer to [`Command::MintRoom`].
    RoomMinted { room: u64 },
    /// A [`Command::Probe`] saw its key after `ms`.
    Measured { what: String, ms: f64 },
    /// ^C, or the caller's shutdown future resolved.
    Shutdown,
    /// The answer to [`Command::ReapRanks`]: no rank process is left.
    RanksReaped,
}

/// A signal for one rank process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Signal {
    Kill,
    Stop,
    Continue,
}

/// Something for the shell to do.
#[derive(Debug)]
pub(super) enum Command {
    /// Write `line` (plus a newline) to a hub connection.
    Send { conn: ConnId, line: String },
    /// Signal a rank process (not reaped: a killed rank's sockets close when the kernel says).
    Signal { role: Role, rank: u32, signal: Signal },
    /// SIGKILL a rank process and wait for it, so its sockets are closed before the next
    /// command runs (the prefill rank's next chunk must hit a dead peer).
    KillAndReap { role: Role, rank: u32 },
    /// SIGKILL, reap and start a rank process again (a new NIXL agent, new metadata).
    Restart { role: Role, rank: u32 },
    /// Answer with [`Event::RoomMinted`] carrying a fresh random room id, before anything
    /// else happens (randomness is the shell's, so tests choose their rooms).
    MintRoom,
    /// Poll etcd for `key` and answer with [`Event::Measured`] once it appears.
    Probe { key: String, what: String },
    /// A room is over: hand it to `on_room`.
    Room(Box<RoomSummary>),
    /// Wait (up to 10 s) for every rank process to exit, kill what is left, then answer with
    /// [`Event::RanksReaped`].
    ReapRanks,
    /// The simulation is over.
    Finish(Box<SimReport>),
    /// The simulation cannot go on.
    Fail(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Starting,
    Running,
    Stopping,
    Done,
}

/// One room from its issue until its summary.
#[derive(Debug)]
struct Round {
    room: u64,
    issued_at: Instant,
    /// When the first prefill rank entered the all-reduce: gloo's timeout runs from there.
    first_at: Option<Instant>,
    /// Each prefill rank's poll state.
    contrib: BTreeMap<u32, u8>,
    /// The MIN, and when it was sent.
    resolved: Option<(u8, Instant)>,
    dones: BTreeMap<u32, RankRoomReport>,
    /// Decode ranks' checks, by source rank.
    decode: BTreeMap<u32, bool>,
    faults: Vec<Fault>,
}

/// The simulated deployment as the parent sees it.
pub(super) struct Deployment {
    config: SimConfig,
    phase: Phase,
    start_deadline: Instant,

    // Who is who. A restarted rank says hello again on a new connection.
    who: HashMap<ConnId, (Role, u32)>,
    conn_of: HashMap<(Role, u32), ConnId>,
    pids: HashMap<(Role, u32), u32>,

    // Rooms.
    period: Duration,
    next_issue: Instant,
    issued: u64,
    /// A [`Command::MintRoom`] is out: issue nothing until its answer.
    minting: bool,
    rounds: BTreeMap<u64, Round>,
    finished: Vec<RoomSummary>,
    measurements: Vec<Measurement>,

    // Faults.
    /// Prefill ranks whose hub connection closed: they count Failed in every open round.
    dead_prefill: BTreeSet<u32>,
    /// SIGSTOPped ranks, resumed at the end so they can exit cleanly.
    stopped: Vec<(Role, u32)>,
    /// Room idx -> Unix ms of the prefill SIGKILL before it.
    prefill_killed_at: HashMap<u64, i64>,
    /// A rank being restarted, and until when it may take: rooms wait for its hello.
    restarting: Option<((Role, u32), Instant)>,
    /// The room whose restart fault was applied (so it is applied once).
    faults_applied: Option<u64>,
    stopped_early: bool,
}

impl Deployment {
    /// The ranks are spawned (at `now`); none has said hello yet.
    pub fn new(config: SimConfig, now: Now) -> Deployment {
        Deployment {
            period: Duration::from_secs_f64(1.0 / config.room_rate),
            config,
            phase: Phase::Starting,
            start_deadline: now.at + START_TIMEOUT,
            who: HashMap::new(),
            conn_of: HashMap::new(),
            pids: HashMap::new(),
            next_issue: now.at,
            issued: 0,
            minting: false,
            rounds: BTreeMap::new(),
            finished: Vec::new(),
            measurements: Vec::new(),
            dead_prefill: BTreeSet::new(),
            stopped: Vec::new(),
            prefill_killed_at: HashMap::new(),
            restarting: None,
            faults_applied: None,
            stopped_early: false,
        }
    }

    /// Still waiting for ranks to come up (the shell watches for rank exits only then).
    pub fn is_starting(&self) -> bool {
        self.phase == Phase::Starting
    }

    /// Applies one event; the commands are to be executed in order.
    #[must_use]
    pub fn handle(&mut self, event: Event, now: Now) -> Vec<Command> {
        let mut out = Vec::new();
        match self.phase {
            Phase::Starting => self.starting(event, now, &mut out),
            Phase::Running => {
                self.running(event, now, &mut out);
                // Whatever happened, see what is now due, resolved or over.
                if self.phase == Phase::Running {
                    self.advance(now, &mut out);
                }
            }
            Phase::Stopping => {
                if let Event::RanksReaped = event {
                    self.finish(now, &mut out);
                }
            }
            Phase::Done => {}
        }
        out
    }

    fn starting(&mut self, event: Event, now: Now, out: &mut Vec<Command>) {
        match event {
            Event::Line { conn, line } => {
                self.hello(conn, &line);
                if self.who.len() >= 2 * self.config.ranks as usize {
                    self.phase = Phase::Running;
                    self.next_issue = now.at;
                    self.advance(now, out);
                }
            }
            Event::RankExited {
                role,
                rank,
                status,
                log_tail,
            } => self.fail(
                out,
                format!(
                    "{} rank {rank} exited during start-up ({status}); {}:\n{log_tail}",
                    role.as_str(),
                    log_path(&self.config, role, rank).display()
                ),
            ),
            Event::Tick if now.at > self.start_deadline => self.fail(
                out,
                format!(
                    "only {} of {} ranks came up within 90 s; logs in {}",
                    self.who.len(),
                    2 * self.config.ranks,
                    self.config.log_dir.display()
                ),
            ),
            Event::Shutdown => self.fail(out, "stopped during start-up".into()),
            _ => {}
        }
    }

    /// `hello ROLE RANK PID`: who is on `conn`. Anything else: `false`.
    fn hello(&mut self, conn: ConnId, line: &str) -> bool {
        let ["hello", role, rank, pid] = line.split_whitespace().collect::<Vec<_>>()[..] else {
            return false;
        };
        let role = if role == "prefill" { Role::Prefill } else { Role::Decode };
        if let (Ok(rank), Ok(pid)) = (rank.parse::<u32>(), pid.parse::<u32>()) {
            self.who.insert(conn, (role, rank));
            self.conn_of.insert((role, rank), conn);
            self.pids.insert((role, rank), pid);
            if self.restarting.is_some_and(|(r, _)| r == (role, rank)) {
                self.restarting = None;
            }
        }
        true
    }

    fn running(&mut self, event: Event, now: Now, out: &mut Vec<Command>) {
        match event {
            Event::Line { conn, line } => self.line(conn, &line, now, out),
            Event::Closed { conn } => {
                if let Some((Role::Prefill, rank)) = self.who.get(&conn).copied() {
                    debug!(rank, "prefill rank's hub connection closed");
                    self.dead_prefill.insert(rank);
                }
            }
            Event::Measured { what, ms } => self.measurements.push(Measurement { what, ms }),
            Event::RoomMinted { room } => self.issue(room, now, out),
            Event::Shutdown => {
                self.stopped_early = true;
                self.stop(out);
            }
            Event::Tick | Event::RankExited { .. } | Event::RanksReaped => {}
        }
    }

    /// One hub line from a rank that said hello.
    fn line(&mut self, conn: ConnId, line: &str, now: Now, out: &mut Vec<Command>) {
        if self.hello(conn, line) {
            return; // a restarted rank
        }
        let Some((role, rank)) = self.who.get(&conn).copied() else {
            return;
        };
        let (verb, rest) = line.split_once(' ').unwrap_or((line, ""));
        match (role, verb) {
            (Role::Prefill, "reduce") => {
                let mut it = rest.split_whitespace().filter_map(|x| x.parse::<u64>().ok());
                let (Some(idx), Some(state)) = (it.next(), it.next()) else {
                    return;
                };
                let Some(r) = self.rounds.get_mut(&idx) else {
                    return;
                };
                let state = u8::try_from(state).unwrap_or(kvpoll::FAILED);
                r.contrib.insert(rank, state);
                r.first_at.get_or_insert(now.at);
                if let Some((min, _)) = r.resolved {
                    // Late: the others went on without it, as after a gloo timeout.
                    let line = format!("result {idx} {}", min.min(state));
                    out.push(Command::Send { conn, line });
                }
            }
            (Role::Prefill, "midway") => {
                // Only a `pause` room says midway: that is the decode SIGKILL's moment.
                let Ok(idx) = rest.trim().parse::<u64>() else {
                    return;
                };
                let room = self.rounds.get(&idx).map_or(0, |r| r.room);
                warn!(idx, room, rank, "injected: SIGKILL of decode rank mid-transfer");
                out.push(Command::KillAndReap {
                    role: Role::Decode,
                    rank,
                });
                out.push(self.record_probe(room, rank, "decode SIGKILL -> local record in etcd"));
                out.push(Command::Send {
                    conn,
                    line: format!("go {idx}"),
                });
            }
            (Role::Prefill, "done") => match serde_json::from_str::<RankRoomReport>(rest) {
                Ok(rep) => {
                    if let Some(r) = self.rounds.get_mut(&rep.idx) {
                        r.dones.insert(rank, rep);
                    }
                }
                Err(e) => warn!(error = %e, "bad done report"),
            },
            (Role::Decode, "recv") => {
                if let [idx, src, ok] = rest.split_whitespace().collect::<Vec<_>>()[..] {
                    if let (Ok(idx), Ok(src)) = (idx.parse::<u64>(), src.parse::<u32>()) {
                        if let Some(r) = self.rounds.get_mut(&idx) {
                            r.decode.insert(src, ok == "ok");
                        }
                    }
                }
            }
            _ => debug!(line, "ignored rank message"),
        }
    }

    /// A probe for the prefill rank's record of `room` (the measured delay of a decode fault).
    fn record_probe(&self, room: u64, rank: u32, what: &str) -> Command {
        let prefix = self.config.prefix.trim_end_matches('/');
        let group = &self.config.prefill_group;
        Command::Probe {
            key: format!("{prefix}/groups/{group}/rooms/{room}/ranks/{rank}"),
            what: what.to_string(),
        }
    }

    /// After every running event: rooms due, restart deadline, rounds resolved, rooms over.
    fn advance(&mut self, now: Now, out: &mut Vec<Command>) {
        self.issue_due(now, out);
        if let Some((who, deadline)) = self.restarting {
            if now.at > deadline {
                let msg = format!(
                    "a restarted rank ({who:?}) did not come back within 60 s; logs in {}",
                    self.config.log_dir.display()
                );
                return self.fail(out, msg);
            }
        }
        self.resolve_rounds(now, out);
        self.finish_rooms(now, out);
        if self.config.rooms > 0 && self.issued >= self.config.rooms && self.rounds.is_empty() {
            self.stop(out);
        }
    }

    fn faults_at(&self, idx: u64) -> Vec<Fault> {
        self.config
            .faults
            .iter()
            .copied()
            .filter(|f| f.at_room == idx)
            .collect()
    }

    /// Asks for the next room's id if it is due (its fault, if any, goes first: a restart).
    fn issue_due(&mut self, now: Now, out: &mut Vec<Command>) {
        let more = self.config.rooms == 0 || self.issued < self.config.rooms;
        if self.minting || !more || now.at < self.next_issue {
            return;
        }
        let idx = self.issued;
        let faults = self.faults_at(idx);
        // A fault "at room K" must hit room K, not a room the ranks are still busy with:
        // let every earlier room finish first (the ranks work through rooms in order).
        if (!faults.is_empty() && !self.rounds.is_empty()) || self.restarting.is_some() {
            return;
        }
        if self.faults_applied != Some(idx) {
            self.faults_applied = Some(idx);
            if let Some(f) = faults.iter().find(|f| f.kind == FaultKind::RestartDecode) {
                warn!(idx, rank = f.rank, "injected: decode rank SIGKILLed and started again");
                out.push(Command::Restart {
                    role: Role::Decode,
                    rank: f.rank,
                });
                self.restarting = Some(((Role::Decode, f.rank), now.at + RESTART_TIMEOUT));
                return; // the room waits for the new rank's hello
            }
        }
        self.minting = true;
        out.push(Command::MintRoom);
    }

    /// Issues the next room as `room`: its faults, then its lines to every rank.
    fn issue(&mut self, room: u64, now: Now, out: &mut Vec<Command>) {
        if !std::mem::replace(&mut self.minting, false) {
            return;
        }
        let idx = self.issued;
        let faults = self.faults_at(idx);
        for f in &faults {
            match f.kind {
                FaultKind::KillPrefill => {
                    warn!(idx, room, rank = f.rank, "injected: SIGKILL of prefill rank");
                    out.push(Command::Signal {
                        role: Role::Prefill,
                        rank: f.rank,
                        signal: Signal::Kill,
                    });
                    self.prefill_killed_at.insert(idx, now.unix_ms);
                }
                FaultKind::StopDecode => {
                    warn!(idx, room, rank = f.rank, "injected: SIGSTOP of decode rank");
                    out.push(Command::Signal {
                        role: Role::Decode,
                        rank: f.rank,
                        signal: Signal::Stop,
                    });
                    self.stopped.push((Role::Decode, f.rank));
                    out.push(self.record_probe(room, f.rank, "decode SIGSTOP -> local record in etcd"));
                }
                // KillDecode happens at `midway`, FailTransfer in the rank, RestartDecode before.
                FaultKind::KillDecode | FaultKind::FailTransfer | FaultKind::RestartDecode => {}
            }
        }
        for rank in 0..self.config.ranks {
            self.send(out, Role::Decode, rank, format!("room {idx} {room}"));
        }
        for rank in 0..self.config.ranks {
            let fault = faults.iter().find(|f| f.rank == rank).map_or("-", |f| match f.kind {
                FaultKind::FailTransfer => "fail",
                FaultKind::KillDecode => "pause",
                _ => "-",
            });
            self.send(out, Role::Prefill, rank, format!("room {idx} {room} {fault}"));
        }
        self.rounds.insert(
            idx,
            Round {
                room,
                issued_at: now.at,
                first_at: None,
                contrib: BTreeMap::new(),
                resolved: None,
                dones: BTreeMap::new(),
                decode: BTreeMap::new(),
                faults,
            },
        );
        self.issued += 1;
        self.next_issue = (self.next_issue + self.period).max(now.at); // no burst after a pause
    }

    fn send(&self, out: &mut Vec<Command>, role: Role, rank: u32, line: String) {
        if let Some(&conn) = self.conn_of.get(&(role, rank)) {
            out.push(Command::Send { conn, line });
        }
    }

    /// A round resolves when every prefill rank contributed or is dead, or when the timeout
    /// passed since the first contribution: a silent rank counts as Failed, as after a gloo
    /// timeout.
    fn resolve_rounds(&mut self, now: Now, out: &mut Vec<Command>) {
        let ranks = self.config.ranks;
        let reduce_timeout = Duration::from_millis(self.config.reduce_timeout_ms);
        for (idx, r) in self.rounds.iter_mut() {
            if r.resolved.is_some() {
                continue;
            }
            let all_in = (0..ranks).all(|k| r.contrib.contains_key(&k) || self.dead_prefill.contains(&k));
            // As in gloo, the timeout runs from when a rank enters the collective: a room still
            // queued behind earlier ones (no contribution yet) is late, not failed.
            let timed_out = r.first_at.is_some_and(|f| now.at >= f + reduce_timeout);
            if !(all_in || timed_out) {
                continue;
            }
            let missing = (0..ranks).any(|k| !r.contrib.contains_key(&k));
            let min = if missing {
                kvpoll::FAILED
            } else {
                r.contrib.values().copied().min().unwrap_or(kvpoll::FAILED)
            };
            r.resolved = Some((min, now.at));
            for k in r.contrib.keys() {
                if let Some(&conn) = self.conn_of.get(&(Role::Prefill, *k)) {
                    let line = format!("result {idx} {min}");
                    out.push(Command::Send { conn, line });
                }
            }
        }
    }

    /// A resolved room is over once every rank that took part reported (or is dead) and decode
    /// checked every shard whose WRITEs completed, or once waiting longer is pointless.
    fn finish_rooms(&mut self, now: Now, out: &mut Vec<Command>) {
        let finalize_after =
            Duration::from_millis(self.config.verdict_wait_ms + self.config.transfer_timeout_ms + 5_000);
        let over: Vec<u64> = self
            .rounds
            .iter()
            .filter(|(_, r)| {
                let Some((_, at)) = r.resolved else {
                    return false;
                };
                let reported = r
                    .contrib
                    .keys()
                    .all(|k| r.dones.contains_key(k) || self.dead_prefill.contains(k));
                // Waiting for decode's checks too keeps the summary's counts from racing the
                // ranks' messages.
                let sent_ok = r.dones.values().filter(|d| d.own == kvpoll::SUCCESS).count();
                let decoded = r.decode.len() >= sent_ok;
                (reported && decoded) || now.at >= at + finalize_after
            })
            .map(|(idx, _)| *idx)
            .collect();
        for idx in over {
            if let Some(r) = self.rounds.remove(&idx) {
                self.close_room(idx, r, false, now, out);
            }
        }
    }

    /// A room is over (or `incomplete`, at the end): its summary goes out and into the report.
    fn close_room(&mut self, idx: u64, r: Round, incomplete: bool, now: Now, out: &mut Vec<Command>) {
        let killed_at = if incomplete {
            None
        } else {
            self.prefill_killed_at.get(&idx).copied()
        };
        let summary = summarize(
            &self.config.prefill_group,
            idx,
            r,
            incomplete,
            killed_at,
            now,
            &mut self.measurements,
        );
        out.push(Command::Room(Box::new(summary.clone())));
        self.finished.push(summary);
    }

    /// The end: resume stopped ranks (they must run to exit), ask every rank to exit, and
    /// have the shell reap them.
    fn stop(&mut self, out: &mut Vec<Command>) {
        self.phase = Phase::Stopping;
        for &(role, rank) in &self.stopped {
            out.push(Command::Signal {
                role,
                rank,
                signal: Signal::Continue,
            });
        }
        for &conn in self.who.keys() {
            out.push(Command::Send {
                conn,
                line: "exit".into(),
            });
        }
        out.push(Command::ReapRanks);
    }

    /// The ranks are gone: rooms still open are incomplete; the report.
    fn finish(&mut self, now: Now, out: &mut Vec<Command>) {
        self.phase = Phase::Done;
        for (idx, r) in std::mem::take(&mut self.rounds) {
            self.close_room(idx, r, true, now, out);
        }
        let mut rooms = std::mem::take(&mut self.finished);
        rooms.sort_by_key(|s| s.idx);
        let pid_list = |role| {
            (0..self.config.ranks)
                .map(|k| self.pids.get(&(role, k)).copied().unwrap_or(0))
                .collect()
        };
        out.push(Command::Finish(Box::new(SimReport {
            rooms,
            measurements: std::mem::take(&mut self.measurements),
            log_dir: self.config.log_dir.clone(),
            stopped_early: self.stopped_early,
            shard_bytes: (self.config.block_size * self.config.chunks.max(1) as usize) as u64,
            prefill_pids: pid_list(Role::Prefill),
            decode_pids: pid_list(Role::Decode),
        })));
    }

    fn fail(&mut self, out: &mut Vec<Command>, msg: String) {
        self.phase = Phase::Done;
        out.push(Command::Fail(msg));
    }
}

/// A room's summary from its round. `killed_at`: Unix ms of a prefill SIGKILL before the room,
/// to measure the delay to each survivor's resolved verdict.
fn summarize(
    group: &str,
    idx: u64,
    r: Round,
    incomplete: bool,
    killed_at: Option<i64>,
    now: Now,
    m: &mut Vec<Measurement>,
) -> RoomSummary {
    let reduced = r.resolved.map(|(min, _)| min);
    let status = if incomplete || reduced.is_none() {
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
        latency_ms: Some(now.at.saturating_duration_since(r.issued_at).as_secs_f64() * 1000.0),
        reports: r.dones.into_values().collect(),
    }
}

/// Where a rank's log goes (the shell writes it, start-up failures quote it).
pub(super) fn log_path(config: &SimConfig, role: Role, rank: u32) -> PathBuf {
    let group = match role {
        Role::Prefill => &config.prefill_group,
        Role::Decode => &config.decode_group,
    };
    config.log_dir.join(format!("{group}-{rank}.log"))
}

#[cfg(test)]
mod tests {
    use super::*;

    // Connections: decode rank r on 10 + r, prefill rank r on 20 + r.
    fn dec(rank: u32) -> ConnId {
        10 + u64::from(rank)
    }
    fn pre(rank: u32) -> ConnId {
        20 + u64::from(rank)
    }

    fn config(ranks: u32, rooms: u64, faults: Vec<Fault>) -> SimConfig {
        SimConfig {
            exe: "rootrank".into(),
            etcd_endpoints: vec![],
            etcd_files: Default::default(),
            prefix: "/p/".into(),
            coordinator: None,
            prefill_group: "pre".into(),
            decode_group: "dec".into(),
            ranks,
            rooms,
            room_rate: 1000.0, // a room every ms
            block_size: 4096,
            chunks: 2,
            slots: 4,
            lease_ttl_ms: 1_000,
            transfer_timeout_ms: 1_000,
            reduce_timeout_ms: 500,
            verdict_wait_ms: 1_000,
            faults,
            log_dir: "/tmp/sim-logs".into(),
            nixl_dir: None,
        }
    }

    fn fault(kind: FaultKind, rank: u32, at_room: u64) -> Fault {
        Fault { kind, rank, at_room }
    }

    /// A deployment and a hand-moved clock (ms since the start).
    struct Sim {
        d: Deployment,
        t0: Instant,
        ms: u64,
    }

    impl Sim {
        fn new(config: SimConfig) -> Sim {
            let t0 = Instant::now();
            let d = Deployment::new(
                config,
                Now {
                    at: t0,
                    unix_ms: 1_000_000,
                },
            );
            Sim { d, t0, ms: 0 }
        }

        fn now(&self) -> Now {
            Now {
                at: self.t0 + Duration::from_millis(self.ms),
                unix_ms: 1_000_000 + self.ms as i64,
            }
        }

        fn at(&mut self, ms: u64) -> &mut Sim {
            self.ms = ms;
            self
        }

        fn ev(&mut self, event: Event) -> Vec<Command> {
            let now = self.now();
            self.d.handle(event, now)
        }

        fn line(&mut self, conn: ConnId, line: &str) -> Vec<Command> {
            self.ev(Event::Line {
                conn,
                line: line.into(),
            })
        }

        /// Every rank says hello; the commands after the last one.
        fn up(&mut self) -> Vec<Command> {
            let ranks = self.d.config.ranks;
            let mut last = Vec::new();
            for rank in 0..ranks {
                assert!(self
                    .line(dec(rank), &format!("hello decode {rank} {}", 100 + rank))
                    .is_empty());
            }
            for rank in 0..ranks {
                assert!(self.d.is_starting(), "up before every rank said hello");
                last = self.line(pre(rank), &format!("hello prefill {rank} {}", 200 + rank));
            }
            assert!(!self.d.is_starting());
            last
        }

        /// Up, and room 0 issued as room 77.
        fn room0(&mut self) -> Vec<Command> {
            let cmds = self.up();
            assert!(matches!(cmds[..], [Command::MintRoom]), "{cmds:?}");
            self.ev(Event::RoomMinted { room: 77 })
        }

        fn done(&mut self, rank: u32, own: u8, reduced: u8) -> Vec<Command> {
            let rep = RankRoomReport {
                idx: 0,
                room: "77".into(),
                rank,
                own,
                reduced,
                ..RankRoomReport::default()
            };
            let json = serde_json::to_string(&rep).unwrap();
            self.line(pre(rank), &format!("done {json}"))
        }
    }

    fn sends(cmds: &[Command]) -> Vec<(ConnId, String)> {
        let mut s: Vec<(ConnId, String)> = cmds
            .iter()
            .filter_map(|c| match c {
                Command::Send { conn, line } => Some((*conn, line.clone())),
                _ => None,
            })
            .collect();
        s.sort();
        s
    }

    fn send(conn: ConnId, line: &str) -> (ConnId, String) {
        (conn, line.to_string())
    }

    fn rooms(cmds: &[Command]) -> Vec<&RoomSummary> {
        cmds.iter()
            .filter_map(|c| match c {
                Command::Room(s) => Some(&**s),
                _ => None,
            })
            .collect()
    }

    fn report(cmds: Vec<Command>) -> SimReport {
        match cmds.into_iter().last() {
            Some(Command::Finish(r)) => *r,
            other => panic!("no report: {other:?}"),
        }
    }

    #[test]
    fn hello_from_every_rank_issues_the_first_room() {
        let mut sim = Sim::new(config(2, 1, vec![]));
        let cmds = sim.room0();
        assert_eq!(
            sends(&cmds),
            vec![
                send(dec(0), "room 0 77"),
                send(dec(1), "room 0 77"),
                send(pre(0), "room 0 77 -"),
                send(pre(1), "room 0 77 -"),
            ]
        );
        // An id nobody asked for issues nothing.
        assert!(sim.ev(Event::RoomMinted { room: 78 }).is_empty());
    }

    #[test]
    fn reduce_sends_the_min_to_every_contributor() {
        let mut sim = Sim::new(config(2, 1, vec![]));
        sim.room0();
        assert!(sends(&sim.line(pre(0), "reduce 0 4")).is_empty(), "rank 1 is still out");
        let cmds = sim.line(pre(1), "reduce 0 2");
        assert_eq!(
            sends(&cmds),
            vec![send(pre(0), "result 0 2"), send(pre(1), "result 0 2")]
        );
    }

    #[test]
    fn a_closed_connection_counts_failed_at_once() {
        let mut sim = Sim::new(config(2, 1, vec![]));
        sim.room0();
        assert!(sim.ev(Event::Closed { conn: pre(1) }).is_empty());
        // No time passes: rank 1's connection is gone, so it cannot contribute.
        let cmds = sim.line(pre(0), "reduce 0 4");
        assert_eq!(sends(&cmds), vec![send(pre(0), "result 0 0")]);
    }

    #[test]
    fn a_closed_decode_connection_does_not_fail_the_round() {
        let mut sim = Sim::new(config(2, 1, vec![]));
        sim.room0();
        assert!(sim.ev(Event::Closed { conn: dec(1) }).is_empty());
        assert!(sends(&sim.line(pre(0), "reduce 0 4")).is_empty());
    }

    #[test]
    fn a_silent_rank_fails_the_round_after_the_reduce_timeout() {
        let mut sim = Sim::new(config(2, 1, vec![]));
        sim.room0();
        sim.at(100).line(pre(0), "reduce 0 4");
        assert!(sends(&sim.at(599).ev(Event::Tick)).is_empty(), "timeout is 500 ms");
        let cmds = sim.at(600).ev(Event::Tick);
        assert_eq!(sends(&cmds), vec![send(pre(0), "result 0 0")]);
        // The latecomer gets the group's answer, MIN its own.
        let cmds = sim.at(700).line(pre(1), "reduce 0 4");
        assert_eq!(sends(&cmds), vec![send(pre(1), "result 0 0")]);
    }

    #[test]
    fn a_room_nobody_reduced_yet_does_not_time_out() {
        let mut sim = Sim::new(config(2, 1, vec![]));
        sim.room0();
        assert!(sends(&sim.at(60_000).ev(Event::Tick)).is_empty());
    }

    #[test]
    fn done_reports_and_decode_checks_make_the_room_summary_then_the_report() {
        let mut sim = Sim::new(config(2, 1, vec![]));
        sim.room0();
        sim.at(5).line(pre(0), "reduce 0 4");
        sim.line(pre(1), "reduce 0 4");
        assert!(rooms(&sim.done(0, kvpoll::SUCCESS, kvpoll::SUCCESS)).is_empty());
        assert!(
            rooms(&sim.done(1, kvpoll::SUCCESS, kvpoll::SUCCESS)).is_empty(),
            "decode checks still out"
        );
        assert!(rooms(&sim.line(dec(0), "recv 0 0 ok")).is_empty());
        let cmds = sim.at(40).line(dec(1), "recv 0 1 bad");
        let summary = rooms(&cmds);
        assert_eq!(summary.len(), 1, "{cmds:?}");
        let s = summary[0];
        assert_eq!((s.idx, s.room.as_str(), s.status), (0, "77", "success"));
        assert_eq!(s.reduced, Some(kvpoll::SUCCESS));
        assert_eq!(s.decode_checks, vec![(0, true), (1, false)]);
        assert_eq!(s.reports.len(), 2);
        assert_eq!(s.latency_ms, Some(40.0));
        assert!(s.culprit.is_none());
        // The only room is over: every rank is told to exit, then reaped.
        assert_eq!(
            sends(&cmds),
            vec![
                send(dec(0), "exit"),
                send(dec(1), "exit"),
                send(pre(0), "exit"),
                send(pre(1), "exit")
            ]
        );
        assert!(matches!(cmds.last(), Some(Command::ReapRanks)));
        assert!(sim.line(pre(0), "reduce 0 4").is_empty(), "stopping: lines are ignored");
        let report = report(sim.ev(Event::RanksReaped));
        assert_eq!(report.rooms.len(), 1);
        assert!(!report.stopped_early);
        assert_eq!(report.prefill_pids, vec![200, 201]);
        assert_eq!(report.decode_pids, vec![100, 101]);
        assert_eq!(report.shard_bytes, 8192);
    }

    #[test]
    fn a_room_without_reports_ends_after_the_finalize_wait() {
        let mut sim = Sim::new(config(2, 1, vec![]));
        sim.room0();
        sim.line(pre(0), "reduce 0 4");
        sim.line(pre(1), "reduce 0 0");
        // verdict wait + transfer timeout + 5 s after the result.
        assert!(rooms(&sim.at(6_999).ev(Event::Tick)).is_empty());
        let cmds = sim.at(7_000).ev(Event::Tick);
        let s = rooms(&cmds);
        assert_eq!(s.len(), 1);
        assert_eq!((s[0].status, s[0].reduced), ("failed", Some(kvpoll::FAILED)));
    }

    #[test]
    fn kill_prefill_signals_before_the_room_and_measures_the_verdict() {
        let mut sim = Sim::new(config(2, 1, vec![fault(FaultKind::KillPrefill, 1, 0)]));
        sim.at(10);
        let cmds = sim.room0();
        assert!(
            matches!(
                cmds[0],
                Command::Signal {
                    role: Role::Prefill,
                    rank: 1,
                    signal: Signal::Kill
                }
            ),
            "the kill comes before the room: {cmds:?}"
        );
        assert_eq!(sends(&cmds).len(), 4);
        sim.ev(Event::Closed { conn: pre(1) });
        assert_eq!(sends(&sim.line(pre(0), "reduce 0 0")), vec![send(pre(0), "result 0 0")]);
        let rep = RankRoomReport {
            idx: 0,
            room: "77".into(),
            rank: 0,
            own: kvpoll::WAITING_FOR_INPUT,
            reduced: kvpoll::FAILED,
            verdict: Some(serde_json::json!({
                "status": "resolved",
                "culprit": {"group": "pre", "rank": 1, "reason": "rank_down", "source": "certificate"},
            })),
            verdict_at_ms: Some(1_000_010 + 250),
            ..RankRoomReport::default()
        };
        let cmds = sim.line(pre(0), &format!("done {}", serde_json::to_string(&rep).unwrap()));
        let s = rooms(&cmds);
        assert_eq!(s.len(), 1, "rank 1 is dead, rank 0 reported: {cmds:?}");
        assert_eq!(s[0].status, "failed");
        assert_eq!(s[0].culprit.as_ref().map(|c| c["rank"].clone()), Some(1.into()));
        assert_eq!(s[0].verdict_status.as_deref(), Some("resolved"));
        let report = report(sim.ev(Event::RanksReaped));
        assert_eq!(report.measurements.len(), 1);
        assert_eq!(report.measurements[0].ms, 250.0);
    }

    #[test]
    fn kill_decode_pauses_the_prefill_rank_and_kills_its_peer_at_midway() {
        let mut sim = Sim::new(config(2, 1, vec![fault(FaultKind::KillDecode, 0, 0)]));
        let cmds = sim.room0();
        assert!(sends(&cmds).contains(&send(pre(0), "room 0 77 pause")));
        assert!(sends(&cmds).contains(&send(pre(1), "room 0 77 -")));
        let cmds = sim.line(pre(0), "midway 0");
        match &cmds[..] {
            [Command::KillAndReap {
                role: Role::Decode,
                rank: 0,
            }, Command::Probe { key, .. }, Command::Send { conn, line }] => {
                assert_eq!(key, "/p/groups/pre/rooms/77/ranks/0");
                assert_eq!((*conn, line.as_str()), (pre(0), "go 0"));
            }
            _ => panic!("kill, probe, go in that order: {cmds:?}"),
        }
    }

    #[test]
    fn fail_transfer_marks_the_rank_s_room_line() {
        let mut sim = Sim::new(config(2, 1, vec![fault(FaultKind::FailTransfer, 1, 0)]));
        let cmds = sim.room0();
        assert!(sends(&cmds).contains(&send(pre(1), "room 0 77 fail")));
    }

    #[test]
    fn a_fault_waits_for_earlier_rooms_and_shutdown_reports_the_open_room() {
        let mut sim = Sim::new(config(2, 2, vec![fault(FaultKind::StopDecode, 0, 1)]));
        sim.room0();
        assert!(
            sim.at(10).ev(Event::Tick).is_empty(),
            "room 1 is due but room 0 is open"
        );
        sim.line(pre(0), "reduce 0 0");
        sim.line(pre(1), "reduce 0 0");
        sim.done(0, kvpoll::FAILED, kvpoll::FAILED);
        let cmds = sim.done(1, kvpoll::FAILED, kvpoll::FAILED);
        assert_eq!(rooms(&cmds).len(), 1);
        let cmds = sim.at(11).ev(Event::Tick);
        assert!(matches!(cmds[..], [Command::MintRoom]), "{cmds:?}");
        let cmds = sim.ev(Event::RoomMinted { room: 88 });
        match &cmds[..2] {
            [Command::Signal {
                role: Role::Decode,
                rank: 0,
                signal: Signal::Stop,
            }, Command::Probe { key, .. }] => assert_eq!(key, "/p/groups/pre/rooms/88/ranks/0"),
            _ => panic!("stop and probe before the room: {cmds:?}"),
        }
        assert!(sends(&cmds).contains(&send(dec(0), "room 1 88")));
        sim.ev(Event::Measured {
            what: "decode SIGSTOP -> local record in etcd".into(),
            ms: 3.0,
        });
        let cmds = sim.at(20).ev(Event::Shutdown);
        assert!(
            matches!(
                cmds[0],
                Command::Signal {
                    role: Role::Decode,
                    rank: 0,
                    signal: Signal::Continue
                }
            ),
            "a stopped rank must run to exit: {cmds:?}"
        );
        assert!(matches!(cmds.last(), Some(Command::ReapRanks)));
        let cmds = sim.at(30).ev(Event::RanksReaped);
        let open = rooms(&cmds);
        assert_eq!(open.len(), 1);
        assert_eq!((open[0].idx, open[0].status), (1, "incomplete"));
        let report = report(cmds);
        assert!(report.stopped_early);
        assert_eq!(report.rooms.iter().map(|r| r.idx).collect::<Vec<_>>(), vec![0, 1]);
        assert_eq!(report.measurements.len(), 1);
    }

    #[test]
    fn restart_holds_the_room_until_the_new_rank_says_hello() {
        let mut sim = Sim::new(config(2, 1, vec![fault(FaultKind::RestartDecode, 1, 0)]));
        let cmds = sim.up();
        assert!(
            matches!(
                cmds[..],
                [Command::Restart {
                    role: Role::Decode,
                    rank: 1
                }]
            ),
            "{cmds:?}"
        );
        assert!(sim.at(100).ev(Event::Tick).is_empty());
        // The old connection closes, the new rank connects anew.
        assert!(sim.ev(Event::Closed { conn: dec(1) }).is_empty());
        let cmds = sim.line(31, "hello decode 1 999");
        assert!(matches!(cmds[..], [Command::MintRoom]), "{cmds:?}");
        let cmds = sim.ev(Event::RoomMinted { room: 77 });
        assert!(sends(&cmds).contains(&send(31, "room 0 77")));
        assert!(!sends(&cmds).iter().any(|(c, _)| *c == dec(1)));
    }

    #[test]
    fn a_restarted_rank_that_never_returns_fails_the_run() {
        let mut sim = Sim::new(config(2, 1, vec![fault(FaultKind::RestartDecode, 1, 0)]));
        sim.up();
        assert!(sim.at(60_000).ev(Event::Tick).is_empty());
        let cmds = sim.at(60_001).ev(Event::Tick);
        assert!(
            matches!(&cmds[..], [Command::Fail(m)] if m.contains("did not come back")),
            "{cmds:?}"
        );
    }

    #[test]
    fn start_up_fails_on_an_exit_a_timeout_or_a_shutdown() {
        let mut sim = Sim::new(config(2, 1, vec![]));
        sim.line(dec(0), "hello decode 0 100");
        let cmds = sim.ev(Event::RankExited {
            role: Role::Prefill,
            rank: 1,
            status: "exit status: 1".into(),
            log_tail: "no NIXL".into(),
        });
        assert!(
            matches!(&cmds[..], [Command::Fail(m)]
                if m.contains("prefill rank 1 exited during start-up") && m.contains("/tmp/sim-logs/pre-1.log") && m.ends_with("no NIXL")),
            "{cmds:?}"
        );

        let mut sim = Sim::new(config(2, 1, vec![]));
        sim.line(dec(0), "hello decode 0 100");
        assert!(sim.at(90_000).ev(Event::Tick).is_empty());
        let cmds = sim.at(90_001).ev(Event::Tick);
        assert!(
            matches!(&cmds[..], [Command::Fail(m)] if m.contains("only 1 of 4 ranks")),
            "{cmds:?}"
        );
        assert!(sim.ev(Event::Tick).is_empty(), "failed once");

        let mut sim = Sim::new(config(2, 1, vec![]));
        let cmds = sim.ev(Event::Shutdown);
        assert!(
            matches!(&cmds[..], [Command::Fail(m)] if m == "stopped during start-up"),
            "{cmds:?}"
        );
    }

    #[test]
    fn rooms_follow_the_rate() {
        let mut sim = Sim::new(config(1, 0, vec![])); // 0: until stopped
        sim.room0();
        assert!(sim.ev(Event::Tick).is_empty(), "room 1 is due 1 ms later");
        assert!(matches!(sim.at(1).ev(Event::Tick)[..], [Command::MintRoom]));
        assert!(sim.ev(Event::Tick).is_empty(), "one id at a time");
        let cmds = sim.ev(Event::RoomMinted { room: 5 });
        assert_eq!(sends(&cmds), vec![send(dec(0), "room 1 5"), send(pre(0), "room 1 5 -")]);
    }
}
