"""Expert parallelism on 2 GPUs, and on 4 where there are 4, over NCCL, in fp32 and bf16,
for every a2a backend:

- the ops (dispatch -> experts_rows -> combine) and the `MoE` module against the
  single-process reference on the same tokens and weights: outputs and gradients,
  with an idle rank, skipped (-1) slots, every slot on one rank, a capacity
  below the worst case;
- the same chain captured eagerly in a CUDA graph and replayed on new inputs;
- a two-layer model compiled whole by Inductor (``fullgraph=True``, no graph
  break), without and with CUDA graphs (``mode="reduce-overhead"``), against eager.

Legend: P ranks, T tokens of one rank, N tokens of all ranks, H hidden size,
I expert intermediate size, E experts, E_l = E / P, K experts per token, R rows.

Each test starts P processes once (`distributed.run_on_ranks` with NCCL, rank r
on cuda:r) and runs its cases in them; every collective and the whole run are
bounded in time, so a bug fails instead of hanging.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import torch_moe_ops as tmo
from distributed import run_on_ranks, skip_without_gpus
from ep_problems import (
    assert_close_scaled,
    assert_rank_matches,
    draw_problem,
    leaves,
    token_slice,
)
from torch_moe_ops.backends.registry import REGISTRY, Problem
from torch_moe_ops.ops import op_overload

pytestmark = pytest.mark.multigpu

# Each test runs on 2 ranks, and on 4 where there are 4 GPUs.
WORLD_SIZES = (2, 4)
H, I, E, K = 64, 32, 8, 2
MAX_TOKENS = 8
# Tokens on each rank, per world size: one layout with an idle rank (it still joins
# every collective), one with every rank busy or one idle and one of them full.
TOKEN_LAYOUTS = {2: ((7, 0), (3, 8)), 4: ((7, 0, 8, 2), (3, 8, 5, 1))}
# The compiled model: uneven; at 4 ranks one of them idle.
COMPILED_TOKENS_PER_RANK = {2: (16, 5), 4: (16, 5, 0, 9)}
COMPILED_MAX_TOKENS = 16
# The a2a backends under test; one that is registered later joins with its name here.
A2A_NAMES = ("all_to_all", "allgather")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (rtol, atol as a fraction of the largest expected magnitude) against the reference,
# which computes in fp32 and rounds once.
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}
GRAD_TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 3e-2)}
# Compiled against eager over two layers: Inductor fuses the residual adds and rounds
# once where eager rounds after each op, a few bf16 steps of the residual stream.
COMPILED_TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (4e-2, 4e-2)}
# Inductor compiles while the peer waits in a collective: more than the CPU tests allow.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=180)
RUN_DEADLINE_S = 300
STATIC = ("silu", 1.702, 7.0)


def _assert_close(actual, expected, tolerances=TOLERANCES):
    assert_close_scaled(actual, expected, *tolerances[actual.dtype])


def _skip_unless_available(a2a: str, world_size: int) -> None:
    """Skip (in the launching process) an a2a backend that cannot run on CUDA here."""
    if a2a not in REGISTRY.a2a:
        pytest.skip(f"a2a backend {a2a!r} is not registered")
    reason = REGISTRY.a2a[a2a].supports(tmo.BackendSpec(a2a=a2a),
                                        Problem(torch.bfloat16, ep_size=world_size),
                                        torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"a2a backend {a2a!r}: {reason}")


def _launch(world_size, fn, *args) -> None:
    skip_without_gpus(world_size)
    run_on_ranks(world_size, fn, *args, backend="nccl", timeout=COLLECTIVE_TIMEOUT,
                 deadline_s=RUN_DEADLINE_S)


def _world() -> int:
    return dist.get_world_size()


def _full_problem(seed: int, route: str, dtype: torch.dtype, num_tokens: int):
    """Every rank's tokens and routing and every expert's weights, drawn on the CPU
    alike on all ranks, then moved to this rank's GPU."""
    hidden_NH, topk_weights_NK, topk_ids_NK, experts = draw_problem(
        seed, route, num_tokens, E, _world(), H, I, K)
    device = torch.device("cuda", torch.cuda.current_device())
    floats = (hidden_NH, topk_weights_NK, *experts.values())
    hidden_NH, topk_weights_NK, *weights = (t.to(device, dtype) for t in floats)
    return hidden_NH, topk_weights_NK, topk_ids_NK.to(device), weights


def _ep_args(max_tokens: int = MAX_TOKENS):
    return (_world(), dist.group.WORLD.group_name, max_tokens)


def _chain(a2a, hidden_TH, weights_TK, ids_TK, expert_weights, capacity):
    """dispatch -> experts_rows -> combine on backend ``a2a``: ``[T, H]``."""
    namespace = REGISTRY.a2a[a2a].namespace
    x_RH, expert_R, weight_R, src_R, count_E, combine_map_TK = op_overload(namespace, "dispatch")(
        hidden_TH, weights_TK, ids_TK, E, *_ep_args(), capacity)
    y_RH = torch.ops.moe.experts_rows(x_RH, expert_R, count_E, *expert_weights, *STATIC)
    return op_overload(namespace, "combine")(y_RH, weight_R, src_R, combine_map_TK, *_ep_args())


