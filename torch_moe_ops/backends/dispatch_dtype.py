"""The dtype tokens travel in between dispatch and the experts: one rule, per layer.

In order, the first that speaks and can be met decides:

1. the explicit argument (``BackendSpec.dispatch_dtype``);
2. the quantization spec (`QuantSpec` on ``MoEConfig.quant``): fp8 where its
   activations are fp8 (``fp8_token``, ``fp8_group``), the a2a backend sends
   quantized rows (``moe::dispatch_quant``) and the experts backend reads them
   (``ExpertsBackend.quantized_rows`` names the format); it says nothing otherwise;
3. the experts backend (``ExpertsBackend.dispatch_dtype``: a dtype it requires);
4. the hardware default: the activations' own dtype.

An explicit choice that cannot be met (fp8 for a layer whose activations are
not quantized, or for experts that quantize their rows themselves; a dtype no
dispatch kernel converts to) falls back to the next rule that can be met, with
one warning naming both. The quantization spec needs no warning where it is
not met: an experts backend that quantizes inside gets its rows in the
activation dtype and quantizes each of them once, by the same formula
(`quant.quantize_activations`) as dispatch would have: the same values, only
more bytes on the way. That is the bug this rule exists to rule out: fp8 rows
sent to a kernel that expects bf16.

Where the result is fp8, the lowering runs ``moe::dispatch_quant`` in place of
``moe::dispatch`` and hands its scales to ``moe::experts_rows_quant``
(`torch_moe_ops.lowering.rewrite`); combine stays in the activation dtype.

Nothing here writes process state: the result belongs to one layer of one
compiled model, so two models in one process may choose differently.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from torch_moe_ops.backends.registry import A2ABackend, ExpertsBackend
from torch_moe_ops.config import QuantSpec

FP8 = torch.float8_e4m3fn
# Activation formats (`QuantSpec.activations`) and the dtype their rows can travel in.
QUANT_DISPATCH_DTYPES: dict[str, torch.dtype] = {"fp8_token": FP8, "fp8_group": FP8}
DEFAULT_RULE = "hardware default (the activation dtype)"


@dataclasses.dataclass(frozen=True)
class DispatchDtype:
    """The resolved dtype and which rule chose it."""

    dtype: torch.dtype
    rule: str


@dataclasses.dataclass(frozen=True)
class DispatchSides:
    """What the two ends of one layer's dispatch can do.

    ``sends_quantized``: the a2a backend sends fp8 rows (``dispatch_quant``);
    ``experts_dtype``: a dtype the experts backend requires (``None``: any it can
    read); ``experts_quantized_rows``: the activation formats whose fp8 rows the
    experts read (``ExpertsBackend.quantized_rows``).
    """

    a2a_name: str = "the a2a backend"
    sends_quantized: bool = False
    experts_name: str = "the experts backend"
    experts_dtype: torch.dtype | None = None
    experts_quantized_rows: tuple[str, ...] = ()

    @classmethod
    def of(cls, a2a: A2ABackend, experts: ExpertsBackend) -> DispatchSides:
        """What the registered backends ``a2a`` and ``experts`` can do."""
        return cls(f"a2a backend {a2a.name!r}", a2a.sends_quantized,
                   f"experts backend {experts.name!r}", experts.dispatch_dtype,
                   experts.quantized_rows)


def _name(quant: QuantSpec | None) -> str | None:
    return None if quant is None else quant.name


def _why_not(dtype: torch.dtype, activation_dtype: torch.dtype, quant: QuantSpec | None,
             sides: DispatchSides) -> str | None:
    """Why rows of a layer with ``activation_dtype`` activations cannot travel in
    ``dtype`` between ``sides``, or None where they can."""
    if sides.experts_dtype not in (None, dtype):
        return f"{sides.experts_name} reads {sides.experts_dtype}"
    if dtype == activation_dtype:
        return None
    if dtype != FP8:
        return f"no dispatch kernel converts {activation_dtype} activations to {dtype}"
    formats = quant.activations if quant is not None else None
    if formats not in QUANT_DISPATCH_DTYPES:
        return f"the layer's activations are not quantized to fp8 (quant={_name(quant)})"
    if not sides.sends_quantized:
        return f"{sides.a2a_name} cannot send fp8 rows"
    if sides.experts_dtype is None and formats not in sides.experts_quantized_rows:
        return f"{sides.experts_name} quantizes its rows itself (reads no {formats} rows)"
    return None


def resolve_dispatch_dtype(activation_dtype: torch.dtype, explicit: torch.dtype | None = None,
                           quant: QuantSpec | None = None,
                           sides: DispatchSides = DispatchSides()) -> DispatchDtype:
    """The dispatch dtype of one layer whose activations are ``activation_dtype``
    and whose weights are quantized as ``quant`` (None: not quantized)."""
    quant_dtype = QUANT_DISPATCH_DTYPES.get(quant.activations) if quant is not None else None
    if quant_dtype is not None and _why_not(quant_dtype, activation_dtype, quant, sides):
        quant_dtype = None
    rules = [("dispatch_dtype argument", explicit),
             (f"quantization spec {_name(quant)}", quant_dtype),
             (sides.experts_name, sides.experts_dtype),
             (DEFAULT_RULE, activation_dtype)]
    spoken = [(rule, dtype) for rule, dtype in rules if dtype is not None]
    first_rule, first_dtype = spoken[0]
    for rule, dtype in spoken:
        if _why_not(dtype, activation_dtype, quant, sides) is None:
            if rule != first_rule:
                reason = _why_not(first_dtype, activation_dtype, quant, sides)
                warnings.warn(f"dispatch dtype {first_dtype} ({first_rule}) cannot be used: "
                              f"{reason}; dispatching in {dtype} ({rule}) instead",
                              stacklevel=2)
            return DispatchDtype(dtype, rule)
    raise ValueError(f"{sides.experts_name} reads {sides.experts_dtype}, which no dispatch "
                     f"kernel produces from {activation_dtype} activations")
