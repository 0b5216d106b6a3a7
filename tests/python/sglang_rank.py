"""One SGLang prefill TP rank, started the way SGLang starts a scheduler, running SGLang's
own disaggregation code on the CPU (see ../shared/SGLANG-FACTS.md, "Running the real SGLang
code on a CPU-only machine").

    python sglang_rank.py --rank R --world N --gloo-port P --bootstrap-port B \
        --scenario NAME --room ROOM --out FILE

It calls SGLang's ``load_plugins()`` first (so the rootrank plugin is found through the
installed wheel's entry point metadata, exactly as ``run_scheduler_process`` does), publishes
the runtime context, joins a real gloo group on loopback, builds a real ``NixlKVManager`` and
``NixlKVSender``, and then runs the scenario through SGLang's real ``poll_and_all_reduce`` and
``failure_exception``. What the rank raised is written to ``--out`` as JSON.

Scenarios (``--culprit`` names the failing rank):
- ``record``: the culprit's reason enters through the real ``CommonKVManager.record_failure``.
- ``conclude``: the same through ``conclude_failure`` (the ``setdefault`` path).
- ``inject``: the culprit's own poll returns Failed with no reason (SGLang's fault injection,
  ``SGLANG_TEST_DISAGG_FAILURE_PROB=1`` set on that rank only).
- ``fatal``: the culprit dies in SGLang's real ``run_scheduler_process`` with an exception
  (its parent, like SGLang's launcher, receives the SIGQUIT).
- ``abort``: a client abort, on every rank, through SGLang's own ``NixlKVSender.abort()``
  (what the scheduler calls for an ``AbortReq``): no failure, so nothing to publish.
- ``none``: nobody fails on purpose; every rank records itself (for the plugin-off checks).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--gloo-port", type=int, required=True)
    ap.add_argument("--bootstrap-port", type=int, required=True)
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--culprit", type=int, default=1)
    ap.add_argument("--room", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model-dir", required=True)
    args = ap.parse_args()
    if args.scenario == "inject" and args.rank == args.culprit:
        # Read by SGLang on every poll (envs.SGLANG_TEST_DISAGG_FAILURE_PROB); set before
        # any thread exists, in this test process only.
        os.environ["SGLANG_TEST_DISAGG_FAILURE_PROB"] = "1"

    t0 = time.monotonic()
    out_dir = os.path.dirname(os.path.abspath(args.out))
    with open(os.path.join(out_dir, f"pid{args.rank}"), "w") as f:
        f.write(str(os.getpid()))
    # Exactly as run_scheduler_process: plugins first (sglang_kit.scheduler_start).
    import sglang_kit

    server_args = sglang_kit.scheduler_start("prefill", args.model_dir, args.bootstrap_port,
                                             world_rank=args.rank, tp_size=args.world)
    import torch.distributed as dist
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError
    from sglang.srt.disaggregation.nixl.conn import NixlKVBootstrapServer, NixlKVManager, NixlKVSender
    from sglang.srt.disaggregation.utils import DisaggregationMode, poll_and_all_reduce

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.gloo_port}", rank=args.rank, world_size=args.world
    )
    gloo_group = dist.new_group(list(range(args.world)), backend="gloo")
    server = None
    if args.rank == 0:
        server = NixlKVBootstrapServer("127.0.0.1", args.bootstrap_port)
    dist.barrier(group=gloo_group)

    kv_args, _ = sglang_kit.kv_args(args.rank, 64, total_kv_heads=args.world)
    kv_mgr = NixlKVManager(kv_args, DisaggregationMode.PREFILL, server_args)
    sender = NixlKVSender(kv_mgr, f"127.0.0.1:{args.bootstrap_port}", args.room)
    result = {"rank": args.rank, "setup_s": round(time.monotonic() - t0, 2), "group_hint": None}
    rr = getattr(kv_mgr, "_rootrank_rank", None)
    if rr is not None:
        result["group"] = rr.group
        rr.agent.wait_registered(10.0)
        result["incarnation"] = rr.agent.incarnation
    dist.barrier(group=gloo_group)

    culprit = args.rank == args.culprit
    if args.scenario == "abort":
        sender.abort()
    elif culprit and args.scenario == "record":
        kv_mgr.record_failure(args.room, f"NIXL transfer encountered ERR room={args.room}")
        kv_mgr.update_status(args.room, KVPoll.Failed)
    elif culprit and args.scenario == "conclude":
        kv_mgr.conclude_failure(bootstrap_room=args.room, failure_reason="KVSender failed to post transfer")
    elif culprit and args.scenario == "fatal":
        fatal(server_args)
        return
    if args.scenario == "fatal":
        wait_gone(os.path.join(out_dir, f"pid{args.culprit}"))
        # The peer died of an exception before the all-reduce; SGLang's launcher takes the
        # instance down, and this rank's room is failed with no reason of its own.
        kv_mgr.update_status(args.room, KVPoll.Failed)
        polls = [int(sender.poll())]
    else:
        polls = poll_and_all_reduce([sender], gloo_group)
    result["polls"] = polls
    if polls[0] == int(KVPoll.Failed):
        t1 = time.monotonic()
        try:
            sender.failure_exception()
            result["raised"] = None
        except KVTransferError as e:
            result["raised"] = {
                "type": type(e).__name__,
                "module": type(e).__module__,
                "room": e.bootstrap_room,
                "is_from_another_rank": e.is_from_another_rank,
                "str": str(e),
            }
        result["fallback_ms"] = round((time.monotonic() - t1) * 1000, 2)
    try:
        import rootrank.sglang as plugin

        result["plugin_stats"] = plugin.stats()
    except ImportError:
        plugin = None
    with open(args.out, "w") as f:
        json.dump(result, f)
    if plugin is not None and plugin._plugin is not None:
        # A culprit not known within the budget is logged as soon as it resolves.
        plugin._plugin.wait_followed(30)
    if args.scenario != "fatal":
        dist.barrier(group=gloo_group)
    if server is not None:
        server.close() if hasattr(server, "close") else None
    os._exit(0)


def wait_gone(pid_file: str, timeout_s: float = 120.0) -> None:
    """Until the culprit's process has exited (what a survivor notices, one way or another,
    before SGLang fails its rooms)."""
    pid = int(open(pid_file).read())
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return
        time.sleep(0.02)


def fatal(server_args) -> None:
    """Dies in SGLang's real run_scheduler_process: its Scheduler() raises (the model
    directory holds a config and no weights), the except branch logs the traceback through
    sglang.utils.get_exception_traceback and SIGQUITs the parent."""
    from sglang.srt.managers.scheduler import run_scheduler_process
    from sglang.srt.server_args import PortArgs

    port_args = PortArgs.init_new(server_args)
    r, w = __import__("multiprocessing").Pipe(duplex=False)
    run_scheduler_process(server_args, port_args, 0, 1, 0, None, w)
    os._exit(3)


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(2)
