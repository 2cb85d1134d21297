"""What torch.compile sees of MoE models: one graph, no breaks, the lowered ops, one
compilation across token counts, gradients, and (GPU) CUDA-graph capture."""

from __future__ import annotations

import dataclasses

import expecttest
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import torch_moe_ops as tmo
from graph_tests.toy_model import CONFIGS, make_model
from torch_moe_ops.lowering import lower, moe_op_sequence

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

MODEL_NAMES = sorted(CONFIGS)


def _ids(num_tokens: int, device="cpu", seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (1, num_tokens), generator=generator).to(device)  # [B=1, S=T]


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_one_graph_no_breaks(name):
    model = make_model(name)
    explanation = torch._dynamo.explain(model)(_ids(9))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_compiled_matches_eager(name):
    model = make_model(name)
    compiled = torch.compile(model, backend=tmo.backend(inner="aot_eager"), fullgraph=True)
    ids = _ids(11)
    torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_inductor_matches_eager():
    model = make_model("deepseek", num_layers=1)
    compiled = torch.compile(model, backend=tmo.backend(), fullgraph=True)
    ids = _ids(11)
    torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_entry_point_backend_by_name():
    model = make_model("mixtral", num_layers=1)
    compiled = torch.compile(model, backend="moe", fullgraph=True)
    ids = _ids(5)
    torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["mixtral", "deepseek"])
def test_dynamic_token_count_compiles_once(name):
    model = make_model(name)
    counter = CompileCounterWithBackend(tmo.backend(inner="aot_eager"))
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for num_tokens in (2, 7, 64, 513):
        ids = _ids(num_tokens)
        torch._dynamo.mark_dynamic(ids, 1)
        torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1
    compiled(_ids(1))
    assert counter.frame_count <= 2


