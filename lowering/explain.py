"""``tmo.explain(model, *example_inputs)``: what the compile backend will run for each MoE
layer of ``model``, and why.

It compiles ``model`` with a backend that records each graph's layer plans
(`plan.layer_plans`) and the dispatch dtype the lowering resolves, then runs the graph
eagerly: one forward of ``model`` on ``example_inputs`` (with expert parallelism every
rank calls it, as every rank runs each forward). A ``torch.compile``d model is planned
with its own backend's spec, and traced as the module it wraps.
"""

from __future__ import annotations

import dataclasses
import inspect
import types

import torch
from torch import fx

from torch_moe_ops import torch_compat
from torch_moe_ops.backends.registry import MASKED, TOKENS, Format, Problem
from torch_moe_ops.config import BackendSpec
from torch_moe_ops.lowering.compile import MoECompileBackend, moe_backend
from torch_moe_ops.lowering.plan import LayerPlan
from torch_moe_ops.lowering.rewrite import expert_parallel, generic_op, layer_plans, lower


def bytes_per_call(problem: Problem, fmt: Format | None, dispatch_dtype: torch.dtype,
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
    if fmt is MASKED:
        messages = problem.max_tokens_per_rank * problem.top_k
        return messages * row_out, messages * row_back
    if fmt is TOKENS:
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
        lines = [f"MoE layer on {plan.device}, {p.dtype}, {shape}"
                 + (f", quantized {p.quant.name}" if p.quant is not None else ""),
                 _GRADIENTS[bool(p.training)]]
        if self.route is not None:
            lines.append(f"  route:   {self.route.route.name}" + _refused(self.route))
        lines.append(f"  experts: {plan.experts.name}" + _refused(plan))
        lines.append(f"  a2a:     {plan.a2a.name}")
        if plan.format is not None:
            sent, back = bytes_per_call(p, plan.format, self.dispatch_dtype, plan.chunks)
            lines += [f"  format:  {plan.format} ({plan.format_reason})",
                      *([f"  mode:    {plan.mode.name} ({plan.mode.reason})"]
                        if plan.mode is not None else []),
                      f"  chunks:  {plan.chunks} ({plan.chunks_reason})",
                      (f"  in flight: {'yes' if plan.in_flight else 'no'} "
                       f"({plan.in_flight_reason})"),
                      f"  dispatch dtype: {self.dispatch_dtype} ({self.dispatch_rule})",
                      f"  bytes each rank sends per call: dispatch {sent:,}, combine {back:,}"]
        return "\n".join(lines)


# Whether a layer plans for training is whether autograd records its gradients, which
# `eval()` does not change: it says so, and how to plan for inference.
_GRADIENTS = {
    True: ("  gradients: recorded (grad mode is on, and eval() leaves it on), so it plans for "
           "training; under torch.no_grad() or torch.inference_mode() it plans for inference"),
    False: ("  gradients: not recorded (torch.no_grad(), torch.inference_mode(), or no weight "
            "or input requires grad), so it plans for inference"),
}


def _refused(plan: LayerPlan) -> str:
    refused = [f"{name}: {reason}" for kind, name, reason in plan.refused]
    return f"   (not taken: {'; '.join(refused)})" if refused else ""


class Explanation(list):
    """`explain`'s answer: a list of `LayerReport` that prints what the plans are of
    (``source``: the backend asked for, or the compiled model's own), then one block per
    layer."""

    def __init__(self, source: str):
        super().__init__()
        self.source = source

    def __str__(self) -> str:
        layers = [str(report) for report in self] or ["no MoE layer was traced"]
        return "\n".join([self.source, *layers])


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


def _spec_arguments(spec: BackendSpec) -> str:
    """``spec`` as the keyword arguments of ``tmo.backend`` that give it."""
    return ", ".join(f"{field.name}={getattr(spec, field.name)!r}"
                     for field in dataclasses.fields(spec))


@dataclasses.dataclass(frozen=True)
class _Source:
    """What `explain` traces (``module``) and plans with (``spec``), and the words for it
    (``says``); ``eager_backend``: the name of the model's backend where it leaves the MoE
    ops to their eager kernels, which ``spec`` gives for layers on one device alone."""

    module: torch.nn.Module
    spec: BackendSpec
    says: str
    eager_backend: str | None = None


def _source(model: torch.nn.Module, asked: dict) -> _Source:
    """The plans' source for ``model`` and the keywords given to `explain` (``asked``): the
    backend they ask for, or a compiled model's own, which they must agree with."""
    compiled = torch_compat.compiled_module(model)
    if compiled is None:
        spec = BackendSpec(**asked)
        return _Source(model, spec, f"planned for tmo.backend({_spec_arguments(spec)})")
    module, backend, name = compiled
    defaults = BackendSpec()
    if isinstance(backend, MoECompileBackend):
        source = _Source(module, backend.spec, f"compiled with tmo.backend("
                                               f"{_spec_arguments(backend.spec)}): what it runs")
    elif backend is moe_backend:
        source = _Source(module, defaults,
                         f"compiled with backend='moe', tmo.backend()'s automatic choice "
                         f"({_spec_arguments(defaults)}): what it runs")
    else:
        source = _Source(module, defaults,
                         f"compiled with {name}, which leaves the MoE ops to their eager "
                         "kernels: they run tmo.backend()'s defaults "
                         f"({_spec_arguments(defaults)})", eager_backend=name)
    disagree = {key: value for key, value in asked.items()
                if value != getattr(source.spec, key)}
    if disagree:
        given = ", ".join(f"{key}={value!r}" for key, value in disagree.items())
        own = ", ".join(f"{key}={getattr(source.spec, key)!r}" for key in disagree)
        raise ValueError(f"model is compiled with {name}, which runs {own}; explain got {given}: "
                         "a compiled model is explained as it runs. Leave those keywords out, "
                         "or pass the uncompiled module to plan other backends")
    return source


def explain(model: torch.nn.Module, *example_inputs, experts: str | None = None,
            a2a: str | None = None, route: str | None = None,
            dispatch_dtype: torch.dtype | None = None, chunks: int | None = None,
            overlap: bool | None = None, **kwargs) -> Explanation:
    """Per MoE layer of ``model`` called on ``example_inputs``: the plan the compile backend
    ``tmo.backend(experts=..., a2a=..., route=..., dispatch_dtype=..., chunks=...,
    overlap=...)`` makes (backends, the ``auto`` candidates it refused and why, the format
    between dispatch and combine, the chunks its tokens move in and why, whether its
    transfers stay in flight under other work and why, the dispatch dtype and the bytes each
    rank sends per call). A keyword left out (None) takes ``tmo.backend``'s default.

    A ``torch.compile``d ``model`` is explained as it runs: with its backend's spec where
    that is ``tmo.backend(...)`` or ``"moe"``; with another backend (Inductor, ``eager``)
    the MoE ops run their eager kernels, whose defaults it plans (one device only: an
    expert-parallel layer's eager kernels are not a plan, and raise ValueError). Keywords
    given with a compiled model must agree with its backend (ValueError naming both).

    A layer plans for training where autograd records its gradients (grad mode on, which
    ``eval()`` does not change), and takes backends and formats with a backward; under
    ``torch.no_grad()`` or ``torch.inference_mode()`` it plans for inference.

    Runs one forward (every rank of an expert-parallel model must call it); prints what the
    plans are of, then one block per layer. ``kwargs`` go to ``model`` too. Raises
    ValueError where the compile backend would.

    Called any number of times, it leaves Dynamo's caches as it found them: nothing of it
    counts towards the recompile limit of the user's compiled models or of later calls,
    nor keeps ``model`` alive. One exception: where ``model`` has a graph break and is
    compiled too, a frame after the break that both compile keeps explain's compilation
    beside the user's (Dynamo drops a frame's cache whole or not at all).
    """
    asked = {key: value for key, value in (("experts", experts), ("a2a", a2a), ("route", route),
                                           ("dispatch_dtype", dispatch_dtype),
                                           ("chunks", chunks), ("overlap", overlap))
             if value is not None}
    source = _source(model, asked)
    found = Explanation(source.says)

    def recording(gm: fx.GraphModule, _example_inputs):
        if source.eager_backend is not None and expert_parallel(gm):
            raise torch_compat.backend_error(
                f"model is compiled with {source.eager_backend}, which leaves an "
                "expert-parallel layer to its eager kernels: they move its tokens on "
                "a2a='all_to_all' in the rows format, whole, which explain does not plan. "
                "Explain the uncompiled module with a2a=..., or compile the model with "
                "tmo.backend(a2a=...)", inspect.currentframe())
        found.extend(_reports(gm, source.spec))
        return gm.forward

    # Dynamo caches a compilation in the code object it compiled, and counts every
    # backend's compilations of one code object towards its recompile limit: the frame
    # explain compiles is a code object of this call's own, not the model's forward (which
    # the user may compile too), and what Dynamo kept of it is dropped once it has run.
    # Static sizes (but those marked dynamic): the sizes an earlier call saw, which Dynamo
    # remembers by the frame's name and line, would make them symbolic.
    call = types.FunctionType(_call_module.__code__.replace(), _call_module.__globals__)
    try:
        torch.compile(call, backend=recording, fullgraph=False, dynamic=False)(
            source.module, example_inputs, kwargs)
    finally:
        torch_compat.discard_compiled(recording)
    return found


def _call_module(module: torch.nn.Module, args: tuple, kwargs: dict):
    """The frame `explain` compiles, copied for each call: ``module(*args, **kwargs)``."""
    return module(*args, **kwargs)
