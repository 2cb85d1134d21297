"""The ``triton`` experts backend: fused MoE kernels written in Triton.

Align (group slots by expert, padded to GEMM blocks, on the device), a grouped
GEMM of ``w13`` with the activation fused, a grouped GEMM of ``w2`` that applies
the routing weight, and a deterministic sum over the K slots of each token.
Tile sizes come from tuned JSON files (`configs`), read on the first call of a
shape. Weights are used in the canonical layout.

The ``triton`` route backend (``moe_triton_route::route``, `route`) computes the routing
of every family without expert groups in one kernel (`route_limits` says what it takes).

The masked format (``experts_masked``, ``experts_masked_quant``: `masked`) runs the tiled
kernels on each expert's block where it stands, skipping the blocks past its count.

The gradient (`experts_backward`, ``experts_masked_backward``) is the ``grouped_mm`` path's
(`common.kernels.grouped_gemm`: grouped GEMMs on the routed rows) where that runs
without a host sync (`grouped_gemm.supports`: bf16 on sm90+, H and I multiples
of 8), else the reference backend's, called as ``moe_reference::experts_backward``.

Quantized weights (``experts_quant``, ``experts_rows_quant``): fp8 per tensor,
per channel and per block with fp8 activations (w8a8) or without (W8A16), and
MXFP4 W4A16, on the same kernels (`fused`); `supports` says which formats run
where. They have no gradient (the op contract raises).

Runs on CUDA; on the CPU only under the Triton interpreter (``TRITON_INTERPRET=1``),
which is how the kernels' indexing is tested without a GPU.
"""

from __future__ import annotations

import functools
import os

import torch

from torch_moe_ops.backends.common import TRITON_INSTALLED
from torch_moe_ops.backends.problems import problem_of
from torch_moe_ops.backends.registry import REGISTRY, ExpertsBackend, Problem, RouteBackend
from torch_moe_ops.backends.triton import mxfp4_fragments, route_limits
from torch_moe_ops.backends.triton.configs import KERNEL_DTYPES, block_k_limits
from torch_moe_ops.config import QuantSpec
from torch_moe_ops.ops.library import REFERENCE_NAMESPACE, op_overload

NAMESPACE = "moe_triton"
ROUTE_NAMESPACE = "moe_triton_route"
# What `_device_reason` reads: on the CPU, Triton's kernels run under its interpreter only.
INTERPRETER_ENV = ("TRITON_INTERPRET",)
# fp8 (e4m3) conversions and tl.dot: Ada and newer.
FP8_MIN_CAPABILITY = (8, 9)


def _why_not_quant(quant: QuantSpec, device) -> str | None:
    """Why quantized weights of ``quant`` cannot run on ``device``, or None."""
    if quant.weights.startswith("fp8") and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CAPABILITY:
            return (f"{quant.name} needs float8 support, sm89 or newer, got "
                    f"sm{capability[0]}{capability[1]}")
    if quant.weights == "fp8_block":
        # A K tile of the tiled kernels lies inside one scale block.
        least, _ = block_k_limits(quant, "tiled")
        columns = quant.block_size[1]
        if columns & -columns < least:
            return (f"{quant.name} needs block columns (block_size[1]) divisible by {least}, "
                    f"got {columns}")
    return None


def _device_reason(device, kind: str, named: bool) -> str | None:
    """Why Triton kernels cannot run on ``device``, or None; on the CPU only under the
    interpreter, and only for a backend the spec names (``kind='triton'``)."""
    if not TRITON_INSTALLED:
        return "triton is not installed (pip install triton)"
    if device.type == "cpu" and os.environ.get(INTERPRETER_ENV[0]) != "1":
        return "needs a CUDA GPU (on the CPU only under TRITON_INTERPRET=1)"
    if device.type == "cpu" and not named:
        return f"the Triton interpreter is for tests: name {kind}='triton' to use it on the CPU"
    if device.type not in ("cpu", "cuda"):
        return f"needs a CUDA GPU, got device {device.type}"
    if device.type == "cuda" and not torch.cuda.is_available():
        return "needs a CUDA GPU, this torch sees none"
    return None


def route_supports(spec, problem, device) -> str | None:
    """The route backend's `supports`: the device first, then the routing's limits (where
    the kernels cannot run at all, that is the reason for every layer, as
    `available_backends` gives it)."""
    return (_device_reason(device, "route", spec is not None and spec.route == "triton")
            or route_limits.limits(problem))


def supports(spec, problem, device) -> str | None:
    reason = _device_reason(device, "experts", spec.experts != "auto")
    if reason is not None:
        return reason
    if problem.dtype not in KERNEL_DTYPES:
        return f"needs float32, float16 or bfloat16, got {problem.dtype}"
    if problem.quant is not None:
        return _why_not_quant(problem.quant, device)
    return None


