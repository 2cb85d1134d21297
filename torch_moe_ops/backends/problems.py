"""The `Problem` an op call poses, read from its arguments (real or fake tensors).

The eager kernels of the generic ops choose a backend from it, and the compile
backend reads it from each node of the graph, so that every ``supports`` sees
the sizes, dtype and expert-parallel layout it has to run.
"""

from __future__ import annotations

import torch

from torch_moe_ops.backends.registry import Problem
from torch_moe_ops.ops import CONTRACTS, GENERIC_NAMESPACE, op_overload
from torch_moe_ops.ops.library import named_args
from torch_moe_ops.ops.quant import spec_of

# The argument whose rows an op reads (its dtype and H), by schema name: the first of
# these that the op takes. An op that takes both its input and the gradient of its output
# reads the input's name, listed first. The masked format's blocks (``[E_l, C, H]``) are
# read as rows.
_ROWS_ARGS = ("hidden", "x_rows", "x_masked", "grad_out", "y_rows", "y_masked",
              "grad_x_rows", "y_tokens", "grad_x_tokens")
_BLOCK_ARGS = ("x_masked", "y_masked")


def problem_of(op_name: str, args: tuple) -> Problem:
    """What the call ``moe::<op_name>(*args)`` asks of a backend (schema order,
    defaults filled in), each argument read by its schema name (`named_args`). Read
    before the op checks its arguments: a tensor with fewer dimensions than the sizes
    read here gets the op's own error."""
    try:
        return _problem_of(named_args(op_overload(GENERIC_NAMESPACE, op_name), args))
    except IndexError:
        # The op's shape checks name the argument, what it got and what it expects.
        CONTRACTS[op_name].check(*args)
        raise


def _rows(args: dict) -> torch.Tensor:
    name = next(name for name in _ROWS_ARGS if name in args)
    return args[name].flatten(0, 1) if name in _BLOCK_ARGS else args[name]


def _problem_of(args: dict) -> Problem:
    if "router_logits" in args:
        return _route_problem(args)
    if "w13" not in args and "ep_size" not in args:
        # Neither experts nor transport (`moe::no_gradient`): its dtype is all it poses.
        first = next(value for value in args.values() if isinstance(value, torch.Tensor))
        return Problem(dtype=first.dtype)
    # The format is checked as the op checks it: the generic op's eager kernel and the
    # lowering read it before any concrete op runs, and a bad one must be reported in
    # the op's own terms.
    quant = (spec_of(args["weight_format"], args["activation_format"], args["block_size"])
             if "weight_format" in args else None)
    x = _rows(args)
    routing = args.get("topk_ids", args.get("combine_map"))
    top_k = None if routing is None else routing.shape[1]
    if "w13" in args:
        w13 = args["w13"]
        rows = x.shape[0]
        return Problem(dtype=args.get("out_dtype") or x.dtype, num_local_experts=w13.shape[0],
                       hidden_size=x.shape[1], intermediate_size=w13.shape[1] // 2,
                       top_k=top_k, activation=args["activation"], quant=quant,
                       rows=rows if isinstance(rows, int) else None)
    ep_size, num_experts = args["ep_size"], args.get("num_experts")
    return Problem(dtype=x.dtype, num_experts=num_experts,
                   num_local_experts=None if num_experts is None else num_experts // ep_size,
                   hidden_size=x.shape[1], top_k=top_k, ep_size=ep_size,
                   capacity=args.get("capacity") if ep_size > 1 else None,
                   max_tokens_per_rank=args["max_tokens_per_rank"] if ep_size > 1 else None,
                   quant=quant)


def _route_problem(args: dict) -> Problem:
    logits = args["router_logits"]
    # Read before the op checks its arguments: logits that are not 2-D get the op's own
    # error there.
    num_experts = logits.shape[1] if logits.dim() == 2 else None
    return Problem(dtype=logits.dtype, num_experts=num_experts, top_k=args["top_k"],
                   scoring=args["scoring"], renormalize=args["renormalize"],
                   num_expert_groups=args["num_expert_groups"],
                   topk_groups=args["topk_groups"],
                   correction_bias=args["correction_bias"] is not None)
