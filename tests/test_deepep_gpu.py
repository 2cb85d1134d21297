"""The ``deepep`` a2a backend on 2 GPUs, and on 4 where there are 4, over NCCL: every
rank's outputs and gradients equal the single-process reference on the same tokens and
weights (bf16 bounds), in
DeepEP's normal and low-latency modes, with one rank idle, in a captured CUDA graph
replayed on new inputs, and as the a2a of a `MoE` compiled by Inductor (forward and
backward, through the rows format; and forward under ``mode="reduce-overhead"``, through
the masked format at decode size and the tokens format where low-latency mode cannot run
it, whole and in 2 chunks in flight). The tokens format on DeepEP's normal mode
(``dispatch_tokens -> moe_reference::experts -> combine_tokens``) against the same
reference at two token counts (one where rows would take the low-latency kernels), with
one rank idle, and captured in a CUDA graph replayed on new inputs; the same chain in
flight (``dispatch_tokens_start``, the functional collectives' wait,
``combine_tokens_start``) likewise. The masked format on DeepEP's low-latency mode
(``dispatch_masked -> experts_masked -> combine_masked``, with each experts backend that
reads it: reference, triton, grouped_mm) against the same reference, one rank idle, and
captured in a CUDA graph replayed on new inputs. Quantized layers: fp8 rows and their
scales through DeepEP's fp8 dispatch (``moe_deepep::dispatch_quant``) against dispatch then
quantize, and quantized `MoE` layers compiled with ``a2a="deepep"`` against one GPU
holding every expert (in low-latency mode, fp8 masked blocks where
DeepEP's cast takes the format: ``dispatch_masked_quant -> experts_masked_quant``).

Legend: P ranks, T tokens of one rank, N tokens of all ranks, H hidden size,
I expert intermediate size, E experts, E_l = E / P, K experts per token, M
max_tokens_per_rank.

Skipped (with `deepep.supports`' reason) where DeepEP is not built: see
scripts/build_deepep.sh. Each test starts its P processes once and runs its cases
in them; low-latency mode initialises NVSHMEM, which a process holds once, so each
mode has its own test (and processes).
"""

from __future__ import annotations

import datetime
import functools
import gc

import pytest
import torch
import torch.distributed as dist

import torch_moe_ops as tmo
from distributed import run_on_ranks, skip_without_gpus
from ep_problems import (
    assert_close_scaled,
    assert_quantized_dispatch,
    assert_rank_matches,
    check_bf16_grad,
    check_bf16_out,
    check_graph_replays,
    draw_problem,
    leaves,
    on_current_gpu,
    recording_backend,
    route_op,
    single_and_sharded,
    token_slice,
)
from torch_moe_ops.backends import deepep
from torch_moe_ops.backends.common.transport import collectives
from torch_moe_ops.backends.registry import Problem
from torch_moe_ops.config import BackendSpec, QuantSpec
from torch_moe_ops.lowering.rewrite import moe_op_sequence

# Each test runs on 2 ranks, and on 4 where there are 4 GPUs.
WORLD_SIZES = (2, 4)
# Tokens on each rank, per world size: one rank full, one idle (at 4: uneven besides).
TOKENS_PER_RANK = {2: (5, 0), 4: (5, 0, 2, 4)}
# H: one of the sizes DeepEP's low-latency kernels are compiled for.
H, I, E, K = 2048, 64, 8, 2
M_NORMAL, M_LOW_LATENCY = 8, 6
# Above the low-latency kernels' decode sizes: a layer of this size serves through the
# tokens format on normal mode, at every world size.
M_NOT_LOW_LATENCY = deepep.LOW_LATENCY_MAX_TOKENS + 1
STATIC = ("silu", 1.702, 7.0)
TOKENS_OPS = ("moe_deepep::dispatch_tokens", "moe_deepep::combine_tokens")
IN_FLIGHT_OPS = ("moe_deepep::dispatch_tokens_start", "moe_deepep::combine_tokens_start")
MASKED_OPS = ("moe_deepep::dispatch_masked", "moe_deepep::combine_masked")
# The experts backends that read the masked format, each on DeepEP's blocks as they arrive.
MASKED_EXPERTS = ("moe_reference", "moe_triton", "moe_grouped_mm")
# Quantized layers: 128 x 128 weight blocks need I to be a multiple of 128.
QUANT_I = 128
QUANT_SPECS = {
    # Normal mode: one scale beside each row; low-latency: bf16, quantized on arrival.
    "fp8_token": QuantSpec("fp8_channel"),
    # 1 x 128 groups: low-latency mode sends them through DeepEP's own cast.
    "fp8_group": QuantSpec("fp8_block"),
    # Normal mode: 32 scales beside each row; low-latency: bf16, quantized on arrival.
    "fp8_group64": QuantSpec("fp8_block", block_size=(128, 64)),
}
# (spec, experts backend, compile mode) of the compiled quantized layers.
QUANT_MODULES = (("fp8_group", "triton", None), ("fp8_group", "triton", "reduce-overhead"),
                 ("fp8_token", "triton", None), ("fp8_group64", "reference", None))
