"""The ``flashinfer`` a2a backend's bookkeeping on CPU processes (gloo), with
``flashinfer.comm`` replaced by tests/flashinfer_a2a_emulator.py: every rank's outputs
and gradients equal the single-process reference (bf16 bounds) in the rows format and the
tokens format, with an idle rank, skipped slots, every slot on one rank,
a capacity below the worst case and tokens arriving in a random order; a workspace that
does not fit is refused on every rank; compiled layers train through the trainable tokens
chain and serve through the fused tokens chain; every workspace is freed (the trainable
tokens format's gradients: tests/test_flashinfer_a2a_training_emulated.py).

What this cannot tell is whether FlashInfer's kernels behave as the emulator does:
tests/test_flashinfer_a2a_gpu.py runs the real ones on GPUs.

Legend: P ranks, T tokens of one rank, N tokens of all ranks, H hidden size,
I expert intermediate size, E experts, E_l = E / P, K experts per token, M
max_tokens_per_rank.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

import flashinfer_a2a_emulator
import torch_moe_ops as tmo
from distributed import run_on_ranks
from ep_problems import (
    assert_rank_matches,
    check_bf16_grad,
    check_bf16_out,
    draw_problem,
    leaves,
    token_slice,
    trained_and_served,
)

H, I, M = 16, 8, 6
# One rank full, one idle.
TOKENS_PER_RANK = (5, 0)
WORLD = 2
# (K, E_l): K above, at and below E_l, each a top_k FlashInfer's kernels are built for; one
# expert per rank (a skipped slot's -1 is clamped to be routed).
SHAPES = ((2, 3), (4, 2), (1, 4), (2, 1))
STATIC = ("silu", 1.702, 7.0)
FUSED_OPS = ("moe_flashinfer_a2a::dispatch_tokens", "moe_cpu::experts",
             "moe_flashinfer_a2a::combine_tokens")
# The backend marks the received ids with a Triton kernel (here under the interpreter).
pytestmark = pytest.mark.triton


def _mine(rank):
    return token_slice(TOKENS_PER_RANK, rank)


def _full_problem(num_experts, top_k, route, seed=7):
    """Every rank's tokens and routing and every expert's weights, alike on all ranks."""
    hidden_NH, weights_NK, ids_NK, experts = draw_problem(
        seed, route, sum(TOKENS_PER_RANK), num_experts, WORLD, H, I, top_k)
    return hidden_NH.bfloat16(), weights_NK, ids_NK, [w.bfloat16() for w in experts.values()]


def _check_fake(op, args, outputs) -> None:
    """``op``'s fake kernel gives the real outputs' sizes, strides, dtypes and storage
    offsets (what opcheck compares; opcheck itself would call dispatch twice in a row)."""
    mode = FakeTensorMode()
    fakes = op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    for real, fake in zip(outputs if isinstance(outputs, tuple) else (outputs,),
                          fakes if isinstance(fakes, tuple) else (fakes,)):
        assert (real.shape, real.stride(), real.dtype, real.storage_offset()) == (
            fake.shape, fake.stride(), fake.dtype, fake.storage_offset())


def _check_rows(rank, top_k, num_local, route, capacity_drop):
    """dispatch -> experts_rows -> combine and their gradients against the reference."""
    num_experts = num_local * WORLD
    group = dist.group.WORLD.group_name
    hidden_NH, weights_NK, ids_NK, full = _full_problem(num_experts, top_k, route)
    mine, local = _mine(rank), slice(rank * num_local, (rank + 1) * num_local)
    ref_leaves = leaves(hidden_NH, weights_NK, *full)
    ref_NH = torch.ops.moe_reference.experts(ref_leaves[0], ref_leaves[1], ids_NK,
                                             *ref_leaves[2:], *STATIC)
    grad_NH = torch.randn(ref_NH.shape, generator=torch.Generator().manual_seed(3)).bfloat16()
    ref_NH.backward(grad_NH)

    hidden_TH, weights_TK, *experts = leaves(hidden_NH[mine], weights_NK[mine],
                                              *(w[local] for w in full))
    capacity = M * min(top_k, num_local) - capacity_drop
    ep_args = (WORLD, group, M)
    args = (hidden_TH, weights_TK, ids_NK[mine], num_experts, *ep_args, capacity)
    dispatched = torch.ops.moe_flashinfer_a2a.dispatch(*args)
    _check_fake(torch.ops.moe_flashinfer_a2a.dispatch.default, args, dispatched)
    x_RH, expert_R, weight_R, src_R, count_E, combine_map_TK = dispatched
    assert x_RH.shape == (WORLD * capacity, H)
    offset = 0
    for e, count in enumerate(count_E.tolist()):
        assert (expert_R[offset:offset + count] == e).all()
        # Rows of one expert in key order, whatever order the tokens arrived in.
        assert (src_R[offset:offset + count].diff() > 0).all()
        offset += count
    assert (expert_R[offset:] == -1).all() and (src_R[offset:] == -1).all()
    y_RH = torch.ops.moe_reference.experts_rows(x_RH, expert_R, count_E, *experts, *STATIC)
    out_TH = torch.ops.moe_flashinfer_a2a.combine(y_RH, weight_R, src_R, combine_map_TK, *ep_args)
    out_TH.backward(grad_NH[mine])
    assert_rank_matches(out_TH, [hidden_TH, weights_TK, *experts], ref_NH, ref_leaves, mine,
                        local, check_bf16_out, check_bf16_grad)


def _check_tokens(rank, top_k, num_local, route):
    """dispatch_tokens -> the experts' own ``experts`` op -> combine_tokens against the
    reference: the receive buffers as they are, padding and other ranks' experts skipped."""
    num_experts = num_local * WORLD
    hidden_NH, weights_NK, ids_NK, full = _full_problem(num_experts, top_k, route, seed=8)
    mine, local = _mine(rank), slice(rank * num_local, (rank + 1) * num_local)
    ep_args = (WORLD, dist.group.WORLD.group_name, M)
    args = (hidden_NH[mine], weights_NK[mine], ids_NK[mine], num_experts, *ep_args)
    sent = torch.ops.moe_flashinfer_a2a.dispatch_tokens(*args)
    _check_fake(torch.ops.moe_flashinfer_a2a.dispatch_tokens.default, args, sent)
    x_NH, weights_NK_recv, local_NK = sent
    assert local_NK.dtype == torch.int32 and local_NK.max() < num_local
    y_NH = torch.ops.moe_cpu.experts(x_NH, weights_NK_recv, local_NK,
                                     *(w[local] for w in full), *STATIC)
    out_TH = torch.ops.moe_flashinfer_a2a.combine_tokens(y_NH, ids_NK[mine], num_experts,
                                                         *ep_args)
    _check_fake(torch.ops.moe_flashinfer_a2a.combine_tokens.default,
                (y_NH, ids_NK[mine], num_experts, *ep_args), out_TH)
    ref_NH = torch.ops.moe_reference.experts(hidden_NH, weights_NK, ids_NK, *full, *STATIC)
    check_bf16_out(out_TH, ref_NH[mine])


