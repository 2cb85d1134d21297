"""Quantized experts, the contract: the formats of `torch_moe_ops.quant`, the ops
``moe::experts_quant`` / ``moe::experts_rows_quant`` (generic and reference) against
an fp64 per-slot formula, their errors, and `MoE` holding quantized weights.

Legend: T tokens, H hidden size, I expert intermediate size, F = 2 * I, E experts,
K experts per token, R rows, N / C rows / columns of one expert matrix, M activation
rows, G scale groups of a row.

Bounds, each checked where stated:

- fp8 e4m3 (weights and activations), scale ``s`` of the value's group:
  ``|x - read back| <= |x| / 16 + s / 1024`` (half a step of 3 mantissa bits; half
  the smallest subnormal step, 2**-9, below the normal range), and the group's
  largest magnitude reads back as exactly ``448 * s``.
- mxfp4: each group's scale is ``2 ** e`` with ``e = floor(log2(amax)) - 2`` (OCP
  MX) and every value reads back as the e2m1 value nearest to ``x / 2 ** e``
  (ties to the smaller magnitude; past 6 it stays 6), times ``2 ** e``.
- The ops against the formula evaluated on the same dequantized weights and
  fp8-rounded activations: the unquantized experts' bounds per output dtype
  (`conftest.TOLERANCES`).
"""

from __future__ import annotations

import io
import math
import re

import pytest
import torch

import torch_moe_ops as tmo
from conftest import TOLERANCES, QuantInputs, assert_close_within, make_quant_inputs
from formulas import activation_formula
from torch_moe_ops import quant
from torch_moe_ops.config import QuantSpec
from torch_moe_ops.ops import op_overload

H, I, E, K = 64, 32, 4, 2
SIZES = {"hidden_size": H, "intermediate_size": I, "num_experts": E, "top_k": K}
SPECS = {
    "fp8_tensor": QuantSpec("fp8_tensor"),
    "fp8_tensor_w8a16": QuantSpec("fp8_tensor", "none"),
    "fp8_channel": QuantSpec("fp8_channel"),
    "fp8_block": QuantSpec("fp8_block", block_size=(32, 32)),
    "fp8_block_w8a16": QuantSpec("fp8_block", "none", (32, 16)),
    "mxfp4": QuantSpec("mxfp4"),
}
FP8_SPECS = [name for name, spec in SPECS.items() if spec.weights != "mxfp4"]
W8A8_SPECS = [name for name, spec in SPECS.items() if spec.activations != "none"]
ACTIVATIONS = ("silu", "gelu", "swiglu_oai")
# Generic (the CPU default backend) and the reference backend.
NAMESPACES = ("moe", "moe_reference")
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def exactly(message: str) -> str:
    """A `pytest.raises` pattern that matches ``message`` and nothing more."""
    return f"^{re.escape(message)}$"


def assert_close(actual: torch.Tensor, expected_fp64: torch.Tensor, dtype: torch.dtype) -> None:
    """``TOLERANCES[dtype]``, atol relative to the largest expected magnitude."""
    assert_close_within(TOLERANCES, actual, expected_fp64, dtype)


# The formula: every (token, slot) pair on its own, in fp64.


def quant_experts_formula(x_TH: torch.Tensor, topk_weights_TK: torch.Tensor,
                          topk_ids_TK: torch.Tensor, inputs: QuantInputs,
                          static=("silu", 1.702, 7.0)) -> torch.Tensor:
    """``moe::experts_quant`` one slot at a time, fp64 ``[T, H]``, with ``x_TH`` the
    tokens as the first GEMM sees them (already through the activation format)::

        for t, k: if (e := topk_ids[t, k]) >= 0:
            a = Q(act(x[t] @ W13[e].T + b13[e]))
            out[t] += topk_weights[t, k] * (a @ W2[e].T + b2[e])

    ``W13``, ``W2`` the weights read back (`QuantInputs.dequantized`), ``Q`` the
    activations' round trip through fp8 (`quant.round_trip_activations`)."""
    activation, alpha, limit = static
    w13_EFH, w2_EHI = (w.double() for w in inputs.dequantized())
    f = inputs.float_inputs
    out_TH = torch.zeros(x_TH.shape, dtype=torch.float64)
    for t, ids in enumerate(topk_ids_TK.tolist()):
        for k, e in enumerate(ids):
            if e < 0:
                continue
            h_1F = x_TH[t:t + 1].double() @ w13_EFH[e].T
            if f.b13_EF is not None:
                h_1F = h_1F + f.b13_EF[e].double()
            a_1I = activation_formula(h_1F[:, :I], h_1F[:, I:], activation, alpha, limit)
            a_1I = quant.round_trip_activations(a_1I, inputs.spec).double()
            y_1H = a_1I @ w2_EHI[e].T
            if f.b2_EH is not None:
                y_1H = y_1H + f.b2_EH[e].double()
            out_TH[t] += topk_weights_TK[t, k].double() * y_1H[0]
    return out_TH


