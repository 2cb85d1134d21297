"""The ``reference`` backend: plain PyTorch, static shapes, the oracle for every other backend.

Legend: T tokens, H hidden size, I expert intermediate size, E experts,
K experts per token, R rows.

Everything is computed in fp32 and cast to the input dtype at the end. Experts
run densely: each expert sees every token and the token's routing weight for
that expert (0 when not chosen) scales the result. That costs E/K times the
FLOPs of a sparse kernel but needs no data-dependent shapes, no host sync and
no sort, so it is trivially right, and it runs on any device.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from torch_moe_ops.backends.registry import REGISTRY, ExpertsBackend
from torch_moe_ops.ops import define_backend_ops

NAMESPACE = "moe_reference"


def route(router_logits_TE: torch.Tensor, correction_bias_E: Optional[torch.Tensor],
          top_k: int, scoring: str, renormalize: bool, num_expert_groups: int,
          topk_groups: int, routed_scaling_factor: float):
    logits_TE = router_logits_TE.float()
    if scoring == "topk_softmax":
        top_logits_TK, topk_ids_TK = torch.topk(logits_TE, top_k, dim=-1)
        topk_weights_TK = torch.softmax(top_logits_TK, dim=-1)
    else:
        scores_TE = torch.softmax(logits_TE, -1) if scoring == "softmax" else logits_TE.sigmoid()
        choice_TE = scores_TE if correction_bias_E is None else scores_TE + correction_bias_E
        if num_expert_groups > 1:
            choice_TE = _mask_groups(choice_TE, num_expert_groups, topk_groups)
        topk_ids_TK = torch.topk(choice_TE, top_k, dim=-1).indices
        topk_weights_TK = scores_TE.gather(1, topk_ids_TK)
        if renormalize:
            topk_weights_TK = topk_weights_TK / topk_weights_TK.sum(-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        topk_weights_TK = topk_weights_TK * routed_scaling_factor
    return topk_weights_TK, topk_ids_TK.to(torch.int32)


def _mask_groups(choice_TE: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """Keep only the experts of the ``topk_groups`` groups with the best sum of top-2 scores."""
    num_tokens, num_experts = choice_TE.shape
    choice_TGS = choice_TE.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores_TG = choice_TGS.topk(2, dim=-1).values.sum(-1)
    top_groups_TJ = group_scores_TG.topk(topk_groups, dim=-1).indices
    keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, top_groups_TJ, True)
    return choice_TGS.masked_fill(~keep_TG.unsqueeze(-1), -math.inf).view(num_tokens, num_experts)


def activation(gate_TI: torch.Tensor, up_TI: torch.Tensor, name: str, alpha: float,
               limit: float) -> torch.Tensor:
    if name == "silu":
        return F.silu(gate_TI) * up_TI
    if name == "gelu":
        return F.gelu(gate_TI) * up_TI
    gate_TI = gate_TI.clamp(max=limit)
    up_TI = up_TI.clamp(min=-limit, max=limit)
    return (up_TI + 1) * gate_TI * torch.sigmoid(alpha * gate_TI)


def activation_backward(grad_TI: torch.Tensor, gate_TI: torch.Tensor, up_TI: torch.Tensor,
                        name: str, alpha: float, limit: float):
    """Gradients of `activation` with respect to (gate, up), in closed form."""
    if name == "silu":
        sig_TI = torch.sigmoid(gate_TI)
        silu_TI = gate_TI * sig_TI
        return grad_TI * up_TI * sig_TI * (1 + gate_TI * (1 - sig_TI)), grad_TI * silu_TI
    if name == "gelu":
        cdf_TI = 0.5 * (1 + torch.erf(gate_TI * math.sqrt(0.5)))
        pdf_TI = torch.exp(-0.5 * gate_TI * gate_TI) / math.sqrt(2 * math.pi)
        return grad_TI * up_TI * (cdf_TI + gate_TI * pdf_TI), grad_TI * F.gelu(gate_TI)
    gate_c_TI = gate_TI.clamp(max=limit)
    up_c_TI = up_TI.clamp(min=-limit, max=limit)
    sig_TI = torch.sigmoid(alpha * gate_c_TI)
    d_gate_TI = (up_c_TI + 1) * sig_TI * (1 + alpha * gate_c_TI * (1 - sig_TI))
    # clamp passes the gradient where the input is inside the bounds, ends included.
    d_gate_TI = d_gate_TI * (gate_TI <= limit)
    d_up_TI = gate_c_TI * sig_TI * ((up_TI >= -limit) & (up_TI <= limit))
    return grad_TI * d_gate_TI, grad_TI * d_up_TI


def _weights_per_expert(topk_weights_TK: torch.Tensor, topk_ids_TK: torch.Tensor,
                        num_experts: int) -> torch.Tensor:
    """Scatter top-k weights to ``[T, E]``; slots with id -1 land in a dropped column."""
    num_tokens = topk_ids_TK.shape[0]
    ids_TK = torch.where(topk_ids_TK < 0, num_experts, topk_ids_TK).long()
    weights_TX = topk_weights_TK.new_zeros((num_tokens, num_experts + 1), dtype=torch.float32)
    weights_TX.scatter_add_(1, ids_TK, topk_weights_TK.float())
    return weights_TX[:, :num_experts]


def _expert_forward(x_TH, w13_FH, w2_HI, b13_F, b2_H, act, alpha, limit):
    """One expert on fp32 inputs; returns the output and what the backward needs."""
    h_TF = x_TH @ w13_FH.float().t()
    if b13_F is not None:
        h_TF = h_TF + b13_F.float()
    gate_TI, up_TI = h_TF.chunk(2, dim=-1)
    a_TI = activation(gate_TI, up_TI, act, alpha, limit)
    y_TH = a_TI @ w2_HI.float().t()
    if b2_H is not None:
        y_TH = y_TH + b2_H.float()
    return y_TH, gate_TI, up_TI, a_TI


def _bias(b, e):
    return None if b is None else b[e]


def experts(hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI, b13_EF, b2_EH,
            act, alpha, limit):
    num_experts = w13_EFH.shape[0]
    weights_TE = _weights_per_expert(topk_weights_TK, topk_ids_TK, num_experts)
    x_TH = hidden_TH.float()
    out_TH = torch.zeros_like(x_TH, memory_format=torch.contiguous_format)
    for e in range(num_experts):
        y_TH = _expert_forward(x_TH, w13_EFH[e], w2_EHI[e], _bias(b13_EF, e), _bias(b2_EH, e),
                               act, alpha, limit)[0]
        out_TH += weights_TE[:, e:e + 1] * y_TH
    return out_TH.to(hidden_TH.dtype)


def experts_backward(grad_out_TH, hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI,
                     b13_EF, b2_EH, act, alpha, limit):
    num_experts = w13_EFH.shape[0]
    weights_TE = _weights_per_expert(topk_weights_TK, topk_ids_TK, num_experts)
    x_TH, grad_TH = hidden_TH.float(), grad_out_TH.float()
    grad_x_TH = torch.zeros_like(x_TH, memory_format=torch.contiguous_format)
    grad_weights_TE = torch.zeros_like(weights_TE)
    grad_w13_EFH = torch.empty_like(w13_EFH, dtype=torch.float32,
                                    memory_format=torch.contiguous_format)
    grad_w2_EHI = torch.empty_like(w2_EHI, dtype=torch.float32,
                                   memory_format=torch.contiguous_format)
    grad_b13_EF = torch.zeros(w13_EFH.shape[:2], dtype=torch.float32, device=x_TH.device)
    grad_b2_EH = torch.zeros(w2_EHI.shape[:2], dtype=torch.float32, device=x_TH.device)
    for e in range(num_experts):
        y_TH, gate_TI, up_TI, a_TI = _expert_forward(
            x_TH, w13_EFH[e], w2_EHI[e], _bias(b13_EF, e), _bias(b2_EH, e), act, alpha, limit)
        grad_weights_TE[:, e] = (grad_TH * y_TH).sum(-1)
        grad_y_TH = weights_TE[:, e:e + 1] * grad_TH
        grad_w2_EHI[e] = grad_y_TH.t() @ a_TI
        grad_b2_EH[e] = grad_y_TH.sum(0)
        grad_gate_TI, grad_up_TI = activation_backward(grad_y_TH @ w2_EHI[e].float(), gate_TI,
                                                       up_TI, act, alpha, limit)
        grad_h_TF = torch.cat([grad_gate_TI, grad_up_TI], dim=-1)
        grad_w13_EFH[e] = grad_h_TF.t() @ x_TH
        grad_b13_EF[e] = grad_h_TF.sum(0)
        grad_x_TH += grad_h_TF @ w13_EFH[e].float()
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


def supports(spec, cfg, device, dtype) -> Optional[str]:
    return None


define_backend_ops(NAMESPACE, {"route": route, "experts": experts,
                               "experts_backward": experts_backward,
                               "experts_rows": experts_rows})

REGISTRY.register_experts(ExpertsBackend(
    name="reference", namespace=NAMESPACE, layout="rows", supports=supports, priority=0,
    description="plain PyTorch, dense over experts; the correctness oracle"))
