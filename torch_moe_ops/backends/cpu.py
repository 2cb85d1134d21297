"""The ``cpu`` experts backend: each token through its chosen experts only, on the CPU.

Legend: T tokens, H hidden size, I expert intermediate size, F = 2 * I, E experts,
K experts per token, S = T * K slots, R rows (the slots with an expert, sorted by
expert), N / M the input / output columns of one projection.

    rows = slots with topk_ids >= 0, grouped by expert      (common.kernels.sorting)
    for each expert e with rows:                             (torch._grouped_mm)
        y[rows(e)] = act(x[rows(e)] @ w13[e].T + b13[e]) @ w2[e].T + b2[e]
    out[t] = sum over the slots (t, k) with an expert of topk_weights[t, k] * y[row(t, k)]

Unlike the dense ``reference`` (every expert on every token), it costs the FLOPs
of the chosen experts alone: a skipped slot (id -1) and an expert nobody chose
cost nothing, and an unchosen expert's weights are never read. The GEMMs run in
the input dtype with fp32 accumulation (fp64 inputs: fp64) and round their
outputs once, as the GPU kernels do; the bias, the activation and the weighted
sum over a token's slots run in fp32 (fp64), and the result is cast back to the
input dtype. Weights are used in the canonical layout (``w13 [E, 2I, H]``,
``w2 [E, H, I]``), never copied.

In a graph compiled by Inductor with fixed sizes and few slots per expert
(decode; a few more where the experts fit in the caches), ``experts`` is traced
in as `gathered_experts` instead (see `GATHERED_MAX_SLOTS_PER_EXPERT` and
`common.kernels.tracing`): one loop over slots that Inductor fuses, where a skipped slot
costs one slot's work (static shapes cannot leave it out) and still adds nothing.

The gradient (`experts_backward`) is its own where ``torch._grouped_mm`` runs
(`backward_supports`: float32, bfloat16 or float16, H and I in steps of 16
bytes, weights' strides too): grouped GEMMs on the routed rows only
(`common.kernels.grouped_backward`, its steps in plain PyTorch). Elsewhere (float64, odd
sizes) the reference backend's runs, called as ``moe_reference::experts_backward``.
"""

from __future__ import annotations

import torch

from torch_moe_ops import torch_compat
from torch_moe_ops.backends.common.kernels import grouped_backward
from torch_moe_ops.backends.common.kernels.activation import activation
from torch_moe_ops.backends.common.kernels.sorting import sort_rows
from torch_moe_ops.backends.common.kernels.tracing import fixed_sizes, tracing_for_inductor
from torch_moe_ops.backends.registry import REGISTRY, ExpertsBackend, Problem
from torch_moe_ops.ops import decompose_backend_ops, define_backend_ops
from torch_moe_ops.ops.checks import compute_dtype
from torch_moe_ops.ops.library import REFERENCE_NAMESPACE, op_overload

NAMESPACE = "moe_cpu"
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# torch._grouped_mm has CPU kernels for these (no float64) ...
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# ... and wants every stride but the unit one in steps of this many bytes.
GROUPED_MM_STRIDE_BYTES = 16
# torch._grouped_mm visits every expert (about 0.75 us each, rows or not), a loop
# here only the experts with rows (about 3 us each): below this fraction of
# experts with rows (decode over many experts) the loop costs less.
GROUPED_MM_MIN_ACTIVE_FRACTION = 0.25
# Compiled by Inductor with fixed sizes, `experts` is traced into the graph as
# `gathered_experts` (one fused loop over slots: no sort, no host loop, no library
# call per expert) where that costs no more than the sorted GEMMs: up to one slot
# per expert (decode), whatever the experts' size; or, where a layer's experts fit
# in the CPU caches so that re-reading them per slot is cheap, up to a few slots
# per expert (on a 2-core AMD EPYC with 32 MiB L3, experts of 0.4-0.8 MiB: 7-17%
# faster at 8 slots per expert, 10-30% slower from 16).
GATHERED_MAX_SLOTS_PER_EXPERT = 1
GATHERED_CACHED_MAX_SLOTS_PER_EXPERT = 8
GATHERED_CACHED_MAX_BYTES = 16 * 2**20


