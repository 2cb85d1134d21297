"""The gated activations of an expert in plain PyTorch (`MoEConfig` documents them),
and their gradients in closed form.

Legend: N rows, I expert intermediate size.
"""

from __future__ import annotations

import math

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


def activation_backward(grad_NI: torch.Tensor, gate_NI: torch.Tensor, up_NI: torch.Tensor,
                        name: str, alpha: float, limit: float):
    """``(grad_gate_NI, grad_up_NI)``: the gradients of `activation` with respect to
    gate and up, given the gradient ``grad_NI`` of its output. Computed in the
    inputs' dtype."""
    if name == "silu":
        sig_NI = torch.sigmoid(gate_NI)
        silu_NI = gate_NI * sig_NI
        return grad_NI * up_NI * sig_NI * (1 + gate_NI * (1 - sig_NI)), grad_NI * silu_NI
    if name == "gelu":
        cdf_NI = 0.5 * (1 + torch.erf(gate_NI * math.sqrt(0.5)))
        pdf_NI = torch.exp(-0.5 * gate_NI * gate_NI) / math.sqrt(2 * math.pi)
        return grad_NI * up_NI * (cdf_NI + gate_NI * pdf_NI), grad_NI * F.gelu(gate_NI)
    gate_c_NI = gate_NI.clamp(max=limit)
    up_c_NI = up_NI.clamp(min=-limit, max=limit)
    sig_NI = torch.sigmoid(alpha * gate_c_NI)
    d_gate_NI = (up_c_NI + 1) * sig_NI * (1 + alpha * gate_c_NI * (1 - sig_NI))
    # clamp passes the gradient where the input is inside the bounds, ends included.
    d_gate_NI = d_gate_NI * (gate_NI <= limit)
    d_up_NI = gate_c_NI * sig_NI * ((up_NI >= -limit) & (up_NI <= limit))
    return grad_NI * d_gate_NI, grad_NI * d_up_NI
