"""DeepEP called directly through its Python API, the yardstick of the ``deepep`` a2a
backend in bench_ep.py: the same ``deep_ep.Buffer`` the backend opens for the shape (so the
same buffer sizes and NVSHMEM state), but none of the backend's ops around its calls.

- normal mode: ``get_dispatch_layout`` + ``dispatch(num_worst_tokens=P*M)`` + ``combine``
  of the received activations, what the tokens format runs per layer (each call computes
  its layout and notifies its peers, as a model's layer must), captured as a pair, at
  the backend's configs (`configs.normal_configs`: DeepEP's default chunk sizes for P ranks
  on the backend's SM count, which DeepEP's own test sets too) and at the best NVL chunk
  sizes of a small sweep (DeepEP's own test tunes them the same way, on a cached handle);
- low-latency mode (decode sizes): ``low_latency_dispatch`` (bf16) +
  ``low_latency_combine`` of its per-expert receive buffer, captured as a pair.

Legend: P ranks, T tokens per rank (= M, max tokens per rank), H hidden size, K experts
per token, E experts, E_l = E / P.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torch_moe_ops.backends import deepep
from torch_moe_ops.backends.deepep import configs
from torch_moe_ops.backends.deepep.buffer import import_deep_ep
from torch_moe_ops.backends.deepep.modes import LOW_LATENCY, NORMAL

# DeepEP's own tuning sweeps (tests/test_intranode.py): dispatch chunks 4..32, combine 1..16.
DISPATCH_CHUNKS = (4, 8, 12, 16, 24, 32)
COMBINE_CHUNKS = (1, 2, 4, 6, 9, 12, 16)


def _routed(hidden_TH, weights_TK, ids_TK, topk_idx_dtype):
    return hidden_TH, weights_TK.float(), ids_TK.to(topk_idx_dtype)


def normal_round_trip(buffer, num_experts: int, worst_tokens: int, hidden_TH, weights_TK,
                      ids_TK, dispatch_config, combine_config) -> Callable[[], torch.Tensor]:
    """The pair one layer runs in normal mode: layout, dispatch at the worst-case count,
    combine of what arrived. Returns a function of no arguments giving ``[T, H]``."""

    def pair():
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(
            ids_TK, num_experts)
        recv_x, _, _, _, handle, _ = buffer.dispatch(
            hidden_TH, topk_idx=ids_TK, topk_weights=weights_TK, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, num_worst_tokens=worst_tokens,
            config=dispatch_config)
        combined_TH, _, _ = buffer.combine(recv_x, handle, config=combine_config)
        return combined_TH

    return pair


def time_normal(run, sizes, case, routing, capture_and_time) -> dict:
    """DeepEP's normal-mode round trip at the backend's configs and at the best chunk sizes
    of the sweep (dispatch chunk, then combine chunk, each tuned with the other at
    default). ``capture_and_time(fn) -> seconds`` times a captured pair on every rank."""
    deep_ep, _ = import_deep_ep()  # deepep runs here: bench_ep found it available
    num_experts, tokens = case
    hidden_TH, weights_TK, ids_TK = routing
    comm = deepep.communicator(run.group_name, sizes.hidden, num_experts, sizes.top_k, tokens,
                               hidden_TH.dtype, mode=NORMAL, device=run.device)
    args = (comm.buffer, num_experts, run.world * tokens,
            *_routed(hidden_TH, weights_TK, ids_TK, comm.topk_idx_dtype))
    default_d, default_c = comm.dispatch_config, comm.combine_config
    row = {"collective": "DeepEP normal: layout + dispatch + combine", "rows_per_peer": tokens,
           "config": "default"}
    row["default_us"] = capture_and_time(normal_round_trip(*args, default_d, default_c)) * 1e6

    def config(chunk):
        # Only the NVL send chunk moves (DeepEP's Config exposes no fields to copy).
        return deep_ep.Config(comm.num_sms, chunk, *configs.SHARED_FIELDS)

    best_d = min((capture_and_time(normal_round_trip(*args, config(c), default_c)), c)
                 for c in DISPATCH_CHUNKS)
    best_c = min((capture_and_time(normal_round_trip(*args, config(best_d[1]), config(c))), c)
                 for c in COMBINE_CHUNKS)
    row.update(tuned_us=best_c[0] * 1e6, dispatch_chunk=best_d[1], combine_chunk=best_c[1],
               num_sms=comm.num_sms, total_us=min(row["default_us"], best_c[0] * 1e6))
    return row


def time_low_latency(run, sizes, case, routing, capture_and_time) -> dict:
    """DeepEP's low-latency round trip (bf16): ``low_latency_dispatch`` into
    ``[E_l, P * M, H]`` and ``low_latency_combine`` of it, captured as a pair."""
    num_experts, tokens = case
    hidden_TH, weights_TK, ids_TK = routing
    comm = deepep.communicator(run.group_name, sizes.hidden, num_experts, sizes.top_k, tokens,
                               hidden_TH.dtype, mode=LOW_LATENCY, device=run.device)
    hidden_TH, weights_TK, ids_TK = _routed(hidden_TH, weights_TK, ids_TK,
                                            comm.topk_idx_dtype)
    buffer = comm.buffer

    def pair():
        recv_x, _, handle, _, _ = buffer.low_latency_dispatch(
            hidden_TH, ids_TK, tokens, num_experts, use_fp8=False)
        combined_TH, _, _ = buffer.low_latency_combine(recv_x, ids_TK, weights_TK, handle)
        return combined_TH

    total_s = capture_and_time(pair)
    return {"collective": "DeepEP low-latency dispatch + combine", "rows_per_peer": tokens,
            "config": "low-latency", "total_us": total_s * 1e6}
