"""Our canonical experts in the layout FlashInfer's CUTLASS fused MoE reads (`PreparedWeights`,
made by `prepare_weights`), for each weight format the ``flashinfer`` experts backend runs.

Legend: E experts, H hidden size, I expert intermediate size, F = 2 * I; mxfp4: h = H / 2
and i = I / 2 packed bytes of a row, g = K / 32 e8m0 scale groups of a matrix's K columns,
and a trailing p marks a size padded to `MXFP4_ALIGNMENT` (Hp, Ip, Fp = 2 * Ip).

Every format: ``fc1`` holds the up rows first and the gate rows second (``w13`` the other
way round: `swap_halves`); ``fc2`` is ``w2``; the biases come both or neither (zeros stand
in for the absent one), in the activations' dtype.

- bf16: ``fc1 [E, F, H]``, ``fc2 [E, H, I]``, no scales.
- fp8 128 x 128 blocks: fp8 weights as above, ``quant_scales = [fc1 [E, F/128, H/128]``
  (halves swapped), ``fc2 [E, H/128, I/128]]`` in fp32.
- mxfp4 (W4A16): the sm90 mixed-input GEMM reads each expert matrix ``[N, K]`` in tiles
  of 64 (or 128) rows by 128 (or more) columns, and its scales folded per 64 x 128 block
  (FlashInfer's ``interleave_moe_scales_for_sm90_mixed_gemm``: N a multiple of 64, K of
  128), its packed values shuffled for its conversion to bf16
  (``interleave_moe_weights_for_sm90_mixed_gemm``). So H and I are padded to multiples of
  128 first: zero values (scale ``2**0``) in the new columns and rows, zero biases, so
  the padded intermediate columns are 0 after any of the activations and add nothing.
  ``fc1 [E, Fp, Hp/2]``, ``fc2 [E, Hp, Ip/2]`` interleaved, ``quant_scales = [fc1
  [E, Fp/64, Hp/128, 16, 4], fc2 [E, Hp/64, Ip/128, 16, 4]]`` (the folded e8m0 bytes
  viewed as int32, as FlashInfer's own W4A16 tests pass them). Where H is
  padded (GPT-OSS: 2880 -> 2944) each call pads its tokens and cuts its output back
  (`PreparedWeights.padded_hidden`); a padded I costs the calls nothing.
"""

from __future__ import annotations

import dataclasses

import torch

from torch_moe_ops import quant
from torch_moe_ops.backends.common.weight_cache import outside_graph_pools
from torch_moe_ops.config import MXFP4_GROUP, QuantSpec

# FlashInfer's ActivationType per activation of ours.
ACTIVATION_TYPES = {"silu": "Swiglu", "gelu": "Geglu", "swiglu_oai": "Swiglu"}
# The sm90 mixed-input GEMM's smallest K tile and its scale folding's K block (both 128):
# H and I of mxfp4 weights are padded to multiples of it.
MXFP4_ALIGNMENT = 128
# The e8m0 scale of the padding: 2**0 (0xFF would be NaN, and NaN * 0 is NaN).
E8M0_ONE = quant.E8M0_BIAS


