"""The ``allgather`` a2a backend: every rank sees every token, runs its own experts
on the slots that chose them, and a reduce-scatter brings each token's sum home.

Legend: T tokens on this rank, M = max_tokens_per_rank, H hidden size, K experts
per token, E experts, E_l = E / P experts per rank, P ranks, N = P * M token positions,
G = P * M * K gathered slots, C rows this rank takes from each rank (the capacity),
R = P * C rows.

Tokens (`ops.tokens`, the format the lowering picks) are what the all-gather makes: the
gathered ``[N, H]`` (position ``p * M + t``: token t of rank p, zeros past its T) with the
gathered weights and the ids made local (-1: another rank's expert, a skipped slot,
padding) is the experts' input as it is, and combine is the reduce-scatter of their
``[N, H]``. The gradients are the same two collectives swapped.

Tokens in chunks (`ops.tokens_in_flight`): each chunk's window of tokens is gathered as above
with M of one chunk, by collectives issued by the ``*_start`` ops and waited in the graph; the
reduce-scatter returns each token's sum, so no ``combine_tokens_finish`` is needed.

Rows (``moe::dispatch``, kept for quantized layers, whose rows travel in fp8):

tokens, ids and weights are padded to M and all-gathered (padding slots carry
id -1); this rank keeps the gathered slots whose expert it holds, sorted by
local expert (``src_R``: the gathered slot of each row). Combine weights the
rows, sums each gathered token's rows in slot order and reduce-scatters, so
token ``t`` of rank ``p`` comes back to rank ``p`` summed over every rank's
experts. All sizes are static; no host sync unless ``ep_capacity`` is below
the worst case, where dispatch checks on every rank (one all-reduce and a host
read) that no rank takes more than ``C`` rows from one rank, and raises on all
of them if one does.

Results come back summed per token, not per row: ``placeholder_TK`` (the ops'
``combine_map``) only carries T and K here (every entry is -1).

fp8 dispatch (``dispatch_quant``): tokens are quantized before the all-gather
and gathered as rows of bytes, values and scales together
(`common.transport.quantized_dispatch`); the reduce-scatter stays in the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_moe_ops.backends.common.kernels.rows import (
    block_of,
    combine_grads,
    gather_rows,
    scatter_rows,
    weighted_rows,
)
from torch_moe_ops.backends.common.kernels.sorting import sort_rows
from torch_moe_ops.backends.common.transport import collectives
from torch_moe_ops.backends.common.transport.quantized_dispatch import quantized_dispatch
from torch_moe_ops.backends.common.transport.token_routing import (
    finish_dispatch,
    received_routing,
    routing_columns,
)
from torch_moe_ops.backends.registry import REGISTRY, A2ABackend
from torch_moe_ops.config import worst_case_capacity
from torch_moe_ops.ops import define_backend_ops, tokens_in_flight
from torch_moe_ops.ops.checks import compute_dtype

NAMESPACE = "moe_allgather"


def _gather_padded(local_TX: torch.Tensor, max_tokens: int, fill, group_name: str,
                   ep_size: int, issue=collectives.all_gather) -> torch.Tensor:
    """``[P * M, ...]``: every rank's ``local`` padded to M rows with ``fill``, in rank order
    (in flight where ``issue`` is `collectives.start_all_gather`)."""
    pad = [0, 0] * (local_TX.dim() - 1) + [0, max_tokens - local_TX.shape[0]]
    return issue(F.pad(local_TX, pad, value=fill), group_name, ep_size)


def _scatter_home(gathered_GX: torch.Tensor, num_tokens: int, group_name: str,
                  ep_size: int) -> torch.Tensor:
    """Each rank's block of the sum over ranks of ``[P * M, ...]``, cut to its T tokens."""
    return collectives.reduce_scatter(gathered_GX, group_name, ep_size)[:num_tokens]


def dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size, group_name,
             max_tokens_per_rank, capacity):
    top_k = topk_ids_TK.shape[1]
    num_local = num_experts // ep_size
    rank = collectives.rank_in(group_name, ep_size)
    hidden_GH = _gather_padded(hidden_TH, max_tokens_per_rank, 0.0, group_name, ep_size)
    ids_GK = _gather_padded(topk_ids_TK.to(torch.int32), max_tokens_per_rank, -1, group_name,
                            ep_size)
    weights_GK = _gather_padded(topk_weights_TK.float(), max_tokens_per_rank, 0.0, group_name,
                                ep_size)
    first = rank * num_local
    mine_GK = (ids_GK >= first) & (ids_GK < first + num_local)
    local_GK = torch.where(mine_GK, ids_GK - first, -1)
    order_S, expert_S, count_E = sort_rows(local_GK, num_local)
    num_rows = ep_size * capacity
    if capacity < worst_case_capacity(max_tokens_per_rank, top_k):
        collectives.check_capacity(mine_GK.view(ep_size, -1).sum(1), capacity, group_name,
                                   "a rank holds the experts of more of another rank's "
                                   "slots than the capacity")
    # Slots of this rank's experts sort first: the first R rows hold them all.
    order_R, expert_R = order_S[:num_rows], expert_S[:num_rows]
    src_R = order_R.masked_fill(expert_R < 0, -1).to(torch.int32)
    x_RH = gather_rows(hidden_GH, block_of(src_R, top_k))
    weight_R = gather_rows(weights_GK.reshape(-1, 1), src_R)[:, 0]
    placeholder_TK = torch.full(tuple(topk_ids_TK.shape), -1, dtype=torch.int32,
                                device=topk_ids_TK.device)
    return x_RH, expert_R.to(torch.int32), weight_R, src_R, count_E.clone(), placeholder_TK


def _sum_gathered_slots(rows_RH, src_R, ep_size, max_tokens, top_k):
    """``[P * M, H]``: each gathered token's rows summed in slot order."""
    slots_GKH = scatter_rows(rows_RH, src_R, ep_size * max_tokens * top_k)
    summed = slots_GKH.view(-1, top_k, rows_RH.shape[1]).to(compute_dtype(rows_RH.dtype)).sum(1)
    return summed.to(rows_RH.dtype)


def combine(y_RH, weight_R, src_R, placeholder_TK, ep_size, group_name, max_tokens_per_rank):
    collectives.rank_in(group_name, ep_size)
    num_tokens, top_k = placeholder_TK.shape
    summed_GH = _sum_gathered_slots(weighted_rows(y_RH, weight_R, src_R), src_R, ep_size,
                                    max_tokens_per_rank, top_k)
    return _scatter_home(summed_GH, num_tokens, group_name, ep_size)


def dispatch_backward(grad_x_RH, grad_weight_R, src_R, placeholder_TK, ep_size, group_name,
                      max_tokens_per_rank):
    collectives.rank_in(group_name, ep_size)
    num_tokens, top_k = placeholder_TK.shape
    summed_GH = _sum_gathered_slots(grad_x_RH, src_R, ep_size, max_tokens_per_rank, top_k)
    grad_weights_GK = scatter_rows(grad_weight_R.unsqueeze(1), src_R,
                                   ep_size * max_tokens_per_rank * top_k).view(-1, top_k)
    return (_scatter_home(summed_GH, num_tokens, group_name, ep_size),
            _scatter_home(grad_weights_GK, num_tokens, group_name, ep_size))


def combine_backward(grad_out_TH, y_RH, weight_R, src_R, placeholder_TK, ep_size, group_name,
                     max_tokens_per_rank):
    collectives.rank_in(group_name, ep_size)
    top_k = placeholder_TK.shape[1]
    grad_GH = _gather_padded(grad_out_TH, max_tokens_per_rank, 0.0, group_name, ep_size)
    grad_RH = gather_rows(grad_GH, block_of(src_R, top_k))
    return combine_grads(grad_RH, y_RH, weight_R, src_R)


