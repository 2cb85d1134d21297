"""The ``all_to_all`` a2a backend: static-capacity all-to-all over torch.distributed.

Legend: T tokens on this rank, H hidden size, K experts per token, E experts,
E_l = E / P experts per rank, P ranks, M = max_tokens_per_rank, N = P * M token
positions, C rows one rank sends another (the capacity), Q = P * C send (and
receive) positions, R = Q rows, S = T * K slots.

Tokens (`ops.tokens`, the format the lowering picks): each token goes once to each rank
that holds one of its experts, whatever number of its slots chose experts there. This
rank's tokens for rank ``p`` take send positions ``[p * M, p * M + n_p)`` in token order
(``send_position_TP``: each token's position in each block, -1 where it does not go;
`common.transport.token_positions`), with their routing weights and ids made local to ``p``
(-1: another rank's expert), and one ``all_to_all_single`` of equal static splits moves the
rows, ids and weights.
The receive buffer ``[N, H]`` is the experts' input as it is. Combine sends each
position's result back the same way and sums each token's over the ranks it went to
(fp32, in rank order). The gradients are the same two moves reversed: that of combine is
a dispatch of ``grad_out``, that of dispatch a combine of the activations' and weights'
gradients. All sizes are static, repeated ids and skipped slots need no special case, and
positions follow from ``topk_ids`` alone, so the gradients recompute them. Ids and weights
ride in the rows' message where it is small (`common.transport.token_routing`).

Tokens in chunks (`ops.tokens_in_flight`): each chunk's window of tokens moves as above with
M of one chunk, its all-to-alls issued by the ``*_start`` ops and waited in the graph; the
returned positions are summed at home by ``combine_tokens_finish``.

Rows (``moe::dispatch``, kept for quantized layers, whose rows travel in fp8):

dispatch sorts this rank's slots by global expert, which groups them by the
rank that holds the expert: the slots for rank ``p`` take send positions
``[p * C, p * C + n_p)`` in expert order, the rest of each block is padding
(expert -1). One ``all_to_all_single`` moves the rows, a second one their
local expert ids and routing weights (the device-side counts: padding carries
-1), both with equal static splits, so the op traces, compiles and captures in
a CUDA graph with no host sync. The receiver sorts what it got by local expert
into the rows format; ``src_R`` is where each row was received. Combine
weights the rows, puts each back at its receive position and sends the blocks
back the same way; the sender sums each token's K returned rows in slot order
(``send_position_TK``, the ops' ``combine_map``: each slot's send position, -1: skipped).

``C`` defaults to the worst case, ``max_tokens_per_rank * K`` (a token may choose one
expert in several slots), which cannot overflow. A smaller ``ep_capacity`` moves fewer
bytes; then dispatch checks on every rank, with one all-reduce and a host read, that no
rank sends another more than ``C`` rows, and raises on all of them if one does.

fp8 dispatch (``dispatch_quant``, where the dispatch dtype rule picks fp8):
each token is quantized once on its own rank and its fp8 values and fp32
scales travel as one row of bytes through the same two all-to-alls
(`common.transport.quantized_dispatch`); combine moves the experts' output in the
activation dtype, as without quantization.
"""

from __future__ import annotations

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
from torch_moe_ops.backends.common.transport import collectives
from torch_moe_ops.backends.common.transport.quantized_dispatch import quantized_dispatch
from torch_moe_ops.backends.common.transport.token_positions import home, send_positions
from torch_moe_ops.backends.common.transport.token_routing import (
    finish_dispatch,
    received_routing,
    routing_columns,
    send_with_routing,
)
from torch_moe_ops.backends.registry import REGISTRY, A2ABackend
from torch_moe_ops.config import worst_case_capacity
from torch_moe_ops.ops import define_backend_ops, tokens_in_flight

NAMESPACE = "moe_all_to_all"


