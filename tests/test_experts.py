"""``moe::experts`` (and its gradient) and the rows path dispatch -> experts_rows ->
combine, against a per-token fp64 loop.

Legend: T tokens, H hidden size, I expert intermediate size, E experts,
K experts per token, F = 2*I, R rows.
"""

from __future__ import annotations

import pytest
import torch

from formulas import experts_formula

ACTIVATIONS = ("silu", "gelu", "swiglu_oai")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# swiglu_oai runs with hidden scaled up so that many pre-activations pass the clamp
# limit, once with the default (alpha, limit) and once with other values.
ACTIVATION_CASES = {
    "silu": ("silu", 1.702, 7.0, 1.0),
    "gelu": ("gelu", 1.702, 7.0, 1.0),
    "swiglu_oai": ("swiglu_oai", 1.702, 7.0, 12.0),
    "swiglu_oai_alpha1_limit0.5": ("swiglu_oai", 1.0, 0.5, 1.0),
}


def pre_activations(inputs):
    """Every (gate, up) pair the experts see: for asserting the clamp is exercised."""
    h_TEF = torch.einsum("th,efh->tef", inputs.hidden_TH.double(), inputs.w13_EFH.double())
    if inputs.b13_EF is not None:
        h_TEF = h_TEF + inputs.b13_EF.double()
    return h_TEF.chunk(2, dim=-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("case", sorted(ACTIVATION_CASES))
def test_experts_matches_formula(case, bias, dtype, expert_inputs, assert_close_for_dtype):
    activation, alpha, limit, hidden_scale = ACTIVATION_CASES[case]
    inputs = expert_inputs(dtype=dtype, bias=bias, hidden_scale=hidden_scale,
                           skip_fraction=0.2)
    if activation == "swiglu_oai":
        gate_TEI, up_TEI = pre_activations(inputs)
        assert (gate_TEI > limit).any() and (up_TEI > limit).any() and (up_TEI < -limit).any()
    out_TH = torch.ops.moe.experts(*inputs.args(activation, alpha, limit))
    expected_TH = experts_formula(*inputs.args(activation, alpha, limit))
    assert (out_TH.shape, out_TH.dtype) == (inputs.hidden_TH.shape, dtype)
    assert_close_for_dtype(out_TH, expected_TH, dtype)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=str)
def test_experts_ids_dtypes(ids_dtype, expert_inputs, assert_close_for_dtype):
    inputs = expert_inputs(ids_dtype=ids_dtype, skip_fraction=0.2)
    assert inputs.topk_ids_TK.dtype == ids_dtype
    out_TH = torch.ops.moe.experts(*inputs.args())
    assert_close_for_dtype(out_TH, experts_formula(*inputs.args()), torch.float32)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=str)
def test_skipped_ids_contribute_nothing(ids_dtype, expert_inputs):
    # A -1 slot with a large weight and biased experts must add exactly nothing.
    inputs = expert_inputs(bias=True, ids_dtype=ids_dtype)
    inputs.topk_weights_TK[:, 1] = 1e3
    inputs.topk_ids_TK[:, 1] = -1
    out_TH = torch.ops.moe.experts(*inputs.args())
    inputs.topk_weights_TK = inputs.topk_weights_TK[:, :1].clone()
    inputs.topk_ids_TK = inputs.topk_ids_TK[:, :1].clone()
    torch.testing.assert_close(out_TH, torch.ops.moe.experts(*inputs.args()))


def test_all_ids_skipped_gives_zeros(expert_inputs):
    inputs = expert_inputs(bias=True)
    inputs.topk_ids_TK.fill_(-1)
    out_TH = torch.ops.moe.experts(*inputs.args())
    assert torch.equal(out_TH, torch.zeros_like(inputs.hidden_TH))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_experts_zero_tokens(dtype, expert_inputs):
    inputs = expert_inputs(num_tokens=0, dtype=dtype, bias=True)
    for t in (inputs.hidden_TH, inputs.w13_EFH, inputs.w2_EHI, inputs.b13_EF, inputs.b2_EH,
              inputs.topk_weights_TK):
        t.requires_grad_(True)
    out_TH = torch.ops.moe.experts(*inputs.args())
    assert (out_TH.shape, out_TH.dtype) == ((0, 8), dtype)
    out_TH.sum().backward()
    assert inputs.hidden_TH.grad.shape == (0, 8)
    assert torch.equal(inputs.w13_EFH.grad, torch.zeros_like(inputs.w13_EFH))
    assert torch.equal(inputs.b2_EH.grad, torch.zeros_like(inputs.b2_EH))


