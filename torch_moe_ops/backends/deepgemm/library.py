"""DeepGEMM (github.com/deepseek-ai/DeepGEMM): whether it runs here, and its two fp8 grouped
GEMMs as the ``deepgemm`` experts backend calls them.

Legend: M rows, N output columns, K the reduced dimension, G groups (experts), C rows per
group of the masked layout.

Both GEMMs compute ``d[m] = (a[m] @ b[g].T)`` with 128-column activation scales (``fp8_group``:
``a_scale [M, K / 128]``) and 128 x 128 weight block scales (``b_scale [G, N / 128, K / 128]``),
fp32 scales on sm90, bf16 out. The activation scales are best given in the layout DeepGEMM's
kernels read (`activation_scales`): given any other, each call first copies them into it with
a transpose kernel of its own. DeepGEMM compiles each kernel with nvcc on its first call (into
``$DG_JIT_CACHE_DIR``): a compiled layer must run once before CUDA-graph capture, as every
layer does in its warm-up.
"""

from __future__ import annotations

import functools
import importlib

import torch

from torch_moe_ops.backends.common import import_failure
from torch_moe_ops.config import QuantSpec

INSTALL_HINT = ("DeepGEMM is built from source: python -m torch_moe_ops.backends.install "
                "deepgemm says how")
# The block of the weight scales and the group of the activation scales DeepGEMM's sm90 fp8
# kernels read.
SCALE_BLOCK = 128
# The one format they run.
FP8_BLOCKS = QuantSpec("fp8_block", "fp8_group", (SCALE_BLOCK, SCALE_BLOCK))
# The rows of fp32 activation scales DeepGEMM's TMA loads start at multiples of: 16 bytes.
SCALE_ROW_ALIGNMENT = 16 // 4


@functools.cache
def missing() -> str | None:
    """Why ``deep_gemm`` cannot be imported here, or ``None`` where it can."""
    return import_failure("deep_gemm", f"deep_gemm is not installed ({INSTALL_HINT})")


def format_reason(quant: QuantSpec | None) -> str | None:
    """Why DeepGEMM's kernels cannot run weights and activations of ``quant`` (None for
    unquantized weights), or ``None``."""
    if quant is None:
        return (f"runs quantized weights only ({FP8_BLOCKS.name}); bf16 layers run on the "
                f"other backends")
    if quant != FP8_BLOCKS:
        return f"runs {FP8_BLOCKS.name} only (DeepGEMM's sm90 fp8 recipe), got {quant.name}"
    return None


def _deep_gemm():
    reason = missing()
    if reason is not None:
        raise RuntimeError(f"experts backend 'deepgemm' cannot run: {reason}")
    return importlib.import_module("deep_gemm")


@functools.cache
def row_alignment() -> int:
    """The rows each expert's group is padded to in the contiguous layout (DeepGEMM's
    largest M block; 128 on sm90)."""
    return int(_deep_gemm().get_mk_alignment_for_contiguous_layout())


def scale_rows(num_rows: int) -> int:
    """``num_rows`` rounded up to `SCALE_ROW_ALIGNMENT` (DeepGEMM's ``get_tma_aligned_size``
    of fp32)."""
    return -(-num_rows // SCALE_ROW_ALIGNMENT) * SCALE_ROW_ALIGNMENT


def activation_scales(num_rows: int, groups: int, device: torch.device,
                      blocks: int | None = None) -> torch.Tensor:
    """Unset fp32 activation scales in the layout DeepGEMM's sm90 GEMMs read, which they
    then take as they are (DeepGEMM's ``get_mn_major_tma_aligned_tensor`` returns them
    untransposed): M-major, each scale column ``scale_rows(M)`` apart.

    ``[M, G]`` with strides ``(1, scale_rows(M))`` (the contiguous GEMM's), or, given
    ``blocks`` B, ``[B, M, G]`` with strides ``(scale_rows(M) * G, 1, scale_rows(M))`` (the
    masked GEMM's, M = C); the padding rows are never written.
    """
    padded = scale_rows(num_rows)
    if blocks is None:
        return torch.empty((groups, padded), dtype=torch.float32, device=device).T[:num_rows]
    return torch.empty((blocks, groups, padded), dtype=torch.float32,
                       device=device).transpose(1, 2)[:, :num_rows]


def grouped_gemm_contiguous(a_MK: torch.Tensor, a_scale_MG: torch.Tensor, b_GNK: torch.Tensor,
                            b_scale: torch.Tensor, group_M: torch.Tensor) -> torch.Tensor:
    """``d_MN`` bf16: row ``m`` times the weights of group ``group_M[m]``; the rows of each
    group follow each other from a multiple of `row_alignment`, and an M block whose first
    row has group -1 is skipped (its rows are left unwritten)."""
    d_MN = torch.empty((a_MK.shape[0], b_GNK.shape[1]), dtype=torch.bfloat16,
                       device=a_MK.device)
    _deep_gemm().m_grouped_fp8_gemm_nt_contiguous((a_MK, a_scale_MG), (b_GNK, b_scale), d_MN,
                                                  group_M)
    return d_MN


def grouped_gemm_masked(a_GCK: torch.Tensor, a_scale_GCX: torch.Tensor, b_GNK: torch.Tensor,
                        b_scale: torch.Tensor, count_G: torch.Tensor, expected_rows: int
                        ) -> torch.Tensor:
    """``d_GCN`` bf16: the first ``count_G[g]`` rows of each block ``a_GCK[g]`` times the
    weights of group ``g``; rows past the count are left unwritten. ``expected_rows`` (the
    rows a group is expected to hold) picks DeepGEMM's tile sizes, not the result."""
    d_GCN = torch.empty((*a_GCK.shape[:2], b_GNK.shape[1]), dtype=torch.bfloat16,
                        device=a_GCK.device)
    _deep_gemm().m_grouped_fp8_gemm_nt_masked((a_GCK, a_scale_GCX), (b_GNK, b_scale), d_GCN,
                                              count_G, expected_rows)
    return d_GCN
