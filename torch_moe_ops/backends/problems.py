"""The `Problem` an op call poses, read from its arguments (real or fake tensors).

The eager kernels of the generic ops choose a backend from it, and the compile
backend reads it from each node of the graph, so that every ``supports`` sees
the sizes, dtype and expert-parallel layout it has to run.
"""

from __future__ import annotations

import dataclasses

from torch_moe_ops.backends.registry import Problem
from torch_moe_ops.ops import CONTRACTS
from torch_moe_ops.ops.quant import spec_of


def _experts_problem(x, w13, activation, top_k=None, quant=None) -> Problem:
    return Problem(dtype=x.dtype, num_local_experts=w13.shape[0], hidden_size=x.shape[1],
                   intermediate_size=w13.shape[1] // 2, top_k=top_k, activation=activation,
                   quant=quant)


def _quant_problem(x, w13, static, top_k=None, out_dtype=None) -> Problem:
    """``static``: (weight_format, activation_format, block_size, activation, ...).
    The format is checked as the op checks it (`ops.quant.spec_of`): the generic
    op's eager kernel and the lowering read it before any concrete op runs, and a
    bad one must be reported in the op's own terms."""
    weight_format, activation_format, block_size, activation, *_ = static
    problem = _experts_problem(x, w13, activation, top_k,
                               spec_of(weight_format, activation_format, block_size))
    return dataclasses.replace(problem, dtype=out_dtype or x.dtype)


def _ep_problem(x, top_k, ep_size, max_tokens_per_rank, num_experts=None, capacity=None
                ) -> Problem:
    return Problem(dtype=x.dtype, num_experts=num_experts,
                   num_local_experts=None if num_experts is None else num_experts // ep_size,
                   hidden_size=x.shape[1], top_k=top_k, ep_size=ep_size,
                   capacity=capacity if ep_size > 1 else None,
                   max_tokens_per_rank=max_tokens_per_rank if ep_size > 1 else None)


def problem_of(op_name: str, args: tuple) -> Problem:
    """What the call ``moe::<op_name>(*args)`` asks of a backend (schema order,
    defaults filled in). Read before the op checks its arguments: a tensor with
    fewer dimensions than the sizes read here gets the op's own error."""
    try:
        return _problem_of(op_name, args)
    except IndexError:
        # The op's shape checks name the argument, what it got and what it expects.
        CONTRACTS[op_name].check(*args)
        raise


def _problem_of(op_name: str, args: tuple) -> Problem:
    if op_name == "experts":
        hidden, _, topk_ids, w13, _, _, _, activation, *_ = args
        return _experts_problem(hidden, w13, activation, topk_ids.shape[1])
    if op_name == "experts_backward":
        _, hidden, _, topk_ids, w13, _, _, _, activation, *_ = args
        return _experts_problem(hidden, w13, activation, topk_ids.shape[1])
    if op_name == "experts_rows":
        x_rows, _, _, w13, _, _, _, activation, *_ = args
        return _experts_problem(x_rows, w13, activation)
    if op_name in ("experts_masked", "experts_masked_backward"):
        x_masked, _, w13, _, _, _, activation, *_ = args[op_name.endswith("_backward"):]
        # Rows of every expert's block: the sizes are those of rows.
        return _experts_problem(x_masked.flatten(0, 1), w13, activation)
    if op_name == "experts_masked_quant":
        x_masked, _, _, w13, _, _, _, _, _, *static = args
        return _quant_problem(x_masked.flatten(0, 1), w13, static, out_dtype=static[-1])
    if op_name == "experts_quant":
        hidden, _, topk_ids, w13, _, _, _, _, _, *static = args
        return _quant_problem(hidden, w13, static, topk_ids.shape[1])
    if op_name == "experts_rows_quant":
        x_rows, _, _, _, w13, _, _, _, _, _, *static = args
        return _quant_problem(x_rows, w13, static, out_dtype=static[-1])
    if op_name == "dispatch":
        hidden, _, topk_ids, num_experts, ep_size, _, max_tokens, capacity = args
        return _ep_problem(hidden, topk_ids.shape[1], ep_size, max_tokens, num_experts, capacity)
    if op_name == "dispatch_quant":
        hidden, _, topk_ids, num_experts, *static, ep_size, _, max_tokens, capacity = args
        return dataclasses.replace(
            _ep_problem(hidden, topk_ids.shape[1], ep_size, max_tokens, num_experts, capacity),
            quant=spec_of(*static))
    if op_name == "dispatch_masked_quant":
        hidden, _, topk_ids, num_experts, *static, ep_size, _, max_tokens = args
        return dataclasses.replace(
            _ep_problem(hidden, topk_ids.shape[1], ep_size, max_tokens, num_experts),
            quant=spec_of(*static))
    if op_name in ("dispatch_tokens", "dispatch_masked"):
        hidden, _, topk_ids, num_experts, ep_size, _, max_tokens = args
        return _ep_problem(hidden, topk_ids.shape[1], ep_size, max_tokens, num_experts)
    if op_name in ("combine_tokens", "combine_tokens_backward"):
        values, topk_ids, num_experts, ep_size, _, max_tokens = args
        return _ep_problem(values, topk_ids.shape[1], ep_size, max_tokens, num_experts)
    if op_name == "combine_masked":
        y_masked, _, _, _, topk_ids, num_experts, ep_size, _, max_tokens = args
        return _ep_problem(y_masked.flatten(0, 1), topk_ids.shape[1], ep_size, max_tokens,
                           num_experts)
    if op_name == "dispatch_tokens_backward":
        grad_x, _, topk_ids, num_experts, ep_size, _, max_tokens = args
        return _ep_problem(grad_x, topk_ids.shape[1], ep_size, max_tokens, num_experts)
    if op_name in ("combine", "dispatch_backward"):
        rows, _, _, slot_map, ep_size, _, max_tokens = args
        return _ep_problem(rows, slot_map.shape[1], ep_size, max_tokens)
    if op_name == "combine_backward":
        grad_out, _, _, _, slot_map, ep_size, _, max_tokens = args
        return _ep_problem(grad_out, slot_map.shape[1], ep_size, max_tokens)
    if op_name == "route":
        logits, correction_bias, top_k, scoring, renormalize, groups, topk_groups, _ = args
        # Read before the op checks its arguments: logits that are not 2-D get the
        # op's own error there.
        num_experts = logits.shape[1] if logits.dim() == 2 else None
        return Problem(dtype=logits.dtype, num_experts=num_experts, top_k=top_k,
                       scoring=scoring, renormalize=renormalize, num_expert_groups=groups,
                       topk_groups=topk_groups, correction_bias=correction_bias is not None)
    return Problem(dtype=args[0].dtype)
