"""Quantized experts on ``torch._scaled_grouped_mm``: fp8 w8a8 with rowwise scales.

Legend: T tokens, H hidden size, I expert intermediate size, F = 2 * I, E experts,
K experts per token, R = T * K rows sorted by expert, M rows and N output
columns of one GEMM.

For ``fp8_channel`` weights with ``fp8_token`` activations (``QuantSpec("fp8_channel")``),
and ``fp8_tensor`` weights, whose one scale per expert is repeated over the output
channels (exact):

    q[t], s[t] = fp8(hidden[t] / s[t]), s[t] = amax |hidden[t]| / 448      (quantize_rows)
    rows r sorted by expert (`sorting.sort_rows`), token(r) the token of row r
    h[r]   = (q[token(r)] @ w13[e].T) * s[token(r)] * w13_scale[e]         one scaled GEMM
    a[r]   = act(h[r] + b13[e])                                  `epilogues.bias_act_rows`
    p, s'  = quantize_rows(a)
    y[r]   = (p[r] @ w2[e].T) * s'[r] * w2_scale[e]                         one scaled GEMM
    out[t] = sum over k of weight[t, k] * (y[row(t, k)] + b2[e])  `epilogues.gather_weighted_sum`

Tokens are quantized before they are gathered into rows: K times fewer rows to
scale, one byte per value to gather, the same values. Each GEMM accumulates in
fp32 and writes bf16 (all that ``torch._scaled_grouped_mm`` writes); the result
is cast to the activations' dtype, which `supports` asks to be bf16.

What ``torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype=bf16)``
takes here (its meta kernel in torch 2.13 and its CUDA source, the rowwise
CUTLASS kernel for sm90; tests/test_grouped_mm_quant.py runs it on the GPU's
torch, 2.11): ``a [M, K]`` float8_e4m3fn row-major; ``b [E, K, N]``
float8_e4m3fn column-major, which the stored ``w [E, N, K]`` transposed already
is (no copy, no `prepare_weights`); ``scale_a [M]`` fp32 contiguous;
``scale_b [E, N]`` fp32, contiguous in N; ``offs [E]`` int32, the cumulative row
ends (groups may be empty; rows from ``offs[-1]`` on are left unwritten); K and
N multiples of 16; fewer than 1024 groups; no bias.
"""

from __future__ import annotations

import torch

from torch_moe_ops import quant, torch_compat
from torch_moe_ops.backends.common.kernels import grouped_gemm
from torch_moe_ops.backends.common.kernels.sorting import rows_of_slots, sort_rows
from torch_moe_ops.config import QuantSpec
from torch_moe_ops.ops.quant import rows_out_dtype

# What torch._scaled_grouped_mm's rowwise scaling takes: one fp8 scale per row.
ROWWISE = QuantSpec("fp8_channel", "fp8_token")

# fp8 rows of 16 bytes: every K and N of the scaled GEMMs.
ALIGNMENT = 16
# The scaled GEMM takes fewer groups (local experts) than this.
MAX_GROUPS = 1024


def format_reason(spec: QuantSpec) -> str | None:
    """Why ``torch._scaled_grouped_mm`` cannot run weights and activations of
    ``spec``, or ``None``."""
    if spec.weights == "fp8_block":
        return (f"does not run {spec.name}: torch._scaled_grouped_mm scales by row and by "
                f"output channel, not by weight block")
    if spec.weights == "mxfp4":
        return (f"does not run {spec.name}: torch._scaled_grouped_mm multiplies fp8 by fp8 "
                f"and has no mxfp4 weight-only path on sm90")
    if spec.activations != "fp8_token":
        return (f"does not run {spec.name} (weight-only fp8): torch._scaled_grouped_mm "
                f"multiplies fp8 activations by fp8 weights")
    return None


def supports(spec, problem, device) -> str | None:
    """``None`` where the quantized experts of ``problem.quant`` run here without a
    host sync, else why not (the registry's ``supports`` signature; ``spec`` is
    not read)."""
    reason = format_reason(problem.quant)
    if reason is not None:
        return reason
    if not torch_compat.has_scaled_grouped_mm():
        return f"needs torch._scaled_grouped_mm for fp8, which torch {torch.__version__} lacks"
    reason = grouped_gemm.device_reason(device, gpu="a CUDA GPU of sm90 for fp8")
    if reason is not None:
        return reason
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return (f"needs sm90 for fp8 (torch._scaled_grouped_mm's rowwise kernel is built for "
                f"sm90 alone), got sm{major}{minor}")
    if problem.dtype != torch.bfloat16:
        return (f"needs bfloat16 activations with fp8 weights (torch._scaled_grouped_mm "
                f"writes bfloat16 only), got {problem.dtype}")
    sizes = (problem.hidden_size, problem.intermediate_size)
    if None not in sizes and any(size % ALIGNMENT for size in sizes):
        return (f"needs hidden_size and intermediate_size divisible by {ALIGNMENT} for fp8, "
                f"got {sizes[0]} and {sizes[1]}")
    if (problem.num_local_experts or 0) >= MAX_GROUPS:
        return (f"needs fewer than {MAX_GROUPS} local experts for fp8 "
                f"(torch._scaled_grouped_mm's groups), got {problem.num_local_experts}")
    return None


