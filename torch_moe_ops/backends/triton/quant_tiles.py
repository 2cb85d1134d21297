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

A K tile of MXFP4 weights is read as its packed bytes ``[P, BN]`` with its
scales ``[BN, G]``, the operands of ``tl.dot_scaled`` (`_mxfp4_dot`, tiles of
rows); the decode kernels' single rows meet tiles decoded to fp32 by bit
arithmetic (`_mxfp4_row_dot`), and `dequant` decodes whole matrices with the
same arithmetic (`_mxfp4_tiles`).
"""

from __future__ import annotations

import triton
import triton.language as tl

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
# `tl.dot_scaled`'s operand formats, as constexprs: Triton 3.6's interpreter reads
# `.value` of them, where a string literal stays a str.
E2M1 = tl.constexpr("e2m1")
BF16 = tl.constexpr("bf16")
FP16 = tl.constexpr("fp16")
# float16 bits with an e2m1 nibble in them read as its value * 2 ** -14 (see _e2m1_halves).
E2M1_IN_FP16 = tl.constexpr(16384.0)


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
def _mxfp4_tiles(packed, scales, dtype: tl.constexpr, K_AXIS: tl.constexpr,
                 PACKED_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The even and the odd K columns of an MXFP4 weight tile, in ``dtype``.

    ``packed``: uint8, ``[P, BN]`` (``K_AXIS=0``) or ``[BN, P]`` (``K_AXIS=1``);
    ``scales``: its e8m0 bytes, ``[G, BN]`` or ``[BN, G]``. A scale byte of 0
    reads as 0 (not 2 ** -127), and scales from 2 ** 113 on overflow: neither
    occurs in weights worth running. 0xFF (OCP MX's NaN) reads as NaN.
    """
    low, high = _e2m1_halves(packed)
    # 0xFF << 23 is the bits of +Inf; a mantissa bit makes them a quiet NaN.
    bits = (scales.to(tl.int32) << 23) | ((scales == 0xFF).to(tl.int32) << 22)
    scale = bits.to(tl.float32, bitcast=True) * E2M1_IN_FP16
    # Each scale serves 16 packed rows (32 K columns).
    if K_AXIS == 0:
        scale = tl.reshape(tl.broadcast_to(scale[:, None, :], (PACKED_K // 16, 16, BLOCK_N)),
                           (PACKED_K, BLOCK_N))
    else:
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, PACKED_K // 16, 16)),
                           (BLOCK_N, PACKED_K))
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
def _mxfp4_dot(acc, a, packed, scales, DOT_PRECISION: tl.constexpr):
    """``acc`` plus one K tile's ``a [M, BK] @ w [BK, BN]`` of MXFP4 weights:
    ``packed [P, BN]`` uint8 (K column 2p in the low nibble of byte p, 2p + 1
    in the high one) and ``scales [BN, G]`` e8m0 bytes.

    fp16 and bf16 activations meet the weights in `tl.dot_scaled`, which decodes
    them in the registers that feed the tensor cores (the tiles decoded by bit
    arithmetic and multiplied with ``tl.dot`` ran 4.2x slower: H200, GPT-OSS-20B
    widths, 4096 tokens, 13.6 against 3.2 ms, each tuned). The decode is exact: an
    e2m1 value times a power of two is a bf16 value, and an fp16 one within
    fp16's range. fp32 activations meet the weights decoded to fp32
    (`_mxfp4_tiles`), at ``DOT_PRECISION``.
    """
    if a.dtype == tl.float32:
        even, odd = _mxfp4_tiles(packed, tl.trans(scales), tl.float32, 0, packed.shape[0],
                                 packed.shape[1])
        # Row 2p of the K tile is the even column of byte p, row 2p + 1 the odd one.
        w = tl.reshape(tl.permute(tl.join(even, odd), (0, 2, 1)),
                       (2 * packed.shape[0], packed.shape[1]))
        return tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    elif a.dtype == tl.bfloat16:
        return tl.dot_scaled(a, None, BF16, packed, scales, E2M1, acc)
    else:
        return tl.dot_scaled(a, None, FP16, packed, scales, E2M1, acc)


@triton.jit
def _mxfp4_row_dot(x_even, x_odd, packed, scales, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """``[BN]`` fp32: one activation row (its even and odd columns, ``[P]`` fp32
    each) times an MXFP4 weight tile (``packed [BN, P]``, ``scales [BN, G]``),
    decoded to fp32 in registers: for one row this beats ``tl.dot_scaled`` on a
    16-row tile (one token, H100, GPT-OSS-20B widths: 38.6 against 57.6 us for
    the gate-up GEMM)."""
    w_even, w_odd = _mxfp4_tiles(packed, scales, tl.float32, 1, BLOCK_K // 2, BLOCK_N)
    return tl.sum(w_even * x_even[None, :] + w_odd * x_odd[None, :], axis=1)
