"""What both SGLang rank scripts need to stand up SGLang's real objects on a CPU (see
../shared/SGLANG-FACTS.md, "Running the real SGLang code on a CPU-only machine"): the
plugins loaded first, the runtime context published, and KVArgs over host (numpy) buffers."""

from __future__ import annotations


def scheduler_start(role: str, model_dir: str, bootstrap_port: int, *, world_rank: int = 0, tp_size: int = 1,
                    port: int = 30000):
    """As `run_scheduler_process` begins: `load_plugins()` first (so the rootrank plugin is
    found through the installed wheel's entry point), then the runtime context. Returns the
    ServerArgs."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(
        model_path=model_dir,
        disaggregation_mode=role,
        disaggregation_transfer_backend="nixl",
        disaggregation_bootstrap_port=bootstrap_port,
        device="cpu",
        skip_tokenizer_init=True,
        host="127.0.0.1",
        port=port,
        tp_size=tp_size,
    )
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=world_rank, dp_rank=None, gpu_id=0))
    if role == "prefill":
        get_parallel().override_permanently(pp_group=None)
    return server_args


def kv_args(rank: int, pages: int, total_kv_heads: int = 1):
    """KVArgs over DRAM buffers of `pages` 64-byte pages and a non-empty aux buffer (an empty
    one crashes NIXL's register_memory). Returns (args, kv buffer); the args keep both
    buffers alive."""
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVArgs

    kv = np.zeros(pages * 64, dtype=np.uint8)
    aux = np.zeros(256, dtype=np.uint8)
    a = KVArgs()
    a._buffers = (kv, aux)
    a.engine_rank = rank
    a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens, a.kv_layer_ids = [kv.ctypes.data], [kv.nbytes], [64], [0]
    a.kv_data_mem_kinds = ["DRAM"]
    a.kv_cache_dtype_str, a.kv_layout = "bfloat16", None
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = [aux.ctypes.data], [aux.nbytes], [16]
    a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
    a.state_layer_ids, a.state_dim_per_tensor, a.state_slice_outer_counts, a.state_conv_shard_groups = [], [], [], []
    a.swa_kv_cache_layout, a.is_hybrid_mla_backend, a.ib_device, a.gpu_id = None, False, None, 0
    a.kv_head_num, a.total_kv_head_num, a.page_size, a.system_dp_rank = 1, total_kv_heads, 1, 0
    a.rust_http_port, a.pp_rank, a.prefill_start_layer, a.prefill_end_layer = None, 0, 0, 1
    a.mla_compression_ratios, a.kv_buf_groups, a.hidden_kv_layers, a.draft_kv_layers, a.num_draft_entries = None, 1, 1, 0, 0
    return a, kv


def run_script(main, parser) -> None:
    """A rank script's entry: `main(args)`; on any exception its traceback, then exit 2 at
    once (os._exit: no atexit, as a crashed rank would not run one), which the tests read."""
    import os
    import sys
    import traceback

    try:
        main(parser.parse_args())
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(2)
