"""Moving rows between the frames of dispatch and combine, with static shapes.

Legend: T tokens, H hidden size, K experts per token, R rows, N rows of
another frame (slots, send or receive positions), an index of -1 means "none".

Every helper is a gather, or a scatter whose targets are distinct (each row
has one place to go), so results do not depend on the order threads run in.
"""

from __future__ import annotations

import torch

from torch_moe_ops.ops.checks import compute_dtype


def block_of(index_N: torch.Tensor, block_size: int) -> torch.Tensor:
    """``index // block_size``, keeping -1 ("none"): the token of a slot index
    (``t * K + k``, blocks of K), the expert of a per-expert cell."""
    return torch.where(index_N < 0, -1, index_N // block_size)


def gather_rows(values_NH: torch.Tensor, index_R: torch.Tensor) -> torch.Tensor:
    """``out[r] = values[index[r]]``, zeros where ``index[r] == -1``."""
    missing_R1 = (index_R < 0).unsqueeze(1)
    if values_NH.shape[0] == 0:
        return values_NH.new_zeros((index_R.shape[0], values_NH.shape[1]))
    taken_RH = values_NH[index_R.clamp(min=0).long()]
    return taken_RH.masked_fill(missing_R1, 0)


def scatter_rows(rows_RH: torch.Tensor, index_R: torch.Tensor, size: int) -> torch.Tensor:
    """``out[index[r]] = rows[r]`` in a ``[size, ...]`` zero buffer; rows with
    index -1 go nowhere. The targets of the other rows are distinct."""
    out_NH = rows_RH.new_zeros((size + 1, *rows_RH.shape[1:]))
    # Rows that go nowhere land on one extra row, dropped after.
    out_NH.index_copy_(0, torch.where(index_R < 0, size, index_R).long(), rows_RH)
    return out_NH[:size]


def scatter_index(values_N: torch.Tensor, index_N: torch.Tensor, size: int) -> torch.Tensor:
    """``out[index[n]] = values[n]`` in a ``[size]`` buffer of -1, for index
    values (-1: none); ``scatter_index(arange(N), index, size)`` inverts ``index``."""
    return scatter_rows(values_N.unsqueeze(1) + 1, index_N, size)[:, 0] - 1


def gather_index(values_N: torch.Tensor, index_R: torch.Tensor) -> torch.Tensor:
    """``out[r] = values[index[r]]`` for index values, -1 where ``index[r] == -1``."""
    return gather_rows(values_N.unsqueeze(1) + 1, index_R)[:, 0] - 1


def sum_slots(values_NH: torch.Tensor, row_of_slot_TK: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k values[row_of_slot[t, k]]`` (-1 adds nothing), summed in
    slot order in fp32 (fp64 for fp64), returned in ``values``' dtype."""
    num_tokens, top_k = row_of_slot_TK.shape
    out_TH = values_NH.new_zeros((num_tokens, values_NH.shape[1]),
                                 dtype=compute_dtype(values_NH.dtype))
    for k in range(top_k):
        out_TH += gather_rows(values_NH, row_of_slot_TK[:, k])
    return out_TH.to(values_NH.dtype)


def weighted_rows(y_RH: torch.Tensor, weight_R: torch.Tensor, src_R: torch.Tensor
                  ) -> torch.Tensor:
    """``weight[r] * y[r]`` in ``y``'s dtype (multiplied in fp32 or wider, one pass
    over the rows), weight 0 for rows that go nowhere (``src == -1``)."""
    kept_R1 = weight_R.masked_fill(src_R < 0, 0.0).unsqueeze(1)
    return torch.mul(y_RH, kept_R1, out=torch.empty_like(y_RH))


def combine_grads(grad_RH: torch.Tensor, y_RH: torch.Tensor, weight_R: torch.Tensor,
                  src_R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of `weighted_rows` given each row's output gradient
    ``grad_RH``: ``(weight * grad, sum_h y * grad)``, zero for rows that go nowhere."""
    dtype = compute_dtype(y_RH.dtype)
    grad_y_RH = weighted_rows(grad_RH, weight_R, src_R).to(y_RH.dtype)
    grad_weight_R = (y_RH.to(dtype) * grad_RH.to(dtype)).sum(-1).float()
    return grad_y_RH, grad_weight_R.masked_fill(src_R < 0, 0.0)


def masked_valid(count_E: torch.Tensor, rows_per_expert: int) -> torch.Tensor:
    """``[E, C, 1]`` bool: which rows of each expert's block of the masked format
    (`ops.masked`) carry a token, C = ``rows_per_expert``."""
    position_C = torch.arange(rows_per_expert, device=count_E.device)
    return (position_C < count_E.unsqueeze(1)).unsqueeze(2)


def masked_to_rows(count_E: torch.Tensor, rows_per_expert: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows format of the masked format's blocks: ``(expert_R, cell_R)``, int32, R = E * C.

    Row ``r`` is cell ``cell_R[r] = e * C + c`` of the ``[E * C]`` blocks (the rows that carry
    a token, grouped by expert in block order, as the rows format groups them), -1 with
    expert -1 from ``sum(count_E)`` on; `gather_rows` and `scatter_rows` move rows between
    the two frames. Sizes depend on E and C alone: no host sync.
    """
    num_experts = count_E.shape[0]
    ends_E = torch.cumsum(count_E.long(), 0)
    row_R = torch.arange(num_experts * rows_per_expert, device=count_E.device)
    expert_R = torch.searchsorted(ends_E, row_R, right=True)
    carried_R = expert_R < num_experts
    expert_R = expert_R.clamp(max=num_experts - 1)
    cell_R = expert_R * rows_per_expert + row_R - (ends_E - count_E)[expert_R]
    return (torch.where(carried_R, expert_R, -1).to(torch.int32),
            torch.where(carried_R, cell_R, -1).to(torch.int32))
