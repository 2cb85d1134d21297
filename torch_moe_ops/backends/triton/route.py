"""``moe::route`` in one Triton kernel: scores, top-k choice, renormalization and scale.

Legend: T tokens, E experts, K experts per token.

One program per token holds its E logits in registers and computes, in fp32,
what the reference routing does (`torch_moe_ops.backends.reference.route`)::

    scores_E = softmax(logits_E) | sigmoid(logits_E) | logits_E (topk_softmax)
    choice_E = scores_E + correction_bias_E (when given)
    ids_K = the K best of choice_E, best first
    weights_K = scores_E[ids_K]; softmaxed (topk_softmax) or renormalized; * scaling

It replaces the several launches of the reference (softmax, ``torch.topk``'s
selection and sort, gather, sum, divide): one launch at decode, where
``torch.topk`` alone ran two kernels of 4-5 us each per layer, and one Python
launch in an eager forward. Expert groups (``num_expert_groups > 1``) are the
reference's and FlashInfer's.

- **Ties.** Among equal choices the lowest expert id is taken first, as
  ``torch.topk``'s selection does at the K-th value; a NaN choice counts as
  larger than every number (as in ``torch.topk``), so ids stay in range.
- **Precision.** Scores in fp32 whatever the logits' dtype (the contract's
  weights are fp32); fp64 logits are the reference's (`route_limits`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch_moe_ops.backends.common.kernels.launch import launcher, next_power_of_2
from torch_moe_ops.backends.triton.route_limits import SCORING_CODES


@triton.jit
def moe_route_topk_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts,
                          stride_logits_t, stride_logits_e, stride_bias, stride_weights_t,
                          stride_ids_t, scaling, TOP_K: tl.constexpr, SCORING: tl.constexpr,
                          RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    in_e = offs_e < num_experts
    logits = tl.load(logits_ptr + token * stride_logits_t + offs_e * stride_logits_e,
                     mask=in_e, other=float("-inf")).to(tl.float32)
    if SCORING == 0:
        exp = tl.exp(logits - tl.max(logits, axis=0))
        scores = exp / tl.sum(exp, axis=0)
    elif SCORING == 1:
        scores = tl.sigmoid(logits)
    else:
        scores = logits
    choice = scores
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_e * stride_bias, mask=in_e, other=0.0)
        choice = choice + bias.to(tl.float32)
    # NaN is the one value unequal to itself.
    choice = tl.where(choice != choice, float("inf"), choice)  # noqa: PLR0124
    # Experts still to choose from: the taken ones and the padding drop out even
    # where every choice left is -inf.
    open_e = in_e
    offs_k = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(tl.where(open_e, choice, float("-inf")), axis=0)
        chosen = tl.min(tl.where(open_e & (choice == best), offs_e, BLOCK_E), axis=0)
        weight = tl.sum(tl.where(offs_e == chosen, scores, 0.0), axis=0)
        weights = tl.where(offs_k == k, weight, weights)
        ids = tl.where(offs_k == k, chosen, ids)
        open_e = open_e & (offs_e != chosen)
    in_k = offs_k < TOP_K
    if SCORING == 2:
        exp_k = tl.where(in_k, tl.exp(weights - tl.max(tl.where(in_k, weights, float("-inf")),
                                                      axis=0)), 0.0)
        weights = exp_k / tl.sum(exp_k, axis=0)
    elif RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    weights = weights * scaling
    tl.store(weights_ptr + token * stride_weights_t + offs_k, weights, mask=in_k)
    tl.store(ids_ptr + token * stride_ids_t + offs_k, ids, mask=in_k)


def route(router_logits_TE: torch.Tensor, correction_bias_E: torch.Tensor | None,
          top_k: int, scoring: str, renormalize: bool, num_expert_groups: int,
          topk_groups: int, routed_scaling_factor: float):
    """``moe::route`` on one kernel launch: fp32 weights ``[T, K]``, int32 ids ``[T, K]``
    (best first), for a routing `route_limits.limits` lets through."""
    num_tokens, num_experts = router_logits_TE.shape
    topk_weights_TK = router_logits_TE.new_empty((num_tokens, top_k), dtype=torch.float32)
    topk_ids_TK = router_logits_TE.new_empty((num_tokens, top_k), dtype=torch.int32)
    if num_tokens == 0:
        return topk_weights_TK, topk_ids_TK
    block_e = next_power_of_2(num_experts)
    # An absent bias is never read (HAS_BIAS=False): the logits fill its slot.
    bias_E = router_logits_TE if correction_bias_E is None else correction_bias_E
    launcher(moe_route_topk_kernel)[(num_tokens,)](
        router_logits_TE, bias_E, topk_weights_TK, topk_ids_TK, num_experts,
        router_logits_TE.stride(0), router_logits_TE.stride(1), bias_E.stride(-1),
        topk_weights_TK.stride(0), topk_ids_TK.stride(0), float(routed_scaling_factor), TOP_K=top_k,
        SCORING=SCORING_CODES[scoring], RENORMALIZE=bool(renormalize),
        HAS_BIAS=correction_bias_E is not None, BLOCK_E=block_e,
        BLOCK_K=next_power_of_2(top_k), num_warps=max(1, min(8, block_e // 128)))
    return topk_weights_TK, topk_ids_TK
