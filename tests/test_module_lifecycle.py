"""Deferred initialisation: build on the meta device, ``to_empty``, then
``reset_parameters()`` (what FSDP2 does) must leave no tensor of the block holding
uninitialised memory.

Legend: E experts, H hidden size.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_moe_ops as tmo

CONFIGS = {
    "deepseek_v3_shared": tmo.MoEConfig(hidden_size=16, intermediate_size=8, num_experts=8,
                                        top_k=2, scoring="sigmoid", renormalize=True,
                                        correction_bias=True, num_expert_groups=4,
                                        topk_groups=2, shared_expert_intermediate_size=12),
    "qwen2_shared_gate": tmo.MoEConfig(hidden_size=16, intermediate_size=8, num_experts=8,
                                       top_k=2, shared_expert_intermediate_size=12,
                                       shared_expert_gate=True),
    "gpt_oss": tmo.MoEConfig(hidden_size=16, intermediate_size=8, num_experts=8, top_k=2,
                             scoring="topk_softmax", router_bias=True, activation="swiglu_oai",
                             expert_bias=True),
}


def materialized_with_nan(cfg: tmo.MoEConfig) -> tmo.MoE:
    """The block built on meta and given CPU memory that holds NaN everywhere."""
    with torch.device("meta"):
        moe = tmo.MoE(cfg)
    moe.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in [*moe.parameters(), *moe.buffers()]:
            tensor.fill_(torch.nan)
    return moe


def every_tensor(moe: nn.Module) -> dict:
    return {**dict(moe.named_parameters()), **dict(moe.named_buffers())}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_reset_parameters_on_every_module_initialises_everything(name):
    moe = materialized_with_nan(CONFIGS[name])
    for module in moe.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    for tensor_name, tensor in every_tensor(moe).items():
        assert tensor.isfinite().all(), tensor_name
    if moe.e_score_correction_bias is not None:
        assert (moe.e_score_correction_bias == 0).all()
    assert moe(torch.randn(5, 16)).isfinite().all()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_reset_parameters_of_the_block_alone_initialises_everything(name):
    moe = materialized_with_nan(CONFIGS[name])
    moe.reset_parameters()
    for tensor_name, tensor in every_tensor(moe).items():
        assert tensor.isfinite().all(), tensor_name


def test_reset_parameters_initialises_like_nn_linear():
    cfg = CONFIGS["qwen2_shared_gate"]
    moe = materialized_with_nan(cfg)
    moe.reset_parameters()
    # nn.Linear's default: uniform(+-1/sqrt(fan_in)), not zeros and not constant.
    bound = cfg.hidden_size ** -0.5
    for weight in (moe.gate.weight, moe.shared_experts.gate.weight):
        assert weight.abs().max() <= bound and weight.std() > 0
