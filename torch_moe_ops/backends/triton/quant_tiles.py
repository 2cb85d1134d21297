"""Quantized operands of the fused-MoE kernels: the format codes the kernels take,
and the @triton.jit helpers that read scales and decode MXFP4 in registers
(`torch_moe_ops.quant` defines the formats; `QuantSpec` names them).

Legend: E experts, N output columns, K input columns of one weight matrix;
M rows, BN columns and BK depth of one program's tile (BLOCK_M, BLOCK_N,
BLOCK_K), P = BK / 2 packed bytes, G = BK / 32 MXFP4 scale groups.

    fp8_tensor   w[n, k] = q[n, k] * s[e]                      scaled after the K loop
    fp8_channel  w[n, k] = q[n, k] * s[e, n]                   scaled after the K loop
    fp8_block    w[n, k] = q[n, k] * s[e, n // bn, k // bk]    scaled per K tile (BK divides bk)
    mxfp4        w[n, k] = e2m1(nibble k % 2 of q[n, k // 2]) * 2 ** (s[e, n, k // 32] - 127)
    activations  x[m, k] = q[m, k] * a[m] (fp8_token) or * a[m, k // bk] (fp8_group)

A K tile of MXFP4 weights is read as its packed bytes ``[BN, P]`` with its
scales ``[BN, G]``. On the GPU the tiles of rows (`_mxfp4_dot_t`, the weights the
left operand) decode them to scaled bf16 in PTX (`_mxfp4_bf16_pairs`); the decode
kernels' single rows (`_mxfp4_row_dot`) look the e2m1 values up unscaled, to fp32, in
PTX (`_e2m1_fp32`), and scale each group's sum. Tiles of fp16 rows meet them in
``tl.dot_scaled``; tiles of fp32 rows and the interpreter decode them with Triton
arithmetic (`_mxfp4_tiles`). Tiles read as fragments (`mxfp4_fragments`) are decoded by
`_mxfp4_fragment_pairs`. `tests/test_mxfp4_ptx.py` runs the three PTX decodes
on the CPU.

Measured (H200, 2026-11-28, torch 2.11, Triton 3.6, same call, GPT-OSS-20B widths,
us, two kernels): the PTX decode against the one before it (``tl.dot_scaled``
with the activations on the left for tiles, the Triton decode to fp32 for rows):
one token 57.5 against 70.0, 16 tokens 302.1 against 365.7; the best tiled
config at 4096 tokens 2855 against 3222.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from torch_moe_ops.backends.triton import mxfp4_fragments
from torch_moe_ops.config import QuantSpec

# `WEIGHT_FORMAT` of the kernels (0: unquantized weights in the activations' dtype).
FP8_TENSOR = tl.constexpr(1)
FP8_CHANNEL = tl.constexpr(2)
FP8_BLOCK = tl.constexpr(3)
MXFP4 = tl.constexpr(4)
WEIGHT_FORMAT_CODES = {None: 0, "fp8_tensor": FP8_TENSOR.value, "fp8_channel": FP8_CHANNEL.value,
                       "fp8_block": FP8_BLOCK.value, "mxfp4": MXFP4.value}
# `ACT_FORMAT` of the kernels: what the activations a GEMM reads are (0: its own dtype).
FP8_TOKEN = tl.constexpr(1)
FP8_GROUP = tl.constexpr(2)
ACT_FORMAT_CODES = {"none": 0, "fp8_token": FP8_TOKEN.value, "fp8_group": FP8_GROUP.value}
# `tl.dot_scaled`'s operand formats, as constexprs (a string literal stays a str where
# Triton 3.6 reads `.value`).
E2M1 = tl.constexpr("e2m1")
FP16 = tl.constexpr("fp16")
# Under Triton's interpreter no PTX runs: the decodes written in PTX
# (`_mxfp4_bf16_pairs`) give way there to the ones written in Triton.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
# float16 bits with an e2m1 nibble in them read as its value * 2 ** -14 (see _e2m1_halves).
E2M1_IN_FP16 = tl.constexpr(16384.0)


def _e2m1_pairs_ptx(out: str, pair: str, scale: str, em_shift: int, sign_shift: int) -> str:
    """PTX of one bf16x2 output of `_mxfp4_bf16_pairs`: the nibbles of the two bytes in
    ``pair``'s half-words (their exponent-mantissa bits shifted left by ``em_shift`` to bits
    6-8, their sign by ``sign_shift`` to bit 15), times 2 ** 126, times ``scale``."""
    return (f" shl.b32 a, {pair}, {em_shift}; and.b32 a, a, 0x01C001C0;"
            f" shl.b32 b, {pair}, {sign_shift}; and.b32 b, b, 0x80008000; or.b32 a, a, b;"
            f" fma.rn.bf16x2 a, a, bias, negz; fma.rn.bf16x2 {out}, a, {scale}, negz;")


# $4 holds four packed bytes and $5 their four scale bytes; t0 / t1 and s0 / s1 put bytes
# 0-1 and 2-3 of each in the low bytes of a register's half-words. Outputs: $0 / $1 the
# low nibbles (even K columns) of bytes 0-1 / 2-3, $2 / $3 the high nibbles (odd columns).
# One line: torch 2.11's Inductor pastes a kernel's globals, repr'd, into a triple-quoted
# string of its generated module, where an escaped newline becomes a real one.
MXFP4_BF16_PAIRS_PTX = tl.constexpr(
    "{ .reg .b32 z, t0, t1, s0, s1, a, b, bias, negz;"
    " mov.b32 z, 0; mov.b32 bias, 0x7E807E80; mov.b32 negz, 0x80008000;"
    " prmt.b32 t0, $4, z, 0x4140; prmt.b32 t1, $4, z, 0x4342;"
    " prmt.b32 s0, $5, z, 0x4140; prmt.b32 s1, $5, z, 0x4342;"
    " shl.b32 s0, s0, 7; shl.b32 s1, s1, 7;" + "".join(
        _e2m1_pairs_ptx(out, pair, scale, em_shift, sign_shift)
        for out, pair, scale, em_shift, sign_shift in (
            ("$0", "t0", "s0", 6, 12), ("$1", "t1", "s1", 6, 12),
            ("$2", "t0", "s0", 2, 8), ("$3", "t1", "s1", 2, 8))) + " }")


# e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 as bf16 (0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000,
# 0x4040, 0x4080, 0x40C0): their high bytes and their low bytes, 8-entry tables that one
# prmt.b32 reads four magnitudes from (`E2M1_FP32_PTX`).
E2M1_HIGH_BYTES = (0x3F3F3F00, 0x40404040)
E2M1_LOW_BYTES = (0xC0800000, 0xC0804000)
# $8 holds four packed bytes b0-b3; m their nibbles' magnitudes (bit 3 of each cleared, as
# prmt.b32 reads a selector's bit 3 as a mode). h01 / l01: the tables' high / low bytes
# for the four nibbles of b0-b1, h23 / l23 for those of b2-b3. e01 pairs them into the
# bf16 of b0's and b1's low nibbles (even K columns), o01 of their high nibbles (odd
# columns), e23 / o23 the same for b2-b3. s01 / s23 put b0-b1 / b2-b3 in the high byte of
# each half-word: a high nibble's sign bit (the byte's bit 7) lands on its half-word's
# sign bit, a low nibble's (bit 3) 4 bits under it. Each bf16 widened to fp32 is its
# bits in the high half-word. Outputs, fp32: $0-$3 the low nibbles of b0-b3, $4-$7 their
# high nibbles. One line, as MXFP4_BF16_PAIRS_PTX.
E2M1_FP32_PTX = tl.constexpr(
    "{ .reg .b32 m, m23, h01, l01, h23, l23, s01, s23, t, z, e01, e23, o01, o23;"
    " mov.b32 z, 0; and.b32 m, $8, 0x77777777; shr.b32 m23, m, 16;"
    + "".join(f" prmt.b32 {out}, 0x{table[0]:08X}, 0x{table[1]:08X}, {nibbles};"
              for out, table, nibbles in (("h01", E2M1_HIGH_BYTES, "m"),
                                          ("l01", E2M1_LOW_BYTES, "m"),
                                          ("h23", E2M1_HIGH_BYTES, "m23"),
                                          ("l23", E2M1_LOW_BYTES, "m23")))
    + " prmt.b32 e01, l01, h01, 0x6240; prmt.b32 o01, l01, h01, 0x7351;"
    " prmt.b32 e23, l23, h23, 0x6240; prmt.b32 o23, l23, h23, 0x7351;"
    " prmt.b32 s01, $8, z, 0x1404; prmt.b32 s23, $8, z, 0x3424;"
    + "".join(f" and.b32 t, s{b}, 0x80008000; or.b32 o{b}, o{b}, t;"
              f" shl.b32 t, s{b}, 4; and.b32 t, t, 0x80008000; or.b32 e{b}, e{b}, t;"
              for b in ("01", "23"))
    + "".join(f" shl.b32 ${2 * i}, {pair}, 16; and.b32 ${2 * i + 1}, {pair}, 0xFFFF0000;"
              for i, pair in enumerate(("e01", "e23", "o01", "o23"))) + " }")


# MXFP4 fragments (`mxfp4_fragments`): $4 holds one word, four bf16 pairs of 8 weights,
# and $5 four scale bytes (row q = 0, row q = 1, then both again). f0 / f1 are the bf16 pairs
# of rows 0 / 1's factors (a byte << 7 is a bf16 exponent). Pairs 0-2 are the word shifted
# left by 0, 3 and 6 and masked (their sign at bit 15, exponent and mantissa at bits 8-6, a
# pair's high nibble 16 bits up: its value times 2 ** -126); pair 3 gathers its sign (bit 11,
# left 4), exponent (bits 14-13, right 6) and mantissa (bit 10, right 4). Each times its row's
# factor: $0, $1 the pairs (o = 0, q = 0), (0, 1); $2, $3 (1, 0), (1, 1). One line, as
# MXFP4_BF16_PAIRS_PTX.
MXFP4_FRAGMENT_PTX = tl.constexpr(
    "{ .reg .b32 a, b, f0, f1;"
    " and.b32 f0, $5, 0x00FF00FF; shl.b32 f0, f0, 7;"
    " and.b32 f1, $5, 0xFF00FF00; shr.b32 f1, f1, 1;"
    + "".join(f" shl.b32 a, $4, {shift}; and.b32 a, a, 0x81C081C0;"
              f" mul.rn.bf16x2 ${pair}, a, f{pair % 2};"
              for pair, shift in enumerate((0, 3, 6)))
    + " shl.b32 a, $4, 4; and.b32 a, a, 0x80008000;"
    " shr.b32 b, $4, 6; and.b32 b, b, 0x01800180; or.b32 a, a, b;"
    " shr.b32 b, $4, 4; and.b32 b, b, 0x00400040; or.b32 a, a, b;"
    " mul.rn.bf16x2 $3, a, f1; }")
# Bytes and scale bytes of one 64 x 64 block of fragments.
FRAGMENT_BLOCK_BYTES = tl.constexpr(mxfp4_fragments.BLOCK_BYTES)
FRAGMENT_BLOCK_SCALES = tl.constexpr(mxfp4_fragments.BLOCK_SCALES)


def format_codes(spec: QuantSpec | None) -> dict:
    """The format constexprs of a kernel launch: ``WEIGHT_FORMAT``, ``ACT_FORMAT``
    and the scale block ``SCALE_BN`` x ``SCALE_BK`` (1 x 1 without blocks)."""
    if spec is None:
        return dict(WEIGHT_FORMAT=0, ACT_FORMAT=0, SCALE_BN=1, SCALE_BK=1)
    block_n, block_k = spec.block_size or (1, 1)
    return dict(WEIGHT_FORMAT=WEIGHT_FORMAT_CODES[spec.weights],
                ACT_FORMAT=ACT_FORMAT_CODES[spec.activations], SCALE_BN=block_n,
                SCALE_BK=block_k)


@triton.jit
def _fp8_weight_scales(scale_ptr, expert, cols, col_ok, k_start, stride_e, stride_n, stride_k,
                       WEIGHT_FORMAT: tl.constexpr, SCALE_BN: tl.constexpr,
                       SCALE_BK: tl.constexpr):
    """The scale of each column of the fp8 weight tile whose K range starts at
    ``k_start``: ``[BN]`` fp32, one scalar per tensor."""
    base = scale_ptr + expert * stride_e
    if WEIGHT_FORMAT == FP8_TENSOR:
        return tl.load(base).to(tl.float32)
    elif WEIGHT_FORMAT == FP8_CHANNEL:
        return tl.load(base + cols * stride_n, mask=col_ok, other=0.0).to(tl.float32)
    else:
        return tl.load(base + (cols // SCALE_BN) * stride_n + (k_start // SCALE_BK) * stride_k,
                       mask=col_ok, other=0.0).to(tl.float32)


@triton.jit
def _activation_scales(scale_ptr, rows, row_ok, k_start, stride_r, stride_g,
                       ACT_FORMAT: tl.constexpr, SCALE_BK: tl.constexpr):
    """The scale of each fp8 activation row for the K tile at ``k_start``:
    ``[M]`` fp32 for ``[M]`` rows, a scalar for one."""
    if ACT_FORMAT == FP8_TOKEN:
        return tl.load(scale_ptr + rows * stride_r, mask=row_ok, other=0.0)
    else:
        return tl.load(scale_ptr + rows * stride_r + (k_start // SCALE_BK) * stride_g,
                       mask=row_ok, other=0.0)


@triton.jit
def _e2m1_halves(packed):
    """The low and the high e2m1 nibble of each byte as fp32, times 2 ** -14."""
    # The nibble's sign goes to bit 15 and its exponent and mantissa to bits 9-11
    # of a float16, which then reads as the e2m1 value * 2 ** -14: the e2m1
    # subnormal (0.5) lands on a float16 subnormal, and the conversion of float16
    # to float32 is exact, so no arithmetic on subnormals is involved.
    # In int32 whatever the promotion rules of the Triton version, then 16 bits.
    bits = packed.to(tl.int32)
    low = (((bits & 0x8) << 12) | ((bits & 0x7) << 9)).to(tl.uint16)
    high = (((bits & 0x80) << 8) | ((bits & 0x70) << 5)).to(tl.uint16)
    return (low.to(tl.float16, bitcast=True).to(tl.float32),
            high.to(tl.float16, bitcast=True).to(tl.float32))


@triton.jit
def _e8m0_fp32(scales):
    """e8m0 scale bytes as fp32 ``2 ** (s - 127)``; 0 reads as 0 (not 2 ** -127), 0xFF
    (OCP MX's NaN) as NaN."""
    # 0xFF << 23 is the bits of +Inf; a mantissa bit makes them a quiet NaN.
    bits = (scales.to(tl.int32) << 23) | ((scales == 0xFF).to(tl.int32) << 22)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_tiles(packed, scales, dtype: tl.constexpr):
    """The even and the odd K columns of an MXFP4 weight tile, in ``dtype``.

    ``packed``: uint8 ``[BN, P]``; ``scales``: its e8m0 bytes, ``[BN, G]``. A scale byte
    of 0 reads as 0 (not 2 ** -127), and scales from 2 ** 113 on overflow: neither
    occurs in weights worth running. 0xFF (OCP MX's NaN) reads as NaN.
    """
    BLOCK_N: tl.constexpr = packed.shape[0]
    PACKED_K: tl.constexpr = packed.shape[1]
    low, high = _e2m1_halves(packed)
    # Each scale serves 16 packed bytes (32 K columns).
    scale = _scale_bytes_per_byte(_e8m0_fp32(scales) * E2M1_IN_FP16, BLOCK_N, PACKED_K)
    return (low * scale).to(dtype), (high * scale).to(dtype)


@triton.jit
def _mma(acc, a, w, row_scale, col_scale, WEIGHT_FORMAT: tl.constexpr,
         ACT_FORMAT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``acc`` plus one K tile's ``a [M, BK] @ w [BK, BN]`` of fp8 weights.

    fp8 activations meet fp8 weights in the tensor cores; otherwise the weights
    are converted to the activations' dtype (exact: every e4m3 value is a
    bf16, fp16 and fp32 value). Block scales multiply each tile's product
    (``row_scale [M]`` of fp8_group activations, 1.0 otherwise, times
    ``col_scale [BN]``); other scales are applied after the K loop (`_scale_after_loop`).
    """
    if ACT_FORMAT == 0:
        w = w.to(a.dtype)
        if WEIGHT_FORMAT == FP8_BLOCK:
            return acc + (tl.dot(a, w, input_precision=DOT_PRECISION)
                          * (row_scale * col_scale[None, :]))
        return tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    # fp8 x fp8 products are summed in fp32 tile by tile: Hopper's fp8 MMA keeps
    # fewer bits than fp32 along one chain of accumulation. No input precision:
    # it names how fp32 operands are multiplied (an H200 gave wrong fp8 products
    # with "ieee").
    if WEIGHT_FORMAT == FP8_BLOCK:
        return acc + tl.dot(a, w) * (row_scale * col_scale[None, :])
    return acc + tl.dot(a, w)


@triton.jit
def _scale_after_loop(acc, row_scale, col_scale, WEIGHT_FORMAT: tl.constexpr,
                      ACT_FORMAT: tl.constexpr):
    """``acc [M, BN]`` times the scales not applied per K tile: the weights' per
    tensor (scalar) or per channel (``col_scale [BN]``) and fp8_token
    activations' (``row_scale [M, 1]``)."""
    if WEIGHT_FORMAT == FP8_TENSOR:
        acc = acc * col_scale
    elif WEIGHT_FORMAT == FP8_CHANNEL:
        acc = acc * col_scale[None, :]
    if ACT_FORMAT == FP8_TOKEN:
        acc = acc * row_scale
    return acc


@triton.jit
def _mxfp4_bf16_pairs(packed, scale_bytes):
    """The even and the odd K column of each MXFP4 byte of ``packed`` as bf16,
    times 2 ** (``scale_bytes`` - 127) (uint8, ``packed``'s shape): exact. A scale
    byte of 0 reads as 0 and 0xFF as +Inf (so its group reads as Inf or NaN).

    In PTX, four bytes to a 32-bit register: each nibble's sign goes to bit 15 and
    its exponent and mantissa to bits 6-8 of a bf16 half-word, two half-words
    at a time, which reads as the e2m1 value * 2 ** -126 (the e2m1 subnormal 0.5
    a bf16 subnormal); fma.rn.bf16x2 by 2 ** 126, then by the scale (its byte
    shifted into a bf16 exponent), brings it to the weight, both products exact.
    About 3.5 instructions a weight, where the decode written in Triton takes an
    instruction per element for each step and an fp16-to-fp32 conversion per weight.
    """
    return _bf16_pairs_asm(MXFP4_BF16_PAIRS_PTX, packed, scale_bytes)


@triton.jit
def _bf16_pairs_asm(ptx: tl.constexpr, first, second):
    """Two bf16 tensors of ``first``'s shape from ``ptx`` run on four elements of
    ``first`` and of ``second`` (uint8: one register each) at a time, four registers of
    bf16 pairs out (``$0``-``$1`` the first tensor's, ``$2``-``$3`` the second's)."""
    return tl.inline_asm_elementwise(
        ptx,
        constraints="=r,=r,=r,=r,r,r",
        args=[first, second],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _scale_bytes_per_byte(scales, BLOCK_N: tl.constexpr, PACKED_K: tl.constexpr):
    """``scales [BN, G]`` repeated for each of the 16 packed bytes of its group: ``[BN, P]``."""
    return tl.reshape(tl.broadcast_to(scales[:, :, None], (BLOCK_N, PACKED_K // 16, 16)),
                      (BLOCK_N, PACKED_K))


@triton.jit
def _mxfp4_dot_t(acc_t, a, packed, scales, DOT_PRECISION: tl.constexpr):
    """``acc_t [BN, M]`` plus one K tile's ``(a [M, BK] @ w [BK, BN]).T``: the
    weights ``packed [BN, P]`` (K column 2p in the low nibble of byte p) with
    ``scales [BN, G]`` are the left operand, so that the tile decoded in
    registers feeds the tensor cores from there (on Hopper the left operand may
    come from registers; the right one goes through shared memory first).

    bf16 activations meet weights decoded in PTX (`_mxfp4_bf16_pairs`), fp16 ones
    meet them in ``tl.dot_scaled``, fp32 ones meet them decoded to fp32 at
    ``DOT_PRECISION``. Under the interpreter (no PTX there, and no ``tl.dot_scaled`` in
    Triton 3.6's) the weights are decoded to the activations' dtype in Triton.
    """
    BLOCK_N: tl.constexpr = packed.shape[0]
    PACKED_K: tl.constexpr = packed.shape[1]
    if a.dtype == tl.float16 and not INTERPRETED:
        return tl.dot_scaled(packed, scales, E2M1, tl.trans(a), None, FP16, acc_t)
    if a.dtype == tl.bfloat16 and not INTERPRETED:
        even, odd = _mxfp4_bf16_pairs(packed, _scale_bytes_per_byte(scales, BLOCK_N, PACKED_K))
    else:
        even, odd = _mxfp4_tiles(packed, scales, a.dtype)
    w = tl.reshape(tl.join(even, odd), (BLOCK_N, 2 * PACKED_K))
    return tl.dot(w, tl.trans(a), acc_t, input_precision=DOT_PRECISION)


@triton.jit
def _fragment_pair_values(word, factor):
    """The two values of each bf16 pair in ``word`` (uint32 bits), times ``factor`` (fp32),
    in fp32: exact (Triton arithmetic, for the interpreter)."""
    low = (word << 16).to(tl.float32, bitcast=True)
    high = (word & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.join(low * factor, high * factor)


@triton.jit
def _mxfp4_fragment_pairs(words, scales, dtype: tl.constexpr):
    """Two ``[X, 4C]`` tensors in ``dtype`` (bf16 on the GPU) of ``words [X, 4C]`` uint8
    (C fragment words) with ``scales`` (uint8, four a word: row 0's, row 1's, again):
    elements ``4 c + 2 q + h`` of the first are value ``h`` of word c's pair ``(0, q)``, of
    the second pair ``(1, q)``.

    On the GPU, `MXFP4_FRAGMENT_PTX`: six instructions for the factors and about 2.5 a pair.
    Under the interpreter, the same bits taken apart in Triton arithmetic."""
    if INTERPRETED:
        NUM_ROWS: tl.constexpr = words.shape[0]
        NUM_WORDS: tl.constexpr = words.shape[1] // 4
        shifts = tl.arange(0, 4).to(tl.uint32) * 8
        word = tl.sum(tl.reshape(words.to(tl.uint32), (NUM_ROWS, NUM_WORDS, 4)) << shifts,
                      axis=2)
        # [X, C, copy, q]: the two copies are equal.
        row_scales = tl.reshape(scales.to(tl.uint32), (NUM_ROWS, NUM_WORDS, 2, 2))
        factor0, factor1 = tl.split(tl.max(row_scales, axis=2))
        factor0 = (factor0 << 23).to(tl.float32, bitcast=True)
        factor1 = (factor1 << 23).to(tl.float32, bitcast=True)
        mask = 0x81C081C0
        pair3 = (((word << 4) & 0x80008000) | ((word >> 6) & 0x01800180)
                 | ((word >> 4) & 0x00400040))
        first = tl.join(_fragment_pair_values(word & mask, factor0),
                        _fragment_pair_values((word << 3) & mask, factor1))
        second = tl.join(_fragment_pair_values((word << 6) & mask, factor0),
                         _fragment_pair_values(pair3, factor1))
        # [X, C, h, q] -> [X, C, q, h]
        first = tl.reshape(tl.permute(first, (0, 1, 3, 2)), (NUM_ROWS, 4 * NUM_WORDS))
        second = tl.reshape(tl.permute(second, (0, 1, 3, 2)), (NUM_ROWS, 4 * NUM_WORDS))
        return first.to(dtype), second.to(dtype)
    return _bf16_pairs_asm(MXFP4_FRAGMENT_PTX, words, scales)


@triton.jit
def _mxfp4_fragments_dot_t(acc_t, a, words, scales, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``acc_t [BN, M]`` plus one K tile's ``(a [M, BK] @ w [BK, BN]).T`` for bf16 ``a``
    (any float dtype under the interpreter), the weights read as fragments
    (`mxfp4_fragments`): ``words [2 BN, BK / 4]`` (a row per thread of each 64-row block,
    its 16 bytes per 64 columns) and ``scales [2 BN, BK / 16]`` (that thread's four bytes
    per 64 columns).

    The decoded pairs are laid out again as ``[BN, BK]`` by reshapes and a permutation
    alone: each thread's values are the ones its fragment of the left operand takes, so
    on Hopper nothing moves between the load and the tensor cores."""
    NUM_ROWS: tl.constexpr = 2 * BLOCK_N
    COL_BLOCKS: tl.constexpr = BLOCK_K // 64
    # Each word's scale bytes: its group's (sg = s // 2) two rows, twice.
    word_scales = tl.broadcast_to(tl.reshape(scales, (NUM_ROWS, COL_BLOCKS, 2, 1, 1, 2)),
                                  (NUM_ROWS, COL_BLOCKS, 2, 2, 2, 2))
    first, second = _mxfp4_fragment_pairs(
        words, tl.reshape(word_scales, (NUM_ROWS, BLOCK_K // 4)), a.dtype)
    # Thread (w, g, t) of block b, word (kb, s), pair (o, q), value h is weight row
    # 64 b + 16 w + 8 q + g and column 64 kb + 16 s + 8 o + 2 t + h.
    values = tl.reshape(tl.join(first, second),
                        (BLOCK_N // 64, 4, 8, 4, COL_BLOCKS, 4, 2, 2, 2))
    w = tl.reshape(tl.permute(values, (0, 1, 6, 2, 4, 5, 8, 3, 7)), (BLOCK_N, BLOCK_K))
    return tl.dot(w, tl.trans(a), acc_t, input_precision=DOT_PRECISION)


@triton.jit
def _e2m1_fp32(packed):
    """The even and the odd K column of each MXFP4 byte of ``packed`` as fp32, unscaled
    (the e2m1 values themselves): eight values from two table lookups of four
    magnitudes each and a sign each (`E2M1_FP32_PTX`)."""
    return tl.inline_asm_elementwise(
        E2M1_FP32_PTX,
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r",
        args=[packed],
        dtype=(tl.float32, tl.float32),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _mxfp4_row_dot(x_even, x_odd, packed, scales, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """``[BN]`` fp32: one activation row (its even and odd columns, ``[P]`` fp32
    each) times an MXFP4 weight tile (``packed [BN, P]``, ``scales [BN, G]``),
    decoded in registers and multiplied in fp32: for one row this beats
    ``tl.dot_scaled`` on a 16-row tile (one token, H100, GPT-OSS-20B widths: 38.6
    against 57.6 us for the gate-up GEMM, both decoding with Triton arithmetic).

    The weights are decoded unscaled and each group of 32 columns' sum is scaled once
    (a power of two, exact), so no scale is spread over the weights. Under the interpreter
    the decode is written in Triton (`_e2m1_halves`)."""
    if INTERPRETED:
        w_even, w_odd = _e2m1_halves(packed)
        w_even *= E2M1_IN_FP16
        w_odd *= E2M1_IN_FP16
    else:
        w_even, w_odd = _e2m1_fp32(packed)
    products = w_even * x_even[None, :] + w_odd * x_odd[None, :]
    groups = tl.sum(tl.reshape(products, (BLOCK_N, BLOCK_K // 32, 16)), axis=2)
    return tl.sum(groups * _e8m0_fp32(scales), axis=1)
