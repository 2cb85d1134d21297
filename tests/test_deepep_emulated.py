"""The ``deepep`` a2a backend's bookkeeping on CPU processes (gloo), with DeepEP itself
replaced by tests/deepep_emulator.py: every rank's outputs and gradients equal the
single-process reference (bf16 bounds), in normal and low-latency mode, with an idle
rank, skipped slots, every slot on one rank, a capacity below the worst case, and
low-latency messages arriving in a random order. The tokens format (DeepEP's normal mode,
``dispatch_tokens -> moe_reference::experts -> combine_tokens``) against the same reference
with an idle rank, skipped slots, repeated ids and every slot on one rank, its fakes
(opcheck), and compiled layers that take it without gradients and rows with; in flight
(``dispatch_tokens_start`` waited by the graph's ``wait_tensor``), compiled in 2 and 3
chunks and with the shared experts issued between a dispatch and its wait. The masked
format (DeepEP's low-latency mode, ``dispatch_masked -> moe_reference::experts_masked ->
combine_masked``) on 2 and 3 ranks against the same reference with an idle rank, uneven
token counts, skipped slots, repeated ids, every slot on one rank and one expert that
every token chooses, the experts' rows past each count poisoned, its fakes (opcheck), the
gradient it refuses, and compiled layers that take it without gradients (`tmo.explain`
says so) and low-latency rows with. Quantized layers: fp8 rows and their scales through
DeepEP's fp8 dispatch (``moe_deepep::dispatch_quant``, in the lowered graph), and at
decode size fp8 masked blocks (``moe_deepep::dispatch_masked_quant``), against the
single-process quantized layer, and bf16 tokens to experts that quantize inside.

What this cannot tell is whether DeepEP's kernels behave as the emulator does:
tests/test_deepep_gpu.py runs the real one on GPUs.

Legend: P ranks, T tokens of one rank, N tokens of all ranks, H hidden size,
I expert intermediate size, E experts, E_l = E / P, K experts per token, M
max_tokens_per_rank.
"""

from __future__ import annotations

import dataclasses
import gc
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import deepep_emulator
import torch_moe_ops as tmo
from distributed import run_on_ranks
from ep_problems import (
    assert_quantized_dispatch,
    assert_rank_matches,
    check_bf16_grad,
    check_bf16_out,
    draw_problem,
    leaves,
    recording_backend,
    token_slice,
    trained_and_served,
)
from torch_moe_ops import quant
from torch_moe_ops.backends.common.kernels.rows import masked_valid
from torch_moe_ops.backends.deepep import ROWS_NAMESPACES, configs, fp8_transport_reason
from torch_moe_ops.backends.deepep.modes import INTRANODE_RANKS
from torch_moe_ops.backends.registry import REGISTRY
from torch_moe_ops.config import QuantSpec
from torch_moe_ops.lowering import plan
from torch_moe_ops.lowering.rewrite import moe_op_sequence

# A hidden size DeepEP's low-latency kernels are compiled for.
H, I = 2048, 16
TOKENS_PER_RANK = {2: (5, 0), 3: (4, 0, 7), 4: (6, 0, 3, 1)}
M_NORMAL, M_LOW_LATENCY = 8, 6
# Low-latency mode does not run 2 * 7 positions (a multiple of 4): a decode layer of this
# size takes the tokens format and normal mode.
M_NOT_LOW_LATENCY = 7
# The masked format at 2 and 3 ranks: low-latency mode needs P * M to be a multiple of 4.
M_MASKED = 8
# (K, E_l): K above, at and below E_l.
SHAPES = ((2, 3), (3, 2), (1, 4))
STATIC = ("silu", 1.702, 7.0)
# torch.library.opcheck's checks that call combine_tokens once, each run on its own (its
# AOT-dispatch check calls it twice for one dispatch; the compiled layers below trace it).
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")


def _my_tokens(rank, world_size):
    return token_slice(TOKENS_PER_RANK[world_size], rank)


def _full_problem(world_size, num_experts, top_k, route, seed=7):
    """Every rank's tokens and routing and every expert's weights, alike on all ranks."""
    hidden_NH, weights_NK, ids_NK, experts = draw_problem(
        seed, route, sum(TOKENS_PER_RANK[world_size]), num_experts, world_size, H, I, top_k)
    return hidden_NH.bfloat16(), weights_NK, ids_NK, [w.bfloat16() for w in experts.values()]


def _check_ops(rank, world_size, deepep, mode, top_k, num_local, route, capacity_drop):
    num_experts = num_local * world_size
    max_tokens = M_NORMAL if mode == "normal" else M_LOW_LATENCY
    group = dist.group.WORLD.group_name
    comm = deepep.communicator(group, H, num_experts, top_k, max_tokens, torch.bfloat16,
                               mode=mode, device="cpu")
    hidden_NH, weights_NK, ids_NK, full = _full_problem(world_size, num_experts, top_k, route)
    mine = _my_tokens(rank, world_size)
    local = slice(rank * num_local, (rank + 1) * num_local)
    ref_leaves = leaves(hidden_NH, weights_NK, *full)
    ref_NH = torch.ops.moe_reference.experts(ref_leaves[0], ref_leaves[1], ids_NK,
                                             *ref_leaves[2:], *STATIC)
    grad_NH = torch.randn(ref_NH.shape, generator=torch.Generator().manual_seed(3)).bfloat16()
    ref_NH.backward(grad_NH)

    hidden_TH, weights_TK, *experts = leaves(hidden_NH[mine], weights_NK[mine],
                                              *(w[local] for w in full))
    capacity = max_tokens * min(top_k, num_local) - capacity_drop
    ep_args = (world_size, group, max_tokens)
    rows_ops = getattr(torch.ops, deepep.ROWS_NAMESPACES[mode])
    x_RH, expert_R, weight_R, src_R, count_E, combine_map_TK = rows_ops.dispatch(
        hidden_TH, weights_TK, ids_NK[mine], num_experts, *ep_args, capacity)
    assert x_RH.shape == (world_size * capacity, H)
    offset = 0
    for e, count in enumerate(count_E.tolist()):
        assert (expert_R[offset:offset + count] == e).all()
        offset += count
    assert (expert_R[offset:] == -1).all() and (src_R[offset:] == -1).all()
    y_RH = torch.ops.moe_reference.experts_rows(x_RH, expert_R, count_E, *experts, *STATIC)
    out_TH = rows_ops.combine(y_RH, weight_R, src_R, combine_map_TK, *ep_args)
    out_TH.backward(grad_NH[mine])

    assert_rank_matches(out_TH, [hidden_TH, weights_TK, *experts], ref_NH, ref_leaves, mine,
                        local, check_bf16_out, check_bf16_grad)
    assert comm.mode == mode and comm.buffer.calls


