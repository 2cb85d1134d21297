"""float64 end to end: the ops take it, the reference backend computes in it (so
``torch.autograd.gradcheck`` works on the real ops), and the backends that cannot
run it say why.

Legend: T tokens, H hidden size, I expert intermediate size, F = 2*I, E experts,
K experts per token.
"""

from __future__ import annotations

import re

import pytest
import torch

import formulas
import torch_moe_ops as tmo
from torch_moe_ops.backends.registry import REGISTRY

T, H, I, E, K = 4, 6, 3, 3, 2
ACTIVATIONS = ("silu", "gelu", "swiglu_oai")
EXPERTS_OPS = {"generic": torch.ops.moe.experts, "reference": torch.ops.moe_reference.experts}


def fp64_leaves(generator: torch.Generator, bias: bool) -> dict:
    """fp64 inputs of ``moe::experts`` that require grad; one slot is skipped."""
    def randn(*shape, scale=1.0):
        t = torch.randn(shape, generator=generator, dtype=torch.float64) * scale
        return t.requires_grad_(True)

    ids_TK = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(T)])
    ids_TK[2, 1] = -1
    return {
        "hidden": randn(T, H),
        "topk_weights": torch.rand((T, K), generator=generator,
                                   dtype=torch.float64).requires_grad_(True),
        "topk_ids": ids_TK.to(torch.int32),
        "w13": randn(E, 2 * I, H, scale=H ** -0.5),
        "w2": randn(E, H, I, scale=I ** -0.5),
        "b13": randn(E, 2 * I, scale=0.5) if bias else None,
        "b2": randn(E, H, scale=0.5) if bias else None,
    }


def ordered(leaves: dict) -> tuple:
    return tuple(leaves[name] for name in
                 ("hidden", "topk_weights", "topk_ids", "w13", "w2", "b13", "b2"))


@pytest.mark.parametrize("op", sorted(EXPERTS_OPS))
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_experts_fp64_matches_the_formula_to_fp64_precision(op, activation, generator):
    leaves = fp64_leaves(generator, bias=True)
    out_TH = EXPERTS_OPS[op](*ordered(leaves), activation, 1.702, 0.5)
    assert out_TH.dtype == torch.float64
    expected_TH = formulas.experts_formula(
        *(t.detach() if t is not None else None for t in ordered(leaves)), activation, 1.702,
        0.5)
    torch.testing.assert_close(out_TH, expected_TH, rtol=1e-12, atol=1e-12)


def test_dispatch_combine_keep_fp64_precision(generator):
    leaves = fp64_leaves(generator, bias=False)
    hidden_TH, weights_TK, ids_TK = (leaves[n].detach() for n in
                                     ("hidden", "topk_weights", "topk_ids"))
    x_RH, _, weight_R, src_R, _, combine_map_TK = torch.ops.moe.dispatch(hidden_TH, weights_TK,
                                                                      ids_TK, E)
    out_TH = torch.ops.moe.combine(x_RH, weight_R, src_R, combine_map_TK)
    assert out_TH.dtype == torch.float64
    # Each token's rows are its own hidden row: combine returns it times its kept weights.
    # The routing weights travel in fp32 by contract; the sum itself must stay fp64.
    kept_T1 = torch.where(ids_TK >= 0, weights_TK.float().double(), 0).sum(1, keepdim=True)
    expected_TH = hidden_TH * kept_T1
    torch.testing.assert_close(out_TH, expected_TH, rtol=1e-12, atol=1e-12)


def test_dispatch_gradcheck(generator):
    """Rows of skipped slots (id -1) hold zeros, as their zero gradient says:
    the forward and the backward agree on every row. (The routing weights travel
    in fp32 by contract, too coarse for a finite difference: only the rows here.)"""
    leaves = fp64_leaves(generator, bias=False)
    weights_TK, ids_TK = leaves["topk_weights"].detach(), leaves["topk_ids"]

    def rows(hidden):
        return torch.ops.moe.dispatch(hidden, weights_TK, ids_TK, E)[0]

    assert torch.autograd.gradcheck(rows, [leaves["hidden"]])