def _worst_capacity() -> int:
    return MAX_TOKENS * min(K, E // _world())


def _local_experts(rank: int) -> slice:
    num_local = E // _world()
    return slice(rank * num_local, (rank + 1) * num_local)


def _check_ops(rank, layout, a2a, dtype, route, capacity):
    """The chain against ``moe::experts`` of the reference on all tokens: this
    rank's outputs and the gradients of its tokens and experts."""
    hidden_NH, weights_NK, ids_NK, full = _full_problem(7, route, dtype, sum(layout))
    mine, local = token_slice(layout, rank), _local_experts(rank)

    ref_leaves = leaves(hidden_NH, weights_NK, *full)
    ref_NH = torch.ops.moe_reference.experts(ref_leaves[0], ref_leaves[1], ids_NK,
                                             *ref_leaves[2:], *STATIC)
    gen = torch.Generator().manual_seed(3)
    grad_NH = torch.randn(ref_NH.shape, generator=gen).to(ref_NH.device, dtype)
    ref_NH.backward(grad_NH)

    hidden_TH, weights_TK, *experts = leaves(hidden_NH[mine], weights_NK[mine],
                                              *(w[local] for w in full))
    out_TH = _chain(a2a, hidden_TH, weights_TK, ids_NK[mine], experts, capacity)
    assert out_TH.shape == (layout[rank], H) and out_TH.dtype == dtype
    out_TH.backward(grad_NH[mine])

    assert_rank_matches(out_TH, [hidden_TH, weights_TK, *experts], ref_NH, ref_leaves, mine,
                        local, _assert_close,
                        lambda actual, expected: _assert_close(actual, expected, GRAD_TOLERANCES))


def _check_overflow(rank, layout, a2a):
    """A capacity below what the routing needs raises on every rank."""
    hidden_NH, weights_NK, ids_NK, _ = _full_problem(11, "one_rank", torch.float32,
                                                     sum(layout))
    mine = token_slice(layout, rank)
    with pytest.raises(RuntimeError, match="ep_capacity is 1; no row was dropped"):
        op_overload(REGISTRY.a2a[a2a].namespace, "dispatch")(
            hidden_NH[mine], weights_NK[mine], ids_NK[mine], E, *_ep_args(), 1)


def _moe_config(ep_size: int, max_tokens: int, **overrides) -> tmo.MoEConfig:
    fields = dict(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, renormalize=True,
                  ep_size=ep_size, max_tokens_per_rank=max_tokens if ep_size > 1 else None)
    return tmo.MoEConfig(**{**fields, **overrides})


def _check_module(rank, layout, dtype):
    """`MoE` with ``ep_group`` (eager: the default a2a) against the single-process
    `MoE` with the same full weights: outputs and gradients."""
    extra = dict(expert_bias=True, shared_expert_intermediate_size=16)
    torch.manual_seed(5)
    device = torch.device("cuda", rank)
    # Built on the CPU so that every rank draws the same weights.
    single = tmo.MoE(_moe_config(1, MAX_TOKENS, **extra)).to(device, dtype)
    sharded = tmo.MoE(_moe_config(_world(), MAX_TOKENS, **extra), device=device, dtype=dtype,
                      ep_group=dist.group.WORLD)
    sharded.load_full_weights(single.state_dict())
    gen = torch.Generator().manual_seed(9)
    x_NH = torch.randn(sum(layout), H, generator=gen).to(device, dtype)
    mine, local = token_slice(layout, rank), sharded.local_experts

    x_ref = x_NH.clone().requires_grad_()
    ref_NH = single(x_ref)
    ref_NH.float().square().sum().backward()
    x_TH = x_NH[mine].clone().requires_grad_()
    out_TH = sharded(x_TH)
    out_TH.float().square().sum().backward()

    _assert_close(out_TH, ref_NH[mine].detach())
    _assert_close(x_TH.grad, x_ref.grad[mine], GRAD_TOLERANCES)
    for name in ("w13", "w2", "b13", "b2"):
        _assert_close(getattr(sharded, name).grad,
                      getattr(single, name).grad[local.start:local.stop], GRAD_TOLERANCES)
    # The router is whole on every rank: its gradient is the sum over ranks.
    gate_grad = sharded.gate.weight.grad.float()
    dist.all_reduce(gate_grad)
    _assert_close(gate_grad.to(dtype), single.gate.weight.grad, GRAD_TOLERANCES)


def _check_graph_replay(rank, layout, a2a, dtype):
    """The chain captured in a CUDA graph (eager ops, static input buffers, warm-up on
    a side stream) and replayed on new tokens and routing equals the eager chain."""
    mine, local = token_slice(layout, rank), _local_experts(rank)
    hidden_NH, weights_NK, ids_NK, full = _full_problem(13, "random", dtype, sum(layout))
    experts = [w[local] for w in full]
    static = [hidden_NH[mine].clone(), weights_NK[mine].clone(), ids_NK[mine].clone()]
    capacity = _worst_capacity()

    def step():
        return _chain(a2a, *static, experts, capacity)

    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the NCCL watchdog thread may query events while this thread captures.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            static_out_TH = step()
        for seed, route in ((21, "random"), (22, "one_rank"), (23, "random")):
            fresh_NH, fresh_NK, fresh_ids_NK, _ = _full_problem(seed, route, dtype,
                                                                sum(layout))
            fresh = (fresh_NH[mine], fresh_NK[mine], fresh_ids_NK[mine])
            for buffer, value in zip(static, fresh):
                buffer.copy_(value)
            static_out_TH.fill_(float("nan"))
            graph.replay()
            expected_TH = _chain(a2a, *fresh, experts, capacity)
            _assert_close(static_out_TH, expected_TH)
    torch.cuda.synchronize()


def _eager_cases(rank, world_size, a2a):
    worst = _worst_capacity()
    for layout in TOKEN_LAYOUTS[world_size]:
        for dtype in DTYPES.values():
            for route in ("random", "one_rank"):
                _check_ops(rank, layout, a2a, dtype, route, worst)
            _check_graph_replay(rank, layout, a2a, dtype)
        # A capacity below the worst case that the routing still fits (a host sync).
        _check_ops(rank, layout, a2a, torch.float32, "random", worst - 1)
        _check_overflow(rank, layout, a2a)


def _module_cases(rank, world_size):
    for layout in TOKEN_LAYOUTS[world_size]:
        for dtype in DTYPES.values():
            _check_module(rank, layout, dtype)


class TwoLayers(nn.Module):
    """Two expert-parallel MoE layers with residuals: ``x + moe1(x)``, then ``+ moe2(.)``."""

    def __init__(self, cfg: tmo.MoEConfig, device, dtype, ep_group):
        super().__init__()
        self.layers = nn.ModuleList(tmo.MoE(cfg, device=device, dtype=dtype, ep_group=ep_group)
                                    for _ in range(2))

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x_TH = x_TH + layer(x_TH)
        return x_TH


def _two_layers(rank, dtype) -> TwoLayers:
    device = torch.device("cuda", rank)
    torch.manual_seed(17)
    model = TwoLayers(_moe_config(_world(), COMPILED_MAX_TOKENS), device, dtype,
                      dist.group.WORLD)
    for layer in model.layers:
        # Full weights drawn on the CPU, alike on every rank.
        layer.load_full_weights(tmo.MoE(_moe_config(1, COMPILED_MAX_TOKENS)).state_dict())
    return model


def _tokens(rank, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    layout = COMPILED_TOKENS_PER_RANK[_world()]
    x_NH = torch.randn(sum(layout), H, generator=gen)
    return x_NH[token_slice(layout, rank)].to(torch.device("cuda", rank), dtype)


def _compile(model, a2a, mode=None):
    counter = CompileCounterWithBackend(tmo.backend(a2a=a2a, mode=mode))
    return counter, torch.compile(model, backend=counter, fullgraph=True, dynamic=False)


def _compiled_cases(rank, world_size, a2a):
    """Inductor, one graph and no break, against eager; then CUDA graphs replaying
    new tokens with one recording and no skipped graph."""
    counters = torch._dynamo.utils.counters
    for dtype in DTYPES.values():
        torch._dynamo.reset()
        counters.clear()
        model = _two_layers(rank, dtype)
        counter, compiled = _compile(model, a2a)
        with torch.no_grad():
            x_TH = _tokens(rank, dtype, seed=1)
            out_TH = compiled(x_TH)
            _assert_close(out_TH, model(x_TH), COMPILED_TOLERANCES)
        assert counter.frame_count == 1, counter.frame_count
        assert not counters["graph_break"], dict(counters["graph_break"])

    torch._dynamo.reset()
    counters.clear()
    model = _two_layers(rank, torch.bfloat16)
    counter, compiled = _compile(model, a2a, mode="reduce-overhead")
    with torch.no_grad():
        for seed in range(4):
            x_TH = _tokens(rank, torch.bfloat16, seed)
            out_TH = compiled(x_TH).clone()
            _assert_close(out_TH, model(x_TH), COMPILED_TOLERANCES)
    assert counter.frame_count == 1, counter.frame_count
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    # Warm-up, one recording, then replays: the tree records exactly one graph.
    tree_manager = torch._inductor.cudagraph_trees.get_container(rank).tree_manager
    assert next(tree_manager.graph_counter) == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids="P{}".format)
@pytest.mark.parametrize("a2a", A2A_NAMES)
def test_ops_and_cuda_graph_match_single_process(a2a, world_size):
    _skip_unless_available(a2a, world_size)
    _launch(world_size, _eager_cases, a2a)


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids="P{}".format)
def test_module_matches_single_process(world_size):
    _launch(world_size, _module_cases)


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids="P{}".format)
@pytest.mark.parametrize("a2a", A2A_NAMES)
def test_two_layers_compiled_whole(a2a, world_size):
    _skip_unless_available(a2a, world_size)
    _launch(world_size, _compiled_cases, a2a)
