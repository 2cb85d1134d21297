"""FlashInfer's autotuner for the fused-MoE kernels, run on the first call of each layer
shape.

``cutlass_fused_moe`` takes each GEMM's tactic from FlashInfer's autotuner cache, keyed by
the call's shapes with the token count mapped to a bucket; a shape it has not profiled
runs the fallback tactic (-1). Untuned, this backend ran 4-8x slower than our Triton
kernels at every width on an H200, at 11-15% of the byte or FLOP floor
(benchmarks/results/flashinfer-experts-H200-2026-11-26.md). So the first call of each
layer shape runs once more under ``flashinfer.autotuner.autotune``, which profiles the
tactics for every token bucket up to `TUNE_MAX_TOKENS` at that shape; that call and the
later ones read the tuned tactics. Layers of one shape share the profile (FlashInfer's
cache is the process's).

``TORCH_MOE_OPS_FLASHINFER_AUTOTUNE=0`` turns it off (fallback tactics, no profiling).
Profiling costs about 40 s per bf16 layer shape and minutes per MXFP4 one on an H200, in
every process: ``TORCH_MOE_OPS_FLASHINFER_TUNE_CACHE=<file.json>`` names a file that
FlashInfer's autotuner reads its tactics from before profiling (a shape found there is not
profiled again) and writes what it profiled back to (FlashInfer's ``autotune(cache=...)``;
the file is FlashInfer's format, tied to its version and the GPU).
During a CUDA-graph capture nothing is profiled: a shape first seen there runs what is
cached. The profiling allocates outside CUDA graphs' pools (`outside_graph_pools`), since
a compiled layer's first call runs inside one.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from torch_moe_ops.backends.common.weight_cache import outside_graph_pools

# Every call passes it as ``tune_max_num_tokens``: FlashInfer's token buckets, and so its
# cache keys, depend on it. Prefill chunks of up to 16384 tokens get a bucket of their own.
TUNE_MAX_TOKENS = 16384
AUTOTUNE_ENV = "TORCH_MOE_OPS_FLASHINFER_AUTOTUNE"
CACHE_ENV = "TORCH_MOE_OPS_FLASHINFER_TUNE_CACHE"

_TUNED_SHAPES: set[tuple] = set()


def enabled() -> bool:
    """Whether first calls profile (``TORCH_MOE_OPS_FLASHINFER_AUTOTUNE`` is not ``0``)."""
    return os.environ.get(AUTOTUNE_ENV, "1") != "0"


def tune_once(shape_key: tuple, device: torch.device,
              profile: Callable[[], object]) -> None:
    """Runs ``profile()`` (one ``cutlass_fused_moe`` call of the layer, into an output of
    its own) under FlashInfer's autotuner, the first time ``shape_key`` is seen here."""
    if shape_key in _TUNED_SHAPES or not enabled():
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    from flashinfer.autotuner import autotune

    def tuned_profile() -> None:
        with autotune(True, cache=os.environ.get(CACHE_ENV) or None):
            profile()

    outside_graph_pools(device, tuned_profile)
    _TUNED_SHAPES.add(shape_key)


def forget_tuned_shapes() -> None:
    """Profile each shape again on its next call (FlashInfer keeps its own cache)."""
    _TUNED_SHAPES.clear()
