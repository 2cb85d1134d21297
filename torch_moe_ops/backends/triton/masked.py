"""The masked format (`ops.masked`) on the fused MoE's tiled kernels: each expert's block of
``[E, C, H]`` is cut into GEMM blocks of BLOCK_M rows where it stands, and a block that
starts at or past its expert's count has no expert, so its programs return at once.

Legend: E experts held here, C rows per expert, H hidden size, I expert intermediate size,
M rows per GEMM block (``BLOCK_M``), X = ceil(C / M) * M positions of one expert's GEMM
blocks, B = E * ceil(C / M) blocks, P = B * M, L = E * C.

    for e, b: if b * M < count[e]:                          (otherwise: no program works)
        rows e * C + b * M + [0, M) below e * C + count[e]  -> tiled_gemms (K = 1, no weights)

Quantized weights (`fused_experts_masked_quant`) run the same kernels with their format
switches on, as `fused.fused_experts_rows_quant` does, on blocks that a dispatch quantized
(fp8 with their scales) or that are quantized here.

No sort and no align: the block table is a comparison of positions with the counts on
the device, sized by E, C and M alone, so nothing waits on the host and a call captures
in a CUDA graph. Rows past a count are neither read nor written: the output keeps there
what its allocation held, as the contract allows.
"""

from __future__ import annotations

import dataclasses

import torch

from torch_moe_ops.backends.common.kernels.launch import cdiv
from torch_moe_ops.backends.triton.configs import (
    KernelConfig,
    device_name,
    fit_block_k,
    get_config,
    least_block_n,
)
from torch_moe_ops.backends.triton.fused import (
    Experts,
    check_activation,
    check_dtype,
    first_gemm_input,
    tiled_gemms,
)
from torch_moe_ops.config import QuantSpec


def masked_blocks(count_E: torch.Tensor, rows_per_expert: int, block_m: int):
    """`align.align_rows`' three outputs for the blocks of the masked format, in place:
    ``sorted_row_ids_P`` int32 (row ``e * C + c`` where ``c < count[e]``, else the sentinel
    ``E * C``), ``block_expert_B`` int32 (``e``, or -1 for a block at or past the count) and
    ``num_padded_rows_1`` int32 (P: the kernels skip blocks by their expert)."""
    num_experts = count_E.shape[0]
    blocks_per_expert = cdiv(rows_per_expert, block_m)
    device = count_E.device
    count_E1 = count_E.unsqueeze(1)
    expert_E1 = torch.arange(num_experts, dtype=torch.int32, device=device).unsqueeze(1)
    position_X = torch.arange(blocks_per_expert * block_m, dtype=torch.int32, device=device)
    sorted_row_ids_EX = torch.where(position_X < count_E1, expert_E1 * rows_per_expert + position_X,
                                    num_experts * rows_per_expert)
    first_row_EB = position_X[::block_m]
    block_expert_EB = torch.where(first_row_EB < count_E1, expert_E1, -1)
    num_padded_rows_1 = torch.full((1,), num_experts * blocks_per_expert * block_m,
                                   dtype=torch.int32, device=device)
    return (sorted_row_ids_EX.reshape(-1).to(torch.int32),
            block_expert_EB.reshape(-1).to(torch.int32), num_padded_rows_1)


def _tiled_config(experts: Experts, x_ECH: torch.Tensor, dtype: torch.dtype) -> KernelConfig:
    """The config of C tokens of one expert each (C rows over E experts: the rows of a
    decode batch where K matches the ranks), its tiles made to suit the tiled kernels of
    the weights' format where it names another path."""
    num_experts, rows_per_expert, hidden_size = x_ECH.shape
    config = get_config(num_experts, experts.inter_size, hidden_size, dtype, rows_per_expert, 1,
                        device_name(x_ECH.device), experts.spec)
    return dataclasses.replace(config, path="tiled",
                               BLOCK_K=fit_block_k(config.BLOCK_K, experts.spec, "tiled"),
                               BLOCK_N=max(config.BLOCK_N, least_block_n(experts.spec, "tiled")))


