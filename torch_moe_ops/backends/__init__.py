"""Backends: each registers concrete ops in its own namespace and a `supports` check.

Importing this package registers every backend and installs the eager kernels
of the generic ``moe::*`` ops, which forward to the default backend of the
input's device (the one ``experts="auto"``, ``a2a="none"`` resolves to).

Experts backends, highest ``auto`` priority first (each runs where its
``supports`` says; `available_backends()` prints what runs here and why not):

- ``deepgemm`` (`deepgemm`): DeepGEMM's fp8 grouped GEMMs, 128 x 128 weight blocks on sm90,
  once DeepGEMM is built (`deepgemm.library.INSTALL_HINT`).
- ``triton`` (`triton`): fused Triton kernels, CUDA.
- ``grouped_mm`` (`grouped_mm`): ``torch._grouped_mm`` with Triton epilogues, bf16 on sm90+;
  fp8 w8a8 with rowwise scales on ``torch._scaled_grouped_mm`` (sm90).
- ``flashinfer`` (`flashinfer.experts`): FlashInfer's CUTLASS fused MoE, bf16 and fp8
  128 x 128 weight blocks on sm90, once its JIT module is built (`flashinfer.cutlass_module`).
- ``cpu`` (`cpu`): the chosen experts only, on the CPU; the CPU default.
- ``reference`` (`reference`): dense plain PyTorch, any device; the correctness oracle.

The gradient of an experts op runs on the backend that ran its forward where
that backend has one (``triton`` where the ``grouped_mm`` path runs, ``grouped_mm``,
``cpu``: grouped GEMMs on the routed rows, `common.kernels.grouped_backward`), else on the
reference backend; the ``backward`` column of `available_backends()` says which. The a2a
backend ``none`` (`local`) sorts and combines rows on one device; with expert
parallelism ``all_to_all`` (`all_to_all`) and ``allgather`` (`allgather`) move
them over torch.distributed, ``deepep`` (`deepep`) over DeepEP and ``flashinfer``
(`flashinfer.a2a`) over FlashInfer's MoE all-to-all (eagerly ``all_to_all`` runs). The
compiled layer takes the first format of `registry.FORMATS` both its backends run: the
masked format (`ops.masked`: a block per local expert, read where it arrived) where the
transport's engine has it as its own decode layout (``deepep``'s low-latency mode, layers
without gradients), else the tokens format wherever the a2a backend produces it (every
experts backend reads it through ``experts``) and the layer's gradients can cross, else
rows. Routing runs on the highest-priority route backend that runs the layer's routing:
``flashinfer`` (`flashinfer.route`, FlashInfer's fused DeepSeek-V3 kernel) where its
``supports`` allows, else ``triton`` (`triton.route`, one Triton kernel, CUDA) where its
does, else ``reference``. What several
backends run (the sort by expert, activations, Triton epilogues, the grouped-GEMM
path) lives in `common`; backends never import each other.
"""

from __future__ import annotations

import torch

from torch_moe_ops import torch_compat

# Each backend registers itself on import.
from torch_moe_ops.backends import (  # noqa: F401
    all_to_all,
    allgather,
    cpu,
    deepep,
    deepgemm,
    grouped_mm,
    local,
    reference,
    triton,
)
from torch_moe_ops.backends.flashinfer import a2a as flashinfer_a2a  # noqa: F401
from torch_moe_ops.backends.flashinfer import experts as flashinfer_experts  # noqa: F401
from torch_moe_ops.backends.flashinfer import route as flashinfer_route  # noqa: F401
from torch_moe_ops.backends.problems import problem_of
from torch_moe_ops.backends.registry import (
    A2A_OPS,
    EXPERTS_OPS,
    MASKED_OPS,
    QUANT_A2A_OPS,
    QUANT_EXPERTS_OPS,
    REGISTRY,
    TOKENS_OPS,
    A2ABackend,
    BackendTable,
    EagerChoices,
    Problem,
)
from torch_moe_ops.config import BackendSpec
from torch_moe_ops.ops import CONTRACTS, GENERIC_NAMESPACE, op_overload
from torch_moe_ops.ops.experts import backward_namespace
from torch_moe_ops.ops.library import defines, implement, kernel_of

