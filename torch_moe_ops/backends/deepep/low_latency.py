"""DeepEP's low-latency mode (``Buffer.low_latency_dispatch`` / ``low_latency_combine``, bf16)
behind the rows format: static, no state kept between ops.

DeepEP delivers ``[E_l, Q, H]`` plus a device-side count per expert; the rows of expert
``e`` sit at ``e * Q`` and the padding between experts breaks the rows layout
(``grouped_mm`` takes offsets ``cumsum(count)``, and ``L > R`` when ``K < E_l``), so
dispatch compacts them with one gather, ordered by (expert, key): the order does not
depend on the order messages arrived in. DeepEP does not carry the routing weights, so
dispatch all-gathers every rank's ids and weights (``[G, 2K]`` int32, small at decode
sizes) and reads each row's weight there. ``src_R`` is ``e * Q + key`` and ``expert_id_TK``
(the ops' ``combine_map``) the global expert id of each of this rank's slots: combine
rebuilds DeepEP's handle (``src_info``, ``layout_range``) from them. The gradient of
dispatch is ``low_latency_combine`` plus one ``all_to_all`` of ``[G, E_l]`` routing-weight
gradients; the gradient of combine a second ``low_latency_dispatch``, whose rows are
matched by (expert, key). DeepEP's kernels alternate between two buffers; each captured
dispatch/combine pair keeps that parity. Routing must give each token distinct experts
(as top-k does).

fp8: DeepEP quantizes inside ``low_latency_dispatch(use_fp8=True)``, with one scale per
128 columns only, so ``fp8_group`` with ``block_size[1] == 128`` travels in fp8. Its cast,
``fp8(x * (448 / amax))`` with amax at least 1e-4 and scale ``amax * fp32(1 / 448)``, is
ours (``fp8(x / (amax / 448))``, amax at least 1e-12) up to fp32 rounding, not bit for
bit: an element lands one e4m3 step away where ``x / scale`` falls within an fp32 ulp of a
rounding boundary, a scale one ulp away, and a group whose largest magnitude is below 1e-4
gets a coarser scale. Its scales come column-major (``[E_l, Q, A]`` over ``[E_l, A, Q]``
storage) and are gathered with their rows.

Legend: T tokens on this rank, M = max_tokens_per_rank, H hidden size, K experts per
token, E experts, E_l = E / P experts per rank, P ranks, R rows, Q = P * M positions per
expert, L = E_l * Q, G = P * M tokens of all ranks, token ``t`` of rank ``p`` having the
key ``p * M + t``.
"""

from __future__ import annotations

import torch

from torch_moe_ops.backends.common.kernels.rows import (
    block_of,
    gather_index,
    gather_rows,
    scatter_index,
    scatter_rows,
)
from torch_moe_ops.backends.common.transport import collectives
from torch_moe_ops.backends.deepep.buffer import pad_tokens
from torch_moe_ops.backends.deepep.modes import DTYPE
from torch_moe_ops.backends.deepep.received import received_rows


def _keys(src_info_EQ: torch.Tensor, layout_range_EP: torch.Tensor,
             max_tokens: int) -> torch.Tensor:
    """``[L]`` int64: the key of the token at each position of a low-latency dispatch, -1
    where none is. Rank ``p``'s tokens for expert ``e`` sit at ``[begin, begin + count)``
    (``layout_range``: count in the low, begin in the high 32 bits; the blocks of one
    expert tile ``[0, sum count)`` in arrival order), ``src_info`` is each token's index
    on its rank."""
    num_local, num_positions = src_info_EQ.shape
    ep_size = layout_range_EP.shape[1]
    device = src_info_EQ.device
    count_EP = layout_range_EP & 0xFFFFFFFF
    begin_EP = layout_range_EP >> 32
    # p + 1 where rank p's block starts (empty blocks go to an extra column), then each
    # position takes the rank of the last block that started at or before it.
    start_EX = torch.zeros((num_local, num_positions + 1), dtype=torch.int64, device=device)
    ranks_EP = torch.arange(1, ep_size + 1, device=device).expand(num_local, ep_size)
    start_EX.scatter_(1, torch.where(count_EP > 0, begin_EP, num_positions), ranks_EP)
    position_Q = torch.arange(num_positions, device=device)
    last_start_EQ = torch.where(start_EX[:, :num_positions] > 0, position_Q, 0).cummax(1).values
    rank_EQ = torch.gather(start_EX, 1, last_start_EQ) - 1
    valid_EQ = position_Q < count_EP.sum(1, keepdim=True)
    key_EQ = torch.where(valid_EQ, rank_EQ * max_tokens + src_info_EQ.long(), -1)
    return key_EQ.reshape(-1)


