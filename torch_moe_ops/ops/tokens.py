"""The tokens format, the wire format across ranks: what an a2a backend's dispatch hands an
experts backend's ``experts`` op (`backends.registry.TOKENS`).

Legend: T tokens (this rank's), H hidden size, K experts per token, E experts (all
ranks), P ranks (``ep_size``), M = ``max_tokens_per_rank``, N = P * M receive positions.

``dispatch_tokens`` sends each token to the ranks that hold its experts and returns, there,
the receive buffers as they are: ``x_tokens [N, H]`` (position ``p * M + i``: the i-th token
that came from rank ``p``, in the order it came), its routing weights ``[N, K]`` (fp32) and
its expert ids translated to this rank's experts ``[N, K]`` (int32; -1 for an expert of
another rank, for a skipped slot and for every slot of a position no token came to). That is
``moe::experts``' input, so the experts backend's own op reads the buffers with no copy into
rows, and gives each received token's weighted sum over this rank's experts; ``combine_tokens``
sends those back and sums each token's over the ranks it went to:

    combine_tokens(experts(*dispatch_tokens(h, w, ids, E), w13, ...), ids, E) == experts(h, w, ids)

Both carry the layer's static expert-parallel arguments like ``moe::dispatch``;
``combine_tokens`` takes this rank's ``topk_ids`` and E, from which a transport may
recompute where each token went. Every rank calls both, with 0
tokens too; a backend's combine answers the dispatch before it.

Gradients run on the transport that ran forward, reversed: the gradient of ``combine_tokens``
is a dispatch of ``grad_out`` to the same positions (``combine_tokens_backward``), and that of
``dispatch_tokens`` sends each position's gradient home and sums each token's over the ranks
it went to (``dispatch_tokens_backward``, for the activations and the routing weights; a
slot whose expert is elsewhere has a zero gradient where it arrived). A backend whose
receive buffers are its own transport memory, overwritten by the next dispatch, defines no
gradient ops beside them: its pairs serve inference, and asking them for a gradient raises;
it may define ops that copy the buffers out, with gradients, in a namespace of its own for
layers that train (`backends.registry.A2ABackend.training_namespace`).
"""

from __future__ import annotations

import torch

from torch_moe_ops.config import worst_case_capacity
from torch_moe_ops.ops import checks, rows
from torch_moe_ops.ops.library import GENERIC_NAMESPACE, OpContract, define, defines, op_overload
from torch_moe_ops.ops.no_gradient import no_double_backward

DISPATCH_SCHEMA = ("(Tensor hidden, Tensor topk_weights, Tensor topk_ids, int num_experts, "
                   f"{rows.EP_ARGS}) -> (Tensor x_tokens, Tensor topk_weights_tokens, "
                   "Tensor topk_ids_tokens)")
COMBINE_SCHEMA = f"(Tensor y_tokens, Tensor topk_ids, int num_experts, {rows.EP_ARGS}) -> Tensor"
DISPATCH_BACKWARD_SCHEMA = ("(Tensor grad_x_tokens, Tensor grad_topk_weights_tokens, "
                            f"Tensor topk_ids, int num_experts, {rows.EP_ARGS}) -> "
                            "(Tensor grad_hidden, Tensor grad_topk_weights)")
COMBINE_BACKWARD_SCHEMA = (f"(Tensor grad_out, Tensor topk_ids, int num_experts, {rows.EP_ARGS}) "
                           "-> Tensor")


def num_positions(ep_size: int, max_tokens_per_rank: int) -> int:
    """N: the receive positions of one rank."""
    return ep_size * max_tokens_per_rank


def check_dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size=1,
                   group_name="", max_tokens_per_rank=0) -> None:
    rows.check_ep_args(ep_size, group_name, max_tokens_per_rank)
    # The rows format's checks with the largest capacity: the same arguments, the same errors.
    rows.check_dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size,
                        group_name, max_tokens_per_rank,
                        worst_case_capacity(max_tokens_per_rank, topk_ids_TK.shape[1]))
    # Rows check it only across ranks; the receive buffers have M positions per rank, one too.
    rows.check_tokens_fit(hidden_TH, max_tokens_per_rank)


