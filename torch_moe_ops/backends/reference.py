"""The ``reference`` backend: plain PyTorch, static shapes, the oracle for every other backend.

Legend: T tokens, H hidden size, I expert intermediate size, F = 2*I, E experts,
K experts per token, R rows, G expert groups, S experts per group, J kept groups,
C rows per expert (the masked format).

Everything is computed in fp32, or in fp64 for fp64 inputs (the promotion of
fp32 and the input dtype), and cast to the input dtype at the end. Experts run
densely: each expert sees every token, and where the token did not choose it the
result is dropped with `torch.where`, never multiplied by a weight of 0: an
expert that no slot chose (weights pruned, not loaded yet, NaN) contributes
nothing to the output or to any gradient, and gets exactly zero weight gradient,
as the per-slot formula says. That costs E/K times the FLOPs of a sparse kernel
but needs no data-dependent shapes, no host sync and no sort, so it is
trivially right, and it runs on any device.

Quantized experts (``experts_quant``, ``experts_rows_quant``) read their weights
back in fp32 (`torch_moe_ops.quant`) and round each GEMM's input through the
activation format, then run as above: the oracle of every quantized kernel.
``experts_rows_quant`` also reads rows that arrive quantized (fp8 with
``x_scale``, from ``moe::dispatch_quant``) in both fp8 activation formats.

``experts_masked`` (the masked format, `ops.masked`: ``[E, C, H]`` blocks with a count of
rows per expert) runs every row of every block as one batched GEMM per projection and
keeps the rows below the count with `torch.where`: rows past it (garbage, NaN) reach no
output row and no gradient, and come out as zeros. ``experts_masked_quant`` is
``experts_rows_quant`` on every cell of the blocks, those past a count of no expert.
"""

from __future__ import annotations

import math

import torch

from torch_moe_ops import quant
from torch_moe_ops.backends.common.kernels.activation import activation, activation_backward
from torch_moe_ops.backends.common.kernels.rows import masked_valid
from torch_moe_ops.backends.registry import REGISTRY, ExpertsBackend, RouteBackend
from torch_moe_ops.config import QuantSpec
from torch_moe_ops.ops import decompose_backend_ops, define_backend_ops
from torch_moe_ops.ops.checks import compute_dtype

NAMESPACE = "moe_reference"