def _send_positions(topk_ids_TK, num_experts, ep_size, capacity):
    """Each slot's send position (``send_position_TK``, -1: skipped) and each send
    position's slot (``slot_of_pos_Q``, -1: padding); and the rows each rank gets."""
    num_slots, num_positions = topk_ids_TK.numel(), ep_size * capacity
    order_S, sorted_ids_S, count_E = sort_rows(topk_ids_TK, num_experts)
    count_P = count_E.view(ep_size, -1).sum(1)
    start_P = torch.cumsum(count_P, 0) - count_P
    dest_S = torch.where(sorted_ids_S < 0, 0, sorted_ids_S // (num_experts // ep_size))
    within_S = torch.arange(num_slots, device=order_S.device) - start_P[dest_S]
    kept_S = (sorted_ids_S >= 0) & (within_S < capacity)
    position_S = torch.where(kept_S, dest_S * capacity + within_S, -1)
    slot_of_pos_Q = scatter_index(order_S, position_S, num_positions)
    send_position_S = scatter_index(position_S, order_S, num_slots)
    return send_position_S.view(topk_ids_TK.shape).to(torch.int32), slot_of_pos_Q, count_P


def dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size, group_name,
             max_tokens_per_rank, capacity):
    top_k = topk_ids_TK.shape[1]
    num_local = num_experts // ep_size
    collectives.rank_in(group_name, ep_size)
    send_position_TK, slot_of_pos_Q, count_P = _send_positions(topk_ids_TK, num_experts,
                                                               ep_size, capacity)
    if capacity < worst_case_capacity(max_tokens_per_rank, top_k):
        collectives.check_capacity(count_P, capacity, group_name,
                                   "a rank sends another more rows than the capacity")
    token_Q = block_of(slot_of_pos_Q, top_k)
    ids_Q = gather_index(topk_ids_TK.reshape(-1).long(), slot_of_pos_Q)
    local_Q = torch.where(ids_Q < 0, -1, ids_Q % num_local).to(torch.int32)
    weight_Q = gather_rows(topk_weights_TK.reshape(-1, 1).float(), slot_of_pos_Q)[:, 0]
    # One message for both: the weight's bits travel as int32 beside the id.
    meta_Q2 = torch.stack([local_Q, weight_Q.view(torch.int32)], 1)
    recv_x_QH = collectives.all_to_all(gather_rows(hidden_TH, token_Q), group_name, ep_size)
    recv_meta_Q2 = collectives.all_to_all(meta_Q2, group_name, ep_size)
    recv_expert_Q = recv_meta_Q2[:, 0]
    recv_weight_Q = recv_meta_Q2[:, 1].contiguous().view(torch.float32)
    order_R, expert_R, count_E = sort_rows(recv_expert_Q.unsqueeze(1), num_local)
    skip_R = expert_R < 0
    src_R = order_R.masked_fill(skip_R, -1).to(torch.int32)
    return (gather_rows(recv_x_QH, src_R), expert_R.to(torch.int32),
            gather_rows(recv_weight_Q.unsqueeze(1), src_R)[:, 0], src_R, count_E.clone(),
            send_position_TK)


def _send_back(rows_RX, src_R, group_name, ep_size):
    """Rows to the ranks and send positions they came from: ``[Q, ...]``, in the
    sender's frame."""
    # A gather through the inverse of src_R, not a scatter: compiled, it fuses
    # with whatever produced the rows (combine's weighting) into one pass.
    rows_R = torch.arange(src_R.shape[0], device=src_R.device)
    row_of_pos_Q = scatter_index(rows_R, src_R, rows_RX.shape[0])
    return collectives.all_to_all(gather_rows(rows_RX, row_of_pos_Q), group_name, ep_size)


def _slot_of_position(send_position_TK, num_positions):
    slots_S = torch.arange(send_position_TK.numel(), device=send_position_TK.device)
    return scatter_index(slots_S, send_position_TK.reshape(-1), num_positions)


def combine(y_RH, weight_R, src_R, send_position_TK, ep_size, group_name, max_tokens_per_rank):
    collectives.rank_in(group_name, ep_size)
    returned_QH = _send_back(weighted_rows(y_RH, weight_R, src_R), src_R, group_name, ep_size)
    return sum_slots(returned_QH, send_position_TK)


def dispatch_backward(grad_x_RH, grad_weight_R, src_R, send_position_TK, ep_size, group_name,
                      max_tokens_per_rank):
    collectives.rank_in(group_name, ep_size)
    returned_QH = _send_back(grad_x_RH, src_R, group_name, ep_size)
    returned_Q1 = _send_back(grad_weight_R.unsqueeze(1), src_R, group_name, ep_size)
    grad_topk_weights_S1 = gather_rows(returned_Q1, send_position_TK.reshape(-1))
    return (sum_slots(returned_QH, send_position_TK),
            grad_topk_weights_S1.view(send_position_TK.shape))


def combine_backward(grad_out_TH, y_RH, weight_R, src_R, send_position_TK, ep_size, group_name,
                     max_tokens_per_rank):
    collectives.rank_in(group_name, ep_size)
    slot_of_pos_Q = _slot_of_position(send_position_TK, y_RH.shape[0])
    token_Q = block_of(slot_of_pos_Q, send_position_TK.shape[1])
    recv_grad_QH = collectives.all_to_all(gather_rows(grad_out_TH, token_Q), group_name,
                                          ep_size)
    return combine_grads(gather_rows(recv_grad_QH, src_R), y_RH, weight_R, src_R)


