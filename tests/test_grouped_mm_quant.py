"""The grouped_mm backend's quantized experts (`common.kernels.scaled_grouped_gemm`): fp8
w8a8 with rowwise scales through ``torch._scaled_grouped_mm``.

Legend: T tokens, H hidden size, I expert intermediate size, F = 2 * I, E experts,
K experts per token, R rows, M rows and N output columns of one GEMM.

On the CPU: what `supports` says of every format, device, dtype and size; the
quantization and scale steps against the reference quantizers
(`torch_moe_ops.quant`); and both ops, opcheck included, under the Triton
interpreter with ``torch._scaled_grouped_mm`` replaced by `stand_in`, which
checks its arguments with torch's own meta kernel (layouts, scale shapes,
dtypes, offsets) and multiplies in fp32. The stand-in writes fp32 where the real
kernel writes bf16 (the interpreter mishandles bf16): the one difference.

On an sm90 GPU (``gpu`` marker): ``torch._scaled_grouped_mm`` itself on this
layout (empty and unaligned groups, rows past the last offset), both ops against
the reference in bf16 at real widths with -1 ids and empty experts,
CUDA-graph capture and replay, and a quantized `tmo.MoE` compiled with
``backend(experts="grouped_mm")``.

Error bounds, as relative Frobenius errors against ``moe_reference``, which
reads the same fp8 weights and rounds each GEMM's input through fp8 as well:

- CPU, fp32 (`CPU_BOUND`): the same fp8 operands and fp32 products; only
  summation order and the last bits of the activation differ.
- GPU, bf16 (`GPU_BOUND`): the GEMMs write bf16 and the intermediate is rounded
  to bf16 before fp8, which moves about 1 in 64 of its values to the fp8
  neighbour of the reference's (both half an fp8 step from the exact value):
  about 1% over many rows; over one token's few rows a flipped value weighs
  more (2.1% measured on an H200 for one DeepSeek-like token), so 3%. Against
  the exact product with the dequantized weights and unquantized activations,
  the backend must be as close as the reference is (`NO_WORSE_THAN_REFERENCE`).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code

import torch_moe_ops as tmo
from conftest import FP8_CPU_OPCHECK_UTILS, why_not_after
from torch_moe_ops import quant
from torch_moe_ops.backends.common.kernels import scaled_grouped_gemm
from torch_moe_ops.backends.registry import REGISTRY, Problem
from torch_moe_ops.config import BackendSpec, QuantSpec

CPU_BOUND = 1e-4
GPU_BOUND = 3e-2
# Our error against the unquantized result over the reference's, plus a floor.
NO_WORSE_THAN_REFERENCE = (1.25, 2e-3)
STATIC = ("silu", 1.702, 7.0)
RUNNING_FORMATS = {"fp8_channel": QuantSpec("fp8_channel"), "fp8_tensor": QuantSpec("fp8_tensor")}
FP8_CHANNEL = RUNNING_FORMATS["fp8_channel"]
CUDA = torch.device("cuda")
BACKEND = REGISTRY.experts["grouped_mm"]


def relative_error(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-12)).item()


def problem(spec=FP8_CHANNEL, dtype=torch.bfloat16, hidden=4096, inter=1024,
            num_local=8) -> Problem:
    return Problem(dtype, num_experts=num_local, num_local_experts=num_local,
                   hidden_size=hidden, intermediate_size=inter, top_k=2, quant=spec)


WEIGHT_ONLY = ("(weight-only fp8): torch._scaled_grouped_mm multiplies fp8 activations by "
               "fp8 weights")
FORMAT_REASONS = {  # spec: what supports says on an sm90 GPU
    QuantSpec("fp8_channel"): None,
    QuantSpec("fp8_tensor"): None,
    QuantSpec("fp8_block"): ("does not run fp8_block128x128+fp8_group: "
                             "torch._scaled_grouped_mm scales by row and by output channel, "
                             "not by weight block"),
    QuantSpec("mxfp4"): ("does not run mxfp4+none: torch._scaled_grouped_mm multiplies fp8 by "
                         "fp8 and has no mxfp4 weight-only path on sm90"),
    QuantSpec("fp8_channel", "none"): f"does not run fp8_channel+none {WEIGHT_ONLY}",
    QuantSpec("fp8_tensor", "none"): f"does not run fp8_tensor+none {WEIGHT_ONLY}",
}


@pytest.mark.parametrize("spec", list(FORMAT_REASONS), ids=lambda spec: spec.name)
def test_supports_says_which_formats_run(sm90, spec):
    reason = BACKEND.why_not(BackendSpec(experts="grouped_mm"), problem(spec), CUDA)
    assert reason == FORMAT_REASONS[spec]


NOT_SM90 = "needs sm90 for fp8 (torch._scaled_grouped_mm's rowwise kernel is built for sm90 alone)"
NOT_ALIGNED = "needs hidden_size and intermediate_size divisible by 16 for fp8"
NOT_BF16 = ("needs bfloat16 activations with fp8 weights (torch._scaled_grouped_mm writes "
            "bfloat16 only)")
TOO_MANY = "needs fewer than 1024 local experts for fp8 (torch._scaled_grouped_mm's groups)"
WHY_NOT = {  # id: (what differs from an sm90 GPU, bf16, H=4096, I=1024, E=8), reason
    "cpu": ({"device": torch.device("cpu")}, "needs a CUDA GPU of sm90 for fp8, got device cpu"),
    "sm89": ({"sm": (8, 9)}, f"{NOT_SM90}, got sm89"),
    "sm100": ({"sm": (10, 0)}, f"{NOT_SM90}, got sm100"),
    "fp16": ({"dtype": torch.float16}, f"{NOT_BF16}, got torch.float16"),
    "H": ({"hidden": 4104}, f"{NOT_ALIGNED}, got 4104 and 1024"),
    "I": ({"inter": 1032}, f"{NOT_ALIGNED}, got 4096 and 1032"),
    "E": ({"num_local": 1024}, f"{TOO_MANY}, got 1024"),
}


@pytest.mark.parametrize("case", list(WHY_NOT))
def test_supports_says_why_not(sm90, case):
    changes, reason = WHY_NOT[case]
    assert why_not_after(BACKEND, problem, sm90, changes) == reason


def test_supports_without_scaled_grouped_mm(sm90, monkeypatch):
    monkeypatch.delattr(torch, "_scaled_grouped_mm")
    assert BACKEND.why_not(BackendSpec(), problem(), CUDA) == (
        f"needs torch._scaled_grouped_mm for fp8, which torch {torch.__version__} lacks")


def test_unquantized_problems_keep_their_reasons(sm90):
    assert BACKEND.why_not(BackendSpec(), problem(spec=None), CUDA) is None
    assert BACKEND.why_not(BackendSpec(), problem(spec=None, dtype=torch.float16), CUDA) == (
        "needs bfloat16 (other dtypes loop on the host), got torch.float16")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("transposed", [False, True])
def test_quantize_rows_is_the_reference_quantizer(generator, dtype, transposed):
    x_MK = (torch.randn((37, 48), generator=generator) * 3).to(dtype)
    x_MK[5] = 0  # the smallest scale, values 0
    x_MK[6, 7] = 1e4  # clamps nothing: the scale follows the maximum
    if transposed:
        x_MK = x_MK.t().contiguous().t()
    q_MK, scale_M = scaled_grouped_gemm.quantize_rows(x_MK)
    want_q, want_scale = quant.quantize_activations(x_MK, QuantSpec("fp8_channel"))
    assert q_MK.dtype == quant.FP8_DTYPE and q_MK.is_contiguous()
    assert scale_M.dtype == torch.float32 and scale_M.shape == (37,)
    assert torch.equal(q_MK.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale_M, want_scale)


@pytest.mark.parametrize("weight_format", sorted(RUNNING_FORMATS))
def test_channel_scales_dequantize_exactly(generator, weight_format):
    spec = RUNNING_FORMATS[weight_format]
    w_ENK = torch.randn((3, 32, 48), generator=generator)
    q_ENK, scale = quant.quantize_weights(w_ENK, spec)
    scale_EN = scaled_grouped_gemm.channel_scales(scale, weight_format, 32)
    assert scale_EN.shape == (3, 32) and scale_EN.dtype == torch.float32
    assert scale_EN.is_contiguous()
    assert torch.equal(q_ENK.float() * scale_EN[:, :, None],
                       quant.dequantize_weights(q_ENK, scale, spec))


def _on_meta(t):
    return t.to("meta") if isinstance(t, torch.Tensor) else t


def stand_in(mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, scale_result=None,
             out_dtype=None, use_fast_accum=False):
    """``torch._scaled_grouped_mm`` in plain PyTorch (2D ``mat_a``, 3D ``mat_b``):
    the arguments go through torch's meta kernel first, which checks them as the
    CUDA kernel does; rows past the last offset come out NaN (unwritten), the
    others in fp32."""
    meta = torch.ops.aten._scaled_grouped_mm.default(
        *map(_on_meta, (mat_a, mat_b, scale_a, scale_b)), offs=_on_meta(offs),
        bias=_on_meta(bias), scale_result=_on_meta(scale_result), out_dtype=out_dtype,
        use_fast_accum=use_fast_accum)
    assert out_dtype == torch.bfloat16 and not use_fast_accum
    out_MN = torch.full(tuple(meta.shape), math.nan)
    start = 0
    for expert, end in enumerate(offs.tolist()):
        a_mK = mat_a[start:end].float() * scale_a[start:end, None]
        out_MN[start:end] = a_mK @ (mat_b[expert].float() * scale_b[expert])
        start = end
    return out_MN


@pytest.fixture
def gemm_calls(monkeypatch) -> list:
    """``torch._scaled_grouped_mm`` is `stand_in`; the list gets one entry per call."""
    calls = []
    monkeypatch.setattr(torch, "_scaled_grouped_mm",
                        lambda *args, **kwargs: calls.append(args[0].shape) or stand_in(
                            *args, **kwargs))
    return calls


def test_stand_in_checks_the_layout():
    # The meta kernel behind the stand-in refuses what the CUDA kernel refuses.
    q_MK = torch.zeros((4, 32), dtype=quant.FP8_DTYPE)
    w_ENK = torch.zeros((2, 16, 32), dtype=quant.FP8_DTYPE)
    ends_E = torch.tensor([1, 4], dtype=torch.int32)
    scale_M, scale_EN = torch.ones(4), torch.ones(2, 16)
    out_MN = stand_in(q_MK, w_ENK.transpose(-2, -1), scale_M, scale_EN, ends_E,
                      out_dtype=torch.bfloat16)
    assert out_MN.shape == (4, 16)
    with pytest.raises(RuntimeError, match="column major"):
        stand_in(q_MK, w_ENK.transpose(-2, -1).contiguous(), scale_M, scale_EN, ends_E,
                 out_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="row major"):
        stand_in(q_MK.t().contiguous().t(), w_ENK.transpose(-2, -1), scale_M, scale_EN,
                 ends_E, out_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="2D tensor"):
        stand_in(q_MK, w_ENK.transpose(-2, -1), scale_M, torch.ones(2), ends_E,
                 out_dtype=torch.bfloat16)


def cpu_inputs(quant_inputs, weight_format, num_tokens=9, bias=False, skip_fraction=0.2):
    """Small fp32 inputs (H=64, I=32, E=4, K=2) with expert 1 chosen by no slot."""
    inputs = quant_inputs(RUNNING_FORMATS[weight_format], num_tokens=num_tokens,
                          hidden_size=64, intermediate_size=32, num_experts=4, top_k=2,
                          bias=bias, skip_fraction=skip_fraction)
    ids_TK = inputs.float_inputs.topk_ids_TK
    ids_TK.masked_fill_(ids_TK == 1, -1)
    return inputs


def op_args(op_name, inputs) -> tuple:
    """The arguments of ``op_name`` (``experts_rows_quant_prequantized``: of
    ``experts_rows_quant`` on rows quantized by dispatch, fp8 with their scales)."""
    if op_name == "experts_quant":
        return inputs.args(*STATIC)
    f = inputs.float_inputs
    x_RH, expert_R, _, _, count_E, _ = torch.ops.moe.dispatch(
        f.hidden_TH, f.topk_weights_TK, f.topk_ids_TK, inputs.w13.shape[0])
    if op_name == "experts_rows_quant":
        return (x_RH, None, expert_R, count_E, *inputs.weight_args(*STATIC))
    x_q_RH, x_scale_R = quant.quantize_activations(x_RH, inputs.spec)
    return (x_q_RH, x_scale_R, expert_R, count_E, *inputs.weight_args(*STATIC), x_RH.dtype)


def op(namespace: str, op_name: str):
    return getattr(getattr(torch.ops, namespace), op_name.removesuffix("_prequantized"))


def run_both(op_name, inputs):
    """``(ours, reference)`` of ``op_name`` (see `op_args`)."""
    args = op_args(op_name, inputs)
    return op("moe_grouped_mm", op_name)(*args), op("moe_reference", op_name)(*args)


OP_NAMES = ["experts_quant", "experts_rows_quant", "experts_rows_quant_prequantized"]
# The stand-in's tests launch the Triton epilogues on CPU tensors, which only the
# interpreter runs (set where there is no GPU); on a GPU the real kernel is tested.
INTERPRETER_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(), reason="runs Triton kernels on CPU tensors under the "
    "interpreter; with a GPU the test_gpu_* tests run torch._scaled_grouped_mm itself")


@INTERPRETER_ONLY
@pytest.mark.triton
@pytest.mark.parametrize("op_name", OP_NAMES)
@pytest.mark.parametrize("weight_format", sorted(RUNNING_FORMATS))
@pytest.mark.parametrize("bias", [False, True])
def test_ops_match_reference_on_cpu(quant_inputs, gemm_calls, poisoned_empty, op_name,
                                    weight_format, bias):
    inputs = cpu_inputs(quant_inputs, weight_format, bias=bias)
    out, ref = run_both(op_name, inputs)
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous()
    assert relative_error(out, ref) < CPU_BOUND
    assert len(gemm_calls) == 2


@pytest.mark.triton
@pytest.mark.parametrize("op_name", OP_NAMES)
def test_zero_tokens_run_no_gemm(quant_inputs, gemm_calls, op_name):
    out, ref = run_both(op_name, cpu_inputs(quant_inputs, "fp8_channel", num_tokens=0))
    assert out.shape == ref.shape == (0, 64) and out.dtype == ref.dtype
    assert gemm_calls == []


@INTERPRETER_ONLY
@pytest.mark.triton
def test_all_slots_skipped(quant_inputs, gemm_calls):
    out, ref = run_both("experts_quant", cpu_inputs(quant_inputs, "fp8_tensor",
                                                    skip_fraction=1.0))
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(ref, out)


@INTERPRETER_ONLY
@pytest.mark.triton
@pytest.mark.parametrize("op_name", OP_NAMES)
@pytest.mark.parametrize("num_tokens", [0, 9])
def test_opcheck_on_cpu(quant_inputs, gemm_calls, op_name, num_tokens):
    args = op_args(op_name, cpu_inputs(quant_inputs, "fp8_channel", num_tokens=num_tokens,
                                       bias=True))
    torch.library.opcheck(op("moe_grouped_mm", op_name).default, args,
                          test_utils=FP8_CPU_OPCHECK_UTILS)


@pytest.mark.triton
@pytest.mark.parametrize("spec, match", [
    (QuantSpec("fp8_block", block_size=(32, 32)), "does not run fp8_block32x32"),
    (QuantSpec("fp8_channel", "none"), r"does not run fp8_channel\+none"),
])
def test_ops_refuse_formats_they_do_not_run(quant_inputs, spec, match):
    inputs = quant_inputs(spec, num_tokens=3, hidden_size=64, intermediate_size=32)
    with pytest.raises(ValueError, match=f"experts backend 'grouped_mm' {match}"):
        torch.ops.moe_grouped_mm.experts_quant(*inputs.args(*STATIC))


@pytest.mark.triton
def test_ops_refuse_sizes_the_gemm_cannot_take(quant_inputs):
    inputs = quant_inputs(QuantSpec("fp8_channel"), num_tokens=3, hidden_size=40,
                          intermediate_size=32)
    with pytest.raises(ValueError, match="needs H and I divisible by 16 for fp8, got H=40, "
                                         "I=32"):
        torch.ops.moe_grouped_mm.experts_quant(*inputs.args(*STATIC))


# GPU: sm90 with torch._scaled_grouped_mm.


def _needs_sm90() -> None:
    """Skips off sm90; on sm90 the backend must run, and says why not if it does not."""
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        pytest.skip(f"torch._scaled_grouped_mm's rowwise fp8 runs on sm90, this is "
                    f"sm{major}{minor}")
    reason = BACKEND.why_not(BackendSpec(), problem(), CUDA)
    assert reason is None, reason


GPU_SHAPES = {  # (H, I, E, K, activation, bias), T per shape below
    "mixtral-like": (4096, 14336, 4, 2, "silu", False),
    "deepseek-like": (7168, 2048, 16, 8, "silu", False),
    "gpt-oss-like": (2880, 2880, 8, 4, "swiglu_oai", True),
}
GPU_TOKENS = (1, 37, 300)


def gpu_inputs(spec, hidden, inter, num_experts, top_k, bias, seed=0):
    """Weights quantized on the GPU (``[E, F, H]``, ``[E, H, I]``), bf16 biases, the
    dequantized fp32 weights, and ``route(num_tokens)``: bf16 tokens and their
    routing, every fifth slot -1, expert 0 (and E/2 from E=8 on) chosen by none."""
    generator = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*size, scale=1.0):
        return torch.randn(*size, device="cuda", generator=generator) * scale

    w13, w13_scale = quant.quantize_weights(randn(num_experts, 2 * inter, hidden,
                                                  scale=hidden ** -0.5), spec)
    w2, w2_scale = quant.quantize_weights(randn(num_experts, hidden, inter,
                                                scale=inter ** -0.5), spec)
    b13 = randn(num_experts, 2 * inter, scale=0.5).bfloat16() if bias else None
    b2 = randn(num_experts, hidden, scale=0.5).bfloat16() if bias else None
    empty = [0] + ([num_experts // 2] if num_experts >= 8 else [])

    def route(num_tokens):
        logits_TE = randn(num_tokens, num_experts)
        logits_TE[:, empty] = -math.inf
        weights_TK, ids_TK = torch.ops.moe.route(logits_TE, None, top_k, "softmax", True, 1, 1,
                                                 1.0)
        ids_TK.view(-1)[::5] = -1
        return randn(num_tokens, hidden).bfloat16(), weights_TK, ids_TK

    weights = (w13, w2, w13_scale, w2_scale, b13, b2, spec.weights, spec.activations,
               spec.block_list)
    dequantized = (quant.dequantize_weights(w13, w13_scale, spec),
                   quant.dequantize_weights(w2, w2_scale, spec),
                   None if b13 is None else b13.float(), None if b2 is None else b2.float())
    return weights, dequantized, route


@pytest.mark.gpu
def test_gpu_scaled_grouped_mm_takes_this_layout():
    """The kernel itself on `scaled_grouped_gemm`'s layout: empty groups first and
    in the middle, groups whose sizes are no multiple of 16, rows past the last
    offset (not compared: left unwritten)."""
    _needs_sm90()
    generator = torch.Generator(device="cuda").manual_seed(0)
    sizes_E = [0, 3, 37, 0, 20, 1]
    num_rows, cols, rows = sum(sizes_E) + 11, 256, 512
    x_MK = torch.randn(num_rows, cols, device="cuda", generator=generator)
    q_MK, scale_M = scaled_grouped_gemm.quantize_rows(x_MK)
    w_ENK = torch.randn(len(sizes_E), rows, cols, device="cuda", generator=generator)
    w_q_ENK, w_scale_EN = quant.quantize_weights(w_ENK, QuantSpec("fp8_channel"))
    ends_E = torch.tensor(sizes_E, device="cuda").cumsum(0).to(torch.int32)
    out_MN = scaled_grouped_gemm.scaled_grouped_mm(q_MK, scale_M, w_q_ENK, w_scale_EN, ends_E)
    assert out_MN.shape == (num_rows, rows) and out_MN.dtype == torch.bfloat16
    expert_M = torch.repeat_interleave(torch.arange(len(sizes_E), device="cuda"),
                                       torch.tensor(sizes_E, device="cuda"))
    a_MK = q_MK[:len(expert_M)].float() * scale_M[:len(expert_M), None]
    w_MNK = w_q_ENK.float()[expert_M] * w_scale_EN[expert_M][:, :, None]
    want_MN = torch.einsum("mk,mnk->mn", a_MK, w_MNK)
    # bf16 output: half a bf16 step (2**-9) of each value at most.
    assert relative_error(out_MN[:len(expert_M)], want_MN) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("weight_format", sorted(RUNNING_FORMATS))
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
def test_gpu_ops_match_reference(poisoned_empty, shape, weight_format):
    _needs_sm90()
    hidden, inter, num_experts, top_k, act, bias = GPU_SHAPES[shape]
    spec = RUNNING_FORMATS[weight_format]
    weights, dequantized, route = gpu_inputs(spec, hidden, inter, num_experts, top_k, bias)
    static = (act, 1.702, 7.0)
    for num_tokens in GPU_TOKENS:
        hidden_TH, weights_TK, ids_TK = route(num_tokens)
        args = (hidden_TH, weights_TK, ids_TK, *weights, *static)
        out_TH = torch.ops.moe_grouped_mm.experts_quant(*args)
        ref_TH = torch.ops.moe_reference.experts_quant(*args)
        exact_TH = torch.ops.moe_reference.experts(hidden_TH.float(), weights_TK, ids_TK,
                                                   *dequantized, *static)
        assert out_TH.dtype == torch.bfloat16 and not out_TH.isnan().any()
        error, ref_error = relative_error(out_TH, ref_TH), relative_error(ref_TH, exact_TH)
        assert error < GPU_BOUND, (num_tokens, error)
        ratio, floor = NO_WORSE_THAN_REFERENCE
        assert relative_error(out_TH, exact_TH) < ratio * ref_error + floor, (num_tokens,
                                                                              ref_error)

        x_RH, expert_R, _, _, count_E, _ = torch.ops.moe.dispatch(hidden_TH, weights_TK,
                                                                  ids_TK, num_experts)
        x_q_RH, x_scale_R = quant.quantize_activations(x_RH, spec)
        for rows in ((x_RH, None), (x_q_RH, x_scale_R)):
            out_dtype = () if rows[1] is None else (torch.bfloat16,)
            rows_args = (*rows, expert_R, count_E, *weights, *static, *out_dtype)
            out_RH = torch.ops.moe_grouped_mm.experts_rows_quant(*rows_args)
            ref_RH = torch.ops.moe_reference.experts_rows_quant(*rows_args)
            assert out_RH.dtype == torch.bfloat16 and not out_RH.isnan().any()
            assert torch.equal(out_RH[expert_R < 0], torch.zeros_like(out_RH[expert_R < 0]))
            error = relative_error(out_RH, ref_RH)
            assert error < GPU_BOUND, (num_tokens, rows[0].dtype, error)


@pytest.mark.gpu
def test_gpu_ops_capture_in_cuda_graph():
    _needs_sm90()
    spec = QuantSpec("fp8_channel")
    weights, _, route = gpu_inputs(spec, 1024, 512, 16, 4, bias=True)
    hidden_TH, weights_TK, ids_TK = route(64)
    x_RH, expert_R, _, _, count_E, _ = torch.ops.moe.dispatch(hidden_TH, weights_TK, ids_TK, 16)
    static_inputs = (hidden_TH, weights_TK, ids_TK, x_RH, expert_R, count_E)

    def run():
        return (torch.ops.moe_grouped_mm.experts_quant(hidden_TH, weights_TK, ids_TK, *weights,
                                                       *STATIC),
                torch.ops.moe_grouped_mm.experts_rows_quant(x_RH, None, expert_R, count_E,
                                                            *weights, *STATIC))

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = run()
    fresh_hidden, fresh_weights, fresh_ids = route(64)
    fresh_rows = torch.ops.moe.dispatch(fresh_hidden, fresh_weights, fresh_ids, 16)
    fresh = (fresh_hidden, fresh_weights, fresh_ids, fresh_rows[0], fresh_rows[1], fresh_rows[4])
    for tensor, new in zip(static_inputs, fresh):
        tensor.copy_(new)
    for out in outputs:
        out.fill_(math.nan)
    graph.replay()
    want = (torch.ops.moe_reference.experts_quant(*fresh[:3], *weights, *STATIC),
            torch.ops.moe_reference.experts_rows_quant(fresh[3], None, *fresh[4:], *weights,
                                                       *STATIC))
    for out, ref in zip(outputs, want):
        assert relative_error(out, ref) < GPU_BOUND


def _quantized_moe(spec=FP8_CHANNEL) -> tmo.MoE:
    cfg = tmo.MoEConfig(hidden_size=1024, intermediate_size=512, num_experts=16, top_k=4,
                        renormalize=True, quant=spec)
    torch.manual_seed(0)
    return tmo.MoE(cfg, device="cuda", dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("weight_format", sorted(RUNNING_FORMATS))
def test_gpu_compiled_moe_traces_the_scaled_gemms(weight_format):
    """One graph (fullgraph), the experts traced in: Inductor runs the scaled GEMMs
    and its own fused quantization; the same routing as the reference's graph."""
    _needs_sm90()
    moe = _quantized_moe(RUNNING_FORMATS[weight_format])
    x_TH = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    expected = torch.compile(moe, backend=tmo.backend(experts="reference"), fullgraph=True)
    compiled = torch.compile(moe, backend=tmo.backend(experts="grouped_mm"), fullgraph=True)
    with torch.no_grad():
        ref_TH = expected(x_TH)
        out_TH, codes = run_and_get_code(compiled, x_TH)
    code = "\n".join(codes)
    assert "moe_grouped_mm.experts_quant" not in code and "_scaled_grouped_mm" in code
    assert relative_error(out_TH, ref_TH) < GPU_BOUND


