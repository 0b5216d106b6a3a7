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
dumps before it exits, so decode learns late) and with its crash dumps off."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOTRANK_BIN
from server_kit import Stack, generate, run_concurrently

PROMPTS = ["The quick brown fox", "Which rank really failed this request?", "Prefill sends the KV cache",
           "Hello, world! Numbers: 0 1 2"]
PREFIX = "/rootrank/v1/groups/"
CRASH_DUMPS_OFF = {"SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0", "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0"}
# Survives a loaded 2-core machine: SGLang's idle schedulers busy-poll.
LEASE_TTL_MS = "4000"

# Scenario 1's outputs without the plugin, for the runs with it.
baseline: dict = {}


def plugin_env(etcd, coordinator) -> dict:
    return {"ROOTRANK_ETCD_ENDPOINTS": etcd.url, "ROOTRANK_COORDINATOR": coordinator.url,
            "ROOTRANK_LEASE_TTL_MS": LEASE_TTL_MS}


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
    return {(v["group"], v["rank"]): v for k, v in etcd.get_prefix(PREFIX) if k.endswith("/live")}


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


def test_1_plugin_off_baseline(tmp):
    """SGLang alone (ROOTRANK_ETCD_ENDPOINTS unset): the outputs scenario 1 compares with."""
    stack = Stack(tmp, "off", {})
    try:
        ready = stack.start()
        ids, seconds = greedy_outputs(stack)
        assert "rootrank: SGLang" not in stack.log("prefill") + stack.log("decode")
    finally:
        stack.stop()
    print(f"\nplugin off: ready in {ready:.1f} s; request latency {', '.join(f'{s:.2f}' for s in seconds)} s")
    baseline.update(ids=ids, seconds=seconds)


def kill_prefill_rank1(stack: Stack, etcd, coordinator, label: str, settle_s: float) -> None:
    """SIGKILLs prefill rank 1 while clients keep requests in flight, then checks what the
    clients got and what rootrank names for every failed room."""
    lives = live_ranks(etcd)
    prefill = {g for (g, r), v in lives.items() if v.get("role") == "prefill"}
    decode = {g for (g, r), v in lives.items() if v.get("role") == "decode"}
    assert len(prefill) == 1 and len(decode) == 1, f"{label}: groups in etcd: {sorted(lives)}"
    (pg,), (dg,) = prefill, decode
    assert sorted(r for (g, r) in lives if g == pg) == [0, 1] and sorted(r for (g, r) in lives if g == dg) == [0], lives
    pid = lives[(pg, 1)]["pid"]
    # The live record's pid is the scheduler SGLang titles TP1 (this test runs in the host's pid namespace).
    assert "TP1" in cmdline(pid), f"{label}: pid {pid} of {pg} rank 1 is not the TP1 scheduler: {cmdline(pid)!r}"

    results: list = []
    stop = threading.Event()

    def client(i: int) -> None:
        n = 0
        while not stop.is_set():
            results.append(generate(stack.router, f"{PROMPTS[i % len(PROMPTS)]} {i}.{n}", 32, timeout=240))
            n += 1

    clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
    for t in clients:
        t.start()
    time.sleep(3.0)  # requests flowing: some decoding, some queued on the prefill
    killed_at = time.monotonic()
    import os

    os.kill(pid, signal.SIGKILL)
    time.sleep(1.0)  # a few more requests reach the dead prefill
    stop.set()
    for t in clients:
        t.join(settle_s)
    assert not any(t.is_alive() for t in clients), f"{label}: a client still waits {settle_s} s after the kill"

    failed = [r for r in results if r["status"] != 200 or not isinstance(r["body"], dict)
              or r["body"].get("meta_info", {}).get("finish_reason", {}).get("type") == "abort"]
    print(f"\n{label}: {len(results)} requests, {len(failed)} failed; prefill group {pg}, decode group {dg}")
    for r in failed[:3]:
        print(f"  client got after {r['done_at'] - killed_at:+.1f} s (from the kill): HTTP {r['status']} "
              f"{json.dumps(r['body'])[:400] if not isinstance(r['body'], str) else r['body'][:400]}")
    assert failed, f"{label}: no request failed; the kill hit nothing in flight"

    # The rooms that failed, as the ranks recorded them; wait until decode's have landed.
    def decode_recorded():
        recs = room_records(etcd)
        return recs if any(g == dg for (g, _, _) in recs) else None

    deadline = time.monotonic() + settle_s
    recs = None
    while time.monotonic() < deadline and not (recs := decode_recorded()):
        time.sleep(0.5)
    assert recs, f"{label}: no decode room record within {settle_s} s of the kill; records: {room_records(etcd)}"
    decode_at = time.monotonic() - killed_at
    for (g, room, rank), rec in sorted(recs.items()):
        print(f"  record {g} room {room} rank {rank}: {rec['origin']} {rec['reason']}: {rec.get('detail', '')[:120]}")
    rooms = sorted({(g, room) for (g, room, _) in recs})

    first_resolved = None
    for g, room in rooms:
        t0 = time.monotonic()
        v = None
        while time.monotonic() - t0 < 30:
            v = coordinator.verdict(room, g, wait_ms=3000)
            if v.get("status") == "resolved":
                break
        resolved_at = time.monotonic() - killed_at
        first_resolved = first_resolved or resolved_at
        why = subprocess.run([ROOTRANK_BIN, "why", str(room), "--group", g, "--coordinator", coordinator.url],
                             capture_output=True, text=True, timeout=30)
        print(f"  rootrank why {room} --group {g}  (resolved {resolved_at:.1f} s after the kill):\n    "
              + "\n    ".join(why.stdout.strip().splitlines()))
        assert v and v.get("status") == "resolved", f"{label}: room {room} of {g} not resolved: {v}"
        c = v["culprit"]
        assert (c["group"], c["rank"]) == (pg, 1), (
            f"{label}: room {room} of {g}: culprit {c['group']} rank {c['rank']}, expected {pg} rank 1\n"
            f"verdict: {json.dumps(v, indent=1)}")
        assert why.returncode == 0 and f"{pg} rank 1" in why.stdout, why.stdout + why.stderr
        if g == pg:
            # The survivor died in gloo a moment after the kill: a victim, never the culprit.
            assert [(x["group"], x["rank"], x["reason"]) for x in v["victims"]] == [(pg, 0, "peer_lost")], v
    errors_at = sorted(r["done_at"] - killed_at for r in failed)
    print(f"{label}: kill -> first client error {errors_at[0]:+.1f} s, last {errors_at[-1]:+.1f} s; "
          f"-> decode records in etcd {decode_at:.1f} s; -> first verdict resolved {first_resolved:.1f} s")


