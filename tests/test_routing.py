"""``moe::route`` against the routing formulas of each model family, in fp64.

Legend: T tokens, E experts, K experts per token, G expert groups.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import formulas


@dataclasses.dataclass(frozen=True)
class Routing:
    """The static arguments of ``moe::route``."""

    num_experts: int
    top_k: int
    scoring: str
    renormalize: bool = False
    correction_bias: bool = False
    num_expert_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0

    def op_args(self, logits_TE: torch.Tensor, bias_E: torch.Tensor | None) -> tuple:
        return (logits_TE, bias_E, self.top_k, self.scoring, self.renormalize,
                self.num_expert_groups, self.topk_groups, self.routed_scaling_factor)


FAMILIES = {
    "softmax": Routing(8, 2, "softmax"),
    "softmax_renormalize": Routing(8, 2, "softmax", renormalize=True),
    "softmax_scaled": Routing(8, 3, "softmax", routed_scaling_factor=2.5),
    "softmax_groups": Routing(16, 3, "softmax", num_expert_groups=4, topk_groups=2),
    "topk_softmax_gpt_oss": Routing(8, 4, "topk_softmax"),
    "sigmoid": Routing(8, 2, "sigmoid"),
    "sigmoid_renormalize": Routing(8, 3, "sigmoid", renormalize=True),
    "sigmoid_bias": Routing(8, 2, "sigmoid", correction_bias=True, renormalize=True),
    "deepseek_v3": Routing(16, 4, "sigmoid", renormalize=True, correction_bias=True,
                           num_expert_groups=4, topk_groups=2, routed_scaling_factor=2.5),
    "deepseek_v3_no_renormalize": Routing(16, 4, "sigmoid", correction_bias=True,
                                          num_expert_groups=8, topk_groups=3,
                                          routed_scaling_factor=1.5),
}


def route_formula(logits_TE: torch.Tensor, bias_E: torch.Tensor | None, routing: Routing):
    """fp64 weights ``[T, K]`` and ids ``[T, K]``; differentiable in ``logits_TE``."""
    return formulas.route_formula(*routing.op_args(logits_TE, bias_E))


def make_logits(routing: Routing, num_tokens: int, generator: torch.Generator,
                dtype: torch.dtype = torch.float32):
    logits_TE = torch.randn((num_tokens, routing.num_experts), generator=generator).to(dtype)
    bias_E = (torch.rand(routing.num_experts, generator=generator) * 0.5
              if routing.correction_bias else None)
    return logits_TE, bias_E


def by_id(weights_TK: torch.Tensor, ids_TK: torch.Tensor):
    """Weights and ids with each token's slots sorted by id: order-insensitive comparison."""
    ids_TK, order_TK = ids_TK.long().sort(dim=-1)
    return weights_TK.gather(1, order_TK), ids_TK


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_route_matches_formula(family, generator, assert_close_for_dtype):
    routing = FAMILIES[family]
    logits_TE, bias_E = make_logits(routing, 16, generator)
    weights_TK, ids_TK = torch.ops.moe.route(*routing.op_args(logits_TE, bias_E))
    expected_weights_TK, expected_ids_TK = route_formula(logits_TE, bias_E, routing)

    assert ids_TK.shape == weights_TK.shape == (16, routing.top_k)
    assert (ids_TK.dtype, weights_TK.dtype) == (torch.int32, torch.float32)
    weights_TK, ids_TK = by_id(weights_TK, ids_TK)
    expected_weights_TK, expected_ids_TK = by_id(expected_weights_TK, expected_ids_TK)
    torch.testing.assert_close(ids_TK, expected_ids_TK, rtol=0, atol=0)
    assert_close_for_dtype(weights_TK, expected_weights_TK, torch.float32)


