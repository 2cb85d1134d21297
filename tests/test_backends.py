"""Every experts backend against the reference backend, the oracle.

Small problems (fp32, fp16) run on the CPU, or on CUDA where there is one, for
every registered experts backend that runs there, plus the backends made of
Triton kernels (the `triton` marker): on the CPU they run under the Triton
interpreter, the grouped_mm backend's GEMMs through torch._grouped_mm's host
loop (its `supports` keeps it out of real use there; the arithmetic is the
same). On a GPU every available backend also runs in bf16 with larger shapes.
"""

from __future__ import annotations

import pytest
import torch

import torch_moe_ops as tmo
from torch_moe_ops.backends.registry import REGISTRY, Problem

ACTIVATIONS = ("silu", "gelu", "swiglu_oai")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Made of Triton kernels: they run where the `triton` marker lets them, whatever
# their `supports` says of the device.
TRITON_BACKENDS = ("triton", "grouped_mm")
# The Triton interpreter mishandles bf16: bf16 runs in the GPU tests.
SMALL_DTYPES = {torch.float32: 1e-5, torch.float16: 5e-3}


def small_problem_backends(dtypes=tuple(SMALL_DTYPES)) -> list:
    """``(namespace, dtype)`` of every experts backend but the oracle, on DEVICE;
    each one skips with its own reason where it does not run."""
    params = []
    for backend in REGISTRY.experts.values():
        if backend.name == "reference":
            continue
        for dtype in dtypes:
            marks = [pytest.mark.triton] if backend.name in TRITON_BACKENDS else []
            reason = backend.supports(tmo.BackendSpec(experts=backend.name), Problem(dtype), DEVICE)
            if not marks and reason is not None:
                marks = [pytest.mark.skip(reason=f"{backend.name}: {reason}")]
            params.append(pytest.param(backend.namespace, dtype, marks=marks,
                                       id=f"{backend.name}-{str(dtype).removeprefix('torch.')}"))
    return params


def make_inputs(num_tokens, hidden, inter, num_experts, top_k, dtype, device, bias, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device, dtype)

    hidden_TH = randn(num_tokens, hidden)
    w13_EFH = randn(num_experts, 2 * inter, hidden, scale=hidden ** -0.5)
    w2_EHI = randn(num_experts, hidden, inter, scale=inter ** -0.5)
    b13_EF = randn(num_experts, 2 * inter, scale=0.1) if bias else None
    b2_EH = randn(num_experts, hidden, scale=0.1) if bias else None
    scores_TE = torch.rand(num_tokens, num_experts, generator=generator)
    topk_ids_TK = scores_TE.topk(top_k, dim=-1).indices.to(torch.int32)
    # Skip every fifth slot, as padding rows and experts of other ranks do.
    topk_ids_TK.view(-1)[::5] = -1
    topk_weights_TK = torch.rand(num_tokens, top_k, generator=generator)
    return (hidden_TH, topk_weights_TK.to(device), topk_ids_TK.to(device), w13_EFH, w2_EHI,
            b13_EF, b2_EH)


def relative_error(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-12)).item()


def run_both(namespace, args, act, rows=False):
    static = (act, 1.702, 7.0)
    if not rows:
        return (getattr(torch.ops, namespace).experts(*args, *static),
                torch.ops.moe_reference.experts(*args, *static))
    hidden_TH, weights_TK, ids_TK, *weights = args
    x_RH, expert_R, _, _, count_E, _ = torch.ops.moe.dispatch(hidden_TH, weights_TK, ids_TK,
                                                              weights[0].shape[0])
    y_RH = getattr(torch.ops, namespace).experts_rows(x_RH, expert_R, count_E, *weights, *static)
    return y_RH, torch.ops.moe_reference.experts_rows(x_RH, expert_R, count_E, *weights, *static)


@pytest.mark.parametrize("namespace,dtype", small_problem_backends())
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [False, True])
def test_small_problems_match_reference(namespace, dtype, act, bias, rows, poisoned_empty):
    # Every buffer a backend allocates starts as NaN: a row it does not write
    # (skipped rows included, which must come out as 0) fails the comparison.
    args = make_inputs(9, 32, 16, 4, 2, dtype, DEVICE, bias)
    out, ref = run_both(namespace, args, act, rows)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert relative_error(out, ref) < SMALL_DTYPES[dtype]


@pytest.mark.parametrize("namespace,dtype", small_problem_backends([torch.float32]))
def test_zero_tokens(namespace, dtype):
    args = make_inputs(0, 32, 16, 4, 2, dtype, DEVICE, True)
    out = getattr(torch.ops, namespace).experts(*args, "silu", 1.702, 7.0)
    assert out.shape == (0, 32)


