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

Formats are declared by what a namespace defines (each `Format` names its ops): an a2a
backend produces the masked format (`ops.masked`) where it defines ``dispatch_masked`` and
``combine_masked``, the tokens format (`ops.tokens`) where it defines ``dispatch_tokens``
and ``combine_tokens`` and the rows format (`ops.rows`) where it defines ``dispatch`` and
``combine``; an experts backend consumes masked blocks through its ``experts_masked`` op,
tokens through its ``experts`` op (the receive buffers as they are, ids local) and rows
through ``experts_rows``. A format trains where the a2a namespace defines its gradient ops
too (`Format.training`; the masked format has none), or where its ``training_namespace``
defines the format's ops and their gradient ops: a transport whose buffers are its own memory hands
them out as they are to layers without gradients, and copies them out for layers that
train. The lowering picks one format per layer (`FORMATS` in order of preference), and for
a layer that trains the namespace that trains in it (`A2ABackend.namespace_of`).

``supports(spec, problem, device)`` returns ``None`` when the backend can run the
`Problem` there, otherwise the reason it cannot. The compile backend reads the
problem from each node of the graph; `available_backends` knows only the dtype.
"""

from __future__ import annotations

import collections
import dataclasses
import os
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


@dataclasses.dataclass(frozen=True)
class Format:
    """A format between dispatch and combine, named by the ops that move and read it.

    An a2a namespace produces it where it defines ``dispatch`` and ``combine``, and carries
    its gradient where it defines ``training`` too (none: it serves inference only); an
    experts namespace reads it through ``experts``, or with quantized weights through
    ``quantized_experts``. ``quantized_dispatch`` sends it in fp8 with its scales (None: it
    crosses in the activations' dtype, and a quantized layer's experts quantize it inside).
    """

    name: str
    dispatch: str
    combine: str
    experts: str
    quantized_experts: str
    quantized_dispatch: str | None = None
    training: tuple[str, ...] = ()

    @property
    def transport_ops(self) -> tuple[str, str]:
        """What an a2a namespace defines to produce it: ``(dispatch, combine)``."""
        return self.dispatch, self.combine

    @property
    def a2a_ops(self) -> tuple[str, ...]:
        """Every a2a op that moves it: dispatch and combine, their gradients, the quantized
        dispatch."""
        quantized = () if self.quantized_dispatch is None else (self.quantized_dispatch,)
        return (*self.transport_ops, *self.training, *quantized)

    def experts_op(self, quantized: bool) -> str:
        """The experts op that reads it, with quantized weights where ``quantized``."""
        return self.quantized_experts if quantized else self.experts

    def __str__(self) -> str:
        return self.name


# Per-expert blocks as DeepEP's low-latency mode delivers them (`ops.masked`), read where they
# arrived; sent in fp8 by the transport's own cast. No gradient.
MASKED = Format("masked", "dispatch_masked", "combine_masked", "experts_masked",
                "experts_masked_quant", quantized_dispatch="dispatch_masked_quant")
# Each token once per rank that holds one of its experts (`ops.tokens`): the receive buffers
# are the experts' input as they are (``experts``); a quantized layer's experts quantize
# them inside (``experts_quant``).
TOKENS = Format("tokens", "dispatch_tokens", "combine_tokens", "experts", "experts_quant",
                training=("dispatch_tokens_backward", "combine_tokens_backward"))
# One row per (token, slot), sorted by expert (`ops.rows`); sent in fp8 by ``dispatch_quant``.
ROWS = Format("rows", "dispatch", "combine", "experts_rows", "experts_rows_quant",
              quantized_dispatch="dispatch_quant",
              training=("dispatch_backward", "combine_backward"))
# The formats, best first (the wire is the cost: tokens cross once per rank that needs them).
# The masked format comes first where a transport produces it: the experts read its receive
# buffer where it is, and a transport makes it only where its engine's own layout is that
# (`A2ABackend.format_reason` says where not).
FORMATS = (MASKED, TOKENS, ROWS)
TOKENS_OPS = TOKENS.a2a_ops
MASKED_OPS = MASKED.a2a_ops
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
    ``rows``: the rows an experts op reads (tokens for ``experts``, routed rows for the
    rows and masked formats) where the call's sizes are fixed, None where symbolic.
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
    rows: int | None = None

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
    # The environment variables its ``supports`` reads (a choice made holds while they keep
    # their values: `EagerChoices`).
    environment: tuple[str, ...] = ()

    @property
    def formats(self) -> tuple[Format, ...]:
        """The formats (`FORMATS`) whose dispatch output its ops read, with unquantized or
        quantized weights (a backend may run quantized layers only)."""
        return tuple(f for f in FORMATS if defines(self.namespace, f.experts)
                     or defines(self.namespace, f.quantized_experts))

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
class TransportMode:
    """The mode of a transport's engine that moves one layer (DeepEP's ``"normal"`` or
    ``"low_latency"``), fixed when the layer is planned: ``namespace`` holds the ops that
    run that mode (the op schemas have no mode), ``reason`` says why it was taken."""

    name: str
    namespace: str
    reason: str


@dataclasses.dataclass(frozen=True)
class A2ABackend:
    """An all-to-all backend; the formats it produces follow from the ops its namespace
    defines (`Format.transport_ops`)."""

    name: str
    namespace: str
    supports: SupportsFn
    description: str
    # ``prepare(format, mode, hidden, topk_weights, topk_ids, num_experts, ep_size,
    # group_name, max_tokens_per_rank)`` (the planned `Format`, `TransportMode` or None, and a
    # dispatch's arguments, fake tensors): opens the transport state a layer of those sizes
    # needs in that format and mode. The lowering
    # calls it when it plans the layer, on every rank alike and outside any captured region
    # (CUDA graphs, or the memory pool of their warm-up runs, which state made there would
    # outlive).
    prepare: Callable[..., None] | None = None
    # ``format_reason(format, problem)``: why this backend cannot move ``problem``'s layer in
    # ``format`` although it defines its ops (a mode of its engine that does not run the
    # shape), or None; absent where every format it defines runs every layer ``supports``.
    format_reason: Callable[[Format, Problem], str | None] | None = None
    # ``mode_of(format, problem)``: the `TransportMode` its engine moves ``problem``'s layer
    # in, in a format it can move it in; absent where its engine has one mode.
    mode_of: Callable[[Format, Problem], TransportMode] | None = None
    # Where its ops for layers that train live, for the formats whose ops (and their gradient
    # ops) it defines: a transport whose ops in ``namespace`` hand out its own memory, which
    # the next dispatch overwrites, copies the buffers out there. None: ``namespace`` serves
    # both.
    training_namespace: str | None = None
    # The environment variables its ``supports`` reads (`ExpertsBackend.environment`).
    environment: tuple[str, ...] = ()

    @property
    def formats(self) -> tuple[Format, ...]:
        """The formats (`FORMATS`, best first) its dispatch can produce."""
        return tuple(f for f in FORMATS
                     if all(defines(self.namespace, op) for op in f.transport_ops))

    def namespace_of(self, fmt: Format | None, training: bool) -> str:
        """The namespace whose ops move a layer in ``fmt`` (None: one device), ``training``
        or not."""
        trainer = self.training_namespace
        if (training and fmt is not None and fmt.training and trainer is not None
                and all(defines(trainer, op) for op in fmt.transport_ops + fmt.training)):
            return trainer
        return self.namespace

    def trains(self, fmt: Format) -> bool:
        """Whether its transport in ``fmt`` carries gradients."""
        return bool(fmt.training) and all(defines(self.namespace_of(fmt, True), op)
                                          for op in fmt.training)

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
    # The environment variables its ``supports`` reads (`ExpertsBackend.environment`).
    environment: tuple[str, ...] = ()

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


class _Backends(collections.UserDict):
    """One kind's backends by name: any change to it (a registration, a backend replaced)
    calls ``changed``, so that choices made on the backends before are made again."""

    def __init__(self, backends: dict, changed: Callable[[], None]) -> None:
        self._changed = changed
        super().__init__(backends)

    def __setitem__(self, name: str, backend) -> None:
        super().__setitem__(name, backend)
        self._changed()

    def __delitem__(self, name: str) -> None:
        super().__delitem__(name)
        self._changed()


class Registry:
    """The backends known to this process, filled when `torch_moe_ops.backends` is imported.

    ``generation`` counts the changes to its backends (registrations, a backend replaced or
    removed, a kind's table replaced) and the calls of `changed`: a choice made in one
    generation holds in it (`EagerChoices`).
    """

    def __init__(self) -> None:
        self.generation = 0
        # The generation the variables of `environment` were listed in, and the variables.
        self._variables: tuple[int, tuple[str, ...]] = (-1, ())
        self.experts: dict[str, ExpertsBackend] = {}
        self.a2a: dict[str, A2ABackend] = {}
        self.route: dict[str, RouteBackend] = {}

    def __setattr__(self, name: str, value) -> None:
        if name in _KINDS:
            value = _Backends(value, self.changed)
            self.changed()
        super().__setattr__(name, value)

    def changed(self) -> None:
        """Say that what a backend's ``supports`` answers may have changed (a module it
        needs was built in this process): choices made before are made again."""
        self.generation += 1

    def environment(self) -> tuple[str | None, ...]:
        """The values of the environment variables the registered backends' ``supports``
        read (each backend's ``environment``)."""
        if self._variables[0] != self.generation:
            # Listed once per generation: every eager call of an op asks.
            self._variables = (self.generation, tuple(dict.fromkeys(
                variable for backends in (self.experts, self.a2a, self.route)
                for backend in backends.values() for variable in backend.environment)))
        return tuple(map(os.environ.get, self._variables[1]))

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
                             + "; ".join(f"{f}: {', '.join(f.transport_ops)}" for f in FORMATS)
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


# The attributes of `Registry` that hold one kind's backends each.
_KINDS = ("experts", "a2a", "route")


class EagerChoices:
    """The namespace whose op runs each eager call of a generic op, chosen once per
    ``(op_name, problem, device)`` by ``choose(op_name, problem, device)`` (a ValueError it
    raises is raised again on the next call: nothing is kept).

    What a choice reads besides its key: the registry's backends and the environment
    variables their ``supports`` read (`Registry.environment`); a change to either empties
    the cache. The machine itself (its GPUs, what is installed) is taken as fixed for the
    life of the process, as `Registry.changed` says where it is not.
    """

    def __init__(self, registry: Registry,
                 choose: Callable[[str, Problem, torch.device], str]) -> None:
        self._registry = registry
        self._choose = choose
        self._state: tuple = ()
        self._chosen: dict[tuple[str, Problem, torch.device], str] = {}

    def namespace(self, op_name: str, problem: Problem, device: torch.device) -> str:
        """``choose(op_name, problem, device)``, computed once per key and state."""
        state = (self._registry.generation, self._registry.environment())
        if state != self._state:
            self._chosen.clear()
            self._state = state
        key = (op_name, problem, device)
        namespace = self._chosen.get(key)
        if namespace is None:
            namespace = self._chosen[key] = self._choose(op_name, problem, device)
        return namespace


REGISTRY = Registry()
