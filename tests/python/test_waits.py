"""SPEC v3 "no request waits": stalls, /v1/health and the /v1/events stream, against real
etcd, a real `rootrank serve` and real Python rank processes whose scheduler-like loops call
`Agent.progress()` once per iteration."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import pytest

import rootrank
from conftest import ROOTRANK_BIN, Coordinator, node_watch_with_py_spy, spawn_python, wait_until

# A rank's loop: one progress() per iteration. WEDGE=secs: after 1 s the loop wedges in a C
# call that keeps the GIL (PyDLL), as a rank stuck in a driver call does; the agent's own
# Rust thread still sees the count stop. WAIT=1: the loop stops in a blocking wait (a rank
# waiting in a collective on a wedged sibling), GIL released.
LOOP = """
import os, sys, time, ctypes, rootrank
a = rootrank.Agent(os.environ['G'], int(os.environ['R']), int(os.environ.get('SIZE', '2')),
                   lease_ttl_ms=1000, stall_after_ms=int(os.environ.get('STALL_MS', '500')))
assert a.wait_registered(10) is not None
print('registered', a.incarnation, flush=True)
start = time.monotonic()
wedge = float(os.environ.get('WEDGE', '0'))
wait_at = float(os.environ.get('WAIT_AT', '0'))
record = os.environ.get('RECORD_FILE')
busy_ms = float(os.environ.get('BUSY_MS', '0'))
deadlock_at = float(os.environ.get('DEADLOCK_AT', '0'))
while time.monotonic() - start < float(os.environ.get('RUN_S', '60')):
    a.progress()
    elapsed = time.monotonic() - start
    if wedge and elapsed > 1.0:
        print('wedging', flush=True)
        ctypes.PyDLL(None).sleep(int(wedge))
        print('unwedged', flush=True)
        wedge = 0
    if wait_at and elapsed > wait_at:
        print('waiting', flush=True)
        time.sleep(float(os.environ.get('WAIT_S', '3')))
        print('woke', flush=True)
        wait_at = 0
    if busy_ms:
        # A busy iteration (a long forward pass): CPU-bound Python, GIL held, yet advancing.
        end = time.monotonic() + busy_ms / 1000
        while time.monotonic() < end:
            sum(range(1000))
    if deadlock_at and elapsed > deadlock_at:
        import threading
        lock = threading.Lock()
        print('deadlocking', flush=True)
        def take_twice(lock):
            lock.acquire()
            lock.acquire()  # a pure-Python deadlock: never returns
        take_twice(lock)
    down = os.environ.get('DOWN_FILE')
    if down and os.path.exists(down):
        # A fatal error this rank reports itself (its certificate), then it exits.
        a.record_down('cuda_error', 'CUDA error: an illegal memory access was encountered')
        a.flush(5)
        print('down', flush=True)
        os._exit(1)
    if record and os.path.exists(record):
        # The generic fallback this rank saw for a room (a room it only failed with the group).
        room = int(open(record).read())
        a.record_failure(room, 'other', 'Failed due to an unknown reason from another rank', origin='propagated')
        print('recorded', room, flush=True)
        record = None
    time.sleep(0.01)
