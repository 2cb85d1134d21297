"""The ``none`` a2a backend: dispatch and combine on one device.

Legend: T tokens, H hidden size, K experts per token, E experts, S = R = T * K
(one row per (token, slot) pair).

Dispatch sorts the slots by expert with a stable sort (`common.kernels.sorting`), so
rows of one expert keep token order and the result is deterministic; skipped
slots (id -1) sort last, as rows of zeros. ``src_R`` is each row's slot
(``t * K + k``) and ``row_of_slot_TK`` (the ops' ``combine_map``) each slot's row (-1:
skipped); combine sums each token's weighted rows in slot order. Everything is sized by
T and K alone: no host sync.
``dispatch_quant`` sorts rows quantized to fp8 (`common.transport.quantized_dispatch`).
"""

from __future__ import annotations

import torch

from torch_moe_ops.backends.common.kernels.rows import (
    block_of,
    combine_grads,
    gather_rows,
    sum_slots,
    weighted_rows,
)
from torch_moe_ops.backends.common.kernels.sorting import sort_rows
from torch_moe_ops.backends.common.transport.quantized_dispatch import quantized_dispatch
from torch_moe_ops.backends.registry import REGISTRY, A2ABackend
from torch_moe_ops.ops import define_backend_ops

NAMESPACE = "moe_local"


def _one_device(ep_size: int) -> None:
    if ep_size != 1:
        raise ValueError(f"ep_size must be 1 for a2a backend 'none' (one device), got "
                         f"{ep_size}: compile with an expert-parallel a2a backend")


def dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size, *_):
    _one_device(ep_size)
    num_tokens, top_k = topk_ids_TK.shape
    order_R, sorted_ids_R, count_E = sort_rows(topk_ids_TK, num_experts)
    skip_R = sorted_ids_R < 0
    src_R = order_R.masked_fill(skip_R, -1).to(torch.int32)
    # Skipped rows hold zeros, as the backward (which gives them no gradient) says.
    x_RH = gather_rows(hidden_TH, block_of(src_R, top_k))
    weight_R = topk_weights_TK.reshape(-1)[order_R].float().masked_fill(skip_R, 0.0)
    row_of_slot_S = torch.empty_like(order_R)
    row_of_slot_S[order_R] = torch.arange(order_R.numel(), device=order_R.device)
    row_of_slot_TK = row_of_slot_S.masked_fill(topk_ids_TK.reshape(-1) < 0, -1).to(
        torch.int32).view(num_tokens, top_k)
    return (x_RH, sorted_ids_R.to(torch.int32), weight_R, src_R, count_E.clone(),
            row_of_slot_TK)


def combine(y_RH, weight_R, src_R, row_of_slot_TK, ep_size, *_):
    _one_device(ep_size)
    return sum_slots(weighted_rows(y_RH, weight_R, src_R), row_of_slot_TK)


def dispatch_backward(grad_x_RH, grad_weight_R, src_R, row_of_slot_TK, *_):
    grad_topk_weights_TK = gather_rows(grad_weight_R.unsqueeze(1), row_of_slot_TK.reshape(-1))
    return (sum_slots(grad_x_RH, row_of_slot_TK),
            grad_topk_weights_TK.view(row_of_slot_TK.shape))


def combine_backward(grad_out_TH, y_RH, weight_R, src_R, row_of_slot_TK, *_):
    token_R = block_of(src_R, row_of_slot_TK.shape[1])
    return combine_grads(gather_rows(grad_out_TH, token_R), y_RH, weight_R, src_R)


def supports(spec, problem, device) -> str | None:
    if problem.ep_size is not None and problem.ep_size != 1:
        return f"a2a 'none' runs one device, the layer has ep_size={problem.ep_size}"
    return None


define_backend_ops(NAMESPACE, {"dispatch": dispatch, "combine": combine,
                               "dispatch_backward": dispatch_backward,
                               "combine_backward": combine_backward,
                               "dispatch_quant": quantized_dispatch(dispatch)})

REGISTRY.register_a2a(A2ABackend(
    name="none", namespace=NAMESPACE, supports=supports,
    description="single device: sort rows by expert, sum each token's weighted rows"))
