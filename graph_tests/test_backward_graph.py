"""Which experts gradient a compiled graph runs: the lowering picks the experts
backend before AOTAutograd traces the backward, so the backward graph calls
the chosen backend's own ``experts_backward`` (or the reference's, for a backend
without one), and on the GPU the grouped_mm gradient is traced into it.

Legend: T tokens, H hidden size, I expert intermediate size, E experts,
K experts per token, R rows.
"""

from __future__ import annotations

import pytest
import torch

from graph_tests.aot_graphs import AotGraphs
from torch_moe_ops.config import BackendSpec

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

T, H, I, E, K = 9, 32, 16, 4, 2
BACKENDS = ["reference", "cpu", pytest.param("triton", marks=pytest.mark.triton)]


def make_leaves(device="cpu", dtype=torch.float32, num_tokens=T, hidden=H, inter=I,
                num_experts=E, top_k=K, seed=0) -> tuple:
    """``(hidden, topk_weights, topk_ids, w13, w2, b13, b2)``; floats require grad,
    every fourth slot is skipped."""
    generator = torch.Generator().manual_seed(seed)

    def leaf(*shape, scale=1.0):
        t = (torch.randn(shape, generator=generator) * scale).to(device, dtype)
        return t.requires_grad_(True)

    ids_TK = torch.rand((num_tokens, num_experts), generator=generator).topk(top_k).indices
    ids_TK.view(-1)[::4] = -1
    weights_TK = torch.rand((num_tokens, top_k), generator=generator).to(device)
    return (leaf(num_tokens, hidden), weights_TK.requires_grad_(True),
            ids_TK.to(device, torch.int32), leaf(num_experts, 2 * inter, hidden,
                                                 scale=hidden ** -0.5),
            leaf(num_experts, hidden, inter, scale=inter ** -0.5),
            leaf(num_experts, 2 * inter, scale=0.1), leaf(num_experts, hidden, scale=0.1))


def experts(hidden, weights, ids, w13, w2, b13, b2):
    return torch.ops.moe.experts(hidden, weights, ids, w13, w2, b13, b2, "silu", 1.702, 7.0)


def rows_chain(hidden, weights, ids, w13, w2, b13, b2):
    x_RH, expert_R, weight_R, src_R, count_E, combine_map_TK = torch.ops.moe.dispatch(
        hidden, weights, ids, w13.shape[0])
    y_RH = torch.ops.moe.experts_rows(x_RH, expert_R, count_E, w13, w2, b13, b2, "silu", 1.702,
                                      7.0)
    return torch.ops.moe.combine(y_RH, weight_R, src_R, combine_map_TK)


def grads_of(fn, leaves) -> list[torch.Tensor]:
    floats = [t for t in leaves if t.is_floating_point()]
    return list(torch.autograd.grad(fn(*leaves).float().square().sum(), floats))


@pytest.mark.parametrize("experts_backend", BACKENDS)
@pytest.mark.parametrize("fn", [experts, rows_chain], ids=["experts", "experts_rows"])
def test_backward_graph_calls_the_chosen_backends_gradient(experts_backend, fn):
    leaves = make_leaves()
    graphs = AotGraphs(BackendSpec(experts=experts_backend))
    got = grads_of(torch.compile(fn, backend=graphs, fullgraph=True), leaves)
    forward, backward = graphs.codes
    assert f"moe_{experts_backend}.experts" in forward
    assert f"moe_{experts_backend}.experts_backward" in backward
    if experts_backend != "reference":
        assert "moe_reference.experts_backward" not in backward
    for grad, want in zip(got, grads_of(fn, leaves)):
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("experts_backend", ["grouped_mm", "triton"])
@pytest.mark.parametrize("fn", [experts, rows_chain], ids=["experts", "experts_rows"])
def test_gpu_grouped_backward_traced_into_the_graph(experts_backend, fn):
    # Fixed sizes on CUDA, bf16: the grouped-GEMM gradient is traced in, its
    # GEMMs and Triton kernels launched from the compiled graph.
    leaves = make_leaves("cuda", torch.bfloat16, num_tokens=256, hidden=256, inter=128,
                         num_experts=16, top_k=4)
    graphs = AotGraphs(BackendSpec(experts=experts_backend))
    got = grads_of(torch.compile(fn, backend=graphs, fullgraph=True), leaves)
    backward = graphs.codes[-1]
    assert f"moe_{experts_backend}.experts_backward" not in backward
    assert "moe_reference.experts_backward" not in backward and "_grouped_mm" in backward
    for grad, want in zip(got, grads_of(fn, leaves)):
        error = ((grad.float() - want.float()).norm() / want.float().norm()).item()
        assert error < 2e-2