"""


class Events:
    """Follows /v1/events with rootrank.Coordinator.events() on a thread."""

    def __init__(self, url: str, since=None, group=None):
        # From the replica's revision now, read before the caller goes on: without `since` a
        # stream starts at its own connect, which on a busy machine came after the first rank
        # registered (CI: a test waited for a `live` event the stream had never been sent).
        if since is None:
            import urllib.request

            with urllib.request.urlopen(url + "/v1/groups", timeout=10) as r:
                since = json.loads(r.read())["revision"]
        self.items: list = []
        self.stop = threading.Event()
        self.error = None
        self.thread = threading.Thread(target=self._run, args=(url, since, group), daemon=True)
        self.thread.start()

    def _run(self, url, since, group):
        try:
            for ev in rootrank.Coordinator(url).events(since, group, idle_timeout_s=5, stop=self.stop):
                self.items.append(ev)
        except Exception as e:  # surfaced by the test
            self.error = e

    def rank(self, group, rank, state):
        return [e for e in self.items if e.get("event") == "rank" and e["group"] == group
                and e["rank"] == rank and e["state"] == state]

    def close(self):
        self.stop.set()
        self.thread.join(10)



def write_at_once(path, text: str):
    """What a rank process polls for: it must never read the file half written (a rank read
    '' between write_text's truncate and its write, under load)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)

def _state(coordinator, group, rank):
    status, body = coordinator.http(f"/v1/groups/{group}")
    if status != 200:
        return None
    return next((r for r in body["ranks"] if r["rank"] == rank), None)


def _metric(coordinator, line_start):
    import urllib.request

    with urllib.request.urlopen(coordinator.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return [l for l in text.splitlines() if l.startswith(line_start)]


def test_a_wedged_rank_holding_the_gil_is_stalled_first_and_named_the_suspect(etcd, coordinator, tmp):
    """Rank 1 wedges in a C call that holds the GIL; rank 0 then waits on it (as siblings
    wait in the collective). Both stall; rank 1's record comes first by revision: suspect.
    node-watch on this host reads the stalled ranks' Python stacks (py-spy) into the records."""

    g = "wait-stall"
    env = {"ROOTRANK_ETCD_ENDPOINTS": etcd.url, "G": g, "STALL_MS": "500", "WEDGE": "0"}
    watcher = node_watch_with_py_spy(etcd, tmp)
    events = Events(coordinator.url, group=g)
    r1 = spawn_python(LOOP, {**env, "R": "1", "WEDGE": "5"}, tmp / "r1.log")
    r0 = spawn_python(LOOP, {**env, "R": "0", "WAIT_AT": "2.5", "WAIT_S": "3"}, tmp / "r0.log")
    try:
        wait_until(lambda: (_state(coordinator, g, 1) or {}).get("state") == "stalled", 20, "rank 1 stalled")
        wait_until(lambda: (_state(coordinator, g, 0) or {}).get("state") == "stalled", 20, "rank 0 stalled")
        s1, s0 = _state(coordinator, g, 1), _state(coordinator, g, 0)
        assert s1["stall"]["role"] == "suspect", s1
        assert s0["stall"]["role"] == "waiting", s0
        assert s1["stalled_since"] and s1["stall"]["stalled_ms"] >= 500, s1
        # The wedged thread's stack, read from outside while it holds the GIL in sleep().
        wait_until(lambda: (_state(coordinator, g, 1) or {}).get("stack"), 10, "rank 1's stack")
        stack = "\n".join(_state(coordinator, g, 1)["stack"])
        assert '"MainThread"' in stack and "<module> (<string>:" in stack, stack
        assert _state(coordinator, g, 1)["stall"]["role"] == "suspect", "adding the stack moved the order"
        # The wedged rank held the GIL the whole time and still kept its lease: alive, stalled.
        assert "wedging" in (tmp / "r1.log").read_text() and "unwedged" not in (tmp / "r1.log").read_text()
        status, body = coordinator.http(f"/v1/health?group={g}")
        assert status == 503 and body["healthy"] is False, body
        assert {(r["rank"], r["state"]) for r in body["ranks"]} == {(0, "stalled"), (1, "stalled")}, body
        assert any("no progress" in r["reason"] for r in body["ranks"]), body
        assert _metric(coordinator, f'rootrank_rank_stalled{{group="{g}",rank="1"}} 1'), "metric"
        assert any(l.startswith("rootrank_events_readers 1") for l in _metric(coordinator, "rootrank_events_readers")), "readers"
        status, groups = coordinator.http("/v1/groups")
        assert next(x for x in groups["groups"] if x["group"] == g)["stalled"] == 2, groups
        # `rootrank status` shows it for people.
        out = subprocess.run([ROOTRANK_BIN, "status", "--group", g, "--coordinator", coordinator.url],
                             capture_output=True, text=True, timeout=20).stdout
        assert "stalled" in out and "suspect" in out, out
        # Both resume: live again, healthy, events say so in revision order.
        wait_until(lambda: coordinator.http(f"/v1/health?group={g}")[0] == 200, 30, "healthy again")
        # Rank 1 live twice: registered (the reader starts before the ranks, `Events`), and
        # live again after its stall; rank 0 live again after its own.
        wait_until(lambda: events.rank(g, 1, "stalled") and events.rank(g, 0, "stalled"), 10, "stalled events")
        stalled1, stalled0 = events.rank(g, 1, "stalled")[0], events.rank(g, 0, "stalled")[0]
        wait_until(lambda: any(e["revision"] > stalled1["revision"] for e in events.rank(g, 1, "live")),
                   10, f"rank 1 live event after its stall (events: {events.items})")
        assert any(e["revision"] < stalled1["revision"] for e in events.rank(g, 1, "live")), events.items
        assert any(e["revision"] > stalled0["revision"] for e in events.rank(g, 0, "live")), events.items
        assert stalled1["revision"] < stalled0["revision"], events.items
        revs = [e["revision"] for e in events.items]
        assert revs == sorted(revs), revs
        assert _metric(coordinator, f'rootrank_rank_stalled{{group="{g}",rank="1"}} 0'), "metric back to 0"
    finally:
        events.close()
        for p in (r0, r1, watcher):
            p.kill()
            p.wait()
    assert events.error is None, events.error


def test_events_resume_from_a_revision_and_name_a_death_and_a_resolved_room(etcd, coordinator, tmp):
    g = "wait-events"
    env = {"ROOTRANK_ETCD_ENDPOINTS": etcd.url, "G": g}
    first = Events(coordinator.url)
    r0 = spawn_python(LOOP, {**env, "R": "0", "RECORD_FILE": str(tmp / "room")}, tmp / "r0.log")
    r1 = spawn_python(LOOP, {**env, "R": "1"}, tmp / "r1.log")
    try:
        wait_until(lambda: len([e for e in first.items if e.get("group") == g and e.get("state") == "live"]) == 2,
                   20, "both ranks live")
        os.kill(r1.pid, signal.SIGKILL)
        r1.wait()
        wait_until(lambda: first.rank(g, 1, "down"), 20, "rank 1 down event")
        down = first.rank(g, 1, "down")[0]
        assert down["reason"] == "lease_expired", down
        # Rank 0 hits the generic failure for a room: the room resolves on rank 1's death.
        room = 4_242_424_242
        write_at_once(tmp / "room", str(room))
        wait_until(lambda: any(e.get("event") == "resolved" and e["verdict"]["room"] == str(room) for e in first.items),
                   20, "resolved event")
        resolved = next(e for e in first.items if e.get("event") == "resolved")
        assert resolved["verdict"]["culprit"]["group"] == g and resolved["verdict"]["culprit"]["rank"] == 1, resolved
        assert g in resolved["groups"], resolved
        # A reader resuming after the first live event gets everything after it, in order.
        since = [e for e in first.items if e.get("group") == g][0]["revision"]
        again = Events(coordinator.url, since=since)
        wait_until(lambda: len(again.items) >= len([e for e in first.items if e["revision"] > since]), 10, "resumed")
        assert [e for e in again.items] == [e for e in first.items if e["revision"] > since]
        again.close()
        # From the beginning: this replica loaded before the ranks came, so its history; a
        # restarted one would send its catch-up (next test). Either way the same end state.
        old = Events(coordinator.url, since=0, group=g)
        wait_until(lambda: any(e.get("event") == "resolved" for e in old.items), 10, "replay from 0")
        old.close()
        assert _fold(old.items, g) == _fold(first.items, g), (old.items, first.items)
        assert _fold(old.items, g)[0] == {0: ("live", None), 1: ("down", "lease_expired")}, old.items
        assert [e["revision"] for e in old.items] == sorted(e["revision"] for e in old.items), old.items
    finally:
        first.close()
        for p in (r0, r1):
            p.kill()
            p.wait()
    assert first.error is None, first.error


def _fold(items, group):
    """What a reader of the stream believes in the end: each rank's last state and reason,
    and the rooms it saw resolved (with their culprits)."""
    ranks, rooms = {}, {}
    for e in items:
        if e.get("event") == "rank" and e["group"] == group:
            ranks[e["rank"]] = (e["state"], e.get("reason"))
        elif e.get("event") == "resolved" and group in e["groups"]:
            c = e["verdict"]["culprit"]
            rooms[e["verdict"]["room"]] = (c["group"], c["rank"], c["reason"])
    return ranks, rooms


def test_a_room_resolved_on_a_victim_is_announced_when_its_window_ends(etcd, coordinator, tmp):
    """A room whose only candidate is a victim (rule 7) resolves when the victim's window ends
    (the slowest lease TTL + 1 s after its death): nothing is written to etcd then, yet the
    stream announces it and a long poll on it returns, at that moment."""
    g = "wait-victim"
    room = 8_200_000_000_000_000_001
    events = Events(coordinator.url, group=g)
    agents = [rootrank.Agent(g, r, 2, etcd_endpoints=etcd.url, lease_ttl_ms=1000) for r in (0, 1)]
    try:
        for a in agents:
            assert a.wait_registered(10) is not None
        long_poll: dict = {}

        def ask() -> None:
            t0 = time.monotonic()
            long_poll["verdict"] = coordinator.verdict(room, g, wait_ms=20_000)
            long_poll["after_s"] = time.monotonic() - t0

        agents[0].record_failure(room, "other", "Failed due to an unknown reason from another rank", origin="propagated")
        agents[0].record_down("peer_lost", "gloo: Connection closed by peer")
        assert agents[0].flush(5)
        died = time.monotonic()
        asker = threading.Thread(target=ask, daemon=True)
        asker.start()

        def resolved():
            return next((e for e in events.items if e.get("event") == "resolved"
                         and e["verdict"]["room"] == str(room)), None)

        ev = wait_until(resolved, 15, "the room's resolved event")
        seen_after = time.monotonic() - died
        c = ev["verdict"]["culprit"]
        assert (c["rank"], c["reason"]) == (0, "peer_lost"), ev
        asker.join(20)
        v = long_poll["verdict"]
        assert v["status"] == "resolved" and v["culprit"]["rank"] == 0, v
        assert long_poll["after_s"] < 15, long_poll  # not its 20 s wait
        print(f"\nvictim-only room: resolved event {seen_after:.2f} s after the death (window: 1 s TTL + 1 s), "
              f"long poll answered after {long_poll['after_s']:.2f} s")
    finally:
        events.close()
        for a in agents:
            a.shutdown(5)


def test_events_resume_after_a_coordinator_restart_and_miss_nothing(etcd, coordinator, tmp):
    """A reader follows replica A; A is SIGKILLed; while it is down rank 1 fails (its own
    certificate), rank 2 registers and rank 0 fails a room because of rank 1. A restarts on
    the same port and the reader, resuming with its last revision, ends knowing what a reader
    of replica B (which watched throughout) knows: no 410, nothing missed."""
    g = "wait-restart"
    env = {"ROOTRANK_ETCD_ENDPOINTS": etcd.url, "G": g, "SIZE": "3"}
    a = Coordinator(etcd, tmp)
    watched = Events(coordinator.url, group=g)  # replica B, never restarted
    resumed = Events(a.url, group=g)
    r0 = spawn_python(LOOP, {**env, "R": "0", "RECORD_FILE": str(tmp / "room")}, tmp / "r0.log")
    r1 = spawn_python(LOOP, {**env, "R": "1", "DOWN_FILE": str(tmp / "down")}, tmp / "r1.log")
    r2 = None
    try:
        for reader in (watched, resumed):
            wait_until(lambda: {e["rank"] for e in reader.items if e.get("state") == "live"} == {0, 1}, 20, "ranks 0, 1 live")
        last = max(e["revision"] for e in resumed.items)
        a.kill()
        write_at_once(tmp / "down", "1")
        r1.wait(20)
        r2 = spawn_python(LOOP, {**env, "R": "2"}, tmp / "r2.log")
        room = 7_000_000_007
        write_at_once(tmp / "room", str(room))
        wait_until(lambda: any(e.get("event") == "resolved" for e in watched.items), 20, "B resolved the room")
        wait_until(lambda: 2 in {e["rank"] for e in watched.items if e.get("state") == "live"}, 20, "B: rank 2 live")
        assert [e for e in resumed.items if e["revision"] > last] == [], "A was down"
        a = Coordinator(etcd, tmp, port=a.port)
        wait_until(lambda: _fold(resumed.items, g) == _fold(watched.items, g), 20,
                   f"the resumed reader catches up: {_fold(resumed.items, g)} vs {_fold(watched.items, g)}")
        ranks, rooms = _fold(resumed.items, g)
        assert ranks == {0: ("live", None), 1: ("down", "cuda_error"), 2: ("live", None)}, ranks
        assert rooms == {str(room): (g, 1, "cuda_error")}, rooms
        revs = [e["revision"] for e in resumed.items]
        assert revs == sorted(revs), revs
        assert resumed.error is None and watched.error is None, (resumed.error, watched.error)
    finally:
        for reader in (watched, resumed):
            reader.close()
        for p in (r0, r1, r2):
            if p is not None:
                p.kill()
                p.wait()
        a.kill()


def test_events_and_health_reject_bad_input_and_a_slow_reader_cannot_grow_the_coordinator(etcd, coordinator, tmp):
    for path, code in [("/v1/events?since=-1", "invalid_since"), ("/v1/events?since=abc", "invalid_since"),
                       ("/v1/events?bogus=1", "invalid_query"), ("/v1/health", "invalid_group"),
                       ("/v1/health?group=", "invalid_group"), ("/v1/health?nope=1", "invalid_query")]:
        status, body = coordinator.http(path)
        assert status == 400 and body["error"]["code"] == code, (path, status, body)
    status, body = coordinator.http("/v1/health?group=never-registered")
    assert status == 503 and body["ranks"][0]["reason"] == "group never registered", body
    # Readers that connect and never read: the coordinator keeps serving and counts them.
    import socket

    silent = []
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", coordinator.port), timeout=5)
        s.sendall(b"GET /v1/events HTTP/1.1\r\nHost: x\r\n\r\n")
        silent.append(s)
    wait_until(lambda: any(l.endswith(" 20") for l in _metric(coordinator, "rootrank_events_readers ")), 10, "20 readers")
    assert coordinator.http("/readyz")[0] == 200
    for s in silent:
        s.close()
    wait_until(lambda: any(l.endswith(" 0") for l in _metric(coordinator, "rootrank_events_readers ")), 40, "readers gone")


def test_a_deadlocked_rank_is_stalled_with_its_stack_and_a_busy_rank_never_is(etcd, coordinator, tmp):
    """A pure-Python deadlock (a lock taken twice) stalls; an iteration that burns the CPU for
    60% of stall_after_ms, every iteration, never does."""

    g = "wait-deadlock"
    env = {"ROOTRANK_ETCD_ENDPOINTS": etcd.url, "G": g, "STALL_MS": "500"}
    watcher = node_watch_with_py_spy(etcd, tmp)
    events = Events(coordinator.url, group=g)
    dead = spawn_python(LOOP, {**env, "R": "0", "DEADLOCK_AT": "1"}, tmp / "r0.log")
    busy = spawn_python(LOOP, {**env, "R": "1", "BUSY_MS": "300", "RUN_S": "8"}, tmp / "r1.log")
    try:
        wait_until(lambda: (_state(coordinator, g, 0) or {}).get("stack"), 20, "the deadlocked rank's stack")
        s0 = _state(coordinator, g, 0)
        assert s0["state"] == "stalled" and s0["stall"]["role"] == "suspect", s0
        assert any("take_twice (<string>:" in line for line in s0["stack"]), s0["stack"]
        busy.wait(30)
        assert busy.returncode == 0, (tmp / "r1.log").read_text()
        assert not events.rank(g, 1, "stalled"), events.items
        assert events.rank(g, 0, "stalled"), events.items
    finally:
        events.close()
        for p in (dead, busy, watcher):
            p.kill()
            p.wait()


def test_rootrank_watch_prints_what_changes_for_people_and_as_json(etcd, coordinator, tmp):
    import json

    g = "wait-cli"
    people = subprocess.Popen([ROOTRANK_BIN, "watch", "--group", g, "--coordinator", coordinator.url],
                              stdout=open(tmp / "watch.txt", "w"), stderr=subprocess.STDOUT)
    machine = subprocess.Popen([ROOTRANK_BIN, "watch", "--json", "--coordinator", coordinator.url],
                               stdout=open(tmp / "watch.jsonl", "w"), stderr=subprocess.STDOUT)
    wait_until(lambda: any(l.endswith(" 2") for l in _metric(coordinator, "rootrank_events_readers ")), 10, "2 watchers")
    rank = spawn_python(LOOP, {"ROOTRANK_ETCD_ENDPOINTS": etcd.url, "G": g, "R": "0", "SIZE": "1"}, tmp / "r0.log")
    try:
        wait_until(lambda: "wait-cli rank 0 live" in (tmp / "watch.txt").read_text(), 20, "live line")
        os.kill(rank.pid, signal.SIGKILL)
        rank.wait()
        wait_until(lambda: "wait-cli rank 0 down (lease_expired)" in (tmp / "watch.txt").read_text(), 20, "down line")

        def machine_lines():
            lines = [json.loads(l) for l in (tmp / "watch.jsonl").read_text().splitlines() if l.startswith("{")]
            return [(e["group"], e["state"], e.get("certified")) for e in lines if e.get("group") == g]

        # v4: the vanished live key at once (not certified yet, unless the coordinator applied
        # it with its certificate in one batch), then its certificate.
        wait_until(lambda: len(machine_lines()) >= 3, 20, "three JSON lines")
        got = machine_lines()
        assert [(e[0], e[1]) for e in got] == [(g, "live"), (g, "down"), (g, "down")], got
        assert got[0][2] is None and got[2][2] is True, got
    finally:
        for p in (people, machine):
            p.kill()
            p.wait()
