"""One plan per MoE layer: which backends run it, in which format and dtype its tokens
travel, in which mode of the transport's engine, and why.

The lowering reads every generic op's `Problem` from the graph, merges those of one layer
(`rewrite.layer_problems`) and asks `plan_layer` once per layer; each node of the layer
then takes its namespace from that plan. `torch_moe_ops.explain` prints the same plans.
The plan is the only place these are decided: the rewrite and `explain` read it.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from torch_moe_ops.backends.dispatch_dtype import (
    DispatchDtype,
    DispatchSides,
    resolve_dispatch_dtype,
)
from torch_moe_ops.backends.registry import (
    EXPERTS_OPS,
    FORMATS,
    MASKED,
    QUANT_EXPERTS_OPS,
    REGISTRY,
    ROWS,
    TOKENS,
    A2ABackend,
    ExpertsBackend,
    Format,
    Problem,
    RouteBackend,
    TransportMode,
)
from torch_moe_ops.config import BackendSpec, worst_case_capacity
from torch_moe_ops.ops.experts import backward_namespace
from torch_moe_ops.ops.library import defines


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """What runs one layer on ``device``.

    ``route`` is set for a routing op's plan, ``experts`` and ``a2a`` for the ops that carry
    activations; ``format`` is the `Format` between dispatch and combine (None on one device)
    and ``format_reason`` why it was taken; ``mode`` the mode of the transport's engine that
    moves it and the namespace of the ops that run that mode (None where the engine has one
    mode: `A2ABackend.mode_of`); ``chunks`` the chunks its tokens move in
    (`choose_chunks`) and ``chunks_reason`` why; ``in_flight`` whether its
    transfers are issued and waited apart, the work that needs no routed tokens between
    (`choose_in_flight`), and ``in_flight_reason`` why; ``dispatch`` the dtype its
    tokens travel in and the rule that chose it (None for routing); ``refused`` lists each
    ``(kind, name, reason)`` of the ``"auto"`` candidates that could not run the layer.
    """

    device: torch.device
    problem: Problem
    route: RouteBackend | None = None
    experts: ExpertsBackend | None = None
    a2a: A2ABackend | None = None
    format: Format | None = None
    format_reason: str = ""
    mode: TransportMode | None = None
    refused: tuple[tuple[str, str, str], ...] = ()
    chunks: int = 1
    chunks_reason: str = ""
    in_flight: bool = False
    in_flight_reason: str = ""
    dispatch: DispatchDtype | None = None

    def namespace_for(self, op_name: str) -> str:
        """The namespace whose op runs ``moe::<op_name>`` in this layer."""
        if op_name in EXPERTS_OPS + QUANT_EXPERTS_OPS:
            return self.experts.namespace
        if op_name in ("experts_backward", "experts_masked_backward"):
            return backward_namespace(self.experts.namespace, op_name)
        fmt = next((f for f in FORMATS if op_name in f.a2a_ops), None)
        if fmt is not None:
            if self.mode is not None:
                return self.mode.namespace
            return self.a2a.namespace_of(fmt, bool(self.problem.training))
        if op_name == "route":
            return self.route.namespace
        raise ValueError(f"op_name must name a generic MoE op, got {op_name!r}")


def _refusals(kind: str, backends: dict, spec: BackendSpec, problem: Problem,
              device: torch.device, chosen: str) -> list[tuple[str, str, str]]:
    """The ``auto`` candidates of ``kind`` that cannot run ``problem``, with their reasons."""
    if getattr(spec, kind) != "auto":
        return []
    return [(kind, name, reason) for name, backend in backends.items() if name != chosen
            and (reason := backend.why_not(spec, problem, device)) is not None]


# Why the first format both backends run is taken, where none was passed over before it.
_MERITS = {MASKED: "the transport's decode layout, read where it arrives (no copy into rows)",
           TOKENS: "the format that moves the fewest bytes"}


def rows_travel_quantized(a2a: A2ABackend, experts: ExpertsBackend, problem: Problem,
                          dispatch_dtype: torch.dtype | None = None) -> bool:
    """Whether a quantized layer's rows would cross in fp8 between these backends (the
    dispatch dtype rule, ``dispatch_dtype`` its explicit choice): the a2a sends fp8 rows, the
    experts read them. Else its tokens cross in the activations' dtype whatever the format.
    A probe: an explicit choice that cannot be met warns once, when the plan resolves it."""
    chosen = _resolved_quietly(problem, dispatch_dtype, DispatchSides.of(a2a, experts))
    return chosen.dtype != problem.dtype


def _resolved_quietly(problem: Problem, dispatch_dtype: torch.dtype | None,
                      sides: DispatchSides) -> DispatchDtype:
    """`resolve_dispatch_dtype` without its warning of an explicit choice that cannot be met,
    for answers that are not the plan's own."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return resolve_dispatch_dtype(problem.dtype, dispatch_dtype, problem.quant, sides)


