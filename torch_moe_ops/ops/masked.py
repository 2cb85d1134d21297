"""The masked format, DeepEP low-latency's own layout: rows of each local expert in a block
of static size, with a device-side count of the rows that are real
(`backends.registry.MASKED`).

Legend: T tokens (this rank's), H hidden size, I expert intermediate size, F = 2 * I,
K experts per token, E experts held here (``E_l`` across ranks), C rows per expert (``P * M``
across ranks: P ranks, M = ``max_tokens_per_rank``), E_all experts of all ranks.

``experts_masked`` runs each expert on the rows of its block that carry a token:

    for e, c: if c < count_experts[e]:
        out[e, c] = act(x[e, c] @ w13[e].T + b13[e]) @ w2[e].T + b2[e]

Rows from ``count_experts[e]`` on are not read: whatever they hold (garbage, NaN) changes
no output row below the count and no gradient. In the output they are unspecified: a
backend may leave them unwritten (the ``triton`` kernels do; writing them would store all
``E * C`` rows, about P times the rows of a decode batch that carry a token, as long as the
GEMMs take), so nothing may read them. Their gradient is zero, and the gradient of an
output row past the count is not read either. The gradient is ``experts_masked_backward``
of the namespace that ran the forward where that namespace defines one, else the reference
backend's (`experts.backward_namespace`).

``dispatch_masked`` sends each (token, slot) to the rank of its expert and returns, there,
the receive buffers as they are: ``x_masked [E, C, H]`` (expert ``e``'s rows from position 0
on, the blocks of the source ranks in arrival order), ``count_experts [E]`` (int32), and
the transport's bookkeeping, which ``combine_masked`` takes back: ``src_info [E, C]``
(int32, the index of each row's token on its source rank) and ``layout_range [E, P]``
(int64: rank ``p``'s block of expert ``e`` begins at ``layout_range >> 32`` and holds
``layout_range & 0xFFFFFFFF`` rows). ``combine_masked`` sends each row back and sums each
token's rows over its slots, weighted by ``topk_weights`` (a slot that is -1 adds nothing):

    x, count, src_info, layout_range = dispatch_masked(h, w, ids, E_all)
    combine_masked(experts_masked(x, count, w13, ...), src_info, layout_range, w, ids, E_all)
        == experts(h, w, ids)

A token that chose one expert in two slots arrives twice and is summed with both weights.
Every rank calls both ops, with 0 tokens too. The receive buffers are the transport's, so
the pair carries no gradient (asking for one raises): a layer that trains takes another
format. Quantized layers: `ops.masked_quant`.
"""

from __future__ import annotations

import torch

from torch_moe_ops.ops import checks, rows, tokens
from torch_moe_ops.ops.experts import (
    EXPERT_ARGS,
    backward_namespace,
    check_expert_weights,
)
from torch_moe_ops.ops.library import GENERIC_NAMESPACE, OpContract, define, op_overload
from torch_moe_ops.ops.no_gradient import no_double_backward, refused_autograd

SCHEMA = f"(Tensor x_masked, Tensor count_experts, {EXPERT_ARGS}) -> Tensor"
BACKWARD_SCHEMA = (f"(Tensor grad_out, Tensor x_masked, Tensor count_experts, {EXPERT_ARGS}) "
                   "-> (Tensor grad_x_masked, Tensor grad_w13, Tensor grad_w2, Tensor grad_b13, "
                   "Tensor grad_b2)")
DISPATCH_SCHEMA = ("(Tensor hidden, Tensor topk_weights, Tensor topk_ids, int num_experts, "
                   f"{rows.EP_ARGS}) -> (Tensor x_masked, Tensor count_experts, "
                   "Tensor src_info, Tensor layout_range)")
COMBINE_SCHEMA = ("(Tensor y_masked, Tensor src_info, Tensor layout_range, Tensor topk_weights, "
                  f"Tensor topk_ids, int num_experts, {rows.EP_ARGS}) -> Tensor")
