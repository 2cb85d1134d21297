"""The rows format's ops on FlashInfer's all-to-all: ``dispatch`` and ``combine`` and their
gradients, each one whole round (a dispatch, then its combine) on the layer's workspace,
with the index arithmetic between the kernels in `bookkeeping`. The routing weights'
gradients go home by one ``all_to_all`` over the group.

The ops' ``combine_map`` is ``rank_of_slot_TK`` here: the rank that holds each slot's
expert (-1: skipped), along which the gradients dispatch again (as ids of P one-expert
ranks).

Legend: T tokens on this rank, M = max_tokens_per_rank, P ranks, N = P * M receive
positions, G = P * M keys, H hidden size, K experts per token, R = P * C rows (C the
capacity one rank takes from each rank).
"""

from __future__ import annotations

import torch

from torch_moe_ops.backends.common.kernels.rows import scatter_rows
from torch_moe_ops.backends.common.transport import collectives
from torch_moe_ops.backends.flashinfer.a2a.bookkeeping import (
    in_key_order,
    ranks_of,
    received_rows,
    rows_of_grad,
    summed_rows,
    token_index,
)
from torch_moe_ops.backends.flashinfer.a2a.comm_api import check_activations, on
from torch_moe_ops.backends.flashinfer.a2a.workspace import answering, communicator
from torch_moe_ops.config import worst_case_capacity


def dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size, group_name,
             max_tokens_per_rank, capacity):
    check_activations("hidden", hidden_TH)
    top_k = topk_ids_TK.shape[1]
    num_local = num_experts // ep_size
    collectives.rank_in(group_name, ep_size)
    with on(hidden_TH.device):
        comm = communicator(group_name, hidden_TH.shape[1], top_k, max_tokens_per_rank,
                            hidden_TH.dtype, hidden_TH.device)
        index_T1 = token_index(topk_ids_TK.shape[0], topk_ids_TK.device)
        x_NH, weights_NK, ids_NK, token_N1 = comm.send_tokens(
            hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, index_T1)
        comm.received.token_N1 = token_N1
        position_G, local_GK = in_key_order(comm.local_ids(ids_NK, num_experts), token_N1,
                                            max_tokens_per_rank)
        if capacity < worst_case_capacity(max_tokens_per_rank, top_k):
            collectives.check_capacity((local_GK >= 0).view(ep_size, -1).sum(1), capacity,
                                       group_name, "a rank holds the experts of more of "
                                       "another rank's slots than the capacity")
        return (*received_rows(x_NH, weights_NK, local_GK, position_G, num_local,
                               ep_size * capacity, top_k),
                ranks_of(topk_ids_TK, num_local))


def combine(y_RH, weight_R, src_R, rank_of_slot_TK, ep_size, group_name, max_tokens_per_rank):
    num_tokens, top_k = rank_of_slot_TK.shape
    with answering("y_rows", y_RH, top_k, group_name, ep_size,
                   max_tokens_per_rank) as comm:
        token_N1 = comm.received.token_N1 if comm.received is not None else None
        if token_N1 is None:
            raise RuntimeError(f"a2a backend 'flashinfer': combine must follow the dispatch "
                               f"of its layer on {comm!r}")
        summed_NH = summed_rows(y_RH, src_R, token_N1, weight_R, max_tokens_per_rank, top_k)
        return comm.combine(summed_NH, num_tokens)


def _send_back_tokens(comm, rank_of_slot_TK, payloads=()) -> tuple[torch.Tensor, list]:
    """A dispatch of each token's index (and ``payloads``) to ``rank_of_slot_TK``: the token
    index at each receive position of this round (``[N, 1]``, -1 at padding) and the
    received payloads."""
    index_T1 = token_index(rank_of_slot_TK.shape[0], rank_of_slot_TK.device)
    *received, token_N1 = comm.dispatch(rank_of_slot_TK, comm.ep_size, [*payloads, index_T1])
    return token_N1, received


def dispatch_backward(grad_x_RH, grad_weight_R, src_R, rank_of_slot_TK, ep_size, group_name,
                      max_tokens_per_rank):
    num_tokens, top_k = rank_of_slot_TK.shape
    with answering("grad_x_rows", grad_x_RH, top_k, group_name, ep_size,
                   max_tokens_per_rank) as comm:
        token_N1, _ = _send_back_tokens(comm, rank_of_slot_TK)
        grad_hidden_TH = comm.combine(
            summed_rows(grad_x_RH, src_R, token_N1, None, max_tokens_per_rank, top_k),
            num_tokens)
        per_key_GK = scatter_rows(grad_weight_R.float().unsqueeze(1), src_R,
                                  comm.num_positions * top_k).view(-1, top_k)
        # Block p of the keys is rank p's tokens; what comes back from rank q holds q's slots.
        mine_PMK = collectives.all_to_all(per_key_GK, group_name, ep_size).view(
            ep_size, max_tokens_per_rank, top_k)
        return grad_hidden_TH, mine_PMK.sum(0)[:num_tokens]


def combine_backward(grad_out_TH, y_RH, weight_R, src_R, rank_of_slot_TK, ep_size, group_name,
                     max_tokens_per_rank):
    top_k = rank_of_slot_TK.shape[1]
    with answering("y_rows", y_RH, top_k, group_name, ep_size,
                   max_tokens_per_rank) as comm:
        token_N1, (grad_NH,) = _send_back_tokens(comm, rank_of_slot_TK,
                                                 [grad_out_TH.to(y_RH.dtype)])
        grads = rows_of_grad(grad_NH, y_RH, weight_R, src_R, token_N1, max_tokens_per_rank,
                             top_k)
        # The round's combine: peers learn this rank is done with what it received.
        comm.combine(y_RH.new_zeros((comm.num_positions, 1)), rank_of_slot_TK.shape[0])
        return grads


