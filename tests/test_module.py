"""`torch_moe_ops.MoE` against an fp64 formula of the whole block (`formulas`).

Legend: B batch, S sequence, T = B*S tokens, H hidden size, I expert intermediate
size, E experts, K experts per token.
"""

from __future__ import annotations

import re

import pytest
import torch

import torch_moe_ops as tmo
from formulas import experts_formula, gated_mlp_formula, route_formula, sigmoid_formula
from torch_moe_ops.backends.registry import REGISTRY, Problem
from torch_moe_ops.config import BackendSpec

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


def moe_formula(x_TH, moe: tmo.MoE):
    """The block in fp64: the routing and the experts of `formulas`, plus the shared
    experts (gated by ``sigmoid(x @ gate.T)`` where the config asks)."""
    cfg = moe.cfg
    x_TH = x_TH.double()
    logits_TE = x_TH @ moe.gate.weight.double().T
    if moe.gate.bias is not None:
        logits_TE = logits_TE + moe.gate.bias.double()
    weights_TK, ids_TK = route_formula(logits_TE, moe.e_score_correction_bias, cfg.top_k,
                                       cfg.scoring, cfg.renormalize, cfg.num_expert_groups,
                                       cfg.topk_groups, cfg.routed_scaling_factor)
    out_TH = experts_formula(x_TH, weights_TK, ids_TK, moe.w13, moe.w2, moe.b13, moe.b2,
                             cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit)
    shared = moe.shared_experts
    if shared is not None:
        y_TH = gated_mlp_formula(x_TH, shared.w13, shared.w2, None, None, cfg.activation,
                                 cfg.swiglu_alpha, cfg.swiglu_limit)
        if shared.gate is not None:
            y_TH = sigmoid_formula(x_TH @ shared.gate.weight.double().T) * y_TH
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


def test_moe_to_bf16_with_correction_bias(generator, assert_close_for_dtype):
    # .to() casts the correction bias too; routing must still take it (as fp32).
    moe = make_moe("deepseek_v3_shared", generator).to(torch.bfloat16)
    x_TH = torch.randn((4, 16), generator=generator).to(torch.bfloat16)
    y_TH = moe(x_TH)
    assert y_TH.dtype == torch.bfloat16
    assert_close_for_dtype(y_TH, moe_formula(x_TH, moe), torch.bfloat16)


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
    *lines, auto, unsupported = str(table).splitlines()
    assert re.fullmatch(r"kind\s+name\s+available\s+backward\s+quantized\s+why not / what",
                        lines[0])
    assert len(lines) == 1 + len(table)
    assert any(re.fullmatch(r"experts\s+reference\s+yes\s+own\s+"
                            r"fp8_tensor,fp8_channel,fp8_block,mxfp4\s+plain PyTorch.*", line)
               for line in lines)
    assert any(re.fullmatch(r"experts\s+cpu\s+yes\s+own\s+-\s+only the chosen.*", line)
               for line in lines)
    assert any(re.fullmatch(r"a2a\s+none\s+yes\s+-\s+-\s+single device.*", line)
               for line in lines)
    assert any(re.fullmatch(r"route\s+reference\s+yes\s+-\s+-\s+plain PyTorch, every "
                            r"scoring.*", line) for line in lines)
    assert any(re.fullmatch(r"route\s+flashinfer\s+(yes\s+-\s+-\s+FlashInfer's fused"
                            r"|no\s+-\s+-\s+\S).*", line) for line in lines)
    assert auto.startswith("experts='auto' and route='auto' take the first available")
    assert unsupported.startswith("quantized formats not supported by any backend: nvfp4")
    # Columns line up: every row starts its "available" cell at the header's column.
    column = lines[0].index("available")
    assert all(line[column:].split()[0] in ("yes", "no", "available") for line in lines)


def test_available_backends_in_auto_order():
    """Experts and route backends are listed in the order "auto" tries them, and the
    one marked is the one the compile backend chooses."""
    cpu, problem = torch.device("cpu"), Problem(torch.float32)
    table = REGISTRY.status(cpu, torch.float32)
    chosen = {"experts": REGISTRY.choose_experts(BackendSpec(), problem, cpu).name,
              "route": REGISTRY.choose_route(BackendSpec(), problem, cpu).name}
    for kind, registered in (("experts", REGISTRY.experts), ("route", REGISTRY.route)):
        listed = [s.name for s in table if s.kind == kind]
        assert listed == sorted(registered, key=lambda name: -registered[name].priority)
        assert [s.name for s in table if s.kind == kind and s.auto] == [chosen[kind]]
    assert str(table).splitlines()[-2] == (
        "experts='auto' and route='auto' take the first available of their kind, in this "
        f"order: on cpu with torch.float32, experts={chosen['experts']!r} and "
        f"route={chosen['route']!r}")


def test_available_backends_cpu_explicit():
    table = tmo.available_backends("cpu")
    assert {("experts", "reference"), ("a2a", "none"), ("route", "reference")} <= {
        (s.kind, s.name) for s in table if s.available}
    assert {("route", "flashinfer")} <= {(s.kind, s.name) for s in table if not s.available}