TIMEOUT = datetime.timedelta(seconds=120)
DEADLINE_S = 480
# Four Inductor compiles of quantized layers besides: more time.
QUANT_DEADLINE_S = 590

REASON = deepep.supports(BackendSpec(a2a="deepep"),
                         Problem(torch.bfloat16, ep_size=2, hidden_size=H, top_k=K),
                         torch.device("cuda"))
pytestmark = [pytest.mark.multigpu,
              pytest.mark.skipif(REASON is not None, reason=f"a2a 'deepep': {REASON}")]


def _world() -> int:
    return dist.get_world_size()


def _layout() -> tuple[int, ...]:
    return TOKENS_PER_RANK[_world()]


def _launch(world_size, fn, *args, deadline_s=DEADLINE_S) -> None:
    skip_without_gpus(world_size)
    run_on_ranks(world_size, fn, *args, backend="nccl", timeout=TIMEOUT, deadline_s=deadline_s)


def _full_problem(seed: int, route: str):
    """Every rank's tokens and routing, and every expert's weights, drawn alike on all
    ranks, on this rank's GPU (`on_current_gpu`)."""
    return on_current_gpu(*draw_problem(seed, route, sum(_layout()), E, _world(), H, I, K))


def _mine(rank: int) -> slice:
    return token_slice(_layout(), rank)


def _local(rank: int) -> slice:
    num_local = E // _world()
    return slice(rank * num_local, (rank + 1) * num_local)


def _rows_pipeline(hidden_TH, weights_TK, ids_TK, experts, mode, max_tokens, capacity):
    """``dispatch -> moe_reference::experts_rows -> combine`` of ``mode``'s namespace
    (`deepep.ROWS_NAMESPACES`): the output and the rows' experts and counts."""
    ep_args = (_world(), dist.group.WORLD.group_name, max_tokens)
    rows_ops = getattr(torch.ops, deepep.ROWS_NAMESPACES[mode])
    x_RH, expert_R, weight_R, src_R, count_E, combine_map_TK = rows_ops.dispatch(
        hidden_TH, weights_TK, ids_TK, E, *ep_args, capacity)
    assert x_RH.shape == (_world() * capacity, H)
    y_RH = torch.ops.moe_reference.experts_rows(x_RH, expert_R, count_E, *experts, *STATIC)
    out_TH = rows_ops.combine(y_RH, weight_R, src_R, combine_map_TK, *ep_args)
    return out_TH, expert_R, count_E


def _check_rows_layout(expert_R: torch.Tensor, count_E: torch.Tensor) -> None:
    """Rows of expert e at [offset_e, offset_e + count_e), the rest skipped."""
    offset = 0
    for e, count in enumerate(count_E.tolist()):
        assert (expert_R[offset:offset + count] == e).all()
        offset += count
    assert (expert_R[offset:] == -1).all()


