"""DeepEP's normal mode (``Buffer.get_dispatch_layout`` + ``Buffer.dispatch(num_worst_tokens=N)``)
behind the rows format, and its one dispatch call that the tokens format shares (`send`).

Every rank receives a worst-case-sized ``[N, H]`` block (tokens that came, then padding
whose ids DeepEP sets to -1), so no size depends on the routing and nothing waits on the
host. Rows: received ``(token, local slot)`` pairs are sorted by local expert
(`common.kernels.sorting`); ``src_R`` is each row's received slot ``n * K + k``. Combine weights
the rows, sums each received token's rows in slot order (``[N, H]``) and hands them to
``Buffer.combine``, which sums each token over the ranks that hold its experts: the ops'
``combine_map`` is a placeholder here (``placeholder_TK``, all -1, read for its shape). DeepEP's
handle (prefix matrices, send heads: tensors whose sizes the op contract cannot carry)
stays in the communicator, keyed by the storage of the ``src_rows`` tensor that dispatch
returned, and is dropped when that storage is freed: combine and both gradients must get
that very tensor (as they do eagerly, under ``torch.compile`` and in one captured CUDA
graph; a copy, as ``torch.library.opcheck`` makes, finds no handle and raises). The
gradient of dispatch is ``Buffer.combine`` (the routing weights' gradients ride as its
``topk_weights``), the gradient of combine a cached-handle ``Buffer.dispatch``.

fp8 (``moe::dispatch_quant``): each token is quantized once, before it leaves
(`quant.quantize_activations`), and ``Buffer.dispatch`` moves DeepEP's fp8 pair ``(x [T,
H] e4m3, scales [T, A] fp32)``: each received row keeps its scales, bit for bit those of
dispatch then quantize.

Legend: T tokens on this rank, T1 = max(T, 1) tokens handed to DeepEP, H hidden size, K
experts per token, N = P * M tokens one rank can receive, R rows, A fp8 scales per row.
"""

from __future__ import annotations

import torch

from torch_moe_ops import quant
from torch_moe_ops.backends.common.kernels.rows import (
    block_of,
    gather_rows,
    scatter_index,
    scatter_rows,
    sum_slots,
)
from torch_moe_ops.backends.common.kernels.sorting import sort_rows
from torch_moe_ops.backends.deepep.buffer import pad_tokens
from torch_moe_ops.backends.deepep.modes import DTYPE
from torch_moe_ops.backends.deepep.received import received_rows


def send(comm, x, topk_weights_TK: torch.Tensor, topk_ids_TK: torch.Tensor,
         async_finish: bool = False):
    """``Buffer.dispatch`` of ``x`` (``[T1, H]`` bf16 or DeepEP's fp8 pair, padded by
    the caller) at the worst-case token count N: ``(recv_x, recv_ids_NK, recv_weights_NK,
    handle)``, the ids local to this rank (-1: another rank's expert, a skipped slot,
    padding). An idle rank hands DeepEP one row routed nowhere: no kernel sees an empty
    tensor, and the rank joins the exchange. ``async_finish``: DeepEP's kernels left
    running on its communication stream, which the caller must wait for."""
    padded = max(topk_ids_TK.shape[0], 1)
    ids_TK = pad_tokens(topk_ids_TK.to(comm.topk_idx_dtype), padded, -1)
    weights_TK = pad_tokens(topk_weights_TK.float(), padded, 0)
    buffer = comm.buffer
    per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(
        ids_TK, comm.num_experts)
    recv_x, recv_ids_NK, recv_weights_NK, _, handle, _ = buffer.dispatch(
        x, topk_idx=ids_TK, topk_weights=weights_TK, num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        num_worst_tokens=comm.ep_size * comm.max_tokens_per_rank, config=comm.dispatch_config,
        async_finish=async_finish)
    return recv_x, recv_ids_NK, recv_weights_NK, handle


def _sum_received(rows_RH: torch.Tensor, src_R: torch.Tensor, num_received: int,
                  top_k: int) -> torch.Tensor:
    """``[N, H]`` bf16: each received token's rows summed in slot order (fp32)."""
    rows = torch.arange(src_R.shape[0], device=src_R.device)
    row_of_slot_S = scatter_index(rows, src_R, num_received * top_k)
    return sum_slots(rows_RH.to(DTYPE), row_of_slot_S.view(num_received, top_k))


def dispatch(comm, hidden_TH, topk_weights_TK, topk_ids_TK, num_rows, spec=None):
    """``Buffer.dispatch`` into rows: dispatch's six outputs, then with ``spec`` (rows
    quantized before they leave, `fp8_transport_reason` None) ``x_scale``."""
    num_tokens, top_k = topk_ids_TK.shape
    padded = max(num_tokens, 1)
    x = pad_tokens(hidden_TH, padded, 0)
    if spec is not None:
        q_TH, scale = quant.quantize_activations(x, spec)
        x = (q_TH, scale.reshape(padded, -1))
    recv_x, recv_ids_NK, recv_weights_NK, handle = send(comm, x, topk_weights_TK, topk_ids_TK)
    order_S, sorted_ids_S, count_E = sort_rows(recv_ids_NK, comm.num_local_experts)
    order_R, expert_R = order_S[:num_rows], sorted_ids_S[:num_rows]
    src_R = order_R.masked_fill(expert_R < 0, -1).to(torch.int32)
    x_RH, *scale = received_rows(recv_x, block_of(src_R, top_k), spec)
    weight_R = gather_rows(recv_weights_NK.reshape(-1, 1).float(), src_R)[:, 0]
    comm.remember(src_R, handle)
    placeholder_TK = torch.full((num_tokens, top_k), -1, dtype=torch.int32,
                                device=topk_ids_TK.device)
    return (x_RH, expert_R.to(torch.int32), weight_R, src_R, count_E.clone(), placeholder_TK,
            *scale)


def combine(comm, handle, rows_RH, src_R, num_tokens, top_k, grad_weight_R=None):
    """``Buffer.combine`` of the rows (and of per-slot ``grad_weight_R``): ``[T, H]``
    (and ``[T, K]``)."""
    num_received = comm.ep_size * comm.max_tokens_per_rank
    summed_NH = _sum_received(rows_RH, src_R, num_received, top_k)
    weights_NK = None
    if grad_weight_R is not None:
        weights_NK = scatter_rows(grad_weight_R.float().unsqueeze(1), src_R,
                                  num_received * top_k).view(num_received, top_k).contiguous()
    combined_TH, combined_weights_TK, _ = comm.buffer.combine(
        summed_NH, handle, topk_weights=weights_NK, config=comm.combine_config)
    if grad_weight_R is None:
        return combined_TH[:num_tokens]
    return combined_TH[:num_tokens], combined_weights_TK[:num_tokens]


def send_out(comm, handle, grad_out_TH, src_R, top_k):
    """Cached-handle ``Buffer.dispatch`` of ``grad_out``: each row's token's gradient."""
    padded = pad_tokens(grad_out_TH.to(DTYPE), max(grad_out_TH.shape[0], 1), 0)
    recv_NH, *_ = comm.buffer.dispatch(padded, handle=handle, config=comm.dispatch_config)
    return gather_rows(recv_NH, block_of(src_R, top_k))
