"""Triton kernels of the fused MoE for a few tokens: each slot on its own, no align.

Legend: T tokens, H hidden size, I expert intermediate size, E experts,
K experts per token, S = T * K slots, N columns of one program's output.

    for each slot s with e = topk_ids[s] >= 0:
        inter[s] = act(hidden[s // K] @ w13[e].T + b13[e])                 moe_direct_gate_up_kernel
        slot[s]  = weight[s] * (inter[s] @ w2[e].T + b2[e])                moe_direct_down_kernel

(then `kernels.moe_sum_over_topk_kernel` sums each token's slots in k order).

With ``SPLIT_K`` > 1 each GEMM's K is cut into parts of whole K tiles, each part's
programs of their own: one token's few slots leave most SMs idle otherwise (GPT-OSS
widths, four slots: 180 programs of 64 columns for 132 SMs). The gate-up parts write
fp32 sums that `moe_direct_activate_kernel` adds in part order, with the bias and the
activation; the down parts write a row each, which the sum over the token's slots adds
in order. One token of GPT-OSS-20B in MXFP4 on an H200 (2026-11-29, tuned): 47.5 us in
one part, 34.3 us in four.

In decode each expert gets about one slot, so a grouped GEMM's tiles would be
mostly padding and the align's launches cost more than the kernels' work:
here a program multiplies one slot's row by a [N, H] slice of its expert's
weights (a matrix-vector product, reduced with tl.sum, so no tile needs 16
rows). Both GEMMs give each slot programs of its own, so a token's K experts
stream side by side on K times the SMs; the slots' rows are kept in fp32 and
summed in a fixed order, with no float atomics. (A down program per token
walking its K slots one after the other ran at a third of the byte rate:
one token, H100, GPT-OSS-20B widths, bf16 30.6 us and MXFP4 72.9 us for
16.6 and 33 MB.)

Quantized weights (``WEIGHT_FORMAT``, `quant_tiles`) are read as stored, fp8
bytes or packed MXFP4, each byte once. Weight-only formats widen them to fp32 in
registers. With fp8 activations (w8a8, ``ACT_FORMAT``) fp8 meets fp8 in the
tensor cores instead: the slot's row is the first of a 16-row tile (``tl.dot``
takes no fewer rows) whose other rows are zeros, and the product's rows are
summed, which is that row exactly. Widening every fp8 weight to fp32 made the
kernels convert-bound (one token, H200: 2.3-3.2x the byte floor at Mixtral and
DeepSeek-V3 widths); the tensor cores convert nothing. With both 0 the kernels
compile to the unquantized ones.

MXFP4 weights are decoded in PTX either way. Column tiles of ``MXFP4_DOT_MIN_N`` and
more meet the row in the tensor cores as the left operand of a 16-column tile (the row,
then zeros): read as fragments (``MXFP4_FRAGMENTS``, `fragment_gemms`), 3.1-4.3 SASS
instructions per weight, else decoded to scaled bf16 from the packed bytes
(`quant_tiles._mxfp4_bf16_pairs`), 7-8 (`benchmarks/kernel_sass.py`, GPT-OSS-20B
widths, sm90).
Narrower ones look the e2m1 values up as fp32 (`quant_tiles._e2m1_fp32`), multiply on
the CUDA cores and scale each group of 32 columns' sum: 6.3-6.7 instructions per
weight, where decoding to scaled bf16 and widening took 7.4-7.6. The narrow one loads
its weights with plain loads (through Triton's asynchronous copies it was slower:
`benchmarks/results/decode-H200-2026-11-29-fewer-launches.md`); the tensor-core one's
arrive through those copies (``num_stages``). The narrow gate-up kernel takes 26.4 us
at one token on an H200 (29.1 before the table lookup), about twice what its
instruction count alone costs there. Which is faster is measured by the tuner
(`tune.direct_candidates`): on an H200 (2026-11-29) fragments with K in four parts took
one token of GPT-OSS (34.3 us at 20B's widths), the row route in one part 47.5.
"""

from __future__ import annotations

import triton
import triton.language as tl

