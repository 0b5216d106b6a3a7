"""A prefill instance and a decode instance of SGLang 0.5.23, TP=N each, one process per rank,
each side with its own real gloo group, a real KV transfer of one room through SGLang's own
NIXL managers, and one prefill rank whose transfer fails:

    python sglang_pd.py prefill|decode --rank R --world N --gloo-port P --bootstrap-port B \
        --room ROOM --failing K --dir D --model-dir M [--port SERVING_PORT]

With ``--kill-failing`` prefill rank K is SIGKILLed instead, once decode waits for the KV (the
no-request-waits scenario): the other prefill ranks keep the instance's bootstrap server up
for ``--linger`` seconds, as SGLang's launcher does while it waits 60 s for crash dumps, so
decode's own heartbeat sees nothing wrong; decode waits at most ``--wait-s`` for the room.

Prefill rank K concludes the room failed with the call SGLang's NIXL transfer worker makes
when a WRITE fails (``conclude_failure(bootstrap_room, failure_reason=str(e))``, nixl/conn.py);
from there everything is SGLang's own: the status message to its decode peer over ZMQ, the
decode listener's ``apply_prefill_status``, both sides' per-iteration ``poll_and_all_reduce``
and ``failure_exception``. Prefill rank r pairs with decode rank r (equal TP), so only decode
rank K is told; the other decode ranks fail the room through the all-reduce and raise
SGLang's generic fallback. Each rank writes D/{role}{R}.json with what it raised.
"""

from __future__ import annotations

import argparse
import json
import os
import time

N_PAGES = 8


def write(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def wait_files(paths, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(paths)
        time.sleep(0.02)


def raised_by(obj) -> dict:
    from sglang.srt.disaggregation.common.conn import KVTransferError

    try:
        obj.failure_exception()
    except KVTransferError as e:
        return {"str": str(e), "is_from_another_rank": e.is_from_another_rank}
    return {}


def until_concluded(poller, group, wait_s: float = 120) -> list:
    """SGLang's scheduler loop for one room: poll and MIN-reduce every iteration until the
    room concludes (every rank leaves in the same iteration)."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import poll_and_all_reduce

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        polls = poll_and_all_reduce([poller], group)
        if polls[0] in (int(KVPoll.Success), int(KVPoll.Failed)):
            return polls
        time.sleep(0.005)
    raise TimeoutError("the room never concluded")


def main(a) -> None:
    import numpy as np
    import sglang_kit
    import torch.distributed as dist
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.nixl.conn import (NixlKVBootstrapServer, NixlKVManager, NixlKVReceiver,
                                                     NixlKVSender)
    from sglang.srt.disaggregation.utils import DisaggregationMode

    server_args = sglang_kit.scheduler_start(a.role, a.model_dir, a.bootstrap_port, world_rank=a.rank,
                                             tp_size=a.world, port=a.port)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.gloo_port}", rank=a.rank, world_size=a.world)
    group = dist.new_group(list(range(a.world)), backend="gloo")
    kv_args, kv = sglang_kit.kv_args(a.rank, N_PAGES, total_kv_heads=a.world)
    addr = f"127.0.0.1:{a.bootstrap_port}"
    me = os.path.join(a.dir, f"{a.role}{a.rank}")
    out: dict = {"rank": a.rank}
    if a.role == "prefill":
        server = NixlKVBootstrapServer("127.0.0.1", a.bootstrap_port) if a.rank == 0 else None
        dist.barrier(group=group)
        kv[:] = 7
        kv_mgr = NixlKVManager(kv_args, DisaggregationMode.PREFILL, server_args)
        rr = getattr(kv_mgr, "_rootrank_rank", None)
        out.update(group=rr.group if rr else None, incarnation=rr.agent.wait_registered(10) if rr else None)
        write(me + "-ready.json", out)
        sender = NixlKVSender(kv_mgr, addr, a.room)
        sender.init(N_PAGES, 0)
        deadline = time.monotonic() + 120
        while int(sender.poll()) != int(KVPoll.WaitingForInput):  # decode asked for the KV
            if time.monotonic() > deadline:
                raise TimeoutError("decode never asked")
            time.sleep(0.005)
        if a.rank == a.failing and a.kill_failing:
            write(me + "-killed.json", {"at": time.time()})
            os.kill(os.getpid(), 9)
        if a.kill_failing:
            # The instance is dead with its rank; its launcher keeps the bootstrap server up.
            time.sleep(a.linger)
            os._exit(0)
        if a.rank == a.failing:
            kv_mgr.conclude_failure(bootstrap_room=a.room, failure_reason=f"NIXL transfer encountered ERR room={a.room}")
        else:
            sender.send(np.arange(N_PAGES, dtype=np.int32))
        out["polls"] = until_concluded(sender, group)
        if out["polls"][0] == int(KVPoll.Failed):
            out["raised"] = raised_by(sender)
        poller_mgr = kv_mgr
    else:
        dist.barrier(group=group)
        wait_files([os.path.join(a.dir, f"prefill{r}-ready.json") for r in range(a.world)])
        kv_mgr = NixlKVManager(kv_args, DisaggregationMode.DECODE, server_args)
        deadline = time.monotonic() + 60
        while not kv_mgr.try_ensure_parallel_info(addr):
            if time.monotonic() > deadline:
                raise TimeoutError("prefill parallel info")
            time.sleep(0.05)
        rr = getattr(kv_mgr, "_rootrank_rank", None)
        out.update(group=rr.group if rr else None, incarnation=rr.agent.wait_registered(10) if rr else None)
        receiver = NixlKVReceiver(kv_mgr, addr, a.room)
        receiver.init(0)
        receiver.send_metadata(np.arange(N_PAGES, dtype=np.int32), 0)
        out["polls"] = until_concluded(receiver, group, a.wait_s)
        out["concluded_at"] = time.time()
        if out["polls"][0] == int(KVPoll.Failed):
            out["raised"] = raised_by(receiver)
        poller_mgr = kv_mgr
    try:
        import rootrank.sglang as plugin

        out["plugin_stats"] = plugin.stats()
        rr = getattr(poller_mgr, "_rootrank_rank", None)
        if rr is not None:
            rr.agent.flush(10)
        if plugin._plugin is not None:
            # A culprit not known within the budget is logged as soon as it resolves.
            plugin._plugin.wait_followed(30)
    except ImportError:
        pass
    write(me + ".json", out)
    dist.barrier(group=group)
    if a.kill_failing and rr is not None:
        # A decode instance lives on after a failed room: its ranks must not read as deaths
        # around the room (they would be candidates of their group, rule 1).
        rr.agent.shutdown(5)
    os._exit(0)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["prefill", "decode"])
    for name in ("rank", "world", "gloo-port", "bootstrap-port", "room", "failing"):
        ap.add_argument(f"--{name}", type=int, required=True)
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--kill-failing", action="store_true")
    ap.add_argument("--linger", type=float, default=60.0)
    ap.add_argument("--wait-s", type=float, default=120.0)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--model-dir", required=True)
    import sglang_kit

    sglang_kit.run_script(main, ap)
