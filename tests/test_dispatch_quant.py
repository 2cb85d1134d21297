"""fp8 through the all-to-all: ``moe::dispatch_quant``, the lowering that puts it in
place of ``moe::dispatch`` where the dispatch dtype rule picks fp8, and quantized
`MoE` layers sharded over CPU processes (gloo) against one process holding every
expert.

Legend: P ranks, T tokens of one rank, N tokens of all ranks, H hidden size,
I expert intermediate size, E experts, K experts per token, R rows.

A row is a copy of its token, so quantizing before the transport gives the
experts the values they would compute from unquantized rows: fp8 dispatch
(compiled) must equal bf16 dispatch (eager) exactly, and both the single
process up to the order of the sums over K.
"""

from __future__ import annotations

import dataclasses
import operator
import re
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

import torch_moe_ops as tmo
from distributed import run_on_ranks, skip_without_gpus
from ep_problems import assert_close_scaled, route_op, token_slice
from torch_moe_ops import quant
from torch_moe_ops.backends.dispatch_dtype import DEFAULT_RULE, DispatchDtype
from torch_moe_ops.backends.registry import REGISTRY
from torch_moe_ops.config import BackendSpec, QuantSpec
from torch_moe_ops.lowering.rewrite import lower, moe_op_sequence
from torch_moe_ops.ops import op_overload

H, I, E, K = 32, 16, 4, 2
MAX_TOKENS = 6
WORLD_SIZE = 2
# Tokens on each rank: rank 1 has none and still joins every collective.
TOKENS_PER_RANK = (5, 0)
FP8 = quant.FP8_DTYPE
W8A8_TOKEN = QuantSpec("fp8_channel")
W8A8_GROUP = QuantSpec("fp8_block", block_size=(16, 16))
SPECS = {"fp8_token": W8A8_TOKEN, "fp8_group": W8A8_GROUP}
# Weight-only: its rows travel unquantized.
W8A16_BLOCK = QuantSpec("fp8_block", "none", (16, 16))
STATIC = ("silu", 1.702, 7.0)
A2A_NAMESPACES = {"all_to_all": "moe_all_to_all", "allgather": "moe_allgather"}


def _quantized_routing(dispatched, spec):
    """What ``dispatch_quant`` must return, from ``moe::dispatch``'s outputs:
    the rows quantized (as bytes: float8 has no CPU equality) and the routing as is."""
    x_RH, *routing = dispatched
    q_RH, scale = quant.quantize_activations(x_RH, spec)
    return q_RH.view(torch.uint8), scale, routing


def _assert_dispatch_quant_matches(dispatch, dispatch_quant, args, ep_args, spec):
    """``args``: (hidden, topk_weights, topk_ids, num_experts); ``ep_args`` the rest."""
    expected_q, expected_scale, expected_routing = _quantized_routing(
        dispatch(*args, *ep_args), spec)
    x_RH, *routing, x_scale = dispatch_quant(*args, spec.weights, spec.activations,
                                             spec.block_list, *ep_args)
    assert x_RH.dtype == FP8 and x_scale.dtype == torch.float32
    for got, expected in zip(routing, expected_routing, strict=True):
        assert torch.equal(got, expected)
    # Skipped rows (expert -1) hold what the transport left there, in either op.
    kept_R = routing[0] >= 0
    assert torch.equal(x_RH.view(torch.uint8)[kept_R], expected_q[kept_R])
    assert torch.equal(x_scale[kept_R], expected_scale[kept_R])


# One process: the op on the ``none`` a2a backend, its errors, the lowering.

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("num_tokens", [5, 0])
def test_dispatch_quant_sends_quantized_rows(name, dtype, num_tokens, generator):
    hidden_TH = torch.randn(num_tokens, H, generator=generator).to(dtype)
    weights_TK = torch.rand(num_tokens, K, generator=generator)
    ids_TK = torch.randint(0, E, (num_tokens, K), generator=generator, dtype=torch.int32)
    ids_TK[::3, -1] = -1
    _assert_dispatch_quant_matches(torch.ops.moe.dispatch, torch.ops.moe.dispatch_quant,
                                   (hidden_TH, weights_TK, ids_TK, E), (), SPECS[name])