def _position_of_cell(key_L: torch.Tensor, num_positions: int) -> torch.Tensor:
    """``[L]``: for each cell ``e * Q + key``, the position of that token in expert
    ``e``'s block of the dispatch, -1 where it did not come."""
    cells = torch.arange(key_L.shape[0], device=key_L.device)
    expert_L = cells // num_positions
    cell_L = torch.where(key_L < 0, -1, expert_L * num_positions + key_L)
    return scatter_index(cells % num_positions, cell_L, key_L.shape[0])


def send(comm, x_TH: torch.Tensor, ids_TK: torch.Tensor, use_fp8: bool = False):
    """``Buffer.low_latency_dispatch`` of ``x`` (``[T, H]``) to the experts ``ids_TK`` name:
    ``(recv_x, count_E, handle)``, ``recv_x`` the ``[E_l, Q, H]`` blocks (with ``use_fp8``
    DeepEP's pair of fp8 values and scales). An idle rank hands DeepEP one row routed
    nowhere: its kernels take no empty tensor, and the rank joins the exchange."""
    padded = max(ids_TK.shape[0], 1)
    recv_x, count_E, handle, _, _ = comm.buffer.low_latency_dispatch(
        pad_tokens(x_TH, padded, 0), pad_tokens(ids_TK.to(comm.topk_idx_dtype), padded, -1),
        comm.max_tokens_per_rank, comm.num_experts, use_fp8=use_fp8, async_finish=False,
        return_recv_hook=False)
    return recv_x, count_E, handle


def send_back(comm, x_EQH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
              handle) -> torch.Tensor:
    """``Buffer.low_latency_combine`` of the blocks: ``[T, H]``, each token's rows weighted
    by ``weights_TK`` and summed (the idle rank's row padded as `send` pads it)."""
    num_tokens = ids_TK.shape[0]
    padded = max(num_tokens, 1)
    combined_TH, _, _ = comm.buffer.low_latency_combine(
        x_EQH, pad_tokens(ids_TK.to(comm.topk_idx_dtype), padded, -1),
        pad_tokens(weights_TK.float(), padded, 0), handle, async_finish=False,
        return_recv_hook=False)
    return combined_TH[:num_tokens]


def dispatch(comm, hidden_TH, topk_weights_TK, topk_ids_TK, num_rows, spec=None):
    """``Buffer.low_latency_dispatch`` into rows: dispatch's six outputs, then with
    ``spec`` (DeepEP's fp8 cast, `fp8_transport_reason` None) ``x_scale``."""
    top_k = topk_ids_TK.shape[1]
    ep_size, max_tokens, num_local = comm.ep_size, comm.max_tokens_per_rank, comm.num_local_experts
    num_positions = ep_size * max_tokens
    recv_x, _, handle = send(comm, hidden_TH, topk_ids_TK, use_fp8=spec is not None)
    key_L = _keys(handle[0], handle[1], max_tokens)
    position_L = _position_of_cell(key_L, num_positions)
    # Rows in cell order (expert, then key): rows of expert e from its first row on.
    present_EQ = (position_L >= 0).view(num_local, num_positions)
    count_E = present_EQ.sum(1, dtype=torch.int32)
    offset_E = torch.cumsum(count_E, 0) - count_E
    row_L = (offset_E.unsqueeze(1) + torch.cumsum(present_EQ, 1) - 1).masked_fill(
        ~present_EQ, -1).reshape(-1)
    # Rows past the capacity cannot come: dispatch checked it when C is below the worst case.
    row_L = torch.where(row_L < num_rows, row_L, -1)
    cells = torch.arange(key_L.shape[0], device=key_L.device)
    src_R = scatter_index(cells, row_L, num_rows)
    expert_R = block_of(src_R, num_positions)
    position_R = gather_index(position_L, src_R)
    x_RH, *scale = received_rows(
        recv_x, torch.where(src_R < 0, -1, expert_R * num_positions + position_R), spec)
    # DeepEP does not move the routing weights: read each row's in every rank's routing.
    ids_MK = pad_tokens(topk_ids_TK.to(torch.int32), max_tokens, -1)
    weights_MK = pad_tokens(topk_weights_TK.float(), max_tokens, 0).view(torch.int32)
    routing_GX = collectives.all_gather(torch.cat([ids_MK, weights_MK], 1), comm.group_name,
                                        ep_size)
    row_routing_RX = gather_rows(routing_GX, torch.where(src_R < 0, -1, src_R % num_positions))
    row_ids_RK = row_routing_RX[:, :top_k]
    row_weights_RK = row_routing_RX[:, top_k:].contiguous().view(torch.float32)
    chosen_RK = row_ids_RK == (comm.rank * num_local + expert_R).unsqueeze(1)
    weight_R = (row_weights_RK * chosen_RK).sum(1).masked_fill(src_R < 0, 0.0)
    expert_id_TK = topk_ids_TK.to(torch.int32, memory_format=torch.contiguous_format, copy=True)
    return (x_RH, expert_R.to(torch.int32), weight_R, src_R.to(torch.int32), count_E,
            expert_id_TK, *scale)


