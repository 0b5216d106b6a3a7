"""`make demo-sglang`: rootrank inside a real SGLang PD server, told for people.

A real SGLang 0.5.23 deployment on this CPU-only machine (`python -m sglang.launch_server`:
prefill TP=2 and decode TP=1, KV over NIXL, sglang-router in front; server_kit.Stack, the same
deployment as the real-server tests) with the rootrank plugin from the wheel, a private etcd
and a coordinator. A request goes through; then prefill rank 1 is SIGKILLed, as the OOM killer
would, while six clients have requests in flight; the demo prints what the clients got, what
`rootrank why` says for every room that failed, and when each thing happened.

Run by scripts/demo-sglang.sh, which prepares the venv, the wheel and the tiny model. ~4 min
and ~5 GB of RAM here; every process it starts is ended by pid, also on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from conftest import ROOTRANK_BIN, Coordinator
from server_kit import generate
from test_server import kill_prefill_rank1, plugin_env, start, tier_etcd


def say(text: str) -> None:
    print(f"\n== {text}", flush=True)


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="rootrank-demo-sglang-"))
    stack = None
    try:
        # Ended in reverse order, also on Ctrl-C: the deployment, the coordinator, etcd.
        with contextlib.ExitStack() as running:
            say("A private etcd and `rootrank serve` on loopback")
            etcd = running.enter_context(tier_etcd(tmp))
            coordinator = Coordinator(etcd, tmp)
            running.callback(coordinator.kill)
            print(f"etcd {etcd.url}, coordinator {coordinator.url}")
            say("A real SGLang PD deployment: prefill TP=2 + decode TP=1 over NIXL, sglang-router in front, "
                "the rootrank plugin loaded by SGLang itself (SGLANG_PLUGINS entry point); ~2-3 min to load here")
            stack, ready = start(tmp, "demo", plugin_env(etcd, coordinator), etcd)
            running.callback(stack.stop)
            print(f"ready in {ready:.0f} s; router {stack.router}")
            for line in stack.log("prefill").splitlines():
                if "plugin active" in line:
                    print(line.strip()[:300])
                    break
            r = generate(stack.router, "Which rank really failed this request?", 8)
            print(f"a request through the router: HTTP {r['status']} in {r['seconds']:.1f} s, "
                  f"{len((r['body'] or {}).get('output_ids', []))} tokens")
            say("prefill rank 1 SIGKILLed (the OOM killer's way) while six clients have requests in flight")
            print("Without rootrank, the clients wait for SGLang's launcher: it gives CUDA 60 s to dump cores before "
                  "it exits, and decode notices only then (measured here: 65.6-74.4 s, an error naming no rank); "
                  "and the surviving prefill rank 0, which dies in gloo a moment after the kill, is the rank that "
                  "looks guilty (its traceback is the only one).")
            kill_prefill_rank1(stack, etcd, coordinator, "demo", settle_s=60.0)
            say("What an operator runs at 3 a.m.")
            out = subprocess.run([ROOTRANK_BIN, "status", "--coordinator", coordinator.url],
                                 capture_output=True, text=True, timeout=30)
            print("$ rootrank status\n" + out.stdout.rstrip())
            print("\nThe killed rank is the culprit of every failed room, in both groups; rank 0 is listed as a victim.")
            return 0
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except AssertionError as e:
        print(f"\ndemo-sglang: {e}", file=sys.stderr)
        if stack is not None:
            print(stack.tails(20), file=sys.stderr)
        return 1
    finally:
        if os.environ.get("ROOTRANK_DEMO_KEEP"):
            print(f"logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    print(f"\ndemo-sglang: {time.monotonic() - started:.0f} s", file=sys.stderr)
    sys.exit(code)
