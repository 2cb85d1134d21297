"""The compile backend object and the ``moe`` entry point."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any

import torch

from torch_moe_ops import torch_compat
from torch_moe_ops.backends.common.kernels.tracing import for_inductor
from torch_moe_ops.backends.registry import REGISTRY, Problem
from torch_moe_ops.config import QUANT_WEIGHT_FORMATS, BackendSpec, QuantSpec
from torch_moe_ops.lowering.rewrite import expert_parallel, generic_op, in_flight, lower

INNER_COMPILERS = ("inductor", "eager", "aot_eager")
# What `check_runs` tries, the device's usual dtype first (its error is the one raised).
CHECK_DTYPES = {"cuda": (torch.bfloat16, torch.float16, torch.float32),
                "cpu": (torch.float32, torch.bfloat16, torch.float16)}


def _choose_experts_for_some_format(spec: BackendSpec, problem: Problem,
                                    device: torch.device) -> None:
    """`Registry.choose_experts` for unquantized weights, else for any weight format (with its
    default activations): the model's format is not known yet, and a backend may run quantized
    layers only. Raises the unquantized problem's ValueError where none runs."""
    try:
        REGISTRY.choose_experts(spec, problem, device)
        return
    except ValueError as error:
        first = error
    for weights in QUANT_WEIGHT_FORMATS:
        quantized = dataclasses.replace(problem, quant=QuantSpec(weights))
        try:
            REGISTRY.choose_experts(spec, quantized, device, "experts_quant")
            return
        except ValueError:
            continue
    raise first


def check_runs(spec: BackendSpec, device: torch.device | str) -> None:
    """Raise the registry's ValueError where a backend ``spec`` names runs on
    ``device`` in no dtype: before compiling, instead of inside the first call.

    Only the device and the dtype are known here; the layer's shapes, routing and
    quantization are checked when the model is compiled.
    """
    device = torch.device(device)
    for kind, choose in (("experts", _choose_experts_for_some_format),
                         ("a2a", REGISTRY.choose_a2a), ("route", REGISTRY.choose_route)):
        errors = []
        for dtype in CHECK_DTYPES.get(device.type, CHECK_DTYPES["cuda"]):
            try:
                choose(spec, Problem(dtype), device)
                break
            except ValueError as error:
                errors.append(error)
        else:
            # Here, not at the top: `python -m torch_moe_ops.backends.install` imports
            # this module first, and runpy warns about a module run after its import.
            from torch_moe_ops.backends.install import install_hint

            hint = install_hint(getattr(spec, kind))
            raise ValueError(f"{errors[0]}; {hint}" if hint else str(errors[0]))


