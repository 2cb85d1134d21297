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
"""

from __future__ import annotations

import triton
import triton.language as tl

from torch_moe_ops.backends.common.triton_activation import _activate


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
def moe_gate_up_act_kernel(
        hidden_ptr, w13_ptr, b13_ptr, inter_ptr,
        sorted_row_ids_ptr, block_expert_ptr, num_padded_ptr,
        num_slots, num_blocks_m, hidden_size, inter_size,
        stride_hidden_t, stride_hidden_h,
        stride_w13_e, stride_w13_f, stride_w13_h,
        stride_b13_e, stride_b13_f,
        stride_inter_s, stride_inter_i,
        swiglu_alpha, swiglu_limit,
        TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
        DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """inter[s, n] = act(gate, up) with gate / up = hidden[s // K] @ w13[e, n (+ I)].T (+ b13)."""
    active, expert, slots, slot_ok, cols, col_ok = _rows_of_program(
        num_padded_ptr, block_expert_ptr, sorted_row_ids_ptr, num_slots, num_blocks_m,
        inter_size, BLOCK_M, BLOCK_N, GROUP_M)
    if not active:
        return
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = (hidden_ptr + (slots // TOP_K)[:, None] * stride_hidden_t
              + ks[None, :] * stride_hidden_h)
    # The gate and up columns of one tile are I rows apart in w13: one program
    # computes both so the activation is applied before anything is stored.
    gate_ptrs = (w13_ptr + expert * stride_w13_e + cols[None, :] * stride_w13_f
                 + ks[:, None] * stride_w13_h)
    up_ptrs = gate_ptrs + inter_size * stride_w13_f
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(tl.cdiv(hidden_size, BLOCK_K)):
        k_ok = ks < hidden_size - k * BLOCK_K
        a = tl.load(a_ptrs, mask=slot_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        gate = tl.dot(a, tl.load(gate_ptrs, mask=w_ok, other=0.0), gate,
                      input_precision=DOT_PRECISION)
        up = tl.dot(a, tl.load(up_ptrs, mask=w_ok, other=0.0), up,
                    input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_hidden_h
        gate_ptrs += BLOCK_K * stride_w13_h
        up_ptrs += BLOCK_K * stride_w13_h
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
        HAS_BIAS: tl.constexpr, HAS_WEIGHTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr):
    """slot[s, n] = weight[s] * (inter[s] @ w2[e, n].T (+ b2[e, n])), weight 1 without weights."""
    active, expert, slots, slot_ok, cols, col_ok = _rows_of_program(
        num_padded_ptr, block_expert_ptr, sorted_row_ids_ptr, num_slots, num_blocks_m,
        hidden_size, BLOCK_M, BLOCK_N, GROUP_M)
    if not active:
        return
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = inter_ptr + slots[:, None] * stride_inter_s + ks[None, :] * stride_inter_i
    w_ptrs = (w2_ptr + expert * stride_w2_e + cols[None, :] * stride_w2_h
              + ks[:, None] * stride_w2_i)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(tl.cdiv(inter_size, BLOCK_K)):
        k_ok = ks < inter_size - k * BLOCK_K
        a = tl.load(a_ptrs, mask=slot_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_inter_i
        w_ptrs += BLOCK_K * stride_w2_i
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
        TOP_K: tl.constexpr, SLOTS_ARE_OUT: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = sum of slot[t * K + k] over the k with ids[t, k] >= 0, in k order.

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
        for k in tl.static_range(TOP_K):
            if tl.load(ids_ptr + token * stride_ids_t + k * stride_ids_k) >= 0:
                acc += tl.load(slot_ptr + (token * TOP_K + k) * stride_slot_s + cols,
                               mask=col_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + token * stride_out_t + cols, acc.to(out_ptr.dtype.element_ty),
                 mask=col_ok)
