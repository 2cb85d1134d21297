"""The routing that travels beside each token in the tokens format.

Legend: T tokens sent, N tokens received, H hidden size, K experts per token.

Each token's K expert ids and K routing weights travel as 2K int32 columns (a weight's
fp32 bits as int32; an id as id + 1, so that the zeros of padding arrive as id -1). Where a
message is small, a collective's latency outweighs its bytes: the columns then ride in the
rows' own message (as columns of the rows' dtype), and the received rows are copied out of
it; where it is large, that copy would cost more than a second collective, which they take.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torch_moe_ops.backends.common.transport import collectives

# Above this many bytes of rows in one message, the routing takes a message of its own.
ONE_MESSAGE_BYTES = 16 * 2**20


def routing_columns(topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> torch.Tensor:
    """``[T, 2K]`` int32: ids + 1, then the weights' bits."""
    return torch.cat([topk_ids_TK.to(torch.int32) + 1,
                      topk_weights_TK.float().view(torch.int32)], 1)


def received_routing(columns_NX: torch.Tensor, top_k: int, rank: int, num_local: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [N, K] fp32, ids [N, K] int32 made local to ``rank``'s ``num_local``
    experts: -1 for another rank's expert, a skipped slot and padding)``."""
    return (columns_NX[:, top_k:].contiguous().view(torch.float32),
            local_ids(columns_NX[:, :top_k] - 1, rank, num_local))


def local_ids(ids_NK: torch.Tensor, rank: int, num_local: int) -> torch.Tensor:
    """``ids_NK`` (global, -1: skipped) made local to ``rank``'s ``num_local`` experts: -1 for
    another rank's expert and a skipped slot."""
    local_NK = ids_NK - rank * num_local
    return torch.where((ids_NK >= 0) & (local_NK >= 0) & (local_NK < num_local), local_NK, -1)


def send_with_routing(send: Callable[[torch.Tensor], torch.Tensor], rows_TH: torch.Tensor,
                      columns_TX: torch.Tensor, received_rows: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(send(rows), send(columns))``, in one message where ``received_rows`` rows of
    ``rows``' width are few bytes (`ONE_MESSAGE_BYTES`). ``send`` moves ``[T, ...]`` to
    ``[N, ...]`` (a collective and whatever gather goes with it); it sees no row's value."""
    hidden = rows_TH.shape[1]
    if received_rows * hidden * rows_TH.element_size() > ONE_MESSAGE_BYTES:
        return send(rows_TH), send(columns_TX)
    packed_NX = send(torch.cat([rows_TH, columns_TX.view(rows_TH.dtype)], 1))
    return (packed_NX[:, :hidden].contiguous(),
            packed_NX[:, hidden:].contiguous().view(torch.int32))


def finish_dispatch(routing_NX: torch.Tensor, num_experts: int, ep_size: int, group_name: str,
                    max_tokens_per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``dispatch_tokens_finish`` kernel (`ops.tokens_in_flight`) of every transport that
    sends the routing columns in a message of their own: `received_routing` of what arrived."""
    rank = collectives.rank_in(group_name, ep_size)
    return received_routing(routing_NX, routing_NX.shape[1] // 2, rank, num_experts // ep_size)