def _grouped_mm_runs(*tensors: torch.Tensor) -> bool:
    return all(t.dtype in GROUPED_MM_DTYPES
               and all(s == 1 or s * t.element_size() % GROUPED_MM_STRIDE_BYTES == 0
                       for s in t.stride())
               for t in tensors)


def _grouped_linear(x_RN: torch.Tensor, w_EMN: torch.Tensor, ends_E: torch.Tensor | None,
                    active: list[tuple[int, int]]) -> torch.Tensor:
    """``y_RM [R, M]`` in ``x_RN``'s dtype: each expert's rows times ``w_EMN[e].T``.

    Rows are grouped by expert, ascending; ``active`` lists ``(expert, rows)`` for
    the experts with rows. ``ends_E`` (int32, cumulative row counts) runs it as
    one ``torch._grouped_mm``; None runs a loop over ``active``.
    """
    w_ENM = w_EMN.transpose(-2, -1)
    if ends_E is not None:
        return torch_compat.grouped_mm(x_RN, w_ENM, ends_E)
    y_RM = x_RN.new_empty((x_RN.shape[0], w_EMN.shape[1]))
    start = 0
    for e, count in active:
        torch.mm(x_RN[start:start + count], w_ENM[e], out=y_RM[start:start + count])
        start += count
    return y_RM


def _sparse_experts(x_TH: torch.Tensor, weights_S: torch.Tensor | None,
                    ids_TK: torch.Tensor, w13_EFH, w2_EHI, b13_EF, b2_EH, act: str,
                    alpha: float, limit: float) -> torch.Tensor:
    """``out_TH [T, H]`` in ``x_TH``'s dtype; ``weights_S`` None means weight 1 per slot."""
    # The op's gradient is its registered formula, never traced through this
    # kernel: below autograd each torch call inside skips the autograd kernels
    # (for a decode step that is about a sixth of the op's time).
    with torch_compat.below_autograd():
        return _sparse_experts_below_autograd(x_TH, weights_S, ids_TK, w13_EFH, w2_EHI,
                                              b13_EF, b2_EH, act, alpha, limit)


def _sparse_experts_below_autograd(x_TH, weights_S, ids_TK, w13_EFH, w2_EHI, b13_EF, b2_EH,
                                   act, alpha, limit):
    num_tokens, top_k = ids_TK.shape
    num_experts, inter_size = w13_EFH.shape[0], w13_EFH.shape[1] // 2
    acc_dtype = compute_dtype(x_TH.dtype)
    out_TH = torch.zeros((num_tokens, x_TH.shape[1]), dtype=acc_dtype, device=x_TH.device)
    order_S, sorted_ids_S, count_E = sort_rows(ids_TK, num_experts)
    # Row counts are read on the host: this kernel is opaque to torch.compile (the
    # op's fake gives the [T, H] output from input sizes alone), so no host value
    # reaches a graph or an output size, and on the CPU the read is a plain load,
    # not a device sync. The rows of skipped slots, sorted last, are cut off here.
    counts = count_E.tolist()
    active = [(e, count) for e, count in enumerate(counts) if count]
    if not active:
        return out_TH.to(x_TH.dtype)
    num_rows = sum(counts)
    order_R, expert_R = order_S[:num_rows], sorted_ids_S[:num_rows]
    token_R = order_R // top_k
    ends_E = None
    if (len(active) >= GROUPED_MM_MIN_ACTIVE_FRACTION * num_experts
            and _grouped_mm_runs(w13_EFH.transpose(-2, -1), w2_EHI.transpose(-2, -1))):
        ends_E = torch.cumsum(count_E, 0, dtype=torch.int32)

    h_RF = _grouped_linear(x_TH.index_select(0, token_R), w13_EFH, ends_E, active)
    h_RF = h_RF.to(acc_dtype)
    if b13_EF is not None:
        h_RF = h_RF + b13_EF.index_select(0, expert_R)
    a_RI = activation(h_RF[:, :inter_size], h_RF[:, inter_size:], act, alpha, limit)
    y_RH = _grouped_linear(a_RI.to(x_TH.dtype), w2_EHI, ends_E, active).to(acc_dtype)
    if b2_EH is not None:
        y_RH = y_RH + b2_EH.index_select(0, expert_R)
    if weights_S is not None:
        y_RH = y_RH * weights_S.index_select(0, order_R).to(acc_dtype).unsqueeze(1)
    # Sequential on the CPU: deterministic, each token's slots added in expert order.
    out_TH.index_add_(0, token_R, y_RH)
    return out_TH.to(x_TH.dtype)