BAD_INPUT = {  # name: (weight_format, activation_format, block_size), message
    "weight_only": (("fp8_block", "none", [16, 16]),
                    ("activation_format must be one of 'fp8_token', 'fp8_group' "
                     "(dispatch_quant sends rows quantized to fp8), got 'none'")),
    "group_not_dividing_H": (("fp8_block", "fp8_group", [16, 24]),
                             ("hidden.shape[1] must be a multiple of block_size[1] (24, "
                              "the columns of one fp8_group scale), got shape (3, 32)")),
    "mxfp4": (("mxfp4", "fp8_token", []),
              ("activation_format must be one of 'none' with weight_format='mxfp4', "
               "got 'fp8_token'")),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_dispatch_quant_bad_input(case, generator):
    static, message = BAD_INPUT[case]
    hidden_TH = torch.randn(3, H, generator=generator)
    ids_TK = torch.zeros(3, K, dtype=torch.int32)
    with pytest.raises(ValueError, match=re.escape(message)):
        torch.ops.moe.dispatch_quant(hidden_TH, torch.rand(3, K), ids_TK, E, *static)


def test_dispatch_quant_has_no_gradient(generator):
    hidden_TH = torch.randn(3, H, generator=generator, requires_grad=True)
    ids_TK = torch.zeros(3, K, dtype=torch.int32)
    spec = W8A8_TOKEN
    *_, x_scale = torch.ops.moe.dispatch_quant(hidden_TH, torch.rand(3, K), ids_TK, E,
                                               spec.weights, spec.activations, spec.block_list)
    with pytest.raises(RuntimeError, match="moe::dispatch_quant has no gradient"):
        x_scale.sum().backward()


def _layer_graph(spec: QuantSpec, dtype=torch.bfloat16, read_rows_elsewhere=False):
    """The FX graph (fake tensors, as the lowering sees it) of one quantized layer
    sharded over 2 ranks: dispatch -> experts_rows_quant -> combine."""
    num_local = E // WORLD_SIZE
    w13, w13_scale = quant.quantize_weights(torch.randn(num_local, 2 * I, H), spec)
    w2, w2_scale = quant.quantize_weights(torch.randn(num_local, H, I), spec)
    ep_args = (WORLD_SIZE, "ep", MAX_TOKENS)

    def layer(x_TH, weights_TK, ids_TK, w13, w2, w13_scale, w2_scale):
        x_RH, expert_R, weight_R, src_R, count_E, combine_map_TK = torch.ops.moe.dispatch(
            x_TH, weights_TK, ids_TK, E, *ep_args, MAX_TOKENS * K)
        y_RH = torch.ops.moe.experts_rows_quant(
            x_RH, None, expert_R, count_E, w13, w2, w13_scale, w2_scale, None, None,
            spec.weights, spec.activations, spec.block_list, *STATIC)
        if read_rows_elsewhere:
            y_RH = y_RH + x_RH
        return torch.ops.moe.combine(y_RH, weight_R, src_R, combine_map_TK, *ep_args)

    inputs = (torch.randn(3, H).to(dtype), torch.rand(3, K),
              torch.zeros(3, K, dtype=torch.int32), w13, w2, w13_scale, w2_scale)
    return make_fx(layer, tracing_mode="fake")(*inputs)


def _lowered(gm, **spec):
    """``gm`` lowered with ``experts="reference"``, and the dispatch dtype it resolved."""
    lower(gm, BackendSpec(experts="reference", **spec))
    chosen = [n.meta["moe_dispatch_dtype"] for n in gm.graph.nodes
              if "moe_dispatch_dtype" in n.meta]
    assert len(chosen) == 1
    return gm, chosen[0]


def _unquantized_sequence(namespace: str) -> str:
    return (f"{namespace}::dispatch\nmoe_reference::experts_rows_quant\n"
            f"{namespace}::combine")


def _tokens_sequence(namespace: str) -> str:
    """A quantized layer whose rows would cross unquantized takes the tokens format."""
    return (f"{namespace}::dispatch_tokens\nmoe_reference::experts_quant\n"
            f"{namespace}::combine_tokens")


@pytest.mark.parametrize("a2a", sorted(A2A_NAMESPACES))
@pytest.mark.parametrize("name", sorted(SPECS))
def test_lowering_sends_fp8_where_the_experts_read_it(name, a2a):
    spec = SPECS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm, chosen = _lowered(_layer_graph(spec), a2a=a2a)
    assert chosen == DispatchDtype(FP8, f"quantization spec {spec.name}")
    namespace = A2A_NAMESPACES[a2a]
    assert moe_op_sequence(gm) == (f"{namespace}::dispatch_quant\n"
                                   "moe_reference::experts_rows_quant\n"
                                   f"{namespace}::combine")
    # No copy, cast or adapter anywhere: the experts read dispatch_quant's fp8 rows
    # and scales as they come, and return the activation dtype to combine.
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    dispatch, experts, combine = (n for n in calls if n.target is not operator.getitem)
    assert all(n.args[0] is dispatch for n in calls if n.target is operator.getitem)
    x_rows, x_scale = experts.args[:2]
    assert (x_rows.args[1], x_scale.args[1]) == (0, 6)
    assert list(x_rows.users) == [experts]
    assert experts.args[-1] == torch.bfloat16 and combine.args[0] is experts
    assert x_rows.meta["val"].dtype == FP8
    assert tuple(x_scale.meta["val"].shape) == (
        (WORLD_SIZE * MAX_TOKENS * K,) if name == "fp8_token" else
        (WORLD_SIZE * MAX_TOKENS * K, H // 16))


@pytest.fixture
def experts_quantize_inside(monkeypatch):
    """The reference backend, declared as one whose experts quantize their rows."""
    reference = REGISTRY.experts["reference"]
    monkeypatch.setitem(REGISTRY.experts, "reference",
                        dataclasses.replace(reference, quantized_rows=()))


def test_experts_that_quantize_inside_get_unquantized_rows(experts_quantize_inside):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm, chosen = _lowered(_layer_graph(W8A8_GROUP), a2a="all_to_all")
    assert chosen == DispatchDtype(torch.bfloat16, DEFAULT_RULE)
    assert moe_op_sequence(gm) == _tokens_sequence("moe_all_to_all")


def test_explicit_fp8_for_experts_that_quantize_inside_warns_once(experts_quantize_inside):
    with pytest.warns(UserWarning) as caught:
        gm, chosen = _lowered(_layer_graph(W8A8_TOKEN), a2a="all_to_all",
                              dispatch_dtype=FP8)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "torch.float8_e4m3fn (dispatch_dtype argument)" in message
    # The plan took tokens (the experts read no fp8 rows), which cross unquantized.
    assert "a2a backend 'all_to_all' in the tokens format cannot send fp8 rows" in message
    assert chosen == DispatchDtype(torch.bfloat16, DEFAULT_RULE)
    assert moe_op_sequence(gm) == _tokens_sequence("moe_all_to_all")


def test_lowering_keeps_unquantized_rows_read_elsewhere():
    gm, chosen = _lowered(_layer_graph(W8A8_TOKEN, read_rows_elsewhere=True), a2a="all_to_all")
    assert chosen.dtype == torch.bfloat16 and "x_rows reach ops besides" in chosen.rule
    assert moe_op_sequence(gm) == _unquantized_sequence("moe_all_to_all")


def test_explicit_bf16_takes_the_format_that_then_runs():
    # Unquantized, a quantized layer's tokens move fewer bytes than its rows: the plan
    # takes tokens once the explicit dtype says nothing crosses in fp8.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm, chosen = _lowered(_layer_graph(W8A8_TOKEN), a2a="all_to_all",
                              dispatch_dtype=torch.bfloat16)
    assert chosen == DispatchDtype(torch.bfloat16, "dispatch_dtype argument")
    assert moe_op_sequence(gm) == _tokens_sequence("moe_all_to_all")


def test_weight_only_layer_dispatches_unquantized_tokens():
    gm, chosen = _lowered(_layer_graph(QuantSpec("fp8_block", "none", (16, 16))),
                          a2a="all_to_all")
    assert chosen == DispatchDtype(torch.bfloat16, DEFAULT_RULE)
    assert moe_op_sequence(gm) == _tokens_sequence("moe_all_to_all")


# Several processes.

def _check_ops(rank, world_size, a2a, spec, capacity):
    """``dispatch_quant`` of backend ``a2a`` equals its ``dispatch`` followed by
    quantization, bit for bit, on every rank (the idle one too)."""
    gen = torch.Generator().manual_seed(11)
    num_tokens = sum(TOKENS_PER_RANK)
    hidden_NH = torch.randn(num_tokens, H, generator=gen).bfloat16()
    weights_NK = torch.rand(num_tokens, K, generator=gen)
    ids_NK = torch.randint(0, E, (num_tokens, K), generator=gen, dtype=torch.int32)
    ids_NK[::3, -1] = -1
    mine = token_slice(TOKENS_PER_RANK, rank)
    namespace = A2A_NAMESPACES[a2a]
    ep_args = (world_size, dist.group.WORLD.group_name, MAX_TOKENS, capacity)
    _assert_dispatch_quant_matches(op_overload(namespace, "dispatch"),
                                   op_overload(namespace, "dispatch_quant"),
                                   (hidden_NH[mine], weights_NK[mine], ids_NK[mine], E),
                                   ep_args, spec)


def _opcheck(rank, world_size, spec):
    hidden_TH = torch.randn(TOKENS_PER_RANK[rank], H, generator=torch.Generator())
    ids_TK = torch.randint(0, E, (TOKENS_PER_RANK[rank], K), dtype=torch.int32,
                           generator=torch.Generator().manual_seed(rank))
    args = (hidden_TH, torch.rand(TOKENS_PER_RANK[rank], K), ids_TK, E, spec.weights,
            spec.activations, spec.block_list, world_size, dist.group.WORLD.group_name,
            MAX_TOKENS, MAX_TOKENS * K)
    torch.library.opcheck(torch.ops.moe_all_to_all.dispatch_quant.default, args)


def _config(ep_size: int, spec: QuantSpec) -> tmo.MoEConfig:
    return tmo.MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K,
                         renormalize=True, expert_bias=True, ep_size=ep_size,
                         max_tokens_per_rank=MAX_TOKENS if ep_size > 1 else None, quant=spec)


class _Lowered:
    """A compile backend that keeps the graphs ``backend`` lowered (in place)."""

    def __init__(self, backend):
        self.backend = backend
        self.graphs = []

    def __call__(self, gm, example_inputs):
        compiled = self.backend(gm, example_inputs)
        self.graphs.append(gm)
        return compiled


def _check_layer(rank, world_size, spec, dtype, inner):
    """A quantized `MoE` sharded over the group, eager (bf16 dispatch) and compiled
    (fp8 rows where its activations are fp8, else bf16 tokens), against the same layer in
    one process."""
    torch._dynamo.reset()
    torch.manual_seed(5)
    single = tmo.MoE(_config(1, spec), dtype=dtype)
    sharded = tmo.MoE(_config(world_size, spec), dtype=dtype, ep_group=dist.group.WORLD)
    sharded.load_full_weights(single.state_dict())
    x_NH = torch.randn(sum(TOKENS_PER_RANK), H, generator=torch.Generator().manual_seed(9))
    x_NH = x_NH.to(dtype)
    mine = token_slice(TOKENS_PER_RANK, rank)
    recording = _Lowered(tmo.backend(a2a="all_to_all", experts="reference", inner=inner))
    compiled = torch.compile(sharded, backend=recording, fullgraph=True, dynamic=False)
    with torch.no_grad():
        expected_TH = single(x_NH)[mine]
        eager_TH = sharded(x_NH[mine])
        compiled_TH = compiled(x_NH[mine])
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    assert compiled_TH.dtype == dtype and compiled_TH.shape == (TOKENS_PER_RANK[rank], H)
    assert_close_scaled(eager_TH, expected_TH, bound, bound)
    assert_close_scaled(compiled_TH, expected_TH, bound, bound)
    if inner != "inductor":
        # Op by op, a row quantized before the transport is the row quantized after it.
        torch.testing.assert_close(compiled_TH, eager_TH, rtol=0, atol=0)
    (gm,) = recording.graphs
    # Weight-only layers' tokens cross unquantized either way: in the tokens format.
    chain = (_tokens_sequence("moe_all_to_all") if spec.activations == "none" else
             "moe_all_to_all::dispatch_quant\nmoe_reference::experts_rows_quant\n"
             "moe_all_to_all::combine")
    assert moe_op_sequence(gm) == f"{route_op(sharded)}\n{chain}"


def _run_cases(rank, world_size):
    for a2a in sorted(A2A_NAMESPACES):
        for spec in SPECS.values():
            _check_ops(rank, world_size, a2a, spec, MAX_TOKENS * K)
    # A capacity below the worst case that the routing fits: the host check runs.
    _check_ops(rank, world_size, "all_to_all", W8A8_GROUP, MAX_TOKENS * K - 1)
    _opcheck(rank, world_size, W8A8_GROUP)
    _check_layer(rank, world_size, W8A8_TOKEN, torch.float32, "aot_eager")
    _check_layer(rank, world_size, W8A8_GROUP, torch.bfloat16, "aot_eager")
    _check_layer(rank, world_size, W8A16_BLOCK, torch.float32, "aot_eager")


def test_quantized_layers_dispatch_fp8_across_ranks():
    run_on_ranks(WORLD_SIZE, _run_cases)


@pytest.mark.slow
def test_quantized_layers_dispatch_fp8_under_inductor():
    # Inductor fuses the quantization into the packing and keeps the idle rank's
    # collectives, whose outputs are empty there. One format: a compile takes a minute.
    run_on_ranks(WORLD_SIZE, _check_layer, W8A8_GROUP, torch.bfloat16, "inductor")


# GPUs: the same on CUDA (NCCL), compiled by Inductor, with and without CUDA graphs.

@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SPECS))
def test_packed_rows_compile_on_cuda(name, generator):
    """The packing (fp8 values and scales as bytes) in Inductor's generated code on
    CUDA against the eager op; rows may differ by one fp8 step where Inductor's
    division rounds otherwise."""
    from torch_moe_ops.backends import local
    from torch_moe_ops.backends.common.transport.quantized_dispatch import quantized_dispatch

    spec, device = SPECS[name], torch.device("cuda")
    hidden_TH = torch.randn(7, H, generator=generator).to(device, torch.bfloat16)
    ids_TK = torch.randint(0, E, (7, K), generator=generator, dtype=torch.int32).to(device)
    args = (hidden_TH, torch.rand(7, K, generator=generator).to(device), ids_TK, E)
    _assert_dispatch_quant_matches(torch.ops.moe.dispatch, torch.ops.moe.dispatch_quant,
                                   args, (), spec)
    kernel = quantized_dispatch(local.dispatch)
    static = (spec.weights, spec.activations, spec.block_list, 1, "", 0, 0)
    eager_RH, *_, eager_scale = kernel(*args, *static)
    compiled_RH, *_, compiled_scale = torch.compile(kernel, fullgraph=True)(*args, *static)
    assert compiled_RH.dtype == FP8 and compiled_RH.is_contiguous()
    torch.testing.assert_close(compiled_scale, eager_scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(quant.dequantize_activations(compiled_RH, compiled_scale, spec),
                               quant.dequantize_activations(eager_RH, eager_scale, spec),
                               rtol=0.13, atol=1e-6)


# Per world size (2, and 4 where there are 4 GPUs): one rank idle, then every rank busy.
GPU_LAYOUTS = {2: ((MAX_TOKENS, 0), (3, MAX_TOKENS)),
               4: ((MAX_TOKENS, 0, 2, 5), (3, MAX_TOKENS, 1, 4))}


def _gpu_cases(rank, world_size, a2a):
    """Quantized layers sharded over the GPUs, compiled (Inductor, then CUDA graphs
    replaying new tokens) with fp8 dispatch, against one GPU holding every expert."""
    device = torch.device("cuda", rank)
    for layout in GPU_LAYOUTS[world_size]:
        mine = token_slice(layout, rank)
        for spec in SPECS.values():
            for mode in (None, "reduce-overhead"):
                torch._dynamo.reset()
                torch.manual_seed(5)
                # Built on the CPU so that every rank draws the same weights.
                single = tmo.MoE(_config(1, spec)).to(device, torch.bfloat16)
                sharded = tmo.MoE(_config(world_size, spec), device=device,
                                  dtype=torch.bfloat16, ep_group=dist.group.WORLD)
                sharded.load_full_weights(single.state_dict())
                recording = _Lowered(tmo.backend(a2a=a2a, experts="reference", mode=mode))
                compiled = torch.compile(sharded, backend=recording, fullgraph=True,
                                         dynamic=False)
                with torch.no_grad():
                    for seed in range(3):
                        gen = torch.Generator().manual_seed(seed)
                        x_NH = torch.randn(sum(layout), H, generator=gen).to(device,
                                                                             torch.bfloat16)
                        out_TH = compiled(x_NH[mine]).clone()
                        assert_close_scaled(out_TH, single(x_NH)[mine], 2e-2, 2e-2)
                        assert_close_scaled(out_TH, sharded(x_NH[mine]), 2e-2, 2e-2)
                namespace = A2A_NAMESPACES[a2a]
                (gm,) = recording.graphs
                assert moe_op_sequence(gm) == (
                    f"{route_op(sharded)}\n{namespace}::dispatch_quant\n"
                    f"moe_reference::experts_rows_quant\n{namespace}::combine")
    torch._dynamo.reset()


@pytest.mark.multigpu
@pytest.mark.parametrize("world_size", sorted(GPU_LAYOUTS), ids="P{}".format)
@pytest.mark.parametrize("a2a", sorted(A2A_NAMESPACES))
def test_quantized_layers_dispatch_fp8_on_gpus(a2a, world_size):
    skip_without_gpus(world_size)
    run_on_ranks(world_size, _gpu_cases, a2a, backend="nccl", deadline_s=600)
