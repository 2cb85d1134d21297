"""Tokens, routing and expert weights that every rank of an expert-parallel test
draws alike, and the slice of them one rank owns.

Legend: N tokens of all ranks, H hidden size, I expert intermediate size,
E experts, K experts per token.
"""

from __future__ import annotations

import torch

ROUTES = ("random", "one_rank")


def draw_problem(seed: int, route: str, num_tokens: int, num_experts: int, world_size: int,
                 hidden: int, inter: int, top_k: int):
    """``(hidden_NH, topk_weights_NK, topk_ids_NK, experts)`` in fp32 on the CPU;
    ``experts`` maps w13, w2, b13, b2 to every expert's tensor. ``route``:
    ``"random"`` (every third token skips its last slot) or ``"one_rank"``
    (every slot goes to rank 0's experts)."""
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    gen = torch.Generator().manual_seed(seed)
    hidden_NH = torch.randn(num_tokens, hidden, generator=gen)
    scores_NE = torch.rand(num_tokens, num_experts, generator=gen)
    if route == "one_rank":
        scores_NE[:, num_experts // world_size:] = -1.0
    topk_weights_NK, topk_ids_NK = scores_NE.topk(top_k, dim=-1)
    topk_ids_NK = topk_ids_NK.to(torch.int32)
    if route == "random":
        topk_ids_NK[::3, -1] = -1
    experts = {
        "w13": torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5,
        "w2": torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5,
        "b13": torch.randn(num_experts, 2 * inter, generator=gen) / 4,
        "b2": torch.randn(num_experts, hidden, generator=gen) / 4,
    }
    return hidden_NH, topk_weights_NK, topk_ids_NK, experts


def token_slice(tokens_per_rank, rank: int) -> slice:
    """The rows of all ranks' tokens that belong to ``rank``."""
    return slice(sum(tokens_per_rank[:rank]), sum(tokens_per_rank[:rank + 1]))