def test_dynamic_true_keeps_config_static():
    # dynamic=True makes float attributes symbolic unless they stay compile-time
    # constants; a symbolic routed_scaling_factor would mean an .item() and a recompile.
    model = make_model("deepseek")
    counter = CompileCounterWithBackend(tmo.backend(inner="aot_eager"))
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    for num_tokens in (3, 17, 40):
        ids = _ids(num_tokens)
        torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-5)
    # dynamic=True also hands the backend an empty graph (a Dynamo artifact, seen
    # without any MoE op); count the graphs that compute something.
    graphs = [g for g in counter.graphs
              if any(node.op == "call_function" for node in g.graph.nodes)]
    assert len(graphs) == 1
    assert "2.5" in graphs[0].code


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_gradients_match_eager(name):
    model = make_model(name)
    compiled = torch.compile(model, backend=tmo.backend(inner="aot_eager"), fullgraph=True)
    ids = _ids(13)
    compiled(ids).square().mean().backward()
    compiled_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(ids).square().mean().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(compiled_grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


class TestLoweredGraph(expecttest.TestCase):
    def lowered_ops(self, name: str, **backend_args) -> str:
        seen = []
        spec = tmo.backend(inner="eager", **backend_args).spec

        def record(gm, example_inputs):
            seen.append(moe_op_sequence(lower(gm, spec)))
            return gm

        torch._dynamo.reset()
        torch.compile(make_model(name), backend=record, fullgraph=True)(_ids(6))
        return "\n".join(seen)

    def test_two_layer_model(self):
        # experts="auto" for CPU tensors: the cpu backend; routing runs on the reference.
        self.assertExpectedInline(self.lowered_ops("deepseek"), """\
moe_reference::route
moe_cpu::experts
moe_reference::route
moe_cpu::experts""")

    def test_explicit_reference(self):
        self.assertExpectedInline(self.lowered_ops("gpt_oss", experts="reference"), """\
moe_reference::route
moe_reference::experts
moe_reference::route
moe_reference::experts""")

    def test_graph_without_moe_ops_is_unchanged(self):
        gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
        before = gm.code
        self.assertIs(lower(gm, tmo.BackendSpec()), gm)
        self.assertEqual(gm.code, before)


GPU_CASES = [("reference", torch.float32)] + [
    (experts, torch.bfloat16) for experts in ("reference", "grouped_mm", "triton")]


@pytest.mark.gpu
@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("experts,dtype", GPU_CASES)
def test_reduce_overhead_replays_cuda_graphs(name, experts, dtype):
    """A 4-layer model under CUDA graphs replays fresh inputs with no re-capture.
    In fp32 it must match eager; in bf16 (where Inductor's fp32 RMSNorm and
    near-tied routing make eager a poor yardstick) it must match the same graph
    compiled without CUDA graphs."""
    model = make_model(name, device="cuda", dtype=dtype, num_layers=4)
    compiled = torch.compile(model, backend=tmo.backend(experts=experts,
                                                         mode="reduce-overhead"),
                             fullgraph=True)
    expected = model if dtype == torch.float32 else torch.compile(
        model, backend=tmo.backend(experts=experts), fullgraph=True)
    tolerance = 1e-3 if dtype == torch.float32 else 1e-2
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        for step in range(4):
            ids = _ids(32, "cuda", seed=step)
            out = compiled(ids).clone()
            torch.testing.assert_close(out, expected(ids), rtol=tolerance, atol=tolerance)
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0
    # Warm-up, one recording, then replays: the tree records exactly one graph.
    tree_manager = torch._inductor.cudagraph_trees.get_container(0).tree_manager
    assert next(tree_manager.graph_counter) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_manual_cuda_graph_capture_and_replay(name):
    model = make_model(name, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model, backend=tmo.backend(inner="aot_eager"), fullgraph=True)
    static_ids = _ids(24, "cuda", seed=0)
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                compiled(static_ids)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = compiled(static_ids)
        for seed in (5, 6):
            fresh = _ids(24, "cuda", seed=seed)
            static_ids.copy_(fresh)
            static_out.fill_(float("nan"))
            graph.replay()
            torch.testing.assert_close(static_out, model(fresh), rtol=2e-2, atol=2e-2)


def test_supports_sees_the_layer_problem(monkeypatch):
    """The compile backend hands every `supports` the layer's sizes, dtype and
    activation read from the graph, so a backend that cannot run the layer is
    refused when the model is compiled, with its reason."""
    from torch_moe_ops.backends.registry import REGISTRY

    seen = []
    reference = REGISTRY.experts["reference"]

    def recording_supports(spec, problem, device):
        seen.append(problem)
        return None if problem.hidden_size is None else f"refused H={problem.hidden_size}"

    monkeypatch.setitem(REGISTRY.experts, "reference", dataclasses.replace(
        reference, supports=recording_supports))
    model = make_model("mixtral", num_layers=1)
    cfg = model.blocks[0].moe.cfg
    compiled = torch.compile(model, backend=tmo.backend(experts="reference", inner="aot_eager"),
                             fullgraph=True)
    with pytest.raises(ValueError, match=f"^experts backend 'reference' is not available: "
                                         f"refused H={cfg.hidden_size}"):
        compiled(_ids(5))
    problem = seen[0]
    assert (problem.num_local_experts, problem.hidden_size, problem.intermediate_size,
            problem.top_k, problem.activation, problem.dtype) == (
        cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k, cfg.activation,
        torch.float32)


@pytest.mark.parametrize("grad", [True, False])
def test_training_graphs_take_the_training_priority(monkeypatch, grad):
    """``experts="auto"`` orders its candidates by ``training_priority`` where the
    experts' output requires grad in the traced graph (a training step), by
    ``priority`` under ``torch.no_grad()``."""
    from torch_moe_ops.backends.registry import REGISTRY

    seen = []

    def recording_supports(spec, problem, device):
        seen.append(problem.training)

    # Of the two CPU backends, "cpu" comes first by priority; here "reference"
    # comes first in training.
    monkeypatch.setitem(REGISTRY.experts, "reference", dataclasses.replace(
        REGISTRY.experts["reference"], supports=recording_supports, training_priority=100))
    moe = tmo.MoE(tmo.MoEConfig(hidden_size=16, intermediate_size=8, num_experts=4, top_k=2))
    counter = torch._dynamo.testing.CompileCounterWithBackend(tmo.backend(inner="aot_eager"))
    compiled = torch.compile(moe, backend=counter, fullgraph=True)
    with torch.set_grad_enabled(grad):
        compiled(torch.randn(5, 16))
    graph = counter.graphs[0]
    targets = {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}
    chosen = "moe_reference.experts" if grad else "moe_cpu.experts"
    assert chosen in targets, targets
    assert (True in seen) == grad
