"""Tokens, routing and expert weights that every rank of an expert-parallel test
draws alike, the slice of them one rank owns, and the checks of what one rank gets.

Legend: N tokens of all ranks, H hidden size, I expert intermediate size,
E experts, K experts per token, R rows.
"""

from __future__ import annotations

import torch

from torch_moe_ops import quant

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


def assert_quantized_dispatch(dispatched, dispatched_quant, spec, one_fp8_step=False) -> None:
    """``dispatch_quant``'s outputs against ``dispatch``'s on the same input, its rows
    quantized by the oracle (`quant.quantize_activations`): the routing equal, and the
    kept rows (expert != -1) bit for bit; or, where a transport quantizes with a cast
    of its own (``one_fp8_step``), values at most one e4m3 step apart (under 1% of
    them differing) and scales two fp32 ulps apart."""
    x_RH, *routing = dispatched
    q_RH, *quant_routing, x_scale = dispatched_quant
    assert q_RH.dtype == quant.FP8_DTYPE and x_scale.dtype == torch.float32
    for got, expected in zip(quant_routing, routing, strict=True):
        assert torch.equal(got, expected)
    kept_R = routing[0] >= 0
    # Bytes: float8 has no indexing or equality on the CPU.
    got_q = q_RH.view(torch.uint8)[kept_R]
    got_scale = x_scale[kept_R]
    expected_q, expected_scale = quant.quantize_activations(x_RH[kept_R], spec)
    expected_q = expected_q.view(torch.uint8)
    if not one_fp8_step:
        assert torch.equal(got_q, expected_q) and torch.equal(got_scale, expected_scale)
        return
    torch.testing.assert_close(got_scale, expected_scale, rtol=2.4e-7, atol=0)
    theirs = quant.dequantize_activations(got_q.view(quant.FP8_DTYPE), got_scale, spec)
    ours = quant.dequantize_activations(expected_q.view(quant.FP8_DTYPE), expected_scale, spec)
    num_rows, hidden = theirs.shape
    group = quant.activation_group(spec, hidden)
    scale_RH = expected_scale.reshape(num_rows, -1).repeat_interleave(group, dim=1)
    # One e4m3 step: at most 1/8 of the value (3 mantissa bits), 2**-9 of the scale
    # among the subnormals.
    step_RH = 0.125 * x_RH[kept_R].float().abs() + 2.0 ** -9 * scale_RH
    assert ((theirs - ours).abs() <= step_RH * 1.001).all()
    assert (got_q != expected_q).float().mean().item() < 0.01