def _check_runs(w13, w2, weight_format: str, activation_format: str, block_size) -> None:
    """What `supports` asks of the weights, for a direct call of the ops."""
    reason = format_reason(QuantSpec.from_op_args(weight_format, activation_format,
                                                  list(block_size)))
    if reason is not None:
        raise ValueError(f"experts backend 'grouped_mm' {reason}")
    hidden, inter = w2.shape[1], w2.shape[2]
    if hidden % ALIGNMENT or inter % ALIGNMENT:
        raise ValueError(f"experts backend 'grouped_mm' needs H and I divisible by {ALIGNMENT} "
                         f"for fp8, got H={hidden}, I={inter}")
    if w13.shape[0] >= MAX_GROUPS:
        raise ValueError(f"experts backend 'grouped_mm' needs fewer than {MAX_GROUPS} experts "
                         f"for fp8, got w13.shape[0]={w13.shape[0]}")


def quantize_rows(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_MK, scale_M)``: each row of ``x_MK`` in float8_e4m3fn, row-major, with
    one fp32 scale (`quant.quantize_activations`, ``fp8_token``)."""
    return quant.quantize_activations(x_MK, ROWWISE)


def channel_scales(w_scale: torch.Tensor, weight_format: str, rows: int) -> torch.Tensor:
    """``[E, N]`` fp32 scales, contiguous, of fp8 weights of ``N = rows`` output
    channels: ``fp8_channel`` scales as stored, an ``fp8_tensor`` scale repeated
    (``[E]``, a few bytes per expert: made per call)."""
    if weight_format == "fp8_tensor":
        return w_scale[:, None].expand(-1, rows).contiguous()
    return w_scale.contiguous()


def scaled_grouped_mm(q_MK: torch.Tensor, scale_M: torch.Tensor, w_ENK: torch.Tensor,
                      w_scale_EN: torch.Tensor, ends_E: torch.Tensor) -> torch.Tensor:
    """``[M, N]`` bf16: ``out[m] = (q[m] @ w[e].T) * scale[m] * w_scale[e]`` for the
    rows ``[ends_E[e - 1], ends_E[e])`` of each expert e, accumulated in fp32;
    rows from ``ends_E[-1]`` on are left unwritten."""
    return torch_compat.scaled_grouped_mm(q_MK, w_ENK.transpose(-2, -1), scale_M, w_scale_EN,
                                          ends_E, torch.bfloat16)


def _grouped_gemms(q_RH, scale_R, expert_R, count_E, w13, w2, w13_scale, w2_scale, b13_EF,
                   weight_format, act, alpha, limit):
    """``y_RH [R, H]`` bf16 before ``b2``; rows past the counted ones hold garbage."""
    ends_E = torch.cumsum(count_E, 0, dtype=torch.int32)
    h_RF = scaled_grouped_mm(q_RH, scale_R, w13, channel_scales(w13_scale, weight_format,
                                                                w13.shape[1]), ends_E)
    a_RI = grouped_gemm.bias_act_rows(h_RF, b13_EF, expert_R, act, alpha, limit)
    q_RI, scale_a_R = quantize_rows(a_RI)
    return scaled_grouped_mm(q_RI, scale_a_R, w2,
                             channel_scales(w2_scale, weight_format, w2.shape[1]), ends_E)


def experts_quant(hidden_TH, topk_weights_TK, topk_ids_TK, w13, w2, w13_scale, w2_scale,
                  b13_EF, b2_EH, weight_format, activation_format, block_size, act, alpha,
                  limit):
    """``moe::experts_quant``: ``out_TH [T, H]``, every token through its top-k
    experts, weighted and summed (the module docstring's formula)."""
    _check_runs(w13, w2, weight_format, activation_format, block_size)
    num_tokens, top_k = topk_ids_TK.shape
    if num_tokens == 0:
        return torch.empty_like(hidden_TH, memory_format=torch.contiguous_format)
    order_R, sorted_ids_R, count_E = sort_rows(topk_ids_TK, w13.shape[0])
    q_TH, scale_T = quantize_rows(hidden_TH)
    y_RH = _grouped_gemms(grouped_gemm.routed_rows(q_TH, order_R, sorted_ids_R, top_k),
                          scale_T[order_R // top_k], sorted_ids_R, count_E, w13, w2,
                          w13_scale, w2_scale, b13_EF, weight_format, act, alpha, limit)
    out_TH = grouped_gemm.gather_weighted_sum(y_RH, rows_of_slots(order_R), topk_weights_TK,
                                              topk_ids_TK, b2_EH)
    return out_TH.to(hidden_TH.dtype)


def experts_rows_quant(x_RH, x_scale, expert_R, count_E, w13, w2, w13_scale, w2_scale, b13_EF,
                       b2_EH, weight_format, activation_format, block_size, act, alpha, limit,
                       out_dtype):
    """``moe::experts_rows_quant``: ``y_RH [R, H]``, each row (grouped by expert, as
    dispatch leaves them) through its expert; rows of expert -1 are 0. Rows that
    arrive quantized (fp8 with ``x_scale [R]``) go to the GEMM as they are."""
    _check_runs(w13, w2, weight_format, activation_format, block_size)
    out_dtype = rows_out_dtype(x_RH, out_dtype)
    if x_RH.shape[0] == 0:
        return x_RH.new_empty(tuple(x_RH.shape), dtype=out_dtype)
    if x_scale is None:
        q_RH, scale_R = quantize_rows(x_RH)
    else:
        q_RH, scale_R = x_RH.contiguous(), x_scale.contiguous()
    y_RH = _grouped_gemms(q_RH, scale_R, expert_R, count_E, w13, w2, w13_scale, w2_scale,
                          b13_EF, weight_format, act, alpha, limit)
    return grouped_gemm.finish_rows(y_RH, expert_R, b2_EH).to(out_dtype)
