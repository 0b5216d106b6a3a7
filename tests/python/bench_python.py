"""What rootrank costs an SGLang scheduler (issue 8's benchmarks). `make bench-python` runs
it in the cached SGLang venv with a real etcd and a real coordinator (release build) and
prints a table; figures are compared with their reference in the same run (the machine is
shared: ratios, not absolutes).

1. `Agent.record_failure` from Python, per call, next to a plain dict assignment; v3
   `Agent.progress()` per call, and a wedge to `stalled` in /v1/groups (stall_after_ms=500).
2. The poll hook per scheduler iteration with 64 rooms in flight and nothing failing: SGLang's
   real `_poll_with_failure_injection` with and without the hook.
3. The fallback's added latency with 1 and with 500 rooms failing in one iteration, through
   SGLang's real `CommonKVSender.failure_exception`, with the culprit known (records in
   etcd) and unknown (the coordinator says pending): the budget is shared by the iteration.
4. v3 fail fast: prefill death -> decode receiver failed, p50/p99 over BENCH_KILLS (default 50)
   SIGKILLs of a prefill rank while decode waits for the room's KV, through SGLang's own NIXL
   managers (tests/python/sglang_pd.py, as test 13; lease TTL 1 s, no node-watch: the death is
   known when the lease runs out). SGLang alone waits SGLANG_DISAGGREGATION_WAITING_TIMEOUT
   (300 s by default) for the same room; it is quoted, not waited for 50 times.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import Coordinator, Etcd  # noqa: E402


def per_call_ns(fn, n: int) -> list:
    """Each call timed alone (perf_counter_ns), minus the timer's own cost."""
    t = time.perf_counter_ns
    empty = []
    for _ in range(2000):
        a = t()
        empty.append(t() - a)
    timer = statistics.median(empty)
    out = []
    gc.disable()
    try:
        for i in range(n):
            a = t()
            fn(i)
            out.append(t() - a - timer)
    finally:
        gc.enable()
    return out


def summary(xs: list) -> str:
    xs = sorted(xs)
    return f"mean {statistics.fmean(xs):.0f} ns, p50 {xs[len(xs) // 2]:.0f} ns, p99 {xs[int(len(xs) * 0.99)]:.0f} ns"


def bench_record_failure(etcd: Etcd, results: dict) -> None:
    import rootrank

    n = 20_000
    d = {}
    with rootrank.Agent("bench-py", 0, 1, etcd_endpoints=etcd.url, queue_capacity=100_000) as a:
        a.wait_registered(10)
        for _ in range(2):  # warm-up of both
            dict_ns = per_call_ns(lambda i: d.__setitem__(i, "KV transfer failed"), n)
            rec_ns = per_call_ns(lambda i: a.record_failure(i, "nixl_error", "KV transfer failed"), n)
        a.flush(120)
    results["record_failure"] = {"calls": n, "record_failure": summary(rec_ns), "dict_assignment": summary(dict_ns),
                                 "ratio_mean": round(statistics.fmean(rec_ns) / max(1.0, statistics.fmean(dict_ns)), 1)}


