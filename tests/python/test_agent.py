"""The Python API (SPEC section 9) against real etcd, real `rootrank serve` coordinators and
real Python rank processes."""

from __future__ import annotations

import math
import os
import signal
import time

import pytest

import rootrank
from rootrank._rootrank import certify_exited
from conftest import Coordinator, spawn_python, wait_until

RANK = """
import os, sys, time, ctypes, rootrank
a = rootrank.Agent(os.environ['G'], int(os.environ['R']), int(os.environ.get('SIZE', '2')), lease_ttl_ms=1000)
assert a.wait_registered(10) is not None
print('registered', a.incarnation, flush=True)
action = os.environ.get('ACTION', '')
if action.startswith('record:'):
    _, origin, room, delay = action.split(':')
    time.sleep(float(delay))
    a.record_failure(int(room), 'nixl_error' if origin == 'local' else 'other', 'from rank ' + os.environ['R'], origin=origin)
    assert a.flush(10)
    print('recorded', flush=True)
elif action == 'hold_gil':
    # PyDLL keeps the GIL for the whole C call: 4 s, four lease TTLs.
    print('holding', flush=True)
    ctypes.PyDLL(None).sleep(4)
    print('released', flush=True)
time.sleep(float(os.environ.get('LINGER', '30')))
"""


def test_local_record_wins_over_propagated(etcd, coordinator, tmp):
    env = {"ROOTRANK_ETCD_ENDPOINTS": etcd.url, "G": "py-local", "LINGER": "0"}
    room = 7_000_000_000_000_000_001
    survivor = spawn_python(RANK, {**env, "R": "0", "ACTION": f"record:propagated:{room}:0"}, tmp / "r0.log")
    culprit = spawn_python(RANK, {**env, "R": "1", "ACTION": f"record:local:{room}:0.3"}, tmp / "r1.log")
    assert survivor.wait(30) == 0 and culprit.wait(30) == 0, (tmp / "r0.log").read_text() + (tmp / "r1.log").read_text()
    v = wait_until(lambda: (v := coordinator.verdict(room, "py-local")) and v["status"] == "resolved" and v, 10, "verdict")
    assert v["culprit"]["rank"] == 1 and v["culprit"]["reason"] == "nixl_error" and v["culprit"]["source"] == "room_record"
    why = coordinator.why(room, "py-local")
    assert why.returncode == 0 and "rank 1" in why.stdout and "nixl_error" in why.stdout, why.stdout + why.stderr
    # Both ranks exited without shutdown(): dropping the agent never writes a clean exit.
    assert coordinator.rank_state("py-local", 0) in ("live", "down")


def test_sigkilled_rank_is_named_lease_expired_and_down(etcd, coordinator, tmp):
    env = {"ROOTRANK_ETCD_ENDPOINTS": etcd.url, "G": "py-kill", "LINGER": "60"}
    victim = spawn_python(RANK, {**env, "R": "1"}, tmp / "victim.log")
    wait_until(lambda: coordinator.rank_state("py-kill", 1) == "live", 20, "rank 1 live")
    with rootrank.Agent("py-kill", 0, 2, etcd_endpoints=etcd.url, lease_ttl_ms=1000) as survivor:
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        room = 42
        assert survivor.record_failure(room, "other", "NIXL KVSender Exception", origin="propagated")
        v = coordinator.verdict(room, "py-kill", wait_ms=10_000)
        assert v["status"] == "resolved", v
        assert v["culprit"]["rank"] == 1 and v["culprit"]["reason"] == "lease_expired", v
        assert v["retry"]["safe"] and [(a["group"], a["dead"]) for a in v["retry"]["avoid"]] == [("py-kill", True)], v
        compact = coordinator.http(f"/v1/rooms/{room}/verdict?group=py-kill&view=compact")[1]
        assert compact["retry"] == {"safe": True, "avoid": v["retry"]["avoid"]}, compact
        assert coordinator.rank_state("py-kill", 1) == "down"


def test_a_parent_certifies_its_killed_child_with_the_rooms_it_had_in_flight(etcd, coordinator, tmp):
    """What SGLang's launcher does for a scheduler killed by a signal (the plugin calls it):
    the certificate names the rank, and every room the parent had in flight becomes a
    propagated record whose verdict names it. Bad rooms change nothing."""
    env = {"ROOTRANK_ETCD_ENDPOINTS": etcd.url, "G": "py-exited", "SIZE": "1", "LINGER": "60"}
    child = spawn_python(RANK, {**env, "R": "0"}, tmp / "child.log")
    wait_until(lambda: coordinator.rank_state("py-exited", 0) == "live", 20, "rank 0 live")
    child.send_signal(signal.SIGKILL)
    child.wait()
    for bad in ([-1], [2 ** 63], [7, "8"]):
        with pytest.raises((ValueError, TypeError)):
            certify_exited(child.pid, signal=9, rooms=bad, etcd_endpoints=etcd.url)
    assert not [k for k, _ in etcd.get_prefix("/rootrank/v1/groups/py-exited/") if "/down/" in k or "/rooms/" in k]
    rooms = [11, 2 ** 63 - 1]
    certified = certify_exited(child.pid, signal=9, detail="the test's launcher saw it", rooms=rooms,
                                        etcd_endpoints=etcd.url)
    assert certified == [("py-exited", 0)]
    for room in rooms:
        (key, rec), = etcd.get_prefix(f"/rootrank/v1/groups/py-exited/rooms/{room}/ranks/")
        assert rec["origin"] == "propagated" and rec["reason"] == "process_exit", rec
        assert "the test's launcher saw it" in rec["detail"] and rec["incarnation"], rec
        v = coordinator.verdict(room, "py-exited", wait_ms=5000)
        c = v["culprit"] or {}
        assert v["status"] == "resolved" and (c["rank"], c["reason"], c["source"]) == (0, "process_exit",
                                                                                      "down_certificate"), v


