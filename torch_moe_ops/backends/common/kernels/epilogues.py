"""Elementwise Triton kernels around library grouped GEMMs (``torch._grouped_mm``).

Legend: T tokens, H hidden size, I expert intermediate size, F = 2 * I,
E experts, K experts per token, R = T * K rows sorted by expert, X the elements
of one expert's gradient.

Forward:

    x[r]   = values[order[r] // K]                                  e = expert[r] >= 0
    a[r]   = act(h[r, :I] + b13[e, :I], h[r, I:] + b13[e, I:])   e = expert[r] >= 0
    out[t] = sum over k with e = ids[t, k] >= 0 of
             weight[t, k] * (y[row_of_slot[t * K + k]] + b2[e])

Backward (`common.kernels.grouped_backward` says what each step is for), per row r of
expert e >= 0 with routing weight w[r] and ``gw2[r] = grad_out[t] @ w2[e]``:

    dot[r]     = <gw2[r], a[r]>
    dh[r]      = act'(h[r] + b13[e]) * (w[r] * gw2[r])      (gate part, then up part)
    wa[r]      = w[r] * a[r]
    grad[e]    = 0 where count[e] == 0                      (in place)

Each reads its input once and writes its output once in the activation dtype,
in fp32 arithmetic: between the GEMMs that is all the memory traffic a layer
needs. Sums over a token's slots run over k in order, so they are deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch_moe_ops.backends.common.kernels.launch import cdiv, launcher, next_power_of_2
from torch_moe_ops.backends.common.kernels.triton_activation import (
    ACTIVATION_CODES,
    _activate,
    _activate_backward,
)

BLOCK_COLUMNS = 1024
# Elements of one expert's gradient per step of a program of the zeroing kernel.
BLOCK_ZERO = 4096
# Programs of the zeroing kernel, over all experts. Each loads its expert's count and
# stores only where it is 0, which training batches seldom have: one program per block
# of every expert ran 230k programs for Mixtral's w13 gradient, 113 us of loads (0.8% of
# its training step on an H100); these programs loop over their expert's blocks instead.
ZERO_PROGRAMS = 1024


@triton.jit
def moe_routed_rows_kernel(values_ptr, order_ptr, expert_ptr, out_ptr, hidden_size,
                           stride_values_t, stride_out_r, TOP_K: tl.constexpr,
                           BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    # A row of expert -1 costs one load: with expert parallelism most of a rank's slots
    # belong to other ranks' experts (3 in 4 at 4 ranks).
    if tl.load(expert_ptr + row) >= 0:
        token = tl.load(order_ptr + row).to(tl.int64) // TOP_K
        in_range = cols < hidden_size
        values = tl.load(values_ptr + token * stride_values_t + cols, mask=in_range)
        tl.store(out_ptr + row * stride_out_r + cols, values.to(out_ptr.dtype.element_ty),
                 mask=in_range)


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
    # Rows of expert -1 follow the counted ones, which the GEMM never wrote and the next
    # GEMM never reads: left unwritten (most of a rank's rows under expert parallelism).
    if expert >= 0:
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


@triton.jit
def moe_bias_act_backward_rows_kernel(h_ptr, b13_ptr, expert_ptr, gw2_ptr, weight_ptr, dh_ptr,
                                      wa_ptr, dot_ptr, inter_size, stride_h_r, stride_b13_e,
                                      stride_gw2_r, stride_dh_r, stride_wa_r,
                                      swiglu_alpha, swiglu_limit,
                                      ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
                                      BLOCK: tl.constexpr):
    # One program per row: the row's dot product sums over all its columns
    # in one place, in order (no atomics).
    row = tl.program_id(0).to(tl.int64)
    expert = tl.load(expert_ptr + row)
    # Rows of expert -1 (past the counted ones) are left unwritten: nothing reads them.
    if expert >= 0:
        weight = tl.load(weight_ptr + row).to(tl.float32)
        dot = tl.zeros([BLOCK], tl.float32)
        for start in range(0, inter_size, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            in_range = cols < inter_size
            h_row = h_ptr + row * stride_h_r
            gate = tl.load(h_row + cols, mask=in_range, other=0.0).to(tl.float32)
            up = tl.load(h_row + inter_size + cols, mask=in_range, other=0.0).to(tl.float32)
            if HAS_BIAS:
                bias_row = b13_ptr + expert.to(tl.int64) * stride_b13_e
                gate += tl.load(bias_row + cols, mask=in_range, other=0.0).to(tl.float32)
                up += tl.load(bias_row + inter_size + cols, mask=in_range,
                              other=0.0).to(tl.float32)
            gw2 = tl.load(gw2_ptr + row * stride_gw2_r + cols, mask=in_range,
                          other=0.0).to(tl.float32)
            a, d_gate, d_up = _activate_backward(gate, up, swiglu_alpha, swiglu_limit,
                                                 ACTIVATION)
            dot += gw2 * a
            grad_a = weight * gw2
            dh_row = dh_ptr + row * stride_dh_r
            tl.store(dh_row + cols, (grad_a * d_gate).to(dh_ptr.dtype.element_ty),
                     mask=in_range)
            tl.store(dh_row + inter_size + cols, (grad_a * d_up).to(dh_ptr.dtype.element_ty),
                     mask=in_range)
            tl.store(wa_ptr + row * stride_wa_r + cols, (weight * a).to(wa_ptr.dtype.element_ty),
                     mask=in_range)
        tl.store(dot_ptr + row, tl.sum(dot, axis=0))


@triton.jit
def moe_zero_empty_experts_kernel(grad_ptr, count_ptr, numel_per_expert, BLOCK: tl.constexpr):
    expert = tl.program_id(1).to(tl.int64)
    # Only the experts without rows are written: the others cost one load.
    if tl.load(count_ptr + expert) == 0:
        zeros = tl.zeros([BLOCK], tl.float32).to(grad_ptr.dtype.element_ty)
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, numel_per_expert, step):
            offsets = start + tl.arange(0, BLOCK)
            tl.store(grad_ptr + expert * numel_per_expert + offsets, zeros,
                     mask=offsets < numel_per_expert)


def routed_rows(values_TH: torch.Tensor, order_R: torch.Tensor, expert_R: torch.Tensor,
                top_k: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x_RH [R, H]`` in ``dtype`` (default ``values_TH``'s): row ``r`` holds
    ``values_TH[order_R[r] // top_k]`` where ``expert_R[r] >= 0``; the rows of expert -1
    are left unwritten (undefined), so only the routed rows cost memory traffic.

    ``values_TH [T, H]``; ``order_R`` and ``expert_R [R]`` int (`sorting.sort_rows`).
    """
    if values_TH.stride(-1) != 1:
        values_TH = values_TH.contiguous()
    num_rows, hidden_size = order_R.shape[0], values_TH.shape[1]
    x_RH = torch.empty((num_rows, hidden_size), dtype=dtype or values_TH.dtype,
                       device=values_TH.device)
    if num_rows == 0 or hidden_size == 0:
        return x_RH
    # One program per row and block of columns, as the other kernels here: a program per
    # row looping over the columns moved 1.9 TB/s at DeepSeek-V3 widths on an H100.
    launcher(moe_routed_rows_kernel)[(num_rows, cdiv(hidden_size, BLOCK_COLUMNS))](
        values_TH, order_R, expert_R, x_RH, hidden_size, values_TH.stride(0), x_RH.stride(0),
        TOP_K=top_k, BLOCK=BLOCK_COLUMNS)
    return x_RH