def fake_dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size=1,
                  group_name="", max_tokens_per_rank=0):
    positions = num_positions(ep_size, max_tokens_per_rank)
    top_k = topk_ids_TK.shape[1]
    return (hidden_TH.new_empty((positions, hidden_TH.shape[1])),
            hidden_TH.new_empty((positions, top_k), dtype=torch.float32),
            hidden_TH.new_empty((positions, top_k), dtype=torch.int32))


def check_experts_split(num_experts, ep_size) -> None:
    if num_experts <= 0 or num_experts % ep_size:
        raise ValueError(f"num_experts must be > 0 and divisible by ep_size ({ep_size}), got "
                         f"{num_experts}")


def check_combine(y_NH, topk_ids_TK, num_experts, ep_size=1, group_name="",
                  max_tokens_per_rank=0, name="y_tokens") -> None:
    checks.check_tensor(name, y_NH, 2, checks.FLOAT_DTYPES)
    checks.check_tensor("topk_ids", topk_ids_TK, 2, checks.INDEX_DTYPES)
    rows.check_ep_args(ep_size, group_name, max_tokens_per_rank)
    check_experts_split(num_experts, ep_size)
    checks.check_size(name, y_NH, 0, num_positions(ep_size, max_tokens_per_rank),
                      "ep_size * max_tokens_per_rank (N)")
    checks.check_same_device(name, y_NH, topk_ids=topk_ids_TK)


def fake_combine(y_NH, topk_ids_TK, *_):
    return y_NH.new_empty((topk_ids_TK.shape[0], y_NH.shape[1]))


def check_dispatch_backward(grad_x_NH, grad_weights_NK, topk_ids_TK, num_experts, ep_size=1,
                            group_name="", max_tokens_per_rank=0) -> None:
    check_combine(grad_x_NH, topk_ids_TK, num_experts, ep_size, group_name, max_tokens_per_rank,
                  "grad_x_tokens")
    checks.check_tensor("grad_topk_weights_tokens", grad_weights_NK, 2, (torch.float32,))
    checks.check_size("grad_topk_weights_tokens", grad_weights_NK, 0, grad_x_NH.shape[0],
                      "grad_x_tokens.shape[0] (N)")
    checks.check_size("grad_topk_weights_tokens", grad_weights_NK, 1, topk_ids_TK.shape[1],
                      "topk_ids.shape[1] (K)")


def fake_dispatch_backward(grad_x_NH, grad_weights_NK, topk_ids_TK, *_):
    return (grad_x_NH.new_empty((topk_ids_TK.shape[0], grad_x_NH.shape[1])),
            grad_x_NH.new_empty(tuple(topk_ids_TK.shape), dtype=torch.float32))


def check_combine_backward(grad_out_TH, topk_ids_TK, num_experts, ep_size=1, group_name="",
                           max_tokens_per_rank=0) -> None:
    checks.check_tensor("grad_out", grad_out_TH, 2, checks.FLOAT_DTYPES)
    checks.check_tensor("topk_ids", topk_ids_TK, 2, checks.INDEX_DTYPES)
    rows.check_ep_args(ep_size, group_name, max_tokens_per_rank)
    check_experts_split(num_experts, ep_size)
    checks.check_size("grad_out", grad_out_TH, 0, topk_ids_TK.shape[0], "topk_ids.shape[0] (T)")
    checks.check_same_device("grad_out", grad_out_TH, topk_ids=topk_ids_TK)


def fake_combine_backward(grad_out_TH, topk_ids_TK, num_experts, ep_size=1, group_name="",
                          max_tokens_per_rank=0):
    return grad_out_TH.new_empty((num_positions(ep_size, max_tokens_per_rank),
                                  grad_out_TH.shape[1]))


