"""The ``triton`` experts backend: fused MoE kernels written in Triton.

Align (group slots by expert, padded to GEMM blocks, on the device), a grouped
GEMM of ``w13`` with the activation fused, a grouped GEMM of ``w2`` that applies
the routing weight, and a deterministic sum over the K slots of each token.
Tile sizes come from tuned JSON files (`configs`), read on the first call of a
shape. Weights are used in the canonical layout.

Runs on CUDA; on the CPU only under the Triton interpreter (``TRITON_INTERPRET=1``),
which is how the kernels' indexing is tested without a GPU.
"""

from __future__ import annotations

import os

import torch

from torch_moe_ops.backends.common import TRITON_INSTALLED
from torch_moe_ops.backends.registry import REGISTRY, ExpertsBackend
from torch_moe_ops.backends.triton.configs import KERNEL_DTYPES

NAMESPACE = "moe_triton"


def supports(spec, problem, device) -> str | None:
    if not TRITON_INSTALLED:
        return "triton is not installed (pip install triton)"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "needs a CUDA GPU (on the CPU only under TRITON_INTERPRET=1)"
    if device.type == "cpu" and spec.experts == "auto":
        return "the Triton interpreter is for tests: name experts='triton' to use it on the CPU"
    if device.type not in ("cpu", "cuda"):
        return f"needs a CUDA GPU, got device {device.type}"
    if device.type == "cuda" and not torch.cuda.is_available():
        return "needs a CUDA GPU, this torch sees none"
    if problem.dtype not in KERNEL_DTYPES:
        return f"needs float32, float16 or bfloat16, got {problem.dtype}"
    return None


if TRITON_INSTALLED:
    from torch_moe_ops.backends.common.launch import static_shapes_on_cuda, traced
    from torch_moe_ops.backends.triton.fused import fused_experts, fused_experts_rows
    from torch_moe_ops.ops import decompose_backend_ops, define_backend_ops

    define_backend_ops(NAMESPACE, {"experts": fused_experts, "experts_rows": fused_experts_rows})
    # Compiled with fixed sizes, the kernels are launched by Inductor's own code.
    decompose_backend_ops(NAMESPACE, {"experts": traced(fused_experts),
                                      "experts_rows": traced(fused_experts_rows)},
                          static_shapes_on_cuda)

REGISTRY.register_experts(ExpertsBackend(
    name="triton", namespace=NAMESPACE, layout="rows", supports=supports, priority=20,
    description="fused Triton kernels: align, GEMM + activation, GEMM + weighted sum"))