@pytest.mark.parametrize("op", sorted(EXPERTS_OPS))
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_experts_gradcheck(op, activation, bias, generator):
    leaves = fp64_leaves(generator, bias)
    # A limit the activations cross, away from any input: the clamp is exercised
    # without a finite difference straddling its kink.
    limit = 0.7
    h_TEF = torch.einsum("th,efh->tef", leaves["hidden"], leaves["w13"]).detach()
    if bias:
        h_TEF = h_TEF + leaves["b13"].detach()
    assert (h_TEF.abs() > limit).any() and ((h_TEF.abs() - limit).abs() > 1e-4).all()

    def run(hidden, topk_weights, w13, w2, *biases):
        b13, b2 = biases if bias else (None, None)
        return EXPERTS_OPS[op](hidden, topk_weights, leaves["topk_ids"], w13, w2, b13, b2,
                               activation, 1.702, limit)

    inputs = [leaves[n] for n in ("hidden", "topk_weights", "w13", "w2")]
    inputs += [leaves["b13"], leaves["b2"]] if bias else []
    assert torch.autograd.gradcheck(run, inputs)


def test_route_fp64_logits_gradient(generator):
    # Router weights stay fp32 by contract (their gradient arrives in fp32, hence the
    # fp32 bound); the logits' gradient comes back in fp64.
    logits_TE = torch.randn((8, 8), generator=generator, dtype=torch.float64)
    logits_TE.requires_grad_(True)
    upstream_TE = torch.randn((8, 8), generator=generator, dtype=torch.float64)
    weights_TK, ids_TK = torch.ops.moe.route(logits_TE, None, 3, "softmax", False, 1, 1, 2.0)
    assert weights_TK.dtype == torch.float32
    (weights_TK.double() * upstream_TE.gather(1, ids_TK.long())).sum().backward()

    logits64_TE = logits_TE.detach().clone().requires_grad_(True)
    expected_TK = torch.softmax(logits64_TE, -1).gather(1, ids_TK.long()) * 2.0
    (expected_TK * upstream_TE.gather(1, ids_TK.long())).sum().backward()
    assert logits_TE.grad.dtype == torch.float64
    torch.testing.assert_close(logits_TE.grad, logits64_TE.grad, rtol=1e-5, atol=1e-6)


def test_moe_module_runs_in_fp64(generator):
    cfg = tmo.MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K,
                        shared_expert_intermediate_size=4)
    moe = tmo.MoE(cfg, dtype=torch.float64)
    x_TH = torch.randn((T, H), generator=generator, dtype=torch.float64, requires_grad=True)
    y_TH = moe(x_TH)
    y_TH.sum().backward()
    assert y_TH.dtype == x_TH.grad.dtype == moe.w13.grad.dtype == torch.float64


def test_backends_that_cannot_run_fp64_say_why():
    table = REGISTRY.status(torch.device("cpu"), torch.float64)
    experts = {status.name: status for status in table if status.kind == "experts"}
    assert experts["reference"].available
    for status in experts.values():
        assert status.available or status.reason, status.name


@pytest.mark.triton
@pytest.mark.parametrize("op", ["experts", "experts_rows"])
def test_triton_backend_rejects_fp64_called_directly(op, generator):
    # Its kernels do not compute in fp64 (they gave NaN): a clear error, not a wrong answer.
    leaves = fp64_leaves(generator, bias=False)
    hidden, weights, ids, w13, w2, _, _ = (t.detach() if t is not None else None
                                           for t in ordered(leaves))
    static = (None, None, "silu", 1.702, 7.0)
    name = "hidden" if op == "experts" else "x_rows"
    args = ((hidden, weights, ids, w13, w2, *static) if op == "experts" else
            (hidden, ids[:, 0].contiguous(), torch.zeros(E, dtype=torch.int32), w13, w2,
             *static))
    expected = (f"{name} must have dtype in (float32, float16, bfloat16) on the triton "
                "experts backend, got float64")
    with pytest.raises(ValueError, match=re.escape(expected)):
        getattr(torch.ops.moe_triton, op)(*args)


def test_opcheck_experts_fp64(generator):
    leaves = fp64_leaves(generator, bias=True)
    args = (*ordered(leaves), "swiglu_oai", 1.702, 0.7)
    for namespace in ("moe", "moe_reference"):
        torch.library.opcheck(getattr(torch.ops, namespace).experts.default, args)
    grad_out_TH = torch.randn((T, H), generator=generator, dtype=torch.float64)
    detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(torch.ops.moe.experts_backward.default, (grad_out_TH, *detached))


@pytest.mark.parametrize("scoring", ["softmax", "topk_softmax", "sigmoid"])
def test_opcheck_route_fp64_groups(scoring, generator):
    logits_TE = torch.randn((5, 8), generator=generator, dtype=torch.float64)
    args = (logits_TE.requires_grad_(True), None, 3, scoring, True, 4, 2, 1.5)
    for namespace in ("moe", "moe_reference"):
        torch.library.opcheck(getattr(torch.ops, namespace).route.default, args)
