"""``moe::route``: router logits to top-k expert weights and ids.

Legend: T tokens, E experts, K experts per token.
"""

from __future__ import annotations

import torch

from torch_moe_ops.config import SCORINGS
from torch_moe_ops.ops import checks
from torch_moe_ops.ops.library import GENERIC_NAMESPACE, OpContract, define

SCHEMA = ("(Tensor router_logits, Tensor? correction_bias, int top_k, str scoring, "
          "bool renormalize, int num_expert_groups, int topk_groups, "
          "float routed_scaling_factor) -> (Tensor topk_weights, Tensor topk_ids)")


def check(router_logits_TE, correction_bias_E, top_k, scoring, renormalize,
          num_expert_groups, topk_groups, routed_scaling_factor):
    checks.check_tensor("router_logits", router_logits_TE, 2, checks.OP_FLOAT_DTYPES)
    num_experts = router_logits_TE.shape[1]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts ({num_experts})], got {top_k}")
    checks.check_choice("scoring", scoring, SCORINGS)
    if correction_bias_E is not None:
        checks.check_tensor("correction_bias", correction_bias_E, 1, (torch.float32,))
        checks.check_size("correction_bias", correction_bias_E, 0, num_experts,
                          "router_logits.shape[1]")
        checks.check_same_device("router_logits", router_logits_TE,
                                 correction_bias=correction_bias_E)
        if scoring != "sigmoid":
            raise ValueError(f"correction_bias must be None unless scoring='sigmoid', "
                             f"got a tensor with scoring={scoring!r}")
    if num_expert_groups < 1 or num_experts % num_expert_groups:
        raise ValueError(f"num_expert_groups must be a positive divisor of num_experts "
                         f"({num_experts}), got {num_expert_groups}")
    if not 1 <= topk_groups <= num_expert_groups:
        raise ValueError(f"topk_groups must be in [1, num_expert_groups "
                         f"({num_expert_groups})], got {topk_groups}")
    if num_expert_groups > 1 and num_experts // num_expert_groups < 2:
        raise ValueError(f"num_expert_groups must leave at least 2 experts per group "
                         f"(num_experts={num_experts}), got {num_expert_groups}")
    eligible = topk_groups * (num_experts // num_expert_groups)
    if top_k > eligible:
        raise ValueError(f"top_k must be <= topk_groups * experts per group ({eligible}), "
                         f"got {top_k}")
    checks.check_positive("routed_scaling_factor", routed_scaling_factor)


def fake(router_logits_TE, correction_bias_E, top_k, *_):
    num_tokens = router_logits_TE.shape[0]
    topk_weights_TK = router_logits_TE.new_empty((num_tokens, top_k), dtype=torch.float32)
    topk_ids_TK = router_logits_TE.new_empty((num_tokens, top_k), dtype=torch.int32)
    return topk_weights_TK, topk_ids_TK


def setup_context(ctx, inputs, output):
    router_logits_TE, _, _, scoring, renormalize, *_, scale = inputs
    topk_weights_TK, topk_ids_TK = output
    ctx.save_for_backward(router_logits_TE, topk_weights_TK, topk_ids_TK)
    ctx.scoring, ctx.renormalize, ctx.scale = scoring, renormalize, scale
    ctx.mark_non_differentiable(topk_ids_TK)


def backward(ctx, grad_weights_TK, _grad_ids):
    """Gradient of the weights with respect to the logits, the selection held fixed.

    The weights depend on the logits only through the chosen entries:
    softmax+renormalize and topk_softmax are a softmax over the K chosen logits,
    softmax alone is the full softmax read at K entries, sigmoid is elementwise
    (then optionally divided by its sum). The correction bias and the expert
    groups only select. Computed in fp32 (fp64 for fp64 logits).
    """
    router_logits_TE, topk_weights_TK, topk_ids_TK = ctx.saved_tensors
    dtype = checks.compute_dtype(router_logits_TE.dtype)
    logits_TE = router_logits_TE.to(dtype)
    ids_TK = topk_ids_TK.long()
    grad_TK = grad_weights_TK.to(dtype) * ctx.scale
    weights_TK = topk_weights_TK.to(dtype) / ctx.scale
    if ctx.scoring == "softmax" and not ctx.renormalize:
        probs_TE = torch.softmax(logits_TE, dim=-1)
        grad_probs_TE = torch.zeros_like(logits_TE).scatter_add_(1, ids_TK, grad_TK)
        inner_T1 = (grad_probs_TE * probs_TE).sum(-1, keepdim=True)
        grad_logits_TE = probs_TE * (grad_probs_TE - inner_T1)
    else:
        if ctx.scoring == "sigmoid":
            sig_TK = torch.sigmoid(logits_TE.gather(1, ids_TK))
            if ctx.renormalize:
                inner_T1 = (grad_TK * weights_TK).sum(-1, keepdim=True)
                grad_sig_TK = (grad_TK - inner_T1) / sig_TK.sum(-1, keepdim=True)
            else:
                grad_sig_TK = grad_TK
            grad_chosen_TK = grad_sig_TK * sig_TK * (1 - sig_TK)
        else:
            inner_T1 = (grad_TK * weights_TK).sum(-1, keepdim=True)
            grad_chosen_TK = weights_TK * (grad_TK - inner_T1)
        grad_logits_TE = torch.zeros_like(logits_TE).scatter_add_(1, ids_TK, grad_chosen_TK)
    return grad_logits_TE.to(router_logits_TE.dtype), None, None, None, None, None, None, None


CONTRACT = OpContract(name="route", schema=SCHEMA, check=check, fake=fake,
                      backward=backward, setup_context=setup_context)
route = define(GENERIC_NAMESPACE, CONTRACT)
