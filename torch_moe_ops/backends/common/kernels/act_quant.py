"""Dynamic fp8 quantization of activation rows, one Triton launch: what a w8a8
GEMM reads (`torch_moe_ops.quant.quantize_activations`, bit for bit).

Legend: M rows, K columns, C columns per scale (``K`` for fp8_token, ``bk``
for fp8_group), G = K / C scales per row.

    a[m, g] = max(amax(|x[m, g*C:(g+1)*C]|), 1e-12) / 448
    q[m, k] = fp8(clamp(x[m, k] / a[m, k // C], -448, 448))

A program takes one group of a few rows and reads it twice, for the absolute
maximum and to quantize: the group stays in L1/L2 between the two passes. Divisions are
correctly rounded (``div_rn``) as torch's are, and values are rounded to the
e4m3 grid (to nearest, ties to even) in fp32 before the conversion, which is
then exact: the result is torch's bit for bit on the GPU and under the Triton
interpreter alike (whose own fp8 conversion mishandles a rounding that carries
into the exponent).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch_moe_ops import quant
from torch_moe_ops.backends.common.kernels.launch import launcher
from torch_moe_ops.config import QuantSpec

# Elements of a program's tile [rows, columns]: rows of one group each, as
# many as fill it (several for short groups), the columns of a longer group in steps.
TILE = 1024
FP8_MAX = tl.constexpr(quant.FP8_MAX)
MIN_SCALE = tl.constexpr(quant.MIN_SCALE)


@triton.jit
def _round_to_e4m3(x):
    """fp32 ``x`` (within +-448) rounded to the nearest e4m3 value, ties to even, as fp32."""
    # Adding and subtracting 1.5 * 2**23 times the e4m3 step at x's binade rounds
    # to a multiple of that step: 3 mantissa bits from 2**-6 on (biased fp32
    # exponent 121), a fixed step of 2**-9 below (the subnormals).
    exponent = (x.to(tl.int32, bitcast=True) >> 23) & 0xFF
    step_exponent = tl.maximum(exponent, 121) - 3
    magic = (((step_exponent + 23) << 23) | 0x400000).to(tl.float32, bitcast=True)
    return (x + magic) - magic


@triton.jit
def fp8_quantize_groups_kernel(x_ptr, q_ptr, scale_ptr, num_rows, stride_x_m, stride_x_k,
                               stride_q_m, stride_q_k, stride_s_m, stride_s_g,
                               GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    row_ok = rows < num_rows
    first = tl.program_id(1) * GROUP
    offsets = tl.arange(0, BLOCK)
    amax = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for start in range(0, GROUP, BLOCK):
        cols = first + start + offsets
        ok = row_ok[:, None] & (start + offsets < GROUP)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x_m + cols[None, :] * stride_x_k, mask=ok,
                    other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=1), MIN_SCALE), FP8_MAX)
    for start in range(0, GROUP, BLOCK):
        cols = first + start + offsets
        ok = row_ok[:, None] & (start + offsets < GROUP)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x_m + cols[None, :] * stride_x_k, mask=ok,
                    other=0.0)
        q = _round_to_e4m3(tl.clamp(tl.math.div_rn(x.to(tl.float32), scale[:, None]), -FP8_MAX,
                                    FP8_MAX))
        tl.store(q_ptr + rows[:, None] * stride_q_m + cols[None, :] * stride_q_k,
                 q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + rows * stride_s_m + tl.program_id(1) * stride_s_g, scale, mask=row_ok)


def quantize_rows(x_MK: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_MK, scale)`` of float rows ``x_MK [M, K]`` under an fp8
    ``spec.activations``: ``q_MK`` float8_e4m3fn ``[M, K]`` contiguous, ``scale``
    fp32 ``[M]`` (fp8_token) or ``[M, K / bk]`` (fp8_group)."""
    num_rows, cols = x_MK.shape
    group = quant.activation_group(spec, cols)
    q_MK = torch.empty((num_rows, cols), dtype=quant.FP8_DTYPE, device=x_MK.device)
    scale_MG = torch.empty((num_rows, cols // group), dtype=torch.float32, device=x_MK.device)
    if num_rows:
        block = min(triton.next_power_of_2(group), TILE)
        rows = TILE // block
        launcher(fp8_quantize_groups_kernel)[(triton.cdiv(num_rows, rows), cols // group)](
            x_MK, q_MK, scale_MG, num_rows, x_MK.stride(0), x_MK.stride(1), q_MK.stride(0),
            q_MK.stride(1), scale_MG.stride(0), scale_MG.stride(1), GROUP=group, ROWS=rows,
            BLOCK=block)
    return q_MK, scale_MG[:, 0] if spec.activations == "fp8_token" else scale_MG
