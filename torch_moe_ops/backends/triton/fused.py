"""The fused MoE on Triton: align, gate-up GEMM with activation, down GEMM with
routing weight, sum over experts; or, for a few tokens, GEMM kernels that
take each slot on its own (`direct_kernels`), no align, then the same sum.

Legend: T tokens, H hidden size, I expert intermediate size, F = 2 * I, E experts,
K experts per token, S = T * K slots, R rows (rows format).

    for t, k: if topk_ids[t, k] >= 0:
        e = topk_ids[t, k]
        out[t] += topk_weights[t, k] * (act(hidden[t] @ w13[e].T + b13[e]) @ w2[e].T + b2[e])

The config of a call (`configs.get_config`) names its kernels: ``direct``,
``tiled`` (`kernels`) or ``grouped_mm`` (`common.kernels.grouped_gemm`, which the
``grouped_mm`` backend runs too).

Quantized weights (`fused_experts_quant`, `fused_experts_rows_quant`; formats
in `torch_moe_ops.quant`) run the same kernels with their format switches on
(`quant_tiles`): with fp8 activations the hidden rows are quantized once per
token (not per slot) and the intermediate rows once after the activation
(`act_quant`), and each GEMM multiplies fp8 by fp8; weight-only formats
(W8A16, MXFP4 W4A16) are dequantized tile by tile in the kernels and meet
the activations in their own dtype. With bf16 activations and tiles of whole
64 x 64 blocks the MXFP4 GEMMs read fragments (`mxfp4_fragments`, prepared on
a layer's first call and kept); no path decodes a whole layer.
Every entry point runs `_run_direct` or `_run_tiled`: the rows format is the
K = 1 case without routing weights. Nothing here reads a tensor's values on the
host but the preparation of a layer's fragments (its largest scale, once), so a
call can be captured in a CUDA graph once its config is cached (see `configs`)
and its fragments made.
Arguments are expected to have passed the op contract's checks
(`torch_moe_ops.ops.experts.check`); only what the kernels themselves rely on
is checked again here.
"""

from __future__ import annotations

import dataclasses

import torch

from torch_moe_ops.backends.common.kernels import grouped_gemm
from torch_moe_ops.backends.common.kernels.act_quant import quantize_rows
from torch_moe_ops.backends.common.kernels.align import align_rows
from torch_moe_ops.backends.common.kernels.launch import cdiv, launcher
from torch_moe_ops.backends.common.kernels.triton_activation import ACTIVATION_CODES
from torch_moe_ops.backends.registry import Problem
from torch_moe_ops.backends.triton import mxfp4_fragments
from torch_moe_ops.backends.triton.configs import (
    KERNEL_DTYPES,
    KernelConfig,
    device_name,
    dtype_name,
    get_config,
)
from torch_moe_ops.backends.triton.direct_kernels import (
    moe_direct_activate_kernel,
    moe_direct_down_kernel,
    moe_direct_gate_up_kernel,
)
from torch_moe_ops.backends.triton.kernels import (
    moe_down_weighted_kernel,
    moe_gate_up_act_kernel,
    moe_sum_over_topk_kernel,
)
from torch_moe_ops.backends.triton.quant_tiles import INTERPRETED, format_codes
from torch_moe_ops.config import QuantSpec

# Columns per program of the sum over experts, and of the activation of K parts' sums.
SUM_BLOCK_H = 256
ACTIVATE_BLOCK_N = 256