def _ops_cases(rank, world_size):
    deepep = deepep_emulator.install()
    for mode in ("normal", "low_latency"):
        for top_k, num_local in SHAPES:
            for route, drop in (("random", 0), ("one_rank", 0), ("random", 1)):
                _check_ops(rank, world_size, deepep, mode, top_k, num_local, route, drop)
                gc.collect()
                # A normal-mode handle lives as long as its src_rows.
                assert not any(c.handles for c in deepep.open_communicators())
            if mode == "low_latency":
                # One NVSHMEM communicator per process: close it before the next shape.
                deepep.close_all()
    deepep.close_all()
    assert not deepep.open_communicators()


def _moe_config(world_size, ep_size, max_tokens, intermediate_size=I, quant=None):
    return tmo.MoEConfig(hidden_size=H, intermediate_size=intermediate_size,
                         num_experts=4 * world_size, top_k=2, renormalize=True,
                         expert_bias=True, ep_size=ep_size,
                         max_tokens_per_rank=max_tokens if ep_size > 1 else None, quant=quant)


def _single_and_sharded(world_size, max_tokens, intermediate_size=I, quant=None):
    """The single-process bf16 `MoE` and this rank's shard of it over the default group,
    with the same full weights (seed 5)."""
    torch.manual_seed(5)
    single = tmo.MoE(_moe_config(world_size, 1, max_tokens, intermediate_size, quant),
                     dtype=torch.bfloat16)
    sharded = tmo.MoE(_moe_config(world_size, world_size, max_tokens, intermediate_size, quant),
                      dtype=torch.bfloat16, ep_group=dist.group.WORLD)
    sharded.load_full_weights(single.state_dict())
    return single, sharded


class TwoLayers(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x_TH):
        for layer in self.layers:
            x_TH = x_TH + layer(x_TH)
        return x_TH


def _compiled_cases(rank, world_size, inner):
    """Two `MoE` layers sharded over the group, compiled with ``a2a="deepep"``, against
    the same layers in one process: outputs and input gradients. Under Inductor the
    idle rank's collectives must survive though their outputs are empty."""
    deepep = deepep_emulator.install()
    group = dist.group.WORLD
    # The plan takes normal mode where low-latency mode cannot run the layer.
    for mode, max_tokens in (("normal", M_NOT_LOW_LATENCY), ("low_latency", M_LOW_LATENCY)):
        torch._dynamo.reset()
        torch.manual_seed(5)
        singles = [tmo.MoE(_moe_config(world_size, 1, max_tokens), dtype=torch.bfloat16)
                   for _ in range(2)]
        sharded = [tmo.MoE(_moe_config(world_size, world_size, max_tokens),
                           dtype=torch.bfloat16, ep_group=group) for _ in range(2)]
        for one, many in zip(singles, sharded):
            many.load_full_weights(one.state_dict())
        x_NH = torch.randn(sum(TOKENS_PER_RANK[world_size]), H,
                           generator=torch.Generator().manual_seed(9)).bfloat16()
        mine = _my_tokens(rank, world_size)
        x_ref = x_NH.clone().requires_grad_()
        ref_NH = TwoLayers(singles)(x_ref)
        ref_NH.float().square().sum().backward()
        compiled = torch.compile(TwoLayers(sharded),
                                 backend=tmo.backend(a2a="deepep", inner=inner),
                                 fullgraph=True, dynamic=False)
        x_TH = x_NH[mine].clone().requires_grad_()
        out_TH = compiled(x_TH)
        out_TH.float().square().sum().backward()
        check_bf16_out(out_TH, ref_NH[mine].detach())
        check_bf16_grad(x_TH.grad, x_ref.grad[mine])
        (comm,) = deepep.open_communicators()
        assert comm.mode == mode and comm.buffer.calls
        deepep.close_all()


@pytest.mark.parametrize("world_size", [2, 4])
def test_ops_match_single_process(world_size):
    run_on_ranks(world_size, _ops_cases)


