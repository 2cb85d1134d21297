"""``moe::experts_masked`` (the masked format, `torch_moe_ops.ops.masked`): the reference
against an fp64 formula per row, every backend that reads the format against the
reference, forward and gradient, with garbage (NaN) in the rows past the counts, an
expert with no rows and NaN weights, an expert whose block is full, and bad input; on
quantized weights (``experts_masked_quant``, blocks in float or in fp8 with their scales)
against the reference's ``experts_rows_quant`` on the rows below the counts.

The triton and grouped_mm backends run here under the Triton interpreter (the `triton`
marker; fp32 and fp16, the interpreter mishandles bf16), grouped_mm's GEMMs through
torch._grouped_mm's CPU kernels.

Legend: E experts, C rows per expert, H hidden size, I expert intermediate size, F = 2 * I.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import formulas
from torch_moe_ops import quant
from torch_moe_ops.backends.common.kernels.rows import masked_valid
from torch_moe_ops.config import QuantSpec

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
E, C, H, I = 4, 21, 16, 8
# Rows of each expert's block that carry a token: some, none, all, one.
COUNTS = (5, 0, C, 1)
# The expert with no rows gets NaN weights: nothing may read them.
EMPTY = COUNTS.index(0)
STATIC = {"silu": ("silu", 1.702, 7.0), "gelu": ("gelu", 1.702, 7.0),
          "swiglu_oai": ("swiglu_oai", 1.702, 0.5)}
# The Triton interpreter mishandles bf16: bf16 runs on a GPU.
DTYPES = (torch.float32, torch.float16) + ((torch.bfloat16,) if DEVICE.type == "cuda" else ())
BACKENDS = [pytest.param(namespace, dtype, marks=pytest.mark.triton,
                         id=f"{namespace}-{str(dtype).removeprefix('torch.')}")
            for namespace in ("moe_triton", "moe_grouped_mm") for dtype in DTYPES]
TOLERANCES = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
GRAD_TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def masked_inputs(dtype, bias=True, seed=0):
    """``(x_ECH, count_E, w13, w2, b13, b2)``: NaN in every row past a count and in the
    weights of the expert without rows."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=generator) * scale).to(DEVICE, dtype)

    count_E = torch.tensor(COUNTS, dtype=torch.int32, device=DEVICE)
    x_ECH = randn(E, C, H).masked_fill(~masked_valid(count_E, C), math.nan)
    weights = [randn(E, 2 * I, H, scale=H ** -0.5), randn(E, H, I, scale=I ** -0.5),
               randn(E, 2 * I, scale=0.5) if bias else None,
               randn(E, H, scale=0.5) if bias else None]
    for w in weights:
        if w is not None:
            w[EMPTY] = math.nan
    return x_ECH, count_E, *weights


def valid_rows(t_ECH: torch.Tensor, count_E: torch.Tensor) -> torch.Tensor:
    """The rows of ``t_ECH`` below the counts, ``[sum(count), H]``."""
    return t_ECH[masked_valid(count_E, t_ECH.shape[1]).squeeze(2)]


def assert_scaled_close(actual, expected, tol):
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("act", sorted(STATIC))
@pytest.mark.parametrize("bias", [True, False])
def test_reference_is_the_per_row_formula(act, bias):
    x_ECH, count_E, w13, w2, b13, b2 = masked_inputs(torch.float32, bias)
    y_ECH = torch.ops.moe_reference.experts_masked(x_ECH, count_E, w13, w2, b13, b2,
                                                   *STATIC[act])
    assert y_ECH.shape == x_ECH.shape and y_ECH.is_contiguous()
    # Rows past the counts: zeros on the reference (the contract leaves them unspecified).
    assert (y_ECH[~masked_valid(count_E, C).expand_as(y_ECH)] == 0).all()
    for e, count in enumerate(COUNTS):
        expected = formulas.gated_mlp_formula(
            x_ECH[e, :count], w13[e], w2[e], None if b13 is None else b13[e],
            None if b2 is None else b2[e], *STATIC[act])
        assert_scaled_close(y_ECH[e, :count], expected, 1e-5)