def _check_refusal(rank, a2a):
    """A workspace that does not fit on one rank is refused on every rank, before any
    rank allocates, with what to lower."""
    free = a2a.workspace._free_bytes
    a2a.workspace._free_bytes = lambda device: 1000 if rank == 1 else 1 << 40
    live = flashinfer_a2a_emulator.MnnvlMemory.live
    try:
        with pytest.raises(RuntimeError, match="lower MoEConfig.max_tokens_per_rank"):
            a2a.communicator(dist.group.WORLD.group_name, H, 2, M, torch.bfloat16, device="cpu")
    finally:
        a2a.workspace._free_bytes = free
    assert flashinfer_a2a_emulator.MnnvlMemory.live == live and not a2a.open_communicators()


def _moe_config(ep_size):
    return tmo.MoEConfig(hidden_size=H, intermediate_size=I, num_experts=4 * WORLD, top_k=2,
                         renormalize=True, expert_bias=True, ep_size=ep_size,
                         max_tokens_per_rank=M if ep_size > 1 else None)


def _check_compiled(rank):
    """A `MoE` sharded over the group and compiled with ``a2a="flashinfer"`` against the
    same layer in one process: with gradients through the trainable tokens chain (output and
    input gradient), without through the tokens chain on the workspace."""
    torch.manual_seed(5)
    single = tmo.MoE(_moe_config(1), dtype=torch.bfloat16)
    sharded = tmo.MoE(_moe_config(WORLD), dtype=torch.bfloat16, ep_group=dist.group.WORLD)
    sharded.load_full_weights(single.state_dict())
    x_NH = torch.randn(sum(TOKENS_PER_RANK), H,
                       generator=torch.Generator().manual_seed(9)).bfloat16()
    trained, served = trained_and_served(single, sharded, x_NH, _mine(rank), experts="cpu",
                                         a2a="flashinfer")
    assert all(op.replace("a2a::", "a2a_trainable::") in trained for op in FUSED_OPS), trained
    assert "moe_flashinfer_a2a::" not in trained, trained
    assert all(op in served for op in FUSED_OPS), served
    assert "trainable" not in served, served
    assert "moe::" not in served and "experts_rows" not in served


def _cases(rank, world_size):
    a2a = flashinfer_a2a_emulator.install()
    _check_refusal(rank, a2a)
    for top_k, num_local in SHAPES:
        for route, drop in (("random", 0), ("one_rank", 0), ("random", 1)):
            _check_rows(rank, top_k, num_local, route, drop)
        for route in ("random", "one_rank"):
            _check_tokens(rank, top_k, num_local, route)
    # One communicator per (group, H, K, M, dtype), whatever E.
    assert len(a2a.open_communicators()) == len({k for k, _ in SHAPES})
    _check_compiled(rank)
    a2a.close_all()
    gc.collect()
    assert not a2a.open_communicators() and flashinfer_a2a_emulator.MnnvlMemory.live == 0
    # Views of a closed workspace may outlive it (in a caller, a compiled graph): the
    # struct their free reads stays.
    assert flashinfer_a2a_emulator.CapsuleWrapper.made
    assert flashinfer_a2a_emulator.CapsuleWrapper.all_alive()


def test_matches_single_process(monkeypatch):
    """One set of processes for every case: their start-up is most of the cost."""
    # The ranks run the backend's Triton kernel on CPU tensors: under the interpreter, also
    # on a machine with a GPU (where conftest leaves it off). They inherit the variable.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_on_ranks(WORLD, _cases)