def _check_ops(rank, route, mode, max_tokens, capacity):
    """Outputs and gradients of this rank's tokens and experts against
    ``moe_reference::experts`` on all tokens."""
    hidden_NH, weights_NK, ids_NK, full = _full_problem(7, route)
    mine, local = _mine(rank), _local(rank)
    ref_leaves = leaves(hidden_NH, weights_NK, *full)
    ref_NH = torch.ops.moe_reference.experts(ref_leaves[0], ref_leaves[1], ids_NK,
                                             *ref_leaves[2:], *STATIC)
    grad_NH = torch.randn(ref_NH.shape, generator=torch.Generator().manual_seed(3)).to(
        ref_NH.device, ref_NH.dtype)
    ref_NH.backward(grad_NH)

    hidden_TH, weights_TK, *experts = leaves(hidden_NH[mine], weights_NK[mine],
                                              *(w[local] for w in full))
    out_TH, expert_R, count_E = _rows_pipeline(hidden_TH, weights_TK, ids_NK[mine], experts,
                                               mode, max_tokens, capacity)
    _check_rows_layout(expert_R, count_E)
    out_TH.backward(grad_NH[mine])

    assert_rank_matches(out_TH, [hidden_TH, weights_TK, *experts], ref_NH, ref_leaves, mine,
                        local, check_bf16_out, check_bf16_grad)


