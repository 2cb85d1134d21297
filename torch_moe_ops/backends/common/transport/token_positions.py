"""Where the tokens format (`ops.tokens`) puts each token, in token order: the layout of the
transports whose gradients recompute positions from ``topk_ids`` alone.

Legend: T tokens on a rank, K experts per token, P ranks, M = max_tokens_per_rank,
N = P * M positions (block p: rank p's), X the width of what is moved.

Block p of a rank's N receive positions holds the tokens of rank p that chose one of this
rank's experts, in rank p's token order, then padding: the token that is the j-th of them
lies at ``p * M + j``. The sender finds that position for each of its tokens and each rank
from its own ``topk_ids`` (`send_positions`), a receiver that got the tokens in some other
order finds it from each one's source token index and local ids (`received_positions`):
the same layout seen from both ends.
"""

from __future__ import annotations

import torch

from torch_moe_ops.backends.common.kernels.rows import (
    gather_index,
    scatter_index,
    scatter_rows,
    sum_slots,
)
from torch_moe_ops.backends.common.transport import collectives


def send_positions(topk_ids_TK, num_experts, ep_size, max_tokens):
    """``(send_position_TP, token_of_position_N)``: where each token goes in each rank's
    block (int32, -1: it does not go there) and the token at each send position (-1:
    padding)."""
    num_tokens = topk_ids_TK.shape[0]
    device = topk_ids_TK.device
    rank_P = torch.arange(ep_size, device=device, dtype=torch.int32)
    ranks_TK = torch.where(topk_ids_TK < 0, -1, topk_ids_TK // (num_experts // ep_size))
    goes_PT = (ranks_TK.unsqueeze(0) == rank_P.view(-1, 1, 1)).any(2)
    # One scan over the P * T flags, rank by rank, not a scan down T of a [T, P] buffer:
    # Inductor (torch 2.11) splits that scan over blocks of T in a kernel with no rank
    # axis, and fails to generate it once it computes the rank there ("list indices must
    # be integers or slices, not NoneType"); this scan has no other axis.
    counted_PT = torch.cumsum(goes_PT.reshape(-1).to(torch.int32), 0).view(goes_PT.shape)
    # The count runs on across ranks: rank p's starts after the flags of the ranks before
    # it, its first token's count less that token's own flag.
    before_P1 = counted_PT[:, :1] - goes_PT[:, :1].long()
    send_position_PT = torch.where(goes_PT, counted_PT - before_P1 - 1
                                   + rank_P.unsqueeze(1) * max_tokens, -1)
    tokens_PT = torch.arange(num_tokens, device=device).expand(ep_size, -1)
    token_of_position_N = scatter_index(tokens_PT.reshape(-1), send_position_PT.reshape(-1),
                                        ep_size * max_tokens)
    send_position_TP = send_position_PT.t().to(torch.int32,
                                               memory_format=torch.contiguous_format)
    return send_position_TP, token_of_position_N


def received_positions(local_NK: torch.Tensor, token_N: torch.Tensor, max_tokens: int
                       ) -> torch.Tensor:
    """``[N]`` int64: for tokens received in any order within their source's block (block p
    of ``token_N`` holds the index each token had on rank p, -1 at padding; ``local_NK`` its
    ids made local, -1 for another rank's expert), the position each one has in token
    order; -1 at padding and for a token that came for none of this rank's experts (a
    transport that routes a skipped slot somewhere sends it)."""
    num_positions = token_N.shape[0]
    device = token_N.device
    source_N = torch.arange(num_positions, device=device) // max_tokens
    came_N = (token_N >= 0) & (local_NK >= 0).any(1)
    # Token t of rank p, key p * M + t: marked where it came, counted in key order per block.
    key_N = torch.where(came_N, source_N * max_tokens + token_N.long(), -1)
    came_PM = scatter_rows(came_N.long().unsqueeze(1), key_N, num_positions).view(-1, max_tokens)
    within_PM = torch.cumsum(came_PM, 1) - 1 + torch.arange(
        0, num_positions, max_tokens, device=device).unsqueeze(1)
    return gather_index(within_PM.view(-1), key_N)


def home(values_NX, send_position_TP, group_name, ep_size):
    """``[T, X]``: each token's rows of ``values`` (``[N, X]`` in token order) from the ranks
    it went to, summed in rank order (fp32)."""
    return sum_slots(collectives.all_to_all(values_NX, group_name, ep_size), send_position_TP)