GRAD_NAMES = ("hidden_TH", "topk_weights_TK", "w13_EFH", "w2_EHI", "b13_EF", "b2_EH")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("case", sorted(ACTIVATION_CASES))
def test_experts_gradients_match_autograd_of_formula(case, bias, dtype, expert_inputs,
                                                     generator, assert_grad_close_for_dtype):
    activation, alpha, limit, hidden_scale = ACTIVATION_CASES[case]
    inputs = expert_inputs(dtype=dtype, bias=bias, hidden_scale=hidden_scale,
                           skip_fraction=0.2)
    names = [n for n in GRAD_NAMES if getattr(inputs, n) is not None]
    upstream_TH = torch.randn(inputs.hidden_TH.shape, generator=generator, dtype=torch.float64)

    leaves = {n: getattr(inputs, n).detach().requires_grad_(True) for n in names}
    op_inputs = dict(vars(inputs), **leaves)
    out_TH = torch.ops.moe.experts(*type(inputs)(**op_inputs).args(activation, alpha, limit))
    (out_TH.double() * upstream_TH).sum().backward()

    leaves64 = {n: getattr(inputs, n).detach().double().requires_grad_(True) for n in names}
    formula_inputs = dict(vars(inputs), **leaves64)
    expected_TH = experts_formula(*type(inputs)(**formula_inputs).args(activation, alpha, limit))
    (expected_TH * upstream_TH).sum().backward()

    for name in names:
        grad, expected = leaves[name].grad, leaves64[name].grad
        assert grad.dtype == leaves[name].dtype, name
        assert grad.shape == leaves[name].shape, name
        assert_grad_close_for_dtype(grad, expected, dtype)


def test_experts_gradient_of_skipped_slot_weight_is_zero(expert_inputs):
    inputs = expert_inputs(bias=True)
    inputs.topk_ids_TK[0, 0] = -1
    inputs.topk_weights_TK.requires_grad_(True)
    torch.ops.moe.experts(*inputs.args()).sum().backward()
    assert inputs.topk_weights_TK.grad[0, 0] == 0
    assert (inputs.topk_weights_TK.grad[1:] != 0).all()


# The rows path: dispatch -> experts_rows -> combine.


def run_rows_path(inputs, activation="silu", alpha=1.702, limit=7.0):
    num_experts = inputs.w13_EFH.shape[0]
    x_RH, expert_R, weight_R, src_R, count_E, row_of_slot_TK = torch.ops.moe.dispatch(
        inputs.hidden_TH, inputs.topk_weights_TK, inputs.topk_ids_TK, num_experts)
    y_RH = torch.ops.moe.experts_rows(x_RH, expert_R, count_E, inputs.w13_EFH, inputs.w2_EHI,
                                      inputs.b13_EF, inputs.b2_EH, activation, alpha, limit)
    return torch.ops.moe.combine(y_RH, weight_R, src_R, row_of_slot_TK)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_rows_path_equals_experts(activation, bias, dtype, expert_inputs):
    inputs = expert_inputs(dtype=dtype, bias=bias, skip_fraction=0.25, num_tokens=9)
    out_TH = run_rows_path(inputs, activation)
    expected_TH = torch.ops.moe.experts(*inputs.args(activation))
    assert (out_TH.shape, out_TH.dtype) == (expected_TH.shape, dtype)
    # Both accumulate in fp32; they differ only by one rounding to dtype per row.
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}[dtype]
    torch.testing.assert_close(out_TH, expected_TH, rtol=tol, atol=tol)