@dataclasses.dataclass(frozen=True)
class Experts:
    """The expert weights of a call and their activation, as the kernels read them.

    ``w13``: ``[E, 2*I, H]`` gate rows then up rows, ``w2``: ``[E, H, I]``, in the
    activations' dtype; or quantized as ``spec`` says (`torch_moe_ops.quant`:
    packed ``[E, N, K / 2]`` for mxfp4) with ``w13_scale`` and ``w2_scale``.
    ``b13``: ``[E, 2*I]`` or None, ``b2``: ``[E, H]`` or None, in the output dtype.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    b13: torch.Tensor | None
    b2: torch.Tensor | None
    activation: str
    swiglu_alpha: float
    swiglu_limit: float
    spec: QuantSpec | None = None
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def inter_size(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def quantized_activations(self) -> bool:
        """Whether each GEMM reads fp8 activation rows (w8a8)."""
        return self.spec is not None and self.spec.activations != "none"

    def scale_args(self, x_scale: torch.Tensor | None, w_scale: torch.Tensor | None,
                   filler: torch.Tensor) -> tuple:
        """One GEMM launch's scale pointers and strides: the activation rows'
        (``[M]`` or ``[M, G]``) and the weights'; ``filler`` stands in for an
        absent one, which the kernel never reads."""
        return (*_padded_strides(x_scale, 2, filler), *_padded_strides(w_scale, 3, filler))

    def kernel_constants(self) -> dict:
        return format_codes(self.spec)


def _padded_strides(t: torch.Tensor | None, ndim: int, filler: torch.Tensor) -> tuple:
    """``(t, *t.stride())`` with zero strides for the dimensions ``t`` lacks (a
    per-row or per-tensor scale read as a table with one column)."""
    if t is None:
        return (filler, *(0,) * ndim)
    return (t, *t.stride(), *(0,) * (ndim - t.dim()))


def _plan(x_TH: torch.Tensor, ids_TK: torch.Tensor, w13: torch.Tensor,
          spec: QuantSpec | None = None, dtype: torch.dtype | None = None) -> KernelConfig:
    """The config of this call (activations ``x_TH``, output ``dtype``, by default
    ``x_TH``'s), its path resolved to one that can run here. It depends on sizes
    only, so a CUDA graph captured at one size replays the same kernels."""
    dtype = x_TH.dtype if dtype is None else dtype
    num_experts, inter_size, hidden_size = w13.shape[0], w13.shape[1] // 2, x_TH.shape[1]
    config = get_config(num_experts, inter_size, hidden_size, dtype, ids_TK.shape[0],
                        ids_TK.shape[1], device_name(x_TH.device), spec)
    # The grouped path needs unquantized weights, and torch._grouped_mm without a host sync.
    if config.path == "grouped_mm" and not (
            spec is None and grouped_gemm.supports(None, Problem(dtype), x_TH.device) is None
            and grouped_gemm.aligned(hidden_size, inter_size)):
        config = dataclasses.replace(config, path="tiled")
    return config


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs follow torch's matmul setting, as torch.matmul would.
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def check_dtype(name: str, dtype: torch.dtype) -> None:
    # The op contract admits float64 (the reference computes in it); these kernels do not.
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"{name} must have dtype in "
                         f"({', '.join(map(dtype_name, KERNEL_DTYPES))}) on the triton "
                         f"experts backend, got {dtype_name(dtype)}")


def check_activation(activation: str) -> None:
    if activation not in ACTIVATION_CODES:
        raise ValueError(f"activation must be one of {', '.join(map(repr, ACTIVATION_CODES))}, "
                         f"got {activation!r}")


def _second_gemm_input(experts: Experts, inter_SI: torch.Tensor):
    """What the down GEMM reads of the intermediate rows: themselves, or fp8 rows and scales."""
    if experts.quantized_activations:
        return quantize_rows(inter_SI, experts.spec)
    return inter_SI, None


def _run_direct(config: KernelConfig, experts: Experts, x_TH: torch.Tensor,
                x_scale: torch.Tensor | None, weights_S: torch.Tensor | None,
                ids_TK: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    num_tokens, hidden_size = x_TH.shape
    top_k = ids_TK.shape[1]
    inter_size = experts.inter_size
    device = x_TH.device
    (w13, w13_scale), (w2, w2_scale), fragments = _gemm_weights(config, experts, x_TH.dtype)
    tiles = dict(BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K, num_warps=config.num_warps,
                 num_stages=config.num_stages, MXFP4_FRAGMENTS=fragments,
                 **experts.kernel_constants())

    num_slots = num_tokens * top_k
    inter_SI = torch.empty((num_slots, inter_size), dtype=dtype, device=device)
    # An absent bias or weight is never read (HAS_BIAS / HAS_WEIGHTS False):
    # any tensor fills its slot.
    b13 = experts.b13 if experts.b13 is not None else experts.w13
    activation = dict(TOP_K=top_k, ACTIVATION=ACTIVATION_CODES[experts.activation],
                      HAS_BIAS=experts.b13 is not None)
    swiglu = (float(experts.swiglu_alpha), float(experts.swiglu_limit))
    up_split, up_parts = _k_parts(hidden_size, config)
    # Parts of K sum into fp32 rows of their own, which one more launch adds up and
    # activates; one part writes the activated rows.
    part_PSF = None if up_parts == 1 else torch.empty(
        (up_parts, num_slots, 2 * inter_size), dtype=torch.float32, device=device)
    gate_up_out = (inter_SI, 0, *inter_SI.stride()) if part_PSF is None else (
        part_PSF, *part_PSF.stride())
    launcher(moe_direct_gate_up_kernel)[(num_slots, cdiv(inter_size, config.BLOCK_N), up_parts)](
        x_TH, ids_TK, w13, b13, gate_up_out[0], hidden_size, inter_size, up_split,
        x_TH.stride(0), x_TH.stride(1), ids_TK.stride(0), ids_TK.stride(1),
        w13.stride(0), w13.stride(1), w13.stride(2),
        b13.stride(0), b13.stride(1), *gate_up_out[1:], *swiglu,
        *experts.scale_args(x_scale, w13_scale, w13), SPLIT_K=up_parts, **activation, **tiles)
    if part_PSF is not None:
        launcher(moe_direct_activate_kernel)[(num_slots, cdiv(inter_size, ACTIVATE_BLOCK_N))](
            part_PSF, ids_TK, b13, inter_SI, inter_size, *part_PSF.stride(),
            ids_TK.stride(0), ids_TK.stride(1), b13.stride(0), b13.stride(1),
            inter_SI.stride(0), inter_SI.stride(1), *swiglu, SPLIT_K=up_parts,
            BLOCK_N=ACTIVATE_BLOCK_N, **activation)

    inter_SI, inter_scale = _second_gemm_input(experts, inter_SI)
    out_TH = torch.empty((num_tokens, hidden_size), dtype=dtype, device=device)
    down_split, down_parts = _k_parts(inter_size, config)
    # The slots' rows (each part's, with parts of K) stay in fp32 until their sum is
    # rounded once, as the reference rounds; with one expert per token and one part they
    # are the output rows.
    slot_SH = out_TH if top_k == 1 and down_parts == 1 else torch.empty(
        (num_slots * down_parts, hidden_size), dtype=torch.float32, device=device)
    # Absent inputs are never read: unmutated tensors fill their slots (an output
    # there would look to torch.compile like another use of the buffer written).
    b2 = experts.b2 if experts.b2 is not None else experts.w2[:, :, 0]
    weights = weights_S if weights_S is not None else inter_SI
    launcher(moe_direct_down_kernel)[(num_slots, cdiv(hidden_size, config.BLOCK_N), down_parts)](
        inter_SI, ids_TK, weights, w2, b2, slot_SH, hidden_size, inter_size, down_split,
        inter_SI.stride(0), inter_SI.stride(1), ids_TK.stride(0), ids_TK.stride(1),
        w2.stride(0), w2.stride(1), w2.stride(2),
        b2.stride(0), b2.stride(1),
        slot_SH.stride(0), slot_SH.stride(1),
        *experts.scale_args(inter_scale, w2_scale, w2),
        TOP_K=top_k, HAS_BIAS=experts.b2 is not None, HAS_WEIGHTS=weights_S is not None,
        SPLIT_K=down_parts, **tiles)
    _sum_over_topk(slot_SH, ids_TK, out_TH, down_parts)
    return out_TH


def _k_parts(k_size: int, config: KernelConfig) -> tuple[int, int]:
    """``(columns per part, parts)``: ``k_size`` cut into at most ``config.SPLIT_K``
    parts of whole K tiles, none empty."""
    split = cdiv(cdiv(k_size, config.SPLIT_K), config.BLOCK_K) * config.BLOCK_K
    return split, max(cdiv(k_size, split), 1)


def _sum_over_topk(slot_SH: torch.Tensor, ids_TK: torch.Tensor, out_TH: torch.Tensor,
                   parts: int = 1) -> None:
    """``out_TH[t]`` = the sum of ``slot_SH[t * K + k]`` over the slots not skipped
    (of its ``parts`` rows, ``slot_SH[(t * K + k) * parts + p]``, in order); where
    ``slot_SH`` is ``out_TH`` (K == 1, one part) only skipped rows are written (zeros)."""
    num_tokens, hidden_size = out_TH.shape
    top_k = ids_TK.shape[1]
    launcher(moe_sum_over_topk_kernel)[(num_tokens, cdiv(hidden_size, SUM_BLOCK_H))](
        slot_SH, ids_TK, out_TH, hidden_size,
        slot_SH.stride(0), ids_TK.stride(0), ids_TK.stride(1), out_TH.stride(0),
        TOP_K=top_k, PARTS=parts, SLOTS_ARE_OUT=slot_SH is out_TH, BLOCK_H=SUM_BLOCK_H)


def _run_tiled(config: KernelConfig, experts: Experts, x_TH: torch.Tensor,
               x_scale: torch.Tensor | None, weights_S: torch.Tensor | None,
               ids_TK: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    num_tokens, hidden_size = x_TH.shape
    top_k = ids_TK.shape[1]
    blocks = align_rows(ids_TK, experts.num_experts, config.BLOCK_M)
    out_TH = torch.empty((num_tokens, hidden_size), dtype=dtype, device=x_TH.device)
    # With one expert per token the per-slot rows are the output rows: the down
    # GEMM writes them in place and the last kernel only zeroes skipped rows.
    slot_SH = out_TH if top_k == 1 else torch.empty((num_tokens * top_k, hidden_size),
                                                    dtype=dtype, device=x_TH.device)
    tiled_gemms(config, experts, x_TH, x_scale, weights_S, top_k, blocks, slot_SH)
    _sum_over_topk(slot_SH, ids_TK, out_TH)
    return out_TH


def tiled_gemms(config: KernelConfig, experts: Experts, x_TH: torch.Tensor,
                x_scale: torch.Tensor | None, weights_S: torch.Tensor | None, top_k: int,
                blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                slot_SH: torch.Tensor) -> None:
    """The two grouped GEMMs over the blocks of ``blocks`` (``sorted_row_ids_P``,
    ``block_expert_B``, ``num_padded_rows_1``, as `align.align_rows` returns them):

        slot[s] = weight[s] * (act(x[s // K] @ w13[e].T + b13[e]) @ w2[e].T + b2[e])

    for each slot ``s`` a block of expert ``e`` lists, written into ``slot_SH [S, H]``
    (in the output dtype); rows no block lists are not written.
    """
    hidden_size = x_TH.shape[1]
    num_slots = slot_SH.shape[0]
    inter_size = experts.inter_size
    sorted_row_ids_P, block_expert_B, num_padded_rows_1 = blocks
    num_blocks_m = block_expert_B.shape[0]
    dtype = slot_SH.dtype
    precision = _dot_precision(dtype)
    tiles = dict(BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K,
                 GROUP_M=config.GROUP_M, num_warps=config.num_warps,
                 num_stages=config.num_stages, **experts.kernel_constants())

    inter_SI = torch.empty((num_slots, inter_size), dtype=dtype, device=x_TH.device)
    # An absent bias is never read (HAS_BIAS=False): any tensor fills its slot.
    b13 = experts.b13 if experts.b13 is not None else experts.w13
    (w13, w13_scale), (w2, w2_scale), fragments = _gemm_weights(config, experts, x_TH.dtype)
    tiles["MXFP4_FRAGMENTS"] = fragments
    launcher(moe_gate_up_act_kernel)[(num_blocks_m * cdiv(inter_size, config.BLOCK_N),)](
        x_TH, w13, b13, inter_SI, sorted_row_ids_P, block_expert_B, num_padded_rows_1,
        num_slots, num_blocks_m, hidden_size, inter_size,
        x_TH.stride(0), x_TH.stride(1),
        w13.stride(0), w13.stride(1), w13.stride(2),
        b13.stride(0), b13.stride(1),
        inter_SI.stride(0), inter_SI.stride(1),
        float(experts.swiglu_alpha), float(experts.swiglu_limit),
        *experts.scale_args(x_scale, w13_scale, w13),
        TOP_K=top_k, ACTIVATION=ACTIVATION_CODES[experts.activation],
        HAS_BIAS=experts.b13 is not None, DOT_PRECISION=precision, **tiles)

    inter_SI, inter_scale = _second_gemm_input(experts, inter_SI)
    b2 = experts.b2 if experts.b2 is not None else experts.w2[:, :, 0]
    weights = weights_S if weights_S is not None else inter_SI
    launcher(moe_down_weighted_kernel)[(num_blocks_m * cdiv(hidden_size, config.BLOCK_N),)](
        inter_SI, w2, b2, weights, slot_SH,
        sorted_row_ids_P, block_expert_B, num_padded_rows_1,
        num_slots, num_blocks_m, hidden_size, inter_size,
        inter_SI.stride(0), inter_SI.stride(1),
        w2.stride(0), w2.stride(1), w2.stride(2),
        b2.stride(0), b2.stride(1),
        slot_SH.stride(0), slot_SH.stride(1),
        *experts.scale_args(inter_scale, w2_scale, w2),
        HAS_BIAS=experts.b2 is not None, HAS_WEIGHTS=weights_S is not None,
        DOT_PRECISION=precision, **tiles)


def _gemm_weights(config: KernelConfig, experts: Experts, dtype: torch.dtype
                   ) -> tuple[tuple, tuple, bool]:
    """``((w13, w13_scale), (w2, w2_scale), fragments)``: what the GEMM kernels read, the
    MXFP4 fragments (`mxfp4_fragments`) where they run (enabled, bf16 activations, tiles of
    whole 64 x 64 blocks, weights the layout holds, memory to spare), else the weights as
    stored. Under Triton's interpreter, which mishandles bf16, the fragments run for every
    float dtype (decoded in Triton arithmetic), so that the CPU tests check their layout."""
    stored = (experts.w13, experts.w13_scale), (experts.w2, experts.w2_scale), False
    if (experts.spec is None or experts.spec.weights != "mxfp4" or not mxfp4_fragments.enabled()
            or (dtype != torch.bfloat16 and not INTERPRETED.value)
            or config.BLOCK_N % mxfp4_fragments.BLOCK_ROWS
            or config.BLOCK_K % mxfp4_fragments.BLOCK_COLS):
        return stored
    pair = mxfp4_fragments.layer_fragments(experts.w13, experts.w13_scale, experts.w2,
                                           experts.w2_scale)
    return stored if pair is None else (*pair, True)


_RUNNERS = {"direct": _run_direct, "tiled": _run_tiled}


def fused_experts(hidden_TH: torch.Tensor, topk_weights_TK: torch.Tensor,
                  topk_ids_TK: torch.Tensor, w13_EFH: torch.Tensor, w2_EHI: torch.Tensor,
                  b13_EF: torch.Tensor | None, b2_EH: torch.Tensor | None,
                  activation: str, swiglu_alpha: float, swiglu_limit: float) -> torch.Tensor:
    """Every token through its top-k experts, weighted and summed: ``out_TH [T, H]``.

    Args:
        hidden_TH: ``[T, H]`` fp16, bf16 or fp32; any strides.
        topk_weights_TK: ``[T, K]`` any float dtype, read as fp32.
        topk_ids_TK: ``[T, K]`` int32 or int64; -1 skips the slot (no GEMM rows).
        w13_EFH: ``[E, 2*I, H]`` gate rows then up rows; ``w2_EHI``: ``[E, H, I]``.
        b13_EF: ``[E, 2*I]`` or None; ``b2_EH``: ``[E, H]`` or None.
        activation: ``"silu"``, ``"gelu"`` (erf) or ``"swiglu_oai"`` (uses
            ``swiglu_alpha`` and ``swiglu_limit``).

    Returns ``out_TH [T, H]`` in ``hidden_TH``'s dtype, contiguous; a token whose
    slots are all skipped gets zeros. Deterministic: no float atomics, the sum
    over k runs in a fixed order in fp32. ``T == 0`` launches nothing.

    Where the config says so (prefill, bf16 on sm90+), the two GEMMs run on
    ``torch._grouped_mm`` with Triton epilogues instead (`common.kernels.grouped_gemm`).
    """
    check_dtype("hidden", hidden_TH.dtype)
    check_activation(activation)
    if topk_ids_TK.shape[0] == 0:
        return torch.empty((0, hidden_TH.shape[1]), dtype=hidden_TH.dtype,
                           device=hidden_TH.device)
    return experts_with_config(_plan(hidden_TH, topk_ids_TK, w13_EFH), hidden_TH,
                               topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI, b13_EF, b2_EH,
                               activation, swiglu_alpha, swiglu_limit)


def experts_with_config(config: KernelConfig, hidden_TH: torch.Tensor,
                        topk_weights_TK: torch.Tensor, topk_ids_TK: torch.Tensor,
                        w13_EFH: torch.Tensor, w2_EHI: torch.Tensor,
                        b13_EF: torch.Tensor | None, b2_EH: torch.Tensor | None,
                        activation: str, swiglu_alpha: float,
                        swiglu_limit: float) -> torch.Tensor:
    """`fused_experts` on the kernels ``config`` names, for ``T >= 1``; its path
    must be able to run here (the tuner times candidates through this)."""
    if config.path == "grouped_mm":
        return grouped_gemm.experts(hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI,
                                    b13_EF, b2_EH, activation, swiglu_alpha, swiglu_limit)
    experts = Experts(w13_EFH, w2_EHI, b13_EF, b2_EH, activation, swiglu_alpha, swiglu_limit)
    return _RUNNERS[config.path](config, experts, hidden_TH, None, topk_weights_TK.reshape(-1),
                                 topk_ids_TK, hidden_TH.dtype)


def fused_experts_rows(x_RH: torch.Tensor, expert_R: torch.Tensor, count_E: torch.Tensor,
                       w13_EFH: torch.Tensor, w2_EHI: torch.Tensor,
                       b13_EF: torch.Tensor | None, b2_EH: torch.Tensor | None,
                       activation: str, swiglu_alpha: float,
                       swiglu_limit: float) -> torch.Tensor:
    """Each row through its own expert, unweighted: ``y_RH [R, H]``.

        y[r] = act(x[r] @ w13[e].T + b13[e]) @ w2[e].T + b2[e]  with e = expert_R[r] >= 0
        y[r] = 0                                                  where expert_R[r] == -1

    Args:
        x_RH: ``[R, H]`` fp16, bf16 or fp32.
        expert_R: ``[R]`` int32, each row's expert or -1.
        count_E: ``[E]`` int32, rows per expert. The rows format keeps rows grouped
            by expert, but the kernels group them again from ``expert_R``, so the
            result does not depend on ``count_E`` (it stays in the signature of
            ``moe::experts_rows``).
        w13_EFH, w2_EHI, b13_EF, b2_EH, activation, swiglu_alpha, swiglu_limit:
            as in `fused_experts`.

    Returns ``y_RH [R, H]`` in ``x_RH``'s dtype, contiguous.
    """
    _check_rows(expert_R)
    check_dtype("x_rows", x_RH.dtype)
    check_activation(activation)
    if expert_R.shape[0] == 0:
        return torch.empty((0, x_RH.shape[1]), dtype=x_RH.dtype, device=x_RH.device)
    expert_R1 = expert_R.unsqueeze(1)
    config = _plan(x_RH, expert_R1, w13_EFH)
    if config.path == "grouped_mm":
        return grouped_gemm.experts_rows(x_RH, expert_R, count_E, w13_EFH, w2_EHI, b13_EF, b2_EH,
                                         activation, swiglu_alpha, swiglu_limit)
    experts = Experts(w13_EFH, w2_EHI, b13_EF, b2_EH, activation, swiglu_alpha, swiglu_limit)
    return _RUNNERS[config.path](config, experts, x_RH, None, None, expert_R1, x_RH.dtype)


def _check_rows(expert_R: torch.Tensor) -> None:
    if expert_R.dim() != 1:
        raise ValueError(f"expert_rows must be 1-D, got shape {tuple(expert_R.shape)}")


def first_gemm_input(experts: Experts, x_MH: torch.Tensor):
    """What the gate-up GEMM reads of the activation rows: themselves, or fp8
    rows and scales (quantized here, once per row)."""
    if experts.quantized_activations:
        return quantize_rows(x_MH, experts.spec)
    return x_MH, None


def fused_experts_quant(hidden_TH: torch.Tensor, topk_weights_TK: torch.Tensor,
                        topk_ids_TK: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                        b13_EF: torch.Tensor | None, b2_EH: torch.Tensor | None,
                        weight_format: str, activation_format: str, block_size: list[int],
                        activation: str, swiglu_alpha: float,
                        swiglu_limit: float) -> torch.Tensor:
    """`fused_experts` on quantized weights (``moe::experts_quant``): ``out_TH [T, H]``
    in ``hidden_TH``'s dtype.

    ``w13``, ``w2`` and their scales are stored as ``QuantSpec(weight_format,
    activation_format, block_size)`` says (`torch_moe_ops.quant`); biases are in
    ``hidden_TH``'s dtype. With fp8 activations ``hidden_TH`` is quantized once
    per token and the intermediate once per slot, dynamically, as the reference does.
    """
    check_dtype("hidden", hidden_TH.dtype)
    check_activation(activation)
    if topk_ids_TK.shape[0] == 0:
        return torch.empty((0, hidden_TH.shape[1]), dtype=hidden_TH.dtype,
                           device=hidden_TH.device)
    spec = QuantSpec.from_op_args(weight_format, activation_format, block_size)
    return experts_quant_with_config(
        _plan(hidden_TH, topk_ids_TK, w13, spec), hidden_TH, topk_weights_TK, topk_ids_TK, w13,
        w2, w13_scale, w2_scale, b13_EF, b2_EH, weight_format, activation_format, block_size,
        activation, swiglu_alpha, swiglu_limit)


def experts_quant_with_config(config: KernelConfig, hidden_TH: torch.Tensor,
                              topk_weights_TK: torch.Tensor, topk_ids_TK: torch.Tensor,
                              w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                              w2_scale: torch.Tensor, b13_EF: torch.Tensor | None,
                              b2_EH: torch.Tensor | None, weight_format: str,
                              activation_format: str, block_size: list[int], activation: str,
                              swiglu_alpha: float, swiglu_limit: float) -> torch.Tensor:
    """`fused_experts_quant` on the kernels ``config`` names (``direct`` or
    ``tiled``), for ``T >= 1`` (the tuner times candidates through this)."""
    experts = Experts(w13, w2, b13_EF, b2_EH, activation, swiglu_alpha, swiglu_limit,
                      QuantSpec.from_op_args(weight_format, activation_format, block_size),
                      w13_scale, w2_scale)
    x_TH, x_scale = first_gemm_input(experts, hidden_TH)
    return _RUNNERS[config.path](config, experts, x_TH, x_scale, topk_weights_TK.reshape(-1),
                                 topk_ids_TK, hidden_TH.dtype)


def fused_experts_rows_quant(x_RH: torch.Tensor, x_scale: torch.Tensor | None,
                             expert_R: torch.Tensor, count_E: torch.Tensor, w13: torch.Tensor,
                             w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                             b13_EF: torch.Tensor | None, b2_EH: torch.Tensor | None,
                             weight_format: str, activation_format: str,
                             block_size: list[int], activation: str, swiglu_alpha: float,
                             swiglu_limit: float,
                             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`fused_experts_rows` on quantized weights (``moe::experts_rows_quant``):
    ``y_RH [R, H]``.

    ``x_RH`` is float rows (``x_scale`` and ``out_dtype`` None; the output has
    their dtype), or rows quantized already by dispatch: float8_e4m3fn with
    ``x_scale`` (``[R]`` for fp8_token, ``[R, H / bk]`` for fp8_group) and the
    output dtype ``out_dtype``; then they are read as they are. Weights as in
    `fused_experts_quant`; ``count_E`` as in `fused_experts_rows`.
    """
    _check_rows(expert_R)
    check_activation(activation)
    dtype = x_RH.dtype if out_dtype is None else out_dtype
    check_dtype("x_rows" if out_dtype is None else "out_dtype", dtype)
    if expert_R.shape[0] == 0:
        return torch.empty((0, x_RH.shape[1]), dtype=dtype, device=x_RH.device)
    expert_R1 = expert_R.unsqueeze(1)
    experts = Experts(w13, w2, b13_EF, b2_EH, activation, swiglu_alpha, swiglu_limit,
                      QuantSpec.from_op_args(weight_format, activation_format, block_size),
                      w13_scale, w2_scale)
    config = _plan(x_RH, expert_R1, w13, experts.spec, dtype)
    if x_scale is None:
        x_RH, x_scale = first_gemm_input(experts, x_RH)
    return _RUNNERS[config.path](config, experts, x_RH, x_scale, None, expert_R1, dtype)
