"""Slots grouped by expert, on the device, with static shapes.

Legend: T tokens, K experts per token, E experts, R = T * K rows (one per slot),
S = T * K slots.
"""

from __future__ import annotations

import torch


def sort_rows(topk_ids_TK: torch.Tensor, num_experts: int):
    """Group the T*K (token, slot) pairs by expert, skipped slots last.

    The sort is stable, so the rows of one expert keep token order and the
    result is deterministic. Returns ``order_R`` (int64: row r holds flattened
    slot ``order_R[r]``), ``sorted_ids_R`` (int64, -1 for skipped rows) and
    ``count_E`` (int32).
    """
    ids_R = topk_ids_TK.reshape(-1).long()
    sort_key_R = torch.where(ids_R < 0, num_experts, ids_R)
    order_R = torch.sort(sort_key_R, stable=True).indices
    count_X = torch.zeros(num_experts + 1, dtype=torch.int32, device=topk_ids_TK.device)
    count_X.scatter_add_(0, sort_key_R, torch.ones_like(sort_key_R, dtype=torch.int32))
    return order_R, ids_R[order_R], count_X[:num_experts]


def rows_of_slots(order_R: torch.Tensor) -> torch.Tensor:
    """``row_of_slot_S`` (int32): the row each flattened slot sits in, the inverse
    of `sort_rows`'s ``order_R`` (a permutation: the scatter's targets are distinct)."""
    row_of_slot_S = torch.empty_like(order_R, dtype=torch.int32)
    row_of_slot_S[order_R] = torch.arange(order_R.numel(), dtype=torch.int32,
                                          device=order_R.device)
    return row_of_slot_S
