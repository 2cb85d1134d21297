"""Quantized formats in plain PyTorch: what each `QuantSpec` stores and how it
reads back. The oracle of every quantized kernel, and the quantizer of the
weights a module builds or a test checkpoint holds.

Legend: E experts, N output rows and K input columns of one expert matrix
(``w13``: N = 2I, K = H; ``w2``: N = H, K = I), M activation rows.

    weights:      w[e, n, k]  = q[e, n, k] * scale[e, ...]          (fp8_*)
                  w[e, n, k]  = e2m1(q, k) * 2 ** (s[e, n, k // 32] - 127)   (mxfp4;
                                NaN where s is 0xFF: a group holding a NaN or an Inf)
    activations:  x[m, k] ~= fp8(x[m, k] / a[m, k // group]) * a[m, k // group]
                  with a = amax of the row (fp8_token) or of its group (fp8_group) / 448

Nothing here is fast: the kernels are the backends'. Every function takes and
returns tensors on any device, computes in fp32 and never reads a value on the host.
"""

from __future__ import annotations

import contextlib
import math

import torch

from torch_moe_ops.config import MXFP4_GROUP, QuantSpec

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
# The smallest scale a row or block gets: an all-zero one then quantizes to zeros
# instead of dividing by zero.
MIN_SCALE = 1e-12
# The e2m1 magnitudes, indexed by the three low bits of a nibble (bit 3 is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E8M0_BIAS = 127
# OCP MX's NaN scale: a group holding a NaN or an Inf reads back as NaN, as an fp8
# group does (its scale becomes NaN or Inf), so a corrupt checkpoint stays visible.
E8M0_NAN = 0xFF


def weight_dtype(spec: QuantSpec) -> torch.dtype:
    """The dtype a quantized weight is stored in."""
    return torch.uint8 if spec.weights == "mxfp4" else FP8_DTYPE


