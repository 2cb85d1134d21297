"""Load balancing of an MoE block's routing: tokens per expert, the auxiliary losses
and DeepSeek-V3's auxiliary-loss-free bias update, as `MoE` computes them.

Legend: B sequences (1 where the loss takes the call's tokens as one batch),
S tokens per sequence, T tokens, E experts, K experts per token, X = S * K slots
of one sequence.

Everything here has static sizes and no host sync, so that it traces into a
compiled graph (``fullgraph=True``) and captures in CUDA graphs. The losses are
fp32 and differentiable in the router logits; the counts are int64 (exact at any
token count, and left alone by ``module.to(dtype)``).
"""

from __future__ import annotations

import torch

from torch_moe_ops import torch_compat


def router_probs(logits_TE: torch.Tensor, scoring: str) -> torch.Tensor:
    """``p [T, E]`` fp32, the probabilities the auxiliary losses balance: ``softmax(logits)``
    (for ``"topk_softmax"`` too: the distribution over every expert), and for ``"sigmoid"``
    DeepSeek-V3's normalized scores ``s / sum_e s`` with ``s = sigmoid(logits)``."""
    logits_TE = logits_TE.float()
    if scoring == "sigmoid":
        scores_TE = torch.sigmoid(logits_TE)
        return scores_TE / scores_TE.sum(dim=-1, keepdim=True)
    return torch.softmax(logits_TE, dim=-1)


def tokens_per_expert(topk_ids_BX: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``counts [B, E]`` int64: how many of each row's slots (``topk_ids [B, X]``, every
    id a global expert id) chose each expert."""
    ids_BX = topk_ids_BX.long()
    return ids_BX.new_zeros(ids_BX.shape[0], num_experts).scatter_add_(
        1, ids_BX, torch.ones_like(ids_BX))


def sum_over_group(counts_E: torch.Tensor, group_name: str) -> torch.Tensor:
    """``counts`` summed over the ranks of the process group ``group_name`` (a functional
    all-reduce, which traces into compiled graphs); ``counts`` itself for ``""``
    (no expert parallelism)."""
    if not group_name:
        return counts_E
    functional = torch_compat.c10d_functional
    return functional.wait_tensor(functional.all_reduce(counts_E, "sum", group_name))


def balance_loss(probs_BSE: torch.Tensor, counts_BE: torch.Tensor) -> torch.Tensor:
    """The Switch / GShard auxiliary loss of each of B groups of S tokens, averaged over
    the groups (DeepSeek-V3's sequence-wise loss where a group is a sequence):

        f[b, e] = counts[b, e] / sum_e counts[b, e]      (fraction of the slots)
        P[b, e] = mean_s probs[b, s, e]
        loss = mean_b E * sum_e f[b, e] * P[b, e]

    ``counts [B, E]`` may hold more tokens than ``probs`` (every expert-parallel rank's),
    ``probs [B, S, E]`` fp32 carries the gradient. Empty groups give 0."""
    num_groups, num_tokens, num_experts = probs_BSE.shape
    f_BE = counts_BE.float() / counts_BE.sum(dim=-1, keepdim=True).clamp_min(1)
    mean_probs_BE = probs_BSE.sum(dim=1) / max(num_tokens, 1)
    return num_experts * (f_BE * mean_probs_BE).sum() / max(num_groups, 1)


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss ``mean_t logsumexp(logits[t])^2`` (fp32; 0 for no tokens)."""
    return torch.logsumexp(logits_TE.float(), dim=-1).square().sum() / max(
        logits_TE.shape[0], 1)


@torch.no_grad()
def nudge_bias(correction_bias_E: torch.Tensor, load_E: torch.Tensor, speed: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free update, in place: each expert's correction bias
    rises by ``speed`` where it took fewer tokens than the mean, falls where it took
    more, ``bias_e += speed * sign(mean(load) - load_e)``; then ``load`` restarts at 0."""
    float_load_E = load_E.float()
    correction_bias_E.add_(torch.sign(float_load_E.mean() - float_load_E), alpha=speed)
    load_E.zero_()