def _modes_cases(rank, world_size):
    """Each mode's rows ops (`ROWS_NAMESPACES`) run that mode with only the other mode's
    communicator of the layer's shape open: they open their own, and the other takes no call.
    Normal mode's kernels take the SMs set before its communicator opened."""
    deepep = deepep_emulator.install()
    deepep.set_num_sms(24)
    group, num_experts, top_k = dist.group.WORLD.group_name, 4 * world_size, 2
    hidden_NH, weights_NK, ids_NK, _ = _full_problem(world_size, num_experts, top_k, "random")
    mine = _my_tokens(rank, world_size)
    ep_args = (world_size, group, M_LOW_LATENCY)
    for mode, other in (("normal", "low_latency"), ("low_latency", "normal")):
        open_before = deepep.communicator(group, H, num_experts, top_k, M_LOW_LATENCY,
                                          torch.bfloat16, mode=other, device="cpu")
        rows_ops = getattr(torch.ops, deepep.ROWS_NAMESPACES[mode])
        x_RH, _, weight_R, src_R, _, combine_map_TK = rows_ops.dispatch(
            hidden_NH[mine], weights_NK[mine], ids_NK[mine], num_experts, *ep_args,
            M_LOW_LATENCY * top_k)
        rows_ops.combine(x_RH, weight_R, src_R, combine_map_TK, *ep_args)
        ran = {comm.mode: comm for comm in deepep.open_communicators()}
        assert not open_before.buffer.calls and ran[mode].buffer.calls, ran
        normal = ran["normal"]
        assert (normal.num_sms, normal.dispatch_config.num_sms,
                normal.combine_config.num_sms) == (24, 24, 24)
        assert "24 SMs" in repr(normal) and ran["low_latency"].num_sms is None
        deepep.close_all()


def test_rows_ops_run_their_namespaces_mode_whatever_is_open():
    run_on_ranks(2, _modes_cases)


def test_normal_mode_configs_by_world_size(monkeypatch):
    monkeypatch.setattr(configs, "NUM_SMS", configs.NUM_SMS)
    for world_size in INTRANODE_RANKS:
        dispatch, combine = configs.normal_configs(deepep_emulator, world_size)
        assert dispatch.num_sms == combine.num_sms == configs.NUM_SMS
    configs.set_num_sms(32)
    assert configs.normal_configs(deepep_emulator, 2)[0].num_sms == 32
    with pytest.raises(ValueError, match="got 3"):
        configs.normal_configs(deepep_emulator, 3)
    assert configs.normal_configs(deepep_emulator, 2, device_sms=33)[0].num_sms == 32
    with pytest.raises(ValueError, match="num_sms must be below the GPU's 32 SMs.*got 32"):
        configs.normal_configs(deepep_emulator, 2, device_sms=32)
    for wrong in (7, 0, True, 24.0):
        with pytest.raises(ValueError, match=f"num_sms must be an even int >= 2.*got {wrong!r}"):
            configs.set_num_sms(wrong)
    assert configs.NUM_SMS == 32


def test_compiled_layers_match_single_process():
    run_on_ranks(2, _compiled_cases, "aot_eager")


@pytest.mark.slow
def test_idle_rank_keeps_its_collectives_under_inductor():
    run_on_ranks(2, _compiled_cases, "inductor")



# The tokens format: DeepEP's normal mode, for layers without gradients.

TOKENS_OPS = ("moe_deepep::dispatch_tokens", "moe_reference::experts",
              "moe_deepep::combine_tokens")
# Each routing a case of its own: skipped slots, every slot on rank 0's experts, a token
# choosing one expert in several slots.
TOKENS_ROUTINGS = ("random", "one_rank", "repeated")


def _check_tokens(rank, world_size, top_k, num_local, route, max_tokens):
    """dispatch_tokens -> moe_reference::experts on the receive buffers as they are ->
    combine_tokens against the reference on all tokens; with the random routing, the
    fakes against the real outputs (opcheck: every rank runs its calls in the same order)."""
    num_experts = num_local * world_size
    hidden_NH, weights_NK, ids_NK, full = _full_problem(
        world_size, num_experts, top_k, "random" if route == "repeated" else route)
    if route == "repeated":
        ids_NK[1::2, -1] = ids_NK[1::2, 0]
    mine, local = _my_tokens(rank, world_size), slice(rank * num_local, (rank + 1) * num_local)
    ep_args = (world_size, dist.group.WORLD.group_name, max_tokens)
    args = (hidden_NH[mine], weights_NK[mine], ids_NK[mine], num_experts, *ep_args)
    if route == "random":
        torch.library.opcheck(torch.ops.moe_deepep.dispatch_tokens.default, args)
    x_NH, weights_tokens_NK, local_NK = torch.ops.moe_deepep.dispatch_tokens(*args)
    assert x_NH.shape == (world_size * max_tokens, H) and local_NK.dtype == torch.int32
    assert -1 <= int(local_NK.min()) and int(local_NK.max()) < num_local
    y_NH = torch.ops.moe_reference.experts(x_NH, weights_tokens_NK, local_NK,
                                           *(w[local] for w in full), *STATIC)
    combine_args = (y_NH, ids_NK[mine], num_experts, *ep_args)
    if route == "random":
        # One combine answers one dispatch: each check that runs the op gets its own.
        for check in OPCHECK_UTILS:
            torch.library.opcheck(torch.ops.moe_deepep.combine_tokens.default, combine_args,
                                  test_utils=check)
            torch.ops.moe_deepep.dispatch_tokens(*args)
    out_TH = torch.ops.moe_deepep.combine_tokens(*combine_args)
    with pytest.raises(RuntimeError, match="must answer the dispatch_tokens before it"):
        torch.ops.moe_deepep.combine_tokens(*combine_args)
    ref_NH = torch.ops.moe_reference.experts(hidden_NH, weights_NK, ids_NK, *full, *STATIC)
    assert out_TH.shape == (mine.stop - mine.start, H)
    check_bf16_out(out_TH, ref_NH[mine])