def test_correction_bias_changes_selection_not_weights(generator):
    # A large bias on expert 0 forces it into every token's choice; its weight
    # stays the unbiased sigmoid of its logit.
    routing = FAMILIES["sigmoid_bias"]
    logits_TE, _ = make_logits(routing, 8, generator)
    bias_E = torch.zeros(routing.num_experts)
    bias_E[0] = 10.0
    weights_TK, ids_TK = torch.ops.moe.route(
        *dataclasses.replace(routing, renormalize=False).op_args(logits_TE, bias_E))
    assert (ids_TK == 0).any(-1).all()
    slot_T = (ids_TK == 0).long().argmax(-1)
    weight_of_0_T = weights_TK.gather(1, slot_T.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(weight_of_0_T, torch.sigmoid(logits_TE[:, 0]))


@pytest.mark.parametrize("family", ["softmax_groups", "deepseek_v3", "deepseek_v3_no_renormalize"])
def test_group_limited_choice_stays_in_topk_groups(family, generator):
    routing = FAMILIES[family]
    logits_TE, bias_E = make_logits(routing, 32, generator)
    _, ids_TK = torch.ops.moe.route(*routing.op_args(logits_TE, bias_E))
    group_size = routing.num_experts // routing.num_expert_groups
    groups_used_T = [len(set(row)) for row in (ids_TK // group_size).tolist()]
    assert max(groups_used_T) <= routing.topk_groups
    # Without the group limit, some token would pick experts from more groups.
    ungrouped = dataclasses.replace(routing, num_expert_groups=1, topk_groups=1)
    _, free_ids_TK = torch.ops.moe.route(*ungrouped.op_args(logits_TE, bias_E))
    assert max(len(set(row)) for row in (free_ids_TK // group_size).tolist()) > \
        routing.topk_groups


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", ["softmax_renormalize", "topk_softmax_gpt_oss",
                                    "sigmoid_bias"])
def test_route_low_precision_logits(family, dtype, generator, assert_close_for_dtype):
    # Distinct logits k/4 are exact in bf16 and fp16: no ties after rounding.
    routing = FAMILIES[family]
    _, bias_E = make_logits(routing, 1, generator)
    perms_TE = torch.stack([torch.randperm(routing.num_experts, generator=generator)
                            for _ in range(8)])
    logits_TE = ((perms_TE - routing.num_experts / 2) / 4).to(dtype)
    weights_TK, ids_TK = torch.ops.moe.route(*routing.op_args(logits_TE, bias_E))
    assert weights_TK.dtype == torch.float32  # router weights stay fp32
    expected_weights_TK, expected_ids_TK = route_formula(logits_TE, bias_E, routing)
    weights_TK, ids_TK = by_id(weights_TK, ids_TK)
    expected_weights_TK, expected_ids_TK = by_id(expected_weights_TK, expected_ids_TK)
    torch.testing.assert_close(ids_TK, expected_ids_TK, rtol=0, atol=0)
    assert_close_for_dtype(weights_TK, expected_weights_TK, torch.float32)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_route_gradient_matches_autograd_of_formula(family, generator,
                                                    assert_grad_close_for_dtype):
    routing = FAMILIES[family]
    logits_TE, bias_E = make_logits(routing, 12, generator)
    # The loss reads each weight through its expert id, so slot order does not matter.
    upstream_TE = torch.randn(logits_TE.shape, generator=generator, dtype=torch.float64)

    logits_TE.requires_grad_(True)
    weights_TK, ids_TK = torch.ops.moe.route(*routing.op_args(logits_TE, bias_E))
    (weights_TK.double() * upstream_TE.gather(1, ids_TK.long())).sum().backward()

    logits64_TE = logits_TE.detach().double().requires_grad_(True)
    expected_weights_TK, expected_ids_TK = route_formula(logits64_TE, bias_E, routing)
    (expected_weights_TK * upstream_TE.gather(1, expected_ids_TK)).sum().backward()

    assert logits_TE.grad.dtype == torch.float32
    assert logits_TE.grad.abs().sum() > 0
    assert_grad_close_for_dtype(logits_TE.grad, logits64_TE.grad, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_route_gradient_has_logits_dtype(dtype, generator):
    logits_TE = torch.randn((4, 8), generator=generator).to(dtype).requires_grad_(True)
    weights_TK, _ = torch.ops.moe.route(logits_TE, None, 2, "softmax", True, 1, 1, 1.0)
    weights_TK.sum().backward()
    assert logits_TE.grad.dtype == dtype
    # Renormalized weights sum to 1 per token: the gradient of their sum is 0.
    assert logits_TE.grad.abs().max() < 1e-2


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_route_zero_tokens(family):
    routing = FAMILIES[family]
    logits_TE = torch.empty((0, routing.num_experts))
    bias_E = torch.zeros(routing.num_experts) if routing.correction_bias else None
    weights_TK, ids_TK = torch.ops.moe.route(*routing.op_args(logits_TE, bias_E))
    assert weights_TK.shape == ids_TK.shape == (0, routing.top_k)
    assert (weights_TK.dtype, ids_TK.dtype) == (torch.float32, torch.int32)


def test_top_k_equal_num_experts_takes_every_expert(generator):
    logits_TE = torch.randn((5, 4), generator=generator)
    weights_TK, ids_TK = torch.ops.moe.route(logits_TE, None, 4, "softmax", False, 1, 1, 1.0)
    assert (ids_TK.sort(-1).values == torch.arange(4, dtype=torch.int32)).all()
    torch.testing.assert_close(weights_TK.sum(-1), torch.ones(5))
    assert math.isclose(weights_TK.max().item(), torch.softmax(logits_TE, -1).max().item(),
                        rel_tol=1e-6)
