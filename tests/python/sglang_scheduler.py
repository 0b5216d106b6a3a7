"""One prefill TP rank run through SGLang 0.5.23's real ``run_scheduler_process``, whose
scheduler loops SGLang's real per-iteration poll all-reduce over a real gloo group, and one
rank SIGKILLed in the middle of it (as the OOM killer does):

    python sglang_scheduler.py --rank R --world N --gloo-port P --bootstrap-port B \
        --room ROOM --victim-of K --dir DIR --model-dir M

What is real: ``run_scheduler_process`` (``load_plugins()``, the runtime context, its
``except`` branch: ``get_exception_traceback``, the log line, SIGQUIT to the parent), the
gloo group, SGLang's ``NixlKVManager``/``NixlKVSender`` and ``poll_and_all_reduce``. The one
test-only stand-in, clearly so: the ``Scheduler`` class (a real one needs model weights and a
GPU), replaced in ``sglang.srt.managers.scheduler`` the way SGLang's plugin hooks may
("Load plugins so hooks can override Scheduler"): its event loop does what SGLang's prefill
event loop does with a transfer in flight, one ``poll_and_all_reduce`` per iteration. Rank
``K`` SIGKILLs itself after a few iterations; the others die inside the all-reduce, exactly
where gloo raises in SGLang. With ``--wedge-s W`` rank ``K`` wedges instead, for W seconds,
in a C call that keeps the GIL (a hung driver call); the others block in the next
all-reduce. Each iteration starts with ``ingest_requests``, as every SGLang event loop does
(the stand-in's takes no input: there is no tokenizer), where the plugin counts progress.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback


class StandInScheduler:
    """Test-only stand-in for ``sglang.srt.managers.scheduler.Scheduler`` (see the module
    doc): what ``run_scheduler_process`` calls on it, and a prefill loop over SGLang's own
    poll all-reduce."""

    args: argparse.Namespace

    def __init__(self, server_args, port_args):
        import sglang_kit
        import torch.distributed as dist
        from sglang.srt.disaggregation.nixl.conn import NixlKVBootstrapServer, NixlKVManager, NixlKVSender
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.runtime_context import get_parallel

        a = self.args
        get_parallel().override_permanently(pp_group=None)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.gloo_port}", rank=a.rank, world_size=a.world)
        self.gloo_group = dist.new_group(list(range(a.world)), backend="gloo")
        self.server = NixlKVBootstrapServer("127.0.0.1", a.bootstrap_port) if a.rank == 0 else None
        dist.barrier(group=self.gloo_group)
        kv_args, _ = sglang_kit.kv_args(a.rank, 64, total_kv_heads=a.world)
        self.kv_mgr = NixlKVManager(kv_args, DisaggregationMode.PREFILL, server_args)
        self.sender = NixlKVSender(self.kv_mgr, f"127.0.0.1:{a.bootstrap_port}", a.room)
        rr = getattr(self.kv_mgr, "_rootrank_rank", None)
        info = {"rank": a.rank, "pid": os.getpid()}
        if rr is not None:
            rr.agent.wait_registered(10.0)
            info.update(group=rr.group, incarnation=rr.agent.incarnation)
        with open(os.path.join(a.dir, f"rank{a.rank}.json"), "w") as f:
            json.dump(info, f)
        dist.barrier(group=self.gloo_group)
        # What run_scheduler_process's finally branch touches.
        self.metrics_reporter = type("M", (), {"_shutdown_fpm": lambda self: None})()
        self.async_d2h_worker = None
        self.gracefully_exit = False

    def get_init_info(self):
        return {"status": "ready"}

    def ingest_requests(self, stop_at_pause: bool = False) -> list:
        return []  # stand-in: SGLang's receives and broadcasts the tokenizer's requests here

    def run_event_loop(self):
        from sglang.srt.disaggregation.utils import poll_and_all_reduce

        a = self.args
        for iteration in range(1_000_000):
            if a.rank == a.victim_of and iteration == 20 and a.wedge_s:
                # Wedged at the top of an iteration, before counting it: the siblings count
                # it and block in its all-reduce (see docs/waits.md on a wedge after the count).
                import ctypes

                ctypes.PyDLL(None).sleep(int(a.wedge_s))  # holds the GIL, like a hung C call
            self.ingest_requests()
            if a.rank == a.victim_of and iteration == 20 and not a.wedge_s:
                os.kill(os.getpid(), signal.SIGKILL)
            poll_and_all_reduce([self.sender], self.gloo_group)
            # 50 ms iterations when wedging: the siblings' last count comes one iteration after
            # the wedged rank's, far apart enough for any scheduling noise on a loaded machine.
            time.sleep(0.05 if a.wedge_s else 0.005)


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("rank", "world", "gloo-port", "bootstrap-port", "room", "victim-of"):
        ap.add_argument(f"--{name}", type=int, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--wedge-s", type=float, default=0.0)
    args = ap.parse_args()
    import multiprocessing

    from sglang.srt.server_args import PortArgs, ServerArgs

    import sglang.srt.managers.scheduler as scheduler_module

    StandInScheduler.args = args
    scheduler_module.Scheduler = StandInScheduler
    server_args = ServerArgs(model_path=args.model_dir, disaggregation_mode="prefill",
                             disaggregation_transfer_backend="nixl", disaggregation_bootstrap_port=args.bootstrap_port,
                             device="cpu", skip_tokenizer_init=True, host="127.0.0.1", tp_size=args.world)
    _, writer = multiprocessing.Pipe(duplex=False)
    t0 = time.monotonic()
    scheduler_module.run_scheduler_process(server_args, PortArgs.init_new(server_args), 0, args.rank, 0, None, writer)
    with open(os.path.join(args.dir, f"rank{args.rank}.exit"), "w") as f:
        json.dump({"returned_after_s": round(time.monotonic() - t0, 2)}, f)
    os._exit(3)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(2)