def _trained_and_served(rank, world_size, max_tokens):
    """`trained_and_served` of a bf16 `MoE` sharded over the group with ``a2a="deepep"``,
    against the same layer in one process: the sharded layer, this rank's tokens, and the
    op sequences of its training and its serving graphs."""
    torch._dynamo.reset()
    single, sharded = _single_and_sharded(world_size, max_tokens)
    x_NH = torch.randn(sum(TOKENS_PER_RANK[world_size]), H,
                       generator=torch.Generator().manual_seed(9)).bfloat16()
    x_TH = x_NH[_my_tokens(rank, world_size)]
    return sharded, x_TH, *trained_and_served(single, sharded, x_NH,
                                              _my_tokens(rank, world_size), a2a="deepep",
                                              experts="reference")


def _check_tokens_compiled(rank, world_size, deepep, max_tokens):
    """A `MoE` sharded over the group and compiled with ``a2a="deepep"``: with gradients
    it keeps rows (in the mode `choose_mode` gives), without it takes the tokens chain on a
    normal-mode communicator of its own; both against the same layer in one process."""
    _, _, trained, served = _trained_and_served(rank, world_size, max_tokens)
    assert "moe_deepep::dispatch\n" in trained and "dispatch_tokens" not in trained, trained
    assert served == "moe_reference::route\n" + "\n".join(TOKENS_OPS), served
    modes = {comm.mode for comm in deepep.open_communicators()}
    assert modes == {"normal", deepep.choose_mode(world_size, H, 2, max_tokens)}, modes


def _tokens_cases(rank, world_size):
    deepep = deepep_emulator.install()
    for max_tokens in (M_NORMAL, M_LOW_LATENCY):
        for top_k, num_local in SHAPES:
            for route in TOKENS_ROUTINGS:
                _check_tokens(rank, world_size, top_k, num_local, route, max_tokens)
    # Every tokens communicator runs normal mode, whatever max_tokens_per_rank.
    assert {comm.mode for comm in deepep.open_communicators()} == {"normal"}
    # A combine that does not answer the dispatch before it fails on every rank, sending nothing.
    ep_args = (world_size, dist.group.WORLD.group_name, M_LOW_LATENCY)
    with pytest.raises(RuntimeError, match="must answer the dispatch_tokens before it"):
        torch.ops.moe_deepep.combine_tokens(
            torch.zeros(world_size * M_LOW_LATENCY, H, dtype=torch.bfloat16),
            torch.zeros(3, 1, dtype=torch.int32), 4 * world_size, *ep_args)
    deepep.close_all()
    _check_tokens_compiled(rank, world_size, deepep, M_NOT_LOW_LATENCY)
    deepep.close_all()
    assert not deepep.open_communicators()


def test_tokens_chain_matches_single_process():
    run_on_ranks(2, _tokens_cases)


# The tokens format in flight (`backends.deepep.in_flight`): issued by one op, waited by the
# graph's wait node (`_c10d_functional.wait_tensor`, which calls back into the backend).

IN_FLIGHT_H = 64


def _in_flight_layers(world_size, max_tokens, shared):
    torch._dynamo.reset()
    torch.manual_seed(3)
    cfg = dict(hidden_size=IN_FLIGHT_H, intermediate_size=I, num_experts=2 * world_size,
               top_k=2, renormalize=True,
               **({"shared_expert_intermediate_size": I} if shared else {}))
    single = tmo.MoE(tmo.MoEConfig(**cfg)).bfloat16()
    sharded = tmo.MoE(tmo.MoEConfig(**cfg, ep_size=world_size, max_tokens_per_rank=max_tokens),
                      ep_group=dist.group.WORLD).bfloat16()
    sharded.load_full_weights(single.state_dict())
    return single, sharded