def test_2_plugin_on_same_outputs_and_sigkilled_prefill_rank_named(tmp, etcd, coordinator):
    """Scenario 1 with the plugin, then scenario 2 under SGLang's defaults (crash dumps on)."""
    assert baseline, "test_1_plugin_off_baseline must run first (same module) for the outputs to compare"
    stack = Stack(tmp, "on", plugin_env(etcd, coordinator))
    try:
        ready = stack.start()
        assert "rootrank: SGLang 0.5.23 plugin active" in stack.log("prefill"), stack.tails()
        ids, seconds = greedy_outputs(stack)
        print(f"\nplugin on: ready in {ready:.1f} s; request latency {', '.join(f'{s:.2f}' for s in seconds)} s "
              f"(off: {', '.join(f'{s:.2f}' for s in baseline['seconds'])} s)")
        assert ids == baseline["ids"], f"greedy outputs differ with the plugin: {ids} vs {baseline['ids']}"
        # SGLang's launcher waits 5 s + 60 s for crash dumps before it exits; decode learns after.
        kill_prefill_rank1(stack, etcd, coordinator, "SGLang defaults", settle_s=180)
    finally:
        stack.stop()


def test_3_sigkilled_prefill_rank_named_crash_dumps_off(tmp, etcd, coordinator):
    """Scenario 2 with SGLang's crash dumps off: its launcher exits at once, decode learns in seconds."""
    stack = Stack(tmp, "on-nodumps", {**plugin_env(etcd, coordinator), **CRASH_DUMPS_OFF})
    try:
        ready = stack.start()
        print(f"\nplugin on, crash dumps off: ready in {ready:.1f} s")
        kill_prefill_rank1(stack, etcd, coordinator, "crash dumps off", settle_s=120)
    finally:
        stack.stop()
