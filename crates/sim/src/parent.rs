//! `rootrank simulate`: the launcher, router and gloo stand-in of a simulated PD deployment.
//! See the [`super`] module docs for the protocol.
//!
//! Two layers, as in rootrank's verdict core: [`machine::Deployment`] decides (rooms, faults,
//! all-reduce rounds, summaries) from events and the time it is given; [`run`] is the I/O
//! shell around it (processes, the TCP hub, signals, timers, etcd probes).

use std::collections::{HashMap, VecDeque};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::{RankOpts, RankRoomReport, Role};
use crate::SimError;

mod machine;

use machine::{Command as MachineCommand, ConnId, Deployment, Event, Now, Signal};

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
    /// etcd's credentials; the ranks get them as `ROOTRANK_ETCD_*` in their environment.
    pub etcd_files: rootrank_store::EtcdCredentialFiles,
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
    let log_path = machine::log_path(config, opts.role, opts.rank);
    let log = std::fs::OpenOptions::new().create(true).append(true).open(&log_path)?;
    let json = serde_json::to_string(opts).map_err(|e| SimError::Sim(e.to_string()))?;
    let parent = std::process::id() as i32;
    let mut cmd = Command::new(&config.exe);
    cmd.arg("sim-rank")
        .arg("--opts")
        .arg(json)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .envs(config.etcd_files.to_env());
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

/// What the hub's and the probes' tasks report to the shell's loop.
enum Io {
    /// A rank connected; lines for it go through this sender. Sent before any of its lines.
    Connected(ConnId, mpsc::UnboundedSender<String>),
    Line(ConnId, String),
    Closed(ConnId),
    Measured(String, f64),
}

fn now() -> Now {
    Now {
        at: Instant::now(),
        unix_ms: rootrank_store::unix_ms(),
    }
}

/// Runs the simulation until `rooms` rooms are over (or `shutdown` resolves), printing each
/// room through `on_room`. Must be polled on the thread that outlives the ranks (see
/// `spawn_rank`): `block_on` it on the main thread.
///
/// This is the I/O shell: it spawns the ranks, runs the hub, and feeds what happens to the
/// [`machine::Deployment`], which decides everything else.
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
    let access = rootrank_store::EtcdAccess::new(config.etcd_endpoints.clone(), &config.etcd_files)
        .map_err(rootrank_store::StoreError::from)?;
    let etcd = rootrank_store::connect(&access).await?;

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

    let (tx, mut rx) = mpsc::unbounded_channel::<Io>();
    tokio::spawn(accept(listener, tx.clone()));

    let mut machine = Deployment::new(config.clone(), now());
    let mut shell = Shell {
        config: &config,
        children,
        rank_opts,
        writers: HashMap::new(),
        etcd,
        tx,
        on_room,
    };
    tokio::pin!(shutdown);
    let mut tick = tokio::time::interval(Duration::from_millis(2));
    let mut exit_check = tokio::time::interval(Duration::from_millis(20));
    let mut shutdown_seen = false;
    loop {
        let starting = machine.is_starting();
        let event = tokio::select! {
            Some(io) = rx.recv() => match io {
                Io::Connected(conn, writer) => {
                    shell.writers.insert(conn, writer);
                    continue;
                }
                Io::Line(conn, line) => Event::Line { conn, line },
                Io::Closed(conn) => Event::Closed { conn },
                Io::Measured(what, ms) => Event::Measured { what, ms },
            },
            _ = tick.tick() => Event::Tick,
            // After start-up, ranks exit because of faults; only a start-up exit is an error.
            _ = exit_check.tick(), if starting => match shell.exited_rank() {
                Some(event) => event,
                None => continue,
            },
            // A finished future must not be polled again.
            _ = &mut shutdown, if !shutdown_seen => {
                shutdown_seen = true;
                Event::Shutdown
            }
        };
        if let Some(report) = shell.drive(&mut machine, event).await? {
            return Ok(report);
        }
        if starting && !machine.is_starting() {
            info!(ranks = config.ranks, hub = %hub, "simulated deployment up");
        }
    }
}

/// Accepts the ranks' hub connections: one writer task and one reader task per connection.
async fn accept(listener: TcpListener, tx: mpsc::UnboundedSender<Io>) {
    let mut next_id: ConnId = 0;
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
        if tx.send(Io::Connected(id, wtx)).is_err() {
            return;
        }
        let tx = tx.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(read).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if tx.send(Io::Line(id, line)).is_err() {
                    return;
                }
            }
            let _ = tx.send(Io::Closed(id));
        });
    }
}