def route(router_logits_TE: torch.Tensor, correction_bias_E: torch.Tensor | None,
          top_k: int, scoring: str, renormalize: bool, num_expert_groups: int,
          topk_groups: int, routed_scaling_factor: float):
    logits_TE = router_logits_TE.to(compute_dtype(router_logits_TE.dtype))
    if scoring == "topk_softmax":
        scores_TE = logits_TE
    elif scoring == "softmax":
        scores_TE = torch.softmax(logits_TE, dim=-1)
    else:
        scores_TE = logits_TE.sigmoid()
    choice_TE = scores_TE if correction_bias_E is None else scores_TE + correction_bias_E
    if num_expert_groups > 1:
        choice_TE = _mask_groups(choice_TE, num_expert_groups, topk_groups)
    topk_ids_TK = torch.topk(choice_TE, top_k, dim=-1).indices
    topk_weights_TK = scores_TE.gather(1, topk_ids_TK)
    if scoring == "topk_softmax":
        # GPT-OSS: a softmax over the chosen logits only (it sums to 1 already).
        topk_weights_TK = torch.softmax(topk_weights_TK, dim=-1)
    elif renormalize:
        topk_weights_TK = topk_weights_TK / topk_weights_TK.sum(-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        topk_weights_TK = topk_weights_TK * routed_scaling_factor
    return topk_weights_TK.float(), topk_ids_TK.to(torch.int32)


def _mask_groups(choice_TE: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """Keep only the experts of the ``topk_groups`` groups with the best sum of top-2 scores."""
    num_tokens, num_experts = choice_TE.shape
    choice_TGS = choice_TE.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores_TG = choice_TGS.topk(2, dim=-1).values.sum(-1)
    top_groups_TJ = group_scores_TG.topk(topk_groups, dim=-1).indices
    keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, top_groups_TJ, True)
    return choice_TGS.masked_fill(~keep_TG.unsqueeze(-1), -math.inf).view(num_tokens, num_experts)


def _per_expert(topk_weights_TK: torch.Tensor, topk_ids_TK: torch.Tensor, num_experts: int,
                dtype: torch.dtype):
    """Top-k weights scattered to ``[T, E]`` (in ``dtype``) and which experts each
    token chose ``[T, E]`` (bool); slots with id -1 land in a dropped column."""
    num_tokens = topk_ids_TK.shape[0]
    ids_TK = torch.where(topk_ids_TK < 0, num_experts, topk_ids_TK).long()
    weights_TX = topk_weights_TK.new_zeros((num_tokens, num_experts + 1), dtype=dtype)
    weights_TX.scatter_add_(1, ids_TK, topk_weights_TK.to(dtype))
    chosen_TX = torch.zeros_like(weights_TX, dtype=torch.bool).scatter_(1, ids_TK, True)
    return weights_TX[:, :num_experts], chosen_TX[:, :num_experts]


def _only(chosen_T1: torch.Tensor, t_TX: torch.Tensor) -> torch.Tensor:
    """``t_TX`` on the rows of tokens that chose the expert, exactly 0 on the others
    (whatever they hold: ``0 * nan`` would be nan)."""
    return torch.where(chosen_T1, t_TX, 0)


def _expert_forward(x_TH, w13_FH, w2_HI, b13_F, b2_H, act, alpha, limit,
                    round_trip=None):
    """One expert on inputs in the compute dtype; returns the output and what the
    backward needs. ``round_trip`` is what the second GEMM's input goes through
    first (the activations' quantization of quantized experts)."""
    h_TF = x_TH @ w13_FH.to(x_TH.dtype).t()
    if b13_F is not None:
        h_TF = h_TF + b13_F.to(x_TH.dtype)
    gate_TI, up_TI = h_TF.chunk(2, dim=-1)
    a_TI = activation(gate_TI, up_TI, act, alpha, limit)
    if round_trip is not None:
        a_TI = round_trip(a_TI)
    y_TH = a_TI @ w2_HI.to(x_TH.dtype).t()
    if b2_H is not None:
        y_TH = y_TH + b2_H.to(x_TH.dtype)
    return y_TH, gate_TI, up_TI, a_TI


def _bias(b, e):
    return None if b is None else b[e]


def _experts_dense(x_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI, b13_EF, b2_EH, act,
                   alpha, limit, round_trip=None):
    """Every expert on every token in ``x_TH``'s (compute) dtype, kept where chosen."""
    num_experts = w13_EFH.shape[0]
    weights_TE, chosen_TE = _per_expert(topk_weights_TK, topk_ids_TK, num_experts, x_TH.dtype)
    out_TH = torch.zeros_like(x_TH, memory_format=torch.contiguous_format)
    for e in range(num_experts):
        y_TH = _expert_forward(x_TH, w13_EFH[e], w2_EHI[e], _bias(b13_EF, e), _bias(b2_EH, e),
                               act, alpha, limit, round_trip)[0]
        out_TH += _only(chosen_TE[:, e:e + 1], weights_TE[:, e:e + 1] * y_TH)
    return out_TH


def experts(hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI, b13_EF, b2_EH,
            act, alpha, limit):
    x_TH = hidden_TH.to(compute_dtype(hidden_TH.dtype))
    return _experts_dense(x_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI, b13_EF, b2_EH,
                          act, alpha, limit).to(hidden_TH.dtype)


def _experts_dequantized(x_TH, topk_weights_TK, topk_ids_TK, w13, w2, w13_scale, w2_scale,
                         b13_EF, b2_EH, weight_format, activation_format, block_size, act,
                         alpha, limit):
    """Quantized experts on activations ``x_TH`` already through their first
    round trip: the weights read back in fp32, the second GEMM's input rounded
    through the activation format as the first's was."""
    spec = QuantSpec.from_op_args(weight_format, activation_format, block_size)
    w13_EFH = quant.dequantize_weights(w13, w13_scale, spec).to(x_TH.dtype)
    w2_EHI = quant.dequantize_weights(w2, w2_scale, spec).to(x_TH.dtype)
    return _experts_dense(x_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI, b13_EF, b2_EH,
                          act, alpha, limit,
                          lambda a_TI: quant.round_trip_activations(a_TI, spec).to(a_TI.dtype))


def experts_quant(hidden_TH, topk_weights_TK, topk_ids_TK, w13, w2, w13_scale, w2_scale,
                  b13_EF, b2_EH, weight_format, activation_format, block_size, act, alpha,
                  limit):
    spec = QuantSpec.from_op_args(weight_format, activation_format, block_size)
    x_TH = quant.round_trip_activations(hidden_TH, spec).to(compute_dtype(hidden_TH.dtype))
    return _experts_dequantized(
        x_TH, topk_weights_TK, topk_ids_TK, w13, w2, w13_scale, w2_scale, b13_EF, b2_EH,
        weight_format, activation_format, block_size, act, alpha, limit).to(hidden_TH.dtype)


def experts_rows_quant(x_RH, x_scale, expert_R, count_E, w13, w2, w13_scale, w2_scale, b13_EF,
                       b2_EH, weight_format, activation_format, block_size, act, alpha, limit,
                       out_dtype):
    spec = QuantSpec.from_op_args(weight_format, activation_format, block_size)
    out_dtype = x_RH.dtype if out_dtype is None else out_dtype
    if x_scale is None:
        x_RH = quant.round_trip_activations(x_RH, spec)
    else:
        x_RH = quant.dequantize_activations(x_RH, x_scale, spec)
    weights_R1 = torch.ones((x_RH.shape[0], 1), dtype=torch.float32, device=x_RH.device)
    return _experts_dequantized(
        x_RH.to(compute_dtype(out_dtype)), weights_R1, expert_R.unsqueeze(1), w13, w2,
        w13_scale, w2_scale, b13_EF, b2_EH, weight_format, activation_format, block_size, act,
        alpha, limit).to(out_dtype)


def experts_backward(grad_out_TH, hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI,
                     b13_EF, b2_EH, act, alpha, limit):
    num_experts = w13_EFH.shape[0]
    dtype = compute_dtype(hidden_TH.dtype)
    x_TH, grad_TH = hidden_TH.to(dtype), grad_out_TH.to(dtype)
    weights_TE, chosen_TE = _per_expert(topk_weights_TK, topk_ids_TK, num_experts, dtype)
    grad_x_TH = torch.zeros_like(x_TH, memory_format=torch.contiguous_format)
    grad_weights_TE = torch.zeros_like(weights_TE)
    grad_w13_EFH = torch.empty_like(w13_EFH, dtype=dtype, memory_format=torch.contiguous_format)
    grad_w2_EHI = torch.empty_like(w2_EHI, dtype=dtype, memory_format=torch.contiguous_format)
    grad_b13_EF = torch.zeros(w13_EFH.shape[:2], dtype=dtype, device=x_TH.device)
    grad_b2_EH = torch.zeros(w2_EHI.shape[:2], dtype=dtype, device=x_TH.device)
    for e in range(num_experts):
        chosen_T1 = chosen_TE[:, e:e + 1]
        y_TH, gate_TI, up_TI, a_TI = _expert_forward(
            x_TH, w13_EFH[e], w2_EHI[e], _bias(b13_EF, e), _bias(b2_EH, e), act, alpha, limit)
        # Read only where the token chose e: the gather below picks chosen entries.
        grad_weights_TE[:, e] = (grad_TH * y_TH).sum(-1)
        grad_y_TH = _only(chosen_T1, weights_TE[:, e:e + 1] * grad_TH)
        grad_w2_EHI[e] = grad_y_TH.t() @ _only(chosen_T1, a_TI)
        grad_b2_EH[e] = grad_y_TH.sum(0)
        grad_gate_TI, grad_up_TI = activation_backward(grad_y_TH @ w2_EHI[e].to(dtype), gate_TI,
                                                       up_TI, act, alpha, limit)
        grad_h_TF = _only(chosen_T1, torch.cat([grad_gate_TI, grad_up_TI], dim=-1))
        grad_w13_EFH[e] = grad_h_TF.t() @ _only(chosen_T1, x_TH)
        grad_b13_EF[e] = grad_h_TF.sum(0)
        grad_x_TH += _only(chosen_T1, grad_h_TF @ w13_EFH[e].to(dtype))
    ids_TK = topk_ids_TK.long().contiguous()
    grad_topk_weights_TK = torch.where(
        ids_TK < 0, 0.0, grad_weights_TE.gather(1, ids_TK.clamp(min=0)))

    def like(grad, t):
        return hidden_TH.new_empty((0,)) if t is None else grad.to(t.dtype)

    return (grad_x_TH.to(hidden_TH.dtype), grad_topk_weights_TK.to(topk_weights_TK.dtype),
            grad_w13_EFH.to(w13_EFH.dtype), grad_w2_EHI.to(w2_EHI.dtype),
            like(grad_b13_EF, b13_EF), like(grad_b2_EH, b2_EH))


def experts_rows(x_RH, expert_R, count_E, w13_EFH, w2_EHI, b13_EF, b2_EH, act, alpha, limit):
    # Rows are tokens with one expert each: weight 1 for their expert, skip rows get none.
    weights_R1 = torch.ones((x_RH.shape[0], 1), dtype=torch.float32, device=x_RH.device)
    return experts(x_RH, weights_R1, expert_R.unsqueeze(1), w13_EFH, w2_EHI, b13_EF, b2_EH,
                   act, alpha, limit)


def _masked_forward(x_ECH, w13_EFH, w2_EHI, b13_EF, act, alpha, limit):
    """Every expert on every row of its block, in ``x_ECH``'s (compute) dtype: ``y_ECH``
    before ``b2``, and what the gradient needs."""
    h_ECF = torch.bmm(x_ECH, w13_EFH.to(x_ECH.dtype).transpose(1, 2))
    if b13_EF is not None:
        h_ECF = h_ECF + b13_EF.to(x_ECH.dtype).unsqueeze(1)
    gate_ECI, up_ECI = h_ECF.chunk(2, dim=-1)
    a_ECI = activation(gate_ECI, up_ECI, act, alpha, limit)
    return torch.bmm(a_ECI, w2_EHI.to(x_ECH.dtype).transpose(1, 2)), gate_ECI, up_ECI, a_ECI


def experts_masked(x_ECH, count_E, w13_EFH, w2_EHI, b13_EF, b2_EH, act, alpha, limit):
    # Rows past the count may hold anything: they are zeroed before the GEMMs, and their
    # outputs (unspecified by the contract) are zeros here.
    valid_EC1 = masked_valid(count_E, x_ECH.shape[1])
    kept_ECH = torch.where(valid_EC1, x_ECH.to(compute_dtype(x_ECH.dtype)), 0)
    y_ECH = _masked_forward(kept_ECH, w13_EFH, w2_EHI, b13_EF, act, alpha, limit)[0]
    if b2_EH is not None:
        y_ECH = y_ECH + b2_EH.to(y_ECH.dtype).unsqueeze(1)
    return torch.where(valid_EC1, y_ECH, 0).to(x_ECH.dtype)


def experts_masked_backward(grad_out_ECH, x_ECH, count_E, w13_EFH, w2_EHI, b13_EF, b2_EH, act,
                            alpha, limit):
    dtype = compute_dtype(x_ECH.dtype)
    valid_EC1 = masked_valid(count_E, x_ECH.shape[1])
    # `torch.where`, not a product with the mask: rows past the count may hold NaN.
    kept_ECH = torch.where(valid_EC1, x_ECH.to(dtype), 0)
    grad_y_ECH = torch.where(valid_EC1, grad_out_ECH.to(dtype), 0)
    _, gate_ECI, up_ECI, a_ECI = _masked_forward(kept_ECH, w13_EFH, w2_EHI, b13_EF, act, alpha,
                                                 limit)
    # An expert without rows may have NaN weights: what they give its empty rows is dropped.
    grad_w2_EHI = torch.bmm(grad_y_ECH.transpose(1, 2), torch.where(valid_EC1, a_ECI, 0))
    grad_gate_ECI, grad_up_ECI = activation_backward(
        torch.bmm(grad_y_ECH, w2_EHI.to(dtype)), gate_ECI, up_ECI, act, alpha, limit)
    grad_h_ECF = torch.where(valid_EC1, torch.cat([grad_gate_ECI, grad_up_ECI], dim=-1), 0)
    grad_w13_EFH = torch.bmm(grad_h_ECF.transpose(1, 2), kept_ECH)
    grad_x_ECH = torch.where(valid_EC1, torch.bmm(grad_h_ECF, w13_EFH.to(dtype)), 0)

    def like(grad, t):
        return x_ECH.new_empty((0,)) if t is None else grad.to(t.dtype)

    return (grad_x_ECH.to(x_ECH.dtype), grad_w13_EFH.to(w13_EFH.dtype),
            grad_w2_EHI.to(w2_EHI.dtype), like(grad_h_ECF.sum(1), b13_EF),
            like(grad_y_ECH.sum(1), b2_EH))


def experts_masked_quant(x_ECH, x_scale, count_E, w13, w2, w13_scale, w2_scale, b13_EF, b2_EH,
                         weight_format, activation_format, block_size, act, alpha, limit,
                         out_dtype):
    # Every cell of the blocks is a row of its expert, or of none (-1) past the count.
    num_experts, rows_per_expert, hidden_size = x_ECH.shape
    expert_E1 = torch.arange(num_experts, device=x_ECH.device).unsqueeze(1)
    expert_L = torch.where(masked_valid(count_E, rows_per_expert)[..., 0], expert_E1, -1)
    x_scale_L = None if x_scale is None else x_scale.flatten(0, 1)
    y_LH = experts_rows_quant(x_ECH.flatten(0, 1), x_scale_L, expert_L.reshape(-1).int(),
                              count_E, w13, w2, w13_scale, w2_scale, b13_EF, b2_EH,
                              weight_format, activation_format, block_size, act, alpha, limit,
                              out_dtype)
    return y_LH.view(num_experts, rows_per_expert, hidden_size)


def supports(spec, problem, device) -> str | None:
    return None


define_backend_ops(NAMESPACE, {"route": route, "experts": experts,
                               "experts_backward": experts_backward,
                               "experts_rows": experts_rows, "experts_quant": experts_quant,
                               "experts_rows_quant": experts_rows_quant,
                               "experts_masked": experts_masked,
                               "experts_masked_backward": experts_masked_backward,
                               "experts_masked_quant": experts_masked_quant})
# Routing is a handful of small torch ops: compiled, Inductor fuses them with the
# router's matmul epilogue instead of launching each from a Python kernel.
decompose_backend_ops(NAMESPACE, {"route": route}, lambda *_: True)

REGISTRY.register_experts(ExpertsBackend(
    name="reference", namespace=NAMESPACE, supports=supports, priority=0,
    description="plain PyTorch, dense over experts; the correctness oracle",
    backward=supports, quantized_rows=("fp8_token", "fp8_group")))
REGISTRY.register_route(RouteBackend(
    name="reference", namespace=NAMESPACE, supports=supports, priority=0,
    description="plain PyTorch, every scoring and grouping; compiled, Inductor fuses it"))