def test_rank_holding_the_gil_for_three_ttls_stays_live(etcd, coordinator, tmp):
    env = {"ROOTRANK_ETCD_ENDPOINTS": etcd.url, "G": "py-gil", "R": "0", "ACTION": "hold_gil", "LINGER": "1"}
    log = tmp / "gil.log"
    p = spawn_python(RANK, env, log)
    wait_until(lambda: "holding" in log.read_text(), 20, "the GIL hold to start")
    states = []
    deadline = time.monotonic() + 3.5
    while time.monotonic() < deadline:
        states.append(coordinator.rank_state("py-gil", 0))
        time.sleep(0.1)
    assert "released" not in log.read_text().split("holding", 1)[0]
    # The coordinator may apply the registration a moment after the rank printed "holding"
    # (a loaded machine): until then it knows no such group. After that, live throughout.
    while states and states[0] is None:
        states.pop(0)
    assert len(states) >= 10 and all(s == "live" for s in states), states
    assert p.wait(30) == 0, log.read_text()
    assert not [k for k, _ in etcd.get_prefix("/rootrank/v1/groups/py-gil/ranks/0/down/")]


@pytest.mark.parametrize(
    "call",
    [
        lambda a: a.record_failure(-1, "nixl_error"),
        lambda a: a.record_failure(2**63, "nixl_error"),
        lambda a: a.record_failure("12", "nixl_error"),
        lambda a: a.record_failure(1, "Not A Reason"),
        lambda a: a.record_failure(1, ""),
        lambda a: a.record_failure(1, "nixl_error", origin="elsewhere"),
        lambda a: a.record_failure(1, "nixl_error", peer={"group": "bad/group"}),
        lambda a: a.record_failure(1, "nixl_error", peer={"rank": -3}),
        lambda a: a.record_failure(1, "nixl_error", peer={"host": "x"}),
        lambda a: a.record_down("NOPE"),
        lambda a: a.record_down("oom_host", log_tail=[1, 2]),
    ],
)
def test_bad_input_raises_value_error_and_writes_nothing(etcd, call):
    with rootrank.Agent("py-bad", 0, 1, etcd_endpoints=etcd.url, lease_ttl_ms=1000) as a:
        assert a.wait_registered(10)
        with pytest.raises(ValueError) as err:
            call(a)
        assert isinstance(err.value, rootrank.InvalidInput) and str(err.value)
        assert a.flush(10)
        assert etcd.get_prefix("/rootrank/v1/groups/py-bad/rooms/") == []
        assert etcd.get_prefix("/rootrank/v1/groups/py-bad/ranks/0/down/") == []


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(group="has space", rank=0, group_size=1),
        dict(group="g", rank=2, group_size=2),
        dict(group="g", rank=-1, group_size=2),
        dict(group="g", rank=0, group_size=5000),
        dict(group="g", rank=0, group_size=1, lease_ttl_ms=10),
        dict(group="g", rank=0, group_size=1, role="router"),
        dict(group="g", rank=0, group_size=1, prefix="no-slash"),
        dict(group="g", rank=0, group_size=1, etcd_endpoints=""),
    ],
)
def test_bad_config_raises_value_error(etcd, kwargs):
    kwargs.setdefault("etcd_endpoints", etcd.url)
    with pytest.raises(ValueError):
        rootrank.Agent(**kwargs)
    assert etcd.get_prefix("/rootrank/v1/") == []


def test_any_timeout_is_safe(etcd):
    a = rootrank.Agent("py-timeouts", 0, 1, etcd_endpoints=etcd.url, lease_ttl_ms=1000)
    assert a.wait_registered(1e12)
    for t in (1e12, math.inf, 1e300, -5.0, math.nan, 0.0):
        assert a.flush(t) in (True, False)
    assert a.shutdown(timeout_s=1e12) is True
    assert a.stopped
    assert a.shutdown(timeout_s=math.inf) is False  # the second stop is a no-op
    with pytest.raises(rootrank.AgentStopped):
        a.record_failure(1, "nixl_error")
    (key, down), = etcd.get_prefix("/rootrank/v1/groups/py-timeouts/ranks/0/down/")
    assert down["reason"] == "shutdown"