/// What the shell owns: processes, hub writers, the etcd client for probes.
struct Shell<'a> {
    config: &'a SimConfig,
    children: Children,
    rank_opts: HashMap<(Role, u32), RankOpts>,
    writers: HashMap<ConnId, mpsc::UnboundedSender<String>>,
    etcd: rootrank_store::etcd_client::Client,
    tx: mpsc::UnboundedSender<Io>,
    on_room: &'a mut dyn FnMut(&RoomSummary),
}

impl Shell<'_> {
    /// Hands `event` to the machine and executes its commands in order. An answer the machine
    /// asked for (a room id, the ranks reaped) goes in at once, and its commands run before
    /// the rest, so the order is the machine's. `Some` once the simulation is over.
    async fn drive(&mut self, machine: &mut Deployment, event: Event) -> Result<Option<SimReport>, SimError> {
        let mut queue: VecDeque<MachineCommand> = machine.handle(event, now()).into();
        while let Some(command) = queue.pop_front() {
            let answer = match command {
                MachineCommand::Send { conn, line } => {
                    if let Some(w) = self.writers.get(&conn) {
                        let _ = w.send(line + "\n");
                    }
                    None
                }
                MachineCommand::Signal { role, rank, signal } => {
                    let sig = match signal {
                        Signal::Kill => libc::SIGKILL,
                        Signal::Stop => libc::SIGSTOP,
                        Signal::Continue => libc::SIGCONT,
                    };
                    if !self.children.signal(role, rank, sig) {
                        warn!(role = role.as_str(), rank, ?signal, "could not signal the rank");
                    }
                    None
                }
                MachineCommand::KillAndReap { role, rank } => {
                    if let Some(child) = self.children.get(role, rank) {
                        let _ = child.kill();
                        let _ = child.wait(); // reaped: its sockets are closed
                    }
                    None
                }
                MachineCommand::Restart { role, rank } => {
                    if let (Some(child), Some(opts)) =
                        (self.children.get(role, rank), self.rank_opts.get(&(role, rank)))
                    {
                        let _ = child.kill();
                        let _ = child.wait();
                        *child = spawn_rank(self.config, opts)?;
                    }
                    None
                }
                MachineCommand::MintRoom => Some(Event::RoomMinted {
                    room: rootrank_transfer_agent::random_room(),
                }),
                MachineCommand::Probe { key, what } => {
                    spawn_record_probe(&self.etcd, key, what, self.tx.clone());
                    None
                }
                MachineCommand::Room(summary) => {
                    (self.on_room)(&summary);
                    None
                }
                MachineCommand::ReapRanks => {
                    let deadline = Instant::now() + Duration::from_secs(10);
                    while !self.children.all_exited() && Instant::now() < deadline {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    self.children.kill_all();
                    Some(Event::RanksReaped)
                }
                MachineCommand::Finish(report) => return Ok(Some(*report)),
                MachineCommand::Fail(msg) => return Err(SimError::Sim(msg)),
            };
            if let Some(answer) = answer {
                for command in machine.handle(answer, now()).into_iter().rev() {
                    queue.push_front(command);
                }
            }
        }
        Ok(None)
    }

    /// The first rank process that has exited, with the end of its log.
    fn exited_rank(&mut self) -> Option<Event> {
        let (role, rank, status) = self
            .children
            .procs
            .iter_mut()
            .find_map(|(role, rank, c)| match c.try_wait() {
                Ok(Some(status)) => Some((*role, *rank, status)),
                _ => None,
            })?;
        let log = std::fs::read_to_string(machine::log_path(self.config, role, rank)).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(5).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        Some(Event::RankExited {
            role,
            rank,
            status: status.to_string(),
            log_tail: tail.join("\n"),
        })
    }
}

/// Polls etcd for `key` every millisecond (up to 30 s) and reports how long it took to appear.
fn spawn_record_probe(
    etcd: &rootrank_store::etcd_client::Client,
    key: String,
    what: String,
    tx: mpsc::UnboundedSender<Io>,
) {
    let mut etcd = etcd.clone();
    let start = Instant::now();
    tokio::spawn(async move {
        while start.elapsed() < Duration::from_secs(30) {
            if let Ok(resp) = etcd.get(key.as_str(), None).await {
                if !resp.kvs().is_empty() {
                    let _ = tx.send(Io::Measured(what, start.elapsed().as_secs_f64() * 1000.0));
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    });
}
