"""Argument checks shared by the ops: each failure names the argument, what was
received and what was expected, so a bad call never reaches a kernel."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The ops also take float64 activations, weights and router logits: the reference
# backend computes in it end to end (gradcheck, fp64 oracles).
OP_FLOAT_DTYPES = (*FLOAT_DTYPES, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the ops accumulate in for inputs of ``dtype``: fp32, or fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def _names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(name: str, t: object, ndim: int, dtypes: Sequence[torch.dtype]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in ({_names(dtypes)}), got "
                         f"{str(t.dtype).removeprefix('torch.')}")


def check_gradient_of(grad_out: torch.Tensor, input_: torch.Tensor, input_name: str) -> None:
    """``grad_out``: a float tensor of ``input_``'s shape (the gradient of an op's output that
    has its input's shape)."""
    check_tensor("grad_out", grad_out, input_.dim(), OP_FLOAT_DTYPES)
    if grad_out.shape != input_.shape:
        raise ValueError(f"grad_out must have {input_name}'s shape {tuple(input_.shape)}, "
                         f"got {tuple(grad_out.shape)}")


def check_size(name: str, t: torch.Tensor, dim: int, expected: int, what: str) -> None:
    # `!=` on symbolic sizes adds a guard that holds for every size that reaches here.
    if t.shape[dim] != expected:
        raise ValueError(f"{name}.shape[{dim}] must equal {what} ({expected}), "
                         f"got shape {tuple(t.shape)}")


def check_same_device(reference_name: str, reference: torch.Tensor,
                      **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.device != reference.device:
            raise ValueError(f"{name} must be on {reference_name}'s device "
                             f"({reference.device}), got {t.device}")


def check_same_dtype(reference_name: str, reference: torch.Tensor,
                     **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.dtype != reference.dtype:
            raise ValueError(f"{name} must have {reference_name}'s dtype "
                             f"({str(reference.dtype).removeprefix('torch.')}), got "
                             f"{str(t.dtype).removeprefix('torch.')}")


def check_choice(name: str, value: object, allowed: Sequence[object]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, "
                         f"got {value!r}")


def check_positive(name: str, value: float) -> None:
    # Comparisons, not math.isfinite: under torch.compile the value may be a SymFloat.
    if not -math.inf < value < math.inf:
        raise ValueError(f"{name} must be finite, got {value!r}")
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def value_checks_enabled(device: torch.device) -> bool:
    """Checks of tensor contents cost a host sync on an accelerator: there they
    run only with ``TORCH_MOE_OPS_CHECK_VALUES=1``; on the CPU they are free."""
    return device.type == "cpu" or os.environ.get("TORCH_MOE_OPS_CHECK_VALUES") == "1"


def check_ids_in_range(name: str, ids: torch.Tensor, bound: int, what: str = "expert ids"
                       ) -> None:
    """Every id must be -1 (skip) or in ``[0, bound)``."""
    if ids.numel() == 0 or not value_checks_enabled(ids.device):
        return
    lowest, highest = int(ids.min()), int(ids.max())
    if lowest < -1 or highest >= bound:
        bad = lowest if lowest < -1 else highest
        raise ValueError(f"{name} must hold -1 (skip) or {what} in [0, {bound}), got {bad}")
