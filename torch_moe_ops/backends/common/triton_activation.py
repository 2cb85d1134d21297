"""The gated activations as a Triton function, for kernels that apply them in registers.

    act(gate, up) = silu(gate) * up | gelu(gate) * up (erf) | swiglu_oai(gate, up)

The same formulas as `activation`, computed in the precision of the inputs
(the kernels pass fp32 accumulators).
"""

from __future__ import annotations

import triton
import triton.language as tl

# `ACTIVATION` values of the kernels that call `_activate`.
ACTIVATION_CODES = {"silu": 0, "gelu": 1, "swiglu_oai": 2}


@triton.jit
def _activate(gate, up, swiglu_alpha, swiglu_limit, ACTIVATION: tl.constexpr):
    if ACTIVATION == 0:
        return gate * tl.sigmoid(gate) * up
    elif ACTIVATION == 1:
        return 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476)) * up
    else:
        gate = tl.minimum(gate, swiglu_limit)
        up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
        return (up + 1.0) * gate * tl.sigmoid(swiglu_alpha * gate)