def _handle(comm, src_R: torch.Tensor):
    """DeepEP's low-latency handle for rows in ``src_R``'s order, and each row's
    position in the ``[E_l, Q]`` block ``low_latency_combine`` reads."""
    ep_size, max_tokens, num_local = comm.ep_size, comm.max_tokens_per_rank, comm.num_local_experts
    num_positions = ep_size * max_tokens
    valid_R = src_R >= 0
    cell_R = src_R.long()
    expert_R = torch.where(valid_R, cell_R // num_positions, num_local)
    key_R = cell_R % num_positions
    rank_R, token_R = key_R // max_tokens, key_R % max_tokens
    ones_R = torch.ones_like(expert_R)
    count_X = torch.zeros(num_local + 1, dtype=torch.int64, device=src_R.device)
    count_E = count_X.scatter_add_(0, expert_R, ones_R)[:num_local]
    offset_E = torch.cumsum(count_E, 0) - count_E
    rows_R = torch.arange(src_R.shape[0], device=src_R.device)
    position_R = rows_R - offset_E[expert_R.clamp(max=num_local - 1)]
    slot_R = torch.where(valid_R, expert_R * num_positions + position_R, -1)
    # Rows of one expert are ordered by key: each rank's block is contiguous.
    pair_R = torch.where(valid_R, expert_R * ep_size + rank_R, num_local * ep_size)
    count_X = torch.zeros(num_local * ep_size + 1, dtype=torch.int64, device=src_R.device)
    count_EP = count_X.scatter_add_(0, pair_R, ones_R)[:-1].view(num_local, ep_size)
    begin_EP = torch.cumsum(count_EP, 1) - count_EP
    layout_range_EP = (begin_EP << 32) | count_EP
    num_cells = num_local * num_positions
    src_info_EQ = scatter_index(token_R, slot_R, num_cells).to(
        torch.int32).view(num_local, num_positions)
    handle = (src_info_EQ, layout_range_EP.contiguous(), max_tokens, comm.hidden_size,
              comm.num_experts)
    return handle, slot_R


def combine(comm, rows_RH, src_R, expert_id_TK):
    """``low_latency_combine`` of the rows: ``[T, H]``, each token's rows summed."""
    num_tokens, top_k = expert_id_TK.shape
    handle, slot_R = _handle(comm, src_R)
    num_cells = comm.num_local_experts * comm.ep_size * comm.max_tokens_per_rank
    x_EQH = scatter_rows(rows_RH.to(DTYPE), slot_R, num_cells).view(
        comm.num_local_experts, -1, comm.hidden_size)
    ones_TK = torch.ones((num_tokens, top_k), dtype=torch.float32, device=rows_RH.device)
    return send_back(comm, x_EQH, expert_id_TK, ones_TK, handle)


def send_out(comm, grad_out_TH, src_R, expert_id_TK):
    """A second ``low_latency_dispatch``, of ``grad_out``: each row's token's gradient."""
    num_positions = comm.ep_size * comm.max_tokens_per_rank
    recv_EQH, _, handle = send(comm, grad_out_TH.to(DTYPE), expert_id_TK)
    position_L = _position_of_cell(_keys(handle[0], handle[1], comm.max_tokens_per_rank),
                                      num_positions)
    position_R = gather_index(position_L, src_R)
    expert_R = block_of(src_R.long(), num_positions)
    return gather_rows(recv_EQH.view(-1, comm.hidden_size),
                       torch.where(position_R < 0, -1, expert_R * num_positions + position_R))


def weight_grads(comm, grad_weight_R, src_R, expert_id_TK):
    """``[T, K]``: each row's routing-weight gradient back to its (token, slot)."""
    num_tokens, _ = expert_id_TK.shape
    ep_size, max_tokens, num_local = comm.ep_size, comm.max_tokens_per_rank, comm.num_local_experts
    num_positions = ep_size * max_tokens
    cell_R = src_R.long()
    key_R, expert_R = cell_R % num_positions, cell_R // num_positions
    target_R = torch.where(src_R < 0, -1, key_R * num_local + expert_R)
    per_key_GE = scatter_rows(grad_weight_R.float().unsqueeze(1), target_R,
                              num_positions * num_local).view(num_positions, num_local)
    # Block p (rank p's tokens) goes home; block q received holds rank q's experts.
    mine_PME = collectives.all_to_all(per_key_GE, comm.group_name, ep_size)
    mine_ME = mine_PME.view(ep_size, max_tokens, num_local).transpose(0, 1).reshape(
        max_tokens, ep_size * num_local)
    ids_TK = expert_id_TK.long()
    grad_TK = torch.gather(mine_ME[:num_tokens], 1, ids_TK.clamp(min=0))
    return grad_TK.masked_fill(ids_TK < 0, 0.0)
