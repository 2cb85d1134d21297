"""The ``flashinfer`` a2a backend's trainable tokens format (namespace
``moe_flashinfer_a2a_trainable``) on 2 and 3 CPU processes (gloo), with ``flashinfer.comm``
replaced by tests/flashinfer_a2a_emulator.py, whose dispatch delivers tokens in a random
order and checks that each dispatch is answered by a combine before the next:

- the op chain ``dispatch_tokens -> moe_reference::experts -> combine_tokens`` and its
  gradients against the single-process reference (idle rank, uneven counts, skipped slots,
  every slot on one rank, repeated ids; one expert per rank), the exact fakes of all
  four ops, and a gradient op out of order refused on every rank;
- where the buffers live: the inference ops hand out the workspace, the trainable ones
  copies that the next dispatch leaves alone;
- two layers of the ops on one workspace (skipped slots in one, repeated ids in the other),
  eagerly and compiled with ``aot_eager``: the output and every gradient against the
  reference;
- two `MoE` layers on one workspace compiled with ``aot_eager``, two steps: outputs and the
  gradients of the input and every parameter against the same layers in one process, also
  with a frozen router and an input that needs no gradient (autograd then skips the first
  layer's dispatch gradient, whose round the next step's dispatch closes); ``tmo.explain``
  names the trainable ops. (Activation checkpointing of an expert-parallel layer fails in
  torch.compile whatever the transport, all_to_all too: not tested here.)

What this cannot tell is whether FlashInfer's kernels behave as the emulator does:
tests/test_flashinfer_a2a_gpu.py runs the trainable chain on the real ones.

Legend: P ranks, T tokens of one rank, N tokens of all ranks (or receive positions), H
hidden size, I expert intermediate size, E experts, E_l = E / P, K experts per token, M
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
    TwoLayers,
    assert_rank_matches,
    check_bf16_grad,
    check_bf16_out,
    check_layers_train,
    draw_problem,
    leaves,
    recording_backend,
    token_slice,
)

H, I, M = 16, 8, 6
TOKENS_PER_RANK = {2: (5, 0), 3: (6, 0, 3)}
# (K, E_l): K above and below E_l, each a top_k FlashInfer's kernels are built for; one
# expert per rank (a skipped slot's -1 is clamped to be routed).
SHAPES = ((2, 3), (4, 2), (2, 1))
ROUTINGS = ("random", "one_rank", "repeated")
STATIC = ("silu", 1.702, 7.0)
TRAINABLE = torch.ops.moe_flashinfer_a2a_trainable
TRAINABLE_OPS = ("moe_flashinfer_a2a_trainable::dispatch_tokens",
                 "moe_flashinfer_a2a_trainable::combine_tokens")
# The inference ops mark the received ids with a Triton kernel (here under the interpreter).
pytestmark = pytest.mark.triton


def _world() -> int:
    return dist.get_world_size()


def _mine(rank: int) -> slice:
    return token_slice(TOKENS_PER_RANK[_world()], rank)


def _ep_args():
    return _world(), dist.group.WORLD.group_name, M


def _problem(top_k, num_local, routing, seed):
    """Every rank's bf16 tokens, fp32 routing and bf16 experts, alike on all ranks."""
    num_experts = num_local * _world()
    hidden_NH, weights_NK, ids_NK, experts = draw_problem(
        seed, "one_rank" if routing == "one_rank" else "random",
        sum(TOKENS_PER_RANK[_world()]), num_experts, _world(), H, I, top_k)
    if routing == "repeated" and top_k > 1:
        ids_NK[1::2, 1] = ids_NK[1::2, 0]
    return (hidden_NH.bfloat16(), weights_NK, ids_NK, [w.bfloat16() for w in experts.values()],
            num_experts)


def _check_fake(op, args, outputs) -> None:
    """``op``'s fake kernel gives the real outputs' sizes, strides, dtypes and storage
    offsets (what opcheck compares; opcheck itself would call a dispatch twice in a row)."""
    mode = FakeTensorMode()
    fakes = op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    for real, fake in zip(outputs if isinstance(outputs, tuple) else (outputs,),
                          fakes if isinstance(fakes, tuple) else (fakes,), strict=True):
        assert (real.shape, real.stride(), real.dtype, real.storage_offset()) == (
            fake.shape, fake.stride(), fake.dtype, fake.storage_offset())


