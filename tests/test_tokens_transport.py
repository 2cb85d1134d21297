"""The tokens format over torch.distributed (gloo, CPU processes): ``dispatch_tokens ->
moe::experts -> combine_tokens`` of each a2a backend equals the single-process reference on
the same tokens, forward and gradients, whatever the routing; a compiled layer that trains
takes it; and the rows format keeps repeated ids.

Legend: P ranks, T tokens of one rank, N tokens of all ranks (or receive positions), H
hidden size, I expert intermediate size, E experts, E_l = E / P, K experts per token.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import torch_moe_ops as tmo
from distributed import run_on_ranks
from ep_problems import (
    assert_rank_matches,
    cpu_single_and_sharded,
    draw_problem,
    leaves,
    token_slice,
)
from torch_moe_ops.backends.common.transport import token_routing
from torch_moe_ops.config import BackendSpec, worst_case_capacity
from torch_moe_ops.lowering import moe_op_sequence
from torch_moe_ops.ops import op_overload

H, I, K = 16, 8, 3
MAX_TOKENS = 6
# Tokens on each rank: uneven, one rank idle.
TOKENS_PER_RANK = {2: (5, 0), 3: (6, 0, 3), 4: (6, 0, 3, 1), 8: (6, 0, 3, 1, 6, 2, 0, 5)}
NAMESPACES = {"all_to_all": "moe_all_to_all", "allgather": "moe_allgather"}
# Each routing a case of its own: skipped slots, every slot on rank 0's experts, a token
# choosing one expert in several slots, one expert for every first slot.
ROUTINGS = ("random", "one_rank", "repeated", "hot_expert")
STATIC = ("silu", 1.702, 7.0)


def _problem(world_size: int, routing: str):
    num_experts = 2 * world_size
    hidden_NH, weights_NK, ids_NK, experts = draw_problem(
        17, "random" if routing in ("repeated", "hot_expert") else routing,
        sum(TOKENS_PER_RANK[world_size]), num_experts, world_size, H, I, K)
    if routing == "repeated":
        ids_NK[1::2, 1] = ids_NK[1::2, 0]
        ids_NK[::4, 2] = ids_NK[::4, 0]
    if routing == "hot_expert":
        ids_NK[:, 0] = 0
        ids_NK[:, 1:] = torch.where(ids_NK[:, 1:] == 0, 1, ids_NK[:, 1:])
    return hidden_NH, weights_NK, ids_NK, experts, num_experts


def _reference(hidden_NH, weights_NK, ids_NK, experts, grad_NH):
    ref_leaves = leaves(hidden_NH, weights_NK, *experts.values())
    ref_NH = torch.ops.moe_reference.experts(ref_leaves[0], ref_leaves[1], ids_NK,
                                             *ref_leaves[2:], *STATIC)
    ref_NH.backward(grad_NH)
    return ref_NH, ref_leaves


def _check(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


def _check_tokens_chain(rank, world_size, a2a, routing):
    hidden_NH, weights_NK, ids_NK, experts, num_experts = _problem(world_size, routing)
    grad_NH = torch.randn(hidden_NH.shape, generator=torch.Generator().manual_seed(3))
    ref_NH, ref_leaves = _reference(hidden_NH, weights_NK, ids_NK, experts, grad_NH)
    num_local = num_experts // world_size
    mine = token_slice(TOKENS_PER_RANK[world_size], rank)
    local = slice(rank * num_local, (rank + 1) * num_local)
    ours = leaves(hidden_NH[mine], weights_NK[mine], *(w[local] for w in experts.values()))
    ep_args = (world_size, dist.group.WORLD.group_name, MAX_TOKENS)
    namespace = NAMESPACES[a2a]
    dispatch_args = (ours[0], ours[1], ids_NK[mine], num_experts, *ep_args)
    if routing == "random":
        # Every rank runs opcheck's calls in the same order: the collectives pair up.
        torch.library.opcheck(op_overload(namespace, "dispatch_tokens"),
                              tuple(t.detach() if isinstance(t, torch.Tensor) else t
                                    for t in dispatch_args))
    x_NH, weights_tokens_NK, local_NK = op_overload(namespace, "dispatch_tokens")(*dispatch_args)
    assert x_NH.shape == (world_size * MAX_TOKENS, H)
    assert local_NK.dtype == torch.int32 and int(local_NK.max()) < num_local
    y_NH = torch.ops.moe_reference.experts(x_NH, weights_tokens_NK, local_NK, *ours[2:], *STATIC)
    combine_args = (y_NH, ids_NK[mine], num_experts, *ep_args)
    if routing == "random":
        torch.library.opcheck(op_overload(namespace, "combine_tokens"),
                              (y_NH.detach(), *combine_args[1:]))
    out_TH = op_overload(namespace, "combine_tokens")(*combine_args)
    out_TH.backward(grad_NH[mine])
    assert_rank_matches(out_TH, ours, ref_NH, ref_leaves, mine, local, _check, _check)


def _check_rows_keep_repeated_ids(rank, world_size, a2a):
    """Rows of a token that chose one expert in several slots all arrive (the worst-case
    capacity counts every slot)."""
    hidden_NH, weights_NK, ids_NK, experts, num_experts = _problem(world_size, "repeated")
    grad_NH = torch.zeros_like(hidden_NH)
    ref_NH, _ = _reference(hidden_NH, weights_NK, ids_NK, experts, grad_NH)
    num_local = num_experts // world_size
    mine = token_slice(TOKENS_PER_RANK[world_size], rank)
    local = slice(rank * num_local, (rank + 1) * num_local)
    ep_args = (world_size, dist.group.WORLD.group_name, MAX_TOKENS)
    capacity = worst_case_capacity(MAX_TOKENS, K)
    namespace = NAMESPACES[a2a]
    x_RH, expert_R, weight_R, src_R, count_E, combine_map_TK = op_overload(namespace, "dispatch")(
        hidden_NH[mine], weights_NK[mine], ids_NK[mine], num_experts, *ep_args, capacity)
    y_RH = torch.ops.moe.experts_rows(x_RH, expert_R, count_E,
                                      *(w[local] for w in experts.values()), *STATIC)
    out_TH = op_overload(namespace, "combine")(y_RH, weight_R, src_R, combine_map_TK, *ep_args)
    _check(out_TH, ref_NH[mine].detach())


def _check_compiled_layer_trains_on_tokens(rank, world_size, a2a):
    single, sharded = cpu_single_and_sharded(H, I, K, MAX_TOKENS)
    sequences = []

    def recording(gm, example_inputs):
        lowered = tmo.lowering.lower(gm, BackendSpec(a2a=a2a))
        sequences.append(moe_op_sequence(lowered))
        return lowered

    x_NH = torch.randn(sum(TOKENS_PER_RANK[world_size]), H,
                       generator=torch.Generator().manual_seed(9))
    mine = token_slice(TOKENS_PER_RANK[world_size], rank)
    x_TH = x_NH[mine].clone().requires_grad_()
    out_TH = torch.compile(sharded, backend=recording, fullgraph=True)(x_TH)
    out_TH.square().sum().backward()
    x_ref = x_NH.clone().requires_grad_()
    single(x_ref).square().sum().backward()
    namespace = NAMESPACES[a2a]
    dispatch, experts, combine = [op for op in sequences[0].split("\n") if "route" not in op]
    assert (dispatch, combine) == (f"{namespace}::dispatch_tokens",
                                   f"{namespace}::combine_tokens"), sequences[0]
    assert experts.endswith("::experts"), sequences[0]
    _check(out_TH, single(x_NH)[mine].detach())
    _check(x_TH.grad, x_ref.grad[mine])
    local = sharded.local_experts
    for name in ("w13", "w2"):
        _check(getattr(sharded, name).grad, getattr(single, name).grad[local.start:local.stop])


def _check_explain(rank, world_size, a2a):
    """`tmo.explain` on every rank: the layer's plan, its format and the bytes it sends."""
    cfg = tmo.MoEConfig(hidden_size=H, intermediate_size=I, num_experts=2 * world_size,
                        top_k=K, ep_size=world_size, max_tokens_per_rank=MAX_TOKENS)
    sharded = tmo.MoE(cfg, ep_group=dist.group.WORLD)
    x_TH = torch.randn(TOKENS_PER_RANK[world_size][rank], H)
    (report,) = tmo.explain(sharded, x_TH, a2a=a2a)
    assert (report.plan.a2a.name, report.plan.format.name) == (a2a, "tokens")
    assert report.plan.problem.training
    text = str(report)
    peers = world_size - 1
    # fp32 rows of H and K ids and weights there, rows back.
    assert (f"bytes each rank sends per call: dispatch {peers * MAX_TOKENS * (4 * H + 8 * K):,}, "
            f"combine {peers * MAX_TOKENS * 4 * H:,}") in text, text
    assert f"ep_size={world_size}" in text and "format:  tokens" in text, text