def dispatch_sides(a2a: A2ABackend, experts: ExpertsBackend, problem: Problem, fmt: Format,
                   mode: TransportMode | None = None) -> DispatchSides:
    """What a layer's two ends can do in ``fmt``: its activations travel in fp8 where the
    namespace that moves it (``mode``'s, where the engine's mode is fixed) defines the
    format's quantized dispatch; tokens never (they cross in the activations' dtype)."""
    namespace = (mode.namespace if mode is not None
                 else a2a.namespace_of(fmt, bool(problem.training)))
    return dataclasses.replace(
        DispatchSides.of(a2a, experts),
        a2a_name=f"a2a backend {a2a.name!r} in the {fmt} format",
        sends_quantized=(fmt.quantized_dispatch is not None
                         and defines(namespace, fmt.quantized_dispatch)))


def _capacity_reason(problem: Problem) -> str | None:
    """Why a format other than rows cannot keep the layer's ``ep_capacity``: the tokens
    and masked formats size their buffers by ``max_tokens_per_rank``, in which no smaller
    capacity of rows per rank can be honoured; rows move at most ``ep_capacity`` a peer."""
    if problem.capacity is None or problem.max_tokens_per_rank is None or problem.top_k is None:
        return None
    worst = worst_case_capacity(problem.max_tokens_per_rank, problem.top_k)
    if problem.capacity >= worst:
        return None
    return (f"cannot keep ep_capacity={problem.capacity} (below the worst case "
            f"max_tokens_per_rank * top_k = {worst}): only rows move at most ep_capacity "
            "rows a peer")


def choose_format(a2a: A2ABackend, experts: ExpertsBackend, problem: Problem,
                  dispatch_dtype: torch.dtype | None = None) -> tuple[Format, str]:
    """``(format, why)``: the first of `FORMATS` both backends run for ``problem``; the
    formats passed over, and why, are in ``why``. A quantized layer takes the format's
    quantized experts op (`Format.experts_op`), and rows before tokens where its rows cross in
    fp8 (half the bytes of tokens in the activations' dtype; ``dispatch_dtype``, the spec's
    explicit choice, may say they do not)."""
    quantized = problem.quant is not None
    skipped = []
    # Formats the transport does not produce are not listed: they were never candidates.
    for fmt in a2a.formats:
        if fmt is not ROWS and (why := _capacity_reason(problem)):
            skipped.append(f"{fmt} {why}")
        elif (quantized and fmt is TOKENS and ROWS in a2a.formats
                and rows_travel_quantized(a2a, experts, problem, dispatch_dtype)):
            skipped.append("rows travel in fp8 with their scales, tokens in the activations' "
                           "dtype")
        elif not defines(experts.namespace, fmt.experts_op(quantized)):
            skipped.append(f"{experts.name} does not read {'quantized ' * quantized}{fmt}")
        elif problem.training and not a2a.trains(fmt):
            skipped.append(f"{a2a.name} carries no gradient in {fmt}")
        elif a2a.format_reason is not None and (why := a2a.format_reason(fmt, problem)):
            skipped.append(f"{a2a.name} cannot move this layer in {fmt}: {why}")
        else:
            why = "; ".join(skipped) or _MERITS.get(fmt, "the one format both run")
            return fmt, ("quantized layer: " if quantized else "") + why
    raise ValueError(f"a2a backend {a2a.name!r} and experts backend {experts.name!r} share no "
                     f"format for this layer: " + "; ".join(skipped))


# From this many tokens per rank (prefill), a transfer is long enough to hide the work of the
# block that does not need the routed tokens (shared experts); below, a transfer issued and
# waited by ops of their own (two messages: rows and routing) adds latency to a decode step.
IN_FLIGHT_TOKENS = 1024


def choose_chunks(spec: BackendSpec, a2a: A2ABackend, problem: Problem, fmt: Format | None
                  ) -> tuple[int, str]:
    """``(chunks, why)``: how many chunks a layer's tokens move in (`ops.tokens_in_flight`),
    chunk i + 1's dispatch in flight while chunk i's experts run and chunk i's combine while
    chunk i + 1's do: as many as ``spec.chunks`` asks (at most ``max_tokens_per_rank``), one
    where it asks none. Each chunk's experts read every local expert's weights again, which
    cost more than the transfers hid where measured."""
    if spec.chunks is None or spec.chunks == 1:
        return 1, ("chunks=1 asked" if spec.chunks == 1 else
                   "none asked: each chunk reads every local expert's weights again (2 "
                   "chunks 1.27x, 4 chunks 2.16x the whole layer at DeepSeek-V3's widths on 2 "
                   "H200s); work that needs no routed tokens runs under the transfers instead")
    if fmt is not TOKENS:
        return 1, f"the {fmt} format moves whole (chunks move the tokens format)"
    if not a2a.overlaps:
        return 1, (f"{a2a.name} issues and waits each transfer inside one op: no compute can "
                   "run under it")
    if problem.training:
        return 1, "training: chunked transfers carry no gradient"
    chunks = min(spec.chunks, problem.max_tokens_per_rank)
    return chunks, f"chunks={spec.chunks} asked" + (
        f", at most max_tokens_per_rank ({problem.max_tokens_per_rank})"
        if chunks < spec.chunks else "")