if TRITON_INSTALLED:
    from torch_moe_ops.backends.common.kernels import grouped_gemm
    from torch_moe_ops.backends.common.kernels.launch import (
        on_first_call,
        static_shapes_on_cuda,
        traced,
    )
    from torch_moe_ops.ops import argument_index, decompose_backend_ops, define_backend_ops

    fused_experts, fused_experts_rows, fused_experts_quant, fused_experts_rows_quant = (
        on_first_call("torch_moe_ops.backends.triton.fused", name) for name in (
            "fused_experts", "fused_experts_rows", "fused_experts_quant",
            "fused_experts_rows_quant"))
    fused_experts_masked, fused_experts_masked_quant = (
        on_first_call("torch_moe_ops.backends.triton.masked", name)
        for name in ("fused_experts_masked", "fused_experts_masked_quant"))

    def _grouped_runs(x, w13_EFH) -> bool:
        problem = Problem(x.dtype, hidden_size=w13_EFH.shape[2],
                          intermediate_size=w13_EFH.shape[1] // 2)
        return grouped_gemm.supports(None, problem, x.device) is None

    def _grouped_backward_runs(grad_out_TH, hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH,
                               *_) -> bool:
        return _grouped_runs(hidden_TH, w13_EFH)

    def _grouped_masked_backward_runs(grad_out_ECH, x_ECH, count_E, w13_EFH, *_) -> bool:
        return _grouped_runs(x_ECH, w13_EFH)

    def experts_backward(*args):
        """``moe::experts_backward`` (schema order): `grouped_gemm.experts_backward`
        where `grouped_gemm.supports` holds, else the reference backend's op."""
        if _grouped_backward_runs(*args):
            return grouped_gemm.experts_backward(*args)
        return op_overload(REFERENCE_NAMESPACE, "experts_backward")(*args)

    def experts_masked_backward(*args):
        """``moe::experts_masked_backward`` (schema order): as `experts_backward`, with
        `grouped_gemm.experts_masked_backward`."""
        if _grouped_masked_backward_runs(*args):
            return grouped_gemm.experts_masked_backward(*args)
        return op_overload(REFERENCE_NAMESPACE, "experts_masked_backward")(*args)

    def _traced_unless_mxfp4(weight_format_at: int, *args) -> bool:
        """`static_shapes_on_cuda`, and weights other than MXFP4 (``args[weight_format_at]``
        names their format) unless the kernels read MXFP4 as stored."""
        return static_shapes_on_cuda(*args) and (args[weight_format_at] != "mxfp4"
                                                 or not mxfp4_fragments.enabled())

    run_route = on_first_call("torch_moe_ops.backends.triton.route", "route")

    def route(*args):
        """``moe::route`` (schema order) on the kernel; a routing it cannot compute raises."""
        reason = route_limits.limits(problem_of("route", args))
        if reason is not None:
            raise ValueError(f"the triton route backend cannot run this routing: {reason}")
        return run_route(*args)

    define_backend_ops(ROUTE_NAMESPACE, {"route": route})
    decompose_backend_ops(ROUTE_NAMESPACE, {"route": traced(route)}, static_shapes_on_cuda)
    define_backend_ops(NAMESPACE, {"experts": fused_experts, "experts_rows": fused_experts_rows,
                                   "experts_backward": experts_backward,
                                   "experts_quant": fused_experts_quant,
                                   "experts_rows_quant": fused_experts_rows_quant,
                                   "experts_masked": fused_experts_masked,
                                   "experts_masked_backward": experts_masked_backward,
                                   "experts_masked_quant": fused_experts_masked_quant})
    # Compiled with fixed sizes, the kernels are launched by Inductor's own code.
    decompose_backend_ops(NAMESPACE, {"experts": traced(fused_experts),
                                      "experts_rows": traced(fused_experts_rows),
                                      "experts_masked": traced(fused_experts_masked)},
                          static_shapes_on_cuda)
    # MXFP4 layers stay one node: their kernels read fragments (`mxfp4_fragments`) prepared
    # from the weights' values on the layer's first call, which a traced body, with no values,
    # cannot make. The op then launches its kernels from Python at run time (CUDA graphs
    # capture it as they capture any op).
    for name, body in (("experts_quant", fused_experts_quant),
                       ("experts_rows_quant", fused_experts_rows_quant),
                       ("experts_masked_quant", fused_experts_masked_quant)):
        decompose_backend_ops(NAMESPACE, {name: traced(body)}, functools.partial(
            _traced_unless_mxfp4, argument_index(NAMESPACE, name, "weight_format")))
    decompose_backend_ops(NAMESPACE, {"experts_backward": traced(grouped_gemm.experts_backward)},
                          lambda *args: static_shapes_on_cuda(*args)
                          and _grouped_backward_runs(*args))
    decompose_backend_ops(NAMESPACE, {"experts_masked_backward":
                                      traced(grouped_gemm.experts_masked_backward)},
                          lambda *args: static_shapes_on_cuda(*args)
                          and _grouped_masked_backward_runs(*args))

REGISTRY.register_experts(ExpertsBackend(
    name="triton", namespace=NAMESPACE, supports=supports, priority=20,
    description="fused Triton kernels: align, GEMM + activation, GEMM + weighted sum",
    backward=grouped_gemm.supports if TRITON_INSTALLED else None,
    # Its experts_rows_quant reads rows that dispatch quantized (x_scale): fp8 dispatch.
    quantized_rows=("fp8_token", "fp8_group"), environment=INTERPRETER_ENV))
REGISTRY.register_route(RouteBackend(
    name="triton", namespace=ROUTE_NAMESPACE, supports=route_supports, priority=5,
    environment=INTERPRETER_ENV,
    description=(f"one Triton kernel: softmax, sigmoid or topk_softmax scores (+ correction "
                 f"bias), no expert groups, <= {route_limits.MAX_EXPERTS} experts, top_k <= "
                 f"{route_limits.MAX_TOP_K}")))