DEFAULT_SPEC = BackendSpec()
# Eagerly, expert parallelism runs on the static all-to-all: it moves only the
# rows that leave for another rank, and runs on any process group.
DEFAULT_EP_SPEC = BackendSpec(a2a="all_to_all")


def namespace_for(op_name: str, spec: BackendSpec, device: torch.device,
                  problem: Problem) -> str:
    """The namespace whose concrete op runs ``moe::<op_name>`` on ``problem`` under ``spec``.

    ``experts_backward`` runs where the gradient of the chosen experts backend's
    ops runs (`ops.experts.backward_namespace`).
    """
    if op_name in EXPERTS_OPS + QUANT_EXPERTS_OPS:
        return REGISTRY.choose_experts(spec, problem, device, op_name).namespace
    if op_name in ("experts_backward", "experts_masked_backward"):
        return backward_namespace(REGISTRY.choose_experts(spec, problem, device).namespace,
                                  op_name)
    if op_name in A2A_OPS + TOKENS_OPS + MASKED_OPS:
        return _defining(op_name, REGISTRY.choose_a2a(spec, problem, device))
    if op_name in QUANT_A2A_OPS:
        a2a = REGISTRY.choose_a2a(spec, problem, device)
        if not a2a.sends_quantized:
            raise ValueError(f"a2a backend {a2a.name!r} cannot send rows quantized to fp8 "
                             f"({a2a.namespace}::{op_name} is not defined); a2a backends that "
                             "can: " + ", ".join(name for name, b in REGISTRY.a2a.items()
                                                 if b.sends_quantized))
        return a2a.namespace
    if op_name == "route":
        return REGISTRY.choose_route(spec, problem, device).namespace
    raise ValueError(f"op_name must name a generic op ({', '.join(CONTRACTS)}), got {op_name!r}")


def _defining(op_name: str, backend: A2ABackend) -> str:
    """``backend``'s namespace, where it defines ``op_name`` (not every transport produces
    every format); else a ValueError naming those that do."""
    if defines(backend.namespace, op_name):
        return backend.namespace
    raise ValueError(f"a2a backend {backend.name!r} does not define {op_name}; a2a backends "
                     "that do: " + ", ".join(name for name, b in REGISTRY.a2a.items()
                                             if defines(b.namespace, op_name)))


def default_spec(problem: Problem) -> BackendSpec:
    """What runs eagerly: the best experts backend, and the a2a the problem needs."""
    return DEFAULT_EP_SPEC if (problem.ep_size or 1) > 1 else DEFAULT_SPEC


# Each eager call's backend, chosen once per (op, problem, device): `supports` checks are not
# run again on every call.
_EAGER_CHOICES = EagerChoices(REGISTRY, lambda op_name, problem, device: namespace_for(
    op_name, default_spec(problem), device, problem))


def _forward_to_default(op_name: str):
    def kernel(*args):
        problem = problem_of(op_name, args)
        namespace = _EAGER_CHOICES.namespace(op_name, problem, args[0].device)
        # The chosen backend's kernel itself where it has one: this runs below the
        # generic op's autograd already, and a second trip through the dispatcher
        # and torch.library's autograd wrapper cost 50-70 us per eager call.
        # Under the profiler the op runs as itself, so a trace names the backend.
        backend_kernel = kernel_of(namespace, op_name)
        if backend_kernel is None or torch_compat.profiler_enabled():
            return op_overload(namespace, op_name)(*args)
        return backend_kernel(*args)

    return kernel


def available_backends(device: torch.device | str | None = None) -> BackendTable:
    """Every registered backend, whether it runs on ``device`` (default: CUDA if
    present, else CPU) and, where it does not, why; in the order ``"auto"`` tries
    them, with the ones it picks marked (``BackendStatus.auto``). Prints as a table."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return REGISTRY.status(device, dtype)


for _name, _contract in CONTRACTS.items():
    # The concrete op checks the arguments (and, on the CPU, the ids: a host
    # pass over them): checking here as well would do it all twice.
    implement(GENERIC_NAMESPACE, _contract, _forward_to_default(_name), checked=False)
