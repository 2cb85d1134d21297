"""The rows format between dispatch, experts and combine, on one device or across ranks.

Legend: T tokens (this rank's), H hidden size, K experts per token, E experts
(all ranks), E_l experts held here (``E // ep_size``), P ranks (``ep_size``),
C rows one rank receives from each rank (the static capacity), R rows
(``T * K`` on one device, ``P * C`` with expert parallelism).

``moe::dispatch`` sends each (token, slot) pair to the rank that holds its
expert and returns, there, rows grouped by local expert: rows
``[offset_e, offset_e + count_E[e])`` belong to expert ``e`` (ascending), the
remaining rows have ``expert_R == -1`` and ``src_R == -1`` and are skipped
(their ``x_rows`` and ``weight_rows`` are zeros, so dispatch's gradient, which
gives them none, agrees with its forward).
``moe::experts_rows`` runs each row through its expert (skipped rows give 0)
and ``moe::combine`` sends ``weight_R * y_RH`` back and sums each token's rows:

    combine(experts_rows(dispatch(h, w, ids)...), ...) == experts(h, w, ids)

``src_R`` says where a row's result goes back to and ``combine_map_TK`` what
combine needs to bring each of this rank's (token, slot) pairs home; both are the
a2a backend's own bookkeeping, passed from its dispatch to its combine as tensors
so that it survives tracing and CUDA-graph capture. What ``combine_map`` holds is
the backend's, each naming it in its own module (-1 marks a skipped slot):

    none                  row_of_slot_TK: each slot's row
    all_to_all            send_position_TK: each slot's send position
    allgather, deepep     placeholder_TK: all -1, combine reads its shape (T, K)
      normal mode         alone (results come back summed per token)
    deepep low-latency    expert_id_TK: each slot's global expert id
    flashinfer            rank_of_slot_TK: the rank that holds each slot's expert

On one device (``ep_size == 1``) combine checks that its values are rows or -1.
All three ops are differentiable; the gradients of dispatch and combine run on the
same transport as their forward (``dispatch_backward``, ``combine_backward`` of the
backend that ran forward), that of experts_rows on the experts backend that ran it
where it has one (`experts.backward_namespace`).

With ``ep_size > 1``, ``group_name`` names the expert-parallel process group
(``ProcessGroup.group_name``, as torch's functional collectives take it) and
every rank must call each op, with 0 tokens too.
"""

from __future__ import annotations

import torch

from torch_moe_ops.config import worst_case_capacity
from torch_moe_ops.ops import checks
from torch_moe_ops.ops.experts import (
    EXPERT_ARGS,
    backward_namespace,
    check_expert_weights,
    check_routing,
)
from torch_moe_ops.ops.library import GENERIC_NAMESPACE, OpContract, define, op_overload
from torch_moe_ops.ops.no_gradient import no_double_backward

EP_ARGS = "int ep_size=1, str group_name=\"\", int max_tokens_per_rank=0"
DISPATCH_SCHEMA = (f"(Tensor hidden, Tensor topk_weights, Tensor topk_ids, int num_experts, "
                   f"{EP_ARGS}, int capacity=0) -> "
                   "(Tensor x_rows, Tensor expert_rows, Tensor weight_rows, Tensor src_rows, "
                   "Tensor count_experts, Tensor combine_map)")
EXPERTS_ROWS_SCHEMA = (f"(Tensor x_rows, Tensor expert_rows, Tensor count_experts, "
                       f"{EXPERT_ARGS}) -> Tensor")
COMBINE_SCHEMA = (f"(Tensor y_rows, Tensor weight_rows, Tensor src_rows, Tensor combine_map, "
                  f"{EP_ARGS}) -> Tensor")
DISPATCH_BACKWARD_SCHEMA = (f"(Tensor grad_x_rows, Tensor grad_weight_rows, Tensor src_rows, "
                            f"Tensor combine_map, {EP_ARGS}) -> "
                            "(Tensor grad_hidden, Tensor grad_topk_weights)")
COMBINE_BACKWARD_SCHEMA = (f"(Tensor grad_out, Tensor y_rows, Tensor weight_rows, "
                           f"Tensor src_rows, Tensor combine_map, {EP_ARGS}) -> "
                           "(Tensor grad_y_rows, Tensor grad_weight_rows)")


