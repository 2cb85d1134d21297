"""Rows out of what a DeepEP dispatch delivered, in either mode (bf16, or DeepEP's fp8 pair).

Legend: R rows, H hidden size, A fp8 scales per row (1 for ``fp8_token``, H /
block_size[1] for ``fp8_group``).
"""

from __future__ import annotations

import torch

from torch_moe_ops import quant
from torch_moe_ops.backends.common.kernels.rows import gather_rows
from torch_moe_ops.config import QuantSpec


def received_rows(recv_x, index_R: torch.Tensor, spec: QuantSpec | None) -> tuple:
    """Rows ``index_R`` (-1: zeros) of what a DeepEP dispatch delivered (``[..., H]``
    bf16; with ``spec``, DeepEP's fp8 pair ``(values [..., H], scales [..., A])``):
    ``(x_RH,)``, or ``(x_RH fp8, x_scale)`` as ``moe::dispatch_quant`` returns them."""
    if spec is None:
        return (gather_rows(_flat(recv_x), index_R),)
    recv_x, recv_scale = recv_x
    # As bytes: float8 has no gather or fill on the CPU.
    x_RH = gather_rows(_flat(recv_x).view(torch.uint8), index_R).view(quant.FP8_DTYPE)
    scale_RA = gather_rows(_flat(recv_scale), index_R)
    return x_RH, scale_RA[:, 0] if spec.activations == "fp8_token" else scale_RA


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``[..., X]`` as ``[rows, X]`` (a copy where the layout asks for one)."""
    return t.reshape(-1, t.shape[-1])
