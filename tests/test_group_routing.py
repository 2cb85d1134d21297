"""Group-limited selection (``num_expert_groups > 1``) in every scoring family of
``moe::route``, ``topk_softmax`` included: the ids stay in the ``topk_groups``
groups with the best sum of their two best selection scores.

Legend: T tokens, E experts, K experts per token, G expert groups, S experts per group.
"""

from __future__ import annotations

import pytest
import torch

import torch_moe_ops as tmo

T, E, K, G, KEPT = 64, 16, 3, 4, 2
S = E // G
FAMILIES = ("softmax", "topk_softmax", "sigmoid")


def selection_scores(logits_TE: torch.Tensor, scoring: str) -> torch.Tensor:
    if scoring == "softmax":
        return torch.softmax(logits_TE.double(), dim=-1)
    if scoring == "sigmoid":
        return torch.sigmoid(logits_TE.double())
    return logits_TE.double()


def kept_groups(scores_TE: torch.Tensor) -> torch.Tensor:
    """``[T, G]`` bool: the `KEPT` groups with the best sum of their two best scores."""
    group_scores_TG = scores_TE.view(-1, G, S).topk(2, dim=-1).values.sum(-1)
    top_TG = group_scores_TG.topk(KEPT, dim=-1).indices
    return torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter(1, top_TG, True)


def route(logits_TE: torch.Tensor, scoring: str, groups: int = G, kept: int = KEPT):
    return torch.ops.moe.route(logits_TE, None, K, scoring, False, groups, kept, 1.0)


@pytest.mark.parametrize("scoring", FAMILIES)
def test_ids_stay_in_the_kept_groups(scoring, generator):
    logits_TE = torch.randn((T, E), generator=generator)
    _, ids_TK = route(logits_TE, scoring)
    kept_TG = kept_groups(selection_scores(logits_TE, scoring))
    assert kept_TG.gather(1, ids_TK.long() // S).all()
    # The best K experts of the kept groups.
    masked_TE = selection_scores(logits_TE, scoring).masked_fill(
        ~kept_TG.repeat_interleave(S, dim=1), -torch.inf)
    expected_TK = masked_TE.topk(K, dim=-1).indices
    assert (ids_TK.long().sort(-1).values == expected_TK.sort(-1).values).all()


@pytest.mark.parametrize("scoring", FAMILIES)
def test_without_groups_some_token_leaves_the_kept_groups(scoring, generator):
    # What makes the test above able to fail: ungrouped choices cross groups.
    logits_TE = torch.randn((T, E), generator=generator)
    _, ids_TK = route(logits_TE, scoring, groups=1, kept=1)
    kept_TG = kept_groups(selection_scores(logits_TE, scoring))
    assert not kept_TG.gather(1, ids_TK.long() // S).all()


def test_topk_softmax_weights_are_a_softmax_over_the_chosen_logits(generator):
    logits_TE = torch.randn((T, E), generator=generator)
    weights_TK, ids_TK = route(logits_TE, "topk_softmax")
    expected_TK = torch.softmax(logits_TE.double().gather(1, ids_TK.long()), dim=-1)
    torch.testing.assert_close(weights_TK.double(), expected_TK, rtol=1e-6, atol=1e-6)


def test_topk_softmax_group_gradient_holds_the_selection_fixed(generator):
    logits_TE = torch.randn((T, E), generator=generator).requires_grad_(True)
    upstream_TE = torch.randn((T, E), generator=generator, dtype=torch.float64)
    weights_TK, ids_TK = route(logits_TE, "topk_softmax")
    (weights_TK.double() * upstream_TE.gather(1, ids_TK.long())).sum().backward()

    logits64_TE = logits_TE.detach().double().requires_grad_(True)
    expected_TK = torch.softmax(logits64_TE.gather(1, ids_TK.long()), dim=-1)
    (expected_TK * upstream_TE.gather(1, ids_TK.long())).sum().backward()
    torch.testing.assert_close(logits_TE.grad.double(), logits64_TE.grad, rtol=1e-5, atol=1e-6)


def test_module_with_topk_softmax_groups_routes_within_them(generator):
    cfg = tmo.MoEConfig(hidden_size=8, intermediate_size=4, num_experts=E, top_k=K,
                        scoring="topk_softmax", num_expert_groups=G, topk_groups=KEPT)
    moe = tmo.MoE(cfg)
    logits_TE, _, ids_TK = moe.route(torch.randn((T, 8), generator=generator))
    assert kept_groups(logits_TE.detach()).gather(1, ids_TK.long() // S).all()