@pytest.mark.triton
def test_grouped_mm_rejects_unaligned_sizes():
    args = make_inputs(3, 12, 16, 4, 2, torch.float32, DEVICE, False)
    with pytest.raises(ValueError, match="needs H and I divisible by 8, got H=12, I=16"):
        torch.ops.moe_grouped_mm.experts(*args, "silu", 1.702, 7.0)
    with pytest.raises(ValueError, match="needs H and I divisible by 8, got H=12, I=16"):
        torch.ops.moe_grouped_mm.experts_backward(torch.randn(3, 12), *args, "silu", 1.702, 7.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks about CUDA where torch has none")
def test_available_backends_for_cuda_without_cuda_says_why():
    table = tmo.available_backends("cuda")
    reasons = {status.name: status.reason for status in table if status.kind == "experts"}
    assert reasons["grouped_mm"] == "needs a CUDA GPU of sm90 or newer, this torch sees none"
    if reasons["triton"] != "triton is not installed (pip install triton)":
        assert reasons["triton"] == "needs a CUDA GPU, this torch sees none"
    routes = {status.name: status for status in table if status.kind == "route"}
    assert routes["reference"].available
    assert routes["flashinfer"].reason == "needs a CUDA device, this torch sees none"
    assert all(status.available or status.reason for status in table)


def gpu_backends():
    if not torch.cuda.is_available():
        return []
    device = torch.device("cuda")
    return [b.namespace for b in REGISTRY.experts.values()
            if b.name != "reference"
            and b.supports(tmo.BackendSpec(), Problem(torch.bfloat16), device) is None]


GPU_SHAPES = {  # (T, H, I, E, K)
    "mixtral-like": (256, 4096, 1024, 8, 2),
    "qwen3-like": (130, 2048, 768, 128, 8),
    "gpt-oss-like": (64, 2880, 2880, 32, 4),
}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
@pytest.mark.parametrize("rows", [False, True])
def test_gpu_matches_reference(shape, rows):
    num_tokens, hidden, inter, num_experts, top_k = GPU_SHAPES[shape]
    bias = shape == "gpt-oss-like"
    act = "swiglu_oai" if bias else "silu"
    namespaces = gpu_backends()
    assert namespaces, "no GPU experts backend is available"
    args = make_inputs(num_tokens, hidden, inter, num_experts, top_k, torch.bfloat16, "cuda",
                       bias)
    for namespace in namespaces:
        out, ref = run_both(namespace, args, act, rows)
        assert not out.isnan().any(), namespace
        assert relative_error(out, ref) < 2e-2, namespace


@pytest.mark.gpu
def test_gpu_backends_capture_in_cuda_graph():
    args = make_inputs(64, 1024, 512, 16, 4, torch.bfloat16, "cuda", True)
    for namespace in gpu_backends():
        op = getattr(torch.ops, namespace).experts
        static = ("silu", 1.702, 7.0)
        hidden_TH = args[0].clone()
        op(hidden_TH, *args[1:], *static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_TH = op(hidden_TH, *args[1:], *static)
        fresh_TH = torch.randn_like(hidden_TH)
        hidden_TH.copy_(fresh_TH)
        out_TH.fill_(float("nan"))
        graph.replay()
        ref_TH = torch.ops.moe_reference.experts(fresh_TH, *args[1:], *static)
        assert relative_error(out_TH, ref_TH) < 2e-2, namespace


@pytest.mark.triton
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="exercises the prefill hand-off on the CPU, under the interpreter")
@pytest.mark.parametrize("rows", [False, True])
def test_triton_hands_prefill_to_grouped_mm(monkeypatch, rows):
    from torch_moe_ops.backends.common.kernels import grouped_gemm
    from torch_moe_ops.backends.triton import configs, fused

    calls = []
    monkeypatch.setattr(grouped_gemm, "supports", lambda *args: None)
    for name in ("experts", "experts_rows"):
        real = getattr(grouped_gemm, name)
        monkeypatch.setattr(grouped_gemm, name,
                            lambda *a, real=real, name=name: calls.append(name) or real(*a))
    # 9 tokens * 2 slots over 4 experts: 4.5 rows per expert, over a threshold of 4.
    monkeypatch.setattr(configs, "GROUPED_MM_MIN_ROWS_PER_EXPERT", 4)
    # Uncached, so the lowered threshold decides.
    monkeypatch.setattr(fused, "get_config", configs.get_config.__wrapped__)
    args = make_inputs(9, 32, 16, 4, 2, torch.float32, "cpu", True)
    out, ref = run_both("moe_triton", args, "swiglu_oai", rows)
    assert calls == ["experts_rows" if rows else "experts"]
    assert relative_error(out, ref) < 1e-5


LISTED_SHAPES = {  # (E, K, H, I, activation, bias): the benchmark's real model shapes
    "mixtral-8x7b": (8, 2, 4096, 14336, "silu", False),
    "qwen3-30b-a3b": (128, 8, 2048, 768, "silu", False),
    "olmoe": (64, 8, 2048, 1024, "silu", False),
    "gpt-oss-20b": (32, 4, 2880, 2880, "swiglu_oai", True),
    "deepseek-v3": (256, 8, 7168, 2048, "silu", False),
}


def _draw_real_shape(shape):
    """A seeded CUDA generator, a bf16 drawer on it and the expert weights
    ``(w13, w2, b13, b2)`` of ``LISTED_SHAPES[shape]`` drawn with it."""
    num_experts, _, hidden, inter, _, bias = LISTED_SHAPES[shape]
    generator = torch.Generator(device="cuda").manual_seed(0)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, device="cuda", generator=generator) * scale).to(torch.bfloat16)

    weights = (randn(num_experts, 2 * inter, hidden, scale=hidden ** -0.5),
               randn(num_experts, hidden, inter, scale=inter ** -0.5),
               randn(num_experts, 2 * inter, scale=0.1) if bias else None,
               randn(num_experts, hidden, scale=0.1) if bias else None)
    return generator, randn, weights


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(LISTED_SHAPES))
def test_gpu_real_shapes_match_reference(shape, poisoned_empty):
    """Every GPU backend at real model shapes, T in {1, 16, 256, 4096}, bf16, with
    every buffer the backends allocate poisoned (NaN), so an unwritten row fails."""
    num_experts, top_k, hidden, _, act, _ = LISTED_SHAPES[shape]
    generator, randn, weights = _draw_real_shape(shape)
    for num_tokens in (1, 16, 256, 4096):
        hidden_TH = randn(num_tokens, hidden)
        logits_TE = torch.randn(num_tokens, num_experts, device="cuda", generator=generator)
        topk_weights_TK, topk_ids_TK = torch.ops.moe.route(logits_TE, None, top_k, "softmax",
                                                           True, 1, 1, 1.0)
        args = (hidden_TH, topk_weights_TK, topk_ids_TK, *weights, act, 1.702, 7.0)
        ref_TH = torch.ops.moe_reference.experts(*args)
        for namespace in gpu_backends():
            out_TH = getattr(torch.ops, namespace).experts(*args)
            error = relative_error(out_TH, ref_TH)
            assert error < 2e-2, (namespace, num_tokens, error)


