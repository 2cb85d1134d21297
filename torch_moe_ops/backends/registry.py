"""Which backends exist, what each supports, and how a choice is resolved.

Experts backends implement ``experts`` and ``experts_rows``, those that read the masked
format ``experts_masked`` too, and those with a gradient of their own ``experts_backward``
(and ``experts_masked_backward``; ``ExpertsBackend.backward`` says where it computes the
gradient itself); the gradient of the others runs on the reference backend's. A2A
backends implement ``dispatch`` and ``combine`` and the gradients of both
(``dispatch_backward``, ``combine_backward``: the same transport, reversed), and
those that send rows quantized to fp8 ``dispatch_quant``. Route backends
implement ``route``; its gradient is the op contract's formula on the selection
the backend made (`torch_moe_ops.ops.route`), whichever backend ran it.

Formats are declared by what a namespace defines (`FORMAT_OPS`): an a2a backend produces
the masked format (`ops.masked`) where it defines ``dispatch_masked`` and ``combine_masked``,
the tokens format (`ops.tokens`) where it defines ``dispatch_tokens`` and ``combine_tokens``
and the rows format (`ops.rows`) where it defines ``dispatch`` and ``combine``; an experts
backend consumes masked blocks through its ``experts_masked`` op, tokens through its
``experts`` op (the receive buffers as they are, ids local) and rows through
``experts_rows``. A format trains where the a2a namespace defines its gradient ops too
(`TRAINING_OPS`; the masked format has none), or where its ``training_namespace`` defines
the format's ops and their gradient ops: a transport whose buffers are its own memory hands
them out as they are to layers without gradients, and copies them out for layers that
train. The lowering picks one format per layer (`FORMATS` in order of preference), and for
a layer that trains the namespace that trains in it (`A2ABackend.namespace_of`).

``supports(spec, problem, device)`` returns ``None`` when the backend can run the
`Problem` there, otherwise the reason it cannot. The compile backend reads the
problem from each node of the graph; `available_backends` knows only the dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from torch_moe_ops.config import QUANT_WEIGHT_FORMATS, BackendSpec, MoEConfig, QuantSpec
from torch_moe_ops.ops.library import REFERENCE_NAMESPACE, defines

# The last line of `available_backends()`: formats no backend here has kernels for.
UNSUPPORTED_FORMATS = ("quantized formats not supported by any backend: nvfp4 and the other "
                       "Blackwell-only formats (QuantSpec lists what is)")
EXPERTS_OPS = ("experts", "experts_rows", "experts_masked")
# The experts ops on quantized weights: a backend has kernels for quantized weights
# exactly where its namespace defines the first two (its `supports` says which formats),
# and reads the masked format's quantized blocks where it defines the third.
QUANT_EXPERTS_OPS = ("experts_quant", "experts_rows_quant", "experts_masked_quant")
A2A_OPS = ("dispatch", "combine", "dispatch_backward", "combine_backward")
# An a2a backend sends rows quantized to fp8 exactly where its namespace defines these.
QUANT_A2A_OPS = ("dispatch_quant",)
# Quantized layers: per format, what an a2a namespace defines to send its activations in
# fp8 and what an experts namespace defines to read them (with quantized weights). The
# tokens format has neither: quantized layers take another.
QUANT_FORMAT_OPS = {"masked": ("dispatch_masked_quant", "experts_masked_quant"),
                    "rows": ("dispatch_quant", "experts_rows_quant")}
# The formats between dispatch and combine, best first (the wire is the cost: tokens cross
# once per rank that needs them); what an a2a namespace defines to produce each, what an
# experts namespace defines to consume it, and what an a2a namespace defines for its gradient.
# The masked format (DeepEP low-latency's per-expert blocks) comes first where a transport
# produces it: the experts read its receive buffer where it is, and a transport makes it
# only where its engine's own layout is that (`A2ABackend.format_reason` says where not).
# A format without gradient ops in `TRAINING_OPS` serves inference only.
FORMATS = ("masked", "tokens", "rows")
FORMAT_OPS = {"masked": ("dispatch_masked", "combine_masked"),
              "tokens": ("dispatch_tokens", "combine_tokens"), "rows": ("dispatch", "combine")}
CONSUMER_OPS = {"masked": "experts_masked", "tokens": "experts", "rows": "experts_rows"}
TRAINING_OPS = {"tokens": ("dispatch_tokens_backward", "combine_tokens_backward"),
                "rows": ("dispatch_backward", "combine_backward")}
TOKENS_OPS = FORMAT_OPS["tokens"] + TRAINING_OPS["tokens"]
# The transport ops of the masked format, its quantized dispatch among them.
MASKED_OPS = (*FORMAT_OPS["masked"], QUANT_FORMAT_OPS["masked"][0])
# What an a2a namespace defines to move the tokens format in chunks, each transfer issued and
# waited apart (`ops.tokens_in_flight`; ``combine_tokens_finish`` where its returned rows are
# summed at home).
IN_FLIGHT_OPS = ("dispatch_tokens_start", "dispatch_tokens_finish", "combine_tokens_start")
# Where the gradient of an experts backend without one of its own runs.
BACKWARD_NAMESPACE = REFERENCE_NAMESPACE


@dataclasses.dataclass(frozen=True)
class Problem:
    """What a backend needs to know to say whether it runs a layer.

    Only ``dtype`` is always known; a field is ``None`` where the caller does not
    know it (`available_backends` asks about a device and dtype alone; a graph
    node knows the sizes of its own arguments). ``num_experts`` counts the
    experts of all ranks, ``num_local_experts`` those of one; ``capacity`` is
    the rows one rank receives from each rank with expert parallelism;
    ``training``: gradients flow through the layer (in a compiled graph, the
    experts op's output requires grad). ``scoring``, ``renormalize``,
    ``num_expert_groups``, ``topk_groups`` and ``correction_bias`` (whether one
    is given) are the layer's routing, as ``moe::route`` receives it; the
    problem of a ``moe::route`` call has the router logits' dtype as ``dtype``.
    """

    dtype: torch.dtype
    num_experts: int | None = None
    num_local_experts: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    top_k: int | None = None
    activation: str | None = None
    ep_size: int | None = None
    capacity: int | None = None
    max_tokens_per_rank: int | None = None
    quant: QuantSpec | None = None
    training: bool | None = None
    scoring: str | None = None
    renormalize: bool | None = None
    num_expert_groups: int | None = None
    topk_groups: int | None = None
    correction_bias: bool | None = None

    @classmethod
    def from_config(cls, cfg: MoEConfig, dtype: torch.dtype) -> Problem:
        """The problem of a layer built from ``cfg`` running in ``dtype``."""
        return cls(dtype=dtype, num_experts=cfg.num_experts,
                   num_local_experts=cfg.num_local_experts, hidden_size=cfg.hidden_size,
                   intermediate_size=cfg.intermediate_size, top_k=cfg.top_k,
                   activation=cfg.activation, ep_size=cfg.ep_size,
                   capacity=cfg.rows_per_rank if cfg.ep_size > 1 else None,
                   max_tokens_per_rank=cfg.max_tokens_per_rank, quant=cfg.quant,
                   scoring=cfg.scoring, renormalize=cfg.renormalize,
                   num_expert_groups=cfg.num_expert_groups, topk_groups=cfg.topk_groups,
                   correction_bias=cfg.correction_bias)

    def merged(self, other: Problem) -> Problem:
        """The fields either knows (this one's where both do): one layer's ops
        each see part of the problem, and every backend decides on all of it."""
        return Problem(**{f.name: other.__dict__[f.name] if self.__dict__[f.name] is None
                          else self.__dict__[f.name] for f in dataclasses.fields(self)})


SupportsFn = Callable[[BackendSpec, Problem, torch.device], str | None]


@dataclasses.dataclass(frozen=True)
class ExpertsBackend:
    """An experts backend: its concrete ops live in ``torch.ops.<namespace>``.

    ``priority`` orders the candidates of ``experts="auto"`` (highest first),
    ``training_priority`` (where given) in place of it for a training problem;
    ``dispatch_dtype`` is the dtype its rows must arrive in, ``None`` for the
    activations' own. ``quantized_rows`` names the activation formats
    (`QuantSpec.activations`) in which its ``experts_rows_quant`` reads rows that
    arrive quantized (fp8 ``x_rows`` with ``x_scale``, as ``moe::dispatch_quant``
    sends them); a backend that quantizes its rows itself names none, and gets
    them in the activation dtype (`backends.dispatch_dtype`).
    ``backward`` is ``None`` for a backend without a gradient of its own (its
    gradient runs on the reference backend); else the backend defines
    ``experts_backward`` and ``backward(spec, problem, device)`` returns ``None``
    where that op computes the gradient itself, or why it hands it to the
    reference backend's there.
    """

    name: str
    namespace: str
    supports: SupportsFn
    priority: int
    description: str
    dispatch_dtype: torch.dtype | None = None
    backward: SupportsFn | None = None
    training_priority: int | None = None
    quantized_rows: tuple[str, ...] = ()

    @property
    def formats(self) -> tuple[str, ...]:
        """The formats (`FORMATS`) whose dispatch output its ops read."""
        return tuple(f for f in FORMATS if defines(self.namespace, CONSUMER_OPS[f]))

    def why_not(self, spec: BackendSpec, problem: Problem, device: torch.device) -> str | None:
        """``supports``, after the rule every experts backend shares: quantized
        weights need the backend's quantized ops."""
        if problem.quant is not None and not defines(self.namespace, QUANT_EXPERTS_OPS[0]):
            return f"has no kernels for quantized weights ({problem.quant.name})"
        return self.supports(spec, problem, device)

    def backward_runs(self, spec: BackendSpec, problem: Problem, device: torch.device) -> str:
        """Where its gradient runs on ``problem``: ``"own"`` or ``"reference"``."""
        own = self.backward is not None and self.backward(spec, problem, device) is None
        return "own" if own else "reference"


@dataclasses.dataclass(frozen=True)
class A2ABackend:
    """An all-to-all backend; the formats it produces follow from the ops its namespace
    defines (`FORMAT_OPS`)."""

    name: str
    namespace: str
    supports: SupportsFn
    description: str
    # ``prepare(format, hidden, topk_weights, topk_ids, num_experts, ep_size, group_name,
    # max_tokens_per_rank)`` (the planned format and a dispatch's arguments, fake tensors):
    # opens the transport state a layer of those sizes needs in that format. The lowering
    # calls it when it plans the layer, on every rank alike and outside any captured region
    # (CUDA graphs, or the memory pool of their warm-up runs, which state made there would
    # outlive).
    prepare: Callable[..., None] | None = None
    # ``format_reason(format, problem)``: why this backend cannot move ``problem``'s layer in
    # ``format`` although it defines its ops (a mode of its engine that does not run the
    # shape), or None; absent where every format it defines runs every layer ``supports``.
    format_reason: Callable[[str, Problem], str | None] | None = None
    # Where its ops for layers that train live, for the formats whose ops (and their gradient
    # ops) it defines: a transport whose ops in ``namespace`` hand out its own memory, which
    # the next dispatch overwrites, copies the buffers out there. None: ``namespace`` serves
    # both.
    training_namespace: str | None = None

    @property
    def formats(self) -> tuple[str, ...]:
        """The formats (`FORMATS`, best first) its dispatch can produce."""
        return tuple(f for f in FORMATS
                     if all(defines(self.namespace, op) for op in FORMAT_OPS[f]))

    def namespace_of(self, fmt: str | None, training: bool) -> str:
        """The namespace whose ops move a layer in ``fmt`` (None: one device), ``training``
        or not."""
        trainer = self.training_namespace
        if (training and fmt in TRAINING_OPS and trainer is not None
                and all(defines(trainer, op) for op in FORMAT_OPS[fmt] + TRAINING_OPS[fmt])):
            return trainer
        return self.namespace

    def trains(self, fmt: str) -> bool:
        """Whether its transport in ``fmt`` carries gradients."""
        return fmt in TRAINING_OPS and all(defines(self.namespace_of(fmt, True), op)
                                           for op in TRAINING_OPS[fmt])

    @property
    def overlaps(self) -> bool:
        """Whether it moves the tokens format in chunks whose transfers are issued and waited
        by ops of their own (`IN_FLIGHT_OPS`), which a graph can place around compute."""
        return all(defines(self.namespace, op) for op in IN_FLIGHT_OPS)

    @property
    def sends_quantized(self) -> bool:
        """Whether it can send rows quantized to fp8 (defines ``dispatch_quant``)."""
        return defines(self.namespace, QUANT_A2A_OPS[0])

    def why_not(self, spec: BackendSpec, problem: Problem, device: torch.device) -> str | None:
        return self.supports(spec, problem, device)


@dataclasses.dataclass(frozen=True)
class RouteBackend:
    """A routing backend: its ``route`` lives in ``torch.ops.<namespace>``.

    ``priority`` orders the candidates of ``route="auto"`` (highest first);
    ``supports`` reads the routing from the `Problem` (a field it needs that is
    ``None`` rules nothing out: `available_backends` knows only the dtype).
    """

    name: str
    namespace: str
    supports: SupportsFn
    priority: int
    description: str

    def why_not(self, spec: BackendSpec, problem: Problem, device: torch.device) -> str | None:
        return self.supports(spec, problem, device)


@dataclasses.dataclass(frozen=True)
class BackendStatus:
    """One row of `BackendTable`. ``backward``: where an available experts
    backend's gradient runs (``"own"`` or ``"reference"``); ``"-"`` for an
    unavailable one, for a2a backends (whose gradients are their transport,
    reversed) and for route backends (the op contract's formula, on any of them).
    ``quantized``: the weight formats (`QuantSpec.weights`) an available experts
    backend runs with their default activations, ``"-"`` for none. ``auto``: it is
    the one ``experts="auto"`` or ``route="auto"`` picks there."""

    kind: str
    name: str
    available: bool
    reason: str
    description: str
    backward: str = "-"
    quantized: str = "-"
    auto: bool = False


class BackendTable(list):
    """`available_backends()`'s answer: a list of `BackendStatus` that prints as a
    table; ``where`` names the device and dtype it was asked about."""

    where = ""

    def __str__(self) -> str:
        header = ("kind", "name", "available", "backward", "quantized", "why not / what")
        rows = [(s.kind, s.name, "yes" if s.available else "no", s.backward, s.quantized,
                 s.description if s.available else s.reason) for s in self]
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(5)]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5]
                 for r in [header, *rows]]
        picks = " and ".join(f"{s.kind}={s.name!r}" for s in self if s.auto)
        auto = (f"experts='auto' and route='auto' take the first available of their kind, "
                f"in this order: on {self.where}, {picks}")
        return "\n".join([*lines, auto, UNSUPPORTED_FORMATS])