def bench_progress(etcd: Etcd, coordinator: Coordinator, results: dict) -> None:
    """v3 stalls: Agent.progress() per call (goal: under 100 ns), next to an empty Python
    call; and a wedge (the loop stops calling it) to `stalled` in /v1/groups, per trial."""
    import rootrank
    import urllib.request

    n = 200_000
    noop = lambda: None  # noqa: E731
    with rootrank.Agent("bench-progress", 0, 1, etcd_endpoints=etcd.url, stall_after_ms=500, lease_ttl_ms=2000) as a:
        a.wait_registered(10)
        for _ in range(2):
            t0 = time.perf_counter_ns()
            for _ in range(n):
                noop()
            empty = (time.perf_counter_ns() - t0) / n
            t0 = time.perf_counter_ns()
            for _ in range(n):
                a.progress()
            prog = (time.perf_counter_ns() - t0) / n
        lags = []
        for _ in range(10):
            end = time.monotonic() + 1.0
            while time.monotonic() < end:  # a loop that advances
                a.progress()
                time.sleep(0.001)
            wedged = time.monotonic()
            while True:
                with urllib.request.urlopen(coordinator.url + "/v1/groups/bench-progress", timeout=5) as r:
                    if json.loads(r.read())["ranks"][0]["state"] == "stalled":
                        break
                time.sleep(0.01)
            lags.append((time.monotonic() - wedged) * 1000)
            a.progress()  # resumes
            while True:
                with urllib.request.urlopen(coordinator.url + "/v1/groups/bench-progress", timeout=5) as r:
                    if json.loads(r.read())["ranks"][0]["state"] == "live":
                        break
                time.sleep(0.01)
    lags.sort()
    results["progress"] = {"calls": n, "progress_ns": round(prog, 1), "empty_python_call_ns": round(empty, 1),
                           "wedge_to_stalled_ms (stall_after_ms=500)": {
                               "trials": len(lags), "p50": round(lags[len(lags) // 2]), "max": round(lags[-1])}}


class _Poller:
    """Stands for a KV sender whose room is still transferring (KVPoll.Transferring)."""

    def poll(self):
        return 3


def bench_poll_hook(results: dict) -> None:
    import sglang.srt.disaggregation.utils as u

    hooked = u._poll_with_failure_injection
    original = hooked.__wrapped__
    pollers = [_Poller() for _ in range(64)]
    iters = 50_000
    rows = {}
    for name, fn in (("without hook", original), ("with hook", hooked)) * 2:
        gc.disable()
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            fn(pollers)
        rows[name] = (time.perf_counter_ns() - t0) / iters
        gc.enable()
    added = rows["with hook"] - rows["without hook"]
    results["poll_hook"] = {"rooms": 64, "iteration_without_ns": round(rows["without hook"]),
                            "iteration_with_ns": round(rows["with hook"]), "added_per_iteration_ns": round(added),
                            "added_per_room_ns": round(added / 64, 1)}


def bench_fallback(etcd: Etcd, coordinator: Coordinator, results: dict) -> None:
    import rootrank
    import rootrank.sglang as plugin
    from sglang.srt.disaggregation.common.conn import CommonKVSender, KVTransferError
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager
    from sglang.srt.disaggregation.utils import DisaggregationMode

    kv_mgr = NixlKVManager.__new__(NixlKVManager)
    kv_mgr.failure_records = {}
    kv_mgr.failure_lock = threading.Lock()
    kv_mgr.disaggregation_mode = DisaggregationMode.PREFILL
    kv_mgr.bootstrap_host, kv_mgr.bootstrap_port, kv_mgr.dist_init_addr = "10.1.0.1", 8998, None
    kv_mgr.attn_tp_rank, kv_mgr.attn_tp_size, kv_mgr.attn_dp_rank = 0, 8, 0
    plugin._plugin.on_kv_manager(kv_mgr)
    group = kv_mgr._rootrank_rank.group
    kv_mgr._rootrank_rank.agent.wait_registered(10)

    class _Trace:
        def trace_req_finish(self):
            pass

    def sender(room):
        s = CommonKVSender.__new__(CommonKVSender)
        s.kv_mgr, s.bootstrap_room, s.conclude_state, s.trace_ctx = kv_mgr, room, None, _Trace()
        s.clear = lambda: None
        return s

    hooked = CommonKVSender.failure_exception
    original = hooked.__wrapped__

    def iteration(rooms, fn) -> float:
        senders = [sender(r) for r in rooms]
        plugin._plugin.epoch += 1  # what the poll hook does at the start of an iteration
        t0 = time.perf_counter()
        for s in senders:
            try:
                fn(s)
            except KVTransferError:
                pass
        return (time.perf_counter() - t0) * 1000

    culprit = rootrank.Agent(group, 3, 8, etcd_endpoints=etcd.url)
    culprit.wait_registered(10)
    base = 10_000
    out = {"budget_ms": round(plugin._plugin.budget_s * 1000)}
    for n in (1, 500):
        known = list(range(base, base + n))
        base += n
        for r in known:
            culprit.record_failure(r, "nixl_error", f"NIXL transfer encountered ERR room={r}")
        culprit.flush(30)
        # "Known" means known at the coordinator: wait out the commit-to-visible lag.
        client = rootrank.Coordinator(coordinator.url)
        for r in (known[0], known[-1]):
            client.verdict(r, group=group, wait_ms=10_000)
        unknown = list(range(base, base + n))
        base += n
        sglang_alone = iteration(list(range(base, base + n)), original)
        base += n
        before = dict(plugin.stats())
        t_known = iteration(known, hooked)
        mid = dict(plugin.stats())
        t_unknown = iteration(unknown, hooked)
        after = dict(plugin.stats())
        out[f"{n}_rooms"] = {
            "sglang_alone_ms": round(sglang_alone, 2),
            "culprit_known_ms": round(t_known, 2),
            "named": mid["fallbacks_rewritten"] - before["fallbacks_rewritten"],
            "culprit_unknown_ms": round(t_unknown, 2),
            "pending": after["fallbacks_pending"] - mid["fallbacks_pending"],
        }
    culprit.shutdown(5)
    results["fallback"] = out


def bench_fail_fast(etcd: Etcd, coordinator: Coordinator, results: dict, kills: int) -> None:
    from test_sglang import run_pd, sglang_env, tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="rootrank-bench-ff-"))
    model = tiny_model(tmp)
    env = sglang_env(tmp, ROOTRANK_LEASE_TTL_MS="1000", ROOTRANK_ETCD_ENDPOINTS=etcd.url,
                     ROOTRANK_COORDINATOR=coordinator.url)
    seconds, skipped = [], 0
    for i in range(kills):
        run = tmp / f"kill{i}"
        run.mkdir()
        # The killed rank's instance lingers (as SGLang's launcher does for its crash dumps) long
        # enough that decode's own heartbeat cannot be what ends the wait.
        d, _, _, _ = run_pd(run, model, env, 6_917_529_027_641_000_000 + i, "--failing", "1", "--kill-failing",
                                "--linger", "12", "--wait-s", "20")
        killed = json.loads((d / "prefill1-killed.json").read_text())["at"] if (d / "prefill1-killed.json").exists() else None
        outs = [json.loads((d / f"decode{r}.json").read_text()) for r in (0, 1) if (d / f"decode{r}.json").exists()]
        if killed is None or len(outs) != 2 or any(o.get("polls") != [0] for o in outs):
            skipped += 1  # NIXL's loopback handshake failed before the room: not a fail-fast sample
            continue
        seconds += [o["concluded_at"] - killed for o in outs]
        took = ", ".join(f"{o['concluded_at'] - killed:.2f}" for o in outs)
        print(f"fail fast {i + 1}/{kills}: decode failed the room {took} s after the SIGKILL", flush=True)
    xs = sorted(seconds)
    results["fail_fast_prefill_death_to_decode_failed_s"] = {
        "kills": kills, "samples": len(xs), "skipped_runs": skipped,
        "p50": xs[len(xs) // 2] if xs else None, "p99": xs[min(len(xs) - 1, int(len(xs) * 0.99))] if xs else None,
        "max": xs[-1] if xs else None, "lease_ttl_ms": 1000,
        "sglang_alone_s": "SGLANG_DISAGGREGATION_WAITING_TIMEOUT (300 by default)"}


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="rootrank-bench-py-"))
    etcd = Etcd(tmp)
    coordinator = Coordinator(etcd, tmp)
    os.environ["ROOTRANK_ETCD_ENDPOINTS"] = etcd.url  # this benchmark process only, before any thread
    os.environ["ROOTRANK_COORDINATOR"] = coordinator.url
    try:
        from sglang.srt.plugins import load_plugins

        load_plugins()
        results: dict = {}
        bench_record_failure(etcd, results)
        bench_progress(etcd, coordinator, results)
        bench_poll_hook(results)
        bench_fallback(etcd, coordinator, results)
        kills = int(os.environ.get("BENCH_KILLS", "50"))
        if kills > 0:
            bench_fail_fast(etcd, coordinator, results, kills)
        print(json.dumps(results, indent=2))
        out = Path("bench-results")
        out.mkdir(exist_ok=True)
        (out / "python.json").write_text(json.dumps(results, indent=2))
    finally:
        coordinator.kill()
        etcd.kill()


if __name__ == "__main__":
    main()
