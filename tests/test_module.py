"""`torch_moe_ops.MoE` against a dense fp64 formula of the whole block.

Legend: B batch, S sequence, T = B*S tokens, H hidden size, I expert intermediate
size, E experts, K experts per token, G expert groups.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import torch_moe_ops as tmo

CONFIGS = {
    "mixtral": tmo.MoEConfig(hidden_size=16, intermediate_size=8, num_experts=8, top_k=2,
                             scoring="softmax", renormalize=True),
    "qwen2_shared_gate": tmo.MoEConfig(hidden_size=16, intermediate_size=8, num_experts=8,
                                       top_k=4, scoring="softmax",
                                       shared_expert_intermediate_size=12,
                                       shared_expert_gate=True),
    "deepseek_v3_shared": tmo.MoEConfig(hidden_size=16, intermediate_size=8, num_experts=16,
                                        top_k=4, scoring="sigmoid", renormalize=True,
                                        correction_bias=True, num_expert_groups=4,
                                        topk_groups=2, routed_scaling_factor=2.5,
                                        shared_expert_intermediate_size=12),
    "gpt_oss": tmo.MoEConfig(hidden_size=16, intermediate_size=8, num_experts=8, top_k=2,
                             scoring="topk_softmax", router_bias=True, activation="swiglu_oai",
                             expert_bias=True, swiglu_limit=1.0),
}


def make_moe(name: str, generator: torch.Generator) -> tmo.MoE:
    moe = tmo.MoE(CONFIGS[name])
    with torch.no_grad():  # nonzero biases everywhere, so that a dropped one shows
        for param in moe.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5)
        if moe.e_score_correction_bias is not None:
            moe.e_score_correction_bias.copy_(torch.rand(16, generator=generator) * 0.3)
    return moe


def dense_routing_formula(x_TH, moe: tmo.MoE):
    """fp64 routing weights per expert ``[T, E]`` (0 for experts not chosen)."""
    cfg = moe.cfg
    logits_TE = x_TH @ moe.gate.weight.double().t()
    if moe.gate.bias is not None:
        logits_TE = logits_TE + moe.gate.bias.double()
    if cfg.scoring == "topk_softmax":
        chosen_TE = torch.zeros_like(logits_TE, dtype=torch.bool).scatter(
            1, logits_TE.topk(cfg.top_k).indices, True)
        masked_TE = logits_TE.masked_fill(~chosen_TE, -math.inf)
        return torch.softmax(masked_TE, dim=-1) * cfg.routed_scaling_factor
    scores_TE = torch.softmax(logits_TE, -1) if cfg.scoring == "softmax" else logits_TE.sigmoid()
    choice_TE = scores_TE.detach()
    if moe.e_score_correction_bias is not None:
        choice_TE = choice_TE + moe.e_score_correction_bias.double()
    num_tokens, G = choice_TE.shape[0], cfg.num_expert_groups
    choice_TGS = choice_TE.view(num_tokens, G, -1)
    group_scores_TG = choice_TGS.topk(2, dim=-1).values.sum(-1)
    kept_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter(
        1, group_scores_TG.topk(cfg.topk_groups, dim=-1).indices, True)
    choice_TE = choice_TGS.masked_fill(~kept_TG.unsqueeze(-1), -math.inf).view(num_tokens, -1)
    chosen_TE = torch.zeros_like(choice_TE, dtype=torch.bool).scatter(
        1, choice_TE.topk(cfg.top_k).indices, True)
    weights_TE = scores_TE * chosen_TE
    if cfg.renormalize:
        weights_TE = weights_TE / weights_TE.sum(-1, keepdim=True)
    return weights_TE * cfg.routed_scaling_factor


def gated_mlp_formula(x_TH, w13_FH, w2_HI, b13_F, b2_H, cfg):
    h_TF = x_TH @ w13_FH.double().t()
    if b13_F is not None:
        h_TF = h_TF + b13_F.double()
    gate_TI, up_TI = h_TF.chunk(2, dim=-1)
    if cfg.activation == "silu":
        a_TI = torch.nn.functional.silu(gate_TI) * up_TI
    elif cfg.activation == "gelu":
        a_TI = torch.nn.functional.gelu(gate_TI) * up_TI
    else:
        gate_TI = gate_TI.clamp(max=cfg.swiglu_limit)
        up_TI = up_TI.clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
        a_TI = (up_TI + 1) * gate_TI * torch.sigmoid(cfg.swiglu_alpha * gate_TI)
    y_TH = a_TI @ w2_HI.double().t()
    return y_TH if b2_H is None else y_TH + b2_H.double()


def moe_formula(x_TH, moe: tmo.MoE):
    """The block in fp64, dense over experts: sum_e weight[t, e] * expert_e(x[t]) + shared."""
    x_TH = x_TH.double()
    weights_TE = dense_routing_formula(x_TH, moe)
    out_TH = torch.zeros_like(x_TH)
    for e in range(moe.cfg.num_experts):
        out_TH = out_TH + weights_TE[:, e:e + 1] * gated_mlp_formula(
            x_TH, moe.w13[e], moe.w2[e], None if moe.b13 is None else moe.b13[e],
            None if moe.b2 is None else moe.b2[e], moe.cfg)
    shared = moe.shared_experts
    if shared is not None:
        y_TH = gated_mlp_formula(x_TH, shared.w13, shared.w2, None, None, moe.cfg)
        if shared.gate is not None:
            y_TH = torch.sigmoid(x_TH @ shared.gate.weight.double().t()) * y_TH
        out_TH = out_TH + y_TH
    return out_TH


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_moe_forward_matches_formula(name, generator, assert_close_for_dtype):
    moe = make_moe(name, generator)
    x_TH = torch.randn((10, 16), generator=generator)
    assert_close_for_dtype(moe(x_TH), moe_formula(x_TH, moe), torch.float32)


def test_swiglu_clamp_is_exercised_in_gpt_oss_config(generator):
    moe = make_moe("gpt_oss", generator)
    h_TEF = torch.einsum("th,efh->tef", torch.randn((10, 16), generator=generator),
                         moe.w13.detach())
    assert (h_TEF.abs() > moe.cfg.swiglu_limit).float().mean() > 0.1


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3_shared"])
def test_moe_batched_input_BSH(name, generator):
    moe = make_moe(name, generator)
    x_BSH = torch.randn((2, 5, 16), generator=generator)
    y_BSH = moe(x_BSH)
    assert y_BSH.shape == x_BSH.shape
    torch.testing.assert_close(y_BSH, moe(x_BSH.reshape(10, 16)).view(2, 5, 16))


@pytest.mark.parametrize("name", ["qwen2_shared_gate", "deepseek_v3_shared"])
def test_shared_experts_are_added(name, generator):
    moe = make_moe(name, generator)
    x_TH = torch.randn((6, 16), generator=generator)
    with torch.no_grad():
        routed_TH = moe.experts(x_TH, *moe.route(x_TH)[1:])
        shared_TH = moe.shared_experts(x_TH)
    assert shared_TH.abs().min() > 0
    torch.testing.assert_close(moe(x_TH), routed_TH + shared_TH)
    assert (moe.shared_experts.gate is not None) == moe.cfg.shared_expert_gate


def test_moe_zero_tokens(generator):
    moe = make_moe("deepseek_v3_shared", generator)
    y_TH = moe(torch.empty((0, 16)))
    assert y_TH.shape == (0, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_moe_low_precision_output_dtype(dtype, generator, assert_close_for_dtype):
    moe = make_moe("mixtral", generator).to(dtype)
    x_TH = torch.randn((6, 16), generator=generator).to(dtype)
    y_TH = moe(x_TH)
    assert y_TH.dtype == dtype
    assert_close_for_dtype(y_TH, moe_formula(x_TH, moe), dtype)


def test_moe_to_bf16_with_correction_bias(generator):
    moe = make_moe("deepseek_v3_shared", generator).to(torch.bfloat16)
    moe(torch.randn((4, 16), generator=generator).to(torch.bfloat16))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_moe_gradients_match_formula(name, generator, assert_grad_close_for_dtype):
    moe = make_moe(name, generator)
    x_TH = torch.randn((8, 16), generator=generator, requires_grad=True)
    upstream_TH = torch.randn((8, 16), generator=generator)
    (moe(x_TH) * upstream_TH).sum().backward()
    grads = {n: p.grad for n, p in moe.named_parameters()}
    grad_x_TH = x_TH.grad
    for name_, grad in grads.items():
        assert grad is not None, name_
        assert torch.isfinite(grad).all(), name_
        assert grad.abs().sum() > 0, name_

    moe.zero_grad()
    x_TH.grad = None
    (moe_formula(x_TH, moe) * upstream_TH.double()).sum().backward()
    assert_grad_close_for_dtype(grad_x_TH, x_TH.grad, torch.float32)
    for name_, param in moe.named_parameters():
        assert_grad_close_for_dtype(grads[name_], param.grad, torch.float32)


EXTRA_REPRS = {
    "mixtral": "experts=8, top_k=2, hidden=16, intermediate=8, scoring=softmax, "
               "activation=silu, renormalize",
    "deepseek_v3_shared": "experts=16, top_k=4, hidden=16, intermediate=8, scoring=sigmoid, "
                          "activation=silu, renormalize, groups=2/4, scale=2.5",
    "gpt_oss": "experts=8, top_k=2, hidden=16, intermediate=8, scoring=topk_softmax, "
               "activation=swiglu_oai, expert_bias",
}


@pytest.mark.parametrize("name", sorted(EXTRA_REPRS))
def test_extra_repr(name):
    moe = tmo.MoE(CONFIGS[name])
    assert moe.extra_repr() == EXTRA_REPRS[name]
    assert repr(moe).splitlines()[:2] in (["MoE(", "  " + EXTRA_REPRS[name]],
                                          [f"MoE({EXTRA_REPRS[name]})"])


def test_available_backends_lists_reference_and_none():
    table = tmo.available_backends()
    by_name = {(s.kind, s.name): s for s in table}
    assert by_name[("experts", "reference")].available
    assert by_name[("a2a", "none")].available
    lines = str(table).splitlines()
    assert re.fullmatch(r"kind\s+name\s+available\s+why not / what", lines[0])
    assert len(lines) == 1 + len(table)
    assert any(re.fullmatch(r"experts\s+reference\s+yes\s+plain PyTorch.*", line)
               for line in lines)
    assert any(re.fullmatch(r"a2a\s+none\s+yes\s+single device.*", line) for line in lines)
    # Columns line up: every row starts its "available" cell at the header's column.
    column = lines[0].index("available")
    assert all(line[column:].split()[0] in ("yes", "no", "available") for line in lines)


def test_available_backends_cpu_explicit():
    table = tmo.available_backends("cpu")
    assert {("experts", "reference"), ("a2a", "none")} <= {
        (s.kind, s.name) for s in table if s.available}
