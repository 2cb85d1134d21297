"""The ``none`` a2a backend: dispatch and combine on one device.

Legend: T tokens, H hidden size, K experts per token, E experts, R = T * K rows.

Dispatch sorts the T*K (token, slot) pairs by expert with a stable sort
(`common.sorting`), so rows of one expert keep token order and the result is
deterministic; skipped slots (id -1) sort last. Everything is sized by T and K alone: no host sync.
"""

from __future__ import annotations

import torch

from torch_moe_ops.backends.common.sorting import sort_rows
from torch_moe_ops.backends.registry import REGISTRY, A2ABackend
from torch_moe_ops.ops import define_backend_ops
from torch_moe_ops.ops.checks import compute_dtype

NAMESPACE = "moe_local"


def dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts):
    order_R, sorted_ids_R, count_E = sort_rows(topk_ids_TK, num_experts)
    skip_R = sorted_ids_R < 0
    token_R = order_R // topk_ids_TK.shape[1]
    x_RH = hidden_TH[token_R]
    weight_R = topk_weights_TK.reshape(-1)[order_R].float().masked_fill(skip_R, 0.0)
    src_R = token_R.masked_fill(skip_R, -1).to(torch.int32)
    return x_RH, sorted_ids_R.to(torch.int32), weight_R, src_R, count_E.clone()


def combine(y_RH, weight_R, src_R, num_tokens):
    skip_R = src_R < 0
    dtype = compute_dtype(y_RH.dtype)
    weighted_RH = y_RH.to(dtype) * weight_R.masked_fill(skip_R, 0.0).unsqueeze(1)
    out_TH = y_RH.new_zeros((num_tokens, y_RH.shape[1]), dtype=dtype)
    out_TH.index_add_(0, src_R.masked_fill(skip_R, 0).long(), weighted_RH)
    return out_TH.to(y_RH.dtype)


def supports(spec, cfg, device, dtype) -> str | None:
    if cfg is not None and cfg.ep_size != 1:
        return f"a2a 'none' runs one device, the config has ep_size={cfg.ep_size}"
    return None


define_backend_ops(NAMESPACE, {"dispatch": dispatch, "combine": combine})

REGISTRY.register_a2a(A2ABackend(
    name="none", namespace=NAMESPACE, layout="rows", supports=supports,
    description="single device: sort rows by expert, weighted scatter-add back"))
