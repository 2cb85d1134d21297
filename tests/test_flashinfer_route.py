"""The ``flashinfer`` route backend: its limits, how ``route="auto"`` and the
lowering choose it, and (GPU, with flashinfer-python) FlashInfer's kernel against
the reference routing.

On the CPU, FlashInfer's kernel is replaced by a stand-in that checks what it
receives as the real one does (dtypes, contiguity, sizes) and computes the
reference routing: the backend's own code (conversions, the bias it passes, its
outputs, its fake, its gradient) runs for real.

Legend: T tokens, E experts, K experts per token, G expert groups.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

import torch_moe_ops as tmo
from torch_moe_ops.backends import namespace_for
from torch_moe_ops.backends.flashinfer import route as fi_route
from torch_moe_ops.backends.registry import REGISTRY, Problem, Registry
from torch_moe_ops.lowering import lower, moe_op_sequence
from torch_moe_ops.lowering.plan import plan_layer

CPU = torch.device("cpu")
# (E, K, G, topk_groups, routed_scaling_factor)
DEEPSEEK_V3 = (256, 8, 8, 4, 2.5)
UNGROUPED = (128, 8, 1, 1, 1.0)


def deepseek_route(logits_TE, bias_E):
    """``moe::route`` with DeepSeek-V3's routing."""
    return torch.ops.moe.route(logits_TE, bias_E, 8, "sigmoid", True, 8, 4, 2.5)


def routing_problem(num_experts=256, top_k=8, groups=8, topk_groups=4, scoring="sigmoid",
                    renormalize=True, dtype=torch.float32) -> Problem:
    return Problem(dtype, num_experts=num_experts, top_k=top_k, scoring=scoring,
                   renormalize=renormalize, num_expert_groups=groups, topk_groups=topk_groups,
                   correction_bias=True)


LIMIT_CASES = {
    "softmax": (dict(scoring="softmax"), "computes scoring='sigmoid' only, got scoring='softmax'"),
    "topk_softmax": (dict(scoring="topk_softmax"),
                     "computes scoring='sigmoid' only, got scoring='topk_softmax'"),
    "no_renormalize": (dict(renormalize=False),
                       "always renormalizes the chosen weights, got renormalize=False"),
    "fp64_logits": (dict(dtype=torch.float64),
                    ("computes in fp32 from float32, bfloat16 or float16 logits, got "
                     "torch.float64")),
    "top_k_9": (dict(top_k=9), "needs top_k <= 8, got 9"),
    "ungrouped_385_experts": (dict(num_experts=385, groups=1, topk_groups=1),
                              "needs num_experts <= 384 without expert groups, got 385"),
    "16_groups": (dict(groups=16), "needs num_expert_groups <= 8, got 16"),
    "5_kept_groups": (dict(topk_groups=5), "needs topk_groups <= 4, got 5"),
    "64_experts_per_group": (
        dict(num_experts=512),
        "needs at most 32 experts per group (num_experts / num_expert_groups), got 512 / 8 = 64"),
}


@pytest.mark.parametrize("case", sorted(LIMIT_CASES))
def test_limits_name_what_the_kernel_cannot_do(case):
    fields, reason = LIMIT_CASES[case]
    assert fi_route.limits(routing_problem(**fields)) == reason


@pytest.mark.parametrize("routing", [
    dict(), dict(num_experts=384, groups=1, topk_groups=1), dict(top_k=1, groups=1, topk_groups=1),
    dict(dtype=torch.bfloat16), dict(dtype=torch.float16), dict(num_experts=64, topk_groups=1)])
def test_limits_let_through_what_the_kernel_runs(routing):
    assert fi_route.limits(routing_problem(**routing)) is None


def test_unknown_fields_rule_nothing_out():
    assert fi_route.limits(Problem(torch.bfloat16)) is None


