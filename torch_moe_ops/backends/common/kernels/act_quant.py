"""Dynamic fp8 quantization of activation rows, one Triton launch: what a w8a8
GEMM reads (`torch_moe_ops.quant.quantize_activations`, bit for bit).

Legend: M rows, K columns, C columns per scale (``K`` for fp8_token, ``bk``
for fp8_group), G = K / C scales per row, S places each row is written to,
E experts, I the columns of a gated activation, F = 2 * I (gate then up), B blocks of
scales.

    a[m, g] = max(amax(|x[m, g*C:(g+1)*C]|), 1e-12) / 448
    q[m, k] = fp8(clamp(x[m, k] / a[m, k // C], -448, 448))

Two kernels apply that rule:

- `quantize_rows`: rows as they are, to the same rows of the output or, given a table of
  targets, each to up to S other rows (a scatter into a grouped GEMM's layout, in the
  pass that quantizes: the fp8 rows are never written twice).
- `bias_act_quantize_rows`: the bias and gated activation of a GEMM's output
  (`epilogues.bias_act_rows`), quantized as it is made: the second GEMM's input in one
  pass that reads the first GEMM's output once, where the activation and then
  `quantize_rows` wrote the activation out and read it back.

A `quantize_rows` program takes one group of a few rows and reads it twice, for the
absolute maximum and to quantize: the group stays in L1/L2 between the two passes. A
`bias_act_quantize_rows` program holds its group in registers (one pass). Both write the
scales row-major ``[M, G]`` unless given a buffer of another layout (``scale_out``: any
strides, ``[M, G]`` or ``[B, M / B, G]``), such as the M-major one DeepGEMM reads.

Divisions are correctly rounded (``div_rn``) as torch's are, and values are rounded to the
e4m3 grid (to nearest, ties to even) in fp32 before the conversion, which is
then exact: the result is torch's bit for bit on the GPU and under the Triton
interpreter alike (whose own fp8 conversion mishandles a rounding that carries
into the exponent).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from torch_moe_ops import quant
from torch_moe_ops.backends.common.kernels.launch import (
    cdiv,
    launcher,
    next_power_of_2,
    unread_slot,
)
from torch_moe_ops.backends.common.kernels.triton_activation import ACTIVATION_CODES, _activate
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
def _fp8_scale(amax):
    """The scale of groups whose largest magnitudes are ``amax`` (fp32)."""
    return tl.math.div_rn(tl.maximum(amax, MIN_SCALE), FP8_MAX)


@triton.jit
def _divide_rows(x, scale):
    """``x [ROWS, BLOCK] / scale[ROWS]`` correctly rounded (``div_rn``'s result), with one
    division a row: each element takes a product and two FMAs in place of a division's
    dozen instructions (the fused activation kernel was issue-bound on them).

    With ``y`` the row's reciprocal correctly rounded, ``q = x * y`` and the exact residual
    ``r = x - q * scale``, ``q + r * y`` rounded once is the correctly rounded quotient
    (Markstein's theorem; it needs no overflow or subnormal residual, which the scales here,
    at least 1e-12 / 448, rule out for every quotient an e4m3 value can round to). Where
    ``r`` is NaN (an infinite scale) ``q`` is the quotient: 0, or NaN as ``div_rn`` gives.
    tests/test_triton_quant.py checks it against ``div_rn`` for every bf16 value over every
    scale a bf16 group can have."""
    inverse = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)[:, None]
    quotient = x * inverse
    residual = tl.fma(-quotient, scale[:, None], x)
    # NaN is the one value unequal to itself (the interpreter has no isnan).
    not_nan = residual == residual  # noqa: PLR0124
    return tl.where(not_nan, tl.fma(residual, inverse, quotient), quotient)


@triton.jit
def _fp8_values(x, scale):
    """fp32 ``x [ROWS, BLOCK]`` over its rows' ``scale [ROWS]``, on the e4m3 grid (fp32)."""
    return _round_to_e4m3(tl.clamp(_divide_rows(x, scale), -FP8_MAX, FP8_MAX))


@triton.jit
def _destination(target_ptr, rows, row_ok, copy, COPIES: tl.constexpr,
                 HAS_TARGETS: tl.constexpr):
    """``(rows, ok)`` that copy ``copy`` of ``rows`` is written to: the same rows without a
    table of targets, else ``target[row, copy]`` where that is not -1."""
    if HAS_TARGETS:
        target = tl.load(target_ptr + rows * COPIES + copy, mask=row_ok, other=-1).to(tl.int64)
        return target, target >= 0
    else:
        return rows, row_ok


@triton.jit
def _scale_offsets(rows, block_rows, stride_s_b, stride_s_m, BLOCKED_SCALES: tl.constexpr):
    """Offsets of ``rows``' scales: ``[M, G]``, or ``[B, block_rows, G]`` (row ``m`` in
    block ``m // block_rows``)."""
    if BLOCKED_SCALES:
        return rows // block_rows * stride_s_b + rows % block_rows * stride_s_m
    else:
        return rows * stride_s_m


@triton.jit
def fp8_quantize_groups_kernel(x_ptr, q_ptr, scale_ptr, target_ptr, num_rows, stride_x_m,
                               stride_x_k, stride_q_m, stride_q_k, scale_block_rows, stride_s_b,
                               stride_s_m, stride_s_g, GROUP: tl.constexpr, ROWS: tl.constexpr,
                               BLOCK: tl.constexpr, COPIES: tl.constexpr,
                               HAS_TARGETS: tl.constexpr, BLOCKED_SCALES: tl.constexpr):
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
    scale = _fp8_scale(tl.max(amax, axis=1))
    for start in range(0, GROUP, BLOCK):
        cols = first + start + offsets
        col_ok = (start + offsets < GROUP)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x_m + cols[None, :] * stride_x_k,
                    mask=row_ok[:, None] & col_ok, other=0.0)
        q = _fp8_values(x.to(tl.float32), scale).to(q_ptr.dtype.element_ty)
        for copy in tl.static_range(COPIES):
            out_rows, out_ok = _destination(target_ptr, rows, row_ok, copy, COPIES, HAS_TARGETS)
            tl.store(q_ptr + out_rows[:, None] * stride_q_m + cols[None, :] * stride_q_k, q,
                     mask=out_ok[:, None] & col_ok)
    for copy in tl.static_range(COPIES):
        out_rows, out_ok = _destination(target_ptr, rows, row_ok, copy, COPIES, HAS_TARGETS)
        scale_at = _scale_offsets(out_rows, scale_block_rows, stride_s_b, stride_s_m,
                                  BLOCKED_SCALES)
        tl.store(scale_ptr + scale_at + tl.program_id(1) * stride_s_g, scale, mask=out_ok)