def experts(hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI, b13_EF, b2_EH, act,
            alpha, limit):
    """``out_TH [T, H]``: every token through its top-k experts, weighted and summed.

    ``topk_ids_TK [T, K]`` int32/int64 (-1 skips a slot), ``topk_weights_TK [T, K]``
    any float dtype (read in fp32); the rest as ``moe::experts``. ``T == 0`` runs no GEMM.
    """
    return _sparse_experts(hidden_TH, topk_weights_TK.reshape(-1), topk_ids_TK, w13_EFH,
                           w2_EHI, b13_EF, b2_EH, act, alpha, limit)


def experts_rows(x_RH, expert_R, count_E, w13_EFH, w2_EHI, b13_EF, b2_EH, act, alpha, limit):
    """``y_RH [R, H]``: each row through its own expert, unweighted; rows of expert -1 are 0.

    The rows are grouped again from ``expert_R`` (a stable sort of already grouped
    rows keeps them in place), so the result does not depend on ``count_E``.
    """
    return _sparse_experts(x_RH, None, expert_R.unsqueeze(1), w13_EFH, w2_EHI, b13_EF, b2_EH,
                           act, alpha, limit)


def gathered_experts(hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI, b13_EF, b2_EH,
                     act, alpha, limit):
    """`experts` with static shapes and no sort: each slot gathers its expert's weights.

        y[s]   = act(x[s // K] @ w13[e].T + b13[e]) @ w2[e].T + b2[e]    e = ids[s], per slot s
        out[t] = sum over k of where(ids[t, k] >= 0, weight[t, k] * y[t * K + k], 0)

    Traced into graphs that Inductor compiles (see `GATHERED_MAX_SLOTS_PER_EXPERT`),
    which folds the gather into the loads of its matrix-vector loop; run op by op
    it would copy one weight matrix per slot. A skipped slot reads expert 0's
    weights (static shapes cannot leave it out) and `torch.where` drops its
    result, so a NaN there never reaches the output.
    """
    num_tokens, top_k = topk_ids_TK.shape
    hidden_size, inter_size = hidden_TH.shape[1], w13_EFH.shape[1] // 2
    acc_dtype = compute_dtype(hidden_TH.dtype)
    ids_S = topk_ids_TK.reshape(-1)
    expert_S = ids_S.clamp(min=0).long()
    x_SH = hidden_TH.unsqueeze(1).expand(num_tokens, top_k, hidden_size).reshape(-1, hidden_size)
    h_SF = torch.bmm(w13_EFH[expert_S], x_SH.unsqueeze(2)).squeeze(2).to(acc_dtype)
    if b13_EF is not None:
        h_SF = h_SF + b13_EF[expert_S]
    a_SI = activation(h_SF[:, :inter_size], h_SF[:, inter_size:], act, alpha, limit)
    y_SH = torch.bmm(w2_EHI[expert_S], a_SI.to(hidden_TH.dtype).unsqueeze(2)).squeeze(2)
    y_SH = y_SH.to(acc_dtype)
    if b2_EH is not None:
        y_SH = y_SH + b2_EH[expert_S]
    weighted_SH = y_SH * topk_weights_TK.reshape(-1, 1).to(acc_dtype)
    weighted_SH = torch.where((ids_S >= 0).unsqueeze(1), weighted_SH, 0)
    return weighted_SH.view(num_tokens, top_k, hidden_size).sum(1).to(hidden_TH.dtype)