def dispatch_tokens(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size, group_name,
                    max_tokens_per_rank):
    rank = collectives.rank_in(group_name, ep_size)

    def send(values_TX):
        return _gather_padded(values_TX, max_tokens_per_rank, 0, group_name, ep_size)

    # Rows and routing in two messages whatever their size: the all-gather of the rows
    # writes the receive buffer itself, where one message would add a copy on each side.
    x_NH = send(hidden_TH)
    columns_NX = send(routing_columns(topk_ids_TK, topk_weights_TK))
    return (x_NH, *received_routing(columns_NX, topk_ids_TK.shape[1], rank,
                                    num_experts // ep_size))


def combine_tokens(y_NH, topk_ids_TK, num_experts, ep_size, group_name, max_tokens_per_rank):
    collectives.rank_in(group_name, ep_size)
    return _scatter_home(y_NH, topk_ids_TK.shape[0], group_name, ep_size)


def dispatch_tokens_backward(grad_x_NH, grad_weights_NK, topk_ids_TK, num_experts, ep_size,
                             group_name, max_tokens_per_rank):
    collectives.rank_in(group_name, ep_size)
    num_tokens = topk_ids_TK.shape[0]
    return (_scatter_home(grad_x_NH, num_tokens, group_name, ep_size),
            _scatter_home(grad_weights_NK, num_tokens, group_name, ep_size))


def combine_tokens_backward(grad_out_TH, topk_ids_TK, num_experts, ep_size, group_name,
                            max_tokens_per_rank):
    collectives.rank_in(group_name, ep_size)
    return _gather_padded(grad_out_TH, max_tokens_per_rank, 0.0, group_name, ep_size)


def dispatch_tokens_start(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size,
                          group_name, max_tokens_per_rank, chunk, num_chunks):
    collectives.rank_in(group_name, ep_size)
    window = (chunk, max_tokens_per_rank, num_chunks)

    def send(values_WX):
        return _gather_padded(values_WX, max_tokens_per_rank, 0, group_name, ep_size,
                              collectives.start_all_gather)

    return (send(tokens_in_flight.window_rows(hidden_TH, *window)),
            send(routing_columns(tokens_in_flight.window_rows(topk_ids_TK, *window, fill=-1),
                                 tokens_in_flight.window_rows(topk_weights_TK, *window))))


def combine_tokens_start(y_NH, topk_ids_TK, num_experts, ep_size, group_name,
                         max_tokens_per_rank, chunk, num_chunks):
    collectives.rank_in(group_name, ep_size)
    # Positions past a rank's tokens hold zeros with no expert: their sums stay zero.
    return collectives.start_reduce_scatter(y_NH, group_name, ep_size)


KERNELS = {"dispatch": dispatch, "combine": combine,
           "dispatch_backward": dispatch_backward,
           "combine_backward": combine_backward,
           "dispatch_quant": quantized_dispatch(dispatch),
           "dispatch_tokens": dispatch_tokens, "combine_tokens": combine_tokens,
           "dispatch_tokens_backward": dispatch_tokens_backward,
           "combine_tokens_backward": combine_tokens_backward}
define_backend_ops(NAMESPACE, KERNELS)
collectives.trace_into_graphs(NAMESPACE, KERNELS)
IN_FLIGHT_KERNELS = {"dispatch_tokens_start": dispatch_tokens_start,
                     "dispatch_tokens_finish": finish_dispatch,
                     "combine_tokens_start": combine_tokens_start}
IN_FLIGHT_CONTRACTS = tokens_in_flight.contracts(sums_at_home=False)
define_backend_ops(NAMESPACE, IN_FLIGHT_KERNELS, IN_FLIGHT_CONTRACTS)
collectives.trace_in_flight_into_graphs(NAMESPACE, IN_FLIGHT_KERNELS, IN_FLIGHT_CONTRACTS)

REGISTRY.register_a2a(A2ABackend(
    name="allgather", namespace=NAMESPACE, supports=collectives.supports,
    description="all-gather tokens, local experts on all of them, reduce-scatter back"))
