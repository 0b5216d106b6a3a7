"""The SGLang plugin: rootrank in every SGLang scheduler (TP rank) process, with no change
to SGLang.

SGLang's ``load_plugins()`` calls :func:`register` through the ``sglang.srt.plugins`` entry
point (``rootrank = rootrank.sglang:register``). When ``ROOTRANK_ETCD_ENDPOINTS`` is set it
hooks, through SGLang's own ``HookRegistry``:

- ``CommonKVManager.__init__``: the rank registers with its group (role, instance,
  attention-DP rank), and ``failure_records`` is observed, so both of SGLang's write paths
  (``record_failure`` and ``conclude_failure``'s ``setdefault``) publish a ``local`` record.
- ``disaggregation.utils._poll_with_failure_injection[_pp]``: a rank whose own poll says
  Failed with no recorded reason publishes a ``local`` record too (this is where one
  scheduler iteration starts, which the verdict budget is shared by).
- ``failure_exception`` of whichever classes define it (``CommonKVSender``/``Receiver`` from
  0.5.23, ``NixlKVSender``/``Receiver`` before): SGLang's generic fallback publishes
  ``propagated`` and is re-raised naming the culprit, when the coordinator knows it within
  ``ROOTRANK_VERDICT_BUDGET_MS``.
- ``sglang.utils.get_exception_traceback`` called from ``run_scheduler_process``: the
  scheduler's fatal exception becomes a ``python_exception`` down certificate with the
  traceback; ``Scheduler.run_event_loop`` returning: a clean ``shutdown``.

Every hook catches its own exceptions (logged once per place, counted in :func:`stats`), so
SGLang proceeds exactly as without rootrank. Turn it off with ``SGLANG_PLUGINS`` (an
allowlist without ``rootrank``) or by unsetting ``ROOTRANK_ETCD_ENDPOINTS``.

Settings (environment): ``ROOTRANK_ETCD_ENDPOINTS`` (required), ``ROOTRANK_COORDINATOR``
(replicas, comma-separated), ``ROOTRANK_PREFIX``, ``ROOTRANK_VERDICT_BUDGET_MS`` (default
100), ``ROOTRANK_LEASE_TTL_MS`` (default 5000), ``ROOTRANK_INSTANCE`` (names this SGLang
instance in the group name instead of its address), ``ROOTRANK_STALL_AFTER_MS`` (default
10000: a rank whose scheduler loop makes no iteration for that long is published stalled),
``ROOTRANK_FAIL_FAST`` (default on; ``0`` turns it off: a decode rank fails the rooms of a
prefill instance the coordinator knows is down, or whose verdict resolved, at once instead
of after SGLang's own timeouts; needs ``ROOTRANK_COORDINATOR``).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import re
import socket
import sys
import threading
import time
import weakref
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

from rootrank._rootrank import certify_exited, classify_fatal
from rootrank.reasons import classify, names_prefill_peer

logger = logging.getLogger("rootrank.sglang")

DEFAULT_BUDGET_MS = 100
# How long a pending room is followed in the background before the log gives up on it.
FOLLOW_S = 120.0
# After the coordinator could not be reached, do not try again for this long: a dead
# coordinator must not cost every failing room a budget.
COORDINATOR_BACKOFF_S = 5.0
# The most a clean exit (shutdown records) and a fatal one (the certificate and the rooms in
# flight) delay SGLang's teardown, in total for the process: etcd takes them in milliseconds
# when it is reachable; when it is not, the lease tells the death a TTL later instead.
SHUTDOWN_TIMEOUT_S = 2.0
FATAL_FLUSH_TIMEOUT_S = 2.0
# How long the launcher's watchdog thread may wait for etcd to take a dead scheduler's certificate.
LAUNCHER_CERTIFY_TIMEOUT_S = 2.0
# The most rooms in flight a launcher records with a dead scheduler's certificate.
LAUNCHER_ROOMS = 4096
# Rooms resolved elsewhere that a decode receiver created later still fails (bounded, and for
# SGLang's own bootstrap timeout at most).
RESOLVED_MEMORY = 65536
RESOLVED_FOR_S = 300.0
# How long decode's fail fast holds a prefill instance's rooms after a victim's death (it comes
# first) for the death that caused it, so the text names that rank.
VICTIM_GRACE_S = 1.0
# How long the launcher's event loop gets to send the requests it ended (503) before SGLang's
# SIGQUIT handler blocks it for the crash dumps.
LAUNCHER_ABORT_FLUSH_S = 0.5
# How often a dying launcher ends what is still unfinished (a request that was being tokenized
# when the scheduler died registers after the first sweep), until SGLang kills the server.
LAUNCHER_SWEEP_S = 0.25
# The most a prefill launcher holds of one streamed answer to turn its error into a status
# (a prefill's answer is a few events; past this it streams on unchanged).
PREFILL_HOLD_BYTES = 1 << 20
# Rooms this process already published a local record for (bounded; an old room can be
# published twice at worst, and etcd keeps the first).
PUBLISHED_MEMORY = 65536
FAILED = 0  # KVPoll.Failed: plain int in every SGLang version
SUCCESS = 4  # KVPoll.Success

_NON_SCHEDULER_ENTRIES = ("run_detokenizer_process", "run_data_parallel_controller_process")

_stats: Dict[str, int] = {
    "local_published": 0,
    "propagated_published": 0,
    "peer_reported_published": 0,
    "fallbacks_rewritten": 0,
    "fallbacks_pending": 0,
    "fail_fast_rooms": 0,
    "launcher_aborted": 0,
    "launcher_refused": 0,
    "prefill_errors_as_status": 0,
    "aborts_ignored": 0,
    "errors": 0,
}
_errors_logged: set = set()
_plugin: Optional["_Plugin"] = None
# Set on the decode listener thread while SGLang applies a prefill's Failed status: the
# record it writes is the prefill's failure, reported to us (room, peer).
_told = threading.local()
# Fail fast: bootstrap address -> the words that name why it is gone, appended to SGLang's
# own "Lost connection with prefill instance" text when the follower fails its rooms.
_fail_fast_notes: Dict[str, str] = {}
_register_lock = threading.Lock()


def stats() -> Dict[str, int]:
    """What the plugin did in this process (counters), including ``errors``: exceptions
    inside the plugin, each caught so SGLang was not affected."""
    return dict(_stats)


def _fault(where: str) -> None:
    """An exception inside a hook: count it, log it once per place, never re-raise."""
    _stats["errors"] += 1
    if where not in _errors_logged:
        _errors_logged.add(where)
        logger.warning("rootrank: internal error in %s (SGLang continues unaffected; logged once)", where, exc_info=True)


# --------------------------------------------------------------------------- identity


def _value(x: Any) -> Any:
    return getattr(x, "value", x)


_GROUP_CHARS = re.compile(r"[^A-Za-z0-9._:-]")


def group_of(kv_mgr: Any) -> Tuple[str, int, int, Optional[str]]:
    """``(group, rank, group_size, role)`` of the reduction group a KV manager's rank polls
    in (SPEC section 9, v3): one SGLang instance x DP replica, every TP x CP x PP rank of it
    (SGLang's PP consensus spans the stages), rank ``pp * cp_size * tp_size + cp * tp_size +
    tp``. The DP replica is the attention-DP rank under DP attention, else the system DP rank
    (plain ``--dp-size``: one scheduler group per replica). The instance is
    ``ROOTRANK_INSTANCE``, else ``dist_init_addr`` (shared by the ranks of a multi-node
    instance), else this machine's hostname with the bootstrap port (prefill) or the serving
    port (decode): never ``--host``, which is 127.0.0.1 or 0.0.0.0 on every node."""
    role = str(_value(getattr(kv_mgr, "disaggregation_mode", ""))).lower()
    role = role if role in ("prefill", "decode") else None
    instance = os.environ.get("ROOTRANK_INSTANCE", "").strip()
    if not instance:
        dist_init_addr = getattr(kv_mgr, "dist_init_addr", None)
        if dist_init_addr:
            instance = str(dist_init_addr)
        else:
            if role == "prefill":
                port = getattr(kv_mgr, "bootstrap_port", 0)
            else:
                port = getattr(getattr(kv_mgr, "server_args", None), "port", 0)
            instance = f"{socket.gethostname()}:{port}"
    tp_size = _int(kv_mgr, "attn_tp_size", 1)
    tp_rank = _int(kv_mgr, "attn_tp_rank", 0)
    cp_size = _int(kv_mgr, "attn_cp_size", 1)
    cp_rank = _int(kv_mgr, "attn_cp_rank", 0)
    pp_size = _int(kv_mgr, "pp_size", 1)
    pp_rank = _int(kv_mgr, "pp_rank", 0)
    dp = _int(kv_mgr, "attn_dp_rank", 0) if _int(kv_mgr, "attn_dp_size", 1) > 1 else _int(kv_mgr, "system_dp_rank", 0)
    group = f"{role or 'rank'}-{_GROUP_CHARS.sub('_', instance)}-dp{dp}"
    if len(group) > 128:
        group = group[:64] + group[-64:]
    rank = pp_rank * cp_size * tp_size + cp_rank * tp_size + tp_rank
    return group, rank, pp_size * cp_size * tp_size, role


def _int(obj: Any, name: str, default: int) -> int:
    try:
        v = getattr(obj, name, default)
        return default if v is None else int(v)
    except (TypeError, ValueError):
        return default


def endpoints_of(kv_mgr: Any) -> List[str]:
    """The addresses by which decode knows a prefill rank's instance (its bootstrap
    ``host:port``, as the router hands it to decode): SGLang's own host and local IP, this
    machine's name, and loopback when it serves on every address. A decode record naming
    one of them leads to this rank's group (SPEC rule 7)."""
    if str(_value(getattr(kv_mgr, "disaggregation_mode", ""))).lower() != "prefill":
        return []
    port = getattr(kv_mgr, "bootstrap_port", None)
    if not port:
        return []
    host = str(getattr(kv_mgr, "bootstrap_host", None) or "")
    hosts = [h for h in (host, getattr(kv_mgr, "local_ip", None), socket.gethostname()) if h]
    if host in ("", "0.0.0.0", "::", "127.0.0.1", "localhost"):
        hosts.append("127.0.0.1")
    out: List[str] = []
    for h in hosts:
        h = str(h)
        e = f"[{h}]:{port}" if ":" in h and not h.startswith("[") else f"{h}:{port}"
        if e not in out and h not in ("0.0.0.0", "::"):
            out.append(e)
    return out