class Registry:
    """The backends known to this process, filled when `torch_moe_ops.backends` is imported."""

    def __init__(self) -> None:
        self.experts: dict[str, ExpertsBackend] = {}
        self.a2a: dict[str, A2ABackend] = {}
        self.route: dict[str, RouteBackend] = {}

    def register_experts(self, backend: ExpertsBackend) -> None:
        """Register ``backend``; it has a ``backward`` exactly where its namespace
        defines ``experts_backward`` (which the autograd of the experts ops calls)."""
        if (backend.backward is not None) != defines(backend.namespace, "experts_backward"):
            raise ValueError(
                f"experts backend {backend.name!r}: backward must be given exactly when "
                f"{backend.namespace}::experts_backward is defined, got backward="
                f"{backend.backward!r}")
        self.experts[backend.name] = backend

    def register_a2a(self, backend: A2ABackend) -> None:
        """Register ``backend``: its namespace defines the ops of at least one format."""
        if not backend.formats:
            raise ValueError(f"a2a backend {backend.name!r}: namespace {backend.namespace!r} "
                             "must define the ops of a format ("
                             + "; ".join(f"{f}: {', '.join(ops)}" for f, ops in FORMAT_OPS.items())
                             + "), it defines none")
        self.a2a[backend.name] = backend

    def register_route(self, backend: RouteBackend) -> None:
        self.route[backend.name] = backend

    def choose_experts(self, spec: BackendSpec, problem: Problem, device: torch.device,
                       op: str = EXPERTS_OPS[0]) -> ExpertsBackend:
        """The backend ``spec.experts`` names, or for ``"auto"`` the best one that runs here,
        among those that define ``op`` (not every backend reads every format).

        Raises ValueError naming what is registered and why the choice is out.
        """
        def rank(backend: ExpertsBackend) -> int:
            if problem.training and backend.training_priority is not None:
                return -backend.training_priority
            return -backend.priority

        # A backend that cannot run here keeps its own reason; one that can but does not
        # define ``op`` is no candidate.
        candidates = {name: backend for name, backend in self.experts.items()
                      if defines(backend.namespace, op)
                      or backend.why_not(spec, problem, device) is not None}
        if spec.experts in self.experts and spec.experts not in candidates:
            raise ValueError(f"experts backend {spec.experts!r} does not define {op}; "
                             "backends that do: " + ", ".join(
                                 name for name, backend in self.experts.items()
                                 if defines(backend.namespace, op)))
        return self._choose("experts", candidates, spec.experts, rank, spec, problem, device)

    def choose_a2a(self, spec: BackendSpec, problem: Problem, device: torch.device) -> A2ABackend:
        return self._choose("a2a", self.a2a, spec.a2a, None, spec, problem, device)

    def choose_route(self, spec: BackendSpec, problem: Problem,
                     device: torch.device) -> RouteBackend:
        """The routing backend ``spec.route`` names, or for ``"auto"`` the
        highest-priority one that runs ``problem``'s routing here (the reference
        runs every routing). Raises ValueError as `choose_experts` does."""
        return self._choose("route", self.route, spec.route, lambda backend: -backend.priority,
                            spec, problem, device)

    def _choose(self, kind: str, backends: dict, name: str, rank: Callable | None,
                spec: BackendSpec, problem: Problem, device: torch.device):
        """The backend of ``kind`` called ``name``, or for ``"auto"`` the first in
        ``rank`` order that runs ``problem`` on ``device``."""
        if name == "auto":
            for backend in sorted(backends.values(), key=rank):
                if backend.why_not(spec, problem, device) is None:
                    return backend
            raise ValueError(f"no {kind} backend runs on {device} with {problem.dtype}: "
                             + self._why_not(backends, spec, problem, device))
        backend = self._lookup(kind, backends, name)
        reason = backend.why_not(spec, problem, device)
        if reason is not None:
            raise ValueError(f"{kind} backend {name!r} is not available: {reason}; "
                             + self._available(kind, backends, spec, problem, device))
        return backend

    def status(self, device: torch.device, dtype: torch.dtype) -> BackendTable:
        """Every backend on ``device`` with ``dtype``: experts and route backends in the
        order ``"auto"`` tries them (highest priority first), the default a2a first."""
        table = BackendTable()
        default_a2a = BackendSpec().a2a
        for kind, backends in (
                ("experts", sorted(self.experts.values(), key=lambda b: -b.priority)),
                ("a2a", sorted(self.a2a.values(), key=lambda b: b.name != default_a2a)),
                ("route", sorted(self.route.values(), key=lambda b: -b.priority))):
            for backend in backends:
                # What "auto" sees (a Triton backend runs the interpreter by name only);
                # an a2a backend is always named.
                spec = BackendSpec() if kind != "a2a" else BackendSpec(a2a=backend.name)
                problem = Problem(dtype)
                reason = backend.supports(spec, problem, device)
                backward = quantized = "-"
                if kind == "experts" and reason is None:
                    backward = backend.backward_runs(spec, problem, device)
                    quantized = ",".join(
                        weights for weights in QUANT_WEIGHT_FORMATS
                        if backend.why_not(spec, Problem(dtype, quant=QuantSpec(weights)),
                                           device) is None) or "-"
                # "auto" takes the first available in this order (`_choose`).
                auto = (kind != "a2a" and reason is None
                        and not any(row.kind == kind and row.available for row in table))
                table.append(BackendStatus(kind, backend.name, reason is None, reason or "",
                                           backend.description, backward, quantized, auto))
        table.where = f"{device} with {dtype}"
        return table

    @staticmethod
    def _lookup(kind: str, backends: dict, name: str):
        if name not in backends:
            raise ValueError(f"{kind} backend {name!r} is not registered; registered: "
                             f"{', '.join(sorted(backends))}")
        return backends[name]

    @staticmethod
    def _available(kind, backends, spec, problem, device) -> str:
        names = [n for n, b in backends.items() if b.why_not(spec, problem, device) is None]
        return f"available {kind} backends on {device} with {problem.dtype}: " + (
            ", ".join(names) or "none")

    @staticmethod
    def _why_not(backends, spec, problem, device) -> str:
        return "; ".join(f"{n}: {b.why_not(spec, problem, device)}"
                         for n, b in backends.items())


REGISTRY = Registry()