def test_etcd_restart_while_publishing_loses_nothing(etcd, tmp):
    rooms = list(range(1000, 1300))
    with rootrank.Agent("py-restart", 0, 1, etcd_endpoints=etcd.url, lease_ttl_ms=2000) as a:
        assert a.wait_registered(10)
        for room in rooms[:100]:
            assert a.record_failure(room, "nixl_error", f"room {room}")
        etcd.kill()
        for room in rooms[100:]:  # etcd is down: only enqueued
            assert a.record_failure(room, "nixl_error", f"room {room}")
        etcd.start()
        assert a.flush(60), "the queue did not drain after etcd came back"
        keys = etcd.get_prefix("/rootrank/v1/groups/py-restart/rooms/")
        written = sorted(int(v["room"]) for _, v in keys)
        assert written == rooms
        assert a.dropped == 0


def test_coordinator_client_fails_over_between_replicas(etcd, coordinator, tmp):
    second = Coordinator(etcd, tmp)
    try:
        with rootrank.Agent("py-failover", 0, 1, etcd_endpoints=etcd.url, lease_ttl_ms=1000) as a:
            a.record_failure(99, "ucx_error", "endpoint closed")
            assert a.flush(10)
            client = rootrank.Coordinator(f"{coordinator.url},{second.url}")
            assert client.verdict(99, group="py-failover", wait_ms=5000)["culprit"]["reason"] == "ucx_error"
            coordinator.kill()
            v = client.verdict(99, group="py-failover", wait_ms=5000)
            assert v["status"] == "resolved" and v["culprit"]["rank"] == 0
            assert {g["group"] for g in client.groups()} >= {"py-failover"}
            assert client.group("py-failover")["group_size"] == 1
            with pytest.raises(rootrank.NotFound):
                client.group("no-such-group")
            with pytest.raises(ValueError):
                client.verdict(-1)
            second.kill()
            with pytest.raises(rootrank.CoordinatorUnavailable):
                client.verdict(99, timeout_s=2)
    finally:
        second.kill()


def test_coordinator_client_survives_the_server_closing_an_idle_connection(etcd, tmp):
    # The coordinator ends kept-alive connections idle for longer than --header-timeout-ms;
    # one replica only, so a failed reuse cannot hide behind a failover.
    server = Coordinator(etcd, tmp, "--header-timeout-ms", "300")
    try:
        client = rootrank.Coordinator(server.url)
        assert client.groups() is not None
        time.sleep(1.0)  # the server has closed the idle connection by now
        assert client.groups() is not None
        assert client.verdict(12345, timeout_s=5)["room"] == "12345"
    finally:
        server.kill()


def test_coordinator_client_fails_over_a_replica_killed_mid_long_poll(etcd, coordinator, tmp):
    import threading
    second = Coordinator(etcd, tmp)
    try:
        with rootrank.Agent("py-midpoll", 0, 1, etcd_endpoints=etcd.url, lease_ttl_ms=30000) as a:
            assert a.wait_registered(10)
            client = rootrank.Coordinator([coordinator.url, second.url])
            answer = {}
            asking = threading.Thread(
                target=lambda: answer.update(client.verdict(4711, group="py-midpoll", wait_ms=20000, timeout_s=30)))
            asking.start()
            time.sleep(1.0)  # the long poll waits on the first replica
            coordinator.kill()
            a.record_failure(4711, "transfer_timeout", "no notification in 30 s")
            asking.join(35)
            assert answer.get("status") == "resolved", answer
            assert answer["culprit"]["reason"] == "transfer_timeout"
    finally:
        second.kill()


def test_imports_without_torch_or_sglang():
    import subprocess
    import sys

    code = "import sys, rootrank, rootrank.sglang; assert 'torch' not in sys.modules and 'sglang' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], env={k: v for k, v in os.environ.items() if k != "ROOTRANK_ETCD_ENDPOINTS"}).returncode == 0


def test_a_record_etcd_rejects_is_dropped_and_the_queue_moves_on(tmp):
    from conftest import Etcd

    small = Etcd(tmp, "--max-request-bytes", "3000")  # a 4 KiB detail is over etcd's limit
    try:
        with rootrank.Agent("py-reject", 0, 1, etcd_endpoints=small.url, lease_ttl_ms=1000) as a:
            assert a.wait_registered(10)
            assert a.record_failure(1, "nixl_error", "x" * 4000)
            assert a.record_failure(2, "nixl_error", "fits")
            assert a.flush(20), "a rejected record blocked the queue"
            assert a.rejected == 1
            rooms = [int(v["room"]) for _, v in small.get_prefix("/rootrank/v1/groups/py-reject/rooms/")]
            assert rooms == [2]
    finally:
        small.kill()