def _check_graph(rank, mode, max_tokens):
    """dispatch -> experts_rows -> combine captured once in a CUDA graph and replayed on new
    inputs (`check_graph_replays`): the reference's output."""
    capacity = max_tokens * min(K, E // _world())
    check_graph_replays(lambda *args: _rows_pipeline(*args, mode, max_tokens, capacity)[0],
                        _full_problem, _mine(rank), _local(rank), STATIC)


def _moe_config(ep_size: int, max_tokens: int, quant: QuantSpec | None = None
                ) -> tmo.MoEConfig:
    return tmo.MoEConfig(hidden_size=H, intermediate_size=I if quant is None else QUANT_I,
                         num_experts=E, top_k=K, renormalize=True, expert_bias=True,
                         ep_size=ep_size, max_tokens_per_rank=max_tokens if ep_size > 1 else None,
                         quant=quant)


def _single_and_sharded(max_tokens, seed, quant=None):
    """`single_and_sharded` of this file's layer (quantized as ``quant`` says)."""
    return single_and_sharded(lambda ep_size: _moe_config(ep_size, max_tokens, quant), seed)


def _check_module(rank, max_tokens):
    """`MoE` sharded over the group and compiled by Inductor with ``a2a="deepep"``
    against the single-process `MoE` with the same full weights: outputs and gradients
    (the idle rank's empty gradients included: its ops must not be dropped as dead code),
    through the rows format."""
    single, sharded = _single_and_sharded(max_tokens, seed=5)
    device = single.w13.device
    x_NH = torch.randn(sum(_layout()), H, generator=torch.Generator().manual_seed(9))
    x_NH = x_NH.to(device, torch.bfloat16)
    mine, local = _mine(rank), sharded.local_experts

    x_ref = x_NH.clone().requires_grad_()
    ref_NH = single(x_ref)
    ref_NH.float().square().sum().backward()
    sequences = []
    compiled = torch.compile(sharded, backend=recording_backend(sequences, a2a="deepep"),
                             fullgraph=True, dynamic=False)
    x_TH = x_NH[mine].clone().requires_grad_()
    out_TH = compiled(x_TH)
    out_TH.float().square().sum().backward()
    # A layer that trains takes the rows format (the tokens ops carry no gradient), in the
    # mode its plan takes.
    mode = deepep.choose_mode(_world(), H, K, max_tokens)
    assert f"{deepep.ROWS_NAMESPACES[mode]}::dispatch\n" in sequences[-1], sequences[-1]

    check_bf16_out(out_TH, ref_NH[mine].detach())
    check_bf16_grad(x_TH.grad, x_ref.grad[mine])
    for name in ("w13", "w2", "b13", "b2"):
        check_bf16_grad(getattr(sharded, name).grad,
                        getattr(single, name).grad[local.start:local.stop])


def _check_reduce_overhead(rank, max_tokens, served_ops, **options):
    """`MoE` compiled by Inductor with ``a2a="deepep"`` and ``mode="reduce-overhead"``
    (CUDA graphs: warm-up, one recording, replays) for inference, through the format whose
    transport ops are ``served_ops`` (masked at decode sizes, else tokens; in flight with
    ``chunks=``), against the single-process `MoE`."""
    single, sharded = _single_and_sharded(max_tokens, seed=6)
    device = single.w13.device
    sequences = []
    compiled = torch.compile(sharded, backend=recording_backend(sequences, a2a="deepep",
                                                                mode="reduce-overhead",
                                                                **options),
                             fullgraph=True, dynamic=False)
    counters = torch._dynamo.utils.counters
    counters.clear()
    with torch.no_grad():
        for seed in range(4):
            gen = torch.Generator().manual_seed(20 + seed)
            x_NH = torch.randn(sum(_layout()), H, generator=gen).to(device,
                                                                          torch.bfloat16)
            out_TH = compiled(x_NH[_mine(rank)]).clone()
            try:
                check_bf16_out(out_TH, single(x_NH)[_mine(rank)])
            except AssertionError as error:
                # Which run of CUDA graph trees went wrong: warm-up, recording or a replay.
                raise AssertionError(f"call {seed} of 4 (0: warm-up, 1: recording, 2-3: "
                                     f"replays), options {options}: {error}") from None
    assert all(op in sequences[-1] for op in served_ops), sequences[-1]
    # DeepEP's ops ran inside the CUDA graphs, not beside them.
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    torch._dynamo.reset()


def _no_handles_left() -> None:
    gc.collect()
    assert all(not comm.handles for comm in deepep.open_communicators())


def _run_normal(rank, world_size):
    # moe_deepep's rows ops run normal mode at this size too, where a layer's plan would
    # take the low-latency kernels.
    worst = M_NORMAL * min(K, E // _world())
    for route in ("random", "one_rank"):
        _check_ops(rank, route, "normal", M_NORMAL, worst)
    (comm,) = deepep.open_communicators()
    assert comm.mode == "normal", comm
    # A capacity below the worst case that the routing still fits.
    _check_ops(rank, "random", "normal", M_NORMAL, worst - 1)
    _no_handles_left()
    _check_graph(rank, "normal", M_NORMAL)
    # A layer that trains where low-latency mode cannot run it: rows, on normal mode.
    _check_module(rank, M_NOT_LOW_LATENCY)
    # Without gradients, where low-latency mode cannot run it: tokens, on normal mode; and
    # in 2 chunks, each transfer in flight on DeepEP's stream until the graph's wait.
    _check_reduce_overhead(rank, M_NOT_LOW_LATENCY, TOKENS_OPS)
    _check_reduce_overhead(rank, M_NOT_LOW_LATENCY, IN_FLIGHT_OPS, chunks=2)
    assert all(not comm.in_flight for comm in deepep.open_communicators())
    _no_handles_left()
    # Collective: on every rank, and only once every rank got here.
    deepep.close_all()


def _run_low_latency(rank, world_size):
    worst = M_LOW_LATENCY * min(K, E // _world())
    for route in ("random", "one_rank"):
        _check_ops(rank, route, "low_latency", M_LOW_LATENCY, worst)
    # max_tokens_per_rank <= LOW_LATENCY_MAX_TOKENS and H among its sizes: low-latency.
    (comm,) = deepep.open_communicators()
    assert comm.mode == "low_latency", comm
    _check_ops(rank, "random", "low_latency", M_LOW_LATENCY, worst - 1)
    _check_graph(rank, "low_latency", M_LOW_LATENCY)
    _check_module(rank, M_LOW_LATENCY)
    # Without gradients at decode size: the masked format, on the same low-latency kernels.
    _check_reduce_overhead(rank, M_LOW_LATENCY, MASKED_OPS)
    # Rows trained and masked blocks served on one low-latency communicator.
    assert [c.mode for c in deepep.open_communicators()] == ["low_latency"]
    deepep.close_all()


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids="P{}".format)
def test_normal_mode_matches_single_process(world_size):
    _launch(world_size, _run_normal)


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids="P{}".format)
def test_low_latency_mode_matches_single_process(world_size):
    _launch(world_size, _run_low_latency)


def _tokens_pipeline(hidden_TH, weights_TK, ids_TK, experts, max_tokens):
    """``moe_deepep::dispatch_tokens -> moe_reference::experts -> moe_deepep::combine_tokens``:
    the receive buffers as DeepEP delivers them, this rank's ``[T, H]`` output."""
    ep_args = (_world(), dist.group.WORLD.group_name, max_tokens)
    x_NH, weights_NK, local_NK = torch.ops.moe_deepep.dispatch_tokens(hidden_TH, weights_TK,
                                                                       ids_TK, E, *ep_args)
    assert x_NH.shape == (_world() * max_tokens, H) and local_NK.dtype == torch.int32
    y_NH = torch.ops.moe_reference.experts(x_NH, weights_NK, local_NK, *experts, *STATIC)
    return torch.ops.moe_deepep.combine_tokens(y_NH, ids_TK, E, *ep_args)


def _in_flight_pipeline(hidden_TH, weights_TK, ids_TK, experts, max_tokens):
    """The same chain in flight (`backends.deepep.in_flight`), as a compiled graph runs it
    with one chunk: each transfer issued by its ``*_start`` op on DeepEP's stream, read after
    the functional collectives' wait."""
    ep_args = (E, _world(), dist.group.WORLD.group_name, max_tokens)
    x_in_flight, routing_in_flight = torch.ops.moe_deepep.dispatch_tokens_start(
        hidden_TH, weights_TK, ids_TK, *ep_args, 0, 1)
    weights_NK, local_NK = torch.ops.moe_deepep.dispatch_tokens_finish(
        collectives.wait(routing_in_flight), *ep_args)
    y_NH = torch.ops.moe_reference.experts(collectives.wait(x_in_flight), weights_NK, local_NK,
                                           *experts, *STATIC)
    returned_MH = collectives.wait(torch.ops.moe_deepep.combine_tokens_start(
        y_NH, ids_TK, *ep_args, 0, 1))
    return returned_MH[:hidden_TH.shape[0]]


def _check_chain(rank, route, pipeline):
    """``pipeline`` (this rank's tokens, routing and experts -> its ``[T, H]`` output)
    against ``moe_reference::experts`` on all tokens."""
    hidden_NH, weights_NK, ids_NK, full = _full_problem(8, route)
    mine, local = _mine(rank), _local(rank)
    with torch.no_grad():
        out_TH = pipeline(hidden_NH[mine], weights_NK[mine], ids_NK[mine],
                          [w[local] for w in full])
        ref_NH = torch.ops.moe_reference.experts(hidden_NH, weights_NK, ids_NK, *full, *STATIC)
    check_bf16_out(out_TH, ref_NH[mine])


def _run_tokens(rank, world_size):
    # M_LOW_LATENCY: the size where rows take the low-latency kernels; tokens stay normal.
    for max_tokens in (M_NORMAL, M_LOW_LATENCY):
        for chain in (_tokens_pipeline, _in_flight_pipeline):
            pipeline = functools.partial(chain, max_tokens=max_tokens)
            for route in ("random", "one_rank"):
                _check_chain(rank, route, pipeline)
            check_graph_replays(pipeline, _full_problem, _mine(rank), _local(rank), STATIC)
    assert [c.mode for c in deepep.open_communicators()] == ["normal", "normal"]
    deepep.close_all()


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids="P{}".format)
def test_tokens_format_matches_single_process(world_size):
    _launch(world_size, _run_tokens)


