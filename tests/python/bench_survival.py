"""`make bench-survival` (issue 30): does a client request survive the death of one prefill
rank, behind the real sglang-router with two prefill instances? Side by side in one run, SGLang
alone and SGLang with the rootrank plugin, the same load and the same kill.

Each side: the real-server tier's deployment (server_kit.Stack) with a second prefill
instance: prefill A (TP=2), prefill B (TP=1), one decode (TP=1), sglang-router with its own
defaults (retries on, cache_aware). CLIENTS clients send REQUESTS greedy requests in all
(mixed prompt and output lengths, streamed unless BENCH_SURVIVAL_STREAM=0); once a third of
them are answered, prefill A's rank 1 scheduler is SIGKILLed, as the OOM killer does. Then
every request runs to its end.

Per side it prints: requests sent, succeeded, failed (with the text clients got), the worst
latency of a request in flight at the kill, how long after the kill prefill A answered its
last request (its access log, watched as it grows), what it answered after the kill, and the
decode rooms given up after the kill (decode's log) and when the last was. The last line:
`survival: F of N client requests failed (SGLang alone: F0 of N0)`. Results go to
bench-results/survival.json.

Env: BENCH_SURVIVAL_CLIENTS (8), BENCH_SURVIVAL_REQUESTS (240), BENCH_SURVIVAL_STREAM (1),
BENCH_SURVIVAL_SIDES (alone,rootrank), BENCH_SURVIVAL_ROUTER_ARGS (extra router flags, e.g.
"--health-check-interval-secs 1 --health-failure-threshold 1"), BENCH_SURVIVAL_KEEP=1 keeps
the servers' logs (the path is printed). 2 shared cores run four SGLang servers here: compare
the two sides of one run, not runs.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from conftest import REPO, Coordinator
from server_kit import Stack, _group_pids, failed, generate, stream_generate
from test_server import cmdline, plugin_env, start, tier_etcd

CLIENTS = int(os.environ.get("BENCH_SURVIVAL_CLIENTS", "8"))
REQUESTS = int(os.environ.get("BENCH_SURVIVAL_REQUESTS", "240"))
STREAM = os.environ.get("BENCH_SURVIVAL_STREAM", "1") != "0"
SIDES = [s for s in os.environ.get("BENCH_SURVIVAL_SIDES", "alone,rootrank").split(",") if s]
ROUTER_ARGS = tuple(shlex.split(os.environ.get("BENCH_SURVIVAL_ROUTER_ARGS", "")))
KEEP = os.environ.get("BENCH_SURVIVAL_KEEP", "0") == "1"
TIMEOUT_S = 400.0  # longer than anything SGLang waits on its own (300 s bootstrap timeout)
WORDS = "the rank that really failed sends its reason to etcd and every other rank reads it".split()
# What decode's log says when it gives up a room (SGLang 0.5.23's own words).
GAVE_UP = re.compile(r"Aborted by AbortReq|Lost connection with prefill|KVTransferError|Request .* timed out|"
                     r"bootstrap.*timed? ?out|Abort request", re.IGNORECASE)
ACCESS = re.compile(r'"POST /generate HTTP/1\.1" (\d{3})')


def request(i: int) -> tuple[str, int]:
    """Request i of the load: mixed prompt lengths (4 to 40 words) and output lengths."""
    words = [WORDS[(i * 7 + k) % len(WORDS)] for k in range(4 + (i * 11) % 37)]
    return f"Request {i}: " + " ".join(words), (4, 8, 16, 32)[i % 4]


def error_text(r: dict) -> str:
    body = r["body"]
    if isinstance(body, dict) and "error" in body:
        text = json.dumps(body["error"])
    elif isinstance(body, dict):
        text = str(((body.get("meta_info") or {}).get("finish_reason") or {}).get("message", json.dumps(body)))
    else:
        text = str(body)
    return f"HTTP {r['status']}: {text[:300]}"


def one(router: str, i: int) -> dict:
    prompt, tokens = request(i)
    r = (stream_generate if STREAM else generate)(router, prompt, tokens, timeout=TIMEOUT_S)
    r["ok"] = not failed(r)
    r["error"] = None if r["ok"] else error_text(r)
    r["i"] = i
    return r


class LogWatch(threading.Thread):
    """Follows a server's log as it grows and stamps each new line with this clock: SGLang's
    access log has no time of its own."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.lines, self.stop = path, [], threading.Event()

    def run(self) -> None:
        offset, rest = 0, b""
        while not self.stop.wait(0.1):
            try:
                with open(self.path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except OSError:
                continue
            offset += len(chunk)
            now = time.monotonic()
            *done, rest = (rest + chunk).split(b"\n")
            self.lines.extend((now, ln.decode("utf-8", "replace")) for ln in done)


def scheduler_pid(stack: Stack, what: str, title: str) -> int:
    pids = [p for p in _group_pids(stack.procs[what].pid) if title in cmdline(p) and "scheduler" in cmdline(p)]
    assert len(pids) == 1, f"{what} {title} scheduler processes: {[(p, cmdline(p)) for p in pids]}"
    return pids[0]


def side(tmp: Path, name: str, env: dict) -> dict:
    # The tier's start: once more when three SGLang servers on 2 cores do not come up.
    stack, ready = start(tmp, name, env, start_timeout_s=600.0, second_prefill=True, retries=True,
                         router_args=ROUTER_ARGS)
    try:
        victim = scheduler_pid(stack, "prefill", "TP1")
        watches = {w: LogWatch(stack.tmp / f"{stack.name}-{w}.log") for w in ("prefill", "decode")}
        for w in watches.values():
            w.start()
        time.sleep(0.5)
        results: list = []
        lock = threading.Lock()
        next_i = [0]
        killed: dict = {}

        def client() -> None:
            while True:
                with lock:
                    i = next_i[0]
                    next_i[0] += 1
                if i >= REQUESTS:
                    return
                r = one(stack.router, i)
                with lock:
                    results.append(r)
                    if "at" not in killed and len(results) >= REQUESTS // 3:
                        # As the OOM killer does: SIGKILL, mid-load, one rank of instance A.
                        killed["at"] = time.monotonic()
                        os.kill(victim, signal.SIGKILL)

        started = time.monotonic()
        threads = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S * (REQUESTS // CLIENTS + 2))
        wall = time.monotonic() - started
        time.sleep(2.0)  # the logs' last lines
        for w in watches.values():
            w.stop.set()
        return report(name, results, killed.get("at"), watches, ready, wall)
    finally:
        stack.stop()


def report(name: str, results: list, killed_at: float | None, watches: dict, ready: float, wall: float) -> dict:
    assert killed_at is not None, f"{name}: the kill never happened ({len(results)} answers)"
    failed = [r for r in results if not r["ok"]]
    in_flight = [r for r in results if r["done_at"] - r["seconds"] < killed_at < r["done_at"]]
    texts: dict = {}
    for r in failed:
        key = re.sub(r"\d{3,}", "N", r["error"] or "")[:160]
        texts[key] = texts.get(key, 0) + 1
    lat = sorted(r["seconds"] for r in results)
    a_after = [(t, ACCESS.search(ln).group(1)) for t, ln in watches["prefill"].lines
               if t >= killed_at and ACCESS.search(ln)]
    a_status: dict = {}
    for _, s in a_after:
        a_status[s] = a_status.get(s, 0) + 1
    # "Lost connection with prefill instance ..., 0 requests affected" gives up no room.
    gave_up = [(t, ln) for t, ln in watches["decode"].lines
               if t >= killed_at and GAVE_UP.search(ln) and ", 0 requests affected" not in ln]
    out = {
        "side": name, "ready_s": round(ready, 1), "wall_s": round(wall, 1),
        "sent": len(results), "succeeded": len(results) - len(failed), "failed": len(failed),
        "failed_texts": texts,
        "in_flight_at_kill": len(in_flight),
        "in_flight_failed": sum(not r["ok"] for r in in_flight),
        "worst_in_flight_s": round(max((r["seconds"] for r in in_flight), default=0.0), 1),
        "latency_p50_s": round(lat[len(lat) // 2], 1) if lat else None,
        "latency_max_s": round(lat[-1], 1) if lat else None,
        "prefill_a_answers_after_kill": a_status,
        "prefill_a_last_answer_after_kill_s": round(a_after[-1][0] - killed_at, 1) if a_after else None,
        "decode_rooms_given_up_after_kill": len(gave_up),
        "decode_last_given_up_after_kill_s": round(gave_up[-1][0] - killed_at, 1) if gave_up else None,
        "decode_given_up_lines": [ln[-200:] for _, ln in gave_up[:5]],
    }
    print(f"\n{name}: {out['sent']} sent, {out['succeeded']} succeeded, {out['failed']} failed "
          f"({out['in_flight_failed']} of the {out['in_flight_at_kill']} in flight at the kill)", flush=True)
    for text, n in sorted(texts.items(), key=lambda kv: -kv[1]):
        print(f"  {n} x {text}")
    print(f"  latency p50 {out['latency_p50_s']} s, max {out['latency_max_s']} s; worst of those in flight at "
          f"the kill {out['worst_in_flight_s']} s")
    print(f"  prefill A after the kill answered {a_status or 'nothing'}; its last answer "
          f"{out['prefill_a_last_answer_after_kill_s']} s after the kill")
    print(f"  decode gave up {len(gave_up)} room(s) after the kill; the last "
          f"{out['decode_last_given_up_after_kill_s']} s after it", flush=True)
    return out


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="rootrank-bench-survival-"))
    print(f"survival: {REQUESTS} requests, {CLIENTS} clients, {'streamed' if STREAM else 'not streamed'}, "
          f"router args {list(ROUTER_ARGS) or 'defaults'}; logs in {tmp}", flush=True)
    runs: dict = {}
    try:
        for name in SIDES:
            if name == "alone":
                runs[name] = side(tmp, name, {})
            elif name == "rootrank":
                with tier_etcd() as etcd:
                    coordinator = Coordinator(etcd, tmp)
                    try:
                        runs[name] = side(tmp, name, plugin_env(etcd, coordinator))
                    finally:
                        coordinator.kill()
            else:
                raise SystemExit(f"BENCH_SURVIVAL_SIDES: unknown side {name!r} (alone, rootrank)")
        path = REPO / "bench-results" / "survival.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({"clients": CLIENTS, "requests": REQUESTS, "stream": STREAM,
                                    "router_args": list(ROUTER_ARGS), "runs": runs}, indent=1) + "\n")
        print(f"\nwrote {path}")
        with_ = runs.get("rootrank")
        alone = runs.get("alone")
        line = "survival: "
        line += f"{with_['failed']} of {with_['sent']} client requests failed" if with_ else "rootrank side not run"
        line += f" (SGLang alone: {alone['failed']} of {alone['sent']})" if alone else " (SGLang alone: not run)"
        print(line, flush=True)
        return 0
    finally:
        if KEEP:
            print(f"logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
