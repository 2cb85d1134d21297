"""The ``grouped_mm`` experts backend: ``torch._grouped_mm`` on rows sorted by expert.

The computation is `common.kernels.grouped_gemm` (shared with the ``triton`` backend,
which hands prefill-sized calls to it): a stable device-side sort by expert, one
grouped GEMM per projection, Triton epilogues for the bias, the activation and
the weighted gather. Its gradient is its own: grouped GEMMs on the routed rows
(`common.kernels.grouped_backward`), with Triton kernels between them. Runs without a
host sync only for bf16 on sm90+; weights are used in the canonical layout
(``w13 [E, 2I, H]``, ``w2 [E, H, I]``). The masked format (``experts_masked``) gathers the
rows below each expert's count into rows, runs them the same way, and scatters them back.

Quantized experts (``experts_quant``, ``experts_rows_quant``) are
`common.kernels.scaled_grouped_gemm`: fp8 w8a8 with rowwise scales through
``torch._scaled_grouped_mm`` (``QuantSpec("fp8_channel")`` and ``"fp8_tensor"``
with ``fp8_token`` activations, bf16, sm90), the same sort and epilogues, the
weights as stored. `supports` says why other formats do not run here.
"""

from __future__ import annotations

from torch_moe_ops.backends.common import TRITON_INSTALLED
from torch_moe_ops.backends.common.kernels import grouped_gemm, scaled_grouped_gemm
from torch_moe_ops.backends.common.kernels.launch import static_shapes_on_cuda, traced
from torch_moe_ops.backends.registry import REGISTRY, ExpertsBackend
from torch_moe_ops.ops import decompose_backend_ops, define_backend_ops

NAMESPACE = "moe_grouped_mm"


def supports(spec, problem, device) -> str | None:
    """`scaled_grouped_gemm.supports` for quantized weights, else `grouped_gemm.supports`."""
    if problem.quant is not None:
        return scaled_grouped_gemm.supports(spec, problem, device)
    return grouped_gemm.supports(spec, problem, device)


if TRITON_INSTALLED:
    KERNELS = {"experts": grouped_gemm.experts,
               "experts_rows": grouped_gemm.experts_rows,
               "experts_backward": grouped_gemm.experts_backward,
               "experts_masked": grouped_gemm.experts_masked,
               "experts_masked_backward": grouped_gemm.experts_masked_backward,
               "experts_quant": scaled_grouped_gemm.experts_quant,
               "experts_rows_quant": scaled_grouped_gemm.experts_rows_quant}
    define_backend_ops(NAMESPACE, KERNELS)
    # Compiled with fixed sizes, Inductor fuses the sort, the quantization and the
    # gathers around the GEMMs and launches the epilogues itself, in the forward
    # and in the backward.
    decompose_backend_ops(NAMESPACE, {name: traced(kernel) for name, kernel in KERNELS.items()},
                          static_shapes_on_cuda)

REGISTRY.register_experts(ExpertsBackend(
    name="grouped_mm", namespace=NAMESPACE, supports=supports,
    priority=10, description="torch._grouped_mm on rows sorted by expert (bf16, sm90+); fp8 "
                             "w8a8 rowwise through torch._scaled_grouped_mm (sm90)",
    backward=grouped_gemm.supports if TRITON_INSTALLED else None,
    # Compiled training: its forward and its gradient are traced grouped GEMMs
    # over the same sorted rows, so the joint graph sorts, gathers and projects
    # once where triton's kernels do it twice (OLMoE, T=8192, H200: 4.93 ms a
    # step against 6.43).
    training_priority=30))
