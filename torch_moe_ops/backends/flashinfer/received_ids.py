"""The expert ids a rank's experts read after a FlashInfer dispatch, in one Triton kernel.

Legend: P ranks, M = max_tokens_per_rank, N = P * M receive positions, K experts per token.

A dispatch leaves each position's ``[K]`` global ids (the token's routing, sent as a payload)
in the workspace; positions past the count of tokens that came from their block hold what
earlier calls left there. The experts read local ids, -1 for a slot that is not theirs.
FlashInfer's round trip writes -1 at those positions with its own kernel
(``moe_a2a_sanitize_expert_ids``, reading the receive counters); here the same pass also
makes the ids local, so the tokens transport runs no more kernels than FlashInfer's
own. On one H100 a round trip of 128 tokens (H=7168, K=8) took 16.3-20.9 us; the lookup
this replaced (an int64 copy of the ids and a gather) added about 7 us to it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch_moe_ops.backends.common.kernels.launch import cdiv

BLOCK = 1024


@triton.jit
def _local_ids_kernel(ids_ptr, counts_ptr, out_ptr, num_slots, top_k, max_tokens, first_local,
                      num_local, BLOCK: tl.constexpr):
    slot = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = slot < num_slots
    position = slot // top_k
    source = position // max_tokens
    came = position - source * max_tokens < tl.load(counts_ptr + source, mask=inside, other=0)
    local = tl.load(ids_ptr + slot, mask=inside, other=-1) - first_local
    mine = came & (local >= 0) & (local < num_local)
    tl.store(out_ptr + slot, tl.where(mine, local, -1), mask=inside)


def local_ids(ids_NK: torch.Tensor, recv_counts_P: torch.Tensor, max_tokens_per_rank: int,
              first_local: int, num_local: int) -> torch.Tensor:
    """``[N, K]`` int32: ``ids - first_local`` where that is in ``[0, num_local)`` and the
    position holds a token (its index within block p below ``recv_counts[p]``), else -1.

    ``ids_NK`` int32 (contiguous), ``recv_counts_P`` int32: the tokens each rank sent here.
    """
    out_NK = torch.empty_like(ids_NK, memory_format=torch.contiguous_format)
    num_slots = ids_NK.numel()
    if num_slots:
        _local_ids_kernel[(cdiv(num_slots, BLOCK),)](
            ids_NK, recv_counts_P, out_NK, num_slots, ids_NK.shape[1], max_tokens_per_rank,
            first_local, num_local, BLOCK=BLOCK)
    return out_NK
