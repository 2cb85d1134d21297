"""`ops.library.call`: an eager call without a gradient runs the op's kernel directly, with the
op's results and errors; a call that a gradient, a trace or a compiler could see runs the op.

Legend: T tokens, H hidden size, E experts, K experts per token.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_moe_ops as tmo
from test_bad_input import OP_CASES, exactly, expert_args
from torch_moe_ops.ops.library import call, runs_eagerly

EXPERTS = torch.ops.moe.experts.default
ROUTE = torch.ops.moe.route.default
ROUTE_STATIC = (2, "softmax", True, 1, 1, 1.0)  # top_k .. routed_scaling_factor


def _logits_TE():
    return torch.randn((5, 8), generator=torch.Generator().manual_seed(1))


class EagerCalls:
    """``ops.<name>(*args)`` is ``call(moe::<name>, *args)``."""

    def __getattr__(self, name: str):
        return lambda *args: call(getattr(torch.ops.moe, name), *args)


def test_the_kernel_runs_directly_with_the_ops_results():
    args = expert_args()
    assert runs_eagerly(EXPERTS, args)
    ours_TH = call(torch.ops.moe.experts, *args)
    torch.testing.assert_close(ours_TH, EXPERTS(*args), rtol=0, atol=0)
    route_args = (_logits_TE(), None, *ROUTE_STATIC)
    assert runs_eagerly(ROUTE, route_args)
    for ours, theirs in zip(call(torch.ops.moe.route, *route_args), ROUTE(*route_args)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("case", sorted(OP_CASES))
def test_bad_input_gets_the_ops_error(case):
    make_call, message = OP_CASES[case]
    with pytest.raises(ValueError, match=exactly(message)):
        make_call(EagerCalls())


def test_a_gradient_runs_the_op():
    hidden_TH, *rest = expert_args()
    hidden_TH.requires_grad_(True)
    args = (hidden_TH, *rest)
    assert not runs_eagerly(EXPERTS, args)
    out_TH = call(torch.ops.moe.experts, *args)
    assert out_TH.grad_fn is not None
    out_TH.sum().backward()
    assert hidden_TH.grad is not None and hidden_TH.grad.shape == hidden_TH.shape
    with torch.no_grad():
        assert runs_eagerly(EXPERTS, args)


def test_traced_or_unusual_calls_run_the_op():
    args = expert_args()
    with FakeTensorMode() as mode:
        fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                          for a in args)
        assert not runs_eagerly(EXPERTS, fake_args)
        assert call(torch.ops.moe.experts, *fake_args).shape == args[0].shape
    with torch.profiler.profile():
        assert not runs_eagerly(EXPERTS, args)
    # A tensor subclass, a device the kernels are not registered for, a missing argument,
    # a value of another type than the schema's: the op decides.
    meta_args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
    assert not runs_eagerly(EXPERTS, meta_args)
    assert not runs_eagerly(EXPERTS, args[:-1])
    assert not runs_eagerly(EXPERTS, (*args[:-1], "7.0"))
    assert not runs_eagerly(ROUTE, (_logits_TE(), None, 2.0, *ROUTE_STATIC[1:]))


def test_compiled_graphs_hold_the_ops(fresh_dynamo):
    graphs = []

    def keep(graph_module, _):
        graphs.append(graph_module.graph)
        return graph_module.forward

    moe = tmo.MoE(tmo.MoEConfig(hidden_size=16, intermediate_size=8, num_experts=4, top_k=2))
    x_TH = torch.randn(5, 16)
    with torch.no_grad():
        eager_TH = moe(x_TH)
        compiled_TH = torch.compile(moe, backend=keep, fullgraph=True)(x_TH)
    targets = {node.target for graph in graphs for node in graph.nodes}
    assert {torch.ops.moe.route, torch.ops.moe.experts} <= targets
    torch.testing.assert_close(compiled_TH, eager_TH, rtol=0, atol=0)
