"""The ``deepgemm`` experts: DeepGEMM's fp8 grouped GEMMs with 128 x 128 weight blocks.

Legend: T tokens, H hidden size, I expert intermediate size, F = 2 * I, E experts, K experts
per token, R = T * K rows sorted by expert, M rows of DeepGEMM's contiguous layout, A the
rows each expert's group is padded to (`library.row_alignment`), C rows per expert of the
masked format, G = H / 128 (or I / 128) activation scale groups per row.

For ``QuantSpec("fp8_block")`` weights (DeepSeek-V3's, ``[E, N, K]`` float8_e4m3fn with
``[E, N / 128, K / 128]`` fp32 scales, as stored) and ``fp8_group`` activations:

    q[m], s[m]  = fp8 of each 128 columns of hidden[token(m)]     `act_quant.quantize_rows`
    h[m] = (q[m] @ w13[e].T) with both scales                DeepGEMM, contiguous layout
    p[m], s'[m] = fp8 of each 128 columns of act(h[m] + b13[e])
                                                      `act_quant.bias_act_quantize_rows`
    y[m] = (p[m] @ w2[e].T) with both scales                 DeepGEMM, contiguous layout
    out[t] = sum over k of weight[t, k] * (y[row(t, k)] + b2[e])   `gather_weighted_sum`

Between the GEMMs and before the first, one pass each: a token is read once and quantized
once, its fp8 row written to each of its K places in the layout; the first GEMM's output is
read once, and the activation is quantized in registers, never written in bf16.

The contiguous layout is the rows sorted by expert with each expert's group starting at a
multiple of A; its size is fixed by T, K and E alone (the worst case, every non-empty group
padded by A - 1 rows), so nothing waits for the host and a CUDA graph captures the whole
layer. Routed tokens reach it through the align step (`align.align_rows` with blocks of A
rows, which also gives each slot's row); rows that arrive grouped by expert, through
`contiguous_layout`. The rows between groups are marked with expert -1 and
hold no token: the quantizers leave them unwritten, DeepGEMM skips the blocks that start
with one and computes the others row by row (a row of its output reads its own row of the
input only), so whatever they hold reaches no row that is read, and the final gather never
reads them. Rows that arrive as the masked format (``[E, C, H]`` blocks with a count per
expert: DeepEP's low-latency layout) go to DeepGEMM's masked GEMM as they are, quantized
into blocks of whole 128-row tiles where they arrive in bf16; the rows past each count are
left unwritten the same way.

Both GEMMs read the activation scales in DeepGEMM's own layout (`library.activation_scales`:
fp32, M-major, columns 16-byte aligned), where the quantizers write them; given row-major
scales, DeepGEMM would first transpose them on every call, a kernel per GEMM. Rows and scales
that arrive quantized into the contiguous layout are gathered into it by the copy that moves
them there (`_to_layout`); masked blocks that arrive in fp8 (DeepEP's, whose scales are in
this layout already) go as they are, or through the copy that pads them to whole tiles.
"""

from __future__ import annotations

import torch

from torch_moe_ops.backends.common.kernels import act_quant, grouped_gemm
from torch_moe_ops.backends.common.kernels.align import align_rows
from torch_moe_ops.backends.deepgemm import library
from torch_moe_ops.config import QuantSpec
from torch_moe_ops.ops.quant import rows_out_dtype


def _check_runs(w13, w2, weight_format, activation_format, block_size) -> None:
    """What `supports` asks of the weights, for a direct call of the ops."""
    reason = library.format_reason(QuantSpec.from_op_args(weight_format, activation_format,
                                                          list(block_size)))
    if reason is not None:
        raise ValueError(f"experts backend 'deepgemm' {reason}")
    hidden, inter = w2.shape[1], w2.shape[2]
    if hidden % library.SCALE_BLOCK or inter % library.SCALE_BLOCK:
        raise ValueError(f"experts backend 'deepgemm' needs H and I divisible by "
                         f"{library.SCALE_BLOCK}, got H={hidden}, I={inter}")


