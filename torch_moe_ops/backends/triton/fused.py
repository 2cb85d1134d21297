"""The fused MoE on Triton: align, gate-up GEMM with activation, down GEMM with
routing weight, sum over experts.

Legend: T tokens, H hidden size, I expert intermediate size, F = 2 * I, E experts,
K experts per token, S = T * K slots, R rows (rows format).

    for t, k: if topk_ids[t, k] >= 0:
        e = topk_ids[t, k]
        out[t] += topk_weights[t, k] * (act(hidden[t] @ w13[e].T + b13[e]) @ w2[e].T + b2[e])

Both entry points run `_run_experts`: the rows format is the K = 1 case without
routing weights. Nothing here reads a tensor's values on the host, so a call
can be captured in a CUDA graph once its config is cached (see `configs`).
Arguments are expected to have passed the op contract's checks
(`torch_moe_ops.ops.experts.check`); only what the kernels themselves rely on
is checked again here.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from torch_moe_ops.backends import grouped_mm
from torch_moe_ops.backends.triton.align import align_rows
from torch_moe_ops.backends.triton.configs import device_name, get_config
from torch_moe_ops.backends.triton.kernels import (ACTIVATION_CODES, moe_down_weighted_kernel,
                                                   moe_gate_up_act_kernel,
                                                   moe_sum_over_topk_kernel)

# Columns per program of the sum over experts.
SUM_BLOCK_H = 256
# From this many rows per expert on, torch._grouped_mm's GEMMs (cuBLAS, wgmma)
# beat these kernels' tl.dot on sm90 in bf16. Measured on an H200 (2026-11-21)
# for Mixtral, Qwen3-30B-A3B, OLMoE, GPT-OSS-20B and DeepSeek-V3 shapes: the
# crossover lay between 32 and 256 rows per expert, at 128 for most.
GROUPED_MM_MIN_ROWS_PER_EXPERT = 128


def _use_grouped_mm(num_rows: int, hidden_TH: torch.Tensor, w13_EFH: torch.Tensor) -> bool:
    """Whether the GEMMs of this call go to `grouped_mm`: the choice depends on
    sizes only, so a CUDA graph captured at one size replays the same kernels."""
    if num_rows < GROUPED_MM_MIN_ROWS_PER_EXPERT * w13_EFH.shape[0]:
        return False
    device = hidden_TH.device
    return (grouped_mm.supports(None, None, device, hidden_TH.dtype) is None
            and grouped_mm.aligned(w13_EFH.shape[2], w13_EFH.shape[1] // 2))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs follow torch's matmul setting, as torch.matmul would.
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def _run_experts(hidden_TH: torch.Tensor, weights_S: Optional[torch.Tensor],
                 ids_TK: torch.Tensor, w13_EFH: torch.Tensor, w2_EHI: torch.Tensor,
                 b13_EF: Optional[torch.Tensor], b2_EH: Optional[torch.Tensor],
                 activation: str, swiglu_alpha: float, swiglu_limit: float) -> torch.Tensor:
    if activation not in ACTIVATION_CODES:
        raise ValueError(f"activation must be one of {', '.join(map(repr, ACTIVATION_CODES))}, "
                         f"got {activation!r}")
    num_tokens, hidden_size = hidden_TH.shape
    top_k = ids_TK.shape[1]
    num_experts, inter_size = w13_EFH.shape[0], w13_EFH.shape[1] // 2
    if num_tokens == 0:
        return torch.empty((0, hidden_size), dtype=hidden_TH.dtype, device=hidden_TH.device)
    num_slots = num_tokens * top_k
    config = get_config(num_experts, inter_size, hidden_size, hidden_TH.dtype, num_tokens,
                        device_name(hidden_TH.device))
    sorted_row_ids_P, block_expert_B, num_padded_rows_1 = align_rows(
        ids_TK, num_experts, config.BLOCK_M)
    num_blocks_m = block_expert_B.shape[0]
    precision = _dot_precision(hidden_TH.dtype)
    tiles = dict(BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K,
                 GROUP_M=config.GROUP_M, num_warps=config.num_warps,
                 num_stages=config.num_stages)
    device, dtype = hidden_TH.device, hidden_TH.dtype

    inter_SI = torch.empty((num_slots, inter_size), dtype=dtype, device=device)
    # An absent bias is never read (HAS_BIAS=False): any tensor fills its slot.
    b13 = b13_EF if b13_EF is not None else w13_EFH
    moe_gate_up_act_kernel[(num_blocks_m * triton.cdiv(inter_size, config.BLOCK_N),)](
        hidden_TH, w13_EFH, b13, inter_SI, sorted_row_ids_P, block_expert_B, num_padded_rows_1,
        num_slots, num_blocks_m, hidden_size, inter_size,
        hidden_TH.stride(0), hidden_TH.stride(1),
        w13_EFH.stride(0), w13_EFH.stride(1), w13_EFH.stride(2),
        b13.stride(0), b13.stride(1),
        inter_SI.stride(0), inter_SI.stride(1),
        float(swiglu_alpha), float(swiglu_limit),
        TOP_K=top_k, ACTIVATION=ACTIVATION_CODES[activation], HAS_BIAS=b13_EF is not None,
        DOT_PRECISION=precision, **tiles)

    out_TH = torch.empty((num_tokens, hidden_size), dtype=dtype, device=device)
    # With one expert per token the per-slot rows are the output rows: the down
    # GEMM writes them in place and the last kernel only zeroes skipped rows.
    slot_SH = out_TH if top_k == 1 else torch.empty((num_slots, hidden_size), dtype=dtype,
                                                    device=device)
    b2 = b2_EH if b2_EH is not None else w2_EHI[:, :, 0]
    weights = weights_S if weights_S is not None else inter_SI
    moe_down_weighted_kernel[(num_blocks_m * triton.cdiv(hidden_size, config.BLOCK_N),)](
        inter_SI, w2_EHI, b2, weights, slot_SH,
        sorted_row_ids_P, block_expert_B, num_padded_rows_1,
        num_slots, num_blocks_m, hidden_size, inter_size,
        inter_SI.stride(0), inter_SI.stride(1),
        w2_EHI.stride(0), w2_EHI.stride(1), w2_EHI.stride(2),
        b2.stride(0), b2.stride(1),
        slot_SH.stride(0), slot_SH.stride(1),
        HAS_BIAS=b2_EH is not None, HAS_WEIGHTS=weights_S is not None,
        DOT_PRECISION=precision, **tiles)

    moe_sum_over_topk_kernel[(num_tokens, triton.cdiv(hidden_size, SUM_BLOCK_H))](
        slot_SH, ids_TK, out_TH, hidden_size,
        slot_SH.stride(0), ids_TK.stride(0), ids_TK.stride(1), out_TH.stride(0),
        TOP_K=top_k, SLOTS_ARE_OUT=top_k == 1, BLOCK_H=SUM_BLOCK_H)
    return out_TH


def fused_experts(hidden_TH: torch.Tensor, topk_weights_TK: torch.Tensor,
                  topk_ids_TK: torch.Tensor, w13_EFH: torch.Tensor, w2_EHI: torch.Tensor,
                  b13_EF: Optional[torch.Tensor], b2_EH: Optional[torch.Tensor],
                  activation: str, swiglu_alpha: float, swiglu_limit: float) -> torch.Tensor:
    """Every token through its top-k experts, weighted and summed: ``out_TH [T, H]``.

    Args:
        hidden_TH: ``[T, H]`` fp16, bf16 or fp32; any strides.
        topk_weights_TK: ``[T, K]`` any float dtype, read as fp32.
        topk_ids_TK: ``[T, K]`` int32 or int64; -1 skips the slot (no GEMM rows).
        w13_EFH: ``[E, 2*I, H]`` gate rows then up rows; ``w2_EHI``: ``[E, H, I]``.
        b13_EF: ``[E, 2*I]`` or None; ``b2_EH``: ``[E, H]`` or None.
        activation: ``"silu"``, ``"gelu"`` (erf) or ``"swiglu_oai"`` (uses
            ``swiglu_alpha`` and ``swiglu_limit``).

    Returns ``out_TH [T, H]`` in ``hidden_TH``'s dtype, contiguous; a token whose
    slots are all skipped gets zeros. Deterministic: no float atomics, the sum
    over k runs in k order in fp32. ``T == 0`` launches nothing.

    With at least ``GROUPED_MM_MIN_ROWS_PER_EXPERT`` rows per expert on average
    (prefill), bf16 on sm90+, the two GEMMs run on ``torch._grouped_mm`` with
    Triton epilogues instead (the `grouped_mm` backend).
    """
    if _use_grouped_mm(topk_ids_TK.numel(), hidden_TH, w13_EFH):
        return grouped_mm.experts(hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI,
                                  b13_EF, b2_EH, activation, swiglu_alpha, swiglu_limit)
    return _run_experts(hidden_TH, topk_weights_TK.reshape(-1), topk_ids_TK, w13_EFH, w2_EHI,
                        b13_EF, b2_EH, activation, swiglu_alpha, swiglu_limit)


def fused_experts_rows(x_RH: torch.Tensor, expert_R: torch.Tensor, count_E: torch.Tensor,
                       w13_EFH: torch.Tensor, w2_EHI: torch.Tensor,
                       b13_EF: Optional[torch.Tensor], b2_EH: Optional[torch.Tensor],
                       activation: str, swiglu_alpha: float,
                       swiglu_limit: float) -> torch.Tensor:
    """Each row through its own expert, unweighted: ``y_RH [R, H]``.

        y[r] = act(x[r] @ w13[e].T + b13[e]) @ w2[e].T + b2[e]  with e = expert_R[r] >= 0
        y[r] = 0                                                  where expert_R[r] == -1

    Args:
        x_RH: ``[R, H]`` fp16, bf16 or fp32.
        expert_R: ``[R]`` int32, each row's expert or -1.
        count_E: ``[E]`` int32, rows per expert. The rows format keeps rows grouped
            by expert, but the kernels group them again from ``expert_R``, so the
            result does not depend on ``count_E`` (it stays in the signature of
            ``moe::experts_rows``).
        w13_EFH, w2_EHI, b13_EF, b2_EH, activation, swiglu_alpha, swiglu_limit:
            as in `fused_experts`.

    Returns ``y_RH [R, H]`` in ``x_RH``'s dtype, contiguous.
    """
    if expert_R.dim() != 1:
        raise ValueError(f"expert_rows must be 1-D, got shape {tuple(expert_R.shape)}")
    if _use_grouped_mm(x_RH.shape[0], x_RH, w13_EFH):
        return grouped_mm.experts_rows(x_RH, expert_R, count_E, w13_EFH, w2_EHI, b13_EF, b2_EH,
                                       activation, swiglu_alpha, swiglu_limit)
    return _run_experts(x_RH, None, expert_R.unsqueeze(1), w13_EFH, w2_EHI, b13_EF, b2_EH,
                        activation, swiglu_alpha, swiglu_limit)
