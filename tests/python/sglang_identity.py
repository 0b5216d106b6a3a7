"""One SGLang 0.5.23 prefill scheduler's KV manager, built under the runtime context SGLang
publishes for a given parallel layout, to see which rootrank group it joins:

    python sglang_identity.py --out FILE --bootstrap-port B --tp-size T --dp-size D \
        --world-rank R --dp-rank DR [--dp-attention] [--serve-bootstrap] [--dist-init-addr A --nnodes N]

``publish(server_args, SpawnRanks(world_rank, dp_rank))`` is what ``run_scheduler_process``
does (plain DP replicas are separate worlds told their DP rank; under DP attention the
attention-DP rank follows from the world rank). Writes FILE with the group, rank, size and
whether its live key registered (or why not), then waits until FILE.stop exists.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main(a) -> None:
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang_kit
    from sglang.srt.disaggregation.nixl.conn import NixlKVBootstrapServer, NixlKVManager
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    # Multi-node: every node is given the leader's --dist-init-addr, --nnodes and its own
    # --node-rank; torch.distributed spans the nodes (SGLang's own init, over gloo).
    extra = {"dist_init_addr": a.dist_init_addr, "nnodes": a.nnodes, "node_rank": a.world_rank} if a.dist_init_addr else {}
    server_args = ServerArgs(model_path=a.model_dir, disaggregation_mode="prefill", disaggregation_transfer_backend="nixl",
                             disaggregation_bootstrap_port=a.bootstrap_port, device="cpu", skip_tokenizer_init=True,
                             host="127.0.0.1", tp_size=a.tp_size, dp_size=a.dp_size,
                             enable_dp_attention=a.dp_attention, **extra)
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=a.world_rank, dp_rank=a.dp_rank, gpu_id=0))
    host = "127.0.0.1"
    if a.dist_init_addr:
        from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

        host, port = a.dist_init_addr.rsplit(":", 1)
        init_distributed_environment(world_size=a.tp_size, rank=a.world_rank, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://{host}:{port}")
        initialize_model_parallel(backend="gloo")
    else:
        get_parallel().override_permanently(pp_group=None)
    server = NixlKVBootstrapServer(host, a.bootstrap_port) if a.serve_bootstrap else None
    kv_args, _ = sglang_kit.kv_args(a.world_rank, 16, total_kv_heads=a.tp_size)
    kv_args.system_dp_rank = a.dp_rank or 0
    kv_mgr = NixlKVManager(kv_args, DisaggregationMode.PREFILL, server_args)
    rr = kv_mgr._rootrank_rank
    incarnation = rr.agent.wait_registered(15)
    out = {"group": rr.group, "rank": rr.rank, "size": rr.agent.group_size, "incarnation": incarnation,
           "registration_error": rr.agent.registration_error, "pid": os.getpid()}
    with open(a.out + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(a.out + ".tmp", a.out)
    deadline = time.monotonic() + 300
    while not os.path.exists(a.out + ".stop") and time.monotonic() < deadline:
        time.sleep(0.05)
    rr.agent.shutdown(5)
    del server
    os._exit(0)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model-dir", required=True)
    for name in ("bootstrap-port", "tp-size", "dp-size", "world-rank"):
        ap.add_argument(f"--{name}", type=int, required=True)
    ap.add_argument("--dp-rank", type=int, default=None)
    ap.add_argument("--dp-attention", action="store_true")
    ap.add_argument("--serve-bootstrap", action="store_true")
    ap.add_argument("--dist-init-addr", default=None)
    ap.add_argument("--nnodes", type=int, default=1)
    import sglang_kit

    sglang_kit.run_script(main, ap)
