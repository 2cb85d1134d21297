"""Elementwise Triton kernels around library grouped GEMMs (``torch._grouped_mm``).

Legend: T tokens, H hidden size, I expert intermediate size, F = 2 * I,
E experts, K experts per token, R = T * K rows sorted by expert.

    a[r]   = act(h[r, :I] + b13[e, :I], h[r, I:] + b13[e, I:])   e = expert[r] >= 0, else 0
    out[t] = sum over k with e = ids[t, k] >= 0 of
             weight[t, k] * (y[row_of_slot[t * K + k]] + b2[e])

Each reads its input once and writes its output once in the activation dtype,
in fp32 arithmetic: between the two GEMMs that is all the memory traffic a
layer needs. The sum runs over k in order, so it is deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch_moe_ops.backends.common.launch import launcher
from torch_moe_ops.backends.common.triton_activation import ACTIVATION_CODES, _activate

BLOCK_COLUMNS = 1024


@triton.jit
def moe_bias_act_rows_kernel(h_ptr, b13_ptr, expert_ptr, a_ptr, inter_size,
                             stride_h_r, stride_b13_e, stride_a_r,
                             swiglu_alpha, swiglu_limit,
                             ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
                             BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_range = cols < inter_size
    expert = tl.load(expert_ptr + row)
    if expert < 0:
        # Rows past the counted ones were never written by the GEMM: zero, never read.
        tl.store(a_ptr + row * stride_a_r + cols, tl.zeros([BLOCK], tl.float32)
                 .to(a_ptr.dtype.element_ty), mask=in_range)
    else:
        gate = tl.load(h_ptr + row * stride_h_r + cols, mask=in_range).to(tl.float32)
        up = tl.load(h_ptr + row * stride_h_r + inter_size + cols, mask=in_range).to(tl.float32)
        if HAS_BIAS:
            bias_row = b13_ptr + expert.to(tl.int64) * stride_b13_e
            gate += tl.load(bias_row + cols, mask=in_range).to(tl.float32)
            up += tl.load(bias_row + inter_size + cols, mask=in_range).to(tl.float32)
        a = _activate(gate, up, swiglu_alpha, swiglu_limit, ACTIVATION)
        tl.store(a_ptr + row * stride_a_r + cols, a.to(a_ptr.dtype.element_ty), mask=in_range)


@triton.jit
def moe_gather_weighted_sum_kernel(y_ptr, row_of_slot_ptr, weights_ptr, ids_ptr, b2_ptr, out_ptr,
                                   hidden_size, stride_y_r, stride_b2_e, stride_out_t,
                                   TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                                   BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_range = cols < hidden_size
    acc = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(TOP_K):
        slot = token * TOP_K + k
        expert = tl.load(ids_ptr + slot)
        if expert >= 0:
            row = tl.load(row_of_slot_ptr + slot).to(tl.int64)
            y = tl.load(y_ptr + row * stride_y_r + cols, mask=in_range).to(tl.float32)
            if HAS_BIAS:
                y += tl.load(b2_ptr + expert.to(tl.int64) * stride_b2_e + cols,
                             mask=in_range).to(tl.float32)
            acc += tl.load(weights_ptr + slot).to(tl.float32) * y
    tl.store(out_ptr + token * stride_out_t + cols, acc.to(out_ptr.dtype.element_ty),
             mask=in_range)


def bias_act_rows(h_RF: torch.Tensor, b13_EF: torch.Tensor | None, expert_R: torch.Tensor,
                  activation: str, swiglu_alpha: float, swiglu_limit: float) -> torch.Tensor:
    """``a_RI [R, I]`` in ``h_RF``'s dtype: bias, gated activation, 0 for rows of expert -1.

    ``h_RF [R, 2I]`` rows must be contiguous in the last dimension; ``expert_R [R]`` int.
    """
    num_rows, inter_size = h_RF.shape[0], h_RF.shape[1] // 2
    a_RI = torch.empty((num_rows, inter_size), dtype=h_RF.dtype, device=h_RF.device)
    if num_rows == 0:
        return a_RI
    bias = b13_EF if b13_EF is not None else h_RF
    launcher(moe_bias_act_rows_kernel)[(num_rows, triton.cdiv(inter_size, BLOCK_COLUMNS))](
        h_RF, bias, expert_R, a_RI, inter_size, h_RF.stride(0), bias.stride(0), a_RI.stride(0),
        float(swiglu_alpha), float(swiglu_limit), ACTIVATION=ACTIVATION_CODES[activation],
        HAS_BIAS=b13_EF is not None, BLOCK=BLOCK_COLUMNS)
    return a_RI


def gather_weighted_sum(y_RH: torch.Tensor, row_of_slot_S: torch.Tensor,
                        topk_weights_TK: torch.Tensor, topk_ids_TK: torch.Tensor,
                        b2_EH: torch.Tensor | None) -> torch.Tensor:
    """``out_TH [T, H]`` in ``y_RH``'s dtype: each token's rows, bias added, weighted, summed.

    ``row_of_slot_S [T*K]`` gives the row of slot ``t * K + k``; slots with id -1 are skipped.
    """
    num_tokens, top_k = topk_ids_TK.shape
    hidden_size = y_RH.shape[1]
    out_TH = torch.empty((num_tokens, hidden_size), dtype=y_RH.dtype, device=y_RH.device)
    if num_tokens == 0:
        return out_TH
    ids_S = topk_ids_TK.contiguous().view(-1)
    weights_S = topk_weights_TK.contiguous().view(-1)
    bias = b2_EH if b2_EH is not None else y_RH
    launcher(moe_gather_weighted_sum_kernel)[(num_tokens, triton.cdiv(hidden_size, BLOCK_COLUMNS))](
        y_RH, row_of_slot_S, weights_S, ids_S, bias, out_TH, hidden_size, y_RH.stride(0),
        bias.stride(0), out_TH.stride(0), TOP_K=top_k, HAS_BIAS=b2_EH is not None,
        BLOCK=BLOCK_COLUMNS)
    return out_TH