NO_GRADIENT = ("{op} has no gradient: the masked format's receive buffers are the transport's "
               "own memory. Compile a layer that trains with torch_moe_ops.backend(...) (the "
               "lowering then gives it a format with gradients), or run it under "
               "torch.no_grad()")


def check(x_ECH, count_E, w13_EFH, w2_EHI, b13_EF, b2_EH, activation, swiglu_alpha,
          swiglu_limit) -> None:
    checks.check_tensor("x_masked", x_ECH, 3, checks.OP_FLOAT_DTYPES)
    checks.check_tensor("count_experts", count_E, 1, (torch.int32,))
    # The weights' checks read H as the width of rows: every expert's rows in one.
    check_expert_weights("x_masked", x_ECH.flatten(0, 1), w13_EFH, w2_EHI, b13_EF, b2_EH,
                         activation, swiglu_alpha, swiglu_limit)
    checks.check_size("x_masked", x_ECH, 0, w13_EFH.shape[0], "w13.shape[0] (E)")
    checks.check_size("count_experts", count_E, 0, w13_EFH.shape[0], "w13.shape[0] (E)")
    checks.check_same_device("x_masked", x_ECH, count_experts=count_E)


def check_values(x_ECH, count_E, *_) -> None:
    if count_E.numel() == 0 or not checks.value_checks_enabled(count_E.device):
        return
    lowest, highest = int(count_E.min()), int(count_E.max())
    if lowest < 0 or highest > x_ECH.shape[1]:
        raise ValueError(f"count_experts must hold row counts in [0, {x_ECH.shape[1]}] "
                         f"(x_masked.shape[1], C), got {lowest if lowest < 0 else highest}")


def fake(x_ECH, *_):
    return torch.empty_like(x_ECH, memory_format=torch.contiguous_format)


def check_backward(grad_out_ECH, x_ECH, *args) -> None:
    checks.check_gradient_of(grad_out_ECH, x_ECH, "x_masked")
    check(x_ECH, *args)


def fake_backward(grad_out_ECH, x_ECH, count_E, w13_EFH, w2_EHI, b13_EF, b2_EH, *_):
    def like(t):
        # An absent bias gets an empty gradient: a custom op cannot return None.
        if t is None:
            return x_ECH.new_empty((0,))
        return torch.empty_like(t, memory_format=torch.contiguous_format)

    return like(x_ECH), like(w13_EFH), like(w2_EHI), like(b13_EF), like(b2_EH)


def _setup(ctx, inputs, output):
    x_ECH, count_E, w13_EFH, w2_EHI, b13_EF, b2_EH, *static = inputs
    ctx.save_for_backward(x_ECH, count_E, w13_EFH, w2_EHI, b13_EF, b2_EH)
    ctx.static_args = static


def _backward(ctx, grad_out_ECH):
    x_ECH, count_E, w13_EFH, w2_EHI, b13_EF, b2_EH = ctx.saved_tensors
    grads = op_overload(backward_namespace(ctx.namespace, BACKWARD_CONTRACT.name),
                        BACKWARD_CONTRACT.name)(
        grad_out_ECH.contiguous(), x_ECH, count_E, w13_EFH, w2_EHI, b13_EF, b2_EH,
        *ctx.static_args)
    grad_x_ECH, grad_w13, grad_w2, grad_b13, grad_b2 = grads
    return (grad_x_ECH, None, grad_w13, grad_w2, grad_b13 if b13_EF is not None else None,
            grad_b2 if b2_EH is not None else None, None, None, None)


def fake_dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size=1,
                  group_name="", max_tokens_per_rank=0):
    num_local = num_experts // ep_size
    rows_per_expert = tokens.num_positions(ep_size, max_tokens_per_rank)
    return (hidden_TH.new_empty((num_local, rows_per_expert, hidden_TH.shape[1])),
            hidden_TH.new_empty((num_local,), dtype=torch.int32),
            hidden_TH.new_empty((num_local, rows_per_expert), dtype=torch.int32),
            hidden_TH.new_empty((num_local, ep_size), dtype=torch.int64))


