"""SGLang 0.5.23's launcher side of a scheduler's death: a parent process with the plugin
loaded (``load_plugins()``, as ``launch_server`` does) spawns two rank processes and watches
them with SGLang's own ``SubprocessWatchdog``; when one is found dead the watchdog SIGQUITs
the parent, whose handler kills the other at once (what ``kill_process_tree`` does when
SGLang's crash dumps are off):

    python sglang_launcher.py --dir D --group G --room ROOM

Each rank registers a rootrank agent under G; rank 0 records ROOM as a victim sees it
(``propagated``). Rank 0's lease (1 s) is shorter than rank 1's (5 s), so when both die
uncertified within a second rank 0's lease expires first every time (with equal leases, at
random). Writes D/ready.json (both pids) once both registered; the test SIGKILLs rank 1.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import time


def write(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def rank_main(rank: int, group: str, room: int, out: str) -> None:
    import rootrank

    agent = rootrank.Agent(group, rank, 2, lease_ttl_ms=1000 if rank == 0 else 5000)
    incarnation = agent.wait_registered(20)
    if rank == 0:
        agent.record_failure(room, "other", "Failed due to an unknown reason from another rank", origin="propagated")
        agent.flush(10)
    write(out, {"rank": rank, "pid": os.getpid(), "incarnation": incarnation})
    while True:
        time.sleep(1)


def main(a) -> None:
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.utils.watchdog import SubprocessWatchdog

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, a.group, a.room, os.path.join(a.dir, f"rank{r}.json")))
             for r in range(2)]
    for p in procs:
        p.start()

    def on_sigquit(*_):
        # SGLang's cleanup with crash dumps off: the surviving scheduler is killed at once.
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
        write(os.path.join(a.dir, "sigquit.json"), {"at": time.time()})
        sys.stdout.flush()
        os._exit(0)

    signal.signal(signal.SIGQUIT, on_sigquit)
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(a.dir, f"rank{r}.json")) for r in range(2)):
        if time.monotonic() > deadline:
            raise TimeoutError("the ranks never registered")
        time.sleep(0.05)
    SubprocessWatchdog(procs, [f"scheduler_{r}" for r in range(2)], interval=0.2).start()
    write(os.path.join(a.dir, "ready.json"), {"pids": [p.pid for p in procs]})
    time.sleep(120)
    raise TimeoutError("nothing died")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--room", type=int, required=True)
    import sglang_kit

    sglang_kit.run_script(main, ap)
