"""Tokens, routing and expert weights that every rank of an expert-parallel test
draws alike, the slice of them one rank owns, and the checks of what one rank gets: by op
(outputs, gradients), replayed from a CUDA graph, and through a compiled layer.

Legend: N tokens of all ranks, H hidden size, I expert intermediate size,
E experts, K experts per token, R rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import torch_moe_ops as tmo
from torch_moe_ops import quant
from torch_moe_ops.backends.registry import REGISTRY, Problem
from torch_moe_ops.config import BackendSpec
from torch_moe_ops.lowering import moe_op_sequence

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


def on_current_gpu(hidden_NH, topk_weights_NK, topk_ids_NK, experts):
    """`draw_problem`'s output on the current CUDA device: activations and experts (a list:
    w13, w2, b13, b2) in bf16, routing weights fp32."""
    device = torch.device("cuda", torch.cuda.current_device())
    return (hidden_NH.to(device, torch.bfloat16), topk_weights_NK.to(device),
            topk_ids_NK.to(device), [w.to(device, torch.bfloat16) for w in experts.values()])


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


def check_graph_replays(pipeline, draw, mine: slice, local: slice, static_args) -> None:
    """``pipeline(hidden_TH, topk_weights_TK, topk_ids_TK, experts)`` (this rank's tokens and
    experts; returns its ``[T, H]``) captured once in a CUDA graph (static input buffers,
    warm-up on a side stream) and replayed on new problems from ``draw(seed, route)`` (in
    `on_current_gpu`'s form): ``moe_reference::experts``' output (activation arguments
    ``static_args``) for this rank's tokens."""
    hidden_NH, weights_NK, ids_NK, full = draw(11, "random")
    experts = [w[local] for w in full]
    static = [hidden_NH[mine].clone(), weights_NK[mine].clone(), ids_NK[mine].clone()]
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                pipeline(*static, experts)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the NCCL watchdog thread may query events while this thread captures.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out_TH = pipeline(*static, experts)
        for seed, route in ((12, "random"), (13, "one_rank"), (14, "random")):
            hidden_NH, weights_NK, ids_NK, _ = draw(seed, route)
            for target, source in zip(static, (hidden_NH, weights_NK, ids_NK)):
                target.copy_(source[mine])
            out_TH.fill_(float("nan"))
            graph.replay()
            ref_NH = torch.ops.moe_reference.experts(hidden_NH, weights_NK, ids_NK, *full,
                                                     *static_args)
            check_bf16_out(out_TH, ref_NH[mine])
        del graph
    torch.cuda.synchronize()


def cpu_single_and_sharded(hidden: int, inter: int, top_k: int, max_tokens: int,
                           seed: int = 5):
    """The single-process fp32 `MoE` on the CPU (2 experts per rank, renormalized top-k) and
    this rank's shard of it over the default group, with the same full weights."""
    torch.manual_seed(seed)
    world_size = dist.get_world_size()
    cfg = dict(hidden_size=hidden, intermediate_size=inter, num_experts=2 * world_size,
               top_k=top_k, renormalize=True)
    single = tmo.MoE(tmo.MoEConfig(**cfg))
    sharded = tmo.MoE(tmo.MoEConfig(**cfg, ep_size=world_size, max_tokens_per_rank=max_tokens),
                      ep_group=dist.group.WORLD)
    sharded.load_full_weights(single.state_dict())
    return single, sharded


def single_and_sharded(moe_config, seed: int):
    """The single-process `MoE` of ``moe_config(1)`` (bf16, the current GPU) and this rank's
    shard of it, ``moe_config(P)`` over the default group of P ranks, with the same full
    weights; Dynamo's caches reset."""
    torch._dynamo.reset()
    torch.manual_seed(seed)
    device = torch.device("cuda", torch.cuda.current_device())
    # Built on the CPU so that every rank draws the same weights.
    single = tmo.MoE(moe_config(1)).to(device, torch.bfloat16)
    sharded = tmo.MoE(moe_config(dist.get_world_size()), device=device, dtype=torch.bfloat16,
                      ep_group=dist.group.WORLD)
    sharded.load_full_weights(single.state_dict())
    return single, sharded


def route_op(moe: tmo.MoE) -> str:
    """The route op ``route="auto"`` lowers ``moe``'s routing to on its device (the
    reference, or a faster one that computes the layer's routing)."""
    cfg = moe.cfg
    problem = Problem(dtype=torch.float32, num_experts=cfg.num_experts, top_k=cfg.top_k,
                      scoring=cfg.scoring, renormalize=cfg.renormalize,
                      num_expert_groups=cfg.num_expert_groups, topk_groups=cfg.topk_groups,
                      correction_bias=moe.e_score_correction_bias is not None)
    route = REGISTRY.choose_route(BackendSpec(), problem, moe.gate.weight.device)
    return f"{route.namespace}::route"


def recording_backend(sequences: list, **options):
    """``tmo.backend(**options)``, appending each lowered graph's op sequence to
    ``sequences``."""
    inner = tmo.backend(**options)

    def backend(gm, example_inputs):
        compiled = inner(gm, example_inputs)
        sequences.append(moe_op_sequence(gm))
        return compiled

    return backend


def trained_and_served(single, sharded, x_NH, mine: slice, **options) -> tuple[str, str]:
    """``sharded`` compiled with ``tmo.backend(inner="aot_eager", **options)`` on this rank's
    tokens ``x_NH[mine]``: with gradients (output and input gradient), then without
    (output), each against ``single`` on every token (bf16 bounds). Returns the lowered op
    sequences of the two (with gradients, without)."""
    x_ref = x_NH.clone().requires_grad_()
    ref_NH = single(x_ref)
    ref_NH.float().square().sum().backward()
    sequences = []
    compiled = torch.compile(sharded, backend=recording_backend(sequences, inner="aot_eager",
                                                                **options),
                             fullgraph=True, dynamic=False)
    x_TH = x_NH[mine].clone().requires_grad_()
    out_TH = compiled(x_TH)
    out_TH.float().square().sum().backward()
    check_bf16_out(out_TH, ref_NH[mine].detach())
    check_bf16_grad(x_TH.grad, x_ref.grad[mine])
    trained = sequences[-1]
    torch._dynamo.reset()
    with torch.no_grad():
        out_TH = compiled(x_NH[mine])
    check_bf16_out(out_TH, ref_NH[mine].detach())
    return trained, sequences[-1]


class TwoLayers(torch.nn.Module):
    """``h + moe(h)`` twice: two layers of one shape, which share a transport's state."""

    def __init__(self, cfg: tmo.MoEConfig, **kwargs):
        super().__init__()
        self.layers = torch.nn.ModuleList(tmo.MoE(cfg, **kwargs) for _ in range(2))

    def forward(self, h_TH: torch.Tensor) -> torch.Tensor:
        for moe in self.layers:
            h_TH = h_TH + moe(h_TH)
        return h_TH


def check_layers_train(single, sharded, compiled, inputs, mine: slice, check) -> None:
    """``compiled`` (``sharded`` compiled) trained on this rank's tokens of each of
    ``inputs`` (``[N, H]``, one step each, ``requires_grad`` as given) against ``single``
    (a module of the same `MoE` layers on one process) on all of them: the outputs, the
    input's gradient and every trained parameter's (an expert's on the rank that holds it;
    the router's, which every rank holds, summed over the ranks); ``check(actual,
    expected)`` asserts. Gradients are zeroed between steps."""
    for x_NH in inputs:
        x_ref = x_NH.detach().clone().requires_grad_(x_NH.requires_grad)
        single(x_ref).float().square().sum().backward()
        x_TH = x_NH.detach()[mine].clone().requires_grad_(x_NH.requires_grad)
        out_TH = compiled(x_TH)
        out_TH.float().square().sum().backward()
        check(out_TH, single(x_NH.detach())[mine].detach())
        if x_NH.requires_grad:
            check(x_TH.grad, x_ref.grad[mine])
        for one, shard in zip(single.layers, sharded.layers, strict=True):
            local = shard.local_experts
            for name, param in shard.named_parameters():
                if not param.requires_grad:
                    continue
                grad, expected = param.grad, one.get_parameter(name).grad
                if name in ("w13", "w2", "b13", "b2"):
                    expected = expected[local.start:local.stop]
                else:
                    grad = grad.clone()
                    dist.all_reduce(grad)
                check(grad, expected)
            one.zero_grad()
            shard.zero_grad()