def first_gemm_input(hidden_TH: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    return quant.round_trip_activations(hidden_TH, spec)


# The formats.


def _spread(shape, generator) -> torch.Tensor:
    """Random values whose rows span six decades, so every scale layout sees
    groups of very different magnitudes."""
    rows_NC = torch.randn(shape, generator=generator)
    decades = torch.randint(-3, 4, shape[:-1] + (1,), generator=generator).float()
    return rows_NC * 10.0 ** decades


def _expanded_fp8_scale(scale: torch.Tensor, spec: QuantSpec, shape) -> torch.Tensor:
    """Each value's scale, ``[E, N, C]``."""
    if spec.weights == "fp8_tensor":
        return scale[:, None, None].expand(shape)
    if spec.weights == "fp8_channel":
        return scale[:, :, None].expand(shape)
    rows, cols = spec.block_size
    return scale.repeat_interleave(rows, 1).repeat_interleave(cols, 2)


def _group_amax(t_ENC: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The largest magnitude of each group that shares a scale (the scale's shape)."""
    if spec.weights == "fp8_tensor":
        return t_ENC.abs().amax(dim=(1, 2))
    if spec.weights == "fp8_channel":
        return t_ENC.abs().amax(dim=2)
    (num_experts, rows, cols), (block_rows, block_cols) = t_ENC.shape, spec.block_size
    blocks = t_ENC.reshape(num_experts, rows // block_rows, block_rows, cols // block_cols,
                           block_cols)
    return blocks.abs().amax(dim=(2, 4))


@pytest.mark.parametrize("name", FP8_SPECS)
def test_fp8_weights_round_trip_within_half_a_step(name, generator):
    spec = SPECS[name]
    w_ENC = _spread((3, 64, 32), generator)
    q, scale = quant.quantize_weights(w_ENC, spec)
    back = quant.dequantize_weights(q, scale, spec)
    s_ENC = _expanded_fp8_scale(scale, spec, w_ENC.shape)
    assert (back - w_ENC).abs().le(w_ENC.abs() / 16 + s_ENC / 1024).all()
    # The scales are tight: each group's largest magnitude becomes 448.
    assert (_group_amax(q.float(), spec) == 448).all()
    torch.testing.assert_close(scale, _group_amax(w_ENC, spec) / 448, rtol=1e-7, atol=0)


@pytest.mark.parametrize("name, shape", [
    ("fp8_tensor", (2,)), ("fp8_channel", (2, 64)), ("fp8_block", (2, 2, 1)),
    ("fp8_block_w8a16", (2, 2, 2)), ("mxfp4", (2, 64, 1)),
])
def test_weight_and_scale_shapes_and_dtypes(name, shape, generator):
    spec = SPECS[name]
    w_ENC = torch.randn((2, 64, 32), generator=generator)  # N = 64, C = 32
    q, scale = quant.quantize_weights(w_ENC, spec)
    packed = spec.weights == "mxfp4"
    assert q.shape == ((2, 64, 16) if packed else (2, 64, 32))
    assert q.dtype == (torch.uint8 if packed else torch.float8_e4m3fn)
    assert (scale.shape, scale.dtype) == (shape, torch.uint8 if packed else torch.float32)
    assert (tuple(q.shape), tuple(scale.shape)) == (quant.weight_shape(spec, 2, 64, 32),
                                                    quant.scale_shape(spec, 2, 64, 32))


def test_fp8_values_and_scales_by_hand():
    w_ENC = torch.tensor([[[1.0, -2.0, 0.5, 4.0], [0.0, 0.0, 0.0, 0.0]]])
    q, scale = quant.quantize_weights(w_ENC, QuantSpec("fp8_channel"))
    # amax 4 -> scale 4 / 448: 1, -2, 0.5, 4 are 112, -224, 56, 448 (all exact in e4m3).
    assert torch.equal(q.float(), torch.tensor([[[112.0, -224.0, 56.0, 448.0], [0.0] * 4]]))
    assert torch.equal(scale, torch.tensor([[4.0, quant.MIN_SCALE]]) / 448)
    q, scale = quant.quantize_weights(w_ENC, QuantSpec("fp8_tensor"))
    assert torch.equal(q.float()[0, 0], torch.tensor([112.0, -224.0, 56.0, 448.0]))
    assert torch.equal(scale, torch.tensor([4.0]) / 448)
    q, scale = quant.quantize_weights(w_ENC, QuantSpec("fp8_block", block_size=(1, 2)))
    assert torch.equal(q.float()[0, 0], torch.tensor([224.0, -448.0, 56.0, 448.0]))
    assert torch.equal(scale, torch.tensor([[[2.0, 4.0], [quant.MIN_SCALE] * 2]]) / 448)
    q_MK, scale_M = quant.quantize_activations(w_ENC[0], QuantSpec("fp8_channel"))
    assert torch.equal(q_MK.float()[0], torch.tensor([112.0, -224.0, 56.0, 448.0]))
    assert torch.equal(scale_M, torch.tensor([4.0, quant.MIN_SCALE]) / 448)
    back = quant.dequantize_weights(*quant.quantize_weights(w_ENC, QuantSpec("fp8_channel")),
                                    QuantSpec("fp8_channel"))
    torch.testing.assert_close(back, w_ENC, rtol=1e-7, atol=0)


def _signed_e2m1(nibbles) -> list[float]:
    return [(-1.0 if n & 8 else 1.0) * E2M1[n & 7] for n in nibbles]


def test_mxfp4_packing_order_and_e8m0_scale_by_hand():
    # Group 0: every code but -0, scaled by 2**-3 (amax 6 * 2**-3 = 0.75, so
    # e = floor(log2(0.75)) - 2 = -3, stored as 127 - 3); group 1 is all zeros.
    nibbles = [1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15, 0, 7] * 2
    w_ENC = torch.tensor([[_signed_e2m1(nibbles) + [0.0] * 32]]) * 2.0 ** -3
    q, scale = quant.quantize_weights(w_ENC, QuantSpec("mxfp4"))
    assert torch.equal(scale, torch.tensor([[[124, 0]]], dtype=torch.uint8))
    # Element 2j in the low nibble, 2j + 1 in the high one: (0.5, -0.5) -> 0x91.
    expected = [n_even | (n_odd << 4) for n_even, n_odd in zip(nibbles[0::2], nibbles[1::2])]
    assert expected[:2] == [0x91, 0xA2]
    assert torch.equal(q, torch.tensor([[expected + [0] * 16]], dtype=torch.uint8))
    assert torch.equal(quant.dequantize_weights(q, scale, QuantSpec("mxfp4")), w_ENC)


def test_e8m0_scales_read_as_powers_of_two():
    scale_bytes = [0, 1, 126, 127, 128, 254]
    q = torch.full((1, len(scale_bytes), 16), 0x22, dtype=torch.uint8)  # every value 1.0
    scale = torch.tensor(scale_bytes, dtype=torch.uint8).reshape(1, -1, 1)
    back = quant.dequantize_weights(q, scale, QuantSpec("mxfp4"))
    expected = torch.tensor([2.0 ** (b - 127) for b in scale_bytes])
    assert torch.equal(back, expected[None, :, None].expand(1, -1, 32))


def test_mxfp4_round_trip_is_the_nearest_e2m1_value(generator):
    w_ENC = _spread((2, 16, 64), generator)
    q, scale = quant.quantize_weights(w_ENC, QuantSpec("mxfp4"))
    groups = w_ENC.reshape(2, 16, 2, 32)
    _mantissa, exponent = torch.frexp(groups.abs().amax(dim=3))  # amax = m * 2**x, m in [0.5, 1)
    assert torch.equal(scale.long(), exponent.long() - 1 - 2 + 127)
    step = torch.exp2(scale.float() - 127)[..., None]
    read_GC = quant.dequantize_weights(q, scale, QuantSpec("mxfp4")).reshape(groups.shape) / step
    scaled_GC = groups / step
    grid = torch.tensor([*E2M1, *(-v for v in E2M1)])
    assert torch.isin(read_GC, grid).all()
    nearest = (scaled_GC[..., None] - grid).abs().amin(dim=-1)
    assert ((read_GC - scaled_GC).abs() <= nearest).all()
    tie = (read_GC - scaled_GC).abs() == nearest
    # Of two equally near values, the smaller magnitude: no grid value as near is smaller.
    as_near = (scaled_GC[..., None] - grid).abs() == nearest[..., None]
    smallest = torch.where(as_near, grid.abs(), math.inf).amin(dim=-1)
    assert torch.equal(read_GC.abs()[tie], smallest[tie])


@pytest.mark.parametrize("name", sorted(SPECS))
def test_zeros_and_an_all_zero_row_read_back_as_zeros(name, generator):
    spec = SPECS[name]
    zeros = torch.zeros((2, 64, 32))
    q, scale = quant.quantize_weights(zeros, spec)
    assert scale.float().isfinite().all()
    assert torch.equal(quant.dequantize_weights(q, scale, spec), zeros)
    w_ENC = torch.randn((2, 64, 32), generator=generator)
    w_ENC[1, 5] = 0
    back = quant.dequantize_weights(*quant.quantize_weights(w_ENC, spec), spec)
    assert torch.equal(back[1, 5], torch.zeros(32))
    assert back.isfinite().all() and back[1, 4].abs().sum() > 0


@pytest.mark.parametrize("name", sorted(SPECS))
def test_non_finite_weights_read_back_as_nan(name, generator):
    """A NaN or an Inf (a corrupt checkpoint) turns every value of the group that
    shares its scale into NaN, never into finite numbers; mxfp4 marks the group
    with OCP MX's NaN scale byte 0xFF. Other groups read back as usual."""
    spec = SPECS[name]
    w_ENC = torch.randn((2, 64, 64), generator=generator)
    w_ENC[0, 3, 5], w_ENC[1, 40, 50], w_ENC[1, 7, 33] = math.nan, math.inf, -math.inf
    bad_ENC = w_ENC.isfinite().logical_not().float()
    q, scale = quant.quantize_weights(w_ENC, spec)
    if spec.weights == "mxfp4":
        bad_ENG = bad_ENC.reshape(2, 64, 2, 32).amax(dim=3)
        assert torch.equal(scale == 0xFF, bad_ENG > 0)
        expected_nan = bad_ENG.repeat_interleave(32, dim=2) > 0
    else:
        expected_nan = _expanded_fp8_scale(_group_amax(bad_ENC, spec), spec, w_ENC.shape) > 0
    back = quant.dequantize_weights(q, scale, spec)
    assert torch.equal(back.isnan(), expected_nan)
    clean_ENC = torch.where(expected_nan, 0.0, w_ENC)
    clean = quant.dequantize_weights(*quant.quantize_weights(clean_ENC, spec), spec)
    assert torch.equal(back[~expected_nan], clean[~expected_nan])


@pytest.mark.parametrize("name", W8A8_SPECS)
def test_activation_round_trip(name, generator):
    spec = SPECS[name]
    x_MK = _spread((6, 64), generator)
    x_MK[2] = 0
    q_MK, scale = quant.quantize_activations(x_MK, spec)
    groups = 64 // 32 if spec.activations == "fp8_group" else None
    assert scale.shape == ((6, groups) if groups else (6,)) and scale.dtype == torch.float32
    assert q_MK.shape == (6, 64) and q_MK.dtype == torch.float8_e4m3fn
    back = quant.round_trip_activations(x_MK, spec)
    assert torch.equal(back, quant.dequantize_activations(q_MK, scale, spec))
    s_MK = (scale.repeat_interleave(32, 1) if groups else scale[:, None]).expand(6, 64)
    assert (back - x_MK).abs().le(x_MK.abs() / 16 + s_MK / 1024).all()
    assert torch.equal(back[2], torch.zeros(64))
    empty_q, empty_scale = quant.quantize_activations(torch.zeros((0, 64)), spec)
    assert empty_q.shape == (0, 64) and empty_scale.shape[0] == 0


def test_weight_only_activations_stay_as_they_are(generator):
    x_MK = torch.randn((3, 64), generator=generator, dtype=torch.float64)
    back = quant.round_trip_activations(x_MK, SPECS["mxfp4"])
    assert back.dtype == torch.float32 and torch.equal(back, x_MK.float())


# The ops against the formula.


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("dtype, bias", [(torch.float32, False), (torch.bfloat16, True)],
                         ids=["fp32", "bf16_bias"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("name", sorted(SPECS))
def test_experts_quant_matches_formula(name, activation, dtype, bias, namespace, quant_inputs):
    inputs = quant_inputs(SPECS[name], **SIZES, num_tokens=7, dtype=dtype, bias=bias,
                          skip_fraction=0.25)
    static = (activation, 1.702, 7.0)
    out_TH = op_overload(namespace, "experts_quant")(*inputs.args(*static))
    f = inputs.float_inputs
    assert (out_TH.shape, out_TH.dtype) == ((7, H), dtype)
    assert (f.topk_ids_TK == -1).any()
    expected = quant_experts_formula(first_gemm_input(f.hidden_TH, inputs.spec),
                                     f.topk_weights_TK, f.topk_ids_TK, inputs, static)
    assert_close(out_TH, expected, dtype)


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("case", ["T0", "K1", "all_skipped"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_experts_quant_edge_cases(name, case, namespace, quant_inputs):
    sizes = {**SIZES, "bias": True, **{"T0": {"num_tokens": 0}, "K1": {"top_k": 1},
                                       "all_skipped": {"skip_fraction": 1.0}}[case]}
    inputs = quant_inputs(SPECS[name], **sizes)
    out_TH = op_overload(namespace, "experts_quant")(*inputs.args())
    f = inputs.float_inputs
    expected = quant_experts_formula(first_gemm_input(f.hidden_TH, inputs.spec),
                                     f.topk_weights_TK, f.topk_ids_TK, inputs)
    assert out_TH.shape == f.hidden_TH.shape
    assert_close(out_TH, expected, torch.float32)
    if case == "all_skipped":
        assert torch.equal(out_TH, torch.zeros_like(out_TH))


def _dispatch(inputs: QuantInputs):
    f = inputs.float_inputs
    return torch.ops.moe.dispatch(f.hidden_TH, f.topk_weights_TK, f.topk_ids_TK, E)


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("name", sorted(SPECS))
def test_rows_path_matches_formula(name, namespace, quant_inputs):
    inputs = quant_inputs(SPECS[name], **SIZES, num_tokens=7, bias=True, skip_fraction=0.25)
    x_RH, expert_R, weight_R, src_R, count_E, combine_map_TK = _dispatch(inputs)
    static = ("swiglu_oai", 1.702, 7.0)
    y_RH = op_overload(namespace, "experts_rows_quant")(x_RH, None, expert_R, count_E,
                                                        *inputs.weight_args(*static))
    out_TH = torch.ops.moe.combine(y_RH, weight_R, src_R, combine_map_TK)
    f = inputs.float_inputs
    expected = quant_experts_formula(first_gemm_input(f.hidden_TH, inputs.spec),
                                     f.topk_weights_TK, f.topk_ids_TK, inputs, static)
    assert_close(out_TH, expected, torch.float32)


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("name", sorted(SPECS))
def test_rows_skip_minus_one_rows(name, namespace, quant_inputs):
    inputs = quant_inputs(SPECS[name], **SIZES, num_tokens=6, bias=True)
    x_RH = inputs.float_inputs.hidden_TH.clone()
    expert_R = torch.tensor([0, 1, -1, 3, -1, 2], dtype=torch.int32)
    x_RH[expert_R == -1] = math.nan  # a skipped row's contents are never read
    y_RH = op_overload(namespace, "experts_rows_quant")(
        x_RH, None, expert_R, torch.ones(E, dtype=torch.int32), *inputs.weight_args())
    expected = quant_experts_formula(first_gemm_input(x_RH, inputs.spec), torch.ones((6, 1)),
                                     expert_R.unsqueeze(1), inputs)
    assert_close(y_RH, expected, torch.float32)
    assert torch.equal(y_RH[[2, 4]], torch.zeros(2, H))


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", W8A8_SPECS)
def test_prequantized_rows(name, out_dtype, namespace, quant_inputs):
    """Rows that arrive in fp8 with their scales (an fp8 dispatch) give what the
    same rows give unquantized: the op's own first round trip is that quantization."""
    inputs = quant_inputs(SPECS[name], **SIZES, num_tokens=7, bias=True, skip_fraction=0.25)
    x_RH, expert_R, _, _, count_E, _ = _dispatch(inputs)
    if out_dtype != torch.float32:
        inputs.float_inputs.b13_EF = inputs.float_inputs.b13_EF.to(out_dtype)
        inputs.float_inputs.b2_EH = inputs.float_inputs.b2_EH.to(out_dtype)
    x_q_RH, x_scale = quant.quantize_activations(x_RH, inputs.spec)
    rows_quant = op_overload(namespace, "experts_rows_quant")
    y_RH = rows_quant(x_q_RH, x_scale, expert_R, count_E, *inputs.weight_args(), out_dtype)
    assert (y_RH.shape, y_RH.dtype) == (x_RH.shape, out_dtype)
    expected = quant_experts_formula(quant.dequantize_activations(x_q_RH, x_scale, inputs.spec),
                                     torch.ones((x_RH.shape[0], 1)), expert_R.unsqueeze(1),
                                     inputs)
    assert_close(y_RH, expected, out_dtype)
    if out_dtype == torch.float32:
        unquantized = rows_quant(x_RH, None, expert_R, count_E, *inputs.weight_args())
        assert torch.equal(y_RH, unquantized)


# Errors: a ValueError naming the argument, what was received and what was expected.


def _small_inputs(name: str = "fp8_channel") -> QuantInputs:
    return make_quant_inputs(torch.Generator().manual_seed(0), SPECS[name], **SIZES,
                             num_tokens=3, bias=True)


def _with(inputs: QuantInputs, **replace) -> tuple:
    """``experts_quant`` arguments of ``inputs`` with the named ones replaced."""
    names = ("hidden", "topk_weights", "topk_ids", "w13", "w2", "w13_scale", "w2_scale", "b13",
             "b2", "weight_format", "activation_format", "block_size", "activation",
             "swiglu_alpha", "swiglu_limit")
    args = dict(zip(names, inputs.args()))
    assert set(replace) <= set(args)
    args.update(replace)
    return tuple(args.values())


def _bad_calls():
    channel = _small_inputs()
    block = _small_inputs("fp8_block")
    mxfp4 = _small_inputs("mxfp4")
    return {
        "scale_shape": (_with(channel, w13_scale=torch.ones(E, 2 * I + 1)),
                        ("w13_scale must have shape [4, 64] (fp8_channel scales of [E, 64, 64] "
                         "weights), got [4, 65]")),
        "scale_rank": (_with(channel, w2_scale=torch.ones(E)),
                       "w2_scale must be 2-D, got shape (4,)"),
        "block_scale_shape": (_with(block, w2_scale=torch.ones(E, 2, 2)),
                              ("w2_scale must have shape [4, 2, 1] (fp8_block scales of "
                               "[E, 64, 32] weights), got [4, 2, 2]")),
        "scale_dtype": (_with(channel, w13_scale=channel.w13_scale.bfloat16()),
                        "w13_scale must have dtype in (float32), got bfloat16"),
        "mxfp4_scale_dtype": (_with(mxfp4, w2_scale=mxfp4.w2_scale.float()),
                              "w2_scale must have dtype in (uint8), got float32"),
        "fp8_weights_as_mxfp4": (_with(channel, weight_format="mxfp4",
                                       activation_format="none"),
                                 "w13 must have dtype in (uint8), got float8_e4m3fn"),
        "mxfp4_bytes_as_fp8": (_with(mxfp4, weight_format="fp8_channel"),
                               "w13 must have dtype in (float8_e4m3fn), got uint8"),
        "float_weights": (_with(channel, w13=channel.float_inputs.w13_EFH),
                          "w13 must have dtype in (float8_e4m3fn), got float32"),
        "mxfp4_unpacked": (_with(mxfp4, w13=torch.zeros((E, 2 * I, H), dtype=torch.uint8)),
                           ("w13 must have shape [4, 64, 32] (mxfp4 weights of [E, 64, 64]), "
                            "got [4, 64, 64]")),
        "block_does_not_divide": (_with(block, block_size=[48, 48]),
                                  ("hidden_size must be a multiple of both block sizes (48, 48) "
                                   "(QuantSpec.block_size); hidden_size=64, intermediate_size=32, "
                                   "got 64")),
        "block_does_not_divide_I": (_with(block, block_size=[32, 64]),
                                    ("intermediate_size must be a multiple of both block sizes "
                                     "(32, 64) (QuantSpec.block_size); hidden_size=64, "
                                     "intermediate_size=32, got 32")),
        "activation_format_for_mxfp4": (_with(mxfp4, activation_format="fp8_token"),
                                        ("activation_format must be one of 'none' with "
                                         "weight_format='mxfp4', got 'fp8_token'")),
        "group_activations_for_channel": (_with(channel, activation_format="fp8_group"),
                                          ("activation_format must be one of 'fp8_token', 'none' "
                                           "with weight_format='fp8_channel', got 'fp8_group'")),
        "block_size_without_blocks": (_with(channel, block_size=[32, 32]),
                                      ("block_size must be [] unless weight_format='fp8_block', "
                                       "got [32, 32] with weight_format='fp8_channel'")),
        "blocks_without_block_size": (_with(block, block_size=[]),
                                      ("block_size must be [rows, columns] of one scale block "
                                       "with weight_format='fp8_block', got []")),
        "unknown_format": (_with(channel, weight_format="int4"),
                           ("weight_format must be one of 'fp8_tensor', 'fp8_channel', "
                            "'fp8_block', 'mxfp4', got 'int4'")),
        "bias_dtype": (_with(channel, hidden=channel.float_inputs.hidden_TH.bfloat16()),
                       "b13 must have dtype in (bfloat16), got float32"),
    }


BAD_CALLS = _bad_calls()


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_experts_quant_bad_input(case):
    args, message = BAD_CALLS[case]
    for namespace in NAMESPACES:
        with pytest.raises(ValueError, match=exactly(message)):
            op_overload(namespace, "experts_quant")(*args)


def _rows_args(inputs: QuantInputs, x_RH, x_scale, out_dtype=None) -> tuple:
    expert_R = torch.tensor([0, 1, -1], dtype=torch.int32)
    return (x_RH, x_scale, expert_R, torch.ones(E, dtype=torch.int32), *inputs.weight_args(),
            out_dtype)


def _bad_rows_calls():
    channel = _small_inputs()
    block = _small_inputs("fp8_block")
    weight_only = _small_inputs("fp8_block_w8a16")
    x_RH = channel.float_inputs.hidden_TH
    q_RH, scale_R = quant.quantize_activations(x_RH, channel.spec)
    q_group_RH, scale_RG = quant.quantize_activations(x_RH, block.spec)
    return {
        "scale_with_float_rows": (_rows_args(channel, x_RH, scale_R),
                                  ("x_scale and out_dtype must be None unless x_rows is "
                                   "float8_e4m3fn (rows quantized by dispatch), got x_rows of "
                                   "torch.float32 with x_scale=a tensor, out_dtype=None")),
        "fp8_rows_without_out_dtype": (_rows_args(channel, q_RH, scale_R),
                                       ("out_dtype must be one of (torch.float32, "
                                        "torch.float16, torch.bfloat16, torch.float64) with "
                                        "float8 x_rows, got None")),
        "fp8_rows_weight_only": (_rows_args(weight_only, q_group_RH, scale_RG, torch.float32),
                                 ("x_rows must not be quantized with activation_format='none' "
                                  "(weight-only fp8_block), got torch.float8_e4m3fn")),
        "token_scale_shape": (_rows_args(channel, q_RH, scale_RG, torch.float32),
                              "x_scale must be 1-D, got shape (3, 2)"),
        "group_scale_shape": (_rows_args(block, q_group_RH, scale_RG[:, :1], torch.float32),
                              ("x_scale must have shape [3, 2] (fp8_group scales of x_rows "
                               "[3, 64]), got [3, 1]")),
        "scale_dtype": (_rows_args(channel, q_RH, scale_R.double(), torch.float32),
                        "x_scale must have dtype in (float32), got float64"),
    }


BAD_ROWS_CALLS = _bad_rows_calls()


@pytest.mark.parametrize("case", sorted(BAD_ROWS_CALLS))
def test_experts_rows_quant_bad_input(case):
    args, message = BAD_ROWS_CALLS[case]
    for namespace in NAMESPACES:
        with pytest.raises(ValueError, match=exactly(message)):
            op_overload(namespace, "experts_rows_quant")(*args)


@pytest.mark.parametrize("fields, message", [
    ({"quant": QuantSpec("fp8_block", block_size=(32, 32)), "intermediate_size": 48},
     ("intermediate_size must be a multiple of both block sizes (32, 32) (QuantSpec.block_size); "
      "hidden_size=64, intermediate_size=48, got 48")),
    ({"quant": QuantSpec("fp8_block"), "hidden_size": 64},
     ("hidden_size must be a multiple of both block sizes (128, 128) (QuantSpec.block_size); "
      "hidden_size=64, intermediate_size=32, got 64")),
    ({"quant": QuantSpec("mxfp4"), "hidden_size": 48},
     ("hidden_size must be a multiple of 32 for mxfp4 weights (one scale per 32 columns); "
      "hidden_size=48, intermediate_size=32, got 48")),
    ({"quant": "fp8_block"}, "quant must be a QuantSpec or None, got 'fp8_block'"),
])
def test_config_rejects_bad_quant(fields, message):
    with pytest.raises(ValueError, match=exactly(message)):
        tmo.MoEConfig(**{**SIZES, **fields})


@pytest.mark.parametrize("kwargs, message", [
    ({"weights": "mxfp4", "activations": "fp8_token"},
     "QuantSpec.activations (with weights='mxfp4') must be one of 'none', got 'fp8_token'"),
    ({"weights": "fp8_tensor", "activations": "fp8_group"},
     ("QuantSpec.activations (with weights='fp8_tensor') must be one of 'fp8_token', 'none', "
      "got 'fp8_group'")),
    ({"weights": "fp8_channel", "block_size": (128, 128)},
     ("QuantSpec.block_size must be None unless weights='fp8_block' (got "
      "weights='fp8_channel'), got (128, 128)")),
    ({"weights": "fp8_block", "block_size": [128, 128]},
     ("QuantSpec.block_size must be a tuple of two positive ints (rows, columns of one scale "
      "block), e.g. (128, 128), got [128, 128]")),
    ({"weights": "nvfp4"},
     ("QuantSpec.weights must be one of 'fp8_tensor', 'fp8_channel', 'fp8_block', 'mxfp4', "
      "got 'nvfp4'")),
])
def test_quant_spec_rejects_bad_specs(kwargs, message):
    with pytest.raises(ValueError, match=exactly(message)):
        QuantSpec(**kwargs)


def test_quant_spec_defaults():
    assert QuantSpec("fp8_block") == QuantSpec("fp8_block", "fp8_group", (128, 128))
    assert QuantSpec("fp8_channel").activations == "fp8_token"
    assert QuantSpec("mxfp4").activations == "none"
    assert QuantSpec("fp8_block", block_size=(32, 16)).name == "fp8_block32x16+fp8_group"


NO_GRADIENT = ("moe::{op} has no gradient: quantized experts serve inference. Train on "
               "unquantized weights (MoEConfig.quant=None), or run the layer under "
               "torch.no_grad()")


@pytest.mark.parametrize("op_name", ["experts_quant", "experts_rows_quant"])
def test_asking_for_a_gradient_raises(op_name, quant_inputs):
    inputs = quant_inputs(SPECS["fp8_block"], **SIZES, bias=True)
    f = inputs.float_inputs
    hidden_TH = f.hidden_TH.clone().requires_grad_()
    if op_name == "experts_quant":
        out = torch.ops.moe.experts_quant(hidden_TH, *inputs.args()[1:])
    else:
        expert_R = f.topk_ids_TK[:, 0].contiguous()
        out = torch.ops.moe.experts_rows_quant(hidden_TH, None, expert_R,
                                               torch.ones(E, dtype=torch.int32),
                                               *inputs.weight_args())
    with pytest.raises(RuntimeError, match=exactly(NO_GRADIENT.format(op=op_name))):
        out.sum().backward()


def test_module_gradient_raises_and_no_grad_runs():
    moe = tmo.MoE(tmo.MoEConfig(**SIZES, quant=SPECS["fp8_channel"]))
    x_TH = torch.randn(3, H)
    message = exactly(NO_GRADIENT.format(op="experts_quant"))
    with pytest.raises(RuntimeError, match=message):
        moe(x_TH).sum().backward()
    # Compiling needs no torch.no_grad() (the router's weights require grad): the
    # compiled backward raises when it runs.
    compiled = torch.compile(moe, backend=tmo.backend(experts="reference", inner="aot_eager"),
                             fullgraph=True)
    torch.testing.assert_close(compiled(x_TH), moe(x_TH))
    with pytest.raises(RuntimeError, match=message):
        compiled(x_TH).sum().backward()
    with torch.no_grad():
        assert moe(x_TH).isfinite().all()


# MoE holding quantized weights.


def _config(name: str, **fields) -> tmo.MoEConfig:
    spec = SPECS[name]
    activation = "swiglu_oai" if spec.weights == "mxfp4" else "silu"
    return tmo.MoEConfig(**SIZES, quant=spec, activation=activation, expert_bias=True,
                         **fields)


def _module(name: str, seed: int = 0, **fields) -> tmo.MoE:
    torch.manual_seed(seed)
    moe = tmo.MoE(_config(name, **fields))
    with torch.no_grad():  # biases start at zero: make them count
        moe.b13.normal_(0, 0.5)
        moe.b2.normal_(0, 0.5)
    return moe


def _bits(moe: tmo.MoE) -> dict:
    return {name: getattr(moe, name).clone() for name in ("w13", "w2", "w13_scale", "w2_scale")}


def _assert_same_bits(moe: tmo.MoE, bits: dict) -> None:
    for name, expected in bits.items():
        tensor = getattr(moe, name)
        assert tensor.dtype == expected.dtype, name
        assert torch.equal(tensor.cpu().view(torch.uint8), expected.view(torch.uint8)), name


@pytest.mark.parametrize("name", sorted(SPECS))
def test_module_holds_stored_formats(name):
    spec = SPECS[name]
    moe = _module(name)
    stored = {"w13": (2 * I, H), "w2": (H, I)}
    for weight, (rows, cols) in stored.items():
        assert weight in dict(moe.named_buffers())
        assert getattr(moe, weight).dtype == quant.weight_dtype(spec)
        assert tuple(getattr(moe, weight).shape) == quant.weight_shape(spec, E, rows, cols)
        assert tuple(getattr(moe, weight + "_scale").shape) == quant.scale_shape(spec, E, rows,
                                                                                 cols)
    assert {n for n, _ in moe.named_parameters()} == {"gate.weight", "b13", "b2"}
    assert f"quant={spec.name}" in repr(moe)


@pytest.mark.parametrize("name", ["fp8_block_w8a16", "mxfp4"])
def test_weight_only_module_equals_float_module_on_dequantized_weights(name):
    """W8A16 / W4A16: the block computes what the float block computes on the
    weights its stored ones read back as."""
    moe = _module(name)
    cfg = moe.cfg
    float_moe = tmo.MoE(tmo.MoEConfig(**{**SIZES, "activation": cfg.activation,
                                         "expert_bias": True}))
    state = moe.state_dict()
    for weight in ("w13", "w2"):
        state[weight] = quant.dequantize_weights(state[weight], state.pop(weight + "_scale"),
                                                 cfg.quant)
    float_moe.load_state_dict(state)
    x_TH = torch.randn(5, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(moe(x_TH), float_moe(x_TH), rtol=1e-5, atol=1e-5)


def _compare_compiled(name: str, inner: str) -> None:
    moe = _module(name)
    compiled = torch.compile(moe, fullgraph=True,
                             backend=tmo.backend(experts="reference", inner=inner))
    x_TH = torch.randn(7, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x_TH), moe(x_TH), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_module_eager_equals_compiled_aot_eager(name, fresh_dynamo):
    _compare_compiled(name, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp8_block", "mxfp4"])
def test_module_eager_equals_compiled_inductor(name, fresh_dynamo):
    _compare_compiled(name, "inductor")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_module_casts_and_moves_keep_the_stored_bits(name):
    moe = _module(name)
    bits = _bits(moe)
    x_TH = torch.randn(4, H, generator=torch.Generator().manual_seed(4))
    moe.to(torch.bfloat16)
    _assert_same_bits(moe, bits)
    assert moe.b13.dtype == moe.gate.weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert moe(x_TH.bfloat16()).dtype == torch.bfloat16
    moe.half()
    _assert_same_bits(moe, bits)
    assert moe.b2.dtype == torch.float16
    moe.to("meta")
    assert {n: getattr(moe, n).device.type for n in bits} == dict.fromkeys(bits, "meta")
    assert {n: getattr(moe, n).dtype for n in bits} == {n: b.dtype for n, b in bits.items()}
    moe.to_empty(device="cpu")
    moe.reset_parameters()
    assert {n: getattr(moe, n).dtype for n in bits} == {n: b.dtype for n, b in bits.items()}
    for weight in ("w13", "w2"):
        read_back = quant.dequantize_weights(getattr(moe, weight), getattr(moe, weight + "_scale"),
                                             moe.cfg.quant)
        assert read_back.isfinite().all() and read_back.abs().sum() > 0


@pytest.mark.parametrize("name", sorted(SPECS))
def test_state_dict_round_trip(name):
    moe = _module(name)
    buffer = io.BytesIO()
    torch.save(moe.state_dict(), buffer)
    buffer.seek(0)
    other = _module(name, seed=1)
    other.load_state_dict(torch.load(buffer, weights_only=True))
    _assert_same_bits(other, _bits(moe))
    x_TH = torch.randn(4, H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(other(x_TH), moe(x_TH))


class FakeGroup:
    """Enough of a 2-rank ProcessGroup to build a sharded block (forward needs a real one)."""

    group_name = "fake"

    def __init__(self, rank: int):
        self._rank = rank

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return self._rank


@pytest.mark.parametrize("name", sorted(SPECS))
def test_expert_parallel_keeps_this_ranks_weights_and_scales(name):
    full = _module(name)
    state = full.state_dict()
    for rank in (0, 1):
        sharded = tmo.MoE(_config(name, ep_size=2, max_tokens_per_rank=4),
                          ep_group=FakeGroup(rank))
        sharded.load_full_weights(state)
        local = slice(rank * E // 2, (rank + 1) * E // 2)
        for tensor in ("w13", "w2", "w13_scale", "w2_scale", "b13", "b2"):
            ours, expected = getattr(sharded, tensor), state[tensor][local]
            assert (ours.shape, ours.dtype) == (expected.shape, expected.dtype), tensor
            assert torch.equal(ours.view(torch.uint8), expected.view(torch.uint8)), tensor
