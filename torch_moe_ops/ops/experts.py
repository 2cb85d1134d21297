"""``moe::experts`` and its gradient ``moe::experts_backward``.

Legend: T tokens, H hidden size, I expert intermediate size, E experts,
K experts per token.

    for t, k: if topk_ids[t, k] >= 0:
        e = topk_ids[t, k]
        out[t] += topk_weights[t, k] * (act(hidden[t] @ w13[e].T + b13[e]) @ w2[e].T + b2[e])

The gradient of ``moe::experts`` (and of ``moe::experts_rows``) is
``experts_backward`` of the namespace that ran the forward where that namespace
defines one, else the reference backend's (`backward_namespace`). The op saves
only its inputs for it.
"""

from __future__ import annotations

import torch

from torch_moe_ops.config import ACTIVATIONS
from torch_moe_ops.ops import checks
from torch_moe_ops.ops.library import (
    GENERIC_NAMESPACE,
    REFERENCE_NAMESPACE,
    OpContract,
    define,
    defines,
    op_overload,
)
from torch_moe_ops.ops.no_gradient import no_double_backward

EXPERT_ARGS = ("Tensor w13, Tensor w2, Tensor? b13, Tensor? b2, str activation, "
               "float swiglu_alpha, float swiglu_limit")
SCHEMA = f"(Tensor hidden, Tensor topk_weights, Tensor topk_ids, {EXPERT_ARGS}) -> Tensor"
BACKWARD_SCHEMA = (f"(Tensor grad_out, Tensor hidden, Tensor topk_weights, Tensor topk_ids, "
                   f"{EXPERT_ARGS}) -> (Tensor grad_hidden, Tensor grad_topk_weights, "
                   "Tensor grad_w13, Tensor grad_w2, Tensor grad_b13, Tensor grad_b2)")


def check_expert_weights(x_name, x_NH, w13_EFH, w2_EHI, b13_EF, b2_EH, activation,
                         swiglu_alpha, swiglu_limit) -> None:
    """Checks the weights against the activations ``x_NH`` they multiply."""
    checks.check_tensor("w13", w13_EFH, 3, checks.OP_FLOAT_DTYPES)
    checks.check_tensor("w2", w2_EHI, 3, checks.OP_FLOAT_DTYPES)
    num_experts, hidden_size = w13_EFH.shape[0], x_NH.shape[1]
    checks.check_size("w13", w13_EFH, 2, hidden_size, f"{x_name}.shape[1] (H)")
    if w13_EFH.shape[1] % 2:
        raise ValueError(f"w13.shape[1] must be even (gate rows then up rows, 2*I), "
                         f"got shape {tuple(w13_EFH.shape)}")
    intermediate_size = w13_EFH.shape[1] // 2
    checks.check_size("w2", w2_EHI, 0, num_experts, "w13.shape[0] (E)")
    checks.check_size("w2", w2_EHI, 1, hidden_size, f"{x_name}.shape[1] (H)")
    checks.check_size("w2", w2_EHI, 2, intermediate_size, "w13.shape[1] // 2 (I)")
    if b13_EF is not None:
        checks.check_tensor("b13", b13_EF, 2, checks.OP_FLOAT_DTYPES)
        checks.check_size("b13", b13_EF, 0, num_experts, "w13.shape[0] (E)")
        checks.check_size("b13", b13_EF, 1, 2 * intermediate_size, "w13.shape[1] (2*I)")
    if b2_EH is not None:
        checks.check_tensor("b2", b2_EH, 2, checks.OP_FLOAT_DTYPES)
        checks.check_size("b2", b2_EH, 0, num_experts, "w13.shape[0] (E)")
        checks.check_size("b2", b2_EH, 1, hidden_size, f"{x_name}.shape[1] (H)")
    checks.check_same_dtype(x_name, x_NH, w13=w13_EFH, w2=w2_EHI, b13=b13_EF, b2=b2_EH)
    checks.check_same_device(x_name, x_NH, w13=w13_EFH, w2=w2_EHI, b13=b13_EF, b2=b2_EH)
    checks.check_choice("activation", activation, ACTIVATIONS)
    checks.check_positive("swiglu_alpha", swiglu_alpha)
    checks.check_positive("swiglu_limit", swiglu_limit)