def _masked_pipeline(hidden_TH, weights_TK, ids_TK, experts, namespace="moe_reference"):
    """``moe_deepep::dispatch_masked -> <namespace>::experts_masked -> combine_masked`` at
    ``M_LOW_LATENCY``: DeepEP's blocks as they arrive, this rank's ``[T, H]`` output."""
    ep_args = (_world(), dist.group.WORLD.group_name, M_LOW_LATENCY)
    x_EQH, count_E, src_info_EQ, layout_range_EP = torch.ops.moe_deepep.dispatch_masked(
        hidden_TH, weights_TK, ids_TK, E, *ep_args)
    assert x_EQH.shape == (E // _world(), _world() * M_LOW_LATENCY, H)
    y_EQH = getattr(torch.ops, namespace).experts_masked(x_EQH, count_E, *experts, *STATIC)
    return torch.ops.moe_deepep.combine_masked(y_EQH, src_info_EQ, layout_range_EP, weights_TK,
                                               ids_TK, E, *ep_args)


def _run_masked(rank, world_size):
    for namespace in MASKED_EXPERTS:
        pipeline = functools.partial(_masked_pipeline, namespace=namespace)
        for route in ("random", "one_rank"):
            _check_chain(rank, route, pipeline)
        check_graph_replays(pipeline, _full_problem, _mine(rank), _local(rank), STATIC)
    assert [c.mode for c in deepep.open_communicators()] == ["low_latency"]
    deepep.close_all()


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids="P{}".format)
def test_masked_format_matches_single_process(world_size):
    _launch(world_size, _run_masked)


