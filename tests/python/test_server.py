"""The real-server tier: a real SGLang 0.5.23 PD deployment (`python -m sglang.launch_server`
prefill TP=2 and decode TP=1, KV over NIXL, sglang-router in front: tests/python/server_kit.py)
with the rootrank plugin installed from the wheel, a real etcd and a real coordinator. What an
operator checks: the client's answers through the router, `rootrank why` for the rooms that
failed, and how long each took. Run by scripts/test-server.sh (`make test-server`), which
prepares the venv, the wheel and the tiny model.

Scenario 1: greedy outputs with the plugin equal SGLang's alone (the plugin never changes what
SGLang does). Scenario 2: prefill rank 1 SIGKILLed (the OOM killer's way) while requests are in
flight: the culprit of the failed rooms is prefill rank 1, never prefill rank 0 (which dies in
gloo a moment later) nor decode; with SGLang's defaults (its launcher waits 60 s for crash
dumps before it exits, so decode learns late) and with its crash dumps off. Scenario 4 (the
prefill's side): decode's scheduler frozen and then SIGKILLed while the prefill holds rooms
waiting for it; before that, no false fail fast under load while other instances' ranks die."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOTRANK_BIN, Etcd, spawn_python
from server_kit import Stack, _group_pids, failed, generate, run_concurrently, stream_generate

PROMPTS = ["The quick brown fox", "Which rank really failed this request?", "Prefill sends the KV cache",
           "Hello, world! Numbers: 0 1 2"]
PREFIX = "/rootrank/v1/groups/"
CRASH_DUMPS_OFF = {"SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0", "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0"}
# Survives a loaded 2-core machine: SGLang's idle schedulers busy-poll (at 4000 ms, the decode
# rank's agent thread, in a process SGLang pins to one busy core at nice 10, missed its lease).
LEASE_TTL_MS = "5000"

@contextlib.contextmanager
def tier_etcd(logs_to: Path | None = None):
    """The etcd next to a real SGLang deployment (this tier, the demo, the bench): data on
    tmpfs and a step ahead of the SGLang processes for the CPU. etcd syncs its log to disk on
    every write, and in one run all three ranks' leases expired in one instant while the
    deployment idled, with the machine's disk and both cores busy with three SGLang servers (an
    etcd that stalled past the leases was one suspect; the cause was not proven). A
    deployment's etcd has its own disk and cores. Its log is copied to ``logs_to``."""
    shm = Path(tempfile.mkdtemp(prefix="rootrank-etcd-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    e = Etcd(shm)
    try:
        try:
            os.setpriority(os.PRIO_PROCESS, e.proc.pid, -5)
        except OSError:
            pass
        yield e
    finally:
        e.kill()
        if logs_to is not None:
            for log in shm.glob("*.log"):
                shutil.copy(log, logs_to / f"etcd-{log.name}")
        shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture
def etcd(tmp):
    """This tier's etcd (see tier_etcd); its log is kept next to the test's other logs."""
    with tier_etcd(tmp) as e:
        yield e


# Scenario 1's outputs without the plugin, for the runs with it.
baseline: dict = {}


def plugin_env(etcd, coordinator) -> dict:
    return {"ROOTRANK_ETCD_ENDPOINTS": etcd.url, "ROOTRANK_COORDINATOR": coordinator.url,
            "ROOTRANK_LEASE_TTL_MS": LEASE_TTL_MS,
            # The agents' own account (registrations, late keepalives) in the servers' logs.
            "ROOTRANK_LOG": "info"}


def greedy_outputs(stack: Stack) -> tuple[list, list]:
    """Each prompt once, one after the other: (output ids per prompt, seconds per request)."""
    ids, seconds = [], []
    for prompt in PROMPTS:
        r = generate(stack.router, prompt, 8)
        assert r["status"] == 200 and isinstance(r["body"], dict), f"{stack.name}: {r}\n{stack.tails()}"
        ids.append(r["body"]["output_ids"])
        seconds.append(r["seconds"])
    return ids, seconds


def live_ranks(etcd) -> dict:
    """(group, rank) -> RankLive, from etcd."""
    return {(v["group"], v["rank"]): v for k, v in etcd.get_prefix(PREFIX) if k.endswith("/live") and "/ranks/" in k}


def room_records(etcd) -> dict:
    """(group, room, rank) -> RoomFailure, from etcd."""
    out = {}
    for k, v in etcd.get_prefix(PREFIX):
        m = re.match(rf"{PREFIX}(.+)/rooms/(\d+)/ranks/(\d+)$", k)
        if m:
            out[(m.group(1), int(m.group(2)), int(m.group(3)))] = v
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def start(tmp: Path, name: str, env: dict, etcd=None, start_timeout_s: float = 420.0, **stack_args) -> tuple:
    """A deployment that came up: (stack, seconds until its first request was answered). Three
    SGLang servers on 2 shared cores sometimes do not come up (the first request never comes
    back, or a rank's lease runs out while they load: a false death, said in the output). That
    is the machine, before any scenario begins: the deployment is started once more, loudly.
    A second failure fails the test."""
    for attempt in (1, 2):
        stack = Stack(tmp, name if attempt == 1 else f"{name}-again", env, **stack_args)
        try:
            ready = stack.start(start_timeout_s)
            if etcd is not None:
                groups(etcd, name)  # every rank registered and live
            return stack, ready
        except AssertionError as e:
            stack.stop()
            if attempt == 2:
                raise
            first = str(e).splitlines()[0][:400]
            print(f"\n{name}: the deployment did not come up ({first}); starting it once more")
            time.sleep(int(LEASE_TTL_MS) / 1000 + 1)  # the first attempt's leases run out
    raise AssertionError("unreachable")


def test_1_plugin_off_baseline(tmp):
    """SGLang alone (ROOTRANK_ETCD_ENDPOINTS unset): the outputs scenario 1 compares with."""
    stack, ready = start(tmp, "off", {})
    try:
        ids, seconds = greedy_outputs(stack)
        assert "rootrank: SGLang" not in stack.log("prefill") + stack.log("decode")
        # Test 4's scenario, SGLang alone: the prefill keeps the rooms whose decode died before
        # asking for their KV (its bootstrap queue) for its bootstrap timeout (300 s).
        pid = decode_scheduler_pid(stack)
        _, _, held = freeze_then_kill_decode(stack, pid, watch_s=30)
        print(f"\nSGLang alone, decode scheduler frozen then SIGKILLed: prefill bootstrap queue {held}")
        assert held and held[-1][1] >= 3, f"the prefill no longer holds the rooms 30 s after the kill: {held}"
    finally:
        stack.stop()
    print(f"\nplugin off: ready in {ready:.1f} s; request latency {', '.join(f'{s:.2f}' for s in seconds)} s")
    baseline.update(ids=ids, seconds=seconds)


def groups(etcd, label: str) -> tuple[str, str, dict]:
    """The prefill and decode groups the plugin registered: (prefill, decode, live records)."""
    lives = live_ranks(etcd)
    prefill = {g for (g, r), v in lives.items() if v.get("role") == "prefill"}
    decode = {g for (g, r), v in lives.items() if v.get("role") == "decode"}
    assert len(prefill) == 1 and len(decode) == 1, f"{label}: groups in etcd: {sorted(lives)}"
    (pg,), (dg,) = prefill, decode
    assert sorted(r for (g, r) in lives if g == pg) == [0, 1] and sorted(r for (g, r) in lives if g == dg) == [0], lives
    return pg, dg, lives


def client_text(r: dict) -> str:
    body = r["body"] if isinstance(r["body"], str) else json.dumps(r["body"])
    return f"HTTP {r['status']} {body[:600]}"


def why(coordinator, room: int, group: str) -> subprocess.CompletedProcess:
    return subprocess.run([ROOTRANK_BIN, "why", str(room), "--group", group, "--coordinator", coordinator.url],
                          capture_output=True, text=True, timeout=30)


def kill_prefill_rank1(stack: Stack, etcd, coordinator, label: str, settle_s: float) -> None:
    """SIGKILLs prefill rank 1 while clients keep requests in flight, then checks what the
    clients got and what rootrank names for every failed room."""
    pg, dg, lives = groups(etcd, label)
    pid = lives[(pg, 1)]["pid"]
    # The live record's pid is the scheduler SGLang titles TP1 (this test runs in the host's pid namespace).
    assert "TP1" in cmdline(pid), f"{label}: pid {pid} of {pg} rank 1 is not the TP1 scheduler: {cmdline(pid)!r}"
    # Rooms failed before (scenario 3's) are not this kill's.
    known_rooms = {room for (_, room, _) in room_records(etcd)}

    results: list = []
    stop = threading.Event()

    def client(i: int) -> None:
        n = 0
        # Half the clients stream, as most clients of a serving router do.
        send = stream_generate if i % 2 else generate
        while not stop.is_set():
            results.append(send(stack.router, f"{PROMPTS[i % len(PROMPTS)]} {i}.{n}", 32, timeout=240))
            n += 1

    clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(6)]
    for t in clients:
        t.start()
    time.sleep(3.0)  # requests flowing: some decoding, some on the prefill
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)

    # Until every client has its answer and every failed room its verdict: when each thing
    # an operator sees happened, in seconds after the kill.
    seen: dict = {}
    verdicts: dict = {}
    while time.monotonic() - killed_at < settle_s:
        now = time.monotonic() - killed_at
        if now > 1.0:
            stop.set()  # a few requests reached the dead prefill; no more
        keys = etcd.get_prefix(PREFIX)
        for k, v in keys:
            if re.match(rf"{PREFIX}{re.escape(pg)}/ranks/\d+/down/", k):
                seen.setdefault(f"{pg} rank {v['rank']} down ({v['reason']})", now)
        recs = {key: v for key, v in room_records(etcd).items() if key[1] not in known_rooms}
        for (g, room, rank), rec in recs.items():
            seen.setdefault(f"first {'prefill' if g == pg else 'decode'} room record", now)
            if (g, room) not in verdicts:
                v = coordinator.verdict(room, g)
                if v.get("status") == "resolved":
                    verdicts[(g, room)] = v
                    seen.setdefault(f"first {'prefill' if g == pg else 'decode'} room's verdict resolved", now)
        rooms = {key[:2] for key in recs}
        if (stop.is_set() and not any(t.is_alive() for t in clients) and any(g == dg for g, _ in rooms)
                and rooms <= set(verdicts)):
            break
        time.sleep(0.5)
    assert not any(t.is_alive() for t in clients), f"{label}: a client still waits {settle_s} s after the kill"

    bad = [r for r in results if failed(r)]
    print(f"\n{label}: {len(results)} requests, {len(bad)} failed; prefill group {pg}, decode group {dg}")
    for r in bad[:3]:
        print(f"  client got {r['done_at'] - killed_at:+.1f} s after the kill: {client_text(r)}")
    assert bad, f"{label}: no request failed; the kill hit nothing in flight"
    # Each request in flight at the kill ended through rootrank (decode's fail fast, or the
    # prefill launcher ending its requests before SGLang's shutdown), not SGLang's own timeouts
    # or a dropped connection: its error says so.
    in_flight = [r for r in bad if r["done_at"] - r["seconds"] < killed_at]
    assert in_flight, f"{label}: no failed request was in flight at the kill"
    for r in in_flight:
        text = client_text(r)
        assert "rootrank" in text, f"{label}: a request in flight at the kill ended without rootrank: {text}"
        # Rank 0 died first (in gloo, a victim): its death never reads as the cause.
        assert f"{pg} rank 0 is down" not in text and f"{pg} rank 0 was killed" not in text, text
        if r.get("stream") and "shutting this server down" in text:
            # Ended by the dying prefill launcher: its streamed answer was held and the error
            # became its status, which a router retries (here retries are off: the client
            # gets the router's error with the prefill's words).
            assert r["status"] != 200, f"{label}: a streamed request the prefill ended came as a 200: {text}"
    streamed = [r for r in in_flight if r.get("stream")]
    print(f"  {len(streamed)} of them streamed: "
          + ", ".join(sorted({f"HTTP {r['status']}" for r in streamed})))
    named = sum(f"{pg} rank 1" in client_text(r) for r in in_flight)
    print(f"  {named} of {len(in_flight)} requests in flight at the kill got an error naming {pg} rank 1")
    for (g, room, rank), rec in sorted(recs.items()):
        print(f"  record {g} room {room} rank {rank}: {rec['origin']} {rec['reason']}: {rec.get('detail', '')[:120]}")
    assert any(g == dg for g, _ in rooms), f"{label}: no decode room record within {settle_s} s of the kill: {recs}"

    shown = set()
    for g, room in sorted(rooms):
        t0 = time.monotonic()
        w = why(coordinator, room, g)
        lines = w.stdout.strip().splitlines()
        print(f"  $ rootrank why {room} --group {g}   ({time.monotonic() - t0:.2f} s)\n    "
              + "\n    ".join(lines if g not in shown else [ln for ln in lines if "culprit:" in ln]))
        shown.add(g)
        v = verdicts.get((g, room))
        assert v, f"{label}: room {room} of {g} not resolved {settle_s} s after the kill: {coordinator.verdict(room, g)}"
        c = v["culprit"]
        assert (c["group"], c["rank"]) == (pg, 1), (
            f"{label}: room {room} of {g}: culprit {c['group']} rank {c['rank']}, expected {pg} rank 1\n"
            f"verdict: {json.dumps(v, indent=1)}")
        # The survivor died in gloo a moment after the kill: a victim, never the culprit.
        assert (pg, 0, "peer_lost") in [(x["group"], x["rank"], x["reason"]) for x in v["victims"]], v
        # A scheduler may send the request elsewhere, never to the dead prefill instance,
        # which it knows by the bootstrap port it was launched with.
        retry = v["retry"]
        assert retry["safe"] and [(a["group"], a["dead"]) for a in retry["avoid"]] == [(pg, True)], retry
        assert any(e.endswith(f":{stack.bootstrap_port}") for e in retry["avoid"][0]["endpoints"]), retry
        assert w.returncode == 0 and f"culprit: {pg} rank 1" in w.stdout, w.stdout + w.stderr
    errors_at = sorted(r["done_at"] - killed_at for r in bad)
    seen[f"client errors ({len(bad)})"] = errors_at[0]
    print(f"{label}, seconds after the kill: " + "; ".join(f"{k} {v:.1f}" for k, v in sorted(seen.items(), key=lambda kv: kv[1])))