@pytest.mark.parametrize("namespace, dtype", BACKENDS)
@pytest.mark.parametrize("act", sorted(STATIC))
def test_backends_match_the_reference(namespace, dtype, act):
    inputs = masked_inputs(dtype)
    count_E = inputs[1]
    y_ECH = getattr(torch.ops, namespace).experts_masked(*inputs, *STATIC[act])
    ref_ECH = torch.ops.moe_reference.experts_masked(*inputs, *STATIC[act])
    assert y_ECH.shape == ref_ECH.shape and y_ECH.dtype == dtype and y_ECH.is_contiguous()
    ours = valid_rows(y_ECH, count_E)
    assert torch.isfinite(ours).all()
    assert_scaled_close(ours, valid_rows(ref_ECH, count_E), TOLERANCES[dtype])


@pytest.mark.parametrize("namespace, dtype", [
    pytest.param("moe_reference", torch.float32, id="reference-float32"), *BACKENDS])
@pytest.mark.parametrize("act", sorted(STATIC))
def test_gradient_matches_autograd_of_the_per_row_formula(namespace, dtype, act):
    """``experts_masked_backward`` (the op's gradient, through autograd) against fp64
    autograd of the formula on the rows below the counts; rows past them and the expert
    without rows get exactly zero gradient, whatever (NaN) they hold."""
    x_ECH, count_E, *weights = masked_inputs(dtype)
    leaves = [t.clone().requires_grad_() for t in (x_ECH, *weights)]
    y_ECH = getattr(torch.ops, namespace).experts_masked(leaves[0], count_E, *leaves[1:],
                                                         *STATIC[act])
    grad_ECH = torch.randn(y_ECH.shape, generator=torch.Generator().manual_seed(1)).to(
        DEVICE, dtype)
    # The gradient of an output row past a count is not read either.
    grad_ECH = grad_ECH.masked_fill(~masked_valid(count_E, C), math.nan)
    y_ECH.backward(grad_ECH)

    refs = [t.detach().double().nan_to_num(nan=0.0).requires_grad_() for t in (x_ECH, *weights)]
    for e, count in enumerate(COUNTS):
        if count:
            y_NH = formulas.gated_mlp_formula(refs[0][e, :count], *(w[e] for w in refs[1:]),
                                              *STATIC[act])
            y_NH.backward(grad_ECH[e, :count].double())
    for leaf, ref in zip(leaves, refs):
        assert leaf.grad.dtype == dtype and torch.isfinite(leaf.grad).all()
        assert_scaled_close(leaf.grad, ref.grad, GRAD_TOLERANCES[dtype])
    assert (leaves[0].grad[~masked_valid(count_E, C).expand_as(x_ECH)] == 0).all()
    assert all((leaf.grad[EMPTY] == 0).all() for leaf in leaves[1:])


def test_the_generic_op_runs_a_backend_that_reads_the_format():
    """On the CPU the default experts backend (``cpu``) does not read masked blocks: the
    generic op runs the best one that does."""
    inputs = masked_inputs(torch.float32)
    torch.testing.assert_close(torch.ops.moe.experts_masked(*inputs, *STATIC["silu"]),
                               torch.ops.moe_reference.experts_masked(*inputs, *STATIC["silu"]),
                               equal_nan=True)


def test_compiles_whole_with_fullgraph():
    inputs = masked_inputs(torch.float32)

    def layer(x_ECH, count_E, w13, w2, b13, b2):
        return torch.ops.moe_reference.experts_masked(x_ECH, count_E, w13, w2, b13, b2,
                                                      *STATIC["gelu"]) * 2

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    count_E = inputs[1]
    torch.testing.assert_close(valid_rows(compiled(*inputs), count_E),
                               valid_rows(layer(*inputs), count_E))


