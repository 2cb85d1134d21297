"""The ``flashinfer`` backend's trainable tokens transport against FlashInfer's own round
trip, for benchmarks/bench_ep_train.py.

Legend: P ranks, T tokens per rank (M = max_tokens_per_rank = T), N = P * M receive
positions, H hidden size, K experts per token, E experts.

A layer that trains moves its tokens twice per step through FlashInfer's all-to-all, each
time one dispatch answered by one combine (`torch_moe_ops.backends.flashinfer.a2a.
trainable_tokens`): the forward pair (``dispatch_tokens`` + ``combine_tokens`` of the
received tokens untouched: the copies out of the workspace in token order and back) and
the backward pair (``combine_tokens_backward`` + ``dispatch_tokens_backward``: the same
moves for the gradients, and the routing weights' gradients home by one ``all_to_all`` of
``[N, K]`` fp32). Each pair is captured in a CUDA graph and timed as benchmarks/bench_ep.py
times transports, against ``MoeAlltoAll.dispatch`` + ``.combine`` of the same payloads
(`bench_ep.time_flashinfer_raw`); target: each pair within `TARGET` times it.
"""

from __future__ import annotations

import bench_ep
import torch

from torch_moe_ops.backends.registry import REGISTRY, Problem
from torch_moe_ops.config import BackendSpec

TARGET = 1.3
NAME = "flashinfer"


def reason(run: bench_ep.Run, problem: Problem) -> str | None:
    """Why the flashinfer backend cannot run ``problem`` here, or None."""
    return REGISTRY.a2a[NAME].supports(BackendSpec(a2a=NAME), problem, run.device)


def measure(run: bench_ep.Run, hidden: int, inter: int, top_k: int, num_experts: int,
            tokens: int) -> dict:
    """The forward and backward pairs' microseconds, each against MoeAlltoAll's round trip,
    with their relative errors (tokens sent and summed back untouched: each token times the
    ranks it went to)."""
    sizes = bench_ep.Sizes(hidden=hidden, inter=inter, top_k=top_k, experts=(num_experts,),
                           tokens=(tokens,), layer_experts=num_experts, layer_tokens=(tokens,),
                           replays=run.args.replays)
    hidden_TH, weights_TK, ids_TK = bench_ep.random_routing(run, sizes, tokens, num_experts,
                                                            seed=1)
    grad_TH = torch.randn_like(hidden_TH)
    grad_weights_NK = torch.zeros(run.world * tokens, top_k, device=run.device)
    ops = torch.ops.moe_flashinfer_a2a_trainable
    ep_args = (run.world, run.group_name, tokens)

    def forward():
        x_NH, _, _ = ops.dispatch_tokens(hidden_TH, weights_TK, ids_TK, num_experts, *ep_args)
        return ops.combine_tokens(x_NH, ids_TK, num_experts, *ep_args)

    def backward():
        grad_x_NH = ops.combine_tokens_backward(grad_TH, ids_TK, num_experts, *ep_args)
        return ops.dispatch_tokens_backward(grad_x_NH, grad_weights_NK, ids_TK, num_experts,
                                            *ep_args)[0]

    errors = [bench_ep.relative_error(pair(), bench_ep.round_trip_expected(
        values_TH, ids_TK, num_experts, run.world))
        for pair, values_TH in ((forward, hidden_TH), (backward, grad_TH))]
    replays = [run.capture(pair)[0] for pair in (forward, backward)]
    forward_s, backward_s = run.time(replays)
    # The graphs, then the workspace, freed before MoeAlltoAll allocates its own.
    del replays
    run.release()
    bench_ep.release_communicators(NAME)
    raw_us = bench_ep.time_flashinfer_raw(run, sizes, (num_experts, tokens))["total_us"]
    return {"forward_us": forward_s * 1e6, "backward_us": backward_s * 1e6,
            "moe_alltoall_us": raw_us, "forward_vs_moe_alltoall": forward_s * 1e6 / raw_us,
            "backward_vs_moe_alltoall": backward_s * 1e6 / raw_us, "target": TARGET,
            "rel_err_forward": errors[0], "rel_err_backward": errors[1]}


def table(rows: list[dict]) -> str:
    """The transport rows (each with ``shape`` and ``tokens``) as a markdown table."""
    lines = [("| shape | T/rank | forward pair us | backward pair us | MoeAlltoAll round trip "
              f"us | forward / it | backward / it (target <= {TARGET}) | rel err fwd / bwd | "
              "error |"), "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['tokens']} | - | - | - | - | - | - | "
                         f"{r['error']} |")
            continue
        lines.append(f"| {r['shape']} | {r['tokens']} | {r['forward_us']:.1f} | "
                     f"{r['backward_us']:.1f} | {r['moe_alltoall_us']:.1f} | "
                     f"{r['forward_vs_moe_alltoall']:.2f} | {r['backward_vs_moe_alltoall']:.2f} | "
                     f"{r['rel_err_forward']:.1e} / {r['rel_err_backward']:.1e} | |")
    return "\n".join(lines)
