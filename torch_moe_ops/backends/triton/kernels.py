"""Triton kernels of the fused MoE: two grouped GEMMs over expert-sorted rows and
a deterministic sum over each token's experts.

Legend: T tokens, H hidden size, I expert intermediate size, E experts,
K experts per token, S = T * K slots, P padded rows (see `align`), M / N rows /
columns of one program's output tile.

    for each block b of M sorted rows with expert e = block_expert[b] >= 0:
        inter[s]  = act(hidden[s // K] @ w13[e].T + b13[e])            moe_gate_up_act_kernel
        slot[s]   = weight[s] * (inter[s] @ w2[e].T + b2[e])           moe_down_weighted_kernel
    out[t] = sum over k with topk_ids[t, k] >= 0 of slot[t * K + k]    moe_sum_over_topk_kernel

``inter`` and ``slot`` are indexed by slot, not by sorted row, so neither holds
padding and a skipped slot (id -1) is never written nor read. Each kernel
accumulates in fp32 and rounds once when it stores.

The GEMM kernels also read quantized weights (``WEIGHT_FORMAT``) and fp8
activation rows (``ACT_FORMAT``) with their scales (`quant_tiles`); with both
0 they compile to the unquantized kernels. MXFP4 weights are read packed as stored, or,
with ``MXFP4_FRAGMENTS`` (bf16 activations), as fragments (`fragment_gemms`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from torch_moe_ops.backends.common.kernels.triton_activation import _activate
from torch_moe_ops.backends.triton.fragment_gemms import (
    _mxfp4_fragments_down_t,
    _mxfp4_fragments_gate_up_t,
)
from torch_moe_ops.backends.triton.quant_tiles import (
    FP8_BLOCK,
    MXFP4,
    _activation_scales,
    _fp8_weight_scales,
    _mma,
    _mxfp4_dot_t,
    _scale_after_loop,
)


@triton.jit
def _tile_of_program(pid, num_blocks_m, num_blocks_n, GROUP_M: tl.constexpr):
    # Programs that run together take GROUP_M row blocks across all column
    # blocks, so the rows they gather are reused from L2.
    per_group = GROUP_M * num_blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _rows_of_program(num_padded_ptr, block_expert_ptr, sorted_row_ids_ptr, num_slots,
                     num_blocks_m, num_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     GROUP_M: tl.constexpr):
    """The tile of this program: whether it has work, its expert, its slots and columns."""
    pid_m, pid_n = _tile_of_program(tl.program_id(0), num_blocks_m, tl.cdiv(num_cols, BLOCK_N),
                                    GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    # Blocks past the padded rows, or of no expert, hold no row to compute.
    active = (pid_m * BLOCK_M < tl.load(num_padded_ptr)) & (expert >= 0)
    slots = tl.load(sorted_row_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return active, expert, slots, slots < num_slots, cols, cols < num_cols


@triton.jit
def _row_scales(scale_ptr, rows, row_ok, k_start, stride_r, stride_g,
                ACT_FORMAT: tl.constexpr, SCALE_BK: tl.constexpr):
    """``[M, 1]`` fp8 activation scales of the rows for the K tile at ``k_start``
    (1.0 for activations that are not fp8)."""
    if ACT_FORMAT == 0:
        return 1.0
    else:
        return _activation_scales(scale_ptr, rows, row_ok, k_start, stride_r, stride_g,
                                  ACT_FORMAT, SCALE_BK)[:, None]


@triton.jit
def moe_gate_up_act_kernel(
        hidden_ptr, w13_ptr, b13_ptr, inter_ptr,
        sorted_row_ids_ptr, block_expert_ptr, num_padded_ptr,
        num_slots, num_blocks_m, hidden_size, inter_size,
        stride_hidden_t, stride_hidden_h,
        stride_w13_e, stride_w13_f, stride_w13_h,
        stride_b13_e, stride_b13_f,
        stride_inter_s, stride_inter_i,
        swiglu_alpha, swiglu_limit,
        x_scale_ptr, stride_xs_t, stride_xs_g,
        w13_scale_ptr, stride_ws_e, stride_ws_f, stride_ws_h,
        TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
        DOT_PRECISION: tl.constexpr, WEIGHT_FORMAT: tl.constexpr, ACT_FORMAT: tl.constexpr,
        SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        MXFP4_FRAGMENTS: tl.constexpr):
    """inter[s, n] = act(gate, up) with gate / up = hidden[s // K] @ w13[e, n (+ I)].T (+ b13).

    Quantized (`quant_tiles`): ``hidden`` is the fp8 rows with ``x_scale`` where
    ``ACT_FORMAT`` says so, ``w13`` and ``w13_scale`` are in ``WEIGHT_FORMAT``.
    """
    active, expert, slots, slot_ok, cols, col_ok = _rows_of_program(
        num_padded_ptr, block_expert_ptr, sorted_row_ids_ptr, num_slots, num_blocks_m,
        inter_size, BLOCK_M, BLOCK_N, GROUP_M)
    if not active:
        return
    rows = slots // TOP_K
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # The gate and up columns of one tile are I rows apart in w13: one program
    # computes both so the activation is applied before anything is stored.
    if WEIGHT_FORMAT == MXFP4 and MXFP4_FRAGMENTS:
        ks = tl.arange(0, BLOCK_K)
        gate_t, up_t = _mxfp4_fragments_gate_up_t(
            hidden_ptr + rows[:, None] * stride_hidden_t + ks[None, :] * stride_hidden_h,
            slot_ok, stride_hidden_h, hidden_size, w13_ptr, w13_scale_ptr, expert, cols,
            inter_size, stride_w13_e, stride_w13_f, stride_w13_h, stride_ws_e, stride_ws_f,
            stride_ws_h, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
        gate = tl.trans(gate_t)
        up = tl.trans(up_t)
    elif WEIGHT_FORMAT == MXFP4:
        ks = tl.arange(0, BLOCK_K)
        ps = tl.arange(0, BLOCK_K // 2)
        gs = tl.arange(0, BLOCK_K // 32)
        a_ptrs = hidden_ptr + rows[:, None] * stride_hidden_t + ks[None, :] * stride_hidden_h
        # [BN, P] packed tiles and [BN, M] sums: the weights are the left operand.
        gate_ptrs = (w13_ptr + expert * stride_w13_e + cols[:, None] * stride_w13_f
                     + ps[None, :] * stride_w13_h)
        gate_scale_ptrs = (w13_scale_ptr + expert * stride_ws_e + cols[:, None] * stride_ws_f
                           + gs[None, :] * stride_ws_h)
        gate_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        up_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(tl.cdiv(hidden_size, BLOCK_K)):
            left = hidden_size - k * BLOCK_K
            a = tl.load(a_ptrs, mask=slot_ok[:, None] & (ks < left)[None, :], other=0.0)
            w_ok = col_ok[:, None] & (ps < left // 2)[None, :]
            s_ok = col_ok[:, None] & (gs < left // 32)[None, :]
            gate_t = _mxfp4_dot_t(gate_t, a, tl.load(gate_ptrs, mask=w_ok, other=0),
                                  tl.load(gate_scale_ptrs, mask=s_ok, other=0), DOT_PRECISION)
            up_t = _mxfp4_dot_t(up_t, a,
                                tl.load(gate_ptrs + inter_size * stride_w13_f, mask=w_ok,
                                        other=0),
                                tl.load(gate_scale_ptrs + inter_size * stride_ws_f, mask=s_ok,
                                        other=0), DOT_PRECISION)
            a_ptrs += BLOCK_K * stride_hidden_h
            gate_ptrs += (BLOCK_K // 2) * stride_w13_h
            gate_scale_ptrs += (BLOCK_K // 32) * stride_ws_h
        gate = tl.trans(gate_t)
        up = tl.trans(up_t)
    else:
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = (hidden_ptr + rows[:, None] * stride_hidden_t
                  + ks[None, :] * stride_hidden_h)
        gate_ptrs = (w13_ptr + expert * stride_w13_e + cols[None, :] * stride_w13_f
                     + ks[:, None] * stride_w13_h)
        up_ptrs = gate_ptrs + inter_size * stride_w13_f
        for k in range(tl.cdiv(hidden_size, BLOCK_K)):
            k_ok = ks < hidden_size - k * BLOCK_K
            a = tl.load(a_ptrs, mask=slot_ok[:, None] & k_ok[None, :], other=0.0)
            w_ok = k_ok[:, None] & col_ok[None, :]
            gate_w = tl.load(gate_ptrs, mask=w_ok, other=0.0)
            up_w = tl.load(up_ptrs, mask=w_ok, other=0.0)
            if WEIGHT_FORMAT == 0:
                gate = tl.dot(a, gate_w, gate, input_precision=DOT_PRECISION)
                up = tl.dot(a, up_w, up, input_precision=DOT_PRECISION)
            elif WEIGHT_FORMAT == FP8_BLOCK:
                a_scale = _row_scales(x_scale_ptr, rows, slot_ok, k * BLOCK_K, stride_xs_t,
                                      stride_xs_g, ACT_FORMAT, SCALE_BK)
                gate = _mma(gate, a, gate_w, a_scale, _fp8_weight_scales(
                    w13_scale_ptr, expert, cols, col_ok, k * BLOCK_K, stride_ws_e, stride_ws_f,
                    stride_ws_h, WEIGHT_FORMAT, SCALE_BN, SCALE_BK), WEIGHT_FORMAT, ACT_FORMAT,
                    DOT_PRECISION)
                up = _mma(up, a, up_w, a_scale, _fp8_weight_scales(
                    w13_scale_ptr, expert, cols + inter_size, col_ok, k * BLOCK_K, stride_ws_e,
                    stride_ws_f, stride_ws_h, WEIGHT_FORMAT, SCALE_BN, SCALE_BK), WEIGHT_FORMAT,
                    ACT_FORMAT, DOT_PRECISION)
            else:
                gate = _mma(gate, a, gate_w, 1.0, 1.0, WEIGHT_FORMAT, ACT_FORMAT, DOT_PRECISION)
                up = _mma(up, a, up_w, 1.0, 1.0, WEIGHT_FORMAT, ACT_FORMAT, DOT_PRECISION)
            a_ptrs += BLOCK_K * stride_hidden_h
            gate_ptrs += BLOCK_K * stride_w13_h
            up_ptrs += BLOCK_K * stride_w13_h
        if WEIGHT_FORMAT != 0 and WEIGHT_FORMAT != FP8_BLOCK:
            row_scale = _row_scales(x_scale_ptr, rows, slot_ok, 0, stride_xs_t, stride_xs_g,
                                    ACT_FORMAT, SCALE_BK)
            gate_scale = _fp8_weight_scales(w13_scale_ptr, expert, cols, col_ok, 0, stride_ws_e,
                                            stride_ws_f, stride_ws_h, WEIGHT_FORMAT, SCALE_BN,
                                            SCALE_BK)
            up_scale = _fp8_weight_scales(w13_scale_ptr, expert, cols + inter_size, col_ok, 0,
                                          stride_ws_e, stride_ws_f, stride_ws_h, WEIGHT_FORMAT,
                                          SCALE_BN, SCALE_BK)
            gate = _scale_after_loop(gate, row_scale, gate_scale, WEIGHT_FORMAT, ACT_FORMAT)
            up = _scale_after_loop(up, row_scale, up_scale, WEIGHT_FORMAT, ACT_FORMAT)
    if HAS_BIAS:
        bias_ptrs = b13_ptr + expert * stride_b13_e + cols * stride_b13_f
        gate += tl.load(bias_ptrs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias_ptrs + inter_size * stride_b13_f, mask=col_ok,
                      other=0.0).to(tl.float32)[None, :]
    act = _activate(gate, up, swiglu_alpha, swiglu_limit, ACTIVATION)
    tl.store(inter_ptr + slots[:, None] * stride_inter_s + cols[None, :] * stride_inter_i,
             act.to(inter_ptr.dtype.element_ty), mask=slot_ok[:, None] & col_ok[None, :])


@triton.jit
def moe_down_weighted_kernel(
        inter_ptr, w2_ptr, b2_ptr, weights_ptr, slot_out_ptr,
        sorted_row_ids_ptr, block_expert_ptr, num_padded_ptr,
        num_slots, num_blocks_m, hidden_size, inter_size,
        stride_inter_s, stride_inter_i,
        stride_w2_e, stride_w2_h, stride_w2_i,
        stride_b2_e, stride_b2_h,
        stride_out_s, stride_out_h,
        x_scale_ptr, stride_xs_s, stride_xs_g,
        w2_scale_ptr, stride_ws_e, stride_ws_h, stride_ws_i,
        HAS_BIAS: tl.constexpr, HAS_WEIGHTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
        WEIGHT_FORMAT: tl.constexpr, ACT_FORMAT: tl.constexpr, SCALE_BN: tl.constexpr,
        SCALE_BK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, MXFP4_FRAGMENTS: tl.constexpr):
    """slot[s, n] = weight[s] * (inter[s] @ w2[e, n].T (+ b2[e, n])), weight 1 without weights.

    Quantized as `moe_gate_up_act_kernel`, with ``inter`` and ``x_scale`` the
    quantized intermediate rows.
    """
    active, expert, slots, slot_ok, cols, col_ok = _rows_of_program(
        num_padded_ptr, block_expert_ptr, sorted_row_ids_ptr, num_slots, num_blocks_m,
        hidden_size, BLOCK_M, BLOCK_N, GROUP_M)
    if not active:
        return
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if WEIGHT_FORMAT == MXFP4 and MXFP4_FRAGMENTS:
        ks = tl.arange(0, BLOCK_K)
        acc = tl.trans(_mxfp4_fragments_down_t(
            inter_ptr + slots[:, None] * stride_inter_s + ks[None, :] * stride_inter_i,
            slot_ok, stride_inter_i, inter_size, w2_ptr, w2_scale_ptr, expert, cols,
            hidden_size, stride_w2_e, stride_w2_h, stride_w2_i, stride_ws_e, stride_ws_h,
            stride_ws_i, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION))
    elif WEIGHT_FORMAT == MXFP4:
        ks = tl.arange(0, BLOCK_K)
        ps = tl.arange(0, BLOCK_K // 2)
        gs = tl.arange(0, BLOCK_K // 32)
        a_ptrs = inter_ptr + slots[:, None] * stride_inter_s + ks[None, :] * stride_inter_i
        w_ptrs = (w2_ptr + expert * stride_w2_e + cols[:, None] * stride_w2_h
                  + ps[None, :] * stride_w2_i)
        scale_ptrs = (w2_scale_ptr + expert * stride_ws_e + cols[:, None] * stride_ws_h
                      + gs[None, :] * stride_ws_i)
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(tl.cdiv(inter_size, BLOCK_K)):
            left = inter_size - k * BLOCK_K
            acc_t = _mxfp4_dot_t(
                acc_t, tl.load(a_ptrs, mask=slot_ok[:, None] & (ks < left)[None, :], other=0.0),
                tl.load(w_ptrs, mask=col_ok[:, None] & (ps < left // 2)[None, :], other=0),
                tl.load(scale_ptrs, mask=col_ok[:, None] & (gs < left // 32)[None, :], other=0),
                DOT_PRECISION)
            a_ptrs += BLOCK_K * stride_inter_i
            w_ptrs += (BLOCK_K // 2) * stride_w2_i
            scale_ptrs += (BLOCK_K // 32) * stride_ws_i
        acc = tl.trans(acc_t)
    else:
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = inter_ptr + slots[:, None] * stride_inter_s + ks[None, :] * stride_inter_i
        w_ptrs = (w2_ptr + expert * stride_w2_e + cols[None, :] * stride_w2_h
                  + ks[:, None] * stride_w2_i)
        for k in range(tl.cdiv(inter_size, BLOCK_K)):
            k_ok = ks < inter_size - k * BLOCK_K
            a = tl.load(a_ptrs, mask=slot_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if WEIGHT_FORMAT == 0:
                acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
            elif WEIGHT_FORMAT == FP8_BLOCK:
                acc = _mma(acc, a, w, _row_scales(x_scale_ptr, slots, slot_ok, k * BLOCK_K,
                                                  stride_xs_s, stride_xs_g, ACT_FORMAT, SCALE_BK),
                           _fp8_weight_scales(w2_scale_ptr, expert, cols, col_ok, k * BLOCK_K,
                                              stride_ws_e, stride_ws_h, stride_ws_i,
                                              WEIGHT_FORMAT, SCALE_BN, SCALE_BK),
                           WEIGHT_FORMAT, ACT_FORMAT, DOT_PRECISION)
            else:
                acc = _mma(acc, a, w, 1.0, 1.0, WEIGHT_FORMAT, ACT_FORMAT, DOT_PRECISION)
            a_ptrs += BLOCK_K * stride_inter_i
            w_ptrs += BLOCK_K * stride_w2_i
        if WEIGHT_FORMAT != 0 and WEIGHT_FORMAT != FP8_BLOCK:
            row_scale = _row_scales(x_scale_ptr, slots, slot_ok, 0, stride_xs_s, stride_xs_g,
                                    ACT_FORMAT, SCALE_BK)
            col_scale = _fp8_weight_scales(w2_scale_ptr, expert, cols, col_ok, 0, stride_ws_e,
                                           stride_ws_h, stride_ws_i, WEIGHT_FORMAT, SCALE_BN,
                                           SCALE_BK)
            acc = _scale_after_loop(acc, row_scale, col_scale, WEIGHT_FORMAT, ACT_FORMAT)
    if HAS_BIAS:
        acc += tl.load(b2_ptr + expert * stride_b2_e + cols * stride_b2_h, mask=col_ok,
                       other=0.0).to(tl.float32)[None, :]
    if HAS_WEIGHTS:
        acc *= tl.load(weights_ptr + slots, mask=slot_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(slot_out_ptr + slots[:, None] * stride_out_s + cols[None, :] * stride_out_h,
             acc.to(slot_out_ptr.dtype.element_ty), mask=slot_ok[:, None] & col_ok[None, :])


@triton.jit
def moe_sum_over_topk_kernel(
        slot_ptr, ids_ptr, out_ptr, hidden_size,
        stride_slot_s, stride_ids_t, stride_ids_k, stride_out_t,
        TOP_K: tl.constexpr, PARTS: tl.constexpr, SLOTS_ARE_OUT: tl.constexpr,
        BLOCK_H: tl.constexpr):
    """out[t] = sum of slot[t * K + k] over the k with ids[t, k] >= 0, in k order.
    With ``PARTS`` > 1 each slot has that many rows (``[(t * K + k) * PARTS + p]``,
    the direct down kernel's parts), added in order.

    With ``SLOTS_ARE_OUT`` (K == 1, slot and out one buffer) only the rows of
    skipped slots are written, with zeros.
    """
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < hidden_size
    if SLOTS_ARE_OUT:
        if tl.load(ids_ptr + token * stride_ids_t) < 0:
            tl.store(out_ptr + token * stride_out_t + cols,
                     tl.zeros((BLOCK_H,), dtype=out_ptr.dtype.element_ty), mask=col_ok)
    else:
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        # Masked, not branched on: no load waits for another's, so all are in flight at
        # once (one token's sum was a chain of 2K round trips, 3 us of an H200).
        for k in tl.static_range(TOP_K):
            # The id read as a row of copies: a mask of the columns' shape.
            taken = tl.load(ids_ptr + token * stride_ids_t + k * stride_ids_k + 0 * cols) >= 0
            for part in tl.static_range(PARTS):
                acc += tl.load(slot_ptr + ((token * TOP_K + k) * PARTS + part) * stride_slot_s
                               + cols, mask=col_ok & taken, other=0.0).to(tl.float32)
        tl.store(out_ptr + token * stride_out_t + cols, acc.to(out_ptr.dtype.element_ty),
                 mask=col_ok)
