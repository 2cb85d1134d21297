"""The ``flashinfer`` a2a backend on 2 GPUs over NCCL, on flashinfer-python's kernels:
every rank's outputs and gradients equal the single-process reference on the same tokens
and weights (bf16 bounds) in the rows format, in the trainable tokens format and (outputs)
in the tokens format (with the triton experts), with one rank idle, in captured CUDA graphs
replayed on new inputs, and as the a2a of a `MoE` compiled by Inductor (forward and
backward through the trainable tokens format, one layer and two layers on one workspace;
forward under ``mode="reduce-overhead"`` through the fused chain); the inference tokens
ops hand out the workspace, the trainable ones copies; a workspace no GPU holds is
refused on both ranks before anything is allocated. And the tokens format into FlashInfer's
fused-MoE experts (bf16, fp8 blocks, mxfp4) on one GPU shared by two ranks: its kernel reads
the receive buffers where the all-to-all left them (skipped until that module is built).

Legend: P ranks, T tokens of one rank, N tokens of all ranks, H hidden size,
I expert intermediate size, E experts, E_l = E / P, K experts per token, M
max_tokens_per_rank.

The same checks also run with both ranks on one GPU (gloo, each rank a process of its
own): the real kernels, workspaces mapped across processes and ranks waiting on each other,
where only one GPU is at hand. What that cannot show is the transport between GPUs (NVLink)
and the ranks' NCCL collectives.

Skipped (with `a2a.supports`' reason) without two NVLink-joined GPUs (or one GPU, for the
shared test) and flashinfer. The first run builds FlashInfer's all-to-all module (100-250 s
on 16 cores), inside the test.
"""

from __future__ import annotations

import contextlib
import datetime
import unittest.mock

import pytest
import torch
import torch.distributed as dist

import torch_moe_ops as tmo
from distributed import run_on_ranks, skip_without_gpus
from ep_problems import (
    TwoLayers,
    assert_close_scaled,
    assert_rank_matches,
    check_bf16_grad,
    check_bf16_out,
    check_graph_replays,
    check_layers_train,
    draw_problem,
    leaves,
    on_current_gpu,
    recording_backend,
    single_and_sharded,
    token_slice,
)
from torch_moe_ops import quant
from torch_moe_ops.backends.flashinfer import a2a
from torch_moe_ops.backends.registry import REGISTRY, Problem
from torch_moe_ops.config import BackendSpec, QuantSpec, worst_case_capacity

# Ranks sharing one GPU: 2. On their own GPUs: 2, and 4 where there are 4.
WORLD = 2
WORLD_SIZES = (2, 4)
# Tokens on each rank, per world size: one rank full, one idle (at 4: uneven besides).
TOKENS_PER_RANK = {2: (5, 0), 4: (5, 0, 2, 4)}
H, I, E, K, M = 1024, 64, 8, 2, 8
STATIC = ("silu", 1.702, 7.0)
FUSED_OPS = ("moe_flashinfer_a2a::dispatch_tokens", "moe_triton::experts",
             "moe_flashinfer_a2a::combine_tokens")
# What a layer that trains takes (the experts: whichever "auto" picks).
TRAINABLE_OPS = ("moe_flashinfer_a2a_trainable::dispatch_tokens",
                 "moe_flashinfer_a2a_trainable::combine_tokens")
# Generous: the first run builds flashinfer's module while the peer waits in a collective.
TIMEOUT = datetime.timedelta(seconds=300)
DEADLINE_S = 580


def _no_link_needed(index: int) -> None:
    """`a2a.backend._nvlink_reason` where the ranks share one GPU: no link lies between them (no
    reason not to run)."""


def _reason(shared_gpu: bool) -> str | None:
    if shared_gpu and torch.cuda.device_count() < 1:
        return "needs a CUDA GPU"
    with unittest.mock.patch.object(a2a.backend, "_nvlink_reason", _no_link_needed) if shared_gpu \
            else contextlib.nullcontext():
        reason = a2a.supports(BackendSpec(a2a="flashinfer"),
                              Problem(torch.bfloat16, ep_size=WORLD, hidden_size=H, top_k=K,
                                      max_tokens_per_rank=M), torch.device("cuda"))
    return None if reason is None else f"a2a 'flashinfer': {reason}"