from torch_moe_ops.backends.common.kernels.triton_activation import _activate
from torch_moe_ops.backends.triton.fragment_gemms import (
    _fragments_from,
    _mxfp4_fragments_down_t,
    _mxfp4_fragments_gate_up_t,
)
from torch_moe_ops.backends.triton.quant_tiles import (
    FP8_BLOCK,
    FP8_TOKEN,
    MXFP4,
    _activation_scales,
    _fp8_weight_scales,
    _mma,
    _mxfp4_dot_t,
    _mxfp4_row_dot,
    _scale_after_loop,
)

# Rows of the tile one slot's row is padded to for tl.dot (its least M).
DOT_ROWS = tl.constexpr(16)
# MXFP4 column tiles this wide meet the slot's row in the tensor cores (the decoded weights
# the left operand, `_mxfp4_dot_t`); narrower ones in fp32 on the CUDA cores.
MXFP4_DOT_MIN_N = tl.constexpr(64)


@triton.jit
def _row_ptrs(row_ptrs):
    """``[DOT_ROWS, BK]`` pointers: each row's are ``row_ptrs [BK]`` (the tile reads the
    first row, zeros under it)."""
    return row_ptrs[None, :] + 0 * tl.arange(0, DOT_ROWS)[:, None]


@triton.jit
def _row_tile(row_ptrs, k_ok):
    """``[DOT_ROWS, BK]``: the row at ``row_ptrs [BK]`` first, zeros under it."""
    first = tl.arange(0, DOT_ROWS) == 0
    return tl.load(_row_ptrs(row_ptrs), mask=first[:, None] & k_ok[None, :], other=0.0)