def weight_shape(spec: QuantSpec, num_experts: int, rows: int, cols: int) -> tuple[int, ...]:
    """The stored shape of ``[E, N, K]`` weights: ``[E, N, K / 2]`` packed for mxfp4."""
    return (num_experts, rows, cols // 2 if spec.weights == "mxfp4" else cols)


def scale_shape(spec: QuantSpec, num_experts: int, rows: int, cols: int) -> tuple[int, ...]:
    """The shape of the scales of ``[E, N, K]`` weights."""
    if spec.weights == "fp8_tensor":
        return (num_experts,)
    if spec.weights == "fp8_channel":
        return (num_experts, rows)
    if spec.weights == "fp8_block":
        block_rows, block_cols = spec.block_size
        return (num_experts, rows // block_rows, cols // block_cols)
    return (num_experts, rows, cols // MXFP4_GROUP)


def scale_dtype(spec: QuantSpec) -> torch.dtype:
    """The dtype of the weight scales: fp32, or e8m0 bytes (uint8) for mxfp4."""
    return torch.uint8 if spec.weights == "mxfp4" else torch.float32


# What a module of quantized experts holds as buffers: stored bits, never cast.
QUANT_TENSORS = ("w13", "w2", "w13_scale", "w2_scale")
# Integer dtypes of each element width, through which `stored_bits` moves quantized tensors.
BIT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@contextlib.contextmanager
def stored_bits(buffers: dict, names=QUANT_TENSORS):
    """Inside, the tensors ``buffers[name]`` (a module's ``_buffers``) are integer
    views of the same width, and their own dtypes again on the way out.

    ``Module._apply`` (``.to(dtype)``, ``.half()``, ``.to(device)``) casts every
    floating-point tensor: quantized weights and their fp32 scales must travel as
    integers instead, so that a device move keeps their bits and a cast leaves them."""
    dtypes = {name: buffers[name].dtype for name in names}
    for name in names:
        buffers[name] = buffers[name].view(BIT_VIEWS[buffers[name].element_size()])
    try:
        yield
    finally:
        for name, dtype in dtypes.items():
            buffers[name] = buffers[name].view(dtype)


def _blocks(w_ENK: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """``[E, N, K]`` as ``[E, N / bn, bn, K / bk, bk]``."""
    num_experts, rows, cols = w_ENK.shape
    return w_ENK.reshape(num_experts, rows // block_rows, block_rows, cols // block_cols,
                         block_cols)


# The quantizers work in fp32 (mxfp4 through a 16-entry table per value): weights
# are quantized this many elements at a time at most (whole experts, at least one),
# so the fp32 temporaries of real-width layers stay small.
CHUNK_ELEMENTS = 2**25


def quantize_weights(w_ENK: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of float weights ``w_ENK [E, N, K]`` in ``spec``'s format:
    scales from each group's absolute maximum, values rounded to the nearest
    representable one (mxfp4 ties go to the smaller magnitude). A few experts
    at a time (`CHUNK_ELEMENTS`), into outputs allocated once."""
    num_experts, rows, cols = w_ENK.shape
    q = torch.empty(weight_shape(spec, num_experts, rows, cols), dtype=weight_dtype(spec),
                    device=w_ENK.device)
    scale = torch.empty(scale_shape(spec, num_experts, rows, cols), dtype=scale_dtype(spec),
                        device=w_ENK.device)
    step = max(1, CHUNK_ELEMENTS // max(1, rows * cols))
    for first in range(0, num_experts, step):
        q[first:first + step], scale[first:first + step] = _quantize_experts(
            w_ENK[first:first + step], spec)
    return q, scale


def _quantize_experts(w_ENK: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    w_ENK = w_ENK.float()
    if spec.weights == "mxfp4":
        return _quantize_mxfp4(w_ENK)
    if spec.weights == "fp8_tensor":
        scale = _fp8_scale(w_ENK.abs().amax(dim=(1, 2)))
        expanded = scale[:, None, None]
    elif spec.weights == "fp8_channel":
        scale = _fp8_scale(w_ENK.abs().amax(dim=2))
        expanded = scale[:, :, None]
    else:
        block_rows, block_cols = spec.block_size
        scale = _fp8_scale(_blocks(w_ENK, block_rows, block_cols).abs().amax(dim=(2, 4)))
        expanded = _expand_blocks(scale, block_rows, block_cols)
    return _to_fp8(w_ENK / expanded), scale


def dequantize_weights(q: torch.Tensor, scale: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The fp32 ``[E, N, K]`` weights that ``(q, scale)`` stand for."""
    if spec.weights == "mxfp4":
        return _dequantize_mxfp4(q, scale)
    values = q.float()
    if spec.weights == "fp8_tensor":
        return values * scale.float()[:, None, None]
    if spec.weights == "fp8_channel":
        return values * scale.float()[:, :, None]
    return values * _expand_blocks(scale.float(), *spec.block_size)


def _fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    return amax.float().clamp(min=MIN_SCALE) / FP8_MAX


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    # Rounding can land just past the largest value: clamp, never overflow to NaN.
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _expand_blocks(scale_EBC: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    return scale_EBC.repeat_interleave(block_rows, dim=1).repeat_interleave(block_cols, dim=2)


def activation_group(spec: QuantSpec, cols: int) -> int:
    """Columns that share one activation scale: the row (``fp8_token``) or ``bk``."""
    return spec.block_size[1] if spec.activations == "fp8_group" else cols


def quantize_activations(x_MK: torch.Tensor, spec: QuantSpec
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [M, K] fp8, scale)`` of ``x_MK`` under an fp8 ``spec.activations``:
    ``scale [M]`` for ``fp8_token``, ``[M, K / bk]`` for ``fp8_group``."""
    rows, cols = x_MK.shape
    group = activation_group(spec, cols)
    # fp32 math with no fp32 copy of x: the maximum is exact in x's own dtype (and
    # rounds to fp32 as the maximum of rounded values would), and the division
    # promotes x on the fly; fp64 is read as fp32 first. Row-major out, as
    # torch._scaled_grouped_mm takes it.
    x_MGC = (x_MK.float() if x_MK.dtype == torch.float64 else x_MK).contiguous().reshape(
        rows, cols // group, group)
    scale_MG = _fp8_scale(torch.linalg.vector_norm(x_MGC, math.inf, dim=2))
    q_MK = _to_fp8(x_MGC / scale_MG[:, :, None]).reshape(rows, cols)
    return q_MK, scale_MG.squeeze(1) if spec.activations == "fp8_token" else scale_MG


def dequantize_activations(q_MK: torch.Tensor, scale: torch.Tensor, spec: QuantSpec
                           ) -> torch.Tensor:
    """The fp32 ``[M, K]`` activations that ``(q, scale)`` stand for."""
    rows, cols = q_MK.shape
    group = activation_group(spec, cols)
    scale_MG = scale.float().reshape(rows, cols // group)
    return (q_MK.float().reshape(rows, cols // group, group)
            * scale_MG[:, :, None]).reshape(rows, cols)


def round_trip_activations(x_MK: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """What a w8a8 GEMM sees of ``x_MK`` (fp32): quantized and read back, or
    ``x_MK`` itself in fp32 where ``spec.activations == "none"``."""
    if spec.activations == "none":
        return x_MK.float()
    return dequantize_activations(*quantize_activations(x_MK, spec), spec)


def _e2m1_table(device: torch.device) -> torch.Tensor:
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([magnitudes, -magnitudes])


def _quantize_mxfp4(w_ENK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num_experts, rows, cols = w_ENK.shape
    w_ENGC = w_ENK.reshape(num_experts, rows, cols // MXFP4_GROUP, MXFP4_GROUP)
    amax_ENG = w_ENGC.abs().amax(dim=3)
    # OCP MX: the shared exponent is floor(log2(amax)) less e2m1's largest
    # exponent (2, for 6 = 1.5 * 2**2); larger values clamp to 6.
    exponent_ENG = torch.where(amax_ENG > 0, torch.floor(torch.log2(amax_ENG)) - 2, -E8M0_BIAS)
    exponent_ENG = exponent_ENG.clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled_ENGC = w_ENGC / torch.exp2(exponent_ENG)[..., None]
    table = _e2m1_table(w_ENK.device)
    nibbles = (scaled_ENGC[..., None] - table).abs().argmin(dim=-1).to(torch.uint8)
    nibbles_ENK = nibbles.reshape(num_experts, rows, cols)
    packed = nibbles_ENK[..., 0::2] | (nibbles_ENK[..., 1::2] << 4)
    scale_ENG = torch.where(w_ENGC.isfinite().all(dim=3), exponent_ENG + E8M0_BIAS, E8M0_NAN)
    return packed, scale_ENG.to(torch.uint8)


def _dequantize_mxfp4(packed_ENP: torch.Tensor, scale_ENG: torch.Tensor) -> torch.Tensor:
    num_experts, rows, half_cols = packed_ENP.shape
    table = _e2m1_table(packed_ENP.device)
    low, high = table[(packed_ENP & 0xF).long()], table[(packed_ENP >> 4).long()]
    values_ENK = torch.stack([low, high], dim=-1).reshape(num_experts, rows, 2 * half_cols)
    scale_ENG = torch.where(scale_ENG == E8M0_NAN, math.nan,
                            torch.exp2(scale_ENG.float() - E8M0_BIAS))
    return values_ENK * scale_ENG.repeat_interleave(MXFP4_GROUP, dim=2)
