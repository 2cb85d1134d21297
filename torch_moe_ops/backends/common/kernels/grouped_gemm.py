"""The experts on ``torch._grouped_mm``: rows sorted by expert, one grouped GEMM per projection.

Legend: T tokens, H hidden size, I expert intermediate size, F = 2 * I, E experts,
K experts per token, R = T * K rows.

Rows are sorted by expert on the device (a stable sort, no host sync), each
expert's rows multiply its weights in one grouped GEMM per projection, and
between and after the GEMMs one Triton kernel each (`epilogues`) adds the bias
and applies the activation, then gathers each token's K rows back, weighted, in
slot order (deterministic). ``torch._grouped_mm`` only runs without a host sync
for bf16 on sm90+; elsewhere it loops on the host, which a CUDA graph cannot
capture: `supports` says so. Weights are used in the canonical layout
(``w13 [E, 2I, H]``, ``w2 [E, H, I]``).

The gradient (`experts_backward`) is `common.kernels.grouped_backward` with its steps
between the GEMMs run as Triton kernels (`epilogues`): the bias, activation and
activation gradient in one pass, the sum over each token's slots in another.

The masked format (`experts_masked`, ``[E, C, H]`` blocks with a count per expert) has no
grouped GEMM of its own in torch (``torch._grouped_mm`` takes groups that follow each
other, and the rows past each count would be computed as part of the next group, C rows
per expert): the rows that carry a token are gathered into the rows format, run as
`experts_rows`, and scattered back (`rows.masked_to_rows`); its gradient likewise. The
GEMMs run the counted rows only, but the gather, the epilogues and the scatter pass over
all ``E * C`` rows, so at decode sizes the ``triton`` backend's masked kernels, which skip
the blocks past each count, are the fast path (``experts="auto"`` takes them first).

The ``grouped_mm`` experts backend is these functions; the ``triton`` backend
hands prefill-sized calls and, where `supports` holds, its gradient to them.
"""

from __future__ import annotations

import torch

from torch_moe_ops import torch_compat
from torch_moe_ops.backends.common import TRITON_INSTALLED
from torch_moe_ops.backends.common.kernels import grouped_backward
from torch_moe_ops.backends.common.kernels.launch import on_first_call
from torch_moe_ops.backends.common.kernels.rows import gather_rows, masked_to_rows, scatter_rows
from torch_moe_ops.backends.common.kernels.sorting import rows_of_slots, sort_rows

# torch._grouped_mm needs 16-byte aligned rows: 8 bf16 values.
ALIGNMENT = 8
EPILOGUES = "torch_moe_ops.backends.common.kernels.epilogues"
bias_act_rows = on_first_call(EPILOGUES, "bias_act_rows")
gather_weighted_sum = on_first_call(EPILOGUES, "gather_weighted_sum")
routed_rows = on_first_call(EPILOGUES, "routed_rows")
TRITON_STEPS = grouped_backward.Steps(*(on_first_call(EPILOGUES, name) for name in (
    "bias_act_backward_rows", "sum_token_rows", "zero_empty_experts_", "routed_rows")))


def aligned(hidden: int, intermediate: int) -> bool:
    return not (hidden % ALIGNMENT or intermediate % ALIGNMENT)


def _check_alignment(w13_EFH: torch.Tensor) -> None:
    hidden, intermediate = w13_EFH.shape[2], w13_EFH.shape[1] // 2
    if not aligned(hidden, intermediate):
        raise ValueError(f"experts backend 'grouped_mm' needs H and I divisible by "
                         f"{ALIGNMENT}, got H={hidden}, I={intermediate}")


def device_reason(device, gpu: str = "a CUDA GPU of sm90 or newer") -> str | None:
    """Why the epilogues cannot run on ``device`` beside a library GEMM that needs
    ``gpu`` (no triton, no CUDA GPU), or ``None``; the GPU's architecture is the
    caller's to check."""
    if not TRITON_INSTALLED:
        return "its activation and gather kernels need triton (pip install triton)"
    if device.type != "cuda":
        return f"needs {gpu}, got device {device.type}"
    if not torch.cuda.is_available():
        return f"needs {gpu}, this torch sees none"
    return None


def supports(spec, problem, device) -> str | None:
    """``None`` where these functions run without a host sync, else why not
    (the registry's ``supports`` signature; ``spec`` is not read)."""
    reason = device_reason(device)
    if reason is not None:
        return reason
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return (f"needs sm90 or newer (torch._grouped_mm loops on the host before), "
                f"got sm{major}{minor}")
    if problem.dtype != torch.bfloat16:
        return f"needs bfloat16 (other dtypes loop on the host), got {problem.dtype}"
    if (problem.hidden_size is not None and problem.intermediate_size is not None
            and not aligned(problem.hidden_size, problem.intermediate_size)):
        return (f"needs hidden_size and intermediate_size divisible by {ALIGNMENT}, got "
                f"{problem.hidden_size} and {problem.intermediate_size}")
    return None