def fail_prefill_rank1_polls(stack: Stack, etcd, coordinator, fail_file: Path) -> None:
    """Scenario 3: prefill rank 1 alone fails its polls (SGLang's own fault injection, turned
    on in that one scheduler by the test-only plugin); rank 0 sees only the all-reduced Failed."""
    pg, dg, _ = groups(etcd, "one rank's polls fail")
    fail_file.write_text("TP1")
    time.sleep(1.0)  # the test-only plugin looks every 0.2 s
    try:
        # The router answers with decode's response. SGLang alone: decode waits for the KV that
        # will not come (its waiting timeout, 300 s), and the client gives up first. With
        # rootrank's fail fast, decode fails the room once its verdict resolves, naming the rank.
        r = generate(stack.router, "fail on one rank", 8, timeout=60)
    finally:
        fail_file.unlink()
    time.sleep(1.0)
    print(f"\none rank's polls fail: the client got after {r['seconds']:.1f} s: {client_text(r)}")
    assert failed(r), f"the request did not fail: {r}"
    assert r["status"] is not None and f"{pg} rank 1" in client_text(r), (
        f"the client's error does not name {pg} rank 1: {client_text(r)}")
    # The room: the one both prefill ranks recorded (rank 1 first-hand, rank 0 its fallback);
    # SGLang's health checks (bootstrap room 0, a fake transfer) fail on rank 1 as well.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        recs = {k: v for k, v in room_records(etcd).items() if k[0] == pg}
        rooms = {room for (_, room, rank) in recs if room != 0 and (pg, room, 0) in recs and (pg, room, 1) in recs}
        if rooms:
            break
        time.sleep(0.5)
    for (g, room, rank), rec in sorted(recs.items()):
        print(f"  record {g} room {room} rank {rank}: {rec['origin']} {rec['reason']}: {rec.get('detail', '')[:160]}")
    assert len(rooms) == 1, f"expected one failed room recorded by both prefill ranks: {sorted(recs)}"
    (room,) = rooms
    assert recs[(pg, room, 1)]["origin"] == "local" and recs[(pg, room, 0)]["origin"] == "propagated", recs
    v = coordinator.verdict(room, pg, wait_ms=3000)
    w = why(coordinator, room, pg)
    print(f"  $ rootrank why {room} --group {pg}\n    " + "\n    ".join(w.stdout.strip().splitlines()))
    assert v["status"] == "resolved" and (v["culprit"]["group"], v["culprit"]["rank"]) == (pg, 1), v
    assert v["culprit"]["reason"] == "other" and v["culprit"]["source"] == "room_record", v
    assert w.returncode == 0 and f"culprit: {pg} rank 1" in w.stdout, w.stdout + w.stderr