def _gathered_applies(hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI, *_) -> bool:
    if not (tracing_for_inductor() and fixed_sizes(topk_ids_TK)):
        return False
    slots_per_expert = topk_ids_TK.numel() / w13_EFH.shape[0]
    expert_bytes = (w13_EFH.numel() + w2_EHI.numel()) * w13_EFH.element_size()
    return (slots_per_expert <= GATHERED_MAX_SLOTS_PER_EXPERT
            or (expert_bytes <= GATHERED_CACHED_MAX_BYTES
                and slots_per_expert <= GATHERED_CACHED_MAX_SLOTS_PER_EXPERT))


def supports(spec, problem, device) -> str | None:
    if device.type != "cpu":
        return (f"runs on the CPU only (it reads row counts on the host, a sync on a GPU), "
                f"got device {device.type}")
    if problem.dtype not in DTYPES:
        return f"needs float32, bfloat16, float16 or float64, got {problem.dtype}"
    return None


def backward_supports(spec, problem, device) -> str | None:
    """``None`` where `experts_backward` runs its own grouped GEMMs on ``problem``,
    else why it hands the gradient to the reference backend (the registry's
    ``supports`` signature; ``spec`` is not read). Weights' strides are checked per call."""
    reason = supports(spec, problem, device)
    if reason is not None:
        return reason
    if problem.dtype not in GROUPED_MM_DTYPES:
        return f"torch._grouped_mm has no CPU kernel for {problem.dtype}"
    step = GROUPED_MM_STRIDE_BYTES // problem.dtype.itemsize
    sizes = {"hidden_size": problem.hidden_size, "intermediate_size": problem.intermediate_size}
    if any(size is not None and size % step for size in sizes.values()):
        return (f"torch._grouped_mm needs hidden_size and intermediate_size in steps of "
                f"{GROUPED_MM_STRIDE_BYTES} bytes ({step} {problem.dtype} values), got "
                f"{problem.hidden_size} and {problem.intermediate_size}")
    return None


def experts_backward(grad_out_TH, hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI,
                     b13_EF, b2_EH, act, alpha, limit):
    """The gradients of `experts` (``moe::experts_backward``'s outputs).

    `grouped_backward.experts_backward` (the routed rows only, on torch._grouped_mm)
    where `backward_supports` holds and the weights' strides suit torch._grouped_mm,
    else the reference backend's op.
    """
    args = (grad_out_TH, hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI, b13_EF,
            b2_EH, act, alpha, limit)
    problem = Problem(hidden_TH.dtype, hidden_size=hidden_TH.shape[1],
                      intermediate_size=w13_EFH.shape[1] // 2)
    if (backward_supports(None, problem, hidden_TH.device) is None
            and _grouped_mm_runs(w13_EFH, w2_EHI)):
        return grouped_backward.experts_backward(*args)
    return op_overload(REFERENCE_NAMESPACE, "experts_backward")(*args)


define_backend_ops(NAMESPACE, {"experts": experts, "experts_rows": experts_rows,
                               "experts_backward": experts_backward})
decompose_backend_ops(NAMESPACE, {"experts": gathered_experts}, _gathered_applies)

REGISTRY.register_experts(ExpertsBackend(
    name="cpu", namespace=NAMESPACE, supports=supports, priority=5,
    description="only the chosen experts, each on its rows (torch._grouped_mm), "
                "in the forward and the backward",
    backward=backward_supports))
