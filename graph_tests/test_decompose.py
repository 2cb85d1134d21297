"""What Inductor runs of a compiled MoE: backend ops traced into the graph.

Routing (the reference route) is always traced into the compiled graph, so
Inductor fuses its ops; the Triton and grouped_mm experts are traced in on
CUDA when the token count is fixed, so Inductor launches their kernels from its
own code. With a symbolic token count the experts op stays one node whose
kernels are chosen per call. Each op keeps its own backward.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code

import torch_moe_ops as tmo
from graph_tests.aot_graphs import AotGraphs
from torch_moe_ops.backends.triton import configs, fused
from torch_moe_ops.config import BackendSpec, QuantSpec

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

ROUTING = {
    "softmax": dict(scoring="softmax", renormalize=True),
    "sigmoid_groups": dict(scoring="sigmoid", correction_bias=True, num_expert_groups=4,
                           topk_groups=2, renormalize=True, routed_scaling_factor=2.5),
    "topk_softmax": dict(scoring="topk_softmax", router_bias=True),
}


@pytest.mark.parametrize("routing", sorted(ROUTING))
def test_route_traced_into_graph_with_its_own_backward(routing):
    cfg = tmo.MoEConfig(hidden_size=32, intermediate_size=16, num_experts=8, top_k=2,
                        **ROUTING[routing])
    torch.manual_seed(0)
    moe = tmo.MoE(cfg)
    if moe.e_score_correction_bias is not None:
        moe.e_score_correction_bias.normal_()
    x_TH = torch.randn(7, 32, requires_grad=True)
    expected_TH = moe(x_TH)
    expected_TH.square().sum().backward()
    expected_grads = [x_TH.grad.clone(), moe.gate.weight.grad.clone()]
    x_TH.grad = None
    moe.zero_grad()

    graphs = AotGraphs(BackendSpec(experts="reference"))
    out_TH = torch.compile(moe, backend=graphs, fullgraph=True)(x_TH)
    out_TH.square().sum().backward()

    forward, backward = graphs.codes
    assert "moe_reference.route" not in forward and "aten.topk" in forward
    # The backward is the op's closed form: selection held fixed, no top-k again.
    assert "aten.topk" not in backward
    torch.testing.assert_close(out_TH, expected_TH)
    for got, expected in zip([x_TH.grad, moe.gate.weight.grad], expected_grads):
        torch.testing.assert_close(got, expected)


def _moe_on_gpu(seed: int = 0) -> tmo.MoE:
    cfg = tmo.MoEConfig(hidden_size=256, intermediate_size=128, num_experts=16, top_k=4,
                        renormalize=True)
    torch.manual_seed(seed)
    return tmo.MoE(cfg, device="cuda", dtype=torch.bfloat16)


def _experts_problem(moe: tmo.MoE, num_tokens: int):
    """Tokens and their routing, computed eagerly once: the compiled experts and the
    reference then see the same routing (a recomputed one may break a near-tie
    differently)."""
    x_TH = torch.randn(num_tokens, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        _, weights_TK, ids_TK = moe.route(x_TH)
    return x_TH, weights_TK, ids_TK


def _experts_op(moe: tmo.MoE):
    def run(x_TH, weights_TK, ids_TK):
        return torch.ops.moe.experts(x_TH, weights_TK, ids_TK, moe.w13, moe.w2, None, None,
                                     "silu", 1.702, 7.0)

    return run


def _relative_error(out_TH, x_TH, weights_TK, ids_TK, moe) -> float:
    expected_TH = torch.ops.moe_reference.experts(x_TH, weights_TK, ids_TK, moe.w13, moe.w2,
                                                  None, None, "silu", 1.702, 7.0)
    return ((out_TH.float() - expected_TH.float()).norm() / expected_TH.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("experts", ["triton", "grouped_mm"])
@pytest.mark.parametrize("num_tokens", [1, 16, 1024])
def test_static_compile_launches_kernels_from_inductor(experts, num_tokens):
    moe = _moe_on_gpu()
    problem = _experts_problem(moe, num_tokens)
    compiled = torch.compile(_experts_op(moe), backend=tmo.backend(experts=experts),
                             fullgraph=True)
    with torch.no_grad():
        out_TH, codes = run_and_get_code(compiled, *problem)
    assert f"moe_{experts}.experts" not in "\n".join(codes)
    assert _relative_error(out_TH, *problem, moe) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_static_compile_runs_the_direct_kernels_in_k_parts(num_tokens, monkeypatch):
    """A direct config that cuts K into parts, traced: Inductor launches the parts'
    activation and sums every part, as the eager op does."""
    config = configs.KernelConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=1, num_warps=4,
                                num_stages=3, path="direct", SPLIT_K=4)
    monkeypatch.setattr(fused, "get_config", lambda *key: config)
    moe = _moe_on_gpu()
    problem = _experts_problem(moe, num_tokens)
    compiled = torch.compile(_experts_op(moe), backend=tmo.backend(experts="triton"),
                             fullgraph=True)
    with torch.no_grad():
        out_TH, codes = run_and_get_code(compiled, *problem)
    code = "\n".join(codes)
    assert "moe_triton.experts" not in code and "moe_direct_activate_kernel" in code
    assert _relative_error(out_TH, *problem, moe) < 1e-2


@pytest.mark.gpu
def test_static_compile_traces_the_whole_block():
    moe = _moe_on_gpu()
    x_TH = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(moe, backend=tmo.backend(experts="triton"), fullgraph=True)
    with torch.no_grad():
        _, codes = run_and_get_code(compiled, x_TH)
    code = "\n".join(codes)
    assert "moe_triton.experts" not in code and "moe_reference.route" not in code


@pytest.mark.gpu
def test_symbolic_token_count_keeps_experts_one_node():
    moe = _moe_on_gpu()
    counter = CompileCounterWithBackend(tmo.backend(experts="triton"))
    compiled = torch.compile(_experts_op(moe), backend=counter, fullgraph=True)
    problems = [_experts_problem(moe, num_tokens) for num_tokens in (5, 300)]
    for tensor in (tensor for problem in problems for tensor in problem):
        torch._dynamo.mark_dynamic(tensor, 0)
    with torch.no_grad():
        # run_and_get_code resets Dynamo before its call: the second size runs plainly,
        # on the graph compiled for the first.
        first_TH, codes = run_and_get_code(compiled, *problems[0])
        outs = [first_TH, compiled(*problems[1])]
    for out_TH, problem in zip(outs, problems):
        assert _relative_error(out_TH, *problem, moe) < 1e-2
    assert counter.frame_count == 1
    assert "moe_triton.experts" in "\n".join(codes)


@pytest.mark.gpu
@pytest.mark.parametrize("experts", ["triton", "grouped_mm"])
def test_traced_experts_keep_their_backward(experts):
    moe = _moe_on_gpu()
    x_TH = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    moe(x_TH).float().square().sum().backward()
    expected = [x_TH.grad.clone(), moe.w13.grad.clone(), moe.w2.grad.clone()]
    x_TH.grad = None
    moe.zero_grad()
    compiled = torch.compile(moe, backend=tmo.backend(experts=experts), fullgraph=True)
    compiled(x_TH).float().square().sum().backward()
    for got, want in zip([x_TH.grad, moe.w13.grad, moe.w2.grad], expected):
        assert (got.float() - want.float()).norm() <= 2e-2 * want.float().norm()


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 1024])
def test_mxfp4_experts_stay_one_node_reading_fragments(num_tokens):
    """MXFP4 layers' kernels read fragments prepared from the weights' values, which no
    traced body has: the op stays one node (its kernels launched at run time), and the
    compiled block matches the eager one; fp8 weights are traced in."""
    cfg = tmo.MoEConfig(hidden_size=256, intermediate_size=128, num_experts=16, top_k=4,
                        activation="swiglu_oai", expert_bias=True,
                        quant=QuantSpec("mxfp4"))
    torch.manual_seed(0)
    moe = tmo.MoE(cfg, device="cuda", dtype=torch.bfloat16)
    x_TH = torch.randn(num_tokens, 256, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(moe, backend=tmo.backend(experts="triton"), fullgraph=True)
    with torch.no_grad():
        expected_TH = moe(x_TH)
        out_TH, codes = run_and_get_code(compiled, x_TH)
    assert "moe_triton.experts_quant" in "\n".join(codes)
    torch.testing.assert_close(out_TH, expected_TH, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fragments", ["1", "0"], ids=["fragments", "stored"])
def test_only_mxfp4_quantized_experts_stay_one_node(fragments, monkeypatch):
    """The triton backend's rule for tracing its quantized experts in, on fake CUDA
    tensors (no GPU needed): fixed sizes on CUDA, and weights other than MXFP4, unless the
    kernels read MXFP4 as stored (``TORCH_MOE_OPS_MXFP4_FRAGMENTS=0``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torch_moe_ops.backends import triton as triton_backend
    from torch_moe_ops.backends.triton import mxfp4_fragments
    from torch_moe_ops.ops import argument_index

    monkeypatch.setenv(mxfp4_fragments.ENABLE_ENV, fragments)
    at = argument_index("moe_triton", "experts_quant", "weight_format")
    with FakeTensorMode():
        hidden_TH = torch.empty(8, 64, device="cuda", dtype=torch.bfloat16)
        args = [hidden_TH] + [None] * 14
        for weight_format, traced in (("mxfp4", fragments == "0"), ("fp8_channel", True),
                                      ("fp8_block", True)):
            args[at] = weight_format
            assert triton_backend._traced_unless_mxfp4(at, *args) is traced