def wait_until_records(etcd, group: str, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        recs = {k: v for k, v in room_records(etcd).items() if k[0] == group}
        if recs:
            return recs
        time.sleep(0.5)
    raise AssertionError(f"no room record of {group} within {timeout_s} s")


def test_2_plugin_on_same_outputs_and_sigkilled_prefill_rank_named(tmp, etcd, coordinator):
    """Scenario 1 with the plugin, then scenario 2 under SGLang's defaults (crash dumps on)."""
    assert baseline, "test_1_plugin_off_baseline must run first (same module) for the outputs to compare"
    stack, ready = start(tmp, "on", plugin_env(etcd, coordinator), etcd)
    try:
        assert "rootrank: SGLang 0.5.23 plugin active" in stack.log("prefill"), stack.tails()
        ids, seconds = greedy_outputs(stack)
        print(f"\nplugin on: ready in {ready:.1f} s; request latency {', '.join(f'{s:.2f}' for s in seconds)} s "
              f"(off: {', '.join(f'{s:.2f}' for s in baseline['seconds'])} s)")
        assert ids == baseline["ids"], f"greedy outputs differ with the plugin: {ids} vs {baseline['ids']}"
        # SGLang's launcher waits 5 s + 60 s for crash dumps before it kills the server: a
        # client still waiting 60 s after the kill waits for that (a request the dying server
        # took in and never answered); with the plugin every one ends within about a second.
        kill_prefill_rank1(stack, etcd, coordinator, "SGLang defaults", settle_s=60)
    finally:
        stack.stop()


def test_3_one_rank_fails_then_sigkilled_prefill_rank_named_crash_dumps_off(tmp, etcd, coordinator):
    """Scenario 3 (one prefill rank fails its polls), then scenario 2 with SGLang's crash dumps
    off: its launcher exits at once, decode learns in seconds."""
    fail_file = tmp / "fail-polls"
    stack, ready = start(tmp, "on-nodumps", {**plugin_env(etcd, coordinator), **CRASH_DUMPS_OFF,
                                             "ROOTRANK_TEST_FAIL_POLLS_FILE": str(fail_file)}, etcd)
    try:
        print(f"\nplugin on, crash dumps off: ready in {ready:.1f} s")
        fail_prefill_rank1_polls(stack, etcd, coordinator, fail_file)
        kill_prefill_rank1(stack, etcd, coordinator, "crash dumps off", settle_s=120)
    finally:
        stack.stop()


def test_4_prefill_rooms_waiting_on_a_killed_decode_end_at_once(tmp, etcd, coordinator):
    """The prefill's side of a decode death: decode's scheduler freezes (SIGSTOP: requests
    reach the prefill, whose rooms then wait in Bootstrapping for the KV indices decode never
    sends) and is then SIGKILLed. Nothing in the prefill ties such a room to a decode rank, and
    SGLang holds it for its bootstrap timeout (300 s). With rootrank, decode's launcher records
    the rooms it had in flight with the dead scheduler's certificate; each room's verdict names
    decode rank 0, and the prefill plugin fails the room through SGLang's status path.

    First, under load with both sides' fail fast following the events, ranks of other
    instances die and fail rooms: no room of this healthy deployment is failed."""
    stack, ready = start(tmp, "decode-dies", plugin_env(etcd, coordinator), etcd)
    try:
        print(f"\nplugin on: ready in {ready:.1f} s")
        pg, dg, lives = groups(etcd, "decode dies")
        no_false_fail_fast(stack, etcd, coordinator, tmp, pg, dg)
        pid = lives[(dg, 0)]["pid"]
        assert "scheduler" in cmdline(pid).lower() or "sglang" in cmdline(pid).lower(), cmdline(pid)
        known_rooms = {room for (_, room, _) in room_records(etcd)}
        results, killed_at, _ = freeze_then_kill_decode(stack, pid, watch_s=0)
        seen: dict = {}
        prefill_failed: dict = {}
        decode_rooms: set = set()
        while time.monotonic() - killed_at < 60:
            now = time.monotonic() - killed_at
            recs = {k: v for k, v in room_records(etcd).items() if k[1] not in known_rooms and k[1] != 0}
            for (g, room, rank), rec in recs.items():
                if g == dg and rec["origin"] == "propagated" and rec["reason"] == "process_exit":
                    decode_rooms.add(room)
                    seen.setdefault("decode launcher's room records", now)
                if g == pg and room not in prefill_failed and "rootrank fail-fast" in rec.get("detail", ""):
                    prefill_failed[room] = (now, rec)
                    seen.setdefault("first prefill room failed", now)
            if decode_rooms and decode_rooms <= set(prefill_failed) and all(r.get("done_at") for r in results):
                break
            time.sleep(0.2)
        for (g, room, rank), rec in sorted(recs.items()):
            print(f"  record {g} room {room} rank {rank}: {rec['origin']} {rec['reason']}: {rec.get('detail', '')[:160]}")
        assert len(decode_rooms) >= 3, f"decode's launcher recorded {len(decode_rooms)} rooms in flight, expected the 3 sent"
        assert decode_rooms <= set(prefill_failed), (
            f"prefill rooms still waiting 60 s after the kill: {sorted(decode_rooms - set(prefill_failed))}")
        for room in sorted(decode_rooms):
            at, rec = prefill_failed[room]
            assert rec["origin"] == "peer_reported" and rec["peer"]["group"] == dg, rec
            assert f"rootrank fail-fast: {dg} rank 0 failed room {room}: process_exit" in rec["detail"], rec
            v = coordinator.verdict(room, pg)
            c = v["culprit"] or {}
            assert v["status"] == "resolved" and (c["group"], c["rank"], c["reason"]) == (dg, 0, "process_exit"), v
        held = bootstrap_queue(stack)
        assert held == 0, f"the prefill's bootstrap queue still holds {held} request(s)"
        print("decode dies, seconds after the kill: " + "; ".join(
            f"{k} {v:.1f}" for k, v in sorted(seen.items(), key=lambda kv: kv[1]))
            + f"; prefill rooms failed {', '.join(f'{prefill_failed[r][0]:.1f}' for r in sorted(decode_rooms))}"
            + " (SGLang alone: its bootstrap timeout, 300 s)")
        for r in results:
            if r.get("done_at"):
                print(f"  client got {r['done_at'] - killed_at:+.1f} s after the kill: {client_text(r)}")
    finally:
        stack.stop()


BYSTANDER = """
import json, os, time, rootrank
a = rootrank.Agent(os.environ['G'], 0, 1, lease_ttl_ms=1000, role=os.environ['ROLE'],
                   nixl_agent=os.environ.get('NIXL') or None, endpoints=json.loads(os.environ['ENDPOINTS']))
a.wait_registered(20)
a.record_failure(int(os.environ['ROOM']), 'nixl_error', 'a bystander failed its own room', origin='local')
a.flush(10)
print('ready', flush=True)
time.sleep(600)
"""


def no_false_fail_fast(stack: Stack, etcd, coordinator, tmp: Path, pg: str, dg: str) -> None:
    """24 requests, 8 at a time, through the router while a decode rank and a prefill rank of
    other instances (their own NIXL agent, their own bootstrap address) fail rooms of their own
    and are SIGKILLed: every request succeeds and nothing of this deployment is failed."""
    bystanders = []
    for i, (role, nixl, endpoints) in enumerate((("decode", "bystander-nixl-agent", []),
                                                 ("prefill", "", ["127.0.0.1:9"]))):
        env = {"ROOTRANK_ETCD_ENDPOINTS": etcd.url, "G": f"{role}-bystander:9-dp0", "ROLE": role, "NIXL": nixl,
               "ENDPOINTS": json.dumps(endpoints), "ROOM": str(8_100_000_000_000_000_000 + i)}
        bystanders.append(spawn_python(BYSTANDER, env, tmp / f"bystander-{role}.log"))
    try:
        results: list = []

        def client(i: int) -> None:
            for n in range(3):
                results.append(generate(stack.router, f"{PROMPTS[i % len(PROMPTS)]} healthy {i}.{n}", 16, timeout=240))

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(8)]
        for t in threads:
            t.start()
        wait_until_text = time.monotonic() + 60
        while sum((tmp / f"bystander-{r}.log").read_text().count("ready") for r in ("decode", "prefill")) < 2:
            assert time.monotonic() < wait_until_text, "the bystanders never registered"
            time.sleep(0.2)
        time.sleep(2.0)
        for b in bystanders:
            b.kill()
        for t in threads:
            t.join(300)
    finally:
        for b in bystanders:
            b.kill()
            b.wait(10)
    bad = [r for r in results if failed(r)]
    assert len(results) == 24 and not bad, f"{len(bad)} of {len(results)} requests failed: {[client_text(r) for r in bad[:3]]}"
    for role in ("decode", "prefill"):
        g = f"{role}-bystander:9-dp0"
        assert wait_until_state(coordinator, g, "down"), f"{g} rank 0 never down"
    ours = {k: v for k, v in room_records(etcd).items() if k[0] in (pg, dg)}
    assert not ours, f"a healthy deployment's rooms were failed: {ours}"
    print(f"no false fail fast: 24 requests ok while two bystanders failed rooms and died "
          f"(p50 {sorted(r['seconds'] for r in results)[12]:.1f} s)")