def bias_act_rows(h_RF: torch.Tensor, b13_EF: torch.Tensor | None, expert_R: torch.Tensor,
                  activation: str, swiglu_alpha: float, swiglu_limit: float) -> torch.Tensor:
    """``a_RI [R, I]`` in ``h_RF``'s dtype: bias, gated activation; rows of expert -1 are
    left unwritten (undefined), as the grouped GEMMs leave the rows past the counted ones.

    ``h_RF [R, 2I]`` rows must be contiguous in the last dimension; ``expert_R [R]`` int.
    """
    num_rows, inter_size = h_RF.shape[0], h_RF.shape[1] // 2
    a_RI = torch.empty((num_rows, inter_size), dtype=h_RF.dtype, device=h_RF.device)
    if num_rows == 0:
        return a_RI
    bias = b13_EF if b13_EF is not None else h_RF
    launcher(moe_bias_act_rows_kernel)[(num_rows, cdiv(inter_size, BLOCK_COLUMNS))](
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
    launcher(moe_gather_weighted_sum_kernel)[(num_tokens, cdiv(hidden_size, BLOCK_COLUMNS))](
        y_RH, row_of_slot_S, weights_S, ids_S, bias, out_TH, hidden_size, y_RH.stride(0),
        bias.stride(0), out_TH.stride(0), TOP_K=top_k, HAS_BIAS=b2_EH is not None,
        BLOCK=BLOCK_COLUMNS)
    return out_TH


def bias_act_backward_rows(h_RF: torch.Tensor, b13_EF: torch.Tensor | None,
                           expert_R: torch.Tensor, gw2_RI: torch.Tensor, weight_R: torch.Tensor,
                           activation: str, swiglu_alpha: float, swiglu_limit: float
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dh_RF, wa_RI, dot_R)``: the backward of `bias_act_rows` in one pass (see the
    module docstring); ``dh_RF`` and ``wa_RI`` in ``h_RF``'s dtype, ``dot_R`` fp32.

    ``h_RF [R, 2I]`` and ``gw2_RI [R, I]`` rows must be contiguous in the last
    dimension; ``weight_R [R]`` fp32; ``expert_R [R]`` int. Rows of expert -1 are
    left undefined.
    """
    num_rows, inter_size = h_RF.shape[0], h_RF.shape[1] // 2
    dh_RF = torch.empty((num_rows, 2 * inter_size), dtype=h_RF.dtype, device=h_RF.device)
    wa_RI = torch.empty((num_rows, inter_size), dtype=h_RF.dtype, device=h_RF.device)
    dot_R = torch.empty((num_rows,), dtype=torch.float32, device=h_RF.device)
    if num_rows == 0:
        return dh_RF, wa_RI, dot_R
    bias = b13_EF if b13_EF is not None else h_RF
    launcher(moe_bias_act_backward_rows_kernel)[(num_rows,)](
        h_RF, bias, expert_R, gw2_RI, weight_R, dh_RF, wa_RI, dot_R, inter_size, h_RF.stride(0),
        bias.stride(0), gw2_RI.stride(0), dh_RF.stride(0), wa_RI.stride(0),
        float(swiglu_alpha), float(swiglu_limit), ACTIVATION=ACTIVATION_CODES[activation],
        HAS_BIAS=b13_EF is not None,
        BLOCK=min(BLOCK_COLUMNS, next_power_of_2(inter_size)))
    return dh_RF, wa_RI, dot_R


def sum_token_rows(values_RH: torch.Tensor, row_of_slot_S: torch.Tensor,
                   topk_ids_TK: torch.Tensor) -> torch.Tensor:
    """``out_TH [T, H]`` in ``values_RH``'s dtype: ``sum_k values[row_of_slot[t * K + k]]``
    over the slots with ``topk_ids >= 0``, in fp32 and slot order."""
    ones_TK = torch.ones(topk_ids_TK.shape, dtype=torch.float32, device=values_RH.device)
    return gather_weighted_sum(values_RH, row_of_slot_S, ones_TK, topk_ids_TK, None)


def zero_empty_experts_(grad_EX: torch.Tensor, count_E: torch.Tensor) -> torch.Tensor:
    """``grad_EX`` (contiguous, ``[E, ...]``) with the slices of experts whose
    ``count_E`` is 0 set to zero, in place; returns it."""
    num_experts = grad_EX.shape[0]
    numel_per_expert = grad_EX.numel() // num_experts if num_experts else 0
    if numel_per_expert == 0:
        return grad_EX
    programs_per_expert = min(cdiv(numel_per_expert, BLOCK_ZERO),
                              max(1, ZERO_PROGRAMS // num_experts))
    grid = (programs_per_expert, num_experts)
    launcher(moe_zero_empty_experts_kernel)[grid](grad_EX, count_E, numel_per_expert,
                                                  BLOCK=BLOCK_ZERO)
    return grad_EX