TWO_GPUS_REASON, SHARED_GPU_REASON = _reason(shared_gpu=False), _reason(shared_gpu=True)


def _world() -> int:
    return dist.get_world_size()


def _layout() -> tuple[int, ...]:
    return TOKENS_PER_RANK[_world()]


def _full_problem(seed: int, route: str):
    """Every rank's tokens and routing, and every expert's weights, drawn alike on all
    ranks, on this rank's GPU (`on_current_gpu`)."""
    return on_current_gpu(*draw_problem(seed, route, sum(_layout()), E, _world(), H, I, K))


def _mine(rank: int) -> slice:
    return token_slice(_layout(), rank)


def _local(rank: int) -> slice:
    return slice(rank * (E // _world()), (rank + 1) * (E // _world()))


def _ep_args():
    return _world(), dist.group.WORLD.group_name, M


def _rows(hidden_TH, weights_TK, ids_TK, experts, capacity):
    """``moe_flashinfer_a2a::dispatch -> moe_reference::experts_rows -> ::combine``."""
    dispatch = torch.ops.moe_flashinfer_a2a.dispatch
    x_RH, expert_R, weight_R, src_R, count_E, combine_map_TK = dispatch(
        hidden_TH, weights_TK, ids_TK, E, *_ep_args(), capacity)
    y_RH = torch.ops.moe_reference.experts_rows(x_RH, expert_R, count_E, *experts, *STATIC)
    return torch.ops.moe_flashinfer_a2a.combine(y_RH, weight_R, src_R, combine_map_TK, *_ep_args())


def _tokens(hidden_TH, weights_TK, ids_TK, experts):
    """The tokens chain: ``dispatch_tokens -> moe_triton::experts -> combine_tokens``."""
    x_NH, weights_NK, local_NK = torch.ops.moe_flashinfer_a2a.dispatch_tokens(
        hidden_TH, weights_TK, ids_TK, E, *_ep_args())
    y_NH = torch.ops.moe_triton.experts(x_NH, weights_NK, local_NK, *experts, *STATIC)
    return torch.ops.moe_flashinfer_a2a.combine_tokens(y_NH, ids_TK, E, *_ep_args())


def _check_refusal(rank):
    """A workspace that does not fit is refused on both ranks, before either allocates."""
    with pytest.raises(RuntimeError, match="lower MoEConfig.max_tokens_per_rank"):
        a2a.communicator(dist.group.WORLD.group_name, 7168, 8, 10 ** 7, torch.bfloat16)
    assert not a2a.open_communicators()


def _trainable_tokens(hidden_TH, weights_TK, ids_TK, experts):
    """The trainable tokens chain: ``moe_flashinfer_a2a_trainable::dispatch_tokens ->
    moe_triton::experts -> ::combine_tokens`` (the receive buffers copied out in token
    order)."""
    x_NH, weights_NK, local_NK = torch.ops.moe_flashinfer_a2a_trainable.dispatch_tokens(
        hidden_TH, weights_TK, ids_TK, E, *_ep_args())
    y_NH = torch.ops.moe_triton.experts(x_NH, weights_NK, local_NK, *experts, *STATIC)
    return torch.ops.moe_flashinfer_a2a_trainable.combine_tokens(y_NH, ids_TK, E, *_ep_args())


def _check_trains(rank, route, pipeline):
    """Outputs and gradients of ``pipeline(hidden_TH, weights_TK, ids_TK, experts)`` (rows,
    or the trainable tokens) on this rank's tokens and experts against
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
    out_TH = pipeline(hidden_TH, weights_TK, ids_NK[mine], experts)
    out_TH.backward(grad_NH[mine])
    assert_rank_matches(out_TH, [hidden_TH, weights_TK, *experts], ref_NH, ref_leaves, mine,
                        local, check_bf16_out, check_bf16_grad)


def _check_tokens(rank, route):
    hidden_NH, weights_NK, ids_NK, full = _full_problem(8, route)
    mine = _mine(rank)
    with torch.no_grad():
        out_TH = _tokens(hidden_NH[mine], weights_NK[mine], ids_NK[mine],
                         [w[_local(rank)] for w in full])
        ref_NH = torch.ops.moe_reference.experts(hidden_NH, weights_NK, ids_NK, *full, *STATIC)
    check_bf16_out(out_TH, ref_NH[mine])


def _moe_config(ep_size: int) -> tmo.MoEConfig:
    return tmo.MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K,
                         renormalize=True, expert_bias=True, ep_size=ep_size,
                         max_tokens_per_rank=M if ep_size > 1 else None)


def _check_workspace_copies(rank):
    """The inference ops hand out the workspace itself; the trainable ones copies, which
    keep their values through the next round on the same workspace."""
    hidden_NH, weights_NK, ids_NK, _ = _full_problem(10, "random")
    mine = _mine(rank)
    args = (hidden_NH[mine], weights_NK[mine], ids_NK[mine], E, *_ep_args())
    (comm,) = a2a.open_communicators()
    # This rank's part of the workspace (its peers' are mapped beside it).
    start = comm.workspace[comm.rank].data_ptr()
    end = start + comm.workspace[comm.rank].numel()
    with torch.no_grad():
        viewed = torch.ops.moe_flashinfer_a2a.dispatch_tokens(*args)
        assert all(start <= t.data_ptr() < end for t in viewed[:2])
        torch.ops.moe_flashinfer_a2a.combine_tokens(viewed[0], *args[2:])
        copied = torch.ops.moe_flashinfer_a2a_trainable.dispatch_tokens(*args)
        assert not any(start <= t.data_ptr() < end for t in copied)
        # As the fake gives them.
        assert all(t.is_contiguous() and t.storage_offset() == 0 for t in copied)
        kept = [t.clone() for t in copied]
        torch.ops.moe_flashinfer_a2a_trainable.combine_tokens(copied[0], *args[2:])
        again = torch.ops.moe_flashinfer_a2a_trainable.dispatch_tokens(
            hidden_NH[mine].flip(0), *args[1:])
        torch.ops.moe_flashinfer_a2a_trainable.combine_tokens(again[0], *args[2:])
    assert all(torch.equal(t, k) for t, k in zip(copied, kept, strict=True))


def _check_two_layers(rank, frozen_router):
    """Two `MoE` layers of one shape (one workspace) compiled by Inductor with
    ``a2a="flashinfer"``, two training steps, against the same layers in one process (fp32,
    which routes the same tokens alike on both sides): outputs and gradients. Each layer's
    gradient dispatch is answered by its own combine, in autograd's order; with
    ``frozen_router`` (and an input without gradient) the first layer's never is, and the
    next step's dispatch closes its round."""
    torch._dynamo.reset()
    torch.manual_seed(8)
    device = torch.device("cuda", torch.cuda.current_device())
    single = TwoLayers(_moe_config(1)).to(device)
    sharded = TwoLayers(_moe_config(_world()), device=device, ep_group=dist.group.WORLD)
    for one, shard in zip(single.layers, sharded.layers, strict=True):
        shard.load_full_weights(one.state_dict())
        one.gate.requires_grad_(not frozen_router)
        shard.gate.requires_grad_(not frozen_router)
    sequences = []
    compiled = torch.compile(sharded, backend=recording_backend(sequences, a2a="flashinfer"),
                             fullgraph=True, dynamic=False)
    inputs = [torch.randn(sum(_layout()), H, generator=torch.Generator().manual_seed(30 + step)
                          ).to(device).requires_grad_(not frozen_router) for step in range(2)]
    check_layers_train(single, sharded, compiled, inputs, _mine(rank),
                       lambda actual, expected: assert_close_scaled(actual, expected, 1e-3,
                                                                    1e-3))
    assert sequences[-1].count("moe_flashinfer_a2a_trainable::dispatch_tokens") == 2, (
        sequences[-1])
    torch._dynamo.reset()


def _check_module(rank):
    """`MoE` sharded over the group and compiled by Inductor with ``a2a="flashinfer"``
    against the single-process `MoE`: outputs and gradients through the trainable tokens
    format (the idle rank's empty gradients included: its ops must not be dropped as dead
    code)."""
    single, sharded = single_and_sharded(_moe_config, seed=5)
    x_NH = torch.randn(sum(_layout()), H, generator=torch.Generator().manual_seed(9))
    x_NH = x_NH.to(single.w13.device, torch.bfloat16)
    mine, local = _mine(rank), sharded.local_experts
    x_ref = x_NH.clone().requires_grad_()
    ref_NH = single(x_ref)
    ref_NH.float().square().sum().backward()
    sequences = []
    compiled = torch.compile(sharded, backend=recording_backend(sequences, a2a="flashinfer"),
                             fullgraph=True, dynamic=False)
    x_TH = x_NH[mine].clone().requires_grad_()
    out_TH = compiled(x_TH)
    out_TH.float().square().sum().backward()
    assert all(op in sequences[-1] for op in TRAINABLE_OPS), sequences[-1]
    assert "moe_flashinfer_a2a::" not in sequences[-1], sequences[-1]
    check_bf16_out(out_TH, ref_NH[mine].detach())
    check_bf16_grad(x_TH.grad, x_ref.grad[mine])
    for name in ("w13", "w2", "b13", "b2"):
        check_bf16_grad(getattr(sharded, name).grad,
                        getattr(single, name).grad[local.start:local.stop])


def _check_reduce_overhead(rank):
    """`MoE` compiled with ``mode="reduce-overhead"`` (CUDA graphs) for inference: the fused
    pair's chain, inside the graphs, against the single-process `MoE`."""
    single, sharded = single_and_sharded(_moe_config, seed=6)
    sequences = []
    compiled = torch.compile(sharded, backend=recording_backend(sequences, a2a="flashinfer",
                                                                mode="reduce-overhead"),
                             fullgraph=True, dynamic=False)
    counters = torch._dynamo.utils.counters
    counters.clear()
    with torch.no_grad():
        for seed in range(4):
            gen = torch.Generator().manual_seed(20 + seed)
            x_NH = torch.randn(sum(_layout()), H, generator=gen).to(single.w13.device,
                                                                          torch.bfloat16)
            out_TH = compiled(x_NH[_mine(rank)]).clone()
            check_bf16_out(out_TH, single(x_NH)[_mine(rank)])
    assert all(op in sequences[-1] for op in FUSED_OPS), sequences[-1]
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    torch._dynamo.reset()


def _run(rank, world_size, shared_gpu):
    if shared_gpu:
        a2a.backend._nvlink_reason = _no_link_needed
    _check_refusal(rank)
    worst = worst_case_capacity(M, K)
    for route in ("random", "one_rank"):
        _check_trains(rank, route, lambda *args: _rows(*args, worst))
        _check_trains(rank, route, _trainable_tokens)
        _check_tokens(rank, route)
    # A capacity below the worst case that the routing still fits.
    _check_trains(rank, "random", lambda *args: _rows(*args, worst - 1))
    (comm,) = a2a.open_communicators()
    assert comm.workspace_bytes > 0, comm
    _check_workspace_copies(rank)
    for pipeline in (lambda *args: _rows(*args, worst), _tokens, _trainable_tokens):
        check_graph_replays(pipeline, _full_problem, _mine(rank), _local(rank), STATIC)
    _check_module(rank)
    for frozen_router in (False, True):
        _check_two_layers(rank, frozen_router)
    # The communicator then opens when the layer compiles, not in a warm-up run of the CUDA
    # graphs (whose memory pool its tensors would outlive: "tensor(s) in the cudagraph pool
    # not tracked as outputs").
    a2a.close_all()
    _check_reduce_overhead(rank)
    # Collective: on every rank, and only once every rank got here.
    a2a.close_all()
    assert not a2a.open_communicators()


@pytest.mark.multigpu
@pytest.mark.skipif(TWO_GPUS_REASON is not None, reason=str(TWO_GPUS_REASON))
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids="P{}".format)
def test_matches_single_process(world_size):
    skip_without_gpus(world_size)
    run_on_ranks(world_size, _run, False, backend="nccl", timeout=TIMEOUT,
                 deadline_s=DEADLINE_S)


@pytest.mark.gpu
@pytest.mark.skipif(SHARED_GPU_REASON is not None, reason=str(SHARED_GPU_REASON))
def test_matches_single_process_ranks_sharing_one_gpu():
    run_on_ranks(WORLD, _run, True, backend="gloo", shared_gpu=0, timeout=TIMEOUT,
                 deadline_s=DEADLINE_S)


# The tokens format into FlashInfer's experts: widths every format holds (fp8: 128 x 128).
EXPERTS_I = 256
EXPERTS_FORMATS = (None, QuantSpec("fp8_block"), QuantSpec("mxfp4"))
EXPERTS_BOUNDS = {"bf16": 2e-2, "fp8_block": 4e-2, "mxfp4": 2e-2}


def _experts_reason() -> str | None:
    for spec in EXPERTS_FORMATS:
        reason = REGISTRY.experts["flashinfer"].why_not(
            BackendSpec(experts="flashinfer"), Problem(torch.bfloat16, quant=spec),
            torch.device("cuda"))
        if reason is not None:
            return f"experts 'flashinfer': {reason}"
    return SHARED_GPU_REASON


def _experts_args(full, spec, local):
    """The experts op's weight arguments (``experts`` or ``experts_quant``) of the experts
    ``local`` of ``full`` (bf16 w13, w2, b13, b2), quantized to ``spec``."""
    w13, w2, b13, b2 = (w[local] for w in full)
    if spec is None:
        return (w13, w2, b13, b2, *STATIC)
    w13, w13_scale = quant.quantize_weights(w13.float(), spec)
    w2, w2_scale = quant.quantize_weights(w2.float(), spec)
    return (w13, w2, w13_scale, w2_scale, b13, b2, spec.weights, spec.activations,
            spec.block_list, *STATIC)


def _run_tokens_into_flashinfer(rank, world_size):
    from flashinfer import fused_moe

    a2a.backend._nvlink_reason = _no_link_needed
    read = []
    kernel = fused_moe.cutlass_fused_moe

    def recording(input, *args, **kwargs):
        read.append(input.data_ptr())
        return kernel(input, *args, **kwargs)

    fused_moe.cutlass_fused_moe = recording
    hidden_NH, weights_NK, ids_NK, full = on_current_gpu(*draw_problem(
        11, "random", sum(_layout()), E, WORLD, H, EXPERTS_I, K))
    mine = _mine(rank)
    with torch.no_grad():
        for spec in EXPERTS_FORMATS:
            op_name = "experts" if spec is None else "experts_quant"
            bound = EXPERTS_BOUNDS["bf16" if spec is None else spec.weights]
            x_NH, weights_tokens_NK, local_NK = torch.ops.moe_flashinfer_a2a.dispatch_tokens(
                hidden_NH[mine], weights_NK[mine], ids_NK[mine], E, *_ep_args())
            y_NH = getattr(torch.ops.moe_flashinfer, op_name)(
                x_NH, weights_tokens_NK, local_NK, *_experts_args(full, spec, _local(rank)))
            # The kernel read the receive buffer itself: no copy of the tokens before it.
            assert read[-1] == x_NH.data_ptr(), spec
            out_TH = torch.ops.moe_flashinfer_a2a.combine_tokens(y_NH, ids_NK[mine], E,
                                                                 *_ep_args())
            ref_NH = getattr(torch.ops.moe_reference, op_name)(
                hidden_NH, weights_NK, ids_NK, *_experts_args(full, spec, slice(None)))
            assert out_TH.shape == (_layout()[rank], H)
            assert_close_scaled(out_TH, ref_NH[mine], bound, bound)
    a2a.close_all()


@pytest.mark.gpu
def test_tokens_into_flashinfer_experts_ranks_sharing_one_gpu():
    reason = _experts_reason()
    if reason is not None:
        pytest.skip(reason)
    run_on_ranks(WORLD, _run_tokens_into_flashinfer, backend="gloo", shared_gpu=0,
                 timeout=TIMEOUT, deadline_s=DEADLINE_S)