@pytest.mark.gpu
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.xfail(strict=True, reason="H200, torch 2.11 (2026-11-23): the second token count "
                   "compiles a second frame here, with the reference compiled first as well, "
                   "fresh or reused inputs alike; a script doing the same outside pytest "
                   "compiled once, and so does this module on the CPU. Cause not found")
def test_gpu_symbolic_token_count_compiles_once():
    """With the token count symbolic the experts op stays one node (its kernels
    chosen per call), and one graph serves every count."""
    _needs_sm90()
    moe = _quantized_moe()
    counter = CompileCounterWithBackend(tmo.backend(experts="grouped_mm"))
    compiled = torch.compile(moe, backend=counter, fullgraph=True)
    inputs = [torch.randn(num_tokens, 1024, device="cuda", dtype=torch.bfloat16)
              for num_tokens in (5, 300)]
    # The reference compiled first: a second backend on the same module's code
    # would count as a recompilation of the first.
    expected = torch.compile(moe, backend=tmo.backend(experts="reference"), fullgraph=True)
    codes = []
    with torch.no_grad():
        refs = [expected(x_TH) for x_TH in inputs]
        for x_TH, ref_TH in zip(inputs, refs):
            torch._dynamo.mark_dynamic(x_TH, 0)
            out_TH, new_codes = run_and_get_code(compiled, x_TH)
            codes += new_codes
            assert relative_error(out_TH, ref_TH) < GPU_BOUND
    assert counter.frame_count == 1
    assert "moe_grouped_mm.experts_quant" in "\n".join(codes)