def test_without_cuda_plan_and_table_agree():
    """Where the kernel cannot run at all, that is why it is not taken, whatever the layer's
    routing: the plan (what `tmo.explain` prints) gives `available_backends`' reason."""
    softmax = routing_problem(scoring="softmax", groups=1, topk_groups=1)
    refused = {name: reason for _, name, reason in
               plan_layer(tmo.BackendSpec(), softmax, CPU, routing=True).refused}
    statuses = {(s.kind, s.name): s for s in tmo.available_backends("cpu")}
    assert refused["flashinfer"] == statuses[("route", "flashinfer")].reason == (
        "needs a CUDA device, got cpu")


def test_without_cuda_says_why():
    reason = fi_route.supports(None, routing_problem(), CPU)
    assert reason == "needs a CUDA device, got cpu"
    statuses = {(s.kind, s.name): s for s in tmo.available_backends("cpu")}
    assert not statuses[("route", "flashinfer")].available
    assert statuses[("route", "flashinfer")].reason == reason
    assert statuses[("route", "reference")].available


def test_table_prints_route_rows():
    lines = str(tmo.available_backends("cpu")).splitlines()
    assert any(line.split()[:3] == ["route", "reference", "yes"] for line in lines)
    assert any(line.split()[:3] == ["route", "flashinfer", "no"]
               and line.endswith("needs a CUDA device, got cpu") for line in lines)


def test_choosing_flashinfer_by_name_without_cuda_names_the_reason():
    with pytest.raises(ValueError, match=(
            r"^route backend 'flashinfer' is not available: needs a CUDA device, got cpu; "
            r"available route backends on cpu with torch.float32: reference$")):
        REGISTRY.choose_route(tmo.BackendSpec(route="flashinfer"), routing_problem(), CPU)


def test_unregistered_route_backend_names_the_registered_ones():
    registry = Registry()
    registry.register_route(REGISTRY.route["reference"])
    with pytest.raises(ValueError, match=r"^route backend 'flashinfer' is not registered; "
                                         r"registered: reference$"):
        registry.choose_route(tmo.BackendSpec(route="flashinfer"), routing_problem(), CPU)


def test_spec_rejects_unknown_route_names():
    with pytest.raises(ValueError, match=r"^route must be one of 'auto', 'reference', "
                                         r"'triton', 'flashinfer', got 'cuda'$"):
        tmo.BackendSpec(route="cuda")
    with pytest.raises(ValueError, match="^route must be one of"):
        tmo.backend(route="nope")


@pytest.fixture
def cuda_allowed(monkeypatch):
    """The flashinfer route backend runs on the CPU: its device check passes,
    and FlashInfer's kernel is a stand-in (see the module docstring). Returns the
    stand-in's calls."""
    calls = []

    def fused_topk_deepseek(scores, bias, n_group, topk_group, topk, routed_scaling_factor,
                            topk_values, topk_indices, launch_with_pdl=True,
                            routing_replay_out=None, *, backend="default", skip_check=False):
        # What FlashInfer's NoAuxTc checks (csrc/fused_moe/noAuxTcKernels.cu).
        for tensor in (scores, bias, topk_values, topk_indices):
            assert tensor.is_contiguous()
        assert bias.shape == (scores.shape[1],) and bias.dtype == torch.float32
        assert topk_values.dtype == scores.dtype and topk_indices.dtype == torch.int32
        assert topk_values.shape == topk_indices.shape == (scores.shape[0], topk)
        calls.append(dict(scores=scores, bias=bias.clone(), skip_check=skip_check))
        weights, ids = torch.ops.moe_reference.route(scores, bias, topk, "sigmoid", True,
                                                     n_group, topk_group, routed_scaling_factor)
        topk_values.copy_(weights)
        topk_indices.copy_(ids)

    fused_moe = types.ModuleType("flashinfer.fused_moe")
    fused_moe.fused_topk_deepseek = fused_topk_deepseek
    package = types.ModuleType("flashinfer")
    package.fused_moe = fused_moe
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.fused_moe", fused_moe)
    monkeypatch.setattr(fi_route, "_device_reason", lambda device: None)
    return calls