@pytest.mark.parametrize("num_tokens", [0, 1, 7])
def test_rows_path_token_counts(num_tokens, expert_inputs):
    inputs = expert_inputs(num_tokens=num_tokens, bias=True, skip_fraction=0.3)
    torch.testing.assert_close(run_rows_path(inputs), torch.ops.moe.experts(*inputs.args()))


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("skip_fraction", [0.0, 0.3, 1.0])
def test_dispatch_rows_grouped_by_expert(skip_fraction, ids_dtype, expert_inputs):
    num_experts = 5
    inputs = expert_inputs(num_tokens=11, num_experts=num_experts, top_k=3,
                           skip_fraction=skip_fraction, ids_dtype=ids_dtype)
    hidden_TH, weights_TK, ids_TK = inputs.hidden_TH, inputs.topk_weights_TK, inputs.topk_ids_TK
    x_RH, expert_R, weight_R, src_R, count_E, row_of_slot_TK = torch.ops.moe.dispatch(
        hidden_TH, weights_TK, ids_TK, num_experts)

    num_rows, top_k = ids_TK.numel(), ids_TK.shape[1]
    assert x_RH.shape == (num_rows, hidden_TH.shape[1])
    assert [t.shape for t in (expert_R, weight_R, src_R)] == [(num_rows,)] * 3
    assert row_of_slot_TK.shape == ids_TK.shape
    assert [t.dtype for t in (expert_R, weight_R, src_R, count_E, row_of_slot_TK)] == \
        [torch.int32, torch.float32, torch.int32, torch.int32, torch.int32]

    valid_ids = ids_TK[ids_TK >= 0].long()
    expected_count_E = torch.bincount(valid_ids, minlength=num_experts).int()
    torch.testing.assert_close(count_E, expected_count_E, rtol=0, atol=0)

    num_valid = int(count_E.sum())
    offset = 0
    for e, count in enumerate(count_E.tolist()):  # rows of expert e, ascending
        assert (expert_R[offset:offset + count] == e).all()
        src_rows = src_R[offset:offset + count]
        assert (src_rows[1:] >= src_rows[:-1]).all()  # stable: slot order kept
        offset += count

    skipped = slice(num_valid, num_rows)  # -1 rows last
    assert (expert_R[skipped] == -1).all()
    assert (src_R[skipped] == -1).all()
    assert (weight_R[skipped] == 0).all()
    assert (x_RH[skipped] == 0).all()

    # Each valid (slot, expert, weight) appears exactly once, with its token's row,
    # and the combine map points each slot at its row.
    got = sorted(zip(src_R[:num_valid].tolist(), expert_R[:num_valid].tolist(),
                     weight_R[:num_valid].tolist()))
    expected = sorted((t * top_k + k, int(ids_TK[t, k]), weights_TK[t, k].item())
                      for t in range(ids_TK.shape[0]) for k in range(top_k)
                      if ids_TK[t, k] >= 0)
    assert got == expected
    assert torch.equal(x_RH[:num_valid], hidden_TH[src_R[:num_valid].long() // top_k])
    expected_row_of_slot = torch.full((num_rows,), -1, dtype=torch.int32)
    expected_row_of_slot[src_R[:num_valid].long()] = torch.arange(num_valid, dtype=torch.int32)
    assert torch.equal(row_of_slot_TK.reshape(-1), expected_row_of_slot)


def test_combine_adds_weighted_rows_into_tokens():
    y_RH = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    weight_R = torch.tensor([0.5, 2.0, 1.0, 9.0])
    # T = 3 tokens, K = 2: each row's slot (t * K + k) and each slot's row.
    src_R = torch.tensor([4, 0, 5, -1], dtype=torch.int32)
    row_of_slot_TK = torch.tensor([[1, -1], [-1, -1], [0, 2]], dtype=torch.int32)
    out_TH = torch.ops.moe.combine(y_RH, weight_R, src_R, row_of_slot_TK)
    expected_TH = torch.tensor([[6.0, 8.0], [0.0, 0.0], [5.5, 7.0]])
    assert torch.equal(out_TH, expected_TH)


def test_experts_rows_skips_minus_one_rows(expert_inputs):
    inputs = expert_inputs(bias=True)
    expert_R = torch.tensor([0, 1, -1, 3, -1, 2], dtype=torch.int32)
    count_E = torch.ones(4, dtype=torch.int32)
    y_RH = torch.ops.moe.experts_rows(inputs.hidden_TH, expert_R, count_E, inputs.w13_EFH,
                                      inputs.w2_EHI, inputs.b13_EF, inputs.b2_EH, "silu",
                                      1.702, 7.0)
    ones_R1 = torch.ones((6, 1))
    expected_RH = experts_formula(inputs.hidden_TH, ones_R1, expert_R.unsqueeze(1),
                                  inputs.w13_EFH, inputs.w2_EHI, inputs.b13_EF, inputs.b2_EH,
                                  "silu", 1.702, 7.0)
    torch.testing.assert_close(y_RH.double(), expected_RH, rtol=1e-5, atol=1e-5)
    assert torch.equal(y_RH[[2, 4]], torch.zeros(2, 8))