def _check_chain(rank, top_k, num_local, routing):
    """The trainable chain's output and gradients against the reference on all tokens."""
    hidden_NH, weights_NK, ids_NK, full, num_experts = _problem(top_k, num_local, routing, 8)
    mine, local = _mine(rank), slice(rank * num_local, (rank + 1) * num_local)
    ref_leaves = leaves(hidden_NH, weights_NK, *full)
    ref_NH = torch.ops.moe_reference.experts(ref_leaves[0], ref_leaves[1], ids_NK,
                                             *ref_leaves[2:], *STATIC)
    grad_NH = torch.randn(ref_NH.shape, generator=torch.Generator().manual_seed(3)).bfloat16()
    ref_NH.backward(grad_NH)
    ours = leaves(hidden_NH[mine], weights_NK[mine], *(w[local] for w in full))
    x_NH, weights_tokens_NK, local_NK = TRAINABLE.dispatch_tokens(
        ours[0], ours[1], ids_NK[mine], num_experts, *_ep_args())
    assert local_NK.dtype == torch.int32 and int(local_NK.max()) < num_local
    y_NH = torch.ops.moe_reference.experts(x_NH, weights_tokens_NK, local_NK, *ours[2:], *STATIC)
    out_TH = TRAINABLE.combine_tokens(y_NH, ids_NK[mine], num_experts, *_ep_args())
    out_TH.backward(grad_NH[mine])
    assert_rank_matches(out_TH, ours, ref_NH, ref_leaves, mine, local, check_bf16_out,
                        check_bf16_grad)


def _two_layers_of_ops(hidden_TH, layers, num_experts, dispatch_and_combine):
    """``h + combine(experts(dispatch(h)))`` for each ``(weights, ids, experts)`` of
    ``layers`` (fp32), through the trainable ops, or the reference on all tokens where
    ``dispatch_and_combine`` is False."""
    for weights_TK, ids_TK, experts in layers:
        if not dispatch_and_combine:
            hidden_TH = hidden_TH + torch.ops.moe_reference.experts(
                hidden_TH, weights_TK, ids_TK, *experts, *STATIC)
            continue
        x_NH, weights_NK, local_NK = TRAINABLE.dispatch_tokens(hidden_TH, weights_TK, ids_TK,
                                                               num_experts, *_ep_args())
        y_NH = torch.ops.moe_reference.experts(x_NH, weights_NK, local_NK, *experts, *STATIC)
        hidden_TH = hidden_TH + TRAINABLE.combine_tokens(y_NH, ids_TK, num_experts,
                                                         *_ep_args())
    return hidden_TH


def _check_two_layers_of_ops(rank, compiled):
    """Two layers of the trainable ops on one workspace (fp32), the first routing with
    skipped slots, the second with repeated ids, eagerly or compiled (aot_eager): the output
    and every gradient against the reference on all tokens."""
    top_k, num_local = 2, 3
    num_experts = num_local * _world()
    mine, local = _mine(rank), slice(rank * num_local, (rank + 1) * num_local)
    full_layers, my_layers = [], []
    hidden_NH = None
    for seed, routing in ((12, "random"), (13, "repeated")):
        hidden, weights_NK, ids_NK, experts, _ = _problem(top_k, num_local, routing, seed)
        hidden_NH = hidden.float() if hidden_NH is None else hidden_NH
        full = leaves(weights_NK, *(w.float() for w in experts))
        ours = leaves(weights_NK[mine], *(w.float()[local] for w in experts))
        full_layers.append((full[0], ids_NK, full[1:]))
        my_layers.append((ours[0], ids_NK[mine], ours[1:]))
    (ref_hidden_NH,), (hidden_TH,) = leaves(hidden_NH), leaves(hidden_NH[mine])
    _two_layers_of_ops(ref_hidden_NH, full_layers, num_experts, False).square().sum().backward()
    run = torch.compile(_two_layers_of_ops, backend="aot_eager", fullgraph=True,
                        dynamic=False) if compiled else _two_layers_of_ops
    out_TH = run(hidden_TH, my_layers, num_experts, True)
    out_TH.square().sum().backward()
    expected_NH = _two_layers_of_ops(hidden_NH, full_layers, num_experts, False)

    def check(actual, expected):
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)

    check(out_TH, expected_NH[mine].detach())
    check(hidden_TH.grad, ref_hidden_NH.grad[mine])
    for (weights, _, experts), (ref_weights, _, ref_experts) in zip(my_layers, full_layers,
                                                                     strict=True):
        check(weights.grad, ref_weights.grad[mine])
        for leaf, ref in zip(experts, ref_experts, strict=True):
            check(leaf.grad, ref.grad[local])
    torch._dynamo.reset()