def check_ep_args(ep_size, group_name, max_tokens_per_rank) -> None:
    if ep_size < 1:
        raise ValueError(f"ep_size must be >= 1, got {ep_size}")
    if ep_size > 1 and not group_name:
        raise ValueError(f"group_name must name the expert-parallel process group when "
                         f"ep_size > 1, got {group_name!r} with ep_size={ep_size}")
    if ep_size > 1 and max_tokens_per_rank < 1:
        raise ValueError(f"max_tokens_per_rank must be >= 1 when ep_size > 1, got "
                         f"{max_tokens_per_rank}")


def num_rows(num_tokens, top_k, ep_size, capacity):
    """R: ``T * K`` on one device, ``ep_size * capacity`` across ranks."""
    return num_tokens * top_k if ep_size == 1 else ep_size * capacity


def check_tokens_fit(hidden_TH, max_tokens_per_rank) -> None:
    if hidden_TH.shape[0] > max_tokens_per_rank:
        raise ValueError(f"hidden.shape[0] (tokens on this rank) must be <= "
                         f"max_tokens_per_rank ({max_tokens_per_rank}), got "
                         f"{hidden_TH.shape[0]}: build the layer with a larger "
                         "max_tokens_per_rank or split the batch")


def check_dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size=1,
                   group_name="", max_tokens_per_rank=0, capacity=0) -> None:
    check_routing(hidden_TH, topk_weights_TK, topk_ids_TK)
    if num_experts <= 0:
        raise ValueError(f"num_experts must be > 0, got {num_experts}")
    check_ep_args(ep_size, group_name, max_tokens_per_rank)
    if num_experts % ep_size:
        raise ValueError(f"num_experts must be divisible by ep_size ({ep_size}), got "
                         f"{num_experts}")
    if ep_size == 1:
        return
    check_tokens_fit(hidden_TH, max_tokens_per_rank)
    worst = worst_case_capacity(max_tokens_per_rank, topk_ids_TK.shape[1])
    if not 1 <= capacity <= worst:
        raise ValueError(f"capacity must be in [1, {worst}] (rows one rank sends another; "
                         f"{worst} is the worst case) when ep_size > 1, got {capacity}")


def check_dispatch_values(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, *_) -> None:
    checks.check_ids_in_range("topk_ids", topk_ids_TK, num_experts)