def _grouped_gemms(x_RH, expert_R, count_E, w13_EFH, w2_EHI, b13_EF, act, alpha, limit):
    """``y_RH [R, H]`` before ``b2``; rows past the counted ones hold garbage."""
    ends_E = torch.cumsum(count_E, 0, dtype=torch.int32)
    h_RF = torch_compat.grouped_mm(x_RH, w13_EFH.transpose(-2, -1), ends_E)
    a_RI = bias_act_rows(h_RF, b13_EF, expert_R, act, alpha, limit)
    return torch_compat.grouped_mm(a_RI, w2_EHI.transpose(-2, -1), ends_E)


def experts_rows(x_RH, expert_R, count_E, w13_EFH, w2_EHI, b13_EF, b2_EH, act, alpha, limit):
    """``y_RH [R, H]``: each row through its expert; rows of expert -1 are 0."""
    _check_alignment(w13_EFH)
    num_rows = x_RH.shape[0]
    if num_rows == 0:
        return torch.empty_like(x_RH, memory_format=torch.contiguous_format)
    y_RH = _grouped_gemms(x_RH, expert_R, count_E, w13_EFH, w2_EHI, b13_EF, act, alpha, limit)
    return finish_rows(y_RH, expert_R, b2_EH)


def finish_rows(y_RH, expert_R, b2_EH):
    """``y_RH [R, H]`` with ``b2`` added and the rows of expert -1 zeroed, whatever
    they held: how every ``experts_rows`` on grouped GEMMs ends."""
    num_rows = y_RH.shape[0]
    # One "slot" per row with weight 1.
    rows_R = torch.arange(num_rows, dtype=torch.int32, device=y_RH.device)
    ones_R1 = torch.ones((num_rows, 1), dtype=torch.float32, device=y_RH.device)
    return gather_weighted_sum(y_RH, rows_R, ones_R1, expert_R.view(-1, 1), b2_EH)


def experts(hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI, b13_EF, b2_EH, act,
            alpha, limit):
    """``out_TH [T, H]``: every token through its top-k experts, weighted and summed."""
    _check_alignment(w13_EFH)
    num_tokens, top_k = topk_ids_TK.shape
    if num_tokens == 0:
        return torch.empty_like(hidden_TH, memory_format=torch.contiguous_format)
    order_R, sorted_ids_R, count_E = sort_rows(topk_ids_TK, w13_EFH.shape[0])
    x_RH = routed_rows(hidden_TH, order_R, sorted_ids_R, top_k)
    y_RH = _grouped_gemms(x_RH, sorted_ids_R, count_E, w13_EFH, w2_EHI, b13_EF, act, alpha,
                          limit)
    return gather_weighted_sum(y_RH, rows_of_slots(order_R), topk_weights_TK, topk_ids_TK,
                               b2_EH)


def experts_backward(grad_out_TH, hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI,
                     b13_EF, b2_EH, act, alpha, limit):
    """The gradients of `experts` (``moe::experts_backward``'s outputs), computed on the
    routed rows only: `grouped_backward.experts_backward` with Triton steps."""
    _check_alignment(w13_EFH)
    return grouped_backward.experts_backward(grad_out_TH, hidden_TH, topk_weights_TK,
                                             topk_ids_TK, w13_EFH, w2_EHI, b13_EF, b2_EH, act,
                                             alpha, limit, steps=TRITON_STEPS)


def experts_masked(x_ECH, count_E, w13_EFH, w2_EHI, b13_EF, b2_EH, act, alpha, limit):
    """``y_ECH [E, C, H]``: `experts_rows` on the rows of each block below its count,
    gathered into rows and scattered back; rows past a count come out as zeros."""
    num_experts, rows_per_expert, hidden_size = x_ECH.shape
    expert_R, cell_R = masked_to_rows(count_E, rows_per_expert)
    x_RH = gather_rows(x_ECH.reshape(-1, hidden_size), cell_R)
    y_RH = experts_rows(x_RH, expert_R, count_E, w13_EFH, w2_EHI, b13_EF, b2_EH, act, alpha,
                        limit)
    return scatter_rows(y_RH, cell_R, num_experts * rows_per_expert).view(x_ECH.shape)


def experts_masked_backward(grad_out_ECH, x_ECH, count_E, w13_EFH, w2_EHI, b13_EF, b2_EH, act,
                            alpha, limit):
    """The gradients of `experts_masked` (``moe::experts_masked_backward``'s outputs): those
    of the rows it ran, a row being a token with one expert at weight 1."""
    num_experts, rows_per_expert, hidden_size = x_ECH.shape
    expert_R, cell_R = masked_to_rows(count_E, rows_per_expert)
    x_RH = gather_rows(x_ECH.reshape(-1, hidden_size), cell_R)
    grad_y_RH = gather_rows(grad_out_ECH.reshape(-1, hidden_size), cell_R)
    ones_R1 = torch.ones((x_RH.shape[0], 1), dtype=torch.float32, device=x_RH.device)
    grad_x_RH, _, *weight_grads = experts_backward(
        grad_y_RH, x_RH, ones_R1, expert_R.unsqueeze(1), w13_EFH, w2_EHI, b13_EF, b2_EH, act,
        alpha, limit)
    grad_x_ECH = scatter_rows(grad_x_RH, cell_R, num_experts * rows_per_expert)
    return (grad_x_ECH.view(x_ECH.shape), *weight_grads)
