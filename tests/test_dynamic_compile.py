"""Config floats reach the ops as compile-time constants when shapes are dynamic:
no ``.item()``, no float graph input, one compilation for every T.

Legend: T tokens, H hidden size.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import torch_moe_ops as tmo

H = 16
CFG = tmo.MoEConfig(hidden_size=H, intermediate_size=8, num_experts=8, top_k=2,
                    routed_scaling_factor=2.5, activation="swiglu_oai", swiglu_alpha=1.5,
                    swiglu_limit=3.0, shared_expert_intermediate_size=8)
# Tensor.item() in a Dynamo graph, aten._local_scalar_dense after AOTAutograd.
SCALAR_READS = ("item", "_local_scalar_dense")


def scalar_inputs_and_reads(graph_module: torch.fx.GraphModule) -> list[str]:
    """Graph inputs that hold one number (a 0-d tensor or a symbolic float) and
    nodes that read a number back from a tensor."""
    found = []
    for node in graph_module.graph.nodes:
        value = node.meta.get("example_value")
        if node.op == "placeholder" and (isinstance(value, torch.SymFloat) or (
                isinstance(value, torch.Tensor) and value.dim() == 0)):
            found.append(f"input {node.name}")
        target = node.target if node.op == "call_method" else str(node.target)
        if node.op in ("call_method", "call_function") and target.endswith(SCALAR_READS):
            found.append(f"read {node.name}")
    return found


def op_float_args(graph_module: torch.fx.GraphModule) -> dict:
    """The float arguments each ``moe::*`` call of the graph received, by op name."""
    calls = {}
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and str(node.target).startswith("moe."):
            name = str(node.target).split(".")[1]
            calls[name] = [a for a in node.args if isinstance(a, (float, torch.SymFloat))]
    return calls


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_dynamic_compile_keeps_config_floats_constant(backend, generator, fresh_dynamo):
    moe = tmo.MoE(CFG)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(moe, dynamic=True, fullgraph=True, backend=counter)
    for num_tokens in (5, 9):
        x_TH = torch.randn((num_tokens, H), generator=generator)
        torch.testing.assert_close(compiled(x_TH), moe(x_TH))
    assert counter.frame_count == 1
    (graph_module,) = counter.graphs
    assert scalar_inputs_and_reads(graph_module) == []
    assert op_float_args(graph_module) == {"route": [2.5], "experts": [1.5, 3.0]}


def test_mark_dynamic_with_two_configs_keeps_floats_constant(generator, fresh_dynamo):
    # A float that differs between calls makes Dynamo retrace it as a graph input
    # (automatic dynamic); the config's floats must stay constants there too.
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(lambda moe, x: moe(x), fullgraph=True, backend=counter)
    for cfg in (CFG, dataclasses.replace(CFG, swiglu_limit=5.0)):
        x_TH = torch.randn((6, H), generator=generator)
        torch._dynamo.mark_dynamic(x_TH, 0)
        compiled(tmo.MoE(cfg), x_TH)
    assert counter.frame_count == 2
    for graph_module in counter.graphs:
        assert scalar_inputs_and_reads(graph_module) == []
    assert op_float_args(counter.graphs[1])["experts"] == [1.5, 5.0]


def test_equal_configs_share_one_graph(generator, fresh_dynamo):
    # The floats are guarded by value: blocks built from equal configs reuse the graph.
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(lambda moe, x: moe(x), fullgraph=True, backend=counter)
    for cfg in (CFG, dataclasses.replace(CFG)):
        compiled(tmo.MoE(cfg), torch.randn((6, H), generator=generator))
    assert counter.frame_count == 1