def _gradient_op(namespace: str, name: str):
    """``namespace::name``, or a clear error where that transport keeps no gradient."""
    if not defines(namespace, name):
        raise RuntimeError(
            f"{namespace}::{name.removesuffix('_backward')} has no gradient: its receive "
            "buffers are the transport's own memory, which the next dispatch overwrites. "
            "Compile a layer that trains with torch_moe_ops.backend(...) (the lowering then "
            "gives it a transport with gradients), or run it under torch.no_grad()")
    return op_overload(namespace, name)


def _setup_dispatch(ctx, inputs, output):
    hidden_TH, topk_weights_TK, topk_ids_TK, *static = inputs
    ctx.save_for_backward(topk_ids_TK)
    ctx.static_args = static
    ctx.dtypes = (hidden_TH.dtype, topk_weights_TK.dtype)
    ctx.received_shape = output[0].shape


def _dispatch_backward(ctx, grad_x_NH, grad_weights_NK, _grad_ids):
    (topk_ids_TK,) = ctx.saved_tensors
    hidden_dtype, weights_dtype = ctx.dtypes
    if grad_x_NH is None:
        grad_x_NH = topk_ids_TK.new_zeros(ctx.received_shape, dtype=hidden_dtype)
    if grad_weights_NK is None:
        grad_weights_NK = grad_x_NH.new_zeros((ctx.received_shape[0], topk_ids_TK.shape[1]),
                                              dtype=torch.float32)
    grad_hidden_TH, grad_topk_weights_TK = _gradient_op(ctx.namespace, DISPATCH_BACKWARD.name)(
        grad_x_NH.contiguous(), grad_weights_NK.float().contiguous(), topk_ids_TK,
        *ctx.static_args)
    return (grad_hidden_TH.to(hidden_dtype), grad_topk_weights_TK.to(weights_dtype),
            None, None, None, None, None)


def _setup_combine(ctx, inputs, output):
    _, topk_ids_TK, *static = inputs
    ctx.save_for_backward(topk_ids_TK)
    ctx.static_args = static


def _combine_backward(ctx, grad_out_TH):
    (topk_ids_TK,) = ctx.saved_tensors
    grad_y_NH = _gradient_op(ctx.namespace, COMBINE_BACKWARD.name)(
        grad_out_TH.contiguous(), topk_ids_TK, *ctx.static_args)
    return grad_y_NH, None, None, None, None, None


DISPATCH = OpContract(name="dispatch_tokens", schema=DISPATCH_SCHEMA, check=check_dispatch,
                      check_values=rows.check_dispatch_values,
                      fake=fake_dispatch, backward=_dispatch_backward,
                      setup_context=_setup_dispatch, ordered=True)
COMBINE = OpContract(name="combine_tokens", schema=COMBINE_SCHEMA, check=check_combine,
                     fake=fake_combine, backward=_combine_backward, setup_context=_setup_combine,
                     ordered=True)
_setup_dispatch_backward, _dispatch_double_backward = no_double_backward(
    "dispatch_tokens_backward")
DISPATCH_BACKWARD = OpContract(name="dispatch_tokens_backward", schema=DISPATCH_BACKWARD_SCHEMA,
                               check=check_dispatch_backward, fake=fake_dispatch_backward,
                               backward=_dispatch_double_backward,
                               setup_context=_setup_dispatch_backward, ordered=True)
_setup_combine_backward, _combine_double_backward = no_double_backward("combine_tokens_backward")
COMBINE_BACKWARD = OpContract(name="combine_tokens_backward", schema=COMBINE_BACKWARD_SCHEMA,
                              check=check_combine_backward, fake=fake_combine_backward,
                              backward=_combine_double_backward,
                              setup_context=_setup_combine_backward, ordered=True)
CONTRACTS = {contract.name: contract
             for contract in (DISPATCH, COMBINE, DISPATCH_BACKWARD, COMBINE_BACKWARD)}
dispatch_tokens = define(GENERIC_NAMESPACE, DISPATCH)
combine_tokens = define(GENERIC_NAMESPACE, COMBINE)
dispatch_tokens_backward = define(GENERIC_NAMESPACE, DISPATCH_BACKWARD)
combine_tokens_backward = define(GENERIC_NAMESPACE, COMBINE_BACKWARD)
