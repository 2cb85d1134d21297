"""The gradient of the experts on the routed rows only: grouped GEMMs over rows sorted by expert.

Legend: T tokens, H hidden size, I expert intermediate size, F = 2 * I, E experts,
K experts per token, S = T * K slots, R = T * K rows (the slots sorted by
expert, skipped slots last), N the columns of a bias gradient, C the columns
of a weight column (`_column`).

For each slot (t, k) with expert ``e = topk_ids[t, k] >= 0``, weight
``w = topk_weights[t, k]`` and ``g = grad_out[t]``::

    h   = x[t] @ w13[e].T + b13[e]          a = act(h[:I], h[I:])
    gw2 = g @ w2[e]                          one GEMM serves two gradients:
    grad_topk_weights[t, k] = <g, a @ w2[e].T + b2[e]> = <gw2, a> + <g, b2[e]>
    dh  = act'(h) * (w * gw2)
    grad_w2[e]  += g^T (w * a)               grad_b2[e]  += w * g
    grad_w13[e] += dh^T x[t]                 grad_b13[e] += dh
    grad_hidden[t] += dh @ w13[e]            summed over k in slot order

Memory: ``moe::experts`` saves only its inputs for the backward, and ``h`` is
recomputed here with one grouped GEMM (of the five this gradient runs), so none
of the forward's intermediates (``[R, 2I]`` per layer) stays alive between the
forward and the backward.

Cost: five grouped GEMMs over the R rows (``h``, ``gw2``, the two weight
gradients in the "k-grouped" form ``torch._grouped_mm(a_RM.t(), b_RN, offs=ends_E)
-> [E, M, N]``, and ``dh @ w13``), the bias gradients as k-grouped GEMMs with a
weight column, one elementwise pass between the GEMMs, the sort and the gathers.
A skipped slot (id -1) and an expert without rows cost no GEMM work; such an
expert gets exactly zero gradient (``torch._grouped_mm`` leaves an empty group's
output undefined, so it is zeroed explicitly). Rows past the counted ones are
never read: the GEMMs leave their outputs undefined and the gathers drop them.
Each token's K contributions to ``grad_hidden`` are gathered and summed in slot
order: deterministic, no atomics.

Precision: the GEMMs take the input dtype and accumulate in fp32, rounding
their outputs once to the input dtype, as the forward kernels do; the
elementwise step and the sums over slots run in fp32; each gradient comes back
in its input's dtype. ``torch._grouped_mm`` wants every stride but the unit
one in steps of 16 bytes (H and I included): callers check that it runs.

The elementwise and gather steps are passed in as `Steps`: `TORCH_STEPS` (plain
PyTorch, which Inductor fuses when the body is traced into a graph) or Triton
kernels (`grouped_gemm`, one pass each when run eagerly on the GPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from torch_moe_ops import torch_compat
from torch_moe_ops.backends.common.kernels.activation import activation, activation_backward
from torch_moe_ops.backends.common.kernels.rows import sum_slots
from torch_moe_ops.backends.common.kernels.sorting import rows_of_slots, sort_rows
from torch_moe_ops.ops.checks import compute_dtype

# torch._grouped_mm wants the row stride of a weight column in steps of this many bytes.
GROUPED_MM_STRIDE_BYTES = 16


@dataclasses.dataclass(frozen=True)
class Steps:
    """The steps between the GEMMs of `experts_backward`.

    ``act_backward_rows(h_RF, b13_EF, expert_R, gw2_RI, weight_R, act, alpha, limit)
    -> (dh_RF, wa_RI, dot_R)``: the bias, the activation and its gradient (see the
    module docstring; ``wa = w * a``, ``dot = <gw2, a>``), ``dh``/``wa`` in
    ``h_RF``'s dtype, ``dot`` fp32, rows of expert -1 undefined.
    ``sum_token_rows(values_RH, row_of_slot_S, topk_ids_TK) -> [T, H]``: each
    token's rows summed in slot order, slots with id -1 left out.
    ``zero_empty_experts_(grad_EX, count_E)``: zero, in place, the slices of
    the experts without rows; returns ``grad_EX``.
    ``routed_rows(values_TH, order_R, expert_R, top_k, dtype) -> [R, H]``: row ``r`` the
    values of token ``order_R[r] // top_k`` in ``dtype``, rows of expert -1 undefined.
    """

    act_backward_rows: Callable
    sum_token_rows: Callable
    zero_empty_experts_: Callable
    routed_rows: Callable


def act_backward_rows(h_RF, b13_EF, expert_R, gw2_RI, weight_R, act, alpha, limit):
    """`Steps.act_backward_rows` in plain PyTorch, in fp32 (fp64 for fp64)."""
    dtype, inter_size = h_RF.dtype, h_RF.shape[1] // 2
    acc_dtype = compute_dtype(dtype)
    h_RF = h_RF.to(acc_dtype)
    if b13_EF is not None:
        h_RF = h_RF + b13_EF.to(acc_dtype).index_select(0, expert_R.clamp(min=0))
    gate_RI, up_RI = h_RF[:, :inter_size], h_RF[:, inter_size:]
    gw2_RI = gw2_RI.to(acc_dtype)
    weight_R1 = weight_R.to(acc_dtype).unsqueeze(1)
    a_RI = activation(gate_RI, up_RI, act, alpha, limit)
    grad_gate_RI, grad_up_RI = activation_backward(weight_R1 * gw2_RI, gate_RI, up_RI, act,
                                                   alpha, limit)
    dh_RF = torch.cat([grad_gate_RI, grad_up_RI], dim=1).to(dtype)
    return dh_RF, (weight_R1 * a_RI).to(dtype), (gw2_RI * a_RI).sum(1).float()


def sum_token_rows(values_RH, row_of_slot_S, topk_ids_TK):
    """`Steps.sum_token_rows` in plain PyTorch (`common.kernels.rows.sum_slots`)."""
    row_of_slot_TK = torch.where(topk_ids_TK < 0, -1, row_of_slot_S.view(topk_ids_TK.shape))
    return sum_slots(values_RH, row_of_slot_TK)


def zero_empty_experts_(grad_EX, count_E):
    """`Steps.zero_empty_experts_` in plain PyTorch."""
    empty_E = (count_E == 0).view(-1, *([1] * (grad_EX.dim() - 1)))
    return grad_EX.masked_fill_(empty_E, 0)


def routed_rows(values_TH, order_R, expert_R, top_k, dtype=None):
    """`Steps.routed_rows` in plain PyTorch (every row, those of expert -1 too)."""
    return values_TH.to(dtype or values_TH.dtype).index_select(0, order_R // top_k)


TORCH_STEPS = Steps(act_backward_rows, sum_token_rows, zero_empty_experts_, routed_rows)


def _column(values_R: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[R, C]`` in ``dtype``: ``values_R`` in column 0, zeros after; C is the
    fewest columns whose row stride torch._grouped_mm takes."""
    column_RC = values_R.new_zeros((values_R.shape[0],
                                    GROUPED_MM_STRIDE_BYTES // dtype.itemsize), dtype=dtype)
    column_RC[:, 0] = values_R
    return column_RC


def _bias_grad(rows_RN: torch.Tensor, weight_RC: torch.Tensor, ends_E: torch.Tensor
               ) -> torch.Tensor:
    """``[E, N]``: each expert's rows summed, weighted by column 0 of ``weight_RC``."""
    return torch_compat.grouped_mm(rows_RN.t(), weight_RC, ends_E)[:, :, 0].contiguous()


def _no_rows(grad_out_TH, hidden_TH, topk_weights_TK, w13_EFH, w2_EHI, b13_EF, b2_EH):
    """The gradients when there are no tokens: empty, and zero for the experts."""
    def zeros(t):
        return hidden_TH.new_empty((0,)) if t is None else torch.zeros_like(
            t, memory_format=torch.contiguous_format)

    return (torch.empty_like(hidden_TH, memory_format=torch.contiguous_format),
            torch.empty_like(topk_weights_TK, memory_format=torch.contiguous_format),
            zeros(w13_EFH), zeros(w2_EHI), zeros(b13_EF), zeros(b2_EH))


def experts_backward(grad_out_TH, hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI,
                     b13_EF, b2_EH, act, alpha, limit, steps: Steps = TORCH_STEPS):
    """The gradients of ``moe::experts`` (the module docstring has the formulas).

    Arguments as ``moe::experts_backward``: ``grad_out_TH``, ``hidden_TH [T, H]``,
    ``topk_weights_TK [T, K]`` (any float dtype, read in fp32), ``topk_ids_TK [T, K]``
    (-1 skips a slot), ``w13_EFH [E, 2I, H]``, ``w2_EHI [E, H, I]``, optional
    ``b13_EF``, ``b2_EH``, in one float dtype that ``torch._grouped_mm`` runs.
    Returns ``(grad_hidden_TH, grad_topk_weights_TK, grad_w13_EFH, grad_w2_EHI,
    grad_b13_EF, grad_b2_EH)``, contiguous, each in its input's dtype; an absent
    bias gets an empty ``[0]`` gradient. ``T == 0`` runs no GEMM.
    """
    num_tokens, top_k = topk_ids_TK.shape
    if num_tokens == 0:
        # torch._grouped_mm rejects a zero-length contraction dimension (R, in the
        # k-grouped GEMMs), under torch.compile too: no rows, no GEMM.
        return _no_rows(grad_out_TH, hidden_TH, topk_weights_TK, w13_EFH, w2_EHI, b13_EF, b2_EH)
    dtype = hidden_TH.dtype
    order_R, expert_R, count_E = sort_rows(topk_ids_TK, w13_EFH.shape[0])
    ends_E = torch.cumsum(count_E, 0, dtype=torch.int32)
    x_RH = steps.routed_rows(hidden_TH, order_R, expert_R, top_k)
    g_RH = steps.routed_rows(grad_out_TH, order_R, expert_R, top_k, dtype)
    # Garbage (NaN) where a slot is skipped: those rows are never read.
    weight_R = topk_weights_TK.reshape(-1).index_select(0, order_R).float()

    h_RF = torch_compat.grouped_mm(x_RH, w13_EFH.transpose(-2, -1), ends_E)
    gw2_RI = torch_compat.grouped_mm(g_RH, w2_EHI, ends_E)
    dh_RF, wa_RI, dot_R = steps.act_backward_rows(h_RF, b13_EF, expert_R, gw2_RI, weight_R,
                                                  act, alpha, limit)
    grad_w2_EHI = steps.zero_empty_experts_(
        torch_compat.grouped_mm(g_RH.t(), wa_RI, ends_E), count_E)
    grad_w13_EFH = steps.zero_empty_experts_(
        torch_compat.grouped_mm(dh_RF.t(), x_RH, ends_E), count_E)
    # An absent bias gets its own empty gradient: outputs of an op must not alias.
    grad_b13_EF, grad_b2_EH = hidden_TH.new_empty((0,)), hidden_TH.new_empty((0,))
    if b13_EF is not None:
        ones_RC = _column(torch.ones_like(weight_R), dtype)
        grad_b13_EF = steps.zero_empty_experts_(_bias_grad(dh_RF, ones_RC, ends_E), count_E)
    if b2_EH is not None:
        grad_b2_EH = steps.zero_empty_experts_(
            _bias_grad(g_RH, _column(weight_R, dtype), ends_E), count_E)

    row_of_slot_S = rows_of_slots(order_R)
    grad_x_RH = torch_compat.grouped_mm(dh_RF, w13_EFH, ends_E)
    grad_hidden_TH = steps.sum_token_rows(grad_x_RH, row_of_slot_S, topk_ids_TK)
    grad_weights_TK = dot_R.index_select(0, row_of_slot_S).view(num_tokens, top_k)
    ids_TK = topk_ids_TK.long().contiguous()
    if b2_EH is not None:
        # <g, b2[e]> for every (token, expert) in one small GEMM, then the chosen ones.
        g_b2_TE = grad_out_TH.float() @ b2_EH.float().t()
        grad_weights_TK = grad_weights_TK + g_b2_TE.gather(1, ids_TK.clamp(min=0))
    grad_weights_TK = torch.where(ids_TK < 0, 0.0, grad_weights_TK)
    return (grad_hidden_TH, grad_weights_TK.to(topk_weights_TK.dtype), grad_w13_EFH,
            grad_w2_EHI, grad_b13_EF, grad_b2_EH)
