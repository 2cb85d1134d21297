"""The index arithmetic between FlashInfer's kernels. Rows: receive positions made keys,
the received (position, slot) pairs of local experts made rows sorted by expert, rows summed
back into positions, and the gradients of rows. Trainable tokens: the received tokens put in
token order (`common.transport.token_positions`) and back into the order they arrived in.
Each piece runs compiled on the GPU (`_compiled_on_gpu`).

Legend: T tokens on this rank, M = max_tokens_per_rank, P ranks, N = P * M receive
positions, G = P * M keys (token t of rank p has the key p * M + t), H hidden size, K
experts per token, E the experts of this rank, R rows, S = G * K slots, X the width of a
payload.
"""

from __future__ import annotations

import functools

import torch

from torch_moe_ops.backends.common.kernels.rows import (
    block_of,
    combine_grads,
    gather_index,
    gather_rows,
    scatter_index,
    sum_slots,
    weighted_rows,
)
from torch_moe_ops.backends.common.kernels.sorting import sort_rows
from torch_moe_ops.backends.common.transport.token_positions import (
    received_positions,
    send_positions,
)
from torch_moe_ops.backends.common.transport.token_routing import local_ids


def token_index(num_tokens: int, device: torch.device) -> torch.Tensor:
    """``[T, 1]`` int32: each token's index, the payload that tells a receiver which token
    of its source came to each position."""
    return torch.arange(num_tokens, dtype=torch.int32, device=device).unsqueeze(1)