def check_combine(y_ECH, src_info_EC, layout_range_EP, topk_weights_TK, topk_ids_TK,
                  num_experts, ep_size=1, group_name="", max_tokens_per_rank=0) -> None:
    checks.check_tensor("y_masked", y_ECH, 3, checks.FLOAT_DTYPES)
    checks.check_tensor("src_info", src_info_EC, 2, (torch.int32,))
    checks.check_tensor("layout_range", layout_range_EP, 2, (torch.int64,))
    checks.check_tensor("topk_weights", topk_weights_TK, 2, checks.FLOAT_DTYPES)
    checks.check_tensor("topk_ids", topk_ids_TK, 2, checks.INDEX_DTYPES)
    rows.check_ep_args(ep_size, group_name, max_tokens_per_rank)
    tokens.check_experts_split(num_experts, ep_size)
    num_local = num_experts // ep_size
    rows_per_expert = tokens.num_positions(ep_size, max_tokens_per_rank)
    checks.check_size("y_masked", y_ECH, 0, num_local, "num_experts // ep_size (E)")
    checks.check_size("y_masked", y_ECH, 1, rows_per_expert,
                      "ep_size * max_tokens_per_rank (C)")
    checks.check_size("src_info", src_info_EC, 0, num_local, "num_experts // ep_size (E)")
    checks.check_size("src_info", src_info_EC, 1, rows_per_expert,
                      "ep_size * max_tokens_per_rank (C)")
    checks.check_size("layout_range", layout_range_EP, 0, num_local, "num_experts // ep_size (E)")
    checks.check_size("layout_range", layout_range_EP, 1, ep_size, "ep_size (P)")
    if topk_weights_TK.shape != topk_ids_TK.shape:
        raise ValueError(f"topk_weights and topk_ids must have the same shape [T, K], got "
                         f"{tuple(topk_weights_TK.shape)} and {tuple(topk_ids_TK.shape)}")
    checks.check_same_device("y_masked", y_ECH, src_info=src_info_EC,
                             layout_range=layout_range_EP, topk_weights=topk_weights_TK,
                             topk_ids=topk_ids_TK)


def fake_combine(y_ECH, src_info_EC, layout_range_EP, topk_weights_TK, *_):
    return y_ECH.new_empty((topk_weights_TK.shape[0], y_ECH.shape[2]))


CONTRACT = OpContract(name="experts_masked", schema=SCHEMA, check=check, fake=fake,
                      check_values=check_values, backward=_backward, setup_context=_setup)
_setup_double, _double_backward = no_double_backward("experts_masked_backward")
BACKWARD_CONTRACT = OpContract(name="experts_masked_backward", schema=BACKWARD_SCHEMA,
                               check=check_backward, fake=fake_backward,
                               backward=_double_backward, setup_context=_setup_double)
_setup_transport, _transport_backward = refused_autograd(
    lambda ctx: NO_GRADIENT.format(op=f"{ctx.namespace}::{ctx.op_name}"))


def _transport_contract(name, schema, check_fn, fake_fn, check_values=None) -> OpContract:
    def setup_context(ctx, inputs, output):
        ctx.op_name = name
        _setup_transport(ctx, inputs, output)

    return OpContract(name=name, schema=schema, check=check_fn, fake=fake_fn,
                      check_values=check_values, backward=_transport_backward,
                      setup_context=setup_context, ordered=True)


# The tokens format's dispatch takes the same arguments: the same checks, the same errors.
DISPATCH = _transport_contract("dispatch_masked", DISPATCH_SCHEMA, tokens.check_dispatch,
                               fake_dispatch, rows.check_dispatch_values)
COMBINE = _transport_contract("combine_masked", COMBINE_SCHEMA, check_combine, fake_combine)
CONTRACTS = {contract.name: contract
             for contract in (CONTRACT, BACKWARD_CONTRACT, DISPATCH, COMBINE)}
experts_masked = define(GENERIC_NAMESPACE, CONTRACT)
experts_masked_backward = define(GENERIC_NAMESPACE, BACKWARD_CONTRACT)
dispatch_masked = define(GENERIC_NAMESPACE, DISPATCH)
combine_masked = define(GENERIC_NAMESPACE, COMBINE)