def _scales(num_rows: int, cols: int, device: torch.device, blocks: int | None
            ) -> torch.Tensor:
    """The scales of ``num_rows`` rows of ``cols`` columns in DeepGEMM's layout: ``[M, G]``,
    or ``[B, M / B, G]`` given ``blocks``."""
    block_rows = num_rows if blocks is None else num_rows // blocks
    return library.activation_scales(block_rows, cols // library.SCALE_BLOCK, device, blocks)


def quantize_groups(x_MK: torch.Tensor, targets_MS: torch.Tensor | None = None,
                    num_out: int | None = None, blocks: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: fp8 with one fp32 scale per row and 128 columns, in one Triton
    launch (`quant.quantize_activations` bit for bit); given ``targets_MS``, written to those
    rows of ``num_out`` (`act_quant.quantize_rows`). The scales are ``[M, G]`` in DeepGEMM's
    layout, or ``[B, M / B, G]`` (the masked GEMM's) given ``blocks``."""
    num_rows = num_out if targets_MS is not None else x_MK.shape[0]
    return act_quant.quantize_rows(x_MK, library.FP8_BLOCKS, targets_MS, num_out,
                                   _scales(num_rows, x_MK.shape[1], x_MK.device, blocks))


def quantize_activation(h_MF, b13_EF, expert_M, act, alpha, limit, blocks=None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p_MI, scale)``: the second GEMM's input, `quantize_groups` of the bias and
    activation of the first GEMM's output, in one pass; rows of expert -1 unwritten. The
    scales as `quantize_groups` gives them."""
    scale = _scales(h_MF.shape[0], h_MF.shape[1] // 2, h_MF.device, blocks)
    return act_quant.bias_act_quantize_rows(h_MF, b13_EF, expert_M, act, alpha, limit,
                                            library.FP8_BLOCKS, scale)


def padded_rows(num_rows: int, num_experts: int, alignment: int) -> int:
    """M: rows of the contiguous layout of ``num_rows`` sorted rows, enough whatever the
    routing (each of at most ``min(E, R)`` non-empty groups padded by ``A - 1`` rows)."""
    worst = num_rows + min(num_experts, num_rows) * (alignment - 1)
    return -(-worst // alignment) * alignment


def contiguous_layout(sorted_ids_R: torch.Tensor, count_E: torch.Tensor, alignment: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(position_R, expert_M)``: where each sorted row goes in the contiguous layout
    (int64) and the expert of each of its rows (int32, -1 between groups).

    Expert e's rows start at the sum of the earlier groups' counts, each rounded up to
    ``alignment``. Rows of expert -1 (last in `sort_rows`' order) go to the layout's last
    rows, which no group reaches (`padded_rows` leaves room for them).
    """
    num_rows, num_experts = sorted_ids_R.shape[0], count_E.shape[0]
    num_padded = padded_rows(num_rows, num_experts, alignment)
    count_E = count_E.long()
    padded_E = (count_E + alignment - 1) // alignment * alignment
    # Row r of expert e moves by (e's padded start) - (e's start) = the padding before e.
    shift_E = torch.cumsum(padded_E - count_E, 0) - (padded_E - count_E)
    kept_R = sorted_ids_R >= 0
    shift_R = torch.where(kept_R, shift_E[sorted_ids_R.clamp(min=0)], num_padded - num_rows)
    position_R = torch.arange(num_rows, device=sorted_ids_R.device) + shift_R
    expert_M = torch.full((num_padded,), -1, dtype=torch.int32, device=sorted_ids_R.device)
    expert_M[position_R] = sorted_ids_R.to(torch.int32)
    return position_R, expert_M


def _grouped_gemms(q_MH, scale_MG, expert_M, w13, w2, w13_scale, w2_scale, b13_EF, act, alpha,
                   limit):
    """``y_MH [M, H]`` bf16 before ``b2``; rows of expert -1 hold garbage."""
    h_MF = library.grouped_gemm_contiguous(q_MH, scale_MG, w13, w13_scale, expert_M)
    p_MI, scale_p_MG = quantize_activation(h_MF, b13_EF, expert_M, act, alpha, limit)
    return library.grouped_gemm_contiguous(p_MI, scale_p_MG, w2, w2_scale, expert_M)


def _to_layout(q_XH, scale_XG, source_R, position_R, num_padded):
    """The contiguous layout's ``M`` rows of rows that arrive quantized: row
    ``position_R[r]`` is row ``source_R[r]`` of ``q_XH`` (and its scales); the rows between
    groups copy row 0 (DeepGEMM skips them or computes rows never read). A gather (each row
    read from its source) in place of a scatter: torch's index_put on fp8 moved a byte a
    thread, 4 ms of a 17 ms DeepSeek-V3 layer at T=16384 on an H200.

    The scales are gathered column by column (``index_select`` of ``scale_XG.T``, a new
    contiguous ``[G, scale_rows(M)]``), which leaves them in DeepGEMM's layout: the same
    gather, with no transpose of DeepGEMM's after it."""
    source_M = torch.zeros(library.scale_rows(num_padded), dtype=torch.int64,
                           device=q_XH.device)
    source_M[position_R] = source_R
    scale_MG = torch.index_select(scale_XG.T, 1, source_M).T[:num_padded]
    return q_XH[source_M[:num_padded]], scale_MG


def experts_quant(hidden_TH, topk_weights_TK, topk_ids_TK, w13, w2, w13_scale, w2_scale,
                  b13_EF, b2_EH, weight_format, activation_format, block_size, act, alpha,
                  limit):
    """``moe::experts_quant``: ``out_TH [T, H]``, every token through its top-k experts,
    weighted and summed (the module docstring's formula)."""
    _check_runs(w13, w2, weight_format, activation_format, block_size)
    num_tokens, top_k = topk_ids_TK.shape
    if num_tokens == 0:
        return torch.empty_like(hidden_TH, memory_format=torch.contiguous_format)
    alignment = library.row_alignment()
    # The align step's blocks are DeepGEMM's contiguous layout: three launches in place of
    # a sort and the layout's bookkeeping (about 130 of 695 us at Qwen3-30B-A3B widths and
    # 4096 tokens, 26 kernels, H200).
    slot_M, block_expert_B, _, row_of_slot_S = align_rows(topk_ids_TK, w13.shape[0],
                                                          alignment, slot_rows=True)
    expert_M = torch.where(slot_M.view(-1, alignment) < topk_ids_TK.numel(),
                           block_expert_B[:, None], -1).view(-1)
    # Each token is read and quantized once (K times fewer rows to scale than the layout
    # holds) and its fp8 row written to its K places: no quantized copy of the tokens to
    # gather from. Slots of expert -1 have row -1: they go nowhere.
    q_MH, scale_MG = quantize_groups(hidden_TH, row_of_slot_S.view(num_tokens, top_k),
                                     expert_M.shape[0])
    y_MH = _grouped_gemms(q_MH, scale_MG, expert_M, w13, w2, w13_scale, w2_scale, b13_EF, act,
                          alpha, limit)
    out_TH = grouped_gemm.gather_weighted_sum(y_MH, row_of_slot_S, topk_weights_TK,
                                              topk_ids_TK, b2_EH)
    return out_TH.to(hidden_TH.dtype)


def experts_rows_quant(x_RH, x_scale, expert_R, count_E, w13, w2, w13_scale, w2_scale, b13_EF,
                       b2_EH, weight_format, activation_format, block_size, act, alpha, limit,
                       out_dtype):
    """``moe::experts_rows_quant``: ``y_RH [R, H]``, each row (grouped by expert, as dispatch
    leaves them) through its expert; rows of expert -1 are 0. Rows that arrive quantized
    (fp8 with ``x_scale [R, G]``) go to the GEMM as they are."""
    _check_runs(w13, w2, weight_format, activation_format, block_size)
    out_dtype = rows_out_dtype(x_RH, out_dtype)
    if x_RH.shape[0] == 0:
        return x_RH.new_empty(tuple(x_RH.shape), dtype=out_dtype)
    position_R, expert_M = contiguous_layout(expert_R, count_E, library.row_alignment())
    num_padded = expert_M.shape[0]
    if x_scale is None:
        # Quantized straight into the layout; rows of expert -1 go nowhere.
        targets_R1 = torch.where(expert_R >= 0, position_R, -1)[:, None]
        q_MH, scale_MG = quantize_groups(x_RH, targets_R1, num_padded)
    else:
        rows_R = torch.arange(x_RH.shape[0], device=x_RH.device)
        q_MH, scale_MG = _to_layout(x_RH, x_scale, rows_R, position_R, num_padded)
    y_MH = _grouped_gemms(q_MH, scale_MG, expert_M, w13, w2, w13_scale, w2_scale, b13_EF, act,
                          alpha, limit)
    return grouped_gemm.finish_rows(y_MH[position_R], expert_R, b2_EH).to(out_dtype)


def _masked_experts(count_E: torch.Tensor, rows_per_expert: int) -> torch.Tensor:
    """``expert_X [E * C]`` int32: the expert of each cell of the masked blocks, -1 past its
    count."""
    num_experts = count_E.shape[0]
    cell_EC = torch.arange(rows_per_expert, device=count_E.device).expand(num_experts, -1)
    expert_EC = torch.arange(num_experts, dtype=torch.int32, device=count_E.device)[:, None]
    return torch.where(cell_EC < count_E[:, None], expert_EC, -1).reshape(-1)


def _block_targets(count_E: torch.Tensor, rows_per_expert: int, rows: int) -> torch.Tensor:
    """``targets_X1 [E * C, 1]`` int32: the row of blocks of ``rows`` rows (``[E * rows]``)
    that each cell of the masked blocks goes to, -1 past its expert's count."""
    num_experts = count_E.shape[0]
    cell_EC = torch.arange(rows_per_expert, dtype=torch.int32, device=count_E.device).expand(
        num_experts, -1)
    start_E1 = torch.arange(0, num_experts * rows, rows, dtype=torch.int32,
                            device=count_E.device)[:, None]
    return torch.where(cell_EC < count_E[:, None], start_E1 + cell_EC, -1).reshape(-1, 1)


def experts_masked_quant(x_ECH, x_scale, count_E, w13, w2, w13_scale, w2_scale, b13_EF, b2_EH,
                         weight_format, activation_format, block_size, act, alpha, limit,
                         out_dtype):
    """``moe::experts_masked_quant``: ``y_ECH [E, C, H]``, the rows of each block below its
    count through its expert (rows past it come out as zeros), on DeepGEMM's masked GEMM."""
    _check_runs(w13, w2, weight_format, activation_format, block_size)
    out_dtype = rows_out_dtype(x_ECH, out_dtype)
    num_experts, rows_per_expert, hidden_size = x_ECH.shape
    if x_ECH.numel() == 0:
        return x_ECH.new_zeros(tuple(x_ECH.shape), dtype=out_dtype)
    # DeepGEMM's masked GEMM reads blocks of a whole number of its M tiles (DeepEP's are:
    # max tokens per rank times ranks); others are quantized or copied into such blocks.
    rows = -(-rows_per_expert // library.SCALE_BLOCK) * library.SCALE_BLOCK
    if x_scale is None:
        # Quantized straight into those blocks; rows past each count go nowhere.
        q_XH, scale_ECG = quantize_groups(x_ECH.reshape(-1, hidden_size),
                                          _block_targets(count_E, rows_per_expert, rows),
                                          num_experts * rows, blocks=num_experts)
        q_ECH = q_XH.view(num_experts, rows, hidden_size)
    else:
        q_ECH, scale_ECG = x_ECH, x_scale
        if rows != rows_per_expert:
            # The copy that pads the scales writes them in DeepGEMM's layout.
            q_ECH = _padded_blocks(q_ECH, rows)
            scale_ECG = _padded_blocks(scale_ECG, rows, library.activation_scales(
                rows, scale_ECG.shape[2], scale_ECG.device, blocks=num_experts))
    # Decode sends a few rows to each expert: the tiles for that size (the result does not
    # depend on it).
    expected_rows = min(rows_per_expert, library.SCALE_BLOCK)
    expert_X = _masked_experts(count_E, rows)
    h_ECF = library.grouped_gemm_masked(q_ECH, scale_ECG, w13, w13_scale, count_E,
                                        expected_rows)
    p_XI, scale_a_ECG = quantize_activation(h_ECF.view(num_experts * rows, -1), b13_EF,
                                            expert_X, act, alpha, limit, blocks=num_experts)
    y_ECH = library.grouped_gemm_masked(p_XI.view(num_experts, rows, -1), scale_a_ECG, w2,
                                        w2_scale, count_E, expected_rows)
    y_XH = grouped_gemm.finish_rows(y_ECH.view(-1, hidden_size), expert_X, b2_EH)
    return y_XH.view(num_experts, rows, hidden_size)[:, :rows_per_expert].to(
        out_dtype).contiguous()


def _padded_blocks(x_ECX: torch.Tensor, rows: int, out: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """``x_ECX`` with each expert's block extended to ``rows`` rows of zeros, in ``out``
    (``[E, rows, X]``, any strides) where given."""
    padded = x_ECX.new_empty((x_ECX.shape[0], rows, x_ECX.shape[2])) if out is None else out
    padded[:, x_ECX.shape[1]:] = 0
    padded[:, :x_ECX.shape[1]] = x_ECX
    return padded
