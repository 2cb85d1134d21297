"""MXFP4 expert weights decoded to a float dtype in one Triton kernel, for the
prefill path that multiplies them on ``torch._grouped_mm`` (``dequant_grouped_mm``
in `configs`).

Legend: E experts, N rows and K columns of one weight matrix, P = K / 2 packed
bytes per row, G = K / 32 scale groups per row; R rows (E * N flattened) and
BR rows, BP packed bytes of one program's block.

    w[e, n, k] = e2m1(nibble k % 2 of q[e, n, k // 2]) * 2 ** (s[e, n, k // 32] - 127)

Each program decodes a ``[BR, BP]`` block of packed bytes with the kernels'
own decode (`quant_tiles._mxfp4_tiles`) and stores the even and the odd
columns interleaved, so the output rows are written contiguously.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch_moe_ops.backends.common.kernels.launch import cdiv, launcher
from torch_moe_ops.backends.triton.quant_tiles import _mxfp4_tiles
from torch_moe_ops.config import MXFP4_GROUP

# Rows and packed bytes per program: 64 x 128 bytes decode to 64 x 256 values.
BLOCK_R = 64
BLOCK_P = 128
# Packed bytes per scale group.
PACKED_GROUP = tl.constexpr(MXFP4_GROUP // 2)


@triton.jit
def dequantize_mxfp4_kernel(packed_ptr, scale_ptr, out_ptr, num_rows, num_packed,
                            stride_pr, stride_pp, stride_sr, stride_sg, stride_or, stride_ok,
                            BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_p = tl.program_id(1)
    # Row offsets in int64: a layer's decoded weights pass 2 ** 31 elements
    # (DeepSeek-V3's w13: 256 x 4096 x 7168).
    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    groups = pid_p * (BLOCK_P // PACKED_GROUP) + tl.arange(0, BLOCK_P // PACKED_GROUP)
    row_ok = rows < num_rows
    # P is a multiple of PACKED_GROUP, so a block's groups are whole or absent.
    packed = tl.load(packed_ptr + rows[:, None] * stride_pr + cols[None, :] * stride_pp,
                     mask=row_ok[:, None] & (cols[None, :] < num_packed), other=0)
    scales = tl.load(scale_ptr + rows[:, None] * stride_sr + groups[None, :] * stride_sg,
                     mask=row_ok[:, None] & (groups[None, :] < num_packed // PACKED_GROUP), other=0)
    even, odd = _mxfp4_tiles(packed, scales, out_ptr.dtype.element_ty, 1, BLOCK_P, BLOCK_R)
    values = tl.interleave(even, odd)
    out_cols = pid_p * 2 * BLOCK_P + tl.arange(0, 2 * BLOCK_P)
    tl.store(out_ptr + rows[:, None] * stride_or + out_cols[None, :] * stride_ok, values,
             mask=row_ok[:, None] & (out_cols[None, :] < 2 * num_packed))


def dequantize_mxfp4(packed_ENP: torch.Tensor, scale_ENG: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """``w_ENK [E, N, K]`` in ``dtype`` (fp16, bf16 or fp32), contiguous: the
    weights that ``packed_ENP [E, N, K / 2]`` uint8 and ``scale_ENG [E, N, K / 32]``
    uint8 (e8m0) stand for, as `torch_moe_ops.quant.dequantize_weights` decodes
    them, rounded to ``dtype``. A scale byte of 0 decodes to 0 (`_mxfp4_tiles`).

    The result is a new buffer of ``2 * E * N * K`` bytes in bf16 (four times the
    packed weights): the caller holds it for one call only.
    """
    num_experts, num_rows, num_packed = packed_ENP.shape
    out_ENK = torch.empty((num_experts, num_rows, 2 * num_packed), dtype=dtype,
                          device=packed_ENP.device)
    if out_ENK.numel() == 0:
        return out_ENK
    packed_RP = packed_ENP.reshape(num_experts * num_rows, num_packed)
    scale_RG = scale_ENG.reshape(num_experts * num_rows, scale_ENG.shape[2])
    out_RK = out_ENK.view(num_experts * num_rows, 2 * num_packed)
    grid = (cdiv(packed_RP.shape[0], BLOCK_R), cdiv(num_packed, BLOCK_P))
    launcher(dequantize_mxfp4_kernel)[grid](
        packed_RP, scale_RG, out_RK, packed_RP.shape[0], num_packed,
        packed_RP.stride(0), packed_RP.stride(1), scale_RG.stride(0), scale_RG.stride(1),
        out_RK.stride(0), out_RK.stride(1), BLOCK_R=BLOCK_R, BLOCK_P=BLOCK_P)
    return out_ENK
