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


def leaves(*tensors):
    """Detached copies that require grad: the inputs of one side of a comparison."""
    return [t.detach().clone().requires_grad_() for t in tensors]


def assert_close_scaled(actual, expected, rtol: float, atol: float) -> None:
    """``assert_close`` in fp64 with ``atol`` relative to ``expected``'s largest
    magnitude (at least 1): low-precision outputs are judged against their scale."""
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol * scale)


def check_bf16_out(actual, expected) -> None:
    """A bf16 output against the fp32 reference."""
    assert_close_scaled(actual, expected, 2e-2, 2e-2)


def check_bf16_grad(actual, expected) -> None:
    """A gradient of a bf16 computation against the fp32 reference."""
    assert_close_scaled(actual, expected, 3e-2, 3e-2)


def assert_rank_matches(out_TH, ours, ref_NH, ref_leaves, mine: slice, local: slice,
                        check_out, check_grad) -> None:
    """This rank's output and gradients against the single-process reference on all
    tokens. ``ours`` and ``ref_leaves`` are ``[hidden, topk_weights, *experts]``
    leaves (this rank's tokens and experts, and everyone's); ``mine`` selects this
    rank's tokens, ``local`` its experts; ``check_out`` / ``check_grad`` are
    ``(actual, expected)`` assertions."""
    check_out(out_TH, ref_NH[mine].detach())
    check_grad(ours[0].grad, ref_leaves[0].grad[mine])
    check_grad(ours[1].grad, ref_leaves[1].grad[mine])
    for leaf, ref in zip(ours[2:], ref_leaves[2:]):
        check_grad(leaf.grad, ref.grad[local])