def _check_one_rank_failure_fails_all(rank, world_size, a2a):
    """A check that fails on the last rank only (too many tokens there, or an id out of
    range) raises on every rank, before any collective: no rank waits for the timeout."""
    num_experts = 2 * world_size
    ep_args = (world_size, dist.group.WORLD.group_name, MAX_TOKENS)
    last = rank == world_size - 1
    for hidden_TH, ids_TK, reason in (
            (torch.randn(MAX_TOKENS + 1 if last else 1, H), None, "max_tokens_per_rank"),
            (torch.randn(2, H), torch.full((2, K), num_experts if last else 0), "topk_ids")):
        if ids_TK is None:
            ids_TK = torch.zeros(hidden_TH.shape[0], K, dtype=torch.int32)
        weights_TK = torch.ones(hidden_TH.shape[0], K)
        for op in ("dispatch_tokens", "dispatch"):
            args = (hidden_TH, weights_TK, ids_TK.to(torch.int32), num_experts, *ep_args)
            if op == "dispatch":
                args = (*args, worst_case_capacity(MAX_TOKENS, K))
            expected = reason if last else "the argument checks failed on another rank"
            with pytest.raises((ValueError, RuntimeError), match=expected):
                op_overload(NAMESPACES[a2a], op)(*args)
    # The group still works: the next collective pairs up on every rank.
    total = torch.ones(1)
    dist.all_reduce(total)
    assert int(total) == world_size


def _run_cases(rank, world_size, a2a):
    for routing in ROUTINGS:
        _check_tokens_chain(rank, world_size, a2a, routing)
    # Rows and routing in messages of their own, as large batches send them.
    one_message = token_routing.ONE_MESSAGE_BYTES
    token_routing.ONE_MESSAGE_BYTES = 0
    try:
        _check_tokens_chain(rank, world_size, a2a, "repeated")
    finally:
        token_routing.ONE_MESSAGE_BYTES = one_message
    _check_rows_keep_repeated_ids(rank, world_size, a2a)
    _check_compiled_layer_trains_on_tokens(rank, world_size, a2a)
    _check_explain(rank, world_size, a2a)
    _check_one_rank_failure_fails_all(rank, world_size, a2a)


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
@pytest.mark.parametrize("a2a", sorted(NAMESPACES))
def test_tokens_chain_matches_single_process(a2a, world_size):
    run_on_ranks(world_size, _run_cases, a2a)
