"""SPEC section 5 (verdicts v2) end to end: real etcd, real coordinators, real rank processes."""

from __future__ import annotations

import json
import re
import signal
import urllib.request

import rootrank
from conftest import Coordinator, spawn_python, wait_until
from test_agent import RANK

G = "prefill-0"


def raw(url: str):
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def metric(coordinator: Coordinator, name: str) -> dict:
    _, _, body = raw(coordinator.url + "/metrics")
    out = {}
    for line in body.decode().splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit("} ", 1)
            out[labels] = float(value)
    return out


def test_a_death_then_a_later_local_record_the_first_answer_stands(etcd, coordinator, tmp):
    """Issue 9's report: rank 3 dies before the rooms' first records; the survivors are told
    rank 3; a few seconds later rank 1 records transfer_timeout for the same rooms. The
    verdict, /v1/failures and rootrank_root_causes_total keep saying rank 3."""
    victim = spawn_python(RANK, {"ROOTRANK_ETCD_ENDPOINTS": etcd.url, "G": G, "R": "3", "SIZE": "4", "LINGER": "60"}, tmp / "r3.log")
    wait_until(lambda: coordinator.rank_state(G, 3) == "live", 20, "rank 3 live")
    agents = {r: rootrank.Agent(G, r, 4, etcd_endpoints=etcd.url, lease_ttl_ms=1000) for r in (0, 1, 2)}
    for a in agents.values():
        assert a.wait_registered(10)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    wait_until(lambda: coordinator.rank_state(G, 3) == "down", 20, "rank 3 down")
    rooms = [8, 9, 10, 11]
    for room in rooms:
        for r in (0, 2):
            agents[r].record_failure(room, "other", "NIXL KVSender Exception", origin="propagated")
    told = {room: coordinator.verdict(room, G, wait_ms=10_000) for room in rooms}
    for v in told.values():
        assert v["status"] == "resolved" and v["culprit"]["rank"] == 3 and v["culprit"]["reason"] == "lease_expired", v
        assert "restart the group" in v["advice"]
    for room in rooms:
        agents[1].record_failure(room, "transfer_timeout", "Request timed out in KVPoll.WaitingForInput")
    assert agents[1].flush(10)
    # Wait until the coordinator has applied rank 1's records, then ask again.
    wait_until(lambda: all(len(coordinator.verdict(r, G)["evidence"]) >= 4 for r in rooms), 10, "rank 1's records applied")
    for room in rooms:
        v = coordinator.verdict(room, G)
        c, before = v["culprit"], told[room]["culprit"]
        assert (c["group"], c["rank"], c["incarnation"]) == (before["group"], before["rank"], before["incarnation"]), v
    failures = coordinator.http(f"/v1/failures?group={G}")[1]["failures"]
    assert sorted(int(f["room"]) for f in failures) == rooms
    assert {f["rank"] for f in failures} == {3}
    counted = metric(coordinator, "rootrank_root_causes_total")
    assert sum(v for k, v in counted.items() if 'rank="3"' in k) == len(rooms), counted
    assert not any('rank="1"' in k for k in counted), counted
    for a in agents.values():
        a.shutdown(5)


