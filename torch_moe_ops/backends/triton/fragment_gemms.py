"""The K loops of the Triton GEMM kernels on MXFP4 fragments (`mxfp4_fragments`): one for
the gate and up products, one for the down product, shared by the tiled kernels (`kernels`:
a block of sorted rows) and the decode kernels (`direct_kernels`: one slot's row, then zeros).

Legend: M rows of the activation tile, N weight rows (output columns) and BN of them per
program, BK columns per K step; ``_t`` names a transposed ``[BN, M]`` sum, the weights the
left operand of the product (`quant_tiles._mxfp4_fragments_dot_t`).

The weight and scale pointers are the fragments' (``[E, N / 64, K / 64 * 2048]`` words,
``[E, N / 64, K / 64 * 128]`` scales) with their strides over experts, 64-row blocks and
bytes; the kernels take them in the place of the stored weights' (``MXFP4_FRAGMENTS``).
K is a multiple of 64 and the columns of a program are whole 64-row blocks, those past N
masked.
"""

from __future__ import annotations

import triton
import triton.language as tl

from torch_moe_ops.backends.triton.quant_tiles import (
    FRAGMENT_BLOCK_BYTES,
    FRAGMENT_BLOCK_SCALES,
    _mxfp4_fragments_dot_t,
)


@triton.jit
def _fragment_ptrs(words_ptr, scales_ptr, expert, cols, num_cols, stride_we, stride_wb,
                   stride_wk, stride_se, stride_sb, stride_sk, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """The first K tile of the fragments of the columns ``cols`` (whole 64-row blocks of
    the weights): pointers to its words ``[2 BN, BK / 4]`` and scales ``[2 BN, BK / 16]``,
    whether each thread row's block exists, and the 64-column block of each byte of the
    words and of the scales."""
    threads = tl.arange(0, 2 * BLOCK_N)
    block = tl.min(cols, axis=0) // 64 + threads // 128
    thread = threads % 128
    word_bytes = tl.arange(0, BLOCK_K // 4)
    scale_bytes = tl.arange(0, BLOCK_K // 16)
    w_ptrs = (words_ptr + expert * stride_we + block[:, None] * stride_wb
              + ((word_bytes // 16)[None, :] * FRAGMENT_BLOCK_BYTES + thread[:, None] * 16
                 + (word_bytes % 16)[None, :]) * stride_wk)
    s_ptrs = (scales_ptr + expert * stride_se + block[:, None] * stride_sb
              + ((scale_bytes // 4)[None, :] * FRAGMENT_BLOCK_SCALES + (thread // 4)[:, None] * 4
                 + (scale_bytes % 4)[None, :]) * stride_sk)
    return w_ptrs, s_ptrs, block < num_cols // 64, word_bytes // 16, scale_bytes // 4


@triton.jit
def _fragments_from(words_ptr, scales_ptr, k_first, stride_wk, stride_sk):
    """The fragments' word and scale pointers moved to K column ``k_first`` (a multiple of
    64), so that the loops below read from there."""
    blocks = k_first // 64
    return (words_ptr + blocks * FRAGMENT_BLOCK_BYTES * stride_wk,
            scales_ptr + blocks * FRAGMENT_BLOCK_SCALES * stride_sk)


@triton.jit
def _mxfp4_fragments_gate_up_t(a_ptrs, a_rows_ok, stride_ak, k_size, w13_ptr, w13_scale_ptr,
                               expert, cols, inter_size, stride_we, stride_wb, stride_wk,
                               stride_se, stride_sb, stride_sk, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               DOT_PRECISION: tl.constexpr):
    """``(gate_t, up_t)``, each ``[BN, M]`` fp32: the rows ``a_ptrs [M, BK]`` (the first K
    tile's; rows where ``a_rows_ok`` is False read as zeros) times ``w13``'s gate rows
    ``cols`` and their up rows, I rows (I / 64 blocks) further."""
    ks = tl.arange(0, BLOCK_K)
    gate_ptrs, gate_scale_ptrs, block_ok, word_block, scale_block = _fragment_ptrs(
        w13_ptr, w13_scale_ptr, expert, cols, inter_size, stride_we, stride_wb, stride_wk,
        stride_se, stride_sb, stride_sk, BLOCK_N, BLOCK_K)
    up_w_offset = (inter_size // 64) * stride_wb
    up_s_offset = (inter_size // 64) * stride_sb
    gate_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    up_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(tl.cdiv(k_size, BLOCK_K)):
        left_blocks = (k_size - k * BLOCK_K) // 64
        a = tl.load(a_ptrs, mask=a_rows_ok[:, None] & (ks < left_blocks * 64)[None, :],
                    other=0.0)
        w_ok = block_ok[:, None] & (word_block < left_blocks)[None, :]
        s_ok = block_ok[:, None] & (scale_block < left_blocks)[None, :]
        gate_t = _mxfp4_fragments_dot_t(
            gate_t, a, tl.load(gate_ptrs, mask=w_ok, other=0),
            tl.load(gate_scale_ptrs, mask=s_ok, other=0), BLOCK_N, BLOCK_K, DOT_PRECISION)
        up_t = _mxfp4_fragments_dot_t(
            up_t, a, tl.load(gate_ptrs + up_w_offset, mask=w_ok, other=0),
            tl.load(gate_scale_ptrs + up_s_offset, mask=s_ok, other=0), BLOCK_N, BLOCK_K,
            DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        gate_ptrs += (BLOCK_K // 64) * FRAGMENT_BLOCK_BYTES * stride_wk
        gate_scale_ptrs += (BLOCK_K // 64) * FRAGMENT_BLOCK_SCALES * stride_sk
    return gate_t, up_t


@triton.jit
def _mxfp4_fragments_down_t(a_ptrs, a_rows_ok, stride_ak, k_size, w2_ptr, w2_scale_ptr,
                            expert, cols, hidden_size, stride_we, stride_wb, stride_wk,
                            stride_se, stride_sb, stride_sk, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            DOT_PRECISION: tl.constexpr):
    """``acc_t [BN, M]`` fp32: the rows ``a_ptrs [M, BK]`` (as in
    `_mxfp4_fragments_gate_up_t`) times ``w2``'s rows ``cols``."""
    ks = tl.arange(0, BLOCK_K)
    w_ptrs, scale_ptrs, block_ok, word_block, scale_block = _fragment_ptrs(
        w2_ptr, w2_scale_ptr, expert, cols, hidden_size, stride_we, stride_wb, stride_wk,
        stride_se, stride_sb, stride_sk, BLOCK_N, BLOCK_K)
    acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(tl.cdiv(k_size, BLOCK_K)):
        left_blocks = (k_size - k * BLOCK_K) // 64
        acc_t = _mxfp4_fragments_dot_t(
            acc_t, tl.load(a_ptrs, mask=a_rows_ok[:, None] & (ks < left_blocks * 64)[None, :],
                           other=0.0),
            tl.load(w_ptrs, mask=block_ok[:, None] & (word_block < left_blocks)[None, :],
                    other=0),
            tl.load(scale_ptrs, mask=block_ok[:, None] & (scale_block < left_blocks)[None, :],
                    other=0), BLOCK_N, BLOCK_K, DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += (BLOCK_K // 64) * FRAGMENT_BLOCK_BYTES * stride_wk
        scale_ptrs += (BLOCK_K // 64) * FRAGMENT_BLOCK_SCALES * stride_sk
    return acc_t