def choose_in_flight(spec: BackendSpec, a2a: A2ABackend, problem: Problem,
                     fmt: Format | None, chunks: int) -> tuple[bool, str]:
    """``(in_flight, why)``: whether the layer's transfers are issued and waited by ops of
    their own (`ops.tokens_in_flight`, as chunks are), so that the work of its graph that
    does not need the routed tokens (shared experts) runs while they travel
    (`overlap.lower_in_chunks` moves it there): with chunks, or where ``spec.overlap`` asks."""
    if chunks > 1:
        return True, "its chunks' transfers are issued and waited apart"
    if not spec.overlap:
        return False, ("overlap=False: not yet shown to pay (2 H200s, DeepSeek-V3's widths, "
                       "4096 tokens per rank: the layer with its shared expert in flight took "
                       "0.65-0.81 ms more than without one)")
    if fmt is not TOKENS or not a2a.overlaps:
        return False, (f"{a2a.name} issues and waits each transfer inside one op"
                       if fmt is TOKENS else f"the {fmt} format moves in one op")
    if problem.training:
        return False, "training: transfers in flight carry no gradient"
    if problem.max_tokens_per_rank < IN_FLIGHT_TOKENS:
        return False, (f"max_tokens_per_rank ({problem.max_tokens_per_rank}) < "
                       f"{IN_FLIGHT_TOKENS}: a decode transfer is latency, which a second "
                       "message would add to")
    return True, (f"max_tokens_per_rank ({problem.max_tokens_per_rank}) >= "
                  f"{IN_FLIGHT_TOKENS}: work that needs no routed tokens runs while they "
                  "travel")


def plan_layer(spec: BackendSpec, problem: Problem, device: torch.device,
               routing: bool = False) -> LayerPlan:
    """The plan of one layer (``routing``: of its routing op alone). Raises ValueError for an
    unregistered, unavailable or inconsistent choice, naming what is available."""
    if routing:
        route = REGISTRY.choose_route(spec, problem, device)
        return LayerPlan(device, problem, route=route,
                         refused=tuple(_refusals("route", REGISTRY.route, spec, problem, device,
                                                 route.name)))
    # A quantized layer runs the quantized experts ops: backends with only those are candidates.
    experts = REGISTRY.choose_experts(spec, problem, device,
                                      "experts_quant" if problem.quant else "experts")
    refused = _refusals("experts", REGISTRY.experts, spec, problem, device, experts.name)
    a2a = REGISTRY.choose_a2a(spec, problem, device)
    if (problem.ep_size or 1) < 2:
        # Rows sorted on one device (a2a 'none'), where a graph has a dispatch at all: most
        # one-device layers have none, so an explicit choice that cannot be met goes unsaid.
        dispatch = _resolved_quietly(problem, spec.dispatch_dtype,
                                     DispatchSides.of(a2a, experts))
        return LayerPlan(device, problem, experts=experts, a2a=a2a, refused=tuple(refused),
                         dispatch=dispatch)
    fmt, why = choose_format(a2a, experts, problem, spec.dispatch_dtype)
    trainer = a2a.namespace_of(fmt, bool(problem.training))
    if trainer != a2a.namespace:
        why += (f"; it trains through {trainer}'s ops, which copy the receive buffers out of "
                f"the transport's memory for the gradient")
    # Once per layer, here: the ops of the mode taken run it whatever else is open.
    mode = a2a.mode_of(fmt, problem) if a2a.mode_of is not None else None
    chunks, chunks_reason = choose_chunks(spec, a2a, problem, fmt)
    in_flight, in_flight_reason = choose_in_flight(spec, a2a, problem, fmt, chunks)
    # Once per layer, here: the rewrite and `explain` read it (an impossible explicit choice
    # warns once, naming both).
    dispatch = resolve_dispatch_dtype(problem.dtype, spec.dispatch_dtype, problem.quant,
                                      dispatch_sides(a2a, experts, problem, fmt, mode))
    return LayerPlan(device, problem, experts=experts, a2a=a2a, format=fmt, format_reason=why,
                     mode=mode, refused=tuple(refused), chunks=chunks,
                     chunks_reason=chunks_reason,
                     in_flight=in_flight, in_flight_reason=in_flight_reason,
                     dispatch=dispatch)