def prefill_peer(kv_mgr: Any, room: Any, unique_rank: Any) -> Dict[str, Any]:
    """The prefill rank that told a decode rank it failed ``room``: its bootstrap address
    (the prefill instance as decode knows it) and its rank in rootrank's group, mapped from
    SGLang's ``_prefill_unique_rank`` (``tp * pp_size * cp_size + pp * cp_size + cp``) with
    the prefill's parallel info decode fetched at bootstrap."""
    peer: Dict[str, Any] = {}
    tracker = getattr(kv_mgr, "addr_to_rooms_tracker", None)
    addr = None
    if isinstance(tracker, dict):
        for a, rooms in list(tracker.items()):
            if room in rooms:
                addr = a
                break
    if addr is None:
        return peer
    peer["endpoint"] = str(addr)
    info = (getattr(kv_mgr, "prefill_info_table", None) or {}).get(addr)
    try:
        tp, cp, pp, u = int(info.attn_tp_size), int(info.attn_cp_size), int(info.pp_size), int(unique_rank)
        tp_rank, rest = divmod(u, pp * cp)
        pp_rank, cp_rank = divmod(rest, cp)
        peer["rank"] = pp_rank * cp * tp + cp_rank * tp + tp_rank
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        pass
    return peer


# --------------------------------------------------------------------------- per rank


class _Rank:
    """One registered rank of this process (normally exactly one)."""

    def __init__(self, agent: Any, group: str, rank: int, role: Optional[str] = None):
        self.agent = agent
        self.group = group
        self.rank = rank
        self.role = role
        self.managers: List[Any] = []  # this rank's KV managers, for the rooms in flight
        self.published: Dict[int, None] = {}  # insertion-ordered set, bounded

    def publish_local(self, kv_mgr: Any, room: Any, text: Any) -> None:
        if room in self.published:
            return
        reason, peer = classify(str(text))
        if reason == "aborted":
            # A client abort (AbortReq, decode's abort notification, a duplicate room) is no
            # failure: never a culprit, and no etcd write per rank per abort.
            _stats["aborts_ignored"] += 1
            self.published[room] = None
            return
        told = getattr(_told, "by", None)
        if told is not None and told[0] == room:
            # The prefill's status message said it failed the room (apply_prefill_status).
            origin, peer = "peer_reported", {**(peer or {}), **told[1]}
        elif self.role == "decode" and names_prefill_peer(str(text)):
            # Decode lost the prefill instance (its heartbeat): the prefill's failure, not ours.
            origin = "peer_reported"
        else:
            origin, peer = "local", _peer_from_manager(kv_mgr, room, peer)
        if self.agent.record_failure(int(room), reason, str(text), origin=origin, peer=peer):
            _stats["local_published" if origin == "local" else "peer_reported_published"] += 1
        # SGLang's transfer threads record failures too: these steps may interleave, and the
        # worst outcome of a race is one more (create-if-absent, so harmless) publish.
        self.published[room] = None
        if len(self.published) > PUBLISHED_MEMORY:
            try:
                self.published.pop(next(iter(self.published)), None)
            except (RuntimeError, StopIteration):
                pass