def _to_positions(values_TX, token_of_position_N, group_name, ep_size,
                  issue=collectives.all_to_all):
    """``[N, ...]`` of ``values`` as each token's receivers get them (in flight where ``issue``
    is `collectives.start_all_to_all`)."""
    return issue(gather_rows(values_TX, token_of_position_N), group_name, ep_size)


def dispatch_tokens(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size, group_name,
                    max_tokens_per_rank):
    rank = collectives.rank_in(group_name, ep_size)
    _, token_of_position_N = send_positions(topk_ids_TK, num_experts, ep_size, max_tokens_per_rank)

    def send(values_TX):
        return _to_positions(values_TX, token_of_position_N, group_name, ep_size)

    x_NH, columns_NX = send_with_routing(send, hidden_TH,
                                         routing_columns(topk_ids_TK, topk_weights_TK),
                                         ep_size * max_tokens_per_rank)
    return (x_NH, *received_routing(columns_NX, topk_ids_TK.shape[1], rank,
                                    num_experts // ep_size))


def combine_tokens(y_NH, topk_ids_TK, num_experts, ep_size, group_name, max_tokens_per_rank):
    collectives.rank_in(group_name, ep_size)
    send_position_TP, _ = send_positions(topk_ids_TK, num_experts, ep_size, max_tokens_per_rank)
    return home(y_NH, send_position_TP, group_name, ep_size)


def dispatch_tokens_backward(grad_x_NH, grad_weights_NK, topk_ids_TK, num_experts, ep_size,
                             group_name, max_tokens_per_rank):
    collectives.rank_in(group_name, ep_size)
    send_position_TP, _ = send_positions(topk_ids_TK, num_experts, ep_size, max_tokens_per_rank)
    return (home(grad_x_NH, send_position_TP, group_name, ep_size),
            home(grad_weights_NK, send_position_TP, group_name, ep_size))


def combine_tokens_backward(grad_out_TH, topk_ids_TK, num_experts, ep_size, group_name,
                            max_tokens_per_rank):
    collectives.rank_in(group_name, ep_size)
    _, token_of_position_N = send_positions(topk_ids_TK, num_experts, ep_size, max_tokens_per_rank)
    return _to_positions(grad_out_TH, token_of_position_N, group_name, ep_size)


def dispatch_tokens_start(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size,
                          group_name, max_tokens_per_rank, chunk, num_chunks):
    collectives.rank_in(group_name, ep_size)
    window = (chunk, max_tokens_per_rank, num_chunks)
    ids_WK = tokens_in_flight.window_rows(topk_ids_TK, *window, fill=-1)
    _, token_of_position_N = send_positions(ids_WK, num_experts, ep_size, max_tokens_per_rank)

    def send(values_WX):
        return _to_positions(values_WX, token_of_position_N, group_name, ep_size,
                             collectives.start_all_to_all)

    return (send(tokens_in_flight.window_rows(hidden_TH, *window)),
            send(routing_columns(ids_WK, tokens_in_flight.window_rows(topk_weights_TK,
                                                                      *window))))


def combine_tokens_start(y_NH, topk_ids_TK, num_experts, ep_size, group_name,
                         max_tokens_per_rank, chunk, num_chunks):
    collectives.rank_in(group_name, ep_size)
    return collectives.start_all_to_all(y_NH, group_name, ep_size)


def combine_tokens_finish(returned_NH, topk_ids_TK, num_experts, ep_size, group_name,
                          max_tokens_per_rank, chunk, num_chunks):
    # M rows whatever the window holds (past T, ids -1: zeros): the chunks' outputs stack to
    # the layer's.
    ids_WK = tokens_in_flight.window_rows(topk_ids_TK, chunk, max_tokens_per_rank, num_chunks,
                                          fill=-1)
    send_position_WP, _ = send_positions(ids_WK, num_experts, ep_size, max_tokens_per_rank)
    return sum_slots(returned_NH, send_position_WP)


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
                     "combine_tokens_start": combine_tokens_start,
                     "combine_tokens_finish": combine_tokens_finish}
IN_FLIGHT_CONTRACTS = tokens_in_flight.contracts(sums_at_home=True)
define_backend_ops(NAMESPACE, IN_FLIGHT_KERNELS, IN_FLIGHT_CONTRACTS)
collectives.trace_in_flight_into_graphs(NAMESPACE, IN_FLIGHT_KERNELS, IN_FLIGHT_CONTRACTS)

REGISTRY.register_a2a(A2ABackend(
    name="all_to_all", namespace=NAMESPACE, supports=collectives.supports,
    description="static-capacity all_to_all_single over torch.distributed (NCCL, gloo)"))
