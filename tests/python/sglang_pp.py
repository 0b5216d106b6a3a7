"""A prefill instance with pipeline parallelism, PP=2 x TP=2, one process per rank, built the
way SGLang builds it: its own ``init_distributed_environment`` and
``initialize_model_parallel`` over gloo (the PP, TP and CP groups are SGLang's
``GroupCoordinator``s), a real ``NixlKVManager`` per rank (under PP its ``request_status`` is
SGLang's ``PPConsensusStore``, replicated to PP rank 0 over ZMQ) and a real ``NixlKVSender``:

    python sglang_pp.py --rank R --dist-port P --bootstrap-port B --room ROOM --failing K \
        --dir D --model-dir M

World rank R is ``pp_rank * tp_size + tp_rank`` (SGLang's layout). Rank K's transfer fails
through SGLang's real ``record_failure`` (as its NIXL transfer worker does on an error) and
its own status turns Failed; then every rank runs SGLang's own per-iteration PP poll,
``poll_and_all_reduce_prefill_pp`` (PP rank 0 polls the consensus of all stages, reduces it
over TP and sends it down the pipeline), until the room concludes, and raises what
``failure_exception`` raises. Each rank writes D/pp{R}.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

TP, PP = 2, 2


def main(a) -> None:
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path=a.model_dir, disaggregation_mode="prefill", disaggregation_transfer_backend="nixl",
                             disaggregation_bootstrap_port=a.bootstrap_port, device="cpu", skip_tokenizer_init=True,
                             host="127.0.0.1", tp_size=TP, pp_size=PP)
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=a.rank, dp_rank=None, gpu_id=0))
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

    init_distributed_environment(world_size=TP * PP, rank=a.rank, distributed_init_method=f"tcp://127.0.0.1:{a.dist_port}",
                                 local_rank=a.rank, backend="gloo")
    initialize_model_parallel(backend="gloo")
    import sglang_kit
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError
    from sglang.srt.disaggregation.nixl.conn import NixlKVBootstrapServer, NixlKVManager, NixlKVSender
    from sglang.srt.disaggregation.utils import DisaggregationMode, poll_and_all_reduce_prefill_pp

    parallel = get_parallel()
    pp_rank, world = parallel.pp_rank, parallel.world_group
    server = NixlKVBootstrapServer("127.0.0.1", a.bootstrap_port) if a.rank == 0 else None
    world.barrier()
    kv_args, _ = sglang_kit.kv_args(a.rank, 64, total_kv_heads=TP)
    kv_args.pp_rank = pp_rank
    kv_mgr = NixlKVManager(kv_args, DisaggregationMode.PREFILL, server_args)
    sender = NixlKVSender(kv_mgr, f"127.0.0.1:{a.bootstrap_port}", a.room)
    rr = getattr(kv_mgr, "_rootrank_rank", None)
    out = {"rank": a.rank, "pp_rank": pp_rank, "tp_rank": parallel.attn_tp_rank}
    if rr is not None:
        out.update(group=rr.group, group_rank=rr.rank, incarnation=rr.agent.wait_registered(10))
    world.barrier()
    if a.rank == a.failing:
        kv_mgr.record_failure(a.room, f"NIXL transfer encountered ERR room={a.room}")
        kv_mgr.update_status(a.room, KVPoll.Failed)
    work: list = []
    deadline = time.monotonic() + 120
    while True:
        polls = poll_and_all_reduce_prefill_pp([sender], parallel.attn_cp_group.cpu_group,
                                               parallel.attn_tp_group.cpu_group, parallel.pp_group, pp_rank, PP, work)
        if polls[0] in (int(KVPoll.Failed), int(KVPoll.Success)) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    out["polls"] = polls
    if polls[0] == int(KVPoll.Failed):
        try:
            sender.failure_exception()
        except KVTransferError as e:
            out["raised"] = {"str": str(e), "is_from_another_rank": e.is_from_another_rank}
    if rr is not None:
        rr.agent.flush(10)
        import rootrank.sglang as plugin

        out["plugin_stats"] = plugin.stats()
        if plugin._plugin is not None:
            plugin._plugin.wait_followed(30)  # a culprit not known within the budget is logged
    with open(os.path.join(a.dir, f"pp{a.rank}.json"), "w") as f:
        json.dump(out, f)
    world.barrier()
    del server
    os._exit(0)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    for name in ("rank", "dist-port", "bootstrap-port", "room", "failing"):
        ap.add_argument(f"--{name}", type=int, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--model-dir", required=True)
    import sglang_kit

    sglang_kit.run_script(main, ap)
