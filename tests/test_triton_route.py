"""The ``triton`` route backend (``moe_triton_route::route``) against the routing formulas.

Legend: T tokens, E experts, K experts per token.

Without CUDA the kernel runs under the Triton interpreter on CPU tensors (fp32 and
fp16: the interpreter mishandles bf16); ``gpu`` tests add bf16, the models' sizes,
the automatic choice and a compiled decode step in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import torch_moe_ops as tmo
from test_flashinfer_route import SOFTMAX_TOY, lowered_route_ops
from test_routing import FAMILIES, Routing, by_id, make_logits, route_formula
from torch_moe_ops.backends import namespace_for
from torch_moe_ops.backends.problems import problem_of

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
UNGROUPED = sorted(name for name, routing in FAMILIES.items() if routing.num_expert_groups == 1)
# Sizes the kernel pads (E not a power of two, K not one either) and the models' own.
SIZES = {"E6_K2": Routing(6, 2, "softmax", renormalize=True),
         "E60_K3": Routing(60, 3, "sigmoid", renormalize=True, correction_bias=True)}
MODELS = {"qwen3": Routing(128, 8, "softmax", renormalize=True),
          "olmoe": Routing(64, 8, "softmax"),
          "mixtral": Routing(8, 2, "softmax", renormalize=True),
          "gpt_oss": Routing(32, 4, "topk_softmax"),
          "kimi_k2_ungrouped": Routing(384, 8, "sigmoid", renormalize=True,
                                       correction_bias=True, routed_scaling_factor=2.827),
          "qwen3_next": Routing(512, 10, "softmax", renormalize=True)}


def run(routing: Routing, logits_TE: torch.Tensor, bias_E: torch.Tensor | None):
    bias_E = None if bias_E is None else bias_E.to(DEVICE)
    return torch.ops.moe_triton_route.route(*routing.op_args(logits_TE.to(DEVICE), bias_E))


def assert_matches_formula(routing: Routing, logits_TE, bias_E, weights_TK, ids_TK):
    expected_weights_TK, expected_ids_TK = route_formula(logits_TE.cpu(), bias_E, routing)
    assert (ids_TK.dtype, weights_TK.dtype) == (torch.int32, torch.float32)
    # Best first, as the reference's sorted top-k: the same order, not only the same set.
    torch.testing.assert_close(ids_TK.cpu(), expected_ids_TK.int(), rtol=0, atol=0)
    torch.testing.assert_close(weights_TK.cpu().double(), expected_weights_TK,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", UNGROUPED + sorted(SIZES))
def test_kernel_matches_formula(family, generator):
    routing = {**FAMILIES, **SIZES}[family]
    logits_TE, bias_E = make_logits(routing, 16, generator)
    weights_TK, ids_TK = run(routing, logits_TE, bias_E)
    assert_matches_formula(routing, logits_TE, bias_E, weights_TK, ids_TK)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_kernel_reads_low_precision_and_strided_logits(dtype, generator):
    routing = SIZES["E60_K3"]
    wide_TE, bias_E = make_logits(dataclasses.replace(routing, num_experts=120), 8, generator)
    # A stride of 2 between experts, in the logits and the bias.
    logits_TE, bias_E = wide_TE.to(dtype)[:, ::2], bias_E[::2]
    weights_TK, ids_TK = torch.ops.moe_triton_route.route(
        *routing.op_args(logits_TE.to(DEVICE), bias_E.to(DEVICE)))
    assert_matches_formula(routing, logits_TE.float(), bias_E, weights_TK, ids_TK)


def test_ties_take_the_lowest_expert_first():
    routing = Routing(8, 3, "softmax")
    logits_TE = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, 0.0, 2.0, 0.0],
                              [-math.inf, 0.0, -math.inf, 0.0, -math.inf, -math.inf, -math.inf,
                               -math.inf]])
    weights_TK, ids_TK = run(routing, logits_TE, None)
    assert ids_TK.tolist() == [[1, 3, 6], [1, 3, 0]]
    assert weights_TK[1].tolist() == [0.5, 0.5, 0.0]


def test_nan_logits_keep_ids_in_range():
    routing = Routing(8, 2, "sigmoid")
    logits_TE = torch.zeros(2, 8)
    logits_TE[0, 5] = math.nan
    weights_TK, ids_TK = run(routing, logits_TE, None)
    assert ids_TK.tolist() == [[5, 0], [0, 1]]
    assert weights_TK[0, 0].isnan() and weights_TK[0, 1] == 0.5


def test_zero_tokens_launch_nothing():
    weights_TK, ids_TK = run(FAMILIES["softmax"], torch.empty(0, 8), None)
    assert weights_TK.shape == ids_TK.shape == (0, 2)


def test_op_refuses_expert_groups():
    routing = FAMILIES["deepseek_v3"]
    logits_TE, bias_E = make_logits(routing, 2, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=(
            r"^the triton route backend cannot run this routing: chooses among all experts "
            r"at once \(no expert groups\), got num_expert_groups=4$")):
        run(routing, logits_TE, bias_E)


@pytest.mark.parametrize(("routing", "reason"), [
    (Routing(8, 2, "softmax", num_expert_groups=2, topk_groups=1), "num_expert_groups=2"),
    (Routing(2048, 8, "softmax"), "needs num_experts <= 1024, got 2048"),
    (Routing(64, 33, "softmax"), "needs top_k <= 32, got 33")])
def test_supports_names_what_the_kernel_cannot_do(routing, reason):
    logits_TE = torch.zeros(1, routing.num_experts)
    problem = problem_of("route", routing.op_args(logits_TE, None))
    with pytest.raises(ValueError, match=reason):
        namespace_for("route", tmo.BackendSpec(route="triton"), torch.device(DEVICE), problem)
    float64 = problem_of("route", routing.op_args(logits_TE.double(), None))
    with pytest.raises(ValueError, match="float32, bfloat16 or float16 logits, got torch.float64"):
        namespace_for("route", tmo.BackendSpec(route="triton"), torch.device(DEVICE), float64)


# What the Triton interpreter does for CPU tensors: on a machine without a GPU only.
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(),
                                      reason="the Triton interpreter runs without a GPU")


@interpreter_only
def test_interpreter_runs_it_by_name_only():
    problem = problem_of("route", FAMILIES["softmax"].op_args(torch.zeros(1, 8), None))
    cpu = torch.device("cpu")
    assert namespace_for("route", tmo.BackendSpec(route="triton"), cpu, problem) == (
        "moe_triton_route")
    assert namespace_for("route", tmo.BackendSpec(), cpu, problem) == "moe_reference"


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_route_runs_the_kernel_and_the_contracts_gradient(generator):
    from torch._dynamo.testing import CompileCounterWithBackend

    routing = FAMILIES["softmax_renormalize"]
    counter = CompileCounterWithBackend(tmo.backend(route="triton", inner="aot_eager"))
    compiled = torch.compile(torch.ops.moe.route, backend=counter, fullgraph=True)
    logits_TE, _ = make_logits(routing, 6, generator)
    results = []
    for fn in (compiled, torch.ops.moe_reference.route):
        leaf_TE = logits_TE.clone().to(DEVICE).requires_grad_(True)
        weights_TK, ids_TK = fn(*routing.op_args(leaf_TE, None))
        (weights_TK * torch.arange(2.0, device=DEVICE)).sum().backward()
        results.append((*by_id(weights_TK.detach(), ids_TK), leaf_TE.grad))
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1


@interpreter_only
def test_lowered_graph_shows_the_kernel_by_name():
    assert lowered_route_ops(SOFTMAX_TOY, route="triton") == (
        "moe_triton_route::route\nmoe_cpu::experts")
    assert lowered_route_ops(SOFTMAX_TOY) == "moe_reference::route\nmoe_cpu::experts"


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_gpu_matches_formula_at_model_sizes(model, dtype, generator):
    routing = MODELS[model]
    # Distinct logits k/8 (exact in bf16 up to 512 experts): no ties after rounding.
    perms_TE = torch.stack([torch.randperm(routing.num_experts, generator=generator)
                            for _ in range(64)])
    logits_TE = ((perms_TE - routing.num_experts / 2) / 8).to(dtype)
    _, bias_E = make_logits(routing, 1, generator)
    weights_TK, ids_TK = run(routing, logits_TE, bias_E)
    assert_matches_formula(routing, logits_TE.float(), bias_E, weights_TK, ids_TK)


@gpu
def test_gpu_auto_takes_the_kernel_for_ungrouped_routing():
    cuda = torch.device("cuda")
    softmax = problem_of("route", MODELS["qwen3"].op_args(
        torch.zeros(1, 128, device=cuda, dtype=torch.bfloat16), None))
    assert namespace_for("route", tmo.BackendSpec(), cuda, softmax) == "moe_triton_route"
    grouped = problem_of("route", FAMILIES["softmax_groups"].op_args(
        torch.zeros(1, 16, device=cuda), None))
    assert namespace_for("route", tmo.BackendSpec(), cuda, grouped) == "moe_reference"


@gpu
@pytest.mark.usefixtures("fresh_dynamo")
def test_gpu_decode_step_in_a_cuda_graph_launches_the_kernel():
    cfg = tmo.MoEConfig(hidden_size=256, intermediate_size=128, num_experts=64, top_k=8,
                        renormalize=True)
    moe = tmo.MoE(cfg, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(moe, backend=tmo.backend(mode="reduce-overhead"), fullgraph=True)
    x_TH = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        out_TH = compiled(x_TH).clone()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        compiled(x_TH)
        torch.cuda.synchronize()
    kernels = [event.name for event in prof.events()
               if event.device_type == torch.autograd.DeviceType.CUDA]
    assert "moe_route_topk_kernel" in kernels
    assert not any("topk" in name.lower() and name != "moe_route_topk_kernel"
                   for name in kernels), kernels
    torch.testing.assert_close(out_TH, moe(x_TH), rtol=2e-2, atol=2e-2)
