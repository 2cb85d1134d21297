"""transformers' experts implementation ``"torch_moe_ops"``: experts on ``moe::experts``.

Legend: T tokens, H hidden size, I expert intermediate size, E experts, K experts
per token, F = 2 * I.

Once registered (`register_experts_implementation`, which importing
`torch_moe_ops.hf` does), ``from_pretrained(..., experts_implementation="torch_moe_ops")``
and ``model.set_experts_implementation("torch_moe_ops")`` run the experts of any
model whose experts use the canonical layout on ``moe::experts``; the routing
stays transformers'. Other layouts (GPT-OSS) raise and point to `patch`.
"""

from __future__ import annotations

import torch
from torch import nn

from torch_moe_ops.config import MoEConfig
from torch_moe_ops.hf.families import ACTIVATIONS
from torch_moe_ops.routed_experts import autocast_inputs

EXPERTS_IMPLEMENTATION = "torch_moe_ops"


def _interface_weights(experts: nn.Module):
    """``(w13, w2, b13, b2, activation, alpha, limit)`` of a ``@use_experts_implementation``
    module, or ValueError if its layout or activation is not ours."""
    name = type(experts).__name__
    flags = {"has_gate": True, "is_concatenated": True, "is_transposed": False,
             "has_post_expert_norm": False}
    for flag, expected in flags.items():
        if getattr(experts, flag, expected) != expected:
            raise ValueError(
                f"experts_implementation={EXPERTS_IMPLEMENTATION!r} needs {flag}={expected} "
                f"(gate_up_proj [E, 2I, H] gate rows then up rows, down_proj [E, H, I]), got "
                f"{name} with {flag}={not expected}; torch_moe_ops.hf.patch(model) converts "
                f"the supported families instead")
    from transformers.integrations.moe import _default_apply_gate

    if getattr(type(experts), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        raise ValueError(f"experts_implementation={EXPERTS_IMPLEMENTATION!r} computes "
                         f"act(gate) * up; {name} defines its own _apply_gate")
    activation = ACTIVATIONS.get(getattr(experts.config, "hidden_act", None))
    if activation is None:
        raise ValueError(f"experts_implementation={EXPERTS_IMPLEMENTATION!r} needs hidden_act in "
                         f"{', '.join(map(repr, ACTIVATIONS))}, got "
                         f"{getattr(experts.config, 'hidden_act', None)!r} for {name}")
    has_bias = getattr(experts, "has_bias", False)
    # alpha and limit only shape swiglu_oai: pass MoEConfig's defaults (class attributes).
    return (experts.gate_up_proj, experts.down_proj,
            experts.gate_up_proj_bias if has_bias else None,
            experts.down_proj_bias if has_bias else None, activation,
            MoEConfig.swiglu_alpha, MoEConfig.swiglu_limit)


def experts_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers experts implementation ``"torch_moe_ops"``: ``moe::experts`` on the
    module's own ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` (and biases).

    ``hidden_states [T, H]``, ``top_k_index [T, K]`` (int), ``top_k_weights [T, K]``
    (float) -> ``[T, H]`` in ``hidden_states``' dtype. Expert-parallel sentinels
    (ids >= E) become our skip id -1.
    """
    w13_EFH, w2_EHI, b13_EF, b2_EH, activation, alpha, limit = _interface_weights(experts)
    topk_ids_TK = top_k_index
    if getattr(experts, "_is_expert_parallel", False):
        topk_ids_TK = topk_ids_TK.masked_fill(topk_ids_TK >= w13_EFH.shape[0], -1)
    # Under autocast the experts compute in its dtype, as transformers' own experts do;
    # without it the activations may still reach here in another dtype than the weights.
    x_TH, (w13_EFH, w2_EHI, b13_EF, b2_EH) = autocast_inputs(
        hidden_states, (w13_EFH, w2_EHI, b13_EF, b2_EH))
    y_TH = torch.ops.moe.experts(x_TH.to(w13_EFH.dtype), top_k_weights, topk_ids_TK,
                                 w13_EFH, w2_EHI, b13_EF, b2_EH, activation, alpha, limit)
    return y_TH.to(hidden_states.dtype)


def register_experts_implementation() -> bool:
    """Register `experts_forward` as transformers' experts implementation
    ``"torch_moe_ops"``. Returns False, registering nothing, when transformers or
    its experts interface (transformers >= 5) is not installed."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return False
    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, experts_forward)
    return True
