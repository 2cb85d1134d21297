"""Expert parallelism on CPU processes (gloo): every rank's output and gradients equal
the single-process reference on the same tokens and weights.

Legend: P ranks, T tokens of one rank, N tokens of all ranks, H hidden size,
I expert intermediate size, E experts, E_l = E / P, K experts per token.

Each test starts P processes once and runs its cases in them (process start-up
is most of the cost); `distributed.run_on_ranks` bounds every collective and
the whole run, so a bug fails instead of hanging.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import torch_moe_ops as tmo
from distributed import run_on_ranks
from ep_problems import assert_rank_matches, draw_problem, leaves, token_slice
from graph_tests.aot_graphs import AotGraphs
from torch_moe_ops.config import BackendSpec
from torch_moe_ops.lowering.rewrite import layer_problems
from torch_moe_ops.ops import op_overload

H, I, K = 16, 8, 2
MAX_TOKENS = 6
# Tokens on each rank: one rank has none, one is full.
TOKENS_PER_RANK = {2: (5, 0), 3: (6, 0, 3)}
A2A_NAMESPACES = {"all_to_all": "moe_all_to_all", "allgather": "moe_allgather"}
ACTIVATIONS = ("silu", "swiglu_oai")


def _experts_count(world_size: int) -> int:
    return 3 * world_size


def _full_problem(world_size: int, seed: int, route: str):
    """Every rank's tokens and routing, and every expert's weights, drawn alike on all ranks."""
    return draw_problem(seed, route, sum(TOKENS_PER_RANK[world_size]),
                        _experts_count(world_size), world_size, H, I, K)


def _my_tokens(rank: int, world_size: int) -> slice:
    return token_slice(TOKENS_PER_RANK[world_size], rank)


def _check_ops(rank, world_size, a2a, route, activation, capacity):
    """dispatch -> experts_rows -> combine of backend ``a2a`` against ``moe::experts``
    on all tokens: this rank's outputs and the gradients of its tokens and experts."""
    hidden_NH, weights_NK, ids_NK, full = _full_problem(world_size, 7 + rank * 0, route)
    num_experts = _experts_count(world_size)
    num_local = num_experts // world_size
    mine, local = _my_tokens(rank, world_size), slice(rank * num_local, (rank + 1) * num_local)
    static = (activation, 1.702, 7.0)

    ref_leaves = leaves(hidden_NH, weights_NK, *full.values())
    ref_NH = torch.ops.moe_reference.experts(ref_leaves[0], ref_leaves[1], ids_NK,
                                             *ref_leaves[2:], *static)
    grad_NH = torch.randn(ref_NH.shape, generator=torch.Generator().manual_seed(3))
    ref_NH.backward(grad_NH)

    ours = leaves(hidden_NH[mine], weights_NK[mine], *(w[local] for w in full.values()))
    hidden_TH, weights_TK, w13, w2, b13, b2 = ours
    ep_args = (world_size, dist.group.WORLD.group_name, MAX_TOKENS)
    namespace = A2A_NAMESPACES[a2a]
    x_RH, expert_R, weight_R, src_R, count_E, combine_map_TK = op_overload(namespace, "dispatch")(
        hidden_TH, weights_TK, ids_NK[mine], num_experts, *ep_args, capacity)
    assert x_RH.shape == (world_size * capacity, H)
    assert int(count_E.sum()) == int((expert_R >= 0).sum())
    y_RH = torch.ops.moe.experts_rows(x_RH, expert_R, count_E, w13, w2, b13, b2, *static)
    out_TH = op_overload(namespace, "combine")(y_RH, weight_R, src_R, combine_map_TK, *ep_args)
    out_TH.backward(grad_NH[mine])

    def check(actual, expected):
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)

    assert_rank_matches(out_TH, ours, ref_NH, ref_leaves, mine, local, check, check)


def _check_overflow(rank, world_size, a2a):
    """A capacity below what the routing needs raises on every rank, before any row is lost."""
    hidden_NH, weights_NK, ids_NK, _ = _full_problem(world_size, 11, "one_rank")
    num_experts = _experts_count(world_size)
    mine = _my_tokens(rank, world_size)
    with pytest.raises(RuntimeError, match="ep_capacity is 1; no row was dropped"):
        op_overload(A2A_NAMESPACES[a2a], "dispatch")(
            hidden_NH[mine], weights_NK[mine], ids_NK[mine], num_experts, world_size,
            dist.group.WORLD.group_name, MAX_TOKENS, 1)


def _moe_config(world_size: int, ep_size: int, activation: str) -> tmo.MoEConfig:
    return tmo.MoEConfig(hidden_size=H, intermediate_size=I,
                         num_experts=_experts_count(world_size), top_k=K, renormalize=True,
                         expert_bias=True, activation=activation,
                         shared_expert_intermediate_size=8, ep_size=ep_size,
                         max_tokens_per_rank=MAX_TOKENS if ep_size > 1 else None)


