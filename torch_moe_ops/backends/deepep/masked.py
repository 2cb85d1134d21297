"""The masked format (`ops.masked`) on DeepEP's low-latency mode, for layers without gradients:
``Buffer.low_latency_dispatch``'s receive buffer and counts are ``dispatch_masked``'s
outputs as they are, and ``combine_masked`` is ``Buffer.low_latency_combine`` of the
experts' ``[E_l, Q, H]``: no copy into rows and back, and no all-gather of the routing.

DeepEP sends each (token, slot) to the rank of its expert; there rank ``p``'s tokens for
local expert ``e`` land in one block of ``e``'s rows, the blocks in arrival order, and
``recv_count[e]`` rows of ``e`` carry a token. Its handle's tensors (``src_info [E_l, Q]``,
``layout_range [E_l, P]``) are outputs of the dispatch and inputs of the combine, so the
pair needs no state between them (a CUDA graph captures it; DeepEP alternates between two
buffers, and each captured pair keeps that parity). ``low_latency_combine`` weights each
slot by ``topk_weights`` and sums a token's slots on its own rank. A token that chose one
expert in two slots arrives twice; both rows compute the same values and go back to one
place, which both slots read with their weights. DeepEP stages one rank's messages to one
expert in M slots: routing that repeats ids must send no expert more than M of them from
one rank (top-k routing sends at most one per token).

Bookkeeping around DeepEP's calls, as in `tokens`: the ids cast to ``topk_idx_t`` and an
idle rank's one padding row routed nowhere (DeepEP's kernels take no empty tensor).
No gradient ops: the receive buffers are DeepEP's, and a layer that trains takes rows.

fp8 (``dispatch_masked_quant``): DeepEP casts each token itself inside
``low_latency_dispatch(use_fp8=True)``, one scale per 128 columns, so only ``fp8_group``
with ``block_size[1] == 128`` travels in fp8 blocks (`modes.fp8_transport_reason`; its
rounding is ours up to fp32 rounding, as `low_latency` says). Its scales come
column-major and are copied contiguous (``G / H`` of the fp8 bytes, in fp32: 3%).

Legend: T tokens on this rank, T1 = max(T, 1) tokens handed to DeepEP, H hidden size, K
experts per token, E experts, E_l = E / P experts per rank, P ranks, M =
max_tokens_per_rank, Q = P * M rows per local expert, G = H / 128 fp8 scales per row.
"""

from __future__ import annotations

from torch_moe_ops.backends.deepep import low_latency
from torch_moe_ops.backends.deepep.buffer import answering, dispatching
from torch_moe_ops.backends.deepep.modes import LOW_LATENCY, fp8_transport_reason
from torch_moe_ops.config import QuantSpec


def _dispatch(hidden_TH, topk_ids_TK, num_experts, ep_size, group_name, max_tokens_per_rank,
              use_fp8):
    """``Buffer.low_latency_dispatch``: ``(recv_x, count_E, src_info_EQ, layout_range_EP)``,
    ``recv_x`` bf16 or, with ``use_fp8``, DeepEP's pair (fp8 values, scales)."""
    num_tokens, top_k = topk_ids_TK.shape
    with dispatching("hidden", hidden_TH, top_k, num_experts, ep_size, group_name,
                     max_tokens_per_rank, LOW_LATENCY) as comm:
        comm.check_tokens(num_tokens)
        recv_x, count_E, handle = low_latency.send(comm, hidden_TH, topk_ids_TK, use_fp8)
        return recv_x, count_E, handle[0], handle[1]


def dispatch_masked(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size, group_name,
                    max_tokens_per_rank):
    return _dispatch(hidden_TH, topk_ids_TK, num_experts, ep_size, group_name,
                     max_tokens_per_rank, use_fp8=False)


def dispatch_masked_quant(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, weight_format,
                          activation_format, block_size, ep_size, group_name,
                          max_tokens_per_rank):
    spec = QuantSpec.from_op_args(weight_format, activation_format, block_size)
    reason = fp8_transport_reason(LOW_LATENCY, spec, hidden_TH.shape[1])
    if reason is not None:
        raise ValueError(f"a2a backend 'deepep' sends masked blocks in fp8 through DeepEP's "
                         f"low-latency cast only: {reason}")
    (x_EQH, scale_EQG), *bookkeeping = _dispatch(hidden_TH, topk_ids_TK, num_experts,
                                                 ep_size, group_name, max_tokens_per_rank,
                                                 use_fp8=True)
    # DeepEP's scales are column-major ([E_l, G, Q] storage): the contract's are contiguous.
    return x_EQH, *bookkeeping, scale_EQG.contiguous()


def combine_masked(y_EQH, src_info_EQ, layout_range_EP, topk_weights_TK, topk_ids_TK,
                   num_experts, ep_size, group_name, max_tokens_per_rank):
    with answering("y_masked", y_EQH, topk_ids_TK.shape[1], num_experts, ep_size, group_name,
                   max_tokens_per_rank, LOW_LATENCY) as comm:
        handle = (src_info_EQ, layout_range_EP, max_tokens_per_rank, y_EQH.shape[2],
                  num_experts)
        return low_latency.send_back(comm, y_EQH.contiguous(), topk_ids_TK, topk_weights_TK,
                                     handle)