def padded(size: int, alignment: int = MXFP4_ALIGNMENT) -> int:
    """``size`` rounded up to a multiple of ``alignment``."""
    return -(-size // alignment) * alignment


def swap_halves(t_EF: torch.Tensor, padded_half: int | None = None,
                padded_cols: int | None = None, fill: int = 0) -> torch.Tensor:
    """A contiguous copy of ``t_EF`` (``[E, F]`` or ``[E, F, C]``) with the two halves of dim
    1 swapped: gate rows then up rows become up rows then gate rows. ``padded_half`` grows
    each half to that many rows, ``padded_cols`` dim 2 to that many columns; the new
    entries hold ``fill``."""
    num_experts, rows = t_EF.shape[:2]
    half = rows // 2
    new_half = padded_half or half
    shape = (num_experts, 2 * new_half, *([padded_cols or t_EF.shape[2]] if t_EF.dim() == 3
                                          else []))
    out = t_EF.new_full(shape, fill)
    cols = t_EF.shape[2:]
    up, gate = out[:, :half], out[:, new_half:new_half + half]
    if cols:
        up, gate = up[..., :cols[0]], gate[..., :cols[0]]
    up.copy_(t_EF[:, half:])
    gate.copy_(t_EF[:, :half])
    return out


def _grown(t: torch.Tensor, shape: tuple[int, ...], fill: int = 0) -> torch.Tensor:
    """``t`` in the leading corner of a new ``shape`` tensor of ``fill``."""
    if tuple(t.shape) == shape:
        return t.contiguous()
    out = t.new_full(shape, fill)
    out[tuple(slice(0, size) for size in t.shape)].copy_(t)
    return out


@dataclasses.dataclass(frozen=True)
class PreparedWeights:
    """One layer's experts in FlashInfer's layout (the module docstring has the shapes).

    ``format_kwargs``: ``cutlass_fused_moe``'s switches for the weight format;
    ``hidden_size`` (H) and ``padded_hidden`` (the width the kernels run, H but where
    mxfp4 pads it). ``swiglu`` holds the per-expert ``swiglu_alpha``/``_beta``/``_limit``
    tensors of each ``(alpha, limit)`` a call asked for.
    """

    fc1: torch.Tensor
    fc2: torch.Tensor
    fc1_bias: torch.Tensor | None
    fc2_bias: torch.Tensor | None
    quant_scales: list[torch.Tensor]
    hidden_size: int
    padded_hidden: int
    format_kwargs: dict = dataclasses.field(default_factory=dict)
    swiglu: dict = dataclasses.field(default_factory=dict)

    def activation_kwargs(self, activation: str, alpha: float, limit: float) -> dict:
        """``cutlass_fused_moe``'s activation arguments for ``activation``."""
        from flashinfer.fused_moe import ActivationType

        kwargs = {"activation_type": getattr(ActivationType, ACTIVATION_TYPES[activation])}
        if activation == "swiglu_oai":
            if (alpha, limit) not in self.swiglu:
                num_experts, device = self.fc1.shape[0], self.fc1.device
                # Kept with the prepared weights.
                self.swiglu[(alpha, limit)] = outside_graph_pools(device, lambda: {
                    f"swiglu_{name}": torch.full((num_experts,), value,
                                                 dtype=torch.float32, device=device)
                    for name, value in (("alpha", alpha), ("beta", 1.0), ("limit", limit))})
            kwargs.update(self.swiglu[(alpha, limit)])
        return kwargs


def _biases(b13_EF, b2_EH, num_experts, rows, hidden, padded_half=None):
    """``(fc1_bias, fc2_bias)``: both or neither, zeros for an absent one, padded."""
    if b13_EF is None and b2_EH is None:
        return None, None
    like = b13_EF if b13_EF is not None else b2_EH
    fc1_bias = (swap_halves(b13_EF, padded_half) if b13_EF is not None
                else like.new_zeros((num_experts, rows)))
    fc2_bias = (_grown(b2_EH, (num_experts, hidden)) if b2_EH is not None
                else like.new_zeros((num_experts, hidden)))
    return fc1_bias, fc2_bias


def prepare_weights(w13: torch.Tensor, w2: torch.Tensor, b13_EF: torch.Tensor | None,
                    b2_EH: torch.Tensor | None, w13_scale: torch.Tensor | None = None,
                    w2_scale: torch.Tensor | None = None,
                    spec: QuantSpec | None = None) -> PreparedWeights:
    """Our canonical experts in FlashInfer's layout for ``spec`` (None: bf16; else fp8
    128 x 128 blocks or mxfp4), as `PreparedWeights`.

    ``w13 [E, F, H]`` (gate rows then up rows), ``w2 [E, H, I]``, optional ``b13 [E, F]``,
    ``b2 [E, H]``; fp8 blocks: fp8 weights with fp32 scales ``[E, F/128, H/128]`` and
    ``[E, H/128, I/128]``; mxfp4: uint8 ``[E, F, H/2]``, ``[E, H, I/2]`` with e8m0 scales
    ``[E, F, H/32]``, ``[E, H, I/32]``. bf16 and fp8 copy ``w13``, ``b13`` and
    ``w13_scale`` and use the rest as is where contiguous; mxfp4 copies everything
    (interleaved, on the GPU that runs FlashInfer's module).
    """
    with torch.no_grad():
        if spec is not None and spec.weights == "mxfp4":
            return _prepare_mxfp4(w13, w2, b13_EF, b2_EH, w13_scale, w2_scale)
        num_experts, hidden = w2.shape[:2]
        fc1_bias, fc2_bias = _biases(b13_EF, b2_EH, num_experts, w13.shape[1], hidden)
        scales, kwargs = [], {}
        if spec is not None:
            scales = [swap_halves(w13_scale.float()), w2_scale.float().contiguous()]
            kwargs = {"use_deepseek_fp8_block_scale": True}
        return PreparedWeights(swap_halves(w13), w2.contiguous(), fc1_bias, fc2_bias, scales,
                               hidden, hidden, kwargs)


def copy_bytes(w13: torch.Tensor, w2: torch.Tensor, b13_EF: torch.Tensor | None,
               b2_EH: torch.Tensor | None, w13_scale: torch.Tensor | None = None,
               w2_scale: torch.Tensor | None = None, spec: QuantSpec | None = None) -> int:
    """The bytes `prepare_weights` allocates for these weights (its arguments), at its
    peak: bf16 and fp8 copy ``w13``, ``b13`` (zeros where only ``b2`` is given) and
    ``w13``'s scales, and ``w2``, ``b2`` (zeros where only ``b13`` is given) and ``w2``'s
    scales where not contiguous; mxfp4 makes every tensor padded, and keeps each padded
    matrix and its scales beside their interleaved copies until it returns."""
    num_experts, hidden = w2.shape[:2]
    like = b13_EF if b13_EF is not None else b2_EH
    if spec is not None and spec.weights == "mxfp4":
        padded_hidden, padded_inter = padded(hidden), padded(2 * w2.shape[2])
        # fc1 [E, Fp, Hp/2] and fc2 [E, Hp, Ip/2] packed bytes, one scale byte per 32 values.
        values = num_experts * 3 * padded_inter * padded_hidden // 2
        bias_rows = 2 * padded_inter + padded_hidden
        return (2 * (values + values // (MXFP4_GROUP // 2))
                + (0 if like is None else num_experts * bias_rows * like.element_size()))
    copied = [w13, b13_EF, w13_scale,
              *(t for t in (w2, b2_EH, w2_scale) if t is not None and not t.is_contiguous())]
    size = sum(t.numel() * t.element_size() for t in copied if t is not None)
    if (b13_EF is None) != (b2_EH is None):
        size += num_experts * (hidden if b2_EH is None else w13.shape[1]) * like.element_size()
    return size


def _folded_scales(scale_ENg: torch.Tensor) -> torch.Tensor:
    """e8m0 scales ``[E, N, K/32]`` folded per 64 x 128 block, each block's 16-byte rows
    viewed as int32 (``[E, N/64, K/128, 16, 4]``), as FlashInfer's W4A16 tests pass them."""
    from flashinfer.fused_moe import interleave_moe_scales_for_sm90_mixed_gemm

    return interleave_moe_scales_for_sm90_mixed_gemm(scale_ENg, MXFP4_GROUP).view(torch.int32)


def _prepare_mxfp4(w13_EFh, w2_EHi, b13_EF, b2_EH, w13_scale_EFg, w2_scale_EHg
                   ) -> PreparedWeights:
    from flashinfer.fused_moe import interleave_moe_weights_for_sm90_mixed_gemm

    num_experts, hidden, packed_inter = w2_EHi.shape
    padded_hidden, padded_inter = padded(hidden), padded(2 * packed_inter)
    fc1_EFph = swap_halves(w13_EFh, padded_inter, padded_hidden // 2)
    fc1_scale_EFpg = swap_halves(w13_scale_EFg, padded_inter, padded_hidden // MXFP4_GROUP,
                                 E8M0_ONE)
    fc2_EHpi = _grown(w2_EHi, (num_experts, padded_hidden, padded_inter // 2))
    fc2_scale_EHpg = _grown(w2_scale_EHg, (num_experts, padded_hidden,
                                           padded_inter // MXFP4_GROUP), E8M0_ONE)
    fc1_bias, fc2_bias = _biases(b13_EF, b2_EH, num_experts, 2 * padded_inter, padded_hidden,
                                 padded_inter)
    return PreparedWeights(
        interleave_moe_weights_for_sm90_mixed_gemm(fc1_EFph, "fp4"),
        interleave_moe_weights_for_sm90_mixed_gemm(fc2_EHpi, "fp4"), fc1_bias, fc2_bias,
        [_folded_scales(fc1_scale_EFpg), _folded_scales(fc2_scale_EHpg)],
        hidden, padded_hidden, {"use_w4_group_scaling": True})
