"""The gated activations as Triton functions, for kernels that apply them in registers.

    act(gate, up) = silu(gate) * up | gelu(gate) * up (erf) | swiglu_oai(gate, up)

The same formulas as `activation` and `activation_backward`, computed in the
precision of the inputs (the kernels pass fp32 accumulators).
"""

from __future__ import annotations

import triton
import triton.language as tl

# `ACTIVATION` values of the kernels that call `_activate`.
ACTIVATION_CODES = {"silu": 0, "gelu": 1, "swiglu_oai": 2}


@triton.jit
def _fp32(swiglu_alpha, swiglu_limit):
    # Inductor passes Python floats to the kernels it launches as fp64 scalars:
    # mixed into an fp32 accumulator they would make it fp64, which tl.dot rejects.
    return tl.cast(swiglu_alpha, tl.float32), tl.cast(swiglu_limit, tl.float32)


@triton.jit
def _activate(gate, up, swiglu_alpha, swiglu_limit, ACTIVATION: tl.constexpr):
    swiglu_alpha, swiglu_limit = _fp32(swiglu_alpha, swiglu_limit)
    if ACTIVATION == 0:
        return gate * tl.sigmoid(gate) * up
    elif ACTIVATION == 1:
        return 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476)) * up
    else:
        gate = tl.minimum(gate, swiglu_limit)
        up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
        return (up + 1.0) * gate * tl.sigmoid(swiglu_alpha * gate)


@triton.jit
def _activate_backward(gate, up, swiglu_alpha, swiglu_limit, ACTIVATION: tl.constexpr):
    """``(act(gate, up), d act / d gate, d act / d up)``: `activation_backward`'s
    closed forms (clamp passes the gradient inside its bounds, ends included)."""
    swiglu_alpha, swiglu_limit = _fp32(swiglu_alpha, swiglu_limit)
    if ACTIVATION == 0:
        sig = tl.sigmoid(gate)
        silu = gate * sig
        return silu * up, up * sig * (1.0 + gate * (1.0 - sig)), silu
    elif ACTIVATION == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(gate * 0.7071067811865476))
        pdf = tl.exp(-0.5 * gate * gate) * 0.3989422804014327
        return gate * cdf * up, up * (cdf + gate * pdf), gate * cdf
    else:
        gate_c = tl.minimum(gate, swiglu_limit)
        up_c = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
        sig = tl.sigmoid(swiglu_alpha * gate_c)
        glu = gate_c * sig
        d_gate = (up_c + 1.0) * sig * (1.0 + swiglu_alpha * gate_c * (1.0 - sig))
        d_gate = tl.where(gate <= swiglu_limit, d_gate, 0.0)
        d_up = tl.where((up >= -swiglu_limit) & (up <= swiglu_limit), glu, 0.0)
        return (up_c + 1.0) * glu, d_gate, d_up