@triton.jit
def fp8_bias_act_quantize_kernel(h_ptr, b13_ptr, expert_ptr, q_ptr, scale_ptr, num_rows,
                                 inter_size, stride_h_m, stride_b13_e, stride_q_m,
                                 scale_block_rows, stride_s_b, stride_s_m, stride_s_g,
                                 swiglu_alpha, swiglu_limit, ACTIVATION: tl.constexpr,
                                 HAS_BIAS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
                                 BLOCK: tl.constexpr, BLOCKED_SCALES: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    # Rows of expert -1 carry no token: the first GEMM left them unwritten, and each row the
    # second GEMM writes reads its own input row only, so whatever they hold reaches no row
    # that is read. They are neither read nor written here.
    expert = tl.load(expert_ptr + rows, mask=rows < num_rows, other=-1)
    # Masks spare memory, not arithmetic: a program of padding rows would compute the whole
    # activation of zeros (a third to a half of the programs, where DeepGEMM's layout pads
    # each expert to 128 rows).
    if tl.max(expert, axis=0) < 0:
        return
    row_ok = expert >= 0
    cols = tl.program_id(1) * GROUP + tl.arange(0, BLOCK)
    ok = row_ok[:, None] & (tl.arange(0, BLOCK) < GROUP)[None, :]
    h_rows = h_ptr + rows[:, None] * stride_h_m + cols[None, :]
    gate = tl.load(h_rows, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(h_rows + inter_size, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias_rows = b13_ptr + expert.to(tl.int64)[:, None] * stride_b13_e + cols[None, :]
        gate += tl.load(bias_rows, mask=ok, other=0.0).to(tl.float32)
        up += tl.load(bias_rows + inter_size, mask=ok, other=0.0).to(tl.float32)
    # Rounded to h's dtype, where `bias_act_rows` stored it for `quantize_rows` to read: the
    # same scales and fp8 values, bit for bit. Masked-off lanes hold act(0, 0) = 0 (every
    # activation), which leaves the maximum as it is.
    a = _activate(gate, up, swiglu_alpha, swiglu_limit, ACTIVATION)
    a = a.to(h_ptr.dtype.element_ty).to(tl.float32)
    scale = _fp8_scale(tl.max(tl.abs(a), axis=1))
    q = _fp8_values(a, scale).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows[:, None] * stride_q_m + cols[None, :], q, mask=ok)
    scale_at = _scale_offsets(rows, scale_block_rows, stride_s_b, stride_s_m, BLOCKED_SCALES)
    tl.store(scale_ptr + scale_at + tl.program_id(1) * stride_s_g, scale, mask=row_ok)


def _outputs(num_rows: int, cols: int, group: int, device: torch.device,
             scale_out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_MK, scale)``: fp8 ``[M, K]`` row-major and ``scale_out`` (fp32 ``[M, K / group]``
    or ``[B, M / B, K / group]``, any strides), or fp32 ``[M, K / group]`` row-major; unset."""
    q_MK = torch.empty((num_rows, cols), dtype=quant.FP8_DTYPE, device=device)
    if scale_out is None:
        return q_MK, torch.empty((num_rows, cols // group), dtype=torch.float32, device=device)
    shape = tuple(scale_out.shape)
    if (scale_out.dtype != torch.float32 or scale_out.device != device
            or len(shape) not in (2, 3) or shape[-1] != cols // group
            or math.prod(shape[:-1]) != num_rows):
        raise ValueError(f"scale_out must be float32 [{num_rows}, {cols // group}] or "
                         f"[B, {num_rows} / B, {cols // group}] on {device}, got "
                         f"{scale_out.dtype} {list(shape)} on {scale_out.device}")
    return q_MK, scale_out


def _scale_strides(scale: torch.Tensor) -> tuple[int, int, int, int]:
    """``(block_rows, stride_b, stride_m, stride_g)`` of scales ``[M, G]`` or ``[B, M / B, G]``,
    as the kernels' ``_scale_offsets`` reads them (the first two unread for ``[M, G]``: fixed
    there, so that they add no specialization)."""
    if scale.dim() == 2:
        return 1, 0, scale.stride(0), scale.stride(1)
    return scale.shape[1], scale.stride(0), scale.stride(1), scale.stride(2)


def quantize_rows(x_MK: torch.Tensor, spec: QuantSpec, targets_MS: torch.Tensor | None = None,
                  num_out: int | None = None, scale_out: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of float rows ``x_MK [M, K]`` under an fp8
    ``spec.activations``: ``q`` float8_e4m3fn ``[M, K]`` contiguous, ``scale``
    fp32 ``[M]`` (fp8_token) or ``[M, K / bk]`` (fp8_group), row-major.

    With ``targets_MS [M, S]`` (int, contiguous; -1: nowhere) the outputs have ``num_out``
    rows instead, and ``q[targets[m, s]], scale[targets[m, s]]`` are those of row ``m``:
    ``x`` is read once whatever S; rows no target names are left unwritten.

    Given ``scale_out`` (fp32 ``[N, G]`` or ``[B, N / B, G]`` of any strides, N the output
    rows), the scales are written there and it is returned (``[..., 0]`` for fp8_token):
    row ``n`` is ``scale_out[n]``, or ``scale_out[n // (N / B), n % (N / B)]``.
    """
    num_rows, cols = x_MK.shape
    group = quant.activation_group(spec, cols)
    has_targets = targets_MS is not None
    q_MK, scale_MG = _outputs(num_out if has_targets else num_rows, cols, group, x_MK.device,
                              scale_out)
    if num_rows:
        block = min(next_power_of_2(group), TILE)
        rows = TILE // block
        targets = targets_MS.contiguous() if has_targets else unread_slot(q_MK, torch.int32)
        launcher(fp8_quantize_groups_kernel)[(cdiv(num_rows, rows), cols // group)](
            x_MK, q_MK, scale_MG, targets, num_rows, x_MK.stride(0), x_MK.stride(1),
            q_MK.stride(0), q_MK.stride(1), *_scale_strides(scale_MG),
            GROUP=group, ROWS=rows, BLOCK=block, COPIES=targets.shape[1] if has_targets else 1,
            HAS_TARGETS=has_targets, BLOCKED_SCALES=scale_MG.dim() == 3)
    return q_MK, scale_MG[..., 0] if spec.activations == "fp8_token" else scale_MG


def bias_act_quantize_rows(h_MF: torch.Tensor, b13_EF: torch.Tensor | None,
                           expert_M: torch.Tensor, activation: str, swiglu_alpha: float,
                           swiglu_limit: float, spec: QuantSpec,
                           scale_out: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_MI, scale)`` of ``a[m] = act(h[m, :I] + b13[e, :I], h[m, I:] + b13[e, I:])``
    (e = ``expert_M[m]``) rounded to ``h_MF``'s dtype: ``quantize_rows(bias_act_rows(h_MF,
    ...), spec)`` bit for bit, in one pass that reads ``h_MF`` once and writes no activation.
    The rows of expert -1 are left unwritten.

    ``h_MF [M, 2I]`` rows must be contiguous in the last dimension, I a multiple of the
    scale group; ``expert_M [M]`` int. ``scale_out``: where the scales go, as in
    `quantize_rows`.
    """
    num_rows, inter_size = h_MF.shape[0], h_MF.shape[1] // 2
    group = quant.activation_group(spec, inter_size)
    if inter_size % group:
        raise ValueError(f"bias_act_quantize_rows needs I divisible by the scale group, got "
                         f"I={inter_size}, group={group}")
    q_MI, scale_MG = _outputs(num_rows, inter_size, group, h_MF.device, scale_out)
    if num_rows:
        # A whole group in registers (one pass): several rows of a short group. Two warps
        # for a tile of TILE elements: the kernel is issue-bound, and 8 rows of 128 columns
        # on 64 threads took 46 SASS instructions an element against 62 on 128 (45.8 against
        # 53.5 us at Qwen3-30B-A3B widths and 4096 tokens, 178.8 against 208.0 at
        # Mixtral-8x7B's, H200); a longer group keeps four.
        block = next_power_of_2(group)
        rows = max(TILE // block, 1)
        bias = b13_EF if b13_EF is not None else h_MF
        launcher(fp8_bias_act_quantize_kernel)[(cdiv(num_rows, rows),
                                                inter_size // group)](
            h_MF, bias, expert_M, q_MI, scale_MG, num_rows, inter_size, h_MF.stride(0),
            bias.stride(0), q_MI.stride(0), *_scale_strides(scale_MG),
            float(swiglu_alpha), float(swiglu_limit), ACTIVATION=ACTIVATION_CODES[activation],
            HAS_BIAS=b13_EF is not None, GROUP=group, ROWS=rows, BLOCK=block,
            BLOCKED_SCALES=scale_MG.dim() == 3, num_warps=2 if block <= TILE else 4)
    return q_MI, scale_MG[..., 0] if spec.activations == "fp8_token" else scale_MG