def _check_in_flight(rank, world_size, deepep, inner, chunks, shared, tokens_per_rank,
                     max_tokens, dynamic=None):
    """A layer compiled with ``a2a="deepep"`` (and ``dynamic``) whose tokens move in flight
    (in ``chunks``, or with ``overlap=True`` around its shared experts) equals the
    single-process layer; its lowered graph issues each chunk's dispatch and combine and
    waits for them, and no chunk stays in flight after the call."""
    single, sharded = _in_flight_layers(world_size, max_tokens, shared)
    x_NH = torch.randn(sum(tokens_per_rank), IN_FLIGHT_H,
                       generator=torch.Generator().manual_seed(9)).bfloat16()
    mine = token_slice(tokens_per_rank, rank)
    options = {"chunks": chunks} if chunks > 1 else {"overlap": True}
    backend = tmo.backend(inner=inner, a2a="deepep", experts="reference", **options)
    lowered, prepared = [], []

    def recording(gm, example_inputs):
        compiled = backend(gm, example_inputs)  # lowers gm in place
        lowered.append(gm)
        return compiled

    deepep_a2a = REGISTRY.a2a["deepep"]
    # The communicator is opened when the layer is compiled, for the M each chunk moves.
    REGISTRY.a2a["deepep"] = dataclasses.replace(deepep_a2a, prepare=lambda *args: (
        prepared.append(args[-1]), deepep_a2a.prepare(*args)))
    try:
        compiled = torch.compile(sharded, fullgraph=True, backend=recording, dynamic=dynamic)
        with torch.no_grad():
            check_bf16_out(compiled(x_NH[mine]), single(x_NH)[mine])
    finally:
        REGISTRY.a2a["deepep"] = deepep_a2a
    assert prepared == [-(-max_tokens // chunks)], prepared
    ops = moe_op_sequence(lowered[-1]).splitlines()
    assert ops.count("moe_deepep::dispatch_tokens_start") == chunks, ops
    assert ops.count("moe_deepep::combine_tokens_start") == chunks, ops
    assert "moe_deepep::dispatch_tokens" not in ops, ops
    # Every transfer was waited for (each wait consumed its registration), and every chunk
    # combined.
    assert torch._C._distributed_c10d._get_work_registry_size() == 0
    assert all(not comm.in_flight for comm in deepep.open_communicators())
    if shared:
        nodes = list(lowered[-1].graph.nodes)
        started = next(i for i, n in enumerate(nodes)
                       if "dispatch_tokens_start" in str(n.target))
        first_wait = next(i for i, n in enumerate(nodes) if "wait_tensor" in str(n.target))
        shared_work = [i for i, n in enumerate(nodes) if n.op == "call_function" and any(
            a.op == "placeholder" and "shared_experts" in a.name for a in n.all_input_nodes)]
        assert shared_work and started < shared_work[0] < first_wait, lowered[-1].code


def _in_flight_cases(rank, world_size):
    deepep = deepep_emulator.install()
    tokens_per_rank = TOKENS_PER_RANK[world_size]
    for inner in ("aot_eager", "inductor"):
        # 2 and 3 chunks of M_NORMAL: an idle rank, windows past a rank's tokens.
        for chunks in (2, 3):
            _check_in_flight(rank, world_size, deepep, inner, chunks, False, tokens_per_rank,
                             M_NORMAL)
    # dynamic=True: ranks of 0 and 1 tokens (graphs of their own) issue the same transfers.
    for tokens in ((5, 0), (1, 6), (0, 1)):
        _check_in_flight(rank, world_size, deepep, "aot_eager", 2, False, tokens, M_NORMAL,
                         dynamic=True)
    # The shared experts under the transfer: prefill sizes (`plan.IN_FLIGHT_TOKENS`).
    _check_in_flight(rank, world_size, deepep, "inductor", 1, True, (600, 900),
                     plan.IN_FLIGHT_TOKENS)
    # A combine of a chunk that is not in flight fails, sending nothing (the communicator of
    # the 2 chunks' M is open, none of its chunks in flight).
    chunk_tokens = M_NORMAL // 2
    ep_args = (world_size, dist.group.WORLD.group_name, chunk_tokens)
    with pytest.raises(RuntimeError, match="must answer a dispatch_tokens_start of that chunk"):
        torch.ops.moe_deepep.combine_tokens_start(
            torch.zeros(world_size * chunk_tokens, IN_FLIGHT_H, dtype=torch.bfloat16),
            torch.zeros(3, 2, dtype=torch.int32), 2 * world_size, *ep_args, 1, 2)
    _check_in_flight_reads_its_own_copies(rank, world_size, deepep, ep_args)
    deepep.close_all()


def _check_in_flight_reads_its_own_copies(rank, world_size, deepep, ep_args):
    """DeepEP's kernels in flight read their tokens after the op returns, when a compiled
    graph may have given the op's input buffers to other kernels (Inductor keeps only a
    functional collective's input alive until its wait): what the in-flight ops hand
    DeepEP shares no storage with their inputs."""
    (comm,) = [c for c in deepep.open_communicators() if c.max_tokens_per_rank == ep_args[-1]]
    buffer_type = type(comm.buffer)
    sent = []

    def spy(method):
        def call(self, x, *args, **kwargs):
            if kwargs.get("async_finish"):
                sent.append(x)
            return method(self, x, *args, **kwargs)
        return call

    gen = torch.Generator().manual_seed(rank)
    hidden_TH = torch.randn(3, IN_FLIGHT_H, generator=gen).bfloat16()
    weights_TK = torch.rand(3, 2, generator=gen)
    ids_TK = torch.randint(0, 2 * world_size, (3, 2), generator=gen, dtype=torch.int32)
    dispatch, combine = buffer_type.dispatch, buffer_type.combine
    buffer_type.dispatch, buffer_type.combine = spy(dispatch), spy(combine)
    try:
        x_NH, routing_NX = torch.ops.moe_deepep.dispatch_tokens_start(
            hidden_TH, weights_TK, ids_TK, 2 * world_size, *ep_args, 0, 2)
        for tensor in (x_NH, routing_NX):
            torch.ops._c10d_functional.wait_tensor(tensor)
        y_NH = x_NH * 2
        torch.ops._c10d_functional.wait_tensor(torch.ops.moe_deepep.combine_tokens_start(
            y_NH, ids_TK, 2 * world_size, *ep_args, 0, 2))
    finally:
        buffer_type.dispatch, buffer_type.combine = dispatch, combine
    assert len(sent) == 2, sent
    for read, given in zip(sent, (hidden_TH, y_NH)):
        assert read.untyped_storage().data_ptr() != given.untyped_storage().data_ptr()


def test_tokens_in_flight_match_single_process():
    run_on_ranks(2, _in_flight_cases)


# The masked format: DeepEP's low-latency blocks as they arrive, for layers without gradients.

MASKED_OPS = ("moe_deepep::dispatch_masked", "moe_reference::experts_masked",
              "moe_deepep::combine_masked")
# Besides the tokens routings: every token's first slot on expert 0 (its other slots on
# expert 0 skipped), so that one expert gets every token of every rank.
MASKED_ROUTINGS = (*TOKENS_ROUTINGS, "hot")
FAKE_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor")


def _masked_routing(world_size, num_experts, top_k, route):
    hidden_NH, weights_NK, ids_NK, full = _full_problem(
        world_size, num_experts, top_k, route if route == "one_rank" else "random")
    if route == "repeated":
        ids_NK[1::2, -1] = ids_NK[1::2, 0]
    if route == "hot":
        ids_NK = torch.where(ids_NK == 0, -1, ids_NK)
        ids_NK[:, 0] = 0
    return hidden_NH, weights_NK, ids_NK, full


def _check_masked(rank, world_size, top_k, num_local, route):
    """dispatch_masked -> moe_reference::experts_masked on DeepEP's blocks as they are ->
    combine_masked against the reference on all tokens, with the experts' rows past each
    count poisoned (nothing may read them); the counts against the routing; with the
    random routing, the fakes against the real outputs (opcheck)."""
    num_experts = num_local * world_size
    hidden_NH, weights_NK, ids_NK, full = _masked_routing(world_size, num_experts, top_k, route)
    mine, local = _my_tokens(rank, world_size), slice(rank * num_local, (rank + 1) * num_local)
    ep_args = (world_size, dist.group.WORLD.group_name, M_MASKED)
    args = (hidden_NH[mine], weights_NK[mine], ids_NK[mine], num_experts, *ep_args)
    if route == "random":
        # Not the eager-against-traced test: two dispatches differ in arrival order and in
        # the garbage past the counts, as DeepEP's do.
        torch.library.opcheck(torch.ops.moe_deepep.dispatch_masked.default, args,
                              test_utils=FAKE_TESTS)
    x_EQH, count_E, src_info_EQ, layout_range_EP = torch.ops.moe_deepep.dispatch_masked(*args)
    rows_per_expert = world_size * M_MASKED
    assert x_EQH.shape == (num_local, rows_per_expert, H) and count_E.dtype == torch.int32
    expected_E = torch.stack([(ids_NK == e).sum() for e in range(num_experts)])[local]
    assert count_E.tolist() == expected_E.tolist()
    y_EQH = torch.ops.moe_reference.experts_masked(x_EQH, count_E, *(w[local] for w in full),
                                                   *STATIC)
    past_count_EQ1 = ~masked_valid(count_E, rows_per_expert)
    y_EQH = y_EQH.masked_fill(past_count_EQ1, math.nan)
    combine_args = (y_EQH, src_info_EQ, layout_range_EP, weights_NK[mine], ids_NK[mine],
                    num_experts, *ep_args)
    if route == "random":
        torch.library.opcheck(torch.ops.moe_deepep.combine_masked.default, combine_args)
    out_TH = torch.ops.moe_deepep.combine_masked(*combine_args)
    ref_NH = torch.ops.moe_reference.experts(hidden_NH, weights_NK, ids_NK, *full, *STATIC)
    assert out_TH.shape == (mine.stop - mine.start, H)
    check_bf16_out(out_TH, ref_NH[mine])


def _check_masked_compiled(rank, world_size, deepep):
    """A `MoE` sharded over the group and compiled with ``a2a="deepep"`` at decode size:
    with gradients it takes low-latency rows, without them the masked chain on the same
    low-latency communicator; both against the same layer in one process."""
    sharded, x_TH, trained, served = _trained_and_served(rank, world_size, M_MASKED)
    assert "moe_deepep_low_latency::dispatch\n" in trained and "masked" not in trained, trained
    assert served == "moe_reference::route\n" + "\n".join(MASKED_OPS), served
    assert {comm.mode for comm in deepep.open_communicators()} == {"low_latency"}
    # `tmo.explain` says so: the format, why, and one bf16 row per (token, slot) at most.
    with torch.no_grad():
        (report,) = tmo.explain(sharded, x_TH, a2a="deepep", experts="reference")
    text, row_bytes = str(report), M_MASKED * 2 * H * 2
    assert "format:  masked (the transport's decode layout, read where it arrives" in text, text
    assert "mode:    low_latency (the masked format is its own layout)" in text, text
    assert (f"bytes each rank sends per call: dispatch {row_bytes:,}, combine {row_bytes:,}"
            in text), text


def _masked_cases(rank, world_size):
    deepep = deepep_emulator.install()
    for top_k, num_local in SHAPES:
        for route in MASKED_ROUTINGS:
            _check_masked(rank, world_size, top_k, num_local, route)
        # One NVSHMEM communicator per process: close it before the next shape.
        deepep.close_all()
    # The transport's receive buffers carry no gradient: asking for one says so.
    hidden_NH, weights_NK, ids_NK, _ = _masked_routing(world_size, 4 * world_size, 2, "random")
    mine = _my_tokens(rank, world_size)
    hidden_TH = hidden_NH[mine].clone().requires_grad_()
    x_EQH, *_ = torch.ops.moe_deepep.dispatch_masked(
        hidden_TH, weights_NK[mine], ids_NK[mine], 4 * world_size, world_size,
        dist.group.WORLD.group_name, M_MASKED)
    with pytest.raises(RuntimeError, match="dispatch_masked has no gradient"):
        x_EQH.float().sum().backward()
    deepep.close_all()
    _check_masked_compiled(rank, world_size, deepep)
    deepep.close_all()
    assert not deepep.open_communicators()


@pytest.mark.parametrize("world_size", [2, 3])
def test_masked_chain_matches_single_process(world_size):
    run_on_ranks(world_size, _masked_cases)


def _masked_inductor_cases(rank, world_size):
    """The masked chain compiled by Inductor, serving: the idle rank's dispatch and
    combine survive though their outputs are empty (ordered effects)."""
    deepep = deepep_emulator.install()
    torch._dynamo.reset()
    single, sharded = _single_and_sharded(world_size, M_MASKED)
    sequences = []
    compiled = torch.compile(sharded, backend=recording_backend(
        sequences, a2a="deepep", experts="reference", inner="inductor"), fullgraph=True,
        dynamic=False)
    mine = _my_tokens(rank, world_size)
    with torch.no_grad():
        for seed in (9, 10):
            x_NH = torch.randn(sum(TOKENS_PER_RANK[world_size]), H,
                               generator=torch.Generator().manual_seed(seed)).bfloat16()
            check_bf16_out(compiled(x_NH[mine]), single(x_NH)[mine])
    assert sequences == ["moe_reference::route\n" + "\n".join(MASKED_OPS)], sequences
    deepep.close_all()


@pytest.mark.slow
def test_masked_chain_keeps_the_idle_rank_under_inductor():
    run_on_ranks(2, _masked_inductor_cases)


# Quantized layers: fp8 rows through DeepEP.

# 128 x 128 weight blocks need I to be a multiple of 128.
QUANT_I = 128
QUANT_SPECS = {
    # Normal mode: one scale beside each row; low-latency: bf16, quantized on arrival.
    "fp8_token": QuantSpec("fp8_channel"),
    # 1 x 128 groups: low-latency mode sends them through DeepEP's own cast.
    "fp8_group": QuantSpec("fp8_block"),
    # Normal mode: 32 scales beside each row; low-latency: bf16, quantized on arrival.
    "fp8_group64": QuantSpec("fp8_block", block_size=(128, 64)),
}
MODES = {"normal": M_NORMAL, "low_latency": M_LOW_LATENCY}


def _check_dispatch_quant(rank, world_size, mode, spec):
    """``moe_deepep::dispatch_quant`` against ``moe_deepep::dispatch`` then the oracle's
    quantizer (DeepEP's low-latency cast: within one e4m3 step), every rank, the idle
    one too; and the op's fake against its outputs (opcheck)."""
    num_experts, top_k = 4 * world_size, 2
    hidden_NH, weights_NK, ids_NK, _ = _full_problem(world_size, num_experts, top_k, "random")
    mine = _my_tokens(rank, world_size)
    max_tokens = MODES[mode]
    ep_args = (world_size, dist.group.WORLD.group_name, max_tokens, max_tokens * top_k)
    args = (hidden_NH[mine], weights_NK[mine], ids_NK[mine], num_experts)
    static = (spec.weights, spec.activations, spec.block_list)
    deepep_cast = mode == "low_latency" and fp8_transport_reason(mode, spec, H) is None
    rows_ops = getattr(torch.ops, ROWS_NAMESPACES[mode])
    assert_quantized_dispatch(rows_ops.dispatch(*args, *ep_args),
                              rows_ops.dispatch_quant(*args, *static, *ep_args),
                              spec, one_fp8_step=deepep_cast)
    if spec is QUANT_SPECS["fp8_group"]:
        torch.library.opcheck(rows_ops.dispatch_quant.default, (*args, *static, *ep_args))


# The layers' sizes per mode: normal mode where low-latency mode cannot run the layer.
LAYER_TOKENS = {"normal": M_NOT_LOW_LATENCY, "low_latency": M_LOW_LATENCY}
QUANT_MASKED_OPS = ("moe_deepep::dispatch_masked_quant", "moe_reference::experts_masked_quant",
                    "moe_deepep::combine_masked")


def _check_quantized_layer(rank, world_size, deepep, mode, spec, reads_fp8=True):
    """A quantized `MoE` sharded over the group, compiled with ``a2a="deepep"``
    (aot_eager), against the same layer in one process. ``reads_fp8``: the experts
    read fp8 rows (the lowered graph dispatches with ``dispatch_quant``, through
    DeepEP's fp8 path where `fp8_transport_reason` says so); else they quantize
    inside and get bf16 tokens (the tokens format). In low-latency mode, blocks that
    DeepEP's fp8 cast can carry take the masked format: fp8 blocks and scales as they
    arrive."""
    torch._dynamo.reset()
    max_tokens = LAYER_TOKENS[mode]
    comm = deepep.communicator(dist.group.WORLD.group_name, H, 4 * world_size, 2, max_tokens,
                               torch.bfloat16, mode=mode, device="cpu")
    single, sharded = _single_and_sharded(world_size, max_tokens, QUANT_I, spec)
    x_NH = torch.randn(sum(TOKENS_PER_RANK[world_size]), H,
                       generator=torch.Generator().manual_seed(9)).bfloat16()
    mine = _my_tokens(rank, world_size)
    graphs = []
    lowering = tmo.backend(a2a="deepep", experts="reference", inner="aot_eager")

    def recording(gm, example_inputs):
        # The lowering rewrites gm in place: what it holds after the call is the lowered graph.
        graphs.append(gm)
        return lowering(gm, example_inputs)

    compiled = torch.compile(sharded, backend=recording, fullgraph=True, dynamic=False)
    comm.buffer.calls.clear()
    with torch.no_grad():
        expected_TH = single(x_NH)[mine]
        out_TH = compiled(x_NH[mine])
    assert out_TH.dtype == torch.bfloat16 and out_TH.shape == expected_TH.shape
    check_bf16_out(out_TH, expected_TH)
    fp8_transport = reads_fp8 and fp8_transport_reason(mode, spec, H) is None
    # Masked blocks where DeepEP's cast carries them in fp8; else rows where they cross in
    # fp8; tokens where they would cross in bf16 either way.
    if mode == "low_latency" and fp8_transport:
        expected = QUANT_MASKED_OPS
    elif reads_fp8:
        expected = (f"{ROWS_NAMESPACES[mode]}::dispatch_quant",
                    "moe_reference::experts_rows_quant", f"{ROWS_NAMESPACES[mode]}::combine")
    else:
        expected = ("moe_deepep::dispatch_tokens", "moe_reference::experts_quant",
                    "moe_deepep::combine_tokens")
    assert moe_op_sequence(graphs[0]) == "\n".join(("moe_reference::route", *expected))
    transport = "dispatch" if mode == "normal" else "low_latency_dispatch"
    assert comm.buffer.calls[f"fp8_{transport}"] == int(fp8_transport)
    assert comm.buffer.calls[transport] == int(not fp8_transport)


def _check_dispatch_masked_quant(rank, world_size):
    """``moe_deepep::dispatch_masked_quant``: DeepEP's fp8 blocks and (contiguous) scales,
    the same blocks as ``dispatch_masked`` quantized by DeepEP's cast, and its fake
    (opcheck); formats DeepEP's cast does not make are refused by name."""
    num_experts, top_k = 4 * world_size, 2
    hidden_NH, weights_NK, ids_NK, _ = _full_problem(world_size, num_experts, top_k, "random")
    mine = _my_tokens(rank, world_size)
    args = (hidden_NH[mine], weights_NK[mine], ids_NK[mine], num_experts)
    ep_args = (world_size, dist.group.WORLD.group_name, M_LOW_LATENCY)
    spec = QUANT_SPECS["fp8_group"]
    static = (spec.weights, spec.activations, spec.block_list)
    torch.library.opcheck(torch.ops.moe_deepep.dispatch_masked_quant.default,
                          (*args, *static, *ep_args), test_utils=FAKE_TESTS[1:])
    x_EQH, count_E, _, _, x_scale = torch.ops.moe_deepep.dispatch_masked_quant(
        *args, *static, *ep_args)
    assert x_EQH.dtype == torch.float8_e4m3fn and x_scale.is_contiguous()
    assert x_scale.shape == (*x_EQH.shape[:2], H // 128)
    blocks_EQH, blocks_count_E, *_ = torch.ops.moe_deepep.dispatch_masked(*args, *ep_args)
    assert count_E.tolist() == blocks_count_E.tolist()
    # Arrival order differs between two dispatches: compare each expert's rows as a set.
    for e, count in enumerate(count_E.tolist()):
        values = quant.dequantize_activations(x_EQH[e, :count], x_scale[e, :count], spec)
        expected = blocks_EQH[e, :count].float()
        torch.testing.assert_close(values.sort(0).values, expected.sort(0).values,
                                   rtol=0.07, atol=1e-3)
    token_spec = QUANT_SPECS["fp8_token"]
    with pytest.raises(ValueError, match="sends masked blocks in fp8 through DeepEP's "
                                         "low-latency cast only"):
        torch.ops.moe_deepep.dispatch_masked_quant(
            *args, token_spec.weights, token_spec.activations, token_spec.block_list, *ep_args)


def _quantized_cases(rank, world_size):
    deepep = deepep_emulator.install()
    for mode, max_tokens in MODES.items():
        deepep.communicator(dist.group.WORLD.group_name, H, 4 * world_size, 2, max_tokens,
                            torch.bfloat16, mode=mode, device="cpu")
        for spec in QUANT_SPECS.values():
            _check_dispatch_quant(rank, world_size, mode, spec)
        if mode == "low_latency":
            _check_dispatch_masked_quant(rank, world_size)
        # DeepEP's fp8 path, and (low-latency fp8_token) bf16 quantized on arrival.
        names = ("fp8_group",) if mode == "normal" else ("fp8_group", "fp8_token")
        for name in names:
            _check_quantized_layer(rank, world_size, deepep, mode, QUANT_SPECS[name])
        if mode == "normal":
            # The dispatch dtype rule: experts that quantize inside get bf16 tokens.
            reference = REGISTRY.experts["reference"]
            REGISTRY.experts["reference"] = dataclasses.replace(reference, quantized_rows=())
            try:
                _check_quantized_layer(rank, world_size, deepep, mode, QUANT_SPECS["fp8_token"],
                                       reads_fp8=False)
            finally:
                REGISTRY.experts["reference"] = reference
        gc.collect()
        deepep.close_all()
    torch._dynamo.reset()


def test_quantized_layers_dispatch_fp8_through_deepep():
    run_on_ranks(2, _quantized_cases)


LOW_LATENCY_CAST = ("DeepEP's low-latency kernels quantize to fp8 themselves, with one scale "
                    "per 128 columns only, and the experts read ")


@pytest.mark.parametrize("mode, name, reason", [
    ("normal", "fp8_token", None),
    ("normal", "fp8_group", None),
    ("normal", "fp8_group64", None),
    ("low_latency", "fp8_group", None),
    ("low_latency", "fp8_token", LOW_LATENCY_CAST + "fp8_token rows"),
    ("low_latency", "fp8_group64", LOW_LATENCY_CAST + "fp8_group rows of 64 columns per scale"),
])
def test_fp8_transport_where_deepep_takes_the_format(mode, name, reason):
    assert fp8_transport_reason(mode, QUANT_SPECS[name], H) == reason


def test_fp8_transport_reasons_of_shapes_deepep_does_not_take():
    many_scales = QuantSpec("fp8_block", block_size=(128, 8))
    assert fp8_transport_reason("normal", many_scales, H) == (
        "DeepEP's normal-mode buffers hold <= 128 scales per token, fp8_group with "
        "block_size (128, 8) at hidden size 2048 has 256")
    assert fp8_transport_reason("low_latency", QUANT_SPECS["fp8_group"], 2560 + 128) == (
        "DeepEP's low-latency fp8 cast needs a hidden size that is a multiple of 512, got 2688")