def _check_fakes(rank):
    """Each of the four ops' fake against its real outputs, called in a round's order."""
    hidden_NH, weights_NK, ids_NK, _, num_experts = _problem(2, 3, "random", 9)
    mine = _mine(rank)
    args = (hidden_NH[mine], weights_NK[mine], ids_NK[mine], num_experts, *_ep_args())
    sent = TRAINABLE.dispatch_tokens(*args)
    _check_fake(TRAINABLE.dispatch_tokens.default, args, sent)
    args = (sent[0], ids_NK[mine], num_experts, *_ep_args())
    _check_fake(TRAINABLE.combine_tokens.default, args, TRAINABLE.combine_tokens(*args))
    args = (hidden_NH[mine], ids_NK[mine], num_experts, *_ep_args())
    grad_x_NH = TRAINABLE.combine_tokens_backward(*args)
    _check_fake(TRAINABLE.combine_tokens_backward.default, args, grad_x_NH)
    args = (grad_x_NH, sent[1], ids_NK[mine], num_experts, *_ep_args())
    _check_fake(TRAINABLE.dispatch_tokens_backward.default, args,
                TRAINABLE.dispatch_tokens_backward(*args))


def _check_out_of_order(rank):
    """A gradient op that answers no dispatch of its kind raises on every rank alike,
    naming the op it must follow, before any collective: no rank waits for a peer."""
    hidden_NH, weights_NK, ids_NK, _, num_experts = _problem(2, 3, "random", 11)
    mine = _mine(rank)
    args = (hidden_NH[mine], weights_NK[mine], ids_NK[mine], num_experts, *_ep_args())
    x_NH, weights_tokens_NK, _ = TRAINABLE.dispatch_tokens(*args)
    with pytest.raises(RuntimeError, match="dispatch_tokens_backward must follow the "
                                           "combine_tokens_backward of its layer"):
        TRAINABLE.dispatch_tokens_backward(x_NH, weights_tokens_NK, *args[2:])
    TRAINABLE.combine_tokens(x_NH, *args[2:])
    with pytest.raises(RuntimeError, match="combine_tokens must follow the dispatch_tokens "
                                           "of its layer"):
        TRAINABLE.combine_tokens(x_NH, *args[2:])


def _in_workspace(t: torch.Tensor, comm) -> bool:
    """Whether ``t`` lies in this rank's part of ``comm``'s workspace."""
    start = comm.workspace[comm.rank].data_ptr()
    return start <= t.data_ptr() < start + comm.workspace[comm.rank].numel()


def _check_workspace_copies(rank, a2a):
    """Inference hands out the workspace itself; training copies it out, and the copies
    keep their values through the next layer's round on the same workspace."""
    hidden_NH, weights_NK, ids_NK, _, num_experts = _problem(2, 3, "random", 10)
    mine = _mine(rank)
    args = (hidden_NH[mine], weights_NK[mine], ids_NK[mine], num_experts, *_ep_args())
    (comm,) = [c for c in a2a.open_communicators()
               if (c.hidden_size, c.top_k, c.dtype) == (H, 2, torch.bfloat16)]
    with torch.no_grad():
        viewed = torch.ops.moe_flashinfer_a2a.dispatch_tokens(*args)
        assert all(_in_workspace(t, comm) for t in viewed[:2])
        torch.ops.moe_flashinfer_a2a.combine_tokens(viewed[0], *args[2:])
    copied = TRAINABLE.dispatch_tokens(*args)
    assert not any(_in_workspace(t, comm) for t in copied)
    kept = [t.clone() for t in copied]
    TRAINABLE.combine_tokens(copied[0], *args[2:])
    # The next layer's round writes the workspace again.
    other = (hidden_NH[mine].flip(0), *args[1:])
    TRAINABLE.combine_tokens(TRAINABLE.dispatch_tokens(*other)[0], *args[2:])
    assert all(torch.equal(t, k) for t, k in zip(copied, kept, strict=True))