@pytest.mark.parametrize("change, error", [
    (lambda a: (a[0][0], *a[1:]), "x_masked must be 3-D, got shape (21, 16)"),
    (lambda a: (a[0], a[1].long(), *a[2:]),
     "count_experts must have dtype in (int32), got int64"),
    (lambda a: (a[0], a[1][:3], *a[2:]),
     "count_experts.shape[0] must equal w13.shape[0] (E) (4), got shape (3,)"),
    (lambda a: (a[0][:3], *a[1:]),
     "x_masked.shape[0] must equal w13.shape[0] (E) (4), got shape (3, 21, 16)"),
    (lambda a: (a[0], a[1] + C, *a[2:]),
     "count_experts must hold row counts in [0, 21] (x_masked.shape[1], C), got 42"),
    (lambda a: (a[0], a[1] - 2, *a[2:]),
     "count_experts must hold row counts in [0, 21] (x_masked.shape[1], C), got -2"),
], ids=["x_2d", "count_int64", "count_size", "x_experts", "count_past_rows", "count_negative"])
def test_bad_input_is_a_clear_error(change, error):
    args = change(masked_inputs(torch.float32))
    for op in (torch.ops.moe.experts_masked, torch.ops.moe_reference.experts_masked):
        with pytest.raises(ValueError, match=re.escape(error)):
            op(*args, *STATIC["silu"])


@pytest.mark.triton
def test_triton_blocks_past_each_count_have_no_expert():
    """The triton backend's block table: blocks of 16 rows in place, rows past a count the
    sentinel E * C, a block that starts at or past its count no expert (its programs
    return at once)."""
    from torch_moe_ops.backends.triton.masked import masked_blocks

    count_E = torch.tensor(COUNTS, dtype=torch.int32, device=DEVICE)
    sorted_row_ids_P, block_expert_B, num_padded_rows_1 = masked_blocks(count_E, C, 16)
    assert block_expert_B.tolist() == [0, -1, -1, -1, 2, 2, 3, -1]
    assert num_padded_rows_1.tolist() == [E * 2 * 16]
    rows_EX = sorted_row_ids_P.view(E, 2 * 16)
    sentinel = E * C
    for e, count in enumerate(COUNTS):
        assert rows_EX[e, :count].tolist() == list(range(e * C, e * C + count))
        assert (rows_EX[e, count:] == sentinel).all()


def test_a_backend_that_does_not_read_masked_blocks_is_refused_by_name():
    from torch_moe_ops.backends.registry import REGISTRY, Problem
    from torch_moe_ops.config import BackendSpec

    with pytest.raises(ValueError, match=re.escape(
            "experts backend 'cpu' does not define experts_masked; backends that do: ")):
        REGISTRY.choose_experts(BackendSpec(experts="cpu"), Problem(torch.float32),
                                torch.device("cpu"), "experts_masked")


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("namespace", ["moe_reference", "moe_triton", "moe_grouped_mm"])
def test_captures_in_a_cuda_graph_and_replays_new_counts(namespace):
    """No host sync: one capture, replayed with other counts and rows, gives each replay's
    rows below its counts."""
    x_ECH, count_E, *weights = masked_inputs(torch.bfloat16)
    op = getattr(torch.ops, namespace).experts_masked
    static = [x_ECH.clone(), count_E.clone()]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            op(*static, *weights, *STATIC["silu"])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_ECH = op(*static, *weights, *STATIC["silu"])
    # The expert without rows keeps none: its weights are NaN.
    for seed, counts in ((1, (C, 0, 3, 7)), (2, (0, 0, 1, C))):
        new_count_E = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
        new_x_ECH = masked_inputs(torch.bfloat16, seed=seed)[0].nan_to_num(nan=0.0).masked_fill(
            ~masked_valid(new_count_E, C), math.nan)
        static[0].copy_(new_x_ECH)
        static[1].copy_(new_count_E)
        graph.replay()
        expected = torch.ops.moe_reference.experts_masked(static[0], new_count_E, *weights,
                                                          *STATIC["silu"])
        assert_scaled_close(valid_rows(y_ECH, new_count_E), valid_rows(expected, new_count_E),
                            TOLERANCES[torch.bfloat16])


