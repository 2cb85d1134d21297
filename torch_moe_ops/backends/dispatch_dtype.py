"""The dtype tokens travel in between dispatch and the experts: one rule, per layer.

In order, the first that speaks decides: the explicit argument
(``BackendSpec.dispatch_dtype``), then the quantization spec (the activation
format its kernels read), then the experts backend (``ExpertsBackend.dispatch_dtype``:
one that quantizes inside wants its input unquantized), then the hardware
default (the activations' own dtype). A choice no dispatch kernel can produce
(or the experts backend cannot read) falls back to the next rule that can, with
one warning naming both; a quantization spec whose dtype cannot be used raises,
since falling back would run other numerics than the spec asks for.

Nothing here writes process state: the result belongs to one layer of one
compiled model, so two models in one process may choose differently.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

# Quantization methods and the activation dtype their kernels read: none yet.
QUANT_DISPATCH_DTYPES: dict[str, torch.dtype] = {}


@dataclasses.dataclass(frozen=True)
class DispatchDtype:
    """The resolved dtype and which rule chose it."""

    dtype: torch.dtype
    rule: str


def has_dispatch_kernel(dtype: torch.dtype, activation_dtype: torch.dtype) -> bool:
    """Whether dispatch can send rows in ``dtype``: today only unconverted activations."""
    return dtype == activation_dtype


def resolve_dispatch_dtype(activation_dtype: torch.dtype, explicit: torch.dtype | None = None,
                           quant: str | None = None,
                           experts_dtype: torch.dtype | None = None,
                           experts_name: str = "the experts backend") -> DispatchDtype:
    """The dispatch dtype of one layer whose activations are ``activation_dtype``."""
    rules = [("dispatch_dtype argument", explicit),
             (f"quantization spec {quant!r}", QUANT_DISPATCH_DTYPES.get(quant)),
             (f"experts backend {experts_name}", experts_dtype),
             ("hardware default (the activation dtype)", activation_dtype)]
    spoken = [(rule, dtype) for rule, dtype in rules if dtype is not None]
    first_rule, first_dtype = spoken[0]
    for rule, dtype in spoken:
        usable = (has_dispatch_kernel(dtype, activation_dtype)
                  and experts_dtype in (None, dtype))
        if usable:
            if rule != first_rule:
                warnings.warn(f"dispatch dtype {first_dtype} ({first_rule}) cannot be used "
                              f"with {activation_dtype} activations and {experts_name}; "
                              f"dispatching in {dtype} ({rule}) instead", stacklevel=2)
            return DispatchDtype(dtype, rule)
        if rule.startswith("quantization spec"):
            raise ValueError(f"dispatch dtype {dtype} ({rule}) cannot be used with "
                             f"{activation_dtype} activations and {experts_name}, and "
                             "falling back would run other numerics than the spec asks for")
    raise ValueError(f"{experts_name} reads {experts_dtype}, which no dispatch kernel "
                     f"produces from {activation_dtype} activations")