def wait_until_state(coordinator, group: str, state: str, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if coordinator.rank_state(group, 0) == state:
            return True
        time.sleep(0.2)
    return False


def decode_scheduler_pid(stack: Stack) -> int:
    """The decode server's one scheduler process (SGLang titles it `sglang::scheduler...`)."""
    pids = [p for p in _group_pids(stack.procs["decode"].pid) if "scheduler" in cmdline(p)]
    assert len(pids) == 1, f"decode scheduler processes: {[(p, cmdline(p)) for p in pids]}"
    return pids[0]


def bootstrap_queue(stack: Stack) -> int | None:
    """How many requests the prefill holds in its bootstrap queue (waiting for decode to ask for
    their KV), from SGLang's own `/v1/loads`; None when it does not answer."""
    from server_kit import http

    try:
        status, body = http(f"{stack.prefill_url}/v1/loads?include=disagg", timeout=5)
    except Exception:
        return None
    if status != 200:
        return None

    def total(x) -> int:
        if isinstance(x, dict):
            return sum(v if k == "prefill_bootstrap_queue_reqs" and isinstance(v, int) else total(v)
                       for k, v in x.items())
        return sum(total(v) for v in x) if isinstance(x, list) else 0

    return total(body)


def freeze_then_kill_decode(stack: Stack, pid: int, watch_s: float) -> tuple:
    """Decode's scheduler SIGSTOPped, three requests sent (the prefill's rooms then wait in its
    bootstrap queue for the KV indices decode never sends), SIGKILL once the prefill's
    bootstrap queue holds the three. Returns (the
    requests' results, filled in as they come back; when the kill was; the prefill's bootstrap
    queue, as (seconds after the kill, requests) every 5 s for ``watch_s``)."""
    os.kill(pid, signal.SIGSTOP)
    results = run_in_background(stack, 3)
    deadline = time.monotonic() + 60
    while (bootstrap_queue(stack) or 0) < 3:  # the scenario's premise: the prefill holds them
        assert time.monotonic() < deadline, f"the prefill's bootstrap queue never held the 3 requests: {results}"
        time.sleep(0.2)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    held = []
    while time.monotonic() - killed_at < watch_s:
        time.sleep(5.0)
        held.append((round(time.monotonic() - killed_at), bootstrap_queue(stack)))
    return results, killed_at, held


def run_in_background(stack: Stack, n: int) -> list:
    """n requests sent at once on threads of their own; each result dict fills in when it
    comes back (``done_at`` set)."""
    results = [{} for _ in range(n)]

    def one(i: int) -> None:
        results[i].update(generate(stack.router, f"{PROMPTS[i % len(PROMPTS)]} decode dies {i}", 16, timeout=240))

    for i in range(n):
        threading.Thread(target=one, args=(i,), daemon=True).start()
    return results