# Quantized weights: (spec, whether the blocks arrive in fp8 with their scales).
QUANT_CASES = {
    "fp8_block_prequantized": (QuantSpec("fp8_block"), True),
    "fp8_block": (QuantSpec("fp8_block"), False),
    "fp8_channel_prequantized": (QuantSpec("fp8_channel"), True),
    "fp8_block_w8a16": (QuantSpec("fp8_block", "none", (32, 32)), False),
    "mxfp4": (QuantSpec("mxfp4"), False),
}
QUANT_H = QUANT_I = 128


def quant_masked_args(case: str):
    """``experts_masked_quant``'s arguments (NaN past the counts; fp8 bytes and scales of
    NaN there where the blocks arrive quantized) and the reference's rows: the rows below
    the counts with their experts, for ``experts_rows_quant``."""
    spec, prequantized = QUANT_CASES[case]
    generator = torch.Generator().manual_seed(3)
    w13 = torch.randn((E, 2 * QUANT_I, QUANT_H), generator=generator) * QUANT_H ** -0.5
    w2 = torch.randn((E, QUANT_H, QUANT_I), generator=generator) * QUANT_I ** -0.5
    w13, w13_scale = quant.quantize_weights(w13, spec)
    w2, w2_scale = quant.quantize_weights(w2, spec)
    weights = [t.to(DEVICE) for t in (w13, w2, w13_scale, w2_scale)]
    count_E = torch.tensor(COUNTS, dtype=torch.int32, device=DEVICE)
    valid_EC1 = masked_valid(count_E, C)
    x_ECH = torch.randn((E, C, QUANT_H), generator=generator).to(DEVICE)
    x_scale, out_dtype = None, None
    if prequantized:
        x_LH, x_scale_L = quant.quantize_activations(x_ECH.flatten(0, 1), spec)
        x_ECH, out_dtype = x_LH.view(x_ECH.shape), torch.float32
        x_scale = x_scale_L.view(E, C, *x_scale_L.shape[1:])
        x_scale = x_scale.masked_fill(~valid_EC1.view(E, C, *([1] * (x_scale.dim() - 2))),
                                      math.nan)
        # NaN bytes of e4m3 (0x7f) past the counts.
        x_ECH = x_ECH.view(torch.uint8).masked_fill(~valid_EC1, 0x7F).view(x_ECH.dtype)
    else:
        x_ECH = x_ECH.masked_fill(~valid_EC1, math.nan)
    static = (spec.weights, spec.activations, spec.block_list, *STATIC["silu"])
    args = (x_ECH, x_scale, count_E, *weights, None, None, *static, out_dtype)
    expert_EC = torch.arange(E, device=DEVICE).unsqueeze(1).expand(E, C)
    valid_EC = valid_EC1[..., 0]
    rows = (x_ECH.view(torch.uint8)[valid_EC].view(x_ECH.dtype),
            None if x_scale is None else x_scale[valid_EC],
            expert_EC[valid_EC].int(), count_E, *weights, None, None, *static, out_dtype)
    return args, rows


@pytest.mark.parametrize("namespace", [
    "moe_reference", pytest.param("moe_triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize("case", sorted(QUANT_CASES))
def test_quantized_blocks_match_the_rows_reference(namespace, case):
    """``experts_masked_quant`` on the rows below the counts against the reference's
    ``experts_rows_quant`` on those rows alone, whatever the rows past the counts hold."""
    args, rows = quant_masked_args(case)
    y_ECH = getattr(torch.ops, namespace).experts_masked_quant(*args)
    assert y_ECH.shape == args[0].shape and y_ECH.dtype == torch.float32
    expected = torch.ops.moe_reference.experts_rows_quant(*rows)
    ours = valid_rows(y_ECH, args[2])
    assert torch.isfinite(ours).all()
    assert_scaled_close(ours, expected, 1e-5)