def check_routing(hidden_TH, topk_weights_TK, topk_ids_TK) -> None:
    checks.check_tensor("hidden", hidden_TH, 2, checks.OP_FLOAT_DTYPES)
    checks.check_tensor("topk_weights", topk_weights_TK, 2, checks.OP_FLOAT_DTYPES)
    checks.check_tensor("topk_ids", topk_ids_TK, 2, checks.INDEX_DTYPES)
    if topk_weights_TK.shape != topk_ids_TK.shape:
        raise ValueError(f"topk_weights and topk_ids must have the same shape [T, K], got "
                         f"{tuple(topk_weights_TK.shape)} and {tuple(topk_ids_TK.shape)}")
    checks.check_size("topk_ids", topk_ids_TK, 0, hidden_TH.shape[0], "hidden.shape[0] (T)")
    checks.check_same_device("hidden", hidden_TH, topk_weights=topk_weights_TK,
                             topk_ids=topk_ids_TK)


def check(hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI, b13_EF, b2_EH,
          activation, swiglu_alpha, swiglu_limit) -> None:
    check_routing(hidden_TH, topk_weights_TK, topk_ids_TK)
    check_expert_weights("hidden", hidden_TH, w13_EFH, w2_EHI, b13_EF, b2_EH, activation,
                         swiglu_alpha, swiglu_limit)


def check_values(hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, *_) -> None:
    checks.check_ids_in_range("topk_ids", topk_ids_TK, w13_EFH.shape[0])


def fake(hidden_TH, *_):
    return torch.empty_like(hidden_TH, memory_format=torch.contiguous_format)


def check_backward(grad_out_TH, hidden_TH, *args) -> None:
    checks.check_gradient_of(grad_out_TH, hidden_TH, "hidden")
    check(hidden_TH, *args)


def fake_backward(grad_out_TH, hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI,
                  b13_EF, b2_EH, *_):
    def like(t):
        # An absent bias gets an empty gradient: a custom op cannot return None.
        if t is None:
            return hidden_TH.new_empty((0,))
        return torch.empty_like(t, memory_format=torch.contiguous_format)

    return (like(hidden_TH), like(topk_weights_TK), like(w13_EFH), like(w2_EHI),
            like(b13_EF), like(b2_EH))


def backward_namespace(namespace: str, name: str = "experts_backward") -> str:
    """Where the gradient of an experts op that ran on ``namespace`` runs: there,
    where ``namespace`` defines its gradient op ``name``, else on the reference backend.
    The generic ``moe`` namespace defines them, which run the default backend's."""
    return namespace if defines(namespace, name) else REFERENCE_NAMESPACE


def setup_context(ctx, inputs, output):
    hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI, b13_EF, b2_EH, *static = inputs
    ctx.save_for_backward(hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI,
                          b13_EF, b2_EH)
    ctx.static_args = static


def backward(ctx, grad_out_TH):
    hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI, b13_EF, b2_EH = ctx.saved_tensors
    grads = op_overload(backward_namespace(ctx.namespace), "experts_backward")(
        grad_out_TH.contiguous(), hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI,
        b13_EF, b2_EH, *ctx.static_args)
    grad_hidden, grad_topk_weights, grad_w13, grad_w2, grad_b13, grad_b2 = grads
    return (grad_hidden, grad_topk_weights, None, grad_w13, grad_w2,
            grad_b13 if b13_EF is not None else None,
            grad_b2 if b2_EH is not None else None, None, None, None)


CONTRACT = OpContract(name="experts", schema=SCHEMA, check=check, fake=fake,
                      check_values=check_values, backward=backward,
                      setup_context=setup_context)
_setup_backward, _double_backward = no_double_backward("experts_backward")
BACKWARD_CONTRACT = OpContract(name="experts_backward", schema=BACKWARD_SCHEMA,
                               check=check_backward, fake=fake_backward,
                               backward=_double_backward, setup_context=_setup_backward)
experts = define(GENERIC_NAMESPACE, CONTRACT)
experts_backward = define(GENERIC_NAMESPACE, BACKWARD_CONTRACT)