class MoECompileBackend:
    """A ``torch.compile`` backend: lowers the MoE ops per ``spec``, then runs ``inner``.

    ``mode`` and ``options`` are Inductor's (``mode="reduce-overhead"`` gives CUDA
    graphs, as it does for plain Inductor); the other inner compilers take neither.
    """

    def __init__(self, spec: BackendSpec, inner: str = "inductor", mode: str | None = None,
                 options: dict[str, Any] | None = None):
        if inner not in INNER_COMPILERS:
            raise ValueError(f"inner must be one of {', '.join(map(repr, INNER_COMPILERS))}, "
                             f"got {inner!r}")
        if inner != "inductor" and (mode is not None or options):
            raise ValueError(f"mode and options apply to inner='inductor' only, got "
                             f"inner={inner!r} with mode={mode!r}, options={options!r}")
        self.spec = spec
        self.inner = inner
        self.mode = mode
        self.options = dict(options or {})
        # The settings `_warn_of_settings_unused` has warned of (once each).
        self._warned: set[str] = set()
        if inner == "inductor":
            self._compile = torch_compat.inductor_compiler(mode, self.options)
            # Inductor's peak-memory reordering ignores the order of effectful ops
            # (seen with torch 2.13): it moved one collective past another on a rank
            # whose tokens were all elsewhere, and the ranks deadlocked. Graphs
            # that run collectives keep the program order of their ops.
            ep_options = {"reorder_for_peak_memory": False, **self.options}
            self._compile_ep = torch_compat.inductor_compiler(mode, ep_options)
            # Inductor's locality pass (inference graphs) moves each node to just before its
            # first user: a shared expert placed under a transfer (`overlap`) went back after
            # the transfer's wait, beside the sum that reads it, and nothing ran in flight.
            self._compile_in_flight = torch_compat.inductor_compiler(
                mode, {"reorder_for_locality": False, **ep_options})
        else:
            self._compile = torch_compat.lookup_backend(inner)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        # Tracing runs the ops' autograd on fake values; under activation checkpointing
        # those saves would count as the forward's, and the recomputation (which does not
        # compile) would then save fewer.
        with torch_compat.saved_tensor_hooks_off():
            return self._lower_and_compile(gm, example_inputs)

    def _lower_and_compile(self, gm: torch.fx.GraphModule, example_inputs):
        across_ranks = expert_parallel(gm)
        moe_layers = any(generic_op(node) for body in gm.modules()
                         if isinstance(body, torch.fx.GraphModule) for node in body.graph.nodes)
        try:
            lowered = lower(gm, self.spec)
        except ValueError as error:
            # The backends asked for cannot run this model: the user's error, said as such
            # (not as Dynamo's BackendCompilerFailed, which reads as a bug in torch).
            raise torch_compat.backend_error(str(error), inspect.currentframe()) from None
        self._warn_of_settings_unused(example_inputs, moe_layers and not across_ranks)
        if self.inner == "inductor":
            compile_graph = (self._compile_in_flight if in_flight(lowered)
                             else self._compile_ep if across_ranks else self._compile)
            # Some backend bodies only pay off fused (`backends.common.kernels.tracing`).
            with for_inductor():
                return compile_graph(lowered, example_inputs)
        return self._compile(lowered, example_inputs)

    def _warn_of_settings_unused(self, example_inputs, one_device_layers: bool) -> None:
        """Warn, once per setting, where a setting given to this backend does nothing for
        the graph at hand: CUDA graphs for a graph with no CUDA tensor, a transport for
        MoE layers on one device (``one_device_layers``)."""
        unused = {}
        if (self.mode == "reduce-overhead"
                and not any(isinstance(value, torch.Tensor) and value.is_cuda
                            for value in example_inputs)):
            unused["mode"] = ("mode='reduce-overhead' does nothing here: it captures CUDA graphs, "
                              "and this model runs on no CUDA device")
        if self.spec.a2a != BackendSpec().a2a and one_device_layers:
            unused["a2a"] = (f"a2a={self.spec.a2a!r} does nothing here: it moves tokens between "
                             "the ranks of MoE layers built with ep_size > 1, and this model's "
                             "MoE layers have ep_size=1")
        for setting, message in unused.items():
            if setting not in self._warned:
                self._warned.add(setting)
                warnings.warn(message, UserWarning, stacklevel=2)

    def __repr__(self) -> str:
        return (f"MoECompileBackend(experts={self.spec.experts!r}, a2a={self.spec.a2a!r}, "
                f"route={self.spec.route!r}, chunks={self.spec.chunks!r}, "
                f"overlap={self.spec.overlap!r}, "
                f"inner={self.inner!r}, mode={self.mode!r})")


def backend(experts: str = "auto", a2a: str = "none", inner: str = "inductor",
            mode: str | None = None, options: dict[str, Any] | None = None,
            dispatch_dtype: torch.dtype | None = None, route: str = "auto",
            device: torch.device | str | None = None, chunks: int | None = None,
            overlap: bool = False) -> MoECompileBackend:
    """A ``torch.compile`` backend that runs the MoE ops on the named backends.

    ``experts``: ``"auto"`` (best available for the device and dtype), or a
    registered name (`available_backends()` lists them); ``a2a``: ``"none"`` on one
    device, ``"all_to_all"`` or ``"allgather"`` for layers built with
    ``ep_size > 1``; ``dispatch_dtype``: what tokens travel in (resolved per
    layer, `torch_moe_ops.backends.dispatch_dtype`); ``route``: ``"auto"`` (the
    fastest that runs each layer's routing), or a registered name; ``chunks``: how many
    chunks an expert-parallel layer's tokens move in, so that transfers run under expert
    compute (``None`` or 1: never, as measured faster; `lowering.plan.choose_chunks`);
    ``overlap``: at prefill sizes, the work that needs no routed tokens (shared experts)
    runs while they travel (`lowering.plan.choose_in_flight`). An unregistered
    name raises ValueError here; an unavailable choice raises ValueError when the
    model is compiled, naming what is available and why the choice cannot run the
    layer, or here already where ``device`` (where the model will run) is given and
    the backend runs there in no dtype (`check_runs`).
    """
    spec = BackendSpec(experts=experts, a2a=a2a, dispatch_dtype=dispatch_dtype, route=route,
                       chunks=chunks, overlap=overlap)
    if device is not None:
        check_runs(spec, device)
    return MoECompileBackend(spec, inner, mode, options)


def moe_backend(gm: torch.fx.GraphModule, example_inputs, mode: str | None = None,
                options: dict[str, Any] | None = None):
    """``torch.compile(model, backend="moe", mode=..., options=...)``: automatic choice,
    Inductor."""
    return backend(mode=mode, options=options)(gm, example_inputs)
