"""TEST-ONLY stand-in for SGLang's CPU kernels (sgl_kernel), used by the real-server tier
(tests/python/test_server.py) and put on PYTHONPATH only for its SGLang processes.

SGLang 0.5.23 calls two functions from sgl_kernel on CPU (kernels/ops/kvcache/cache_move.py,
srt/mem_cache/allocation.py) and sgl_kernel's CPU build is not on PyPI. These are the same
operations in plain torch, slow and correct (the speculative-decoding names it imports are
placeholders that raise). `convert_weight_packed` is left out on purpose:
SGLang probes for it to turn on AMX kernels, which this stand-in does not provide.
Never ship this: a real deployment uses SGLang's own kernels."""

import ctypes

import torch


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                  start_offset: torch.Tensor, end_offset: torch.Tensor,
                                  out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the i-th run of out_cache_loc
    (the runs are packed back to back), as SGLang's triton kernel assign_req_to_token_pool."""
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[offset:offset + n].to(req_to_token.dtype)
        offset += n


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor,
                                tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """For every KV buffer (a raw data pointer and its per-token stride in bytes), copies
    token rows src_loc to tgt_loc, as SGLang's triton kernel copy_all_layer_kv_cache_tiled.
    Reads every source row before writing, so an in-place overlap is safe there too."""
    if src_loc.numel() == 0:
        return
    rows = int(max(int(src_loc.max()), int(tgt_loc.max()))) + 1
    src, tgt = src_loc.long(), tgt_loc.long()
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * int(stride))).from_address(int(ptr))
        buf = torch.frombuffer(raw, dtype=torch.uint8).view(rows, int(stride))
        buf[tgt] = buf[src]


def _not_provided(name: str):
    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: not in rootrank's test-only stand-in (speculative decoding is not run)")

    missing.__name__ = name
    return missing


# Imported at module load on CPU by SGLang's speculative-decoding kernels (kernels/ops/speculative/),
# never called without speculative decoding, which the tier does not turn on.
for _name in ("build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu", "rotate_input_ids_cpu",
              "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu", "assign_draft_cache_locs_contiguous_cpu",
              "assign_extend_cache_locs_cpu", "build_draft_decode_metadata_cpu"):
    globals()[_name] = _not_provided(_name)
del _name
