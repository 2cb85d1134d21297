"""The ``grouped_mm`` experts backend: ``torch._grouped_mm`` on rows sorted by expert.

Legend: T tokens, H hidden size, I expert intermediate size, E experts,
K experts per token, R = T * K rows.

Rows are sorted by expert on the device (a stable sort, no host sync), each
expert's rows multiply its weights in one grouped GEMM per projection, and the
K rows of a token are summed in slot order, so the result is deterministic.
``torch._grouped_mm`` only runs without a host sync for bf16 on sm90+; elsewhere
it loops on the host, which a CUDA graph cannot capture: `supports` says so.
Weights are used in the canonical layout (``w13 [E, 2I, H]``, ``w2 [E, H, I]``).
"""

from __future__ import annotations

from typing import Optional

import torch

from torch_moe_ops.backends.local import sort_rows
from torch_moe_ops.backends.reference import activation
from torch_moe_ops.backends.registry import REGISTRY, ExpertsBackend
from torch_moe_ops.ops import CONTRACTS
from torch_moe_ops.ops.library import define, implement

NAMESPACE = "moe_grouped_mm"
# torch._grouped_mm needs 16-byte aligned rows: 8 bf16 values.
ALIGNMENT = 8


def _check_alignment(w13_EFH: torch.Tensor) -> None:
    hidden, intermediate = w13_EFH.shape[2], w13_EFH.shape[1] // 2
    if hidden % ALIGNMENT or intermediate % ALIGNMENT:
        raise ValueError(f"experts backend 'grouped_mm' needs H and I divisible by "
                         f"{ALIGNMENT}, got H={hidden}, I={intermediate}")


def experts_rows(x_RH, expert_R, count_E, w13_EFH, w2_EHI, b13_EF, b2_EH, act, alpha, limit):
    """``y_RH [R, H]``: each row through its expert; rows past the counted ones are 0."""
    _check_alignment(w13_EFH)
    if x_RH.shape[0] == 0:
        return torch.empty_like(x_RH)
    ends_E = torch.cumsum(count_E, 0, dtype=torch.int32)
    expert_R = expert_R.long()
    # Skipped rows borrow expert 0's bias; their output is zeroed below.
    bias_index_R = expert_R.clamp(min=0)
    h_RF = torch._grouped_mm(x_RH, w13_EFH.transpose(-2, -1), offs=ends_E).float()
    if b13_EF is not None:
        h_RF = h_RF + b13_EF[bias_index_R].float()
    gate_RI, up_RI = h_RF.chunk(2, dim=-1)
    a_RI = activation(gate_RI, up_RI, act, alpha, limit).to(x_RH.dtype)
    y_RH = torch._grouped_mm(a_RI, w2_EHI.transpose(-2, -1), offs=ends_E)
    if b2_EH is not None:
        y_RH = y_RH + b2_EH[bias_index_R]
    # Rows past the last offset are never written by the GEMM: select, do not multiply.
    return torch.where((expert_R >= 0).unsqueeze(1), y_RH, 0).to(x_RH.dtype)


def experts(hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI, b13_EF, b2_EH, act,
            alpha, limit):
    num_tokens, top_k = topk_ids_TK.shape
    if num_tokens == 0:
        _check_alignment(w13_EFH)
        return torch.empty_like(hidden_TH)
    order_R, sorted_ids_R, count_E = sort_rows(topk_ids_TK, w13_EFH.shape[0])
    x_RH = hidden_TH[order_R // top_k]
    y_RH = experts_rows(x_RH, sorted_ids_R, count_E, w13_EFH, w2_EHI, b13_EF, b2_EH, act,
                        alpha, limit)
    row_of_slot_R = torch.empty_like(order_R)
    row_of_slot_R[order_R] = torch.arange(order_R.numel(), device=order_R.device)
    y_TKH = y_RH[row_of_slot_R].view(num_tokens, top_k, -1).float()
    weights_TK1 = torch.where(topk_ids_TK < 0, 0.0, topk_weights_TK.float()).unsqueeze(-1)
    return (y_TKH * weights_TK1).sum(1).to(hidden_TH.dtype)


def supports(spec, cfg, device, dtype) -> Optional[str]:
    if device.type != "cuda":
        return f"needs a CUDA GPU of sm90 or newer, got device {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return (f"needs sm90 or newer (torch._grouped_mm loops on the host before), "
                f"got sm{major}{minor}")
    if dtype != torch.bfloat16:
        return f"needs bfloat16 (other dtypes loop on the host), got {dtype}"
    if cfg is not None and (cfg.hidden_size % ALIGNMENT or cfg.intermediate_size % ALIGNMENT):
        return (f"needs hidden_size and intermediate_size divisible by {ALIGNMENT}, got "
                f"{cfg.hidden_size} and {cfg.intermediate_size}")
    return None


for _name, _kernel in (("experts", experts), ("experts_rows", experts_rows)):
    define(NAMESPACE, CONTRACTS[_name])
    implement(NAMESPACE, CONTRACTS[_name], _kernel)

REGISTRY.register_experts(ExpertsBackend(
    name="grouped_mm", namespace=NAMESPACE, layout="rows", supports=supports, priority=10,
    description="torch._grouped_mm on rows sorted by expert (bf16, sm90+)"))
