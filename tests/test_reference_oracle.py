"""The reference backend computes the per-slot formula exactly: an expert that no
slot chose, a skipped slot (id -1) and a skipped row contribute nothing, whatever
the weights or rows they would read hold (NaN or Inf: pruned, not loaded yet,
uninitialised capacity rows), in the forward and in every gradient.

Legend: T tokens, H hidden size, I expert intermediate size, F = 2*I, E experts,
K experts per token, R rows.
"""

from __future__ import annotations

import math

import pytest
import torch

T, H, I, E, K = 6, 8, 4, 4, 2
UNCHOSEN = E - 1  # no slot ever picks this expert
POISONS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
EXPERT_TENSORS = ("w13", "w2", "b13", "b2")
ACTIVATIONS = ("silu", "gelu", "swiglu_oai")
REFERENCE = torch.ops.moe_reference


def make_inputs(generator: torch.Generator) -> dict:
    """Inputs of ``moe::experts`` (with biases) whose ids never name `UNCHOSEN`, with
    two skipped slots that hold a NaN weight (a padding slot's weight is garbage)."""
    ids_TK = torch.stack([torch.randperm(UNCHOSEN, generator=generator)[:K] for _ in range(T)])
    ids_TK[1, 0] = ids_TK[4, 1] = -1
    weights_TK = torch.rand((T, K), generator=generator)
    weights_TK[1, 0] = weights_TK[4, 1] = math.nan
    return {
        "hidden": torch.randn((T, H), generator=generator),
        "topk_weights": weights_TK,
        "topk_ids": ids_TK.to(torch.int32),
        "w13": torch.randn((E, 2 * I, H), generator=generator) * H ** -0.5,
        "w2": torch.randn((E, H, I), generator=generator) * I ** -0.5,
        "b13": torch.randn((E, 2 * I), generator=generator) * 0.5,
        "b2": torch.randn((E, H), generator=generator) * 0.5,
    }


def poisoned(inputs: dict, name: str, value: float) -> dict:
    """``inputs`` with the unchosen expert's ``name`` tensor filled with ``value``."""
    out = dict(inputs)
    out[name] = inputs[name].clone()
    out[name][UNCHOSEN] = value
    return out


def args(inputs: dict, activation: str) -> tuple:
    return (inputs["hidden"], inputs["topk_weights"], inputs["topk_ids"], inputs["w13"],
            inputs["w2"], inputs["b13"], inputs["b2"], activation, 1.702, 7.0)


def test_inputs_leave_one_expert_unchosen_and_skip_slots(generator):
    ids_TK = make_inputs(generator)["topk_ids"]
    assert not (ids_TK == UNCHOSEN).any()
    assert (ids_TK == -1).sum() == 2


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("poison", sorted(POISONS))
@pytest.mark.parametrize("name", EXPERT_TENSORS)
def test_unchosen_expert_does_not_reach_the_output(name, poison, activation, generator):
    clean = make_inputs(generator)
    expected_TH = REFERENCE.experts(*args(clean, activation))
    out_TH = REFERENCE.experts(*args(poisoned(clean, name, POISONS[poison]), activation))
    assert expected_TH.isfinite().all()
    torch.testing.assert_close(out_TH, expected_TH, rtol=0, atol=0)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("poison", sorted(POISONS))
@pytest.mark.parametrize("name", EXPERT_TENSORS)
def test_unchosen_expert_does_not_reach_any_gradient(name, poison, activation, generator):
    clean = make_inputs(generator)
    grad_out_TH = torch.randn((T, H), generator=generator)
    expected = REFERENCE.experts_backward(grad_out_TH, *args(clean, activation))
    grads = REFERENCE.experts_backward(
        grad_out_TH, *args(poisoned(clean, name, POISONS[poison]), activation))
    grad_names = ("hidden", "topk_weights", "w13", "w2", "b13", "b2")
    for grad_name, grad, expected_grad in zip(grad_names, grads, expected):
        assert grad.isfinite().all(), grad_name
        if grad_name in EXPERT_TENSORS:
            # Exactly zero for the expert nobody chose; the others as without the poison.
            assert (grad[UNCHOSEN] == 0).all(), grad_name
            grad, expected_grad = grad[:UNCHOSEN], expected_grad[:UNCHOSEN]
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0, msg=grad_name)


@pytest.mark.parametrize("name", EXPERT_TENSORS)
def test_autograd_through_the_op_ignores_the_unchosen_expert(name, generator):
    # The same, as a user sees it: loss.backward() through the reference op.
    leaves = {key: t.requires_grad_(key != "topk_ids")
              for key, t in poisoned(make_inputs(generator), name, math.nan).items()}
    out_TH = REFERENCE.experts(*args(leaves, "silu"))
    out_TH.square().sum().backward()
    assert out_TH.isfinite().all()
    for key in ("hidden", "topk_weights", *EXPERT_TENSORS):
        assert leaves[key].grad.isfinite().all(), key
    assert (leaves["w13"].grad[UNCHOSEN] == 0).all()


@pytest.mark.parametrize("poison", sorted(POISONS))
def test_skipped_rows_give_zero_whatever_they_hold(poison, generator):
    # Rows past the counted ones of a capacity buffer are garbage: expert -1, any content.
    inputs = make_inputs(generator)
    x_RH = torch.randn((5, H), generator=generator)
    expert_R = torch.tensor([0, 0, 2, -1, -1], dtype=torch.int32)
    count_E = torch.tensor([2, 0, 1, 0], dtype=torch.int32)
    weights = (inputs["w13"], inputs["w2"], inputs["b13"], inputs["b2"], "silu", 1.702, 7.0)
    expected_RH = REFERENCE.experts_rows(x_RH, expert_R, count_E, *weights)

    x_RH[3:] = POISONS[poison]
    w13_EFH = poisoned(inputs, "w13", POISONS[poison])["w13"]
    y_RH = REFERENCE.experts_rows(x_RH, expert_R, count_E, w13_EFH, *weights[1:])
    assert (y_RH[3:] == 0).all()
    torch.testing.assert_close(y_RH, expected_RH, rtol=0, atol=0)