@triton.jit
def _slot_expert(ids_ptr, slot, stride_ids_t, stride_ids_k, TOP_K: tl.constexpr):
    """The expert of slot ``slot`` (int64; -1 where the slot is skipped)."""
    return tl.load(ids_ptr + (slot // TOP_K) * stride_ids_t
                   + (slot % TOP_K) * stride_ids_k).to(tl.int64)


@triton.jit
def _k_part(k_size, split_size, SPLIT_K: tl.constexpr):
    """``(first, count)``: the K columns a program sums, all ``k_size`` of them, or
    with ``SPLIT_K`` > 1 the ``split_size`` (a multiple of BLOCK_K) of part program 2."""
    first = 0
    count = k_size
    if SPLIT_K > 1:
        first = tl.program_id(2) * split_size
        count = tl.minimum(k_size - first, split_size)
    return first, count


@triton.jit
def _biased_activation(gate, up, b13_ptr, expert, cols, col_ok, inter_size, stride_b13_e,
                       stride_b13_f, swiglu_alpha, swiglu_limit, ACTIVATION: tl.constexpr,
                       HAS_BIAS: tl.constexpr):
    """act(gate + b13[e, cols], up + b13[e, I + cols]), the bias where there is one."""
    if HAS_BIAS:
        bias_ptrs = b13_ptr + expert * stride_b13_e + cols * stride_b13_f
        gate += tl.load(bias_ptrs, mask=col_ok, other=0.0).to(tl.float32)
        up += tl.load(bias_ptrs + inter_size * stride_b13_f, mask=col_ok,
                      other=0.0).to(tl.float32)
    return _activate(gate, up, swiglu_alpha, swiglu_limit, ACTIVATION)


@triton.jit
def moe_direct_gate_up_kernel(
        hidden_ptr, ids_ptr, w13_ptr, b13_ptr, inter_ptr,
        hidden_size, inter_size, split_size,
        stride_hidden_t, stride_hidden_h, stride_ids_t, stride_ids_k,
        stride_w13_e, stride_w13_f, stride_w13_h,
        stride_b13_e, stride_b13_f,
        stride_inter_p, stride_inter_s, stride_inter_i,
        swiglu_alpha, swiglu_limit,
        x_scale_ptr, stride_xs_t, stride_xs_g,
        w13_scale_ptr, stride_ws_e, stride_ws_f, stride_ws_h,
        TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
        WEIGHT_FORMAT: tl.constexpr, ACT_FORMAT: tl.constexpr, SCALE_BN: tl.constexpr,
        SCALE_BK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        MXFP4_FRAGMENTS: tl.constexpr, SPLIT_K: tl.constexpr):
    """inter[s, n] = act(gate, up) for slot s = program 0, columns n of program 1.

    With ``SPLIT_K`` > 1, program 2 sums the ``split_size`` hidden columns of its part
    only, and ``inter`` is ``[SPLIT_K, S, 2 * I]`` fp32: each part's gate and up sums,
    before bias and activation (`moe_direct_activate_kernel` finishes them).

    Quantized (`quant_tiles`): ``hidden`` is the fp8 rows with ``x_scale`` where
    ``ACT_FORMAT`` says so, ``w13`` and ``w13_scale`` are in ``WEIGHT_FORMAT``;
    each K tile's sum is scaled as it is added.
    """
    slot = tl.program_id(0).to(tl.int64)
    token = slot // TOP_K
    expert = _slot_expert(ids_ptr, slot, stride_ids_t, stride_ids_k, TOP_K)
    # A skipped slot's row is never read by the down kernel: nothing to write.
    if expert < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter_size
    k_first, k_size = _k_part(hidden_size, split_size, SPLIT_K)
    gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if WEIGHT_FORMAT == MXFP4 and MXFP4_FRAGMENTS:
        ks = tl.arange(0, BLOCK_K)
        w13_part_ptr, w13_scale_part_ptr = _fragments_from(
            w13_ptr, w13_scale_ptr, k_first, stride_w13_h, stride_ws_h)
        gate_t, up_t = _mxfp4_fragments_gate_up_t(
            _row_ptrs(hidden_ptr + token * stride_hidden_t + (k_first + ks) * stride_hidden_h),
            tl.arange(0, DOT_ROWS) == 0, stride_hidden_h, k_size, w13_part_ptr,
            w13_scale_part_ptr, expert, cols, inter_size, stride_w13_e, stride_w13_f,
            stride_w13_h, stride_ws_e, stride_ws_f, stride_ws_h, DOT_ROWS, BLOCK_N, BLOCK_K,
            "ieee")
        # Only column 0 of the products is the row's; the others are zeros.
        gate = tl.sum(gate_t, axis=1)
        up = tl.sum(up_t, axis=1)
    elif WEIGHT_FORMAT == MXFP4 and BLOCK_N >= MXFP4_DOT_MIN_N:
        ks = tl.arange(0, BLOCK_K)
        ps = tl.arange(0, BLOCK_K // 2)
        gs = tl.arange(0, BLOCK_K // 32)
        x_ptrs = hidden_ptr + token * stride_hidden_t + (k_first + ks) * stride_hidden_h
        gate_ptrs = (w13_ptr + expert * stride_w13_e + cols[:, None] * stride_w13_f
                     + (k_first // 2 + ps[None, :]) * stride_w13_h)
        gate_scale_ptrs = (w13_scale_ptr + expert * stride_ws_e + cols[:, None] * stride_ws_f
                           + (k_first // 32 + gs[None, :]) * stride_ws_h)
        up_ptrs = gate_ptrs + inter_size * stride_w13_f
        up_scale_ptrs = gate_scale_ptrs + inter_size * stride_ws_f
        gate_t = tl.zeros((BLOCK_N, DOT_ROWS), dtype=tl.float32)
        up_t = tl.zeros((BLOCK_N, DOT_ROWS), dtype=tl.float32)
        for k in range(tl.cdiv(k_size, BLOCK_K)):
            left = k_size - k * BLOCK_K
            x_MK = _row_tile(x_ptrs, ks < left)
            w_ok = col_ok[:, None] & (ps < left // 2)[None, :]
            s_ok = col_ok[:, None] & (gs < left // 32)[None, :]
            gate_t = _mxfp4_dot_t(gate_t, x_MK, tl.load(gate_ptrs, mask=w_ok, other=0),
                                  tl.load(gate_scale_ptrs, mask=s_ok, other=0), "ieee")
            up_t = _mxfp4_dot_t(up_t, x_MK, tl.load(up_ptrs, mask=w_ok, other=0),
                                tl.load(up_scale_ptrs, mask=s_ok, other=0), "ieee")
            x_ptrs += BLOCK_K * stride_hidden_h
            gate_ptrs += (BLOCK_K // 2) * stride_w13_h
            up_ptrs += (BLOCK_K // 2) * stride_w13_h
            gate_scale_ptrs += (BLOCK_K // 32) * stride_ws_h
            up_scale_ptrs += (BLOCK_K // 32) * stride_ws_h
        # Only column 0 of the products is the row's; the others are zeros.
        gate = tl.sum(gate_t, axis=1)
        up = tl.sum(up_t, axis=1)
    elif WEIGHT_FORMAT == MXFP4:
        ps = tl.arange(0, BLOCK_K // 2)
        gs = tl.arange(0, BLOCK_K // 32)
        x_ptrs = hidden_ptr + token * stride_hidden_t + (k_first + 2 * ps) * stride_hidden_h
        gate_ptrs = (w13_ptr + expert * stride_w13_e + cols[:, None] * stride_w13_f
                     + (k_first // 2 + ps[None, :]) * stride_w13_h)
        gate_scale_ptrs = (w13_scale_ptr + expert * stride_ws_e + cols[:, None] * stride_ws_f
                           + (k_first // 32 + gs[None, :]) * stride_ws_h)
        for k in range(tl.cdiv(k_size, BLOCK_K)):
            left = k_size - k * BLOCK_K
            p_ok = ps < left // 2
            x_even = tl.load(x_ptrs, mask=p_ok, other=0.0).to(tl.float32)
            x_odd = tl.load(x_ptrs + stride_hidden_h, mask=p_ok, other=0.0).to(tl.float32)
            w_ok = col_ok[:, None] & p_ok[None, :]
            s_ok = col_ok[:, None] & (gs < left // 32)[None, :]
            gate += _mxfp4_row_dot(x_even, x_odd, tl.load(gate_ptrs, mask=w_ok, other=0),
                                   tl.load(gate_scale_ptrs, mask=s_ok, other=0), BLOCK_K,
                                   BLOCK_N)
            up += _mxfp4_row_dot(x_even, x_odd,
                                 tl.load(gate_ptrs + inter_size * stride_w13_f, mask=w_ok,
                                         other=0),
                                 tl.load(gate_scale_ptrs + inter_size * stride_ws_f, mask=s_ok,
                                         other=0), BLOCK_K, BLOCK_N)
            x_ptrs += BLOCK_K * stride_hidden_h
            gate_ptrs += (BLOCK_K // 2) * stride_w13_h
            gate_scale_ptrs += (BLOCK_K // 32) * stride_ws_h
    elif ACT_FORMAT != 0:
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = hidden_ptr + token * stride_hidden_t + (k_first + ks) * stride_hidden_h
        # [BK, BN] tiles, as tl.dot takes them.
        gate_ptrs = (w13_ptr + expert * stride_w13_e + cols[None, :] * stride_w13_f
                     + (k_first + ks[:, None]) * stride_w13_h)
        up_ptrs = gate_ptrs + inter_size * stride_w13_f
        gate_MN = tl.zeros((DOT_ROWS, BLOCK_N), dtype=tl.float32)
        up_MN = tl.zeros((DOT_ROWS, BLOCK_N), dtype=tl.float32)
        for k in range(tl.cdiv(k_size, BLOCK_K)):
            k_ok = ks < k_size - k * BLOCK_K
            x_MK = _row_tile(x_ptrs, k_ok)
            w_ok = k_ok[:, None] & col_ok[None, :]
            # Per K tile: fp8_group activations' and fp8_block weights' scales
            # (`_mma`); the others are applied after the loop.
            if ACT_FORMAT == FP8_TOKEN:
                row_scale = 1.0
            else:
                row_scale = _activation_scales(x_scale_ptr, token, expert >= 0,
                                               k_first + k * BLOCK_K, stride_xs_t, stride_xs_g,
                                               ACT_FORMAT, SCALE_BK)
            if WEIGHT_FORMAT == FP8_BLOCK:
                gate_scale = _fp8_weight_scales(w13_scale_ptr, expert, cols, col_ok,
                                                k_first + k * BLOCK_K, stride_ws_e, stride_ws_f,
                                                stride_ws_h, WEIGHT_FORMAT, SCALE_BN, SCALE_BK)
                up_scale = _fp8_weight_scales(w13_scale_ptr, expert, cols + inter_size, col_ok,
                                              k_first + k * BLOCK_K, stride_ws_e, stride_ws_f,
                                              stride_ws_h, WEIGHT_FORMAT, SCALE_BN, SCALE_BK)
            else:
                gate_scale = 1.0
                up_scale = 1.0
            gate_MN = _mma(gate_MN, x_MK, tl.load(gate_ptrs, mask=w_ok, other=0.0), row_scale,
                           gate_scale, WEIGHT_FORMAT, ACT_FORMAT, "ieee")
            up_MN = _mma(up_MN, x_MK, tl.load(up_ptrs, mask=w_ok, other=0.0), row_scale,
                         up_scale, WEIGHT_FORMAT, ACT_FORMAT, "ieee")
            x_ptrs += BLOCK_K * stride_hidden_h
            gate_ptrs += BLOCK_K * stride_w13_h
            up_ptrs += BLOCK_K * stride_w13_h
        # The scales left for after the loop (`_scale_after_loop` skips the rest).
        gate_cols = _fp8_weight_scales(w13_scale_ptr, expert, cols, col_ok, 0, stride_ws_e,
                                       stride_ws_f, stride_ws_h, WEIGHT_FORMAT, SCALE_BN,
                                       SCALE_BK)
        up_cols = _fp8_weight_scales(w13_scale_ptr, expert, cols + inter_size, col_ok, 0,
                                     stride_ws_e, stride_ws_f, stride_ws_h, WEIGHT_FORMAT,
                                     SCALE_BN, SCALE_BK)
        token_scale = _activation_scales(x_scale_ptr, token, expert >= 0, 0, stride_xs_t,
                                         stride_xs_g, ACT_FORMAT, SCALE_BK)
        gate = tl.sum(_scale_after_loop(gate_MN, token_scale, gate_cols, WEIGHT_FORMAT,
                                        ACT_FORMAT), axis=0)
        up = tl.sum(_scale_after_loop(up_MN, token_scale, up_cols, WEIGHT_FORMAT, ACT_FORMAT),
                    axis=0)
    else:
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = hidden_ptr + token * stride_hidden_t + (k_first + ks) * stride_hidden_h
        gate_ptrs = (w13_ptr + expert * stride_w13_e + cols[:, None] * stride_w13_f
                     + (k_first + ks[None, :]) * stride_w13_h)
        up_ptrs = gate_ptrs + inter_size * stride_w13_f
        token_scale = 1.0
        if ACT_FORMAT == FP8_TOKEN:
            token_scale = _activation_scales(x_scale_ptr, token, expert >= 0, 0, stride_xs_t,
                                             stride_xs_g, ACT_FORMAT, SCALE_BK)
        for k in range(tl.cdiv(k_size, BLOCK_K)):
            k_ok = ks < k_size - k * BLOCK_K
            x = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            if ACT_FORMAT == FP8_TOKEN:
                x *= token_scale
            elif ACT_FORMAT != 0:
                x *= _activation_scales(x_scale_ptr, token, expert >= 0, k_first + k * BLOCK_K,
                                        stride_xs_t, stride_xs_g, ACT_FORMAT, SCALE_BK)
            w_ok = col_ok[:, None] & k_ok[None, :]
            gate_k = tl.sum(tl.load(gate_ptrs, mask=w_ok, other=0.0).to(tl.float32) * x[None, :],
                            axis=1)
            up_k = tl.sum(tl.load(up_ptrs, mask=w_ok, other=0.0).to(tl.float32) * x[None, :],
                          axis=1)
            if WEIGHT_FORMAT == FP8_BLOCK:
                gate_k *= _fp8_weight_scales(w13_scale_ptr, expert, cols, col_ok,
                                             k_first + k * BLOCK_K, stride_ws_e, stride_ws_f,
                                             stride_ws_h, WEIGHT_FORMAT, SCALE_BN, SCALE_BK)
                up_k *= _fp8_weight_scales(w13_scale_ptr, expert, cols + inter_size, col_ok,
                                           k_first + k * BLOCK_K, stride_ws_e, stride_ws_f,
                                           stride_ws_h, WEIGHT_FORMAT, SCALE_BN, SCALE_BK)
            gate += gate_k
            up += up_k
            x_ptrs += BLOCK_K * stride_hidden_h
            gate_ptrs += BLOCK_K * stride_w13_h
            up_ptrs += BLOCK_K * stride_w13_h
        if WEIGHT_FORMAT != 0 and WEIGHT_FORMAT != FP8_BLOCK:
            gate *= _fp8_weight_scales(w13_scale_ptr, expert, cols, col_ok, 0, stride_ws_e,
                                       stride_ws_f, stride_ws_h, WEIGHT_FORMAT, SCALE_BN,
                                       SCALE_BK)
            up *= _fp8_weight_scales(w13_scale_ptr, expert, cols + inter_size, col_ok, 0,
                                     stride_ws_e, stride_ws_f, stride_ws_h, WEIGHT_FORMAT,
                                     SCALE_BN, SCALE_BK)
    if SPLIT_K > 1:
        part_ptrs = (inter_ptr + tl.program_id(2) * stride_inter_p + slot * stride_inter_s
                     + cols * stride_inter_i)
        tl.store(part_ptrs, gate, mask=col_ok)
        tl.store(part_ptrs + inter_size * stride_inter_i, up, mask=col_ok)
    else:
        act = _biased_activation(gate, up, b13_ptr, expert, cols, col_ok, inter_size,
                                 stride_b13_e, stride_b13_f, swiglu_alpha, swiglu_limit,
                                 ACTIVATION, HAS_BIAS)
        tl.store(inter_ptr + slot * stride_inter_s + cols * stride_inter_i,
                 act.to(inter_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def moe_direct_activate_kernel(
        part_ptr, ids_ptr, b13_ptr, inter_ptr, inter_size,
        stride_part_p, stride_part_s, stride_part_f, stride_ids_t, stride_ids_k,
        stride_b13_e, stride_b13_f, stride_inter_s, stride_inter_i,
        swiglu_alpha, swiglu_limit,
        TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
        SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """inter[s, n] = act(gate, up) for slot s = program 0, columns n of program 1, from
    the ``SPLIT_K`` parts' sums ``part [SPLIT_K, S, 2 * I]`` (fp32, gate then up
    columns) that `moe_direct_gate_up_kernel` wrote, added in part order."""
    slot = tl.program_id(0).to(tl.int64)
    expert = _slot_expert(ids_ptr, slot, stride_ids_t, stride_ids_k, TOP_K)
    if expert < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter_size
    part_ptrs = part_ptr + slot * stride_part_s + cols * stride_part_f
    gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for part in tl.static_range(SPLIT_K):
        gate += tl.load(part_ptrs + part * stride_part_p, mask=col_ok, other=0.0)
        up += tl.load(part_ptrs + part * stride_part_p + inter_size * stride_part_f,
                      mask=col_ok, other=0.0)
    act = _biased_activation(gate, up, b13_ptr, expert, cols, col_ok, inter_size, stride_b13_e,
                             stride_b13_f, swiglu_alpha, swiglu_limit, ACTIVATION, HAS_BIAS)
    tl.store(inter_ptr + slot * stride_inter_s + cols * stride_inter_i,
             act.to(inter_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def moe_direct_down_kernel(
        inter_ptr, ids_ptr, weights_ptr, w2_ptr, b2_ptr, slot_out_ptr,
        hidden_size, inter_size, split_size,
        stride_inter_s, stride_inter_i, stride_ids_t, stride_ids_k,
        stride_w2_e, stride_w2_h, stride_w2_i,
        stride_b2_e, stride_b2_h,
        stride_out_s, stride_out_h,
        x_scale_ptr, stride_xs_s, stride_xs_g,
        w2_scale_ptr, stride_ws_e, stride_ws_h, stride_ws_i,
        TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
        WEIGHT_FORMAT: tl.constexpr, ACT_FORMAT: tl.constexpr, SCALE_BN: tl.constexpr,
        SCALE_BK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        MXFP4_FRAGMENTS: tl.constexpr, SPLIT_K: tl.constexpr):
    """slot[s, n] = weight[s] * (inter[s] @ w2[e, n].T (+ b2[e, n])) for slot s =
    program 0, columns n of program 1; a skipped slot's row is not written.
    ``weights`` is ``[S]``, weight 1 without. With ``SPLIT_K`` > 1, ``slot`` is
    ``[S * SPLIT_K, H]``: row ``s * SPLIT_K + p`` holds part p's sum over its
    ``split_size`` intermediate columns (program 2), the bias in part 0's.

    Quantized as `moe_direct_gate_up_kernel`, with ``inter`` and ``x_scale`` the
    quantized intermediate rows.
    """
    slot = tl.program_id(0).to(tl.int64)
    expert = _slot_expert(ids_ptr, slot, stride_ids_t, stride_ids_k, TOP_K)
    # The sum over the token's slots skips this one.
    if expert < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden_size
    k_first, k_size = _k_part(inter_size, split_size, SPLIT_K)
    a_row_ptr = inter_ptr + slot * stride_inter_s
    w_ptr = w2_ptr + expert * stride_w2_e
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if WEIGHT_FORMAT == MXFP4 and MXFP4_FRAGMENTS:
        ks = tl.arange(0, BLOCK_K)
        w2_part_ptr, w2_scale_part_ptr = _fragments_from(w2_ptr, w2_scale_ptr, k_first,
                                                         stride_w2_i, stride_ws_i)
        acc = tl.sum(_mxfp4_fragments_down_t(
            _row_ptrs(a_row_ptr + (k_first + ks) * stride_inter_i),
            tl.arange(0, DOT_ROWS) == 0, stride_inter_i, k_size, w2_part_ptr,
            w2_scale_part_ptr, expert, cols, hidden_size, stride_w2_e, stride_w2_h,
            stride_w2_i, stride_ws_e, stride_ws_h, stride_ws_i, DOT_ROWS, BLOCK_N, BLOCK_K,
            "ieee"), axis=1)
    elif WEIGHT_FORMAT == MXFP4 and BLOCK_N >= MXFP4_DOT_MIN_N:
        ks = tl.arange(0, BLOCK_K)
        ps = tl.arange(0, BLOCK_K // 2)
        gs = tl.arange(0, BLOCK_K // 32)
        w_ptrs = w_ptr + cols[:, None] * stride_w2_h + (k_first // 2 + ps[None, :]) * stride_w2_i
        scale_ptrs = (w2_scale_ptr + expert * stride_ws_e + cols[:, None] * stride_ws_h
                      + (k_first // 32 + gs[None, :]) * stride_ws_i)
        acc_t = tl.zeros((BLOCK_N, DOT_ROWS), dtype=tl.float32)
        for k in range(tl.cdiv(k_size, BLOCK_K)):
            left = k_size - k * BLOCK_K
            acc_t = _mxfp4_dot_t(
                acc_t, _row_tile(a_row_ptr + (k_first + k * BLOCK_K + ks) * stride_inter_i,
                                 ks < left),
                tl.load(w_ptrs, mask=col_ok[:, None] & (ps < left // 2)[None, :], other=0),
                tl.load(scale_ptrs, mask=col_ok[:, None] & (gs < left // 32)[None, :], other=0),
                "ieee")
            w_ptrs += (BLOCK_K // 2) * stride_w2_i
            scale_ptrs += (BLOCK_K // 32) * stride_ws_i
        acc = tl.sum(acc_t, axis=1)
    elif WEIGHT_FORMAT == MXFP4:
        ps = tl.arange(0, BLOCK_K // 2)
        gs = tl.arange(0, BLOCK_K // 32)
        a_ptrs = a_row_ptr + (k_first + 2 * ps) * stride_inter_i
        w_ptrs = w_ptr + cols[:, None] * stride_w2_h + (k_first // 2 + ps[None, :]) * stride_w2_i
        scale_ptrs = (w2_scale_ptr + expert * stride_ws_e + cols[:, None] * stride_ws_h
                      + (k_first // 32 + gs[None, :]) * stride_ws_i)
        for k in range(tl.cdiv(k_size, BLOCK_K)):
            left = k_size - k * BLOCK_K
            p_ok = ps < left // 2
            a_even = tl.load(a_ptrs, mask=p_ok, other=0.0).to(tl.float32)
            a_odd = tl.load(a_ptrs + stride_inter_i, mask=p_ok, other=0.0).to(tl.float32)
            acc += _mxfp4_row_dot(
                a_even, a_odd, tl.load(w_ptrs, mask=col_ok[:, None] & p_ok[None, :], other=0),
                tl.load(scale_ptrs, mask=col_ok[:, None] & (gs < left // 32)[None, :], other=0),
                BLOCK_K, BLOCK_N)
            a_ptrs += BLOCK_K * stride_inter_i
            w_ptrs += (BLOCK_K // 2) * stride_w2_i
            scale_ptrs += (BLOCK_K // 32) * stride_ws_i
    elif ACT_FORMAT != 0:
        ks = tl.arange(0, BLOCK_K)
        acc_MN = tl.zeros((DOT_ROWS, BLOCK_N), dtype=tl.float32)
        for k in range(tl.cdiv(k_size, BLOCK_K)):
            k_ok = ks < k_size - k * BLOCK_K
            a_MK = _row_tile(a_row_ptr + (k_first + k * BLOCK_K + ks) * stride_inter_i, k_ok)
            w_KN = tl.load(w_ptr + cols[None, :] * stride_w2_h
                           + (k_first + k * BLOCK_K + ks)[:, None] * stride_w2_i,
                           mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            # Per K tile: fp8_group activations' and fp8_block weights' scales
            # (`_mma`); the others are applied after the loop.
            if ACT_FORMAT == FP8_TOKEN:
                row_scale = 1.0
            else:
                row_scale = _activation_scales(x_scale_ptr, slot, True, k_first + k * BLOCK_K,
                                               stride_xs_s, stride_xs_g, ACT_FORMAT, SCALE_BK)
            if WEIGHT_FORMAT == FP8_BLOCK:
                col_scale = _fp8_weight_scales(w2_scale_ptr, expert, cols, col_ok,
                                               k_first + k * BLOCK_K, stride_ws_e, stride_ws_h,
                                               stride_ws_i, WEIGHT_FORMAT, SCALE_BN, SCALE_BK)
            else:
                col_scale = 1.0
            acc_MN = _mma(acc_MN, a_MK, w_KN, row_scale, col_scale, WEIGHT_FORMAT, ACT_FORMAT,
                          "ieee")
        acc = tl.sum(_scale_after_loop(
            acc_MN,
            _activation_scales(x_scale_ptr, slot, True, 0, stride_xs_s, stride_xs_g,
                               ACT_FORMAT, SCALE_BK),
            _fp8_weight_scales(w2_scale_ptr, expert, cols, col_ok, 0, stride_ws_e, stride_ws_h,
                               stride_ws_i, WEIGHT_FORMAT, SCALE_BN, SCALE_BK),
            WEIGHT_FORMAT, ACT_FORMAT), axis=0)
    else:
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_row_ptr + (k_first + ks) * stride_inter_i
        w_ptrs = w_ptr + cols[:, None] * stride_w2_h + (k_first + ks[None, :]) * stride_w2_i
        for k in range(tl.cdiv(k_size, BLOCK_K)):
            k_ok = ks < k_size - k * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            acc_k = tl.sum(tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :],
                                   other=0.0).to(tl.float32) * a[None, :], axis=1)
            if WEIGHT_FORMAT == FP8_BLOCK:
                acc_k *= _fp8_weight_scales(w2_scale_ptr, expert, cols, col_ok,
                                            k_first + k * BLOCK_K, stride_ws_e, stride_ws_h,
                                            stride_ws_i, WEIGHT_FORMAT, SCALE_BN, SCALE_BK)
            acc += acc_k
            a_ptrs += BLOCK_K * stride_inter_i
            w_ptrs += BLOCK_K * stride_w2_i
        if WEIGHT_FORMAT != 0 and WEIGHT_FORMAT != FP8_BLOCK:
            acc *= _fp8_weight_scales(w2_scale_ptr, expert, cols, col_ok, 0, stride_ws_e,
                                      stride_ws_h, stride_ws_i, WEIGHT_FORMAT, SCALE_BN, SCALE_BK)
    # Part 0's row carries the bias (a compile-time test, then a run-time one).
    if HAS_BIAS:  # noqa: SIM102
        if tl.program_id(2) == 0:
            acc += tl.load(b2_ptr + expert * stride_b2_e + cols * stride_b2_h, mask=col_ok,
                           other=0.0).to(tl.float32)
    if HAS_WEIGHTS:
        acc *= tl.load(weights_ptr + slot).to(tl.float32)
    tl.store(slot_out_ptr + (slot * SPLIT_K + tl.program_id(2)) * stride_out_s
             + cols * stride_out_h, acc.to(slot_out_ptr.dtype.element_ty), mask=col_ok)