def _moe_config(ep_size: int) -> tmo.MoEConfig:
    return tmo.MoEConfig(hidden_size=H, intermediate_size=I, num_experts=2 * _world(), top_k=2,
                         renormalize=True, expert_bias=True, ep_size=ep_size,
                         max_tokens_per_rank=M if ep_size > 1 else None)


def _check_two_layers(rank, frozen_router):
    """Two layers sharing one workspace, compiled (aot_eager), two training steps, against
    the same layers in one process (fp32). ``frozen_router``: the routers train not and the
    input needs no gradient, so autograd never runs the first layer's dispatch gradient."""
    torch.manual_seed(5)
    single = TwoLayers(_moe_config(1))
    sharded = TwoLayers(_moe_config(_world()), ep_group=dist.group.WORLD)
    for one, shard in zip(single.layers, sharded.layers, strict=True):
        shard.load_full_weights(one.state_dict())
        one.gate.requires_grad_(not frozen_router)
        shard.gate.requires_grad_(not frozen_router)
    sequences = []
    compiled = torch.compile(sharded, backend=recording_backend(sequences, inner="aot_eager",
                                                                a2a="flashinfer"),
                             fullgraph=True, dynamic=False)
    inputs = [torch.randn(sum(TOKENS_PER_RANK[_world()]), H,
                          generator=torch.Generator().manual_seed(9 + step)
                          ).requires_grad_(not frozen_router) for step in range(2)]
    check_layers_train(single, sharded, compiled, inputs, _mine(rank),
                       lambda actual, expected: torch.testing.assert_close(
                           actual, expected, rtol=1e-4, atol=1e-5))
    lowered = "\n".join(sequences)
    assert all(lowered.count(op) == 2 for op in TRAINABLE_OPS), lowered
    assert "moe_flashinfer_a2a::" not in lowered, lowered
    torch._dynamo.reset()


def _check_explain(rank):
    """`tmo.explain`: a layer that trains takes the tokens format through the trainable ops."""
    sharded = tmo.MoE(_moe_config(_world()), ep_group=dist.group.WORLD)
    x_TH = torch.randn(TOKENS_PER_RANK[_world()][rank], H)
    (report,) = tmo.explain(sharded, x_TH, a2a="flashinfer")
    assert (report.plan.a2a.name, report.plan.format.name) == ("flashinfer", "tokens")
    assert report.plan.problem.training
    assert ("trains through moe_flashinfer_a2a_trainable's ops, which copy the receive buffers "
            "out of the transport's memory") in str(report), str(report)
    torch._dynamo.reset()


def _cases(rank, world_size):
    a2a = flashinfer_a2a_emulator.install()
    for top_k, num_local in SHAPES:
        for routing in ROUTINGS:
            _check_chain(rank, top_k, num_local, routing)
    for compiled in (False, True):
        _check_two_layers_of_ops(rank, compiled)
    _check_fakes(rank)
    _check_out_of_order(rank)
    _check_workspace_copies(rank, a2a)
    for frozen_router in (False, True):
        _check_two_layers(rank, frozen_router)
    _check_explain(rank)
    a2a.close_all()
    gc.collect()
    assert not a2a.open_communicators() and flashinfer_a2a_emulator.MnnvlMemory.live == 0


@pytest.mark.parametrize("world_size", sorted(TOKENS_PER_RANK))
def test_trainable_tokens_match_single_process(world_size, monkeypatch):
    """One set of processes per world size for every case: their start-up is most of the
    cost."""
    # The ranks inherit it: the interpreter also on a machine with a GPU.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_on_ranks(world_size, _cases)
