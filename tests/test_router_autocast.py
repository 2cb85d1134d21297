"""The router runs in fp32 under ``torch.autocast`` too: in bf16 its logits round
and tokens pick other experts than the fp32 router picks.

Legend: T tokens, H hidden size, E experts, K experts per token.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import torch_moe_ops as tmo

T, H, E, K = 256, 64, 64, 8
CFG = tmo.MoEConfig(hidden_size=H, intermediate_size=16, num_experts=E, top_k=K)


@pytest.fixture
def moe_and_x(generator):
    moe = tmo.MoE(CFG)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn((E, H), generator=generator) * H ** -0.5)
    return moe, torch.randn((T, H), generator=generator)


def route_in_bf16_autocast(route, x_TH):
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        return route(x_TH)


def test_bf16_router_would_pick_other_experts(moe_and_x):
    # What makes the tests below able to fail: bf16 logits change the choice.
    moe, x_TH = moe_and_x
    logits_TE = torch.nn.functional.linear(x_TH.bfloat16(), moe.gate.weight.bfloat16())
    ids_TK = logits_TE.float().topk(K).indices.sort(-1).values
    expected_TK = moe.route(x_TH)[2].long().sort(-1).values
    assert (ids_TK != expected_TK).any()


def test_router_is_fp32_under_autocast(moe_and_x):
    moe, x_TH = moe_and_x
    expected_logits_TE, expected_weights_TK, expected_ids_TK = moe.route(x_TH)
    logits_TE, weights_TK, ids_TK = route_in_bf16_autocast(moe.route, x_TH)
    assert logits_TE.dtype == torch.float32
    torch.testing.assert_close(logits_TE, expected_logits_TE, rtol=0, atol=0)
    torch.testing.assert_close(ids_TK, expected_ids_TK, rtol=0, atol=0)
    torch.testing.assert_close(weights_TK, expected_weights_TK, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_router_is_fp32_under_autocast(backend, moe_and_x, fresh_dynamo):
    moe, x_TH = moe_and_x
    expected_logits_TE, _, expected_ids_TK = moe.route(x_TH)
    counter = CompileCounterWithBackend(backend)
    route = torch.compile(moe.route, fullgraph=True, backend=counter)
    logits_TE, _, ids_TK = route_in_bf16_autocast(route, x_TH)
    assert counter.frame_count == 1
    assert logits_TE.dtype == torch.float32
    torch.testing.assert_close(logits_TE, expected_logits_TE, rtol=0, atol=0)
    torch.testing.assert_close(ids_TK, expected_ids_TK, rtol=0, atol=0)


def test_router_on_meta_device():
    # Autocast does not know the meta device: the router must not ask it.
    with torch.device("meta"):
        moe = tmo.MoE(CFG)
        logits_TE, _, ids_TK = moe.route(torch.empty(T, H))
    assert (logits_TE.shape, ids_TK.shape) == ((T, E), (T, K))