def _check_dispatch_quant(rank, mode, max_tokens):
    """``dispatch_quant`` of ``mode``'s namespace on DeepEP against its ``dispatch`` then
    the oracle's quantizer, in every format: bit for bit, or within one e4m3 step where
    DeepEP's low-latency kernels cast (`deepep.fp8_transport_reason`)."""
    hidden_NH, weights_NK, ids_NK, _ = _full_problem(7, "random")
    mine = _mine(rank)
    ep_args = (_world(), dist.group.WORLD.group_name, max_tokens,
               max_tokens * min(K, E // _world()))
    args = (hidden_NH[mine], weights_NK[mine], ids_NK[mine], E)
    rows_ops = getattr(torch.ops, deepep.ROWS_NAMESPACES[mode])
    for spec in QUANT_SPECS.values():
        deepep_cast = mode == "low_latency" and deepep.fp8_transport_reason(mode, spec, H) is None
        assert_quantized_dispatch(
            rows_ops.dispatch(*args, *ep_args),
            rows_ops.dispatch_quant(*args, spec.weights, spec.activations, spec.block_list,
                                    *ep_args),
            spec, one_fp8_step=deepep_cast)


def _check_quantized_module(rank, max_tokens, name, experts, compile_mode):
    """A quantized `MoE` sharded over the group and compiled by Inductor with
    ``a2a="deepep"`` (under ``"reduce-overhead"``: CUDA graphs replaying new tokens),
    against one GPU holding every expert; the lowered graph dispatches fp8 rows, or in
    low-latency mode, where DeepEP's fp8 cast takes the format, fp8 masked blocks."""
    single, sharded = _single_and_sharded(max_tokens, seed=5, quant=QUANT_SPECS[name])
    device = single.w13.device
    graphs = []
    lowering = tmo.backend(a2a="deepep", experts=experts, mode=compile_mode)

    def recording(gm, example_inputs):
        # The lowering rewrites gm in place: what it holds after the call is the lowered graph.
        graphs.append(gm)
        return lowering(gm, example_inputs)

    compiled = torch.compile(sharded, backend=recording, fullgraph=True, dynamic=False)
    counters = torch._dynamo.utils.counters
    counters.clear()
    with torch.no_grad():
        for seed in range(3):
            gen = torch.Generator().manual_seed(30 + seed)
            x_NH = torch.randn(sum(_layout()), H, generator=gen).to(device,
                                                                          torch.bfloat16)
            out_TH = compiled(x_NH[_mine(rank)]).clone()
            assert_close_scaled(out_TH, single(x_NH)[_mine(rank)], 2e-2, 2e-2)
    mode = deepep.choose_mode(_world(), H, K, max_tokens)
    expected = (f"{deepep.ROWS_NAMESPACES[mode]}::dispatch_quant",
                f"moe_{experts}::experts_rows_quant", f"{deepep.ROWS_NAMESPACES[mode]}::combine")
    if (mode == "low_latency"
            and deepep.fp8_transport_reason("low_latency", QUANT_SPECS[name], H) is None):
        expected = ("moe_deepep::dispatch_masked_quant", f"moe_{experts}::experts_masked_quant",
                    "moe_deepep::combine_masked")
    assert moe_op_sequence(graphs[0]) == "\n".join((route_op(sharded), *expected))
    if compile_mode == "reduce-overhead":
        assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    torch._dynamo.reset()


def _run_quantized(rank, world_size, mode):
    # Normal mode: a size low-latency mode cannot run, so that compiled layers take it too.
    max_tokens = M_NOT_LOW_LATENCY if mode == "normal" else M_LOW_LATENCY
    comm = deepep.communicator(dist.group.WORLD.group_name, H, E, K, max_tokens,
                               torch.bfloat16, mode=mode)
    assert comm.mode == mode
    _check_dispatch_quant(rank, mode, max_tokens)
    for case in QUANT_MODULES:
        _check_quantized_module(rank, max_tokens, *case)
    _no_handles_left()
    deepep.close_all()


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids="P{}".format)
@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_quantized_layers_dispatch_fp8_through_deepep(mode, world_size):
    _launch(world_size, _run_quantized, mode, deadline_s=QUANT_DEADLINE_S)