def _run_masked(experts: Experts, x_ECH: torch.Tensor, x_scale_L: torch.Tensor | None,
                count_E: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tiled_gemms` on the blocks below the counts: ``y_ECH`` in ``dtype``."""
    num_experts, rows_per_expert, hidden_size = x_ECH.shape
    # The kernels write rows of a 2-D buffer, which the result views as blocks.
    y_LH = torch.empty((num_experts * rows_per_expert, hidden_size), dtype=dtype,
                       device=x_ECH.device)
    if y_LH.numel():
        config = _tiled_config(experts, x_ECH, dtype)
        tiled_gemms(config, experts, x_ECH.reshape(-1, hidden_size), x_scale_L, None, 1,
                    masked_blocks(count_E, rows_per_expert, config.BLOCK_M), y_LH)
    return y_LH.view(num_experts, rows_per_expert, hidden_size)


def fused_experts_masked(x_ECH: torch.Tensor, count_E: torch.Tensor, w13_EFH: torch.Tensor,
                         w2_EHI: torch.Tensor, b13_EF: torch.Tensor | None,
                         b2_EH: torch.Tensor | None, activation: str, swiglu_alpha: float,
                         swiglu_limit: float) -> torch.Tensor:
    """Each expert on the rows of its block that carry a token: ``y_ECH [E, C, H]``.

        y[e, c] = act(x[e, c] @ w13[e].T + b13[e]) @ w2[e].T + b2[e]   for c < count[e]

    Args:
        x_ECH: ``[E, C, H]`` fp16, bf16 or fp32; rows from ``count_E[e]`` on are not read.
        count_E: ``[E]`` int32, rows of each block that carry a token (<= C).
        w13_EFH, w2_EHI, b13_EF, b2_EH, activation, swiglu_alpha, swiglu_limit: as in
            `fused.fused_experts`.

    Returns ``y_ECH`` in ``x_ECH``'s dtype, contiguous; rows past a count are not written.
    The tiles are `_tiled_config`'s, always on the tiled kernels.
    """
    check_dtype("x_masked", x_ECH.dtype)
    check_activation(activation)
    experts = Experts(w13_EFH, w2_EHI, b13_EF, b2_EH, activation, swiglu_alpha, swiglu_limit)
    return _run_masked(experts, x_ECH, None, count_E, x_ECH.dtype)


def fused_experts_masked_quant(x_ECH: torch.Tensor, x_scale: torch.Tensor | None,
                               count_E: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                               w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                               b13_EF: torch.Tensor | None, b2_EH: torch.Tensor | None,
                               weight_format: str, activation_format: str,
                               block_size: list[int], activation: str, swiglu_alpha: float,
                               swiglu_limit: float,
                               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`fused_experts_masked` on quantized weights (``moe::experts_masked_quant``):
    ``y_ECH [E, C, H]``.

    ``x_ECH`` is float blocks (``x_scale`` and ``out_dtype`` None; the output has their
    dtype; with fp8 activations every row is quantized here, those past the counts too),
    or blocks a dispatch quantized: float8_e4m3fn with ``x_scale`` (``[E, C]`` for
    fp8_token, ``[E, C, H / bk]`` for fp8_group, any strides: read as ``[E * C, ...]``, a
    copy where the strides ask for one) and the output dtype ``out_dtype``. Weights as in
    `fused.fused_experts_quant`.
    """
    check_activation(activation)
    dtype = x_ECH.dtype if out_dtype is None else out_dtype
    check_dtype("x_masked" if out_dtype is None else "out_dtype", dtype)
    experts = Experts(w13, w2, b13_EF, b2_EH, activation, swiglu_alpha, swiglu_limit,
                      QuantSpec.from_op_args(weight_format, activation_format, block_size),
                      w13_scale, w2_scale)
    if x_scale is None:
        x_LH, x_scale_L = first_gemm_input(experts, x_ECH.flatten(0, 1))
        x_ECH = x_LH.view(x_ECH.shape)
    else:
        x_scale_L = x_scale.flatten(0, 1)
    return _run_masked(experts, x_ECH, x_scale_L, count_E, dtype)
