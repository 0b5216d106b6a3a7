"""A real prefill-to-decode KV transfer through SGLang 0.5.23's own NIXL managers on the CPU,
with the decode rank killed mid-transfer (after it asked for the KV, before the prefill's
WRITE lands). One process per side:

    python sglang_transfer.py prefill --bootstrap-port B --room R --dir D --model-dir M
    python sglang_transfer.py decode  --bootstrap-port B --room R --dir D --model-dir M [--die|--stop]

The prefill side writes D/prefill.json: what its sender polled and raised, and when it
concluded. The decode side SIGKILLs itself right after SGLang's send_metadata when --die is
given (as the OOM killer would), SIGSTOPs itself there with --stop (a wedged or frozen
process, agent thread included: its lease runs out), else waits for the KV and writes
D/decode.json. With --wait-for-death the prefill sends (its NIXL WRITE) only once the test
says the decode is dead or stopped, and polls for at most --wait-s seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback

N_PAGES = 8


def setup(role: str, args):
    import sglang_kit

    return sglang_kit.scheduler_start(role, args.model_dir, args.bootstrap_port, port=args.port)


def kv_args_for(rank: int):
    import sglang_kit

    return sglang_kit.kv_args(rank, N_PAGES)


def write(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def wait_file(path: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.01)


def prefill(args) -> None:
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError
    from sglang.srt.disaggregation.nixl.conn import NixlKVBootstrapServer, NixlKVManager, NixlKVSender
    from sglang.srt.disaggregation.utils import DisaggregationMode

    server_args = setup("prefill", args)
    server = NixlKVBootstrapServer("127.0.0.1", args.bootstrap_port)
    kv_args, kv = kv_args_for(0)
    kv[:] = 7
    kv_mgr = NixlKVManager(kv_args, DisaggregationMode.PREFILL, server_args)
    rr = getattr(kv_mgr, "_rootrank_rank", None)
    out = {"group": rr.group if rr else None, "nixl_agent": kv_mgr.agent.name}
    write(os.path.join(args.dir, "prefill-ready.json"), out)
    sender = NixlKVSender(kv_mgr, f"127.0.0.1:{args.bootstrap_port}", args.room)
    sender.init(N_PAGES, 0)
    deadline = time.monotonic() + 120
    polls = []
    while time.monotonic() < deadline:  # decode asks for the KV: WaitingForInput
        p = int(sender.poll())
        if not polls or polls[-1] != p:
            polls.append(p)
        if p == int(KVPoll.WaitingForInput):
            break
        time.sleep(0.005)
    if args.wait_for_death:
        wait_file(os.path.join(args.dir, "decode-dead"))
    sender.send(np.arange(N_PAGES, dtype=np.int32))
    out["sent_at"] = time.time()
    deadline = time.monotonic() + args.wait_s
    while time.monotonic() < deadline:
        p = int(sender.poll())
        if polls[-1] != p:
            polls.append(p)
        if p in (int(KVPoll.Success), int(KVPoll.Failed)):
            break
        time.sleep(0.005)
    out["polls"] = polls
    out["concluded_at"] = time.time() if polls[-1] in (int(KVPoll.Success), int(KVPoll.Failed)) else None
    if polls[-1] == int(KVPoll.Failed):
        try:
            sender.failure_exception()
        except KVTransferError as e:
            out["raised"] = {"str": str(e), "is_from_another_rank": e.is_from_another_rank}
    if rr is not None:
        rr.agent.flush(10)
    write(os.path.join(args.dir, "prefill.json"), out)
    os._exit(0)


def decode(args) -> None:
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager, NixlKVReceiver
    from sglang.srt.disaggregation.utils import DisaggregationMode

    server_args = setup("decode", args)
    wait_file(os.path.join(args.dir, "prefill-ready.json"))
    kv_args, kv = kv_args_for(0)
    kv_mgr = NixlKVManager(kv_args, DisaggregationMode.DECODE, server_args)
    addr = f"127.0.0.1:{args.bootstrap_port}"
    deadline = time.monotonic() + 60
    while not kv_mgr.try_ensure_parallel_info(addr):
        if time.monotonic() > deadline:
            raise TimeoutError("prefill parallel info")
        time.sleep(0.05)
    receiver = NixlKVReceiver(kv_mgr, addr, args.room)
    receiver.init(0)
    rr = getattr(kv_mgr, "_rootrank_rank", None)
    if rr is not None:
        rr.agent.wait_registered(10)
    receiver.send_metadata(np.arange(N_PAGES, dtype=np.int32), 0)
    if args.die or args.stop:
        time.sleep(0.2)  # let the request reach the prefill
        write(os.path.join(args.dir, "decode-dying"), {"nixl_agent": kv_mgr.agent.name, "group": rr.group if rr else None})
        os.kill(os.getpid(), signal.SIGSTOP if args.stop else signal.SIGKILL)
    while time.monotonic() < deadline:
        p = int(receiver.poll())
        if p in (int(KVPoll.Success), int(KVPoll.Failed)):
            break
        time.sleep(0.005)
    write(os.path.join(args.dir, "decode.json"), {"poll": p, "kv_sum": int(kv.sum()), "group": rr.group if rr else None})
    os._exit(0)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["prefill", "decode"])
    ap.add_argument("--bootstrap-port", type=int, required=True)
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--room", type=int, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--die", action="store_true")
    ap.add_argument("--stop", action="store_true")
    ap.add_argument("--wait-s", type=float, default=120.0)
    ap.add_argument("--wait-for-death", action="store_true")
    a = ap.parse_args()
    try:
        (prefill if a.role == "prefill" else decode)(a)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(2)