def own_backward_gpu_backends() -> list:
    """The namespaces of the GPU backends whose bf16 gradient is their own here."""
    device, problem = torch.device("cuda"), Problem(torch.bfloat16)
    return [b.namespace for b in REGISTRY.experts.values()
            if b.namespace in gpu_backends()
            and b.backward_runs(tmo.BackendSpec(), problem, device) == "own"]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["mixtral-8x7b", "qwen3-30b-a3b", "olmoe", "gpt-oss-20b"])
def test_gpu_real_shapes_backward_matches_reference(shape, poisoned_empty):
    """Each GPU backend's own gradient at real model widths, a few tokens (so that
    many experts get no rows: their gradients must be exactly 0), every fifth slot
    skipped, every buffer the backends allocate poisoned (NaN)."""
    num_experts, top_k, hidden, _, act, _ = LISTED_SHAPES[shape]
    namespaces = own_backward_gpu_backends()
    assert namespaces, "no GPU experts backend has its own gradient here"
    generator, randn, weights = _draw_real_shape(shape)
    for num_tokens in (1, 16, 256):
        logits_TE = torch.randn(num_tokens, num_experts, device="cuda", generator=generator)
        topk_weights_TK, topk_ids_TK = torch.ops.moe.route(logits_TE, None, top_k, "softmax",
                                                           True, 1, 1, 1.0)
        topk_ids_TK.view(-1)[::5] = -1
        args = (randn(num_tokens, hidden), randn(num_tokens, hidden), topk_weights_TK,
                topk_ids_TK, *weights, act, 1.702, 7.0)
        expected = torch.ops.moe_reference.experts_backward(*args)
        ids = topk_ids_TK[topk_ids_TK >= 0].long()
        empty_E = torch.bincount(ids, minlength=num_experts) == 0
        for namespace in namespaces:
            grads = getattr(torch.ops, namespace).experts_backward(*args)
            for index, (grad, want) in enumerate(zip(grads, expected)):
                assert grad.shape == want.shape and grad.dtype == want.dtype
                if want.numel():
                    # bf16's gradient tolerance elsewhere too: with one token the
                    # routing weights' gradient is three bf16 dot products of
                    # length H, and one off by 1e-2 relative moves the norm that much.
                    error = relative_error(grad, want)
                    assert error < 3e-2, (namespace, num_tokens, index, error)
            for grad in grads[2:]:
                assert grad.numel() == 0 or (grad[empty_E] == 0).all(), namespace


@pytest.mark.gpu
def test_gpu_backward_captures_in_cuda_graph_and_is_deterministic():
    args = make_inputs(64, 1024, 512, 16, 4, torch.bfloat16, "cuda", True)
    static = ("swiglu_oai", 1.702, 7.0)
    for namespace in own_backward_gpu_backends():
        op = getattr(torch.ops, namespace).experts_backward
        grad_out_TH = torch.randn_like(args[0])
        first = op(grad_out_TH, *args, *static)
        assert all(torch.equal(a, b) for a, b in zip(first, op(grad_out_TH, *args, *static)))
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            grads = op(grad_out_TH, *args, *static)
        fresh_TH = torch.randn_like(grad_out_TH)
        grad_out_TH.copy_(fresh_TH)
        for grad in grads:
            grad.fill_(float("nan"))
        graph.replay()
        expected = torch.ops.moe_reference.experts_backward(fresh_TH, *args, *static)
        for grad, want in zip(grads, expected):
            assert relative_error(grad, want) < 2e-2, namespace
