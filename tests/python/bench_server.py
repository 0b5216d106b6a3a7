"""`make bench-server`: request latency and throughput through sglang-router with the rootrank
plugin off and on, side by side in one run, on the real SGLang PD deployment of the
real-server tier (server_kit.Stack: prefill TP=2 + decode TP=1 over NIXL, the tiny model).

Each side: the deployment starts, one warm-up request, then CLIENTS clients send greedy
requests (MAX_NEW_TOKENS tokens each) back to back for SECONDS; completed requests per second
and the latency distribution are reported, and written to bench-results/server.json. The
machine is 2 shared cores with three SGLang servers on them: compare the two sides of one run,
not runs. Env: BENCH_SECONDS (default 60), BENCH_CLIENTS (4), BENCH_TOKENS (16).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from conftest import REPO, Coordinator
from server_kit import generate
from test_server import plugin_env, start, tier_etcd

SECONDS = float(os.environ.get("BENCH_SECONDS", "60"))
CLIENTS = int(os.environ.get("BENCH_CLIENTS", "4"))
TOKENS = int(os.environ.get("BENCH_TOKENS", "16"))


def load(router: str) -> dict:
    done: list = []
    failed = [0]
    stop_at = time.monotonic() + SECONDS

    def client(i: int) -> None:
        n = 0
        while time.monotonic() < stop_at:
            r = generate(router, f"Which rank really failed request {i}.{n}?", TOKENS, timeout=120)
            n += 1
            if r["status"] == 200 and isinstance(r["body"], dict):
                done.append(r["seconds"])
            else:
                failed[0] += 1

    started = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SECONDS + 180)
    wall = time.monotonic() - started
    done.sort()
    pct = lambda q: done[min(len(done) - 1, int(q * len(done)))] if done else float("nan")  # noqa: E731
    return {"requests": len(done), "failed": failed[0], "wall_s": round(wall, 1),
            "requests_per_s": round(len(done) / wall, 3), "latency_p50_s": round(pct(0.5), 3),
            "latency_p99_s": round(pct(0.99), 3), "latency_mean_s": round(statistics.fmean(done), 3) if done else None}


def side(tmp: Path, name: str, env: dict, etcd=None) -> dict:
    stack, ready = start(tmp, name, env, etcd)
    try:
        result = load(stack.router)
        result["ready_s"] = round(ready, 1)
        return result
    finally:
        stack.stop()


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="rootrank-bench-server-"))
    try:
        off = side(tmp, "off", {})
        print(f"plugin off: {off}", flush=True)
        with tier_etcd() as etcd:
            coordinator = Coordinator(etcd, tmp)
            try:
                on = side(tmp, "on", plugin_env(etcd, coordinator), etcd)
            finally:
                coordinator.kill()
        print(f"plugin on:  {on}", flush=True)
        out = {"clients": CLIENTS, "seconds": SECONDS, "max_new_tokens": TOKENS, "off": off, "on": on,
               "on_over_off_requests_per_s": round(on["requests_per_s"] / off["requests_per_s"], 3)
               if off["requests_per_s"] else None}
        path = REPO / "bench-results" / "server.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(f"\n| plugin | requests/s | p50 s | p99 s | failed |\n|---|---|---|---|---|\n"
              f"| off | {off['requests_per_s']} | {off['latency_p50_s']} | {off['latency_p99_s']} | {off['failed']} |\n"
              f"| on | {on['requests_per_s']} | {on['latency_p50_s']} | {on['latency_p99_s']} | {on['failed']} |\n"
              f"\nwrote {path}")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