def route_args(num_tokens, routing, dtype=torch.float32, bias=True, seed=0):
    num_experts, top_k, groups, topk_groups, scale = routing
    generator = torch.Generator().manual_seed(seed)
    logits_TE = torch.randn(num_tokens, num_experts, generator=generator).to(dtype)
    bias_E = torch.rand(num_experts, generator=generator) * 0.1 if bias else None
    return (logits_TE, bias_E, top_k, "sigmoid", True, groups, topk_groups, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_backend_feeds_the_kernel_fp32(cuda_allowed, dtype, bias):
    args = route_args(7, DEEPSEEK_V3, dtype, bias)
    # Stored transposed: the kernel reads dense rows, the backend must hand it some.
    logits_TE = args[0].t().contiguous().t()
    weights_TK, ids_TK = torch.ops.moe_flashinfer_route.route(logits_TE, *args[1:])
    expected = torch.ops.moe_reference.route(*args)
    assert weights_TK.dtype == torch.float32 and ids_TK.dtype == torch.int32
    torch.testing.assert_close((weights_TK, ids_TK), expected, rtol=0, atol=0)
    (call,) = cuda_allowed
    assert call["scores"].dtype == torch.float32 and call["skip_check"]
    torch.testing.assert_close(call["scores"], args[0].float(), rtol=0, atol=0)
    if not bias:
        assert (call["bias"] == 0).all()


def test_zero_tokens_launch_nothing(cuda_allowed):
    weights_TK, ids_TK = torch.ops.moe_flashinfer_route.route(*route_args(0, DEEPSEEK_V3))
    assert weights_TK.shape == ids_TK.shape == (0, 8) and not cuda_allowed


@pytest.mark.parametrize("case", ["softmax", "16_groups", "top_k_9"])
def test_kernel_refuses_what_it_cannot_compute(cuda_allowed, case):
    fields, reason = LIMIT_CASES[case]
    problem = routing_problem(**fields)
    args = (torch.randn(3, problem.num_experts), None, problem.top_k, problem.scoring, True,
            problem.num_expert_groups, problem.topk_groups, 1.0)
    with pytest.raises(ValueError, match=("^the flashinfer route backend cannot run this "
                                          f"routing: {reason}$")):
        torch.ops.moe_flashinfer_route.route(*args)
    assert not cuda_allowed


def test_refuses_on_a_device_it_does_not_run_on():
    with pytest.raises(ValueError, match="cannot run this routing: needs a CUDA device, got cpu"):
        torch.ops.moe_flashinfer_route.route(*route_args(3, DEEPSEEK_V3))


@pytest.mark.parametrize("case", ["deepseek_v3", "ungrouped_bf16_no_bias", "T0"])
def test_opcheck(cuda_allowed, case):
    num_tokens, routing, dtype, bias = {
        "deepseek_v3": (5, DEEPSEEK_V3, torch.float32, True),
        "ungrouped_bf16_no_bias": (5, UNGROUPED, torch.bfloat16, False),
        "T0": (0, DEEPSEEK_V3, torch.float32, True)}[case]
    logits_TE, *rest = route_args(num_tokens, routing, dtype, bias)
    torch.library.opcheck(torch.ops.moe_flashinfer_route.route,
                          (logits_TE.requires_grad_(True), *rest))


def test_gradient_is_the_contracts(cuda_allowed):
    logits_TE, *rest = route_args(6, DEEPSEEK_V3)
    grads = []
    for op in (torch.ops.moe_flashinfer_route.route, torch.ops.moe_reference.route):
        leaf_TE = logits_TE.clone().requires_grad_(True)
        weights_TK, _ = op(leaf_TE, *rest)
        (weights_TK * torch.arange(8.0)).sum().backward()
        grads.append(leaf_TE.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    assert grads[0].abs().sum() > 0


def test_auto_takes_flashinfer_where_it_runs_else_the_reference(cuda_allowed):
    spec = tmo.BackendSpec()
    assert namespace_for("route", spec, CPU, routing_problem()) == "moe_flashinfer_route"
    softmax = routing_problem(scoring="softmax", groups=1, topk_groups=1)
    assert namespace_for("route", spec, CPU, softmax) == "moe_reference"
    assert namespace_for("route", tmo.BackendSpec(route="reference"), CPU,
                         routing_problem()) == "moe_reference"
    with pytest.raises(ValueError, match=(
            r"^route backend 'flashinfer' is not available: computes scoring='sigmoid' only, "
            r"got scoring='softmax'; available route backends on cpu with torch.float32: "
            r"reference$")):
        namespace_for("route", tmo.BackendSpec(route="flashinfer"), CPU, softmax)


def test_auto_on_the_cpu_is_the_reference():
    assert namespace_for("route", tmo.BackendSpec(), CPU, routing_problem()) == "moe_reference"


def test_eager_module_routes_through_auto(cuda_allowed):
    cfg = tmo.MoEConfig(hidden_size=16, intermediate_size=8, num_experts=16, top_k=4,
                        scoring="sigmoid", renormalize=True, correction_bias=True,
                        num_expert_groups=4, topk_groups=2, routed_scaling_factor=2.5)
    moe = tmo.MoE(cfg)
    moe(torch.randn(5, 16))
    assert len(cuda_allowed) == 1


def lowered_route_ops(cfg: tmo.MoEConfig, **spec_args) -> str:
    """The custom ops of one MoE layer's Dynamo graph, lowered for
    ``BackendSpec(**spec_args)``."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(tmo.MoE(cfg), backend=capture, fullgraph=True)(torch.randn(6, cfg.hidden_size))
    torch._dynamo.reset()
    (gm,) = graphs
    return moe_op_sequence(lower(gm, tmo.BackendSpec(**spec_args)))


DEEPSEEK_TOY = tmo.MoEConfig(hidden_size=16, intermediate_size=8, num_experts=16, top_k=4,
                             scoring="sigmoid", renormalize=True, correction_bias=True,
                             num_expert_groups=4, topk_groups=2, routed_scaling_factor=2.5)
SOFTMAX_TOY = tmo.MoEConfig(hidden_size=16, intermediate_size=8, num_experts=8, top_k=2,
                            renormalize=True)


def test_lowered_graph_shows_the_chosen_route(cuda_allowed):
    assert lowered_route_ops(DEEPSEEK_TOY, route="flashinfer") == (
        "moe_flashinfer_route::route\nmoe_cpu::experts")
    assert lowered_route_ops(DEEPSEEK_TOY) == "moe_flashinfer_route::route\nmoe_cpu::experts"
    assert lowered_route_ops(SOFTMAX_TOY) == "moe_reference::route\nmoe_cpu::experts"


def test_lowering_refuses_flashinfer_for_routing_it_cannot_compute(cuda_allowed):
    with pytest.raises(ValueError, match="computes scoring='sigmoid' only, got scoring='softmax'"):
        lowered_route_ops(SOFTMAX_TOY, route="flashinfer")


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_route_runs_the_backend_and_its_gradient(cuda_allowed):
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend(tmo.backend(route="flashinfer", inner="aot_eager"))
    compiled = torch.compile(torch.ops.moe.route, backend=counter, fullgraph=True)
    logits_TE, bias_E, *_ = route_args(6, DEEPSEEK_V3)
    results = []
    for fn in (compiled, torch.ops.moe_reference.route):
        leaf_TE = logits_TE.clone().requires_grad_(True)
        weights_TK, ids_TK = fn(leaf_TE, bias_E, *route_args(6, DEEPSEEK_V3)[2:])
        (weights_TK * torch.arange(8.0)).sum().backward()
        results.append((weights_TK.detach(), ids_TK, leaf_TE.grad))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
    assert moe_op_sequence(counter.graphs[0]) == "moe_flashinfer_route::route"
    assert len(cuda_allowed) == 1


# GPU: FlashInfer's kernel itself.


def flashinfer_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return fi_route.supports(None, Problem(torch.float32), torch.device("cuda"))


def needs_flashinfer():
    reason = flashinfer_reason()
    if reason is not None:
        pytest.skip(f"flashinfer route backend: {reason}")


def decision_margins(logits_TE, bias_E, top_k, groups, topk_groups) -> torch.Tensor:
    """Per token, the narrowest gap in the reference's fp32 choice scores that decides
    its experts: between the last kept and the first dropped group, and between the
    last chosen and the first left expert of the kept groups. Where it is below fp32
    rounding, another correct kernel may choose otherwise."""
    choice_TE = logits_TE.float().sigmoid()
    if bias_E is not None:
        choice_TE = choice_TE + bias_E
    num_tokens, num_experts = choice_TE.shape
    margin_T = torch.full((num_tokens,), float("inf"), device=choice_TE.device)
    if groups > 1:
        choice_TGS = choice_TE.view(num_tokens, groups, num_experts // groups)
        group_scores_TG = choice_TGS.topk(2, dim=-1).values.sum(-1)
        ranked_TG, order_TG = group_scores_TG.sort(dim=-1, descending=True)
        if topk_groups < groups:
            margin_T = ranked_TG[:, topk_groups - 1] - ranked_TG[:, topk_groups]
        dropped_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(
            1, order_TG[:, topk_groups:], True)
        choice_TE = choice_TGS.masked_fill(dropped_TG.unsqueeze(-1), -float("inf")).view(
            num_tokens, num_experts)
    ranked_TE = choice_TE.sort(dim=-1, descending=True).values
    if top_k < num_experts:
        margin_T = torch.minimum(margin_T, ranked_TE[:, top_k - 1] - ranked_TE[:, top_k])
    return margin_T


def assert_matches_reference(args, weights_TK, ids_TK, tie=1e-5):
    """Same expert set per token as the reference, weights within fp32 rounding;
    a token whose choice is tied to within ``tie`` (bf16 logits that are equal, or
    scores closer than the kernel's and torch's sigmoids agree: with 1e-6, one of
    4096 fp32 tokens chose otherwise on an H200) may choose otherwise, and is not
    compared."""
    ref_weights_TK, ref_ids_TK = torch.ops.moe_reference.route(*args)
    assert weights_TK.dtype == torch.float32 and ids_TK.dtype == torch.int32
    ids_TK, order_TK = ids_TK.sort(dim=-1)
    ref_ids_TK, ref_order_TK = ref_ids_TK.sort(dim=-1)
    same_T = (ids_TK == ref_ids_TK).all(-1)
    logits_TE, bias_E, top_k, _, _, groups, topk_groups, _ = args
    tied_T = decision_margins(logits_TE, bias_E, top_k, groups, topk_groups) < tie
    assert (same_T | tied_T).all(), (
        f"{(~same_T & ~tied_T).sum().item()} of {len(same_T)} tokens chose other experts")
    torch.testing.assert_close(weights_TK.gather(1, order_TK)[same_T],
                               ref_weights_TK.gather(1, ref_order_TK)[same_T],
                               rtol=1e-5, atol=1e-6)


ROUTINGS = {"deepseek_v3": DEEPSEEK_V3, "ungrouped": UNGROUPED}


@pytest.mark.gpu
@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_gpu_matches_reference(routing, dtype, bias):
    needs_flashinfer()
    for num_tokens in (1, 7, 128, 4096):
        args = route_args(num_tokens, ROUTINGS[routing], dtype, bias, seed=num_tokens)
        args = (args[0].cuda(), None if args[1] is None else args[1].cuda(), *args[2:])
        assert_matches_reference(args, *torch.ops.moe_flashinfer_route.route(*args))


@pytest.mark.gpu
def test_gpu_zero_tokens_and_opcheck():
    needs_flashinfer()
    for num_tokens in (0, 5):
        logits_TE, bias_E, *rest = route_args(num_tokens, DEEPSEEK_V3)
        args = (logits_TE.cuda().requires_grad_(True), bias_E.cuda(), *rest)
        torch.library.opcheck(torch.ops.moe_flashinfer_route.route, args)


@pytest.mark.gpu
def test_gpu_gradient_matches_reference():
    needs_flashinfer()
    logits_TE, bias_E, *rest = route_args(64, DEEPSEEK_V3)
    grad_TK = torch.randn(64, 8, device="cuda")
    grads = []
    for op in (torch.ops.moe_flashinfer_route.route, torch.ops.moe_reference.route):
        leaf_TE = logits_TE.cuda().requires_grad_(True)
        (op(leaf_TE, bias_E.cuda(), *rest)[0] * grad_TK).sum().backward()
        grads.append(leaf_TE.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_gpu_compiled_fullgraph(mode):
    """``route="flashinfer"`` under torch.compile: the lowered graph calls the kernel,
    and (``reduce-overhead``) its CUDA graphs replay fresh logits correctly."""
    needs_flashinfer()
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend(tmo.backend(route="flashinfer", mode=mode))
    compiled = torch.compile(deepseek_route, backend=counter, fullgraph=True)
    for step in range(4):
        args = route_args(128, DEEPSEEK_V3, seed=step)
        logits_TE, bias_E = args[0].cuda(), args[1].cuda()
        weights_TK, ids_TK = compiled(logits_TE, bias_E)
        assert_matches_reference((logits_TE, bias_E, *args[2:]), weights_TK.clone(),
                                 ids_TK.clone())
    assert counter.frame_count == 1
    assert "moe_flashinfer_route::route" in moe_op_sequence(counter.graphs[0])


@pytest.mark.gpu
def test_gpu_captures_in_cuda_graph():
    needs_flashinfer()
    args = route_args(256, DEEPSEEK_V3)
    logits_TE, bias_E = args[0].cuda(), args[1].cuda()
    op = torch.ops.moe_flashinfer_route.route
    op(logits_TE, bias_E, *args[2:])  # builds and loads the JIT module outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights_TK, ids_TK = op(logits_TE, bias_E, *args[2:])
    fresh_TE = torch.randn_like(logits_TE)
    logits_TE.copy_(fresh_TE)
    weights_TK.fill_(float("nan"))
    graph.replay()
    assert_matches_reference((fresh_TE, bias_E, *args[2:]), weights_TK, ids_TK)


@pytest.mark.gpu
def test_gpu_module_auto_runs_flashinfer():
    """A DeepSeek-style MoE layer routes eagerly on the kernel (``route="auto"``)."""
    needs_flashinfer()
    cfg = DEEPSEEK_TOY
    moe = tmo.MoE(cfg, device="cuda")
    torch.nn.init.uniform_(moe.e_score_correction_bias, -0.1, 0.1)
    assert namespace_for("route", tmo.BackendSpec(), torch.device("cuda"),
                         Problem.from_config(cfg, torch.float32)) == "moe_flashinfer_route"
    with torch.no_grad():
        x_TH = torch.randn(32, cfg.hidden_size, device="cuda")
        logits_TE, weights_TK, ids_TK = moe.route(x_TH)
        args = (logits_TE, moe.e_score_correction_bias.float(), cfg.top_k, cfg.scoring,
                cfg.renormalize, cfg.num_expert_groups, cfg.topk_groups,
                cfg.routed_scaling_factor)
        assert_matches_reference(args, weights_TK, ids_TK)
        assert moe(x_TH).isfinite().all()
