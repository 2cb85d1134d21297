"""The gated activations of an expert in plain PyTorch (`MoEConfig` documents them).

Legend: N rows, I expert intermediate size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def activation(gate_NI: torch.Tensor, up_NI: torch.Tensor, name: str, alpha: float,
               limit: float) -> torch.Tensor:
    """``a_NI``: ``silu(gate) * up``, ``gelu(gate) * up`` (erf) or ``swiglu_oai``.

    ``swiglu_oai``: ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``,
    ``(up + 1) * gate * sigmoid(alpha * gate)``. Computed in the inputs' dtype.
    """
    if name == "silu":
        return F.silu(gate_NI) * up_NI
    if name == "gelu":
        return F.gelu(gate_NI) * up_NI
    gate_NI = gate_NI.clamp(max=limit)
    up_NI = up_NI.clamp(min=-limit, max=limit)
    return (up_NI + 1) * gate_NI * torch.sigmoid(alpha * gate_NI)