def fake_dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size=1,
                  group_name="", max_tokens_per_rank=0, capacity=0):
    rows = num_rows(topk_ids_TK.shape[0], topk_ids_TK.shape[1], ep_size, capacity)
    return (hidden_TH.new_empty((rows, hidden_TH.shape[1])),
            hidden_TH.new_empty((rows,), dtype=torch.int32),
            hidden_TH.new_empty((rows,), dtype=torch.float32),
            hidden_TH.new_empty((rows,), dtype=torch.int32),
            hidden_TH.new_empty((num_experts // ep_size,), dtype=torch.int32),
            hidden_TH.new_empty(tuple(topk_ids_TK.shape), dtype=torch.int32))


def check_experts_rows(x_RH, expert_R, count_E, w13_EFH, w2_EHI, b13_EF, b2_EH, activation,
                       swiglu_alpha, swiglu_limit) -> None:
    checks.check_tensor("x_rows", x_RH, 2, checks.OP_FLOAT_DTYPES)
    checks.check_tensor("expert_rows", expert_R, 1, (torch.int32,))
    checks.check_tensor("count_experts", count_E, 1, (torch.int32,))
    checks.check_size("expert_rows", expert_R, 0, x_RH.shape[0], "x_rows.shape[0] (R)")
    check_expert_weights("x_rows", x_RH, w13_EFH, w2_EHI, b13_EF, b2_EH, activation,
                         swiglu_alpha, swiglu_limit)
    checks.check_size("count_experts", count_E, 0, w13_EFH.shape[0], "w13.shape[0] (E)")
    checks.check_same_device("x_rows", x_RH, expert_rows=expert_R, count_experts=count_E)


def check_experts_rows_values(x_RH, expert_R, count_E, w13_EFH, *_) -> None:
    checks.check_ids_in_range("expert_rows", expert_R, w13_EFH.shape[0])


def fake_experts_rows(x_RH, *_):
    return torch.empty_like(x_RH, memory_format=torch.contiguous_format)


def check_rows_metadata(y_RH, weight_R, src_R, combine_map_TK) -> None:
    checks.check_tensor("weight_rows", weight_R, 1, (torch.float32,))
    checks.check_tensor("src_rows", src_R, 1, (torch.int32,))
    checks.check_tensor("combine_map", combine_map_TK, 2, (torch.int32,))
    checks.check_size("weight_rows", weight_R, 0, y_RH.shape[0], "y_rows.shape[0] (R)")
    checks.check_size("src_rows", src_R, 0, y_RH.shape[0], "y_rows.shape[0] (R)")
    checks.check_same_device("y_rows", y_RH, weight_rows=weight_R, src_rows=src_R,
                             combine_map=combine_map_TK)


def check_combine(y_RH, weight_R, src_R, combine_map_TK, ep_size=1, group_name="",
                  max_tokens_per_rank=0) -> None:
    checks.check_tensor("y_rows", y_RH, 2, checks.OP_FLOAT_DTYPES)
    check_rows_metadata(y_RH, weight_R, src_R, combine_map_TK)
    check_ep_args(ep_size, group_name, max_tokens_per_rank)


def check_combine_values(y_RH, weight_R, src_R, combine_map_TK, ep_size=1, *_) -> None:
    if ep_size == 1:
        num_slots = combine_map_TK.numel()
        checks.check_ids_in_range("src_rows", src_R, num_slots, "slot indices")
        checks.check_ids_in_range("combine_map", combine_map_TK, y_RH.shape[0], "row indices")


def fake_combine(y_RH, weight_R, src_R, combine_map_TK, *_):
    return y_RH.new_empty((combine_map_TK.shape[0], y_RH.shape[1]))


def check_dispatch_backward(grad_x_RH, grad_weight_R, src_R, combine_map_TK, ep_size=1,
                            group_name="", max_tokens_per_rank=0) -> None:
    checks.check_tensor("grad_x_rows", grad_x_RH, 2, checks.OP_FLOAT_DTYPES)
    check_rows_metadata(grad_x_RH, grad_weight_R, src_R, combine_map_TK)
    check_ep_args(ep_size, group_name, max_tokens_per_rank)


def fake_dispatch_backward(grad_x_RH, grad_weight_R, src_R, combine_map_TK, *_):
    return (grad_x_RH.new_empty((combine_map_TK.shape[0], grad_x_RH.shape[1])),
            grad_x_RH.new_empty(tuple(combine_map_TK.shape), dtype=torch.float32))


def check_combine_backward(grad_out_TH, y_RH, weight_R, src_R, combine_map_TK, ep_size=1,
                           group_name="", max_tokens_per_rank=0) -> None:
    checks.check_tensor("grad_out", grad_out_TH, 2, checks.OP_FLOAT_DTYPES)
    check_combine(y_RH, weight_R, src_R, combine_map_TK, ep_size, group_name, max_tokens_per_rank)
    checks.check_size("grad_out", grad_out_TH, 0, combine_map_TK.shape[0],
                      "combine_map.shape[0] (T)")


def fake_combine_backward(grad_out_TH, y_RH, *_):
    return (torch.empty_like(y_RH, memory_format=torch.contiguous_format),
            y_RH.new_empty((y_RH.shape[0],), dtype=torch.float32))


def _setup_dispatch(ctx, inputs, output):
    hidden_TH, topk_weights_TK, _, _, *ep_args = inputs
    _, _, _, src_R, _, combine_map_TK = output
    ctx.save_for_backward(src_R, combine_map_TK)
    ctx.ep_args = ep_args[:3]
    ctx.dtypes = (hidden_TH.dtype, topk_weights_TK.dtype)


def _dispatch_backward(ctx, grad_x_RH, _expert, grad_weight_R, *_):
    src_R, combine_map_TK = ctx.saved_tensors
    if grad_weight_R is None:
        grad_weight_R = grad_x_RH.new_zeros((grad_x_RH.shape[0],), dtype=torch.float32)
    grad_hidden_TH, grad_topk_weights_TK = op_overload(ctx.namespace, "dispatch_backward")(
        grad_x_RH.contiguous(), grad_weight_R.float().contiguous(), src_R, combine_map_TK,
        *ctx.ep_args)
    hidden_dtype, weights_dtype = ctx.dtypes
    return (grad_hidden_TH.to(hidden_dtype), grad_topk_weights_TK.to(weights_dtype),
            None, None, None, None, None, None)


def _setup_combine(ctx, inputs, output):
    y_RH, weight_R, src_R, combine_map_TK, *ep_args = inputs
    ctx.save_for_backward(y_RH, weight_R, src_R, combine_map_TK)
    ctx.ep_args = ep_args


def _combine_backward(ctx, grad_out_TH):
    y_RH, weight_R, src_R, combine_map_TK = ctx.saved_tensors
    grad_y_RH, grad_weight_R = op_overload(ctx.namespace, "combine_backward")(
        grad_out_TH.contiguous(), y_RH, weight_R, src_R, combine_map_TK, *ctx.ep_args)
    return grad_y_RH, grad_weight_R, None, None, None, None, None


def _setup_experts_rows(ctx, inputs, output):
    x_RH, expert_R, _, w13_EFH, w2_EHI, b13_EF, b2_EH, *static = inputs
    ctx.save_for_backward(x_RH, expert_R, w13_EFH, w2_EHI, b13_EF, b2_EH)
    ctx.static_args = static


def _experts_rows_backward(ctx, grad_y_RH):
    # A row is a token with one expert at weight 1: the experts' gradient applies,
    # on the namespace that ran forward (`backward_namespace`).
    x_RH, expert_R, w13_EFH, w2_EHI, b13_EF, b2_EH = ctx.saved_tensors
    ones_R1 = torch.ones((x_RH.shape[0], 1), dtype=torch.float32, device=x_RH.device)
    experts_backward = op_overload(backward_namespace(ctx.namespace), "experts_backward")
    grad_x_RH, _, grad_w13, grad_w2, grad_b13, grad_b2 = experts_backward(
        grad_y_RH.contiguous(), x_RH, ones_R1, expert_R.unsqueeze(1), w13_EFH, w2_EHI,
        b13_EF, b2_EH, *ctx.static_args)
    return (grad_x_RH, None, None, grad_w13, grad_w2,
            grad_b13 if b13_EF is not None else None,
            grad_b2 if b2_EH is not None else None, None, None, None)


DISPATCH = OpContract(name="dispatch", schema=DISPATCH_SCHEMA, check=check_dispatch,
                      check_values=check_dispatch_values, fake=fake_dispatch,
                      backward=_dispatch_backward, setup_context=_setup_dispatch, ordered=True)
EXPERTS_ROWS = OpContract(name="experts_rows", schema=EXPERTS_ROWS_SCHEMA,
                          check=check_experts_rows, check_values=check_experts_rows_values,
                          fake=fake_experts_rows, backward=_experts_rows_backward,
                          setup_context=_setup_experts_rows)
COMBINE = OpContract(name="combine", schema=COMBINE_SCHEMA, check=check_combine,
                     check_values=check_combine_values, fake=fake_combine,
                     backward=_combine_backward, setup_context=_setup_combine, ordered=True)
_setup_dispatch_backward, _dispatch_double_backward = no_double_backward("dispatch_backward")
DISPATCH_BACKWARD = OpContract(name="dispatch_backward", schema=DISPATCH_BACKWARD_SCHEMA,
                               check=check_dispatch_backward, fake=fake_dispatch_backward,
                               backward=_dispatch_double_backward,
                               setup_context=_setup_dispatch_backward, ordered=True)
_setup_combine_backward, _combine_double_backward = no_double_backward("combine_backward")
COMBINE_BACKWARD = OpContract(name="combine_backward", schema=COMBINE_BACKWARD_SCHEMA,
                              check=check_combine_backward, fake=fake_combine_backward,
                              backward=_combine_double_backward,
                              setup_context=_setup_combine_backward, ordered=True)
dispatch = define(GENERIC_NAMESPACE, DISPATCH)
experts_rows = define(GENERIC_NAMESPACE, EXPERTS_ROWS)
combine = define(GENERIC_NAMESPACE, COMBINE)
dispatch_backward = define(GENERIC_NAMESPACE, DISPATCH_BACKWARD)
combine_backward = define(GENERIC_NAMESPACE, COMBINE_BACKWARD)
