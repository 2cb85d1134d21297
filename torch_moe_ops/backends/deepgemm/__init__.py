"""The ``deepgemm`` experts backend: DeepGEMM's fp8 grouped GEMMs (DeepSeek's kernels for
DeepSeek-V3's 128 x 128 weight blocks on Hopper) with this project's sort, activation and
gather around them (`experts`).

It runs ``QuantSpec("fp8_block")`` layers (128 x 128 weight blocks, fp8_group activations)
in bf16 on sm90, once DeepGEMM is built (`library.INSTALL_HINT`): the tokens and rows
formats on its contiguous GEMM, the masked format (DeepEP's low-latency blocks, decode) on
its masked GEMM, reading blocks that arrive in fp8 as they are. Weights are read as stored
(DeepGEMM's K-major ``[E, N, K]`` with ``[E, N / 128, K / 128]`` fp32 scales is the stored
layout). Quantized layers serve inference: no gradient.
"""

from __future__ import annotations

import torch

from torch_moe_ops.backends.common import TRITON_INSTALLED
from torch_moe_ops.backends.common.kernels import grouped_gemm
from torch_moe_ops.backends.deepgemm import library
from torch_moe_ops.backends.registry import REGISTRY, ExpertsBackend
from torch_moe_ops.ops import define_backend_ops

NAMESPACE = "moe_deepgemm"
# Below this many routed rows per expert on average (one of DeepGEMM's 128-row M tiles), the
# contiguous layout's padding to whole tiles and the launches around the GEMMs cost more than
# DeepGEMM's GEMMs save (H200, 2026-11-27: DeepSeek-V3 at T=1024, 32 rows an expert: 4581 us
# against vLLM's fp8 Triton kernel's 3376; at T=4096, 128 rows: 6170 against our triton's
# 7375; Mixtral-8x7B at T=1024, 256 rows: 1100 against 1621).
MIN_ROWS_PER_EXPERT = 128


def supports(spec, problem, device) -> str | None:
    """``None`` where DeepGEMM runs ``problem`` on ``device`` without a host sync, else why
    not (the registry's ``supports`` signature; ``spec`` is not read)."""
    reason = grouped_gemm.device_reason(device, gpu="a CUDA GPU of sm90")
    if reason is not None:
        return reason
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        # sm100's DeepGEMM kernels read e8m0 scales packed four to an int: another layout.
        return f"needs sm90 (its fp32-scale kernels), got sm{major}{minor}"
    reason = library.format_reason(problem.quant) or library.missing()
    if reason is not None:
        return reason
    if problem.dtype != torch.bfloat16:
        return f"needs bfloat16 activations (DeepGEMM writes bfloat16), got {problem.dtype}"
    sizes = (problem.hidden_size, problem.intermediate_size)
    if None not in sizes and any(size % library.SCALE_BLOCK for size in sizes):
        return (f"needs hidden_size and intermediate_size divisible by {library.SCALE_BLOCK}, "
                f"got {sizes[0]} and {sizes[1]}")
    per_expert = rows_per_expert(problem)
    if per_expert is not None and per_expert < MIN_ROWS_PER_EXPERT:
        return (f"runs {per_expert:g} routed rows per expert on average, fewer than "
                f"{MIN_ROWS_PER_EXPERT}: its layout pads each expert's rows to whole 128-row "
                f"tiles, and the triton kernels are faster there")
    return None


def rows_per_expert(problem) -> float | None:
    """The rows the experts multiply (each token once per expert it is routed to: tokens
    times top-k where the op reads tokens) over the experts held here, or None where the
    count is not fixed."""
    if problem.rows is None or not problem.num_local_experts:
        return None
    return problem.rows * (problem.top_k or 1) / problem.num_local_experts


if TRITON_INSTALLED:
    from torch_moe_ops.backends.common.kernels.launch import on_first_call

    _EXPERTS = "torch_moe_ops.backends.deepgemm.experts"
    define_backend_ops(NAMESPACE, {name: on_first_call(_EXPERTS, name) for name in (
        "experts_quant", "experts_rows_quant", "experts_masked_quant")})

REGISTRY.register_experts(ExpertsBackend(
    name="deepgemm", namespace=NAMESPACE, supports=supports, priority=25,
    description="DeepGEMM's fp8 grouped GEMMs (128 x 128 weight blocks, sm90; contiguous "
                "and masked layouts)",
    quantized_rows=("fp8_group",)))
