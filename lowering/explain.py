"""``tmo.explain(model, *example_inputs)``: what the compile backend will run for each MoE
layer of ``model``, and why.

It compiles ``model`` with a backend that records each graph's layer plans
(`plan.layer_plans`) and the dispatch dtype the lowering resolves, then runs the graph
eagerly: one forward of ``model`` on ``example_inputs`` (with expert parallelism every
rank calls it, as every rank runs each forward).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from torch_moe_ops.backends.registry import Problem
from torch_moe_ops.config import BackendSpec
from torch_moe_ops.lowering.plan import LayerPlan
from torch_moe_ops.lowering.rewrite import generic_op, layer_plans, lower


def bytes_per_call(problem: Problem, fmt: str | None, dispatch_dtype: torch.dtype,
                   chunks: int = 1) -> tuple[int, int]:
    """``(dispatch, combine)`` bytes one rank sends its peers per call, at the layer's
    static sizes (every position is sent, filled or not: the splits are static).

    tokens: M rows of H, with K ids and weights (8 bytes each), to each peer, and M rows
    back (in ``chunks`` chunks: ``chunks * ceil(M / chunks)``); rows: C rows of H with an id
    and a weight to each peer, C rows back; masked: one message of H per (token, slot) to its
    expert's rank and one back, at most M * K (the transport sends the messages there are,
    not static blocks; the bound counts them all).
    """
    if fmt is None or not problem.ep_size or problem.ep_size < 2:
        return 0, 0
    peers, hidden = problem.ep_size - 1, problem.hidden_size
    row_out = hidden * dispatch_dtype.itemsize
    row_back = hidden * problem.dtype.itemsize
    if fmt == "masked":
        messages = problem.max_tokens_per_rank * problem.top_k
        return messages * row_out, messages * row_back
    if fmt == "tokens":
        rows = chunks * -(-problem.max_tokens_per_rank // chunks)
        return peers * rows * (row_out + 8 * problem.top_k), peers * rows * row_back
    return peers * problem.capacity * (row_out + 8), peers * problem.capacity * row_back


@dataclasses.dataclass(frozen=True)
class LayerReport:
    """One layer's plan with the dispatch dtype its lowering resolved (and the rule)."""

    plan: LayerPlan
    route: LayerPlan | None
    dispatch_dtype: torch.dtype
    dispatch_rule: str

    def __str__(self) -> str:
        p, plan = self.plan.problem, self.plan
        shape = (f"E={p.num_experts or p.num_local_experts}"
                 + (f" ({p.num_local_experts} per rank), ep_size={p.ep_size}"
                    if (p.ep_size or 1) > 1 else "")
                 + f", H={p.hidden_size}, I={p.intermediate_size}, K={p.top_k}")
        lines = [f"MoE layer on {plan.device}, {p.dtype}, {shape}, "
                 f"{'training' if p.training else 'inference'}"
                 + (f", quantized {p.quant.name}" if p.quant is not None else "")]
        if self.route is not None:
            lines.append(f"  route:   {self.route.route.name}" + _refused(self.route))
        lines.append(f"  experts: {plan.experts.name}" + _refused(plan))
        lines.append(f"  a2a:     {plan.a2a.name}")
        if plan.format is not None:
            sent, back = bytes_per_call(p, plan.format, self.dispatch_dtype, plan.chunks)
            lines += [f"  format:  {plan.format} ({plan.format_reason})",
                      f"  chunks:  {plan.chunks} ({plan.chunks_reason})",
                      f"  dispatch dtype: {self.dispatch_dtype} ({self.dispatch_rule})",
                      f"  bytes each rank sends per call: dispatch {sent:,}, combine {back:,}"]
        return "\n".join(lines)


def _refused(plan: LayerPlan) -> str:
    refused = [f"{name}: {reason}" for kind, name, reason in plan.refused]
    return f"   (not taken: {'; '.join(refused)})" if refused else ""


class Explanation(list):
    """`explain`'s answer: a list of `LayerReport` that prints one block per layer."""

    def __str__(self) -> str:
        if not self:
            return "no MoE layer was traced"
        return "\n".join(str(report) for report in self)


# The op each layer emits once: its experts on one device, its dispatch across ranks.
_LAYER_OPS = ("experts", "experts_quant", "dispatch")


def _reports(gm: fx.GraphModule, spec: BackendSpec) -> list[LayerReport]:
    """The layers of ``gm`` (and the graphs it holds) in graph order, lowered; a layer's
    routing is the routing op of the same rank in that order."""
    found = []
    for body in gm.modules():
        if not isinstance(body, fx.GraphModule):
            continue
        plans = layer_plans(body, spec)
        layers = [(node, plan) for node, plan in plans.items()
                  if generic_op(node) in _LAYER_OPS]
        routes = [plan for node, plan in plans.items() if generic_op(node) == "route"]
        lower(body, spec)
        for index, (node, plan) in enumerate(layers):
            chosen = node.meta.get("moe_dispatch_dtype")
            found.append(LayerReport(
                plan, routes[index] if index < len(routes) else None,
                chosen.dtype if chosen is not None else plan.problem.dtype,
                chosen.rule if chosen is not None else "one device: no dispatch"))
    return found


def explain(model: torch.nn.Module, *example_inputs, experts: str = "auto", a2a: str = "none",
            route: str = "auto", dispatch_dtype: torch.dtype | None = None,
            chunks: int | None = None, **kwargs) -> Explanation:
    """Per MoE layer of ``model`` called on ``example_inputs``: the plan the compile backend
    ``tmo.backend(experts=..., a2a=..., route=..., dispatch_dtype=..., chunks=...)`` makes
    (backends, the ``auto`` candidates it refused and why, the format between dispatch and
    combine, the chunks its tokens move in and why, the dispatch dtype and the bytes each
    rank sends per call). Runs one forward (every
    rank of an expert-parallel model must call it); prints as one block per layer.
    ``kwargs`` go to ``model`` too. Raises ValueError where the compile backend would.
    """
    spec = BackendSpec(experts=experts, a2a=a2a, dispatch_dtype=dispatch_dtype, route=route,
                       chunks=chunks)
    found = Explanation()

    def recording(gm: fx.GraphModule, _example_inputs):
        found.extend(_reports(gm, spec))
        return gm.forward

    torch.compile(model, backend=recording, fullgraph=False)(*example_inputs, **kwargs)
    return found