def test_replicas_answer_byte_for_byte_and_min_revision(etcd, coordinator, tmp):
    second = Coordinator(etcd, tmp)
    try:
        with rootrank.Agent(G, 0, 2, etcd_endpoints=etcd.url, lease_ttl_ms=1000) as a0, \
                rootrank.Agent(G, 1, 2, etcd_endpoints=etcd.url, lease_ttl_ms=1000) as a1:
            a0.record_failure(5, "other", "generic", origin="propagated")
            a1.record_failure(5, "oom_gpu", "CUDA out of memory", peer={"group": "decode-0", "rank": 1})
            a0.record_failure(6, "nixl_error", "NIXL transfer encountered ERR room=6")
            assert a0.flush(10) and a1.flush(10)
            # A scheduler that wrote through one replica reads its own writes from any other.
            rev = coordinator.verdict(5, G, wait_ms=5000)["revision"]
            paths = [f"/v1/rooms/5/verdict?group={G}&min_revision={rev}&wait_ms=5000",
                     f"/v1/rooms/6/verdict?min_revision={rev}&wait_ms=5000",
                     f"/v1/rooms/5/verdict?view=compact&min_revision={rev}&wait_ms=5000",
                     "/v1/failures", f"/v1/groups/{G}"]
            wait_until(lambda: raw(second.url + paths[0])[0] == 200, 10, "the second replica to catch up")
            for path in paths:
                a, b = raw(coordinator.url + path), raw(second.url + path)
                assert a[0] == b[0] == 200, (path, a, b)
                if "/groups/" not in path:  # a group view carries live 'since' times
                    assert a[2] == b[2], (path, a[2], b[2])
            compact = json.loads(raw(coordinator.url + paths[2])[2])
            # ~200 bytes in SPEC; the retry advice (docs/contract.md, "Retry advice") adds ~100.
            assert len(raw(coordinator.url + paths[2])[2]) <= 320
            assert compact["retry"]["safe"] and [a["group"] for a in compact["retry"]["avoid"]] == [G], compact
            assert compact["culprit"] == {"group": G, "rank": 1, "reason": "oom_gpu", "source": "room_record",
                                          "incarnation": a1.incarnation}
            # Beyond what etcd has: 503 behind, with Retry-After, after the wait.
            status, headers, body = raw(f"{second.url}/v1/rooms/5/verdict?min_revision={rev + 100000}&wait_ms=100")
            assert status == 503 and json.loads(body)["error"]["code"] == "behind"
            assert {k.lower(): v for k, v in headers.items()}.get("retry-after") == "1"
            # The Python client fails over on 503 behind to a replica that is current.
            status, _, body = raw(f"{second.url}/v1/rooms/5/verdict?view=bogus")
            assert status == 400 and json.loads(body)["error"]["code"] == "invalid_view"
    finally:
        second.kill()


def test_why_prints_cause_and_advice(etcd, coordinator):
    with rootrank.Agent("decode-0", 2, 4, etcd_endpoints=etcd.url, lease_ttl_ms=1000) as d2, \
            rootrank.Agent(G, 2, 4, etcd_endpoints=etcd.url, lease_ttl_ms=1000) as p2:
        d2.record_down("oom_host", "killed by the kernel OOM killer", log_tail=["Out of memory: Killed process 4242"])
        assert d2.flush(10)
        p2.record_failure(30, "nixl_error", "KVSender failed to post transfer: NIXL_ERR_REMOTE_DISCONNECT",
                          peer={"group": "decode-0", "rank": 2})
        assert p2.flush(10)
        v = coordinator.verdict(30, G, wait_ms=5000)
        assert v["cause"]["group"] == "decode-0" and v["cause"]["reason"] == "oom_host", v
        why = coordinator.why(30, G)
        assert why.returncode == 0, why.stderr
        assert re.search(r"cause: +decode-0 rank 2: oom_host", why.stdout), why.stdout
        assert "advice:" in why.stdout and "ran out of memory" in why.stdout, why.stdout
        assert "Out of memory: Killed process 4242" in why.stdout


def test_a_flood_of_long_polls_is_bounded_and_others_still_answered(etcd, tmp):
    """Past --max-long-polls waiters, a long poll gets 503 too_many_waiters with Retry-After at
    once; answers that do not wait, and the waiters themselves, are unaffected."""
    import threading
    import time

    c = Coordinator(etcd, tmp, "--max-long-polls", "8")
    try:
        results = []
        def wait(room):  # rooms nobody failed: each waits its whole 3 s
            results.append(raw(f"{c.url}/v1/rooms/{room}/verdict?wait_ms=3000")[0])
        waiters = [threading.Thread(target=wait, args=(1000 + i,)) for i in range(8)]
        for t in waiters:
            t.start()
        time.sleep(1.0)
        status, headers, body = raw(f"{c.url}/v1/rooms/77/verdict?wait_ms=3000")
        assert status == 503 and json.loads(body)["error"]["code"] == "too_many_waiters", body
        assert {k.lower(): v for k, v in headers.items()}["retry-after"] == "1"
        assert raw(f"{c.url}/v1/rooms/77/verdict")[0] == 200  # no wait: answered
        assert raw(f"{c.url}/healthz")[0] == 200
        for t in waiters:
            t.join()
        assert results == [200] * 8
        assert raw(f"{c.url}/v1/rooms/77/verdict?wait_ms=10")[0] == 200  # slots are given back
    finally:
        c.kill()