def _peer_from_manager(kv_mgr: Any, room: Any, peer: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """A prefill rank knows the decode side of a room it was sending (its NIXL agent name
    and endpoint): name it as the peer when the text did not."""
    if peer is not None:
        return peer
    infos = getattr(kv_mgr, "transfer_infos", None)
    if not isinstance(infos, dict):
        return None
    per_room = infos.get(room)
    if not isinstance(per_room, dict):
        return None
    for info in list(per_room.values()):
        if getattr(info, "is_dummy", False):
            continue
        out: Dict[str, Any] = {}
        name = getattr(info, "agent_name", None)
        if isinstance(name, str) and name:
            out["agent"] = name
        endpoint, port = getattr(info, "endpoint", None), getattr(info, "dst_port", None)
        if endpoint:
            out["endpoint"] = f"{endpoint}:{port}" if port is not None else str(endpoint)
        return out or None
    return None


class _FailureRecords(dict):
    """``kv_mgr.failure_records``, observed: SGLang writes it on two paths (item assignment
    in ``record_failure``, ``setdefault`` in ``conclude_transfer``); both publish. Reads are
    the plain dict's, at C speed."""

    __slots__ = ("_rootrank_rank", "_rootrank_mgr")

    def __setitem__(self, room: Any, reason: Any) -> None:
        if _fail_fast_notes and isinstance(reason, str):
            reason = _with_fail_fast_note(reason)
        dict.__setitem__(self, room, reason)
        self._publish(room, reason)

    def setdefault(self, room: Any, default: Any = None) -> Any:
        if room in self:
            return dict.__getitem__(self, room)
        dict.__setitem__(self, room, default)
        self._publish(room, default)
        return default

    def update(self, *args: Any, **kwargs: Any) -> None:
        for room, reason in dict(*args, **kwargs).items():
            self[room] = reason

    def _publish(self, room: Any, reason: Any) -> None:
        try:
            self._rootrank_rank.publish_local(self._rootrank_mgr, room, reason)
        except Exception:
            _fault("failure_records write")


# --------------------------------------------------------------------------- the plugin


class _Plugin:
    def __init__(self, endpoints: str):
        self.endpoints = endpoints
        self.ranks: Dict[str, _Rank] = {}
        self.dead = False  # a fatal certificate was written: no clean shutdown at exit
        budget = os.environ.get("ROOTRANK_VERDICT_BUDGET_MS", "").strip()
        try:
            self.budget_s = max(0.0, float(budget)) / 1000.0 if budget else DEFAULT_BUDGET_MS / 1000.0
        except ValueError:
            logger.warning("rootrank: ROOTRANK_VERDICT_BUDGET_MS=%r is not a number; using %d", budget, DEFAULT_BUDGET_MS)
            self.budget_s = DEFAULT_BUDGET_MS / 1000.0
        try:
            self.lease_ttl_ms = int(os.environ.get("ROOTRANK_LEASE_TTL_MS", "5000"))
        except ValueError:
            self.lease_ttl_ms = 5000
        self.coordinator = None
        urls = os.environ.get("ROOTRANK_COORDINATOR", "").strip()
        if urls:
            try:
                from rootrank.coordinator import Coordinator

                self.coordinator = Coordinator(urls)
            except Exception:
                _fault("ROOTRANK_COORDINATOR")
        self.coordinator_down_until = 0.0
        # The budget: one deadline per scheduler iteration (the poll hook bumps the epoch).
        self.epoch = 0
        self.burst_epoch = -1
        self.burst_deadline = 0.0
        self.follow: "queue.Queue[Tuple[int, str, int, str, float]]" = queue.Queue(maxsize=10000)
        self.follower: Optional[threading.Thread] = None
        self.stall_after_ms: Optional[int] = None
        stall = os.environ.get("ROOTRANK_STALL_AFTER_MS", "").strip()
        if stall:
            try:
                self.stall_after_ms = int(stall)
            except ValueError:
                logger.warning("rootrank: ROOTRANK_STALL_AFTER_MS=%r is not an integer; using 10000", stall)
        self.fail_fast = os.environ.get("ROOTRANK_FAIL_FAST", "1").strip() not in ("0", "false", "no", "off")
        self.fail_fast_thread: Optional[threading.Thread] = None
        # Rooms whose verdict resolved in another group (the prefill): room -> (when, culprit).
        # Written by the fail-fast thread alone; the scheduler thread only reads it (dict.get).
        self.resolved_elsewhere: Dict[int, Tuple[float, Dict[str, Any]]] = {}
        # Prefill instances known gone: bootstrap address -> (the words naming why, when).
        # Written by the fail-fast thread alone, read by the scheduler thread (dict.get).
        self.gone_instances: Dict[str, Tuple[str, float]] = {}
        # In the launcher: SGLang's TokenizerManager (its requests in flight), once seen.
        self.tokenizer_manager: Optional["weakref.ref[Any]"] = None
        # Prefill groups whose victim died first: group -> (endpoints, its down event).
        self.victim_wait: Dict[Any, Tuple[set, Dict[str, Any]]] = {}
        self.victim_lock = threading.Lock()
        self.fail_fast_stop = threading.Event()
        # Whether Scheduler.ingest_requests is hooked: then the budget's epoch is one
        # scheduler iteration (else one poll call, as before SGLang had that method).
        self.per_iteration = False
        # Scheduler pid -> the (group, rank) pairs the launcher certified for it.
        self.launcher_certified: Dict[int, List[Tuple[str, int]]] = {}
        # SGLang's SIGQUIT handler is scheduled (after the requests in flight were ended).
        self.sigquit_deferred = False
        # In the launcher, once SGLang is shutting the server down: why (new requests get 503).
        self.dying_text: Optional[str] = None
        # Every target this process registered, and whether the hooks SGLang applied were said.
        self.hook_targets: List[str] = []
        self.hooks_reported = False

    # ---- registration

    def on_kv_manager(self, kv_mgr: Any) -> None:
        import rootrank

        group, rank, size, role = group_of(kv_mgr)
        r = self.ranks.get(group)
        if r is None:
            nixl = getattr(getattr(kv_mgr, "agent", None), "name", None)
            agent = rootrank.Agent(
                group,
                rank,
                size,
                etcd_endpoints=self.endpoints,
                lease_ttl_ms=self.lease_ttl_ms,
                role=role,
                nixl_agent=nixl if isinstance(nixl, str) else None,
                endpoints=endpoints_of(kv_mgr),
                stall_after_ms=self.stall_after_ms,
            )
            r = _Rank(agent, group, rank, role)
            self.ranks[group] = r
            logger.info("rootrank: rank %d of %s (size %d, role %s) registering with etcd %s", rank, group, size, role, self.endpoints)
        records = _FailureRecords(getattr(kv_mgr, "failure_records", None) or {})
        records._rootrank_rank = r
        records._rootrank_mgr = kv_mgr
        kv_mgr.failure_records = records
        kv_mgr._rootrank_rank = r
        r.managers.append(kv_mgr)
        # Reasons recorded before the hook (none in practice) are published too.
        for room, reason in list(records.items()):
            r.publish_local(kv_mgr, room, reason)
        if role in ("decode", "prefill") and self.fail_fast and self.coordinator is not None and self.fail_fast_thread is None:
            self.fail_fast_thread = threading.Thread(target=self._fail_fast_loop, name="rootrank-fail-fast", daemon=True)
            self.fail_fast_thread.start()

    # ---- one scheduler iteration

    def on_iteration(self) -> None:
        """Called once per scheduler iteration (before SGLang's input broadcast, so a rank
        blocked in that collective counted its iteration and the rank that stopped first is
        the one whose stall record comes first)."""
        self.epoch += 1
        for r in self.ranks.values():
            r.agent.progress()

    # ---- fail fast: a background thread, like SGLang's own heartbeat checker

    def _fail_fast_loop(self) -> None:
        from rootrank.coordinator import Coordinator
        from rootrank.errors import CoordinatorError

        client = Coordinator(self.coordinator.urls) if self.coordinator else None
        since = None
        while client is not None and not self.fail_fast_stop.is_set():
            try:
                for ev in client.events(since, stop=self.fail_fast_stop):
                    since = ev.get("revision", since)
                    kind = ev.get("event")
                    if kind == "rank" and ev.get("state") == "down" and _certain_death(ev):
                        self.on_peer_down(ev)
                    elif kind == "rank" and ev.get("state") == "live":
                        self.on_peer_live(ev)
                    elif kind == "resolved":
                        self.on_room_resolved(ev.get("verdict") or {})
            except CoordinatorError as e:
                if getattr(e, "code", None) == "compacted":
                    since = None  # what happened in the gap: SGLang's own timeouts still apply
                else:
                    _fault("fail-fast events")
                    self.fail_fast_stop.wait(2.0)
            except Exception:
                _fault("fail-fast events")
                self.fail_fast_stop.wait(2.0)

    def _managers(self, *roles: str) -> List[Any]:
        return [m for r in list(self.ranks.values()) if r.role in roles for m in list(r.managers)]

    def on_peer_down(self, ev: Dict[str, Any]) -> None:
        """A rank of a prefill instance is down: the instance is gone (SGLang ends every
        rank of an instance when one dies), so its rooms fail now, through SGLang's own
        node-failure path, as its heartbeat would after missing ``max_failures`` beats.

        A victim's death (``peer_lost``: it died because a peer of its collective vanished)
        comes first, milliseconds before the death that caused it is known: its instance's
        rooms wait up to ``VICTIM_GRACE_S`` for that death, so the text names the rank that
        failed; if none comes, they fail naming no one.

        A decode rank that is down concerns a prefill rank instead: :meth:`on_decode_down`."""
        if ev.get("role") == "decode":
            self.on_decode_down(ev)
            return
        endpoints = set(ev.get("endpoints") or ())
        if not endpoints:
            return
        group = ev.get("group")
        if (ev.get("reason") or "down") == "peer_lost":
            with self.victim_lock:
                held = self.victim_wait.get(group)
                if held is not None:
                    held[0].update(endpoints)
                    return
                self.victim_wait[group] = (endpoints, ev)
            timer = threading.Timer(VICTIM_GRACE_S, self._victim_grace_over, args=(group,))
            timer.daemon = True
            timer.start()
            return
        with self.victim_lock:
            held = self.victim_wait.pop(group, None)
        if held is not None:
            endpoints |= held[0]
        self._fail_instance(endpoints, "(rootrank: {} rank {} is down: {})".format(group, ev.get("rank"), ev.get("reason")))

    def on_decode_down(self, ev: Dict[str, Any]) -> None:
        """A decode rank is down (a prefill's side): the rooms this prefill rank is to send to it
        (SGLang's ``transfer_infos[room]`` holds the room's decode destinations by NIXL agent
        name, from the moment decode asked for the KV) will never conclude: a WRITE into a
        stopped or cut-off decode never ends in NIXL, and a room not yet sent waits for
        nothing. They fail now, naming the rank. A room whose decode had not asked yet is
        not tied to any decode rank here: its decode's launcher publishes it (see
        :meth:`_launcher_rooms`) and its verdict fails it (:meth:`on_room_resolved`)."""
        agent = ev.get("agent")
        if not isinstance(agent, str) or not agent:
            return
        text = "rootrank fail-fast: decode {} rank {} (NIXL agent {}) is down: {}".format(
            ev.get("group"), ev.get("rank"), agent, ev.get("reason"))
        told = {"group": ev.get("group"), "rank": ev.get("rank"), "agent": agent}
        for kv_mgr in self._managers("prefill"):
            infos = getattr(kv_mgr, "transfer_infos", None)
            if not isinstance(infos, dict):
                continue
            for room, destinations in list(infos.items()):
                if room and isinstance(destinations, dict) and agent in destinations and _fail_now(kv_mgr, room, text, told):
                    logger.warning("rootrank: room %s failed now: %s", room, text)

    def _victim_grace_over(self, group: Any) -> None:
        with self.victim_lock:
            held = self.victim_wait.pop(group, None)
        if held is None:
            return  # the culprit's death came first and failed the rooms naming it
        endpoints, ev = held
        try:
            self._fail_instance(endpoints, "(rootrank: {} is down: its rank {} lost a peer of its collective; `rootrank why "
                                           "ROOM` names the rank that failed)".format(group, ev.get("rank")))
        except Exception:
            _fault("fail-fast victim grace")

    def _fail_instance(self, endpoints: set, note: str) -> None:
        # Receivers SGLang creates for this instance from now on fail too (on_transfer_created),
        # until one of its ranks registers again (on_peer_live).
        now = time.monotonic()
        for addr in endpoints:
            self.gone_instances[addr] = (note, now)
        while len(self.gone_instances) > RESOLVED_MEMORY:
            self.gone_instances.pop(next(iter(self.gone_instances)), None)
        for kv_mgr in self._managers("decode"):
            tracker = getattr(kv_mgr, "addr_to_rooms_tracker", None)
            handle = getattr(kv_mgr, "_handle_node_failure", None)
            if not isinstance(tracker, dict) or handle is None:
                continue
            for addr in [a for a in list(tracker.keys()) if a in endpoints]:
                rooms = len(tracker.get(addr) or ())
                _fail_fast_notes[addr] = note
                logger.warning("rootrank: prefill %s is gone %s: failing its %d room(s) now instead of after SGLang's timeouts",
                               addr, note, rooms)
                handle(addr)
                _stats["fail_fast_rooms"] += rooms

    def on_room_resolved(self, verdict: Dict[str, Any]) -> None:
        """A room's verdict resolved with its culprit in another group (for decode its prefill;
        for a prefill its decode, e.g. one that died before asking for the KV): if this rank
        waits on that room, it fails it now, naming the culprit. A peer may fail a room before
        this rank has even created its receiver or sender for it (the failure is published in
        milliseconds): the room is remembered, and the creation fails it then (see
        :meth:`on_transfer_created`)."""
        culprit = verdict.get("culprit") or {}
        try:
            room = int(verdict.get("room"))
        except (TypeError, ValueError):
            return
        if room == 0:
            return  # SGLang's health checks and warm-up (a fake transfer): many requests, one room
        own = {r.group for r in self.ranks.values()}
        if not culprit or "group" not in culprit or culprit.get("group") in own:
            return
        self.resolved_elsewhere[room] = (time.monotonic(), culprit)
        while len(self.resolved_elsewhere) > RESOLVED_MEMORY:
            self.resolved_elsewhere.pop(next(iter(self.resolved_elsewhere)), None)
        for kv_mgr in self._managers("decode", "prefill"):
            self._fail_room(kv_mgr, room, culprit)

    def on_transfer_created(self, kv_mgr: Any, room: Any, addr: Any = None) -> None:
        """SGLang created a decode receiver (or a prefill sender) for ``room`` (on the
        scheduler thread): if the room's verdict already resolved elsewhere, or (decode, at
        ``addr``) its prefill instance is known gone (the router still sends it requests until
        its health check notices, and SGLang's decode fetches the instance's bootstrap info
        again from the dying launcher, which still answers), the room fails now instead of
        waiting for what will not come (dict lookups; nothing else on this thread)."""
        try:
            room = int(room)
        except (TypeError, ValueError):
            return
        seen = self.resolved_elsewhere.get(room)
        if seen is not None and time.monotonic() - seen[0] <= RESOLVED_FOR_S:
            self._fail_room(kv_mgr, room, seen[1])
            return
        gone = self.gone_instances.get(addr) if isinstance(addr, str) else None
        if gone is None or time.monotonic() - gone[1] > RESOLVED_FOR_S:
            return
        # SGLang's own words for a prefill instance that went away, and why (a decode record
        # naming the prefill by its address is peer_reported: the prefill's failure).
        _fail_now(kv_mgr, room, f"Lost connection with prefill instance (bootstrap_addr: {addr}) {gone[0]}")

    def on_peer_live(self, ev: Dict[str, Any]) -> None:
        """A rank registered (a restarted prefill instance): its addresses are served again."""
        for addr in ev.get("endpoints") or ():
            self.gone_instances.pop(addr, None)
            _fail_fast_notes.pop(addr, None)

    def _fail_room(self, kv_mgr: Any, room: int, culprit: Dict[str, Any]) -> None:
        text = "rootrank fail-fast: {} rank {} failed room {}: {} ({})".format(
            culprit.get("group"), culprit.get("rank"), room, culprit.get("reason"), culprit.get("source"))
        if _fail_now(kv_mgr, room, text, told={"group": culprit.get("group"), "rank": culprit.get("rank")}):
            logger.warning("rootrank: room %d failed now: %s", room, text)

    # ---- local Failed polls

    def on_own_status(self, pollers: List[Any]) -> None:
        """Under PP, SGLang's poll is the consensus of every stage (PP rank 0) or a copy of it
        (the other stages): a rank publishes only its own status (SPEC section 9, v3)."""
        own = []
        for poller in pollers:
            kv_mgr = getattr(poller, "kv_mgr", None)
            room = getattr(poller, "bootstrap_room", None)
            try:
                status = int(kv_mgr.check_status(room)) if room in kv_mgr.request_status else None
            except Exception:
                status = None
            own.append(FAILED if status == FAILED else -1)
        self.on_polls(own, pollers)

    def on_polls(self, polls: List[int], pollers: List[Any]) -> None:
        for poll, poller in zip(polls, pollers):
            if poll != FAILED:
                continue
            kv_mgr = getattr(poller, "kv_mgr", None)
            r = getattr(kv_mgr, "_rootrank_rank", None)
            room = getattr(poller, "bootstrap_room", None)
            if r is None or room is None or room in r.published:
                continue
            recorded = kv_mgr.failure_records.get(room)
            if recorded is not None:
                r.publish_local(kv_mgr, room, recorded)
                continue
            injected = os.environ.get("SGLANG_TEST_DISAGG_FAILURE_PROB", "")
            detail = (
                "this rank's own poll returned KVPoll.Failed with no recorded reason"
                + (f" (SGLANG_TEST_DISAGG_FAILURE_PROB={injected} fault injection is on)" if injected not in ("", "0", "0.0") else
                   " (a staging timeout, a HiCache restore failure or a test fault injection)")
            )
            r.publish_local(kv_mgr, room, detail)

    # ---- the fallback

    def budget_left(self) -> float:
        now = time.monotonic()
        if self.burst_epoch != self.epoch or now > self.burst_deadline + 1.0:
            self.burst_epoch = self.epoch
            self.burst_deadline = now + self.budget_s
        return self.burst_deadline - now

    def on_fallback(self, owner: Any, exc: BaseException) -> None:
        kv_mgr = getattr(owner, "kv_mgr", None)
        r: Optional[_Rank] = getattr(kv_mgr, "_rootrank_rank", None)
        room = getattr(exc, "bootstrap_room", None)
        if r is None or room is None:
            return
        original = str(getattr(exc, "failure_reason", "") or (exc.args[0] if exc.args else ""))
        if r.agent.record_failure(int(room), "other", original, origin="propagated"):
            _stats["propagated_published"] += 1
        verdict = None
        left = self.budget_left()
        if self.coordinator is not None and left > 0.001 and time.monotonic() >= self.coordinator_down_until:
            try:
                verdict = self.coordinator.verdict(
                    int(room),
                    group=r.group,
                    # The server answers by wait_ms; the rest of the budget is for the
                    # network, so only a coordinator that is really slow or gone times out.
                    wait_ms=max(0, int(left * 800) - 1),
                    asking_rank=r.rank,
                    timeout_s=left,
                )
            except Exception as e:
                from rootrank.errors import CoordinatorUnavailable

                if isinstance(e, CoordinatorUnavailable):
                    self.coordinator_down_until = time.monotonic() + COORDINATOR_BACKOFF_S
                    logger.debug("rootrank: coordinator unavailable: %s", e)
                else:
                    _fault("verdict lookup")
        text = culprit_text(verdict)
        if text is None:
            text = f"{original} (rootrank: pending, see rootrank why {room} --group {r.group})"
            _stats["fallbacks_pending"] += 1
            self.follow_later(int(room), r.group, r.rank, original)
        else:
            _stats["fallbacks_rewritten"] += 1
            # SGLang logs a "from another rank" error at DEBUG: the culprit reaches the client
            # through the exception, and the operator through this line.
            logger.warning("rootrank: KVTransferError(bootstrap_room=%d) was %r: %s", int(room), original, text)
        _set_reason(exc, text)

    def follow_later(self, room: int, group: str, rank: int, original: str) -> None:
        """Logs the culprit of a room that was still pending when the budget ran out, as soon
        as it resolves (one background thread, long polls, never the scheduler's)."""
        if self.coordinator is None:
            return
        try:
            self.follow.put_nowait((room, group, rank, original, time.monotonic() + FOLLOW_S))
        except queue.Full:
            return
        if self.follower is None or not self.follower.is_alive():
            self.follower = threading.Thread(target=self._follow_loop, name="rootrank-follow", daemon=True)
            self.follower.start()

    def _follow_loop(self) -> None:
        from rootrank.coordinator import Coordinator

        client = Coordinator(self.coordinator.urls) if self.coordinator else None
        while client is not None:
            room, group, rank, original, until = self.follow.get()
            try:
                while True:
                    left = until - time.monotonic()
                    if left <= 0:
                        logger.warning("rootrank: room %d (%s): no culprit within %.0f s; see rootrank why %d --group %s", room, group, FOLLOW_S, room, group)
                        break
                    try:
                        v = client.verdict(room, group=group, wait_ms=int(min(left, 30.0) * 1000), asking_rank=rank)
                    except Exception:
                        time.sleep(min(1.0, max(0.0, left)))
                        continue
                    text = culprit_text(v)
                    if text is not None:
                        logger.error("rootrank: KVTransferError(bootstrap_room=%d) was %r: %s", room, original, text)
                        break
                    if v.get("status") == "unknown":
                        logger.warning("rootrank: room %d: no rank of %s failed it (%s)", room, group, v.get("explain", "cause outside the group"))
                        break
            except Exception:
                _fault("follow pending room")
            finally:
                self.follow.task_done()

    def wait_followed(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` until every pending room was followed to its end (for
        a process about to exit that wants those log lines out)."""
        deadline = time.monotonic() + timeout_s
        while self.follow.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self.follow.unfinished_tasks

    # ---- exits

    def on_fatal(self, tb: str) -> None:
        lines = [l for l in str(tb).splitlines() if l.strip()]
        detail = lines[-1] if lines else "scheduler exception"
        # A scheduler that died because a peer of its collective vanished (gloo raises in the
        # survivors of a SIGKILL within milliseconds) is a victim, never the culprit (rule 7).
        reason = classify_fatal(str(tb))
        for r in list(self.ranks.values()):
            r.agent.record_down(reason, detail, log_tail=lines[-100:])
            # The rooms this rank had in flight die with it: say so (never a root cause), so
            # the coordinator knows them and lists their culprit among the failures.
            for room in _rooms_in_flight(r.managers):
                r.agent.record_failure(int(room), reason, f"this rank died ({reason}) with the room in flight: {detail}",
                                       origin="propagated")
        # One bound for the whole teardown delay, whatever the number of ranks in this process.
        deadline = time.monotonic() + FATAL_FLUSH_TIMEOUT_S
        for r in list(self.ranks.values()):
            r.agent.flush(max(0.0, deadline - time.monotonic()))
        self.dead = True
        logger.info("rootrank: fatal scheduler exception (%s) certified for %s", reason, ", ".join(self.ranks) or "no rank")

    def on_children_checked(self, processes: List[Any], names: List[str]) -> None:
        """SGLang's launcher is about to look for a dead scheduler (its subprocess watchdog, once
        a second); on the first one it finds it SIGQUITs itself and kills the rest, at once when
        crash dumps are off. Their leases would then expire in an order that says nothing of
        who died first, so the launcher speaks first for a scheduler killed by a signal."""
        self._certify_killed(processes, names, "its subprocess watchdog")

    def _certify_killed(self, processes: List[Any], names: List[str], found_by: str) -> List[Tuple[str, int]]:
        """Certifies the one scheduler killed by a signal (it could not speak for itself) when
        every other one is alive or exited by itself (a scheduler that raised certified itself
        on its way out, first, so the revision order stays the order of deaths). Two killed by
        signals: which died first is unknown, and nothing is claimed. Returns the (group, rank)
        pairs certified now or before."""
        killed = [(p, n) for p, n in zip(processes, names)
                  if not p.is_alive() and p.exitcode is not None and p.exitcode < 0]
        if len(killed) != 1:
            return []
        proc, name = killed[0]
        if proc.pid in self.launcher_certified:
            return self.launcher_certified[proc.pid]
        sig = -int(proc.exitcode)
        detail = f"SGLang's launcher ({found_by}) found {name} (pid {proc.pid}) killed by signal {sig}"
        ranks = certify_exited(int(proc.pid), signal=sig, detail=detail, rooms=self._launcher_rooms(),
                               etcd_endpoints=self.endpoints, timeout_s=LAUNCHER_CERTIFY_TIMEOUT_S)
        self.launcher_certified[proc.pid] = [(str(g), int(r)) for g, r in ranks]
        logger.warning("rootrank: %s; certified %s", detail,
                       ", ".join(f"{g} rank {r}" for g, r in ranks) or "no rank (it had not registered)")
        return self.launcher_certified[proc.pid]

    def keep_tokenizer_manager(self, tokenizer_manager: Any) -> None:
        """In the launcher: remember SGLang's TokenizerManager (weakly), for its requests in flight."""
        if tokenizer_manager is not None and self.tokenizer_manager is None:
            try:
                self.tokenizer_manager = weakref.ref(tokenizer_manager)
            except TypeError:
                pass

    def _launcher_rooms(self) -> List[int]:
        """The bootstrap rooms of the requests this launcher has in flight (bounded). A
        scheduler killed by a signal could not say which rooms died with it; its peer may be
        waiting on one of them with nothing that ties the room to it (a prefill whose decode
        died before asking for the room's KV holds it in Bootstrapping for SGLang's 300 s
        bootstrap timeout): recorded with the death, each room's verdict names the dead rank,
        and the peer's plugin fails it (:meth:`on_room_resolved`)."""
        tm = self.tokenizer_manager() if self.tokenizer_manager is not None else None
        rooms: List[int] = []
        for state in list((getattr(tm, "rid_to_state", None) or {}).values()):
            if getattr(state, "finished", True):
                continue
            room = getattr(getattr(state, "obj", None), "bootstrap_room", None)
            for r in room if isinstance(room, list) else [room]:
                # Room 0 is SGLang's health checks and warm-up (a fake bootstrap host): no transfer.
                if isinstance(r, int) and not isinstance(r, bool) and 0 < r < 2 ** 63 and len(rooms) < LAUNCHER_ROOMS:
                    rooms.append(r)
        return rooms

    def on_sigquit(self, tokenizer_manager: Any) -> Optional[str]:
        """SGLang's launcher got SIGQUIT ("one child failed"): its handler is about to block its
        event loop for the crash dumps (5 s + 60 s by default) and then kill the server, so every
        request in flight (a prefill's own HTTP request, which the router waits for too) hangs
        until then and ends as a dropped connection. Instead each ends now, through SGLang's own
        abort path, with HTTP 503 naming the scheduler that died, and a request that arrives
        before the kill is refused the same way. Returns that text, or None when SGLang is left
        to itself (fail fast off, or a crash dump folder that wants the requests unfinished)."""
        self.keep_tokenizer_manager(tokenizer_manager)
        watchdog = getattr(tokenizer_manager, "_subprocess_watchdog", None)
        processes = list(getattr(watchdog, "_processes", None) or [])
        names = list(getattr(watchdog, "_names", None) or [f"process_{i}" for i in range(len(processes))])
        ranks = self._certify_killed(processes, names, "SIGQUIT") if processes else []
        if not self.fail_fast:
            return None
        if getattr(tokenizer_manager, "crash_dump_folder", None):
            # SGLang's crash dump lists the unfinished requests: they stay unfinished for it.
            logger.warning("rootrank: SGLang's crash dump folder is set; requests in flight are left to it")
            return None
        from sglang.srt.managers.io_struct import AbortReq

        if ranks:
            who = ", ".join(f"{g} rank {r}" for g, r in ranks) + " was killed by a signal"
        else:
            who = "a process of this SGLang server failed"
        # From now on a new request is refused at once (the server is going down).
        self.dying_text = f"rootrank: {who}; SGLang is shutting this server down"
        self._health_fails_now(tokenizer_manager)
        ended = self._end_in_flight(tokenizer_manager, AbortReq)
        logger.warning("rootrank: %s; ended %d request(s) in flight with HTTP 503 now instead of when SGLang's "
                       "shutdown drops them, answers new ones with 503 until then, and /health with 503", who, ended)
        try:
            import asyncio

            loop = asyncio.get_running_loop()

            def sweep() -> None:
                try:
                    self._end_in_flight(tokenizer_manager, AbortReq)
                except Exception:
                    _fault("launcher sweep")
                loop.call_later(LAUNCHER_SWEEP_S, sweep)

            loop.call_later(LAUNCHER_SWEEP_S, sweep)
        except Exception:
            _fault("launcher sweep")
        return self.dying_text

    def _end_in_flight(self, tokenizer_manager: Any, abort_req: Any) -> int:
        """Ends every unfinished request of the dying launcher through SGLang's own abort
        path, with status 503 (a router retries it on another instance)."""
        ended = 0
        for rid, state in list(getattr(tokenizer_manager, "rid_to_state", {}).items()):
            if getattr(state, "finished", True) or getattr(state, "_rootrank_ended", False):
                continue
            room = getattr(getattr(state, "obj", None), "bootstrap_room", None)
            text = (str(self.dying_text)
                    + (f" (`rootrank why {room}` says more)" if isinstance(room, int) else ""))
            tokenizer_manager._handle_abort_req(abort_req(
                rid=rid, abort_message=text,
                finished_reason={"type": "abort", "message": text, "status_code": 503}))
            try:
                state._rootrank_ended = True
            except Exception:
                pass
            ended += 1
        _stats["launcher_aborted"] += ended
        return ended

    @staticmethod
    def _health_fails_now(tokenizer_manager: Any) -> None:
        """SGLang's /health answers 503 while the server is starting; otherwise it waits up to
        20 s for a token from the scheduler that just died, and a router's check (5 s by
        default) times out instead of seeing the instance go."""
        try:
            from sglang.srt.managers.tokenizer_manager import ServerStatus

            tokenizer_manager.server_status = ServerStatus.Starting
        except Exception:
            _fault("launcher health")

    def on_clean_exit(self) -> None:
        if self.dead:
            return
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        for r in list(self.ranks.values()):
            if not r.agent.stopped:
                r.agent.shutdown(max(0.0, deadline - time.monotonic()))

    def at_exit(self) -> None:
        try:
            last = getattr(sys, "last_value", None)
            if last is not None and not self.dead and self.ranks:
                self.on_fatal("".join(traceback.format_exception(type(last), last, last.__traceback__)))
            self.on_clean_exit()
        except Exception:
            _fault("exit")


def _fail_now(kv_mgr: Any, room: int, text: str, told: Optional[Dict[str, Any]] = None) -> bool:
    """Fails a room that has not concluded through SGLang's own status path (the reason
    recorded, then Failed), as its own timeouts would; ``told`` names the peer rank that failed
    it or is gone (the record is then peer_reported with that peer). Whether it failed it."""
    status = getattr(kv_mgr, "request_status", {}).get(room)
    if status is None or int(status) in (FAILED, SUCCESS):
        return False
    _told.by = (room, told) if told is not None else None
    try:
        kv_mgr.record_failure(room, text)
    finally:
        _told.by = None
    from sglang.srt.disaggregation.base.conn import KVPoll

    kv_mgr.update_status(room, KVPoll.Failed)
    _stats["fail_fast_rooms"] += 1
    return True


def _certain_death(ev: Dict[str, Any]) -> bool:
    """Whether a ``down`` event is a death to act on. A live key that vanished is sent at once
    with ``certified: false`` and again when its certificate lands: after an etcd stall longer
    than the lease TTL every lease runs out, and the coordinator certifies the processes that
    registered again ``lease_lost`` (no death; they are not sent again, their new incarnation
    is ``live``). So fail fast waits for the certificate, one etcd write later when etcd was
    not silent. Coordinators before v4 send no ``certified``: every ``down`` counts."""
    return ev.get("certified") is not False and ev.get("reason") != "lease_lost"


def _with_fail_fast_note(reason: str) -> str:
    for addr, note in list(_fail_fast_notes.items()):
        if addr in reason and note not in reason:
            return f"{reason} {note}"
    return reason


def _rooms_in_flight(managers: List[Any], limit: int = 4096) -> List[int]:
    """Rooms a rank's KV managers hold that have not concluded (bounded)."""
    rooms: List[int] = []
    for kv_mgr in managers:
        try:
            for room, status in list(getattr(kv_mgr, "request_status", {}).items()):
                if int(status) not in (FAILED, SUCCESS) and len(rooms) < limit:
                    rooms.append(int(room))
        except Exception:
            continue
    return rooms


def culprit_text(verdict: Optional[Dict[str, Any]]) -> Optional[str]:
    """``failed at GROUP rank R: REASON (SOURCE): DETAIL`` for a resolved verdict, else None."""
    if not verdict or verdict.get("status") != "resolved":
        return None
    c = verdict.get("culprit") or {}
    if "group" not in c or "rank" not in c:
        return None
    text = f"failed at {c['group']} rank {c['rank']}: {c.get('reason', 'other')} ({c.get('source', '?')})"
    detail = str(c.get("detail") or "").strip()
    text = f"{text}: {detail}" if detail else text
    cause = verdict.get("cause")
    if isinstance(cause, dict) and "group" in cause:
        text += f"; cause: {cause['group']} rank {cause.get('rank')}: {cause.get('reason', 'other')}"
    return text


def _set_reason(exc: BaseException, text: str) -> None:
    """Rewrites the message of SGLang's own exception object: same type, room and
    ``is_from_another_rank``, same traceback."""
    if hasattr(exc, "failure_reason"):
        exc.failure_reason = text
    exc.args = (text,)


# --------------------------------------------------------------------------- hooks


def _after_kv_manager_init(result: Any, kv_mgr: Any, *args: Any, **kwargs: Any) -> None:
    try:
        if _plugin is None or isinstance(getattr(kv_mgr, "failure_records", None), _FailureRecords):
            return None
        # NixlKVManager creates its NIXL agent after CommonKVManager.__init__ returns; its own
        # __init__ hook registers then, so RankLive names the rank's NIXL agent.
        if getattr(kv_mgr, "agent", None) is None and _is_nixl(kv_mgr):
            return None
        _plugin.on_kv_manager(kv_mgr)
    except Exception:
        _fault("KV manager registration")
    return None


def _is_nixl(kv_mgr: Any) -> bool:
    return any(c.__name__ == "NixlKVManager" and c.__module__.endswith("disaggregation.nixl.conn") for c in type(kv_mgr).__mro__)


def _after_transfer_init(result: Any, transfer: Any, *args: Any, **kwargs: Any) -> None:
    """After SGLang creates a decode receiver or a prefill sender for a room."""
    p = _plugin
    if p is not None and p.fail_fast and (p.resolved_elsewhere or p.gone_instances):
        try:
            kv_mgr = getattr(transfer, "kv_mgr", None)
            role = getattr(getattr(kv_mgr, "_rootrank_rank", None), "role", None)
            room = getattr(transfer, "bootstrap_room", None)
            if role == "decode":
                p.on_transfer_created(kv_mgr, room, getattr(transfer, "bootstrap_addr", None))
            elif role == "prefill":
                p.on_transfer_created(kv_mgr, room)  # its own instance's address says nothing
        except Exception:
            _fault("receiver/sender hook")
    return None


def _before_ingest(*args: Any, **kwargs: Any) -> None:
    p = _plugin
    if p is not None:
        try:
            if not p.per_iteration:
                p.per_iteration = True
                _report_hooks(p, "scheduler")
            p.on_iteration()
        except Exception:
            _fault("iteration hook")
    return None


def _report_hooks(p: "_Plugin", where: str) -> None:
    """Once per process, when the plugin first runs there (a scheduler's first iteration, the
    launcher's first watchdog check): which of its hooks SGLang really applied. The "plugin
    active" line says what was registered; a hook SGLang could not apply (a method renamed in
    another SGLang version) shows here."""
    if p.hooks_reported:
        return
    p.hooks_reported = True
    from sglang.srt.plugins.hook_registry import HookRegistry

    patched = getattr(HookRegistry, "_patched", None)
    if patched is None:
        return
    short = lambda t: t.rsplit(".", 2)[-2] + "." + t.rsplit(".", 1)[-1]  # noqa: E731
    took = [short(t) for t in p.hook_targets if t in patched]
    missed = [short(t) for t in p.hook_targets if t not in patched]
    if missed:
        logger.warning("rootrank: in this %s, SGLang applied %s; not applied: %s", where, ", ".join(took) or "none",
                       ", ".join(missed))
    else:
        logger.info("rootrank: in this %s, SGLang applied all %d hooks", where, len(took))


def _after_poll(polls: Any, pollers: Any = None, *args: Any, **kwargs: Any) -> None:
    p = _plugin
    if p is not None:
        if not p.per_iteration:
            p.epoch += 1
        if FAILED in polls:
            try:
                p.on_polls(polls, pollers)
            except Exception:
                _fault("poll hook")
    return None


def _after_poll_pp(polls: Any, pollers: Any = None, *args: Any, **kwargs: Any) -> None:
    p = _plugin
    if p is not None and pollers:
        if not p.per_iteration:
            p.epoch += 1
        try:
            p.on_own_status(pollers)
        except Exception:
            _fault("PP poll hook")
    return None


def _around_apply_prefill_status(original: Callable[..., Any], kv_mgr: Any, *args: Any, **kwargs: Any) -> Any:
    told = None
    try:
        if _plugin is not None and int(kwargs.get("status", -1)) == FAILED:
            room = kwargs.get("bootstrap_room")
            told = (room, prefill_peer(kv_mgr, room, kwargs.get("prefill_rank")))
    except Exception:
        _fault("prefill status hook")
    if told is None:
        return original(kv_mgr, *args, **kwargs)
    _told.by = told
    try:
        return original(kv_mgr, *args, **kwargs)
    finally:
        _told.by = None


def _around_failure_exception(original: Callable[..., Any], owner: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return original(owner, *args, **kwargs)
    except Exception as exc:
        if _plugin is not None and getattr(exc, "is_from_another_rank", False) is True:
            try:
                _plugin.on_fallback(owner, exc)
            except Exception:
                _fault("fallback rewrite")
        raise


def _after_exception_traceback(result: Any, *args: Any, **kwargs: Any) -> None:
    try:
        if _plugin is None or _plugin.dead or not _plugin.ranks:
            return None
        frame = sys._getframe(1)
        for _ in range(4):
            if frame is None:
                return None
            if frame.f_code.co_name == "run_scheduler_process":
                _plugin.on_fatal(result)
                return None
            frame = frame.f_back
    except Exception:
        _fault("fatal exception hook")
    return None


def _around_run_event_loop(original: Callable[..., Any], scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    result = original(scheduler, *args, **kwargs)
    try:
        if _plugin is not None:
            _plugin.on_clean_exit()
    except Exception:
        _fault("clean exit")
    return result


def _around_check_processes(original: Callable[..., Any], watchdog: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        if _plugin is not None:
            _report_hooks(_plugin, "launcher")
            processes = list(getattr(watchdog, "_processes", None) or [])
            names = list(getattr(watchdog, "_names", None) or [f"process_{i}" for i in range(len(processes))])
            _plugin.on_children_checked(processes, names)
    except Exception:
        _fault("launcher certificate")
    return original(watchdog, *args, **kwargs)


def _around_sigquit(original: Callable[..., Any], handler: Any, *args: Any, **kwargs: Any) -> Any:
    p = _plugin
    if p is not None and p.sigquit_deferred:
        return None  # a second SIGQUIT (the watchdog's) while SGLang's handler is already due
    dying = False
    try:
        if p is not None:
            dying = p.on_sigquit(getattr(handler, "tokenizer_manager", None)) is not None
    except Exception:
        _fault("launcher SIGQUIT")
    if dying:
        try:
            import asyncio

            # The handler runs as a callback of the event loop (loop.add_signal_handler). SGLang's
            # own handler sleeps for its crash diagnostics (5 s + 60 s by default) and then kills
            # the server: run on the loop, that sleep would hold every request that arrives
            # meanwhile until the kill. It runs on its own thread instead, a moment later (after
            # the ended requests' responses went out), and the loop keeps answering new requests
            # with 503 (`_around_generate_request`) until the kill.
            def later() -> None:
                threading.Thread(target=original, args=(handler, *args), kwargs=kwargs,
                                 name="sglang-sigquit", daemon=True).start()

            asyncio.get_running_loop().call_later(LAUNCHER_ABORT_FLUSH_S, later)
            p.sigquit_deferred = True
            return None
        except Exception:
            _fault("launcher SIGQUIT deferral")
    return original(handler, *args, **kwargs)


class _ServerDying(ValueError):
    """What a dying server answers a new request with: SGLang's HTTP layer turns a ValueError
    into an error response with its ``status_code``."""

    status_code = 503


def _around_generate_request(original: Callable[..., Any], tokenizer_manager: Any, *args: Any, **kwargs: Any) -> Any:
    p = _plugin
    if p is not None and p.tokenizer_manager is None:
        p.keep_tokenizer_manager(tokenizer_manager)
    text = p.dying_text if p is not None else None
    if text is None:
        return original(tokenizer_manager, *args, **kwargs)

    async def refused() -> Any:
        raise _ServerDying(text)
        yield  # an async generator, as SGLang's generate_request is

    _stats["launcher_refused"] += 1
    return refused()


def _is_prefill_launcher() -> bool:
    try:
        from sglang.srt.entrypoints.http_server import _global_state

        args = getattr(getattr(_global_state, "tokenizer_manager", None), "server_args", None)
        return str(getattr(args, "disaggregation_mode", "null")) == "prefill"
    except Exception:
        return False


def _stream_error(chunk: bytes) -> Optional[Tuple[int, Dict[str, Any]]]:
    """The 5xx status a streamed SGLang event carries, with the event: an error event
    (``code``) or a request ended by abort (its finished reason's ``status_code``); None for
    anything else."""
    if not chunk.startswith(b"data: {"):
        return None
    try:
        out = json.loads(chunk[len(b"data: "):])
    except ValueError:
        return None
    if not isinstance(out, dict):
        return None
    error = out.get("error")
    if isinstance(error, dict):
        code = error.get("code")
    else:
        reason = (out.get("meta_info") or {}).get("finish_reason") or {}
        code = reason.get("status_code") if isinstance(reason, dict) and reason.get("type") == "abort" else None
    return (code, out) if isinstance(code, int) and not isinstance(code, bool) and 500 <= code < 600 else None


async def _around_serve_generate(original: Callable[..., Any], obj: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    """In a prefill launcher, a streamed answer is held until it ends, and one that ends in a
    5xx error (the plugin ending a request of a dying instance, or refusing a new one) becomes
    that status. SGLang sends a stream's 200 at once, and sglang-router retries a PD request
    on another pair only on the prefill's status, never on an error inside its body (it reads
    the whole prefill body before the client sees anything, so holding it costs nothing:
    docs/router.md). Anything else is left as SGLang answers it."""
    response = await original(obj, request, *args, **kwargs)
    try:
        p = _plugin
        body = getattr(response, "body_iterator", None)
        if (p is None or not p.fail_fast or body is None or not getattr(obj, "stream", False)
                or not _is_prefill_launcher()):
            return response
        from fastapi.responses import ORJSONResponse, StreamingResponse
    except Exception:
        _fault("prefill stream")
        return response
    held: List[bytes] = []
    size = 0
    error: Optional[Tuple[int, Dict[str, Any]]] = None
    # SGLang's own generator: what it raises, it raised under SGLang's StreamingResponse too.
    async for chunk in body:
        chunk = chunk.encode() if isinstance(chunk, str) else bytes(chunk)
        held.append(chunk)
        size += len(chunk)
        if error is None:
            error = _stream_error(chunk)
        if size > PREFILL_HOLD_BYTES:
            break
    if error is not None and size <= PREFILL_HOLD_BYTES:
        # Not SGLang's background abort: the request is already ended (and one refused before
        # SGLang normalized it has no rid to abort: its abort_request raises).
        _stats["prefill_errors_as_status"] += 1
        status, out = error
        if not isinstance(out.get("error"), dict):
            reason = (out.get("meta_info") or {}).get("finish_reason") or {}
            out = {"error": {"message": str(reason.get("message", "")), "code": status}}
        return ORJSONResponse(out, status_code=status)

    async def replay() -> Any:
        for c in held:
            yield c
        if size > PREFILL_HOLD_BYTES:
            async for c in body:
                yield c

    return StreamingResponse(replay(), status_code=response.status_code, media_type=response.media_type,
                             background=response.background)


def _called_from(names: Tuple[str, ...]) -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in names:
            return True
        frame = frame.f_back
    return False


def _fallback_classes() -> List[type]:
    """The classes whose own ``failure_exception`` raises the generic fallback: the shared
    ``CommonKVSender``/``CommonKVReceiver`` from SGLang 0.5.23, ``NixlKVSender``/
    ``NixlKVReceiver`` in 0.5.18-0.5.22."""
    import importlib

    found = []
    for module, names in (
        ("sglang.srt.disaggregation.common.conn", ("CommonKVSender", "CommonKVReceiver")),
        ("sglang.srt.disaggregation.nixl.conn", ("NixlKVSender", "NixlKVReceiver")),
    ):
        try:
            mod = importlib.import_module(module)
        except Exception:
            continue
        for name in names:
            cls = getattr(mod, name, None)
            if isinstance(cls, type) and "failure_exception" in cls.__dict__:
                found.append(cls)
    return found


def register() -> None:
    """The entry point SGLang's ``load_plugins()`` calls once per process. Never raises."""
    global _plugin
    try:
        with _register_lock:
            if _plugin is not None:
                return
            endpoints = os.environ.get("ROOTRANK_ETCD_ENDPOINTS", "").strip()
            if not endpoints:
                logger.info("rootrank: ROOTRANK_ETCD_ENDPOINTS is not set; the plugin is inactive and changes nothing")
                return
            if _called_from(_NON_SCHEDULER_ENTRIES):
                return
            _install(_Plugin(endpoints))
    except Exception:
        _plugin = None
        _fault("register")


def _install(plugin: "_Plugin") -> None:
    global _plugin
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    hooked = []

    def hook(target: str, fn: Callable[..., Any], kind: Any) -> None:
        HookRegistry.register(target, fn, kind)
        plugin.hook_targets.append(target)
        hooked.append(target.rsplit(".", 2)[-2] + "." + target.rsplit(".", 1)[-1])

    hook("sglang.srt.disaggregation.common.conn.CommonKVManager.__init__", _after_kv_manager_init, HookType.AFTER)
    try:
        import sglang.srt.disaggregation.nixl.conn  # noqa: F401  (NIXL may be absent: then no NIXL hook)

        hook("sglang.srt.disaggregation.nixl.conn.NixlKVManager.__init__", _after_kv_manager_init, HookType.AFTER)
    except Exception:
        pass
    import sglang.srt.disaggregation.utils as dutils

    # The rank's own polls (without PP); under PP every stage's own status, since PP rank 0's
    # poll is the consensus of all stages and the others only receive it.
    if hasattr(dutils, "_poll_with_failure_injection"):
        hook("sglang.srt.disaggregation.utils._poll_with_failure_injection", _after_poll, HookType.AFTER)
    if hasattr(dutils, "poll_and_all_reduce_prefill_pp"):
        hook("sglang.srt.disaggregation.utils.poll_and_all_reduce_prefill_pp", _after_poll_pp, HookType.AFTER)
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    if hasattr(CommonKVManager, "apply_prefill_status"):
        hook("sglang.srt.disaggregation.common.conn.CommonKVManager.apply_prefill_status",
             _around_apply_prefill_status, HookType.AROUND)
    # A decode receiver (a prefill sender) created for a room whose verdict already resolved
    # at its peer.
    import importlib

    for kind in ("Receiver", "Sender"):
        for module, name in (("sglang.srt.disaggregation.common.conn", f"CommonKV{kind}"),
                             ("sglang.srt.disaggregation.nixl.conn", f"NixlKV{kind}")):
            try:
                if "__init__" in getattr(importlib.import_module(module), name).__dict__:
                    hook(f"{module}.{name}.__init__", _after_transfer_init, HookType.AFTER)
                    break
            except Exception:
                continue
    for cls in _fallback_classes():
        hook(f"{cls.__module__}.{cls.__qualname__}.failure_exception", _around_failure_exception, HookType.AROUND)
    hook("sglang.utils.get_exception_traceback", _after_exception_traceback, HookType.AFTER)
    hook("sglang.srt.managers.scheduler.Scheduler.run_event_loop", _around_run_event_loop, HookType.AROUND)
    # Once per iteration of every event loop (SGLang: "the one place a new per-iteration
    # input source belongs"): stalls and the verdict budget count iterations there. Named,
    # not imported: importing the scheduler module here, inside load_plugins(), would load
    # its whole import tree early in every process (an SGLang without the method logs that
    # the hook did not apply, and the budget stays per poll call).
    hook("sglang.srt.managers.scheduler.Scheduler.ingest_requests", _before_ingest, HookType.BEFORE)
    # In the launcher: its watchdog over the scheduler processes (named, as above).
    hook("sglang.srt.utils.watchdog.SubprocessWatchdog._check_processes", _around_check_processes, HookType.AROUND)
    import multiprocessing

    if multiprocessing.parent_process() is None:
        # Only in the launcher (the main process; schedulers are its children): its SIGQUIT
        # handler (importing the tokenizer manager in every scheduler would cost each one).
        hook("sglang.srt.managers.tokenizer_manager.SignalHandler.running_phase_sigquit_handler",
             _around_sigquit, HookType.AROUND)
        hook("sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request",
             _around_generate_request, HookType.AROUND)
        # A prefill's streamed answer that ends in a 5xx error, as a status a router retries.
        hook("sglang.srt.entrypoints.http_server.serve_generate_request", _around_serve_generate, HookType.AROUND)
    _plugin = plugin
    atexit.register(plugin.at_exit)
    try:
        import sglang

        version = getattr(sglang, "__version__", "?")
    except Exception:
        version = "?"
    # WARNING, not INFO: load_plugins() runs before SGLang configures logging, and this one
    # line is what tells an operator rootrank is in (and what it hooked).
    logger.warning("rootrank: SGLang %s plugin active (etcd %s, coordinator %s, budget %d ms); hooked %s",
                version, plugin.endpoints, ",".join(plugin.coordinator.urls) if plugin.coordinator else "none",
                int(plugin.budget_s * 1000), ", ".join(hooked))