def _check_module(rank, world_size, a2a, compiled):
    """`MoE` with ``ep_group`` against the single-process `MoE` with the same full
    weights: outputs, input gradients and the gradients of this rank's experts."""
    torch.manual_seed(5)
    single = tmo.MoE(_moe_config(world_size, 1, "silu"))
    sharded = tmo.MoE(_moe_config(world_size, world_size, "silu"), ep_group=dist.group.WORLD)
    sharded.load_full_weights(single.state_dict())
    x_NH = torch.randn(sum(TOKENS_PER_RANK[world_size]), H,
                       generator=torch.Generator().manual_seed(9))
    mine = _my_tokens(rank, world_size)
    local = sharded.local_experts

    x_ref = x_NH.clone().requires_grad_()
    single(x_ref).square().sum().backward()
    run, problems, dispatch_dtypes = sharded, [], []
    graphs = AotGraphs(BackendSpec(a2a=a2a))
    if compiled:
        def recording(gm, example_inputs):
            problems.extend(layer_problems(gm).values())
            compiled_fn = graphs(gm, example_inputs)
            dispatch_dtypes.extend(n.meta["moe_dispatch_dtype"] for n in gm.graph.nodes
                                   if "moe_dispatch_dtype" in n.meta)
            return compiled_fn

        run = torch.compile(sharded, backend=recording, fullgraph=True)
    x_TH = x_NH[mine].clone().requires_grad_()
    out_TH = run(x_TH)
    out_TH.square().sum().backward()

    if compiled:
        # Every op of the layer is lowered knowing the whole expert-parallel problem.
        cfg = sharded.cfg
        expected = (cfg.num_experts, cfg.num_local_experts, H, I, K, world_size,
                    cfg.rows_per_rank, MAX_TOKENS)
        layer = [p for p in problems if p.dtype == torch.float32 and p.ep_size is not None]
        assert len(layer) == 3
        # The layer's dispatch dtype is resolved once, when it is lowered.
        assert [d.dtype for d in dispatch_dtypes] == [torch.float32]
        for p in layer:
            assert (p.num_experts, p.num_local_experts, p.hidden_size, p.intermediate_size,
                    p.top_k, p.ep_size, p.capacity, p.max_tokens_per_rank) == expected
        # Dispatch, combine and their gradients are traced into the graphs (to be
        # fused around them), each collective an op of its own.
        collective = {"all_to_all": "moe_collectives.all_to_all",
                      "allgather": "moe_collectives.all_gather"}[a2a]
        assert len(graphs.codes) == 2
        for code in graphs.codes:
            assert A2A_NAMESPACES[a2a] not in code
            assert collective in code or "moe_collectives.reduce_scatter" in code
    tol = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(out_TH, single(x_NH)[mine].detach(), **tol)
    torch.testing.assert_close(x_TH.grad, x_ref.grad[mine], **tol)
    for name in ("w13", "w2", "b13", "b2"):
        torch.testing.assert_close(getattr(sharded, name).grad,
                                   getattr(single, name).grad[local.start:local.stop], **tol)
    # The router is whole on every rank: its gradient is the sum over ranks.
    gate_grad = sharded.gate.weight.grad.clone()
    dist.all_reduce(gate_grad)
    torch.testing.assert_close(gate_grad, single.gate.weight.grad, **tol)


def _run_cases(rank, world_size, a2a):
    num_local = _experts_count(world_size) // world_size
    worst = MAX_TOKENS * min(K, num_local)
    for route in ("random", "one_rank"):
        for activation in ACTIVATIONS:
            _check_ops(rank, world_size, a2a, route, activation, worst)
    # A capacity below the worst case that the routing still fits.
    _check_ops(rank, world_size, a2a, "random", "silu", worst - 1)
    _check_overflow(rank, world_size, a2a)
    _check_module(rank, world_size, a2a, compiled=False)
    _check_module(rank, world_size, a2a, compiled=True)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("a2a", sorted(A2A_NAMESPACES))
def test_expert_parallel_matches_single_process(a2a, world_size):
    run_on_ranks(world_size, _run_cases, a2a)


def _check_inductor_idle_rank(rank, world_size):
    """Inductor, forward and backward, with rank 1 idle: every rank still runs each
    collective, in the same order (an idle rank's outputs are empty, and a compiler
    that dropped or moved its collectives would leave its peers waiting)."""
    for a2a in sorted(A2A_NAMESPACES):
        torch._dynamo.reset()
        torch.manual_seed(5)
        single = tmo.MoE(_moe_config(world_size, 1, "silu"))
        sharded = tmo.MoE(_moe_config(world_size, world_size, "silu"), ep_group=dist.group.WORLD)
        sharded.load_full_weights(single.state_dict())
        compiled = torch.compile(sharded, backend=tmo.backend(a2a=a2a), fullgraph=True,
                                 dynamic=False)
        x_NH = torch.randn(MAX_TOKENS, H, generator=torch.Generator().manual_seed(2))
        x_TH = (x_NH if rank == 0 else x_NH[:0]).clone().requires_grad_()
        out_TH = compiled(x_TH)
        out_TH.square().sum().backward()
        x_ref = x_NH.clone().requires_grad_()
        single(x_ref).square().sum().backward()
        tol = {"rtol": 1e-4, "atol": 1e-5}
        mine = slice(0, MAX_TOKENS) if rank == 0 else slice(0, 0)
        torch.testing.assert_close(out_TH, single(x_NH)[mine].detach(), **tol)
        torch.testing.assert_close(x_TH.grad, x_ref.grad[mine], **tol)
        local = sharded.local_experts
        torch.testing.assert_close(sharded.w13.grad, single.w13.grad[local.start:local.stop],
                                   **tol)


@pytest.mark.slow
def test_inductor_keeps_every_collective_on_an_idle_rank():
    run_on_ranks(2, _check_inductor_idle_rank)
