"""Float experts follow ``torch.autocast``: an fp32 module's experts compute in autocast's
dtype (as transformers' experts and ``nn.Linear`` do), eagerly and compiled, and the
gradients reach the fp32 parameters; the router stays fp32 (tests/test_router_autocast.py).

Legend: T tokens, H hidden size, E experts, K experts per token.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import torch_moe_ops as tmo

T, H, I, E, K = 24, 64, 32, 8, 2
CFG = tmo.MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K)
BF16_TOL = {"rtol": 1.6e-2, "atol": 1e-2}


def in_bf16_autocast(fn, *args):
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        return fn(*args)


def bf16_experts(moe: tmo.MoE, x_TH: torch.Tensor) -> torch.Tensor:
    """What the module's experts give on bf16 copies of ``x`` and of their weights, routed
    by the fp32 router."""
    _, weights_TK, ids_TK = moe.route(x_TH)
    cfg = moe.cfg
    return torch.ops.moe.experts(x_TH.bfloat16(), weights_TK, ids_TK, moe.w13.bfloat16(),
                                 moe.w2.bfloat16(), None, None, cfg.activation,
                                 cfg.static_float("swiglu_alpha"),
                                 cfg.static_float("swiglu_limit"))


@pytest.fixture
def moe_and_x(generator):
    return tmo.MoE(CFG), torch.randn((T, H), generator=generator)


def test_experts_compute_in_the_autocast_dtype(moe_and_x):
    moe, x_TH = moe_and_x
    out_TH = in_bf16_autocast(moe, x_TH)
    assert out_TH.dtype == torch.bfloat16
    torch.testing.assert_close(out_TH, bf16_experts(moe, x_TH), rtol=0, atol=0)
    # Outside autocast nothing changes.
    assert moe(x_TH).dtype == torch.float32
    torch.testing.assert_close(out_TH.float(), moe(x_TH), **BF16_TOL)


def test_gradients_reach_the_fp32_parameters(moe_and_x):
    moe, x_TH = moe_and_x
    reference = copy.deepcopy(moe)
    in_bf16_autocast(moe, x_TH).float().square().sum().backward()
    reference(x_TH).square().sum().backward()
    for name in ("w13", "w2", "gate.weight"):
        grad = moe.get_parameter(name).grad
        assert grad is not None and grad.dtype == torch.float32, name
        torch.testing.assert_close(grad, reference.get_parameter(name).grad, rtol=5e-2,
                                   atol=5e-2 * grad.abs().max().item())


def test_compiled_under_autocast_matches_eager(moe_and_x, fresh_dynamo):
    moe, x_TH = moe_and_x
    counter = CompileCounterWithBackend(tmo.backend(inner="aot_eager"))
    compiled = torch.compile(moe, fullgraph=True, backend=counter)
    out_TH = in_bf16_autocast(compiled, x_TH)
    assert counter.frame_count == 1
    assert out_TH.dtype == torch.bfloat16
    torch.testing.assert_close(out_TH, in_bf16_autocast(moe, x_TH), rtol=0, atol=0)


def test_module_takes_autocast_dtype_input(moe_and_x):
    # Under autocast the block's input may come from a low-precision GEMM.
    moe, x_TH = moe_and_x
    out_TH = in_bf16_autocast(moe, x_TH.bfloat16())
    torch.testing.assert_close(out_TH, bf16_experts(moe, x_TH.bfloat16()), rtol=0, atol=0)
    with pytest.raises(ValueError, match="x must have the module's dtype"):
        moe(x_TH.bfloat16())


def test_patched_transformers_block_follows_autocast():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=H, intermediate_size=64, moe_intermediate_size=I,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=E, num_experts_per_tok=K, norm_topk_prob=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    patched = copy.deepcopy(model)
    tmo.hf.patch(patched)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        want = model(ids).logits.float()
        got = patched(ids).logits.float()
        block_out_dtypes = []
        block = patched.model.layers[0].mlp
        block.register_forward_hook(lambda module, args, out: block_out_dtypes.append(
            (out[0] if isinstance(out, tuple) else out).dtype))
        patched(ids)
    assert block_out_dtypes == [torch.bfloat16]
    torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2 * want.abs().max().item())