def ranks_of(topk_ids_TK: torch.Tensor, num_local: int) -> torch.Tensor:
    """``[T, K]`` int32: the rank of each slot's expert, -1 for a skipped slot."""
    ids_TK = topk_ids_TK.long()
    return torch.where(ids_TK < 0, -1, ids_TK // num_local).to(torch.int32)


def _keys(token_N: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """``[N]`` int64: the key of the token at each receive position, -1 at padding."""
    source_N = torch.arange(token_N.shape[0], device=token_N.device) // max_tokens
    return torch.where(token_N < 0, -1, source_N * max_tokens + token_N.long())


def _compiled_on_gpu(body):
    """``body`` (tensors, then ints fixed per layer shape) compiled by Inductor with static
    shapes where its first input is on a GPU, as it is elsewhere (the CPU stand-in of the
    tests). The rows bookkeeping around FlashInfer's kernels is some 150 small torch ops a
    round trip: eagerly, launch-bound. It stays whole (opaque) in a compiled model, like
    the kernels, so it is compiled on its own; its sizes are the layer's (N, R), not T's.
    ``run.compiled()`` is the compiled form (whatever the device: tests compare the two)."""

    @functools.cache
    def compiled():
        # On first use: importing the package does not load the compiler. Casts to bf16
        # rounded where the eager ops round (as `weighted_rows` documents).
        return torch.compile(body, dynamic=False, fullgraph=True,
                             options={"emulate_precision_casts": True})

    @functools.wraps(body)
    def run(*args):
        return (compiled() if args[0].is_cuda else body)(*args)

    run.compiled = compiled
    return run


def _sum_received(rows_RH, src_R, key_N, top_k) -> torch.Tensor:
    """``[N, H]``: at each receive position the rows of its token summed in slot order."""
    num_slots = key_N.shape[0] * top_k
    rows = torch.arange(src_R.shape[0], device=src_R.device)
    row_of_slot_GK = scatter_index(rows, src_R, num_slots).view(-1, top_k)
    return sum_slots(rows_RH, gather_rows(row_of_slot_GK + 1, key_N) - 1)


def _positions(key_N: torch.Tensor) -> torch.Tensor:
    """``[G]``: the receive position of each key, -1 where its token did not come."""
    return scatter_index(torch.arange(key_N.shape[0], device=key_N.device), key_N,
                         key_N.shape[0])


@_compiled_on_gpu
def in_key_order(local_NK, token_N1, max_tokens):
    """``(position_G, local_GK)``: where each key's token was received, and its local ids
    (-1 where it did not come)."""
    position_G = _positions(_keys(token_N1[:, 0], max_tokens))
    return position_G, gather_rows(local_NK + 1, position_G) - 1


@_compiled_on_gpu
def received_rows(x_NH, weights_NK, local_GK, position_G, num_local, num_rows, top_k):
    """The rows format's outputs but the slot map: ``(x_RH, expert_R, weight_R, src_R,
    count_E)``; the slots of this rank's experts sort first, in key order."""
    order_S, expert_S, count_E = sort_rows(local_GK, num_local)
    expert_R = expert_S[:num_rows]
    src_R = order_S[:num_rows].masked_fill(expert_R < 0, -1).to(torch.int32)
    position_R = gather_index(position_G, block_of(src_R, top_k))
    slot_R = torch.where(position_R < 0, -1, position_R * top_k + src_R % top_k)
    weight_R = gather_rows(weights_NK.reshape(-1, 1), slot_R)[:, 0]
    return (gather_rows(x_NH, position_R), expert_R.to(torch.int32), weight_R, src_R,
            count_E.clone())


@_compiled_on_gpu
def summed_rows(rows_RH, src_R, token_N1, weight_R, max_tokens, top_k):
    """``[N, H]``: at each receive position its token's rows (times ``weight_R`` where
    given) summed in slot order."""
    if weight_R is not None:
        rows_RH = weighted_rows(rows_RH, weight_R, src_R)
    return _sum_received(rows_RH, src_R, _keys(token_N1[:, 0], max_tokens), top_k)


@_compiled_on_gpu
def rows_of_grad(grad_NH, y_RH, weight_R, src_R, token_N1, max_tokens, top_k):
    """The gradients of the rows (`combine_grads`) from the received gradient of each
    position, ``grad_NH``."""
    position_R = gather_index(_positions(_keys(token_N1[:, 0], max_tokens)),
                              block_of(src_R, top_k))
    return combine_grads(gather_rows(grad_NH, position_R), y_RH, weight_R, src_R)




def _arrival_of_positions(ids_NK, token_N1, counts_P, rank, num_local, max_tokens):
    """``(arrival_N, local_NK)``: the receive position of the token at each position in
    token order (-1: padding), and the received ids made local, in arrival order."""
    local_NK = local_ids(ids_NK, rank, num_local)
    position_N = received_positions(local_NK, _arrived(token_N1, counts_P, max_tokens),
                                    max_tokens)
    arrivals_N = torch.arange(position_N.shape[0], device=position_N.device)
    return scatter_index(arrivals_N, position_N, position_N.shape[0]), local_NK


def _arrived(token_N1, counts_P, max_tokens):
    """``[N]``: the token index at each receive position, -1 past the ``counts_P[p]``
    tokens rank p sent (padding, which holds what earlier calls left there)."""
    within_PM = torch.arange(max_tokens, device=token_N1.device).unsqueeze(0)
    arrived_N = (within_PM < counts_P.unsqueeze(1)).view(-1)
    return torch.where(arrived_N, token_N1[:, 0], -1)


@_compiled_on_gpu
def tokens_in_token_order(x_NH, weights_NK, ids_NK, token_N1, counts_P, rank, num_local,
                          max_tokens):
    """The trainable tokens format's dispatch output from the arrivals (each ``[N, ...]``
    in arrival order, ``ids_NK`` global, ``counts_P`` the tokens each rank sent):
    ``(x_NH, weights_NK, local_NK)`` in token order, copies; zeros at padding, ids -1
    there."""
    arrival_N, local_NK = _arrival_of_positions(ids_NK, token_N1, counts_P, rank, num_local,
                                                max_tokens)
    return (gather_rows(x_NH, arrival_N), gather_rows(weights_NK, arrival_N),
            gather_rows(local_NK + 1, arrival_N) - 1)


@_compiled_on_gpu
def rows_in_token_order(rows_NX, ids_NK, token_N1, counts_P, rank, num_local, max_tokens):
    """``rows_NX`` (in arrival order) in token order, a copy; zeros at padding."""
    arrival_N, _ = _arrival_of_positions(ids_NK, token_N1, counts_P, rank, num_local,
                                         max_tokens)
    return gather_rows(rows_NX, arrival_N)


@_compiled_on_gpu
def rows_in_arrival_order(rows_NX, ids_NK, token_N1, counts_P, rank, num_local, max_tokens):
    """``rows_NX`` (in token order) at the positions the last dispatch's tokens arrived at,
    what FlashInfer's combine reads; zeros at padding and where a token came for none of
    this rank's experts."""
    local_NK = local_ids(ids_NK, rank, num_local)
    token_N = _arrived(token_N1, counts_P, max_tokens)
    return gather_rows(rows_NX, received_positions(local_NK, token_N, max_tokens))


@_compiled_on_gpu
def summed_home(returned_NK, ids_MK, num_experts, ep_size, max_tokens):
    """The second half of `token_positions.home`, compiled: from what an ``all_to_all`` of
    ``[N, K]`` in token order returned, each of this rank's tokens' rows (``ids_MK``: its
    ids, padded with -1 to M tokens so that the body's sizes are the layer's) summed over
    the ranks it went to; ``[M, K]``."""
    return sum_slots(returned_NK, send_positions(ids_MK, num_experts, ep_size, max_tokens)[0])
